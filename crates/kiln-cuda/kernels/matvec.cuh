// Mat-vec for 1..8 tokens: out[t][r] = sum_c W[r][c] * x[t][c], with out [NTOK][rows] f32.
//
// One warp computes ROWS_PER_WARP rows (of each of NW weights: 2 for the fused SwiGLU) for all
// NTOK tokens, so every activation load serves ROWS_PER_WARP * NW rows. A block is MV_WARPS
// warps in MV_GROUPS groups of MV_SPLIT warps sharing rows; grid = ceil(rows / (MV_GROUPS *
// ROWS_PER_WARP)) (SwiGLU: SWIGLU_ROWS_PER_WARP).
//
// Quantized weights meet activations quantized to int8 per 16 values (matvec_input.cu): a lane
// multiplies its 16-value weight chunk with the matching activation chunk by four dp4a, then
//     sum_i (scale q_i + offset) * xd xq_i = scale * xd * isum + offset * xs,
// with (xd, xs) = (activation scale, xd * sum_i xq_i). Float weights use f32 activations
// (their loops: matvec_float.cu).
#pragma once
#include "chunk_pair.cuh"

#ifndef NTOK
#error "matvec kernels need -DNTOK=<tokens, 1..8>"
#endif
#ifndef ROWS_PER_WARP
#error "matvec kernels need -DROWS_PER_WARP=<1, 2, 4, or 8 or 16 for one token>"
#endif
static_assert(NTOK >= 1 && NTOK <= 8, "NTOK must be 1..8");
// 16 rows a warp is a shape of the grouped (1- and 2-bit) formats only (matvec_shape.rs).
static_assert(ROWS_PER_WARP == 1 || ROWS_PER_WARP == 2 || ROWS_PER_WARP == 4 ||
                  ((ROWS_PER_WARP == 8 || ROWS_PER_WARP == 16) && NTOK == 1),
              "ROWS_PER_WARP must be 1, 2, 4, or 8 or 16 for one token");

// Warps of a block: 4, or 16 for the wide split shapes, whose blocks hold whole 16-row chunks.
#ifndef MV_WARPS
#define MV_WARPS 4
#endif
static_assert(MV_WARPS == 4 || MV_WARPS == 16, "MV_WARPS must be 4 or 16");
#define MV_THREADS (MV_WARPS * 32)
// Warps that share one group of rows, each taking every MV_SPLIT-th step of the row and their
// sums added in finish_rows: more loads in flight per row for long, few rows (the FFN down
// product) without giving up the activation reuse of several rows per warp.
#ifndef MV_SPLIT
#define MV_SPLIT 1
#endif
static_assert(MV_SPLIT == 1 || MV_SPLIT == 2 || MV_SPLIT == 4, "MV_SPLIT must be 1, 2 or 4");
#define MV_GROUPS (MV_WARPS / MV_SPLIT)
// The fused SwiGLU reads two weights, so it needs half the rows per warp for the same reuse.
#define SWIGLU_ROWS_PER_WARP (ROWS_PER_WARP > 1 ? ROWS_PER_WARP / 2 : 1)
// Tiles whose weight loads are issued together before any is decoded (memory-level
// parallelism); the host measures which MV_BATCH suits a product (src/matvec/matvec_shape.rs).
#ifndef MV_BATCH
#define MV_BATCH (ROWS_PER_WARP < 4 ? 4 / ROWS_PER_WARP : 1)
#endif
static_assert(MV_BATCH >= 1 && MV_BATCH <= 8, "MV_BATCH must be 1..8");

constexpr int pow2_at_least(int n) {
    return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2);
}

// One step of warp_sum_many: lanes with bit HALF set keep values [HALF, 2 HALF), the others
// [0, HALF), and each adds the half its partner (lane ^ HALF) kept out.
template <int HALF>
__device__ __forceinline__ void exchange_halves(float* v, bool upper) {
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
        const float keep = upper ? v[i + HALF] : v[i];
        const float send = upper ? v[i] : v[i + HALF];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, HALF);
    }
    if constexpr (HALF > 1) {
        exchange_halves<HALF / 2>(v, ((threadIdx.x & 31) & (HALF / 2)) != 0);
    }
}

// Sums each of V values (V a power of two, at most 32) over the warp; afterwards lane l holds
// the total of value l % V. Each step hands half of the values to the partner lane, so this
// takes V - 1 + 5 - log2(V) shuffles instead of 5 V.
template <int V>
__device__ __forceinline__ float warp_sum_many(float (&v)[V]) {
    static_assert(V >= 1 && V <= 32 && (V & (V - 1)) == 0, "V must be a power of two <= 32");
    if constexpr (V > 1) {
        exchange_halves<V / 2>(v, ((threadIdx.x & 31) & (V / 2)) != 0);
    }
    float total = v[0];
#pragma unroll
    for (int offset = V; offset < 32; offset *= 2) {
        total += __shfl_xor_sync(0xffffffffu, total, offset);
    }
    return total;
}

