// Rotary position embedding and the attention prologue (q/k norms, rope, K and V stored into
// the paged cache). Token positions and cache rows come from the step block (plan.cuh), so a
// captured decode graph replays at the next positions unchanged. The cache element types are
// compile-time defines (kv.cuh codes).
// kiln-test-defines: K_TYPE=0,V_TYPE=0
// kiln-test-defines: K_TYPE=1,V_TYPE=1
// kiln-test-defines: K_TYPE=2,V_TYPE=2
// kiln-test-defines: K_TYPE=1,V_TYPE=2
// kiln-waits-for-inputs
#include "common.cuh"
#include "kv.cuh"
#include "plan.cuh"
#include "rope.cuh"

#ifndef K_TYPE
#define K_TYPE KV_F16
#endif
#ifndef V_TYPE
#define V_TYPE KV_F16
#endif
// q8_0 needs a whole 32-value block per store, which spans heads when head_dim < 32: such
// caches get the roped keys back in f32 and kv_store quantizes them afterwards.
#define FUSED_STORE (K_TYPE != KV_Q8_0 && V_TYPE != KV_Q8_0)

// In place on [n_tokens][n_heads][head_dim]: every pair of token t rotates by its position.
// Any 1-D grid (grid-stride over the pairs).
extern "C" __global__ void rope_f32(float* x, const float* inv_freq, const u32* step, u32 n_tokens, u32 n_heads,
                                    u32 head_dim, u32 n_rot, u32 neox) {
    wait_for_inputs();
    const u32 half = n_rot / 2;
    const u64 pairs = (u64)n_tokens * n_heads * half;
    const u32* positions = step + step[STEP_POS_AT];
    for (u64 i = global_thread_index(); i < pairs; i += global_thread_count()) {
        const u64 head_index = i / half;
        float* head = x + head_index * head_dim;
        rotate_pair(head, head, (u32)(i % half), n_rot, neox, positions[head_index / n_heads], inv_freq);
    }
}

// Stores n_tokens rows of K and V ([n][width] f32) at their cache rows (the step's slots). One
// warp per (token, 32-value group) of K or V; grid-stride over those units.
extern "C" __global__ void kv_store(u8* k_cache, u8* v_cache, const float* k, const float* v, const u32* step, u32 n_tokens,
                                    u32 width, u32 rows) {
    wait_for_inputs();
    const u32 lane = threadIdx.x & 31;
    const u32 groups = (width + 31) / 32;
    const u64 units = (u64)n_tokens * groups * 2;
    const u32* slots = step + step[STEP_SLOT_AT];
    for (u64 unit = global_thread_index() / 32; unit < units; unit += global_thread_count() / 32) {
        const bool is_value = unit & 1;
        const u32 group = (u32)((unit >> 1) % groups);
        const u32 token = (u32)((unit >> 1) / groups);
        const u32 col = group * 32 + lane;
        const float value = col < width ? (is_value ? v : k)[(u64)token * width + col] : 0.0f;
        const u64 row = slots[token];
        u8* cache = is_value ? v_cache : k_cache;
        const int type = is_value ? V_TYPE : K_TYPE;
        if (type == KV_Q8_0) {
            kv_store_q8_block(cache, rows, width, row, group, lane, value);
        } else if (col < width) {
            if (type == KV_F32) {
                kv_store_float<KV_F32>(cache, width, row, col, value);
            } else {
                kv_store_float<KV_F16>(cache, width, row, col, value);
            }
        }
    }
}

#define PROLOGUE_WARPS 4
#define PROLOGUE_MAX_HEAD_DIM 512

// The attention prologue in one launch: optional per-head RMSNorm of q and k (q_norm/k_norm
// null: none) and with FUSED_STORE of v (v_norm, null: none), rotary embedding of q and k, q
// written to q_out (which may alias q). With FUSED_STORE, k and v go straight to their cache rows; otherwise the roped keys go to k_out
// (which may alias k) for kv_store. One warp per head row: the n*n_heads query rows, then
// n*n_kv_heads key rows, then as many value rows. Grid: ceil(rows / PROLOGUE_WARPS) blocks of
// PROLOGUE_WARPS warps.
extern "C" __global__ void __launch_bounds__(PROLOGUE_WARPS * 32) qk_norm_rope_store(
    float* q_out, u8* k_cache, u8* v_cache, float* k_out, const float* q, const float* k, const float* v, const float* q_norm,
    const float* k_norm, const float* v_norm, const float* inv_freq, const u32* step, u32 n_tokens, u32 n_heads, u32 n_kv_heads, u32 head_dim,
    u32 n_rot, u32 neox, float eps) {
    wait_for_inputs();
    __shared__ float rows_s[PROLOGUE_WARPS][PROLOGUE_MAX_HEAD_DIM];
    const u32 lane = threadIdx.x & 31;
    const u32 warp = threadIdx.x >> 5;
    const u32 row = blockIdx.x * PROLOGUE_WARPS + warp;
    const u32 q_rows = n_tokens * n_heads;
    const u32 kv_rows = n_tokens * n_kv_heads;
    if (row >= q_rows + (FUSED_STORE ? 2 : 1) * kv_rows) {
        return;
    }
    const u32 width = n_kv_heads * head_dim;
    const float* src;
    const float* norm = nullptr;
    u32 token;
    // 0: query, 1: key, 2: value.
    u32 kind;
    u32 col0 = 0;
    if (row < q_rows) {
        token = row / n_heads;
        src = q + (u64)row * head_dim;
        norm = q_norm;
        kind = 0;
    } else {
        const u32 kv_row = (row - q_rows) % kv_rows;
        kind = row < q_rows + kv_rows ? 1 : 2;
        token = kv_row / n_kv_heads;
        col0 = (kv_row % n_kv_heads) * head_dim;
        src = (kind == 1 ? k : v) + (u64)kv_row * head_dim;
        norm = kind == 1 ? k_norm : v_norm;
    }
    float* x = rows_s[warp];
    const u32 pos = step[step[STEP_POS_AT] + token];
    prepare_head_row(x, src, head_dim, HeadPrologue{norm, eps, kind != 2 ? n_rot : 0u, neox, pos, inv_freq});
    if (kind == 0) {
        float* dst = q_out + (u64)row * head_dim;
        for (u32 d = lane; d < head_dim; d += 32) {
            dst[d] = x[d];
        }
        return;
    }
    if (!FUSED_STORE) {
        float* dst = k_out + (u64)token * width + col0;
        for (u32 d = lane; d < head_dim; d += 32) {
            dst[d] = x[d];
        }
        return;
    }
    const u64 cache_at = step[step[STEP_SLOT_AT] + token];
    for (u32 d = lane; d < head_dim; d += 32) {
        if (kind == 1) {
            kv_store_float<FUSED_STORE ? K_TYPE : KV_F32>(k_cache, width, cache_at, col0 + d, x[d]);
        } else {
            kv_store_float<FUSED_STORE ? V_TYPE : KV_F32>(v_cache, width, cache_at, col0 + d, x[d]);
        }
    }
}
