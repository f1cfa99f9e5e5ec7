// The mat-mat body of tiles 0..3 (no MMA_PIPE): f32 activations read and converted by every
// block, weights and activations prefetched one step ahead into registers (see matmat_mma.cu).
#pragma once
#include "mma.cuh"

#define MMA_BK (MMA_THREADS * CHUNK_VALUES / MMA_BM)
// Chunks of a row per step, and float4 activation loads per thread per step.
#define MMA_CPR (MMA_BK / CHUNK_VALUES)
#define MMA_XV (MMA_BN * MMA_BK / 4 / MMA_THREADS)

static_assert(MMA_BM == 32 || MMA_BM == 64 || MMA_BM == 128, "MMA_BM must be 32, 64 or 128");
static_assert(MMA_WM * MMA_WN * MMA_WK == MMA_WARPS, "warps must tile slots x tokens x depth");
static_assert(MMA_TN % 16 == 0 && MMA_TK % 16 == 0, "warp tiles are whole pairs of n8 tiles and k16 slices");
static_assert(MMA_XV >= 1 && MMA_BN * MMA_BK % (4 * MMA_THREADS) == 0, "activation loads must spread evenly");

#define MMA_W_BYTES (2 * MMA_BM * MMA_LDS * 2)
#define MMA_X_BYTES (2 * MMA_BN * MMA_LDS * 2)
#define MMA_RED_BYTES ((MMA_WK - 1) * MMA_BM * MMA_BN * 4)
#define MMA_SMEM_BYTES (MMA_W_BYTES + MMA_X_BYTES > MMA_RED_BYTES ? MMA_W_BYTES + MMA_X_BYTES : MMA_RED_BYTES)
static_assert(MMA_SMEM_BYTES <= 48 * 1024, "static shared memory is limited to 48 KiB");

template <class W, int NW>
__device__ __forceinline__ void matmat_mma(const W& first, const W& second, const float* __restrict__ x, u32 cols,
                                           u32 n, float* out, u32 rows, u32 accumulate) {
    typedef HalfChunks<W> H;
    __shared__ __align__(16) u8 smem[MMA_SMEM_BYTES];
    u16(*ws)[MMA_BM][MMA_LDS] = reinterpret_cast<u16(*)[MMA_BM][MMA_LDS]>(smem);
    u16(*xs)[MMA_BN][MMA_LDS] = reinterpret_cast<u16(*)[MMA_BN][MMA_LDS]>(smem + MMA_W_BYTES);

    const u32 tid = threadIdx.x;
    const u32 lane = tid & 31;
    const u32 warp = tid >> 5;
    const u32 row_base = blockIdx.x * (MMA_BM / NW);
    const u32 token_base = blockIdx.y * MMA_BN;
    const u32 chunks = first.chunks_per_row();
    const u32 steps = (chunks + MMA_CPR - 1) / MMA_CPR;

    // Decoding role: slot `slot`, chunk `part` of each step; neighbouring threads read
    // neighbouring chunks of one row. Rows past the end re-read the last row (never written).
    const u32 slot = tid / MMA_CPR;
    const u32 part = tid % MMA_CPR;
    const u32 slot_row = min(NW == 1 ? row_base + slot : row_base + (slot >> 4) * 8 + (slot & 7), rows - 1);
    const W source = NW == 2 && (slot & 8) ? second : first;

    // Activation role: float4 e = i * MMA_THREADS + tid of the step's [MMA_BN][MMA_BK] tile.
    // Load i reads token x_token + i * X_TOKEN_STEP, columns x_column.. of the step.
    constexpr u32 X_TOKEN_STEP = MMA_THREADS / (MMA_BK / 4);
    const bool vector_x = (cols & 3) == 0;
    const u32 x_token = tid / (MMA_BK / 4);
    const u32 x_column = 4 * (tid % (MMA_BK / 4));
    const float* x_first = x + (u64)(token_base + x_token) * cols;
    const u64 x_step = (u64)X_TOKEN_STEP * cols;

    typename H::Raw raw;
    float4 xv[MMA_XV];
    auto fetch = [&](u32 step) {
        const u32 chunk = min(step * MMA_CPR + part, chunks - 1);
        raw = H::fetch(source, slot_row, chunk);
        const u32 column = step * MMA_BK + x_column;
#pragma unroll
        for (int i = 0; i < MMA_XV; ++i) {
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            const float* p = x_first + i * x_step + column;
            if (token_base + x_token + i * X_TOKEN_STEP < n) {
                if (vector_x) {
                    if (column < cols) {
                        v = __ldg(reinterpret_cast<const float4*>(p));
                    }
                } else {
                    v.x = column < cols ? __ldg(p) : 0.0f;
                    v.y = column + 1 < cols ? __ldg(p + 1) : 0.0f;
                    v.z = column + 2 < cols ? __ldg(p + 2) : 0.0f;
                    v.w = column + 3 < cols ? __ldg(p + 3) : 0.0f;
                }
            }
            xv[i] = v;
        }
    };
    auto store = [&](u32 step, u32 buffer) {
        u32 h[8];
        const u32 chunk = step * MMA_CPR + part;
        H::decode(raw, min(chunk, chunks - 1), h);
        if (chunk >= chunks) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                h[i] = 0;
            }
        }
        uint4* dst = reinterpret_cast<uint4*>(&ws[buffer][slot][part * CHUNK_VALUES]);
        dst[0] = make_uint4(h[0], h[1], h[2], h[3]);
        dst[1] = make_uint4(h[4], h[5], h[6], h[7]);
