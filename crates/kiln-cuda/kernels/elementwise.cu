// Elementwise kernels over flat buffers of n elements; any 1-D grid covers them (grid-stride).
// kiln-waits-for-inputs
#include "common.cuh"

extern "C" __global__ void add_f32(float* out, const float* a, const float* b, u64 n) {
    wait_for_inputs();
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        out[i] = a[i] + b[i];
    }
}

extern "C" __global__ void scale_f32(float* out, const float* x, float factor, u64 n) {
    wait_for_inputs();
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        out[i] = x[i] * factor;
    }
}

// Fills with a bit pattern: used to poison outputs before a launch so unwritten elements show.
extern "C" __global__ void fill_u32(u32* out, u32 value, u64 n) {
    wait_for_inputs();
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        out[i] = value;
    }
}

extern "C" __global__ void fill_u16(u16* out, u16 value, u64 n) {
    wait_for_inputs();
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        out[i] = value;
    }
}
