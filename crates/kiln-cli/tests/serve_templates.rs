//! Every case of shared/testdata/chat-templates/cases.json through `kiln serve`'s
//! `/apply-template`, one server per template: the prompt transformers rendered, or a 400
//! carrying the template's own error message.
//!
//! The server renders with its model's BOS/EOS text and the real clock, so the expected strings
//! get the bundled model's tokens in place of the case's (where the template reads them) and
//! today's date in place of the case's pinned one (where it calls strftime_now). Tool-call
//! arguments sent as a JSON string are parsed into objects by the server (as llama.cpp does),
//! so `tool_call_string_args` expects what the template renders for the parsed arguments; and
//! where a template fails on the null content beside tool calls (as in transformers), the server
//! renders "" in its place, so `tool_call_null_content` expects that rendering there.

mod serve_support;

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use kiln_tokenizer::chat::{strftime, unix_seconds};
use kiln_tokenizer::{ChatInputs, ChatTemplate};
use serde_json::{json, Value};
use serve_support::Server;

/// The bundled stories260K model's BOS and EOS text.
const BOS: &str = "<s>";
const EOS: &str = "</s>";

/// The strftime formats the reference templates use.
const DATE_FORMATS: [&str; 2] = ["%d %b %Y", "%Y-%m-%d"];

fn pinned_seconds(instant: &str) -> i64 {
    let parse = |range: std::ops::Range<usize>| instant[range].parse::<u32>().unwrap_or_else(|_| panic!("instant {instant}"));
    unix_seconds(i64::from(parse(0..4)), parse(5..7), parse(8..10), parse(11..13), parse(14..16), parse(17..19)).expect("a valid instant")
}

/// `expected` as this server renders it: its BOS/EOS and, for a pinned instant, today.
fn as_served(case: &Value, template: &str, expected: &str) -> String {
    let mut text = expected.to_string();
    if let Some(instant) = case["strftime_now"].as_str() {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() as i64;
        for format in DATE_FORMATS {
            text = text.replace(&strftime(format, pinned_seconds(instant)), &strftime(format, now));
        }
    }
    for (key, ours) in [("bos_token", BOS), ("eos_token", EOS)] {
        if let Some(theirs) = case[key].as_str().filter(|_| template.contains(key)) {
            text = text.replace(theirs, ours);
        }
    }
    text
}

/// The case rendered directly with every string tool-call argument parsed into an object and
/// every null content made "".
fn expected_as_the_server_sends_it(case: &Value, template: &ChatTemplate) -> Result<String, String> {
    let mut messages = case["messages"].clone();
    for content in messages.as_array_mut().unwrap().iter_mut().filter_map(|m| m.get_mut("content")).filter(|c| c.is_null()) {
        *content = json!("");
    }
    for call in messages.as_array_mut().unwrap().iter_mut().filter_map(|m| m.get_mut("tool_calls")).flat_map(|c| c.as_array_mut().unwrap()) {
        let arguments = &mut call["function"]["arguments"];
        if let Some(parsed) = arguments.as_str().and_then(|s| serde_json::from_str::<Value>(s).ok()) {
            *arguments = parsed;
        }
    }
    let now = case["strftime_now"].as_str().map(|i| UNIX_EPOCH + std::time::Duration::from_secs(pinned_seconds(i) as u64));
    let inputs = ChatInputs {
        messages: &messages,
        tools: Some(&case["tools"]).filter(|t| !t.is_null()),
        add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
        extra: case["extra_kwargs"].as_object(),
        bos_token: case["bos_token"].as_str(),
        eos_token: case["eos_token"].as_str(),
        now,
    };
    template.render(&inputs).map_err(|e| e.to_string())
}

#[test]
fn every_reference_case_renders_through_apply_template() {
    let dir = kiln_testdata::path("chat-templates");
    let cases: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).expect("cases.json")).expect("cases.json parses");
    let mut by_template: BTreeMap<String, Vec<&Value>> = BTreeMap::new();
    for case in &cases {
        by_template.entry(case["template"].as_str().unwrap().to_string()).or_default().push(case);
    }
    let mut failures = Vec::new();
    let mut checked = 0;
    for (template, cases) in &by_template {
        let file = dir.join(format!("{template}.jinja"));
        let source = std::fs::read_to_string(&file).expect("template file");
        let server = Server::start(&["--chat-template", file.to_str().unwrap()]);
        assert!(server.wait_for(60, |s| s.get("/health").status == 200), "{template}: the server never became ready");
        for case in cases {
            let name = format!("{template}/{}", case["case"].as_str().unwrap());
            let mut body = json!({"messages": case["messages"], "add_generation_prompt": case["add_generation_prompt"]});
            if !case["tools"].is_null() {
                body["tools"] = case["tools"].clone();
            }
            if case["extra_kwargs"].as_object().is_some_and(|m| !m.is_empty()) {
                body["chat_template_kwargs"] = case["extra_kwargs"].clone();
            }
            let r = server.post("/apply-template", &body);
            checked += 1;
            let null_content_failed = case["case"] == "tool_call_null_content" && case["expected"].is_null();
            let expected = if case["case"] == "tool_call_string_args" || null_content_failed {
                expected_as_the_server_sends_it(case, &ChatTemplate::new(source.as_str()).unwrap()).ok()
            } else {
                case["expected"].as_str().map(str::to_string)
            };
            match expected {
                Some(expected) => {
                    let want = as_served(case, &source, &expected);
                    if r.status != 200 {
                        failures.push(format!("{name}: status {} ({})", r.status, r.body));
                    } else if r.json()["prompt"].as_str() != Some(want.as_str()) {
                        failures.push(format!("{name}: got {:?}\n  want {want:?}", r.json()["prompt"]));
                    }
                }
                None => {
                    let message = r.json()["error"]["message"].as_str().unwrap_or_default().to_string();
                    let wanted = case["expected_error"].as_str().unwrap();
                    let kind = case["expected_error_type"].as_str().unwrap();
                    if r.status != 400 || (kind == "TemplateError" && !message.contains(wanted)) {
                        failures.push(format!("{name}: wanted a 400 ({kind}: {wanted}), got {} {}", r.status, r.body));
                    }
                }
            }
        }
    }
    assert_eq!(checked, cases.len());
    assert!(failures.is_empty(), "{} of {checked} cases differ:\n{}", failures.len(), failures.join("\n"));
}