#include "matvec_next.cuh"

// What finish_rows does beyond scaling each row's dot product: per-row biases (a projection's,
// a mixture of experts'), added before the activation (null: none; both or neither for a pair),
// and a pair's gate activation (GATE_* in common.cuh). The zero value: no bias, SwiGLU.
struct RowEpilogue {
    const float* bias;     // [rows], added to the first weight's (the gate's) dots
    const float* up_bias;  // [rows], added to the up weight's dots
    u32 act;
    float alpha;  // GATE_SWIGLU_OAI's
    float limit;
    u32 pad_;
};

// Reduces acc[w * RPW + r][t] (weight w, row row0 + r, token t) over the warp and writes
// out[t][row]: the value itself (+= it when `accumulate`), or act(gate) * up when NW == 2.
template <int NW, int RPW>
__device__ __forceinline__ void finish_rows(float (&acc)[NW * RPW][NTOK], u32 row0, u32 rows, float* out,
                                            u32 accumulate, const float (&scale)[NTOK], const RowEpilogue& ep = RowEpilogue{}) {
    constexpr int HALF = pow2_at_least(RPW * NTOK);
    constexpr int V = NW * HALF;
    static_assert(V <= 32, "too many values per warp");
    float v[V];
#pragma unroll
    for (int i = 0; i < V; ++i) {
        v[i] = 0.0f;
    }
#pragma unroll
    for (int w = 0; w < NW; ++w) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
#pragma unroll
            for (int t = 0; t < NTOK; ++t) {
                v[w * HALF + r * NTOK + t] = acc[w * RPW + r][t];
            }
        }
    }
    float total = warp_sum_many<V>(v);
    // Without a split every warp writes its rows; with one, the group's first warp does (the
    // others stay to the end, so a barrier after this one still counts the whole block).
    bool writer = true;
    if (MV_SPLIT > 1) {
        // The group's warps add their parts in a fixed order.
        __shared__ float split_sums[MV_WARPS][32];
        const u32 warp = threadIdx.x >> 5;
        const u32 group = warp / MV_SPLIT;
        split_sums[warp][threadIdx.x & 31] = total;
        asm volatile("bar.sync %0, %1;" ::"r"(1 + group), "r"(MV_SPLIT * 32) : "memory");
        writer = warp % MV_SPLIT == 0;
        total = 0.0f;
#pragma unroll
        for (int i = 0; i < MV_SPLIT; ++i) {
            total += split_sums[group * MV_SPLIT + i][threadIdx.x & 31];
        }
    }
    const u32 lane = threadIdx.x & 31;
    // Lane l holds value l % HALF of its weight: row l % HALF / NTOK, token l % HALF % NTOK.
    float token_scale = scale[0];
#pragma unroll
    for (int t = 1; t < NTOK; ++t) {
        token_scale = (lane % HALF) % NTOK == (u32)t ? scale[t] : token_scale;
    }
    total *= token_scale;
    if (ep.bias != nullptr) {
        // Lane l holds value l % V: weight (l % V) / HALF, row (l % HALF) / NTOK.
        const u32 value = lane % V;
        const float* bias = NW == 2 && value >= (u32)HALF ? ep.up_bias : ep.bias;
        total += bias[min(row0 + (value % HALF) / NTOK, rows - 1)];
    }
    // With two weights, lane l < HALF holds the gate value and lane l + HALF the matching up.
    const float up = NW == 2 ? __shfl_xor_sync(0xffffffffu, total, HALF) : 0.0f;
    if (writer && lane < RPW * NTOK) {
        const u32 row = row0 + lane / NTOK;
        const u32 token = lane % NTOK;
        if (row < rows) {
            float* slot = out + (u64)token * rows + row;
            if (NW == 2) {
                *slot = gated(ep.act, total, up, ep.alpha, ep.limit);
            } else {
                *slot = accumulate ? *slot + total : total;
            }
        }
    }
}

