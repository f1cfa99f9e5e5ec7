//! A residual product that also prepares the next product's input: `x += a · Wᵀ` and, in the
//! same launch, the RMSNorm of the new `x` quantized for the products that read it next, so a
//! decode step needs no separate norm launch before q/k/v or the FFN (docs/performance.md: each
//! such launch costs 2.2-2.7 µs replayed).
//!
//! The launch's blocks cannot know the RMS of the whole row, so each quantizes its 16-value
//! chunks of `x * weight` (quantization is scale-free: the codes of `x * weight / rms` are the
//! same but for ties) and writes the sum of squares of its rows. The products reading the input
//! add those sums and scale their outputs by 1 / rms (matvec.cuh's InputNorm), which is linear
//! in the input, so the product equals that of the normed input up to float rounding.

use cudarc::driver::CudaSlice;

use super::{
    bias_address, check_len, check_next_input, device_address, input_for_width, invalid, launch_storing, GpuWeight, MatvecCall, NormStore,
    QuantizedActivations, SharedInput,
};
use crate::{CudaDevice, CudaError};

/// `residual += x · Wᵀ` for `n` tokens of int8 activations `x` (the quantized mat-vec) and,
/// where the launch shape lets each block hold whole 16-row chunks, `next` filled with the
/// RMSNorm of the new residual with `norm` = (weight, eps) as a deferred norm
/// ([`QuantizedActivations::has_deferred_norm`]); `bias` (`w.rows` values), where given, is
/// added with the product. The shape is the one measured for the product, or `shape` whatever
/// measurement would pick (tests). Returns whether `next` was filled; if not, only the sum was
/// done and `next` is as it was.
#[allow(clippy::too_many_arguments)]
pub fn matmul_add_normed(
    device: &CudaDevice,
    w: &GpuWeight,
    x: &QuantizedActivations,
    bias: Option<&CudaSlice<f32>>,
    residual: &mut CudaSlice<f32>,
    n: usize,
    norm: (&CudaSlice<f32>, f32),
    next: &QuantizedActivations,
    shape: Option<usize>,
) -> Result<bool, CudaError> {
    const OP: &str = "matmul_add_normed";
    check_next_input(OP, w, x, next, n)?;
    if !(norm.1 > 0.0 && norm.1.is_finite()) {
        return Err(invalid(OP, format!("norm eps {} is not a positive number", norm.1)));
    }
    check_len(OP, "norm weight", norm.0.len(), w.rows)?;
    let store = NormStore { weight: device_address(device, norm.0), parts: device_address(device, &next.norm_parts) };
    let bias = bias_address(device, OP, w, bias)?;
    let call = MatvecCall { bias, next: Some(next.target(device)), norm: Some(store), ..MatvecCall::plain(OP, w, x, n, true) };
    let blocks = launch_storing(device, call, residual, shape)?;
    if let Some(blocks) = blocks {
        next.mark_filled_normed(n, blocks, norm.1);
    }
    Ok(blocks.is_some())
}

/// The device's buffer for normed inputs of rows of `cols` values that residual products fill
/// ([`matmul_add_normed`]): another than [`super::shared_input`]'s, which the product itself may read.
pub fn normed_input(device: &CudaDevice, cols: usize) -> Result<SharedInput, CudaError> {
    input_for_width(device, &device.normed_inputs, cols)
}
