// What kernel boundaries cost a Qwen3-8B Q1_0 decode token, standalone: 36 layers of one token
// (grouped Q1_0 weights, an f16 KV cache of CTX positions), computed four ways with the same
// device functions:
//   kernels     nine launches a layer in a CUDA graph, as kiln's step graph: norm-quantize, q/k/v,
//               attention (q/k norms, rope, the new K/V stored), quantize, o + residual,
//               norm-quantize, gate/up SwiGLU, quantize, down + residual; with programmatic
//               edges (each kernel fetches its first weights, then waits for its inputs) or serial;
//   blocks prepare their inputs
//               five launches a layer (q/k/v, attention, o, gate/up, down): every product block
//               norms and quantizes its input into its shared memory itself;
//   persistent  one launch for all layers: every phase's rows spread over all resident blocks,
//               five grid barriers a layer, and each block redoing the norm / quantization of a
//               product's input into its own shared memory instead of a launch of its own.
// And three timing-only ways with the input preparation left out (each product reads the quantized
// activations as they stand): five launches a layer, as kiln's step where its products prepare
// the next one's input, against the persistent kernel; the boundaries alone, compared; and the
// persistent kernel with every block copying its share of each product's weights into its shared
// memory two phases ahead (the weight stream under the barriers and the attention).
// Prints µs per layer of each, and checks that the first four give the same residual stream (same code,
// same order of every sum: the difference must be 0); then what one boundary costs alone (a
// grid barrier; an empty kernel after another). Run on the GPU machine:
//     nvcc -O3 -arch=sm_90 -o /tmp/plp scripts/persistent-layer-probe.cu && /tmp/plp [ctx]
#include <type_traits>
#include "q1-grouped.cuh"

typedef unsigned char u8;
constexpr int HIDDEN = 4096, HEAD_DIM = 128, Q_HEADS = 32, KV_HEADS = 8, FF = 12288, LAYERS = 36;
constexpr int Q_ROWS = Q_HEADS * HEAD_DIM, KV_ROWS = KV_HEADS * HEAD_DIM, QKV_ROWS = Q_ROWS + 2 * KV_ROWS;
constexpr int THREADS = 256, WARPS = THREADS / 32;
constexpr int ROWS = 8;          // rows a warp computes in a plain product
constexpr int SWIGLU_ROWS = 4;   // gate rows (and as many up rows) a warp computes
constexpr float EPS = 1e-6f, ROPE_BASE = 1000000.0f;

// A Q1_0 weight in kiln's grouped layout: codes [rows][groups] of 16 bytes (bit k of byte b is
// the sign of value 128 g + 16 k + b), one f16 scale per group; value = d (2 bit - 1).
struct Q1 {
    const uint4* codes;
    const __half* scales;
    int rows, groups;
};

struct Layer {
    Q1 qkv, o, gate, up, down;
    const float *attn_norm, *ffn_norm, *q_norm, *k_norm;
    __half *k_cache, *v_cache;  // [KV_HEADS][ctx + 1][HEAD_DIM]
};

// The residual stream and the activations between phases (global memory).
struct Stream {
    float *x, *qkv, *attn, *h;
    uint4* xq;     // the kernels variant's quantized activations: chunks of 16 int8
    float2* xds;   // (scale, scale * code sum) per chunk
};

__device__ __forceinline__ void wait_for_inputs() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

__device__ __forceinline__ float block_sum(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) s += red[w];
    return s;
}

__device__ __forceinline__ float block_max(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m = fmaxf(m, red[w]);
    return m;
}

// By a whole block: x (n values), times rms(x) and `norm` when given, quantized to int8 in
// chunks of 16 into xq / xds (global or shared memory). x is read with plain loads: in the
// persistent kernel it was written by other blocks of the same launch.
__device__ void norm_quantize(const float* x, const float* norm, int n, uint4* xq, float2* xds, float* red) {
    float scale = 1.0f;
    if (norm) {
        float ss = 0.0f;
        for (int i = threadIdx.x; i < n / 4; i += THREADS) {
            const float4 v = reinterpret_cast<const float4*>(x)[i];
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        scale = rsqrtf(block_sum(ss, red) / n + EPS);
    }
    for (int c = threadIdx.x; c < n / 16; c += THREADS) {
        float v[16], amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            v[i] = x[16 * c + i] * scale * (norm ? norm[16 * c + i] : 1.0f);
            amax = fmaxf(amax, fabsf(v[i]));
        }
        const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        u32 w[4] = {0, 0, 0, 0};
        int sum = 0;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const int q = __float2int_rn(v[i] * inv);
            sum += q;
            w[i / 4] |= (u32)(q & 0xff) << (8 * (i % 4));
        }
        xq[c] = make_uint4(w[0], w[1], w[2], w[3]);
        xds[c] = make_float2(d, d * (float)sum);
    }
    __syncthreads();
}

