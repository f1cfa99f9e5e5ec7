//! decode(encode(text)) == text wherever llama.cpp's detokenizer round-trips.

mod common;

/// Sequences llama.cpp's `clean_spaces` decode step rewrites (" ?" -> "?", " 's" -> "'s", ...).
fn touched_by_clean_up(text: &str) -> bool {
    [" ?", " !", " .", " ,", " '"].iter().any(|p| text.contains(p))
}

#[test]
fn bpe_vocabularies_round_trip() {
    for name in common::BPE_VOCABS {
        let tok = common::load_vocab(name);
        // deepseek-coder and qwen2 have clean_spaces off in llama.cpp; the others on.
        let cleans = !matches!(name, "deepseek-coder" | "qwen2");
        let mut checked = 0;
        for text in common::read_texts(name) {
            if cleans && touched_by_clean_up(&text) {
                continue;
            }
            let ids = tok.encode(&text, false, false);
            assert_eq!(tok.decode(&ids), text, "vocab {name}: round trip of {text:?} via {ids:?}");
            checked += 1;
        }
        assert!(checked >= 42, "vocab {name}: only {checked} texts checked");
    }
}

#[test]
fn clean_spaces_applies_only_where_llama_cpp_enables_it() {
    let text = "How are you 😁 ?";
    let gpt2 = common::load_vocab("gpt-2");
    assert_eq!(gpt2.decode(&gpt2.encode(text, false, false)), "How are you 😁?");
    let qwen = common::load_vocab("qwen2");
    assert_eq!(qwen.decode(&qwen.encode(text, false, false)), text);
}

#[test]
fn spm_round_trips_and_drops_the_dummy_prefix() {
    for name in ["llama-spm", "phi-3"] {
        let tok = common::load_vocab(name);
        for text in common::read_texts(name) {
            let ids = tok.encode(&text, false, false);
            assert_eq!(tok.decode(&ids), text, "vocab {name}: round trip of {text:?} via {ids:?}");
        }
    }
}

#[test]
fn spm_decode_after_bos_keeps_the_space_like_llama_cpp() {
    let tok = common::load_vocab("llama-spm");
    let ids = tok.encode("Hello world", true, false);
    assert_eq!(ids[0], 1);
    // llama.cpp strips the prefix space only when the first token is not BOS.
    assert_eq!(tok.decode(&ids), " Hello world");
    assert_eq!(tok.detokenize(&ids, true, false), " Hello world");
    assert_eq!(tok.detokenize(&ids, false, true), "<s> Hello world");
}

#[test]
fn wordpiece_decodes_lowercased_words_with_leading_spaces() {
    let tok = common::load_vocab("bert-bge");
    let ids = tok.encode("Hello World!", true, false);
    assert_eq!((ids[0], *ids.last().unwrap()), (101, 102));
    assert_eq!(tok.decode(&ids), " hello world!");
    assert_eq!(tok.detokenize(&ids, false, true), "[CLS] hello world![SEP]");
}
