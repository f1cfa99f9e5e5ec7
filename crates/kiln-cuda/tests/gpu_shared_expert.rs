//! A mixture of experts' shared expert (Qwen3.5) on the CUDA backend against the CPU reference
//! backend on fresh random inputs, every GPU output poisoned with NaN before the launch: its gate
//! beside the router, its FFN on the routed experts' normed input. Needs an NVIDIA GPU: run
//! scripts/gpu-tests.sh on the device.

mod common;
use common::rng;

use kiln_core::backend::{Activation, Backend, GatedFfn, RouterArgs, RouterParams};
use kiln_quant::GgmlType;

#[path = "common/backends.rs"]
mod backends;
use backends::*;

/// A renormalizing router of `weight` on backend `_b` with no norm, bias, scales or shared expert.
fn plain_router<'a, B: Backend>(_b: &B, weight: &'a B::Weight) -> RouterArgs<'a, B> {
    RouterArgs { weight, norm: None, bias: None, expert_scale: None, params: RouterParams { renormalize: true, shared_expert: false }, shared_gate: None }
}

/// A shared expert's gate logit computed beside the router's logits (Qwen3.5: one stacked float
/// launch for one token), against the CPU: one token of Qwen3.5-35B-A3B's router (256 experts
/// of 2,048), three tokens (two products), and a router with a bias (gpt-oss-like: the fused
/// norm-router launch, the gate after it). Float products of the same values in another order:
/// 1e-5 relative L2.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn shared_gate_is_computed_beside_the_router() {
    let mut rng = rng("arch_shared_gate");
    let pair = Pair::new(1, 0);
    let (cpu, gpu, eps) = (&pair.cpu, &pair.gpu, 1e-6);
    for (n, n_experts, cols, n_used, with_bias) in [(1, 256, 2048, 8, false), (3, 8, 96, 2, false), (1, 32, 2880, 4, true)] {
        let what = format!("{n} tokens, {n_experts} experts of {cols}, bias {with_bias}");
        let (x, norm, bias) = (random(&mut rng, n * cols, 2.0), random(&mut rng, cols, 1.5), random(&mut rng, n_experts, 1.0));
        let router_source = weight_source("router", GgmlType::F32, n_experts, cols, &random(&mut rng, n_experts * cols, 0.2));
        let gate_source = weight_source("shared gate", GgmlType::F32, 1, cols, &random(&mut rng, cols, 0.2));
        let (rows, logit_rows, chosen, gate_rows) = ([n, cols], [n, n_experts], [n, n_used], [n, 1]);
        let (cr, cg) = (cpu.upload_weight(router_source.clone()).expect("cpu"), cpu.upload_weight(gate_source.clone()).expect("cpu"));
        let (mut h, mut logits, mut ids, mut w, mut gate) =
            (vec![0f32; n * cols], vec![0f32; n * n_experts], vec![0f32; n * n_used], vec![0f32; n * n_used], vec![0f32; n]);
        let router = RouterArgs {
            weight: &cr,
            norm: None,
            bias: with_bias.then(|| view(&bias, [n_experts])),
            expert_scale: None,
            params: RouterParams { renormalize: true, shared_expert: false },
            shared_gate: Some((&cg, view_mut(&mut gate, gate_rows))),
        };
        let routes = [view_mut(&mut ids, chosen), view_mut(&mut w, chosen)];
        cpu.moe_norm_route(view(&x, rows), (view(&norm, [cols]), eps), router, view_mut(&mut h, rows), view_mut(&mut logits, logit_rows), routes).expect("cpu");

        let (gr, gg) = (gpu.upload_weight(router_source).expect("gpu"), gpu.upload_weight(gate_source).expect("gpu"));
        let (gx, gnorm, gbias) = (upload(gpu, &x), upload(gpu, &norm), upload(gpu, &bias));
        let (mut gh, mut glogits, mut gids, mut gw, mut ggate) =
            (poisoned(gpu, n * cols), poisoned(gpu, n * n_experts), poisoned(gpu, n * n_used), poisoned(gpu, n * n_used), poisoned(gpu, n));
        let router = RouterArgs {
            weight: &gr,
            norm: None,
            bias: with_bias.then(|| view(&gbias, [n_experts])),
            expert_scale: None,
            params: RouterParams { renormalize: true, shared_expert: false },
            shared_gate: Some((&gg, view_mut(&mut ggate, gate_rows))),
        };
        let routes = [view_mut(&mut gids, chosen), view_mut(&mut gw, chosen)];
        gpu.moe_norm_route(view(&gx, rows), (view(&gnorm, [cols]), eps), router, view_mut(&mut gh, rows), view_mut(&mut glogits, logit_rows), routes)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_close(&format!("{what}: shared gate"), &download(gpu, &ggate, n), &gate, 1e-5);
        assert_close(&format!("{what}: logits"), &download(gpu, &glogits, n * n_experts), &logits, 1e-5);
        assert_bitwise(&format!("{what}: ids"), &download(gpu, &gids, n * n_used), &ids);
    }
}

