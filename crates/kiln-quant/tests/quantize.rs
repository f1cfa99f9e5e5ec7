//! `kiln quantize` and the random models against llama-quantize.
//!
//! The expected per-tensor types are written out by hand from llama.cpp's
//! rules (src/llama-quant.cpp, `llama_tensor_get_type`): output.weight goes to
//! Q6_K (Q8_0 when its rows do not fit the block), attn_v and ffn_down get Q6_K
//! in the "use more bits" layers (the first and last eighth and every third
//! one between), and rows that are not a multiple of 256 fall back to
//! Q5_0/Q5_1/Q8_0/Q4_0/IQ4_NL, or F16 when not even a multiple of 32.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kiln_gguf::{GgufFile, TensorInfo, Value};
use kiln_quant::file::{parse_file_type, plan_tensors, quantize_file, QuantHparams, QuantizeError, QuantizeOptions};
use kiln_quant::synthetic::{find_shape, ModelShape, RandomModel};
use kiln_quant::GgmlType::{self, *};

fn stories() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/stories260K.gguf");
    assert!(p.exists(), "model not found at {}", p.display());
    p
}

fn options(name: &str) -> QuantizeOptions {
    QuantizeOptions::new(parse_file_type(name).unwrap())
}

fn shape(name: &str, n_layer: u64) -> ModelShape {
    ModelShape { n_layer, ..find_shape(name).unwrap() }
}

/// Planned output type per tensor name for the random model of `shape`.
fn planned(shape: ModelShape, opts: &QuantizeOptions) -> HashMap<String, GgmlType> {
    let model = RandomModel::new(shape, 0);
    let hp = QuantHparams::from_metadata(&model.metadata()).unwrap();
    let plans = plan_tensors(&hp, model.tensors(), opts).unwrap();
    plans.into_iter().map(|p| (p.name, p.dst_type)).collect()
}

/// Expected types of a llama/qwen3 model: `base` for every matrix, `more`
/// for attn_v/ffn_down of the listed layers, F32 norms, `embd`/`out` for the
/// embeddings and the output matrix.
struct Expect<'a> {
    n_layer: u64,
    base: GgmlType,
    embd: GgmlType,
    out: Option<GgmlType>,
    attn_v: &'a dyn Fn(u64) -> GgmlType,
    ffn_down: &'a dyn Fn(u64) -> GgmlType,
    attn_output: GgmlType,
    qk_norm: bool,
}

impl Expect<'_> {
    fn table(&self) -> HashMap<String, GgmlType> {
        let mut t = HashMap::new();
        t.insert("token_embd.weight".to_string(), self.embd);
        t.insert("output_norm.weight".to_string(), F32);
        if let Some(out) = self.out {
            t.insert("output.weight".to_string(), out);
        }
        for l in 0..self.n_layer {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            for s in ["attn_q", "attn_k", "ffn_gate", "ffn_up"] {
                t.insert(n(s), self.base);
            }
            t.insert(n("attn_output"), self.attn_output);
            t.insert(n("attn_v"), (self.attn_v)(l));
            t.insert(n("ffn_down"), (self.ffn_down)(l));
            for s in ["attn_norm", "ffn_norm"] {
                t.insert(n(s), F32);
            }
            if self.qk_norm {
                t.insert(n("attn_q_norm"), F32);
                t.insert(n("attn_k_norm"), F32);
            }
        }
        t
    }
}

fn assert_same_types(got: &HashMap<String, GgmlType>, expected: &HashMap<String, GgmlType>, what: &str) {
    assert_eq!(got.len(), expected.len(), "{what}: tensor count");
    for (name, ty) in expected {
        assert_eq!(got.get(name), Some(ty), "{what}: {name}");
    }
}

/// Layers whose attn_v/ffn_down get more bits in a 32-layer Q4_K_M/Q5_K_M.
const MORE_BITS_32: &[u64] = &[0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31];
/// The same for 36 layers (qwen3-8b): below 36/8 = 4, from 7*36/8 = 31, and (i - 4) % 3 == 2.
const MORE_BITS_36: &[u64] = &[0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 31, 32, 33, 34, 35];

