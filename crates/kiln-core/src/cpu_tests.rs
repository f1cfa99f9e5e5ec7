//! The CPU backend's attention at every SIMD level against a float64 reference.

use super::{CpuBackend, CpuKvCache, CpuStep};
use crate::backend::{AttentionParams, Backend, WeightSource};
use crate::cpu_simd::tests::values;
use crate::cpu_simd::{Simd, SimdLevel};
use crate::plan::{BatchPlan, FlatPlan, KvCacheSpec, KvType, LogitRows, SeqStep, StepCapacity};
use crate::tensor::DeviceBuffer;
use kiln_quant::GgmlType;

/// Softmax-weighted sum of the cache's values (as the cache returns them), in float64.
#[allow(clippy::too_many_arguments)]
fn reference(
    backend_cache: &crate::cpu_kv::CpuKvCache,
    plan: &FlatPlan,
    q: &[f32],
    sinks: Option<&[f32]>,
    p: &AttentionParams,
    t: usize,
    h: usize,
    out: &mut [f64],
) {
    let hd = p.head_dim;
    let col = h / (p.n_heads / p.n_kv_heads) * hd;
    let (seq, end) = (plan.token_seq[t] as usize, plan.positions[t] as usize + 1);
    let start = p.window.map_or(0, |w| end.saturating_sub(w));
    let qv = &q[(t * p.n_heads + h) * hd..][..hd];
    let (mut k, mut v) = (vec![0f32; hd], vec![0f32; hd]);
    let scores: Vec<f64> = (start..end)
        .map(|j| {
            backend_cache.load_k(plan.row_of(seq, j), col, &mut k);
            qv.iter().zip(&k).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * p.scale as f64
        })
        .collect();
    let sink = sinks.map(|s| s[h] as f64);
    let max = scores.iter().copied().chain(sink).fold(f64::NEG_INFINITY, f64::max);
    let total: f64 = scores.iter().chain(sink.as_ref()).map(|s| (s - max).exp()).sum();
    out.fill(0.0);
    for (j, s) in (start..end).zip(&scores) {
        backend_cache.load_v(plan.row_of(seq, j), col, &mut v);
        for (o, x) in out.iter_mut().zip(&v) {
            *o += (s - max).exp() / total * *x as f64;
        }
    }
}

/// The attention of the query rows `q` (with `sinks` where given) into a new buffer, poisoned
/// first so that an output never written fails the comparison.
fn attend(backend: &CpuBackend, q: &[f32], cache: &CpuKvCache, sinks: Option<&[f32]>, step: &CpuStep, p: &AttentionParams) -> Vec<f32> {
    let (q, width) = (q.to_vec(), p.n_heads * p.head_dim);
    let (n, sinks) = (q.len() / width, sinks.map(<[f32]>::to_vec));
    let mut out = vec![f32::NAN; q.len()];
    let (qv, ov) = (q.rows(n, width).unwrap(), out.rows_mut(n, width).unwrap());
    match &sinks {
        Some(s) => backend.attention_sinks(qv, cache, s.whole(), ov, step, p).unwrap(),
        None => backend.attention(qv, cache, ov, step, p).unwrap(),
    }
    out
}

