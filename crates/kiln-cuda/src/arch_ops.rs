//! The CUDA backend's ops of the newer architectures (kernels/arch_ops.cu, delta_net.cu): the
//! elementwise activations and gates of Gemma, gpt-oss and Qwen3.5, the expert router and the
//! combination of expert outputs, and the Gated DeltaNet's convolution and delta rule. Each
//! computes what the CPU backend's op of the same name does; the argument checks are the same.

// `usize::is_multiple_of` needs Rust 1.87; the workspace supports 1.85.
#![allow(clippy::manual_is_multiple_of)]

use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use kiln_core::backend::{
    compose_gated_norm_matmul_add, compose_moe_gate_up, compose_moe_norm_route, BackendError, DeltaNetParams, ExpertInput, GatedExperts, GatedNorm, Result,
    RouterArgs, RouterParams, StateSlots,
};
use kiln_core::shapes;
use kiln_core::tensor::expect_shape;

use crate::backend::{backend_error, check_len, launch_error, to_u32, View, ViewMut, BLOCK};
use crate::matvec::{self, ExpertCall, GatedCall, GpuWeight, NormRouteCall, RouteOutputs};
use crate::shared_products::{lock_input, takes_quantized_matvec};
use crate::{CudaBackend, CudaStep};

/// `arch_ops.cu`'s CONV_MAX_KERNEL, ROUTE_MAX_USED and 32 * ROUTE_REGS; `delta_net.cu`'s largest head.
const CONV_MAX_KERNEL: usize = 8;
const ROUTE_MAX_USED: usize = 64;
const ROUTE_REGISTER_EXPERTS: usize = 256;
const DELTA_NET_MAX_HEAD_DIM: usize = 128;

/// Which form of the delta rule runs a Gated DeltaNet layer's spans (delta_net.cu): token by
/// token (`delta_net_f32`), or in chunks of 32 tokens (`delta_net_chunked_f32`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeltaNetSpans {
    /// Chunked from [`DELTA_NET_CHUNKED_FROM`] tokens, where it is measured faster.
    #[default]
    Fastest,
    /// Every span token by token (the reference the chunked form is tested against).
    Recurrence,
    /// Every span of two or more tokens chunked.
    Chunked,
}

/// The shortest span the chunked form takes by default: `gpu_arch_ops`'s `delta_net_forms_timing`
/// on Qwen3.5-35B-A3B's heads measured 29.6 against 30.3 µs at 16 tokens, 42.6 against 30.4 at 24.
pub const DELTA_NET_CHUNKED_FROM: usize = 24;

impl DeltaNetSpans {
    pub(crate) fn chunked_from(self) -> u32 {
        match self {
            DeltaNetSpans::Fastest => DELTA_NET_CHUNKED_FROM as u32,
            DeltaNetSpans::Recurrence => u32::MAX,
            DeltaNetSpans::Chunked => 2,
        }
    }
}

/// `delta_net.cu`'s DN_CHUNK, DN_COLS, DN_THREADS and DN_GROUPS, and the size of its
/// `DeltaNetChunk` for heads of `d` values (the kernel checks it was given at least this much).
const DELTA_NET_CHUNK: usize = 32;
const DELTA_NET_COLS: usize = 32;
const DELTA_NET_THREADS: usize = 256;
const DELTA_NET_GROUPS: usize = 32 / (DELTA_NET_COLS / (DELTA_NET_THREADS / 32));
fn delta_net_chunk_shared_bytes(d: usize) -> usize {
    let (c, groups) = (DELTA_NET_CHUNK, DELTA_NET_GROUPS);
    let kq_row = groups * (d / groups + 4) + 4;
    8 * c + 4 * (2 * c * kq_row + 2 * c * (c + 1) + 3 * c * DELTA_NET_COLS + 3 * c)
}

