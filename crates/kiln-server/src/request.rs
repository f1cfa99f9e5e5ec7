//! Parsing and checking request bodies. Every field is read from the JSON by hand, so that a
//! wrong type or value answers 400 with the name of the field.

use kiln_core::SamplingParams;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::reasoning::ReasoningFormat;

pub type Object = Map<String, Value>;

/// The most alternatives `top_logprobs` / `logprobs` may ask for.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The most stop strings a request may give: each is searched for after every token.
pub const MAX_STOP_STRINGS: usize = 64;

/// The most choices (`n`) a request may ask for: each is a sequence of its own.
pub const MAX_CHOICES: usize = 16;

pub fn parse_object(body: &[u8]) -> Result<Object, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(ApiError::bad_request("the request body must be a JSON object")),
        Err(e) => Err(ApiError::bad_request(format!("malformed JSON in the request body: {e}"))),
    }
}

fn type_error(name: &str, want: &str) -> ApiError {
    ApiError::field(name, format!("must be {want}"))
}

/// A field, treating JSON `null` as absent.
fn get<'a>(o: &'a Object, name: &str) -> Option<&'a Value> {
    o.get(name).filter(|v| !v.is_null())
}

pub fn opt_bool(o: &Object, name: &str) -> Result<Option<bool>, ApiError> {
    get(o, name).map(|v| v.as_bool().ok_or_else(|| type_error(name, "a boolean"))).transpose()
}

pub fn opt_str<'a>(o: &'a Object, name: &str) -> Result<Option<&'a str>, ApiError> {
    get(o, name).map(|v| v.as_str().ok_or_else(|| type_error(name, "a string"))).transpose()
}

fn opt_i64(o: &Object, name: &str) -> Result<Option<i64>, ApiError> {
    get(o, name).map(|v| v.as_i64().ok_or_else(|| type_error(name, "an integer"))).transpose()
}

fn opt_f32(o: &Object, name: &str) -> Result<Option<f32>, ApiError> {
    get(o, name).map(|v| v.as_f64().map(|x| x as f32).filter(|x| x.is_finite()).ok_or_else(|| type_error(name, "a finite number"))).transpose()
}

/// A number field checked against `ok`, described by `range` in the error.
fn checked_f32(o: &Object, name: &str, range: &str, ok: impl Fn(f32) -> bool) -> Result<Option<f32>, ApiError> {
    match opt_f32(o, name)? {
        Some(x) if !ok(x) => Err(ApiError::field(name, format!("must be {range}, got {x}"))),
        x => Ok(x),
    }
}

fn count_field(o: &Object, name: &str, max: usize) -> Result<Option<usize>, ApiError> {
    match opt_i64(o, name)? {
        Some(n) if n < 0 || n as u64 > max as u64 => Err(ApiError::field(name, format!("must be between 0 and {max}, got {n}"))),
        n => Ok(n.map(|n| n as usize)),
    }
}

/// The settings of a generation request shared by both endpoints.
#[derive(Clone, Debug)]
pub struct GenerationFields {
    /// Asked-for tokens at most; `None`: up to the context.
    pub max_tokens: Option<usize>,
    /// Choices to generate, each its own sequence.
    pub n: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
    /// `Some(n)`: log-probabilities with `n` alternatives per token.
    pub logprobs: Option<usize>,
    /// `reasoning_format`, where the request names one.
    pub reasoning_format: Option<ReasoningFormat>,
    /// Whether tool calls are read from the answer (`tool_choice` other than "none").
    pub read_tool_calls: bool,
}

pub(crate) fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish()
}

