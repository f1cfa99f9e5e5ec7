//! Detokenization: per-token pieces, llama.cpp's whole-sequence decode, and
//! an incremental decoder that never splits a UTF-8 character.

use crate::unicode::unicode_to_byte;
use crate::vocab::attr;
use crate::{Model, Tokenizer};

/// Text of a byte-level BPE token back to raw bytes; chars outside GPT-2's
/// byte map (none in a well-formed vocabulary) are kept as their UTF-8.
fn byte_level_decode(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match unicode_to_byte(c) {
            Some(b) => out.push(b),
            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    out
}

impl Tokenizer {
    /// The bytes token `id` prints as, with control tokens rendered as their text.
    pub(crate) fn render_piece(&self, id: u32) -> Vec<u8> {
        let text = &self.vocab.texts[id as usize];
        let a = self.vocab.attrs[id as usize];
        if a & (attr::UNKNOWN | attr::CONTROL | attr::USER_DEFINED) != 0 {
            text.as_bytes().to_vec()
        } else if a & attr::NORMAL != 0 {
            match self.model {
                Model::Bpe(_) => byte_level_decode(text),
                Model::Spm | Model::Wpm(_) => text.replace('\u{2581}', " ").into_bytes(),
            }
        } else if a & attr::BYTE != 0 {
            // "<0xNN>"
            match text.get(3..5).and_then(|h| u8::from_str_radix(h, 16).ok()) {
                Some(b) => vec![b],
                None => text.as_bytes().to_vec(),
            }
        } else {
            // Unused and undefined tokens print as nothing.
            Vec::new()
        }
    }

    /// Raw bytes of one token as printed: SentencePiece's U+2581 becomes a
    /// space, `<0xNN>` its byte, byte-level BPE chars their bytes. Control and
    /// unknown tokens (and ids outside the vocabulary) give nothing.
    pub fn token_to_piece(&self, id: u32) -> Vec<u8> {
        self.piece(id, false).to_vec()
    }

    /// Like [`Tokenizer::token_to_piece`], borrowing; `render_special` prints
    /// control tokens as their text.
    pub fn piece(&self, id: u32, render_special: bool) -> &[u8] {
        match self.pieces.get(id as usize) {
            Some(_) if !render_special && self.is_control(id) => &[],
            Some(p) => p,
            None => &[],
        }
    }

    /// Text of `ids` (lossy where the bytes are not UTF-8), as llama.cpp's
    /// `llama_detokenize(remove_special = false, unparse_special = false)`.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.detokenize(ids, false, false)
    }

    /// llama.cpp's detokenizer. With the SentencePiece space prefix the first
    /// token's leading space is dropped, unless a removed BOS came first.
    /// `remove_special` drops a leading BOS / trailing EOS the model adds;
    /// `unparse_special` prints control tokens. BPE vocabularies with
    /// llama.cpp's `clean_spaces` get its clean-up (" ?" -> "?", " 's" -> "'s", ...).
    pub fn detokenize(&self, mut ids: &[u32], remove_special: bool, unparse_special: bool) -> String {
        let mut remove_space = self.add_space_prefix;
        if remove_special && self.add_bos && ids.first().is_some_and(|&id| Some(id) == self.special.bos) {
            remove_space = false;
            ids = &ids[1..];
        }
        if remove_special && self.add_eos && ids.last().is_some_and(|&id| Some(id) == self.special.eos) {
            ids = &ids[..ids.len() - 1];
        }
        let mut bytes = Vec::new();
        for &id in ids {
            let piece = self.piece(id, unparse_special);
            let piece = match piece.split_first() {
                Some((b' ', rest)) if remove_space => rest,
                _ => piece,
            };
            remove_space = false;
            bytes.extend_from_slice(piece);
        }
        if self.clean_spaces {
            bytes = clean_up_spaces(&bytes);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// llama.cpp's `clean_spaces` passes, in order: drop the space before
/// ?!., ; collapse " ' " to "'"; drop the space before 's 'm 're 've.
fn clean_up_spaces(text: &[u8]) -> Vec<u8> {
    let Some(&first) = text.first() else { return Vec::new() };
    let mut out = vec![first];
    for i in 1..text.len() {
        if text[i - 1] == b' ' && matches!(text[i], b'?' | b'!' | b'.' | b',') {
            out.pop();
        }
        out.push(text[i]);
    }

    let mut t = out;
    let mut out = vec![t[0]];
    let mut i = 1;
    while i < t.len() {
        let x = t[i];
        if x == b'\'' && i + 1 < t.len() && t[i - 1] == b' ' && t[i + 1] == b' ' {
            out.pop();
            // The dropped space must not count as the "space before" of the next char.
            t[i + 1] = 0;
            out.push(x);
            i += 2;
            continue;
        }
        out.push(x);
        i += 1;
    }

    let t = out;
    let mut out = vec![t[0]];
    for i in 1..t.len() {
        if t[i - 1] == b' ' && t[i] == b'\'' && i + 1 < t.len() {
            let next2 = (t[i + 1], t.get(i + 2).copied());
            if matches!(next2, (b's' | b'm', _) | (b'r', Some(b'e')) | (b'v', Some(b'e'))) {
                out.pop();
            }
        }
        out.push(t[i]);
    }
    out
}

/// Incremental detokenizer for streaming output: yields only complete UTF-8
/// characters, holding back a multi-byte sequence until its last byte arrives.
/// Pieces are concatenated as printed (no leading-space removal or clean-up),
/// as llama.cpp streams them.
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    bytes: Utf8Assembler,
    render_special: bool,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tok: &'a Tokenizer) -> Self {
        StreamDecoder { tok, bytes: Utf8Assembler::default(), render_special: false }
    }

    /// A decoder that prints control tokens as their text.
    pub fn with_special(tok: &'a Tokenizer) -> Self {
        StreamDecoder { render_special: true, ..StreamDecoder::new(tok) }
    }

    /// Adds one token; returns the text completed by it (possibly empty).
    /// Bytes that can never form a character are replaced by U+FFFD.
    pub fn push(&mut self, id: u32) -> String {
        self.bytes.push(self.tok.piece(id, self.render_special))
    }

    /// Flushes held-back bytes (lossily: an unfinished sequence becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        self.bytes.finish()
    }
}

