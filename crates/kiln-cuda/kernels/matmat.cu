// Embedding-row lookup for every weight format (the products are in matmat_mma.cu).
// kiln-waits-for-inputs
#include "quant.cuh"

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

#define EMBED_ARGS const u32* ids, u32 n, u32 rows, float* out, u32 cols

extern "C" __global__ void embed_f32(FloatRows<0> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_f16(FloatRows<1> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_bf16(FloatRows<2> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_q8_0(QuantRows<FmtQ8_0> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_q4_0(QuantRows<FmtQ4_0> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_q4_1(QuantRows<FmtQ4_1> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_q5_0(QuantRows<FmtQ5_0> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_q5_1(QuantRows<FmtQ5_1> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_iq4_nl(QuantRows<FmtIQ4_NL> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_q1_0(QuantRows<FmtQ1_0> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_q2_k(QuantRows<FmtQ2_K> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_q3_k(QuantRows<FmtQ3_K> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_q4_k(QuantRows<FmtQ4_K> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_q5_k(QuantRows<FmtQ5_K> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_q6_k(QuantRows<FmtQ6_K> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_iq4_xs(QuantRows<FmtIQ4_XS> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_tq2_0(QuantRows<FmtTQ2_0> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_q2_0(QuantRows<FmtQ2_0> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_mxfp4(QuantRows<FmtMXFP4> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_nvfp4(QuantRows<FmtNVFP4> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_iq2_xxs(QuantRows<FmtIQ2_XXS> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_iq2_xs(QuantRows<FmtIQ2_XS> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_iq2_s(QuantRows<FmtIQ2_S> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_iq3_xxs(QuantRows<FmtIQ3_XXS> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_iq3_s(QuantRows<FmtIQ3_S> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_iq1_s(QuantRows<FmtIQ1_S> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}

extern "C" __global__ void embed_iq1_m(QuantRows<FmtIQ1_M> table, EMBED_ARGS) {
    wait_for_inputs();
    embed(table, ids, n, rows, out, cols);
}
