// One sequence's decode attention at depth with position-major blocks, standalone: does a kernel
// whose blocks stream whole cache rows (every KV head, 2 KiB contiguous) and merge their partials
// in two levels (a thread-block cluster over DSMEM, then a ticket per slice of query heads) beat
// kiln's head-major split kernel (19.5 µs a layer, Llama-3-8B at depth 8192 on an H100:
// docs/performance-log.md)? The loads alone of such blocks reached 12.3-13.0 µs there
// (scripts/attention-merge-probe.cu). Beside it, the same scoring head-major with a cluster
// merge, the layout of kiln's kernel with its cheapest merge.
// Llama-3-8B's shape: 8 KV heads of 128, 4 query heads a KV head, f16 cache rows of all heads,
// 32 layers' caches (1 GB at 8192: cold in L2). A block's warp w takes KV head w: each lane
// scores one (query head, row) pair of an 8-row pass from shared memory, then accumulates four
// dimensions of the warp's four query heads. Checked against a float64 reference (max-abs error
// within 1e-3 of the largest output: float32 sums of 8192 weighted rows; a wrong row or head
// shows at the scale of the output itself). Run:
//     nvcc -O3 -arch=sm_90 -o /tmp/arp scripts/attention-rows-probe.cu && /tmp/arp [ctx]
#include <cooperative_groups.h>
#include "harness.cuh"

namespace cg = cooperative_groups;

constexpr int KV_HEADS = 8, GROUP = 4, Q_HEADS = KV_HEADS * GROUP, HEAD_DIM = 128, LAYERS = 32;
constexpr int WARPS = KV_HEADS, THREADS = WARPS * 32;
constexpr int ROW_HALVES = KV_HEADS * HEAD_DIM;  // one cache row: every head
constexpr int SMEM_ROW = ROW_HALVES + 8;         // padded: the 8 rows a warp scores use distinct banks
constexpr int PASS_ROWS = 8, STAGES = 2;
constexpr int STAGE_HALVES = STAGES * PASS_ROWS * SMEM_ROW;
constexpr size_t SMEM_BYTES = 2 * STAGE_HALVES * 2 + Q_HEADS * HEAD_DIM * 4;
constexpr u32 FULL = 0xffffffffu;

struct Args {
    const __half *k, *v;  // [ctx][ROW_HALVES]
    const float* q;       // [Q_HEADS][HEAD_DIM], scaled by log2(e) / sqrt(HEAD_DIM)
    int ctx;
    float* part_acc;  // [clusters][Q_HEADS][HEAD_DIM]: a cluster's weighted sums
    float* part_ml;   // [clusters][Q_HEADS][2]: its (max, sum of weights)
    u32* tickets;     // [16], zero between launches
    float* out;       // [Q_HEADS][HEAD_DIM]
};

__device__ __forceinline__ void copy16_async(void* dst, const void* src) {
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// One warp's step over 8 rows of one KV head in shared memory: lane (g, r) scores query head g
// (q_row) against row r (k_row, its own), the running max m and sum l of each query head move on,
// and acc[h][0..3] (dimensions 4 lane .. of query head h) take the rows' values (v_col: this
// lane's four values of the first row, rows v_stride halves apart).
__device__ __forceinline__ void attend_rows(const __half* k_row, const float* q_row, const __half* v_col, int v_stride, float& m,
                                            float& l, float (&acc)[GROUP][4]) {
    float s = 0.0f;
#pragma unroll
    for (int d = 0; d < HEAD_DIM; d += 8) {
        const uint4 raw = *reinterpret_cast<const uint4*>(k_row + d);
        const float4 qa = *reinterpret_cast<const float4*>(q_row + d), qb = *reinterpret_cast<const float4*>(q_row + d + 4);
        const __half2* h = reinterpret_cast<const __half2*>(&raw);
        const float2 f0 = __half22float2(h[0]), f1 = __half22float2(h[1]), f2 = __half22float2(h[2]), f3 = __half22float2(h[3]);
        s = fmaf(qa.x, f0.x, s);
        s = fmaf(qa.y, f0.y, s);
        s = fmaf(qa.z, f1.x, s);
        s = fmaf(qa.w, f1.y, s);
        s = fmaf(qb.x, f2.x, s);
        s = fmaf(qb.y, f2.y, s);
        s = fmaf(qb.z, f3.x, s);
        s = fmaf(qb.w, f3.y, s);
    }
    float top = s;
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) top = fmaxf(top, __shfl_xor_sync(FULL, top, o));
    const float m_new = fmaxf(m, top);
    const float alpha = exp2f(m - m_new);
    const float p = exp2f(s - m_new);
    float p_sum = p;
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) p_sum += __shfl_xor_sync(FULL, p_sum, o);
    l = l * alpha + p_sum;
    m = m_new;
