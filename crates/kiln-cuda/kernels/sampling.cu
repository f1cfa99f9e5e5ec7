// Token sampling on the GPU, reproducing kiln_core::sampling: repetition, presence and
// frequency penalties, top-k, top-p, min-p, temperature, then one draw of the same
// counter-based uniform number.
//
// One block of SAMPLE_THREADS threads. Tokens are ranked by a 64-bit composite key (the
// logit's order-preserving bits, then the complement of the id), so "descending logit, ties
// to the lower id" is plain descending key order and every cut of the CPU's sorted candidate
// list is a key threshold. Each cut is found by a radix descent that sums weights (counts for
// top-k, probabilities for top-p, tempered weights for the draw) per digit, so the vocabulary
// is never sorted. After top-k, at most CANDIDATE_CAP survivors are moved to shared memory.
// A small top-k (the defaults' 40) is found by the blocks sharing the row instead: each sorts
// its part's few candidates, the last merges the parts' k best and walks them as the CPU does.
// Other cuts and temperature alone go through counts: the parts bin their logits, the last
// gathers the prefix of the ranking that fits one block and walks it where it decides the cuts
// or holds the draw (sampling_parts.cuh).
// kiln-waits-for-inputs
#include "common.cuh"
#include "plan.cuh"

#define SAMPLE_THREADS 1024
#define RADIX_BITS 10
#define RADIX_BINS (1 << RADIX_BITS)
#define CANDIDATE_CAP SAMPLE_THREADS
#define NEG_INF __int_as_float(0xff800000)
#define POS_INF __int_as_float(0x7f800000)
#define MAX_FINITE __int_as_float(0x7f7fffff)
// A bin's mass in fixed point, units of 2^-40: integer sums are the same in any order, so a
// seeded draw does not depend on which warp reached a bin first. Weights are at most 1 and a
// vocabulary under 2^24 tokens sums below 2^64.
#define MASS_ONE 1099511627776.0f
// Top-k by parts: each part of a row keeps its own k best, the last part to finish merges
// them. Up to PART_TOP_MAX a part, MERGE_CAP a row (one a thread of the merging block;
// backend.rs: SAMPLE_MERGE_CAP), parts of at most PART_VALUES_PER_THREAD logits a thread.
#define PART_TOP_MAX 128
#define MERGE_CAP SAMPLE_THREADS
#define PART_VALUES_PER_THREAD 8
// The threshold path (sampling_parts.cuh): each part counts its logits in THRESHOLD_BINS bins
// of 1/THRESHOLD_BIN_SCALE below its maximum (12 nats), in a PartCounts record; the records of
// at most THRESHOLD_MAX_PARTS parts fill a sample's MERGE_CAP keys.
#define THRESHOLD_BINS 96
#define THRESHOLD_BIN_SCALE 8.0f
#define PART_COUNTS_BYTES (16 + 2 * THRESHOLD_BINS)
#define THRESHOLD_MAX_PARTS (MERGE_CAP * 8 / PART_COUNTS_BYTES)

static_assert(RADIX_BINS == SAMPLE_THREADS, "the bin scan gives each thread one bin");

