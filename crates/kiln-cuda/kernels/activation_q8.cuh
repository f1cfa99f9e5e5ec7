// The int8 activations the quantized mat-vec kernels read (host side:
// matvec::QuantizedActivations): chunks of CHUNK_VALUES values, each with its scale.
#pragma once
#include "common.cuh"

#define CHUNK_VALUES 16

// 16 consecutive f32 values at `p` (16-byte aligned), by plain loads: the callers quantize
// values their own block has just written, which the read-only path may not see.
__device__ __forceinline__ void load_written_chunk(const float* p, float (&v)[CHUNK_VALUES]) {
    const float4* src = reinterpret_cast<const float4*>(p);
#pragma unroll
    for (int i = 0; i < CHUNK_VALUES / 4; ++i) {
        const float4 f = src[i];
        v[4 * i] = f.x;
        v[4 * i + 1] = f.y;
        v[4 * i + 2] = f.z;
        v[4 * i + 3] = f.w;
    }
}

// Stores 16 activations as chunk `index` (= token * tiles * 32 + chunk of the token's row) of
// the int8 layout the mat-vec kernels read: codes xq[16 index ..] = round-half-even(v * 127 /
// max|v|) and xds[index] = (d, d * sum of codes) with d = max|v| / 127. A kernel producing
// activations (a norm, the attention) can call this to skip a separate quantization launch; the host
// side of the buffers is matvec::QuantizedActivations.
__device__ __forceinline__ void quantize_chunk(const float (&v)[CHUNK_VALUES], i8* xq, float2* xds, u64 index) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < CHUNK_VALUES; ++i) {
        amax = fmaxf(amax, fabsf(v[i]));
    }
    const float d = amax / 127.0f;
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    u32 words[4] = {0, 0, 0, 0};
    int sum = 0;
#pragma unroll
    for (int i = 0; i < CHUNK_VALUES; ++i) {
        const int q = __float2int_rn(v[i] * inverse);
        sum += q;
        words[i / 4] |= ((u32)q & 0xffu) << (8 * (i % 4));
    }
    reinterpret_cast<uint4*>(xq)[index] = make_uint4(words[0], words[1], words[2], words[3]);
    xds[index] = make_float2(d, d * (float)sum);
}
