//! SentencePiece (BPE-by-score) tokenization, as llama.cpp's SPM tokenizer:
//! start from single chars and repeatedly merge the adjacent pair whose
//! concatenation is the highest-scoring vocabulary entry.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::symbols::{char_symbols, live_symbols, merge_into_left, Symbol};
use crate::vocab::Vocab;

/// The byte-fallback token of `b`: `<0xNN>`, else the one-char token, else `<unk>`.
pub(crate) fn byte_token(vocab: &Vocab, b: u8, unk: Option<u32>) -> Option<u32> {
    vocab.id(&format!("<0x{b:02X}>")).or_else(|| if b.is_ascii() { vocab.id(char::from(b).encode_utf8(&mut [0; 4])) } else { None }).or(unk)
}

struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// Highest score first; among equal scores the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then(other.left.cmp(&self.left))
    }
}

/// Tokenizes already-escaped text (spaces as U+2581) and appends the ids.
pub(crate) fn tokenize(vocab: &Vocab, unk: Option<u32>, text: &str, out: &mut Vec<u32>) {
    let mut symbols = char_symbols(text);
    let mut queue = BinaryHeap::new();
    let try_add = |symbols: &[Symbol], queue: &mut BinaryHeap<Bigram>, left: Option<usize>, right: Option<usize>| {
        let (Some(left), Some(right)) = (left, right) else { return };
        let (l, r) = (symbols[left], symbols[right]);
        let size = l.len + r.len;
        if let Some(id) = vocab.id(&text[l.start..l.start + size]) {
            queue.push(Bigram { score: vocab.scores[id as usize], left, right, size });
        }
    };
    for i in 1..symbols.len() {
        try_add(&symbols, &mut queue, Some(i - 1), Some(i));
    }
    while let Some(b) = queue.pop() {
        let (l, r) = (symbols[b.left], symbols[b.right]);
        // Stale entry: one side was merged since it was queued.
        if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
            continue;
        }
        merge_into_left(&mut symbols, b.left, b.right);
        try_add(&symbols, &mut queue, symbols[b.left].prev, Some(b.left));
        try_add(&symbols, &mut queue, Some(b.left), symbols[b.left].next);
    }
    for s in live_symbols(&symbols) {
        let piece = &text[s.start..s.start + s.len];
        match vocab.id(piece) {
            Some(id) => out.push(id),
            None => out.extend(piece.bytes().filter_map(|b| byte_token(vocab, b, unk))),
        }
    }
}
