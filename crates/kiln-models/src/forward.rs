//! The forward pass of one step as straight sequences of backend ops: one builder per block
//! style ([`BlockStyle`]) over shared blocks (attention, dense or mixture-of-experts FFN, LM
//! head), each layer run with its own settings from [`crate::config::LayerConfig`].

use kiln_core::backend::{AttentionParams, Result};
use kiln_core::{AllReduce, Backend, BackendError, ExpertInput, RopeParams, RouterParams};

use crate::config::{Activation, AttentionConfig, BlockStyle, DeltaNetConfig, FfnConfig, KvSource, LayerConfig, Mixer, ModelConfig, MoeConfig};
use crate::recurrent::{self, RecurrentStates};
use crate::weights::{
    AttentionWeights, DeltaNetWeights, DenseFfn, FfnWeights, LayerWeights, MixerWeights, MoeWeights, PerLayerInputs, PerLayerWeights, Weights,
};

/// Activation buffers, allocated once for the largest step and the widest layer.
pub(crate) struct Workspace<B: Backend> {
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
    /// Router logits, chosen expert ids and their weights (empty without experts).
    router: B::Buffer,
    expert_ids: B::Buffer,
    expert_weights: B::Buffer,
    /// Every chosen expert's output, `[tokens][n_used][n_embd]`.
    expert_out: B::Buffer,
    v_normed: B::Buffer,
    /// Gemma 4's sum of its dense and expert FFNs.
    ffn_out: B::Buffer,
    /// Gemma 4's per-layer inputs of every layer, `[tokens][n_layer][width]`, the scratch that
    /// builds them, and one layer's slice, gate and activation.
    ple: B::Buffer,
    ple_scratch: [B::Buffer; 2],
    ple_layer: [B::Buffer; 3],
    /// Qwen3.5: the output gate of gated attention, and its shared expert's gate per token.
    q_gate: B::Buffer,
    shared_gate: B::Buffer,
    dn: DeltaNetScratch<B>,
    /// Hidden states of the rows that produce logits.
    rows: B::Buffer,
    pub(crate) logits: B::Buffer,
}

/// A Gated DeltaNet layer's activations: q/k/v before and after the convolution, the output
/// gate z, the per-head gates, and the output before and after its gated norm.
struct DeltaNetScratch<B: Backend> {
    qkv: B::Buffer,
    conv: B::Buffer,
    z: B::Buffer,
    g: B::Buffer,
    beta: B::Buffer,
    out: B::Buffer,
    normed: B::Buffer,
}

