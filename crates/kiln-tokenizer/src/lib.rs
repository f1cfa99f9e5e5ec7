//! Tokenizers built from GGUF metadata alone, reproducing llama.cpp's
//! tokenization: SentencePiece-style (`llama`), byte-level BPE (`gpt2`, with
//! the pre-tokenizer named by `tokenizer.ggml.pre`) and WordPiece (`bert`).
//! Also chat-template rendering and UTF-8-safe streaming detokenization.

mod bpe;
pub mod chat;
mod decode;
mod error;
mod pretok;
mod spec;
mod spm;
mod symbols;
mod unicode;
mod vocab;
mod wpm;

use std::fmt;

pub use chat::{builtin_template, render_chat_template, ChatInputs, ChatMessage, ChatTemplate, BUILTIN_TEMPLATES, CHATML_TEMPLATE};
pub use decode::{StreamDecoder, Utf8Assembler};
pub use error::TokenizerError;
pub use spec::{token_type, SpecialIdKeys, TokenizerSpec};

use bpe::Bpe;
use spec::{KEY_ADD_BOS, KEY_ADD_EOS, KEY_BOS_ID, KEY_EOS_ID, KEY_MERGES};
use vocab::{attr, SpecialIds, Vocab};
use wpm::Wpm;

/// Which tokenization algorithm a model uses (for display and dispatch).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    /// SentencePiece-style BPE by token score (`tokenizer.ggml.model` = "llama").
    Spm,
    /// Byte-level BPE (`gpt2`) with the named pre-tokenizer.
    Bpe { pre: String },
    /// WordPiece (`bert`).
    Wpm,
}

impl fmt::Display for TokenizerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenizerKind::Spm => f.write_str("SPM (llama)"),
            TokenizerKind::Bpe { pre } => write!(f, "BPE (gpt2, pre-tokenizer {pre})"),
            TokenizerKind::Wpm => f.write_str("WPM (bert)"),
        }
    }
}

enum Model {
    Spm,
    Bpe(Bpe),
    Wpm(Wpm),
}

/// A text fragment after special-token partitioning.
enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

/// An immutable tokenizer; cheap to share across threads.
pub struct Tokenizer {
    vocab: Vocab,
    model: Model,
    kind: TokenizerKind,
    special: SpecialIds,
    /// Sorted end-of-generation ids.
    eog: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    add_sep: bool,
    add_space_prefix: bool,
    clean_spaces: bool,
    /// Control, user-defined and unknown tokens, longest text first.
    special_cache: Vec<u32>,
    /// Each token's bytes as printed with specials rendered.
    pieces: Vec<Vec<u8>>,
    chat_template: Option<String>,
}

