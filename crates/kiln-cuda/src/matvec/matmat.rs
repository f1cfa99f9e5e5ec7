//! Dispatch of the tensor-core mat-mat (kernels/matmat_mma.cu): its block shapes, the choice
//! of shape per product by measurement, and the scratch buffers the pipelined shapes share.
//!
//! Autotuning: the first uncaptured product for a (device, rows, cols, format, SwiGLU,
//! accumulate, token bucket) key times every candidate (each shape, and the split-K shapes
//! also with their heuristic split count) with CUDA events on the real weight and input, the
//! L2 flushed before each of two timed runs, into a throw-away output; the fastest is kept for
//! the process and on disk (tuning.rs) and the product is then computed with it. Inside a CUDA
//! graph capture nothing is timed: the remembered choice is used, else the measured static rule
//! [`choose_tile`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::sys::{CUevent_flags, CUstreamCaptureStatus};
use cudarc::driver::{CudaFunction, CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits};

use super::kernels::prepare_kernels;
use super::{check_len, check_pair, invalid, push_weight, stride_launch, to_u32, GpuWeight, Kernel, Storage, CHUNK_VALUES, MMA_THREADS};
use crate::tuning::{Tunable, TuningTable};
use crate::{CudaDevice, CudaError};

/// One block shape of the mat-mat, passed as MMA_BM / MMA_BN / MMA_WN (and for the pipelined
/// body MMA_BK / MMA_XS / MMA_PIPE): `slots` weight rows (the fused SwiGLU: half as many
/// gate/up pairs) by `tokens` tokens, with `token_warps` of the 8 warps along the tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct MmaTile {
    pub(super) slots: u32,
    pub(super) tokens: u32,
    token_warps: u32,
    /// Pipelined body (mma_pipe.cuh): values of depth per step; 0 is the original body.
    depth: u32,
    /// Pipelined body: shared stages of activations.
    x_stages: u32,
    /// May split the depth over several blocks (gridDim.z).
    split: bool,
    /// Resident blocks per multiprocessor the registers are budgeted for (MMA_MIN_BLOCKS).
    min_blocks: u32,
    /// Streaming body (mma_stream.cuh): weights straight from registers into the MMAs.
    stream: bool,
}

const fn tile(slots: u32, tokens: u32, token_warps: u32) -> MmaTile {
    MmaTile { slots, tokens, token_warps, depth: 0, x_stages: 0, split: false, min_blocks: 2, stream: false }
}

const fn pipe(slots: u32, tokens: u32, token_warps: u32, depth: u32, x_stages: u32, split: bool) -> MmaTile {
    MmaTile { slots, tokens, token_warps, depth, x_stages, split, min_blocks: 2, stream: false }
}

/// A pipelined split-K shape for small batches (two activation stages) with registers for
/// `min_blocks` blocks per multiprocessor.
const fn small(slots: u32, tokens: u32, token_warps: u32, depth: u32, min_blocks: u32) -> MmaTile {
    MmaTile { slots, tokens, token_warps, depth, x_stages: 2, split: true, min_blocks, stream: false }
}

/// A streaming split-K shape (mma_stream.cuh) for up to 64 tokens.
const fn stream(slots: u32, tokens: u32, token_warps: u32, depth: u32, x_stages: u32, min_blocks: u32) -> MmaTile {
    MmaTile { slots, tokens, token_warps, depth, x_stages, split: true, min_blocks, stream: true }
}

/// Each has a `// kiln-test-defines:` line in matmat_mma.cu. 0..3: the original body, from the
/// most work per block to the least; 4..: pipelined (predictions in matmat_mma.cu), 9: tile 6
/// with registers for three resident blocks (at n = 64 on the 8B shapes 3-10% faster; 64x32 and
/// 32x32 shapes with four blocks were slower, measured); 10..: streaming, 64 tokens with one
/// warp along them get registers for one block; 15: tile 10 with two chunk pairs a thread a step
/// in registers for one block (at 32 tokens on the 8B FFN shapes 7-13% faster than tile 10:
/// twice the weight bytes in flight a warp beats twice the warps; the same at 16 and 64 tokens,
/// three activation stages, and 64 rows with four depth warps were no faster, measured).
pub(super) const MMA_TILES: [MmaTile; 16] = [
    tile(128, 128, 2),
    tile(128, 64, 2),
    tile(64, 64, 2),
    tile(32, 32, 1),
    pipe(128, 128, 2, 64, 3, false),
    pipe(128, 64, 2, 64, 3, false),
    pipe(64, 64, 2, 128, 2, true),
    pipe(64, 32, 1, 256, 2, true),
    pipe(128, 32, 1, 128, 2, true),
    small(64, 64, 2, 128, 3),
    stream(128, 32, 1, 256, 2, 2),
    stream(128, 64, 1, 256, 2, 1),
    stream(256, 32, 1, 128, 3, 2),
    stream(128, 16, 1, 256, 2, 2),
    stream(256, 64, 1, 128, 2, 1),
    stream(128, 32, 1, 512, 2, 1),
];

/// Mat-mat block shapes the kernels are built for (see [`matmul_with_tile`]).
pub const MATMAT_TILES: usize = MMA_TILES.len();