// Rows first_a .. first_a + RA of `a` and first_b .. first_b + R - RA of `b` (a row past its
// weight's end reads the last row) dotted with the activations by one warp; every lane ends with
// the sums. With `wait`, the first group's codes are fetched before waiting for the kernel
// before this one.
template <int R, int RA>
__device__ __forceinline__ void rows_dot(const Q1& a, int first_a, const Q1& b, int first_b, const uint4* xq, const float2* xds, bool wait,
                                         float (&acc)[R]) {
    const int lane = threadIdx.x & 31, groups = a.groups;
    const uint4* codes[R];
    const __half* scales[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const Q1& w = r < RA ? a : b;
        const size_t at = (size_t)min(r < RA ? first_a + r : first_b + r - RA, w.rows - 1) * groups;
        codes[r] = w.codes + at;
        scales[r] = w.scales + at;
    }
    lane_dots<R, false>(groups, xq, xds, [&](int g, uint4(&c)[R], float(&d)[R]) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            c[r] = __ldg(codes[r] + g);
            d[r] = __half2float(scales[r][g]);
        }
        if (wait && g == lane) wait_for_inputs();
    }, acc);
    if (wait && lane >= groups) wait_for_inputs();
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
    }
}

// Item i (ROWS rows of w) of a plain product: out[row] = (or +=) the row's dot.
__device__ __forceinline__ void plain_item(const Q1& w, int item, const uint4* xq, const float2* xds, float* out, bool add, bool wait) {
    float acc[ROWS];
    rows_dot<ROWS, ROWS>(w, item * ROWS, w, 0, xq, xds, wait, acc);
    const int lane = threadIdx.x & 31, row = item * ROWS + lane;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (lane == r && row < w.rows) out[row] = add ? out[row] + acc[r] : acc[r];
    }
}

// Item i (SWIGLU_ROWS rows of gate and up) of the SwiGLU product.
__device__ __forceinline__ void swiglu_item(const Q1& gate, const Q1& up, int item, const uint4* xq, const float2* xds, float* out, bool wait) {
    float acc[2 * SWIGLU_ROWS];
    rows_dot<2 * SWIGLU_ROWS, SWIGLU_ROWS>(gate, item * SWIGLU_ROWS, up, item * SWIGLU_ROWS, xq, xds, wait, acc);
    const int lane = threadIdx.x & 31, row = item * SWIGLU_ROWS + lane;
#pragma unroll
    for (int r = 0; r < SWIGLU_ROWS; ++r) {
        const float g = acc[r];
        if (lane == r && row < gate.rows) out[row] = g / (1.0f + __expf(-g)) * acc[SWIGLU_ROWS + r];
    }
}

// RMS norm of one head (HEAD_DIM values in shared memory) by a whole block,
// then NEOX rope at `pos`. The block must sync before and after.
__device__ void norm_rope_head(float* v, const float* norm, int pos, float* red) {
    float ss = 0.0f;
    if (threadIdx.x < HEAD_DIM) ss = v[threadIdx.x] * v[threadIdx.x];
    const float scale = rsqrtf(block_sum(ss, red) / HEAD_DIM + EPS);
    float a = 0.0f, b = 0.0f;
    const int i = threadIdx.x;
    if (i < HEAD_DIM / 2) {
        const float inv_freq = __powf(ROPE_BASE, -2.0f * i / HEAD_DIM), angle = pos * inv_freq;
        float s, c;
        __sincosf(angle, &s, &c);
        const float x0 = v[i] * scale * norm[i], x1 = v[i + HEAD_DIM / 2] * scale * norm[i + HEAD_DIM / 2];
        a = x0 * c - x1 * s;
        b = x0 * s + x1 * c;
    }
    __syncthreads();
    if (i < HEAD_DIM / 2) {
        v[i] = a;
        v[i + HEAD_DIM / 2] = b;
    }
    __syncthreads();
}

