//! The prefix cache (the KV-cache manager's sharing half): full KV blocks indexed by a hash
//! chain of their token contents, so that a request starting with the same tokens as an
//! earlier one (a system prompt, the conversation so far) takes those blocks instead of
//! computing them. The cache holds one reference to each block it indexes; a block only the
//! cache holds is free to evict, least recently used first.
//!
//! On a model with sliding-window layers an entry also holds the window-pool block of its
//! positions when that block was still held as the entry was indexed (sequences release the
//! window blocks that fall out of their window, `kiln_models::window_kv`). A prefix is reused
//! only up to the deepest block whose last [`kiln_models::Engine::prefix_window_entries`]
//! entries all carry their window blocks, so the next query sees its whole window and the
//! logits equal those of computing the prefix; a shorter match is taken over a longer one
//! without them. Window blocks only the cache holds are evicted on their own (the entry stays,
//! for its full block) when the window pool runs short.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use kiln_core::{Backend, KV_BLOCK_SIZE, RELEASED_BLOCK};
use kiln_models::{BlockAllocator, Engine, ModelError};

/// Which of the engine's pools a block is from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pool {
    /// The pool of the global layers (every layer, without sliding windows).
    Full,
    /// The sliding-window layers' pool.
    Window,
}

/// Who counts block references: the engine in the server, a bare allocator in tests (one
/// allocator numbering the blocks of both pools).
pub trait BlockRefs {
    fn refs(&self, pool: Pool, block: u32) -> u32;
    fn retain(&mut self, pool: Pool, block: u32) -> Result<(), ModelError>;
    fn release(&mut self, pool: Pool, block: u32) -> Result<(), ModelError>;
}

impl<B: Backend> BlockRefs for Engine<B> {
    fn refs(&self, pool: Pool, block: u32) -> u32 {
        match pool {
            Pool::Full => self.pool().allocator().refs(block),
            Pool::Window => self.window_pool().map_or(0, |p| p.allocator().refs(block)),
        }
    }
    fn retain(&mut self, pool: Pool, block: u32) -> Result<(), ModelError> {
        match pool {
            Pool::Full => self.retain_block(block),
            Pool::Window => self.retain_window_block(block),
        }
    }
    fn release(&mut self, pool: Pool, block: u32) -> Result<(), ModelError> {
        match pool {
            Pool::Full => self.release_block(block),
            Pool::Window => self.release_window_block(block),
        }
    }
}

impl BlockRefs for BlockAllocator {
    fn refs(&self, _: Pool, block: u32) -> u32 {
        BlockAllocator::refs(self, block)
    }
    fn retain(&mut self, _: Pool, block: u32) -> Result<(), ModelError> {
        BlockAllocator::retain(self, block)
    }
    fn release(&mut self, _: Pool, block: u32) -> Result<(), ModelError> {
        BlockAllocator::release(self, block)
    }
}

/// The hash a chain starts from (the parent of a sequence's first block).
pub const ROOT_HASH: u64 = 0;

/// The chain hash of a block: its parent's hash and its tokens.
pub fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

struct Entry {
    block: u32,
    /// Its window-pool block, while the cache holds one.
    window_block: Option<u32>,
    parent: u64,
    /// Compared on lookup, so a hash collision can never hand out another prompt's keys.
    tokens: Box<[u32]>,
    last_use: u64,
}

/// A run of cached blocks that a sequence's tokens start with.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    pub blocks: Vec<u32>,
    /// Their window-pool blocks ([`RELEASED_BLOCK`] where the cache holds none); empty on a
    /// model without a window pool.
    pub window_blocks: Vec<u32>,
    /// The chain hash of the last matched block ([`ROOT_HASH`] when none).
    pub last_hash: u64,
}

#[derive(Default)]
pub struct PrefixCache {
    entries: HashMap<u64, Entry>,
    /// Entries by last use (a unique tick each), oldest first.
    by_use: BTreeMap<u64, u64>,
    clock: u64,
    /// Sliding-window models: the trailing entries whose window blocks a match must hold.
    window_entries: Option<usize>,
}

