//! The type each tensor is written in. The rules are llama.cpp's
//! (`llama_tensor_get_type` in src/llama-quant.cpp), so a kiln mix such as
//! Q4_K_M has exactly the per-tensor types llama-quantize would choose.

use kiln_gguf::{TensorInfo, Value};

use super::ftype::FileType;
use super::{QuantizeError, QuantizeOptions, Result};
use crate::GgmlType;

/// The hyper-parameters the type rules look at, read from GGUF metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantHparams {
    pub arch: String,
    pub n_layer: u64,
    pub n_embd: u64,
    pub n_head: u64,
    pub n_head_kv: u64,
    pub n_expert: u64,
    pub n_vocab: u64,
}

fn lookup<'m>(metadata: &'m [(String, Value)], key: &str) -> Option<&'m Value> {
    metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
}

/// An integer value, or the first element of a per-layer integer array.
fn first_u64(value: &Value) -> Option<u64> {
    match value {
        Value::Array(_, items) => items.first().and_then(Value::as_u64),
        v => v.as_u64(),
    }
}

impl QuantHparams {
    pub fn from_metadata(metadata: &[(String, Value)]) -> Result<QuantHparams> {
        let arch_key = "general.architecture";
        let arch = lookup(metadata, arch_key).and_then(Value::as_str).ok_or_else(|| QuantizeError::MissingKey(arch_key.into()))?.to_string();
        let get = |suffix: &str| {
            let key = format!("{arch}.{suffix}");
            match lookup(metadata, &key) {
                None => Ok(None),
                Some(v) => first_u64(v).map(Some).ok_or(QuantizeError::BadKey { key, expected: "a non-negative integer" }),
            }
        };
        let block_key = format!("{arch}.block_count");
        let n_layer = get("block_count")?.ok_or(QuantizeError::MissingKey(block_key))?;
        let n_head = get("attention.head_count")?.unwrap_or(0);
        let n_vocab = match get("vocab_size")? {
            Some(n) => n,
            None => lookup(metadata, "tokenizer.ggml.tokens").and_then(Value::as_array).map_or(0, |t| t.len() as u64),
        };
        Ok(QuantHparams {
            n_layer,
            n_embd: get("embedding_length")?.unwrap_or(0),
            n_head,
            n_head_kv: get("attention.head_count_kv")?.unwrap_or(n_head),
            n_expert: get("expert_count")?.unwrap_or(0),
            n_vocab,
            arch,
        })
    }

    /// llama.cpp's `n_gqa()`: query heads per KV head (0 without KV heads).
    fn n_gqa(&self) -> u64 {
        self.n_head.checked_div(self.n_head_kv).unwrap_or(0)
    }

    /// The size label llama.cpp gives the model ("8B", "70B", ...) for the
    /// architectures kiln knows; `None` where llama.cpp says "?B".
    pub fn size_label(&self) -> Option<&'static str> {
        let (n, e) = (self.n_layer, self.n_embd);
        match self.arch.as_str() {
            "llama" if self.n_expert == 8 => match n {
                32 => Some("8x7B"),
                56 => Some("8x22B"),
                _ => None,
            },
            "llama" => match n {
                16 | 22 => Some("1B"),
                26 | 28 => Some("3B"),
                30 => Some("256M"),
                32 if self.n_vocab == 49152 => Some("3B"),
                32 if self.n_vocab < 40000 => Some("7B"),
                32 | 36 => Some("8B"),
                40 => Some("13B"),
                48 => Some("34B"),
                60 => Some("30B"),
                80 if self.n_head == self.n_head_kv => Some("65B"),
                80 => Some("70B"),
                _ => None,
            },
            "qwen2" => match n {
                24 if e == 1024 => Some("0.5B"),
                24 => Some("1B"),
                28 if e == 1536 => Some("1.5B"),
                28 | 32 => Some("7B"),
                36 => Some("3B"),
                40 if self.n_head == 20 => Some("4B"),
                40 => Some("13B"),
                48 => Some("14B"),
                64 => Some("32B"),
                80 => Some("70B"),
                _ => None,
            },
            "qwen3" => match n {
                28 if e == 1024 => Some("0.6B"),
                28 => Some("1.7B"),
                36 if e == 2560 => Some("4B"),
                36 => Some("8B"),
                40 => Some("14B"),
                64 => Some("32B"),
                _ => None,
            },
            _ => None,
        }
    }
}

