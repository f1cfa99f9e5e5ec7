//! The three algorithms on tiny hand-made vocabularies, where each expected
//! result differs from what a plausible mistake (wrong priority, wrong tie
//! order, no fallback) would give.

use kiln_tokenizer::{token_type, Tokenizer, TokenizerSpec};

fn tokenizer(model: &str, tokens: &[&str], f: impl FnOnce(&mut TokenizerSpec)) -> Tokenizer {
    let mut spec = TokenizerSpec { model: model.into(), tokens: tokens.iter().map(|t| t.to_string()).collect(), ..Default::default() };
    f(&mut spec);
    Tokenizer::from_spec(&spec).unwrap()
}

fn texts(tok: &Tokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter().map(|&id| tok.token_text(id).unwrap().to_string()).collect()
}

const SPM_TOKENS: [&str; 12] = ["<unk>", "<s>", "</s>", "▁", "a", "b", "c", "ab", "bc", "▁a", "<0xC3>", "<0xA9>"];

fn spm(score_ab: f32, score_bc: f32) -> Tokenizer {
    tokenizer("llama", &SPM_TOKENS, |s| {
        let mut scores = vec![0.0; SPM_TOKENS.len()];
        scores[7] = score_ab;
        scores[8] = score_bc;
        scores[9] = -2.0;
        s.scores = Some(scores);
        let mut types = vec![token_type::NORMAL; SPM_TOKENS.len()];
        types[0] = token_type::UNKNOWN;
        types[1] = token_type::CONTROL;
        types[2] = token_type::CONTROL;
        types[10] = token_type::BYTE;
        types[11] = token_type::BYTE;
        s.token_types = Some(types);
    })
}

#[test]
fn spm_merges_highest_score_first() {
    let ab_first = spm(-0.5, -1.0);
    assert_eq!(texts(&ab_first, &ab_first.encode("abc", false, false)), ["▁", "ab", "c"]);
    let bc_first = spm(-1.0, -0.5);
    assert_eq!(texts(&bc_first, &bc_first.encode("abc", false, false)), ["▁a", "bc"]);
    // Equal scores: the leftmost pair wins.
    let tie = spm(-1.0, -1.0);
    assert_eq!(texts(&tie, &tie.encode("abc", false, false)), ["▁", "ab", "c"]);
}

#[test]
fn spm_byte_fallback_and_unknown() {
    let tok = spm(-1.0, -1.0);
    assert_eq!(texts(&tok, &tok.encode("é", false, false)), ["▁", "<0xC3>", "<0xA9>"]);
    assert_eq!(tok.decode(&tok.encode("é", false, false)), "é");
    // No <0xNN> token for 'z' and no 'z' piece: the unknown token.
    assert_eq!(texts(&tok, &tok.encode("z", false, false)), ["▁", "<unk>"]);
}

#[test]
fn spm_space_prefix_flag() {
    let tok = tokenizer("llama", &SPM_TOKENS, |s| s.add_space_prefix = Some(false));
    assert!(!tok.add_space_prefix());
    assert_eq!(texts(&tok, &tok.encode("a", false, false)), ["a"]);
    assert_eq!(tok.decode(&tok.encode("ab", false, false)), "ab");
}

fn bpe(merges: &[&str]) -> Tokenizer {
    tokenizer("gpt2", &["a", "b", "c", "ab", "bc", "abc", "Ġ", "Ġa"], |s| {
        s.pre = Some("gpt-2".into());
        s.merges = Some(merges.iter().map(|m| m.to_string()).collect());
    })
}

#[test]
fn bpe_merges_lowest_rank_first() {
    let tok = bpe(&["b c", "a b", "ab c"]);
    assert_eq!(texts(&tok, &tok.encode("abc", false, false)), ["a", "bc"]);
    let tok = bpe(&["a b", "b c", "ab c"]);
    assert_eq!(texts(&tok, &tok.encode("abc", false, false)), ["abc"]);
    // A space becomes "Ġ"; " a" is one pre-token and merges to "Ġa".
    let tok = bpe(&["Ġ a"]);
    assert_eq!(texts(&tok, &tok.encode("a a", false, false)), ["a", "Ġa"]);
}

#[test]
fn bpe_drops_unmappable_bytes_like_llama_cpp() {
    // "d" is not in the vocabulary and has no byte token: llama.cpp emits nothing for it.
    let tok = bpe(&["a b"]);
    assert_eq!(texts(&tok, &tok.encode("abd", false, false)), ["ab"]);
}

fn wpm() -> Tokenizer {
    tokenizer("bert", &["[PAD]", "[UNK]", "▁un", "▁unaff", "able", "▁x", "▁!", "▁a"], |s| {
        s.special.unk = Some(1);
        s.special.bos = Some(0);
        s.special.sep = Some(0);
    })
}

#[test]
fn wordpiece_longest_match_unknown_words_and_normalization() {
    let tok = wpm();
    assert_eq!(texts(&tok, &tok.encode("Unaffable", false, false)), ["▁unaff", "able"]);
    // Accents are stripped after NFD and text lowercased.
    assert_eq!(texts(&tok, &tok.encode("ÜNAFFÁBLE", false, false)), ["▁unaff", "able"]);
    // One unmatched position makes the whole word unknown.
    assert_eq!(texts(&tok, &tok.encode("unknown", false, false)), ["[UNK]"]);
    // Punctuation is its own word.
    assert_eq!(texts(&tok, &tok.encode("x! a", false, false)), ["▁x", "▁!", "▁a"]);
}
