//! Launch shapes of the quantized mat-vec (kernels/matvec.cuh) and their choice by measurement.
//!
//! A shape is the rows each warp computes (ROWS_PER_WARP: activation reuse), the tiles whose
//! weight loads one warp issues before decoding any (MV_BATCH: bytes in flight), the warps
//! sharing a row (MV_SPLIT) and the warps of a block (MV_WARPS: rows a block owns). Which is best
//! depends on the token count, the format and the weight's shape, so, like the mat-mat's block
//! shape, it is measured: the first uncaptured product of a (device, rows, cols, format, SwiGLU,
//! tokens) key times every candidate on the real weight and input and keeps the fastest, counting
//! a shape that also stores the next product's input as faster by the launch it saves. Inside a
//! graph capture nothing is timed: the remembered choice (of this process or, saved on disk, of an
//! earlier run: tuning.rs), else the default for the count.

use super::kernels::prepare_kernels;
use super::matmat::{fastest_with_credit, gpu_key, is_capturing};
use super::{GpuWeight, Kernel, MAX_MATVEC_TOKENS, MV_WARPS};
use crate::tuning::TuningTable;
use crate::{CudaDevice, CudaError};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct MatvecShape {
    pub(super) rows_per_warp: u32,
    pub(super) batch: u32,
    /// Warps sharing one group of rows (MV_SPLIT), each taking every `split`-th step.
    pub(super) split: u32,
    /// Warps of a block (MV_WARPS).
    pub(super) warps: u32,
    /// A shape only the grouped formats' loop takes (`grouped_only`).
    grouped: bool,
}

const fn shape(rows_per_warp: u32, batch: u32) -> MatvecShape {
    MatvecShape { rows_per_warp, batch, split: 1, warps: MV_WARPS, grouped: false }
}

const fn split_shape(rows_per_warp: u32, batch: u32, split: u32) -> MatvecShape {
    MatvecShape { rows_per_warp, batch, split, warps: MV_WARPS, grouped: false }
}

/// A split shape in a block of 16 warps: each warp works as in `split_shape`, but a block holds
/// four times the rows, enough whole 16-row chunks to quantize its own output (`stores_next`).
const fn wide_split_shape(rows_per_warp: u32, batch: u32, split: u32) -> MatvecShape {
    MatvecShape { rows_per_warp, batch, split, warps: 16, grouped: false }
}

/// A shape of the grouped formats only: a 1- or 2-bit row is few 16-byte groups a lane (a
/// 12288-value 1-bit row three lane-steps), so their tall products split one step a warp.
const fn grouped_shape(rows_per_warp: u32, split: u32, warps: u32) -> MatvecShape {
    MatvecShape { rows_per_warp, batch: 1, split, warps, grouped: true }
}

/// Every shape the kernels are built for (`// kiln-test-defines:` lines of matvec_kquant.cu).
/// The split ones and those of 8 or 16 rows a warp are candidates for one token only, 16 rows
/// and the splits of one step a warp for the grouped formats only (`candidates`).
pub(super) const MATVEC_SHAPES: [MatvecShape; 16] = [
    shape(1, 4),
    shape(1, 8),
    shape(2, 2),
    shape(2, 4),
    shape(4, 1),
    shape(4, 2),
    split_shape(4, 2, 4),
    split_shape(2, 4, 4),
    shape(8, 1),
    shape(8, 2),
    grouped_shape(16, 1, MV_WARPS),
    wide_split_shape(4, 2, 4),
    wide_split_shape(4, 2, 2),
    grouped_shape(4, 4, MV_WARPS),
    grouped_shape(4, 4, 16),
    grouped_shape(8, 4, 16),
];

/// The shapes measured for `ntok` tokens of `w`. One token has the fewest loads in flight per
/// warp: its candidates add warps that share a long row (split) and 8 rows a warp (a short row
/// of a 1- or 2-bit format is one 16-byte load per lane, so rows are what a warp can batch);
/// the grouped formats also 16 rows a warp, which the others' registers do not allow.
pub(super) fn candidates(ntok: usize, w: &GpuWeight) -> impl Iterator<Item = usize> + Clone {
    candidate_shapes(ntok, w.is_grouped())
}

fn candidate_shapes(ntok: usize, grouped: bool) -> impl Iterator<Item = usize> + Clone {
    (0..MATVEC_SHAPES.len()).filter(move |&i| MATVEC_SHAPES[i].fits(ntok, grouped))
}

/// The shape used before (or without) measurement: one row per warp for one token, two for
/// two or three, four beyond, with four rows' worth of tiles in flight.
pub(super) fn default_shape(ntok: usize) -> usize {
    match ntok {
        1 => 0,
        2 | 3 => 2,
        _ => 4,
    }
}

