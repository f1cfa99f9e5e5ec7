// Causal grouped-query attention of a step's prompt tokens over the paged KV cache (the
// conventions of paged_attention.cu: q and out f32 [n_tokens][n_heads][HEAD_DIM], the caches
// typed rows found through each sequence's block table, query head h reads kv head h / GROUP,
// an optional window and sinks).
// paged_attention_prefill: flash attention on tensor cores over the step's query tiles.
// kiln-test-defines: HEAD_DIM=128,GROUP=4,K_TYPE=1,V_TYPE=1
// kiln-test-defines: HEAD_DIM=128,GROUP=8,K_TYPE=2,V_TYPE=2
// kiln-test-defines: HEAD_DIM=128,GROUP=1,K_TYPE=0,V_TYPE=0
// kiln-test-defines: HEAD_DIM=64,GROUP=2,K_TYPE=1,V_TYPE=2
// kiln-test-defines: HEAD_DIM=64,GROUP=8,K_TYPE=0,V_TYPE=1
// kiln-test-defines: HEAD_DIM=8,GROUP=2,K_TYPE=2,V_TYPE=0
// kiln-test-defines: HEAD_DIM=80,GROUP=7,K_TYPE=1,V_TYPE=1
// kiln-test-defines: HEAD_DIM=4,GROUP=1,K_TYPE=0,V_TYPE=1
// kiln-test-defines: HEAD_DIM=256,GROUP=2,K_TYPE=0,V_TYPE=0
// kiln-test-defines: HEAD_DIM=512,GROUP=8,K_TYPE=1,V_TYPE=1
// kiln-test-defines: HEAD_DIM=512,GROUP=2,K_TYPE=2,V_TYPE=1
// kiln-test-defines: HEAD_DIM=3,GROUP=1,K_TYPE=1,V_TYPE=2
// kiln-test-defines: HEAD_DIM=64,GROUP=8,K_TYPE=1,V_TYPE=1
// kiln-waits-for-inputs

#ifndef HEAD_DIM
#error "paged_prefill.cu needs -DHEAD_DIM=<values per head>"
#endif
#ifndef GROUP
#error "paged_prefill.cu needs -DGROUP=<query heads per kv head>"
#endif
#ifndef K_TYPE
#error "paged_prefill.cu needs -DK_TYPE=<KV_F32|KV_F16|KV_Q8_0>"
#endif
#ifndef V_TYPE
#error "paged_prefill.cu needs -DV_TYPE=<KV_F32|KV_F16|KV_Q8_0>"
#endif

#include "paged_attention.cuh"

// ============================================================================================
// Flash-attention prefill on tensor cores
// ============================================================================================
//
// One block of FA_WARPS warps per (query tile, query head); warp w owns query rows 16w..16w+15
// of the tile. K/V tiles of FA_KV rows are gathered through the block table into shared memory
// as f16, rows padded to FA_DP (a multiple of 16, zeros past HEAD_DIM) plus 8 halves so that
// fragment reads and ldmatrix hit distinct banks. S = Q K^T and O += P V use
// mma.m16n8k16 (f16 in, f32 accumulate); the softmax runs online in f32 registers.

#define FA_WARPS 4
#define FA_THREADS (FA_WARPS * 32)
#define FA_KV 64
constexpr int FA_DP = (HEAD_DIM + 15) / 16 * 16;
constexpr int FA_STRIDE = FA_DP + 8;
// Values per gathered chunk (one 16-byte f16 store when HEAD_DIM allows it).
constexpr int FA_CHUNK = HEAD_DIM % 8 == 0 ? 8 : HEAD_DIM % 4 == 0 ? 4 : HEAD_DIM % 2 == 0 ? 2 : 1;
constexpr int FA_ROW_CHUNKS = FA_DP / FA_CHUNK;
constexpr int FA_GATHER = (FA_KV * FA_ROW_CHUNKS + FA_THREADS - 1) / FA_THREADS;

static_assert(Q_TILE == FA_WARPS * 16, "one warp per 16 query rows of a tile");

