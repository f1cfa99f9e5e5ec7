// RMSNorm pieces shared by norm.cu and the fused norm + quantize kernel (matvec_input.cu), so
// both reduce in the same order and produce bit-identical normalized values.
#pragma once
#include "common.cuh"

#define NORM_BLOCK 256
// Rows of at most this many values are reduced by one warp, longer ones by a whole block.
#define WARP_NORM_MAX_DIM 512

// Sum of squares of a row, lane-strided over one warp; every lane gets the total.
__device__ __forceinline__ float warp_row_sum_sq(const float* xr, u32 dim, u32 lane) {
    float sum_sq = 0.0f;
    for (u32 i = lane; i < dim; i += 32) {
        sum_sq += xr[i] * xr[i];
    }
    return warp_sum(sum_sq);
}

// Whether a row of `dim` floats at `p` can be read as float4s.
__device__ __forceinline__ bool float4_row(const void* p, u32 dim) {
    return (dim & 3) == 0 && (reinterpret_cast<u64>(p) & 15) == 0;
}

// The float4s of a row a thread reads in one pass of thread_row_sum_sq: 4 * NORM_BLOCK of them.
#define NORM_PASS_FLOAT4S 4

// This thread's float4s of a row's pass starting at float4 `base` (zeros past n4).
__device__ __forceinline__ void load_row_pass(const float4* x4, u32 base, u32 n4, float4 (&v)[NORM_PASS_FLOAT4S]) {
#pragma unroll
    for (int k = 0; k < NORM_PASS_FLOAT4S; ++k) {
        const u32 i = base + k * NORM_BLOCK;
        v[k] = i < n4 ? x4[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

// `sum_sq` plus the squares of a pass, in the order every caller adds them.
__device__ __forceinline__ float add_pass_squares(float sum_sq, const float4 (&v)[NORM_PASS_FLOAT4S]) {
#pragma unroll
    for (int k = 0; k < NORM_PASS_FLOAT4S; ++k) {
        sum_sq += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
    }
    return sum_sq;
}

// This thread's part of block_row_sum_sq (no barrier: a kernel can load two rows' parts
// before it reduces either).
__device__ __forceinline__ float thread_row_sum_sq(const float* xr, u32 dim) {
    float sum_sq = 0.0f;
    if (float4_row(xr, dim)) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        const u32 n4 = dim / 4;
        for (u32 base = threadIdx.x; base < n4; base += NORM_PASS_FLOAT4S * NORM_BLOCK) {
            float4 v[NORM_PASS_FLOAT4S];
            load_row_pass(x4, base, n4, v);
            sum_sq = add_pass_squares(sum_sq, v);
        }
    } else {
#pragma unroll 4
        for (u32 i = threadIdx.x; i < dim; i += NORM_BLOCK) {
            sum_sq += xr[i] * xr[i];
        }
    }
    return sum_sq;
}

// Sum of squares of a row, thread-strided over a NORM_BLOCK block; every thread gets the total.
// Each thread issues four loads before it adds any, so one memory latency covers 4096 values.
// Contains __syncthreads: all threads of the block must call it.
__device__ __forceinline__ float block_row_sum_sq(const float* xr, u32 dim) {
    return block_sum<NORM_BLOCK>(thread_row_sum_sq(xr, dim));
}

__device__ __forceinline__ float rms_scale(float sum_sq, u32 dim, float eps) {
    return 1.0f / sqrtf(sum_sq / (float)dim + eps);
}

// One normalized value; the product order is fixed so every caller rounds alike.
__device__ __forceinline__ float rms_normed(float x, float scale, float weight) {
    return x * scale * weight;
}
