// Standalone 1-bit (Q1_0, grouped layout) mat-vec variants at one token on Qwen3-8B shapes: what
// limits kiln's grouped mat-vec (warps of one step each): whether persistent warps that walk
// several row batches, fetching the next batch while computing this one, more resident warps
// (registers capped), activations in shared memory or 16 rows a warp do better. Prints each
// variant's registers, resident blocks per SM and time with the weight cold and L2-resident, plus
// the dp4a throughput of one SM. Run on the GPU machine (CUDA toolkit only, not kiln):
//     nvcc -O3 -arch=sm_90 -o /tmp/q1v scripts/q1-matvec-variants.cu && /tmp/q1v
#include "q1-grouped.cuh"

// Persistent warps: a grid that fills the GPU once; warp w walks row batches w, w + W, ... and
// each batch's steps, fetching the next (batch, step) before computing this one.
template <int R>
__global__ void __launch_bounds__(128) walking(const uint4* codes, const __half* scales, const uint4* xq,
                                               const float2* xds, float* out, int rows, int groups) {
    const int lane = threadIdx.x & 31;
    const int warp = blockIdx.x * 4 + (threadIdx.x >> 5), warps = gridDim.x * 4;
    const int steps = (groups + 31) / 32, batches = (rows + R - 1) / R;
    if (warp >= batches) return;
    const int items = ((batches - warp + warps - 1) / warps) * steps;
    uint4 c[R], cn[R];
    float d[R], dn[R], acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    fetch<R>(codes, scales, warp * R, rows, groups, lane, c, d);
    for (int j = 0; j < items; ++j) {
        const int row0 = (warp + (j / steps) * warps) * R, s = j % steps;
        if (j + 1 < items) {
            const int nrow0 = (warp + ((j + 1) / steps) * warps) * R, ns = (j + 1) % steps;
            fetch<R>(codes, scales, nrow0, rows, groups, ns * 32 + lane, cn, dn);
        }
        if (s * 32 + lane < groups) group_dot<R>(c, d, xq, xds, s * 32 + lane, acc);
        if (s == steps - 1) finish<R>(acc, out, row0, rows, lane);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            c[r] = cn[r];
            d[r] = dn[r];
        }
    }
}

// kiln's loop with its registers capped so that B blocks of 4 warps fit an SM (is it short of
// resident warps?).
template <int R, int B>
__global__ void __launch_bounds__(128, B) one_batch_capped(const uint4* codes, const __half* scales, const uint4* xq,
                                                           const float2* xds, float* out, int rows, int groups) {
    one_batch_rows<R>(codes, scales, xq, xds, out, rows, groups);
}

// kiln's loop with the activations copied once per block into shared memory (is it waiting on
// its L1 activation loads?). Dynamic shared memory: groups * 8 chunks of 16 + 8 bytes.
template <int R>
__global__ void __launch_bounds__(128) one_batch_shared_x(const uint4* codes, const __half* scales, const uint4* xq,
                                                          const float2* xds, float* out, int rows, int groups) {
    extern __shared__ uint4 sx[];
    float2* sds = reinterpret_cast<float2*>(sx + groups * 8);
    for (int i = threadIdx.x; i < groups * 8; i += blockDim.x) {
        sx[i] = __ldg(xq + i);
        sds[i] = __ldg(xds + i);
    }
    __syncthreads();
    one_batch_rows<R, false>(codes, scales, sx, sds, out, rows, groups);
}

// The same bytes read with nothing computed: the floor of a kernel of this size and shape.
template <int R>
__global__ void __launch_bounds__(128) loads_only(const uint4* codes, const __half* scales, const uint4* xq,
                                                  const float2* xds, float* out, int rows, int groups) {
    const int lane = threadIdx.x & 31, row0 = (blockIdx.x * 4 + (threadIdx.x >> 5)) * R;
    if (row0 >= rows) return;
    u32 acc = 0;
    for (int g = lane; g < groups; g += 32) {
        uint4 c[R];
        float d[R];
        fetch<R>(codes, scales, row0, rows, groups, g, c, d);
#pragma unroll
        for (int r = 0; r < R; ++r) acc ^= c[r].x ^ c[r].y ^ c[r].z ^ c[r].w ^ __float_as_uint(d[r]);
    }
    if (acc == 0x12345u) out[row0] = 1.0f;
}

__global__ void dp4a_rate(int* out, int iters) {
    int a[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) a[i] = threadIdx.x + i;
    const u32 w = 0x01020304u * (threadIdx.x | 1);
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int i = 0; i < 8; ++i) a[i] = dp4a_us(w, a[i], a[i]);
    }
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) s += a[i];
    if (s == 0x7654321) out[0] = s;
}

typedef void (*Kernel)(const uint4*, const __half*, const uint4*, const float2*, float*, int, int);