impl<B: Backend> Workspace<B> {
    pub(crate) fn new(b: &B, c: &ModelConfig, tokens: usize, logit_rows: usize) -> kiln_core::backend::Result<Workspace<B>> {
        let most = |f: &dyn Fn(&LayerConfig) -> usize| c.layers.iter().map(f).max().unwrap_or(0);
        let attn = |f: &dyn Fn(&AttentionConfig) -> usize| most(&|l| l.attention().map_or(0, f));
        let dn = |f: &dyn Fn(&DeltaNetConfig) -> usize| most(&|l| l.delta_net().map_or(0, f));
        let q_width = attn(&|a| a.n_head * a.head_dim);
        let kv_width = attn(&|a| a.kv_width());
        // A gated attention's query projection also holds its gate.
        let q_proj = attn(&|a| a.n_head * a.head_dim * if a.gated { 2 } else { 1 });
        let gated = attn(&|a| if a.gated { a.n_head * a.head_dim } else { 0 });
        let v_width = dn(&DeltaNetConfig::v_width);
        // Gate/up/activation hold a dense FFN's `n_ff` or every chosen expert's.
        let ff = most(&|l| match &l.ffn {
            FfnConfig::Dense { n_ff } => *n_ff,
            FfnConfig::Moe(m) => (m.n_used * m.n_ff).max(m.dense_ff.unwrap_or(0)).max(m.shared_ff.unwrap_or(0)),
        });
        let moe = |f: &dyn Fn(&MoeConfig) -> usize| most(&|l| if let FfnConfig::Moe(m) = &l.ffn { f(m) } else { 0 });
        let ple_dim = c.per_layer_embd.unwrap_or(0);
        let ple_width = ple_dim * c.n_layer;
        Ok(Workspace {
            x: b.alloc(tokens * c.n_embd, "hidden state")?,
            h: b.alloc(tokens * c.n_embd.max(q_width), "normed state")?,
            q: b.alloc(tokens * q_proj, "queries")?,
            k: b.alloc(tokens * kv_width, "keys")?,
            v: b.alloc(tokens * kv_width, "values")?,
            q_normed: b.alloc(tokens * q_width, "normed queries")?,
            k_normed: b.alloc(tokens * kv_width, "normed keys")?,
            att: b.alloc(tokens * q_width.max(v_width), "attention output")?,
            gate: b.alloc(tokens * ff, "ffn gate")?,
            up: b.alloc(tokens * ff, "ffn up")?,
            act: b.alloc(tokens * ff, "ffn activation")?,
            tmp: b.alloc(tokens * c.n_embd, "residual scratch")?,
            router: b.alloc(tokens * moe(&|m| m.n_expert), "router logits")?,
            expert_ids: b.alloc(tokens * moe(&|m| m.n_used), "expert ids")?,
            expert_weights: b.alloc(tokens * moe(&|m| m.n_used), "expert weights")?,
            expert_out: b.alloc(tokens * moe(&|m| m.n_used) * c.n_embd, "expert outputs")?,
            v_normed: b.alloc(tokens * kv_width, "normed values")?,
            ffn_out: b.alloc(if moe(&|m| m.dense_ff.or(m.shared_ff).unwrap_or(0)) > 0 { tokens * c.n_embd } else { 0 }, "ffn output")?,
            q_gate: b.alloc(tokens * gated, "attention gate")?,
            shared_gate: b.alloc(if moe(&|m| m.shared_ff.unwrap_or(0)) > 0 { tokens } else { 0 }, "shared expert gate")?,
            dn: DeltaNetScratch {
                qkv: b.alloc(tokens * dn(&DeltaNetConfig::conv_dim), "DeltaNet qkv")?,
                conv: b.alloc(tokens * dn(&DeltaNetConfig::conv_dim), "DeltaNet convolved qkv")?,
                z: b.alloc(tokens * v_width, "DeltaNet output gate")?,
                g: b.alloc(tokens * dn(&|d| d.n_v_heads), "DeltaNet decay")?,
                beta: b.alloc(tokens * dn(&|d| d.n_v_heads), "DeltaNet beta")?,
                out: b.alloc(tokens * v_width, "DeltaNet output")?,
                normed: b.alloc(tokens * v_width, "DeltaNet normed output")?,
            },
            ple: b.alloc(tokens * ple_width, "per-layer inputs")?,
            ple_scratch: [b.alloc(tokens * ple_width, "per-layer input scratch")?, b.alloc(tokens * ple_width, "per-layer input scratch")?],
            ple_layer: [
                b.alloc(tokens * ple_dim, "per-layer input")?,
                b.alloc(tokens * ple_dim, "per-layer gate")?,
                b.alloc(tokens * ple_dim, "per-layer activation")?,
            ],
            rows: b.alloc(logit_rows * c.n_embd, "logit rows")?,
            logits: b.alloc(logit_rows * c.n_vocab, "logits")?,
        })
    }
}

/// What every block of a step reads: backend, weights, the step, and its token and logit-row counts.
pub(crate) struct Pass<'a, B: Backend> {
    pub b: &'a B,
    pub w: &'a Weights<B>,
    pub step: &'a B::Step,
    pub n: usize,
    pub n_rows: usize,
    pub max_seq_len: usize,
    /// The tensor-parallel group, when the weights are one rank's slice.
    pub reduce: Option<&'a dyn AllReduce<B>>,
}

pub(crate) fn attention_params(a: &AttentionConfig, max_seq_len: usize) -> AttentionParams {
    AttentionParams { n_heads: a.n_head, n_kv_heads: a.n_head_kv, head_dim: a.head_dim, max_seq_len, scale: a.scale, window: a.window }
}

/// The forward pass of the step's tokens: embeddings, the decoder blocks, then the LM head over
/// the rows that produce logits.
pub(crate) fn forward<B: Backend>(p: &Pass<B>, caches: &mut [B::KvCache], states: Option<&mut RecurrentStates<B>>, a: &mut Workspace<B>) -> Result<()> {
    match p.w.config.arch.block_style() {
        BlockStyle::PreNorm => pre_norm(p, caches, states, a),
        BlockStyle::Gemma => gemma(p, caches, a),
    }
}

