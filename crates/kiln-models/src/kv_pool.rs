//! The paged KV cache: every layer's cache holds the same numbered blocks of
//! [`KV_BLOCK_SIZE`] positions, and a sequence owns a table of block ids. Blocks are
//! reference-counted so that full blocks can be shared by several sequences (a prefix cache),
//! and memory behind them is taken only as the high-water mark of blocks in use rises.

use kiln_core::{Backend, KvCacheSpec, KvType, KV_BLOCK_SIZE};

use crate::error::{ModelError, Result};

/// Blocks the pool backs at least when it first takes memory.
const MIN_GROWTH: usize = 16;

/// Blocks by id: free list, reference counts, and how many are backed by memory.
#[derive(Debug)]
pub struct BlockAllocator {
    capacity: usize,
    /// Blocks `0..usable` have memory behind them.
    usable: usize,
    free: Vec<u32>,
    refs: Vec<u32>,
}

impl BlockAllocator {
    pub fn new(capacity: usize) -> BlockAllocator {
        BlockAllocator { capacity, usable: 0, free: Vec::with_capacity(capacity), refs: vec![0; capacity] }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks that can still be handed out (free ones and ones not yet backed).
    pub fn available(&self) -> usize {
        self.free.len() + (self.capacity - self.usable)
    }

    pub fn in_use(&self) -> usize {
        self.capacity - self.available()
    }

    pub fn usable(&self) -> usize {
        self.usable
    }

    /// How many blocks must be backed so that `n` more can be handed out.
    fn usable_for(&self, n: usize) -> usize {
        self.usable + n.saturating_sub(self.free.len())
    }

    /// Hands out `n` blocks, each with one reference, appending them to `out`. `back` is called
    /// first with the new number of usable blocks when memory must be added.
    pub fn take(&mut self, n: usize, out: &mut Vec<u32>, back: impl FnOnce(usize) -> Result<()>) -> Result<()> {
        if n > self.available() {
            return Err(ModelError::OutOfKvBlocks { needed: n, available: self.available(), capacity: self.capacity });
        }
        let want = self.usable_for(n);
        if want > self.usable {
            // Double (from 16 blocks, 512 positions), so growth happens a few times per run.
            let grown = want.max(2 * self.usable).max(MIN_GROWTH).min(self.capacity);
            back(grown)?;
            self.free.extend((self.usable..grown).rev().map(|b| b as u32));
            self.usable = grown;
        }
        for _ in 0..n {
            let block = self.free.pop().expect("enough free blocks checked above");
            self.refs[block as usize] = 1;
            out.push(block);
        }
        Ok(())
    }

    fn refs_in_use(&mut self, block: u32, what: &str) -> Result<&mut u32> {
        match self.refs.get_mut(block as usize) {
            Some(r) if *r > 0 => Ok(r),
            _ => Err(ModelError::BadKvBlock(format!("{what} of block {block}, which is not in use (capacity {})", self.capacity))),
        }
    }

    /// Adds a reference to a block in use (another sequence shares it).
    pub fn retain(&mut self, block: u32) -> Result<()> {
        *self.refs_in_use(block, "retain")? += 1;
        Ok(())
    }

    /// Drops one reference; the block is free again when none is left.
    pub fn release(&mut self, block: u32) -> Result<()> {
        let r = self.refs_in_use(block, "release")?;
        *r -= 1;
        if *r == 0 {
            self.free.push(block);
        }
        Ok(())
    }

    /// References to `block` (0 when free or out of range).
    pub fn refs(&self, block: u32) -> u32 {
        self.refs.get(block as usize).copied().unwrap_or(0)
    }
}

/// How large the pool may grow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvBudget {
    Blocks(usize),
    Bytes(u64),
}

/// The caches of every layer that stores keys and values, and the allocator of their shared
/// block ids.
pub struct KvPool<B: Backend> {
    pub(crate) caches: Vec<B::KvCache>,
    pub(crate) blocks: BlockAllocator,
    /// The first cache's spec; the others differ only in their row width.
    spec: KvCacheSpec,
    widths: Vec<usize>,
}

impl<B: Backend> KvPool<B> {
    /// Bytes one block takes over all `n_layers` layers.
    pub fn block_bytes(n_layers: usize, width: usize, k_type: KvType, v_type: KvType) -> u64 {
        Self::block_bytes_of(&vec![width; n_layers], k_type, v_type)
    }

    /// Bytes one block takes over caches of these row widths.
    pub fn block_bytes_of(widths: &[usize], k_type: KvType, v_type: KvType) -> u64 {
        widths.iter().map(|&w| (KV_BLOCK_SIZE * (k_type.row_bytes(w) + v_type.row_bytes(w))) as u64).sum()
    }

