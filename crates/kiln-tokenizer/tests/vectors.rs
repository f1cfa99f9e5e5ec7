//! Every llama.cpp tokenizer vector (9 vocabularies x 46 texts), encoded with
//! add_special = false, parse_special = false.

mod common;

fn check_vocab(name: &str) {
    let tok = common::load_vocab(name);
    let cases = common::read_cases(name);
    assert_eq!(cases.len(), 46, "{name}: expected 46 texts");
    let mut failures = Vec::new();
    for (i, (text, expected)) in cases.iter().enumerate() {
        let got = tok.encode(text, false, false);
        if &got != expected {
            let pieces: Vec<&str> = got.iter().map(|&id| tok.token_text(id).unwrap_or("?")).collect();
            failures.push(format!("vocab {name}, text #{i} {text:?}\n  expected {expected:?}\n  got      {got:?}\n  got pieces {pieces:?}"));
        }
    }
    assert!(failures.is_empty(), "{} of {} texts differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

macro_rules! vocab_tests {
    ($($test:ident => $name:literal),* $(,)?) => {
        $(#[test] fn $test() { check_vocab($name); })*
    };
}

vocab_tests! {
    llama_spm => "llama-spm",
    phi_3 => "phi-3",
    gpt_2 => "gpt-2",
    deepseek_coder => "deepseek-coder",
    falcon => "falcon",
    starcoder => "starcoder",
    bert_bge => "bert-bge",
    llama_bpe => "llama-bpe",
    qwen2 => "qwen2",
}

#[test]
fn all_nine_vocabularies_are_covered() {
    assert_eq!(common::VOCABS.len(), 9);
    for name in common::VOCABS {
        assert!(common::vocab_path(name).exists());
    }
}
