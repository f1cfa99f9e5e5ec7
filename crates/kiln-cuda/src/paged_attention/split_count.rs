//! How many splits a decode grid uses: one wave of resident blocks as the estimate, and, on the
//! first uncaptured call for a grid, the fastest of a few candidates timed on a synthetic
//! long-context step, kept for good (captured graphs bake the count in) and for later runs.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaSlice;
use kiln_core::plan::{BatchPlan, FlatPlan, LogitRows, SeqStep, StepCapacity, KV_BLOCK_SIZE};

use super::{
    invalid, launch_split, min_chunk, workspace_len, AttentionInputs, Kernels, Key, PagedAttention, PagedAttentionParams, SplitLaunch, State, DEC_MAX_SPLITS,
    WORKSPACE_MAX_BYTES,
};
use crate::plan_words::PlanLayout;
use crate::tuning::TuningTable;
use crate::{CudaDevice, CudaError};

/// Positions per sequence of the synthetic step the split counts are timed on, and the cap on
/// its rows over all tokens (large batches are timed at shorter depths).
const TUNE_POSITIONS: usize = 8192;
const TUNE_MAX_ROWS: usize = 1 << 20;
/// Timed launches per candidate (after one warm-up); candidates within TUNE_SLACK of the
/// fastest count as ties, won by the fewest splits (smaller partials, cheaper merge).
const TUNE_ROUNDS: usize = 3;
const TUNE_SLACK: f64 = 1.02;

/// Timed split counts, kept for later processes (an estimate fixed untimed is not).
static TUNED_SPLITS: TuningTable<GridKey, usize> = TuningTable::new("decode attention splits", |&n| (1..=DEC_MAX_SPLITS).contains(&n));

/// What fixes a decode grid: the specialization, the token count and the shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct GridKey {
    key: Key,
    n_tokens: usize,
    n_heads: usize,
    n_kv_heads: usize,
    max_span: usize,
}

/// The split count of one decode grid and how it was chosen.
#[derive(Clone, Debug, PartialEq)]
pub struct SplitChoice {
    pub n_splits: usize,
    /// (splits, milliseconds per call) of every candidate timed; empty when the count was
    /// fixed without timing (first seen inside a capture, or a cache too small to time on).
    pub timings: Vec<(usize, f64)>,
    /// Positions per token of the step the candidates were timed on.
    pub timed_positions: usize,
}

impl GridKey {
    pub(super) fn of(n_tokens: usize, p: &PagedAttentionParams) -> GridKey {
        GridKey { key: Key::of(p), n_tokens, n_heads: p.n_heads, n_kv_heads: p.n_kv_heads, max_span: p.max_span() }
    }
}

impl PagedAttention {
    /// One full wave of resident blocks (so enough cache rows are in flight at long context),
    /// within the caps.
    pub(super) fn splits_for(resident_blocks: usize, n_tokens: usize, p: &PagedAttentionParams) -> usize {
        Self::cap_splits(resident_blocks / (p.n_kv_heads * n_tokens).max(1), n_tokens, p)
    }

    /// No more splits than the longest sequence can feed, and partials within the workspace cap.
    fn cap_splits(n_splits: usize, n_tokens: usize, p: &PagedAttentionParams) -> usize {
        let per_split_bytes = n_tokens * p.n_heads * (p.head_dim + 2) * 4;
        n_splits.min(p.max_span().div_ceil(min_chunk(&Key::of(p)))).min(DEC_MAX_SPLITS).min(WORKSPACE_MAX_BYTES / per_split_bytes.max(1)).max(1)
    }

    /// Split counts worth timing: half a wave to four waves (blocks beyond one wave overlap one
    /// split's fixed costs with another's loads), within the caps.
    fn candidates(resident_blocks: usize, n_tokens: usize, p: &PagedAttentionParams) -> Vec<usize> {
        let wave = resident_blocks as f64 / (p.n_kv_heads * n_tokens).max(1) as f64;
        let mut out: Vec<usize> = [0.5, 1.0, 2.0, 3.0, 4.0].iter().map(|&w| Self::cap_splits((wave * w) as usize, n_tokens, p)).collect();
        out.sort_unstable();
        out.dedup();
        out
    }
}

/// Step words of `n_tokens` decode tokens, each its own sequence at position `positions - 1`
/// over distinct cache blocks (wrapping around a small cache), to time split counts on.
fn tuning_step(n_tokens: usize, positions: usize, cache_blocks: usize) -> Result<Vec<u32>, CudaError> {
    let blocks_per_seq = positions.div_ceil(KV_BLOCK_SIZE);
    let tables: Vec<Vec<u32>> = (0..n_tokens).map(|t| (0..blocks_per_seq).map(|b| ((t * blocks_per_seq + b) % cache_blocks) as u32).collect()).collect();
    let token = [0u32];
    let seqs: Vec<SeqStep> =
        tables.iter().map(|blocks| SeqStep { tokens: &token, pos0: positions - 1, blocks, logits: LogitRows::None, sample: None }).collect();
    let cap = StepCapacity { tokens: n_tokens, seqs: n_tokens, blocks: n_tokens * blocks_per_seq, logit_rows: 0, history: 0 };
    let mut flat = FlatPlan::default();
    flat.fill(&BatchPlan { seqs: &seqs }, &cap, cache_blocks).map_err(|e| invalid(format!("tuning step: {e}")))?;
    let layout = PlanLayout::new(cap);
    let mut words = vec![0u32; layout.words];
    layout.write(&flat, &mut words);
    Ok(words)
}

