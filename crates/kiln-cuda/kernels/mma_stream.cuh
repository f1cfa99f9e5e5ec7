// The mat-mat body of the streaming tiles (MMA_PIPE=2), for decode batches and short prompts
// (up to 64 tokens). Each warp reads its weight chunks from global memory straight into
// registers and decodes them into the A operands of its MMAs: no shared-memory weight tile, no
// decode-store-load round trip and no barrier on the weight side; the loads of the next step
// are issued as soon as this step's chunks are decoded.
//
// The trick is that a dot product does not care about the order of its terms. Thread (g, t)
// of a warp (g = lane / 4, t = lane % 4) holds k slots 2t, 2t+1, 2t+8, 2t+9 of rows g and g+8
// in an m16n8k16 A operand and the same slots of token g in the B operand. Here those four
// slots of product kk (0..3) are values 4kk..4kk+3 of a 16-value chunk of the weight row that
// the thread decodes itself (the quant.cuh decoders), and it reads the same 16 activation
// values (32 contiguous bytes) from shared memory for its B operands. A thread takes two
// neighbouring chunks at a time (ChunkPair), so each load instruction carries 64 bytes of
// every row it touches (a warp's load always spans 8 rows, one per thread group).
//
// Warps: MMA_BM / 32 along the slots (32 slots each: m16 tiles of rows g, g+8, g+16, g+24),
// MMA_WN along the tokens, the rest split each step's depth (their sums meet in shared memory
// at the end). Activations are f16 (mma_half_activations) in an MMA_XS-stage cp.async ring,
// one barrier per step; with the SwiGLU pair each m16 tile holds 8 gate rows then the same 8
// up rows, as in the other bodies, so mma_store serves all three.
//
// What bounds it (H200, Q4_K 14336x4096, kernel alone, with the exact decode): instructions. A
// step of 128 values per thread is about 1,050 instructions per warp, 5.5 per weight value,
// nearly all the decode (code to f32, scale and offset in f32, round to f16); at four per clock
// per multiprocessor that caps it near 2.3 TB/s, and it reaches 0.8-1.0. With the decode
// stubbed out the same loads stream at 1.3-1.7 TB/s; staging the raw weights through a
// per-thread cp.async ring in shared memory (no registers held in flight, 2-3 steps ahead) was
// no faster. Hence the cheaper f16 decodes of Q4_K and Q6_K below.
#pragma once
#include "chunk_pair.cuh"
#include "mma.cuh"

#if !defined(MMA_BK) || !defined(MMA_XS)
#error "streaming matmat_mma kernels need -DMMA_BK=<depth per step> -DMMA_XS=<activation stages>"
#endif

// Pair u of a row as f16: a fetch (global loads only) and a decode of either chunk.
template <class W>
struct HalfPairs;

// The fetch of pair `pair` (chunks 2 pair, 2 pair + 1) of a row of quantized weights.
template <class F>
struct QuantPairFetch {
    typedef typename ChunkPair<F>::Raw Raw;
    static __device__ __forceinline__ Raw fetch(const QuantRows<F>& w, u32 row, u32 pair) {
        const u32 chunk = 2 * pair;
        return ChunkPair<F>::fetch(w.p, (u64)row * w.p.tiles + (chunk >> 5), chunk & 31);
    }
};

template <class F>
struct HalfPairs<QuantRows<F>> : QuantPairFetch<F> {
    typedef typename QuantPairFetch<F>::Raw Raw;
    static __device__ __forceinline__ void decode(const Raw& raw, u32 pair, int i, u32 (&h)[8]) {
        HalfChunks<QuantRows<F>>::decode(ChunkPair<F>::half(raw, i), 2 * pair + i, h);
    }
};

