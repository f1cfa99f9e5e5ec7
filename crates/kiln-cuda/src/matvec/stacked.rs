//! Several weights on one quantized input in one mat-vec launch (`matvec_stacked` in
//! kernels/matvec.cuh): attention's q, k and v. A launch has a fixed cost (start, ramp-up,
//! drain) that a small weight does not hide; a decode step of a 1-bit 8B model spends more
//! time in those than in reading its weights. Float weights of one kind take the same for one
//! token (`matvec_stacked_f16` and the like in kernels/matvec_float.cu).

use std::sync::atomic::Ordering;

use cudarc::driver::{CudaFunction, CudaSlice, DriverError, LaunchArgs, LaunchConfig, PushKernelArg};

use super::matvec_shape::{choose_shape, default_shape, MatvecKind, TuneKey, MATVEC_SHAPES};
use super::{
    bias_address, invalid, matmul_quantized, push_weight, to_u32, GpuWeight, Kernel, QuantizedActivations, Storage, FV_ROW_ROWS, FV_ROW_WARPS,
    MAX_MATVEC_TOKENS,
};
use crate::{CudaDevice, CudaError};

/// The most weights one launch takes (the kernel's parameters a, b, c).
pub(super) const MAX_STACKED: usize = 3;

const OP: &str = "matmul_stacked_quantized";

/// `outs[i] = x Wi^T + bias[i]` for `n` tokens of activations quantized once (as
/// [`matmul_quantized`] computes each), with each run of consecutive weights of one quantized
/// format and width in one launch. `biases`: one per weight (None: that product has none).
pub fn matmul_stacked_quantized(
    device: &CudaDevice,
    weights: &[&GpuWeight],
    biases: &[Option<&CudaSlice<f32>>],
    x: &QuantizedActivations,
    outs: &mut [&mut CudaSlice<f32>],
    n: usize,
) -> Result<(), CudaError> {
    if weights.len() != outs.len() || weights.len() != biases.len() {
        return Err(invalid(OP, format!("{} weights but {} outputs and {} biases", weights.len(), outs.len(), biases.len())));
    }
    let mut start = 0;
    while start < weights.len() {
        let end = start + stackable_run(&weights[start..]);
        if end - start == 1 {
            matmul_quantized(device, weights[start], x, biases[start], outs[start], n, false)?;
        } else {
            let mut bias = [0u64; MAX_STACKED];
            for ((address, w), b) in bias.iter_mut().zip(&weights[start..end]).zip(&biases[start..end]) {
                *address = bias_address(device, OP, w, *b)?;
            }
            let run = Stacked { weights: &weights[start..end], bias };
            launch_stacked(device, run, x, &mut outs[start..end], n)?;
        }
        start = end;
    }
    Ok(())
}

/// A run of weights for one stacked launch, with the device addresses of their biases (0: none).
#[derive(Clone, Copy)]
struct Stacked<'a> {
    weights: &'a [&'a GpuWeight],
    bias: [u64; MAX_STACKED],
}

/// `outs[i] = x Wi^T` for one token of f32 activations in one launch, when every weight is a
/// float of one kind and width; Ok(false), launching nothing, when they are not. With
/// `input_norm` = (scale, eps), of `rms_norm(x) * scale` instead (`scale`: `[cols]`; one weight
/// will do then), the norm applied as the product loads x.
pub fn matmul_stacked_float(
    device: &CudaDevice,
    weights: &[&GpuWeight],
    x: &CudaSlice<f32>,
    outs: &mut [&mut CudaSlice<f32>],
    n: usize,
    input_norm: Option<(&CudaSlice<f32>, f32)>,
) -> Result<bool, CudaError> {
    const OP: &str = "matmul_stacked_float";
    let Some(&first) = weights.first() else { return Ok(false) };
    let same = weights.iter().all(|w| w.ty == first.ty && w.cols == first.cols && matches!(w.storage, Storage::Float { .. }));
    let fewest = if input_norm.is_some() { 1 } else { 2 };
    if n != 1 || !same || weights.len() != outs.len() || !(fewest..=MAX_STACKED).contains(&weights.len()) || first.cols % 4 != 0 {
        return Ok(false);
    }
    if x.len() < first.cols {
        return Err(invalid(OP, format!("x holds {} values, {} ({}x{}) needs {}", x.len(), first.name, first.rows, first.cols, first.cols)));
    }
    if let Some((scale, _)) = input_norm {
        if scale.len() != first.cols {
            return Err(invalid(OP, format!("the input norm's weight holds {} values, {} has {} columns", scale.len(), first.name, first.cols)));
        }
    }
    let (scale, eps) = input_norm.map_or((0, 0.0f32), |(scale, eps)| (super::device_address(device, scale), eps));
    let mut rows = [0u32; MAX_STACKED];
    for ((r, w), out) in rows.iter_mut().zip(weights).zip(outs.iter()) {
        if out.len() < w.rows {
            return Err(invalid(OP, format!("the output of {} holds {} values, the call needs {}", w.name, out.len(), w.rows)));
        }
        *r = to_u32(OP, "rows", w.rows)?;
    }
    let function = first.kernels.get(device, &first.storage, Kernel::Matvec { ntok: 1, kind: MatvecKind::Stacked, shape: default_shape(1) })?;
    let blocks = rows.iter().map(|r| r.div_ceil(FV_ROW_ROWS)).sum();
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (FV_ROW_WARPS * 32, 1, 1), shared_mem_bytes: 0 };
    let cols = to_u32(OP, "cols", first.cols)?;
    // SAFETY: matvec_stacked_{f32,f16,bf16} (matvec_float.cu) take the weights, then (x, cols),
    // then the outputs and rows, then the input norm's weight (or null) and eps; the weights
    // share one float kind and width, x and the norm weight hold one token of that width and
    // each output its weight's rows (checked).
    unsafe {
        launch_stacked_kernel(
            device,
            function,
            cfg,
            weights,
            |launch| {
                launch.arg(x).arg(&cols);
            },
            outs,
            &rows,
            |launch| {
                launch.arg(&scale).arg(&eps);
            },
        )
    }
    .map_err(CudaError::driver(format!("launching the stacked float mat-vec of {}", first.name)))?;
    Ok(true)
}

