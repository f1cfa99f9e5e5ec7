//! Several weights on one input in one tensor-core mat-mat launch (`matmat_stacked_*` in
//! kernels/matmat_mma.cu): attention's q, k and v for decode batches and prompts. At 32
//! tokens of an 8B model the three products took 37 us in three launches for 14 MB of weights,
//! most of it each launch's fixed cost (ramp-up, the last wave, the split-K reduction).

use std::sync::PoisonError;

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::matmat::{
    candidates, device_key, fastest, is_capturing, scratch, stacked_tune_key, stage_input, Choice, HalfLayout, Launched, MatmatCall, Staged, MMA_TILES, TUNED,
};
use super::stacked::{launch_stacked_kernel, MAX_STACKED};
use super::{invalid, stride_launch, to_u32, GpuWeight, Kernel, MMA_THREADS};
use crate::{CudaDevice, CudaError};

const OP: &str = "matmul_stacked_matmat";

/// `outs[i] = x . ws[i]` for 2 or 3 weights of one quantized format and width in one launch
/// (`converted` as for `launch_matmat`). None, launching nothing, where no measured choice
/// exists inside a capture or the scratch would have to grow there: the caller runs the
/// products one by one. Else what the f16 scratch holds afterwards.
pub(super) fn launch_stacked_matmat(
    device: &CudaDevice,
    ws: &[&GpuWeight],
    x: &CudaSlice<f32>,
    outs: &mut [&mut CudaSlice<f32>],
    n: usize,
    converted: Option<HalfLayout>,
) -> Result<Option<Option<HalfLayout>>, CudaError> {
    if !(2..=MAX_STACKED).contains(&ws.len()) || ws.len() != outs.len() {
        return Err(invalid(OP, format!("{} weights for {} outputs (2 or 3 stack)", ws.len(), outs.len())));
    }
    let capturing = is_capturing(device);
    let key = stacked_tune_key(device, ws, n);
    let remembered = TUNED.get(device, &key);
    let (choice, converted) = match remembered {
        Some(choice) => (choice, converted),
        None if capturing => return Ok(None),
        None => {
            let rows = ws.iter().map(|w| w.rows).sum();
            let candidates = candidates(device, ws[0], rows, n, false, true);
            let mut scratch_outs = ws.iter().map(|w| device.alloc_zeros::<f32>(n * w.rows, "stacked mat-mat tuning output")).collect::<Result<Vec<_>, _>>()?;
            let mut refs: Vec<&mut CudaSlice<f32>> = scratch_outs.iter_mut().collect();
            let choice =
                fastest(device, "stacked mat-mat shapes", &candidates, |choice| launch_choice(device, ws, x, &mut refs, n, choice, false, None).map(drop))?;
            TUNED.insert(device, key, choice);
            // The candidates converted the input in their own layouts.
            (choice, None)
        }
    };
    match launch_choice(device, ws, x, outs, n, choice, capturing, converted)? {
        Launched::Yes { half } => Ok(Some(half)),
        Launched::NeedsScratch => Ok(None),
    }
}