/// Most depth splits of one product.
const MAX_SPLITS: usize = 16;
/// Fewest steps of depth per split.
const MIN_SPLIT_STEPS: usize = 2;
/// Depth splits the tuner times for each split-K shape (besides the heuristic's own).
const TIMED_SPLITS: [usize; 7] = [2, 3, 4, 6, 8, 12, MAX_SPLITS];

impl MmaTile {
    pub(super) fn defines(self) -> Vec<(&'static str, i64)> {
        let mut defines = vec![("MMA_BM", i64::from(self.slots)), ("MMA_BN", i64::from(self.tokens)), ("MMA_WN", i64::from(self.token_warps))];
        if self.pipelined() {
            defines.extend([("MMA_BK", i64::from(self.depth)), ("MMA_XS", i64::from(self.x_stages)), ("MMA_PIPE", if self.stream { 2 } else { 1 })]);
        }
        if self.min_blocks != 2 {
            defines.push(("MMA_MIN_BLOCKS", i64::from(self.min_blocks)));
        }
        defines
    }

    pub(super) fn pipelined(self) -> bool {
        self.depth > 0
    }

    pub(super) fn is_streaming(self) -> bool {
        self.stream
    }

    /// Dynamic shared memory of the pipelined and streaming bodies: max(MMA_W_BYTES (none when
    /// streaming) + MMA_X_BYTES, the depth-split reduction) of mma_pipe.cuh / mma_stream.cuh;
    /// 0 for the original body (static).
    pub(super) fn shared_bytes(self) -> u32 {
        if !self.pipelined() {
            return 0;
        }
        let row = (self.depth + 8) * 2;
        let weights = if self.stream { 0 } else { 2 * self.slots * row };
        let activations = self.x_stages * self.tokens * row;
        let depth_warps = 8 / (self.slots / 32 * self.token_warps);
        (weights + activations).max((depth_warps - 1) * self.slots * self.tokens * 4)
    }

    /// (row blocks, token blocks).
    fn grid(self, rows: usize, n: usize, swiglu: bool) -> (usize, usize) {
        let rows_per_block = self.slots as usize / if swiglu { 2 } else { 1 };
        (rows.div_ceil(rows_per_block), n.div_ceil(self.tokens as usize))
    }

    /// Steps of depth over a row of `chunks` 16-value chunks.
    fn steps(self, chunks: usize) -> usize {
        let depth = if self.pipelined() { self.depth } else { MMA_THREADS * CHUNK_VALUES as u32 / self.slots };
        chunks.div_ceil(depth as usize / CHUNK_VALUES)
    }

    /// Depth splits: enough blocks for two per multiprocessor, at least MIN_SPLIT_STEPS steps
    /// each, and no split left empty.
    fn auto_splits(self, blocks: usize, steps: usize, multiprocessors: usize) -> usize {
        if !self.split {
            return 1;
        }
        let wanted = (2 * multiprocessors).div_ceil(blocks.max(1)).clamp(1, MAX_SPLITS).min((steps / MIN_SPLIT_STEPS).max(1));
        steps.div_ceil(steps.div_ceil(wanted))
    }
}

/// The static choice (original body only, so that it never needs the scratch buffers inside a
/// capture): the largest tile whose token tile is not mostly padding and whose grid fills the
/// GPU, else the smallest. "Fills": one block per multiprocessor for 128x128 (measured on the
/// H200: at n = 512 and 4096 rows its 128 blocks beat 256 of 128x64), 1.5 for the others (at
/// n = 64: 64x64 for 14336 rows, 32x32 for 4096, as measured).
pub(super) fn choose_tile(rows: usize, n: usize, swiglu: bool, multiprocessors: usize) -> usize {
    let classic = MMA_TILES.iter().take_while(|tile| !tile.pipelined()).count();
    MMA_TILES[..classic]
        .iter()
        .position(|tile| {
            let (x, y) = tile.grid(rows, n, swiglu);
            let wanted = if tile.slots * tile.tokens >= 128 * 128 { multiprocessors - multiprocessors / 16 } else { multiprocessors + multiprocessors / 2 };
            2 * n > tile.tokens as usize && x * y >= wanted
        })
        .unwrap_or(classic - 1)
}

/// A shape and its depth splits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Choice {
    pub tile: usize,
    pub splits: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct TuneKey {
    device: usize,
    /// The weight's rows; a stacked launch's rows all together.
    rows: usize,
    cols: usize,
    ty: u32,
    swiglu: bool,
    accumulate: bool,
    /// Several weights in one launch (matmat_stacked.rs).
    stacked: bool,
    bucket: u8,
}

/// Token-count buckets that share a measured choice.
fn bucket(n: usize) -> u8 {
    match n {
        ..=16 => 0,
        17..=32 => 1,
        33..=64 => 2,
        65..=128 => 3,
        129..=256 => 4,
        _ => 5,
    }
}

/// Measured choices, shared by every backend on the GPU (so they sum in the same order).
pub(super) static TUNED: TuningTable<TuneKey, Choice> =
    TuningTable::new("mat-mat shapes", |c| c.tile < MMA_TILES.len() && (1..=MAX_SPLITS).contains(&c.splits));

impl Tunable for Choice {
    fn to_words(self) -> Vec<u64> {
        vec![self.tile as u64, self.splits as u64]
    }

