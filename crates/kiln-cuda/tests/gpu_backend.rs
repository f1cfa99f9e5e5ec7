//! CudaBackend against the CPU reference backend, op by op on fresh random inputs (in the
//! manner of ggml's test-backend-ops: every GPU output is poisoned with NaN before the launch),
//! then whole models against the float64 references in shared/testdata. Every test needs an
//! NVIDIA GPU: run scripts/gpu-tests.sh on the device.

mod common;
use common::rng;
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use kiln_core::backend::{AttentionParams, Backend, BackendError, RopeKind, RopeParams, StepInput, WeightSource};
use kiln_core::sampling::{self, SamplingParams};
use kiln_core::CpuBackend;
use kiln_cuda::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use kiln_cuda::CudaBackend;
use kiln_gguf::GgufFile;
use kiln_models::{Logits, Model, ModelOptions};
use kiln_quant::GgmlType;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Tests share the GPU; the timing tests hold it alone, so their numbers are not diluted by
/// other tests' kernels.
static GPU_USE: RwLock<()> = RwLock::new(());

enum GpuUse {
    Shared(#[allow(dead_code)] RwLockReadGuard<'static, ()>),
    Exclusive(#[allow(dead_code)] RwLockWriteGuard<'static, ()>),
}

fn shared_gpu() -> GpuUse {
    GpuUse::Shared(GPU_USE.read().unwrap_or_else(PoisonError::into_inner))
}

fn exclusive_gpu() -> GpuUse {
    GpuUse::Exclusive(GPU_USE.write().unwrap_or_else(PoisonError::into_inner))
}

fn gpu() -> CudaBackend {
    CudaBackend::new(0).unwrap_or_else(|e| panic!("opening GPU 0: {e}"))
}

fn random(rng: &mut ChaCha8Rng, len: usize, scale: f32) -> Vec<f32> {
    (0..len).map(|_| rng.gen_range(-scale..scale)).collect()
}

fn upload(gpu: &CudaBackend, data: &[f32]) -> CudaSlice<f32> {
    let mut buffer = gpu.alloc(data.len().max(1), "test input").expect("alloc");
    gpu.write(&mut buffer, data).expect("write");
    buffer
}

/// A GPU buffer filled with NaN, so any element a kernel fails to write shows.
fn poisoned(gpu: &CudaBackend, len: usize) -> CudaSlice<f32> {
    gpu.device().alloc_poisoned::<f32>(len.max(1), "poisoned output").expect("alloc")
}

fn download(gpu: &CudaBackend, buffer: &CudaSlice<f32>, len: usize) -> Vec<f32> {
    let mut host = vec![0f32; len];
    gpu.read(buffer, &mut host).expect("read");
    host
}

/// (relative L2 error, max absolute error) of `got` against `want`; fails on any NaN.
fn errors(what: &str, got: &[f32], want: &[f32]) -> (f64, f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = got.iter().position(|v| v.is_nan()) {
        panic!("{what}: element {i} is NaN (unwritten?)");
    }
    let (mut diff, mut norm, mut max_abs) = (0f64, 0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let d = (g as f64 - w as f64).abs();
        diff += d * d;
        norm += (w as f64) * (w as f64);
        max_abs = max_abs.max(d);
    }
    ((diff / norm.max(1e-30)).sqrt(), max_abs)
}

fn assert_close(what: &str, got: &[f32], want: &[f32], max_rel_l2: f64) {
    let (rel_l2, max_abs) = errors(what, got, want);
    assert!(rel_l2 <= max_rel_l2, "{what}: rel_l2 {rel_l2:.3e} > {max_rel_l2:.0e} (max_abs {max_abs:.3e})");
}

fn assert_bitwise(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!("{what}: element {i}: gpu {} cpu {}", got[i], want[i]);
    }
}

/// The CPU reference and the GPU under test, each with a step object holding the same values.
struct Pair {
    _gpu_use: GpuUse,
    cpu: CpuBackend,
    gpu: CudaBackend,
    cpu_step: <CpuBackend as Backend>::Step,
    gpu_step: <CudaBackend as Backend>::Step,
}

impl Pair {
    fn new(max_tokens: usize, max_history: usize) -> Pair {
        Self::with_use(shared_gpu(), max_tokens, max_history)
    }

    /// For timing: no other test of this binary runs kernels meanwhile.
    fn alone(max_tokens: usize, max_history: usize) -> Pair {
        Self::with_use(exclusive_gpu(), max_tokens, max_history)
    }

    fn with_use(gpu_use: GpuUse, max_tokens: usize, max_history: usize) -> Pair {
        let (cpu, gpu) = (CpuBackend::new(), gpu());
        let cpu_step = cpu.alloc_step(max_tokens, max_history).expect("cpu step");
        let gpu_step = gpu.alloc_step(max_tokens, max_history).expect("gpu step");
        Pair { _gpu_use: gpu_use, cpu, gpu, cpu_step, gpu_step }
    }

    fn set_step(&mut self, tokens: &[u32], pos0: usize, sampling: &SamplingParams, history: &[u32], draw: u64) {
        let input = StepInput { tokens, pos0, sampling, history, draw };
        self.cpu.write_step(&mut self.cpu_step, &input).expect("cpu write_step");
        self.gpu.write_step(&mut self.gpu_step, &input).expect("gpu write_step");
    }

