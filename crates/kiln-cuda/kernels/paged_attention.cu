// Causal grouped-query attention over the paged KV cache, for every token of a batched step.
// Token t belongs to sequence step_token_seq(t) at position step_pos(t) and sees positions
// 0..=pos of its own sequence (with `window` > 0 only the last `window` of them), found through
// that sequence's block table (plan.cuh). `sinks`, when not null, holds one logit per query
// head that joins every softmax row of that head without a value (gpt-oss). The
// caches are typed buffers of `rows` rows of n_kv_heads * HEAD_DIM values (kv.cuh); q and out
// are f32 [n_tokens][n_heads][HEAD_DIM]; query head h reads kv head h / GROUP.
//
// paged_attention_split: flash-decoding for any mix of tokens. The grid (n_splits, n_kv_heads,
// n_tokens) depends on shapes only; each token's own visible length is cut into n_splits chunks
// in the kernel (paged_decode.cuh), so a captured graph stays valid as sequences grow. The last
// split of a (token, kv head) to finish merges the splits' partials (merge_splits), so no
// second launch is needed.
// paged_attention_split_mma: the split kernel on tensor cores, for f16 caches;
// paged_attention_split_mma_prologue the same taking the attention prologue (DecodePrologue).
// The prefill kernel (flash attention over the step's query tiles) is paged_prefill.cu.
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
#error "paged_attention.cu needs -DHEAD_DIM=<values per head>"
#endif
#ifndef GROUP
#error "paged_attention.cu needs -DGROUP=<query heads per kv head>"
#endif
#ifndef K_TYPE
#error "paged_attention.cu needs -DK_TYPE=<KV_F32|KV_F16|KV_Q8_0>"
#endif
#ifndef V_TYPE
#error "paged_attention.cu needs -DV_TYPE=<KV_F32|KV_F16|KV_Q8_0>"
#endif

#include "paged_decode.cuh"
#include "rope.cuh"

