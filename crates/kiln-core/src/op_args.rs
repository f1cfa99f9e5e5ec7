//! The argument types of the backend's ops: layer geometry and rules, and the bundles of views
//! and weights that one op takes.

use crate::backend::Backend;
use crate::tensor::{Tensor, TensorMut};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeKind {
    /// Rotates pairs (x[2i], x[2i+1]) (llama).
    Normal,
    /// Rotates pairs (x[i], x[i + n_rot/2]) (GPT-NeoX, qwen2/3).
    Neox,
}

/// Rotary embedding of a `[n_tokens, n_heads, head_dim]` view: pair `i` of the first `n_rot`
/// dims of the token at position `p` is rotated by `p * inv_freq[i]`, where `inv_freq` (a
/// `[n_rot / 2]` view, so it gives `n_rot`) already includes any frequency scaling.
#[derive(Clone, Copy, Debug)]
pub struct RopeParams {
    pub kind: RopeKind,
}

/// Attention geometry for one layer. It stays whole although a query view's shape repeats
/// `n_heads * head_dim`: [`Backend::prepare`] reads it before any view exists, and the ops check
/// their views against it.
#[derive(Clone, Copy, Debug)]
pub struct AttentionParams {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Longest sequence the cache holds (positions), which sizes a split decode attention.
    pub max_seq_len: usize,
    pub scale: f32,
    /// Sliding-window attention: a query at position `p` sees only positions `p + 1 - window ..= p`.
    pub window: Option<usize>,
}

/// How a mixture-of-experts router turns a token's expert logits into its chosen experts and
/// their weights: softmax over all `n_experts`, the `n_used` most probable (ties: lower id),
/// both counts given by the shapes of the logits and the chosen ids.
#[derive(Clone, Copy, Debug)]
pub struct RouterParams {
    /// Divide the chosen probabilities by their sum (then they equal a softmax over the chosen).
    pub renormalize: bool,
    /// The logits' last column is a shared expert's gate logit, not a routed expert's: every
    /// token gets that expert (id `n_experts`, one past the routed ones) as one more slot after
    /// its `n_used` chosen, weighted by the logit's sigmoid (Qwen3.5's shared expert, run by the
    /// expert products as one of the experts).
    pub shared_expert: bool,
}

/// The gate activation of a gated FFN: `out = act(gate) * up`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    /// SwiGLU.
    Silu,
    /// GeGLU with tanh-approximated GELU.
    GeluTanh,
    /// gpt-oss's clamped SwiGLU (see [`Backend::swiglu_oai`]).
    SwiGluOai { alpha: f32, limit: f32 },
}

/// A mixture of experts' gate and up experts for [`Backend::moe_gate_up`]: both sets, their
/// per-expert biases (`[n_experts, n_ff]` each, gpt-oss) and the activation joining them.
pub struct GatedExperts<'a, B: Backend + ?Sized> {
    pub gate: &'a [B::Weight],
    pub up: &'a [B::Weight],
    pub bias: Option<[Tensor<'a, B::Buffer>; 2]>,
    pub act: Activation,
}

/// A dense gated FFN for [`Backend::norm_gated_ffn`]: `down(act(h·gateᵀ) * (h·upᵀ))`.
pub struct GatedFfn<'a, B: Backend + ?Sized> {
    pub gate: &'a B::Weight,
    pub up: &'a B::Weight,
    pub down: &'a B::Weight,
    pub act: Activation,
}

/// A mixture of experts' router for [`Backend::moe_norm_route`]: its weight `[n_experts, cols]`,
/// its own RMSNorm weight where it has one (Gemma 4; else the experts' norm serves it too), its
/// bias `[n_experts]`, the per-expert output scales `[n_experts]` and the routing rule; and a
/// shared expert's gate (Qwen3.5), a product of the experts' normed input computed beside the
/// router's: its weight `[1, cols]` and where its logits go (`[n, 1]`).
pub struct RouterArgs<'a, B: Backend + ?Sized> {
    pub weight: &'a B::Weight,
    pub norm: Option<Tensor<'a, B::Buffer>>,
    pub bias: Option<Tensor<'a, B::Buffer>>,
    pub expert_scale: Option<Tensor<'a, B::Buffer>>,
    pub params: RouterParams,
    pub shared_gate: Option<(&'a B::Weight, TensorMut<'a, B::Buffer>)>,
}

/// A Gated DeltaNet's output before its projection, `silu(z) * rms_norm(x) · weight`: x
/// `[n, heads, head_dim]` normed per head, z `[n, heads * head_dim]`, weight `[head_dim]`.
pub struct GatedNorm<'a, T> {
    pub x: Tensor<'a, T>,
    pub z: Tensor<'a, T>,
    pub weight: Tensor<'a, T>,
    pub eps: f32,
}

/// Shapes of a Gated DeltaNet layer (Qwen3.5) for its recurrent ops, which check their views
/// against it (the states are allocated from it before any view exists). Its convolution runs
/// over `conv_dim() = (2 * n_k_heads + n_v_heads) * head_dim` channels: q, k and v side by side.
/// Value head `h` reads query/key head `h % n_k_heads` (the order the GGUF converter writes).
#[derive(Clone, Copy, Debug)]
pub struct DeltaNetParams {
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub head_dim: usize,
    pub conv_kernel: usize,
}

