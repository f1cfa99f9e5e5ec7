//! Sliding-window layers keep only the KV blocks their window can still reach.
//!
//! The caches of layers with a sliding window (narrower than the context) live in a pool of
//! their own, and every sequence has a second block table for it, indexed like the first
//! (entry `i` covers positions `i * KV_BLOCK_SIZE..`), so the attention kernels address both
//! alike. After each step the entries wholly before the earliest position a later query can see
//! are set to [`RELEASED_BLOCK`] and their blocks go back to the pool, where other sequences
//! take them. A step's first query at `pos` sees `pos + 1 - window..=pos`, so the entries kept
//! start at the block holding `n_cached + 1 - window`, plus one block more: then the window of a
//! query at any block boundary up to `n_cached` is still held when the step ends, which is what
//! the server's prefix cache needs to start another sequence there. A sequence holds at most
//! `(window - 1) / KV_BLOCK_SIZE + 3` window blocks between steps, however long it grows.
//!
//! Window layers read the step through their own step object, whose plan carries the window
//! tables (the same tokens and positions, other cache rows). Global layers keep the sequence's
//! first table, and a model without a window narrower than the context has no second pool.

use kiln_core::plan::{FlatPlan, SeqStep, StepCapacity};
use kiln_core::{Backend, BackendError, KvType, KV_BLOCK_SIZE, RELEASED_BLOCK};

use crate::config::KvCacheLayout;
use crate::engine::Sequence;
use crate::error::{ModelError, Result};
use crate::kv_pool::{KvBudget, KvPool};

/// Where a KV cache lives: which pool, and its index among that pool's caches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CacheSlot {
    pub windowed: bool,
    pub index: usize,
}

/// Window blocks one sequence may hold at once: between steps at most
/// `(window - 1) / KV_BLOCK_SIZE + 3`, one more while a step's last block is partly filled.
pub fn window_blocks_per_seq(window: usize) -> usize {
    window.saturating_sub(1) / KV_BLOCK_SIZE + 4
}

/// The window pool a configuration needs: every sequence at its most, plus room for the step's
/// tokens (a prompt chunk is written whole before its blocks fall out of the window), and never
/// more than tables over the whole context would take.
pub fn window_pool_blocks(window: usize, max_seqs: usize, max_batch_tokens: usize, max_seq_len: usize) -> usize {
    let whole = max_seqs * max_seq_len.div_ceil(KV_BLOCK_SIZE);
    (max_seqs * window_blocks_per_seq(window) + max_batch_tokens.div_ceil(KV_BLOCK_SIZE)).min(whole)
}

/// The pools of a model: which caches go to the window pool, and the budget of each.
pub(crate) struct PoolPlan {
    pub slots: Vec<CacheSlot>,
    pub full_widths: Vec<usize>,
    pub full_budget: KvBudget,
    /// The window pool's widths, budget and window, when the model has one.
    pub window: Option<(Vec<usize>, KvBudget, usize)>,
}

/// Splits the caches and the budget: a cache goes to the window pool when every layer reading
/// it has a window narrower than the context. The window pool gets what its sequences can use
/// ([`window_pool_blocks`]), at most half of a byte budget; the full pool gets the rest (a block
/// budget counts the full pool's blocks).
pub(crate) fn plan_pools(
    caches: &[KvCacheLayout],
    budget: Option<KvBudget>,
    (max_seqs, max_batch_tokens, max_seq_len): (usize, usize, usize),
    (k_type, v_type): (KvType, KvType),
) -> Result<PoolPlan> {
    let window = caches.iter().filter_map(|c| c.window).filter(|&w| w < max_seq_len).max();
    let windowed = |c: &KvCacheLayout| window.is_some() && c.window.is_some_and(|w| w < max_seq_len);
    let (mut full_widths, mut window_widths, mut slots) = (Vec::new(), Vec::new(), Vec::new());
    for c in caches {
        let (widths, is_windowed) = if windowed(c) { (&mut window_widths, true) } else { (&mut full_widths, false) };
        slots.push(CacheSlot { windowed: is_windowed, index: widths.len() });
        widths.push(c.width);
    }
    let whole = KvBudget::Blocks(max_seqs * max_seq_len.div_ceil(KV_BLOCK_SIZE));
    let Some(window) = window else {
        return Ok(PoolPlan { slots, full_widths, full_budget: budget.unwrap_or(whole), window: None });
    };
    let need = window_pool_blocks(window, max_seqs, max_batch_tokens, max_seq_len);
    let (window_budget, full_budget) = match budget {
        None => (need, whole),
        Some(KvBudget::Blocks(n)) => (need, KvBudget::Blocks(n)),
        Some(KvBudget::Bytes(bytes)) => {
            let block = KvPool::<kiln_core::CpuBackend>::block_bytes_of(&window_widths, k_type, v_type).max(1);
            let blocks = need.min((bytes / 2 / block) as usize);
            (blocks, KvBudget::Bytes(bytes - blocks as u64 * block))
        }
    };
    // Without global caches the full table only numbers positions: its ids cost no memory.
    let full_budget = if full_widths.is_empty() { whole } else { full_budget };
    Ok(PoolPlan { slots, full_widths, full_budget, window: Some((window_widths, KvBudget::Blocks(window_budget), window)) })
}

