//! A model's weights, loaded once and shared (immutably) by every sequence and thread.

use std::ops::Range;
use std::sync::Arc;

use kiln_core::{Backend, WeightSource};
use kiln_gguf::GgufFile;

use crate::config::{Arch, BlockStyle, FfnConfig, KvSource, LayerConfig, ModelConfig};
use crate::error::{ModelError, Result};

/// One decoder block's weights.
pub struct LayerWeights<B: Backend> {
    pub attn_norm: B::Buffer,
    pub wq: B::Weight,
    /// `None` on a layer that reads another layer's keys and values.
    pub wk: Option<B::Weight>,
    /// `None` where the layer reads another's cache or its values are its keys' projection.
    pub wv: Option<B::Weight>,
    pub wo: B::Weight,
    /// q/k/v biases (qwen2, gpt-oss).
    pub bias: Option<[B::Buffer; 3]>,
    /// gpt-oss's output projection bias.
    pub wo_bias: Option<B::Buffer>,
    /// gpt-oss's attention sinks, one logit per head.
    pub sinks: Option<B::Buffer>,
    /// Per-head RMSNorm weights of q and k (qwen3, Gemma).
    pub q_norm: Option<B::Buffer>,
    pub k_norm: Option<B::Buffer>,
    /// Gemma 4's per-head RMSNorm of v, without a learned weight (a vector of ones).
    pub v_norm: Option<B::Buffer>,
    /// Gemma's norm of the attention output, before the residual add.
    pub post_attn_norm: Option<B::Buffer>,
    pub ffn_norm: B::Buffer,
    pub ffn: FfnWeights<B>,
    /// Gemma's norm of the FFN output, before the residual add.
    pub post_ffn_norm: Option<B::Buffer>,
    pub per_layer: Option<PerLayerWeights<B>>,
    /// Gemma 4 scales the layer's output (the whole residual stream) by this.
    pub output_scale: Option<f32>,
}

/// A layer's part of Gemma 4's per-layer embeddings: `x += norm(proj(gelu(gate(x)) * input))`.
pub struct PerLayerWeights<B: Backend> {
    pub gate: B::Weight,
    pub proj: B::Weight,
    pub norm: B::Buffer,
}

/// Gemma 4's per-layer input of each token: its per-layer embedding and a projection of its
/// embedding, normed, for every layer at once.
pub struct PerLayerInputs<B: Backend> {
    pub token_embd: B::Weight,
    pub model_proj: B::Weight,
    pub proj_norm: B::Buffer,
}

pub enum FfnWeights<B: Backend> {
    Dense(DenseFfn<B>),
    Moe(MoeWeights<B>),
}

/// A gated FFN: `down(act(gate(x)) * up(x))`.
pub struct DenseFfn<B: Backend> {
    pub gate: B::Weight,
    pub up: B::Weight,
    pub down: B::Weight,
}

/// A mixture of experts: the router and each expert's matrices (slices of the GGUF's 3-D tensors).
pub struct MoeWeights<B: Backend> {
    pub router: B::Weight,
    /// Gemma 4 routes `rms_norm(x) * router_norm` (its `ffn_gate_inp.scale / sqrt(n_embd)`).
    pub router_norm: Option<B::Buffer>,
    pub gate: Vec<B::Weight>,
    pub up: Vec<B::Weight>,
    pub down: Vec<B::Weight>,
    /// Gemma 4's per-expert factor on the routing weights.
    pub expert_scale: Option<B::Buffer>,
    /// gpt-oss's router bias and per-expert biases of the gate, up and down products
    /// (`[n_expert][rows]` each).
    pub router_bias: Option<B::Buffer>,
    pub expert_bias: Option<[B::Buffer; 3]>,
    pub beside: Option<DenseBeside<B>>,
}

