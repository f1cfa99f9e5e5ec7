//! `/v1/completions` and `/v1/chat/completions`: checks a request, hands it to the scheduler,
//! and turns its token events into text (whole UTF-8 characters only, stop strings held back)
//! as one JSON response or as server-sent events, one chunk per token.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kiln_tokenizer::Tokenizer;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::error::ApiError;
use crate::http::AppState;
use crate::reasoning::{ReasoningSplitter, Split};
use crate::request::{chat_tools, completion_prompt, generation_fields, random_seed, GenerationFields, Prompt};
use crate::scheduler::{Event, GenerationRequest, Rejection, TokenLogprobs, Usage};
use crate::stop::StopMatcher;
use crate::tool_calls::{ToolCall, ToolCallCatcher};
use kiln_tokenizer::Utf8Assembler;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Completion,
    Chat,
}

pub async fn completions(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let o = state.read_body(&headers, body).await?;
    let ready = state.ready()?;
    let fields = generation_fields(&o, false)?;
    let prompt = match completion_prompt(&o)? {
        Prompt::Text(text) => state.off_the_workers(move |r| Ok(r.tokenizer.encode(&text, true, true))).await?,
        Prompt::Tokens(ids) => {
            ready.check_tokens(&ids, "prompt")?;
            ids
        }
    };
    generate(state.clone(), Api::Completion, prompt, "prompt", fields, AnswerParsers::default()).await
}

pub async fn chat_completions(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let o = state.read_body(&headers, body).await?;
    state.ready()?;
    let fields = generation_fields(&o, true)?;
    let (format, read_calls) = (fields.reasoning_format, fields.read_tool_calls);
    let (prompt, parsers) = state
        .off_the_workers(move |r| {
            let text = r.render_chat(&o, true)?;
            let tools = chat_tools(&o)?.and_then(Value::as_array).cloned().unwrap_or_default();
            Ok((r.tokenize_chat(&text), r.answer_parsers(format, tools, read_calls, &text)))
        })
        .await?;
    generate(state.clone(), Api::Chat, prompt, "messages", fields, parsers).await
}

fn rejected(r: Rejection, prompt_field: &str) -> ApiError {
    match r {
        Rejection::QueueFull { .. } => ApiError::unavailable(r.to_string(), 1),
        Rejection::TooLarge { .. } => ApiError::field(prompt_field, r),
        Rejection::ShuttingDown => ApiError::unavailable(r.to_string(), 5),
    }
}

async fn generate(
    state: Arc<AppState>,
    api: Api,
    prompt: Vec<u32>,
    prompt_field: &str,
    fields: GenerationFields,
    parsers: AnswerParsers,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let n_ctx = ready.n_ctx;
    // Possible when the tokenizer adds no BOS and the text (a rendered template) is empty; the
    // scheduler needs a token to feed.
    if prompt.is_empty() {
        return Err(ApiError::field(prompt_field, "the prompt is empty once tokenized"));
    }
    if prompt.len() >= n_ctx {
        return Err(ApiError::field(prompt_field, format!("the prompt has {} tokens and the context holds {n_ctx} (raise -c)", prompt.len())));
    }
    let room = n_ctx - prompt.len();
    let max_tokens = fields.max_tokens.unwrap_or(room);
    if max_tokens > room {
        let name = if api == Api::Chat { "max_completion_tokens" } else { "max_tokens" };
        return Err(ApiError::field(
            name,
            format!("{max_tokens} tokens after a prompt of {} do not fit in the context of {n_ctx}; at most {room} can be generated", prompt.len()),
        ));
    }
    let n_prompt = prompt.len();
    let request = GenerationRequest { prompt, sampling: fields.sampling, max_tokens, ignore_eos: fields.ignore_eos, top_logprobs: fields.logprobs };
    let events = state.scheduler.submit(request).await.map_err(|r| rejected(r, prompt_field))?;
    let id = state.next_id();
    let out = Output {
        tokenizer: ready.tokenizer.clone(),
        utf8: Utf8Assembler::default(),
        stop: StopMatcher::new(fields.stop.clone()),
        usage: Usage { prompt_tokens: n_prompt, ..Usage::default() },
        api,
        logprobs: fields.logprobs.is_some(),
        text_offset: 0,
        parsers,
    };
    let meta = ResponseMeta {
        id: format!("{}-{id}", if api == Api::Chat { "chatcmpl" } else { "cmpl" }),
        created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        model: ready.model_name.clone(),
        api,
    };
    if fields.stream {
        Ok(stream_response(events, out, meta, fields.include_usage))
    } else {
        whole_response(events, out, meta).await
    }
}