// Loads tiles t0 .. t0 + MV_BATCH - 1 of every row; past the last tile a batch re-reads it (in
// bounds, never used), so no load waits on a branch.
template <class F, int NW, int RPW>
__device__ __forceinline__ void fetch_tiles(typename F::Raw (&raw)[MV_BATCH][NW * RPW], const Planes (&w)[NW],
                                            const u32 (&first_tile)[NW * RPW], u32 t0, u32 lane) {
    const u32 tiles = w[0].tiles;
#pragma unroll
    for (int b = 0; b < MV_BATCH; ++b) {
        const u32 tile = min(t0 + b, tiles - 1);
#pragma unroll
        for (int r = 0; r < NW * RPW; ++r) {
            raw[b][r] = F::fetch(w[r / RPW], first_tile[r] + tile, lane);
        }
    }
}

// A warp's rows of a quantized mat-vec: the first global tile of each of its R rows (rows past
// the end re-read the last row, never written; 32 bits, as a weight's chunk indices fit them)
// and their sums per token.
template <int R, int RPW>
struct WarpRows {
    u32 first_tile[R];
    float acc[R][NTOK];
    __device__ __forceinline__ WarpRows(u32 row0, u32 rows, u32 tiles) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            first_tile[r] = min(row0 + r % RPW, rows - 1) * tiles;
#pragma unroll
            for (int t = 0; t < NTOK; ++t) {
                acc[r][t] = 0.0f;
            }
        }
    }
};

// 1.5 * 2^23 as float bits: an int accumulated onto it, |i| < 2^22, reads back as float
// 12582912 + i exactly, so subtracting the float replaces a (quarter-rate) int-to-float.
#define EXACT_INT_BIAS 0x4b400000
#define EXACT_INT_BIAS_F 12582912.0f

// A chunk as the dot products below take it: codebook formats as two lookups for one token (a
// prmt fewer per four values; with more tokens each lookup's dp4a would repeat per token), and
// the mat-vec variants of MatvecDecode formats.
template <class F>
__device__ __forceinline__ Chunk decode_for_dot(const typename F::Raw& r, u32 lane) {
    if constexpr ((SplitsBook<F>::value && NTOK == 1) || MatvecDecode<F>::value) {
        return F::template decode<true>(r, lane);
    } else {
        return F::decode(r, lane);
    }
}

// A chunk's 16 codes dotted with 16 int8 activations, exactly (|sum| < 2^19), as a float; a
// codebook format's two lookups add in one chain.
template <class F>
__device__ __forceinline__ float exact_dot16(const Chunk& c, const uint4& x) {
    const int xs[4] = {(int)x.x, (int)x.y, (int)x.z, (int)x.w};
    int dot = EXACT_INT_BIAS;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        dot = __dp4a(c.q[k], xs[k], dot);
        if constexpr (SplitsBook<F>::value && NTOK == 1) {
            dot = __dp4a(c.q2[k], xs[k], dot);
        }
    }
    return __int_as_float(dot) - EXACT_INT_BIAS_F;
}

// acc plus a chunk's 16 values dotted with the 16 int8 activations x (scale xd, scaled sum xs).
template <class F>
__device__ __forceinline__ float chunk_dot(const Chunk& c, const uint4& x, float xd, float xs, float acc) {
    constexpr float K = ScaledOffset<F>::value;
    if constexpr (K != 0.0f) {
        return fmaf(c.scale, fmaf(xd, exact_dot16<F>(c, x), K * xs), acc);
    } else {
        return fmaf(c.scale * xd, exact_dot16<F>(c, x), !NoOffset<F>::value ? fmaf(c.offset, xs, acc) : acc);
    }
}

// acc plus chunks 2u and 2u + 1 dotted with their activations x0, x1 (ds: xd0, xs0, xd1, xs1).
// Where the pair lies in one scale group, its scale and offset apply once to both sums.
template <class F>
__device__ __forceinline__ float pair_dot(const Chunk (&c)[2], const uint4& x0, const uint4& x1, const float4& ds, float acc) {
    if constexpr (ScalePer32<F>::value) {
        constexpr float K = ScaledOffset<F>::value;
        const float first = K != 0.0f ? fmaf(ds.x, exact_dot16<F>(c[0], x0), K * (ds.y + ds.w)) : ds.x * exact_dot16<F>(c[0], x0);
        acc = fmaf(c[0].scale, fmaf(ds.z, exact_dot16<F>(c[1], x1), first), acc);
        return !NoOffset<F>::value && K == 0.0f ? fmaf(c[0].offset, ds.y + ds.w, acc) : acc;
    } else {
        return chunk_dot<F>(c[1], x1, ds.z, ds.w, chunk_dot<F>(c[0], x0, ds.x, ds.y, acc));
    }
}