#[test]
fn llama3_8b_q4_k_m_types_match_llama_quantize() {
    let more = |l: u64| if MORE_BITS_32.contains(&l) { Q6_K } else { Q4_K };
    let expected = Expect { n_layer: 32, base: Q4_K, embd: Q4_K, out: Some(Q6_K), attn_v: &more, ffn_down: &more, attn_output: Q4_K, qk_norm: false };
    assert_same_types(&planned(shape("llama3-8b", 32), &options("Q4_K_M")), &expected.table(), "llama3-8b Q4_K_M");
    // The alias Q4_K means Q4_K_M, as in llama-quantize.
    assert_same_types(&planned(shape("llama3-8b", 32), &options("q4_k")), &expected.table(), "llama3-8b Q4_K");
}

#[test]
fn llama3_8b_two_layers_q4_k_m_types_match_llama_quantize() {
    // With 2 layers only layer 1 (>= 7*2/8) uses more bits.
    let more = |l: u64| if l == 1 { Q6_K } else { Q4_K };
    let expected = Expect { n_layer: 2, base: Q4_K, embd: Q4_K, out: Some(Q6_K), attn_v: &more, ffn_down: &more, attn_output: Q4_K, qk_norm: false };
    assert_same_types(&planned(shape("llama3-8b", 2), &options("Q4_K_M")), &expected.table(), "llama3-8b --layers 2");
}

#[test]
fn qwen3_8b_q5_k_m_types_match_llama_quantize() {
    let more = |l: u64| if MORE_BITS_36.contains(&l) { Q6_K } else { Q5_K };
    let expected = Expect { n_layer: 36, base: Q5_K, embd: Q5_K, out: Some(Q6_K), attn_v: &more, ffn_down: &more, attn_output: Q5_K, qk_norm: true };
    assert_same_types(&planned(shape("qwen3-8b", 36), &options("Q5_K_M")), &expected.table(), "qwen3-8b Q5_K_M");
}