/// One stacked launch with `choice` (a pipelined shape), then the split-K reduction.
#[allow(clippy::too_many_arguments)]
fn launch_choice(
    device: &CudaDevice,
    ws: &[&GpuWeight],
    x: &CudaSlice<f32>,
    outs: &mut [&mut CudaSlice<f32>],
    n: usize,
    choice: Choice,
    capturing: bool,
    converted: Option<HalfLayout>,
) -> Result<Launched, CudaError> {
    let first = ws[0];
    let t = MMA_TILES[choice.tile];
    if !t.pipelined() {
        return Err(invalid(OP, format!("tile {} is not a pipelined shape", choice.tile)));
    }
    let mut rows = [0u32; MAX_STACKED];
    for ((r, w), out) in rows.iter_mut().zip(ws).zip(outs.iter()) {
        if w.ty != first.ty || w.cols != first.cols {
            return Err(invalid(OP, format!("{} ({} x{}) does not stack with {} ({} x{})", w.name, w.ty, w.cols, first.name, first.ty, first.cols)));
        }
        if out.len() < n * w.rows {
            return Err(invalid(OP, format!("the output of {} holds {} values, the call needs {}", w.name, out.len(), n * w.rows)));
        }
        *r = to_u32(OP, "rows", w.rows)?;
    }
    if x.len() < n * first.cols {
        return Err(invalid(OP, format!("x holds {} values, {n} tokens of {} need {}", x.len(), first.cols, n * first.cols)));
    }
    let total_rows: usize = ws.iter().map(|w| w.rows).sum();
    let row_blocks: usize = ws.iter().map(|w| w.rows.div_ceil(t.slots as usize)).sum();
    let token_blocks = n.div_ceil(t.tokens as usize);
    if row_blocks > 65_535 {
        return Err(invalid(OP, format!("{total_rows} rows exceed one launch's 65535 blocks of {}", t.slots)));
    }
    let splits = choice.splits.max(1);
    let partial_len = if splits > 1 { splits * n * total_rows } else { 1 };
    let mut map = scratch().lock().unwrap_or_else(PoisonError::into_inner);
    let s = map.entry(device_key(device)).or_default();
    let call = MatmatCall { op: OP, w: first, up: None, x, n, accumulate: false };
    let Some(Staged { half, partials, layout, ld }) = stage_input(device, s, call, choice.tile, partial_len, capturing, converted)? else {
        return Ok(Launched::NeedsScratch);
    };
    let (ld32, n32, splits32) = (to_u32(OP, "padded cols", ld)?, to_u32(OP, "n", n)?, to_u32(OP, "splits", splits)?);
    let failed = |what: &str| CudaError::driver(format!("launching the {n}-token stacked {what} of {}", first.name));
    let function = first.kernels.get(device, &first.storage, Kernel::MatmatStacked { tile: choice.tile })?;
    let cfg = LaunchConfig {
        grid_dim: (to_u32(OP, "token blocks", token_blocks)?, row_blocks as u32, splits32),
        block_dim: (MMA_THREADS, 1, 1),
        shared_mem_bytes: t.shared_bytes(),
    };
    // SAFETY: matmat_stacked_* (MM_STACKED_ARGS in matmat_mma.cu) take the three weights, then
    // (x, ld, n, partials), then the outputs and rows; the weights share one quantized format and
    // width (checked), half holds n * ld f16 values (staged), each output n times its weight's
    // rows (checked) and partials splits * n * all rows when splits > 1; shared_bytes is what the
    // body lays out (the function's limit was raised to it when looked up).
    unsafe {
        launch_stacked_kernel(
            device,
            function,
            cfg,
            ws,
            |launch| {
                launch.arg(half).arg(&ld32).arg(&n32).arg(partials);
            },
            outs,
            &rows,
            |_| {},
        )
    }
    .map_err(failed("mat-mat"))?;
    if splits > 1 {
        let reduce = first.kernels.get(device, &first.storage, Kernel::MatmatReduceStacked { tile: choice.tile })?;
        let mut launch = device.stream().launch_builder(reduce);
        launch.arg(partials).arg(&splits32).arg(&n32);
        for out in outs.iter_mut() {
            launch.arg(&mut **out);
        }
        static NO_OUTPUT: u64 = 0;
        if ws.len() < MAX_STACKED {
            launch.arg(&NO_OUTPUT);
        }
        launch.arg(&rows[0]).arg(&rows[1]).arg(&rows[2]);
        // SAFETY: matches mma_reduce_stacked; partials hold the launch above's splits * n * rows
        // sums of each weight, one region after another, and each output n * its rows (a null
        // third output has no rows, so nothing writes it).
        unsafe { launch.launch(stride_launch(n * total_rows)) }.map_err(failed("split-K reduction"))?;
    }
    Ok(Launched::Yes { half: Some(layout) })
}
