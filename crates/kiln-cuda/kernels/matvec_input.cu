// Activations for the quantized mat-vec kernels: x [n][cols] f32 (cols a multiple of 16) to
// the layout of quantize_chunk (quant.cuh). Values past `cols` (the padding up to whole tiles)
// are zero, so the mat-vec kernels need no bounds checks.
// kiln-waits-for-inputs
#include "norm.cuh"
#include "quant.cuh"

// 16 consecutive f32 values starting at `p` (16-value aligned).
__device__ __forceinline__ void load_chunk(const float* p, float (&v)[CHUNK_VALUES]) {
    const float4* src = reinterpret_cast<const float4*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float4 f = __ldg(src + i);
        v[4 * i] = f.x;
        v[4 * i + 1] = f.y;
        v[4 * i + 2] = f.z;
        v[4 * i + 3] = f.w;
    }
}

// Grid-stride over (token, chunk).
extern "C" __global__ void quantize_activations_q8(const float* __restrict__ x, u32 cols, u32 n, u32 tiles,
                                                   i8* __restrict__ xq, float2* __restrict__ xds) {
    wait_for_inputs();
    const u64 chunks_per_token = (u64)tiles * 32;
    for (u64 index = global_thread_index(); index < n * chunks_per_token; index += global_thread_count()) {
        const u64 token = index / chunks_per_token;
        const u32 first = (u32)(index % chunks_per_token) * CHUNK_VALUES;
        float v[CHUNK_VALUES] = {};
        if (first < cols) {
            load_chunk(x + token * cols + first, v);
        }
        quantize_chunk(v, xq, xds, index);
    }
}