fn sampling(o: &Object) -> Result<SamplingParams, ApiError> {
    let mut p = SamplingParams { seed: random_seed(), ..SamplingParams::default() };
    if let Some(t) = checked_f32(o, "temperature", "at least 0", |t| t >= 0.0)? {
        p.temperature = t;
    }
    if let Some(x) = checked_f32(o, "top_p", "in (0, 1]", |x| x > 0.0 && x <= 1.0)? {
        p.top_p = x;
    }
    if let Some(x) = checked_f32(o, "min_p", "in [0, 1]", |x| (0.0..=1.0).contains(&x))? {
        p.min_p = x;
    }
    match opt_i64(o, "top_k")? {
        Some(k) if k < 0 => return Err(ApiError::field("top_k", format!("must be at least 0 (0 keeps every token), got {k}"))),
        Some(k) => p.top_k = k as usize,
        None => {}
    }
    if let Some(x) = checked_f32(o, "repeat_penalty", "greater than 0", |x| x > 0.0)? {
        p.repeat_penalty = x;
    }
    if let Some(x) = checked_f32(o, "presence_penalty", "between -2 and 2", |x| (-2.0..=2.0).contains(&x))? {
        p.presence_penalty = x;
    }
    if let Some(x) = checked_f32(o, "frequency_penalty", "between -2 and 2", |x| (-2.0..=2.0).contains(&x))? {
        p.frequency_penalty = x;
    }
    if let Some(n) = count_field(o, "repeat_last_n", 256)? {
        p.repeat_last_n = n;
    }
    // Any 64-bit integer, signed or not.
    if let Some(seed) = get(o, "seed") {
        p.seed = seed.as_u64().or_else(|| seed.as_i64().map(|s| s as u64)).ok_or_else(|| type_error("seed", "an integer"))?;
    }
    Ok(p)
}

fn stop_strings(o: &Object) -> Result<Vec<String>, ApiError> {
    match get(o, "stop") {
        None => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) if items.len() > MAX_STOP_STRINGS => {
            Err(ApiError::field("stop", format!("at most {MAX_STOP_STRINGS} stop strings, got {}", items.len())))
        }
        Some(Value::Array(items)) => {
            items.iter().map(|v| v.as_str().map(str::to_string).ok_or_else(|| type_error("stop", "a string or a list of strings"))).collect()
        }
        Some(_) => Err(type_error("stop", "a string or a list of strings")),
    }
}

/// OpenAI (and llama.cpp) fields that would change the output and that kiln does not
/// implement: any value but the neutral one is refused rather than quietly ignored.
fn refuse_unsupported(o: &Object) -> Result<(), ApiError> {
    let neutral = |name: &str, v: &Value| match name {
        "logit_bias" => v.as_object().is_some_and(|m| m.is_empty()),
        "echo" => v == &Value::Bool(false),
        "best_of" => v.as_i64() == Some(1),
        "suffix" => v.as_str() == Some(""),
        "response_format" => v.get("type").and_then(Value::as_str) == Some("text"),
        // Calls are read from what the model writes; nothing forces one.
        "tool_choice" => matches!(v.as_str(), Some("auto" | "none")),
        _ => false,
    };
    for name in ["logit_bias", "echo", "best_of", "suffix", "response_format", "grammar", "json_schema", "tool_choice"] {
        if get(o, name).is_some_and(|v| !neutral(name, v)) {
            let what = if name == "tool_choice" {
                "is not supported beyond \"auto\" and \"none\" (nothing can force a call)"
            } else {
                "is not supported by this server"
            };
            return Err(ApiError::field(name, what));
        }
    }
    Ok(())
}

/// Reads the generation fields; `chat` selects the chat endpoint's spellings of max tokens
/// and logprobs.
pub fn generation_fields(o: &Object, chat: bool) -> Result<GenerationFields, ApiError> {
    if let Some(model) = get(o, "model") {
        if !model.is_string() {
            return Err(type_error("model", "a string"));
        }
    }
    let n = match opt_i64(o, "n")? {
        None => 1,
        Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => n as usize,
        Some(n) => return Err(ApiError::field("n", format!("must be between 1 and {MAX_CHOICES}, got {n}"))),
    };
    refuse_unsupported(o)?;
    let max_name = if chat && get(o, "max_completion_tokens").is_some() { "max_completion_tokens" } else { "max_tokens" };
    let max_tokens = match opt_i64(o, max_name)? {
        Some(n) if n <= 0 => return Err(ApiError::field(max_name, format!("must be at least 1, got {n}"))),
        n => n.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
    };
    let logprobs = if chat {
        let top = count_field(o, "top_logprobs", MAX_TOP_LOGPROBS)?;
        match opt_bool(o, "logprobs")? {
            Some(true) => Some(top.unwrap_or(0)),
            _ if top.is_some_and(|n| n > 0) => return Err(ApiError::field("top_logprobs", "needs \"logprobs\": true")),
            _ => None,
        }
    } else {
        match get(o, "logprobs") {
            Some(Value::Bool(b)) => b.then_some(0),
            _ => count_field(o, "logprobs", MAX_TOP_LOGPROBS)?,
        }
    };
    let include_usage = match get(o, "stream_options") {
        None => false,
        Some(Value::Object(so)) => opt_bool(so, "include_usage").map_err(|_| type_error("stream_options.include_usage", "a boolean"))?.unwrap_or(false),
        Some(_) => return Err(type_error("stream_options", "an object")),
    };
    Ok(GenerationFields {
        max_tokens,
        n,
        sampling: sampling(o)?,
        stop: stop_strings(o)?,
        stream: opt_bool(o, "stream")?.unwrap_or(false),
        include_usage,
        ignore_eos: opt_bool(o, "ignore_eos")?.unwrap_or(false),
        logprobs,
        read_tool_calls: get(o, "tool_choice").and_then(Value::as_str) != Some("none"),
        reasoning_format: match opt_str(o, "reasoning_format")? {
            None => None,
            Some(name) => {
                Some(ReasoningFormat::parse(name).ok_or_else(|| ApiError::field("reasoning_format", format!("must be auto, deepseek or none, got {name:?}")))?)
            }
        },
    })
}

