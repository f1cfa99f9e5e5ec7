// Standalone F16 mat-vec variants on Llama-3-8B shapes (one token), weight GB/s of each, with the
// read-only roofline of the same harness; the numbers behind docs/performance-log.md "Float weights,
// one token". Run on the GPU machine (it needs the CUDA toolkit, not kiln):
//     nvcc -O3 -arch=sm_90 -o /tmp/fv scripts/float-matvec-variants.cu && /tmp/fv
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1); } } while (0)
typedef unsigned int u32;

__global__ void read_all(const uint4* p, size_t n, u32* sink) {
    u32 acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = __ldg(p + i); acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678) sink[0] = acc;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}
__device__ __forceinline__ uint4 ldw16(const void* p) {
    uint4 r; asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p)); return r;
}
__device__ __forceinline__ uint2 ldw8(const void* p) {
    uint2 r; asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p)); return r;
}
__device__ __forceinline__ float2 h2f(u32 w) { return __half22float2(*reinterpret_cast<__half2*>(&w)); }

// V1: warp per RPW rows, 8-byte loads (4 halves), BATCH steps in flight (kiln today).
template <int RPW, int BATCH>
__global__ void __launch_bounds__(128) mv8(const __half* w, const float* x, float* out, int rows, int cols) {
    int lane = threadIdx.x & 31, row0 = (blockIdx.x * 4 + (threadIdx.x >> 5)) * RPW;
    if (row0 >= rows) return;
    float acc[RPW] = {};
    for (int c0 = 4 * lane; c0 < cols; c0 += 128 * BATCH) {
        uint2 wv[BATCH][RPW];
#pragma unroll
        for (int b = 0; b < BATCH; ++b)
#pragma unroll
            for (int r = 0; r < RPW; ++r) wv[b][r] = ldw8(w + (size_t)(row0 + r) * cols + c0 + 128 * b);
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            float4 xv = __ldg(reinterpret_cast<const float4*>(x + c0 + 128 * b));
#pragma unroll
            for (int r = 0; r < RPW; ++r) {
                float2 a = h2f(wv[b][r].x), c = h2f(wv[b][r].y);
                acc[r] += a.x * xv.x + a.y * xv.y + c.x * xv.z + c.y * xv.w;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) { float s = warp_sum(acc[r]); if (lane == 0) out[row0 + r] = s; }
}

// V2: warp per RPW rows, 16-byte loads (8 halves), BATCH steps in flight.
template <int RPW, int BATCH>
__global__ void __launch_bounds__(128) mv16(const __half* w, const float* x, float* out, int rows, int cols) {
    int lane = threadIdx.x & 31, row0 = (blockIdx.x * 4 + (threadIdx.x >> 5)) * RPW;
    if (row0 >= rows) return;
    float acc[RPW] = {};
    for (int c0 = 8 * lane; c0 < cols; c0 += 256 * BATCH) {
        uint4 wv[BATCH][RPW];
#pragma unroll
        for (int b = 0; b < BATCH; ++b)
#pragma unroll
            for (int r = 0; r < RPW; ++r) wv[b][r] = ldw16(w + (size_t)(row0 + r) * cols + c0 + 256 * b);
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            float4 x0 = __ldg(reinterpret_cast<const float4*>(x + c0 + 256 * b));
            float4 x1 = __ldg(reinterpret_cast<const float4*>(x + c0 + 256 * b + 4));
#pragma unroll
            for (int r = 0; r < RPW; ++r) {
                float2 a = h2f(wv[b][r].x), c = h2f(wv[b][r].y), d = h2f(wv[b][r].z), e = h2f(wv[b][r].w);
                acc[r] += a.x * x0.x + a.y * x0.y + c.x * x0.z + c.y * x0.w + d.x * x1.x + d.y * x1.y + e.x * x1.z + e.y * x1.w;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) { float s = warp_sum(acc[r]); if (lane == 0) out[row0 + r] = s; }
}

// V3: a block of T threads per row (llama.cpp-like), 16-byte loads, block reduce.
template <int T, int BATCH>
__global__ void __launch_bounds__(T) mvblock(const __half* w, const float* x, float* out, int rows, int cols) {
    int row = blockIdx.x;
    float acc = 0;
    for (int c0 = 8 * threadIdx.x; c0 < cols; c0 += 8 * T * BATCH) {
        uint4 wv[BATCH];
#pragma unroll
        for (int b = 0; b < BATCH; ++b) { int c = c0 + 8 * T * b; wv[b] = c < cols ? ldw16(w + (size_t)row * cols + c) : make_uint4(0,0,0,0); }
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            int c = c0 + 8 * T * b; if (c >= cols) break;
            float4 x0 = __ldg(reinterpret_cast<const float4*>(x + c)), x1 = __ldg(reinterpret_cast<const float4*>(x + c + 4));
            float2 a = h2f(wv[b].x), cc = h2f(wv[b].y), d = h2f(wv[b].z), e = h2f(wv[b].w);
            acc += a.x * x0.x + a.y * x0.y + cc.x * x0.z + cc.y * x0.w + d.x * x1.x + d.y * x1.y + e.x * x1.z + e.y * x1.w;
        }
    }
    __shared__ float part[T / 32];
    acc = warp_sum(acc);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x < 32) { float v = threadIdx.x < T / 32 ? part[threadIdx.x] : 0; v = warp_sum(v); if (threadIdx.x == 0) out[row] = v; }
}

