//! A [`FlatPlan`] as the 32-bit words of the device step block (`kernels/plan.cuh`). The arrays
//! sit at offsets fixed by the step's capacity, so a graph captured for one plan reads the next
//! plan's values from the same addresses.

use kiln_core::plan::{FlatPlan, StepCapacity, Q_TILE};

/// Word offsets of the header and record fields (the defines of `kernels/plan.cuh`).
pub mod word {
    pub const N_TOKENS: usize = 0;
    pub const N_SEQS: usize = 1;
    pub const N_LOGIT_ROWS: usize = 2;
    pub const N_SAMPLES: usize = 3;
    pub const N_TILES: usize = 4;
    pub const MAX_KV_LEN: usize = 5;
    pub const TOKENS_AT: usize = 6;
    pub const POS_AT: usize = 7;
    pub const TOKEN_SEQ_AT: usize = 8;
    pub const SLOT_AT: usize = 9;
    pub const SEQS_AT: usize = 10;
    pub const BLOCKS_AT: usize = 11;
    pub const LOGIT_ROWS_AT: usize = 12;
    pub const SAMPLES_AT: usize = 13;
    pub const HISTORY_AT: usize = 14;
    pub const TILES_AT: usize = 15;
    pub const SAMPLED_AT: usize = 16;
    pub const HEADER_WORDS: usize = 20;

    pub const SEQ_KV_LEN: usize = 0;
    pub const SEQ_POS0: usize = 1;
    pub const SEQ_FIRST_TOKEN: usize = 2;
    pub const SEQ_N_TOKENS: usize = 3;
    pub const SEQ_TABLE_AT: usize = 4;
    pub const SEQ_N_BLOCKS: usize = 5;
    pub const SEQ_WORDS: usize = 8;

    pub const SAMPLE_SEQ: usize = 0;
    pub const SAMPLE_LOGIT_ROW: usize = 1;
    pub const SAMPLE_SEED_LO: usize = 2;
    pub const SAMPLE_SEED_HI: usize = 3;
    pub const SAMPLE_DRAW_LO: usize = 4;
    pub const SAMPLE_DRAW_HI: usize = 5;
    pub const SAMPLE_TEMPERATURE: usize = 6;
    pub const SAMPLE_TOP_K: usize = 7;
    pub const SAMPLE_TOP_P: usize = 8;
    pub const SAMPLE_MIN_P: usize = 9;
    pub const SAMPLE_REPEAT_PENALTY: usize = 10;
    pub const SAMPLE_REPEAT_LAST_N: usize = 11;
    pub const SAMPLE_HISTORY_AT: usize = 12;
    pub const SAMPLE_N_HISTORY: usize = 13;
    pub const SAMPLE_PRESENCE_PENALTY: usize = 14;
    pub const SAMPLE_FREQUENCY_PENALTY: usize = 15;
    pub const SAMPLE_WORDS: usize = 16;

    pub const TILE_SEQ: usize = 0;
    pub const TILE_FIRST_TOKEN: usize = 1;
    pub const TILE_N_TOKENS: usize = 2;
    pub const TILE_WORDS: usize = 4;
}

/// Where each array of the step block starts, for one capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanLayout {
    pub capacity: StepCapacity,
    pub tokens_at: usize,
    pub pos_at: usize,
    pub token_seq_at: usize,
    pub slot_at: usize,
    pub seqs_at: usize,
    pub blocks_at: usize,
    pub logit_rows_at: usize,
    pub samples_at: usize,
    pub history_at: usize,
    pub tiles_at: usize,
    pub sampled_at: usize,
    /// Words of the whole block.
    pub words: usize,
}

fn saturate(value: usize) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}

impl PlanLayout {
    /// Most prefill tiles a plan of this capacity can have: every sequence may end in a partial tile.
    pub fn max_tiles(capacity: &StepCapacity) -> usize {
        capacity.tokens.div_ceil(Q_TILE) + capacity.seqs
    }

