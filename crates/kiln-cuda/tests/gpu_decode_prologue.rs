//! The attention prologue taken by the decode attention kernel (`AttentionArgs::prologue`,
//! `paged_attention_split_mma_prologue`) against the CPU's separate prologue, attention and
//! output product, and the attention handing its output to its product (`attention_matmul`),
//! on fresh random inputs. Needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device.

mod common;
use common::rng;

use kiln_core::backend::{AttentionArgs, AttentionParams, Backend, DeferredPrologue, Linear, QkNorm, Qkv, RopeKind, RopeParams};
use kiln_core::plan::{KvType, KV_BLOCK_SIZE};
use kiln_quant::GgmlType;
use rand::seq::SliceRandom;
#[path = "common/backends.rs"]
mod backends;
use backends::*;

/// The GPU's queries and keys are normed and roped by the same f32 code as the CPU's up to a
/// few ulps, which can flip an f16 rounding of a key (2^-11 relative) in either cache: up to a
/// few 1e-4 relative L2 of the attention output, as in gpu_backend's prologue test. A wrong
/// position, row, split or norm gives errors of order 1e-1.
const OUT_TOLERANCE: f64 = 5e-4;
/// The output product's int8 activations (per 16 values) against the CPU's f32 ones: about
/// 0.5% relative L2 of the product, diluted by the residual it is added to.
const RESIDUAL_TOLERANCE: f64 = 1e-2;
const EMBD: usize = 256;

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn decode_attention_with_its_prologue_matches_the_separate_cpu_ops() {
    let mut rng = rng("decode_attention_with_its_prologue");
    // Positions of the step's sequences (one token each): a first token, spans inside one
    // split's rows, just past them (a second split holding one row), and long ones whose
    // token lies in the last of many splits.
    let positions = [0usize, 40, 255, 256, 700, 3000];
    let n = positions.len();
    let mut pair = Pair::new(n, 0);
    // (heads, kv heads, head dim, rotated dims, q/k norms, rope kind): Qwen3 and Llama 3
    // shapes, 8 and 7 query heads a kv head, one (with partial rope), heads of 64 and 80.
    let shapes = [
        (32, 8, 128, 128, true, RopeKind::Neox),
        (32, 8, 128, 128, false, RopeKind::Normal),
        (16, 2, 64, 64, true, RopeKind::Normal),
        (28, 4, 128, 128, false, RopeKind::Neox),
        (8, 8, 128, 64, true, RopeKind::Neox),
        (6, 2, 80, 32, false, RopeKind::Normal),
    ];
    for (i, (n_heads, n_kv_heads, head_dim, n_rot, with_norm, kind)) in shapes.into_iter().enumerate() {
        let (q_width, kv_width) = (n_heads * head_dim, n_kv_heads * head_dim);
        // Every other output product has a bias (gpt-oss), added in the product's launch.
        let wo_bias = (i % 2 == 0).then(|| random(&mut rng, EMBD, 1.0));
        let what = format!("{n_heads}/{n_kv_heads} heads of {head_dim}, rope {n_rot} {kind:?}, norms {with_norm}, bias {}", wo_bias.is_some());
        let params = AttentionParams { n_heads, n_kv_heads, head_dim, max_seq_len: CACHE_ROWS, scale: 1.0 / (head_dim as f32).sqrt(), window: None };
        let rope = RopeParams { kind };
        let inv_freq: Vec<f32> = (0..n_rot / 2).map(|i| 1e6f32.powf(-2.0 * i as f32 / n_rot as f32)).collect();

        // Each sequence its own random blocks (they store at their own rows), its earlier
        // positions the same random keys and values in both caches.
        let mut caches = Caches::new(&pair, kv_width, KvType::F16, KvType::F16);
        let mut blocks: Vec<u32> = (0..CACHE_BLOCKS as u32).collect();
        blocks.shuffle(&mut rng);
        let mut chunks = Vec::new();
        for &pos in &positions {
            let table: Vec<u32> = blocks.drain(..(pos + 1).div_ceil(KV_BLOCK_SIZE)).collect();
            if pos > 0 {
                caches.fill(&pair, &mut rng, &table, pos);
            }
            chunks.push(Chunk { n: 1, pos0: pos, table });
        }
        pair.set_chunks(&chunks);
        assert!(pair.gpu.defers_attention_prologue(&caches.gpu, &pair.gpu_step, &params), "{what}: a decode step over f16 caches defers");

        let (q, k, v) = (random(&mut rng, n * q_width, 2.0), random(&mut rng, n * kv_width, 2.0), random(&mut rng, n * kv_width, 2.0));
        let (q_norm, k_norm) = (random(&mut rng, head_dim, 1.0), random(&mut rng, head_dim, 1.0));
        let residual = random(&mut rng, n * EMBD, 1.0);
        let wo_source = weight_source("wo", GgmlType::Q8_0, EMBD, q_width, &random(&mut rng, EMBD * q_width, 0.05));
        let (q_shape, k_shape, v_shape, x_shape) = ([n, n_heads, head_dim], [n, n_kv_heads, head_dim], [n, kv_width], [n, EMBD]);
        let freqs = [n_rot / 2];

        // CPU: the prologue, then attention and the output product on the final queries.
        let cpu = &pair.cpu;
        let wo = cpu.upload_weight(wo_source.clone()).expect("cpu weight");
        let (mut cq, mut ck) = (q.clone(), k.clone());
        let (mut q_scratch, mut k_scratch) = (vec![0f32; q.len()], vec![0f32; k.len()]);
        let norms = with_norm.then(|| QkNorm {
            q: view(&q_norm, [head_dim]),
            k: view(&k_norm, [head_dim]),
            eps: 1e-6,
            scratch: [view_mut(&mut q_scratch, q_shape), view_mut(&mut k_scratch, k_shape)],
            v: None,
        });
        let qkv = Qkv { q: view_mut(&mut cq, q_shape), k: view_mut(&mut ck, k_shape), v: view(&v, v_shape) };
        cpu.attention_prologue(qkv, norms, view(&inv_freq, freqs), &rope, &mut caches.cpu, &pair.cpu_step).expect("cpu prologue");
        let (mut want_out, mut want_x, mut tmp) = (vec![0f32; n * q_width], residual.clone(), vec![0f32; n * EMBD]);
        let args = AttentionArgs { q: view(&cq, [n, q_width]), cache: &caches.cpu, sinks: None, step: &pair.cpu_step, params: &params, prologue: None };
        let linear = Linear::new(&wo, wo_bias.as_ref().map(|b| view(b, [EMBD])));
        cpu.attention_matmul_add(args, view_mut(&mut want_out, [n, q_width]), linear, view_mut(&mut want_x, x_shape), view_mut(&mut tmp, x_shape), None)
            .expect("cpu attention");

        // GPU: the attention takes the prologue itself, from the projections as they are.
        let gpu = &pair.gpu;
        let wo = gpu.upload_weight(wo_source).expect("gpu weight");
        let (gq, gk, gv) = (upload(gpu, &q), upload(gpu, &k), upload(gpu, &v));
        let (gqn, gkn, gfreq) = (upload(gpu, &q_norm), upload(gpu, &k_norm), upload(gpu, &inv_freq));
        let prologue = DeferredPrologue {
            k: view(&gk, k_shape),
            v: view(&gv, v_shape),
            qk_norm: with_norm.then(|| (view(&gqn, [head_dim]), view(&gkn, [head_dim]), 1e-6)),
            inv_freq: view(&gfreq, freqs),
            rope,
        };
        let (mut got_out, mut got_x, mut gtmp) = (poisoned(gpu, n * q_width), upload(gpu, &residual), poisoned(gpu, n * EMBD));
        let args =
            AttentionArgs { q: view(&gq, [n, q_width]), cache: &caches.gpu, sinks: None, step: &pair.gpu_step, params: &params, prologue: Some(prologue) };
        let gpu_bias = wo_bias.as_ref().map(|b| upload(gpu, b));
        let linear = Linear::new(&wo, gpu_bias.as_ref().map(|b| view(b, [EMBD])));
        gpu.attention_matmul_add(args, view_mut(&mut got_out, [n, q_width]), linear, view_mut(&mut got_x, x_shape), view_mut(&mut gtmp, x_shape), None)
            .expect("gpu attention with its prologue");
        assert_close(&format!("{what}: attention"), &download(gpu, &got_out, n * q_width), &want_out, OUT_TOLERANCE);
        assert_close(&format!("{what}: residual"), &download(gpu, &got_x, n * EMBD), &want_x, RESIDUAL_TOLERANCE);
        // The GPU stored each token's key and value where the CPU did: attention of fresh
        // queries at those positions reads them back.
        let reads: Vec<Chunk> = chunks.iter().map(|c| Chunk { n: 1, pos0: c.pos0, table: c.table.clone() }).collect();
        pair.set_chunks(&reads);
        let (got, want) = attend(&pair, &caches, &mut rng, &params);
        assert_close(&format!("{what}: stored keys and values"), &got, &want, OUT_TOLERANCE);
    }
}

