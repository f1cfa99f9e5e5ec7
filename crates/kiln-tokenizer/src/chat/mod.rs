//! Chat templates: Hugging Face-style Jinja templates rendered as `transformers`'
//! `apply_chat_template` renders them (see `env` for the Jinja environment), over OpenAI / HF
//! shaped JSON messages, tools and extra template variables.

mod builtin;
mod env;
mod time;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::Value;
use minijinja::Environment;
use serde_json::{Map, Value as Json};

use crate::TokenizerError;

pub use builtin::{builtin_template, BUILTIN_TEMPLATES};
pub use time::{strftime, unix_seconds};

/// One chat turn with plain text content (see [`ChatInputs`] for full JSON messages).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// ChatML, the template llama.cpp falls back to when a model has none.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Everything a template renders from, as `apply_chat_template` takes it.
#[derive(Clone, Copy, Debug)]
pub struct ChatInputs<'a> {
    /// JSON array of messages, OpenAI / HF shape (content a string, null or a list of parts;
    /// `tool_calls`; `reasoning_content` ...).
    pub messages: &'a Json,
    /// `None`: the template sees `tools = none`.
    pub tools: Option<&'a Json>,
    pub add_generation_prompt: bool,
    /// Extra template variables (`chat_template_kwargs`, e.g. `enable_thinking`).
    pub extra: Option<&'a Map<String, Json>>,
    /// `None`: the variable is undefined.
    pub bos_token: Option<&'a str>,
    pub eos_token: Option<&'a str>,
    /// `strftime_now`'s instant (read as UTC); `None` = the real clock.
    pub now: Option<SystemTime>,
}

static NO_MESSAGES: Json = Json::Array(Vec::new());

impl Default for ChatInputs<'_> {
    /// No messages, no tools, no generation prompt, no special tokens, the real clock.
    fn default() -> Self {
        ChatInputs { messages: &NO_MESSAGES, tools: None, add_generation_prompt: false, extra: None, bos_token: None, eos_token: None, now: None }
    }
}

/// A compiled chat template; cheap to clone and share between threads.
#[derive(Clone)]
pub struct ChatTemplate {
    inner: Arc<Inner>,
}

struct Inner {
    source: String,
    env: Environment<'static>,
}

const TEMPLATE_NAME: &str = "chat_template";

/// Variables `apply_chat_template` sets itself, which extra variables may not replace.
const RESERVED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("source", &self.inner.source).finish()
    }
}

impl ChatTemplate {
    /// Compiles `source`; fails on syntax errors.
    pub fn new(source: impl Into<String>) -> Result<ChatTemplate, TokenizerError> {
        let source = source.into();
        let mut env = env::environment();
        env.add_template_owned(TEMPLATE_NAME, env::guard_loops(&source)).map_err(template_error)?;
        Ok(ChatTemplate { inner: Arc::new(Inner { source, env }) })
    }

    /// The template text as given.
    pub fn source(&self) -> &str {
        &self.inner.source
    }

    /// The template a user asked for: `requested` (`--chat-template NAME|FILE`: a built-in name,
    /// else a file path), else the model's `tokenizer.chat_template`.
    pub fn resolve(requested: Option<&str>, from_model: Option<&str>) -> Result<ChatTemplate, TokenizerError> {
        match (requested, from_model) {
            (Some(req), _) => {
                if let Some(source) = builtin_template(req) {
                    return ChatTemplate::new(source);
                }
                let path = std::path::Path::new(req);
                if !path.is_file() {
                    return Err(TokenizerError::Template(format!(
                        "--chat-template {req:?} is neither a built-in template ({}) nor a file",
                        BUILTIN_TEMPLATES.join(", ")
                    )));
                }
                let source = std::fs::read_to_string(path).map_err(|e| TokenizerError::Template(format!("--chat-template {}: {e}", path.display())))?;
                ChatTemplate::new(source).map_err(|e| TokenizerError::Template(format!("--chat-template {}: {e}", path.display())))
            }
            (None, Some(source)) => ChatTemplate::new(source).map_err(|e| TokenizerError::Template(format!("the model's tokenizer.chat_template: {e}"))),
            (None, None) => Err(TokenizerError::NoChatTemplate(BUILTIN_TEMPLATES.join(", "))),
        }
    }

