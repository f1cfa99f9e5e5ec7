//! Activations quantized for the quantized mat-vec kernels (kernels/activation_q8.cuh): int8
//! codes per value and a scale pair per 16 values, filled by a quantization launch, by a norm
//! fused into it, by a kernel that writes them itself ([`ActivationTarget`]) or by a residual
//! product with the RMSNorm still to be applied (a deferred norm, see normed.rs).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

use cudarc::driver::{CudaFunction, CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};

use super::{check_len, device_address, invalid, stride_launch, tiles_of, to_u32, CHUNK_VALUES, LANES, NORM_THREADS, TILE_VALUES};
use crate::{CudaDevice, CudaError};

/// `InputNorm` of kernels/matvec.cuh, passed by value: a deferred RMSNorm's per-block sums of
/// squares (null: none), their count per token, the row length and eps.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct InputNormArg {
    parts: u64,
    count: u32,
    cols: u32,
    eps: f32,
    _pad: u32,
}
// SAFETY: plain #[repr(C)] data matching the kernels' struct.
unsafe impl DeviceRepr for InputNormArg {}

/// Activations quantized for the quantized mat-vec kernels: for up to `max_tokens` tokens of
/// `cols` values, int8 codes per value and (scale, scale * sum of codes) per 16 values, zero
/// past `cols` up to whole 512-value tiles.
pub struct QuantizedActivations {
    pub(super) codes: CudaSlice<i8>,
    /// (scale, scale * code sum) pairs.
    pub(super) scales: CudaSlice<f32>,
    pub(super) max_tokens: usize,
    pub(super) cols: usize,
    /// Tokens of the last quantization, so a product cannot read stale ones.
    pub(super) filled_tokens: AtomicUsize,
    /// Sums of squares of a deferred RMSNorm's input, per token and producer block.
    pub(super) norm_parts: CudaSlice<f32>,
    /// The RMSNorm the codes still need ([`matmul_add_normed`]): the producer's blocks in the
    /// high 32 bits, eps's bits in the low; 0 when none.
    pub(super) deferred_norm: AtomicU64,
    /// Fills so far, so a holder of an earlier fill can tell whether it is still there.
    pub(super) fills: AtomicU64,
    pub(super) quantize: OnceLock<CudaFunction>,
    pub(super) norm_quantize: OnceLock<CudaFunction>,
    pub(super) norm_quantize_keep: OnceLock<CudaFunction>,
    pub(super) gated_norm_quantize: OnceLock<CudaFunction>,
}

