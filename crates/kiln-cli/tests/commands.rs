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

/// `kiln run --json` prints one object with the token ids, the text, a finish reason that
/// agrees with the count and `-n`, and timings; greedy runs agree with each other.
#[test]
fn run_json_reports_tokens_text_and_finish_reason() {
    let model = stories();
    let args = ["run", "-m", model.to_str().unwrap(), "--device", "cpu", "--temp", "0", "-n", "12", "-p", "Once upon a time", "--json"];
    let out = kiln(&args);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    let generated = v["generated_tokens"].as_array().unwrap();
    assert!(generated.len() <= 12 && !generated.is_empty());
    if generated.len() < 12 {
        assert_eq!(v["finish_reason"], "stop");
    } else {
        assert_eq!(v["finish_reason"], "length");
    }
    assert!(v["prompt_tokens"].as_array().unwrap().len() > 1);
    assert!(!v["text"].as_str().unwrap().is_empty());
    assert!(v["timings"]["generation_tokens_per_second"].as_f64().unwrap() > 0.0);
    let again: serde_json::Value = serde_json::from_str(kiln(&args).trim()).unwrap();
    assert_eq!((&again["generated_tokens"], &again["text"]), (&v["generated_tokens"], &v["text"]), "greedy runs differ");
}
