//! The CUDA backend's fused norms against their composed steps and the CPU reference on fresh
//! random inputs: Gemma's post-norms added to the residual and summed, Gemma 4's router norm
//! inside the router's product, and a Gated DeltaNet's
//! output projection added to the residual (`gated_norm_matmul_add`: for up to 8 tokens of
//! quantized weights the gated RMSNorm writes the product's int8 input itself,
//! `gated_norm_quantize_q8`; else the composed ops run). Needs an NVIDIA GPU: run
//! scripts/gpu-tests.sh on the device.

mod common;
use common::rng;

use kiln_core::backend::{Backend, GatedNorm, RouterArgs, RouterParams};
use kiln_quant::GgmlType;
#[path = "common/backends.rs"]
mod backends;
use backends::*;

/// int8 activations (16 values a scale) against the CPU's f32: about 0.5% relative L2 of the
/// product, as the mat-vec tests bound it.
const PRODUCT_TOLERANCE: f64 = 1e-2;

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn gated_norm_feeds_the_output_product() {
    let mut rng = rng("gated_norm_matmul_add");
    let pair = Pair::new(12, 0);
    let (cpu, gpu) = (&pair.cpu, &pair.gpu);
    // (tokens, heads, head_dim, weight type): Qwen3.5's 32 heads of 128; rows that leave a
    // padding tile (6 x 128 = 768); heads of 64 and of 16; heads of 80 (5 chunks: not a power
    // of two, the composed path) and 12 tokens (past the mat-vec, the composed path too).
    let cases = [
        (1, 32, 128, GgmlType::Q4_K),
        (3, 6, 128, GgmlType::Q8_0),
        (2, 4, 64, GgmlType::Q4_K),
        (8, 16, 16, GgmlType::Q8_0),
        (2, 8, 80, GgmlType::Q8_0),
        (12, 4, 128, GgmlType::Q8_0),
    ];
    for (n, heads, head_dim, ty) in cases {
        let (width, rows) = (heads * head_dim, 256);
        let what = format!("{n} tokens, {heads} heads of {head_dim}, {ty}");
        let (x, z) = (random(&mut rng, n * width, 2.0), random(&mut rng, n * width, 3.0));
        let weight: Vec<f32> = random(&mut rng, head_dim, 0.5).iter().map(|w| 1.0 + w).collect();
        let residual = random(&mut rng, n * rows, 1.0);
        let source = weight_source("ssm_out", ty, rows, width, &random(&mut rng, rows * width, 1.0 / (width as f32).sqrt()));
        let eps = 1e-6;

        let cw = cpu.upload_weight(source.clone()).expect("cpu weight");
        let (mut normed, mut gated, mut want, mut tmp) = (vec![0f32; n * width], vec![0f32; n * width], residual.clone(), vec![0f32; n * rows]);
        let g = GatedNorm { x: view(&x, [n, heads, head_dim]), z: view(&z, [n, width]), weight: view(&weight, [head_dim]), eps };
        let scratch = [view_mut(&mut normed, [n, heads, head_dim]), view_mut(&mut gated, [n, width])];
        cpu.gated_norm_matmul_add(g, scratch, &cw, view_mut(&mut want, [n, rows]), view_mut(&mut tmp, [n, rows])).expect("cpu");

        let gw = gpu.upload_weight(source).expect("gpu weight");
        let (gx, gz, gweight) = (upload(gpu, &x), upload(gpu, &z), upload(gpu, &weight));
        let (mut gnormed, mut ggated, mut got, mut gtmp) =
            (poisoned(gpu, n * width), poisoned(gpu, n * width), upload(gpu, &residual), poisoned(gpu, n * rows));
        let g = GatedNorm { x: view(&gx, [n, heads, head_dim]), z: view(&gz, [n, width]), weight: view(&gweight, [head_dim]), eps };
        let scratch = [view_mut(&mut gnormed, [n, heads, head_dim]), view_mut(&mut ggated, [n, width])];
        gpu.gated_norm_matmul_add(g, scratch, &gw, view_mut(&mut got, [n, rows]), view_mut(&mut gtmp, [n, rows])).expect("gpu");

        // The product alone (the residual it is added to would dilute its error).
        let added = |sum: &[f32]| sum.iter().zip(&residual).map(|(s, r)| s - r).collect::<Vec<f32>>();
        assert_close(&format!("{what}: product added"), &added(&download(gpu, &got, n * rows)), &added(&want), PRODUCT_TOLERANCE);
    }
    // A z of the wrong width is refused, on the fused path as on the composed one.
    let (n, heads, head_dim) = (1, 4, 64);
    let source = weight_source("ssm_out", GgmlType::Q8_0, 64, heads * head_dim, &random(&mut rng, 64 * heads * head_dim, 0.1));
    let gw = gpu.upload_weight(source).expect("gpu weight");
    let (gx, gz, gweight) = (upload(gpu, &random(&mut rng, heads * head_dim, 1.0)), upload(gpu, &random(&mut rng, 64, 1.0)), upload(gpu, &vec![1.0; head_dim]));
    let (mut gnormed, mut ggated, mut got, mut gtmp) = (poisoned(gpu, heads * head_dim), poisoned(gpu, heads * head_dim), poisoned(gpu, 64), poisoned(gpu, 64));
    let g = GatedNorm { x: view(&gx, [n, heads, head_dim]), z: view(&gz, [n, 64]), weight: view(&gweight, [head_dim]), eps: 1e-6 };
    let scratch = [view_mut(&mut gnormed, [n, heads, head_dim]), view_mut(&mut ggated, [n, heads * head_dim])];
    assert!(gpu.gated_norm_matmul_add(g, scratch, &gw, view_mut(&mut got, [n, 64]), view_mut(&mut gtmp, [n, 64])).is_err(), "a short z is refused");
}

