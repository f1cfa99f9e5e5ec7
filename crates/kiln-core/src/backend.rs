//! The operations a transformer forward pass needs, as one trait.
//!
//! Every op writes into a buffer the caller allocated up front, and every value
//! that changes from one step to the next (token ids, positions, sampler state)
//! lives in the backend's `Step` object, written once per step by
//! [`Backend::write_step`]. A GPU backend can therefore record a whole step once
//! (a CUDA graph) and replay it: the kernels read positions and tokens from
//! device memory instead of taking them as launch arguments.
//!
//! Shapes: activations are row-major `[n_tokens][width]` f32 buffers. A weight
//! matrix has `rows` outputs of `cols` inputs each (GGUF `ne = [cols, rows]`),
//! and `matmul` computes `out[t][r] = sum_c x[t][c] * W[r][c]`.

use std::ops::Range;
use std::sync::Arc;

use kiln_quant::GgmlType;

use crate::plan::{FlatPlan, KvCacheSpec, StepCapacity};

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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeKind {
    /// Rotates pairs (x[2i], x[2i+1]) (llama).
    Normal,
    /// Rotates pairs (x[i], x[i + n_rot/2]) (GPT-NeoX, qwen2/3).
    Neox,
}

/// Rotary embedding of a `[n_tokens][n_heads][head_dim]` buffer: pair `i` of the
/// first `n_rot` dims of the token at position `p` is rotated by `p * inv_freq[i]`.
/// `inv_freq` (length `n_rot / 2`) already includes any frequency scaling.
#[derive(Clone, Copy, Debug)]
pub struct RopeParams {
    pub kind: RopeKind,
    pub n_heads: usize,
    pub head_dim: usize,
    pub n_rot: usize,
}

/// Attention geometry for one layer.
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
/// their weights: softmax over all `n_experts`, the `n_used` most probable (ties: lower id).
#[derive(Clone, Copy, Debug)]
pub struct RouterParams {
    pub n_experts: usize,
    pub n_used: usize,
    /// Divide the chosen probabilities by their sum (then they equal a softmax over the chosen).
    pub renormalize: bool,
}

/// Shapes of a Gated DeltaNet layer (Qwen3.5) for its recurrent ops. Its convolution runs over
/// `conv_dim() = (2 * n_k_heads + n_v_heads) * head_dim` channels: q, k and v side by side.
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

