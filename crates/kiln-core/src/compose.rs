//! Composite backend ops written once in terms of the plain ones: the trait's defaults, and
//! what a backend falls back to where its fused form does not apply.

use crate::backend::{AttentionArgs, Backend, BackendError, ExpertInput, GatedExperts, GatedNorm, Linear, QkNorm, Qkv, Result, RopeParams, RouterArgs};
use crate::tensor::{Tensor, TensorMut};

/// [`Backend::norm_matmuls`] composed of the plain ops: the norm into `h`, then each product
/// of `h` with its bias.
pub fn compose_norm_matmuls<B: Backend + ?Sized, const N: usize>(
    b: &B,
    x: Tensor<B::Buffer>,
    norm: (Tensor<B::Buffer>, f32),
    mut h: TensorMut<B::Buffer>,
    w: [Linear<'_, B>; N],
    out: [TensorMut<B::Buffer>; N],
) -> Result<()> {
    b.rms_norm(x, norm.0, h.reborrow(), norm.1)?;
    for (w, mut out) in w.into_iter().zip(out) {
        b.matmul(w.weight, h.as_ref(), out.reborrow())?;
        if let Some(bias) = w.bias {
            b.add_bias(out, bias)?;
        }
    }
    Ok(())
}

/// The attention of `args` into `out`: [`Backend::attention`], or [`Backend::attention_sinks`]
/// with sinks; a prologue left to the attention is refused.
pub fn compose_attention<B: Backend + ?Sized>(b: &B, args: AttentionArgs<'_, B>, out: TensorMut<B::Buffer>) -> Result<()> {
    let AttentionArgs { q, cache, sinks, step, params, prologue } = args;
    if prologue.is_some() {
        return Err(BackendError::Unsupported { backend: b.name(), what: "an attention prologue left to the attention".into() });
    }
    match sinks {
        Some(sinks) => b.attention_sinks(q, cache, sinks, out, step, params),
        None => b.attention(q, cache, out, step, params),
    }
}

/// [`Backend::attention_prologue`] composed of the plain ops: the q/k (and v) norms into their
/// scratch (q copied back), rope of q and k with `rope` = (inv_freq, params), the keys and
/// values stored.
pub fn compose_attention_prologue<B: Backend + ?Sized>(
    b: &B,
    qkv: Qkv<B::Buffer>,
    qk_norm: Option<QkNorm<B::Buffer>>,
    (inv_freq, p): (Tensor<B::Buffer>, &RopeParams),
    cache: &mut B::KvCache,
    step: &B::Step,
) -> Result<()> {
    let Qkv { mut q, k, v } = qkv;
    let [n, heads, head_dim] = k.shape().dims3("attention_prologue", "k")?;
    let (mut k, v_normed) = match qk_norm {
        Some(QkNorm { q: q_norm, k: k_norm, eps, scratch: [mut q_normed, mut k_normed], v: v_norm }) => {
            b.rms_norm(q.as_ref(), q_norm, q_normed.reborrow(), eps)?;
            b.copy(q_normed.as_ref(), q.reborrow())?;
            b.rms_norm(k.as_ref(), k_norm, k_normed.reborrow(), eps)?;
            let v_normed = match v_norm {
                Some((weight, mut v_normed)) => {
                    b.rms_norm(v.reshape([n, heads, head_dim])?, weight, v_normed.reborrow(), eps)?;
                    Some(v_normed)
                }
                None => None,
            };
            (k_normed, v_normed)
        }
        None => (k, None),
    };
    b.rope(q, inv_freq, step, p)?;
    b.rope(k.reborrow(), inv_freq, step, p)?;
    let v = match &v_normed {
        Some(v_normed) => v_normed.as_ref().reshape([n, heads * head_dim])?,
        None => v,
    };
    b.kv_store(k.as_ref().reshape([n, heads * head_dim])?, v, cache, step)
}

/// [`Backend::gated_norm_matmul_add`] composed of the plain ops: the norm into `normed`, the
/// gate into `gated`, the product added to the residual.
pub fn compose_gated_norm_matmul_add<B: Backend + ?Sized>(
    b: &B,
    g: GatedNorm<B::Buffer>,
    [mut normed, mut gated]: [TensorMut<B::Buffer>; 2],
    w: &B::Weight,
    residual: TensorMut<B::Buffer>,
    tmp: TensorMut<B::Buffer>,
) -> Result<()> {
    b.rms_norm(g.x, g.weight, normed.reborrow(), g.eps)?;
    let [n, heads, head_dim] = normed.shape().dims3("gated_norm_matmul_add", "normed")?;
    b.swiglu(g.z, normed.as_ref().reshape([n, heads * head_dim])?, gated.reborrow())?;
    b.matmul_add(w, gated.as_ref(), residual, tmp)
}

/// [`Backend::moe_gate_up`] composed of the plain ops: both expert products, their biases, the
/// activation.
pub fn compose_moe_gate_up<B: Backend + ?Sized>(
    b: &B,
    experts: GatedExperts<B>,
    x: Tensor<B::Buffer>,
    ids: Tensor<B::Buffer>,
    [mut gate, mut up]: [TensorMut<B::Buffer>; 2],
    out: TensorMut<B::Buffer>,
) -> Result<()> {
    b.moe_matmul(experts.gate, x, ids, gate.reborrow(), ExpertInput::PerToken)?;
    b.moe_matmul(experts.up, x, ids, up.reborrow(), ExpertInput::PerToken)?;
    if let Some([gate_bias, up_bias]) = experts.bias {
        b.moe_add_bias(gate.reborrow(), gate_bias, ids)?;
        b.moe_add_bias(up.reborrow(), up_bias, ids)?;
    }
    b.gated(experts.act, gate.as_ref(), up.as_ref(), out)
}

/// [`Backend::moe_norm_route`] composed of the plain ops: the router's norm (where it has its
/// own), its product and bias, the experts' norm (`experts_norm(x, norm, h)`: the plain RMSNorm,
/// or a backend's that also prepares the experts' input), then the routing.
#[allow(clippy::too_many_arguments)]
pub fn compose_moe_norm_route<B: Backend + ?Sized>(
    b: &B,
    x: Tensor<B::Buffer>,
    norm: (Tensor<B::Buffer>, f32),
    router: RouterArgs<B>,
    mut h: TensorMut<B::Buffer>,
    mut logits: TensorMut<B::Buffer>,
    [ids, weights]: [TensorMut<B::Buffer>; 2],
    experts_norm: impl FnOnce(Tensor<B::Buffer>, (Tensor<B::Buffer>, f32), TensorMut<B::Buffer>) -> Result<()>,
) -> Result<()> {
    if let Some(router_norm) = router.norm {
        b.normed_router_logits(x, (router_norm, norm.1), h.reborrow(), router.weight, logits.reborrow())?;
        experts_norm(x, norm, h.reborrow())?;
        if let Some((gate, out)) = router.shared_gate {
            b.matmul(gate, h.as_ref(), out)?;
        }
    } else {
        experts_norm(x, norm, h.reborrow())?;
        b.router_logits(h.as_ref(), router.weight, logits.reborrow(), router.shared_gate)?;
    }
    if let Some(bias) = router.bias {
        b.add_bias(logits.reborrow(), bias)?;
    }
    b.moe_route(logits.as_ref(), router.expert_scale, ids, weights, &router.params)
}
