// Shared by the standalone CUDA harnesses in scripts/ (run with nvcc on the GPU machine). They
// also compile without a GPU, from the pip wheels of one CUDA release (nvvm and crt must match
// nvcc's version, or ptxas rejects the PTX): pip install nvidia-cuda-nvcc==13.0.88
// nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 'nvidia-cuda-cccl==13.0.*', then with
// N=<site-packages>/nvidia/cu13: PATH=$N/bin:$PATH nvcc -O3 -arch=sm_90 -I$N/include -L$N/lib ...
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t ck_err = (x); if (ck_err != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(ck_err)); exit(1); } } while (0)
typedef unsigned int u32;
typedef unsigned long long u64;

// dp4a of unsigned weight bytes with signed activation bytes.
__device__ __forceinline__ int dp4a_us(u32 a, int b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// A well-mixed word from an index and a seed, for filling buffers on the device.
__device__ __forceinline__ u32 mix_word(size_t i, u32 seed) {
    u32 h = (u32)i * 0x9e3779b9u ^ seed;
    h ^= h >> 15;
    h *= 0x2c1b3c6du;
    h ^= h >> 12;
    return h;
}

// By a whole block, after its writes: whether it is the last of `count` blocks to arrive at
// ticket `i` (then it sees every other block's writes); the last one resets the ticket for the
// next launch.
__device__ __forceinline__ bool last_to_arrive(u32* tickets, int i, u32 count) {
    __shared__ u32 last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(tickets + i, 1u) + 1 == count;
        if (last) tickets[i] = 0;
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// Mean microseconds of one replay of `exec` divided by `per_graph` (20 replays after one).
static float time_graph(cudaGraphExec_t exec, cudaStream_t s, int per_graph) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    CK(cudaGraphLaunch(exec, s));
    CK(cudaEventRecord(a, s));
    const int reps = 20;
    for (int i = 0; i < reps; ++i) CK(cudaGraphLaunch(exec, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    return 1000.0f * ms / reps / per_graph;
}

// Mean microseconds a launch of a graph of `count` launches, launch(i) issuing the i-th.
template <class Launch>
static float time_launches(cudaStream_t s, int count, Launch launch) {
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < count; ++i) launch(i);
    CK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t e;
    CK(cudaGraphInstantiate(&e, g, 0ull));
    return time_graph(e, s, count);
}
