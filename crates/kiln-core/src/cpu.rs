//! The CPU backend: multi-threaded (rayon), computing straight from the
//! quantized weight bytes one row at a time, so no dequantized copy of the
//! weights ever exists. Scratch space is per thread and reused, so a decode
//! step allocates nothing once warmed up.

use std::cell::RefCell;
use std::sync::Mutex;

use kiln_quant::GgmlType;
use rayon::prelude::*;

use crate::backend::{
    AttentionParams, Backend, BackendError, DeltaNetParams, ExpertInput, Result, RopeKind, RopeParams, RouterParams, StateSlots, WeightSource,
};
use crate::cpu_int::{self, QuantizedActs, SimdLevel, MATMAT_MIN_TOKENS};
pub use crate::cpu_kv::CpuKvCache;
use crate::cpu_simd::{Simd, SimdLevel as F32Level};
use crate::plan::{FlatPlan, KvCacheSpec, StepCapacity};
use crate::sampling;
use crate::shapes;
use crate::tensor::{expect_shape, Tensor, TensorMut};
use crate::{cpu_attention, cpu_ops, cpu_recurrent};

/// How the CPU backend multiplies by quantized weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuMatmul {
    /// Activations quantized to 8 bits once per matmul, integer dot products on the
    /// packed weights (as llama.cpp's CPU backend): the fast path.
    Quantized,
    /// Every weight row dequantized to f32 and dotted in f32: the numerical reference.
    Exact,
}

/// The CPU backend's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuOptions {
    pub matmul: CpuMatmul,
    /// The instruction set of the kernels (must be available on this CPU); the f32 kernels
    /// (attention, norms) run at the matching level.
    pub simd: SimdLevel,
}

impl Default for CpuOptions {
    fn default() -> Self {
        CpuOptions { matmul: CpuMatmul::Quantized, simd: SimdLevel::detect() }
    }
}

pub struct CpuBackend {
    options: CpuOptions,
    /// Quantized-activation buffers, taken for the length of one matmul and put back,
    /// so that steps reuse them without allocating and concurrent callers never share one.
    acts: Mutex<Vec<QuantizedActs>>,
    /// The level of the f32 kernels.
    simd: Simd,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::with_options(CpuOptions::default())
    }
}

impl CpuBackend {
    /// The fast backend: quantized activations, the best SIMD level of this CPU.
    pub fn new() -> Self {
        CpuBackend::default()
    }

    /// The reference backend: exact f32 dot products on dequantized weights.
    pub fn exact() -> Self {
        CpuBackend::with_options(CpuOptions { matmul: CpuMatmul::Exact, ..CpuOptions::default() })
    }

    /// # Panics
    /// If `options.simd` is not available on this CPU.
    pub fn with_options(options: CpuOptions) -> Self {
        assert!(options.simd.is_available(), "{:?} is not available on this CPU", options.simd);
        let f32_level = match options.simd {
            SimdLevel::Avx512Vnni => F32Level::Avx512,
            SimdLevel::Avx2 | SimdLevel::AvxVnni => F32Level::Avx2,
            SimdLevel::Neon | SimdLevel::NeonDot => F32Level::Neon,
            SimdLevel::Scalar => F32Level::Scalar,
        };
        let simd = Simd::at(f32_level).or_else(|| Simd::at(F32Level::Scalar)).expect("the scalar level is always available");
        CpuBackend { options, acts: Mutex::new(Vec::new()), simd }
    }

    /// A backend whose f32 kernels run at `simd`'s level, so tests can compare levels.
    pub fn with_simd(simd: Simd) -> Self {
        CpuBackend { simd, ..CpuBackend::default() }
    }

    pub fn options(&self) -> CpuOptions {
        self.options
    }
}

pub struct CpuStep {
    plan: FlatPlan,
    capacity: StepCapacity,
    cache_blocks: usize,
    sampled: Vec<u32>,
    logits: Vec<f32>,
    candidates: Vec<(f32, u32)>,
}

