//! Hyper-parameters read from GGUF metadata.

use kiln_core::RopeKind;
use kiln_gguf::GgufFile;

use crate::error::{ModelError, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
}

impl Arch {
    pub fn from_name(name: &str) -> Result<Arch> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            other => Err(ModelError::UnsupportedArch(other.to_string())),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }
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
        Ok(ModelConfig {
            arch,
            name: file.get("general.name").and_then(|v| v.as_str()).map(str::to_string),
            n_embd,
            n_layer: positive(file, &key("block_count"))?,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            n_ff: positive(file, &key("feed_forward_length"))?,
            n_vocab,
            n_ctx_train: optional(file, &key("context_length"))?.unwrap_or(2048),
            rms_eps,
            rope_base,
            rope_kind: if arch == Arch::Llama { RopeKind::Normal } else { RopeKind::Neox },
            rope_scaling,
            tied_embeddings: file.tensor("output.weight").is_none(),
        })
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

    /// Per-pair inverse frequencies with the scaling folded in.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let half = self.n_rot / 2;
        (0..half)
            .map(|i| {
                let f = (self.rope_base as f64).powf(-2.0 * i as f64 / self.n_rot as f64);
                let scaled = match &self.rope_scaling {
                    RopeScaling::None => f,
                    RopeScaling::Linear { factor } => f / *factor as f64,
                    RopeScaling::PerFrequency(div) => f / div[i] as f64,
                };
                scaled as f32
            })
            .collect()
    }

    /// Parameter count implied by the shapes.
    pub fn n_params(&self) -> u64 {
        let (e, q, kv, ff) = (self.n_embd as u64, (self.n_head * self.head_dim) as u64, (self.n_head_kv * self.head_dim) as u64, self.n_ff as u64);
        let per_layer = e * q * 2 + e * kv * 2 + 3 * e * ff + 2 * e;
        let out = if self.tied_embeddings { 0 } else { e * self.n_vocab as u64 };
        self.n_layer as u64 * per_layer + e * self.n_vocab as u64 + out + e
    }
}
