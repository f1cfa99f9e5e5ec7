//! The scheduler over a real engine on the CPU: chunked prefill keeps a running sequence
//! decoding every step while a long prompt is fed (the bundled model), and on a sliding-window
//! model a prefix-cache hit gives what computing the prompt gives (tiny gemma3).

mod common;

use std::sync::Arc;

use common::bundled_engine;
use kiln_core::{CpuBackend, SamplingParams};
use kiln_gguf::GgufFile;
use kiln_models::{Engine, EngineOptions, Weights};
use kiln_server::metrics::Metrics;
use kiln_server::scheduler::{Event, FinishReason, GenerationRequest, Scheduler, SchedulerConfig, SchedulerHandle, TokenLogprobs};

fn request(prompt: Vec<u32>, max_tokens: usize) -> GenerationRequest {
    GenerationRequest { prompt, sampling: SamplingParams::greedy(), max_tokens, ignore_eos: true, top_logprobs: None }
}

#[test]
fn decodes_keep_going_while_a_long_prompt_is_fed_in_chunks() {
    let options = EngineOptions { max_seq_len: 512, max_batch_tokens: 16, max_seqs: 2, ..EngineOptions::default() };
    let (engine, _) = bundled_engine(&options);
    let (commands, receiver) = std::sync::mpsc::channel();
    let handle = SchedulerHandle::new(commands);
    let config = SchedulerConfig { max_running: 2, max_waiting: 4, step_tokens: 16 };
    let scheduler = Scheduler::new(engine, config, &[2], Arc::new(Metrics::default()), receiver);
    let thread = std::thread::spawn(move || scheduler.run());

    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    runtime.block_on(async {
        let mut short = handle.submit(request(vec![1, 30, 31], 100)).await.unwrap();
        assert!(matches!(short.recv().await, Some(Event::Started { cached_tokens: 0 })));
        let long_prompt: Vec<u32> = std::iter::once(1).chain((0..299).map(|i| 20 + i % 400)).collect();
        let mut long = handle.submit(request(long_prompt, 4)).await.unwrap();
        let mut short_tokens = 0;
        loop {
            match long.recv().await.unwrap() {
                Event::Started { .. } => {}
                Event::Token { .. } => break,
                e => panic!("{e:?}"),
            }
        }
        // Every short token sent before the long prompt's first one is queued by now.
        while let Ok(e) = short.try_recv() {
            if matches!(e, Event::Token { .. }) {
                short_tokens += 1;
            }
        }
        // 300 prompt tokens in steps of 16 with one token of each step going to the decode: at
        // least 20 steps, each of which decoded the short sequence.
        assert!(short_tokens >= 19, "the short sequence got only {short_tokens} tokens while the long prompt was fed");
        loop {
            match long.recv().await.unwrap() {
                Event::Finished { reason, usage } => {
                    assert_eq!((reason, usage.prompt_tokens, usage.completion_tokens), (FinishReason::Length, 300, 4));
                    break;
                }
                Event::Token { .. } => {}
                e => panic!("{e:?}"),
            }
        }
    });
    handle.shutdown();
    thread.join().unwrap();
}

/// A scheduler on its own thread over `engine`.
fn start<B: kiln_core::Backend + 'static>(engine: Engine<B>, metrics: Arc<Metrics>) -> (SchedulerHandle, std::thread::JoinHandle<()>) {
    let (commands, receiver) = std::sync::mpsc::channel();
    let config = SchedulerConfig { max_running: 2, max_waiting: 4, step_tokens: 64 };
    let scheduler = Scheduler::new(engine, config, &[2], metrics, receiver);
    (SchedulerHandle::new(commands), std::thread::spawn(move || scheduler.run()))
}

/// Runs one request to its end: the cached prompt tokens and every token with its logprobs.
async fn generate(handle: &SchedulerHandle, prompt: Vec<u32>, max_tokens: usize) -> (usize, Vec<(u32, Option<TokenLogprobs>)>) {
    let mut events = handle.submit(GenerationRequest { top_logprobs: Some(4), ..request(prompt, max_tokens) }).await.unwrap();
    let (mut cached, mut tokens) = (None, Vec::new());
    loop {
        match events.recv().await.unwrap() {
            Event::Started { cached_tokens } => cached = Some(cached_tokens),
            Event::Token { id, logprobs } => tokens.push((id, logprobs)),
            Event::Finished { .. } => return (cached.unwrap(), tokens),
            e => panic!("{e:?}"),
        }
    }
}

/// On gemma3 (window 8), a request whose prompt starts with an earlier one's takes its full
/// blocks and the window blocks its first query needs, and generates exactly what a server
/// that computed the whole prompt generates.
#[test]
fn prefix_hits_on_a_sliding_window_model_equal_computing_the_prompt() {
    let path = kiln_testdata::path("archs/tiny-gemma3-Q8_0.gguf");
    let backend = Arc::new(CpuBackend::exact());
    let weights = Arc::new(Weights::load(&*backend, &Arc::new(GgufFile::open(&path).unwrap())).unwrap());
    let options = EngineOptions { max_seq_len: 320, max_batch_tokens: 64, max_seqs: 2, ..EngineOptions::default() };
    let first: Vec<u32> = (0..100).map(|i| (i * 37 % 511 + 1) as u32).collect();
    let second: Vec<u32> = first.iter().copied().chain((0..20).map(|i| (i * 11 % 500 + 3) as u32)).collect();
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();

    let metrics = Arc::new(Metrics::default());
    let (handle, thread) = start(Engine::new(backend.clone(), weights.clone(), &options).unwrap(), metrics.clone());
    let (hit, reused) = runtime.block_on(async {
        assert_eq!(generate(&handle, first.clone(), 40).await.0, 0);
        generate(&handle, second.clone(), 40).await
    });
    handle.shutdown();
    thread.join().unwrap();
    assert_eq!(hit, 96, "the first three blocks of the second prompt are cached");
    let total = metrics.kv_window_blocks_total.load(std::sync::atomic::Ordering::Relaxed);
    assert!(total > 0 && total < 2 * 320 / 32, "a window pool of {total} blocks");

    let (handle, thread) = start(Engine::new(backend, weights, &options).unwrap(), Arc::new(Metrics::default()));
    let (none, computed) = runtime.block_on(generate(&handle, second, 40));
    handle.shutdown();
    thread.join().unwrap();
    assert_eq!(none, 0);
    assert_eq!(reused, computed, "a prefix hit changes the generated tokens or their logprobs");
}