impl CpuStep {
    /// The plan of the last `write_step`.
    pub fn plan(&self) -> &FlatPlan {
        &self.plan
    }
}

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's scratch vector, grown to at least `len`.
pub(crate) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < len {
            // Start big (256 KiB) and grow by powers of two, so a thread's scratch
            // settles at once and decode steps stop allocating.
            s.resize(len.next_power_of_two().max(1 << 16), 0.0);
        }
        f(&mut s[..len])
    })
}

/// A raw output pointer that rayon tasks write disjoint elements through.
#[derive(Clone, Copy)]
pub(crate) struct SharedOut(pub(crate) *mut f32);
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}
impl SharedOut {
    /// # Safety
    /// No other task may touch `at..at + len` while the slice lives, and it must be in bounds.
    pub(crate) unsafe fn slice_mut<'a>(self, at: usize, len: usize) -> &'a mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(at), len)
    }

    /// # Safety
    /// No two tasks may write the same index, and `i` must be in bounds.
    pub(crate) unsafe fn write(self, i: usize, v: f32) {
        *self.0.add(i) = v;
    }
}

#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators let the compiler vectorize the loop.
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        let (x, y) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut tail = 0.0;
    for i in chunks * 8..a.len() {
        tail += a[i] * b[i];
    }
    acc.iter().sum::<f32>() + tail
}

pub(crate) fn check_len(what: &str, have: usize, need: usize) -> Result<()> {
    if have < need {
        return Err(BackendError::Device(format!("{what}: buffer of {have} values, op needs {need}")));
    }
    Ok(())
}

/// Row `r` of a weight as f32: borrowed when already f32 and aligned,
/// otherwise dequantized into `buf`.
pub(crate) fn weight_row<'a>(w: &'a WeightSource, r: usize, buf: &'a mut [f32]) -> &'a [f32] {
    let row_bytes = w.cols / w.ty.block_size() * w.ty.type_size();
    let bytes = &w.bytes()[r * row_bytes..(r + 1) * row_bytes];
    if w.ty == GgmlType::F32 && (bytes.as_ptr() as usize).is_multiple_of(4) {
        // SAFETY: aligned, length is cols * 4, and every bit pattern is a valid f32.
        return unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const f32, w.cols) };
    }
    // Validated at upload: the row holds exactly `cols` values of a dequantizable type.
    kiln_quant::dequantize(w.ty, bytes, buf).expect("row validated at upload");
    buf
}

impl Backend for CpuBackend {
    type Buffer = Vec<f32>;
    type Weight = WeightSource;
    type Step = CpuStep;
    type NormedInput = std::convert::Infallible;
    type KvCache = CpuKvCache;

    fn name(&self) -> String {
        let kernels = match (self.options.matmul, self.options.simd) {
            (CpuMatmul::Exact, _) => "exact f32",
            (_, SimdLevel::Avx512Vnni) => "AVX-512 VNNI",
            (_, SimdLevel::AvxVnni) => "AVX-VNNI",
            (_, SimdLevel::Avx2) => "AVX2",
            (_, SimdLevel::NeonDot) => "NEON dot product",
            (_, SimdLevel::Neon) => "NEON",
            (_, SimdLevel::Scalar) => "scalar",
        };
        format!("CPU ({} threads, {kernels})", rayon::current_num_threads())
    }

    fn upload_weight(&self, src: WeightSource) -> Result<WeightSource> {
        src.validate()?;
        if !kiln_quant::can_dequantize(src.ty) {
            return Err(BackendError::Unsupported { backend: "CPU".into(), what: format!("weights of type {} ({})", src.ty, src.name) });
        }
        if src.ty == GgmlType::TQ1_0 && self.options.matmul == CpuMatmul::Quantized {
            return as_tq2_0(&src);
        }
        Ok(src)
    }

    fn alloc(&self, len: usize, what: &str) -> Result<Vec<f32>> {
        let mut v = Vec::new();
        v.try_reserve_exact(len).map_err(|_| BackendError::OutOfMemory {
            device: "host".into(),
            what: what.into(),
            requested_bytes: len as u64 * 4,
            free_bytes: None,
        })?;
        v.resize(len, 0.0);
        Ok(v)
    }

    fn write(&self, dst: &mut Vec<f32>, src: &[f32]) -> Result<()> {
        check_len("write", dst.len(), src.len())?;
        dst[..src.len()].copy_from_slice(src);
        Ok(())
    }