/// Only a decode step over f16 caches on the tensor-core kernel takes the prologue; the CPU
/// never does, and refuses one handed to it.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn only_tensor_core_decode_steps_defer_the_prologue() {
    let mut pair = Pair::new(4, 0);
    let params = AttentionParams { n_heads: 8, n_kv_heads: 2, head_dim: 64, max_seq_len: CACHE_ROWS, scale: 0.125, window: None };
    let width = 2 * 64;
    let f16 = Caches::new(&pair, width, KvType::F16, KvType::F16);
    let q8 = Caches::new(&pair, width, KvType::Q8_0, KvType::Q8_0);
    pair.set_chunks(&[Chunk { n: 1, pos0: 5, table: contiguous(6) }]);
    assert!(pair.gpu.defers_attention_prologue(&f16.gpu, &pair.gpu_step, &params));
    assert!(!pair.gpu.defers_attention_prologue(&q8.gpu, &pair.gpu_step, &params), "q8_0 caches run on CUDA cores");
    assert!(!pair.cpu.defers_attention_prologue(&f16.cpu, &pair.cpu_step, &params));
    pair.set_chunks(&[Chunk { n: 3, pos0: 5, table: contiguous(8) }]);
    assert!(!pair.gpu.defers_attention_prologue(&f16.gpu, &pair.gpu_step, &params), "a prefill step does not defer");

    let (q, k, v, freq) = (vec![0.5f32; 8 * 64], vec![0.5f32; width], vec![0.5f32; width], vec![1.0f32; 32]);
    pair.set_chunks(&[Chunk { n: 1, pos0: 5, table: contiguous(6) }]);
    let prologue = DeferredPrologue {
        k: view(&k, [1, 2, 64]),
        v: view(&v, [1, width]),
        qk_norm: None,
        inv_freq: view(&freq, [32]),
        rope: RopeParams { kind: RopeKind::Neox },
    };
    let wo = pair.cpu.upload_weight(weight_source("wo", GgmlType::F32, 16, 8 * 64, &vec![0.1f32; 16 * 8 * 64])).expect("cpu weight");
    let (mut out, mut x, mut tmp) = (vec![0f32; 8 * 64], vec![0f32; 16], vec![0f32; 16]);
    let args = AttentionArgs { q: view(&q, [1, 8 * 64]), cache: &f16.cpu, sinks: None, step: &pair.cpu_step, params: &params, prologue: Some(prologue) };
    let refused =
        pair.cpu.attention_matmul_add(args, view_mut(&mut out, [1, 8 * 64]), Linear::plain(&wo), view_mut(&mut x, [1, 16]), view_mut(&mut tmp, [1, 16]), None);
    assert!(refused.is_err(), "the CPU refuses a deferred prologue");
}

