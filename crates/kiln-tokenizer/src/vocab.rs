//! Token table, per-token attributes and special-token resolution, following
//! llama.cpp's `llama_vocab::impl::load`.

use std::collections::HashMap;

use crate::spec::{token_type, SpecialIdKeys, TokenizerSpec, KEY_SCORES, KEY_TOKEN_TYPE};
use crate::TokenizerError;

/// Per-token attribute bits (llama.cpp's `llama_token_attr`).
pub(crate) mod attr {
    pub const NORMAL: u16 = 1 << 0;
    pub const UNKNOWN: u16 = 1 << 1;
    pub const UNUSED: u16 = 1 << 2;
    pub const CONTROL: u16 = 1 << 3;
    pub const USER_DEFINED: u16 = 1 << 4;
    pub const BYTE: u16 = 1 << 5;
    pub const LSTRIP: u16 = 1 << 6;
    pub const RSTRIP: u16 = 1 << 7;
}

pub(crate) struct Vocab {
    pub texts: Vec<String>,
    pub scores: Vec<f32>,
    pub attrs: Vec<u16>,
    pub ids: HashMap<String, u32>,
    /// Longest token text in bytes.
    pub max_token_len: usize,
}

impl Vocab {
    pub(crate) fn from_spec(spec: &TokenizerSpec) -> Result<Vocab, TokenizerError> {
        let n = spec.tokens.len();
        if n == 0 {
            return Err(TokenizerError::BadVocab("tokenizer.ggml.tokens is empty".into()));
        }
        if u32::try_from(n).is_err() {
            return Err(TokenizerError::BadVocab(format!("{n} tokens do not fit u32 ids")));
        }
        let check_len = |key: &str, len: Option<usize>| match len {
            Some(len) if len < n => Err(TokenizerError::BadVocab(format!("{key} has {len} entries for {n} tokens"))),
            _ => Ok(()),
        };
        check_len(KEY_SCORES, spec.scores.as_ref().map(Vec::len))?;
        check_len(KEY_TOKEN_TYPE, spec.token_types.as_ref().map(Vec::len))?;

        let mut ids = HashMap::with_capacity(n);
        let mut texts = Vec::with_capacity(n);
        for (i, text) in spec.tokens.iter().enumerate() {
            // llama.cpp gives empty entries a unique stand-in text instead of rejecting the vocab.
            let text = if text.is_empty() { format!("[EMPTY_{i}]") } else { text.clone() };
            if let Some(prev) = ids.insert(text.clone(), i as u32) {
                return Err(TokenizerError::BadVocab(format!("duplicate token {text:?} with ids {prev} and {i}")));
            }
            texts.push(text);
        }
        let attrs = (0..n)
            .map(|i| match spec.token_types.as_ref().map_or(token_type::NORMAL, |t| t[i]) {
                token_type::NORMAL => attr::NORMAL,
                token_type::UNKNOWN => attr::UNKNOWN,
                token_type::CONTROL => attr::CONTROL,
                token_type::USER_DEFINED => attr::USER_DEFINED,
                token_type::UNUSED => attr::UNUSED,
                token_type::BYTE => attr::BYTE,
                _ => 0, // undefined: never matched, printed as nothing
            })
            .collect();
        Ok(Vocab {
            max_token_len: texts.iter().map(String::len).max().unwrap_or(0),
            scores: spec.scores.clone().unwrap_or_else(|| vec![0.0; n]),
            texts,
            attrs,
            ids,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.texts.len()
    }

    pub(crate) fn id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    pub(crate) fn has_attr(&self, id: u32, bits: u16) -> bool {
        self.attrs.get(id as usize).is_some_and(|a| a & bits != 0)
    }

    fn add_attr(&mut self, id: u32, bits: u16) {
        self.attrs[id as usize] |= bits;
    }

    fn set_attr_by_text(&mut self, text: &str, bits: u16, on: bool) {
        if let Some(id) = self.id(text) {
            let a = &mut self.attrs[id as usize];
            *a = if on { *a | bits } else { *a & !bits };
        }
    }

    /// The lowest id among tokens whose text is one of `texts`, earlier texts first.
    fn find_first(&self, texts: &[&str]) -> Option<u32> {
        texts.iter().find_map(|t| self.id(t))
    }
}

/// Resolved special-token ids.
#[derive(Clone, Debug, Default)]
pub(crate) struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub sep: Option<u32>,
    pub pad: Option<u32>,
    pub mask: Option<u32>,
    pub fim_pre: Option<u32>,
    pub fim_suf: Option<u32>,
    pub fim_mid: Option<u32>,
    pub fim_pad: Option<u32>,
    pub fim_rep: Option<u32>,
    pub fim_sep: Option<u32>,
}

impl SpecialIds {
    /// Model defaults overridden by GGUF keys. As in llama.cpp, a default outside
    /// the vocabulary is dropped and an out-of-range key keeps the default.
    pub(crate) fn resolve(defaults: SpecialIds, keys: &SpecialIdKeys, n_vocab: usize) -> SpecialIds {
        let pick = |default: Option<u32>, key: Option<u64>| {
            let default = default.filter(|&id| (id as usize) < n_vocab);
            match key {
                Some(k) if k < n_vocab as u64 => Some(k as u32),
                _ => default,
            }
        };
        SpecialIds {
            bos: pick(defaults.bos, keys.bos),
            eos: pick(defaults.eos, keys.eos),
            eot: pick(defaults.eot, keys.eot),
            eom: pick(defaults.eom, keys.eom),
            unk: pick(defaults.unk, keys.unk),
            sep: pick(defaults.sep, keys.sep),
            pad: pick(defaults.pad, keys.pad),
            mask: pick(defaults.mask, keys.mask),
            fim_pre: pick(defaults.fim_pre, keys.fim_pre),
            fim_suf: pick(defaults.fim_suf, keys.fim_suf),
            fim_mid: pick(defaults.fim_mid, keys.fim_mid),
            fim_pad: pick(defaults.fim_pad, keys.fim_pad),
            fim_rep: pick(defaults.fim_rep, keys.fim_rep),
            fim_sep: pick(defaults.fim_sep, keys.fim_sep),
        }
    }
}

const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PRE_TEXTS: &[&str] = &["<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>", "<|prefix|>"];
const FIM_SUF_TEXTS: &[&str] = &["<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>"];
const FIM_MID_TEXTS: &[&str] = &["<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>", "<|middle|>"];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];
/// Token texts llama.cpp treats as end of generation.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];
/// gpt-oss channel markers that llama.cpp always renders.
const ALWAYS_RENDERED: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

