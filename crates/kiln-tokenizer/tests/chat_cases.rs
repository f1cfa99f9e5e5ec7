//! Every case of `chat-templates/cases.json`: 15 real templates rendered by Hugging Face
//! transformers' `apply_chat_template` (see that folder's README.md). Each must render
//! byte-identically, or fail where transformers raised.

use std::time::{Duration, UNIX_EPOCH};

use kiln_tokenizer::chat::unix_seconds;
use kiln_tokenizer::{ChatInputs, ChatTemplate, TokenizerError};
use serde_json::Value;

/// `2026-03-05T09:08:07` as an instant, the datetime read as UTC (as `strftime_now` renders it).
fn parse_instant(text: &str) -> std::time::SystemTime {
    let fields: Vec<i64> = text.split(['-', 'T', ':']).map(|x| x.parse().unwrap_or(-1)).collect();
    let secs = match fields[..] {
        [y, mo, d, h, mi, s] if [mo, d, h, mi, s].iter().all(|&f| f >= 0) => unix_seconds(y, mo as u32, d as u32, h as u32, mi as u32, s as u32),
        _ => None,
    };
    let secs = secs.unwrap_or_else(|| panic!("strftime_now {text:?}: expected YYYY-MM-DDTHH:MM:SS"));
    UNIX_EPOCH + Duration::from_secs(secs as u64)
}

/// What one case should give, or why it does not, as a one-line-per-problem report.
fn check(case: &Value, template: &ChatTemplate) -> Result<(), String> {
    let str_field = |k: &str| case.get(k).and_then(Value::as_str);
    let tools = case.get("tools").filter(|t| !t.is_null());
    let extra = case.get("extra_kwargs").and_then(Value::as_object);
    let inputs = ChatInputs {
        messages: &case["messages"],
        tools,
        add_generation_prompt: case["add_generation_prompt"].as_bool().ok_or("add_generation_prompt is not a bool")?,
        extra,
        bos_token: str_field("bos_token"),
        eos_token: str_field("eos_token"),
        now: str_field("strftime_now").map(parse_instant),
    };
    let got = template.render(&inputs);
    match (str_field("expected"), str_field("expected_error_type"), got) {
        (Some(want), _, Ok(got)) if got == want => Ok(()),
        (Some(want), _, Ok(got)) => Err(format!("rendered differently\n  want {want:?}\n  got  {got:?}")),
        (Some(_), _, Err(e)) => Err(format!("failed: {e}")),
        (None, Some("TemplateError"), Err(e)) => {
            let want = str_field("expected_error").unwrap_or_default();
            match &e {
                TokenizerError::TemplateException(m) if m.contains(want) => Ok(()),
                _ => Err(format!("want raise_exception({want:?}), got {e:?}")),
            }
        }
        (None, Some(_), Err(_)) => Ok(()),
        (None, kind, Ok(got)) => Err(format!("want a {kind:?} error, rendered {got:?}")),
        (None, None, Err(e)) => Err(format!("case has neither expected nor expected_error_type; render failed: {e}")),
    }
}

#[test]
fn every_case_renders_as_transformers_does() {
    let dir = kiln_testdata::path("chat-templates");
    let cases_path = dir.join("cases.json");
    let text = std::fs::read_to_string(&cases_path).unwrap_or_else(|e| panic!("{}: {e}", cases_path.display()));
    let cases: Vec<Value> = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", cases_path.display()));
    assert!(!cases.is_empty(), "{}: no cases", cases_path.display());
    let mut templates = std::collections::HashMap::new();
    let mut failures = Vec::new();
    for case in &cases {
        let name = case["template"].as_str().unwrap_or_else(|| panic!("case without a template name: {case}"));
        let label = format!("{name} / {}", case["case"].as_str().unwrap_or("?"));
        let template = templates.entry(name.to_string()).or_insert_with(|| {
            let path = dir.join(format!("{name}.jinja"));
            let source = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            ChatTemplate::new(source).map_err(|e| e.to_string())
        });
        let result = match template {
            Ok(t) => check(case, t),
            Err(e) => Err(format!("does not compile: {e}")),
        };
        if let Err(why) = result {
            failures.push(format!("{label}: {why}"));
        }
    }
    let passed = cases.len() - failures.len();
    eprintln!("chat template cases: {passed}/{} pass", cases.len());
    assert!(failures.is_empty(), "{} of {} cases fail:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

/// The messages the template saw, where transformers recorded them, equal ours in content and
/// key order: rendering `messages|tojson` shows both.
#[test]
fn messages_are_prepared_as_transformers_prepares_them() {
    let path = kiln_testdata::path("chat-templates/cases.json");
    let cases: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let show = ChatTemplate::new("{{ messages|tojson }}").unwrap();
    let mut checked = 0;
    for case in cases.iter().filter(|c| c.get("template_messages").is_some()) {
        let got = show.render(&ChatInputs { messages: &case["messages"], ..Default::default() }).unwrap();
        let want = show.render(&ChatInputs { messages: &case["template_messages"], ..Default::default() }).unwrap();
        assert_eq!(got, want, "{} / {}", case["template"], case["case"]);
        checked += 1;
    }
    assert!(checked > 0, "no case records template_messages");
}

/// Built-in templates render as the real template of their family on the cases where the two
/// formats agree (plain conversations; no tools).
#[test]
fn builtin_templates_match_their_families() {
    let pairs: [(&str, &str, &[&str]); 9] = [
        ("chatml", "chatml", &["single_user", "multi_turn_gen", "multi_turn_nogen", "unicode_whitespace", "consecutive_users"]),
        ("qwen2", "Qwen-Qwen2.5-7B-Instruct", &["multi_turn_gen", "multi_turn_nogen", "empty_system"]),
        ("qwen3", "Qwen-Qwen3-0.6B", &["single_user", "multi_turn_gen", "multi_turn_nogen", "consecutive_users", "enable_thinking_false"]),
        ("gemma", "google-gemma-2-2b-it", &["single_user", "unicode_whitespace", "ends_with_assistant"]),
        ("mistral", "Mistral-Small-3.2-24B-Instruct-2506", &["multi_turn_gen", "multi_turn_nogen"]),
        ("phi3", "microsoft-Phi-3.5-mini-instruct", &["single_user", "multi_turn_gen", "consecutive_users"]),
        ("deepseek-r1", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", &["multi_turn_nogen", "ends_with_assistant"]),
        ("gpt-oss", "openai-gpt-oss-120b", &["single_user", "multi_turn_gen", "multi_turn_nogen", "consecutive_users"]),
        ("smollm3", "HuggingFaceTB-SmolLM3-3B", &["multi_turn_gen", "multi_turn_nogen", "system_no_think_flag", "enable_thinking_false"]),
    ];
    let path = kiln_testdata::path("chat-templates/cases.json");
    let cases: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut failures = Vec::new();
    for (name, family, names) in pairs {
        let template = ChatTemplate::resolve(Some(name), None).unwrap();
        for case_name in names {
            let case = cases.iter().find(|c| c["template"] == family && c["case"] == *case_name);
            let case = case.unwrap_or_else(|| panic!("no case {family} / {case_name}"));
            if let Err(why) = check(case, &template) {
                failures.push(format!("{name} as {family} / {case_name}: {why}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
