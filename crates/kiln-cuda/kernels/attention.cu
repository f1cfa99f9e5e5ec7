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
// Lanes that share one row's dot products: a power of two dividing 32.
#define TEAM (HEAD_DIM >= 32 ? 32 : HEAD_DIM >= 16 ? 16 : HEAD_DIM >= 8 ? 8 : HEAD_DIM >= 4 ? 4 : HEAD_DIM >= 2 ? 2 : 1)
#define TEAMS_PER_WARP (32 / TEAM)
// The V pass: DIM_THREADS threads cover one row's values, ROW_GROUPS rows go side by side.
#define DIM_THREADS (HEAD_DIM < ATT_THREADS ? HEAD_DIM : ATT_THREADS)
#define ROW_GROUPS (ATT_THREADS / DIM_THREADS)
#define DIMS_PER_THREAD ((HEAD_DIM + ATT_THREADS - 1) / ATT_THREADS)
#define NEG_INF __int_as_float(0xff800000)

static_assert(TILE % (ATT_WARPS * TEAMS_PER_WARP) == 0, "the score loop must tile TILE exactly");

// Rows per split for a cache holding kv_len live rows; both kernels must agree on it.
__device__ __forceinline__ u32 split_rows(u32 kv_len, u32 n_splits) {
    return max((kv_len + n_splits - 1) / n_splits, (u32)MIN_CHUNK);
}

// Writes `out` directly when launched with one split, else the partials:
// part_acc[(row * n_splits + split) * HEAD_DIM + d] and part_ml[(row * n_splits + split) * 2 + {0: max, 1: sum}],
// row = token * n_heads + head.
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_split_f32(
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
    float acc[GROUP][DIMS_PER_THREAD];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
        for (int k = 0; k < DIMS_PER_THREAD; ++k) {
            acc[g][k] = 0.0f;
        }
    }
    __syncthreads();

    for (u32 tile = begin; tile < end; tile += TILE) {
        // Scores of this tile's rows for every query head of the group.
        for (u32 j0 = 0; j0 < TILE; j0 += ATT_WARPS * TEAMS_PER_WARP) {
            const u32 j = j0 + warp * TEAMS_PER_WARP + team;
            const u32 pos = tile + j;
            const bool live = pos < end;
            float dot[GROUP];
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                dot[g] = 0.0f;
            }
            if (live) {
                const float* k_row = k_cache + (u64)pos * kv_width + kv_head * HEAD_DIM;
                for (u32 d = team_lane; d < HEAD_DIM; d += TEAM) {
                    const float kd = k_row[d];
#pragma unroll
                    for (int g = 0; g < GROUP; ++g) {
                        dot[g] += q_s[g][d] * kd;
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
#pragma unroll
                for (int offset = TEAM / 2; offset > 0; offset >>= 1) {
                    dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], offset);
                }
                if (team_lane == 0) {
                    p_s[g][j] = live ? dot[g] * scale : NEG_INF;
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
                for (int k = 0; k < DIMS_PER_THREAD; ++k) {
                    acc[g][k] *= rescale;
                }
            }
            for (u32 j = row_group; j < TILE && tile + j < end; j += ROW_GROUPS) {
                const float* v_row = v_cache + (u64)(tile + j) * kv_width + kv_head * HEAD_DIM;
#pragma unroll
                for (int k = 0; k < DIMS_PER_THREAD; ++k) {
                    const u32 d = dim_lane + k * ATT_THREADS;
                    if (d < HEAD_DIM) {
                        const float vd = v_row[d];
#pragma unroll
                        for (int g = 0; g < GROUP; ++g) {
                            acc[g][k] += p_s[g][j] * vd;
                        }
                    }
                }
            }
        }
        __syncthreads();
    }

#if ROW_GROUPS > 1
    // Row groups summed rows j = r mod ROW_GROUPS; add them up (here DIMS_PER_THREAD is 1).
    __shared__ float combine_s[ROW_GROUPS][GROUP][DIM_THREADS];
    if (accumulates) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            combine_s[row_group][g][dim_lane] = acc[g][0];
        }
    }
    __syncthreads();
    if (row_group == 0) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float total = 0.0f;
            for (int r = 0; r < ROW_GROUPS; ++r) {
                total += combine_s[r][g][dim_lane];
            }
            acc[g][0] = total;
        }
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
        for (int k = 0; k < DIMS_PER_THREAD; ++k) {
            const u32 d = dim_lane + k * ATT_THREADS;
            if (d < HEAD_DIM) {
                if (n_splits == 1) {
                    out[row * HEAD_DIM + d] = acc[g][k] / sum_s[g];
                } else {
                    part_acc[slot * HEAD_DIM + d] = acc[g][k];
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

    __shared__ float weight_s[MAX_SPLITS];
    __shared__ float total_s;
    float max_value = NEG_INF;
    for (u32 s = 0; s < live; ++s) {
        max_value = fmaxf(max_value, ml[s * 2]);
    }
    for (u32 s = threadIdx.x; s < live; s += ATT_THREADS) {
        weight_s[s] = expf(ml[s * 2] - max_value);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (u32 s = 0; s < live; ++s) {
            total += ml[s * 2 + 1] * weight_s[s];
        }
        total_s = total;
    }
    __syncthreads();
    for (u32 d = threadIdx.x; d < HEAD_DIM; d += ATT_THREADS) {
        float value = 0.0f;
        for (u32 s = 0; s < live; ++s) {
            value += part_acc[(row * n_splits + s) * HEAD_DIM + d] * weight_s[s];
        }
        out[row * HEAD_DIM + d] = value / total_s;
    }
}
