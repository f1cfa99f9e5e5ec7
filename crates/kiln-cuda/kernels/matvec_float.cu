// Mat-vec of F32, F16 and BF16 weights (rows of `stride` elements) against f32 activations
// x [NTOK][cols], cols a multiple of 4; all arithmetic in f32. See matvec.cuh. One token takes
// matvec_float_row (a block per FV_ROW_ROWS rows, per row of a SwiGLU pair); the expert products
// keep matvec_float's warp rows.
// kiln-test-defines: NTOK=1,ROWS_PER_WARP=1
// kiln-test-defines: NTOK=3,ROWS_PER_WARP=2
// kiln-test-defines: NTOK=8,ROWS_PER_WARP=4
// kiln-waits-for-inputs
#include "matvec.cuh"

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
// launch: a block per FV_ROW_ROWS rows of a, then of b, then of c (a missing c has no rows).
template <class W>
__device__ __forceinline__ void matvec_float_stacked(const W& a, const W& b, const W& c, const float* x, u32 cols,
                                                     float* out_a, float* out_b, float* out_c, u32 rows_a, u32 rows_b,
                                                     u32 rows_c) {
    if (NTOK != 1) {
        return;  // the host launches the NTOK = 1 module's kernel only
    }
    u32 block = blockIdx.x;
    const u32 k = stacked_weight(block, (rows_a + FV_ROW_ROWS - 1) / FV_ROW_ROWS, (rows_b + FV_ROW_ROWS - 1) / FV_ROW_ROWS);
    const W weights[1] = {k == 0 ? a : k == 1 ? b : c};
    matvec_float_row<W, 1, FV_ROW_ROWS>(weights, x, cols, k == 0 ? out_a : k == 1 ? out_b : out_c, k == 0 ? rows_a : k == 1 ? rows_b : rows_c, 0,
                                        block);
}

#define FV_STACKED_PARAMS(W) \
    W a, W b, W c, const float *x, u32 cols, float *out_a, float *out_b, float *out_c, u32 rows_a, u32 rows_b, u32 rows_c
#define FV_STACKED_ARGS a, b, c, x, cols, out_a, out_b, out_c, rows_a, rows_b, rows_c

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
