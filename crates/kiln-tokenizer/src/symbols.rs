//! Linked char runs shared by the SentencePiece and BPE merge loops.

/// A run of text, linked to its neighbours; `len == 0` once merged away.
#[derive(Clone, Copy)]
pub(crate) struct Symbol {
    pub start: usize,
    pub len: usize,
    pub prev: Option<usize>,
    pub next: Option<usize>,
}

/// One symbol per char of `text`, linked in order.
pub(crate) fn char_symbols(text: &str) -> Vec<Symbol> {
    let n = text.chars().count();
    text.char_indices()
        .enumerate()
        .map(|(i, (start, c))| Symbol { start, len: c.len_utf8(), prev: i.checked_sub(1), next: (i + 1 < n).then_some(i + 1) })
        .collect()
}

/// Merges `right` into `left` and unlinks it.
pub(crate) fn merge_into_left(symbols: &mut [Symbol], left: usize, right: usize) {
    symbols[left].len += symbols[right].len;
    symbols[right].len = 0;
    symbols[left].next = symbols[right].next;
    if let Some(n) = symbols[right].next {
        symbols[n].prev = Some(left);
    }
}

pub(crate) fn live_symbols(symbols: &[Symbol]) -> impl Iterator<Item = &Symbol> {
    std::iter::successors((!symbols.is_empty()).then_some(0), |&i| symbols[i].next).map(|i| &symbols[i])
}
