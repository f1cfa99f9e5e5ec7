//! Sliding-window layers release the KV blocks that fall out of their window (`window_kv`), on
//! the tiny models of testdata/archs (window 8): gemma3 (five sliding layers, one global),
//! gemma4 (sliding and full layers, two of them reading earlier layers' caches) and gpt-oss
//! (sliding and full, with sinks), over sequences many windows long.

use std::collections::HashSet;
use std::sync::Arc;

use kiln_core::plan::LogitRows;
use kiln_core::{CpuBackend, KvType, KV_BLOCK_SIZE, RELEASED_BLOCK};
use kiln_gguf::GgufFile;
use kiln_models::checks::{compare, run_alone, run_staggered};
use kiln_models::{Engine, EngineOptions, KvBudget, Logits, Model, ModelError, SeqWork, Sequence, Weights};

const MODELS: [&str; 3] = ["tiny-gemma3-Q4_K.gguf", "tiny-gemma4-Q8_0.gguf", "tiny-gpt-oss-MXFP4.gguf"];
const WINDOW: usize = 8;
/// Window blocks a sequence may hold between steps: the module's bound for a window of 8.
const HELD_AT_REST: usize = (WINDOW - 1) / KV_BLOCK_SIZE + 3;

fn weights(name: &str) -> (Arc<CpuBackend>, Arc<Weights<CpuBackend>>) {
    let backend = Arc::new(CpuBackend::exact());
    let file = Arc::new(GgufFile::open(kiln_testdata::path("archs").join(name)).unwrap());
    let weights = Arc::new(Weights::load(&*backend, &file).unwrap());
    (backend, weights)
}

fn tokens(n: usize, salt: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 37 + salt * 101) % 511 + 1) as u32).collect()
}

fn options(max_seq_len: usize, max_batch_tokens: usize) -> EngineOptions {
    EngineOptions { max_seq_len, max_batch_tokens, all_logits: true, k_type: KvType::F32, v_type: KvType::F32, ..EngineOptions::default() }
}

/// Every position's logits of `tokens` fed in one step (every window block held at once).
fn one_pass(engine: &mut Engine<CpuBackend>, tokens: &[u32]) -> Vec<f32> {
    let mut seq = Sequence::new(tokens.to_vec(), Default::default());
    engine.step(&mut [SeqWork { seq: &mut seq, n_tokens: tokens.len(), logits: LogitRows::All, sample: false }]).unwrap();
    let logits = engine.logits().unwrap().to_vec();
    engine.release(&mut seq);
    logits
}

fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let diff: f64 = got.iter().zip(want).map(|(g, w)| (*g as f64 - *w as f64).powi(2)).sum();
    (diff / want.iter().map(|w| (*w as f64).powi(2)).sum::<f64>()).sqrt()
}

/// A 300-token sequence fed in chunks of 8 (the prompt attention's tiles give the same values
/// however a prompt is split) gives exactly the logits of one pass, while the window pool
/// holds at most `HELD_AT_REST` of its blocks between steps and the full pool all ten.
#[test]
fn chunked_feeding_releases_window_blocks_and_keeps_the_logits() {
    for name in MODELS {
        let (backend, w) = weights(name);
        let mut engine = Engine::new(backend, w, &options(320, 320)).unwrap();
        assert_eq!(engine.window(), Some(WINDOW), "{name}");
        let all = tokens(300, 1);
        let want = one_pass(&mut engine, &all);
        let mut seq = Sequence::new(all.clone(), Default::default());
        let mut got = Vec::new();
        while seq.n_pending() > 0 {
            let n = seq.n_pending().min(8);
            engine.step(&mut [SeqWork { seq: &mut seq, n_tokens: n, logits: LogitRows::All, sample: false }]).unwrap();
            got.extend_from_slice(engine.logits().unwrap());
            assert!(seq.window_blocks_held() <= HELD_AT_REST, "{name}: {} window blocks held at {}", seq.window_blocks_held(), seq.n_cached());
            assert_eq!(engine.window_pool().unwrap().allocator().in_use(), seq.window_blocks_held(), "{name}");
        }
        assert_eq!(got, want, "{name}: logits change when window blocks are released");
        assert_eq!(seq.blocks().len(), 300usize.div_ceil(KV_BLOCK_SIZE), "{name}");
        let released = seq.window_blocks().iter().filter(|&&b| b == RELEASED_BLOCK).count();
        assert_eq!(released + seq.window_blocks_held(), seq.blocks().len(), "{name}");
        println!("{name}: at 300 positions the full pool holds {} blocks, the window pool {}", seq.blocks().len(), seq.window_blocks_held());
        engine.release(&mut seq);
        assert_eq!(engine.window_pool().unwrap().allocator().in_use(), 0, "{name}");
    }
}