#[test]
fn other_mixes_match_llama_quantize() {
    let s = shape("llama3-8b", 32);
    // Q4_K_S: the first 4 attn_v and the first 32/8 ffn_down in Q5_K.
    let first4 = |l: u64| if l < 4 { Q5_K } else { Q4_K };
    let e = Expect { n_layer: 32, base: Q4_K, embd: Q4_K, out: Some(Q6_K), attn_v: &first4, ffn_down: &first4, attn_output: Q4_K, qk_norm: false };
    assert_same_types(&planned(s, &options("Q4_K_S")), &e.table(), "Q4_K_S");
    // Q3_K_M: attn_v Q5_K for the first 2, else Q4_K; ffn_down Q5_K below 32/16, else Q4_K; attn_output Q4_K.
    let v = |l: u64| if l < 2 { Q5_K } else { Q4_K };
    let e = Expect { n_layer: 32, base: Q3_K, embd: Q3_K, out: Some(Q6_K), attn_v: &v, ffn_down: &v, attn_output: Q4_K, qk_norm: false };
    assert_same_types(&planned(s, &options("Q3_K_M")), &e.table(), "Q3_K_M");
    // Q2_K: attn_v Q4_K (4 query heads per KV head), ffn_down and attn_output Q3_K.
    let e = Expect { n_layer: 32, base: Q2_K, embd: Q2_K, out: Some(Q6_K), attn_v: &|_| Q4_K, ffn_down: &|_| Q3_K, attn_output: Q3_K, qk_norm: false };
    assert_same_types(&planned(s, &options("Q2_K")), &e.table(), "Q2_K");
    // IQ4_NL: attn_v Q5_K (n_gqa >= 4), ffn_down Q5_K in the first eighth.
    let first4_nl = |l: u64| if l < 4 { Q5_K } else { IQ4_NL };
    let e = Expect { n_layer: 32, base: IQ4_NL, embd: IQ4_NL, out: Some(Q6_K), attn_v: &|_| Q5_K, ffn_down: &first4_nl, attn_output: IQ4_NL, qk_norm: false };
    assert_same_types(&planned(s, &options("IQ4_NL")), &e.table(), "IQ4_NL");
    // TQ2_0: embeddings Q4_K, output Q6_K, everything else ternary.
    let e = Expect { n_layer: 32, base: TQ2_0, embd: Q4_K, out: Some(Q6_K), attn_v: &|_| TQ2_0, ffn_down: &|_| TQ2_0, attn_output: TQ2_0, qk_norm: false };
    assert_same_types(&planned(s, &options("TQ2_0")), &e.table(), "TQ2_0");
    // IQ3_S: attn_v Q4_K (n_gqa >= 4). IQ3_M: attn_v and attn_output Q4_K, ffn_down Q4_K
    // in the first eighth.
    let e = Expect { n_layer: 32, base: IQ3_S, embd: IQ3_S, out: Some(Q6_K), attn_v: &|_| Q4_K, ffn_down: &|_| IQ3_S, attn_output: IQ3_S, qk_norm: false };
    assert_same_types(&planned(s, &options("IQ3_S")), &e.table(), "IQ3_S");
    let first4_iq3 = |l: u64| if l < 4 { Q4_K } else { IQ3_S };
    let e = Expect { n_layer: 32, base: IQ3_S, embd: IQ3_S, out: Some(Q6_K), attn_v: &|_| Q4_K, ffn_down: &first4_iq3, attn_output: Q4_K, qk_norm: false };
    assert_same_types(&planned(s, &options("IQ3_M")), &e.table(), "IQ3_M");
    // IQ3_XS puts IQ3_XXS on attn_k (the first such tensor in llama.cpp's order), which
    // llama-quantize refuses without an importance matrix; --pure is all IQ3_S.
    let model = RandomModel::new(s, 0);
    let hp = QuantHparams::from_metadata(&model.metadata()).unwrap();
    match plan_tensors(&hp, model.tensors(), &options("IQ3_XS")) {
        Err(QuantizeError::NeedsImatrix { tensor, ty: IQ3_XXS }) => assert_eq!(tensor, "blk.0.attn_k.weight"),
        other => panic!("expected NeedsImatrix, got {other:?}"),
    }
    let pure = QuantizeOptions { pure: true, ..options("IQ3_XS") };
    let e = Expect { n_layer: 32, base: IQ3_S, embd: IQ3_S, out: Some(IQ3_S), attn_v: &|_| IQ3_S, ffn_down: &|_| IQ3_S, attn_output: IQ3_S, qk_norm: false };
    assert_same_types(&planned(s, &pure), &e.table(), "--pure IQ3_XS");
    // IQ2_XXS needs an importance matrix: refused at the first layer matrix in llama.cpp's
    // order, as llama-quantize refuses it; with a uniform importance (random-model), its
    // mix: output Q5_K, embeddings Q2_K, attn_v Q4_K (n_gqa >= 4), ffn_down Q2_K in the
    // first eighth.
    match plan_tensors(&hp, model.tensors(), &options("IQ2_XXS")) {
        Err(QuantizeError::NeedsImatrix { tensor, ty: IQ2_XXS }) => assert_eq!(tensor, "blk.0.attn_k.weight"),
        other => panic!("expected NeedsImatrix, got {other:?}"),
    }
    let uniform = QuantizeOptions { allow_without_imatrix: true, ..options("IQ2_XXS") };
    let first4_q2 = |l: u64| if l < 4 { Q2_K } else { IQ2_XXS };
    let e = Expect { n_layer: 32, base: IQ2_XXS, embd: Q2_K, out: Some(Q5_K), attn_v: &|_| Q4_K, ffn_down: &first4_q2, attn_output: IQ2_XXS, qk_norm: false };
    assert_same_types(&planned(s, &uniform), &e.table(), "IQ2_XXS");
    // With 2 KV heads per head (n_gqa 2), attn_v is Q2_K.
    let gqa2 = ModelShape { n_head_kv: 16, ..s };
    let e = Expect { n_layer: 32, base: IQ2_XXS, embd: Q2_K, out: Some(Q5_K), attn_v: &|_| Q2_K, ffn_down: &first4_q2, attn_output: IQ2_XXS, qk_norm: false };
    assert_same_types(&planned(gqa2, &uniform), &e.table(), "IQ2_XXS, n_gqa 2");
    // IQ2_XS: the same rules. IQ2_S (IQ2_XS by default) and IQ2_M (IQ2_S): IQ3_S where the
    // others take Q2_K, and on attn_output.
    let without = |name: &str| QuantizeOptions { allow_without_imatrix: true, ..options(name) };
    let first4_q2 = |l: u64| if l < 4 { Q2_K } else { IQ2_XS };
    let e = Expect { n_layer: 32, base: IQ2_XS, embd: Q2_K, out: Some(Q5_K), attn_v: &|_| Q4_K, ffn_down: &first4_q2, attn_output: IQ2_XS, qk_norm: false };
    assert_same_types(&planned(s, &without("IQ2_XS")), &e.table(), "IQ2_XS");
    for (name, base) in [("IQ2_S", IQ2_XS), ("IQ2_M", IQ2_S)] {
        let first4_iq3 = |l: u64| if l < 4 { IQ3_S } else { base };
        let e = Expect { n_layer: 32, base, embd: IQ3_S, out: Some(Q5_K), attn_v: &|_| Q4_K, ffn_down: &first4_iq3, attn_output: IQ3_S, qk_norm: false };
        assert_same_types(&planned(s, &without(name)), &e.table(), name);
        let e = Expect { attn_v: &|_| IQ3_S, ..e };
        assert_same_types(&planned(gqa2, &without(name)), &e.table(), &format!("{name}, n_gqa 2"));
    }
    // IQ3_XXS without an importance matrix: IQ2_S on attn_q/attn_k, IQ3_XXS on gate/up,
    // attn_output and the embeddings IQ3_S, ffn_down Q4_K in the first eighth, else Q3_K.
    let first4_q4 = |l: u64| if l < 4 { Q4_K } else { Q3_K };
    let e = Expect { n_layer: 32, base: IQ3_XXS, embd: IQ3_S, out: Some(Q5_K), attn_v: &|_| Q4_K, ffn_down: &first4_q4, attn_output: IQ3_S, qk_norm: false };
    let mut table = e.table();
    for l in 0..32 {
        table.insert(format!("blk.{l}.attn_q.weight"), IQ2_S);
        table.insert(format!("blk.{l}.attn_k.weight"), IQ2_S);
    }
    assert_same_types(&planned(s, &without("IQ3_XXS")), &table, "IQ3_XXS");
    match plan_tensors(&hp, model.tensors(), &options("IQ3_XXS")) {
        Err(QuantizeError::NeedsImatrix { tensor, ty: IQ2_S }) => assert_eq!(tensor, "blk.0.attn_k.weight"),
        other => panic!("expected NeedsImatrix, got {other:?}"),
    }
    // IQ1_S / IQ1_M: the IQ2_XXS rules, with IQ2_XXS on attn_output.
    for (name, base) in [("IQ1_S", IQ1_S), ("IQ1_M", IQ1_M)] {
        let first4_q2 = |l: u64| if l < 4 { Q2_K } else { base };
        let e = Expect { n_layer: 32, base, embd: Q2_K, out: Some(Q5_K), attn_v: &|_| Q4_K, ffn_down: &first4_q2, attn_output: IQ2_XXS, qk_norm: false };
        assert_same_types(&planned(s, &without(name)), &e.table(), name);
    }
    // Q2_K_S: Q4_K on attn_v (n_gqa >= 4) and on ffn_down in the first eighth; its Q2_K
    // tensors need an importance matrix (the embeddings excepted).
    let first4_q4k = |l: u64| if l < 4 { Q4_K } else { Q2_K };
    let e = Expect { n_layer: 32, base: Q2_K, embd: Q2_K, out: Some(Q6_K), attn_v: &|_| Q4_K, ffn_down: &first4_q4k, attn_output: Q2_K, qk_norm: false };
    assert_same_types(&planned(s, &without("Q2_K_S")), &e.table(), "Q2_K_S");
    match plan_tensors(&hp, model.tensors(), &options("Q2_K_S")) {
        Err(QuantizeError::NeedsImatrix { tensor, ty: Q2_K }) => assert_eq!(tensor, "blk.0.attn_k.weight"),
        other => panic!("expected NeedsImatrix, got {other:?}"),
    }
    // Q2_0 / NVFP4: the generic rules only (output Q6_K).
    for (name, ty) in [("Q2_0", Q2_0), ("NVFP4", NVFP4)] {
        let e = Expect { n_layer: 32, base: ty, embd: ty, out: Some(Q6_K), attn_v: &|_| ty, ffn_down: &|_| ty, attn_output: ty, qk_norm: false };
        assert_same_types(&planned(s, &options(name)), &e.table(), name);
    }
    // MXFP4_MOE on a dense model: no expert tensors, so all but the untied embeddings Q8_0;
    // --pure puts every matrix in MXFP4.
    let e = Expect { n_layer: 32, base: Q8_0, embd: MXFP4, out: Some(Q8_0), attn_v: &|_| Q8_0, ffn_down: &|_| Q8_0, attn_output: Q8_0, qk_norm: false };
    assert_same_types(&planned(s, &options("MXFP4_MOE")), &e.table(), "MXFP4_MOE");
    let pure = QuantizeOptions { pure: true, ..options("MXFP4_MOE") };
    let e = Expect { n_layer: 32, base: MXFP4, embd: MXFP4, out: Some(MXFP4), attn_v: &|_| MXFP4, ffn_down: &|_| MXFP4, attn_output: MXFP4, qk_norm: false };
    assert_same_types(&planned(s, &pure), &e.table(), "--pure MXFP4_MOE");
    // Q8_0 keeps Q8_0 for the output; F16 converts every matrix and no mix rule applies.
    let e = Expect { n_layer: 32, base: Q8_0, embd: Q8_0, out: Some(Q8_0), attn_v: &|_| Q8_0, ffn_down: &|_| Q8_0, attn_output: Q8_0, qk_norm: false };
    assert_same_types(&planned(s, &options("Q8_0")), &e.table(), "Q8_0");
    let e = Expect { n_layer: 32, base: F16, embd: F16, out: Some(F16), attn_v: &|_| F16, ffn_down: &|_| F16, attn_output: F16, qk_norm: false };
    assert_same_types(&planned(s, &options("F16")), &e.table(), "F16");
    // --pure: every matrix in the default type, output and embeddings included.
    let pure = QuantizeOptions { pure: true, ..options("Q4_K_M") };
    let e = Expect { n_layer: 32, base: Q4_K, embd: Q4_K, out: Some(Q4_K), attn_v: &|_| Q4_K, ffn_down: &|_| Q4_K, attn_output: Q4_K, qk_norm: false };
    assert_same_types(&planned(s, &pure), &e.table(), "--pure Q4_K_M");
}

