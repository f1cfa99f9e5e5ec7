//! The forward pass of one step as straight sequences of backend ops: one builder per block
//! style ([`BlockStyle`]) over shared blocks (attention, dense or mixture-of-experts FFN, LM
//! head), each layer run with its own settings from [`crate::config::LayerConfig`].

use kiln_core::backend::{AttentionParams, Result};
use kiln_core::{
    AllReduce, AttentionArgs, Backend, BackendError, DeferredPrologue, DeviceBuffer, ExpertInput, GatedExperts, GatedFfn, GatedNorm, Linear, NormChain, QkNorm,
    Qkv, RopeParams, RouterArgs, RouterParams, TensorMut,
};

use crate::config::{AttentionConfig, BlockStyle, DeltaNetConfig, FfnConfig, KvSource, LayerConfig, Mixer, ModelConfig, MoeConfig};
use crate::recurrent::{self, RecurrentStates};
use crate::weights::{
    AttentionWeights, DeltaNetWeights, DenseFfn, FfnWeights, LayerWeights, MixerWeights, MoeWeights, PerLayerInputs, PerLayerWeights, SharedExpert, Weights,
};
use crate::window_kv::LayerCaches;

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
            FfnConfig::Moe(m) => (most_slots(m) * m.n_ff).max(m.dense_ff.unwrap_or(0)).max(m.shared_ff.unwrap_or(0)),
        });
        let moe = |f: &dyn Fn(&MoeConfig) -> usize| most(&|l| if let FfnConfig::Moe(m) = &l.ffn { f(m) } else { 0 });
        // A shared expert may be routed: one more logit and one more slot a token.
        let shared = |m: &MoeConfig| usize::from(m.shared_ff.is_some());
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
            router: b.alloc(tokens * moe(&|m| m.n_expert + shared(m)), "router logits")?,
            expert_ids: b.alloc(tokens * moe(&most_slots), "expert ids")?,
            expert_weights: b.alloc(tokens * moe(&most_slots), "expert weights")?,
            expert_out: b.alloc(tokens * moe(&most_slots) * c.n_embd, "expert outputs")?,
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
pub(crate) fn forward<B: Backend>(p: &Pass<B>, caches: &mut LayerCaches<B>, states: Option<&mut RecurrentStates<B>>, a: &mut Workspace<B>) -> Result<()> {
    match p.w.config.arch.block_style() {
        BlockStyle::PreNorm => pre_norm(p, caches, states, a),
        BlockStyle::Gemma => gemma(p, caches, a),
    }
}