pub trait Backend: Send + Sync + 'static {
    /// An f32 buffer in the backend's memory.
    type Buffer: Send + Sync;
    /// A weight matrix in whatever layout the backend chose at upload.
    type Weight: Send + Sync;
    /// Per-step values read by the ops: the step's [`crate::FlatPlan`] (tokens, positions,
    /// cache rows, block tables, samplers) and the sampled tokens.
    type Step: Send + Sync;
    /// One layer's paged K and V cache.
    type KvCache: Send + Sync;

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

    /// `out[t] = table[step.tokens[t]]` for the first `n` tokens.
    fn embed(&self, table: &Self::Weight, step: &Self::Step, out: &mut Self::Buffer, n: usize) -> Result<()>;
    /// Per row of `dim` values: `out = x / sqrt(mean(x²) + eps) * weight`.
    fn rms_norm(&self, x: &Self::Buffer, weight: &Self::Buffer, out: &mut Self::Buffer, rows: usize, dim: usize, eps: f32) -> Result<()>;
    /// `out[t][r] = x[t] · W[r]` for `n` tokens.
    fn matmul(&self, w: &Self::Weight, x: &Self::Buffer, out: &mut Self::Buffer, n: usize) -> Result<()>;
    /// `x[t][i] += bias[i]`.
    fn add_bias(&self, x: &mut Self::Buffer, bias: &Self::Buffer, n: usize, dim: usize) -> Result<()>;
    /// `x[i] += y[i]` for the first `len` values.
    fn add(&self, x: &mut Self::Buffer, y: &Self::Buffer, len: usize) -> Result<()>;
    /// `out[i] = silu(gate[i]) * up[i]`.
    fn swiglu(&self, gate: &Self::Buffer, up: &Self::Buffer, out: &mut Self::Buffer, len: usize) -> Result<()>;
    /// Rotary embedding in place, each token at its position in `step`.
    fn rope(&self, x: &mut Self::Buffer, inv_freq: &Self::Buffer, step: &Self::Step, n: usize, p: &RopeParams) -> Result<()>;
    /// Stores `n` tokens of K and V (`[n][cache width]`) at their cache rows (the step's slots).
    fn kv_store(&self, k: &Self::Buffer, v: &Self::Buffer, cache: &mut Self::KvCache, step: &Self::Step, n: usize) -> Result<()>;
    /// Causal grouped-query attention of `n` query tokens, each over positions `0..=its
    /// position` of its own sequence, read through that sequence's block table.
    fn attention(&self, q: &Self::Buffer, cache: &Self::KvCache, out: &mut Self::Buffer, step: &Self::Step, n: usize, p: &AttentionParams) -> Result<()>;
    /// Chooses the experts of `n` tokens from their router logits (`[n][n_experts]`): expert ids
    /// into `ids` and their weights into `weights`, both `[n][n_used]`, each weight times
    /// `expert_scale[id]` where given (after any renormalization). Ids are stored as f32 (exact
    /// for any expert count below 2^24), so they live in ordinary buffers on the device.
    #[allow(clippy::too_many_arguments)]
    fn moe_route(
        &self,
        logits: &Self::Buffer,
        expert_scale: Option<&Self::Buffer>,
        ids: &mut Self::Buffer,
        weights: &mut Self::Buffer,
        n: usize,
        p: &RouterParams,
    ) -> Result<()>;
    /// Expert-indexed product: `out[t][j] = x_in · experts[ids[t][j]]` for each token `t` and slot
    /// `j < n_used`, where `x_in` is `x[t]` or `x[t][j]` as `input` says; `out` is
    /// `[n][n_used][rows]`. Only the chosen experts' weights are read.
    #[allow(clippy::too_many_arguments)]
    fn moe_matmul(
        &self,
        experts: &[Self::Weight],
        x: &Self::Buffer,
        ids: &Self::Buffer,
        out: &mut Self::Buffer,
        n: usize,
        n_used: usize,
        input: ExpertInput,
    ) -> Result<()>;
    /// `x[t][j] += bias[ids[t][j]]` for the `n_used` slots of `x` (`[n][n_used][dim]`); `bias` is
    /// `[n_experts][dim]`.
    fn moe_add_bias(&self, x: &mut Self::Buffer, bias: &Self::Buffer, ids: &Self::Buffer, n: usize, n_used: usize, dim: usize) -> Result<()>;
    /// gpt-oss's clamped SwiGLU: `out = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`, `g = min(gate, limit)`.
    fn swiglu_oai(&self, gate: &Self::Buffer, up: &Self::Buffer, out: &mut Self::Buffer, len: usize, alpha: f32, limit: f32) -> Result<()>;
    /// `out[t] = sum_j weights[t][j] * y[t][j]` over the `n_used` slots of `y` (`[n][n_used][dim]`).
    fn moe_combine(&self, y: &Self::Buffer, weights: &Self::Buffer, out: &mut Self::Buffer, n: usize, n_used: usize, dim: usize) -> Result<()>;
    /// `out[i] = gelu_tanh(gate[i]) * up[i]` (GeGLU with the tanh approximation of GELU).
    fn geglu(&self, gate: &Self::Buffer, up: &Self::Buffer, out: &mut Self::Buffer, len: usize) -> Result<()>;
    /// `x[i] *= s` for the first `len` values.
    fn scale(&self, x: &mut Self::Buffer, s: f32, len: usize) -> Result<()>;
    /// Soft-capping: `x[i] = cap * tanh(x[i] / cap)` for the first `len` values.
    fn softcap(&self, x: &mut Self::Buffer, cap: f32, len: usize) -> Result<()>;
    /// `dst[t][0..width] = src[t][col..col + width]` for `n` rows of `src_width` values: one block
    /// of columns (one layer's slice of Gemma 4's per-layer inputs, say) as its own rows.
    fn copy_cols(&self, src: &Self::Buffer, src_width: usize, col: usize, dst: &mut Self::Buffer, width: usize, n: usize) -> Result<()>;
    /// `x[t][i] *= sigmoid(gate[t][i * gate_dim / dim])` for `n` rows of `dim`: an elementwise
    /// gate (`gate_dim == dim`, Qwen3.5's gated attention) or one per row (`gate_dim == 1`, its
    /// shared expert).
    fn sigmoid_gate(&self, x: &mut Self::Buffer, gate: &Self::Buffer, n: usize, dim: usize, gate_dim: usize) -> Result<()>;
    /// The per-head gates of a Gated DeltaNet, in place for `n` tokens of `n_heads`:
    /// `g = a_log_neg * softplus(g + dt_bias)` (the log of the state's decay) and `beta = sigmoid(beta)`.
    fn delta_net_gates(
        &self,
        g: &mut Self::Buffer,
        beta: &mut Self::Buffer,
        a_log_neg: &Self::Buffer,
        dt_bias: &Self::Buffer,
        n: usize,
        n_heads: usize,
    ) -> Result<()>;
    /// Causal depthwise convolution then SiLU of each sequence's tokens (`x`, `out`:
    /// `[n][conv_dim]`; `weight`: `[conv_dim][conv_kernel]`), continuing from the sequence's
    /// state and leaving its last inputs there. `slots[s]` (f32) is the state slot of the step's
    /// sequence `s`; a sequence starting at position 0 starts from a zero state.
    #[allow(clippy::too_many_arguments)]
    fn ssm_conv(
        &self,
        x: &Self::Buffer,
        weight: &Self::Buffer,
        state: &mut Self::Buffer,
        slots: &Self::Buffer,
        out: &mut Self::Buffer,
        step: &Self::Step,
        n: usize,
        p: &DeltaNetParams,
    ) -> Result<()>;
    /// The gated delta rule over each sequence's tokens, one token after the other: with q and
    /// k L2-normalized (q also scaled by 1/sqrt(head_dim)) from the convolved `x`, per value head
    /// `S = exp(g) S; S += k (beta (v - Sᵀk))ᵀ; out = Sᵀq`. States as in [`Backend::ssm_conv`];
    /// `out` is `[n][n_v_heads * head_dim]`. A backend may compute a sequence's span of several
    /// tokens in the chunked form, which equals the recurrence up to rounding (the CPU backend
    /// does), so a prompt split over steps differently may round differently.
    #[allow(clippy::too_many_arguments)]
    fn delta_net(
        &self,
        x: &Self::Buffer,
        g: &Self::Buffer,
        beta: &Self::Buffer,
        state: &mut Self::Buffer,
        slots: &Self::Buffer,
        out: &mut Self::Buffer,
        step: &Self::Step,
        n: usize,
        p: &DeltaNetParams,
    ) -> Result<()>;
    /// [`Backend::attention`] with attention sinks (gpt-oss): one extra logit per head, `sinks[h]`,
    /// joins every softmax row (its max and its sum) and has no value.
    #[allow(clippy::too_many_arguments)]
    fn attention_sinks(
        &self,
        q: &Self::Buffer,
        cache: &Self::KvCache,
        sinks: &Self::Buffer,
        out: &mut Self::Buffer,
        step: &Self::Step,
        n: usize,
        p: &AttentionParams,
    ) -> Result<()>;
    /// Copies `len` values of `src` into `dst`.
    fn copy(&self, src: &Self::Buffer, dst: &mut Self::Buffer, len: usize) -> Result<()>;
    /// `dst[i] = src[step.logit_rows[i]]` for every logits row of the step, rows of `dim` values.
    fn gather_rows(&self, src: &Self::Buffer, dst: &mut Self::Buffer, step: &Self::Step, dim: usize) -> Result<()>;
    /// Samples one token per sample of the step from its row of `logits` (`[rows][n_vocab]`),
    /// with its settings, and stores them in the step.
    fn sample(&self, logits: &Self::Buffer, n_vocab: usize, step: &mut Self::Step) -> Result<()>;
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

    /// `out = silu(x·Wgᵀ) * (x·Wuᵀ)`, using `gate`/`up` as scratch.
    #[allow(clippy::too_many_arguments)]
    fn ffn_gate_up(
        &self,
        w_gate: &Self::Weight,
        w_up: &Self::Weight,
        x: &Self::Buffer,
        gate: &mut Self::Buffer,
        up: &mut Self::Buffer,
        out: &mut Self::Buffer,
        n: usize,
        n_ff: usize,
    ) -> Result<()> {
        self.matmul(w_gate, x, gate, n)?;
        self.matmul(w_up, x, up, n)?;
        self.swiglu(gate, up, out, n * n_ff)
    }

    /// The SwiGLU activation of a mixture of experts' gate and up products for every slot:
    /// `out[t][j] = silu(x[t]·gate[ids[t][j]]) * (x[t]·up[ids[t][j]])` (`[n][n_used][n_ff]`),
    /// using `gate_out`/`up_out` as scratch.
    #[allow(clippy::too_many_arguments)]
    fn moe_gate_up_swiglu(
        &self,
        gate: &[Self::Weight],
        up: &[Self::Weight],
        x: &Self::Buffer,
        ids: &Self::Buffer,
        gate_out: &mut Self::Buffer,
        up_out: &mut Self::Buffer,
        out: &mut Self::Buffer,
        n: usize,
        n_used: usize,
        n_ff: usize,
    ) -> Result<()> {
        self.moe_matmul(gate, x, ids, gate_out, n, n_used, ExpertInput::PerToken)?;
        self.moe_matmul(up, x, ids, up_out, n, n_used, ExpertInput::PerToken)?;
        self.swiglu(gate_out, up_out, out, n * n_used * n_ff)
    }

    /// `q = x·Wqᵀ`, `k = x·Wkᵀ`, `v = x·Wvᵀ`: one input for three products, which a
    /// backend that converts its input per product can convert once.
    #[allow(clippy::too_many_arguments)]
    fn matmul_qkv(
        &self,
        wq: &Self::Weight,
        wk: &Self::Weight,
        wv: &Self::Weight,
        x: &Self::Buffer,
        q: &mut Self::Buffer,
        k: &mut Self::Buffer,
        v: &mut Self::Buffer,
        n: usize,
    ) -> Result<()> {
        self.matmul(wq, x, q, n)?;
        self.matmul(wk, x, k, n)?;
        self.matmul(wv, x, v, n)
    }

    /// [`Backend::rms_norm`] of `n` rows of `dim` values of `x` with `norm`, then
    /// [`Backend::matmul_qkv`] of the result; `h` receives the normed rows (or, in a backend
    /// that normalizes straight into its product input, is left unspecified).
    #[allow(clippy::too_many_arguments)]
    fn norm_matmul_qkv(
        &self,
        x: &Self::Buffer,
        norm: &Self::Buffer,
        eps: f32,
        h: &mut Self::Buffer,
        wq: &Self::Weight,
        wk: &Self::Weight,
        wv: &Self::Weight,
        q: &mut Self::Buffer,
        k: &mut Self::Buffer,
        v: &mut Self::Buffer,
        n: usize,
        dim: usize,
    ) -> Result<()> {
        self.rms_norm(x, norm, h, n, dim, eps)?;
        self.matmul_qkv(wq, wk, wv, h, q, k, v, n)
    }

    /// [`Backend::rms_norm`] of `x` into `h` as in [`Backend::norm_matmul_qkv`], then
    /// [`Backend::ffn_gate_up`] of the result into `out`.
    #[allow(clippy::too_many_arguments)]
    fn norm_ffn_gate_up(
        &self,
        x: &Self::Buffer,
        norm: &Self::Buffer,
        eps: f32,
        h: &mut Self::Buffer,
        w_gate: &Self::Weight,
        w_up: &Self::Weight,
        gate: &mut Self::Buffer,
        up: &mut Self::Buffer,
        out: &mut Self::Buffer,
        n: usize,
        dim: usize,
        n_ff: usize,
    ) -> Result<()> {
        self.rms_norm(x, norm, h, n, dim, eps)?;
        self.ffn_gate_up(w_gate, w_up, h, gate, up, out, n, n_ff)
    }

    /// The attention prologue: optional per-head RMSNorm of q and k
    /// (`qk_norm` = weights and eps), rotary embedding of both, and the step's
    /// keys and values stored in the cache. Afterwards `q` holds the final
    /// queries; `k` and the scratch buffers hold unspecified values.
    #[allow(clippy::too_many_arguments)]
    fn attention_prologue(
        &self,
        q: &mut Self::Buffer,
        k: &mut Self::Buffer,
        v: &Self::Buffer,
        qk_norm: Option<(&Self::Buffer, &Self::Buffer, f32)>,
        scratch: (&mut Self::Buffer, &mut Self::Buffer),
        inv_freq: &Self::Buffer,
        cache: &mut Self::KvCache,
        step: &Self::Step,
        n: usize,
        q_rope: &RopeParams,
        n_kv_heads: usize,
    ) -> Result<()> {
        let k_rope = RopeParams { n_heads: n_kv_heads, ..*q_rope };
        let q_width = q_rope.n_heads * q_rope.head_dim;
        let k = match qk_norm {
            Some((q_norm, k_norm, eps)) => {
                let (q_normed, k_normed) = scratch;
                self.rms_norm(q, q_norm, q_normed, n * q_rope.n_heads, q_rope.head_dim, eps)?;
                self.copy(q_normed, q, n * q_width)?;
                self.rms_norm(k, k_norm, k_normed, n * n_kv_heads, q_rope.head_dim, eps)?;
                k_normed
            }
            None => k,
        };
        self.rope(q, inv_freq, step, n, q_rope)?;
        self.rope(k, inv_freq, step, n, &k_rope)?;
        self.kv_store(k, v, cache, step, n)
    }

    /// `residual += x·Wᵀ`, using `tmp` as scratch.
    fn matmul_add(&self, w: &Self::Weight, x: &Self::Buffer, residual: &mut Self::Buffer, tmp: &mut Self::Buffer, n: usize, dim: usize) -> Result<()> {
        self.matmul(w, x, tmp, n)?;
        self.add(residual, tmp, n * dim)
    }
}
