//! Chat templates; expected strings were rendered by Python jinja2 3.1 with
//! the settings `transformers` uses (trim_blocks, lstrip_blocks).

mod common;

use kiln_tokenizer::{ChatMessage, TokenizerError, CHATML_TEMPLATE};

const LLAMA3_TEMPLATE: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

fn conversation() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("system", "You are terse."),
        ChatMessage::new("user", " Hi there \n"),
        ChatMessage::new("assistant", "Hello."),
        ChatMessage::new("user", "Bye"),
    ]
}

#[test]
fn llama3_template_renders_and_tokenizes_with_header_tokens() {
    let tok = common::load_vocab("llama-bpe");
    let prompt = tok.apply_chat_template_with(LLAMA3_TEMPLATE, &conversation(), true).unwrap();
    assert_eq!(
        prompt,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    let ids = tok.encode(&prompt, false, true);
    assert_eq!(ids[..2], [128000, 128006]);
    assert_eq!(ids.iter().filter(|&&id| id == 128009).count(), 4);
    assert_eq!(tok.detokenize(&ids, false, true), prompt);
}

#[test]
fn qwen2_builtin_template() {
    let tok = common::load_vocab("qwen2");
    assert!(tok.chat_template().unwrap().contains("<|im_start|>"));
    let msgs = conversation();
    assert_eq!(
        tok.apply_chat_template(&msgs[1..], true).unwrap(),
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\n Hi there \n<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        tok.apply_chat_template(&msgs, false).unwrap(),
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n Hi there \n<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
    );
}

#[test]
fn chatml_fallback_template() {
    let tok = common::load_vocab("qwen2");
    let msgs = [ChatMessage::new("user", "Hi")];
    assert_eq!(tok.apply_chat_template_with(CHATML_TEMPLATE, &msgs, true).unwrap(), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

#[test]
fn phi3_builtin_template_uses_bos_token() {
    let tok = common::load_vocab("phi-3");
    assert_eq!(
        tok.apply_chat_template(&conversation(), true).unwrap(),
        "<s><|user|>\n Hi there \n<|end|>\n<|assistant|>\nHello.<|end|>\n<|user|>\nBye<|end|>\n<|assistant|>\n"
    );
}

#[test]
fn template_errors_are_typed() {
    let tok = common::load_vocab("gpt-2");
    assert!(matches!(tok.apply_chat_template(&conversation(), true), Err(TokenizerError::Template(_))));
    let strict = "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{{ m['content'] }}{% endfor %}";
    let e = tok.apply_chat_template_with(strict, &conversation(), false).unwrap_err();
    assert!(e.to_string().contains("roles must alternate"), "{e}");
    assert_eq!(tok.apply_chat_template_with(strict, &conversation()[1..3], false).unwrap(), " Hi there \nHello.");
}
