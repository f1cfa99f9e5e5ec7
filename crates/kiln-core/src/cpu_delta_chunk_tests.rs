use super::*;
use crate::backend::DeltaNetParams;
use crate::cpu::SharedOut;
use crate::cpu_recurrent::tests::{plan, reference_from};
use crate::cpu_recurrent::{delta_net_from, delta_net_gates, recurrence, DeltaNetIo};
use crate::cpu_simd::tests::values;
use crate::cpu_simd::SimdLevel;

/// Chunked and token-by-token results differ by f32 reassociation alone: sums of head_dim and
/// chunk-length terms taken in another order, the state carried across chunks rather than
/// tokens. Measured worst over every shape and span below, outputs and states, either SIMD
/// level: 5.3e-7 apart, each 2e-7 to 5e-7 from float64 (the chunked form slightly closer). 1e-5
/// (the end-to-end tests' f32 tolerance) leaves 20x; a wrong decay, beta or off-by-one moves
/// results by 1e-2 or more.
const REL_L2: f64 = 1e-5;

fn rel_l2(got: impl Iterator<Item = f64>, want: impl Iterator<Item = f64>) -> f64 {
    let (mut diff, mut norm) = (0f64, 0f64);
    for (g, w) in got.zip(want) {
        diff += (g - w) * (g - w);
        norm += w * w;
    }
    (diff / norm.max(1e-300)).sqrt()
}

/// `n` tokens of convolved inputs and the gates a Qwen3.5 layer derives for them:
/// `g = -exp(A_log) softplus(a + dt_bias)` with A in 1..16 and softplus(dt_bias) log-uniform in
/// 0.001..0.1 (Mamba's initialisation, which the trained models keep the shape of), so heads
/// range from barely decaying to losing most of their state every token (g down to about -30).
fn inputs(n: usize, p: &DeltaNetParams, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let nv = p.n_v_heads;
    let x = values(n * p.conv_dim(), seed);
    let a_log_neg: Vec<f32> = values(nv, seed + 1).iter().map(|v| -(8.5 + 7.5 * v)).collect();
    let dt_bias: Vec<f32> = values(nv, seed + 2).iter().map(|v| (0.01f32.ln() + v * 10f32.ln()).exp().exp_m1().ln()).collect();
    let mut g: Vec<f32> = values(n * nv, seed + 3).iter().map(|v| 4.0 * v).collect();
    let mut beta: Vec<f32> = values(n * nv, seed + 4).iter().map(|v| 3.0 * v).collect();
    delta_net_gates(&mut g, &mut beta, &a_log_neg, &dt_bias, n, nv).unwrap();
    (x, g, beta)
}

/// One call over sequences of these lengths, the first from position 0 (zero state), the others
/// continuing from random states in slots given in reverse order: the chunked form (every span,
/// even of one token) against the recurrence, per sequence and head, and both against float64.
/// Returns the worst relative L2 errors: chunked vs recurrence, recurrence vs float64, chunked
/// vs float64.
fn chunked_vs_recurrence(simd: Simd, p: &DeltaNetParams, lens: &[usize], seed: u64) -> [f64; 3] {
    let (d, nv, c) = (p.head_dim, p.n_v_heads, p.conv_dim());
    let seqs: Vec<(usize, usize)> = lens.iter().enumerate().map(|(i, &n)| (if i == 0 { 0 } else { 5 + 40 * i }, n)).collect();
    let step = plan(&seqs);
    let n: usize = lens.iter().sum();
    let (x, g, beta) = inputs(n, p, seed);
    let slots: Vec<f32> = (0..lens.len()).rev().map(|s| s as f32).collect();
    let init = values(lens.len() * p.ssm_state(), seed + 5);
    let run = |chunked_from| {
        let (mut state, mut out) = (init.clone(), vec![f32::NAN; n * nv * d]);
        let io = DeltaNetIo { x: &x, g: &g, beta: &beta, state: &mut state, slots: &slots, out: &mut out };
        delta_net_from(simd, io, &step, n, p, chunked_from).unwrap();
        (state, out)
    };
    let (rec_state, rec_out) = run(usize::MAX);
    let (chunk_state, chunk_out) = run(1);
    let mut worst = [0f64; 3];
    for (s, (&(pos0, len), seq)) in seqs.iter().zip(&step.seqs).enumerate() {
        let first = seq.first_token as usize;
        let slot = slots[s] as usize * p.ssm_state();
        let from = if pos0 == 0 { vec![0.0; p.ssm_state()] } else { init[slot..slot + p.ssm_state()].to_vec() };
        let (x_s, g_s, b_s) = (&x[first * c..], &g[first * nv..], &beta[first * nv..]);
        let (want_out, want_state) = reference_from(x_s, g_s, b_s, len, p, &from);
        for h in 0..nv {
            let cols = |t: usize| (first + t) * nv * d + h * d..(first + t) * nv * d + (h + 1) * d;
            let outs = |o: &[f32]| (0..len).flat_map(|t| o[cols(t)].to_vec()).map(f64::from).collect::<Vec<f64>>();
            let st = |v: &[f32]| v[slot + h * d * d..slot + (h + 1) * d * d].iter().map(|&e| e as f64).collect::<Vec<f64>>();
            let (rec, chunk) = (outs(&rec_out), outs(&chunk_out));
            let f64_out = || (0..len).flat_map(|t| want_out[t * nv * d + h * d..t * nv * d + (h + 1) * d].to_vec());
            let errs = [rel_l2(chunk.iter().copied(), rec.iter().copied()), rel_l2(st(&chunk_state).into_iter(), st(&rec_state).into_iter())];
            for (what, e) in ["outputs", "state"].iter().zip(errs) {
                assert!(e <= REL_L2, "{p:?} sequence of {len} tokens, head {h}: {what} rel_l2 {e:.2e}");
            }
            let f64_state = || want_state[h * d * d..(h + 1) * d * d].iter().copied();
            let vs_f64 = |out: &[f64], state: &[f32]| rel_l2(out.iter().copied(), f64_out()).max(rel_l2(st(state).into_iter(), f64_state()));
            let errs = [errs[0].max(errs[1]), vs_f64(&rec, &rec_state), vs_f64(&chunk, &chunk_state)];
            worst = std::array::from_fn(|i| worst[i].max(errs[i]));
        }
    }
    worst
}

