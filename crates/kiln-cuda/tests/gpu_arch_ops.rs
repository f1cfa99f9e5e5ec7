//! The CUDA backend's ops of the newer architectures (mixture of experts, Gemma, gpt-oss,
//! Qwen3.5's Gated DeltaNet) against the CPU reference backend on fresh random inputs of
//! awkward sizes, every GPU output poisoned with NaN before the launch. Needs an NVIDIA GPU:
//! run scripts/gpu-tests.sh on the device.

mod common;
use common::rng;

use cudarc::driver::CudaSlice;
use kiln_core::backend::{
    compose_moe_norm_route, Activation, AttentionParams, Backend, DeltaNetParams, ExpertInput, GatedExperts, RouterArgs, RouterParams, StateSlots,
};
use kiln_core::plan::{KvType, LogitRows, SeqStep};
use kiln_core::tensor::{Tensor, TensorMut};
use kiln_core::Shape;
use kiln_cuda::{DeltaNetSpans, RegistryConfig};
use kiln_quant::GgmlType;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
#[path = "common/backends.rs"]
mod backends;
use backends::*;

/// expf, tanhf and log1pf against Rust's f32 functions: an ulp or two per value.
const TRANSCENDENTAL: f64 = 1e-6;

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn activations_gates_and_copies_match_cpu() {
    let mut rng = rng("arch_pointwise");
    let pair = Pair::new(1, 0);
    let (cpu, gpu) = (&pair.cpu, &pair.gpu);
    for len in [1, 37, 1000, 65_539] {
        // Amplitude 9: past gpt-oss's clamp (7) and deep into GELU's tails.
        let (a, b) = (random(&mut rng, len, 9.0), random(&mut rng, len, 9.0));
        let (ga, gb) = (upload(gpu, &a), upload(gpu, &b));
        let mut want = vec![0f32; len];
        let mut got = poisoned(gpu, len);
        cpu.geglu(view(&a, [len]), view(&b, [len]), view_mut(&mut want, [len])).expect("cpu");
        gpu.geglu(view(&ga, [len]), view(&gb, [len]), view_mut(&mut got, [len])).expect("gpu");
        // The CPU's vectorized tanh and tanhf differ by an ulp or two of 1, which is a large
        // relative error where GELU's output is nearly 0 (a short row of such values): so
        // relative to the row, or within 1e-5 of outputs of magnitude up to 81.
        let (rel, max_abs) = errors(&format!("geglu {len}"), &download(gpu, &got, len), &want);
        assert!(rel <= TRANSCENDENTAL || max_abs <= 1e-5, "geglu {len}: rel_l2 {rel:.3e}, max_abs {max_abs:.3e}");

        let mut got = poisoned(gpu, len);
        cpu.swiglu_oai(view(&a, [len]), view(&b, [len]), view_mut(&mut want, [len]), 1.702, 7.0).expect("cpu");
        gpu.swiglu_oai(view(&ga, [len]), view(&gb, [len]), view_mut(&mut got, [len]), 1.702, 7.0).expect("gpu");
        assert_close(&format!("swiglu_oai {len}"), &download(gpu, &got, len), &want, TRANSCENDENTAL);

        let mut want = a.clone();
        let mut got = upload(gpu, &a);
        cpu.scale(view_mut(&mut want, [len]), 0.37).expect("cpu");
        gpu.scale(view_mut(&mut got, [len]), 0.37).expect("gpu");
        assert_bitwise(&format!("scale {len}"), &download(gpu, &got, len), &want);

        let mut want = a.clone();
        let mut got = upload(gpu, &a);
        cpu.softcap(view_mut(&mut want, [len]), 3.0).expect("cpu");
        gpu.softcap(view_mut(&mut got, [len]), 3.0).expect("gpu");
        assert_close(&format!("softcap {len}"), &download(gpu, &got, len), &want, TRANSCENDENTAL);
        assert!(gpu.softcap(view_mut(&mut got, [len]), 0.0).is_err(), "a cap of 0 is refused");
    }
    for (n, dim) in [(1, 7), (5, 96), (3, 1000)] {
        let x = random(&mut rng, n * dim, 4.0);
        for gate_dim in [dim, 1] {
            let gate = random(&mut rng, n * gate_dim, 6.0);
            let mut want = x.clone();
            let mut got = upload(gpu, &x);
            cpu.sigmoid_gate(view_mut(&mut want, [n, dim]), view(&gate, [n, gate_dim])).expect("cpu");
            gpu.sigmoid_gate(view_mut(&mut got, [n, dim]), view(&upload(gpu, &gate), [n, gate_dim])).expect("gpu");
            assert_close(&format!("sigmoid_gate {n}x{dim} / {gate_dim}"), &download(gpu, &got, n * dim), &want, TRANSCENDENTAL);
        }
        // A block of columns of every row, nothing past it.
        let (col, width) = (dim / 3, dim - dim / 3 - dim / 5);
        let mut want = vec![0f32; n * width];
        let mut got = poisoned(gpu, n * width + 3);
        cpu.copy_cols(view(&x, [n, dim]), col, view_mut(&mut want, [n, width])).expect("cpu");
        gpu.copy_cols(view(&upload(gpu, &x), [n, dim]), col, view_mut(&mut got, [n, width])).expect("gpu");
        let got = download(gpu, &got, n * width + 3);
        assert_bitwise(&format!("copy_cols {n}x{dim} [{col}, +{width})"), &got[..n * width], &want);
        assert!(got[n * width..].iter().all(|v| v.is_nan()), "copy_cols wrote past its rows");
        let (gx, mut past) = (upload(gpu, &x), poisoned(gpu, n * dim));
        assert!(gpu.copy_cols(view(&gx, [n, dim]), col, view_mut(&mut past, [n, dim])).is_err(), "columns past the row are refused");
    }
    for (n, heads) in [(1, 4), (7, 32), (33, 3)] {
        // Gate pre-activations up to 30 in magnitude reach softplus's linear branch.
        let (g, beta) = (random(&mut rng, n * heads, 30.0), random(&mut rng, n * heads, 6.0));
        let (a, dt) = (random(&mut rng, heads, 2.0), random(&mut rng, heads, 1.0));
        let (mut wg, mut wb) = (g.clone(), beta.clone());
        cpu.delta_net_gates(view_mut(&mut wg, [n, heads]), view_mut(&mut wb, [n, heads]), view(&a, [heads]), view(&dt, [heads])).expect("cpu");
        let (mut gg, mut gb, ga, gdt) = (upload(gpu, &g), upload(gpu, &beta), upload(gpu, &a), upload(gpu, &dt));
        gpu.delta_net_gates(view_mut(&mut gg, [n, heads]), view_mut(&mut gb, [n, heads]), view(&ga, [heads]), view(&gdt, [heads])).expect("gpu");
        assert_close(&format!("delta_net_gates g {n}x{heads}"), &download(gpu, &gg, n * heads), &wg, TRANSCENDENTAL);
        assert_close(&format!("delta_net_gates beta {n}x{heads}"), &download(gpu, &gb, n * heads), &wb, TRANSCENDENTAL);
    }
}

