//! A Gated DeltaNet's input projections and causal convolution (Qwen3.5) on the CUDA backend
//! against the same ops launched one by one and against the CPU reference backend, on fresh
//! random inputs, every GPU output poisoned with NaN before the launch. Needs an NVIDIA GPU:
//! run scripts/gpu-tests.sh on the device.

mod common;
use common::rng;

use cudarc::driver::CudaSlice;
use kiln_core::backend::{Backend, Convolution, DeltaNetParams, Linear, StateSlots};
use kiln_quant::GgmlType;

#[path = "common/backends.rs"]
mod backends;
use backends::*;

/// Slots of the convolution state; the step's sequence uses `SLOT`.
const N_SLOTS: usize = 3;
const SLOT: f32 = 2.0;
const EPS: f32 = 1e-6;

/// One token's input: the residual row, the norm weight and the convolution's taps.
struct Input {
    x: Vec<f32>,
    norm: Vec<f32>,
    taps: Vec<f32>,
}

/// What one token's projections leave: q/k/v, z, alpha and beta, the convolved q/k/v.
struct Outputs {
    products: Vec<Vec<f32>>,
    convolved: Vec<f32>,
}

/// The CPU's projections and convolution of one token, continuing from `state`.
fn on_cpu<W>(pair: &Pair, w: &[W; 4], rows: [usize; 4], input: &Input, state: &mut Vec<f32>, p: &DeltaNetParams) -> Outputs
where
    kiln_core::CpuBackend: Backend<Weight = W, Buffer = Vec<f32>>,
{
    let (cols, c) = (input.x.len(), p.conv_dim());
    let (mut h, mut products, mut convolved, slots) = (vec![0f32; cols], rows.map(|r| vec![0f32; r]), vec![0f32; c], vec![SLOT]);
    let [a, b, g, beta] = &mut products;
    let out = [view_mut(a, [1, rows[0]]), view_mut(b, [1, rows[1]]), view_mut(g, [1, rows[2]]), view_mut(beta, [1, rows[3]])];
    let conv = Convolution {
        weight: view(&input.taps, [c, p.conv_kernel]),
        state: StateSlots { state: view_mut(state, [N_SLOTS, p.conv_state()]), slots: view(&slots, [1]) },
        out: view_mut(&mut convolved, [1, c]),
        step: &pair.cpu_step,
        params: p,
    };
    let linears = [0, 1, 2, 3].map(|i| Linear::plain(&w[i]));
    let (x, norm) = (view(&input.x, [1, cols]), (view(&input.norm, [cols]), EPS));
    pair.cpu.delta_net_projections(x, norm, view_mut(&mut h, [1, cols]), linears, out, conv).expect("cpu");
    Outputs { products: products.to_vec(), convolved }
}

/// The GPU's: `delta_net_projections` (`fused`), else `norm_matmuls` then `ssm_conv`.
#[allow(clippy::too_many_arguments)]
fn on_gpu(
    pair: &Pair,
    w: &[kiln_cuda::matvec::GpuWeight; 4],
    rows: [usize; 4],
    input: &Input,
    state: &mut CudaSlice<f32>,
    slot: f32,
    p: &DeltaNetParams,
    fused: bool,
) -> Outputs {
    let (gpu, cols, c) = (&pair.gpu, input.x.len(), p.conv_dim());
    let (x, norm, taps, slots) = (upload(gpu, &input.x), upload(gpu, &input.norm), upload(gpu, &input.taps), upload(gpu, &[slot]));
    let (mut h, mut products, mut convolved) = (poisoned(gpu, cols), rows.map(|r| poisoned(gpu, r)), poisoned(gpu, c));
    let [a, b, g, beta] = &mut products;
    let mut out = [view_mut(a, [1, rows[0]]), view_mut(b, [1, rows[1]]), view_mut(g, [1, rows[2]]), view_mut(beta, [1, rows[3]])];
    let linears = [0, 1, 2, 3].map(|i| Linear::plain(&w[i]));
    let (xv, normv) = (view(&x, [1, cols]), (view(&norm, [cols]), EPS));
    let state = StateSlots { state: view_mut(state, [N_SLOTS, p.conv_state()]), slots: view(&slots, [1]) };
    let (weight, conv_out) = (view(&taps, [c, p.conv_kernel]), view_mut(&mut convolved, [1, c]));
    if fused {
        let conv = Convolution { weight, state, out: conv_out, step: &pair.gpu_step, params: p };
        gpu.delta_net_projections(xv, normv, view_mut(&mut h, [1, cols]), linears, out, conv).expect("gpu");
    } else {
        let views = out.each_mut().map(|o| o.reborrow());
        gpu.norm_matmuls(xv, normv, view_mut(&mut h, [1, cols]), linears, views, None).expect("gpu products");
        gpu.ssm_conv(out[0].as_ref(), weight, state, conv_out, &pair.gpu_step, p).expect("gpu convolution");
    }
    Outputs { products: products.iter().zip(rows).map(|(o, r)| download(gpu, o, r)).collect(), convolved: download(gpu, &convolved, c) }
}