// Writes `out` directly where the token has one live split (alone_in_span), else unnormalized partials:
// part_acc[(row * n_splits + split) * HEAD_DIM + d] and part_ml[(row * n_splits + split) * 2 +
// {0: max (log2 units), 1: sum}], row = token * n_heads + head, that merge_splits combines;
// `tickets` holds n_tokens * n_kv_heads zeros; xq, xds, x_chunks: quantize_heads_out. Dynamic
// shared memory: the larger of DEC_STAGES * DEC_STAGE_BYTES and the merge's scratch.
extern "C" __global__ void __launch_bounds__(DEC_THREADS, 4) paged_attention_split(
    float* out, float* part_acc, float* part_ml, u32* tickets, const float* q, const u8* k_cache, const u8* v_cache,
    const u32* step, u32 n_heads, u32 n_kv_heads, u32 rows, float scale, u32 window, const float* sinks, i8* xq,
    float2* xds, u32 x_chunks) {
    wait_for_inputs();
    const u32 split = blockIdx.x;
    const u32 n_splits = gridDim.x;
    const u32 kv_head = blockIdx.y;
    const u32 token = blockIdx.z;
    const SplitRows split_rows = decode_split_rows(step, token, window, split, n_splits);
    if (split_rows.empty) {
        return;
    }
    const DecodeSpan span = split_rows.span;
    const bool alone = alone_in_span(span, n_splits);
    const u32 begin = split_rows.begin;
    const u32 end = split_rows.end;
    const u32* table = split_rows.table;
    const u32 n_tiles = (end - begin + DEC_TILE - 1) / DEC_TILE;
    const u32 width = n_kv_heads * HEAD_DIM;
    const u32 col0 = kv_head * HEAD_DIM;
    const u32 first_head = kv_head * GROUP;

    extern __shared__ uint4 dec_shared[];
    u8* stages = reinterpret_cast<u8*>(dec_shared);
    __shared__ u32 block_s[DEC_STAGES];
    __shared__ float p_s[GROUP][DEC_TILE];
    __shared__ float rescale_s[GROUP];
    __shared__ float max_s[GROUP];
    __shared__ float sum_s[GROUP];

    // Tile t goes to stage t % DEC_STAGES; block_s remembers its cache block for the q8 scales.
    auto issue = [&](u32 t, u32 block) {
        u8* dst = stages + (t % DEC_STAGES) * DEC_STAGE_BYTES;
        const u32 live_rows = min((u32)DEC_TILE, end - begin - t * DEC_TILE);
        if (threadIdx.x == 0) {
            block_s[t % DEC_STAGES] = block;
        }
        dec_issue<K_TYPE, K_ROW_BYTES, K_STRIDE>(dst, k_cache, block, width, col0, live_rows);
        dec_issue<V_TYPE, V_ROW_BYTES, V_STRIDE>(dst + DEC_TILE * K_STRIDE, v_cache, block, width, col0, live_rows);
    };
    // The first tiles' copies start before anything else, so q loads overlap them.
#pragma unroll
    for (int t = 0; t < DEC_STAGES - 1; ++t) {
        if (t < n_tiles) {
            issue(t, table[t]);
        }
        copy_commit();
    }
    // Block table entry of the next tile to issue, read one tile ahead to hide its latency.
    u32 pending = DEC_STAGES - 1 < n_tiles ? table[DEC_STAGES - 1] : 0;

    const u32 lane = threadIdx.x & 31;
    const u32 warp = threadIdx.x >> 5;
    const u32 team = lane / K_TEAM;
    const u32 team_lane = lane % K_TEAM;

    // q pre-scaled into log2 units, so the softmax runs on exp2.
    float q_r[GROUP][K_LANE_CHUNKS][K_VEC];
    const float q_scale = scale * LOG2E;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const float* q_row = q + ((u64)token * n_heads + first_head + g) * HEAD_DIM;
#pragma unroll
        for (int i = 0; i < K_LANE_CHUNKS; ++i) {
#pragma unroll
            for (int c = 0; c < K_VEC; ++c) {
                const u32 d = (i * K_TEAM + team_lane) * K_VEC + c;
                q_r[g][i][c] = d < HEAD_DIM ? q_row[d] * q_scale : 0.0f;
            }
        }
    }
    if (threadIdx.x < GROUP) {
        max_s[threadIdx.x] = NEG_INF;
        sum_s[threadIdx.x] = 0.0f;
    }
    const u32 dim_lane = threadIdx.x % V_DIM_THREADS;
    const u32 row_group = threadIdx.x / V_DIM_THREADS;
    // When V_DIM_THREADS does not divide DEC_THREADS the leftover threads only help with scores.
    const bool accumulates = threadIdx.x < V_ROW_GROUPS * V_DIM_THREADS;
    float acc[GROUP][V_CHUNKS][V_VEC];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
        for (int k = 0; k < V_CHUNKS; ++k) {
#pragma unroll
            for (int c = 0; c < V_VEC; ++c) {
                acc[g][k][c] = 0.0f;
            }
        }
    }

    for (u32 t = 0; t < n_tiles; ++t) {
        // Tile t has landed once at most DEC_STAGES - 2 later groups are pending; the barrier
        // also ends every thread's use of tile t - 1's stage, which the next copies refill.
        copy_wait<DEC_STAGES - 2>();
        __syncthreads();
        const u32 ahead = t + DEC_STAGES - 1;
        if (ahead < n_tiles) {
            issue(ahead, pending);
        }
        copy_commit();
        pending = ahead + 1 < n_tiles ? table[ahead + 1] : 0;

        const u8* k_tile = stages + (t % DEC_STAGES) * DEC_STAGE_BYTES;
        const u8* v_tile = k_tile + DEC_TILE * K_STRIDE;
        const u64 block_row = (u64)block_s[t % DEC_STAGES] * KV_BLOCK_SIZE;
        const u32 rows_here = min((u32)DEC_TILE, end - begin - t * DEC_TILE);

#pragma unroll
        for (int j0 = 0; j0 < DEC_TILE; j0 += K_PASS) {
            const u32 j_first = j0 + (warp * (32 / K_TEAM) + team) * K_ROWS;
            KvVec<K_TYPE, K_VEC> k_lane[K_ROWS][K_LANE_CHUNKS];
            float k_d[K_ROWS][K_LANE_CHUNKS];
#pragma unroll
            for (int r = 0; r < K_ROWS; ++r) {
                const u32 j = j_first + r;
#pragma unroll
                for (int i = 0; i < K_LANE_CHUNKS; ++i) {
                    const u32 d = (i * K_TEAM + team_lane) * K_VEC;
                    const bool live = j < rows_here && d < HEAD_DIM;
                    k_lane[r][i] = live ? kv_fetch<K_TYPE, K_VEC>(k_tile + j * K_STRIDE, d) : kv_zero<K_TYPE, K_VEC>();
                    k_d[r][i] = live ? kv_scale<K_TYPE>(k_cache, rows, width, block_row + j, col0 + d) : 0.0f;
                }
            }
#pragma unroll
            for (int r = 0; r < K_ROWS; ++r) {
                const u32 j = j_first + r;
#pragma unroll
                for (int g = 0; g < GROUP; ++g) {
                    float dot = 0.0f;
#pragma unroll
                    for (int i = 0; i < K_LANE_CHUNKS; ++i) {
                        float part = 0.0f;
#pragma unroll
                        for (int c = 0; c < K_VEC; ++c) {
                            part += q_r[g][i][c] * kv_value<K_TYPE, K_VEC>(k_lane[r][i], c);
                        }
                        dot += K_TYPE == KV_Q8_0 ? part * k_d[r][i] : part;
                    }
#pragma unroll
                    for (int offset = K_TEAM / 2; offset > 0; offset >>= 1) {
                        dot += __shfl_xor_sync(0xffffffffu, dot, offset);
                    }
                    if (team_lane == 0 && j < DEC_TILE) {
                        p_s[g][j] = j < rows_here && begin + t * DEC_TILE + j >= span.first ? dot : NEG_INF;
                    }
                }
            }
        }
        __syncthreads();

        // Online softmax: one warp per query head turns scores into weights and rescales.
        for (u32 g = warp; g < GROUP; g += DEC_WARPS) {
            float tile_max = NEG_INF;
            for (u32 j = lane; j < DEC_TILE; j += 32) {
                tile_max = fmaxf(tile_max, p_s[g][j]);
            }
            tile_max = warp_max(tile_max);
            const float old_max = max_s[g];
            const float new_max = fmaxf(old_max, tile_max);
            float tile_sum = 0.0f;
            for (u32 j = lane; j < DEC_TILE; j += 32) {
                const float p = exp2f(p_s[g][j] - new_max);
                p_s[g][j] = p;
                tile_sum += p;
            }
            tile_sum = warp_sum(tile_sum);
            __syncwarp();
            if (lane == 0) {
                const float rescale = exp2f(old_max - new_max);
                rescale_s[g] = rescale;
                sum_s[g] = sum_s[g] * rescale + tile_sum;
                max_s[g] = new_max;
            }
        }
        __syncthreads();

        if (accumulates) {
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                const float rescale = rescale_s[g];
#pragma unroll
                for (int k = 0; k < V_CHUNKS; ++k) {
#pragma unroll
                    for (int c = 0; c < V_VEC; ++c) {
                        acc[g][k][c] *= rescale;
                    }
                }
            }
#pragma unroll
            for (int s = 0; s < V_STEPS; ++s) {
                const u32 j = s * V_ROW_GROUPS + row_group;
                const bool live_row = j < rows_here;
#pragma unroll
                for (int k = 0; k < V_CHUNKS; ++k) {
                    const u32 d = (k * V_DIM_THREADS + dim_lane) * V_VEC;
                    const bool live = live_row && d < HEAD_DIM;
                    const KvVec<V_TYPE, V_VEC> v = live ? kv_fetch<V_TYPE, V_VEC>(v_tile + j * V_STRIDE, d) : kv_zero<V_TYPE, V_VEC>();
                    const float v_d = live ? kv_scale<V_TYPE>(v_cache, rows, width, block_row + j, col0 + d) : 0.0f;
#pragma unroll
                    for (int g = 0; g < GROUP; ++g) {
                        float p = live_row ? p_s[g][j] : 0.0f;
                        if (V_TYPE == KV_Q8_0) {
                            p *= v_d;
                        }
#pragma unroll
                        for (int c = 0; c < V_VEC; ++c) {
                            acc[g][k][c] += p * kv_value<V_TYPE, V_VEC>(v, c);
                        }
                    }
                }
            }
        }
    }

    if (V_ROW_GROUPS > 1) {
        // Row groups summed rows j = r mod V_ROW_GROUPS; add them up one query head at a time
        // (V_CHUNKS is 1 here, so a row group's values fill V_DIM_THREADS * V_VEC = HEAD_DIM slots).
        __shared__ float combine_s[V_ROW_GROUPS > 1 ? V_ROW_GROUPS : 1][V_DIM_THREADS * V_VEC];
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            if (accumulates) {
#pragma unroll
                for (int c = 0; c < V_VEC; ++c) {
                    combine_s[row_group][dim_lane * V_VEC + c] = acc[g][0][c];
                }
            }
            __syncthreads();
            if (row_group == 0) {
#pragma unroll
                for (int c = 0; c < V_VEC; ++c) {
                    float total = 0.0f;
                    for (int r = 0; r < V_ROW_GROUPS; ++r) {
                        total += combine_s[r][dim_lane * V_VEC + c];
                    }
                    acc[g][0][c] = total;
                }
            }
            __syncthreads();
        }
    }

    if (row_group == 0) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            const u64 row = (u64)token * n_heads + first_head + g;
            const u64 slot = row * n_splits + split;
            const float inv_sum =
                softmax_norm(max_s[g], sum_s[g], sinks ? sinks[first_head + g] * LOG2E : 0.0f, sinks != nullptr);