#[test]
fn seventy_b_llama_gets_q5_k_attn_v() {
    let s = ModelShape { n_layer: 80, n_embd: 8192, n_head: 64, n_head_kv: 8, n_ff: 28672, ..find_shape("llama3-8b").unwrap() };
    let types = planned(s, &options("Q4_K_M"));
    // Layers 0..10 and 70..80 use more bits; between, (l - 10) % 3 == 2 does.
    assert_eq!(types["blk.0.attn_v.weight"], Q6_K);
    assert_eq!(types["blk.12.attn_v.weight"], Q6_K);
    assert_eq!(types["blk.13.attn_v.weight"], Q5_K, "70B raises the other attn_v from Q4_K to Q5_K");
    assert_eq!(types["blk.13.ffn_down.weight"], Q4_K);
    assert_eq!(types["blk.13.attn_q.weight"], Q4_K);
    let types = planned(s, &options("IQ3_M"));
    assert_eq!(types["blk.13.attn_v.weight"], Q5_K, "70B raises IQ3_M's Q4_K attn_v too");
    assert_eq!(types["blk.13.attn_q.weight"], IQ3_S);
}

#[test]
fn tied_qwen3_embeddings_follow_the_output_rule() {
    let types = planned(shape("qwen3-0.6b", 28), &options("Q4_K_M"));
    assert!(!types.contains_key("output.weight"));
    assert_eq!(types["token_embd.weight"], Q6_K, "tied token_embd is quantized like output.weight");
}