/// A completion prompt: text, or token ids given directly.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

fn token_ids(items: &[Value], name: &str) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or_else(|| type_error(name, "a list of token ids (non-negative integers)")))
        .collect()
}

/// `prompt`: a string, a list of token ids, or a list holding one string or one id list.
pub fn completion_prompt(o: &Object) -> Result<Prompt, ApiError> {
    let want = "a string, a list of token ids, or a list of one of those";
    let prompt = match get(o, "prompt") {
        None => return Err(ApiError::field("prompt", "is required")),
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(items)) => match items.as_slice() {
            [Value::String(s)] => Prompt::Text(s.clone()),
            [Value::Array(ids)] => Prompt::Tokens(token_ids(ids, "prompt")?),
            [] => return Err(ApiError::field("prompt", "must not be empty")),
            items if items.iter().all(Value::is_number) => Prompt::Tokens(token_ids(items, "prompt")?),
            _ if items.len() > 1 && items.iter().all(|v| v.is_string() || v.is_array()) => {
                return Err(ApiError::field("prompt", "batches of several prompts are not supported; send one request per prompt"))
            }
            _ => return Err(type_error("prompt", want)),
        },
        Some(_) => return Err(type_error("prompt", want)),
    };
    match &prompt {
        Prompt::Text(t) if t.is_empty() => Err(ApiError::field("prompt", "must not be empty")),
        Prompt::Tokens(t) if t.is_empty() => Err(ApiError::field("prompt", "must not be empty")),
        _ => Ok(prompt),
    }
}

const ROLES: [&str; 6] = ["system", "developer", "user", "assistant", "tool", "ipython"];

/// Checks `messages`: a non-empty list of objects with a known role and text content (a
/// string, a list of text parts, or null for an assistant turn with tool calls).
pub fn chat_messages(o: &Object) -> Result<&Vec<Value>, ApiError> {
    let messages = match get(o, "messages") {
        None => return Err(ApiError::field("messages", "is required")),
        Some(Value::Array(m)) => m,
        Some(_) => return Err(type_error("messages", "a list of messages")),
    };
    if messages.is_empty() {
        return Err(ApiError::field("messages", "must not be empty"));
    }
    for (i, m) in messages.iter().enumerate() {
        let field = |f: &str| format!("messages[{i}].{f}");
        let Some(m) = m.as_object() else { return Err(type_error(&format!("messages[{i}]"), "an object")) };
        let role = opt_str(m, "role").map_err(|_| type_error(&field("role"), "a string"))?.ok_or_else(|| ApiError::field(&field("role"), "is required"))?;
        if !ROLES.contains(&role) {
            return Err(ApiError::field(&field("role"), format!("unknown role '{role}' (expected one of {})", ROLES.join(", "))));
        }
        match get(m, "content") {
            Some(Value::String(_)) => {}
            None if role == "assistant" => {}
            Some(Value::Array(parts)) => {
                for (j, p) in parts.iter().enumerate() {
                    if p.get("type").and_then(Value::as_str) != Some("text") || !p.get("text").is_some_and(Value::is_string) {
                        return Err(ApiError::field(&format!("messages[{i}].content[{j}]"), "must be a text part {\"type\": \"text\", \"text\": \"...\"}"));
                    }
                }
            }
            None => return Err(ApiError::field(&field("content"), "is required")),
            Some(_) => return Err(type_error(&field("content"), "a string or a list of text parts")),
        }
        if get(m, "tool_calls").is_some_and(|c| !is_list_of_objects(c)) {
            return Err(type_error(&field("tool_calls"), "a list of tool call objects"));
        }
    }
    Ok(messages)
}

