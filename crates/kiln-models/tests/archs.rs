//! The CPU engine on the new architectures of `testdata/archs` (mixture of experts, Gemma 3, ...)
//! against float64 transformers references computed from each file's own weights.
//!
//! Tolerance (testdata/archs README, "Suggested use"): the CPU backend computes in f32 on
//! exactly dequantized weights, so the logits must agree at the F32 level, rel_l2 <= 1e-5
//! (llama.cpp on its own F32 dequantization lands at 2e-7..2e-6), and every one of the 32 greedy
//! tokens must be the reference's (their margins, >= 0.0089, are far above that error).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_core::{CpuBackend, KvType, SamplingParams};
use kiln_gguf::{GgmlType, GgufFile, GgufWriter};
use kiln_models::checks::{compare, run_alone, run_staggered};
use kiln_models::{EngineOptions, FfnWeights, Logits, Model, ModelError, ModelOptions, SharedExpert, Weights};
use serde_json::Value;

const REL_L2: f64 = 1e-5;

/// The families of testdata/archs that kiln runs (all of them).
const SUPPORTED: &[&str] = &["qwen3moe", "mixtral", "gemma3", "gemma4", "gemma4moe", "gpt-oss", "qwen35", "qwen35moe"];

fn files() -> Vec<PathBuf> {
    let dir = kiln_testdata::path("archs");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "gguf")).collect();
    files.sort();
    assert!(files.len() >= 16, "expected the 16 files of testdata/archs, found {}", files.len());
    files
}

/// `tiny-<family>-<type>.gguf` → family.
fn family(path: &Path) -> String {
    let name = path.file_stem().unwrap().to_string_lossy();
    let rest = name.strip_prefix("tiny-").unwrap();
    rest[..rest.rfind('-').unwrap()].to_string()
}

