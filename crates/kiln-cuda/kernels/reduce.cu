// Row reductions: one block of BLOCK_SIZE threads per row of a row-major [rows, cols] matrix.
// kiln-test-defines: BLOCK_SIZE=128
// kiln-test-defines: BLOCK_SIZE=1024
// kiln-waits-for-inputs
#include "common.cuh"

#ifndef BLOCK_SIZE
#error "reduce.cu needs -DBLOCK_SIZE=<threads per block> (a multiple of 32, at most 1024)"
#endif

// Launch with grid (rows, 1, 1) and block (BLOCK_SIZE, 1, 1).
extern "C" __global__ void __launch_bounds__(BLOCK_SIZE) row_sum_f32(float* out, const float* x, u32 cols) {
    wait_for_inputs();
    const float* row = x + (u64)blockIdx.x * cols;
    float partial = 0.0f;
    for (u32 col = threadIdx.x; col < cols; col += BLOCK_SIZE) {
        partial += row[col];
    }
    const float total = block_sum<BLOCK_SIZE>(partial);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = total;
    }
}