/// llama, qwen2, qwen3, qwen3moe, Mixtral, gpt-oss, Qwen3.5 (attention or Gated DeltaNet).
fn pre_norm<B: Backend>(p: &Pass<B>, caches: &mut LayerCaches<B>, mut states: Option<&mut RecurrentStates<B>>, a: &mut Workspace<B>) -> Result<()> {
    let (b, c, n, e) = (p.b, &p.w.config, p.n, p.w.config.n_embd);
    b.embed(&p.w.token_embd, p.step, a.x.rows_mut(n, e)?)?;
    // The attention norm the last FFN prepared with its residual add (NormChain).
    let mut prepared = None;
    for (i, (lc, l)) in c.layers.iter().zip(&p.w.layers).enumerate() {
        let next_attention_norm = match (c.layers.get(i + 1).map(|lc| &lc.mixer), p.w.layers.get(i + 1)) {
            (Some(Mixer::Attention(at)), Some(next)) if matches!(at.kv, KvSource::Own { .. }) => Some((next.attn_norm.whole(), c.rms_eps)),
            // The LM head's norm, where it reads the residual itself (lm_head).
            (None, _) if p.n_rows == n => Some((p.w.output_norm.whole(), c.rms_eps)),
            _ => None,
        };
        match (&lc.mixer, &l.mixer) {
            (Mixer::Attention(at), MixerWeights::Attention(aw)) => {
                let defer = defers_prologue(p, at, aw, caches)?;
                attention_projections(p, at, aw, &l.attn_norm, a, prepared.take())?;
                if !defer {
                    attention_prologue(p, at, aw, caches, a)?;
                }
                let q_width = at.n_head * at.head_dim;
                let wo_bias = aw.wo_bias.as_ref().map(|b| b.whole());
                match p.reduce {
                    None if !at.gated => {
                        let (cache, step) = caches.get(at.cache)?;
                        let params = attention_params(at, p.max_seq_len);
                        let prologue = if defer { Some(deferred_prologue(p, at, aw, [&a.k, &a.v])?) } else { None };
                        let sinks = aw.sinks.as_ref().map(|s| s.whole());
                        let args = AttentionArgs { q: a.q.rows(n, q_width)?, cache, sinks, step, params: &params, prologue };
                        let ffn_norm = chained_dense_ffn(p, lc, l).map(|_| (l.ffn_norm.whole(), c.rms_eps));
                        let wo = Linear::new(&aw.wo, wo_bias);
                        prepared = b.attention_matmul_add(args, a.att.rows_mut(n, q_width)?, wo, a.x.rows_mut(n, e)?, a.tmp.rows_mut(n, e)?, ffn_norm)?;
                    }
                    None => {
                        // A gated attention's output: its product added to the residual in the product.
                        attention(p, at, aw, caches, a)?;
                        b.linear_add(Linear::new(&aw.wo, wo_bias), a.att.rows(n, q_width)?, a.x.rows_mut(n, e)?, a.tmp.rows_mut(n, e)?)?;
                    }
                    Some(_) => {
                        attention(p, at, aw, caches, a)?;
                        b.matmul(&aw.wo, a.att.rows(n, q_width)?, a.tmp.rows_mut(n, e)?)?;
                        // The ranks' partial products are summed before the bias is added once.
                        sum_over_ranks(p, a.tmp.rows_mut(n, e)?)?;
                        if let Some(bias) = wo_bias {
                            b.add_bias(a.tmp.rows_mut(n, e)?, bias)?;
                        }
                        b.add(a.x.rows_mut(n, e)?, a.tmp.rows(n, e)?)?;
                    }
                }
            }
            (Mixer::DeltaNet(d), MixerWeights::DeltaNet(dw)) => {
                let states = states.as_deref_mut().ok_or_else(|| BackendError::BadPlan("a DeltaNet layer without recurrent states".into()))?;
                delta_net(p, d, dw, &l.attn_norm, states, a)?;
            }
            _ => return Err(BackendError::BadPlan("layer weights do not match the layer's mixer".into())),
        }
        let chain = NormChain { prepared: prepared.take(), next: next_attention_norm };
        prepared = ffn(p, lc, l, a, Out::AddToResidual, chain)?;
    }
    lm_head(p, a, prepared)
}

/// A Gated DeltaNet of `norm(x)` added to the residual: q/k/v through the causal convolution,
/// the delta rule over the sequence's state, the norm gated by `silu(z)`, the output projection.
fn delta_net<B: Backend>(
    p: &Pass<B>,
    d: &DeltaNetConfig,
    w: &DeltaNetWeights<B>,
    norm: &B::Buffer,
    states: &mut RecurrentStates<B>,
    a: &mut Workspace<B>,
) -> Result<()> {
    let (b, c, n, e, s) = (p.b, &p.w.config, p.n, p.w.config.n_embd, &mut a.dn);
    let (conv_dim, heads, v_width) = (d.conv_dim(), d.n_v_heads, d.v_width());
    let params = recurrent::params(d);
    let projections = [s.qkv.rows_mut(n, conv_dim)?, s.z.rows_mut(n, v_width)?, s.g.rows_mut(n, heads)?, s.beta.rows_mut(n, heads)?];
    b.norm_matmuls(a.x.rows(n, e)?, (norm.whole(), c.rms_eps), a.h.rows_mut(n, e)?, [&w.qkv, &w.z, &w.alpha, &w.beta].map(Linear::plain), projections, None)?;
    let [conv, ssm] = states.layer(d.state, &params)?;
    b.ssm_conv(s.qkv.rows(n, conv_dim)?, w.conv.rows(conv_dim, d.conv_kernel)?, conv, s.conv.rows_mut(n, conv_dim)?, p.step, &params)?;
    let (gates, gate_params) = ([s.g.rows_mut(n, heads)?, s.beta.rows_mut(n, heads)?], [w.a.whole(), w.dt_bias.whole()]);
    b.delta_net_from_projections(s.conv.rows(n, conv_dim)?, gates, gate_params, ssm, s.out.rows_mut(n, v_width)?, p.step, &params)?;
    let gated = GatedNorm { x: s.out.view([n, heads, d.head_dim])?, z: s.z.rows(n, v_width)?, weight: w.norm.whole(), eps: c.rms_eps };
    let scratch = [s.normed.view_mut([n, heads, d.head_dim])?, a.att.rows_mut(n, v_width)?];
    b.gated_norm_matmul_add(gated, scratch, &w.out, a.x.rows_mut(n, e)?, a.tmp.rows_mut(n, e)?)
}