impl Tokenizer {
    pub fn from_gguf(file: &kiln_gguf::GgufFile) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::from_spec(&TokenizerSpec::from_gguf(file)?)
    }

    /// Opens a GGUF file and builds its tokenizer.
    pub fn from_path(path: impl AsRef<std::path::Path>) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::from_gguf(&kiln_gguf::GgufFile::open(path)?)
    }

    pub fn from_spec(spec: &TokenizerSpec) -> Result<Tokenizer, TokenizerError> {
        let mut vocab = Vocab::from_spec(spec)?;
        let none = SpecialIds::default();
        // Per-model defaults, flags and algorithm, as llama.cpp's vocab loader sets them.
        let (defaults, kind, mut add_bos, add_space_prefix, clean_spaces, mut add_sep) = match spec.model.as_str() {
            "llama" => {
                let d = SpecialIds { bos: Some(1), eos: Some(2), unk: Some(0), ..none };
                (d, TokenizerKind::Spm, true, true, false, false)
            }
            "bert" => {
                let d = SpecialIds { bos: Some(101), unk: Some(100), sep: Some(102), pad: Some(0), mask: Some(103), ..none };
                (d, TokenizerKind::Wpm, true, false, true, true)
            }
            "gpt2" => {
                // llama.cpp warns and falls back to "default" when the key is absent.
                let pre = spec.pre.clone().unwrap_or_else(|| "default".into());
                let def = pretok::find_pre(&pre).ok_or_else(|| TokenizerError::UnsupportedPre(pre.clone()))?;
                let bos = if def.no_default_bos { None } else { Some(11) };
                let d = SpecialIds { bos, eos: Some(11), ..none };
                (d, TokenizerKind::Bpe { pre }, def.add_bos, false, def.clean_spaces, def.add_sep)
            }
            other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
        };
        let add_space_prefix = spec.add_space_prefix.unwrap_or(add_space_prefix);
        add_bos = spec.add_bos.unwrap_or(add_bos);
        let add_eos = spec.add_eos.unwrap_or(false);
        add_sep = spec.add_sep.unwrap_or(add_sep);

        let mut special = SpecialIds::resolve(defaults, &spec.special, vocab.len());
        for (on, id, flag_key, id_key) in [(add_bos, special.bos, KEY_ADD_BOS, KEY_BOS_ID), (add_eos, special.eos, KEY_ADD_EOS, KEY_EOS_ID)] {
            if on && id.is_none() {
                return Err(TokenizerError::BadVocab(format!("{flag_key} is true, but {id_key} is not set")));
            }
        }
        let eog = vocab::detect_specials(&mut vocab, &mut special);
        let special_cache = vocab::special_cache(&vocab);
        let model = match &kind {
            TokenizerKind::Spm => Model::Spm,
            TokenizerKind::Wpm => {
                let lowercase = spec.lowercase.unwrap_or(true);
                Model::Wpm(Wpm { lowercase, strip_accents: spec.strip_accents.unwrap_or(lowercase) })
            }
            TokenizerKind::Bpe { pre } => {
                let def = pretok::find_pre(pre).expect("checked above");
                let merges = spec.merges.as_deref().ok_or_else(|| TokenizerError::MissingKey(KEY_MERGES.into()))?;
                Model::Bpe(Bpe::new(&vocab, merges, pretok::compile(pre, def)?, def.ignore_merges)?)
            }
        };
        let mut tok = Tokenizer {
            vocab,
            model,
            kind,
            special,
            eog,
            add_bos,
            add_eos,
            add_sep,
            add_space_prefix,
            clean_spaces,
            special_cache,
            pieces: Vec::new(),
            chat_template: spec.chat_template.clone(),
        };
        // llama.cpp builds its piece cache before applying the name-keyed strip attributes.
        tok.pieces = (0..tok.vocab.len() as u32).map(|id| tok.render_piece(id)).collect();
        vocab::apply_name_attrs(&mut tok.vocab, spec, &tok.special_cache);
        Ok(tok)
    }

    /// Token ids for `text`. `add_special` adds BOS/EOS per the model's flags
    /// (CLS/SEP for WordPiece); `parse_special` recognises control-token text
    /// such as `<|eot_id|>`. User-defined tokens are matched either way, as in
    /// llama.cpp (and Hugging Face's added tokens).
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let fragments = if text.is_empty() { Vec::new() } else { self.partition(text, parse_special) };
        // WordPiece always frames the text with CLS/SEP; the others follow add_bos/add_eos.
        let (first, last) = match self.model {
            Model::Wpm(_) => (self.special.bos, self.special.sep),
            _ => (self.special.bos.filter(|_| self.add_bos), self.special.eos.filter(|_| self.add_eos)),
        };
        let mut out = Vec::new();
        if add_special {
            out.extend(first);
        }
        let mut after_special = true;
        for f in fragments {
            match f {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(t) => {
                    match &self.model {
                        Model::Spm => {
                            // The dummy prefix goes before the text and after every special token.
                            let prefix = if self.add_space_prefix && after_special { " " } else { "" };
                            let escaped = format!("{prefix}{t}").replace(' ', "\u{2581}");
                            spm::tokenize(&self.vocab, self.special.unk, &escaped, &mut out);
                        }
                        Model::Bpe(bpe) => bpe.tokenize(&self.vocab, t, &mut out),
                        Model::Wpm(wpm) => wpm.tokenize(&self.vocab, self.special.unk, t, &mut out),
                    }
                    after_special = false;
                }
            }
        }
        if add_special {
            out.extend(last);
        }
        out
    }

    /// Splits `text` around special-token occurrences, longest token text first.
    fn partition<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        let mut fragments = vec![Fragment::Text(text)];
        for &id in &self.special_cache {
            if !parse_special && self.vocab.has_attr(id, attr::CONTROL | attr::UNKNOWN) {
                continue;
            }
            let needle = self.vocab.texts[id as usize].as_str();
            if !fragments.iter().any(|f| matches!(f, Fragment::Text(t) if t.contains(needle))) {
                continue;
            }
            let lstrip = self.vocab.has_attr(id, attr::LSTRIP);
            let rstrip = self.vocab.has_attr(id, attr::RSTRIP);
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for f in fragments {
                let Fragment::Text(mut rest) = f else {
                    next.push(f);
                    continue;
                };
                while let Some(pos) = rest.find(needle) {
                    let mut left = &rest[..pos];
                    if lstrip {
                        left = left.trim_end_matches(|c: char| c.is_ascii() && unicode::is_c_space(c as u8));
                    }
                    if !left.is_empty() {
                        next.push(Fragment::Text(left));
                    }
                    next.push(Fragment::Token(id));
                    rest = &rest[pos + needle.len()..];
                    if rstrip {
                        rest = rest.trim_start_matches(|c: char| c.is_ascii() && unicode::is_c_space(c as u8));
                    }
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            fragments = next;
        }
        fragments
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// The text of token `id` as stored in the vocabulary.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.texts.get(id as usize).map(String::as_str)
    }

    /// The id of the vocabulary entry whose text is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.id(text)
    }

    pub fn bos(&self) -> Option<u32> {
        self.special.bos
    }
    pub fn eos(&self) -> Option<u32> {
        self.special.eos
    }
    pub fn eot(&self) -> Option<u32> {
        self.special.eot
    }
    pub fn eom(&self) -> Option<u32> {
        self.special.eom
    }
    pub fn unk(&self) -> Option<u32> {
        self.special.unk
    }
    /// BERT's separator ([SEP]).
    pub fn sep(&self) -> Option<u32> {
        self.special.sep
    }
    pub fn pad(&self) -> Option<u32> {
        self.special.pad
    }

    /// Whether generation should stop at `id`: EOS, EOT, EOM, FIM pad/repo/sep
    /// and the control tokens llama.cpp treats as end of turn.
    pub fn is_end_of_generation(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// All end-of-generation ids, sorted.
    pub fn end_of_generation_ids(&self) -> &[u32] {
        &self.eog
    }

    /// Whether `id` is a control (or unknown) token, printed only on request.
    pub fn is_control(&self, id: u32) -> bool {
        self.vocab.has_attr(id, attr::CONTROL | attr::UNKNOWN)
    }

    pub fn add_bos(&self) -> bool {
        self.add_bos
    }
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }
    /// Whether the model expects a SEP token after the text (BERT-style).
    pub fn add_sep(&self) -> bool {
        self.add_sep
    }
    /// Whether SentencePiece's dummy space prefix is added.
    pub fn add_space_prefix(&self) -> bool {
        self.add_space_prefix
    }

    pub fn kind(&self) -> TokenizerKind {
        self.kind.clone()
    }

    /// The BOS token's text, for a chat template's `bos_token`.
    pub fn bos_text(&self) -> Option<&str> {
        self.special.bos.and_then(|id| self.token_text(id))
    }
    /// The EOS token's text, for a chat template's `eos_token`.
    pub fn eos_text(&self) -> Option<&str> {
        self.special.eos.and_then(|id| self.token_text(id))
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Renders `messages` with the model's chat template (`tokenizer.chat_template`).
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TokenizerError> {
        let template = self.chat_template().ok_or_else(|| TokenizerError::Template(format!("the model has no chat template ({})", spec::KEY_CHAT_TEMPLATE)))?;
        self.apply_chat_template_with(template, messages, add_generation_prompt)
    }

    /// Renders `messages` with an explicit template (e.g. [`CHATML_TEMPLATE`]),
    /// passing this model's BOS/EOS texts.
    pub fn apply_chat_template_with(&self, template: &str, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TokenizerError> {
        let text = |id: Option<u32>| id.and_then(|id| self.token_text(id)).unwrap_or("");
        render_chat_template(template, messages, add_generation_prompt, text(self.special.bos), text(self.special.eos))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn tokenizer_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<super::Tokenizer>();
        assert_send_sync::<super::StreamDecoder<'static>>();
    }
}
