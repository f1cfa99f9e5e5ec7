//! Encoding speed: 100 KB of mixed text must encode well under a second.

mod common;

use std::time::Instant;

/// About 100 KB cycling through every test text (code, CJK, emoji, digits, whitespace runs).
fn big_text() -> String {
    let texts = common::read_texts("llama-bpe");
    let mut out = String::new();
    while out.len() < 100_000 {
        for t in &texts {
            out += t;
            out.push(' ');
        }
    }
    out
}

#[test]
fn encoding_100kb_is_fast() {
    let text = big_text();
    for name in common::VOCABS {
        let tok = common::load_vocab(name);
        let start = Instant::now();
        let ids = tok.encode(&text, false, true);
        let elapsed = start.elapsed();
        eprintln!("{name}: {} bytes -> {} tokens in {elapsed:?}", text.len(), ids.len());
        assert!(ids.len() > 10_000, "{name}: suspiciously few tokens");
        // The budget is generous for a loaded 2-core CI machine; typical times are far lower.
        assert!(elapsed.as_secs_f64() < 2.0, "{name}: encoding 100 KB took {elapsed:?}");
    }
}

#[test]
fn degenerate_100kb_inputs_stay_fast() {
    // One giant pre-token, one giant whitespace run, and a long run of multi-byte chars.
    let inputs = ["ab".repeat(50_000), " ".repeat(100_000), "😀x".repeat(20_000), "1".repeat(100_000)];
    for name in common::VOCABS {
        let tok = common::load_vocab(name);
        for text in &inputs {
            let start = Instant::now();
            let ids = tok.encode(text, false, false);
            let elapsed = start.elapsed();
            // WordPiece drops whitespace entirely; everything else yields tokens.
            let whitespace_only = text.trim().is_empty();
            assert_eq!(ids.is_empty(), name == "bert-bge" && whitespace_only, "{name}: {:?}...", &text[..8]);
            assert!(elapsed.as_secs_f64() < 2.0, "{name}: {:?}... took {elapsed:?}", &text[..8]);
        }
    }
}