#[test]
fn attention_matches_a_float64_reference_at_every_level() {
    let backends: Vec<CpuBackend> = SimdLevel::ALL.into_iter().filter_map(Simd::at).map(CpuBackend::with_simd).collect();
    let cap = StepCapacity { tokens: 128, seqs: 2, blocks: 8, logit_rows: 0, history: 0 };
    // Two sequences over scattered blocks, one of them three blocks long.
    let (a_blocks, b_blocks) = ([4u32, 1, 6], [0u32, 3]);
    let (a_tokens, b_tokens) = (vec![0u32; 70], vec![0u32; 33]);
    let seqs = [
        SeqStep { tokens: &a_tokens, pos0: 0, blocks: &a_blocks, logits: LogitRows::None, sample: None },
        SeqStep { tokens: &b_tokens, pos0: 0, blocks: &b_blocks, logits: LogitRows::None, sample: None },
    ];
    let mut plan = FlatPlan::with_capacity(&cap);
    plan.fill(&BatchPlan { seqs: &seqs }, &cap, 8).unwrap();
    let n = plan.n_tokens();
    // Head sizes 64 (q8_0 heads on block boundaries) and 48 (q8_0 heads across them).
    for (hd, n_kv_heads, group) in [(64, 2, 3), (48, 2, 1)] {
        let n_heads = n_kv_heads * group;
        let width = n_kv_heads * hd;
        let (k, v, q) = (values(n * width, 1), values(n * width, 2), values(n * n_heads * hd, 3));
        let q: Vec<f32> = q.iter().map(|x| x * 4.0).collect();
        let sink_values: Vec<f32> = values(n_heads, 4);
        for ty in [KvType::F32, KvType::F16, KvType::Q8_0] {
            for window in [None, Some(5)] {
                for sinks in [None, Some(&sink_values[..])] {
                    let p = AttentionParams { n_heads, n_kv_heads, head_dim: hd, max_seq_len: 96, scale: 1.0 / (hd as f32).sqrt(), window };
                    let mut want = vec![0f64; n * n_heads * hd];
                    // The first backend is the scalar one, whose cache the reference reads.
                    for backend in &backends {
                        let spec = KvCacheSpec { n_blocks: 8, width, k_type: ty, v_type: ty };
                        let mut cache = backend.alloc_kv(&spec, "test").unwrap();
                        backend.grow_kv(&mut cache, 8).unwrap();
                        let mut step = backend.alloc_step(&cap, 8).unwrap();
                        backend.write_step(&mut step, &plan).unwrap();
                        backend.kv_store(k.rows(n, width).unwrap(), v.rows(n, width).unwrap(), &mut cache, &step).unwrap();
                        if backend.simd.level() == SimdLevel::Scalar {
                            for t in 0..n {
                                for h in 0..n_heads {
                                    reference(&cache, &plan, &q, sinks, &p, t, h, &mut want[(t * n_heads + h) * hd..][..hd]);
                                }
                            }
                        }
                        let mut out = attend(backend, &q, &cache, sinks, &step, &p);
                        // One decode token with more threads than heads: a job per head.
                        let last = [0u32];
                        let decode = [SeqStep { tokens: &last, pos0: 69, blocks: &a_blocks, logits: LogitRows::None, sample: None }];
                        let mut decode_plan = FlatPlan::with_capacity(&cap);
                        decode_plan.fill(&BatchPlan { seqs: &decode }, &cap, 8).unwrap();
                        backend.write_step(&mut step, &decode_plan).unwrap();
                        let row = n_heads * hd;
                        let pool = rayon::ThreadPoolBuilder::new().num_threads(4 * n_heads).build().unwrap();
                        let one = pool.install(|| attend(backend, &q[69 * row..70 * row], &cache, sinks, &step, &p));
                        // Sequence a's prompt with sequence b beside it in the step and alone:
                        // the same bits (its tiles depend on its own span only).
                        let mut a_plan = FlatPlan::with_capacity(&cap);
                        a_plan.fill(&BatchPlan { seqs: &seqs[..1] }, &cap, 8).unwrap();
                        backend.write_step(&mut step, &a_plan).unwrap();
                        let a_alone = attend(backend, &q[..70 * row], &cache, sinks, &step, &p);
                        assert!(
                            out[..70 * row].iter().zip(&a_alone).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{:?} {ty} hd {hd} window {window:?}: a prompt depends on the other sequences of its step",
                            backend.simd.level()
                        );
                        // Its last 30 tokens fed as a step of their own (the first 40 cached): the
                        // same bits again, so a prompt split over steps computes alike.
                        let tail = [SeqStep { tokens: &a_tokens[40..], pos0: 40, blocks: &a_blocks, logits: LogitRows::None, sample: None }];
                        a_plan.fill(&BatchPlan { seqs: &tail }, &cap, 8).unwrap();
                        backend.write_step(&mut step, &a_plan).unwrap();
                        let a_tail = attend(backend, &q[40 * row..70 * row], &cache, sinks, &step, &p);
                        assert!(
                            out[40 * row..70 * row].iter().zip(&a_tail).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{:?} {ty} hd {hd} window {window:?}: a prompt's tokens depend on how it is split over steps",
                            backend.simd.level()
                        );
                        out.extend_from_slice(&one);
                        let want: Vec<f64> = want.iter().copied().chain(want[69 * row..70 * row].iter().copied()).collect();
                        // Outputs are averages of values in [-1, 1]: f32 sums of up to 70
                        // terms and a vector exp within 1e-6 stay well inside 1e-5.
                        for (i, (o, w)) in out.iter().zip(&want).enumerate() {
                            assert!(
                                (*o as f64 - w).abs() < 1e-5,
                                "{:?} {ty} hd {hd} window {window:?} sinks {}: [{i}] {o} vs {w}",
                                backend.simd.level(),
                                sinks.is_some()
                            );
                        }
                    }
                }
            }
        }
    }
}

