//! The batch plan of one step: which sequences take part, how many tokens each feeds at which
//! positions, where their keys and values live in the paged KV cache, which rows produce logits
//! and which of those are sampled.
//!
//! [`BatchPlan`] is what the engine describes; [`FlatPlan`] is the same plan flattened into
//! per-token, per-sequence and per-sample arrays, validated once, which every backend reads (the
//! CUDA backend copies it to the device as one block, `kernels/step.cuh`).

use std::fmt;
use std::str::FromStr;

use crate::backend::{BackendError, Result};
use crate::sampling::SamplingParams;

/// Positions per KV block. 32 keeps the memory a sequence wastes below 32 positions (under 0.4%
/// of an 8k context) and the block tables short (256 entries at 8k), and it is a multiple of
/// the q8_0 block, so a cache row never shares a quantization block with another row.
pub const KV_BLOCK_SIZE: usize = 32;

/// A block-table entry whose block went back to the pool: every position in it lies before any
/// window still to be read (a sliding-window layer's table). No kernel reads such an entry;
/// [`FlatPlan::check_window`] refuses a layer whose window would reach one.
pub const RELEASED_BLOCK: u32 = u32::MAX;

/// Query tokens per prefill attention tile ([`FlatPlan::tiles`]).
pub const Q_TILE: usize = 64;

/// Element type of the KV cache (`-ctk` / `-ctv`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum KvType {
    F32,
    #[default]
    F16,
    /// Blocks of 32 values along a cache row: 32 signed bytes and one f16 scale (ggml's q8_0).
    Q8_0,
}

impl KvType {
    pub const ALL: [KvType; 3] = [KvType::F32, KvType::F16, KvType::Q8_0];

    /// Bytes of one cache row of `width` values (`width` a multiple of 32 for q8_0).
    pub fn row_bytes(self, width: usize) -> usize {
        match self {
            KvType::F32 => width * 4,
            KvType::F16 => width * 2,
            KvType::Q8_0 => width / 32 * 34,
        }
    }

    /// Checks that a cache of rows of `width` values can hold this type.
    pub fn check_width(self, width: usize) -> Result<()> {
        if self == KvType::Q8_0 && !width.is_multiple_of(32) {
            return Err(BackendError::Unsupported { backend: "KV cache".into(), what: format!("q8_0 rows of {width} values (a multiple of 32 is needed)") });
        }
        Ok(())
    }
}

impl fmt::Display for KvType {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Q8_0 => "q8_0",
        })
    }
}

impl FromStr for KvType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        KvType::ALL
            .into_iter()
            .find(|t| t.to_string().eq_ignore_ascii_case(s))
            .ok_or_else(|| format!("unknown KV cache type '{s}' (expected f32, f16 or q8_0)"))
    }
}

/// One layer's KV cache: `n_blocks` blocks of [`KV_BLOCK_SIZE`] rows of `width` values for K
/// (type `k_type`) and as many for V (type `v_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheSpec {
    pub n_blocks: usize,
    pub width: usize,
    pub k_type: KvType,
    pub v_type: KvType,
}

impl KvCacheSpec {
    pub fn rows(&self) -> usize {
        self.n_blocks * KV_BLOCK_SIZE
    }
    /// Bytes of K and V together.
    pub fn bytes(&self) -> usize {
        self.rows() * (self.k_type.row_bytes(self.width) + self.v_type.row_bytes(self.width))
    }
}

/// What a sequence's sampled token is drawn with.
#[derive(Clone, Copy, Debug)]
pub struct SampleSpec<'a> {
    pub params: SamplingParams,
    /// The most recent tokens (oldest first), for the repetition penalty.
    pub history: &'a [u32],
    /// Counter mixed with the seed so every sampled token draws a fresh number.
    pub draw: u64,
}

/// Which of a sequence's tokens produce logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    None,
    Last,
    All,
}

