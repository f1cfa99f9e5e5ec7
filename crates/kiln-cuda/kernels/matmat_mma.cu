// Tensor-core mat-mat for every weight format: out[t][r] = sum_c W[r][c] * x[t][c] for x [n][cols]
// and out [n][rows] f32 (+= with `accumulate`), or the fused SwiGLU silu(x.Wg) * (x.Wu).
//
// Three kernel bodies share the entry points below, the PTX wrappers and the f16 chunk decoders
// (mma.cuh); the host picks a body and its tile with the defines (MmaTile in src/matvec/matmat.rs).
//
// Tiles 0..3, mma_tile.cuh: a block of 8 warps computes MMA_BM weight slots x MMA_BN tokens
// over steps of MMA_BK = 4096 / MMA_BM values of depth, so each thread decodes exactly one
// 16-value chunk per step (the quant.cuh decoders) into shared f16, and converts f32
// activations to f16 on their way into shared memory. Products are mma.sync m16n8k16 (f16
// operands, f32 accumulators) fed by ldmatrix. Two shared buffers: the global loads of step
// s + 1 are issued into registers before the MMAs of step s and stored after them, one barrier
// per step. Warps: MMA_BM / 32 along the slots, MMA_WN along the tokens, the rest split the
// depth (their sums meet in shared memory at the end, in a fixed order). With the SwiGLU pair,
// each 16-slot m16 tile holds 8 gate rows then the same 8 up rows, so one thread holds both
// halves of its outputs. Grid: (row blocks, token blocks).
//
// Pipelined tiles (MMA_PIPE=1), mma_pipe.cuh; measured baseline on the H200 (Q4_K 14336x4096):
// tile 0 at n = 512 154 TFLOP/s, tile 2 at n = 64 410 GB/s of weight. Changes and why:
// (a) The activations are converted to f16 once per product (mma_half_activations into a
//     shared scratch, rows padded to 8 values) instead of by each of the ~112 row blocks: half
//     the L2 traffic of x and no conversion work in the mat-mat; they arrive by 16-byte
//     cp.async straight into shared memory, no registers held while in flight.
// (b) An MMA_XS-stage activation ring (3 for the big tiles): two steps of copy latency hidden.
// (c) MMA_BK = 64..256 values per step (tiles 0..3: 32..128), so every barrier covers 2..8x
//     the MMAs and each thread keeps MMA_CPT = 2..4 weight chunks in flight instead of one.
// (d) Small n: tiles of 64..128 rows with all (32 or 64) tokens and BK 128..256, optionally
//     split along the depth over gridDim.z (partials in f32, summed in split order by
//     mma_reduce_splits: deterministic), so enough blocks stream the weight at once.
// Tokens vary fastest over the grid (token blocks, row blocks, splits): blocks resident
// together share weight rows, read from DRAM once. Dynamic shared memory 64..101 KiB, two
// blocks per multiprocessor.
// Predicted: 128x128 (BK 64, 3 stages) at n >= 256: 154 -> ~230-280 TFLOP/s (latency of both
// operands hidden, 2x MMAs per barrier); 128x64 the same gain at n 65..256; 64x64 / 64x32 /
// 128x32 (BK 128-256, split-K) at n <= 64: 3-4x the weight bytes in flight per multiprocessor,
// ~1.2-1.6 TB/s (14336x4096 Q4_K at n = 64: ~25 us instead of 81). The weights are still
// decoded through registers (the decoders read global memory); a cp.async of raw weight
// bytes would need shared-memory decoders, the next lever if the decode shows up as the limit.
//
// Streaming tiles (MMA_PIPE=2), mma_stream.cuh, for up to 64 tokens: the weight chunks go from
// global memory through registers straight into the MMAs' A operands (a permuted depth order
// makes each thread's own chunk its operand), so no shared weight tile, no decode-store-load
// round trip and no barrier holds the weight stream back.
//
// Needs sm_80 (mma.m16n8k16, cvt f16x2, cp.async).
// kiln-test-defines: MMA_BM=128,MMA_BN=128,MMA_WN=2
// kiln-test-defines: MMA_BM=128,MMA_BN=64,MMA_WN=2
// kiln-test-defines: MMA_BM=64,MMA_BN=64,MMA_WN=2
// kiln-test-defines: MMA_BM=32,MMA_BN=32,MMA_WN=1
// kiln-test-defines: MMA_BM=128,MMA_BN=128,MMA_WN=2,MMA_BK=64,MMA_XS=3,MMA_PIPE=1
// kiln-test-defines: MMA_BM=128,MMA_BN=64,MMA_WN=2,MMA_BK=64,MMA_XS=3,MMA_PIPE=1
// kiln-test-defines: MMA_BM=64,MMA_BN=64,MMA_WN=2,MMA_BK=128,MMA_XS=2,MMA_PIPE=1
// kiln-test-defines: MMA_BM=64,MMA_BN=32,MMA_WN=1,MMA_BK=256,MMA_XS=2,MMA_PIPE=1
// kiln-test-defines: MMA_BM=128,MMA_BN=32,MMA_WN=1,MMA_BK=128,MMA_XS=2,MMA_PIPE=1
// kiln-test-defines: MMA_BM=64,MMA_BN=64,MMA_WN=2,MMA_BK=128,MMA_XS=2,MMA_PIPE=1,MMA_MIN_BLOCKS=3
// kiln-test-defines: MMA_BM=128,MMA_BN=32,MMA_WN=1,MMA_BK=256,MMA_XS=2,MMA_PIPE=2
// kiln-test-defines: MMA_BM=128,MMA_BN=64,MMA_WN=1,MMA_BK=256,MMA_XS=2,MMA_PIPE=2,MMA_MIN_BLOCKS=1
// kiln-test-defines: MMA_BM=256,MMA_BN=32,MMA_WN=1,MMA_BK=128,MMA_XS=3,MMA_PIPE=2
// kiln-test-defines: MMA_BM=128,MMA_BN=16,MMA_WN=1,MMA_BK=256,MMA_XS=2,MMA_PIPE=2
// kiln-test-defines: MMA_BM=256,MMA_BN=64,MMA_WN=1,MMA_BK=128,MMA_XS=2,MMA_PIPE=2,MMA_MIN_BLOCKS=1
// kiln-test-defines: MMA_BM=128,MMA_BN=32,MMA_WN=1,MMA_BK=512,MMA_XS=2,MMA_PIPE=2,MMA_MIN_BLOCKS=1
// kiln-test-defines: MMA_BM=128,MMA_BN=32,MMA_WN=1,MMA_BK=256,MMA_XS=2,MMA_PIPE=2,MMA_TYPE=12
// kiln-test-defines: MMA_BM=256,MMA_BN=64,MMA_WN=1,MMA_BK=128,MMA_XS=2,MMA_PIPE=2,MMA_MIN_BLOCKS=1,MMA_TYPE=14