/// Fills special ids llama.cpp detects by token text, marks them control, and
/// returns the sorted end-of-generation set.
pub(crate) fn detect_specials(vocab: &mut Vocab, ids: &mut SpecialIds) -> Vec<u32> {
    let slots: [(&mut Option<u32>, &[&str]); 8] = [
        (&mut ids.eot, EOT_TEXTS),
        (&mut ids.eom, EOM_TEXTS),
        (&mut ids.fim_pre, FIM_PRE_TEXTS),
        (&mut ids.fim_suf, FIM_SUF_TEXTS),
        (&mut ids.fim_mid, FIM_MID_TEXTS),
        (&mut ids.fim_pad, FIM_PAD_TEXTS),
        (&mut ids.fim_rep, FIM_REP_TEXTS),
        (&mut ids.fim_sep, FIM_SEP_TEXTS),
    ];
    for (slot, texts) in slots {
        if slot.is_none() {
            *slot = vocab.find_first(texts);
            if let Some(id) = *slot {
                vocab.add_attr(id, attr::CONTROL);
            }
        }
    }

    let mut eog: Vec<u32> = [ids.fim_pad, ids.fim_rep, ids.fim_sep].into_iter().flatten().collect();
    for text in EOG_TEXTS {
        if let Some(id) = vocab.id(text) {
            eog.push(id);
            vocab.add_attr(id, attr::CONTROL);
        }
    }
    for text in ALWAYS_RENDERED {
        if let Some(id) = vocab.id(text) {
            vocab.attrs[id as usize] = attr::USER_DEFINED;
        }
    }
    eog.extend([ids.eos, ids.eot, ids.eom].into_iter().flatten());
    eog.sort_unstable();
    eog.dedup();

    let in_eog = |vocab: &Vocab, eog: &[u32], t: &str| vocab.id(t).filter(|id| eog.binary_search(id).is_ok());
    // Harmony/solar-open vocabularies end turns with <|return|>/<|call|>; there <|end|> is not EOG.
    let has = |t: &str| in_eog(vocab, &eog, t).is_some();
    let harmony = (has("<|return|>") && has("<|call|>")) || (has("<|calls|>") && has("<|flush|>"));
    if let Some(end) = in_eog(vocab, &eog, "<|end|>").filter(|_| harmony) {
        eog.retain(|&id| id != end);
        vocab.attrs[end as usize] = attr::USER_DEFINED;
    }
    // Gemma 4 / PaddleOCR: </s> is an ordinary token there.
    let tool_response = in_eog(vocab, &eog, "<|tool_response>").is_some();
    if let Some(s) = in_eog(vocab, &eog, "</s>").filter(|_| tool_response) {
        eog.retain(|&id| id != s);
        vocab.attrs[s as usize] = attr::NORMAL;
    }
    eog
}

/// Tokens matched in raw text before tokenization, longest text first.
pub(crate) fn special_cache(vocab: &Vocab) -> Vec<u32> {
    let mut cache: Vec<u32> = (0..vocab.len() as u32).filter(|&id| vocab.has_attr(id, attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN)).collect();
    cache.sort_by(|&a, &b| vocab.texts[b as usize].len().cmp(&vocab.texts[a as usize].len()).then(a.cmp(&b)));
    cache
}

/// The strip attributes llama.cpp sets by model name.
pub(crate) fn apply_name_attrs(vocab: &mut Vocab, spec: &TokenizerSpec, special_cache: &[u32]) {
    let name = spec.model_name.as_deref().unwrap_or("").to_ascii_lowercase();
    let pre = spec.pre.as_deref().unwrap_or("");
    let arch = spec.architecture.as_deref().unwrap_or("");
    let any = |s: &str, subs: &[&str]| subs.iter().any(|x| s.contains(x));
    if any(pre, &["jina-v2-de", "jina-v2-es", "jina-v2-code"]) || any(arch, &["nomic-bert-moe", "jina-bert-v3"]) {
        vocab.set_attr_by_text("<mask>", attr::LSTRIP, true);
    } else if any(&name, &["phi-3", "phi3"]) {
        for &id in special_cache {
            vocab.add_attr(id, attr::RSTRIP);
        }
        vocab.set_attr_by_text("</s>", attr::RSTRIP, true);
        for t in ["<unk>", "<s>", "<|endoftext|>"] {
            vocab.set_attr_by_text(t, attr::RSTRIP, false);
        }
    } else if name.contains("modern-bert") {
        vocab.set_attr_by_text("[MASK]", attr::LSTRIP, true);
    }
}
