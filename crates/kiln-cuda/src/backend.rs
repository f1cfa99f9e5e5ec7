//! `CudaBackend`: kiln's `Backend` on one NVIDIA GPU. Every op is an asynchronous launch on
//! the device's stream; per-step values come from the step block (see `step.rs`), so a whole
//! decode step is captured once as a CUDA graph and replayed.

// `usize::is_multiple_of` needs Rust 1.87; the workspace supports 1.85.
#![allow(clippy::manual_is_multiple_of)]

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use kiln_core::backend::{
    Activation, AttentionArgs, AttentionParams, Backend, BackendError, DeferredPrologue, DeltaNetParams, ExpertInput, GatedExperts, GatedFfn, GatedNorm,
    Linear, NormChain, QkNorm, Qkv, Result, RopeKind, RopeParams, RouterArgs, RouterParams, StateSlots, WeightSource,
};
use kiln_core::plan::{FlatPlan, KvCacheSpec, KvType, StepCapacity};
use kiln_core::shapes;
use kiln_core::tensor::{expect_shape, Tensor, TensorMut};

use crate::graph::StepProfile;
use crate::kv::{kv_type_code, CudaKvCache};
use crate::matvec::{self, ActivationTarget, ExpertProducts, GatedPair, GpuWeight};
use crate::norm_chain::{chained_gated_ffn, chained_norm, gated_ffn_into, matmul_add_then_norm, CudaNormedInput, NextNormTarget};
use crate::paged_attention::{AttentionInputs, PagedAttention, PagedAttentionParams, PrologueInputs, StepCounts};
use crate::prologue::StoreKernels;
use crate::shared_products::{lock_input, quantized_input_for, FfnShapes};
use crate::step::{CudaStep, StepGraphRunner};
use crate::step_clock::{StepClock, StepTime};
use crate::{CudaDevice, CudaError, RegistryConfig};

/// The views the backend's ops take.
pub(crate) type View<'a> = Tensor<'a, CudaSlice<f32>>;
pub(crate) type ViewMut<'a> = TensorMut<'a, CudaSlice<f32>>;

/// Threads per block of the grid-stride kernels.
pub(crate) const BLOCK: u32 = 256;
/// Rows of at most this many values are normalized by one warp, longer ones by a block
/// (`WARP_NORM_MAX_DIM`, kernels/norm.cuh).
pub(crate) const WARP_NORM_MAX_DIM: usize = 512;
/// `sampling.cu`'s SAMPLE_THREADS.
const SAMPLE_THREADS: u32 = 1024;
/// Logits each sampler thread reads in a part of a row: one block alone reads a row of 128k
/// logits in about 16 us, the step's last and exposed kernel; in parts, a few.
const SAMPLE_VALUES_PER_THREAD: usize = 8;
const SAMPLE_MAX_PARTS: usize = 64;
/// `sampling.cu`'s MERGE_CAP: top-k candidates a sample.
pub(crate) const SAMPLE_MERGE_CAP: usize = 1024;

/// Blocks that share one sample's row (sampling.cu's grid x).
fn sample_parts(n_vocab: usize) -> u32 {
    n_vocab.div_ceil(SAMPLE_THREADS as usize * SAMPLE_VALUES_PER_THREAD).clamp(1, SAMPLE_MAX_PARTS) as u32
}

pub(crate) fn backend_error(error: CudaError) -> BackendError {
    match error {
        CudaError::OutOfMemory { requested_bytes, free_bytes, what } => {
            BackendError::OutOfMemory { device: "GPU".into(), what, requested_bytes: requested_bytes as u64, free_bytes: Some(free_bytes as u64) }
        }
        other => BackendError::Device(other.to_string()),
    }
}

