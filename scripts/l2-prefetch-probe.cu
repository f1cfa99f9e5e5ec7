// Standalone probe: can weights be streamed into L2 while latency-bound kernels run, so that a
// later mat-vec reads them from L2? A decode layer is a chain of kernels of which only some read
// weights; between them the DRAM idles. Measures, in CUDA graphs on Qwen3-8B Q1_0 shapes:
//   * a 1-bit grouped mat-vec (kiln's layout at one token) with its weight cold vs L2-resident;
//   * a chain "latency kernel (spin) -> mat-vec" per layer, with the mat-vec's weight prefetched
//     into L2 (cp.async.bulk.prefetch.L2) before the spin, beside it on a forked branch, or not;
//   * the same for a weight larger than L2 (a Q4_K-sized stream), prefetching its first part.
// Run on the GPU machine (CUDA toolkit only, not kiln):
//     nvcc -O3 -arch=sm_90 -o /tmp/l2p scripts/l2-prefetch-probe.cu && /tmp/l2p
#include "q1-grouped.cuh"

// A streaming read of n 16-byte words (stands in for a bandwidth-bound product).
__global__ void read_all(const uint4* p, size_t n, u32* sink) {
    u32 acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = __ldg(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

__device__ __forceinline__ void prefetch_range(const char* p, size_t bytes, u32 chunk) {
    const size_t stride = (size_t)gridDim.x * blockDim.x * chunk;
    for (size_t off = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) * chunk; off < bytes; off += stride) {
        const u32 size = (u32)(bytes - off < chunk ? bytes - off : chunk);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(size) : "memory");
    }
}

__global__ void l2_prefetch(const char* p, size_t bytes, u32 chunk) {
    prefetch_range(p, bytes, chunk);
}

// Stands in for a latency-bound kernel (a norm, rope, attention at short context): one block busy
// for `ns`; with `bytes` > 0 its first warp also prefetches p[0, bytes) first.
__global__ void spin(u64 ns, const char* p, size_t bytes, u32 chunk) {
    if (bytes > 0 && threadIdx.x < 32) {
        const size_t stride = 32 * (size_t)chunk;
        for (size_t off = threadIdx.x * (size_t)chunk; off < bytes; off += stride) {
            const u32 size = (u32)(bytes - off < chunk ? bytes - off : chunk);
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(size) : "memory");
        }
    }
    u64 t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}

struct Q1Weight {
    uint4* codes;
    __half* scales;
    int rows, groups;
    size_t code_bytes() const { return (size_t)rows * groups * 16; }
};

