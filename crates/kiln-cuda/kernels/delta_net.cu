// The gated delta rule of a Gated DeltaNet layer (Qwen3.5), token after token over each
// sequence of the step, from the state its last step left and leaving it there (the CPU
// backend's `delta_net`, whose recurrence this is; its chunked prompt form equals it up to
// rounding). Per value head h with key head h % n_k_heads and q, k L2-normed (q also times
// 1/sqrt(D)):  S = exp(g) S;  S += k (beta (v - S^T k))^T;  out = S^T q.
//
// One block of D threads per (value head, sequence): thread j keeps column j of the D x D
// state S[i][j] in registers for the whole span, so a token costs four passes over registers
// and two barriers. x is the convolved [tokens][(2 n_k + n_v) D] (q heads, k heads, v heads);
// g and beta are [tokens][n_v]: the gates, or with a_log_neg and dt_bias ([n_v], else null) the
// projections they come from (common.cuh's delta_net_log_decay and sigmoid, applied on
// reading); out is [tokens][n_v D]; the states are [slot][n_v][D][D] and slots[s] (f32) is the
// slot, one of n_slots, of the step's sequence s.
// The chunked form, delta_net_chunked_f32 below, takes the spans of chunked_from tokens or more;
// this kernel the shorter ones (a decode step's single tokens).
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

// The log decay and write strength of head h's token t.
__device__ __forceinline__ float2 head_gates(const float* g, const float* beta, const float* a_log_neg, const float* dt_bias, u64 t,
                                             u32 n_v_heads, u32 h) {
    const float gt = g[t * n_v_heads + h], bt = beta[t * n_v_heads + h];
    return a_log_neg == nullptr ? make_float2(gt, bt) : make_float2(delta_net_log_decay(gt, a_log_neg[h], dt_bias[h]), sigmoid(bt));
}

