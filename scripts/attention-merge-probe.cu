// What merging the splits of one sequence's decode attention costs at depth, standalone, and
// whether a thread-block cluster merging through distributed shared memory costs less than
// kiln's merge (each split writes its partials to global memory and takes a ticket; the last
// one reads them all back through L2). Llama-3-8B's shape: 8 KV heads of 128, 4 query heads a
// KV head, an f16 cache of CTX positions, 32 layers' caches (1 GB at 8192: cold in L2).
// Each block streams its split's K and V rows with 16-byte loads and makes stand-in partials
// from them (the scoring hides under the loads in kiln: docs/performance-log.md); the merge is the
// real one (max, weights, sum of the weighted partials). Ways, µs a layer:
//   no merge       the splits write their partials and exit (the floor of any merge)
//   ticket merge   kiln's: partials to global memory, a ticket, the last split merges
//   cluster merge  the splits of a head form one cluster (8 or 16 blocks); the partials stay in
//                  shared memory and, after a cluster barrier, each block merges its share of
//                  the dimensions reading every block's partials through DSMEM
//   rows           loads only, each block streaming whole 2 KiB cache rows (all heads) of a
//                  position range, 8 or 16 rows of K and V in flight
// and checks that the two merges agree. Run on the GPU machine:
//     nvcc -O3 -arch=sm_90 -o /tmp/amp scripts/attention-merge-probe.cu && /tmp/amp [ctx]
#include <cooperative_groups.h>
#include "harness.cuh"

namespace cg = cooperative_groups;

constexpr int KV_HEADS = 8, GROUP = 4, HEAD_DIM = 128, LAYERS = 32, THREADS = 128, MAX_SPLITS = 64;
constexpr int ROW_PIECES = HEAD_DIM * 2 / 16;          // 16-byte pieces of one head's row
constexpr int ROWS_A_PASS = THREADS / ROW_PIECES;      // rows a block loads in one pass
constexpr int UNROLL = 8;                              // passes in flight (32 KiB a block)
constexpr int ROWS_A_STEP = ROWS_A_PASS * UNROLL;
constexpr int ROW_PIECES_ALL = KV_HEADS * ROW_PIECES;  // 16-byte pieces of a whole cache row

enum Merge { NO_MERGE, TICKET, CLUSTER };

struct Args {
    const uint4 *k, *v;  // [ctx][KV_HEADS][HEAD_DIM] halves, as 16-byte pieces
    int ctx;
    float *part_acc, *part_ml;  // [KV_HEADS][MAX_SPLITS][GROUP][HEAD_DIM], [..][GROUP][2]
    u32* tickets;               // [KV_HEADS], zero between launches
    float* out;                 // [KV_HEADS * GROUP][HEAD_DIM]
};

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// The merged output of head g, dimension d, from `splits` partials that `acc(s)` and `ml(s, i)`
// read (i = 0: the split's max, 1: its sum of weights).
template <class Acc, class Ml>
__device__ __forceinline__ float merge_value(int splits, Acc acc, Ml ml) {
    float top = -INFINITY;
    for (int s = 0; s < splits; ++s) top = fmaxf(top, ml(s, 0));
    float total = 0.0f, value = 0.0f;
#pragma unroll 8
    for (int s = 0; s < splits; ++s) {
        const float w = exp2f(ml(s, 0) - top);
        total += ml(s, 1) * w;
        value += acc(s) * w;
    }
    return value / total;
}

