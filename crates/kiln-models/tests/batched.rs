//! The batched engine on the CPU: sequences batched together equal each sequence alone, paged
//! attention equals contiguous attention, f16 and q8_0 KV stay close to f32 KV, and running
//! out of KV blocks is a typed error.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_core::backend::AttentionParams;
use kiln_core::plan::{BatchPlan, FlatPlan, LogitRows, SeqStep, StepCapacity};
use kiln_core::{Backend, CpuBackend, DeviceBuffer, KvCacheSpec, KvType, KV_BLOCK_SIZE};
use kiln_gguf::GgufFile;
use kiln_models::checks::{compare, run_alone, run_staggered};
use kiln_models::{Engine, EngineOptions, KvBudget, ModelError, SeqWork, Sequence, Weights};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn testdata_model(name: &str) -> PathBuf {
    kiln_testdata::path("models").join(name)
}

fn stories() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/stories260K.gguf")
}

fn weights(path: &Path) -> (Arc<CpuBackend>, Arc<Weights<CpuBackend>>) {
    let backend = Arc::new(CpuBackend::exact());
    let file = Arc::new(GgufFile::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())));
    let weights = Arc::new(Weights::load(&*backend, &file).unwrap());
    (backend, weights)
}

fn prompts(n_vocab: usize, lengths: &[usize], seed: u64) -> Vec<Vec<u32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    lengths.iter().map(|&n| (0..n).map(|_| rng.gen_range(1..n_vocab as u32)).collect()).collect()
}

/// On the CPU every row is computed by the same code in the same order whatever else is in
/// the step, so batched and alone must agree exactly.
#[test]
fn batched_sequences_equal_each_sequence_alone() {
    for path in [stories(), testdata_model("tiny-qwen3-Q8_0.gguf"), testdata_model("tiny-llama-Q4_K.gguf")] {
        let (backend, w) = weights(&path);
        let lengths = [1, 5, 33, 64, 70];
        let prompts = prompts(w.config.n_vocab, &lengths, 7);
        for kv in [KvType::F32, KvType::Q8_0] {
            let options = EngineOptions { max_seq_len: 128, max_batch_tokens: 256, k_type: kv, v_type: kv, ..EngineOptions::default() };
            let batched = run_staggered(&backend, &w, &options, &prompts, 6).unwrap();
            for (prompt, b) in prompts.iter().zip(&batched) {
                let alone = run_alone(&backend, &w, &options, prompt, 6).unwrap();
                let (max_abs, bad) = compare(&alone, b, 0.0);
                assert_eq!(max_abs, 0.0, "{} {kv}: prompt of {} tokens: logits differ by {max_abs}", path.display(), prompt.len());
                assert!(bad.is_empty() && alone.tokens == b.tokens, "{}: tokens {:?} vs {:?}", path.display(), alone.tokens, b.tokens);
            }
        }
    }
}

/// Relative L2 distance of `got` from `want`.
fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let diff: f64 = got.iter().zip(want).map(|(g, w)| (*g as f64 - *w as f64).powi(2)).sum();
    let norm: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
    (diff / norm).sqrt()
}

/// Teacher-forced logits of every position, for one KV type.
fn all_logits(backend: &Arc<CpuBackend>, w: &Arc<Weights<CpuBackend>>, tokens: &[u32], kv: KvType) -> Vec<f32> {
    let options = EngineOptions { max_seq_len: 256, max_batch_tokens: 256, all_logits: true, k_type: kv, v_type: kv, ..EngineOptions::default() };
    let mut engine = Engine::new(backend.clone(), w.clone(), &options).unwrap();
    let mut seq = Sequence::new(tokens.to_vec(), Default::default());
    engine.step(&mut [SeqWork { seq: &mut seq, n_tokens: tokens.len(), logits: LogitRows::All, sample: false }]).unwrap();
    engine.logits().unwrap().to_vec()
}

