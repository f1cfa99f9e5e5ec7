//! Composite backend ops written once in terms of the plain ones: the trait's defaults, and
//! what a backend falls back to where its fused form does not apply.

use crate::backend::{Backend, ExpertInput, GatedExperts, GatedNorm, Result, RouterArgs};
use crate::tensor::{Tensor, TensorMut};

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
        b.rms_norm(x, router_norm, h.reborrow(), norm.1)?;
        b.router_logits(h.as_ref(), router.weight, logits.reborrow(), None)?;
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
