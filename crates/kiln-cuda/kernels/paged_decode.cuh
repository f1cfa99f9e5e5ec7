// The split decode kernels' shared parts (paged_attention.cu): their tile geometry, how a
// token's visible rows are cut into splits, and the merge of the splits' partials by the last
// split to finish. Needs HEAD_DIM, GROUP, K_TYPE and V_TYPE defined.
#pragma once
#include "activation_q8.cuh"
#include "paged_attention.cuh"

// ============================================================================================
// Split decode attention
// ============================================================================================
//
// Each block walks its split's chunk one KV block (DEC_TILE = 32 rows) at a time. The K and V
// rows of the next DEC_STAGES - 1 tiles are copied into shared memory with cp.async while the
// current tile is scored and accumulated, so a block keeps memory busy across its whole chunk
// instead of paying one load latency per pass.

#define DEC_THREADS 128
#define DEC_WARPS (DEC_THREADS / 32)
// Cache rows per tile: one KV block, so a tile needs one block table entry.
#define DEC_TILE 32
// Whether decode runs on tensor cores (paged_attention_split_mma; src/paged_attention.rs's
// decode_on_tensor_cores mirrors it).
#define DEC_MMA (K_TYPE == KV_F16 && V_TYPE == KV_F16 && HEAD_DIM % 16 == 0 && HEAD_DIM <= 128 && GROUP <= 8)
// Rows a split covers at least, whole KV blocks, so a shorter span takes one split and skips
// the merge (src/paged_attention.rs's min_chunk mirrors it). Tensor cores: four tiles a warp,
// which its three stages stream without a stall; a merge costs more than the extra tiles.
#define DEC_MIN_CHUNK_MMA 256
#define DEC_MIN_CHUNK_CORES 32
#define DEC_MIN_CHUNK (DEC_MMA ? DEC_MIN_CHUNK_MMA : DEC_MIN_CHUNK_CORES)
// Most splits a launch may have (the merge's scratch is sized for them).
#define DEC_MAX_SPLITS 256

static_assert(DEC_TILE == KV_BLOCK_SIZE, "a decode tile is one KV block");

// Score pass: teams of K_TEAM lanes share one row's dot product, each lane holding K_LANE_CHUNKS
// vectors of K_VEC values; q stays in registers, so GROUP * K_VEC is capped at 32 (as is
// GROUP * V_VEC, the accumulators), which keeps the kernel within 128 registers.
constexpr int K_VEC = pick_vec(K_TYPE, cmax(32 / GROUP, 1));
constexpr int K_CHUNKS = HEAD_DIM / K_VEC;
constexpr int K_TEAM = floor_pow2(cmin(32, K_CHUNKS));
constexpr int K_LANE_CHUNKS = (K_CHUNKS + K_TEAM - 1) / K_TEAM;
constexpr int K_TEAMS = DEC_WARPS * (32 / K_TEAM);
constexpr int K_ROWS = cmax(1, cmin(8, DEC_TILE / K_TEAMS));
constexpr int K_PASS = K_TEAMS * K_ROWS;
// Value pass: V_DIM_THREADS threads cover a row in V_VEC-wide reads (V_CHUNKS each) and
// V_ROW_GROUPS rows go side by side; each thread accumulates GROUP * V_VEC values per chunk.
constexpr int V_VEC = pick_vec(V_TYPE, cmax(32 / GROUP, 1));
constexpr int V_DIM_THREADS = cmin(HEAD_DIM / V_VEC, DEC_THREADS);
constexpr int V_ROW_GROUPS = DEC_THREADS / V_DIM_THREADS;
constexpr int V_CHUNKS = (HEAD_DIM + V_VEC * V_DIM_THREADS - 1) / (V_VEC * V_DIM_THREADS);
constexpr int V_STEPS = (DEC_TILE + V_ROW_GROUPS - 1) / V_ROW_GROUPS;