/// llama, qwen2, qwen3, qwen3moe, Mixtral, gpt-oss, Qwen3.5 (attention or Gated DeltaNet).
fn pre_norm<B: Backend>(p: &Pass<B>, caches: &mut [B::KvCache], mut states: Option<&mut RecurrentStates<B>>, a: &mut Workspace<B>) -> Result<()> {
    let (b, c, n) = (p.b, &p.w.config, p.n);
    b.embed(&p.w.token_embd, p.step, &mut a.x, n)?;
    for (lc, l) in c.layers.iter().zip(&p.w.layers) {
        match (&lc.mixer, &l.mixer) {
            (Mixer::Attention(at), MixerWeights::Attention(aw)) => {
                attention(p, at, aw, &l.attn_norm, caches, a)?;
                match (&aw.wo_bias, p.reduce) {
                    (None, None) => b.matmul_add(&aw.wo, &a.att, &mut a.x, &mut a.tmp, n, c.n_embd)?,
                    (bias, _) => {
                        b.matmul(&aw.wo, &a.att, &mut a.tmp, n)?;
                        sum_over_ranks(p, &mut a.tmp)?;
                        if let Some(bias) = bias {
                            b.add_bias(&mut a.tmp, bias, n, c.n_embd)?;
                        }
                        b.add(&mut a.x, &a.tmp, n * c.n_embd)?;
                    }
                }
            }
            (Mixer::DeltaNet(d), MixerWeights::DeltaNet(dw)) => {
                let states = states.as_deref_mut().ok_or_else(|| BackendError::BadPlan("a DeltaNet layer without recurrent states".into()))?;
                delta_net(p, d, dw, &l.attn_norm, states, a)?;
                b.matmul_add(&dw.out, &a.att, &mut a.x, &mut a.tmp, n, c.n_embd)?;
            }
            _ => return Err(BackendError::BadPlan("layer weights do not match the layer's mixer".into())),
        }
        ffn(p, lc, l, a, Out::AddToResidual)?;
    }
    lm_head(p, a)
}

/// A Gated DeltaNet of `norm(x)` into `a.att` (before its output projection): q/k/v through the
/// causal convolution, the delta rule over the sequence's state, the norm gated by `silu(z)`.
fn delta_net<B: Backend>(
    p: &Pass<B>,
    d: &DeltaNetConfig,
    w: &DeltaNetWeights<B>,
    norm: &B::Buffer,
    states: &mut RecurrentStates<B>,
    a: &mut Workspace<B>,
) -> Result<()> {
    let (b, c, n, s) = (p.b, &p.w.config, p.n, &mut a.dn);
    let params = recurrent::params(d);
    b.rms_norm(&a.x, norm, &mut a.h, n, c.n_embd, c.rms_eps)?;
    b.matmul(&w.qkv, &a.h, &mut s.qkv, n)?;
    b.matmul(&w.z, &a.h, &mut s.z, n)?;
    b.matmul(&w.alpha, &a.h, &mut s.g, n)?;
    b.matmul(&w.beta, &a.h, &mut s.beta, n)?;
    b.delta_net_gates(&mut s.g, &mut s.beta, &w.a, &w.dt_bias, n, d.n_v_heads)?;
    let (conv, ssm) = (&mut states.conv[d.state], &mut states.ssm[d.state]);
    b.ssm_conv(&s.qkv, &w.conv, conv, &states.slots, &mut s.conv, p.step, n, &params)?;
    b.delta_net(&s.conv, &s.g, &s.beta, ssm, &states.slots, &mut s.out, p.step, n, &params)?;
    b.rms_norm(&s.out, &w.norm, &mut s.normed, n * d.n_v_heads, d.head_dim, c.rms_eps)?;
    b.swiglu(&s.z, &s.normed, &mut a.att, n * d.v_width())
}

