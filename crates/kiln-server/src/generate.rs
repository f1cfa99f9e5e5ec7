//! `/v1/completions` and `/v1/chat/completions`: checks a request, hands its choices to the
//! scheduler (a sequence each), and turns their token events into text (whole UTF-8 characters
//! only, stop strings held back, reasoning and tool calls read out), which [`crate::respond`]
//! sends as one JSON response or as server-sent events.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use kiln_core::SamplingParams;
use kiln_tokenizer::Tokenizer;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::http::AppState;
use crate::reasoning::{ReasoningSplitter, Split};
use crate::request::{chat_tools, completion_prompt, generation_fields, GenerationFields, Prompt};
use crate::respond::{stream_response, whole_response, Choice, ResponseMeta};
use crate::scheduler::{Event, GenerationRequest, Rejection, TokenLogprobs, Usage};
use crate::stop::StopMatcher;
use crate::tool_calls::{ToolCall, ToolCallCatcher};
use kiln_tokenizer::Utf8Assembler;

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Api {
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
    if fields.n > state.max_choices {
        return Err(ApiError::field("n", format!("{} choices do not fit this server's queue of {} sequences (raise -np)", fields.n, state.max_choices)));
    }
    let n_prompt = prompt.len();
    let mut choices = Vec::with_capacity(fields.n);
    for index in 0..fields.n {
        // Draws are a function of (seed, position): each choice gets its own seed.
        let sampling = SamplingParams { seed: fields.sampling.seed.wrapping_add(index as u64), ..fields.sampling };
        let request = GenerationRequest { prompt: prompt.clone(), sampling, max_tokens, ignore_eos: fields.ignore_eos, top_logprobs: fields.logprobs };
        // On a refusal the choices submitted so far are dropped, which cancels them.
        let events = state.scheduler.submit(request).await.map_err(|r| rejected(r, prompt_field))?;
        let out = Output {
            tokenizer: ready.tokenizer.clone(),
            utf8: Utf8Assembler::default(),
            stop: StopMatcher::new(fields.stop.clone()),
            usage: Usage { prompt_tokens: n_prompt, ..Usage::default() },
            api,
            logprobs: fields.logprobs.is_some(),
            text_offset: 0,
            parsers: parsers.clone(),
        };
        choices.push(Choice { index, events, out });
    }
    let id = state.next_id();
    let meta = ResponseMeta {
        id: format!("{}-{id}", if api == Api::Chat { "chatcmpl" } else { "cmpl" }),
        created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        model: ready.model_name.clone(),
        api,
    };
    if fields.stream {
        Ok(stream_response(choices, meta, fields.include_usage))
    } else {
        whole_response(choices, meta).await
    }
}

/// What reads a chat answer's parts: its reasoning and its tool calls, with the special
/// tokens their markers need shown.
#[derive(Clone, Default)]
pub struct AnswerParsers {
    pub reasoning: Option<ReasoningSplitter>,
    pub tool_calls: Option<ToolCallCatcher>,
    pub shown: Vec<u32>,
}

/// What one event turned into.
pub enum Step {
    Text { text: Split, logprobs: Option<Value> },
    Finished { tail: Split, calls: Vec<ToolCall>, reason: &'static str },
    Failed(String),
    Nothing,
}

/// One choice's output side: detokenizing, stop strings, counting.
pub struct Output {
    tokenizer: Arc<Tokenizer>,
    utf8: Utf8Assembler,
    stop: StopMatcher,
    pub usage: Usage,
    api: Api,
    pub logprobs: bool,
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

    pub fn on_event(&mut self, event: Event) -> Step {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reasoning::ReasoningSyntax;
    use crate::respond::{tool_calls_json, whole_choice};
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
        let choice = whole_choice(Api::Chat, 0, &text, &calls, Value::Null, "stop");
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
        let choice = whole_choice(Api::Chat, 0, &text, &calls, Value::Null, "stop");
        assert_eq!((&choice["message"]["content"], &choice["message"]["tool_calls"][0]["function"]["name"]), (&Value::Null, &json!("search")));
    }
}
