//! The operations a transformer forward pass needs, as one trait.
//!
//! Every op writes into a buffer the caller allocated up front, and every value
//! that changes from one step to the next (token ids, positions, sampler state)
//! lives in the backend's `Step` object, written once per step by
//! [`Backend::write_step`]. A GPU backend can therefore record a whole step once
//! (a CUDA graph) and replay it: the kernels read positions and tokens from
//! device memory instead of taking them as launch arguments.
//!
//! Shapes: ops take typed views ([`Tensor`], [`TensorMut`]) of buffers; activations are
//! row-major `[n_tokens, width]`, and every count an op needs comes from its operands' shapes,
//! checked against each other. A weight matrix has `rows` outputs of `cols` inputs each (GGUF
//! `ne = [cols, rows]`), and `matmul` computes `out[t][r] = sum_c x[t][c] * W[r][c]`.

use std::ops::Range;
use std::sync::Arc;

use kiln_quant::GgmlType;

pub use crate::compose::{
    compose_attention, compose_attention_prologue, compose_gated_norm_matmul_add, compose_moe_gate_up, compose_moe_norm_route, compose_norm_matmuls,
};
pub use crate::op_args::{
    Activation, AttentionArgs, AttentionParams, DeferredPrologue, DeltaNetParams, ExpertInput, GatedExperts, GatedFfn, GatedNorm, Linear, NormChain, QkNorm,
    Qkv, RopeKind, RopeParams, RouterArgs, RouterParams, StateSlots,
};
use crate::plan::{FlatPlan, KvCacheSpec, StepCapacity};
use crate::tensor::{DeviceBuffer, Shape, Tensor, TensorMut};

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("out of {device} memory: {what} needs {requested_bytes} bytes{}", free_note(*.free_bytes))]
    OutOfMemory { device: String, what: String, requested_bytes: u64, free_bytes: Option<u64> },
    #[error("{backend} backend does not support {what}")]
    Unsupported { backend: String, what: String },
    #[error("weight {name}: {reason}")]
    BadWeight { name: String, reason: String },
    #[error("batch of {n_tokens} tokens exceeds the {capacity} this state was allocated for")]
    BatchTooLarge { n_tokens: usize, capacity: usize },
    #[error("step of {need} {what} exceeds the {capacity} this step object was allocated for")]
    PlanTooLarge { what: String, need: usize, capacity: usize },
    #[error("bad batch plan: {0}")]
    BadPlan(String),
    #[error("device error: {0}")]
    Device(String),
    #[error("{op}: {tensor} is {found}, expected {expected}")]
    ShapeMismatch { op: String, tensor: String, expected: String, found: Shape },
    #[error("a view of {shape} needs {need} values, its buffer holds {len}")]
    ViewTooLarge { shape: Shape, need: usize, len: usize },
}

fn free_note(free: Option<u64>) -> String {
    free.map(|f| format!(" ({f} bytes free)")).unwrap_or_default()
}

pub type Result<T, E = BackendError> = std::result::Result<T, E>;

/// Borrowed-for-life bytes of one tensor (usually a slice of a memory-mapped
/// GGUF file), so a backend that computes from host memory keeps no copy.
#[derive(Clone)]
pub struct WeightSource {
    pub name: String,
    pub ty: GgmlType,
    /// Output features (number of rows).
    pub rows: usize,
    /// Input features (row length in elements).
    pub cols: usize,
    pub owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    pub range: Range<usize>,
}

impl WeightSource {
    pub fn bytes(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.range.clone()]
    }

    /// Checks that the byte range holds exactly `rows` rows of `cols` values.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| BackendError::BadWeight { name: self.name.clone(), reason };
        if !self.cols.is_multiple_of(self.ty.block_size()) {
            return Err(bad(format!("row length {} is not a multiple of the {} block size {}", self.cols, self.ty, self.ty.block_size())));
        }
        let want = (self.cols / self.ty.block_size()) as u64 * self.ty.type_size() as u64 * self.rows as u64;
        let have = self.range.len() as u64;
        if want != have || self.range.end > (*self.owner).as_ref().len() {
            return Err(bad(format!("{} bytes given, {} {}x{} needs {want}", have, self.ty, self.rows, self.cols)));
        }
        Ok(())
    }
}

