//! A model's weights, loaded once and shared (immutably) by every sequence and thread.

use std::sync::Arc;

use kiln_core::{Backend, WeightSource};
use kiln_gguf::GgufFile;

use crate::config::{Arch, BlockStyle, FfnConfig, LayerConfig, ModelConfig};
use crate::error::{ModelError, Result};

/// One decoder block's weights.
pub struct LayerWeights<B: Backend> {
    pub attn_norm: B::Buffer,
    pub wq: B::Weight,
    pub wk: B::Weight,
    pub wv: B::Weight,
    pub wo: B::Weight,
    /// qwen2's q/k/v biases.
    pub bias: Option<[B::Buffer; 3]>,
    /// Per-head q/k RMSNorm weights (qwen3, gemma3).
    pub qk_norm: Option<[B::Buffer; 2]>,
    /// Gemma's norm of the attention output, before the residual add.
    pub post_attn_norm: Option<B::Buffer>,
    pub ffn_norm: B::Buffer,
    pub ffn: FfnWeights<B>,
    /// Gemma's norm of the FFN output, before the residual add.
    pub post_ffn_norm: Option<B::Buffer>,
}

pub enum FfnWeights<B: Backend> {
    Dense { gate: B::Weight, up: B::Weight, down: B::Weight },
    Moe(MoeWeights<B>),
}

/// A mixture of experts: the router and each expert's matrices (slices of the GGUF's 3-D tensors).
pub struct MoeWeights<B: Backend> {
    pub router: B::Weight,
    pub gate: Vec<B::Weight>,
    pub up: Vec<B::Weight>,
    pub down: Vec<B::Weight>,
}

pub struct Weights<B: Backend> {
    pub config: ModelConfig,
    pub token_embd: B::Weight,
    /// `None` when the embeddings are tied.
    pub output: Option<B::Weight>,
    pub output_norm: B::Buffer,
    pub layers: Vec<LayerWeights<B>>,
    /// Rotary inverse frequencies (scaling included), one table per [`ModelConfig::ropes`].
    pub rope_tables: Vec<B::Buffer>,
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
        Ok(self.matrices(name, cols, rows, None)?.pop().expect("one matrix"))
    }

    /// A 3-D tensor `[cols, rows, n]` (ne order) as its `n` matrices.
    fn experts(&self, name: &str, cols: usize, rows: usize, n: usize) -> Result<Vec<B::Weight>> {
        self.matrices(name, cols, rows, Some(n))
    }

    fn matrices(&self, name: &str, cols: usize, rows: usize, n: Option<usize>) -> Result<Vec<B::Weight>> {
        let index = self.find(name)?;
        let t = &self.file.tensors()[index];
        let mut want = vec![cols as u64, rows as u64];
        want.extend(n.map(|n| n as u64));
        if t.dims != want {
            return Err(ModelError::WrongShape { name: name.into(), expected: want, found: t.dims.clone() });
        }
        let count = n.unwrap_or(1);
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(TensorBytes { file: self.file.clone(), index });
        // Rows are whole blocks, so each matrix is an equal byte slice (checked by the upload).
        let per = t.n_bytes as usize / count;
        (0..count)
            .map(|e| {
                let name = if n.is_some() { format!("{name}[{e}]") } else { name.to_string() };
                let src = WeightSource { name, ty: t.ty, rows, cols, owner: owner.clone(), range: e * per..(e + 1) * per };
                Ok(self.backend.upload_weight(src)?)
            })
            .collect()
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

    fn layer(&self, c: &ModelConfig, l: usize, lc: &LayerConfig) -> Result<LayerWeights<B>> {
        let n = |s: &str| format!("blk.{l}.{s}");
        let a = &lc.attn;
        let (q_width, kv_width) = (a.n_head * a.head_dim, a.n_head_kv * a.head_dim);
        let bias = if self.has(&n("attn_q.bias")) || c.arch == Arch::Qwen2 {
            Some([self.vector(&n("attn_q.bias"), q_width)?, self.vector(&n("attn_k.bias"), kv_width)?, self.vector(&n("attn_v.bias"), kv_width)?])
        } else {
            None
        };
        let qk_norm = if c.arch.has_qk_norm() {
            Some([self.vector(&n("attn_q_norm.weight"), a.head_dim)?, self.vector(&n("attn_k_norm.weight"), a.head_dim)?])
        } else {
            None
        };
        let gemma = c.arch.block_style() == BlockStyle::Gemma;
        let post_norm = |name: &str| if gemma { self.vector(&n(name), c.n_embd).map(Some) } else { Ok(None) };
        let ffn = match &lc.ffn {
            FfnConfig::Dense { n_ff } => FfnWeights::Dense {
                gate: self.matrix(&n("ffn_gate.weight"), c.n_embd, *n_ff)?,
                up: self.matrix(&n("ffn_up.weight"), c.n_embd, *n_ff)?,
                down: self.matrix(&n("ffn_down.weight"), *n_ff, c.n_embd)?,
            },
            FfnConfig::Moe(m) => FfnWeights::Moe(MoeWeights {
                router: self.matrix(&n("ffn_gate_inp.weight"), c.n_embd, m.n_expert)?,
                gate: self.experts(&n("ffn_gate_exps.weight"), c.n_embd, m.n_ff, m.n_expert)?,
                up: self.experts(&n("ffn_up_exps.weight"), c.n_embd, m.n_ff, m.n_expert)?,
                down: self.experts(&n("ffn_down_exps.weight"), m.n_ff, c.n_embd, m.n_expert)?,
            }),
        };
        Ok(LayerWeights {
            attn_norm: self.vector(&n("attn_norm.weight"), c.n_embd)?,
            wq: self.matrix(&n("attn_q.weight"), c.n_embd, q_width)?,
            wk: self.matrix(&n("attn_k.weight"), c.n_embd, kv_width)?,
            wv: self.matrix(&n("attn_v.weight"), c.n_embd, kv_width)?,
            wo: self.matrix(&n("attn_output.weight"), q_width, c.n_embd)?,
            bias,
            qk_norm,
            post_attn_norm: post_norm("post_attention_norm.weight")?,
            ffn_norm: self.vector(&n("ffn_norm.weight"), c.n_embd)?,
            ffn,
            post_ffn_norm: post_norm("post_ffw_norm.weight")?,
        })
    }
}