#pragma unroll
            for (int k = 0; k < V_CHUNKS; ++k) {
#pragma unroll
                for (int c = 0; c < V_VEC; ++c) {
                    const u32 d = (k * V_DIM_THREADS + dim_lane) * V_VEC + c;
                    if (d < HEAD_DIM) {
                        if (alone) {
                            out[row * HEAD_DIM + d] = acc[g][k][c] * inv_sum;
                        } else {
                            part_acc[slot * HEAD_DIM + d] = acc[g][k][c];
                        }
                    }
                }
            }
            if (!alone && threadIdx.x == 0) {
                part_ml[slot * 2] = max_s[g];
                part_ml[slot * 2 + 1] = sum_s[g];
            }
        }
    }
    if (!alone) {
        copy_wait<0>();
        merge_splits(out, part_acc, part_ml, tickets, span, token, kv_head, n_heads, n_kv_heads, n_splits, sinks,
                     reinterpret_cast<float*>(dec_shared), xq, xds, x_chunks);
    } else {
        quantize_heads_out(out, token, first_head, n_heads, xq, xds, x_chunks);
    }
}

// ---- The same on tensor cores, for f16 caches ----
//
// With f16 caches, HEAD_DIM a multiple of 16 (at most 128) and GROUP <= 8,
// paged_attention_split_mma replaces paged_attention_split (same grid, arguments and partials,
// blocks of WARPS warps; DEC_MMA in paged_decode.cuh).
// Each warp walks its own MD_ROWS-row tiles of the split's chunk (tiles w, w + WARPS, ...)
// through its own cp.async stages, so no block barrier stands in the loop; the warps' online
// softmaxes merge once at the end. S = Q K^T and O += P V run on mma.m16n8k16 with f32
// accumulation. The A operand's rows g < 8 hold query head g (then its weights) rounded to
// f16 and rows 8 + g what that rounding left over; a thread holds both rows' accumulators, and
// their sum is as exact as f32 arithmetic on the cache's own f16 values.
// Every specialization exports the kernel (with an empty body where it does not apply).
// Blocks of MD_WARPS_NARROW or MD_WARPS_WIDE warps (the `_wide` kernels). A wide block takes a
// span of up to 256 rows (DEC_MIN_CHUNK_MMA) in at most two tiles a warp, both copied before
// the first is scored, so a decode step of few tokens pays one load latency; with many tokens
// the grid fills the GPU anyway, and narrow blocks, two a multiprocessor, keep more of it busy.
#define MD_WARPS_NARROW 4
#define MD_WARPS_WIDE 8
#if DEC_MMA
#define MD_ROWS 16
#define MD_STAGES 3
// How far (log2 units) a head's scores may pass its kept max before O is rescaled.
#define MD_MAX_GROWTH 8.0f
// Halves per staged row: 16 bytes of padding put the 8 rows of an ldmatrix on distinct banks.
constexpr int MD_STRIDE = HEAD_DIM + 8;
// A stage: MD_ROWS K rows, then MD_ROWS V rows. Dynamic shared memory: DEC_THREADS / 32 warps
// x MD_STAGES stages (decode_shared_bytes in src/paged_attention.rs).
constexpr int MD_STAGE_HALVES = 2 * MD_ROWS * MD_STRIDE;