// w: NW weights with the same shape; xq: [NTOK][tiles * 512] int8; xds: [NTOK][tiles * 32] (xd, xs).
template <class F, int NW>
__device__ __forceinline__ void matvec_quant(const Planes (&w)[NW], const i8* __restrict__ xq,
                                             const float2* __restrict__ xds, const InputNorm& xn, float* out, u32 rows, u32 accumulate,
                                             u32 block, const RowEpilogue& ep) {
    constexpr int RPW = NW == 2 ? SWIGLU_ROWS_PER_WARP : ROWS_PER_WARP;
    constexpr int R = NW * RPW;
    const u32 lane = threadIdx.x & 31;
    const u32 row0 = (block * MV_GROUPS + (threadIdx.x >> 5) / MV_SPLIT) * RPW;
    const u32 part = (threadIdx.x >> 5) % MV_SPLIT;
    if (row0 >= rows) {
        return;  // the whole group: its barrier in finish_rows counts only its own warps
    }
    const u32 tiles = w[0].tiles;
    WarpRows<R, RPW> rows_of(row0, rows, tiles);
    const u64 x_stride = (u64)tiles * TILE_VALUES;
    const u64 ds_stride = (u64)tiles * 32;
    // The first batch of weights is on its way while the kernel before this one finishes.
    typename F::Raw raw[MV_BATCH][R];
    fetch_tiles<F, NW, RPW>(raw, w, rows_of.first_tile, part * MV_BATCH, lane);
    wait_for_inputs();
    float scale[NTOK];
    input_scales(xn, scale);
    for (u32 t0 = part * MV_BATCH; t0 < tiles; t0 += MV_BATCH * MV_SPLIT) {
        if (t0 > part * MV_BATCH) {
            fetch_tiles<F, NW, RPW>(raw, w, rows_of.first_tile, t0, lane);
        }
#pragma unroll
        for (int b = 0; b < MV_BATCH; ++b) {
            if (t0 + b >= tiles) {
                break;
            }
            Chunk c[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                c[r] = decode_for_dot<F>(raw[b][r], lane);
            }
            const u64 tile = t0 + b;
#pragma unroll
            for (int t = 0; t < NTOK; ++t) {
                const uint4 xv = __ldg(reinterpret_cast<const uint4*>(xq + t * x_stride + tile * TILE_VALUES) + lane);
                const float2 ds = __ldg(xds + t * ds_stride + tile * 32 + lane);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    rows_of.acc[r][t] = chunk_dot<F>(c[r], xv, ds.x, ds.y, rows_of.acc[r][t]);
                }
            }
        }
    }
    finish_rows<NW, RPW>(rows_of.acc, row0, rows, out, accumulate, scale, ep);
}

// Loads the chunk pairs of steps s0 .. s0 + MV_BATCH - 1 of every row: lane l takes pair
// l % 16 of tile 2 s + l / 16. Tiles past the row's end re-read its last tile (never used).
template <class F, int NW, int RPW>
__device__ __forceinline__ void fetch_pairs(typename ChunkPair<F>::Raw (&raw)[MV_BATCH][NW * RPW],
                                            const Planes (&w)[NW], const u32 (&first_tile)[NW * RPW], u32 s0,
                                            u32 lane) {
    const u32 tiles = w[0].tiles;
#pragma unroll
    for (int b = 0; b < MV_BATCH; ++b) {
        const u32 tile = min(2 * (s0 + b) + (lane >> 4), tiles - 1);
#pragma unroll
        for (int r = 0; r < NW * RPW; ++r) {
            raw[b][r] = ChunkPair<F>::fetch(w[r / RPW], first_tile[r] + tile, 2 * (lane & 15));
        }
    }
}

