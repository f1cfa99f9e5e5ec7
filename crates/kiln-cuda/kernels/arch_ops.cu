// The ops of the newer architectures (mixture of experts, Gemma, gpt-oss, Qwen3.5's Gated
// DeltaNet) that are not products or attention: elementwise activations and gates, the expert
// router, the per-expert biases and the weighted sum of expert outputs, and the causal
// convolution of a DeltaNet layer. Each computes what the CPU backend's op of the same name does
// (kiln-core), in the same order of operations where that order shows in f32.
// Elementwise kernels take any 1-D grid (grid-stride).
// kiln-waits-for-inputs
#include "activation_q8.cuh"
#include "norm.cuh"
#include "plan.cuh"

#define CONV_MAX_KERNEL 8
#define CONV_BATCH 8

extern "C" __global__ void geglu_f32(float* out, const float* gate, const float* up, u64 n) {
    wait_for_inputs();
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        out[i] = gelu_tanh_times(gate[i], up[i]);
    }
}

extern "C" __global__ void swiglu_oai_f32(float* out, const float* gate, const float* up, float alpha, float limit, u64 n) {
    wait_for_inputs();
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        out[i] = swiglu_oai_times(gate[i], up[i], alpha, limit);
    }
}

extern "C" __global__ void softcap_f32(float* x, float cap, u64 n) {
    wait_for_inputs();
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        x[i] = cap * tanhf(x[i] / cap);
    }
}

// dst[t][0..width] = src[t][col..col + width] for rows of src_width values; n = rows * width.
extern "C" __global__ void copy_cols_f32(float* dst, const float* src, u32 src_width, u32 col, u32 width, u64 n) {
    wait_for_inputs();
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        dst[i] = src[i / width * src_width + col + i % width];
    }
}

// x[i] *= sigmoid(gate[i / per]): per = 1 for an elementwise gate, the row width for one gate
// per row.
extern "C" __global__ void sigmoid_gate_f32(float* x, const float* gate, u32 per, u64 n) {
    wait_for_inputs();
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        x[i] /= 1.0f + expf(-gate[i / per]);
    }
}

// The DeltaNet gates of n tokens x n_heads, in place: g = a_log_neg * softplus(g + dt_bias),
// beta = sigmoid(beta).
extern "C" __global__ void delta_net_gates_f32(float* g, float* beta, const float* a_log_neg, const float* dt_bias, u32 n_heads, u64 n) {
    wait_for_inputs();
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        const u32 h = i % n_heads;
        g[i] = delta_net_log_decay(g[i], a_log_neg[h], dt_bias[h]);
        beta[i] = sigmoid(beta[i]);
    }
}

// An expert id stored as f32, or n_experts when it is not one (the caller then writes NaN).
__device__ __forceinline__ u32 expert_of(float id, u32 n_experts) {
    return id >= 0.0f && id < (float)n_experts && id == floorf(id) ? (u32)id : n_experts;
}

// x[slot][d] += bias[ids[slot]][d] over n = slots * dim values.
extern "C" __global__ void moe_add_bias_f32(float* x, const float* bias, const float* ids, u32 dim, u32 n_experts, u64 n) {
    wait_for_inputs();
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        const u32 e = expert_of(ids[i / dim], n_experts);
        x[i] = e < n_experts ? x[i] + bias[(u64)e * dim + i % dim] : __int_as_float(0x7fc00000);
    }
}

// out[t][d] = sum_j weights[t][j] * y[t][j][d] (+= when accumulating) over n = tokens * dim values.
// With a shared expert (`shared` [tokens][dim], non-null), its output gated by the sigmoid of
// its logit (`shared_gate` [tokens]) joins the sum.
extern "C" __global__ void moe_combine_f32(float* out, const float* y, const float* weights, u32 n_used, u32 dim, u64 n,
                                           u32 accumulate, const float* shared, const float* shared_gate) {
    wait_for_inputs();
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        const u64 t = i / dim;
        const u32 d = i % dim;
        float total = 0.0f;
        for (u32 j = 0; j < n_used; ++j) {
            total += weights[t * n_used + j] * y[(t * n_used + j) * dim + d];
        }
        if (shared != nullptr) {
            total += shared[i] / (1.0f + expf(-shared_gate[t]));
        }
        out[i] = accumulate ? out[i] + total : total;
    }
}

