//! The CPU reference and a GPU backend side by side (`Pair`), paged caches on both (`Caches`),
//! and the comparison helpers the GPU backend test binaries share; each binary uses a part.
#![allow(dead_code)]

use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use kiln_core::backend::{AttentionParams, Backend, WeightSource};
use kiln_core::plan::{BatchPlan, FlatPlan, KvCacheSpec, KvType, LogitRows, SampleSpec, SeqStep, StepCapacity, KV_BLOCK_SIZE};
use kiln_core::sampling::SamplingParams;
use kiln_core::{CpuBackend, DeviceBuffer, Shape, Tensor, TensorMut};
use kiln_cuda::cudarc::driver::CudaSlice;
use kiln_cuda::{CudaBackend, RegistryConfig};
use kiln_quant::GgmlType;
use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Tests share the GPU; the timing tests hold it alone, so their numbers are not diluted by
/// other tests' kernels, and so do the tests that record step graphs: a capture in progress is
/// invalidated when another thread synchronizes the device (seen in the batched-vs-alone tests).
static GPU_USE: RwLock<()> = RwLock::new(());

pub enum GpuUse {
    Shared(#[allow(dead_code)] RwLockReadGuard<'static, ()>),
    Exclusive(#[allow(dead_code)] RwLockWriteGuard<'static, ()>),
}

pub fn shared_gpu() -> GpuUse {
    GpuUse::Shared(GPU_USE.read().unwrap_or_else(PoisonError::into_inner))
}

pub fn exclusive_gpu() -> GpuUse {
    GpuUse::Exclusive(GPU_USE.write().unwrap_or_else(PoisonError::into_inner))
}

pub fn gpu() -> CudaBackend {
    CudaBackend::new(0).unwrap_or_else(|e| panic!("opening GPU 0: {e}"))
}

/// `buf` viewed as `shape`, which the test sized it for.
pub fn view<T: DeviceBuffer>(buf: &T, shape: impl Into<Shape>) -> Tensor<'_, T> {
    buf.view(shape).expect("a view the buffer holds")
}

pub fn view_mut<T: DeviceBuffer>(buf: &mut T, shape: impl Into<Shape>) -> TensorMut<'_, T> {
    buf.view_mut(shape).expect("a view the buffer holds")
}

pub fn random(rng: &mut ChaCha8Rng, len: usize, scale: f32) -> Vec<f32> {
    (0..len).map(|_| rng.gen_range(-scale..scale)).collect()
}

pub fn upload(gpu: &CudaBackend, data: &[f32]) -> CudaSlice<f32> {
    let mut buffer = gpu.alloc(data.len().max(1), "test input").expect("alloc");
    gpu.write(&mut buffer, data).expect("write");
    buffer
}

/// A GPU buffer filled with NaN, so any element a kernel fails to write shows.
pub fn poisoned(gpu: &CudaBackend, len: usize) -> CudaSlice<f32> {
    gpu.device().alloc_poisoned::<f32>(len.max(1), "poisoned output").expect("alloc")
}

pub fn download(gpu: &CudaBackend, buffer: &CudaSlice<f32>, len: usize) -> Vec<f32> {
    let mut host = vec![0f32; len];
    gpu.read(buffer, &mut host).expect("read");
    host
}

/// (relative L2 error, max absolute error) of `got` against `want`; fails on any NaN.
pub fn errors(what: &str, got: &[f32], want: &[f32]) -> (f64, f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = got.iter().position(|v| v.is_nan()) {
        panic!("{what}: element {i} is NaN (unwritten?)");
    }
    let (mut diff, mut norm, mut max_abs) = (0f64, 0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let d = (g as f64 - w as f64).abs();
        diff += d * d;
        norm += (w as f64) * (w as f64);
        max_abs = max_abs.max(d);
    }
    ((diff / norm.max(1e-30)).sqrt(), max_abs)
}

pub fn assert_close(what: &str, got: &[f32], want: &[f32], max_rel_l2: f64) {
    let (rel_l2, max_abs) = errors(what, got, want);
    assert!(rel_l2 <= max_rel_l2, "{what}: rel_l2 {rel_l2:.3e} > {max_rel_l2:.0e} (max_abs {max_abs:.3e})");
}

pub fn assert_bitwise(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!("{what}: element {i}: gpu {} cpu {}", got[i], want[i]);
    }
}

