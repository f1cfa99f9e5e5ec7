// Conversions between f32 and the 16-bit float formats (carried as raw u16 bit patterns).
// kiln-waits-for-inputs
#include "common.cuh"

extern "C" __global__ void f16_to_f32(float* out, const u16* in, u64 n) {
    wait_for_inputs();
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        out[i] = f16_bits_to_f32(in[i]);
    }
}

extern "C" __global__ void bf16_to_f32(float* out, const u16* in, u64 n) {
    wait_for_inputs();
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        out[i] = bf16_bits_to_f32(in[i]);
    }
}

extern "C" __global__ void f32_to_f16(u16* out, const float* in, u64 n) {
    wait_for_inputs();
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        out[i] = f32_to_f16_bits(in[i]);
    }
}

extern "C" __global__ void f32_to_bf16(u16* out, const float* in, u64 n) {
    wait_for_inputs();
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        out[i] = f32_to_bf16_bits(in[i]);
    }
}