#pragma unroll
    for (int h = 0; h < GROUP; ++h) {
        const float scale = __shfl_sync(FULL, alpha, 8 * h);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[h][i] *= scale;
    }
#pragma unroll
    for (int row = 0; row < 8; ++row) {
        const uint2 raw = *reinterpret_cast<const uint2*>(v_col + row * v_stride);
        const float2 v01 = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
        const float2 v23 = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
#pragma unroll
        for (int h = 0; h < GROUP; ++h) {
            const float w = __shfl_sync(FULL, p, 8 * h + row);
            acc[h][0] = fmaf(w, v01.x, acc[h][0]);
            acc[h][1] = fmaf(w, v01.y, acc[h][1]);
            acc[h][2] = fmaf(w, v23.x, acc[h][2]);
            acc[h][3] = fmaf(w, v23.y, acc[h][3]);
        }
    }
}

// The merge of `n` partials (max, sum of weights) and a weighted sum, read through ml(i, 0|1) and
// value(i): (the merged max, its sum of weights, its weighted sum).
template <class Ml, class Value>
__device__ __forceinline__ float3 merge_partials(int n, Ml ml, Value value) {
    float top = -INFINITY;
    for (int i = 0; i < n; ++i) top = fmaxf(top, ml(i, 0));
    float total = 0.0f, sum = 0.0f;
    for (int i = 0; i < n; ++i) {
        const float w = exp2f(ml(i, 0) - top);
        total += ml(i, 1) * w;
        sum += value(i) * w;
    }
    return make_float3(top, total, sum);
}

// The pass loop of both layouts: the first STAGES - 1 passes' copies issued, then `prepare()`
// (while they land), then each pass's copies issued STAGES - 1 passes ahead and `step(pass)` once
// its own have landed; every copy has landed on return.
template <class Issue, class Prepare, class Step>
__device__ __forceinline__ void stream_passes(int passes, Issue issue, Prepare prepare, Step step) {
#pragma unroll
    for (int p = 0; p < STAGES - 1; ++p) issue(p);
    prepare();
    for (int pass = 0; pass < passes; ++pass) {
        issue(pass + STAGES - 1);
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1) : "memory");
        __syncthreads();
        step(pass);
        __syncthreads();  // the stage is free for the copy the next pass issues
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
}

// A warp's running softmax state for its GROUP query heads (m, l: of this lane's head g).
struct Running {
    float m = -INFINITY, l = 0.0f;
    float acc[GROUP][4] = {};
};