struct ResponseMeta {
    id: String,
    created: u64,
    model: String,
    api: Api,
}

impl ResponseMeta {
    fn object(&self, streamed: bool) -> &'static str {
        match (self.api, streamed) {
            (Api::Chat, true) => "chat.completion.chunk",
            (Api::Chat, false) => "chat.completion",
            (Api::Completion, _) => "text_completion",
        }
    }

    fn envelope(&self, streamed: bool, choices: Value) -> Value {
        json!({"id": self.id, "object": self.object(streamed), "created": self.created, "model": self.model, "choices": choices})
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// What reads a chat answer's parts: its reasoning and its tool calls, with the special
/// tokens their markers need shown.
#[derive(Default)]
pub struct AnswerParsers {
    pub reasoning: Option<ReasoningSplitter>,
    pub tool_calls: Option<ToolCallCatcher>,
    pub shown: Vec<u32>,
}

/// What one event turned into.
enum Step {
    Text { text: Split, logprobs: Option<Value> },
    Finished { tail: Split, calls: Vec<ToolCall>, reason: &'static str },
    Failed(String),
    Nothing,
}

/// One request's output side: detokenizing, stop strings, counting.
struct Output {
    tokenizer: Arc<Tokenizer>,
    utf8: Utf8Assembler,
    stop: StopMatcher,
    usage: Usage,
    api: Api,
    logprobs: bool,
    text_offset: usize,
    /// Without parsers all text is content.
    parsers: AnswerParsers,
}

impl Output {
    fn split(&mut self, text: String) -> Split {
        let mut split = match &mut self.parsers.reasoning {
            Some(splitter) => splitter.push(&text),
            None => Split { reasoning: String::new(), content: text },
        };
        if let Some(catcher) = &mut self.parsers.tool_calls {
            split.content = catcher.push(&split.content);
        }
        split
    }

    /// The answer's last text, with what the parsers still held, and its tool calls.
    fn split_tail(&mut self, text: String) -> (Split, Vec<ToolCall>) {
        let mut split = self.split(text);
        let mut calls = Vec::new();
        if let Some(splitter) = &mut self.parsers.reasoning {
            let rest = splitter.finish();
            split.reasoning += &rest.reasoning;
            split.content += &match &mut self.parsers.tool_calls {
                Some(catcher) => catcher.push(&rest.content),
                None => rest.content,
            };
            calls.extend(splitter.take_calls().into_iter().map(|(name, arguments)| ToolCall { name, arguments }));
        }
        if let Some(catcher) = &mut self.parsers.tool_calls {
            let (rest, found) = catcher.finish();
            split.content += &rest;
            calls.extend(found);
        }
        (split, calls)
    }

    fn token_text(&self, id: u32) -> String {
        String::from_utf8_lossy(self.tokenizer.piece(id, true)).into_owned()
    }

    fn logprob_entry(&self, id: u32, lp: &TokenLogprobs) -> Value {
        match self.api {
            Api::Chat => {
                let entry = |id: u32, logprob: f32| {
                    let text = self.token_text(id);
                    json!({"token": text, "logprob": logprob, "bytes": text.as_bytes()})
                };
                let mut e = entry(id, lp.logprob);
                e["top_logprobs"] = lp.top.iter().map(|&(t, l)| entry(t, l)).collect();
                e
            }
            Api::Completion => {
                let top: serde_json::Map<String, Value> = lp.top.iter().map(|&(t, l)| (self.token_text(t), json!(l))).collect();
                json!({"token": self.token_text(id), "logprob": lp.logprob, "top": top, "offset": self.text_offset})
            }
        }
    }

    fn on_event(&mut self, event: Event) -> Step {
        match event {
            Event::Started { cached_tokens } => {
                self.usage.cached_tokens = cached_tokens;
                Step::Nothing
            }
            Event::Token { id, logprobs } => {
                self.usage.completion_tokens += 1;
                let logprobs = match (&logprobs, self.logprobs) {
                    (Some(lp), true) => Some(self.logprob_entry(id, lp)),
                    _ => None,
                };
                let piece = self.utf8.push(self.tokenizer.piece(id, self.parsers.shown.contains(&id)));
                let released = self.stop.push(&piece);
                self.text_offset += released.text.len();
                if released.stopped {
                    let (tail, calls) = self.split_tail(released.text);
                    return Step::Finished { tail, calls, reason: "stop" };
                }
                Step::Text { text: self.split(released.text), logprobs }
            }
            Event::Finished { reason, usage } => {
                self.usage = usage;
                let rest = self.utf8.finish();
                let released = self.stop.push(&rest);
                let tail = if released.stopped { released.text } else { released.text + &self.stop.finish() };
                let (tail, calls) = self.split_tail(tail);
                Step::Finished { tail, calls, reason: if released.stopped { "stop" } else { reason.as_str() } }
            }
            Event::Failed(message) => Step::Failed(message),
        }
    }
}

/// Completion logprobs: the legacy parallel arrays, from per-token entries.
fn completion_logprobs(entries: &[Value]) -> Value {
    let pick = |key: &str| entries.iter().map(|e| e[key].clone()).collect::<Vec<_>>();
    json!({"tokens": pick("token"), "token_logprobs": pick("logprob"), "top_logprobs": pick("top"), "text_offset": pick("offset")})
}

fn logprobs_field(api: Api, entries: &[Value]) -> Value {
    match api {
        Api::Chat => json!({"content": entries}),
        Api::Completion => completion_logprobs(entries),
    }
}

/// A chat message or delta: `content`, and `reasoning_content` where there is any (as
/// llama-server and vLLM send it).
fn chat_text(text: &Split, role: Option<&str>) -> Value {
    let mut m = serde_json::Map::new();
    if let Some(role) = role {
        m.insert("role".into(), json!(role));
    }
    if role.is_some() || !text.content.is_empty() || text.reasoning.is_empty() {
        m.insert("content".into(), json!(text.content));
    }
    if !text.reasoning.is_empty() {
        m.insert("reasoning_content".into(), json!(text.reasoning));
    }
    Value::Object(m)
}

/// Tool calls as the API sends them, each with a fresh id (and its `index` in a streamed delta).
fn tool_calls_json(calls: &[ToolCall], streamed: bool) -> Value {
    let call = |(i, c): (usize, &ToolCall)| {
        let mut v = json!({"id": format!("call_{:016x}", random_seed()), "type": "function", "function": {"name": c.name, "arguments": c.arguments}});
        if streamed {
            v["index"] = json!(i);
        }
        v
    };
    calls.iter().enumerate().map(call).collect()
}

/// The finish reason of an answer that made tool calls.
fn finish_reason(reason: &'static str, calls: &[ToolCall]) -> &'static str {
    if calls.is_empty() {
        reason
    } else {
        "tool_calls"
    }
}

fn choice(api: Api, streamed: bool, text: &Split, logprobs: Value, finish: Option<&str>) -> Value {
    match (api, streamed) {
        (Api::Completion, _) => json!({"index": 0, "text": text.content, "logprobs": logprobs, "finish_reason": finish}),
        (Api::Chat, false) => json!({"index": 0, "message": chat_text(text, Some("assistant")), "logprobs": logprobs, "finish_reason": finish}),
        (Api::Chat, true) => {
            let delta = if finish.is_some() && text.is_empty() { json!({}) } else { chat_text(text, None) };
            json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
        }
    }
}

/// The one choice of a whole (not streamed) response.
fn whole_choice(api: Api, text: &Split, calls: &[ToolCall], logprobs: Value, reason: &'static str) -> Value {
    let mut answer = choice(api, false, text, logprobs, Some(finish_reason(reason, calls)));
    if !calls.is_empty() {
        // Blanks before the calls are no content (null where nothing else is).
        let content = text.content.trim_end();
        answer["message"]["content"] = if content.is_empty() { Value::Null } else { json!(content) };
        answer["message"]["tool_calls"] = tool_calls_json(calls, false);
    }
    answer
}

async fn whole_response(mut events: UnboundedReceiver<Event>, mut out: Output, meta: ResponseMeta) -> Result<Response, ApiError> {
    let mut text = Split::default();
    let mut entries = Vec::new();
    loop {
        let Some(event) = events.recv().await else {
            return Err(ApiError::unavailable(Rejection::ShuttingDown.to_string(), 5));
        };
        match out.on_event(event) {
            Step::Nothing => {}
            Step::Text { text: t, logprobs } => {
                text.reasoning += &t.reasoning;
                text.content += &t.content;
                entries.extend(logprobs);
            }
            Step::Finished { tail, calls, reason } => {
                text.reasoning += &tail.reasoning;
                text.content += &tail.content;
                let logprobs = if out.logprobs { logprobs_field(meta.api, &entries) } else { Value::Null };
                let mut body = meta.envelope(false, json!([whole_choice(meta.api, &text, &calls, logprobs, reason)]));
                body["usage"] = usage_json(&out.usage);
                return Ok(Json(body).into_response());
            }
            Step::Failed(message) => return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message)),
        }
    }
}

fn sse(value: &Value) -> String {
    format!("data: {value}\n\n")
}

struct StreamState {
    events: UnboundedReceiver<Event>,
    out: Output,
    meta: ResponseMeta,
    include_usage: bool,
    /// Sent before the first event (the chat role chunk).
    prelude: Option<String>,
    ended: bool,
}

impl StreamState {
    /// The next piece of the event stream; `None` once it is over.
    async fn next(&mut self) -> Option<String> {
        if self.ended {
            return None;
        }
        if let Some(p) = self.prelude.take() {
            return Some(p);
        }
        loop {
            let Some(event) = self.events.recv().await else {
                self.ended = true;
                let error = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, Rejection::ShuttingDown.to_string());
                return Some(sse(&error.body()));
            };
            let api = self.meta.api;
            let logprobs_of = |lp: Option<Value>| lp.map(|e| logprobs_field(api, &[e])).unwrap_or(Value::Null);
            match self.out.on_event(event) {
                Step::Nothing => continue,
                Step::Text { text, logprobs } => {
                    return Some(sse(&self.meta.envelope(true, json!([choice(api, true, &text, logprobs_of(logprobs), None)]))));
                }
                Step::Finished { tail, calls, reason } => {
                    self.ended = true;
                    // Dropping the receiver cancels a sequence that a stop string ended.
                    self.events.close();
                    let mut s = String::new();
                    if !tail.is_empty() {
                        s += &sse(&self.meta.envelope(true, json!([choice(api, true, &tail, Value::Null, None)])));
                    }
                    if !calls.is_empty() {
                        let delta = json!({"tool_calls": tool_calls_json(&calls, true)});
                        s += &sse(&self.meta.envelope(true, json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": null}])));
                    }
                    let reason = finish_reason(reason, &calls);
                    s += &sse(&self.meta.envelope(true, json!([choice(api, true, &Split::default(), Value::Null, Some(reason))])));
                    if self.include_usage {
                        let mut u = self.meta.envelope(true, json!([]));
                        u["usage"] = usage_json(&self.out.usage);
                        s += &sse(&u);
                    }
                    s += "data: [DONE]\n\n";
                    return Some(s);
                }
                Step::Failed(message) => {
                    self.ended = true;
                    return Some(sse(&ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message).body()));
                }
            }
        }
    }
}

fn stream_response(events: UnboundedReceiver<Event>, out: Output, meta: ResponseMeta, include_usage: bool) -> Response {
    let prelude = (meta.api == Api::Chat)
        .then(|| sse(&meta.envelope(true, json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]))));
    let state = StreamState { events, out, meta, include_usage, prelude, ended: false };
    let stream = futures_util::stream::unfold(state, |mut s| async move { s.next().await.map(|chunk| (Ok::<_, Infallible>(Bytes::from(chunk)), s)) });
    ([(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], Body::from_stream(stream)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reasoning::ReasoningSyntax;
    use crate::tool_calls::ToolSyntax;

    fn bundled_tokenizer() -> Arc<Tokenizer> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/stories260K.gguf");
        Arc::new(Tokenizer::from_gguf(&kiln_gguf::GgufFile::open(&path).unwrap()).unwrap())
    }

    fn chat_output(parsers: AnswerParsers) -> Output {
        Output {
            tokenizer: bundled_tokenizer(),
            utf8: Utf8Assembler::default(),
            stop: StopMatcher::new(Vec::new()),
            usage: Usage::default(),
            api: Api::Chat,
            logprobs: false,
            text_offset: 0,
            parsers,
        }
    }

    /// A thinking model's answer that calls a tool, text in pieces of 3 bytes: reasoning,
    /// content before the call and the call come apart, and the whole choice says so.
    #[test]
    fn an_answer_with_reasoning_and_a_tool_call() {
        let answer = "<think>\nWeather needs a lookup.\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
        let reasoning = Some(ReasoningSyntax::Think.splitter("<|im_start|>assistant\n"));
        let catcher = ToolCallCatcher::new(ToolSyntax::HermesJson, vec![]);
        let mut out = chat_output(AnswerParsers { reasoning, tool_calls: Some(catcher), shown: vec![] });
        let mut text = Split::default();
        for piece in answer.as_bytes().chunks(3) {
            let part = out.split(String::from_utf8(piece.to_vec()).unwrap());
            text.reasoning += &part.reasoning;
            text.content += &part.content;
        }
        let (tail, calls) = out.split_tail(String::new());
        text.reasoning += &tail.reasoning;
        text.content += &tail.content;
        assert_eq!((text.reasoning.as_str(), text.content.as_str()), ("Weather needs a lookup.", "Let me check.\n"));
        let choice = whole_choice(Api::Chat, &text, &calls, Value::Null, "stop");
        assert_eq!(choice["finish_reason"], "tool_calls");
        let message = &choice["message"];
        assert_eq!((&message["content"], &message["reasoning_content"]), (&json!("Let me check."), &json!("Weather needs a lookup.")));
        let call = &message["tool_calls"][0];
        assert_eq!((&call["type"], &call["function"]["name"]), (&json!("function"), &json!("get_weather")));
        assert_eq!(serde_json::from_str::<Value>(call["function"]["arguments"].as_str().unwrap()).unwrap(), json!({"city": "Oslo"}));
        assert!(call["id"].as_str().unwrap().starts_with("call_"));
        // Streamed, the calls carry their index.
        assert_eq!(tool_calls_json(&calls, true)[0]["index"], 0);
    }

    /// gpt-oss: the call comes from the harmony header's recipient; nothing is content.
    #[test]
    fn a_harmony_call_is_a_tool_call() {
        let reasoning = Some(ReasoningSyntax::Harmony.splitter("<|start|>assistant"));
        let mut out = chat_output(AnswerParsers { reasoning, tool_calls: None, shown: vec![] });
        let text = out.split("<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json<|message|>{\"q\": \"kiln\"}".into());
        let (tail, calls) = out.split_tail(String::new());
        assert_eq!((text.reasoning.as_str(), text.content.as_str(), tail.content.as_str()), ("Look it up.", "", ""));
        let choice = whole_choice(Api::Chat, &text, &calls, Value::Null, "stop");
        assert_eq!((&choice["message"]["content"], &choice["message"]["tool_calls"][0]["function"]["name"]), (&Value::Null, &json!("search")));
    }
}
