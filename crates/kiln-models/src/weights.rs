//! A model's weights, loaded once and shared (immutably) by every sequence and thread.

use std::sync::Arc;

use kiln_core::{Backend, WeightSource};
use kiln_gguf::GgufFile;

use crate::config::{Arch, ModelConfig};
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
    /// qwen3's per-head q/k RMSNorm weights.
    pub qk_norm: Option<[B::Buffer; 2]>,
    pub ffn_norm: B::Buffer,
    pub w_gate: B::Weight,
    pub w_up: B::Weight,
    pub w_down: B::Weight,
}

pub struct Weights<B: Backend> {
    pub config: ModelConfig,
    pub token_embd: B::Weight,
    /// `None` when the embeddings are tied.
    pub output: Option<B::Weight>,
    pub output_norm: B::Buffer,
    pub layers: Vec<LayerWeights<B>>,
    /// Rotary inverse frequencies (scaling included).
    pub inv_freq: B::Buffer,
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

impl<B: Backend> Weights<B> {
    /// Reads the configuration and uploads every tensor the architecture needs.
    pub fn load(backend: &B, file: &Arc<GgufFile>) -> Result<Weights<B>> {
        let config = ModelConfig::from_gguf(file)?;
        let c = &config;
        let (q_width, kv_width) = (c.n_head * c.head_dim, c.n_head_kv * c.head_dim);
        let ld = Loader { file, backend };
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
            layers.push(LayerWeights {
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
            });
        }
        let mut inv_freq = backend.alloc(c.n_rot / 2, "rope frequencies")?;
        backend.write(&mut inv_freq, &c.rope_inv_freq())?;
        Ok(Weights { config, token_embd, output, output_norm, layers, inv_freq })
    }

    /// Every weight matrix.
    pub fn matrices(&self) -> Vec<&B::Weight> {
        let mut all = vec![&self.token_embd];
        all.extend(&self.output);
        for l in &self.layers {
            all.extend([&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]);
        }
        all
    }

    /// The LM head (the embedding table when tied).
    pub fn lm_head(&self) -> &B::Weight {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }
}