/// The fused post-norm, residual add and scale (Gemma's blocks) equals the CUDA backend's own
/// rms_norm, add and scale bit for bit, and the CPU's within the norms' rounding.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn norm_add_matches_its_steps_and_cpu() {
    let mut rng = rng("norm_add");
    let pair = Pair::new(1, 0);
    let (cpu, gpu) = (&pair.cpu, &pair.gpu);
    // Widths on both sides of the one-warp reduction (512) and of float4 rows.
    for (n, dim, scale) in [(1, 7, 1.0), (3, 300, 0.5), (2, 513, 1.0), (5, 2816, 0.73), (1, 4096, 1.0)] {
        let (src, x, w) = (random(&mut rng, n * dim, 3.0), random(&mut rng, n * dim, 5.0), random(&mut rng, dim, 2.0));
        let (gsrc, gw) = (upload(gpu, &src), upload(gpu, &w));
        let what = format!("rms_norm_add {n}x{dim} scale {scale}");
        let mut fused = upload(gpu, &x);
        let mut scratch = poisoned(gpu, n * dim);
        gpu.rms_norm_add(view(&gsrc, [n, dim]), (view(&gw, [dim]), 1e-6), view_mut(&mut scratch, [n, dim]), view_mut(&mut fused, [n, dim]), scale)
            .expect("gpu");
        let mut steps = upload(gpu, &x);
        let mut normed = poisoned(gpu, n * dim);
        gpu.rms_norm(view(&gsrc, [n, dim]), view(&gw, [dim]), view_mut(&mut normed, [n, dim]), 1e-6).expect("gpu norm");
        gpu.add(view_mut(&mut steps, [n, dim]), view(&normed, [n, dim])).expect("gpu add");
        if scale != 1.0 {
            gpu.scale(view_mut(&mut steps, [n, dim]), scale).expect("gpu scale");
        }
        let got = download(gpu, &fused, n * dim);
        assert_bitwise(&what, &got, &download(gpu, &steps, n * dim));
        let (mut want, mut cpu_scratch) = (x.clone(), vec![0f32; n * dim]);
        cpu.rms_norm_add(view(&src, [n, dim]), (view(&w, [dim]), 1e-6), view_mut(&mut cpu_scratch, [n, dim]), view_mut(&mut want, [n, dim]), scale)
            .expect("cpu");
        // The two backends sum the squares in different orders: a few f32 ulps.
        assert_close(&what, &got, &want, 1e-6);
    }
}