static Q1Weight make_q1(int rows, int cols, const std::vector<uint4>& hc, const std::vector<__half>& hs) {
    Q1Weight w{nullptr, nullptr, rows, cols / 128};
    CK(cudaMalloc(&w.codes, w.code_bytes()));
    CK(cudaMalloc(&w.scales, (size_t)rows * w.groups * 2));
    CK(cudaMemcpy(w.codes, hc.data(), w.code_bytes(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(w.scales, hs.data(), (size_t)rows * w.groups * 2, cudaMemcpyHostToDevice));
    return w;
}

enum class Prefetch { None, SameStream, Forked, InSpin };
static const char* name(Prefetch p) {
    switch (p) {
        case Prefetch::None: return "none";
        case Prefetch::SameStream: return "prefetch kernel, then spin";
        case Prefetch::Forked: return "prefetch on a forked branch";
        default: return "spin's first warp prefetches";
    }
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, %d SMs, L2 %.1f MiB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1048576.0);
    cudaStream_t s, side;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    srand(7);
    const int cols_list[2] = {4096, 12288}, rows_list[2] = {24576, 4096};
    const char* what[2] = {"gate+up 2x12288x4096", "down 4096x12288"};
    const int copies = 12;
    const Activations act = upload_activations(12288);
    const std::vector<uint4>& hx = act.codes;
    const std::vector<float2>& hds = act.scales;
    uint4* dx = act.d_codes;
    float2* dds = act.d_scales;
    float* dout;
    u32* sink;
    CK(cudaMalloc(&dout, 24576 * 4));
    CK(cudaMalloc(&sink, 4));
    cudaEvent_t fork, join;
    CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));

    // Launch floor: a graph of 64 chained empty spins.
    {
        cudaGraph_t g;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        for (int i = 0; i < 64; ++i) spin<<<1, 32, 0, s>>>(0, nullptr, 0, 0);
        CK(cudaStreamEndCapture(s, &g));
        cudaGraphExec_t e;
        CK(cudaGraphInstantiate(&e, g, 0));
        printf("empty kernel in a graph chain: %.2f us per launch\n", time_graph(e, s, 64));
    }

    for (int shape = 0; shape < 2; ++shape) {
        const int rows = rows_list[shape], cols = cols_list[shape], groups = cols / 128;
        std::vector<uint4> hc((size_t)rows * groups);
        std::vector<__half> hs((size_t)rows * groups);
        for (auto& v : hc) v = make_uint4(rand(), rand(), rand(), rand());
        for (auto& v : hs) v = __float2half(0.001f * (1 + rand() % 100));
        std::vector<Q1Weight> w;
        for (int i = 0; i < copies; ++i) w.push_back(make_q1(rows, cols, hc, hs));
        const double mb = (w[0].code_bytes() + (size_t)rows * groups * 2) / 1e6;
        // Reference for row 0..3 on the host, to check the kernel is the product.
        one_batch<8><<<(rows / 8 + 3) / 4, 128, 0, s>>>(w[0].codes, w[0].scales, dx, dds, dout, rows, groups);
        CK(cudaStreamSynchronize(s));
        std::vector<float> got(4);
        CK(cudaMemcpy(got.data(), dout, 16, cudaMemcpyDeviceToHost));
        double worst = 0;
        for (int r = 0; r < 4; ++r) {
            double ref = 0;
            for (int g = 0; g < groups; ++g) {
                const unsigned char* b = reinterpret_cast<const unsigned char*>(&hc[(size_t)r * groups + g]);
                const signed char* xb = reinterpret_cast<const signed char*>(&hx[g * 8]);
                double sum = 0;
                for (int k = 0; k < 8; ++k)
                    for (int j = 0; j < 16; ++j) {
                        const int bit = (b[j] >> k) & 1;
                        sum += (2 * bit - 1) * (double)xb[16 * k + j] * hds[g * 8 + k].x;
                    }
                ref += __half2float(hs[(size_t)r * groups + g]) * sum;
            }
            // xs stands for xd * sum of codes; the harness's xds is synthetic, so fix it up:
            double xs_term = 0;
            for (int g = 0; g < groups; ++g) {
                double xs = 0, xsum = 0;
                const signed char* xb = reinterpret_cast<const signed char*>(&hx[g * 8]);
                for (int k = 0; k < 8; ++k) {
                    xs += hds[g * 8 + k].y;
                    for (int j = 0; j < 16; ++j) xsum += (double)xb[16 * k + j] * hds[g * 8 + k].x;
                }
                xs_term += __half2float(hs[(size_t)r * groups + g]) * (xsum - xs);
            }
            ref += xs_term;
            worst = fmax(worst, fabs(ref - got[r]) / (fabs(ref) + 1e-3));
        }
        printf("\n%s Q1_0 (%.1f MB): kernel vs host reference, worst relative error %.2e\n", what[shape], mb, worst);
        const int blocks = (rows / 8 + 3) / 4;
        auto mv = [&](int i) { one_batch<8><<<blocks, 128, 0, s>>>(w[i].codes, w[i].scales, dx, dds, dout, rows, groups); };
        for (int hot = 0; hot < 2; ++hot) {
            cudaGraph_t g;
            CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
            for (int i = 0; i < 24; ++i) mv(hot ? 0 : i % copies);
            CK(cudaStreamEndCapture(s, &g));
            cudaGraphExec_t e;
            CK(cudaGraphInstantiate(&e, g, 0));
            const float us = time_graph(e, s, 24);
            printf("  mat-vec alone, %s: %.2f us (%.0f GB/s)\n", hot ? "L2-resident" : "cold", us, mb * 1e3 / us);
        }
        for (u64 spin_ns : {3000ull, 8000ull}) {
            for (Prefetch p : {Prefetch::None, Prefetch::SameStream, Prefetch::Forked, Prefetch::InSpin}) {
                for (u32 chunk : {16384u, 262144u}) {
                    if (p == Prefetch::None && chunk != 16384u) continue;
                    cudaGraph_t g;
                    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
                    for (int i = 0; i < 24; ++i) {
                        const Q1Weight& wi = w[i % copies];
                        const char* base = reinterpret_cast<const char*>(wi.codes);
                        const size_t bytes = wi.code_bytes();
                        if (p == Prefetch::SameStream) l2_prefetch<<<4, 32, 0, s>>>(base, bytes, chunk);
                        if (p == Prefetch::Forked) {
                            CK(cudaEventRecord(fork, s));
                            CK(cudaStreamWaitEvent(side, fork));
                            l2_prefetch<<<4, 32, 0, side>>>(base, bytes, chunk);
                            CK(cudaEventRecord(join, side));
                        }
                        spin<<<1, 64, 0, s>>>(spin_ns, base, p == Prefetch::InSpin ? bytes : 0, chunk);
                        if (p == Prefetch::Forked) CK(cudaStreamWaitEvent(s, join));
                        mv(i % copies);
                    }
                    CK(cudaStreamEndCapture(s, &g));
                    cudaGraphExec_t e;
                    CK(cudaGraphInstantiate(&e, g, 0));
                    printf("  spin %4.1f us -> mat-vec, %-32s chunk %6u: %.2f us a pair\n", spin_ns / 1e3, name(p), chunk,
                           time_graph(e, s, 24));
                }
            }
        }
        for (auto& x : w) {
            CK(cudaFree(x.codes));
            CK(cudaFree(x.scales));
        }
    }

    // A weight larger than the L2 (Q4_K gate+up of Llama-3-8B, 66 MB): prefetch its first part.
    {
        const size_t bytes = 66u << 20;
        std::vector<uint4*> big(4);
        for (auto& b : big) {
            CK(cudaMalloc(&b, bytes));
            CK(cudaMemset(b, 1, bytes));
        }
        printf("\n66 MB streaming read after a spin of 8 us, prefetching its first part in the spin:\n");
        for (size_t part : {(size_t)0, (size_t)8 << 20, (size_t)16 << 20, (size_t)24 << 20, (size_t)32 << 20}) {
            cudaGraph_t g;
            CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
            for (int i = 0; i < 8; ++i) {
                spin<<<1, 64, 0, s>>>(8000, reinterpret_cast<const char*>(big[i % 4]), part, 262144);
                read_all<<<prop.multiProcessorCount * 8, 256, 0, s>>>(big[i % 4], bytes / 16, sink);
            }
            CK(cudaStreamEndCapture(s, &g));
            cudaGraphExec_t e;
            CK(cudaGraphInstantiate(&e, g, 0));
            printf("  prefetch %2zu MB: %.2f us a pair\n", part >> 20, time_graph(e, s, 8));
        }
    }
    return 0;
}