// Attention of q-head `head` for the token at position ctx over positions 0..ctx (the cache
// holds 0..ctx-1; the new key and value come from qkv), by a whole block; the first q-head of
// each group stores the new key and value into the cache. smem: ATTN_SMEM(ctx) floats.
#define ATTN_SMEM(ctx) ((3 + WARPS) * HEAD_DIM + (ctx) + 1)
__device__ void attention_head(const Layer& L, const float* qkv, float* attn, int head, int ctx, float* smem, float* red) {
    float *q = smem, *k = smem + HEAD_DIM, *v = smem + 2 * HEAD_DIM, *part = smem + 3 * HEAD_DIM, *score = part + WARPS * HEAD_DIM;
    const int kv = head / (Q_HEADS / KV_HEADS), t = threadIdx.x, lane = t & 31, warp = t >> 5;
    if (t < HEAD_DIM) {
        q[t] = qkv[head * HEAD_DIM + t];
        k[t] = qkv[Q_ROWS + kv * HEAD_DIM + t];
        v[t] = qkv[Q_ROWS + KV_ROWS + kv * HEAD_DIM + t];
    }
    __syncthreads();
    norm_rope_head(q, L.q_norm, ctx, red);
    norm_rope_head(k, L.k_norm, ctx, red);
    const size_t stride = (size_t)(ctx + 1) * HEAD_DIM;
    __half* kc = L.k_cache + kv * stride;
    __half* vc = L.v_cache + kv * stride;
    if (head % (Q_HEADS / KV_HEADS) == 0 && t < HEAD_DIM) {
        kc[(size_t)ctx * HEAD_DIM + t] = __float2half(k[t]);
        vc[(size_t)ctx * HEAD_DIM + t] = __float2half(v[t]);
    }
    // Scores: a thread per position, its whole key row in 16 loads.
    const float scale = rsqrtf((float)HEAD_DIM);
    for (int p = t; p <= ctx; p += THREADS) {
        float s = 0.0f;
        if (p < ctx) {
            const uint4* row = reinterpret_cast<const uint4*>(kc + (size_t)p * HEAD_DIM);
            uint4 raw[HEAD_DIM / 8];
#pragma unroll
            for (int i = 0; i < HEAD_DIM / 8; ++i) raw[i] = row[i];
#pragma unroll
            for (int i = 0; i < HEAD_DIM / 8; ++i) {
                const __half2* h = reinterpret_cast<const __half2*>(&raw[i]);
                const float4 qa = *reinterpret_cast<const float4*>(q + 8 * i), qb = *reinterpret_cast<const float4*>(q + 8 * i + 4);
                const float2 f0 = __half22float2(h[0]), f1 = __half22float2(h[1]), f2 = __half22float2(h[2]), f3 = __half22float2(h[3]);
                s += qa.x * f0.x + qa.y * f0.y + qa.z * f1.x + qa.w * f1.y + qb.x * f2.x + qb.y * f2.y + qb.z * f3.x + qb.w * f3.y;
            }
        } else {
            for (int d = 0; d < HEAD_DIM; ++d) s += q[d] * k[d];
        }
        score[p] = s * scale;
    }
    __syncthreads();
    float m = -INFINITY;
    for (int p = t; p <= ctx; p += THREADS) m = fmaxf(m, score[p]);
    m = block_max(m, red);
    float sum = 0.0f;
    for (int p = t; p <= ctx; p += THREADS) {
        const float e = __expf(score[p] - m);
        score[p] = e;
        sum += e;
    }
    sum = block_sum(sum, red);  // its barriers also publish the exponentials
    // Output: a warp per position, four dimensions a lane; the warps' sums meet in `part`.
    float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 8
    for (int p = warp; p < ctx; p += WARPS) {
        const uint2 raw = *reinterpret_cast<const uint2*>(vc + (size_t)p * HEAD_DIM + 4 * lane);
        const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&raw.x)), b = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
        const float sp = score[p];
        o[0] += sp * a.x;
        o[1] += sp * a.y;
        o[2] += sp * b.x;
        o[3] += sp * b.y;
    }
    if (warp == 0) {
#pragma unroll
        for (int i = 0; i < 4; ++i) o[i] += score[ctx] * v[4 * lane + i];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) part[warp * HEAD_DIM + 4 * lane + i] = o[i];
    __syncthreads();
    if (t < HEAD_DIM) {
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) total += part[w * HEAD_DIM + t];
        attn[head * HEAD_DIM + t] = total / sum;
    }
    __syncthreads();
}

// ---- The kernels variant: nine launches a layer ----

__global__ void __launch_bounds__(THREADS) k_norm_quantize(const float* x, const float* norm, int n, uint4* xq, float2* xds) {
    __shared__ float red[WARPS];
    wait_for_inputs();
    norm_quantize(x, norm, n, xq, xds, red);
}

__global__ void __launch_bounds__(THREADS, 2) k_plain(Q1 w, const uint4* xq, const float2* xds, float* out, int add) {
    const int item = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (item * ROWS >= w.rows) {
        wait_for_inputs();
        return;
    }
    plain_item(w, item, xq, xds, out, add, true);
}

__global__ void __launch_bounds__(THREADS, 2) k_swiglu(Q1 gate, Q1 up, const uint4* xq, const float2* xds, float* out) {
    const int item = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (item * SWIGLU_ROWS >= gate.rows) {
        wait_for_inputs();
        return;
    }
    swiglu_item(gate, up, item, xq, xds, out, true);
}

__global__ void __launch_bounds__(THREADS) k_attention(Layer L, const float* qkv, float* attn, int ctx) {
    extern __shared__ __align__(16) float smem[];
    __shared__ float red[WARPS];
    wait_for_inputs();
    attention_head(L, qkv, attn, blockIdx.x, ctx, smem, red);
}

// ---- The fused-input variant: five launches a layer, every product block preparing its input ----

// The L2 fetch of the first codes of rows first .. first + count of w, before waiting for the
// kernel before.
__device__ __forceinline__ void prefetch_rows(const Q1& w, int first, int count) {
    const int lane = threadIdx.x & 31;
    for (int r = 0; r < count; ++r) {
        const int row = min(first + r, w.rows - 1);
        if (lane < w.groups) asm volatile("prefetch.global.L2 [%0];" ::"l"(w.codes + (size_t)row * w.groups + lane));
    }
}

// A plain product of `w` (`swiglu` 0) or the SwiGLU of `w` and `up`, its input normed and
// quantized by every block.
__global__ void __launch_bounds__(THREADS, 2) k_fused(Q1 w, Q1 up, int swiglu, const float* in, const float* norm, int n, float* out, int add) {
    extern __shared__ __align__(16) float smem[];
    __shared__ float red[WARPS];
    uint4* xq = reinterpret_cast<uint4*>(smem);
    float2* xds = reinterpret_cast<float2*>(xq + n / 16);
    const int item = blockIdx.x * WARPS + (threadIdx.x >> 5), rows = swiglu ? SWIGLU_ROWS : ROWS;
    prefetch_rows(w, item * rows, rows);
    if (swiglu) prefetch_rows(up, item * rows, rows);
    wait_for_inputs();
    norm_quantize(in, norm, n, xq, xds, red);
    if (item * rows >= w.rows) return;
    if (swiglu) {
        swiglu_item(w, up, item, xq, xds, out, false);
    } else {
        plain_item(w, item, xq, xds, out, add, false);
    }
}

// ---- The persistent variant ----

