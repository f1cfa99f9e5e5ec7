//! The tokenizer-relevant GGUF metadata, gathered in one plain struct.

use kiln_gguf::{GgufFile, Value};

use crate::TokenizerError;

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
pub mod token_type {
    pub const UNDEFINED: i32 = 0;
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// Special-token ids as stored in GGUF; `None` where the key is absent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecialIdKeys {
    pub bos: Option<u64>,
    pub eos: Option<u64>,
    pub eot: Option<u64>,
    pub eom: Option<u64>,
    pub unk: Option<u64>,
    pub sep: Option<u64>,
    pub pad: Option<u64>,
    pub mask: Option<u64>,
    pub fim_pre: Option<u64>,
    pub fim_suf: Option<u64>,
    pub fim_mid: Option<u64>,
    pub fim_pad: Option<u64>,
    pub fim_rep: Option<u64>,
    pub fim_sep: Option<u64>,
}

/// Everything a [`crate::Tokenizer`] is built from. Optional fields are the
/// GGUF keys that may be absent; the tokenizer applies llama.cpp's defaults.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`: "llama", "gpt2", "bert", ...
    pub model: String,
    /// `tokenizer.ggml.pre`.
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub scores: Option<Vec<f32>>,
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges`, each "left right" (required for BPE).
    pub merges: Option<Vec<String>>,
    pub special: SpecialIdKeys,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_sep: Option<bool>,
    pub add_space_prefix: Option<bool>,
    /// `tokenizer.ggml.normalizer.lowercase` / `.strip_accents` (WordPiece).
    pub lowercase: Option<bool>,
    pub strip_accents: Option<bool>,
    /// `general.name` and `general.architecture`: llama.cpp keys a few
    /// per-token strip attributes on them (Phi-3, Jina, ModernBERT).
    pub model_name: Option<String>,
    pub architecture: Option<String>,
    pub chat_template: Option<String>,
}

pub(crate) const KEY_MODEL: &str = "tokenizer.ggml.model";
pub(crate) const KEY_PRE: &str = "tokenizer.ggml.pre";
pub(crate) const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
pub(crate) const KEY_SCORES: &str = "tokenizer.ggml.scores";
pub(crate) const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
pub(crate) const KEY_MERGES: &str = "tokenizer.ggml.merges";
pub(crate) const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
pub(crate) const KEY_ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
pub(crate) const KEY_ADD_SEP: &str = "tokenizer.ggml.add_sep_token";
pub(crate) const KEY_BOS_ID: &str = "tokenizer.ggml.bos_token_id";
pub(crate) const KEY_EOS_ID: &str = "tokenizer.ggml.eos_token_id";
pub(crate) const KEY_SEP_ID: &str = "tokenizer.ggml.seperator_token_id";
pub(crate) const KEY_CHAT_TEMPLATE: &str = "tokenizer.chat_template";

fn wrong_type(key: &str, expected: &'static str) -> TokenizerError {
    TokenizerError::WrongType { key: key.to_string(), expected }
}

fn opt_str(file: &GgufFile, key: &str) -> Result<Option<String>, TokenizerError> {
    file.get(key).map(|v| v.as_str().map(str::to_string).ok_or_else(|| wrong_type(key, "a string"))).transpose()
}

fn opt_bool(file: &GgufFile, key: &str) -> Result<Option<bool>, TokenizerError> {
    file.get(key).map(|v| v.as_bool().ok_or_else(|| wrong_type(key, "a bool"))).transpose()
}

fn opt_id(file: &GgufFile, key: &str) -> Result<Option<u64>, TokenizerError> {
    file.get(key).map(|v| v.as_u64().ok_or_else(|| wrong_type(key, "a non-negative integer"))).transpose()
}

fn opt_array<'a>(file: &'a GgufFile, key: &str) -> Result<Option<&'a [Value]>, TokenizerError> {
    file.get(key).map(|v| v.as_array().ok_or_else(|| wrong_type(key, "an array"))).transpose()
}

fn map_array<T>(file: &GgufFile, key: &str, expected: &'static str, f: impl Fn(&Value) -> Option<T>) -> Result<Option<Vec<T>>, TokenizerError> {
    opt_array(file, key)?.map(|items| items.iter().map(|v| f(v).ok_or_else(|| wrong_type(key, expected))).collect()).transpose()
}

fn string_array(file: &GgufFile, key: &str) -> Result<Option<Vec<String>>, TokenizerError> {
    map_array(file, key, "an array of strings", |v| v.as_str().map(str::to_string))
}

impl TokenizerSpec {
    /// Reads the `tokenizer.*` keys (and `general.name`/`general.architecture`).
    /// Absent optional keys stay `None`; a key of the wrong type is an error.
    pub fn from_gguf(file: &GgufFile) -> Result<TokenizerSpec, TokenizerError> {
        let model = opt_str(file, KEY_MODEL)?.ok_or_else(|| TokenizerError::MissingKey(KEY_MODEL.into()))?;
        let tokens = string_array(file, KEY_TOKENS)?.ok_or_else(|| TokenizerError::MissingKey(KEY_TOKENS.into()))?;
        let id = |name: &str| opt_id(file, &format!("tokenizer.ggml.{name}_token_id"));
        let special = SpecialIdKeys {
            bos: opt_id(file, KEY_BOS_ID)?,
            eos: opt_id(file, KEY_EOS_ID)?,
            eot: id("eot")?,
            eom: id("eom")?,
            unk: id("unknown")?,
            sep: opt_id(file, KEY_SEP_ID)?,
            pad: id("padding")?,
            mask: id("mask")?,
            // llama.cpp reads the deprecated prefix/suffix/middle keys last, so they win.
            fim_pre: id("prefix")?.or(id("fim_pre")?),
            fim_suf: id("suffix")?.or(id("fim_suf")?),
            fim_mid: id("middle")?.or(id("fim_mid")?),
            fim_pad: id("fim_pad")?,
            fim_rep: id("fim_rep")?,
            fim_sep: id("fim_sep")?,
        };
        Ok(TokenizerSpec {
            model,
            pre: opt_str(file, KEY_PRE)?,
            tokens,
            scores: map_array(file, KEY_SCORES, "an array of numbers", Value::as_f32)?,
            token_types: map_array(file, KEY_TOKEN_TYPE, "an array of i32", |v| v.as_i64().and_then(|x| i32::try_from(x).ok()))?,
            merges: string_array(file, KEY_MERGES)?,
            special,
            add_bos: opt_bool(file, KEY_ADD_BOS)?,
            add_eos: opt_bool(file, KEY_ADD_EOS)?,
            add_sep: opt_bool(file, KEY_ADD_SEP)?,
            add_space_prefix: opt_bool(file, "tokenizer.ggml.add_space_prefix")?,
            lowercase: opt_bool(file, "tokenizer.ggml.normalizer.lowercase")?,
            strip_accents: opt_bool(file, "tokenizer.ggml.normalizer.strip_accents")?,
            model_name: opt_str(file, "general.name")?,
            architecture: opt_str(file, "general.architecture")?,
            chat_template: opt_str(file, KEY_CHAT_TEMPLATE)?,
        })
    }
}