static_assert(KV_BLOCK_SIZE % MD_ROWS == 0, "a warp tile lies in one KV block");
static_assert(GROUP * HEAD_DIM * 4 + GROUP * 8 <= MD_STAGES * MD_STAGE_HALVES * 2, "the merge fits the stages");
#endif

// The attention prologue that paged_attention_split_mma_prologue takes over from
// qk_norm_rope_store (rope.cu), for decode steps of one token per sequence: q, k and v arrive
// as the projections left them ([n][n_heads][HEAD_DIM], [n][n_kv_heads][HEAD_DIM] twice).
// Every split block norms and ropes its GROUP query heads into shared memory; the split that
// holds the token's own position norms and ropes its key, stores key and value at the token's
// cache row, and writes both into its staged tile in place of the copy of that row, so no
// block waits for its own stores. Pointers into the caches as k_cache / v_cache (writable).
struct DecodePrologue {
    const float* k;
    const float* v;
    const float* q_norm;  // null: no q/k norms
    const float* k_norm;
    const float* inv_freq;
    u8* k_cache;
    u8* v_cache;
    u32 n_rot;
    u32 neox;
    float eps;
    u32 pad;
};

template <bool PROLOGUE, int WARPS>
__device__ __forceinline__ void split_mma(float* out, float* part_acc, float* part_ml, u32* tickets, const float* q,
                                          const u8* k_cache, const u8* v_cache, const u32* step, u32 n_heads,
                                          u32 n_kv_heads, float scale, u32 window, const float* sinks, i8* xq,
                                          float2* xds, u32 x_chunks, const DecodePrologue& pro) {
#if DEC_MMA
    constexpr int THREADS = WARPS * 32;
    // For one token, the o product after this kernel starts now and streams its weights
    // meanwhile (with more, its blocks would crowd the attention's).
    if (gridDim.z == 1) {
        start_dependents();
    }
    if constexpr (!PROLOGUE) {
        wait_for_inputs();
    }
    const u32 split = blockIdx.x;
    const u32 n_splits = gridDim.x;
    const u32 kv_head = blockIdx.y;
    const u32 token = blockIdx.z;
    const SplitRows split_rows = decode_split_rows(step, token, window, split, n_splits);
    if (split_rows.empty) {
        return;
    }
    const DecodeSpan span = split_rows.span;
    const bool alone = alone_in_span(span, n_splits);
    const u32 begin = split_rows.begin;
    const u32 end = split_rows.end;
    const u32* table = split_rows.table;
    const u32 n_tiles = (end - begin + MD_ROWS - 1) / MD_ROWS;
    const u32 width = n_kv_heads * HEAD_DIM;
    const u32 col0 = kv_head * HEAD_DIM;
    const u32 first_head = kv_head * GROUP;
    const u32 lane = threadIdx.x & 31;
    const u32 warp = threadIdx.x >> 5;
    const u32 g = lane >> 2;
    const u32 t = lane & 3;

    extern __shared__ uint4 dec_shared[];
    u16* stages = reinterpret_cast<u16*>(dec_shared) + warp * MD_STAGES * MD_STAGE_HALVES;
    const u32 my_tiles = warp < n_tiles ? (n_tiles - warp + WARPS - 1) / WARPS : 0;
    // Offset from `begin` of this warp's local tile i.
    auto tile_first = [&](u32 i) { return (warp + i * WARPS) * MD_ROWS; };
    auto issue = [&](u32 i, u32 block) {
        constexpr int ROW_UNITS = HEAD_DIM / 8;
        constexpr int UNITS = MD_ROWS * ROW_UNITS;
        const u32 first = tile_first(i);
        const u32 live = min((u32)MD_ROWS, end - begin - first);
        const u64 row0 = (u64)block * KV_BLOCK_SIZE + first % KV_BLOCK_SIZE;
        u16* dst = stages + (i % MD_STAGES) * MD_STAGE_HALVES;
        if constexpr (32 % ROW_UNITS == 0) {
            // Lane l copies unit l % ROW_UNITS of rows l / ROW_UNITS + k PASS_ROWS: one address
            // each, then steps of PASS_ROWS rows.
            constexpr u32 PASS_ROWS = 32 / ROW_UNITS;
            const u32 j0 = lane / ROW_UNITS, c = lane % ROW_UNITS * 8;
            const u64 at = ((row0 + j0) * width + col0 + c) * 2;
            const u64 pass_bytes = (u64)PASS_ROWS * width * 2;
            const u8* k_src = k_cache + at;
            const u8* v_src = v_cache + at;
            const u32 k_dst = shared_address(dst + j0 * MD_STRIDE + c);
#pragma unroll
            for (u32 pass = 0; pass < MD_ROWS / PASS_ROWS; ++pass) {
                const bool in = j0 + pass * PASS_ROWS < live;
                copy_async16(k_dst + 2 * pass * PASS_ROWS * MD_STRIDE, k_src, in);
                copy_async16(k_dst + 2 * (MD_ROWS + pass * PASS_ROWS) * MD_STRIDE, v_src, in);
                k_src += pass_bytes;
                v_src += pass_bytes;
            }
        } else {
#pragma unroll
            for (int u0 = 0; u0 < UNITS; u0 += 32) {
                const u32 u = u0 + lane;
                const u32 j = u / ROW_UNITS;
                const u32 c = u % ROW_UNITS * 8;
                const u64 at = ((row0 + j) * width + col0 + c) * 2;
                copy_async<16>(dst + j * MD_STRIDE + c, k_cache + at, j < live);
                copy_async<16>(dst + (MD_ROWS + j) * MD_STRIDE + c, v_cache + at, j < live);
            }
        }
    };
    auto block_of = [&](u32 i) { return table[tile_first(i) / KV_BLOCK_SIZE]; };
#pragma unroll
    for (int i = 0; i < MD_STAGES - 1; ++i) {
        if (i < my_tiles) {
            issue(i, block_of(i));
        }
        copy_commit();
    }
    u32 pending = MD_STAGES - 1 < my_tiles ? block_of(MD_STAGES - 1) : 0;
    // With the prologue, no kernel of this step writes the step block or the rows copied so far
    // (the token's own row is replaced below), so they were fetched before q, k and v are ready.
    if constexpr (PROLOGUE) {
        wait_for_inputs();
    }

    // With the prologue: the GROUP query heads normed and roped, then (in the split holding the
    // token's position) its key and value, one warp a row.
    __shared__ __align__(16) float prologue_s[PROLOGUE ? (GROUP + 2) * HEAD_DIM : 4];
    const u32 own_pos = span.end - 1;
    const bool stores = PROLOGUE && end == span.end;
    if constexpr (PROLOGUE) {
        const HeadPrologue roped{pro.q_norm, pro.eps, pro.n_rot, pro.neox, own_pos, pro.inv_freq};
        const u64 kv_row = (u64)token * n_kv_heads + kv_head;
        for (u32 r = warp; r < GROUP + (stores ? 2 : 0); r += WARPS) {
            HeadPrologue how = roped;
            const float* src = q + ((u64)token * n_heads + first_head + r) * HEAD_DIM;
            if (r == GROUP) {
                how.norm = pro.k_norm;
                src = pro.k + kv_row * HEAD_DIM;
            } else if (r == GROUP + 1) {
                how.norm = nullptr;
                how.n_rot = 0;
                src = pro.v + kv_row * HEAD_DIM;
            }
            prepare_head_row(prologue_s + r * HEAD_DIM, src, HEAD_DIM, how);
        }
        __syncthreads();
        if (stores) {
            const u64 cache_at = step[step[STEP_SLOT_AT] + token];
            for (u32 d = threadIdx.x; d < HEAD_DIM; d += THREADS) {
                kv_store_float<KV_F16>(pro.k_cache, width, cache_at, col0 + d, prologue_s[GROUP * HEAD_DIM + d]);
                kv_store_float<KV_F16>(pro.v_cache, width, cache_at, col0 + d, prologue_s[(GROUP + 1) * HEAD_DIM + d]);
            }
        }
    }

    // Q fragments (A operand, k step kc): rows g, pre-scaled into log2 units; heads past GROUP
    // are zeros and never written.
    constexpr int KSTEPS = HEAD_DIM / 16;
    u32 qa[KSTEPS][4];
    {
        const float q_scale = scale * LOG2E;
        const bool head_live = g < GROUP;
        const float* q_row = PROLOGUE ? prologue_s + (head_live ? g : 0) * HEAD_DIM
                                      : q + ((u64)token * n_heads + first_head + (head_live ? g : 0)) * HEAD_DIM;
#pragma unroll
        for (int kc = 0; kc < KSTEPS; ++kc) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float2 x = head_live ? *reinterpret_cast<const float2*>(q_row + kc * 16 + h * 8 + 2 * t) : make_float2(0.0f, 0.0f);
                split_f16x2(x.x * q_scale, x.y * q_scale, qa[kc][2 * h], qa[kc][2 * h + 1]);
            }
        }
    }

    float o[HEAD_DIM / 8][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; ++n) {
        o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    }
    // Running max (log2 units) and this lane's part of the sum, for head g.
    float m = NEG_INF;
    float l = 0.0f;

    for (u32 i = 0; i < my_tiles; ++i) {
        // Tile i has landed; the barrier also ends the lanes' reads of tile i - 1's stage,
        // which the next copies refill.
        copy_wait<MD_STAGES - 2>();
        __syncwarp();
        const u32 ahead = i + MD_STAGES - 1;
        if (ahead < my_tiles) {
            issue(ahead, pending);
        }
        copy_commit();
        pending = ahead + 1 < my_tiles ? block_of(ahead + 1) : 0;

        u16* k_s = stages + (i % MD_STAGES) * MD_STAGE_HALVES;
        u16* v_s = k_s + MD_ROWS * MD_STRIDE;
        const u32 pos0 = begin + tile_first(i);
        if (stores && own_pos - pos0 < MD_ROWS) {
            // The token's own row: its key and value as stored, not the copy racing the store.
            for (u32 d = lane; d < HEAD_DIM; d += 32) {
                k_s[(own_pos - pos0) * MD_STRIDE + d] = f32_to_f16_bits(prologue_s[GROUP * HEAD_DIM + d]);
                v_s[(own_pos - pos0) * MD_STRIDE + d] = f32_to_f16_bits(prologue_s[(GROUP + 1) * HEAD_DIM + d]);
            }
            __syncwarp();
        }

        // S: n tile n covers the tile's rows 8n..8n+7; ldmatrix matrix (lane / 8) is rows
        // 8 * (lane / 16).., dims 8 * (lane / 8 % 2).. of the k step.
        float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
        const u16* k_lane = k_s + ((lane >> 4) * 8 + (lane & 7)) * MD_STRIDE + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int kc = 0; kc < KSTEPS; ++kc) {
            u32 b[4];
            ldmatrix_x4(b, k_lane + kc * 16);
            mma_f16(s[0], qa[kc], b[0], b[1]);
            mma_f16(s[1], qa[kc], b[2], b[3]);
        }

        // Scores of head g at rows 8n + 2t + e; positions outside the span (and the zero rows
        // past its end) are masked.
        float p[2][2];
        float tile_max = NEG_INF;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const u32 pos = pos0 + n * 8 + 2 * t + e;
                p[n][e] = pos < end && pos >= span.first ? s[n][e] + s[n][2 + e] : NEG_INF;
                tile_max = fmaxf(tile_max, p[n][e]);
            }
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
        // The running max moves, and O and the sum are rescaled, only when some head's scores
        // pass it by more than MD_MAX_GROWTH (log2 units): at long context it rarely does, and
        // the weights below the kept max stay under 2^MD_MAX_GROWTH, which the f32 sums and the
        // split f16 weights hold to the same relative precision. A head that has seen no visible
        // position yet keeps a max of -inf and is offset by 0, so its weights and rescale are 0.
        if (__any_sync(0xffffffffu, tile_max > m + MD_MAX_GROWTH)) {
            const float new_max = fmaxf(m, tile_max);
            const float alpha = exp2f(m - (new_max == NEG_INF ? 0.0f : new_max));
            m = new_max;
            l *= alpha;
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; ++n) {
                o[n][0] *= alpha;
                o[n][1] *= alpha;
                o[n][2] *= alpha;
                o[n][3] *= alpha;
            }
        }
        const float base = m == NEG_INF ? 0.0f : m;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                p[n][e] = exp2f(p[n][e] - base);
                l += p[n][e];
            }
        }

        // O += P V: the weights of n tiles 0 and 1 are the A operand's k = 0..7 and 8..15.
        u32 a[4];
        split_f16x2(p[0][0], p[0][1], a[0], a[1]);
        split_f16x2(p[1][0], p[1][1], a[2], a[3]);
        const u16* v_lane = v_s + ((lane & 7) + ((lane >> 3) & 1) * 8) * MD_STRIDE + (lane >> 4) * 8;
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 8; n += 2) {
            u32 b[4];
            ldmatrix_x4_trans(b, v_lane + n * 8);
            mma_f16(o[n], a, b[0], b[1]);
            mma_f16(o[n + 1], a, b[2], b[3]);
        }
    }

    // Merge the warps: each writes its unnormalized values, max and sum per head to the
    // (drained) stages, then every thread combines some (head, dim) slots.
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    copy_wait<0>();
    __syncthreads();
    float* o_s = reinterpret_cast<float*>(dec_shared);
    float* ml_s = o_s + WARPS * GROUP * HEAD_DIM;
    if (g < GROUP) {
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 8; ++n) {
            float* dst = o_s + (warp * GROUP + g) * HEAD_DIM + n * 8 + 2 * t;
            *reinterpret_cast<float2*>(dst) = make_float2(o[n][0] + o[n][2], o[n][1] + o[n][3]);
        }
        if (t == 0) {
            ml_s[(warp * GROUP + g) * 2] = m;
            ml_s[(warp * GROUP + g) * 2 + 1] = l;
        }
    }
    __syncthreads();
    for (u32 index = threadIdx.x; index < GROUP * HEAD_DIM; index += THREADS) {
        const u32 h = index / HEAD_DIM;
        const u32 d = index % HEAD_DIM;
        float top = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            top = fmaxf(top, ml_s[(w * GROUP + h) * 2]);
        }
        float value = 0.0f;
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float wm = ml_s[(w * GROUP + h) * 2];
            const float weight = wm == NEG_INF ? 0.0f : exp2f(wm - top);
            value += o_s[(w * GROUP + h) * HEAD_DIM + d] * weight;
            sum += ml_s[(w * GROUP + h) * 2 + 1] * weight;
        }
        const u64 row = (u64)token * n_heads + first_head + h;
        if (alone) {
            const float result = value * softmax_norm(top, sum, sinks ? sinks[first_head + h] * LOG2E : 0.0f, sinks != nullptr);
            out[row * HEAD_DIM + d] = result;
            // Warp 0's slot of (h, d), which no other thread reads: the quantization's source.
            o_s[h * HEAD_DIM + d] = result;
        } else {
            const u64 slot = row * n_splits + split;
            part_acc[slot * HEAD_DIM + d] = value;
            if (d == 0) {
                part_ml[slot * 2] = top;
                part_ml[slot * 2 + 1] = sum;
            }
        }
    }
    if (!alone) {
        // The barrier in merge_splits also ends every thread's reads of o_s and ml_s.
        merge_splits<THREADS>(out, part_acc, part_ml, tickets, span, token, kv_head, n_heads, n_kv_heads, n_splits, sinks,
                     reinterpret_cast<float*>(dec_shared), xq, xds, x_chunks);
    } else {
        quantize_head_rows<THREADS>(o_s, token, first_head, xq, xds, x_chunks);
    }