/// Two rows post-normed and summed (`rms_norm_sum`: Gemma 4's dense FFN and experts) equals
/// the CUDA backend's own norm then norm-add bit for bit, and the CPU's within the norms'
/// rounding (a few f32 ulps, as above). Widths on both sides of the one-warp reduction and of
/// float4 rows; 1 to 12 tokens.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn norm_sum_matches_its_steps_and_cpu() {
    let mut rng = rng("norm_sum");
    let pair = Pair::new(1, 0);
    let (cpu, gpu) = (&pair.cpu, &pair.gpu);
    for (n, dim) in [(1, 7), (3, 300), (2, 513), (1, 2816), (12, 2816), (4, 1030)] {
        let what = format!("rms_norm_sum {n}x{dim}");
        let (a, b) = (random(&mut rng, n * dim, 3.0), random(&mut rng, n * dim, 40.0));
        let (wa, wb) = (random(&mut rng, dim, 2.0), random(&mut rng, dim, 0.5));
        let (rows, cols) = ([n, dim], [dim]);
        let (ga, gb, gwa, gwb) = (upload(gpu, &a), upload(gpu, &b), upload(gpu, &wa), upload(gpu, &wb));
        let mut fused = poisoned(gpu, n * dim);
        let mut a_copy = upload(gpu, &a);
        gpu.rms_norm_sum(view_mut(&mut a_copy, rows), view(&gb, rows), [view(&gwa, cols), view(&gwb, cols)], 1e-6, view_mut(&mut fused, rows))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let (mut steps, mut scratch) = (poisoned(gpu, n * dim), poisoned(gpu, n * dim));
        gpu.rms_norm(view(&ga, rows), view(&gwa, cols), view_mut(&mut steps, rows), 1e-6).expect("gpu norm");
        gpu.rms_norm_add(view(&gb, rows), (view(&gwb, cols), 1e-6), view_mut(&mut scratch, rows), view_mut(&mut steps, rows), 1.0).expect("gpu norm add");
        let got = download(gpu, &fused, n * dim);
        assert_bitwise(&what, &got, &download(gpu, &steps, n * dim));
        let (mut want, mut cpu_a) = (vec![0f32; n * dim], a.clone());
        cpu.rms_norm_sum(view_mut(&mut cpu_a, rows), view(&b, rows), [view(&wa, cols), view(&wb, cols)], 1e-6, view_mut(&mut want, rows)).expect("cpu");
        assert_close(&what, &got, &want, 1e-6);
    }
}

