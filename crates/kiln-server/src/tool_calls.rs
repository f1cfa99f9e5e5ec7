//! Tool calls read out of a chat answer's content, in the syntax its template teaches the
//! model (as llama-server's and vLLM's tool parsers do): Hermes JSON in `<tool_call>` tags
//! (Qwen2.5, Qwen3, Hermes), Qwen3.5's XML functions in the same tags, Mistral's `[TOOL_CALLS]`
//! (a JSON list, or `name[ARGS]{...}`), Llama 3's JSON object and Gemma 4's `<|tool_call>call:`
//! blocks. gpt-oss's harmony calls are
//! read by the reasoning splitter, which follows its channels. Content streams until a call
//! may begin; from there it is held and parsed at the end, and text that does not parse as a
//! call is sent as content after all.

use serde_json::{Map, Value};

use crate::reasoning::partial_marker_len;

/// How a template's model writes tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolSyntax {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    HermesJson,
    /// `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`
    QwenXml,
    /// `[TOOL_CALLS][{"name": ..., "arguments": ...}]` or `[TOOL_CALLS]NAME[ARGS]{...}`
    Mistral,
    /// `{"name": ..., "parameters": {...}}` as the whole answer (`<|python_tag|>` before it).
    Llama3Json,
    /// `<|tool_call>call:NAME{key:value,...}<tool_call|>`, strings between `<|"|>` quotes.
    Gemma,
}

const TOOL_CALL_OPEN: &str = "<tool_call>";
const TOOL_CALL_CLOSE: &str = "</tool_call>";
const MISTRAL_CALLS: &str = "[TOOL_CALLS]";
const MISTRAL_ARGS: &str = "[ARGS]";
const PYTHON_TAG: &str = "<|python_tag|>";
const GEMMA_CALL_OPEN: &str = "<|tool_call>";
const GEMMA_CALL_CLOSE: &str = "<tool_call|>";
const GEMMA_QUOTE: &str = "<|\"|>";

/// A call as the API sends it: the function's name and its arguments as JSON text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

impl ToolSyntax {
    /// The syntax a chat template's source teaches, if any.
    pub fn of_template(source: &str) -> Option<ToolSyntax> {
        if source.contains(GEMMA_CALL_OPEN) {
            Some(ToolSyntax::Gemma)
        } else if source.contains(TOOL_CALL_OPEN) {
            Some(if source.contains("<function=") { ToolSyntax::QwenXml } else { ToolSyntax::HermesJson })
        } else if source.contains(MISTRAL_CALLS) {
            Some(ToolSyntax::Mistral)
        } else if source.contains(PYTHON_TAG) || (source.contains("ipython") && source.contains("\"parameters\"")) {
            Some(ToolSyntax::Llama3Json)
        } else {
            None
        }
    }

    /// Special tokens the answer must show for its calls to be read.
    pub fn markers(self) -> &'static [&'static str] {
        match self {
            ToolSyntax::HermesJson | ToolSyntax::QwenXml => &[TOOL_CALL_OPEN, TOOL_CALL_CLOSE],
            ToolSyntax::Mistral => &[MISTRAL_CALLS, MISTRAL_ARGS],
            ToolSyntax::Llama3Json => &[PYTHON_TAG],
            ToolSyntax::Gemma => &[GEMMA_CALL_OPEN, GEMMA_CALL_CLOSE, GEMMA_QUOTE],
        }
    }

    /// The marker that begins a call; Llama 3 also begins one with `{` at the answer's start.
    fn opening(self) -> &'static str {
        match self {
            ToolSyntax::HermesJson | ToolSyntax::QwenXml => TOOL_CALL_OPEN,
            ToolSyntax::Mistral => MISTRAL_CALLS,
            ToolSyntax::Llama3Json => PYTHON_TAG,
            ToolSyntax::Gemma => GEMMA_CALL_OPEN,
        }
    }

    /// The calls in `text` (which starts where a call may) and the text around them; `None`
    /// where it does not parse as calls. `tools` (the request's) gives parameter types.
    pub fn parse(self, text: &str, tools: &[Value]) -> Option<(String, Vec<ToolCall>)> {
        let (rest, calls) = match self {
            ToolSyntax::Gemma => tagged_calls(text, [GEMMA_CALL_OPEN, GEMMA_CALL_CLOSE], gemma_call)?,
            ToolSyntax::HermesJson | ToolSyntax::QwenXml => tagged_calls(text, [TOOL_CALL_OPEN, TOOL_CALL_CLOSE], |inner| match self {
                ToolSyntax::QwenXml => xml_call(inner, tools),
                _ => json_call(&serde_json::from_str(inner.trim()).ok()?, "arguments"),
            })?,
            ToolSyntax::Mistral => (String::new(), mistral_calls(text.trim().strip_prefix(MISTRAL_CALLS)?)?),
            ToolSyntax::Llama3Json => {
                let body = text.trim();
                let body = body.strip_prefix(PYTHON_TAG).unwrap_or(body).trim();
                let value: Value = serde_json::from_str(body).ok()?;
                (String::new(), vec![json_call(&value, "parameters").or_else(|| json_call(&value, "arguments"))?])
            }
        };
        (!calls.is_empty()).then_some((rest, calls))
    }
}

