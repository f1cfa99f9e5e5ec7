// Device helpers shared by every kernel file. Kernels are compiled by NVRTC with no CUDA
// toolkit headers available, so this file uses only built-in types, intrinsics and inline PTX.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef signed char i8;
typedef int i32;
typedef long long i64;

// ---- Half-precision formats, carried as raw 16-bit patterns ----

__device__ __forceinline__ float f16_bits_to_f32(u16 bits) {
    float value;
    asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(bits));
    return value;
}

// Round to nearest even, like every IEEE conversion on the host side.
__device__ __forceinline__ u16 f32_to_f16_bits(float value) {
    u16 bits;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
    return bits;
}

// Two f32 -> one f16x2 word (lo in the low half), round to nearest even.
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Eight values as f16 at `dst` (16-byte aligned), the tensor-core mat-mat's activations: with
// `permuted`, in the order the f16 Q4_K / Q6_K decode of the streaming tiles yields values
// (0, 2, 1, 3, 4, 6, 5, 7).
__device__ __forceinline__ void store_half8(u16* dst, const float (&v)[8], bool permuted) {
    const int a = permuted ? 2 : 1, b = permuted ? 1 : 2;
    *reinterpret_cast<uint4*>(dst) = make_uint4(pack_f16x2(v[0], v[a]), pack_f16x2(v[b], v[3]), pack_f16x2(v[4], v[4 + a]), pack_f16x2(v[4 + b], v[7]));
}

// bf16 is the top half of an f32, so widening is exact.
__device__ __forceinline__ float bf16_bits_to_f32(u16 bits) {
    return __uint_as_float(((u32)bits) << 16);
}

// Round to nearest even; NaNs stay NaN (quiet bit forced so truncation cannot make an Inf).
__device__ __forceinline__ u16 f32_to_bf16_bits(float value) {
    const u32 bits = __float_as_uint(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((bits >> 16) | 0x0040u);
    }
    const u32 rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
    return (u16)((bits + rounding_bias) >> 16);
}

// ---- Overlapped launches (programmatic dependent launch, sm_90 and later) ----
// In a step graph, a kernel of a source tagged `// kiln-waits-for-inputs` may start once every
// block of the kernel before it has exited, before that kernel's results are flushed: until
// wait_for_inputs() returns it may read only weights (never written during a step); after it,
// everything earlier kernels wrote is visible. Outside a graph, or below sm_90, it does nothing.
// A kernel that calls start_dependents() lets the kernel after it start as soon as all its own
// blocks have called it: used only around the decode attention, whose neighbours have few blocks
// or short waits (chains of early-started mat-vecs would crowd the SMs).

__device__ __forceinline__ void wait_for_inputs() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void start_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---- Gate activations of gated FFNs (host: kiln_core::Activation): act(gate) * up ----

#define GATE_SILU 0
#define GATE_GELU_TANH 1
#define GATE_SWIGLU_OAI 2

__device__ __forceinline__ float silu(float g) {
    return g / (1.0f + expf(-g));
}

// GELU with the tanh approximation, times up.
__device__ __forceinline__ float gelu_tanh_times(float g, float up) {
    const float sqrt_2_over_pi = 0.7978846f;
    return 0.5f * g * (1.0f + tanhf(sqrt_2_over_pi * (g + 0.044715f * g * g * g))) * up;
}

// gpt-oss: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit).
__device__ __forceinline__ float swiglu_oai_times(float gate, float up, float alpha, float limit) {
    const float g = fminf(gate, limit);
    return (fminf(fmaxf(up, -limit), limit) + 1.0f) * g / (1.0f + expf(-alpha * g));
}

__device__ __forceinline__ float sigmoid(float x) {
    return 1.0f / (1.0f + expf(-x));
}

// A Gated DeltaNet head's gates from their projections: the log of the state's decay,
// a_log_neg * softplus(g + dt_bias), and the write strength sigmoid(beta).
__device__ __forceinline__ float delta_net_log_decay(float g, float a_log_neg, float dt_bias) {
    const float z = g + dt_bias;
    return a_log_neg * (z > 20.0f ? z : log1pf(expf(z)));
}

__device__ __forceinline__ float gated(u32 act, float gate, float up, float alpha, float limit) {
    switch (act) {
        case GATE_GELU_TANH:
            return gelu_tanh_times(gate, up);
        case GATE_SWIGLU_OAI:
            return swiglu_oai_times(gate, up, alpha, limit);
        default:
            return silu(gate) * up;
    }
}

// ---- Indexing ----

// 64-bit so that tensors with more than 2^32 elements index correctly.
__device__ __forceinline__ u64 global_thread_index() {
    return (u64)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ u64 global_thread_count() {
    return (u64)gridDim.x * blockDim.x;
}

// ---- Reductions ----

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        value += __shfl_xor_sync(0xffffffffu, value, offset);
    }
    return value;
}

__device__ __forceinline__ float warp_max(float value) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
    }
    return value;
}

// Sum over a block of BLOCK threads (a multiple of 32, at most 1024); every thread gets the
// result. Contains __syncthreads, so all threads of the block must call it.
template <int BLOCK>
__device__ __forceinline__ float block_sum(float value) {
    static_assert(BLOCK % 32 == 0 && BLOCK <= 1024, "BLOCK must be a multiple of 32, at most 1024");
    __shared__ float warp_partials[BLOCK / 32];
    __shared__ float total;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    value = warp_sum(value);
    if (lane == 0) {
        warp_partials[warp] = value;
    }
    __syncthreads();
    if (warp == 0) {
        value = lane < BLOCK / 32 ? warp_partials[lane] : 0.0f;
        value = warp_sum(value);
        if (lane == 0) {
            total = value;
        }
    }
    __syncthreads();
    return total;
}

// Which of a stacked launch's weights block `index` belongs to (0, 1, 2), the first two taking
// `blocks_a` and `blocks_b` blocks; `index` becomes the block's index within that weight.
__device__ __forceinline__ u32 stacked_weight(u32& index, u32 blocks_a, u32 blocks_b) {
    if (index < blocks_a) {
        return 0;
    }
    index -= blocks_a;
    if (index < blocks_b) {
        return 1;
    }
    index -= blocks_b;
    return 2;
}
