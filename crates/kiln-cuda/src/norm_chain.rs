//! The CUDA backend's [`Backend::NormedInput`](kiln_core::Backend::NormedInput): the RMSNorm of
//! the residual that a residual product prepared in its own launch (matvec::matmul_add_normed)
//! for the next call's products, so that call runs no norm launch.

use std::sync::MutexGuard;

use cudarc::driver::{CudaSlice, DevicePtr};
use kiln_core::backend::{GatedFfn, NormChain, Result};

use crate::backend::{backend_error, View};
use crate::matvec::{self, GatedPair, GpuWeight, QuantizedActivations, SharedInput};
use crate::shared_products::lock_input;
use crate::{CudaBackend, CudaDevice};

/// What a residual product left in the device's normed input for `cols`-value rows: the norm
/// of the residual at `residual` with the weight at `weight` and `eps`, for `n` tokens, as the
/// buffer's fill number `fill`.
pub struct CudaNormedInput {
    input: SharedInput,
    fill: u64,
    residual: u64,
    weight: u64,
    eps: f32,
    n: usize,
}

fn address(device: &CudaDevice, buffer: &CudaSlice<f32>) -> u64 {
    buffer.device_ptr(device.stream()).0
}

impl CudaNormedInput {
    /// Records what `input` (locked by the caller, just filled) now holds.
    pub(crate) fn new(
        device: &CudaDevice,
        input: &SharedInput,
        filled: &QuantizedActivations,
        residual: &CudaSlice<f32>,
        norm: (&CudaSlice<f32>, f32),
        n: usize,
    ) -> Self {
        CudaNormedInput { input: input.clone(), fill: filled.fills(), residual: address(device, residual), weight: address(device, norm.0), eps: norm.1, n }
    }

    /// The prepared input, locked, if it holds the norm of `residual` with `norm` for `n`
    /// tokens and nothing has filled it since; else None (the caller normalizes itself).
    pub(crate) fn lock_if_current(
        &self,
        device: &CudaDevice,
        residual: &CudaSlice<f32>,
        norm: (&CudaSlice<f32>, f32),
        n: usize,
    ) -> Option<MutexGuard<'_, QuantizedActivations>> {
        let same = self.residual == address(device, residual) && self.weight == address(device, norm.0) && self.eps == norm.1 && self.n == n;
        if !same {
            return None;
        }
        let input = self.input.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        (input.fills() == self.fill && input.has_deferred_norm()).then_some(input)
    }
}

/// Where a residual product prepares the next call's normed input: the norm (weight, eps), and
/// the device's normed input for the residual's width, locked by the caller.
pub(crate) struct NextNormTarget<'a> {
    pub(crate) norm: (View<'a>, f32),
    pub(crate) input: &'a SharedInput,
    pub(crate) locked: &'a QuantizedActivations,
}

/// Most tokens a residual product prepares the next norm for: each reader sums the producer's
/// per-block parts for every token (one L2 round trip a warp), which at two to eight tokens
/// cost more than the norm launch it saves (H200, Llama-3-8B Q4_K_M batched decode at 2 / 4 / 8
/// sequences 796 / 1,243 / 1,975 tok/s unchained against 748 / 1,123 / 1,678 chained).
const MAX_CHAINED_TOKENS: usize = 1;

/// The next norm a residual product of `n` tokens should prepare: `next`, or none past
/// [`MAX_CHAINED_TOKENS`] (then no normed input is even looked up or locked).
pub(crate) fn chained_norm<T>(next: Option<T>, n: usize) -> Option<T> {
    next.filter(|_| n <= MAX_CHAINED_TOKENS)
}

/// `residual += x · Wᵀ (+ bias)` from int8 activations and, given `next` (see
/// [`chained_norm`]), the norm of the new residual prepared in the same launch where its shape
/// allows (returned, for the next call's products).
pub(crate) fn matmul_add_then_norm(
    device: &CudaDevice,
    (w, bias): (&GpuWeight, Option<&CudaSlice<f32>>),
    x: &QuantizedActivations,
    residual: &mut CudaSlice<f32>,
    n: usize,
    next: Option<NextNormTarget>,
) -> Result<Option<CudaNormedInput>> {
    let Some(NextNormTarget { norm: (weight, eps), input, locked }) = next else {
        matvec::matmul_quantized(device, w, x, bias, residual, n, true).map_err(backend_error)?;
        return Ok(None);
    };
    let norm = (weight.buf(), eps);
    if !matvec::matmul_add_normed(device, w, x, bias, residual, n, norm, locked, None).map_err(backend_error)? {
        return Ok(None);
    }
    Ok(Some(CudaNormedInput::new(device, input, locked, residual, norm, n)))
}

