// Layout of one K or V cache buffer of `rows` rows of `width` values (kiln_core::KvType):
//   KV_F32:  float[rows][width]
//   KV_F16:  IEEE half bits, u16[rows][width]
//   KV_Q8_0: int8 qs[rows][width], then from byte kv_q8_scales_at(rows, width) the f16 scales
//            u16[rows][width / 32]: value = d * q for q8_0 blocks of 32 along a row (ggml's
//            quantization: d = amax / 127, q = round-half-away(x / d)).
// Kernels that read or write a cache are compiled per type with -DK_TYPE=.. -DV_TYPE=.. .
// Must match src/kv.rs.
#pragma once
#include "common.cuh"

#define KV_F32 0
#define KV_F16 1
#define KV_Q8_0 2

__device__ __forceinline__ u64 kv_q8_scales_at(u64 rows, u32 width) {
    return (rows * width + 15) / 16 * 16;
}

// Value `col` of cache row `row`.
template <int TYPE>
__device__ __forceinline__ float kv_load(const u8* cache, u64 rows, u32 width, u64 row, u32 col) {
    if (TYPE == KV_F32) {
        return reinterpret_cast<const float*>(cache)[row * width + col];
    } else if (TYPE == KV_F16) {
        return f16_bits_to_f32(reinterpret_cast<const u16*>(cache)[row * width + col]);
    } else {
        const u16* scales = reinterpret_cast<const u16*>(cache + kv_q8_scales_at(rows, width));
        const float d = f16_bits_to_f32(scales[row * (width / 32) + col / 32]);
        return d * (float)reinterpret_cast<const i8*>(cache)[row * width + col];
    }
}

// Stores value `col` of row `row` for the f32 and f16 types.
template <int TYPE>
__device__ __forceinline__ void kv_store_float(u8* cache, u32 width, u64 row, u32 col, float value) {
    if (TYPE == KV_F32) {
        reinterpret_cast<float*>(cache)[row * width + col] = value;
    } else {
        reinterpret_cast<u16*>(cache)[row * width + col] = f32_to_f16_bits(value);
    }
}

// Quantizes one q8_0 block of 32 values (`block` of row `row`): lane i of a 32-lane group
// passes value i; the group's lanes must be consecutive lanes of one warp, aligned to 32.
__device__ __forceinline__ void kv_store_q8_block(u8* cache, u64 rows, u32 width, u64 row, u32 block, u32 lane, float value) {
    float amax = fabsf(value);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    reinterpret_cast<i8*>(cache)[row * width + block * 32 + lane] = (i8)roundf(value * id);
    if (lane == 0) {
        reinterpret_cast<u16*>(cache + kv_q8_scales_at(rows, width))[row * (width / 32) + block] = f32_to_f16_bits(d);
    }
}
