//! The scheduler over a real engine (the bundled model on the CPU): chunked prefill keeps a
//! running sequence decoding every step while a long prompt is fed.

use std::path::Path;
use std::sync::Arc;

use kiln_core::{CpuBackend, SamplingParams};
use kiln_gguf::GgufFile;
use kiln_models::{Engine, EngineOptions, Weights};
use kiln_server::metrics::Metrics;
use kiln_server::scheduler::{Event, FinishReason, GenerationRequest, Scheduler, SchedulerConfig, SchedulerHandle};

fn request(prompt: Vec<u32>, max_tokens: usize) -> GenerationRequest {
    GenerationRequest { prompt, sampling: SamplingParams::greedy(), max_tokens, ignore_eos: true, top_logprobs: None }
}

#[test]
fn decodes_keep_going_while_a_long_prompt_is_fed_in_chunks() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/stories260K.gguf");
    let backend = Arc::new(CpuBackend::new());
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let weights = Arc::new(Weights::load(&*backend, &file).unwrap());
    let options = EngineOptions { max_seq_len: 512, max_batch_tokens: 16, max_seqs: 2, ..EngineOptions::default() };
    let engine = Engine::new(backend, weights, &options).unwrap();
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
