// The mat-mat body of the pipelined tiles (MMA_PIPE=1; design and predictions in matmat_mma.cu):
// f16 activations (converted once per product by mma_half_activations) copied into an
// MMA_XS-stage shared ring with cp.async, MMA_BK values of depth per step, the weight chunks
// of the next step prefetched into registers and decoded into a double-buffered f16 tile, and
// optional split-K over gridDim.z with f32 partials summed by mma_reduce_splits.
#pragma once
#include "mma.cuh"

#if !defined(MMA_BK) || !defined(MMA_XS)
#error "pipelined matmat_mma kernels need -DMMA_BK=<depth per step> -DMMA_XS=<activation stages>"
#endif

// Chunks of a row per step, weight chunks per thread per step, 16-byte activation segments
// per token per step and per thread per step.
#define MMA_CPR (MMA_BK / CHUNK_VALUES)
#define MMA_CPT (MMA_BM * MMA_CPR / MMA_THREADS)
#define MMA_SPR (MMA_BK / 8)
#define MMA_XSEG (MMA_BN * MMA_SPR / MMA_THREADS)
// Dynamic shared memory (the host's MmaTile::shared_bytes computes the same).
#define MMA_W_BYTES (2 * MMA_BM * MMA_LDS * 2)
#define MMA_X_BYTES (MMA_XS * MMA_BN * MMA_LDS * 2)

static_assert(MMA_BM == 32 || MMA_BM == 64 || MMA_BM == 128, "MMA_BM must be 32, 64 or 128");
static_assert(MMA_WM * MMA_WN * MMA_WK == MMA_WARPS, "warps must tile slots x tokens x depth");
static_assert(MMA_TN % 16 == 0 && MMA_TK % 16 == 0, "warp tiles are whole pairs of n8 tiles and k16 slices");
static_assert(MMA_CPT >= 1 && MMA_BM * MMA_CPR % MMA_THREADS == 0, "weight chunks must spread evenly");
// A thread's chunks lie MMA_THREADS / MMA_CPR slots apart: a multiple of 16, so they are all
// gate or all up rows of the SwiGLU interleave (and MMA_BK <= 256).
static_assert(MMA_THREADS % MMA_CPR == 0 && (MMA_THREADS / MMA_CPR) % 16 == 0, "MMA_BK must be 64, 128 or 256");
static_assert(MMA_XSEG >= 1 && MMA_BN * MMA_SPR % MMA_THREADS == 0, "activation copies must spread evenly");
static_assert(MMA_XS == 2 || MMA_XS == 3, "two or three activation stages");

