//! Every kind of bad input ends the `kiln` process with a clear message and a
//! non-zero exit status, never a panic.

use std::path::{Path, PathBuf};
use std::process::Command;

use kiln_gguf::{GgufFile, GgufWriter, Value};

fn kiln() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
}

fn stories() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/stories260K.gguf")
}

/// Runs kiln with `args`, expects failure with `needle` in stderr.
fn expect_error(args: &[&str], needle: &str) {
    let out = kiln().args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "kiln {args:?} succeeded; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "kiln {args:?} panicked: {stderr}");
    assert!(stderr.to_lowercase().contains(&needle.to_lowercase()), "kiln {args:?}: expected '{needle}' in: {stderr}");
}

/// A copy of stories260K with metadata and tensors edited by the closures.
fn edited_copy(dir: &Path, name: &str, kv: impl Fn(&str, &Value) -> Option<Value>, tensor: impl Fn(&str, &[u64]) -> Option<Vec<u64>>) -> PathBuf {
    let src = GgufFile::open(stories()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        if let Some(v) = kv(k, v) {
            w.add_kv(k.clone(), v);
        }
    }
    let mut kept = Vec::new();
    for t in src.tensors() {
        if let Some(dims) = tensor(&t.name, &t.dims) {
            w.add_tensor(t.name.clone(), dims, t.ty).unwrap();
            kept.push(t.clone());
        }
    }
    let path = dir.join(name);
    w.write_to_file(&path, |i, out| out.write_all(src.tensor_data(&kept[i]))).unwrap();
    path
}

fn run_args(model: &Path) -> Vec<String> {
    ["run", "-m", model.to_str().unwrap(), "-n", "4", "--temp", "0"].iter().map(|s| s.to_string()).collect()
}

fn expect_run_error(model: &Path, needle: &str) {
    let args = run_args(model);
    expect_error(&args.iter().map(String::as_str).collect::<Vec<_>>(), needle);
}

fn patched(dir: &Path, name: &str, patch: impl Fn(&mut Vec<u8>)) -> PathBuf {
    let mut bytes = std::fs::read(stories()).unwrap();
    patch(&mut bytes);
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn missing_file() {
    expect_error(&["run", "-m", "/nonexistent/model.gguf"], "/nonexistent/model.gguf");
}

#[test]
fn truncated_file() {
    let dir = tempfile::tempdir().unwrap();
    for cut in [3usize, 20, 1000, 300_000] {
        let path = patched(dir.path(), &format!("cut{cut}.gguf"), |b| b.truncate(cut));
        let out = kiln().args(run_args(&path)).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && !stderr.contains("panicked"), "cut at {cut}: {stderr}");
        assert!(stderr.contains("error:"), "cut at {cut}: {stderr}");
    }
}

#[test]
fn wrong_magic() {
    let dir = tempfile::tempdir().unwrap();
    let path = patched(dir.path(), "magic.gguf", |b| b[..4].copy_from_slice(b"GGML"));
    expect_run_error(&path, "magic");
}

#[test]
fn bad_version() {
    let dir = tempfile::tempdir().unwrap();
    let path = patched(dir.path(), "version.gguf", |b| b[4..8].copy_from_slice(&99u32.to_le_bytes()));
    expect_run_error(&path, "version");
}

#[test]
fn absurd_tensor_count() {
    let dir = tempfile::tempdir().unwrap();
    let path = patched(dir.path(), "count.gguf", |b| b[8..16].copy_from_slice(&(u64::MAX / 3).to_le_bytes()));
    let out = kiln().args(run_args(&path)).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !stderr.contains("panicked") && stderr.contains("error:"), "{stderr}");
}

/// Offset of the type field of tensor `name` in the header.
fn type_field_offset(bytes: &[u8], name: &str) -> usize {
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(name.as_bytes());
    let at = bytes.windows(needle.len()).position(|w| w == needle).unwrap() + needle.len();
    let n_dims = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    at + 4 + 8 * n_dims
}

#[test]
fn unknown_tensor_type() {
    let dir = tempfile::tempdir().unwrap();
    let path = patched(dir.path(), "type.gguf", |b| {
        let at = type_field_offset(b, "blk.0.attn_q.weight");
        b[at..at + 4].copy_from_slice(&77u32.to_le_bytes());
    });
    expect_run_error(&path, "blk.0.attn_q.weight");
    expect_run_error(&path, "77");
}