/// llama-quantize's types for stories260K (n_embd 64, n_ff 172, tied, 5
/// layers): no row is a multiple of 256, so Q4_K falls back to Q5_0 and Q6_K
/// to Q8_0, and the 172-long ffn_down rows (not a multiple of 32) to F16. The
/// tied token_embd takes the output rule: rows of 64 do not fit Q4_K -> Q8_0.
fn stories_q4_k_m_expected(file: &GgufFile) -> HashMap<String, GgmlType> {
    let mut t = HashMap::new();
    for info in file.tensors() {
        let n = &info.name;
        let layer: u64 = n.split('.').nth(1).and_then(|l| l.parse().ok()).unwrap_or(99);
        let ty = if info.dims.len() == 1 {
            F32
        } else if n == "token_embd.weight" || (n.ends_with("attn_v.weight") && (layer == 2 || layer == 4)) {
            Q8_0
        } else if n.ends_with("ffn_down.weight") {
            F16
        } else {
            Q5_0
        };
        t.insert(n.clone(), ty);
    }
    t
}

fn types_of(file: &GgufFile) -> HashMap<String, GgmlType> {
    file.tensors().iter().map(|t| (t.name.clone(), t.ty)).collect()
}

fn dequantize_all(file: &GgufFile, t: &TensorInfo) -> Vec<f32> {
    let mut out = vec![0f32; t.n_elements() as usize];
    kiln_quant::dequantize(t.ty, file.tensor_data(t), &mut out).unwrap();
    out
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Largest rel-L2 error of a type on these weights: the largest value measured
/// over all tensors of these tests (Gaussian and trained weights), plus about
/// 50%. An all-zero or uncorrelated tensor gives 1 or more, above every bound;
/// ternary and 1-bit types are that coarse on Gaussian data (measured 0.77
/// and 0.59), so their bounds sit just below 1.
fn tolerance(ty: GgmlType) -> f64 {
    match ty {
        F32 => 0.0,
        F16 => 1e-3,
        BF16 => 5e-3,
        Q8_0 => 0.01,
        Q6_K => 0.03,
        Q5_0 | Q5_1 | Q5_K => 0.075,
        Q4_0 | Q4_1 | Q4_K | IQ4_NL | IQ4_XS => 0.15,
        MXFP4 | NVFP4 => 0.18,
        Q3_K => 0.22,
        IQ3_S => 0.25,
        IQ3_XXS => 0.32,
        Q2_K => 0.43,
        Q1_0 => 0.8,
        TQ1_0 | TQ2_0 | Q2_0 => 0.9,
        other => panic!("no tolerance for {other}"),
    }
}

struct TempDir(tempfile::TempDir);

impl TempDir {
    fn new() -> Self {
        TempDir(tempfile::tempdir().unwrap())
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }
}

#[test]
fn stories_q4_k_m_has_llama_quantize_types_values_and_metadata() {
    let dir = TempDir::new();
    let out = dir.path("q4km.gguf");
    let summary = quantize_file(&stories(), &out, &options("Q4_K_M"), &()).unwrap();
    let input = GgufFile::open(stories()).unwrap();
    let output = GgufFile::open(&out).unwrap();
    assert_same_types(&types_of(&output), &stories_q4_k_m_expected(&input), "stories260K Q4_K_M");
    assert_eq!(summary.n_fallback, 35, "every one of the 5 x 7 layer matrices needs a fallback type");
    // Tensor order and every metadata key but the two llama-quantize sets are kept.
    let names = |f: &GgufFile| f.tensors().iter().map(|t| t.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&input), names(&output));
    assert_eq!(output.get("general.file_type"), Some(&Value::U32(15)));
    assert_eq!(output.get("general.quantization_version"), Some(&Value::U32(2)));
    for (key, value) in input.metadata() {
        if key != "general.file_type" {
            assert_eq!(output.get(key), Some(value), "{key}");
        }
    }
    for (a, b) in input.tensors().iter().zip(output.tensors()) {
        let err = rel_l2(&dequantize_all(&output, b), &dequantize_all(&input, a));
        assert!(err <= tolerance(b.ty), "{}: {} rel_l2 {err:.4}", b.name, b.ty);
    }
}

