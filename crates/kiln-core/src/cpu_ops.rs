//! The CPU backend's mixture-of-experts and Gemma ops, over plain slices.

use rayon::prelude::*;

use crate::backend::{BackendError, ExpertInput, Result, RouterParams, WeightSource};
use crate::cpu::{check_len, dot_f32, weight_row, with_scratch, SharedOut};

/// The expert id stored at `ids[i]`, checked against the expert count.
fn expert_id(v: f32, n_experts: usize) -> Result<usize> {
    if v >= 0.0 && v.fract() == 0.0 && (v as usize) < n_experts {
        Ok(v as usize)
    } else {
        Err(BackendError::Device(format!("expert id {v} is not one of the {n_experts} experts")))
    }
}

/// `counts` = (tokens, routed experts, routed experts chosen per token); with a shared expert,
/// each row of `logits` holds its logit after the routed ones and each row of `ids`/`weights`
/// its slot after the chosen.
pub(crate) fn moe_route(
    logits: &[f32],
    expert_scale: Option<&[f32]>,
    ids: &mut [f32],
    weights: &mut [f32],
    (n, e, k): (usize, usize, usize),
    p: &RouterParams,
) -> Result<()> {
    if k == 0 || k > e {
        return Err(BackendError::Device(format!("router: {k} experts chosen of {e}")));
    }
    if let Some(s) = expert_scale {
        check_len("expert scales", s.len(), e)?;
    }
    let shared = usize::from(p.shared_expert);
    let (columns, slots) = (e + shared, k + shared);
    check_len("router logits", logits.len(), n * columns)?;
    check_len("router ids", ids.len().min(weights.len()), n * slots)?;
    for t in 0..n {
        let row = &logits[t * columns..t * columns + e];
        let (ids, weights) = (&mut ids[t * slots..t * slots + k], &mut weights[t * slots..t * slots + k]);
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let total: f32 = row.iter().map(|l| (l - max).exp()).sum();
        for j in 0..k {
            // The largest logit not chosen yet; the lower id wins a tie.
            let mut best = usize::MAX;
            for (i, &l) in row.iter().enumerate() {
                if !ids[..j].contains(&(i as f32)) && (best == usize::MAX || l > row[best]) {
                    best = i;
                }
            }
            ids[j] = best as f32;
            weights[j] = (row[best] - max).exp() / total;
        }
        if p.renormalize {
            let sum: f32 = weights.iter().sum();
            weights.iter_mut().for_each(|w| *w /= sum);
        }
        if let Some(scale) = expert_scale {
            for (w, &id) in weights.iter_mut().zip(ids.iter()) {
                *w *= scale[id as usize];
            }
        }
    }
    if p.shared_expert {
        for t in 0..n {
            ids[t * slots + k] = e as f32;
            weights[t * slots + k] = 1.0 / (1.0 + (-logits[t * columns + e]).exp());
        }
    }
    Ok(())
}

/// Checks the shapes, lengths and expert ids of an expert product.
pub(crate) fn check_moe_args(experts: &[WeightSource], x: &[f32], ids: &[f32], out: &[f32], n: usize, n_used: usize, input: ExpertInput) -> Result<()> {
    let Some(first) = experts.first() else { return Err(BackendError::Device("expert product over no experts".into())) };
    let (rows, cols) = (first.rows, first.cols);
    if let Some(w) = experts.iter().find(|w| (w.rows, w.cols) != (rows, cols)) {
        return Err(BackendError::BadWeight { name: w.name.clone(), reason: format!("{}x{} among experts of {rows}x{cols}", w.rows, w.cols) });
    }
    let slots = n * n_used;
    check_len("expert ids", ids.len(), slots)?;
    let in_rows = if input == ExpertInput::PerSlot { slots } else { n };
    check_len("expert product input", x.len(), in_rows * cols)?;
    check_len("expert product output", out.len(), slots * rows)?;
    for &id in &ids[..slots] {
        expert_id(id, experts.len())?;
    }
    Ok(())
}