/// How one tensor is written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorPlan {
    pub name: String,
    /// GGUF `ne` order: `dims[0]` is the row length.
    pub dims: Vec<u64>,
    pub src_type: GgmlType,
    pub dst_type: GgmlType,
    /// The mix's choice did not fit the row length and a fallback type was used.
    pub fallback: bool,
}

impl TensorPlan {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    pub fn row_len(&self) -> usize {
        self.dims[0] as usize
    }
}

/// llama.cpp's broad tensor roles; attn_qkv and attn_kv_b count as attn_v.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Category {
    TokenEmbd,
    AttnValue,
    AttnK,
    AttnQ,
    AttnOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Output,
    Other,
}

fn category(name: &str) -> Category {
    use Category::*;
    if name == "output.weight" {
        return Output;
    }
    if name == "token_embd.weight" || name == "per_layer_token_embd.weight" {
        return TokenEmbd;
    }
    let rules: [(&str, Category); 9] = [
        ("attn_qkv.weight", AttnValue),
        ("attn_kv_b.weight", AttnValue),
        ("attn_v.weight", AttnValue),
        ("attn_k.weight", AttnK),
        ("attn_q.weight", AttnQ),
        ("attn_output.weight", AttnOutput),
        ("ffn_up", FfnUp),
        ("ffn_gate", FfnGate),
        ("ffn_down", FfnDown),
    ];
    rules.iter().find(|(pat, _)| name.contains(pat)).map_or(Other, |&(_, c)| c)
}

/// Substrings of 2-D weights llama.cpp never quantizes (small, or used as
/// lookup tables rather than matrices).
const KEEP_AS_IS: &[&str] = &[
    "_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_tid2eid.weight",
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "shortconv.conv.weight",
    "indexer.k_proj.weight",
    "indexer.q_proj.weight",
    "time_mix_first.weight",
    "time_mix_w0.weight",
    "time_mix_w1.weight",
    "time_mix_w2.weight",
    "time_mix_v0.weight",
    "time_mix_v1.weight",
    "time_mix_v2.weight",
    "time_mix_a0.weight",
    "time_mix_a1.weight",
    "time_mix_a2.weight",
    "time_mix_g1.weight",
    "time_mix_g2.weight",
    "time_mix_decay_w1.weight",
    "time_mix_decay_w2.weight",
    "time_mix_lerp_fused.weight",
    "attn_rel_b.weight",
    ".position_embd",
    "sam.pos_embd",
    "sam.neck.",
    "sam.net_",
    ".rel_pos",
    ".patch_embd",
    ".patch_merger",
    "a.rvq.codebook",
    "mm.a.code_embd",
];

/// ggml's `ggml_n_dims`: trailing dimensions of size 1 do not count.
fn n_dims(dims: &[u64]) -> usize {
    dims.iter().rposition(|&d| d > 1).map_or(1, |i| i + 1)
}

/// Whether llama-quantize would convert this tensor at all (`tensor_allows_quantization`).
fn allows_quantization(name: &str, dims: &[u64]) -> bool {
    n_dims(dims) >= 2
        && name.ends_with("weight")
        && name != "position_embd.weight"
        && name != "token_types.weight"
        && !KEEP_AS_IS.iter().any(|pat| name.contains(pat))
}

/// Whether ggml counts the type as quantized (F16/BF16 are plain floats).
fn is_quantized(ty: GgmlType) -> bool {
    ty.block_size() > 1
}

/// The layer number of a "blk.N." name (sscanf "blk.%d." semantics).
fn layer_of(name: &str) -> Option<i64> {
    let rest = name.strip_prefix("blk.")?;
    let end = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// Tensors in llama.cpp's processing order: non-layer tensors first, then by
/// layer number, ties by name. The layer counters below depend on this order.
fn llama_order(tensors: &[TensorInfo]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| {
        let key = |i: usize| (layer_of(&tensors[i].name).unwrap_or(-1), tensors[i].name.as_str());
        key(a).cmp(&key(b))
    });
    order
}

