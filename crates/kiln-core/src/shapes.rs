//! The shape rules of every op, shared by the backends: each checks an op's views against one
//! another (through [`expect_shape`]) and returns the counts the op's kernels need.

use crate::backend::{AttentionParams, BackendError, DeltaNetParams, ExpertInput, Result};
use crate::tensor::{expect_shape, Shape};

/// Operands of one shape, as elementwise ops take them; returns the element count.
pub fn elementwise(op: &str, inputs: &[(&str, Shape)], out: Shape) -> Result<usize> {
    for &(name, shape) in inputs {
        expect_shape(op, name, shape, out)?;
    }
    Ok(out.numel())
}

/// `out` `[n, dim]` for rows of an embedding table of `dim` columns; returns `n`.
pub fn embed(out: Shape, dim: usize) -> Result<usize> {
    let [n, _] = out.dims2("embed", "out")?;
    expect_shape("embed", "out", out, [n, dim])?;
    Ok(n)
}

/// `x` (any rank) and `out` of one shape, `weight` `[cols]`; returns (rows, cols).
pub fn rms_norm(x: Shape, weight: Shape, out: Shape) -> Result<(usize, usize)> {
    expect_shape("rms_norm", "out", out, x)?;
    expect_shape("rms_norm", "weight", weight, [x.cols()])?;
    Ok((x.rows(), x.cols()))
}

/// A `rows` x `cols` weight times `x` (`[n, cols]`) into `out` (`[n, rows]`); returns `n`.
pub fn matmul(op: &str, (rows, cols): (usize, usize), x: Shape, out: Shape) -> Result<usize> {
    let [n, _] = x.dims2(op, "input")?;
    expect_shape(op, "input", x, [n, cols])?;
    expect_shape(op, "output", out, [n, rows])?;
    Ok(n)
}

/// `x` (`[n, dim]`) and a `[dim]` vector; returns (n, dim).
pub fn rows_and_vector(op: &str, x: Shape, v: Shape) -> Result<(usize, usize)> {
    let [n, dim] = x.dims2(op, "x")?;
    expect_shape(op, "vector", v, [dim])?;
    Ok((n, dim))
}

/// `x` (`[n, n_heads, head_dim]`) and `inv_freq` (`[n_rot / 2]`); returns the dims and `n_rot`.
pub fn rope(x: Shape, inv_freq: Shape) -> Result<([usize; 3], usize)> {
    let dims = x.dims3("rope", "x")?;
    let n_rot = 2 * inv_freq.numel();
    expect_shape("rope", "inv_freq", inv_freq, [n_rot / 2])?;
    if n_rot > dims[2] {
        return Err(BackendError::Device(format!("rope: n_rot {n_rot} does not fit head_dim {}", dims[2])));
    }
    Ok((dims, n_rot))
}

/// K and V of `[n, width]` each for a cache of rows of `width`; returns `n`.
pub fn kv_store(k: Shape, v: Shape, width: usize) -> Result<usize> {
    let [n, _] = k.dims2("kv_store", "k")?;
    expect_shape("kv_store", "k", k, [n, width])?;
    expect_shape("kv_store", "v", v, k)?;
    Ok(n)
}

/// Queries and output `[n, n_heads * head_dim]`, sinks `[n_heads]`; returns `n`.
pub fn attention(q: Shape, out: Shape, sinks: Option<Shape>, p: &AttentionParams) -> Result<usize> {
    let [n, _] = q.dims2("attention", "q")?;
    expect_shape("attention", "q", q, [n, p.n_heads * p.head_dim])?;
    expect_shape("attention", "out", out, q)?;
    if let Some(s) = sinks {
        expect_shape("attention", "sinks", s, [p.n_heads])?;
    }
    Ok(n)
}

/// Logits `[n, n_experts]`, scales `[n_experts]`, ids and weights `[n, n_used]`, with a shared
/// expert (`shared`, [`crate::RouterParams::shared_expert`]) one more logit and one more slot
/// than those; returns (n, n_experts, n_used), the routed experts' counts.
pub fn moe_route(logits: Shape, scale: Option<Shape>, ids: Shape, weights: Shape, shared: bool) -> Result<(usize, usize, usize)> {
    let [n, columns] = logits.dims2("moe_route", "logits")?;
    let [_, slots] = ids.dims2("moe_route", "ids")?;
    expect_shape("moe_route", "ids", ids, [n, slots])?;
    expect_shape("moe_route", "weights", weights, [n, slots])?;
    let (e, k) = match shared {
        true if columns == 0 || slots == 0 => return Err(BackendError::Device("router: a shared expert without its logit or slot".into())),
        true => (columns - 1, slots - 1),
        false => (columns, slots),
    };
    if let Some(s) = scale {
        expect_shape("moe_route", "expert_scale", s, [e])?;
    }
    if k == 0 || k > e {
        return Err(BackendError::Device(format!("router: {k} experts chosen of {e}")));
    }
    Ok((n, e, k))
}

/// Experts of `rows` x `cols`, ids `[n, n_used]`, `x` `[n, cols]` or `[n, n_used, cols]` as
/// `input` says, `out` `[n, n_used, rows]`; returns (n, n_used).
pub fn moe_matmul((rows, cols): (usize, usize), x: Shape, ids: Shape, out: Shape, input: ExpertInput) -> Result<(usize, usize)> {
    let [n, k] = ids.dims2("moe_matmul", "ids")?;
    let x_want: Shape = match input {
        ExpertInput::PerToken => [n, cols].into(),
        ExpertInput::PerSlot => [n, k, cols].into(),
    };
    expect_shape("moe_matmul", "input", x, x_want)?;
    expect_shape("moe_matmul", "output", out, [n, k, rows])?;
    Ok((n, k))
}

