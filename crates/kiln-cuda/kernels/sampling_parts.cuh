// The sampler's paths over parts of a row (sampling.cu includes this after its shared
// definitions: SampleShared, VocabSource, the constants). Top-k by parts: each part keeps its
// own k best, the last part to finish merges them. Threshold: each part counts its logits in
// bins below its maximum, the last gathers the prefix of the ranking those counts say fits one
// block.
#pragma once

// What a part returns where it drew no token: it was not the last to finish, or (the threshold
// path's last part) the prefix it gathered does not decide the cuts, so it ranks the whole row.
#define NOT_DRAWN 0xffffffffu
#define WHOLE_ROW 0xfffffffeu

// A (value, id) pair as one integer that orders as the pairs do: larger values first, then
// lower ids; 0 is below every pair.
__device__ __forceinline__ u64 best_key(float value, u32 id) {
    return ((u64)order_key(value) << 32) | (u64)(0xffffffffu - id);
}

__device__ __forceinline__ float value_of_key(u64 key) {
    const u32 ordered = (u32)(key >> 32);
    return __uint_as_float((ordered & 0x80000000u) ? (ordered & 0x7fffffffu) : ~ordered);
}

__device__ __forceinline__ u32 id_of_key(u64 key) { return 0xffffffffu - (u32)key; }

__device__ __forceinline__ u32 warp_sum_u32(u32 x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        x += __shfl_xor_sync(0xffffffffu, x, offset);
    }
    return x;
}

// The block's 1024 keys, one a thread, sorted in descending order: returns the key at the
// thread's position. A bitonic network in registers: partners in the warp by shuffles, others
// through `exchange` (2 x SAMPLE_THREADS keys: alternate stages write alternate halves, so
// one barrier a stage suffices).
__device__ u64 block_sort_descending_1024(u64 key, u64* exchange) {
    static_assert(SAMPLE_THREADS == 1024, "one key a thread");
    const u32 tid = threadIdx.x;
    u32 half = 0;
    for (u32 size = 2; size <= SAMPLE_THREADS; size <<= 1) {
        for (u32 stride = size >> 1; stride > 0; stride >>= 1) {
            u64 partner;
            if (stride >= 32) {
                u64* buffer = exchange + half * SAMPLE_THREADS;
                buffer[tid] = key;
                __syncthreads();
                partner = buffer[tid ^ stride];
                half ^= 1;
            } else {
                partner = __shfl_xor_sync(0xffffffffu, key, stride);
            }
            key = (((tid & stride) == 0) == ((tid & size) == 0)) ? max(key, partner) : min(key, partner);
        }
    }
    return key;
}

// Inclusive prefix sum over a warp's lanes.
__device__ __forceinline__ float warp_inclusive_scan(float x) {
    const u32 lane = threadIdx.x & 31;
#pragma unroll
    for (u32 offset = 1; offset < 32; offset <<= 1) {
        const float y = __shfl_up_sync(0xffffffffu, x, offset);
        if (lane >= offset) {
            x += y;
        }
    }
    return x;
}

// The first of the ranked positions 0..n whose `inclusive` running sum passes `target`
// (reaches it when not `strict`), or n when none does. Lane l holds positions 4l..4l+3.
__device__ __forceinline__ u32 first_passing(const float (&inclusive)[4], u32 n, float target, bool strict) {
    const u32 lane = threadIdx.x & 31;
    u32 mine = 4;
#pragma unroll
    for (int j = 3; j >= 0; --j) {
        if (4 * lane + j < n && (strict ? inclusive[j] > target : inclusive[j] >= target)) {
            mine = j;
        }
    }
    const u32 lanes = __ballot_sync(0xffffffffu, mine < 4);
    if (lanes == 0) {
        return n;
    }
    const int first = __ffs(lanes) - 1;
    return 4 * first + __shfl_sync(0xffffffffu, mine, first);
}