/// gemma3, gemma4: scaled embeddings, every block's output normed before its residual add;
/// Gemma 4's per-layer embeddings and output scales where the model has them.
fn gemma<B: Backend>(p: &Pass<B>, caches: &mut LayerCaches<B>, a: &mut Workspace<B>) -> Result<()> {
    let (b, c, n, e) = (p.b, &p.w.config, p.n, p.w.config.n_embd);
    b.embed(&p.w.token_embd, p.step, a.x.rows_mut(n, e)?)?;
    if let Some(s) = c.embd_scale {
        b.scale(a.x.rows_mut(n, e)?, s)?;
    }
    if let Some(inputs) = &p.w.per_layer_inputs {
        per_layer_inputs(p, inputs, a)?;
    }
    for (i, (lc, l)) in c.layers.iter().zip(&p.w.layers).enumerate() {
        let (Mixer::Attention(at), MixerWeights::Attention(aw)) = (&lc.mixer, &l.mixer) else {
            return Err(BackendError::BadPlan("a Gemma layer without attention".into()));
        };
        attention_projections(p, at, aw, &l.attn_norm, a, None)?;
        attention_prologue(p, at, aw, caches, a)?;
        let (cache, step) = caches.get(at.cache)?;
        let (params, q_width) = (attention_params(at, p.max_seq_len), at.n_head * at.head_dim);
        let args = AttentionArgs { q: a.q.rows(n, q_width)?, cache, sinks: aw.sinks.as_ref().map(|s| s.whole()), step, params: &params, prologue: None };
        b.attention_matmul(args, a.att.rows_mut(n, q_width)?, &aw.wo, a.tmp.rows_mut(n, e)?)?;
        norm_add(p, l.post_attn_norm.as_ref(), a, 1.0)?;
        ffn_unchained(p, lc, l, a, Out::Scratch)?;
        // The layer's output scale comes last: after the per-layer block where there is one.
        let scale = l.output_scale.unwrap_or(1.0);
        match &l.per_layer {
            Some(pl) => {
                norm_add(p, l.post_ffn_norm.as_ref(), a, 1.0)?;
                per_layer_block(p, pl, i, a)?;
                if scale != 1.0 {
                    b.scale(a.x.rows_mut(n, e)?, scale)?;
                }
            }
            None => norm_add(p, l.post_ffn_norm.as_ref(), a, scale)?,
        }
    }
    lm_head(p, a, None)
}

/// Gemma 4's per-layer inputs from the (scaled) embeddings in `x`:
/// `(norm(proj(x) / sqrt(n_embd)) + ple_embd(token) * sqrt(width)) / sqrt(2)`, per layer.
fn per_layer_inputs<B: Backend>(p: &Pass<B>, inputs: &PerLayerInputs<B>, a: &mut Workspace<B>) -> Result<()> {
    let (b, c, n, e) = (p.b, &p.w.config, p.n, p.w.config.n_embd);
    let (d, layers) = (c.per_layer_embd.unwrap_or(0), c.n_layer);
    let width = layers * d;
    let [proj, normed] = &mut a.ple_scratch;
    b.embed(&inputs.token_embd, p.step, a.ple.rows_mut(n, width)?)?;
    b.scale(a.ple.rows_mut(n, width)?, (d as f32).sqrt())?;
    b.matmul(&inputs.model_proj, a.x.rows(n, e)?, proj.rows_mut(n, width)?)?;
    b.scale(proj.rows_mut(n, width)?, 1.0 / (e as f32).sqrt())?;
    b.rms_norm(proj.view([n, layers, d])?, inputs.proj_norm.whole(), normed.view_mut([n, layers, d])?, c.rms_eps)?;
    b.add(a.ple.rows_mut(n, width)?, normed.rows(n, width)?)?;
    b.scale(a.ple.rows_mut(n, width)?, std::f32::consts::FRAC_1_SQRT_2)
}

