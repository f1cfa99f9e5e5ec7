// Pieces both mat-mat kernel bodies (mma_tile.cuh, mma_pipe.cuh) share: PTX wrappers for
// ldmatrix / mma.sync / cp.async, and each weight format's chunks decoded to f16.
#pragma once
#include "quant.cuh"

// ---- PTX wrappers ----

__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 address;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(p));
    return address;
}

// Two f32 -> one f16x2 word (lo in the low half), round to nearest even.
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

__device__ __forceinline__ void mma_f16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- Weight chunks as f16: a fetch (global loads only) and a decode, so the loads of the next
// step can be issued before the MMAs of the current one ----

template <class W>
struct HalfChunks;

template <class F>
struct HalfChunks<QuantRows<F>> {
    typedef typename F::Raw Raw;
    static __device__ __forceinline__ Raw fetch(const QuantRows<F>& w, u32 row, u32 chunk) {
        return F::fetch(w.p, (u64)row * w.p.tiles + (chunk >> 5), chunk & 31);
    }
    static __device__ __forceinline__ void decode(const Raw& raw, u32 chunk, u32 (&h)[8]) {
        const Chunk c = F::decode(raw, chunk & 31);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const u32 word = (u32)c.q[i / 2];
            const float lo = (float)(int)(i8)(u8)(word >> (16 * (i % 2)));
            const float hi = (float)(int)(i8)(u8)(word >> (16 * (i % 2) + 8));
            h[i] = pack_f16x2(fmaf(c.scale, lo, c.offset), fmaf(c.scale, hi, c.offset));
        }
    }
};

template <int KIND>
struct HalfChunks<FloatRows<KIND>> {
    static constexpr int WORDS = KIND == 0 ? 4 : 2;  // uint4 loads per 16-value chunk
    struct Raw {
        uint4 v[WORDS];
    };
    static __device__ __forceinline__ Raw fetch(const FloatRows<KIND>& w, u32 row, u32 chunk) {
        Raw raw;
#pragma unroll
        for (int i = 0; i < WORDS; ++i) {
            raw.v[i] = ld_weight_u128(w.at(row, chunk * CHUNK_VALUES + i * (CHUNK_VALUES / WORDS)));
        }
        return raw;
    }
    static __device__ __forceinline__ void decode(const Raw& raw, u32, u32 (&h)[8]) {
#pragma unroll
        for (int i = 0; i < WORDS; ++i) {
            const uint4 v = raw.v[i];
            if (KIND == 0) {
                h[2 * i] = pack_f16x2(__uint_as_float(v.x), __uint_as_float(v.y));
                h[2 * i + 1] = pack_f16x2(__uint_as_float(v.z), __uint_as_float(v.w));
            } else if (KIND == 1) {
                h[4 * i] = v.x;
                h[4 * i + 1] = v.y;
                h[4 * i + 2] = v.z;
                h[4 * i + 3] = v.w;
            } else {
                const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    h[4 * i + j] = pack_f16x2(__uint_as_float(words[j] << 16), __uint_as_float(words[j] & 0xffff0000u));
                }
            }
        }
    }
};

__device__ __forceinline__ float silu_mma(float g) {
    return g / (1.0f + expf(-g));
}

// 16-byte asynchronous global -> shared copy (L2 only); `bytes` < 16 zero-fills the rest, so
// 0 gives a zero segment without reading memory.
__device__ __forceinline__ void cp_async_16(u32 shared, const void* global, u32 bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared), "l"(global), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}