// Running sums of weights[0..4) / divisor over the lanes' positions in ranking order.
__device__ __forceinline__ void ranked_running_sums(const float (&weights)[4], float divisor, float (&inclusive)[4]) {
    float run = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        run += weights[j] / divisor;
        inclusive[j] = run;
    }
    const float before = warp_inclusive_scan(run) - run;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        inclusive[j] += before;
    }
}

// top-p, min-p and the draw over the n (at most PART_TOP_MAX) best keys in ranking order, as
// kiln_core::sampling::sample walks its sorted list. Called by one whole warp.
__device__ u32 draw_from_ranked(const u64* ranked, u32 n, const u32* rec, float temperature) {
    const u32 lane = threadIdx.x & 31;
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        v[j] = 4 * lane + j < n ? value_of_key(ranked[4 * lane + j]) : 0.0f;
    }
    const float max_value = value_of_key(ranked[0]);
    const float top_p = __uint_as_float(rec[SAMPLE_TOP_P]);
    const float min_p = __uint_as_float(rec[SAMPLE_MIN_P]);
    float weights[4];
    float inclusive[4];
    u32 keep = n;
    if (top_p < 1.0f) {
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            weights[j] = 4 * lane + j < n ? expf(v[j] - max_value) : 0.0f;
            sum += weights[j];
        }
        const float total = warp_sum(sum);
        ranked_running_sums(weights, total, inclusive);
        keep = min(n, first_passing(inclusive, n, top_p, false) + 1);
    }
    if (min_p > 0.0f) {
        // The ranking is descending: the tokens at or above the floor are a prefix of it.
        const float floor = max_value + logf(min_p);
        u32 above = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            above += 4 * lane + j < keep && v[j] >= floor;
        }
        keep = max(1u, warp_sum_u32(above));
    }
    const float inv_temperature = 1.0f / temperature;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        weights[j] = 4 * lane + j < keep ? expf((v[j] - max_value) * inv_temperature) : 0.0f;
        sum += weights[j];
    }
    const float total = warp_sum(sum);
    ranked_running_sums(weights, 1.0f, inclusive);
    const u64 seed = (u64)rec[SAMPLE_SEED_LO] | ((u64)rec[SAMPLE_SEED_HI] << 32);
    const u64 draw = (u64)rec[SAMPLE_DRAW_LO] | ((u64)rec[SAMPLE_DRAW_HI] << 32);
    const u32 chosen = min(keep - 1, first_passing(inclusive, keep, uniform_draw(seed, draw) * total, true));
    return id_of_key(ranked[chosen]);
}

// This block's part of the row (at most PART_VALUES_PER_THREAD logits a thread): its k best
// keys (best_key order; fewer when the part is shorter, zeros after them) stored at `out`.
__device__ void part_top_k(const VocabSource& vocab, SampleShared& sh, u32 begin, u32 end, u32 k, u64* out) {
    const u32 tid = threadIdx.x;
    u64 keys[PART_VALUES_PER_THREAD];
    u64 thread_top = 0;
#pragma unroll
    for (int r = 0; r < PART_VALUES_PER_THREAD; ++r) {
        const u32 i = begin + tid + r * SAMPLE_THREADS;
        keys[r] = i < end ? best_key(vocab.value(i), i) : 0;
        thread_top = max(thread_top, keys[r]);
    }
    // The k-th best of the threads' bests is a key of the part at or below its k-th best, and
    // only those k threads hold keys at or above it: at most 8k <= SAMPLE_THREADS candidates.
    thread_top = block_sort_descending_1024(thread_top, sh.sorted);
    if (tid == k - 1) {
        sh.floor = max(thread_top, 1ull);
    }
    if (tid == 0) {
        sh.n_cand = 0;
    }
    __syncthreads();
    const u64 floor = sh.floor;
#pragma unroll
    for (int r = 0; r < PART_VALUES_PER_THREAD; ++r) {
        if (keys[r] >= floor) {
            const u32 slot = atomicAdd(&sh.n_cand, 1u);
            if (slot < SAMPLE_THREADS) {
                sh.sorted[slot] = keys[r];
            }
        }
    }
    __syncthreads();
    const u32 n = sh.n_cand;
    u64 key = tid < n ? sh.sorted[tid] : 0;
    if (n > k) {
        __syncthreads();
        key = block_sort_descending_1024(key, sh.sorted);
    }
    if (tid < k) {
        out[tid] = key;
    }
}

