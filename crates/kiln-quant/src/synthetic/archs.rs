//! The mixture-of-experts and hybrid shapes of `random-model`: tensors and metadata as
//! convert_hf_to_gguf.py writes them for Qwen3-MoE, Gemma 4 MoE, Qwen3.5-MoE and gpt-oss.

use kiln_gguf::{Value, ValueType};

use super::{Init, ModelShape, ShapeKind, TokenizerStyle};

/// Mixture-of-experts sizes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Moe {
    pub n_expert: u64,
    pub n_used: u64,
    /// Width of one expert's FFN.
    pub n_ff_exp: u64,
    /// Width of the shared expert (0: none).
    pub n_ff_shexp: u64,
}

/// Gemma 4: sliding layers beside full ones with their own head size and KV heads (K = V).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemma4 {
    pub moe: Moe,
    /// One full-attention layer after every `period - 1` sliding ones.
    pub period: u64,
    pub window: u64,
    pub head_dim_full: u64,
    pub n_head_kv_full: u64,
    pub rope_base_swa: f32,
    /// Rotated dims of a full layer ("proportional" rope on this many of `head_dim_full`).
    pub n_rot_full: u64,
    pub softcap: f32,
}

/// Qwen3.5 hybrid: Gated DeltaNet layers, one gated-attention layer every `interval`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Qwen35 {
    pub moe: Moe,
    pub interval: u64,
    pub k_heads: u64,
    pub v_heads: u64,
    /// Key and value head size of the DeltaNet layers (llama.cpp takes both from `ssm.state_size`).
    pub d_state: u64,
    pub conv_kernel: u64,
    pub n_rot: u64,
    pub sections: [u32; 4],
}

/// gpt-oss: alternating sliding / full attention with sinks, biased experts, YaRN.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GptOss {
    pub moe: Moe,
    pub window: u64,
    pub yarn_factor: f32,
    pub yarn_orig_ctx: u64,
}

/// Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json).
pub const QWEN3_30B_A3B: ModelShape = ModelShape {
    name: "qwen3-30b-a3b",
    arch: "qwen3moe",
    n_embd: 2048,
    n_layer: 48,
    n_head: 32,
    n_head_kv: 4,
    head_dim: 128,
    n_ff: 6144,
    n_vocab: 151936,
    n_special: 293,
    n_ctx: 40960,
    rope_base: 1000000.0,
    rms_eps: 1e-6,
    tied_embeddings: false,
    qk_norm: true,
    qkv_bias: false,
    tokenizer: TokenizerStyle::Qwen2,
    kind: ShapeKind::Moe(Moe { n_expert: 128, n_used: 8, n_ff_exp: 768, n_ff_shexp: 0 }),
};

/// Gemma-4-26B-A4B (google/gemma-4-26B-A4B text config): 30 layers, 5 sliding per full one.
pub const GEMMA4_26B_A4B: ModelShape = ModelShape {
    name: "gemma4-26b-a4b",
    arch: "gemma4",
    n_embd: 2816,
    n_layer: 30,
    n_head: 16,
    n_head_kv: 8,
    head_dim: 256,
    n_ff: 2112,
    n_vocab: 262144,
    n_special: 256,
    n_ctx: 262144,
    rope_base: 1000000.0,
    rms_eps: 1e-6,
    tied_embeddings: true,
    qk_norm: true,
    qkv_bias: false,
    tokenizer: TokenizerStyle::Llama3,
    kind: ShapeKind::Gemma4(Gemma4 {
        moe: Moe { n_expert: 128, n_used: 8, n_ff_exp: 704, n_ff_shexp: 0 },
        period: 6,
        window: 1024,
        head_dim_full: 512,
        n_head_kv_full: 2,
        rope_base_swa: 10000.0,
        n_rot_full: 128,
        softcap: 30.0,
    }),
};