// Float order as unsigned order (0 stays below every real value: it marks "taken"). A NaN
// logit ranks below every number, as the CPU's `>` comparison leaves it.
__device__ __forceinline__ u32 route_key(float f) {
    const u32 u = __float_as_uint(f);
    return f != f ? 1u : (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float route_logit(u32 key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// The routing rule of one token, run by one warp: softmax over n_experts logits (`row`, read
// through L2: other blocks of the caller may have written them), the n_used (at most
// ROUTE_MAX_USED) most probable in order, a tie going to the lower id, renormalized when asked,
// each times expert_scale[id] when given, into ids[0..n_used] and weights[0..n_used]. Up to 32 *
// ROUTE_REGS experts stay in registers (one warp-wide max and min per choice); more go through
// `route_logits` (n_experts floats of shared memory).
#define ROUTE_MAX_USED 64
#define ROUTE_REGS 8
__device__ __forceinline__ void route_token(const float* row, const float* expert_scale, float* ids, float* weights,
                                            u32 n_experts, u32 n_used, u32 renormalize, float* route_logits) {
    __shared__ u32 chosen[ROUTE_MAX_USED];
    __shared__ float chosen_weight[ROUTE_MAX_USED];
    const u32 lane = threadIdx.x & 31;
    const float minus_inf = __int_as_float(0xff800000);
    float chosen_sum = 0.0f;
    if (n_experts <= 32 * ROUTE_REGS) {
        u32 key[ROUTE_REGS];
        float max_logit = minus_inf;
#pragma unroll
        for (int i = 0; i < ROUTE_REGS; ++i) {
            const u32 e = lane + 32 * i;
            const float l = e < n_experts ? __ldcg(row + e) : minus_inf;
            key[i] = e < n_experts ? route_key(l) : 0u;
            max_logit = fmaxf(max_logit, l);
        }
        max_logit = warp_max(max_logit);
        float total = 0.0f;
#pragma unroll
        for (int i = 0; i < ROUTE_REGS; ++i) {
            if (lane + 32 * i < n_experts) {
                total += expf(route_logit(key[i]) - max_logit);
            }
        }
        total = warp_sum(total);
        for (u32 j = 0; j < n_used; ++j) {
            u32 best = 0, best_i = 0;
#pragma unroll
            for (int i = 0; i < ROUTE_REGS; ++i) {
                if (key[i] > best) {
                    best = key[i];
                    best_i = i;
                }
            }
            const u32 top = __reduce_max_sync(0xffffffffu, best);
            const u32 id = __reduce_min_sync(0xffffffffu, best == top ? lane + 32 * best_i : 0xffffffffu);
#pragma unroll
            for (int i = 0; i < ROUTE_REGS; ++i) {
                if (lane + 32 * i == id) {
                    key[i] = 0u;
                }
            }
            const float w = expf(route_logit(top) - max_logit) / total;
            chosen_sum += w;
            if (lane == 0) {
                chosen[j] = id;
                chosen_weight[j] = w;
            }
        }
        __syncwarp();
    } else {
        float max_logit = minus_inf;
        for (u32 e = lane; e < n_experts; e += 32) {
            route_logits[e] = __ldcg(row + e);
            max_logit = fmaxf(max_logit, route_logits[e]);
        }
        max_logit = warp_max(max_logit);
        float total = 0.0f;
        for (u32 e = lane; e < n_experts; e += 32) {
            total += expf(route_logits[e] - max_logit);
        }
        total = warp_sum(total);
        for (u32 j = 0; j < n_used; ++j) {
            const u32 none = 0xffffffffu;
            float best = 0.0f;
            u32 best_id = none;
            for (u32 e = lane; e < n_experts; e += 32) {
                bool taken = false;
                for (u32 i = 0; i < j; ++i) {
                    taken |= chosen[i] == e;
                }
                const float l = route_logits[e];
                if (!taken && (best_id == none || l > best)) {
                    best = l;
                    best_id = e;
                }
            }
#pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1) {
                const float other = __shfl_xor_sync(0xffffffffu, best, offset);
                const u32 other_id = __shfl_xor_sync(0xffffffffu, best_id, offset);
                if (other_id != none && (best_id == none || other > best || (other == best && other_id < best_id))) {
                    best = other;
                    best_id = other_id;
                }
            }
            const float w = expf(best - max_logit) / total;
            chosen_sum += w;
            if (lane == 0) {
                chosen[j] = best_id;
                chosen_weight[j] = w;
            }
            __syncwarp();
        }
    }
    for (u32 j = lane; j < n_used; j += 32) {
        float w = chosen_weight[j];
        if (renormalize) {
            w /= chosen_sum;
        }
        if (expert_scale) {
            w *= expert_scale[chosen[j]];
        }
        ids[j] = (float)chosen[j];
        weights[j] = w;
    }
}

// The router of one token per 32-thread block (route_token). Grid (tokens). With
// shared_expert, each logits row holds a shared expert's gate logit after the n_experts routed
// ones and each ids/weights row its slot after the n_used chosen: id n_experts, weight
// sigmoid(logit).
extern "C" __global__ void __launch_bounds__(32) moe_route_f32(
    const float* logits, const float* expert_scale, float* ids, float* weights, u32 n_experts, u32 n_used, u32 renormalize,
    u32 shared_expert) {
    wait_for_inputs();
    extern __shared__ float route_logits[];
    const u64 t = blockIdx.x;
    const u32 columns = n_experts + shared_expert, slots = n_used + shared_expert;
    const float* row = logits + t * columns;
    route_token(row, expert_scale, ids + t * slots, weights + t * slots, n_experts, n_used, renormalize, route_logits);
    if (shared_expert && threadIdx.x == 0) {
        ids[t * slots + n_used] = (float)n_experts;
        weights[t * slots + n_used] = sigmoid(__ldcg(row + n_experts));
    }
}

// A mixture of experts' norm and router in one launch, for a few tokens: h = x * (1 / rms(x)) *
// norm_w (rms_norm_{warp,block}_f32's values, bit for bit), also stored as the experts' int8
// input where xq is given (quantize_chunk); the router's logits, (x * router_norm_w) . row times
// 1 / rms(x) (router_norm_w: norm_w itself, or the router's own weight) plus bias; then the
// last block of a token to finish routes it (route_token) and resets its ticket. A block takes
// ROUTER_ROWS router rows of one token and a share of its h chunks. Grid (ceil(n_experts /
// ROUTER_ROWS), tokens), NORM_BLOCK threads; cols a multiple of 16, router rows 16-byte aligned,
// at most 32 * ROUTE_REGS experts (the routing gets no shared memory for more; the host checks).
// Every block of a token recomputes its sum of squares: x is one row, read from L2.
#define ROUTER_ROWS 2
#define ROUTER_AHEAD 4
extern "C" __global__ void __launch_bounds__(NORM_BLOCK) moe_norm_route_f32(
    const float* x, const float* norm_w, const float* router_norm_w, float eps, const float* router, u32 router_stride,
    const float* bias, const float* expert_scale, float* h, float* logits, float* ids, float* weights, u32* tickets,
    i8* xq, float2* xds, u32 x_chunks, u32 cols, u32 n_experts, u32 n_used, u32 renormalize) {
    // The router rows and the norm weight are no step's output: the first ROUTER_AHEAD float4s
    // of each thread's columns are loaded before the wait, during the kernel before this one.
    const u32 row0 = blockIdx.x * ROUTER_ROWS;
    const u32 cols4 = cols / 4;
    float4 ahead_w[ROUTER_AHEAD];
    float4 ahead_m[ROUTER_AHEAD][ROUTER_ROWS];
#pragma unroll
    for (int k = 0; k < ROUTER_AHEAD; ++k) {
        const u32 i = threadIdx.x + k * NORM_BLOCK;
        ahead_w[k] = i < cols4 ? reinterpret_cast<const float4*>(router_norm_w)[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int r = 0; r < ROUTER_ROWS; ++r) {
            ahead_m[k][r] = i < cols4 && row0 + r < n_experts ? reinterpret_cast<const float4*>(router + (u64)(row0 + r) * router_stride)[i]
                                                              : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
    wait_for_inputs();
    const u32 t = blockIdx.y;
    const u32 lane = threadIdx.x & 31;
    const u32 warp = threadIdx.x >> 5;
    const float* xr = x + (u64)t * cols;
    // Router rows times x * router_norm_w over each thread's float4 columns (the first ones
    // loaded ahead); 1 / rms scales the block's sums, so this pass need not wait for it.
    float dot[ROUTER_ROWS];
#pragma unroll
    for (int r = 0; r < ROUTER_ROWS; ++r) {
        dot[r] = 0.0f;
    }
    auto add_columns = [&](u32 i, float4 w, const float4 (&m)[ROUTER_ROWS]) {
        const float4 a = reinterpret_cast<const float4*>(xr)[i];
        const float4 r4 = make_float4(a.x * w.x, a.y * w.y, a.z * w.z, a.w * w.w);
#pragma unroll
        for (int r = 0; r < ROUTER_ROWS; ++r) {
            dot[r] += r4.x * m[r].x + r4.y * m[r].y + r4.z * m[r].z + r4.w * m[r].w;
        }
    };
#pragma unroll
    for (int k = 0; k < ROUTER_AHEAD; ++k) {
        const u32 i = threadIdx.x + k * NORM_BLOCK;
        if (i < cols4) {
            add_columns(i, ahead_w[k], ahead_m[k]);
        }
    }
    for (u32 i = threadIdx.x + ROUTER_AHEAD * NORM_BLOCK; i < cols4; i += NORM_BLOCK) {
        float4 m[ROUTER_ROWS];
#pragma unroll
        for (int r = 0; r < ROUTER_ROWS; ++r) {
            m[r] = row0 + r < n_experts ? reinterpret_cast<const float4*>(router + (u64)(row0 + r) * router_stride)[i]
                                        : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        add_columns(i, reinterpret_cast<const float4*>(router_norm_w)[i], m);
    }
    const float sum_sq = cols <= WARP_NORM_MAX_DIM ? warp_row_sum_sq(xr, cols, lane) : block_row_sum_sq(xr, cols);
    const float scale = rms_scale(sum_sq, cols, eps);

    // This block's share of h (and of its int8 codes): chunk c of 16 values goes to block c %
    // gridDim.x.
    const u32 chunks = cols / CHUNK_VALUES;
    for (u32 c = blockIdx.x + threadIdx.x * gridDim.x; c < chunks; c += NORM_BLOCK * gridDim.x) {
        float v[CHUNK_VALUES];
        const float4* x4 = reinterpret_cast<const float4*>(xr + c * CHUNK_VALUES);
        const float4* w4 = reinterpret_cast<const float4*>(norm_w + c * CHUNK_VALUES);
        float4* h4 = reinterpret_cast<float4*>(h + (u64)t * cols + c * CHUNK_VALUES);
#pragma unroll
        for (int i = 0; i < CHUNK_VALUES / 4; ++i) {
            const float4 a = x4[i];
            const float4 w = w4[i];
            const float4 r = make_float4(rms_normed(a.x, scale, w.x), rms_normed(a.y, scale, w.y), rms_normed(a.z, scale, w.z),
                                         rms_normed(a.w, scale, w.w));
            h4[i] = r;
            v[4 * i] = r.x;
            v[4 * i + 1] = r.y;
            v[4 * i + 2] = r.z;
            v[4 * i + 3] = r.w;
        }
        if (xq != nullptr) {
            quantize_chunk(v, xq, xds, (u64)t * x_chunks + c);
        }
    }

    __shared__ float partial[NORM_BLOCK / 32][ROUTER_ROWS];
    __shared__ u32 last;
#pragma unroll
    for (int r = 0; r < ROUTER_ROWS; ++r) {
        const float total = warp_sum(dot[r]);
        if (lane == 0) {
            partial[warp][r] = total;
        }
    }
    __syncthreads();
    if (threadIdx.x < ROUTER_ROWS && row0 + threadIdx.x < n_experts) {
        float total = 0.0f;
        for (u32 w = 0; w < NORM_BLOCK / 32; ++w) {
            total += partial[w][threadIdx.x];
        }
        const u32 e = row0 + threadIdx.x;
        logits[(u64)t * n_experts + e] = bias != nullptr ? total * scale + bias[e] : total * scale;
    }
    // Every block's logits and codes are written before its ticket is taken; the block taking
    // the last ticket sees them all.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(tickets + t, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) {
        return;
    }
    __threadfence();
    if (warp == 0) {
        route_token(logits + (u64)t * n_experts, expert_scale, ids + (u64)t * n_used, weights + (u64)t * n_used, n_experts,
                    n_used, renormalize, nullptr);
        if (lane == 0) {
            tickets[t] = 0;
        }
    }
}

// Causal depthwise convolution then SiLU of each sequence of the step, continuing from its
// state (the last kernel - 1 inputs, oldest first: state[j][channel]) and leaving its last
// inputs there; a sequence at position 0 starts from zeros. slots[s] (f32) is the state slot
// of the step's sequence s (one of n_slots). One thread per (sequence, channel), n = max sequences * channels.
extern "C" __global__ void ssm_conv_f32(
    float* out, const float* x, const float* weight, float* state, const float* slots, u32 n_slots, const u32* step,
    u32 channels, u32 kernel, u64 n) {
    wait_for_inputs();
    const u64 live = (u64)step[STEP_N_SEQS] * channels;
    for (u64 i = global_thread_index(); i < n && i < live; i += global_thread_count()) {
        const u32 s = i / channels;
        const u32 ch = i % channels;
        const u32* seq = step_seq(step, s);
        const u32 first = seq[SEQ_FIRST_TOKEN];
        if (!(slots[s] >= 0.0f && slots[s] < (float)n_slots)) {
            // No state to continue from: NaN outputs rather than another sequence's state.
            for (u32 t = first; t < first + seq[SEQ_N_TOKENS]; ++t) {
                out[(u64)t * channels + ch] = __int_as_float(0x7fc00000);
            }
            continue;
        }
        float* st = state + (u64)slots[s] * (kernel - 1) * channels;
        float w[CONV_MAX_KERNEL];
        float past[CONV_MAX_KERNEL];
#pragma unroll
        for (u32 j = 0; j < CONV_MAX_KERNEL; ++j) {
            w[j] = j < kernel ? weight[(u64)ch * kernel + j] : 0.0f;
            past[j] = j + 1 < kernel && seq[SEQ_POS0] != 0 ? st[(u64)j * channels + ch] : 0.0f;
        }
        // CONV_BATCH tokens' inputs are loaded before any output is stored (out may alias x as
        // far as the compiler knows), so a prompt's loads overlap instead of one per token.
        const u32 end = first + seq[SEQ_N_TOKENS];
        for (u32 t0 = first; t0 < end; t0 += CONV_BATCH) {
            float batch[CONV_BATCH];
#pragma unroll
            for (u32 b = 0; b < CONV_BATCH; ++b) {
                batch[b] = t0 + b < end ? x[(u64)(t0 + b) * channels + ch] : 0.0f;
            }
#pragma unroll
            for (u32 b = 0; b < CONV_BATCH; ++b) {
                if (t0 + b >= end) {
                    break;
                }
                const float v = batch[b];
                float y = w[kernel - 1] * v;
#pragma unroll
                for (u32 j = 0; j + 1 < CONV_MAX_KERNEL; ++j) {
                    if (j + 1 < kernel) {
                        y += w[j] * past[j];
                    }
                }
                out[(u64)(t0 + b) * channels + ch] = y / (1.0f + expf(-y));
                // Shifted with constant indices only, so `past` stays in registers.
#pragma unroll
                for (u32 j = 0; j + 1 < CONV_MAX_KERNEL; ++j) {
                    if (j + 2 < kernel) {
                        past[j] = past[j + 1];
                    } else if (j + 2 == kernel) {
                        past[j] = v;
                    }
                }
            }
        }
#pragma unroll
        for (u32 j = 0; j + 1 < CONV_MAX_KERNEL; ++j) {
            if (j + 1 < kernel) {
                st[(u64)j * channels + ch] = past[j];
            }
        }
    }
}

// ---- A prompt's expert slots grouped by expert (see matvec_expert_groups in matvec.cuh) ----

#define GROUP_THREADS 1024
#define GROUP_MAX_EXPERTS 1024
#define NO_SLOT 0xffffffffu

// Sorts the n_slots slots by their expert (ids) into groups of up to `group` slots of one
// expert: group_slot[g * group + i] is the i-th slot of group g (NO_SLOT past its count),
// group_expert[g] its expert, *n_groups how many there are (at most max_groups). A slot whose
// id names no expert joins no group; its `rows` outputs of `out` become NaN here. The order of
// slots within an expert is not fixed, and need not be: a slot's product depends only on its
// own row and expert. One block of GROUP_THREADS threads.
extern "C" __global__ void __launch_bounds__(GROUP_THREADS) moe_group_slots(
    const float* ids, u32 n_slots, u32 n_experts, u32 group, u32 max_groups, u32* group_slot, u32* group_expert, u32* n_groups,
    float* out, u32 rows) {
    wait_for_inputs();
    __shared__ u32 count[GROUP_MAX_EXPERTS];
    __shared__ u32 first_group[GROUP_MAX_EXPERTS];
    const u32 tid = threadIdx.x;
    for (u32 e = tid; e < n_experts; e += GROUP_THREADS) {
        count[e] = 0;
    }
    for (u32 i = tid; i < max_groups * group; i += GROUP_THREADS) {
        group_slot[i] = NO_SLOT;
    }
    __syncthreads();
    for (u32 s = tid; s < n_slots; s += GROUP_THREADS) {
        const u32 e = expert_of(ids[s], n_experts);
        if (e < n_experts) {
            atomicAdd(&count[e], 1u);
        } else {
            for (u32 r = 0; r < rows; ++r) {
                out[(u64)s * rows + r] = __int_as_float(0x7fc00000);
            }
        }
    }
    __syncthreads();
    if (tid == 0) {
        u32 g = 0;
        for (u32 e = 0; e < n_experts; ++e) {
            first_group[e] = g;
            g += (count[e] + group - 1) / group;
            count[e] = 0;
        }
        *n_groups = g;
    }
    __syncthreads();
    for (u32 s = tid; s < n_slots; s += GROUP_THREADS) {
        const u32 e = expert_of(ids[s], n_experts);
        if (e < n_experts) {
            const u32 p = atomicAdd(&count[e], 1u);
            const u32 g = first_group[e] + p / group;
            group_slot[g * group + p % group] = s;
            if (p % group == 0) {
                group_expert[g] = e;
            }
        }
    }
}

// dst[g * group + i] = the input row of slot group_slot[g * group + i] (token slot / n_used, or
// the slot itself when per_slot), zeros for NO_SLOT, rows of `cols` values, for the live
// groups; n bounds the launch (max_groups * group * cols).
extern "C" __global__ void moe_gather_rows(
    float* dst, const float* src, const u32* group_slot, const u32* n_groups, u32 group, u32 n_used, u32 per_slot, u32 cols, u64 n) {
    wait_for_inputs();
    const u64 live = (u64)*n_groups * group * cols;
    for (u64 i = global_thread_index(); i < n && i < live; i += global_thread_count()) {
        const u32 slot = group_slot[i / cols];
        const u64 row = per_slot ? slot : slot / n_used;
        dst[i] = slot == NO_SLOT ? 0.0f : src[row * cols + i % cols];
    }
}

// out[group_slot[j]] = src[j], rows of `rows` values, for the live groups' slots.
extern "C" __global__ void moe_scatter_rows(float* out, const float* src, const u32* group_slot, const u32* n_groups, u32 group, u32 rows, u64 n) {
    wait_for_inputs();
    const u64 live = (u64)*n_groups * group * rows;
    for (u64 i = global_thread_index(); i < n && i < live; i += global_thread_count()) {
        const u32 slot = group_slot[i / rows];
        if (slot != NO_SLOT) {
            out[(u64)slot * rows + i % rows] = src[i];
        }
    }
}
