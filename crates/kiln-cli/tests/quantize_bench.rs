//! `kiln quantize`, `kiln dev random-model` and `kiln bench` through the
//! binary, on the CPU. The per-tensor type tables are checked in
//! kiln-models/tests/quantize.rs; here the commands, their output and errors.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn stories() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/stories260K.gguf");
    assert!(p.exists(), "model not found at {}", p.display());
    p
}

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).output().expect("kiln runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs kiln and returns stdout, failing with stderr when it fails.
fn kiln_ok(args: &[&str]) -> String {
    let out = kiln(args);
    assert!(out.status.success(), "kiln {args:?} failed:\n{}", text(&out.stderr));
    text(&out.stdout)
}

/// Runs kiln expecting failure and returns stderr.
fn kiln_err(args: &[&str]) -> String {
    let out = kiln(args);
    assert!(!out.status.success(), "kiln {args:?} should fail");
    text(&out.stderr)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn quantize_writes_a_model_that_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q4km.gguf");
    let result = kiln(&["quantize", s(&stories()), s(&out), "Q4_K_M", "-t", "2"]);
    let stderr = text(&result.stderr);
    assert!(result.status.success(), "{stderr}");
    assert!(stderr.contains("quant size") && stderr.contains("35 of 47 tensor(s) required fallback"), "{stderr}");
    assert!(stderr.contains("blk.0.ffn_down.weight") && stderr.contains("converting to F16"), "{stderr}");
    let info: serde_json::Value = serde_json::from_str(&kiln_ok(&["info", s(&out), "--json"])).unwrap();
    let types: Vec<&str> = info["tensors"].as_array().unwrap().iter().map(|t| t["type"].as_str().unwrap()).collect();
    assert_eq!(types.len(), 47);
    assert!(types.contains(&"Q5_0") && types.contains(&"Q8_0") && types.contains(&"F16"), "{types:?}");
    let generated = kiln_ok(&["run", "-m", s(&out), "-p", "Once upon a time", "-n", "16", "--temp", "0", "--device", "cpu"]);
    assert!(generated.starts_with("Once upon a time") && generated.len() > "Once upon a time".len() + 10, "{generated}");
}

#[test]
fn quantize_errors_are_clear() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.gguf");
    let err = kiln_err(&["quantize", s(&stories()), s(&out), "Q7_K"]);
    assert!(err.contains("unknown quantization type 'Q7_K'") && err.contains("valid types:") && err.contains("Q4_K_M"), "{err}");
    let q8 = kiln_testdata::path("models/tiny-llama-Q8_0.gguf");
    let err = kiln_err(&["quantize", s(&q8), s(&out), "Q4_K_M"]);
    assert!(err.contains("already quantized (Q8_0)") && err.contains("--allow-requantize"), "{err}");
    kiln_ok(&["quantize", s(&q8), s(&out), "Q4_K_M", "--allow-requantize"]);
    // IQ3_XS's mix wants IQ3_XXS, which llama-quantize refuses without an importance matrix.
    let err = kiln_err(&["quantize", s(&q8), s(&out), "IQ3_XS", "--allow-requantize"]);
    assert!(err.contains("blk.0.attn_k.weight") && err.contains("IQ3_XXS") && err.contains("importance matrix"), "{err}");
    // IQ3_XXS's mix puts IQ2_S on attn_k, the first layer matrix in llama.cpp's order.
    let err = kiln_err(&["quantize", s(&q8), s(&out), "IQ3_XXS", "--allow-requantize"]);
    assert!(err.contains("blk.0.attn_k.weight") && err.contains("IQ2_S") && err.contains("importance matrix"), "{err}");
    let err = kiln_err(&["quantize", s(&dir.path().join("missing.gguf")), s(&out), "Q8_0"]);
    assert!(err.contains("cannot read") && err.contains("missing.gguf"), "{err}");
    let err = kiln_err(&["quantize", s(&stories()), s(&dir.path().join("no/dir/x.gguf")), "F16"]);
    assert!(err.contains("cannot write") && err.contains("no/dir/x.gguf"), "{err}");
    let err = kiln_err(&["quantize", s(&stories()), s(&out), "Q4_0"]);
    assert!(err.contains("blk.0.ffn_down.weight") && err.contains("172"), "{err}");
}

#[test]
fn random_model_loads_runs_and_benches() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tiny.gguf");
    kiln_ok(&["dev", "random-model", s(&out), "--shape", "tiny-qwen3", "--type", "Q4_K_M", "--seed", "3", "--layers", "3"]);
    let info: serde_json::Value = serde_json::from_str(&kiln_ok(&["info", s(&out), "--json"])).unwrap();
    assert_eq!(info["architecture"], "qwen3");
    assert_eq!(info["hparams"]["n_layer"], 3);
    assert_eq!(info["tokenizer"]["vocab_size"], 512);
    let generated = kiln_ok(&["run", "-m", s(&out), "-p", "the cat", "-n", "8", "--temp", "0", "--device", "cpu"]);
    assert!(generated.starts_with("the cat"), "{generated}");
    let table = kiln_ok(&["bench", "-m", s(&out), "-p", "16", "-n", "4", "-r", "1", "--device", "cpu"]);
    assert!(table.contains("| qwen3 ?B Q4_K - Medium"), "{table}");
    let err = kiln_err(&["dev", "random-model", s(&out), "--shape", "gpt5"]);
    assert!(err.contains("unknown shape 'gpt5'") && err.contains("llama3-8b"), "{err}");
}