/// The "use more bits" layer pattern: the first and last eighth of the
/// layers, and every third layer in between.
fn use_more_bits(i_layer: i64, n_layer: i64) -> bool {
    i_layer < n_layer / 8 || i_layer >= 7 * n_layer / 8 || (i_layer - n_layer / 8) % 3 == 2
}

/// Running state of one planning pass (llama.cpp's `quantize_state_impl`).
struct MixRules<'a> {
    hp: &'a QuantHparams,
    ftype: FileType,
    is_70b: bool,
    tied_embeddings: bool,
    n_attn_value: i64,
    i_attn_value: i64,
    n_ffn_down: i64,
    i_ffn_down: i64,
    i_ffn_gate: i64,
    i_ffn_up: i64,
}

impl MixRules<'_> {
    /// `(layer, n_layer)` for an FFN tensor: the running count for dense
    /// models, the layer in the name for MoE models.
    fn layer_info(&self, counter: i64, name: &str) -> Result<(i64, i64)> {
        let n_layer = self.hp.n_layer as i64;
        if self.hp.n_expert <= 1 {
            return Ok((counter, n_layer));
        }
        match layer_of(name) {
            Some(l) if (0..n_layer).contains(&l) => Ok((l, n_layer)),
            _ => Err(QuantizeError::BadLayer { tensor: name.to_string(), n_layer: self.hp.n_layer }),
        }
    }

    /// llama.cpp's branch for the IQ1/IQ2 mixes: it replaces every other rule for the tensors
    /// inside the layers. IQ2_S and IQ2_M give IQ3_S where the others give Q2_K.
    fn choose_low_bit(&mut self, cat: Category, default: GgmlType) -> GgmlType {
        use GgmlType as G;
        let n_expert = self.hp.n_expert;
        let step_up = if matches!(self.ftype, FileType::IQ2_S | FileType::IQ2_M) { G::IQ3_S } else { G::Q2_K };
        match cat {
            Category::AttnValue => {
                self.i_attn_value += 1;
                if self.hp.n_gqa() >= 4 || n_expert >= 4 {
                    G::Q4_K
                } else {
                    step_up
                }
            }
            Category::AttnK if n_expert == 8 => G::Q4_K,
            Category::FfnDown => {
                let first_eighth = self.i_ffn_down < self.n_ffn_down / 8;
                self.i_ffn_down += 1;
                if first_eighth {
                    step_up
                } else {
                    default
                }
            }
            Category::AttnOutput if n_expert == 8 => G::Q5_K,
            Category::AttnOutput if step_up == G::IQ3_S => G::IQ3_S,
            Category::AttnOutput if matches!(self.ftype, FileType::IQ1_S | FileType::IQ1_M) => G::IQ2_XXS,
            _ => default,
        }
    }

    /// The mix's type for one tensor, starting from the file type's default.
    fn choose(&mut self, t: &TensorInfo, cat: Category, default: GgmlType) -> Result<GgmlType> {
        use FileType as F;
        use GgmlType as G;
        let (ftype, arch, n_expert) = (self.ftype, self.hp.arch.as_str(), self.hp.n_expert);
        let falcon = arch == "falcon";
        let low_bit_mix = matches!(ftype, F::IQ2_XXS | F::IQ2_XS | F::IQ2_S | F::IQ2_M | F::IQ1_S | F::IQ1_M);
        if ftype == F::MXFP4_MOE {
            // Expert tensors MXFP4; the output (and tied embeddings) and every other tensor Q8_0,
            // except untied token embeddings, which keep the default as in llama-quant's chain.
            let expert = t.name.contains("_exps");
            let tied = cat == Category::TokenEmbd && self.tied_embeddings;
            return Ok(if expert || (cat == Category::TokenEmbd && !tied) { default } else { G::Q8_0 });
        }
        let mut ty = default;
        match cat {
            Category::Output | Category::TokenEmbd if cat == Category::Output || self.tied_embeddings => {
                if falcon || !t.dims[0].is_multiple_of(ty.block_size() as u64) {
                    ty = G::Q8_0;
                } else if low_bit_mix || ftype == F::IQ3_XXS {
                    ty = G::Q5_K;
                } else if ty != G::Q8_0 {
                    ty = G::Q6_K;
                }
            }
            Category::TokenEmbd => {
                if matches!(ftype, F::TQ1_0 | F::TQ2_0) {
                    ty = G::Q4_K;
                } else if matches!(ftype, F::IQ2_XXS | F::IQ2_XS | F::IQ1_S | F::IQ1_M) {
                    ty = G::Q2_K;
                } else if matches!(ftype, F::IQ2_S | F::IQ2_M | F::IQ3_XXS) {
                    ty = G::IQ3_S;
                }
            }
            _ if low_bit_mix => ty = self.choose_low_bit(cat, default),
            Category::AttnValue => {
                let (i, n, gqa) = (self.i_attn_value, self.n_attn_value, self.hp.n_gqa());
                match ftype {
                    F::Q2_K => ty = if gqa >= 4 { G::Q4_K } else { G::Q3_K },
                    F::Q2_K_S if gqa >= 4 => ty = G::Q4_K,
                    F::Q3_K_M => ty = if i < 2 { G::Q5_K } else { G::Q4_K },
                    F::Q3_K_L => ty = G::Q5_K,
                    F::IQ3_XXS => ty = if gqa >= 4 { G::Q4_K } else { G::IQ3_S },
                    F::IQ3_XS | F::IQ3_S if gqa >= 4 => ty = G::Q4_K,
                    F::IQ3_M => ty = G::Q4_K,
                    F::IQ4_NL | F::IQ4_XS if gqa >= 4 => ty = G::Q5_K,
                    F::Q4_K_M | F::Q5_K_M if use_more_bits(i, n) => ty = G::Q6_K,
                    F::Q4_K_S if i < 4 => ty = G::Q5_K,
                    _ => {}
                }
                if self.is_70b && matches!(ty, G::Q3_K | G::Q4_K) {
                    // 70B shares each attn_v among 8 query heads: a small tensor worth more bits.
                    ty = G::Q5_K;
                }
                if n_expert == 8 {
                    ty = G::Q8_0;
                }
                self.i_attn_value += 1;
            }
            Category::AttnK => {
                if n_expert == 8 {
                    ty = G::Q8_0;
                } else if ftype == F::IQ3_XS {
                    ty = G::IQ3_XXS;
                } else if ftype == F::IQ3_XXS {
                    ty = G::IQ2_S;
                }
            }
            Category::AttnQ => {
                if ftype == F::IQ3_XS {
                    ty = G::IQ3_XXS;
                } else if ftype == F::IQ3_XXS {
                    ty = G::IQ2_S;
                }
            }
            Category::FfnDown => {
                let (i, n) = self.layer_info(self.i_ffn_down, &t.name)?;
                let more = use_more_bits(i, n);
                match ftype {
                    F::Q2_K => ty = G::Q3_K,
                    F::Q2_K_S if i < n / 8 => ty = G::Q4_K,
                    // Without an importance matrix (kiln never has one).
                    F::IQ3_XXS => ty = if i < n / 8 { G::Q4_K } else { G::Q3_K },
                    F::Q3_K_M => {
                        ty = if i < n / 16 {
                            G::Q5_K
                        } else if !falcon || more {
                            G::Q4_K
                        } else {
                            G::Q3_K
                        }
                    }
                    F::IQ3_M if i < n / 8 || (n_expert == 8 && more) => ty = G::Q4_K,
                    F::Q3_K_L => ty = if falcon { G::Q4_K } else { G::Q5_K },
                    F::Q4_K_M if falcon => {
                        ty = if i < n / 16 {
                            G::Q6_K
                        } else if more {
                            G::Q5_K
                        } else {
                            G::Q4_K
                        }
                    }
                    F::Q4_K_M | F::Q5_K_M if more => ty = G::Q6_K,
                    F::IQ4_NL | F::IQ4_XS if i < n / 8 => ty = G::Q5_K,
                    F::Q4_K_S if !falcon && i < n / 8 => ty = G::Q5_K,
                    _ => {}
                }
                self.i_ffn_down += 1;
            }
            Category::AttnOutput => {
                if !falcon && n_expert == 8 {
                    if matches!(
                        ftype,
                        F::Q2_K | F::IQ3_XS | F::IQ3_XXS | F::Q3_K_S | F::Q3_K_M | F::IQ4_NL | F::Q4_K_S | F::Q4_K_M | F::IQ3_S | F::IQ3_M | F::IQ4_XS
                    ) {
                        ty = G::Q5_K;
                    }
                } else if !falcon {
                    match ftype {
                        F::Q2_K => ty = G::Q3_K,
                        F::IQ3_XXS => ty = G::IQ3_S,
                        F::Q3_K_M => ty = G::Q4_K,
                        F::Q3_K_L => ty = G::Q5_K,
                        F::IQ3_M => ty = G::Q4_K,
                        _ => {}
                    }
                } else if ftype == F::Q3_K_L {
                    ty = G::Q4_K;
                }
            }
            // Only the IQ3_XS mix changes these: IQ3_XXS outside the first and last eighth.
            Category::FfnGate | Category::FfnUp => {
                let gate = cat == Category::FfnGate;
                let (i, n) = self.layer_info(if gate { self.i_ffn_gate } else { self.i_ffn_up }, &t.name)?;
                if ftype == F::IQ3_XS && i >= n / 8 && i < 7 * n / 8 {
                    ty = G::IQ3_XXS;
                }
                if gate {
                    self.i_ffn_gate += 1;
                } else {
                    self.i_ffn_up += 1;
                }
            }
            Category::Output | Category::Other => {}
        }
        Ok(ty)
    }
}