/// `x` `[n, n_used, dim]`, bias `[n_experts, dim]`, ids `[n, n_used]`; returns
/// (n, n_used, dim, n_experts).
pub fn moe_add_bias(x: Shape, bias: Shape, ids: Shape) -> Result<(usize, usize, usize, usize)> {
    let [n, k, dim] = x.dims3("moe_add_bias", "x")?;
    let [n_experts, _] = bias.dims2("moe_add_bias", "bias")?;
    expect_shape("moe_add_bias", "bias", bias, [n_experts, dim])?;
    expect_shape("moe_add_bias", "ids", ids, [n, k])?;
    Ok((n, k, dim, n_experts))
}

/// `y` `[n, n_used, dim]`, weights `[n, n_used]`, out `[n, dim]`; returns (n, n_used, dim).
pub fn moe_combine(y: Shape, weights: Shape, out: Shape) -> Result<(usize, usize, usize)> {
    let [n, k, dim] = y.dims3("moe_combine", "y")?;
    expect_shape("moe_combine", "weights", weights, [n, k])?;
    expect_shape("moe_combine", "out", out, [n, dim])?;
    Ok((n, k, dim))
}

/// `src` `[n, src_width]`, `dst` `[n, width]` with `col + width <= src_width`; returns
/// (n, src_width, width).
pub fn copy_cols(src: Shape, col: usize, dst: Shape) -> Result<(usize, usize, usize)> {
    let [n, src_width] = src.dims2("copy_cols", "src")?;
    let [_, width] = dst.dims2("copy_cols", "dst")?;
    expect_shape("copy_cols", "dst", dst, [n, width])?;
    if col + width > src_width {
        return Err(BackendError::Device(format!("copy_cols: columns {col}..{} of rows of {src_width}", col + width)));
    }
    Ok((n, src_width, width))
}

/// `x` `[n, dim]`, `gate` `[n, gate_dim]` with `gate_dim` dividing `dim`; returns (n, dim, gate_dim).
pub fn sigmoid_gate(x: Shape, gate: Shape) -> Result<(usize, usize, usize)> {
    let [n, dim] = x.dims2("sigmoid_gate", "x")?;
    let [_, gate_dim] = gate.dims2("sigmoid_gate", "gate")?;
    expect_shape("sigmoid_gate", "gate", gate, [n, gate_dim])?;
    if gate_dim == 0 || !dim.is_multiple_of(gate_dim) {
        return Err(BackendError::Device(format!("sigmoid_gate: {gate_dim} gates over rows of {dim}")));
    }
    Ok((n, dim, gate_dim))
}

/// g and beta `[n, n_heads]`, A and dt bias `[n_heads]`; returns (n, n_heads).
pub fn delta_net_gates(g: Shape, beta: Shape, a_log_neg: Shape, dt_bias: Shape) -> Result<(usize, usize)> {
    let [n, heads] = g.dims2("delta_net_gates", "g")?;
    expect_shape("delta_net_gates", "beta", beta, g)?;
    expect_shape("delta_net_gates", "a_log_neg", a_log_neg, [heads])?;
    expect_shape("delta_net_gates", "dt_bias", dt_bias, [heads])?;
    Ok((n, heads))
}

/// A state `[n_slots, per_slot]`; returns `n_slots`.
pub fn state(op: &str, state: Shape, per_slot: usize) -> Result<usize> {
    let [n_slots, _] = state.dims2(op, "state")?;
    expect_shape(op, "state", state, [n_slots, per_slot])?;
    Ok(n_slots)
}

/// `x` and `out` `[n, conv_dim]`, weight `[conv_dim, conv_kernel]`, state `[n_slots, conv_state]`;
/// returns `n`.
pub fn ssm_conv(x: Shape, weight: Shape, state_: Shape, out: Shape, p: &DeltaNetParams) -> Result<usize> {
    let [n, _] = x.dims2("ssm_conv", "x")?;
    expect_shape("ssm_conv", "x", x, [n, p.conv_dim()])?;
    expect_shape("ssm_conv", "out", out, x)?;
    expect_shape("ssm_conv", "weight", weight, [p.conv_dim(), p.conv_kernel])?;
    state("ssm_conv", state_, p.conv_state())?;
    Ok(n)
}

/// `x` `[n, conv_dim]`, g and beta `[n, n_v_heads]`, state `[n_slots, ssm_state]`, out
/// `[n, n_v_heads * head_dim]`; returns `n`.
pub fn delta_net(x: Shape, [g, beta]: [Shape; 2], state_: Shape, out: Shape, p: &DeltaNetParams) -> Result<usize> {
    let [n, _] = x.dims2("delta_net", "x")?;
    expect_shape("delta_net", "x", x, [n, p.conv_dim()])?;
    expect_shape("delta_net", "g", g, [n, p.n_v_heads])?;
    expect_shape("delta_net", "beta", beta, g)?;
    expect_shape("delta_net", "out", out, [n, p.n_v_heads * p.head_dim])?;
    state("delta_net", state_, p.ssm_state())?;
    Ok(n)
}

/// `src` `[n_tokens, dim]`, `dst` `[logit_rows, dim]`; returns (n_tokens, dim).
pub fn gather_rows(src: Shape, dst: Shape, logit_rows: usize) -> Result<(usize, usize)> {
    let [n, dim] = src.dims2("gather_rows", "src")?;
    expect_shape("gather_rows", "dst", dst, [logit_rows, dim])?;
    Ok((n, dim))
}