/// Layer `layer`'s per-layer embedding block: `x += norm(proj(gelu(gate(x)) * input))`.
fn per_layer_block<B: Backend>(p: &Pass<B>, pl: &PerLayerWeights<B>, layer: usize, a: &mut Workspace<B>) -> Result<()> {
    let (b, c, n, e) = (p.b, &p.w.config, p.n, p.w.config.n_embd);
    let d = c.per_layer_embd.unwrap_or(0);
    let [input, gate, act] = &mut a.ple_layer;
    b.copy_cols(a.ple.rows(n, c.n_layer * d)?, layer * d, input.rows_mut(n, d)?)?;
    b.matmul(&pl.gate, a.x.rows(n, e)?, gate.rows_mut(n, d)?)?;
    b.geglu(gate.rows(n, d)?, input.rows(n, d)?, act.rows_mut(n, d)?)?;
    b.matmul(&pl.proj, act.rows(n, d)?, a.tmp.rows_mut(n, e)?)?;
    norm_add(p, Some(&pl.norm), a, 1.0)
}

/// `x = (x + rms_norm(tmp)) * scale`.
fn norm_add<B: Backend>(p: &Pass<B>, norm: Option<&B::Buffer>, a: &mut Workspace<B>, scale: f32) -> Result<()> {
    let (c, n, e) = (&p.w.config, p.n, p.w.config.n_embd);
    let norm = norm.ok_or_else(|| BackendError::BadPlan("a Gemma block without its post-norm".into()))?;
    p.b.rms_norm_add(a.tmp.rows(n, e)?, (norm.whole(), c.rms_eps), a.h.rows_mut(n, e)?, a.x.rows_mut(n, e)?, scale)
}

/// Whether this layer's attention takes its prologue itself (the fused attention of
/// `pre_norm`, for a layer with its own plain keys and values: no v norm or gate; biases are
/// the projections').
fn defers_prologue<B: Backend>(p: &Pass<B>, at: &AttentionConfig, l: &AttentionWeights<B>, caches: &mut LayerCaches<B>) -> Result<bool> {
    let plain = matches!(at.kv, KvSource::Own { v_from_k: false }) && l.wk.is_some() && l.v_norm.is_none();
    if !plain || at.gated || p.reduce.is_some() {
        return Ok(false);
    }
    let (cache, step) = caches.get(at.cache)?;
    Ok(p.b.defers_attention_prologue(cache, step, &attention_params(at, p.max_seq_len)))
}

/// The prologue `attention_prologue` would have run: the projected keys and values (`a.k`, `a.v`),
/// the layer's q/k norms and rope table.
fn deferred_prologue<'t, B: Backend>(
    p: &Pass<'t, B>,
    at: &AttentionConfig,
    l: &'t AttentionWeights<B>,
    [k, v]: [&'t B::Buffer; 2],
) -> Result<DeferredPrologue<'t, B::Buffer>> {
    let (n, kv_heads, hd) = (p.n, at.n_head_kv, at.head_dim);
    let qk_norm = match (&l.q_norm, &l.k_norm) {
        (Some(qn), Some(kn)) => Some((qn.whole(), kn.whole(), p.w.config.rms_eps)),
        _ => None,
    };
    Ok(DeferredPrologue {
        k: k.view([n, kv_heads, hd])?,
        v: v.rows(n, at.kv_width())?,
        qk_norm,
        inv_freq: p.w.rope_tables[at.rope].whole(),
        rope: RopeParams { kind: p.w.config.rope_kind },
    })
}

