// RMSNorm of row-major [rows][dim] f32 data: out = x / sqrt(mean(x^2) + eps) * weight.
// kiln-waits-for-inputs
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
    wait_for_inputs();
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
    wait_for_inputs();
    const float* xr = x + (u64)blockIdx.x * dim;
    const float sum_sq = block_row_sum_sq(xr, dim);
    scale_row(out + (u64)blockIdx.x * dim, xr, weight, dim, sum_sq, eps, threadIdx.x, NORM_BLOCK);
}

// rms_norm_{warp,block}_f32's row (bit-identical: the reduction is chosen by width the same
// way) written to `out` and, in the same pass, as f16 to xh [rows][ld] (ld: dim rounded up to
// 8, the pad zeroed) in the order mma_half_activations writes for `permuted`: the tensor-core
// mat-mat's input without a conversion launch. `out` must not alias `x`. Grid: rows.
extern "C" __global__ void __launch_bounds__(NORM_BLOCK) rms_norm_half_f32(float* out, u16* __restrict__ xh, const float* x, const float* weight,
                                                                           u32 dim, u32 ld, float eps, u32 permuted) {
    wait_for_inputs();
    const float* xr = x + (u64)blockIdx.x * dim;
    const float sum_sq = dim <= WARP_NORM_MAX_DIM ? warp_row_sum_sq(xr, dim, threadIdx.x & 31) : block_row_sum_sq(xr, dim);
    const float scale = rms_scale(sum_sq, dim, eps);
    float* row_out = out + (u64)blockIdx.x * dim;
    u16* row_half = xh + (u64)blockIdx.x * ld;
    const bool vector = (dim & 7) == 0 && float4_row(xr, dim) && float4_row(row_out, dim) && float4_row(weight, dim);
    for (u32 first = threadIdx.x * 8; first < ld; first += NORM_BLOCK * 8) {
        float v[8];
        if (vector) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float4 a = *reinterpret_cast<const float4*>(xr + first + 4 * h);
                const float4 w = *reinterpret_cast<const float4*>(weight + first + 4 * h);
                v[4 * h] = rms_normed(a.x, scale, w.x);
                v[4 * h + 1] = rms_normed(a.y, scale, w.y);
                v[4 * h + 2] = rms_normed(a.z, scale, w.z);
                v[4 * h + 3] = rms_normed(a.w, scale, w.w);
                *reinterpret_cast<float4*>(row_out + first + 4 * h) = make_float4(v[4 * h], v[4 * h + 1], v[4 * h + 2], v[4 * h + 3]);
            }
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const u32 i = first + j;
                v[j] = i < dim ? rms_normed(xr[i], scale, weight[i]) : 0.0f;
                if (i < dim) {
                    row_out[i] = v[j];
                }
            }
        }
        store_half8(row_half + first, v, permuted != 0);
    }
}

// x = (x + rms_norm(src) * weight) * scale per row of `dim` values: rms_norm_{warp,block}_f32's
// normed values (the reduction chosen by width the same way), then add_f32 and scale_f32's
// arithmetic, in one pass (Gemma's post-norms before the residual add). `src` must not alias
// `x`. Grid: rows.
// (x + normed) * scale, each step rounded as the separate add and scale kernels round it (no
// contraction of the norm's last product into the add).
__device__ __forceinline__ float normed_add(float x, float normed, float scale) {
    return __fmul_rn(__fadd_rn(x, normed), scale);
}

extern "C" __global__ void __launch_bounds__(NORM_BLOCK) rms_norm_add_f32(float* x, const float* src, const float* weight, u32 dim, float eps,
                                                                          float scale) {
    wait_for_inputs();
    const float* sr = src + (u64)blockIdx.x * dim;
    const float sum_sq = dim <= WARP_NORM_MAX_DIM ? warp_row_sum_sq(sr, dim, threadIdx.x & 31) : block_row_sum_sq(sr, dim);
    const float norm_scale = rms_scale(sum_sq, dim, eps);
    float* xr = x + (u64)blockIdx.x * dim;
    if (float4_row(xr, dim) && float4_row(sr, dim) && float4_row(weight, dim)) {
        for (u32 i = threadIdx.x; i < dim / 4; i += NORM_BLOCK) {
            const float4 v = reinterpret_cast<const float4*>(sr)[i];
            const float4 w = reinterpret_cast<const float4*>(weight)[i];
            float4 r = reinterpret_cast<float4*>(xr)[i];
            r.x = normed_add(r.x, rms_normed(v.x, norm_scale, w.x), scale);
            r.y = normed_add(r.y, rms_normed(v.y, norm_scale, w.y), scale);
            r.z = normed_add(r.z, rms_normed(v.z, norm_scale, w.z), scale);
            r.w = normed_add(r.w, rms_normed(v.w, norm_scale, w.w), scale);
            reinterpret_cast<float4*>(xr)[i] = r;
        }
        return;
    }
    for (u32 i = threadIdx.x; i < dim; i += NORM_BLOCK) {
        xr[i] = normed_add(xr[i], rms_normed(sr[i], norm_scale, weight[i]), scale);
    }
}

// out = rms_norm(a) * wa + rms_norm(b) * wb per row of `dim` values (Gemma 4: its dense FFN's
// and its experts' outputs, each post-normed, summed): both rows' squares loaded before either
// is reduced, each normed value as rms_norm_{warp,block}_f32 rounds it and the sum as add_f32
// does (bit for bit the norm, then rms_norm_add_f32 with scale 1). `out` must alias neither
// row. Grid: rows.
extern "C" __global__ void __launch_bounds__(NORM_BLOCK) rms_norm_sum_f32(float* out, const float* a, const float* wa, const float* b,
                                                                          const float* wb, u32 dim, float eps) {
    wait_for_inputs();
    const float* ar = a + (u64)blockIdx.x * dim;
    const float* br = b + (u64)blockIdx.x * dim;
    float sum_a, sum_b;
    if (dim <= WARP_NORM_MAX_DIM) {
        sum_a = warp_row_sum_sq(ar, dim, threadIdx.x & 31);
        sum_b = warp_row_sum_sq(br, dim, threadIdx.x & 31);
    } else {
        const float part_a = thread_row_sum_sq(ar, dim);
        const float part_b = thread_row_sum_sq(br, dim);
        sum_a = block_sum<NORM_BLOCK>(part_a);
        sum_b = block_sum<NORM_BLOCK>(part_b);
    }
    const float scale_a = rms_scale(sum_a, dim, eps);
    const float scale_b = rms_scale(sum_b, dim, eps);
    float* row = out + (u64)blockIdx.x * dim;
    for (u32 i = threadIdx.x; i < dim; i += NORM_BLOCK) {
        row[i] = __fadd_rn(rms_normed(ar[i], scale_a, wa[i]), rms_normed(br[i], scale_b, wb[i]));
    }
}