/// Replaces a type whose block does not divide the row length
/// (`tensor_type_fallback`). Returns the type and whether it changed.
fn fallback(t: &TensorInfo, ty: GgmlType) -> Result<(GgmlType, bool)> {
    use GgmlType as G;
    let row_len = t.dims[0];
    if row_len.is_multiple_of(ty.block_size() as u64) {
        return Ok((ty, false));
    }
    let replacement = match ty {
        G::IQ1_S | G::IQ1_M | G::IQ2_XXS | G::IQ2_XS | G::IQ2_S | G::IQ3_XXS | G::IQ3_S | G::IQ4_XS => G::IQ4_NL,
        G::Q2_K | G::Q3_K | G::TQ1_0 | G::TQ2_0 => G::Q4_0,
        G::Q4_K => G::Q5_0,
        G::Q5_K => G::Q5_1,
        G::Q6_K => G::Q8_0,
        _ => return Err(QuantizeError::NoFallback { tensor: t.name.clone(), ty, row_len }),
    };
    // A row that is not even a multiple of 32 is kept in F16.
    let ty = if row_len.is_multiple_of(replacement.block_size() as u64) { replacement } else { G::F16 };
    Ok((ty, true))
}

/// llama-quantize's `tensor_requires_imatrix`: these targets need an importance matrix
/// (except for the embeddings and the output), which kiln never reads.
fn needs_imatrix(name: &str, ty: GgmlType, ftype: FileType) -> bool {
    use GgmlType as G;
    if matches!(name, "token_embd.weight" | "per_layer_token_embd.weight" | "output.weight") {
        return false;
    }
    match ty {
        G::IQ3_XXS | G::IQ2_XXS | G::IQ2_XS | G::IQ2_S | G::IQ1_M | G::IQ1_S => true,
        G::Q2_K => ftype == FileType::Q2_K_S,
        _ => false,
    }
}