    fn read(&self, src: &Vec<f32>, dst: &mut [f32]) -> Result<()> {
        check_len("read", src.len(), dst.len())?;
        dst.copy_from_slice(&src[..dst.len()]);
        Ok(())
    }

    fn alloc_kv(&self, spec: &KvCacheSpec, what: &str) -> Result<CpuKvCache> {
        CpuKvCache::new(spec, what)
    }

    fn grow_kv(&self, cache: &mut CpuKvCache, n_blocks: usize) -> Result<()> {
        cache.grow(n_blocks)
    }

    fn alloc_step(&self, capacity: &StepCapacity, cache_blocks: usize) -> Result<CpuStep> {
        let plan = FlatPlan::with_capacity(capacity);
        Ok(CpuStep { plan, capacity: *capacity, cache_blocks, sampled: Vec::with_capacity(capacity.seqs), logits: Vec::new(), candidates: Vec::new() })
    }

    fn write_step(&self, step: &mut CpuStep, plan: &FlatPlan) -> Result<()> {
        plan.check_fits(&step.capacity, step.cache_blocks)?;
        step.plan.assign(plan);
        Ok(())
    }

    fn embed(&self, table: &WeightSource, step: &CpuStep, mut out: TensorMut<Vec<f32>>) -> Result<()> {
        let dim = table.cols;
        let n = shapes::embed(out.shape(), dim)?;
        check_len("embed tokens in the step", step.plan.n_tokens(), n)?;
        let out = out.data_mut();
        for (t, &tok) in step.plan.tokens[..n].iter().enumerate() {
            if tok as usize >= table.rows {
                return Err(BackendError::Device(format!("token id {tok} is outside the {}-row embedding table", table.rows)));
            }
            let dst = &mut out[t * dim..(t + 1) * dim];
            let dst_ptr = dst.as_ptr();
            let row = weight_row(table, tok as usize, dst);
            if row.as_ptr() != dst_ptr {
                // Borrowed f32 row: copy it in. (Dequantized rows were written in place.)
                let row: *const [f32] = row;
                // SAFETY: `row` points into the weight bytes, which do not alias `out`.
                out[t * dim..(t + 1) * dim].copy_from_slice(unsafe { &*row });
            }
        }
        Ok(())
    }

    fn rms_norm(&self, x: Tensor<Vec<f32>>, weight: Tensor<Vec<f32>>, mut out: TensorMut<Vec<f32>>, eps: f32) -> Result<()> {
        let (_, dim) = shapes::rms_norm(x.shape(), weight.shape(), out.shape())?;
        if dim == 0 {
            return Ok(());
        }
        for (xr, or) in x.data().chunks_exact(dim).zip(out.data_mut().chunks_exact_mut(dim)) {
            let ms = self.simd.sum_squares(xr) / dim as f32;
            self.simd.rms_apply(xr, 1.0 / (ms + eps).sqrt(), weight.data(), or);
        }
        Ok(())
    }

    fn matmul(&self, w: &WeightSource, x: Tensor<Vec<f32>>, mut out: TensorMut<Vec<f32>>) -> Result<()> {
        let (rows, cols) = (w.rows, w.cols);
        let n = shapes::matmul("matmul", (rows, cols), x.shape(), out.shape())?;
        let x = x.data();
        let dst = SharedOut(out.data_mut().as_mut_ptr());
        if self.options.matmul == CpuMatmul::Quantized && cpu_int::supports(w) {
            let mut acts = self.acts.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_default();
            acts.quantize(x, n, cols, n >= MATMAT_MIN_TOKENS);
            cpu_int::matmul(self.options.simd, w, &acts, dst);
            self.acts.lock().unwrap_or_else(|e| e.into_inner()).push(acts);
            return Ok(());
        }
        if self.options.matmul == CpuMatmul::Quantized && cpu_int::float::supports(self.options.simd, w) {
            cpu_int::float::matmul(self.options.simd, self.simd, w, x, n, dst);
            return Ok(());
        }
        // Blocks of rows amortize rayon's scheduling over the small rows of tiny models.
        let rows_per_task = (16384 / cols.max(1)).clamp(1, 64);
        (0..rows.div_ceil(rows_per_task)).into_par_iter().for_each(|task| {
            with_scratch(cols, |buf| {
                for r in task * rows_per_task..((task + 1) * rows_per_task).min(rows) {
                    let row = weight_row(w, r, buf);
                    for t in 0..n {
                        let v = dot_f32(row, &x[t * cols..(t + 1) * cols]);
                        // SAFETY: each (t, r) is written by the one task owning row r; in bounds by the shapes.
                        unsafe { dst.write(t * rows + r, v) };
                    }
                }
            })
        });
        Ok(())
    }