/// The formats added for Ternary-Bonsai and gpt-oss, and IQ3_S, end to end on the CPU:
/// made by random-model, reported by info, run greedily.
#[test]
fn random_models_in_the_fp4_and_q2_0_formats_run() {
    let dir = tempfile::tempdir().unwrap();
    for (file_type, pure, weight_type) in [("Q2_0", false, "Q2_0"), ("NVFP4", false, "NVFP4"), ("MXFP4_MOE", true, "MXFP4"), ("IQ3_M", false, "IQ3_S")] {
        let out = dir.path().join(format!("{file_type}.gguf"));
        let mut args = vec!["dev", "random-model", s(&out), "--shape", "tiny-qwen3", "--type", file_type, "--seed", "5", "--layers", "2"];
        if pure {
            args.push("--pure");
        }
        kiln_ok(&args);
        let info: serde_json::Value = serde_json::from_str(&kiln_ok(&["info", s(&out), "--json"])).unwrap();
        let text = info.to_string();
        assert!(text.contains(&format!("\"{weight_type}\"")), "{file_type}: no {weight_type} tensor in {text}");
        let generated = kiln_ok(&["run", "-m", s(&out), "-p", "the cat", "-n", "4", "--temp", "0", "--device", "cpu"]);
        assert!(generated.starts_with("the cat"), "{file_type}: {generated}");
    }
}

/// The value of a "mean ± sd" cell.
fn mean_and_sd(cell: &str) -> (f64, f64) {
    let (m, sd) = cell.split_once(" ± ").unwrap_or_else(|| panic!("not 'mean ± sd': {cell}"));
    (m.trim().parse().unwrap(), sd.trim().parse().unwrap())
}

#[test]
fn bench_markdown_matches_llama_bench_layout() {
    let out = kiln_ok(&["bench", "-m", s(&stories()), "-p", "16", "-n", "4", "-d", "0,8", "-r", "2", "-t", "2", "--device", "cpu"]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "| model                          |       size |     params | backend    | threads |            test |                  t/s |");
    assert_eq!(lines[1], "| ------------------------------ | ---------: | ---------: | ---------- | ------: | --------------: | -------------------: |");
    let tests = ["pp16", "tg4", "pp16 @ d8", "tg4 @ d8"];
    for (line, test) in lines[2..6].iter().zip(tests) {
        let cells: Vec<&str> = line.trim_matches('|').split(" | ").map(str::trim).collect();
        assert_eq!(cells[..6], ["llama ?B all F32", "0.99 MiB", "0.26 M", "CPU", "2", test], "{line}");
        let (mean, sd) = mean_and_sd(cells[6]);
        assert!(mean > 0.0 && sd >= 0.0, "{line}");
        // Same width as llama-bench's rows (the ± counts as one column).
        assert_eq!(line.chars().count(), lines[0].chars().count(), "{line}");
    }
    assert!(lines[7].starts_with("build: kiln"), "{out}");
}

#[test]
fn bench_json_has_llama_bench_fields() {
    let out = kiln_ok(&["bench", "-m", s(&stories()), "-p", "8", "-n", "3", "-r", "3", "-o", "json", "--device", "cpu"]);
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let rows = doc.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (row, (p, n)) in rows.iter().zip([(8, 0), (0, 3)]) {
        assert_eq!((row["n_prompt"].as_u64(), row["n_gen"].as_u64(), row["n_depth"].as_u64()), (Some(p), Some(n), Some(0)));
        assert_eq!(row["model_type"], "llama ?B all F32");
        assert_eq!(row["model_size"], 1040128);
        assert_eq!(row["model_n_params"], 260032);
        assert_eq!(row["backends"], "CPU");
        let avg = row["avg_ts"].as_f64().unwrap();
        assert!(avg > 0.0 && row["stddev_ts"].as_f64().unwrap() >= 0.0, "{row}");
        let samples = row["samples_ns"].as_array().unwrap();
        assert_eq!(samples.len(), 3);
        assert!(samples.iter().all(|v| v.as_u64().unwrap() > 0));
        let ts: Vec<f64> = row["samples_ts"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        let mean = ts.iter().sum::<f64>() / ts.len() as f64;
        assert!((mean - avg).abs() <= 1e-9 * avg, "avg_ts {avg} is not the mean of {ts:?}");
        for key in ["build_commit", "cpu_info", "n_threads", "type_k", "n_gpu_layers", "test_time", "avg_ns", "stddev_ns"] {
            assert!(row.get(key).is_some(), "missing {key}");
        }
    }
}
