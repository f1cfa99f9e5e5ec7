// Pieces the mat-mat kernel bodies (mma_tile.cuh, mma_pipe.cuh, mma_stream.cuh) share: PTX wrappers for
// ldmatrix / mma.sync / cp.async, and each weight format's chunks decoded to f16.
#pragma once
#include "quant.cuh"

// ---- A block's warps, shared by the bodies (each defines MMA_BK, its depth per step) ----
#define MMA_WARPS (MMA_THREADS / 32)
// Warps along the slots (32 each) and along the depth.
#define MMA_WM (MMA_BM / 32)
#define MMA_WK (MMA_WARPS / (MMA_WM * MMA_WN))
// Per warp: tokens and depth.
#define MMA_TN (MMA_BN / MMA_WN)
#define MMA_TK (MMA_BK / MMA_WK)
// Shared rows padded by 16 bytes: the 8 row addresses of an ldmatrix (or the two tokens of a
// quarter warp in mma_stream.cuh) hit distinct bank groups.
#define MMA_LDS (MMA_BK + 8)

// ---- PTX wrappers ----

__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 address;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(p));
    return address;
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

// Signed byte `i` (0..3) of a code word, given as `biased` = word ^ 0x80808080, as an exact f32:
// the unsigned byte becomes the low mantissa bits of 2^23 (one byte permute) and a subtraction
// removes 2^23 + 128, instead of an integer-to-float conversion at a quarter of the FMA rate
// (measured on the H200: Q4_K mat-mat 3-5% faster at 64 and 512 tokens).
__device__ __forceinline__ float code_to_float(u32 biased, int i) {
    return __uint_as_float(prmt(biased, 0x4b000000u, 0x7440u | (u32)i)) - 8388736.0f;
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
        for (int w = 0; w < 4; ++w) {
            const u32 biased = (u32)c.q[w] ^ 0x80808080u;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float lo = code_to_float(biased, 2 * half), hi = code_to_float(biased, 2 * half + 1);
                h[2 * w + half] = pack_f16x2(fmaf(c.scale, lo, c.offset), fmaf(c.scale, hi, c.offset));
            }
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

// The activation ring of the pipelined and streaming bodies: stage s % XS holds the
// activations of step begin + s. One group is committed per step (empty past the end), so
// waiting for all but XS - 2 groups means "the next step is in".
template <int XS, class Issue>
__device__ __forceinline__ void ring_fill(const Issue& issue, u32 begin, u32 end) {
#pragma unroll
    for (int s = 0; s < XS - 1; ++s) {
        if (begin + s < end) {
            issue(begin + s, s);
        }
        cp_async_commit();
    }
}

// At step `step` (`local` steps after the split's first): the stage refilled here was last
// read in the previous step, before its barrier.
template <int XS, class Issue>
__device__ __forceinline__ void ring_refill(const Issue& issue, u32 step, u32 local, u32 end) {
    if (step + XS - 1 < end) {
        issue(step + XS - 1, (local + XS - 1) % XS);
    }
    cp_async_commit();
}

template <int TN>
__device__ __forceinline__ void mma_zero(float (&acc)[2][TN / 8][4]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < TN / 8; ++j) {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                acc[i][j][k] = 0.0f;
            }
        }
    }
}

