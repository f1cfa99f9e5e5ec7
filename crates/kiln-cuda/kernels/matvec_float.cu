// Mat-vec of F32, F16 and BF16 weights (rows of `stride` elements) against f32 activations
// x [NTOK][cols], cols a multiple of 4; all arithmetic in f32. See matvec.cuh. One token takes
// matvec_float_row (a block per FV_ROW_ROWS rows, per row of a SwiGLU pair); the expert products
// keep matvec_float's warp rows.
// kiln-test-defines: NTOK=1,ROWS_PER_WARP=1
// kiln-test-defines: NTOK=3,ROWS_PER_WARP=2
// kiln-test-defines: NTOK=8,ROWS_PER_WARP=4
// kiln-waits-for-inputs
#include "matvec.cuh"

// Steps whose weight loads are issued together: 32 registers of weights in flight per thread.
#define FV_BATCH (ROWS_PER_WARP < 8 ? 8 / ROWS_PER_WARP : 1)

// Weights of steps c0, c0 + 128, ... (FV_BATCH of them) of every row; zeros past `cols`.
template <class W, int NW, int RPW>
__device__ __forceinline__ void fetch_float_steps(float4 (&wv)[FV_BATCH][NW * RPW], const W (&w)[NW],
                                                  const u32 (&row_of)[NW * RPW], u32 c0, u32 cols) {
#pragma unroll
    for (int b = 0; b < FV_BATCH; ++b) {
        const u32 c = c0 + 128 * b;
#pragma unroll
        for (int r = 0; r < NW * RPW; ++r) {
            wv[b][r] = c < cols ? w[r / RPW].load4(row_of[r], c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
}

// Float weights (FloatRows) against f32 activations x [NTOK][cols], cols a multiple of 4 (the
// host routes other widths to the mat-mat kernel). Lane l handles values 128 s + 4 l of step s,
// so both the weight and the activation loads of a warp are contiguous.
template <class W, int NW>
__device__ __forceinline__ void matvec_float(const W (&w)[NW], const float* __restrict__ x, u32 cols, float* out,
                                             u32 rows, u32 accumulate) {
    constexpr int RPW = NW == 2 ? SWIGLU_ROWS_PER_WARP : ROWS_PER_WARP;
    constexpr int R = NW * RPW;
    const u32 lane = threadIdx.x & 31;
    const u32 row0 = (blockIdx.x * MV_WARPS + (threadIdx.x >> 5)) * RPW;
    if (row0 >= rows) {
        return;
    }
    u32 row_of[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        row_of[r] = min(row0 + r % RPW, rows - 1);
    }
    float acc[R][NTOK];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int t = 0; t < NTOK; ++t) {
            acc[r][t] = 0.0f;
        }
    }
    float4 wv[FV_BATCH][R];
    fetch_float_steps<W, NW, RPW>(wv, w, row_of, 4 * lane, cols);
    wait_for_inputs();
    for (u32 c0 = 4 * lane; c0 < cols; c0 += 128 * FV_BATCH) {
        if (c0 > 4 * lane) {
            fetch_float_steps<W, NW, RPW>(wv, w, row_of, c0, cols);
        }
#pragma unroll
        for (int b = 0; b < FV_BATCH; ++b) {
            const u32 c = c0 + 128 * b;
            if (c >= cols) {
                break;
            }
#pragma unroll
            for (int t = 0; t < NTOK; ++t) {
                const float4 xv = __ldg(reinterpret_cast<const float4*>(x + (u64)t * cols + c));
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    float a = acc[r][t];
                    a = fmaf(wv[b][r].x, xv.x, a);
                    a = fmaf(wv[b][r].y, xv.y, a);
                    a = fmaf(wv[b][r].z, xv.z, a);
                    acc[r][t] = fmaf(wv[b][r].w, xv.w, a);
                }
            }
        }
    }
    float ones[NTOK];
#pragma unroll
    for (int t = 0; t < NTOK; ++t) {
        ones[t] = 1.0f;
    }
    finish_rows<NW, RPW>(acc, row0, rows, out, accumulate, ones);
}