// Q4_K and Q6_K in f16 arithmetic, for the streaming modules of those formats only (MMA_TYPE
// 12, 14), whose activations mma_half_activations stores permuted (MMA_X_PERMUTED): the exact
// decode above costs about 3.5 instructions per value (code to f32, scale and offset in f32,
// round), these about 2 and 2.5. A pair of codes becomes f16 1024 + q by mask-and-or, the bias
// is subtracted exactly, and one f16 fma (or multiply) applies the scale and offset rounded to
// f16: each value is round16(round16(s) q + round16(o)) rather than round16(s q + o). The
// pairs come out as values (4k, 4k+2) and (4k+1, 4k+3), the order the permuted activations
// arrive in.
#if MMA_TYPE == 12 || MMA_TYPE == 14
#define MMA_X_PERMUTED 1
__device__ __forceinline__ u32 f16x2_mul(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ u32 f16x2_sub(u32 a, u32 b) {
    u32 r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

__device__ __forceinline__ u32 f16x2_fma(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

template <>
struct HalfPairs<QuantRows<FmtQ4_K>> : QuantPairFetch<FmtQ4_K> {
    static __device__ __forceinline__ void decode(const Raw& raw, u32 pair, int i, u32 (&h)[8]) {
        // Both chunks of a pair lie in one 32-value sub-block.
        float scale, offset;
        k4_scale_min(raw.head, ((2 * pair) & 15) >> 1, scale, offset);
        const u32 s2 = pack_f16x2(scale, scale), o2 = pack_f16x2(offset, offset);
        constexpr u32 BIAS = 0x64006400u;  // f16 1024 in both halves
        const uint2 codes = half_of(raw.codes, i);
        const u32 words[2] = {codes.x, codes.y};
#pragma unroll
        for (int w = 0; w < 2; ++w) {
            // Byte b of a word holds value 8w + b (low nibble) and 8w + 4 + b (high nibble).
            const u32 shifts[4] = {0, 8, 4, 12};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const u32 biased = ((words[w] >> shifts[k]) & 0x000f000fu) | BIAS;
                h[4 * w + k] = f16x2_fma(f16x2_sub(biased, BIAS), s2, o2);
            }
        }
    }
};

// Q6_K: the low nibbles as Q4_K's, the top two bits of value 4k + b at bits 2k..2k+1 of byte b
// of the extra word; value = round16(round16(d sc) (q - 32)).
template <>
struct HalfPairs<QuantRows<FmtQ6_K>> : QuantPairFetch<FmtQ6_K> {
    static __device__ __forceinline__ void decode(const Raw& raw, u32, int i, u32 (&h)[8]) {
        const FmtQ6_K::Raw c = ChunkPair<FmtQ6_K>::half(raw, i);
        const float scale = f16_low(c.d) * (float)(int)(i8)(u8)c.sc;
        const u32 s2 = pack_f16x2(scale, scale);
        constexpr u32 BIAS = 0x64006400u, BIAS_32 = 0x64206420u;  // f16 1024, 1056
        const u32 words[2] = {c.codes.x, c.codes.y};
#pragma unroll
        for (int w = 0; w < 2; ++w) {
            const u32 nibble_shifts[4] = {0, 8, 4, 12};
            // The same values' top bits: value 8w + b + 4j (j = 0, 1) sits at bits 2 (2w + j)
            // of byte b.
            const u32 high_shifts[4] = {0, 8, 2, 10};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const u32 top = ((c.high >> (high_shifts[k] + 4 * w)) & 0x00030003u) << 4;
                const u32 biased = ((words[w] >> nibble_shifts[k]) & 0x000f000fu) | top | BIAS;
                h[4 * w + k] = f16x2_mul(f16x2_sub(biased, BIAS_32), s2);
            }
        }
    }
};
#endif
#ifndef MMA_X_PERMUTED
#define MMA_X_PERMUTED 0
#endif

template <int KIND>
struct HalfPairs<FloatRows<KIND>> {
    typedef HalfChunks<FloatRows<KIND>> H;
    struct Raw {
        typename H::Raw c[2];
    };
    // A row of an odd number of chunks re-reads its last one (the kernel zeroes it).
    static __device__ __forceinline__ Raw fetch(const FloatRows<KIND>& w, u32 row, u32 pair) {
        return {{H::fetch(w, row, 2 * pair), H::fetch(w, row, min(2 * pair + 1, w.chunks_per_row() - 1))}};
    }
    static __device__ __forceinline__ void decode(const Raw& raw, u32 pair, int i, u32 (&h)[8]) { H::decode(raw.c[i], 2 * pair + i, h); }
};

// Chunk pairs of a row per step, pairs per weight row per thread per step, 16-byte activation
// segments per token per step.
#define MMA_PPR (MMA_BK / 32)
#define MMA_PPT (MMA_TK / 128)
#define MMA_SPR (MMA_BK / 8)
// Dynamic shared memory (the host's MmaTile::shared_bytes computes the same).
#define MMA_X_BYTES (MMA_XS * MMA_BN * MMA_LDS * 2)

static_assert(MMA_BM % 32 == 0 && MMA_BM <= 32 * MMA_WARPS, "MMA_BM must be 32..256 in steps of 32");
static_assert(MMA_WM * MMA_WN * MMA_WK == MMA_WARPS, "warps must tile slots x tokens x depth");
static_assert(MMA_TN % 8 == 0 && MMA_TK % 128 == 0 && MMA_PPT >= 1, "warp tiles are whole n8 tiles and 128-value depth slices");
static_assert(MMA_XS == 2 || MMA_XS == 3, "two or three activation stages");

// Where 16-byte activation segment `seg` of a token's step sits in shared memory: bit 3 of the
// segment flips bit 1, so that the four threads of a row group (segments 4t.., t = 0..3) read
// four distinct bank groups at once; the token stride (MMA_LDS, one segment past a multiple
// of 8) separates the two tokens of each quarter warp.
__device__ __forceinline__ u32 x_segment(u32 seg) {
    return seg ^ (((seg >> 3) & 1) << 1);
}

template <class W, int NW>
__device__ __forceinline__ void matmat_body(const W& first, const W& second, const u16* __restrict__ xh, u32 ld, u32 n, const MmaOut& o) {
    typedef HalfPairs<W> H;
    extern __shared__ __align__(16) u8 smem[];

    const u32 tid = threadIdx.x;
    const u32 lane = tid & 31;
    const u32 warp = tid >> 5;
    const u32 group = lane >> 2;
    const u32 quad = lane & 3;
    const u32 token_base = blockIdx.x * MMA_BN;
    const u32 rows = o.rows;
    const u32 row_base = o.row_block * (MMA_BM / NW);
    const u32 chunks = first.chunks_per_row();
    const u32 pairs = (chunks + 1) / 2;
    const u32 all_steps = (pairs + MMA_PPR - 1) / MMA_PPR;
    const u32 per_split = (all_steps + gridDim.z - 1) / gridDim.z;
    const u32 begin = blockIdx.z * per_split;
    const u32 end = min(begin + per_split, all_steps);

    const u32 wk = warp % MMA_WK;
    const u32 wn = (warp / MMA_WK) % MMA_WN;
    const u32 wm = warp / (MMA_WK * MMA_WN);

    // The rows of slots wm * 32 + 8 r + group: m16 tile r / 2, its upper half for odd r (the up
    // rows of the SwiGLU pair). Rows past the end re-read the last row (never written).
    u32 row[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        row[r] = min(NW == 1 ? row_base + wm * 32 + 8 * r + group : row_base + wm * 16 + 8 * (r >> 1) + group, rows - 1);
    }
    // This thread's pairs of a step: pair0 + 4 p (p < MMA_PPT) of the step's first pair.
    const u32 pair0 = wk * (MMA_TK / 32) + quad;

    typename H::Raw raw[4][MMA_PPT];
    auto fetch = [&](u32 step, int p) {
        const u32 pair = min(step * MMA_PPR + pair0 + 4 * p, pairs - 1);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            raw[r][p] = H::fetch(NW == 2 && (r & 1) ? second : first, row[r], pair);
        }
    };

    // Activation ring: segment e of a stage is token e / MMA_SPR, values 8 (e % MMA_SPR)..
    // (stored at x_segment); segments past n tokens or the row's ld values are zero-filled.
    const u32 xs_base = shared_address(smem);
    auto issue_x = [&](u32 step, u32 stage) {
        constexpr u32 SEGMENTS = MMA_BN * MMA_SPR;
#pragma unroll
        for (u32 first_e = 0; first_e < SEGMENTS; first_e += MMA_THREADS) {
            const u32 e = first_e + tid;
            if (SEGMENTS % MMA_THREADS == 0 || e < SEGMENTS) {
                const u32 t = e / MMA_SPR;
                const u32 seg = e % MMA_SPR;
                const u32 column = step * MMA_BK + seg * 8;
                const bool inside = token_base + t < n && column < ld;
                const u16* src = inside ? xh + (u64)(token_base + t) * ld + column : xh;
                cp_async_16(xs_base + ((stage * MMA_BN + t) * MMA_LDS + x_segment(seg) * 8) * 2, src, inside ? 16 : 0);
            }
        }
    };
    // This thread's B values: token wn * MMA_TN + 8 j + group, the 16 values of each of its chunks.
    const u8* x_thread = smem + (wn * MMA_TN + group) * MMA_LDS * 2;

    float acc[2][MMA_TN / 8][4];
    mma_zero<MMA_TN>(acc);

    // The first step's weights are fetched before the inputs are known to be written.
    if (begin < end) {
#pragma unroll
        for (int p = 0; p < MMA_PPT; ++p) {
            fetch(begin, p);
        }
    }
    wait_for_inputs();
    if (begin < end) {
        ring_fill<MMA_XS>(issue_x, begin, end);
        cp_async_wait<MMA_XS - 2>();
        __syncthreads();
        for (u32 step = begin; step < end; ++step) {
            const u32 local = step - begin;
            const bool more = step + 1 < end;
            ring_refill<MMA_XS>(issue_x, step, local, end);
            const u8* x_stage = x_thread + (local % MMA_XS) * (MMA_BN * MMA_LDS * 2);
#pragma unroll
            for (int p = 0; p < MMA_PPT; ++p) {
                const u32 pair = step * MMA_PPR + pair0 + 4 * p;
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const u32 chunk = 2 * pair + i;
                    u32 h[4][8];
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        H::decode(raw[r][p], min(pair, pairs - 1), i, h[r]);
                        if (chunk >= chunks) {
#pragma unroll
                            for (int k = 0; k < 8; ++k) {
                                h[r][k] = 0;
                            }
                        }
                    }
                    // Both chunks decoded: the registers are free for the next step's loads.
                    if (i == 1 && more) {
                        fetch(step + 1, p);
                    }
                    const u32 seg = 2 * (2 * (pair0 + 4 * p) + i);
#pragma unroll
                    for (int j = 0; j < MMA_TN / 8; ++j) {
                        const uint4* xv = reinterpret_cast<const uint4*>(x_stage + (8 * j * MMA_LDS + x_segment(seg) * 8) * 2);
                        const uint4 lo = xv[0], hi = xv[1];
                        const u32 b[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
                        for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
                            for (int m = 0; m < 2; ++m) {
                                const u32 a[4] = {h[2 * m][2 * kk], h[2 * m + 1][2 * kk], h[2 * m][2 * kk + 1], h[2 * m + 1][2 * kk + 1]};
                                mma_f16(acc[m][j], a, b[2 * kk], b[2 * kk + 1]);
                            }
                        }
                    }
                }
            }
            cp_async_wait<MMA_XS - 2>();
            __syncthreads();
        }
    }
    cp_async_wait<0>();
    mma_finish<NW, MMA_WM, MMA_WN, MMA_WK, MMA_TN>(acc, smem, o.out, o.partials, n, rows, row_base, token_base, wm, wn, wk, lane, o.accumulate);
}