/// A call from a JSON object: `name` and the arguments under `key` (an object, or a string
/// holding one).
fn json_call(value: &Value, key: &str) -> Option<ToolCall> {
    let name = value.get("name")?.as_str()?.to_string();
    let arguments = match value.get(key) {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(a @ Value::Object(_)) => a.to_string(),
        Some(_) => return None,
    };
    Some(ToolCall { name, arguments })
}

/// Every block between the `tags` (the last may be cut off) read by `call`; the text between
/// blocks, trimmed, as content.
fn tagged_calls(text: &str, [open_tag, close_tag]: [&str; 2], call: impl Fn(&str) -> Option<ToolCall>) -> Option<(String, Vec<ToolCall>)> {
    let (mut rest, mut calls) = (String::new(), Vec::new());
    let mut text = text;
    while let Some(open) = text.find(open_tag) {
        rest.push_str(&text[..open]);
        let inner = &text[open + open_tag.len()..];
        let end = inner.find(close_tag).unwrap_or(inner.len());
        calls.push(call(&inner[..end])?);
        text = inner.get(end + close_tag.len()..).unwrap_or("");
    }
    rest.push_str(text);
    Some((rest.trim().to_string(), calls))
}

/// The JSON type a tool declares for one of its parameters.
fn parameter_type<'a>(tools: &'a [Value], function: &str, parameter: &str) -> Option<&'a str> {
    let tool = tools.iter().find(|t| t.pointer("/function/name").and_then(Value::as_str) == Some(function))?;
    tool.pointer("/function/parameters/properties")?.get(parameter)?.get("type")?.as_str()
}

/// `<function=NAME><parameter=P>\nvalue\n</parameter>...</function>`: a value is a string
/// where its parameter is declared one (or does not read as JSON), else the JSON it holds.
fn xml_call(inner: &str, tools: &[Value]) -> Option<ToolCall> {
    let after = inner.trim_start().strip_prefix("<function=")?;
    let (name, mut body) = after.split_once('>')?;
    let name = name.trim();
    let mut arguments = Map::new();
    while let Some(start) = body.find("<parameter=") {
        let (parameter, value_and_rest) = body[start + "<parameter=".len()..].split_once('>')?;
        let (value, rest) = value_and_rest.split_once("</parameter>").unwrap_or((value_and_rest, ""));
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        let typed = match parameter_type(tools, name, parameter.trim()) {
            Some("string") => None,
            _ => serde_json::from_str::<Value>(value.trim()).ok(),
        };
        arguments.insert(parameter.trim().to_string(), typed.unwrap_or_else(|| Value::String(value.to_string())));
        body = rest;
    }
    (!name.is_empty()).then(|| ToolCall { name: name.to_string(), arguments: Value::Object(arguments).to_string() })
}

/// After `[TOOL_CALLS]`: a JSON list of calls, or `NAME[ARGS]{...}` pieces each after its own
/// `[TOOL_CALLS]`.
fn mistral_calls(text: &str) -> Option<Vec<ToolCall>> {
    let text = text.trim_start();
    if text.starts_with('[') {
        let list: Vec<Value> = serde_json::Deserializer::from_str(text).into_iter().next()?.ok()?;
        return list.iter().map(|c| json_call(c, "arguments")).collect();
    }
    text.split(MISTRAL_CALLS)
        .map(|piece| {
            let (name, arguments) = piece.split_once(MISTRAL_ARGS)?;
            let arguments: Value = serde_json::Deserializer::from_str(arguments.trim()).into_iter().next()?.ok()?;
            arguments.is_object().then(|| ToolCall { name: name.trim().to_string(), arguments: arguments.to_string() })
        })
        .collect()
}