// One token: the FV_ROW_WARPS warps of a block share R rows (of each of NW weights), every
// thread streaming eight values of each row per 16-byte load with FV_ROW_BATCH / R steps in
// flight. A block per row or two keeps all SMs busy even for short products (the 1024-row K/V
// projections) and halves the load count of matvec_float's lane-per-four-values loop. Block
// `block` computes rows block * R onwards.
#define FV_ROW_BATCH 4
// Warps of that block: 8 streams 4-14% more bytes a second than 4 on the 8B shapes (standalone
// harness, docs/performance-log.md), the LM head's 128256 rows alike within 2%.
#define FV_ROW_WARPS 8
#define FV_ROW_THREADS (FV_ROW_WARPS * 32)
// Rows of one weight a block takes (plain and stacked products; the SwiGLU pair already reads
// two rows a step): each f32 activation a thread reads from L1 serves that many f16 rows, so
// the block reads 4 / FV_ROW_ROWS bytes of activation per 2-byte weight instead of 4.
#define FV_ROW_ROWS 2
// With `in_scale` (NW = 1), the product of the RMSNorm of x times in_scale ([cols]; Gemma 4's
// router): x times in_scale is multiplied as it is loaded, the block sums x^2 from the same
// loads (it reads every column once), and each row's total is scaled by 1 / rms(x).
template <class W, int NW, int R = 1>
__device__ __forceinline__ void matvec_float_row(const W (&w)[NW], const float* __restrict__ x, u32 cols, float* out,
                                                 u32 rows, u32 accumulate, u32 block, const float* __restrict__ in_scale = nullptr,
                                                 float in_eps = 0.0f) {
    static_assert(NW == 1 || R == 1, "the SwiGLU pair takes one row of each weight");
    constexpr u32 STEP = 8 * FV_ROW_THREADS;
    constexpr int SLOTS = NW * R;  // slot s: row row0 + s % R of weight s / R
    constexpr int BATCH = FV_ROW_BATCH / R > 0 ? FV_ROW_BATCH / R : 1;
    const u32 row0 = block * R;
    if (row0 >= rows) {
        return;
    }
    uint4 raw[BATCH][SLOTS][W::RAW8];
    auto fetch = [&](u32 c0) {
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            const u32 c = c0 + STEP * b;
#pragma unroll
            for (int s = 0; s < SLOTS; ++s) {
                const u32 row = row0 + s % R;
                if (c < cols && row < rows) {
                    w[s / R].load8(row, c, raw[b][s]);
                } else {
#pragma unroll
                    for (int i = 0; i < W::RAW8; ++i) {
                        raw[b][s][i] = make_uint4(0, 0, 0, 0);
                    }
                }
            }
        }
    };
    float acc[SLOTS];
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
        acc[s] = 0.0f;
    }
    float sum_sq = 0.0f;
    const u32 first = 8 * threadIdx.x;
    fetch(first);
    wait_for_inputs();
    for (u32 c0 = first; c0 < cols; c0 += STEP * BATCH) {
        if (c0 != first) {
            fetch(c0);
        }
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            const u32 c = c0 + STEP * b;
            if (c >= cols) {
                break;
            }
            // cols is a multiple of 4: the second half of the eight is either all in or all out.
            float4 x0 = __ldg(reinterpret_cast<const float4*>(x + c));
            float4 x1 = c + 4 < cols ? __ldg(reinterpret_cast<const float4*>(x + c + 4)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (in_scale != nullptr) {
                const float4 s0 = __ldg(reinterpret_cast<const float4*>(in_scale + c));
                const float4 s1 = c + 4 < cols ? __ldg(reinterpret_cast<const float4*>(in_scale + c + 4)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                sum_sq += x0.x * x0.x + x0.y * x0.y + x0.z * x0.z + x0.w * x0.w + x1.x * x1.x + x1.y * x1.y + x1.z * x1.z + x1.w * x1.w;
                x0 = make_float4(x0.x * s0.x, x0.y * s0.y, x0.z * s0.z, x0.w * s0.w);
                x1 = make_float4(x1.x * s1.x, x1.y * s1.y, x1.z * s1.z, x1.w * s1.w);
            }
#pragma unroll
            for (int s = 0; s < SLOTS; ++s) {
                float v[8];
                W::expand8(raw[b][s], v);
                float a = acc[s];
                a = fmaf(v[0], x0.x, a);
                a = fmaf(v[1], x0.y, a);
                a = fmaf(v[2], x0.z, a);
                a = fmaf(v[3], x0.w, a);
                a = fmaf(v[4], x1.x, a);
                a = fmaf(v[5], x1.y, a);
                a = fmaf(v[6], x1.z, a);
                acc[s] = fmaf(v[7], x1.w, a);
            }
        }
    }
    __shared__ float partial[SLOTS][FV_ROW_WARPS];
    __shared__ float partial_sq[FV_ROW_WARPS];
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
        const float total = warp_sum(acc[s]);
        if ((threadIdx.x & 31) == 0) {
            partial[s][threadIdx.x >> 5] = total;
        }
    }
    if (in_scale != nullptr) {
        const float total = warp_sum(sum_sq);
        if ((threadIdx.x & 31) == 0) {
            partial_sq[threadIdx.x >> 5] = total;
        }
    }
    __syncthreads();
    float row_scale = 1.0f;
    if (in_scale != nullptr) {
        float total = 0.0f;
#pragma unroll
        for (int i = 0; i < FV_ROW_WARPS; ++i) {
            total += partial_sq[i];
        }
        row_scale = 1.0f / sqrtf(total / (float)cols + in_eps);
    }
    // Thread s sums slot s, every slot in the same order.
    auto slot_total = [&](int slot) {
        float total = 0.0f;
#pragma unroll
        for (int i = 0; i < FV_ROW_WARPS; ++i) {
            total += partial[slot][i];
        }
        return total;
    };
    if (NW == 2) {
        if (threadIdx.x == 0) {
            out[row0] = silu(slot_total(0)) * slot_total(1);
        }
    } else if (threadIdx.x < R && row0 + threadIdx.x < rows) {
        const u32 row = row0 + threadIdx.x;
        const float total = slot_total(threadIdx.x) * row_scale;
        out[row] = accumulate ? out[row] + total : total;
    }
}

