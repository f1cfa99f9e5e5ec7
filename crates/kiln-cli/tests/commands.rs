//! `kiln info` and `kiln tokenize` on the shipped model.

use std::path::{Path, PathBuf};
use std::process::Command;

fn stories() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/stories260K.gguf")
}

fn kiln(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).output().unwrap();
    assert!(out.status.success(), "kiln {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn info_json_describes_the_model() {
    let doc: serde_json::Value = serde_json::from_str(&kiln(&["info", stories().to_str().unwrap(), "--json"])).unwrap();
    assert_eq!(doc["architecture"], "llama");
    assert_eq!(doc["hparams"]["n_layer"], 5);
    assert_eq!(doc["hparams"]["n_head_kv"], 4);
    assert_eq!(doc["tokenizer"]["vocab_size"], 512);
    assert_eq!(doc["tensors"].as_array().unwrap().len(), 47);
    let embd = doc["tensors"].as_array().unwrap().iter().find(|t| t["name"] == "token_embd.weight").unwrap();
    assert_eq!(embd["shape"], serde_json::json!([64, 512]));
    assert_eq!(embd["type"], "F32");
}

#[test]
fn info_text_lists_tensors() {
    let text = kiln(&["info", stories().to_str().unwrap()]);
    assert!(text.contains("architecture: llama"), "{text}");
    assert!(text.contains("blk.4.ffn_down.weight"), "{text}");
}

#[test]
fn tokenize_matches_reference_ids() {
    // Ids from shared/testdata/models/stories260K.ref.json (BOS + llama.cpp's tokenization).
    let text = "One day, Lily found a big red ball in the park.";
    let ids = kiln(&["tokenize", "-m", stories().to_str().unwrap(), "-p", text, "--ids"]);
    let reference = kiln_testdata::path("models/stories260K.ref.json");
    let raw = std::fs::read_to_string(&reference).unwrap_or_else(|e| panic!("{}: {e}", reference.display()));
    let r: serde_json::Value = serde_json::from_str(&raw).unwrap();
    let want: Vec<String> = r["tokens"].as_array().unwrap().iter().map(|v| v.to_string()).collect();
    assert_eq!(ids.trim(), format!("[{}]", want.join(", ")));
}
