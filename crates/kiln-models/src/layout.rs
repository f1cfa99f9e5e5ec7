//! Each decoder layer's own settings (attention geometry, rope table, window, where its keys
//! and values come from, its FFN), read from GGUF metadata that may give a value per layer.

use kiln_gguf::GgufFile;

use crate::config::{Arch, RopeScaling};
use crate::error::{ModelError, Result};

pub use kiln_core::Activation;

/// One rotary table: layers that share base, rotated dims and scaling share it.
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
                    RopeScaling::Yarn { factor, original_context, beta_fast, beta_slow } => {
                        let dims = self.n_rot as f64;
                        let correction_dim = |rotations: f32| {
                            dims * (*original_context as f64 / (rotations as f64 * 2.0 * std::f64::consts::PI)).ln() / (2.0 * (self.base as f64).ln())
                        };
                        let low = correction_dim(*beta_fast).max(0.0);
                        let mut high = correction_dim(*beta_slow).min(dims - 1.0);
                        if high == low {
                            high += 0.001;
                        }
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        // Below the ramp the original frequency, above it the interpolated one.
                        let extrapolate = 1.0 - ramp;
                        f / *factor as f64 * (1.0 - extrapolate) + f * extrapolate
                    }
                };
                scaled as f32
            })
            .collect()
    }
}

/// Where a layer's keys and values come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvSource {
    /// Its own projections; `v_from_k`: the values are the key projection (Gemma 4's K=V layers).
    Own { v_from_k: bool },
    /// The cache of an earlier layer, read as it is (Gemma 4's KV sharing).
    Shared { layer: usize },
}

/// What mixes a layer's tokens.
#[derive(Clone, Debug, PartialEq)]
pub enum Mixer {
    Attention(AttentionConfig),
    /// Qwen3.5's Gated DeltaNet: a recurrence over a per-sequence state instead of a KV cache.
    DeltaNet(DeltaNetConfig),
}

/// A Gated DeltaNet layer: q and k heads of `head_dim` (`n_k_heads` each), `n_v_heads` value
/// heads of `head_dim`, a causal convolution of `conv_kernel` taps over q, k and v.
#[derive(Clone, Debug, PartialEq)]
pub struct DeltaNetConfig {
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub head_dim: usize,
    pub conv_kernel: usize,
    /// Index of its recurrent state among the DeltaNet layers.
    pub state: usize,
}

impl DeltaNetConfig {
    /// Channels of the convolution: q, k and v side by side.
    pub fn conv_dim(&self) -> usize {
        (2 * self.n_k_heads + self.n_v_heads) * self.head_dim
    }
    pub fn v_width(&self) -> usize {
        self.n_v_heads * self.head_dim
    }
}

/// One layer's attention.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionConfig {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Index of its rotary table in [`crate::ModelConfig::ropes`].
    pub rope: usize,
    /// Sliding window (positions seen, the query's own included); `None`: global attention.
    pub window: Option<usize>,
    pub scale: f32,
    pub kv: KvSource,
    /// Index of the KV cache it writes or reads, among the layers that own one.
    pub cache: usize,
    /// Qwen3.5: the query projection also emits a per-value output gate, `out *= sigmoid(gate)`.
    pub gated: bool,
}

impl AttentionConfig {
    pub fn kv_width(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
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
    /// Gemma 4: a dense FFN of this width runs beside the experts; their outputs are added.
    pub dense_ff: Option<usize>,
    /// Qwen3.5: a shared expert of this width, its output gated by `sigmoid(x · w)`, is added.
    pub shared_ff: Option<usize>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum FfnConfig {
    Dense { n_ff: usize },
    Moe(MoeConfig),
}

/// What one decoder layer computes.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerConfig {
    pub mixer: Mixer,
    pub ffn: FfnConfig,
}

impl LayerConfig {
    pub fn attention(&self) -> Option<&AttentionConfig> {
        match &self.mixer {
            Mixer::Attention(a) => Some(a),
            Mixer::DeltaNet(_) => None,
        }
    }