/// The window layers' pool, their step object and the plan written to it.
pub(crate) struct WindowKv<B: Backend> {
    pub pool: KvPool<B>,
    pub window: usize,
    pub step: B::Step,
    pub plan: FlatPlan,
}

impl<B: Backend> WindowKv<B> {
    pub fn new(backend: &B, widths: &[usize], types: (KvType, KvType), budget: KvBudget, window: usize, capacity: &StepCapacity) -> Result<WindowKv<B>> {
        let pool = KvPool::with_widths(backend, widths, types.0, types.1, budget)?;
        let step = backend.alloc_step(capacity, pool.spec().n_blocks)?;
        Ok(WindowKv { pool, window, step, plan: FlatPlan::with_capacity(capacity) })
    }

    /// The first table entry a query at `pos` reads.
    fn first_read(&self, pos: usize) -> usize {
        (pos + 1).saturating_sub(self.window) / KV_BLOCK_SIZE
    }

    /// Entries a prefix of `n_blocks` full blocks must hold for the next query to see its window.
    pub fn prefix_entries(&self) -> usize {
        self.window.saturating_sub(1).div_ceil(KV_BLOCK_SIZE)
    }

    /// Blocks a step feeding `seq`'s next `n_tokens` takes: entries past the table's end, and
    /// released ones a sequence fed again from an earlier position needs back.
    pub fn blocks_to_feed(&self, seq: &Sequence, n_tokens: usize) -> usize {
        let end = (seq.n_cached() + n_tokens).div_ceil(KV_BLOCK_SIZE);
        seq.window_released.saturating_sub(self.first_read(seq.n_cached())) + end.saturating_sub(seq.window_blocks.len())
    }

    /// Gives `seq`'s window table blocks for positions up to `end` (what
    /// [`WindowKv::blocks_to_feed`] counted).
    pub fn reserve(&mut self, backend: &B, seq: &mut Sequence, end: usize) -> Result<()> {
        let first = self.first_read(seq.n_cached());
        if first < seq.window_released {
            // Fed again from before its window: the released entries get new blocks, swapped
            // in from the table's end.
            let (at, n) = (seq.window_blocks.len(), seq.window_released - first);
            self.pool.reserve(backend, &mut seq.window_blocks, (at + n) * KV_BLOCK_SIZE)?;
            for j in 0..n {
                seq.window_blocks.swap(first + j, at + j);
            }
            seq.window_blocks.truncate(at);
            seq.window_released = first;
        }
        self.pool.reserve(backend, &mut seq.window_blocks, end)
    }

    /// Releases the entries of `seq`'s table that no later query reads (see the module docs).
    pub fn release_behind(&mut self, seq: &mut Sequence) {
        let keep_from = self.first_read(seq.n_cached()).saturating_sub(1).min(seq.window_blocks.len());
        for entry in seq.window_blocks.iter_mut().take(keep_from).skip(seq.window_released) {
            // A table only holds blocks it took or retained, each with its own reference.
            let released = self.pool.blocks.release(*entry);
            debug_assert!(released.is_ok(), "{released:?}");
            *entry = RELEASED_BLOCK;
        }
        seq.window_released = seq.window_released.max(keep_from);
        self.note_resume(seq);
    }

    /// The earliest cached length `seq` can resume from: its window must still be held.
    fn note_resume(&self, seq: &mut Sequence) {
        seq.window_resume_from = if seq.window_released == 0 { 0 } else { seq.window_released * KV_BLOCK_SIZE + self.window - 1 };
    }

    /// Returns every block of `seq`'s window table.
    pub fn release_all(&mut self, seq: &mut Sequence) {
        for &b in seq.window_blocks.iter().skip(seq.window_released) {
            let released = self.pool.blocks.release(b);
            debug_assert!(released.is_ok(), "{released:?}");
        }
        seq.window_blocks.clear();
        (seq.window_released, seq.window_resume_from) = (0, 0);
    }

