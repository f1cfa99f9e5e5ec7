//! Models written by `kiln quantize` and the random-model generator load and
//! generate, with logits close to the F32 original's.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_core::{CpuBackend, SamplingParams};
use kiln_gguf::GgufFile;
use kiln_models::{Logits, Model, ModelOptions};
use kiln_quant::file::{parse_file_type, quantize_file, QuantizeOptions};
use kiln_quant::synthetic::{find_shape, RandomModel};

fn stories() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/stories260K.gguf");
    assert!(p.exists(), "model not found at {}", p.display());
    p
}

fn options(name: &str) -> QuantizeOptions {
    QuantizeOptions::new(parse_file_type(name).unwrap())
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    (num / den).sqrt()
}

fn greedy_tokens(path: &Path, prompt: &[u32], n: usize) -> (Vec<f32>, Vec<u32>) {
    let file = Arc::new(GgufFile::open(path).unwrap());
    let options = ModelOptions { n_ctx: Some(128), ..ModelOptions::default() };
    let mut model = Model::load(Arc::new(CpuBackend::new()), file, &options).unwrap();
    let logits = model.forward(prompt, Logits::Last).unwrap().to_vec();
    let greedy = SamplingParams::greedy();
    let mut token = kiln_core::sampling::argmax(&logits);
    let mut out = vec![token];
    for _ in 1..n {
        token = model.decode_sample(token, &greedy).unwrap();
        out.push(token);
    }
    (logits, out)
}

#[test]
fn quantized_models_load_and_generate() {
    let dir = tempfile::tempdir().unwrap();
    // BOS and four arbitrary tokens of the 512-token vocabulary.
    let prompt = [1, 403, 407, 261, 378];
    let (reference, _) = greedy_tokens(&stories(), &prompt, 1);
    for name in ["Q4_K_M", "Q6_K", "F16"] {
        let out = dir.path().join(format!("{name}.gguf"));
        quantize_file(&stories(), &out, &options(name), &()).unwrap();
        let (logits, tokens) = greedy_tokens(&out, &prompt, 16);
        // Weight errors of a few percent (the tolerances in kiln-quant's
        // tests/quantize.rs) move these logits by a few percent; a broken
        // tensor moves them by 30% or more.
        let err = rel_l2(&logits, &reference);
        assert!(err < 0.1, "{name}: logits rel_l2 {err:.4} against the F32 model");
        assert!(tokens.iter().all(|&t| t < 512), "{name}: {tokens:?}");
    }
    for shape_name in ["tiny-llama", "tiny-qwen3", "tiny-qwen2"] {
        let out = dir.path().join(format!("{shape_name}.gguf"));
        RandomModel::new(find_shape(shape_name).unwrap(), 1).write(&out, &options("Q4_K_M"), &()).unwrap();
        let (logits, tokens) = greedy_tokens(&out, &[504, 10, 20, 30], 8);
        assert!(logits.iter().all(|l| l.is_finite()), "{shape_name}: non-finite logits");
        assert_eq!(tokens.len(), 8);
        let tokenizer = kiln_tokenizer::Tokenizer::from_gguf(&GgufFile::open(&out).unwrap()).unwrap();
        assert_eq!(tokenizer.vocab_size(), 512);
    }
}