/// What one mat-vec launch computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum MatvecKind {
    /// One weight's product (or its sum into the output).
    Plain,
    /// silu(x Wg) * (x Wu) of a gate and an up weight of one shape.
    SwiGlu,
    /// Up to three weights of one format and width on one input (`matvec_stacked`).
    Stacked,
    /// Each slot's chosen expert on its input row (`matvec_experts`, one token per slot).
    Experts,
    /// Groups of up to NTOK slots of one expert on their gathered rows (`matvec_expert_groups`).
    ExpertGroups,
    /// `Experts` of a gate and an up set with the SwiGLU epilogue (`matvec_experts_gated`).
    ExpertsGated,
}

impl MatvecKind {
    pub(super) const COUNT: usize = 6;

    pub(super) fn index(self) -> usize {
        self as usize
    }

    /// The kernel name's part after `matvec_`.
    pub(super) fn prefix(self) -> &'static str {
        match self {
            MatvecKind::Plain => "",
            MatvecKind::SwiGlu => "swiglu_",
            MatvecKind::Stacked => "stacked_",
            MatvecKind::Experts => "experts_",
            MatvecKind::ExpertGroups => "expert_groups_",
            MatvecKind::ExpertsGated => "experts_gated_",
        }
    }
}

impl MatvecShape {
    /// Shapes the kernels take only for one token (finish_rows' warp reduction caps rows x tokens).
    pub(super) fn one_token_only(self) -> bool {
        self.split > 1 || self.rows_per_warp > 4
    }

    /// Shapes only the grouped formats' loop takes: its raw weights are one 16-byte group a row.
    pub(super) fn grouped_only(self) -> bool {
        self.grouped
    }

    /// Whether this shape may run `ntok` tokens of a weight, grouped or not.
    pub(super) fn fits(self, ntok: usize, grouped: bool) -> bool {
        (ntok == 1 || !self.one_token_only()) && (grouped || !self.grouped_only())
    }

    /// Rows a block computes.
    pub(super) fn rows_per_block(self, kind: MatvecKind) -> u32 {
        self.warps / self.split * self.rows(kind)
    }

    /// Threads of a block.
    pub(super) fn threads(self) -> u32 {
        self.warps * 32
    }

    /// Rows a warp computes; the fused SwiGLU reads two weights, so half as many.
    pub(super) fn rows(self, kind: MatvecKind) -> u32 {
        match kind {
            MatvecKind::SwiGlu | MatvecKind::ExpertsGated => (self.rows_per_warp / 2).max(1),
            MatvecKind::Plain | MatvecKind::Stacked | MatvecKind::Experts | MatvecKind::ExpertGroups => self.rows_per_warp,
        }
    }
}

/// What a measured shape is remembered by: a stacked launch by the sum of its weights' rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct TuneKey {
    device: usize,
    rows: usize,
    cols: usize,
    ty: u32,
    kind: MatvecKind,
    ntok: usize,
    /// Whether the launch also stores the next product's input where its shape allows.
    storing: bool,
    /// Slots of an expert product (one input row each, so `ntok` is 1); 0 for the others.
    slots: usize,
}

impl TuneKey {
    pub(super) fn new(device: &CudaDevice, w: &GpuWeight, ntok: usize, kind: MatvecKind) -> TuneKey {
        TuneKey { device: gpu_key(device), rows: w.rows, cols: w.cols, ty: w.ty.id(), kind, ntok, storing: false, slots: 0 }
    }

    /// The key of an expert product of `slots` (token, expert) pairs over experts shaped as `w`.
    pub(super) fn experts(device: &CudaDevice, w: &GpuWeight, kind: MatvecKind, slots: usize) -> TuneKey {
        TuneKey { slots, ..TuneKey::new(device, w, 1, kind) }
    }

    /// The key of a launch that does (or does not) store the next product's input.
    pub(super) fn storing(self, storing: bool) -> TuneKey {
        TuneKey { storing, ..self }
    }

    /// The key of `weights` stacked in one launch (same format and width).
    pub(super) fn stacked(device: &CudaDevice, weights: &[&GpuWeight], ntok: usize) -> TuneKey {
        TuneKey { rows: weights.iter().map(|w| w.rows).sum(), ..TuneKey::new(device, weights[0], ntok, MatvecKind::Stacked) }
    }
}

/// Measured shapes, as indices into `MATVEC_SHAPES`.
static TUNED: TuningTable<TuneKey, usize> = TuningTable::new("mat-vec shapes", |&shape| shape < MATVEC_SHAPES.len());