/// Qwen3.5-35B-A3B (Qwen/Qwen3.5-35B-A3B text config).
pub const QWEN35_35B_A3B: ModelShape = ModelShape {
    name: "qwen3.5-35b-a3b",
    arch: "qwen35moe",
    n_embd: 2048,
    n_layer: 40,
    n_head: 16,
    n_head_kv: 2,
    head_dim: 256,
    n_ff: 0,
    n_vocab: 248320,
    n_special: 293,
    n_ctx: 262144,
    rope_base: 10000000.0,
    rms_eps: 1e-6,
    tied_embeddings: false,
    qk_norm: true,
    qkv_bias: false,
    tokenizer: TokenizerStyle::Qwen2,
    kind: ShapeKind::Qwen35(Qwen35 {
        moe: Moe { n_expert: 256, n_used: 8, n_ff_exp: 512, n_ff_shexp: 512 },
        interval: 4,
        k_heads: 16,
        v_heads: 32,
        d_state: 128,
        conv_kernel: 4,
        n_rot: 64,
        sections: [11, 11, 10, 0],
    }),
};

/// gpt-oss-20b (openai/gpt-oss-20b config.json); its release ships MXFP4 experts.
pub const GPT_OSS_20B: ModelShape = ModelShape {
    name: "gpt-oss-20b",
    arch: "gpt-oss",
    n_embd: 2880,
    n_layer: 24,
    n_head: 64,
    n_head_kv: 8,
    head_dim: 64,
    n_ff: 2880,
    n_vocab: 201088,
    n_special: 256,
    n_ctx: 131072,
    rope_base: 150000.0,
    rms_eps: 1e-5,
    tied_embeddings: false,
    qk_norm: false,
    qkv_bias: false,
    tokenizer: TokenizerStyle::Llama3,
    kind: ShapeKind::GptOss(GptOss {
        moe: Moe { n_expert: 32, n_used: 4, n_ff_exp: 2880, n_ff_shexp: 0 },
        window: 128,
        yarn_factor: 32.0,
        yarn_orig_ctx: 4096,
    }),
};

fn is_full_gemma(g: &Gemma4, l: u64) -> bool {
    (l + 1).is_multiple_of(g.period)
}

fn is_full_qwen35(q: &Qwen35, l: u64) -> bool {
    (l + 1).is_multiple_of(q.interval)
}

/// The expert tensors of one layer (`gate_up`: gate and up fused, as Gemma 4 stores them).
fn experts(add: &mut dyn FnMut(String, Vec<u64>, Init), l: u64, n_embd: u64, m: &Moe, gate_up: bool) {
    let n = |s: &str| format!("blk.{l}.{s}");
    add(n("ffn_gate_inp.weight"), vec![n_embd, m.n_expert], Init::FloatMatrix);
    add(n("ffn_down_exps.weight"), vec![m.n_ff_exp, n_embd, m.n_expert], Init::Matrix);
    if gate_up {
        add(n("ffn_gate_up_exps.weight"), vec![n_embd, 2 * m.n_ff_exp, m.n_expert], Init::Matrix);
    } else {
        add(n("ffn_gate_exps.weight"), vec![n_embd, m.n_ff_exp, m.n_expert], Init::Matrix);
        add(n("ffn_up_exps.weight"), vec![n_embd, m.n_ff_exp, m.n_expert], Init::Matrix);
    }
    if m.n_ff_shexp > 0 {
        add(n("ffn_gate_inp_shexp.weight"), vec![n_embd], Init::Bias);
        add(n("ffn_down_shexp.weight"), vec![m.n_ff_shexp, n_embd], Init::Matrix);
        add(n("ffn_gate_shexp.weight"), vec![n_embd, m.n_ff_shexp], Init::Matrix);
        add(n("ffn_up_shexp.weight"), vec![n_embd, m.n_ff_shexp], Init::Matrix);
    }
}