    fn from_words(words: &[u64]) -> Option<Self> {
        match *words {
            [tile, splits] => Some(Choice { tile: usize::try_from(tile).ok()?, splits: usize::try_from(splits).ok()? }),
            _ => None,
        }
    }
}

/// Buffers of the pipelined shapes, one set per stream (every launch of a device goes to its
/// one stream, so products use them one after the other). A grown buffer's predecessor is kept:
/// a captured graph may still point at it.
#[derive(Default)]
pub(super) struct Scratch {
    half: Option<CudaSlice<u16>>,
    partials: Option<CudaSlice<f32>>,
    retired_half: Vec<CudaSlice<u16>>,
    retired_partials: Vec<CudaSlice<f32>>,
    /// Written before each timed run of the autotuner to evict the weight from L2.
    flush: Option<CudaSlice<u8>>,
    /// norm.cu's rms_norm_half_f32, looked up on first use.
    norm_half: Option<CudaFunction>,
}

pub(super) fn scratch() -> &'static Mutex<HashMap<usize, Scratch>> {
    static SCRATCH: OnceLock<Mutex<HashMap<usize, Scratch>>> = OnceLock::new();
    SCRATCH.get_or_init(Default::default)
}

/// Scratch buffers belong to one stream.
pub(super) fn device_key(device: &CudaDevice) -> usize {
    Arc::as_ptr(device.stream()) as usize
}

/// Measured launch choices hold for the GPU, so every backend opened on it shares them (and
/// computes with the same summation order).
pub(super) fn gpu_key(device: &CudaDevice) -> usize {
    device.context().ordinal()
}

/// Grows `slot` to `len` values (to the next power of two), except inside a capture: false then.
pub(super) fn ensure<T: DeviceRepr + ValidAsZeroBits>(
    device: &CudaDevice,
    slot: &mut Option<CudaSlice<T>>,
    retired: &mut Vec<CudaSlice<T>>,
    len: usize,
    capturing: bool,
    what: &str,
) -> Result<bool, CudaError> {
    if slot.as_ref().is_some_and(|s| s.len() >= len) {
        return Ok(true);
    }
    if capturing {
        return Ok(false);
    }
    let grown = device.alloc_zeros::<T>(len.next_power_of_two(), what)?;
    retired.extend(slot.replace(grown));
    Ok(true)
}

pub(super) fn is_capturing(device: &CudaDevice) -> bool {
    device.stream().capture_status().is_ok_and(|status| status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

pub(super) fn chunks_per_row(storage: &Storage) -> usize {
    match storage {
        Storage::Quant { planes, .. } => planes.tiles as usize * 32,
        Storage::Float { rows, .. } => rows.stride as usize / CHUNK_VALUES,
    }
}

/// The tensor-core mat-mat with block shape `tile` (< [`MATMAT_TILES`]) whatever `n` is, for
/// tests and benchmarks of every shape; `up` makes it the fused SwiGLU. Split shapes use their
/// heuristic split count. [`matmul`](super::matmul) and friends pick the shape themselves.
#[allow(clippy::too_many_arguments)]
pub fn matmul_with_tile(
    device: &CudaDevice,
    w: &GpuWeight,
    up: Option<&GpuWeight>,
    x: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    n: usize,
    accumulate: bool,
    tile: usize,
) -> Result<(), CudaError> {
    const OP: &str = "matmul_with_tile";
    if tile >= MATMAT_TILES {
        return Err(invalid(OP, format!("tile {tile} of {MATMAT_TILES}")));
    }
    if let Some(up) = up {
        check_pair(OP, w, up)?;
    }
    if n == 0 {
        return Ok(());
    }
    check_len(OP, "out", out.len(), n * w.rows)?;
    check_len(OP, "x", x.len(), n * w.cols)?;
    let choice = Choice { tile, splits: default_splits(device, w, n, up.is_some(), tile) };
    let call = MatmatCall { op: OP, w, up, x, n, accumulate };
    match launch_choice(device, call, out, choice, is_capturing(device), None)? {
        Launched::Yes { .. } => Ok(()),
        Launched::NeedsScratch => Err(invalid(OP, format!("tile {tile} needs its scratch buffers grown, which a graph capture forbids"))),
    }
}

fn default_splits(device: &CudaDevice, w: &GpuWeight, n: usize, swiglu: bool, tile: usize) -> usize {
    let t = MMA_TILES[tile];
    let (x, y) = t.grid(w.rows, n, swiglu);
    t.auto_splits(x * y, t.steps(chunks_per_row(&w.storage)), device.info().multiprocessor_count as usize)
}

/// Whether mat-mat tile `tile` is a streaming one (kernels/mma_stream.cuh), whose Q4_K decode
/// rounds each sub-block's scale and offset to f16 before applying them.
pub fn matmat_tile_is_streaming(tile: usize) -> bool {
    MMA_TILES.get(tile).is_some_and(|t| t.stream)
}

/// The mat-mat block shape `matmul` uses for `n` tokens of `w` (index into the tiles of
/// [`matmul_with_tile`]): the measured one once a product of this bucket ran, else the static
/// rule.
pub fn matmat_tile(device: &CudaDevice, w: &GpuWeight, n: usize, swiglu: bool) -> usize {
    let key = tune_key(device, w, n, swiglu, false);
    match TUNED.get(device, &key) {
        Some(choice) => choice.tile,
        None => choose_tile(w.rows, n, swiglu, device.info().multiprocessor_count as usize),
    }
}

fn tune_key(device: &CudaDevice, w: &GpuWeight, n: usize, swiglu: bool, accumulate: bool) -> TuneKey {
    TuneKey { device: gpu_key(device), rows: w.rows, cols: w.cols, ty: w.ty.id(), swiglu, accumulate, stacked: false, bucket: bucket(n) }
}

/// The key of one launch over the stacked weights `ws` (one format and width).
pub(super) fn stacked_tune_key(device: &CudaDevice, ws: &[&GpuWeight], n: usize) -> TuneKey {
    let rows = ws.iter().map(|w| w.rows).sum();
    TuneKey { rows, stacked: true, ..tune_key(device, ws[0], n, false, false) }
}

/// One mat-mat product's operands, all but the output.
#[derive(Clone, Copy)]
pub(super) struct MatmatCall<'a> {
    pub op: &'static str,
    pub w: &'a GpuWeight,
    /// The up weight of the fused SwiGLU.
    pub up: Option<&'a GpuWeight>,
    pub x: &'a CudaSlice<f32>,
    pub n: usize,
    pub accumulate: bool,
}

/// How the shared f16 scratch holds a product's input: mma_half_activations permutes each 8
/// values for the streaming tiles of Q4_K and Q6_K (their f16 decode yields values in that
/// order), and leaves them in order for every other pipelined tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HalfLayout {
    InOrder,
    Permuted,
}