// FA_CHUNK values of a cache (f16 bits) at element `at`, with the row's q8_0 scale applied.
template <int TYPE>
__device__ __forceinline__ void fa_fetch(float* dst, const u8* cache, u64 rows, u32 width, u64 row, u32 col) {
    constexpr int SUB = cmin(FA_CHUNK, 16 / elem_bytes(TYPE));
    const float d = kv_scale<TYPE>(cache, rows, width, row, col);
#pragma unroll
    for (int s = 0; s < FA_CHUNK; s += SUB) {
        const KvVec<TYPE, SUB> v = kv_fetch<TYPE, SUB>(cache, row * width + col + s);
#pragma unroll
        for (int c = 0; c < SUB; ++c) {
            dst[s + c] = TYPE == KV_Q8_0 ? d * kv_value<TYPE, SUB>(v, c) : kv_value<TYPE, SUB>(v, c);
        }
    }
}

// Rows kv0..kv0 + FA_KV of one kv head into `dst` ([FA_KV][FA_STRIDE] f16), zeros at
// positions before kv_begin (before every row's window, where the table may hold released
// entries) or from kv_end on, and at dims from HEAD_DIM on.
template <int TYPE>
__device__ __forceinline__ void fa_gather(
    u16* dst, const u8* cache, const u32* table, u64 rows, u32 width, u32 col0, u32 kv0, u32 kv_begin, u32 kv_end) {
    constexpr int WORDS = (FA_CHUNK + 1) / 2;
    u32 packed[FA_GATHER][WORDS];
#pragma unroll
    for (int i = 0; i < FA_GATHER; ++i) {
        const u32 index = i * FA_THREADS + threadIdx.x;
        const u32 j = index / FA_ROW_CHUNKS;
        const u32 d = index % FA_ROW_CHUNKS * FA_CHUNK;
        float v[FA_CHUNK];
        if (j < FA_KV && kv0 + j >= kv_begin && kv0 + j < kv_end && d < HEAD_DIM) {
            fa_fetch<TYPE>(v, cache, rows, width, cache_row(table, kv0 + j), col0 + d);
        } else {
#pragma unroll
            for (int c = 0; c < FA_CHUNK; ++c) {
                v[c] = 0.0f;
            }
        }
        if (FA_CHUNK == 1) {
            packed[i][0] = f32_to_f16_bits(v[0]);
        } else {
#pragma unroll
            for (int w = 0; w < WORDS; ++w) {
                packed[i][w] = pack_f16x2(v[2 * w], v[2 * w + 1 < FA_CHUNK ? 2 * w + 1 : 2 * w]);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < FA_GATHER; ++i) {
        const u32 index = i * FA_THREADS + threadIdx.x;
        const u32 j = index / FA_ROW_CHUNKS;
        u16* p = dst + j * FA_STRIDE + index % FA_ROW_CHUNKS * FA_CHUNK;
        if (j >= FA_KV) {
            continue;
        }
        if (FA_CHUNK == 8) {
            *reinterpret_cast<uint4*>(p) = make_uint4(packed[i][0], packed[i][1], packed[i][2], packed[i][3]);
        } else if (FA_CHUNK == 4) {
            *reinterpret_cast<uint2*>(p) = make_uint2(packed[i][0], packed[i][1]);
        } else if (FA_CHUNK == 2) {
            *reinterpret_cast<u32*>(p) = packed[i][0];
        } else {
            *p = (u16)packed[i][0];
        }
    }
}

// Grid (n_tiles, n_heads), FA_THREADS threads, dynamic shared memory 2 * FA_KV * FA_STRIDE
// halves. Tiles at or past step[STEP_N_TILES] exit, so the host may launch more.
extern "C" __global__ void __launch_bounds__(FA_THREADS) paged_attention_prefill(
    float* out, const float* q, const u8* k_cache, const u8* v_cache, const u32* step, u32 n_heads, u32 n_kv_heads,
    u32 rows, float scale, u32 window, const float* sinks) {
    wait_for_inputs();
    // Later tiles of a sequence see more positions; start them first.
    const u32 tile = gridDim.x - 1 - blockIdx.x;
    if (tile >= step[STEP_N_TILES]) {
        return;
    }
    const u32 head = blockIdx.y;
    const u32 kv_head = head / GROUP;
    const u32* tile_rec = step_tile(step, tile);
    const u32 first_token = tile_rec[TILE_FIRST_TOKEN];
    const u32 n_tok = tile_rec[TILE_N_TOKENS];
    const u32* table = step_block_table(step, step_seq(step, tile_rec[TILE_SEQ]));
    const u32 pos0 = step_pos(step, first_token);
    const u32 kv_end = pos0 + n_tok;
    const u32 width = n_kv_heads * HEAD_DIM;
    const u32 col0 = kv_head * HEAD_DIM;

    extern __shared__ uint4 fa_shared[];
    u16* k_s = reinterpret_cast<u16*>(fa_shared);
    u16* v_s = k_s + FA_KV * FA_STRIDE;

    const u32 lane = threadIdx.x & 31;
    const u32 warp = threadIdx.x >> 5;
    const u32 g = lane >> 2;
    const u32 t = lane & 3;
    const u32 row0 = warp * 16 + g;
    const u32 row1 = row0 + 8;
    // Rows past the tile's tokens compute on zero queries and are never written.
    const u32 qpos0 = pos0 + row0;
    const u32 qpos1 = pos0 + row1;
    const u32 warp_last = pos0 + warp * 16 + 15;

    // Q fragments (A operand, row-major 16 x 16 per k step) straight from global memory.
    u32 qf[FA_DP / 16][4];
    {
        const float* q0 = q + ((u64)(first_token + row0) * n_heads + head) * HEAD_DIM;
        const float* q1 = q + ((u64)(first_token + row1) * n_heads + head) * HEAD_DIM;
        const bool live0 = row0 < n_tok;
        const bool live1 = row1 < n_tok;
#pragma unroll
        for (int kc = 0; kc < FA_DP / 16; ++kc) {
            float v[8];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const u32 d = kc * 16 + h * 8 + 2 * t + e;
                    v[h * 4 + e] = live0 && d < HEAD_DIM ? q0[d] : 0.0f;
                    v[h * 4 + 2 + e] = live1 && d < HEAD_DIM ? q1[d] : 0.0f;
                }
            }
            qf[kc][0] = pack_f16x2(v[0], v[1]);
            qf[kc][1] = pack_f16x2(v[2], v[3]);
            qf[kc][2] = pack_f16x2(v[4], v[5]);
            qf[kc][3] = pack_f16x2(v[6], v[7]);
        }
    }

    float o[FA_DP / 8][4];
#pragma unroll
    for (int n = 0; n < FA_DP / 8; ++n) {
        o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    }
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    const float s_scale = scale * LOG2E;

    // With a sliding window, tiles wholly before the first row's window are skipped; each row
    // masks the rest of what precedes its own window.
    const u32 kv_begin = window > 0 && pos0 + 1 > window ? pos0 + 1 - window : 0;
    const u32 kv_first = kv_begin / FA_KV * FA_KV;
    for (u32 kv0 = kv_first; kv0 < kv_end; kv0 += FA_KV) {
        // Gather K, then V: each thread's loads are issued together and packed to f16 at once,
        // which keeps only FA_GATHER chunks of one tensor in registers.
        __syncthreads();
        fa_gather<K_TYPE>(k_s, k_cache, table, rows, width, col0, kv0, kv_begin, kv_end);
        fa_gather<V_TYPE>(v_s, v_cache, table, rows, width, col0, kv0, kv_begin, kv_end);
        __syncthreads();
        // Warps whose rows all precede this tile have nothing to add.
        if (kv0 > warp_last) {
            continue;
        }

        float s[FA_KV / 8][4];
#pragma unroll
        for (int n = 0; n < FA_KV / 8; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
        }
#pragma unroll
        for (int kc = 0; kc < FA_DP / 16; ++kc) {
#pragma unroll
            for (int n = 0; n < FA_KV / 8; ++n) {
                const u16* k_row = k_s + (n * 8 + g) * FA_STRIDE + kc * 16 + 2 * t;
                mma_f16(s[n], qf[kc], *reinterpret_cast<const u32*>(k_row), *reinterpret_cast<const u32*>(k_row + 8));
            }
        }

        // Scale, causal mask (also hides the zero rows past kv_end), and the tile's row maxima.
        float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
        for (int n = 0; n < FA_KV / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const u32 col = kv0 + n * 8 + 2 * t + e;
                const bool see0 = col <= qpos0 && (window == 0 || col + window > qpos0);
                const bool see1 = col <= qpos1 && (window == 0 || col + window > qpos1);
                s[n][e] = see0 ? s[n][e] * s_scale : NEG_INF;
                s[n][2 + e] = see1 ? s[n][2 + e] * s_scale : NEG_INF;
                mx0 = fmaxf(mx0, s[n][e]);
                mx1 = fmaxf(mx1, s[n][2 + e]);
            }
        }
#pragma unroll
        for (int offset = 1; offset < 4; offset <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, offset));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, offset));
        }
        // A row that has seen no visible position yet (before its sliding window) keeps a max
        // of -inf; it is offset by 0 instead, so its weights and rescale come out 0, not NaN.
        const float new0 = fmaxf(m0, mx0);
        const float new1 = fmaxf(m1, mx1);
        const float base0 = new0 == NEG_INF ? 0.0f : new0;
        const float base1 = new1 == NEG_INF ? 0.0f : new1;
        const float alpha0 = exp2f(m0 - base0);
        const float alpha1 = exp2f(m1 - base1);
        m0 = new0;
        m1 = new1;
        float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
        for (int n = 0; n < FA_KV / 8; ++n) {
            s[n][0] = exp2f(s[n][0] - base0);
            s[n][1] = exp2f(s[n][1] - base0);
            s[n][2] = exp2f(s[n][2] - base1);
            s[n][3] = exp2f(s[n][3] - base1);
            sum0 += s[n][0] + s[n][1];
            sum1 += s[n][2] + s[n][3];
        }
        // Per-lane partial sums; the 4 lanes of a row are added once at the end.
        l0 = l0 * alpha0 + sum0;
        l1 = l1 * alpha1 + sum1;