/// The shape for `key`'s launch: remembered, else (outside a capture) measured by timing
/// `launch(shape)` for each candidate, less `credit(shape)` ms for the work a shape saves
/// elsewhere, else the default. `launch` must be repeatable (it writes a scratch output, not
/// the caller's accumulating one).
pub(super) fn choose_shape(
    device: &CudaDevice,
    key: TuneKey,
    w: &GpuWeight,
    credit: impl Fn(usize) -> f32,
    launch: impl FnMut(usize) -> Result<(), CudaError>,
) -> Result<usize, CudaError> {
    debug_assert!((1..=MAX_MATVEC_TOKENS).contains(&key.ntok));
    if let Some(shape) = TUNED.get(device, &key) {
        return Ok(shape);
    }
    if is_capturing(device) {
        return Ok(default_shape(key.ntok));
    }
    let candidates: Vec<usize> = candidates(key.ntok, w).collect();
    // Every kind of product of a shape comes from the same module.
    prepare_kernels(device, w, candidates.iter().map(|&shape| Kernel::Matvec { ntok: key.ntok, kind: MatvecKind::Plain, shape }))?;
    let best = fastest_with_credit(device, "mat-vec shapes", &candidates, credit, launch)?;
    tracing::debug!(?key, shape = ?MATVEC_SHAPES[best], "mat-vec launch shape measured");
    TUNED.insert(device, key, best);
    Ok(best)
}

/// The shape `matmul` uses for `n` tokens of `w`: the measured one once a product ran, else
/// the default.
pub fn matvec_shape(device: &CudaDevice, w: &GpuWeight, n: usize, swiglu: bool) -> (u32, u32) {
    let key = TuneKey::new(device, w, n, if swiglu { MatvecKind::SwiGlu } else { MatvecKind::Plain });
    let index = TUNED.get(device, &key).unwrap_or_else(|| default_shape(n));
    let s = MATVEC_SHAPES[index];
    (s.rows_per_warp, s.batch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_fit_the_kernels_limits() {
        for s in MATVEC_SHAPES {
            assert!([1, 2, 4, 8, 16].contains(&s.rows_per_warp) && (1..=8).contains(&s.batch) && [1, 2, 4].contains(&s.split), "{s:?}");
            // matvec.cuh's static_assert on MV_WARPS; a split divides the block's warps.
            assert!([MV_WARPS, 16].contains(&s.warps) && s.warps % s.split == 0, "{s:?}");
            assert!(!s.grouped_only() || s.one_token_only(), "{s:?}");
            let most_tokens = if s.one_token_only() { 1 } else { MAX_MATVEC_TOKENS as u32 };
            for ntok in 1..=most_tokens {
                // finish_rows reduces ROWS_PER_WARP * NTOK values (x2 for SwiGLU) in one warp.
                let (plain, swiglu) = (s.rows(MatvecKind::Plain), s.rows(MatvecKind::SwiGlu));
                assert!(plain * ntok <= 32 && 2 * (swiglu * ntok).next_power_of_two() <= 32, "{s:?} ntok {ntok}");
            }
        }
        assert_eq!([1, 2, 3, 4, 8].map(|n| MATVEC_SHAPES[default_shape(n)].rows_per_warp), [1, 2, 2, 4, 4]);
    }

    /// Every format has a one-token shape whose blocks hold whole 16-row chunks for each kind
    /// of product that stores the next input (the plain residual product, the SwiGLU), so the
    /// tuner always has a storing candidate to weigh.
    #[test]
    fn one_token_candidates_include_storing_shapes_for_every_kind() {
        for grouped in [false, true] {
            for kind in [MatvecKind::Plain, MatvecKind::SwiGlu] {
                let storing = candidate_shapes(1, grouped).filter(|&i| MATVEC_SHAPES[i].rows_per_block(kind) % 16 == 0).count();
                assert!(storing > 0, "{kind:?}, grouped {grouped}: no candidate holds whole 16-row chunks a block");
            }
        }
    }

    #[test]
    fn sixteen_rows_are_a_one_token_candidate_of_the_grouped_formats_only() {
        let sixteen = MATVEC_SHAPES.iter().position(|s| s.rows_per_warp == 16).expect("a 16-row shape");
        assert!(candidate_shapes(1, true).any(|s| s == sixteen));
        assert!(!candidate_shapes(1, false).any(|s| s == sixteen));
        let grouped_only = MATVEC_SHAPES.iter().filter(|s| s.grouped_only()).count();
        assert_eq!(candidate_shapes(1, false).count(), MATVEC_SHAPES.len() - grouped_only);
        assert!(MATVEC_SHAPES.iter().all(|s| s.grouped_only() || s.rows_per_warp <= 8));
        for ntok in 2..=MAX_MATVEC_TOKENS {
            for grouped in [false, true] {
                let many: Vec<usize> = candidate_shapes(ntok, grouped).collect();
                assert!(!many.is_empty() && many.iter().all(|&s| !MATVEC_SHAPES[s].one_token_only()), "{ntok} tokens: {many:?}");
                assert!(many.contains(&default_shape(ntok)), "{ntok} tokens: the default shape is a candidate");
            }
        }
    }
}