/// Per-layer tensors of the shapes in this module (token embedding, output norm and output are
/// added by the caller). Returns false for the dense kinds, which the caller lays out.
pub(super) fn layer_tensors(s: &ModelShape, l: u64, add: &mut dyn FnMut(String, Vec<u64>, Init)) -> bool {
    let n = |suffix: &str| format!("blk.{l}.{suffix}");
    let e = s.n_embd;
    let attention = |add: &mut dyn FnMut(String, Vec<u64>, Init), head_dim: u64, n_kv: u64, q_rows: u64, with_v: bool| {
        add(n("attn_norm.weight"), vec![e], Init::Norm);
        add(n("attn_q.weight"), vec![e, q_rows], Init::Matrix);
        add(n("attn_k.weight"), vec![e, n_kv * head_dim], Init::Matrix);
        if with_v {
            add(n("attn_v.weight"), vec![e, n_kv * head_dim], Init::Matrix);
        }
        add(n("attn_output.weight"), vec![s.n_head * head_dim, e], Init::Matrix);
        if s.qk_norm {
            add(n("attn_q_norm.weight"), vec![head_dim], Init::Norm);
            add(n("attn_k_norm.weight"), vec![head_dim], Init::Norm);
        }
    };
    match &s.kind {
        ShapeKind::Dense => return false,
        ShapeKind::Moe(m) => {
            attention(add, s.head_dim, s.n_head_kv, s.n_head * s.head_dim, true);
            add(n("ffn_norm.weight"), vec![e], Init::Norm);
            experts(add, l, e, m, false);
        }
        ShapeKind::Gemma4(g) => {
            let full = is_full_gemma(g, l);
            let (hd, kv) = if full { (g.head_dim_full, g.n_head_kv_full) } else { (s.head_dim, s.n_head_kv) };
            // K = V on the full layers: no attn_v.
            attention(add, hd, kv, s.n_head * hd, !full);
            for norm in ["post_attention_norm", "ffn_norm", "post_ffw_norm", "post_ffw_norm_1", "pre_ffw_norm_2", "post_ffw_norm_2"] {
                add(n(&format!("{norm}.weight")), vec![e], Init::Norm);
            }
            add(n("ffn_gate.weight"), vec![e, s.n_ff], Init::Matrix);
            add(n("ffn_up.weight"), vec![e, s.n_ff], Init::Matrix);
            add(n("ffn_down.weight"), vec![s.n_ff, e], Init::Matrix);
            experts(add, l, e, &g.moe, true);
            add(n("ffn_gate_inp.scale"), vec![e], Init::Norm);
            add(n("ffn_down_exps.scale"), vec![g.moe.n_expert], Init::Norm);
            add(n("layer_output_scale.weight"), vec![1], Init::Norm);
        }
        ShapeKind::Qwen35(q) => {
            if is_full_qwen35(q, l) {
                // The query projection also emits the sigmoid output gate.
                attention(add, s.head_dim, s.n_head_kv, 2 * s.n_head * s.head_dim, true);
            } else {
                let (key, value) = (q.k_heads * q.d_state, q.v_heads * q.d_state);
                let conv = 2 * key + value;
                add(n("attn_norm.weight"), vec![e], Init::Norm);
                add(n("attn_qkv.weight"), vec![e, conv], Init::Matrix);
                add(n("attn_gate.weight"), vec![e, value], Init::Matrix);
                add(n("ssm_conv1d.weight"), vec![q.conv_kernel, conv], Init::FloatMatrix);
                add(n("ssm_alpha.weight"), vec![e, q.v_heads], Init::Matrix);
                add(n("ssm_beta.weight"), vec![e, q.v_heads], Init::Matrix);
                add(n("ssm_a"), vec![q.v_heads], Init::Negative);
                add(n("ssm_dt.bias"), vec![q.v_heads], Init::Bias);
                add(n("ssm_norm.weight"), vec![q.d_state], Init::Norm);
                add(n("ssm_out.weight"), vec![value, e], Init::Matrix);
            }
            add(n("post_attention_norm.weight"), vec![e], Init::Norm);
            experts(add, l, e, &q.moe, false);
        }
        ShapeKind::GptOss(g) => {
            let m = &g.moe;
            let (q, kv) = (s.n_head * s.head_dim, s.n_head_kv * s.head_dim);
            attention(add, s.head_dim, s.n_head_kv, q, true);
            for (name, len) in [("attn_q.bias", q), ("attn_k.bias", kv), ("attn_v.bias", kv), ("attn_output.bias", e)] {
                add(n(name), vec![len], Init::Bias);
            }
            add(n("attn_sinks.weight"), vec![s.n_head], Init::Norm);
            add(n("post_attention_norm.weight"), vec![e], Init::Norm);
            experts(add, l, e, m, false);
            add(n("ffn_gate_inp.bias"), vec![m.n_expert], Init::Bias);
            add(n("ffn_gate_exps.bias"), vec![m.n_ff_exp, m.n_expert], Init::Bias);
            add(n("ffn_up_exps.bias"), vec![m.n_ff_exp, m.n_expert], Init::Bias);
            add(n("ffn_down_exps.bias"), vec![e, m.n_expert], Init::Bias);
        }
    }
    true
}

