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

// Sum of squares of a row, thread-strided over a NORM_BLOCK block; every thread gets the total.
// Contains __syncthreads: all threads of the block must call it.
__device__ __forceinline__ float block_row_sum_sq(const float* xr, u32 dim) {
    float sum_sq = 0.0f;
    for (u32 i = threadIdx.x; i < dim; i += NORM_BLOCK) {
        sum_sq += xr[i] * xr[i];
    }
    return block_sum<NORM_BLOCK>(sum_sq);
}

__device__ __forceinline__ float rms_scale(float sum_sq, u32 dim, float eps) {
    return 1.0f / sqrtf(sum_sq / (float)dim + eps);
}

// One normalized value; the product order is fixed so every caller rounds alike.
__device__ __forceinline__ float rms_normed(float x, float scale, float weight) {
    return x * scale * weight;
}