/// gemma3, gemma4: scaled embeddings, every block's output normed before its residual add;
/// Gemma 4's per-layer embeddings and output scales where the model has them.
fn gemma<B: Backend>(p: &Pass<B>, caches: &mut [B::KvCache], a: &mut Workspace<B>) -> Result<()> {
    let (b, c, n) = (p.b, &p.w.config, p.n);
    b.embed(&p.w.token_embd, p.step, &mut a.x, n)?;
    if let Some(s) = c.embd_scale {
        b.scale(&mut a.x, s, n * c.n_embd)?;
    }
    if let Some(inputs) = &p.w.per_layer_inputs {
        per_layer_inputs(p, inputs, a)?;
    }
    for (i, (lc, l)) in c.layers.iter().zip(&p.w.layers).enumerate() {
        let (Mixer::Attention(at), MixerWeights::Attention(aw)) = (&lc.mixer, &l.mixer) else {
            return Err(BackendError::BadPlan("a Gemma layer without attention".into()));
        };
        attention(p, at, aw, &l.attn_norm, caches, a)?;
        b.matmul(&aw.wo, &a.att, &mut a.tmp, n)?;
        norm_add(p, l.post_attn_norm.as_ref(), a)?;
        ffn(p, lc, l, a, Out::Scratch)?;
        norm_add(p, l.post_ffn_norm.as_ref(), a)?;
        if let Some(pl) = &l.per_layer {
            per_layer_block(p, pl, i, a)?;
        }
        if let Some(s) = l.output_scale {
            b.scale(&mut a.x, s, n * c.n_embd)?;
        }
    }
    lm_head(p, a)
}

/// Gemma 4's per-layer inputs from the (scaled) embeddings in `x`:
/// `(norm(proj(x) / sqrt(n_embd)) + ple_embd(token) * sqrt(width)) / sqrt(2)`, per layer.
fn per_layer_inputs<B: Backend>(p: &Pass<B>, inputs: &PerLayerInputs<B>, a: &mut Workspace<B>) -> Result<()> {
    let (b, c, n) = (p.b, &p.w.config, p.n);
    let d = c.per_layer_embd.unwrap_or(0);
    let len = n * c.n_layer * d;
    let [proj, normed] = &mut a.ple_scratch;
    b.embed(&inputs.token_embd, p.step, &mut a.ple, n)?;
    b.scale(&mut a.ple, (d as f32).sqrt(), len)?;
    b.matmul(&inputs.model_proj, &a.x, proj, n)?;
    b.scale(proj, 1.0 / (c.n_embd as f32).sqrt(), len)?;
    b.rms_norm(proj, &inputs.proj_norm, normed, n * c.n_layer, d, c.rms_eps)?;
    b.add(&mut a.ple, normed, len)?;
    b.scale(&mut a.ple, std::f32::consts::FRAC_1_SQRT_2, len)
}

/// Layer `layer`'s per-layer embedding block: `x += norm(proj(gelu(gate(x)) * input))`.
fn per_layer_block<B: Backend>(p: &Pass<B>, pl: &PerLayerWeights<B>, layer: usize, a: &mut Workspace<B>) -> Result<()> {
    let (b, c, n) = (p.b, &p.w.config, p.n);
    let d = c.per_layer_embd.unwrap_or(0);
    let [input, gate, act] = &mut a.ple_layer;
    b.copy_cols(&a.ple, c.n_layer * d, layer * d, input, d, n)?;
    b.matmul(&pl.gate, &a.x, gate, n)?;
    b.geglu(gate, input, act, n * d)?;
    b.matmul(&pl.proj, act, &mut a.tmp, n)?;
    norm_add(p, Some(&pl.norm), a)
}

/// `x += rms_norm(tmp)`.
fn norm_add<B: Backend>(p: &Pass<B>, norm: Option<&B::Buffer>, a: &mut Workspace<B>) -> Result<()> {
    let (c, len) = (&p.w.config, p.n * p.w.config.n_embd);
    let norm = norm.ok_or_else(|| BackendError::BadPlan("a Gemma block without its post-norm".into()))?;
    p.b.rms_norm(&a.tmp, norm, &mut a.h, p.n, c.n_embd, c.rms_eps)?;
    p.b.add(&mut a.x, &a.h, len)
}