    /// Starts `seq`'s window table on a prefix of `blocks.len()` full blocks whose window blocks
    /// are `blocks` (released entries as [`RELEASED_BLOCK`]): the entries the next query reads
    /// get one more reference each, the ones before it stay released.
    pub fn attach(&mut self, seq: &mut Sequence, blocks: &[u32]) -> Result<()> {
        let first = self.first_read(blocks.len() * KV_BLOCK_SIZE);
        let needed = &blocks[first.min(blocks.len())..];
        if let Some(i) = needed.iter().position(|&b| b == RELEASED_BLOCK) {
            return Err(ModelError::BadKvBlock(format!(
                "a prefix of {} blocks lacks window block {} (its window reaches back to block {first})",
                blocks.len(),
                first + i
            )));
        }
        for (i, &b) in needed.iter().enumerate() {
            if let Err(e) = self.pool.blocks.retain(b) {
                needed[..i].iter().for_each(|&r| drop(self.pool.blocks.release(r)));
                return Err(e);
            }
        }
        seq.window_blocks.clear();
        seq.window_blocks.extend(std::iter::repeat_n(RELEASED_BLOCK, first.min(blocks.len())));
        seq.window_blocks.extend_from_slice(needed);
        seq.window_released = first.min(blocks.len());
        self.note_resume(seq);
        Ok(())
    }

    /// Appends `seq`'s part of the step to the window plan (the main plan's, over this table).
    pub fn push(&mut self, step: &SeqStep, seq: &Sequence, capacity: &StepCapacity) -> kiln_core::backend::Result<()> {
        let cache_blocks = self.pool.spec().n_blocks;
        self.plan.push(&SeqStep { blocks: &seq.window_blocks, ..*step }, capacity, cache_blocks)
    }
}

/// Every KV cache of one rank as the forward pass reads them: each cache in its pool, read
/// through the step of that pool.
pub(crate) struct LayerCaches<'a, B: Backend> {
    pub full: &'a mut [B::KvCache],
    pub step: &'a B::Step,
    pub window: Option<(&'a mut [B::KvCache], &'a B::Step)>,
    pub slots: &'a [CacheSlot],
}

impl<B: Backend> LayerCaches<'_, B> {
    /// Cache `index` (numbered as [`crate::ModelConfig::kv_widths`]) and the step it is read with.
    pub fn get(&mut self, index: usize) -> kiln_core::backend::Result<(&mut B::KvCache, &B::Step)> {
        let slot = self.slots.get(index).ok_or_else(|| BackendError::BadPlan(format!("no KV cache {index}")))?;
        let (caches, step) = match (&mut self.window, slot.windowed) {
            (Some((caches, step)), true) => (&mut **caches, *step),
            (None, true) => return Err(BackendError::BadPlan(format!("KV cache {index} is a window cache, but the step has no window pool"))),
            (_, false) => (&mut *self.full, self.step),
        };
        let cache = caches.get_mut(slot.index).ok_or_else(|| BackendError::BadPlan(format!("no KV cache {index}")))?;
        Ok((cache, step))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layouts() -> Vec<KvCacheLayout> {
        // gemma4's kind: sliding and global caches of different widths.
        vec![KvCacheLayout { width: 128, window: Some(1024) }, KvCacheLayout { width: 256, window: None }, KvCacheLayout { width: 128, window: Some(1024) }]
    }

    #[test]
    fn window_caches_get_a_pool_sized_by_the_window() {
        let types = (KvType::F16, KvType::F16);
        let plan = plan_pools(&layouts(), None, (4, 512, 32768), types).unwrap();
        let slot = |windowed, index| CacheSlot { windowed, index };
        assert_eq!(plan.slots, vec![slot(true, 0), slot(false, 0), slot(true, 1)]);
        assert_eq!((plan.full_widths, plan.full_budget), (vec![256], KvBudget::Blocks(4 * 1024)));
        let (widths, budget, window) = plan.window.unwrap();
        // 35 blocks a sequence at most (1023 / 32 + 4), and the step's 512 tokens.
        assert_eq!((widths, budget, window), (vec![128, 128], KvBudget::Blocks(4 * 35 + 16), 1024));

        // A byte budget: the window pool takes what it can use, the full pool the rest.
        let window_block = KvPool::<kiln_core::CpuBackend>::block_bytes_of(&[128, 128], KvType::F16, KvType::F16);
        let plan = plan_pools(&layouts(), Some(KvBudget::Bytes(1 << 30)), (4, 512, 32768), types).unwrap();
        assert_eq!(plan.full_budget, KvBudget::Bytes((1 << 30) - 156 * window_block));
        // A tight one leaves the window pool half of it at most.
        let plan = plan_pools(&layouts(), Some(KvBudget::Bytes(10 * window_block)), (4, 512, 32768), types).unwrap();
        assert_eq!(plan.window.unwrap().1, KvBudget::Blocks(5));

        // A window as wide as the context releases nothing: one pool.
        let plan = plan_pools(&layouts(), None, (4, 512, 1024), types).unwrap();
        assert!(plan.window.is_none() && plan.slots.iter().all(|s| !s.windowed) && plan.full_widths.len() == 3);
    }
}
