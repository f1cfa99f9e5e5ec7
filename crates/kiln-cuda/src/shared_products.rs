//! The CUDA backend's products of one input (q, k and v; gate and up; a DeltaNet's input
//! projections): which input they share (the device's int8 buffer for its width, an f16
//! conversion for the mat-mat, or f32) and the norm that fills it.

use std::sync::PoisonError;

use cudarc::driver::CudaSlice;
use kiln_core::backend::{Backend, GatedFfn, Linear, Result};
use kiln_core::shapes;
use kiln_core::tensor::{expect_shape, Shape};

use crate::backend::{backend_error, View, ViewMut};
use crate::matvec::{self, GpuWeight, HalfLayout, NormCall, QuantizedActivations};
use crate::norm_chain::{gated_ffn_of_quantized, CudaNormedInput};
use crate::CudaBackend;

impl CudaBackend {
    /// [`Backend::norm_matmuls`]: the products on the int8 input the norm writes (or the one the
    /// last residual add prepared), else on f32 (float weights, mat-mat).
    pub(crate) fn norm_products<const N: usize>(
        &self,
        x: View,
        norm: (View, f32),
        mut h: ViewMut,
        linears: [Linear<Self>; N],
        mut out: [ViewMut; N],
        prepared: Option<CudaNormedInput>,
    ) -> Result<()> {
        let (n, dim) = shapes::rms_norm(x.shape(), norm.0.shape(), h.shape())?;
        if N == 0 {
            // No product to feed: the plain norm (the stacked helpers take at least one weight).
            return self.rms_norm(x, norm.0, h, norm.1);
        }
        let w = linears.map(|l| l.weight);
        let shared = quantized_input_for(self.device(), &w, n, dim)?;
        if let (Some(_), Some(prepared)) = (&shared, &prepared) {
            if let Some(qx) = prepared.lock_if_current(self.device(), x.buf(), (norm.0.buf(), norm.1), n) {
                return self.matmuls_quantized(&qx, linears, out, n);
            }
        }
        match shared {
            Some(shared) => {
                let qx = lock_input(&shared);
                matvec::rms_norm_quantize(self.device(), x.buf(), norm.0.buf(), norm.1, n, &qx).map_err(backend_error)?;
                self.matmuls_quantized(&qx, linears, out, n)
            }
            None => {
                let converted = self.norm_for_products(x, norm, h.reborrow(), &w, false)?;
                let views = out.each_mut().map(|o| o.reborrow());
                self.matmuls_f32(w, h.as_ref(), views, n, converted)?;
                // The mat-mat and float products take no bias.
                for (l, out) in linears.iter().zip(out) {
                    if let Some(bias) = l.bias {
                        self.add_bias(out, bias)?;
                    }
                }
                Ok(())
            }
        }
    }

    /// Products of one f32 input (q, k and v, a DeltaNet's input projections): the float
    /// stacked mat-vec, else one product each, the mat-mat ones sharing one f16 conversion
    /// (`converted`: the scratch holds it already).
    pub(crate) fn matmuls_f32<const N: usize>(
        &self,
        w: [&GpuWeight; N],
        x: View,
        mut out: [ViewMut; N],
        n: usize,
        converted: Option<HalfLayout>,
    ) -> Result<()> {
        for (weight, out) in w.iter().zip(&out) {
            shapes::matmul("matmuls", (weight.rows, weight.cols), x.shape(), out.shape())?;
        }
        let mut outs: Vec<&mut CudaSlice<f32>> = out.iter_mut().map(|o| o.buf_mut()).collect();
        if converted.is_none() && matvec::matmul_stacked_float(self.device(), &w, x.buf(), &mut outs, n, None).map_err(backend_error)? {
            return Ok(());
        }
        matvec::matmul_shared_input(self.device(), &w, x.buf(), &mut outs, n, converted).map_err(backend_error)
    }

    /// RMSNorm of `x` into `h` ahead of the products of `h` with `products` (`swiglu`: the
    /// first with its up weight): on a measured mat-mat shape the norm also writes `h` in f16
    /// for them, and the layout it wrote is returned; else the plain norm, and None.
    pub(crate) fn norm_for_products(&self, x: View, norm: (View, f32), mut h: ViewMut, products: &[&GpuWeight], swiglu: bool) -> Result<Option<HalfLayout>> {
        let (n, dim) = shapes::rms_norm(x.shape(), norm.0.shape(), h.shape())?;
        let call = NormCall { x: x.buf(), weight: norm.0.buf(), eps: norm.1, h: h.buf_mut(), n, dim };
        let converted = matvec::rms_norm_half(self.device(), call, products, swiglu).map_err(backend_error)?;
        if converted.is_none() {
            self.rms_norm(x, norm.0, h, norm.1)?;
        }
        Ok(converted)
    }