// One token's kernels run a block of FV_ROW_THREADS per row, the others MV_THREADS.
#define FV_THREADS (NTOK == 1 ? FV_ROW_THREADS : MV_THREADS)

template <class W>
__device__ __forceinline__ void matvec_float_one(const W& w, const float* x, u32 cols, float* out, u32 rows,
                                                 u32 accumulate) {
    const W weights[1] = {w};
    if (NTOK == 1) {
        matvec_float_row<W, 1, FV_ROW_ROWS>(weights, x, cols, out, rows, accumulate, blockIdx.x);
    } else {
        matvec_float<W, 1>(weights, x, cols, out, rows, accumulate);
    }
}

template <class W>
__device__ __forceinline__ void matvec_float_two(const W& gate, const W& up, const float* x, u32 cols, float* out,
                                                 u32 rows) {
    const W weights[2] = {gate, up};
    if (NTOK == 1) {
        matvec_float_row<W, 2>(weights, x, cols, out, rows, 0, blockIdx.x);
    } else {
        matvec_float<W, 2>(weights, x, cols, out, rows, 0);
    }
}

#define FV_ARGS const float* x, u32 cols, float* out, u32 rows

// One token of up to three weights of one kind and width (attention's q, k and v) in one
// launch: a block per FV_ROW_ROWS rows of a, then of b, then of c (a missing weight has no
// rows); with in_scale (non-null), of x's RMSNorm times in_scale (matvec_float_row).
template <class W>
__device__ __forceinline__ void matvec_float_stacked(const W& a, const W& b, const W& c, const float* x, u32 cols,
                                                     float* out_a, float* out_b, float* out_c, u32 rows_a, u32 rows_b,
                                                     u32 rows_c, const float* in_scale, float in_eps) {
    if (NTOK != 1) {
        return;  // the host launches the NTOK = 1 module's kernel only
    }
    u32 block = blockIdx.x;
    const u32 k = stacked_weight(block, (rows_a + FV_ROW_ROWS - 1) / FV_ROW_ROWS, (rows_b + FV_ROW_ROWS - 1) / FV_ROW_ROWS);
    const W weights[1] = {k == 0 ? a : k == 1 ? b : c};
    float* out = k == 0 ? out_a : k == 1 ? out_b : out_c;
    const u32 rows = k == 0 ? rows_a : k == 1 ? rows_b : rows_c;
    // Two copies, so the products without the norm keep the loop they had.
    if (in_scale != nullptr) {
        matvec_float_row<W, 1, FV_ROW_ROWS>(weights, x, cols, out, rows, 0, block, in_scale, in_eps);
    } else {
        matvec_float_row<W, 1, FV_ROW_ROWS>(weights, x, cols, out, rows, 0, block);
    }
}