/// Self-attention's projections of `norm(x)`: q (with its gate split off into `a.q_gate` where
/// the layer gates it) into `a.q`, and k, v into `a.k`, `a.v` where the layer has its own.
fn attention_projections<B: Backend>(
    p: &Pass<B>,
    at: &AttentionConfig,
    l: &AttentionWeights<B>,
    norm: &B::Buffer,
    a: &mut Workspace<B>,
    prepared: Option<B::NormedInput>,
) -> Result<()> {
    let (b, c, n, e) = (p.b, &p.w.config, p.n, p.w.config.n_embd);
    let (q_width, kv_width) = (at.n_head * at.head_dim, at.kv_width());
    let (x, norm) = (a.x.rows(n, e)?, (norm.whole(), c.rms_eps));
    match (at.kv, &l.wk, &l.q_gate) {
        (KvSource::Own { v_from_k }, Some(wk), q_gate) => {
            let wv = if v_from_k { wk } else { l.wv.as_ref().ok_or_else(|| BackendError::BadPlan("a layer without its value projection".into()))? };
            let qkv = [a.q.rows_mut(n, q_width)?, a.k.rows_mut(n, kv_width)?, a.v.rows_mut(n, kv_width)?];
            let bias = |i: usize| l.bias.as_ref().map(|b| b[i].whole());
            let linears = [Linear::new(&l.wq, bias(0)), Linear::new(wk, bias(1)), Linear::new(wv, bias(2))];
            match q_gate {
                Some(gate) => {
                    let [q, k, v] = qkv;
                    let linears = [linears[0], Linear::plain(gate), linears[1], linears[2]];
                    b.norm_matmuls(x, norm, a.h.rows_mut(n, e)?, linears, [q, a.q_gate.rows_mut(n, q_width)?, k, v], prepared)?;
                }
                None => b.norm_matmuls(x, norm, a.h.rows_mut(n, e)?, linears, qkv, prepared)?,
            }
        }
        (KvSource::Shared { .. }, None, q_gate) => {
            b.rms_norm(x, norm.0, a.h.rows_mut(n, e)?, norm.1)?;
            b.matmul(&l.wq, a.h.rows(n, e)?, a.q.rows_mut(n, q_width)?)?;
            if let Some(gate) = q_gate {
                b.matmul(gate, a.h.rows(n, e)?, a.q_gate.rows_mut(n, q_width)?)?;
            }
        }
        _ => return Err(BackendError::BadPlan("layer weights do not match the layer's KV source".into())),
    }
    Ok(())
}

/// The attention prologue after the projections (which added the biases): q/k/v norms, rope
/// with the layer's table and the step's K/V stored in the layer's cache (read through the step
/// of the cache's pool); the final queries are left in `a.q`.
fn attention_prologue<B: Backend>(p: &Pass<B>, at: &AttentionConfig, l: &AttentionWeights<B>, caches: &mut LayerCaches<B>, a: &mut Workspace<B>) -> Result<()> {
    let (b, c, n) = (p.b, &p.w.config, p.n);
    let (heads, kv_heads, hd) = (at.n_head, at.n_head_kv, at.head_dim);
    let (q_width, kv_width) = (heads * hd, at.kv_width());
    let rope = RopeParams { kind: c.rope_kind };
    let table = p.w.rope_tables[at.rope].whole();
    let (cache, step) = caches.get(at.cache)?;
    if l.wk.is_some() {
        let qk_norm = match (&l.q_norm, &l.k_norm, &l.v_norm) {
            (Some(qn), Some(kn), v_norm) => {
                let scratch = [a.q_normed.view_mut([n, heads, hd])?, a.k_normed.view_mut([n, kv_heads, hd])?];
                let v = match v_norm {
                    Some(w) => Some((w.whole(), a.v_normed.view_mut([n, kv_heads, hd])?)),
                    None => None,
                };
                Some(QkNorm { q: qn.whole(), k: kn.whole(), eps: c.rms_eps, scratch, v })
            }
            (_, _, None) => None,
            _ => return Err(BackendError::BadPlan("a value norm without query and key norms".into())),
        };
        let qkv = Qkv { q: a.q.view_mut([n, heads, hd])?, k: a.k.view_mut([n, kv_heads, hd])?, v: a.v.rows(n, kv_width)? };
        b.attention_prologue(qkv, qk_norm, table, &rope, cache, step)?;
    } else {
        if let Some(qn) = &l.q_norm {
            b.rms_norm(a.q.view([n, heads, hd])?, qn.whole(), a.q_normed.view_mut([n, heads, hd])?, c.rms_eps)?;
            b.copy(a.q_normed.rows(n, q_width)?, a.q.rows_mut(n, q_width)?)?;
        }
        b.rope(a.q.view_mut([n, heads, hd])?, table, step, &rope)?;
    }
    Ok(())
}