impl QuantizedActivations {
    /// `cols` must be a multiple of 16 (every quantized format's row length is).
    pub fn new(device: &CudaDevice, max_tokens: usize, cols: usize) -> Result<Self, CudaError> {
        const OP: &str = "QuantizedActivations::new";
        if cols % CHUNK_VALUES != 0 || cols == 0 || max_tokens == 0 {
            return Err(invalid(OP, format!("{max_tokens} tokens of {cols} values: need cols a non-zero multiple of 16")));
        }
        let padded = tiles_of(cols) * TILE_VALUES;
        let codes = device.alloc_zeros::<i8>(max_tokens * padded, "quantized activations")?;
        let scales = device.alloc_zeros::<f32>(max_tokens * padded / CHUNK_VALUES * 2, "activation scales")?;
        // A deferred norm's producer blocks hold at least 16 rows each.
        let norm_parts = device.alloc_zeros::<f32>(max_tokens * cols / CHUNK_VALUES, "deferred norm sums")?;
        Ok(QuantizedActivations {
            codes,
            scales,
            max_tokens,
            cols,
            filled_tokens: AtomicUsize::new(0),
            norm_parts,
            deferred_norm: AtomicU64::new(0),
            fills: AtomicU64::new(0),
            quantize: OnceLock::new(),
            norm_quantize: OnceLock::new(),
            norm_quantize_keep: OnceLock::new(),
            gated_norm_quantize: OnceLock::new(),
        })
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Checks that `x` holds `n` tokens this buffer can take, and returns `kernel` of
    /// matvec_input.cu from `slot`, looking it up on first use.
    pub(super) fn prepare<'a>(
        &self,
        device: &CudaDevice,
        op: &'static str,
        slot: &'a OnceLock<CudaFunction>,
        kernel: &str,
        x: &CudaSlice<f32>,
        n: usize,
    ) -> Result<&'a CudaFunction, CudaError> {
        if n > self.max_tokens {
            return Err(invalid(op, format!("{n} tokens exceed the buffer's {}", self.max_tokens)));
        }
        check_len(op, "x", x.len(), n * self.cols)?;
        if let Some(function) = slot.get() {
            return Ok(function);
        }
        let function = device.registry().function("matvec_input", kernel, &[])?;
        Ok(slot.get_or_init(|| function))
    }

    /// Quantizes the first `n` tokens of `x` [n][cols]. Writes the device buffers through a
    /// shared reference: their only readers are later launches on the same stream.
    pub(crate) fn fill(&self, device: &CudaDevice, x: &CudaSlice<f32>, n: usize) -> Result<(), CudaError> {
        const OP: &str = "quantize_activations";
        let function = self.prepare(device, OP, &self.quantize, "quantize_activations_q8", x, n)?;
        let tiles = tiles_of(self.cols);
        let (cols, n32, tiles32) = (to_u32(OP, "cols", self.cols)?, to_u32(OP, "n", n)?, to_u32(OP, "tiles", tiles)?);
        let cfg = stride_launch(n * tiles * LANES);
        // SAFETY: argument list matches quantize_activations_q8; x holds n * cols values (checked)
        // and the buffers n <= max_tokens tokens of tiles * 512 codes and tiles * 32 pairs.
        unsafe { device.stream().launch_builder(function).arg(x).arg(&cols).arg(&n32).arg(&tiles32).arg(&self.codes).arg(&self.scales).launch(cfg) }
            .map(drop)
            .map_err(CudaError::driver("launching quantize_activations_q8"))?;
        self.mark_filled(n);
        Ok(())
    }
}

/// Where a kernel that produces activations stores them in [`QuantizedActivations`]' layout
/// itself (kernels/activation_q8.cuh): the codes' and scales' device addresses and the chunks
/// of 16 values a token's row takes (padding included).
#[derive(Clone, Copy, Debug)]
pub struct ActivationTarget {
    pub codes: u64,
    pub scales: u64,
    pub chunks_per_token: u32,
    pub cols: usize,
    pub max_tokens: usize,
}

impl QuantizedActivations {
    /// The buffers for a kernel that writes them itself; afterwards [`Self::mark_filled`] with
    /// the tokens it wrote, so that products may read them.
    pub fn target(&self, device: &CudaDevice) -> ActivationTarget {
        ActivationTarget {
            codes: device_address(device, &self.codes),
            scales: device_address(device, &self.scales),
            chunks_per_token: (tiles_of(self.cols) * LANES) as u32,
            cols: self.cols,
            max_tokens: self.max_tokens,
        }
    }

    /// The first `n` tokens' codes (`cols` each, padding dropped) and (scale, scale * code
    /// sum) pairs, copied to the host (for tests).
    pub fn download(&self, device: &CudaDevice, n: usize) -> Result<(Vec<i8>, Vec<[f32; 2]>), CudaError> {
        let (padded, chunks) = (tiles_of(self.cols) * TILE_VALUES, tiles_of(self.cols) * LANES);
        let (codes, scales) = (device.download(&self.codes)?, device.download(&self.scales)?);
        let n = n.min(self.max_tokens);
        let codes = (0..n).flat_map(|t| codes[t * padded..t * padded + self.cols].iter().copied()).collect();
        let scales = (0..n).flat_map(|t| (0..self.cols / CHUNK_VALUES).map(move |c| (t * chunks + c) * 2)).map(|i| [scales[i], scales[i + 1]]).collect();
        Ok((codes, scales))
    }