/// Lets `function` take `bytes` of dynamic shared memory where that is past the 48 KiB a launch
/// may take without asking.
fn allow_dynamic_shared(function: &CudaFunction, bytes: usize, kernel: &str) -> Result<()> {
    if bytes <= 48 << 10 {
        return Ok(());
    }
    function
        .set_attribute(cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
        .map(drop)
        .map_err(|e| BackendError::Device(format!("raising {kernel}'s shared memory limit: {e:?}")))
}

impl CudaBackend {
    fn arch_kernel(&self, name: &str) -> Result<CudaFunction> {
        self.device().registry().function("arch_ops", name, &[]).map_err(backend_error)
    }

    /// `out = act(gate, up)` elementwise, for the two-input activations of arch_ops.cu.
    pub(crate) fn gated_pointwise(&self, kernel: &'static str, gate: View, up: View, mut out: ViewMut, params: &[f32]) -> Result<()> {
        let len = shapes::elementwise(kernel, &[("gate", gate.shape()), ("up", up.shape())], out.shape())?;
        if len == 0 {
            return Ok(());
        }
        let function = self.arch_kernel(kernel)?;
        let total = len as u64;
        let mut launch = self.device().stream().launch_builder(&function);
        launch.arg(out.buf_mut()).arg(gate.buf()).arg(up.buf());
        for p in params {
            launch.arg(p);
        }
        launch.arg(&total);
        // SAFETY: geglu_f32(out, gate, up, n) / swiglu_oai_f32(out, gate, up, alpha, limit, n);
        // every view holds `len` values (checked above).
        unsafe { launch.launch(self.grid_stride(len)) }.map(drop).map_err(launch_error(kernel))
    }

    pub(crate) fn launch_scale(&self, mut x: ViewMut, s: f32) -> Result<()> {
        let len = x.numel();
        if len == 0 {
            return Ok(());
        }
        let function = self.device().registry().function("elementwise", "scale_f32", &[]).map_err(backend_error)?;
        let total = len as u64;
        let (ptr, _record) = x.buf_mut().device_ptr(self.device().stream());
        // SAFETY: scale_f32(out, x, factor, n) is elementwise, so out may alias x; x holds len values.
        unsafe { self.device().stream().launch_builder(&function).arg(&ptr).arg(&ptr).arg(&s).arg(&total).launch(self.grid_stride(len)) }
            .map(drop)
            .map_err(launch_error("scale_f32"))
    }

    /// [`Backend::rms_norm_sum`] in one launch, `a` only read.
    pub(crate) fn launch_rms_norm_sum(&self, a: View, b: View, weights: [View; 2], eps: f32, mut out: ViewMut) -> Result<()> {
        let (rows, dim) = shapes::rms_norm(a.shape(), weights[0].shape(), out.shape())?;
        shapes::rms_norm(b.shape(), weights[1].shape(), out.shape())?;
        if rows == 0 || dim == 0 {
            return Ok(());
        }
        let dim32 = to_u32("dim", dim)?;
        let cfg = LaunchConfig { grid_dim: (to_u32("rows", rows)?, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        let function = self.device().registry().function("norm", "rms_norm_sum_f32", &[]).map_err(backend_error)?;
        // SAFETY: matches norm.cu's rms_norm_sum_f32 (NORM_BLOCK = BLOCK threads); a, b and out
        // hold rows * dim values, the weights dim (the shapes above); out is borrowed mutably,
        // so it is neither row.
        unsafe {
            let mut launch = self.device().stream().launch_builder(&function);
            launch.arg(out.buf_mut()).arg(a.buf()).arg(weights[0].buf()).arg(b.buf()).arg(weights[1].buf()).arg(&dim32).arg(&eps);
            launch.launch(cfg)
        }
        .map(drop)
        .map_err(launch_error("rms_norm_sum"))
    }

    /// [`Backend::normed_router_logits`]: for one token of an f32 router, one launch that
    /// norms x as it loads it (`h` untouched); else the norm, then the product.
    pub(crate) fn launch_normed_router_logits(&self, x: View, norm: (View, f32), mut h: ViewMut, router: &GpuWeight, mut logits: ViewMut) -> Result<()> {
        let (n, _) = shapes::rms_norm(x.shape(), norm.0.shape(), h.shape())?;
        shapes::matmul("normed_router_logits", (router.rows, router.cols), x.shape(), logits.shape())?;
        let input_norm = Some((norm.0.buf(), norm.1));
        if matvec::matmul_stacked_float(self.device(), &[router], x.buf(), &mut [logits.buf_mut()], n, input_norm).map_err(backend_error)? {
            return Ok(());
        }
        kiln_core::Backend::rms_norm(self, x, norm.0, h.reborrow(), norm.1)?;
        kiln_core::Backend::router_logits(self, h.as_ref(), router, logits, None)
    }

    pub(crate) fn launch_softcap(&self, mut x: ViewMut, cap: f32) -> Result<()> {
        let len = x.numel();
        if !(cap > 0.0 && cap.is_finite()) {
            return Err(BackendError::Device(format!("softcap: cap {cap} is not positive")));
        }
        if len == 0 {
            return Ok(());
        }
        let function = self.arch_kernel("softcap_f32")?;
        let total = len as u64;
        // SAFETY: softcap_f32(x, cap, n); x holds len values.
        unsafe { self.device().stream().launch_builder(&function).arg(x.buf_mut()).arg(&cap).arg(&total).launch(self.grid_stride(len)) }
            .map(drop)
            .map_err(launch_error("softcap_f32"))
    }

    pub(crate) fn launch_copy_cols(&self, src: View, col: usize, mut dst: ViewMut) -> Result<()> {
        let (n, src_width, width) = shapes::copy_cols(src.shape(), col, dst.shape())?;
        if n * width == 0 {
            return Ok(());
        }
        let function = self.arch_kernel("copy_cols_f32")?;
        let (sw, c, w, total) = (to_u32("source width", src_width)?, to_u32("column", col)?, to_u32("width", width)?, (n * width) as u64);
        // SAFETY: copy_cols_f32(dst, src, src_width, col, width, n); bounds checked above.
        unsafe {
            self.device()
                .stream()
                .launch_builder(&function)
                .arg(dst.buf_mut())
                .arg(src.buf())
                .arg(&sw)
                .arg(&c)
                .arg(&w)
                .arg(&total)
                .launch(self.grid_stride(n * width))
        }
        .map(drop)
        .map_err(launch_error("copy_cols_f32"))
    }

    pub(crate) fn launch_sigmoid_gate(&self, mut x: ViewMut, gate: View) -> Result<()> {
        let (n, dim, gate_dim) = shapes::sigmoid_gate(x.shape(), gate.shape())?;
        if n * dim == 0 {
            return Ok(());
        }
        let function = self.arch_kernel("sigmoid_gate_f32")?;
        let (per, total) = (to_u32("values per gate", dim / gate_dim)?, (n * dim) as u64);
        // SAFETY: sigmoid_gate_f32(x, gate, per, n); x holds n * dim values and gate n * dim / per.
        unsafe { self.device().stream().launch_builder(&function).arg(x.buf_mut()).arg(gate.buf()).arg(&per).arg(&total).launch(self.grid_stride(n * dim)) }
            .map(drop)
            .map_err(launch_error("sigmoid_gate_f32"))
    }

    pub(crate) fn launch_delta_net_gates(&self, mut g: ViewMut, mut beta: ViewMut, a_log_neg: View, dt_bias: View) -> Result<()> {
        let (n, n_heads) = shapes::delta_net_gates(g.shape(), beta.shape(), a_log_neg.shape(), dt_bias.shape())?;
        if n * n_heads == 0 {
            return Ok(());
        }
        let function = self.arch_kernel("delta_net_gates_f32")?;
        let (heads, total) = (to_u32("heads", n_heads)?, (n * n_heads) as u64);
        // SAFETY: delta_net_gates_f32(g, beta, a_log_neg, dt_bias, n_heads, n); lengths checked.
        unsafe {
            self.device()
                .stream()
                .launch_builder(&function)
                .arg(g.buf_mut())
                .arg(beta.buf_mut())
                .arg(a_log_neg.buf())
                .arg(dt_bias.buf())
                .arg(&heads)
                .arg(&total)
                .launch(self.grid_stride(n * n_heads))
        }
        .map(drop)
        .map_err(launch_error("delta_net_gates_f32"))
    }

    pub(crate) fn launch_moe_route(&self, logits: View, expert_scale: Option<View>, mut ids: ViewMut, mut weights: ViewMut, p: &RouterParams) -> Result<()> {
        let (n, e, k) = shapes::moe_route(logits.shape(), expert_scale.map(|s| s.shape()), ids.shape(), weights.shape(), p.shared_expert)?;
        if k > ROUTE_MAX_USED {
            return Err(BackendError::Unsupported { backend: "CUDA".into(), what: format!("routing to {k} experts per token (at most {ROUTE_MAX_USED})") });
        }
        if n == 0 {
            return Ok(());
        }
        let function = self.arch_kernel("moe_route_f32")?;
        let shared = if e > ROUTE_REGISTER_EXPERTS { e * 4 } else { 0 };
        if shared > self.device().info().max_shared_memory_per_block_optin {
            return Err(BackendError::Unsupported { backend: "CUDA".into(), what: format!("a router over {e} experts") });
        }
        allow_dynamic_shared(&function, shared, "moe_route_f32")?;
        let (e32, k32, renorm, shared_expert) = (to_u32("experts", e)?, to_u32("experts used", k)?, u32::from(p.renormalize), u32::from(p.shared_expert));
        let no_scale: u64 = 0;
        let (scale_ptr, _record) = expert_scale.map_or((no_scale, None), |s| {
            let (ptr, record) = s.buf().device_ptr(self.device().stream());
            (ptr, Some(record))
        });
        let cfg = LaunchConfig { grid_dim: (to_u32("tokens", n)?, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: shared as u32 };
        // SAFETY: moe_route_f32(logits, expert_scale or null, ids, weights, n_experts, n_used,
        // renormalize, shared_expert); logits hold n rows of e values, ids and weights n rows of
        // k, each one more with a shared expert (their shapes).
        unsafe {
            self.device()
                .stream()
                .launch_builder(&function)
                .arg(logits.buf())
                .arg(&scale_ptr)
                .arg(ids.buf_mut())
                .arg(weights.buf_mut())
                .arg(&e32)
                .arg(&k32)
                .arg(&renorm)
                .arg(&shared_expert)
                .launch(cfg)
        }
        .map(drop)
        .map_err(launch_error("moe_route_f32"))
    }

    pub(crate) fn launch_moe_matmul(&self, experts: &[GpuWeight], x: View, ids: View, mut out: ViewMut, input: ExpertInput) -> Result<()> {
        let (n, n_used) = expert_product_shape(experts, &x, &ids, &out, input)?;
        let call = ExpertCall { experts, x: x.buf(), ids: ids.buf(), n, n_used, input };
        self.experts.matmul(self.device(), call, out.buf_mut()).map_err(backend_error)
    }

    /// The gated expert product in one launch where it applies (matvec/experts.rs), else
    /// composed of the plain ops.
    pub(crate) fn launch_moe_gate_up(&self, experts: GatedExperts<Self>, x: View, ids: View, scratch: [ViewMut; 2], mut out: ViewMut) -> Result<()> {
        let (n, n_used) = expert_product_shape(experts.gate, &x, &ids, &out, ExpertInput::PerToken)?;
        if let Some(bias) = &experts.bias {
            for b in bias {
                shapes::moe_add_bias(out.shape(), b.shape(), ids.shape())?;
            }
        }
        let call = ExpertCall { experts: experts.gate, x: x.buf(), ids: ids.buf(), n, n_used, input: ExpertInput::PerToken };
        let gated = GatedCall { up: experts.up, bias: experts.bias.as_ref().map(|[g, u]| [g.buf(), u.buf()]), act: experts.act };
        if self.experts.matmul_gated(self.device(), call, gated, out.buf_mut()).map_err(backend_error)?.is_some() {
            return Ok(());
        }
        compose_moe_gate_up(self, experts, x, ids, scratch, out)
    }

    /// The expert product with its bias in one launch where it applies, else the two ops.
    pub(crate) fn launch_moe_matmul_bias(&self, experts: &[GpuWeight], bias: View, x: View, ids: View, mut out: ViewMut, input: ExpertInput) -> Result<()> {
        let (n, n_used) = expert_product_shape(experts, &x, &ids, &out, input)?;
        shapes::moe_add_bias(out.shape(), bias.shape(), ids.shape())?;
        let call = ExpertCall { experts, x: x.buf(), ids: ids.buf(), n, n_used, input };
        if self.experts.matmul_bias(self.device(), call, bias.buf(), out.buf_mut()).map_err(backend_error)? {
            return Ok(());
        }
        self.launch_moe_matmul(experts, x, ids, out.reborrow(), input)?;
        self.launch_moe_add_bias(out, bias, ids)
    }

    /// The experts' norm and the router in one launch where it applies (matvec/router.rs),
    /// else composed of the plain ops.
    pub(crate) fn launch_moe_norm_route(
        &self,
        x: View,
        norm: (View, f32),
        router: RouterArgs<Self>,
        mut h: ViewMut,
        mut logits: ViewMut,
        [mut ids, mut weights]: [ViewMut; 2],
    ) -> Result<()> {
        let (n, _) = shapes::rms_norm(x.shape(), norm.0.shape(), h.shape())?;
        if let Some(router_norm) = &router.norm {
            shapes::rms_norm(x.shape(), router_norm.shape(), h.shape())?;
        }
        shapes::matmul("moe_norm_route", (router.weight.rows, router.weight.cols), h.shape(), logits.shape())?;
        if let Some(bias) = &router.bias {
            shapes::rows_and_vector("moe_norm_route", logits.shape(), bias.shape())?;
        }
        let (_, _, n_used) =
            shapes::moe_route(logits.shape(), router.expert_scale.map(|s| s.shape()), ids.shape(), weights.shape(), router.params.shared_expert)?;
        if let Some((gate, out)) = &router.shared_gate {
            shapes::matmul("moe_norm_route", (gate.rows, gate.cols), h.shape(), out.shape())?;
        }
        let call = NormRouteCall {
            x: x.buf(),
            norm: norm.0.buf(),
            router_norm: router.norm.as_ref().map(|t| t.buf()),
            eps: norm.1,
            router: router.weight,
            bias: router.bias.as_ref().map(|t| t.buf()),
            expert_scale: router.expert_scale.as_ref().map(|t| t.buf()),
            renormalize: router.params.renormalize,
            n,
            n_used,
        };
        let out = RouteOutputs { h: h.buf_mut(), logits: logits.buf_mut(), ids: ids.buf_mut(), weights: weights.buf_mut() };
        // The one-launch router routes no shared expert.
        if !router.params.shared_expert && self.experts.norm_route(self.device(), call, out).map_err(backend_error)? {
            return match router.shared_gate {
                Some((gate, out)) => kiln_core::Backend::matmul(self, gate, h.as_ref(), out),
                None => Ok(()),
            };
        }
        // Composed, the experts' norm writing their int8 input too (one launch fewer).
        let experts_norm = |x: View, norm: (View, f32), mut h: ViewMut| -> Result<()> {
            if self.experts.norm_input(self.device(), x.buf(), norm.0.buf(), norm.1, h.buf_mut(), n).map_err(backend_error)? {
                return Ok(());
            }
            kiln_core::Backend::rms_norm(self, x, norm.0, h, norm.1)
        };
        compose_moe_norm_route(self, x, norm, router, h, logits, [ids, weights], experts_norm)
    }

    pub(crate) fn launch_moe_add_bias(&self, mut x: ViewMut, bias: View, ids: View) -> Result<()> {
        let (n, n_used, dim, n_experts) = shapes::moe_add_bias(x.shape(), bias.shape(), ids.shape())?;
        let slots = n * n_used;
        if slots * dim == 0 {
            return Ok(());
        }
        let function = self.arch_kernel("moe_add_bias_f32")?;
        let (dim32, n_experts, total) = (to_u32("dim", dim)?, to_u32("experts", n_experts)?, (slots * dim) as u64);
        // SAFETY: moe_add_bias_f32(x, bias, ids, dim, n_experts, n); the kernel checks every id
        // against the experts `bias` holds; lengths from the views' shapes.
        unsafe {
            self.device()
                .stream()
                .launch_builder(&function)
                .arg(x.buf_mut())
                .arg(bias.buf())
                .arg(ids.buf())
                .arg(&dim32)
                .arg(&n_experts)
                .arg(&total)
                .launch(self.grid_stride(slots * dim))
        }
        .map(drop)
        .map_err(launch_error("moe_add_bias_f32"))
    }

    /// `out = combine(y, weights)`, or `out += ...` when `accumulate`.
    /// `out (+)= sum_j weights[t][j] * y[t][j]`, plus `sigmoid(gate[t]) * shared[t]` with a
    /// shared expert's (output `[n, dim]`, gate logit `[n, 1]`).
    pub(crate) fn launch_moe_combine(&self, y: View, weights: View, shared: Option<(View, View)>, mut out: ViewMut, accumulate: bool) -> Result<()> {
        let (n, n_used, dim) = shapes::moe_combine(y.shape(), weights.shape(), out.shape())?;
        if let Some((shared, gate)) = shared {
            expect_shape("moe_combine", "shared expert", shared.shape(), [n, dim])?;
            expect_shape("moe_combine", "shared expert's gate", gate.shape(), [n, 1])?;
        }
        if n * dim == 0 {
            return Ok(());
        }
        let function = self.arch_kernel("moe_combine_f32")?;
        let (k32, dim32, total) = (to_u32("experts used", n_used)?, to_u32("dim", dim)?, (n * dim) as u64);
        let accumulate = u32::from(accumulate);
        let address = |v: View| v.buf().device_ptr(self.device().stream()).0;
        let (shared, gate) = shared.map_or((0, 0), |(s, g)| (address(s), address(g)));
        // SAFETY: moe_combine_f32(out, y, weights, n_used, dim, n, accumulate, shared, shared_gate);
        // lengths from the views' shapes (the shared expert's checked above, or null).
        unsafe {
            self.device()
                .stream()
                .launch_builder(&function)
                .arg(out.buf_mut())
                .arg(y.buf())
                .arg(weights.buf())
                .arg(&k32)
                .arg(&dim32)
                .arg(&total)
                .arg(&accumulate)
                .arg(&shared)
                .arg(&gate)
                .launch(self.grid_stride(n * dim))
        }
        .map(drop)
        .map_err(launch_error("moe_combine_f32"))
    }

    /// Checks the state slots buffer against the step's sequences.
    fn check_slots(&self, what: &str, state: &CudaSlice<f32>, slots: &CudaSlice<f32>, step: &CudaStep, per_slot: usize) -> Result<()> {
        check_len(&format!("{what} state slots"), slots.len(), step.n_seqs)?;
        if per_slot == 0 || state.len() < per_slot {
            return Err(BackendError::Device(format!("{what}: a state buffer of {} values holds no slot of {per_slot}", state.len())));
        }
        Ok(())
    }

    /// [`kiln_core::Backend::gated_norm_matmul_add`]: for up to 8 tokens of quantized weights
    /// the gated norm writes the product's int8 input itself (`gated_norm_quantize_q8`: one
    /// launch for the norm, the gate and the quantization); else the composed ops.
    pub(crate) fn launch_gated_norm_matmul_add(
        &self,
        g: GatedNorm<CudaSlice<f32>>,
        scratch: [ViewMut; 2],
        w: &GpuWeight,
        mut residual: ViewMut,
        tmp: ViewMut,
    ) -> Result<()> {
        const OP: &str = "gated_norm_matmul_add";
        let [n, heads, head_dim] = g.x.shape().dims3(OP, "x")?;
        let width = heads * head_dim;
        if takes_quantized_matvec(w, n, width) {
            expect_shape(OP, "z", g.z.shape(), [n, width])?;
            expect_shape(OP, "norm weight", g.weight.shape(), [head_dim])?;
            shapes::matmul(OP, (w.rows, w.cols), [n, width].into(), residual.shape())?;
            let shared = matvec::shared_input(self.device(), width).map_err(backend_error)?;
            let qx = lock_input(&shared);
            let fused = matvec::gated_norm_quantize(self.device(), (g.x.buf(), g.z.buf()), (g.weight.buf(), g.eps), head_dim, n, &qx).map_err(backend_error)?;
            if fused {
                return matvec::matmul_quantized(self.device(), w, &qx, None, residual.buf_mut(), n, true).map_err(backend_error);
            }
        }
        compose_gated_norm_matmul_add(self, g, scratch, w, residual, tmp)
    }

    pub(crate) fn launch_ssm_conv(
        &self,
        x: View,
        weight: View,
        state: StateSlots<CudaSlice<f32>>,
        mut out: ViewMut,
        step: &CudaStep,
        p: &DeltaNetParams,
    ) -> Result<()> {
        let (c, k) = (p.conv_dim(), p.conv_kernel);
        if k == 0 || k > CONV_MAX_KERNEL {
            return Err(BackendError::Unsupported { backend: "CUDA".into(), what: format!("a convolution of {k} taps (1 to {CONV_MAX_KERNEL})") });
        }
        let StateSlots { state: mut state_view, slots } = state;
        let n = shapes::ssm_conv(x.shape(), weight.shape(), state_view.shape(), out.shape(), p)?;
        check_len("ssm_conv tokens in the step", step.n_tokens, n)?;
        let (state, slots) = (state_view.buf_mut(), slots.buf());
        self.check_slots("ssm_conv", state, slots, step, p.conv_state().max(1))?;
        let threads = step.n_seqs * c;
        if threads == 0 {
            return Ok(());
        }
        let function = self.arch_kernel("ssm_conv_f32")?;
        let (c32, k32, total) = (to_u32("channels", c)?, to_u32("taps", k)?, threads as u64);
        let n_slots = to_u32("state slots", state.len() / p.conv_state().max(1))?;
        // SAFETY: ssm_conv_f32(out, x, weight, state, slots, n_slots, step, channels, kernel, n);
        // the step's sequences cover its tokens (n checked) and the kernel checks every slot
        // against the n_slots that `state` holds.
        unsafe {
            self.device()
                .stream()
                .launch_builder(&function)
                .arg(out.buf_mut())
                .arg(x.buf())
                .arg(weight.buf())
                .arg(state)
                .arg(slots)
                .arg(&n_slots)
                .arg(&step.block)
                .arg(&c32)
                .arg(&k32)
                .arg(&total)
                .launch(self.grid_stride(threads))
        }
        .map(drop)
        .map_err(launch_error("ssm_conv_f32"))
    }

    /// The delta rule (delta_net.cu) of the gates, or with `gate_params` = [a_log_neg, dt_bias]
    /// of the gates' projections, which the kernels turn into gates as they read them.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_delta_net(
        &self,
        x: View,
        gates: [View; 2],
        gate_params: Option<[View; 2]>,
        state: StateSlots<CudaSlice<f32>>,
        mut out: ViewMut,
        step: &CudaStep,
        p: &DeltaNetParams,
    ) -> Result<()> {
        let (d, nk, nv) = (p.head_dim, p.n_k_heads, p.n_v_heads);
        if nk == 0 || nv % nk != 0 {
            return Err(BackendError::Device(format!("delta_net: {nv} value heads over {nk} key heads")));
        }
        if d == 0 || d % 32 != 0 || d > DELTA_NET_MAX_HEAD_DIM {
            return Err(BackendError::Unsupported {
                backend: "CUDA".into(),
                what: format!("a DeltaNet head of {d} values (a multiple of 32, at most {DELTA_NET_MAX_HEAD_DIM})"),
            });
        }
        let StateSlots { state: mut state_view, slots } = state;
        let n = shapes::delta_net(x.shape(), gates.map(|g| g.shape()), state_view.shape(), out.shape(), p)?;
        check_len("delta_net tokens in the step", step.n_tokens, n)?;
        if let Some(params) = &gate_params {
            for (t, name) in params.iter().zip(["a_log_neg", "dt_bias"]) {
                expect_shape("delta_net", name, t.shape(), [nv])?;
            }
        }
        let address = |t: &View| t.buf().device_ptr(self.device().stream()).0;
        let [a_log_neg, dt_bias] = gate_params.as_ref().map_or([0u64; 2], |params| params.each_ref().map(address));
        let (state, slots, [g, beta]) = (state_view.buf_mut(), slots.buf(), gates.map(|g| g.buf()));
        self.check_slots("delta_net", state, slots, step, p.ssm_state())?;
        if step.n_seqs == 0 || n == 0 {
            return Ok(());
        }
        let defines = [("DN_HEAD_DIM", d as i64)];
        let (nk32, nv32, n_slots) = (to_u32("key heads", nk)?, to_u32("value heads", nv)?, to_u32("state slots", state.len() / p.ssm_state())?);
        let seqs = to_u32("sequences", step.n_seqs)?;
        // A decode step's spans are single tokens: the chunked kernel would find nothing to do.
        let chunked_from = if step.decode_only { u32::MAX } else { self.delta_net_chunked_from };
        // (kernel, blocks per head, threads, dynamic shared bytes): the recurrence always (it
        // takes the short spans), the chunked form unless no span can reach it.
        let forms = [("delta_net_f32", 1, d, 0), ("delta_net_chunked_f32", d / DELTA_NET_COLS, DELTA_NET_THREADS, delta_net_chunk_shared_bytes(d))];
        let used = if chunked_from == u32::MAX { 1 } else { 2 };
        for &(kernel, blocks_per_head, threads, shared_bytes) in &forms[..used] {
            let function = self.device().registry().function("delta_net", kernel, &defines).map_err(backend_error)?;
            allow_dynamic_shared(&function, shared_bytes, kernel)?;
            let grid = (nv32 * to_u32("blocks per head", blocks_per_head)?, seqs, 1);
            let cfg = LaunchConfig { grid_dim: grid, block_dim: (threads as u32, 1, 1), shared_mem_bytes: shared_bytes as u32 };
            // SAFETY: delta_net_f32 / delta_net_chunked_f32(out, x, g, beta, state, slots,
            // n_slots, step, n_k_heads, n_v_heads, chunked_from, a_log_neg, dt_bias) with
            // DN_HEAD_DIM = d, the block and shared memory each kernel takes; lengths checked
            // above (the gate parameters n_v values or null), slots as in ssm_conv.
            unsafe {
                self.device()
                    .stream()
                    .launch_builder(&function)
                    .arg(out.buf_mut())
                    .arg(x.buf())
                    .arg(g)
                    .arg(beta)
                    .arg(&mut *state)
                    .arg(slots)
                    .arg(&n_slots)
                    .arg(&step.block)
                    .arg(&nk32)
                    .arg(&nv32)
                    .arg(&chunked_from)
                    .arg(&a_log_neg)
                    .arg(&dt_bias)
                    .launch(cfg)
            }
            .map(drop)
            .map_err(launch_error(kernel))?;
        }
        Ok(())
    }
}

/// (tokens, experts a token) of an expert product's operands, checked against the experts'
/// shape.
fn expert_product_shape(experts: &[GpuWeight], x: &View, ids: &View, out: &ViewMut, input: ExpertInput) -> Result<(usize, usize)> {
    let first = experts.first().ok_or_else(|| BackendError::Device("expert product over no experts".into()))?;
    shapes::moe_matmul((first.rows, first.cols), x.shape(), ids.shape(), out.shape(), input)
}