pub(crate) fn launch_error(kernel: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> BackendError {
    move |error| BackendError::Device(format!("launching {kernel}: {error:?}"))
}

pub(crate) fn check_len(what: &str, have: usize, need: usize) -> Result<()> {
    if have < need {
        return Err(BackendError::Device(format!("{what}: buffer of {have} values, op needs {need}")));
    }
    Ok(())
}

pub(crate) fn to_u32(what: &str, value: usize) -> Result<u32> {
    u32::try_from(value).map_err(|_| BackendError::Device(format!("{what} = {value} does not fit the kernels' 32-bit indices")))
}

/// Kernels loaded once when the backend opens.
struct Kernels {
    rms_norm_warp: CudaFunction,
    rms_norm_block: CudaFunction,
    rms_norm_add: CudaFunction,
    rope: CudaFunction,
    add: CudaFunction,
    gather_rows: CudaFunction,
    add_bias: CudaFunction,
    swiglu: CudaFunction,
    sample: CudaFunction,
}

pub struct CudaBackend {
    device: CudaDevice,
    kernels: Kernels,
    pub(crate) store_kernels: Mutex<HashMap<(KvType, KvType), StoreKernels>>,
    attention: PagedAttention,
    pub(crate) experts: ExpertProducts,
    graphs: StepGraphRunner,
    /// Device-side times of sampled steps, once `time_steps` was called.
    step_clock: Mutex<Option<StepClock>>,
    /// Blocks that keep every multiprocessor busy, for the grid-stride kernels.
    busy_blocks: usize,
    max_sample_shared_bytes: usize,
    /// Spans of a Gated DeltaNet layer this long or longer take the chunked form.
    pub(crate) delta_net_chunked_from: u32,
}

impl CudaBackend {
    /// Opens GPU `ordinal` with the default kernel cache.
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        Self::with_config(ordinal, RegistryConfig::default())
    }

    pub fn with_config(ordinal: usize, config: RegistryConfig) -> Result<CudaBackend> {
        let delta_net_chunked_from = config.delta_net_spans.chunked_from();
        let device = CudaDevice::new(ordinal, config).map_err(backend_error)?;
        let function = |source: &str, kernel: &str| device.registry().function(source, kernel, &[]).map_err(backend_error);
        let kernels = Kernels {
            rms_norm_warp: function("norm", "rms_norm_warp_f32")?,
            rms_norm_block: function("norm", "rms_norm_block_f32")?,
            rms_norm_add: function("norm", "rms_norm_add_f32")?,
            rope: function("rope", "rope_f32")?,
            add: function("elementwise", "add_f32")?,
            gather_rows: function("pointwise", "gather_rows_f32")?,
            add_bias: function("pointwise", "add_bias_f32")?,
            swiglu: function("pointwise", "swiglu_f32")?,
            sample: function("sampling", "sample_tokens_f32")?,
        };
        // The sampler's penalty bitmap is dynamic shared memory sized by the vocabulary.
        let static_bytes = kernels.sample.shared_size_bytes().map_err(|e| BackendError::Device(format!("{e:?}")))? as usize;
        let max_sample_shared_bytes = device.info().max_shared_memory_per_block_optin.saturating_sub(static_bytes);
        kernels
            .sample
            .set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, max_sample_shared_bytes as i32)
            .map_err(|e| BackendError::Device(format!("raising the sampler's shared memory limit: {e:?}")))?;
        let busy_blocks = 2 * device.info().multiprocessor_count as usize;
        Ok(CudaBackend {
            device,
            kernels,
            store_kernels: Mutex::new(HashMap::new()),
            attention: PagedAttention::new(),
            experts: ExpertProducts::default(),
            graphs: StepGraphRunner::default(),
            step_clock: Mutex::new(None),
            busy_blocks,
            max_sample_shared_bytes,
            delta_net_chunked_from,
        })
    }

    /// How many kernels of the step graphs captured so far start while the kernel before them
    /// drains (`GraphEdges::Overlapped`); 0 under `GraphEdges::Serial`.
    pub fn overlapped_graph_edges(&self) -> usize {
        self.graphs.overlapped_edges()
    }

    /// From now on, profile every step graph once, at its first replay (`step_profiles`).
    pub fn profile_step_graphs(&self) {
        self.graphs.profile();
    }

    /// The profiles taken since `profile_step_graphs`, one per step graph, in capture order.
    pub fn step_profiles(&self) -> Vec<StepProfile> {
        self.graphs.profiles()
    }

    /// From now on, time every sampled step on the device (`step_times`).
    pub fn time_steps(&self) -> Result<()> {
        let clock = StepClock::new(&self.device).map_err(|e| BackendError::Device(format!("creating the step clock's events: {e:?}")))?;
        *self.step_clock.lock().unwrap_or_else(PoisonError::into_inner) = Some(clock);
        Ok(())
    }

    /// The sampled steps timed since `time_steps`, in order.
    pub fn step_times(&self) -> Vec<StepTime> {
        self.step_clock.lock().unwrap_or_else(PoisonError::into_inner).as_ref().map(|c| c.times.clone()).unwrap_or_default()
    }

    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// A 1-D grid-stride launch over `n` elements.
    pub(crate) fn grid_stride(&self, n: usize) -> LaunchConfig {
        let blocks = n.div_ceil(BLOCK as usize).clamp(1, self.busy_blocks * 4);
        LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
    }
}

impl CudaBackend {
    /// The attention of `args` into `out`; with a `target`, only where the split kernels can
    /// also store the output there quantized (then they do, and true is returned; else nothing
    /// is done and false is returned).
    fn paged_attention(&self, args: AttentionArgs<'_, Self>, mut out: ViewMut, target: Option<ActivationTarget>) -> Result<bool> {
        let AttentionArgs { q, cache, sinks, step, params: p, prologue } = args;
        let n = shapes::attention(q.shape(), out.shape(), sinks.map(|s| s.shape()), p)?;
        check_len("attention tokens in the step", step.n_tokens, n)?;
        step.check_usable(cache)?;
        kiln_core::plan::check_window_reach(step.widest_window, p.window)?;
        let params = PagedAttentionParams::of_layer(p, cache.spec());
        let counts = StepCounts { n_tokens: n, n_tiles: step.n_tiles, decode_only: step.decode_only };
        let prologue = match prologue {
            Some(deferred) if PagedAttention::takes_prologue(&counts, &params) => Some(prologue_inputs(&deferred, n, p)?),
            Some(_) => return Err(BackendError::Unsupported { backend: "CUDA".into(), what: "the attention prologue in this attention kernel".into() }),
            None => None,
        };
        let view = cache.view();
        let inputs = AttentionInputs { q: q.buf(), kv: &view, step: &step.block, sinks: sinks.map(|s| s.buf()), prologue };
        match target {
            Some(target) => self.attention.attention_quantized(&self.device, inputs, out.buf_mut(), counts, &params, None, target),
            None => self.attention.attention(&self.device, inputs, out.buf_mut(), counts, &params).map(|()| true),
        }
        .map_err(backend_error)
    }
}