// One token's chunk `chunk` of the quantization below: its values already normalized in `v`
// (zeros past `cols`), kept in h where KEEP.
template <bool KEEP>
__device__ __forceinline__ void store_normed_chunk(float (&v)[CHUNK_VALUES], u64 token, u32 chunk, u32 chunks_per_token, u32 cols,
                                                   i8* __restrict__ xq, float2* __restrict__ xds, float* __restrict__ h) {
    const u32 first = chunk * CHUNK_VALUES;
    if constexpr (KEEP) {
        if (first < cols) {
            float4* out = reinterpret_cast<float4*>(h + token * cols + first);
#pragma unroll
            for (int i = 0; i < CHUNK_VALUES / 4; ++i) {
                out[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
            }
        }
    }
    quantize_chunk(v, xq, xds, token * chunks_per_token + chunk);
}

// RMSNorm fused into the quantization above: per token row of `cols` values,
// quantize_chunk(x / sqrt(mean(x^2) + eps) * weight), with the normalized values bit-identical
// to norm.cu's (same reduction as rms_norm_warp_f32 for rows up to WARP_NORM_MAX_DIM, as
// rms_norm_block_f32 beyond); KEEP also stores them in h [n][cols] (a mixture of experts' input,
// which its router reads in f32). A row that one pass of the block reduction covers (up to
// 4,096 values) is read once: the pass's float4s staged in shared memory for the chunks, each
// thread's chunk weights loaded before the wait. Grid: one NORM_BLOCK block per token.
template <bool KEEP>
__device__ __forceinline__ void norm_quantize_row(const float* __restrict__ x, const float* __restrict__ weight, u32 cols, u32 tiles,
                                                  float eps, i8* __restrict__ xq, float2* __restrict__ xds, float* __restrict__ h) {
    const u64 token = blockIdx.x;
    const float* xr = x + token * cols;
    const u32 chunks_per_token = tiles * 32;
    const u32 n4 = cols / 4;
    if (cols > WARP_NORM_MAX_DIM && n4 <= NORM_PASS_FLOAT4S * NORM_BLOCK && chunks_per_token <= NORM_BLOCK && float4_row(xr, cols)) {
        __shared__ float4 row_s[NORM_PASS_FLOAT4S * NORM_BLOCK];
        const u32 chunk = threadIdx.x;
        const u32 first = chunk * CHUNK_VALUES;
        float w[CHUNK_VALUES];
        if (first < cols) {
            load_chunk(weight + first, w);
        }
        wait_for_inputs();
        float4 v4[NORM_PASS_FLOAT4S];
        load_row_pass(reinterpret_cast<const float4*>(xr), threadIdx.x, n4, v4);
#pragma unroll
        for (int k = 0; k < NORM_PASS_FLOAT4S; ++k) {
            row_s[threadIdx.x + k * NORM_BLOCK] = v4[k];
        }
        // The block sum's barriers also publish row_s.
        const float scale = rms_scale(block_sum<NORM_BLOCK>(add_pass_squares(0.0f, v4)), cols, eps);
        if (chunk < chunks_per_token) {
            float v[CHUNK_VALUES] = {};
            if (first < cols) {
#pragma unroll
                for (int i = 0; i < CHUNK_VALUES / 4; ++i) {
                    const float4 f = row_s[chunk * (CHUNK_VALUES / 4) + i];
                    v[4 * i] = rms_normed(f.x, scale, w[4 * i]);
                    v[4 * i + 1] = rms_normed(f.y, scale, w[4 * i + 1]);
                    v[4 * i + 2] = rms_normed(f.z, scale, w[4 * i + 2]);
                    v[4 * i + 3] = rms_normed(f.w, scale, w[4 * i + 3]);
                }
            }
            store_normed_chunk<KEEP>(v, token, chunk, chunks_per_token, cols, xq, xds, h);
        }
        return;
    }
    wait_for_inputs();
    // Every warp reduces short rows itself (so no block barrier is needed); all get one value.
    const float sum_sq = cols <= WARP_NORM_MAX_DIM ? warp_row_sum_sq(xr, cols, threadIdx.x & 31) : block_row_sum_sq(xr, cols);
    const float scale = rms_scale(sum_sq, cols, eps);
    for (u32 chunk = threadIdx.x; chunk < chunks_per_token; chunk += NORM_BLOCK) {
        const u32 first = chunk * CHUNK_VALUES;
        float v[CHUNK_VALUES] = {};
        if (first < cols) {
            float w[CHUNK_VALUES];
            load_chunk(xr + first, v);
            load_chunk(weight + first, w);
#pragma unroll
            for (int i = 0; i < CHUNK_VALUES; ++i) {
                v[i] = rms_normed(v[i], scale, w[i]);
            }
        }
        store_normed_chunk<KEEP>(v, token, chunk, chunks_per_token, cols, xq, xds, h);
    }
}

extern "C" __global__ void __launch_bounds__(NORM_BLOCK)
    rms_norm_quantize_q8(const float* __restrict__ x, const float* __restrict__ weight, u32 cols, u32 tiles, float eps,
                         i8* __restrict__ xq, float2* __restrict__ xds) {
    norm_quantize_row<false>(x, weight, cols, tiles, eps, xq, xds, nullptr);
}

extern "C" __global__ void __launch_bounds__(NORM_BLOCK)
    rms_norm_quantize_keep_q8(const float* __restrict__ x, const float* __restrict__ weight, u32 cols, u32 tiles, float eps,
                              i8* __restrict__ xq, float2* __restrict__ xds, float* __restrict__ h) {
    norm_quantize_row<true>(x, weight, cols, tiles, eps, xq, xds, h);
}

// A Gated DeltaNet's gated RMSNorm into the int8 input of its output projection: per token row
// of `cols` = heads * head_dim values, each head's values normed on their own and gated,
// quantize_chunk(silu(z) * x / sqrt(mean_head(x^2) + eps) * weight[d]) (weight [head_dim]).
// A head is `group` = head_dim / 16 chunks (a power of two up to 32, checked by the host), held
// by consecutive lanes of one warp, which sum its squares by shuffles. Grid: one NORM_BLOCK block
// per token; padding chunks past `cols` are quantized zeros.
extern "C" __global__ void __launch_bounds__(NORM_BLOCK)
    gated_norm_quantize_q8(const float* __restrict__ x, const float* __restrict__ z, const float* __restrict__ weight, u32 cols,
                           u32 head_dim, u32 tiles, float eps, i8* __restrict__ xq, float2* __restrict__ xds) {
    wait_for_inputs();
    const u64 token = blockIdx.x;
    const u32 group = head_dim / CHUNK_VALUES;
    const u32 chunks_per_token = tiles * 32;
    // chunks_per_token is a multiple of 32: every lane of a warp takes each step of the loop.
    for (u32 chunk = threadIdx.x; chunk < chunks_per_token; chunk += NORM_BLOCK) {
        const u32 first = chunk * CHUNK_VALUES;
        const bool live = first < cols;
        float v[CHUNK_VALUES] = {};
        float sum_sq = 0.0f;
        if (live) {
            load_chunk(x + token * cols + first, v);
#pragma unroll
            for (int i = 0; i < CHUNK_VALUES; ++i) {
                sum_sq += v[i] * v[i];
            }
        }
        for (u32 offset = group / 2; offset > 0; offset /= 2) {
            sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, offset);
        }
        if (live) {
            const float scale = rms_scale(sum_sq, head_dim, eps);
            float g[CHUNK_VALUES], w[CHUNK_VALUES];
            load_chunk(z + token * cols + first, g);
            load_chunk(weight + first % head_dim, w);
#pragma unroll
            for (int i = 0; i < CHUNK_VALUES; ++i) {
                v[i] = silu(g[i]) * rms_normed(v[i], scale, w[i]);
            }
        }
        quantize_chunk(v, xq, xds, token * chunks_per_token + chunk);
    }
}