extern "C" __global__ void __launch_bounds__(D) delta_net_f32(
    float* out, const float* x, const float* g, const float* beta, float* state, const float* slots, u32 n_slots,
    const u32* step, u32 n_k_heads, u32 n_v_heads, u32 chunked_from, const float* a_log_neg, const float* dt_bias) {
    wait_for_inputs();
    const u32 h = blockIdx.x;
    const u32 s = blockIdx.y;
    if (s >= step[STEP_N_SEQS]) {
        return;
    }
    const u32 j = threadIdx.x;
    const u32* seq = step_seq(step, s);
    if (seq[SEQ_N_TOKENS] >= chunked_from) {
        return;
    }
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
        const float2 gates = head_gates(g, beta, a_log_neg, dt_bias, t, n_v_heads, h);
        const float decay = expf(gates.x);
        const float b = gates.y;
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

// The same rule over spans of DN_CHUNK tokens at a time (derived in the CPU backend's
// cpu_delta_chunk.rs). Within a chunk starting from state S0, with b_t the running sum of g over
// the chunk and G_t = exp(b_t), the values the tokens write solve (I + A) u = r, where
// A[t][s] = beta_t exp(b_t - b_s) k_t.k_s for s < t and r_t = beta_t (v_t - G_t S0^T k_t); then
// out_t = G_t S0^T q_t + sum_{s<=t} exp(b_t - b_s) (q_t.k_s) u_s, and the state leaves the chunk
// as G_last S0 + sum_s exp(b_last - b_s) k_s u_s^T. Every exponent is a difference b_t - b_s with
// s <= t, never positive. The state is read once per chunk instead of twice per token, and the
// chunk's products run across the block instead of token after token.
//
// One block of 8 warps per (value head, 32 of its D state columns, sequence): the columns of S
// are independent given q, k, g and beta, so a head spreads over D/32 blocks, each recomputing
// the chunk's small key products. Lane l of warp w holds column w*4 + l%4 of the block's 32,
// over the rows of row group l/4 (DN_ROWS rows), in registers; a warp's 8 row groups are summed
// by shuffles. The loops over a chunk's tokens stay rolled: unrolled, the code was 2.3 times
// the size at the same speed.
#define DN_CHUNK 32
#define DN_COLS 32
#define DN_WARPS 8
#define DN_THREADS (DN_WARPS * 32)
#define DN_COLS_PER_WARP (DN_COLS / DN_WARPS)
#define DN_GROUPS (32 / DN_COLS_PER_WARP)
#define DN_ROWS (D / DN_GROUPS)
static_assert(DN_ROWS % 4 == 0, "row groups are read as float4s");
// Keys then queries in shared memory, a row of D values per token; each row group is padded by
// 4 so that the groups a warp reads at once fall in different banks, and the row so that
// float4 reads of 8 consecutive rows do (its length in float4s is odd).
#define DN_GROUP_STRIDE (DN_ROWS + 4)
#define DN_KQ_ROW (DN_GROUPS * DN_GROUP_STRIDE + 4)
static_assert((DN_KQ_ROW / 4) % 2 == 1, "row length in float4s must be odd");

// The shared memory of delta_net_chunked_f32 (dynamic: over 48 KiB at D = 128); src/arch_ops.rs
// computes the same size, and the kernel checks it was given that much.
struct DeltaNetChunk {
    double b[DN_CHUNK];                    // running sums of g
    float kq[2 * DN_CHUNK][DN_KQ_ROW];     // L2-normed keys, then queries (times 1/sqrt(D))
    float a[DN_CHUNK][DN_CHUNK + 1];       // A, zero on and above the diagonal
    float qk[DN_CHUNK][DN_CHUNK + 1];      // exp(b_t - b_s) q_t.k_s, zero above the diagonal
    float v[DN_CHUNK][DN_COLS];            // the block's columns of the values
    float u[DN_CHUNK][DN_COLS];            // r, then the solved u
    float o[DN_CHUNK][DN_COLS];            // G_t S0^T q_t
    float beta[DN_CHUNK];
    float gamma[DN_CHUNK];                 // G_t
    float to_end[DN_CHUNK];                // exp(b_last - b_t)
};

__device__ __forceinline__ u32 kq_at(u32 i) {
    return (i / DN_ROWS) * DN_GROUP_STRIDE + i % DN_ROWS;
}

extern "C" __global__ void __launch_bounds__(DN_THREADS) delta_net_chunked_f32(
    float* out, const float* x, const float* g, const float* beta, float* state, const float* slots, u32 n_slots,
    const u32* step, u32 n_k_heads, u32 n_v_heads, u32 chunked_from, const float* a_log_neg, const float* dt_bias) {
    wait_for_inputs();
    extern __shared__ __align__(16) unsigned char dn_shared[];
    DeltaNetChunk& sh = *reinterpret_cast<DeltaNetChunk*>(dn_shared);
    const u32 h = blockIdx.x / (D / DN_COLS);
    const u32 j0 = blockIdx.x % (D / DN_COLS) * DN_COLS;
    const u32 s = blockIdx.y;
    if (s >= step[STEP_N_SEQS]) {
        return;
    }
    const u32* seq = step_seq(step, s);
    const u32 n_tokens = seq[SEQ_N_TOKENS];
    if (n_tokens < chunked_from || n_tokens == 0) {
        return;
    }
    const u32 tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const u32 col = warp * DN_COLS_PER_WARP + lane % DN_COLS_PER_WARP;  // within the block's
    const u32 rg = lane / DN_COLS_PER_WARP;  // this thread's row group: rows rg * DN_ROWS ..
    const u32 kh = h % n_k_heads;
    const u32 width = (2 * n_k_heads + n_v_heads) * D;
    const u32 first = seq[SEQ_FIRST_TOKEN];
    u32 shared_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(shared_bytes));
    if (!(slots[s] >= 0.0f && slots[s] < (float)n_slots) || shared_bytes < sizeof(DeltaNetChunk)) {
        // No state to continue from (or too little shared memory): NaN outputs.
        for (u32 t = first + rg; t < first + n_tokens; t += DN_GROUPS) {
            out[(u64)t * n_v_heads * D + h * D + j0 + col] = __int_as_float(0x7fc00000);
        }
        return;
    }
    float* st = state + ((u64)slots[s] * n_v_heads + h) * D * D + j0 + col;
    const bool fresh = seq[SEQ_POS0] == 0;
    float S[DN_ROWS];
#pragma unroll
    for (int r = 0; r < DN_ROWS; ++r) {
        S[r] = fresh ? 0.0f : st[(u64)(rg * DN_ROWS + r) * D];
    }
    const float q_scale = 1.0f / sqrtf((float)D);
    for (u32 c0 = first; c0 < first + n_tokens; c0 += DN_CHUNK) {
        const u32 c = min(DN_CHUNK, first + n_tokens - c0);

        // Gates and their running sums (tokens past the span: no decay, no write), and the
        // normed keys and queries, warp w taking tokens w, w + DN_WARPS, ...
        if (warp == 0) {
            const bool real = lane < c;
            const float2 gates = real ? head_gates(g, beta, a_log_neg, dt_bias, c0 + lane, n_v_heads, h) : make_float2(0.0f, 0.0f);
            const float bt = gates.y;
            double sum = gates.x;
#pragma unroll
            for (int o = 1; o < 32; o *= 2) {
                const double up = __shfl_up_sync(0xffffffffu, sum, o);
                sum += lane >= o ? up : 0.0;
            }
            const double last = __shfl_sync(0xffffffffu, sum, 31);
            sh.b[lane] = sum;
            sh.beta[lane] = bt;
            sh.gamma[lane] = (float)exp(sum);
            sh.to_end[lane] = (float)exp(last - sum);
        }
        // The chunk's global loads are issued before any is used: this thread's values
        // (tokens t = DN_GROUPS m + rg, its column), then its warp's keys and queries.
        float v_own[DN_CHUNK / DN_GROUPS];
#pragma unroll
        for (int m = 0; m < DN_CHUNK / DN_GROUPS; ++m) {
            const u32 t = DN_GROUPS * m + rg;
            v_own[m] = t < c ? x[(u64)(c0 + t) * width + (2 * n_k_heads + h) * D + j0 + col] : 0.0f;
        }
        float kv[DN_CHUNK / DN_WARPS][D / 32], qv[DN_CHUNK / DN_WARPS][D / 32];
#pragma unroll
        for (int m = 0; m < DN_CHUNK / DN_WARPS; ++m) {
            const u32 t = warp + DN_WARPS * m;
            const float* row = x + (u64)(c0 + t) * width;
#pragma unroll
            for (int e = 0; e < D / 32; ++e) {
                kv[m][e] = t < c ? row[(n_k_heads + kh) * D + lane + 32 * e] : 0.0f;
                qv[m][e] = t < c ? row[kh * D + lane + 32 * e] : 0.0f;
            }
        }
#pragma unroll
        for (int m = 0; m < DN_CHUNK / DN_GROUPS; ++m) {
            sh.v[DN_GROUPS * m + rg][col] = v_own[m];
        }
#pragma unroll
        for (int m = 0; m < DN_CHUNK / DN_WARPS; ++m) {
            const u32 t = warp + DN_WARPS * m;
            float kk = 0.0f, qq = 0.0f;
#pragma unroll
            for (int e = 0; e < D / 32; ++e) {
                kk += kv[m][e] * kv[m][e];
                qq += qv[m][e] * qv[m][e];
            }
            const float kn = 1.0f / sqrtf(warp_sum(kk) + 1e-6f);
            const float qn = 1.0f / sqrtf(warp_sum(qq) + 1e-6f) * q_scale;
#pragma unroll
            for (int e = 0; e < D / 32; ++e) {
                sh.kq[t][kq_at(lane + 32 * e)] = kv[m][e] * kn;
                sh.kq[DN_CHUNK + t][kq_at(lane + 32 * e)] = qv[m][e] * qn;
            }
        }
        __syncthreads();

        // The decayed Gram matrices A and QK, a GRAM_ROWS x 4 tile a thread: rows (keys, then
        // queries) r0.., key columns tid % 8 + 8 m.
        {
            constexpr int GRAM_ROWS = 2 * DN_CHUNK * DN_CHUNK / 4 / DN_THREADS;
            const u32 r0 = tid / 8 * GRAM_ROWS, s0 = tid % 8;
            float acc[GRAM_ROWS][4] = {};
#pragma unroll 1
            for (u32 i = 0; i < D; i += 4) {
                const u32 at = kq_at(i);
                float4 rv[GRAM_ROWS], cv[4];
#pragma unroll
                for (int a = 0; a < GRAM_ROWS; ++a) {
                    rv[a] = *reinterpret_cast<const float4*>(&sh.kq[r0 + a][at]);
                }
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    cv[m] = *reinterpret_cast<const float4*>(&sh.kq[s0 + 8 * m][at]);
                }
#pragma unroll
                for (int a = 0; a < GRAM_ROWS; ++a) {
#pragma unroll
                    for (int m = 0; m < 4; ++m) {
                        acc[a][m] += rv[a].x * cv[m].x + rv[a].y * cv[m].y + rv[a].z * cv[m].z + rv[a].w * cv[m].w;
                    }
                }
            }
#pragma unroll
            for (int a = 0; a < GRAM_ROWS; ++a) {
                const bool key_row = r0 < DN_CHUNK;
                const u32 t = (r0 + a) % DN_CHUNK;
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    const u32 k = s0 + 8 * m;
                    const float decay = k <= t ? expf((float)(sh.b[t] - sh.b[k])) : 0.0f;
                    if (key_row) {
                        sh.a[t][k] = k < t ? sh.beta[t] * decay * acc[a][m] : 0.0f;
                    } else {
                        sh.qk[t][k] = decay * acc[a][m];
                    }
                }
            }
        }

        // S0^T k_t and S0^T q_t over this thread's rows, summed over the row groups by
        // shuffles; the lane of row group t % DN_GROUPS writes r_t, or G_t S0^T q_t.