fn is_list_of_objects(v: &Value) -> bool {
    v.as_array().is_some_and(|items| items.iter().all(Value::is_object))
}

/// `tools`, when given: a list of tool objects (a template iterating over anything else would
/// render nonsense, such as one tool per character of a string).
pub fn chat_tools(o: &Object) -> Result<Option<&Value>, ApiError> {
    match get(o, "tools") {
        Some(t) if !is_list_of_objects(t) => Err(type_error("tools", "a list of tool objects")),
        t => Ok(t),
    }
}

/// A message's content as one string (text parts joined).
pub fn message_text(m: &Value) -> String {
    match m.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect(),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Object {
        v.as_object().unwrap().clone()
    }

    fn param_of(r: Result<GenerationFields, ApiError>) -> String {
        r.unwrap_err().param.unwrap()
    }

    #[test]
    fn bad_values_name_their_field() {
        for (body, field) in [
            (json!({"temperature": -1}), "temperature"),
            (json!({"temperature": "hot"}), "temperature"),
            (json!({"top_p": 0}), "top_p"),
            (json!({"top_p": 1.5}), "top_p"),
            (json!({"top_k": -3}), "top_k"),
            (json!({"min_p": 2}), "min_p"),
            (json!({"max_tokens": 0}), "max_tokens"),
            (json!({"max_tokens": -5}), "max_tokens"),
            (json!({"max_tokens": 1.5}), "max_tokens"),
            (json!({"presence_penalty": 3}), "presence_penalty"),
            (json!({"frequency_penalty": -2.5}), "frequency_penalty"),
            (json!({"repeat_penalty": 0}), "repeat_penalty"),
            (json!({"stop": 3}), "stop"),
            (json!({"stop": ["a", 1]}), "stop"),
            (json!({"stream": "yes"}), "stream"),
            (json!({"seed": "x"}), "seed"),
            (json!({"logprobs": 21}), "logprobs"),
            (json!({"model": 5}), "model"),
            (json!({"stream_options": {"include_usage": 1}}), "stream_options.include_usage"),
            (json!({"stop": vec!["x"; MAX_STOP_STRINGS + 1]}), "stop"),
            (json!({"logit_bias": {"5": 100}}), "logit_bias"),
            (json!({"logit_bias": [1, 2]}), "logit_bias"),
            (json!({"echo": true}), "echo"),
            (json!({"best_of": 3}), "best_of"),
            (json!({"suffix": "end"}), "suffix"),
            (json!({"response_format": {"type": "json_object"}}), "response_format"),
            (json!({"grammar": "root ::= \"a\""}), "grammar"),
        ] {
            assert_eq!(param_of(generation_fields(&obj(body.clone()), false)), field, "{body}");
        }
        assert_eq!(param_of(generation_fields(&obj(json!({"max_completion_tokens": 0})), true)), "max_completion_tokens");
        assert_eq!(param_of(generation_fields(&obj(json!({"top_logprobs": 3})), true)), "top_logprobs");
    }

    #[test]
    fn good_fields_become_settings() {
        let body = json!({"temperature": 0, "top_k": 5, "top_p": 0.5, "seed": 9, "stop": "x", "max_tokens": 7, "stream": true,
            "stream_options": {"include_usage": true}, "presence_penalty": 0.5, "logprobs": true, "top_logprobs": 2, "ignore_eos": true});
        let f = generation_fields(&obj(body), true).unwrap();
        assert_eq!((f.sampling.temperature, f.sampling.top_k, f.sampling.top_p, f.sampling.seed), (0.0, 5, 0.5, 9));
        assert_eq!((f.stop, f.max_tokens, f.stream, f.include_usage, f.logprobs, f.ignore_eos), (vec!["x".to_string()], Some(7), true, true, Some(2), true));
        assert_eq!(f.sampling.presence_penalty, 0.5);
        assert_eq!(generation_fields(&obj(json!({"logprobs": 3, "temperature": null})), false).unwrap().logprobs, Some(3));
        // The neutral values of unsupported fields, as some clients always send them.
        let neutral = json!({"logit_bias": {}, "echo": false, "best_of": 1, "suffix": "", "response_format": {"type": "text"}, "n": 1});
        assert!(generation_fields(&obj(neutral), true).is_ok());
        assert_eq!(generation_fields(&obj(json!({"seed": u64::MAX})), false).unwrap().sampling.seed, u64::MAX);
        assert_eq!(generation_fields(&obj(json!({"seed": -1})), false).unwrap().sampling.seed, u64::MAX);
        assert_eq!(generation_fields(&obj(json!({"stop": vec!["x"; MAX_STOP_STRINGS]})), false).unwrap().stop.len(), MAX_STOP_STRINGS);
    }

    #[test]
    fn temperatures_too_small_to_invert_are_greedy() {
        // 1/t is infinite for these: the sampler takes them as greedy.
        for t in [1e-45, 1e-39] {
            assert!(generation_fields(&obj(json!({"temperature": t})), false).unwrap().sampling.is_greedy(), "{t}");
        }
        assert_eq!(generation_fields(&obj(json!({"temperature": 1e-30})), false).unwrap().sampling.temperature, 1e-30);
    }

    #[test]
    fn prompts_and_messages_are_checked() {
        assert_eq!(completion_prompt(&obj(json!({"prompt": "hi"}))).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(completion_prompt(&obj(json!({"prompt": ["hi"]}))).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(completion_prompt(&obj(json!({"prompt": [1, 2]}))).unwrap(), Prompt::Tokens(vec![1, 2]));
        assert_eq!(completion_prompt(&obj(json!({"prompt": [[3]]}))).unwrap(), Prompt::Tokens(vec![3]));
        for bad in
            [json!({}), json!({"prompt": ""}), json!({"prompt": []}), json!({"prompt": [1, -2]}), json!({"prompt": {"a": 1}}), json!({"prompt": ["a", "b"]})]
        {
            assert_eq!(completion_prompt(&obj(bad.clone())).unwrap_err().param.as_deref(), Some("prompt"), "{bad}");
        }
        let ok = json!({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]});
        let o = obj(ok);
        let m = chat_messages(&o).unwrap();
        assert_eq!(message_text(&m[1]), "ab");
        for (bad, field) in [
            (json!({"messages": []}), "messages"),
            (json!({"messages": "hi"}), "messages"),
            (json!({"messages": [{"role": "wizard", "content": "x"}]}), "messages[0].role"),
            (json!({"messages": [{"content": "x"}]}), "messages[0].role"),
            (json!({"messages": [{"role": "user"}]}), "messages[0].content"),
            (json!({"messages": [{"role": "user", "content": 5}]}), "messages[0].content"),
            (json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), "messages[0].content[0]"),
            (json!({"messages": [1]}), "messages[0]"),
            (json!({"messages": [{"role": "assistant", "content": "", "tool_calls": "x"}]}), "messages[0].tool_calls"),
            (json!({"messages": [{"role": "assistant", "content": "", "tool_calls": [1]}]}), "messages[0].tool_calls"),
        ] {
            assert_eq!(chat_messages(&obj(bad.clone())).unwrap_err().param.as_deref(), Some(field), "{bad}");
        }
        for bad in [json!({"tools": "abc"}), json!({"tools": {"type": "function"}}), json!({"tools": ["f"]})] {
            assert_eq!(chat_tools(&obj(bad.clone())).unwrap_err().param.as_deref(), Some("tools"), "{bad}");
        }
        assert!(chat_tools(&obj(json!({"tools": [{"type": "function", "function": {"name": "f"}}]}))).unwrap().is_some());
        assert!(chat_tools(&obj(json!({"tools": null}))).unwrap().is_none());
        assert!(parse_object(b"{bad").unwrap_err().message.contains("malformed JSON"));
        assert!(parse_object(b"[1]").is_err());
    }
}
