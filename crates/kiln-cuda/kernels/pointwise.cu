// Pointwise ops of the decoder block that the fused mat-vec epilogues do not cover.
// Any 1-D grid (grid-stride).
// kiln-waits-for-inputs
#include "common.cuh"
#include "plan.cuh"

// x[t][i] += bias[i] for x of n_rows rows of `dim` values.
extern "C" __global__ void add_bias_f32(float* x, const float* bias, u32 dim, u64 n) {
    wait_for_inputs();
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        x[i] += bias[i % dim];
    }
}

// out = silu(gate) * up, written as the CPU backend does: gate / (1 + exp(-gate)) * up.
extern "C" __global__ void swiglu_f32(float* out, const float* gate, const float* up, u64 n) {
    wait_for_inputs();
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// dst[i] = src[step's logit row i] for the step's logits rows, rows of `dim` values.
extern "C" __global__ void gather_rows_f32(float* dst, const float* src, const u32* step, u32 dim) {
    wait_for_inputs();
    const u32* rows = step + step[STEP_LOGIT_ROWS_AT];
    const u64 n = (u64)step[STEP_N_LOGIT_ROWS] * dim;
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        dst[i] = src[(u64)rows[i / dim] * dim + i % dim];
    }
}
