//! The decode and prefill kernels of one specialization (head size, group, cache types) and
//! the shared memory each block takes.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::CudaFunction;
use kiln_core::plan::KvType;

use super::{
    PagedAttentionParams, DEC_MAX_SPLITS, DEC_MIN_CHUNK_CORES, DEC_MIN_CHUNK_MMA, DEC_THREADS, DEC_TILE, FA_KV, MD_ROWS, MD_STAGES, MD_WARPS_NARROW,
    MD_WARPS_WIDE,
};
use crate::kv::kv_type_code;
use crate::{CudaDevice, CudaError};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Key {
    pub(super) head_dim: usize,
    pub(super) group: usize,
    pub(super) k_type: KvType,
    pub(super) v_type: KvType,
}

/// One block shape of the split kernel.
#[derive(Clone)]
pub(super) struct SplitKernel {
    pub(super) function: CudaFunction,
    /// The same with the attention prologue (tensor cores only).
    pub(super) prologue: Option<CudaFunction>,
    pub(super) threads: u32,
    pub(super) shared_bytes: u32,
    /// Blocks the whole GPU holds at once: the split candidates are multiples of a wave.
    pub(super) resident_blocks: usize,
}

#[derive(Clone)]
pub(super) struct Kernels {
    pub(super) split: SplitKernel,
    /// Tensor cores only: wide blocks (paged_attention.cu's MD_WARPS_WIDE), for steps whose
    /// (token, kv head) pairs are fewer than the multiprocessors.
    pub(super) split_wide: Option<SplitKernel>,
    pub(super) multiprocessors: usize,
    pub(super) prefill: CudaFunction,
    pub(super) prefill_shared_bytes: u32,
}

impl Kernels {
    /// Compiles (or takes from the registry) and configures the kernels of `key`.
    pub(super) fn load(device: &CudaDevice, key: Key) -> Result<Kernels, CudaError> {
        let defines =
            [("HEAD_DIM", key.head_dim as i64), ("GROUP", key.group as i64), ("K_TYPE", kv_type_code(key.k_type)), ("V_TYPE", kv_type_code(key.v_type))];
        let multiprocessors = device.info().multiprocessor_count as usize;
        let load_split = |name: &str, with_prologue: Option<&str>, warps: usize| -> Result<SplitKernel, CudaError> {
            let shared_bytes = decode_shared_bytes(&key, warps);
            let load = |kernel: &str| -> Result<CudaFunction, CudaError> {
                let function = device.registry().function("paged_attention", kernel, &defines)?;
                function
                    .set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes as i32)
                    .map_err(CudaError::driver("raising the decode attention's shared memory limit"))?;
                Ok(function)
            };
            let function = load(name)?;
            let prologue = with_prologue.map(load).transpose()?;
            let threads = if decode_on_tensor_cores(&key) { (warps * 32) as u32 } else { DEC_THREADS };
            let per_multiprocessor = function
                .occupancy_max_active_blocks_per_multiprocessor(threads, shared_bytes, None)
                .map_err(CudaError::driver("querying the split kernel's occupancy"))?;
            let resident_blocks = (per_multiprocessor as usize).max(1) * multiprocessors;
            Ok(SplitKernel { function, prologue, threads, shared_bytes: shared_bytes as u32, resident_blocks })
        };
        let (split, split_wide) = if decode_on_tensor_cores(&key) {
            let narrow = load_split("paged_attention_split_mma", Some("paged_attention_split_mma_prologue"), MD_WARPS_NARROW)?;
            // A GPU with less shared memory a block than the wide stages keeps the narrow blocks.
            let fits = decode_shared_bytes(&key, MD_WARPS_WIDE) <= device.info().max_shared_memory_per_block_optin;
            let wide =
                if fits { Some(load_split("paged_attention_split_mma_wide", Some("paged_attention_split_mma_prologue_wide"), MD_WARPS_WIDE)?) } else { None };
            (narrow, wide)
        } else {
            (load_split("paged_attention_split", None, MD_WARPS_NARROW)?, None)
        };
        let prefill = device.registry().function("paged_prefill", "paged_attention_prefill", &defines)?;
        let shared = prefill_shared_bytes(key.head_dim);
        prefill
            .set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared as i32)
            .map_err(CudaError::driver("raising paged_attention_prefill's shared memory limit"))?;
        Ok(Kernels { split, split_wide, multiprocessors, prefill, prefill_shared_bytes: shared as u32 })
    }

    /// The block shape for a step of `n_tokens` tokens.
    pub(super) fn split_for(&self, n_tokens: usize, p: &PagedAttentionParams) -> &SplitKernel {
        match &self.split_wide {
            Some(wide) if n_tokens * p.n_kv_heads < self.multiprocessors => wide,
            _ => &self.split,
        }
    }
}