    pub fn new(backend: &B, n_layers: usize, width: usize, k_type: KvType, v_type: KvType, budget: KvBudget) -> Result<KvPool<B>> {
        Self::with_widths(backend, &vec![width; n_layers], k_type, v_type, budget)
    }

    /// One cache per entry of `widths`, each of rows of that many values.
    pub fn with_widths(backend: &B, widths: &[usize], k_type: KvType, v_type: KvType, budget: KvBudget) -> Result<KvPool<B>> {
        for &width in widths {
            k_type.check_width(width)?;
            v_type.check_width(width)?;
        }
        let block = Self::block_bytes_of(widths, k_type, v_type);
        let n_blocks = match budget {
            KvBudget::Blocks(n) => n,
            KvBudget::Bytes(bytes) => (bytes / block.max(1)) as usize,
        };
        if n_blocks == 0 {
            return Err(ModelError::BadHparam { key: "kv-mem".into(), reason: format!("the KV budget holds no block (one block takes {block} bytes)") });
        }
        let spec_of = |width| KvCacheSpec { n_blocks, width, k_type, v_type };
        let caches =
            widths.iter().enumerate().map(|(l, &w)| backend.alloc_kv(&spec_of(w), &format!("KV cache {l}"))).collect::<kiln_core::backend::Result<Vec<_>>>()?;
        Ok(KvPool { caches, blocks: BlockAllocator::new(n_blocks), spec: spec_of(widths.first().copied().unwrap_or(0)), widths: widths.to_vec() })
    }

    pub fn spec(&self) -> &KvCacheSpec {
        &self.spec
    }

    pub fn allocator(&self) -> &BlockAllocator {
        &self.blocks
    }

    /// Gives `table` enough blocks for `positions` positions.
    pub(crate) fn reserve(&mut self, backend: &B, table: &mut Vec<u32>, positions: usize) -> Result<()> {
        let need = positions.div_ceil(KV_BLOCK_SIZE).saturating_sub(table.len());
        if need == 0 {
            return Ok(());
        }
        let caches = &mut self.caches;
        self.blocks.take(need, table, |usable| caches.iter_mut().try_for_each(|c| backend.grow_kv(c, usable)).map_err(ModelError::from))
    }

    /// Backs blocks `0..usable` with memory (a tensor-parallel peer following its leader's pool,
    /// whose ids it uses; its own allocator hands out nothing).
    pub(crate) fn back(&mut self, backend: &B, usable: usize) -> Result<()> {
        if usable > self.blocks.usable {
            for cache in &mut self.caches {
                backend.grow_kv(cache, usable)?;
            }
            self.blocks.usable = usable;
        }
        Ok(())
    }

    /// Returns a table's blocks; every id in it came from this pool's `take`.
    pub(crate) fn release(&mut self, table: &mut Vec<u32>) {
        for b in table.drain(..) {
            // A table only holds blocks it took, each with its own reference.
            let released = self.blocks.release(b);
            debug_assert!(released.is_ok(), "{released:?}");
        }
    }

    /// Bytes of the blocks backed by memory now.
    pub fn usable_bytes(&self) -> u64 {
        self.blocks.usable() as u64 * self.bytes_per_block()
    }

    /// Bytes one block takes over every cache of the pool.
    pub fn bytes_per_block(&self) -> u64 {
        Self::block_bytes_of(&self.widths, self.spec.k_type, self.spec.v_type)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_counted_shared_and_freed() {
        let mut a = BlockAllocator::new(16);
        let mut grown = Vec::new();
        let mut table = Vec::new();
        a.take(3, &mut table, |n| {
            grown.push(n);
            Ok(())
        })
        .unwrap();
        assert_eq!(table.len(), 3);
        assert_eq!(grown, vec![MIN_GROWTH]);
        assert_eq!(a.available(), 13);
        a.retain(table[0]).unwrap();
        a.release(table[0]).unwrap();
        assert_eq!(a.refs(table[0]), 1);
        for &b in &table {
            a.release(b).unwrap();
        }
        assert!(matches!(a.release(table[0]), Err(ModelError::BadKvBlock(_))));
        assert!(a.retain(999).unwrap_err().to_string().contains("block 999"));
        assert_eq!(a.refs(999), 0);
        assert_eq!(a.available(), 16);
        let mut again = Vec::new();
        a.take(3, &mut again, |_| panic!("no growth needed")).unwrap();
        let err = a.take(14, &mut again, |_| Ok(())).unwrap_err();
        assert!(matches!(err, ModelError::OutOfKvBlocks { needed: 14, available: 13, capacity: 16 }), "{err}");
        let distinct: std::collections::HashSet<_> = again.iter().collect();
        assert_eq!(distinct.len(), again.len());
    }
}