__device__ __forceinline__ u64 splitmix64(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Bit-identical to kiln_core::sampling::uniform.
__device__ __forceinline__ float uniform_draw(u64 seed, u64 draw) {
    const u64 bits = splitmix64(seed ^ splitmix64(draw));
    return (float)(bits >> 40) * (1.0f / 16777216.0f);
}

// Monotone map of floats to unsigned integers (the order of f32::total_cmp).
__device__ __forceinline__ u32 order_key(float value) {
    const u32 bits = __float_as_uint(value);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

struct SampleShared {
    union {
        struct {
            u64 mass[RADIX_BINS];
            u32 count[RADIX_BINS];
        } bins;
        // The keys the by-parts path sorts, and its sort's exchange (it uses no radix bins).
        u64 sorted[2 * SAMPLE_THREADS];
    };
    float warp_totals[SAMPLE_THREADS / 32];
    float cand_value[CANDIDATE_CAP];
    u32 cand_id[CANDIDATE_CAP];
    u32 n_cand;
    u32 found;
    u64 floor;
    u32 last_nonempty;
    float found_above;
    // Each thread's largest value: the k-th largest of these bounds the k-th largest logit.
    float thread_max[SAMPLE_THREADS];
    float best_value[SAMPLE_THREADS / 32];
    u32 best_id[SAMPLE_THREADS / 32];
    // The threshold path's merge: each part's top bin, maximum and sum of exp(value - maximum).
    int part_top_bin[THRESHOLD_MAX_PARTS];
    float part_max[THRESHOLD_MAX_PARTS];
    float part_exp_sum[THRESHOLD_MAX_PARTS];
    float part_tempered_sum[THRESHOLD_MAX_PARTS];
    u32 position;
};

// The logits with the penalties applied on the fly (bit i of `penalized` marks token i), in
// kiln_core::sampling::apply_repeat_penalty's order and rounding (no fused multiply-add).
struct VocabSource {
    const float* logits;
    const u32* penalized;
    u32 n;
    float penalty;
    bool penalize;
    float presence;
    float frequency;
    // The penalty window: the last `window` tokens of the history.
    const u32* recent;
    u32 window;
    __device__ u32 size() const { return n; }
    __device__ u32 id(u32 i) const { return i; }
    __device__ float value(u32 i) const { return adjusted(i, logits[i]); }
    // Logit `v` of token `i` with the repetition penalties applied.
    __device__ float adjusted(u32 i, float v) const {
        if (penalize && ((penalized[i >> 5] >> (i & 31)) & 1u)) {
            v = v > 0.0f ? fminf(v / penalty, MAX_FINITE) : v * penalty;
            // Only penalized tokens pay for counting, and only with a frequency penalty.
            u32 count = 1;
            if (frequency != 0.0f) {
                count = 0;
                for (u32 j = 0; j < window; ++j) {
                    count += recent[j] == i;
                }
            }
            v = __fsub_rn(v, __fadd_rn(__fmul_rn((float)count, frequency), presence));
        }
        return v;
    }
};

// Values in shared memory with their token ids (or, when `ids` is null, their positions).
struct CandidateSource {
    const float* values;
    const u32* ids;
    u32 n;
    __device__ u32 size() const { return n; }
    __device__ u32 id(u32 i) const { return ids != nullptr ? ids[i] : i; }
    __device__ float value(u32 i) const { return values[i]; }
};

enum WeightKind { WEIGHT_COUNT, WEIGHT_PROB, WEIGHT_TEMPERED };

struct Ranking {
    u32 id_bits;
    u64 id_mask;
    float max_value;
    float inv_temperature;
    __device__ u64 composite(float value, u32 id) const {
        return ((u64)order_key(value) << id_bits) | (id_mask - id);
    }
    __device__ u32 id_of(u64 composite) const { return (u32)(id_mask - (composite & id_mask)); }
    // The CPU's expressions: exp(l - max) for top-p, exp((l - max) / T) for the draw.
    __device__ float weight(float value, WeightKind kind) const {
        switch (kind) {
            case WEIGHT_COUNT: return 1.0f;
            case WEIGHT_PROB: return expf(value - max_value);
            default: return expf((value - max_value) * inv_temperature);
        }
    }
};

// Inclusive prefix sum over the block's threads in thread order.
__device__ float block_inclusive_scan(float x, float* warp_totals) {
    const u32 lane = threadIdx.x & 31;
    const u32 warp = threadIdx.x >> 5;
#pragma unroll
    for (u32 offset = 1; offset < 32; offset <<= 1) {
        const float y = __shfl_up_sync(0xffffffffu, x, offset);
        if (lane >= offset) {
            x += y;
        }
    }
    if (lane == 31) {
        warp_totals[warp] = x;
    }
    __syncthreads();
    if (warp == 0) {
        float total = warp_totals[lane];
#pragma unroll
        for (u32 offset = 1; offset < 32; offset <<= 1) {
            const float y = __shfl_up_sync(0xffffffffu, total, offset);
            if (lane >= offset) {
                total += y;
            }
        }
        warp_totals[lane] = total;
    }
    __syncthreads();
    if (warp > 0) {
        x += warp_totals[warp - 1];
    }
    __syncthreads();
    return x;
}

// *bin += mass, exactly. A 64-bit add to shared memory compiles to a compare-and-swap loop,
// which spins where many warps hit one bin (flat rows); two native 32-bit adds, the low word's
// carry passed on, give the same sum.
__device__ __forceinline__ void add_mass(u64* bin, u64 mass) {
    u32* words = reinterpret_cast<u32*>(bin);
    const u32 low = (u32)mass;
    const u32 before = atomicAdd(words, low);
    const u32 high = (u32)(mass >> 32) + (before + low < before ? 1u : 0u);
    if (high != 0) {
        atomicAdd(words + 1, high);
    }
}

// Sum of the weights of the tokens ranked at or above `cut`.
template <class Source>
__device__ float sum_weights(const Source& src, const Ranking& rank, u64 cut, WeightKind kind) {
    float sum = 0.0f;
    for (u32 i = threadIdx.x; i < src.size(); i += SAMPLE_THREADS) {
        const float v = src.value(i);
        if (rank.composite(v, src.id(i)) >= cut) {
            sum += rank.weight(v, kind);
        }
    }
    return block_sum<SAMPLE_THREADS>(sum);
}

// Walking the tokens ranked at or above `cut` in ranking order, the first at which the running
// weight reaches `target` (exceeds it when `strict`); the last such token when rounding leaves
// the target unreached. Returns its composite key.
template <class Source>
__device__ u64 select_by_weight(const Source& src, SampleShared& sh, const Ranking& rank, u64 cut, WeightKind kind,
                                float target, bool strict) {
    const u32 tid = threadIdx.x;
    u64 prefix = 0;
    float above = 0.0f;
    for (int hi = 32 + (int)rank.id_bits; hi > 0;) {
        const int lo = hi > RADIX_BITS ? hi - RADIX_BITS : 0;
        const u32 digit_mask = (1u << (hi - lo)) - 1u;
        sh.bins.mass[tid] = 0;
        sh.bins.count[tid] = 0;
        if (tid == 0) {
            sh.found = RADIX_BINS;
            sh.last_nonempty = 0;
        }
        __syncthreads();
        // Logits crowd into few digits, so lanes of a warp sharing one are summed first and
        // only one of them updates the bins (the loop bounds are uniform for the warp ops).
        const u32 lane = tid & 31;
        for (u32 first = 0; first < src.size(); first += SAMPLE_THREADS) {
            const u32 i = first + tid;
            bool hit = false;
            u32 digit = 0;
            float weight = 0.0f;
            if (i < src.size()) {
                const float v = src.value(i);
                const u64 key = rank.composite(v, src.id(i));
                if (key >= cut && (key >> hi) == (prefix >> hi)) {
                    hit = true;
                    digit = (u32)(key >> lo) & digit_mask;
                    weight = rank.weight(v, kind);
                }
            }
            if (__ballot_sync(0xffffffffu, hit) == 0) {
                continue;
            }
            const u32 peers = __match_any_sync(0xffffffffu, hit ? digit : 0xffffffffu);
            const bool leader = hit && lane == (u32)(__ffs(peers) - 1);
            u64 peer_mass = kind == WEIGHT_COUNT ? (u64)__popc(peers) * (u64)MASS_ONE : (u64)(weight * MASS_ONE);
            // A lane's mass is at most MASS_ONE = 2^40, so the 20-bit halves of a group's masses
            // sum within 32 bits: two whole-warp reductions a group of several lanes.
            const u32 shared_digits = kind == WEIGHT_COUNT ? 0u : __ballot_sync(0xffffffffu, leader && __popc(peers) > 1);
            for (u32 pending = shared_digits; pending != 0; pending &= pending - 1) {
                const u32 group = __shfl_sync(0xffffffffu, peers, __ffs(pending) - 1);
                const bool in = hit && peers == group;
                const u32 low = __reduce_add_sync(0xffffffffu, in ? (u32)(peer_mass & 0xfffffu) : 0u);
                const u32 high = __reduce_add_sync(0xffffffffu, in ? (u32)(peer_mass >> 20) : 0u);
                if (in && leader) {
                    peer_mass = ((u64)high << 20) + low;
                }
            }
            if (leader) {
                atomicAdd(&sh.bins.count[digit], (u32)__popc(peers));
                add_mass(&sh.bins.mass[digit], peer_mass);
            }
        }
        __syncthreads();
        // Thread t reads bin RADIX_BINS-1-t, so the scan runs down the ranking.
        const u32 bin = RADIX_BINS - 1 - tid;
        const float mass = (float)sh.bins.mass[bin] * (1.0f / MASS_ONE);
        const bool nonempty = sh.bins.count[bin] > 0;
        const float inclusive = block_inclusive_scan(mass, sh.warp_totals);
        const float reached = above + inclusive;
        if (nonempty) {
            if (strict ? reached > target : reached >= target) {
                atomicMin(&sh.found, tid);
            }
            atomicMax(&sh.last_nonempty, tid);
        }
        __syncthreads();
        const u32 chosen = sh.found < RADIX_BINS ? sh.found : sh.last_nonempty;
        if (tid == chosen) {
            sh.found_above = above + (inclusive - mass);
        }
        __syncthreads();
        above = sh.found_above;
        prefix |= (u64)(RADIX_BINS - 1 - chosen) << lo;
        hi = lo;
        __syncthreads();
    }
    return prefix;
}

// top-p, min-p and the draw over the tokens ranked at or above `cut` (the top-k set).
template <class Source>
__device__ u32 draw_token(const Source& src, SampleShared& sh, const Ranking& rank, u64 cut, u64 top, const u32* rec) {
    const float top_p = __uint_as_float(rec[SAMPLE_TOP_P]);
    const float min_p = __uint_as_float(rec[SAMPLE_MIN_P]);
    if (top_p < 1.0f) {
        const float total = sum_weights(src, rank, cut, WEIGHT_PROB);
        const u64 nucleus_end = select_by_weight(src, sh, rank, cut, WEIGHT_PROB, top_p * total, false);
        cut = max(cut, nucleus_end);
    }
    if (min_p > 0.0f) {
        // Tokens at or above the floor, but always the top one.
        const u64 floor_key = (u64)order_key(rank.max_value + logf(min_p)) << rank.id_bits;
        cut = max(cut, min(floor_key, top));
    }
    const float total = sum_weights(src, rank, cut, WEIGHT_TEMPERED);
    const u64 seed = (u64)rec[SAMPLE_SEED_LO] | ((u64)rec[SAMPLE_SEED_HI] << 32);
    const u64 draw = (u64)rec[SAMPLE_DRAW_LO] | ((u64)rec[SAMPLE_DRAW_HI] << 32);
    const float target = uniform_draw(seed, draw) * total;
    return rank.id_of(select_by_weight(src, sh, rank, cut, WEIGHT_TEMPERED, target, true));
}

// Moves the tokens `keep(value, id)` accepts into shared memory and returns how many there
// are; past CANDIDATE_CAP only the count grows.
template <class Keep>
__device__ u32 gather_candidates(const VocabSource& vocab, SampleShared& sh, Keep keep) {
    if (threadIdx.x == 0) {
        sh.n_cand = 0;
    }
    __syncthreads();
    for (u32 i = threadIdx.x; i < vocab.size(); i += SAMPLE_THREADS) {
        const float v = vocab.value(i);
        if (keep(v, i)) {
            const u32 slot = atomicAdd(&sh.n_cand, 1u);
            if (slot < CANDIDATE_CAP) {
                sh.cand_value[slot] = v;
                sh.cand_id[slot] = i;
            }
        }
    }
    __syncthreads();
    return sh.n_cand;
}

// Each thread's best (largest value, lowest id among equals) of positions begin..end of the
// row, four logits a load where the row allows (begin a multiple of 4), several loads in flight.
__device__ __forceinline__ void thread_best(const VocabSource& vocab, u32 begin, u32 end, float& best, u32& best_id) {
    best = NEG_INF;
    best_id = 0xffffffffu;
    const auto consider = [&](float v, u32 i) {
        if (v > best || (v == best && i < best_id)) {
            best = v;
            best_id = i;
        }
    };
    if (vocab.n % 4 == 0 && begin % 4 == 0 && reinterpret_cast<u64>(vocab.logits) % 16 == 0) {
        const float4* quads = reinterpret_cast<const float4*>(vocab.logits);
#pragma unroll 4
        for (u32 j = begin / 4 + threadIdx.x; j < end / 4; j += SAMPLE_THREADS) {
            const float4 x = quads[j];
            consider(vocab.adjusted(4 * j, x.x), 4 * j);
            consider(vocab.adjusted(4 * j + 1, x.y), 4 * j + 1);
            consider(vocab.adjusted(4 * j + 2, x.z), 4 * j + 2);
            consider(vocab.adjusted(4 * j + 3, x.w), 4 * j + 3);
        }
    } else {
        for (u32 i = begin + threadIdx.x; i < end; i += SAMPLE_THREADS) {
            consider(vocab.value(i), i);
        }
    }
}

// The block's best of its threads' (every thread gets it).
__device__ __forceinline__ void block_best(SampleShared& sh, float& best, u32& best_id) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, best, offset);
        const u32 other_id = __shfl_xor_sync(0xffffffffu, best_id, offset);
        if (other > best || (other == best && other_id < best_id)) {
            best = other;
            best_id = other_id;
        }
    }
    if ((threadIdx.x & 31) == 0) {
        sh.best_value[threadIdx.x >> 5] = best;
        sh.best_id[threadIdx.x >> 5] = best_id;
    }
    __syncthreads();
    best = sh.best_value[0];
    best_id = sh.best_id[0];
    for (u32 w = 1; w < SAMPLE_THREADS / 32; ++w) {
        if (sh.best_value[w] > best || (sh.best_value[w] == best && sh.best_id[w] < best_id)) {
            best = sh.best_value[w];
            best_id = sh.best_id[w];
        }
    }
}

