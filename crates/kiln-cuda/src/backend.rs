//! `CudaBackend`: kiln's `Backend` on one NVIDIA GPU. Every op is an asynchronous launch on
//! the device's stream; per-step values come from the step block (see `step.rs`), so a whole
//! decode step is captured once as a CUDA graph and replayed.

// `usize::is_multiple_of` needs Rust 1.87; the workspace supports 1.85.
#![allow(clippy::manual_is_multiple_of)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use cudarc::driver::sys::{CUfunction_attribute, CUstreamCaptureMode};
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use kiln_core::backend::{AttentionParams, Backend, BackendError, DeltaNetParams, ExpertInput, Result, RopeKind, RopeParams, RouterParams, WeightSource};
use kiln_core::plan::{FlatPlan, KvCacheSpec, KvType, StepCapacity};

use crate::graph::StepGraphExec;
use crate::kv::{kv_type_code, CudaKvCache};
use crate::matvec::{self, ExpertProducts, GpuWeight, QuantizedActivations};
use crate::paged_attention::{AttentionInputs, PagedAttention, PagedAttentionParams, StepCounts};
use crate::prologue::StoreKernels;
use crate::step::{CudaStep, StepGraph, StepGraphs};
use crate::{CudaDevice, CudaError, RegistryConfig};

/// Threads per block of the grid-stride kernels.
const BLOCK: u32 = 256;
/// Rows of at most this many values are normalized by one warp, longer ones by a block
/// (`WARP_NORM_MAX_DIM`, kernels/norm.cuh).
pub(crate) const WARP_NORM_MAX_DIM: usize = 512;
/// `sampling.cu`'s SAMPLE_THREADS.
const SAMPLE_THREADS: u32 = 1024;

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
    experts: ExpertProducts,
    graphs: StepGraphs,
    /// Id of the step object written last: `run_step` records and replays for it.
    current_step: AtomicU64,
    /// Kernel-to-kernel edges made programmatic in the graphs captured so far.
    overlapped_edges: AtomicUsize,
    /// Blocks that keep every multiprocessor busy, for the grid-stride kernels.
    busy_blocks: usize,
    max_sample_shared_bytes: usize,
}

