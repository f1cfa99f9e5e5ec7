//! `kiln perplexity`: against the model's own logits, against the float64 references of
//! testdata, KL divergence, and bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;

use kiln_core::CpuBackend;
use kiln_gguf::GgufFile;
use kiln_models::{Logits, Model, ModelOptions};
use kiln_tokenizer::Tokenizer;
use serde_json::Value;

const TEXT: &str = "Once upon a time, there was a little girl named Lily. She liked to play in the park with her big red ball. ";

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).output().unwrap()
}

fn ok(args: &[&str]) -> String {
    let out = kiln(args);
    assert!(out.status.success(), "kiln {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// The command fails with a message containing `needle`, and does not panic.
fn fails_with(args: &[&str], needle: &str) {
    let out = kiln(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "kiln {args:?} succeeded");
    assert!(!err.contains("panicked"), "kiln {args:?} panicked: {err}");
    assert!(err.contains(needle), "kiln {args:?}: expected '{needle}' in: {err}");
}

/// The number after `label` in `out`.
fn value_after(out: &str, label: &str) -> f64 {
    let rest = &out[out.find(label).unwrap_or_else(|| panic!("no '{label}' in: {out}")) + label.len()..];
    rest.split_whitespace().next().unwrap().parse().unwrap()
}

fn ppl(out: &str) -> f64 {
    value_after(out, "Final estimate: PPL =")
}

fn model(name: &str) -> PathBuf {
    kiln_testdata::path(&format!("models/{name}"))
}

fn write_text(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// Perplexity of the second half of each chunk, from `[n_ctx][n_vocab]` logits per chunk.
fn ppl_from_logits(chunks: &[(Vec<u32>, Vec<f64>)]) -> f64 {
    let (mut nll, mut n) = (0.0, 0);
    for (tokens, logits) in chunks {
        let n_ctx = tokens.len();
        let n_vocab = logits.len() / n_ctx;
        for i in n_ctx / 2..n_ctx - 1 {
            let row = &logits[i * n_vocab..(i + 1) * n_vocab];
            let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let log_z = max + row.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
            nll += log_z - row[tokens[i + 1] as usize];
            n += 1;
        }
    }
    (nll / n as f64).exp()
}

#[test]
fn perplexity_equals_the_one_from_the_models_own_logits() {
    let dir = tempfile::tempdir().unwrap();
    let text = TEXT.repeat(4);
    let txt = write_text(dir.path(), "t.txt", &text);
    let path = model("tiny-llama-Q8_0.gguf");
    let (n_ctx, n_chunks) = (32, 3);
    // -b 8: each chunk is fed in four passes; the test feeds it in one.
    let out = ok(&["perplexity", "-m", path.to_str().unwrap(), "-f", txt.to_str().unwrap(), "-c", "32", "-b", "8", "--chunks", "3", "--device", "cpu"]);
    assert!(out.contains("[3]") && !out.contains("[4]"), "three chunks: {out}");

    let file = Arc::new(GgufFile::open(&path).unwrap());
    let tokens = Tokenizer::from_gguf(&file).unwrap().encode(&text, true, false);
    assert!(tokens.len() >= n_ctx * (n_chunks + 1), "the text must have more chunks than --chunks keeps");
    let options = ModelOptions { n_ctx: Some(n_ctx), n_batch: n_ctx, all_logits: true, ..Default::default() };
    let mut m = Model::load(Arc::new(CpuBackend::new()), file, &options).unwrap();
    let chunks: Vec<(Vec<u32>, Vec<f64>)> = tokens
        .chunks_exact(n_ctx)
        .take(n_chunks)
        .map(|c| {
            let mut c = c.to_vec();
            c[0] = 1;
            m.reset();
            let logits = m.forward(&c, Logits::All).unwrap().iter().map(|&v| v as f64).collect();
            (c, logits)
        })
        .collect();
    let want = ppl_from_logits(&chunks);
    let got = ppl(&out);
    assert!(((got - want) / want).abs() < 1e-5, "kiln perplexity {got}, from the model's logits {want}");
    // The running value after the last chunk is the final one.
    let last: f64 = out.split("[3]").nth(1).and_then(|r| r.split(',').next()).unwrap().parse().unwrap();
    assert!((last - got).abs() <= 1e-4 * got, "{out}");
}

/// Over exactly the reference's tokens (one chunk), the exact CPU path with an f32 cache gives
/// the perplexity of the float64 reference logits; they agree to ~1e-6 relative, so 1e-4 on
/// the perplexity is far from flaky yet catches any off-by-one in the scored positions.
#[test]
fn perplexity_matches_the_float64_references() {
    let dir = tempfile::tempdir().unwrap();
    let files = [
        kiln_testdata::path("models/tiny-llama-Q8_0.ref.json"),
        kiln_testdata::path("models/tiny-qwen3-Q4_K.ref.json"),
        kiln_testdata::path("archs/tiny-qwen35-Q8_0.gguf.ref.json"),
        kiln_testdata::path("archs/tiny-gemma3-Q8_0.gguf.ref.json"),
        kiln_testdata::path("archs/tiny-gpt-oss-MXFP4.gguf.ref.json"),
    ];
    for json in files {
        let r: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        // models/X.ref.json and archs/X.gguf.ref.json both describe X.gguf.
        let stem = json.to_str().unwrap().trim_end_matches(".ref.json").trim_end_matches(".gguf");
        let gguf = PathBuf::from(format!("{stem}.gguf"));
        let tokens: Vec<u32> = r["tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let text = r["text"].as_str().unwrap();
        let file = GgufFile::open(&gguf).unwrap();
        assert_eq!(Tokenizer::from_gguf(&file).unwrap().encode(text, true, false), tokens, "{}: kiln must tokenize the text as the reference", gguf.display());
        let logits: Vec<f64> = r["logits"].as_array().unwrap().iter().flat_map(|row| row.as_array().unwrap().iter().map(|v| v.as_f64().unwrap())).collect();
        let want = ppl_from_logits(&[(tokens.clone(), logits)]);
        let txt = write_text(dir.path(), "ref.txt", text);
        let c = tokens.len().to_string();
        let args = [
            "perplexity",
            "-m",
            gguf.to_str().unwrap(),
            "-f",
            txt.to_str().unwrap(),
            "-c",
            &c,
            "--device",
            "cpu",
            "--cpu-matmul",
            "exact",
            "-ctk",
            "f32",
            "-ctv",
            "f32",
        ];
        let got = ppl(&ok(&args));
        let rel = ((got - want) / want).abs();
        println!("{}: PPL {got} reference {want} rel {rel:.2e}", gguf.display());
        assert!(rel < 1e-4, "{}: kiln {got}, reference {want}", gguf.display());
    }
}

#[test]
fn kl_divergence_is_zero_against_its_own_base_and_positive_against_another_quant() {
    let dir = tempfile::tempdir().unwrap();
    let txt = write_text(dir.path(), "t.txt", &TEXT.repeat(3));
    let base = dir.path().join("base.bin");
    let (q8, q4) = (model("tiny-llama-Q8_0.gguf"), model("tiny-llama-Q4_0.gguf"));
    let b = base.to_str().unwrap();
    let made = ok(&["perplexity", "-m", q8.to_str().unwrap(), "-f", txt.to_str().unwrap(), "-c", "24", "--device", "cpu", "--kl-divergence-base", b]);
    let same = ok(&["perplexity", "-m", q8.to_str().unwrap(), "--device", "cpu", "--kl-divergence-base", b, "--kl-divergence"]);
    let kld = value_after(&same, "Mean    KLD:");
    assert!(kld.abs() < 1e-6, "{same}");
    assert_eq!(value_after(&same, "Same top p:"), 100.0, "{same}");
    assert!((ppl(&same) - ppl(&made)).abs() < 1e-9 * ppl(&made), "the base's tokens give the same perplexity: {made} vs {same}");
    assert!((value_after(&same, "Mean PPL(base)                :") - ppl(&made)).abs() < 1e-4 * ppl(&made), "{same}");

    let other = ok(&["perplexity", "-m", q4.to_str().unwrap(), "--device", "cpu", "--kl-divergence-base", b, "--kl-divergence"]);
    let kld = value_after(&other, "Mean    KLD:");
    assert!(kld.is_finite() && kld > 1e-3, "{other}");
    let top = value_after(&other, "Same top p:");
    assert!(top > 0.0 && top < 100.0, "{other}");
    let ratio = value_after(&other, "Mean PPL(Q)/PPL(base)         :");
    assert!((ratio - ppl(&other) / ppl(&made)).abs() < 1e-4 * ratio, "{other}");
}

#[test]
fn bad_input_gives_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let q8 = model("tiny-llama-Q8_0.gguf");
    let m = q8.to_str().unwrap();
    let txt = write_text(dir.path(), "t.txt", &TEXT.repeat(2));
    let t = txt.to_str().unwrap();
    fails_with(&["perplexity", "-m", "/nonexistent/model.gguf", "-f", t, "--device", "cpu"], "/nonexistent/model.gguf");
    fails_with(&["perplexity", "-m", m, "-f", "/nonexistent/text.txt", "--device", "cpu"], "/nonexistent/text.txt");
    fails_with(&["perplexity", "-m", m, "--device", "cpu"], "no text to score");
    fails_with(&["perplexity", "-m", m, "-f", t, "--device", "cpu"], "fewer than one chunk of 512");
    fails_with(&["perplexity", "-m", m, "-f", t, "-c", "2", "--device", "cpu"], "at least 3 tokens");
    fails_with(&["perplexity", "-m", m, "--kl-divergence", "--device", "cpu"], "--kl-divergence-base");

    let base = dir.path().join("base.bin");
    let b = base.to_str().unwrap();
    ok(&["perplexity", "-m", m, "-f", t, "-c", "16", "--device", "cpu", "--kl-divergence-base", b]);
    let good = std::fs::read(&base).unwrap();
    let kl = ["perplexity", "-m", m, "--device", "cpu", "--kl-divergence-base", b, "--kl-divergence"];
    fails_with(&["perplexity", "-m", m, "-c", "32", "--device", "cpu", "--kl-divergence-base", b, "--kl-divergence"], "chunks of 16 tokens, but -c is 32");

    let mut other_vocab = good.clone();
    other_vocab[8..12].copy_from_slice(&1000u32.to_le_bytes());
    std::fs::write(&base, &other_vocab).unwrap();
    fails_with(&kl, "vocabulary of 1000 tokens, this model 512");

    std::fs::write(&base, &good[..good.len() - 4]).unwrap();
    fails_with(&kl, "bytes, but");

    let mut other_count = good.clone();
    other_count[16..20].copy_from_slice(&7u32.to_le_bytes());
    std::fs::write(&base, &other_count).unwrap();
    fails_with(&kl, "7 chunks of 16 tokens");

    std::fs::write(&base, b"not a base file at all").unwrap();
    fails_with(&kl, "not a kiln KL-divergence base file");
}