/// Blocks of every KV cache of these tests: room for the 4096-position cases, plus spare
/// blocks, so shuffled tables also use blocks past the ones a contiguous table covers.
pub const CACHE_BLOCKS: usize = 4096 / KV_BLOCK_SIZE + 8;
pub const CACHE_ROWS: usize = CACHE_BLOCKS * KV_BLOCK_SIZE;

/// Decode-only steps run the split kernels, which compute in f32 on the exact stored values
/// (f16 widened, q8_0 dequantized with its f16 scale, as the CPU does): f32 softmax and weighted
/// sums over up to 4352 rows, merged across splits in another order than the CPU's single pass,
/// differ by a few 1e-7 relative. A wrong row, scale, mask or split gives errors of order 1e-1.
pub const SPLIT_TOLERANCE: f64 = 1e-5;
/// Any step where a sequence feeds more than one token runs the tensor-core flash kernel on
/// all its tokens, which rounds Q, the probabilities P and (for f32 and q8_0 caches) K and V to
/// f16 (unit roundoff 4.9e-4): a few 1e-4 relative L2 (gpu_paged_attention.rs).
pub const FLASH_TOLERANCE: f64 = 2e-3;
/// Products of more than 8 tokens run the tensor-core mat-mat, which rounds weights and
/// activations to f16 and sums in f32: about 3e-4 relative L2 from the f32 product (matvec.rs).
pub const MATMAT_TOLERANCE: f64 = 2e-3;

/// The attention tolerance for the step in `plan` (see `CudaBackend::attention`'s choice).
pub fn attention_tolerance(plan: &FlatPlan) -> f64 {
    if plan.is_decode_only() {
        SPLIT_TOLERANCE
    } else {
        FLASH_TOLERANCE
    }
}

/// Blocks `0..` covering `len` positions.
pub fn contiguous(len: usize) -> Vec<u32> {
    (0..len.div_ceil(KV_BLOCK_SIZE) as u32).collect()
}

/// Distinct random blocks of the cache, in random order, covering `len` positions.
pub fn shuffled(rng: &mut ChaCha8Rng, len: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..CACHE_BLOCKS as u32).collect();
    ids.shuffle(rng);
    ids.truncate(len.div_ceil(KV_BLOCK_SIZE));
    ids
}

pub fn table(rng: &mut ChaCha8Rng, shuffle: bool, len: usize) -> Vec<u32> {
    if shuffle {
        shuffled(rng, len)
    } else {
        contiguous(len)
    }
}

/// A sequence's part of an attention step: `n` tokens from position `pos0`, through `table`.
pub struct Chunk {
    pub n: usize,
    pub pos0: usize,
    pub table: Vec<u32>,
}

/// One query token per listed position, each its own sequence over (the needed part of)
/// `table`: a decode-only step, which reads each position's causal view of the cache.
pub fn decode_reads(table: &[u32], positions: impl IntoIterator<Item = usize>) -> Vec<Chunk> {
    positions.into_iter().map(|pos| Chunk { n: 1, pos0: pos, table: table[..(pos + 1).div_ceil(KV_BLOCK_SIZE)].to_vec() }).collect()
}

/// The CPU reference and the GPU under test, each with a step object holding the same plan.
pub struct Pair {
    pub _gpu_use: GpuUse,
    pub cpu: CpuBackend,
    pub gpu: CudaBackend,
    pub capacity: StepCapacity,
    /// History tokens one sample keeps (the engine's `max_history`).
    pub max_history: usize,
    /// The plan last written to both steps.
    pub plan: FlatPlan,
    pub cpu_step: <CpuBackend as Backend>::Step,
    pub gpu_step: <CudaBackend as Backend>::Step,
}

impl Pair {
    /// Steps of up to `max_tokens` tokens (as many sequences, logit rows and samples), each
    /// sample with up to `max_history` history tokens, over caches of [`CACHE_BLOCKS`] blocks.
    pub fn new(max_tokens: usize, max_history: usize) -> Pair {
        Self::with_use(shared_gpu(), max_tokens, max_history)
    }

    /// For timing: no other test of this binary runs kernels meanwhile.
    pub fn alone(max_tokens: usize, max_history: usize) -> Pair {
        Self::with_use(exclusive_gpu(), max_tokens, max_history)
    }

    pub fn with_use(gpu_use: GpuUse, max_tokens: usize, max_history: usize) -> Pair {
        Self::with_config(gpu_use, RegistryConfig::default(), max_tokens, max_history)
    }

