// The gated delta rule of a Gated DeltaNet layer (Qwen3.5), token after token over each
// sequence of the step, from the state its last step left and leaving it there (the CPU
// backend's `delta_net`, whose recurrence this is; its chunked prompt form equals it up to
// rounding). Per value head h with key head h % n_k_heads and q, k L2-normed (q also times
// 1/sqrt(D)):  S = exp(g) S;  S += k (beta (v - S^T k))^T;  out = S^T q.
//
// One block of D threads per (value head, sequence): thread j keeps column j of the D x D
// state S[i][j] in registers for the whole span, so a token costs four passes over registers
// and two barriers. x is the convolved [tokens][(2 n_k + n_v) D] (q heads, k heads, v heads);
// g and beta are [tokens][n_v]; out is [tokens][n_v D]; the states are [slot][n_v][D][D] and
// slots[s] (f32) is the slot, one of n_slots, of the step's sequence s.
// kiln-test-defines: DN_HEAD_DIM=64
// kiln-test-defines: DN_HEAD_DIM=128
// kiln-test-defines: DN_HEAD_DIM=32
// kiln-waits-for-inputs
#include "common.cuh"
#include "plan.cuh"

#ifndef DN_HEAD_DIM
#error "delta_net.cu needs -DDN_HEAD_DIM=<values per head, a multiple of 32, at most 128>"
#endif
#define D DN_HEAD_DIM
static_assert(D % 32 == 0 && D <= 128, "DN_HEAD_DIM must be a multiple of 32, at most 128");

extern "C" __global__ void __launch_bounds__(D) delta_net_f32(
    float* out, const float* x, const float* g, const float* beta, float* state, const float* slots, u32 n_slots,
    const u32* step, u32 n_k_heads, u32 n_v_heads) {
    wait_for_inputs();
    const u32 h = blockIdx.x;
    const u32 s = blockIdx.y;
    if (s >= step[STEP_N_SEQS]) {
        return;
    }
    const u32 j = threadIdx.x;
    const u32* seq = step_seq(step, s);
    const u32 kh = h % n_k_heads;
    const u32 width = (2 * n_k_heads + n_v_heads) * D;
    const u32 first = seq[SEQ_FIRST_TOKEN];
    if (!(slots[s] >= 0.0f && slots[s] < (float)n_slots)) {
        // No state to continue from: NaN outputs rather than another sequence's state.
        for (u32 t = first; t < first + seq[SEQ_N_TOKENS]; ++t) {
            out[(u64)t * n_v_heads * D + h * D + j] = __int_as_float(0x7fc00000);
        }
        return;
    }
    float* st = state + ((u64)slots[s] * n_v_heads + h) * D * D;
    float col[D];
    const bool fresh = seq[SEQ_POS0] == 0;
#pragma unroll
    for (int i = 0; i < D; ++i) {
        col[i] = fresh ? 0.0f : st[i * D + j];
    }
    __shared__ float q_s[D];
    __shared__ float k_s[D];
    const float q_scale = 1.0f / sqrtf((float)D);
    for (u32 t = first; t < first + seq[SEQ_N_TOKENS]; ++t) {
        const float* row = x + (u64)t * width;
        const float q = row[kh * D + j];
        const float k = row[(n_k_heads + kh) * D + j];
        const float v = row[(2 * n_k_heads + h) * D + j];
        const float qq = block_sum<D>(q * q);
        const float kk = block_sum<D>(k * k);
        q_s[j] = q * (1.0f / sqrtf(qq + 1e-6f) * q_scale);
        k_s[j] = k * (1.0f / sqrtf(kk + 1e-6f));
        __syncthreads();
        const float decay = expf(g[(u64)t * n_v_heads + h]);
        const float b = beta[(u64)t * n_v_heads + h];
        float read = 0.0f;
#pragma unroll
        for (int i = 0; i < D; ++i) {
            col[i] *= decay;
            read += col[i] * k_s[i];
        }
        const float delta = (v - read) * b;
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < D; ++i) {
            col[i] += k_s[i] * delta;
            o += col[i] * q_s[i];
        }
        out[(u64)t * n_v_heads * D + h * D + j] = o;
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < D; ++i) {
        st[i * D + j] = col[i];
    }
}