/// The attention of the queries `attention_prologue` left in `a.q` into `a.att`, gated where the
/// layer gates it.
fn attention<B: Backend>(p: &Pass<B>, at: &AttentionConfig, l: &AttentionWeights<B>, caches: &mut LayerCaches<B>, a: &mut Workspace<B>) -> Result<()> {
    let (b, n, q_width) = (p.b, p.n, at.n_head * at.head_dim);
    let (cache, step) = caches.get(at.cache)?;
    let params = attention_params(at, p.max_seq_len);
    let (q, out) = (a.q.rows(n, q_width)?, a.att.rows_mut(n, q_width)?);
    match &l.sinks {
        Some(sinks) => b.attention_sinks(q, cache, sinks.whole(), out, step, &params)?,
        None => b.attention(q, cache, out, step, &params)?,
    }
    if at.gated {
        b.sigmoid_gate(a.att.rows_mut(n, q_width)?, a.q_gate.rows(n, q_width)?)?;
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

/// The layer's dense gated FFN where it is added straight to the residual (one backend call,
/// [`Backend::norm_gated_ffn_add`]), with its width.
fn chained_dense_ffn<'a, B: Backend>(p: &Pass<B>, lc: &LayerConfig, l: &'a LayerWeights<B>) -> Option<(&'a DenseFfn<B>, usize)> {
    match (&l.ffn, &lc.ffn) {
        (FfnWeights::Dense(d), FfnConfig::Dense { n_ff }) if p.reduce.is_none() => Some((d, *n_ff)),
        _ => None,
    }
}

/// A dense FFN's weights with the model's gate activation.
fn gated_ffn<'a, B: Backend>(p: &Pass<B>, d: &'a DenseFfn<B>) -> GatedFfn<'a, B> {
    GatedFfn { gate: &d.gate, up: &d.up, down: &d.down, act: p.w.config.activation }
}

/// The layer's feed-forward of `norm(x)`: dense gated FFN or mixture of experts (with Gemma 4's
/// dense FFN beside it). Along `chain` the dense gated FFN added to the residual takes the
/// norm the attention prepared and prepares the next layer's; returns what it prepared.
fn ffn<B: Backend>(p: &Pass<B>, lc: &LayerConfig, l: &LayerWeights<B>, a: &mut Workspace<B>, out: Out, chain: NormChain<B>) -> Result<Option<B::NormedInput>> {
    let (b, c, n, e) = (p.b, &p.w.config, p.n, p.w.config.n_embd);
    if let (Some((d, n_ff)), Out::AddToResidual) = (chained_dense_ffn(p, lc, l), out) {
        let scratch = [a.gate.rows_mut(n, n_ff)?, a.up.rows_mut(n, n_ff)?];
        let (x, h, act, tmp) = (a.x.rows_mut(n, e)?, a.h.rows_mut(n, e)?, a.act.rows_mut(n, n_ff)?, a.tmp.rows_mut(n, e)?);
        return b.norm_gated_ffn_add(x, (l.ffn_norm.whole(), c.rms_eps), h, gated_ffn(p, d), scratch, act, tmp, chain);
    }
    ffn_unchained(p, lc, l, a, out).map(|()| None)
}

