//! Attention over the paged, typed KV cache for every token of a batched step
//! (`kernels/paged_attention.cu`). Each token attends causally to its own sequence's positions,
//! read through that sequence's block table in the step block (`kernels/plan.cuh`).
//!
//! Two paths: the split (flash-decoding) kernels, whose grid depends on shapes only, so a
//! captured decode step replays as sequences grow; and a tensor-core flash-attention kernel
//! over the step's prefill tiles. [`PagedAttention::attention`] picks one from the step's counts.

// `usize::is_multiple_of` needs Rust 1.87; the workspace supports 1.85.
#![allow(clippy::manual_is_multiple_of)]

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use cudarc::driver::sys::{CUfunction_attribute, CUstreamCaptureStatus};
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
use kiln_core::plan::KvType;

pub use crate::kv::cache_bytes;
use crate::kv::{kv_type_code, KvView};
use crate::plan_words::word;
use crate::{CudaDevice, CudaError};

/// `paged_attention.cu`'s DEC_THREADS, DEC_MIN_CHUNK and DEC_MAX_SPLITS.
const DEC_THREADS: u32 = 128;
const DEC_MIN_CHUNK: usize = 64;
const DEC_MAX_SPLITS: usize = 256;
/// `paged_attention.cu`'s FA_THREADS and FA_KV.
const FA_THREADS: u32 = 128;
const FA_KV: usize = 64;
/// Cap on the split partials; long batches use fewer splits instead.
const WORKSPACE_MAX_BYTES: usize = 64 << 20;
/// Largest head dimension: the prefill kernel's K and V tiles must fit shared memory.
pub const MAX_HEAD_DIM: usize = 256;

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

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    head_dim: usize,
    group: usize,
    k_type: KvType,
    v_type: KvType,
}

#[derive(Clone)]
struct Kernels {
    split: CudaFunction,
    reduce: CudaFunction,
    prefill: CudaFunction,
    /// Split blocks the whole GPU holds at once: the decode grid aims for one full wave.
    resident_blocks: usize,
    prefill_shared_bytes: u32,
}

