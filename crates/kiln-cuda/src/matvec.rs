//! Weight matrices on the GPU and the products that read them: mat-vec for 1 to
//! [`MAX_MATVEC_TOKENS`] tokens, mat-mat beyond, fused residual-add and SwiGLU variants, and
//! embedding-row lookup, for F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K,
//! Q5_K, Q6_K, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, Q1_0, Q2_0, MXFP4, NVFP4 and the IQ1/IQ2/IQ3 codebook
//! formats (expanded at upload, see repack.rs).
//!
//! Weights are repacked once at upload ([`upload_weight`], layouts in `repack.rs`). Every
//! launch goes to the device's one stream, never synchronizes the host and never allocates,
//! and its arguments depend only on the buffers and `n`, so a step can be captured into a CUDA
//! graph and replayed.
//!
//! Numerics: float weights are multiplied in f32. For quantized weights the mat-vec kernels
//! (`n <= 8`) first quantize the activations to int8 per 16 values (scale = max|x| / 127,
//! like ggml's q8_1 but with 16-value groups) and use `dp4a`; the result is the exact dot
//! product of the dequantized weights with the 8-bit activations, typically within 0.5%
//! (relative L2) of the f32 product. The mat-mat kernel (`n > 8`, kernels/matmat_mma.cu) runs
//! on tensor cores: weights decoded to f16 (rounded once from the exact f32 value), activations
//! rounded to f16, products summed in f32; about 3e-4 relative L2 from the f32 product. f16
//! activations overflow past 65504 in magnitude. Its block shape is measured per weight shape
//! and token bucket on first use (`matmat.rs`); the pipelined shapes share per-device scratch
//! buffers (f16 activations, split-K partials) that only grow outside graph captures.
//!
//! Weights are immutable once uploaded. [`matmul`] of a quantized weight quantizes its input
//! into the device's buffer for that row length ([`shared_input`]: `cols` x 8 tokens, int8 plus
//! two f32 per 16 values, made when the first weight of that length is uploaded, locked from
//! its fill until the products reading it are enqueued, so threads may share a device). Callers
//! that multiply one input by several weights can quantize it once with
//! [`quantize_activations`] (or normalize and quantize it in one launch with
//! [`rms_norm_quantize`]) and call [`matmul_quantized`] / [`matmul_gated_quantized`].

// `usize::is_multiple_of` needs Rust 1.87; the workspace supports 1.85.
#![allow(clippy::manual_is_multiple_of)]

mod activations;
mod experts;
mod kernels;
mod matmat;
mod matmat_stacked;
mod matvec_shape;
mod normed;
mod repack;
mod router;
mod stacked;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
use kiln_core::{Activation, WeightSource};
use kiln_quant::GgmlType;

use crate::{CudaDevice, CudaError};
use activations::InputNormArg;
pub use activations::{gated_norm_quantize, quantize_activations, rms_norm_quantize, ActivationTarget, QuantizedActivations};
pub use experts::{grouped_ways, ExpertCall, ExpertProducts, GatedCall};
pub use kernels::{matvec_module_keys, module_keys, resolve_matmat_kernels};
use kernels::{Kernel, KernelSlots};
pub use matmat::HalfLayout;
use matmat::{launch_matmat, MatmatCall};
pub use matmat::{matmat_tile, matmat_tile_is_streaming, matmul_with_tile, MATMAT_TILES};
pub(crate) use matmat::{rms_norm_half, NormCall};
pub use matvec_shape::matvec_shape;
use matvec_shape::{choose_shape, default_shape, MatvecKind, TuneKey, MATVEC_SHAPES};
pub use normed::{matmul_add_normed, normed_input};
use repack::{float_stride, pad_float_rows, quant_layout, repack, tiles_of, FloatKind, QuantLayout, CHUNK_VALUES, LANES, TILE_VALUES};
pub use router::{NormRouteCall, RouteOutputs};
pub use stacked::{matmul_stacked_float, matmul_stacked_quantized};

/// Most tokens one mat-vec launch handles; larger batches use the mat-mat kernel.
pub const MAX_MATVEC_TOKENS: usize = 8;

/// Warps per mat-vec block unless its shape says otherwise (`MV_WARPS`' default, kernels/matvec.cuh).
const MV_WARPS: u32 = 4;
/// Warps of the block that takes rows of float weights for one token (`FV_ROW_WARPS`).
const FV_ROW_WARPS: u32 = 8;
/// Rows of one weight such a block takes in a plain or stacked product (`FV_ROW_ROWS`).
const FV_ROW_ROWS: u32 = 2;
/// Threads per mat-mat block (`MMA_THREADS`, kernels/matmat_mma.cu).
const MMA_THREADS: u32 = 256;