typedef void (*Kern)(const __half*, const float*, float*, int, int);
struct Variant { const char* name; Kern k; int threads; int rows_per_block; };

int main() {
    const int shapes[][2] = {{14336, 4096}, {4096, 14336}, {4096, 4096}, {1024, 4096}, {128256, 4096}};
    size_t max_bytes = (size_t)128256 * 4096 * 2;
    size_t pool = 1600ull << 20;  // rotate over >= 1.6 GB so L2 never holds a copy
    char* wbase; CK(cudaMalloc(&wbase, pool + max_bytes));
    CK(cudaMemset(wbase, 0x3c, pool + max_bytes));
    float* x; CK(cudaMalloc(&x, 14336 * 4)); CK(cudaMemset(x, 0, 14336 * 4));
    float* out; CK(cudaMalloc(&out, 128256 * 4)); u32* sink; CK(cudaMalloc(&sink, 4));
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    // Read roofline.
    {
        size_t n = pool / 16; read_all<<<132 * 8, 512>>>((const uint4*)wbase, n, sink); CK(cudaDeviceSynchronize());
        cudaEventRecord(a); for (int i = 0; i < 5; ++i) read_all<<<132 * 8, 512>>>((const uint4*)wbase, n, sink); cudaEventRecord(b); CK(cudaEventSynchronize(b));
        float ms; cudaEventElapsedTime(&ms, a, b); printf("read roofline: %.0f GB/s\n", 5.0 * pool / ms / 1e6);
    }
    Variant vs[] = {
        {"mv8 r1 b8", mv8<1, 8>, 128, 4}, {"mv8 r2 b4", mv8<2, 4>, 128, 8}, {"mv8 r4 b2", mv8<4, 2>, 128, 16},
        {"mv16 r1 b4", mv16<1, 4>, 128, 4}, {"mv16 r1 b8", mv16<1, 8>, 128, 4}, {"mv16 r2 b2", mv16<2, 2>, 128, 8}, {"mv16 r2 b4", mv16<2, 4>, 128, 8},
        {"mv16 r4 b1", mv16<4, 1>, 128, 16}, {"mv16 r4 b2", mv16<4, 2>, 128, 16},
        {"blk128 b4", mvblock<128, 4>, 128, 1}, {"blk256 b2", mvblock<256, 2>, 256, 1}, {"blk256 b4", mvblock<256, 4>, 256, 1}, {"blk512 b2", mvblock<512, 2>, 512, 1},
    };
    for (auto& s : shapes) {
        int rows = s[0], cols = s[1]; size_t bytes = (size_t)rows * cols * 2;
        int copies = (int)(pool / bytes); if (copies < 1) copies = 1; if (copies > 64) copies = 64;
        printf("\n%d x %d (%.1f MB, %d copies)\n", rows, cols, bytes / 1e6, copies);
        for (auto& v : vs) {
            int grid = (rows + v.rows_per_block - 1) / v.rows_per_block;
            for (int i = 0; i < copies; ++i) v.k<<<grid, v.threads>>>((const __half*)(wbase + i * bytes), x, out, rows, cols);
            CK(cudaDeviceSynchronize());
            int reps = copies * 4 < 20 ? 20 : copies * 4;
            cudaEventRecord(a);
            for (int i = 0; i < reps; ++i) v.k<<<grid, v.threads>>>((const __half*)(wbase + (i % copies) * bytes), x, out, rows, cols);
            cudaEventRecord(b); CK(cudaEventSynchronize(b));
            float ms; cudaEventElapsedTime(&ms, a, b);
            printf("  %-12s %7.2f us  %6.0f GB/s\n", v.name, 1000 * ms / reps, (double)bytes * reps / ms / 1e6);
        }
    }
    return 0;
}
