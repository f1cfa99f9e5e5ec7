//! Attention over the paged, typed KV cache for every token of a batched step
//! (`kernels/paged_attention.cu`, prefill in `kernels/paged_prefill.cu`). Each token attends causally to its own sequence's positions,
//! read through that sequence's block table in the step block (`kernels/plan.cuh`).
//!
//! Two paths: the split (flash-decoding) kernels, whose grid depends on shapes only, so a
//! captured decode step replays as sequences grow; and a tensor-core flash-attention kernel
//! over the step's prefill tiles. [`PagedAttention::attention`] picks one from the step's counts.
//!
//! The split count of a decode grid is measured, not guessed: the first uncaptured automatic
//! call for a (token count, shapes) key times a few candidates on a synthetic long-context step
//! and keeps the fastest for that key for good, so captured graphs stay valid.

// `usize::is_multiple_of` needs Rust 1.87; the workspace supports 1.85.
#![allow(clippy::manual_is_multiple_of)]

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use cudarc::driver::sys::CUstreamCaptureStatus;
use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg};
use kiln_core::backend::AttentionParams;
use kiln_core::plan::{KvCacheSpec, KvType, KV_BLOCK_SIZE};

pub use crate::kv::cache_bytes;
use crate::kv::{kv_type_code, KvView};
use crate::matvec::ActivationTarget;
use crate::plan_words::word;
use crate::{CudaDevice, CudaError};

mod kernels;
mod split_count;

use kernels::{decode_on_tensor_cores, decode_shared_bytes, min_chunk, Kernels, Key};
use split_count::GridKey;
pub use split_count::SplitChoice;

/// `paged_decode.cuh`'s DEC_THREADS, DEC_TILE, DEC_MIN_CHUNK_MMA / _CORES and DEC_MAX_SPLITS.
const DEC_THREADS: u32 = 128;
const DEC_TILE: usize = 32;
const DEC_MIN_CHUNK_MMA: usize = 256;
const DEC_MIN_CHUNK_CORES: usize = 32;
const DEC_MAX_SPLITS: usize = 256;
/// `paged_attention.cu`'s MD_WARPS_NARROW / _WIDE, MD_ROWS and MD_STAGES (the tensor-core split
/// kernels' blocks and stages).
const MD_WARPS_NARROW: usize = 4;
const MD_WARPS_WIDE: usize = 8;
const MD_ROWS: usize = 16;
const MD_STAGES: usize = 3;
/// `paged_prefill.cu`'s FA_THREADS and FA_KV.
const FA_THREADS: u32 = 128;
const FA_KV: usize = 64;
/// Cap on the split partials; long batches use fewer splits instead.
const WORKSPACE_MAX_BYTES: usize = 64 << 20;
/// Largest head dimension (Gemma 4's global layers: 512): the prefill kernel's K and V tiles
/// must fit shared memory.
pub const MAX_HEAD_DIM: usize = 512;
/// Dynamic shared memory a block may opt into on sm_90 (227 KiB).
const MAX_SHARED_BYTES: usize = 227 * 1024;

/// Shapes of one layer's attention.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PagedAttentionParams {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Rows of each cache buffer (`n_blocks * KV_BLOCK_SIZE`).
    pub rows: usize,
    /// Longest sequence the engine allows; with the token count it fixes the decode grid.
    pub max_seq_len: usize,
    pub scale: f32,
    pub k_type: KvType,
    pub v_type: KvType,
    /// Sliding window: a token at position `p` sees only `p + 1 - window ..= p`.
    pub window: Option<usize>,
}

impl PagedAttentionParams {
    /// The launch parameters of a layer with this geometry over this cache.
    pub fn of_layer(p: &AttentionParams, kv: &KvCacheSpec) -> PagedAttentionParams {
        PagedAttentionParams {
            n_heads: p.n_heads,
            n_kv_heads: p.n_kv_heads,
            head_dim: p.head_dim,
            rows: kv.rows(),
            max_seq_len: p.max_seq_len,
            scale: p.scale,
            k_type: kv.k_type,
            v_type: kv.v_type,
            window: p.window,
        }
    }
}