/// Self-attention of `norm(x)` into `a.att` (before the output projection): q (and k, v where
/// the layer has its own), biases, q/k/v norms, rope with the layer's table, the step's K/V
/// stored, then paged attention over the layer's cache and window.
fn attention<B: Backend>(
    p: &Pass<B>,
    at: &AttentionConfig,
    l: &AttentionWeights<B>,
    norm: &B::Buffer,
    caches: &mut [B::KvCache],
    a: &mut Workspace<B>,
) -> Result<()> {
    let (b, c, n) = (p.b, &p.w.config, p.n);
    let (q_width, kv_width) = (at.n_head * at.head_dim, at.kv_width());
    let rope = &c.ropes[at.rope];
    let q_rope = RopeParams { kind: c.rope_kind, n_heads: at.n_head, head_dim: at.head_dim, n_rot: rope.n_rot };
    let table = &p.w.rope_tables[at.rope];
    let cache = caches.get_mut(at.cache).ok_or_else(|| BackendError::BadPlan(format!("no KV cache {}", at.cache)))?;
    match (at.kv, &l.wk) {
        (KvSource::Own { v_from_k }, Some(wk)) => {
            let wv = if v_from_k { wk } else { l.wv.as_ref().ok_or_else(|| BackendError::BadPlan("a layer without its value projection".into()))? };
            b.norm_matmul_qkv(&a.x, norm, c.rms_eps, &mut a.h, &l.wq, wk, wv, &mut a.q, &mut a.k, &mut a.v, n, c.n_embd)?;
        }
        (KvSource::Shared { .. }, None) => {
            b.rms_norm(&a.x, norm, &mut a.h, n, c.n_embd, c.rms_eps)?;
            b.matmul(&l.wq, &a.h, &mut a.q, n)?;
        }
        _ => return Err(BackendError::BadPlan("layer weights do not match the layer's KV source".into())),
    }
    if at.gated {
        // Each head's query is followed by its output gate.
        let (hd, rows) = (at.head_dim, n * at.n_head);
        b.copy_cols(&a.q, 2 * hd, hd, &mut a.q_gate, hd, rows)?;
        b.copy_cols(&a.q, 2 * hd, 0, &mut a.q_normed, hd, rows)?;
        b.copy(&a.q_normed, &mut a.q, n * q_width)?;
    }
    if l.wk.is_some() {
        if let Some([bq, bk, bv]) = &l.bias {
            b.add_bias(&mut a.q, bq, n, q_width)?;
            b.add_bias(&mut a.k, bk, n, kv_width)?;
            b.add_bias(&mut a.v, bv, n, kv_width)?;
        }
        let v = match &l.v_norm {
            Some(ones) => {
                b.rms_norm(&a.v, ones, &mut a.v_normed, n * at.n_head_kv, at.head_dim, c.rms_eps)?;
                &a.v_normed
            }
            None => &a.v,
        };
        let qk_norm = l.q_norm.as_ref().zip(l.k_norm.as_ref()).map(|(qn, kn)| (qn, kn, c.rms_eps));
        b.attention_prologue(&mut a.q, &mut a.k, v, qk_norm, (&mut a.q_normed, &mut a.k_normed), table, cache, p.step, n, &q_rope, at.n_head_kv)?;
    } else {
        if let Some(qn) = &l.q_norm {
            b.rms_norm(&a.q, qn, &mut a.q_normed, n * at.n_head, at.head_dim, c.rms_eps)?;
            b.copy(&a.q_normed, &mut a.q, n * q_width)?;
        }
        b.rope(&mut a.q, table, p.step, n, &q_rope)?;
    }
    let params = attention_params(at, p.max_seq_len);
    match &l.sinks {
        Some(sinks) => b.attention_sinks(&a.q, cache, sinks, &mut a.att, p.step, n, &params)?,
        None => b.attention(&a.q, cache, &mut a.att, p.step, n, &params)?,
    }
    if at.gated {
        b.sigmoid_gate(&mut a.att, &a.q_gate, n, q_width, q_width)?;
    }
    Ok(())
}

/// Where an FFN block leaves its output.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Out {
    /// `x += ffn(norm(x))`.
    AddToResidual,
    /// `tmp = ffn(norm(x))`.
    Scratch,
}