// After each part stored its results: whether this block is the last of the row's parts to
// finish (all of them then visible to it). The last one resets the ticket for the next launch.
__device__ bool last_part_to_finish(SampleShared& sh, u32* ticket) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const bool last = atomicAdd(ticket, 1u) + 1 == gridDim.x;
        if (last) {
            *ticket = 0;
            __threadfence();
        }
        sh.found = last;
    }
    __syncthreads();
    return sh.found;
}

// Top-k sampling with the row split among the grid's blocks: each keeps its part's k best in
// `part_keys`; the last to finish merges them (grid x times k at most MERGE_CAP) and draws.
// Returns the drawn token to thread 0 of the block that drew it, else NOT_DRAWN.
__device__ u32 sample_top_k_by_parts(const VocabSource& vocab, SampleShared& sh, u32 k, u64* part_keys, u32* ticket,
                                     const u32* rec, float temperature) {
    const u32 part = (vocab.n + gridDim.x - 1) / gridDim.x;
    const u32 begin = min(blockIdx.x * part, vocab.n);
    part_top_k(vocab, sh, begin, min(begin + part, vocab.n), k, part_keys + blockIdx.x * k);
    if (!last_part_to_finish(sh, ticket)) {
        return NOT_DRAWN;
    }
    const u32 merged = gridDim.x * k;
    const u64 key = block_sort_descending_1024(threadIdx.x < merged ? __ldcg(part_keys + threadIdx.x) : 0, sh.sorted);
    __syncthreads();
    sh.sorted[threadIdx.x] = key;
    __syncthreads();
    u32 token = NOT_DRAWN;
    if (threadIdx.x < 32) {
        // Zero keys (short parts) rank last.
        const u32 lane = threadIdx.x;
        u32 n = 0;
        for (u32 i = lane; i < k; i += 32) {
            n += sh.sorted[i] != 0;
        }
        n = warp_sum_u32(n);
        token = draw_from_ranked(sh.sorted, n, rec, temperature);
    }
    return token;
}

// One part's counts for the threshold path: its logits in bins of 1/THRESHOLD_BIN_SCALE down
// from top_bin = ceil(max * scale) (bin b holds values v with top_bin - v * scale in [b, b+1)).
struct PartCounts {
    int top_bin;  // PART_EMPTY: no logit above -inf; PART_UNRANKABLE: a NaN, +inf or huge logit
    float max_value;
    float exp_sum;       // sum of exp(v - max_value) over the part
    float tempered_sum;  // sum of exp((v - max_value) / temperature), where the draw needs it
    unsigned short count[THRESHOLD_BINS];
};
static_assert(sizeof(PartCounts) == PART_COUNTS_BYTES && sizeof(PartCounts) % 8 == 0, "records tile the part keys");
static_assert(PART_VALUES_PER_THREAD * SAMPLE_THREADS <= 0xffff, "a bin's count fits 16 bits");
#define PART_EMPTY (-0x7fffffff - 1)
#define PART_UNRANKABLE 0x7fffffff
// Beyond this magnitude top_bin leaves the range where floats hold whole bin numbers exactly.
#define THRESHOLD_MAX_LOGIT 1048576.0f

