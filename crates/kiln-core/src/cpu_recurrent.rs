//! The CPU backend's Gated DeltaNet ops (Qwen3.5): the causal convolution and the delta rule,
//! each sequence's tokens in order from the state it left. The delta rule runs token by token
//! for decode and in chunks (`cpu_delta_chunk`) for the spans of a prompt.

use std::ops::Range;

use rayon::prelude::*;

use crate::backend::{BackendError, DeltaNetParams, Result, StateSlots};
use crate::cpu::{check_len, dot_f32, with_scratch, SharedOut};
use crate::cpu_delta_chunk;
use crate::cpu_simd::Simd;
use crate::plan::FlatPlan;
use crate::shapes;
use crate::tensor::{Tensor, TensorMut};

/// The state slot of each of the plan's sequences, checked against the state buffer.
fn slot(slots: &[f32], s: usize, state_len: usize, per_slot: usize) -> Result<usize> {
    let v = *slots.get(s).ok_or_else(|| BackendError::Device(format!("no state slot for sequence {s}")))?;
    let ok = v >= 0.0 && v.fract() == 0.0 && (v as usize + 1) * per_slot <= state_len;
    ok.then_some(v as usize).ok_or_else(|| BackendError::Device(format!("state slot {v} is outside the state buffer")))
}

/// Slots of every sequence of the plan, distinct, each checked.
fn checked_slots(plan: &FlatPlan, slots: &[f32], state_len: usize, per_slot: usize) -> Result<()> {
    for s in 0..plan.seqs.len() {
        let a = slot(slots, s, state_len, per_slot)?;
        if (0..s).any(|r| slots[r] as usize == a) {
            return Err(BackendError::BadPlan(format!("two sequences of the step share state slot {a}")));
        }
    }
    Ok(())
}

pub(crate) fn ssm_conv(
    x: Tensor<Vec<f32>>,
    weight: Tensor<Vec<f32>>,
    state: StateSlots<Vec<f32>>,
    mut out: TensorMut<Vec<f32>>,
    plan: &FlatPlan,
    p: &DeltaNetParams,
) -> Result<()> {
    let (c, k) = (p.conv_dim(), p.conv_kernel);
    if k == 0 {
        return Err(BackendError::Device("ssm_conv: kernel of 0 taps".into()));
    }
    let StateSlots { mut state, slots } = state;
    let n = shapes::ssm_conv(x.shape(), weight.shape(), state.shape(), out.shape(), p)?;
    let (x, weight, state, slots, out) = (x.data(), weight.data(), state.data_mut(), slots.data(), out.data_mut());
    check_len("ssm_conv tokens in the step", plan.n_tokens(), n)?;
    checked_slots(plan, slots, state.len(), p.conv_state())?;
    for (s, seq) in plan.seqs.iter().enumerate() {
        let at = slot(slots, s, state.len(), p.conv_state())? * p.conv_state();
        let st = &mut state[at..at + p.conv_state()];
        if seq.pos0 == 0 {
            st.fill(0.0);
        }
        for t in seq.first_token as usize..(seq.first_token + seq.n_tokens) as usize {
            for ch in 0..c {
                let w = &weight[ch * k..(ch + 1) * k];
                // Taps 0..k-1 read the state (oldest first), the last one this token.
                let mut y = w[k - 1] * x[t * c + ch];
                for (j, wj) in w[..k - 1].iter().enumerate() {
                    y += wj * st[j * c + ch];
                }
                out[t * c + ch] = y / (1.0 + (-y).exp());
            }
            if k > 1 {
                st.copy_within(c.., 0);
                st[(k - 2) * c..].copy_from_slice(&x[t * c..(t + 1) * c]);
            }
        }
    }
    Ok(())
}

/// `v / sqrt(sum v² + 1e-6)` (transformers' `l2norm`), times `scale`, into `out`.
fn l2_normed(v: &[f32], scale: f32, out: &mut [f32]) {
    let inv = 1.0 / (dot_f32(v, v) + 1e-6).sqrt() * scale;
    for (o, x) in out.iter_mut().zip(v) {
        *o = x * inv;
    }
}

/// Spans of at least this many tokens take the chunked form; a single token (decode) takes the
/// recurrence, which is also the reference. Already at two tokens the chunked form is the faster
/// (measured 7x at head_dim 128: it reads the state in register tiles twice per chunk instead of
/// four times per token, the last in strided columns).
pub(crate) const CHUNKED_FROM: usize = 2;

