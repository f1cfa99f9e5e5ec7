//! A model's weights, loaded once and shared (immutably) by every sequence and thread.

use std::sync::Arc;

use kiln_core::Backend;
use kiln_gguf::GgufFile;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::loader::Loader;
use crate::tensor_parallel::{self, Shard};

/// One decoder block's weights.
pub struct LayerWeights<B: Backend> {
    pub attn_norm: B::Buffer,
    pub mixer: MixerWeights<B>,
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

pub enum MixerWeights<B: Backend> {
    Attention(AttentionWeights<B>),
    DeltaNet(DeltaNetWeights<B>),
}

pub struct AttentionWeights<B: Backend> {
    /// The query projection (of Qwen3.5's gated layers: the query rows of each head).
    pub wq: B::Weight,
    /// Qwen3.5's gated layers: the output gate's rows of each head, split from the query
    /// projection that holds them after the head's query rows.
    pub q_gate: Option<B::Weight>,
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
    /// Per-head RMSNorm weights of q and k (qwen3, Gemma, Qwen3.5).
    pub q_norm: Option<B::Buffer>,
    pub k_norm: Option<B::Buffer>,
    /// Gemma 4's per-head RMSNorm of v, without a learned weight (a vector of ones).
    pub v_norm: Option<B::Buffer>,
}

/// A Gated DeltaNet layer (Qwen3.5).
pub struct DeltaNetWeights<B: Backend> {
    /// q, k and v projections side by side (`attn_qkv`), then their causal convolution
    /// (`[conv_dim][kernel]`).
    pub qkv: B::Weight,
    pub conv: B::Buffer,
    /// The output gate `z` (`attn_gate`).
    pub z: B::Weight,
    /// Per value head: the decay input `a` and the write strength `b` projections.
    pub alpha: B::Weight,
    pub beta: B::Weight,
    /// `-exp(A_log)` and the `dt` bias, per value head.
    pub a: B::Buffer,
    pub dt_bias: B::Buffer,
    /// The gated RMSNorm's weight, per head dim.
    pub norm: B::Buffer,
    pub out: B::Weight,
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
    pub shared: Option<SharedExpert<B>>,
}

/// Qwen3.5-MoE's shared expert: its FFN's output times `sigmoid(x · gate)`, one gate per token.
pub enum SharedExpert<B: Backend> {
    /// Its own FFN beside the routed experts, `gate` the row of its gate logit.
    Apart { ffn: DenseFfn<B>, gate: B::Weight },
    /// Loaded as one more expert: the last of `gate`, `up` and `down` and the router's last
    /// row (its gate logit), so the route gives every token that expert as one more slot
    /// ([`kiln_core::RouterParams::shared_expert`]) and the expert products run it (where its
    /// matrices share the routed experts' formats and width).
    Routed,
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

impl<B: Backend> Weights<B> {
    /// Reads the configuration and uploads every tensor the architecture needs.
    pub fn load(backend: &B, file: &Arc<GgufFile>) -> Result<Weights<B>> {
        Self::load_shard(backend, file, Shard::WHOLE)
    }

    /// The weights one rank of a tensor-parallel group holds (see [`crate::tensor_parallel`]);
    /// the configuration is that rank's: its heads and FFN width.
    pub fn load_shard(backend: &B, file: &Arc<GgufFile>, shard: Shard) -> Result<Weights<B>> {
        let full = ModelConfig::from_gguf(file)?;
        if !shard.is_whole() {
            tensor_parallel::check(&full, file, shard.ranks)?;
        }
        let c = &full;
        let ld = Loader { file, backend, shard };
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
        let config = tensor_parallel::shard_config(&full, shard);
        Ok(Weights { config, token_embd, output, output_norm, layers, rope_tables, per_layer_inputs })
    }

    /// Every weight matrix.
    pub fn matrices(&self) -> Vec<&B::Weight> {
        let mut all = vec![&self.token_embd];
        all.extend(&self.output);
        all.extend(self.per_layer_inputs.iter().flat_map(|p| [&p.token_embd, &p.model_proj]));
        for l in &self.layers {
            match &l.mixer {
                MixerWeights::Attention(a) => {
                    all.extend([&a.wq, &a.wo]);
                    all.extend(&a.q_gate);
                    all.extend(a.wk.iter().chain(&a.wv));
                }
                MixerWeights::DeltaNet(d) => all.extend([&d.qkv, &d.z, &d.alpha, &d.beta, &d.out]),
            }
            all.extend(l.per_layer.iter().flat_map(|p| [&p.gate, &p.proj]));
            match &l.ffn {
                FfnWeights::Dense(d) => all.extend([&d.gate, &d.up, &d.down]),
                FfnWeights::Moe(m) => {
                    all.push(&m.router);
                    all.extend(m.beside.iter().flat_map(|b| [&b.ffn.gate, &b.ffn.up, &b.ffn.down]));
                    if let Some(SharedExpert::Apart { ffn, gate }) = &m.shared {
                        all.extend([&ffn.gate, &ffn.up, &ffn.down, gate]);
                    }
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