// Mat-vec of the formats with wide chunk pairs (ChunkPair<F>::WIDE) but Q8_0 (see matvec_rows):
// as matvec_quant, but each lane takes two neighbouring chunks per step, so every load carries
// 16 bytes per lane and the pair's shared scale fields are fetched once. A step covers two
// tiles, one per half-warp.
template <class F, int NW>
__device__ __forceinline__ void matvec_paired(const Planes (&w)[NW], const i8* __restrict__ xq,
                                              const float2* __restrict__ xds, const InputNorm& xn, float* out, u32 rows, u32 accumulate,
                                              u32 block, const RowEpilogue& ep) {
    constexpr int RPW = NW == 2 ? SWIGLU_ROWS_PER_WARP : ROWS_PER_WARP;
    constexpr int R = NW * RPW;
    const u32 lane = threadIdx.x & 31;
    const u32 row0 = (block * MV_GROUPS + (threadIdx.x >> 5) / MV_SPLIT) * RPW;
    const u32 part = (threadIdx.x >> 5) % MV_SPLIT;
    if (row0 >= rows) {
        return;  // the whole group: its barrier in finish_rows counts only its own warps
    }
    const u32 tiles = w[0].tiles;
    const u32 steps = (tiles + 1) / 2;
    const u32 pair_chunk = 2 * (lane & 15);
    WarpRows<R, RPW> rows_of(row0, rows, tiles);
    const u64 x_stride = (u64)tiles * TILE_VALUES;
    const u64 ds_stride = (u64)tiles * 32;
    typename ChunkPair<F>::Raw raw[MV_BATCH][R];
    fetch_pairs<F, NW, RPW>(raw, w, rows_of.first_tile, part * MV_BATCH, lane);
    wait_for_inputs();
    float scale[NTOK];
    input_scales(xn, scale);
    for (u32 s0 = part * MV_BATCH; s0 < steps; s0 += MV_BATCH * MV_SPLIT) {
        if (s0 > part * MV_BATCH) {
            fetch_pairs<F, NW, RPW>(raw, w, rows_of.first_tile, s0, lane);
        }
#pragma unroll
        for (int b = 0; b < MV_BATCH; ++b) {
            if (s0 + b >= steps) {
                break;
            }
            const u32 tile = 2 * (s0 + b) + (lane >> 4);
            if (tile >= tiles) {
                continue;
            }
            Chunk c[R][2];
#pragma unroll
            for (int r = 0; r < R; ++r) {
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    c[r][i] = decode_for_dot<F>(ChunkPair<F>::half(raw[b][r], i), pair_chunk + i);
                }
            }
            const u64 chunk = (u64)tile * 32 + pair_chunk;
#pragma unroll
            for (int t = 0; t < NTOK; ++t) {
                const uint4* xv = reinterpret_cast<const uint4*>(xq + t * x_stride + chunk * CHUNK_VALUES);
                const float4 ds = __ldg(reinterpret_cast<const float4*>(xds + t * ds_stride + chunk));
                const uint4 x0 = __ldg(xv), x1 = __ldg(xv + 1);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    rows_of.acc[r][t] = pair_dot<F>(c[r], x0, x1, ds, rows_of.acc[r][t]);
                }
            }
        }
    }
    finish_rows<NW, RPW>(rows_of.acc, row0, rows, out, accumulate, scale, ep);
}