    /// Products (`out`, one per weight) of activations already quantized into `qx` (the
    /// weights' input buffer).
    pub(crate) fn matmuls_quantized<const N: usize>(&self, qx: &QuantizedActivations, w: [Linear<Self>; N], mut out: [ViewMut; N], n: usize) -> Result<()> {
        for (w, out) in w.iter().zip(&out) {
            let weight = w.weight;
            shapes::matmul("matmuls", (weight.rows, weight.cols), Shape::from([n, weight.cols]), out.shape())?;
            if let Some(bias) = w.bias {
                expect_shape("matmuls", "bias", bias.shape(), [weight.rows])?;
            }
        }
        let mut outs: Vec<&mut CudaSlice<f32>> = out.iter_mut().map(|o| o.buf_mut()).collect();
        let biases = w.map(|w| w.bias.map(|b| b.buf()));
        matvec::matmul_stacked_quantized(self.device(), &w.map(|w| w.weight), &biases, qx, &mut outs, n).map_err(backend_error)
    }
}

/// The shapes a gated FFN call checks: its input, norm weight, normed rows, activation and
/// output.
pub(crate) struct FfnShapes {
    pub(crate) x: Shape,
    pub(crate) norm: Shape,
    pub(crate) h: Shape,
    pub(crate) act: Shape,
    pub(crate) out: Shape,
}

impl CudaBackend {
    /// The device's int8 input for `ffn`'s gated FFN, with its (tokens, width), where all three
    /// weights take the quantized mat-vec and gate/up can store down's input in another buffer
    /// than their own (both stay locked at once); None where not. Shapes checked.
    pub(crate) fn fused_ffn_input(&self, op: &str, ffn: &GatedFfn<CudaBackend>, s: FfnShapes) -> Result<Option<(matvec::SharedInput, usize, usize)>> {
        let (gate, up, down) = (ffn.gate, ffn.up, ffn.down);
        let (n, dim) = shapes::rms_norm(s.x, s.norm, s.h)?;
        let fused = down.cols == gate.rows && down.cols != dim && takes_quantized_matvec(down, n, down.cols);
        let shared = if fused { quantized_input_for(self.device(), &[gate, up], n, dim)? } else { None };
        if shared.is_some() {
            shapes::matmul(op, (gate.rows, gate.cols), s.x, s.act)?;
            shapes::matmul(op, (down.rows, down.cols), s.act, s.out)?;
        }
        Ok(shared.map(|shared| (shared, n, dim)))
    }

    /// [`Backend::gated_ffn`] on the int8 input the routed experts' norm wrote beside `h` (a
    /// shared expert's products), where all three weights take the quantized mat-vec and that
    /// input is still there; false, with nothing launched, otherwise. Shapes checked.
    pub(crate) fn gated_ffn_of_experts_input(&self, h: View, ffn: &GatedFfn<CudaBackend>, act: &mut ViewMut, out: &mut ViewMut) -> Result<bool> {
        let (gate, up, down) = (ffn.gate, ffn.up, ffn.down);
        let n = shapes::matmul("gated_ffn", (gate.rows, gate.cols), h.shape(), act.shape())?;
        shapes::matmul("gated_ffn", (up.rows, up.cols), h.shape(), act.shape())?;
        shapes::matmul("gated_ffn", (down.rows, down.cols), act.shape(), out.shape())?;
        let dim = gate.cols;
        if ![gate, up].iter().all(|w| takes_quantized_matvec(w, n, dim)) || !takes_quantized_matvec(down, n, down.cols) {
            return Ok(false);
        }
        let Some(inputs) = self.experts.prefilled_input(self.device(), h.buf(), n, dim) else { return Ok(false) };
        gated_ffn_of_quantized(self.device(), ffn, &inputs[&dim], (act.buf_mut(), out.buf_mut()), n)?;
        Ok(true)
    }
}

/// Whether a product of `n` tokens of `dim` values with `w` takes the quantized mat-vec, whose
/// input buffer is the device's for `dim` ([`matvec::shared_input`]).
pub(crate) fn takes_quantized_matvec(w: &GpuWeight, n: usize, dim: usize) -> bool {
    w.is_quantized() && n <= matvec::MAX_MATVEC_TOKENS && w.cols == dim
}

/// The device's quantized input for `dim` when `ws` all take the quantized mat-vec with it
/// (lock it from its fill until its products are enqueued).
pub(crate) fn quantized_input_for(device: &crate::CudaDevice, ws: &[&GpuWeight], n: usize, dim: usize) -> Result<Option<matvec::SharedInput>> {
    if ws.iter().all(|w| takes_quantized_matvec(w, n, dim)) {
        return matvec::shared_input(device, dim).map(Some).map_err(backend_error);
    }
    Ok(None)
}

/// A shared quantized input, locked (a panic elsewhere leaves its buffers as valid as before).
pub(crate) fn lock_input(input: &matvec::SharedInput) -> std::sync::MutexGuard<'_, matvec::QuantizedActivations> {
    input.lock().unwrap_or_else(PoisonError::into_inner)
}
