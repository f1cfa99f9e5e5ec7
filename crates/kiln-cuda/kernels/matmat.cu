// Mat-mat for any number of tokens (prompt processing) and embedding-row lookup, for every
// weight format. Correctness-first f32 SIMT tiling: each block decodes a 64-row x 64-value tile
// of the weight (16-value chunks, quant.cuh) and a 64-token x 64-value tile of x into shared
// memory, and each of its 256 threads accumulates a 4 x 4 block of outputs in f32.
#include "quant.cuh"

#define MM_SLOTS 64    // weight rows per block (the fused SwiGLU: 32 gate/up row pairs)
#define MM_TOKENS 64   // tokens per block
#define MM_DEPTH 64    // values of each row per step: 4 chunks
#define MM_THREADS 256
static_assert(MM_SLOTS * (MM_DEPTH / CHUNK_VALUES) == MM_THREADS, "one chunk per thread per step");

__device__ __forceinline__ float silu_f32(float g) {
    return g / (1.0f + expf(-g));
}

// out [n][rows]: out[t][r] = sum_c W[r][c] * x[t][c] for x [n][cols] (+= with `accumulate`), or
// with NW == 2, silu(x.Wg) * (x.Wu) for Wg = first, Wu = second. Grid: (ceil(rows / (MM_SLOTS / NW)), ceil(n / MM_TOKENS)).
template <class W, int NW>
__device__ __forceinline__ void matmat(const W& first, const W& second, const float* __restrict__ x, u32 cols, u32 n, float* out,
                                       u32 rows, u32 accumulate) {
    // Transposed tiles [value][slot or token]; rows padded by 4 floats, keeping 16-byte alignment.
    __shared__ __align__(16) float ws[MM_DEPTH][MM_SLOTS + 4];
    __shared__ __align__(16) float xs[MM_DEPTH][MM_TOKENS + 4];
    constexpr u32 ROWS_PER_BLOCK = MM_SLOTS / NW;
    const u32 tid = threadIdx.x;
    const u32 row_base = blockIdx.x * ROWS_PER_BLOCK;
    const u32 token_base = blockIdx.y * MM_TOKENS;
    const u32 chunks = first.chunks_per_row();
    // Decoding role: slot s holds row s / NW of weight s % NW; consecutive threads take
    // consecutive slots so their shared-memory stores do not conflict.
    const u32 slot = tid % MM_SLOTS;
    const u32 part = tid / MM_SLOTS;
    const u32 slot_row = min(row_base + slot / NW, rows - 1);
    W source = first;
    if (NW == 2 && (slot & 1)) {
        source = second;
    }
    // Computing role: slots 4 ty.. and tokens 4 tx..
    const u32 ty = tid / 16;
    const u32 tx = tid % 16;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc[i][j] = 0.0f;
        }
    }
    for (u32 chunk0 = 0; chunk0 < chunks; chunk0 += MM_DEPTH / CHUNK_VALUES) {
        float v[16];
        if (chunk0 + part < chunks) {
            source.values(slot_row, chunk0 + part, v);
        } else {
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                v[i] = 0.0f;
            }
        }
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            ws[part * CHUNK_VALUES + i][slot] = v[i];
        }
        const u32 column0 = chunk0 * CHUNK_VALUES;
#pragma unroll
        for (int j = 0; j < MM_DEPTH * MM_TOKENS / MM_THREADS; ++j) {
            const u32 e = j * MM_THREADS + tid;
            const u32 k = e % MM_DEPTH;
            const u32 token = token_base + e / MM_DEPTH;
            const u32 column = column0 + k;
            xs[k][e / MM_DEPTH] = token < n && column < cols ? x[(u64)token * cols + column] : 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < MM_DEPTH; ++k) {
            const float4 a = *reinterpret_cast<const float4*>(&ws[k][4 * ty]);
            const float4 b = *reinterpret_cast<const float4*>(&xs[k][4 * tx]);
            const float av[4] = {a.x, a.y, a.z, a.w};
            const float bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const u32 token = token_base + 4 * tx + j;
        if (token >= n) {
            continue;
        }
#pragma unroll
        for (int i = 0; i < 4 / NW; ++i) {
            const u32 row = row_base + (4 * ty) / NW + i;
            if (row >= rows) {
                continue;
            }
            float* slot_out = out + (u64)token * rows + row;
            if (NW == 2) {
                *slot_out = silu_f32(acc[2 * i][j]) * acc[2 * i + 1][j];
            } else {
                *slot_out = accumulate ? *slot_out + acc[i][j] : acc[i][j];
            }
        }
    }
}