#[test]
fn out_of_range_offset() {
    let dir = tempfile::tempdir().unwrap();
    let path = patched(dir.path(), "offset.gguf", |b| {
        let at = type_field_offset(b, "output_norm.weight") + 4;
        b[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    });
    expect_run_error(&path, "output_norm.weight");
}

#[test]
fn unknown_architecture() {
    let dir = tempfile::tempdir().unwrap();
    let path = edited_copy(
        dir.path(),
        "arch.gguf",
        |k, v| Some(if k == "general.architecture" { Value::String("mamba9".into()) } else { v.clone() }),
        |_, d| Some(d.to_vec()),
    );
    expect_run_error(&path, "unsupported architecture 'mamba9'");
}

#[test]
fn missing_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = edited_copy(dir.path(), "missing.gguf", |_, v| Some(v.clone()), |n, d| (n != "blk.3.ffn_up.weight").then(|| d.to_vec()));
    expect_run_error(&path, "blk.3.ffn_up.weight");
}

#[test]
fn wrong_shape() {
    let dir = tempfile::tempdir().unwrap();
    let path =
        edited_copy(dir.path(), "shape.gguf", |_, v| Some(v.clone()), |n, d| Some(if n == "blk.1.ffn_gate.weight" { vec![d[1], d[0]] } else { d.to_vec() }));
    expect_run_error(&path, "blk.1.ffn_gate.weight");
}

#[test]
fn missing_hyper_parameter() {
    let dir = tempfile::tempdir().unwrap();
    let path = edited_copy(dir.path(), "hparam.gguf", |k, v| (k != "llama.block_count").then(|| v.clone()), |_, d| Some(d.to_vec()));
    expect_run_error(&path, "llama.block_count");
}

#[test]
fn sampling_flags_must_be_finite() {
    let model = stories();
    let model = model.to_str().unwrap();
    for (flag, value, needle) in [
        ("--temp", "nan", "finite"),
        ("--top-p", "inf", "finite"),
        ("--min-p", "x", "not a number"),
        ("--repeat-penalty", "0", "greater than 0"),
        ("--repeat-penalty", "-1.5", "greater than 0"),
    ] {
        expect_error(&["run", "-m", model, "-n", "2", &format!("{flag}={value}")], needle);
    }
}

#[test]
fn prompt_longer_than_context() {
    let model = stories();
    let long = "Once upon a time there was a little girl who liked to play in the park every day.";
    expect_error(&["run", "-m", model.to_str().unwrap(), "-c", "8", "-p", long, "-n", "4"], "context");
}

#[test]
fn shipped_model_runs_with_defaults() {
    let out = kiln().args(["run", "-n", "24", "--temp", "0"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.starts_with("Once upon a time") && stdout.len() > "Once upon a time".len() + 20, "{stdout}");
    assert!(stderr.contains("tokens/s"), "{stderr}");
}

#[test]
fn same_seed_same_output() {
    let args = ["run", "-n", "40", "--temp", "0.9", "-s", "1234", "--repeat-penalty", "1.1"];
    let a = kiln().args(args).output().unwrap();
    let b = kiln().args(args).output().unwrap();
    assert!(a.status.success());
    assert_eq!(a.stdout, b.stdout);
    let c = kiln().args(["run", "-n", "40", "--temp", "0.9", "-s", "99"]).output().unwrap();
    assert_ne!(a.stdout, c.stdout, "different seeds should differ");
}

/// `-tp N` that the model or the host cannot take is refused before anything runs; one that
/// fits runs on the CPU's simulated ranks and prints the unsplit model's greedy text.
#[test]
fn tensor_parallel_splits_are_checked() {
    let model = stories();
    let m = model.to_str().unwrap();
    expect_error(&["run", "-m", m, "-tp", "3", "--device", "cpu", "-n", "4"], "8 query heads");
    expect_error(&["run", "-m", m, "-tp", "0", "--device", "cpu", "-n", "4"], "at least one rank");
    expect_error(&["bench", "-m", m, "-tp", "3", "--device", "cpu", "-p", "8", "-n", "0", "-r", "1"], "cannot split the model over 3 ranks");
    let text = |extra: &[&str]| {
        let out = kiln().args(["run", "-m", m, "--device", "cpu", "-n", "12", "--temp", "0"]).args(extra).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    assert_eq!(text(&["-tp", "2"]), text(&[]));
}