#[test]
fn chunked_equals_the_recurrence_on_every_span_length() {
    // The tiny qwen35 test model's shape, the real head_dim 128 with 2, 3 and 4 value heads
    // per key head, and head dims that leave SIMD tails.
    let shapes = [(2, 4, 64), (2, 4, 128), (2, 6, 128), (1, 4, 128), (3, 3, 40), (1, 2, 7)];
    // One step of sequences of 1, C-1, C, C+1 and 3C+5 tokens, and spans longer than MAX_CHUNK.
    let lens = [1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5];
    let mut levels = vec![Simd::best()];
    levels.extend(Simd::at(SimdLevel::Scalar).filter(|s| *s != Simd::best()));
    for simd in levels {
        for (i, &(nk, nv, d)) in shapes.iter().enumerate() {
            let p = DeltaNetParams { n_k_heads: nk, n_v_heads: nv, head_dim: d, conv_kernel: 4 };
            let (a, b) = (chunked_vs_recurrence(simd, &p, &lens, 10 * i as u64 + 1), chunked_vs_recurrence(simd, &p, &[MAX_CHUNK + 9, 2], 10 * i as u64 + 7));
            let [vs_rec, rec_f64, chunk_f64] = std::array::from_fn(|i| a[i].max(b[i]));
            println!(
                "{:?} {nk} k / {nv} v heads x {d}: chunked vs recurrence {vs_rec:.1e}; vs float64: recurrence {rec_f64:.1e}, chunked {chunk_f64:.1e}",
                simd.level()
            );
        }
    }
}

/// Chunks of any length give the same outputs and state.
#[test]
fn every_chunk_length_gives_the_recurrence() {
    let p = DeltaNetParams { n_k_heads: 2, n_v_heads: 4, head_dim: 32, conv_kernel: 4 };
    let n = 3 * CHUNK + 5;
    let (x, g, beta) = inputs(n, &p, 3);
    let d = p.head_dim;
    let init = values(d * d, 4);
    let run = |chunk: Option<usize>| {
        let mut out = vec![f32::NAN; n * p.n_v_heads * d];
        let mut state = init.clone();
        let span = HeadSpan { x: &x, g: &g, beta: &beta, out: SharedOut(out.as_mut_ptr()), p: &p, head: 3, tokens: 0..n };
        match chunk {
            Some(c) => chunked(Simd::best(), &span, &mut state, c),
            None => recurrence(&span, &mut state),
        }
        let head: Vec<f64> = out.chunks_exact(d).skip(3).step_by(p.n_v_heads).flatten().map(|&e| e as f64).collect();
        (head, state)
    };
    let (want_out, want_state) = run(None);
    for chunk in [1, 2, 5, CHUNK, MAX_CHUNK] {
        let (out, state) = run(Some(chunk));
        let e_out = rel_l2(out.into_iter(), want_out.iter().copied());
        let e_state = rel_l2(state.iter().map(|&e| e as f64), want_state.iter().map(|&e| e as f64));
        assert!(e_out.max(e_state) <= REL_L2, "chunks of {chunk}: outputs {e_out:.2e}, state {e_state:.2e}");
    }
}
