//! Tensor parallelism simulated on the CPU: N ranks as threads, each with its slice of the
//! weights and KV cache, the all-reduce a sum on the host. Sharded logits must equal the
//! unsharded model's and greedy tokens must match, for 2 and 4 ranks (4 ranks on the tiny
//! models replicate their 2 KV heads).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_core::{CpuBackend, GroupHandle, HostAllReduce, KvType, SamplingParams};
use kiln_gguf::GgufFile;
use kiln_models::checks::{run_staggered, run_staggered_on};
use kiln_models::{tensor_parallel, EngineOptions, Logits, Model, ModelError, ModelOptions, Shard};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn testdata_model(name: &str) -> PathBuf {
    kiln_testdata::path("models").join(name)
}

fn stories() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/stories260K.gguf")
}

fn open(path: &Path) -> Arc<GgufFile> {
    Arc::new(GgufFile::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

fn options() -> ModelOptions {
    ModelOptions { n_ctx: Some(64), n_batch: 64, all_logits: true, ..ModelOptions::default() }
}

fn group(ranks: usize, backend: fn() -> CpuBackend) -> (Vec<Arc<CpuBackend>>, Vec<GroupHandle<CpuBackend>>) {
    ((0..ranks).map(|_| Arc::new(backend())).collect(), HostAllReduce::handles(ranks))
}

fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let diff: f64 = got.iter().zip(want).map(|(g, w)| (*g as f64 - *w as f64).powi(2)).sum();
    let norm: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
    (diff / norm).sqrt()
}

/// Greedy continuation of `prompt`, `n` tokens.
fn greedy(mut next: impl FnMut(&[u32]) -> u32, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut tokens = vec![next(prompt)];
    while tokens.len() < n {
        let last = *tokens.last().unwrap();
        tokens.push(next(&[last]));
    }
    tokens
}

/// With exact f32 products the only difference between sharded and unsharded is the order of
/// the f32 sums of the row-parallel products (each rank's partial, then the sum over ranks), so
/// the logits agree to rounding: rel-L2 within 1e-5 (measured 3e-7). With 8-bit activations
/// (the fast backend) that rounding difference can flip an activation code later on (every
/// slice starts on a quantization block, so nothing else differs): measured 1.4e-3 on
/// tiny-llama Q8_0, where int8 activations themselves move the logits 1.1e-2 from exact; the
/// bound is a quarter of that model's own int8 error, and never below the f32 one. Greedy
/// tokens equal in every case.
#[test]
fn sharded_logits_and_tokens_equal_unsharded() {
    let cases: [(PathBuf, fn() -> CpuBackend); 6] = [
        (stories(), CpuBackend::exact),
        (testdata_model("stories260K-F16.gguf"), CpuBackend::new),
        (testdata_model("tiny-llama-Q8_0.gguf"), CpuBackend::new),
        (testdata_model("tiny-llama-Q4_0.gguf"), CpuBackend::exact),
        (testdata_model("tiny-qwen3-Q8_0.gguf"), CpuBackend::new),
        (testdata_model("tiny-qwen3-Q8_0.gguf"), CpuBackend::exact),
    ];
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for (path, backend) in cases {
        let file = open(&path);
        let mut full = Model::load(Arc::new(backend()), file.clone(), &options()).unwrap();
        let prompt: Vec<u32> = (0..23).map(|_| rng.gen_range(1..full.config.n_vocab as u32)).collect();
        let want = full.forward(&prompt, Logits::All).unwrap().to_vec();
        let exact = Model::load(Arc::new(CpuBackend::exact()), file.clone(), &options()).unwrap().forward(&prompt, Logits::All).unwrap().to_vec();
        let int8_error = rel_l2(&want, &exact);
        // Float weights on the fast backend are f32 products too (only summed in another order
        // than the exact backend's), so they get the f32 rounding bound as well.
        let bound = (int8_error / 4.0).max(1e-5);
        full.reset();
        let want_tokens = greedy(|t| full.prompt(t, &SamplingParams::greedy()).unwrap(), &prompt, 12);
        for ranks in [2, 4] {
            let (backends, reducers) = group(ranks, backend);
            let mut tp = tensor_parallel::model(backends, reducers, &file, &options()).unwrap_or_else(|e| panic!("{} at {ranks}: {e}", path.display()));
            assert_eq!(tp.config.n_head * ranks, full.config.n_head, "each rank holds its share of the heads");
            assert_eq!(tp.engine().n_ranks(), ranks);
            let got = tp.forward(&prompt, Logits::All).unwrap().to_vec();
            assert_eq!(got.len(), want.len());
            let err = rel_l2(&got, &want);
            assert!(err < bound, "{} at {ranks} ranks: logits rel-L2 {err:e} (bound {bound:e})", path.display());
            tp.reset();
            let tokens = greedy(|t| tp.prompt(t, &SamplingParams::greedy()).unwrap(), &prompt, 12);
            assert_eq!(tokens, want_tokens, "{} at {ranks} ranks: greedy tokens", path.display());
        }
    }
}

#[test]
fn shards_that_cut_blocks_or_heads_are_refused_by_name() {
    let refused = |path: PathBuf, ranks: usize| {
        let (backends, reducers) = group(ranks, CpuBackend::new);
        match tensor_parallel::model(backends, reducers, &open(&path), &options()) {
            Err(e @ ModelError::Unshardable { .. }) => e.to_string(),
            Err(e) => panic!("{}: {ranks} ranks: wrong error {e}", path.display()),
            Ok(_) => panic!("{}: {ranks} ranks accepted", path.display()),
        }
    };
    // Q4_K's 256-value blocks: attn_output rows of 256 split in two are half blocks.
    let e = refused(testdata_model("tiny-llama-Q4_K.gguf"), 2);
    assert!(e.contains("attn_output") && e.contains("256-value blocks"), "{e}");
    // 4 query heads do not split 3 ways.
    let e = refused(testdata_model("tiny-llama-Q8_0.gguf"), 3);
    assert!(e.contains("4 query heads"), "{e}");
    // Architectures the sharded forward does not cover yet say so.
    let e = refused(kiln_testdata::path("archs").join("tiny-gemma3-Q4_K.gguf"), 2);
    assert!(e.contains("gemma3"), "{e}");
    // Handles out of order or of another group size.
    let (backends, mut reducers) = group(2, CpuBackend::new);
    reducers.swap(0, 1);
    assert!(matches!(tensor_parallel::model(backends, reducers, &open(&stories()), &options()), Err(ModelError::Unshardable { .. })));
}

/// The batched engine split over ranks: sequences of different lengths started at different
/// steps, as the server runs them, give the unsharded engine's logits and tokens.
#[test]
fn sharded_batched_engine_equals_unsharded() {
    let path = testdata_model("tiny-qwen3-Q8_0.gguf");
    let file = open(&path);
    let backend = Arc::new(CpuBackend::exact());
    let weights = Arc::new(kiln_models::Weights::load(&*backend, &file).unwrap());
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let prompts: Vec<Vec<u32>> = [1, 7, 33, 40].iter().map(|&n| (0..n).map(|_| rng.gen_range(1..512)).collect()).collect();
    // An f32 cache, so that only the order of the partial sums differs (an f16 cache rounds the
    // keys, which differ in their last bits, to different halves now and then: 2e-5).
    let options =
        EngineOptions { max_seq_len: 96, max_batch_tokens: 128, max_seqs: prompts.len(), k_type: KvType::F32, v_type: KvType::F32, ..EngineOptions::default() };
    let want = run_staggered(&backend, &weights, &options, &prompts, 5).unwrap();
    for ranks in [2, 4] {
        let (backends, reducers) = group(ranks, CpuBackend::exact);
        let mut engine = tensor_parallel::engine(backends, reducers, &file, &options).unwrap();
        let got = run_staggered_on(&mut engine, &prompts, 5).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.tokens, w.tokens, "{ranks} ranks, sequence {i}: tokens");
            for (gl, wl) in g.logits.iter().zip(&w.logits) {
                let err = rel_l2(gl, wl);
                assert!(err < 1e-5, "{ranks} ranks, sequence {i}: logits rel-L2 {err:e}");
            }
        }
    }
}

#[test]
fn kv_heads_split_or_replicate() {
    let heads = |ranks, n_kv| (0..ranks).map(|rank| Shard { rank, ranks }.kv_heads(n_kv)).collect::<Vec<_>>();
    assert_eq!(heads(2, 8), vec![0..4, 4..8]);
    assert_eq!(heads(4, 2), vec![0..1, 0..1, 1..2, 1..2]);
    assert_eq!(heads(8, 8), (0..8).map(|h| h..h + 1).collect::<Vec<_>>());
    assert_eq!(Shard { rank: 1, ranks: 4 }.part(172), 43..86);
}