// Shared-memory staging: a tile's K rows then its V rows, each row padded to 16 bytes; stages
// of at most 16 KiB get a third buffer. Must match decode_shared_bytes in src/paged_attention.rs.
constexpr int K_ROW_BYTES = HEAD_DIM * elem_bytes(K_TYPE);
constexpr int V_ROW_BYTES = HEAD_DIM * elem_bytes(V_TYPE);
constexpr int K_STRIDE = (K_ROW_BYTES + 15) / 16 * 16;
constexpr int V_STRIDE = (V_ROW_BYTES + 15) / 16 * 16;
constexpr int DEC_STAGE_BYTES = DEC_TILE * (K_STRIDE + V_STRIDE);
constexpr int DEC_STAGES = DEC_STAGE_BYTES <= 16384 ? 3 : 2;

// Starts copying the first `live_rows` rows of cache block `block` (this kv head's columns)
// into `dst` ([DEC_TILE][STRIDE] bytes); the other rows become zeros.
template <int TYPE, int ROW_BYTES, int STRIDE>
__device__ __forceinline__ void dec_issue(u8* dst, const u8* cache, u32 block, u32 width, u32 col0, u32 live_rows) {
    constexpr int UNIT = copy_unit(ROW_BYTES);
    constexpr int ROW_UNITS = ROW_BYTES / UNIT;
    constexpr int UNITS = DEC_TILE * ROW_UNITS;
    const u8* base = cache + ((u64)block * KV_BLOCK_SIZE * width + col0) * elem_bytes(TYPE);
#pragma unroll
    for (int i = 0; i < (UNITS + DEC_THREADS - 1) / DEC_THREADS; ++i) {
        const u32 u = i * DEC_THREADS + threadIdx.x;
        if (UNITS % DEC_THREADS == 0 || u < UNITS) {
            const u32 j = u / ROW_UNITS;
            const u32 at = u % ROW_UNITS * UNIT;
            copy_async<UNIT>(dst + j * STRIDE + at, base + (u64)j * width * elem_bytes(TYPE) + at, j < live_rows);
        }
    }
}

// Rows per split for a token that sees `visible` positions; split and reduce must agree.
__device__ __forceinline__ u32 split_chunk(u32 visible, u32 n_splits) {
    const u32 rows = max((visible + n_splits - 1) / n_splits, (u32)DEC_MIN_CHUNK);
    return (rows + KV_BLOCK_SIZE - 1) / KV_BLOCK_SIZE * KV_BLOCK_SIZE;
}

// The positions a token at `pos` attends to: first..pos, first = pos + 1 - window for a
// sliding window (window > 0), else 0. The splits cut the span from the KV block holding
// `first` on, so every split's tiles are whole blocks and its first tile has a visible row.
struct DecodeSpan {
    u32 first;
    u32 start;
    u32 end;
};

__device__ __forceinline__ DecodeSpan decode_span(u32 pos, u32 window) {
    DecodeSpan span;
    span.end = pos + 1;
    span.first = window > 0 && span.end > window ? span.end - window : 0;
    span.start = span.first / KV_BLOCK_SIZE * KV_BLOCK_SIZE;
    return span;
}

// The rows split `split` of token `token` reads, begin..end of its span, and the block table
// from `begin` on; `empty` for a token past the step or a split past the span.
struct SplitRows {
    DecodeSpan span;
    u32 begin;
    u32 end;
    const u32* table;
    bool empty;
};

__device__ __forceinline__ SplitRows decode_split_rows(const u32* step, u32 token, u32 window, u32 split, u32 n_splits) {
    SplitRows rows = {};
    rows.empty = true;
    if (token >= step[STEP_N_TOKENS]) {
        return rows;
    }
    rows.span = decode_span(step_pos(step, token), window);
    const u32 chunk = split_chunk(rows.span.end - rows.span.start, n_splits);
    rows.begin = rows.span.start + split * chunk;
    if (rows.begin >= rows.span.end) {
        return rows;
    }
    rows.end = min(rows.begin + chunk, rows.span.end);
    rows.table = step_block_table(step, step_seq(step, step_token_seq(step, token))) + rows.begin / KV_BLOCK_SIZE;
    rows.empty = false;
    return rows;
}

