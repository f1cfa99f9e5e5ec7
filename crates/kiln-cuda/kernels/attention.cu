// Causal grouped-query attention over the KV cache, split along the cache (flash-decoding):
// attention_split_f32 computes, per (split, kv head, token), an unnormalized partial result
// for the GROUP query heads sharing that kv head; attention_reduce_f32 merges the splits.
// The grid is fixed by the host (n_splits, n_kv_heads, n_tokens); the length each split
// covers is computed here from the step's position, so a captured graph stays valid as the
// cache fills, and splits past the live length exit at once.
//
// Shapes: q and out are [n_tokens][n_heads][HEAD_DIM]; the caches are [rows][n_kv_heads][HEAD_DIM];
// query head h reads kv head h / GROUP. Token t (at pos0 + t) sees cache rows 0..=pos0 + t.
// kiln-test-defines: HEAD_DIM=8,GROUP=2
// kiln-test-defines: HEAD_DIM=64,GROUP=1
// kiln-test-defines: HEAD_DIM=128,GROUP=8
// kiln-test-defines: HEAD_DIM=256,GROUP=4
// kiln-test-defines: HEAD_DIM=80,GROUP=7
// kiln-test-defines: HEAD_DIM=4,GROUP=1
#include "common.cuh"
#include "step.cuh"

#ifndef HEAD_DIM
#error "attention.cu needs -DHEAD_DIM=<values per head>"
#endif
#ifndef GROUP
#error "attention.cu needs -DGROUP=<query heads per kv head>"
#endif

#define ATT_THREADS 128
#define ATT_WARPS (ATT_THREADS / 32)
// Cache rows scored per shared-memory pass.
#define TILE 64
// A split never covers fewer rows than this, so short contexts use few splits.
#define MIN_CHUNK 32
// Most splits attention_reduce_f32 accepts (the host never launches more).
#define MAX_SPLITS 256
// Splits whose partials attention_reduce_f32 loads together.
#define REDUCE_BATCH 16
// Lanes that share one row's dot products: a power of two dividing 32.
#define TEAM (HEAD_DIM >= 32 ? 32 : HEAD_DIM >= 16 ? 16 : HEAD_DIM >= 8 ? 8 : HEAD_DIM >= 4 ? 4 : HEAD_DIM >= 2 ? 2 : 1)
#define TEAMS_PER_WARP (32 / TEAM)
// Rows each team scores per pass, and the K values each lane holds per row (VEC-wide loads).
#define ROWS_PER_TEAM (TILE / (ATT_WARPS * TEAMS_PER_WARP) < 8 ? TILE / (ATT_WARPS * TEAMS_PER_WARP) : 8)
#define VEC (HEAD_DIM % (4 * TEAM) == 0 ? 4 : HEAD_DIM % (2 * TEAM) == 0 ? 2 : 1)
#define LANE_CHUNKS ((HEAD_DIM + VEC * TEAM - 1) / (VEC * TEAM))
// The V pass: DIM_THREADS threads cover one row in V_VEC-wide loads (V_CHUNKS each), and
// ROW_GROUPS rows go side by side.
#define V_VEC (HEAD_DIM % 4 == 0 ? 4 : HEAD_DIM % 2 == 0 ? 2 : 1)
#define DIM_THREADS (HEAD_DIM / V_VEC < ATT_THREADS ? HEAD_DIM / V_VEC : ATT_THREADS)
#define ROW_GROUPS (ATT_THREADS / DIM_THREADS)
#define V_CHUNKS ((HEAD_DIM + V_VEC * DIM_THREADS - 1) / (V_VEC * DIM_THREADS))
#define V_STEPS ((TILE + ROW_GROUPS - 1) / ROW_GROUPS)
#define NEG_INF __int_as_float(0xff800000)

static_assert(TILE % (ATT_WARPS * TEAMS_PER_WARP * ROWS_PER_TEAM) == 0, "the score loop must tile TILE exactly");

// VEC consecutive floats from `src` (aligned to VEC floats), or zeros when `live` is false.
template <int N>
__device__ __forceinline__ void load_or_zero(float* dst, const float* src, bool live) {
    if (N == 4) {
        const float4 v = live ? *reinterpret_cast<const float4*>(src) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        dst[0] = v.x;
        dst[1] = v.y;
        dst[2] = v.z;
        dst[3] = v.w;
    } else if (N == 2) {
        const float2 v = live ? *reinterpret_cast<const float2*>(src) : make_float2(0.0f, 0.0f);
        dst[0] = v.x;
        dst[1] = v.y;
    } else {
        dst[0] = live ? *src : 0.0f;
    }
}

// Rows per split for a cache holding kv_len live rows; both kernels must agree on it.
__device__ __forceinline__ u32 split_rows(u32 kv_len, u32 n_splits) {
    return max((kv_len + n_splits - 1) / n_splits, (u32)MIN_CHUNK);
}