// Depth-split warps (WK > 1) hand their sums to warp wk == 0 of the same output tile, in a
// fixed order (deterministic), lane-major so the shared accesses do not conflict. Returns
// false for the warps that are done. Every thread of the block must call it.
template <int WM, int WN, int WK, int TN>
__device__ __forceinline__ bool mma_merge_depth_splits(float (&acc)[2][TN / 8][4], u8* smem, u32 wm, u32 wn, u32 wk, u32 lane) {
    if (WK > 1) {
        // Depth-split warps hand their sums to warp wk == 0 of the same output tile, in a fixed
        // order (deterministic). Lane-major so the shared accesses do not conflict.
        float* partial = reinterpret_cast<float*>(smem);
        const u32 tile = wm * WN + wn;
        constexpr u32 PER_WARP = 2 * (TN / 8) * 4;
        if (wk > 0) {
            float* dst = partial + ((wk - 1) * WM * WN + tile) * PER_WARP * 32 + lane;
#pragma unroll
            for (int i = 0; i < 2; ++i) {
#pragma unroll
                for (int j = 0; j < TN / 8; ++j) {
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        dst[((i * (TN / 8) + j) * 4 + k) * 32] = acc[i][j][k];
                    }
                }
            }
        }
        __syncthreads();
        if (wk > 0) {
            return false;
        }
        for (u32 other = 0; other + 1 < WK; ++other) {
            const float* src = partial + (other * WM * WN + tile) * PER_WARP * 32 + lane;
#pragma unroll
            for (int i = 0; i < 2; ++i) {
#pragma unroll
                for (int j = 0; j < TN / 8; ++j) {
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        acc[i][j][k] += src[((i * (TN / 8) + j) * 4 + k) * 32];
                    }
                }
            }
        }
    }
    return true;
}

// Writes a warp's accumulators. Accumulator k of tile (i, j) is slot 16 i + lane / 4 (+ 8 for
// k >= 2), token 8 j + 2 (lane % 4) (+ 1 for odd k). out[token][row] = the sum (+= with
// `accumulate`), or silu(gate) * up for NW == 2 (gate/up rows interleaved per 8); with
// `partials`, the raw sums (gate/up pairs) go to partials[split_base + token][row] instead.
template <int NW, int TN>
__device__ __forceinline__ void mma_store(const float (&acc)[2][TN / 8][4], float* out, float* partials, u64 split_base, u32 n, u32 rows,
                                          u32 row_base, u32 token_base, u32 wm, u32 wn, u32 lane, u32 accumulate) {
    const u32 group = lane >> 2;
    const u32 pair = 2 * (lane & 3);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < TN / 8; ++j) {
#pragma unroll
            for (int odd = 0; odd < 2; ++odd) {
                const u32 token = token_base + wn * TN + 8 * j + pair + odd;
                if (token >= n) {
                    continue;
                }
                if (NW == 2) {
                    const u32 row = row_base + (wm * 32 + 16 * i) / 2 + group;
                    if (row < rows) {
                        const float g = acc[i][j][odd], u = acc[i][j][2 + odd];
                        if (partials != nullptr) {
                            reinterpret_cast<float2*>(partials)[(split_base + token) * rows + row] = make_float2(g, u);
                        } else {
                            out[(u64)token * rows + row] = silu_mma(g) * u;
                        }
                    }
                } else {
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const u32 row = row_base + wm * 32 + 16 * i + 8 * half + group;
                        if (row < rows) {
                            const float v = acc[i][j][2 * half + odd];
                            if (partials != nullptr) {
                                partials[(split_base + token) * rows + row] = v;
                            } else {
                                float* slot_out = out + (u64)token * rows + row;
                                *slot_out = accumulate ? *slot_out + v : v;
                            }
                        }
                    }
                }
            }
        }
    }
}

// Where a block of the pipelined and streaming bodies writes: row block `row_block` (its
// MMA_BM / NW rows) of out [n][rows], += with `accumulate`; with split-K over gridDim.z, this
// split's partial sums into partials [split][n][rows] instead.
struct MmaOut {
    float* out;
    float* partials;
    u32 rows;
    u32 row_block;
    u32 accumulate;
};

// The end of the pipelined and streaming bodies: depth-split warps merge, then the output (or,
// with split-K over gridDim.z, this split's partial sums for mma_reduce_splits) is written.
template <int NW, int WM, int WN, int WK, int TN>
__device__ __forceinline__ void mma_finish(float (&acc)[2][TN / 8][4], u8* smem, float* out, float* partials, u32 n, u32 rows, u32 row_base,
                                           u32 token_base, u32 wm, u32 wn, u32 wk, u32 lane, u32 accumulate) {
    if (!mma_merge_depth_splits<WM, WN, WK, TN>(acc, smem, wm, wn, wk, lane)) {
        return;
    }
    mma_store<NW, TN>(acc, out, gridDim.z > 1 ? partials : nullptr, (u64)blockIdx.z * n, n, rows, row_base, token_base, wm, wn, lane, accumulate);
}