    /// Renders `inputs` as `transformers`' `apply_chat_template(..., tokenize=False)` does.
    pub fn render(&self, inputs: &ChatInputs) -> Result<String, TokenizerError> {
        let messages = template_messages(inputs.messages)?;
        let mut vars: Vec<(String, Value)> = Vec::new();
        for (name, token) in [("bos_token", inputs.bos_token), ("eos_token", inputs.eos_token)] {
            if let Some(token) = token {
                vars.push((name.into(), Value::from(token)));
            }
        }
        for (key, value) in inputs.extra.into_iter().flatten() {
            if RESERVED.contains(&key.as_str()) {
                return Err(TokenizerError::Template(format!("extra template variable {key:?} is set by the renderer itself")));
            }
            vars.push((key.clone(), Value::from_serialize(value)));
        }
        vars.push(("messages".into(), Value::from_serialize(&messages)));
        vars.push(("tools".into(), inputs.tools.map_or(Value::from(()), Value::from_serialize)));
        vars.push(("documents".into(), Value::from(())));
        vars.push(("add_generation_prompt".into(), Value::from(inputs.add_generation_prompt)));
        if let Some(now) = inputs.now {
            let secs = match now.duration_since(UNIX_EPOCH) {
                Ok(d) => d.as_secs() as i64,
                Err(e) => -(e.duration().as_secs_f64().ceil() as i64),
            };
            vars.push((env::NOW_VAR.into(), Value::from(secs)));
        }
        // Later entries win, as in `{**special_tokens, **kwargs}`.
        let ctx: Value = vars.into_iter().collect();
        let template = self.inner.env.get_template(TEMPLATE_NAME).map_err(template_error)?;
        template.render(ctx).map_err(template_error)
    }
}

/// The messages the template sees: each message without its `None`-valued keys, and with
/// `reasoning_content` / `thinking` filled from the first of `reasoning_content`, `thinking`,
/// `reasoning` it has (`{"thinking": r, **message, "reasoning_content": r}`).
fn template_messages(messages: &Json) -> Result<Json, TokenizerError> {
    let list = messages.as_array().ok_or_else(|| TokenizerError::Template(format!("messages must be a JSON array, not {}", json_kind(messages))))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, message) in list.iter().enumerate() {
        let obj = message.as_object().ok_or_else(|| TokenizerError::Template(format!("messages[{i}] must be a JSON object, not {}", json_kind(message))))?;
        let present: Map<String, Json> = obj.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), v.clone())).collect();
        let reasoning = ["reasoning_content", "thinking", "reasoning"].iter().find_map(|k| present.get(*k)).cloned();
        let Some(reasoning) = reasoning else {
            out.push(Json::Object(present));
            continue;
        };
        let mut aliased = Map::new();
        aliased.insert("thinking".into(), present.get("thinking").cloned().unwrap_or_else(|| reasoning.clone()));
        for (k, v) in present {
            aliased.insert(k, v);
        }
        aliased.insert("reasoning_content".into(), reasoning);
        out.push(Json::Object(aliased));
    }
    Ok(Json::Array(out))
}

fn json_kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

/// A minijinja error as a [`TokenizerError`]: `raise_exception` messages as they were raised,
/// anything else with minijinja's detail and location.
fn template_error(e: minijinja::Error) -> TokenizerError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(err) = source {
        if let Some(raised) = err.downcast_ref::<env::Raised>() {
            return TokenizerError::TemplateException(raised.0.clone());
        }
        source = err.source();
    }
    let mut msg = e.to_string();
    if let Some(detail) = e.detail() {
        if !msg.contains(detail) {
            msg = format!("{msg}: {detail}");
        }
    }
    TokenizerError::Template(msg)
}

