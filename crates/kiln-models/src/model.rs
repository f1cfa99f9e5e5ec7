//! One transformer implementation for llama, qwen2 and qwen3, over any backend.

use std::sync::Arc;

use kiln_core::backend::AttentionParams;
use kiln_core::{Backend, RopeParams, SamplingParams, StepInput, WeightSource};
use kiln_gguf::GgufFile;
use kiln_quant::GgmlType;

use crate::config::{Arch, ModelConfig};
use crate::error::{ModelError, Result};

/// Which logits a forward pass produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only for the last token of the batch (generation).
    Last,
    /// For every token (teacher-forced evaluation); needs `ModelOptions::all_logits`.
    All,
}

#[derive(Clone, Debug)]
pub struct ModelOptions {
    /// Context length (KV cache capacity); `None` uses the training context.
    pub n_ctx: Option<usize>,
    /// Most tokens per forward pass; longer prompts are split.
    pub n_batch: usize,
    /// Allocate logits for every token of a batch.
    pub all_logits: bool,
    /// Tokens the repetition penalty can look back on.
    pub max_history: usize,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions { n_ctx: None, n_batch: 512, all_logits: false, max_history: 256 }
    }
}

struct Layer<B: Backend> {
    attn_norm: B::Buffer,
    wq: B::Weight,
    wk: B::Weight,
    wv: B::Weight,
    wo: B::Weight,
    /// qwen2's q/k/v biases.
    bias: Option<[B::Buffer; 3]>,
    /// qwen3's per-head q/k RMSNorm weights.
    qk_norm: Option<[B::Buffer; 2]>,
    ffn_norm: B::Buffer,
    w_gate: B::Weight,
    w_up: B::Weight,
    w_down: B::Weight,
    k_cache: B::Buffer,
    v_cache: B::Buffer,
}

/// Activation buffers, allocated once for `n_batch` tokens.
struct Activations<B: Backend> {
    x: B::Buffer,
    h: B::Buffer,
    q: B::Buffer,
    k: B::Buffer,
    v: B::Buffer,
    q_normed: B::Buffer,
    k_normed: B::Buffer,
    att: B::Buffer,
    gate: B::Buffer,
    up: B::Buffer,
    act: B::Buffer,
    tmp: B::Buffer,
    last: B::Buffer,
    logits: B::Buffer,
    inv_freq: B::Buffer,
    step: B::Step,
}

pub struct Model<B: Backend> {
    pub config: ModelConfig,
    backend: Arc<B>,
    token_embd: B::Weight,
    /// `None` when the embeddings are tied.
    output: Option<B::Weight>,
    output_norm: B::Buffer,
    layers: Vec<Layer<B>>,
    act: Activations<B>,
    n_ctx: usize,
    n_batch: usize,
    all_logits: bool,
    /// Cached (positions processed) so `generate` can continue a sequence.
    n_past: usize,
    host_logits: Vec<f32>,
}

/// Bytes of one tensor of a shared GGUF file.
struct TensorBytes {
    file: Arc<GgufFile>,
    index: usize,
}

impl AsRef<[u8]> for TensorBytes {
    fn as_ref(&self) -> &[u8] {
        self.file.tensor_data(&self.file.tensors()[self.index])
    }
}

struct Loader<'a, B: Backend> {
    file: &'a Arc<GgufFile>,
    backend: &'a B,
}

impl<B: Backend> Loader<'_, B> {
    fn find(&self, name: &str) -> Result<usize> {
        self.file.tensors().iter().position(|t| t.name == name).ok_or_else(|| ModelError::MissingTensor(name.into()))
    }

    fn matrix(&self, name: &str, cols: usize, rows: usize) -> Result<B::Weight> {
        let index = self.find(name)?;
        let t = &self.file.tensors()[index];
        if t.dims != [cols as u64, rows as u64] {
            return Err(ModelError::WrongShape { name: name.into(), expected: vec![cols as u64, rows as u64], found: t.dims.clone() });
        }
        let src = WeightSource {
            name: name.into(),
            ty: t.ty,
            rows,
            cols,
            owner: Arc::new(TensorBytes { file: self.file.clone(), index }),
            range: 0..t.n_bytes as usize,
        };
        Ok(self.backend.upload_weight(src)?)
    }

    fn vector(&self, name: &str, len: usize) -> Result<B::Buffer> {
        let t = &self.file.tensors()[self.find(name)?];
        if t.dims != [len as u64] {
            return Err(ModelError::WrongShape { name: name.into(), expected: vec![len as u64], found: t.dims.clone() });
        }
        let mut host = vec![0f32; len];
        kiln_quant::dequantize(t.ty, self.file.tensor_data(t), &mut host).map_err(|_| ModelError::WrongType {
            name: name.into(),
            ty: t.ty,
            role: "a norm or bias vector",
        })?;
        let mut buf = self.backend.alloc(len, name)?;
        self.backend.write(&mut buf, &host)?;
        Ok(buf)
    }

    fn has(&self, name: &str) -> bool {
        self.file.tensor(name).is_some()
    }
}