    fn add_bias(&self, mut x: TensorMut<Vec<f32>>, bias: Tensor<Vec<f32>>) -> Result<()> {
        let (_, dim) = shapes::rows_and_vector("add_bias", x.shape(), bias.shape())?;
        if dim == 0 {
            return Ok(());
        }
        for row in x.data_mut().chunks_exact_mut(dim) {
            for (v, b) in row.iter_mut().zip(bias.data()) {
                *v += b;
            }
        }
        Ok(())
    }

    fn add(&self, mut x: TensorMut<Vec<f32>>, y: Tensor<Vec<f32>>) -> Result<()> {
        shapes::elementwise("add", &[("y", y.shape())], x.shape())?;
        for (a, b) in x.data_mut().iter_mut().zip(y.data()) {
            *a += b;
        }
        Ok(())
    }

    fn swiglu(&self, gate: Tensor<Vec<f32>>, up: Tensor<Vec<f32>>, mut out: TensorMut<Vec<f32>>) -> Result<()> {
        shapes::elementwise("swiglu", &[("gate", gate.shape()), ("up", up.shape())], out.shape())?;
        self.simd.swiglu(gate.data(), up.data(), out.data_mut());
        Ok(())
    }

    fn rope(&self, mut x: TensorMut<Vec<f32>>, inv_freq: Tensor<Vec<f32>>, step: &CpuStep, p: &RopeParams) -> Result<()> {
        let ([n, n_heads, head_dim], n_rot) = shapes::rope(x.shape(), inv_freq.shape())?;
        let width = n_heads * head_dim;
        check_len("rope tokens in the step", step.plan.n_tokens(), n)?;
        let (half, x, inv_freq) = (n_rot / 2, x.data_mut(), inv_freq.data());
        if head_dim == 0 {
            return Ok(());
        }
        // One table of angles per token serves every head.
        with_scratch(2 * half, |table| {
            let (sins, coss) = table.split_at_mut(half);
            for t in 0..n {
                let pos = step.plan.positions[t] as f32;
                for ((s, c), f) in sins.iter_mut().zip(coss.iter_mut()).zip(inv_freq) {
                    (*s, *c) = (pos * f).sin_cos();
                }
                for head in x[t * width..(t + 1) * width].chunks_exact_mut(head_dim) {
                    match p.kind {
                        RopeKind::Normal => {
                            for ((pair, &sin), &cos) in head[..2 * half].chunks_exact_mut(2).zip(&*sins).zip(&*coss) {
                                let (x0, x1) = (pair[0], pair[1]);
                                pair[0] = x0 * cos - x1 * sin;
                                pair[1] = x0 * sin + x1 * cos;
                            }
                        }
                        RopeKind::Neox => {
                            let (lo, hi) = head[..2 * half].split_at_mut(half);
                            for (((a, b), &sin), &cos) in lo.iter_mut().zip(hi.iter_mut()).zip(&*sins).zip(&*coss) {
                                let (x0, x1) = (*a, *b);
                                *a = x0 * cos - x1 * sin;
                                *b = x0 * sin + x1 * cos;
                            }
                        }
                    }
                }
            }
        });
        Ok(())
    }

    fn kv_store(&self, k: Tensor<Vec<f32>>, v: Tensor<Vec<f32>>, cache: &mut CpuKvCache, step: &CpuStep) -> Result<()> {
        let width = cache.spec.width;
        let n = shapes::kv_store(k.shape(), v.shape(), width)?;
        check_len("kv_store tokens in the step", step.plan.n_tokens(), n)?;
        step.plan.check_usable(cache.usable_rows() / crate::plan::KV_BLOCK_SIZE)?;
        let (k, v) = (k.data(), v.data());
        for (t, &slot) in step.plan.slots[..n].iter().enumerate() {
            cache.store(slot as usize, &k[t * width..(t + 1) * width], &v[t * width..(t + 1) * width]);
        }
        Ok(())
    }