/// Threads per token of rms_norm_quantize_q8 (`NORM_BLOCK`, kernels/norm.cuh).
const NORM_THREADS: u32 = 256;
/// Block size of the grid-stride kernels (quantize_activations_q8, embed_*).
const STRIDE_THREADS: u32 = 256;
/// Enough blocks of the grid-stride kernels to fill the GPU several times over.
const STRIDE_MAX_BLOCKS: u32 = 4096;

/// `Planes` of kernels/quant.cuh, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct PlanesArg {
    codes: u64,
    extra: u64,
    scales: u64,
    tiles: u32,
    _pad: u32,
}
// SAFETY: plain #[repr(C)] data matching the kernels' struct.
unsafe impl DeviceRepr for PlanesArg {}

/// `FloatRows` of kernels/quant.cuh, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct FloatArg {
    data: u64,
    stride: u32,
    _pad: u32,
}
// SAFETY: plain #[repr(C)] data matching the kernels' struct.
unsafe impl DeviceRepr for FloatArg {}

/// `NextNorm` of kernels/matvec.cuh, passed by value: where a residual product stores the next
/// product's input (null codes: it does not).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct NextNormArg {
    weight: u64,
    codes: u64,
    scales: u64,
    parts: u64,
}
// SAFETY: plain #[repr(C)] data matching the kernels' struct.
unsafe impl DeviceRepr for NextNormArg {}

#[derive(Debug)]
enum Storage {
    Quant { layout: &'static QuantLayout, planes: PlanesArg },
    Float { kind: FloatKind, rows: FloatArg },
}

/// A weight matrix of `rows` outputs by `cols` inputs, in the layout its kernels read.
pub struct GpuWeight {
    pub name: String,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    storage: Storage,
    /// Owns the memory `storage` points into.
    data: CudaSlice<u8>,
    kernels: KernelSlots,
}

impl std::fmt::Debug for GpuWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuWeight")
            .field("name", &self.name)
            .field("ty", &self.ty)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("storage", &self.storage)
            .finish()
    }
}

impl GpuWeight {
    /// Device bytes of the weight.
    pub fn device_bytes(&self) -> usize {
        self.data.len()
    }

    pub fn is_quantized(&self) -> bool {
        matches!(self.storage, Storage::Quant { .. })
    }

    /// Stored in a grouped (1- or 2-bit) layout, which the mat-vec's grouped loop reads.
    pub fn is_grouped(&self) -> bool {
        matches!(&self.storage, Storage::Quant { layout, .. } if layout.grouped())
    }
}

/// A device's quantized-input buffer for one row length. Whoever fills it holds the lock until
/// the products reading it are enqueued: the device has one stream, so another thread's fill
/// then lands after those reads.
pub type SharedInput = Arc<Mutex<QuantizedActivations>>;

/// The device's quantized-input buffer for rows of `cols` values, which [`matmul`] of a
/// quantized weight with `cols` columns and `n <= 8` quantizes into; made on first request
/// (every quantized upload asks, so none is first made inside a graph capture).
pub fn shared_input(device: &CudaDevice, cols: usize) -> Result<SharedInput, CudaError> {
    input_for_width(device, &device.matvec_inputs, cols)
}

/// The input of `inputs` (one of the device's maps of per-width buffers) for rows of `cols`
/// values, made on first request.
fn input_for_width(device: &CudaDevice, inputs: &Mutex<HashMap<usize, SharedInput>>, cols: usize) -> Result<SharedInput, CudaError> {
    let mut inputs = inputs.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(input) = inputs.get(&cols) {
        return Ok(input.clone());
    }
    let input = Arc::new(Mutex::new(QuantizedActivations::new(device, MAX_MATVEC_TOKENS, cols)?));
    inputs.insert(cols, input.clone());
    Ok(input)
}

fn invalid(op: &'static str, reason: impl Into<String>) -> CudaError {
    CudaError::InvalidArgument { op, reason: reason.into() }
}

fn to_u32(op: &'static str, what: &str, value: usize) -> Result<u32, CudaError> {
    u32::try_from(value).map_err(|_| invalid(op, format!("{what} = {value} does not fit the kernels' 32-bit indices")))
}

fn device_address<T>(device: &CudaDevice, slice: &CudaSlice<T>) -> u64 {
    let (address, _record) = slice.device_ptr(device.stream());
    address
}

