//! Requests through the whole server (HTTP layer, scheduler, the bundled model on the CPU).

mod common;

use std::sync::Arc;

use common::{bundled_engine, request, serve};
use kiln_models::{EngineOptions, KvBudget};
use kiln_server::http::{AppState, Ready};
use kiln_server::metrics::Metrics;
use kiln_server::reasoning::ReasoningFormat;
use kiln_server::scheduler::{Scheduler, SchedulerConfig, SchedulerHandle};
use kiln_tokenizer::{ChatTemplate, Tokenizer, TokenizerSpec};

/// A chat template that renders only the first message's content, over a tokenizer that adds
/// no BOS (as many BPE models are): an empty message renders and tokenizes to nothing. A prompt
/// larger than the whole KV pool (two blocks) is refused naming the chat field too.
#[test]
fn chat_prompts_the_server_cannot_run_are_refused_by_name() {
    let options = EngineOptions { max_seq_len: 128, max_batch_tokens: 64, max_seqs: 1, kv_budget: Some(KvBudget::Blocks(2)), ..EngineOptions::default() };
    let (engine, file) = bundled_engine(&options);
    let mut spec = TokenizerSpec::from_gguf(&file).unwrap();
    spec.add_bos = Some(false);
    let tokenizer = Tokenizer::from_spec(&spec).unwrap();
    assert!(tokenizer.encode("", true, true).is_empty());

    let metrics = Arc::new(Metrics::default());
    let (commands, receiver) = std::sync::mpsc::channel();
    let handle = SchedulerHandle::new(commands);
    let scheduler = Scheduler::new(engine, SchedulerConfig { max_running: 1, max_waiting: 4, step_tokens: 64 }, &[2], metrics.clone(), receiver);
    let thread = std::thread::spawn(move || scheduler.run());
    let state = Arc::new(AppState::new(handle.clone(), metrics, None, 1 << 20));
    let ready = Ready {
        tokenizer: Arc::new(tokenizer),
        template: Some(ChatTemplate::new("{{ messages[0].content }}").unwrap()),
        model_name: "stories".into(),
        n_ctx: 128,
        n_vocab: 512,
        created: 0,
        reasoning_syntax: None,
        reasoning_format: ReasoningFormat::Auto,
        tool_syntax: None,
    };
    assert!(state.ready.set(ready).is_ok());

    let (_runtime, addr) = serve(state);

    let empty = request(&addr, "POST", "/v1/chat/completions", r#"{"messages": [{"role": "user", "content": ""}], "max_tokens": 2}"#);
    assert!(empty.starts_with("HTTP/1.1 400"), "{empty}");
    assert!(empty.contains(r#""param":"messages""#) && empty.contains("empty once tokenized"), "{empty}");
    let long = format!(r#"{{"messages": [{{"role": "user", "content": "{}"}}], "max_tokens": 2}}"#, "Once upon a time ".repeat(20));
    let too_large = request(&addr, "POST", "/v1/chat/completions", &long);
    assert!(too_large.starts_with("HTTP/1.1 400") && too_large.contains(r#""param":"messages""#) && too_large.contains("KV blocks"), "{too_large}");
    let fine = request(&addr, "POST", "/v1/chat/completions", r#"{"messages": [{"role": "user", "content": "Once upon"}], "max_tokens": 2}"#);
    assert!(fine.starts_with("HTTP/1.1 200") && fine.contains(r#""completion_tokens":2"#), "{fine}");

    handle.shutdown();
    thread.join().unwrap();
}

/// A prompt whose tokenizing takes long (4 MiB of text) leaves the one HTTP worker free: a
/// health check sent meanwhile answers at once.
#[test]
fn a_long_prompt_does_not_hold_the_http_worker() {
    let options = EngineOptions { max_seq_len: 128, max_batch_tokens: 64, max_seqs: 1, ..EngineOptions::default() };
    let (_, file) = bundled_engine(&options);
    let (commands, _receiver) = std::sync::mpsc::channel();
    let state = Arc::new(AppState::new(SchedulerHandle::new(commands), Arc::new(Metrics::default()), None, 8 << 20));
    let tokenizer = Tokenizer::from_spec(&TokenizerSpec::from_gguf(&file).unwrap()).unwrap();
    let ready = Ready {
        tokenizer: Arc::new(tokenizer),
        template: None,
        model_name: "stories".into(),
        n_ctx: 128,
        n_vocab: 512,
        created: 0,
        reasoning_syntax: None,
        reasoning_format: ReasoningFormat::Auto,
        tool_syntax: None,
    };
    assert!(state.ready.set(ready).is_ok());
    let (_runtime, addr) = serve(state);

    let long = format!(r#"{{"prompt": "{}", "max_tokens": 2}}"#, "Once upon a time there was a cat. ".repeat(4 << 20 >> 5));
    let long_addr = addr.clone();
    let started = std::time::Instant::now();
    let long_request = std::thread::spawn(move || (request(&long_addr, "POST", "/v1/completions", &long), started.elapsed()));
    std::thread::sleep(std::time::Duration::from_millis(300));
    let asked = std::time::Instant::now();
    let health = request(&addr, "GET", "/health", "");
    let health_time = asked.elapsed();
    let (too_long, long_time) = long_request.join().unwrap();
    eprintln!("health {health_time:?}, long prompt {long_time:?}");
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    assert!(too_long.starts_with("HTTP/1.1 400") && too_long.contains(r#""param":"prompt""#), "{too_long}");
    assert!(health_time * 4 < long_time, "health {health_time:?} against the long prompt's {long_time:?}");
}
