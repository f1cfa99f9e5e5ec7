//! The one adapter between the server and chat-template rendering (`kiln_tokenizer::ChatTemplate`,
//! which renders as transformers' `apply_chat_template`): picks the template and turns a request's
//! OpenAI-shaped messages into the template's inputs.

use kiln_tokenizer::{ChatInputs, ChatTemplate, Tokenizer, TokenizerError};
use serde_json::Value;

use crate::request::{message_text, Object};

/// What a template renders.
pub struct TemplateInputs<'a> {
    pub messages: &'a [Value],
    pub tools: Option<&'a Value>,
    pub add_generation_prompt: bool,
    /// `chat_template_kwargs`: extra variables for the template.
    pub extra: Option<&'a Object>,
}

/// `--chat-template NAME|FILE` when given, else the model's own template; none when neither
/// exists (chat requests are then refused with a message naming the flag).
pub fn resolve(requested: Option<&str>, from_model: Option<&str>) -> Result<Option<ChatTemplate>, String> {
    if requested.is_none() && from_model.is_none() {
        return Ok(None);
    }
    ChatTemplate::resolve(requested, from_model).map(Some).map_err(|e| e.to_string())
}

/// Renders a chat request's prompt with the model's BOS/EOS text. Content sent as a list of
/// text parts is joined into one string first, since most templates concatenate content as a
/// string. Tool-call arguments sent as the OpenAI wire format's JSON string are parsed into
/// objects first (the convention of Hugging Face templates, and what llama.cpp does); strings
/// that are not JSON objects stay.
///
/// Templates that read `content` unguarded (Qwen3's, DeepSeek-R1's) fail on the null content
/// an OpenAI client sends beside tool calls, as in transformers; where that is the only
/// trouble they get "" instead, as llama.cpp gives them.
pub fn render(template: &ChatTemplate, tokenizer: &Tokenizer, inputs: &TemplateInputs) -> Result<String, TokenizerError> {
    let messages: Vec<Value> = inputs.messages.iter().map(template_message).collect();
    let render_messages = |messages: Vec<Value>| {
        template.render(&ChatInputs {
            messages: &Value::Array(messages),
            tools: inputs.tools,
            add_generation_prompt: inputs.add_generation_prompt,
            extra: inputs.extra,
            bos_token: tokenizer.bos_text(),
            eos_token: tokenizer.eos_text(),
            now: None,
        })
    };
    let is_null_content = |m: &Value| m.get("content").is_some_and(Value::is_null);
    if !messages.iter().any(is_null_content) {
        return render_messages(messages);
    }
    let filled: Vec<Value> = messages
        .iter()
        .cloned()
        .map(|mut m| {
            if is_null_content(&m) {
                m["content"] = Value::String(String::new());
            }
            m
        })
        .collect();
    render_messages(messages).or_else(|error| render_messages(filled).map_err(|_| error))
}

fn template_message(message: &Value) -> Value {
    let mut message = message.clone();
    if message.get("content").is_some_and(Value::is_array) {
        message["content"] = Value::String(message_text(&message));
    }
    if let Some(calls) = message.get_mut("tool_calls").and_then(Value::as_array_mut) {
        for call in calls {
            if let Some(arguments) = call.pointer_mut("/function/arguments") {
                if let Some(parsed) = arguments.as_str().and_then(|s| serde_json::from_str::<Value>(s).ok()).filter(Value::is_object) {
                    *arguments = parsed;
                }
            }
        }
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_files_and_the_model_template_resolve() {
        assert!(resolve(None, None).unwrap().is_none());
        assert_eq!(resolve(None, Some("{{ x }}")).unwrap().unwrap().source(), "{{ x }}");
        assert_eq!(resolve(Some("chatml"), Some("{{ x }}")).unwrap().unwrap().source(), kiln_tokenizer::CHATML_TEMPLATE);
        let file = std::env::temp_dir().join(format!("kiln-template-{}", std::process::id()));
        std::fs::write(&file, "{{ messages[0].content }}").unwrap();
        assert_eq!(resolve(Some(file.to_str().unwrap()), None).unwrap().unwrap().source(), "{{ messages[0].content }}");
        std::fs::remove_file(&file).unwrap();
        assert!(resolve(Some("no-such-template"), None).unwrap_err().contains("chatml"));
    }

    #[test]
    fn text_parts_render_as_their_joined_string() {
        let tokenizer = Tokenizer::from_path(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/stories260K.gguf")).unwrap();
        let template = resolve(Some("chatml"), None).unwrap().unwrap();
        let render_content = |content: Value| {
            let messages = [json!({"role": "user", "content": content})];
            render(&template, &tokenizer, &TemplateInputs { messages: &messages, tools: None, add_generation_prompt: true, extra: None }).unwrap()
        };
        let parts = json!([{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]);
        assert_eq!(render_content(parts), render_content(json!("Hello there")));
    }

    #[test]
    fn null_content_beside_tool_calls_renders_where_the_template_needs_a_string() {
        let tokenizer = Tokenizer::from_path(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/stories260K.gguf")).unwrap();
        let messages = [
            json!({"role": "user", "content": "Weather?"}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}),
        ];
        let inputs = TemplateInputs { messages: &messages, tools: None, add_generation_prompt: false, extra: None };
        // Reads content unguarded: "" stands in for the null.
        let strict = ChatTemplate::new("{% for m in messages %}[{{ m.content + '|' }}]{% endfor %}").unwrap();
        assert_eq!(render(&strict, &tokenizer, &inputs).unwrap(), "[Weather?|][|]");
        // Handles the missing content itself (transformers drops keys holding None): rendered
        // as transformers renders it.
        let careful = ChatTemplate::new("{% for m in messages %}[{{ m.content if m.content is defined else 'none' }}]{% endfor %}").unwrap();
        assert_eq!(render(&careful, &tokenizer, &inputs).unwrap(), "[Weather?][none]");
        // Failing for another reason: that error.
        let failing = ChatTemplate::new("{{ raise_exception('no tools here') }}").unwrap();
        assert!(render(&failing, &tokenizer, &inputs).unwrap_err().to_string().contains("no tools here"));
    }

    #[test]
    fn string_arguments_become_objects_when_they_are_json_objects() {
        let m = json!({"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{\"a\": 1}"}},
            {"function": {"name": "g", "arguments": "not json"}},
            {"function": {"name": "h", "arguments": {"b": 2}}}]});
        let parsed = template_message(&m);
        assert_eq!(parsed["tool_calls"][0]["function"]["arguments"], json!({"a": 1}));
        assert_eq!(parsed["tool_calls"][1]["function"]["arguments"], "not json");
        assert_eq!(parsed["tool_calls"][2]["function"]["arguments"], json!({"b": 2}));
    }
}