    pub fn new(capacity: StepCapacity) -> PlanLayout {
        let tokens_at = word::HEADER_WORDS;
        let pos_at = tokens_at + capacity.tokens;
        let token_seq_at = pos_at + capacity.tokens;
        let slot_at = token_seq_at + capacity.tokens;
        let seqs_at = slot_at + capacity.tokens;
        let blocks_at = seqs_at + capacity.seqs * word::SEQ_WORDS;
        let logit_rows_at = blocks_at + capacity.blocks;
        let samples_at = logit_rows_at + capacity.logit_rows;
        let history_at = samples_at + capacity.seqs * word::SAMPLE_WORDS;
        let tiles_at = history_at + capacity.history;
        let sampled_at = tiles_at + Self::max_tiles(&capacity) * word::TILE_WORDS;
        let words = sampled_at + capacity.seqs.max(1);
        PlanLayout {
            capacity,
            tokens_at,
            pos_at,
            token_seq_at,
            slot_at,
            seqs_at,
            blocks_at,
            logit_rows_at,
            samples_at,
            history_at,
            tiles_at,
            sampled_at,
            words,
        }
    }

    /// Writes `plan` (already checked against this capacity by [`FlatPlan::fill`]) into `out`
    /// (`self.words` long). Only the used part of each array is written.
    pub fn write(&self, plan: &FlatPlan, out: &mut [u32]) {
        assert_eq!(out.len(), self.words, "step block of the wrong size");
        let header = [
            (word::N_TOKENS, plan.tokens.len()),
            (word::N_SEQS, plan.seqs.len()),
            (word::N_LOGIT_ROWS, plan.logit_rows.len()),
            (word::N_SAMPLES, plan.samples.len()),
            (word::N_TILES, plan.tiles.len()),
            (word::MAX_KV_LEN, plan.max_kv_len as usize),
            (word::TOKENS_AT, self.tokens_at),
            (word::POS_AT, self.pos_at),
            (word::TOKEN_SEQ_AT, self.token_seq_at),
            (word::SLOT_AT, self.slot_at),
            (word::SEQS_AT, self.seqs_at),
            (word::BLOCKS_AT, self.blocks_at),
            (word::LOGIT_ROWS_AT, self.logit_rows_at),
            (word::SAMPLES_AT, self.samples_at),
            (word::HISTORY_AT, self.history_at),
            (word::TILES_AT, self.tiles_at),
            (word::SAMPLED_AT, self.sampled_at),
        ];
        for (at, value) in header {
            out[at] = saturate(value);
        }
        let n = plan.tokens.len();
        out[self.tokens_at..self.tokens_at + n].copy_from_slice(&plan.tokens);
        out[self.pos_at..self.pos_at + n].copy_from_slice(&plan.positions);
        out[self.token_seq_at..self.token_seq_at + n].copy_from_slice(&plan.token_seq);
        out[self.slot_at..self.slot_at + n].copy_from_slice(&plan.slots);
        for (i, s) in plan.seqs.iter().enumerate() {
            let rec = &mut out[self.seqs_at + i * word::SEQ_WORDS..self.seqs_at + (i + 1) * word::SEQ_WORDS];
            rec.fill(0);
            rec[word::SEQ_KV_LEN] = s.kv_len;
            rec[word::SEQ_POS0] = s.pos0;
            rec[word::SEQ_FIRST_TOKEN] = s.first_token;
            rec[word::SEQ_N_TOKENS] = s.n_tokens;
            rec[word::SEQ_TABLE_AT] = s.table_at;
            rec[word::SEQ_N_BLOCKS] = s.n_blocks;
        }
        out[self.blocks_at..self.blocks_at + plan.blocks.len()].copy_from_slice(&plan.blocks);
        out[self.logit_rows_at..self.logit_rows_at + plan.logit_rows.len()].copy_from_slice(&plan.logit_rows);
        for (i, s) in plan.samples.iter().enumerate() {
            let rec = &mut out[self.samples_at + i * word::SAMPLE_WORDS..self.samples_at + (i + 1) * word::SAMPLE_WORDS];
            rec.fill(0);
            let p = &s.params;
            rec[word::SAMPLE_SEQ] = s.seq;
            rec[word::SAMPLE_LOGIT_ROW] = s.logit_row;
            rec[word::SAMPLE_SEED_LO] = p.seed as u32;
            rec[word::SAMPLE_SEED_HI] = (p.seed >> 32) as u32;
            rec[word::SAMPLE_DRAW_LO] = s.draw as u32;
            rec[word::SAMPLE_DRAW_HI] = (s.draw >> 32) as u32;
            // The kernel reads a temperature above 0 as a draw: greedy settings travel as 0.
            rec[word::SAMPLE_TEMPERATURE] = if p.is_greedy() { 0 } else { p.temperature.to_bits() };
            rec[word::SAMPLE_TOP_K] = saturate(p.top_k);
            rec[word::SAMPLE_TOP_P] = p.top_p.to_bits();
            rec[word::SAMPLE_MIN_P] = p.min_p.to_bits();
            rec[word::SAMPLE_REPEAT_PENALTY] = p.repeat_penalty.to_bits();
            rec[word::SAMPLE_REPEAT_LAST_N] = saturate(p.repeat_last_n);
            rec[word::SAMPLE_HISTORY_AT] = s.history_at;
            rec[word::SAMPLE_N_HISTORY] = s.n_history;
            rec[word::SAMPLE_PRESENCE_PENALTY] = p.presence_penalty.to_bits();
            rec[word::SAMPLE_FREQUENCY_PENALTY] = p.frequency_penalty.to_bits();
        }
        out[self.history_at..self.history_at + plan.history.len()].copy_from_slice(&plan.history);
        for (i, t) in plan.tiles.iter().enumerate() {
            let rec = &mut out[self.tiles_at + i * word::TILE_WORDS..self.tiles_at + (i + 1) * word::TILE_WORDS];
            rec.fill(0);
            rec[word::TILE_SEQ] = t.seq;
            rec[word::TILE_FIRST_TOKEN] = t.first_token;
            rec[word::TILE_N_TOKENS] = t.n_tokens;
        }
    }
}

