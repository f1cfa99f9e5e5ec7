//! Hyper-parameters read from GGUF metadata.

use kiln_core::RopeKind;
use kiln_gguf::GgufFile;

use crate::error::{ModelError, Result};
use crate::layout;
use crate::layout::{optional, optional_f32, positive, Base};
pub use crate::layout::{Activation, AttentionConfig, DeltaNetConfig, FfnConfig, KvSource, LayerConfig, Mixer, MoeConfig, RopeConfig};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Also Mixtral (llama with experts).
    Llama,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    Gemma3,
    /// Dense (per-layer embeddings, KV sharing) and MoE (experts beside a dense FFN, K=V layers).
    Gemma4,
    GptOss,
    /// Qwen3.5 hybrids: Gated DeltaNet layers and gated attention, dense or MoE.
    Qwen35,
    Qwen35Moe,
}

impl Arch {
    pub fn from_name(name: &str) -> Result<Arch> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            "qwen3moe" => Ok(Arch::Qwen3Moe),
            "gemma3" => Ok(Arch::Gemma3),
            "gemma4" => Ok(Arch::Gemma4),
            "gpt-oss" => Ok(Arch::GptOss),
            "qwen35" => Ok(Arch::Qwen35),
            "qwen35moe" => Ok(Arch::Qwen35Moe),
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
            Arch::Gemma4 => "gemma4",
            Arch::GptOss => "gpt-oss",
            Arch::Qwen35 => "qwen35",
            Arch::Qwen35Moe => "qwen35moe",
        }
    }

    /// The decoder block the architecture's forward assembles.
    pub fn block_style(self) -> BlockStyle {
        match self {
            Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::GptOss | Arch::Qwen35 | Arch::Qwen35Moe => BlockStyle::PreNorm,
            Arch::Gemma3 | Arch::Gemma4 => BlockStyle::Gemma,
        }
    }

    /// Whether queries and keys get a per-head RMSNorm before rope.
    pub fn has_qk_norm(self) -> bool {
        matches!(self, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3 | Arch::Gemma4 | Arch::Qwen35 | Arch::Qwen35Moe)
    }

    /// Whether some layers are recurrent (Gated DeltaNet) instead of attention.
    pub fn is_hybrid(self) -> bool {
        matches!(self, Arch::Qwen35 | Arch::Qwen35Moe)
    }

    pub fn is_gemma(self) -> bool {
        self.block_style() == BlockStyle::Gemma
    }
}

/// How the blocks of a decoder layer are wired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockStyle {
    /// `x += attn(norm(x)); x += ffn(norm(x))` (llama, qwen).
    PreNorm,
    /// Gemma's sandwich: `x += norm(attn(norm(x))); x += norm(ffn(norm(x)))`, embeddings scaled;
    /// Gemma 4 adds per-layer embeddings and a per-layer output scale.
    Gemma,
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
    /// YaRN (gpt-oss): frequencies blended between interpolated (÷ factor) and original over
    /// the ramp between the correction dims of `beta_fast` and `beta_slow` rotations, not
    /// truncated to whole dims (the HF/OpenAI definition); cos and sin scaled by
    /// [`RopeScaling::attention_factor`].
    Yarn {
        factor: f32,
        original_context: usize,
        beta_fast: f32,
        beta_slow: f32,
    },
}

impl RopeScaling {
    /// The factor YaRN puts on cos and sin (`0.1 ln(factor) + 1`); 1 for the others.
    pub fn attention_factor(&self) -> f32 {
        match self {
            RopeScaling::Yarn { factor, .. } if *factor > 1.0 => (0.1 * (*factor as f64).ln() + 1.0) as f32,
            _ => 1.0,
        }
    }
}

/// One KV cache: its row width and the widest sliding window of the layers that read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheLayout {
    pub width: usize,
    pub window: Option<usize>,
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
    /// Width of Gemma 4's per-layer embedding of each token, per layer.
    pub per_layer_embd: Option<usize>,
    /// The distinct rotary tables; `ropes[0]` is the model-wide one.
    pub ropes: Vec<RopeConfig>,
    pub layers: Vec<LayerConfig>,
}

