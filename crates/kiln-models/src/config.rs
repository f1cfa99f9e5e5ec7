//! Hyper-parameters read from GGUF metadata.

use kiln_core::RopeKind;
use kiln_gguf::GgufFile;

use crate::error::{ModelError, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Also Mixtral (llama with experts).
    Llama,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    Gemma3,
}

impl Arch {
    pub fn from_name(name: &str) -> Result<Arch> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            "qwen3moe" => Ok(Arch::Qwen3Moe),
            "gemma3" => Ok(Arch::Gemma3),
            other => Err(ModelError::UnsupportedArch(other.to_string())),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Gemma3 => "gemma3",
        }
    }

    /// The decoder block the architecture's forward assembles.
    pub fn block_style(self) -> BlockStyle {
        match self {
            Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe => BlockStyle::PreNorm,
            Arch::Gemma3 => BlockStyle::Gemma,
        }
    }

    /// Whether queries and keys get a per-head RMSNorm before rope.
    pub fn has_qk_norm(self) -> bool {
        matches!(self, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3)
    }
}

/// How the blocks of a decoder layer are wired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockStyle {
    /// `x += attn(norm(x)); x += ffn(norm(x))` (llama, qwen).
    PreNorm,
    /// Gemma's sandwich: `x += norm(attn(norm(x))); x += norm(ffn(norm(x)))`, embeddings scaled.
    Gemma,
}

/// The gate activation of a gated FFN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU.
    Silu,
    /// GeGLU with tanh-approximated GELU.
    GeluTanh,
}

/// One rotary table: layers that share base and scaling share it.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    pub base: f32,
    pub n_rot: usize,
    pub scaling: RopeScaling,
}

impl RopeConfig {
    /// Per-pair inverse frequencies with the scaling folded in.
    pub fn inv_freq(&self) -> Vec<f32> {
        (0..self.n_rot / 2)
            .map(|i| {
                let f = (self.base as f64).powf(-2.0 * i as f64 / self.n_rot as f64);
                let scaled = match &self.scaling {
                    RopeScaling::None => f,
                    RopeScaling::Linear { factor } => f / *factor as f64,
                    RopeScaling::PerFrequency(div) => f / div[i] as f64,
                };
                scaled as f32
            })
            .collect()
    }
}

/// One layer's attention.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionConfig {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Index of its rotary table in [`ModelConfig::ropes`].
    pub rope: usize,
    /// Sliding window (positions seen, the query's own included); `None`: global attention.
    pub window: Option<usize>,
    pub scale: f32,
}

/// A mixture of experts: router over `n_expert`, `n_used` chosen per token.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub n_expert: usize,
    pub n_used: usize,
    /// Each expert's hidden width.
    pub n_ff: usize,
    /// The chosen experts' softmax weights are divided by their sum.
    pub renormalize: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub enum FfnConfig {
    Dense { n_ff: usize },
    Moe(MoeConfig),
}

/// What one decoder layer computes.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerConfig {
    pub attn: AttentionConfig,
    pub ffn: FfnConfig,
}

/// How rotary frequencies are scaled beyond the plain `base^(-2i/n_rot)`.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama 3.1: per-frequency divisors (from `rope_freqs.weight` or computed).
    PerFrequency(Vec<f32>),
}

/// Model-wide hyper-parameters, and each layer's own settings in `layers`. The model-wide
/// head and FFN sizes are those of the first layer, for display.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub arch: Arch,
    pub name: Option<String>,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_rot: usize,
    pub n_ff: usize,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    pub rope_kind: RopeKind,
    pub rope_scaling: RopeScaling,
    pub tied_embeddings: bool,
    pub activation: Activation,
    /// Embeddings are multiplied by this (Gemma: sqrt(n_embd)).
    pub embd_scale: Option<f32>,
    /// Final logits are soft-capped: `cap * tanh(logits / cap)`.
    pub final_softcap: Option<f32>,
    /// The distinct rotary tables; `ropes[0]` is the model-wide one.
    pub ropes: Vec<RopeConfig>,
    pub layers: Vec<LayerConfig>,
}

fn positive(file: &GgufFile, key: &str) -> Result<usize> {
    let v = file.get_u64(key)?;
    if v == 0 || v > (1 << 24) {
        return Err(ModelError::BadHparam { key: key.into(), reason: format!("{v} is out of range") });
    }
    Ok(v as usize)
}

fn optional(file: &GgufFile, key: &str) -> Result<Option<usize>> {
    if file.get(key).is_none() {
        return Ok(None);
    }
    positive(file, key).map(Some)
}