template <class W, int NW>
__device__ __forceinline__ void matmat_body(const W& first, const W& second, const u16* __restrict__ xh, u32 ld, u32 n, const MmaOut& o) {
    typedef HalfChunks<W> H;
    extern __shared__ __align__(16) u8 smem[];
    u16(*ws)[MMA_BM][MMA_LDS] = reinterpret_cast<u16(*)[MMA_BM][MMA_LDS]>(smem);

    const u32 tid = threadIdx.x;
    const u32 lane = tid & 31;
    const u32 warp = tid >> 5;
    // Tokens vary fastest across the grid: blocks running together share weight rows, which
    // then come from DRAM once; the f16 activations are small enough to stay in L2.
    const u32 token_base = blockIdx.x * MMA_BN;
    const u32 rows = o.rows;
    const u32 row_base = o.row_block * (MMA_BM / NW);
    const u32 chunks = first.chunks_per_row();
    const u32 all_steps = (chunks + MMA_CPR - 1) / MMA_CPR;
    const u32 per_split = (all_steps + gridDim.z - 1) / gridDim.z;
    const u32 begin = blockIdx.z * per_split;
    const u32 end = min(begin + per_split, all_steps);

    // Decoding role: chunk `piece` of slots slot0 + i * SLOT_STEP (i < MMA_CPT) of each step.
    constexpr u32 SLOT_STEP = MMA_THREADS / MMA_CPR;
    constexpr u32 ROW_STEP = NW == 1 ? SLOT_STEP : SLOT_STEP / 2;
    const u32 slot0 = tid / MMA_CPR;
    const u32 piece = tid % MMA_CPR;
    const u32 row0 = NW == 1 ? row_base + slot0 : row_base + (slot0 >> 4) * 8 + (slot0 & 7);
    const W source = NW == 2 && (slot0 & 8) ? second : first;

    typename H::Raw raw[MMA_CPT];
    auto fetch_w = [&](u32 step) {
        const u32 chunk = min(step * MMA_CPR + piece, chunks - 1);
#pragma unroll
        for (int i = 0; i < MMA_CPT; ++i) {
            raw[i] = H::fetch(source, min(row0 + i * ROW_STEP, rows - 1), chunk);
        }
    };
    auto store_w = [&](u32 step, u32 buffer) {
        const u32 chunk = step * MMA_CPR + piece;
#pragma unroll
        for (int i = 0; i < MMA_CPT; ++i) {
            u32 h[8];
            H::decode(raw[i], min(chunk, chunks - 1), h);
            if (chunk >= chunks) {
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    h[k] = 0;
                }
            }
            uint4* dst = reinterpret_cast<uint4*>(&ws[buffer][slot0 + i * SLOT_STEP][piece * CHUNK_VALUES]);
            dst[0] = make_uint4(h[0], h[1], h[2], h[3]);
            dst[1] = make_uint4(h[4], h[5], h[6], h[7]);
        }
    };

    // Activation role: 16-byte segment x_seg of tokens x_token + i * X_TOKEN_STEP. Segments
    // past n tokens or the row's ld values are zero-filled (ld is a multiple of 8).
    constexpr u32 X_TOKEN_STEP = MMA_THREADS / MMA_SPR;
    const u32 x_token = tid / MMA_SPR;
    const u32 x_seg = tid % MMA_SPR;
    const u32 ws_base = shared_address(smem);
    const u32 xs_base = ws_base + MMA_W_BYTES;
    auto issue_x = [&](u32 step, u32 stage) {
        const u32 column = step * MMA_BK + x_seg * 8;
#pragma unroll
        for (int i = 0; i < MMA_XSEG; ++i) {
            const u32 t = x_token + i * X_TOKEN_STEP;
            const bool inside = token_base + t < n && column < ld;
            const u16* src = inside ? xh + (u64)(token_base + t) * ld + column : xh;
            cp_async_16(xs_base + ((stage * MMA_BN + t) * MMA_LDS + x_seg * 8) * 2, src, inside ? 16 : 0);
        }
    };

    // Computing role, as in mma_tile.cuh.
    const u32 wk = warp % MMA_WK;
    const u32 wn = (warp / MMA_WK) % MMA_WN;
    const u32 wm = warp / (MMA_WK * MMA_WN);
    const u32 a_offset = ((wm * 32 + (lane & 15)) * MMA_LDS + wk * MMA_TK + 8 * (lane >> 4)) * 2;
    const u32 b_offset = ((wn * MMA_TN + (lane & 7) + 8 * (lane >> 4)) * MMA_LDS + wk * MMA_TK + 8 * ((lane >> 3) & 1)) * 2;

    float acc[2][MMA_TN / 8][4];
    mma_zero<MMA_TN>(acc);

    // The first step's weights are fetched before the inputs are known to be written.
    if (begin < end) {
        fetch_w(begin);
    }
    wait_for_inputs();
    if (begin < end) {
        ring_fill<MMA_XS>(issue_x, begin, end);
        store_w(begin, 0);
        cp_async_wait<MMA_XS - 2>();
        __syncthreads();
        for (u32 step = begin; step < end; ++step) {
            const u32 local = step - begin;
            const bool more = step + 1 < end;
            ring_refill<MMA_XS>(issue_x, step, local, end);
            if (more) {
                fetch_w(step + 1);
            }
            const u32 a_base = ws_base + (local & 1) * (MMA_BM * MMA_LDS * 2) + a_offset;
            const u32 b_base = xs_base + (local % MMA_XS) * (MMA_BN * MMA_LDS * 2) + b_offset;
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
                store_w(step + 1, (local & 1) ^ 1);
            }
            cp_async_wait<MMA_XS - 2>();
            __syncthreads();
        }
    }
    cp_async_wait<0>();
    mma_finish<NW, MMA_WM, MMA_WN, MMA_WK, MMA_TN>(acc, smem, o.out, o.partials, n, rows, row_base, token_base, wm, wn, wk, lane, o.accumulate);
}
