// Pointwise ops of the decoder block that the fused mat-vec epilogues do not cover.
// Any 1-D grid (grid-stride).
#include "common.cuh"

// x[t][i] += bias[i] for x of n_rows rows of `dim` values.
extern "C" __global__ void add_bias_f32(float* x, const float* bias, u32 dim, u64 n) {
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        x[i] += bias[i % dim];
    }
}

// out = silu(gate) * up, written as the CPU backend does: gate / (1 + exp(-gate)) * up.
extern "C" __global__ void swiglu_f32(float* out, const float* gate, const float* up, u64 n) {
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}