/// The quantized gated FFN of `n` tokens of `dim` values added to `x`: its norm (`norm`, or
/// what `chain.prepared` holds of it; else into `shared`, the device's input for `dim`),
/// gate/up storing the down product's input (where its launch shape cannot, `act` is quantized
/// in a launch of its own), down preparing `chain.next`. Returns the prepared norm.
pub(crate) fn chained_gated_ffn(
    device: &CudaDevice,
    ffn: &GatedFfn<CudaBackend>,
    (x, norm): (&mut CudaSlice<f32>, (View, f32)),
    act: &mut CudaSlice<f32>,
    (n, dim): (usize, usize),
    shared: &SharedInput,
    chain: NormChain<CudaBackend>,
) -> Result<Option<CudaNormedInput>> {
    let down = ffn.down;
    let next_shared = matvec::shared_input(device, down.cols).map_err(backend_error)?;
    let chain_next = chained_norm(chain.next, n);
    let normed = chain_next.map(|_| matvec::normed_input(device, dim)).transpose().map_err(backend_error)?;
    // All stay locked until their products are enqueued (the normed one last).
    let (qx, next) = lock_pair(shared, &next_shared, dim < down.cols);
    let prepared = chain.prepared.as_ref().and_then(|p| p.lock_if_current(device, x, (norm.0.buf(), norm.1), n));
    if prepared.is_none() {
        matvec::rms_norm_quantize(device, x, norm.0.buf(), norm.1, n, &qx).map_err(backend_error)?;
    }
    gate_up_storing_down_input(device, ffn, prepared.as_deref().unwrap_or(&qx), act, n, &next)?;
    // The next norm goes where gate/up's prepared input was (read by then).
    let target = match (prepared, &normed) {
        (Some(target), _) => Some(target),
        (None, Some(normed)) => Some(lock_input(normed)),
        (None, None) => None,
    };
    let next_norm = chain_next.zip(normed.as_ref()).zip(target.as_deref()).map(|((norm, input), locked)| NextNormTarget { norm, input, locked });
    matmul_add_then_norm(device, (down, None), &next, x, n, next_norm)
}

/// The quantized gated FFN of `n` tokens of `dim` values into `out` (a mixture of experts'
/// shared expert, Gemma's FFNs): its norm into `shared` (the device's input for `dim`), gate/up storing the
/// down product's input where its launch shape can, the down product.
pub(crate) fn gated_ffn_into(
    device: &CudaDevice,
    ffn: &GatedFfn<CudaBackend>,
    (x, norm): (&CudaSlice<f32>, (View, f32)),
    (act, out): (&mut CudaSlice<f32>, &mut CudaSlice<f32>),
    (n, dim): (usize, usize),
    shared: &SharedInput,
) -> Result<()> {
    let next_shared = matvec::shared_input(device, ffn.down.cols).map_err(backend_error)?;
    let (qx, next) = lock_pair(shared, &next_shared, dim < ffn.down.cols);
    matvec::rms_norm_quantize(device, x, norm.0.buf(), norm.1, n, &qx).map_err(backend_error)?;
    gate_up_storing_down_input(device, ffn, &qx, act, n, &next)?;
    matvec::matmul_quantized(device, ffn.down, &next, None, out, n, false).map_err(backend_error)
}

/// [`gated_ffn_into`] of an input quantized already (`qx`, `n` tokens: the routed experts'
/// normed input, for their shared expert).
pub(crate) fn gated_ffn_of_quantized(
    device: &CudaDevice,
    ffn: &GatedFfn<CudaBackend>,
    qx: &QuantizedActivations,
    (act, out): (&mut CudaSlice<f32>, &mut CudaSlice<f32>),
    n: usize,
) -> Result<()> {
    let next_shared = matvec::shared_input(device, ffn.down.cols).map_err(backend_error)?;
    let next = lock_input(&next_shared);
    gate_up_storing_down_input(device, ffn, qx, act, n, &next)?;
    matvec::matmul_quantized(device, ffn.down, &next, None, out, n, false).map_err(backend_error)
}

/// Locks two shared inputs, the narrower first (`first_narrower`: `a`'s), so that two models
/// with swapped widths cannot each hold one and wait for the other.
fn lock_pair<'a>(a: &'a SharedInput, b: &'a SharedInput, first_narrower: bool) -> (MutexGuard<'a, QuantizedActivations>, MutexGuard<'a, QuantizedActivations>) {
    if first_narrower {
        let a = lock_input(a);
        (a, lock_input(b))
    } else {
        let b = lock_input(b);
        (lock_input(a), b)
    }
}

/// Gate/up of `x` and their activation into `act`, which the launch also stores as the down
/// product's input `next` where its shape can (else a quantization launch of its own does).
fn gate_up_storing_down_input(
    device: &CudaDevice,
    ffn: &GatedFfn<CudaBackend>,
    x: &QuantizedActivations,
    act: &mut CudaSlice<f32>,
    n: usize,
    next: &QuantizedActivations,
) -> Result<()> {
    let pair = GatedPair { gate: ffn.gate, up: ffn.up, act: ffn.act };
    if !matvec::matmul_gated_quantized_into(device, pair, x, act, n, next, None).map_err(backend_error)? {
        next.fill(device, act, n).map_err(backend_error)?;
    }
    Ok(())
}