/// Joins byte pieces into text that never ends inside a UTF-8 character: what a token stream
/// decoder needs when it does not hold the tokenizer (a server's per-request state).
#[derive(Debug, Default)]
pub struct Utf8Assembler {
    pending: Vec<u8>,
}

impl Utf8Assembler {
    /// Adds bytes; returns the whole characters completed (bytes that can never form one as U+FFFD).
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).expect("validated prefix"));
                    match e.error_len() {
                        // An incomplete sequence at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// What is left at the end (an unfinished character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::clean_up_spaces;

    #[test]
    fn characters_split_over_pieces_come_out_whole() {
        let mut a = super::Utf8Assembler::default();
        let euro = "€".as_bytes();
        assert_eq!(a.push(&euro[..1]), "");
        assert_eq!(a.push(&euro[1..2]), "");
        assert_eq!(a.push(&[euro[2], b'a']), "€a");
        assert_eq!(a.push(&[0xff, b'b']), "\u{FFFD}b");
        assert_eq!(a.push(&euro[..2]), "");
        assert_eq!(a.finish(), "\u{FFFD}");
    }

    fn clean(s: &str) -> String {
        String::from_utf8(clean_up_spaces(s.as_bytes())).unwrap()
    }

    #[test]
    fn clean_up_matches_llama_cpp_rules() {
        assert_eq!(clean("Hello , world !"), "Hello, world!");
        assert_eq!(clean("a ' b"), "a'b");
        assert_eq!(clean("he 's I 'm we 're you 've"), "he's I'm we're you've");
        // " 't", " 'd", " 'll" keep their space; so does upper case.
        assert_eq!(clean("don 't I 'd we 'll 'S"), "don 't I 'd we 'll 'S");
        assert_eq!(clean(" ?"), "?");
        assert_eq!(clean(""), "");
    }
}
