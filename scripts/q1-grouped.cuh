// kiln's grouped Q1_0 mat-vec at one token, standalone (for scripts/q1-matvec-variants.cu and
// scripts/l2-prefetch-probe.cu): codes [rows][groups] of 16 bytes, f16 scales [rows][groups],
// int8 activations in chunks of 16 with (scale, scale * code sum) per chunk.
#pragma once
#include "harness.cuh"

#define BIAS 0x4b400000
#define BIAS_F 12582912.0f

// An activation load: read-only cache (`__ldg`) when the activations are in global memory and
// not written by this launch, a plain load otherwise (shared memory, or written by other blocks).
template <bool NC, class T>
__device__ __forceinline__ T load_x(const T* p) {
    if constexpr (NC) return __ldg(p);
    return *p;
}

// acc[r] += group g of row r (codes c[r], scale d[r]) dotted with the int8 activations; bit k of
// byte b of a group is the sign of value 128 g + 16 k + b.
template <int R, bool NC = true>
__device__ __forceinline__ void group_dot(const uint4 (&c)[R], const float (&d)[R], const uint4* __restrict__ xq,
                                          const float2* __restrict__ xds, int g, float (&acc)[R]) {
    float xd[8], xs = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; k += 2) {
        const float4 p = load_x<NC>(reinterpret_cast<const float4*>(xds + g * 8 + k));
        xd[k] = p.x * (2.0f / (float)(1 << k));
        xd[k + 1] = p.z * (2.0f / (float)(1 << (k + 1)));
        xs += p.y + p.w;
    }
    float part[R];
#pragma unroll
    for (int r = 0; r < R; ++r) part[r] = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const uint4 x = load_x<NC>(xq + g * 8 + k);
        const u32 mask = 0x01010101u << k;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            int dot = dp4a_us(c[r].x & mask, (int)x.x, BIAS);
            dot = dp4a_us(c[r].y & mask, (int)x.y, dot);
            dot = dp4a_us(c[r].z & mask, (int)x.z, dot);
            dot = dp4a_us(c[r].w & mask, (int)x.w, dot);
            part[r] = fmaf(xd[k], __int_as_float(dot) - BIAS_F, part[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = fmaf(d[r], part[r] - xs, acc[r]);
}

template <int R>
__device__ __forceinline__ void finish(float (&acc)[R], float* out, int row0, int rows, int lane) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        float v = acc[r];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == r && row0 + r < rows) out[row0 + r] = v;
        acc[r] = 0.0f;
    }
}

template <int R>
__device__ __forceinline__ void fetch(const uint4* __restrict__ codes, const __half* __restrict__ scales, int row0,
                                      int rows, int groups, int g, uint4 (&c)[R], float (&d)[R]) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const size_t at = (size_t)min(row0 + r, rows - 1) * groups + min(g, groups - 1);
        c[r] = __ldg(codes + at);
        d[r] = __half2float(scales[at]);
    }
}

// acc[r] = this lane's share of row r's dot with the activations: lane l takes groups l, l + 32,
// ...; fetch(g, c, d) loads group g's codes and scale of every row.
template <int R, bool NC, class Fetch>
__device__ __forceinline__ void lane_dots(int groups, const uint4* xq, const float2* xds, Fetch fetch, float (&acc)[R]) {
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    for (int g = threadIdx.x & 31; g < groups; g += 32) {
        uint4 c[R];
        float d[R];
        fetch(g, c, d);
        group_dot<R, NC>(c, d, xq, xds, g, acc);
    }
}

// kiln today: a warp per R rows, lane l takes groups l, l + 32, ... of them (activations from
// global memory through the read-only cache, or from shared memory when NC is false).
template <int R, bool NC = true>
__device__ __forceinline__ void one_batch_rows(const uint4* codes, const __half* scales, const uint4* xq, const float2* xds,
                                               float* out, int rows, int groups) {
    const int lane = threadIdx.x & 31, row0 = (blockIdx.x * 4 + (threadIdx.x >> 5)) * R;
    if (row0 >= rows) return;
    float acc[R];
    lane_dots<R, NC>(groups, xq, xds, [&](int g, uint4(&c)[R], float(&d)[R]) { fetch<R>(codes, scales, row0, rows, groups, g, c, d); }, acc);
    finish<R>(acc, out, row0, rows, lane);
}

template <int R>
__global__ void __launch_bounds__(128) one_batch(const uint4* codes, const __half* scales, const uint4* xq,
                                                 const float2* xds, float* out, int rows, int groups) {
    one_batch_rows<R>(codes, scales, xq, xds, out, rows, groups);
}

// Random int8 activations of `cols` values (a multiple of 128) and synthetic chunk scales, on
// the host and the device.
struct Activations {
    std::vector<uint4> codes;
    std::vector<float2> scales;
    uint4* d_codes;
    float2* d_scales;
};

static Activations upload_activations(int cols) {
    Activations a{std::vector<uint4>(cols / 16), std::vector<float2>(cols / 16), nullptr, nullptr};
    for (auto& v : a.codes) v = make_uint4(rand(), rand(), rand(), rand());
    for (size_t i = 0; i < a.scales.size(); ++i) a.scales[i] = make_float2(0.01f * (1 + i % 7), 0.3f * ((int)(i % 5) - 2));
    CK(cudaMalloc(&a.d_codes, a.codes.size() * 16));
    CK(cudaMalloc(&a.d_scales, a.scales.size() * 8));
    CK(cudaMemcpy(a.d_codes, a.codes.data(), a.codes.size() * 16, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(a.d_scales, a.scales.data(), a.scales.size() * 8, cudaMemcpyHostToDevice));
    return a;
}