/// Gemma 4's dense FFN beside the experts, and the norms that keep the two apart: the dense
/// one's input is normed by the layer's `ffn_norm`, its output by `post_norm`; the experts'
/// input by `moe_norm` and their output by `moe_post_norm`.
pub struct DenseBeside<B: Backend> {
    pub ffn: DenseFfn<B>,
    pub post_norm: B::Buffer,
    pub moe_norm: B::Buffer,
    pub moe_post_norm: B::Buffer,
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
    pub per_layer_inputs: Option<PerLayerInputs<B>>,
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

    /// Rows `part` of each of the `n` matrices of a 3-D tensor `[cols, rows, n]`.
    fn expert_rows(&self, name: &str, cols: usize, rows: usize, n: usize, part: Range<usize>) -> Result<Vec<B::Weight>> {
        self.slices(name, cols, rows, Some(n), part)
    }

    fn matrices(&self, name: &str, cols: usize, rows: usize, n: Option<usize>) -> Result<Vec<B::Weight>> {
        self.slices(name, cols, rows, n, 0..rows)
    }

    fn slices(&self, name: &str, cols: usize, rows: usize, n: Option<usize>, part: Range<usize>) -> Result<Vec<B::Weight>> {
        let index = self.find(name)?;
        let t = &self.file.tensors()[index];
        let mut want = vec![cols as u64, rows as u64];
        want.extend(n.map(|n| n as u64));
        if t.dims != want {
            return Err(ModelError::WrongShape { name: name.into(), expected: want, found: t.dims.clone() });
        }
        let count = n.unwrap_or(1);
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(TensorBytes { file: self.file.clone(), index });
        // Rows are whole blocks, so each matrix and row is an equal byte slice (checked by the upload).
        let per = t.n_bytes as usize / count;
        let row_bytes = per / rows.max(1);
        (0..count)
            .map(|e| {
                let name = if n.is_some() { format!("{name}[{e}]") } else { name.to_string() };
                let range = e * per + part.start * row_bytes..e * per + part.end * row_bytes;
                let src = WeightSource { name, ty: t.ty, rows: part.len(), cols, owner: owner.clone(), range };
                Ok(self.backend.upload_weight(src)?)
            })
            .collect()
    }

    fn vector(&self, name: &str, len: usize) -> Result<B::Buffer> {
        self.vector_scaled(name, len, 1.0)
    }

    /// A vector times `scale`.
    fn vector_scaled(&self, name: &str, len: usize, scale: f32) -> Result<B::Buffer> {
        self.values(name, &[len], scale)
    }

    /// A 2-D tensor of `rows` rows of `cols` as one buffer (gpt-oss's per-expert biases).
    fn table(&self, name: &str, cols: usize, rows: usize) -> Result<B::Buffer> {
        self.values(name, &[cols, rows], 1.0)
    }

    fn values(&self, name: &str, dims: &[usize], scale: f32) -> Result<B::Buffer> {
        let t = &self.file.tensors()[self.find(name)?];
        let want: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        if t.dims != want {
            return Err(ModelError::WrongShape { name: name.into(), expected: want, found: t.dims.clone() });
        }
        let len = dims.iter().product();
        let mut host = vec![0f32; len];
        kiln_quant::dequantize(t.ty, self.file.tensor_data(t), &mut host).map_err(|_| ModelError::WrongType {
            name: name.into(),
            ty: t.ty,
            role: "a norm or bias vector",
        })?;
        host.iter_mut().for_each(|v| *v *= scale);
        let mut buf = self.backend.alloc(len, name)?;
        self.backend.write(&mut buf, &host)?;
        Ok(buf)
    }

    /// A one-element tensor, read on the host.
    fn scalar(&self, name: &str) -> Result<f32> {
        let t = &self.file.tensors()[self.find(name)?];
        let mut v = [0f32];
        if t.n_elements() != 1 || kiln_quant::dequantize(t.ty, self.file.tensor_data(t), &mut v).is_err() {
            return Err(ModelError::WrongShape { name: name.into(), expected: vec![1], found: t.dims.clone() });
        }
        Ok(v[0])
    }

