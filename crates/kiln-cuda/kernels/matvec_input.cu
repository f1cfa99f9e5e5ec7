// Activations for the quantized mat-vec kernels: x [n][cols] f32 (cols a multiple of 16) to
// the layout of quantize_chunk (quant.cuh). Values past `cols` (the padding up to whole tiles)
// are zero, so the mat-vec kernels need no bounds checks. Grid-stride over (token, chunk).
#include "quant.cuh"

extern "C" __global__ void quantize_activations_q8(const float* __restrict__ x, u32 cols, u32 n, u32 tiles,
                                                   i8* __restrict__ xq, float2* __restrict__ xds) {
    const u64 chunks_per_token = (u64)tiles * 32;
    for (u64 index = global_thread_index(); index < n * chunks_per_token; index += global_thread_count()) {
        const u64 token = index / chunks_per_token;
        const u32 first = (u32)(index % chunks_per_token) * CHUNK_VALUES;
        float v[CHUNK_VALUES];
        const float4* src = reinterpret_cast<const float4*>(x + token * cols + first);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float4 f = first < cols ? __ldg(src + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            v[4 * i] = f.x;
            v[4 * i + 1] = f.y;
            v[4 * i + 2] = f.z;
            v[4 * i + 3] = f.w;
        }
        quantize_chunk(v, xq, xds, index);
    }
}