    /// With a GPU backend opened with `config`.
    pub fn with_config(gpu_use: GpuUse, config: RegistryConfig, max_tokens: usize, max_history: usize) -> Pair {
        let cpu = CpuBackend::exact();
        let gpu = CudaBackend::with_config(0, config).unwrap_or_else(|e| panic!("opening GPU 0: {e}"));
        let tokens = max_tokens.max(1);
        let capacity = StepCapacity { tokens, seqs: tokens, blocks: tokens * CACHE_BLOCKS, logit_rows: tokens, history: tokens * max_history };
        let cpu_step = cpu.alloc_step(&capacity, CACHE_BLOCKS).expect("cpu step");
        let gpu_step = gpu.alloc_step(&capacity, CACHE_BLOCKS).expect("gpu step");
        Pair { _gpu_use: gpu_use, cpu, gpu, capacity, max_history, plan: FlatPlan::with_capacity(&capacity), cpu_step, gpu_step }
    }

    /// Flattens `seqs` into `self.plan` and writes it into both step objects.
    pub fn set_plan(&mut self, seqs: &[SeqStep]) {
        self.plan.fill(&BatchPlan { seqs }, &self.capacity, CACHE_BLOCKS).expect("valid plan");
        self.cpu.write_step(&mut self.cpu_step, &self.plan).expect("cpu write_step");
        self.gpu.write_step(&mut self.gpu_step, &self.plan).expect("gpu write_step");
    }

    /// One sequence feeding `tokens` from `pos0` through blocks `0..`, sampling from its last
    /// token's logits (row 0) with these settings. No tokens (sampling-only tests): one token,
    /// so that there is one logits row. The history keeps its last `max_history` tokens, as the
    /// engine's does.
    pub fn set_step(&mut self, tokens: &[u32], pos0: usize, sampling: &SamplingParams, history: &[u32], draw: u64) {
        let tokens: &[u32] = if tokens.is_empty() { &[0] } else { tokens };
        let blocks = contiguous(pos0 + tokens.len());
        let history = &history[history.len().saturating_sub(self.max_history)..];
        let sample = SampleSpec { params: *sampling, history, draw };
        self.set_plan(&[SeqStep { tokens, pos0, blocks: &blocks, logits: LogitRows::Last, sample: Some(sample) }]);
    }

    /// One sequence feeding `n` tokens from `pos0`, without logits.
    pub fn set_positions(&mut self, n: usize, pos0: usize) {
        let tokens: Vec<u32> = (0..n as u32).collect();
        let blocks = contiguous(pos0 + n);
        self.set_plan(&[SeqStep { tokens: &tokens, pos0, blocks: &blocks, logits: LogitRows::None, sample: None }]);
    }

    /// A step of the given chunks, without logits.
    pub fn set_chunks(&mut self, chunks: &[Chunk]) {
        let tokens: Vec<Vec<u32>> = chunks.iter().map(|c| vec![0u32; c.n]).collect();
        let seqs: Vec<SeqStep> =
            chunks.iter().zip(&tokens).map(|(c, tokens)| SeqStep { tokens, pos0: c.pos0, blocks: &c.table, logits: LogitRows::None, sample: None }).collect();
        self.set_plan(&seqs);
    }

    pub fn cpu_tokens(&self, n: usize) -> Vec<u32> {
        let mut out = vec![0u32; n];
        self.cpu.sampled_tokens(&self.cpu_step, &mut out).expect("cpu sampled tokens");
        out
    }

    pub fn gpu_tokens(&self, n: usize) -> Vec<u32> {
        let mut out = vec![u32::MAX; n];
        self.gpu.sampled_tokens(&self.gpu_step, &mut out).expect("gpu sampled tokens");
        out
    }
}

/// A CPU and a GPU KV cache of the same spec, every block usable, with step objects able to
/// store into all of their rows at once.
pub struct Caches {
    pub width: usize,
    pub cpu: <CpuBackend as Backend>::KvCache,
    pub gpu: <CudaBackend as Backend>::KvCache,
    pub fill_capacity: StepCapacity,
    pub cpu_fill: <CpuBackend as Backend>::Step,
    pub gpu_fill: <CudaBackend as Backend>::Step,
}