/// [`ffn`] for the FFNs that take no norm along a chain.
fn ffn_unchained<B: Backend>(p: &Pass<B>, lc: &LayerConfig, l: &LayerWeights<B>, a: &mut Workspace<B>, out: Out) -> Result<()> {
    let (b, c, n, e) = (p.b, &p.w.config, p.n, p.w.config.n_embd);
    match (&l.ffn, &lc.ffn) {
        (FfnWeights::Dense(d), FfnConfig::Dense { n_ff }) => {
            let (scratch, norm) = ([a.gate.rows_mut(n, *n_ff)?, a.up.rows_mut(n, *n_ff)?], (l.ffn_norm.whole(), c.rms_eps));
            let (x, h, act) = (a.x.rows(n, e)?, a.h.rows_mut(n, e)?, a.act.rows_mut(n, *n_ff)?);
            b.norm_gated_ffn(x, norm, h, gated_ffn(p, d), scratch, act, a.tmp.rows_mut(n, e)?)?;
            sum_over_ranks(p, a.tmp.rows_mut(n, e)?)?;
            match out {
                Out::AddToResidual => b.add(a.x.rows_mut(n, e)?, a.tmp.rows(n, e)?),
                Out::Scratch => Ok(()),
            }
        }
        (FfnWeights::Moe(m), FfnConfig::Moe(mc)) => {
            match (&m.beside, mc.dense_ff) {
                (Some(side), Some(n_ff)) => {
                    // tmp = post_norm(dense(ffn_norm(x))) + moe_post_norm(moe(moe_norm(x))): the
                    // dense block's output in ffn_out, the experts' weighted sum in h (free once
                    // the experts have read it), both normed and summed in one call.
                    let (scratch, norm) = ([a.gate.rows_mut(n, n_ff)?, a.up.rows_mut(n, n_ff)?], (l.ffn_norm.whole(), c.rms_eps));
                    let (x, h, act) = (a.x.rows(n, e)?, a.h.rows_mut(n, e)?, a.act.rows_mut(n, n_ff)?);
                    b.norm_gated_ffn(x, norm, h, gated_ffn(p, &side.ffn), scratch, act, a.ffn_out.rows_mut(n, e)?)?;
                    routed_experts(p, m, mc, &side.moe_norm, a)?;
                    let (y, weights) = (a.expert_out.view([n, mc.n_used, e])?, a.expert_weights.rows(n, mc.n_used)?);
                    b.moe_combine(y, weights, a.h.rows_mut(n, e)?)?;
                    let post_norms = [side.post_norm.whole(), side.moe_post_norm.whole()];
                    b.rms_norm_sum(a.ffn_out.rows_mut(n, e)?, a.h.rows(n, e)?, post_norms, c.rms_eps, a.tmp.rows_mut(n, e)?)?;
                }
                (None, None) => {
                    let (Some(SharedExpert::Apart { ffn: shared, .. }), Some(n_ff)) = (&m.shared, mc.shared_ff) else {
                        return moe(p, m, mc, &l.ffn_norm, a, out);
                    };
                    routed_experts(p, m, mc, &l.ffn_norm, a)?;
                    // The shared expert beside them on their normed input, gated by
                    // sigmoid(norm(x) · gate).
                    let scratch = [a.gate.rows_mut(n, n_ff)?, a.up.rows_mut(n, n_ff)?];
                    b.gated_ffn(a.h.rows(n, e)?, gated_ffn(p, shared), scratch, a.act.rows_mut(n, n_ff)?, a.ffn_out.rows_mut(n, e)?)?;
                    let (y, weights) = (a.expert_out.view([n, mc.n_used, e])?, a.expert_weights.rows(n, mc.n_used)?);
                    let shared_out = (a.ffn_out.rows_mut(n, e)?, a.shared_gate.rows(n, 1)?);
                    return match out {
                        Out::AddToResidual => b.moe_combine_shared_add(y, weights, shared_out, a.x.rows_mut(n, e)?, a.tmp.rows_mut(n, e)?),
                        Out::Scratch => {
                            let (mut shared, gate) = shared_out;
                            b.moe_combine(y, weights, a.tmp.rows_mut(n, e)?)?;
                            b.sigmoid_gate(shared.reborrow(), gate)?;
                            b.add(a.tmp.rows_mut(n, e)?, shared.as_ref())
                        }
                    };
                }
                _ => return Err(BackendError::BadPlan("the dense FFN beside the experts is missing".into())),
            }
            match out {
                Out::AddToResidual => b.add(a.x.rows_mut(n, e)?, a.tmp.rows(n, e)?),
                Out::Scratch => Ok(()),
            }
        }
        _ => Err(BackendError::BadPlan("layer weights do not match the layer's FFN kind".into())),
    }
}

/// A row-parallel product's partial sums added up over the tensor-parallel ranks.
fn sum_over_ranks<B: Backend>(p: &Pass<B>, x: TensorMut<B::Buffer>) -> Result<()> {
    match p.reduce {
        Some(r) => r.sum(p.b, x),
        None => Ok(()),
    }
}

/// Mixture of experts of `norm(x)` into `tmp` (or added to `x`): [`routed_experts`], then the
/// weighted sum of their outputs.
fn moe<B: Backend>(p: &Pass<B>, m: &MoeWeights<B>, mc: &MoeConfig, norm: &B::Buffer, a: &mut Workspace<B>, out: Out) -> Result<()> {
    let (b, n, e) = (p.b, p.n, p.w.config.n_embd);
    routed_experts(p, m, mc, norm, a)?;
    let k = slots(m, mc);
    let (y, weights) = (a.expert_out.view([n, k, e])?, a.expert_weights.rows(n, k)?);
    match out {
        Out::AddToResidual => b.moe_combine_add(y, weights, a.x.rows_mut(n, e)?, a.tmp.rows_mut(n, e)?),
        Out::Scratch => b.moe_combine(y, weights, a.tmp.rows_mut(n, e)?),
    }
}

/// Expert slots a token of these weights fills: its `n_used` chosen, and a routed shared
/// expert's.
fn slots<B: Backend>(m: &MoeWeights<B>, mc: &MoeConfig) -> usize {
    mc.n_used + usize::from(matches!(m.shared, Some(SharedExpert::Routed)))
}