// This block's part of the row (at most PART_VALUES_PER_THREAD logits a thread), counted into
// `out`; its tempered sum only where `inv_temperature` is not 0.
__device__ void part_counts(const VocabSource& vocab, SampleShared& sh, u32 begin, u32 end, float inv_temperature,
                            PartCounts* out) {
    const u32 tid = threadIdx.x;
    float values[PART_VALUES_PER_THREAD];
    float best = NEG_INF;
    u32 best_id = 0xffffffffu;
    bool unrankable = false;
#pragma unroll
    for (int r = 0; r < PART_VALUES_PER_THREAD; ++r) {
        const u32 i = begin + tid + r * SAMPLE_THREADS;
        values[r] = i < end ? vocab.value(i) : NEG_INF;
        unrankable |= !(values[r] < POS_INF) && values[r] != NEG_INF;  // NaN or +inf
        if (values[r] > best) {
            best = values[r];
            best_id = i;
        }
    }
    unrankable = __syncthreads_or(unrankable);
    block_best(sh, best, best_id);
    int top_bin = PART_EMPTY;
    if (unrankable || (best != NEG_INF && !(fabsf(best) < THRESHOLD_MAX_LOGIT))) {
        top_bin = PART_UNRANKABLE;
    } else if (best != NEG_INF) {
        top_bin = (int)ceilf(best * THRESHOLD_BIN_SCALE);
    }
    float exp_sum = 0.0f;
    float tempered_sum = 0.0f;
    if (tid < THRESHOLD_BINS) {
        sh.bins.count[tid] = 0;
    }
    __syncthreads();
    if (top_bin != PART_EMPTY && top_bin != PART_UNRANKABLE) {
#pragma unroll
        for (int r = 0; r < PART_VALUES_PER_THREAD; ++r) {
            exp_sum += expf(values[r] - best);
            if (inv_temperature != 0.0f) {
                tempered_sum += expf((values[r] - best) * inv_temperature);
            }
            const float bin = floorf((float)top_bin - values[r] * THRESHOLD_BIN_SCALE);
            if (bin < (float)THRESHOLD_BINS) {
                atomicAdd(&sh.bins.count[(int)bin], 1u);
            }
        }
    }
    exp_sum = block_sum<SAMPLE_THREADS>(exp_sum);
    if (inv_temperature != 0.0f) {
        tempered_sum = block_sum<SAMPLE_THREADS>(tempered_sum);
    }
    if (tid < THRESHOLD_BINS) {
        out->count[tid] = (unsigned short)sh.bins.count[tid];
    }
    if (tid == 0) {
        out->top_bin = top_bin;
        out->max_value = best;
        out->exp_sum = exp_sum;
        out->tempered_sum = tempered_sum;
    }
}

// The first thread (position) for which `pass` holds, or SAMPLE_THREADS when none does.
__device__ u32 block_first(SampleShared& sh, bool pass) {
    if (threadIdx.x == 0) {
        sh.position = SAMPLE_THREADS;
    }
    __syncthreads();
    if (pass) {
        atomicMin(&sh.position, threadIdx.x);
    }
    __syncthreads();
    const u32 first = sh.position;
    __syncthreads();
    return first;
}

// Value `key` held by thread `from`, for every thread.
__device__ u64 block_broadcast(SampleShared& sh, u64 key, u32 from) {
    if (threadIdx.x == from) {
        sh.floor = key;
    }
    __syncthreads();
    key = sh.floor;
    __syncthreads();
    return key;
}

