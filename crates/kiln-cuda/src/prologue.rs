//! The attention prologue of the CUDA backend (rope.cu): per-head RMSNorm of q and k, rotary
//! embedding of both and the step's keys and values stored at their cache rows, in one launch
//! for f16 and f32 caches (a second one quantizes into a q8_0 cache).

// `usize::is_multiple_of` needs Rust 1.87; the workspace supports 1.85.
#![allow(clippy::manual_is_multiple_of)]

use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use kiln_core::backend::{Backend, BackendError, QkNorm, Qkv, Result, RopeKind, RopeParams};
use kiln_core::plan::{KvCacheSpec, KvType};
use kiln_core::shapes;
use kiln_core::tensor::expect_shape;
use std::sync::PoisonError;

use crate::backend::{backend_error, check_len, launch_error, to_u32, View};
use crate::kv::{kv_type_code, CudaKvCache};
use crate::{CudaBackend, CudaStep};

/// `rope.cu`'s PROLOGUE_WARPS and PROLOGUE_MAX_HEAD_DIM.
const PROLOGUE_WARPS: usize = 4;
const PROLOGUE_MAX_HEAD_DIM: usize = 512;

/// The per-head RMSNorm weights of the prologue (`[head_dim]` each): q's and k's, and v's where
/// values are normed too (f16 and f32 caches only), with eps.
pub struct HeadNorms<'a> {
    pub q: View<'a>,
    pub k: View<'a>,
    pub v: Option<View<'a>>,
    pub eps: f32,
}

/// The prologue and store kernels of one (K type, V type) pair of cache element types.
#[derive(Clone)]
pub(crate) struct StoreKernels {
    prologue: CudaFunction,
    pub(crate) kv_store: CudaFunction,
}

impl CudaBackend {
    pub(crate) fn store_kernels(&self, spec: &KvCacheSpec) -> Result<StoreKernels> {
        let mut cache = self.store_kernels.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(found) = cache.get(&(spec.k_type, spec.v_type)) {
            return Ok(found.clone());
        }
        let defines = [("K_TYPE", kv_type_code(spec.k_type)), ("V_TYPE", kv_type_code(spec.v_type))];
        let load = |kernel| self.device().registry().function("rope", kernel, &defines).map_err(backend_error);
        let kernels = StoreKernels { prologue: load("qk_norm_rope_store")?, kv_store: load("kv_store")? };
        cache.insert((spec.k_type, spec.v_type), kernels.clone());
        Ok(kernels)
    }

