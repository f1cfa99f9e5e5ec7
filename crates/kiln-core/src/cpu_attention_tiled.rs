//! The CPU backend's prompt attention in query tiles (flash attention's order of work): a job
//! is up to [`TILE_TOKENS`] consecutive tokens of one sequence's span and one KV head, and it
//! walks the positions they see one KV block at a time. Each block's keys and values are
//! widened to f32 once for every query of the tile and of the head's group, and both products
//! (scores = K Qᵀ, outputs += P V) run on the register-tiled f32 mat-mat, so a position costs
//! FMAs rather than one short dot product per query and head. The softmax is online, per
//! query row, over the block's scores.
//!
//! A token's result does not depend on the other tokens of its tile, nor on the other sequences
//! of the step: the score product always runs on whole 32-column panels (query columns padded
//! with zeros), every block on all 32 of its rows (rows past the tile's last position zeroed and
//! masked), so each value goes through the same instructions in the same order however a
//! prompt is split over steps.

use crate::backend::AttentionParams;
use crate::cpu::{with_scratch, CpuKvCache, SharedOut};
use crate::cpu_attention::finish;
use crate::cpu_simd::{KvRow, Simd};
use crate::plan::{FlatPlan, KV_BLOCK_SIZE};

/// Spans of at least this many tokens take the tiled path; shorter ones (decode) the per-token one.
pub(crate) const TILE_MIN: usize = 4;
/// Query tokens per tile: with a group of two query heads, 64 columns of the score product.
pub(crate) const TILE_TOKENS: usize = 32;

/// One tile: `n` tokens of sequence `seq` from token `first` of the step.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tile {
    pub seq: usize,
    pub first: usize,
    pub n: usize,
}

/// The tiles of every span of the plan that takes the tiled path.
pub(crate) fn tiles(plan: &FlatPlan) -> Vec<Tile> {
    let mut out = Vec::new();
    for (seq, s) in plan.seqs.iter().enumerate() {
        let (first, n) = (s.first_token as usize, s.n_tokens as usize);
        if n >= TILE_MIN {
            out.extend((0..n).step_by(TILE_TOKENS).map(|at| Tile { seq, first: first + at, n: TILE_TOKENS.min(n - at) }));
        }
    }
    out
}

/// `row` as f32 into `out` (every cache type; exact: 1 * x + 0).
fn widen(simd: Simd, row: KvRow, out: &mut [f32]) {
    out.fill(0.0);
    simd.axpy_kv(1.0, row, out);
}

/// What every tile of one attention call reads and where it writes (`out`: `[tokens][heads][hd]`).
pub(crate) struct TileCtx<'a> {
    pub simd: Simd,
    pub cache: &'a CpuKvCache,
    pub q: &'a [f32],
    pub sinks: Option<&'a [f32]>,
    pub out: SharedOut,
    pub plan: &'a FlatPlan,
    pub p: &'a AttentionParams,
}

/// The tile's attention for the query heads of `kv_head`.
pub(crate) fn run_tile(ctx: &TileCtx, tile: Tile, kv_head: usize) {
    let TileCtx { simd, cache, q, sinks, out, plan, p } = *ctx;
    let (hd, group) = (p.head_dim, p.n_heads / p.n_kv_heads);
    let q_width = p.n_heads * hd;
    let cols = group * tile.n;
    // The score product's columns, whole panels of the f32 mat-mat.
    let panel = 32;
    let ld = cols.div_ceil(panel) * panel;
    let pos0 = plan.positions[tile.first] as usize;
    let last = pos0 + tile.n - 1;
    // The first position any query of the tile sees; its block is where the walk starts.
    let start = p.window.map_or(0, |w| (pos0 + 1).saturating_sub(w));
    let b = KV_BLOCK_SIZE;
    let len = hd * ld + 2 * b * hd + b * ld + b * cols + cols * hd + 2 * cols + hd + 2;
    with_scratch(len, |scratch| {
        let (qt, rest) = scratch.split_at_mut(hd * ld);
        let (kf, rest) = rest.split_at_mut(b * hd);
        let (vf, rest) = rest.split_at_mut(b * hd);
        let (st, rest) = rest.split_at_mut(b * ld);
        let (pt, rest) = rest.split_at_mut(cols * b);
        let (o, rest) = rest.split_at_mut(cols * hd);
        let (m, rest) = rest.split_at_mut(cols);
        let (l, part) = rest.split_at_mut(cols);
        // Column c = (head in the group) * n + token: the scaled queries, transposed; zeros past cols.
        qt.fill(0.0);
        for hl in 0..group {
            for t in 0..tile.n {
                let row = &q[(tile.first + t) * q_width + (kv_head * group + hl) * hd..][..hd];
                for (d, &v) in row.iter().enumerate() {
                    qt[d * ld + hl * tile.n + t] = v * p.scale;
                }
            }
        }
        o.fill(0.0);
        m.fill(f32::NEG_INFINITY);
        l.fill(0.0);
        let mut pos = start - start % b;
        while pos <= last {
            // Rows past the tile's last position may hold other data (or none yet): zeros.
            let rows = b.min(last + 1 - pos);
            let row0 = plan.row_of(tile.seq, pos);
            for j in 0..rows {
                widen(simd, cache.k_row(row0 + j, kv_head * hd, hd), &mut kf[j * hd..(j + 1) * hd]);
                widen(simd, cache.v_row(row0 + j, kv_head * hd, hd), &mut vf[j * hd..(j + 1) * hd]);
            }
            kf[rows * hd..].fill(0.0);
            vf[rows * hd..].fill(0.0);
            st.fill(0.0);
            simd.matmul_add(b, ld, hd, kf, hd, qt, ld, st, ld);
            for c in 0..cols {
                let qpos = pos0 + c % tile.n;
                let lo = p.window.map_or(0, |w| (qpos + 1).saturating_sub(w));
                let row = &mut pt[c * b..(c + 1) * b];
                if pos + b <= qpos + 1 && pos >= lo {
                    // The whole block is visible to this query (most blocks of a long context).
                    for (j, v) in row.iter_mut().enumerate() {
                        *v = st[j * ld + c];
                    }
                } else {
                    for (j, v) in row.iter_mut().enumerate() {
                        let at = pos + j;
                        *v = if at <= qpos && at >= lo { st[j * ld + c] } else { f32::NEG_INFINITY };
                    }
                }
                let new_max = simd.max(row).max(m[c]);
                if new_max == f32::NEG_INFINITY {
                    // Nothing visible yet (before the window): no weight, no rescale.
                    row.fill(0.0);
                    continue;
                }
                if new_max > m[c] {
                    let f = (m[c] - new_max).exp();
                    o[c * hd..(c + 1) * hd].iter_mut().for_each(|v| *v *= f);
                    l[c] *= f;
                    m[c] = new_max;
                }
                l[c] += simd.exp_sum(row, m[c]);
            }
            simd.matmul_add(cols, hd, b, pt, b, vf, hd, o, hd);
            pos += b;
        }
        for c in 0..cols {
            let (hl, t) = (c / tile.n, c % tile.n);
            let h = kv_head * group + hl;
            part[..hd].copy_from_slice(&o[c * hd..(c + 1) * hd]);
            part[hd] = m[c];
            part[hd + 1] = l[c];
            // SAFETY: this job owns head h of the tile's tokens; bounds checked by the caller.
            let dst = unsafe { out.slice_mut((tile.first + t) * q_width + h * hd, hd) };
            finish(&[&*part], sinks.map(|s| s[h]), dst);
        }
    })
}
