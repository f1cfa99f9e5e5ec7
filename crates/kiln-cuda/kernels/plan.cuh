// Layout of the step block (32-bit words) that CudaBackend::write_step copies to the device in
// one transfer: kiln_core::plan::FlatPlan as arrays. Kernels read token ids, positions, cache
// rows, block tables and sampler settings from it, so a captured graph replays with new values.
// The header's *_AT words are absolute word offsets fixed when the step object is allocated.
// Must match `word` in src/step.rs (a unit test checks).
#pragma once
#include "common.cuh"

#define STEP_N_TOKENS 0
#define STEP_N_SEQS 1
#define STEP_N_LOGIT_ROWS 2
#define STEP_N_SAMPLES 3
#define STEP_N_TILES 4
#define STEP_MAX_KV_LEN 5
// Per token: id, position, sequence index, cache row (block * KV_BLOCK_SIZE + position % KV_BLOCK_SIZE).
#define STEP_TOKENS_AT 6
#define STEP_POS_AT 7
#define STEP_TOKEN_SEQ_AT 8
#define STEP_SLOT_AT 9
// Per sequence: SEQ_WORDS words.
#define STEP_SEQS_AT 10
// Every sequence's block table, one after another (SEQ_TABLE_AT indexes into it).
#define STEP_BLOCKS_AT 11
// Per logits row: the token index whose hidden state it projects.
#define STEP_LOGIT_ROWS_AT 12
// Per sample: SAMPLE_WORDS words.
#define STEP_SAMPLES_AT 13
#define STEP_HISTORY_AT 14
// Per prefill query tile: TILE_WORDS words.
#define STEP_TILES_AT 15
// Written by the sampler, one token per sample, read back in one copy.
#define STEP_SAMPLED_AT 16
#define STEP_HEADER_WORDS 20

#define SEQ_KV_LEN 0
#define SEQ_POS0 1
#define SEQ_FIRST_TOKEN 2
#define SEQ_N_TOKENS 3
#define SEQ_TABLE_AT 4
#define SEQ_N_BLOCKS 5
#define SEQ_WORDS 8

#define SAMPLE_SEQ 0
#define SAMPLE_LOGIT_ROW 1
#define SAMPLE_SEED_LO 2
#define SAMPLE_SEED_HI 3
#define SAMPLE_DRAW_LO 4
#define SAMPLE_DRAW_HI 5
#define SAMPLE_TEMPERATURE 6
#define SAMPLE_TOP_K 7
#define SAMPLE_TOP_P 8
#define SAMPLE_MIN_P 9
#define SAMPLE_REPEAT_PENALTY 10
#define SAMPLE_REPEAT_LAST_N 11
#define SAMPLE_HISTORY_AT 12
#define SAMPLE_N_HISTORY 13
#define SAMPLE_PRESENCE_PENALTY 14
#define SAMPLE_FREQUENCY_PENALTY 15
#define SAMPLE_WORDS 16

#define TILE_SEQ 0
#define TILE_FIRST_TOKEN 1
#define TILE_N_TOKENS 2
#define TILE_WORDS 4

// kiln_core::plan::KV_BLOCK_SIZE and Q_TILE.
#define KV_BLOCK_SIZE 32
#define Q_TILE 64

__device__ __forceinline__ const u32* step_seq(const u32* step, u32 seq) {
    return step + step[STEP_SEQS_AT] + seq * SEQ_WORDS;
}

__device__ __forceinline__ const u32* step_sample(const u32* step, u32 sample) {
    return step + step[STEP_SAMPLES_AT] + sample * SAMPLE_WORDS;
}

__device__ __forceinline__ const u32* step_tile(const u32* step, u32 tile) {
    return step + step[STEP_TILES_AT] + tile * TILE_WORDS;
}

// The block table of sequence record `seq_record` (from step_seq).
__device__ __forceinline__ const u32* step_block_table(const u32* step, const u32* seq_record) {
    return step + step[STEP_BLOCKS_AT] + seq_record[SEQ_TABLE_AT];
}

// Cache row of position `pos` for a sequence whose block table is `table`.
__device__ __forceinline__ u32 cache_row(const u32* table, u32 pos) {
    return table[pos / KV_BLOCK_SIZE] * KV_BLOCK_SIZE + pos % KV_BLOCK_SIZE;
}