/// `call:NAME{...}`: Gemma 4's call, its arguments in Gemma's notation.
fn gemma_call(inner: &str) -> Option<ToolCall> {
    let (name, arguments) = inner.trim().strip_prefix("call:")?.split_once('{')?;
    let mut reader = GemmaReader { rest: arguments, depth: 0 };
    let arguments = reader.object()?;
    reader.rest.trim().is_empty().then(|| ToolCall { name: name.trim().to_string(), arguments: arguments.to_string() })
}

/// Gemma 4's argument notation: JSON with bare keys and strings between `<|"|>` quotes.
struct GemmaReader<'a> {
    rest: &'a str,
    /// Open objects and lists: nesting past [`MAX_NESTING`] is not a call (and would otherwise
    /// recurse as deep as a model cares to write).
    depth: usize,
}

/// serde_json's own limit.
const MAX_NESTING: usize = 128;

impl GemmaReader<'_> {
    fn skip_blanks(&mut self) {
        self.rest = self.rest.trim_start();
    }

    fn eat(&mut self, prefix: &str) -> bool {
        self.skip_blanks();
        match self.rest.strip_prefix(prefix) {
            Some(rest) => {
                self.rest = rest;
                true
            }
            None => false,
        }
    }

    fn value(&mut self) -> Option<Value> {
        if self.eat(GEMMA_QUOTE) {
            let (text, rest) = self.rest.split_once(GEMMA_QUOTE)?;
            self.rest = rest;
            return Some(Value::String(text.to_string()));
        }
        if self.eat("{") {
            return self.object();
        }
        if self.eat("[") {
            return self.nested(|r| {
                let mut items = Vec::new();
                if r.eat("]") {
                    return Some(Value::Array(items));
                }
                loop {
                    items.push(r.value()?);
                    if r.eat("]") {
                        return Some(Value::Array(items));
                    }
                    if !r.eat(",") {
                        return None;
                    }
                }
            });
        }
        // A number, true, false or null, up to the next delimiter.
        let end = self.rest.find([',', '}', ']']).unwrap_or(self.rest.len());
        let literal = self.rest[..end].trim();
        self.rest = &self.rest[end..];
        serde_json::from_str::<Value>(literal).ok().filter(|v| !v.is_string())
    }

    /// `read` one level deeper, within [`MAX_NESTING`].
    fn nested(&mut self, read: impl FnOnce(&mut Self) -> Option<Value>) -> Option<Value> {
        if self.depth == MAX_NESTING {
            return None;
        }
        self.depth += 1;
        let value = read(self);
        self.depth -= 1;
        value
    }

    /// The members of an object whose `{` was read, through its `}`.
    fn object(&mut self) -> Option<Value> {
        self.nested(Self::members)
    }

    fn members(&mut self) -> Option<Value> {
        let mut members = Map::new();
        if self.eat("}") {
            return Some(Value::Object(members));
        }
        loop {
            let key = if self.eat(GEMMA_QUOTE) {
                let (key, rest) = self.rest.split_once(GEMMA_QUOTE)?;
                self.rest = rest;
                key.to_string()
            } else {
                let (key, _) = self.rest.split_once(':')?;
                self.rest = &self.rest[key.len()..];
                key.trim().to_string()
            };
            if !self.eat(":") {
                return None;
            }
            members.insert(key, self.value()?);
            if self.eat("}") {
                return Some(Value::Object(members));
            }
            if !self.eat(",") {
                return None;
            }
        }
    }
}

/// Watches an answer's content for tool calls, piece by piece.
#[derive(Clone)]
pub struct ToolCallCatcher {
    syntax: ToolSyntax,
    tools: Vec<Value>,
    /// Text not yet sent: a possible start of the opening marker, or (once `capturing`) all
    /// of the answer from the marker on.
    held: String,
    capturing: bool,
    /// Whether content other than blanks was sent (Llama 3's bare `{` opens a call only first).
    sent_text: bool,
}