/// One sequence's part of a step.
#[derive(Clone, Copy, Debug)]
pub struct SeqStep<'a> {
    /// The tokens this step feeds (a prefill chunk, or one decode token).
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`: the positions `0..pos0` are already in the cache.
    pub pos0: usize,
    /// Physical KV blocks covering positions `0..pos0 + tokens.len()`, in order; entries before
    /// the window of every query may be [`RELEASED_BLOCK`].
    pub blocks: &'a [u32],
    pub logits: LogitRows,
    /// Samples from the last token's logits (needs `logits` other than `None`).
    pub sample: Option<SampleSpec<'a>>,
}

/// The sequences of one step, in the order their tokens, logit rows and samples appear.
#[derive(Clone, Copy, Debug)]
pub struct BatchPlan<'a> {
    pub seqs: &'a [SeqStep<'a>],
}

/// Most tokens, sequences, block-table entries and history tokens a step object holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepCapacity {
    pub tokens: usize,
    pub seqs: usize,
    /// Block-table entries over all sequences of a step.
    pub blocks: usize,
    /// Rows of logits (at most `tokens`).
    pub logit_rows: usize,
    /// History tokens over all samples of a step.
    pub history: usize,
}

/// A sequence of a flattened plan.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlatSeq {
    /// Positions in the cache after this step (`pos0 + n_tokens`).
    pub kv_len: u32,
    pub pos0: u32,
    pub first_token: u32,
    pub n_tokens: u32,
    /// Offset of this sequence's block table in [`FlatPlan::blocks`].
    pub table_at: u32,
    pub n_blocks: u32,
}

/// A sample of a flattened plan.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlatSample {
    pub seq: u32,
    /// Row of the logits buffer it draws from.
    pub logit_row: u32,
    pub params: SamplingParams,
    pub draw: u64,
    /// Offset and length of its history in [`FlatPlan::history`].
    pub history_at: u32,
    pub n_history: u32,
}

/// A prefill attention tile: up to [`Q_TILE`] consecutive query tokens of one sequence.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlatTile {
    pub seq: u32,
    pub first_token: u32,
    pub n_tokens: u32,
}

/// A [`BatchPlan`] as flat arrays, checked against the step capacity and the cache size.
#[derive(Clone, Debug, Default)]
pub struct FlatPlan {
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    /// Sequence index of each token.
    pub token_seq: Vec<u32>,
    /// Cache row of each token: `block * KV_BLOCK_SIZE + position % KV_BLOCK_SIZE`.
    pub slots: Vec<u32>,
    pub seqs: Vec<FlatSeq>,
    pub blocks: Vec<u32>,
    /// Token index of each logits row.
    pub logit_rows: Vec<u32>,
    pub samples: Vec<FlatSample>,
    pub history: Vec<u32>,
    pub tiles: Vec<FlatTile>,
    /// Longest `kv_len` of the step.
    pub max_kv_len: u32,
    /// One past the highest block id any table names (0 for an empty plan): the cache must have
    /// memory behind blocks `0..blocks_end` before the step runs.
    pub blocks_end: u32,
    /// The widest sliding window that every token's table still covers, when some table has
    /// released blocks; `None`: every table is whole, so any attention can read it.
    pub widest_window: Option<u32>,
}

/// `need` = (tokens, sequences, block-table entries, logit rows, history tokens) against `cap`.
fn check_counts(cap: &StepCapacity, need: [usize; 5]) -> Result<()> {
    let have = [cap.tokens, cap.seqs, cap.blocks, cap.logit_rows, cap.history];
    let what = ["tokens", "sequences", "block-table entries", "logit rows", "history tokens"];
    for ((what, need), have) in what.into_iter().zip(need).zip(have) {
        if need > have {
            return Err(BackendError::PlanTooLarge { what: what.into(), need, capacity: have });
        }
    }
    Ok(())
}

/// Checks an attention of `window` (`None`: global) against the widest window a step's tables
/// still cover ([`FlatPlan::widest_window`]), for backends that keep only that number.
pub fn check_window_reach(widest: Option<u32>, window: Option<usize>) -> Result<()> {
    match (widest, window) {
        (Some(widest), None) => {
            Err(BackendError::BadPlan(format!("global attention over block tables that released blocks (they cover a window of {widest})")))
        }
        (Some(widest), Some(w)) if w > widest as usize => {
            Err(BackendError::BadPlan(format!("a sliding window of {w} positions over block tables that cover only {widest}")))
        }
        _ => Ok(()),
    }
}

fn u32_of(what: &str, value: usize) -> Result<u32> {
    u32::try_from(value).map_err(|_| BackendError::BadPlan(format!("{what} = {value} does not fit 32 bits")))
}

impl FlatPlan {
    /// An empty plan whose arrays hold plans up to `cap` without growing.
    pub fn with_capacity(cap: &StepCapacity) -> FlatPlan {
        FlatPlan {
            tokens: Vec::with_capacity(cap.tokens),
            positions: Vec::with_capacity(cap.tokens),
            token_seq: Vec::with_capacity(cap.tokens),
            slots: Vec::with_capacity(cap.tokens),
            seqs: Vec::with_capacity(cap.seqs),
            blocks: Vec::with_capacity(cap.blocks),
            logit_rows: Vec::with_capacity(cap.logit_rows),
            samples: Vec::with_capacity(cap.seqs),
            history: Vec::with_capacity(cap.history),
            tiles: Vec::with_capacity(cap.tokens.div_ceil(Q_TILE) + cap.seqs),
            max_kv_len: 0,
            blocks_end: 0,
            widest_window: None,
        }
    }

    /// Empties the plan, keeping its allocations.
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.positions.clear();
        self.token_seq.clear();
        self.slots.clear();
        self.seqs.clear();
        self.blocks.clear();
        self.logit_rows.clear();
        self.samples.clear();
        self.history.clear();
        self.tiles.clear();
        self.max_kv_len = 0;
        self.blocks_end = 0;
        self.widest_window = None;
    }

    /// Flattens `plan` in place (no allocation once the arrays have grown to `cap`). `cache_blocks`
    /// is the number of blocks the KV cache holds, so a block id past it is refused here.
    pub fn fill(&mut self, plan: &BatchPlan, cap: &StepCapacity, cache_blocks: usize) -> Result<()> {
        self.clear();
        plan.seqs.iter().try_for_each(|s| self.push(s, cap, cache_blocks))
    }

    /// Appends one sequence's part of the step, checked against `cap` and the cache size.
    pub fn push(&mut self, s: &SeqStep, cap: &StepCapacity, cache_blocks: usize) -> Result<()> {
        let index = self.seqs.len();
        let n_rows = match s.logits {
            LogitRows::None => 0,
            LogitRows::Last => 1,
            LogitRows::All => s.tokens.len(),
        };
        check_counts(
            cap,
            [
                self.tokens.len() + s.tokens.len(),
                index + 1,
                self.blocks.len() + s.blocks.len(),
                self.logit_rows.len() + n_rows,
                self.history.len() + s.sample.map_or(0, |x| x.history.len()),
            ],
        )?;
        let seq = u32_of("sequence index", index)?;
        let kv_len = s.pos0 + s.tokens.len();
        if s.tokens.is_empty() {
            return Err(BackendError::BadPlan(format!("sequence {index} feeds no tokens")));
        }
        if s.blocks.len() * KV_BLOCK_SIZE < kv_len {
            return Err(BackendError::BadPlan(format!(
                "sequence {index} reaches position {} but its {} blocks hold {}",
                kv_len - 1,
                s.blocks.len(),
                s.blocks.len() * KV_BLOCK_SIZE
            )));
        }
        let live = |b: &&u32| **b != RELEASED_BLOCK;
        if let Some(&bad) = s.blocks.iter().filter(live).find(|&&b| b as usize >= cache_blocks) {
            return Err(BackendError::BadPlan(format!("sequence {index} names block {bad}; the cache holds {cache_blocks}")));
        }
        // Released entries lead the table: the first position whose block is still held.
        let live_from = s.blocks.iter().rposition(|&b| b == RELEASED_BLOCK).map_or(0, |i| (i + 1) * KV_BLOCK_SIZE);
        if live_from > s.pos0 {
            return Err(BackendError::BadPlan(format!("sequence {index} feeds position {} but its block was released", s.pos0)));
        }
        if live_from > 0 {
            // The first token sees the least: its window may reach back to `live_from`.
            let reach = u32_of("window", s.pos0 + 1 - live_from)?;
            self.widest_window = Some(self.widest_window.map_or(reach, |w| w.min(reach)));
        }
        self.blocks_end = self.blocks_end.max(s.blocks.iter().filter(live).max().map_or(0, |&b| b + 1));
        if s.sample.is_some() && s.logits == LogitRows::None {
            return Err(BackendError::BadPlan(format!("sequence {index} samples but produces no logits")));
        }
        let first_token = self.tokens.len();
        self.seqs.push(FlatSeq {
            kv_len: u32_of("sequence length", kv_len)?,
            pos0: u32_of("position", s.pos0)?,
            first_token: first_token as u32,
            n_tokens: s.tokens.len() as u32,
            table_at: self.blocks.len() as u32,
            n_blocks: s.blocks.len() as u32,
        });
        self.max_kv_len = self.max_kv_len.max(kv_len as u32);
        self.blocks.extend_from_slice(s.blocks);
        for (i, &token) in s.tokens.iter().enumerate() {
            let pos = s.pos0 + i;
            let block = s.blocks[pos / KV_BLOCK_SIZE] as usize;
            self.tokens.push(token);
            self.positions.push(pos as u32);
            self.token_seq.push(seq);
            self.slots.push(u32_of("cache row", block * KV_BLOCK_SIZE + pos % KV_BLOCK_SIZE)?);
        }
        let mut tile_at = 0;
        while tile_at < s.tokens.len() {
            let n = (s.tokens.len() - tile_at).min(Q_TILE);
            self.tiles.push(FlatTile { seq, first_token: (first_token + tile_at) as u32, n_tokens: n as u32 });
            tile_at += n;
        }
        match s.logits {
            LogitRows::None => {}
            LogitRows::Last => self.logit_rows.push((first_token + s.tokens.len() - 1) as u32),
            LogitRows::All => self.logit_rows.extend((first_token..first_token + s.tokens.len()).map(|t| t as u32)),
        }
        if let Some(spec) = s.sample {
            let history_at = self.history.len() as u32;
            self.history.extend_from_slice(spec.history);
            self.samples.push(FlatSample {
                seq,
                logit_row: (self.logit_rows.len() - 1) as u32,
                params: spec.params,
                draw: spec.draw,
                history_at,
                n_history: spec.history.len() as u32,
            });
        }
        Ok(())
    }

    /// Makes this plan a copy of `other`, reusing the arrays' allocations (derived `clone_from`
    /// would allocate anew).
    pub fn assign(&mut self, other: &FlatPlan) {
        fn copy<T: Copy>(dst: &mut Vec<T>, src: &[T]) {
            dst.clear();
            dst.extend_from_slice(src);
        }
        copy(&mut self.tokens, &other.tokens);
        copy(&mut self.positions, &other.positions);
        copy(&mut self.token_seq, &other.token_seq);
        copy(&mut self.slots, &other.slots);
        copy(&mut self.seqs, &other.seqs);
        copy(&mut self.blocks, &other.blocks);
        copy(&mut self.logit_rows, &other.logit_rows);
        copy(&mut self.samples, &other.samples);
        copy(&mut self.history, &other.history);
        copy(&mut self.tiles, &other.tiles);
        self.max_kv_len = other.max_kv_len;
        self.blocks_end = other.blocks_end;
        self.widest_window = other.widest_window;
    }

    /// Checks that this plan fits `cap` and names no block past `cache_blocks` (a plan built
    /// against another capacity or cache may not).
    pub fn check_fits(&self, cap: &StepCapacity, cache_blocks: usize) -> Result<()> {
        check_counts(cap, [self.tokens.len(), self.seqs.len(), self.blocks.len(), self.logit_rows.len(), self.history.len()])?;
        if self.blocks_end as usize > cache_blocks {
            return Err(BackendError::BadPlan(format!("block {} is outside the {cache_blocks}-block cache", self.blocks_end - 1)));
        }
        Ok(())
    }

    /// Checks that a cache with memory behind `usable_blocks` blocks can serve this plan.
    pub fn check_usable(&self, usable_blocks: usize) -> Result<()> {
        if self.blocks_end as usize > usable_blocks {
            return Err(BackendError::BadPlan(format!(
                "the step reads block {} but only {usable_blocks} blocks of the cache have memory (grow_kv first)",
                self.blocks_end - 1
            )));
        }
        Ok(())
    }

    /// Checks that attention with `window` (`None`: global) reads no released table entry.
    pub fn check_window(&self, window: Option<usize>) -> Result<()> {
        check_window_reach(self.widest_window, window)
    }

    /// Whether every sequence of the step feeds exactly one token (a decode step).
    pub fn is_decode_only(&self) -> bool {
        self.tokens.len() == self.seqs.len()
    }

    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// The history of sample `i`.
    pub fn sample_history(&self, i: usize) -> &[u32] {
        let s = &self.samples[i];
        &self.history[s.history_at as usize..(s.history_at + s.n_history) as usize]
    }

    /// The cache row holding position `pos` of sequence `seq`.
    pub fn row_of(&self, seq: usize, pos: usize) -> usize {
        let s = &self.seqs[seq];
        self.blocks[s.table_at as usize + pos / KV_BLOCK_SIZE] as usize * KV_BLOCK_SIZE + pos % KV_BLOCK_SIZE
    }

    /// A key that is equal for two plans exactly when every kernel launch of their step has the
    /// same grid: a captured graph recorded for one replays correctly for the other.
    pub fn shape_key(&self) -> u64 {
        let mut key = self.tokens.len() as u64;
        for v in [self.seqs.len(), self.logit_rows.len(), self.samples.len(), self.tiles.len()] {
            key = key.wrapping_mul(0x100_0000_01b3).wrapping_add(v as u64 + 1);
        }
        key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cap() -> StepCapacity {
        StepCapacity { tokens: 256, seqs: 8, blocks: 64, logit_rows: 256, history: 64 }
    }

    /// The LM head skips its gather where every token has a logit row (kiln-models' lm_head):
    /// such rows must be the tokens themselves, in order.
    #[test]
    fn a_logit_row_for_every_token_is_every_token_in_order() {
        let (prompt, one) = ([1u32, 2, 3], [4u32]);
        for (first, second) in [(LogitRows::All, LogitRows::Last), (LogitRows::Last, LogitRows::All), (LogitRows::All, LogitRows::All)] {
            let tokens_a: &[u32] = if first == LogitRows::All { &prompt } else { &one };
            let tokens_b: &[u32] = if second == LogitRows::All { &prompt } else { &one };
            let seq = |tokens, logits, blocks| SeqStep { tokens, pos0: 0, blocks, logits, sample: None };
            let seqs = [seq(tokens_a, first, &[0][..]), seq(tokens_b, second, &[1][..])];
            let mut flat = FlatPlan::default();
            flat.fill(&BatchPlan { seqs: &seqs }, &cap(), 8).unwrap();
            assert_eq!(flat.logit_rows.len(), flat.tokens.len());
            assert!(flat.logit_rows.iter().enumerate().all(|(i, &row)| row as usize == i), "{:?}", flat.logit_rows);
        }
    }

    #[test]
    fn flattening_maps_positions_through_block_tables() {
        let history = [5u32, 6];
        let a = SeqStep {
            tokens: &[1, 2, 3],
            pos0: 30,
            blocks: &[7, 2],
            logits: LogitRows::Last,
            sample: Some(SampleSpec { params: SamplingParams::greedy(), history: &history, draw: 3 }),
        };
        let tokens_b: Vec<u32> = (0..70).collect();
        let b = SeqStep { tokens: &tokens_b, pos0: 0, blocks: &[0, 1, 4], logits: LogitRows::All, sample: None };
        let mut flat = FlatPlan::default();
        flat.fill(&BatchPlan { seqs: &[a, b] }, &cap(), 8).unwrap();
        assert_eq!(flat.positions[..3], [30, 31, 32]);
        assert_eq!(flat.slots[..3], [7 * 32 + 30, 7 * 32 + 31, 2 * 32]);
        assert_eq!(flat.slots[3 + 65], 4 * 32 + 1);
        assert_eq!(flat.token_seq[3], 1);
        assert_eq!(flat.logit_rows.len(), 71);
        assert_eq!(flat.logit_rows[0], 2);
        assert_eq!(flat.samples[0].logit_row, 0);
        assert_eq!(flat.sample_history(0), history);
        assert_eq!(
            flat.tiles,
            vec![
                FlatTile { seq: 0, first_token: 0, n_tokens: 3 },
                FlatTile { seq: 1, first_token: 3, n_tokens: 64 },
                FlatTile { seq: 1, first_token: 67, n_tokens: 6 }
            ]
        );
        assert_eq!(flat.max_kv_len, 70);
        assert_eq!(flat.blocks_end, 8);
        assert!(flat.check_fits(&cap(), 8).is_ok());
        assert!(flat.check_fits(&cap(), 7).unwrap_err().to_string().contains("block 7"));
        assert!(flat.check_usable(5).unwrap_err().to_string().contains("only 5 blocks"));
        assert_eq!(flat.row_of(1, 69), 4 * 32 + 5);
    }

    #[test]
    fn bad_plans_are_refused_with_a_reason() {
        let mut flat = FlatPlan::default();
        let short = SeqStep { tokens: &[1; 40], pos0: 0, blocks: &[0], logits: LogitRows::None, sample: None };
        let err = flat.fill(&BatchPlan { seqs: &[short] }, &cap(), 8).unwrap_err().to_string();
        assert!(err.contains("reaches position 39"), "{err}");
        let outside = SeqStep { tokens: &[1], pos0: 0, blocks: &[9], logits: LogitRows::None, sample: None };
        assert!(flat.fill(&BatchPlan { seqs: &[outside] }, &cap(), 8).unwrap_err().to_string().contains("block 9"));
        let many = SeqStep { tokens: &[1; 300], pos0: 0, blocks: &[0; 10], logits: LogitRows::None, sample: None };
        assert!(flat.fill(&BatchPlan { seqs: &[many] }, &cap(), 8).unwrap_err().to_string().contains("300 tokens"));
    }

    #[test]
    fn released_entries_are_never_read_and_bound_the_window() {
        let r = RELEASED_BLOCK;
        let tokens = [1u32; 3];
        // Positions 100..103 over a table whose first two blocks went back to the pool.
        let a = SeqStep { tokens: &tokens, pos0: 100, blocks: &[r, r, 5, 6], logits: LogitRows::None, sample: None };
        let mut flat = FlatPlan::default();
        flat.fill(&BatchPlan { seqs: &[a] }, &cap(), 8).unwrap();
        assert_eq!((flat.blocks_end, flat.widest_window), (7, Some(100 + 1 - 64)));
        assert_eq!(flat.slots[0], 6 * 32 + 4);
        assert!(flat.check_window(Some(37)).is_ok());
        assert!(flat.check_window(Some(38)).unwrap_err().to_string().contains("cover only 37"));
        assert!(flat.check_window(None).unwrap_err().to_string().contains("global attention"));
        // A whole table serves any attention; a token whose own block was released is refused.
        let whole = SeqStep { blocks: &[0, 1, 2, 3], ..a };
        flat.fill(&BatchPlan { seqs: &[whole, a] }, &cap(), 8).unwrap();
        assert_eq!(flat.widest_window, Some(37));
        flat.fill(&BatchPlan { seqs: &[whole] }, &cap(), 8).unwrap();
        assert!(flat.widest_window.is_none() && flat.check_window(None).is_ok());
        let own_released = SeqStep { blocks: &[r, r, r, r], ..a };
        let err = flat.fill(&BatchPlan { seqs: &[own_released] }, &cap(), 8).unwrap_err().to_string();
        assert!(err.contains("released"), "{err}");
    }

    #[test]
    fn kv_types_parse_and_size() {
        assert_eq!("Q8_0".parse::<KvType>().unwrap(), KvType::Q8_0);
        assert!("q4_0".parse::<KvType>().is_err());
        assert_eq!(KvType::Q8_0.row_bytes(64), 68);
        assert!(KvType::Q8_0.check_width(40).is_err());
        assert!(KvType::F16.check_width(40).is_ok());
    }
}
