// What a quantized mat-vec stores for the product after it, and the deferred RMSNorm it reads
// from one: the residual product's norm epilogue (norm_block_rows), the SwiGLU's quantization
// of its own output (quantize_block_rows) and the readers' scale (input_scales). Part of
// matvec.cuh, which includes it after its launch-shape defines (NTOK, MV_GROUPS, ...).
#pragma once
#ifndef MV_GROUPS
#error "matvec_next.cuh is included by matvec.cuh"
#endif

// An input whose RMSNorm is still to be applied (host: matvec::QuantizedActivations' deferred
// norm): its codes quantize x * weight, and parts[t][count] hold the sums of x^2 over the
// blocks of the product that wrote it (norm_block_rows), so each token's output is scaled by
// 1 / sqrt(sum / cols + eps). parts == nullptr: nothing to apply.
struct InputNorm {
    const float* parts;
    u32 count;
    u32 cols;
    float eps;
    u32 pad_;
};

// Each token's scale of an InputNorm (1 without one). All lanes of the warp take part; every
// warp adds the parts in the same order, so all rows get the same scale.
__device__ __forceinline__ void input_scales(const InputNorm& xn, float (&scale)[NTOK]) {
#pragma unroll
    for (int t = 0; t < NTOK; ++t) {
        scale[t] = 1.0f;
        if (xn.parts != nullptr) {
            float sum = 0.0f;
            for (u32 i = threadIdx.x & 31; i < xn.count; i += 32) {
                sum += __ldg(xn.parts + t * xn.count + i);
            }
            scale[t] = 1.0f / sqrtf(warp_sum(sum) / (float)xn.cols + xn.eps);
        }
    }
}

// Where a residual product also prepares the next product's input, the RMSNorm of the new
// residual with `weight` (host: matvec::matmul_add_normed): xq/xds as quantize_chunk writes
// them, of x * weight, and parts[t][gridDim.x] the sums of x^2 over each block's rows, so the
// consumer applies 1 / rms (InputNorm). xq == nullptr: none.
struct NextNorm {
    const float* weight;
    i8* xq;
    float2* xds;
    float* parts;
};

// This block's rows of the new residual `out` (NTOK tokens of `rows`) quantized times the norm
// weight, and their sum of squares, per the NextNorm above. Like quantize_block_rows, the host
// passes a NextNorm only for launch shapes whose blocks hold whole 16-row chunks and none of
// whose warps return early.
__device__ __forceinline__ void norm_block_rows(const float* out, u32 rows, const NextNorm& next) {
    constexpr u32 BLOCK_ROWS = MV_GROUPS * ROWS_PER_WARP;
    if constexpr (BLOCK_ROWS % CHUNK_VALUES == 0) {
        constexpr u32 CHUNKS = BLOCK_ROWS / CHUNK_VALUES;
        static_assert((CHUNKS & (CHUNKS - 1)) == 0 && CHUNKS * NTOK <= 32, "a block's chunks of all tokens fit one warp");
        __syncthreads();
        if (threadIdx.x < 32) {
            const u32 token = threadIdx.x / CHUNKS;
            const u32 chunk = blockIdx.x * CHUNKS + threadIdx.x % CHUNKS;
            float sum_sq = 0.0f;
            if (threadIdx.x < CHUNKS * NTOK) {
                float v[CHUNK_VALUES];
                load_written_chunk(out + (u64)token * rows + chunk * CHUNK_VALUES, v);
                const float4* w4 = reinterpret_cast<const float4*>(next.weight + chunk * CHUNK_VALUES);
#pragma unroll
                for (int i = 0; i < CHUNK_VALUES / 4; ++i) {
                    const float4 w = __ldg(w4 + i);
                    sum_sq += v[4 * i] * v[4 * i] + v[4 * i + 1] * v[4 * i + 1] + v[4 * i + 2] * v[4 * i + 2] + v[4 * i + 3] * v[4 * i + 3];
                    v[4 * i] *= w.x;
                    v[4 * i + 1] *= w.y;
                    v[4 * i + 2] *= w.z;
                    v[4 * i + 3] *= w.w;
                }
                quantize_chunk(v, next.xq, next.xds, (u64)token * (rows / CHUNK_VALUES) + chunk);
            }
#pragma unroll
            for (u32 offset = 1; offset < CHUNKS; offset *= 2) {
                sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, offset);
            }
            if (threadIdx.x < CHUNKS * NTOK && threadIdx.x % CHUNKS == 0) {
                next.parts[(u64)token * gridDim.x + blockIdx.x] = sum_sq;
            }
        }
    }
}

// The SwiGLU's rows of this block stored again as the next product's int8 input (the down
// projection's; quantize_chunk's layout, chunks_per_token = rows / 16). The host passes
// next_xq only for launch shapes whose block holds whole 16-row chunks and none of whose warps
// return early (rows a multiple of the block's rows, and of 512 for several tokens), so each
// chunk's amax is found inside the block, behind one barrier, from the values just written.
__device__ __forceinline__ void quantize_block_rows(const float* out, u32 rows, i8* next_xq, float2* next_xds) {
    constexpr u32 BLOCK_ROWS = MV_GROUPS * SWIGLU_ROWS_PER_WARP;
    if constexpr (BLOCK_ROWS % CHUNK_VALUES == 0) {
        constexpr u32 CHUNKS = BLOCK_ROWS / CHUNK_VALUES;
        __syncthreads();
        if (threadIdx.x < CHUNKS * NTOK) {
            const u32 token = threadIdx.x / CHUNKS;
            const u32 chunk = blockIdx.x * CHUNKS + threadIdx.x % CHUNKS;
            float v[CHUNK_VALUES];
            load_written_chunk(out + (u64)token * rows + chunk * CHUNK_VALUES, v);
            quantize_chunk(v, next_xq, next_xds, (u64)token * (rows / CHUNK_VALUES) + chunk);
        }
    }
}

#define MV_NEXT_PARAMS i8 *next_xq, float2 *next_xds
