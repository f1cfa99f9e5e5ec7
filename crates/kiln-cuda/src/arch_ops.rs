//! The CUDA backend's ops of the newer architectures (kernels/arch_ops.cu, delta_net.cu): the
//! elementwise activations and gates of Gemma, gpt-oss and Qwen3.5, the expert router and the
//! combination of expert outputs, and the Gated DeltaNet's convolution and delta rule. Each
//! computes what the CPU backend's op of the same name does; the argument checks are the same.

// `usize::is_multiple_of` needs Rust 1.87; the workspace supports 1.85.
#![allow(clippy::manual_is_multiple_of)]

use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use kiln_core::backend::{BackendError, DeltaNetParams, Result, RouterParams};

use crate::backend::{backend_error, check_len, launch_error, to_u32};
use crate::{CudaBackend, CudaStep};

/// `arch_ops.cu`'s CONV_MAX_KERNEL and ROUTE_MAX_USED; `delta_net.cu`'s largest head.
const CONV_MAX_KERNEL: usize = 8;
const ROUTE_MAX_USED: usize = 64;
const DELTA_NET_MAX_HEAD_DIM: usize = 128;

impl CudaBackend {
    fn arch_kernel(&self, name: &str) -> Result<CudaFunction> {
        self.device().registry().function("arch_ops", name, &[]).map_err(backend_error)
    }

    /// `out = act(gate, up)` elementwise, for the two-input activations of arch_ops.cu.
    pub(crate) fn gated_pointwise(
        &self,
        kernel: &'static str,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        len: usize,
        params: &[f32],
    ) -> Result<()> {
        check_len(kernel, gate.len().min(up.len()).min(out.len()), len)?;
        if len == 0 {
            return Ok(());
        }
        let function = self.arch_kernel(kernel)?;
        let total = len as u64;
        let mut launch = self.device().stream().launch_builder(&function);
        launch.arg(out).arg(gate).arg(up);
        for p in params {
            launch.arg(p);
        }
        launch.arg(&total);
        // SAFETY: geglu_f32(out, gate, up, n) / swiglu_oai_f32(out, gate, up, alpha, limit, n);
        // every buffer holds `len` values (checked above).
        unsafe { launch.launch(self.grid_stride(len)) }.map(drop).map_err(launch_error(kernel))
    }

    pub(crate) fn launch_scale(&self, x: &mut CudaSlice<f32>, s: f32, len: usize) -> Result<()> {
        check_len("scale", x.len(), len)?;
        if len == 0 {
            return Ok(());
        }
        let function = self.device().registry().function("elementwise", "scale_f32", &[]).map_err(backend_error)?;
        let total = len as u64;
        let (ptr, _record) = x.device_ptr(self.device().stream());
        // SAFETY: scale_f32(out, x, factor, n) is elementwise, so out may alias x; len checked.
        unsafe { self.device().stream().launch_builder(&function).arg(&ptr).arg(&ptr).arg(&s).arg(&total).launch(self.grid_stride(len)) }
            .map(drop)
            .map_err(launch_error("scale_f32"))
    }