#[derive(Default)]
struct State {
    kernels: HashMap<Key, Kernels>,
    workspace: Option<CudaSlice<f32>>,
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

/// Dynamic shared memory of the prefill kernel: K and V tiles of FA_KV rows of f16, each row
/// padded to a multiple of 16 values plus 8.
fn prefill_shared_bytes(head_dim: usize) -> usize {
    2 * FA_KV * (head_dim.div_ceil(16) * 16 + 8) * 2
}

impl PagedAttentionParams {
    fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    fn check(&self, counts: &StepCounts, q: usize, out: usize, k: usize, v: usize, step: usize) -> Result<(), CudaError> {
        if self.n_kv_heads == 0 || self.n_heads == 0 || self.n_heads % self.n_kv_heads != 0 {
            return Err(invalid(format!("{} query heads cannot share {} kv heads evenly", self.n_heads, self.n_kv_heads)));
        }
        if self.head_dim == 0 || self.head_dim > MAX_HEAD_DIM {
            return Err(invalid(format!("head dimension {} (supported: 1 to {MAX_HEAD_DIM})", self.head_dim)));
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
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        device: &CudaDevice,
        q: &CudaSlice<f32>,
        kv: &KvView,
        out: &mut CudaSlice<f32>,
        step: &CudaSlice<u32>,
        counts: StepCounts,
        p: &PagedAttentionParams,
    ) -> Result<(), CudaError> {
        if counts.decode_only || counts.n_tiles == 0 {
            self.split(device, q, kv, out, step, counts, p, None)
        } else {
            self.prefill(device, q, kv, out, step, counts, p)
        }
    }

    /// How many splits the decode grid of `n_tokens` tokens uses: one full wave of resident
    /// blocks (so enough cache rows are in flight for the memory bandwidth at long context,
    /// with no straggling second wave), no more than the longest sequence can feed, and
    /// partials within the workspace cap. Shapes alone fix it.
    pub fn splits(&self, device: &CudaDevice, n_tokens: usize, p: &PagedAttentionParams) -> Result<usize, CudaError> {
        let resident = self.kernels(device, p)?.resident_blocks;
        Ok(Self::splits_for(resident, n_tokens, p))
    }

    fn splits_for(resident_blocks: usize, n_tokens: usize, p: &PagedAttentionParams) -> usize {
        let per_split_bytes = n_tokens * p.n_heads * (p.head_dim + 2) * 4;
        (resident_blocks / (p.n_kv_heads * n_tokens).max(1))
            .min(p.max_seq_len.div_ceil(DEC_MIN_CHUNK))
            .min(DEC_MAX_SPLITS)
            .min(WORKSPACE_MAX_BYTES / per_split_bytes.max(1))
            .max(1)
    }

    /// Split (flash-decoding) attention for any mix of tokens; `n_splits` overrides the
    /// automatic count (at most 256).
    #[allow(clippy::too_many_arguments)]
    pub fn split(
        &self,
        device: &CudaDevice,
        q: &CudaSlice<f32>,
        kv: &KvView,
        out: &mut CudaSlice<f32>,
        step: &CudaSlice<u32>,
        counts: StepCounts,
        p: &PagedAttentionParams,
        n_splits: Option<usize>,
    ) -> Result<(), CudaError> {
        p.check(&counts, q.len(), out.len(), kv.k_bytes, kv.v_bytes, step.len())?;
        if counts.n_tokens == 0 {
            return Ok(());
        }
        let capturing = is_capturing(device);
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let kernels = state.kernels(device, p)?.clone();
        let n_splits = match n_splits {
            Some(n) if n == 0 || n > DEC_MAX_SPLITS => return Err(invalid(format!("{n} splits (supported: 1 to {DEC_MAX_SPLITS})"))),
            Some(n) => n,
            None => Self::splits_for(kernels.resident_blocks, counts.n_tokens, p),
        };
        let slots = counts.n_tokens * p.n_heads * n_splits;
        let acc_len = slots * p.head_dim;
        let workspace_len = if n_splits > 1 { acc_len + slots * 2 } else { 2 };
        let workspace = state.workspace(device, workspace_len, capturing)?;
        let (mut part_acc, mut part_ml) = workspace.split_at_mut(if n_splits > 1 { acc_len } else { 1 });
        let (n_tokens, n_heads, n_kv_heads, rows) = (counts.n_tokens as u32, p.n_heads as u32, p.n_kv_heads as u32, p.rows as u32);
        let stream = device.stream();
        let cfg = LaunchConfig { grid_dim: (n_splits as u32, n_kv_heads, n_tokens), block_dim: (DEC_THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: arguments match paged_attention_split; q/out hold n_tokens query rows and the
        // caches `rows` rows (checked above); the partials hold `slots` rows when n_splits > 1.
        unsafe {
            stream
                .launch_builder(&kernels.split)
                .arg(&mut *out)
                .arg(&mut part_acc)
                .arg(&mut part_ml)
                .arg(q)
                .arg(&kv.k)
                .arg(&kv.v)
                .arg(step)
                .arg(&n_heads)
                .arg(&n_kv_heads)
                .arg(&rows)
                .arg(&p.scale)
                .launch(cfg)
        }
        .map_err(launch_error("paged_attention_split"))?;
        if n_splits > 1 {
            let n_splits = n_splits as u32;
            let cfg = LaunchConfig { grid_dim: (n_heads, n_tokens, 1), block_dim: (DEC_THREADS, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: as above; the reduce reads the partials the split kernel just wrote.
            unsafe { stream.launch_builder(&kernels.reduce).arg(out).arg(&mut part_acc).arg(&mut part_ml).arg(step).arg(&n_heads).arg(&n_splits).launch(cfg) }
                .map_err(launch_error("paged_attention_reduce"))?;
        }
        Ok(())
    }

    /// Flash attention over the step's `counts.n_tiles` prefill tiles (every token of the step
    /// belongs to one tile).
    #[allow(clippy::too_many_arguments)]
    pub fn prefill(
        &self,
        device: &CudaDevice,
        q: &CudaSlice<f32>,
        kv: &KvView,
        out: &mut CudaSlice<f32>,
        step: &CudaSlice<u32>,
        counts: StepCounts,
        p: &PagedAttentionParams,
    ) -> Result<(), CudaError> {
        p.check(&counts, q.len(), out.len(), kv.k_bytes, kv.v_bytes, step.len())?;
        if counts.n_tokens == 0 {
            return Ok(());
        }
        if counts.n_tiles == 0 || counts.n_tiles > counts.n_tokens {
            return Err(invalid(format!("{} prefill tiles for {} tokens", counts.n_tiles, counts.n_tokens)));
        }
        let kernels = {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            state.kernels(device, p)?.clone()
        };
        let (n_heads, n_kv_heads, rows) = (to_u32("heads", p.n_heads)?, p.n_kv_heads as u32, p.rows as u32);
        let cfg = LaunchConfig {
            grid_dim: (to_u32("tiles", counts.n_tiles)?, n_heads, 1),
            block_dim: (FA_THREADS, 1, 1),
            shared_mem_bytes: kernels.prefill_shared_bytes,
        };
        // SAFETY: arguments match paged_attention_prefill; buffers checked above; the shared
        // memory size is the one its attribute was raised to when the kernel was loaded.
        unsafe {
            device
                .stream()
                .launch_builder(&kernels.prefill)
                .arg(out)
                .arg(q)
                .arg(&kv.k)
                .arg(&kv.v)
                .arg(step)
                .arg(&n_heads)
                .arg(&n_kv_heads)
                .arg(&rows)
                .arg(&p.scale)
                .launch(cfg)
        }
        .map_err(launch_error("paged_attention_prefill"))?;
        Ok(())
    }

    fn kernels(&self, device: &CudaDevice, p: &PagedAttentionParams) -> Result<Kernels, CudaError> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.kernels(device, p).cloned()
    }
}

/// The module of the attention kernels for these shapes, for [`crate::KernelRegistry::prepare`].
pub fn module_key(p: &PagedAttentionParams) -> (&'static str, Vec<(&'static str, i64)>) {
    (
        "paged_attention",
        vec![("HEAD_DIM", p.head_dim as i64), ("GROUP", p.group() as i64), ("K_TYPE", kv_type_code(p.k_type)), ("V_TYPE", kv_type_code(p.v_type))],
    )
}

impl State {
    fn kernels(&mut self, device: &CudaDevice, p: &PagedAttentionParams) -> Result<&Kernels, CudaError> {
        let key = Key { head_dim: p.head_dim, group: p.group(), k_type: p.k_type, v_type: p.v_type };
        Ok(match self.kernels.entry(key) {
            Entry::Occupied(loaded) => loaded.into_mut(),
            Entry::Vacant(slot) => {
                let defines = [
                    ("HEAD_DIM", key.head_dim as i64),
                    ("GROUP", key.group as i64),
                    ("K_TYPE", kv_type_code(key.k_type)),
                    ("V_TYPE", kv_type_code(key.v_type)),
                ];
                let load = |kernel| device.registry().function("paged_attention", kernel, &defines);
                let split = load("paged_attention_split")?;
                let per_multiprocessor = split
                    .occupancy_max_active_blocks_per_multiprocessor(DEC_THREADS, 0, None)
                    .map_err(CudaError::driver("querying paged_attention_split occupancy"))?;
                let resident_blocks = (per_multiprocessor as usize).max(1) * device.info().multiprocessor_count as usize;
                let prefill = load("paged_attention_prefill")?;
                let shared = prefill_shared_bytes(key.head_dim);
                prefill
                    .set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared as i32)
                    .map_err(CudaError::driver("raising paged_attention_prefill's shared memory limit"))?;
                slot.insert(Kernels { split, reduce: load("paged_attention_reduce")?, prefill, resident_blocks, prefill_shared_bytes: shared as u32 })
            }
        })
    }

    /// The workspace, grown to at least `len` values; growing is refused inside a capture.
    fn workspace(&mut self, device: &CudaDevice, len: usize, capturing: bool) -> Result<&mut CudaSlice<f32>, CudaError> {
        let have = self.workspace.as_ref().map_or(0, |w| w.len());
        if have < len {
            if capturing {
                return Err(invalid(format!(
                    "the split partials need {len} values inside a graph capture (allocated: {have}); run the step once uncaptured first"
                )));
            }
            self.workspace = None;
            self.workspace = Some(device.alloc_zeros::<f32>(len, "paged attention split partials")?);
        }
        Ok(self.workspace.as_mut().expect("allocated above"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> PagedAttentionParams {
        PagedAttentionParams { n_heads: 32, n_kv_heads: 8, head_dim: 128, rows: 1024, max_seq_len: 8192, scale: 0.1, k_type: KvType::F16, v_type: KvType::Q8_0 }
    }

    #[test]
    fn splits_fill_one_wave_within_the_caps() {
        let p = params();
        assert_eq!(PagedAttention::splits_for(1056, 1, &p), 128, "8192 positions feed 128 chunks of 64");
        assert_eq!(PagedAttention::splits_for(1056, 1, &PagedAttentionParams { max_seq_len: 32768, ..p }), 132);
        assert_eq!(PagedAttention::splits_for(1056, 64, &p), 2);
        assert_eq!(PagedAttention::splits_for(1056, 512, &p), 1);
        assert_eq!(PagedAttention::splits_for(100_000, 1, &PagedAttentionParams { max_seq_len: 1 << 20, ..p }), DEC_MAX_SPLITS);
        assert_eq!(PagedAttention::splits_for(1056, 1, &PagedAttentionParams { max_seq_len: 100, ..p }), 2);
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
        assert!(err(PagedAttentionParams { head_dim: 512, ..p }, k, v, q).contains("head dimension"));
        assert!(err(p, k - 1, v, q).contains("K cache"));
        assert!(err(p, k, v - 1, q).contains("V cache"));
        assert!(err(p, k, v, q - 1).contains("query"));
        assert!(err(PagedAttentionParams { head_dim: 8, n_kv_heads: 1, n_heads: 1, ..p }, k, v, q).contains("multiple of 32"));
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