/// Renders a chat template over plain role/content messages, with `bos_token` and `eos_token`.
pub fn render_chat_template(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, TokenizerError> {
    let messages = serde_json::to_value(messages).map_err(|e| TokenizerError::Template(e.to_string()))?;
    let inputs = ChatInputs { messages: &messages, add_generation_prompt, bos_token: Some(bos_token), eos_token: Some(eos_token), ..Default::default() };
    ChatTemplate::new(template)?.render(&inputs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(template: &str, messages: Json) -> Result<String, TokenizerError> {
        ChatTemplate::new(template)?.render(&ChatInputs { messages: &messages, ..Default::default() })
    }

    #[test]
    fn tojson_uses_python_spacing_without_html_escaping() {
        let msgs = [ChatMessage::new("user", "<b>é</b>")];
        let out = render_chat_template("{{ messages|tojson }}|{{ {'a': [1, 2]}|tojson(indent=2) }}", &msgs, false, "", "").unwrap();
        assert_eq!(out, "[{\"role\": \"user\", \"content\": \"<b>é</b>\"}]|{\n  \"a\": [\n    1,\n    2\n  ]\n}");
    }

    #[test]
    fn raise_exception_keeps_its_message() {
        let err =
            render_chat_template("{% macro f() %}{{ raise_exception('only user and assistant') }}{% endmacro %}{{ f() }}", &[], false, "", "").unwrap_err();
        assert!(matches!(&err, TokenizerError::TemplateException(m) if m == "only user and assistant"), "{err:?}");
    }

    #[test]
    fn python_string_methods_and_block_trimming() {
        let msgs = [ChatMessage::new("user", "  hi  ")];
        // lstrip_blocks removes the indentation before block tags, trim_blocks the newline after them.
        let t = "{% for m in messages %}\n    {% if m.role.startswith('us') %}\n{{ m['content'].strip() }}!\n    {% endif %}\n{% endfor %}";
        assert_eq!(render_chat_template(t, &msgs, false, "", "").unwrap(), "hi!\n");
    }

    #[test]
    fn syntax_error_is_reported() {
        assert!(matches!(ChatTemplate::new("{% if %}"), Err(TokenizerError::Template(_))));
        assert!(matches!(render_chat_template("{% for x in %}", &[], false, "", ""), Err(TokenizerError::Template(_))));
    }

    #[test]
    fn none_keys_dropped_and_reasoning_aliased() {
        let out = render(
            "{% for m in messages %}{{ m|tojson }}\n{% endfor %}",
            json!([{"role": "assistant", "content": null, "reasoning": "r"}, {"role": "user", "thinking": "t", "content": "c"}]),
        )
        .unwrap();
        assert_eq!(
            out,
            "{\"thinking\": \"r\", \"role\": \"assistant\", \"reasoning\": \"r\", \"reasoning_content\": \"r\"}\n{\"thinking\": \"t\", \"role\": \"user\", \"content\": \"c\", \"reasoning_content\": \"t\"}\n"
        );
    }

    #[test]
    fn python_printing_and_none_iteration() {
        let out = render("{{ true }} {{ none }} {{ [1, 'a'] }} {{ false|string }} {{ '\u{1c} x '|trim }}|{{ tools }}", json!([])).unwrap();
        assert_eq!(out, "True None [1, 'a'] False x|None");
        let err = render("{% for t in tools %}{% endfor %}", json!([])).unwrap_err();
        assert!(err.to_string().contains("not iterable"), "{err}");
        assert_eq!(render("{% for t in undefined_thing %}x{% endfor %}ok", json!([])).unwrap(), "ok");
    }

    #[test]
    fn strftime_now_is_pinned_and_extra_variables_apply() {
        let t = ChatTemplate::new("{{ strftime_now('%Y-%m-%d %H:%M') }} {{ flag }} {{ bos_token is defined }}").unwrap();
        let now = UNIX_EPOCH + std::time::Duration::from_secs(unix_seconds(2026, 3, 5, 9, 8, 7).unwrap() as u64);
        let extra: Map<String, Json> = [("flag".to_string(), json!(false))].into_iter().collect();
        let inputs = ChatInputs { messages: &json!([]), extra: Some(&extra), now: Some(now), ..Default::default() };
        assert_eq!(t.render(&inputs).unwrap(), "2026-03-05 09:08 False False");
        let bad: Map<String, Json> = [("messages".to_string(), json!([]))].into_iter().collect();
        assert!(t.render(&ChatInputs { extra: Some(&bad), ..inputs }).is_err());
    }

    #[test]
    fn bad_messages_are_errors() {
        let t = ChatTemplate::new(CHATML_TEMPLATE).unwrap();
        for bad in [json!({"role": "user"}), json!(["hi"])] {
            let err = t.render(&ChatInputs { messages: &bad, ..Default::default() }).unwrap_err();
            assert!(err.to_string().contains("messages"), "{err}");
        }
    }

    #[test]
    fn resolve_prefers_the_request_and_names_both_options() {
        assert!(ChatTemplate::resolve(Some("chatml"), Some("{{ x }}")).unwrap().source().contains("<|im_start|>"));
        assert_eq!(ChatTemplate::resolve(None, Some("{{ x }}")).unwrap().source(), "{{ x }}");
        let err = ChatTemplate::resolve(None, None).unwrap_err().to_string();
        assert!(err.contains("--chat-template") && err.contains("tokenizer.chat_template") && err.contains("chatml"), "{err}");
        let err = ChatTemplate::resolve(Some("no-such-template"), None).unwrap_err().to_string();
        assert!(err.contains("no-such-template") && err.contains("llama3"), "{err}");
    }

    #[test]
    fn chat_template_is_send_sync() {
        fn assert_send_sync<T: Send + Sync + Clone>() {}
        assert_send_sync::<ChatTemplate>();
    }
}