#[cfg(test)]
mod tests {
    use kiln_core::plan::{BatchPlan, LogitRows, SampleSpec, SeqStep, KV_BLOCK_SIZE};
    use kiln_core::SamplingParams;

    use super::*;

    /// The Rust offsets and kernels/plan.cuh describe the same layout.
    #[test]
    fn layout_matches_the_kernel_header() {
        let header = include_str!("../kernels/plan.cuh");
        let defines: Vec<(String, usize)> = header
            .lines()
            .filter_map(|line| line.strip_prefix("#define "))
            .filter_map(|rest| rest.split_once(' '))
            .filter_map(|(name, value)| value.trim().parse().ok().map(|v| (name.to_string(), v)))
            .collect();
        let rust = [
            ("STEP_N_TOKENS", word::N_TOKENS),
            ("STEP_N_SEQS", word::N_SEQS),
            ("STEP_N_LOGIT_ROWS", word::N_LOGIT_ROWS),
            ("STEP_N_SAMPLES", word::N_SAMPLES),
            ("STEP_N_TILES", word::N_TILES),
            ("STEP_MAX_KV_LEN", word::MAX_KV_LEN),
            ("STEP_TOKENS_AT", word::TOKENS_AT),
            ("STEP_POS_AT", word::POS_AT),
            ("STEP_TOKEN_SEQ_AT", word::TOKEN_SEQ_AT),
            ("STEP_SLOT_AT", word::SLOT_AT),
            ("STEP_SEQS_AT", word::SEQS_AT),
            ("STEP_BLOCKS_AT", word::BLOCKS_AT),
            ("STEP_LOGIT_ROWS_AT", word::LOGIT_ROWS_AT),
            ("STEP_SAMPLES_AT", word::SAMPLES_AT),
            ("STEP_HISTORY_AT", word::HISTORY_AT),
            ("STEP_TILES_AT", word::TILES_AT),
            ("STEP_SAMPLED_AT", word::SAMPLED_AT),
            ("STEP_HEADER_WORDS", word::HEADER_WORDS),
            ("SEQ_KV_LEN", word::SEQ_KV_LEN),
            ("SEQ_POS0", word::SEQ_POS0),
            ("SEQ_FIRST_TOKEN", word::SEQ_FIRST_TOKEN),
            ("SEQ_N_TOKENS", word::SEQ_N_TOKENS),
            ("SEQ_TABLE_AT", word::SEQ_TABLE_AT),
            ("SEQ_N_BLOCKS", word::SEQ_N_BLOCKS),
            ("SEQ_WORDS", word::SEQ_WORDS),
            ("SAMPLE_SEQ", word::SAMPLE_SEQ),
            ("SAMPLE_LOGIT_ROW", word::SAMPLE_LOGIT_ROW),
            ("SAMPLE_SEED_LO", word::SAMPLE_SEED_LO),
            ("SAMPLE_SEED_HI", word::SAMPLE_SEED_HI),
            ("SAMPLE_DRAW_LO", word::SAMPLE_DRAW_LO),
            ("SAMPLE_DRAW_HI", word::SAMPLE_DRAW_HI),
            ("SAMPLE_TEMPERATURE", word::SAMPLE_TEMPERATURE),
            ("SAMPLE_TOP_K", word::SAMPLE_TOP_K),
            ("SAMPLE_TOP_P", word::SAMPLE_TOP_P),
            ("SAMPLE_MIN_P", word::SAMPLE_MIN_P),
            ("SAMPLE_REPEAT_PENALTY", word::SAMPLE_REPEAT_PENALTY),
            ("SAMPLE_REPEAT_LAST_N", word::SAMPLE_REPEAT_LAST_N),
            ("SAMPLE_HISTORY_AT", word::SAMPLE_HISTORY_AT),
            ("SAMPLE_N_HISTORY", word::SAMPLE_N_HISTORY),
            ("SAMPLE_PRESENCE_PENALTY", word::SAMPLE_PRESENCE_PENALTY),
            ("SAMPLE_FREQUENCY_PENALTY", word::SAMPLE_FREQUENCY_PENALTY),
            ("SAMPLE_WORDS", word::SAMPLE_WORDS),
            ("TILE_SEQ", word::TILE_SEQ),
            ("TILE_FIRST_TOKEN", word::TILE_FIRST_TOKEN),
            ("TILE_N_TOKENS", word::TILE_N_TOKENS),
            ("TILE_WORDS", word::TILE_WORDS),
            ("KV_BLOCK_SIZE", KV_BLOCK_SIZE),
            ("Q_TILE", Q_TILE),
        ];
        for (name, offset) in rust {
            assert!(defines.iter().any(|(n, v)| n == name && *v == offset), "{name} = {offset} is not in plan.cuh: {defines:?}");
        }
        let step_like = defines.iter().filter(|(n, _)| ["STEP_", "SEQ_", "SAMPLE_", "TILE_"].iter().any(|p| n.starts_with(p))).count();
        assert_eq!(step_like + 2, rust.len(), "plan.cuh has defines the Rust side does not check: {defines:?}");
    }