/// Checks that kiln can produce `plan.dst_type` from `plan.src_type`.
fn check_conversion(plan: &TensorPlan, allow_requantize: bool) -> Result<()> {
    if plan.src_type == plan.dst_type {
        return Ok(());
    }
    let tensor = || plan.name.clone();
    if is_quantized(plan.src_type) && !allow_requantize {
        return Err(QuantizeError::RequantizeDisabled { tensor: tensor(), from: plan.src_type, to: plan.dst_type });
    }
    if !crate::can_dequantize(plan.src_type) {
        return Err(QuantizeError::CannotDequantize { tensor: tensor(), ty: plan.src_type });
    }
    if !crate::can_quantize(plan.dst_type) {
        return Err(QuantizeError::CannotQuantize { tensor: tensor(), ty: plan.dst_type });
    }
    Ok(())
}

/// The output type of every tensor (in the input order), as llama-quantize
/// would choose it for `options`, and checked to be producible.
pub fn plan_tensors(hp: &QuantHparams, tensors: &[TensorInfo], options: &QuantizeOptions) -> Result<Vec<TensorPlan>> {
    let ftype = options.ftype;
    let default = ftype.default_type();
    let mut rules = MixRules {
        hp,
        ftype,
        is_70b: hp.size_label() == Some("70B"),
        tied_embeddings: !tensors.iter().any(|t| category(&t.name) == Category::Output),
        n_attn_value: tensors.iter().filter(|t| category(&t.name) == Category::AttnValue).count() as i64,
        i_attn_value: 0,
        n_ffn_down: tensors.iter().filter(|t| category(&t.name) == Category::FfnDown).count() as i64,
        i_ffn_down: 0,
        i_ffn_gate: 0,
        i_ffn_up: 0,
    };
    let mut plans: Vec<Option<TensorPlan>> = vec![None; tensors.len()];
    let order = llama_order(tensors);
    for &i in &order {
        let t = &tensors[i];
        let (mut dst, mut fell_back) = (t.ty, false);
        if allows_quantization(&t.name, &t.dims) {
            dst = default;
            if is_quantized(default) {
                if !options.pure {
                    dst = rules.choose(t, category(&t.name), default)?;
                }
                (dst, fell_back) = fallback(t, dst)?;
            }
            if needs_imatrix(&t.name, dst, ftype) && !options.allow_without_imatrix {
                // llama-quantize refuses in this pass, before converting anything.
                return Err(QuantizeError::NeedsImatrix { tensor: t.name.clone(), ty: dst });
            }
        }
        plans[i] = Some(TensorPlan { name: t.name.clone(), dims: t.dims.clone(), src_type: t.ty, dst_type: dst, fallback: fell_back });
    }
    let plans: Vec<TensorPlan> = plans.into_iter().map(|p| p.expect("every tensor was planned")).collect();
    for &i in &order {
        check_conversion(&plans[i], options.allow_requantize)?;
    }
    Ok(plans)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn use_more_bits_matches_the_known_32_layer_pattern() {
        let picked: Vec<i64> = (0..32).filter(|&i| use_more_bits(i, 32)).collect();
        assert_eq!(picked, [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]);
        let picked: Vec<i64> = (0..5).filter(|&i| use_more_bits(i, 5)).collect();
        assert_eq!(picked, [2, 4]);
    }

    #[test]
    fn categories_and_quantizable_tensors() {
        assert_eq!(category("blk.3.attn_v.weight"), Category::AttnValue);
        assert_eq!(category("blk.3.attn_qkv.weight"), Category::AttnValue);
        assert_eq!(category("blk.3.ffn_down_exps.weight"), Category::FfnDown);
        assert_eq!(category("blk.3.attn_q_norm.weight"), Category::Other);
        assert!(allows_quantization("blk.0.attn_q.weight", &[4096, 4096]));
        assert!(!allows_quantization("blk.0.attn_norm.weight", &[4096]));
        assert!(!allows_quantization("blk.0.attn_q.weight", &[4096, 1]));
        assert!(!allows_quantization("blk.0.ffn_gate_inp.weight", &[4096, 8]));
        assert!(!allows_quantization("blk.0.attn_q.bias", &[4096, 2]));
        assert_eq!(layer_of("blk.12.ffn_up.weight"), Some(12));
        assert_eq!(layer_of("output.weight"), None);
    }

    #[test]
    fn processing_order_is_non_layer_first_then_by_layer_number() {
        let info = |name: &str| TensorInfo { name: name.into(), dims: vec![32], ty: GgmlType::F32, offset: 0, n_bytes: 0 };
        let tensors: Vec<TensorInfo> =
            ["token_embd.weight", "blk.10.attn_v.weight", "blk.2.attn_v.weight", "output.weight", "blk.2.attn_k.weight"].into_iter().map(info).collect();
        let names: Vec<&str> = llama_order(&tensors).into_iter().map(|i| tensors[i].name.as_str()).collect();
        assert_eq!(names, ["output.weight", "token_embd.weight", "blk.2.attn_k.weight", "blk.2.attn_v.weight", "blk.10.attn_v.weight"]);
    }
}