#[test]
fn many_file_types_on_stories_load_and_stay_close() {
    let dir = TempDir::new();
    let input = GgufFile::open(stories()).unwrap();
    // IQ3_XS passes the importance-matrix check here: its IQ3_XXS tensors fall back to IQ4_NL first.
    for name in ["F32", "F16", "BF16", "Q5_K_M", "Q6_K", "Q2_K", "Q3_K_L", "Q4_K_S", "IQ4_XS", "IQ3_XS", "IQ3_M", "TQ1_0", "TQ2_0"] {
        let out = dir.path(&format!("{name}.gguf"));
        quantize_file(&stories(), &out, &options(name), &()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let output = GgufFile::open(&out).unwrap();
        for (a, b) in input.tensors().iter().zip(output.tensors()) {
            assert_eq!(a.dims, b.dims);
            let err = rel_l2(&dequantize_all(&output, b), &dequantize_all(&input, a));
            assert!(err <= tolerance(b.ty), "{name} {}: {} rel_l2 {err:.4}", b.name, b.ty);
        }
    }
}

#[test]
fn f16_and_bf16_are_byte_identical_to_llama_quantize() {
    // shared/testdata's stories260K-F16/-BF16 were written by llama-quantize
    // from the same F32 file (it reorders tensors, so compare by name).
    let dir = TempDir::new();
    for name in ["F16", "BF16"] {
        let out = dir.path(&format!("{name}.gguf"));
        quantize_file(&stories(), &out, &options(name), &()).unwrap();
        let ours = GgufFile::open(&out).unwrap();
        let theirs = GgufFile::open(kiln_testdata::path(&format!("models/stories260K-{name}.gguf"))).unwrap();
        assert_eq!(ours.tensors().len(), theirs.tensors().len());
        for t in theirs.tensors() {
            let mine = ours.tensor(&t.name).unwrap_or_else(|| panic!("{} missing", t.name));
            assert_eq!((mine.ty, &mine.dims), (t.ty, &t.dims), "{}", t.name);
            assert!(ours.tensor_data(mine) == theirs.tensor_data(t), "{name} {}: bytes differ", t.name);
        }
        assert_eq!(ours.get("general.file_type"), theirs.get("general.file_type"));
    }
}

#[test]
fn stories_errors_are_llama_quantize_errors() {
    let dir = TempDir::new();
    // Q4_0 has no fallback and 172 is not a multiple of 32.
    match quantize_file(&stories(), &dir.path("q4_0.gguf"), &options("Q4_0"), &()) {
        Err(QuantizeError::NoFallback { tensor, ty: Q4_0, row_len: 172 }) => assert_eq!(tensor, "blk.0.ffn_down.weight"),
        other => panic!("expected NoFallback, got {other:?}"),
    }
    // Q1_0 blocks are 128 long; the first 64-wide matrix in llama.cpp's order is blk.0.attn_k.
    match quantize_file(&stories(), &dir.path("q1_0.gguf"), &options("Q1_0"), &()) {
        Err(QuantizeError::NoFallback { tensor, ty: Q1_0, row_len: 64 }) => assert_eq!(tensor, "blk.0.attn_k.weight"),
        other => panic!("expected NoFallback, got {other:?}"),
    }
    assert!(!dir.path("q4_0.gguf").exists() && !dir.path("q4_0.gguf.tmp").exists(), "a failed run leaves no file");
    let err = parse_file_type("Q7_K").unwrap_err().to_string();
    assert!(err.contains("'Q7_K'") && err.contains("Q4_K_M") && err.contains("IQ4_NL"), "{err}");
    match quantize_file(&dir.path("missing.gguf"), &dir.path("x.gguf"), &options("Q8_0"), &()) {
        Err(e @ QuantizeError::Open { .. }) => assert!(e.to_string().contains("missing.gguf"), "{e}"),
        other => panic!("expected Open, got {other:?}"),
    }
    match quantize_file(&stories(), &dir.path("no/such/dir/x.gguf"), &options("F16"), &()) {
        Err(e @ QuantizeError::Write { .. }) => assert!(e.to_string().contains("no/such/dir"), "{e}"),
        other => panic!("expected Write, got {other:?}"),
    }
    assert!(matches!(quantize_file(&stories(), &stories(), &options("F16"), &()), Err(QuantizeError::SameFile { .. })));
}

#[test]
fn requantizing_needs_the_flag() {
    let dir = TempDir::new();
    let src = kiln_testdata::path("models/tiny-llama-Q8_0.gguf");
    match quantize_file(&src, &dir.path("a.gguf"), &options("Q4_K_M"), &()) {
        Err(QuantizeError::RequantizeDisabled { from: Q8_0, .. }) => {}
        other => panic!("expected RequantizeDisabled, got {other:?}"),
    }
    let out = dir.path("b.gguf");
    let opts = QuantizeOptions { allow_requantize: true, ..options("Q4_K_M") };
    quantize_file(&src, &out, &opts, &()).unwrap();
    let (input, output) = (GgufFile::open(&src).unwrap(), GgufFile::open(&out).unwrap());
    for (a, b) in input.tensors().iter().zip(output.tensors()) {
        let err = rel_l2(&dequantize_all(&output, b), &dequantize_all(&input, a));
        assert!(err <= tolerance(b.ty), "{}: {} rel_l2 {err:.4}", b.name, b.ty);
    }
    // Converting to the type a tensor already has copies it: Q8_0 -> Q8_0 needs no flag.
    quantize_file(&src, &dir.path("c.gguf"), &QuantizeOptions { pure: true, ..options("Q8_0") }, &()).unwrap();
    let copy = GgufFile::open(dir.path("c.gguf")).unwrap();
    for (a, b) in input.tensors().iter().zip(copy.tensors()) {
        assert!(input.tensor_data(a) == copy.tensor_data(b), "{}", a.name);
    }
}

/// Every type kiln writes, through the mixes that use it, on rows of 256 and 512.
const RANDOM_MODEL_TYPES: &[&str] = &[
    "Q4_K_M",
    "Q5_K_S",
    "Q2_K",
    "Q3_K_M",
    "Q6_K",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "IQ4_XS",
    "IQ4_NL",
    "IQ3_S",
    "IQ3_M",
    "TQ1_0",
    "TQ2_0",
    "Q1_0",
    "Q2_0",
    "NVFP4",
    "MXFP4_MOE",
    "BF16",
];

#[test]
fn random_tiny_models_hold_their_planned_types_and_values() {
    let dir = TempDir::new();
    let cases = RANDOM_MODEL_TYPES.iter().map(|&t| ("tiny-llama", t)).chain([("tiny-qwen3", "Q4_K_M")]);
    for (shape_name, type_name) in cases {
        let model = RandomModel::new(find_shape(shape_name).unwrap(), 42);
        let out = dir.path(&format!("{shape_name}-{type_name}.gguf"));
        let opts = options(type_name);
        model.write(&out, &opts, &()).unwrap();
        let file = GgufFile::open(&out).unwrap();
        let hp = QuantHparams::from_metadata(&model.metadata()).unwrap();
        let plans = plan_tensors(&hp, model.tensors(), &opts).unwrap();
        assert_eq!(file.tensors().len(), plans.len());
        assert_eq!(file.get("general.file_type"), Some(&Value::U32(opts.ftype.id())));
        for (index, (t, p)) in file.tensors().iter().zip(&plans).enumerate() {
            assert_eq!((&t.name, t.ty), (&p.name, p.dst_type));
            let values = dequantize_all(&file, t);
            let row_len = t.dims[0] as usize;
            let mut original = vec![0f32; values.len()];
            for (row, chunk) in original.chunks_mut(row_len).enumerate() {
                model.original_row(index, row, chunk);
            }
            let err = rel_l2(&values, &original);
            assert!(err <= tolerance(t.ty), "{shape_name} {type_name} {}: {} rel_l2 {err:.4}", t.name, t.ty);
        }
    }
}

#[test]
fn random_model_is_kiln_quantize_of_its_f16_original() {
    let dir = TempDir::new();
    for shape_name in ["tiny-llama", "tiny-qwen3"] {
        let model = RandomModel::new(find_shape(shape_name).unwrap(), 9);
        let (f16, direct, converted) = (dir.path("f16.gguf"), dir.path("direct.gguf"), dir.path("converted.gguf"));
        model.write(&f16, &options("F16"), &()).unwrap();
        model.write(&direct, &options("Q4_K_M"), &()).unwrap();
        quantize_file(&f16, &converted, &options("Q4_K_M"), &()).unwrap();
        let (a, b) = (std::fs::read(&direct).unwrap(), std::fs::read(&converted).unwrap());
        assert!(a == b, "{shape_name}: the random Q4_K_M model differs from `kiln quantize` of its F16 version");
    }
}

/// With distinct rows, a weight matrix's rows repeat its first rows, those first rows are the
/// full model's own bytes, and the F32 matrices and norms are untouched: the file has the
/// full file's layout and size.
#[test]
fn distinct_rows_repeat_the_full_models_first_rows() {
    const ROWS: usize = 3;
    let dir = TempDir::new();
    let shape = find_shape("tiny-qwen3").unwrap();
    let (full, fast) = (dir.path("full.gguf"), dir.path("fast.gguf"));
    RandomModel::new(shape, 5).write(&full, &options("Q4_K_M"), &()).unwrap();
    RandomModel::new(shape, 5).with_distinct_rows(ROWS).write(&fast, &options("Q4_K_M"), &()).unwrap();
    let (full, fast) = (GgufFile::open(&full).unwrap(), GgufFile::open(&fast).unwrap());
    assert_eq!(full.tensors().len(), fast.tensors().len());
    let mut repeated = 0;
    for (a, b) in full.tensors().iter().zip(fast.tensors()) {
        assert_eq!((&a.name, a.ty, &a.dims), (&b.name, b.ty, &b.dims));
        let (x, y) = (full.tensor_data(a), fast.tensor_data(b));
        assert_eq!(x.len(), y.len(), "{}", a.name);
        let n_rows = (a.n_elements() / a.dims[0]) as usize;
        if a.dims.len() < 2 || n_rows <= ROWS {
            assert_eq!(x, y, "{}: a norm or short matrix must not change", a.name);
            continue;
        }
        let row = x.len() / n_rows;
        assert_eq!(x[..ROWS * row], y[..ROWS * row], "{}: the first rows are the full model's", a.name);
        for r in ROWS..n_rows {
            assert_eq!(y[r * row..(r + 1) * row], y[(r % ROWS) * row..(r % ROWS + 1) * row], "{} row {r}", a.name);
        }
        repeated += 1;
    }
    assert!(repeated >= 7, "only {repeated} matrices repeat their rows");
}
