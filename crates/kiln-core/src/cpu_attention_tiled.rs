//! The CPU backend's prompt attention in query tiles (flash attention's order of work): a job
//! is up to [`TILE_TOKENS`] consecutive tokens of one sequence's span and one KV head, and it
//! walks the positions they see one KV block at a time. Each block's keys and values are
//! widened to f32 once for every query of the tile and of the head's group, and both products
//! (scores = K Qᵀ, outputs += P V) run on the register-tiled f32 mat-mat, so a position costs
//! FMAs rather than one short dot product per query and head. The softmax is online, per
//! query row, over the block's scores.
//!
//! A token's result depends on the tokens of its own tile (which the span alone decides), never
//! on the other sequences of the step; a prompt split over steps differently rounds differently.

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

/// The tile's attention for the query heads of `kv_head` into `out` (`[tokens][heads][hd]`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_tile(simd: Simd, cache: &CpuKvCache, q: &[f32], sinks: Option<&[f32]>, out: SharedOut, plan: &FlatPlan, p: &AttentionParams, tile: Tile, kv_head: usize) {
    let (hd, group) = (p.head_dim, p.n_heads / p.n_kv_heads);
    let q_width = p.n_heads * hd;
    let cols = group * tile.n;
    let pos0 = plan.positions[tile.first] as usize;
    let last = pos0 + tile.n - 1;
    // The first position any query of the tile sees; its block is where the walk starts.
    let start = p.window.map_or(0, |w| (pos0 + 1).saturating_sub(w));
    let b = KV_BLOCK_SIZE;
    let len = hd * cols + 2 * b * hd + 2 * b * cols + cols * hd + 2 * cols + hd + 2;
    with_scratch(len, |scratch| {
        let (qt, rest) = scratch.split_at_mut(hd * cols);
        let (kf, rest) = rest.split_at_mut(b * hd);
        let (vf, rest) = rest.split_at_mut(b * hd);
        let (st, rest) = rest.split_at_mut(b * cols);
        let (pt, rest) = rest.split_at_mut(cols * b);
        let (o, rest) = rest.split_at_mut(cols * hd);
        let (m, rest) = rest.split_at_mut(cols);
        let (l, part) = rest.split_at_mut(cols);
        // Column c = (head in the group) * n + token: the scaled queries, transposed.
        for hl in 0..group {
            for t in 0..tile.n {
                let row = &q[(tile.first + t) * q_width + (kv_head * group + hl) * hd..][..hd];
                for (d, &v) in row.iter().enumerate() {
                    qt[d * cols + hl * tile.n + t] = v * p.scale;
                }
            }
        }
        o.fill(0.0);
        m.fill(f32::NEG_INFINITY);
        l.fill(0.0);
        let mut pos = start - start % b;
        while pos <= last {
            let rows = b.min(last + 1 - pos);
            let row0 = plan.row_of(tile.seq, pos);
            for j in 0..rows {
                widen(simd, cache.k_row(row0 + j, kv_head * hd, hd), &mut kf[j * hd..(j + 1) * hd]);
                widen(simd, cache.v_row(row0 + j, kv_head * hd, hd), &mut vf[j * hd..(j + 1) * hd]);
            }
            st[..rows * cols].fill(0.0);
            simd.matmul_add(rows, cols, hd, kf, hd, qt, cols, st, cols);
            for c in 0..cols {
                let qpos = pos0 + c % tile.n;
                let lo = p.window.map_or(0, |w| (qpos + 1).saturating_sub(w));
                let row = &mut pt[c * b..c * b + rows];
                for (j, v) in row.iter_mut().enumerate() {
                    let at = pos + j;
                    *v = if at <= qpos && at >= lo { st[j * cols + c] } else { f32::NEG_INFINITY };
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
            simd.matmul_add(cols, hd, rows, pt, b, vf, hd, o, hd);
            pos += rows;
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
