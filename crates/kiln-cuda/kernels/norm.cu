// RMSNorm of row-major [rows][dim] f32 data: out = x / sqrt(mean(x^2) + eps) * weight.
#include "norm.cuh"

__device__ __forceinline__ void scale_row(float* out, const float* x, const float* weight, u32 dim, float sum_sq,
                                          float eps, u32 first, u32 stride) {
    const float scale = rms_scale(sum_sq, dim, eps);
    if (float4_row(out, dim) && float4_row(x, dim) && float4_row(weight, dim)) {
        // Each thread reads whole float4s of x before writing the same ones: in-place is safe.
        const u32 n4 = dim / 4;
        for (u32 i = first; i < n4; i += stride) {
            const float4 v = reinterpret_cast<const float4*>(x)[i];
            const float4 w = reinterpret_cast<const float4*>(weight)[i];
            reinterpret_cast<float4*>(out)[i] = make_float4(rms_normed(v.x, scale, w.x), rms_normed(v.y, scale, w.y),
                                                            rms_normed(v.z, scale, w.z), rms_normed(v.w, scale, w.w));
        }
        return;
    }
    for (u32 i = first; i < dim; i += stride) {
        out[i] = rms_normed(x[i], scale, weight[i]);
    }
}

// One warp per row: for short rows (per-head q/k norms, small models). Grid: ceil(rows / 8).
extern "C" __global__ void __launch_bounds__(NORM_BLOCK) rms_norm_warp_f32(float* out, const float* x, const float* weight,
                                                                           u32 rows, u32 dim, float eps) {
    const u32 row = blockIdx.x * (NORM_BLOCK / 32) + threadIdx.x / 32;
    const u32 lane = threadIdx.x & 31;
    if (row >= rows) {
        return;
    }
    const float* xr = x + (u64)row * dim;
    scale_row(out + (u64)row * dim, xr, weight, dim, warp_row_sum_sq(xr, dim, lane), eps, lane, 32);
}

// One block per row: for model-width rows. Grid: rows.
extern "C" __global__ void __launch_bounds__(NORM_BLOCK) rms_norm_block_f32(float* out, const float* x, const float* weight,
                                                                            u32 rows, u32 dim, float eps) {
    const float* xr = x + (u64)blockIdx.x * dim;
    const float sum_sq = block_row_sum_sq(xr, dim);
    scale_row(out + (u64)blockIdx.x * dim, xr, weight, dim, sum_sq, eps, threadIdx.x, NORM_BLOCK);
}