__device__ __forceinline__ u32 load_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Every block of the grid arrives before any leaves; what the blocks wrote before is visible
// after. `arrived` counts arrivals over the launch (zeroed before it).
__device__ __forceinline__ void grid_barrier(u32* arrived, u32& target) {
    target += gridDim.x;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(arrived, 1u);
        while (load_acquire(arrived) < target) {
        }
        __threadfence();
    }
    __syncthreads();
}

// Items of a phase go round the blocks first, so that every multiprocessor gets work.
__device__ __forceinline__ int first_item() { return (threadIdx.x >> 5) * gridDim.x + blockIdx.x; }
__device__ __forceinline__ int item_stride() { return gridDim.x * WARPS; }
__device__ __forceinline__ bool block_has_items(int items) { return (int)blockIdx.x < items; }

// A product phase of the persistent kernel (`up` and `swiglu` as in k_fused): the blocks with
// rows to compute norm and quantize the input into their shared memory (`smem`) and take their
// items; then every block meets at the barrier.
// With `prepared` (global quantized activations), the input is taken as it stands (timing only).
__device__ void product_phase(const Q1& w, const Q1& up, bool swiglu, const float* in, const float* norm, int n, float* out, bool add, float* smem, float* red,
                              const Stream& prepared, u32* arrived, u32& target) {
    uint4* xq = prepared.xq ? prepared.xq : reinterpret_cast<uint4*>(smem);
    float2* xds = prepared.xq ? prepared.xds : reinterpret_cast<float2*>(reinterpret_cast<uint4*>(smem) + n / 16);
    const int items = w.rows / (swiglu ? SWIGLU_ROWS : ROWS);
    if (block_has_items(items)) {
        if (!prepared.xq) norm_quantize(in, norm, n, xq, xds, red);
        for (int i = first_item(); i < items; i += item_stride()) {
            if (swiglu) {
                swiglu_item(w, up, i, xq, xds, out, false);
            } else {
                plain_item(w, i, xq, xds, out, add, false);
            }
        }
    }
    grid_barrier(arrived, target);
}

// `prepare` 0: every product reads s.xq / s.xds as they stand (timing only, wrong output).
__global__ void __launch_bounds__(THREADS, 2) k_persistent(const Layer* layers, Stream s, int ctx, u32* arrived, int prepare) {
    extern __shared__ __align__(16) float smem[];
    __shared__ float red[WARPS];
    float* attn_smem = smem + FF / 16 * 6;  // after the largest input's codes and scales
    Stream prepared = {};
    if (!prepare) prepared = s;
    u32 target = 0;
    for (int l = 0; l < LAYERS; ++l) {
        const Layer& L = layers[l];
        product_phase(L.qkv, L.qkv, false, s.x, L.attn_norm, HIDDEN, s.qkv, false, smem, red, prepared, arrived, target);
        for (int h = blockIdx.x; h < Q_HEADS; h += gridDim.x) attention_head(L, s.qkv, s.attn, h, ctx, attn_smem, red);
        grid_barrier(arrived, target);
        product_phase(L.o, L.o, false, s.attn, nullptr, Q_ROWS, s.x, true, smem, red, prepared, arrived, target);
        product_phase(L.gate, L.up, true, s.x, L.ffn_norm, HIDDEN, s.h, false, smem, red, prepared, arrived, target);
        product_phase(L.down, L.down, false, s.h, nullptr, FF, s.x, true, smem, red, prepared, arrived, target);
    }
}

// ---- The staged persistent variant (timing only, inputs prepared) ----
// Each block copies its share of a product's weights (codes and scales of its items) into its
// shared memory two phases ahead with cp.async, so that the weight stream runs on under the
// barriers, the attention and the other products, and a product's loop reads shared memory.
// Two buffers: A for q/k/v and gate/up, B for o and down; a product's copy is issued as soon as
// the product before it in the same buffer has been computed.

