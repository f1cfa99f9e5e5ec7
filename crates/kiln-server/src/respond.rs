//! The shapes a generation is answered in: one JSON body once every choice has finished, or
//! server-sent events, a chunk per token of each choice (choices interleaved as their tokens
//! come), then the usage and `[DONE]`.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::error::ApiError;
use crate::generate::{Api, Output, Step};
use crate::reasoning::Split;
use crate::request::random_seed;
use crate::scheduler::{Event, Rejection, Usage};
use crate::tool_calls::ToolCall;

/// One choice of a response: its sequence's events and its output side.
pub struct Choice {
    pub index: usize,
    pub events: UnboundedReceiver<Event>,
    pub out: Output,
}

pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub api: Api,
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

/// The request's usage from its choices': the prompt counted once, the completions summed.
fn total_usage(choices: &[Usage]) -> Usage {
    Usage {
        prompt_tokens: choices.first().map_or(0, |u| u.prompt_tokens),
        completion_tokens: choices.iter().map(|u| u.completion_tokens).sum(),
        cached_tokens: choices.first().map_or(0, |u| u.cached_tokens),
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
pub fn tool_calls_json(calls: &[ToolCall], streamed: bool) -> Value {
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

fn choice(api: Api, index: usize, streamed: bool, text: &Split, logprobs: Value, finish: Option<&str>) -> Value {
    match (api, streamed) {
        (Api::Completion, _) => json!({"index": index, "text": text.content, "logprobs": logprobs, "finish_reason": finish}),
        (Api::Chat, false) => json!({"index": index, "message": chat_text(text, Some("assistant")), "logprobs": logprobs, "finish_reason": finish}),
        (Api::Chat, true) => {
            let delta = if finish.is_some() && text.is_empty() { json!({}) } else { chat_text(text, None) };
            json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
        }
    }
}

/// A choice of a whole (not streamed) response.
pub fn whole_choice(api: Api, index: usize, text: &Split, calls: &[ToolCall], logprobs: Value, reason: &'static str) -> Value {
    let mut answer = choice(api, index, false, text, logprobs, Some(finish_reason(reason, calls)));
    if !calls.is_empty() {
        // Blanks before the calls are no content (null where nothing else is).
        let content = text.content.trim_end();
        answer["message"]["content"] = if content.is_empty() { Value::Null } else { json!(content) };
        answer["message"]["tool_calls"] = tool_calls_json(calls, false);
    }
    answer
}

/// One choice run to its end: its JSON and its usage.
async fn finish_choice(mut c: Choice, api: Api) -> Result<(Value, Usage), ApiError> {
    let mut text = Split::default();
    let mut entries = Vec::new();
    loop {
        let Some(event) = c.events.recv().await else {
            return Err(ApiError::unavailable(Rejection::ShuttingDown.to_string(), 5));
        };
        match c.out.on_event(event) {
            Step::Nothing => {}
            Step::Text { text: t, logprobs } => {
                text.reasoning += &t.reasoning;
                text.content += &t.content;
                entries.extend(logprobs);
            }
            Step::Finished { tail, calls, reason } => {
                text.reasoning += &tail.reasoning;
                text.content += &tail.content;
                let logprobs = if c.out.logprobs { logprobs_field(api, &entries) } else { Value::Null };
                return Ok((whole_choice(api, c.index, &text, &calls, logprobs, reason), c.out.usage));
            }
            Step::Failed(message) => return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message)),
        }
    }
}

/// One JSON body once every choice has finished (they run together in the scheduler).
pub async fn whole_response(choices: Vec<Choice>, meta: ResponseMeta) -> Result<Response, ApiError> {
    let finished = futures_util::future::try_join_all(choices.into_iter().map(|c| finish_choice(c, meta.api))).await?;
    let (answers, usages): (Vec<Value>, Vec<Usage>) = finished.into_iter().unzip();
    let mut body = meta.envelope(false, Value::Array(answers));
    body["usage"] = usage_json(&total_usage(&usages));
    Ok(Json(body).into_response())
}

fn sse(value: &Value) -> String {
    format!("data: {value}\n\n")
}

/// What a choice's stream yields.
enum Piece {
    Chunk(String),
    /// The choice's last chunks, then its usage.
    Last(String, Usage),
    /// An error event that ends the whole response.
    Fatal(String),
}

/// A choice's events as chunks.
struct ChoiceStream {
    choice: Choice,
    meta: Arc<ResponseMeta>,
    ended: bool,
}

impl ChoiceStream {
    fn chunk(&self, choice: Value) -> String {
        sse(&self.meta.envelope(true, json!([choice])))
    }

    async fn next(&mut self) -> Option<Piece> {
        if self.ended {
            return None;
        }
        let (api, index) = (self.meta.api, self.choice.index);
        loop {
            let Some(event) = self.choice.events.recv().await else {
                self.ended = true;
                return Some(Piece::Fatal(sse(&ApiError::new(StatusCode::SERVICE_UNAVAILABLE, Rejection::ShuttingDown.to_string()).body())));
            };
            match self.choice.out.on_event(event) {
                Step::Nothing => continue,
                Step::Text { text, logprobs } => {
                    let logprobs = logprobs.map(|e| logprobs_field(api, &[e])).unwrap_or(Value::Null);
                    return Some(Piece::Chunk(self.chunk(choice(api, index, true, &text, logprobs, None))));
                }
                Step::Finished { tail, calls, reason } => {
                    self.ended = true;
                    // Dropping the receiver cancels a sequence that a stop string ended.
                    self.choice.events.close();
                    let mut s = String::new();
                    if !tail.is_empty() {
                        s += &self.chunk(choice(api, index, true, &tail, Value::Null, None));
                    }
                    if !calls.is_empty() {
                        let delta = json!({"tool_calls": tool_calls_json(&calls, true)});
                        s += &self.chunk(json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": null}));
                    }
                    s += &self.chunk(choice(api, index, true, &Split::default(), Value::Null, Some(finish_reason(reason, &calls))));
                    return Some(Piece::Last(s, self.choice.out.usage));
                }
                Step::Failed(message) => {
                    self.ended = true;
                    return Some(Piece::Fatal(sse(&ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message).body())));
                }
            }
        }
    }
}

/// Server-sent events: the chat role chunk of each choice, then each choice's chunks as they
/// come, then (when every choice has ended) the usage where asked for and `[DONE]`. An error
/// event ends the stream, and with it the other choices.
pub fn stream_response(choices: Vec<Choice>, meta: ResponseMeta, include_usage: bool) -> Response {
    let n = choices.len();
    let prelude: String = match meta.api {
        Api::Chat => (0..n)
            .map(|i| sse(&meta.envelope(true, json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]))))
            .collect(),
        Api::Completion => String::new(),
    };
    let body = event_stream(choices, Arc::new(meta), include_usage, prelude);
    ([(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], Body::from_stream(body)).into_response()
}