/// f16 keeps 11 significant bits (relative rounding 2^-12 ≈ 2.4e-4 per value) and q8_0 one
/// step of amax/127 per block of 32 (up to 0.4% of the block's largest value), so attention
/// scores and outputs move by about those fractions. The bounds are those rounding sizes times
/// the ~4x amplification measured through these depth-2..5 models (f16: 2e-4..4e-4 seen,
/// q8_0: 2e-3..5e-3 seen), with room to spare; greedy tokens must agree wherever the f32
/// margin is above twice the largest logit change.
#[test]
fn f16_and_q8_0_kv_stay_close_to_f32_kv() {
    let mut models = vec![stories()];
    let dir = testdata_model("");
    let mut names: Vec<_> =
        std::fs::read_dir(&dir).unwrap().filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "gguf")).collect();
    names.sort();
    models.extend(names);
    let mut table = Vec::new();
    for path in models {
        let (backend, w) = weights(&path);
        let tokens = &prompts(w.config.n_vocab, &[200], 3)[0];
        let reference = all_logits(&backend, &w, tokens, KvType::F32);
        for (kv, bound) in [(KvType::F16, 2e-3), (KvType::Q8_0, 2e-2)] {
            let got = all_logits(&backend, &w, tokens, kv);
            let err = rel_l2(&got, &reference);
            let vocab = w.config.n_vocab;
            let max_abs = got.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            for (pos, (g, r)) in got.chunks(vocab).zip(reference.chunks(vocab)).enumerate() {
                if kiln_models::checks::top2_margin(r) > 2.0 * max_abs {
                    assert_eq!(kiln_core::sampling::argmax(g), kiln_core::sampling::argmax(r), "{} {kv}: greedy token differs at {pos}", path.display());
                }
            }
            table.push(format!("{} {kv}: rel_l2 {err:.2e} max_abs {max_abs:.2e}", path.file_name().unwrap().to_string_lossy()));
            assert!(err < bound, "{} {kv}: rel_l2 {err:.3e} >= {bound:e}", path.display());
        }
    }
    println!("{}", table.join("\n"));
}

/// Reading keys and values through shuffled block tables gives exactly what contiguous blocks
/// give, and both match a float64 softmax attention, for lengths around the block size, with
/// and without sliding windows (shorter and longer than a block) and attention sinks.
#[test]
fn paged_attention_equals_contiguous_attention() {
    let backend = CpuBackend::exact();
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let (n_heads, n_kv_heads, head_dim) = (4, 2, 16);
    let width = n_kv_heads * head_dim;
    let lengths = [1, KV_BLOCK_SIZE - 1, KV_BLOCK_SIZE, KV_BLOCK_SIZE + 1, 300];
    let windows = [None, Some(1), Some(7), Some(KV_BLOCK_SIZE + 3)];
    let sinks: Vec<f32> = (0..n_heads).map(|h| h as f32 * 0.7 - 1.0).collect();
    let cases = lengths.into_iter().flat_map(|l| windows.map(|w| (l, w))).flat_map(|(l, w)| [(l, w, false), (l, w, true)]);
    for (len, window, with_sinks) in cases {
        let n_blocks = len.div_ceil(KV_BLOCK_SIZE);
        let spec = KvCacheSpec { n_blocks: 2 * n_blocks + 3, width, k_type: KvType::F32, v_type: KvType::F32 };
        let cap = StepCapacity { tokens: len, seqs: 1, blocks: n_blocks, logit_rows: 1, history: 0 };
        let k: Vec<f32> = (0..len * width).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let v: Vec<f32> = (0..len * width).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let q: Vec<f32> = (0..len * n_heads * head_dim).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let contiguous: Vec<u32> = (0..n_blocks as u32).collect();
        let mut shuffled: Vec<u32> = (0..spec.n_blocks as u32).collect();
        for i in (1..shuffled.len()).rev() {
            shuffled.swap(i, rng.gen_range(0..=i));
        }
        shuffled.truncate(n_blocks);
        let params = AttentionParams { n_heads, n_kv_heads, head_dim, max_seq_len: len, scale: 0.25, window };
        let mut outs = Vec::new();
        for table in [&contiguous, &shuffled] {
            let mut cache = backend.alloc_kv(&spec, "test").unwrap();
            backend.grow_kv(&mut cache, spec.n_blocks).unwrap();
            let tokens = vec![0u32; len];
            let mut plan = FlatPlan::default();
            plan.fill(&BatchPlan { seqs: &[SeqStep { tokens: &tokens, pos0: 0, blocks: table, logits: LogitRows::None, sample: None }] }, &cap, spec.n_blocks)
                .unwrap();
            let mut step = backend.alloc_step(&cap, spec.n_blocks).unwrap();
            backend.write_step(&mut step, &plan).unwrap();
            backend.kv_store(k.rows(len, width).unwrap(), v.rows(len, width).unwrap(), &mut cache, &step).unwrap();
            let mut out = vec![f32::NAN; q.len()];
            let (qv, ov) = (q.rows(len, n_heads * head_dim).unwrap(), out.rows_mut(len, n_heads * head_dim).unwrap());
            if with_sinks {
                backend.attention_sinks(qv, &cache, sinks.whole(), ov, &step, &params).unwrap();
            } else {
                backend.attention(qv, &cache, ov, &step, &params).unwrap();
            }
            outs.push(out);
        }
        assert_eq!(outs[0], outs[1], "length {len} window {window:?} sinks {with_sinks}: shuffled blocks change the result");
        // float64 reference over the contiguous K/V.
        let group = n_heads / n_kv_heads;
        let mut worst = 0f64;
        for t in 0..len {
            for h in 0..n_heads {
                let qv = &q[(t * n_heads + h) * head_dim..][..head_dim];
                let col = h / group * head_dim;
                // Masked positions get weight 0, as an -inf score would.
                let seen = |j: usize| window.is_none_or(|w| t - j < w);
                let scores: Vec<f64> =
                    (0..=t).map(|j| qv.iter().zip(&k[j * width + col..][..head_dim]).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * 0.25).collect();
                // A sink is one more logit in the softmax, without a value.
                let sink = with_sinks.then(|| sinks[h] as f64);
                let max = (0..=t).filter(|&j| seen(j)).map(|j| scores[j]).fold(sink.unwrap_or(f64::NEG_INFINITY), f64::max);
                let weights: Vec<f64> = (0..=t).map(|j| if seen(j) { (scores[j] - max).exp() } else { 0.0 }).collect();
                let total: f64 = weights.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - max).exp());
                for d in 0..head_dim {
                    let want: f64 = (0..=t).map(|j| weights[j] * v[j * width + col + d] as f64).sum::<f64>() / total;
                    worst = worst.max((outs[0][(t * n_heads + h) * head_dim + d] as f64 - want).abs());
                }
            }
        }
        // f32 accumulation over at most 300 rows of values in [-1, 1]: well under 1e-5.
        assert!(worst < 1e-5, "length {len} window {window:?} sinks {with_sinks}: {worst:e} from the float64 reference");
    }
}

