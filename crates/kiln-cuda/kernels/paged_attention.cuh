// Device helpers of paged_attention.cu: typed vector access to cache rows, cp.async copies
// into shared memory, and the f16 tensor-core primitives. Needs HEAD_DIM defined.
#pragma once
#include "common.cuh"
#include "kv.cuh"
#include "plan.cuh"

#define NEG_INF __int_as_float(0xff800000)
#define LOG2E 1.4426950408889634f

// ---- Typed vector access to cache rows ----

__host__ __device__ constexpr int elem_bytes(int type) {
    return type == KV_F32 ? 4 : type == KV_F16 ? 2 : 1;
}

// Widest vector of values (at most 16 bytes, dividing HEAD_DIM) with at most `max_values`.
__host__ __device__ constexpr int pick_vec(int type, int max_values) {
    int v = 16 / elem_bytes(type);
    while (v > 1 && (HEAD_DIM % v != 0 || v > max_values)) {
        v /= 2;
    }
    return v;
}

__host__ __device__ constexpr int floor_pow2(int x) {
    int p = 1;
    while (p * 2 <= x) {
        p *= 2;
    }
    return p;
}

__host__ __device__ constexpr int cmin(int a, int b) {
    return a < b ? a : b;
}

__host__ __device__ constexpr int cmax(int a, int b) {
    return a > b ? a : b;
}

template <int TYPE, int N>
struct KvVec {
    static constexpr int WORDS = (N * elem_bytes(TYPE) + 3) / 4;
    u32 w[WORDS];
};

// N values of a cache from element index `at` (aligned to N values) as raw words.
template <int TYPE, int N>
__device__ __forceinline__ KvVec<TYPE, N> kv_fetch(const u8* cache, u64 at) {
    constexpr int BYTES = N * elem_bytes(TYPE);
    const u8* p = cache + at * elem_bytes(TYPE);
    KvVec<TYPE, N> v;
    if (BYTES == 16) {
        const uint4 x = *reinterpret_cast<const uint4*>(p);
        v.w[0] = x.x;
        v.w[1] = x.y;
        v.w[2] = x.z;
        v.w[3] = x.w;
    } else if (BYTES == 8) {
        const uint2 x = *reinterpret_cast<const uint2*>(p);
        v.w[0] = x.x;
        v.w[1] = x.y;
    } else if (BYTES == 4) {
        v.w[0] = *reinterpret_cast<const u32*>(p);
    } else if (BYTES == 2) {
        v.w[0] = *reinterpret_cast<const u16*>(p);
    } else {
        v.w[0] = *p;
    }
    return v;
}

template <int TYPE, int N>
__device__ __forceinline__ KvVec<TYPE, N> kv_zero() {
    KvVec<TYPE, N> v;
#pragma unroll
    for (int i = 0; i < KvVec<TYPE, N>::WORDS; ++i) {
        v.w[i] = 0;
    }
    return v;
}

// Value i of a fetched vector; q8_0 values come without their scale (see kv_scale).
template <int TYPE, int N>
__device__ __forceinline__ float kv_value(const KvVec<TYPE, N>& v, int i) {
    if (TYPE == KV_F32) {
        return __uint_as_float(v.w[i]);
    } else if (TYPE == KV_F16) {
        return f16_bits_to_f32((u16)(v.w[i / 2] >> (16 * (i % 2))));
    } else {
        return (float)(((i32)(v.w[i / 4] << (24 - 8 * (i % 4)))) >> 24);
    }
}

// The q8_0 scale of value `col` of row `row` (1 for the float types).
template <int TYPE>
__device__ __forceinline__ float kv_scale(const u8* cache, u64 rows, u32 width, u64 row, u32 col) {
    if (TYPE == KV_Q8_0) {
        const u16* scales = reinterpret_cast<const u16*>(cache + kv_q8_scales_at(rows, width));
        return f16_bits_to_f32(scales[row * (width / 32) + col / 32]);
    }
    return 1.0f;
}

__device__ __forceinline__ u32 step_token_seq(const u32* step, u32 token) {
    return step[step[STEP_TOKEN_SEQ_AT] + token];
}

__device__ __forceinline__ u32 step_pos(const u32* step, u32 token) {
    return step[step[STEP_POS_AT] + token];
}

// ---- Asynchronous copies into shared memory ----

// Widest copy unit (at most 16 bytes) dividing `bytes`.
__host__ __device__ constexpr int copy_unit(int bytes) {
    return bytes % 16 == 0 ? 16 : bytes % 8 == 0 ? 8 : bytes % 4 == 0 ? 4 : bytes % 2 == 0 ? 2 : 1;
}

__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 address;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(p));
    return address;
}

// 16 bytes from global `src` to shared-space address `dst`, zeros when !live (the source is then
// not read).
__device__ __forceinline__ void copy_async16(u32 dst, const u8* src, bool live) {
    u64 global;
    asm("cvta.to.global.u64 %0, %1;" : "=l"(global) : "l"(src));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(global), "r"(live ? 16u : 0u) : "memory");
}

// BYTES from global `src` to shared `dst`, zeros when !live (the source is then not read).
// Units under 4 bytes (odd row sizes only) are copied synchronously.
template <int BYTES>
__device__ __forceinline__ void copy_async(void* dst, const u8* src, bool live) {
    if constexpr (BYTES == 16) {
        copy_async16(shared_address(dst), src, live);
    } else if constexpr (BYTES >= 4) {
        u64 global;
        asm("cvta.to.global.u64 %0, %1;" : "=l"(global) : "l"(src));
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(shared_address(dst)), "l"(global), "n"(BYTES), "r"(live ? BYTES : 0) : "memory");
    } else if constexpr (BYTES == 2) {
        *reinterpret_cast<u16*>(dst) = live ? *reinterpret_cast<const u16*>(src) : (u16)0;
    } else {
        *reinterpret_cast<u8*>(dst) = live ? *src : (u8)0;
    }
}

__device__ __forceinline__ void copy_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// Waits until at most PENDING of this thread's committed copy groups are still in flight.
template <int PENDING>
__device__ __forceinline__ void copy_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

// ---- Tensor cores ----

__device__ __forceinline__ void mma_f16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4(u32* r, const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p)));
}

// f16 pair nearest (lo, hi), and the pair of what that rounding left over: hi + lo carries
// about 22 significant bits of each value.
__device__ __forceinline__ void split_f16x2(float lo, float hi, u32& top, u32& rest) {
    top = pack_f16x2(lo, hi);
    rest = pack_f16x2(lo - f16_bits_to_f32((u16)top), hi - f16_bits_to_f32((u16)(top >> 16)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p)));
}

// out * 1/sum of a softmax whose max is m (log2 units), with the sink logit (log2 units,
// `has_sink`) joining the row: its max and its sum, without a value.
__device__ __forceinline__ float softmax_norm(float m, float sum, float sink, bool has_sink) {
    if (!has_sink) {
        return 1.0f / sum;
    }
    const float top = fmaxf(m, sink);
    const float keep = exp2f(m - top);
    return keep / (sum * keep + exp2f(sink - top));
}