// Writes `out` directly when launched with one split, else the partials:
// part_acc[(row * n_splits + split) * HEAD_DIM + d] and part_ml[(row * n_splits + split) * 2 + {0: max, 1: sum}],
// row = token * n_heads + head.
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 4) attention_split_f32(
    float* out, float* part_acc, float* part_ml, const float* q, const float* k_cache, const float* v_cache,
    const u32* step, u32 n_tokens, u32 n_heads, u32 n_kv_heads, u32 cache_rows, float scale) {
    const u32 split = blockIdx.x;
    const u32 n_splits = gridDim.x;
    const u32 kv_head = blockIdx.y;
    const u32 token = blockIdx.z;
    const u32 pos0 = step[STEP_POS0];
    const u32 visible = min(pos0 + token + 1, cache_rows);
    const u32 chunk = split_rows(min(pos0 + n_tokens, cache_rows), n_splits);
    const u32 begin = split * chunk;
    if (begin >= visible) {
        return;
    }
    const u32 end = min(begin + chunk, visible);
    const u32 kv_width = n_kv_heads * HEAD_DIM;
    const u32 first_head = kv_head * GROUP;

    __shared__ float q_s[GROUP][HEAD_DIM];
    __shared__ float p_s[GROUP][TILE];
    __shared__ float rescale_s[GROUP];
    __shared__ float max_s[GROUP];
    __shared__ float sum_s[GROUP];

    const float* q_rows = q + ((u64)token * n_heads + first_head) * HEAD_DIM;
    for (u32 i = threadIdx.x; i < GROUP * HEAD_DIM; i += ATT_THREADS) {
        q_s[i / HEAD_DIM][i % HEAD_DIM] = q_rows[i];
    }
    if (threadIdx.x < GROUP) {
        max_s[threadIdx.x] = NEG_INF;
        sum_s[threadIdx.x] = 0.0f;
    }
    const u32 lane = threadIdx.x & 31;
    const u32 warp = threadIdx.x >> 5;
    const u32 team = lane / TEAM;
    const u32 team_lane = lane % TEAM;
    const u32 dim_lane = threadIdx.x % DIM_THREADS;
    const u32 row_group = threadIdx.x / DIM_THREADS;
    // When DIM_THREADS does not divide ATT_THREADS the leftover threads only help with scores.
    const bool accumulates = threadIdx.x < ROW_GROUPS * DIM_THREADS;
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
    __syncthreads();

    for (u32 tile = begin; tile < end; tile += TILE) {
        // Scores of this tile's rows for every query head of the group. Each team loads
        // ROWS_PER_TEAM rows before reducing, so several loads per lane are in flight.
        for (u32 j0 = 0; j0 < TILE; j0 += ATT_WARPS * TEAMS_PER_WARP * ROWS_PER_TEAM) {
            const u32 j_first = j0 + (warp * TEAMS_PER_WARP + team) * ROWS_PER_TEAM;
            float k_lane[ROWS_PER_TEAM][LANE_CHUNKS][VEC];
#pragma unroll
            for (int r = 0; r < ROWS_PER_TEAM; ++r) {
                const u32 pos = tile + j_first + r;
                const float* k_row = k_cache + (u64)pos * kv_width + kv_head * HEAD_DIM;
#pragma unroll
                for (int i = 0; i < LANE_CHUNKS; ++i) {
                    const u32 d = (i * TEAM + team_lane) * VEC;
                    load_or_zero<VEC>(k_lane[r][i], k_row + d, pos < end && d < HEAD_DIM);
                }
            }
#pragma unroll
            for (int r = 0; r < ROWS_PER_TEAM; ++r) {
#pragma unroll
                for (int g = 0; g < GROUP; ++g) {
                    float dot = 0.0f;
#pragma unroll
                    for (int i = 0; i < LANE_CHUNKS; ++i) {
                        const u32 d = (i * TEAM + team_lane) * VEC;
#pragma unroll
                        for (int c = 0; c < VEC; ++c) {
                            if (d + c < HEAD_DIM) {
                                dot += q_s[g][d + c] * k_lane[r][i][c];
                            }
                        }
                    }
#pragma unroll
                    for (int offset = TEAM / 2; offset > 0; offset >>= 1) {
                        dot += __shfl_xor_sync(0xffffffffu, dot, offset);
                    }
                    if (team_lane == 0) {
                        p_s[g][j_first + r] = tile + j_first + r < end ? dot * scale : NEG_INF;
                    }
                }
            }
        }
        __syncthreads();

        // Online softmax: one warp per query head turns scores into weights and rescales.
        for (u32 g = warp; g < GROUP; g += ATT_WARPS) {
            float tile_max = NEG_INF;
            for (u32 j = lane; j < TILE; j += 32) {
                tile_max = fmaxf(tile_max, p_s[g][j]);
            }
            tile_max = warp_max(tile_max);
            const float old_max = max_s[g];
            const float new_max = fmaxf(old_max, tile_max);
            float tile_sum = 0.0f;
            for (u32 j = lane; j < TILE; j += 32) {
                const float p = expf(p_s[g][j] - new_max);
                p_s[g][j] = p;
                tile_sum += p;
            }
            tile_sum = warp_sum(tile_sum);
            __syncwarp();
            if (lane == 0) {
                const float rescale = expf(old_max - new_max);
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
            // A fixed trip count with predicated loads, so several rows' loads are in flight;
            // rows past the end load zeros and carry zero weight.
            const u32 rows_here = min((u32)TILE, end - tile);
#pragma unroll 8
            for (int step = 0; step < V_STEPS; ++step) {
                const u32 j = step * ROW_GROUPS + row_group;
                const bool live = j < rows_here;
                const float* v_row = v_cache + (u64)(tile + j) * kv_width + kv_head * HEAD_DIM;
#pragma unroll
                for (int k = 0; k < V_CHUNKS; ++k) {
                    const u32 d = (k * DIM_THREADS + dim_lane) * V_VEC;
                    float v[V_VEC];
                    load_or_zero<V_VEC>(v, v_row + d, live && d < HEAD_DIM);
#pragma unroll
                    for (int g = 0; g < GROUP; ++g) {
                        const float p = live ? p_s[g][j] : 0.0f;
#pragma unroll
                        for (int c = 0; c < V_VEC; ++c) {
                            acc[g][k][c] += p * v[c];
                        }
                    }
                }
            }
        }
        __syncthreads();
    }

#if ROW_GROUPS > 1
    // Row groups summed rows j = r mod ROW_GROUPS; add them up, one query head at a time
    // (here V_CHUNKS is 1, so a row group's values fill DIM_THREADS * V_VEC = HEAD_DIM slots).
    __shared__ float combine_s[ROW_GROUPS][DIM_THREADS * V_VEC];
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
                for (int r = 0; r < ROW_GROUPS; ++r) {
                    total += combine_s[r][dim_lane * V_VEC + c];
                }
                acc[g][0][c] = total;
            }
        }
        __syncthreads();
    }