// COMPUTE false: the loads and both merges only (stand-in partials), the floor of the layout.
template <int CLUSTER, bool COMPUTE>
__global__ void __launch_bounds__(THREADS, 2) rows_attention(Args a) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __half* stage_k = reinterpret_cast<__half*>(smem_raw);  // [STAGES][PASS_ROWS][SMEM_ROW]
    __half* stage_v = stage_k + STAGE_HALVES;
    float* q_s = reinterpret_cast<float*>(stage_v + STAGE_HALVES);  // [Q_HEADS][HEAD_DIM]
    // After the loop, over the stages: the block's partials.
    float* acc_s = reinterpret_cast<float*>(smem_raw);  // [Q_HEADS][HEAD_DIM]
    float* ml_s = acc_s + Q_HEADS * HEAD_DIM;           // [Q_HEADS][2]

    const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
    const int rows = a.ctx / gridDim.x, begin = blockIdx.x * rows, passes = rows / PASS_ROWS;
    auto issue = [&](int pass) {
        if (pass < passes) {
            const int stage = pass % STAGES;
            for (int i = t; i < PASS_ROWS * ROW_HALVES / 8; i += THREADS) {
                const int r = i / (ROW_HALVES / 8), c = i % (ROW_HALVES / 8) * 8;
                const size_t src = (size_t)(begin + pass * PASS_ROWS + r) * ROW_HALVES + c;
                copy16_async(stage_k + (stage * PASS_ROWS + r) * SMEM_ROW + c, a.k + src);
                copy16_async(stage_v + (stage * PASS_ROWS + r) * SMEM_ROW + c, a.v + src);
            }
        }
        copy_commit();
    };
    // This lane scores query head warp * GROUP + g against row r of each pass.
    const int g = lane >> 3, r = lane & 7;
    const float* q_row = q_s + (warp * GROUP + g) * HEAD_DIM;
    Running run;
    stream_passes(
        passes, issue,
        [&] {
            for (int i = t; i < Q_HEADS * HEAD_DIM / 4; i += THREADS) reinterpret_cast<float4*>(q_s)[i] = reinterpret_cast<const float4*>(a.q)[i];
        },
        [&](int pass) {
            if constexpr (COMPUTE) {
                const int stage = pass % STAGES;
                attend_rows(stage_k + (stage * PASS_ROWS + r) * SMEM_ROW + warp * HEAD_DIM, q_row,
                            stage_v + stage * PASS_ROWS * SMEM_ROW + warp * HEAD_DIM + 4 * lane, SMEM_ROW, run.m, run.l, run.acc);
            }
        });
    float m = run.m, l = run.l;
    if constexpr (!COMPUTE) {
        m = 0.25f * (blockIdx.x % 5);
        l = 1.0f + 0.01f * blockIdx.x;
    }
#pragma unroll
    for (int h = 0; h < GROUP; ++h) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc_s[(warp * GROUP + h) * HEAD_DIM + 4 * lane + i] = run.acc[h][i];
    }
    if (r == 0) {
        ml_s[(warp * GROUP + g) * 2] = m;
        ml_s[(warp * GROUP + g) * 2 + 1] = l;
    }

    // Level 1: block `rank` of the cluster merges query heads rank * SLICE .. of every block of
    // its cluster, from their shared memory.
    constexpr int SLICE = Q_HEADS / CLUSTER;
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    const int rank = (int)cluster.block_rank(), clusters = gridDim.x / CLUSTER, cluster_id = blockIdx.x / CLUSTER;
    for (int o = t; o < SLICE * HEAD_DIM; o += THREADS) {
        const int head = rank * SLICE + o / HEAD_DIM, d = o % HEAD_DIM;
        const float3 merged = merge_partials(
            CLUSTER, [&](int c, int i) { return *cluster.map_shared_rank(ml_s + head * 2 + i, c); },
            [&](int c) { return *cluster.map_shared_rank(acc_s + head * HEAD_DIM + d, c); });
        a.part_acc[((size_t)cluster_id * Q_HEADS + head) * HEAD_DIM + d] = merged.z;
        if (d == 0) {
            a.part_ml[((size_t)cluster_id * Q_HEADS + head) * 2] = merged.x;
            a.part_ml[((size_t)cluster_id * Q_HEADS + head) * 2 + 1] = merged.y;
        }
    }
    cluster.sync();  // no block leaves while another reads its shared memory

    // Level 2: the last cluster to finish a slice merges it over every cluster.
    if (!last_to_arrive(a.tickets, rank, clusters)) return;
    for (int o = t; o < SLICE * HEAD_DIM; o += THREADS) {
        const int head = rank * SLICE + o / HEAD_DIM, d = o % HEAD_DIM;
        const float3 merged = merge_partials(
            clusters, [&](int c, int i) { return __ldcg(a.part_ml + ((size_t)c * Q_HEADS + head) * 2 + i); },
            [&](int c) { return __ldcg(a.part_acc + ((size_t)c * Q_HEADS + head) * HEAD_DIM + d); });
        a.out[head * HEAD_DIM + d] = merged.z / merged.y;
    }
}