// kiln-waits-for-inputs
#if !defined(MMA_BM) || !defined(MMA_BN) || !defined(MMA_WN)
#error "matmat_mma kernels need -DMMA_BM=<slots> -DMMA_BN=<tokens> -DMMA_WN=<warps along the tokens>"
#endif

#define MMA_THREADS 256

#ifndef MMA_PIPE
#define MMA_PIPE 0
#endif
#if MMA_PIPE
#if MMA_PIPE == 2
#include "mma_stream.cuh"
#else
#include "mma_pipe.cuh"
#endif
template <class W>
__device__ __forceinline__ void matmat_one(const W& w, const u16* x, u32 ld, u32 n, float* out, u32 rows, float* partials, u32 accumulate) {
    matmat_body<W, 1>(w, w, x, ld, n, MmaOut{out, partials, rows, blockIdx.y, accumulate});
}
template <class W>
__device__ __forceinline__ void matmat_two(const W& gate, const W& up, const u16* x, u32 ld, u32 n, float* out, u32 rows, float* partials) {
    matmat_body<W, 2>(gate, up, x, ld, n, MmaOut{out, partials, rows, blockIdx.y, 0});
}
// x: f16 activations [n][cols] with cols a multiple of 8; partials: the split-K sums.
#define MM_ARGS const u16* x, u32 cols, u32 n, float* out, u32 rows, float* partials
#define MM_PASS x, cols, n, out, rows, partials
#if MMA_PIPE == 2
// Experts over groups of slots (a prompt's or a large batch's mixture of experts): the slots
// were sorted by expert into groups of up to MMA_BN that share one (moe_group_slots), their
// rows gathered into MMA_BN consecutive rows per group, so the token block g = blockIdx.x is
// group g and multiplies by expert group_expert[g], whose weight descriptor is table[expert].
// Blocks of groups from *n_groups on exit at once.
#define MM_GROUP_ARGS const u32 *group_expert, const u32 *n_groups, MM_ARGS, u32 accumulate
#define MM_GROUP_PASS group_expert, n_groups, MM_PASS, accumulate
template <class W>
__device__ __forceinline__ void matmat_group(const W* table, const u32* group_expert, const u32* n_groups, const u16* x, u32 ld,
                                             u32 n, float* out, u32 rows, float* partials, u32 accumulate) {
    wait_for_inputs();
    if (blockIdx.x >= *n_groups) {
        return;
    }
    const W w = table[group_expert[blockIdx.x]];
    matmat_body<W, 1>(w, w, x, ld, n, MmaOut{out, partials, rows, blockIdx.y, accumulate});
}
#endif
// Up to three weights of one format and width on one input (attention's q, k and v) in one
// launch, as the stacked mat-vec does: the first row blocks compute a's rows, the next b's, the
// rest c's (rows_c = 0 for two). With split-K each weight's partial sums take their own
// [split][n][rows] region of `partials`, a's first, for mma_reduce_stacked.
#define MM_STACKED_ARGS \
    const u16 *x, u32 cols, u32 n, float *partials, float *out_a, float *out_b, float *out_c, u32 rows_a, u32 rows_b, u32 rows_c