#pragma unroll 1
        for (u32 t0 = 0; t0 < 2 * DN_CHUNK; t0 += DN_GROUPS) {
            float p[DN_GROUPS] = {};
#pragma unroll
            for (int r = 0; r < DN_ROWS; r += 4) {
#pragma unroll
                for (int m = 0; m < DN_GROUPS; ++m) {
                    const float4 kv = *reinterpret_cast<const float4*>(&sh.kq[t0 + m][rg * DN_GROUP_STRIDE + r]);
                    p[m] += S[r] * kv.x + S[r + 1] * kv.y + S[r + 2] * kv.z + S[r + 3] * kv.w;
                }
            }
            float mine = 0.0f;
#pragma unroll
            for (int m = 0; m < DN_GROUPS; ++m) {
#pragma unroll
                for (int lanes = DN_COLS_PER_WARP; lanes < 32; lanes *= 2) {
                    p[m] += __shfl_xor_sync(0xffffffffu, p[m], lanes);
                }
                mine = rg == m ? p[m] : mine;  // no dynamic register index
            }
            const u32 t = (t0 + rg) % DN_CHUNK;
            if (t0 < DN_CHUNK) {
                sh.u[t][col] = sh.beta[t] * (sh.v[t][col] - sh.gamma[t] * mine);
            } else {
                sh.o[t][col] = sh.gamma[t] * mine;
            }
        }
        __syncthreads();

        // Forward substitution for u, column by column (a lane each): once u_k is final it is
        // taken out of every later row.
        if (warp == 0 && lane < DN_COLS) {
#pragma unroll 1
            for (u32 k = 0; k + 1 < DN_CHUNK; ++k) {
                const float uk = sh.u[k][lane];
#pragma unroll 4
                for (u32 t = k + 1; t < DN_CHUNK; ++t) {
                    sh.u[t][lane] -= sh.a[t][k] * uk;
                }
            }
        }
        __syncthreads();

        // Outputs of tokens t = DN_GROUPS m + rg, and the state at the chunk's end.
#pragma unroll 1
        for (u32 t = rg; t < c; t += DN_GROUPS) {
            float sum = sh.o[t][col];
#pragma unroll 8
            for (int k = 0; k < DN_CHUNK; ++k) {
                sum += sh.qk[t][k] * sh.u[k][col];
            }
            out[(u64)(c0 + t) * n_v_heads * D + h * D + j0 + col] = sum;
        }
        const float chunk_decay = sh.gamma[DN_CHUNK - 1];
#pragma unroll
        for (int r = 0; r < DN_ROWS; ++r) {
            S[r] *= chunk_decay;
        }
#pragma unroll 2
        for (int k = 0; k < DN_CHUNK; ++k) {
            const float w = sh.to_end[k] * sh.u[k][col];
#pragma unroll
            for (int r = 0; r < DN_ROWS; r += 4) {
                const float4 kv = *reinterpret_cast<const float4*>(&sh.kq[k][rg * DN_GROUP_STRIDE + r]);
                S[r] += kv.x * w;
                S[r + 1] += kv.y * w;
                S[r + 2] += kv.z * w;
                S[r + 3] += kv.w * w;
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < DN_ROWS; ++r) {
        st[(u64)(rg * DN_ROWS + r) * D] = S[r];
    }
}