#pragma unroll
        for (int i = 0; i < MMA_XV; ++i) {
            *reinterpret_cast<uint2*>(&xs[buffer][x_token + i * X_TOKEN_STEP][x_column]) =
                make_uint2(pack_f16x2(xv[i].x, xv[i].y), pack_f16x2(xv[i].z, xv[i].w));
        }
    };

    // Computing role.
    const u32 wk = warp % MMA_WK;
    const u32 wn = (warp / MMA_WK) % MMA_WN;
    const u32 wm = warp / (MMA_WK * MMA_WN);
    // ldmatrix row addresses: A rows (lane & 15), depth half (lane >> 4); B tokens (lane & 7) +
    // 8 (lane >> 4), depth half (lane >> 3) & 1.
    const u32 a_offset = ((wm * 32 + (lane & 15)) * MMA_LDS + wk * MMA_TK + 8 * (lane >> 4)) * 2;
    const u32 b_offset = ((wn * MMA_TN + (lane & 7) + 8 * (lane >> 4)) * MMA_LDS + wk * MMA_TK + 8 * ((lane >> 3) & 1)) * 2;
    const u32 ws_base = shared_address(&ws[0][0][0]);
    const u32 xs_base = shared_address(&xs[0][0][0]);

    float acc[2][MMA_TN / 8][4];
    mma_zero<MMA_TN>(acc);

    wait_for_inputs();
    fetch(0);
    store(0, 0);
    __syncthreads();
    for (u32 step = 0; step < steps; ++step) {
        const bool more = step + 1 < steps;
        if (more) {
            fetch(step + 1);
        }
        const u32 buffer = step & 1;
        const u32 a_base = ws_base + buffer * (MMA_BM * MMA_LDS * 2) + a_offset;
        const u32 b_base = xs_base + buffer * (MMA_BN * MMA_LDS * 2) + b_offset;
#pragma unroll
        for (int kk = 0; kk < MMA_TK / 16; ++kk) {
            u32 a[2][4];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                ldmatrix_x4(a[i], a_base + (16 * i * MMA_LDS + 16 * kk) * 2);
            }
#pragma unroll
            for (int j = 0; j < MMA_TN / 16; ++j) {
                u32 b[4];
                ldmatrix_x4(b, b_base + (16 * j * MMA_LDS + 16 * kk) * 2);
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    mma_f16(acc[i][2 * j], a[i], b[0], b[1]);
                    mma_f16(acc[i][2 * j + 1], a[i], b[2], b[3]);
                }
            }
        }
        if (more) {
            store(step + 1, buffer ^ 1);
        }
        __syncthreads();
    }

    if (!mma_merge_depth_splits<MMA_WM, MMA_WN, MMA_WK, MMA_TN>(acc, smem, wm, wn, wk, lane)) {
        return;
    }

    mma_store<NW, MMA_TN>(acc, out, nullptr, 0, n, rows, row_base, token_base, wm, wn, lane, accumulate);
}

template <class W>
__device__ __forceinline__ void matmat_one(const W& w, const float* x, u32 cols, u32 n, float* out, u32 rows,
                                           u32 accumulate) {
    matmat_mma<W, 1>(w, w, x, cols, n, out, rows, accumulate);
}

template <class W>
__device__ __forceinline__ void matmat_two(const W& gate, const W& up, const float* x, u32 cols, u32 n, float* out,
                                           u32 rows) {
    matmat_mma<W, 2>(gate, up, x, cols, n, out, rows, 0);
}