impl ModelConfig {
    pub fn from_gguf(file: &GgufFile) -> Result<ModelConfig> {
        let arch = Arch::from_name(file.architecture()?)?;
        let a = arch.name();
        let key = |k: &str| format!("{a}.{k}");
        let n_embd = positive(file, &key("embedding_length"))?;
        let n_head = positive(file, &key("attention.head_count"))?;
        let head_dim = optional(file, &key("attention.key_length"))?.unwrap_or(n_embd / n_head);
        let n_rot = optional(file, &key("rope.dimension_count"))?.unwrap_or(head_dim);
        let rope_base = optional_f32(file, &key("rope.freq_base"))?.unwrap_or(10000.0);
        let rms_eps = file.get_f32(&key("attention.layer_norm_rms_epsilon"))?;
        let embd = file.tensor("token_embd.weight").ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))?;
        let n_vocab = match embd.dims.get(1) {
            Some(&v) if v > 0 => v as usize,
            _ => return Err(ModelError::WrongShape { name: embd.name.clone(), expected: vec![n_embd as u64, 0], found: embd.dims.clone() }),
        };
        let rope_scaling = Self::rope_scaling(file, a, n_rot)?;
        let n_layer = positive(file, &key("block_count"))?;
        let base = Base { n_layer, n_head, head_dim, n_rot, rope_base, rope_scaling: rope_scaling.clone() };
        let (ropes, layers) = layout::layers(file, arch, &base)?;
        let first = &layers[0];
        let first_attn = layers
            .iter()
            .find_map(LayerConfig::attention)
            .ok_or_else(|| ModelError::BadHparam { key: key("block_count"), reason: "no attention layer".into() })?;
        let n_ff = match &first.ffn {
            FfnConfig::Dense { n_ff } => *n_ff,
            FfnConfig::Moe(m) => m.n_ff,
        };
        let final_softcap = optional_f32(file, &key("final_logit_softcapping"))?.filter(|c| *c != 0.0);
        if let Some(cap) = final_softcap.filter(|c| !(*c > 0.0 && c.is_finite())) {
            return Err(ModelError::BadHparam { key: key("final_logit_softcapping"), reason: format!("{cap} is not a positive cap") });
        }
        let gemma = arch.is_gemma();
        Ok(ModelConfig {
            arch,
            name: file.get("general.name").and_then(|v| v.as_str()).map(str::to_string),
            n_embd,
            n_layer,
            n_head,
            n_head_kv: first_attn.n_head_kv,
            head_dim: first_attn.head_dim,
            n_rot: ropes[first_attn.rope].n_rot,
            n_ff,
            n_vocab,
            n_ctx_train: optional(file, &key("context_length"))?.unwrap_or(2048),
            rms_eps,
            rope_base,
            rope_kind: if arch == Arch::Llama { RopeKind::Normal } else { RopeKind::Neox },
            rope_scaling,
            tied_embeddings: file.tensor("output.weight").is_none(),
            activation: match arch {
                _ if gemma => Activation::GeluTanh,
                // No GGUF key holds them: the values of every gpt-oss checkpoint (and llama.cpp).
                Arch::GptOss => Activation::SwiGluOai { alpha: 1.702, limit: 7.0 },
                _ => Activation::Silu,
            },
            embd_scale: gemma.then(|| (n_embd as f32).sqrt()),
            final_softcap,
            per_layer_embd: if arch == Arch::Gemma4 { Self::per_layer_embd(file, &key("embedding_length_per_layer_input"))? } else { None },
            ropes,
            layers,
        })
    }

    /// Gemma 4's per-layer embedding width; 0 or absent: none.
    fn per_layer_embd(file: &GgufFile, key: &str) -> Result<Option<usize>> {
        match file.get(key) {
            Some(_) if file.get_u64(key)? == 0 => Ok(None),
            Some(_) => positive(file, key).map(Some),
            None => Ok(None),
        }
    }

    /// Row widths of the KV caches, one per layer that stores its own keys and values.
    pub fn kv_widths(&self) -> Vec<usize> {
        self.layers.iter().filter_map(LayerConfig::attention).filter(|a| matches!(a.kv, KvSource::Own { .. })).map(AttentionConfig::kv_width).collect()
    }

    /// The KV caches in the order of [`ModelConfig::kv_widths`], each with the widest sliding
    /// window of the layers that read it (`None` when one of them attends globally).
    pub fn kv_caches(&self) -> Vec<KvCacheLayout> {
        let mut caches = Vec::new();
        for a in self.layers.iter().filter_map(LayerConfig::attention) {
            match a.kv {
                KvSource::Own { .. } => caches.push(KvCacheLayout { width: a.kv_width(), window: a.window }),
                KvSource::Shared { .. } => {
                    if let Some(c) = caches.get_mut(a.cache) {
                        c.window = c.window.zip(a.window).map(|(x, y)| x.max(y));
                    }
                }
            }
        }
        caches
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
        let beta = |name: &str, default: f32| optional_f32(file, &format!("{a}.rope.scaling.yarn_beta_{name}")).map(|b| b.unwrap_or(default));
        match kind {
            "none" => Ok(RopeScaling::None),
            "linear" => Ok(RopeScaling::Linear { factor: factor()? }),
            "yarn" => Ok(RopeScaling::Yarn {
                factor: factor()?,
                original_context: positive(file, &format!("{a}.rope.scaling.original_context_length"))?,
                beta_fast: beta("fast", 32.0)?,
                beta_slow: beta("slow", 1.0)?,
            }),
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
                let mixer = match &l.mixer {
                    Mixer::Attention(a) => e * (a.n_head * a.head_dim) as u64 * 2 + e * a.kv_width() as u64 * 2,
                    // qkv, z and out projections, and the two per-head gates.
                    Mixer::DeltaNet(d) => e * (d.conv_dim() + 2 * d.v_width() + 2 * d.n_v_heads) as u64,
                };
                let ffn = match &l.ffn {
                    FfnConfig::Dense { n_ff } => 3 * e * *n_ff as u64,
                    FfnConfig::Moe(m) => m.n_expert as u64 * (3 * e * m.n_ff as u64 + e) + 3 * e * (m.dense_ff.unwrap_or(0) + m.shared_ff.unwrap_or(0)) as u64,
                };
                mixer + ffn + 2 * e
            })
            .sum();
        let out = if self.tied_embeddings { 0 } else { e * self.n_vocab as u64 };
        per_layer + e * self.n_vocab as u64 + out + e
    }
}