/// The most expert slots a token of a layer of `m` fills (its shared expert may be routed).
fn most_slots(m: &MoeConfig) -> usize {
    m.n_used + usize::from(m.shared_ff.is_some())
}

/// The routed experts of `norm(x)`: the route (ids and weights in `a.expert_ids`,
/// `a.expert_weights`, an apart shared expert's gate logit in `a.shared_gate`; `norm(x)` in
/// `a.h`) and each chosen expert's gated FFN into `a.expert_out` (`[n, slots, n_embd]`).
fn routed_experts<B: Backend>(p: &Pass<B>, m: &MoeWeights<B>, mc: &MoeConfig, norm: &B::Buffer, a: &mut Workspace<B>) -> Result<()> {
    let (b, c, n, e) = (p.b, &p.w.config, p.n, p.w.config.n_embd);
    let routed_shared = matches!(m.shared, Some(SharedExpert::Routed));
    let (n_expert, k, ff) = (mc.n_expert, slots(m, mc), mc.n_ff);
    let shared_gate = match &m.shared {
        Some(SharedExpert::Apart { gate, .. }) => Some((gate, a.shared_gate.rows_mut(n, 1)?)),
        _ => None,
    };
    let router = RouterArgs {
        weight: &m.router,
        norm: m.router_norm.as_ref().map(|w| w.whole()),
        bias: m.router_bias.as_ref().map(|b| b.whole()),
        expert_scale: m.expert_scale.as_ref().map(|s| s.whole()),
        params: RouterParams { renormalize: mc.renormalize, shared_expert: routed_shared },
        shared_gate,
    };
    let routes = [a.expert_ids.rows_mut(n, k)?, a.expert_weights.rows_mut(n, k)?];
    b.moe_norm_route(
        a.x.rows(n, e)?,
        (norm.whole(), c.rms_eps),
        router,
        a.h.rows_mut(n, e)?,
        a.router.rows_mut(n, n_expert + usize::from(routed_shared))?,
        routes,
    )?;
    let (h, ids, ff_shape) = (a.h.rows(n, e)?, a.expert_ids.rows(n, k)?, [n, k, ff]);
    let (bias, down_bias) = match &m.expert_bias {
        Some([gate, up, down]) => (Some([gate.rows(n_expert, ff)?, up.rows(n_expert, ff)?]), Some(down.rows(n_expert, e)?)),
        None => (None, None),
    };
    let experts = GatedExperts { gate: &m.gate, up: &m.up, bias, act: c.activation };
    b.moe_gate_up(experts, h, ids, [a.gate.view_mut(ff_shape)?, a.up.view_mut(ff_shape)?], a.act.view_mut(ff_shape)?)?;
    let (act, down_out) = (a.act.view(ff_shape)?, a.expert_out.view_mut([n, k, e])?);
    match down_bias {
        Some(bias) => b.moe_matmul_bias(&m.down, bias, act, ids, down_out, ExpertInput::PerSlot),
        None => b.moe_matmul(&m.down, act, ids, down_out, ExpertInput::PerSlot),
    }
}

/// Final norm and output projection of the rows that produce logits, soft-capped where the
/// architecture caps them; `prepared`: that norm as the last layer left it ([`NormChain`]).
fn lm_head<B: Backend>(p: &Pass<B>, a: &mut Workspace<B>, prepared: Option<B::NormedInput>) -> Result<()> {
    let (b, c, rows, e) = (p.b, &p.w.config, p.n_rows, p.w.config.n_embd);
    if rows == 0 {
        return Ok(());
    }
    // A row per token is every token in order (FlatPlan): nothing to gather.
    let x = if rows == p.n {
        a.x.rows(rows, e)?
    } else {
        b.gather_rows(a.x.rows(p.n, e)?, a.rows.rows_mut(rows, e)?, p.step)?;
        a.rows.rows(rows, e)?
    };
    let norm = (p.w.output_norm.whole(), c.rms_eps);
    b.norm_matmuls(x, norm, a.h.rows_mut(rows, e)?, [Linear::plain(p.w.lm_head())], [a.logits.rows_mut(rows, c.n_vocab)?], prepared)?;
    if let Some(cap) = c.final_softcap {
        b.softcap(a.logits.rows_mut(rows, c.n_vocab)?, cap)?;
    }
    Ok(())
}