// dp4a of unsigned weight bytes (the masked fields of a code group reach 0xc0) with signed
// activation bytes.
__device__ __forceinline__ int dp4a_us(u32 a, int b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Loads the code groups of steps s0 .. s0 + MV_BATCH - 1 (lane l: group 32 s + l) of every
// row; groups past the row's end re-read its last group (in bounds, never used).
template <class F, int NW, int RPW>
__device__ __forceinline__ void fetch_groups(typename F::Raw (&raw)[MV_BATCH][NW * RPW], const Planes (&w)[NW],
                                             const u32 (&first_tile)[NW * RPW], u32 s0, u32 groups, u32 lane) {
    constexpr u32 CHUNKS = F::Group::CHUNKS;
#pragma unroll
    for (int b = 0; b < MV_BATCH; ++b) {
        const u32 g = min((s0 + b) * 32 + lane, groups - 1);
#pragma unroll
        for (int r = 0; r < NW * RPW; ++r) {
            raw[b][r] = F::fetch(w[r / RPW], first_tile[r] + g * CHUNKS / 32, g * CHUNKS % 32);
        }
    }
}

// Mat-vec of the grouped formats (FmtGrouped): lane l takes the whole 16-byte group 32 s + l
// of step s (CHUNKS chunks under one scale), so a warp's load is 512 contiguous bytes and the
// scale is applied once per group. Chunk k's field, masked in place, is its codes times
// 2^(BITS k); the activation scale absorbs that power of two, and the offset term needs only
// the group's activation sum.
template <class F, int NW>
__device__ __forceinline__ void matvec_grouped(const Planes (&w)[NW], const i8* __restrict__ xq,
                                               const float2* __restrict__ xds, const InputNorm& xn, float* out, u32 rows, u32 accumulate,
                                               u32 block, const RowEpilogue& ep) {
    typedef typename F::Group G;
    constexpr int RPW = NW == 2 ? SWIGLU_ROWS_PER_WARP : ROWS_PER_WARP;
    constexpr int R = NW * RPW;
    constexpr u32 CHUNKS = G::CHUNKS;
    const u32 lane = threadIdx.x & 31;
    const u32 row0 = (block * MV_GROUPS + (threadIdx.x >> 5) / MV_SPLIT) * RPW;
    const u32 part = (threadIdx.x >> 5) % MV_SPLIT;
    if (row0 >= rows) {
        return;  // the whole group: its barrier in finish_rows counts only its own warps
    }
    const u32 tiles = w[0].tiles;
    const u32 groups = tiles * (32 / CHUNKS);
    const u32 steps = (groups + 31) / 32;
    WarpRows<R, RPW> rows_of(row0, rows, tiles);
    const u64 x_stride = (u64)tiles * TILE_VALUES;
    const u64 ds_stride = (u64)tiles * 32;
    typename F::Raw raw[MV_BATCH][R];
    fetch_groups<F, NW, RPW>(raw, w, rows_of.first_tile, part * MV_BATCH, groups, lane);
    wait_for_inputs();
    float scale[NTOK];
    input_scales(xn, scale);
    for (u32 s0 = part * MV_BATCH; s0 < steps; s0 += MV_BATCH * MV_SPLIT) {
        if (s0 > part * MV_BATCH) {
            fetch_groups<F, NW, RPW>(raw, w, rows_of.first_tile, s0, groups, lane);
        }
#pragma unroll
        for (int b = 0; b < MV_BATCH; ++b) {
            const u32 g = (s0 + b) * 32 + lane;
            if (s0 + b >= steps) {
                break;
            }
            if (g >= groups) {
                continue;
            }
#pragma unroll
            for (int t = 0; t < NTOK; ++t) {
                const uint4* xv = reinterpret_cast<const uint4*>(xq + t * x_stride) + (u64)g * CHUNKS;
                const float4* ds = reinterpret_cast<const float4*>(xds + t * ds_stride + (u64)g * CHUNKS);
                float xd[CHUNKS];
                float x_sum = 0.0f;
#pragma unroll
                for (int k = 0; k < (int)CHUNKS; k += 2) {
                    const float4 pair = __ldg(ds + k / 2);
                    xd[k] = pair.x * (1.0f / (float)(1u << (G::BITS * k)));
                    xd[k + 1] = pair.z * (1.0f / (float)(1u << (G::BITS * (k + 1))));
                    x_sum += pair.y + pair.w;
                }
                float partial[R];
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    partial[r] = 0.0f;
                }
#pragma unroll
                for (int k = 0; k < (int)CHUNKS; ++k) {
                    const uint4 x = __ldg(xv + k);
                    const u32 mask = G::MASK << (G::BITS * k);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        const uint4 c = raw[b][r].codes;
                        int dot = dp4a_us(c.x & mask, (int)x.x, EXACT_INT_BIAS);
                        dot = dp4a_us(c.y & mask, (int)x.y, dot);
                        dot = dp4a_us(c.z & mask, (int)x.z, dot);
                        dot = dp4a_us(c.w & mask, (int)x.w, dot);
                        partial[r] = fmaf(xd[k], __int_as_float(dot) - EXACT_INT_BIAS_F, partial[r]);
                    }
                }
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const float2 so = F::scale_offset(raw[b][r]);
                    rows_of.acc[r][t] = fmaf(so.x, partial[r], fmaf(so.y, x_sum, rows_of.acc[r][t]));
                }
            }
        }
    }
    finish_rows<NW, RPW>(rows_of.acc, row0, rows, out, accumulate, scale, ep);
}

// Entry-point bodies, so each format's kernels are one line each. The grouped formats
// (FmtGrouped) and those with wide chunk pairs take their own loops, except Q8_0: its pair is
// two 16-byte loads 32 bytes apart per lane, so each load instruction of a warp would touch
// twice the sectors it uses; one chunk a lane streams 2% faster (docs/performance-log.md).
template <class F, int NW>
__device__ __forceinline__ void matvec_rows(const Planes (&w)[NW], const i8* xq, const float2* xds, const InputNorm& xn,
                                            float* out, u32 rows, u32 accumulate, u32 block,
                                            const RowEpilogue& ep = RowEpilogue{}) {
    if constexpr (IsGrouped<F>::value) {
        matvec_grouped<F, NW>(w, xq, xds, xn, out, rows, accumulate, block, ep);
    } else if constexpr (ChunkPair<F>::WIDE && F::CODE_BYTES < 16) {
        matvec_paired<F, NW>(w, xq, xds, xn, out, rows, accumulate, block, ep);
    } else {
        matvec_quant<F, NW>(w, xq, xds, xn, out, rows, accumulate, block, ep);
    }
}

// out (+)= x.W + bias (bias null: none).
template <class F>
__device__ __forceinline__ void matvec_one(const Planes& w, const i8* xq, const float2* xds, const InputNorm& xn,
                                           float* out, u32 rows, u32 accumulate, const float* bias, const NextNorm& next) {
    const Planes weights[1] = {w};
    RowEpilogue ep{};
    ep.bias = bias;
    matvec_rows<F, 1>(weights, xq, xds, xn, out, rows, accumulate, blockIdx.x, ep);
    if (next.xq != nullptr) {
        norm_block_rows(out, rows, next);
    }
}

