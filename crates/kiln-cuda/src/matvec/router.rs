//! A mixture of experts' norm and router in one launch for a decode step's few tokens
//! (`moe_norm_route_f32`, kernels/arch_ops.cu): the experts' normed input `h`, also written as
//! the int8 input of the expert products that follow, the router's logits and the routing.
//! For a router with a bias (gpt-oss) five launches (norm, router product, bias, routing, the
//! input's quantization) and the second quantization of separate gate and up products become
//! one launch.

use std::sync::PoisonError;

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::activations::norm_quantize;
use super::experts::Prefill;
use super::matmat::is_capturing;
use super::repack::FloatKind;
use super::{device_address, to_u32, ExpertProducts, GpuWeight, Storage, CHUNK_VALUES, MAX_MATVEC_TOKENS};
use crate::{CudaDevice, CudaError};

const OP: &str = "moe_norm_route";
/// arch_ops.cu's ROUTER_ROWS, NORM_BLOCK, ROUTE_MAX_USED and 32 * ROUTE_REGS (the experts the
/// routing keeps in registers; the fused launch has no shared memory for more).
const ROUTER_ROWS: usize = 2;
const THREADS: u32 = 256;
const MAX_USED: usize = 64;
const MAX_EXPERTS: usize = 256;

/// The operands of [`ExpertProducts::norm_route`]: `x` `[n, cols]`, the experts' norm weight and
/// the router's own one where it has one, eps, the f32 router `[n_experts, cols]`, its bias and
/// the per-expert scales (`[n_experts]`), the renormalization rule and the experts a token uses.
pub struct NormRouteCall<'a> {
    pub x: &'a CudaSlice<f32>,
    pub norm: &'a CudaSlice<f32>,
    pub router_norm: Option<&'a CudaSlice<f32>>,
    pub eps: f32,
    pub router: &'a GpuWeight,
    pub bias: Option<&'a CudaSlice<f32>>,
    pub expert_scale: Option<&'a CudaSlice<f32>>,
    pub renormalize: bool,
    pub n: usize,
    pub n_used: usize,
}

/// Where [`ExpertProducts::norm_route`] writes: `h` `[n, cols]`, `logits` `[n, n_experts]`,
/// `ids` and `weights` `[n, n_used]` (lengths checked by the caller).
pub struct RouteOutputs<'a> {
    pub h: &'a mut CudaSlice<f32>,
    pub logits: &'a mut CudaSlice<f32>,
    pub ids: &'a mut CudaSlice<f32>,
    pub weights: &'a mut CudaSlice<f32>,
}

