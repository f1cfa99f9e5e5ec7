// Mat-vec for 1..8 tokens: out[t][r] = sum_c W[r][c] * x[t][c], with out [NTOK][rows] f32.
//
// One warp computes ROWS_PER_WARP rows (of each of NW weights: 2 for the fused SwiGLU) for all
// NTOK tokens, so every activation load serves ROWS_PER_WARP * NW rows. A block is MV_WARPS
// warps; grid = ceil(rows / (MV_WARPS * ROWS_PER_WARP)) (SwiGLU: SWIGLU_ROWS_PER_WARP).
//
// Quantized weights meet activations quantized to int8 per 16 values (matvec_input.cu): a lane
// multiplies its 16-value weight chunk with the matching activation chunk by four dp4a, then
//     sum_i (scale q_i + offset) * xd xq_i = scale * xd * isum + offset * xs,
// with (xd, xs) = (activation scale, xd * sum_i xq_i). Float weights use f32 activations.
#pragma once
#include "quant.cuh"

#ifndef NTOK
#error "matvec kernels need -DNTOK=<tokens, 1..8>"
#endif
#ifndef ROWS_PER_WARP
#error "matvec kernels need -DROWS_PER_WARP=<1, 2 or 4>"
#endif
static_assert(NTOK >= 1 && NTOK <= 8, "NTOK must be 1..8");
static_assert(ROWS_PER_WARP == 1 || ROWS_PER_WARP == 2 || ROWS_PER_WARP == 4, "ROWS_PER_WARP must be 1, 2 or 4");

#define MV_WARPS 4
#define MV_THREADS (MV_WARPS * 32)
// The fused SwiGLU reads two weights, so it needs half the rows per warp for the same reuse.
#define SWIGLU_ROWS_PER_WARP (ROWS_PER_WARP > 1 ? ROWS_PER_WARP / 2 : 1)
// Tiles whose weight loads are issued together before any is decoded (memory-level
// parallelism); the host measures which MV_BATCH suits a product (src/matvec/matvec_shape.rs).
#ifndef MV_BATCH
#define MV_BATCH (4 / ROWS_PER_WARP)
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

__device__ __forceinline__ float silu(float g) {
    return g / (1.0f + expf(-g));
}