    pub fn delta_net(&self) -> Option<&DeltaNetConfig> {
        match &self.mixer {
            Mixer::DeltaNet(d) => Some(d),
            Mixer::Attention(_) => None,
        }
    }
}

pub(crate) fn positive(file: &GgufFile, key: &str) -> Result<usize> {
    let v = file.get_u64(key)?;
    check_range(key, v)
}

fn check_range(key: &str, v: u64) -> Result<usize> {
    if v == 0 || v > (1 << 24) {
        return Err(ModelError::BadHparam { key: key.into(), reason: format!("{v} is out of range") });
    }
    Ok(v as usize)
}

pub(crate) fn optional(file: &GgufFile, key: &str) -> Result<Option<usize>> {
    if file.get(key).is_none() {
        return Ok(None);
    }
    positive(file, key).map(Some)
}

pub(crate) fn optional_f32(file: &GgufFile, key: &str) -> Result<Option<f32>> {
    file.get(key).map(|_| file.get_f32(key)).transpose().map_err(ModelError::from)
}

/// A key that holds one value for every layer or an array of one per layer.
pub(crate) fn per_layer(file: &GgufFile, key: &str, n_layer: usize) -> Result<Option<Vec<usize>>> {
    let Some(value) = file.get(key) else { return Ok(None) };
    let Some(items) = value.as_array() else { return Ok(Some(vec![positive(file, key)?; n_layer])) };
    if items.len() != n_layer {
        return Err(ModelError::BadHparam { key: key.into(), reason: format!("{} values for {n_layer} layers", items.len()) });
    }
    let bad = || ModelError::BadHparam { key: key.into(), reason: "not an array of integers".into() };
    items.iter().map(|v| v.as_u64().ok_or_else(bad).and_then(|v| check_range(key, v))).collect::<Result<Vec<_>>>().map(Some)
}

/// The model-wide values the layers start from.
pub(crate) struct Base {
    pub n_layer: usize,
    pub n_head: usize,
    pub head_dim: usize,
    pub n_rot: usize,
    pub rope_base: f32,
    pub rope_scaling: RopeScaling,
}

/// Every layer's settings and the rotary tables they use.
pub(crate) fn layers(file: &GgufFile, arch: Arch, base: &Base) -> Result<(Vec<RopeConfig>, Vec<LayerConfig>)> {
    let a = arch.name();
    let key = |k: &str| format!("{a}.{k}");
    let n = base.n_layer;
    let n_head_kv = per_layer(file, &key("attention.head_count_kv"), n)?.unwrap_or(vec![base.n_head; n]);
    // Qwen3.5-MoE has no dense FFN and writes no dense width.
    let n_ff = match per_layer(file, &key("feed_forward_length"), n)? {
        Some(n_ff) => n_ff,
        None => vec![positive(file, &key("expert_feed_forward_length")).map_err(|_| kiln_gguf::GgufError::MissingKey(key("feed_forward_length")))?; n],
    };
    let windows = sliding_windows(file, arch, n)?;
    let mut ropes = vec![RopeConfig { base: base.rope_base, n_rot: base.n_rot, scaling: base.rope_scaling.clone() }];
    // Gemma's sliding layers have their own base (and head size, rotated dims), without scaling.
    let swa = arch.is_gemma() && windows.iter().any(Option::is_some);
    let head_dim_swa = optional(file, &key("attention.key_length_swa"))?.unwrap_or(base.head_dim);
    if swa {
        let n_rot = optional(file, &key("rope.dimension_count_swa"))?.unwrap_or(head_dim_swa);
        let base = optional_f32(file, &key("rope.freq_base_swa"))?.unwrap_or(10000.0);
        ropes.push(RopeConfig { base, n_rot, scaling: RopeScaling::None });
    }
    let moe = moe(file, a, n_ff[0])?;
    if matches!(arch, Arch::Qwen3Moe | Arch::Qwen35Moe) && moe.is_none() {
        return Err(ModelError::BadHparam { key: key("expert_count"), reason: format!("missing ({a} has experts)") });
    }
    let delta_net = delta_net(file, arch)?;
    let shared_ff = optional(file, &key("expert_shared_feed_forward_length"))?;
    let shared_key = key("attention.shared_kv_layers");
    let n_shared = file.get(&shared_key).map(|_| file.get_u64(&shared_key)).transpose()?.unwrap_or(0).min(n as u64) as usize;
    let mut caches = Vec::new();
    let mut states = 0;
    let mut layers: Vec<LayerConfig> = Vec::with_capacity(n);
    for (l, window) in windows.into_iter().enumerate() {
        let t = |name: &str| file.tensor(&format!("blk.{l}.{name}")).is_some();
        let ffn = match (&moe, t("ffn_gate_inp.weight")) {
            (Some(m), true) => FfnConfig::Moe(MoeConfig {
                dense_ff: (arch == Arch::Gemma4).then_some(n_ff[l]),
                shared_ff: shared_ff.filter(|_| t("ffn_gate_shexp.weight")),
                ..m.clone()
            }),
            (None, true) => return Err(ModelError::BadHparam { key: key("expert_count"), reason: format!("missing, but blk.{l} has a router") }),
            (_, false) => FfnConfig::Dense { n_ff: n_ff[l] },
        };
        // Qwen3.5: every `interval`-th layer attends, the others are Gated DeltaNets.
        if let Some((template, interval)) = &delta_net {
            if (l + 1) % interval != 0 {
                layers.push(LayerConfig { mixer: Mixer::DeltaNet(DeltaNetConfig { state: states, ..template.clone() }), ffn });
                states += 1;
                continue;
            }
        }
        let sliding = swa && window.is_some();
        let head_dim = if sliding { head_dim_swa } else { base.head_dim };
        let rope = usize::from(sliding);
        if ropes[rope].n_rot > head_dim || ropes[rope].n_rot % 2 != 0 {
            return Err(ModelError::BadHparam { key: key("rope.dimension_count"), reason: format!("{} does not fit head_dim {head_dim}", ropes[rope].n_rot) });
        }
        if n_head_kv[l] == 0 || !base.n_head.is_multiple_of(n_head_kv[l]) {
            return Err(ModelError::BadHparam {
                key: key("attention.head_count_kv"),
                reason: format!("{} query heads are not a multiple of {} kv heads (blk.{l})", base.n_head, n_head_kv[l]),
            });
        }
        // KV sharing (transformers' rule): the last layer of the same kind before the shared ones.
        let kv = if l >= n - n_shared {
            let source = (0..n - n_shared).rev().find(|&s| layers[s].attention().is_some_and(|a| a.window.is_some() == window.is_some()));
            let layer =
                source.ok_or_else(|| ModelError::BadHparam { key: key("attention.shared_kv_layers"), reason: format!("blk.{l} has no layer to share") })?;
            KvSource::Shared { layer }
        } else {
            KvSource::Own { v_from_k: arch == Arch::Gemma4 && !t("attn_v.weight") }
        };
        let cache = match kv {
            KvSource::Own { .. } => {
                caches.push(l);
                caches.len() - 1
            }
            KvSource::Shared { layer } => layers[layer].attention().map_or(0, |a| a.cache),
        };
        // Gemma 4 normalizes q and k per head and scales scores by 1. YaRN's factor on cos and
        // sin scales q and k, so it is the scores' scale squared where every dim rotates.
        let yarn = ropes[rope].scaling.attention_factor();
        if yarn != 1.0 && ropes[rope].n_rot != head_dim {
            return Err(ModelError::BadHparam { key: key("rope.dimension_count"), reason: "YaRN on part of the head dims is not supported".into() });
        }
        let scale = if arch == Arch::Gemma4 { 1.0 } else { yarn * yarn / (head_dim as f32).sqrt() };
        let gated = delta_net.is_some();
        let attn = AttentionConfig { n_head: base.n_head, n_head_kv: n_head_kv[l], head_dim, rope, window, scale, kv, cache, gated };
        if let KvSource::Shared { layer } = kv {
            let same = layers[layer].attention().is_some_and(|src| (src.n_head_kv, src.head_dim) == (attn.n_head_kv, attn.head_dim));
            if !same {
                return Err(ModelError::BadHparam { key: key("attention.shared_kv_layers"), reason: format!("blk.{l} cannot read blk.{layer}'s cache") });
            }
        }
        layers.push(LayerConfig { mixer: Mixer::Attention(attn), ffn });
    }
    Ok((ropes, layers))
}

/// Qwen3.5's Gated DeltaNet geometry and the period of its full-attention layers.
fn delta_net(file: &GgufFile, arch: Arch) -> Result<Option<(DeltaNetConfig, usize)>> {
    if !arch.is_hybrid() {
        return Ok(None);
    }
    let key = |k: &str| format!("{}.{k}", arch.name());
    let head_dim = positive(file, &key("ssm.state_size"))?;
    let (n_k_heads, n_v_heads) = (positive(file, &key("ssm.group_count"))?, positive(file, &key("ssm.time_step_rank"))?);
    if !n_v_heads.is_multiple_of(n_k_heads) {
        return Err(ModelError::BadHparam { key: key("ssm.time_step_rank"), reason: format!("{n_v_heads} value heads over {n_k_heads} key heads") });
    }
    if let Some(inner) = optional(file, &key("ssm.inner_size"))? {
        if inner != n_v_heads * head_dim {
            return Err(ModelError::BadHparam { key: key("ssm.inner_size"), reason: format!("{inner} is not {n_v_heads} heads of {head_dim}") });
        }
    }
    let conv_kernel = positive(file, &key("ssm.conv_kernel"))?;
    let interval = optional(file, &key("full_attention_interval"))?.unwrap_or(4);
    Ok(Some((DeltaNetConfig { n_k_heads, n_v_heads, head_dim, conv_kernel, state: 0 }, interval)))
}

/// Each layer's sliding window. Gemma 4 gives a per-layer bool pattern; Gemma 3's converter
/// writes none, and llama.cpp's period of 6 (five sliding layers, then a global one) is the
/// default; gpt-oss alternates. The other supported architectures attend globally.
fn sliding_windows(file: &GgufFile, arch: Arch, n_layer: usize) -> Result<Vec<Option<usize>>> {
    let a = arch.name();
    let window = if arch.is_gemma() || arch == Arch::GptOss { optional(file, &format!("{a}.attention.sliding_window"))? } else { None };
    let Some(window) = window else { return Ok(vec![None; n_layer]) };
    let pattern_key = format!("{a}.attention.sliding_window_pattern");
    match file.get(&pattern_key).and_then(|v| v.as_array()) {
        Some(items) => {
            if items.len() != n_layer {
                return Err(ModelError::BadHparam { key: pattern_key, reason: format!("{} values for {n_layer} layers", items.len()) });
            }
            items
                .iter()
                .map(|v| v.as_bool().map(|s| s.then_some(window)))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| ModelError::BadHparam { key: pattern_key, reason: "not an array of bools".into() })
        }
        // gpt-oss writes no pattern: even layers slide (HF's default layer_types, llama.cpp's).
        None if arch == Arch::GptOss => Ok((0..n_layer).map(|l| (l % 2 == 0).then_some(window)).collect()),
        None => {
            let period = optional(file, &pattern_key)?.unwrap_or(6);
            Ok((0..n_layer).map(|l| ((l + 1) % period != 0).then_some(window)).collect())
        }
    }
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
    Ok(Some(MoeConfig { n_expert, n_used, n_ff, renormalize: true, dense_ff: None, shared_ff: None }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gpt-oss's YaRN: pairs below the correction dim of beta_fast (8.09 here) keep their
    /// frequency, pairs above that of beta_slow (17.40) are divided by the factor, and the pairs
    /// between blend linearly, without rounding the dims to integers.
    #[test]
    fn yarn_blends_between_untruncated_correction_dims() {
        let scaling = RopeScaling::Yarn { factor: 32.0, original_context: 4096, beta_fast: 32.0, beta_slow: 1.0 };
        let rope = RopeConfig { base: 150000.0, n_rot: 64, scaling };
        let plain = RopeConfig { scaling: RopeScaling::None, ..rope.clone() }.inv_freq();
        let yarn = rope.inv_freq();
        let (low, high) = (8.0933, 17.3980);
        for i in 0..32 {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let want = plain[i] as f64 * (1.0 - ramp + ramp / 32.0);
            assert!((yarn[i] as f64 - want).abs() <= 2e-4 * want, "pair {i}: {} vs {want}", yarn[i]);
        }
        assert_eq!(yarn[8], plain[8]);
        assert!(yarn[9] < plain[9] && yarn[17] > plain[17] / 32.0);
        assert_eq!(yarn[18], plain[18] / 32.0);
        assert!((rope.scaling.attention_factor() - 1.3466).abs() < 1e-4);
    }
}