#endif
}

extern "C" __global__ void __launch_bounds__(MD_WARPS_NARROW * 32, 2) paged_attention_split_mma(
    float* out, float* part_acc, float* part_ml, u32* tickets, const float* q, const u8* k_cache, const u8* v_cache,
    const u32* step, u32 n_heads, u32 n_kv_heads, u32 rows, float scale, u32 window, const float* sinks, i8* xq,
    float2* xds, u32 x_chunks) {
    split_mma<false, MD_WARPS_NARROW>(out, part_acc, part_ml, tickets, q, k_cache, v_cache, step, n_heads, n_kv_heads,
                                  scale, window, sinks, xq, xds, x_chunks, DecodePrologue{});
}

// paged_attention_split_mma with the attention prologue (DecodePrologue): q is unroped.
extern "C" __global__ void __launch_bounds__(MD_WARPS_NARROW * 32, 2) paged_attention_split_mma_prologue(
    float* out, float* part_acc, float* part_ml, u32* tickets, const float* q, const u8* k_cache, const u8* v_cache,
    const u32* step, u32 n_heads, u32 n_kv_heads, u32 rows, float scale, u32 window, const float* sinks, i8* xq,
    float2* xds, u32 x_chunks, DecodePrologue pro) {
    split_mma<true, MD_WARPS_NARROW>(out, part_acc, part_ml, tickets, q, k_cache, v_cache, step, n_heads, n_kv_heads,
                                  scale, window, sinks, xq, xds, x_chunks, pro);
}