impl ModelConfig {
    pub fn from_gguf(file: &GgufFile) -> Result<ModelConfig> {
        let arch = Arch::from_name(file.architecture()?)?;
        let a = arch.name();
        let key = |k: &str| format!("{a}.{k}");
        let n_embd = positive(file, &key("embedding_length"))?;
        let n_head = positive(file, &key("attention.head_count"))?;
        let n_head_kv = optional(file, &key("attention.head_count_kv"))?.unwrap_or(n_head);
        if n_head % n_head_kv != 0 {
            return Err(ModelError::BadHparam {
                key: key("attention.head_count_kv"),
                reason: format!("{n_head} query heads are not a multiple of {n_head_kv} kv heads"),
            });
        }
        let head_dim = optional(file, &key("attention.key_length"))?.unwrap_or(n_embd / n_head);
        let n_rot = optional(file, &key("rope.dimension_count"))?.unwrap_or(head_dim);
        if n_rot > head_dim || n_rot % 2 != 0 {
            return Err(ModelError::BadHparam { key: key("rope.dimension_count"), reason: format!("{n_rot} does not fit head_dim {head_dim}") });
        }
        let rope_base = match file.get(&key("rope.freq_base")) {
            Some(_) => file.get_f32(&key("rope.freq_base"))?,
            None => 10000.0,
        };
        let rms_eps = file.get_f32(&key("attention.layer_norm_rms_epsilon"))?;
        let embd = file.tensor("token_embd.weight").ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))?;
        let n_vocab = match embd.dims.get(1) {
            Some(&v) if v > 0 => v as usize,
            _ => return Err(ModelError::WrongShape { name: embd.name.clone(), expected: vec![n_embd as u64, 0], found: embd.dims.clone() }),
        };
        let rope_scaling = Self::rope_scaling(file, a, n_rot)?;
        let n_layer = positive(file, &key("block_count"))?;
        let n_ff = positive(file, &key("feed_forward_length"))?;
        let gemma = arch.block_style() == BlockStyle::Gemma;
        let mut ropes = vec![RopeConfig { base: rope_base, n_rot, scaling: rope_scaling.clone() }];
        let windows = Self::sliding_windows(file, arch, n_layer)?;
        if gemma && windows.iter().any(Option::is_some) {
            // Gemma's sliding layers have their own base and no frequency scaling.
            let base = match file.get(&key("rope.freq_base_swa")) {
                Some(_) => file.get_f32(&key("rope.freq_base_swa"))?,
                None => 10000.0,
            };
            ropes.push(RopeConfig { base, n_rot, scaling: RopeScaling::None });
        }
        let moe = Self::moe(file, a, n_ff)?;
        if arch == Arch::Qwen3Moe && moe.is_none() {
            return Err(ModelError::BadHparam { key: key("expert_count"), reason: "missing (qwen3moe has experts)".into() });
        }
        let mut layers = Vec::with_capacity(n_layer);
        for (l, window) in windows.into_iter().enumerate() {
            let routed = file.tensor(&format!("blk.{l}.ffn_gate_inp.weight")).is_some();
            let ffn = match (&moe, routed) {
                (Some(m), true) => FfnConfig::Moe(m.clone()),
                (None, true) => return Err(ModelError::BadHparam { key: key("expert_count"), reason: format!("missing, but blk.{l} has a router") }),
                (_, false) => FfnConfig::Dense { n_ff },
            };
            let rope = if gemma && window.is_some() { 1 } else { 0 };
            let attn = AttentionConfig { n_head, n_head_kv, head_dim, rope, window, scale: 1.0 / (head_dim as f32).sqrt() };
            layers.push(LayerConfig { attn, ffn });
        }
        let final_softcap = match file.get(&key("final_logit_softcapping")) {
            Some(_) => Some(file.get_f32(&key("final_logit_softcapping"))?).filter(|c| *c != 0.0),
            None => None,
        };
        if let Some(cap) = final_softcap.filter(|c| !(*c > 0.0 && c.is_finite())) {
            return Err(ModelError::BadHparam { key: key("final_logit_softcapping"), reason: format!("{cap} is not a positive cap") });
        }
        Ok(ModelConfig {
            arch,
            name: file.get("general.name").and_then(|v| v.as_str()).map(str::to_string),
            n_embd,
            n_layer,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            n_ff,
            n_vocab,
            n_ctx_train: optional(file, &key("context_length"))?.unwrap_or(2048),
            rms_eps,
            rope_base,
            rope_kind: if arch == Arch::Llama { RopeKind::Normal } else { RopeKind::Neox },
            rope_scaling,
            tied_embeddings: file.tensor("output.weight").is_none(),
            activation: if gemma { Activation::GeluTanh } else { Activation::Silu },
            embd_scale: gemma.then(|| (n_embd as f32).sqrt()),
            final_softcap,
            ropes,
            layers,
        })
    }

    /// Each layer's sliding window. Only Gemma 3 has sliding layers among the supported
    /// architectures; its converter writes no pattern, and llama.cpp's period of 6 (five
    /// sliding layers, then a global one) is the default.
    fn sliding_windows(file: &GgufFile, arch: Arch, n_layer: usize) -> Result<Vec<Option<usize>>> {
        let a = arch.name();
        let window_key = format!("{a}.attention.sliding_window");
        let window = match arch {
            Arch::Gemma3 => optional(file, &window_key)?,
            _ => None,
        };
        let Some(window) = window else { return Ok(vec![None; n_layer]) };
        let pattern_key = format!("{a}.attention.sliding_window_pattern");
        let period = optional(file, &pattern_key)?.unwrap_or(6);
        Ok((0..n_layer).map(|l| ((l + 1) % period != 0).then_some(window)).collect())
    }

    /// The experts of the layers that have a router, from `expert_count` and `expert_used_count`.
    fn moe(file: &GgufFile, a: &str, n_ff: usize) -> Result<Option<MoeConfig>> {
        let Some(n_expert) = optional(file, &format!("{a}.expert_count"))? else { return Ok(None) };
        let used_key = format!("{a}.expert_used_count");
        let n_used = positive(file, &used_key)?;
        if n_used > n_expert {
            return Err(ModelError::BadHparam { key: used_key, reason: format!("{n_used} experts used of {n_expert}") });
        }
        let n_ff = optional(file, &format!("{a}.expert_feed_forward_length"))?.unwrap_or(n_ff);
        // llama.cpp renormalizes the chosen weights for both (Mixtral; Qwen3-MoE's norm_topk_prob).
        Ok(Some(MoeConfig { n_expert, n_used, n_ff, renormalize: true }))
    }

    fn rope_scaling(file: &GgufFile, a: &str, n_rot: usize) -> Result<RopeScaling> {
        if let Some(t) = file.tensor("rope_freqs.weight") {
            if t.n_elements() != (n_rot / 2) as u64 || t.ty != kiln_quant::GgmlType::F32 {
                return Err(ModelError::WrongShape { name: t.name.clone(), expected: vec![(n_rot / 2) as u64], found: t.dims.clone() });
            }
            let mut f = vec![0f32; n_rot / 2];
            kiln_quant::dequantize(t.ty, file.tensor_data(t), &mut f).map_err(|e| ModelError::BadHparam { key: t.name.clone(), reason: e.to_string() })?;
            return Ok(RopeScaling::PerFrequency(f));
        }
        let type_key = format!("{a}.rope.scaling.type");
        let Some(kind) = file.get(&type_key) else { return Ok(RopeScaling::None) };
        let kind = kind.as_str().unwrap_or("");
        let factor_key = format!("{a}.rope.scaling.factor");
        let factor = || -> Result<f32> {
            let f = file.get_f32(&factor_key)?;
            if f > 0.0 && f.is_finite() {
                Ok(f)
            } else {
                Err(ModelError::BadHparam { key: factor_key.clone(), reason: format!("{f} is not a positive factor") })
            }
        };
        match kind {
            "none" => Ok(RopeScaling::None),
            "linear" => Ok(RopeScaling::Linear { factor: factor()? }),
            other => Err(ModelError::BadHparam { key: type_key, reason: format!("rope scaling '{other}' is not supported") }),
        }
    }

    /// The model-wide rotary inverse frequencies (`ropes[0]`).
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        self.ropes[0].inv_freq()
    }

    /// Parameter count implied by the shapes (every expert counted).
    pub fn n_params(&self) -> u64 {
        let e = self.n_embd as u64;
        let per_layer: u64 = self
            .layers
            .iter()
            .map(|l| {
                let (q, kv) = ((l.attn.n_head * l.attn.head_dim) as u64, (l.attn.n_head_kv * l.attn.head_dim) as u64);
                let ffn = match &l.ffn {
                    FfnConfig::Dense { n_ff } => 3 * e * *n_ff as u64,
                    FfnConfig::Moe(m) => m.n_expert as u64 * (3 * e * m.n_ff as u64 + e),
                };
                e * q * 2 + e * kv * 2 + ffn + 2 * e
            })
            .sum();
        let out = if self.tied_embeddings { 0 } else { e * self.n_vocab as u64 };
        per_layer + e * self.n_vocab as u64 + out + e
    }
}
