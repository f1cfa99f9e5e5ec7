// Rotary position embedding, the KV-cache store, and both fused with the q/k norms. All read
// the step's first position from the step block, so a captured decode graph replays at the
// next position unchanged.
#include "common.cuh"
#include "step.cuh"

// Rotates pair `pair` (of n_rot / 2) of one head at position `pos`: reads src[a], src[b] and
// writes dst[a], dst[b], with (a, b) = (2i, 2i+1), or (i, i + n_rot/2) when `neox` is set.
// The angle is the same f32 product as the CPU backend's, so both rotate by the same angle.
__device__ __forceinline__ void rotate_pair(float* dst, const float* src, u32 pair, u32 n_rot, u32 neox, u32 pos,
                                            const float* inv_freq) {
    const u32 half = n_rot / 2;
    float sin_a, cos_a;
    sincosf((float)pos * inv_freq[pair], &sin_a, &cos_a);
    const u32 a = neox ? pair : 2 * pair;
    const u32 b = neox ? pair + half : 2 * pair + 1;
    const float x0 = src[a];
    const float x1 = src[b];
    dst[a] = x0 * cos_a - x1 * sin_a;
    dst[b] = x0 * sin_a + x1 * cos_a;
}

// In place on [n_tokens][n_heads][head_dim]: every pair of token t rotates by position pos0 + t.
// Any 1-D grid (grid-stride over the pairs).
extern "C" __global__ void rope_f32(float* x, const float* inv_freq, const u32* step, u32 n_tokens, u32 n_heads,
                                    u32 head_dim, u32 n_rot, u32 neox) {
    const u32 half = n_rot / 2;
    const u64 pairs = (u64)n_tokens * n_heads * half;
    const u32 pos0 = step[STEP_POS0];
    for (u64 i = global_thread_index(); i < pairs; i += global_thread_count()) {
        const u64 head_index = i / half;
        float* head = x + head_index * head_dim;
        rotate_pair(head, head, (u32)(i % half), n_rot, neox, pos0 + (u32)(head_index / n_heads), inv_freq);
    }
}

// Copies n_tokens rows of K and V ([n][kv_width]) to rows pos0.. of the caches. Rows past
// `cache_rows` are dropped rather than written out of bounds. Any 1-D grid.
extern "C" __global__ void kv_store_f32(float* k_cache, float* v_cache, const float* k, const float* v, const u32* step,
                                        u32 n_tokens, u32 kv_width, u32 cache_rows) {
    const u32 pos0 = step[STEP_POS0];
    const u32 rows = pos0 >= cache_rows ? 0 : min(n_tokens, cache_rows - pos0);
    const u64 len = (u64)rows * kv_width;
    const u64 start = (u64)pos0 * kv_width;
    for (u64 i = global_thread_index(); i < len; i += global_thread_count()) {
        k_cache[start + i] = k[i];
        v_cache[start + i] = v[i];
    }
}

#define PROLOGUE_WARPS 4
#define PROLOGUE_MAX_HEAD_DIM 512

// The attention prologue in one launch: optional per-head RMSNorm of q and k (q_norm/k_norm
// null: none), rotary embedding of both, q written to q_out (which may alias q), k and v
// stored at rows pos0.. of the caches (rows past cache_rows dropped). One warp per head row:
// the n*n_heads query rows, then n*n_kv_heads key rows, then as many value rows.
// Grid: ceil(rows / PROLOGUE_WARPS) blocks of PROLOGUE_WARPS warps.
extern "C" __global__ void __launch_bounds__(PROLOGUE_WARPS * 32) qk_norm_rope_store_f32(
    float* q_out, float* k_cache, float* v_cache, const float* q, const float* k, const float* v, const float* q_norm,
    const float* k_norm, const float* inv_freq, const u32* step, u32 n_tokens, u32 n_heads, u32 n_kv_heads,
    u32 head_dim, u32 n_rot, u32 neox, float eps, u32 cache_rows) {
    __shared__ float rows_s[PROLOGUE_WARPS][PROLOGUE_MAX_HEAD_DIM];
    const u32 lane = threadIdx.x & 31;
    const u32 warp = threadIdx.x >> 5;
    const u32 row = blockIdx.x * PROLOGUE_WARPS + warp;
    const u32 q_rows = n_tokens * n_heads;
    const u32 kv_rows = n_tokens * n_kv_heads;
    if (row >= q_rows + 2 * kv_rows) {
        return;
    }
    const u32 pos0 = step[STEP_POS0];
    const float* src;
    const float* norm = nullptr;
    float* dst;
    u32 token;
    bool rotate = true;
    if (row < q_rows) {
        token = row / n_heads;
        src = q + (u64)row * head_dim;
        dst = q_out + (u64)row * head_dim;
        norm = q_norm;
    } else {
        const u32 kv_row = (row - q_rows) % kv_rows;
        const bool is_key = row < q_rows + kv_rows;
        token = kv_row / n_kv_heads;
        if (pos0 + token >= cache_rows) {
            return;
        }
        const u64 cache_at = ((u64)(pos0 + token) * n_kv_heads + kv_row % n_kv_heads) * head_dim;
        src = (is_key ? k : v) + (u64)kv_row * head_dim;
        dst = (is_key ? k_cache : v_cache) + cache_at;
        norm = is_key ? k_norm : nullptr;
        rotate = is_key;
    }
    float* x = rows_s[warp];
    float sum_sq = 0.0f;
    for (u32 d = lane; d < head_dim; d += 32) {
        const float value = src[d];
        x[d] = value;
        sum_sq += value * value;
    }
    sum_sq = warp_sum(sum_sq);
    if (norm != nullptr) {
        const float scale = 1.0f / sqrtf(sum_sq / (float)head_dim + eps);
        for (u32 d = lane; d < head_dim; d += 32) {
            x[d] = x[d] * scale * norm[d];
        }
    }
    __syncwarp();
    const u32 rotated = rotate ? n_rot : 0;
    for (u32 pair = lane; pair < rotated / 2; pair += 32) {
        rotate_pair(dst, x, pair, n_rot, neox, pos0 + token, inv_freq);
    }
    for (u32 d = rotated + lane; d < head_dim; d += 32) {
        dst[d] = x[d];
    }
}