impl ToolCallCatcher {
    pub fn new(syntax: ToolSyntax, tools: Vec<Value>) -> ToolCallCatcher {
        ToolCallCatcher { syntax, tools, held: String::new(), capturing: false, sent_text: false }
    }

    /// Adds content; returns the content that can be sent now.
    pub fn push(&mut self, text: &str) -> String {
        self.held.push_str(text);
        if self.capturing {
            return String::new();
        }
        if !self.sent_text && self.syntax == ToolSyntax::Llama3Json {
            // Blanks are held until the first text says whether a call begins.
            let trimmed = self.held.trim_start();
            if trimmed.is_empty() {
                return String::new();
            }
            if trimmed.starts_with('{') {
                self.capturing = true;
                return String::new();
            }
        }
        let opening = self.syntax.opening();
        let (send, keep) = match self.held.find(opening) {
            Some(i) => {
                self.capturing = true;
                (i, self.held.len() - i)
            }
            None => {
                let keep = partial_marker_len(&self.held, &[opening]);
                (self.held.len() - keep, keep)
            }
        };
        let sent: String = self.held.drain(..send).collect();
        debug_assert_eq!(self.held.len(), keep);
        self.sent_text |= !sent.trim().is_empty();
        sent
    }

    /// At the answer's end: the content still to send and the calls.
    pub fn finish(&mut self) -> (String, Vec<ToolCall>) {
        let held = std::mem::take(&mut self.held);
        if !self.capturing {
            return (held, Vec::new());
        }
        match self.syntax.parse(&held, &self.tools) {
            Some((rest, calls)) => (rest, calls),
            None => (held, Vec::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(name: &str, arguments: Value) -> ToolCall {
        ToolCall { name: name.into(), arguments: arguments.to_string() }
    }

    /// The content sent while streaming in pieces of every size from 1 to 5 bytes (and whole),
    /// with what the end adds; the same every way.
    fn catch(syntax: ToolSyntax, tools: &[Value], answer: &str) -> (String, Vec<ToolCall>) {
        let mut results = Vec::new();
        for size in [1, 2, 3, 5, answer.len().max(1)] {
            let mut c = ToolCallCatcher::new(syntax, tools.to_vec());
            let mut sent = String::new();
            for piece in answer.as_bytes().chunks(size) {
                sent += &c.push(std::str::from_utf8(piece).unwrap());
            }
            let (rest, calls) = c.finish();
            results.push((sent + &rest, calls));
        }
        assert!(results.windows(2).all(|w| w[0] == w[1]), "{results:?}");
        results.pop().unwrap()
    }

    #[test]
    fn hermes_calls_in_tags() {
        let answer = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": \"{}\"}\n</tool_call>";
        let (content, calls) = catch(ToolSyntax::HermesJson, &[], answer);
        assert_eq!(content, "Let me look.\n");
        assert_eq!(calls, vec![call("get_weather", json!({"city": "Oslo"})), ToolCall { name: "now".into(), arguments: "{}".into() }]);
        // Not JSON inside the tags: all of it stays content.
        let broken = "Hi <tool_call>{name: x}</tool_call>";
        assert_eq!(catch(ToolSyntax::HermesJson, &[], broken), (broken.to_string(), vec![]));
        assert_eq!(catch(ToolSyntax::HermesJson, &[], "a <tool_ b"), ("a <tool_ b".to_string(), vec![]));
    }

    #[test]
    fn qwen_xml_calls_take_their_types_from_the_tools() {
        let tools = [json!({"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
            "room": {"type": "string"}, "nights": {"type": "integer"}, "note": {"type": "string"}}}}})];
        let answer = "<tool_call>\n<function=book>\n<parameter=room>\n101\n</parameter>\n<parameter=nights>\n3\n</parameter>\n<parameter=note>\ntwo\nlines\n</parameter>\n<parameter=extra>\n{\"a\": true}\n</parameter>\n</function>\n</tool_call>";
        let (content, calls) = catch(ToolSyntax::QwenXml, &tools, answer);
        assert_eq!(content, "");
        assert_eq!(calls, vec![call("book", json!({"room": "101", "nights": 3, "note": "two\nlines", "extra": {"a": true}}))]);
    }

