//! The prefix cache (the KV-cache manager's sharing half): full KV blocks indexed by a hash
//! chain of their token contents, so that a request starting with the same tokens as an
//! earlier one (a system prompt, the conversation so far) takes those blocks instead of
//! computing them. The cache holds one reference to each block it indexes; a block only the
//! cache holds is free to evict, least recently used first.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use kiln_core::{Backend, KV_BLOCK_SIZE};
use kiln_models::{BlockAllocator, Engine, ModelError};

/// Who counts block references: the engine in the server, a bare allocator in tests.
pub trait BlockRefs {
    fn refs(&self, block: u32) -> u32;
    fn retain(&mut self, block: u32) -> Result<(), ModelError>;
    fn release(&mut self, block: u32) -> Result<(), ModelError>;
}

impl<B: Backend> BlockRefs for Engine<B> {
    fn refs(&self, block: u32) -> u32 {
        self.pool().allocator().refs(block)
    }
    fn retain(&mut self, block: u32) -> Result<(), ModelError> {
        self.retain_block(block)
    }
    fn release(&mut self, block: u32) -> Result<(), ModelError> {
        self.release_block(block)
    }
}

impl BlockRefs for BlockAllocator {
    fn refs(&self, block: u32) -> u32 {
        BlockAllocator::refs(self, block)
    }
    fn retain(&mut self, block: u32) -> Result<(), ModelError> {
        BlockAllocator::retain(self, block)
    }
    fn release(&mut self, block: u32) -> Result<(), ModelError> {
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
    parent: u64,
    /// Compared on lookup, so a hash collision can never hand out another prompt's keys.
    tokens: Box<[u32]>,
    last_use: u64,
}

/// A run of cached blocks that a sequence's tokens start with.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    pub blocks: Vec<u32>,
    /// The chain hash of the last matched block ([`ROOT_HASH`] when none).
    pub last_hash: u64,
}

#[derive(Default)]
pub struct PrefixCache {
    entries: HashMap<u64, Entry>,
    /// Entries by last use (a unique tick each), oldest first.
    by_use: BTreeMap<u64, u64>,
    clock: u64,
}

impl PrefixCache {
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

    /// The longest run of cached full blocks that `tokens` starts with, at most `max_blocks`.
    pub fn lookup(&mut self, tokens: &[u32], max_blocks: usize) -> PrefixMatch {
        let mut found = PrefixMatch { blocks: Vec::new(), last_hash: ROOT_HASH };
        let mut hashes = Vec::new();
        for chunk in tokens.chunks_exact(KV_BLOCK_SIZE).take(max_blocks) {
            let h = chain_hash(found.last_hash, chunk);
            match self.entries.get(&h) {
                Some(e) if e.parent == found.last_hash && *e.tokens == *chunk => {
                    found.blocks.push(e.block);
                    found.last_hash = h;
                    hashes.push(h);
                }
                _ => break,
            }
        }
        self.touch(&hashes);
        found
    }

    /// Indexes `block`, a full block holding `tokens` after the chain `parent`, taking a
    /// reference to it. Returns the block's chain hash. When the same contents are already
    /// cached (another sequence computed them too) the cache keeps its own block.
    pub fn insert(&mut self, refs: &mut impl BlockRefs, parent: u64, tokens: &[u32], block: u32) -> Result<u64, ModelError> {
        debug_assert_eq!(tokens.len(), KV_BLOCK_SIZE);
        let h = chain_hash(parent, tokens);
        if !self.entries.contains_key(&h) {
            refs.retain(block)?;
            self.clock += 1;
            self.entries.insert(h, Entry { block, parent, tokens: tokens.into(), last_use: self.clock });
            self.by_use.insert(self.clock, h);
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
        self.entries.values().filter(|e| refs.refs(e.block) == 1).count()
    }

    /// Frees up to `n` blocks that only the cache holds, least recently used first; returns
    /// how many it freed.
    pub fn evict(&mut self, refs: &mut impl BlockRefs, n: usize) -> usize {
        let mut victims = Vec::new();
        for (&tick, &h) in &self.by_use {
            if victims.len() == n {
                break;
            }
            if refs.refs(self.entries[&h].block) == 1 {
                victims.push((tick, h));
            }
        }
        for &(tick, h) in &victims {
            self.by_use.remove(&tick);
            let e = self.entries.remove(&h).expect("indexed entry");
            // The cache's own reference, counted when it was inserted.
            let released = refs.release(e.block);
            debug_assert!(released.is_ok(), "{released:?}");
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
            h = cache.insert(a, h, chunk, b).unwrap();
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
        cache.insert(&mut a, ROOT_HASH, &first[..KV_BLOCK_SIZE], dup[0]).unwrap();
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
}
