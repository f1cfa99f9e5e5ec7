//! WordPiece (BERT) tokenization as llama.cpp's WPM tokenizer: normalize,
//! split on whitespace and punctuation, then greedy longest-match per word.
//! Vocabularies converted by llama.cpp mark word starts with U+2581 instead of
//! marking continuations with "##".

use crate::unicode::{simple_lowercase, CharClasses};
use crate::vocab::Vocab;

pub(crate) struct Wpm {
    pub lowercase: bool,
    pub strip_accents: bool,
}

/// CJK ideograph blocks BERT isolates as single-char words.
fn is_chinese_char(c: char) -> bool {
    matches!(c as u32,
        0x4E00..=0x9FFF | 0x3400..=0x4DBF | 0x20000..=0x2A6DF | 0x2A700..=0x2B73F | 0x2B740..=0x2B81F
        // 0x2B920 (not 0x2B820) as in the Hugging Face implementation llama.cpp follows.
        | 0x2B920..=0x2CEAF | 0xF900..=0xFAFF | 0x2F800..=0x2FA1F)
}

/// The first char of `c`'s canonical decomposition: llama.cpp's NFD table maps
/// each code point to its base alone (the dropped parts are combining marks,
/// which accent stripping removes anyway).
fn nfd_base(c: char) -> char {
    let mut base = None;
    unicode_normalization::char::decompose_canonical(c, |d| {
        base.get_or_insert(d);
    });
    base.unwrap_or(c)
}

impl Wpm {
    fn preprocess(&self, text: &str) -> Vec<String> {
        let classes = CharClasses::get();
        let mut words = vec![String::new()];
        for c in text.chars() {
            let c = if self.strip_accents { nfd_base(c) } else { c };
            if c.is_whitespace() {
                if !words.last().expect("never empty").is_empty() {
                    words.push(String::new());
                }
                continue;
            }
            if c == '\0' || c == '\u{FFFD}' || classes.is_control(c) || (self.strip_accents && classes.is_mark(c)) {
                continue;
            }
            let out = if self.lowercase { simple_lowercase(c) } else { c };
            if classes.is_punctuation(c) || (c.is_ascii() && classes.is_symbol(c)) || is_chinese_char(c) {
                if !words.last().expect("never empty").is_empty() {
                    words.push(String::new());
                }
                words.last_mut().expect("never empty").push(out);
                words.push(String::new());
            } else {
                words.last_mut().expect("never empty").push(out);
            }
        }
        words.retain(|w| !w.is_empty());
        words
    }

    pub(crate) fn tokenize(&self, vocab: &Vocab, unk: Option<u32>, text: &str, out: &mut Vec<u32>) {
        for word in self.preprocess(text) {
            let word = format!("\u{2581}{word}");
            let n = word.len();
            let start_len = out.len();
            let mut i = 0;
            while i < n {
                // Longest vocabulary entry starting at byte i.
                let longest =
                    (i + 1..=n.min(i + vocab.max_token_len)).rev().filter(|&j| word.is_char_boundary(j)).find_map(|j| vocab.id(&word[i..j]).map(|id| (id, j)));
                match longest {
                    Some((id, j)) => {
                        out.push(id);
                        i = j;
                    }
                    None => {
                        // One unmatched position discards the whole word.
                        out.truncate(start_len);
                        break;
                    }
                }
            }
            if out.len() == start_len {
                out.extend(unk);
            }
        }
    }
}
