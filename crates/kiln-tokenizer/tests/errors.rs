//! Bad or unsupported metadata gives a typed error naming what is wrong.

mod common;

use kiln_gguf::{GgufFile, GgufWriter, Value, ValueType};
use kiln_tokenizer::{Tokenizer, TokenizerError, TokenizerSpec};

fn spec(name: &str) -> TokenizerSpec {
    let path = common::vocab_path(name);
    TokenizerSpec::from_gguf(&GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

fn err(spec: &TokenizerSpec) -> TokenizerError {
    match Tokenizer::from_spec(spec) {
        Ok(_) => panic!("expected an error for model {:?} pre {:?}", spec.model, spec.pre),
        Err(e) => e,
    }
}

#[test]
fn unsupported_model_and_pre_are_named() {
    let mut s = spec("gpt-2");
    s.model = "t5".into();
    assert!(matches!(err(&s), TokenizerError::UnsupportedModel(m) if m == "t5"));
    let mut s = spec("gpt-2");
    s.pre = Some("kimi-k2".into());
    let e = err(&s);
    assert!(matches!(&e, TokenizerError::UnsupportedPre(p) if p == "kimi-k2"), "{e}");
    assert!(e.to_string().contains("kimi-k2"));
}

#[test]
fn every_listed_pre_name_builds() {
    let base = spec("gpt-2");
    for name in [
        "default",
        "gpt2",
        "llama3",
        "llama-v3",
        "smaug-bpe",
        "dbrx",
        "refact",
        "command-r",
        "stablelm2",
        "deepseek-llm",
        "deepseek-v3",
        "mpt",
        "olmo",
        "poro-chat",
        "viking",
        "tekken",
        "chameleon",
        "gpt-4o",
        "qwen35",
        "seed-coder",
        "bailingmoe",
        "exaone-moe",
        "minicpm5",
        "jais-2",
        "glm4",
    ] {
        let mut s = base.clone();
        s.pre = Some(name.into());
        s.add_bos = Some(false);
        let tok = Tokenizer::from_spec(&s).unwrap_or_else(|e| panic!("pre {name}: {e}"));
        // Byte-level BPE is lossless whatever the pre-tokenizer.
        let text = "Hello,  world!\n 123456 'll 🦙 нещо";
        assert_eq!(tok.decode(&tok.encode(text, false, false)).replace(" ,", ","), text, "pre {name}");
    }
}

#[test]
fn bad_vocabularies() {
    let mut s = spec("gpt-2");
    s.merges = None;
    assert!(matches!(err(&s), TokenizerError::MissingKey(k) if k == "tokenizer.ggml.merges"));

    let mut s = spec("llama-spm");
    s.tokens[5] = s.tokens[4].clone();
    assert!(matches!(err(&s), TokenizerError::BadVocab(m) if m.contains("duplicate") && m.contains("<0x01>")));

    let mut s = spec("llama-spm");
    s.scores.as_mut().unwrap().truncate(10);
    assert!(matches!(err(&s), TokenizerError::BadVocab(m) if m.contains("tokenizer.ggml.scores")));

    let mut s = spec("gpt-2");
    s.merges.as_mut().unwrap()[3] = "nospace".into();
    assert!(matches!(err(&s), TokenizerError::BadVocab(m) if m.contains("merges[3]")));

    // chatglm has no default BOS, so add_bos without a bos id is inconsistent.
    let mut s = spec("gpt-2");
    s.pre = Some("glm4".into());
    s.special.bos = None;
    s.add_bos = Some(true);
    assert!(matches!(err(&s), TokenizerError::BadVocab(m) if m.contains("tokenizer.ggml.bos_token_id")));
}

fn gguf(kvs: Vec<(&str, Value)>) -> GgufFile {
    let mut w = GgufWriter::new();
    for (k, v) in kvs {
        w.add_kv(k, v);
    }
    GgufFile::from_bytes(w.to_bytes(|_, _| Ok(())).unwrap()).unwrap()
}

fn strings(items: &[&str]) -> Value {
    Value::Array(ValueType::String, items.iter().map(|s| Value::String(s.to_string())).collect())
}

#[test]
fn missing_or_mistyped_gguf_keys() {
    let e = Tokenizer::from_gguf(&gguf(vec![("tokenizer.ggml.tokens", strings(&["a"]))])).err().unwrap();
    assert!(matches!(&e, TokenizerError::MissingKey(k) if k == "tokenizer.ggml.model"), "{e}");

    let e = Tokenizer::from_gguf(&gguf(vec![("tokenizer.ggml.model", Value::String("llama".into()))])).err().unwrap();
    assert!(matches!(&e, TokenizerError::MissingKey(k) if k == "tokenizer.ggml.tokens"), "{e}");

    let e = Tokenizer::from_gguf(&gguf(vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", strings(&["<unk>", "<s>", "</s>"])),
        ("tokenizer.ggml.add_bos_token", Value::U32(1)),
    ]))
    .err()
    .unwrap();
    assert!(matches!(&e, TokenizerError::WrongType { key, .. } if key == "tokenizer.ggml.add_bos_token"), "{e}");
}

#[test]
fn minimal_gguf_vocabulary_builds() {
    // A tiny SentencePiece vocabulary with no scores or types: every token is
    // normal with score 0, so "▁ab" forms via "▁a", and "c" (no byte tokens)
    // falls back to <unk> (id 0).
    let tok = Tokenizer::from_gguf(&gguf(vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", strings(&["<unk>", "▁ab", "▁", "a", "b", "▁a"])),
        ("tokenizer.ggml.add_space_prefix", Value::Bool(true)),
    ]))
    .unwrap();
    assert_eq!(tok.encode("ab", false, false), [1]);
    assert_eq!(tok.encode("c", false, false), [2, 0]);
    assert_eq!(tok.chat_template(), None);
    assert!(matches!(tok.apply_chat_template(&[], true), Err(TokenizerError::Template(_))));
}