// A gated pair's output act(x.Wg) * (x.Wu): `act` a GATE_* of common.cuh (alpha and limit
// GATE_SWIGLU_OAI's), and given next_xq also its int8 quantization.
#define MV_GATED_PARAMS MV_NEXT_PARAMS, u32 act, float alpha, float limit
#define MV_GATED_ARGS next_xq, next_xds, act, alpha, limit

template <class F>
__device__ __forceinline__ void matvec_two(const Planes& gate, const Planes& up, const i8* xq, const float2* xds,
                                           const InputNorm& xn, float* out, u32 rows, MV_GATED_PARAMS) {
    const Planes weights[2] = {gate, up};
    RowEpilogue ep{};
    ep.act = act;
    ep.alpha = alpha;
    ep.limit = limit;
    matvec_rows<F, 2>(weights, xq, xds, xn, out, rows, 0, blockIdx.x, ep);
    if (next_xq != nullptr) {
        quantize_block_rows(out, rows, next_xq, next_xds);
    }
}

// Up to three weights of one format on one input (attention's q, k and v) in one launch: the
// first blocks compute a's rows, the next b's, the rest c's (rows_c = 0 for two), which saves
// the fixed cost of the launches it replaces. Each adds its bias (null: none).
#define MV_STACKED_PARAMS                                                                                         \
    Planes a, Planes b, Planes c, const i8 *xq, const float2 *xds, InputNorm xn, float *out_a, float *out_b, float *out_c, \
        u32 rows_a, u32 rows_b, u32 rows_c, const float *bias_a, const float *bias_b, const float *bias_c
#define MV_STACKED_ARGS a, b, c, xq, xds, xn, out_a, out_b, out_c, rows_a, rows_b, rows_c, bias_a, bias_b, bias_c

template <class F>
__device__ __forceinline__ void matvec_stacked(MV_STACKED_PARAMS) {
    // For one token, the decode attention after q, k and v starts now and fetches its cache
    // rows meanwhile.
    if constexpr (NTOK == 1) {
        start_dependents();
    }
    constexpr u32 PER_BLOCK = MV_GROUPS * ROWS_PER_WARP;
    u32 block = blockIdx.x;
    const u32 k = stacked_weight(block, (rows_a + PER_BLOCK - 1) / PER_BLOCK, (rows_b + PER_BLOCK - 1) / PER_BLOCK);
    const Planes weights[1] = {k == 0 ? a : k == 1 ? b : c};
    RowEpilogue ep{};
    ep.bias = k == 0 ? bias_a : k == 1 ? bias_b : bias_c;
    matvec_rows<F, 1>(weights, xq, xds, xn, k == 0 ? out_a : k == 1 ? out_b : out_c, k == 0 ? rows_a : k == 1 ? rows_b : rows_c, 0, block, ep);
}

// Expert-indexed mat-vec (mixture of experts): slot s = slot0 + blockIdx.y of the step's
// tokens x chosen experts multiplies its input row (token s / n_used, or row s itself when
// per_slot) by expert ids[s] of `table` (one Planes per expert, all of one format and shape)
// into out[s - slot0][rows], plus row r of `bias` ([n_experts][rows], null: none) for its
// expert, so a token reads only its chosen experts' weights. The ids come from the router kernel
// before this one. Built with NTOK = 1.
#define MV_EXPERTS_PARAMS                                                                                           \
    const Planes *table, const float *ids, u32 n_experts, u32 n_used, u32 per_slot, u32 slot0, const i8 *xq,          \
        const float2 *xds, float *out, u32 rows, const float *bias
#define MV_EXPERTS_ARGS table, ids, n_experts, n_used, per_slot, slot0, xq, xds, out, rows, bias

// The expert of slot `slot`, or n_experts when ids holds no valid id there (the output is then NaN).
__device__ __forceinline__ u32 slot_expert(const float* ids, u32 slot, u32 n_experts) {
    const float id = ids[slot];
    return id >= 0.0f && id < (float)n_experts && id == floorf(id) ? (u32)id : n_experts;
}

// This block's slot (slot0 + blockIdx.y) once the router's ids are visible: `out` moved to the
// slot's output row, and its expert, or n_experts for an id that names none, after NaN went
// into this block's rows of that output (rows_per_block of them).
__device__ __forceinline__ u32 block_expert(const float* ids, u32 slot, u32 n_experts, float*& out, u32 rows, u32 rows_per_block) {
    wait_for_inputs();
    const u32 e = slot_expert(ids, slot, n_experts);
    out += (u64)blockIdx.y * rows;
    if (e >= n_experts) {
        for (u32 r = blockIdx.x * rows_per_block + threadIdx.x; r < min(rows, (blockIdx.x + 1) * rows_per_block); r += blockDim.x) {
            out[r] = __int_as_float(0x7fc00000);
        }
    }
    return e;
}