/// What one attention call reads: the queries, the caches, the step block, and the sink logits
/// of a model that has them (gpt-oss: one per query head, joining every softmax row).
#[derive(Clone, Copy)]
pub struct AttentionInputs<'a> {
    pub q: &'a CudaSlice<f32>,
    pub kv: &'a KvView,
    pub step: &'a CudaSlice<u32>,
    pub sinks: Option<&'a CudaSlice<f32>>,
    /// The attention prologue taken by the decode kernel (`q` then as projected); only for a
    /// decode step of one token per sequence on tensor cores ([`PagedAttention::takes_prologue`]).
    pub prologue: Option<PrologueInputs<'a>>,
}

/// The operands of the attention prologue in the decode kernel: keys `[n, n_kv_heads,
/// head_dim]` and values as projected, the q/k norm weights (`head_dim` each) and eps, the rope
/// table (`n_rot / 2` frequencies) and kind.
#[derive(Clone, Copy)]
pub struct PrologueInputs<'a> {
    pub k: &'a CudaSlice<f32>,
    pub v: &'a CudaSlice<f32>,
    pub qk_norm: Option<(&'a CudaSlice<f32>, &'a CudaSlice<f32>, f32)>,
    pub inv_freq: &'a CudaSlice<f32>,
    pub n_rot: usize,
    pub neox: bool,
}

/// The lengths of a prologue's operands, for [`PagedAttentionParams::check_prologue`].
struct PrologueLens {
    k: usize,
    v: usize,
    norms: Option<(usize, usize)>,
    inv_freq: usize,
    n_rot: usize,
}

/// `DecodePrologue` of paged_attention.cu, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct DecodePrologueArg {
    k: u64,
    v: u64,
    q_norm: u64,
    k_norm: u64,
    inv_freq: u64,
    k_cache: u64,
    v_cache: u64,
    n_rot: u32,
    neox: u32,
    eps: f32,
    pad: u32,
}
// SAFETY: plain #[repr(C)] data matching the kernel's struct.
unsafe impl DeviceRepr for DecodePrologueArg {}

impl AttentionInputs<'_> {
    /// The sinks' device address, 0 (null) without them.
    fn sinks_address(&self, device: &CudaDevice) -> u64 {
        self.sinks.map_or(0, |s| {
            let (address, _record) = s.device_ptr(device.stream());
            address
        })
    }
}

/// What the host knows of the step without reading the device block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepCounts {
    pub n_tokens: usize,
    /// Prefill tiles of the step (`FlatPlan::tiles.len()`).
    pub n_tiles: usize,
    /// Every sequence feeds exactly one token.
    pub decode_only: bool,
}

#[derive(Default)]
struct State {
    kernels: HashMap<Key, Kernels>,
    choices: HashMap<GridKey, SplitChoice>,
    workspace: Option<CudaSlice<f32>>,
    retired_workspaces: Vec<CudaSlice<f32>>,
    /// One counter per (token, kv head) of the split launches: each live split takes a ticket
    /// and the last one merges. All zero between launches (the merging block resets its own).
    tickets: Option<CudaSlice<u32>>,
    retired_tickets: Vec<CudaSlice<u32>>,
}

/// The paged attention kernels, loaded per specialization on first use, and the split
/// partials they share.
#[derive(Default)]
pub struct PagedAttention {
    state: Mutex<State>,
}

fn invalid(reason: String) -> CudaError {
    CudaError::InvalidArgument { op: "paged attention", reason }
}

fn to_u32(what: &str, value: usize) -> Result<u32, CudaError> {
    u32::try_from(value).map_err(|_| invalid(format!("{what} = {value} does not fit the kernels' 32-bit indices")))
}