impl PrefixCache {
    /// A cache for a model whose matches need their last `window_entries` window blocks
    /// (`None`: a model without a window pool).
    pub fn new(window_entries: Option<usize>) -> PrefixCache {
        PrefixCache { window_entries, ..PrefixCache::default() }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Marks a chain of entries used now, its last block the least recent of them, so that
    /// eviction takes the ends of chains before the prefixes other chains share.
    fn touch(&mut self, hashes: &[u64]) {
        for &h in hashes.iter().rev() {
            if let Some(e) = self.entries.get_mut(&h) {
                self.by_use.remove(&e.last_use);
                self.clock += 1;
                e.last_use = self.clock;
                self.by_use.insert(self.clock, h);
            }
        }
    }

    /// The longest run of cached full blocks that `tokens` starts with, at most `max_blocks`
    /// (on a sliding-window model, the longest whose window blocks the next query needs are held).
    pub fn lookup(&mut self, tokens: &[u32], max_blocks: usize) -> PrefixMatch {
        let mut found = PrefixMatch::default();
        let mut hashes = Vec::new();
        let mut parent = ROOT_HASH;
        for chunk in tokens.chunks_exact(KV_BLOCK_SIZE).take(max_blocks) {
            let h = chain_hash(parent, chunk);
            match self.entries.get(&h) {
                Some(e) if e.parent == parent && *e.tokens == *chunk => {
                    found.blocks.push(e.block);
                    found.window_blocks.push(e.window_block.unwrap_or(RELEASED_BLOCK));
                    parent = h;
                    hashes.push(h);
                }
                _ => break,
            }
        }
        match self.window_entries {
            Some(reach) => {
                let whole = |d: usize| found.window_blocks[d.saturating_sub(reach)..d].iter().all(|&b| b != RELEASED_BLOCK);
                let depth = (0..=found.blocks.len()).rev().find(|&d| whole(d)).unwrap_or(0);
                found.blocks.truncate(depth);
                found.window_blocks.truncate(depth);
                hashes.truncate(depth);
            }
            None => found.window_blocks.clear(),
        }
        found.last_hash = hashes.last().copied().unwrap_or(ROOT_HASH);
        self.touch(&hashes);
        found
    }

    /// Indexes `block`, a full block holding `tokens` after the chain `parent`, taking a
    /// reference to it and to `window_block`, its window-pool block if the sequence still holds
    /// it. Returns the block's chain hash. When the same contents are already cached (another
    /// sequence computed them too) the cache keeps its own block, and takes the window block
    /// if it had none.
    pub fn insert(&mut self, refs: &mut impl BlockRefs, parent: u64, tokens: &[u32], block: u32, window_block: Option<u32>) -> Result<u64, ModelError> {
        debug_assert_eq!(tokens.len(), KV_BLOCK_SIZE);
        let h = chain_hash(parent, tokens);
        let window_block = window_block.filter(|&b| self.window_entries.is_some() && b != RELEASED_BLOCK);
        match self.entries.get_mut(&h) {
            Some(e) => {
                if let (None, Some(w)) = (e.window_block, window_block) {
                    refs.retain(Pool::Window, w)?;
                    e.window_block = Some(w);
                }
            }
            None => {
                refs.retain(Pool::Full, block)?;
                if let Some(w) = window_block {
                    if let Err(e) = refs.retain(Pool::Window, w) {
                        drop(refs.release(Pool::Full, block));
                        return Err(e);
                    }
                }
                self.clock += 1;
                self.entries.insert(h, Entry { block, window_block, parent, tokens: tokens.into(), last_use: self.clock });
                self.by_use.insert(self.clock, h);
            }
        }
        Ok(h)
    }

    /// Marks the chain ending at `last_hash` (with `n_blocks` blocks) used now.
    pub fn touch_chain(&mut self, last_hash: u64, n_blocks: usize) {
        let mut hashes = Vec::with_capacity(n_blocks);
        let mut h = last_hash;
        while hashes.len() < n_blocks {
            match self.entries.get(&h) {
                Some(e) => {
                    hashes.push(h);
                    h = e.parent;
                }
                None => break,
            }
        }
        hashes.reverse();
        self.touch(&hashes);
    }

    /// Blocks that only the cache holds.
    pub fn evictable(&self, refs: &impl BlockRefs) -> usize {
        self.entries.values().filter(|e| refs.refs(Pool::Full, e.block) == 1).count()
    }

    /// Window-pool blocks that only the cache holds.
    pub fn evictable_window(&self, refs: &impl BlockRefs) -> usize {
        self.entries.values().filter_map(|e| e.window_block).filter(|&w| refs.refs(Pool::Window, w) == 1).count()
    }

    /// Frees up to `n` window-pool blocks that only the cache holds, least recently used first
    /// (their entries stay, for their full blocks); returns how many it freed.
    pub fn evict_window(&mut self, refs: &mut impl BlockRefs, n: usize) -> usize {
        let mut freed = 0;
        for h in self.by_use.values() {
            if freed == n {
                break;
            }
            let e = self.entries.get_mut(h).expect("indexed entry");
            if let Some(w) = e.window_block.filter(|&w| refs.refs(Pool::Window, w) == 1) {
                e.window_block = None;
                let released = refs.release(Pool::Window, w);
                debug_assert!(released.is_ok(), "{released:?}");
                freed += 1;
            }
        }
        freed
    }

    /// Frees up to `n` blocks that only the cache holds, least recently used first; returns
    /// how many it freed.
    pub fn evict(&mut self, refs: &mut impl BlockRefs, n: usize) -> usize {
        let mut victims = Vec::new();
        for (&tick, &h) in &self.by_use {
            if victims.len() == n {
                break;
            }
            if refs.refs(Pool::Full, self.entries[&h].block) == 1 {
                victims.push((tick, h));
            }
        }
        for &(tick, h) in &victims {
            self.by_use.remove(&tick);
            let e = self.entries.remove(&h).expect("indexed entry");
            // The cache's own references, counted when it was inserted.
            let released = refs.release(Pool::Full, e.block);
            debug_assert!(released.is_ok(), "{released:?}");
            if let Some(w) = e.window_block {
                let released = refs.release(Pool::Window, w);
                debug_assert!(released.is_ok(), "{released:?}");
            }
        }
        victims.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take(a: &mut BlockAllocator, n: usize) -> Vec<u32> {
        let mut t = Vec::new();
        a.take(n, &mut t, |_| Ok(())).unwrap();
        t
    }

    fn tokens(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32).map(|i| i * 7 + salt).collect()
    }

    fn insert_all(cache: &mut PrefixCache, a: &mut BlockAllocator, toks: &[u32], blocks: &[u32]) -> u64 {
        let mut h = ROOT_HASH;
        for (chunk, &b) in toks.chunks_exact(KV_BLOCK_SIZE).zip(blocks) {
            h = cache.insert(a, h, chunk, b, None).unwrap();
        }
        h
    }

    #[test]
    fn shared_prefixes_match_block_by_block() {
        let mut a = BlockAllocator::new(16);
        let mut cache = PrefixCache::default();
        let first = tokens(3 * KV_BLOCK_SIZE + 5, 1);
        let blocks = take(&mut a, 4);
        insert_all(&mut cache, &mut a, &first, &blocks[..3]);
        assert_eq!((cache.len(), a.refs(blocks[0])), (3, 2));

        let m = cache.lookup(&first, 10);
        assert_eq!(m.blocks, blocks[..3]);
        assert_eq!(cache.lookup(&first, 2).blocks, blocks[..2]);
        // A change inside the second block keeps only the first.
        let mut other = first.clone();
        other[KV_BLOCK_SIZE + 3] += 1;
        assert_eq!(cache.lookup(&other, 10).blocks, blocks[..1]);
        // The same block contents after a different first block do not match.
        let mut shifted = first.clone();
        shifted[0] += 1;
        assert!(cache.lookup(&shifted, 10).blocks.is_empty());
        // Inserting contents already cached keeps the cached block and takes no reference.
        let dup = take(&mut a, 1);
        cache.insert(&mut a, ROOT_HASH, &first[..KV_BLOCK_SIZE], dup[0], None).unwrap();
        assert_eq!((cache.len(), a.refs(dup[0])), (3, 1));
    }

    #[test]
    fn eviction_frees_only_cache_held_blocks_oldest_chain_ends_first() {
        let mut a = BlockAllocator::new(16);
        let mut cache = PrefixCache::default();
        let old = tokens(2 * KV_BLOCK_SIZE, 100);
        let new = tokens(2 * KV_BLOCK_SIZE, 200);
        let old_blocks = take(&mut a, 2);
        let new_blocks = take(&mut a, 2);
        insert_all(&mut cache, &mut a, &old, &old_blocks);
        let new_hash = insert_all(&mut cache, &mut a, &new, &new_blocks);
        // The sequences end: only the cache holds the blocks now.
        for &b in old_blocks.iter().chain(&new_blocks) {
            a.release(b).unwrap();
        }
        cache.touch_chain(new_hash, 2);
        assert_eq!(cache.evictable(&a), 4);
        // A running sequence shares the old chain's first block: it cannot be evicted.
        a.retain(old_blocks[0]).unwrap();
        assert_eq!(cache.evictable(&a), 3);
        assert_eq!(cache.evict(&mut a, 2), 2);
        assert_eq!(a.refs(old_blocks[1]), 0, "the old chain's end goes first");
        assert_eq!(a.refs(new_blocks[1]), 0, "then the end of the newer chain");
        assert_eq!(a.refs(old_blocks[0]), 2);
        assert_eq!(cache.lookup(&new, 2).blocks, new_blocks[..1]);
        assert_eq!(cache.evict(&mut a, 10), 1);
        assert_eq!(cache.len(), 1);
        a.release(old_blocks[0]).unwrap();
        assert_eq!(cache.evict(&mut a, 10), 1);
        assert!(cache.is_empty());
        assert_eq!(a.in_use(), 0);
    }

    #[test]
    fn window_models_match_only_where_the_window_blocks_are_held() {
        let mut a = BlockAllocator::new(16);
        let mut cache = PrefixCache::new(Some(1));
        let toks = tokens(4 * KV_BLOCK_SIZE, 3);
        let (blocks, window) = (take(&mut a, 4), take(&mut a, 4));
        // Indexed by a sequence that had already released its first two window blocks.
        let mut h = ROOT_HASH;
        for (i, chunk) in toks.chunks_exact(KV_BLOCK_SIZE).enumerate() {
            h = cache.insert(&mut a, h, chunk, blocks[i], (i >= 2).then_some(window[i])).unwrap();
        }
        let r = RELEASED_BLOCK;
        let m = cache.lookup(&toks, 10);
        assert_eq!((m.blocks, m.window_blocks, m.last_hash), (blocks.clone(), vec![r, r, window[2], window[3]], h));
        assert_eq!(cache.lookup(&toks, 3).blocks, blocks[..3]);
        // Diverging in the third block: the two blocks before it lack the window block the
        // next query needs, so nothing is reused.
        let mut other = toks.clone();
        other[2 * KV_BLOCK_SIZE + 1] += 1;
        assert_eq!(cache.lookup(&other, 10), PrefixMatch::default());
        // The sequence ends: its window blocks are the cache's alone, and go oldest first (the
        // chain's end), leaving the match one block shorter.
        for &b in blocks.iter().chain(&window) {
            a.release(b).unwrap();
        }
        assert_eq!((cache.evictable(&a), cache.evictable_window(&a)), (4, 2));
        assert_eq!(cache.evict_window(&mut a, 1), 1);
        assert_eq!(a.refs(window[3]), 0);
        assert_eq!(cache.lookup(&toks, 10).blocks, blocks[..3]);
        // Evicting the entries drops their window blocks too.
        assert_eq!(cache.evict(&mut a, 10), 4);
        assert_eq!(a.in_use(), 0);
    }
}