// Reduces acc[w * RPW + r][t] (weight w, row row0 + r, token t) over the warp and writes
// out[t][row]: the value itself (+= it when `accumulate`), or silu(gate) * up when NW == 2.
template <int NW, int RPW>
__device__ __forceinline__ void finish_rows(float (&acc)[NW * RPW][NTOK], u32 row0, u32 rows, float* out,
                                            u32 accumulate) {
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
    // With two weights, lane l < HALF holds the gate value and lane l + HALF the matching up.
    const float up = NW == 2 ? __shfl_xor_sync(0xffffffffu, total, HALF) : 0.0f;
    const u32 lane = threadIdx.x & 31;
    if (lane < RPW * NTOK) {
        const u32 row = row0 + lane / NTOK;
        const u32 token = lane % NTOK;
        if (row < rows) {
            float* slot = out + (u64)token * rows + row;
            if (NW == 2) {
                *slot = silu(total) * up;
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
                                            const u64 (&first_tile)[NW * RPW], u32 t0, u32 lane) {
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

// w: NW weights with the same shape; xq: [NTOK][tiles * 512] int8; xds: [NTOK][tiles * 32] (xd, xs).
template <class F, int NW>
__device__ __forceinline__ void matvec_quant(const Planes (&w)[NW], const i8* __restrict__ xq,
                                             const float2* __restrict__ xds, float* out, u32 rows, u32 accumulate) {
    constexpr int RPW = NW == 2 ? SWIGLU_ROWS_PER_WARP : ROWS_PER_WARP;
    constexpr int R = NW * RPW;
    const u32 lane = threadIdx.x & 31;
    const u32 row0 = (blockIdx.x * MV_WARPS + (threadIdx.x >> 5)) * RPW;
    if (row0 >= rows) {
        return;
    }
    const u32 tiles = w[0].tiles;
    // First global tile of each weight row; rows past the end re-read the last row (never written).
    u64 first_tile[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        first_tile[r] = (u64)min(row0 + r % RPW, rows - 1) * tiles;
    }
    float acc[R][NTOK];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int t = 0; t < NTOK; ++t) {
            acc[r][t] = 0.0f;
        }
    }
    const u64 x_stride = (u64)tiles * TILE_VALUES;
    const u64 ds_stride = (u64)tiles * 32;
    // The first batch of weights is on its way while the kernel before this one finishes.
    typename F::Raw raw[MV_BATCH][R];
    fetch_tiles<F, NW, RPW>(raw, w, first_tile, 0, lane);
    wait_for_inputs();
    for (u32 t0 = 0; t0 < tiles; t0 += MV_BATCH) {
        if (t0 > 0) {
            fetch_tiles<F, NW, RPW>(raw, w, first_tile, t0, lane);
        }
#pragma unroll
        for (int b = 0; b < MV_BATCH; ++b) {
            if (t0 + b >= tiles) {
                break;
            }
            Chunk c[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                c[r] = F::decode(raw[b][r], lane);
            }
            const u64 tile = t0 + b;
#pragma unroll
            for (int t = 0; t < NTOK; ++t) {
                const uint4 xv = __ldg(reinterpret_cast<const uint4*>(xq + t * x_stride + tile * TILE_VALUES) + lane);
                const float2 ds = __ldg(xds + t * ds_stride + tile * 32 + lane);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    int dot = __dp4a(c[r].q[0], (int)xv.x, 0);
                    dot = __dp4a(c[r].q[1], (int)xv.y, dot);
                    dot = __dp4a(c[r].q[2], (int)xv.z, dot);
                    dot = __dp4a(c[r].q[3], (int)xv.w, dot);
                    acc[r][t] = fmaf(c[r].scale * ds.x, (float)dot, fmaf(c[r].offset, ds.y, acc[r][t]));
                }
            }
        }
    }
    finish_rows<NW, RPW>(acc, row0, rows, out, accumulate);
}

// Steps whose weight loads are issued together: 32 registers of weights in flight per thread.
#define FV_BATCH (8 / ROWS_PER_WARP)

// Weights of steps c0, c0 + 128, ... (FV_BATCH of them) of every row; zeros past `cols`.
template <class W, int NW, int RPW>
__device__ __forceinline__ void fetch_float_steps(float4 (&wv)[FV_BATCH][NW * RPW], const W (&w)[NW],
                                                  const u32 (&row_of)[NW * RPW], u32 c0, u32 cols) {
#pragma unroll
    for (int b = 0; b < FV_BATCH; ++b) {
        const u32 c = c0 + 128 * b;
#pragma unroll
        for (int r = 0; r < NW * RPW; ++r) {
            wv[b][r] = c < cols ? w[r / RPW].load4(row_of[r], c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
}

// Float weights (FloatRows) against f32 activations x [NTOK][cols], cols a multiple of 4 (the
// host routes other widths to the mat-mat kernel). Lane l handles values 128 s + 4 l of step s,
// so both the weight and the activation loads of a warp are contiguous.
template <class W, int NW>
__device__ __forceinline__ void matvec_float(const W (&w)[NW], const float* __restrict__ x, u32 cols, float* out,
                                             u32 rows, u32 accumulate) {
    constexpr int RPW = NW == 2 ? SWIGLU_ROWS_PER_WARP : ROWS_PER_WARP;
    constexpr int R = NW * RPW;
    const u32 lane = threadIdx.x & 31;
    const u32 row0 = (blockIdx.x * MV_WARPS + (threadIdx.x >> 5)) * RPW;
    if (row0 >= rows) {
        return;
    }
    u32 row_of[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        row_of[r] = min(row0 + r % RPW, rows - 1);
    }
    float acc[R][NTOK];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int t = 0; t < NTOK; ++t) {
            acc[r][t] = 0.0f;
        }
    }
    float4 wv[FV_BATCH][R];
    fetch_float_steps<W, NW, RPW>(wv, w, row_of, 4 * lane, cols);
    wait_for_inputs();
    for (u32 c0 = 4 * lane; c0 < cols; c0 += 128 * FV_BATCH) {
        if (c0 > 4 * lane) {
            fetch_float_steps<W, NW, RPW>(wv, w, row_of, c0, cols);
        }
#pragma unroll
        for (int b = 0; b < FV_BATCH; ++b) {
            const u32 c = c0 + 128 * b;
            if (c >= cols) {
                break;
            }
#pragma unroll
            for (int t = 0; t < NTOK; ++t) {
                const float4 xv = __ldg(reinterpret_cast<const float4*>(x + (u64)t * cols + c));
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    float a = acc[r][t];
                    a = fmaf(wv[b][r].x, xv.x, a);
                    a = fmaf(wv[b][r].y, xv.y, a);
                    a = fmaf(wv[b][r].z, xv.z, a);
                    acc[r][t] = fmaf(wv[b][r].w, xv.w, a);
                }
            }
        }
    }
    finish_rows<NW, RPW>(acc, row0, rows, out, accumulate);
}

// Entry-point bodies, so each format's kernels are one line each.
template <class F>
__device__ __forceinline__ void matvec_one(const Planes& w, const i8* xq, const float2* xds, float* out, u32 rows,
                                           u32 accumulate) {
    const Planes weights[1] = {w};
    matvec_quant<F, 1>(weights, xq, xds, out, rows, accumulate);
}

template <class F>
__device__ __forceinline__ void matvec_two(const Planes& gate, const Planes& up, const i8* xq, const float2* xds,
                                           float* out, u32 rows) {
    const Planes weights[2] = {gate, up};
    matvec_quant<F, 2>(weights, xq, xds, out, rows, 0);
}