/// The layer's feed-forward of `norm(x)`: dense gated FFN or mixture of experts (with Gemma 4's
/// dense FFN beside it).
fn ffn<B: Backend>(p: &Pass<B>, lc: &LayerConfig, l: &LayerWeights<B>, a: &mut Workspace<B>, out: Out) -> Result<()> {
    let (b, c, n) = (p.b, &p.w.config, p.n);
    let len = n * c.n_embd;
    match (&l.ffn, &lc.ffn) {
        (FfnWeights::Dense(d), FfnConfig::Dense { n_ff }) => {
            dense_activation(p, d, &l.ffn_norm, *n_ff, a)?;
            match (out, p.reduce) {
                (Out::AddToResidual, None) => b.matmul_add(&d.down, &a.act, &mut a.x, &mut a.tmp, n, c.n_embd),
                (out, _) => {
                    b.matmul(&d.down, &a.act, &mut a.tmp, n)?;
                    sum_over_ranks(p, &mut a.tmp)?;
                    match out {
                        Out::AddToResidual => b.add(&mut a.x, &a.tmp, len),
                        Out::Scratch => Ok(()),
                    }
                }
            }
        }
        (FfnWeights::Moe(m), FfnConfig::Moe(mc)) => {
            match (&m.beside, mc.dense_ff) {
                (Some(side), Some(n_ff)) => {
                    // tmp = post_norm(dense(ffn_norm(x))) + moe_post_norm(moe(moe_norm(x)))
                    dense_activation(p, &side.ffn, &l.ffn_norm, n_ff, a)?;
                    b.matmul(&side.ffn.down, &a.act, &mut a.tmp, n)?;
                    b.rms_norm(&a.tmp, &side.post_norm, &mut a.ffn_out, n, c.n_embd, c.rms_eps)?;
                    moe(p, m, mc, &side.moe_norm, a)?;
                    b.rms_norm(&a.tmp, &side.moe_post_norm, &mut a.h, n, c.n_embd, c.rms_eps)?;
                    b.add(&mut a.ffn_out, &a.h, len)?;
                    b.copy(&a.ffn_out, &mut a.tmp, len)?;
                }
                (None, None) => {
                    moe(p, m, mc, &l.ffn_norm, a)?;
                    if let (Some(shared), Some(n_ff)) = (&m.shared, mc.shared_ff) {
                        // tmp += sigmoid(norm(x) · gate) * shared(norm(x))
                        dense_activation(p, &shared.ffn, &l.ffn_norm, n_ff, a)?;
                        b.matmul(&shared.ffn.down, &a.act, &mut a.ffn_out, n)?;
                        b.matmul(&shared.gate, &a.h, &mut a.shared_gate, n)?;
                        b.sigmoid_gate(&mut a.ffn_out, &a.shared_gate, n, c.n_embd, 1)?;
                        b.add(&mut a.tmp, &a.ffn_out, len)?;
                    }
                }
                _ => return Err(BackendError::BadPlan("the dense FFN beside the experts is missing".into())),
            }
            match out {
                Out::AddToResidual => b.add(&mut a.x, &a.tmp, len),
                Out::Scratch => Ok(()),
            }
        }
        _ => Err(BackendError::BadPlan("layer weights do not match the layer's FFN kind".into())),
    }
}

/// A row-parallel product's `[n][n_embd]` partial sums added up over the tensor-parallel ranks.
fn sum_over_ranks<B: Backend>(p: &Pass<B>, x: &mut B::Buffer) -> Result<()> {
    match p.reduce {
        Some(r) => r.sum(p.b, x, p.n * p.w.config.n_embd),
        None => Ok(()),
    }
}

/// `act = act(gate(norm(x))) * up(norm(x))`, ready for the down projection.
fn dense_activation<B: Backend>(p: &Pass<B>, d: &DenseFfn<B>, norm: &B::Buffer, n_ff: usize, a: &mut Workspace<B>) -> Result<()> {
    let (b, c, n) = (p.b, &p.w.config, p.n);
    match c.activation {
        Activation::Silu => b.norm_ffn_gate_up(&a.x, norm, c.rms_eps, &mut a.h, &d.gate, &d.up, &mut a.gate, &mut a.up, &mut a.act, n, c.n_embd, n_ff),
        act => {
            b.rms_norm(&a.x, norm, &mut a.h, n, c.n_embd, c.rms_eps)?;
            b.matmul(&d.gate, &a.h, &mut a.gate, n)?;
            b.matmul(&d.up, &a.h, &mut a.up, n)?;
            gated_activation(b, act, a, n * n_ff)
        }
    }
}