// The same work head-major, laid out as kiln's split kernel: a cluster of SPLITS blocks a KV head,
// each streaming 64-row passes of that head's 256-byte slice of the rows (32 KiB a stage, as
// above), warp w taking rows 8 w .. 8 w + 7 of each pass; the warps' partials merged in the
// block, the blocks' in the cluster over DSMEM (one level: the cluster holds every split).
constexpr int HM_PASS_ROWS = 8 * WARPS, HM_ROW = HEAD_DIM + 8;
constexpr int HM_STAGE_HALVES = STAGES * HM_PASS_ROWS * HM_ROW;
constexpr size_t HM_SMEM_BYTES = 2 * HM_STAGE_HALVES * 2 + GROUP * HEAD_DIM * 4;

template <int SPLITS>
__global__ void __launch_bounds__(THREADS, 2) head_attention(Args a) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __half* stage_k = reinterpret_cast<__half*>(smem_raw);  // [STAGES][HM_PASS_ROWS][HM_ROW]
    __half* stage_v = stage_k + HM_STAGE_HALVES;
    float* q_s = reinterpret_cast<float*>(stage_v + HM_STAGE_HALVES);  // [GROUP][HEAD_DIM]
    // After the loop, over the stages: the warps' partials, then the block's.
    float* warp_acc = reinterpret_cast<float*>(smem_raw);  // [WARPS][GROUP][HEAD_DIM]
    float* warp_ml = warp_acc + WARPS * GROUP * HEAD_DIM;  // [WARPS][GROUP][2]
    float* block_acc = warp_ml + WARPS * GROUP * 2;        // [GROUP][HEAD_DIM]
    float* block_ml = block_acc + GROUP * HEAD_DIM;        // [GROUP][2]

    const int t = threadIdx.x, warp = t >> 5, lane = t & 31, kv = blockIdx.y;
    const int rows = a.ctx / SPLITS, begin = blockIdx.x * rows, passes = rows / HM_PASS_ROWS;
    auto issue = [&](int pass) {
        if (pass < passes) {
            const int stage = pass % STAGES;
            for (int i = t; i < HM_PASS_ROWS * HEAD_DIM / 8; i += THREADS) {
                const int r = i / (HEAD_DIM / 8), c = i % (HEAD_DIM / 8) * 8;
                const size_t src = (size_t)(begin + pass * HM_PASS_ROWS + r) * ROW_HALVES + kv * HEAD_DIM + c;
                copy16_async(stage_k + (stage * HM_PASS_ROWS + r) * HM_ROW + c, a.k + src);
                copy16_async(stage_v + (stage * HM_PASS_ROWS + r) * HM_ROW + c, a.v + src);
            }
        }
        copy_commit();
    };
    const int g = lane >> 3, r = lane & 7;
    Running run;
    stream_passes(
        passes, issue,
        [&] {
            for (int i = t; i < GROUP * HEAD_DIM / 4; i += THREADS) {
                reinterpret_cast<float4*>(q_s)[i] = reinterpret_cast<const float4*>(a.q + kv * GROUP * HEAD_DIM)[i];
            }
        },
        [&](int pass) {
            const int row0 = pass % STAGES * HM_PASS_ROWS + 8 * warp;
            attend_rows(stage_k + (row0 + r) * HM_ROW, q_s + g * HEAD_DIM, stage_v + row0 * HM_ROW + 4 * lane, HM_ROW, run.m, run.l, run.acc);
        });
#pragma unroll
    for (int h = 0; h < GROUP; ++h) {
#pragma unroll
        for (int i = 0; i < 4; ++i) warp_acc[(warp * GROUP + h) * HEAD_DIM + 4 * lane + i] = run.acc[h][i];
    }
    if (r == 0) {
        warp_ml[(warp * GROUP + g) * 2] = run.m;
        warp_ml[(warp * GROUP + g) * 2 + 1] = run.l;
    }
    __syncthreads();
    for (int o = t; o < GROUP * HEAD_DIM; o += THREADS) {
        const int h = o / HEAD_DIM, d = o % HEAD_DIM;
        const float3 merged = merge_partials(
            WARPS, [&](int w, int i) { return warp_ml[(w * GROUP + h) * 2 + i]; }, [&](int w) { return warp_acc[(w * GROUP + h) * HEAD_DIM + d]; });
        block_acc[o] = merged.z;
        if (d == 0) {
            block_ml[h * 2] = merged.x;
            block_ml[h * 2 + 1] = merged.y;
        }
    }

    // Block `rank` of the head's cluster merges its share of the head's outputs over every split.
    constexpr int SHARE = GROUP * HEAD_DIM / SPLITS;
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    const int rank = (int)cluster.block_rank();
    if (t < SHARE) {
        const int o = rank * SHARE + t, h = o / HEAD_DIM, d = o % HEAD_DIM;
        const float3 merged = merge_partials(
            SPLITS, [&](int c, int i) { return *cluster.map_shared_rank(block_ml + h * 2 + i, c); },
            [&](int c) { return *cluster.map_shared_rank(block_acc + o, c); });
        a.out[(kv * GROUP + h) * HEAD_DIM + d] = merged.z / merged.y;
    }
    cluster.sync();  // no block leaves while another reads its shared memory
}