impl<B: Backend> Model<B> {
    pub fn load(backend: Arc<B>, file: Arc<GgufFile>, options: &ModelOptions) -> Result<Model<B>> {
        let config = ModelConfig::from_gguf(&file)?;
        let c = &config;
        let n_ctx = options.n_ctx.unwrap_or(c.n_ctx_train).max(1);
        let n_batch = options.n_batch.clamp(1, n_ctx);
        let (q_width, kv_width) = (c.n_head * c.head_dim, c.n_head_kv * c.head_dim);
        let ld = Loader { file: &file, backend: &*backend };
        let b = &*backend;

        let token_embd = ld.matrix("token_embd.weight", c.n_embd, c.n_vocab)?;
        let output = if c.tied_embeddings { None } else { Some(ld.matrix("output.weight", c.n_embd, c.n_vocab)?) };
        let output_norm = ld.vector("output_norm.weight", c.n_embd)?;
        let mut layers = Vec::with_capacity(c.n_layer);
        for l in 0..c.n_layer {
            let n = |s: &str| format!("blk.{l}.{s}");
            let bias = if ld.has(&n("attn_q.bias")) || c.arch == Arch::Qwen2 {
                Some([ld.vector(&n("attn_q.bias"), q_width)?, ld.vector(&n("attn_k.bias"), kv_width)?, ld.vector(&n("attn_v.bias"), kv_width)?])
            } else {
                None
            };
            let qk_norm = if c.arch == Arch::Qwen3 {
                Some([ld.vector(&n("attn_q_norm.weight"), c.head_dim)?, ld.vector(&n("attn_k_norm.weight"), c.head_dim)?])
            } else {
                None
            };
            layers.push(Layer {
                attn_norm: ld.vector(&n("attn_norm.weight"), c.n_embd)?,
                wq: ld.matrix(&n("attn_q.weight"), c.n_embd, q_width)?,
                wk: ld.matrix(&n("attn_k.weight"), c.n_embd, kv_width)?,
                wv: ld.matrix(&n("attn_v.weight"), c.n_embd, kv_width)?,
                wo: ld.matrix(&n("attn_output.weight"), q_width, c.n_embd)?,
                bias,
                qk_norm,
                ffn_norm: ld.vector(&n("ffn_norm.weight"), c.n_embd)?,
                w_gate: ld.matrix(&n("ffn_gate.weight"), c.n_embd, c.n_ff)?,
                w_up: ld.matrix(&n("ffn_up.weight"), c.n_embd, c.n_ff)?,
                w_down: ld.matrix(&n("ffn_down.weight"), c.n_ff, c.n_embd)?,
                k_cache: b.alloc_kv(n_ctx * kv_width, &n("k cache"))?,
                v_cache: b.alloc_kv(n_ctx * kv_width, &n("v cache"))?,
            });
        }

        let nb = n_batch;
        let logit_rows = if options.all_logits { nb } else { 1 };
        let mut inv_freq = b.alloc(c.n_rot / 2, "rope frequencies")?;
        b.write(&mut inv_freq, &c.rope_inv_freq())?;
        let act = Activations {
            x: b.alloc(nb * c.n_embd, "hidden state")?,
            h: b.alloc(nb * c.n_embd.max(q_width), "normed state")?,
            q: b.alloc(nb * q_width, "queries")?,
            k: b.alloc(nb * kv_width, "keys")?,
            v: b.alloc(nb * kv_width, "values")?,
            q_normed: b.alloc(nb * q_width, "normed queries")?,
            k_normed: b.alloc(nb * kv_width, "normed keys")?,
            att: b.alloc(nb * q_width, "attention output")?,
            gate: b.alloc(nb * c.n_ff, "ffn gate")?,
            up: b.alloc(nb * c.n_ff, "ffn up")?,
            act: b.alloc(nb * c.n_ff, "ffn activation")?,
            tmp: b.alloc(nb * c.n_embd, "residual scratch")?,
            last: b.alloc(c.n_embd, "last hidden state")?,
            logits: b.alloc(logit_rows * c.n_vocab, "logits")?,
            inv_freq,
            step: b.alloc_step(nb, options.max_history)?,
        };
        let host_logits = vec![0f32; logit_rows * c.n_vocab];
        Ok(Model { config, backend, token_embd, output, output_norm, layers, act, n_ctx, n_batch, all_logits: options.all_logits, n_past: 0, host_logits })
    }

    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    pub fn n_batch(&self) -> usize {
        self.n_batch
    }
    /// Positions already in the KV cache.
    pub fn n_past(&self) -> usize {
        self.n_past
    }
    /// Forgets the cached sequence (the KV contents are simply overwritten later).
    pub fn reset(&mut self) {
        self.n_past = 0;
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= self.config.n_vocab) {
            return Err(ModelError::BadToken { id, n_vocab: self.config.n_vocab });
        }
        let needed = self.n_past + tokens.len();
        if needed > self.n_ctx {
            return Err(ModelError::ContextOverflow { needed, n_ctx: self.n_ctx });
        }
        Ok(())
    }

    /// Feeds `tokens` after the cached ones, in batches of at most `n_batch`,
    /// and returns the requested logits (`[n][n_vocab]` or `[n_vocab]`).
    pub fn forward(&mut self, tokens: &[u32], which: Logits) -> Result<&[f32]> {
        self.check_tokens(tokens)?;
        if which == Logits::All && (!self.all_logits || tokens.len() > self.n_batch) {
            return Err(ModelError::BadHparam {
                key: "all_logits".into(),
                reason: format!("all logits of {} tokens need ModelOptions::all_logits and n_batch >= that", tokens.len()),
            });
        }
        let sampling = SamplingParams::greedy();
        for chunk in tokens.chunks(self.n_batch) {
            let input = StepInput { tokens: chunk, pos0: self.n_past, sampling: &sampling, history: &[], draw: 0 };
            self.backend.write_step(&mut self.act.step, &input)?;
            let all = which == Logits::All;
            Self::enqueue_forward(
                &self.backend,
                &self.config,
                self.n_ctx,
                &self.token_embd,
                self.output.as_ref(),
                &self.output_norm,
                &mut self.layers,
                &mut self.act,
                chunk.len(),
                all,
            )?;
            self.n_past += chunk.len();
        }
        let rows = if which == Logits::All { tokens.len() } else { 1 };
        let n = rows * self.config.n_vocab;
        self.backend.read(&self.act.logits, &mut self.host_logits[..n])?;
        Ok(&self.host_logits[..n])
    }

    /// One decode step: feeds `token` at the next position and samples the
    /// following token on the backend. On a GPU the whole step is one graph
    /// replay, and only the token id comes back.
    pub fn decode_sample(&mut self, token: u32, sampling: &SamplingParams, history: &[u32], draw: u64) -> Result<u32> {
        self.check_tokens(&[token])?;
        let input = StepInput { tokens: &[token], pos0: self.n_past, sampling, history, draw };
        self.backend.write_step(&mut self.act.step, &input)?;
        let (backend, config, n_ctx) = (&self.backend, &self.config, self.n_ctx);
        let (embd, output, norm) = (&self.token_embd, self.output.as_ref(), &self.output_norm);
        let (layers, act) = (&mut self.layers, &mut self.act);
        backend.run_step(1, &mut || {
            Self::enqueue_forward(backend, config, n_ctx, embd, output, norm, layers, act, 1, false)?;
            backend.sample(&act.logits, config.n_vocab, &mut act.step)?;
            Ok(())
        })?;
        self.n_past += 1;
        Ok(self.backend.sampled_token(&self.act.step)?)
    }

    /// Samples from the logits of the last forward pass (after a prompt).
    pub fn sample_last(&mut self, sampling: &SamplingParams, history: &[u32], draw: u64) -> Result<u32> {
        let input = StepInput { tokens: &[], pos0: self.n_past, sampling, history, draw };
        self.backend.write_step(&mut self.act.step, &input)?;
        self.backend.sample(&self.act.logits, self.config.n_vocab, &mut self.act.step)?;
        Ok(self.backend.sampled_token(&self.act.step)?)
    }

    /// The forward pass of `n` tokens whose ids and positions are in the step
    /// object, as one straight sequence of backend ops.
    #[allow(clippy::too_many_arguments)]
    fn enqueue_forward(
        b: &B,
        c: &ModelConfig,
        n_ctx: usize,
        token_embd: &B::Weight,
        output: Option<&B::Weight>,
        output_norm: &B::Buffer,
        layers: &mut [Layer<B>],
        a: &mut Activations<B>,
        n: usize,
        all_logits: bool,
    ) -> kiln_core::backend::Result<()> {
        let (q_width, kv_width) = (c.n_head * c.head_dim, c.n_head_kv * c.head_dim);
        let q_rope = RopeParams { kind: c.rope_kind, n_heads: c.n_head, head_dim: c.head_dim, n_rot: c.n_rot };
        let attn = AttentionParams { n_heads: c.n_head, n_kv_heads: c.n_head_kv, head_dim: c.head_dim, n_ctx, scale: 1.0 / (c.head_dim as f32).sqrt() };

        b.embed(token_embd, &a.step, &mut a.x, n)?;
        for l in layers.iter_mut() {
            b.norm_matmul_qkv(&a.x, &l.attn_norm, c.rms_eps, &mut a.h, &l.wq, &l.wk, &l.wv, &mut a.q, &mut a.k, &mut a.v, n, c.n_embd)?;
            if let Some([bq, bk, bv]) = &l.bias {
                b.add_bias(&mut a.q, bq, n, q_width)?;
                b.add_bias(&mut a.k, bk, n, kv_width)?;
                b.add_bias(&mut a.v, bv, n, kv_width)?;
            }
            let qk_norm = l.qk_norm.as_ref().map(|[qn, kn]| (qn, kn, c.rms_eps));
            let scratch = (&mut a.q_normed, &mut a.k_normed);
            b.attention_prologue(&mut a.q, &mut a.k, &a.v, qk_norm, scratch, &a.inv_freq, (&mut l.k_cache, &mut l.v_cache), &a.step, n, &q_rope, c.n_head_kv)?;
            b.attention(&a.q, &l.k_cache, &l.v_cache, &mut a.att, &a.step, n, &attn)?;
            b.matmul_add(&l.wo, &a.att, &mut a.x, &mut a.tmp, n, c.n_embd)?;

            b.norm_ffn_gate_up(&a.x, &l.ffn_norm, c.rms_eps, &mut a.h, &l.w_gate, &l.w_up, &mut a.gate, &mut a.up, &mut a.act, n, c.n_embd, c.n_ff)?;
            b.matmul_add(&l.w_down, &a.act, &mut a.x, &mut a.tmp, n, c.n_embd)?;
        }
        let out_w = output.unwrap_or(token_embd);
        if all_logits {
            b.rms_norm(&a.x, output_norm, &mut a.h, n, c.n_embd, c.rms_eps)?;
            b.matmul(out_w, &a.h, &mut a.logits, n)?;
        } else {
            b.copy_row(&a.x, n - 1, &mut a.last, c.n_embd)?;
            b.rms_norm(&a.last, output_norm, &mut a.h, 1, c.n_embd, c.rms_eps)?;
            b.matmul(out_w, &a.h, &mut a.logits, 1)?;
        }
        Ok(())
    }
}

/// Type of the model's main weights, as `general.file_type` would describe it.
pub fn dominant_weight_type(file: &GgufFile) -> Option<GgmlType> {
    let mut bytes: Vec<(GgmlType, u64)> = Vec::new();
    for t in file.tensors().iter().filter(|t| t.dims.len() >= 2) {
        match bytes.iter_mut().find(|(ty, _)| *ty == t.ty) {
            Some((_, b)) => *b += t.n_bytes,
            None => bytes.push((t.ty, t.n_bytes)),
        }
    }
    bytes.into_iter().max_by_key(|(_, b)| *b).map(|(t, _)| t)
}