    fn ones(&self, len: usize) -> Result<B::Buffer> {
        let mut buf = self.backend.alloc(len, "unit norm weights")?;
        self.backend.write(&mut buf, &vec![1.0; len])?;
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
        let own_kv = matches!(a.kv, KvSource::Own { .. });
        let norm = |name: &str, len| if c.arch.has_qk_norm() { self.vector(&n(name), len).map(Some) } else { Ok(None) };
        let q_norm = norm("attn_q_norm.weight", a.head_dim)?;
        let k_norm = if own_kv { norm("attn_k_norm.weight", a.head_dim)? } else { None };
        let v_norm = if c.arch == Arch::Gemma4 && own_kv { Some(self.ones(a.head_dim)?) } else { None };
        let wk = if own_kv { Some(self.matrix(&n("attn_k.weight"), c.n_embd, kv_width)?) } else { None };
        let wv = match a.kv {
            KvSource::Own { v_from_k: false } => Some(self.matrix(&n("attn_v.weight"), c.n_embd, kv_width)?),
            _ => None,
        };
        let per_layer = match c.per_layer_embd {
            Some(d) => Some(PerLayerWeights {
                gate: self.matrix(&n("inp_gate.weight"), c.n_embd, d)?,
                proj: self.matrix(&n("proj.weight"), d, c.n_embd)?,
                norm: self.vector(&n("post_norm.weight"), c.n_embd)?,
            }),
            None => None,
        };
        let output_scale = if self.has(&n("layer_output_scale.weight")) { Some(self.scalar(&n("layer_output_scale.weight"))?) } else { None };
        let gemma = c.arch.block_style() == BlockStyle::Gemma;
        let post_norm = |name: &str| if gemma { self.vector(&n(name), c.n_embd).map(Some) } else { Ok(None) };
        let dense = |n_ff: usize| -> Result<DenseFfn<B>> {
            Ok(DenseFfn {
                gate: self.matrix(&n("ffn_gate.weight"), c.n_embd, n_ff)?,
                up: self.matrix(&n("ffn_up.weight"), c.n_embd, n_ff)?,
                down: self.matrix(&n("ffn_down.weight"), n_ff, c.n_embd)?,
            })
        };
        let ffn = match &lc.ffn {
            FfnConfig::Dense { n_ff } => FfnWeights::Dense(dense(*n_ff)?),
            FfnConfig::Moe(m) => {
                // Gate and up stacked in one tensor (Gemma 4) are its first and second halves.
                let (gate, up) = if self.has(&n("ffn_gate_up_exps.weight")) {
                    let name = n("ffn_gate_up_exps.weight");
                    (
                        self.expert_rows(&name, c.n_embd, 2 * m.n_ff, m.n_expert, 0..m.n_ff)?,
                        self.expert_rows(&name, c.n_embd, 2 * m.n_ff, m.n_expert, m.n_ff..2 * m.n_ff)?,
                    )
                } else {
                    (
                        self.experts(&n("ffn_gate_exps.weight"), c.n_embd, m.n_ff, m.n_expert)?,
                        self.experts(&n("ffn_up_exps.weight"), c.n_embd, m.n_ff, m.n_expert)?,
                    )
                };
                let optional = |name: &str, len, scale| if self.has(&n(name)) { self.vector_scaled(&n(name), len, scale).map(Some) } else { Ok(None) };
                let beside = match m.dense_ff {
                    Some(n_ff) => Some(DenseBeside {
                        ffn: dense(n_ff)?,
                        post_norm: self.vector(&n("post_ffw_norm_1.weight"), c.n_embd)?,
                        moe_norm: self.vector(&n("pre_ffw_norm_2.weight"), c.n_embd)?,
                        moe_post_norm: self.vector(&n("post_ffw_norm_2.weight"), c.n_embd)?,
                    }),
                    None => None,
                };
                FfnWeights::Moe(MoeWeights {
                    router: self.matrix(&n("ffn_gate_inp.weight"), c.n_embd, m.n_expert)?,
                    router_norm: optional("ffn_gate_inp.scale", c.n_embd, 1.0 / (c.n_embd as f32).sqrt())?,
                    gate,
                    up,
                    down: self.experts(&n("ffn_down_exps.weight"), m.n_ff, c.n_embd, m.n_expert)?,
                    expert_scale: optional("ffn_down_exps.scale", m.n_expert, 1.0)?,
                    router_bias: optional("ffn_gate_inp.bias", m.n_expert, 1.0)?,
                    expert_bias: if self.has(&n("ffn_gate_exps.bias")) {
                        Some([
                            self.table(&n("ffn_gate_exps.bias"), m.n_ff, m.n_expert)?,
                            self.table(&n("ffn_up_exps.bias"), m.n_ff, m.n_expert)?,
                            self.table(&n("ffn_down_exps.bias"), c.n_embd, m.n_expert)?,
                        ])
                    } else {
                        None
                    },
                    beside,
                })
            }
        };
        Ok(LayerWeights {
            attn_norm: self.vector(&n("attn_norm.weight"), c.n_embd)?,
            wq: self.matrix(&n("attn_q.weight"), c.n_embd, q_width)?,
            wk,
            wv,
            wo: self.matrix(&n("attn_output.weight"), q_width, c.n_embd)?,
            bias,
            wo_bias: if self.has(&n("attn_output.bias")) { Some(self.vector(&n("attn_output.bias"), c.n_embd)?) } else { None },
            sinks: if self.has(&n("attn_sinks.weight")) { Some(self.vector(&n("attn_sinks.weight"), a.n_head)?) } else { None },
            q_norm,
            k_norm,
            v_norm,
            post_attn_norm: post_norm("post_attention_norm.weight")?,
            // gpt-oss names its FFN input norm after the attention.
            ffn_norm: self.vector(&n(if c.arch == Arch::GptOss { "post_attention_norm.weight" } else { "ffn_norm.weight" }), c.n_embd)?,
            ffn,
            post_ffn_norm: post_norm("post_ffw_norm.weight")?,
            per_layer,
            output_scale,
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
        let per_layer_inputs = match c.per_layer_embd {
            Some(d) => Some(PerLayerInputs {
                token_embd: ld.matrix("per_layer_token_embd.weight", d * c.n_layer, c.n_vocab)?,
                model_proj: ld.matrix("per_layer_model_proj.weight", c.n_embd, d * c.n_layer)?,
                proj_norm: ld.vector("per_layer_proj_norm.weight", d)?,
            }),
            None => None,
        };
        let mut rope_tables = Vec::with_capacity(c.ropes.len());
        for rope in &c.ropes {
            let mut table = backend.alloc(rope.n_rot / 2, "rope frequencies")?;
            backend.write(&mut table, &rope.inv_freq())?;
            rope_tables.push(table);
        }
        Ok(Weights { config, token_embd, output, output_norm, layers, rope_tables, per_layer_inputs })
    }

    /// Every weight matrix.
    pub fn matrices(&self) -> Vec<&B::Weight> {
        let mut all = vec![&self.token_embd];
        all.extend(&self.output);
        all.extend(self.per_layer_inputs.iter().flat_map(|p| [&p.token_embd, &p.model_proj]));
        for l in &self.layers {
            all.extend([&l.wq, &l.wo]);
            all.extend(l.wk.iter().chain(&l.wv));
            all.extend(l.per_layer.iter().flat_map(|p| [&p.gate, &p.proj]));
            match &l.ffn {
                FfnWeights::Dense(d) => all.extend([&d.gate, &d.up, &d.down]),
                FfnWeights::Moe(m) => {
                    all.push(&m.router);
                    all.extend(m.beside.iter().flat_map(|b| [&b.ffn.gate, &b.ffn.up, &b.ffn.down]));
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