/// A router's own norm (Gemma 4: `rms_norm(x) · ffn_gate_inp.scale / sqrt(n_embd)`) applied
/// inside the router's product for one token of an f32 router (the product scales x as it
/// loads it and each logit by 1 / rms(x), summed from the same loads), else composed: its
/// logits against the CPU's norm then product (the same sums in another order: 1e-5 relative
/// L2), and through `moe_norm_route` the chosen experts too. Gemma-4-26B-A4B's 128 x 2,816,
/// a width the one-token kernel takes in one step (100), one it cannot (30: composed) and
/// three tokens (composed). The composed product of an f32 router that the float mat-vec does
/// not take runs on f16 inputs (MATMAT_TOLERANCE), as does the composed route of a width the
/// fused norm-router does not take (not a multiple of 16; its ids then are not compared).
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn router_norm_inside_the_product_matches_cpu() {
    let mut rng = rng("normed_router");
    let pair = Pair::new(1, 0);
    let (cpu, gpu, eps) = (&pair.cpu, &pair.gpu, 1e-6);
    for (n, n_experts, cols) in [(1, 128, 2816), (1, 8, 100), (1, 8, 30), (3, 16, 256)] {
        let what = format!("{n} tokens, {n_experts} experts of {cols}");
        let (x, norm, scale) = (random(&mut rng, n * cols, 3.0), random(&mut rng, cols, 1.5), random(&mut rng, cols, 0.1));
        let router_source = weight_source("router", GgmlType::F32, n_experts, cols, &random(&mut rng, n_experts * cols, 1.0));
        let (rows, logit_rows) = ([n, cols], [n, n_experts]);
        let cr = cpu.upload_weight(router_source.clone()).expect("cpu");
        let (mut h, mut want) = (vec![0f32; n * cols], vec![0f32; n * n_experts]);
        cpu.normed_router_logits(view(&x, rows), (view(&scale, [cols]), eps), view_mut(&mut h, rows), &cr, view_mut(&mut want, logit_rows)).expect("cpu");
        let gr = gpu.upload_weight(router_source).expect("gpu");
        let (gx, gnorm, gscale) = (upload(gpu, &x), upload(gpu, &norm), upload(gpu, &scale));
        let (mut gh, mut got) = (poisoned(gpu, n * cols), poisoned(gpu, n * n_experts));
        gpu.normed_router_logits(view(&gx, rows), (view(&gscale, [cols]), eps), view_mut(&mut gh, rows), &gr, view_mut(&mut got, logit_rows))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let in_product = n == 1 && cols % 4 == 0;
        let tolerance = if in_product { 1e-5 } else { MATMAT_TOLERANCE };
        assert_close(&format!("{what}: logits"), &download(gpu, &got, n * n_experts), &want, tolerance);

        let n_used = 4.min(n_experts);
        let chosen = [n, n_used];
        let params = RouterParams { renormalize: true, shared_expert: false };
        let (mut logits, mut ids, mut weights) = (vec![0f32; n * n_experts], vec![0f32; n * n_used], vec![0f32; n * n_used]);
        let router = RouterArgs { weight: &cr, norm: Some(view(&scale, [cols])), bias: None, expert_scale: None, params, shared_gate: None };
        let routes = [view_mut(&mut ids, chosen), view_mut(&mut weights, chosen)];
        let cpu_norm = (view(&norm, [cols]), eps);
        cpu.moe_norm_route(view(&x, rows), cpu_norm, router, view_mut(&mut h, rows), view_mut(&mut logits, logit_rows), routes).expect("cpu");
        let (mut glogits, mut gids, mut gweights) = (poisoned(gpu, n * n_experts), poisoned(gpu, n * n_used), poisoned(gpu, n * n_used));
        let router = RouterArgs { weight: &gr, norm: Some(view(&gscale, [cols])), bias: None, expert_scale: None, params, shared_gate: None };
        let routes = [view_mut(&mut gids, chosen), view_mut(&mut gweights, chosen)];
        let gpu_norm = (view(&gnorm, [cols]), eps);
        gpu.moe_norm_route(view(&gx, rows), gpu_norm, router, view_mut(&mut gh, rows), view_mut(&mut glogits, logit_rows), routes)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let fused_route = cols % 16 == 0;
        let tolerance = if fused_route { 1e-5 } else { MATMAT_TOLERANCE };
        assert_close(&format!("{what}: routed logits"), &download(gpu, &glogits, n * n_experts), &logits, tolerance);
        assert_close(&format!("{what}: the experts' normed input"), &download(gpu, &gh, n * cols), &h, 1e-6);
        if fused_route {
            assert_bitwise(&format!("{what}: ids"), &download(gpu, &gids, n * n_used), &ids);
        }
    }
}