impl State {
    /// The split count of this grid: fixed on first sight and never changed, since captured
    /// graphs bake it in. The count an earlier run timed, where saved; else, uncaptured, the
    /// candidates are timed on a synthetic step of long-context sequences through the caller's
    /// caches and q (`out` is overwritten; the caller's own launch follows); inside a capture
    /// the one-wave estimate is fixed untimed.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn choose(
        &mut self,
        device: &CudaDevice,
        kernels: &Kernels,
        inputs: AttentionInputs,
        out: &mut CudaSlice<f32>,
        n_tokens: usize,
        p: &PagedAttentionParams,
        capturing: bool,
    ) -> Result<usize, CudaError> {
        let grid = GridKey::of(n_tokens, p);
        if let Some(choice) = self.choices.get(&grid) {
            return Ok(choice.n_splits);
        }
        let resident_blocks = kernels.split_for(n_tokens, p).resident_blocks;
        let estimate = PagedAttention::splits_for(resident_blocks, n_tokens, p);
        // Only blocks with memory behind them: the synthetic step's tables wrap within those.
        let cache_blocks = p.rows.min(inputs.kv.usable_rows) / KV_BLOCK_SIZE;
        let candidates = PagedAttention::candidates(resident_blocks, n_tokens, p);
        let choice = if let Some(n_splits) = TUNED_SPLITS.get(device, &grid) {
            SplitChoice { n_splits, timings: Vec::new(), timed_positions: 0 }
        } else if capturing || cache_blocks == 0 || candidates.len() < 2 {
            SplitChoice { n_splits: estimate, timings: Vec::new(), timed_positions: 0 }
        } else {
            let positions = p.max_span().min(TUNE_POSITIONS).min((TUNE_MAX_ROWS / n_tokens).max(min_chunk(&Key::of(p)) * 16));
            let step = device.upload(&tuning_step(n_tokens, positions, cache_blocks)?, "paged attention tuning step")?;
            let timed = AttentionInputs { step: &step, prologue: None, ..inputs };
            let most = candidates.iter().map(|&n| workspace_len(n_tokens, p, n)).max().unwrap_or(2);
            let workspace = self.workspace(device, most, n_tokens * p.n_kv_heads, false)?;
            let ctx = device.context();
            let event = || ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(CudaError::driver("creating a timing event"));
            let (start, end) = (event()?, event()?);
            let mut timings = Vec::with_capacity(candidates.len());
            for &n in &candidates {
                // One warm-up launch, then TUNE_ROUNDS timed ones.
                let launch = SplitLaunch { n_tokens, n_splits: n, quantized: None };
                launch_split(device, kernels, (&mut *workspace.0, &mut *workspace.1), timed, out, p, launch)?;
                start.record(device.stream()).map_err(CudaError::driver("recording a timing event"))?;
                for _ in 0..TUNE_ROUNDS {
                    launch_split(device, kernels, (&mut *workspace.0, &mut *workspace.1), timed, out, p, launch)?;
                }
                end.record(device.stream()).map_err(CudaError::driver("recording a timing event"))?;
                end.synchronize().map_err(CudaError::driver("timing the split candidates"))?;
                let ms = start.elapsed_ms(&end).map_err(CudaError::driver("reading a timing event"))?;
                timings.push((n, f64::from(ms) / TUNE_ROUNDS as f64));
            }
            let best = timings.iter().map(|&(_, ms)| ms).fold(f64::INFINITY, f64::min);
            let n_splits = timings.iter().find(|&&(_, ms)| ms <= best * TUNE_SLACK).map_or(estimate, |&(n, _)| n);
            tracing::debug!(?grid, positions, ?timings, n_splits, "decode attention splits timed (ms per call)");
            TUNED_SPLITS.insert(device, grid, n_splits);
            SplitChoice { n_splits, timings, timed_positions: positions }
        };
        let n_splits = choice.n_splits;
        self.choices.insert(grid, choice);
        Ok(n_splits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::paged_attention::tests::params;
    use crate::plan_words::word;

    #[test]
    fn splits_fill_one_wave_within_the_caps() {
        let p = params();
        assert_eq!(PagedAttention::splits_for(1056, 1, &p), 132, "one wave of 1056 blocks over 8 kv heads");
        assert_eq!(PagedAttention::splits_for(1056, 1, &PagedAttentionParams { max_seq_len: 32768, ..p }), 132);
        assert_eq!(PagedAttention::splits_for(1056, 64, &p), 2);
        assert_eq!(PagedAttention::splits_for(1056, 512, &p), 1);
        assert_eq!(PagedAttention::splits_for(100_000, 1, &PagedAttentionParams { max_seq_len: 1 << 20, ..p }), DEC_MAX_SPLITS);
        assert_eq!(PagedAttention::splits_for(1056, 1, &PagedAttentionParams { max_seq_len: 100, ..p }), 4, "100 positions feed 4 chunks of 32");
        // A sliding window of 8 touches at most two KV blocks, however long the sequence.
        assert_eq!(PagedAttention::splits_for(1056, 1, &PagedAttentionParams { window: Some(8), ..p }), 2);
    }

    #[test]
    fn split_candidates_span_half_a_wave_to_four_waves_within_the_caps() {
        let p = params();
        assert_eq!(PagedAttention::candidates(1056, 1, &p), vec![66, 132, 256], "8192 positions feed at most 256 chunks");
        assert_eq!(PagedAttention::candidates(528, 1, &p), vec![33, 66, 132, 198, 256]);
        assert_eq!(PagedAttention::candidates(528, 64, &p), vec![1, 2, 3, 4]);
        assert_eq!(PagedAttention::candidates(1056, 1, &PagedAttentionParams { max_seq_len: 100, ..p }), vec![4]);
    }

    #[test]
    fn tuning_steps_give_each_token_its_own_blocks() {
        let words = tuning_step(2, 100, 5).expect("valid step");
        assert!(words.len() > word::HEADER_WORDS);
    }
}