impl HalfLayout {
    fn of(w: &GpuWeight, t: MmaTile) -> HalfLayout {
        // GGML type ids of Q4_K and Q6_K: the MMA_TYPE values mma_stream.cuh permutes for.
        if t.stream && matches!(w.ty.id(), 12 | 14) {
            HalfLayout::Permuted
        } else {
            HalfLayout::InOrder
        }
    }
}

/// What a launch did.
pub(super) enum Launched {
    /// The product is enqueued; `half` is what the f16 scratch holds afterwards (the input in
    /// that layout; None: not known to hold it).
    Yes { half: Option<HalfLayout> },
    /// Nothing launched: a pipelined shape would need its scratch grown inside a capture.
    NeedsScratch,
}

/// `matmul`'s mat-mat path (`n` > 8): the remembered shape, else (uncaptured) measure them all.
/// `converted`: the f16 scratch already holds `call.x` in that layout (an earlier product on
/// the same input, with nothing launched on the stream between), so the conversion is skipped
/// where this product's shape reads the same layout. Returns what the scratch holds afterwards.
pub(super) fn launch_matmat(
    device: &CudaDevice,
    call: MatmatCall<'_>,
    out: &mut CudaSlice<f32>,
    converted: Option<HalfLayout>,
) -> Result<Option<HalfLayout>, CudaError> {
    let MatmatCall { w, up, n, accumulate, .. } = call;
    let swiglu = up.is_some();
    let capturing = is_capturing(device);
    let key = tune_key(device, w, n, swiglu, accumulate);
    let remembered = TUNED.get(device, &key);
    let static_choice = || Choice { tile: choose_tile(w.rows, n, swiglu, device.info().multiprocessor_count as usize), splits: 1 };
    let (choice, converted) = match remembered {
        Some(choice) => (choice, converted),
        None if capturing => (static_choice(), converted),
        None => {
            let choice = tune(device, call)?;
            TUNED.insert(device, key, choice);
            // The candidates converted the input in their own layouts.
            (choice, None)
        }
    };
    if let Launched::Yes { half } = launch_choice(device, call, out, choice, capturing, converted)? {
        return Ok(half);
    }
    // A pipelined choice whose scratch is too small inside a capture: the static shape.
    match launch_choice(device, call, out, static_choice(), capturing, converted)? {
        Launched::Yes { half } => Ok(half),
        Launched::NeedsScratch => Err(invalid(call.op, "the static mat-mat shape needs scratch grown inside a capture".to_string())),
    }
}

/// An RMSNorm whose output feeds mat-mat products: `h = x / sqrt(mean(x²) + eps) * weight`
/// over `n` rows of `dim` values.
pub(crate) struct NormCall<'a> {
    pub x: &'a CudaSlice<f32>,
    pub weight: &'a CudaSlice<f32>,
    pub eps: f32,
    pub h: &'a mut CudaSlice<f32>,
    pub n: usize,
    pub dim: usize,
}