impl Key {
    pub(super) fn of(p: &PagedAttentionParams) -> Key {
        Key { head_dim: p.head_dim, group: p.group(), k_type: p.k_type, v_type: p.v_type }
    }
}

/// Whether decode runs `paged_attention_split_mma` (the `#if` above it in paged_attention.cu).
pub(super) fn decode_on_tensor_cores(key: &Key) -> bool {
    key.k_type == KvType::F16 && key.v_type == KvType::F16 && key.head_dim % 16 == 0 && key.head_dim <= 128 && key.group <= 8
}

/// Fewest rows a split covers (paged_decode.cuh's DEC_MIN_CHUNK): what one block's first copies
/// bring in, so a shorter span takes one split and no merge.
pub(super) fn min_chunk(key: &Key) -> usize {
    if decode_on_tensor_cores(key) {
        DEC_MIN_CHUNK_MMA
    } else {
        DEC_MIN_CHUNK_CORES
    }
}

/// Dynamic shared memory of the split kernel (of `warps` warps a block on tensor cores): its
/// stages, which the merge of the splits reuses for one weight per (query head, split) and one
/// total per query head.
pub(super) fn decode_shared_bytes(key: &Key, warps: usize) -> usize {
    decode_stage_bytes(key, warps).max(key.group * (DEC_MAX_SPLITS + 1) * 4)
}

/// The split kernel's stages. The tensor-core one: per warp, MD_STAGES stages of MD_ROWS K rows
/// and MD_ROWS V rows of f16, each padded by 8 values. The other: DEC_STAGES stages of a 32-row
/// K tile and V tile, rows padded to 16 bytes, three stages when one takes at most 16 KiB
/// (paged_decode.cuh).
fn decode_stage_bytes(key: &Key, warps: usize) -> usize {
    if decode_on_tensor_cores(key) {
        return warps * MD_STAGES * 2 * MD_ROWS * (key.head_dim + 8) * 2;
    }
    let Key { head_dim, k_type, v_type, .. } = *key;
    let elem = |ty| match ty {
        KvType::F32 => 4,
        KvType::F16 => 2,
        KvType::Q8_0 => 1,
    };
    let stage = DEC_TILE * ((head_dim * elem(k_type)).div_ceil(16) * 16 + (head_dim * elem(v_type)).div_ceil(16) * 16);
    stage * if stage <= 16384 { 3 } else { 2 }
}

/// Dynamic shared memory of the prefill kernel: K and V tiles of FA_KV rows of f16, each row
/// padded to a multiple of 16 values plus 8.
fn prefill_shared_bytes(head_dim: usize) -> usize {
    2 * FA_KV * (head_dim.div_ceil(16) * 16 + 8) * 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_shared_memory_matches_the_kernel_stages() {
        let key = |head_dim, group, k_type, v_type| Key { head_dim, group, k_type, v_type };
        // f16, head_dim 128, on tensor cores: warps x 3 stages x 32 rows of 136 halves.
        assert_eq!(decode_shared_bytes(&key(128, 4, KvType::F16, KvType::F16), 4), 4 * 3 * 32 * 136 * 2);
        assert_eq!(decode_shared_bytes(&key(128, 4, KvType::F16, KvType::F16), 8), 8 * 3 * 32 * 136 * 2);
        // f16, head_dim 128, 16 query heads a kv head: 32 rows of 256 + 256 bytes = 16 KiB a stage, three stages.
        assert_eq!(decode_shared_bytes(&key(128, 16, KvType::F16, KvType::F16), 4), 3 * 16384);
        // f32, head_dim 256: 64 KiB a stage, two stages.
        assert_eq!(decode_shared_bytes(&key(256, 2, KvType::F32, KvType::F32), 4), 2 * 65536);
        // q8_0 / f16, head_dim 8: rows padded to 16 bytes.
        assert_eq!(decode_shared_bytes(&key(8, 2, KvType::Q8_0, KvType::F16), 4), 3 * 32 * 32);
        // Small stages: the merge's weights (8 heads x 256 splits) and totals set the size.
        assert_eq!(decode_shared_bytes(&key(4, 8, KvType::F32, KvType::F32), 4), 8 * 257 * 4);
    }
}