#define MM_STACKED_PASS x, cols, n, partials, out_a, out_b, out_c, rows_a, rows_b, rows_c
template <class W>
__device__ __forceinline__ void matmat_stacked(const W& a, const W& b, const W& c, MM_STACKED_ARGS) {
    constexpr u32 PER_BLOCK = MMA_BM;
    u32 block = blockIdx.y;
    const u32 k = stacked_weight(block, (rows_a + PER_BLOCK - 1) / PER_BLOCK, (rows_b + PER_BLOCK - 1) / PER_BLOCK);
    const W w = k == 0 ? a : k == 1 ? b : c;
    const u64 before = k == 0 ? 0 : k == 1 ? rows_a : (u64)rows_a + rows_b;
    float* region = partials + before * gridDim.z * n;
    matmat_body<W, 1>(w, w, x, cols, n, MmaOut{k == 0 ? out_a : k == 1 ? out_b : out_c, region, k == 0 ? rows_a : k == 1 ? rows_b : rows_c, block, 0});
}
#else
#include "mma_tile.cuh"
#define MM_ARGS const float* x, u32 cols, u32 n, float* out, u32 rows
#define MM_PASS x, cols, n, out, rows
#endif

// f32 activations [n][cols] -> f16 [n][ld] (ld: cols rounded up to 8, the pad zeroed), 8
// values per thread, for the pipelined tiles, in the order this module's body reads (the host's
// HalfLayout). Compiled in every module, like the reduction.
#if MMA_PIPE == 2 && MMA_X_PERMUTED
#define HALF_PERMUTED true
#else
#define HALF_PERMUTED false
#endif
extern "C" __global__ void __launch_bounds__(256) mma_half_activations(const float* __restrict__ x, u32 cols, u32 n, u32 ld,
                                                                         u16* __restrict__ xh) {
    wait_for_inputs();
    const u32 per_token = ld / 8;
    const u64 total = (u64)n * per_token;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (u64)gridDim.x * blockDim.x) {
        const u32 token = (u32)(e / per_token);
        const u32 column = (u32)(e % per_token) * 8;
        const float* p = x + (u64)token * cols + column;
        float v[8];
        if ((cols & 3) == 0 && column + 8 <= cols) {
            const float4 a = __ldg(reinterpret_cast<const float4*>(p));
            const float4 b = __ldg(reinterpret_cast<const float4*>(p + 4));
            v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                v[j] = column + j < cols ? __ldg(p + j) : 0.0f;
            }
        }
        store_half8(xh + (u64)token * ld + column, v, HALF_PERMUTED);
    }
}

