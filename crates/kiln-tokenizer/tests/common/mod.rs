#![allow(dead_code)]

use std::path::PathBuf;

use kiln_gguf::GgufFile;
use kiln_tokenizer::Tokenizer;

pub const VOCABS: [&str; 9] = ["llama-spm", "phi-3", "gpt-2", "deepseek-coder", "falcon", "starcoder", "bert-bge", "llama-bpe", "qwen2"];
pub const BPE_VOCABS: [&str; 6] = ["gpt-2", "deepseek-coder", "falcon", "starcoder", "llama-bpe", "qwen2"];

pub fn vocab_path(name: &str) -> PathBuf {
    kiln_testdata::path(&format!("tokenizer/ggml-vocab-{name}.gguf"))
}

pub fn load_file(path: PathBuf) -> Tokenizer {
    let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Tokenizer::from_gguf(&file).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn load_vocab(name: &str) -> Tokenizer {
    load_file(vocab_path(name))
}

pub fn stories_path() -> PathBuf {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/stories260K.gguf");
    assert!(path.is_file(), "test model missing: {}", path.display());
    path
}

/// The test texts of FORMAT.md: split on the full separator, drop the final empty piece.
pub fn read_texts(name: &str) -> Vec<String> {
    let path = kiln_testdata::path(&format!("tokenizer/ggml-vocab-{name}.gguf.inp"));
    let raw = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut texts: Vec<String> = raw.split("\n__ggml_vocab_test__\n").map(str::to_string).collect();
    assert_eq!(texts.pop().as_deref(), Some(""), "{}: must end with a separator", path.display());
    texts
}

/// (text, expected ids) per case.
pub fn read_cases(name: &str) -> Vec<(String, Vec<u32>)> {
    let texts = read_texts(name);
    let path = kiln_testdata::path(&format!("tokenizer/ggml-vocab-{name}.gguf.out"));
    let out = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let lines: Vec<&str> = out.strip_suffix('\n').unwrap_or(&out).split('\n').collect();
    assert_eq!(lines.len(), texts.len(), "{}: one line per text", path.display());
    texts.into_iter().zip(lines).map(|(t, l)| (t, l.split_whitespace().map(|x| x.parse().unwrap()).collect())).collect()
}