#[test]
fn running_out_of_kv_blocks_is_a_typed_error_and_nothing_changes() {
    let (backend, w) = weights(&stories());
    let options = EngineOptions { max_seq_len: 256, max_seqs: 2, kv_budget: Some(KvBudget::Blocks(2)), ..EngineOptions::default() };
    let mut engine = Engine::new(backend, w, &options).unwrap();
    let mut long = Sequence::new(vec![1; 100], Default::default());
    let err = engine.step(&mut [SeqWork { seq: &mut long, n_tokens: 100, logits: LogitRows::Last, sample: true }]).unwrap_err();
    assert!(matches!(err, ModelError::OutOfKvBlocks { needed: 4, available: 2, capacity: 2 }), "{err}");
    assert_eq!(long.n_cached(), 0);
    assert!(long.blocks().is_empty());
    let mut short = Sequence::new(vec![1; 40], Default::default());
    engine.step(&mut [SeqWork { seq: &mut short, n_tokens: 40, logits: LogitRows::Last, sample: true }]).unwrap();
    assert_eq!((short.n_cached(), short.blocks().len(), engine.pool().allocator().available()), (40, 2, 0));
    engine.release(&mut short);
    assert_eq!(engine.pool().allocator().available(), 2);
}

/// A plan that names blocks the cache has no memory for yet is refused before any row is read
/// or written (on a GPU such a read would fault and poison the context).
#[test]
fn steps_over_blocks_without_memory_are_errors() {
    let backend = CpuBackend::exact();
    let spec = KvCacheSpec { n_blocks: 8, width: 32, k_type: KvType::F16, v_type: KvType::Q8_0 };
    let mut cache = backend.alloc_kv(&spec, "test").unwrap();
    backend.grow_kv(&mut cache, 2).unwrap();
    let cap = StepCapacity { tokens: 4, seqs: 1, blocks: 8, logit_rows: 1, history: 0 };
    let mut plan = FlatPlan::default();
    plan.fill(&BatchPlan { seqs: &[SeqStep { tokens: &[1, 2], pos0: 64, blocks: &[0, 1, 5], logits: LogitRows::None, sample: None }] }, &cap, 8).unwrap();
    let mut step = backend.alloc_step(&cap, spec.n_blocks).unwrap();
    backend.write_step(&mut step, &plan).unwrap();
    let kv = vec![0.5f32; 2 * 32];
    let kv = kv.rows(2, 32).unwrap();
    let err = backend.kv_store(kv, kv, &mut cache, &step).unwrap_err().to_string();
    assert!(err.contains("block 5") && err.contains("only 2 blocks"), "{err}");
    let params = AttentionParams { n_heads: 2, n_kv_heads: 2, head_dim: 16, max_seq_len: 256, scale: 0.25, window: None };
    let q = vec![0.1f32; 2 * 32];
    let mut out = vec![0f32; 2 * 32];
    assert!(backend.attention(q.rows(2, 32).unwrap(), &cache, out.rows_mut(2, 32).unwrap(), &step, &params).is_err());
    assert!(backend.grow_kv(&mut cache, 9).is_err());
    backend.grow_kv(&mut cache, 6).unwrap();
    backend.kv_store(kv, kv, &mut cache, &step).unwrap();
    backend.attention(q.rows(2, 32).unwrap(), &cache, out.rows_mut(2, 32).unwrap(), &step, &params).unwrap();
    // A step object of a smaller cache refuses the plan outright.
    let mut small = backend.alloc_step(&cap, 4).unwrap();
    assert!(backend.write_step(&mut small, &plan).unwrap_err().to_string().contains("4-block cache"));
}

