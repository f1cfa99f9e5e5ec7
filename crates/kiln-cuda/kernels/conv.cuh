// A DeltaNet's causal convolution of its q/k/v channels, one channel and one token at a time:
// the steps ssm_conv_f32 (arch_ops.cu) and the one-token stacked mat-vec's epilogue
// (matvec.cuh) share, so both give the same bits.
#pragma once
#include "plan.cuh"

#define CONV_MAX_KERNEL 8

// Channel ch's taps, and its past inputs from its slot's state `st` ([kernel - 1][channels];
// zeros where the sequence starts fresh).
__device__ __forceinline__ void conv_load(const float* weight, const float* st, u32 ch, u32 channels, u32 kernel, bool fresh,
                                          float (&w)[CONV_MAX_KERNEL], float (&past)[CONV_MAX_KERNEL]) {
#pragma unroll
    for (u32 j = 0; j < CONV_MAX_KERNEL; ++j) {
        w[j] = j < kernel ? weight[(u64)ch * kernel + j] : 0.0f;
        past[j] = j + 1 < kernel && !fresh ? st[(u64)j * channels + ch] : 0.0f;
    }
}

// SiLU of the taps over the past inputs and the new input v; then v joins the past (shifted with
// constant indices only, so `past` stays in registers).
__device__ __forceinline__ float conv_step(const float (&w)[CONV_MAX_KERNEL], float (&past)[CONV_MAX_KERNEL], float v, u32 kernel) {
    float y = w[kernel - 1] * v;
#pragma unroll
    for (u32 j = 0; j + 1 < CONV_MAX_KERNEL; ++j) {
        if (j + 1 < kernel) {
            y += w[j] * past[j];
        }
    }
#pragma unroll
    for (u32 j = 0; j + 1 < CONV_MAX_KERNEL; ++j) {
        if (j + 2 < kernel) {
            past[j] = past[j + 1];
        } else if (j + 2 == kernel) {
            past[j] = v;
        }
    }
    return y / (1.0f + expf(-y));
}

__device__ __forceinline__ void conv_store(float* st, u32 ch, u32 channels, u32 kernel, const float (&past)[CONV_MAX_KERNEL]) {
#pragma unroll
    for (u32 j = 0; j + 1 < CONV_MAX_KERNEL; ++j) {
        if (j + 1 < kernel) {
            st[(u64)j * channels + ch] = past[j];
        }
    }
}

// What a one-token product needs to convolve its rows (a DeltaNet's q/k/v channels) as it
// finishes them: the taps ([channels][kernel]), the state of every slot ([n_slots][kernel - 1]
// [channels]), the slot of the step's one sequence, the step block (its start position), and
// the outputs (null: no convolution).
struct ConvEpilogue {
    float* out;
    const float* weight;
    float* state;
    const float* slots;
    const u32* step;
    u32 n_slots;
    u32 kernel;
};

// ssm_conv_f32 of channel ch of the step's one token, whose projection is v; NaN without a
// valid slot to continue from.
__device__ __forceinline__ void convolve_channel(const ConvEpilogue& c, u32 ch, u32 channels, float v) {
    const float slot = c.slots[0];
    if (!(slot >= 0.0f && slot < (float)c.n_slots)) {
        c.out[ch] = __int_as_float(0x7fc00000);
        return;
    }
    float* st = c.state + (u64)slot * (c.kernel - 1) * channels;
    float w[CONV_MAX_KERNEL];
    float past[CONV_MAX_KERNEL];
    conv_load(c.weight, st, ch, channels, c.kernel, step_seq(c.step, 0)[SEQ_POS0] == 0, w, past);
    c.out[ch] = conv_step(w, past, v, c.kernel);
    conv_store(st, ch, channels, c.kernel, past);
}