// quantize_heads_out from `rows`, the GROUP heads as the block wrote them (global or shared
// memory).
template <int THREADS = DEC_THREADS>
__device__ __forceinline__ void quantize_head_rows(const float* rows, u32 token, u32 first_head, i8* xq, float2* xds,
                                                   u32 x_chunks) {
    if constexpr (HEAD_DIM % CHUNK_VALUES == 0) {
        if (xq == nullptr) {
            return;
        }
        // The block's stores to `rows` are visible to all its threads past the barrier.
        __syncthreads();
        constexpr u32 HEAD_CHUNKS = HEAD_DIM / CHUNK_VALUES;
        for (u32 c = threadIdx.x; c < GROUP * HEAD_CHUNKS; c += THREADS) {
            float v[CHUNK_VALUES];
            load_written_chunk(rows + c * CHUNK_VALUES, v);
            quantize_chunk(v, xq, xds, (u64)token * x_chunks + first_head * HEAD_CHUNKS + c);
        }
    }
}

// When `xq` is not null, the GROUP heads of `token` this block has just written to `out` are
// also stored as the int8 input of the product that follows (activation_q8.cuh; chunk c of
// the token's row at index token * x_chunks + c), saving that product its own quantization
// launch. The host asks only for HEAD_DIM a multiple of CHUNK_VALUES. Called by every thread.
template <int THREADS = DEC_THREADS>
__device__ __forceinline__ void quantize_heads_out(const float* out, u32 token, u32 first_head, u32 n_heads, i8* xq,
                                                   float2* xds, u32 x_chunks) {
    quantize_head_rows<THREADS>(out + ((u64)token * n_heads + first_head) * HEAD_DIM, token, first_head, xq, xds, x_chunks);
}

// Splits of a token that sees `visible` positions that have rows to read.
__device__ __forceinline__ u32 live_splits(u32 visible, u32 n_splits) {
    const u32 chunk = split_chunk(visible, n_splits);
    return min((visible + chunk - 1) / chunk, n_splits);
}

// Whether a split block is its token's only live one, so it writes the output itself: no
// partials, ticket or merge.
__device__ __forceinline__ bool alone_in_span(const DecodeSpan& span, u32 n_splits) {
    return live_splits(span.end - span.start, n_splits) == 1;
}

// Partial vectors of one head each merging thread loads before adding them up.
constexpr int MERGE_BATCH = 8;
constexpr int MERGE_VEC = HEAD_DIM % 4 == 0 ? 4 : HEAD_DIM % 2 == 0 ? 2 : 1;