/// A sequence truncated to a prefix and continued (a chat turn reusing the cache) gives the
/// logits of the prefix and continuation fed from scratch, and keeps its blocks.
#[test]
fn truncated_model_continues_as_if_fed_from_scratch() {
    use kiln_models::{Logits, Model};
    let (backend, w) = weights(&stories());
    let options = EngineOptions { max_seq_len: 256, max_batch_tokens: 64, ..EngineOptions::default() };
    let p = prompts(w.config.n_vocab, &[40, 30, 25], 11);
    let (prefix, dropped, continuation) = (&p[0], &p[1], &p[2]);
    let mut reused = Model::with_weights(backend.clone(), w.clone(), &options).unwrap();
    reused.forward(prefix, Logits::Last).unwrap();
    reused.forward(dropped, Logits::Last).unwrap();
    reused.truncate(prefix.len());
    assert_eq!(reused.cached_tokens(), &prefix[..]);
    let got = reused.forward(continuation, Logits::Last).unwrap().to_vec();
    let mut fresh = Model::with_weights(backend, w, &options).unwrap();
    let whole: Vec<u32> = prefix.iter().chain(continuation).copied().collect();
    let want = fresh.forward(&whole, Logits::Last).unwrap().to_vec();
    assert!(rel_l2(&got, &want) < 1e-5, "rel L2 {}", rel_l2(&got, &want));
    assert_eq!(reused.cached_tokens(), &whole[..]);
}

/// A sequence started on another sequence's full blocks computes the same logits as one that
/// fed the whole prompt, and the shared blocks are counted once per holder.
#[test]
fn attached_prefix_blocks_give_the_same_logits_as_recomputing() {
    let (backend, w) = weights(&stories());
    let options = EngineOptions { max_seq_len: 256, max_seqs: 2, max_batch_tokens: 256, ..EngineOptions::default() };
    let mut engine = Engine::new(backend, w.clone(), &options).unwrap();
    let prompt = prompts(w.config.n_vocab, &[70], 3).remove(0);
    let mut first = Sequence::new(prompt.clone(), Default::default());
    engine.step(&mut [SeqWork { seq: &mut first, n_tokens: 70, logits: LogitRows::Last, sample: false }]).unwrap();
    let want = engine.logits().unwrap().to_vec();
    let shared = &first.blocks()[..2].to_vec();

    let mut second = Sequence::new(prompt.clone(), Default::default());
    engine.attach_prefix(&mut second, shared, &[]).unwrap();
    assert_eq!((second.n_cached(), second.n_pending(), second.blocks_to_feed(6)), (64, 6, 1));
    assert!(shared.iter().all(|&b| engine.pool().allocator().refs(b) == 2));
    engine.step(&mut [SeqWork { seq: &mut second, n_tokens: 6, logits: LogitRows::Last, sample: false }]).unwrap();
    assert_eq!(engine.logits().unwrap(), &want[..]);
    assert_ne!(second.blocks()[2], first.blocks()[2], "the block a sequence writes is its own");

    // A prefix covering every token, or a sequence that already has blocks, is refused untouched.
    let mut whole = Sequence::new(prompt[..64].to_vec(), Default::default());
    assert!(matches!(engine.attach_prefix(&mut whole, shared, &[]), Err(ModelError::BadKvBlock(_))));
    assert!(matches!(engine.attach_prefix(&mut second, shared, &[]), Err(ModelError::BadKvBlock(_))));
    let mut stale = Sequence::new(prompt.clone(), Default::default());
    assert!(engine.attach_prefix(&mut stale, &[shared[0], 200], &[]).is_err());
    assert!(stale.blocks().is_empty() && engine.pool().allocator().refs(shared[0]) == 2);

    engine.retain_block(shared[0]).unwrap();
    engine.release(&mut first);
    engine.release(&mut second);
    assert_eq!(engine.pool().allocator().refs(shared[0]), 1);
    engine.release_block(shared[0]).unwrap();
    assert!(engine.release_block(shared[0]).is_err());
    assert_eq!(engine.pool().allocator().in_use(), 0);
}
