//! The CPU backend's paged attention.
//!
//! A job is one token over a run of its positions, for every head at once: the cache rows of
//! a block are adjacent in memory, so a job streams whole rows instead of picking one head's
//! few hundred bytes out of each (which left the kernels waiting on memory). Softmax is
//! online, block by block, so a job's scratch does not grow with the context. Long spans are
//! split into chunks (by the token's own span, so results never depend on the rest of the
//! step) whose partial softmaxes are merged afterwards: that keeps every thread busy in decode
//! steps, which have few tokens.

use std::cell::RefCell;

use rayon::prelude::*;

use crate::backend::{AttentionParams, BackendError, Result};
use crate::cpu::{check_len, with_scratch, CpuKvCache, CpuStep, SharedOut};
use crate::cpu_attention_tiled;
use crate::cpu_simd::Simd;
use crate::plan::KV_BLOCK_SIZE;
use crate::shapes;
use crate::tensor::{Tensor, TensorMut};

/// How many rows ahead, within a block, rows are prefetched.
const PREFETCH_ROWS: usize = 2;
/// Fewest positions worth a chunk of their own (few in tests, so short sequences split too).
const MIN_CHUNK: usize = if cfg!(test) { 8 } else { 256 };
/// Most chunks a token's positions are split into.
const MAX_CHUNKS: usize = 64;
/// Tokens whose chunks are computed and merged together.
const TOKENS_PER_PASS: usize = 64;

thread_local! {
    /// The chunks' partial results of a split attention, on the calling thread.
    static PARTIALS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `sinks` adds one logit per head to every softmax row, without a value.
pub(crate) fn attention(
    simd: Simd,
    q: Tensor<Vec<f32>>,
    cache: &CpuKvCache,
    sinks: Option<Tensor<Vec<f32>>>,
    mut out: TensorMut<Vec<f32>>,
    step: &CpuStep,
    p: &AttentionParams,
) -> Result<()> {
    if p.n_kv_heads == 0 || !p.n_heads.is_multiple_of(p.n_kv_heads) {
        return Err(BackendError::Device(format!("attention: {} query heads over {} KV heads", p.n_heads, p.n_kv_heads)));
    }
    let n = shapes::attention(q.shape(), out.shape(), sinks.map(|s| s.shape()), p)?;
    let (q, sinks, out) = (q.data(), sinks.map(|s| s.data()), out.data_mut());
    let plan = step.plan();
    let (hd, nh) = (p.head_dim, p.n_heads);
    let q_width = nh * hd;
    check_len("attention tokens in the step", plan.n_tokens(), n)?;
    check_len("attention cache width", cache.spec.width, p.n_kv_heads * hd)?;
    plan.check_usable(cache.usable_rows() / KV_BLOCK_SIZE)?;
    plan.check_window(p.window)?;
    // A token's positions are split by its own span alone, never by what else is in the step,
    // so a sequence's result does not depend on the batch it runs in.
    let span_of = |t: usize| {
        let end = plan.positions[t] as usize + 1;
        (end - p.window.map_or(0, |w| end.saturating_sub(w))).max(1)
    };
    // Spans of a few tokens or more (prompts) take the tiled path (cpu_attention_tiled); the
    // rest, none chunks here.
    let tiled = |t: usize| plan.seqs[plan.token_seq[t] as usize].n_tokens as usize >= cpu_attention_tiled::TILE_MIN;
    let chunks_of = |t: usize| if tiled(t) { 0 } else { span_of(t).div_ceil(MIN_CHUNK).clamp(1, MAX_CHUNKS) };
    // A head's partial result: its weighted sum of values, softmax max and sum.
    let part = hd + 2;
    let dst = SharedOut(out.as_mut_ptr());
    PARTIALS.with(|cell| {
        let mut parts = cell.borrow_mut();
        // Tokens go in passes so that the partials stay bounded however long the step.
        for first in (0..n).step_by(TOKENS_PER_PASS) {
            let count = TOKENS_PER_PASS.min(n - first);
            let grid = (first..first + count).map(chunks_of).max().unwrap_or(0);
            if grid > 1 && parts.len() < count * grid * nh * part {
                parts.resize(count * grid * nh * part, 0.0);
            }
            let partials = SharedOut(parts.as_mut_ptr());
            (0..count * grid).into_par_iter().for_each(|job| {
                let (t, c) = (first + job / grid, job % grid);
                let chunks = chunks_of(t);
                if c >= chunks {
                    return;
                }
                let (seq, end) = (plan.token_seq[t] as usize, plan.positions[t] as usize + 1);
                // Positions before the sliding window are masked out.
                let start = end - span_of(t).min(end);
                let len = (end - start).div_ceil(chunks);
                let (a, b) = ((start + c * len).min(end), (start + (c + 1) * len).min(end));
                with_scratch(nh * (KV_BLOCK_SIZE + part), |scratch| {
                    let (scores, rest) = scratch.split_at_mut(nh * KV_BLOCK_SIZE);
                    let acc = &mut rest[..nh * part];
                    for h in acc.chunks_exact_mut(part) {
                        h.fill(0.0);
                        h[hd] = f32::NEG_INFINITY;
                    }
                    let ctx = Ctx { simd, cache, p, q: &q[t * q_width..(t + 1) * q_width] };
                    let mut pos = a;
                    while pos < b {
                        // Positions of one block sit in consecutive rows.
                        let m = (KV_BLOCK_SIZE - pos % KV_BLOCK_SIZE).min(b - pos);
                        ctx.block(plan.row_of(seq, pos), m, scores, acc);
                        pos += m;
                    }
                    for (h, acc) in acc.chunks_exact(part).enumerate() {
                        if chunks == 1 {
                            // SAFETY: the job owns out[t]; bounds checked above.
                            let o = unsafe { dst.slice_mut(t * q_width + h * hd, hd) };
                            finish(&[acc], sinks.map(|s| s[h]), o);
                        } else {
                            // SAFETY: the job owns its chunk's partials of token t; sized above.
                            unsafe { partials.slice_mut((((t - first) * grid + c) * nh + h) * part, part) }.copy_from_slice(acc);
                        }
                    }
                })
            });
            for t in first..first + count {
                let chunks = chunks_of(t);
                if chunks <= 1 {
                    continue;
                }
                for h in 0..nh {
                    let mut pieces = [&[][..]; MAX_CHUNKS];
                    for (c, piece) in pieces[..chunks].iter_mut().enumerate() {
                        *piece = &parts[(((t - first) * grid + c) * nh + h) * part..][..part];
                    }
                    finish(&pieces[..chunks], sinks.map(|s| s[h]), &mut out[t * q_width + h * hd..][..hd]);
                }
            }
        }
    });
    let tiles = cpu_attention_tiled::tiles(plan);
    let ctx = cpu_attention_tiled::TileCtx { simd, cache, q, sinks, out: dst, plan, p };
    (0..tiles.len() * p.n_kv_heads).into_par_iter().for_each(|job| cpu_attention_tiled::run_tile(&ctx, tiles[job / p.n_kv_heads], job % p.n_kv_heads));
    Ok(())
}

/// What every block of a job needs.
struct Ctx<'a> {
    simd: Simd,
    cache: &'a CpuKvCache,
    p: &'a AttentionParams,
    /// The token's queries, all heads.
    q: &'a [f32],
}

