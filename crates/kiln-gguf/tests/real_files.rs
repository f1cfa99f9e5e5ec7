//! Every shipped GGUF opens, and its header matches the reference JSON
//! written by gguf-py (shared/testdata/models/*.ref.json).

mod common;

use std::path::Path;

use common::{gguf_files_in, read, stories260k};
use kiln_gguf::{fuzzing, GgufFile};
use serde_json::Value as Json;

fn load_ref(gguf: &Path) -> Json {
    let name = gguf.file_stem().unwrap().to_str().unwrap();
    let ref_path = kiln_testdata::path(&format!("models/{name}.ref.json"));
    let text = std::fs::read_to_string(&ref_path).unwrap_or_else(|e| panic!("reference {} unreadable: {e}", ref_path.display()));
    serde_json::from_str(&text).expect("reference JSON parses")
}

fn model_files() -> Vec<std::path::PathBuf> {
    let mut files = gguf_files_in(&kiln_testdata::path("models"));
    files.push(stories260k());
    files
}

fn check_against_ref(path: &Path) {
    let file = GgufFile::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let r = load_ref(path);
    let ctx = path.display();
    assert_eq!(file.path(), Some(path));
    assert_eq!(file.file_size(), r["file_size"].as_u64().unwrap(), "{ctx}");
    assert_eq!(file.version() as u64, r["gguf"]["version"].as_u64().unwrap(), "{ctx}");
    assert_eq!(file.metadata().len() as u64, r["gguf"]["n_kv"].as_u64().unwrap(), "{ctx}");
    assert_eq!(file.tensors().len() as u64, r["gguf"]["n_tensors"].as_u64().unwrap(), "{ctx}");
    assert_eq!(file.get_u64("general.file_type").unwrap(), r["gguf"]["file_type"].as_u64().unwrap());

    // Hyperparameters as stored in the metadata.
    let h = &r["hparams"];
    let arch = file.architecture().unwrap();
    assert_eq!(arch, h["arch"].as_str().unwrap(), "{ctx}");
    for (key, field) in [
        ("embedding_length", "n_embd"),
        ("block_count", "n_layer"),
        ("attention.head_count", "n_head"),
        ("attention.head_count_kv", "n_head_kv"),
        ("feed_forward_length", "n_ff"),
    ] {
        let got = file.get_u64(&format!("{arch}.{key}")).unwrap();
        assert_eq!(got, h[field].as_u64().unwrap(), "{ctx}: {key}");
    }
    let eps = file.get_f32(&format!("{arch}.attention.layer_norm_rms_epsilon")).unwrap();
    assert_eq!(eps as f64, h["rms_eps"].as_f64().unwrap(), "{ctx}");
    let tokens = file.get_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len() as u64, h["n_vocab"].as_u64().unwrap(), "{ctx}");
    assert!(tokens.iter().all(|t| t.as_str().is_some()));

    let ref_tensors = r["tensors"].as_array().unwrap();
    assert_eq!(ref_tensors.len(), file.tensors().len());
    for (t, rt) in file.tensors().iter().zip(ref_tensors) {
        assert_eq!(t.name, rt["name"].as_str().unwrap(), "{ctx}");
        let shape: Vec<u64> = rt["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).collect();
        assert_eq!(t.dims, shape, "{ctx}: {}", t.name);
        assert_eq!(t.ty.name(), rt["type"].as_str().unwrap(), "{ctx}: {}", t.name);
        assert_eq!(t.n_bytes, rt["n_bytes"].as_u64().unwrap(), "{ctx}: {}", t.name);
        assert_eq!(t.n_elements(), rt["n_elements"].as_u64().unwrap(), "{ctx}: {}", t.name);
        assert_eq!(file.data_offset() + t.offset, rt["data_offset"].as_u64().unwrap(), "{ctx}: {}", t.name);
        assert_eq!(file.tensor(&t.name), Some(t));
        assert_eq!(file.tensor_data(t).len() as u64, t.n_bytes);
    }
}

#[test]
fn models_match_reference_json() {
    let files = model_files();
    // 22 shipped models: keep the count honest if files go missing.
    assert!(files.len() >= 22, "expected >= 22 model files, found {}", files.len());
    for path in &files {
        check_against_ref(path);
    }
}

#[test]
fn f32_tensor_data_matches_reference_values() {
    // stories260K is all F32, so first16 of each tensor is its raw data.
    let path = stories260k();
    let file = GgufFile::open(&path).unwrap();
    let r = load_ref(&path);
    for (t, rt) in file.tensors().iter().zip(r["tensors"].as_array().unwrap()) {
        assert_eq!(t.ty.name(), "F32");
        let data = file.tensor_data(t);
        let expected = rt["first16"].as_array().unwrap();
        for (i, e) in expected.iter().enumerate() {
            let got = f32::from_le_bytes(data[4 * i..4 * i + 4].try_into().unwrap());
            assert_eq!(got, e.as_f64().unwrap() as f32, "{} element {i}", t.name);
        }
    }
}

/// Token counts from tokenizer/FORMAT.md.
const VOCAB_SIZES: &[(&str, usize)] = &[
    ("llama-spm", 32000),
    ("phi-3", 32064),
    ("gpt-2", 50257),
    ("deepseek-coder", 32256),
    ("falcon", 65024),
    ("starcoder", 49152),
    ("bert-bge", 30522),
    ("llama-bpe", 128256),
    ("qwen2", 151936),
];

#[test]
fn tokenizer_files_open() {
    let files = gguf_files_in(&kiln_testdata::path("tokenizer"));
    assert_eq!(files.len(), VOCAB_SIZES.len());
    for path in &files {
        let file = GgufFile::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let stem = path.file_stem().unwrap().to_str().unwrap();
        let vocab = stem.strip_prefix("ggml-vocab-").unwrap();
        let expected = VOCAB_SIZES.iter().find(|(n, _)| *n == vocab).unwrap().1;
        assert_eq!(file.version(), 3);
        assert!(file.tensors().is_empty());
        assert!(file.architecture().is_ok());
        let tokens = file.get_array("tokenizer.ggml.tokens").unwrap();
        assert_eq!(tokens.len(), expected, "{vocab}");
        let types = file.get_array("tokenizer.ggml.token_type").unwrap();
        assert_eq!(types.len(), expected, "{vocab}");
        assert!(types.iter().all(|t| t.as_i64().is_some()));
        if let Ok(merges) = file.get_array("tokenizer.ggml.merges") {
            assert!(merges.iter().all(|m| m.as_str().is_some_and(|s| s.contains(' '))));
        }
    }
}

/// Writing a real file back with `GgufWriter` reproduces it byte for byte:
/// llama.cpp and this writer lay out header, padding and tensors the same way.
#[test]
fn real_files_rewrite_byte_identical() {
    let mut files = model_files();
    files.extend(gguf_files_in(&kiln_testdata::path("tokenizer")));
    for path in &files {
        let bytes = read(path);
        let file = GgufFile::from_bytes(bytes.clone()).unwrap();
        assert!(file.path().is_none());
        let rewritten = fuzzing::rewrite(&file);
        assert!(rewritten == bytes, "{}: rewrite differs", path.display());
        assert!(fuzzing::exercise(bytes), "{}", path.display());
    }
}