impl CudaBackend {
    /// Opens GPU `ordinal` with the default kernel cache.
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        Self::with_config(ordinal, RegistryConfig::default())
    }

    pub fn with_config(ordinal: usize, config: RegistryConfig) -> Result<CudaBackend> {
        let device = CudaDevice::new(ordinal, config).map_err(backend_error)?;
        let function = |source: &str, kernel: &str| device.registry().function(source, kernel, &[]).map_err(backend_error);
        let kernels = Kernels {
            rms_norm_warp: function("norm", "rms_norm_warp_f32")?,
            rms_norm_block: function("norm", "rms_norm_block_f32")?,
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
            graphs: StepGraphs::default(),
            current_step: AtomicU64::new(0),
            overlapped_edges: AtomicUsize::new(0),
            busy_blocks,
            max_sample_shared_bytes,
        })
    }

    /// How many kernels of the step graphs captured so far start while the kernel before them
    /// drains (`GraphEdges::Overlapped`); 0 under `GraphEdges::Serial`.
    pub fn overlapped_graph_edges(&self) -> usize {
        self.overlapped_edges.load(Ordering::Relaxed)
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

/// The paged attention launch parameters of a layer with this geometry over this cache.
fn paged_params(p: &AttentionParams, kv: &KvCacheSpec) -> PagedAttentionParams {
    PagedAttentionParams {
        n_heads: p.n_heads,
        n_kv_heads: p.n_kv_heads,
        head_dim: p.head_dim,
        rows: kv.rows(),
        max_seq_len: p.max_seq_len,
        scale: p.scale,
        k_type: kv.k_type,
        v_type: kv.v_type,
        window: p.window,
    }
}

/// Whether a product of `n` tokens of `dim` values with `w` takes the quantized mat-vec, whose
/// input buffer is the device's for `dim` ([`matvec::shared_input`]).
fn takes_quantized_matvec(w: &GpuWeight, n: usize, dim: usize) -> bool {
    w.is_quantized() && n <= matvec::MAX_MATVEC_TOKENS && w.cols == dim
}

/// The device's quantized input for `dim` when `ws` all take the quantized mat-vec with it
/// (lock it from its fill until its products are enqueued).
fn quantized_input_for(device: &crate::CudaDevice, ws: &[&GpuWeight], n: usize, dim: usize) -> Result<Option<matvec::SharedInput>> {
    if ws.iter().all(|w| takes_quantized_matvec(w, n, dim)) {
        return matvec::shared_input(device, dim).map(Some).map_err(backend_error);
    }
    Ok(None)
}

impl CudaBackend {
    #[allow(clippy::too_many_arguments)]
    fn paged_attention(
        &self,
        q: &CudaSlice<f32>,
        cache: &CudaKvCache,
        sinks: Option<&CudaSlice<f32>>,
        out: &mut CudaSlice<f32>,
        step: &CudaStep,
        n: usize,
        p: &AttentionParams,
    ) -> Result<()> {
        check_len("attention tokens in the step", step.n_tokens, n)?;
        step.check_usable(cache)?;
        let params = paged_params(p, cache.spec());
        let counts = StepCounts { n_tokens: n, n_tiles: step.n_tiles, decode_only: step.decode_only };
        let view = cache.view();
        let inputs = AttentionInputs { q, kv: &view, step: &step.block, sinks };
        self.attention.attention(&self.device, inputs, out, counts, &params).map_err(backend_error)
    }

    /// q, k and v from activations already quantized into `qx` (wq's input buffer).
    #[allow(clippy::too_many_arguments)]
    fn matmul_qkv_quantized(
        &self,
        qx: &QuantizedActivations,
        wq: &GpuWeight,
        wk: &GpuWeight,
        wv: &GpuWeight,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        n: usize,
    ) -> Result<()> {
        matvec::matmul_stacked_quantized(&self.device, &[wq, wk, wv], qx, &mut [q, k, v], n).map_err(backend_error)
    }
}

impl Backend for CudaBackend {
    type Buffer = CudaSlice<f32>;
    type Weight = GpuWeight;
    type Step = CudaStep;
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
        CudaStep::new(&self.device, &self.graphs, capacity, cache_blocks)
    }

    fn write_step(&self, step: &mut CudaStep, plan: &FlatPlan) -> Result<()> {
        step.write(&self.device, plan)?;
        self.current_step.store(step.id, Ordering::Relaxed);
        Ok(())
    }

    fn embed(&self, table: &GpuWeight, step: &CudaStep, out: &mut CudaSlice<f32>, n: usize) -> Result<()> {
        check_len("embed tokens", step.n_tokens, n)?;
        matvec::embed_rows(&self.device, table, &step.tokens(), out, n).map_err(backend_error)
    }

    fn rms_norm(&self, x: &CudaSlice<f32>, weight: &CudaSlice<f32>, out: &mut CudaSlice<f32>, rows: usize, dim: usize, eps: f32) -> Result<()> {
        check_len("rms_norm", x.len().min(out.len()), rows * dim)?;
        check_len("rms_norm weight", weight.len(), dim)?;
        if rows == 0 || dim == 0 {
            return Ok(());
        }
        let (rows32, dim32) = (to_u32("rows", rows)?, to_u32("dim", dim)?);
        let warps_per_block = BLOCK as usize / 32;
        let (function, blocks) =
            if dim <= WARP_NORM_MAX_DIM { (&self.kernels.rms_norm_warp, rows.div_ceil(warps_per_block)) } else { (&self.kernels.rms_norm_block, rows) };
        let cfg = LaunchConfig { grid_dim: (to_u32("blocks", blocks)?, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument list matches norm.cu; every pointer covers rows * dim (checked above).
        unsafe { self.device.stream().launch_builder(function).arg(out).arg(x).arg(weight).arg(&rows32).arg(&dim32).arg(&eps).launch(cfg) }
            .map(drop)
            .map_err(launch_error("rms_norm"))
    }

    fn matmul(&self, w: &GpuWeight, x: &CudaSlice<f32>, out: &mut CudaSlice<f32>, n: usize) -> Result<()> {
        matvec::matmul(&self.device, w, x, out, n).map_err(backend_error)
    }

    fn add_bias(&self, x: &mut CudaSlice<f32>, bias: &CudaSlice<f32>, n: usize, dim: usize) -> Result<()> {
        check_len("add_bias", x.len(), n * dim)?;
        check_len("bias", bias.len(), dim)?;
        if n * dim == 0 {
            return Ok(());
        }
        let (dim32, total) = (to_u32("dim", dim)?, (n * dim) as u64);
        // SAFETY: matches pointwise.cu's add_bias_f32; lengths checked above.
        unsafe { self.device.stream().launch_builder(&self.kernels.add_bias).arg(x).arg(bias).arg(&dim32).arg(&total).launch(self.grid_stride(n * dim)) }
            .map(drop)
            .map_err(launch_error("add_bias"))
    }

    fn add(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, len: usize) -> Result<()> {
        check_len("add", x.len().min(y.len()), len)?;
        if len == 0 {
            return Ok(());
        }
        let total = len as u64;
        let (ptr, _record) = x.device_ptr(self.device.stream());
        // SAFETY: add_f32(out, a, b, n) is elementwise, so out may alias a; lengths checked above.
        unsafe { self.device.stream().launch_builder(&self.kernels.add).arg(&ptr).arg(&ptr).arg(y).arg(&total).launch(self.grid_stride(len)) }
            .map(drop)
            .map_err(launch_error("add"))
    }

    fn swiglu(&self, gate: &CudaSlice<f32>, up: &CudaSlice<f32>, out: &mut CudaSlice<f32>, len: usize) -> Result<()> {
        check_len("swiglu", gate.len().min(up.len()).min(out.len()), len)?;
        if len == 0 {
            return Ok(());
        }
        let total = len as u64;
        // SAFETY: matches pointwise.cu's swiglu_f32; lengths checked above.
        unsafe { self.device.stream().launch_builder(&self.kernels.swiglu).arg(out).arg(gate).arg(up).arg(&total).launch(self.grid_stride(len)) }
            .map(drop)
            .map_err(launch_error("swiglu"))
    }

    fn rope(&self, x: &mut CudaSlice<f32>, inv_freq: &CudaSlice<f32>, step: &CudaStep, n: usize, p: &RopeParams) -> Result<()> {
        check_len("rope", x.len(), n * p.n_heads * p.head_dim)?;
        check_len("rope frequencies", inv_freq.len(), p.n_rot / 2)?;
        check_len("rope tokens in the step", step.n_tokens, n)?;
        if p.n_rot > p.head_dim || p.n_rot % 2 != 0 {
            return Err(BackendError::Device(format!("rope: n_rot {} does not fit head_dim {}", p.n_rot, p.head_dim)));
        }
        let pairs = n * p.n_heads * (p.n_rot / 2);
        if pairs == 0 {
            return Ok(());
        }
        let args = [
            to_u32("tokens", n)?,
            to_u32("heads", p.n_heads)?,
            to_u32("head_dim", p.head_dim)?,
            to_u32("n_rot", p.n_rot)?,
            u32::from(p.kind == RopeKind::Neox),
        ];
        // SAFETY: matches rope.cu's rope_f32; x holds n * n_heads * head_dim values (checked).
        unsafe {
            self.device
                .stream()
                .launch_builder(&self.kernels.rope)
                .arg(x)
                .arg(inv_freq)
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

    fn kv_store(&self, k: &CudaSlice<f32>, v: &CudaSlice<f32>, cache: &mut CudaKvCache, step: &CudaStep, n: usize) -> Result<()> {
        check_len("kv_store input", k.len().min(v.len()), n * cache.spec.width)?;
        check_len("kv_store tokens in the step", step.n_tokens, n)?;
        step.check_usable(cache)?;
        let kernels = self.store_kernels(&cache.spec)?;
        let (k_ptr, _record) = k.device_ptr(self.device.stream());
        self.launch_kv_store(&kernels.kv_store, k_ptr, v, cache, step, n)
    }

    fn attention(&self, q: &CudaSlice<f32>, cache: &CudaKvCache, out: &mut CudaSlice<f32>, step: &CudaStep, n: usize, p: &AttentionParams) -> Result<()> {
        self.paged_attention(q, cache, None, out, step, n, p)
    }

    fn moe_route(
        &self,
        logits: &CudaSlice<f32>,
        expert_scale: Option<&CudaSlice<f32>>,
        ids: &mut CudaSlice<f32>,
        weights: &mut CudaSlice<f32>,
        n: usize,
        p: &RouterParams,
    ) -> Result<()> {
        self.launch_moe_route(logits, expert_scale, ids, weights, n, p)
    }

    fn moe_matmul(
        &self,
        experts: &[GpuWeight],
        x: &CudaSlice<f32>,
        ids: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        n: usize,
        n_used: usize,
        input: ExpertInput,
    ) -> Result<()> {
        self.experts.matmul(&self.device, experts, x, ids, out, n, n_used, input).map_err(backend_error)
    }

    fn moe_add_bias(&self, x: &mut CudaSlice<f32>, bias: &CudaSlice<f32>, ids: &CudaSlice<f32>, n: usize, n_used: usize, dim: usize) -> Result<()> {
        self.launch_moe_add_bias(x, bias, ids, n, n_used, dim)
    }

    fn swiglu_oai(&self, gate: &CudaSlice<f32>, up: &CudaSlice<f32>, out: &mut CudaSlice<f32>, len: usize, alpha: f32, limit: f32) -> Result<()> {
        self.gated_pointwise("swiglu_oai_f32", gate, up, out, len, &[alpha, limit])
    }

    fn sigmoid_gate(&self, x: &mut CudaSlice<f32>, gate: &CudaSlice<f32>, n: usize, dim: usize, gate_dim: usize) -> Result<()> {
        self.launch_sigmoid_gate(x, gate, n, dim, gate_dim)
    }

    fn delta_net_gates(
        &self,
        g: &mut CudaSlice<f32>,
        beta: &mut CudaSlice<f32>,
        a_log_neg: &CudaSlice<f32>,
        dt_bias: &CudaSlice<f32>,
        n: usize,
        n_heads: usize,
    ) -> Result<()> {
        self.launch_delta_net_gates(g, beta, a_log_neg, dt_bias, n, n_heads)
    }

    fn ssm_conv(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        state: &mut CudaSlice<f32>,
        slots: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        step: &CudaStep,
        n: usize,
        p: &DeltaNetParams,
    ) -> Result<()> {
        self.launch_ssm_conv(x, weight, state, slots, out, step, n, p)
    }

    fn delta_net(
        &self,
        x: &CudaSlice<f32>,
        g: &CudaSlice<f32>,
        beta: &CudaSlice<f32>,
        state: &mut CudaSlice<f32>,
        slots: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        step: &CudaStep,
        n: usize,
        p: &DeltaNetParams,
    ) -> Result<()> {
        self.launch_delta_net(x, g, beta, state, slots, out, step, n, p)
    }

    fn attention_sinks(
        &self,
        q: &CudaSlice<f32>,
        cache: &CudaKvCache,
        sinks: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        step: &CudaStep,
        n: usize,
        p: &AttentionParams,
    ) -> Result<()> {
        self.paged_attention(q, cache, Some(sinks), out, step, n, p)
    }

    fn moe_combine(&self, y: &CudaSlice<f32>, weights: &CudaSlice<f32>, out: &mut CudaSlice<f32>, n: usize, n_used: usize, dim: usize) -> Result<()> {
        self.launch_moe_combine(y, weights, out, n, n_used, dim)
    }

    fn geglu(&self, gate: &CudaSlice<f32>, up: &CudaSlice<f32>, out: &mut CudaSlice<f32>, len: usize) -> Result<()> {
        self.gated_pointwise("geglu_f32", gate, up, out, len, &[])
    }

    fn scale(&self, x: &mut CudaSlice<f32>, s: f32, len: usize) -> Result<()> {
        self.launch_scale(x, s, len)
    }

    fn softcap(&self, x: &mut CudaSlice<f32>, cap: f32, len: usize) -> Result<()> {
        self.launch_softcap(x, cap, len)
    }

    fn copy_cols(&self, src: &CudaSlice<f32>, src_width: usize, col: usize, dst: &mut CudaSlice<f32>, width: usize, n: usize) -> Result<()> {
        self.launch_copy_cols(src, src_width, col, dst, width, n)
    }

    fn copy(&self, src: &CudaSlice<f32>, dst: &mut CudaSlice<f32>, len: usize) -> Result<()> {
        check_len("copy", src.len().min(dst.len()), len)?;
        if len == 0 {
            return Ok(());
        }
        self.device.stream().memcpy_dtod(&src.slice(..len), &mut dst.slice_mut(..len)).map_err(|e| BackendError::Device(format!("copy: {e:?}")))
    }

    fn gather_rows(&self, src: &CudaSlice<f32>, dst: &mut CudaSlice<f32>, step: &CudaStep, dim: usize) -> Result<()> {
        check_len("gather_rows destination", dst.len(), step.n_logit_rows * dim)?;
        check_len("gather_rows source", src.len(), step.n_tokens * dim)?;
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
                .arg(dst)
                .arg(src)
                .arg(&step.block)
                .arg(&dim32)
                .launch(self.grid_stride(step.n_logit_rows * dim))
        }
        .map(drop)
        .map_err(launch_error("gather_rows_f32"))
    }

    fn sample(&self, logits: &CudaSlice<f32>, n_vocab: usize, step: &mut CudaStep) -> Result<()> {
        check_len("sample", logits.len(), step.n_logit_rows * n_vocab)?;
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
        let n32 = to_u32("n_vocab", n_vocab)?;
        let cfg =
            LaunchConfig { grid_dim: (to_u32("samples", step.n_samples)?, 1, 1), block_dim: (SAMPLE_THREADS, 1, 1), shared_mem_bytes: bitmap_bytes as u32 };
        // SAFETY: matches sampling.cu; logits hold n_vocab values (checked), the step block its layout.
        unsafe { self.device.stream().launch_builder(&self.kernels.sample).arg(logits).arg(&mut step.block).arg(&n32).launch(cfg) }
            .map(drop)
            .map_err(launch_error("sample_tokens_f32"))
    }

    fn sampled_tokens(&self, step: &CudaStep, out: &mut [u32]) -> Result<()> {
        step.sampled(&self.device, out)
    }

    /// Per key of the step object written last: the first call runs `record` directly, so
    /// lazily loaded kernels and scratch buffers are created outside any capture; the second
    /// captures `record` into a graph and launches it; later calls launch the graph only.
    fn run_step(&self, key: u64, record: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let slot = (self.current_step.load(Ordering::Relaxed), key);
        let mut graphs = self.graphs.lock().unwrap_or_else(PoisonError::into_inner);
        let stream = self.device.stream();
        let graph_error = |what: &'static str| move |e| BackendError::Device(format!("{what} the graph of step {key}: {e:?}"));
        match graphs.get(&slot) {
            None => {
                record()?;
                graphs.insert(slot, StepGraph::WarmedUp);
            }
            Some(StepGraph::WarmedUp) => {
                stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(graph_error("starting the capture of"))?;
                let recorded = record();
                // The capture always ends, so a failed record leaves the stream usable.
                let registry = self.device.registry();
                let captured = StepGraphExec::end_capture(stream, &|function| registry.waits_for_inputs(function));
                recorded?;
                let (graph, overlapped) =
                    captured.map_err(graph_error("capturing"))?.ok_or_else(|| BackendError::Device(format!("step {key} recorded no work to capture")))?;
                self.overlapped_edges.fetch_add(overlapped, Ordering::Relaxed);
                tracing::debug!(key, overlapped, "step graph captured");
                graph.launch().map_err(graph_error("launching"))?;
                graphs.insert(slot, StepGraph::Captured(graph));
            }
            Some(StepGraph::Captured(graph)) => graph.launch().map_err(graph_error("launching"))?,
        }
        Ok(())
    }

    fn prepare(&self, weights: &[&GpuWeight], attention: &AttentionParams, kv: &KvCacheSpec) -> Result<()> {
        let mut keys: Vec<_> = weights.iter().flat_map(|w| matvec::module_keys(w)).collect();
        keys.push(crate::paged_attention::module_key(&paged_params(attention, kv)));
        keys.push(("rope", vec![("K_TYPE", kv_type_code(kv.k_type)), ("V_TYPE", kv_type_code(kv.v_type))]));
        self.device.registry().prepare(&keys).map_err(backend_error)?;
        weights.iter().try_for_each(|w| matvec::resolve_matmat_kernels(&self.device, w)).map_err(backend_error)
    }

    fn synchronize(&self) -> Result<()> {
        self.device.synchronize().map_err(backend_error)
    }

    fn ffn_gate_up(
        &self,
        w_gate: &GpuWeight,
        w_up: &GpuWeight,
        x: &CudaSlice<f32>,
        _gate: &mut CudaSlice<f32>,
        _up: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        n: usize,
        _n_ff: usize,
    ) -> Result<()> {
        matvec::matmul_swiglu(&self.device, w_gate, w_up, x, out, n).map_err(backend_error)
    }

    fn moe_gate_up_swiglu(
        &self,
        gate: &[GpuWeight],
        up: &[GpuWeight],
        x: &CudaSlice<f32>,
        ids: &CudaSlice<f32>,
        gate_out: &mut CudaSlice<f32>,
        up_out: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        n: usize,
        n_used: usize,
        n_ff: usize,
    ) -> Result<()> {
        if self.experts.matmul_swiglu(&self.device, gate, up, x, ids, out, n, n_used).map_err(backend_error)?.is_some() {
            return Ok(());
        }
        self.moe_matmul(gate, x, ids, gate_out, n, n_used, ExpertInput::PerToken)?;
        self.moe_matmul(up, x, ids, up_out, n, n_used, ExpertInput::PerToken)?;
        self.swiglu(gate_out, up_out, out, n * n_used * n_ff)
    }

    fn matmul_qkv(
        &self,
        wq: &GpuWeight,
        wk: &GpuWeight,
        wv: &GpuWeight,
        x: &CudaSlice<f32>,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        n: usize,
    ) -> Result<()> {
        match quantized_input_for(&self.device, &[wq, wk, wv], n, wq.cols)? {
            Some(shared) => {
                let qx = shared.lock().unwrap_or_else(PoisonError::into_inner);
                qx.fill(&self.device, x, n).map_err(backend_error)?;
                self.matmul_qkv_quantized(&qx, wq, wk, wv, q, k, v, n)
            }
            None => {
                self.matmul(wq, x, q, n)?;
                self.matmul(wk, x, k, n)?;
                self.matmul(wv, x, v, n)
            }
        }
    }

    fn norm_matmul_qkv(
        &self,
        x: &CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        eps: f32,
        h: &mut CudaSlice<f32>,
        wq: &GpuWeight,
        wk: &GpuWeight,
        wv: &GpuWeight,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        n: usize,
        dim: usize,
    ) -> Result<()> {
        match quantized_input_for(&self.device, &[wq, wk, wv], n, dim)? {
            Some(shared) => {
                let qx = shared.lock().unwrap_or_else(PoisonError::into_inner);
                matvec::rms_norm_quantize(&self.device, x, norm, eps, n, &qx).map_err(backend_error)?;
                self.matmul_qkv_quantized(&qx, wq, wk, wv, q, k, v, n)
            }
            None => {
                self.rms_norm(x, norm, h, n, dim, eps)?;
                self.matmul_qkv(wq, wk, wv, h, q, k, v, n)
            }
        }
    }

    fn norm_ffn_gate_up(
        &self,
        x: &CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        eps: f32,
        h: &mut CudaSlice<f32>,
        w_gate: &GpuWeight,
        w_up: &GpuWeight,
        gate: &mut CudaSlice<f32>,
        up: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        n: usize,
        dim: usize,
        n_ff: usize,
    ) -> Result<()> {
        match quantized_input_for(&self.device, &[w_gate, w_up], n, dim)? {
            Some(shared) => {
                let qx = shared.lock().unwrap_or_else(PoisonError::into_inner);
                matvec::rms_norm_quantize(&self.device, x, norm, eps, n, &qx).map_err(backend_error)?;
                matvec::matmul_swiglu_quantized(&self.device, w_gate, w_up, &qx, out, n).map_err(backend_error)
            }
            None => {
                self.rms_norm(x, norm, h, n, dim, eps)?;
                self.ffn_gate_up(w_gate, w_up, h, gate, up, out, n, n_ff)
            }
        }
    }

    fn attention_prologue(
        &self,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        v: &CudaSlice<f32>,
        qk_norm: Option<(&CudaSlice<f32>, &CudaSlice<f32>, f32)>,
        _scratch: (&mut CudaSlice<f32>, &mut CudaSlice<f32>),
        inv_freq: &CudaSlice<f32>,
        cache: &mut CudaKvCache,
        step: &CudaStep,
        n: usize,
        q_rope: &RopeParams,
        n_kv_heads: usize,
    ) -> Result<()> {
        self.qk_norm_rope_store(q, k, v, qk_norm, inv_freq, cache, step, n, q_rope, n_kv_heads)
    }

    fn matmul_add(&self, w: &GpuWeight, x: &CudaSlice<f32>, residual: &mut CudaSlice<f32>, _tmp: &mut CudaSlice<f32>, n: usize, _dim: usize) -> Result<()> {
        matvec::matmul_add(&self.device, w, x, residual, n).map_err(backend_error)
    }
}