impl ExpertProducts {
    /// The fused norm and router; false, with nothing launched, where it does not apply (a
    /// router without a bias, more than 8 tokens, a router not stored in f32, rows not whole
    /// 16-value chunks, more than 256 experts or 64 chosen, or a first call inside a graph
    /// capture): the caller composes the ops then. Either way the quantized input it may have
    /// written for an earlier call no longer counts.
    pub fn norm_route(&self, device: &CudaDevice, call: NormRouteCall, out: RouteOutputs) -> Result<bool, CudaError> {
        *self.prefilled.lock().unwrap_or_else(PoisonError::into_inner) = None;
        let NormRouteCall { x, norm, router_norm, eps, router, bias, expert_scale, renormalize, n, n_used } = call;
        let cols = router.cols;
        // Only routers with a bias (gpt-oss), whose composed path also adds the bias and, with
        // gate and up as separate products, quantizes their input twice: there the one launch
        // measured faster (gpt-oss-20b tg128 +3.5%); a plain router's four launches were faster
        // than the one (Qwen3-30B-A3B -1.4%: their chain of latencies stays in the fused kernel).
        if bias.is_none() {
            return Ok(false);
        }
        let Storage::Float { kind: FloatKind::F32, rows } = &router.storage else { return Ok(false) };
        if n == 0 || n > MAX_MATVEC_TOKENS || cols % CHUNK_VALUES != 0 || router.rows > MAX_EXPERTS || n_used > MAX_USED || n_used > router.rows {
            return Ok(false);
        }
        let capturing = is_capturing(device);
        let mut tickets = self.route_tickets.lock().unwrap_or_else(PoisonError::into_inner);
        if tickets.is_none() {
            if capturing {
                return Ok(false);
            }
            *tickets = Some(device.alloc_zeros::<u32>(MAX_MATVEC_TOKENS, "router tickets")?);
        }
        let tickets = tickets.as_mut().expect("allocated above");
        // The experts' int8 input, where its buffer holds n tokens (grown here outside a capture).
        let inputs = self.quantized_input(device, cols, n, capturing).ok();
        let target = inputs.as_ref().map(|inputs| inputs[&cols].target(device));
        let (xq, xds, x_chunks) = target.map_or((0, 0, 0), |t| (t.codes, t.scales, t.chunks_per_token));
        let null = 0u64;
        let address = |s: Option<&CudaSlice<f32>>| s.map_or(null, |s| device_address(device, s));
        let (router_norm, bias, expert_scale) = (router_norm.unwrap_or(norm), address(bias), address(expert_scale));
        let (n_experts, n_used32, cols32, renormalize) =
            (to_u32(OP, "experts", router.rows)?, to_u32(OP, "n_used", n_used)?, to_u32(OP, "cols", cols)?, u32::from(renormalize));
        let function = device.registry().function("arch_ops", "moe_norm_route_f32", &[])?;
        let cfg = LaunchConfig { grid_dim: (router.rows.div_ceil(ROUTER_ROWS) as u32, n as u32, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        let RouteOutputs { h, logits, ids, weights } = out;
        // SAFETY: argument list matches moe_norm_route_f32; x and h hold n rows of cols values,
        // the norm weights cols, the router n_experts rows of its stride (f32, 16-byte aligned),
        // bias and scales n_experts or null, logits n rows of n_experts, ids and weights n rows
        // of n_used (checked by the caller); the tickets cover 8 tokens and are zero between
        // launches; the int8 target holds n tokens of x_chunks chunks, or is null.
        unsafe {
            device
                .stream()
                .launch_builder(&function)
                .arg(x)
                .arg(norm)
                .arg(router_norm)
                .arg(&eps)
                .arg(&rows.data)
                .arg(&rows.stride)
                .arg(&bias)
                .arg(&expert_scale)
                .arg(&mut *h)
                .arg(logits)
                .arg(ids)
                .arg(weights)
                .arg(tickets)
                .arg(&xq)
                .arg(&xds)
                .arg(&x_chunks)
                .arg(&cols32)
                .arg(&n_experts)
                .arg(&n_used32)
                .arg(&renormalize)
                .launch(cfg)
        }
        .map_err(CudaError::driver("launching moe_norm_route_f32"))?;
        if let Some(inputs) = &inputs {
            let q = &inputs[&cols];
            q.mark_filled(n);
            *self.prefilled.lock().unwrap_or_else(PoisonError::into_inner) = Some(Prefill { x: device_address(device, h), n, cols, fills: q.fills() });
        }
        Ok(true)
    }

    /// The experts' norm of `n` tokens of `x` into `h` and, in the same launch, their int8
    /// input, which the expert products that follow then skip quantizing; false, with nothing
    /// launched, where the input buffer cannot take it (more than 8 tokens, rows not whole
    /// 16-value chunks, a buffer too small inside a graph capture): the caller norms then.
    pub fn norm_input(
        &self,
        device: &CudaDevice,
        x: &CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        eps: f32,
        h: &mut CudaSlice<f32>,
        n: usize,
    ) -> Result<bool, CudaError> {
        let cols = norm.len();
        if n == 0 || n > MAX_MATVEC_TOKENS || cols % CHUNK_VALUES != 0 {
            return Ok(false);
        }
        let Ok(inputs) = self.quantized_input(device, cols, n, is_capturing(device)) else { return Ok(false) };
        let q = &inputs[&cols];
        norm_quantize(device, x, (norm, eps), n, q, Some(h))?;
        *self.prefilled.lock().unwrap_or_else(PoisonError::into_inner) = Some(Prefill { x: device_address(device, h), n, cols, fills: q.fills() });
        Ok(true)
    }
}
