//! Byte-level BPE (GPT-2 style): regex pre-tokenization, byte-to-char
//! encoding, then rank-ordered merges within each pre-token.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use fancy_regex::Regex;

use crate::symbols::{char_symbols, live_symbols, merge_into_left};
use crate::unicode::bytes_to_unicode;
use crate::vocab::Vocab;
use crate::{pretok, TokenizerError};

pub(crate) struct Bpe {
    regexes: Vec<Regex>,
    ignore_merges: bool,
    n_vocab: u32,
    /// Merge operands and results that are not vocabulary entries, numbered from `n_vocab`.
    extra_ids: HashMap<String, u32>,
    /// (left, right) piece ids -> (rank, merged piece id).
    merges: HashMap<(u32, u32), (u32, u32)>,
}

impl Bpe {
    pub(crate) fn new(vocab: &Vocab, merges: &[String], regexes: Vec<Regex>, ignore_merges: bool) -> Result<Bpe, TokenizerError> {
        let n_vocab = vocab.len() as u32;
        let mut extra_ids: HashMap<String, u32> = HashMap::new();
        let mut intern = |s: &str| {
            vocab.id(s).unwrap_or_else(|| {
                let next = n_vocab + extra_ids.len() as u32;
                *extra_ids.entry(s.to_string()).or_insert(next)
            })
        };
        let mut table = HashMap::with_capacity(merges.len());
        for (rank, merge) in merges.iter().enumerate() {
            // The separator is the first space after the first byte, as llama.cpp splits.
            let Some(pos) = merge.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
                return Err(TokenizerError::BadVocab(format!("tokenizer.ggml.merges[{rank}] = {merge:?} has no \"left right\" separator")));
            };
            let (left, right) = (&merge[..pos], &merge[pos + 1..]);
            let key = (intern(left), intern(right));
            let merged = intern(&format!("{left}{right}"));
            // The first occurrence of a pair keeps its rank.
            table.entry(key).or_insert((rank as u32, merged));
        }
        Ok(Bpe { regexes, ignore_merges, n_vocab, extra_ids, merges: table })
    }

    fn piece_id(&self, vocab: &Vocab, s: &str) -> Option<u32> {
        vocab.id(s).or_else(|| self.extra_ids.get(s).copied())
    }

    pub(crate) fn tokenize(&self, vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
        for word in pretok::split(text, &self.regexes) {
            let encoded = bytes_to_unicode(word.as_bytes());
            match self.ignore_merges.then(|| vocab.id(&encoded)).flatten() {
                Some(id) => out.push(id),
                None => self.merge_word(vocab, &encoded, out),
            }
        }
    }

    fn merge_word(&self, vocab: &Vocab, word: &str, out: &mut Vec<u32>) {
        let mut symbols = char_symbols(word);
        let mut ids: Vec<Option<u32>> = symbols.iter().map(|s| self.piece_id(vocab, &word[s.start..s.start + s.len])).collect();
        let mut queue = BinaryHeap::new();
        let add = |ids: &[Option<u32>], queue: &mut BinaryHeap<_>, left: Option<usize>, right: Option<usize>| {
            let (Some(l), Some(r)) = (left, right) else { return };
            let (Some(a), Some(b)) = (ids[l], ids[r]) else { return };
            if let Some(&(rank, _)) = self.merges.get(&(a, b)) {
                // Lowest rank first; among equal ranks the leftmost pair.
                queue.push(Reverse((rank, l, r, a, b)));
            }
        };
        for i in 1..symbols.len() {
            add(&ids, &mut queue, Some(i - 1), Some(i));
        }
        while let Some(Reverse((_, l, r, a, b))) = queue.pop() {
            // Stale entry: either side changed since it was queued.
            if symbols[l].len == 0 || symbols[r].len == 0 || ids[l] != Some(a) || ids[r] != Some(b) {
                continue;
            }
            merge_into_left(&mut symbols, l, r);
            ids[l] = Some(self.merges[&(a, b)].1);
            add(&ids, &mut queue, symbols[l].prev, Some(l));
            add(&ids, &mut queue, Some(l), symbols[l].next);
        }
        for s in live_symbols(&symbols) {
            let piece = &word[s.start..s.start + s.len];
            match self.piece_id(vocab, piece) {
                Some(id) if id < self.n_vocab => out.push(id),
                // Not a token: llama.cpp looks up each byte alone, which only ASCII can match.
                _ => out.extend(piece.bytes().filter(u8::is_ascii).filter_map(|b| vocab.id(&char::from(b).to_string()))),
            }
        }
    }
}