__global__ void fill_halves(__half* p, size_t n, u32 seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        p[i] = __float2half((float)(mix_word(i, seed) & 0xffff) / 32768.0f - 1.0f);
    }
}

// A cluster launch of `kernel`: a grid of `grid` blocks in clusters of `cluster` along x.
struct ClusterLaunch {
    void (*kernel)(Args);
    dim3 grid;
    int cluster;
    size_t smem;

    cudaLaunchConfig_t config(cudaStream_t st, cudaLaunchAttribute* attr) const {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = grid;
        cfg.blockDim = dim3(THREADS);
        cfg.dynamicSmemBytes = smem;
        cfg.stream = st;
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim = {(unsigned)cluster, 1, 1};
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        return cfg;
    }
    // Whether at least one cluster can be resident (sets the kernel's shared-memory and
    // cluster-size attributes first).
    bool fits() const {
        CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        if (cluster > 8) CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
        cudaLaunchAttribute attr[1];
        const cudaLaunchConfig_t cfg = config(0, attr);
        int clusters = 0;
        if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess || clusters < 1) {
            cudaGetLastError();
            return false;
        }
        return true;
    }
    void operator()(cudaStream_t st, const Args& a) const {
        cudaLaunchAttribute attr[1];
        const cudaLaunchConfig_t cfg = config(st, attr);
        CK(cudaLaunchKernelEx(&cfg, kernel, a));
    }
};

