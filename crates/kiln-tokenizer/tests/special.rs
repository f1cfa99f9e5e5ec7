//! Special tokens: parsing, BOS/EOS insertion, end-of-generation ids, pieces.

mod common;

use kiln_tokenizer::TokenizerKind;

#[test]
fn llama3_header_tokens_parse_only_with_parse_special() {
    let tok = common::load_vocab("llama-bpe");
    let text = "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>";
    let ids = tok.encode(text, false, true);
    let hi = tok.encode("Hi", false, false);
    let user = tok.encode("user", false, false);
    let nl = tok.encode("\n\n", false, false);
    let expected: Vec<u32> = [vec![128006], user, vec![128007], nl, hi, vec![128009]].concat();
    assert_eq!(ids, expected);
    let plain = tok.encode(text, false, false);
    assert!(plain.iter().all(|&id| id < 128000), "control tokens matched with parse_special=false: {plain:?}");
    assert_eq!(tok.decode(&plain), text);
}

#[test]
fn add_special_follows_the_model_flags() {
    let spm = common::load_vocab("llama-spm");
    assert!(spm.add_bos());
    assert_eq!(spm.encode("Hello", true, false), [1, 15043]);
    assert_eq!(spm.encode("", true, false), [1]);
    let llama3 = common::load_vocab("llama-bpe");
    // Not set in the file: llama.cpp defaults add_bos to true for the llama3 pre-tokenizer.
    assert!(llama3.add_bos());
    assert_eq!(llama3.encode("Hello", true, false), [128000, 9906]);
    let gpt2 = common::load_vocab("gpt-2");
    assert!(!gpt2.add_bos());
    assert_eq!(gpt2.encode("Hello", true, false), gpt2.encode("Hello", false, false));
    let bert = common::load_vocab("bert-bge");
    assert_eq!(bert.encode("hello", true, false), [101, 7592, 102]);
}

#[test]
fn spm_adds_the_space_prefix_after_each_special_token() {
    let tok = common::load_vocab("llama-spm");
    assert_eq!(tok.encode("<s>Hello", false, true), [1, 15043]);
    assert_eq!(tok.encode("Hello</s>Hello", false, true), [15043, 2, 15043]);
    // Without parse_special "<s>" is ordinary text.
    assert!(!tok.encode("<s>Hello", false, false).contains(&1));
}

#[test]
fn phi3_special_tokens_strip_following_whitespace() {
    let tok = common::load_vocab("phi-3");
    let user = tok.token_id("<|user|>").unwrap();
    let a = tok.encode("<|user|>\n  Hi", false, true);
    assert_eq!(a[0], user);
    assert_eq!(a, tok.encode("<|user|>Hi", false, true));
}

#[test]
fn user_defined_tokens_match_even_without_parse_special() {
    // deepseek-coder stores "õ" (32000) as a user-defined token, which llama.cpp
    // (like Hugging Face's added tokens) always splits out first.
    let tok = common::load_vocab("deepseek-coder");
    assert_eq!(tok.encode("õ", false, false), [32000]);
    assert_eq!(tok.encode("aõb", false, false)[1], 32000);
}

#[test]
fn end_of_generation_ids() {
    let llama3 = common::load_vocab("llama-bpe");
    assert_eq!((llama3.bos(), llama3.eos(), llama3.eot()), (Some(128000), Some(128001), Some(128009)));
    assert!(llama3.is_end_of_generation(128009) && llama3.is_end_of_generation(128001));
    assert!(!llama3.is_end_of_generation(128000) && !llama3.is_end_of_generation(9906));

    let qwen = common::load_vocab("qwen2");
    assert_eq!(qwen.eot(), Some(151645), "<|im_end|>");
    assert!(qwen.is_end_of_generation(151643) && qwen.is_end_of_generation(151645));
    assert!(!qwen.is_end_of_generation(151644), "<|im_start|> is not an end");

    let phi3 = common::load_vocab("phi-3");
    assert_eq!(phi3.eos(), Some(32000));
    assert!(phi3.is_end_of_generation(32007), "<|end|>");

    let spm = common::load_vocab("llama-spm");
    assert_eq!(spm.end_of_generation_ids(), [2]);
}

#[test]
fn pieces() {
    let spm = common::load_vocab("llama-spm");
    assert_eq!(spm.token_to_piece(15043), b" Hello");
    assert_eq!(spm.token_to_piece(13), b"\n", "<0x0A>");
    assert_eq!(spm.token_to_piece(1), b"", "control tokens print as nothing");
    assert_eq!(spm.piece(1, true), b"<s>");
    assert_eq!(spm.token_to_piece(u32::MAX), b"");
    let gpt2 = common::load_vocab("gpt-2");
    assert_eq!(gpt2.token_to_piece(gpt2.token_id("Ġworld").unwrap()), b" world");
    // A lone byte of a multi-byte character: "ð" stands for 0xF0.
    assert_eq!(gpt2.token_to_piece(gpt2.token_id("ð").unwrap()), [0xF0]);
}

#[test]
fn unreadable_file_is_a_gguf_error() {
    let e = kiln_tokenizer::Tokenizer::from_path("/nonexistent/model.gguf").err().unwrap();
    assert!(matches!(e, kiln_tokenizer::TokenizerError::Gguf(_)) && e.to_string().contains("/nonexistent/model.gguf"), "{e}");
}

#[test]
fn kinds() {
    assert_eq!(common::load_vocab("llama-spm").kind(), TokenizerKind::Spm);
    assert_eq!(common::load_vocab("qwen2").kind(), TokenizerKind::Bpe { pre: "qwen2".into() });
    assert_eq!(common::load_vocab("bert-bge").kind(), TokenizerKind::Wpm);
    assert_eq!(common::load_vocab("bert-bge").kind().to_string(), "WPM (bert)");
    assert_eq!(common::load_vocab("falcon").vocab_size(), 65024);
}

#[test]
fn stories260k_prompt_matches_reference_tokens() {
    let tok = kiln_tokenizer::Tokenizer::from_path(common::stories_path()).unwrap();
    let reference = kiln_testdata::path("models/stories260K.ref.json");
    let raw = std::fs::read_to_string(&reference).unwrap_or_else(|e| panic!("{}: {e}", reference.display()));
    let json: serde_json::Value = serde_json::from_str(&raw).unwrap();
    let text = json["text"].as_str().unwrap();
    assert_eq!(text, "One day, Lily found a big red ball in the park.");
    let expected: Vec<u32> = json["tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    assert_eq!(tok.encode(text, true, false), expected);
    assert_eq!(tok.decode(&expected[1..]), text);
    assert_eq!((tok.vocab_size(), tok.bos(), tok.eos(), tok.kind()), (512, Some(1), Some(2), TokenizerKind::Spm));
}
