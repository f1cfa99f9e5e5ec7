//! `kiln serve` end to end on the bundled model (CPU): every endpoint and error, batching
//! without cross-talk, cancellation, the prefix cache, preemption, the queue bound and a clean
//! stop on SIGTERM.

mod serve_support;

use std::io::{BufReader, Read};
use std::thread;

use serde_json::{json, Value};
use serve_support::{read_chunk, read_head, Server};

fn error_param(r: &serve_support::Response) -> Option<String> {
    r.json()["error"]["param"].as_str().map(str::to_string)
}

fn greedy(prompt: Value, max_tokens: usize) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

/// Text and token count of a completion, streamed or not.
fn complete(server: &Server, body: &Value) -> (String, u64, Value) {
    let r = server.post("/v1/completions", body);
    assert_eq!(r.status, 200, "{}", r.body);
    if body["stream"] == json!(true) {
        let (events, done) = r.events();
        assert!(done, "{}", r.body);
        let text: String = events.iter().filter_map(|e| e["choices"].get(0)).map(|c| c["text"].as_str().unwrap().to_string()).collect();
        let usage = events.last().unwrap()["usage"].clone();
        let finish = events.iter().filter_map(|e| e["choices"].get(0)).find_map(|c| c["finish_reason"].as_str().map(str::to_string));
        (text, usage["completion_tokens"].as_u64().unwrap_or(0), json!({"usage": usage, "finish": finish}))
    } else {
        let v = r.json();
        let text = v["choices"][0]["text"].as_str().unwrap().to_string();
        let n = v["usage"]["completion_tokens"].as_u64().unwrap();
        (text, n, json!({"usage": v["usage"], "finish": v["choices"][0]["finish_reason"]}))
    }
}