int main(int argc, char** argv) {
    const int ctx = argc > 1 ? atoi(argv[1]) : 8192;
    if (ctx <= 0 || ctx % 4096 != 0) {  // every way's blocks take whole passes: 512 blocks x 8 rows
        printf("ctx must be a positive multiple of 4096, not %s\n", argv[1]);
        return 1;
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const double layer_bytes = 2.0 * ctx * ROW_HALVES * 2;
    printf("%s, %d SMs; one sequence at depth %d, %d/%d heads of %d, f16 cache: %.1f MB a layer, %d layers\n", prop.name,
           prop.multiProcessorCount, ctx, Q_HEADS, KV_HEADS, HEAD_DIM, layer_bytes / 1e6, LAYERS);

    std::vector<float> q(Q_HEADS * HEAD_DIM);
    const float q_scale = 1.4426950408889634f / sqrtf((float)HEAD_DIM);
    for (size_t i = 0; i < q.size(); ++i) q[i] = q_scale * (float)((int)((i * 2654435761u) >> 20 & 1023) - 512) / 256.0f;
    float *d_q, *part_acc, *part_ml, *out;
    u32* tickets;
    CK(cudaMalloc(&d_q, q.size() * 4));
    CK(cudaMemcpy(d_q, q.data(), q.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&part_acc, (size_t)1024 * Q_HEADS * HEAD_DIM * 4));
    CK(cudaMalloc(&part_ml, (size_t)1024 * Q_HEADS * 2 * 4));
    CK(cudaMalloc(&out, Q_HEADS * HEAD_DIM * 4));
    CK(cudaMalloc(&tickets, 16 * 4));
    CK(cudaMemset(tickets, 0, 16 * 4));
    std::vector<Args> layers(LAYERS);
    for (int i = 0; i < LAYERS; ++i) {
        const size_t n = (size_t)ctx * ROW_HALVES;
        __half *k, *v;
        CK(cudaMalloc(&k, n * 2));
        CK(cudaMalloc(&v, n * 2));
        fill_halves<<<1024, 256>>>(k, n, 2 * i + 1);
        fill_halves<<<1024, 256>>>(v, n, 2 * i + 2);
        layers[i] = Args{k, v, d_q, ctx, part_acc, part_ml, tickets, out};
    }
    CK(cudaDeviceSynchronize());

    // The float64 reference of the last layer.
    std::vector<double> want(Q_HEADS * HEAD_DIM);
    {
        const size_t n = (size_t)ctx * ROW_HALVES;
        std::vector<__half> k(n), v(n);
        CK(cudaMemcpy(k.data(), layers[LAYERS - 1].k, n * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(v.data(), layers[LAYERS - 1].v, n * 2, cudaMemcpyDeviceToHost));
        std::vector<double> s(ctx);
        for (int h = 0; h < Q_HEADS; ++h) {
            const int kv = h / GROUP;
            double top = -INFINITY;
            for (int p = 0; p < ctx; ++p) {
                double dot = 0;
                for (int d = 0; d < HEAD_DIM; ++d) dot += (double)q[h * HEAD_DIM + d] * (double)__half2float(k[(size_t)p * ROW_HALVES + kv * HEAD_DIM + d]);
                s[p] = dot;
                top = std::max(top, dot);
            }
            double total = 0;
            std::vector<double> o(HEAD_DIM, 0.0);
            for (int p = 0; p < ctx; ++p) {
                const double w = exp2(s[p] - top);
                total += w;
                for (int d = 0; d < HEAD_DIM; ++d) o[d] += w * (double)__half2float(v[(size_t)p * ROW_HALVES + kv * HEAD_DIM + d]);
            }
            for (int d = 0; d < HEAD_DIM; ++d) want[h * HEAD_DIM + d] = o[d] / total;
        }
    }

    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    printf("%-26s | blocks | cluster | us a layer | GB/s | max |out - f64| (of max |out|)\n", "way");
    auto run = [&](const char* name, const ClusterLaunch& way, bool compute) {
        const int blocks = way.grid.x * way.grid.y;
        if (!way.fits()) {
            printf("%-26s | %6d | %7d | cannot be resident\n", name, blocks, way.cluster);
            return;
        }
        CK(cudaMemset(out, 0xff, Q_HEADS * HEAD_DIM * 4));  // NaN: a way that writes nothing fails the check
        const float us = time_launches(st, LAYERS, [&](int layer) { way(st, layers[layer]); });
        CK(cudaStreamSynchronize(st));
        std::vector<float> got(Q_HEADS * HEAD_DIM);
        CK(cudaMemcpy(got.data(), out, got.size() * 4, cudaMemcpyDeviceToHost));
        printf("%-26s | %6d | %7d | %10.2f | %4.0f | ", name, blocks, way.cluster, us, layer_bytes / us / 1e3);
        if (compute) {
            double diff = 0, norm = 0;
            for (size_t i = 0; i < got.size(); ++i) {
                const double e = fabs(got[i] - want[i]);
                if (!(e <= diff)) diff = e;  // a NaN stays
                norm = std::max(norm, fabs(want[i]));
            }
            printf("%.2e (of %.3f)%s\n", diff, norm, diff <= 1e-3 * norm ? "" : "  MISMATCH");
        } else {
            printf("loads and merges only\n");
        }
    };
    run("head-major, scored", {head_attention<8>, dim3(8, KV_HEADS), 8, HM_SMEM_BYTES}, true);
    run("head-major, scored", {head_attention<16>, dim3(16, KV_HEADS), 16, HM_SMEM_BYTES}, true);
    const int block_counts[] = {128, 256, 512};
    for (int blocks : block_counts) {
        run("rows, scored", {rows_attention<8, true>, dim3(blocks), 8, SMEM_BYTES}, true);
        run("rows, scored", {rows_attention<16, true>, dim3(blocks), 16, SMEM_BYTES}, true);
        run("rows, loads and merges", {rows_attention<16, false>, dim3(blocks), 16, SMEM_BYTES}, false);
    }
    printf("kiln's head-major split kernel (docs, H100): 19.5 us a layer at depth 8192; the bar needs about 3.3 TB/s on the H200\n");
    return 0;
}
