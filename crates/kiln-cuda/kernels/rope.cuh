// Rotary embedding and the per-head part of the attention prologue, shared by the prologue
// kernel (rope.cu) and the decode attention that takes the prologue itself (paged_attention.cu),
// so both compute the same values.
#pragma once
#include "common.cuh"

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

// How a head row is prepared: RMSNorm by `norm` (null: none) and rope (n_rot 0: none).
struct HeadPrologue {
    const float* norm;
    float eps;
    u32 n_rot;
    u32 neox;
    u32 pos;
    const float* inv_freq;
};

// One warp stages head row `src` (head_dim values) in `x` (shared memory), normed and roped
// as `how` says. Called by all 32 lanes; `x` is complete for the warp on return.
__device__ __forceinline__ void prepare_head_row(float* x, const float* src, u32 head_dim, const HeadPrologue& how) {
    const u32 lane = threadIdx.x & 31;
    float sum_sq = 0.0f;
    for (u32 d = lane; d < head_dim; d += 32) {
        const float value = src[d];
        x[d] = value;
        sum_sq += value * value;
    }
    sum_sq = warp_sum(sum_sq);
    if (how.norm != nullptr) {
        const float scale = 1.0f / sqrtf(sum_sq / (float)head_dim + how.eps);
        for (u32 d = lane; d < head_dim; d += 32) {
            x[d] = x[d] * scale * how.norm[d];
        }
    }
    __syncwarp();
    if (how.n_rot > 0) {
        for (u32 pair = lane; pair < how.n_rot / 2; pair += 32) {
            rotate_pair(x, x, pair, how.n_rot, how.neox, how.pos, how.inv_freq);
        }
        __syncwarp();
    }
}