/// Uploads a weight once, repacked into the layout its kernels read (see `repack.rs`).
pub fn upload_weight(device: &CudaDevice, src: &WeightSource) -> Result<GpuWeight, CudaError> {
    const OP: &str = "upload_weight";
    src.validate().map_err(|error| invalid(OP, error.to_string()))?;
    let (rows, cols) = (src.rows, src.cols);
    let what = format!("weight {} ({} {rows}x{cols})", src.name, src.ty);
    if rows == 0 || cols == 0 {
        return Err(invalid(OP, format!("{what} is empty")));
    }
    to_u32(OP, "rows", rows)?;
    to_u32(OP, "cols", cols)?;
    let (storage, data) = if let Some(kind) = FloatKind::of(src.ty) {
        let stride = float_stride(cols);
        let bytes = pad_float_rows(kind, src.bytes(), rows, cols);
        let data = device.upload_via_pinned(&bytes, &what)?;
        let rows_arg = FloatArg { data: device_address(device, &data), stride: to_u32(OP, "row stride", stride)?, _pad: 0 };
        (Storage::Float { kind, rows: rows_arg }, data)
    } else if let Some(layout) = quant_layout(src.ty) {
        // The kernels index a weight's 16-value chunks with 32-bit integers (quant.cuh's lane_bytes).
        to_u32(OP, "16-value chunks", rows * tiles_of(cols) * LANES)?;
        let packed = repack(layout, src.bytes(), rows, cols);
        let data = device.upload_via_pinned(&packed.bytes, &what)?;
        let base = device_address(device, &data);
        let planes = PlanesArg {
            codes: base + packed.codes.start as u64,
            extra: base + packed.extra.start as u64,
            scales: base + packed.scales.start as u64,
            tiles: to_u32(OP, "tiles", packed.tiles)?,
            _pad: 0,
        };
        shared_input(device, cols)?;
        (Storage::Quant { layout, planes }, data)
    } else {
        return Err(invalid(OP, format!("{what}: no GPU kernels for type {}", src.ty)));
    };
    Ok(GpuWeight { name: src.name.clone(), ty: src.ty, rows, cols, storage, data, kernels: KernelSlots::default() })
}

fn check_len(op: &'static str, what: &str, have: usize, need: usize) -> Result<(), CudaError> {
    if have < need {
        return Err(invalid(op, format!("{what} holds {have} values, the call needs {need}")));
    }
    Ok(())
}