/// Tensors before the layers, other than the token embedding.
pub(super) fn global_tensors(s: &ModelShape, add: &mut dyn FnMut(String, Vec<u64>, Init)) {
    if let ShapeKind::Gemma4(g) = &s.kind {
        add("rope_freqs.weight".into(), vec![g.head_dim_full / 2], Init::RopeFreqs { rotated_pairs: g.n_rot_full / 2 });
    }
}

fn u32v(v: u64) -> Value {
    Value::U32(v as u32)
}

fn u32_array(items: impl IntoIterator<Item = u64>) -> Value {
    Value::Array(ValueType::U32, items.into_iter().map(u32v).collect())
}

/// Architecture keys beyond the common ones; `common` is edited where a key changes meaning.
pub(super) fn metadata(s: &ModelShape, common: &mut Vec<(String, Value)>) {
    let a = s.arch;
    let key = |k: &str| format!("{a}.{k}");
    let mut set = |k: &str, v: Value| match common.iter_mut().find(|(name, _)| *name == key(k)) {
        Some(slot) => slot.1 = v,
        None => common.push((key(k), v)),
    };
    let moe = |set: &mut dyn FnMut(&str, Value), m: &Moe| {
        set("expert_count", u32v(m.n_expert));
        set("expert_used_count", u32v(m.n_used));
        set("expert_feed_forward_length", u32v(m.n_ff_exp));
        if m.n_ff_shexp > 0 {
            set("expert_shared_feed_forward_length", u32v(m.n_ff_shexp));
        }
    };
    match &s.kind {
        ShapeKind::Dense => {}
        ShapeKind::Moe(m) => moe(&mut set, m),
        ShapeKind::Gemma4(g) => {
            moe(&mut set, &g.moe);
            let layers = 0..s.n_layer;
            set("attention.head_count_kv", u32_array(layers.clone().map(|l| if is_full_gemma(g, l) { g.n_head_kv_full } else { s.n_head_kv })));
            set("attention.sliding_window_pattern", Value::Array(ValueType::Bool, layers.map(|l| Value::Bool(!is_full_gemma(g, l))).collect()));
            set("attention.sliding_window", u32v(g.window));
            set("attention.key_length", u32v(g.head_dim_full));
            set("attention.value_length", u32v(g.head_dim_full));
            set("attention.key_length_swa", u32v(s.head_dim));
            set("attention.value_length_swa", u32v(s.head_dim));
            set("attention.shared_kv_layers", u32v(0));
            set("embedding_length_per_layer_input", u32v(0));
            set("rope.freq_base_swa", Value::F32(g.rope_base_swa));
            set("rope.dimension_count", u32v(g.head_dim_full));
            set("rope.dimension_count_swa", u32v(s.head_dim));
            set("final_logit_softcapping", Value::F32(g.softcap));
        }
        ShapeKind::Qwen35(q) => {
            moe(&mut set, &q.moe);
            set("ssm.conv_kernel", u32v(q.conv_kernel));
            set("ssm.state_size", u32v(q.d_state));
            set("ssm.group_count", u32v(q.k_heads));
            set("ssm.time_step_rank", u32v(q.v_heads));
            set("ssm.inner_size", u32v(q.v_heads * q.d_state));
            set("full_attention_interval", u32v(q.interval));
            set("rope.dimension_count", u32v(q.n_rot));
            set("rope.dimension_sections", Value::Array(ValueType::I32, q.sections.iter().map(|&v| Value::I32(v as i32)).collect()));
        }
        ShapeKind::GptOss(g) => {
            moe(&mut set, &g.moe);
            set("attention.sliding_window", u32v(g.window));
            set("rope.scaling.type", Value::String("yarn".into()));
            set("rope.scaling.factor", Value::F32(g.yarn_factor));
            set("rope.scaling.original_context_length", u32v(g.yarn_orig_ctx));
        }
    }
    // Without a dense FFN there is no feed_forward_length (qwen35moe); gpt-oss writes the expert width.
    if s.n_ff == 0 {
        common.retain(|(k, _)| *k != key("feed_forward_length"));
    }
}