/// A shared expert's FFN on the routed experts' normed input (`Backend::gated_ffn` after
/// `moe_norm_route`; CUDA: its gate/up read the int8 input the experts' norm wrote, where it
/// is still there), against the same FFN of a copy of that input (quantized by a launch of its
/// own: the same codes of the same f32 values, unless the stored and the copied rows round a
/// tie apart, so 1e-4 relative L2) and the CPU (two products of int8 activations: 2e-2).
/// Qwen3.5-35B-A3B's shape for one token, three tokens of an FFN wider than its input, and
/// twelve tokens (past the mat-vec: the f32 products).
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn shared_expert_reads_the_experts_normed_input() {
    let mut rng = rng("shared_expert_ffn");
    let pair = Pair::new(1, 0);
    let (cpu, gpu, eps) = (&pair.cpu, &pair.gpu, 1e-6);
    for (n, cols, n_ff, ty) in [(1, 2048, 512, GgmlType::Q4_K), (3, 256, 768, GgmlType::Q8_0), (12, 512, 512, GgmlType::Q4_K)] {
        let (n_experts, n_used) = (16, 4);
        let what = format!("{n} tokens of {cols}, {ty} shared expert of {n_ff}");
        let (x, norm) = (random(&mut rng, n * cols, 2.0), random(&mut rng, cols, 1.5));
        let router_source = weight_source("router", GgmlType::F32, n_experts, cols, &random(&mut rng, n_experts * cols, 0.2));
        let ffn_sources = [("gate", n_ff, cols), ("up", n_ff, cols), ("down", cols, n_ff)]
            .map(|(name, rows, cols)| weight_source(name, ty, rows, cols, &random(&mut rng, rows * cols, 0.5)));
        let (rows, logit_rows, chosen, act_rows) = ([n, cols], [n, n_experts], [n, n_used], [n, n_ff]);

        let (cr, cw) = (cpu.upload_weight(router_source.clone()).expect("cpu"), ffn_sources.clone().map(|s| cpu.upload_weight(s).expect("cpu")));
        let (mut h, mut logits, mut ids, mut w) = (vec![0f32; n * cols], vec![0f32; n * n_experts], vec![0f32; n * n_used], vec![0f32; n * n_used]);
        let router = plain_router(cpu, &cr);
        let routes = [view_mut(&mut ids, chosen), view_mut(&mut w, chosen)];
        cpu.moe_norm_route(view(&x, rows), (view(&norm, [cols]), eps), router, view_mut(&mut h, rows), view_mut(&mut logits, logit_rows), routes).expect("cpu");
        let (mut gate, mut up, mut act, mut want) = (vec![0f32; n * n_ff], vec![0f32; n * n_ff], vec![0f32; n * n_ff], vec![0f32; n * cols]);
        let ffn = GatedFfn { gate: &cw[0], up: &cw[1], down: &cw[2], act: Activation::Silu };
        let scratch = [view_mut(&mut gate, act_rows), view_mut(&mut up, act_rows)];
        cpu.gated_ffn(view(&h, rows), ffn, scratch, view_mut(&mut act, act_rows), view_mut(&mut want, rows)).expect("cpu");

        let (gr, gw) = (gpu.upload_weight(router_source).expect("gpu"), ffn_sources.map(|s| gpu.upload_weight(s).expect("gpu")));
        let (gx, gnorm) = (upload(gpu, &x), upload(gpu, &norm));
        let (mut gh, mut glogits, mut gids, mut gweights) =
            (poisoned(gpu, n * cols), poisoned(gpu, n * n_experts), poisoned(gpu, n * n_used), poisoned(gpu, n * n_used));
        let router = plain_router(gpu, &gr);
        let routes = [view_mut(&mut gids, chosen), view_mut(&mut gweights, chosen)];
        gpu.moe_norm_route(view(&gx, rows), (view(&gnorm, [cols]), eps), router, view_mut(&mut gh, rows), view_mut(&mut glogits, logit_rows), routes)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let copied = upload(gpu, &download(gpu, &gh, n * cols));
        let run = |input: &_| {
            let (mut gate, mut up, mut act, mut out) = (poisoned(gpu, n * n_ff), poisoned(gpu, n * n_ff), poisoned(gpu, n * n_ff), poisoned(gpu, n * cols));
            let ffn = GatedFfn { gate: &gw[0], up: &gw[1], down: &gw[2], act: Activation::Silu };
            let scratch = [view_mut(&mut gate, act_rows), view_mut(&mut up, act_rows)];
            gpu.gated_ffn(view(input, rows), ffn, scratch, view_mut(&mut act, act_rows), view_mut(&mut out, rows)).unwrap_or_else(|e| panic!("{what}: {e}"));
            download(gpu, &out, n * cols)
        };
        let (got, separate) = (run(&gh), run(&copied));
        assert_close(&format!("{what}: normed input"), &download(gpu, &gh, n * cols), &h, 1e-5);
        assert_close(&format!("{what}: against the copied input"), &got, &separate, 1e-4);
        assert_close(&format!("{what}: against the CPU"), &got, &want, 2e-2);
    }
}
