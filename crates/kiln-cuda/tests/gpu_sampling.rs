//! The GPU sampler against the CPU reference sampler: the same random generator bit for bit,
//! greedy and top-k 1 identical, draws that follow the exact distribution and repeat exactly,
//! and many sequences of one step each sampling its own row with its own settings. Needs an
//! NVIDIA GPU: run scripts/gpu-tests.sh on the device.

mod common;
use common::rng;

use kiln_core::backend::Backend;
use kiln_core::plan::{LogitRows, SampleSpec, SeqStep};
use kiln_core::sampling::{self, SamplingParams};
use kiln_cuda::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use rand::Rng;
#[path = "common/backends.rs"]
mod backends;
use backends::*;

fn sample_both(pair: &mut Pair, logits: &[f32], gpu_logits: &CudaSlice<f32>, p: &SamplingParams, history: &[u32], draw: u64) -> (u32, u32) {
    pair.set_step(&[], 0, p, history, draw);
    let (cpu_logits, shape) = (logits.to_vec(), [1, logits.len()]);
    pair.cpu.sample(view(&cpu_logits, shape), &mut pair.cpu_step).expect("cpu sample");
    pair.gpu.sample(view(gpu_logits, shape), &mut pair.gpu_step).expect("gpu sample");
    (pair.cpu_tokens(1)[0], pair.gpu_tokens(1)[0])
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn the_gpu_generator_is_the_cpu_generator_bit_for_bit() {
    let _gpu_use = shared_gpu();
    let gpu = gpu();
    let uniform = gpu.device().registry().function("sampling", "uniform_draws_f32", &[]).expect("kernel");
    for (seed, first) in [(0u64, 0u64), (42, 1_000_000), (u64::MAX, u64::MAX - 5000), (0x1234_5678_9abc_def0, 1 << 40)] {
        let n = 4096usize;
        let mut out = poisoned(&gpu, n);
        let cfg = LaunchConfig { grid_dim: (8, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        let n32 = n as u32;
        // SAFETY: uniform_draws_f32(out, seed, first_draw, n) with `out` holding n values.
        unsafe { gpu.device().stream().launch_builder(&uniform).arg(&mut out).arg(&seed).arg(&first).arg(&n32).launch(cfg) }.expect("launch");
        let got = download(&gpu, &out, n);
        let want: Vec<f32> = (0..n as u64).map(|i| sampling::uniform(seed, first.wrapping_add(i))).collect();
        assert_bitwise(&format!("uniform(seed {seed}, draws from {first})"), &got, &want);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn greedy_and_top_k_one_sampling_are_identical_to_cpu() {
    let mut rng = rng("greedy");
    let mut pair = Pair::new(1, 256);
    for n_vocab in [1usize, 7, 512, 32_000, 50_001, 151_936] {
        for trial in 0..6 {
            let mut logits = random(&mut rng, n_vocab, 8.0);
            if trial % 2 == 1 && n_vocab > 3 {
                // Ties for the maximum: the lower id must win on both.
                let top = logits.iter().cloned().fold(f32::MIN, f32::max) + 1.0;
                for _ in 0..3 {
                    logits[rng.gen_range(0..n_vocab)] = top;
                }
            }
            let history: Vec<u32> = (0..rng.gen_range(0..300)).map(|_| rng.gen_range(0..n_vocab as u32 + 5)).collect();
            let gpu_logits = upload(&pair.gpu, &logits);
            let penalties = [1.0, 1.3, 0.7];
            // Small vocabularies repeat tokens in the window, so frequency counts above one are checked.
            let (presence, frequency) = [(0.0, 0.0), (0.5, 0.0), (0.3, 0.9)][(trial / 2) % 3];
            let greedy = SamplingParams {
                repeat_penalty: penalties[trial % 3],
                repeat_last_n: 64,
                presence_penalty: presence,
                frequency_penalty: frequency,
                ..SamplingParams::greedy()
            };
            let (cpu, gpu) = sample_both(&mut pair, &logits, &gpu_logits, &greedy, &history, trial as u64);
            assert_eq!(gpu, cpu, "greedy, vocab {n_vocab}, trial {trial}");
            // A temperature whose inverse overflows is greedy on both.
            let tiny = SamplingParams { temperature: 1e-45, top_k: 0, seed: trial as u64, ..greedy };
            let (cpu_tiny, gpu_tiny) = sample_both(&mut pair, &logits, &gpu_logits, &tiny, &history, trial as u64 * 3);
            assert_eq!((gpu_tiny, cpu_tiny), (cpu, cpu), "temperature 1e-45, vocab {n_vocab}, trial {trial}");
            // A repetition penalty whose quotient overflows: the largest finite logit on both.
            let crushed = SamplingParams { repeat_penalty: 1e-40, temperature: 1.0, top_k: 0, seed: trial as u64, ..greedy };
            let (cpu_crushed, gpu_crushed) = sample_both(&mut pair, &logits, &gpu_logits, &crushed, &history, trial as u64 * 5);
            assert_eq!(gpu_crushed, cpu_crushed, "repeat penalty 1e-40, vocab {n_vocab}, trial {trial}");
            let top1 = SamplingParams { temperature: 1.7, top_k: 1, seed: trial as u64, ..greedy };
            let (cpu, gpu) = sample_both(&mut pair, &logits, &gpu_logits, &top1, &history, trial as u64 * 7);
            assert_eq!(gpu, cpu, "top_k 1 at temperature 1.7, vocab {n_vocab}, trial {trial}");
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn draws_match_cpu_draw_for_draw() {
    // Up to 1024 candidates (the shared-memory path): both sides walk the same short ranking
    // with the same uniform number, so only a running sum that rounds across the drawn value
    // (about 1e-6 of the draws) may pick a neighbour.
    let mut rng = rng("draws");
    let mut pair = Pair::new(1, 128);
    let base = SamplingParams::default();
    let cases = [
        (512, base),
        (512, SamplingParams { top_k: 0, top_p: 1.0, min_p: 0.0, temperature: 1.0, ..base }),
        (32_000, SamplingParams { repeat_penalty: 1.2, ..base }),
        (32_000, SamplingParams { repeat_penalty: 1.1, presence_penalty: 0.4, frequency_penalty: 0.3, ..base }),
        (151_936, SamplingParams { top_k: 300, top_p: 0.8, min_p: 0.01, temperature: 0.9, ..base }),
    ];
    for (n_vocab, params) in cases {
        let logits = random(&mut rng, n_vocab, 6.0);
        let history: Vec<u32> = (0..100).map(|_| rng.gen_range(0..n_vocab as u32)).collect();
        let same = draws_agreeing(&mut pair, &logits, &params, &history, 200);
        assert!(same >= 198, "vocab {n_vocab}, {params:?}: {same}/200 draws agree");
    }
}

/// How many of `draws` seeded draws from `logits` the GPU and the CPU agree on.
fn draws_agreeing(pair: &mut Pair, logits: &[f32], params: &SamplingParams, history: &[u32], draws: u64) -> usize {
    let gpu_logits = upload(&pair.gpu, logits);
    let agree = |draw: &u64| {
        let p = SamplingParams { seed: 1000 + draw, ..*params };
        let (cpu, gpu) = sample_both(pair, logits, &gpu_logits, &p, history, *draw);
        assert!((gpu as usize) < logits.len(), "{params:?}: token {gpu} of {}", logits.len());
        cpu == gpu
    };
    (0..draws).filter(agree).count()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn top_k_by_parts_draws_match_cpu_draw_for_draw() {
    // Top-k up to 128: each part of the row keeps its own k best and the last part merges them.
    // Rows of 1 to 19 parts, k up to the merge's 1024 candidates, and logits of 25 distinct
    // values where thousands tie at the top (the k lowest ids among them must be kept). Those
    // draw without top-p: 38 of 40 equal weights reach 0.95 exactly, a rounding tie where sums
    // in another order than the CPU's keep one token more or less and shift most draws.
    let mut rng = rng("top_k_by_parts");
    let mut pair = Pair::new(1, 128);
    let base = SamplingParams::default();
    let cases = [
        (40, SamplingParams { top_k: 64, ..base }),
        (300, SamplingParams { top_k: 128, top_p: 1.0, min_p: 0.0, temperature: 1.0, ..base }),
        (8_193, SamplingParams { top_k: 2, temperature: 2.0, ..base }),
        (50_001, SamplingParams { top_k: 128, top_p: 0.9, min_p: 0.0, repeat_penalty: 1.3, ..base }),
        (151_936, base),
        (151_936, SamplingParams { top_k: 53, top_p: 1.0, min_p: 0.01, temperature: 1.5, ..base }),
        (151_936, SamplingParams { top_k: 54, top_p: 1.0, min_p: 0.01, temperature: 1.5, ..base }),
        (151_936, SamplingParams { top_k: 17, top_p: 0.5, min_p: 0.0, presence_penalty: 0.5, frequency_penalty: 0.3, ..base }),
    ];
    for (case, (n_vocab, params)) in cases.into_iter().enumerate() {
        for coarse in [false, true] {
            let logits: Vec<f32> =
                if coarse { (0..n_vocab).map(|_| (rng.gen_range(-6.0f32..6.0) * 2.0).round() / 2.0).collect() } else { random(&mut rng, n_vocab, 6.0) };
            let history: Vec<u32> = (0..100).map(|_| rng.gen_range(0..n_vocab as u32)).collect();
            let params = SamplingParams { top_p: if coarse { 1.0 } else { params.top_p }, ..params };
            let same = draws_agreeing(&mut pair, &logits, &params, &history, 100);
            assert!(same >= 99, "case {case}, vocab {n_vocab}, coarse {coarse}, {params:?}: {same}/100 draws agree");
        }
    }
}

/// Logits shaped like a language model's: a bulk in [-4, 4] and `head` tokens at random ids in
/// [9, 17], which hold all but about 0.1% of the probability at 151,936 tokens.
fn peaked(rng: &mut impl Rng, n_vocab: usize, head: usize) -> Vec<f32> {
    let mut logits: Vec<f32> = (0..n_vocab).map(|_| rng.gen_range(-4.0f32..4.0)).collect();
    for _ in 0..head {
        logits[rng.gen_range(0..n_vocab)] = rng.gen_range(9.0f32..17.0);
    }
    logits
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn threshold_draws_match_cpu_draw_for_draw() {
    // No top-k (or one past what top-k by parts merges), or no cut at all: the parts count their logits in bins,
    // the last gathers the prefix of the ranking that fits 1024 candidates and walks it where it
    // decides every cut (else ranks the whole row). Rows of 1 to 32 parts (49: past the parts'
    // records, the whole row), peaked logits whose nucleus lies in the gathered prefix, a row
    // where parts hold only -inf, and a flat row of 700 tokens gathered whole.
    let mut rng = rng("threshold");
    let mut pair = Pair::new(1, 128);
    let base = SamplingParams { top_k: 0, ..SamplingParams::default() };
    let cases = [
        (151_936, 300, base),
        (151_936, 300, SamplingParams { top_p: 0.9, min_p: 0.0, temperature: 1.0, ..base }),
        (151_936, 300, SamplingParams { top_k: 200, top_p: 1.0, min_p: 0.0, temperature: 1.2, ..base }),
        (151_936, 600, SamplingParams { top_k: 500, top_p: 0.8, min_p: 0.0, repeat_penalty: 1.3, frequency_penalty: 0.2, ..base }),
        (32_000, 100, SamplingParams { top_p: 1.0, min_p: 0.1, ..base }),
        (262_144, 300, base),
        (400_000, 300, base),
        (5_000, 50, SamplingParams { top_p: 0.9, min_p: 0.0, ..base }),
        (700, 0, SamplingParams { top_p: 0.99, min_p: 0.0, temperature: 1.5, ..base }),
        (151_936, 300, SamplingParams { presence_penalty: 0.5, ..base }),
        // Temperature alone: the target from the parts' tempered sums, drawn inside the prefix
        // (all but about 0.1% of the weight at 1.0). Hotter rows, where most draws fall past
        // the prefix into the whole row, are checked as a distribution in
        // whole_vocabulary_sampling_follows_the_exact_distribution.
        (151_936, 300, SamplingParams { top_p: 1.0, min_p: 0.0, temperature: 1.0, ..base }),
        (151_936, 300, SamplingParams { top_p: 1.0, min_p: 0.0, temperature: 0.8, repeat_penalty: 1.3, ..base }),
        (700, 0, SamplingParams { top_p: 1.0, min_p: 0.0, temperature: 1.5, ..base }),
    ];
    for (case, (n_vocab, head, params)) in cases.into_iter().enumerate() {
        let mut logits = if head > 0 { peaked(&mut rng, n_vocab, head) } else { random(&mut rng, n_vocab, 1.5) };
        if case == 9 {
            // Parts 11 to 18 hold only -inf (masked tokens); part 10 a few finite logits.
            logits[80_000..].fill(f32::NEG_INFINITY);
        }
        let history: Vec<u32> = (0..100).map(|_| rng.gen_range(0..n_vocab as u32)).collect();
        let same = draws_agreeing(&mut pair, &logits, &params, &history, 100);
        assert!(same >= 99, "case {case}, vocab {n_vocab}, head {head}, {params:?}: {same}/100 draws agree");
    }
}

/// The CPU sampler's distribution computed in f64: (token, probability) in ranking order.
fn exact_distribution(logits: &[f32], history: &[u32], p: &SamplingParams) -> Vec<(u32, f64)> {
    let mut values = logits.to_vec();
    sampling::apply_repeat_penalty(&mut values, history, p);
    let mut ranked: Vec<(f32, u32)> = values.iter().enumerate().map(|(i, &v)| (v, i as u32)).collect();
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    if p.top_k > 0 {
        ranked.truncate(p.top_k);
    }
    let max = ranked[0].0 as f64;
    let total: f64 = ranked.iter().map(|c| (c.0 as f64 - max).exp()).sum();
    let mut cum = 0.0;
    let keep = ranked.iter().position(|c| {
        cum += (c.0 as f64 - max).exp() / total;
        p.top_p < 1.0 && cum >= p.top_p as f64
    });
    ranked.truncate(keep.map_or(ranked.len(), |i| i + 1));
    let floor = ranked[0].0 + p.min_p.ln();
    let keep = ranked.iter().take_while(|c| p.min_p <= 0.0 || c.0 >= floor).count().max(1);
    ranked.truncate(keep);
    let weights: Vec<f64> = ranked.iter().map(|c| ((c.0 as f64 - max) / p.temperature as f64).exp()).collect();
    let sum: f64 = weights.iter().sum();
    ranked.iter().zip(weights).map(|(c, w)| (c.1, w / sum)).collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn whole_vocabulary_sampling_follows_the_exact_distribution() {
    // More than 1024 candidates: the sampler ranks the whole vocabulary in global memory.
    // Thousands of f32 terms make the CPU's running sums drift by more than one token's
    // weight, so draws are compared as a distribution: GPU samples bucketed into 16 ranges of
    // equal exact (f64) probability, against a chi-square bound.
    let mut rng = rng("whole_vocabulary");
    let mut pair = Pair::new(1, 128);
    let base = SamplingParams::default();
    // (vocabulary, peaked head (0: uniform logits), settings)
    let cases = [
        (50_000, 0, SamplingParams { top_k: 0, top_p: 0.9, min_p: 0.0, temperature: 0.7, ..base }),
        (50_000, 0, SamplingParams { top_k: 2000, top_p: 1.0, min_p: 0.02, temperature: 1.3, ..base }),
        (50_000, 0, SamplingParams { top_k: 0, top_p: 1.0, min_p: 0.05, temperature: 1.0, repeat_penalty: 1.3, ..base }),
        // Temperature alone: every token a candidate.
        (50_000, 0, SamplingParams { top_k: 0, top_p: 1.0, min_p: 0.0, temperature: 1.1, ..base }),
        // Temperature alone on peaked rows so hot that about 45% (2.0) and 85% (3.0) of the
        // weight lies in the bulk: draws inside the gathered prefix and past it, into the whole row.
        (151_936, 300, SamplingParams { top_k: 0, top_p: 1.0, min_p: 0.0, temperature: 2.0, repeat_penalty: 1.3, ..base }),
        (151_936, 300, SamplingParams { top_k: 0, top_p: 1.0, min_p: 0.0, temperature: 3.0, ..base }),
    ];
    let (draws, buckets) = (4000u64, 16usize);
    for (n_vocab, head, params) in cases {
        let logits = if head > 0 { peaked(&mut rng, n_vocab, head) } else { random(&mut rng, n_vocab, 6.0) };
        let history: Vec<u32> = (0..100).map(|_| rng.gen_range(0..n_vocab as u32)).collect();
        let exact = exact_distribution(&logits, &history, &params);
        let mut bucket_of = vec![usize::MAX; n_vocab];
        let mut expected = vec![0f64; buckets];
        let mut cum = 0.0;
        for &(token, prob) in &exact {
            let bucket = (((cum + prob / 2.0) * buckets as f64) as usize).min(buckets - 1);
            bucket_of[token as usize] = bucket;
            expected[bucket] += prob * draws as f64;
            cum += prob;
        }
        let gpu_logits = upload(&pair.gpu, &logits);
        let (mut observed, mut outside) = (vec![0f64; buckets], 0);
        for draw in 0..draws {
            pair.set_step(&[], 0, &SamplingParams { seed: 77, ..params }, &history, draw);
            pair.gpu.sample(view(&gpu_logits, [1, n_vocab]), &mut pair.gpu_step).expect("sample");
            match bucket_of[pair.gpu_tokens(1)[0] as usize] {
                usize::MAX => outside += 1,
                bucket => observed[bucket] += 1.0,
            }
        }
        let chi2: f64 = observed.iter().zip(&expected).map(|(o, e)| (o - e) * (o - e) / e).sum();
        eprintln!("{params:?}: {} candidates, chi-square {chi2:.1} over {buckets} buckets, {outside} outside", exact.len());
        // 15 degrees of freedom: P(chi-square > 45) is about 7e-5. A token just past an f32
        // cut may fall outside the exact set, with the probability of a tail token (~1e-5).
        assert!(chi2 < 45.0, "{params:?}: chi-square {chi2:.1}, observed {observed:?}, expected {expected:?}");
        assert!(outside <= 2, "{params:?}: {outside} draws outside the exact candidate set");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn seeded_draws_repeat_exactly() {
    // Thousands of near-equal weights per radix bin, added by many warps in whatever order they
    // reach it: a seeded draw must still pick the same token every time (the bins sum in fixed
    // point, which no order changes).
    let mut rng = rng("repeat");
    let mut pair = Pair::new(1, 128);
    let n_vocab = 151_936;
    let logits: Vec<f32> = (0..n_vocab).map(|_| rng.gen_range(0.0f32..0.05)).collect();
    let gpu_logits = upload(&pair.gpu, &logits);
    let params = SamplingParams { top_k: 0, top_p: 0.95, min_p: 0.0, temperature: 1.0, seed: 5, ..SamplingParams::default() };
    for draw in 0..40u64 {
        let mut tokens = Vec::new();
        for _ in 0..8 {
            pair.set_step(&[], 0, &params, &[], draw);
            pair.gpu.sample(view(&gpu_logits, [1, n_vocab]), &mut pair.gpu_step).expect("sample");
            tokens.push(pair.gpu_tokens(1)[0]);
        }
        assert!(tokens.iter().all(|&t| t == tokens[0]), "draw {draw}: {tokens:?}");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn sampler_speed_on_a_large_vocabulary() {
    let mut rng = rng("sampler_speed");
    let mut pair = Pair::alone(1, 64);
    let n_vocab = 151_936;
    let flat = upload(&pair.gpu, &random(&mut rng, n_vocab, 6.0));
    let language_like = upload(&pair.gpu, &peaked(&mut rng, n_vocab, 300));
    let history: Vec<u32> = (0..64).map(|_| rng.gen_range(0..n_vocab as u32)).collect();
    let base = SamplingParams::default();
    let no_top_k = SamplingParams { top_k: 0, ..base };
    let cases = [
        ("greedy", SamplingParams::greedy(), &flat),
        ("top-k 40 (defaults)", base, &flat),
        ("defaults + penalty", SamplingParams { repeat_penalty: 1.1, ..base }, &flat),
        ("top-p 0.9 over all, flat logits", SamplingParams { top_p: 0.9, min_p: 0.0, ..no_top_k }, &flat),
        ("temperature alone, flat logits", SamplingParams { top_p: 1.0, min_p: 0.0, ..no_top_k }, &flat),
        ("temperature alone, peaked logits", SamplingParams { top_p: 1.0, min_p: 0.0, ..no_top_k }, &language_like),
        ("top-k 0 (defaults otherwise), peaked logits", no_top_k, &language_like),
        ("top-p 0.9 over all, peaked logits", SamplingParams { top_p: 0.9, min_p: 0.0, ..no_top_k }, &language_like),
        ("top-k 200, peaked logits", SamplingParams { top_k: 200, ..base }, &language_like),
    ];
    let stream = pair.gpu.device().stream().clone();
    let timed = || pair.gpu.device().context().new_event(Some(kiln_cuda::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).expect("event");
    let (start, end) = (timed(), timed());
    for (what, params, logits) in cases {
        pair.set_step(&[], 0, &params, &history, 3);
        let runs = 50;
        pair.gpu.sample(view(logits, [1, n_vocab]), &mut pair.gpu_step).expect("warm-up");
        start.record(&stream).expect("record");
        for _ in 0..runs {
            pair.gpu.sample(view(logits, [1, n_vocab]), &mut pair.gpu_step).expect("sample");
        }
        end.record(&stream).expect("record");
        end.synchronize().expect("sync");
        let micros = start.elapsed_ms(&end).expect("elapsed") as f64 * 1000.0 / runs as f64;
        assert!((pair.gpu_tokens(1)[0] as usize) < n_vocab);
        eprintln!("sample, {n_vocab} tokens, {what}: {micros:.1} us");
    }
}

/// Frequencies of `draws` GPU samples from `logits`.
fn gpu_histogram(pair: &mut Pair, logits: &[f32], params: &SamplingParams, draws: u64) -> Vec<f64> {
    let gpu_logits = upload(&pair.gpu, logits);
    let mut counts = vec![0usize; logits.len()];
    for draw in 0..draws {
        pair.set_step(&[], 0, params, &[], draw);
        pair.gpu.sample(view(&gpu_logits, [1, logits.len()]), &mut pair.gpu_step).expect("sample");
        counts[pair.gpu_tokens(1)[0] as usize] += 1;
    }
    counts.iter().map(|&c| c as f64 / draws as f64).collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn sampling_follows_the_distribution() {
    let mut pair = Pair::new(1, 0);
    let draws = 20_000;
    // Probabilities 0.5, 0.3, 0.2 among 300 tokens, the rest impossible.
    let mut logits = vec![-1e30f32; 300];
    logits[17] = 0.5f32.ln();
    logits[250] = 0.3f32.ln();
    logits[3] = 0.2f32.ln();
    let plain = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 9, ..Default::default() };
    let freq = gpu_histogram(&mut pair, &logits, &plain, draws);
    // Binomial sd at n = 20000 is below 0.0036, so 0.015 is over 4 sd.
    for (token, want) in [(17, 0.5), (250, 0.3), (3, 0.2)] {
        assert!((freq[token] - want).abs() < 0.015, "token {token}: {} vs {want}", freq[token]);
    }
    // Temperature 2 flattens to p^(1/2) normalized; top-p 0.75 then keeps the two best.
    let hot = SamplingParams { temperature: 2.0, ..plain };
    let norm = 0.5f64.sqrt() + 0.3f64.sqrt() + 0.2f64.sqrt();
    let freq = gpu_histogram(&mut pair, &logits, &hot, draws);
    for (token, p) in [(17, 0.5f64), (250, 0.3), (3, 0.2)] {
        assert!((freq[token] - p.sqrt() / norm).abs() < 0.015, "T=2 token {token}: {}", freq[token]);
    }
    let nucleus = SamplingParams { top_p: 0.75, ..plain };
    let freq = gpu_histogram(&mut pair, &logits, &nucleus, draws);
    assert_eq!(freq[3], 0.0, "top-p 0.75 keeps only the two best");
    assert!((freq[17] - 0.625).abs() < 0.015, "top-p renormalized: {}", freq[17]);
    let floor = SamplingParams { min_p: 0.5, ..plain };
    let freq = gpu_histogram(&mut pair, &logits, &floor, draws);
    assert_eq!(freq[3], 0.0, "min-p 0.5 drops p = 0.2 < 0.25");
    assert!((freq[250] - 0.375).abs() < 0.015, "min-p renormalized: {}", freq[250]);
}

/// One step holding several sequences, each sampling its own row with its own settings, seed,
/// draw and history: the GPU sampler must read each sample's row and history from the plan.
/// Greedy and top-k 1 draws are deterministic, so they equal the CPU's; random draws must fall
/// within the candidates their settings allow (computed in f64 from the same row).
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn each_sequence_of_a_step_samples_its_own_row() {
    let mut rng = rng("batched_samples");
    let mut pair = Pair::new(16, 64);
    let base = SamplingParams::default();
    for n_vocab in [7usize, 512, 32_000, 151_936] {
        for round in 0..4u64 {
            let params = [
                SamplingParams::greedy(),
                SamplingParams { repeat_penalty: 1.3, repeat_last_n: 64, ..SamplingParams::greedy() },
                SamplingParams { temperature: 1.7, top_k: 1, seed: round, ..base },
                SamplingParams { top_k: 40, top_p: 1.0, min_p: 0.0, temperature: 0.9, seed: 1000 + round, ..base },
                SamplingParams { top_k: 1, repeat_penalty: 0.7, seed: 7, ..base },
                SamplingParams { top_k: 0, top_p: 1.0, min_p: 0.1, temperature: 1.1, repeat_penalty: 1.1, seed: 2000 + round, ..base },
                SamplingParams { presence_penalty: 1.5, frequency_penalty: 0.7, repeat_last_n: 64, ..SamplingParams::greedy() },
            ];
            let k = params.len();
            // Odd rounds: the first sequence feeds 3 tokens and asks for all their logits, so
            // every later sample draws from a row past its own index.
            let first_rows = if round % 2 == 1 { 3 } else { 1 };
            let tokens: Vec<Vec<u32>> = (0..k).map(|i| vec![0u32; if i == 0 { first_rows } else { 1 }]).collect();
            let n_rows = first_rows + k - 1;
            let logits = random(&mut rng, n_rows * n_vocab, 8.0);
            let row_of_seq = |i: usize| if i == 0 { first_rows - 1 } else { first_rows + i - 1 };
            let histories: Vec<Vec<u32>> = (0..k)
                .map(|i| {
                    let mut h: Vec<u32> = (0..rng.gen_range(0..64)).map(|_| rng.gen_range(0..n_vocab as u32)).collect();
                    // The row's best token in the history, so a penalty changes the outcome.
                    let row = row_of_seq(i);
                    h.push(sampling::argmax(&logits[row * n_vocab..(row + 1) * n_vocab]));
                    h
                })
                .collect();
            let tables: Vec<Vec<u32>> = (0..k).map(|i| shuffled(&mut rng, 10 * i + tokens[i].len())).collect();
            let seqs: Vec<SeqStep> = (0..k)
                .map(|i| SeqStep {
                    tokens: &tokens[i],
                    pos0: 10 * i,
                    blocks: &tables[i],
                    logits: if i == 0 && first_rows > 1 { LogitRows::All } else { LogitRows::Last },
                    sample: Some(SampleSpec { params: params[i], history: &histories[i], draw: round * 100 + i as u64 }),
                })
                .collect();
            pair.set_plan(&seqs);
            assert_eq!(pair.plan.logit_rows.len(), n_rows);
            let (shape, gpu_logits) = ([n_rows, n_vocab], upload(&pair.gpu, &logits));
            pair.cpu.sample(view(&logits, shape), &mut pair.cpu_step).expect("cpu sample");
            pair.gpu.sample(view(&gpu_logits, shape), &mut pair.gpu_step).expect("gpu sample");
            let (cpu, gpu) = (pair.cpu_tokens(k), pair.gpu_tokens(k));
            for (i, p) in params.iter().enumerate() {
                let row = pair.plan.samples[i].logit_row as usize;
                assert_eq!(row, row_of_seq(i));
                let what = format!("vocab {n_vocab}, round {round}, sequence {i} ({p:?})");
                if p.is_greedy() || p.top_k == 1 {
                    assert_eq!(gpu[i], cpu[i], "{what}");
                } else {
                    let candidates = exact_distribution(&logits[row * n_vocab..(row + 1) * n_vocab], &histories[i], p);
                    assert!(candidates.iter().any(|&(t, _)| t == gpu[i]), "{what}: token {} is not a candidate", gpu[i]);
                }
            }
        }
    }
}