#pragma unroll
        for (int n = 0; n < FA_DP / 8; ++n) {
            o[n][0] *= alpha0;
            o[n][1] *= alpha0;
            o[n][2] *= alpha1;
            o[n][3] *= alpha1;
        }

        // O += P V: the S accumulators of two n-tiles form one A fragment of k = 16 rows.
#pragma unroll
        for (int kc = 0; kc < FA_KV / 16; ++kc) {
            u32 a[4];
            a[0] = pack_f16x2(s[2 * kc][0], s[2 * kc][1]);
            a[1] = pack_f16x2(s[2 * kc][2], s[2 * kc][3]);
            a[2] = pack_f16x2(s[2 * kc + 1][0], s[2 * kc + 1][1]);
            a[3] = pack_f16x2(s[2 * kc + 1][2], s[2 * kc + 1][3]);
            const u32 r = kc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
            for (int n = 0; n < FA_DP / 8; n += 2) {
                u32 b[4];
                ldmatrix_x4_trans(b, v_s + r * FA_STRIDE + (n + (lane >> 4)) * 8);
                mma_f16(o[n], a, b[0], b[1]);
                mma_f16(o[n + 1], a, b[2], b[3]);
            }
        }
    }

#pragma unroll
    for (int offset = 1; offset < 4; offset <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, offset);
        l1 += __shfl_xor_sync(0xffffffffu, l1, offset);
    }
    const float sink = sinks ? sinks[head] * LOG2E : 0.0f;
    const float inv0 = softmax_norm(m0, l0, sink, sinks != nullptr);
    const float inv1 = softmax_norm(m1, l1, sink, sinks != nullptr);
    float* out0 = out + ((u64)(first_token + row0) * n_heads + head) * HEAD_DIM;
    float* out1 = out + ((u64)(first_token + row1) * n_heads + head) * HEAD_DIM;
#pragma unroll
    for (int n = 0; n < FA_DP / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const u32 d = n * 8 + 2 * t + e;
            if (d < HEAD_DIM) {
                if (row0 < n_tok) {
                    out0[d] = o[n][e] * inv0;
                }
                if (row1 < n_tok) {
                    out1[d] = o[n][2 + e] * inv1;
                }
            }
        }
    }
}