struct Weight {
    uint4* codes;
    __half* scales;
};

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int sms = prop.multiProcessorCount;
    int clock_khz = 0;
    CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
    printf("%s, %d SMs, L2 %.0f MiB, %d MHz\n", prop.name, sms, prop.l2CacheSize / 1048576.0, clock_khz / 1000);
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    int* sink;
    CK(cudaMalloc(&sink, 4));
    {
        const int iters = 1 << 14, blocks = sms * 8, threads = 256;
        cudaEvent_t a, b;
        CK(cudaEventCreate(&a));
        CK(cudaEventCreate(&b));
        dp4a_rate<<<blocks, threads, 0, s>>>(sink, iters);
        CK(cudaEventRecord(a, s));
        dp4a_rate<<<blocks, threads, 0, s>>>(sink, iters);
        CK(cudaEventRecord(b, s));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        const double ops = (double)blocks * threads * iters * 8;
        printf("dp4a: %.1f per clock per SM (at the base clock above)\n", ops / (ms * 1e-3) / (clock_khz * 1e3) / sms);
    }
    srand(11);
    const Activations act = upload_activations(12288);
    const std::vector<uint4>& hx = act.codes;
    const std::vector<float2>& hds = act.scales;
    uint4* dx = act.d_codes;
    float2* dds = act.d_scales;
    float *dout, *dref;
    CK(cudaMalloc(&dout, 24576 * 4));
    CK(cudaMalloc(&dref, 24576 * 4));

    struct Variant {
        const char* name;
        Kernel k;
        int rows_per_warp;
        bool persistent;
        bool shared_x;  // takes the activations' bytes of dynamic shared memory
    };
    const Variant variants[] = {
        {"one batch, 4 rows a warp", one_batch<4>, 4, false, false},
        {"one batch, 8 rows a warp", one_batch<8>, 8, false, false},
        {"8 rows, 6 blocks/SM cap", one_batch_capped<8, 6>, 8, false, false},
        {"8 rows, 8 blocks/SM cap", one_batch_capped<8, 8>, 8, false, false},
        {"8 rows, x in shared mem", one_batch_shared_x<8>, 8, false, true},
        {"16 rows a warp", one_batch<16>, 16, false, false},
        {"walking, 2 rows a warp", walking<2>, 2, true, false},
        {"walking, 4 rows a warp", walking<4>, 4, true, false},
        {"walking, 8 rows a warp", walking<8>, 8, true, false},
        {"loads only, 8 rows a warp", loads_only<8>, 8, false, false},
        {"loads only, 4 rows a warp", loads_only<4>, 4, false, false},
    };
    const int rows_list[2] = {24576, 4096}, cols_list[2] = {4096, 12288};
    const char* what[2] = {"gate+up 2x12288x4096", "down 4096x12288"};
    const int copies = 12;
    for (int shape = 0; shape < 2; ++shape) {
        const int rows = rows_list[shape], groups = cols_list[shape] / 128;
        std::vector<uint4> hc((size_t)rows * groups);
        std::vector<__half> hs((size_t)rows * groups);
        for (auto& v : hc) v = make_uint4(rand(), rand(), rand(), rand());
        for (auto& v : hs) v = __float2half(0.001f * (1 + rand() % 100));
        std::vector<Weight> w(copies);
        for (auto& x : w) {
            CK(cudaMalloc(&x.codes, hc.size() * 16));
            CK(cudaMalloc(&x.scales, hs.size() * 2));
            CK(cudaMemcpy(x.codes, hc.data(), hc.size() * 16, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(x.scales, hs.data(), hs.size() * 2, cudaMemcpyHostToDevice));
        }
        const double mb = (hc.size() * 16 + hs.size() * 2) / 1e6;
        printf("\n%s Q1_0, %.1f MB: variant | regs | blocks/SM | grid | cold us (GB/s) | L2-resident us | max diff vs first\n", what[shape], mb);
        one_batch<4><<<(rows / 4 + 3) / 4, 128, 0, s>>>(w[0].codes, w[0].scales, dx, dds, dref, rows, groups);
        for (const Variant& v : variants) {
            cudaFuncAttributes attr;
            CK(cudaFuncGetAttributes(&attr, v.k));
            const size_t smem = v.shared_x ? (size_t)groups * 8 * (16 + 8) : 0;
            int per_sm = 0;
            CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, v.k, 128, smem));
            const int needed = (rows / v.rows_per_warp + 3) / 4;
            const int grid = v.persistent ? std::min(needed, per_sm * sms) : needed;
            CK(cudaMemset(dout, 0xff, rows * 4));
            v.k<<<grid, 128, smem, s>>>(w[0].codes, w[0].scales, dx, dds, dout, rows, groups);
            CK(cudaStreamSynchronize(s));
            std::vector<float> got(rows), ref(rows);
            CK(cudaMemcpy(got.data(), dout, rows * 4, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(ref.data(), dref, rows * 4, cudaMemcpyDeviceToHost));
            double diff = 0;
            for (int r = 0; r < rows; ++r) diff = fmax(diff, fabs((double)got[r] - ref[r]));
            float us[2];
            for (int hot = 0; hot < 2; ++hot) {
                cudaGraph_t g;
                CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
                for (int i = 0; i < 24; ++i) {
                    const Weight& x = w[hot ? 0 : i % copies];
                    v.k<<<grid, 128, smem, s>>>(x.codes, x.scales, dx, dds, dout, rows, groups);
                }
                CK(cudaStreamEndCapture(s, &g));
                cudaGraphExec_t e;
                CK(cudaGraphInstantiate(&e, g, 0ull));
                us[hot] = time_graph(e, s, 24);
            }
            printf("  %-28s %4d %3d %6d | %6.2f (%5.0f) | %6.2f | %.2e\n", v.name, attr.numRegs, per_sm, grid, us[0], mb * 1e3 / us[0], us[1],
                   strstr(v.name, "loads") ? 0.0 : diff);
        }
        for (auto& x : w) {
            CK(cudaFree(x.codes));
            CK(cudaFree(x.scales));
        }
    }
    return 0;
}
