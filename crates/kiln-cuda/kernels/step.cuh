// Layout of the per-step block (32-bit words) that CudaBackend::write_step copies to the device
// in one transfer. Kernels read positions, tokens and sampler settings from it, so a captured
// graph replays with new values. Must match `StepWord` in src/step.rs (a unit test checks).
#pragma once

#define STEP_N_TOKENS 0
#define STEP_POS0 1
#define STEP_N_HISTORY 2
// Word offset of the repetition history inside the block.
#define STEP_HISTORY_AT 3
#define STEP_SEED_LO 4
#define STEP_SEED_HI 5
#define STEP_DRAW_LO 6
#define STEP_DRAW_HI 7
#define STEP_TEMPERATURE 8
#define STEP_TOP_K 9
#define STEP_TOP_P 10
#define STEP_MIN_P 11
#define STEP_REPEAT_PENALTY 12
#define STEP_REPEAT_LAST_N 13
// Written by the sampler, read back by sampled_token.
#define STEP_SAMPLED 14
#define STEP_TOKENS_AT 16