template <int MERGE>
__global__ void __launch_bounds__(THREADS) split_attention(Args a) {
    __shared__ float acc_s[GROUP][HEAD_DIM];
    __shared__ float ml_s[GROUP][2];
    const int head = blockIdx.y, split = blockIdx.x, splits = gridDim.x, t = threadIdx.x;
    const int rows = a.ctx / splits, begin = split * rows;
    const int piece = t % ROW_PIECES, sub = t / ROW_PIECES;

    // Stream the split's K and V rows; fold the words so that the loads are live.
    u32 folded = 0;
    for (int r0 = begin; r0 < begin + rows; r0 += ROWS_A_STEP) {
        uint4 kv[2 * UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const size_t at = ((size_t)(r0 + u * ROWS_A_PASS + sub) * KV_HEADS + head) * ROW_PIECES + piece;
            kv[2 * u] = load_stream(a.k + at);
            kv[2 * u + 1] = load_stream(a.v + at);
        }
#pragma unroll
        for (int i = 0; i < 2 * UNROLL; ++i) folded ^= kv[i].x ^ kv[i].y ^ kv[i].z ^ kv[i].w;
    }

    // Stand-in partials: a dimension a thread.
#pragma unroll
    for (int g = 0; g < GROUP; ++g) acc_s[g][t] = (float)(folded & 0xffff) * 1e-4f * (g + 1);
    if (t < GROUP) {
        ml_s[t][0] = 0.25f * ((split * 7 + t) % 5);
        ml_s[t][1] = 1.0f + 0.01f * split + 1e-6f * (folded & 0xff);
    }
    __syncthreads();

    if constexpr (MERGE == CLUSTER) {
        cg::cluster_group cluster = cg::this_cluster();
        cluster.sync();  // every block's partials are in its shared memory
        const int dims = HEAD_DIM / splits;  // dimensions of each head this block merges
        if (t < GROUP * dims) {
            const int g = t / dims, d = split * dims + t % dims;
            const float value = merge_value(
                splits, [&](int s) { return *cluster.map_shared_rank(&acc_s[g][d], s); },
                [&](int s, int i) { return *cluster.map_shared_rank(&ml_s[g][i], s); });
            a.out[(head * GROUP + g) * HEAD_DIM + d] = value;
        }
        cluster.sync();  // no block leaves while another reads its shared memory
        return;
    }

    float* acc = a.part_acc + ((size_t)head * MAX_SPLITS + split) * GROUP * HEAD_DIM;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) acc[g * HEAD_DIM + t] = acc_s[g][t];
    if (t < GROUP * 2) a.part_ml[((size_t)head * MAX_SPLITS + split) * GROUP * 2 + t] = ml_s[t / 2][t % 2];
    if constexpr (MERGE == TICKET) {
        if (!last_to_arrive(a.tickets, head, splits)) return;
        const float* head_acc = a.part_acc + (size_t)head * MAX_SPLITS * GROUP * HEAD_DIM;
        const float* head_ml = a.part_ml + (size_t)head * MAX_SPLITS * GROUP * 2;
#pragma unroll 1
        for (int g = 0; g < GROUP; ++g) {
            const float value = merge_value(
                splits, [&](int s) { return __ldcg(head_acc + ((size_t)s * GROUP + g) * HEAD_DIM + t); },
                [&](int s, int i) { return __ldcg(head_ml + ((size_t)s * GROUP + g) * 2 + i); });
            a.out[(head * GROUP + g) * HEAD_DIM + t] = value;
        }
    }
}


// Loads only, position-major: each block streams whole cache rows (every KV head, 2 KiB
// contiguous) of its share of the positions, DEPTH rows of K and of V in flight; against the
// head-major splits above, which read one head's 256 bytes a row at a 2 KiB stride.
template <int DEPTH>
__global__ void __launch_bounds__(THREADS) stream_rows(Args a, u32* sink) {
    const int blocks = gridDim.x, t = threadIdx.x;
    const int rows = a.ctx / blocks, begin = blockIdx.x * rows;
    u32 folded = 0;
    for (int r0 = begin; r0 < begin + rows; r0 += DEPTH) {
        uint4 kv[2 * DEPTH];
#pragma unroll
        for (int u = 0; u < DEPTH; ++u) {
            const size_t at = (size_t)(r0 + u) * ROW_PIECES_ALL + t;
            kv[2 * u] = load_stream(a.k + at);
            kv[2 * u + 1] = load_stream(a.v + at);
        }
#pragma unroll
        for (int i = 0; i < 2 * DEPTH; ++i) folded ^= kv[i].x ^ kv[i].y ^ kv[i].z ^ kv[i].w;
    }
    if (folded == 0x12345678u) sink[t] = folded;
}