/// Expert ids as the router writes them: `n_used` distinct ones per token.
fn random_ids(rng: &mut ChaCha8Rng, n: usize, n_used: usize, n_experts: usize) -> Vec<f32> {
    let mut all: Vec<usize> = (0..n_experts).collect();
    (0..n)
        .flat_map(|_| {
            all.shuffle(rng);
            all[..n_used].iter().map(|&e| e as f32).collect::<Vec<_>>()
        })
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn router_bias_and_combine_match_cpu() {
    let mut rng = rng("arch_router");
    let pair = Pair::new(1, 0);
    let (cpu, gpu) = (&pair.cpu, &pair.gpu);
    // 256 experts are the most the kernel keeps in registers; 257 and 300 take its shared-memory path.
    for (n, n_experts, n_used) in [(1, 8, 2), (5, 8, 8), (3, 60, 4), (9, 128, 8), (2, 200, 37), (2, 256, 8), (1, 257, 3), (3, 300, 40)] {
        // Continuous random logits: no ties, so the chosen ids must agree exactly. With a
        // shared expert, one more logit (its gate) and one more slot a token.
        let logits = random(&mut rng, n * (n_experts + 1), 4.0);
        let scale = random(&mut rng, n_experts, 2.0);
        for (renormalize, with_scale, shared_expert) in
            [(false, false, false), (false, true, false), (true, false, false), (true, true, false), (true, false, true), (false, true, true)]
        {
            let p = RouterParams { renormalize, shared_expert };
            let (columns, slots) = (n_experts + usize::from(shared_expert), n_used + usize::from(shared_expert));
            let logits = logits[..n * columns].to_vec();
            let s = with_scale.then(|| view(&scale, [n_experts]));
            let (mut want_ids, mut want_w) = (vec![0f32; n * slots], vec![0f32; n * slots]);
            let (logits_shape, chosen) = ([n, columns], [n, slots]);
            cpu.moe_route(view(&logits, logits_shape), s, view_mut(&mut want_ids, chosen), view_mut(&mut want_w, chosen), &p).expect("cpu");
            let (mut ids, mut w) = (poisoned(gpu, n * slots), poisoned(gpu, n * slots));
            let (gs, gl) = (with_scale.then(|| upload(gpu, &scale)), upload(gpu, &logits));
            let gs = gs.as_ref().map(|s| view(s, [n_experts]));
            gpu.moe_route(view(&gl, logits_shape), gs, view_mut(&mut ids, chosen), view_mut(&mut w, chosen), &p).expect("gpu");
            let what = format!("router {n} tokens, top {n_used} of {n_experts}, renormalize {renormalize}, scale {with_scale}, shared {shared_expert}");
            assert_bitwise(&format!("{what}: ids"), &download(gpu, &ids, n * slots), &want_ids);
            assert_close(&format!("{what}: weights"), &download(gpu, &w, n * slots), &want_w, TRANSCENDENTAL);
        }
    }
    for (n, n_used, dim, n_experts) in [(1, 2, 7, 4), (6, 4, 96, 8), (3, 8, 1000, 16)] {
        let ids = random_ids(&mut rng, n, n_used, n_experts);
        let (x, bias) = (random(&mut rng, n * n_used * dim, 2.0), random(&mut rng, n_experts * dim, 1.0));
        let mut want = x.clone();
        let mut got = upload(gpu, &x);
        let (slots, experts, chosen) = ([n, n_used, dim], [n_experts, dim], [n, n_used]);
        cpu.moe_add_bias(view_mut(&mut want, slots), view(&bias, experts), view(&ids, chosen)).expect("cpu");
        let (gbias, gids) = (upload(gpu, &bias), upload(gpu, &ids));
        gpu.moe_add_bias(view_mut(&mut got, slots), view(&gbias, experts), view(&gids, chosen)).expect("gpu");
        assert_bitwise(&format!("moe_add_bias {n}x{n_used}x{dim}"), &download(gpu, &got, n * n_used * dim), &want);

        let weights = random(&mut rng, n * n_used, 1.0);
        let mut want = vec![0f32; n * dim];
        let mut got = poisoned(gpu, n * dim);
        cpu.moe_combine(view(&x, slots), view(&weights, chosen), view_mut(&mut want, [n, dim])).expect("cpu");
        let (gx, gw) = (upload(gpu, &x), upload(gpu, &weights));
        gpu.moe_combine(view(&gx, slots), view(&gw, chosen), view_mut(&mut got, [n, dim])).expect("gpu");
        // The GPU contracts each weight-value product into its sum (fma).
        assert_close(&format!("moe_combine {n}x{n_used}x{dim}"), &download(gpu, &got, n * dim), &want, 1e-6);

        // With a shared expert (Qwen3.5), added to the residual in the same launch.
        let (shared, gate, residual) = (random(&mut rng, n * dim, 2.0), random(&mut rng, n, 3.0), random(&mut rng, n * dim, 1.0));
        let (mut want, mut cpu_shared, mut tmp) = (residual.clone(), shared.clone(), vec![0f32; n * dim]);
        let cpu_args = (view_mut(&mut cpu_shared, [n, dim]), view(&gate, [n, 1]));
        cpu.moe_combine_shared_add(view(&x, slots), view(&weights, chosen), cpu_args, view_mut(&mut want, [n, dim]), view_mut(&mut tmp, [n, dim]))
            .expect("cpu");
        let (mut gshared, ggate, mut got, mut gtmp) = (upload(gpu, &shared), upload(gpu, &gate), upload(gpu, &residual), poisoned(gpu, n * dim));
        let gpu_args = (view_mut(&mut gshared, [n, dim]), view(&ggate, [n, 1]));
        gpu.moe_combine_shared_add(view(&gx, slots), view(&gw, chosen), gpu_args, view_mut(&mut got, [n, dim]), view_mut(&mut gtmp, [n, dim])).expect("gpu");
        // The sigmoid's expf against Rust's exp: a few ulps more than the plain sum.
        assert_close(&format!("moe_combine_shared_add {n}x{n_used}x{dim}"), &download(gpu, &got, n * dim), &want, TRANSCENDENTAL);
        if n > 1 {
            let short_gate = upload(gpu, &gate[..n - 1]);
            let short = (view_mut(&mut gshared, [n, dim]), view(&short_gate, [n - 1, 1]));
            let refused = gpu.moe_combine_shared_add(view(&gx, slots), view(&gw, chosen), short, view_mut(&mut got, [n, dim]), view_mut(&mut gtmp, [n, dim]));
            assert!(refused.is_err(), "a gate logit short of a token is refused");
        }
    }
}

/// The fused norm and router (one launch for up to 8 tokens of a router with a bias; without a
/// bias, the experts' norm writing their int8 input) against the same ops composed on the GPU
/// and on the CPU, with and without the router's own norm and expert scales; then the expert
/// SwiGLU on the int8 input the router call wrote against the one on its own quantization of
/// the composed `h` (bit for bit), and on another input.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn fused_norm_router_matches_the_composed_ops() {
    let mut rng = rng("arch_norm_router");
    let pair = Pair::new(1, 0);
    let (cpu, gpu) = (&pair.cpu, &pair.gpu);
    let eps = 1e-6;
    // Rows of at most 512 take the warp reduction of the norm, longer ones the block's; routers
    // without a bias, 9 tokens and 257 experts are past the fused launch (composed either way);
    // 2880 columns leave a partial 512-value tile of the int8 input (gpt-oss).
    for (n, n_experts, cols, n_used, own_norm, with_bias, with_scale) in [
        (1, 128, 2048, 8, false, true, false),
        (3, 8, 64, 2, true, true, true),
        (8, 32, 2880, 4, false, true, false),
        (2, 256, 512, 8, true, true, true),
        (5, 60, 528, 6, false, false, true),
        (1, 128, 2048, 8, false, false, false),
        (9, 16, 256, 2, false, true, false),
        (1, 257, 256, 3, false, false, false),
    ] {
        let what = format!("{n} tokens, {n_experts} experts of {cols}, top {n_used}, own norm {own_norm}, bias {with_bias}, scale {with_scale}");
        let x = random(&mut rng, n * cols, 2.0);
        let (norm, router_norm) = (random(&mut rng, cols, 1.5), random(&mut rng, cols, 1.5));
        let (bias, scale) = (random(&mut rng, n_experts, 1.0), random(&mut rng, n_experts, 2.0));
        let source = weight_source("router", GgmlType::F32, n_experts, cols, &random(&mut rng, n_experts * cols, 0.2));
        let (cw, gw) = (cpu.upload_weight(source.clone()).expect("cpu"), gpu.upload_weight(source).expect("gpu"));
        let (gx, gnorm, grouter_norm, gbias, gscale) =
            (upload(gpu, &x), upload(gpu, &norm), upload(gpu, &router_norm), upload(gpu, &bias), upload(gpu, &scale));
        let (rows, logit_rows, chosen) = ([n, cols], [n, n_experts], [n, n_used]);
        for renormalize in [false, true] {
            let params = RouterParams { renormalize, shared_expert: false };
            let cpu_router = RouterArgs {
                weight: &cw,
                norm: own_norm.then(|| view(&router_norm, [cols])),
                bias: with_bias.then(|| view(&bias, [n_experts])),
                expert_scale: with_scale.then(|| view(&scale, [n_experts])),
                params,
                shared_gate: None,
            };
            let gpu_router = || RouterArgs {
                weight: &gw,
                norm: own_norm.then(|| view(&grouter_norm, [cols])),
                bias: with_bias.then(|| view(&gbias, [n_experts])),
                expert_scale: with_scale.then(|| view(&gscale, [n_experts])),
                params,
                shared_gate: None,
            };
            let (mut h, mut logits, mut ids, mut w) = (vec![0f32; n * cols], vec![0f32; n * n_experts], vec![0f32; n * n_used], vec![0f32; n * n_used]);
            let routes = [view_mut(&mut ids, chosen), view_mut(&mut w, chosen)];
            cpu.moe_norm_route(view(&x, rows), (view(&norm, [cols]), eps), cpu_router, view_mut(&mut h, rows), view_mut(&mut logits, logit_rows), routes)
                .expect("cpu");
            let outputs = || (poisoned(gpu, n * cols), poisoned(gpu, n * n_experts), poisoned(gpu, n * n_used), poisoned(gpu, n * n_used));
            let (mut ch, mut cl, mut cids, mut cw8) = outputs();
            let routes = [view_mut(&mut cids, chosen), view_mut(&mut cw8, chosen)];
            let composed_h = view_mut(&mut ch, rows);
            let plain_norm = |x: Tensor<CudaSlice<f32>>, norm: (Tensor<CudaSlice<f32>>, f32), h: TensorMut<CudaSlice<f32>>| gpu.rms_norm(x, norm.0, h, norm.1);
            compose_moe_norm_route(
                gpu,
                view(&gx, rows),
                (view(&gnorm, [cols]), eps),
                gpu_router(),
                composed_h,
                view_mut(&mut cl, logit_rows),
                routes,
                plain_norm,
            )
            .expect("composed");
            let (mut fh, mut fl, mut fids, mut fw) = outputs();
            let routes = [view_mut(&mut fids, chosen), view_mut(&mut fw, chosen)];
            gpu.moe_norm_route(view(&gx, rows), (view(&gnorm, [cols]), eps), gpu_router(), view_mut(&mut fh, rows), view_mut(&mut fl, logit_rows), routes)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let what = format!("{what}, renormalize {renormalize}");
            // h: the same reduction and product order as the norm kernels.
            assert_bitwise(&format!("{what}: h"), &download(gpu, &fh, n * cols), &download(gpu, &ch, n * cols));
            assert_close(&format!("{what}: h against the CPU"), &download(gpu, &fh, n * cols), &h, 1e-6);
            // The logits sum the same products in another order than the float mat-vec; past 8
            // tokens (composed) the router product runs on tensor cores in f16.
            let got_logits = download(gpu, &fl, n * n_experts);
            let (fused, got_ids) = (with_bias && n <= 8 && n_experts <= 256, download(gpu, &fids, n * n_used));
            assert_close(&format!("{what}: logits"), &got_logits, &download(gpu, &cl, n * n_experts), 1e-5);
            assert_close(&format!("{what}: logits against the CPU"), &got_logits, &logits, if fused { 1e-5 } else { 1e-3 });
            // Continuous random logits: no near ties, so the same experts in the same order.
            assert_bitwise(&format!("{what}: ids"), &got_ids, &download(gpu, &cids, n * n_used));
            if fused {
                assert_bitwise(&format!("{what}: ids against the CPU"), &got_ids, &ids);
                assert_close(&format!("{what}: weights"), &download(gpu, &fw, n * n_used), &w, 1e-5);
            }

            // The expert SwiGLU (Q4_K experts: rows of whole 256-value blocks) on the fused
            // launch's int8 input, or (composed) on its own quantization, against the composed h.
            if cols % 256 != 0 {
                continue;
            }
            let ff = 48;
            let experts = |rng: &mut ChaCha8Rng, name: &str| -> Vec<_> {
                (0..n_experts)
                    .map(|e| gpu.upload_weight(weight_source(&format!("{name} {e}"), GgmlType::Q4_K, ff, cols, &random(rng, ff * cols, 1.0))))
                    .collect()
            };
            let (gate, up): (Vec<_>, Vec<_>) = (
                experts(&mut rng, "gate").into_iter().map(|w| w.expect("gate")).collect(),
                experts(&mut rng, "up").into_iter().map(|w| w.expect("up")).collect(),
            );
            let slots = [n, n_used, ff];
            let swiglu = |x: &CudaSlice<f32>, ids: &CudaSlice<f32>| {
                let (mut s1, mut s2, mut out) = (poisoned(gpu, n * n_used * ff), poisoned(gpu, n * n_used * ff), poisoned(gpu, n * n_used * ff));
                let scratch = [view_mut(&mut s1, slots), view_mut(&mut s2, slots)];
                let experts = GatedExperts { gate: &gate, up: &up, bias: None, act: Activation::Silu };
                gpu.moe_gate_up(experts, view(x, rows), view(ids, chosen), scratch, view_mut(&mut out, slots)).expect("swiglu");
                download(gpu, &out, n * n_used * ff)
            };
            // Right after a fused launch: the SwiGLU of its h (which then skips its quantization),
            // or of another input (quantized anew).
            let other = upload(gpu, &random(&mut rng, n * cols, 1.0));
            let want_other = swiglu(&other, &cids);
            for on_other in [false, true] {
                let routes = [view_mut(&mut fids, chosen), view_mut(&mut fw, chosen)];
                gpu.moe_norm_route(view(&gx, rows), (view(&gnorm, [cols]), eps), gpu_router(), view_mut(&mut fh, rows), view_mut(&mut fl, logit_rows), routes)
                    .expect("fused again");
                if on_other {
                    assert_bitwise(&format!("{what}: expert SwiGLU on another input"), &swiglu(&other, &cids), &want_other);
                } else {
                    let after_fused = swiglu(&fh, &fids);
                    assert_bitwise(&format!("{what}: expert SwiGLU after the fused router"), &after_fused, &swiglu(&ch, &cids));
                }
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn expert_products_match_cpu_and_each_experts_own_product() {
    let mut rng = rng("arch_experts");
    let pair = Pair::new(1, 0);
    let (cpu, gpu) = (&pair.cpu, &pair.gpu);
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::MXFP4, GgmlType::Q4_0] {
        // 1..8 tokens: a launch per slot; more: slots grouped by expert (up to 8 per group,
        // several groups for an expert many tokens chose, experts nobody chose).
        for (n_experts, rows, cols, n, n_used) in [(5, 72, 256, 1, 2), (8, 300, 512, 3, 4), (4, 33, 256, 9, 1), (6, 64, 768, 20, 3), (128, 40, 256, 64, 8)] {
            let sources: Vec<_> = (0..n_experts).map(|e| weight_source(&format!("expert {e}"), ty, rows, cols, &random(&mut rng, rows * cols, 1.0))).collect();
            let cw: Vec<_> = sources.iter().map(|s| cpu.upload_weight(s.clone()).expect("cpu")).collect();
            let gw: Vec<_> = sources.iter().map(|s| gpu.upload_weight(s.clone()).expect("gpu")).collect();
            let ids = random_ids(&mut rng, n, n_used, n_experts);
            let gids = upload(gpu, &ids);
            for input in [ExpertInput::PerToken, ExpertInput::PerSlot] {
                let in_rows = if input == ExpertInput::PerSlot { n * n_used } else { n };
                let x_shape: Shape = if input == ExpertInput::PerSlot { [n, n_used, cols].into() } else { [n, cols].into() };
                let (chosen, out_shape) = ([n, n_used], [n, n_used, rows]);
                let x = random(&mut rng, in_rows * cols, 1.0);
                let gx = upload(gpu, &x);
                let what = format!("{ty} experts {n_experts}x{rows}x{cols}, {n} tokens x {n_used}, {input:?}");
                let mut want = vec![0f32; n * n_used * rows];
                cpu.moe_matmul(&cw, view(&x, x_shape), view(&ids, chosen), view_mut(&mut want, out_shape), input).expect("cpu");
                let mut got = poisoned(gpu, n * n_used * rows);
                gpu.moe_matmul(&gw, view(&gx, x_shape), view(&gids, chosen), view_mut(&mut got, out_shape), input).unwrap_or_else(|e| panic!("{what}: {e}"));
                let got = download(gpu, &got, n * n_used * rows);
                // As the mat-vec: int8 activations for quantized experts (about 0.5% relative
                // L2), f32 for float ones.
                let tolerance = if matches!(ty, GgmlType::F32 | GgmlType::F16) { 1e-5 } else { 1e-2 };
                assert_close(&what, &got, &want, tolerance);
                // Up to 8 tokens, each slot equals its expert's own one-token product on its
                // input row: the same kernel body, so only the launch shape (the warp's row
                // count) may differ. More go through the grouped product, whose way (the
                // mat-vec, or a tensor-core tile on f16 activations) the tuner picks by time.
                let alone_tolerance = if n <= 8 { 1e-6 } else { tolerance };
                for slot in [0, n * n_used - 1] {
                    let row = if input == ExpertInput::PerSlot { slot } else { slot / n_used };
                    let mut one = poisoned(gpu, rows);
                    let x_row = upload(gpu, &x[row * cols..(row + 1) * cols]);
                    gpu.matmul(&gw[ids[slot] as usize], view(&x_row, [1, cols]), view_mut(&mut one, [1, rows])).expect("gpu matmul");
                    assert_close(&format!("{what}: slot {slot} alone"), &got[slot * rows..(slot + 1) * rows], &download(gpu, &one, rows), alone_tolerance);
                }
            }
            // The gated gate/up products (one launch for up to 8 tokens, else composed), with and
            // without per-expert biases, each activation; the down product with its bias.
            let up_sources: Vec<_> = (0..n_experts).map(|e| weight_source(&format!("up {e}"), ty, rows, cols, &random(&mut rng, rows * cols, 1.0))).collect();
            let cu: Vec<_> = up_sources.iter().map(|s| cpu.upload_weight(s.clone()).expect("cpu")).collect();
            let gu: Vec<_> = up_sources.iter().map(|s| gpu.upload_weight(s.clone()).expect("gpu")).collect();
            let x = random(&mut rng, n * cols, 1.0);
            let len = n * n_used * rows;
            let (chosen, slots) = ([n, n_used], [n, n_used, rows]);
            let biases = [random(&mut rng, n_experts * rows, 1.0), random(&mut rng, n_experts * rows, 1.0)];
            let gpu_biases = [upload(gpu, &biases[0]), upload(gpu, &biases[1])];
            let gx = upload(gpu, &x);
            for (act, biased) in
                [(Activation::Silu, false), (Activation::GeluTanh, false), (Activation::SwiGluOai { alpha: 1.702, limit: 7.0 }, true), (Activation::Silu, true)]
            {
                let bias_shape = [n_experts, rows];
                let mut want = vec![0f32; len];
                let (mut c1, mut c2) = (vec![0f32; len], vec![0f32; len]);
                let scratch = [view_mut(&mut c1, slots), view_mut(&mut c2, slots)];
                let bias = biased.then(|| [view(&biases[0], bias_shape), view(&biases[1], bias_shape)]);
                cpu.moe_gate_up(GatedExperts { gate: &cw, up: &cu, bias, act }, view(&x, [n, cols]), view(&ids, chosen), scratch, view_mut(&mut want, slots))
                    .expect("cpu");
                let mut got = poisoned(gpu, len);
                let (mut s1, mut s2) = (poisoned(gpu, len), poisoned(gpu, len));
                let scratch = [view_mut(&mut s1, slots), view_mut(&mut s2, slots)];
                let bias = biased.then(|| [view(&gpu_biases[0], bias_shape), view(&gpu_biases[1], bias_shape)]);
                gpu.moe_gate_up(GatedExperts { gate: &gw, up: &gu, bias, act }, view(&gx, [n, cols]), view(&gids, chosen), scratch, view_mut(&mut got, slots))
                    .expect("gpu");
                let tolerance = if matches!(ty, GgmlType::F32 | GgmlType::F16) { 1e-5 } else { 2e-2 };
                let what = format!("{ty} expert {act:?} (bias {biased}) {n_experts}x{rows}x{cols}, {n} tokens x {n_used}");
                assert_close(&what, &download(gpu, &got, len), &want, tolerance);
            }
            let mut want = vec![0f32; len];
            let bias_shape = [n_experts, rows];
            cpu.moe_matmul_bias(&cw, view(&biases[0], bias_shape), view(&x, [n, cols]), view(&ids, chosen), view_mut(&mut want, slots), ExpertInput::PerToken)
                .expect("cpu");
            let mut got = poisoned(gpu, len);
            gpu.moe_matmul_bias(
                &gw,
                view(&gpu_biases[0], bias_shape),
                view(&gx, [n, cols]),
                view(&gids, chosen),
                view_mut(&mut got, slots),
                ExpertInput::PerToken,
            )
            .expect("gpu");
            let tolerance = if matches!(ty, GgmlType::F32 | GgmlType::F16) { 1e-5 } else { 1e-2 };
            assert_close(&format!("{ty} experts with bias {n_experts}x{rows}x{cols}, {n} tokens x {n_used}"), &download(gpu, &got, len), &want, tolerance);

            // An id that names no expert gives NaN rows, never another expert's product.
            let mut bad = ids.clone();
            bad[0] = n_experts as f32;
            let mut got = poisoned(gpu, n * n_used * rows);
            let x = upload(gpu, &random(&mut rng, n * cols, 1.0));
            let gbad = upload(gpu, &bad);
            gpu.moe_matmul(&gw, view(&x, [n, cols]), view(&gbad, [n, n_used]), view_mut(&mut got, [n, n_used, rows]), ExpertInput::PerToken).expect("gpu");
            let got = download(gpu, &got, n * n_used * rows);
            assert!(got[..rows].iter().all(|v| v.is_nan()), "{ty}: a bad expert id must give NaN");
        }
    }
}

/// The one-token expert products (plain, both input layouts, and the fused SwiGLU) in every
/// launch shape the tuner may pick, against the CPU: rows that leave partial blocks for every
/// shape, rows of two tiles and one, a grouped (1-bit) format among them.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn expert_products_match_cpu_in_every_launch_shape() {
    let mut rng = rng("arch_expert_shapes");
    let pair = Pair::new(1, 0);
    let (cpu, gpu) = (&pair.cpu, &pair.gpu);
    let products = kiln_cuda::matvec::ExpertProducts::default();
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::MXFP4, GgmlType::Q8_0, GgmlType::Q1_0, GgmlType::IQ4_XS] {
        for (n_experts, rows, cols, n, n_used) in [(6, 72, 768, 1, 4), (8, 300, 512, 2, 3), (4, 33, 1024, 1, 1), (5, 256, 256, 3, 2)] {
            let upload_set = |rng: &mut ChaCha8Rng, name: &str| {
                let sources: Vec<_> = (0..n_experts).map(|e| weight_source(&format!("{name} {e}"), ty, rows, cols, &random(rng, rows * cols, 1.0))).collect();
                let cw: Vec<_> = sources.iter().map(|s| cpu.upload_weight(s.clone()).expect("cpu")).collect();
                let gw: Vec<_> = sources.iter().map(|s| gpu.upload_weight(s.clone()).expect("gpu")).collect();
                (cw, gw)
            };
            let ((cw, gw), (cu, gu)) = (upload_set(&mut rng, "gate"), upload_set(&mut rng, "up"));
            let ids = random_ids(&mut rng, n, n_used, n_experts);
            let gids = upload(gpu, &ids);
            let (chosen, slots, len) = ([n, n_used], [n, n_used, rows], n * n_used * rows);
            // (layout, its input on the GPU, the CPU's products)
            let mut inputs = Vec::new();
            for input in [ExpertInput::PerToken, ExpertInput::PerSlot] {
                let in_rows = if input == ExpertInput::PerSlot { n * n_used } else { n };
                let x_shape: Shape = if input == ExpertInput::PerSlot { [n, n_used, cols].into() } else { [n, cols].into() };
                let x = random(&mut rng, in_rows * cols, 1.0);
                let mut expected = vec![0f32; len];
                cpu.moe_matmul(&cw, view(&x, x_shape), view(&ids, chosen), view_mut(&mut expected, slots), input).expect("cpu");
                inputs.push((input, upload(gpu, &x), expected));
            }
            // The gated product as gpt-oss takes it: biases, clamped SwiGLU.
            let x = random(&mut rng, n * cols, 1.0);
            let biases = [random(&mut rng, n_experts * rows, 1.0), random(&mut rng, n_experts * rows, 1.0)];
            let act = Activation::SwiGluOai { alpha: 1.702, limit: 7.0 };
            let mut want_gated = vec![0f32; len];
            let (mut c1, mut c2) = (vec![0f32; len], vec![0f32; len]);
            let scratch = [view_mut(&mut c1, slots), view_mut(&mut c2, slots)];
            let bias = Some([view(&biases[0], [n_experts, rows]), view(&biases[1], [n_experts, rows])]);
            cpu.moe_gate_up(GatedExperts { gate: &cw, up: &cu, bias, act }, view(&x, [n, cols]), view(&ids, chosen), scratch, view_mut(&mut want_gated, slots))
                .expect("cpu");
            let mut want_biased = vec![0f32; len];
            cpu.moe_matmul_bias(
                &cw,
                view(&biases[0], [n_experts, rows]),
                view(&x, [n, cols]),
                view(&ids, chosen),
                view_mut(&mut want_biased, slots),
                ExpertInput::PerToken,
            )
            .expect("cpu");
            let (gx, gpu_biases) = (upload(gpu, &x), [upload(gpu, &biases[0]), upload(gpu, &biases[1])]);
            let mut tried = 0;
            for shape in (0..kiln_cuda::matvec::MATVEC_SHAPE_COUNT).filter(|&s| kiln_cuda::matvec::matvec_shape_fits(s, &gw[0], 1)) {
                tried += 1;
                let what = format!("{ty} experts {n_experts}x{rows}x{cols}, {n} tokens x {n_used}, shape {shape}");
                for (input, gx, want) in &inputs {
                    let mut got = poisoned(gpu, len);
                    let call = kiln_cuda::matvec::ExpertCall { experts: &gw, x: gx, ids: &gids, n, n_used, input: *input };
                    products.matmul_with_shape(gpu.device(), call, None, &mut got, shape).unwrap_or_else(|e| panic!("{what}: {e}"));
                    // int8 activations: about 0.5% relative L2 (the mat-vec's tolerance).
                    assert_close(&format!("{what}, {input:?}"), &download(gpu, &got, len), want, 1e-2);
                }
                let call = kiln_cuda::matvec::ExpertCall { experts: &gw, x: &gx, ids: &gids, n, n_used, input: ExpertInput::PerToken };
                let mut got = poisoned(gpu, len);
                products.matmul_with_shape(gpu.device(), call, Some(&gpu_biases[0]), &mut got, shape).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_close(&format!("{what}, with bias"), &download(gpu, &got, len), &want_biased, 1e-2);
                let mut got = poisoned(gpu, len);
                let gated = kiln_cuda::matvec::GatedCall { up: &gu, bias: Some([&gpu_biases[0], &gpu_biases[1]]), act };
                let fused = products.matmul_gated_with_shape(gpu.device(), call, gated, &mut got, shape).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert!(fused.is_some(), "{what}: the gated product of quantized experts is one launch");
                assert_close(&format!("{what}, gated"), &download(gpu, &got, len), &want_gated, 2e-2);
            }
            assert!(tried >= 10, "{ty}: only {tried} launch shapes tried");
            // A shape the format cannot take is refused, not run.
            let call = kiln_cuda::matvec::ExpertCall { experts: &gw, x: &inputs[0].1, ids: &gids, n, n_used, input: ExpertInput::PerToken };
            let mut got = poisoned(gpu, len);
            assert!(
                products.matmul_with_shape(gpu.device(), call, None, &mut got, kiln_cuda::matvec::MATVEC_SHAPE_COUNT).is_err(),
                "{ty}: a shape past the list"
            );
            // Float experts take neither a launch shape nor a fused bias: refused, not ignored.
            if ty == GgmlType::Q8_0 {
                let float: Vec<_> = (0..n_experts)
                    .map(|e| {
                        gpu.upload_weight(weight_source(&format!("f16 {e}"), GgmlType::F16, rows, cols, &random(&mut rng, rows * cols, 1.0))).expect("gpu")
                    })
                    .collect();
                let call = kiln_cuda::matvec::ExpertCall { experts: &float, x: &gx, ids: &gids, n, n_used, input: ExpertInput::PerToken };
                let mut got = poisoned(gpu, len);
                assert!(products.matmul_with_shape(gpu.device(), call, Some(&gpu_biases[0]), &mut got, 0).is_err(), "{ty}: a shape for float experts");
            }
        }
    }
}

/// Every way of the grouped expert product (the mat-vec over groups of 8 slots and each
/// tensor-core tile over groups of its token count) against the CPU: groups cut at awkward
/// counts, experts nobody chose, rows and columns off the tile sizes, both input layouts.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn grouped_expert_products_match_cpu_on_every_way() {
    let mut rng = rng("arch_expert_groups");
    let pair = Pair::new(1, 0);
    let (cpu, gpu) = (&pair.cpu, &pair.gpu);
    let products = kiln_cuda::matvec::ExpertProducts::default();
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0, GgmlType::MXFP4, GgmlType::Q4_0, GgmlType::IQ4_XS, GgmlType::Q5_K, GgmlType::Q2_K] {
        for (n_experts, rows, cols, n, n_used) in [(8, 300, 512, 64, 4), (4, 33, 256, 100, 2), (16, 200, 768, 77, 3), (128, 40, 256, 64, 8)] {
            let sources: Vec<_> = (0..n_experts).map(|e| weight_source(&format!("expert {e}"), ty, rows, cols, &random(&mut rng, rows * cols, 1.0))).collect();
            let cw: Vec<_> = sources.iter().map(|s| cpu.upload_weight(s.clone()).expect("cpu")).collect();
            let gw: Vec<_> = sources.iter().map(|s| gpu.upload_weight(s.clone()).expect("gpu")).collect();
            // Skewed choices: expert 0 takes most tokens (several full groups), the last never.
            let mut ids = random_ids(&mut rng, n, n_used, n_experts - 1);
            for t in (0..n).step_by(2) {
                if !ids[t * n_used..(t + 1) * n_used].contains(&0.0) {
                    ids[t * n_used] = 0.0;
                }
            }
            let gids = upload(gpu, &ids);
            for input in [ExpertInput::PerToken, ExpertInput::PerSlot] {
                let in_rows = if input == ExpertInput::PerSlot { n * n_used } else { n };
                let x_shape: Shape = if input == ExpertInput::PerSlot { [n, n_used, cols].into() } else { [n, cols].into() };
                let x = random(&mut rng, in_rows * cols, 1.0);
                let gx = upload(gpu, &x);
                let mut want = vec![0f32; n * n_used * rows];
                cpu.moe_matmul(&cw, view(&x, x_shape), view(&ids, [n, n_used]), view_mut(&mut want, [n, n_used, rows]), input).expect("cpu");
                for way in 0..kiln_cuda::matvec::grouped_ways() {
                    let what = format!("{ty} experts {n_experts}x{rows}x{cols}, {n} tokens x {n_used}, {input:?}, way {way}");
                    let mut got = poisoned(gpu, n * n_used * rows);
                    let call = kiln_cuda::matvec::ExpertCall { experts: &gw, x: &gx, ids: &gids, n, n_used, input };
                    products.matmul_grouped_way(gpu.device(), call, &mut got, way).unwrap_or_else(|e| panic!("{what}: {e}"));
                    // int8 activations (way 0, about 0.5% relative L2) or f16 ones (3e-4), and
                    // the CPU's own int8 activations.
                    assert_close(&what, &download(gpu, &got, n * n_used * rows), &want, 1e-2);
                }
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn sliding_window_and_sink_attention_match_cpu() {
    let mut rng = rng("arch_attention");
    let mut pair = Pair::new(16, 0);
    for (n_heads, n_kv_heads, head_dim) in [(4, 2, 64), (8, 1, 128), (6, 3, 32)] {
        let width = n_kv_heads * head_dim;
        for ty in [KvType::F32, KvType::F16, KvType::Q8_0] {
            let mut caches = Caches::new(&pair, width, ty, ty);
            caches.fill_all(&pair, &mut rng);
            let sinks = random(&mut rng, n_heads, 3.0);
            let gpu_sinks = upload(&pair.gpu, &sinks);
            for window in [None, Some(1), Some(8), Some(33), Some(100), Some(4096)] {
                let p = AttentionParams { n_heads, n_kv_heads, head_dim, max_seq_len: CACHE_ROWS, scale: 1.0 / (head_dim as f32).sqrt(), window };
                // Decode tokens inside and far past their windows, a prefill chunk straddling
                // a window and block edges, and the two mixed.
                let steps: Vec<Vec<Chunk>> = vec![
                    [0, 5, 31, 32, 33, 100, 1000, 4094].iter().map(|&pos| Chunk { n: 1, pos0: pos, table: shuffled(&mut rng, pos + 1) }).collect(),
                    vec![Chunk { n: 16, pos0: 90, table: shuffled(&mut rng, 106) }],
                    [(9, 0), (1, 77), (3, 1000)].iter().map(|&(n, pos0)| Chunk { n, pos0, table: shuffled(&mut rng, pos0 + n) }).collect(),
                ];
                for chunks in steps {
                    pair.set_chunks(&chunks);
                    let seqs: Vec<String> = chunks.iter().map(|c| format!("{}+{}", c.pos0, c.n)).collect();
                    let what = format!("{n_heads}/{n_kv_heads} heads of {head_dim}, {ty}, window {window:?}, seqs [{}]", seqs.join(" "));
                    let (got, want) = attend(&pair, &caches, &mut rng, &p);
                    assert_close(&what, &got, &want, attention_tolerance(&pair.plan));
                    let n = pair.plan.n_tokens();
                    let q = random(&mut rng, n * n_heads * head_dim, 3.0);
                    let (mut want, shape) = (vec![0f32; q.len()], [n, n_heads * head_dim]);
                    pair.cpu
                        .attention_sinks(view(&q, shape), &caches.cpu, view(&sinks, [n_heads]), view_mut(&mut want, shape), &pair.cpu_step, &p)
                        .expect("cpu");
                    let (mut got, gq) = (poisoned(&pair.gpu, q.len()), upload(&pair.gpu, &q));
                    let gsinks = view(&gpu_sinks, [n_heads]);
                    pair.gpu.attention_sinks(view(&gq, shape), &caches.gpu, gsinks, view_mut(&mut got, shape), &pair.gpu_step, &p).expect("gpu");
                    assert_close(&format!("{what} with sinks"), &download(&pair.gpu, &got, q.len()), &want, attention_tolerance(&pair.plan));
                }
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn delta_net_convolution_and_both_forms_match_cpu() {
    // The same inputs (the same seed) through each form of the delta rule: each against the
    // CPU, and the chunked outputs and states against the recurrence's.
    let seed = rng("arch_delta_net").gen::<u64>();
    let mut by_form = Vec::new();
    for form in [DeltaNetSpans::Recurrence, DeltaNetSpans::Chunked, DeltaNetSpans::Fastest] {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut pair = Pair::with_config(shared_gpu(), RegistryConfig { delta_net_spans: form, ..Default::default() }, 160, 0);
        let mut results = Vec::new();
        for (n_k_heads, n_v_heads, head_dim) in [(2, 6, 32), (2, 4, 64), (1, 2, 128)] {
            let p = DeltaNetParams { n_k_heads, n_v_heads, head_dim, conv_kernel: 4 };
            let (c, nv) = (p.conv_dim(), n_v_heads);
            let n_slots = 4;
            // States of every slot start random: a fresh sequence (position 0) must ignore its
            // slot's, a continuing one must read it.
            let conv_state = random(&mut rng, n_slots * p.conv_state(), 1.0);
            let ssm_state = random(&mut rng, n_slots * p.ssm_state(), 0.3);
            let conv_weight = random(&mut rng, c * p.conv_kernel, 0.5);
            let gconv_weight = upload(&pair.gpu, &conv_weight);
            // Spans of one token to several chunks of 32, whole and partial, fresh and continued.
            for shape in [vec![(0, 7), (12, 1), (3, 20)], vec![(40, 1), (0, 1)], vec![(0, 33)], vec![(5, 100), (0, 2), (9, 32)], vec![(0, 64)]] {
                let tokens: Vec<Vec<u32>> = shape.iter().map(|&(_, n)| vec![0; n]).collect();
                let tables: Vec<Vec<u32>> = shape.iter().map(|&(pos0, n)| contiguous(pos0 + n).iter().map(|b| b % CACHE_BLOCKS as u32).collect()).collect();
                let seqs: Vec<SeqStep> = shape
                    .iter()
                    .zip(&tokens)
                    .zip(&tables)
                    .map(|((&(pos0, _), t), b)| SeqStep { tokens: t, pos0, blocks: b, logits: LogitRows::None, sample: None })
                    .collect();
                pair.set_plan(&seqs);
                let n = pair.plan.n_tokens();
                // Slots in a scrambled order, one per sequence.
                let slots: Vec<f32> = [2.0, 0.0, 3.0][..shape.len()].to_vec();
                let gslots = upload(&pair.gpu, &slots);
                let what = format!("DeltaNet {n_k_heads}/{n_v_heads} heads of {head_dim}, seqs {shape:?}, {form:?}");

                let x = random(&mut rng, n * c, 1.0);
                let (rows, weight, conv_states, slot_shape) = ([n, c], [c, p.conv_kernel], [n_slots, p.conv_state()], [slots.len()]);
                let (mut want_conv, mut want_state) = (vec![0f32; n * c], conv_state.clone());
                let state = StateSlots { state: view_mut(&mut want_state, conv_states), slots: view(&slots, slot_shape) };
                pair.cpu.ssm_conv(view(&x, rows), view(&conv_weight, weight), state, view_mut(&mut want_conv, rows), &pair.cpu_step, &p).expect("cpu");
                let (mut got_conv, mut got_state, gx) = (poisoned(&pair.gpu, n * c), upload(&pair.gpu, &conv_state), upload(&pair.gpu, &x));
                let state = StateSlots { state: view_mut(&mut got_state, conv_states), slots: view(&gslots, slot_shape) };
                pair.gpu.ssm_conv(view(&gx, rows), view(&gconv_weight, weight), state, view_mut(&mut got_conv, rows), &pair.gpu_step, &p).expect("gpu");
                assert_close(&format!("{what}: convolution"), &download(&pair.gpu, &got_conv, n * c), &want_conv, TRANSCENDENTAL);
                assert_close(&format!("{what}: convolution state"), &download(&pair.gpu, &got_state, conv_state.len()), &want_state, 1e-7);

                // Gates as delta_net_gates leaves them: log decays below 0, strengths in (0, 1).
                let g: Vec<f32> = random(&mut rng, n * nv, 1.0).iter().map(|v| -0.6 * (v + 1.0)).collect();
                let beta: Vec<f32> = random(&mut rng, n * nv, 1.0).iter().map(|v| 0.5 * (v + 1.0)).collect();
                let (heads, outs, ssm_states) = ([n, nv], [n, nv * head_dim], [n_slots, p.ssm_state()]);
                let (mut want_out, mut want_ssm) = (vec![0f32; n * nv * head_dim], ssm_state.clone());
                let state = StateSlots { state: view_mut(&mut want_ssm, ssm_states), slots: view(&slots, slot_shape) };
                let gates = [view(&g, heads), view(&beta, heads)];
                pair.cpu.delta_net(view(&want_conv, rows), gates, state, view_mut(&mut want_out, outs), &pair.cpu_step, &p).expect("cpu");
                let (mut got_out, mut got_ssm) = (poisoned(&pair.gpu, n * nv * head_dim), upload(&pair.gpu, &ssm_state));
                let (gg, gb, gconv) = (upload(&pair.gpu, &g), upload(&pair.gpu, &beta), upload(&pair.gpu, &want_conv));
                let state = StateSlots { state: view_mut(&mut got_ssm, ssm_states), slots: view(&gslots, slot_shape) };
                let gates = [view(&gg, heads), view(&gb, heads)];
                pair.gpu.delta_net(view(&gconv, rows), gates, state, view_mut(&mut got_out, outs), &pair.gpu_step, &p).expect("gpu");
                // The CPU runs spans of two or more tokens in its chunked form, which equals the
                // recurrence up to f32 rounding (kiln-core measures 5e-7..1.1e-6).
                let (got_out, got_ssm) = (download(&pair.gpu, &got_out, n * nv * head_dim), download(&pair.gpu, &got_ssm, ssm_state.len()));
                assert_close(&format!("{what}: outputs"), &got_out, &want_out, 1e-5);
                assert_close(&format!("{what}: states"), &got_ssm, &want_ssm, 1e-5);
                // An unused slot's state is left alone.
                let slot1 = p.ssm_state()..2 * p.ssm_state();
                assert_bitwise(&format!("{what}: untouched slot"), &got_ssm[slot1.clone()], &ssm_state[slot1]);

                // The same rule from the gates' projections, which the kernels turn into gates as
                // they read them: bit for bit the gates' launch then the rule, and the CPU's.
                let (g_raw, beta_raw) = (random(&mut rng, n * nv, 2.0), random(&mut rng, n * nv, 2.0));
                let a_log_neg: Vec<f32> = random(&mut rng, nv, 1.0).iter().map(|v| -(v.abs() + 0.1)).collect();
                let dt_bias = random(&mut rng, nv, 1.0);
                let (ga, gd) = (upload(&pair.gpu, &a_log_neg), upload(&pair.gpu, &dt_bias));
                let run = |from_projections: bool| {
                    let (mut gg, mut gb) = (upload(&pair.gpu, &g_raw), upload(&pair.gpu, &beta_raw));
                    let (mut out, mut ssm) = (poisoned(&pair.gpu, n * nv * head_dim), upload(&pair.gpu, &ssm_state));
                    let state = StateSlots { state: view_mut(&mut ssm, ssm_states), slots: view(&gslots, slot_shape) };
                    let (x, params, out_view) = (view(&gconv, rows), [view(&ga, [nv]), view(&gd, [nv])], view_mut(&mut out, outs));
                    if from_projections {
                        let projections = [view_mut(&mut gg, heads), view_mut(&mut gb, heads)];
                        pair.gpu.delta_net_from_projections(x, projections, params, state, out_view, &pair.gpu_step, &p).expect("gpu");
                    } else {
                        let [a, d] = params;
                        pair.gpu.delta_net_gates(view_mut(&mut gg, heads), view_mut(&mut gb, heads), a, d).expect("gpu gates");
                        pair.gpu.delta_net(x, [view(&gg, heads), view(&gb, heads)], state, out_view, &pair.gpu_step, &p).expect("gpu");
                    }
                    (download(&pair.gpu, &out, n * nv * head_dim), download(&pair.gpu, &ssm, ssm_state.len()))
                };
                let ((fused_out, fused_ssm), (steps_out, steps_ssm)) = (run(true), run(false));
                assert_bitwise(&format!("{what}: from projections, outputs"), &fused_out, &steps_out);
                assert_bitwise(&format!("{what}: from projections, states"), &fused_ssm, &steps_ssm);
                let (mut cpu_g, mut cpu_beta, mut cpu_out, mut cpu_ssm) = (g_raw.clone(), beta_raw.clone(), vec![0f32; n * nv * head_dim], ssm_state.clone());
                let state = StateSlots { state: view_mut(&mut cpu_ssm, ssm_states), slots: view(&slots, slot_shape) };
                let projections = [view_mut(&mut cpu_g, heads), view_mut(&mut cpu_beta, heads)];
                let params = [view(&a_log_neg, [nv]), view(&dt_bias, [nv])];
                pair.cpu
                    .delta_net_from_projections(view(&want_conv, rows), projections, params, state, view_mut(&mut cpu_out, outs), &pair.cpu_step, &p)
                    .expect("cpu");
                // The gates' transcendental functions on both sides, then the rule as above.
                assert_close(&format!("{what}: from projections, outputs against the CPU"), &fused_out, &cpu_out, 1e-5);
                assert_close(&format!("{what}: from projections, states against the CPU"), &fused_ssm, &cpu_ssm, 1e-5);
                results.push((what, got_out, got_ssm));
            }
        }
        by_form.push(results);
    }
    for ((what, chunked_out, chunked_ssm), (_, out, ssm)) in by_form[1].iter().zip(&by_form[0]) {
        assert_close(&format!("{what} against the recurrence: outputs"), chunked_out, out, 1e-5);
        assert_close(&format!("{what} against the recurrence: states"), chunked_ssm, ssm, 1e-5);
    }
}

/// Prints the delta rule's time per layer in each form on Qwen3.5-35B-A3B's heads (16 key and
/// 32 value heads of 128), for spans of several lengths: where the chunked form starts to pay;
/// and the convolution's.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn delta_net_forms_timing() {
    let p = DeltaNetParams { n_k_heads: 16, n_v_heads: 32, head_dim: 128, conv_kernel: 4 };
    let mut rng = rng("arch_delta_net_timing");
    let spans = [2, 4, 8, 16, 24, 32, 64, 128, 512];
    println!("delta rule on 16/32 heads of 128, one sequence: microseconds a layer");
    println!("{:>6} {:>12} {:>12} {:>12}", "tokens", "recurrence", "chunked", "convolution");
    let (mut micros, mut conv_micros) = (Vec::new(), Vec::new());
    for form in [DeltaNetSpans::Recurrence, DeltaNetSpans::Chunked] {
        let mut pair = Pair::with_config(exclusive_gpu(), RegistryConfig { delta_net_spans: form, ..Default::default() }, 512, 0);
        for n in spans {
            let (tokens, blocks) = (vec![0u32; n], contiguous(n));
            pair.set_plan(&[SeqStep { tokens: &tokens, pos0: 0, blocks: &blocks, logits: LogitRows::None, sample: None }]);
            let x = upload(&pair.gpu, &random(&mut rng, n * p.conv_dim(), 1.0));
            let g = upload(&pair.gpu, &random(&mut rng, n * p.n_v_heads, 1.0).iter().map(|v| -0.6 * (v + 1.0)).collect::<Vec<_>>());
            let beta = upload(&pair.gpu, &random(&mut rng, n * p.n_v_heads, 1.0).iter().map(|v| 0.5 * (v + 1.0)).collect::<Vec<_>>());
            let (mut state, slots) = (upload(&pair.gpu, &vec![0f32; p.ssm_state()]), upload(&pair.gpu, &[0.0]));
            let mut out = poisoned(&pair.gpu, n * p.n_v_heads * p.head_dim);
            let mut run = || {
                let state = StateSlots { state: view_mut(&mut state, [1, p.ssm_state()]), slots: view(&slots, [1]) };
                let gates = [view(&g, [n, p.n_v_heads]), view(&beta, [n, p.n_v_heads])];
                let outs = view_mut(&mut out, [n, p.n_v_heads * p.head_dim]);
                pair.gpu.delta_net(view(&x, [n, p.conv_dim()]), gates, state, outs, &pair.gpu_step, &p).expect("gpu");
            };
            run();
            pair.gpu.synchronize().expect("sync");
            let rounds = 20;
            let start = std::time::Instant::now();
            for _ in 0..rounds {
                run();
            }
            pair.gpu.synchronize().expect("sync");
            micros.push(start.elapsed().as_secs_f64() * 1e6 / rounds as f64);
            if form == DeltaNetSpans::Recurrence {
                // The convolution before it, over the same span.
                let weight = upload(&pair.gpu, &random(&mut rng, p.conv_dim() * p.conv_kernel, 0.5));
                let (mut conv_state, mut conv_out) = (upload(&pair.gpu, &vec![0f32; p.conv_state()]), poisoned(&pair.gpu, n * p.conv_dim()));
                let mut conv = || {
                    let state = StateSlots { state: view_mut(&mut conv_state, [1, p.conv_state()]), slots: view(&slots, [1]) };
                    let rows = [n, p.conv_dim()];
                    pair.gpu
                        .ssm_conv(view(&x, rows), view(&weight, [p.conv_dim(), p.conv_kernel]), state, view_mut(&mut conv_out, rows), &pair.gpu_step, &p)
                        .expect("gpu");
                };
                conv();
                pair.gpu.synchronize().expect("sync");
                let start = std::time::Instant::now();
                for _ in 0..rounds {
                    conv();
                }
                pair.gpu.synchronize().expect("sync");
                conv_micros.push(start.elapsed().as_secs_f64() * 1e6 / rounds as f64);
            }
        }
    }
    for (i, n) in spans.iter().enumerate() {
        println!("{n:>6} {:>12.1} {:>12.1} {:>12.1}", micros[i], micros[spans.len() + i], conv_micros[i]);
    }
}