/// One decode token's attention over 2048 cached positions in qwen3-0.6b's shape (16 query
/// heads over 8 KV heads of 128) at every level, on one thread: `cargo test --release -p kiln-core -- --ignored --nocapture`.
#[test]
#[ignore]
fn decode_attention_timing() {
    let (n_heads, n_kv_heads, hd, depth) = (16, 8, 128, 2048);
    let blocks: Vec<u32> = (0..depth as u32 / 32).collect();
    let cap = StepCapacity { tokens: 1, seqs: 1, blocks: blocks.len(), logit_rows: 0, history: 0 };
    let tokens = [0u32];
    let seqs = [SeqStep { tokens: &tokens, pos0: depth - 1, blocks: &blocks, logits: LogitRows::None, sample: None }];
    let mut plan = FlatPlan::with_capacity(&cap);
    plan.fill(&BatchPlan { seqs: &seqs }, &cap, blocks.len()).unwrap();
    let width = n_kv_heads * hd;
    let q = values(n_heads * hd, 1);
    let p = AttentionParams { n_heads, n_kv_heads, head_dim: hd, max_seq_len: depth, scale: 0.088, window: None };
    for ty in [KvType::F16, KvType::Q8_0, KvType::F32] {
        for level in SimdLevel::ALL {
            let Some(simd) = Simd::at(level) else { continue };
            let backend = CpuBackend::with_simd(simd);
            let spec = KvCacheSpec { n_blocks: blocks.len(), width, k_type: ty, v_type: ty };
            let mut cache = backend.alloc_kv(&spec, "timing").unwrap();
            backend.grow_kv(&mut cache, blocks.len()).unwrap();
            let rows = values(width, 2);
            for r in 0..depth {
                cache.store(r, &rows, &rows);
            }
            let mut step = backend.alloc_step(&cap, blocks.len()).unwrap();
            backend.write_step(&mut step, &plan).unwrap();
            let mut out = vec![0f32; n_heads * hd];
            let reps = if level == SimdLevel::Scalar { 5 } else { 50 };
            // CPU time of the one worker thread, so other load on the machine does not count.
            let cpu_ns = || std::fs::read_to_string("/proc/thread-self/schedstat").ok().and_then(|s| s.split(' ').next()?.parse::<f64>().ok()).unwrap_or(0.0);
            let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
            let ns = pool.install(|| {
                let t0 = cpu_ns();
                for _ in 0..reps {
                    backend.attention(q.rows(1, n_heads * hd).unwrap(), &cache, out.rows_mut(1, n_heads * hd).unwrap(), &step, &p).unwrap();
                }
                cpu_ns() - t0
            });
            println!("{ty} {level:?}: {:.3} ms of one thread's CPU time a layer", ns / 1e6 / reps as f64);
        }
    }
}

/// The fast backend stores TQ1_0 weights as TQ2_0: the same values exactly.
#[test]
fn tq1_0_weights_keep_their_values_as_tq2_0() {
    let (rows, cols) = (3, 512);
    let values: Vec<f32> = values(rows * cols, 11).iter().map(|v| (v * 3.0).round().clamp(-1.0, 1.0) * 0.25).collect();
    let mut bytes = vec![0u8; kiln_quant::quantized_size(GgmlType::TQ1_0, values.len()).unwrap()];
    kiln_quant::quantize(GgmlType::TQ1_0, &values, &mut bytes).unwrap();
    let len = bytes.len();
    let src = WeightSource { name: "t".into(), ty: GgmlType::TQ1_0, rows, cols, owner: std::sync::Arc::new(bytes), range: 0..len };
    let mut want = vec![0f32; rows * cols];
    kiln_quant::dequantize(GgmlType::TQ1_0, src.bytes(), &mut want).unwrap();
    let fast = CpuBackend::new().upload_weight(src.clone()).unwrap();
    assert_eq!(fast.ty, GgmlType::TQ2_0);
    let mut got = vec![0f32; rows * cols];
    kiln_quant::dequantize(GgmlType::TQ2_0, fast.bytes(), &mut got).unwrap();
    assert_eq!(got, want);
    assert_eq!(CpuBackend::exact().upload_weight(src).unwrap().ty, GgmlType::TQ1_0, "the exact backend keeps the file's bytes");
}