/// The norm (bit for bit the backend's `rms_norm`) that also writes `h` in f16 into the mat-mat
/// scratch, in the layout that the remembered shape of the first product of `products` reads
/// (the stacked launch of their leading run where they stack, as `matmul_shared_input` runs
/// them; `swiglu`: the one product of the first with its up weight), so that product skips its
/// conversion: pass the returned layout to it as `converted`. None, with nothing launched,
/// where that product does not take a measured pipelined shape for `n` tokens (or its scratch
/// would have to grow inside a capture): the caller norms as usual.
pub(crate) fn rms_norm_half(device: &CudaDevice, norm: NormCall<'_>, products: &[&GpuWeight], swiglu: bool) -> Result<Option<HalfLayout>, CudaError> {
    const OP: &str = "rms_norm_half";
    let NormCall { x, weight, eps, h, n, dim } = norm;
    let Some(&first) = products.first() else {
        return Ok(None);
    };
    if n == 0 || first.cols != dim {
        return Ok(None);
    }
    let run = if swiglu { 1 } else { super::stacked::stackable_run(products) };
    let key = if run > 1 { stacked_tune_key(device, &products[..run], n) } else { tune_key(device, first, n, swiglu, false) };
    let Some(choice) = TUNED.get(device, &key) else {
        return Ok(None);
    };
    let t = MMA_TILES[choice.tile];
    if !t.pipelined() {
        return Ok(None);
    }
    check_len(OP, "x", x.len(), n * dim)?;
    check_len(OP, "h", h.len(), n * dim)?;
    check_len(OP, "norm weight", weight.len(), dim)?;
    let ld = dim.next_multiple_of(8);
    let mut map = scratch().lock().unwrap_or_else(PoisonError::into_inner);
    let s = map.entry(device_key(device)).or_default();
    if !ensure(device, &mut s.half, &mut s.retired_half, n * ld, is_capturing(device), "f16 mat-mat activations")? {
        return Ok(None);
    }
    if s.norm_half.is_none() {
        s.norm_half = Some(device.registry().function("norm", "rms_norm_half_f32", &[])?);
    }
    let (half, function) = (s.half.as_ref().expect("ensured"), s.norm_half.as_ref().expect("looked up"));
    let layout = HalfLayout::of(first, t);
    let (dim32, ld32, permuted) = (to_u32(OP, "dim", dim)?, to_u32(OP, "padded dim", ld)?, u32::from(layout == HalfLayout::Permuted));
    let cfg = LaunchConfig { grid_dim: (to_u32(OP, "rows", n)?, 1, 1), block_dim: (MMA_THREADS, 1, 1), shared_mem_bytes: 0 };
    let mut launch = device.stream().launch_builder(function);
    launch.arg(h).arg(half).arg(x).arg(weight).arg(&dim32).arg(&ld32).arg(&eps).arg(&permuted);
    // SAFETY: matches norm.cu's rms_norm_half_f32 (NORM_BLOCK = MMA_THREADS = 256 threads); x and
    // h hold n * dim values, weight dim (checked), half n * ld (ensured); h and x are distinct
    // buffers (one borrowed mutably, one shared).
    unsafe { launch.launch(cfg) }.map_err(CudaError::driver("launching rms_norm_half_f32"))?;
    Ok(Some(layout))
}

/// The shapes (and split counts) worth timing for `rows` rows of `w`'s format and width at `n`
/// tokens; `pipelined_only` leaves out the original body.
pub(super) fn candidates(device: &CudaDevice, w: &GpuWeight, rows: usize, n: usize, swiglu: bool, pipelined_only: bool) -> Vec<Choice> {
    let sms = device.info().multiprocessor_count as usize;
    let steps = |t: MmaTile| t.steps(chunks_per_row(&w.storage));
    let mut candidates = Vec::new();
    for (tile, t) in MMA_TILES.iter().enumerate() {
        let (x_blocks, y_blocks) = t.grid(rows, n, swiglu);
        // Streaming shapes are for decode batches; past 128 tokens they are never the fastest.
        if (if t.pipelined() { x_blocks } else { y_blocks }) > 65_535 || (t.stream && n > 128) || (pipelined_only && !t.pipelined()) {
            continue;
        }
        candidates.push(Choice { tile, splits: 1 });
        if t.split {
            // Split counts that leave a partial last wave of blocks lose most of a round, so
            // several are timed, not only the heuristic's.
            let auto = t.auto_splits(x_blocks * y_blocks, steps(*t), sms);
            let mut counts: Vec<usize> = TIMED_SPLITS.iter().copied().filter(|&s| steps(*t) / s >= MIN_SPLIT_STEPS).chain([auto]).collect();
            counts.sort_unstable();
            counts.dedup();
            candidates.extend(counts.into_iter().filter(|&s| s > 1).map(|splits| Choice { tile, splits }));
        }
    }
    candidates
}

/// Times every candidate on `w` and `x` (outputs into a scratch buffer) and returns the fastest.
fn tune(device: &CudaDevice, call: MatmatCall<'_>) -> Result<Choice, CudaError> {
    let candidates = candidates(device, call.w, call.w.rows, call.n, call.up.is_some(), false);
    prepare_kernels(device, call.w, candidates.iter().map(|c| Kernel::Matmat { tile: c.tile, swiglu: false }))?;
    let mut out = device.alloc_zeros::<f32>(call.n * call.w.rows, "mat-mat tuning output")?;
    let choice = fastest(device, "mat-mat shapes", &candidates, |choice| launch_choice(device, call, &mut out, choice, false, None).map(drop))?;
    let w = call.w;
    tracing::debug!(rows = w.rows, cols = w.cols, ty = w.ty.name(), n = call.n, swiglu = call.up.is_some(), ?candidates, ?choice, "mat-mat product tuned");
    Ok(choice)
}

/// The candidate whose `run` takes least time: each runs once untimed (compiling its module,
/// growing scratch), then twice timed with CUDA events, the L2 flushed before each run.
pub(super) fn fastest<C: Copy>(device: &CudaDevice, what: &str, candidates: &[C], run: impl FnMut(C) -> Result<(), CudaError>) -> Result<C, CudaError> {
    fastest_with_credit(device, what, candidates, |_| 0.0, run)
}