    fn attention(&self, q: Tensor<Vec<f32>>, cache: &CpuKvCache, out: TensorMut<Vec<f32>>, step: &CpuStep, p: &AttentionParams) -> Result<()> {
        cpu_attention::attention(self.simd, q, cache, None, out, step, p)
    }

    fn sigmoid_gate(&self, mut x: TensorMut<Vec<f32>>, gate: Tensor<Vec<f32>>) -> Result<()> {
        let (_, dim, gate_dim) = shapes::sigmoid_gate(x.shape(), gate.shape())?;
        let (per, gate) = (dim / gate_dim, gate.data());
        for (i, v) in x.data_mut().iter_mut().enumerate() {
            let g = gate[i / per];
            *v /= 1.0 + (-g).exp();
        }
        Ok(())
    }

    fn delta_net_gates(&self, mut g: TensorMut<Vec<f32>>, mut beta: TensorMut<Vec<f32>>, a_log_neg: Tensor<Vec<f32>>, dt_bias: Tensor<Vec<f32>>) -> Result<()> {
        let (n, n_heads) = shapes::delta_net_gates(g.shape(), beta.shape(), a_log_neg.shape(), dt_bias.shape())?;
        cpu_recurrent::delta_net_gates(g.data_mut(), beta.data_mut(), a_log_neg.data(), dt_bias.data(), n, n_heads)
    }

    fn ssm_conv(
        &self,
        x: Tensor<Vec<f32>>,
        weight: Tensor<Vec<f32>>,
        state: StateSlots<Vec<f32>>,
        out: TensorMut<Vec<f32>>,
        step: &CpuStep,
        p: &DeltaNetParams,
    ) -> Result<()> {
        cpu_recurrent::ssm_conv(x, weight, state, out, &step.plan, p)
    }

    fn delta_net(
        &self,
        x: Tensor<Vec<f32>>,
        gates: [Tensor<Vec<f32>>; 2],
        state: StateSlots<Vec<f32>>,
        mut out: TensorMut<Vec<f32>>,
        step: &CpuStep,
        p: &DeltaNetParams,
    ) -> Result<()> {
        let StateSlots { mut state, slots } = state;
        let n = shapes::delta_net(x.shape(), gates.map(|g| g.shape()), state.shape(), out.shape(), p)?;
        let io = cpu_recurrent::DeltaNetIo {
            x: x.data(),
            g: gates[0].data(),
            beta: gates[1].data(),
            state: state.data_mut(),
            slots: slots.data(),
            out: out.data_mut(),
        };
        cpu_recurrent::delta_net(self.simd, io, &step.plan, n, p)
    }

    fn attention_sinks(
        &self,
        q: Tensor<Vec<f32>>,
        cache: &CpuKvCache,
        sinks: Tensor<Vec<f32>>,
        out: TensorMut<Vec<f32>>,
        step: &CpuStep,
        p: &AttentionParams,
    ) -> Result<()> {
        cpu_attention::attention(self.simd, q, cache, Some(sinks), out, step, p)
    }

    fn moe_route(
        &self,
        logits: Tensor<Vec<f32>>,
        expert_scale: Option<Tensor<Vec<f32>>>,
        mut ids: TensorMut<Vec<f32>>,
        mut weights: TensorMut<Vec<f32>>,
        p: &RouterParams,
    ) -> Result<()> {
        let counts = shapes::moe_route(logits.shape(), expert_scale.map(|s| s.shape()), ids.shape(), weights.shape(), p.shared_expert)?;
        cpu_ops::moe_route(logits.data(), expert_scale.map(|s| s.data()), ids.data_mut(), weights.data_mut(), counts, p)
    }