/// Mixture of experts of `norm(x)` into `tmp`: route, each chosen expert's gated FFN, and the
/// weighted sum of their outputs.
fn moe<B: Backend>(p: &Pass<B>, m: &MoeWeights<B>, mc: &MoeConfig, norm: &B::Buffer, a: &mut Workspace<B>) -> Result<()> {
    let (b, c, n, k) = (p.b, &p.w.config, p.n, mc.n_used);
    let router = RouterParams { n_experts: mc.n_expert, n_used: k, renormalize: mc.renormalize };
    if let Some(router_norm) = &m.router_norm {
        b.rms_norm(&a.x, router_norm, &mut a.h, n, c.n_embd, c.rms_eps)?;
        b.matmul(&m.router, &a.h, &mut a.router, n)?;
        b.rms_norm(&a.x, norm, &mut a.h, n, c.n_embd, c.rms_eps)?;
    } else {
        b.rms_norm(&a.x, norm, &mut a.h, n, c.n_embd, c.rms_eps)?;
        b.matmul(&m.router, &a.h, &mut a.router, n)?;
    }
    if let Some(bias) = &m.router_bias {
        b.add_bias(&mut a.router, bias, n, mc.n_expert)?;
    }
    b.moe_route(&a.router, m.expert_scale.as_ref(), &mut a.expert_ids, &mut a.expert_weights, n, &router)?;
    let ids = &a.expert_ids;
    match (&m.expert_bias, c.activation) {
        (None, Activation::Silu) => b.moe_gate_up_swiglu(&m.gate, &m.up, &a.h, ids, &mut a.gate, &mut a.up, &mut a.act, n, k, mc.n_ff)?,
        (bias, act) => {
            b.moe_matmul(&m.gate, &a.h, ids, &mut a.gate, n, k, ExpertInput::PerToken)?;
            b.moe_matmul(&m.up, &a.h, ids, &mut a.up, n, k, ExpertInput::PerToken)?;
            if let Some([gate, up, _]) = bias {
                b.moe_add_bias(&mut a.gate, gate, ids, n, k, mc.n_ff)?;
                b.moe_add_bias(&mut a.up, up, ids, n, k, mc.n_ff)?;
            }
            gated_activation(b, act, a, n * k * mc.n_ff)?;
        }
    }
    b.moe_matmul(&m.down, &a.act, &a.expert_ids, &mut a.expert_out, n, k, ExpertInput::PerSlot)?;
    if let Some([_, _, down]) = &m.expert_bias {
        b.moe_add_bias(&mut a.expert_out, down, &a.expert_ids, n, k, c.n_embd)?;
    }
    b.moe_combine(&a.expert_out, &a.expert_weights, &mut a.tmp, n, k, c.n_embd)
}

/// `act = act(gate) * up` over `len` values.
fn gated_activation<B: Backend>(b: &B, act: Activation, a: &mut Workspace<B>, len: usize) -> Result<()> {
    match act {
        Activation::Silu => b.swiglu(&a.gate, &a.up, &mut a.act, len),
        Activation::GeluTanh => b.geglu(&a.gate, &a.up, &mut a.act, len),
        Activation::SwiGluOai { alpha, limit } => b.swiglu_oai(&a.gate, &a.up, &mut a.act, len, alpha, limit),
    }
}

/// Final norm and output projection of the rows that produce logits, soft-capped where the
/// architecture caps them.
fn lm_head<B: Backend>(p: &Pass<B>, a: &mut Workspace<B>) -> Result<()> {
    let (b, c, rows) = (p.b, &p.w.config, p.n_rows);
    if rows == 0 {
        return Ok(());
    }
    b.gather_rows(&a.x, &mut a.rows, p.step, c.n_embd)?;
    b.rms_norm(&a.rows, &p.w.output_norm, &mut a.h, rows, c.n_embd, c.rms_eps)?;
    b.matmul(p.w.lm_head(), &a.h, &mut a.logits, rows)?;
    if let Some(cap) = c.final_softcap {
        b.softcap(&mut a.logits, cap, rows * c.n_vocab)?;
    }
    Ok(())
}