// Split-K: out[e] = sum over splits s (in order) of partials[s][e] for e < count (= n * rows),
// added to out with `accumulate`; `pair`: partials hold (gate, up) and out = silu(g) * u.
extern "C" __global__ void __launch_bounds__(256) mma_reduce_splits(const float* __restrict__ partials, u32 splits, u32 count,
                                                                      u32 pair, u32 accumulate, float* out) {
    wait_for_inputs();
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < count; e += (u64)gridDim.x * blockDim.x) {
        if (pair) {
            float g = 0.0f, u = 0.0f;
            for (u32 s = 0; s < splits; ++s) {
                const float2 v = reinterpret_cast<const float2*>(partials)[(u64)s * count + e];
                g += v.x;
                u += v.y;
            }
            out[e] = silu_mma(g) * u;
        } else {
            float v = 0.0f;
            for (u32 s = 0; s < splits; ++s) {
                v += partials[(u64)s * count + e];
            }
            out[e] = accumulate ? out[e] + v : v;
        }
    }
}

// The split-K sums of a stacked launch (matmat_stacked): weight k's outputs out_k[e] for
// e < n * rows_k are the sums over splits s (in order) of its region's partials[s][e].
extern "C" __global__ void __launch_bounds__(256) mma_reduce_stacked(const float* __restrict__ partials, u32 splits, u32 n, float* out_a,
                                                                       float* out_b, float* out_c, u32 rows_a, u32 rows_b, u32 rows_c) {
    wait_for_inputs();
    const u64 count_a = (u64)n * rows_a, count_b = (u64)n * rows_b, total = count_a + count_b + (u64)n * rows_c;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (u64)gridDim.x * blockDim.x) {
        const u32 k = e < count_a ? 0 : e < count_a + count_b ? 1 : 2;
        const u64 before = k == 0 ? 0 : k == 1 ? count_a : count_a + count_b;
        const u64 count = k == 0 ? count_a : k == 1 ? count_b : total - count_a - count_b;
        const float* region = partials + before * splits;
        const u64 i = e - before;
        float v = 0.0f;
        for (u32 s = 0; s < splits; ++s) {
            v += region[(u64)s * count + i];
        }
        (k == 0 ? out_a : k == 1 ? out_b : out_c)[i] = v;
    }
}

// MMA_TYPE (a GGML type id) compiles only that format's pair, so a model pays for the formats
// it has; without it every format is compiled (the compile check).
#ifndef MMA_TYPE
#define MMA_TYPE -1
#endif
#define MMA_WANTS(ggml_type) (MMA_TYPE < 0 || MMA_TYPE == (ggml_type))
// __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS): by default two resident blocks per
// multiprocessor (16 warps), so at most 128 registers per thread; a small-batch tile asks for
// 3 (85 registers) so that more warps hide the weight loads' latency.
#ifndef MMA_MIN_BLOCKS
#define MMA_MIN_BLOCKS 2
#endif

#if MMA_WANTS(0)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_f32(FloatRows<0> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_f32(FloatRows<0> gate, FloatRows<0> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#endif

#if MMA_WANTS(1)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_f16(FloatRows<1> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_f16(FloatRows<1> gate, FloatRows<1> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#endif

#if MMA_WANTS(30)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_bf16(FloatRows<2> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_bf16(FloatRows<2> gate, FloatRows<2> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#endif