pub(crate) fn moe_matmul(experts: &[WeightSource], x: &[f32], ids: &[f32], out: &mut [f32], n: usize, n_used: usize, input: ExpertInput) -> Result<()> {
    check_moe_args(experts, x, ids, out, n, n_used, input)?;
    let (rows, cols) = (experts[0].rows, experts[0].cols);
    let slots = n * n_used;
    let ids = &ids[..slots];
    let input_of = |s: usize| {
        let r = if input == ExpertInput::PerSlot { s } else { s / n_used };
        &x[r * cols..(r + 1) * cols]
    };
    let dst = SharedOut(out.as_mut_ptr());
    let rows_per_task = (16384 / cols.max(1)).clamp(1, 64);
    let blocks = rows.div_ceil(rows_per_task);
    // A task is one block of rows of one expert; each row is dequantized once for every slot
    // that chose its expert, and experts nobody chose are never read.
    (0..experts.len() * blocks).into_par_iter().for_each(|task| {
        let (e, block) = (task / blocks, task % blocks);
        let id = e as f32;
        if !ids.contains(&id) {
            return;
        }
        with_scratch(cols, |buf| {
            for r in block * rows_per_task..((block + 1) * rows_per_task).min(rows) {
                let row = weight_row(&experts[e], r, buf);
                for (s, _) in ids.iter().enumerate().filter(|(_, &i)| i == id) {
                    // SAFETY: slot s of expert e, row r is written by this task only; bounds checked above.
                    unsafe { dst.write(s * rows + r, dot_f32(row, input_of(s))) };
                }
            }
        })
    });
    Ok(())
}

pub(crate) fn moe_combine(y: &[f32], weights: &[f32], out: &mut [f32], n: usize, n_used: usize, dim: usize) -> Result<()> {
    check_len("expert outputs", y.len(), n * n_used * dim)?;
    check_len("expert weights", weights.len(), n * n_used)?;
    check_len("combined output", out.len(), n * dim)?;
    for (t, o) in out[..n * dim].chunks_exact_mut(dim).enumerate() {
        o.fill(0.0);
        for j in 0..n_used {
            let (w, ys) = (weights[t * n_used + j], &y[(t * n_used + j) * dim..(t * n_used + j + 1) * dim]);
            for (o, v) in o.iter_mut().zip(ys) {
                *o += w * v;
            }
        }
    }
    Ok(())
}

pub(crate) fn moe_add_bias(x: &mut [f32], bias: &[f32], ids: &[f32], n: usize, n_used: usize, dim: usize) -> Result<()> {
    let slots = n * n_used;
    check_len("expert bias input", x.len(), slots * dim)?;
    check_len("expert bias ids", ids.len(), slots)?;
    let n_experts = bias.len() / dim.max(1);
    for (row, &id) in x[..slots * dim].chunks_exact_mut(dim).zip(&ids[..slots]) {
        let e = expert_id(id, n_experts)?;
        for (v, b) in row.iter_mut().zip(&bias[e * dim..(e + 1) * dim]) {
            *v += b;
        }
    }
    Ok(())
}

/// gpt-oss's clamped SwiGLU: `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with
/// `g = min(gate, limit)`.
pub(crate) fn swiglu_oai(gate: f32, up: f32, alpha: f32, limit: f32) -> f32 {
    let g = gate.min(limit);
    (up.clamp(-limit, limit) + 1.0) * g / (1.0 + (-alpha * g).exp())
}

/// GELU with the tanh approximation (PyTorch's `gelu(approximate="tanh")`).
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
}

#[cfg(test)]
mod tests {
    use crate::cpu_simd::tests::values;
    use std::sync::Arc;

    use kiln_quant::GgmlType;

    use super::*;

    fn f32_experts(n: usize, rows: usize, cols: usize, seed: u64) -> (Vec<WeightSource>, Vec<f32>) {
        let all = values(n * rows * cols, seed);
        let bytes: Arc<Vec<u8>> = Arc::new(all.iter().flat_map(|v| v.to_le_bytes()).collect());
        let per = rows * cols * 4;
        let experts = (0..n)
            .map(|e| WeightSource { name: format!("e{e}"), ty: GgmlType::F32, rows, cols, owner: bytes.clone(), range: e * per..(e + 1) * per })
            .collect();
        (experts, all)
    }