/// Decode tokens of one sequence (positions 0, 1, 2, then 40: a fresh sequence ignores its
/// slot's random state, a continuing one shifts it) through `Backend::delta_net_projections`.
/// CUDA convolves the q/k/v channels in their product's epilogue where q/k/v stacks with z on
/// the int8 input. Against the products then the convolution launched one by one on the GPU:
/// the same products bit for bit, the same convolution (the same steps of kernels/conv.cuh:
/// 1e-6, an ulp or two of expf), the same state bit for bit; against the CPU (products of int8
/// activations): 2e-2. Qwen3.5-35B-A3B's shape (all Q4_K), an awkward width of Q8_0 (33 blocks), and
/// float gates (the composed path). A slot the state does
/// not hold gives NaN and leaves the state as it was.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn delta_net_projections_convolve_in_their_product() {
    let mut rng = rng("delta_net_projections");
    let mut pair = Pair::new(1, 0);
    let cases =
        [(2048, 16, 32, 128, GgmlType::Q4_K, GgmlType::Q4_K), (1056, 2, 6, 32, GgmlType::Q8_0, GgmlType::Q8_0), (768, 1, 3, 64, GgmlType::Q5_K, GgmlType::F32)];
    for (cols, n_k_heads, n_v_heads, head_dim, ty, gate_ty) in cases {
        let p = DeltaNetParams { n_k_heads, n_v_heads, head_dim, conv_kernel: 4 };
        let c = p.conv_dim();
        let rows = [c, n_v_heads * head_dim, n_v_heads, n_v_heads];
        let types = [ty, ty, gate_ty, gate_ty];
        let names = ["qkv", "z", "alpha", "beta"];
        let sources: Vec<_> = (0..4).map(|i| weight_source(names[i], types[i], rows[i], cols, &random(&mut rng, rows[i] * cols, 0.5))).collect();
        let cw: [_; 4] = std::array::from_fn(|i| pair.cpu.upload_weight(sources[i].clone()).expect("cpu"));
        let gw: [_; 4] = std::array::from_fn(|i| pair.gpu.upload_weight(sources[i].clone()).expect("gpu"));
        let initial = random(&mut rng, N_SLOTS * p.conv_state(), 1.0);
        let (mut cpu_state, mut fused_state, mut separate_state) = (initial.clone(), upload(&pair.gpu, &initial), upload(&pair.gpu, &initial));
        let taps = random(&mut rng, c * p.conv_kernel, 0.5);
        for pos in [0, 1, 2, 40] {
            let what = format!("{n_k_heads}/{n_v_heads} heads of {head_dim} from {cols}, {ty} with {gate_ty} gates, position {pos}");
            pair.set_positions(1, pos);
            let input = Input { x: random(&mut rng, cols, 2.0), norm: random(&mut rng, cols, 1.5), taps: taps.clone() };
            let want = on_cpu(&pair, &cw, rows, &input, &mut cpu_state, &p);
            let fused = on_gpu(&pair, &gw, rows, &input, &mut fused_state, SLOT, &p, true);
            let separate = on_gpu(&pair, &gw, rows, &input, &mut separate_state, SLOT, &p, false);
            for (i, name) in names.iter().enumerate() {
                assert_bitwise(&format!("{what}: {name} against the separate launches"), &fused.products[i], &separate.products[i]);
                assert_close(&format!("{what}: {name} against the CPU"), &fused.products[i], &want.products[i], 2e-2);
            }
            assert_close(&format!("{what}: convolved against the separate launches"), &fused.convolved, &separate.convolved, 1e-6);
            assert_close(&format!("{what}: convolved against the CPU"), &fused.convolved, &want.convolved, 2e-2);
            let (fused_now, separate_now) = (download(&pair.gpu, &fused_state, initial.len()), download(&pair.gpu, &separate_state, initial.len()));
            assert_bitwise(&format!("{what}: state against the separate launches"), &fused_now, &separate_now);
            assert_close(&format!("{what}: state against the CPU"), &fused_now, &cpu_state, 2e-2);
            let other_slots = ..2 * p.conv_state();
            assert_bitwise(&format!("{what}: the other slots"), &fused_now[other_slots], &initial[other_slots]);
        }
        let input = Input { x: random(&mut rng, cols, 2.0), norm: random(&mut rng, cols, 1.5), taps };
        let before = download(&pair.gpu, &fused_state, initial.len());
        let bad = on_gpu(&pair, &gw, rows, &input, &mut fused_state, N_SLOTS as f32, &p, true);
        assert!(bad.convolved.iter().all(|v| v.is_nan()), "{cols}: a slot past the state's gives NaN");
        assert_bitwise(&format!("{cols}: state after a bad slot"), &download(&pair.gpu, &fused_state, initial.len()), &before);
    }
}