impl DeltaNetParams {
    pub fn conv_dim(&self) -> usize {
        (2 * self.n_k_heads + self.n_v_heads) * self.head_dim
    }
    /// Values of one sequence's convolution state: the last `conv_kernel - 1` inputs.
    pub fn conv_state(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_dim()
    }
    /// Values of one sequence's delta-rule state: a `head_dim` x `head_dim` matrix per value head.
    pub fn ssm_state(&self) -> usize {
        self.n_v_heads * self.head_dim * self.head_dim
    }
}

/// Which input rows an expert-indexed product reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertInput {
    /// One row per token, shared by its `n_used` slots (the gate and up products).
    PerToken,
    /// One row per slot, `[n_tokens][n_used][cols]` (the down product).
    PerSlot,
}

/// The recurrent states of a Gated DeltaNet layer's op: `state` is `[n_slots, per_slot]`, one
/// row per state slot, and `slots` (`[n_seqs]`, f32) the slot of each of the step's sequences.
pub struct StateSlots<'a, T> {
    pub state: TensorMut<'a, T>,
    pub slots: Tensor<'a, T>,
}

/// The attention prologue's operands: queries `[n, n_heads, head_dim]` and keys
/// `[n, n_kv_heads, head_dim]`, rewritten in place, and values `[n, n_kv_heads * head_dim]`.
pub struct Qkv<'a, T> {
    pub q: TensorMut<'a, T>,
    pub k: TensorMut<'a, T>,
    pub v: Tensor<'a, T>,
}

/// Per-head RMSNorm of q and k in the attention prologue: the weights (`[head_dim]` each), eps,
/// and scratch of q's and k's shapes for the normed values; where values are normed too
/// (Gemma 4), their weight with scratch of k's shape.
pub struct QkNorm<'a, T> {
    pub q: Tensor<'a, T>,
    pub k: Tensor<'a, T>,
    pub eps: f32,
    pub scratch: [TensorMut<'a, T>; 2],
    pub v: Option<(Tensor<'a, T>, TensorMut<'a, T>)>,
}

/// A projection: its weight and, where the model has one, its bias (a value per output row),
/// `x·Wᵀ + bias`. A backend may add the bias inside the product.
pub struct Linear<'a, B: Backend + ?Sized> {
    pub weight: &'a B::Weight,
    pub bias: Option<Tensor<'a, B::Buffer>>,
}

impl<'a, B: Backend + ?Sized> Linear<'a, B> {
    pub fn new(weight: &'a B::Weight, bias: Option<Tensor<'a, B::Buffer>>) -> Self {
        Linear { weight, bias }
    }

    /// A projection without a bias.
    pub fn plain(weight: &'a B::Weight) -> Self {
        Linear { weight, bias: None }
    }
}

impl<B: Backend + ?Sized> Clone for Linear<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend + ?Sized> Copy for Linear<'_, B> {}

/// The operands of one attention call besides its output: queries `[n, n_heads * head_dim]`,
/// the layer's cache, its sink logits (gpt-oss: `[n_heads]`), the step and the geometry.
/// With `prologue`, the queries are as projected and the call takes the attention prologue
/// first (only where [`Backend::defers_attention_prologue`] said so).
pub struct AttentionArgs<'a, B: Backend + ?Sized> {
    pub q: Tensor<'a, B::Buffer>,
    pub cache: &'a B::KvCache,
    pub sinks: Option<Tensor<'a, B::Buffer>>,
    pub step: &'a B::Step,
    pub params: &'a AttentionParams,
    pub prologue: Option<DeferredPrologue<'a, B::Buffer>>,
}

/// An attention prologue left to the attention call: keys `[n, n_kv_heads, head_dim]` and
/// values `[n, n_kv_heads * head_dim]` as projected, the q/k norm weights and eps, the rope
/// table (`inv_freq`) and kind. What [`Backend::attention_prologue`] would have done with them,
/// the attention does before reading the cache.
pub struct DeferredPrologue<'a, T> {
    pub k: Tensor<'a, T>,
    pub v: Tensor<'a, T>,
    pub qk_norm: Option<(Tensor<'a, T>, Tensor<'a, T>, f32)>,
    pub inv_freq: Tensor<'a, T>,
    pub rope: RopeParams,
}

impl<T> Clone for DeferredPrologue<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DeferredPrologue<'_, T> {}

impl<B: Backend + ?Sized> Clone for AttentionArgs<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend + ?Sized> Copy for AttentionArgs<'_, B> {}

/// RMSNorms carried from one call to the next over the residual stream: `prepared`, what the
/// call that last added to the residual made of this call's input norm
/// ([`Backend::NormedInput`]); `next`, the norm (weight, eps) the next call will apply to the
/// residual this call adds to, which a backend may prepare in the same launch.
pub struct NormChain<'a, B: Backend + ?Sized> {
    pub prepared: Option<B::NormedInput>,
    pub next: Option<(Tensor<'a, B::Buffer>, f32)>,
}

impl<B: Backend + ?Sized> Default for NormChain<'_, B> {
    fn default() -> Self {
        NormChain { prepared: None, next: None }
    }
}