fn event_stream(
    choices: Vec<Choice>,
    meta: Arc<ResponseMeta>,
    include_usage: bool,
    prelude: String,
) -> impl futures_util::Stream<Item = Result<Bytes, Infallible>> {
    let n = choices.len();
    let merged = stream::select_all(choices.into_iter().map(|choice| {
        let s = ChoiceStream { choice, meta: meta.clone(), ended: false };
        Box::pin(stream::unfold(s, |mut s| async move { s.next().await.map(|piece| (piece, s)) }))
    }));
    let usages: Vec<Usage> = Vec::with_capacity(n);
    let first = (!prelude.is_empty()).then_some(prelude);
    stream::unfold((merged, usages, first, false), move |(mut merged, mut usages, first, over)| {
        let meta = meta.clone();
        async move {
            if over {
                return None;
            }
            if let Some(p) = first {
                return Some((Ok(Bytes::from(p)), (merged, usages, None, false)));
            }
            let text = match merged.next().await? {
                Piece::Chunk(s) => s,
                Piece::Fatal(s) => return Some((Ok(Bytes::from(s)), (merged, usages, None, true))),
                Piece::Last(mut s, usage) => {
                    usages.push(usage);
                    if usages.len() == n {
                        if include_usage {
                            let mut u = meta.envelope(true, json!([]));
                            u["usage"] = usage_json(&total_usage(&usages));
                            s += &sse(&u);
                        }
                        s += "data: [DONE]\n\n";
                    }
                    s
                }
            };
            Some((Ok(Bytes::from(text)), (merged, usages, None, false)))
        }
    })
}