/// One value head of one sequence's span of the step: its inputs in the step's buffers and
/// where its outputs go.
pub(crate) struct HeadSpan<'a> {
    pub(crate) x: &'a [f32],
    pub(crate) g: &'a [f32],
    pub(crate) beta: &'a [f32],
    pub(crate) out: SharedOut,
    pub(crate) p: &'a DeltaNetParams,
    pub(crate) head: usize,
    /// The span's tokens, rows of the step.
    pub(crate) tokens: Range<usize>,
}

impl HeadSpan<'_> {
    /// Token `t`'s query (L2-normed, scaled by 1/sqrt(head_dim)) and key (L2-normed) for this
    /// head; its key head is `head % n_k_heads`.
    pub(crate) fn query_key(&self, t: usize, q: &mut [f32], k: &mut [f32]) {
        let (d, nk) = (self.p.head_dim, self.p.n_k_heads);
        let (row, kh) = (&self.x[t * self.p.conv_dim()..], self.head % nk);
        l2_normed(&row[kh * d..(kh + 1) * d], 1.0 / (d as f32).sqrt(), q);
        l2_normed(&row[(nk + kh) * d..(nk + kh + 1) * d], 1.0, k);
    }

    pub(crate) fn value(&self, t: usize) -> &[f32] {
        let (d, nk) = (self.p.head_dim, self.p.n_k_heads);
        let at = t * self.p.conv_dim() + (2 * nk + self.head) * d;
        &self.x[at..at + d]
    }

    /// Token `t`'s log decay `g` and write strength `beta`.
    pub(crate) fn gates(&self, t: usize) -> (f32, f32) {
        let i = t * self.p.n_v_heads + self.head;
        (self.g[i], self.beta[i])
    }

    /// Token `t`'s output for this head.
    ///
    /// # Safety
    /// The caller owns this head's outputs (one task per sequence and head) and holds no other
    /// slice of the same row; the output buffer was checked to hold every token of the step.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn out_row(&self, t: usize) -> &mut [f32] {
        let (d, nv) = (self.p.head_dim, self.p.n_v_heads);
        self.out.slice_mut(t * nv * d + self.head * d, d)
    }
}

/// The delta rule token by token, from `state` (`[k index][v index]`, head_dim²) and leaving
/// it there: the reference the chunked form is tested against, and the decode path.
pub(crate) fn recurrence(span: &HeadSpan, state: &mut [f32]) {
    let d = span.p.head_dim;
    with_scratch(3 * d, |scratch| {
        let (q, rest) = scratch.split_at_mut(d);
        let (k, delta) = rest.split_at_mut(d);
        for t in span.tokens.clone() {
            span.query_key(t, q, k);
            let (g, b) = span.gates(t);
            let decay = g.exp();
            // Decay S, then read it with k.
            state.iter_mut().for_each(|e| *e *= decay);
            delta.copy_from_slice(span.value(t));
            for (i, ki) in k.iter().enumerate() {
                for (dj, sij) in delta.iter_mut().zip(&state[i * d..(i + 1) * d]) {
                    *dj -= sij * ki;
                }
            }
            delta.iter_mut().for_each(|e| *e *= b);
            // SAFETY: as `out_row` asks; `o` is the only slice of token t's row here.
            let o = unsafe { span.out_row(t) };
            o.fill(0.0);
            // Each row of S is updated, then read by q while it is at hand: out_j sums its
            // terms in row order, S_ij q_i, the same as a column sum, without striding.
            for ((ki, qi), row) in k.iter().zip(q.iter()).zip(state.chunks_exact_mut(d)) {
                for ((sij, dj), oj) in row.iter_mut().zip(delta.iter()).zip(o.iter_mut()) {
                    *sij += ki * dj;
                    *oj += *sij * qi;
                }
            }
        }
    })
}

/// The tensors of one DeltaNet call: the step's convolved q/k/v rows `x`, its gates `g` and
/// `beta`, the recurrent states (one block per slot) with the step's `slots`, and `out`.
pub(crate) struct DeltaNetIo<'a> {
    pub x: &'a [f32],
    pub g: &'a [f32],
    pub beta: &'a [f32],
    pub state: &'a mut [f32],
    pub slots: &'a [f32],
    pub out: &'a mut [f32],
}