/// How many of the first weights of `ws` go into one stacked launch (1: none stack).
pub(super) fn stackable_run(ws: &[&GpuWeight]) -> usize {
    let mut end = 1;
    while end < ws.len() && end < MAX_STACKED && stackable(ws[0], ws[end]) {
        end += 1;
    }
    end.min(ws.len())
}

pub(super) fn stackable(a: &GpuWeight, b: &GpuWeight) -> bool {
    a.ty == b.ty && a.cols == b.cols && matches!((&a.storage, &b.storage), (Storage::Quant { .. }, Storage::Quant { .. }))
}

fn launch_stacked(device: &CudaDevice, run: Stacked<'_>, x: &QuantizedActivations, outs: &mut [&mut CudaSlice<f32>], n: usize) -> Result<(), CudaError> {
    if n == 0 {
        return Ok(());
    }
    let weights = run.weights;
    let first = weights[0];
    let filled = x.filled_tokens.load(Ordering::Relaxed).min(MAX_MATVEC_TOKENS);
    if x.cols != first.cols || n > filled {
        return Err(invalid(
            OP,
            format!("{n} tokens of {} quantized values ({filled} filled) for {} ({} {}x{})", x.cols, first.name, first.ty, first.rows, first.cols),
        ));
    }
    for (w, out) in weights.iter().zip(outs.iter()) {
        if out.len() < n * w.rows {
            return Err(invalid(OP, format!("the output of {} holds {} values, the call needs {}", w.name, out.len(), n * w.rows)));
        }
    }
    let key = TuneKey::stacked(device, weights, n);
    let shape = choose_shape(device, key, first, |_| 0.0, |shape| launch_shape(device, run, x, outs, n, shape))?;
    launch_shape(device, run, x, outs, n, shape)
}

/// One launch with `shape` (index into [`MATVEC_SHAPES`]); 2 or 3 weights, checked by the caller.
fn launch_shape(
    device: &CudaDevice,
    run: Stacked<'_>,
    x: &QuantizedActivations,
    outs: &mut [&mut CudaSlice<f32>],
    n: usize,
    shape: usize,
) -> Result<(), CudaError> {
    let weights = run.weights;
    let first = weights[0];
    let function = first.kernels.get(device, &first.storage, Kernel::Matvec { ntok: n, kind: MatvecKind::Stacked, shape })?;
    let rows_per_block = MATVEC_SHAPES[shape].rows_per_block(MatvecKind::Stacked);
    let mut rows = [0u32; MAX_STACKED];
    for (r, w) in rows.iter_mut().zip(weights) {
        *r = to_u32(OP, "rows", w.rows)?;
    }
    let blocks: u32 = rows.iter().map(|r| r.div_ceil(rows_per_block)).sum();
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (MATVEC_SHAPES[shape].threads(), 1, 1), shared_mem_bytes: 0 };
    let input_norm = x.input_norm_arg(device);
    // SAFETY: matvec_stacked_* (MV_STACKED_PARAMS in matvec.cuh) take the weights, then the
    // quantized activations with their deferred norm, then the outputs and rows, then the
    // biases; the weights share one quantized format and width (`stackable`), the activations
    // hold n tokens of that width (checked), each output n times its weight's rows and each
    // bias (or null) its weight's rows (checked).
    unsafe {
        let bias = &run.bias;
        launch_stacked_kernel(
            device,
            function,
            cfg,
            weights,
            |launch| {
                launch.arg(&x.codes).arg(&x.scales).arg(&input_norm);
            },
            outs,
            &rows,
            |launch| {
                launch.arg(&bias[0]).arg(&bias[1]).arg(&bias[2]);
            },
        )
    }
    .map_err(CudaError::driver(format!("launching the {n}-token stacked mat-vec of {}", first.name)))
}

/// Launches a stacked kernel with its arguments: three weights (the last repeated when there
/// are two), the input `push_input` adds, the outputs (a null third when there are two: it has
/// no rows, so no block reads its weight or writes it), the three row counts and what
/// `push_tail` adds.
///
/// # Safety
/// `function` must take exactly those parameters, and each output must hold what its weight's
/// rows make for the launch's tokens.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn launch_stacked_kernel<'a>(
    device: &'a CudaDevice,
    function: &'a CudaFunction,
    cfg: LaunchConfig,
    weights: &'a [&GpuWeight],
    push_input: impl FnOnce(&mut LaunchArgs<'a>),
    outs: &'a mut [&mut CudaSlice<f32>],
    rows: &'a [u32; MAX_STACKED],
    push_tail: impl FnOnce(&mut LaunchArgs<'a>),
) -> Result<(), DriverError> {
    let mut launch = device.stream().launch_builder(function);
    for i in 0..MAX_STACKED {
        push_weight(&mut launch, &weights[i.min(weights.len() - 1)].storage);
    }
    push_input(&mut launch);
    for out in outs.iter_mut() {
        launch.arg(&mut **out);
    }
    static NO_OUTPUT: u64 = 0;
    for _ in weights.len()..MAX_STACKED {
        launch.arg(&NO_OUTPUT);
    }
    launch.arg(&rows[0]).arg(&rows[1]).arg(&rows[2]);
    push_tail(&mut launch);
    launch.launch(cfg).map(drop)
}