fn launch_error(kernel: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError {
    move |error| CudaError::Driver { context: format!("launching {kernel}"), error }
}

fn is_capturing(device: &CudaDevice) -> bool {
    device.stream().capture_status().is_ok_and(|status| status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

impl PagedAttentionParams {
    fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// Most positions a token's decode attention walks: the whole sequence, or the KV blocks
    /// its sliding window touches.
    fn max_span(&self) -> usize {
        self.window.map_or(self.max_seq_len, |w| self.max_seq_len.min(w + KV_BLOCK_SIZE))
    }

    fn window_arg(&self) -> Result<u32, CudaError> {
        match self.window {
            Some(0) => Err(invalid("a sliding window of 0 positions".into())),
            Some(w) => to_u32("window", w),
            None => Ok(0),
        }
    }

    fn check_inputs(&self, counts: &StepCounts, inputs: &AttentionInputs, out: usize) -> Result<(), CudaError> {
        if let Some(sinks) = inputs.sinks {
            if sinks.len() < self.n_heads {
                return Err(invalid(format!("{} sink logits for {} query heads", sinks.len(), self.n_heads)));
            }
        }
        self.window_arg()?;
        if let Some(pro) = inputs.prologue {
            let norms = pro.qk_norm.map(|(q, k, _)| (q.len(), k.len()));
            self.check_prologue(counts, PrologueLens { k: pro.k.len(), v: pro.v.len(), norms, inv_freq: pro.inv_freq.len(), n_rot: pro.n_rot })?;
        }
        self.check(counts, inputs.q.len(), out, inputs.kv.k_bytes, inputs.kv.v_bytes, inputs.step.len())
    }

    /// The prologue's operands hold what the decode kernel reads: every token's key and value
    /// rows, a norm weight per head dimension, and `n_rot / 2` frequencies of an even `n_rot`
    /// no wider than a head.
    fn check_prologue(&self, counts: &StepCounts, lens: PrologueLens) -> Result<(), CudaError> {
        let values = counts.n_tokens * self.n_kv_heads * self.head_dim;
        for (what, have) in [("key", lens.k), ("value", lens.v)] {
            if have < values {
                return Err(invalid(format!("prologue {what} buffer of {have} values; {} tokens need {values}", counts.n_tokens)));
            }
        }
        if let Some((q_norm, k_norm)) = lens.norms {
            if q_norm < self.head_dim || k_norm < self.head_dim {
                return Err(invalid(format!("q/k norm weights of {q_norm} and {k_norm} values for heads of {}", self.head_dim)));
            }
        }
        if lens.n_rot % 2 != 0 || lens.n_rot > self.head_dim || lens.inv_freq < lens.n_rot / 2 {
            return Err(invalid(format!("rope over {} dims of heads of {} with {} frequencies", lens.n_rot, self.head_dim, lens.inv_freq)));
        }
        Ok(())
    }

    fn check(&self, counts: &StepCounts, q: usize, out: usize, k: usize, v: usize, step: usize) -> Result<(), CudaError> {
        if self.n_kv_heads == 0 || self.n_heads == 0 || self.n_heads % self.n_kv_heads != 0 {
            return Err(invalid(format!("{} query heads cannot share {} kv heads evenly", self.n_heads, self.n_kv_heads)));
        }
        if self.head_dim == 0 || self.head_dim > MAX_HEAD_DIM {
            return Err(invalid(format!("head dimension {} (supported: 1 to {MAX_HEAD_DIM})", self.head_dim)));
        }
        let decode_bytes =
            decode_shared_bytes(&Key { head_dim: self.head_dim, group: self.group(), k_type: self.k_type, v_type: self.v_type }, MD_WARPS_NARROW);
        if decode_bytes > MAX_SHARED_BYTES {
            return Err(invalid(format!(
                "a {} K / {} V cache with heads of {} values needs {} KiB of shared memory per decode block (at most {}); use an f16 or q8_0 cache",
                self.k_type,
                self.v_type,
                self.head_dim,
                decode_bytes / 1024,
                MAX_SHARED_BYTES / 1024
            )));
        }
        if self.max_seq_len == 0 {
            return Err(invalid("max_seq_len is 0".into()));
        }
        let width = self.n_kv_heads * self.head_dim;
        for (what, ty, have) in [("K", self.k_type, k), ("V", self.v_type, v)] {
            ty.check_width(width).map_err(|e| invalid(format!("{what} cache: {e}")))?;
            let need = cache_bytes(ty, self.rows, width);
            if have < need {
                return Err(invalid(format!("{what} cache of {have} bytes; {} rows of {width} {ty} values need {need}", self.rows)));
            }
        }
        let values = counts.n_tokens * self.n_heads * self.head_dim;
        for (what, have) in [("query", q), ("output", out)] {
            if have < values {
                return Err(invalid(format!("{what} buffer of {have} values; {} tokens need {values}", counts.n_tokens)));
            }
        }
        if step <= word::HEADER_WORDS {
            return Err(invalid(format!("step block of {step} words")));
        }
        to_u32("cache rows", self.rows)?;
        to_u32("tokens", counts.n_tokens)?;
        to_u32("query rows", counts.n_tokens * self.n_heads)?;
        Ok(())
    }
}

impl PagedAttention {
    pub fn new() -> PagedAttention {
        PagedAttention::default()
    }

    /// The attention of every token of the step: the split kernels for a decode-only step, the
    /// flash-attention kernel over the prefill tiles otherwise.
    pub fn attention(
        &self,
        device: &CudaDevice,
        inputs: AttentionInputs,
        out: &mut CudaSlice<f32>,
        counts: StepCounts,
        p: &PagedAttentionParams,
    ) -> Result<(), CudaError> {
        if counts.decode_only || counts.n_tiles == 0 {
            self.split(device, inputs, out, counts, p, None, None)
        } else {
            self.prefill(device, inputs, out, counts, p)
        }
    }

    /// Whether the decode kernel for these shapes can take the attention prologue: a decode
    /// step (one token per sequence) on tensor cores.
    pub fn takes_prologue(counts: &StepCounts, p: &PagedAttentionParams) -> bool {
        counts.decode_only && decode_on_tensor_cores(&Key::of(p))
    }

    /// How many splits the decode grid of `n_tokens` tokens uses: the measured choice once an
    /// automatic call made it, else the one-wave estimate.
    pub fn splits(&self, device: &CudaDevice, n_tokens: usize, p: &PagedAttentionParams) -> Result<usize, CudaError> {
        Ok(match self.split_choice(n_tokens, p) {
            Some(choice) => choice.n_splits,
            None => Self::splits_for(self.kernels(device, p)?.split_for(n_tokens, p).resident_blocks, n_tokens, p),
        })
    }

    /// The split count fixed for `n_tokens` tokens of these shapes, with its timings, once an
    /// automatic call has chosen it.
    pub fn split_choice(&self, n_tokens: usize, p: &PagedAttentionParams) -> Option<SplitChoice> {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.choices.get(&GridKey::of(n_tokens, p)).cloned()
    }

    /// [`Self::attention`] that also stores its output as the int8 input of the product that
    /// follows (`target`, which the caller then marks filled), where the step takes the split
    /// kernels, a head is whole chunks of 16 values and `target` takes the rows; returns false,
    /// having done nothing, where not. `n_splits` as in [`Self::split`].
    #[allow(clippy::too_many_arguments)]
    pub fn attention_quantized(
        &self,
        device: &CudaDevice,
        inputs: AttentionInputs,
        out: &mut CudaSlice<f32>,
        counts: StepCounts,
        p: &PagedAttentionParams,
        n_splits: Option<usize>,
        target: ActivationTarget,
    ) -> Result<bool, CudaError> {
        let takes_split = counts.decode_only || counts.n_tiles == 0;
        if !takes_split || p.head_dim % 16 != 0 || target.cols != p.n_heads * p.head_dim || counts.n_tokens > target.max_tokens {
            return Ok(false);
        }
        self.split(device, inputs, out, counts, p, n_splits, Some(target))?;
        Ok(true)
    }

    /// Split (flash-decoding) attention for any mix of tokens; `n_splits` overrides the
    /// automatic count (at most 256); `quantized`: see [`Self::attention_quantized`].
    #[allow(clippy::too_many_arguments)]
    pub fn split(
        &self,
        device: &CudaDevice,
        inputs: AttentionInputs,
        out: &mut CudaSlice<f32>,
        counts: StepCounts,
        p: &PagedAttentionParams,
        n_splits: Option<usize>,
        quantized: Option<ActivationTarget>,
    ) -> Result<(), CudaError> {
        p.check_inputs(&counts, &inputs, out.len())?;
        if counts.n_tokens == 0 {
            return Ok(());
        }
        let capturing = is_capturing(device);
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let kernels = state.kernels(device, p)?.clone();
        let n_splits = match n_splits {
            Some(n) if n == 0 || n > DEC_MAX_SPLITS => return Err(invalid(format!("{n} splits (supported: 1 to {DEC_MAX_SPLITS})"))),
            Some(n) => n,
            None => state.choose(device, &kernels, inputs, out, counts.n_tokens, p, capturing)?,
        };
        let (workspace, tickets) = state.workspace(device, workspace_len(counts.n_tokens, p, n_splits), counts.n_tokens * p.n_kv_heads, capturing)?;
        let launch = SplitLaunch { n_tokens: counts.n_tokens, n_splits, quantized };
        launch_split(device, &kernels, (workspace, tickets), inputs, out, p, launch)
    }

    /// Flash attention over the step's `counts.n_tiles` prefill tiles (every token of the step
    /// belongs to one tile).
    pub fn prefill(
        &self,
        device: &CudaDevice,
        inputs: AttentionInputs,
        out: &mut CudaSlice<f32>,
        counts: StepCounts,
        p: &PagedAttentionParams,
    ) -> Result<(), CudaError> {
        p.check_inputs(&counts, &inputs, out.len())?;
        if counts.n_tokens == 0 {
            return Ok(());
        }
        if counts.n_tiles == 0 || counts.n_tiles > counts.n_tokens {
            return Err(invalid(format!("{} prefill tiles for {} tokens", counts.n_tiles, counts.n_tokens)));
        }
        if inputs.prologue.is_some() {
            return Err(invalid("the attention prologue in the prefill kernel (decode steps on tensor cores only)".into()));
        }
        let kernels = {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            state.kernels(device, p)?.clone()
        };
        let common = CommonArgs::new(device, inputs, p)?;
        let cfg = LaunchConfig {
            grid_dim: (to_u32("tiles", counts.n_tiles)?, common.n_heads, 1),
            block_dim: (FA_THREADS, 1, 1),
            shared_mem_bytes: kernels.prefill_shared_bytes,
        };
        let stream = device.stream();
        let mut builder = stream.launch_builder(&kernels.prefill);
        builder.arg(out);
        common.push(&mut builder);
        // SAFETY: arguments match paged_attention_prefill; buffers checked above; the shared
        // memory size is the one its attribute was raised to when the kernel was loaded.
        unsafe { builder.launch(cfg) }.map_err(launch_error("paged_attention_prefill"))?;
        Ok(())
    }

    fn kernels(&self, device: &CudaDevice, p: &PagedAttentionParams) -> Result<Kernels, CudaError> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.kernels(device, p).cloned()
    }
}

/// Values of the split partials (accumulators, then (max, sum) pairs) for this grid.
fn workspace_len(n_tokens: usize, p: &PagedAttentionParams, n_splits: usize) -> usize {
    if n_splits > 1 {
        n_tokens * p.n_heads * n_splits * (p.head_dim + 2)
    } else {
        2
    }
}

/// The arguments the prefill and split kernels both take after their outputs, in their order:
/// q, the caches, the step block, heads, KV heads, cache rows, scale, window and sinks.
struct CommonArgs<'a> {
    inputs: AttentionInputs<'a>,
    n_heads: u32,
    n_kv_heads: u32,
    rows: u32,
    scale: f32,
    window: u32,
    sinks: u64,
}

impl<'a> CommonArgs<'a> {
    fn new(device: &CudaDevice, inputs: AttentionInputs<'a>, p: &PagedAttentionParams) -> Result<CommonArgs<'a>, CudaError> {
        Ok(CommonArgs {
            inputs,
            n_heads: to_u32("heads", p.n_heads)?,
            n_kv_heads: to_u32("KV heads", p.n_kv_heads)?,
            rows: to_u32("cache rows", p.rows)?,
            scale: p.scale,
            window: p.window_arg()?,
            sinks: inputs.sinks_address(device),
        })
    }

    fn push<'b>(&'b self, builder: &mut LaunchArgs<'b>) {
        let AttentionInputs { q, kv, step, .. } = self.inputs;
        builder
            .arg(q)
            .arg(&kv.k)
            .arg(&kv.v)
            .arg(step)
            .arg(&self.n_heads)
            .arg(&self.n_kv_heads)
            .arg(&self.rows)
            .arg(&self.scale)
            .arg(&self.window)
            .arg(&self.sinks);
    }
}

/// The grid of one split launch and where its output also goes quantized.
#[derive(Clone, Copy)]
struct SplitLaunch {
    n_tokens: usize,
    n_splits: usize,
    quantized: Option<ActivationTarget>,
}

/// Launches the split kernel over the step's tokens (which merges the splits itself when
/// `n_splits > 1`).
fn launch_split(
    device: &CudaDevice,
    kernels: &Kernels,
    (workspace, tickets): (&mut CudaSlice<f32>, &mut CudaSlice<u32>),
    inputs: AttentionInputs,
    out: &mut CudaSlice<f32>,
    p: &PagedAttentionParams,
    launch: SplitLaunch,
) -> Result<(), CudaError> {
    let SplitLaunch { n_tokens, n_splits, quantized } = launch;
    let kernel = kernels.split_for(n_tokens, p);
    let common = CommonArgs::new(device, inputs, p)?;
    let (xq, xds, x_chunks) = quantized.map_or((0, 0, 0), |t| (t.codes, t.scales, t.chunks_per_token));
    let acc_len = n_tokens * p.n_heads * n_splits * p.head_dim;
    let (mut part_acc, mut part_ml) = workspace.split_at_mut(if n_splits > 1 { acc_len } else { 1 });
    let stream = device.stream();
    let cfg = LaunchConfig {
        grid_dim: (n_splits as u32, common.n_kv_heads, n_tokens as u32),
        block_dim: (kernel.threads, 1, 1),
        shared_mem_bytes: kernel.shared_bytes,
    };
    let (function, prologue) = match inputs.prologue {
        None => (&kernel.function, None),
        Some(prologue) => {
            let function = kernel.prologue.as_ref().ok_or_else(|| invalid("the attention prologue in a decode kernel on CUDA cores".into()))?;
            (function, Some(prologue_arg(device, &prologue, inputs.kv)))
        }
    };
    let mut builder = stream.launch_builder(function);
    builder.arg(&mut *out).arg(&mut part_acc).arg(&mut part_ml).arg(tickets);
    common.push(&mut builder);
    builder.arg(&xq).arg(&xds).arg(&x_chunks);
    if let Some(prologue) = &prologue {
        builder.arg(prologue);
    }
    // SAFETY: arguments match paged_attention_split(_mma)(_prologue); q/out hold n_tokens
    // query rows and the caches `rows` rows (checked by the caller); the partials hold every
    // slot when n_splits > 1 (workspace_len) and the tickets every (token, kv head); the shared
    // memory is what its attribute was raised to; the prologue's operands hold every token's
    // rows (check_prologue).
    unsafe { builder.launch(cfg) }.map(drop).map_err(launch_error("paged_attention_split"))
}

/// The kernel argument of a decode prologue: device addresses of its operands and the caches.
fn prologue_arg(device: &CudaDevice, inputs: &PrologueInputs, kv: &KvView) -> DecodePrologueArg {
    let stream = device.stream();
    let address = |buf: &CudaSlice<f32>| {
        let (address, _record) = buf.device_ptr(stream);
        address
    };
    let (q_norm, k_norm, eps) = inputs.qk_norm.map_or((0, 0, 0.0), |(q, k, eps)| (address(q), address(k), eps));
    DecodePrologueArg {
        k: address(inputs.k),
        v: address(inputs.v),
        q_norm,
        k_norm,
        inv_freq: address(inputs.inv_freq),
        k_cache: kv.k,
        v_cache: kv.v,
        n_rot: inputs.n_rot as u32,
        neox: u32::from(inputs.neox),
        eps,
        pad: 0,
    }
}

/// The modules of the attention kernels for these shapes (decode, prefill), for
/// [`crate::KernelRegistry::prepare`].
pub fn module_keys(p: &PagedAttentionParams) -> [(&'static str, Vec<(&'static str, i64)>); 2] {
    let defines = vec![("HEAD_DIM", p.head_dim as i64), ("GROUP", p.group() as i64), ("K_TYPE", kv_type_code(p.k_type)), ("V_TYPE", kv_type_code(p.v_type))];
    [("paged_attention", defines.clone()), ("paged_prefill", defines)]
}

