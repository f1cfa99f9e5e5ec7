//! The forward pass of one step as straight sequences of backend ops: one builder per block
//! style ([`BlockStyle`]) over shared blocks (attention, dense or mixture-of-experts FFN, LM
//! head), each layer run with its own settings from [`crate::config::LayerConfig`].

use kiln_core::backend::{AttentionParams, Result};
use kiln_core::{Backend, ExpertInput, RopeParams, RouterParams};

use crate::config::{Activation, AttentionConfig, BlockStyle, FfnConfig, LayerConfig, ModelConfig};
use crate::weights::{FfnWeights, LayerWeights, MoeWeights, Weights};

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
    /// Hidden states of the rows that produce logits.
    rows: B::Buffer,
    pub(crate) logits: B::Buffer,
}

impl<B: Backend> Workspace<B> {
    pub(crate) fn new(b: &B, c: &ModelConfig, tokens: usize, logit_rows: usize) -> kiln_core::backend::Result<Workspace<B>> {
        let most = |f: &dyn Fn(&LayerConfig) -> usize| c.layers.iter().map(f).max().unwrap_or(0);
        let q_width = most(&|l| l.attn.n_head * l.attn.head_dim);
        let kv_width = most(&|l| l.attn.n_head_kv * l.attn.head_dim);
        // Gate/up/activation hold a dense FFN's `n_ff` or every chosen expert's.
        let ff = most(&|l| match &l.ffn {
            FfnConfig::Dense { n_ff } => *n_ff,
            FfnConfig::Moe(m) => m.n_used * m.n_ff,
        });
        let moe = |f: &dyn Fn(&crate::config::MoeConfig) -> usize| most(&|l| if let FfnConfig::Moe(m) = &l.ffn { f(m) } else { 0 });
        Ok(Workspace {
            x: b.alloc(tokens * c.n_embd, "hidden state")?,
            h: b.alloc(tokens * c.n_embd.max(q_width), "normed state")?,
            q: b.alloc(tokens * q_width, "queries")?,
            k: b.alloc(tokens * kv_width, "keys")?,
            v: b.alloc(tokens * kv_width, "values")?,
            q_normed: b.alloc(tokens * q_width, "normed queries")?,
            k_normed: b.alloc(tokens * kv_width, "normed keys")?,
            att: b.alloc(tokens * q_width, "attention output")?,
            gate: b.alloc(tokens * ff, "ffn gate")?,
            up: b.alloc(tokens * ff, "ffn up")?,
            act: b.alloc(tokens * ff, "ffn activation")?,
            tmp: b.alloc(tokens * c.n_embd, "residual scratch")?,
            router: b.alloc(tokens * moe(&|m| m.n_expert), "router logits")?,
            expert_ids: b.alloc(tokens * moe(&|m| m.n_used), "expert ids")?,
            expert_weights: b.alloc(tokens * moe(&|m| m.n_used), "expert weights")?,
            expert_out: b.alloc(tokens * moe(&|m| m.n_used) * c.n_embd, "expert outputs")?,
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
}

pub(crate) fn attention_params(a: &AttentionConfig, max_seq_len: usize) -> AttentionParams {
    AttentionParams { n_heads: a.n_head, n_kv_heads: a.n_head_kv, head_dim: a.head_dim, max_seq_len, scale: a.scale, window: a.window }
}

/// The forward pass of the step's tokens: embeddings, the decoder blocks, then the LM head over
/// the rows that produce logits.
pub(crate) fn forward<B: Backend>(p: &Pass<B>, caches: &mut [B::KvCache], a: &mut Workspace<B>) -> Result<()> {
    match p.w.config.arch.block_style() {
        BlockStyle::PreNorm => pre_norm(p, caches, a),
        BlockStyle::Gemma => gemma(p, caches, a),
    }
}

/// llama, qwen2, qwen3, qwen3moe, Mixtral.
fn pre_norm<B: Backend>(p: &Pass<B>, caches: &mut [B::KvCache], a: &mut Workspace<B>) -> Result<()> {
    let (b, c, n) = (p.b, &p.w.config, p.n);
    b.embed(&p.w.token_embd, p.step, &mut a.x, n)?;
    for ((lc, l), cache) in c.layers.iter().zip(&p.w.layers).zip(caches.iter_mut()) {
        attention(p, lc, l, cache, a)?;
        b.matmul_add(&l.wo, &a.att, &mut a.x, &mut a.tmp, n, c.n_embd)?;
        ffn(p, lc, l, a, Out::AddToResidual)?;
    }
    lm_head(p, a)
}

/// gemma3: scaled embeddings, every block's output normed before its residual add.
fn gemma<B: Backend>(p: &Pass<B>, caches: &mut [B::KvCache], a: &mut Workspace<B>) -> Result<()> {
    let (b, c, n) = (p.b, &p.w.config, p.n);
    b.embed(&p.w.token_embd, p.step, &mut a.x, n)?;
    if let Some(s) = c.embd_scale {
        b.scale(&mut a.x, s, n * c.n_embd)?;
    }
    for ((lc, l), cache) in c.layers.iter().zip(&p.w.layers).zip(caches.iter_mut()) {
        attention(p, lc, l, cache, a)?;
        b.matmul(&l.wo, &a.att, &mut a.tmp, n)?;
        norm_add(p, l.post_attn_norm.as_ref(), a)?;
        ffn(p, lc, l, a, Out::Scratch)?;
        norm_add(p, l.post_ffn_norm.as_ref(), a)?;
    }
    lm_head(p, a)
}

/// `x += rms_norm(tmp)`.
fn norm_add<B: Backend>(p: &Pass<B>, norm: Option<&B::Buffer>, a: &mut Workspace<B>) -> Result<()> {
    let (c, len) = (&p.w.config, p.n * p.w.config.n_embd);
    let norm = norm.ok_or_else(|| kiln_core::BackendError::BadPlan("a Gemma block without its post-norm".into()))?;
    p.b.rms_norm(&a.tmp, norm, &mut a.h, p.n, c.n_embd, c.rms_eps)?;
    p.b.add(&mut a.x, &a.h, len)
}

/// Self-attention of `norm(x)` into `a.att` (before the output projection): q/k/v, biases,
/// q/k norms, rope with the layer's table, the step's K/V stored, then paged attention over
/// the layer's window.
fn attention<B: Backend>(p: &Pass<B>, lc: &LayerConfig, l: &LayerWeights<B>, cache: &mut B::KvCache, a: &mut Workspace<B>) -> Result<()> {
    let (b, c, n, at) = (p.b, &p.w.config, p.n, &lc.attn);
    let (q_width, kv_width) = (at.n_head * at.head_dim, at.n_head_kv * at.head_dim);
    b.norm_matmul_qkv(&a.x, &l.attn_norm, c.rms_eps, &mut a.h, &l.wq, &l.wk, &l.wv, &mut a.q, &mut a.k, &mut a.v, n, c.n_embd)?;
    if let Some([bq, bk, bv]) = &l.bias {
        b.add_bias(&mut a.q, bq, n, q_width)?;
        b.add_bias(&mut a.k, bk, n, kv_width)?;
        b.add_bias(&mut a.v, bv, n, kv_width)?;
    }
    let qk_norm = l.qk_norm.as_ref().map(|[qn, kn]| (qn, kn, c.rms_eps));
    let rope = &c.ropes[at.rope];
    let q_rope = RopeParams { kind: c.rope_kind, n_heads: at.n_head, head_dim: at.head_dim, n_rot: rope.n_rot };
    let table = &p.w.rope_tables[at.rope];
    b.attention_prologue(&mut a.q, &mut a.k, &a.v, qk_norm, (&mut a.q_normed, &mut a.k_normed), table, cache, p.step, n, &q_rope, at.n_head_kv)?;
    b.attention(&a.q, cache, &mut a.att, p.step, n, &attention_params(at, p.max_seq_len))
}

/// Where an FFN block leaves its output.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Out {
    /// `x += ffn(norm(x))`.
    AddToResidual,
    /// `tmp = ffn(norm(x))`.
    Scratch,
}

/// The layer's feed-forward of `norm(x)`: dense gated FFN or mixture of experts.
fn ffn<B: Backend>(p: &Pass<B>, lc: &LayerConfig, l: &LayerWeights<B>, a: &mut Workspace<B>, out: Out) -> Result<()> {
    let (b, c, n) = (p.b, &p.w.config, p.n);
    match (&l.ffn, &lc.ffn) {
        (FfnWeights::Dense { gate, up, down }, FfnConfig::Dense { n_ff }) => {
            match c.activation {
                Activation::Silu => {
                    b.norm_ffn_gate_up(&a.x, &l.ffn_norm, c.rms_eps, &mut a.h, gate, up, &mut a.gate, &mut a.up, &mut a.act, n, c.n_embd, *n_ff)?
                }
                Activation::GeluTanh => {
                    b.rms_norm(&a.x, &l.ffn_norm, &mut a.h, n, c.n_embd, c.rms_eps)?;
                    b.matmul(gate, &a.h, &mut a.gate, n)?;
                    b.matmul(up, &a.h, &mut a.up, n)?;
                    b.geglu(&a.gate, &a.up, &mut a.act, n * n_ff)?;
                }
            }
            match out {
                Out::AddToResidual => b.matmul_add(down, &a.act, &mut a.x, &mut a.tmp, n, c.n_embd),
                Out::Scratch => b.matmul(down, &a.act, &mut a.tmp, n),
            }
        }
        (FfnWeights::Moe(m), FfnConfig::Moe(mc)) => {
            b.rms_norm(&a.x, &l.ffn_norm, &mut a.h, n, c.n_embd, c.rms_eps)?;
            let router = RouterParams { n_experts: mc.n_expert, n_used: mc.n_used, renormalize: mc.renormalize };
            moe(p, m, &router, mc.n_ff, a)?;
            match out {
                Out::AddToResidual => b.add(&mut a.x, &a.tmp, n * c.n_embd),
                Out::Scratch => Ok(()),
            }
        }
        _ => Err(kiln_core::BackendError::BadPlan("layer weights do not match the layer's FFN kind".into())),
    }
}

/// Mixture of experts of the normed `h` into `tmp`: route, each chosen expert's SwiGLU FFN,
/// and the weighted sum of their outputs.
fn moe<B: Backend>(p: &Pass<B>, m: &MoeWeights<B>, router: &RouterParams, n_ff: usize, a: &mut Workspace<B>) -> Result<()> {
    let (b, c, n, k) = (p.b, &p.w.config, p.n, router.n_used);
    b.matmul(&m.router, &a.h, &mut a.router, n)?;
    b.moe_route(&a.router, &mut a.expert_ids, &mut a.expert_weights, n, router)?;
    b.moe_matmul(&m.gate, &a.h, &a.expert_ids, &mut a.gate, n, k, ExpertInput::PerToken)?;
    b.moe_matmul(&m.up, &a.h, &a.expert_ids, &mut a.up, n, k, ExpertInput::PerToken)?;
    b.swiglu(&a.gate, &a.up, &mut a.act, n * k * n_ff)?;
    b.moe_matmul(&m.down, &a.act, &a.expert_ids, &mut a.expert_out, n, k, ExpertInput::PerSlot)?;
    b.moe_combine(&a.expert_out, &a.expert_weights, &mut a.tmp, n, k, c.n_embd)
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
