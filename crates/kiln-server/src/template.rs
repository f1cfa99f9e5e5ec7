//! The one adapter between the server and chat-template rendering. It renders over the
//! tokenizer's `apply_chat_template_with` (roles and text content); tools and template options
//! are accepted and passed on once the full renderer (`kiln_tokenizer::ChatTemplate`) is in.

use kiln_tokenizer::{ChatMessage, Tokenizer, TokenizerError, CHATML_TEMPLATE};
use serde_json::Value;

use crate::request::{message_text, Object};

/// Built-in templates selectable by name with `--chat-template`.
const NAMED: [(&str, &str); 1] = [("chatml", CHATML_TEMPLATE)];

#[derive(Clone, Debug)]
pub struct ChatTemplate {
    source: String,
}

/// What a template renders.
pub struct TemplateInputs<'a> {
    pub messages: &'a [Value],
    pub tools: Option<&'a Value>,
    pub add_generation_prompt: bool,
    /// `chat_template_kwargs`: extra variables for the template.
    pub extra: Option<&'a Object>,
}

impl ChatTemplate {
    pub fn new(source: impl Into<String>) -> ChatTemplate {
        ChatTemplate { source: source.into() }
    }

    /// `--chat-template NAME|FILE` when given, else the model's own template, else none.
    pub fn resolve(requested: Option<&str>, from_model: Option<&str>) -> Result<Option<ChatTemplate>, String> {
        let Some(requested) = requested else { return Ok(from_model.map(ChatTemplate::new)) };
        if let Some((_, source)) = NAMED.iter().find(|(name, _)| *name == requested) {
            return Ok(Some(ChatTemplate::new(*source)));
        }
        match std::fs::read_to_string(requested) {
            Ok(source) => Ok(Some(ChatTemplate::new(source))),
            Err(e) => {
                let names: Vec<&str> = NAMED.iter().map(|(n, _)| *n).collect();
                Err(format!("--chat-template {requested}: not a template name ({}) nor a readable file: {e}", names.join(", ")))
            }
        }
    }

    pub fn render(&self, tokenizer: &Tokenizer, inputs: &TemplateInputs) -> Result<String, TokenizerError> {
        let messages: Vec<ChatMessage> =
            inputs.messages.iter().map(|m| ChatMessage::new(m.get("role").and_then(Value::as_str).unwrap_or_default(), message_text(m))).collect();
        tokenizer.apply_chat_template_with(&self.source, &messages, inputs.add_generation_prompt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_files_and_the_model_template_resolve() {
        assert!(ChatTemplate::resolve(None, None).unwrap().is_none());
        assert_eq!(ChatTemplate::resolve(None, Some("{{ x }}")).unwrap().unwrap().source, "{{ x }}");
        assert_eq!(ChatTemplate::resolve(Some("chatml"), Some("{{ x }}")).unwrap().unwrap().source, CHATML_TEMPLATE);
        let dir = std::env::temp_dir().join(format!("kiln-template-{}", std::process::id()));
        std::fs::write(&dir, "{{ messages[0].content }}").unwrap();
        assert_eq!(ChatTemplate::resolve(Some(dir.to_str().unwrap()), None).unwrap().unwrap().source, "{{ messages[0].content }}");
        std::fs::remove_file(&dir).unwrap();
        assert!(ChatTemplate::resolve(Some("no-such-template"), None).unwrap_err().contains("chatml"));
    }
}