    fn moe_matmul(&self, experts: &[WeightSource], x: Tensor<Vec<f32>>, ids: Tensor<Vec<f32>>, mut out: TensorMut<Vec<f32>>, input: ExpertInput) -> Result<()> {
        let first = experts.first().ok_or_else(|| BackendError::Device("expert product over no experts".into()))?;
        let (n, n_used) = shapes::moe_matmul((first.rows, first.cols), x.shape(), ids.shape(), out.shape(), input)?;
        let (x, ids, out) = (x.data(), ids.data(), out.data_mut());
        let quantized = self.options.matmul == CpuMatmul::Quantized && cpu_int::supports(first);
        if !quantized || experts.iter().any(|w| w.ty != experts[0].ty) {
            return cpu_ops::moe_matmul(experts, x, ids, out, n, n_used, input);
        }
        let cols = experts[0].cols;
        let in_rows = if input == ExpertInput::PerSlot { n * n_used } else { n };
        cpu_ops::check_moe_args(experts, x, ids, out, n, n_used, input)?;
        let mut acts = self.acts.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_default();
        acts.quantize(x, in_rows, cols, false);
        let per_slot = input == ExpertInput::PerSlot;
        let input_row = move |slot: usize| if per_slot { slot } else { slot / n_used };
        cpu_int::moe_matmul(self.options.simd, experts, &acts, ids, input_row, SharedOut(out.as_mut_ptr()));
        self.acts.lock().unwrap_or_else(|e| e.into_inner()).push(acts);
        Ok(())
    }

    fn moe_add_bias(&self, mut x: TensorMut<Vec<f32>>, bias: Tensor<Vec<f32>>, ids: Tensor<Vec<f32>>) -> Result<()> {
        let (n, n_used, dim, _) = shapes::moe_add_bias(x.shape(), bias.shape(), ids.shape())?;
        cpu_ops::moe_add_bias(x.data_mut(), bias.data(), ids.data(), n, n_used, dim)
    }

    fn swiglu_oai(&self, gate: Tensor<Vec<f32>>, up: Tensor<Vec<f32>>, mut out: TensorMut<Vec<f32>>, alpha: f32, limit: f32) -> Result<()> {
        shapes::elementwise("swiglu_oai", &[("gate", gate.shape()), ("up", up.shape())], out.shape())?;
        for ((o, g), u) in out.data_mut().iter_mut().zip(gate.data()).zip(up.data()) {
            *o = cpu_ops::swiglu_oai(*g, *u, alpha, limit);
        }
        Ok(())
    }

    fn moe_combine(&self, y: Tensor<Vec<f32>>, weights: Tensor<Vec<f32>>, mut out: TensorMut<Vec<f32>>) -> Result<()> {
        let (n, n_used, dim) = shapes::moe_combine(y.shape(), weights.shape(), out.shape())?;
        cpu_ops::moe_combine(y.data(), weights.data(), out.data_mut(), n, n_used, dim)
    }

    fn geglu(&self, gate: Tensor<Vec<f32>>, up: Tensor<Vec<f32>>, mut out: TensorMut<Vec<f32>>) -> Result<()> {
        shapes::elementwise("geglu", &[("gate", gate.shape()), ("up", up.shape())], out.shape())?;
        self.simd.geglu(gate.data(), up.data(), out.data_mut());
        Ok(())
    }

    fn scale(&self, mut x: TensorMut<Vec<f32>>, s: f32) -> Result<()> {
        x.data_mut().iter_mut().for_each(|v| *v *= s);
        Ok(())
    }

    fn softcap(&self, mut x: TensorMut<Vec<f32>>, cap: f32) -> Result<()> {
        if !(cap > 0.0 && cap.is_finite()) {
            return Err(BackendError::Device(format!("softcap: cap {cap} is not positive")));
        }
        x.data_mut().iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
        Ok(())
    }

    fn copy_cols(&self, src: Tensor<Vec<f32>>, col: usize, mut dst: TensorMut<Vec<f32>>) -> Result<()> {
        let (_, src_width, width) = shapes::copy_cols(src.shape(), col, dst.shape())?;
        if width == 0 {
            return Ok(());
        }
        let src = src.data();
        for (t, d) in dst.data_mut().chunks_exact_mut(width).enumerate() {
            d.copy_from_slice(&src[t * src_width + col..t * src_width + col + width]);
        }
        Ok(())
    }