__global__ void fill_words(u32* p, size_t n, u32 seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        p[i] = mix_word(i, seed) & 0x3bff3bffu;  // two finite halves
    }
}

int main(int argc, char** argv) {
    const int ctx = argc > 1 ? atoi(argv[1]) : 8192;
    if (ctx <= 0 || ctx % (MAX_SPLITS * ROWS_A_STEP) != 0) {
        printf("ctx must be a positive multiple of %d\n", MAX_SPLITS * ROWS_A_STEP);
        return 1;
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const double layer_bytes = 2.0 * ctx * KV_HEADS * HEAD_DIM * 2;
    printf("%s, %d SMs; one sequence at depth %d, %d/%d heads of %d, f16 cache: %.1f MB a layer, %d layers\n", prop.name, prop.multiProcessorCount, ctx,
           KV_HEADS * GROUP, KV_HEADS, HEAD_DIM, layer_bytes / 1e6, LAYERS);

    std::vector<Args> layers(LAYERS);
    float *part_acc, *part_ml, *out;
    u32* tickets;
    CK(cudaMalloc(&part_acc, (size_t)KV_HEADS * MAX_SPLITS * GROUP * HEAD_DIM * 4));
    CK(cudaMalloc(&part_ml, (size_t)KV_HEADS * MAX_SPLITS * GROUP * 2 * 4));
    CK(cudaMalloc(&out, (size_t)KV_HEADS * GROUP * HEAD_DIM * 4));
    CK(cudaMalloc(&tickets, KV_HEADS * 4));
    CK(cudaMemset(tickets, 0, KV_HEADS * 4));
    for (int l = 0; l < LAYERS; ++l) {
        const size_t words = (size_t)ctx * KV_HEADS * HEAD_DIM / 2;
        u32 *k, *v;
        CK(cudaMalloc(&k, words * 4));
        CK(cudaMalloc(&v, words * 4));
        fill_words<<<1024, 256>>>(k, words, 2 * l + 1);
        fill_words<<<1024, 256>>>(v, words, 2 * l + 2);
        layers[l] = Args{reinterpret_cast<const uint4*>(k), reinterpret_cast<const uint4*>(v), ctx, part_acc, part_ml, tickets, out};
    }
    CK(cudaDeviceSynchronize());
    CK(cudaFuncSetAttribute(split_attention<CLUSTER>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));

    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    struct Way {
        const char* name;
        int merge, splits;
    };
    const Way ways[] = {{"no merge", NO_MERGE, 16},     {"no merge", NO_MERGE, 32},     {"no merge", NO_MERGE, 64},
                        {"ticket merge", TICKET, 16},   {"ticket merge", TICKET, 32},   {"ticket merge", TICKET, 64},
                        {"cluster merge", CLUSTER, 8},  {"cluster merge", CLUSTER, 16}};
    std::vector<float> last_out[3][MAX_SPLITS + 1];
    printf("%-14s | splits | blocks | us a layer | GB/s\n", "way");
    for (const Way& w : ways) {
        auto launch = [&](int layer) {
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(w.splits, KV_HEADS);
            cfg.blockDim = dim3(THREADS);
            cfg.stream = st;
            cudaLaunchAttribute attr[1];
            attr[0].id = cudaLaunchAttributeClusterDimension;
            attr[0].val.clusterDim.x = w.splits;
            attr[0].val.clusterDim.y = 1;
            attr[0].val.clusterDim.z = 1;
            cfg.attrs = attr;
            cfg.numAttrs = w.merge == CLUSTER ? 1 : 0;
            const Args& a = layers[layer];
            if (w.merge == NO_MERGE) CK(cudaLaunchKernelEx(&cfg, split_attention<NO_MERGE>, a));
            if (w.merge == TICKET) CK(cudaLaunchKernelEx(&cfg, split_attention<TICKET>, a));
            if (w.merge == CLUSTER) CK(cudaLaunchKernelEx(&cfg, split_attention<CLUSTER>, a));
        };
        if (w.merge == CLUSTER) {
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(w.splits, KV_HEADS);
            cfg.blockDim = dim3(THREADS);
            cudaLaunchAttribute attr[1];
            attr[0].id = cudaLaunchAttributeClusterDimension;
            attr[0].val.clusterDim = {(unsigned)w.splits, 1, 1};
            cfg.attrs = attr;
            cfg.numAttrs = 1;
            int clusters = 0;
            if (cudaOccupancyMaxActiveClusters(&clusters, split_attention<CLUSTER>, &cfg) != cudaSuccess || clusters < 1) {
                printf("%-14s | %6d | cannot be resident (%d clusters)\n", w.name, w.splits, clusters);
                cudaGetLastError();
                continue;
            }
        }
        const float us = time_launches(st, LAYERS, launch);
        CK(cudaStreamSynchronize(st));
        printf("%-14s | %6d | %6d | %10.2f | %4.0f\n", w.name, w.splits, w.splits * KV_HEADS, us, layer_bytes / us / 1e3);
        last_out[w.merge][w.splits].resize(KV_HEADS * GROUP * HEAD_DIM);
        CK(cudaMemcpy(last_out[w.merge][w.splits].data(), out, KV_HEADS * GROUP * HEAD_DIM * 4, cudaMemcpyDeviceToHost));
    }
    static_assert(THREADS == ROW_PIECES_ALL, "a pass of stream_rows is one whole cache row");
    u32* sink;
    CK(cudaMalloc(&sink, THREADS * 4));
    struct StreamWay {
        int blocks, depth;
    };
    const StreamWay stream_ways[] = {{128, 8}, {256, 8}, {512, 8}, {128, 16}, {256, 16}, {1024, 8}};
    for (const StreamWay& w : stream_ways) {
        if (ctx % (w.blocks * w.depth) != 0) {
            printf("rows, %d deep     |      - | %6d | skipped: ctx not a multiple of %d\n", w.depth, w.blocks, w.blocks * w.depth);
            continue;
        }
        auto launch = [&](int layer) {
            if (w.depth == 8) stream_rows<8><<<w.blocks, THREADS, 0, st>>>(layers[layer], sink);
            if (w.depth == 16) stream_rows<16><<<w.blocks, THREADS, 0, st>>>(layers[layer], sink);
        };
        const float us = time_launches(st, LAYERS, launch);
        CK(cudaStreamSynchronize(st));
        char name[32];
        snprintf(name, sizeof name, "rows, %d deep", w.depth);
        printf("%-14s | %6s | %6d | %10.2f | %4.0f\n", name, "-", w.blocks, us, layer_bytes / us / 1e3);
    }
    // Both merges of 16 splits saw the same partials (the last layer's): they must agree but
    // for the order of the float sums.
    const std::vector<float>&ticket = last_out[TICKET][16], &cluster = last_out[CLUSTER][16];
    if (!ticket.empty() && !cluster.empty()) {
        double diff = 0, norm = 0;
        for (size_t i = 0; i < ticket.size(); ++i) {
            diff = fmax(diff, fabs((double)ticket[i] - cluster[i]));
            norm = fmax(norm, fabs((double)ticket[i]));
        }
        printf("\nticket vs cluster merge, 16 splits: max |difference| %.3e (of %.3f)%s\n", diff, norm, diff <= 1e-5 * norm ? "" : "  MISMATCH");
    }
    printf("the bar (tg128 at depth 8192 at most 15%% below depth 0, Llama-3-8B Q4_K_M) needs about 3.3 TB/s on the H200\n");
    return 0;
}