/// The decode kernel's view of a deferred attention prologue, its shapes checked against the
/// attention's: keys `[n, n_kv_heads, head_dim]`, values `[n, n_kv_heads * head_dim]`, norms of
/// `head_dim` (the rope table's width is checked with the buffers, `check_prologue`).
fn prologue_inputs<'a>(d: &DeferredPrologue<'a, CudaSlice<f32>>, n: usize, p: &AttentionParams) -> Result<PrologueInputs<'a>> {
    let (kv_heads, hd) = (p.n_kv_heads, p.head_dim);
    expect_shape("attention prologue", "k", d.k.shape(), [n, kv_heads, hd])?;
    expect_shape("attention prologue", "v", d.v.shape(), [n, kv_heads * hd])?;
    if let Some((q_norm, k_norm, _)) = d.qk_norm {
        expect_shape("attention prologue", "q norm", q_norm.shape(), [hd])?;
        expect_shape("attention prologue", "k norm", k_norm.shape(), [hd])?;
    }
    Ok(PrologueInputs {
        k: d.k.buf(),
        v: d.v.buf(),
        qk_norm: d.qk_norm.map(|(q, k, eps)| (q.buf(), k.buf(), eps)),
        inv_freq: d.inv_freq.buf(),
        n_rot: 2 * d.inv_freq.shape().numel(),
        neox: d.rope.kind == RopeKind::Neox,
    })
}

impl Backend for CudaBackend {
    type Buffer = CudaSlice<f32>;
    type Weight = GpuWeight;
    type Step = CudaStep;
    type NormedInput = CudaNormedInput;
    type KvCache = CudaKvCache;

    fn name(&self) -> String {
        let info = self.device.info();
        format!("CUDA {} ({})", info.name, info.arch())
    }

    fn free_memory(&self) -> Option<u64> {
        self.device.memory_info().ok().map(|(free, _)| free as u64)
    }

    fn upload_weight(&self, src: WeightSource) -> Result<GpuWeight> {
        matvec::upload_weight(&self.device, &src).map_err(backend_error)
    }

    fn alloc(&self, len: usize, what: &str) -> Result<CudaSlice<f32>> {
        self.device.alloc_zeros::<f32>(len, what).map_err(backend_error)
    }

    fn write(&self, dst: &mut CudaSlice<f32>, src: &[f32]) -> Result<()> {
        check_len("write", dst.len(), src.len())?;
        let mut target = dst.slice_mut(..src.len());
        self.device.stream().memcpy_htod(src, &mut target).map_err(|e| BackendError::Device(format!("uploading {} values: {e:?}", src.len())))
    }

    fn read(&self, src: &CudaSlice<f32>, dst: &mut [f32]) -> Result<()> {
        check_len("read", src.len(), dst.len())?;
        let stream = self.device.stream();
        stream
            .memcpy_dtoh(&src.slice(..dst.len()), dst)
            .and_then(|()| stream.synchronize())
            .map_err(|e| BackendError::Device(format!("downloading {} values: {e:?}", dst.len())))
    }

    fn alloc_kv(&self, spec: &KvCacheSpec, what: &str) -> Result<CudaKvCache> {
        CudaKvCache::new(&self.device, spec, what)
    }

    fn grow_kv(&self, cache: &mut CudaKvCache, n_blocks: usize) -> Result<()> {
        cache.grow(n_blocks)
    }

    fn alloc_step(&self, capacity: &StepCapacity, cache_blocks: usize) -> Result<CudaStep> {
        CudaStep::new(&self.device, &self.graphs.graphs, capacity, cache_blocks)
    }

    fn write_step(&self, step: &mut CudaStep, plan: &FlatPlan) -> Result<()> {
        if let Some(clock) = self.step_clock.lock().unwrap_or_else(PoisonError::into_inner).as_mut() {
            clock.step_written(self.device.stream()).map_err(|e| BackendError::Device(format!("timing the step: {e:?}")))?;
        }
        step.write(&self.device, plan)?;
        self.graphs.set_current(step.id);
        Ok(())
    }

    fn embed(&self, table: &GpuWeight, step: &CudaStep, mut out: ViewMut) -> Result<()> {
        let n = shapes::embed(out.shape(), table.cols)?;
        check_len("embed tokens", step.n_tokens, n)?;
        matvec::embed_rows(&self.device, table, &step.tokens(), out.buf_mut(), n).map_err(backend_error)
    }