/// Decoding one token at a time past many windows stays within f32 rounding of one pass (the
/// decode attention sums in another order than the prompt tiles), holding a bounded window.
#[test]
fn decoding_past_the_window_matches_one_pass() {
    for name in MODELS {
        let (backend, w) = weights(name);
        let mut engine = Engine::new(backend, w, &options(224, 224)).unwrap();
        let all = tokens(200, 2);
        let want = one_pass(&mut engine, &all);
        let vocab = want.len() / all.len();
        let mut seq = Sequence::new(all.clone(), Default::default());
        engine.step(&mut [SeqWork { seq: &mut seq, n_tokens: 20, logits: LogitRows::None, sample: false }]).unwrap();
        let mut got = Vec::new();
        while seq.n_pending() > 0 {
            engine.step(&mut [SeqWork { seq: &mut seq, n_tokens: 1, logits: LogitRows::Last, sample: false }]).unwrap();
            got.extend_from_slice(engine.logits().unwrap());
            assert!(seq.window_blocks_held() <= HELD_AT_REST, "{name}");
        }
        let rel = rel_l2(&got, &want[20 * vocab..]);
        println!("{name}: decode vs one pass rel_l2 {rel:.2e}");
        assert!(rel < 1e-5, "{name}: rel_l2 {rel:.3e}");
    }
}

/// Sequences of mixed lengths, several windows long, batched together give exactly what each
/// gives alone while their window blocks are released and taken again.
#[test]
fn batched_equals_alone_past_many_windows() {
    for name in MODELS {
        let (backend, w) = weights(name);
        let prompts: Vec<Vec<u32>> = [3, 40, 100, 150].iter().enumerate().map(|(i, &n)| tokens(n, i + 3)).collect();
        let options = EngineOptions { all_logits: false, ..options(192, 320) };
        let batched = run_staggered(&backend, &w, &options, &prompts, 30).unwrap();
        for (prompt, b) in prompts.iter().zip(&batched) {
            let alone = run_alone(&backend, &w, &options, prompt, 30).unwrap();
            let (max_abs, _) = compare(&alone, b, 0.0);
            assert_eq!(max_abs, 0.0, "{name}: prompt of {}: logits differ by {max_abs}", prompt.len());
            assert_eq!(alone.tokens, b.tokens, "{name}: prompt of {}", prompt.len());
        }
    }
}

/// Two sequences of 300 positions each run in a window pool of fewer blocks than their tables
/// span together: the blocks one releases are taken by the other.
#[test]
fn released_window_blocks_are_taken_by_other_sequences() {
    let (backend, w) = weights(MODELS[0]);
    let options = EngineOptions { max_seqs: 2, ..options(320, 64) };
    let mut engine = Engine::new(backend, w, &options).unwrap();
    let capacity = engine.window_pool().unwrap().allocator().capacity();
    let mut first = Sequence::new(tokens(300, 4), Default::default());
    let mut held_by_first = HashSet::new();
    while first.n_pending() > 0 {
        let n = first.n_pending().min(64);
        engine.step(&mut [SeqWork { seq: &mut first, n_tokens: n, logits: LogitRows::None, sample: false }]).unwrap();
        held_by_first.extend(first.window_blocks().iter().copied().filter(|&b| b != RELEASED_BLOCK));
    }
    let released_by_first: HashSet<u32> = held_by_first.difference(&first.window_blocks().iter().copied().collect()).copied().collect();
    assert!(!released_by_first.is_empty());
    let mut second = Sequence::new(tokens(300, 5), Default::default());
    let mut taken_by_second = HashSet::new();
    while second.n_pending() > 0 {
        let n = second.n_pending().min(64);
        engine.step(&mut [SeqWork { seq: &mut second, n_tokens: n, logits: LogitRows::None, sample: false }]).unwrap();
        taken_by_second.extend(second.window_blocks().iter().copied().filter(|&b| b != RELEASED_BLOCK));
    }
    assert!(taken_by_second.iter().any(|b| released_by_first.contains(b)), "no released block was reused");
    let spanned = first.window_blocks().len() + second.window_blocks().len();
    assert!(capacity < spanned, "the window pool ({capacity} blocks) should be smaller than the {spanned} entries both tables span");
    println!("window pool of {capacity} blocks served two tables spanning {spanned} entries");
}