pub trait Backend: Send + Sync + 'static {
    /// An f32 buffer in the backend's memory.
    type Buffer: DeviceBuffer;
    /// A weight matrix in whatever layout the backend chose at upload.
    type Weight: Send + Sync;
    /// Per-step values read by the ops: the step's [`crate::FlatPlan`] (tokens, positions,
    /// cache rows, block tables, samplers) and the sampled tokens.
    type Step: Send + Sync;
    /// One layer's paged K and V cache.
    type KvCache: Send + Sync;
    /// An RMSNorm of the residual prepared, by the call that added to it, as the input of the
    /// next call's products ([`NormChain`]); the next call uses it if it still matches its input
    /// and norm, else normalizes itself. A backend that never prepares one uses
    /// `std::convert::Infallible`.
    type NormedInput: Send;

    fn name(&self) -> String;
    /// Bytes of free memory on the device, where it can tell.
    fn free_memory(&self) -> Option<u64> {
        None
    }

    /// Uploads (or, on the host, wraps) a weight matrix.
    fn upload_weight(&self, src: WeightSource) -> Result<Self::Weight>;
    /// An f32 buffer of `len` elements, contents unspecified.
    fn alloc(&self, len: usize, what: &str) -> Result<Self::Buffer>;
    /// One layer's K and V cache of up to `spec.n_blocks` blocks, of which none is usable
    /// until [`Backend::grow_kv`] provides memory for them.
    fn alloc_kv(&self, spec: &KvCacheSpec, what: &str) -> Result<Self::KvCache>;
    /// Makes blocks `0..n_blocks` of `cache` usable (contents of new blocks unspecified), so that
    /// memory is taken as sequences grow. Addresses of blocks already usable never change.
    fn grow_kv(&self, cache: &mut Self::KvCache, n_blocks: usize) -> Result<()>;
    fn write(&self, dst: &mut Self::Buffer, src: &[f32]) -> Result<()>;
    fn read(&self, src: &Self::Buffer, dst: &mut [f32]) -> Result<()>;
    /// A step object able to hold plans up to `capacity`, over caches of `cache_blocks` blocks.
    fn alloc_step(&self, capacity: &StepCapacity, cache_blocks: usize) -> Result<Self::Step>;
    /// Takes `plan` into `step` (on a device: copies it there in one transfer).
    fn write_step(&self, step: &mut Self::Step, plan: &FlatPlan) -> Result<()>;

    /// `out[t] = table[step.tokens[t]]` for the first `n` tokens; `out` is `[n, table cols]`.
    fn embed(&self, table: &Self::Weight, step: &Self::Step, out: TensorMut<Self::Buffer>) -> Result<()>;
    /// Per row of `x` (any rank; rows of its last dimension): `out = x / sqrt(mean(x²) + eps) *
    /// weight`, with `weight` `[cols]` and `out` of `x`'s shape.
    fn rms_norm(&self, x: Tensor<Self::Buffer>, weight: Tensor<Self::Buffer>, out: TensorMut<Self::Buffer>, eps: f32) -> Result<()>;
    /// `out = rms_norm(a) · weights[0] + rms_norm(b) · weights[1]` per row, one eps (Gemma 4:
    /// its dense FFN's and its experts' outputs, each post-normed, summed); `a`, `b` and `out`
    /// are `[n, dim]`, and `a` is left unspecified (the composed form norms `b` into it).
    fn rms_norm_sum(
        &self,
        a: TensorMut<Self::Buffer>,
        b: Tensor<Self::Buffer>,
        weights: [Tensor<Self::Buffer>; 2],
        eps: f32,
        mut out: TensorMut<Self::Buffer>,
    ) -> Result<()> {
        self.rms_norm(a.as_ref(), weights[0], out.reborrow(), eps)?;
        self.rms_norm_add(b, (weights[1], eps), a, out, 1.0)
    }

    /// `x = (x + rms_norm(src) · weight) · scale` with `norm` = (weight, eps) (Gemma's block
    /// outputs normed before the residual add, and its per-layer output scale; 1 for none):
    /// `src`, `scratch` and `x` are `[n, dim]`; `scratch` receives the normed rows (or, in a
    /// backend that fuses the steps, is left unspecified).
    fn rms_norm_add(
        &self,
        src: Tensor<Self::Buffer>,
        norm: (Tensor<Self::Buffer>, f32),
        mut scratch: TensorMut<Self::Buffer>,
        mut x: TensorMut<Self::Buffer>,
        scale: f32,
    ) -> Result<()> {
        self.rms_norm(src, norm.0, scratch.reborrow(), norm.1)?;
        self.add(x.reborrow(), scratch.as_ref())?;
        if scale != 1.0 {
            self.scale(x, scale)?;
        }
        Ok(())
    }
    /// `out[t][r] = x[t] · W[r]`: `x` is `[n, cols]`, `out` `[n, rows]`.
    fn matmul(&self, w: &Self::Weight, x: Tensor<Self::Buffer>, out: TensorMut<Self::Buffer>) -> Result<()>;
    /// `x[t][i] += bias[i]`: `x` is `[n, dim]`, `bias` `[dim]`.
    fn add_bias(&self, x: TensorMut<Self::Buffer>, bias: Tensor<Self::Buffer>) -> Result<()>;
    /// `x[i] += y[i]`, both of one shape.
    fn add(&self, x: TensorMut<Self::Buffer>, y: Tensor<Self::Buffer>) -> Result<()>;
    /// `out[i] = silu(gate[i]) * up[i]`, all of one shape.
    fn swiglu(&self, gate: Tensor<Self::Buffer>, up: Tensor<Self::Buffer>, out: TensorMut<Self::Buffer>) -> Result<()>;
    /// Rotary embedding in place of `x` (`[n, n_heads, head_dim]`), each token at its position in
    /// `step`, with `inv_freq` (`[n_rot / 2]`).
    fn rope(&self, x: TensorMut<Self::Buffer>, inv_freq: Tensor<Self::Buffer>, step: &Self::Step, p: &RopeParams) -> Result<()>;
    /// Stores `n` tokens of K and V (`[n, cache width]`) at their cache rows (the step's slots).
    fn kv_store(&self, k: Tensor<Self::Buffer>, v: Tensor<Self::Buffer>, cache: &mut Self::KvCache, step: &Self::Step) -> Result<()>;
    /// Causal grouped-query attention of `n` query tokens (`q` and `out`:
    /// `[n, n_heads * head_dim]`), each over positions `0..=its position` of its own sequence,
    /// read through that sequence's block table.
    fn attention(&self, q: Tensor<Self::Buffer>, cache: &Self::KvCache, out: TensorMut<Self::Buffer>, step: &Self::Step, p: &AttentionParams) -> Result<()>;
    /// Chooses the experts of `n` tokens from their router logits (`[n, n_experts]`): expert ids
    /// into `ids` and their weights into `weights`, both `[n, n_used]`, each weight times
    /// `expert_scale[id]` (`[n_experts]`) where given (after any renormalization). Ids are stored
    /// as f32 (exact for any expert count below 2^24), so they live in ordinary buffers on the device.
    fn moe_route(
        &self,
        logits: Tensor<Self::Buffer>,
        expert_scale: Option<Tensor<Self::Buffer>>,
        ids: TensorMut<Self::Buffer>,
        weights: TensorMut<Self::Buffer>,
        p: &RouterParams,
    ) -> Result<()>;
    /// Expert-indexed product: `out[t][j] = x_in · experts[ids[t][j]]` for each token `t` and slot
    /// `j < n_used` (`ids`: `[n, n_used]`), where `x_in` is `x[t]` (`x`: `[n, cols]`) or `x[t][j]`
    /// (`x`: `[n, n_used, cols]`) as `input` says; `out` is `[n, n_used, rows]`. Only the chosen
    /// experts' weights are read.
    fn moe_matmul(
        &self,
        experts: &[Self::Weight],
        x: Tensor<Self::Buffer>,
        ids: Tensor<Self::Buffer>,
        out: TensorMut<Self::Buffer>,
        input: ExpertInput,
    ) -> Result<()>;
    /// `x[t][j] += bias[ids[t][j]]` for the slots of `x` (`[n, n_used, dim]`); `bias` is
    /// `[n_experts, dim]`, `ids` `[n, n_used]`.
    fn moe_add_bias(&self, x: TensorMut<Self::Buffer>, bias: Tensor<Self::Buffer>, ids: Tensor<Self::Buffer>) -> Result<()>;
    /// gpt-oss's clamped SwiGLU: `out = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`, `g = min(gate, limit)`.
    fn swiglu_oai(&self, gate: Tensor<Self::Buffer>, up: Tensor<Self::Buffer>, out: TensorMut<Self::Buffer>, alpha: f32, limit: f32) -> Result<()>;
    /// `out[t] = sum_j weights[t][j] * y[t][j]`: `y` is `[n, n_used, dim]`, `weights`
    /// `[n, n_used]`, `out` `[n, dim]`.
    fn moe_combine(&self, y: Tensor<Self::Buffer>, weights: Tensor<Self::Buffer>, out: TensorMut<Self::Buffer>) -> Result<()>;
    /// `out[i] = gelu_tanh(gate[i]) * up[i]` (GeGLU with the tanh approximation of GELU).
    fn geglu(&self, gate: Tensor<Self::Buffer>, up: Tensor<Self::Buffer>, out: TensorMut<Self::Buffer>) -> Result<()>;
    /// `x[i] *= s`.
    fn scale(&self, x: TensorMut<Self::Buffer>, s: f32) -> Result<()>;
    /// Soft-capping: `x[i] = cap * tanh(x[i] / cap)`.
    fn softcap(&self, x: TensorMut<Self::Buffer>, cap: f32) -> Result<()>;
    /// `dst[t][0..width] = src[t][col..col + width]` (`src`: `[n, src_width]`, `dst`:
    /// `[n, width]`): one block of columns (one layer's slice of Gemma 4's per-layer inputs, say)
    /// as its own rows.
    fn copy_cols(&self, src: Tensor<Self::Buffer>, col: usize, dst: TensorMut<Self::Buffer>) -> Result<()>;
    /// `x[t][i] *= sigmoid(gate[t][i * gate_dim / dim])` (`x`: `[n, dim]`, `gate`:
    /// `[n, gate_dim]`): an elementwise gate (`gate_dim == dim`, Qwen3.5's gated attention) or
    /// one per row (`gate_dim == 1`, its shared expert).
    fn sigmoid_gate(&self, x: TensorMut<Self::Buffer>, gate: Tensor<Self::Buffer>) -> Result<()>;
    /// The per-head gates of a Gated DeltaNet, in place (`g`, `beta`: `[n, n_heads]`;
    /// `a_log_neg`, `dt_bias`: `[n_heads]`): `g = a_log_neg * softplus(g + dt_bias)` (the log of
    /// the state's decay) and `beta = sigmoid(beta)`.
    fn delta_net_gates(
        &self,
        g: TensorMut<Self::Buffer>,
        beta: TensorMut<Self::Buffer>,
        a_log_neg: Tensor<Self::Buffer>,
        dt_bias: Tensor<Self::Buffer>,
    ) -> Result<()>;
    /// Causal depthwise convolution then SiLU of each sequence's tokens (`x`, `out`:
    /// `[n, conv_dim]`; `weight`: `[conv_dim, conv_kernel]`), continuing from the sequence's
    /// state (`state`: `[n_slots, conv_state]`) and leaving its last inputs there. A sequence
    /// starting at position 0 starts from a zero state.
    fn ssm_conv(
        &self,
        x: Tensor<Self::Buffer>,
        weight: Tensor<Self::Buffer>,
        state: StateSlots<Self::Buffer>,
        out: TensorMut<Self::Buffer>,
        step: &Self::Step,
        p: &DeltaNetParams,
    ) -> Result<()>;
    /// The gated delta rule over each sequence's tokens, one token after the other: with q and
    /// k L2-normalized (q also scaled by 1/sqrt(head_dim)) from the convolved `x` (`[n, conv_dim]`),
    /// per value head `S = exp(g) S; S += k (beta (v - Sᵀk))ᵀ; out = Sᵀq`. `gates` are g and beta
    /// (`[n, n_v_heads]` each), `state` is `[n_slots, ssm_state]` and `out`
    /// `[n, n_v_heads * head_dim]`. A backend may compute a sequence's span of several tokens in
    /// the chunked form, which equals the recurrence up to rounding (the CPU backend does), so a
    /// prompt split over steps differently may round differently.
    fn delta_net(
        &self,
        x: Tensor<Self::Buffer>,
        gates: [Tensor<Self::Buffer>; 2],
        state: StateSlots<Self::Buffer>,
        out: TensorMut<Self::Buffer>,
        step: &Self::Step,
        p: &DeltaNetParams,
    ) -> Result<()>;
    /// [`Backend::delta_net`] with its gates from their projections: [`Backend::delta_net_gates`]
    /// of `projections` = [g, beta] with `gate_params` = [a_log_neg, dt_bias] in place first (a
    /// backend that applies them as the rule reads them leaves the projections as they are).
    #[allow(clippy::too_many_arguments)]
    fn delta_net_from_projections(
        &self,
        x: Tensor<Self::Buffer>,
        projections: [TensorMut<Self::Buffer>; 2],
        gate_params: [Tensor<Self::Buffer>; 2],
        state: StateSlots<Self::Buffer>,
        out: TensorMut<Self::Buffer>,
        step: &Self::Step,
        p: &DeltaNetParams,
    ) -> Result<()> {
        let ([mut g, mut beta], [a_log_neg, dt_bias]) = (projections, gate_params);
        self.delta_net_gates(g.reborrow(), beta.reborrow(), a_log_neg, dt_bias)?;
        self.delta_net(x, [g.as_ref(), beta.as_ref()], state, out, step, p)
    }
    /// [`Backend::attention`] with attention sinks (gpt-oss): one extra logit per head,
    /// `sinks[h]` (`[n_heads]`), joins every softmax row (its max and its sum) and has no value.
    fn attention_sinks(
        &self,
        q: Tensor<Self::Buffer>,
        cache: &Self::KvCache,
        sinks: Tensor<Self::Buffer>,
        out: TensorMut<Self::Buffer>,
        step: &Self::Step,
        p: &AttentionParams,
    ) -> Result<()>;
    /// Copies `src` into `dst`, both of one shape.
    fn copy(&self, src: Tensor<Self::Buffer>, dst: TensorMut<Self::Buffer>) -> Result<()>;
    /// `dst[i] = src[step.logit_rows[i]]` for every logits row of the step: `src` is
    /// `[n_tokens, dim]`, `dst` `[logit rows, dim]`.
    fn gather_rows(&self, src: Tensor<Self::Buffer>, dst: TensorMut<Self::Buffer>, step: &Self::Step) -> Result<()>;
    /// Samples one token per sample of the step from its row of `logits` (`[rows, n_vocab]`),
    /// with its settings, and stores them in the step.
    fn sample(&self, logits: Tensor<Self::Buffer>, step: &mut Self::Step) -> Result<()>;
    /// The tokens stored by the last `sample`, one per sample, in one copy.
    fn sampled_tokens(&self, step: &Self::Step, out: &mut [u32]) -> Result<()>;

    /// Runs `record`, which enqueues one whole step. A GPU backend records it
    /// the first time a `key` is seen and replays the recording afterwards, so
    /// `record` must enqueue the same work every time for the same key.
    fn run_step(&self, key: u64, record: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let _ = key;
        record()
    }
    /// Gets ready every kernel a model with these weights and attention shapes will run (a
    /// GPU backend compiles them in parallel), so the first step is not held up.
    fn prepare(&self, weights: &[&Self::Weight], attention: &AttentionParams, kv: &KvCacheSpec) -> Result<()> {
        let _ = (weights, attention, kv);
        Ok(())
    }

    /// Waits for all enqueued work.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    // Fusable compounds. Defaults compose the primitive ops; a backend may
    // override them with fused kernels that save launches and memory traffic.

    /// The router's logits `h·routerᵀ` into `logits` and, where given, a shared expert's gate
    /// logit `h·gateᵀ` into its `[n, 1]` rows: products of one input.
    fn router_logits(
        &self,
        h: Tensor<Self::Buffer>,
        router: &Self::Weight,
        logits: TensorMut<Self::Buffer>,
        shared_gate: Option<(&Self::Weight, TensorMut<Self::Buffer>)>,
    ) -> Result<()> {
        self.matmul(router, h, logits)?;
        match shared_gate {
            Some((gate, out)) => self.matmul(gate, h, out),
            None => Ok(()),
        }
    }

    /// The router's logits of `rms_norm(x) · norm.0` (a router with a norm of its own: Gemma
    /// 4) into `logits`; `h` (`[n, cols]`) receives the normed rows, or unspecified values
    /// where a backend applies the norm inside the product.
    fn normed_router_logits(
        &self,
        x: Tensor<Self::Buffer>,
        norm: (Tensor<Self::Buffer>, f32),
        mut h: TensorMut<Self::Buffer>,
        router: &Self::Weight,
        logits: TensorMut<Self::Buffer>,
    ) -> Result<()> {
        self.rms_norm(x, norm.0, h.reborrow(), norm.1)?;
        self.router_logits(h.as_ref(), router, logits, None)
    }

    /// `out = act(x·Wgᵀ) * (x·Wuᵀ)` for `w` = [gate, up], using `scratch` (of `out`'s shape)
    /// for the two products.
    fn ffn_gate_up(
        &self,
        (w, act): ([&Self::Weight; 2], Activation),
        x: Tensor<Self::Buffer>,
        scratch: [TensorMut<Self::Buffer>; 2],
        out: TensorMut<Self::Buffer>,
    ) -> Result<()> {
        let [mut gate, mut up] = scratch;
        self.matmul(w[0], x, gate.reborrow())?;
        self.matmul(w[1], x, up.reborrow())?;
        self.gated(act, gate.as_ref(), up.as_ref(), out)
    }

    /// `out = act(gate) * up` for `act` (the matching elementwise op).
    fn gated(&self, act: Activation, gate: Tensor<Self::Buffer>, up: Tensor<Self::Buffer>, out: TensorMut<Self::Buffer>) -> Result<()> {
        match act {
            Activation::Silu => self.swiglu(gate, up, out),
            Activation::GeluTanh => self.geglu(gate, up, out),
            Activation::SwiGluOai { alpha, limit } => self.swiglu_oai(gate, up, out, alpha, limit),
        }
    }

    /// A mixture of experts' gated products for every slot: `out[t][j] = act(x[t]·gate[e] +
    /// gate_bias[e]) * (x[t]·up[e] + up_bias[e])` with `e = ids[t][j]` (`[n, n_used, n_ff]`),
    /// using `scratch` (of `out`'s shape) for the two products.
    fn moe_gate_up(
        &self,
        experts: GatedExperts<Self>,
        x: Tensor<Self::Buffer>,
        ids: Tensor<Self::Buffer>,
        scratch: [TensorMut<Self::Buffer>; 2],
        out: TensorMut<Self::Buffer>,
    ) -> Result<()> {
        compose_moe_gate_up(self, experts, x, ids, scratch, out)
    }

    /// [`Backend::moe_matmul`] plus each slot's expert bias (`bias`: `[n_experts, rows]`), as
    /// [`Backend::moe_add_bias`] adds it.
    fn moe_matmul_bias(
        &self,
        experts: &[Self::Weight],
        bias: Tensor<Self::Buffer>,
        x: Tensor<Self::Buffer>,
        ids: Tensor<Self::Buffer>,
        mut out: TensorMut<Self::Buffer>,
        input: ExpertInput,
    ) -> Result<()> {
        self.moe_matmul(experts, x, ids, out.reborrow(), input)?;
        self.moe_add_bias(out, bias, ids)
    }

    /// [`Backend::rms_norm`] of `x` with `norm` = (weight, eps) into `h`, then the product of the
    /// result with each weight of `w` into the matching `out` (q, k and v; a DeltaNet's input
    /// projections; a gate and up): one input for several products, which a backend that
    /// converts its input per product converts once. `h` receives the normed rows (or, in a
    /// backend that normalizes straight into its product input, is left unspecified).
    /// `prepared`: that input as the previous residual add left it ([`NormChain`]). Each
    /// product adds its bias, where it has one.
    fn norm_matmuls<const N: usize>(
        &self,
        x: Tensor<Self::Buffer>,
        norm: (Tensor<Self::Buffer>, f32),
        h: TensorMut<Self::Buffer>,
        w: [Linear<'_, Self>; N],
        out: [TensorMut<Self::Buffer>; N],
        _prepared: Option<Self::NormedInput>,
    ) -> Result<()> {
        compose_norm_matmuls(self, x, norm, h, w, out)
    }

    /// [`Backend::rms_norm`] of `x` into `h` as in [`Backend::norm_matmuls`], then
    /// [`Backend::ffn_gate_up`] of the result into `out`.
    fn norm_ffn_gate_up(
        &self,
        x: Tensor<Self::Buffer>,
        norm: (Tensor<Self::Buffer>, f32),
        mut h: TensorMut<Self::Buffer>,
        gated: ([&Self::Weight; 2], Activation),
        scratch: [TensorMut<Self::Buffer>; 2],
        out: TensorMut<Self::Buffer>,
    ) -> Result<()> {
        self.rms_norm(x, norm.0, h.reborrow(), norm.1)?;
        self.ffn_gate_up(gated, h.as_ref(), scratch, out)
    }

    /// The dense gated FFN of an input normed already: `out = down(act(gate(h)) * up(h))`
    /// (a mixture of experts' shared expert, whose input the routed experts' norm wrote; a
    /// backend may reuse what that norm prepared for them). `act` holds the activation or
    /// unspecified values, as in [`Backend::norm_gated_ffn`].
    fn gated_ffn(
        &self,
        h: Tensor<Self::Buffer>,
        ffn: GatedFfn<Self>,
        scratch: [TensorMut<Self::Buffer>; 2],
        mut act: TensorMut<Self::Buffer>,
        out: TensorMut<Self::Buffer>,
    ) -> Result<()> {
        self.ffn_gate_up(([ffn.gate, ffn.up], ffn.act), h, scratch, act.reborrow())?;
        self.matmul(ffn.down, act.as_ref(), out)
    }

    /// The dense gated FFN into `out`: `out = down(act(gate(h)) * up(h))` with
    /// `h = rms_norm(x)` (a mixture of experts' shared expert, Gemma's FFNs);
    /// [`Backend::norm_ffn_gate_up`] into `act`, then the down product. A backend may hand the
    /// activation to the down product its own way, as in [`Backend::norm_gated_ffn_add`]
    /// (`h`, `scratch` and `act` then hold unspecified values).
    #[allow(clippy::too_many_arguments)]
    fn norm_gated_ffn(
        &self,
        x: Tensor<Self::Buffer>,
        norm: (Tensor<Self::Buffer>, f32),
        h: TensorMut<Self::Buffer>,
        ffn: GatedFfn<Self>,
        scratch: [TensorMut<Self::Buffer>; 2],
        mut act: TensorMut<Self::Buffer>,
        out: TensorMut<Self::Buffer>,
    ) -> Result<()> {
        self.norm_ffn_gate_up(x, norm, h, ([ffn.gate, ffn.up], ffn.act), scratch, act.reborrow())?;
        self.matmul(ffn.down, act.as_ref(), out)
    }

    /// The dense gated FFN added to the residual: `x += down(act(gate(h)) * up(h))` with
    /// `h = rms_norm(x)`; [`Backend::norm_ffn_gate_up`] into `act`, then
    /// [`Backend::matmul_add`] of the down product. A backend may hand the activation to the
    /// down product its own way (CUDA: quantized by the gate/up launch itself), and take or
    /// prepare norms along `chain`, returning what it prepared for `chain.next`.
    #[allow(clippy::too_many_arguments)]
    fn norm_gated_ffn_add(
        &self,
        x: TensorMut<Self::Buffer>,
        norm: (Tensor<Self::Buffer>, f32),
        h: TensorMut<Self::Buffer>,
        ffn: GatedFfn<Self>,
        scratch: [TensorMut<Self::Buffer>; 2],
        mut act: TensorMut<Self::Buffer>,
        tmp: TensorMut<Self::Buffer>,
        _chain: NormChain<Self>,
    ) -> Result<Option<Self::NormedInput>> {
        self.norm_ffn_gate_up(x.as_ref(), norm, h, ([ffn.gate, ffn.up], ffn.act), scratch, act.reborrow())?;
        self.matmul_add(ffn.down, act.as_ref(), x, tmp)?;
        Ok(None)
    }

    /// Whether the attention of this layer and step can take its prologue itself
    /// ([`AttentionArgs::prologue`], for [`Backend::attention_matmul_add`]); the caller then
    /// skips [`Backend::attention_prologue`].
    fn defers_attention_prologue(&self, _cache: &Self::KvCache, _step: &Self::Step, _params: &AttentionParams) -> bool {
        false
    }

    /// The attention prologue: optional per-head RMSNorm of q and k, rotary embedding of both
    /// with `inv_freq`, and the step's keys and values stored in the cache. Afterwards `qkv.q`
    /// holds the final queries; `qkv.k` and the norm's scratch hold unspecified values.
    fn attention_prologue(
        &self,
        qkv: Qkv<Self::Buffer>,
        qk_norm: Option<QkNorm<Self::Buffer>>,
        inv_freq: Tensor<Self::Buffer>,
        p: &RopeParams,
        cache: &mut Self::KvCache,
        step: &Self::Step,
    ) -> Result<()> {
        compose_attention_prologue(self, qkv, qk_norm, (inv_freq, p), cache, step)
    }

    /// The experts' input and their routing: `h = rms_norm(x) · norm.0` (`norm` = (weight, eps);
    /// `x`, `h`: `[n, cols]`), the router's logits of `rms_norm(x) · router.norm` (or of `h`)
    /// plus its bias into `logits` (`[n, n_experts]`), then [`Backend::moe_route`] into `ids` and
    /// `weights` (`[n, n_used]`). A backend may also prepare `h` for the expert products that
    /// follow (CUDA: their int8 input, in the same launch).
    fn moe_norm_route(
        &self,
        x: Tensor<Self::Buffer>,
        norm: (Tensor<Self::Buffer>, f32),
        router: RouterArgs<Self>,
        h: TensorMut<Self::Buffer>,
        logits: TensorMut<Self::Buffer>,
        routes: [TensorMut<Self::Buffer>; 2],
    ) -> Result<()> {
        compose_moe_norm_route(self, x, norm, router, h, logits, routes, |x, norm, h| self.rms_norm(x, norm.0, h, norm.1))
    }

    /// `residual[t] += sum_j weights[t][j] * y[t][j]` ([`Backend::moe_combine`] added to the
    /// residual), using `tmp` (of `residual`'s shape) as scratch.
    fn moe_combine_add(
        &self,
        y: Tensor<Self::Buffer>,
        weights: Tensor<Self::Buffer>,
        residual: TensorMut<Self::Buffer>,
        mut tmp: TensorMut<Self::Buffer>,
    ) -> Result<()> {
        self.moe_combine(y, weights, tmp.reborrow())?;
        self.add(residual, tmp.as_ref())
    }

    /// A Gated DeltaNet's output projection added to the residual:
    /// `residual += (silu(z) * rms_norm(x) · weight) · Wᵀ` ([`GatedNorm`]), with `scratch` =
    /// [the normed x `[n, heads, head_dim]`, the gated rows `[n, heads * head_dim]`] and `tmp`
    /// (of `residual`'s shape), which a backend that feeds the product straight leaves
    /// unspecified.
    fn gated_norm_matmul_add(
        &self,
        g: GatedNorm<Self::Buffer>,
        scratch: [TensorMut<Self::Buffer>; 2],
        w: &Self::Weight,
        residual: TensorMut<Self::Buffer>,
        tmp: TensorMut<Self::Buffer>,
    ) -> Result<()> {
        compose_gated_norm_matmul_add(self, g, scratch, w, residual, tmp)
    }

    /// [`Backend::moe_combine_add`] with a shared expert beside the routed ones:
    /// `residual[t] += sum_j weights[t][j] * y[t][j] + sigmoid(gate[t]) * shared[t]`, where
    /// `shared` = (the shared expert's output `[n, dim]`, left unspecified; its gate logit
    /// `[n, 1]`).
    fn moe_combine_shared_add(
        &self,
        y: Tensor<Self::Buffer>,
        weights: Tensor<Self::Buffer>,
        (mut shared, gate): (TensorMut<Self::Buffer>, Tensor<Self::Buffer>),
        residual: TensorMut<Self::Buffer>,
        mut tmp: TensorMut<Self::Buffer>,
    ) -> Result<()> {
        self.moe_combine(y, weights, tmp.reborrow())?;
        self.sigmoid_gate(shared.reborrow(), gate)?;
        self.add(tmp.reborrow(), shared.as_ref())?;
        self.add(residual, tmp.as_ref())
    }

    /// The attention of `args` into `out` ([`Backend::attention`], or [`Backend::attention_sinks`]
    /// with sinks), then `residual += out·woᵀ (+ wo's bias)` with `tmp` as scratch, as
    /// [`Backend::linear_add`].
    /// A backend may hand the attention's output to the product in the product's own input
    /// format (the CUDA one: int8, written by the attention kernel itself), and prepare `next`
    /// ([`NormChain`]) in the product, returning what it prepared.
    fn attention_matmul_add(
        &self,
        args: AttentionArgs<'_, Self>,
        mut out: TensorMut<Self::Buffer>,
        wo: Linear<'_, Self>,
        residual: TensorMut<Self::Buffer>,
        tmp: TensorMut<Self::Buffer>,
        _next: Option<(Tensor<Self::Buffer>, f32)>,
    ) -> Result<Option<Self::NormedInput>> {
        compose_attention(self, args, out.reborrow())?;
        self.linear_add(wo, out.as_ref(), residual, tmp)?;
        Ok(None)
    }

    /// The attention of `args` into `out`, then `proj = out·woᵀ` (Gemma, whose blocks norm the
    /// projection before the residual add). A backend may hand the attention's output to the
    /// product in the product's own input format, as in [`Backend::attention_matmul_add`].
    fn attention_matmul(
        &self,
        args: AttentionArgs<'_, Self>,
        mut out: TensorMut<Self::Buffer>,
        wo: &Self::Weight,
        proj: TensorMut<Self::Buffer>,
    ) -> Result<()> {
        compose_attention(self, args, out.reborrow())?;
        self.matmul(wo, out.as_ref(), proj)
    }

    /// `residual += x·Wᵀ + bias` ([`Backend::matmul_add`] where `w` has no bias).
    fn linear_add(&self, w: Linear<'_, Self>, x: Tensor<Self::Buffer>, residual: TensorMut<Self::Buffer>, mut tmp: TensorMut<Self::Buffer>) -> Result<()> {
        let Some(bias) = w.bias else {
            return self.matmul_add(w.weight, x, residual, tmp);
        };
        self.matmul(w.weight, x, tmp.reborrow())?;
        self.add_bias(tmp.reborrow(), bias)?;
        self.add(residual, tmp.as_ref())
    }

    /// `residual += x·Wᵀ`, using `tmp` (of `residual`'s shape) as scratch.
    fn matmul_add(&self, w: &Self::Weight, x: Tensor<Self::Buffer>, residual: TensorMut<Self::Buffer>, mut tmp: TensorMut<Self::Buffer>) -> Result<()> {
        self.matmul(w, x, tmp.reborrow())?;
        self.add(residual, tmp.as_ref())
    }
}