fn stride_launch(threads: usize) -> LaunchConfig {
    let blocks = threads.div_ceil(STRIDE_THREADS as usize).clamp(1, STRIDE_MAX_BLOCKS as usize) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (STRIDE_THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// The activations a product reads.
#[derive(Clone, Copy)]
enum Input<'a> {
    F32(&'a CudaSlice<f32>),
    Quantized(&'a QuantizedActivations),
}

/// `out[t][r] = x[t] . W[r]` for the first `n` tokens of `x` [n][cols]; `out` is [n][rows].
pub fn matmul(device: &CudaDevice, w: &GpuWeight, x: &CudaSlice<f32>, out: &mut CudaSlice<f32>, n: usize) -> Result<(), CudaError> {
    product(device, "matmul", w, None, Input::F32(x), out, n, false)
}

/// `out[t][r] += x[t] . W[r]` (the residual add fused into the product).
pub fn matmul_add(device: &CudaDevice, w: &GpuWeight, x: &CudaSlice<f32>, out: &mut CudaSlice<f32>, n: usize) -> Result<(), CudaError> {
    product(device, "matmul_add", w, None, Input::F32(x), out, n, true)
}

/// `out[t][r] = silu(x[t] . Wg[r]) * (x[t] . Wu[r])` in one launch; the two weights must have
/// the same type and shape.
pub fn matmul_swiglu(
    device: &CudaDevice,
    w_gate: &GpuWeight,
    w_up: &GpuWeight,
    x: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    product(device, "matmul_swiglu", w_gate, Some(w_up), Input::F32(x), out, n, false)
}

/// The fused SwiGLU of [`matmul_swiglu`] with `converted` as in [`matmul_shared_input`].
pub(crate) fn matmul_swiglu_converted(
    device: &CudaDevice,
    w_gate: &GpuWeight,
    w_up: &GpuWeight,
    x: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    n: usize,
    converted: Option<HalfLayout>,
) -> Result<(), CudaError> {
    const OP: &str = "matmul_swiglu";
    if converted.is_none() || n == 0 || !takes_matmat(w_gate, n) {
        return matmul_swiglu(device, w_gate, w_up, x, out, n);
    }
    check_pair(OP, w_gate, w_up)?;
    check_len(OP, "out", out.len(), n * w_gate.rows)?;
    check_len(OP, "x", x.len(), n * w_gate.cols)?;
    launch_matmat(device, MatmatCall { op: OP, w: w_gate, up: Some(w_up), x, n, accumulate: false }, out, converted).map(drop)
}

/// [`matmul`] (or [`matmul_add`] when `accumulate`) from activations already quantized by
/// [`quantize_activations`], plus `bias` (`w.rows` values) where given, in the same launch;
/// quantized weights and `n <= 8` only.
pub fn matmul_quantized(
    device: &CudaDevice,
    w: &GpuWeight,
    x: &QuantizedActivations,
    bias: Option<&CudaSlice<f32>>,
    out: &mut CudaSlice<f32>,
    n: usize,
    accumulate: bool,
) -> Result<(), CudaError> {
    const OP: &str = "matmul_quantized";
    if n == 0 {
        return Ok(());
    }
    let call = MatvecCall { bias: bias_address(device, OP, w, bias)?, ..MatvecCall::plain(OP, w, x, n, accumulate) };
    check_quantized_call(&call, out)?;
    launch_matvec(device, call, out).map(drop)
}

/// The device address of a per-row bias of `w`'s product (0: none), its length checked.
fn bias_address(device: &CudaDevice, op: &'static str, w: &GpuWeight, bias: Option<&CudaSlice<f32>>) -> Result<u64, CudaError> {
    match bias {
        Some(bias) => {
            check_len(op, "bias", bias.len(), w.rows)?;
            Ok(device_address(device, bias))
        }
        None => Ok(0),
    }
}

/// A gated FFN's two products of one input and the activation joining them:
/// `act(x . gate) * (x . up)`; gate and up of one type and shape.
#[derive(Clone, Copy)]
pub struct GatedPair<'a> {
    pub gate: &'a GpuWeight,
    pub up: &'a GpuWeight,
    pub act: Activation,
}

impl<'a> GatedPair<'a> {
    /// SwiGLU's pair: `silu(x . gate) * (x . up)`.
    pub fn swiglu(gate: &'a GpuWeight, up: &'a GpuWeight) -> GatedPair<'a> {
        GatedPair { gate, up, act: Activation::Silu }
    }
}

/// The kernels' code of a gate activation (common.cuh's GATE_*) with its two parameters.
pub(crate) fn gate_code(act: Activation) -> (u32, f32, f32) {
    match act {
        Activation::Silu => (0, 0.0, 0.0),
        Activation::GeluTanh => (1, 0.0, 0.0),
        Activation::SwiGluOai { alpha, limit } => (2, alpha, limit),
    }
}

/// [`matmul_swiglu`] with `pair`'s activation, from activations already quantized by
/// [`quantize_activations`]; quantized weights and `n <= 8` only.
pub fn matmul_gated_quantized(device: &CudaDevice, pair: GatedPair<'_>, x: &QuantizedActivations, out: &mut CudaSlice<f32>, n: usize) -> Result<(), CudaError> {
    let call = MatvecCall::gated("matmul_gated_quantized", pair, x, n);
    launch_storing(device, call, out, None).map(drop)
}

/// Launch shapes of the quantized mat-vec (see [`matmul_quantized_with_shape`]).
pub const MATVEC_SHAPE_COUNT: usize = MATVEC_SHAPES.len();

/// How many warps share a group of rows in launch shape `shape` (1: none).
pub fn matvec_shape_split(shape: usize) -> u32 {
    MATVEC_SHAPES.get(shape).map_or(1, |s| s.split)
}

/// Whether launch shape `shape` runs `n` tokens of `w` (grouped-only shapes run the 1- and 2-bit formats only).
pub fn matvec_shape_fits(shape: usize, w: &GpuWeight, n: usize) -> bool {
    MATVEC_SHAPES.get(shape).is_some_and(|s| s.fits(n, w.is_grouped()))
}

/// The most tokens launch shape `shape` takes: 1 for the shapes the tuner tries on one token
/// only (warps sharing rows, 8 or 16 rows a warp), else [`MAX_MATVEC_TOKENS`].
pub fn matvec_shape_max_tokens(shape: usize) -> usize {
    match MATVEC_SHAPES.get(shape) {
        Some(s) if s.one_token_only() => 1,
        _ => MAX_MATVEC_TOKENS,
    }
}

/// [`matmul_quantized`] (the fused SwiGLU with `up`) with launch shape `shape`
/// (< [`MATVEC_SHAPE_COUNT`]) whatever measurement would pick, for tests and benchmarks.
#[allow(clippy::too_many_arguments)]
pub fn matmul_quantized_with_shape(
    device: &CudaDevice,
    w: &GpuWeight,
    up: Option<&GpuWeight>,
    x: &QuantizedActivations,
    out: &mut CudaSlice<f32>,
    n: usize,
    accumulate: bool,
    shape: usize,
) -> Result<(), CudaError> {
    let call = MatvecCall { up, ..MatvecCall::plain("matmul_quantized_with_shape", w, x, n, accumulate) };
    launch_checked_shape(device, call, out, shape).map(drop)
}

/// [`matmul_gated_quantized`] that also stores its output as `next`'s int8 input (the FFN's
/// down projection's) in the same launch where the launch shape allows (blocks of whole 16-row
/// chunks, rows a multiple of 512 or one token), sparing that product its
/// quantization launch. The shape is the one measured for the product, or `shape` whatever
/// measurement would pick (tests). Returns whether it stored `next`, which then holds `n` tokens.
pub fn matmul_gated_quantized_into(
    device: &CudaDevice,
    pair: GatedPair<'_>,
    x: &QuantizedActivations,
    out: &mut CudaSlice<f32>,
    n: usize,
    next: &QuantizedActivations,
    shape: Option<usize>,
) -> Result<bool, CudaError> {
    const OP: &str = "matmul_gated_quantized_into";
    check_next_input(OP, pair.gate, x, next, n)?;
    let call = MatvecCall { next: Some(next.target(device)), ..MatvecCall::gated(OP, pair, x, n) };
    let stored = launch_storing(device, call, out, shape)?;
    if stored.is_some() {
        next.mark_filled(n);
    }
    Ok(stored.is_some())
}

/// Whether `next` can take the `n` tokens of `w`'s output that a product reading `x` stores as
/// the next product's input: room enough, and another buffer than `x`.
fn check_next_input(op: &'static str, w: &GpuWeight, x: &QuantizedActivations, next: &QuantizedActivations, n: usize) -> Result<(), CudaError> {
    if n > next.max_tokens || next.cols != w.rows {
        return Err(invalid(op, format!("{n} tokens of {} values into a next input of {} x {}", w.rows, next.max_tokens, next.cols)));
    }
    if std::ptr::eq(x, next) {
        return Err(invalid(op, "the next input is the product's own input: its blocks would overwrite what others still read"));
    }
    Ok(())
}

/// A mat-vec that stores `call.next` where its launch shape allows: the measured shape, or
/// `shape` whatever measurement would pick. Returns its blocks when it stored.
fn launch_storing(device: &CudaDevice, call: MatvecCall<'_>, out: &mut CudaSlice<f32>, shape: Option<usize>) -> Result<Option<u32>, CudaError> {
    match shape {
        Some(shape) => launch_checked_shape(device, call, out, shape),
        None if call.n == 0 => Ok(None),
        None => {
            check_quantized_call(&call, out)?;
            launch_matvec(device, call, out)
        }
    }
}

/// A mat-vec launch of a caller-chosen shape, its operands checked; returns its blocks where it
/// stored `call.next`.
fn launch_checked_shape(device: &CudaDevice, call: MatvecCall<'_>, out: &mut CudaSlice<f32>, shape: usize) -> Result<Option<u32>, CudaError> {
    let MatvecCall { op, w, n, .. } = call;
    if shape >= MATVEC_SHAPES.len() || !(1..=matvec_shape_max_tokens(shape)).contains(&n) {
        return Err(invalid(op, format!("shape {shape} of {} for {n} tokens (1..={})", MATVEC_SHAPES.len(), matvec_shape_max_tokens(shape))));
    }
    if !matvec_shape_fits(shape, w, n) {
        return Err(invalid(op, format!("shape {shape} ({:?}) is for the grouped formats only, not {}", MATVEC_SHAPES[shape], w.ty)));
    }
    check_quantized_call(&call, out)?;
    let next = next_input_target(&call, shape);
    launch_matvec_shape(device, MatvecCall { next, ..call }, out, shape).map(|blocks| next.map(|_| blocks))
}

/// The operands of a quantized mat-vec on int8 activations: gate and up alike, the output long
/// enough, quantized weights, and the activations quantized for them.
fn check_quantized_call(call: &MatvecCall<'_>, out: &CudaSlice<f32>) -> Result<(), CudaError> {
    let MatvecCall { op, w, up, input, n, .. } = *call;
    if let Some(up) = up {
        check_pair(op, w, up)?;
    }
    check_len(op, "out", out.len(), n * w.rows)?;
    if !matches!(w.storage, Storage::Quant { .. }) {
        return Err(invalid(op, format!("{} is {}: float weights take f32 activations", w.name, w.ty)));
    }
    match input {
        Input::Quantized(x) => check_quantized_input(op, x, w, n),
        Input::F32(_) => Err(invalid(op, "f32 activations where int8 ones were expected")),
    }
}

/// `out[t] = table[token_ids[t]]` (f32, `cols` values per token) for the first `n` ids. An id
/// past the table's rows yields a row of NaN rather than an out-of-bounds read.
pub fn embed_rows(device: &CudaDevice, table: &GpuWeight, token_ids: &CudaView<'_, u32>, out: &mut CudaSlice<f32>, n: usize) -> Result<(), CudaError> {
    const OP: &str = "embed_rows";
    if n == 0 {
        return Ok(());
    }
    check_len(OP, "token_ids", token_ids.len(), n)?;
    check_len(OP, "out", out.len(), n * table.cols)?;
    let function = table.kernels.get(device, &table.storage, Kernel::Embed)?;
    let (n32, rows32, cols32) = (to_u32(OP, "n", n)?, to_u32(OP, "rows", table.rows)?, to_u32(OP, "cols", table.cols)?);
    let mut launch = device.stream().launch_builder(function);
    push_weight(&mut launch, &table.storage);
    launch.arg(token_ids).arg(&n32).arg(&rows32).arg(out).arg(&cols32);
    // SAFETY: argument list matches embed_* in matmat.cu; ids hold n values and out n * cols
    // (checked); the kernel bounds-checks every id against rows.
    unsafe { launch.launch(stride_launch(n * table.cols.div_ceil(CHUNK_VALUES))) }
        .map(drop)
        .map_err(CudaError::driver(format!("launching embed for {}", table.name)))
}

fn push_weight<'a>(launch: &mut cudarc::driver::LaunchArgs<'a>, storage: &'a Storage) {
    match storage {
        Storage::Quant { planes, .. } => launch.arg(planes),
        Storage::Float { rows, .. } => launch.arg(rows),
    };
}