impl<B: Backend> Weights<B> {
    /// Reads the configuration and uploads every tensor the architecture needs.
    pub fn load(backend: &B, file: &Arc<GgufFile>) -> Result<Weights<B>> {
        let config = ModelConfig::from_gguf(file)?;
        let c = &config;
        let ld = Loader { file, backend };
        let token_embd = ld.matrix("token_embd.weight", c.n_embd, c.n_vocab)?;
        let output = if c.tied_embeddings { None } else { Some(ld.matrix("output.weight", c.n_embd, c.n_vocab)?) };
        let output_norm = ld.vector("output_norm.weight", c.n_embd)?;
        let layers = c.layers.iter().enumerate().map(|(l, lc)| ld.layer(c, l, lc)).collect::<Result<Vec<_>>>()?;
        let mut rope_tables = Vec::with_capacity(c.ropes.len());
        for rope in &c.ropes {
            let mut table = backend.alloc(rope.n_rot / 2, "rope frequencies")?;
            backend.write(&mut table, &rope.inv_freq())?;
            rope_tables.push(table);
        }
        Ok(Weights { config, token_embd, output, output_norm, layers, rope_tables })
    }

    /// Every weight matrix.
    pub fn matrices(&self) -> Vec<&B::Weight> {
        let mut all = vec![&self.token_embd];
        all.extend(&self.output);
        for l in &self.layers {
            all.extend([&l.wq, &l.wk, &l.wv, &l.wo]);
            match &l.ffn {
                FfnWeights::Dense { gate, up, down } => all.extend([gate, up, down]),
                FfnWeights::Moe(m) => {
                    all.push(&m.router);
                    all.extend(m.gate.iter().chain(&m.up).chain(&m.down));
                }
            }
        }
        all
    }

    /// The LM head (the embedding table when tied).
    pub fn lm_head(&self) -> &B::Weight {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }
}