pub(crate) fn delta_net(simd: Simd, io: DeltaNetIo, plan: &FlatPlan, n: usize, p: &DeltaNetParams) -> Result<()> {
    delta_net_from(simd, io, plan, n, p, CHUNKED_FROM)
}

/// [`delta_net`] with spans of at least `chunked_from` tokens in the chunked form, so tests can
/// force either path.
pub(crate) fn delta_net_from(simd: Simd, io: DeltaNetIo, plan: &FlatPlan, n: usize, p: &DeltaNetParams, chunked_from: usize) -> Result<()> {
    let DeltaNetIo { x, g, beta, state, slots, out } = io;
    let (d, nk, nv, c) = (p.head_dim, p.n_k_heads, p.n_v_heads, p.conv_dim());
    if nk == 0 || !nv.is_multiple_of(nk) {
        return Err(BackendError::Device(format!("delta_net: {nv} value heads over {nk} key heads")));
    }
    check_len("delta_net input", x.len(), n * c)?;
    check_len("delta_net gates", g.len().min(beta.len()), n * nv)?;
    check_len("delta_net output", out.len(), n * nv * d)?;
    check_len("delta_net tokens in the step", plan.n_tokens(), n)?;
    checked_slots(plan, slots, state.len(), p.ssm_state())?;
    let (state_ptr, dst) = (SharedOut(state.as_mut_ptr()), SharedOut(out.as_mut_ptr()));
    // One task per (sequence, value head): each owns its state matrix and output columns, and
    // the heads of a long prompt keep every thread busy.
    (0..plan.seqs.len() * nv).into_par_iter().for_each(|job| {
        let (s, head) = (job / nv, job % nv);
        let seq = plan.seqs[s];
        let at = slot(slots, s, usize::MAX, p.ssm_state()).unwrap_or(0) * p.ssm_state() + head * d * d;
        // SAFETY: slots are distinct and in bounds (checked above), so this d x d block is this task's alone.
        let st = unsafe { state_ptr.slice_mut(at, d * d) };
        if seq.pos0 == 0 {
            st.fill(0.0);
        }
        let first = seq.first_token as usize;
        let span = HeadSpan { x, g, beta, out: dst, p, head, tokens: first..first + seq.n_tokens as usize };
        if span.tokens.len() >= chunked_from {
            cpu_delta_chunk::chunked(simd, &span, st, cpu_delta_chunk::CHUNK);
        } else {
            recurrence(&span, st);
        }
    });
    Ok(())
}