    #[test]
    fn routing_matches_a_float64_softmax_top_k() {
        let (n, e, k) = (7, 9, 3);
        let logits: Vec<f32> = values(n * e, 3).iter().map(|v| v * 4.0).collect();
        let scales: Vec<f32> = values(e, 4).iter().map(|v| v + 1.5).collect();
        for (renormalize, scaled) in [(false, false), (true, false), (true, true)] {
            let (mut ids, mut weights) = (vec![0f32; n * k], vec![0f32; n * k]);
            let scale = scaled.then_some(&scales[..]);
            moe_route(&logits, scale, &mut ids, &mut weights, (n, e, k), &RouterParams { renormalize, shared_expert: false }).unwrap();
            for t in 0..n {
                let row: Vec<f64> = logits[t * e..(t + 1) * e].iter().map(|&v| v as f64).collect();
                let total: f64 = row.iter().map(|l| l.exp()).sum();
                let mut order: Vec<usize> = (0..e).collect();
                order.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap());
                let chosen = &order[..k];
                let sum: f64 = chosen.iter().map(|&i| row[i].exp() / total).sum();
                for (j, &i) in chosen.iter().enumerate() {
                    assert_eq!(ids[t * k + j], i as f32, "token {t} slot {j}");
                    let want = row[i].exp() / total / if renormalize { sum } else { 1.0 } * if scaled { scales[i] as f64 } else { 1.0 };
                    assert!((weights[t * k + j] as f64 - want).abs() < 1e-6, "token {t} slot {j}: {} vs {want}", weights[t * k + j]);
                }
            }
        }
        let mut ids = vec![0f32; 3];
        assert!(moe_route(&logits, None, &mut ids.clone(), &mut ids, (1, e, e + 1), &RouterParams { renormalize: true, shared_expert: false }).is_err());
    }

    #[test]
    fn a_shared_expert_takes_the_slot_after_the_chosen() {
        let (n, e, k) = (5, 9, 3);
        let logits: Vec<f32> = values(n * (e + 1), 8).iter().map(|v| v * 4.0).collect();
        let scales: Vec<f32> = values(e, 9).iter().map(|v| v + 1.5).collect();
        let (mut ids, mut weights) = (vec![f32::NAN; n * (k + 1)], vec![f32::NAN; n * (k + 1)]);
        let p = RouterParams { renormalize: true, shared_expert: true };
        moe_route(&logits, Some(&scales), &mut ids, &mut weights, (n, e, k), &p).unwrap();
        for t in 0..n {
            let row = &logits[t * (e + 1)..t * (e + 1) + e];
            let (mut want_ids, mut want_weights) = (vec![0f32; k], vec![0f32; k]);
            let routed = RouterParams { shared_expert: false, ..p };
            moe_route(row, Some(&scales), &mut want_ids, &mut want_weights, (1, e, k), &routed).unwrap();
            let slots = t * (k + 1)..(t + 1) * (k + 1);
            assert_eq!(ids[slots.clone()][..k], want_ids[..], "token {t}");
            assert_eq!(weights[slots.clone()][..k], want_weights[..], "token {t}");
            let gate = logits[t * (e + 1) + e] as f64;
            assert_eq!(ids[slots.end - 1], e as f32, "token {t}: the shared expert's id");
            assert!((weights[slots.end - 1] as f64 - 1.0 / (1.0 + (-gate).exp())).abs() < 1e-6, "token {t}: its weight");
        }
        let mut short = vec![0f32; n * k];
        assert!(moe_route(&logits, None, &mut short.clone(), &mut short, (n, e, k), &p).is_err());
    }

    #[test]
    fn ties_choose_the_lower_expert() {
        let (mut ids, mut weights) = (vec![0f32; 2], vec![0f32; 2]);
        moe_route(&[1.0, 2.0, 2.0, 2.0], None, &mut ids, &mut weights, (1, 4, 2), &RouterParams { renormalize: true, shared_expert: false }).unwrap();
        assert_eq!(ids, [1.0, 2.0]);
        assert_eq!(weights, [0.5, 0.5]);
    }

    #[test]
    fn expert_products_match_a_scalar_reference() {
        let (n_experts, rows, cols, n, k) = (5, 37, 67, 6, 3);
        let (experts, all) = f32_experts(n_experts, rows, cols, 5);
        let ids: Vec<f32> = (0..n * k).map(|s| ((s * 7 + s / k) % n_experts) as f32).collect();
        for input in [ExpertInput::PerToken, ExpertInput::PerSlot] {
            let in_rows = if input == ExpertInput::PerSlot { n * k } else { n };
            let x = values(in_rows * cols, 9);
            let mut out = vec![f32::NAN; n * k * rows];
            moe_matmul(&experts, &x, &ids, &mut out, n, k, input).unwrap();
            for s in 0..n * k {
                let (e, xr) = (ids[s] as usize, if input == ExpertInput::PerSlot { s } else { s / k });
                for r in 0..rows {
                    let w = &all[(e * rows + r) * cols..][..cols];
                    let want: f64 = w.iter().zip(&x[xr * cols..][..cols]).map(|(a, b)| *a as f64 * *b as f64).sum();
                    assert!((out[s * rows + r] as f64 - want).abs() < 1e-5, "{input:?} slot {s} row {r}");
                }
            }
        }
        let mut out = vec![0f32; n * k * rows];
        let bad: Vec<f32> = ids.iter().map(|_| n_experts as f32).collect();
        let err = moe_matmul(&experts, &values(n * cols, 1), &bad, &mut out, n, k, ExpertInput::PerToken).unwrap_err();
        assert!(err.to_string().contains("not one of the 5 experts"), "{err}");
    }

    #[test]
    fn quantized_experts_read_each_expert_slice() {
        // Q8_0 expert tensor: each expert's product equals the product with its dequantized rows.
        let (n_experts, rows, cols) = (3, 5, 64);
        let floats = values(n_experts * rows * cols, 4);
        let row_bytes = cols / 32 * 34;
        let mut bytes = vec![0u8; n_experts * rows * row_bytes];
        kiln_quant::quantize(GgmlType::Q8_0, &floats, &mut bytes).unwrap();
        let mut deq = vec![0f32; floats.len()];
        kiln_quant::dequantize(GgmlType::Q8_0, &bytes, &mut deq).unwrap();
        let owner = Arc::new(bytes);
        let per = rows * row_bytes;
        let experts: Vec<WeightSource> = (0..n_experts)
            .map(|e| WeightSource { name: format!("q{e}"), ty: GgmlType::Q8_0, rows, cols, owner: owner.clone(), range: e * per..(e + 1) * per })
            .collect();
        let x = values(cols, 8);
        let ids = [2.0, 0.0, 1.0];
        let mut out = vec![0f32; 3 * rows];
        moe_matmul(&experts, &x, &ids, &mut out, 1, 3, ExpertInput::PerToken).unwrap();
        for (s, &e) in ids.iter().enumerate() {
            for r in 0..rows {
                let want = dot_f32(&deq[(e as usize * rows + r) * cols..][..cols], &x);
                assert_eq!(out[s * rows + r], want);
            }
        }
    }

    #[test]
    fn expert_biases_follow_the_chosen_experts() {
        let (n, k, dim, e) = (3, 2, 5, 4);
        let bias = values(e * dim, 21);
        let ids = [3.0, 0.0, 1.0, 1.0, 2.0, 3.0];
        let mut x = values(n * k * dim, 22);
        let before = x.clone();
        moe_add_bias(&mut x, &bias, &ids, n, k, dim).unwrap();
        for s in 0..n * k {
            for d in 0..dim {
                assert_eq!(x[s * dim + d], before[s * dim + d] + bias[ids[s] as usize * dim + d]);
            }
        }
        assert!(moe_add_bias(&mut x, &bias, &[4.0; 6], n, k, dim).is_err());
    }

    #[test]
    fn clamped_swiglu_matches_its_float64_formula() {
        let (alpha, limit) = (1.702, 7.0);
        let gates = values(64, 31).into_iter().map(|v| v * 12.0);
        for (g, u) in gates.zip(values(64, 32).into_iter().map(|v| v * 12.0)) {
            let gd = (g as f64).min(limit);
            let want = ((u as f64).clamp(-limit, limit) + 1.0) * gd / (1.0 + (-alpha * gd).exp());
            let got = swiglu_oai(g, u, alpha as f32, limit as f32) as f64;
            assert!((got - want).abs() < 1e-5 * (1.0 + want.abs()), "gate {g} up {u}: {got} vs {want}");
        }
    }

    #[test]
    fn combine_is_the_weighted_sum_of_slots() {
        let (n, k, dim) = (3, 2, 5);
        let y = values(n * k * dim, 2);
        let w = values(n * k, 6);
        let mut out = vec![0f32; n * dim];
        moe_combine(&y, &w, &mut out, n, k, dim).unwrap();
        for t in 0..n {
            for d in 0..dim {
                let want: f32 = (0..k).map(|j| w[t * k + j] * y[(t * k + j) * dim + d]).sum();
                assert!((out[t * dim + d] - want).abs() < 1e-6);
            }
        }
    }

    #[test]
    fn gelu_tanh_matches_its_float64_formula() {
        for x in values(101, 12).iter().map(|v| v * 6.0).chain([0.0, -10.0, 10.0]) {
            let xd = x as f64;
            let want = 0.5 * xd * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (xd + 0.044715 * xd.powi(3))).tanh());
            assert!((gelu_tanh(x) as f64 - want).abs() < 1e-6 * (1.0 + want.abs()), "{x}");
        }
    }
}