    fn rms_norm(&self, x: View, weight: View, mut out: ViewMut, eps: f32) -> Result<()> {
        let (rows, dim) = shapes::rms_norm(x.shape(), weight.shape(), out.shape())?;
        if rows == 0 || dim == 0 {
            return Ok(());
        }
        let (x, weight, out) = (x.buf(), weight.buf(), out.buf_mut());
        let (rows32, dim32) = (to_u32("rows", rows)?, to_u32("dim", dim)?);
        let warps_per_block = BLOCK as usize / 32;
        let (function, blocks) =
            if dim <= WARP_NORM_MAX_DIM { (&self.kernels.rms_norm_warp, rows.div_ceil(warps_per_block)) } else { (&self.kernels.rms_norm_block, rows) };
        let cfg = LaunchConfig { grid_dim: (to_u32("blocks", blocks)?, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument list matches norm.cu; every pointer covers rows * dim (the views' shapes).
        unsafe { self.device.stream().launch_builder(function).arg(out).arg(x).arg(weight).arg(&rows32).arg(&dim32).arg(&eps).launch(cfg) }
            .map(drop)
            .map_err(launch_error("rms_norm"))
    }

    fn rms_norm_sum(&self, a: ViewMut, b: View, weights: [View; 2], eps: f32, out: ViewMut) -> Result<()> {
        self.launch_rms_norm_sum(a.as_ref(), b, weights, eps, out)
    }

    fn rms_norm_add(&self, src: View, norm: (View, f32), scratch: ViewMut, mut x: ViewMut, scale: f32) -> Result<()> {
        let (rows, dim) = shapes::rms_norm(src.shape(), norm.0.shape(), x.shape())?;
        shapes::elementwise("rms_norm_add", &[("src", src.shape())], scratch.shape())?;
        if rows == 0 || dim == 0 {
            return Ok(());
        }
        let (dim32, eps) = (to_u32("dim", dim)?, norm.1);
        let cfg = LaunchConfig { grid_dim: (to_u32("rows", rows)?, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: matches norm.cu's rms_norm_add_f32 (NORM_BLOCK = BLOCK threads); src and x hold
        // rows * dim values, the weight dim (the shapes above); x is borrowed mutably, so it is
        // not src.
        unsafe {
            self.device
                .stream()
                .launch_builder(&self.kernels.rms_norm_add)
                .arg(x.buf_mut())
                .arg(src.buf())
                .arg(norm.0.buf())
                .arg(&dim32)
                .arg(&eps)
                .arg(&scale)
                .launch(cfg)
        }
        .map(drop)
        .map_err(launch_error("rms_norm_add"))
    }

    fn matmul(&self, w: &GpuWeight, x: View, mut out: ViewMut) -> Result<()> {
        let n = shapes::matmul("matmul", (w.rows, w.cols), x.shape(), out.shape())?;
        matvec::matmul(&self.device, w, x.buf(), out.buf_mut(), n).map_err(backend_error)
    }

    fn add_bias(&self, mut x: ViewMut, bias: View) -> Result<()> {
        let (n, dim) = shapes::rows_and_vector("add_bias", x.shape(), bias.shape())?;
        if n * dim == 0 {
            return Ok(());
        }
        let (dim32, total) = (to_u32("dim", dim)?, (n * dim) as u64);
        // SAFETY: matches pointwise.cu's add_bias_f32; lengths from the views' shapes.
        unsafe {
            self.device
                .stream()
                .launch_builder(&self.kernels.add_bias)
                .arg(x.buf_mut())
                .arg(bias.buf())
                .arg(&dim32)
                .arg(&total)
                .launch(self.grid_stride(n * dim))
        }
        .map(drop)
        .map_err(launch_error("add_bias"))
    }

    fn add(&self, mut x: ViewMut, y: View) -> Result<()> {
        let len = shapes::elementwise("add", &[("y", y.shape())], x.shape())?;
        if len == 0 {
            return Ok(());
        }
        let total = len as u64;
        let (ptr, _record) = x.buf_mut().device_ptr(self.device.stream());
        // SAFETY: add_f32(out, a, b, n) is elementwise, so out may alias a; lengths from the views.
        unsafe { self.device.stream().launch_builder(&self.kernels.add).arg(&ptr).arg(&ptr).arg(y.buf()).arg(&total).launch(self.grid_stride(len)) }
            .map(drop)
            .map_err(launch_error("add"))
    }

    fn swiglu(&self, gate: View, up: View, mut out: ViewMut) -> Result<()> {
        let len = shapes::elementwise("swiglu", &[("gate", gate.shape()), ("up", up.shape())], out.shape())?;
        if len == 0 {
            return Ok(());
        }
        let total = len as u64;
        // SAFETY: matches pointwise.cu's swiglu_f32; lengths from the views.
        unsafe {
            self.device.stream().launch_builder(&self.kernels.swiglu).arg(out.buf_mut()).arg(gate.buf()).arg(up.buf()).arg(&total).launch(self.grid_stride(len))
        }
        .map(drop)
        .map_err(launch_error("swiglu"))
    }

    fn rope(&self, mut x: ViewMut, inv_freq: View, step: &CudaStep, p: &RopeParams) -> Result<()> {
        let ([n, n_heads, head_dim], n_rot) = shapes::rope(x.shape(), inv_freq.shape())?;
        check_len("rope tokens in the step", step.n_tokens, n)?;
        let pairs = n * n_heads * (n_rot / 2);
        if pairs == 0 {
            return Ok(());
        }
        let args =
            [to_u32("tokens", n)?, to_u32("heads", n_heads)?, to_u32("head_dim", head_dim)?, to_u32("n_rot", n_rot)?, u32::from(p.kind == RopeKind::Neox)];
        // SAFETY: matches rope.cu's rope_f32; x holds n * n_heads * head_dim values (its shape).
        unsafe {
            self.device
                .stream()
                .launch_builder(&self.kernels.rope)
                .arg(x.buf_mut())
                .arg(inv_freq.buf())
                .arg(&step.block)
                .arg(&args[0])
                .arg(&args[1])
                .arg(&args[2])
                .arg(&args[3])
                .arg(&args[4])
                .launch(self.grid_stride(pairs))
        }
        .map(drop)
        .map_err(launch_error("rope"))
    }

    fn kv_store(&self, k: View, v: View, cache: &mut CudaKvCache, step: &CudaStep) -> Result<()> {
        let n = shapes::kv_store(k.shape(), v.shape(), cache.spec.width)?;
        check_len("kv_store tokens in the step", step.n_tokens, n)?;
        step.check_usable(cache)?;
        let kernels = self.store_kernels(&cache.spec)?;
        let (k_ptr, _record) = k.buf().device_ptr(self.device.stream());
        self.launch_kv_store(&kernels.kv_store, k_ptr, v.buf(), cache, step, n)
    }

    fn attention(&self, q: View, cache: &CudaKvCache, out: ViewMut, step: &CudaStep, p: &AttentionParams) -> Result<()> {
        self.paged_attention(AttentionArgs { q, cache, sinks: None, step, params: p, prologue: None }, out, None).map(drop)
    }

    fn defers_attention_prologue(&self, cache: &CudaKvCache, step: &CudaStep, p: &AttentionParams) -> bool {
        let counts = StepCounts { n_tokens: step.n_tokens, n_tiles: step.n_tiles, decode_only: step.decode_only };
        PagedAttention::takes_prologue(&counts, &PagedAttentionParams::of_layer(p, cache.spec()))
    }

    fn attention_matmul_add(
        &self,
        args: AttentionArgs<'_, Self>,
        mut out: ViewMut,
        linear: Linear<Self>,
        mut residual: ViewMut,
        tmp: ViewMut,
        next: Option<(View, f32)>,
    ) -> Result<Option<CudaNormedInput>> {
        let n = shapes::attention(args.q.shape(), out.shape(), args.sinks.map(|s| s.shape()), args.params)?;
        let wo = linear.weight;
        if wo.is_quantized() && n <= matvec::MAX_MATVEC_TOKENS {
            shapes::matmul("attention_matmul_add", (wo.rows, wo.cols), out.shape(), residual.shape())?;
            if let Some(bias) = linear.bias {
                expect_shape("attention_matmul_add", "bias", bias.shape(), [wo.rows])?;
            }
            let shared = matvec::shared_input(&self.device, wo.cols).map_err(backend_error)?;
            let input = lock_input(&shared);
            if self.paged_attention(args, out.reborrow(), Some(input.target(&self.device)))? {
                input.mark_filled(n);
                let next = chained_norm(next, n);
                let normed = next.map(|_| matvec::normed_input(&self.device, wo.rows)).transpose().map_err(backend_error)?;
                let target = normed.as_ref().map(lock_input);
                let next_norm = next.zip(normed.as_ref()).zip(target.as_deref()).map(|((norm, input), locked)| NextNormTarget { norm, input, locked });
                let bias = linear.bias.map(|b| b.buf());
                return matmul_add_then_norm(&self.device, (wo, bias), &input, residual.buf_mut(), n, next_norm);
            }
        }
        self.paged_attention(args, out.reborrow(), None)?;
        self.linear_add(linear, out.as_ref(), residual, tmp)?;
        Ok(None)
    }

    fn attention_matmul(&self, args: AttentionArgs<'_, Self>, mut out: ViewMut, wo: &GpuWeight, mut proj: ViewMut) -> Result<()> {
        let n = shapes::attention(args.q.shape(), out.shape(), args.sinks.map(|s| s.shape()), args.params)?;
        if wo.is_quantized() && n <= matvec::MAX_MATVEC_TOKENS {
            shapes::matmul("attention_matmul", (wo.rows, wo.cols), out.shape(), proj.shape())?;
            let shared = matvec::shared_input(&self.device, wo.cols).map_err(backend_error)?;
            let input = lock_input(&shared);
            if self.paged_attention(args, out.reborrow(), Some(input.target(&self.device)))? {
                input.mark_filled(n);
                return matvec::matmul_quantized(&self.device, wo, &input, None, proj.buf_mut(), n, false).map_err(backend_error);
            }
        }
        self.paged_attention(args, out.reborrow(), None)?;
        self.matmul(wo, out.as_ref(), proj)
    }

    fn moe_route(&self, logits: View, expert_scale: Option<View>, ids: ViewMut, weights: ViewMut, p: &RouterParams) -> Result<()> {
        self.launch_moe_route(logits, expert_scale, ids, weights, p)
    }

    fn moe_norm_route(&self, x: View, norm: (View, f32), router: RouterArgs<Self>, h: ViewMut, logits: ViewMut, routes: [ViewMut; 2]) -> Result<()> {
        self.launch_moe_norm_route(x, norm, router, h, logits, routes)
    }

    fn moe_matmul(&self, experts: &[GpuWeight], x: View, ids: View, out: ViewMut, input: ExpertInput) -> Result<()> {
        self.launch_moe_matmul(experts, x, ids, out, input)
    }

    fn moe_add_bias(&self, x: ViewMut, bias: View, ids: View) -> Result<()> {
        self.launch_moe_add_bias(x, bias, ids)
    }

    fn swiglu_oai(&self, gate: View, up: View, out: ViewMut, alpha: f32, limit: f32) -> Result<()> {
        self.gated_pointwise("swiglu_oai_f32", gate, up, out, &[alpha, limit])
    }

    fn sigmoid_gate(&self, x: ViewMut, gate: View) -> Result<()> {
        self.launch_sigmoid_gate(x, gate)
    }

    fn delta_net_gates(&self, g: ViewMut, beta: ViewMut, a_log_neg: View, dt_bias: View) -> Result<()> {
        self.launch_delta_net_gates(g, beta, a_log_neg, dt_bias)
    }

    fn ssm_conv(&self, x: View, weight: View, state: StateSlots<CudaSlice<f32>>, out: ViewMut, step: &CudaStep, p: &DeltaNetParams) -> Result<()> {
        self.launch_ssm_conv(x, weight, state, out, step, p)
    }

    fn delta_net_from_projections(
        &self,
        x: View,
        projections: [ViewMut; 2],
        gate_params: [View; 2],
        state: StateSlots<CudaSlice<f32>>,
        out: ViewMut,
        step: &CudaStep,
        p: &DeltaNetParams,
    ) -> Result<()> {
        self.launch_delta_net(x, projections.each_ref().map(|g| g.as_ref()), Some(gate_params), state, out, step, p)
    }

    fn delta_net(&self, x: View, gates: [View; 2], state: StateSlots<CudaSlice<f32>>, out: ViewMut, step: &CudaStep, p: &DeltaNetParams) -> Result<()> {
        self.launch_delta_net(x, gates, None, state, out, step, p)
    }

    fn attention_sinks(&self, q: View, cache: &CudaKvCache, sinks: View, out: ViewMut, step: &CudaStep, p: &AttentionParams) -> Result<()> {
        self.paged_attention(AttentionArgs { q, cache, sinks: Some(sinks), step, params: p, prologue: None }, out, None).map(drop)
    }

    fn moe_combine(&self, y: View, weights: View, out: ViewMut) -> Result<()> {
        self.launch_moe_combine(y, weights, None, out, false)
    }

    fn moe_combine_add(&self, y: View, weights: View, residual: ViewMut, _tmp: ViewMut) -> Result<()> {
        self.launch_moe_combine(y, weights, None, residual, true)
    }

    fn gated_norm_matmul_add(&self, g: GatedNorm<CudaSlice<f32>>, scratch: [ViewMut; 2], w: &GpuWeight, residual: ViewMut, tmp: ViewMut) -> Result<()> {
        self.launch_gated_norm_matmul_add(g, scratch, w, residual, tmp)
    }

    fn moe_combine_shared_add(&self, y: View, weights: View, (shared, gate): (ViewMut, View), residual: ViewMut, _tmp: ViewMut) -> Result<()> {
        self.launch_moe_combine(y, weights, Some((shared.as_ref(), gate)), residual, true)
    }

    fn geglu(&self, gate: View, up: View, out: ViewMut) -> Result<()> {
        self.gated_pointwise("geglu_f32", gate, up, out, &[])
    }

    fn scale(&self, x: ViewMut, s: f32) -> Result<()> {
        self.launch_scale(x, s)
    }

    fn softcap(&self, x: ViewMut, cap: f32) -> Result<()> {
        self.launch_softcap(x, cap)
    }

    fn copy_cols(&self, src: View, col: usize, dst: ViewMut) -> Result<()> {
        self.launch_copy_cols(src, col, dst)
    }

    fn copy(&self, src: View, mut dst: ViewMut) -> Result<()> {
        let len = shapes::elementwise("copy", &[("src", src.shape())], dst.shape())?;
        if len == 0 {
            return Ok(());
        }
        self.device.stream().memcpy_dtod(&src.buf().slice(..len), &mut dst.buf_mut().slice_mut(..len)).map_err(|e| BackendError::Device(format!("copy: {e:?}")))
    }

    fn gather_rows(&self, src: View, mut dst: ViewMut, step: &CudaStep) -> Result<()> {
        let (n, dim) = shapes::gather_rows(src.shape(), dst.shape(), step.n_logit_rows)?;
        check_len("gather_rows source rows", n, step.n_tokens)?;
        if step.n_logit_rows * dim == 0 {
            return Ok(());
        }
        let dim32 = to_u32("dim", dim)?;
        // SAFETY: matches pointwise.cu's gather_rows_f32; the step's logit rows index its tokens,
        // which `src` covers (checked above).
        unsafe {
            self.device
                .stream()
                .launch_builder(&self.kernels.gather_rows)
                .arg(dst.buf_mut())
                .arg(src.buf())
                .arg(&step.block)
                .arg(&dim32)
                .launch(self.grid_stride(step.n_logit_rows * dim))
        }
        .map(drop)
        .map_err(launch_error("gather_rows_f32"))
    }

    fn sample(&self, logits: View, step: &mut CudaStep) -> Result<()> {
        let [_, n_vocab] = logits.shape().dims2("sample", "logits")?;
        expect_shape("sample", "logits", logits.shape(), [step.n_logit_rows, n_vocab])?;
        if step.n_samples == 0 {
            return Ok(());
        }
        if n_vocab == 0 {
            return Err(BackendError::Device("sample: empty vocabulary".into()));
        }
        let bitmap_bytes = n_vocab.div_ceil(32) * 4;
        if bitmap_bytes > self.max_sample_shared_bytes {
            return Err(BackendError::Unsupported {
                backend: "CUDA".into(),
                what: format!(
                    "sampling a vocabulary of {n_vocab} tokens (the penalty bitmap needs {bitmap_bytes} bytes of shared memory, {} available)",
                    self.max_sample_shared_bytes
                ),
            });
        }
        if step.n_samples > step.sample_keys.len() {
            return Err(BackendError::PlanTooLarge { what: "samples".into(), need: step.n_samples, capacity: step.sample_keys.len() });
        }
        let n32 = to_u32("n_vocab", n_vocab)?;
        let samples = to_u32("samples", step.n_samples)?;
        let cfg = LaunchConfig { grid_dim: (sample_parts(n_vocab), samples, 1), block_dim: (SAMPLE_THREADS, 1, 1), shared_mem_bytes: bitmap_bytes as u32 };
        let CudaStep { block, sample_keys, sample_tickets, sample_part_keys, .. } = step;
        // SAFETY: matches sampling.cu; logits hold n_vocab values (checked), the step block its
        // layout, the keys and tickets one zeroed slot per sample of the capacity, the part keys
        // SAMPLE_MERGE_CAP a sample.
        unsafe {
            self.device
                .stream()
                .launch_builder(&self.kernels.sample)
                .arg(logits.buf())
                .arg(block)
                .arg(&n32)
                .arg(sample_keys)
                .arg(sample_tickets)
                .arg(sample_part_keys)
                .launch(cfg)
        }
        .map(drop)
        .map_err(launch_error("sample_tokens_f32"))
    }

    fn sampled_tokens(&self, step: &CudaStep, out: &mut [u32]) -> Result<()> {
        step.sampled(&self.device, out, self.step_clock.lock().unwrap_or_else(PoisonError::into_inner).as_mut())
    }

    fn run_step(&self, key: u64, record: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        self.graphs.run(&self.device, key, record)
    }

    fn prepare(&self, weights: &[&GpuWeight], attention: &AttentionParams, kv: &KvCacheSpec) -> Result<()> {
        let mut keys: Vec<_> = weights.iter().flat_map(|w| matvec::module_keys(w)).collect();
        keys.extend(crate::paged_attention::module_keys(&PagedAttentionParams::of_layer(attention, kv)));
        keys.push(("rope", vec![("K_TYPE", kv_type_code(kv.k_type)), ("V_TYPE", kv_type_code(kv.v_type))]));
        self.device.registry().prepare(&keys).map_err(backend_error)?;
        weights.iter().try_for_each(|w| matvec::resolve_matmat_kernels(&self.device, w)).map_err(backend_error)
    }

    fn synchronize(&self) -> Result<()> {
        self.device.synchronize().map_err(backend_error)
    }

    fn ffn_gate_up(&self, (w, act): ([&GpuWeight; 2], Activation), x: View, [mut gate, mut up]: [ViewMut; 2], mut out: ViewMut) -> Result<()> {
        let n = shapes::matmul("ffn_gate_up", (w[0].rows, w[0].cols), x.shape(), out.shape())?;
        if act == Activation::Silu {
            return matvec::matmul_swiglu(&self.device, w[0], w[1], x.buf(), out.buf_mut(), n).map_err(backend_error);
        }
        // Another activation: both products of the one input (one f16 conversion for the
        // mat-mat), then the activation.
        self.matmuls_f32(w, x, [gate.reborrow(), up.reborrow()], n, None)?;
        self.gated(act, gate.as_ref(), up.as_ref(), out)
    }

    fn router_logits(&self, h: View, router: &GpuWeight, logits: ViewMut, shared_gate: Option<(&GpuWeight, ViewMut)>) -> Result<()> {
        match shared_gate {
            Some((gate, out)) => {
                let n = shapes::matmul("router_logits", (router.rows, router.cols), h.shape(), logits.shape())?;
                self.matmuls_f32([router, gate], h, [logits, out], n, None)
            }
            None => self.matmul(router, h, logits),
        }
    }

    fn normed_router_logits(&self, x: View, norm: (View, f32), h: ViewMut, router: &GpuWeight, logits: ViewMut) -> Result<()> {
        self.launch_normed_router_logits(x, norm, h, router, logits)
    }

    fn moe_gate_up(&self, experts: GatedExperts<Self>, x: View, ids: View, scratch: [ViewMut; 2], out: ViewMut) -> Result<()> {
        self.launch_moe_gate_up(experts, x, ids, scratch, out)
    }

    fn moe_matmul_bias(&self, experts: &[GpuWeight], bias: View, x: View, ids: View, out: ViewMut, input: ExpertInput) -> Result<()> {
        self.launch_moe_matmul_bias(experts, bias, x, ids, out, input)
    }

    fn norm_matmuls<const N: usize>(
        &self,
        x: View,
        norm: (View, f32),
        h: ViewMut,
        linears: [Linear<Self>; N],
        out: [ViewMut; N],
        prepared: Option<CudaNormedInput>,
    ) -> Result<()> {
        self.norm_products(x, norm, h, linears, out, prepared)
    }

    fn norm_ffn_gate_up(
        &self,
        x: View,
        norm: (View, f32),
        mut h: ViewMut,
        (w, act): ([&GpuWeight; 2], Activation),
        scratch: [ViewMut; 2],
        mut out: ViewMut,
    ) -> Result<()> {
        let (n, dim) = shapes::rms_norm(x.shape(), norm.0.shape(), h.shape())?;
        match quantized_input_for(&self.device, &w, n, dim)? {
            Some(shared) => {
                shapes::matmul("norm_ffn_gate_up", (w[0].rows, w[0].cols), x.shape(), out.shape())?;
                let qx = lock_input(&shared);
                matvec::rms_norm_quantize(&self.device, x.buf(), norm.0.buf(), norm.1, n, &qx).map_err(backend_error)?;
                let pair = GatedPair { gate: w[0], up: w[1], act };
                matvec::matmul_gated_quantized(&self.device, pair, &qx, out.buf_mut(), n).map_err(backend_error)
            }
            None if act != Activation::Silu => {
                // The norm writes the mat-mat's f16 input where it can, as for q/k/v.
                let [mut gate, mut up] = scratch;
                let converted = self.norm_for_products(x, norm, h.reborrow(), &w, false)?;
                self.matmuls_f32(w, h.as_ref(), [gate.reborrow(), up.reborrow()], n, converted)?;
                self.gated(act, gate.as_ref(), up.as_ref(), out)
            }
            None => {
                let converted = self.norm_for_products(x, norm, h.reborrow(), &w[..1], true)?;
                shapes::matmul("norm_ffn_gate_up", (w[0].rows, w[0].cols), h.shape(), out.shape())?;
                matvec::matmul_swiglu_converted(&self.device, w[0], w[1], h.buf(), out.buf_mut(), n, converted).map_err(backend_error)
            }
        }
    }

    fn gated_ffn(&self, h: View, ffn: GatedFfn<Self>, scratch: [ViewMut; 2], mut act: ViewMut, mut out: ViewMut) -> Result<()> {
        if self.gated_ffn_of_experts_input(h, &ffn, &mut act, &mut out)? {
            return Ok(());
        }
        self.ffn_gate_up(([ffn.gate, ffn.up], ffn.act), h, scratch, act.reborrow())?;
        self.matmul(ffn.down, act.as_ref(), out)
    }

    fn norm_gated_ffn(
        &self,
        x: View,
        norm: (View, f32),
        h: ViewMut,
        ffn: GatedFfn<Self>,
        scratch: [ViewMut; 2],
        mut act: ViewMut,
        mut out: ViewMut,
    ) -> Result<()> {
        let shapes = FfnShapes { x: x.shape(), norm: norm.0.shape(), h: h.shape(), act: act.shape(), out: out.shape() };
        if let Some((shared, n, dim)) = self.fused_ffn_input("norm_gated_ffn", &ffn, shapes)? {
            return gated_ffn_into(&self.device, &ffn, (x.buf(), norm), (act.buf_mut(), out.buf_mut()), (n, dim), &shared);
        }
        self.norm_ffn_gate_up(x, norm, h, ([ffn.gate, ffn.up], ffn.act), scratch, act.reborrow())?;
        self.matmul(ffn.down, act.as_ref(), out)
    }

    fn norm_gated_ffn_add(
        &self,
        mut x: ViewMut,
        norm: (View, f32),
        h: ViewMut,
        ffn: GatedFfn<Self>,
        scratch: [ViewMut; 2],
        mut act: ViewMut,
        tmp: ViewMut,
        chain: NormChain<Self>,
    ) -> Result<Option<CudaNormedInput>> {
        let shapes = FfnShapes { x: x.shape(), norm: norm.0.shape(), h: h.shape(), act: act.shape(), out: x.shape() };
        if let Some((shared, n, dim)) = self.fused_ffn_input("norm_gated_ffn_add", &ffn, shapes)? {
            return chained_gated_ffn(&self.device, &ffn, (x.buf_mut(), norm), act.buf_mut(), (n, dim), &shared, chain);
        }
        self.norm_ffn_gate_up(x.as_ref(), norm, h, ([ffn.gate, ffn.up], ffn.act), scratch, act.reborrow())?;
        self.matmul_add(ffn.down, act.as_ref(), x, tmp)?;
        Ok(None)
    }

    fn attention_prologue(
        &self,
        qkv: Qkv<CudaSlice<f32>>,
        qk_norm: Option<QkNorm<CudaSlice<f32>>>,
        inv_freq: View,
        p: &RopeParams,
        cache: &mut CudaKvCache,
        step: &CudaStep,
    ) -> Result<()> {
        self.launch_attention_prologue(qkv, qk_norm, inv_freq, p, cache, step)
    }

    fn matmul_add(&self, w: &GpuWeight, x: View, mut residual: ViewMut, _tmp: ViewMut) -> Result<()> {
        let n = shapes::matmul("matmul_add", (w.rows, w.cols), x.shape(), residual.shape())?;
        matvec::matmul_add(&self.device, w, x.buf(), residual.buf_mut(), n).map_err(backend_error)
    }
}