    #[test]
    fn mistral_calls_in_both_forms() {
        let list = "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", \"arguments\": {}}]";
        assert_eq!(catch(ToolSyntax::Mistral, &[], list).1, vec![call("a", json!({"x": 1})), call("b", json!({}))]);
        let named = "[TOOL_CALLS]a[ARGS]{\"x\": 1}[TOOL_CALLS]b[ARGS]{}";
        assert_eq!(catch(ToolSyntax::Mistral, &[], named), (String::new(), vec![call("a", json!({"x": 1})), call("b", json!({}))]));
    }

    #[test]
    fn llama3_calls_are_the_whole_answer() {
        let answer = " {\"name\": \"search\", \"parameters\": {\"q\": \"rust\"}}";
        assert_eq!(catch(ToolSyntax::Llama3Json, &[], answer), (String::new(), vec![call("search", json!({"q": "rust"}))]));
        let tagged = "<|python_tag|>{\"name\": \"search\", \"parameters\": {}}";
        assert_eq!(catch(ToolSyntax::Llama3Json, &[], tagged).1, vec![call("search", json!({}))]);
        // A brace after text, or JSON that is not a call, is content.
        assert_eq!(catch(ToolSyntax::Llama3Json, &[], "x {\"name\": \"s\"}"), ("x {\"name\": \"s\"}".to_string(), vec![]));
        assert_eq!(catch(ToolSyntax::Llama3Json, &[], "{\"a\": 1}"), ("{\"a\": 1}".to_string(), vec![]));
    }

    #[test]
    fn gemma_calls_in_their_notation() {
        let q = GEMMA_QUOTE;
        let answer = format!("<|tool_call>call:book{{room:{q}101, \"north\"{q},nights:3,late:true,tags:[{q}a{q},{q}b{q}],where:{{city:{q}Oslo{q}}}}}<tool_call|><|tool_call>call:now{{}}<tool_call|>");
        let (content, calls) = catch(ToolSyntax::Gemma, &[], &answer);
        assert_eq!(content, "");
        let args = json!({"room": "101, \"north\"", "nights": 3, "late": true, "tags": ["a", "b"], "where": {"city": "Oslo"}});
        assert_eq!(calls, vec![call("book", args), call("now", json!({}))]);
        // A broken block stays content; so does nesting deeper than JSON parsers take.
        let broken = format!("<|tool_call>call:book{{room:{q}101}}<tool_call|>");
        assert_eq!(catch(ToolSyntax::Gemma, &[], &broken), (broken.clone(), vec![]));
        let deep = format!("<|tool_call>call:f{{a:{}1{}}}<tool_call|>", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(ToolSyntax::Gemma.parse(&deep, &[]), None);
        let fine = format!("<|tool_call>call:f{{a:{}1{}}}<tool_call|>", "[".repeat(100), "]".repeat(100));
        assert_eq!(ToolSyntax::Gemma.parse(&fine, &[]).unwrap().1.len(), 1);
    }

    #[test]
    fn the_syntax_follows_the_template() {
        let mut found = std::collections::BTreeMap::new();
        for entry in std::fs::read_dir(kiln_testdata::path("chat-templates")).unwrap().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(".jinja") {
                found.insert(name, ToolSyntax::of_template(&std::fs::read_to_string(entry.path()).unwrap()));
            }
        }
        let expect = [
            ("Qwen-Qwen3-0.6B.jinja", Some(ToolSyntax::HermesJson)),
            ("Qwen-Qwen2.5-7B-Instruct.jinja", Some(ToolSyntax::HermesJson)),
            ("Qwen3.5-4B.jinja", Some(ToolSyntax::QwenXml)),
            ("mistralai-Mistral-Nemo-Instruct-2407.jinja", Some(ToolSyntax::Mistral)),
            ("Mistral-Small-3.2-24B-Instruct-2506.jinja", Some(ToolSyntax::Mistral)),
            ("meta-llama-Llama-3.1-8B-Instruct.jinja", Some(ToolSyntax::Llama3Json)),
            ("google-gemma-2-2b-it.jinja", None),
            ("google-gemma-4-31B-it.jinja", Some(ToolSyntax::Gemma)),
        ];
        for (name, syntax) in expect {
            assert_eq!(found.get(name), Some(&syntax), "{name}");
        }
    }
}