__device__ __forceinline__ void copy16_async(void* dst, const void* src) {
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits for every copy group but the newest, then publishes them to the whole block.
__device__ __forceinline__ void wait_all_but_newest() {
    asm volatile("cp.async.wait_group 1;" ::: "memory");
    __syncthreads();
}

// An item of a staged product: RA rows of a (from RA * item), then RB rows of b (from RB * item);
// its slot holds their codes [RA + RB][groups], then their scales [RA + RB][groups].
template <int RA, int RB>
struct Staged {
    static constexpr int R = RA + RB;
    static __device__ __forceinline__ size_t slot_bytes(int groups) { return (size_t)R * groups * 18; }
    // Items of this block: blockIdx.x + k gridDim.x, in slot k.
    static __device__ __forceinline__ int items(const Q1& a) { return a.rows / RA; }
    static __device__ __forceinline__ int block_items(const Q1& a) {
        const int n = items(a) - (int)blockIdx.x;
        return n > 0 ? (n + gridDim.x - 1) / gridDim.x : 0;
    }
    static __device__ void stage(const Q1& a, const Q1& b, u8* slots) {
        const int groups = a.groups, code_pieces = R * groups, per_slot = code_pieces + R * groups / 8;
        for (int t = threadIdx.x; t < block_items(a) * per_slot; t += THREADS) {
            const int k = t / per_slot, j = t % per_slot, item = blockIdx.x + k * gridDim.x;
            u8* slot = slots + k * slot_bytes(groups);
            if (j < code_pieces) {
                const int r = j / groups, g = j % groups;
                const uint4* row = r < RA ? a.codes + ((size_t)item * RA + r) * groups : b.codes + ((size_t)item * RB + r - RA) * groups;
                copy16_async(slot + 16 * j, row + g);
            } else {
                const int h = 8 * (j - code_pieces), r = h / groups, g = h % groups;  // 8 scales of one row
                const __half* row = r < RA ? a.scales + ((size_t)item * RA + r) * groups : b.scales + ((size_t)item * RB + r - RA) * groups;
                copy16_async(slot + 16 * code_pieces + 2 * h, row + g);
            }
        }
        copy_commit();
    }
    // The block's items from their slots, summed in rows_dot's order (the same bits as the
    // unstaged ways); `swiglu`: out = silu(a row) * b row, else out (+)= the a row.
    static __device__ void compute(const Q1& a, const u8* slots, const uint4* xq, const float2* xds, float* out, bool add) {
        const int groups = a.groups, lane = threadIdx.x & 31;
        for (int k = threadIdx.x >> 5; k < block_items(a); k += WARPS) {
            const int item = blockIdx.x + k * gridDim.x;
            const uint4* codes = reinterpret_cast<const uint4*>(slots + k * slot_bytes(groups));
            const __half* scales = reinterpret_cast<const __half*>(codes + R * groups);
            float acc[R];
            lane_dots<R, false>(groups, xq, xds, [&](int g, uint4(&c)[R], float(&d)[R]) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    c[r] = codes[r * groups + g];
                    d[r] = __half2float(scales[r * groups + g]);
                }
            }, acc);
#pragma unroll
            for (int r = 0; r < R; ++r) {
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
            }
            const int row = item * RA + lane;
#pragma unroll
            for (int r = 0; r < RA; ++r) {
                if (lane != r || row >= a.rows) continue;
                if constexpr (RB > 0) {
                    out[row] = acc[r] / (1.0f + __expf(-acc[r])) * acc[RA + r];
                } else {
                    out[row] = add ? out[row] + acc[r] : acc[r];
                }
            }
        }
    }
};
typedef Staged<ROWS, 0> StagedPlain;
typedef Staged<SWIGLU_ROWS, SWIGLU_ROWS> StagedSwiglu;

// Bytes of buffer A (q/k/v, gate/up) and B (o, down) for a grid of `blocks`.
static size_t staged_a_bytes(int blocks) {
    const size_t qkv = (size_t)(QKV_ROWS / ROWS + blocks - 1) / blocks * ROWS * (HIDDEN / 128) * 18;
    const size_t gate_up = (size_t)(FF / SWIGLU_ROWS + blocks - 1) / blocks * 2 * SWIGLU_ROWS * (HIDDEN / 128) * 18;
    return std::max(qkv, gate_up);
}
static size_t staged_b_bytes(int blocks) {
    const size_t o = (size_t)(HIDDEN / ROWS + blocks - 1) / blocks * ROWS * (Q_ROWS / 128) * 18;
    const size_t down = (size_t)(HIDDEN / ROWS + blocks - 1) / blocks * ROWS * (FF / 128) * 18;
    return std::max(o, down);
}

__global__ void __launch_bounds__(THREADS, 2) k_staged(const Layer* layers, Stream s, int ctx, u32* arrived, u32 a_bytes, u32 b_bytes) {
    extern __shared__ __align__(16) float smem[];
    __shared__ float red[WARPS];
    u8* buf_a = reinterpret_cast<u8*>(smem);
    u8* buf_b = buf_a + a_bytes;
    float* attn_smem = reinterpret_cast<float*>(buf_b + b_bytes);
    u32 target = 0;
    StagedPlain::stage(layers[0].qkv, layers[0].qkv, buf_a);
    StagedPlain::stage(layers[0].o, layers[0].o, buf_b);
    for (int l = 0; l < LAYERS; ++l) {
        const Layer& L = layers[l];
        const Layer* next = l + 1 < LAYERS ? &layers[l + 1] : nullptr;
        const Q1 none = {};  // after the last layer: an empty copy group, so every wait stays the same
        wait_all_but_newest();
        StagedPlain::compute(L.qkv, buf_a, s.xq, s.xds, s.qkv, false);
        __syncthreads();
        StagedSwiglu::stage(L.gate, L.up, buf_a);
        grid_barrier(arrived, target);
        for (int h = blockIdx.x; h < Q_HEADS; h += gridDim.x) attention_head(L, s.qkv, s.attn, h, ctx, attn_smem, red);
        grid_barrier(arrived, target);
        wait_all_but_newest();
        StagedPlain::compute(L.o, buf_b, s.xq, s.xds, s.x, true);
        __syncthreads();
        StagedPlain::stage(L.down, L.down, buf_b);
        grid_barrier(arrived, target);
        wait_all_but_newest();
        StagedSwiglu::compute(L.gate, buf_a, s.xq, s.xds, s.h, false);
        __syncthreads();
        StagedPlain::stage(next ? next->qkv : none, next ? next->qkv : none, buf_a);
        grid_barrier(arrived, target);
        wait_all_but_newest();
        StagedPlain::compute(L.down, buf_b, s.xq, s.xds, s.x, true);
        __syncthreads();
        StagedPlain::stage(next ? next->o : none, next ? next->o : none, buf_b);
        grid_barrier(arrived, target);
    }
}

// ---- What one boundary costs alone ----