    fn copy(&self, src: Tensor<Vec<f32>>, mut dst: TensorMut<Vec<f32>>) -> Result<()> {
        shapes::elementwise("copy", &[("src", src.shape())], dst.shape())?;
        dst.data_mut().copy_from_slice(src.data());
        Ok(())
    }

    fn gather_rows(&self, src: Tensor<Vec<f32>>, mut dst: TensorMut<Vec<f32>>, step: &CpuStep) -> Result<()> {
        let rows = &step.plan.logit_rows;
        let (n, dim) = shapes::gather_rows(src.shape(), dst.shape(), rows.len())?;
        let (src, dst) = (src.data(), dst.data_mut());
        for (i, &r) in rows.iter().enumerate() {
            let r = r as usize;
            check_len("gather_rows source rows", n, r + 1)?;
            dst[i * dim..(i + 1) * dim].copy_from_slice(&src[r * dim..(r + 1) * dim]);
        }
        Ok(())
    }

    fn sample(&self, logits: Tensor<Vec<f32>>, step: &mut CpuStep) -> Result<()> {
        let [_, n_vocab] = logits.shape().dims2("sample", "logits")?;
        expect_shape("sample", "logits", logits.shape(), [step.plan.logit_rows.len(), n_vocab])?;
        let logits = logits.data();
        step.sampled.clear();
        if step.candidates.capacity() < n_vocab {
            step.candidates.reserve(n_vocab - step.candidates.len());
        }
        for i in 0..step.plan.samples.len() {
            let s = step.plan.samples[i];
            let row = s.logit_row as usize;
            step.logits.clear();
            step.logits.extend_from_slice(&logits[row * n_vocab..(row + 1) * n_vocab]);
            let token = sampling::sample(&mut step.logits, step.plan.sample_history(i), &s.params, s.draw, &mut step.candidates);
            step.sampled.push(token);
        }
        Ok(())
    }

    fn sampled_tokens(&self, step: &CpuStep, out: &mut [u32]) -> Result<()> {
        check_len("sampled tokens", step.sampled.len(), out.len())?;
        out.copy_from_slice(&step.sampled[..out.len()]);
        Ok(())
    }
}

/// A TQ1_0 weight as TQ2_0: the same ternary values under the same scales (exactly: each
/// block's scale is its largest magnitude), in 2-bit fields the integer kernels unpack with
/// shifts and masks instead of base-3 digits. 22% more bytes, as the CUDA backend stores it too;
/// the fast path decodes TQ1_0 at about half the speed of TQ2_0.
fn as_tq2_0(src: &WeightSource) -> Result<WeightSource> {
    let bad = |e: kiln_quant::QuantError| BackendError::BadWeight { name: src.name.clone(), reason: e.to_string() };
    let (n, block) = (src.rows * src.cols, GgmlType::TQ1_0.block_size());
    let (in_block, out_block) = (GgmlType::TQ1_0.type_size(), GgmlType::TQ2_0.type_size());
    let mut bytes = vec![0u8; kiln_quant::quantized_size(GgmlType::TQ2_0, n).map_err(bad)?];
    // A few thousand blocks at a time, so the f32 values in between stay small.
    const CHUNK_BLOCKS: usize = 4096;
    let mut values = vec![0f32; CHUNK_BLOCKS * block];
    for (src_chunk, dst_chunk) in src.bytes().chunks(CHUNK_BLOCKS * in_block).zip(bytes.chunks_mut(CHUNK_BLOCKS * out_block)) {
        let len = src_chunk.len() / in_block * block;
        kiln_quant::dequantize(GgmlType::TQ1_0, src_chunk, &mut values[..len]).map_err(bad)?;
        kiln_quant::quantize(GgmlType::TQ2_0, &values[..len], dst_chunk).map_err(bad)?;
    }
    let len = bytes.len();
    Ok(WeightSource { name: src.name.clone(), ty: GgmlType::TQ2_0, rows: src.rows, cols: src.cols, owner: std::sync::Arc::new(bytes), range: 0..len })
}

#[cfg(test)]
#[path = "cpu_tests.rs"]
mod tests;
