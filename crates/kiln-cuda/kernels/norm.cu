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

// Whether a row of `dim` values at each of `p` is reduced by the block (not one warp) in one
// pass of float4s (up to 4,096 values), so a kernel can keep the pass's values in registers.
template <typename... P>
__device__ __forceinline__ bool one_pass_row(u32 dim, const P*... p) {
    return dim > WARP_NORM_MAX_DIM && dim / 4 <= NORM_PASS_FLOAT4S * NORM_BLOCK && (float4_row(p, dim) && ...);
}

// One block per row: for model-width rows. A row of one pass is read once (its weights before
// the wait). Grid: rows.
extern "C" __global__ void __launch_bounds__(NORM_BLOCK) rms_norm_block_f32(float* out, const float* x, const float* weight,
                                                                            u32 rows, u32 dim, float eps) {
    const float* xr = x + (u64)blockIdx.x * dim;
    float* row = out + (u64)blockIdx.x * dim;
    if (one_pass_row(dim, xr, row, weight)) {
        const u32 n4 = dim / 4;
        float4 w[NORM_PASS_FLOAT4S], v[NORM_PASS_FLOAT4S];
        load_row_pass(reinterpret_cast<const float4*>(weight), threadIdx.x, n4, w);
        wait_for_inputs();
        load_row_pass(reinterpret_cast<const float4*>(xr), threadIdx.x, n4, v);
        const float scale = rms_scale(block_sum<NORM_BLOCK>(add_pass_squares(0.0f, v)), dim, eps);
#pragma unroll
        for (int k = 0; k < NORM_PASS_FLOAT4S; ++k) {
            const u32 i = threadIdx.x + k * NORM_BLOCK;
            if (i < n4) {
                reinterpret_cast<float4*>(row)[i] = make_float4(rms_normed(v[k].x, scale, w[k].x), rms_normed(v[k].y, scale, w[k].y),
                                                                rms_normed(v[k].z, scale, w[k].z), rms_normed(v[k].w, scale, w[k].w));
            }
        }
        return;
    }
    wait_for_inputs();
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

// (x + normed) * scale for four values.
__device__ __forceinline__ float4 normed_add4(float4 x, float4 v, float norm_scale, float4 w, float scale) {
    return make_float4(normed_add(x.x, rms_normed(v.x, norm_scale, w.x), scale), normed_add(x.y, rms_normed(v.y, norm_scale, w.y), scale),
                       normed_add(x.z, rms_normed(v.z, norm_scale, w.z), scale), normed_add(x.w, rms_normed(v.w, norm_scale, w.w), scale));
}

extern "C" __global__ void __launch_bounds__(NORM_BLOCK) rms_norm_add_f32(float* x, const float* src, const float* weight, u32 dim, float eps,
                                                                          float scale) {
    const float* sr = src + (u64)blockIdx.x * dim;
    float* xr = x + (u64)blockIdx.x * dim;
    if (one_pass_row(dim, sr, xr, weight)) {
        // The pass's source, residual and weight values in registers, the weight's before the wait.
        const u32 n4 = dim / 4;
        float4 w[NORM_PASS_FLOAT4S], v[NORM_PASS_FLOAT4S], r[NORM_PASS_FLOAT4S];
        load_row_pass(reinterpret_cast<const float4*>(weight), threadIdx.x, n4, w);
        wait_for_inputs();
        load_row_pass(reinterpret_cast<const float4*>(sr), threadIdx.x, n4, v);
        load_row_pass(reinterpret_cast<const float4*>(xr), threadIdx.x, n4, r);
        const float norm_scale = rms_scale(block_sum<NORM_BLOCK>(add_pass_squares(0.0f, v)), dim, eps);
#pragma unroll
        for (int k = 0; k < NORM_PASS_FLOAT4S; ++k) {
            const u32 i = threadIdx.x + k * NORM_BLOCK;
            if (i < n4) {
                reinterpret_cast<float4*>(xr)[i] = normed_add4(r[k], v[k], norm_scale, w[k], scale);
            }
        }
        return;
    }
    wait_for_inputs();
    const float sum_sq = dim <= WARP_NORM_MAX_DIM ? warp_row_sum_sq(sr, dim, threadIdx.x & 31) : block_row_sum_sq(sr, dim);
    const float norm_scale = rms_scale(sum_sq, dim, eps);
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
// and its experts' outputs, each post-normed, summed), each normed value as
// rms_norm_{warp,block}_f32 rounds it and the sum as add_f32 does (bit for bit the norm, then
// rms_norm_add_f32 with scale 1). A row of float4s that one pass covers (Gemma 4's 2,816) is
// loaded once, both rows and both weights in flight together (the weights before the wait),
// and kept in registers for the output. `out` must alias neither row. Grid: rows.
__device__ __forceinline__ float4 normed_sum4(float4 a, float sa, float4 wa, float4 b, float sb, float4 wb) {
    return make_float4(__fadd_rn(rms_normed(a.x, sa, wa.x), rms_normed(b.x, sb, wb.x)), __fadd_rn(rms_normed(a.y, sa, wa.y), rms_normed(b.y, sb, wb.y)),
                       __fadd_rn(rms_normed(a.z, sa, wa.z), rms_normed(b.z, sb, wb.z)), __fadd_rn(rms_normed(a.w, sa, wa.w), rms_normed(b.w, sb, wb.w)));
}

extern "C" __global__ void __launch_bounds__(NORM_BLOCK) rms_norm_sum_f32(float* __restrict__ out, const float* __restrict__ a, const float* __restrict__ wa,
                                                                          const float* __restrict__ b, const float* __restrict__ wb, u32 dim, float eps) {
    const float* ar = a + (u64)blockIdx.x * dim;
    const float* br = b + (u64)blockIdx.x * dim;
    float* row = out + (u64)blockIdx.x * dim;
    const u32 n4 = dim / 4;
    if (one_pass_row(dim, ar, br, row, wa, wb)) {
        float4 w0[NORM_PASS_FLOAT4S], w1[NORM_PASS_FLOAT4S], va[NORM_PASS_FLOAT4S], vb[NORM_PASS_FLOAT4S];
        load_row_pass(reinterpret_cast<const float4*>(wa), threadIdx.x, n4, w0);
        load_row_pass(reinterpret_cast<const float4*>(wb), threadIdx.x, n4, w1);
        wait_for_inputs();
        load_row_pass(reinterpret_cast<const float4*>(ar), threadIdx.x, n4, va);
        load_row_pass(reinterpret_cast<const float4*>(br), threadIdx.x, n4, vb);
        const float sum_a = block_sum<NORM_BLOCK>(add_pass_squares(0.0f, va));
        const float sum_b = block_sum<NORM_BLOCK>(add_pass_squares(0.0f, vb));
        const float sa = rms_scale(sum_a, dim, eps), sb = rms_scale(sum_b, dim, eps);
#pragma unroll
        for (int k = 0; k < NORM_PASS_FLOAT4S; ++k) {
            const u32 i = threadIdx.x + k * NORM_BLOCK;
            if (i < n4) {
                reinterpret_cast<float4*>(row)[i] = normed_sum4(va[k], sa, w0[k], vb[k], sb, w1[k]);
            }
        }
        return;
    }
    wait_for_inputs();
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
    const float sa = rms_scale(sum_a, dim, eps), sb = rms_scale(sum_b, dim, eps);
    for (u32 i = threadIdx.x; i < dim; i += NORM_BLOCK) {
        row[i] = __fadd_rn(rms_normed(ar[i], sa, wa[i]), rms_normed(br[i], sb, wb[i]));
    }
}