/// A sequence started on another's prefix gets its full blocks and the window blocks its next
/// query needs, and computes exactly the logits of feeding the whole prompt; once those window
/// blocks are released the prefix is refused, untouched.
#[test]
fn attached_prefix_with_window_blocks_equals_recomputing() {
    let (backend, w) = weights(MODELS[0]);
    let options = EngineOptions { max_seqs: 2, ..options(320, 320) };
    let mut engine = Engine::new(backend, w, &options).unwrap();
    let mut prompt = tokens(96, 6);
    prompt.extend(tokens(10, 7));
    let want = one_pass(&mut engine, &prompt);
    let vocab = want.len() / prompt.len();

    let mut source = Sequence::new(tokens(300, 6)[..100].to_vec(), Default::default());
    source.tokens[..96].copy_from_slice(&prompt[..96]);
    engine.step(&mut [SeqWork { seq: &mut source, n_tokens: 100, logits: LogitRows::None, sample: false }]).unwrap();
    assert_eq!(engine.prefix_window_entries(), Some(1));
    let (blocks, window_blocks) = (source.blocks()[..3].to_vec(), source.window_blocks()[..3].to_vec());
    assert_eq!(window_blocks[0], RELEASED_BLOCK, "the first block is out of every later window");

    let mut reused = Sequence::new(prompt.clone(), Default::default());
    engine.attach_prefix(&mut reused, &blocks, &window_blocks).unwrap();
    assert_eq!((reused.n_cached(), reused.window_blocks_held()), (96, 1));
    engine.step(&mut [SeqWork { seq: &mut reused, n_tokens: 10, logits: LogitRows::All, sample: false }]).unwrap();
    assert_eq!(engine.logits().unwrap(), &want[96 * vocab..], "a prefix hit changes the logits");
    engine.release(&mut reused);

    // Fed on to 200 positions, the source releases the window block position 96 needs.
    source.tokens.extend(tokens(100, 8));
    engine.step(&mut [SeqWork { seq: &mut source, n_tokens: 100, logits: LogitRows::None, sample: false }]).unwrap();
    assert_eq!(source.window_blocks()[2], RELEASED_BLOCK);
    let refs_before: Vec<u32> = blocks.iter().map(|&b| engine.pool().allocator().refs(b)).collect();
    let mut late = Sequence::new(prompt, Default::default());
    let err = engine.attach_prefix(&mut late, &blocks, &source.window_blocks()[..3]).unwrap_err();
    assert!(matches!(err, ModelError::BadKvBlock(_)), "{err}");
    assert!(late.blocks().is_empty() && late.window_blocks().is_empty() && late.n_cached() == 0);
    assert_eq!(blocks.iter().map(|&b| engine.pool().allocator().refs(b)).collect::<Vec<_>>(), refs_before);
}

/// Truncating within what the window pool still holds keeps the cache; truncating further back
/// feeds the sequence again from its start. Either way the logits are those of a fresh run.
#[test]
fn truncation_resumes_only_where_the_window_is_held() {
    let (backend, w) = weights(MODELS[0]);
    let options = EngineOptions { all_logits: false, ..options(320, 256) };
    let all = tokens(200, 9);
    let continuation = tokens(10, 10);
    for keep in [190, 150] {
        let mut model = Model::with_weights(backend.clone(), w.clone(), &options).unwrap();
        model.forward(&all, Logits::Last).unwrap();
        model.truncate(keep);
        let resumed = model.n_past();
        let got = model.forward(&continuation, Logits::Last).unwrap().to_vec();
        let mut fresh = Model::with_weights(backend.clone(), w.clone(), &options).unwrap();
        let whole: Vec<u32> = all[..keep].iter().chain(&continuation).copied().collect();
        let want = fresh.forward(&whole, Logits::Last).unwrap().to_vec();
        assert_eq!(resumed, if keep == 190 { 190 } else { 0 }, "truncated to {keep}");
        assert!(rel_l2(&got, &want) < 1e-5, "truncated to {keep}: rel_l2 {:.3e}", rel_l2(&got, &want));
        assert_eq!(model.cached_tokens(), &whole[..]);
    }
}

/// A byte budget leaves the window pool at most half of it; a step needing more window blocks
/// than are left is the typed error of any pool, and changes nothing.
#[test]
fn running_out_of_window_blocks_is_a_typed_error() {
    let (backend, w) = weights(MODELS[0]);
    // gemma3 f32: a window block over five 64-wide caches is 81920 bytes, a full block 16384.
    let budget = KvBudget::Bytes(4 * 81920);
    let options = EngineOptions { kv_budget: Some(budget), ..options(320, 320) };
    let mut engine = Engine::new(backend, w, &options).unwrap();
    assert_eq!(engine.window_pool().unwrap().allocator().capacity(), 2);
    assert_eq!(engine.pool().allocator().capacity(), 10);
    let mut long = Sequence::new(tokens(100, 11), Default::default());
    let err = engine.step(&mut [SeqWork { seq: &mut long, n_tokens: 100, logits: LogitRows::Last, sample: false }]).unwrap_err();
    assert!(matches!(err, ModelError::OutOfKvBlocks { needed: 4, available: 2, capacity: 2 }), "{err}");
    assert!(long.n_cached() == 0 && long.blocks().is_empty() && long.window_blocks().is_empty());
    let mut short = Sequence::new(tokens(40, 12), Default::default());
    engine.step(&mut [SeqWork { seq: &mut short, n_tokens: 40, logits: LogitRows::Last, sample: false }]).unwrap();
}

/// A model without sliding windows has no second pool.
#[test]
fn models_without_windows_have_one_pool() {
    let backend = Arc::new(CpuBackend::exact());
    let file = Arc::new(GgufFile::open(kiln_testdata::path("archs/tiny-qwen3moe-Q8_0.gguf")).unwrap());
    let w = Arc::new(Weights::load(&*backend, &file).unwrap());
    let engine = Engine::new(backend, w, &options(128, 64)).unwrap();
    assert!(engine.window_pool().is_none() && engine.window().is_none() && engine.prefix_window_entries().is_none());
}