/// [`fastest`], each candidate's time less `credit(candidate)` ms (what it saves elsewhere).
pub(super) fn fastest_with_credit<C: Copy>(
    device: &CudaDevice,
    what: &str,
    candidates: &[C],
    credit: impl Fn(C) -> f32,
    mut run: impl FnMut(C) -> Result<(), CudaError>,
) -> Result<C, CudaError> {
    const TIMED_RUNS: usize = 2;
    let flush_len = device.info().l2_cache_bytes.max(1 << 20) * 2;
    let timing = |e| CudaError::driver(format!("timing {what}"))(e);
    let event = || device.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(timing);
    let mut best: Option<(f32, C)> = None;
    let mut times_ms = Vec::with_capacity(candidates.len());
    for &candidate in candidates {
        run(candidate)?;
        let mut least = f32::INFINITY;
        for _ in 0..TIMED_RUNS {
            {
                let mut map = scratch().lock().unwrap_or_else(PoisonError::into_inner);
                let s = map.entry(device_key(device)).or_default();
                let mut none = Vec::new();
                ensure(device, &mut s.flush, &mut none, flush_len, false, "tuning L2 flush")?;
                device.stream().memset_zeros(s.flush.as_mut().expect("allocated above")).map_err(timing)?;
            }
            let (start, end) = (event()?, event()?);
            start.record(device.stream()).map_err(timing)?;
            run(candidate)?;
            end.record(device.stream()).map_err(timing)?;
            least = least.min(start.elapsed_ms(&end).map_err(timing)?);
        }
        times_ms.push(least);
        let least = least - credit(candidate);
        if best.is_none_or(|(ms, _)| least < ms) {
            best = Some((least, candidate));
        }
    }
    tracing::debug!(what, ?times_ms, "candidates timed, in candidate order");
    best.map(|(_, c)| c).ok_or_else(|| invalid("tuning", format!("no candidate {what}")))
}

/// The streaming tiles (indices into [`MMA_TILES`]) and their token counts: the group sizes an
/// expert product over gathered slots may use ([`launch_groups`]).
pub(super) fn group_tiles() -> impl Iterator<Item = (usize, usize)> {
    MMA_TILES.iter().enumerate().filter(|(_, t)| t.is_streaming()).map(|(i, t)| (i, t.tokens as usize))
}

/// The expert product over groups of gathered slots on tensor cores (`matmat_groups_*`):
/// `x` holds `groups` groups of `tile`'s token count of rows of `first.cols` values, group g
/// multiplies by the weight whose descriptor is `table[group_expert[g]]` (all of `first`'s
/// type and shape) into `out` (rows of `first.rows`); groups from `n_groups` (on the device)
/// on are skipped. False (nothing launched) when the f16 scratch would need growing inside a
/// capture.
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_groups(
    device: &CudaDevice,
    first: &GpuWeight,
    table: u64,
    group_expert: &CudaSlice<u32>,
    n_groups: &CudaSlice<u32>,
    x: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    groups: usize,
    tile: usize,
) -> Result<bool, CudaError> {
    const OP: &str = "matmul_expert_groups";
    let t = MMA_TILES[tile];
    if !t.is_streaming() {
        return Err(invalid(OP, format!("tile {tile} is not a streaming tile")));
    }
    let n = groups * t.tokens as usize;
    check_len(OP, "x", x.len(), n * first.cols)?;
    check_len(OP, "out", out.len(), n * first.rows)?;
    let (rows32, cols32, n32, groups32) =
        (to_u32(OP, "rows", first.rows)?, to_u32(OP, "cols", first.cols)?, to_u32(OP, "n", n)?, to_u32(OP, "groups", groups)?);
    let (row_blocks, _) = t.grid(first.rows, n, false);
    if row_blocks > 65_535 {
        return Err(invalid(OP, format!("{} rows exceed one launch's 65535 blocks of {}", first.rows, t.slots)));
    }
    let ld = first.cols.next_multiple_of(8);
    let ld32 = to_u32(OP, "padded cols", ld)?;
    let mut map = scratch().lock().unwrap_or_else(PoisonError::into_inner);
    let s = map.entry(device_key(device)).or_default();
    let capturing = is_capturing(device);
    if !ensure(device, &mut s.half, &mut s.retired_half, n * ld, capturing, "f16 mat-mat activations")?
        || !ensure(device, &mut s.partials, &mut s.retired_partials, 1, capturing, "split-K partials")?
    {
        return Ok(false);
    }
    let (half, partials) = (s.half.as_ref().expect("ensured"), s.partials.as_ref().expect("ensured"));
    let failed = |what: &str| CudaError::driver(format!("launching the grouped expert {what} of {}", first.name));
    let convert = first.kernels.get(device, &first.storage, Kernel::MatmatHalf { tile })?;
    let mut launch = device.stream().launch_builder(convert);
    launch.arg(x).arg(&cols32).arg(&n32).arg(&ld32).arg(half);
    // SAFETY: matches mma_half_activations; x holds n * cols values (checked), half n * ld.
    unsafe { launch.launch(stride_launch(n * ld / 8)) }.map_err(failed("f16 conversion"))?;

    let function = first.kernels.get(device, &first.storage, Kernel::MatmatGroups { tile })?;
    let cfg = LaunchConfig { grid_dim: (groups32, row_blocks as u32, 1), block_dim: (MMA_THREADS, 1, 1), shared_mem_bytes: t.shared_bytes() };
    let accumulate = 0u32;
    let mut launch = device.stream().launch_builder(function);
    launch.arg(&table).arg(group_expert).arg(n_groups).arg(half).arg(&ld32).arg(&n32).arg(out).arg(&rows32).arg(partials).arg(&accumulate);
    // SAFETY: matches matmat_groups_* (matmat_mma.cu): the table holds one descriptor per
    // expert of first's type and shape, group_expert `groups` valid expert ids (written by
    // moe_group_slots), half n * ld f16 values and out n * rows (checked); one depth split, so
    // partials are not read; shared_bytes is what the body lays out (the limit was raised
    // when the function was looked up).
    unsafe { launch.launch(cfg) }.map_err(failed("mat-mat"))?;
    Ok(true)
}