// Into sh.sorted, the keys of every logit at or above `edge` (a prefix of the ranking), read
// from the parts whose maximum reaches it; returns how many there are (only the first
// CANDIDATE_CAP stored).
__device__ u32 gather_at_or_above(const VocabSource& vocab, SampleShared& sh, float edge) {
    const u32 tid = threadIdx.x;
    const u32 lane = tid & 31;
    const u32 part = (vocab.n + gridDim.x - 1) / gridDim.x;
    if (tid == 0) {
        sh.n_cand = 0;
    }
    __syncthreads();
    for (u32 p = 0; p < gridDim.x; ++p) {
        if (sh.part_top_bin[p] == PART_EMPTY || sh.part_max[p] < edge) {
            continue;
        }
        const u32 begin = min(p * part, vocab.n);
        const u32 end = min(begin + part, vocab.n);
        float values[PART_VALUES_PER_THREAD];
#pragma unroll
        for (int r = 0; r < PART_VALUES_PER_THREAD; ++r) {
            const u32 i = begin + tid + r * SAMPLE_THREADS;
            values[r] = i < end ? vocab.value(i) : NEG_INF;
        }
#pragma unroll
        for (int r = 0; r < PART_VALUES_PER_THREAD; ++r) {
            const bool take = values[r] >= edge;
            const u32 takers = __ballot_sync(0xffffffffu, take);
            if (takers == 0) {
                continue;
            }
            u32 base = 0;
            if (lane == 0) {
                base = atomicAdd(&sh.n_cand, (u32)__popc(takers));
            }
            base = __shfl_sync(0xffffffffu, base, 0);
            const u32 slot = base + __popc(takers & ((1u << lane) - 1u));
            if (take && slot < CANDIDATE_CAP) {
                sh.sorted[slot] = best_key(values[r], begin + tid + r * SAMPLE_THREADS);
            }
        }
    }
    __syncthreads();
    return sh.n_cand;
}