#if MMA_WANTS(8)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_q8_0(QuantRows<FmtQ8_0> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_q8_0(QuantRows<FmtQ8_0> gate, QuantRows<FmtQ8_0> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_q8_0(const QuantRows<FmtQ8_0>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_q8_0(QuantRows<FmtQ8_0> a, QuantRows<FmtQ8_0> b, QuantRows<FmtQ8_0> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(2)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_q4_0(QuantRows<FmtQ4_0> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_q4_0(QuantRows<FmtQ4_0> gate, QuantRows<FmtQ4_0> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_q4_0(const QuantRows<FmtQ4_0>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_q4_0(QuantRows<FmtQ4_0> a, QuantRows<FmtQ4_0> b, QuantRows<FmtQ4_0> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(3)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_q4_1(QuantRows<FmtQ4_1> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_q4_1(QuantRows<FmtQ4_1> gate, QuantRows<FmtQ4_1> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_q4_1(const QuantRows<FmtQ4_1>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_q4_1(QuantRows<FmtQ4_1> a, QuantRows<FmtQ4_1> b, QuantRows<FmtQ4_1> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(6)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_q5_0(QuantRows<FmtQ5_0> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_q5_0(QuantRows<FmtQ5_0> gate, QuantRows<FmtQ5_0> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_q5_0(const QuantRows<FmtQ5_0>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_q5_0(QuantRows<FmtQ5_0> a, QuantRows<FmtQ5_0> b, QuantRows<FmtQ5_0> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(7)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_q5_1(QuantRows<FmtQ5_1> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_q5_1(QuantRows<FmtQ5_1> gate, QuantRows<FmtQ5_1> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_q5_1(const QuantRows<FmtQ5_1>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_q5_1(QuantRows<FmtQ5_1> a, QuantRows<FmtQ5_1> b, QuantRows<FmtQ5_1> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(20)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_iq4_nl(QuantRows<FmtIQ4_NL> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_iq4_nl(QuantRows<FmtIQ4_NL> gate, QuantRows<FmtIQ4_NL> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_iq4_nl(const QuantRows<FmtIQ4_NL>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_iq4_nl(QuantRows<FmtIQ4_NL> a, QuantRows<FmtIQ4_NL> b, QuantRows<FmtIQ4_NL> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(41)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_q1_0(QuantRows<FmtQ1_0> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_q1_0(QuantRows<FmtQ1_0> gate, QuantRows<FmtQ1_0> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_q1_0(const QuantRows<FmtQ1_0>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_q1_0(QuantRows<FmtQ1_0> a, QuantRows<FmtQ1_0> b, QuantRows<FmtQ1_0> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(10)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_q2_k(QuantRows<FmtQ2_K> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_q2_k(QuantRows<FmtQ2_K> gate, QuantRows<FmtQ2_K> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_q2_k(const QuantRows<FmtQ2_K>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_q2_k(QuantRows<FmtQ2_K> a, QuantRows<FmtQ2_K> b, QuantRows<FmtQ2_K> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(11)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_q3_k(QuantRows<FmtQ3_K> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_q3_k(QuantRows<FmtQ3_K> gate, QuantRows<FmtQ3_K> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_q3_k(const QuantRows<FmtQ3_K>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_q3_k(QuantRows<FmtQ3_K> a, QuantRows<FmtQ3_K> b, QuantRows<FmtQ3_K> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(12)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_q4_k(QuantRows<FmtQ4_K> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_q4_k(QuantRows<FmtQ4_K> gate, QuantRows<FmtQ4_K> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_q4_k(const QuantRows<FmtQ4_K>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_q4_k(QuantRows<FmtQ4_K> a, QuantRows<FmtQ4_K> b, QuantRows<FmtQ4_K> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(13)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_q5_k(QuantRows<FmtQ5_K> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_q5_k(QuantRows<FmtQ5_K> gate, QuantRows<FmtQ5_K> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_q5_k(const QuantRows<FmtQ5_K>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_q5_k(QuantRows<FmtQ5_K> a, QuantRows<FmtQ5_K> b, QuantRows<FmtQ5_K> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(14)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_q6_k(QuantRows<FmtQ6_K> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_q6_k(QuantRows<FmtQ6_K> gate, QuantRows<FmtQ6_K> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_q6_k(const QuantRows<FmtQ6_K>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_q6_k(QuantRows<FmtQ6_K> a, QuantRows<FmtQ6_K> b, QuantRows<FmtQ6_K> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(23)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_iq4_xs(QuantRows<FmtIQ4_XS> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_iq4_xs(QuantRows<FmtIQ4_XS> gate, QuantRows<FmtIQ4_XS> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_iq4_xs(const QuantRows<FmtIQ4_XS>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_iq4_xs(QuantRows<FmtIQ4_XS> a, QuantRows<FmtIQ4_XS> b, QuantRows<FmtIQ4_XS> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(35)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_tq2_0(QuantRows<FmtTQ2_0> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_tq2_0(QuantRows<FmtTQ2_0> gate, QuantRows<FmtTQ2_0> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_tq2_0(const QuantRows<FmtTQ2_0>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_tq2_0(QuantRows<FmtTQ2_0> a, QuantRows<FmtTQ2_0> b, QuantRows<FmtTQ2_0> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(42)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_q2_0(QuantRows<FmtQ2_0> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_q2_0(QuantRows<FmtQ2_0> gate, QuantRows<FmtQ2_0> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_q2_0(const QuantRows<FmtQ2_0>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_q2_0(QuantRows<FmtQ2_0> a, QuantRows<FmtQ2_0> b, QuantRows<FmtQ2_0> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(39)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_mxfp4(QuantRows<FmtMXFP4> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_mxfp4(QuantRows<FmtMXFP4> gate, QuantRows<FmtMXFP4> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_mxfp4(const QuantRows<FmtMXFP4>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_mxfp4(QuantRows<FmtMXFP4> a, QuantRows<FmtMXFP4> b, QuantRows<FmtMXFP4> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(40)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_nvfp4(QuantRows<FmtNVFP4> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_nvfp4(QuantRows<FmtNVFP4> gate, QuantRows<FmtNVFP4> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_nvfp4(const QuantRows<FmtNVFP4>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_nvfp4(QuantRows<FmtNVFP4> a, QuantRows<FmtNVFP4> b, QuantRows<FmtNVFP4> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(16)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_iq2_xxs(QuantRows<FmtIQ2_XXS> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_iq2_xxs(QuantRows<FmtIQ2_XXS> gate, QuantRows<FmtIQ2_XXS> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_iq2_xxs(const QuantRows<FmtIQ2_XXS>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_iq2_xxs(QuantRows<FmtIQ2_XXS> a, QuantRows<FmtIQ2_XXS> b, QuantRows<FmtIQ2_XXS> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(17)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_iq2_xs(QuantRows<FmtIQ2_XS> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_iq2_xs(QuantRows<FmtIQ2_XS> gate, QuantRows<FmtIQ2_XS> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_iq2_xs(const QuantRows<FmtIQ2_XS>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_iq2_xs(QuantRows<FmtIQ2_XS> a, QuantRows<FmtIQ2_XS> b, QuantRows<FmtIQ2_XS> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(22)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_iq2_s(QuantRows<FmtIQ2_S> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_iq2_s(QuantRows<FmtIQ2_S> gate, QuantRows<FmtIQ2_S> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_iq2_s(const QuantRows<FmtIQ2_S>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_iq2_s(QuantRows<FmtIQ2_S> a, QuantRows<FmtIQ2_S> b, QuantRows<FmtIQ2_S> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(18)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_iq3_xxs(QuantRows<FmtIQ3_XXS> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_iq3_xxs(QuantRows<FmtIQ3_XXS> gate, QuantRows<FmtIQ3_XXS> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_iq3_xxs(const QuantRows<FmtIQ3_XXS>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_iq3_xxs(QuantRows<FmtIQ3_XXS> a, QuantRows<FmtIQ3_XXS> b, QuantRows<FmtIQ3_XXS> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(21)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_iq3_s(QuantRows<FmtIQ3_S> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_iq3_s(QuantRows<FmtIQ3_S> gate, QuantRows<FmtIQ3_S> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_iq3_s(const QuantRows<FmtIQ3_S>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_iq3_s(QuantRows<FmtIQ3_S> a, QuantRows<FmtIQ3_S> b, QuantRows<FmtIQ3_S> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(19)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_iq1_s(QuantRows<FmtIQ1_S> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_iq1_s(QuantRows<FmtIQ1_S> gate, QuantRows<FmtIQ1_S> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_iq1_s(const QuantRows<FmtIQ1_S>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_iq1_s(QuantRows<FmtIQ1_S> a, QuantRows<FmtIQ1_S> b, QuantRows<FmtIQ1_S> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif

#if MMA_WANTS(29)
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_iq1_m(QuantRows<FmtIQ1_M> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, MM_PASS, accumulate);
}
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_swiglu_iq1_m(QuantRows<FmtIQ1_M> gate, QuantRows<FmtIQ1_M> up, MM_ARGS) {
    matmat_two(gate, up, MM_PASS);
}
#if MMA_PIPE == 2
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_groups_iq1_m(const QuantRows<FmtIQ1_M>* table, MM_GROUP_ARGS) {
    matmat_group(table, MM_GROUP_PASS);
}
#endif
#if MMA_PIPE
extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS) matmat_stacked_iq1_m(QuantRows<FmtIQ1_M> a, QuantRows<FmtIQ1_M> b, QuantRows<FmtIQ1_M> c, MM_STACKED_ARGS) {
    matmat_stacked(a, b, c, MM_STACKED_PASS);
}
#endif
#endif