/// A pipelined product's input in the f16 scratch, and its split-K scratch.
pub(super) struct Staged<'s> {
    pub half: &'s CudaSlice<u16>,
    pub partials: &'s CudaSlice<f32>,
    pub layout: HalfLayout,
    /// Values per token row of `half` (the width rounded up to 8).
    pub ld: usize,
}

/// Grows `s` for a pipelined product with shape `tile` and `partial_len` split-K sums, and
/// converts `call.x` to f16 in the layout `tile` reads for `call.w`, unless `converted` says the
/// scratch holds that already. None (nothing launched) where the scratch would have to grow
/// inside a capture.
pub(super) fn stage_input<'s>(
    device: &CudaDevice,
    s: &'s mut Scratch,
    call: MatmatCall<'_>,
    tile: usize,
    partial_len: usize,
    capturing: bool,
    converted: Option<HalfLayout>,
) -> Result<Option<Staged<'s>>, CudaError> {
    let MatmatCall { op, w, x, n, .. } = call;
    let ld = w.cols.next_multiple_of(8);
    // A grown scratch holds nothing yet.
    let converted = converted.filter(|_| s.half.as_ref().is_some_and(|h| h.len() >= n * ld));
    if !ensure(device, &mut s.half, &mut s.retired_half, n * ld, capturing, "f16 mat-mat activations")?
        || !ensure(device, &mut s.partials, &mut s.retired_partials, partial_len, capturing, "split-K partials")?
    {
        return Ok(None);
    }
    let (half, partials) = (s.half.as_ref().expect("ensured"), s.partials.as_ref().expect("ensured"));
    let layout = HalfLayout::of(w, MMA_TILES[tile]);
    if converted != Some(layout) {
        let (cols32, n32, ld32) = (to_u32(op, "cols", w.cols)?, to_u32(op, "n", n)?, to_u32(op, "padded cols", ld)?);
        let convert = w.kernels.get(device, &w.storage, Kernel::MatmatHalf { tile })?;
        let mut launch = device.stream().launch_builder(convert);
        launch.arg(x).arg(&cols32).arg(&n32).arg(&ld32).arg(half);
        // SAFETY: matches mma_half_activations; x holds n * cols values (the caller checked),
        // half n * ld (ensured).
        unsafe { launch.launch(stride_launch(n * ld / 8)) }.map_err(CudaError::driver(format!("launching the {n}-token f16 conversion for {}", w.name)))?;
    }
    Ok(Some(Staged { half, partials, layout, ld }))
}