template <class F>
__device__ __forceinline__ void matvec_experts(MV_EXPERTS_PARAMS) {
    if (NTOK != 1) {
        return;  // one input row per slot: the host launches the NTOK = 1 module's kernel only
    }
    const u32 slot = slot0 + blockIdx.y;
    const u32 e = block_expert(ids, slot, n_experts, out, rows, MV_GROUPS * ROWS_PER_WARP);
    if (e >= n_experts) {
        return;
    }
    const Planes weights[1] = {table[e]};
    const u64 row = per_slot ? slot : slot / n_used;
    const u32 tiles = weights[0].tiles;
    RowEpilogue ep{};
    ep.bias = bias != nullptr ? bias + (u64)e * rows : nullptr;
    matvec_rows<F, 1>(weights, xq + row * tiles * TILE_VALUES, xds + row * tiles * 32, InputNorm{}, out, rows, 0, blockIdx.x, ep);
}

// matvec_experts of a gate and an up expert set on one input row per token (PerToken), out =
// act(x.Wg + gate_bias) * (x.Wu + up_bias) per slot (the biases [n_experts][rows], both or
// neither; `act` a GATE_* of common.cuh): one launch and one quantized input for both products.
#define MV_EXPERTS_GATED_PARAMS                                                                                    \
    const Planes *gate_table, const Planes *up_table, const float *ids, u32 n_experts, u32 n_used, u32 slot0,        \
        const i8 *xq, const float2 *xds, float *out, u32 rows, const float *gate_bias, const float *up_bias, u32 act,   \
        float alpha, float limit
#define MV_EXPERTS_GATED_ARGS \
    gate_table, up_table, ids, n_experts, n_used, slot0, xq, xds, out, rows, gate_bias, up_bias, act, alpha, limit

template <class F>
__device__ __forceinline__ void matvec_experts_gated(MV_EXPERTS_GATED_PARAMS) {
    if (NTOK != 1) {
        return;  // one input row per slot: the host launches the NTOK = 1 module's kernel only
    }
    const u32 slot = slot0 + blockIdx.y;
    const u32 e = block_expert(ids, slot, n_experts, out, rows, MV_GROUPS * SWIGLU_ROWS_PER_WARP);
    if (e >= n_experts) {
        return;
    }
    const Planes weights[2] = {gate_table[e], up_table[e]};
    const u64 row = slot / n_used;
    const u32 tiles = weights[0].tiles;
    const bool biased = gate_bias != nullptr && up_bias != nullptr;
    const RowEpilogue ep{biased ? gate_bias + (u64)e * rows : nullptr, biased ? up_bias + (u64)e * rows : nullptr, act, alpha, limit, 0};
    matvec_rows<F, 2>(weights, xq + row * tiles * TILE_VALUES, xds + row * tiles * 32, InputNorm{}, out, rows, 0, blockIdx.x, ep);
}

// Expert-indexed mat-vec over groups of slots (a prompt's experts): the slots were sorted by
// expert into groups of up to NTOK that share one (moe_group_slots in arch_ops.cu), their input
// rows gathered into NTOK consecutive rows per group, so group g = blockIdx.y multiplies the
// rows xq[g NTOK ..] by expert group_expert[g] into out[g NTOK ..][rows] and reads that
// expert's weights once for NTOK slots. Groups from *n_groups on exit.
#define MV_EXPERT_GROUPS_PARAMS \
    const Planes *table, const u32 *group_expert, const u32 *n_groups, const i8 *xq, const float2 *xds, float *out, u32 rows
#define MV_EXPERT_GROUPS_ARGS table, group_expert, n_groups, xq, xds, out, rows

template <class F>
__device__ __forceinline__ void matvec_expert_groups(MV_EXPERT_GROUPS_PARAMS) {
    const u32 g = blockIdx.y;
    wait_for_inputs();
    if (g >= *n_groups) {
        return;
    }
    const Planes weights[1] = {table[group_expert[g]]};
    const u64 row = (u64)g * NTOK;
    const u32 tiles = weights[0].tiles;
    matvec_rows<F, 1>(weights, xq + row * tiles * TILE_VALUES, xds + row * tiles * 32, InputNorm{}, out + row * rows, rows, 0, blockIdx.x);
}
