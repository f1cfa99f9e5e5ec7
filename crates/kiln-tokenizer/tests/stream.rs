//! StreamDecoder: token-by-token output is always whole UTF-8 characters.

mod common;

use kiln_tokenizer::StreamDecoder;

const MULTIBYTE: [&str; 5] = [
    "我想在apple工作1314151天～",
    "🚀 (normal) 😶\u{200d}🌫️ (multiple emojis concatenated) ✅ 🦙🦙",
    "កាន់តែពិសេសអាចខលចេញ",
    "нещо на Български",
    "Cửa Việt 😁 ½",
];

#[test]
fn streaming_never_splits_characters() {
    for name in ["llama-spm", "phi-3", "gpt-2", "deepseek-coder", "falcon", "starcoder", "llama-bpe", "qwen2"] {
        let tok = common::load_vocab(name);
        let mut held_back = 0;
        for text in MULTIBYTE {
            let ids = tok.encode(text, false, false);
            let mut dec = StreamDecoder::new(&tok);
            let mut streamed = String::new();
            for &id in &ids {
                let chunk = dec.push(id);
                assert!(!chunk.contains('\u{FFFD}'), "vocab {name}, {text:?}: replacement char in {chunk:?}");
                if chunk.is_empty() && !tok.token_to_piece(id).is_empty() {
                    held_back += 1;
                }
                streamed += &chunk;
            }
            assert_eq!(dec.finish(), "", "vocab {name}, {text:?}: bytes left over");
            // SentencePiece pieces keep the dummy-prefix space; byte-level BPE is exact.
            let expected = if tok.add_space_prefix() { format!(" {text}") } else { text.to_string() };
            assert_eq!(streamed, expected, "vocab {name}");
        }
        // Every one of these vocabularies splits some of the characters above into byte tokens.
        assert!(held_back > 0, "vocab {name}: no partial character was ever held back");
    }
}

#[test]
fn finish_flushes_an_incomplete_character_lossily() {
    let tok = common::load_vocab("gpt-2");
    let ids = tok.encode("🦙", false, false);
    assert!(ids.len() > 1, "🦙 is several byte-level tokens in GPT-2: {ids:?}");
    let mut dec = StreamDecoder::new(&tok);
    assert_eq!(dec.push(ids[0]), "");
    assert_eq!(dec.finish(), "\u{FFFD}");
    // The decoder is reusable after finish.
    let all: String = ids.iter().map(|&id| dec.push(id)).collect();
    assert_eq!(all, "🦙");
}

#[test]
fn invalid_bytes_become_replacement_chars_without_stalling() {
    let tok = common::load_vocab("llama-spm");
    let byte = |b: u8| tok.token_id(&format!("<0x{b:02X}>")).unwrap();
    let mut dec = StreamDecoder::new(&tok);
    // A lone continuation byte can never start a character: replaced at once.
    assert_eq!(dec.push(byte(0x80)), "\u{FFFD}");
    assert_eq!(dec.push(byte(0xE2)), "");
    assert_eq!(dec.push(byte(0x82)), "");
    assert_eq!(dec.push(byte(0xAC)), "€");
}

#[test]
fn special_tokens_stream_only_when_asked() {
    let tok = common::load_vocab("llama-bpe");
    let eot = tok.eot().unwrap();
    assert_eq!(StreamDecoder::new(&tok).push(eot), "");
    assert_eq!(StreamDecoder::with_special(&tok).push(eot), "<|eot_id|>");
}