#[test]
fn endpoints_answer_and_bad_requests_are_json_errors() {
    let s = Server::start(&["--alias", "tiny"]);
    assert_eq!(s.get("/health").status, 200);
    let models = s.get("/v1/models").json();
    assert_eq!(models["data"][0]["id"], "tiny");

    let tokens = s.post("/tokenize", &json!({"content": "Once upon a time", "add_special": true})).json()["tokens"].clone();
    let ids: Vec<u64> = tokens.as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    assert_eq!(ids[0], 1, "BOS first with add_special");
    let plain = s.post("/tokenize", &json!({"content": "Once upon a time"})).json()["tokens"].as_array().unwrap().len();
    assert_eq!(plain, ids.len() - 1);
    let text = s.post("/detokenize", &json!({"tokens": ids[1..]})).json()["content"].as_str().unwrap().to_string();
    assert!(text.contains("Once upon a time"), "{text}");

    // A string, an array of one string and token ids are the same prompt.
    let (a, n, meta) = complete(&s, &greedy(json!("Once upon a time"), 12));
    assert_eq!((n, meta["finish"].as_str()), (12, Some("length")));
    assert_eq!(meta["usage"]["prompt_tokens"], ids.len());
    assert_eq!(complete(&s, &greedy(json!(["Once upon a time"]), 12)).0, a);
    assert_eq!(complete(&s, &greedy(json!(ids), 12)).0, a);
    let mut streamed = greedy(json!("Once upon a time"), 12);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (b, n, meta) = complete(&s, &streamed);
    assert_eq!((b.as_str(), n, meta["finish"].as_str()), (a.as_str(), 12, Some("length")));
    let r = s.post("/v1/completions", &streamed);
    let (events, _) = r.events();
    assert_eq!(events.len(), 12 + 2, "one chunk per token, the finish chunk, the usage chunk");

    // Stop strings: the text ends before the stop string, finish_reason stop, fewer tokens.
    let stop_word: String = a.split_whitespace().nth(3).unwrap().to_string();
    for stream in [false, true] {
        let (t, n, meta) = complete(&s, &json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "stop": [stop_word], "stream": stream}));
        assert_eq!(meta["finish"], "stop", "{meta}");
        assert!(!t.contains(&stop_word) && a.starts_with(&t), "{t:?} vs {a:?}");
        if !stream {
            assert!(n < 12);
        }
    }
    // Logprobs of greedy tokens are the largest of their top list.
    let lp = s.post("/v1/completions", &json!({"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "logprobs": 2})).json();
    let lp = &lp["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 3);
    for (l, top) in lp["token_logprobs"].as_array().unwrap().iter().zip(lp["top_logprobs"].as_array().unwrap()) {
        let best = top.as_object().unwrap().values().map(|v| v.as_f64().unwrap()).fold(f64::MIN, f64::max);
        assert!(l.as_f64().unwrap() <= 0.0 && (l.as_f64().unwrap() - best).abs() < 1e-6, "{lp}");
    }
    // Sampling with penalties and a seed repeats itself.
    let seeded = json!({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.9, "seed": 42, "presence_penalty": 0.5, "frequency_penalty": 0.5});
    assert_eq!(complete(&s, &seeded).0, complete(&s, &seeded).0);

    // No chat template in the bundled model: a clear error.
    let chat = s.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!(chat.status, 500);
    assert!(chat.json()["error"]["message"].as_str().unwrap().contains("--chat-template"));

    let cases = [
        ("/v1/completions", "{\"prompt\": ", None),
        ("/v1/completions", "[1, 2]", None),
        ("/v1/completions", r#"{"prompt": 5}"#, Some("prompt")),
        ("/v1/completions", r#"{"prompt": "a", "max_tokens": 0}"#, Some("max_tokens")),
        ("/v1/completions", r#"{"prompt": "a", "max_tokens": 100000}"#, Some("max_tokens")),
        ("/v1/completions", r#"{"prompt": "a", "temperature": -0.5}"#, Some("temperature")),
        ("/v1/completions", r#"{"prompt": "a", "top_p": 0}"#, Some("top_p")),
        ("/v1/completions", r#"{"prompt": "a", "top_k": -1}"#, Some("top_k")),
        ("/v1/completions", r#"{"prompt": "a", "stream": "yes"}"#, Some("stream")),
        ("/v1/completions", r#"{"prompt": [1, 99999]}"#, Some("prompt")),
        ("/v1/chat/completions", r#"{"messages": []}"#, Some("messages")),
        ("/v1/chat/completions", r#"{"messages": [{"role": "pirate", "content": "x"}]}"#, Some("messages[0].role")),
        ("/detokenize", r#"{"tokens": [100000]}"#, Some("tokens")),
        ("/detokenize", r#"{"tokens": "x"}"#, Some("tokens")),
        ("/tokenize", r#"{"content": 3}"#, Some("content")),
    ];
    for (path, body, param) in cases {
        let r = s.request("POST", path, &[], body);
        assert_eq!(r.status, 400, "{path} {body}: {}", r.body);
        assert_eq!(error_param(&r).as_deref(), param, "{body}: {}", r.body);
        assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    }
    let long: Vec<u32> = (0..600).map(|i| 10 + i % 400).collect();
    let r = s.post("/v1/completions", &json!({"prompt": long}));
    assert_eq!((r.status, error_param(&r).as_deref()), (400, Some("prompt")), "{}", r.body);

    let big = format!("{{\"prompt\": \"{}\"}}", "a".repeat(9 << 20));
    assert_eq!(s.request("POST", "/v1/completions", &[], &big).status, 413);
    assert_eq!(s.get("/v2/nothing").status, 404);
    let wrong_method = s.get("/v1/completions");
    assert_eq!(wrong_method.status, 405);
    assert!(wrong_method.json()["error"]["message"].is_string());

    let metrics = s.get("/metrics").body;
    for name in [
        "kiln_requests_running",
        "kiln_requests_waiting",
        "kiln_requests_total",
        "kiln_prompt_tokens_total",
        "kiln_generated_tokens_total",
        "kiln_kv_blocks_used",
        "kiln_kv_blocks_total",
        "kiln_prefix_cache_hit_tokens_total",
        "kiln_time_to_first_token_seconds_bucket",
        "kiln_inter_token_latency_seconds_count",
    ] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }
    assert!(s.metric("kiln_generated_tokens_total") >= 12.0 * 6.0);
    assert_eq!(s.get("/health").status, 200, "the server survived all of it");
}

#[test]
fn chat_template_and_api_key() {
    let key_file = std::env::temp_dir().join(format!("kiln-serve-key-{}", std::process::id()));
    std::fs::write(&key_file, "sesame\n").unwrap();
    let s = Server::start(&["--chat-template", "chatml", "--api-key-file", key_file.to_str().unwrap()]);
    std::fs::remove_file(&key_file).unwrap();
    let body =
        json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell a story"}], "max_tokens": 8, "temperature": 0});
    assert_eq!(s.get("/health").status, 200, "health needs no key");
    let missing = s.post("/v1/chat/completions", &body);
    assert_eq!(missing.status, 401);
    assert!(missing.json()["error"]["message"].as_str().unwrap().contains("API key"));
    let wrong = s.request("POST", "/v1/chat/completions", &[("Authorization", "Bearer sesamE")], &body.to_string());
    assert_eq!(wrong.status, 401);
    assert_eq!(s.request("GET", "/v1/models", &[("Authorization", "Bearer sesame1")], "").status, 401);

    let auth = [("Authorization", "Bearer sesame")];
    let r = s.request("POST", "/v1/chat/completions", &auth, &body.to_string());
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["usage"]["completion_tokens"], 8);
    let whole = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (events, done) = s.request("POST", "/v1/chat/completions", &auth, &streamed.to_string()).events();
    assert!(done);
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = events.iter().filter_map(|e| e["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, whole);

    let applied = s.request("POST", "/apply-template", &auth, &json!({"messages": body["messages"]}).to_string()).json();
    assert_eq!(applied["prompt"], "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nTell a story<|im_end|>\n<|im_start|>assistant\n");
    let r = s.request("POST", "/apply-template", &auth, r#"{"messages": [{"role": "user"}]}"#);
    assert_eq!((r.status, error_param(&r).as_deref()), (400, Some("messages[0].content")));

    // Chat logprobs in the chat shape.
    let lp = json!({"messages": body["messages"], "max_tokens": 2, "temperature": 0, "logprobs": true, "top_logprobs": 3});
    let v = s.request("POST", "/v1/chat/completions", &auth, &lp.to_string()).json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 2);
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 3);
}

/// A template whose prompt opens a `<think>` block (as DeepSeek-R1's and Qwen3.5's do): the
/// answer is reasoning until `</think>`, sent as `reasoning_content`, whole and streamed;
/// `reasoning_format: "none"` (or `--reasoning-format none`) sends the same text as content.
#[test]
fn reasoning_is_split_from_the_content() {
    let template = std::env::temp_dir().join(format!("kiln-think-{}.jinja", std::process::id()));
    std::fs::write(&template, "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<think>\n{% endif %}").unwrap();
    let s = Server::start(&["--chat-template", template.to_str().unwrap()]);
    let body = json!({"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 16, "temperature": 0});
    let v = s.post("/v1/chat/completions", &body).json();
    let message = &v["choices"][0]["message"];
    let reasoning = message["reasoning_content"].as_str().unwrap_or_else(|| panic!("no reasoning_content in {v}")).to_string();
    assert_eq!(message["content"], "", "{v}");
    assert!(!reasoning.is_empty() && reasoning.trim() == reasoning, "{reasoning:?}");

    let mut raw = body.clone();
    raw["reasoning_format"] = json!("none");
    let v = s.post("/v1/chat/completions", &raw).json();
    assert!(v["choices"][0]["message"].get("reasoning_content").is_none(), "{v}");
    assert_eq!(v["choices"][0]["message"]["content"].as_str().unwrap().trim(), reasoning);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (events, done) = s.post("/v1/chat/completions", &streamed).events();
    assert!(done);
    let part = |key: &str| events.iter().filter_map(|e| e["choices"][0]["delta"][key].as_str()).collect::<String>();
    assert_eq!((part("reasoning_content"), part("content")), (reasoning.clone(), String::new()));

    let bad = s.post("/v1/chat/completions", &json!({"messages": body["messages"], "reasoning_format": "loud"}));
    assert_eq!((bad.status, error_param(&bad).as_deref()), (400, Some("reasoning_format")));
    drop(s);

    let s = Server::start(&["--chat-template", template.to_str().unwrap(), "--reasoning-format", "none"]);
    let v = s.post("/v1/chat/completions", &body).json();
    assert_eq!(v["choices"][0]["message"]["content"].as_str().unwrap().trim(), reasoning);
    std::fs::remove_file(&template).unwrap();
}

/// With `tools` offered and a template that teaches `<tool_call>` tags, an answer without a
/// call comes through as the same content; `tool_choice` beyond "auto" and "none" is refused.
#[test]
fn tools_leave_answers_without_calls_alone() {
    let template = std::env::temp_dir().join(format!("kiln-tools-{}.jinja", std::process::id()));
    std::fs::write(
        &template,
        "{% if tools %}{{ tools | length }} tools, called in <tool_call></tool_call> tags\n{% endif %}{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
    )
    .unwrap();
    let s = Server::start(&["--chat-template", template.to_str().unwrap()]);
    std::fs::remove_file(&template).unwrap();
    let tools =
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let offered =
        json!({"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 16, "temperature": 0, "tools": tools, "tool_choice": "auto"});
    let v = s.post("/v1/chat/completions", &offered).json();
    let message = &v["choices"][0]["message"];
    assert!(message.get("tool_calls").is_none() && v["choices"][0]["finish_reason"] == "length", "{v}");
    // tool_choice "none" renders the same prompt and reads no calls.
    let mut unread = offered.clone();
    unread["tool_choice"] = json!("none");
    let u = s.post("/v1/chat/completions", &unread).json();
    assert_eq!(message["content"], u["choices"][0]["message"]["content"], "{v} {u}");
    assert!(!message["content"].as_str().unwrap().is_empty());
    let mut streamed = offered.clone();
    streamed["stream"] = json!(true);
    let (events, done) = s.post("/v1/chat/completions", &streamed).events();
    assert!(done);
    let text: String = events.iter().filter_map(|e| e["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, message["content"].as_str().unwrap());
    for choice in [json!("required"), json!({"type": "function", "function": {"name": "get_weather"}})] {
        let mut forced = offered.clone();
        forced["tool_choice"] = choice;
        let r = s.post("/v1/chat/completions", &forced);
        assert_eq!((r.status, error_param(&r).as_deref()), (400, Some("tool_choice")), "{}", r.body);
    }
}

/// `n` choices: each is the answer its own seed (the request's plus its index) gives alone,
/// whole and streamed (chunks interleaved, each with its index, one usage and one `[DONE]` at
/// the end); the usage counts the prompt once and every choice's tokens.
#[test]
fn several_choices_are_each_their_seeds_answer() {
    let s = Server::start(&["-np", "4", "--chat-template", "chatml"]);
    let body = json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "top_k": 0, "seed": 41, "n": 3, "ignore_eos": true});
    let v = s.post("/v1/completions", &body).json();
    let texts: Vec<String> = (0..3)
        .map(|i| {
            assert_eq!(v["choices"][i]["index"], i, "{v}");
            v["choices"][i]["text"].as_str().unwrap().to_string()
        })
        .collect();
    for (i, text) in texts.iter().enumerate() {
        let alone = json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "top_k": 0, "seed": 41 + i, "ignore_eos": true});
        assert_eq!(&complete(&s, &alone).0, text, "choice {i}");
    }
    assert!(texts[0] != texts[1] || texts[1] != texts[2], "three seeds, three draws: {texts:?}");
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!((v["usage"]["completion_tokens"].as_u64(), v["usage"]["total_tokens"].as_u64()), (Some(36), Some(36 + prompt_tokens)));

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let r = s.post("/v1/completions", &streamed);
    let (events, done) = r.events();
    assert!(done && r.body.matches("[DONE]").count() == 1, "{}", r.body);
    let mut parts = vec![String::new(); 3];
    for e in &events {
        if let Some(c) = e["choices"].get(0) {
            parts[c["index"].as_u64().unwrap() as usize] += c["text"].as_str().unwrap();
        }
    }
    assert_eq!(parts, texts);
    assert_eq!(events.last().unwrap()["usage"]["completion_tokens"], 36);

    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2, "stream": true});
    let (events, _) = s.post("/v1/chat/completions", &chat).events();
    let roles: Vec<u64> =
        events.iter().filter(|e| e["choices"][0]["delta"]["role"] == "assistant").map(|e| e["choices"][0]["index"].as_u64().unwrap()).collect();
    assert_eq!(roles, vec![0, 1]);
    for n in [0, 17] {
        let r = s.post("/v1/completions", &json!({"prompt": "x", "n": n}));
        assert_eq!((r.status, error_param(&r).as_deref()), (400, Some("n")));
    }
    drop(s);
    // One slot has 8 waiting places: 9 choices could never all be queued.
    let s = Server::start(&["-np", "1"]);
    let r = s.post("/v1/completions", &json!({"prompt": "x", "n": 9, "max_tokens": 2}));
    assert_eq!((r.status, error_param(&r).as_deref()), (400, Some("n")), "{}", r.body);
    assert!(r.body.contains("-np"), "{}", r.body);
    assert_eq!(s.post("/v1/completions", &json!({"prompt": "x", "n": 8, "max_tokens": 2})).json()["choices"].as_array().unwrap().len(), 8);
}

/// A hybrid model (Qwen3.5: Gated DeltaNet layers) keeps a recurrent state that cached KV
/// blocks do not hold, so its requests share no prefix: a repeated prompt, alone or as two
/// choices, is computed again and gives the same answer (it failed with 503 when the second
/// request took the first one's blocks).
#[test]
fn a_hybrid_model_repeats_a_prompt_without_the_prefix_cache() {
    let model = kiln_testdata::path("archs/tiny-qwen35-Q8_0.gguf");
    let s = Server::start(&["-m", model.to_str().unwrap()]);
    let prompt = "Once upon a time there was a little cat who lived in a big house with many rooms and a garden";
    let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0});
    let first = s.post("/v1/completions", &body).json();
    assert!(first["usage"]["prompt_tokens"].as_u64().unwrap() > 33, "{first}");
    let again = s.post("/v1/completions", &body);
    assert_eq!(again.status, 200, "{}", again.body);
    let again = again.json();
    assert_eq!(again["choices"][0]["text"], first["choices"][0]["text"]);
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let mut two = body.clone();
    two["n"] = json!(2);
    let both = s.post("/v1/completions", &two).json();
    assert_eq!((&both["choices"][0]["text"], &both["choices"][1]["text"]), (&first["choices"][0]["text"], &first["choices"][0]["text"]), "{both}");
}

/// 64 different prompts at once give each exactly what it gives alone: same tokens, no
/// tokens of one request in another's stream.
#[test]
fn parallel_greedy_requests_equal_each_request_alone() {
    let s = Server::start(&["-np", "64"]);
    let bodies: Vec<Value> = (0..64)
        .map(|i| {
            let prompt: Vec<u32> = std::iter::once(1).chain((0..(5 + i % 40)).map(|j| 20 + ((i * 37 + j * 11) % 480) as u32)).collect();
            json!({"prompt": prompt, "max_tokens": 20 + i % 13, "temperature": 0, "stream": i % 2 == 0, "ignore_eos": i % 3 == 0})
        })
        .collect();
    let alone: Vec<(String, u64, Value)> = bodies.iter().map(|b| complete(&s, b)).collect();
    let together: Vec<(String, u64, Value)> = thread::scope(|scope| {
        let handles: Vec<_> = bodies.iter().map(|b| scope.spawn(|| complete(&s, b))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!((&a.0, a.1), (&t.0, t.1), "request {i}");
    }
    assert!(alone.iter().map(|a| &a.0).collect::<std::collections::HashSet<_>>().len() > 32, "prompts differ, so outputs do");
}

#[test]
fn a_client_that_disconnects_frees_its_blocks() {
    let s = Server::start(&[]);
    let body = json!({"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": true, "stream": true, "temperature": 1});
    let mut reader = BufReader::new(s.send("POST", "/v1/completions", &[], body.to_string().as_bytes()));
    let (status, _) = read_head(&mut reader);
    assert_eq!(status, 200);
    assert!(read_chunk(&mut reader).is_some());
    drop(reader);
    assert!(s.wait_for(10, |s| s.metric("kiln_kv_blocks_used") == 0.0 && s.metric("kiln_requests_running") == 0.0), "blocks stay in use");
    assert!(s.metric("kiln_generated_tokens_total") < 500.0, "the sequence stopped early");
}

#[test]
fn a_repeated_prompt_takes_its_blocks_from_the_prefix_cache() {
    let s = Server::start(&[]);
    let prompt: Vec<u32> = std::iter::once(1).chain((0..99).map(|j| 30 + (j * 7) % 400)).collect();
    let body = json!({"prompt": prompt, "max_tokens": 16, "temperature": 0});
    let (first, _, m1) = complete(&s, &body);
    let (second, _, m2) = complete(&s, &body);
    assert_eq!(m1["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // Three full blocks of 32; the last prompt token is always computed.
    assert_eq!(m2["usage"]["prompt_tokens_details"]["cached_tokens"], 96, "{m2}");
    assert_eq!(first, second);
    // A longer prompt sharing the start, streamed: the same blocks, plus ones the first request generated.
    let mut longer = prompt.clone();
    longer.extend((0..40).map(|j| 50 + j));
    let (_, _, m3) = complete(&s, &json!({"prompt": longer, "max_tokens": 4, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}}));
    assert_eq!(m3["usage"]["prompt_tokens_details"]["cached_tokens"], 96, "{m3}");
    assert_eq!(s.metric("kiln_prefix_cache_hit_tokens_total"), 192.0);
    assert!(s.wait_for(10, |s| s.metric("kiln_kv_blocks_cached") > 0.0 && s.metric("kiln_kv_blocks_used") == 0.0));
}

/// With room for few blocks, sequences that cannot grow are preempted and recomputed, and
/// still give what they give alone; past the queue bound the answer is 503 with Retry-After.
#[test]
fn preemption_keeps_outputs_and_a_full_queue_answers_503() {
    let s = Server::start(&["-np", "4", "--kv-mem", "200K"]);
    let bodies: Vec<Value> = (0..4).map(|i| json!({"prompt": [1, 40 + i, 41, 42 + i], "max_tokens": 200, "ignore_eos": true, "temperature": 0})).collect();
    let alone: Vec<_> = bodies.iter().map(|b| complete(&s, b).0).collect();
    let together: Vec<_> = thread::scope(|scope| {
        let handles: Vec<_> = bodies.iter().map(|b| scope.spawn(|| complete(&s, b).0)).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(alone, together);
    assert!(s.metric("kiln_preemptions_total") > 0.0, "the pool of 10 blocks cannot hold four sequences of 7");

    let statuses: Vec<(u16, Option<String>)> = thread::scope(|scope| {
        let handles: Vec<_> = (0..40)
            .map(|i| {
                let s = &s;
                scope.spawn(move || {
                    let r = s.post("/v1/completions", &json!({"prompt": [1, 50 + i], "max_tokens": 150, "ignore_eos": true}));
                    (r.status, r.header("retry-after").map(str::to_string))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let busy: Vec<_> = statuses.iter().filter(|(st, _)| *st == 503).collect();
    assert!(!busy.is_empty(), "{statuses:?}");
    assert!(busy.iter().all(|(_, retry)| retry.is_some()));
    assert!(statuses.iter().all(|(st, _)| *st == 200 || *st == 503), "{statuses:?}");
    assert!(s.wait_for(10, |s| s.metric("kiln_kv_blocks_used") == 0.0));
}

#[test]
fn sigterm_ends_streams_with_an_error_and_exits_zero() {
    let mut s = Server::start(&["-np", "2"]);
    let streams: Vec<_> = (0..4)
        .map(|i| {
            s.send("POST", "/v1/completions", &[], json!({"prompt": [1, 60 + i], "max_tokens": 500, "ignore_eos": true, "stream": true}).to_string().as_bytes())
        })
        .collect();
    let mut readers: Vec<_> = streams.into_iter().map(BufReader::new).collect();
    for r in readers.iter_mut().take(2) {
        assert_eq!(read_head(r).0, 200);
        assert!(read_chunk(r).is_some());
    }
    let status = std::process::Command::new("kill").args(["-TERM", &s.child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let started = std::time::Instant::now();
    let exit = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st;
        }
        assert!(started.elapsed().as_secs() < 15, "the server did not stop");
        thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(exit.success(), "{exit:?}");
    for mut r in readers {
        let mut rest = Vec::new();
        let _ = r.read_to_end(&mut rest);
        let text = String::from_utf8_lossy(&rest);
        assert!(text.contains("shutting down") || text.contains("[DONE]"), "{text}");
    }
}

/// The official `openai` Python client, installed with pip when missing.
#[test]
fn the_openai_python_client_works_against_the_server() {
    let python = |args: &[&str]| std::process::Command::new("python3").args(args).output();
    let has_openai = |o: std::io::Result<std::process::Output>| o.map(|o| o.status.success()).unwrap_or(false);
    if !has_openai(python(&["-c", "import openai"])) {
        let pip = python(&["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "openai"]);
        if !has_openai(pip) || !has_openai(python(&["-c", "import openai"])) {
            eprintln!("SKIPPED the_openai_python_client_works_against_the_server: `python3 -m pip install openai` failed");
            return;
        }
    }
    let s = Server::start(&["--chat-template", "chatml", "--alias", "stories", "--api-key", "k3y"]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let out = python(&[script, &format!("http://{}", s.addr), "k3y"]).unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains("OK"), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
}