pub(crate) fn delta_net_gates(g: &mut [f32], beta: &mut [f32], a_log_neg: &[f32], dt_bias: &[f32], n: usize, n_heads: usize) -> Result<()> {
    check_len("delta_net gates", g.len().min(beta.len()), n * n_heads)?;
    check_len("delta_net A and dt bias", a_log_neg.len().min(dt_bias.len()), n_heads)?;
    for (gr, br) in g[..n * n_heads].chunks_exact_mut(n_heads).zip(beta[..n * n_heads].chunks_exact_mut(n_heads)) {
        for h in 0..n_heads {
            let z = gr[h] + dt_bias[h];
            // softplus, exact where exp(z) would overflow
            let softplus = if z > 20.0 { z } else { z.exp().ln_1p() };
            gr[h] = a_log_neg[h] * softplus;
            br[h] = 1.0 / (1.0 + (-br[h]).exp());
        }
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cpu_simd::tests::values;
    use crate::plan::{BatchPlan, LogitRows, SeqStep, StepCapacity, KV_BLOCK_SIZE};
    use crate::tensor::DeviceBuffer;

    /// A plan of sequences with these (first position, token count), each with the blocks its
    /// positions need.
    pub(crate) fn plan(seqs: &[(usize, usize)]) -> FlatPlan {
        let tokens: Vec<Vec<u32>> = seqs.iter().map(|&(_, n)| vec![1; n]).collect();
        let mut next = 0u32;
        let blocks: Vec<Vec<u32>> = seqs
            .iter()
            .map(|&(pos0, n)| {
                let count = (pos0 + n).div_ceil(KV_BLOCK_SIZE) as u32;
                next += count;
                (next - count..next).collect()
            })
            .collect();
        let steps: Vec<SeqStep> = seqs
            .iter()
            .zip(&tokens)
            .zip(&blocks)
            .map(|((&(pos0, _), t), b)| SeqStep { tokens: t, pos0, blocks: b, logits: LogitRows::None, sample: None })
            .collect();
        let n_tokens = seqs.iter().map(|s| s.1).sum::<usize>();
        let cap = StepCapacity { tokens: n_tokens.max(64), seqs: seqs.len().max(8), blocks: next as usize, logit_rows: 0, history: 0 };
        let mut flat = FlatPlan::default();
        flat.fill(&BatchPlan { seqs: &steps }, &cap, next as usize).unwrap();
        flat
    }

    const P: DeltaNetParams = DeltaNetParams { n_k_heads: 2, n_v_heads: 6, head_dim: 5, conv_kernel: 4 };

    /// The recurrence in float64, token by token from a zero state, for one sequence.
    fn reference(x: &[f32], g: &[f32], beta: &[f32], n: usize, p: &DeltaNetParams) -> Vec<f64> {
        reference_from(x, g, beta, n, p, &vec![0.0; p.ssm_state()]).0
    }

    /// The recurrence in float64 for one sequence's `n` tokens from `init` (every head's state):
    /// the outputs and the final states.
    pub(crate) fn reference_from(x: &[f32], g: &[f32], beta: &[f32], n: usize, p: &DeltaNetParams, init: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let (d, nk, nv, c) = (p.head_dim, p.n_k_heads, p.n_v_heads, p.conv_dim());
        let mut out = vec![0f64; n * nv * d];
        let mut states: Vec<f64> = init[..p.ssm_state()].iter().map(|&e| e as f64).collect();
        let norm = |v: &[f32], scale: f64| {
            let inv = 1.0 / (v.iter().map(|&e| e as f64 * e as f64).sum::<f64>() + 1e-6).sqrt() * scale;
            v.iter().map(|&e| e as f64 * inv).collect::<Vec<f64>>()
        };
        for (h, st) in states.chunks_exact_mut(d * d).enumerate() {
            let kh = h % nk;
            for t in 0..n {
                let row = &x[t * c..(t + 1) * c];
                let q = norm(&row[kh * d..(kh + 1) * d], 1.0 / (d as f64).sqrt());
                let k = norm(&row[(nk + kh) * d..(nk + kh + 1) * d], 1.0);
                let v = &row[(2 * nk + h) * d..(2 * nk + h + 1) * d];
                let decay = (g[t * nv + h] as f64).exp();
                st.iter_mut().for_each(|e| *e *= decay);
                let delta: Vec<f64> = (0..d).map(|j| (v[j] as f64 - (0..d).map(|i| st[i * d + j] * k[i]).sum::<f64>()) * beta[t * nv + h] as f64).collect();
                for i in 0..d {
                    for j in 0..d {
                        st[i * d + j] += k[i] * delta[j];
                    }
                }
                for j in 0..d {
                    out[t * nv * d + h * d + j] = (0..d).map(|i| st[i * d + j] * q[i]).sum();
                }
            }
        }
        (out, states)
    }

    #[test]
    fn recurrence_matches_float64_and_continues_across_steps() {
        let n = 13;
        let x = values(n * P.conv_dim(), 1);
        let g: Vec<f32> = values(n * P.n_v_heads, 2).iter().map(|v| -0.5 * (v + 1.0)).collect();
        let beta: Vec<f32> = values(n * P.n_v_heads, 3).iter().map(|v| 0.5 * (v + 1.0)).collect();
        let want = reference(&x, &g, &beta, n, &P);
        let width = P.n_v_heads * P.head_dim;
        let simd = Simd::best();
        // Token by token (every span below the chunked threshold), then the backend's own path.
        for chunked_from in [usize::MAX, CHUNKED_FROM] {
            let run = |x: &[f32], g: &[f32], beta: &[f32], state: &mut [f32], slot: f32, out: &mut [f32], pos0: usize, len: usize| {
                delta_net_from(simd, DeltaNetIo { x, g, beta, state, slots: &[slot], out }, &plan(&[(pos0, len)]), len, &P, chunked_from)
            };
            // Whole sequence in one step (slot 1), then split 9 + 4 over two steps (slot 0).
            let mut state = vec![f32::NAN; 2 * P.ssm_state()];
            let mut whole = vec![0f32; n * width];
            run(&x, &g, &beta, &mut state, 1.0, &mut whole, 0, n).unwrap();
            let mut split = vec![0f32; n * width];
            let (a, b) = (9, 4);
            run(&x[..a * P.conv_dim()], &g, &beta, &mut state, 0.0, &mut split[..a * width], 0, a).unwrap();
            let mut tail = vec![0f32; b * width];
            let (gt, bt) = (&g[a * P.n_v_heads..], &beta[a * P.n_v_heads..]);
            run(&x[a * P.conv_dim()..], gt, bt, &mut state, 0.0, &mut tail, a, b).unwrap();
            split[a * width..].copy_from_slice(&tail);
            for (i, w) in want.iter().enumerate() {
                for got in [whole[i], split[i]] {
                    assert!((got as f64 - w).abs() < 1e-5 * (1.0 + w.abs()), "value {i}: {got} vs {w}");
                }
            }
            // Token by token, the split changes no rounding; chunks end at other tokens.
            if chunked_from == usize::MAX {
                assert_eq!(whole, split, "a sequence split over two steps equals it in one");
            }
            let err = run(&x, &g, &beta, &mut state, 2.0, &mut whole, 0, n).unwrap_err();
            assert!(err.to_string().contains("state slot 2"), "{err}");
        }
    }

    /// `ssm_conv` of the rows of `x` in state slot `slot` into `out`.
    fn conv(x: &[f32], w: &[f32], state: &mut Vec<f32>, slot: f32, out: &mut [f32], plan: &FlatPlan) {
        let (x, w, slots, mut o) = (x.to_vec(), w.to_vec(), vec![slot], vec![0f32; out.len()]);
        let (n, c, per_slot) = (x.len() / P.conv_dim(), P.conv_dim(), P.conv_state());
        let state = StateSlots { state: state.view_mut([state.len() / per_slot, per_slot]).unwrap(), slots: slots.whole() };
        ssm_conv(x.rows(n, c).unwrap(), w.rows(c, P.conv_kernel).unwrap(), state, o.rows_mut(n, c).unwrap(), plan, &P).unwrap();
        out.copy_from_slice(&o);
    }

    #[test]
    fn convolution_matches_a_scalar_reference_and_keeps_its_state() {
        let (n, c, k) = (7, P.conv_dim(), P.conv_kernel);
        let x = values(n * c, 4);
        let w = values(c * k, 5);
        let mut state = vec![f32::NAN; 2 * P.conv_state()];
        // Two sequences in one step: slot 1 from position 0 (all 7 tokens), slot 0 the same
        // tokens split 3 + 4 over two steps.
        let mut both = vec![0f32; 2 * n * c];
        let xx: Vec<f32> = x.iter().chain(&x).copied().collect();
        conv(&xx[..n * c], &w, &mut state, 1.0, &mut both[..n * c], &plan(&[(0, n)]));
        conv(&x[..3 * c], &w, &mut state, 0.0, &mut both[n * c..(n + 3) * c], &plan(&[(0, 3)]));
        let mut rest = vec![0f32; 4 * c];
        conv(&x[3 * c..], &w, &mut state, 0.0, &mut rest, &plan(&[(3, 4)]));
        both[(n + 3) * c..].copy_from_slice(&rest);
        for t in 0..n {
            for ch in 0..c {
                let y: f64 = (0..k).filter(|&j| t + j + 1 >= k).map(|j| w[ch * k + j] as f64 * x[(t + j + 1 - k) * c + ch] as f64).sum();
                let want = y / (1.0 + (-y).exp());
                assert!((both[t * c + ch] as f64 - want).abs() < 1e-5, "token {t} channel {ch}");
                assert_eq!(both[t * c + ch], both[(n + t) * c + ch], "split steps differ at token {t}");
            }
        }
    }

    #[test]
    fn gates_match_their_formulas() {
        let (n, h) = (3, 4);
        let (mut g, mut b) = (values(n * h, 6).iter().map(|v| v * 30.0).collect::<Vec<_>>(), values(n * h, 7));
        let (g0, b0) = (g.clone(), b.clone());
        let (a, dt) = (values(h, 8), values(h, 9));
        delta_net_gates(&mut g, &mut b, &a, &dt, n, h).unwrap();
        for i in 0..n * h {
            let z = g0[i] as f64 + dt[i % h] as f64;
            let want = a[i % h] as f64 * (1.0 + z.exp()).ln();
            assert!((g[i] as f64 - want).abs() < 1e-5 * (1.0 + want.abs()), "{i}: {} vs {want}", g[i]);
            assert!((b[i] as f64 - 1.0 / (1.0 + (-(b0[i] as f64)).exp())).abs() < 1e-6);
        }
    }
}