// Sampling where the cuts end past what top-k by parts merges (top-k of any k, top-p, min-p)
// or where there is no cut (temperature alone): each part counts its logits in bins below its
// maximum; the last to finish adds the counts up, gathers the longest run of bins from the top
// that fits CANDIDATE_CAP (a prefix of the ranking, whatever rounding put in which bin: the
// gather compares values), sorts it, and walks it as kiln_core::sampling::sample walks its
// sorted list wherever the prefix decides every cut. Without cuts the draw's target comes from
// the parts' tempered sums, and the prefix decides it where the target falls within its weight.
// Returns the drawn token to every thread of the block that drew it; NOT_DRAWN in the other
// parts; WHOLE_ROW where the last part must rank the whole row instead.
__device__ u32 sample_by_threshold(const VocabSource& vocab, SampleShared& sh, u32 k, PartCounts* parts, u32* ticket,
                                   const u32* rec, float temperature) {
    const u32 tid = threadIdx.x;
    const u32 n_parts = gridDim.x;
    const u32 part = (vocab.n + n_parts - 1) / n_parts;
    const u32 begin = min(blockIdx.x * part, vocab.n);
    const float top_p = __uint_as_float(rec[SAMPLE_TOP_P]);
    const float min_p = __uint_as_float(rec[SAMPLE_MIN_P]);
    // NaN settings count as off, as on the CPU.
    const bool temperature_alone = k >= vocab.n && !(top_p < 1.0f) && !(min_p > 0.0f);
    const float inv_temperature = 1.0f / temperature;
    part_counts(vocab, sh, begin, min(begin + part, vocab.n), temperature_alone ? inv_temperature : 0.0f,
                parts + blockIdx.x);
    if (!last_part_to_finish(sh, ticket)) {
        return NOT_DRAWN;
    }
    if (tid < n_parts) {
        sh.part_top_bin[tid] = __ldcg(&parts[tid].top_bin);
        sh.part_max[tid] = __ldcg(&parts[tid].max_value);
        sh.part_exp_sum[tid] = __ldcg(&parts[tid].exp_sum);
        sh.part_tempered_sum[tid] = __ldcg(&parts[tid].tempered_sum);
    }
    __syncthreads();
    int top_bin = PART_EMPTY;
    float max_value = NEG_INF;
    for (u32 p = 0; p < n_parts; ++p) {
        top_bin = max(top_bin, sh.part_top_bin[p]);
        max_value = fmaxf(max_value, sh.part_max[p]);
    }
    if (top_bin == PART_EMPTY || top_bin == PART_UNRANKABLE) {
        return WHOLE_ROW;
    }
    // The row's sums of exp(v - max), for top-p without a top-k, and of the tempered weights,
    // for temperature alone (in part order: every thread and every run gets the same).
    float row_total = 0.0f;
    float row_tempered_total = 0.0f;
    for (u32 p = 0; p < n_parts; ++p) {
        if (sh.part_top_bin[p] != PART_EMPTY) {
            row_total += sh.part_exp_sum[p] * expf(sh.part_max[p] - max_value);
            row_tempered_total += sh.part_tempered_sum[p] * expf((sh.part_max[p] - max_value) * inv_temperature);
        }
    }
    u32 count = 0;
    if (tid < THRESHOLD_BINS) {
        for (u32 p = 0; p < n_parts; ++p) {
            if (sh.part_top_bin[p] == PART_EMPTY) {
                continue;
            }
            const int source = (int)tid - (top_bin - sh.part_top_bin[p]);
            if (source >= 0) {
                count += __ldcg(&parts[p].count[source]);
            }
        }
    }
    const float from_top = block_inclusive_scan((float)count, sh.warp_totals);
    const u32 bins = block_first(sh, tid >= THRESHOLD_BINS || from_top > (float)CANDIDATE_CAP);
    if (bins == 0) {
        return WHOLE_ROW;
    }
    const float edge = (float)(top_bin - (int)bins) * (1.0f / THRESHOLD_BIN_SCALE);
    const u32 n_cand = gather_at_or_above(vocab, sh, edge);
    if (n_cand > CANDIDATE_CAP) {
        return WHOLE_ROW;
    }
    u64 key = tid < n_cand ? sh.sorted[tid] : 0;
    __syncthreads();
    key = block_sort_descending_1024(key, sh.sorted);
    const float value = value_of_key(key);
    const bool ranked = tid < n_cand;

    // Each cut is a length of the ranking; UNDECIDED where it ends past the gathered prefix.
    const u32 UNDECIDED = 0xffffffffu;
    u32 keep = k <= n_cand ? k : UNDECIDED;
    if (top_p < 1.0f) {
        // The CPU's total runs over its top-k list: the whole row, or the first k here.
        const u32 within = min(k, n_cand);
        const float weight = tid < within ? expf(value - max_value) : 0.0f;
        float total = row_total;
        if (k < vocab.n) {
            if (k > n_cand) {
                return WHOLE_ROW;
            }
            total = block_sum<SAMPLE_THREADS>(weight);
        }
        const float reached = block_inclusive_scan(weight / total, sh.warp_totals);
        const u32 first = block_first(sh, tid < within && reached >= top_p);
        if (first < within) {
            keep = first + 1;
        } else if (keep == UNDECIDED) {
            return WHOLE_ROW;
        }
    }
    if (min_p > 0.0f) {
        const float floor = max_value + logf(min_p);
        const u32 limit = keep == UNDECIDED ? n_cand : keep;
        const u32 below = block_first(sh, tid < limit && value < floor);
        if (below < limit) {
            keep = max(below, 1u);
        }
    }
    // Temperature alone keeps the whole row, of which only the prefix is ranked here.
    const bool prefix_of_row = keep == UNDECIDED && temperature_alone;
    if (keep == UNDECIDED && !temperature_alone) {
        return WHOLE_ROW;
    }
    if (prefix_of_row) {
        keep = n_cand;
    }
    const float weight = ranked && tid < keep ? expf((value - max_value) * inv_temperature) : 0.0f;
    const float reached = block_inclusive_scan(weight, sh.warp_totals);
    const float total =
        prefix_of_row ? row_tempered_total : __uint_as_float((u32)block_broadcast(sh, __float_as_uint(reached), keep - 1));
    const u64 seed = (u64)rec[SAMPLE_SEED_LO] | ((u64)rec[SAMPLE_SEED_HI] << 32);
    const u64 draw = (u64)rec[SAMPLE_DRAW_LO] | ((u64)rec[SAMPLE_DRAW_HI] << 32);
    const float target = uniform_draw(seed, draw) * total;
    const u32 first = block_first(sh, tid < keep && reached > target);
    if (prefix_of_row && first >= keep) {
        return WHOLE_ROW;
    }
    return id_of_key(block_broadcast(sh, key, min(keep - 1, first)));
}