/// The attention with its output product into an output of its own (`attention_matmul`, Gemma's
/// blocks): where the decode kernel stores its output as the product's int8 input, the product
/// must equal, bit for bit, the same product quantizing the attention's output itself (one
/// quantize_chunk of the same values) wherever the two attentions agree bit for bit; both
/// against the CPU (the product's int8 activations:
/// `RESIDUAL_TOLERANCE` without a residual to dilute them, so twice it; the attention alone
/// within the split or flash kernel's tolerance, the prefill's f16 rounding). Heads of 256 and 512
/// (Gemma 4, on CUDA cores) and 128 (tensor cores), f16 and q8_0 caches, decode steps of four
/// sequences and a prefill step of twelve tokens.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn attention_with_its_product_matches_the_separate_ops() {
    let mut rng = rng("attention_matmul");
    let mut pair = Pair::new(12, 0);
    for (n_heads, n_kv_heads, head_dim) in [(16, 8, 256), (16, 2, 512), (8, 2, 128)] {
        let q_width = n_heads * head_dim;
        let params = AttentionParams { n_heads, n_kv_heads, head_dim, max_seq_len: CACHE_ROWS, scale: 1.0, window: None };
        let wo_source = weight_source("wo", GgmlType::Q4_K, EMBD, q_width, &random(&mut rng, EMBD * q_width, 0.05));
        let (cpu_wo, gpu_wo) = (pair.cpu.upload_weight(wo_source.clone()).expect("cpu weight"), pair.gpu.upload_weight(wo_source).expect("gpu weight"));
        for ty in [KvType::F16, KvType::Q8_0] {
            let mut caches = Caches::new(&pair, n_kv_heads * head_dim, ty, ty);
            let mut blocks: Vec<u32> = (0..CACHE_BLOCKS as u32).collect();
            blocks.shuffle(&mut rng);
            let steps: [&[(usize, usize)]; 2] = [&[(0, 1), (40, 1), (700, 1), (3000, 1)], &[(100, 12)]];
            for step in steps {
                let mut chunks = Vec::new();
                for &(pos0, n) in step {
                    let table: Vec<u32> = blocks[..(pos0 + n).div_ceil(KV_BLOCK_SIZE)].to_vec();
                    blocks.rotate_left(table.len());
                    caches.fill(&pair, &mut rng, &table, pos0 + n);
                    chunks.push(Chunk { n, pos0, table });
                }
                pair.set_chunks(&chunks);
                let n: usize = step.iter().map(|&(_, n)| n).sum();
                let what = format!("{n_heads}/{n_kv_heads} heads of {head_dim}, {ty} cache, {n} tokens");
                let q = random(&mut rng, n * q_width, 3.0);
                let (q_shape, x_shape) = ([n, q_width], [n, EMBD]);
                let (mut cpu_out, mut want) = (vec![0f32; n * q_width], vec![0f32; n * EMBD]);
                let args = AttentionArgs { q: view(&q, q_shape), cache: &caches.cpu, sinks: None, step: &pair.cpu_step, params: &params, prologue: None };
                pair.cpu.attention_matmul(args, view_mut(&mut cpu_out, q_shape), &cpu_wo, view_mut(&mut want, x_shape)).expect("cpu");
                let gq = upload(&pair.gpu, &q);
                let run = |fused: bool| {
                    let (mut out, mut proj) = (poisoned(&pair.gpu, n * q_width), poisoned(&pair.gpu, n * EMBD));
                    let args = AttentionArgs { q: view(&gq, q_shape), cache: &caches.gpu, sinks: None, step: &pair.gpu_step, params: &params, prologue: None };
                    if fused {
                        pair.gpu.attention_matmul(args, view_mut(&mut out, q_shape), &gpu_wo, view_mut(&mut proj, x_shape)).expect("gpu");
                    } else {
                        pair.gpu.attention(args.q, args.cache, view_mut(&mut out, q_shape), args.step, args.params).expect("gpu attention");
                        pair.gpu.matmul(&gpu_wo, view(&out, q_shape), view_mut(&mut proj, x_shape)).expect("gpu product");
                    }
                    (download(&pair.gpu, &out, n * q_width), download(&pair.gpu, &proj, n * EMBD))
                };
                let ((out, got), (separate_out, separate)) = (run(true), run(false));
                // The storing kernel may take another split than the plain one: the same
                // attention up to summation order, and then codes that can round one step apart.
                assert_close(&format!("{what}: attention against the attention alone"), &out, &separate_out, 1e-6);
                if out.iter().zip(&separate_out).all(|(a, b)| a.to_bits() == b.to_bits()) {
                    assert_bitwise(&format!("{what}: product against the separate product"), &got, &separate);
                } else {
                    assert_close(&format!("{what}: product against the separate product"), &got, &separate, 2e-3);
                }
                assert_close(&format!("{what}: attention against the CPU"), &out, &cpu_out, attention_tolerance(&pair.plan));
                assert_close(&format!("{what}: product against the CPU"), &got, &want, 2.0 * RESIDUAL_TOLERANCE);
            }
        }
    }
}