    pub(crate) fn launch_softcap(&self, x: &mut CudaSlice<f32>, cap: f32, len: usize) -> Result<()> {
        check_len("softcap", x.len(), len)?;
        if !(cap > 0.0 && cap.is_finite()) {
            return Err(BackendError::Device(format!("softcap: cap {cap} is not positive")));
        }
        if len == 0 {
            return Ok(());
        }
        let function = self.arch_kernel("softcap_f32")?;
        let total = len as u64;
        // SAFETY: softcap_f32(x, cap, n); x holds len values (checked).
        unsafe { self.device().stream().launch_builder(&function).arg(x).arg(&cap).arg(&total).launch(self.grid_stride(len)) }
            .map(drop)
            .map_err(launch_error("softcap_f32"))
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_copy_cols(&self, src: &CudaSlice<f32>, src_width: usize, col: usize, dst: &mut CudaSlice<f32>, width: usize, n: usize) -> Result<()> {
        if col + width > src_width {
            return Err(BackendError::Device(format!("copy_cols: columns {col}..{} of rows of {src_width}", col + width)));
        }
        check_len("copy_cols source", src.len(), n * src_width)?;
        check_len("copy_cols destination", dst.len(), n * width)?;
        if n * width == 0 {
            return Ok(());
        }
        let function = self.arch_kernel("copy_cols_f32")?;
        let (sw, c, w, total) = (to_u32("source width", src_width)?, to_u32("column", col)?, to_u32("width", width)?, (n * width) as u64);
        // SAFETY: copy_cols_f32(dst, src, src_width, col, width, n); bounds checked above.
        unsafe { self.device().stream().launch_builder(&function).arg(dst).arg(src).arg(&sw).arg(&c).arg(&w).arg(&total).launch(self.grid_stride(n * width)) }
            .map(drop)
            .map_err(launch_error("copy_cols_f32"))
    }

    pub(crate) fn launch_sigmoid_gate(&self, x: &mut CudaSlice<f32>, gate: &CudaSlice<f32>, n: usize, dim: usize, gate_dim: usize) -> Result<()> {
        if gate_dim == 0 || dim % gate_dim != 0 {
            return Err(BackendError::Device(format!("sigmoid_gate: {gate_dim} gates over rows of {dim}")));
        }
        check_len("sigmoid_gate input", x.len(), n * dim)?;
        check_len("sigmoid_gate gates", gate.len(), n * gate_dim)?;
        if n * dim == 0 {
            return Ok(());
        }
        let function = self.arch_kernel("sigmoid_gate_f32")?;
        let (per, total) = (to_u32("values per gate", dim / gate_dim)?, (n * dim) as u64);
        // SAFETY: sigmoid_gate_f32(x, gate, per, n); x holds n * dim values and gate n * dim / per.
        unsafe { self.device().stream().launch_builder(&function).arg(x).arg(gate).arg(&per).arg(&total).launch(self.grid_stride(n * dim)) }
            .map(drop)
            .map_err(launch_error("sigmoid_gate_f32"))
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_delta_net_gates(
        &self,
        g: &mut CudaSlice<f32>,
        beta: &mut CudaSlice<f32>,
        a_log_neg: &CudaSlice<f32>,
        dt_bias: &CudaSlice<f32>,
        n: usize,
        n_heads: usize,
    ) -> Result<()> {
        check_len("delta_net gates", g.len().min(beta.len()), n * n_heads)?;
        check_len("delta_net A and dt bias", a_log_neg.len().min(dt_bias.len()), n_heads)?;
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
                .arg(g)
                .arg(beta)
                .arg(a_log_neg)
                .arg(dt_bias)
                .arg(&heads)
                .arg(&total)
                .launch(self.grid_stride(n * n_heads))
        }
        .map(drop)
        .map_err(launch_error("delta_net_gates_f32"))
    }

    pub(crate) fn launch_moe_route(
        &self,
        logits: &CudaSlice<f32>,
        expert_scale: Option<&CudaSlice<f32>>,
        ids: &mut CudaSlice<f32>,
        weights: &mut CudaSlice<f32>,
        n: usize,
        p: &RouterParams,
    ) -> Result<()> {
        let (e, k) = (p.n_experts, p.n_used);
        if k == 0 || k > e {
            return Err(BackendError::Device(format!("router: {k} experts chosen of {e}")));
        }
        if k > ROUTE_MAX_USED {
            return Err(BackendError::Unsupported { backend: "CUDA".into(), what: format!("routing to {k} experts per token (at most {ROUTE_MAX_USED})") });
        }
        if let Some(s) = expert_scale {
            check_len("expert scales", s.len(), e)?;
        }
        check_len("router logits", logits.len(), n * e)?;
        check_len("router ids", ids.len().min(weights.len()), n * k)?;
        if n == 0 {
            return Ok(());
        }
        let function = self.arch_kernel("moe_route_f32")?;
        let shared = e * 4;
        if shared > self.device().info().max_shared_memory_per_block_optin {
            return Err(BackendError::Unsupported { backend: "CUDA".into(), what: format!("a router over {e} experts") });
        }
        if shared > 48 << 10 {
            function
                .set_attribute(cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared as i32)
                .map_err(|e| BackendError::Device(format!("raising the router's shared memory limit: {e:?}")))?;
        }
        let (e32, k32, renorm) = (to_u32("experts", e)?, to_u32("experts used", k)?, u32::from(p.renormalize));
        let no_scale: u64 = 0;
        let (scale_ptr, _record) = expert_scale.map_or((no_scale, None), |s| {
            let (ptr, record) = s.device_ptr(self.device().stream());
            (ptr, Some(record))
        });
        let cfg = LaunchConfig { grid_dim: (to_u32("tokens", n)?, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: shared as u32 };
        // SAFETY: moe_route_f32(logits, expert_scale or null, ids, weights, n_experts, n_used,
        // renormalize); logits hold n rows of e values, ids and weights n rows of k (checked).
        unsafe {
            self.device().stream().launch_builder(&function).arg(logits).arg(&scale_ptr).arg(ids).arg(weights).arg(&e32).arg(&k32).arg(&renorm).launch(cfg)
        }
        .map(drop)
        .map_err(launch_error("moe_route_f32"))
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_moe_add_bias(
        &self,
        x: &mut CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        ids: &CudaSlice<f32>,
        n: usize,
        n_used: usize,
        dim: usize,
    ) -> Result<()> {
        let slots = n * n_used;
        check_len("expert bias input", x.len(), slots * dim)?;
        check_len("expert bias ids", ids.len(), slots)?;
        if slots * dim == 0 {
            return Ok(());
        }
        let function = self.arch_kernel("moe_add_bias_f32")?;
        let (dim32, n_experts, total) = (to_u32("dim", dim)?, to_u32("experts", bias.len() / dim)?, (slots * dim) as u64);
        // SAFETY: moe_add_bias_f32(x, bias, ids, dim, n_experts, n); the kernel checks every id
        // against the experts `bias` holds; lengths checked above.
        unsafe {
            self.device()
                .stream()
                .launch_builder(&function)
                .arg(x)
                .arg(bias)
                .arg(ids)
                .arg(&dim32)
                .arg(&n_experts)
                .arg(&total)
                .launch(self.grid_stride(slots * dim))
        }
        .map(drop)
        .map_err(launch_error("moe_add_bias_f32"))
    }

    pub(crate) fn launch_moe_combine(
        &self,
        y: &CudaSlice<f32>,
        weights: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        n: usize,
        n_used: usize,
        dim: usize,
    ) -> Result<()> {
        check_len("expert outputs", y.len(), n * n_used * dim)?;
        check_len("expert weights", weights.len(), n * n_used)?;
        check_len("combined output", out.len(), n * dim)?;
        if n * dim == 0 {
            return Ok(());
        }
        let function = self.arch_kernel("moe_combine_f32")?;
        let (k32, dim32, total) = (to_u32("experts used", n_used)?, to_u32("dim", dim)?, (n * dim) as u64);
        // SAFETY: moe_combine_f32(out, y, weights, n_used, dim, n); lengths checked above.
        unsafe {
            self.device().stream().launch_builder(&function).arg(out).arg(y).arg(weights).arg(&k32).arg(&dim32).arg(&total).launch(self.grid_stride(n * dim))
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

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_ssm_conv(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        state: &mut CudaSlice<f32>,
        slots: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        step: &CudaStep,
        n: usize,
        p: &DeltaNetParams,
    ) -> Result<()> {
        let (c, k) = (p.conv_dim(), p.conv_kernel);
        if k == 0 || k > CONV_MAX_KERNEL {
            return Err(BackendError::Unsupported { backend: "CUDA".into(), what: format!("a convolution of {k} taps (1 to {CONV_MAX_KERNEL})") });
        }
        check_len("ssm_conv input", x.len().min(out.len()), n * c)?;
        check_len("ssm_conv weight", weight.len(), c * k)?;
        check_len("ssm_conv tokens in the step", step.n_tokens, n)?;
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
                .arg(out)
                .arg(x)
                .arg(weight)
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

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_delta_net(
        &self,
        x: &CudaSlice<f32>,
        g: &CudaSlice<f32>,
        beta: &CudaSlice<f32>,
        state: &mut CudaSlice<f32>,
        slots: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        step: &CudaStep,
        n: usize,
        p: &DeltaNetParams,
    ) -> Result<()> {
        let (d, nk, nv, c) = (p.head_dim, p.n_k_heads, p.n_v_heads, p.conv_dim());
        if nk == 0 || nv % nk != 0 {
            return Err(BackendError::Device(format!("delta_net: {nv} value heads over {nk} key heads")));
        }
        if d == 0 || d % 32 != 0 || d > DELTA_NET_MAX_HEAD_DIM {
            return Err(BackendError::Unsupported {
                backend: "CUDA".into(),
                what: format!("a DeltaNet head of {d} values (a multiple of 32, at most {DELTA_NET_MAX_HEAD_DIM})"),
            });
        }
        check_len("delta_net input", x.len(), n * c)?;
        check_len("delta_net gates", g.len().min(beta.len()), n * nv)?;
        check_len("delta_net output", out.len(), n * nv * d)?;
        check_len("delta_net tokens in the step", step.n_tokens, n)?;
        self.check_slots("delta_net", state, slots, step, p.ssm_state())?;
        if step.n_seqs == 0 || n == 0 {
            return Ok(());
        }
        let function = self.device().registry().function("delta_net", "delta_net_f32", &[("DN_HEAD_DIM", d as i64)]).map_err(backend_error)?;
        let (nk32, nv32, n_slots) = (to_u32("key heads", nk)?, to_u32("value heads", nv)?, to_u32("state slots", state.len() / p.ssm_state())?);
        let cfg = LaunchConfig { grid_dim: (nv32, to_u32("sequences", step.n_seqs)?, 1), block_dim: (d as u32, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: delta_net_f32(out, x, g, beta, state, slots, n_slots, step, n_k_heads,
        // n_v_heads) with DN_HEAD_DIM = d threads a block; lengths checked above, slots as in
        // ssm_conv.
        unsafe {
            self.device()
                .stream()
                .launch_builder(&function)
                .arg(out)
                .arg(x)
                .arg(g)
                .arg(beta)
                .arg(state)
                .arg(slots)
                .arg(&n_slots)
                .arg(&step.block)
                .arg(&nk32)
                .arg(&nv32)
                .launch(cfg)
        }
        .map(drop)
        .map_err(launch_error("delta_net_f32"))
    }
}