// Called by every thread of a split block after its partials are written. Each block takes a
// ticket of its (token, kv head); the one that completes the count of live splits reads every
// split's partials (through L2: other multiprocessors wrote them) and writes the GROUP heads'
// outputs, then resets the ticket for the next launch (no block of this one uses it again).
// `scratch`: the block's dynamic shared memory, free by now, GROUP * (DEC_MAX_SPLITS + 1)
// floats at least (merge_shared_bytes in src/paged_attention.rs). THREADS: the block's size.
template <int THREADS = DEC_THREADS>
__device__ __forceinline__ void merge_splits(float* out, const float* part_acc, const float* part_ml, u32* tickets,
                                             const DecodeSpan& span, u32 token, u32 kv_head, u32 n_heads,
                                             u32 n_kv_heads, u32 n_splits, const float* sinks, float* scratch,
                                             i8* xq, float2* xds, u32 x_chunks) {
    __shared__ u32 last_s;
    const u32 live = live_splits(span.end - span.start, n_splits);
    // Every thread's partials are visible device-wide before the block's ticket is taken.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        u32* ticket = tickets + (u64)token * n_kv_heads + kv_head;
        const u32 arrived = atomicAdd(ticket, 1u) + 1;
        last_s = arrived == live;
        if (arrived == live) {
            *ticket = 0;
        }
    }
    __syncthreads();
    if (!last_s) {
        return;
    }
    __threadfence();
    const u32 lane = threadIdx.x & 31;
    const u32 warp = threadIdx.x >> 5;
    const u32 first_head = kv_head * GROUP;
    const u64 row0 = (u64)token * n_heads + first_head;
    // Partial (max, sum) pairs of head g, split s: ml[(g * n_splits + s) * 2 + {0, 1}].
    const float* ml = part_ml + row0 * n_splits * 2;
    float* weight_s = scratch;
    float* inv_total_s = scratch + GROUP * live;
    // One warp per head: the max over the splits (and the sink), each split's weight, the total.
    for (u32 g = warp; g < GROUP; g += THREADS / 32) {
        const float sink = sinks ? sinks[first_head + g] * LOG2E : NEG_INF;
        float top = sink;
        for (u32 s = lane; s < live; s += 32) {
            const float m = __ldcg(ml + ((u64)g * n_splits + s) * 2);
            weight_s[g * live + s] = m;
            top = fmaxf(top, m);
        }
        top = warp_max(top);
        float total = 0.0f;
        for (u32 s = lane; s < live; s += 32) {
            const float weight = exp2f(weight_s[g * live + s] - top);
            weight_s[g * live + s] = weight;
            total += __ldcg(ml + ((u64)g * n_splits + s) * 2 + 1) * weight;
        }
        total = warp_sum(total);
        if (lane == 0) {
            inv_total_s[g] = 1.0f / (total + (sinks ? exp2f(sink - top) : 0.0f));
        }
    }
    __syncthreads();
    // Each thread sums MERGE_VEC dims of one head over the splits, in split order.
    constexpr u32 HEAD_LANES = HEAD_DIM / MERGE_VEC;
    for (u32 i = threadIdx.x; i < GROUP * HEAD_LANES; i += THREADS) {
        const u32 g = i / HEAD_LANES;
        const u32 d = i % HEAD_LANES * MERGE_VEC;
        const float* acc = part_acc + (row0 + g) * n_splits * HEAD_DIM + d;
        float value[MERGE_VEC] = {};
        for (u32 s0 = 0; s0 < live; s0 += MERGE_BATCH) {
            float batch[MERGE_BATCH][MERGE_VEC];
#pragma unroll
            for (int b = 0; b < MERGE_BATCH; ++b) {
                const u32 s = s0 + b;
                const float* p = acc + (u64)min(s, live - 1) * HEAD_DIM;
                if constexpr (MERGE_VEC == 4) {
                    const float4 x = __ldcg(reinterpret_cast<const float4*>(p));
                    batch[b][0] = x.x;
                    batch[b][1] = x.y;
                    batch[b][2] = x.z;
                    batch[b][3] = x.w;
                } else if constexpr (MERGE_VEC == 2) {
                    const float2 x = __ldcg(reinterpret_cast<const float2*>(p));
                    batch[b][0] = x.x;
                    batch[b][1] = x.y;
                } else {
                    batch[b][0] = __ldcg(p);
                }
            }
#pragma unroll
            for (int b = 0; b < MERGE_BATCH; ++b) {
                const float weight = s0 + b < live ? weight_s[g * live + s0 + b] : 0.0f;
#pragma unroll
                for (int c = 0; c < MERGE_VEC; ++c) {
                    value[c] += batch[b][c] * weight;
                }
            }
        }
#pragma unroll
        for (int c = 0; c < MERGE_VEC; ++c) {
            out[(row0 + g) * HEAD_DIM + d + c] = value[c] * inv_total_s[g];
        }
    }
    quantize_heads_out<THREADS>(out, token, first_head, n_heads, xq, xds, x_chunks);
}