#include "sampling_parts.cuh"

// Samples one token per sample of the step (plan.cuh): the blocks of column y draw sample y
// from its row of logits ([rows][n_vocab]) with its settings and store the token at
// STEP_SAMPLED_AT + y. With several blocks a sample (grid x), each finds the best of its part
// of the row and folds it into best_keys[y]; the last to finish (tickets[y]) answers a greedy
// sample from it, or ranks the whole row alone, and resets both for the next launch. Top-k
// samples of k <= PART_TOP_MAX rank in parts instead (sample_top_k_by_parts, with
// part_keys: MERGE_CAP keys a sample), other cuts and temperature alone by counts in parts
// (sample_by_threshold, its PartCounts records in the same keys), the last part ranking the
// whole row only where the prefix it gathers does not decide them or hold the draw.
// Launch: SAMPLE_THREADS threads a block, ceil(n_vocab / 32) * 4 bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS, 1)
    sample_tokens_f32(const float* all_logits, u32* step, u32 n_vocab, u64* best_keys, u32* tickets, u64* part_keys) {
    wait_for_inputs();
    __shared__ SampleShared sh;
    __shared__ u64 last_key_s;  // the sample's best, in the block that finishes it; else 0
    extern __shared__ u32 penalized[];
    const u32 tid = threadIdx.x;
    const u32 sample = blockIdx.y;
    const u32* rec = step_sample(step, sample);
    u32* sampled = step + step[STEP_SAMPLED_AT] + sample;
    const float* logits = all_logits + (u64)rec[SAMPLE_LOGIT_ROW] * n_vocab;
    const float penalty = __uint_as_float(rec[SAMPLE_REPEAT_PENALTY]);
    const u32 last_n = rec[SAMPLE_REPEAT_LAST_N];
    const float presence = __uint_as_float(rec[SAMPLE_PRESENCE_PENALTY]);
    const float frequency = __uint_as_float(rec[SAMPLE_FREQUENCY_PENALTY]);
    const bool penalize = last_n != 0 && (penalty != 1.0f || presence != 0.0f || frequency != 0.0f);
    const u32 n_history = rec[SAMPLE_N_HISTORY];
    const u32* history = step + step[STEP_HISTORY_AT] + rec[SAMPLE_HISTORY_AT];
    const u32 window = min(last_n, n_history);
    if (penalize) {
        for (u32 w = tid; w < (n_vocab + 31) / 32; w += SAMPLE_THREADS) {
            penalized[w] = 0;
        }
        __syncthreads();
        // Once per distinct token of the window: a bit set twice is still one bit.
        for (u32 i = tid; i < window; i += SAMPLE_THREADS) {
            const u32 token = history[n_history - window + i];
            if (token < n_vocab) {
                atomicOr(&penalized[token >> 5], 1u << (token & 31));
            }
        }
        __syncthreads();
    }
    const VocabSource vocab{logits, penalized, n_vocab, penalty, penalize, presence, frequency, history + (n_history - window), window};
    const float temperature = __uint_as_float(rec[SAMPLE_TEMPERATURE]);
    const u32 top_k = rec[SAMPLE_TOP_K];
    const u32 k = (top_k == 0 || top_k > n_vocab) ? n_vocab : top_k;
    const u32 part_size = (n_vocab + gridDim.x - 1) / gridDim.x;
    const bool in_parts = temperature > 0.0f && part_size <= SAMPLE_THREADS * PART_VALUES_PER_THREAD;
    u64* const sample_part_keys = part_keys + (u64)sample * MERGE_CAP;
    if (in_parts && k <= PART_TOP_MAX && gridDim.x * k <= MERGE_CAP) {
        const u32 token = sample_top_k_by_parts(vocab, sh, k, sample_part_keys, tickets + sample, rec, temperature);
        if (tid == 0 && token != NOT_DRAWN) {
            *sampled = token;
        }
        return;
    }
    // The last part alone ranks the whole row where the threshold path could not decide.
    bool alone = gridDim.x == 1;
    if (in_parts && gridDim.x <= THRESHOLD_MAX_PARTS) {
        const u32 token = sample_by_threshold(vocab, sh, k, reinterpret_cast<PartCounts*>(sample_part_keys), tickets + sample, rec, temperature);
        if (token == NOT_DRAWN) {
            return;
        }
        if (token != WHOLE_ROW) {
            if (tid == 0) {
                *sampled = token;
            }
            return;
        }
        alone = true;
        __syncthreads();
    }

    float best;
    u32 best_id;
    if (alone) {
        thread_best(vocab, 0, n_vocab, best, best_id);
    } else {
        const u32 part = ((n_vocab + gridDim.x - 1) / gridDim.x + 3) / 4 * 4;
        const u32 begin = min(blockIdx.x * part, n_vocab);
        thread_best(vocab, begin, min(begin + part, n_vocab), best, best_id);
        block_best(sh, best, best_id);
        if (tid == 0) {
            unsigned long long* key = reinterpret_cast<unsigned long long*>(best_keys + sample);
            atomicMax(key, (unsigned long long)best_key(best, best_id));
            __threadfence();
            last_key_s = 0;
            if (atomicAdd(tickets + sample, 1u) + 1 == gridDim.x) {
                __threadfence();
                last_key_s = atomicExch(key, 0ull);
                tickets[sample] = 0;
            }
        }
        __syncthreads();
        const u64 key = last_key_s;
        if (key == 0) {
            return;
        }
        if (temperature <= 0.0f) {
            if (tid == 0) {
                *sampled = 0xffffffffu - (u32)key;
            }
            return;
        }
        // The ranking below needs every thread's maximum over the whole row.
        __syncthreads();
        thread_best(vocab, 0, n_vocab, best, best_id);
    }
    sh.thread_max[tid] = best;
    block_best(sh, best, best_id);

    if (temperature <= 0.0f) {
        if (tid == 0) {
            *sampled = best_id;
        }
        return;
    }
    Ranking rank;
    rank.id_bits = n_vocab > 1 ? 32 - __clz(n_vocab - 1) : 1;
    rank.id_mask = (1ull << rank.id_bits) - 1;
    rank.max_value = best;
    rank.inv_temperature = 1.0f / temperature;
    const u64 top = rank.composite(best, best_id);
    if (k <= CANDIDATE_CAP) {
        // The k largest thread maxima are k distinct logits, so the k-th largest of them is
        // at most the k-th largest logit: everything at or above it holds the top k, usually
        // few more. Gather those into shared memory; rank there.
        Ranking by_thread = rank;
        by_thread.id_bits = RADIX_BITS;
        by_thread.id_mask = RADIX_BINS - 1;
        const CandidateSource maxima{sh.thread_max, nullptr, SAMPLE_THREADS};
        const u64 kth = select_by_weight(maxima, sh, by_thread, 0, WEIGHT_COUNT, (float)k, false);
        const float floor = sh.thread_max[by_thread.id_of(kth)];
        const auto at_or_above_floor = [floor](float v, u32) { return v >= floor; };
        if (gather_candidates(vocab, sh, at_or_above_floor) <= CANDIDATE_CAP) {
            const CandidateSource candidates{sh.cand_value, sh.cand_id, sh.n_cand};
            const u64 cut = k < sh.n_cand ? select_by_weight(candidates, sh, rank, 0, WEIGHT_COUNT, (float)k, false) : 0;
            const u32 token = draw_token(candidates, sh, rank, cut, top, rec);
            if (tid == 0) {
                *sampled = token;
            }
            return;
        }
        __syncthreads();
    }
    // Too many candidates: rank the whole vocabulary in global memory.
    const u64 cut = k < n_vocab ? select_by_weight(vocab, sh, rank, 0, WEIGHT_COUNT, (float)k, false) : 0;
    u32 token;
    if (k <= CANDIDATE_CAP) {
        gather_candidates(vocab, sh, [&rank, cut](float v, u32 i) { return rank.composite(v, i) >= cut; });
        const CandidateSource candidates{sh.cand_value, sh.cand_id, sh.n_cand};
        token = draw_token(candidates, sh, rank, cut, top, rec);
    } else {
        token = draw_token(vocab, sh, rank, cut, top, rec);
    }
    if (tid == 0) {
        *sampled = token;
    }
}

// out[i] = uniform(seed, first_draw + i): lets tests pin the generator to the CPU's bit for bit.
extern "C" __global__ void uniform_draws_f32(float* out, u64 seed, u64 first_draw, u32 n) {
    wait_for_inputs();
    for (u64 i = global_thread_index(); i < n; i += global_thread_count()) {
        out[i] = uniform_draw(seed, first_draw + i);
    }
}