impl State {
    fn kernels(&mut self, device: &CudaDevice, p: &PagedAttentionParams) -> Result<&Kernels, CudaError> {
        Ok(match self.kernels.entry(Key::of(p)) {
            Entry::Occupied(loaded) => loaded.into_mut(),
            Entry::Vacant(slot) => slot.insert(Kernels::load(device, Key::of(p))?),
        })
    }

    /// The split partials, grown to at least `len` values, and the merge's tickets, grown to at
    /// least `n_tickets`; growing is refused inside a capture. Old buffers stay allocated:
    /// graphs captured earlier use them.
    fn workspace(
        &mut self,
        device: &CudaDevice,
        len: usize,
        n_tickets: usize,
        capturing: bool,
    ) -> Result<(&mut CudaSlice<f32>, &mut CudaSlice<u32>), CudaError> {
        let have = (self.workspace.as_ref().map_or(0, |w| w.len()), self.tickets.as_ref().map_or(0, |t| t.len()));
        if have.0 < len || have.1 < n_tickets {
            if capturing {
                return Err(invalid(format!(
                    "the split partials need {len} values and {n_tickets} tickets inside a graph capture (allocated: {} and {}); run the step once uncaptured first",
                    have.0, have.1
                )));
            }
            if have.0 < len {
                let grown = device.alloc_zeros::<f32>(len, "paged attention split partials")?;
                self.retired_workspaces.extend(self.workspace.replace(grown));
            }
            if have.1 < n_tickets {
                let grown = device.alloc_zeros::<u32>(n_tickets, "paged attention split tickets")?;
                self.retired_tickets.extend(self.tickets.replace(grown));
            }
        }
        Ok((self.workspace.as_mut().expect("allocated above"), self.tickets.as_mut().expect("allocated above")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn params() -> PagedAttentionParams {
        PagedAttentionParams {
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
            rows: 1024,
            max_seq_len: 8192,
            scale: 0.1,
            k_type: KvType::F16,
            v_type: KvType::Q8_0,
            window: None,
        }
    }

    #[test]
    fn host_constants_match_the_kernel_defines() {
        let define = crate::sources::define_value;
        let (decode, split, prefill) =
            (include_str!("../kernels/paged_decode.cuh"), include_str!("../kernels/paged_attention.cu"), include_str!("../kernels/paged_prefill.cu"));
        assert_eq!(define(decode, "DEC_THREADS"), DEC_THREADS);
        assert_eq!(define(decode, "DEC_MIN_CHUNK_MMA") as usize, DEC_MIN_CHUNK_MMA);
        assert_eq!(define(decode, "DEC_MIN_CHUNK_CORES") as usize, DEC_MIN_CHUNK_CORES);
        assert_eq!(define(decode, "DEC_TILE") as usize, DEC_TILE);
        assert_eq!(define(decode, "DEC_MAX_SPLITS") as usize, DEC_MAX_SPLITS);
        assert_eq!(define(split, "MD_WARPS_NARROW") as usize, MD_WARPS_NARROW);
        assert_eq!(define(split, "MD_WARPS_WIDE") as usize, MD_WARPS_WIDE);
        assert_eq!(define(split, "MD_ROWS") as usize, MD_ROWS);
        assert_eq!(define(split, "MD_STAGES") as usize, MD_STAGES);
        assert_eq!(define(prefill, "FA_KV") as usize, FA_KV);
        assert_eq!(define(prefill, "FA_WARPS") * 32, FA_THREADS);
    }

    #[test]
    fn bad_shapes_are_refused_with_a_reason() {
        let counts = StepCounts { n_tokens: 2, n_tiles: 1, decode_only: false };
        let p = params();
        let k = cache_bytes(KvType::F16, 1024, 1024);
        let v = cache_bytes(KvType::Q8_0, 1024, 1024);
        let q = 2 * 32 * 128;
        assert!(p.check(&counts, q, q, k, v, 100).is_ok());
        let err = |p: PagedAttentionParams, k, v, q| p.check(&counts, q, q, k, v, 100).unwrap_err().to_string();
        assert!(err(PagedAttentionParams { n_kv_heads: 5, ..p }, k, v, q).contains("evenly"));
        assert!(err(PagedAttentionParams { head_dim: 1024, ..p }, k, v, q).contains("head dimension"));
        let f32_cache = PagedAttentionParams { head_dim: 512, k_type: KvType::F32, v_type: KvType::F32, ..p };
        assert!(err(f32_cache, k, v, q).contains("use an f16 or q8_0 cache"));
        assert!(err(p, k - 1, v, q).contains("K cache"));
        assert!(err(p, k, v - 1, q).contains("V cache"));
        assert!(err(p, k, v, q - 1).contains("query"));
        assert!(err(PagedAttentionParams { head_dim: 8, n_kv_heads: 1, n_heads: 1, ..p }, k, v, q).contains("multiple of 32"));
    }

    #[test]
    fn prologue_operands_too_small_are_refused() {
        let counts = StepCounts { n_tokens: 3, n_tiles: 0, decode_only: true };
        let p = PagedAttentionParams { v_type: KvType::F16, ..params() };
        let kv = 3 * 8 * 128;
        let lens = |k, v, norms, inv_freq, n_rot| PrologueLens { k, v, norms, inv_freq, n_rot };
        assert!(p.check_prologue(&counts, lens(kv, kv, Some((128, 128)), 64, 128)).is_ok());
        assert!(p.check_prologue(&counts, lens(kv, kv, None, 16, 32)).is_ok(), "partial rope, no norms");
        let err = |l| p.check_prologue(&counts, l).unwrap_err().to_string();
        assert!(err(lens(kv - 1, kv, None, 64, 128)).contains("key"));
        assert!(err(lens(kv, kv - 1, None, 64, 128)).contains("value"));
        assert!(err(lens(kv, kv, Some((127, 128)), 64, 128)).contains("norm"));
        assert!(err(lens(kv, kv, None, 65, 130)).contains("rope"));
        assert!(err(lens(kv, kv, None, 16, 33)).contains("rope"));
        assert!(err(lens(kv, kv, None, 15, 32)).contains("rope"));
    }

    #[test]
    fn q8_cache_size_matches_the_kernel_layout() {
        // 33 rows of 32 values: 1056 quant bytes, padded to 1056 (a multiple of 16), then 33 scales.
        assert_eq!(cache_bytes(KvType::Q8_0, 33, 32), 1056 + 66);
        assert_eq!(cache_bytes(KvType::Q8_0, 1, 32), 32 + 2);
        assert_eq!(cache_bytes(KvType::Q8_0, 3, 32), 96 + 6);
        assert_eq!(cache_bytes(KvType::Q8_0, 1, 64), 64 + 4);
    }
}