#define FV_STACKED_PARAMS(W)                                                                                         \
    W a, W b, W c, const float *x, u32 cols, float *out_a, float *out_b, float *out_c, u32 rows_a, u32 rows_b, u32 rows_c, \
        const float *in_scale, float in_eps
#define FV_STACKED_ARGS a, b, c, x, cols, out_a, out_b, out_c, rows_a, rows_b, rows_c, in_scale, in_eps

// The expert-indexed product of float experts (see matvec_experts in matvec.cuh).
template <class W>
__device__ __forceinline__ void matvec_float_experts(const W* table, const float* ids, u32 n_experts, u32 n_used,
                                                     u32 per_slot, u32 slot0, FV_ARGS) {
    if (NTOK != 1) {
        return;  // one input row per slot: the host launches the NTOK = 1 module's kernel only
    }
    const u32 slot = slot0 + blockIdx.y;
    const u32 e = block_expert(ids, slot, n_experts, out, rows, MV_WARPS * ROWS_PER_WARP);
    if (e >= n_experts) {
        return;
    }
    const W weights[1] = {table[e]};
    const u64 row = per_slot ? slot : slot / n_used;
    matvec_float<W, 1>(weights, x + row * cols, cols, out, rows, 0);
}

#define FV_EXPERTS_PARAMS(W) const W *table, const float *ids, u32 n_experts, u32 n_used, u32 per_slot, u32 slot0, FV_ARGS
#define FV_EXPERTS_ARGS table, ids, n_experts, n_used, per_slot, slot0, x, cols, out, rows

extern "C" __global__ void __launch_bounds__(FV_THREADS) matvec_f32(FloatRows<0> w, FV_ARGS, u32 accumulate) {
    matvec_float_one(w, x, cols, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(FV_THREADS) matvec_swiglu_f32(FloatRows<0> gate, FloatRows<0> up, FV_ARGS) {
    matvec_float_two(gate, up, x, cols, out, rows);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_f32(FV_EXPERTS_PARAMS(FloatRows<0>)) {
    matvec_float_experts(FV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(FV_THREADS) matvec_stacked_f32(FV_STACKED_PARAMS(FloatRows<0>)) {
    matvec_float_stacked(FV_STACKED_ARGS);
}

extern "C" __global__ void __launch_bounds__(FV_THREADS) matvec_f16(FloatRows<1> w, FV_ARGS, u32 accumulate) {
    matvec_float_one(w, x, cols, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(FV_THREADS) matvec_swiglu_f16(FloatRows<1> gate, FloatRows<1> up, FV_ARGS) {
    matvec_float_two(gate, up, x, cols, out, rows);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_f16(FV_EXPERTS_PARAMS(FloatRows<1>)) {
    matvec_float_experts(FV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(FV_THREADS) matvec_stacked_f16(FV_STACKED_PARAMS(FloatRows<1>)) {
    matvec_float_stacked(FV_STACKED_ARGS);
}

extern "C" __global__ void __launch_bounds__(FV_THREADS) matvec_bf16(FloatRows<2> w, FV_ARGS, u32 accumulate) {
    matvec_float_one(w, x, cols, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(FV_THREADS) matvec_swiglu_bf16(FloatRows<2> gate, FloatRows<2> up, FV_ARGS) {
    matvec_float_two(gate, up, x, cols, out, rows);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_bf16(FV_EXPERTS_PARAMS(FloatRows<2>)) {
    matvec_float_experts(FV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(FV_THREADS) matvec_stacked_bf16(FV_STACKED_PARAMS(FloatRows<2>)) {
    matvec_float_stacked(FV_STACKED_ARGS);
}