    /// The first `n` tokens now hold activations written through [`Self::target`].
    pub fn mark_filled(&self, n: usize) {
        self.filled_tokens.store(n.min(self.max_tokens), Ordering::Relaxed);
        self.deferred_norm.store(0, Ordering::Relaxed);
        self.fills.fetch_add(1, Ordering::Relaxed);
    }

    /// The first `n` tokens now hold a residual's values times a norm weight, written by a
    /// product of `blocks` blocks that also left each block's sum of squares in `norm_parts`:
    /// the products reading them apply the RMSNorm's 1 / rms ([`InputNormArg`]).
    pub(super) fn mark_filled_normed(&self, n: usize, blocks: u32, eps: f32) {
        self.filled_tokens.store(n.min(self.max_tokens), Ordering::Relaxed);
        self.deferred_norm.store(u64::from(blocks) << 32 | u64::from(eps.to_bits()), Ordering::Relaxed);
        self.fills.fetch_add(1, Ordering::Relaxed);
    }

    /// How many times the buffer was filled (by any way) so far.
    pub fn fills(&self) -> u64 {
        self.fills.load(Ordering::Relaxed)
    }

    /// Whether the codes still need an RMSNorm's scale ([`matmul_add_normed`]).
    pub fn has_deferred_norm(&self) -> bool {
        self.deferred_norm.load(Ordering::Relaxed) != 0
    }

    /// The kernels' `InputNorm` for these activations: the deferred norm's sums, or none.
    pub(super) fn input_norm_arg(&self, device: &CudaDevice) -> InputNormArg {
        match self.deferred_norm.load(Ordering::Relaxed) {
            0 => InputNormArg::default(),
            packed => InputNormArg {
                parts: device_address(device, &self.norm_parts),
                count: (packed >> 32) as u32,
                cols: self.cols as u32,
                eps: f32::from_bits(packed as u32),
                _pad: 0,
            },
        }
    }
}

/// Quantizes the first `n` tokens of `x` [n][cols] for [`matmul_quantized`] and
/// [`matmul_gated_quantized`].
pub fn quantize_activations(device: &CudaDevice, x: &CudaSlice<f32>, n: usize, out: &mut QuantizedActivations) -> Result<(), CudaError> {
    out.fill(device, x, n)
}

/// RMSNorm of the first `n` tokens of `x` [n][cols] (`x / sqrt(mean(x²) + eps) * weight`),
/// quantized into `out` in the same launch. The normalized values are bit-identical to the
/// backend's `rms_norm` (the kernels share their reduction code), so this equals `rms_norm`
/// followed by [`quantize_activations`]. Writes `out` through a shared reference like `matmul`
/// does with a weight's own input buffer.
pub fn rms_norm_quantize(
    device: &CudaDevice,
    x: &CudaSlice<f32>,
    weight: &CudaSlice<f32>,
    eps: f32,
    n: usize,
    out: &QuantizedActivations,
) -> Result<(), CudaError> {
    norm_quantize(device, x, (weight, eps), n, out, None)
}