    #[test]
    fn words_land_at_the_layout_offsets() {
        let cap = StepCapacity { tokens: 80, seqs: 4, blocks: 16, logit_rows: 80, history: 8 };
        let layout = PlanLayout::new(cap);
        let tokens: Vec<u32> = (100..170).collect();
        let seqs = [
            SeqStep { tokens: &tokens, pos0: 0, blocks: &[3, 1, 2], logits: LogitRows::Last, sample: None },
            SeqStep {
                tokens: &[9],
                pos0: 40,
                blocks: &[0, 5],
                logits: LogitRows::Last,
                sample: Some(SampleSpec { params: SamplingParams { seed: 1 << 40 | 7, ..SamplingParams::default() }, history: &[4, 4, 2], draw: 11 }),
            },
        ];
        let mut flat = FlatPlan::default();
        flat.fill(&BatchPlan { seqs: &seqs }, &cap, 8).unwrap();
        let mut out = vec![0u32; layout.words];
        layout.write(&flat, &mut out);
        assert_eq!(out[word::N_TOKENS], 71);
        assert_eq!(out[word::N_TILES], 3);
        assert_eq!(out[layout.tokens_at + 70], 9);
        assert_eq!(out[layout.pos_at + 70], 40);
        assert_eq!(out[layout.slot_at + 70], (5 * KV_BLOCK_SIZE + 8) as u32);
        let seq1 = &out[layout.seqs_at + word::SEQ_WORDS..];
        assert_eq!(seq1[word::SEQ_KV_LEN], 41);
        assert_eq!(out[layout.blocks_at + seq1[word::SEQ_TABLE_AT] as usize + 1], 5);
        let sample = &out[layout.samples_at..];
        assert_eq!((sample[word::SAMPLE_SEQ], sample[word::SAMPLE_LOGIT_ROW]), (1, 1));
        assert_eq!(sample[word::SAMPLE_SEED_HI], 1 << 8);
        assert_eq!(out[layout.history_at + sample[word::SAMPLE_HISTORY_AT] as usize..][..3], [4, 4, 2]);
        let tile2 = &out[layout.tiles_at + 2 * word::TILE_WORDS..];
        assert_eq!((tile2[word::TILE_SEQ], tile2[word::TILE_FIRST_TOKEN], tile2[word::TILE_N_TOKENS]), (1, 70, 1));
        assert!(layout.sampled_at + cap.seqs <= layout.words);
    }
}