impl Ctx<'_> {
    /// Rows `row..row + m` (one block's) into every head's running `[acc, max, sum]`.
    fn block(&self, row: usize, m: usize, scores: &mut [f32], acc: &mut [f32]) {
        let (simd, hd, p) = (self.simd, self.p.head_dim, self.p);
        let (group, width, part) = (p.n_heads / p.n_kv_heads, self.cache.spec.width, hd + 2);
        for i in 0..m {
            if i + PREFETCH_ROWS < m {
                self.cache.k_row(row + i + PREFETCH_ROWS, 0, width).prefetch();
            }
            for (kvh, qs) in self.q.chunks_exact(group * hd).enumerate() {
                let k = self.cache.k_row(row + i, kvh * hd, hd);
                for (g, qv) in qs.chunks_exact(hd).enumerate() {
                    scores[(kvh * group + g) * KV_BLOCK_SIZE + i] = simd.dot_kv(qv, k) * p.scale;
                }
            }
        }
        for (s, a) in scores.chunks_exact_mut(KV_BLOCK_SIZE).zip(acc.chunks_exact_mut(part)) {
            let s = &mut s[..m];
            let (max, sum) = (a[hd], a[hd + 1]);
            let new_max = simd.max(s).max(max);
            if new_max > max {
                // Rescale what came before to the new max (nothing, on the first block).
                let f = (max - new_max).exp();
                a[..hd].iter_mut().for_each(|v| *v *= f);
                a[hd + 1] = sum * f;
                a[hd] = new_max;
            }
            a[hd + 1] += simd.exp_sum(s, a[hd]);
        }
        for i in 0..m {
            if i + PREFETCH_ROWS < m {
                self.cache.v_row(row + i + PREFETCH_ROWS, 0, width).prefetch();
            }
            for kvh in 0..p.n_kv_heads {
                let v = self.cache.v_row(row + i, kvh * hd, hd);
                for h in kvh * group..(kvh + 1) * group {
                    simd.axpy_kv(scores[h * KV_BLOCK_SIZE + i], v, &mut acc[h * part..h * part + hd]);
                }
            }
        }
    }
}

/// One head's output from the partial `[acc, max, sum]` of its chunks and its sink.
pub(crate) fn finish(pieces: &[&[f32]], sink: Option<f32>, out: &mut [f32]) {
    let hd = out.len();
    let max = pieces.iter().map(|c| c[hd]).chain(sink).fold(f32::NEG_INFINITY, f32::max);
    let weight = |c: &[f32]| if c[hd] == f32::NEG_INFINITY { 0.0 } else { (c[hd] - max).exp() };
    let total: f32 = pieces.iter().map(|c| c[hd + 1] * weight(c)).sum::<f32>() + sink.map_or(0.0, |s| (s - max).exp());
    out.fill(0.0);
    for c in pieces {
        let w = weight(c) / total;
        out.iter_mut().zip(&c[..hd]).for_each(|(o, a)| *o += a * w);
    }
}