fn check_pair(op: &'static str, w: &GpuWeight, up: &GpuWeight) -> Result<(), CudaError> {
    if (up.ty, up.rows, up.cols) != (w.ty, w.rows, w.cols) {
        return Err(invalid(
            op,
            format!("gate {} ({} {}x{}) and up {} ({} {}x{}) differ in type or shape", w.name, w.ty, w.rows, w.cols, up.name, up.ty, up.rows, up.cols),
        ));
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn product(
    device: &CudaDevice,
    op: &'static str,
    w: &GpuWeight,
    up: Option<&GpuWeight>,
    input: Input<'_>,
    out: &mut CudaSlice<f32>,
    n: usize,
    accumulate: bool,
) -> Result<(), CudaError> {
    if let Some(up) = up {
        check_pair(op, w, up)?;
    }
    if n == 0 {
        return Ok(());
    }
    check_len(op, "out", out.len(), n * w.rows)?;
    let matvec_input = match (input, &w.storage) {
        (Input::F32(x), _) => {
            check_len(op, "x", x.len(), n * w.cols)?;
            match &w.storage {
                _ if takes_matmat(w, n) => return launch_matmat(device, MatmatCall { op, w, up, x, n, accumulate }, out, None).map(drop),
                Storage::Quant { .. } => {
                    let shared = shared_input(device, w.cols)?;
                    let buffer = shared.lock().unwrap_or_else(PoisonError::into_inner);
                    buffer.fill(device, x, n)?;
                    return launch_matvec(device, MatvecCall { up, ..MatvecCall::plain(op, w, &buffer, n, accumulate) }, out).map(drop);
                }
                Storage::Float { .. } => input,
            }
        }
        (Input::Quantized(q), Storage::Quant { .. }) => {
            check_quantized_input(op, q, w, n)?;
            input
        }
        (Input::Quantized(_), Storage::Float { .. }) => {
            return Err(invalid(op, format!("{} is {}: float weights take f32 activations", w.name, w.ty)));
        }
    };
    let call = MatvecCall { op, w, up, input: matvec_input, n, accumulate, bias: 0, next: None, norm: None, act: Activation::Silu };
    launch_matvec(device, call, out).map(drop)
}

/// Whether `n` tokens of f32 activations times `w` take the mat-mat (tensor cores) rather
/// than the mat-vec.
fn takes_matmat(w: &GpuWeight, n: usize) -> bool {
    match w.storage {
        Storage::Quant { .. } => n > MAX_MATVEC_TOKENS,
        Storage::Float { .. } => n > MAX_MATVEC_TOKENS || w.cols % 4 != 0,
    }
}

/// `outs[i] = x . ws[i]` for products of one input (q, k and v): where they take the mat-mat,
/// the input is converted to f16 once for all whose shapes read it in the same layout.
/// `converted`: the f16 scratch already holds `x` in that layout ([`rms_norm_half`]).
pub fn matmul_shared_input(
    device: &CudaDevice,
    ws: &[&GpuWeight],
    x: &CudaSlice<f32>,
    outs: &mut [&mut CudaSlice<f32>],
    n: usize,
    mut converted: Option<HalfLayout>,
) -> Result<(), CudaError> {
    const OP: &str = "matmul_shared_input";
    if ws.len() != outs.len() {
        return Err(invalid(OP, format!("{} weights for {} outputs", ws.len(), outs.len())));
    }
    if let Some(w) = ws.iter().find(|w| w.cols != ws[0].cols) {
        return Err(invalid(OP, format!("{} takes {} inputs, {} takes {}", w.name, w.cols, ws[0].name, ws[0].cols)));
    }
    let mut start = 0;
    while start < ws.len() {
        let end = start + stacked::stackable_run(&ws[start..]);
        let (run, run_outs) = (&ws[start..end], &mut outs[start..end]);
        start = end;
        if n == 0 || !takes_matmat(run[0], n) {
            for (w, out) in run.iter().zip(run_outs.iter_mut()) {
                product(device, OP, w, None, Input::F32(x), out, n, false)?;
            }
            continue;
        }
        if run.len() > 1 {
            if let Some(half) = matmat_stacked::launch_stacked_matmat(device, run, x, run_outs, n, converted)? {
                converted = half;
                continue;
            }
        }
        for (w, out) in run.iter().zip(run_outs.iter_mut()) {
            check_len(OP, "out", out.len(), n * w.rows)?;
            check_len(OP, "x", x.len(), n * w.cols)?;
            converted = launch_matmat(device, MatmatCall { op: OP, w, up: None, x, n, accumulate: false }, out, converted)?;
        }
    }
    Ok(())
}

/// One mat-vec product's operands, all but the output.
#[derive(Clone, Copy)]
struct MatvecCall<'a> {
    op: &'static str,
    w: &'a GpuWeight,
    up: Option<&'a GpuWeight>,
    input: Input<'a>,
    n: usize,
    accumulate: bool,
    /// The device address of a bias added to every row's value (0: none).
    bias: u64,
    /// The output stored again as the next product's int8 input, where the launch shape allows
    /// ([`next_input_target`]): a SwiGLU's as it is, a residual product's (`norm`) times the
    /// norm weight, its RMS scale deferred to the products that read it.
    next: Option<ActivationTarget>,
    norm: Option<NormStore>,
    /// The gate's activation where `up` is given.
    act: Activation,
}

/// The device addresses a residual product needs to store the next product's normed input:
/// the norm weight, and where each block's sum of squares goes.
#[derive(Clone, Copy)]
struct NormStore {
    weight: u64,
    parts: u64,
}

/// Whether `n` tokens of `x` were quantized for `w`, as its product needs.
fn check_quantized_input(op: &'static str, x: &QuantizedActivations, w: &GpuWeight, n: usize) -> Result<(), CudaError> {
    let filled = x.filled_tokens.load(Ordering::Relaxed).min(MAX_MATVEC_TOKENS);
    if x.cols != w.cols || n > filled {
        return Err(invalid(op, format!("{n} tokens of {} quantized values for {} ({}x{}); {filled} tokens were quantized", x.cols, w.name, w.rows, w.cols)));
    }
    Ok(())
}

/// `call.next` where a quantized SwiGLU or residual (`call.norm`) launch of `shape` can store its
/// output as the next product's input too (matvec.cuh's quantize_block_rows, norm_block_rows):
/// its blocks hold whole 16-row chunks, none of their warps returns early, and the rows fill
/// whole tiles (no padding chunks) or, for a gated pair, the launch has one token.
fn next_input_target(call: &MatvecCall<'_>, shape: usize) -> Option<ActivationTarget> {
    call.next.filter(|_| stores_next(call, shape))
}

fn stores_next(call: &MatvecCall<'_>, shape: usize) -> bool {
    let rows = call.w.rows;
    let block_rows = MATVEC_SHAPES[shape].rows_per_block(call.kind()) as usize;
    // Past whole tiles a gated pair's one token still stores: the padding chunks after its
    // rows keep the zeros every quantization writes there (tokens after the first would sit
    // at another stride).
    let whole_tiles = rows % TILE_VALUES == 0 || (call.n == 1 && call.up.is_some());
    let fits = block_rows % CHUNK_VALUES == 0 && rows % block_rows == 0 && whole_tiles;
    let stores = call.up.is_some() || (call.norm.is_some() && call.accumulate);
    fits && stores && matches!(call.w.storage, Storage::Quant { .. })
}

impl<'a> MatvecCall<'a> {
    /// The product of one weight on int8 activations: no bias, nothing stored.
    fn plain(op: &'static str, w: &'a GpuWeight, x: &'a QuantizedActivations, n: usize, accumulate: bool) -> MatvecCall<'a> {
        MatvecCall { op, w, up: None, input: Input::Quantized(x), n, accumulate, bias: 0, next: None, norm: None, act: Activation::Silu }
    }

    /// A gated pair's product on int8 activations.
    fn gated(op: &'static str, pair: GatedPair<'a>, x: &'a QuantizedActivations, n: usize) -> MatvecCall<'a> {
        MatvecCall { up: Some(pair.up), act: pair.act, ..MatvecCall::plain(op, pair.gate, x, n, false) }
    }

    fn kind(&self) -> MatvecKind {
        if self.up.is_some() {
            MatvecKind::SwiGlu
        } else {
            MatvecKind::Plain
        }
    }
}

/// What a launch that moves no weights (a quantization of 16K values) costs in a replayed
/// decode graph, measured by leaving it out (docs/performance.md: 2.2-2.7 µs). A shape that
/// makes one unnecessary is measured as faster by this much.
const SAVED_LAUNCH_MS: f32 = 0.002;

/// The mat-vec with the launch shape measured for it (quantized weights) or the default.
/// Returns its blocks where it stored `call.next` (only where that shape allows).
fn launch_matvec(device: &CudaDevice, call: MatvecCall<'_>, out: &mut CudaSlice<f32>) -> Result<Option<u32>, CudaError> {
    let MatvecCall { w, n, .. } = call;
    let shape = match w.storage {
        Storage::Quant { .. } => {
            let mut scratch: Option<CudaSlice<f32>> = None;
            let kind = call.kind();
            let storing = call.next.is_some();
            let credit = |shape| if storing && stores_next(&call, shape) { SAVED_LAUNCH_MS } else { 0.0 };
            choose_shape(device, TuneKey::new(device, w, n, kind).storing(storing), w, credit, |shape| {
                let out = match &mut scratch {
                    Some(out) => out,
                    None => scratch.insert(device.alloc_zeros::<f32>(n * w.rows, "mat-vec tuning output")?),
                };
                launch_matvec_shape(device, MatvecCall { accumulate: false, next: None, ..call }, out, shape).map(drop)
            })?
        }
        Storage::Float { .. } => default_shape(n),
    };
    let next = next_input_target(&call, shape);
    let blocks = launch_matvec_shape(device, MatvecCall { next, ..call }, out, shape)?;
    Ok(next.map(|_| blocks))
}

/// One mat-vec launch with `shape` (index into [`MATVEC_SHAPES`]); returns its blocks.
fn launch_matvec_shape(device: &CudaDevice, call: MatvecCall<'_>, out: &mut CudaSlice<f32>, shape: usize) -> Result<u32, CudaError> {
    let MatvecCall { op, w, up, input, n, accumulate, bias, next, norm, act } = call;
    let swiglu = up.is_some();
    let kind = call.kind();
    let function = w.kernels.get(device, &w.storage, Kernel::Matvec { ntok: n, kind, shape })?;
    // One token of float weights takes a block per FV_ROW_ROWS rows, per row of a SwiGLU pair
    // (matvec_float_row).
    let (rows_per_block, warps) = match w.storage {
        Storage::Float { .. } if n == 1 => (if swiglu { 1 } else { FV_ROW_ROWS }, FV_ROW_WARPS),
        _ => (MATVEC_SHAPES[shape].rows_per_block(kind), MATVEC_SHAPES[shape].warps),
    };
    let (rows32, cols32, accumulate32) = (to_u32(op, "rows", w.rows)?, to_u32(op, "cols", w.cols)?, u32::from(accumulate));
    let blocks = rows32.div_ceil(rows_per_block);
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (warps * 32, 1, 1), shared_mem_bytes: 0 };
    let input_norm = match input {
        Input::Quantized(q) => q.input_norm_arg(device),
        Input::F32(_) => InputNormArg::default(),
    };
    let (next_codes, next_scales) = next.map_or((0u64, 0u64), |t| (t.codes, t.scales));
    let next_norm = match (next, norm) {
        (Some(t), Some(norm)) => NextNormArg { weight: norm.weight, codes: t.codes, scales: t.scales, parts: norm.parts },
        _ => NextNormArg::default(),
    };
    let gate = gate_code(act);
    let mut launch = device.stream().launch_builder(function);
    push_weight(&mut launch, &w.storage);
    if let Some(up) = up {
        push_weight(&mut launch, &up.storage);
    }
    match input {
        Input::Quantized(q) => launch.arg(&q.codes).arg(&q.scales).arg(&input_norm),
        Input::F32(x) => launch.arg(x).arg(&cols32),
    };
    launch.arg(out).arg(&rows32);
    match (swiglu, &w.storage) {
        (false, Storage::Quant { .. }) => launch.arg(&accumulate32).arg(&bias).arg(&next_norm),
        (false, Storage::Float { .. }) if bias == 0 => launch.arg(&accumulate32),
        (false, Storage::Float { .. }) => return Err(invalid(op, format!("a bias fused into the product of float weights ({})", w.name))),
        (true, Storage::Quant { .. }) => launch.arg(&next_codes).arg(&next_scales).arg(&gate.0).arg(&gate.1).arg(&gate.2),
        (true, Storage::Float { .. }) if act == Activation::Silu => &mut launch,
        (true, Storage::Float { .. }) => return Err(invalid(op, format!("the {act:?} gate of float weights ({}) in the product", w.name))),
    };
    // SAFETY: argument lists match matvec_* / matvec_swiglu_* of matvec_{legacy,kquant,float}.cu;
    // the weights cover rows x cols (same shape for gate and up, checked), the activations n
    // tokens of cols values (checked or quantized above) with their deferred norm's sums, and
    // out n * rows values (checked), a bias (or null) rows values (checked by its caller); a next
    // target (or null) holds n tokens of rows values, and its norm weight rows values and sums a
    // value per token and block (checked by its caller).
    unsafe { launch.launch(cfg) }.map_err(CudaError::driver(format!("launching the {n}-token mat-vec of {}", w.name)))?;
    Ok(blocks)
}

#[cfg(test)]
mod tests;
