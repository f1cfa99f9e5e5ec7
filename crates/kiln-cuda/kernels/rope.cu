// Rotary position embedding and the KV-cache store. Both read the step's first position from
// the step block, so a captured decode graph replays at the next position unchanged.
#include "common.cuh"
#include "step.cuh"

// In place on [n_tokens][n_heads][head_dim]: pair i < n_rot/2 of token t is rotated by
// (pos0 + t) * inv_freq[i]. Pairs are (2i, 2i+1), or (i, i + n_rot/2) when `neox` is set.
// Any 1-D grid (grid-stride over the pairs).
extern "C" __global__ void rope_f32(float* x, const float* inv_freq, const u32* step, u32 n_tokens, u32 n_heads,
                                    u32 head_dim, u32 n_rot, u32 neox) {
    const u32 half = n_rot / 2;
    const u64 pairs = (u64)n_tokens * n_heads * half;
    const u32 pos0 = step[STEP_POS0];
    for (u64 i = global_thread_index(); i < pairs; i += global_thread_count()) {
        const u32 pair = (u32)(i % half);
        const u64 head_index = i / half;
        const u32 token = (u32)(head_index / n_heads);
        float* head = x + head_index * head_dim;
        // The same f32 product as the CPU backend, so both rotate by the same angle.
        const float angle = (float)(pos0 + token) * inv_freq[pair];
        float sin_a, cos_a;
        sincosf(angle, &sin_a, &cos_a);
        const u32 a = neox ? pair : 2 * pair;
        const u32 b = neox ? pair + half : 2 * pair + 1;
        const float x0 = head[a];
        const float x1 = head[b];
        head[a] = x0 * cos_a - x1 * sin_a;
        head[b] = x0 * sin_a + x1 * cos_a;
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