#endif

    if (row_group != 0) {
        return;
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const u64 row = (u64)token * n_heads + first_head + g;
        const u64 slot = row * n_splits + split;
#pragma unroll
        for (int k = 0; k < V_CHUNKS; ++k) {
#pragma unroll
            for (int c = 0; c < V_VEC; ++c) {
                const u32 d = (k * DIM_THREADS + dim_lane) * V_VEC + c;
                if (d < HEAD_DIM) {
                    if (n_splits == 1) {
                        out[row * HEAD_DIM + d] = acc[g][k][c] / sum_s[g];
                    } else {
                        part_acc[slot * HEAD_DIM + d] = acc[g][k][c];
                    }
                }
            }
        }
        if (n_splits > 1 && threadIdx.x == 0) {
            part_ml[slot * 2] = max_s[g];
            part_ml[slot * 2 + 1] = sum_s[g];
        }
    }
}

// Merges the live splits of each (token, head). Grid (n_heads, n_tokens), ATT_THREADS threads.
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_reduce_f32(
    float* out, const float* part_acc, const float* part_ml, const u32* step, u32 n_tokens, u32 n_heads,
    u32 cache_rows, u32 n_splits) {
    const u32 head = blockIdx.x;
    const u32 token = blockIdx.y;
    const u32 pos0 = step[STEP_POS0];
    const u32 visible = min(pos0 + token + 1, cache_rows);
    const u32 chunk = split_rows(min(pos0 + n_tokens, cache_rows), n_splits);
    const u32 live = min((visible + chunk - 1) / chunk, min(n_splits, (u32)MAX_SPLITS));
    const u64 row = (u64)token * n_heads + head;
    const float* ml = part_ml + row * n_splits * 2;

    // Every split's (max, sum) is read once, in parallel: a serial walk would pay one memory
    // latency per split.
    __shared__ float max_s[MAX_SPLITS];
    __shared__ float weight_s[MAX_SPLITS];
    for (u32 s = threadIdx.x; s < live; s += ATT_THREADS) {
        max_s[s] = ml[s * 2];
    }
    __syncthreads();
    float max_value = NEG_INF;
    for (u32 s = 0; s < live; ++s) {
        max_value = fmaxf(max_value, max_s[s]);
    }
    float sum = 0.0f;
    for (u32 s = threadIdx.x; s < live; s += ATT_THREADS) {
        const float weight = expf(max_s[s] - max_value);
        weight_s[s] = weight;
        sum += ml[s * 2 + 1] * weight;
    }
    const float total = block_sum<ATT_THREADS>(sum);
    for (u32 d = threadIdx.x; d < HEAD_DIM; d += ATT_THREADS) {
        const float* column = part_acc + row * n_splits * HEAD_DIM + d;
        float value = 0.0f;
        u32 s = 0;
        // Batches of independent loads, so REDUCE_BATCH splits are in flight at once.
        for (; s + REDUCE_BATCH <= live; s += REDUCE_BATCH) {
            float batch[REDUCE_BATCH];
#pragma unroll
            for (int u = 0; u < REDUCE_BATCH; ++u) {
                batch[u] = column[(u64)(s + u) * HEAD_DIM];
            }
#pragma unroll
            for (int u = 0; u < REDUCE_BATCH; ++u) {
                value += batch[u] * weight_s[s + u];
            }
        }
        for (; s < live; ++s) {
            value += column[(u64)s * HEAD_DIM] * weight_s[s];
        }
        out[row * HEAD_DIM + d] = value / total;
    }
}
