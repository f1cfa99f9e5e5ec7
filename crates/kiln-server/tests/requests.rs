//! Requests through the whole server (HTTP layer, scheduler, the bundled model on the CPU).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{bundled_engine, request, serve, serve_with_header_timeout};
use kiln_models::{EngineOptions, KvBudget};
use kiln_server::http::{AppState, Ready};
use kiln_server::metrics::Metrics;
use kiln_server::reasoning::ReasoningFormat;
use kiln_server::scheduler::{Scheduler, SchedulerConfig, SchedulerHandle};
use kiln_tokenizer::{ChatTemplate, Tokenizer, TokenizerSpec};

/// The bundled model's serving setup (a context of 128) with `tokenizer` and `template`.
fn stories_ready(tokenizer: Tokenizer, template: Option<ChatTemplate>) -> Ready {
    Ready {
        tokenizer: Arc::new(tokenizer),
        template,
        model_name: "stories".into(),
        n_ctx: 128,
        n_vocab: 512,
        created: 0,
        reasoning_syntax: None,
        reasoning_format: ReasoningFormat::Auto,
        tool_syntax: None,
    }
}

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
    assert!(state.ready.set(stories_ready(tokenizer, Some(ChatTemplate::new("{{ messages[0].content }}").unwrap()))).is_ok());

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
    assert!(state.ready.set(stories_ready(tokenizer, None)).is_ok());
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

/// Clients that trickle their request cannot hold a connection: headers that stop arriving
/// close it once the header timeout passes, a body that stops arriving answers 408; other
/// requests are served meanwhile.
#[test]
fn slow_clients_are_cut_off() {
    let (commands, _receiver) = std::sync::mpsc::channel();
    let mut state = AppState::new(SchedulerHandle::new(commands), Arc::new(Metrics::default()), None, 1 << 20);
    state.body_read_timeout = Duration::from_millis(400);
    let (_runtime, addr) = serve_with_header_timeout(Arc::new(state), Duration::from_millis(400));
    let connect = || {
        let s = TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s
    };
    let read_all = |mut s: TcpStream| {
        let started = Instant::now();
        let mut out = Vec::new();
        s.read_to_end(&mut out).expect("the server ends the connection before the client's read timeout");
        (String::from_utf8_lossy(&out).into_owned(), started.elapsed())
    };

    let mut headers = connect();
    headers.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n").unwrap();
    let mut body = connect();
    body.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ").unwrap();
    // Meanwhile a whole request is answered (503: no model in this test).
    assert!(request(&addr, "GET", "/health", "").starts_with("HTTP/1.1 503"));
    let (answer, waited) = read_all(headers);
    assert!(!answer.contains(" 200 ") && waited < Duration::from_secs(10), "{answer:?} after {waited:?}");
    let (answer, waited) = read_all(body);
    assert!(answer.starts_with("HTTP/1.1 408") && answer.contains("did not arrive"), "{answer:?}");
    assert!(waited < Duration::from_secs(10), "{waited:?}");
}