// The same in wide blocks.
extern "C" __global__ void __launch_bounds__(MD_WARPS_WIDE * 32, 1) paged_attention_split_mma_wide(
    float* out, float* part_acc, float* part_ml, u32* tickets, const float* q, const u8* k_cache, const u8* v_cache,
    const u32* step, u32 n_heads, u32 n_kv_heads, u32 rows, float scale, u32 window, const float* sinks, i8* xq,
    float2* xds, u32 x_chunks) {
    split_mma<false, MD_WARPS_WIDE>(out, part_acc, part_ml, tickets, q, k_cache, v_cache, step, n_heads, n_kv_heads,
                                  scale, window, sinks, xq, xds, x_chunks, DecodePrologue{});
}

extern "C" __global__ void __launch_bounds__(MD_WARPS_WIDE * 32, 1) paged_attention_split_mma_prologue_wide(
    float* out, float* part_acc, float* part_ml, u32* tickets, const float* q, const u8* k_cache, const u8* v_cache,
    const u32* step, u32 n_heads, u32 n_kv_heads, u32 rows, float scale, u32 window, const float* sinks, i8* xq,
    float2* xds, u32 x_chunks, DecodePrologue pro) {
    split_mma<true, MD_WARPS_WIDE>(out, part_acc, part_ml, tickets, q, k_cache, v_cache, step, n_heads, n_kv_heads,
                                  scale, window, sinks, xq, xds, x_chunks, pro);
}