    /// The attention prologue in one launch instead of five: per-head RMSNorm of q
    /// (`[n, n_heads, head_dim]`), k (`[n, n_kv_heads, head_dim]`) and, where its weight is
    /// given, v when `norms` are given, rotary embedding of q and k at the tokens' positions (q
    /// in place), and k, v stored at the tokens' cache rows (for a q8_0 cache, the roped keys go
    /// back to `k` and a second launch quantizes both into the cache; such a cache takes no
    /// value norm). Computes what `rms_norm` (up to three times), `rope` (twice) and `kv_store`
    /// compute.
    pub fn qk_norm_rope_store(
        &self,
        qkv: Qkv<CudaSlice<f32>>,
        norms: Option<HeadNorms>,
        inv_freq: View,
        rope: &RopeParams,
        cache: &mut CudaKvCache,
        step: &CudaStep,
    ) -> Result<()> {
        let Qkv { mut q, mut k, v } = qkv;
        let ([n, n_heads, hd], n_rot) = shapes::rope(q.shape(), inv_freq.shape())?;
        let [_, n_kv_heads, _] = k.shape().dims3("attention_prologue", "k")?;
        let kv_width = n_kv_heads * hd;
        expect_shape("attention_prologue", "k", k.shape(), [n, n_kv_heads, hd])?;
        expect_shape("attention_prologue", "v", v.shape(), [n, kv_width])?;
        check_len("prologue tokens in the step", step.n_tokens, n)?;
        if hd > PROLOGUE_MAX_HEAD_DIM || kv_width == 0 {
            return Err(BackendError::Unsupported { backend: "CUDA".into(), what: format!("the fused prologue for head_dim {hd}, n_rot {n_rot}") });
        }
        if cache.spec.width != kv_width {
            return Err(BackendError::Device(format!("prologue: cache rows of {} values, keys of {kv_width}", cache.spec.width)));
        }
        step.check_usable(cache)?;
        let fused = stores_in_prologue(&cache.spec);
        if let Some(norms) = &norms {
            expect_shape("attention_prologue", "q norm", norms.q.shape(), [hd])?;
            expect_shape("attention_prologue", "k norm", norms.k.shape(), [hd])?;
            match norms.v {
                Some(_) if !fused => return Err(BackendError::Device("prologue: a value norm with a q8_0 cache, whose values kv_store writes".into())),
                Some(v_norm) => expect_shape("attention_prologue", "v norm", v_norm.shape(), [hd])?,
                None => {}
            }
        }
        let rows = n * (n_heads + if fused { 2 } else { 1 } * n_kv_heads);
        if rows == 0 {
            return Ok(());
        }
        let kernels = self.store_kernels(&cache.spec)?;
        let stream = self.device().stream();
        let (q_ptr, _q_record) = q.buf_mut().device_ptr(stream);
        let (k_ptr, _k_record) = k.buf_mut().device_ptr(stream);
        let weights = norms.as_ref().map_or([None; 3], |n| [Some(n.q.buf()), Some(n.k.buf()), n.v.map(|v| v.buf())]);
        let [(q_norm, _q_record), (k_norm, _k_record), (v_norm, _v_record)] = weights.map(|w| match w {
            Some(w) => {
                let (ptr, record) = w.device_ptr(stream);
                (ptr, Some(record))
            }
            None => (0u64, None),
        });
        let eps = norms.as_ref().map_or(0.0, |n| n.eps);
        let (k_cache, v_cache) = cache.pointers();
        let ints = [
            to_u32("tokens", n)?,
            to_u32("heads", n_heads)?,
            to_u32("kv heads", n_kv_heads)?,
            to_u32("head_dim", hd)?,
            to_u32("n_rot", n_rot)?,
            u32::from(rope.kind == RopeKind::Neox),
        ];
        let blocks = to_u32("prologue blocks", rows.div_ceil(PROLOGUE_WARPS))?;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (PROLOGUE_WARPS as u32 * 32, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: matches rope.cu's qk_norm_rope_store; q_out aliases q and k_out aliases k, which
        // the kernel allows (each warp stages its row in shared memory); lengths checked above,
        // and the step's slots lie in blocks the engine made usable.
        unsafe {
            stream
                .launch_builder(&kernels.prologue)
                .arg(&q_ptr)
                .arg(&k_cache)
                .arg(&v_cache)
                .arg(&k_ptr)
                .arg(&q_ptr)
                .arg(&k_ptr)
                .arg(v.buf())
                .arg(&q_norm)
                .arg(&k_norm)
                .arg(&v_norm)
                .arg(inv_freq.buf())
                .arg(&step.block)
                .arg(&ints[0])
                .arg(&ints[1])
                .arg(&ints[2])
                .arg(&ints[3])
                .arg(&ints[4])
                .arg(&ints[5])
                .arg(&eps)
                .launch(cfg)
        }
        .map_err(launch_error("qk_norm_rope_store"))?;
        if !fused {
            self.launch_kv_store(&kernels.kv_store, k_ptr, v.buf(), cache, step, n)?;
        }
        Ok(())
    }

    /// The attention prologue of [`Backend::attention_prologue`](kiln_core::Backend): a value
    /// norm runs in the prologue's launch where that stores the values, else in one of its own.
    pub(crate) fn launch_attention_prologue(
        &self,
        qkv: Qkv<CudaSlice<f32>>,
        qk_norm: Option<QkNorm<CudaSlice<f32>>>,
        inv_freq: View,
        rope: &RopeParams,
        cache: &mut CudaKvCache,
        step: &CudaStep,
    ) -> Result<()> {
        let Some(QkNorm { q: q_norm, k: k_norm, eps, v: v_norm, .. }) = qk_norm else {
            return self.qk_norm_rope_store(qkv, None, inv_freq, rope, cache, step);
        };
        let norms = |v| Some(HeadNorms { q: q_norm, k: k_norm, v, eps });
        match v_norm {
            Some((weight, mut normed)) if !stores_in_prologue(&cache.spec) => {
                let Qkv { q, k, v } = qkv;
                let [n, heads, head_dim] = k.shape().dims3("attention_prologue", "k")?;
                self.rms_norm(v.reshape([n, heads, head_dim])?, weight, normed.reborrow(), eps)?;
                let qkv = Qkv { q, k, v: normed.as_ref().reshape([n, heads * head_dim])? };
                self.qk_norm_rope_store(qkv, norms(None), inv_freq, rope, cache, step)
            }
            v_norm => self.qk_norm_rope_store(qkv, norms(v_norm.map(|(weight, _)| weight)), inv_freq, rope, cache, step),
        }
    }

    pub(crate) fn launch_kv_store(&self, function: &CudaFunction, k: u64, v: &CudaSlice<f32>, cache: &CudaKvCache, step: &CudaStep, n: usize) -> Result<()> {
        let width = cache.spec.width;
        let units = n * width.div_ceil(32) * 2;
        if units == 0 {
            return Ok(());
        }
        let (k_cache, v_cache) = cache.pointers();
        let (n32, width32, rows32) = (to_u32("tokens", n)?, to_u32("cache width", width)?, to_u32("cache rows", cache.spec.rows())?);
        // SAFETY: matches rope.cu's kv_store; k and v hold n rows of `width` values (checked by
        // the callers), and the step's slots lie in blocks the engine made usable.
        unsafe {
            self.device()
                .stream()
                .launch_builder(function)
                .arg(&k_cache)
                .arg(&v_cache)
                .arg(&k)
                .arg(v)
                .arg(&step.block)
                .arg(&n32)
                .arg(&width32)
                .arg(&rows32)
                .launch(self.grid_stride(units * 32))
        }
        .map(drop)
        .map_err(launch_error("kv_store"))
    }
}

/// Whether the prologue's launch stores keys and values itself (f16 and f32 caches; a q8_0
/// cache takes a kv_store launch after it).
fn stores_in_prologue(spec: &KvCacheSpec) -> bool {
    spec.k_type != KvType::Q8_0 && spec.v_type != KvType::Q8_0
}