// out[t][0..cols) = row ids[t] of the table, decoded to f32; a row of NaN for an id >= rows, so
// a bad token cannot read out of bounds or pass unnoticed. Grid-stride over (token, chunk).
template <class W>
__device__ __forceinline__ void embed(const W& table, const u32* __restrict__ ids, u32 n, u32 rows, float* out,
                                      u32 cols) {
    const u32 chunks = (cols + CHUNK_VALUES - 1) / CHUNK_VALUES;
    for (u64 index = global_thread_index(); index < (u64)n * chunks; index += global_thread_count()) {
        const u32 token = (u32)(index / chunks);
        const u32 chunk = (u32)(index % chunks);
        const u32 id = ids[token];
        float v[16];
        if (id < rows) {
            table.values(id, chunk, v);
        } else {
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                v[i] = __int_as_float(0x7fc00000);
            }
        }
        float* dst = out + (u64)token * cols + chunk * CHUNK_VALUES;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            if (chunk * CHUNK_VALUES + i < cols) {
                dst[i] = v[i];
            }
        }
    }
}

template <class W>
__device__ __forceinline__ void matmat_one(const W& w, const float* x, u32 cols, u32 n, float* out, u32 rows,
                                           u32 accumulate) {
    matmat<W, 1>(w, w, x, cols, n, out, rows, accumulate);
}

template <class W>
__device__ __forceinline__ void matmat_two(const W& gate, const W& up, const float* x, u32 cols, u32 n, float* out,
                                           u32 rows) {
    matmat<W, 2>(gate, up, x, cols, n, out, rows, 0);
}

#define MM_ARGS const float* x, u32 cols, u32 n, float* out, u32 rows
#define EMBED_ARGS const u32* ids, u32 n, u32 rows, float* out, u32 cols

extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_f32(FloatRows<0> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, x, cols, n, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_swiglu_f32(FloatRows<0> gate, FloatRows<0> up, MM_ARGS) {
    matmat_two(gate, up, x, cols, n, out, rows);
}
extern "C" __global__ void embed_f32(FloatRows<0> table, EMBED_ARGS) {
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_f16(FloatRows<1> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, x, cols, n, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_swiglu_f16(FloatRows<1> gate, FloatRows<1> up, MM_ARGS) {
    matmat_two(gate, up, x, cols, n, out, rows);
}
extern "C" __global__ void embed_f16(FloatRows<1> table, EMBED_ARGS) {
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_bf16(FloatRows<2> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, x, cols, n, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_swiglu_bf16(FloatRows<2> gate, FloatRows<2> up, MM_ARGS) {
    matmat_two(gate, up, x, cols, n, out, rows);
}
extern "C" __global__ void embed_bf16(FloatRows<2> table, EMBED_ARGS) {
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_q8_0(QuantRows<FmtQ8_0> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, x, cols, n, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_swiglu_q8_0(QuantRows<FmtQ8_0> gate, QuantRows<FmtQ8_0> up, MM_ARGS) {
    matmat_two(gate, up, x, cols, n, out, rows);
}
extern "C" __global__ void embed_q8_0(QuantRows<FmtQ8_0> table, EMBED_ARGS) {
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_q4_0(QuantRows<FmtQ4_0> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, x, cols, n, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_swiglu_q4_0(QuantRows<FmtQ4_0> gate, QuantRows<FmtQ4_0> up, MM_ARGS) {
    matmat_two(gate, up, x, cols, n, out, rows);
}
extern "C" __global__ void embed_q4_0(QuantRows<FmtQ4_0> table, EMBED_ARGS) {
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_q4_1(QuantRows<FmtQ4_1> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, x, cols, n, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_swiglu_q4_1(QuantRows<FmtQ4_1> gate, QuantRows<FmtQ4_1> up, MM_ARGS) {
    matmat_two(gate, up, x, cols, n, out, rows);
}
extern "C" __global__ void embed_q4_1(QuantRows<FmtQ4_1> table, EMBED_ARGS) {
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_q5_0(QuantRows<FmtQ5_0> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, x, cols, n, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_swiglu_q5_0(QuantRows<FmtQ5_0> gate, QuantRows<FmtQ5_0> up, MM_ARGS) {
    matmat_two(gate, up, x, cols, n, out, rows);
}
extern "C" __global__ void embed_q5_0(QuantRows<FmtQ5_0> table, EMBED_ARGS) {
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_q5_1(QuantRows<FmtQ5_1> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, x, cols, n, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_swiglu_q5_1(QuantRows<FmtQ5_1> gate, QuantRows<FmtQ5_1> up, MM_ARGS) {
    matmat_two(gate, up, x, cols, n, out, rows);
}
extern "C" __global__ void embed_q5_1(QuantRows<FmtQ5_1> table, EMBED_ARGS) {
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_iq4_nl(QuantRows<FmtIQ4_NL> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, x, cols, n, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_swiglu_iq4_nl(QuantRows<FmtIQ4_NL> gate, QuantRows<FmtIQ4_NL> up, MM_ARGS) {
    matmat_two(gate, up, x, cols, n, out, rows);
}
extern "C" __global__ void embed_iq4_nl(QuantRows<FmtIQ4_NL> table, EMBED_ARGS) {
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_q1_0(QuantRows<FmtQ1_0> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, x, cols, n, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_swiglu_q1_0(QuantRows<FmtQ1_0> gate, QuantRows<FmtQ1_0> up, MM_ARGS) {
    matmat_two(gate, up, x, cols, n, out, rows);
}
extern "C" __global__ void embed_q1_0(QuantRows<FmtQ1_0> table, EMBED_ARGS) {
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_q2_k(QuantRows<FmtQ2_K> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, x, cols, n, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_swiglu_q2_k(QuantRows<FmtQ2_K> gate, QuantRows<FmtQ2_K> up, MM_ARGS) {
    matmat_two(gate, up, x, cols, n, out, rows);
}
extern "C" __global__ void embed_q2_k(QuantRows<FmtQ2_K> table, EMBED_ARGS) {
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_q3_k(QuantRows<FmtQ3_K> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, x, cols, n, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_swiglu_q3_k(QuantRows<FmtQ3_K> gate, QuantRows<FmtQ3_K> up, MM_ARGS) {
    matmat_two(gate, up, x, cols, n, out, rows);
}
extern "C" __global__ void embed_q3_k(QuantRows<FmtQ3_K> table, EMBED_ARGS) {
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_q4_k(QuantRows<FmtQ4_K> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, x, cols, n, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_swiglu_q4_k(QuantRows<FmtQ4_K> gate, QuantRows<FmtQ4_K> up, MM_ARGS) {
    matmat_two(gate, up, x, cols, n, out, rows);
}
extern "C" __global__ void embed_q4_k(QuantRows<FmtQ4_K> table, EMBED_ARGS) {
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_q5_k(QuantRows<FmtQ5_K> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, x, cols, n, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_swiglu_q5_k(QuantRows<FmtQ5_K> gate, QuantRows<FmtQ5_K> up, MM_ARGS) {
    matmat_two(gate, up, x, cols, n, out, rows);
}
extern "C" __global__ void embed_q5_k(QuantRows<FmtQ5_K> table, EMBED_ARGS) {
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_q6_k(QuantRows<FmtQ6_K> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, x, cols, n, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_swiglu_q6_k(QuantRows<FmtQ6_K> gate, QuantRows<FmtQ6_K> up, MM_ARGS) {
    matmat_two(gate, up, x, cols, n, out, rows);
}
extern "C" __global__ void embed_q6_k(QuantRows<FmtQ6_K> table, EMBED_ARGS) {
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_iq4_xs(QuantRows<FmtIQ4_XS> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, x, cols, n, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_swiglu_iq4_xs(QuantRows<FmtIQ4_XS> gate, QuantRows<FmtIQ4_XS> up, MM_ARGS) {
    matmat_two(gate, up, x, cols, n, out, rows);
}
extern "C" __global__ void embed_iq4_xs(QuantRows<FmtIQ4_XS> table, EMBED_ARGS) {
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_tq2_0(QuantRows<FmtTQ2_0> w, MM_ARGS, u32 accumulate) {
    matmat_one(w, x, cols, n, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS) matmat_swiglu_tq2_0(QuantRows<FmtTQ2_0> gate, QuantRows<FmtTQ2_0> up, MM_ARGS) {
    matmat_two(gate, up, x, cols, n, out, rows);
}
extern "C" __global__ void embed_tq2_0(QuantRows<FmtTQ2_0> table, EMBED_ARGS) {
    embed(table, ids, n, rows, out, cols);
}