fn supported() -> Vec<(PathBuf, Value)> {
    files()
        .into_iter()
        .filter(|p| SUPPORTED.contains(&family(p).as_str()))
        .map(|p| {
            let json = PathBuf::from(format!("{}.ref.json", p.display()));
            let r = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
            (p, r)
        })
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn load(path: &Path, all_logits: bool) -> Model<CpuBackend> {
    load_on(CpuBackend::exact(), path, all_logits)
}

fn load_on(backend: CpuBackend, path: &Path, all_logits: bool) -> Model<CpuBackend> {
    let file = Arc::new(GgufFile::open(path).unwrap());
    // f32 KV: the references are float64 and the tolerance is that of f32 compute.
    let options = ModelOptions { n_ctx: Some(128), n_batch: 64, all_logits, k_type: KvType::F32, v_type: KvType::F32, ..Default::default() };
    Model::load(Arc::new(backend), file, &options).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn teacher_forced_logits_match_reference() {
    let mut report = Vec::new();
    for (path, r) in supported() {
        let tokens = ids(&r["tokens"]);
        let got = load(&path, true).forward(&tokens, Logits::All).unwrap().to_vec();
        let want: Vec<f64> = r["logits"].as_array().unwrap().iter().flat_map(|row| row.as_array().unwrap().iter().map(|x| x.as_f64().unwrap())).collect();
        assert_eq!(got.len(), want.len());
        let diff2: f64 = got.iter().zip(&want).map(|(g, w)| (*g as f64 - w).powi(2)).sum();
        let ref2: f64 = want.iter().map(|w| w * w).sum();
        let max_abs = got.iter().zip(&want).map(|(g, w)| (*g as f64 - w).abs()).fold(0.0, f64::max);
        let rel = (diff2 / ref2).sqrt();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        report.push(format!("{name:28} rel_l2 {rel:.2e} max_abs {max_abs:.2e}"));
        assert!(rel <= REL_L2, "{name}: rel_l2 {rel:.3e} max_abs {max_abs:.3e}");
        let n_vocab = got.len() / tokens.len();
        for (i, want_id) in ids(&r["argmax"]).into_iter().enumerate() {
            assert_eq!(kiln_core::sampling::argmax(&got[i * n_vocab..(i + 1) * n_vocab]), want_id, "{name}: argmax at position {i}");
        }
    }
    println!("{}", report.join("\n"));
}

/// The fast backend (8-bit activations; expert products included) against llama.cpp's CPU
/// backend, which also rounds activations to 8 bits, on the same files (the figures in each
/// ref.json). A few positions of the MoE files flip a routing decision under any such rounding
/// and dominate rel_l2 (llama.cpp's own max_abs reaches 4.4 at one position), so rel_l2 may be
/// up to 3x llama.cpp's; the typical position, the median of the per-position max_abs, which a
/// systematic error would raise everywhere, must stay within 1.5x of llama.cpp's.
#[test]
fn quantized_activations_stay_within_llama_cpp_error() {
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut report = Vec::new();
    for (path, r) in supported() {
        let tokens = ids(&r["tokens"]);
        let got = load_on(CpuBackend::new(), &path, true).forward(&tokens, Logits::All).unwrap().to_vec();
        let want: Vec<f64> = r["logits"].as_array().unwrap().iter().flat_map(|row| row.as_array().unwrap().iter().map(|x| x.as_f64().unwrap())).collect();
        let diff2: f64 = got.iter().zip(&want).map(|(g, w)| (*g as f64 - w).powi(2)).sum();
        let ref2: f64 = want.iter().map(|w| w * w).sum();
        let rel = (diff2 / ref2).sqrt();
        let n_vocab = got.len() / tokens.len();
        let per_position: Vec<f64> = (0..tokens.len())
            .map(|i| {
                got[i * n_vocab..(i + 1) * n_vocab].iter().zip(&want[i * n_vocab..(i + 1) * n_vocab]).map(|(g, w)| (*g as f64 - w).abs()).fold(0.0, f64::max)
            })
            .collect();
        let theirs = &r["llamacpp"];
        let their_rel = theirs["rel_l2"].as_f64().unwrap();
        let their_median = median(theirs["max_abs_per_position"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect());
        let ours_median = median(per_position);
        let ok = rel <= 3.0 * their_rel && ours_median <= 1.5 * their_median;
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        report.push(format!(
            "{name:28} rel_l2 {rel:.2e} (llama.cpp {their_rel:.2e})  median max_abs {ours_median:.2} (llama.cpp {their_median:.2}){}",
            if ok { "" } else { "  OVER" }
        ));
    }
    println!("{}", report.join("\n"));
    assert!(!report.iter().any(|line| line.ends_with("OVER")), "{}", report.join("\n"));
}

#[test]
fn greedy_continuations_match_reference() {
    for (path, r) in supported() {
        let want = ids(&r["greedy"]["tokens"]);
        let mut model = load(&path, false);
        let greedy = SamplingParams::greedy();
        let mut got = vec![model.prompt(&ids(&r["greedy"]["prompt_tokens"]), &greedy).unwrap()];
        while got.len() < want.len() {
            got.push(model.decode_sample(*got.last().unwrap(), &greedy).unwrap());
        }
        assert_eq!(got, want, "{}", path.display());
    }
}

/// Every file of testdata/archs is supported; a file of an architecture kiln does not know
/// (here qwen35's file with its architecture renamed in place) is refused at load by name.
#[test]
fn unknown_architectures_are_refused_by_name() {
    assert_eq!(supported().len(), files().len(), "a file of testdata/archs is not in SUPPORTED");
    let mut bytes = std::fs::read(kiln_testdata::path("archs/tiny-qwen35-Q8_0.gguf")).unwrap();
    let key = b"general.architecture";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 4 + 8;
    assert_eq!(&bytes[at..at + 6], b"qwen35");
    bytes[at..at + 6].copy_from_slice(b"qwen99");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("renamed.gguf");
    std::fs::write(&path, bytes).unwrap();
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let err = Weights::load(&CpuBackend::exact(), &file).err().expect("an unknown architecture loaded");
    assert!(matches!(&err, ModelError::UnsupportedArch(a) if a == "qwen99"), "{err}");
    assert!(err.to_string().contains("unsupported architecture 'qwen99'"), "{err}");
}

/// Sequences of mixed lengths, shorter and longer than the sliding window and the KV block,
/// batched together give exactly what each gives alone (the CPU computes every row alike): on
/// sliding-window models (gemma4 also with KV sharing and per-layer cache widths, gpt-oss with
/// sinks), MoE ones and the hybrids, whose recurrent states live in per-sequence slots.
#[test]
fn batched_equals_alone_on_sliding_window_and_moe_models() {
    let models = [
        "tiny-gemma3-Q4_K.gguf",
        "tiny-gemma4-Q8_0.gguf",
        "tiny-gemma4moe-Q4_K.gguf",
        "tiny-gpt-oss-MXFP4.gguf",
        "tiny-qwen3moe-Q8_0.gguf",
        "tiny-qwen35-Q4_K.gguf",
        "tiny-qwen35moe-Q8_0.gguf",
    ];
    for name in models {
        let path = kiln_testdata::path("archs").join(name);
        let backend = Arc::new(CpuBackend::exact());
        let weights = Arc::new(Weights::load(&*backend, &Arc::new(GgufFile::open(&path).unwrap())).unwrap());
        let prompts: Vec<Vec<u32>> = [1usize, 5, 9, 33, 47].iter().map(|&n| (0..n).map(|i| (i * 37 % 511 + 1) as u32).collect()).collect();
        for kv in [KvType::F32, KvType::F16] {
            let options = EngineOptions { max_seq_len: 96, max_batch_tokens: 128, k_type: kv, v_type: kv, ..EngineOptions::default() };
            let batched = run_staggered(&backend, &weights, &options, &prompts, 12).unwrap();
            for (prompt, b) in prompts.iter().zip(&batched) {
                let alone = run_alone(&backend, &weights, &options, prompt, 12).unwrap();
                let (max_abs, _) = compare(&alone, b, 0.0);
                assert_eq!(max_abs, 0.0, "{name} {kv}: prompt of {}: logits differ by {max_abs}", prompt.len());
                assert_eq!(alone.tokens, b.tokens, "{name} {kv}: prompt of {}", prompt.len());
            }
        }
    }
}

/// A hybrid model's prompt fed in chunks of every size (the recurrent state carried from step to
/// step) gives the logits of the prompt fed at once, to f32 rounding (each step's span runs the
/// delta rule in chunks of its own, one token at a time for spans of one: measured 5e-7 to
/// 1.1e-6), and a sequence truncated to a prefix and continued (its recurrent state cannot
/// rewind, so it is fed again) gives exactly those of the whole sequence fed from scratch.
#[test]
fn hybrid_state_carries_across_chunks_and_truncation() {
    let path = kiln_testdata::path("archs/tiny-qwen35-Q8_0.gguf");
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let r: Value = serde_json::from_str(&std::fs::read_to_string(format!("{}.ref.json", path.display())).unwrap()).unwrap();
    let tokens = ids(&r["tokens"]);
    let model = |n_batch| {
        let options = ModelOptions { n_ctx: Some(128), n_batch, k_type: KvType::F32, v_type: KvType::F32, ..Default::default() };
        Model::load(Arc::new(CpuBackend::exact()), file.clone(), &options).unwrap()
    };
    let whole = model(64).forward(&tokens, Logits::Last).unwrap().to_vec();
    for n_batch in [1, 3, 8, 33] {
        let chunked = model(n_batch).forward(&tokens, Logits::Last).unwrap().to_vec();
        let diff2: f64 = chunked.iter().zip(&whole).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum();
        let rel = (diff2 / whole.iter().map(|&w| w as f64 * w as f64).sum::<f64>()).sqrt();
        println!("prefill in chunks of {n_batch}: rel_l2 {rel:.2e}");
        assert!(rel <= REL_L2, "prefill in chunks of {n_batch}: rel_l2 {rel:.3e}");
    }
    let mut reused = model(64);
    reused.forward(&tokens[..20], Logits::Last).unwrap();
    reused.forward(&[7, 8, 9], Logits::Last).unwrap();
    reused.truncate(20);
    let got = reused.forward(&tokens[20..], Logits::Last).unwrap().to_vec();
    assert_eq!(got, whole, "continued after truncation");
    assert_eq!(reused.cached_tokens(), &tokens[..]);
}

/// Qwen3.5's shared expert runs as one more routed expert where its matrices share the routed
/// experts' formats (every layer of tiny-qwen35moe), and as its own FFN beside them where they
/// do not (here: the same file with each shared down product stored as F32, its dequantized
/// values, so the model is the same one). Both forms give the same logits to f32 rounding (the
/// weighted sum adds the shared output in another order) and the same greedy tokens.
#[test]
fn a_shared_expert_routed_or_apart_gives_the_same_model() {
    let path = kiln_testdata::path("archs").join("tiny-qwen35moe-Q8_0.gguf");
    let file = Arc::new(GgufFile::open(&path).unwrap());
    // Each shared down product as F32 of its dequantized values.
    let apart_file = rewritten(&file, |t, data| {
        if !t.name.ends_with("ffn_down_shexp.weight") {
            return None;
        }
        let mut values = vec![0f32; t.n_elements() as usize];
        kiln_quant::dequantize(t.ty, data, &mut values).unwrap();
        Some((t.dims.clone(), GgmlType::F32, values.iter().flat_map(|v| v.to_le_bytes()).collect()))
    });
    let backend = CpuBackend::exact();
    let shared_forms = |file: &Arc<GgufFile>| -> Vec<bool> {
        let weights = Weights::load(&backend, file).unwrap();
        weights
            .layers
            .iter()
            .filter_map(|l| if let FfnWeights::Moe(m) = &l.ffn { Some(matches!(m.shared, Some(SharedExpert::Routed))) } else { None })
            .collect()
    };
    let (routed_forms, apart_forms) = (shared_forms(&file), shared_forms(&apart_file));
    assert!(!routed_forms.is_empty() && routed_forms.iter().all(|&r| r), "routed in every layer: {routed_forms:?}");
    assert!(apart_forms.iter().all(|&r| !r), "apart in every layer: {apart_forms:?}");

    let options = ModelOptions { n_ctx: Some(128), n_batch: 64, all_logits: true, k_type: KvType::F32, v_type: KvType::F32, ..Default::default() };
    let mut routed = Model::load(Arc::new(CpuBackend::exact()), file, &options).unwrap();
    let mut apart = Model::load(Arc::new(CpuBackend::exact()), apart_file, &options).unwrap();
    let prompt: Vec<u32> = (0..29).map(|i| (i * 53 % 509 + 1) as u32).collect();
    let want = apart.forward(&prompt, Logits::All).unwrap().to_vec();
    let got = routed.forward(&prompt, Logits::All).unwrap().to_vec();
    let diff2: f64 = got.iter().zip(&want).map(|(g, w)| (*g as f64 - *w as f64).powi(2)).sum();
    let ref2: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
    let rel = (diff2 / ref2).sqrt();
    assert!(rel <= REL_L2, "routed vs apart shared expert: rel_l2 {rel:.3e}");
    let (routed_tokens, apart_tokens) = (greedy_tokens(&mut routed, &prompt, 16), greedy_tokens(&mut apart, &prompt, 16));
    assert_eq!(routed_tokens, apart_tokens);
}

fn greedy_tokens(model: &mut Model<CpuBackend>, prompt: &[u32], n: usize) -> Vec<u32> {
    model.reset();
    let mut tokens = vec![model.prompt(prompt, &SamplingParams::greedy()).unwrap()];
    while tokens.len() < n {
        let last = *tokens.last().unwrap();
        tokens.push(model.prompt(&[last], &SamplingParams::greedy()).unwrap());
    }
    tokens
}

/// A routed shared expert's gate row may be a vector or a one-row matrix; a gate row of the
/// wrong width is refused by name.
#[test]
fn a_shared_expert_gate_row_of_another_shape_loads_or_is_refused_by_name() {
    let file = Arc::new(GgufFile::open(kiln_testdata::path("archs").join("tiny-qwen35moe-Q8_0.gguf")).unwrap());
    let gate_row = |t: &kiln_gguf::TensorInfo| t.name == "blk.0.ffn_gate_inp_shexp.weight";
    let as_matrix = rewritten(&file, |t, data| gate_row(t).then(|| (vec![t.dims[0], 1], t.ty, data.to_vec())));
    let backend = CpuBackend::exact();
    let weights = Weights::load(&backend, &as_matrix).unwrap();
    let FfnWeights::Moe(m) = &weights.layers[0].ffn else { panic!("layer 0 is a MoE layer") };
    assert!(matches!(m.shared, Some(SharedExpert::Routed)));
    let short = rewritten(&file, |t, data| gate_row(t).then(|| (vec![t.dims[0] / 2], t.ty, data[..data.len() / 2].to_vec())));
    match Weights::load(&backend, &short) {
        Err(ModelError::WrongShape { name, .. }) => assert_eq!(name, "blk.0.ffn_gate_inp_shexp.weight"),
        Err(e) => panic!("expected a wrong shape of the gate row, got {e}"),
        Ok(_) => panic!("a gate row of half the width loaded"),
    }
}

/// `file` written again in memory, each tensor for which `change` gives (dims, type, bytes)
/// replaced by them.
fn rewritten(file: &GgufFile, change: impl Fn(&kiln_gguf::TensorInfo, &[u8]) -> Option<(Vec<u64>, GgmlType, Vec<u8>)>) -> Arc<GgufFile> {
    let mut writer = GgufWriter::new();
    for (key, value) in file.metadata() {
        writer.add_kv(key.clone(), value.clone());
    }
    let changed: Vec<_> = file.tensors().iter().map(|t| change(t, file.tensor_data(t))).collect();
    for (t, c) in file.tensors().iter().zip(&changed) {
        let (dims, ty) = c.as_ref().map_or((t.dims.clone(), t.ty), |(dims, ty, _)| (dims.clone(), *ty));
        writer.add_tensor(t.name.clone(), dims, ty).unwrap();
    }
    let bytes = writer
        .to_bytes(|i, out| match &changed[i] {
            Some((_, _, bytes)) => out.write_all(bytes),
            None => out.write_all(file.tensor_data(&file.tensors()[i])),
        })
        .unwrap();
    Arc::new(GgufFile::from_bytes(bytes).unwrap())
}