__global__ void __launch_bounds__(THREADS) k_barriers(u32* arrived, int count) {
    u32 target = 0;
    for (int i = 0; i < count; ++i) grid_barrier(arrived, target);
}

// A kernel that only waits for the one before it.
__global__ void __launch_bounds__(THREADS) k_empty() { wait_for_inputs(); }

// ---- Host ----

__device__ __forceinline__ u32 random_word(size_t i, u32 seed) {
    u32 h = (u32)i * 0x9e3779b9u ^ seed;
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    return h;
}

// p[i] = random words (T = u32), or values in [lo, hi) (T = float, __half).
template <class T>
__global__ void fill_random(T* p, size_t n, u32 seed, float lo, float hi) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const u32 h = random_word(i, seed);
        if constexpr (std::is_same_v<T, u32>) {
            p[i] = h;
        } else {
            p[i] = (T)(lo + (hi - lo) * (h & 0xffffff) / 16777216.0f);
        }
    }
}

__global__ void copy_floats(float* dst, const float* src) { dst[blockIdx.x * blockDim.x + threadIdx.x] = src[blockIdx.x * blockDim.x + threadIdx.x]; }

static u32 next_seed = 1;

static Q1 random_q1(int rows, int cols) {
    const int groups = cols / 128;
    uint4* codes;
    __half* scales;
    CK(cudaMalloc(&codes, (size_t)rows * groups * 16));
    CK(cudaMalloc(&scales, (size_t)rows * groups * 2));
    fill_random<<<1024, 256>>>(reinterpret_cast<u32*>(codes), (size_t)rows * groups * 4, next_seed++, 0.0f, 0.0f);
    // |value| about 1 / sqrt(cols), so products of normed inputs stay near 1.
    const float d = 1.0f / sqrtf((float)cols);
    fill_random<<<1024, 256>>>(scales, (size_t)rows * groups, next_seed++, 0.5f * d, 1.5f * d);
    return Q1{codes, scales, rows, groups};
}

static float* random_floats(size_t n, float lo, float hi) {
    float* p;
    CK(cudaMalloc(&p, n * 4));
    fill_random<<<256, 256>>>(p, n, next_seed++, lo, hi);
    return p;
}

static double q1_bytes(const Q1& w) { return (double)w.rows * w.groups * 18; }

enum Edge { SERIAL, PROGRAMMATIC, COOPERATIVE };