impl Caches {
    pub fn new(pair: &Pair, width: usize, k_type: KvType, v_type: KvType) -> Caches {
        let spec = KvCacheSpec { n_blocks: CACHE_BLOCKS, width, k_type, v_type };
        let what = format!("{k_type}/{v_type} cache of {width}");
        let mut cpu = pair.cpu.alloc_kv(&spec, &what).expect("cpu cache");
        let mut gpu = pair.gpu.alloc_kv(&spec, &what).expect("gpu cache");
        pair.cpu.grow_kv(&mut cpu, CACHE_BLOCKS).expect("cpu grow");
        pair.gpu.grow_kv(&mut gpu, CACHE_BLOCKS).expect("gpu grow");
        let fill_capacity = StepCapacity { tokens: CACHE_ROWS, seqs: 1, blocks: CACHE_BLOCKS, logit_rows: 1, history: 1 };
        let cpu_fill = pair.cpu.alloc_step(&fill_capacity, CACHE_BLOCKS).expect("cpu step");
        let gpu_fill = pair.gpu.alloc_step(&fill_capacity, CACHE_BLOCKS).expect("gpu step");
        Caches { width, cpu, gpu, fill_capacity, cpu_fill, gpu_fill }
    }

    /// Stores the same random keys and values (values in [-1, 1)) at positions `0..len` of a
    /// sequence over `blocks` in both caches.
    pub fn fill(&mut self, pair: &Pair, rng: &mut ChaCha8Rng, blocks: &[u32], len: usize) {
        let tokens = vec![0u32; len];
        let mut plan = FlatPlan::default();
        let seq = SeqStep { tokens: &tokens, pos0: 0, blocks, logits: LogitRows::None, sample: None };
        plan.fill(&BatchPlan { seqs: &[seq] }, &self.fill_capacity, CACHE_BLOCKS).expect("fill plan");
        pair.cpu.write_step(&mut self.cpu_fill, &plan).expect("cpu write_step");
        pair.gpu.write_step(&mut self.gpu_fill, &plan).expect("gpu write_step");
        let (k, v) = (random(rng, len * self.width, 1.0), random(rng, len * self.width, 1.0));
        let shape = [len, self.width];
        pair.cpu.kv_store(view(&k, shape), view(&v, shape), &mut self.cpu, &self.cpu_fill).expect("cpu kv_store");
        let (gk, gv) = (upload(&pair.gpu, &k), upload(&pair.gpu, &v));
        pair.gpu.kv_store(view(&gk, shape), view(&gv, shape), &mut self.gpu, &self.gpu_fill).expect("gpu kv_store");
    }

    /// Random rows everywhere: every row of both caches holds the same values.
    pub fn fill_all(&mut self, pair: &Pair, rng: &mut ChaCha8Rng) {
        self.fill(pair, rng, &contiguous(CACHE_ROWS), CACHE_ROWS);
    }
}

/// Attention of every token of the pair's current plan over both caches, with the same fresh
/// queries: (gpu, cpu).
pub fn attend(pair: &Pair, caches: &Caches, rng: &mut ChaCha8Rng, p: &AttentionParams) -> (Vec<f32>, Vec<f32>) {
    let n = pair.plan.n_tokens();
    // Amplitude 3 against keys in [-1, 1): scores of a few units, so the softmax is neither
    // flat nor one-hot.
    let shape = [n, p.n_heads * p.head_dim];
    let q = random(rng, n * p.n_heads * p.head_dim, 3.0);
    let mut want = vec![0f32; q.len()];
    pair.cpu.attention(view(&q, shape), &caches.cpu, view_mut(&mut want, shape), &pair.cpu_step, p).expect("cpu attention");
    let (gq, mut got) = (upload(&pair.gpu, &q), poisoned(&pair.gpu, q.len()));
    pair.gpu.attention(view(&gq, shape), &caches.gpu, view_mut(&mut got, shape), &pair.gpu_step, p).expect("gpu attention");
    (download(&pair.gpu, &got, q.len()), want)
}

pub fn weight_source(name: &str, ty: GgmlType, rows: usize, cols: usize, values: &[f32]) -> WeightSource {
    let bytes = if ty == GgmlType::F32 {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    } else {
        let mut bytes = vec![0u8; kiln_quant::quantized_size(ty, values.len()).expect("block multiple")];
        kiln_quant::quantize(ty, values, &mut bytes).expect("quantize");
        bytes
    };
    let len = bytes.len();
    WeightSource { name: name.into(), ty, rows, cols, owner: Arc::new(bytes), range: 0..len }
}
