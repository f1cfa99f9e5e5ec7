//! CudaBackend against the CPU reference backend, op by op on fresh random inputs (in the
//! manner of ggml's test-backend-ops: every GPU output is poisoned with NaN before the launch),
//! and decode steps replayed from a captured graph. Every test needs an NVIDIA GPU: run
//! scripts/gpu-tests.sh on the device.
//!
//! The GPU's KV cache cannot be read back, so caches are compared through attention: the same
//! random keys and values are stored into a CPU and a GPU cache of the same type (both quantize
//! identically), and attention of the same queries is computed over both.

mod common;
use common::rng;

use kiln_core::backend::{Activation, AttentionParams, Backend, BackendError, GatedFfn, Linear, NormChain, QkNorm, Qkv, RopeKind, RopeParams, WeightSource};
use kiln_core::plan::{KvCacheSpec, KvType, LogitRows, SampleSpec, SeqStep, KV_BLOCK_SIZE};
use kiln_core::sampling::{self, SamplingParams};
use kiln_cuda::matvec::MAX_MATVEC_TOKENS;
use kiln_models::checks::top2_margin;
use kiln_quant::GgmlType;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
#[path = "common/backends.rs"]
mod backends;
use backends::*;

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn rms_norm_matches_cpu() {
    let mut rng = rng("rms_norm");
    let pair = Pair::new(1, 0);
    for (rows, dim) in [(1, 64), (3, 4096), (7, 8), (5, 513), (2, 1000), (40, 128), (1, 8192)] {
        let x = random(&mut rng, rows * dim, 3.0);
        let weight: Vec<f32> = random(&mut rng, dim, 0.5).iter().map(|w| 1.0 + w).collect();
        let mut want = vec![0f32; rows * dim];
        pair.cpu.rms_norm(view(&x, [rows, dim]), view(&weight, [dim]), view_mut(&mut want, [rows, dim]), 1e-5).expect("cpu");
        let (mut out, gx, gw) = (poisoned(&pair.gpu, rows * dim), upload(&pair.gpu, &x), upload(&pair.gpu, &weight));
        pair.gpu.rms_norm(view(&gx, [rows, dim]), view(&gw, [dim]), view_mut(&mut out, [rows, dim]), 1e-5).expect("gpu");
        // f32 sums of up to 8192 squares in another order: ~1e-7 relative per value.
        assert_close(&format!("rms_norm {rows}x{dim}"), &download(&pair.gpu, &out, rows * dim), &want, 2e-6);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn pointwise_ops_match_cpu() {
    let mut rng = rng("pointwise");
    let pair = Pair::new(1, 0);
    let (cpu, gpu) = (&pair.cpu, &pair.gpu);
    for (n, dim) in [(1, 7), (5, 4096), (3, 1000), (8, 33)] {
        let (x, bias) = (random(&mut rng, n * dim, 4.0), random(&mut rng, dim, 1.0));
        let mut want = x.clone();
        cpu.add_bias(view_mut(&mut want, [n, dim]), view(&bias, [dim])).expect("cpu");
        let (mut got, gbias) = (upload(gpu, &x), upload(gpu, &bias));
        gpu.add_bias(view_mut(&mut got, [n, dim]), view(&gbias, [dim])).expect("gpu");
        assert_bitwise(&format!("add_bias {n}x{dim}"), &download(gpu, &got, n * dim), &want);
    }
    for len in [1, 1000, 65_537] {
        let (x, y) = (random(&mut rng, len, 4.0), random(&mut rng, len, 4.0));
        let mut want = x.clone();
        cpu.add(view_mut(&mut want, [len]), view(&y, [len])).expect("cpu");
        let (mut got, gx, gy) = (upload(gpu, &x), upload(gpu, &x), upload(gpu, &y));
        gpu.add(view_mut(&mut got, [len]), view(&gy, [len])).expect("gpu");
        assert_bitwise(&format!("add {len}"), &download(gpu, &got, len), &want);

        let mut want = vec![0f32; len];
        cpu.swiglu(view(&x, [len]), view(&y, [len]), view_mut(&mut want, [len])).expect("cpu");
        let mut got = poisoned(gpu, len);
        gpu.swiglu(view(&gx, [len]), view(&gy, [len]), view_mut(&mut got, [len])).expect("gpu");
        // expf and Rust's exp differ by an ulp or two.
        assert_close(&format!("swiglu {len}"), &download(gpu, &got, len), &want, 1e-6);

        // copy: exactly the first `len` values, nothing past them (those stay poisoned).
        let src = random(&mut rng, len + 5, 1.0);
        let mut want = vec![f32::NAN; len + 9];
        cpu.copy(view(&src, [len]), view_mut(&mut want, [len])).expect("cpu");
        let (mut got, gsrc) = (poisoned(gpu, len + 9), upload(gpu, &src));
        gpu.copy(view(&gsrc, [len]), view_mut(&mut got, [len])).expect("gpu");
        let got = download(gpu, &got, len + 9);
        assert_bitwise(&format!("copy {len}"), &got[..len], &want[..len]);
        assert!(got[len..].iter().all(|v| v.to_bits() == u32::MAX), "copy {len}: wrote past the end");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn gather_rows_copies_the_plans_logit_rows() {
    let mut rng = rng("gather_rows");
    let mut pair = Pair::new(128, 0);
    // (tokens, logits) per sequence: one sequence with every row, then sequences mixing last
    // rows, all rows and none, so the gathered rows are neither contiguous nor in one block.
    let plans: [&[(usize, LogitRows)]; 4] = [
        &[(1, LogitRows::All)],
        &[(70, LogitRows::All)],
        &[(3, LogitRows::Last), (1, LogitRows::Last), (40, LogitRows::None), (5, LogitRows::All), (9, LogitRows::Last)],
        &[(33, LogitRows::Last), (1, LogitRows::Last), (1, LogitRows::Last), (1, LogitRows::Last)],
    ];
    for seqs in plans {
        let tokens: Vec<Vec<u32>> = seqs.iter().map(|&(n, _)| vec![0u32; n]).collect();
        let tables: Vec<Vec<u32>> = seqs.iter().map(|&(n, _)| contiguous(n)).collect();
        let steps: Vec<SeqStep> =
            seqs.iter().zip(&tokens).zip(&tables).map(|((&(_, logits), tokens), blocks)| SeqStep { tokens, pos0: 0, blocks, logits, sample: None }).collect();
        pair.set_plan(&steps);
        let (n, rows) = (pair.plan.n_tokens(), pair.plan.logit_rows.len());
        for dim in [64, 4096, 37] {
            let src = random(&mut rng, n * dim, 1.0);
            let mut want = vec![0f32; rows * dim];
            pair.cpu.gather_rows(view(&src, [n, dim]), view_mut(&mut want, [rows, dim]), &pair.cpu_step).expect("cpu");
            let (mut got, gsrc) = (poisoned(&pair.gpu, rows * dim), upload(&pair.gpu, &src));
            pair.gpu.gather_rows(view(&gsrc, [n, dim]), view_mut(&mut got, [rows, dim]), &pair.gpu_step).expect("gpu");
            assert_bitwise(&format!("gather_rows {:?} of {n} tokens, dim {dim}", pair.plan.logit_rows), &download(&pair.gpu, &got, rows * dim), &want);
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn rope_matches_cpu_for_both_pairings_deep_into_the_context() {
    let mut rng = rng("rope");
    let mut pair = Pair::new(8, 0);
    for kind in [RopeKind::Normal, RopeKind::Neox] {
        for (n_heads, head_dim, n_rot) in [(4, 64, 64), (8, 128, 128), (2, 8, 8), (3, 80, 32)] {
            for (n, pos0) in [(1, 0), (3, 17), (8, 2999), (1, 4095)] {
                pair.set_positions(n, pos0);
                let (p, shape, table) = (RopeParams { kind }, [n, n_heads, head_dim], [n_rot / 2]);
                let inv_freq: Vec<f32> = (0..n_rot / 2).map(|i| 10000f32.powf(-2.0 * i as f32 / n_rot as f32)).collect();
                let x = random(&mut rng, n * n_heads * head_dim, 2.0);
                let mut want = x.clone();
                pair.cpu.rope(view_mut(&mut want, shape), view(&inv_freq, table), &pair.cpu_step, &p).expect("cpu");
                let (mut got, gfreq) = (upload(&pair.gpu, &x), upload(&pair.gpu, &inv_freq));
                pair.gpu.rope(view_mut(&mut got, shape), view(&gfreq, table), &pair.gpu_step, &p).expect("gpu");
                // Same f32 angle on both sides; sincosf and Rust's sin_cos differ by an ulp or two.
                let what = format!("rope {kind:?} {n_heads}x{head_dim} rot {n_rot}, {n} tokens at {pos0}");
                assert_close(&what, &download(&pair.gpu, &got, x.len()), &want, 2e-6);
            }
        }
    }
}

/// Every pair of cache types: the same keys and values stored at the step's slots on both
/// sides (identical rounding), then read back through attention, in decode-only steps (the
/// split kernels, f32 arithmetic on the stored values): once through each new row's causal
/// view, once over every row of the cache, where a write to any other row would show.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn kv_store_writes_exactly_the_step_rows() {
    let mut rng = rng("kv_store");
    let mut pair = Pair::new(8, 0);
    let (n_heads, n_kv_heads, head_dim) = (6, 3, 32);
    let width = n_kv_heads * head_dim;
    let p = AttentionParams { n_heads, n_kv_heads, head_dim, max_seq_len: CACHE_ROWS, scale: 1.0 / (head_dim as f32).sqrt(), window: None };
    for k_type in KvType::ALL {
        for v_type in KvType::ALL {
            let mut caches = Caches::new(&pair, width, k_type, v_type);
            for shuffle in [false, true] {
                for (n, pos0) in [(1, 0), (8, 13), (3, 3000), (1, 4095)] {
                    let what = format!("{k_type}/{v_type} cache, {n} rows at {pos0}, shuffled {shuffle}");
                    caches.fill_all(&pair, &mut rng);
                    let blocks = table(&mut rng, shuffle, pos0 + n);
                    pair.set_chunks(&[Chunk { n, pos0, table: blocks.clone() }]);
                    let (k, v) = (random(&mut rng, n * width, 1.0), random(&mut rng, n * width, 1.0));
                    pair.cpu.kv_store(view(&k, [n, width]), view(&v, [n, width]), &mut caches.cpu, &pair.cpu_step).expect("cpu");
                    let (gk, gv) = (upload(&pair.gpu, &k), upload(&pair.gpu, &v));
                    pair.gpu.kv_store(view(&gk, [n, width]), view(&gv, [n, width]), &mut caches.gpu, &pair.gpu_step).expect("gpu");

                    pair.set_chunks(&decode_reads(&blocks, pos0..pos0 + n));
                    let (got, want) = attend(&pair, &caches, &mut rng, &p);
                    assert_close(&format!("{what}: the new rows"), &got, &want, SPLIT_TOLERANCE);
                    pair.set_chunks(&decode_reads(&contiguous(CACHE_ROWS), [CACHE_ROWS - 1]));
                    let (got, want) = attend(&pair, &caches, &mut rng, &p);
                    assert_close(&format!("{what}: every row"), &got, &want, SPLIT_TOLERANCE);
                }
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn attention_matches_cpu_for_every_group_size_and_partial_splits() {
    let mut rng = rng("attention");
    let mut pair = Pair::new(16, 0);
    // (query heads, kv heads, head_dim): group sizes 1, 2, 4, 8 and an odd 7, head dims 4..256.
    for (n_heads, n_kv_heads, head_dim) in [(4, 4, 64), (8, 4, 8), (8, 2, 128), (32, 4, 128), (14, 2, 80), (8, 2, 256), (2, 1, 32), (6, 3, 16), (3, 3, 4)] {
        let width = n_kv_heads * head_dim;
        let p = AttentionParams { n_heads, n_kv_heads, head_dim, max_seq_len: CACHE_ROWS, scale: 1.0 / (head_dim as f32).sqrt(), window: None };
        for ty in KvType::ALL {
            if ty.check_width(width).is_err() {
                // q8_0 rows are whole blocks of 32 values: both backends refuse other widths.
                let spec = KvCacheSpec { n_blocks: 1, width, k_type: ty, v_type: ty };
                assert!(pair.cpu.alloc_kv(&spec, "odd width").is_err() && pair.gpu.alloc_kv(&spec, "odd width").is_err(), "{ty} rows of {width}");
                continue;
            }
            let mut caches = Caches::new(&pair, width, ty, ty);
            caches.fill_all(&pair, &mut rng);
            for shuffle in [false, true] {
                let mut steps: Vec<Vec<Chunk>> = Vec::new();
                // One sequence: one token (split kernels) or a chunk (flash kernel).
                for (n, pos0) in [(1, 0), (1, 5), (3, 17), (1, 1000), (8, 2040), (1, 3001), (2, 4094)] {
                    steps.push(vec![Chunk { n, pos0, table: table(&mut rng, shuffle, pos0 + n) }]);
                }
                // One token of each of many sequences of different lengths: the split kernels
                // over several tokens, with fewer splits for shorter sequences and the last
                // split of each partly filled.
                let decode = [0, 5, 31, 32, 33, 1000, 2047, 3001, 4094, 4095];
                steps.push(decode.iter().map(|&pos| Chunk { n: 1, pos0: pos, table: table(&mut rng, shuffle, pos + 1) }).collect());
                // A prefill chunk and decode tokens in one step: the flash kernel for all.
                steps.push(
                    [(8, 2040), (1, 5), (3, 17), (1, 4095)].iter().map(|&(n, pos0)| Chunk { n, pos0, table: table(&mut rng, shuffle, pos0 + n) }).collect(),
                );
                for chunks in steps {
                    pair.set_chunks(&chunks);
                    let (got, want) = attend(&pair, &caches, &mut rng, &p);
                    let seqs: Vec<String> = chunks.iter().map(|c| format!("{}+{}", c.pos0, c.n)).collect();
                    let what = format!("attention {n_heads}/{n_kv_heads} heads of {head_dim}, {ty} cache, shuffled {shuffle}, seqs [{}]", seqs.join(" "));
                    assert_close(&what, &got, &want, attention_tolerance(&pair.plan));
                }
            }
        }
    }
}

/// How close a cache written by the fused prologue stays to the CPU's. The roped keys differ
/// from the CPU's by f32 ulps (sincosf against sin_cos, another reduction order in the norm),
/// which an f32 cache keeps. Rounding to f16 or q8_0 maps nearly all of them to the same code,
/// but a key within those ulps of a rounding midpoint lands one step apart: one f16 ulp
/// (2^-10 relative) or one q8_0 step (amax / 127). Through softmax weights that is up to
/// ~1e-4 (f16) and ~1e-3 (q8_0) relative L2 of the outputs in the worst case (the flipped row
/// dominating a short context). A wrong position, row or norm gives errors of order 1e-1.
fn prologue_cache_tolerance(ty: KvType) -> f64 {
    match ty {
        KvType::F32 => SPLIT_TOLERANCE,
        KvType::F16 => 5e-4,
        KvType::Q8_0 => 5e-3,
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn fused_prologue_matches_the_separate_cpu_ops() {
    let mut rng = rng("prologue");
    let mut pair = Pair::new(8, 0);
    // (q/k norms, the value norm too (Gemma 4), rope)
    for (with_norm, v_norm, kind) in [(false, false, RopeKind::Normal), (true, false, RopeKind::Neox), (true, true, RopeKind::Normal)] {
        for (n_heads, n_kv_heads, head_dim, n_rot) in [(8, 4, 8, 8), (4, 2, 64, 64), (32, 8, 128, 128), (6, 2, 80, 32), (4, 2, 256, 128)] {
            let kv_width = n_kv_heads * head_dim;
            let (rope, freqs) = (RopeParams { kind }, [n_rot / 2]);
            let attn = AttentionParams { n_heads, n_kv_heads, head_dim, max_seq_len: CACHE_ROWS, scale: 1.0 / (head_dim as f32).sqrt(), window: None };
            let inv_freq: Vec<f32> = (0..n_rot / 2).map(|i| 1e6f32.powf(-2.0 * i as f32 / n_rot as f32)).collect();
            let gpu_freq = upload(&pair.gpu, &inv_freq);
            for ty in KvType::ALL {
                let mut caches = Caches::new(&pair, kv_width, ty, ty);
                for (case, (n, pos0)) in [(1, 0), (5, 100), (1, 3000), (2, 4094)].into_iter().enumerate() {
                    let what =
                        format!("prologue norm={with_norm} v_norm={v_norm} {kind:?} {n_heads}/{n_kv_heads}x{head_dim} rot {n_rot}, {ty} cache, {n} at {pos0}");
                    // The earlier positions: the same random rows on both sides.
                    let blocks = table(&mut rng, case % 2 == 1, pos0 + n);
                    caches.fill(&pair, &mut rng, &blocks, pos0 + n);
                    pair.set_chunks(&[Chunk { n, pos0, table: blocks.clone() }]);
                    let (q, k, v) = (random(&mut rng, n * n_heads * head_dim, 2.0), random(&mut rng, n * kv_width, 2.0), random(&mut rng, n * kv_width, 2.0));
                    let (q_norm, k_norm, v_weight) = (random(&mut rng, head_dim, 1.0), random(&mut rng, head_dim, 1.0), random(&mut rng, head_dim, 1.0));

                    let cpu = &pair.cpu;
                    let (q_shape, k_shape, v_shape) = ([n, n_heads, head_dim], [n, n_kv_heads, head_dim], [n, kv_width]);
                    let (mut want_q, mut want_k, mut want_v) = (q.clone(), k.clone(), v.clone());
                    if with_norm {
                        cpu.rms_norm(view(&q, q_shape), view(&q_norm, [head_dim]), view_mut(&mut want_q, q_shape), 1e-6).expect("cpu");
                        cpu.rms_norm(view(&k, k_shape), view(&k_norm, [head_dim]), view_mut(&mut want_k, k_shape), 1e-6).expect("cpu");
                    }
                    if v_norm {
                        cpu.rms_norm(view(&v, k_shape), view(&v_weight, [head_dim]), view_mut(&mut want_v, k_shape), 1e-6).expect("cpu");
                    }
                    cpu.rope(view_mut(&mut want_q, q_shape), view(&inv_freq, freqs), &pair.cpu_step, &rope).expect("cpu");
                    cpu.rope(view_mut(&mut want_k, k_shape), view(&inv_freq, freqs), &pair.cpu_step, &rope).expect("cpu");
                    cpu.kv_store(view(&want_k, v_shape), view(&want_v, v_shape), &mut caches.cpu, &pair.cpu_step).expect("cpu");

                    // The backend's prologue: one launch (a q8_0 cache: a kv_store after it, and
                    // the value norm before it).
                    let gpu = &pair.gpu;
                    let (mut gq, mut gk, gv) = (upload(gpu, &q), upload(gpu, &k), upload(gpu, &v));
                    let (gqn, gkn, gvn) = (upload(gpu, &q_norm), upload(gpu, &k_norm), upload(gpu, &v_weight));
                    let (mut q_scratch, mut k_scratch, mut v_scratch) = (poisoned(gpu, q.len()), poisoned(gpu, k.len()), poisoned(gpu, v.len()));
                    let norms = with_norm.then(|| QkNorm {
                        q: view(&gqn, [head_dim]),
                        k: view(&gkn, [head_dim]),
                        eps: 1e-6,
                        scratch: [view_mut(&mut q_scratch, q_shape), view_mut(&mut k_scratch, k_shape)],
                        v: v_norm.then(|| (view(&gvn, [head_dim]), view_mut(&mut v_scratch, k_shape))),
                    });
                    let qkv = Qkv { q: view_mut(&mut gq, q_shape), k: view_mut(&mut gk, k_shape), v: view(&gv, v_shape) };
                    gpu.attention_prologue(qkv, norms, view(&gpu_freq, freqs), &rope, &mut caches.gpu, &pair.gpu_step).expect("gpu");
                    // As rms_norm and rope above: a few ulps per value.
                    assert_close(&format!("{what}: q"), &download(gpu, &gq, q.len()), &want_q, 2e-6);

                    pair.set_chunks(&decode_reads(&blocks, pos0..pos0 + n));
                    let (got, want) = attend(&pair, &caches, &mut rng, &attn);
                    assert_close(&format!("{what}: cache"), &got, &want, prologue_cache_tolerance(ty));
                }
            }
        }
    }
}

/// Random weights of `ty`: the CPU reads the same quantized bytes the GPU uploads.
fn random_weight(rng: &mut ChaCha8Rng, ty: GgmlType, rows: usize, cols: usize) -> WeightSource {
    weight_source("test.weight", ty, rows, cols, &random(rng, rows * cols, 1.0))
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn embed_and_weight_ops_match_cpu() {
    let mut rng = rng("weights");
    let mut pair = Pair::new(16, 0);
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_K, GgmlType::Q6_K] {
        // 1..8 tokens take the mat-vec kernels, 12 the mat-mat kernel.
        for (rows, cols, n) in [(64, 256, 1), (300, 512, 3), (33, 256, 8), (40, 512, 12)] {
            let tokens: Vec<u32> = (0..n).map(|_| rng.gen_range(0..rows as u32)).collect();
            pair.set_step(&tokens, 0, &SamplingParams::greedy(), &[], 0);
            let what = |op: &str| format!("{op} {ty} {rows}x{cols}, {n} tokens");
            let src = random_weight(&mut rng, ty, rows, cols);
            let (cw, gw) = (pair.cpu.upload_weight(src.clone()).expect("cpu"), pair.gpu.upload_weight(src).expect("gpu"));

            let mut want = vec![0f32; n * cols];
            let (ins, outs) = ([n, cols], [n, rows]);
            pair.cpu.embed(&cw, &pair.cpu_step, view_mut(&mut want, ins)).expect("cpu");
            let mut got = poisoned(&pair.gpu, n * cols);
            pair.gpu.embed(&gw, &pair.gpu_step, view_mut(&mut got, ins)).expect("gpu");
            // Both dequantize the same bytes with exact scale products.
            assert_close(&what("embed"), &download(&pair.gpu, &got, n * cols), &want, 1e-7);

            let x = random(&mut rng, n * cols, 1.0);
            let gx = upload(&pair.gpu, &x);
            let mut want = vec![0f32; n * rows];
            pair.cpu.matmul(&cw, view(&x, ins), view_mut(&mut want, outs)).expect("cpu");
            let mut got = poisoned(&pair.gpu, n * rows);
            pair.gpu.matmul(&gw, view(&gx, ins), view_mut(&mut got, outs)).expect("gpu");
            // Quantized weights meet activations rounded to int8 per 16 values in the mat-vec
            // kernels (documented at about 0.5% relative L2 of the f32 product); float weights
            // in the mat-vec kernels compute in f32 from exactly dequantized weights. Beyond 8
            // tokens the tensor-core mat-mat rounds weights and activations to f16 (f16
            // operands, f32 sums: about 3e-4).
            let tolerance = if n > MAX_MATVEC_TOKENS {
                MATMAT_TOLERANCE
            } else if matches!(ty, GgmlType::F32 | GgmlType::F16) {
                1e-5
            } else {
                1e-2
            };
            assert_close(&what("matmul"), &download(&pair.gpu, &got, n * rows), &want, tolerance);

            let residual = random(&mut rng, n * rows, 1.0);
            let mut want_sum = residual.clone();
            let mut tmp = vec![0f32; n * rows];
            pair.cpu.matmul_add(&cw, view(&x, ins), view_mut(&mut want_sum, outs), view_mut(&mut tmp, outs)).expect("cpu");
            let (mut got_sum, mut gtmp) = (upload(&pair.gpu, &residual), poisoned(&pair.gpu, n * rows));
            pair.gpu.matmul_add(&gw, view(&gx, ins), view_mut(&mut got_sum, outs), view_mut(&mut gtmp, outs)).expect("gpu");
            assert_close(&what("matmul_add"), &download(&pair.gpu, &got_sum, n * rows), &want_sum, tolerance);

            let up_src = random_weight(&mut rng, ty, rows, cols);
            let (cu, gu) = (pair.cpu.upload_weight(up_src.clone()).expect("cpu"), pair.gpu.upload_weight(up_src).expect("gpu"));
            for act in [Activation::Silu, Activation::GeluTanh] {
                let mut want = vec![0f32; n * rows];
                let (mut s1, mut s2) = (vec![0f32; n * rows], vec![0f32; n * rows]);
                let scratch = [view_mut(&mut s1, outs), view_mut(&mut s2, outs)];
                pair.cpu.ffn_gate_up(([&cw, &cu], act), view(&x, ins), scratch, view_mut(&mut want, outs)).expect("cpu");
                let mut got = poisoned(&pair.gpu, n * rows);
                let (mut g1, mut g2) = (poisoned(&pair.gpu, n * rows), poisoned(&pair.gpu, n * rows));
                let scratch = [view_mut(&mut g1, outs), view_mut(&mut g2, outs)];
                pair.gpu.ffn_gate_up(([&gw, &gu], act), view(&gx, ins), scratch, view_mut(&mut got, outs)).expect("gpu");
                assert_close(&what(&format!("ffn_gate_up {act:?}")), &download(&pair.gpu, &got, n * rows), &want, 2.0 * tolerance);
            }
        }
    }
}

/// The fused RMSNorm + int8 quantization (rms_norm_quantize_q8) and the backend ops built on it
/// (norm_matmuls, norm_ffn_gate_up) against rms_norm followed by the f32-input products.
/// Row lengths: 4096, odd multiples of 96 (partial 512-value tiles) and rows short enough for
/// the one-warp norm reduction; 1, 3 and 8 tokens take the mat-vec kernels, 12 and 40 the
/// tensor-core mat-mat, whose shapes the separate products measure first, so the fused ops
/// then take the norm that writes the products' f16 input itself.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn fused_norm_quantize_matches_norm_then_product() {
    use kiln_cuda::matvec::{self, QuantizedActivations};
    let mut rng = rng("fused_norm_quantize");
    let pair = Pair::new(1, 0);
    let (gpu, device) = (&pair.gpu, pair.gpu.device());
    let (q_rows, kv_rows, eps) = (200, 64, 1e-5);
    for (ty, dims) in [(GgmlType::Q8_0, [4096, 480, 1440]), (GgmlType::Q4_K, [5120, 256, 3840])] {
        for dim in dims {
            let sources: Vec<WeightSource> = [q_rows, kv_rows, kv_rows, q_rows].iter().map(|&rows| random_weight(&mut rng, ty, rows, dim)).collect();
            let gw: Vec<_> = sources.iter().map(|s| gpu.upload_weight(s.clone()).expect("gpu weight")).collect();
            let cw: Vec<_> = sources.iter().map(|s| pair.cpu.upload_weight(s.clone()).expect("cpu weight")).collect();
            let (wq, wk, wv, w_up) = (&gw[0], &gw[1], &gw[2], &gw[3]);
            for n in [1, 3, 8, 12, 40] {
                let what = |op: &str| format!("{op} {ty} dim {dim}, {n} tokens");
                let x = random(&mut rng, n * dim, 3.0);
                let norm: Vec<f32> = random(&mut rng, dim, 0.5).iter().map(|w| 1.0 + w).collect();
                let (gx, g_norm) = (upload(gpu, &x), upload(gpu, &norm));
                let mut h = poisoned(gpu, n * dim);
                let (rows, q_out, kv_out) = ([n, dim], [n, q_rows], [n, kv_rows]);
                gpu.rms_norm(view(&gx, rows), view(&g_norm, [dim]), view_mut(&mut h, rows), eps).expect("rms_norm");
                let separate = |w: &matvec::GpuWeight, rows: usize| {
                    let mut out = poisoned(gpu, n * rows);
                    matvec::matmul(device, w, &h, &mut out, n).expect("matmul");
                    download(gpu, &out, n * rows)
                };
                let (want_q, want_k, want_v) = (separate(wq, q_rows), separate(wk, kv_rows), separate(wv, kv_rows));
                // Both paths normalize with the same reduction code (kernels/norm.cuh), so the
                // normed values, hence the int8 codes and scales, are bit-identical and the same
                // mat-vec kernel runs: the outputs agree exactly. 1e-6 still fails on any single
                // flipped int8 code (a shift of ~d * |w|, about 3e-4 of one output, ~3e-5 of a
                // case), which is what an f32 rounding difference in the norm would cause.
                let exact = 1e-6;
                if n <= matvec::MAX_MATVEC_TOKENS {
                    let buffer = QuantizedActivations::new(device, matvec::MAX_MATVEC_TOKENS, dim).expect("buffer");
                    matvec::rms_norm_quantize(device, &gx, &g_norm, eps, n, &buffer).expect("rms_norm_quantize");
                    let mut got = poisoned(gpu, n * q_rows);
                    matvec::matmul_quantized(device, wq, &buffer, None, &mut got, n, false).expect("matmul_quantized");
                    assert_close(&what("rms_norm_quantize + matmul_quantized"), &download(gpu, &got, n * q_rows), &want_q, exact);
                    assert!(
                        matches!(
                            matvec::rms_norm_quantize(device, &gx, &upload(gpu, &norm[..dim - 16]), eps, n, &buffer),
                            Err(kiln_cuda::CudaError::InvalidArgument { .. })
                        ),
                        "{}",
                        what("short norm weight")
                    );
                }

                let (mut q, mut k, mut v) = (poisoned(gpu, n * q_rows), poisoned(gpu, n * kv_rows), poisoned(gpu, n * kv_rows));
                let mut scratch = poisoned(gpu, n * dim);
                let out = [view_mut(&mut q, q_out), view_mut(&mut k, kv_out), view_mut(&mut v, kv_out)];
                let norm_eps = (view(&g_norm, [dim]), eps);
                gpu.norm_matmuls(view(&gx, rows), norm_eps, view_mut(&mut scratch, rows), [wq, wk, wv].map(Linear::plain), out, None).expect("norm_matmuls");
                // Past the mat-vec range q, k and v go through one stacked mat-mat launch, whose
                // measured shape (and so its decode rounding and split-K order) may differ from
                // each product's own: they are checked against the CPU below instead.
                if n <= matvec::MAX_MATVEC_TOKENS {
                    assert_close(&what("norm_matmuls q"), &download(gpu, &q, n * q_rows), &want_q, exact);
                    assert_close(&what("norm_matmuls k"), &download(gpu, &k, n * kv_rows), &want_k, exact);
                    assert_close(&what("norm_matmuls v"), &download(gpu, &v, n * kv_rows), &want_v, exact);
                }
                if n > matvec::MAX_MATVEC_TOKENS {
                    // The mat-mat path norms into h itself (rms_norm_half_f32, which also writes
                    // the products' f16 input): bit for bit rms_norm's values.
                    assert_eq!(download(gpu, &scratch, n * dim), download(gpu, &h, n * dim), "{}", what("normed rows"));
                }
                // Against the CPU as well, so a fault shared by both GPU paths shows: int8
                // activations cost ~0.5% relative L2 in the mat-vec kernels; the mat-mat (n > 8)
                // multiplies f16 operands (weights and activations rounded to f16, f32 sums).
                let tolerance = if n <= matvec::MAX_MATVEC_TOKENS { 1e-2 } else { MATMAT_TOLERANCE };
                let mut cpu_h = vec![0f32; n * dim];
                let mut cpu_q = vec![0f32; n * q_rows];
                let (mut cpu_k, mut cpu_v) = (vec![0f32; n * kv_rows], vec![0f32; n * kv_rows]);
                let out = [view_mut(&mut cpu_q, q_out), view_mut(&mut cpu_k, kv_out), view_mut(&mut cpu_v, kv_out)];
                let cpu_norm = (view(&norm, [dim]), eps);
                pair.cpu
                    .norm_matmuls(view(&x, rows), cpu_norm, view_mut(&mut cpu_h, rows), [&cw[0], &cw[1], &cw[2]].map(Linear::plain), out, None)
                    .expect("cpu");
                let (q, k, v) = (download(gpu, &q, n * q_rows), download(gpu, &k, n * kv_rows), download(gpu, &v, n * kv_rows));
                assert_close(&what("norm_matmuls q vs cpu"), &q, &cpu_q, tolerance);
                assert_close(&what("norm_matmuls k vs cpu"), &k, &cpu_k, tolerance);
                assert_close(&what("norm_matmuls v vs cpu"), &v, &cpu_v, tolerance);

                // Biases on q and v (qwen2, gpt-oss), which the mat-vec adds in its own launch:
                // the same products plus the bias, up to the rounding of one addition.
                let (bq, bv) = (random(&mut rng, q_rows, 1.0), random(&mut rng, kv_rows, 1.0));
                let (gbq, gbv) = (upload(gpu, &bq), upload(gpu, &bv));
                let (mut q2, mut k2, mut v2) = (poisoned(gpu, n * q_rows), poisoned(gpu, n * kv_rows), poisoned(gpu, n * kv_rows));
                let out = [view_mut(&mut q2, q_out), view_mut(&mut k2, kv_out), view_mut(&mut v2, kv_out)];
                let linears = [Linear::new(wq, Some(view(&gbq, [q_rows]))), Linear::plain(wk), Linear::new(wv, Some(view(&gbv, [kv_rows])))];
                gpu.norm_matmuls(view(&gx, rows), norm_eps, view_mut(&mut scratch, rows), linears, out, None).expect("norm_matmuls with biases");
                let plus = |x: &[f32], bias: &[f32]| x.iter().enumerate().map(|(i, v)| v + bias[i % bias.len()]).collect::<Vec<f32>>();
                assert_close(&what("norm_matmuls q with bias"), &download(gpu, &q2, n * q_rows), &plus(&q, &bq), exact);
                assert_close(&what("norm_matmuls k beside biases"), &download(gpu, &k2, n * kv_rows), &k, exact);
                assert_close(&what("norm_matmuls v with bias"), &download(gpu, &v2, n * kv_rows), &plus(&v, &bv), exact);
                // A bias shorter than its weight's rows is refused, on either path.
                let out = [view_mut(&mut q2, q_out), view_mut(&mut k2, kv_out), view_mut(&mut v2, kv_out)];
                let short = [Linear::new(wq, Some(view(&gbq, [q_rows - 1]))), Linear::plain(wk), Linear::plain(wv)];
                let refused = gpu.norm_matmuls(view(&gx, rows), norm_eps, view_mut(&mut scratch, rows), short, out, None);
                assert!(refused.is_err(), "{}", what("a short q bias"));

                let mut want_ffn = poisoned(gpu, n * q_rows);
                matvec::matmul_swiglu(device, wq, w_up, &h, &mut want_ffn, n).expect("matmul_swiglu");
                let want_ffn = download(gpu, &want_ffn, n * q_rows);
                let mut got = poisoned(gpu, n * q_rows);
                let (mut gate, mut up) = (poisoned(gpu, n * q_rows), poisoned(gpu, n * q_rows));
                let gate_up = [view_mut(&mut gate, q_out), view_mut(&mut up, q_out)];
                gpu.norm_ffn_gate_up(
                    view(&gx, rows),
                    norm_eps,
                    view_mut(&mut scratch, rows),
                    ([wq, w_up], Activation::Silu),
                    gate_up,
                    view_mut(&mut got, q_out),
                )
                .expect("norm_ffn_gate_up");
                let got = download(gpu, &got, n * q_rows);
                assert_close(&what("norm_ffn_gate_up"), &got, &want_ffn, exact);
                let mut cpu_out = vec![0f32; n * q_rows];
                let (mut s1, mut s2) = (vec![0f32; n * q_rows], vec![0f32; n * q_rows]);
                let gate_up = [view_mut(&mut s1, q_out), view_mut(&mut s2, q_out)];
                pair.cpu
                    .norm_ffn_gate_up(
                        view(&x, rows),
                        cpu_norm,
                        view_mut(&mut cpu_h, rows),
                        ([&cw[0], &cw[3]], Activation::Silu),
                        gate_up,
                        view_mut(&mut cpu_out, q_out),
                    )
                    .expect("cpu");
                // silu(g) * u combines the errors of two products.
                assert_close(&what("norm_ffn_gate_up vs cpu"), &got, &cpu_out, 2.0 * tolerance);
            }
        }
    }
}

/// The dense SwiGLU FFN added to the residual in one backend call (`norm_gated_ffn_add`),
/// against the same ops called one by one: where the SwiGLU launch also stores the down
/// product's int8 input, its codes come from its f32 values by the same quantize_chunk. The
/// storing launch may take another shape than the plain one (the tuner credits it with the
/// launch it saves), which sums in another order, so a stored code can round the other way at
/// a tie: 1e-4 relative L2 on the residual (one code step moves one value by 1/127 of its
/// chunk's largest). Against the CPU within the int8 activations' error (two products: 2e-2).
/// An FFN width of whole tiles (1,024) and one without (1,040: never stored); 1, 3 and 12
/// tokens. The same for the FFN into an output of its own (`norm_gated_ffn`). SwiGLU and
/// GeGLU (Gemma) alike.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn fused_gated_ffn_matches_its_ops_one_by_one() {
    let mut rng = rng("swiglu_ffn_add");
    let pair = Pair::new(1, 0);
    let (gpu, dim, eps) = (&pair.gpu, 512, 1e-5);
    for (ty, act) in [GgmlType::Q1_0, GgmlType::Q4_K].into_iter().flat_map(|ty| [(ty, Activation::Silu), (ty, Activation::GeluTanh)]) {
        for ff in [1024, 1040] {
            if ff % ty.block_size() != 0 {
                continue;
            }
            let sources = [random_weight(&mut rng, ty, ff, dim), random_weight(&mut rng, ty, ff, dim), random_weight(&mut rng, ty, dim, ff)];
            let gw: Vec<_> = sources.iter().map(|s| gpu.upload_weight(s.clone()).expect("gpu weight")).collect();
            let cw: Vec<_> = sources.iter().map(|s| pair.cpu.upload_weight(s.clone()).expect("cpu weight")).collect();
            for n in [1, 3, 12] {
                let what = format!("{ty} {act:?} FFN {dim} -> {ff}, {n} tokens");
                let x = random(&mut rng, n * dim, 3.0);
                let norm: Vec<f32> = random(&mut rng, dim, 0.5).iter().map(|w| 1.0 + w).collect();
                let g_norm = upload(gpu, &norm);
                let (rows, wide) = ([n, dim], [n, ff]);
                let run = |fused: bool| {
                    let mut gx = upload(gpu, &x);
                    let (mut h, mut activated, mut tmp) = (poisoned(gpu, n * dim), poisoned(gpu, n * ff), poisoned(gpu, n * dim));
                    let (mut s1, mut s2) = (poisoned(gpu, n * ff), poisoned(gpu, n * ff));
                    let scratch = [view_mut(&mut s1, wide), view_mut(&mut s2, wide)];
                    let norm_eps = (view(&g_norm, [dim]), eps);
                    if fused {
                        gpu.norm_gated_ffn_add(
                            view_mut(&mut gx, rows),
                            norm_eps,
                            view_mut(&mut h, rows),
                            GatedFfn { gate: &gw[0], up: &gw[1], down: &gw[2], act },
                            scratch,
                            view_mut(&mut activated, wide),
                            view_mut(&mut tmp, rows),
                            NormChain::default(),
                        )
                        .expect("norm_gated_ffn_add");
                    } else {
                        gpu.norm_ffn_gate_up(
                            view(&gx, rows),
                            norm_eps,
                            view_mut(&mut h, rows),
                            ([&gw[0], &gw[1]], act),
                            scratch,
                            view_mut(&mut activated, wide),
                        )
                        .expect("gate/up");
                        gpu.matmul_add(&gw[2], view(&activated, wide), view_mut(&mut gx, rows), view_mut(&mut tmp, rows)).expect("down");
                    }
                    download(gpu, &gx, n * dim)
                };
                let (got, want) = (run(true), run(false));
                assert_close(&format!("{what}: against the ops one by one"), &got, &want, 1e-4);
                let mut cpu_x = x.clone();
                let (mut h, mut activated, mut tmp) = (vec![0f32; n * dim], vec![0f32; n * ff], vec![0f32; n * dim]);
                let (mut s1, mut s2) = (vec![0f32; n * ff], vec![0f32; n * ff]);
                let scratch = [view_mut(&mut s1, wide), view_mut(&mut s2, wide)];
                pair.cpu
                    .norm_gated_ffn_add(
                        view_mut(&mut cpu_x, rows),
                        (view(&norm, [dim]), eps),
                        view_mut(&mut h, rows),
                        GatedFfn { gate: &cw[0], up: &cw[1], down: &cw[2], act },
                        scratch,
                        view_mut(&mut activated, wide),
                        view_mut(&mut tmp, rows),
                        NormChain::default(),
                    )
                    .expect("cpu");
                let tolerance = if n <= MAX_MATVEC_TOKENS { 2e-2 } else { 2.0 * MATMAT_TOLERANCE };
                assert_close(&format!("{what} vs cpu"), &got, &cpu_x, tolerance);

                // The same FFN into an output of its own (`norm_gated_ffn`, a shared expert).
                let into = |fused: bool| {
                    let gx = upload(gpu, &x);
                    let (mut h, mut activated, mut out) = (poisoned(gpu, n * dim), poisoned(gpu, n * ff), poisoned(gpu, n * dim));
                    let (mut s1, mut s2) = (poisoned(gpu, n * ff), poisoned(gpu, n * ff));
                    let scratch = [view_mut(&mut s1, wide), view_mut(&mut s2, wide)];
                    let norm_eps = (view(&g_norm, [dim]), eps);
                    if fused {
                        let ffn = GatedFfn { gate: &gw[0], up: &gw[1], down: &gw[2], act };
                        gpu.norm_gated_ffn(
                            view(&gx, rows),
                            norm_eps,
                            view_mut(&mut h, rows),
                            ffn,
                            scratch,
                            view_mut(&mut activated, wide),
                            view_mut(&mut out, rows),
                        )
                        .expect("norm_gated_ffn");
                    } else {
                        gpu.norm_ffn_gate_up(
                            view(&gx, rows),
                            norm_eps,
                            view_mut(&mut h, rows),
                            ([&gw[0], &gw[1]], act),
                            scratch,
                            view_mut(&mut activated, wide),
                        )
                        .expect("gate/up");
                        gpu.matmul(&gw[2], view(&activated, wide), view_mut(&mut out, rows)).expect("down");
                    }
                    download(gpu, &out, n * dim)
                };
                let got_into = into(true);
                assert_close(&format!("{what}, into its own output: against the ops one by one"), &got_into, &into(false), 1e-4);
                let cpu_ffn: Vec<f32> = cpu_x.iter().zip(&x).map(|(sum, x)| sum - x).collect();
                assert_close(&format!("{what}, into its own output, vs cpu"), &got_into, &cpu_ffn, tolerance);
            }
        }
    }
}

/// Two SwiGLU FFNs and a stacked q/k/v product passing their norms along (`NormChain`): the
/// first FFN's down product prepares the second's norm, the second's the norm of the products
/// after it, each where its launch shape allows; against the same calls each normalizing
/// itself. The prepared input quantizes `x * weight` and its readers apply 1 / rms, so codes
/// can differ from the separate norm's only at rounding ties (one step of a 16-value chunk's
/// scale), and sums differ in order: 1e-3 relative L2 on the outputs, 1e-5 on the residual.
/// At least one case must have prepared a norm, else the chain went untested; several tokens
/// never do (the chain is for one token: norm_chain.rs's MAX_CHAINED_TOKENS).
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn ffns_pass_prepared_norms_to_the_products_after_them() {
    let mut rng = rng("norm_chain");
    let pair = Pair::new(1, 0);
    let (gpu, eps, ff) = (&pair.gpu, 1e-5, 1024);
    let mut prepared_cases = 0;
    for ty in [GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q1_0] {
        for dim in [512, 1024] {
            let mut weight = |rows, cols| gpu.upload_weight(random_weight(&mut rng, ty, rows, cols)).expect("gpu weight");
            let ffns: Vec<[_; 3]> = (0..2).map(|_| [weight(ff, dim), weight(ff, dim), weight(dim, ff)]).collect();
            let qkv = [weight(dim, dim), weight(dim / 4, dim), weight(dim / 4, dim)];
            for n in [1, 3] {
                let what = format!("{ty} dim {dim}, {n} tokens");
                let x = random(&mut rng, n * dim, 3.0);
                let norms: Vec<_> = (0..3).map(|_| upload(gpu, &random(&mut rng, dim, 0.5).iter().map(|w| 1.0 + w).collect::<Vec<_>>())).collect();
                let (rows, wide) = ([n, dim], [n, ff]);
                let run = |chained: bool| {
                    let mut gx = upload(gpu, &x);
                    let (mut h, mut act, mut tmp) = (poisoned(gpu, n * dim), poisoned(gpu, n * ff), poisoned(gpu, n * dim));
                    let (mut s1, mut s2) = (poisoned(gpu, n * ff), poisoned(gpu, n * ff));
                    let mut prepared = None;
                    let mut count = 0;
                    for (i, w) in ffns.iter().enumerate() {
                        let next = chained.then(|| (view(&norms[i + 1], [dim]), eps));
                        let chain = NormChain { prepared: prepared.take(), next };
                        let scratch = [view_mut(&mut s1, wide), view_mut(&mut s2, wide)];
                        let norm = (view(&norms[i], [dim]), eps);
                        let ffn = GatedFfn { gate: &w[0], up: &w[1], down: &w[2], act: Activation::Silu };
                        prepared = gpu
                            .norm_gated_ffn_add(
                                view_mut(&mut gx, rows),
                                norm,
                                view_mut(&mut h, rows),
                                ffn,
                                scratch,
                                view_mut(&mut act, wide),
                                view_mut(&mut tmp, rows),
                                chain,
                            )
                            .expect("norm_gated_ffn_add");
                        count += usize::from(prepared.is_some());
                    }
                    let (mut q, mut k, mut v) = (poisoned(gpu, n * dim), poisoned(gpu, n * dim / 4), poisoned(gpu, n * dim / 4));
                    let out = [view_mut(&mut q, rows), view_mut(&mut k, [n, dim / 4]), view_mut(&mut v, [n, dim / 4])];
                    let norm = (view(&norms[2], [dim]), eps);
                    gpu.norm_matmuls(view(&gx, rows), norm, view_mut(&mut h, rows), [&qkv[0], &qkv[1], &qkv[2]].map(Linear::plain), out, prepared)
                        .expect("norm_matmuls");
                    let outputs = [download(gpu, &q, n * dim), download(gpu, &k, n * dim / 4), download(gpu, &v, n * dim / 4)];
                    (download(gpu, &gx, n * dim), outputs, count)
                };
                let ((x_chained, chained, count), (x_alone, alone, none)) = (run(true), run(false));
                assert_eq!(none, 0, "{what}: a norm prepared without a next norm");
                assert!(n == 1 || count == 0, "{what}: {count} norms prepared for several tokens");
                prepared_cases += count;
                assert_close(&format!("{what}: residual"), &x_chained, &x_alone, 1e-5);
                // The prepared codes are those of x * w, not x * w / rms: equal but at rounding
                // ties, where a code moves by one step (1/127 of its block's largest value),
                // about 8e-4 of an output's norm at dim 512. 3e-3 allows a dozen such codes; a
                // wrong norm weight or scale is off by 1e-1 or more.
                for (name, (got, want)) in ["q", "k", "v"].iter().zip(chained.iter().zip(&alone)) {
                    assert_close(&format!("{what}: {name} ({count} norms prepared)"), got, want, 3e-3);
                }
            }
        }
    }
    assert!(prepared_cases > 0, "no launch shape prepared a norm: the chain went untested");
}

/// Samples on both backends from the same logits and step values.

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn captured_steps_replay_with_each_steps_values() {
    // A decode-like step (rope, KV store, attention, greedy sample) run through run_step:
    // the first call runs directly, the second captures, the rest replay the graph. The
    // sequence's block table is shuffled and grows by one block every 32 positions.
    let mut rng = rng("graph");
    let mut pair = Pair::new(1, 0);
    let (n_heads, n_kv_heads, head_dim, n_ctx) = (8, 2, 64, 512);
    let (q_width, kv_width) = (n_heads * head_dim, n_kv_heads * head_dim);
    let rope = RopeParams { kind: RopeKind::Neox };
    let (q_heads, k_heads, table_len) = ([1, n_heads, head_dim], [1, n_kv_heads, head_dim], [head_dim / 2]);
    let attn = AttentionParams { n_heads, n_kv_heads, head_dim, max_seq_len: n_ctx, scale: 0.125, window: None };
    let inv_freq: Vec<f32> = (0..head_dim / 2).map(|i| 10000f32.powf(-2.0 * i as f32 / head_dim as f32)).collect();
    let gpu_freq = upload(&pair.gpu, &inv_freq);
    let mut caches = Caches::new(&pair, kv_width, KvType::F16, KvType::F16);
    let blocks = shuffled(&mut rng, n_ctx);
    let (mut gq, mut gk, mut gv) = (poisoned(&pair.gpu, q_width), poisoned(&pair.gpu, kv_width), poisoned(&pair.gpu, kv_width));
    let mut g_out = poisoned(&pair.gpu, q_width);
    let greedy = SampleSpec { params: SamplingParams::greedy(), history: &[], draw: 0 };
    for pos in 0..300usize {
        let (q, k, v) = (random(&mut rng, q_width, 2.0), random(&mut rng, kv_width, 1.0), random(&mut rng, kv_width, 1.0));
        let table = &blocks[..(pos + 1).div_ceil(KV_BLOCK_SIZE)];
        pair.set_plan(&[SeqStep { tokens: &[0], pos0: pos, blocks: table, logits: LogitRows::Last, sample: Some(greedy) }]);
        let (mut cq, mut ck) = (q.clone(), k.clone());
        let mut c_out = vec![0f32; q_width];
        let cpu = &pair.cpu;
        cpu.rope(view_mut(&mut cq, q_heads), view(&inv_freq, table_len), &pair.cpu_step, &rope).expect("cpu");
        cpu.rope(view_mut(&mut ck, k_heads), view(&inv_freq, table_len), &pair.cpu_step, &rope).expect("cpu");
        cpu.kv_store(view(&ck, [1, kv_width]), view(&v, [1, kv_width]), &mut caches.cpu, &pair.cpu_step).expect("cpu");
        cpu.attention(view(&cq, [1, q_width]), &caches.cpu, view_mut(&mut c_out, [1, q_width]), &pair.cpu_step, &attn).expect("cpu");
        cpu.sample(view(&c_out, [1, q_width]), &mut pair.cpu_step).expect("cpu");

        // Host uploads stay outside the recorded step, as in the model.
        let gpu = &pair.gpu;
        gpu.write(&mut gq, &q).expect("write");
        gpu.write(&mut gk, &k).expect("write");
        gpu.write(&mut gv, &v).expect("write");
        let (step, cache) = (&mut pair.gpu_step, &mut caches.gpu);
        gpu.run_step(7, &mut || {
            gpu.rope(view_mut(&mut gq, q_heads), view(&gpu_freq, table_len), step, &rope)?;
            gpu.rope(view_mut(&mut gk, k_heads), view(&gpu_freq, table_len), step, &rope)?;
            gpu.kv_store(view(&gk, [1, kv_width]), view(&gv, [1, kv_width]), cache, step)?;
            gpu.attention(view(&gq, [1, q_width]), cache, view_mut(&mut g_out, [1, q_width]), step, &attn)?;
            gpu.sample(view(&g_out, [1, q_width]), step)
        })
        .expect("run_step");
        let got = download(gpu, &g_out, q_width);
        // The keys are roped on each side (f32 ulps apart) before the f16 store: a key within
        // those ulps of a rounding midpoint is stored one f16 ulp apart (as in the prologue
        // test), up to ~1e-4 relative at the shortest contexts. A stale position, row or
        // table gives errors of order 1e-1.
        let (rel_l2, max_abs) = errors(&format!("step at {pos}"), &got, &c_out);
        assert!(rel_l2 <= 5e-4, "step at {pos}: rel_l2 {rel_l2:.3e} (max_abs {max_abs:.3e})");
        // The replayed sampler read this step's outputs; the CPU's token must match wherever
        // the outputs' difference cannot reorder the top two.
        let token = pair.gpu_tokens(1)[0];
        assert_eq!(token, sampling::argmax(&got), "sampled token at {pos}: not the argmax of this step's output");
        if f64::from(top2_margin(&c_out)) > 2.0 * max_abs {
            assert_eq!(token, pair.cpu_tokens(1)[0], "sampled token at {pos}");
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn impossible_allocations_are_out_of_memory_errors() {
    let _gpu_use = shared_gpu();
    let gpu = gpu();
    let (_, total) = gpu.device().memory_info().expect("memory info");
    match gpu.alloc(total, "huge buffer") {
        Err(BackendError::OutOfMemory { what, requested_bytes, .. }) => {
            assert_eq!(what, "huge buffer");
            assert_eq!(requested_bytes, total as u64 * 4);
        }
        other => panic!("expected OutOfMemory, got {:?}", other.map(|b| b.len())),
    }
}

// ---- Whole models against shared/testdata ----