/// [`rms_norm_quantize`]; with `keep` it also stores the normalized rows there [n][cols],
/// bit-identical to the backend's `rms_norm` (a mixture of experts' input: its router reads it
/// in f32, its experts in int8).
pub(super) fn norm_quantize(
    device: &CudaDevice,
    x: &CudaSlice<f32>,
    (weight, eps): (&CudaSlice<f32>, f32),
    n: usize,
    out: &QuantizedActivations,
    keep: Option<&mut CudaSlice<f32>>,
) -> Result<(), CudaError> {
    const OP: &str = "rms_norm_quantize";
    let (slot, kernel) = if keep.is_some() { (&out.norm_quantize_keep, "rms_norm_quantize_keep_q8") } else { (&out.norm_quantize, "rms_norm_quantize_q8") };
    let function = out.prepare(device, OP, slot, kernel, x, n)?;
    check_len(OP, "norm weight", weight.len(), out.cols)?;
    if let Some(h) = &keep {
        check_len(OP, "h", h.len(), n * out.cols)?;
    }
    if n > 0 {
        let tiles = tiles_of(out.cols);
        let (cols, tiles32) = (to_u32(OP, "cols", out.cols)?, to_u32(OP, "tiles", tiles)?);
        let cfg = LaunchConfig { grid_dim: (to_u32(OP, "n", n)?, 1, 1), block_dim: (NORM_THREADS, 1, 1), shared_mem_bytes: 0 };
        let mut launch = device.stream().launch_builder(function);
        launch.arg(x).arg(weight).arg(&cols).arg(&tiles32).arg(&eps).arg(&out.codes).arg(&out.scales);
        if let Some(h) = keep {
            launch.arg(h);
        }
        // SAFETY: argument list matches the kernel (h last for the keeping one); x (and h) hold
        // n * cols values and weight cols (checked), the buffers n <= max_tokens tokens of
        // tiles * 512 codes and tiles * 32 pairs.
        unsafe { launch.launch(cfg) }.map(drop).map_err(CudaError::driver(format!("launching {kernel}")))?;
    }
    out.mark_filled(n);
    Ok(())
}

/// A Gated DeltaNet's gated RMSNorm of the first `n` tokens of `x` [n][cols] (heads of
/// `head_dim` values, each normed alone with `weight` [head_dim], then times silu(z), z of x's
/// shape), quantized into `out` (`cols` wide) in the same launch. Ok(false), launching nothing,
/// where a head is not a power-of-two count of 16-value chunks up to 32 (or does not divide
/// the row): the kernel's lanes reduce a head by shuffles.
pub fn gated_norm_quantize(
    device: &CudaDevice,
    (x, z): (&CudaSlice<f32>, &CudaSlice<f32>),
    (weight, eps): (&CudaSlice<f32>, f32),
    head_dim: usize,
    n: usize,
    out: &QuantizedActivations,
) -> Result<bool, CudaError> {
    const OP: &str = "gated_norm_quantize";
    let group = head_dim / CHUNK_VALUES;
    if head_dim % CHUNK_VALUES != 0 || !group.is_power_of_two() || group > 32 || out.cols % head_dim != 0 {
        return Ok(false);
    }
    let function = out.prepare(device, OP, &out.gated_norm_quantize, "gated_norm_quantize_q8", x, n)?;
    check_len(OP, "z", z.len(), n * out.cols)?;
    check_len(OP, "norm weight", weight.len(), head_dim)?;
    if n > 0 {
        let tiles = tiles_of(out.cols);
        let (cols, head_dim32, tiles32) = (to_u32(OP, "cols", out.cols)?, to_u32(OP, "head_dim", head_dim)?, to_u32(OP, "tiles", tiles)?);
        let cfg = LaunchConfig { grid_dim: (to_u32(OP, "n", n)?, 1, 1), block_dim: (NORM_THREADS, 1, 1), shared_mem_bytes: 0 };
        let mut launch = device.stream().launch_builder(function);
        launch.arg(x).arg(z).arg(weight).arg(&cols).arg(&head_dim32).arg(&tiles32).arg(&eps).arg(&out.codes).arg(&out.scales);
        // SAFETY: argument list matches gated_norm_quantize_q8; x and z hold n * cols values,
        // weight head_dim (checked), the buffers n <= max_tokens tokens of tiles * 512 codes and
        // tiles * 32 pairs; a head is a power of two of chunks up to 32 that divides the row.
        unsafe { launch.launch(cfg) }.map(drop).map_err(CudaError::driver("launching gated_norm_quantize_q8"))?;
    }
    out.mark_filled(n);
    Ok(true)
}