// Launches `kernel` on `s`: after the kernel before it (SERIAL), with a programmatic edge to it,
// or as a cooperative grid (which fails rather than deadlocks when the grid cannot be resident).
template <typename... Args>
static void launch(Edge edge, cudaStream_t s, void (*kernel)(Args...), dim3 grid, size_t smem, Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    if (edge == COOPERATIVE) {
        attr[0].id = cudaLaunchAttributeCooperative;
        attr[0].val.cooperative = 1;
    } else {
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
    }
    cfg.attrs = attr;
    cfg.numAttrs = edge == SERIAL ? 0 : 1;
    CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// Nine launches a layer; without `prepare`, five: the single-block norm-quantizations left out
// (their inputs as they stand, timing only), what kiln's step reaches where its products
// prepare the next one's input.
static void layer_kernels(Edge edge, cudaStream_t st, const Layer& L, const Stream& s, int ctx, bool prepare = true) {
    const size_t attn_smem = ATTN_SMEM(ctx) * 4;
    if (prepare) launch(edge, st, k_norm_quantize, dim3(1), 0, (const float*)s.x, L.attn_norm, HIDDEN, s.xq, s.xds);
    launch(edge, st, k_plain, dim3((QKV_ROWS / ROWS + WARPS - 1) / WARPS), 0, L.qkv, (const uint4*)s.xq, (const float2*)s.xds, s.qkv, 0);
    launch(edge, st, k_attention, dim3(Q_HEADS), attn_smem, L, (const float*)s.qkv, s.attn, ctx);
    if (prepare) launch(edge, st, k_norm_quantize, dim3(1), 0, (const float*)s.attn, (const float*)nullptr, Q_ROWS, s.xq, s.xds);
    launch(edge, st, k_plain, dim3((HIDDEN / ROWS + WARPS - 1) / WARPS), 0, L.o, (const uint4*)s.xq, (const float2*)s.xds, s.x, 1);
    if (prepare) launch(edge, st, k_norm_quantize, dim3(1), 0, (const float*)s.x, L.ffn_norm, HIDDEN, s.xq, s.xds);
    launch(edge, st, k_swiglu, dim3((FF / SWIGLU_ROWS + WARPS - 1) / WARPS), 0, L.gate, L.up, (const uint4*)s.xq, (const float2*)s.xds, s.h);
    if (prepare) launch(edge, st, k_norm_quantize, dim3(1), 0, (const float*)s.h, (const float*)nullptr, FF, s.xq, s.xds);
    launch(edge, st, k_plain, dim3((HIDDEN / ROWS + WARPS - 1) / WARPS), 0, L.down, (const uint4*)s.xq, (const float2*)s.xds, s.x, 1);
}

static void layer_fused_inputs(cudaStream_t st, const Layer& L, const Stream& s, int ctx) {
    const size_t attn_smem = ATTN_SMEM(ctx) * 4, hidden_smem = HIDDEN / 16 * 24, ff_smem = FF / 16 * 24;
    const float* none = nullptr;
    launch(PROGRAMMATIC, st, k_fused, dim3((QKV_ROWS / ROWS + WARPS - 1) / WARPS), hidden_smem, L.qkv, L.qkv, 0, (const float*)s.x, L.attn_norm, HIDDEN, s.qkv, 0);
    launch(PROGRAMMATIC, st, k_attention, dim3(Q_HEADS), attn_smem, L, (const float*)s.qkv, s.attn, ctx);
    launch(PROGRAMMATIC, st, k_fused, dim3((HIDDEN / ROWS + WARPS - 1) / WARPS), hidden_smem, L.o, L.o, 0, (const float*)s.attn, none, Q_ROWS, s.x, 1);
    launch(PROGRAMMATIC, st, k_fused, dim3((FF / SWIGLU_ROWS + WARPS - 1) / WARPS), hidden_smem, L.gate, L.up, 1, (const float*)s.x, L.ffn_norm, HIDDEN, s.h, 0);
    launch(PROGRAMMATIC, st, k_fused, dim3((HIDDEN / ROWS + WARPS - 1) / WARPS), ff_smem, L.down, L.down, 0, (const float*)s.h, none, FF, s.x, 1);
}

int main(int argc, char** argv) {
    const int ctx = argc > 1 ? atoi(argv[1]) : 128;
    if (ctx < 1 || ctx > 8192) {  // the staged way's shared memory holds the scores of at most 8192
        printf("position must be 1..8192, not %s\n", argv[1]);
        return 1;
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, %d SMs; Qwen3-8B Q1_0 shape, %d layers, one token at position %d\n", prop.name, prop.multiProcessorCount, LAYERS, ctx);

    std::vector<Layer> layers(LAYERS);
    double weight_bytes = 0;
    for (Layer& L : layers) {
        L.qkv = random_q1(QKV_ROWS, HIDDEN);
        L.o = random_q1(HIDDEN, Q_ROWS);
        L.gate = random_q1(FF, HIDDEN);
        L.up = random_q1(FF, HIDDEN);
        L.down = random_q1(HIDDEN, FF);
        L.attn_norm = random_floats(HIDDEN, 0.8f, 1.2f);
        L.ffn_norm = random_floats(HIDDEN, 0.8f, 1.2f);
        L.q_norm = random_floats(HEAD_DIM, 0.8f, 1.2f);
        L.k_norm = random_floats(HEAD_DIM, 0.8f, 1.2f);
        const size_t cache = (size_t)KV_HEADS * (ctx + 1) * HEAD_DIM;
        CK(cudaMalloc(&L.k_cache, cache * 2));
        CK(cudaMalloc(&L.v_cache, cache * 2));
        fill_random<<<1024, 256>>>(L.k_cache, cache, next_seed++, -1.0f, 1.0f);
        fill_random<<<1024, 256>>>(L.v_cache, cache, next_seed++, -1.0f, 1.0f);
        weight_bytes += q1_bytes(L.qkv) + q1_bytes(L.o) + q1_bytes(L.gate) + q1_bytes(L.up) + q1_bytes(L.down);
    }
    Layer* d_layers;
    CK(cudaMalloc(&d_layers, sizeof(Layer) * LAYERS));
    CK(cudaMemcpy(d_layers, layers.data(), sizeof(Layer) * LAYERS, cudaMemcpyHostToDevice));

    Stream s;
    float* x0 = random_floats(HIDDEN, -1.0f, 1.0f);
    CK(cudaMalloc(&s.x, HIDDEN * 4));
    CK(cudaMalloc(&s.qkv, QKV_ROWS * 4));
    CK(cudaMalloc(&s.attn, Q_ROWS * 4));
    CK(cudaMalloc(&s.h, FF * 4));
    CK(cudaMalloc(&s.xq, FF));
    CK(cudaMalloc(&s.xds, FF / 16 * 8));
    u32* arrived;
    CK(cudaMalloc(&arrived, 4));
    CK(cudaDeviceSynchronize());

    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const size_t attn_smem = ATTN_SMEM(ctx) * 4;
    CK(cudaFuncSetAttribute(k_attention, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)attn_smem));
    const size_t persistent_smem = FF / 16 * (16 + 8) + attn_smem;
    CK(cudaFuncSetAttribute(k_persistent, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)persistent_smem));
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k_persistent, THREADS, persistent_smem));
    cudaFuncAttributes attr;
    CK(cudaFuncGetAttributes(&attr, k_persistent));
    printf("persistent kernel: %d registers, %zu B shared, %d blocks per SM\n", attr.numRegs, persistent_smem, per_sm);
    if (per_sm < 1) return 1;

    // The residual stream after one token, each way.
    // The last two leave the input preparation out: timing only (their output is not checked).
    constexpr int WAYS = 7, CHECKED = 4, STAGED = 6;
    std::vector<float> results[WAYS];
    const char* names[WAYS] = {"kernels, programmatic edges", "kernels, serial edges", "blocks prepare their inputs", "persistent",
                               "five kernels, inputs prepared", "persistent, inputs prepared", "persistent, weights staged"};
    auto persistent = [](int way) { return way == 3 || way >= 5; };
    auto staged_smem = [&](int blocks) { return staged_a_bytes(blocks) + staged_b_bytes(blocks) + attn_smem; };
    int staged_per_sm = 0;
    CK(cudaFuncSetAttribute(k_staged, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)staged_smem(prop.multiProcessorCount)));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&staged_per_sm, k_staged, THREADS, staged_smem(2 * prop.multiProcessorCount)));
    CK(cudaFuncGetAttributes(&attr, k_staged));
    printf("staged kernel: %d registers; %zu / %zu B shared at 2 / 1 blocks per SM (%d resident at 2)\n", attr.numRegs,
           staged_smem(2 * prop.multiProcessorCount), staged_smem(prop.multiProcessorCount), staged_per_sm);
    staged_per_sm = std::max(1, std::min(staged_per_sm, 2));
    float us[WAYS][2];
    for (int way = 0; way < WAYS; ++way) {
        auto token = [&](cudaStream_t stream, int blocks) {
            // A kernel, so that the first layer's programmatic edge follows a kernel.
            launch(SERIAL, stream, copy_floats, dim3(HIDDEN / THREADS), 0, s.x, (const float*)x0);
            if (way < 2 || way == 4) {
                for (const Layer& L : layers) layer_kernels(way == 1 ? SERIAL : PROGRAMMATIC, stream, L, s, ctx, way != 4);
            } else if (way == 2) {
                for (const Layer& L : layers) layer_fused_inputs(stream, L, s, ctx);
            } else if (way == STAGED) {
                CK(cudaMemsetAsync(arrived, 0, 4, stream));
                launch(COOPERATIVE, stream, k_staged, dim3(blocks), staged_smem(blocks), (const Layer*)d_layers, s, ctx, arrived,
                       (u32)staged_a_bytes(blocks), (u32)staged_b_bytes(blocks));
            } else {
                CK(cudaMemsetAsync(arrived, 0, 4, stream));
                launch(COOPERATIVE, stream, k_persistent, dim3(blocks), persistent_smem, (const Layer*)d_layers, s, ctx, arrived, (int)(way == 3));
            }
        };
        for (int grid_pass = 0; grid_pass < (persistent(way) ? 2 : 1); ++grid_pass) {
            // The persistent kernel with every resident block, then with one block per SM.
            const int blocks = prop.multiProcessorCount * (grid_pass == 0 ? (way == STAGED ? staged_per_sm : per_sm) : 1);
            cudaGraph_t g;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            token(st, blocks);
            CK(cudaStreamEndCapture(st, &g));
            cudaGraphExec_t e;
            CK(cudaGraphInstantiate(&e, g, 0ull));
            CK(cudaGraphLaunch(e, st));
            CK(cudaStreamSynchronize(st));
            if (grid_pass == 0) {
                results[way].resize(HIDDEN);
                CK(cudaMemcpy(results[way].data(), s.x, HIDDEN * 4, cudaMemcpyDeviceToHost));
            }
            us[way][grid_pass] = time_graph(e, st, LAYERS);
            CK(cudaGraphExecDestroy(e));
            CK(cudaGraphDestroy(g));
        }
    }
    // One boundary alone: a grid barrier of the persistent grid, and an empty kernel of as many
    // blocks after another, with either edge.
    {
        const int blocks = prop.multiProcessorCount * per_sm, count = 1000;
        float boundary_us[3];
        for (int kind = 0; kind < 3; ++kind) {
            cudaGraph_t g;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            if (kind == 0) {
                CK(cudaMemsetAsync(arrived, 0, 4, st));
                launch(COOPERATIVE, st, k_barriers, dim3(blocks), 0, arrived, count);
            } else {
                for (int i = 0; i < count; ++i) launch(kind == 1 ? PROGRAMMATIC : SERIAL, st, k_empty, dim3(blocks), 0);
            }
            CK(cudaStreamEndCapture(st, &g));
            cudaGraphExec_t e;
            CK(cudaGraphInstantiate(&e, g, 0ull));
            boundary_us[kind] = time_graph(e, st, count);
            CK(cudaGraphExecDestroy(e));
            CK(cudaGraphDestroy(g));
        }
        printf("\none boundary, %d blocks of %d threads: grid barrier %.2f us; empty kernel after another: programmatic %.2f us, serial %.2f us\n", blocks,
               THREADS, boundary_us[0], boundary_us[1], boundary_us[2]);
    }
    const double layer_mb = weight_bytes / LAYERS / 1e6;
    printf("\nweights %.1f MB a layer; the copy ceiling (4.23 TB/s) is %.2f us a layer\n", layer_mb, layer_mb / 4.23e6 * 1e6);
    printf("%-30s | us a layer | tok/s (layers only) | GB/s | max |x - kernels|\n", "way");
    for (int way = 0; way < WAYS; ++way) {
        double diff = 0, norm = 0;
        for (int i = 0; i < HIDDEN; ++i) {
            diff = fmax(diff, fabs((double)results[way][i] - results[0][i]));
            norm = fmax(norm, fabs((double)results[0][i]));
        }
        printf("%-30s | %10.2f | %19.0f | %4.0f | ", names[way], us[way][0], 1e6 / (us[way][0] * LAYERS), layer_mb * 1e3 / us[way][0]);
        if (way < CHECKED) {
            printf("%.3e (of %.2f)\n", diff, norm);
        } else {
            // The timing-only ways read the same stale inputs: they must agree with each other.
            double same = 0;
            for (int i = 0; i < HIDDEN; ++i) same = fmax(same, fabs((double)results[way][i] - results[CHECKED][i]));
            printf("timing only (%.1e from the five kernels')\n", same);
        }
        if (persistent(way)) printf("%-30s | %10.2f |\n", "  the same, one block per SM", us[way][1]);
    }
    return 0;
}
