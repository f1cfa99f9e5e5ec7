//! The CPU backend's Gated DeltaNet ops (Qwen3.5): the causal convolution and the delta-rule
//! recurrence, each sequence's tokens in order from the state it left, one token at a time.

use rayon::prelude::*;

use crate::backend::{BackendError, DeltaNetParams, Result};
use crate::cpu::{check_len, dot_f32, with_scratch, SharedOut};
use crate::plan::FlatPlan;

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

#[allow(clippy::too_many_arguments)]
pub(crate) fn ssm_conv(
    x: &[f32],
    weight: &[f32],
    state: &mut [f32],
    slots: &[f32],
    out: &mut [f32],
    plan: &FlatPlan,
    n: usize,
    p: &DeltaNetParams,
) -> Result<()> {
    let (c, k) = (p.conv_dim(), p.conv_kernel);
    if k == 0 {
        return Err(BackendError::Device("ssm_conv: kernel of 0 taps".into()));
    }
    check_len("ssm_conv input", x.len().min(out.len()), n * c)?;
    check_len("ssm_conv weight", weight.len(), c * k)?;
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

#[allow(clippy::too_many_arguments)]
pub(crate) fn delta_net(
    x: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    slots: &[f32],
    out: &mut [f32],
    plan: &FlatPlan,
    n: usize,
    p: &DeltaNetParams,
) -> Result<()> {
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
    let q_scale = 1.0 / (d as f32).sqrt();
    // One task per (sequence, value head): each owns its state matrix and output columns.
    (0..plan.seqs.len() * nv).into_par_iter().for_each(|job| {
        let (s, h) = (job / nv, job % nv);
        let seq = plan.seqs[s];
        let at = slot(slots, s, usize::MAX, p.ssm_state()).unwrap_or(0) * p.ssm_state() + h * d * d;
        // SAFETY: slots are distinct and in bounds (checked above), so this d x d block is this task's alone.
        let st = unsafe { state_ptr.slice_mut(at, d * d) };
        if seq.pos0 == 0 {
            st.fill(0.0);
        }
        let kh = h % nk;
        with_scratch(3 * d, |scratch| {
            let (q, rest) = scratch.split_at_mut(d);
            let (k, delta) = rest.split_at_mut(d);
            for t in seq.first_token as usize..(seq.first_token + seq.n_tokens) as usize {
                let row = &x[t * c..(t + 1) * c];
                l2_normed(&row[kh * d..(kh + 1) * d], q_scale, q);
                l2_normed(&row[(nk + kh) * d..(nk + kh + 1) * d], 1.0, k);
                let v = &row[(2 * nk + h) * d..(2 * nk + h + 1) * d];
                let (decay, b) = (g[t * nv + h].exp(), beta[t * nv + h]);
                // S is [k index i][v index j]: decay it, then read it with k.
                st.iter_mut().for_each(|e| *e *= decay);
                delta.copy_from_slice(v);
                for (i, ki) in k.iter().enumerate() {
                    for (dj, sij) in delta.iter_mut().zip(&st[i * d..(i + 1) * d]) {
                        *dj -= sij * ki;
                    }
                }
                delta.iter_mut().for_each(|e| *e *= b);
                for (i, ki) in k.iter().enumerate() {
                    for (sij, dj) in st[i * d..(i + 1) * d].iter_mut().zip(delta.iter()) {
                        *sij += ki * dj;
                    }
                }
                for j in 0..d {
                    let o: f32 = (0..d).map(|i| st[i * d + j] * q[i]).sum();
                    // SAFETY: token t, head h's output columns belong to this task; bounds checked above.
                    unsafe { dst.write(t * nv * d + h * d + j, o) };
                }
            }
        })
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
mod tests {
    use super::*;
    use crate::cpu_simd::tests::values;
    use crate::plan::{BatchPlan, LogitRows, SeqStep, StepCapacity};

    /// A plan of sequences with these (first position, token count), one block each.
    fn plan(seqs: &[(usize, usize)]) -> FlatPlan {
        let tokens: Vec<Vec<u32>> = seqs.iter().map(|&(_, n)| vec![1; n]).collect();
        let blocks: Vec<[u32; 1]> = (0..seqs.len() as u32).map(|b| [b]).collect();
        let steps: Vec<SeqStep> = seqs
            .iter()
            .zip(&tokens)
            .zip(&blocks)
            .map(|((&(pos0, _), t), b)| SeqStep { tokens: t, pos0, blocks: b, logits: LogitRows::None, sample: None })
            .collect();
        let cap = StepCapacity { tokens: 64, seqs: 8, blocks: 8, logit_rows: 0, history: 0 };
        let mut flat = FlatPlan::default();
        flat.fill(&BatchPlan { seqs: &steps }, &cap, 8).unwrap();
        flat
    }

    const P: DeltaNetParams = DeltaNetParams { n_k_heads: 2, n_v_heads: 6, head_dim: 5, conv_kernel: 4 };

    /// The recurrence in float64, token by token from a zero state, for one sequence.
    fn reference(x: &[f32], g: &[f32], beta: &[f32], n: usize, p: &DeltaNetParams) -> Vec<f64> {
        let (d, nk, nv, c) = (p.head_dim, p.n_k_heads, p.n_v_heads, p.conv_dim());
        let mut out = vec![0f64; n * nv * d];
        let norm = |v: &[f32], scale: f64| {
            let inv = 1.0 / (v.iter().map(|&e| e as f64 * e as f64).sum::<f64>() + 1e-6).sqrt() * scale;
            v.iter().map(|&e| e as f64 * inv).collect::<Vec<f64>>()
        };
        for h in 0..nv {
            let mut st = vec![0f64; d * d];
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
        out
    }

    #[test]
    fn recurrence_matches_float64_and_continues_across_steps() {
        let n = 13;
        let x = values(n * P.conv_dim(), 1);
        let g: Vec<f32> = values(n * P.n_v_heads, 2).iter().map(|v| -0.5 * (v + 1.0)).collect();
        let beta: Vec<f32> = values(n * P.n_v_heads, 3).iter().map(|v| 0.5 * (v + 1.0)).collect();
        let want = reference(&x, &g, &beta, n, &P);
        let width = P.n_v_heads * P.head_dim;
        // Whole sequence in one step (slot 1), then split 9 + 4 over two steps (slot 0).
        let mut state = vec![f32::NAN; 2 * P.ssm_state()];
        let mut whole = vec![0f32; n * width];
        delta_net(&x, &g, &beta, &mut state, &[1.0], &mut whole, &plan(&[(0, n)]), n, &P).unwrap();
        let mut split = vec![0f32; n * width];
        let (a, b) = (9, 4);
        delta_net(&x[..a * P.conv_dim()], &g, &beta, &mut state, &[0.0], &mut split[..a * width], &plan(&[(0, a)]), a, &P).unwrap();
        let mut tail = vec![0f32; b * width];
        let (gt, bt) = (&g[a * P.n_v_heads..], &beta[a * P.n_v_heads..]);
        delta_net(&x[a * P.conv_dim()..], gt, bt, &mut state, &[0.0], &mut tail, &plan(&[(a, b)]), b, &P).unwrap();
        split[a * width..].copy_from_slice(&tail);
        for (i, w) in want.iter().enumerate() {
            assert!((whole[i] as f64 - w).abs() < 1e-5 * (1.0 + w.abs()), "value {i}: {} vs {w}", whole[i]);
        }
        assert_eq!(whole, split, "a sequence split over two steps equals it in one");
        let err = delta_net(&x, &g, &beta, &mut state, &[2.0], &mut whole, &plan(&[(0, n)]), n, &P).unwrap_err();
        assert!(err.to_string().contains("state slot 2"), "{err}");
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
        ssm_conv(&xx[..n * c], &w, &mut state, &[1.0], &mut both[..n * c], &plan(&[(0, n)]), n, &P).unwrap();
        ssm_conv(&x[..3 * c], &w, &mut state, &[0.0], &mut both[n * c..(n + 3) * c], &plan(&[(0, 3)]), 3, &P).unwrap();
        let mut rest = vec![0f32; 4 * c];
        ssm_conv(&x[3 * c..], &w, &mut state, &[0.0], &mut rest, &plan(&[(3, 4)]), 4, &P).unwrap();
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