    fn set_positions(&mut self, n: usize, pos0: usize) {
        let tokens: Vec<u32> = (0..n as u32).collect();
        self.set_step(&tokens, pos0, &SamplingParams::greedy(), &[], 0);
    }
}

fn weight_source(name: &str, ty: GgmlType, rows: usize, cols: usize, values: &[f32]) -> WeightSource {
    let bytes = if ty == GgmlType::F32 {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    } else {
        let mut bytes = vec![0u8; kiln_quant::quantized_size(ty, values.len()).expect("block multiple")];
        kiln_quant::quantize(ty, values, &mut bytes).expect("quantize");
        bytes
    };
    let len = bytes.len();
    WeightSource { name: name.into(), ty, rows, cols, owner: Arc::new(bytes), range: 0..len }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn rms_norm_matches_cpu() {
    let mut rng = rng("rms_norm");
    let pair = Pair::new(1, 0);
    for (rows, dim) in [(1, 64), (3, 4096), (7, 8), (5, 513), (2, 1000), (40, 128), (1, 8192)] {
        let x = random(&mut rng, rows * dim, 3.0);
        let weight: Vec<f32> = random(&mut rng, dim, 0.5).iter().map(|w| 1.0 + w).collect();
        let mut want = vec![0f32; rows * dim];
        pair.cpu.rms_norm(&x.clone(), &weight, &mut want, rows, dim, 1e-5).expect("cpu");
        let mut out = poisoned(&pair.gpu, rows * dim);
        pair.gpu.rms_norm(&upload(&pair.gpu, &x), &upload(&pair.gpu, &weight), &mut out, rows, dim, 1e-5).expect("gpu");
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
        cpu.add_bias(&mut want, &bias, n, dim).expect("cpu");
        let mut got = upload(gpu, &x);
        gpu.add_bias(&mut got, &upload(gpu, &bias), n, dim).expect("gpu");
        assert_bitwise(&format!("add_bias {n}x{dim}"), &download(gpu, &got, n * dim), &want);
    }
    for len in [1, 1000, 65_537] {
        let (x, y) = (random(&mut rng, len, 4.0), random(&mut rng, len, 4.0));
        let mut want = x.clone();
        cpu.add(&mut want, &y, len).expect("cpu");
        let mut got = upload(gpu, &x);
        gpu.add(&mut got, &upload(gpu, &y), len).expect("gpu");
        assert_bitwise(&format!("add {len}"), &download(gpu, &got, len), &want);

        let mut want = vec![0f32; len];
        cpu.swiglu(&x, &y, &mut want, len).expect("cpu");
        let mut got = poisoned(gpu, len);
        gpu.swiglu(&upload(gpu, &x), &upload(gpu, &y), &mut got, len).expect("gpu");
        // expf and Rust's exp differ by an ulp or two.
        assert_close(&format!("swiglu {len}"), &download(gpu, &got, len), &want, 1e-6);
    }
    for (rows, dim, row) in [(1, 64, 0), (8, 4096, 7), (5, 37, 2)] {
        let src = random(&mut rng, rows * dim, 1.0);
        let mut want = vec![0f32; dim];
        cpu.copy_row(&src, row, &mut want, dim).expect("cpu");
        let mut got = poisoned(gpu, dim);
        gpu.copy_row(&upload(gpu, &src), row, &mut got, dim).expect("gpu");
        assert_bitwise(&format!("copy_row {row} of {rows}x{dim}"), &download(gpu, &got, dim), &want);
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
                let p = RopeParams { kind, n_heads, head_dim, n_rot };
                let inv_freq: Vec<f32> = (0..n_rot / 2).map(|i| 10000f32.powf(-2.0 * i as f32 / n_rot as f32)).collect();
                let x = random(&mut rng, n * n_heads * head_dim, 2.0);
                let mut want = x.clone();
                pair.cpu.rope(&mut want, &inv_freq, &pair.cpu_step, n, &p).expect("cpu");
                let mut got = upload(&pair.gpu, &x);
                pair.gpu.rope(&mut got, &upload(&pair.gpu, &inv_freq), &pair.gpu_step, n, &p).expect("gpu");
                // Same f32 angle on both sides; sincosf and Rust's sin_cos differ by an ulp or two.
                let what = format!("rope {kind:?} {n_heads}x{head_dim} rot {n_rot}, {n} tokens at {pos0}");
                assert_close(&what, &download(&pair.gpu, &got, x.len()), &want, 2e-6);
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn kv_store_writes_exactly_the_step_rows() {
    let mut rng = rng("kv_store");
    let mut pair = Pair::new(8, 0);
    let (n_ctx, kv_width) = (4096, 96);
    for (n, pos0) in [(1, 0), (8, 13), (3, 3000), (1, 4095)] {
        pair.set_positions(n, pos0);
        let (k, v) = (random(&mut rng, n * kv_width, 1.0), random(&mut rng, n * kv_width, 1.0));
        let (k_cache, v_cache) = (random(&mut rng, n_ctx * kv_width, 1.0), random(&mut rng, n_ctx * kv_width, 1.0));
        let (mut want_k, mut want_v) = (k_cache.clone(), v_cache.clone());
        pair.cpu.kv_store(&k, &v, &mut want_k, &mut want_v, &pair.cpu_step, n, kv_width).expect("cpu");
        let (mut got_k, mut got_v) = (upload(&pair.gpu, &k_cache), upload(&pair.gpu, &v_cache));
        let (gk, gv) = (upload(&pair.gpu, &k), upload(&pair.gpu, &v));
        pair.gpu.kv_store(&gk, &gv, &mut got_k, &mut got_v, &pair.gpu_step, n, kv_width).expect("gpu");
        assert_bitwise(&format!("k cache, {n} at {pos0}"), &download(&pair.gpu, &got_k, want_k.len()), &want_k);
        assert_bitwise(&format!("v cache, {n} at {pos0}"), &download(&pair.gpu, &got_v, want_v.len()), &want_v);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn attention_matches_cpu_for_every_group_size_and_partial_splits() {
    let mut rng = rng("attention");
    let mut pair = Pair::new(8, 0);
    let n_ctx = 4096;
    // (query heads, kv heads, head_dim): group sizes 1, 2, 4, 8 and an odd 7, head dims 8..256.
    for (n_heads, n_kv_heads, head_dim) in [(4, 4, 64), (8, 4, 8), (8, 2, 128), (32, 4, 128), (14, 2, 80), (8, 2, 256), (2, 1, 32), (6, 3, 16), (3, 3, 4)] {
        let kv_width = n_kv_heads * head_dim;
        let k_cache = random(&mut rng, n_ctx * kv_width, 1.0);
        let v_cache = random(&mut rng, n_ctx * kv_width, 1.0);
        let (gk, gv) = (upload(&pair.gpu, &k_cache), upload(&pair.gpu, &v_cache));
        let p = AttentionParams { n_heads, n_kv_heads, head_dim, n_ctx, scale: 1.0 / (head_dim as f32).sqrt() };
        for (n, pos0) in [(1, 0), (1, 5), (3, 17), (1, 1000), (8, 2040), (1, 3001), (2, 4094)] {
            pair.set_positions(n, pos0);
            // Scores of a few units, so the softmax is neither flat nor one-hot.
            let q = random(&mut rng, n * n_heads * head_dim, 3.0);
            let mut want = vec![0f32; q.len()];
            pair.cpu.attention(&q, &k_cache, &v_cache, &mut want, &pair.cpu_step, n, &p).expect("cpu");
            let mut got = poisoned(&pair.gpu, q.len());
            pair.gpu.attention(&upload(&pair.gpu, &q), &gk, &gv, &mut got, &pair.gpu_step, n, &p).expect("gpu");
            // f32 softmax and weighted sums over up to 4096 rows, merged across splits in
            // another order than the CPU's single pass: a few 1e-7 relative.
            let what = format!("attention {n_heads}/{n_kv_heads} heads of {head_dim}, {n} tokens at {pos0}");
            assert_close(&what, &download(&pair.gpu, &got, q.len()), &want, 1e-5);
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn fused_prologue_matches_the_separate_cpu_ops() {
    let mut rng = rng("prologue");
    let mut pair = Pair::new(8, 0);
    let n_ctx = 4096;
    for (with_norm, kind) in [(false, RopeKind::Normal), (true, RopeKind::Neox), (true, RopeKind::Normal)] {
        for (n_heads, n_kv_heads, head_dim, n_rot) in [(8, 4, 8, 8), (4, 2, 64, 64), (32, 8, 128, 128), (6, 2, 80, 32)] {
            for (n, pos0) in [(1, 0), (5, 100), (1, 3000), (2, 4094)] {
                pair.set_positions(n, pos0);
                let kv_width = n_kv_heads * head_dim;
                let rope = RopeParams { kind, n_heads, head_dim, n_rot };
                let inv_freq: Vec<f32> = (0..n_rot / 2).map(|i| 1e6f32.powf(-2.0 * i as f32 / n_rot as f32)).collect();
                let (q, k, v) = (random(&mut rng, n * n_heads * head_dim, 2.0), random(&mut rng, n * kv_width, 2.0), random(&mut rng, n * kv_width, 2.0));
                let (q_norm, k_norm) = (random(&mut rng, head_dim, 1.0), random(&mut rng, head_dim, 1.0));
                let caches = (random(&mut rng, n_ctx * kv_width, 1.0), random(&mut rng, n_ctx * kv_width, 1.0));

                let cpu = &pair.cpu;
                let (mut want_q, mut want_k) = (q.clone(), k.clone());
                if with_norm {
                    cpu.rms_norm(&q, &q_norm, &mut want_q, n * n_heads, head_dim, 1e-6).expect("cpu");
                    cpu.rms_norm(&k, &k_norm, &mut want_k, n * n_kv_heads, head_dim, 1e-6).expect("cpu");
                }
                cpu.rope(&mut want_q, &inv_freq, &pair.cpu_step, n, &rope).expect("cpu");
                cpu.rope(&mut want_k, &inv_freq, &pair.cpu_step, n, &RopeParams { n_heads: n_kv_heads, ..rope }).expect("cpu");
                let (mut want_kc, mut want_vc) = caches.clone();
                cpu.kv_store(&want_k, &v, &mut want_kc, &mut want_vc, &pair.cpu_step, n, kv_width).expect("cpu");

                let gpu = &pair.gpu;
                let (mut gq, gk, gv) = (upload(gpu, &q), upload(gpu, &k), upload(gpu, &v));
                let (gqn, gkn) = (upload(gpu, &q_norm), upload(gpu, &k_norm));
                let (mut gkc, mut gvc) = (upload(gpu, &caches.0), upload(gpu, &caches.1));
                let norms = with_norm.then_some((&gqn, &gkn, 1e-6));
                gpu.qk_norm_rope_store(&mut gq, &gk, &gv, norms, &upload(gpu, &inv_freq), &mut gkc, &mut gvc, &pair.gpu_step, n, &rope, n_kv_heads)
                    .expect("gpu");
                let what = format!("prologue norm={with_norm} {kind:?} {n_heads}/{n_kv_heads}x{head_dim} rot {n_rot}, {n} at {pos0}");
                // As rms_norm and rope above: a few ulps per value.
                assert_close(&format!("{what}: q"), &download(gpu, &gq, q.len()), &want_q, 2e-6);
                assert_close(&format!("{what}: k cache"), &download(gpu, &gkc, want_kc.len()), &want_kc, 2e-6);
                assert_bitwise(&format!("{what}: v cache"), &download(gpu, &gvc, want_vc.len()), &want_vc);
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn attention_speed_at_long_context() {
    // Llama-3-8B geometry (32 query heads, 8 kv heads of 128) at a full 32k cache: one decode
    // step reads 2 x 32768 x 1024 f32 = 268 MB of K and V, about 62 us at 4.3 TB/s.
    let mut rng = rng("attention_speed");
    let mut pair = Pair::alone(1, 0);
    let (n_heads, n_kv_heads, head_dim, n_ctx) = (32, 8, 128, 32_768);
    let kv_width = n_kv_heads * head_dim;
    let (k_cache, v_cache) = (random(&mut rng, n_ctx * kv_width, 1.0), random(&mut rng, n_ctx * kv_width, 1.0));
    let q = random(&mut rng, n_heads * head_dim, 3.0);
    let p = AttentionParams { n_heads, n_kv_heads, head_dim, n_ctx, scale: 1.0 / (head_dim as f32).sqrt() };
    pair.set_positions(1, n_ctx - 1);
    let mut want = vec![0f32; q.len()];
    pair.cpu.attention(&q, &k_cache, &v_cache, &mut want, &pair.cpu_step, 1, &p).expect("cpu");
    let gpu = &pair.gpu;
    let (gq, gk, gv) = (upload(gpu, &q), upload(gpu, &k_cache), upload(gpu, &v_cache));
    let mut out = poisoned(gpu, q.len());
    let stream = gpu.device().stream();
    let timed = || gpu.device().context().new_event(Some(kiln_cuda::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).expect("event");
    let (start, end) = (timed(), timed());
    let runs = 50;
    for _ in 0..3 {
        gpu.attention(&gq, &gk, &gv, &mut out, &pair.gpu_step, 1, &p).expect("gpu");
    }
    start.record(stream).expect("record");
    for _ in 0..runs {
        gpu.attention(&gq, &gk, &gv, &mut out, &pair.gpu_step, 1, &p).expect("gpu");
    }
    end.record(stream).expect("record");
    end.synchronize().expect("sync");
    let micros = start.elapsed_ms(&end).expect("elapsed") as f64 * 1000.0 / runs as f64;
    let bytes = 2.0 * (n_ctx * kv_width * 4) as f64;
    eprintln!("attention 32/8 heads x 128 at 32k context: {micros:.1} us per step, {:.0} GB/s", bytes / micros / 1e3);
    assert_close("long-context attention", &download(gpu, &out, q.len()), &want, 1e-5);
}

/// Random weights of `ty` as (source, dequantized values) so the CPU sees what the GPU sees.
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
            pair.cpu.embed(&cw, &pair.cpu_step, &mut want, n).expect("cpu");
            let mut got = poisoned(&pair.gpu, n * cols);
            pair.gpu.embed(&gw, &pair.gpu_step, &mut got, n).expect("gpu");
            // Both dequantize the same bytes with exact scale products.
            assert_close(&what("embed"), &download(&pair.gpu, &got, n * cols), &want, 1e-7);

            let x = random(&mut rng, n * cols, 1.0);
            let gx = upload(&pair.gpu, &x);
            let mut want = vec![0f32; n * rows];
            pair.cpu.matmul(&cw, &x, &mut want, n).expect("cpu");
            let mut got = poisoned(&pair.gpu, n * rows);
            pair.gpu.matmul(&gw, &gx, &mut got, n).expect("gpu");
            // Quantized weights meet activations rounded to int8 per 16 values in the mat-vec
            // kernels (documented at about 0.5% relative L2 of the f32 product); float weights
            // and the mat-mat kernel compute in f32 from exactly dequantized weights.
            let tolerance = if n <= 8 && !matches!(ty, GgmlType::F32 | GgmlType::F16) { 1e-2 } else { 1e-5 };
            assert_close(&what("matmul"), &download(&pair.gpu, &got, n * rows), &want, tolerance);

            let residual = random(&mut rng, n * rows, 1.0);
            let mut want_sum = residual.clone();
            pair.cpu.matmul_add(&cw, &x, &mut want_sum, &mut vec![0f32; n * rows], n, rows).expect("cpu");
            let mut got_sum = upload(&pair.gpu, &residual);
            pair.gpu.matmul_add(&gw, &gx, &mut got_sum, &mut poisoned(&pair.gpu, n * rows), n, rows).expect("gpu");
            assert_close(&what("matmul_add"), &download(&pair.gpu, &got_sum, n * rows), &want_sum, tolerance);

            let up_src = random_weight(&mut rng, ty, rows, cols);
            let (cu, gu) = (pair.cpu.upload_weight(up_src.clone()).expect("cpu"), pair.gpu.upload_weight(up_src).expect("gpu"));
            let mut want = vec![0f32; n * rows];
            let (mut s1, mut s2) = (vec![0f32; n * rows], vec![0f32; n * rows]);
            pair.cpu.ffn_gate_up(&cw, &cu, &x, &mut s1, &mut s2, &mut want, n, rows).expect("cpu");
            let mut got = poisoned(&pair.gpu, n * rows);
            let (mut g1, mut g2) = (poisoned(&pair.gpu, n * rows), poisoned(&pair.gpu, n * rows));
            pair.gpu.ffn_gate_up(&gw, &gu, &gx, &mut g1, &mut g2, &mut got, n, rows).expect("gpu");
            assert_close(&what("ffn_gate_up"), &download(&pair.gpu, &got, n * rows), &want, 2.0 * tolerance);
        }
    }
}

/// The fused RMSNorm + int8 quantization (rms_norm_quantize_q8) and the backend ops built on it
/// (norm_matmul_qkv, norm_ffn_gate_up) against rms_norm followed by the f32-input products.
/// Row lengths: 4096, odd multiples of 96 (partial 512-value tiles) and rows short enough for
/// the one-warp norm reduction; 1, 3 and 8 tokens take the mat-vec kernels, 12 the fallback.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn fused_norm_quantize_matches_norm_then_product() {
    use kiln_cuda::matvec::{self, QuantizedActivations};
    let mut rng = rng("fused_norm_quantize");
    let pair = Pair::new(1, 0);
    let (gpu, device) = (&pair.gpu, pair.gpu.device());
    let (q_rows, kv_rows, eps) = (200, 64, 1e-5);
    for (ty, dims) in [(GgmlType::Q8_0, [4096, 480, 1440]), (GgmlType::Q4_K, [4096, 256, 3840])] {
        for dim in dims {
            let sources: Vec<WeightSource> = [q_rows, kv_rows, kv_rows, q_rows].iter().map(|&rows| random_weight(&mut rng, ty, rows, dim)).collect();
            let gw: Vec<_> = sources.iter().map(|s| gpu.upload_weight(s.clone()).expect("gpu weight")).collect();
            let cw: Vec<_> = sources.iter().map(|s| pair.cpu.upload_weight(s.clone()).expect("cpu weight")).collect();
            let (wq, wk, wv, w_up) = (&gw[0], &gw[1], &gw[2], &gw[3]);
            for n in [1, 3, 8, 12] {
                let what = |op: &str| format!("{op} {ty} dim {dim}, {n} tokens");
                let x = random(&mut rng, n * dim, 3.0);
                let norm: Vec<f32> = random(&mut rng, dim, 0.5).iter().map(|w| 1.0 + w).collect();
                let (gx, g_norm) = (upload(gpu, &x), upload(gpu, &norm));
                let mut h = poisoned(gpu, n * dim);
                gpu.rms_norm(&gx, &g_norm, &mut h, n, dim, eps).expect("rms_norm");
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
                    matvec::matmul_quantized(device, wq, &buffer, &mut got, n, false).expect("matmul_quantized");
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
                gpu.norm_matmul_qkv(&gx, &g_norm, eps, &mut scratch, wq, wk, wv, &mut q, &mut k, &mut v, n, dim).expect("norm_matmul_qkv");
                assert_close(&what("norm_matmul_qkv q"), &download(gpu, &q, n * q_rows), &want_q, exact);
                assert_close(&what("norm_matmul_qkv k"), &download(gpu, &k, n * kv_rows), &want_k, exact);
                assert_close(&what("norm_matmul_qkv v"), &download(gpu, &v, n * kv_rows), &want_v, exact);
                // Against the CPU as well, so a fault shared by both GPU paths shows: int8
                // activations cost ~0.5% relative L2 in the mat-vec kernels; mat-mat is f32.
                let tolerance = if n <= matvec::MAX_MATVEC_TOKENS { 1e-2 } else { 1e-5 };
                let mut cpu_h = vec![0f32; n * dim];
                let mut cpu_q = vec![0f32; n * q_rows];
                let (mut cpu_k, mut cpu_v) = (vec![0f32; n * kv_rows], vec![0f32; n * kv_rows]);
                pair.cpu.norm_matmul_qkv(&x, &norm, eps, &mut cpu_h, &cw[0], &cw[1], &cw[2], &mut cpu_q, &mut cpu_k, &mut cpu_v, n, dim).expect("cpu");
                assert_close(&what("norm_matmul_qkv q vs cpu"), &download(gpu, &q, n * q_rows), &cpu_q, tolerance);

                let mut want_ffn = poisoned(gpu, n * q_rows);
                matvec::matmul_swiglu(device, wq, w_up, &h, &mut want_ffn, n).expect("matmul_swiglu");
                let want_ffn = download(gpu, &want_ffn, n * q_rows);
                let mut got = poisoned(gpu, n * q_rows);
                let (mut gate, mut up) = (poisoned(gpu, n * q_rows), poisoned(gpu, n * q_rows));
                gpu.norm_ffn_gate_up(&gx, &g_norm, eps, &mut scratch, wq, w_up, &mut gate, &mut up, &mut got, n, dim, q_rows).expect("norm_ffn_gate_up");
                let got = download(gpu, &got, n * q_rows);
                assert_close(&what("norm_ffn_gate_up"), &got, &want_ffn, exact);
                let mut cpu_out = vec![0f32; n * q_rows];
                let (mut s1, mut s2) = (vec![0f32; n * q_rows], vec![0f32; n * q_rows]);
                pair.cpu.norm_ffn_gate_up(&x, &norm, eps, &mut cpu_h, &cw[0], &cw[3], &mut s1, &mut s2, &mut cpu_out, n, dim, q_rows).expect("cpu");
                // silu(g) * u combines the errors of two products.
                assert_close(&what("norm_ffn_gate_up vs cpu"), &got, &cpu_out, 2.0 * tolerance);
            }
        }
    }
}

/// Samples on both backends from the same logits and step values.
fn sample_both(pair: &mut Pair, logits: &[f32], gpu_logits: &CudaSlice<f32>, p: &SamplingParams, history: &[u32], draw: u64) -> (u32, u32) {
    pair.set_step(&[], 0, p, history, draw);
    pair.cpu.sample(&logits.to_vec(), logits.len(), &mut pair.cpu_step).expect("cpu sample");
    pair.gpu.sample(gpu_logits, logits.len(), &mut pair.gpu_step).expect("gpu sample");
    (pair.cpu.sampled_token(&pair.cpu_step).expect("cpu"), pair.gpu.sampled_token(&pair.gpu_step).expect("gpu"))
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
    for n_vocab in [1usize, 7, 512, 32_000, 151_936] {
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
            let greedy = SamplingParams { repeat_penalty: penalties[trial % 3], repeat_last_n: 64, ..SamplingParams::greedy() };
            let (cpu, gpu) = sample_both(&mut pair, &logits, &gpu_logits, &greedy, &history, trial as u64);
            assert_eq!(gpu, cpu, "greedy, vocab {n_vocab}, trial {trial}");
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
        (151_936, SamplingParams { top_k: 300, top_p: 0.8, min_p: 0.01, temperature: 0.9, ..base }),
    ];
    for (n_vocab, params) in cases {
        let logits = random(&mut rng, n_vocab, 6.0);
        let gpu_logits = upload(&pair.gpu, &logits);
        let history: Vec<u32> = (0..100).map(|_| rng.gen_range(0..n_vocab as u32)).collect();
        let draws = 200;
        let mut same = 0;
        for draw in 0..draws {
            let p = SamplingParams { seed: 1000 + draw, ..params };
            let (cpu, gpu) = sample_both(&mut pair, &logits, &gpu_logits, &p, &history, draw);
            assert!((gpu as usize) < n_vocab);
            same += usize::from(cpu == gpu);
        }
        assert!(same >= draws as usize - 2, "vocab {n_vocab}, {params:?}: {same}/{draws} draws agree");
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
        cum >= p.top_p as f64
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
    let cases = [
        SamplingParams { top_k: 0, top_p: 0.9, min_p: 0.0, temperature: 0.7, ..base },
        SamplingParams { top_k: 2000, top_p: 1.0, min_p: 0.02, temperature: 1.3, ..base },
        SamplingParams { top_k: 0, top_p: 1.0, min_p: 0.05, temperature: 1.0, repeat_penalty: 1.3, ..base },
    ];
    let (n_vocab, draws, buckets) = (50_000, 4000u64, 16usize);
    for params in cases {
        let logits = random(&mut rng, n_vocab, 6.0);
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
            pair.gpu.sample(&gpu_logits, n_vocab, &mut pair.gpu_step).expect("sample");
            match bucket_of[pair.gpu.sampled_token(&pair.gpu_step).expect("token") as usize] {
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
fn sampler_speed_on_a_large_vocabulary() {
    let mut rng = rng("sampler_speed");
    let mut pair = Pair::alone(1, 64);
    let n_vocab = 151_936;
    let logits = upload(&pair.gpu, &random(&mut rng, n_vocab, 6.0));
    let history: Vec<u32> = (0..64).map(|_| rng.gen_range(0..n_vocab as u32)).collect();
    let base = SamplingParams::default();
    let cases = [
        ("greedy", SamplingParams::greedy()),
        ("top-k 40 (defaults)", base),
        ("defaults + penalty", SamplingParams { repeat_penalty: 1.1, ..base }),
        ("top-p 0.9 over all", SamplingParams { top_k: 0, top_p: 0.9, min_p: 0.0, ..base }),
    ];
    let stream = pair.gpu.device().stream().clone();
    let timed = || pair.gpu.device().context().new_event(Some(kiln_cuda::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).expect("event");
    let (start, end) = (timed(), timed());
    for (what, params) in cases {
        pair.set_step(&[], 0, &params, &history, 3);
        let runs = 50;
        pair.gpu.sample(&logits, n_vocab, &mut pair.gpu_step).expect("warm-up");
        start.record(&stream).expect("record");
        for _ in 0..runs {
            pair.gpu.sample(&logits, n_vocab, &mut pair.gpu_step).expect("sample");
        }
        end.record(&stream).expect("record");
        end.synchronize().expect("sync");
        let micros = start.elapsed_ms(&end).expect("elapsed") as f64 * 1000.0 / runs as f64;
        assert!((pair.gpu.sampled_token(&pair.gpu_step).expect("token") as usize) < n_vocab);
        eprintln!("sample, {n_vocab} tokens, {what}: {micros:.1} us");
    }
}

/// Frequencies of `draws` GPU samples from `logits`.
fn gpu_histogram(pair: &mut Pair, logits: &[f32], params: &SamplingParams, draws: u64) -> Vec<f64> {
    let gpu_logits = upload(&pair.gpu, logits);
    let mut counts = vec![0usize; logits.len()];
    for draw in 0..draws {
        pair.set_step(&[], 0, params, &[], draw);
        pair.gpu.sample(&gpu_logits, logits.len(), &mut pair.gpu_step).expect("sample");
        counts[pair.gpu.sampled_token(&pair.gpu_step).expect("token") as usize] += 1;
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

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn captured_steps_replay_with_each_steps_values() {
    // A decode-like step (rope, KV store, attention, greedy sample) run through run_step:
    // the first call runs directly, the second captures, the rest replay the graph.
    let mut rng = rng("graph");
    let mut pair = Pair::new(1, 0);
    let (n_heads, n_kv_heads, head_dim, n_ctx) = (8, 2, 64, 512);
    let (q_width, kv_width) = (n_heads * head_dim, n_kv_heads * head_dim);
    let rope = RopeParams { kind: RopeKind::Neox, n_heads, head_dim, n_rot: head_dim };
    let attn = AttentionParams { n_heads, n_kv_heads, head_dim, n_ctx, scale: 0.125 };
    let inv_freq: Vec<f32> = (0..head_dim / 2).map(|i| 10000f32.powf(-2.0 * i as f32 / head_dim as f32)).collect();
    let gpu_freq = upload(&pair.gpu, &inv_freq);
    let (mut cpu_k, mut cpu_v) = (vec![0f32; n_ctx * kv_width], vec![0f32; n_ctx * kv_width]);
    let (mut gpu_k, mut gpu_v) = (upload(&pair.gpu, &cpu_k), upload(&pair.gpu, &cpu_v));
    let (mut gq, mut gk, mut gv) = (poisoned(&pair.gpu, q_width), poisoned(&pair.gpu, kv_width), poisoned(&pair.gpu, kv_width));
    let mut g_out = poisoned(&pair.gpu, q_width);
    for pos in 0..300 {
        let (q, k, v) = (random(&mut rng, q_width, 2.0), random(&mut rng, kv_width, 1.0), random(&mut rng, kv_width, 1.0));
        pair.set_step(&[0], pos, &SamplingParams::greedy(), &[], 0);
        let (mut cq, mut ck) = (q.clone(), k.clone());
        let mut c_out = vec![0f32; q_width];
        let cpu = &pair.cpu;
        cpu.rope(&mut cq, &inv_freq, &pair.cpu_step, 1, &rope).expect("cpu");
        cpu.rope(&mut ck, &inv_freq, &pair.cpu_step, 1, &RopeParams { n_heads: n_kv_heads, ..rope }).expect("cpu");
        cpu.kv_store(&ck, &v, &mut cpu_k, &mut cpu_v, &pair.cpu_step, 1, kv_width).expect("cpu");
        cpu.attention(&cq, &cpu_k, &cpu_v, &mut c_out, &pair.cpu_step, 1, &attn).expect("cpu");
        cpu.sample(&c_out, q_width, &mut pair.cpu_step).expect("cpu");

        // Host uploads stay outside the recorded step, as in the model.
        let gpu = &pair.gpu;
        gpu.write(&mut gq, &q).expect("write");
        gpu.write(&mut gk, &k).expect("write");
        gpu.write(&mut gv, &v).expect("write");
        let step = &mut pair.gpu_step;
        gpu.run_step(7, &mut || {
            gpu.rope(&mut gq, &gpu_freq, step, 1, &rope)?;
            gpu.rope(&mut gk, &gpu_freq, step, 1, &RopeParams { n_heads: n_kv_heads, ..rope })?;
            gpu.kv_store(&gk, &gv, &mut gpu_k, &mut gpu_v, step, 1, kv_width)?;
            gpu.attention(&gq, &gpu_k, &gpu_v, &mut g_out, step, 1, &attn)?;
            gpu.sample(&g_out, q_width, step)
        })
        .expect("run_step");
        assert_close(&format!("step at {pos}"), &download(gpu, &g_out, q_width), &c_out, 1e-5);
        let (want, got) = (pair.cpu.sampled_token(&pair.cpu_step).expect("cpu"), gpu.sampled_token(&pair.gpu_step).expect("gpu"));
        assert_eq!(got, want, "sampled token at {pos}");
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

/// stories260K and every model of shared/testdata/models that has a reference.
fn reference_models() -> Vec<(PathBuf, serde_json::Value)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let models = kiln_testdata::path("models");
    let mut found = vec![(root.join("models/stories260K.gguf"), models.join("stories260K.ref.json"))];
    let mut entries: Vec<PathBuf> = std::fs::read_dir(&models)
        .unwrap_or_else(|e| panic!("{}: {e} (the model tests need shared/testdata)", models.display()))
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .collect();
    entries.sort();
    for gguf in entries {
        found.push((gguf.clone(), gguf.with_extension("ref.json")));
    }
    found
        .into_iter()
        .map(|(gguf, json)| {
            let text = std::fs::read_to_string(&json).unwrap_or_else(|e| panic!("{}: {e}", json.display()));
            (gguf, serde_json::from_str(&text).expect("reference JSON"))
        })
        .collect()
}

fn ids(value: &serde_json::Value) -> Vec<u32> {
    value.as_array().expect("array").iter().map(|v| v.as_u64().expect("id") as u32).collect()
}

fn floats(value: &serde_json::Value) -> Vec<f64> {
    value.as_array().expect("array").iter().map(|v| v.as_f64().expect("number")).collect()
}

struct ModelRun {
    /// Teacher-forced logits [20][n_vocab] from one 20-token batch.
    batch: Vec<f32>,
    /// The same logits fed one token at a time (the decode path's numerics).
    stepwise: Vec<f32>,
    /// The greedy continuation through `decode_sample` (captured graphs after two steps).
    greedy: Vec<u32>,
    /// The same continuation computed eagerly: `forward` one token at a time, host argmax.
    eager: Vec<u32>,
}

fn run_model<B: Backend>(backend: Arc<B>, path: &Path, tokens: &[u32], n_new: usize) -> Result<ModelRun, String> {
    let fail = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let file = Arc::new(GgufFile::open(path).map_err(|e| fail(&e))?);
    let options = ModelOptions { n_ctx: Some(64), n_batch: 32, all_logits: true, max_history: 64 };
    let mut model = Model::load(backend, file, &options).map_err(|e| fail(&e))?;
    let batch = model.forward(tokens, Logits::All).map_err(|e| fail(&e))?.to_vec();
    model.reset();
    let mut stepwise = Vec::with_capacity(batch.len());
    for &token in tokens {
        stepwise.extend_from_slice(model.forward(&[token], Logits::Last).map_err(|e| fail(&e))?);
    }
    let greedy_params = SamplingParams::greedy();
    let mut history = tokens.to_vec();
    let mut token = model.sample_last(&greedy_params, &history, 0).map_err(|e| fail(&e))?;
    let mut greedy = vec![token];
    while greedy.len() < n_new {
        history.push(token);
        token = model.decode_sample(token, &greedy_params, &history, greedy.len() as u64).map_err(|e| fail(&e))?;
        greedy.push(token);
    }
    // Fed one token at a time like the greedy run above, so both hold the same cache.
    model.reset();
    let mut logits = Vec::new();
    for &token in tokens {
        logits = model.forward(&[token], Logits::Last).map_err(|e| fail(&e))?.to_vec();
    }
    let mut eager = Vec::with_capacity(n_new);
    while eager.len() < n_new {
        let next = sampling::argmax(&logits);
        eager.push(next);
        if eager.len() < n_new {
            logits = model.forward(&[next], Logits::Last).map_err(|e| fail(&e))?.to_vec();
        }
    }
    Ok(ModelRun { batch, stepwise, greedy, eager })
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn models_match_the_float64_references() {
    let _gpu_use = shared_gpu();
    let gpu = Arc::new(gpu());
    let cpu = Arc::new(CpuBackend::new());
    let mut failures = Vec::new();
    eprintln!(
        "{:<26} {:>9} {:>9} {:>9} {:>9} {:>10} {:>8} {:>7}",
        "model", "batch rel", "batch abs", "step rel", "step abs", "vs cpu rel", "greedy", "checked"
    );
    for (path, reference) in reference_models() {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let tokens = ids(&reference["tokens"]);
        let want: Vec<f32> = reference["logits"].as_array().expect("logits").iter().flat_map(floats).map(|v| v as f32).collect();
        let greedy_want = ids(&reference["greedy"]["tokens"]);
        let margins = floats(&reference["greedy"]["margins"]);
        let (run, cpu_run) = match (run_model(gpu.clone(), &path, &tokens, greedy_want.len()), run_model(cpu.clone(), &path, &tokens, 1)) {
            (Ok(g), Ok(c)) => (g, c),
            (g, c) => {
                eprintln!("{name:<26} failed");
                failures.extend(g.err().into_iter().chain(c.err()));
                continue;
            }
        };
        let (batch_rel, batch_abs) = errors(&name, &run.batch, &want);
        let (step_rel, step_abs) = errors(&name, &run.stepwise, &want);
        let (cpu_rel, _) = errors(&name, &run.batch, &cpu_run.batch);
        // Greedy tokens count only while the reference margin exceeds twice the decode path's
        // logit error: past a closer call, rounding may legitimately pick the runner-up.
        let checked = margins.iter().take_while(|&&m| m > 2.0 * step_abs).count();
        let agree = run.greedy.iter().zip(&greedy_want).take(checked).take_while(|(a, b)| a == b).count();
        eprintln!(
            "{name:<26} {batch_rel:>9.2e} {batch_abs:>9.2e} {step_rel:>9.2e} {step_abs:>9.2e} {cpu_rel:>10.2e} {agree:>5}/{:<2} {checked:>7}",
            greedy_want.len()
        );
        // Batches of 20 tokens run the f32 mat-mat kernel on exactly dequantized weights: the
        // brief's bound (about 1e-6 is expected). One token at a time, quantized weights meet
        // int8 activations, as in llama.cpp, which lands at 7.8e-3 to 3.4e-2 on these files
        // (shared/testdata/README.md); 5e-2 bounds that, float weights stay at the batch's level.
        let float_weights = name == "stories260K.gguf" || name.contains("-F16.") || name.contains("-BF16.");
        let step_bound = if float_weights { 1e-3 } else { 5e-2 };
        if batch_rel > 1e-3 || batch_abs > 5e-2 {
            failures.push(format!("{name}: batch logits rel_l2 {batch_rel:.2e}, max_abs {batch_abs:.2e}"));
        }
        if step_rel > step_bound {
            failures.push(format!("{name}: one-token logits rel_l2 {step_rel:.2e} > {step_bound:.0e}"));
        }
        if agree < checked {
            failures.push(format!("{name}: greedy token {agree} is {} (want {}), margin {}", run.greedy[agree], greedy_want[agree], margins[agree]));
        }
        // Replayed graphs run the very kernels of the eager one-token forward: same tokens.
        if run.greedy != run.eager {
            failures.push(format!("{name}: graph decode {:?} differs from eager decode {:?}", run.greedy, run.eager));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