/// Launches one product with `choice` (see [`launch_matmat`] for `converted`).
fn launch_choice(
    device: &CudaDevice,
    call: MatmatCall<'_>,
    out: &mut CudaSlice<f32>,
    choice: Choice,
    capturing: bool,
    converted: Option<HalfLayout>,
) -> Result<Launched, CudaError> {
    let MatmatCall { op, w, up, x, n, accumulate } = call;
    let swiglu = up.is_some();
    let t = MMA_TILES[choice.tile];
    let function = w.kernels.get(device, &w.storage, Kernel::Matmat { tile: choice.tile, swiglu })?;
    let (rows32, cols32, n32, accumulate32) = (to_u32(op, "rows", w.rows)?, to_u32(op, "cols", w.cols)?, to_u32(op, "n", n)?, u32::from(accumulate));
    let (row_blocks, token_blocks) = t.grid(w.rows, n, swiglu);
    let failed = |what: &str| CudaError::driver(format!("launching the {n}-token {what} of {}", w.name));
    if !t.pipelined() {
        if token_blocks > 65_535 {
            return Err(invalid(op, format!("{n} tokens exceed one launch's 65535 blocks of {}", t.tokens)));
        }
        let cfg =
            LaunchConfig { grid_dim: (to_u32(op, "row blocks", row_blocks)?, token_blocks as u32, 1), block_dim: (MMA_THREADS, 1, 1), shared_mem_bytes: 0 };
        let mut launch = device.stream().launch_builder(function);
        push_weight(&mut launch, &w.storage);
        if let Some(up) = up {
            push_weight(&mut launch, &up.storage);
        }
        launch.arg(x).arg(&cols32).arg(&n32).arg(out).arg(&rows32);
        if !swiglu {
            launch.arg(&accumulate32);
        }
        // SAFETY: argument lists match matmat_* / matmat_swiglu_* of matmat_mma.cu (mma_tile.cuh);
        // x holds n * cols values and out n * rows (checked), gate and up share type and shape
        // (checked), and the kernel bounds-checks rows, tokens and columns.
        unsafe { launch.launch(cfg) }.map_err(failed("mat-mat"))?;
        // This body reads x itself: the f16 scratch is untouched.
        return Ok(Launched::Yes { half: converted });
    }
    if row_blocks > 65_535 {
        return Err(invalid(op, format!("{} rows exceed one launch's 65535 blocks of {}", w.rows, t.slots)));
    }
    let splits = choice.splits.max(1);
    let partial_len = if splits > 1 { splits * n * w.rows * if swiglu { 2 } else { 1 } } else { 1 };
    let mut map = scratch().lock().unwrap_or_else(PoisonError::into_inner);
    let s = map.entry(device_key(device)).or_default();
    let Some(Staged { half, partials, layout, ld }) = stage_input(device, s, call, choice.tile, partial_len, capturing, converted)? else {
        return Ok(Launched::NeedsScratch);
    };
    let ld32 = to_u32(op, "padded cols", ld)?;

    let shared = t.shared_bytes();
    let cfg = LaunchConfig {
        grid_dim: (to_u32(op, "token blocks", token_blocks)?, row_blocks as u32, to_u32(op, "splits", splits)?),
        block_dim: (MMA_THREADS, 1, 1),
        shared_mem_bytes: shared,
    };
    let mut launch = device.stream().launch_builder(function);
    push_weight(&mut launch, &w.storage);
    if let Some(up) = up {
        push_weight(&mut launch, &up.storage);
    }
    launch.arg(half).arg(&ld32).arg(&n32).arg(&mut *out).arg(&rows32).arg(partials);
    if !swiglu {
        launch.arg(&accumulate32);
    }
    // SAFETY: argument lists match matmat_* / matmat_swiglu_* of matmat_mma.cu (mma_pipe.cuh):
    // half holds n * ld f16 values, out n * rows (checked), partials splits * n * rows (x2 for
    // SwiGLU) when splits > 1; shared_bytes is what the kernel lays out (its function's limit
    // was raised to it when looked up).
    unsafe { launch.launch(cfg) }.map_err(failed("mat-mat"))?;

    if splits > 1 {
        let reduce = w.kernels.get(device, &w.storage, Kernel::MatmatReduce { tile: choice.tile })?;
        let (splits32, pair32, count32) = (splits as u32, u32::from(swiglu), to_u32(op, "outputs", n * w.rows)?);
        let mut launch = device.stream().launch_builder(reduce);
        launch.arg(partials).arg(&splits32).arg(&count32).arg(&pair32).arg(&accumulate32).arg(out);
        // SAFETY: matches mma_reduce_splits; partials hold splits * count values (x2 with pair)
        // written by the launch above, out count = n * rows.
        unsafe { launch.launch(stride_launch(n * w.rows)) }.map_err(failed("split-K reduction"))?;
    }
    Ok(Launched::Yes { half: Some(layout) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_round_trip_through_their_words() {
        for choice in [Choice { tile: 0, splits: 1 }, Choice { tile: MMA_TILES.len() - 1, splits: 7 }] {
            assert_eq!(Choice::from_words(&choice.to_words()), Some(choice));
        }
        assert_eq!(Choice::from_words(&[1]), None);
    }

    #[test]
    fn shared_bytes_match_the_kernel_layout() {
        // 128x128, BK 64, 3 stages: 2 x 128 x 72 x 2 + 3 x 128 x 72 x 2.
        assert_eq!(MMA_TILES[4].shared_bytes(), 36_864 + 55_296);
        // 64x32, BK 256, 2 stages: 2 x 64 x 264 x 2 + 2 x 32 x 264 x 2 (> 3 x 64 x 32 x 4).
        assert_eq!(MMA_TILES[7].shared_bytes(), 67_584 + 33_792);
        for t in MMA_TILES {
            // The blocks the registers are budgeted for fit on an sm_90 multiprocessor (227 KiB,
            // 1 KiB reserved per block).
            assert!(t.min_blocks * (t.shared_bytes() + 1024) <= 227 * 1024, "{t:?}");
        }
    }

    #[test]
    fn splits_fill_the_gpu_and_leave_no_split_empty() {
        let t = MMA_TILES[7];
        // 14336 rows / 64 = 224 blocks at n <= 32: 2 splits; 4096 rows: 64 blocks, 5 splits.
        assert_eq!(t.auto_splits(224, 16, 132), 2);
        assert_eq!(t.auto_splits(64, 56, 132), 5);
        for steps in 1..100 {
            for blocks in [1, 7, 64, 300] {
                let s = t.auto_splits(blocks, steps, 132);
                let per = steps.div_ceil(s);
                assert!((1..=MAX_SPLITS).contains(&s) && (s - 1) * per < steps, "steps {steps} blocks {blocks}: {s}");
            }
        }
        assert_eq!(MMA_TILES[4].auto_splits(1, 100, 132), 1);
    }

    #[test]
    fn buckets_split_at_powers_of_two() {
        assert_eq!([9, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 4096].map(bucket), [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]);
    }
}
