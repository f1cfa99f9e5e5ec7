//! The batched engine: shared [`Weights`], a paged [`KvPool`] (and a second one for
//! sliding-window layers, `window_kv`), a [`Workspace`] sized once for the largest step, and
//! [`Engine::step`], which runs one forward pass over any mix of sequences (prefill chunks and
//! single decode tokens) and samples each one that asks.

use std::sync::Arc;

use kiln_core::plan::{FlatPlan, LogitRows, SampleSpec, SeqStep, StepCapacity};
use kiln_core::{Backend, BackendError, DeviceBuffer, GroupHandle, KvType, SamplingParams, KV_BLOCK_SIZE};

use crate::error::{ModelError, Result};
use crate::forward::{attention_params, forward, Pass, Workspace};
use crate::kv_pool::{KvBudget, KvPool};
use crate::recurrent::RecurrentStates;
use crate::weights::Weights;
use crate::window_kv::{plan_pools, CacheSlot, LayerCaches, WindowKv};

/// One sequence: its tokens, its KV blocks and how many of its tokens they hold.
#[derive(Debug, Default)]
pub struct Sequence {
    /// Every token of the sequence so far (prompt and generated).
    pub tokens: Vec<u32>,
    n_cached: usize,
    blocks: Vec<u32>,
    pub sampling: SamplingParams,
    /// Tokens sampled so far (the sampler's draw counter).
    pub draws: u64,
    /// Hybrid models: the sequence's recurrent state slot, and how many tokens that state holds.
    state_slot: Option<u32>,
    state_len: usize,
    /// Sliding-window models: the table of the window pool, indexed like `blocks`, whose first
    /// `window_released` entries went back to the pool ([`kiln_core::RELEASED_BLOCK`]); the
    /// sequence can resume from `window_resume_from` cached tokens on, not before.
    pub(crate) window_blocks: Vec<u32>,
    pub(crate) window_released: usize,
    pub(crate) window_resume_from: usize,
}

impl Sequence {
    pub fn new(tokens: Vec<u32>, sampling: SamplingParams) -> Sequence {
        Sequence { tokens, sampling, ..Default::default() }
    }

    /// An empty sequence with room for `max_len` tokens, so that growing to it allocates nothing.
    pub fn with_capacity(max_len: usize, sampling: SamplingParams) -> Sequence {
        let blocks = max_len.div_ceil(KV_BLOCK_SIZE);
        Sequence {
            tokens: Vec::with_capacity(max_len),
            blocks: Vec::with_capacity(blocks),
            window_blocks: Vec::with_capacity(blocks),
            sampling,
            ..Default::default()
        }
    }

    /// Tokens whose keys and values are in the cache.
    pub fn n_cached(&self) -> usize {
        self.n_cached
    }

    /// Tokens not yet fed.
    pub fn n_pending(&self) -> usize {
        self.tokens.len() - self.n_cached
    }

    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// The window pool's table: entries wholly before the window are [`kiln_core::RELEASED_BLOCK`].
    pub fn window_blocks(&self) -> &[u32] {
        &self.window_blocks
    }

    /// Window-pool blocks the sequence holds now.
    pub fn window_blocks_held(&self) -> usize {
        self.window_blocks.len().saturating_sub(self.window_released)
    }

    /// New blocks a step feeding its next `n_tokens` tokens takes from the (full) pool.
    pub fn blocks_to_feed(&self, n_tokens: usize) -> usize {
        (self.n_cached + n_tokens).div_ceil(KV_BLOCK_SIZE).saturating_sub(self.blocks.len())
    }

    /// Forgets everything after the first `n` cached tokens (the blocks stay with the sequence).
    /// A hybrid model's recurrent state cannot go back, nor can a sliding-window cache whose
    /// blocks before the new end were released: there, truncating below what they hold keeps
    /// the tokens but none of the cache, and the next step feeds them all again.
    pub fn truncate(&mut self, n: usize) {
        self.n_cached = self.n_cached.min(n);
        self.tokens.truncate(n);
        if (self.state_slot.is_some() && self.n_cached < self.state_len) || self.n_cached < self.window_resume_from {
            self.n_cached = 0;
        }
    }
}

/// One sequence's part of a step: feed its next `n_tokens` pending tokens.
pub struct SeqWork<'a> {
    pub seq: &'a mut Sequence,
    pub n_tokens: usize,
    pub logits: LogitRows,
    /// Sample a token from the last fed token's logits (it is not appended to the sequence).
    pub sample: bool,
}

#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Most positions one sequence may hold (the context, `-c`).
    pub max_seq_len: usize,
    /// Most tokens one step feeds over all sequences (`-b`).
    pub max_batch_tokens: usize,
    /// Most sequences in one step.
    pub max_seqs: usize,
    /// Room for logits of every token of a step (teacher-forced evaluation), not only one per sequence.
    pub all_logits: bool,
    /// Tokens the repetition penalty can look back on.
    pub max_history: usize,
    pub k_type: KvType,
    pub v_type: KvType,
    /// The KV memory limit; `None`: every sequence at its full length. With sliding-window
    /// layers, a byte budget is split between the two pools and a block budget counts the full
    /// pool's blocks (the window pool gets what its sequences can hold, `window_kv`).
    pub kv_budget: Option<KvBudget>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            max_seq_len: 4096,
            max_batch_tokens: 512,
            max_seqs: 1,
            all_logits: false,
            max_history: 256,
            k_type: KvType::F16,
            v_type: KvType::F16,
            kv_budget: None,
        }
    }
}

pub struct Engine<B: Backend> {
    backend: Arc<B>,
    weights: Arc<Weights<B>>,
    pool: KvPool<B>,
    /// The sliding-window layers' pool, step and plan, when the model has such layers.
    window: Option<WindowKv<B>>,
    /// Which pool holds each KV cache.
    cache_slots: Vec<CacheSlot>,
    ws: Workspace<B>,
    step: B::Step,
    plan: FlatPlan,
    capacity: StepCapacity,
    options: EngineOptions,
    sampled: Vec<u32>,
    host_logits: Vec<f32>,
    /// Hybrid models' recurrent states, one slot per sequence.
    states: Option<RecurrentStates<B>>,
    /// The tensor-parallel group this engine's weights are a slice of.
    reduce: Option<GroupHandle<B>>,
    /// The group's other ranks (tensor parallelism): each its own backend, weight slice, caches
    /// and activations, run with this engine's plan; their allocators and plans are unused.
    peers: Vec<Engine<B>>,
}

/// The sizes of one step, the same on every rank.
#[derive(Clone, Copy)]
struct StepShape {
    n: usize,
    n_rows: usize,
    n_samples: usize,
    max_seq_len: usize,
    /// Decode steps repeat with the same shapes: recorded once under this key and replayed.
    graph_key: Option<u64>,
}

impl<B: Backend> Engine<B> {
    pub fn new(backend: Arc<B>, weights: Arc<Weights<B>>, options: &EngineOptions) -> Result<Engine<B>> {
        let c = &weights.config;
        let options = EngineOptions { max_batch_tokens: options.max_batch_tokens.max(1), max_seqs: options.max_seqs.max(1), ..options.clone() };
        let blocks_per_seq = options.max_seq_len.div_ceil(KV_BLOCK_SIZE);
        let logit_rows = if options.all_logits { options.max_batch_tokens } else { options.max_seqs.min(options.max_batch_tokens) };
        let capacity = StepCapacity {
            tokens: options.max_batch_tokens,
            seqs: options.max_seqs,
            blocks: options.max_seqs * blocks_per_seq,
            logit_rows,
            history: options.max_seqs * options.max_history,
        };
        let b = &*backend;
        let types = (options.k_type, options.v_type);
        let pools = plan_pools(&c.kv_caches(), options.kv_budget, (options.max_seqs, options.max_batch_tokens, options.max_seq_len), types)?;
        let pool = KvPool::with_widths(b, &pools.full_widths, options.k_type, options.v_type, pools.full_budget)?;
        let window = match pools.window {
            Some((widths, budget, window)) => Some(WindowKv::new(b, &widths, types, budget, window, &capacity)?),
            None => None,
        };
        if let Some(first) = c.layers.iter().find_map(crate::config::LayerConfig::attention) {
            let spec = match (&window, pools.slots.get(first.cache)) {
                (Some(w), Some(slot)) if slot.windowed => w.pool.spec(),
                _ => pool.spec(),
            };
            b.prepare(&weights.matrices(), &attention_params(first, options.max_seq_len), spec)?;
        }
        let ws = Workspace::new(b, c, options.max_batch_tokens, logit_rows)?;
        let step = b.alloc_step(&capacity, pool.spec().n_blocks)?;
        let host_logits = vec![0f32; logit_rows * c.n_vocab];
        let states = RecurrentStates::new(b, c, options.max_seqs)?;
        Ok(Engine {
            backend,
            weights,
            pool,
            window,
            cache_slots: pools.slots,
            ws,
            step,
            plan: FlatPlan::with_capacity(&capacity),
            capacity,
            options,
            sampled: Vec::with_capacity(capacity.seqs),
            host_logits,
            states,
            reduce: None,
            peers: Vec::new(),
        })
    }

    /// Joins engines over the slices of one model into a tensor-parallel group led by the first:
    /// `ranks[r]` holds rank `r`'s weights and `reducers[r]` is its handle on the group.
    pub(crate) fn group(mut ranks: Vec<Engine<B>>, reducers: Vec<GroupHandle<B>>) -> Result<Engine<B>> {
        if ranks.is_empty() || reducers.len() != ranks.len() {
            return Err(ModelError::Unshardable { ranks: ranks.len(), reason: format!("{} all-reduce handles for {} ranks", reducers.len(), ranks.len()) });
        }
        for (engine, reduce) in ranks.iter_mut().zip(reducers) {
            engine.reduce = Some(reduce);
        }
        let mut first = ranks.remove(0);
        first.peers = ranks;
        Ok(first)
    }

    /// Ranks of the tensor-parallel group this engine leads (1 without one).
    pub fn n_ranks(&self) -> usize {
        1 + self.peers.len()
    }

    pub fn weights(&self) -> &Arc<Weights<B>> {
        &self.weights
    }
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }
    pub fn options(&self) -> &EngineOptions {
        &self.options
    }
    /// The pool of the global layers' caches (of every cache without sliding-window layers).
    pub fn pool(&self) -> &KvPool<B> {
        &self.pool
    }

    /// The sliding-window layers' pool, when the model has one.
    pub fn window_pool(&self) -> Option<&KvPool<B>> {
        self.window.as_ref().map(|w| &w.pool)
    }

    /// The window of the window pool's layers (the widest of them).
    pub fn window(&self) -> Option<usize> {
        self.window.as_ref().map(|w| w.window)
    }

    /// Whether a sequence may start from blocks another one cached: not where layers keep a
    /// recurrent state (Gated DeltaNet), which the blocks do not hold.
    pub fn shares_prefixes(&self) -> bool {
        self.states.is_none()
    }

    /// Trailing window blocks a prefix must bring for the next query to see its whole window
    /// ([`Engine::attach_prefix`]); `None` without a window pool.
    pub fn prefix_window_entries(&self) -> Option<usize> {
        self.window.as_ref().map(WindowKv::prefix_entries)
    }

    /// New window-pool blocks a step feeding `seq`'s next `n_tokens` tokens takes (0 without one).
    pub fn window_blocks_to_feed(&self, seq: &Sequence, n_tokens: usize) -> usize {
        self.window.as_ref().map_or(0, |w| w.blocks_to_feed(seq, n_tokens))
    }

    /// Bytes of KV cache backed by memory now, in both pools.
    pub fn kv_usable_bytes(&self) -> u64 {
        self.pool.usable_bytes() + self.window_pool().map_or(0, KvPool::usable_bytes)
    }

    /// Returns a sequence's blocks to the pools (it keeps its tokens, none cached).
    pub fn release(&mut self, seq: &mut Sequence) {
        self.pool.release(&mut seq.blocks);
        if let Some(w) = &mut self.window {
            w.release_all(seq);
        }
        seq.n_cached = 0;
        if let (Some(states), Some(slot)) = (&mut self.states, seq.state_slot.take()) {
            states.release(slot);
        }
        seq.state_len = 0;
    }

    /// Starts `seq` on full blocks that already hold the keys and values of its first
    /// `blocks.len() * KV_BLOCK_SIZE` tokens (a shared prefix): each block gets one more
    /// reference and those tokens count as cached. At least one token must stay to be fed, so
    /// the block the sequence writes next is its own and shared blocks are never written.
    /// `window_blocks` are the same positions' window-pool blocks ([`kiln_core::RELEASED_BLOCK`]
    /// where released), of which the last [`Engine::prefix_window_entries`] must be held; without a
    /// window pool they are ignored.
    pub fn attach_prefix(&mut self, seq: &mut Sequence, blocks: &[u32], window_blocks: &[u32]) -> Result<()> {
        let n_cached = blocks.len() * KV_BLOCK_SIZE;
        if !self.shares_prefixes() && !blocks.is_empty() {
            return Err(ModelError::BadKvBlock("a hybrid model's recurrent state is not in cached blocks: its sequences share no prefix".into()));
        }
        if self.window.is_some() && window_blocks.len() != blocks.len() {
            return Err(ModelError::BadKvBlock(format!("a prefix of {} blocks comes with {} window blocks", blocks.len(), window_blocks.len())));
        }
        if !seq.blocks.is_empty() || !seq.window_blocks.is_empty() || seq.n_cached != 0 {
            return Err(ModelError::BadKvBlock("a prefix can only be attached to a sequence without blocks".into()));
        }
        if n_cached >= seq.tokens.len() {
            return Err(ModelError::BadKvBlock(format!("a prefix of {n_cached} positions leaves none of the {} tokens to feed", seq.tokens.len())));
        }
        for (i, &b) in blocks.iter().enumerate() {
            if let Err(e) = self.pool.blocks.retain(b) {
                blocks[..i].iter().for_each(|&r| drop(self.pool.blocks.release(r)));
                return Err(e);
            }
        }
        if let Some(w) = &mut self.window {
            if let Err(e) = w.attach(seq, window_blocks) {
                blocks.iter().for_each(|&r| drop(self.pool.blocks.release(r)));
                return Err(e);
            }
        }
        seq.blocks.extend_from_slice(blocks);
        seq.n_cached = n_cached;
        Ok(())
    }

    /// Adds a reference to a block in use, for a holder outside any sequence (a prefix cache).
    pub fn retain_block(&mut self, block: u32) -> Result<()> {
        self.pool.blocks.retain(block)
    }

    /// Drops a reference taken with [`Engine::retain_block`].
    pub fn release_block(&mut self, block: u32) -> Result<()> {
        self.pool.blocks.release(block)
    }

    fn window_allocator(&mut self) -> Result<&mut crate::kv_pool::BlockAllocator> {
        self.window.as_mut().map(|w| &mut w.pool.blocks).ok_or_else(|| ModelError::BadKvBlock("the model has no window pool".into()))
    }

    /// [`Engine::retain_block`] for a block of the window pool.
    pub fn retain_window_block(&mut self, block: u32) -> Result<()> {
        self.window_allocator()?.retain(block)
    }

    /// Drops a reference taken with [`Engine::retain_window_block`].
    pub fn release_window_block(&mut self, block: u32) -> Result<()> {
        self.window_allocator()?.release(block)
    }

    /// Runs one step over `work` and returns the sampled tokens, one per work item that
    /// samples, in order. Blocks are taken from the pool first; when it runs out, nothing
    /// runs and the error says how many were missing, so the caller can wait or fail.
    pub fn step(&mut self, work: &mut [SeqWork]) -> Result<&[u32]> {
        let vocab = self.weights.config.n_vocab;
        let (mut needed, mut needed_window) = (0, 0);
        for w in work.iter() {
            let end = w.seq.n_cached + w.n_tokens;
            if w.n_tokens == 0 || end > w.seq.tokens.len() {
                return Err(ModelError::BadHparam {
                    key: "step".into(),
                    reason: format!("{} tokens asked of a sequence with {} pending", w.n_tokens, w.seq.n_pending()),
                });
            }
            if end > self.options.max_seq_len {
                return Err(ModelError::ContextOverflow { needed: end, n_ctx: self.options.max_seq_len });
            }
            if let Some(&id) = w.seq.tokens[w.seq.n_cached..end].iter().find(|&&t| t as usize >= vocab) {
                return Err(ModelError::BadToken { id, n_vocab: vocab });
            }
            // A recurrent state is only ever continued by the tokens it has absorbed (a cached
            // prefix from elsewhere has no state to go with it) or restarted at position 0.
            if self.states.is_some() && w.seq.n_cached != 0 && w.seq.n_cached != w.seq.state_len {
                return Err(ModelError::BadHparam {
                    key: "step".into(),
                    reason: format!(
                        "a hybrid model's sequence resumes at {} but its recurrent state holds {} tokens; feed it from its first token",
                        w.seq.n_cached, w.seq.state_len
                    ),
                });
            }
            needed += w.seq.blocks_to_feed(w.n_tokens);
            needed_window += self.window_blocks_to_feed(w.seq, w.n_tokens);
        }
        if needed > self.pool.blocks.available() {
            return Err(ModelError::OutOfKvBlocks { needed, available: self.pool.blocks.available(), capacity: self.pool.blocks.capacity() });
        }
        if let Some(window) = &self.window {
            let blocks = &window.pool.blocks;
            if needed_window > blocks.available() {
                return Err(ModelError::OutOfKvBlocks { needed: needed_window, available: blocks.available(), capacity: blocks.capacity() });
            }
        }
        if let Some(states) = &mut self.states {
            for w in work.iter_mut() {
                if w.seq.state_slot.is_none() {
                    w.seq.state_slot = Some(states.take()?);
                }
            }
            states.write_slots(&self.backend, work.iter().map(|w| w.seq.state_slot.unwrap_or(0)))?;
        }
        for w in work.iter_mut() {
            let end = w.seq.n_cached + w.n_tokens;
            self.pool.reserve(&self.backend, &mut w.seq.blocks, end)?;
            if let Some(window) = &mut self.window {
                window.reserve(&self.backend, w.seq, end)?;
            }
        }

        self.plan.clear();
        if let Some(window) = &mut self.window {
            window.plan.clear();
        }
        let cache_blocks = self.pool.spec().n_blocks;
        for w in work.iter() {
            let s = &*w.seq;
            let history = &s.tokens[(s.n_cached + w.n_tokens).saturating_sub(self.options.max_history)..s.n_cached + w.n_tokens];
            let sample = w.sample.then_some(SampleSpec { params: s.sampling, history, draw: s.draws });
            let logits = if w.sample && w.logits == LogitRows::None { LogitRows::Last } else { w.logits };
            let seq_step = SeqStep { tokens: &s.tokens[s.n_cached..s.n_cached + w.n_tokens], pos0: s.n_cached, blocks: &s.blocks, logits, sample };
            self.plan.push(&seq_step, &self.capacity, cache_blocks)?;
            if let Some(window) = &mut self.window {
                window.push(&seq_step, s, &self.capacity)?;
            }
        }
        self.backend.write_step(&mut self.step, &self.plan)?;
        if let Some(window) = &mut self.window {
            self.backend.write_step(&mut window.step, &window.plan)?;
        }

        let n_samples = self.plan.samples.len();
        let graph_key = (self.plan.is_decode_only() && n_samples > 0).then(|| self.plan.shape_key());
        let shape = StepShape { n: self.plan.n_tokens(), n_rows: self.plan.logit_rows.len(), n_samples, max_seq_len: self.options.max_seq_len, graph_key };
        let usable = self.pool.blocks.usable();
        for peer in &mut self.peers {
            peer.pool.back(&*peer.backend, usable)?;
            peer.backend.write_step(&mut peer.step, &self.plan)?;
            if let (Some(mine), Some(theirs)) = (&self.window, &mut peer.window) {
                theirs.pool.back(&*peer.backend, mine.pool.blocks.usable())?;
                peer.backend.write_step(&mut theirs.step, &mine.plan)?;
            }
        }
        if let Err(e) = self.run_ranks(shape) {
            // A failed step may have advanced some layers' recurrent states: feed again from 0.
            if self.states.is_some() {
                for w in work.iter_mut() {
                    (w.seq.n_cached, w.seq.state_len) = (0, 0);
                }
            }
            return Err(e.into());
        }
        self.sampled.resize(n_samples, 0);
        if n_samples > 0 {
            self.backend.sampled_tokens(&self.step, &mut self.sampled)?;
        }
        for w in work.iter_mut() {
            w.seq.n_cached += w.n_tokens;
            w.seq.draws += u64::from(w.sample);
            w.seq.state_len = w.seq.n_cached;
            if let Some(window) = &mut self.window {
                window.release_behind(w.seq);
            }
        }
        Ok(&self.sampled)
    }

    /// The step on this engine's rank and, at once, on every peer's (one thread each); only
    /// this rank samples.
    fn run_ranks(&mut self, shape: StepShape) -> kiln_core::backend::Result<()> {
        if self.peers.is_empty() {
            return self.run_rank(shape, true);
        }
        let mut peers = std::mem::take(&mut self.peers);
        let result = std::thread::scope(|s| {
            let others: Vec<_> = peers.iter_mut().map(|p| s.spawn(move || p.run_rank(shape, false))).collect();
            let mine = self.run_rank(shape, true);
            others.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(BackendError::Device("a tensor-parallel rank panicked".into())))).fold(mine, Result::and)
        });
        self.peers = peers;
        result
    }

    fn run_rank(&mut self, s: StepShape, sample: bool) -> kiln_core::backend::Result<()> {
        let (b, w, pool, ws, step, states, reduce) =
            (&*self.backend, &*self.weights, &mut self.pool, &mut self.ws, &mut self.step, &mut self.states, self.reduce.as_deref());
        let (window, slots) = (&mut self.window, &self.cache_slots);
        let mut run = || -> kiln_core::backend::Result<()> {
            let pass = Pass { b, w, step, n: s.n, n_rows: s.n_rows, max_seq_len: s.max_seq_len, reduce };
            let mut caches = LayerCaches { full: &mut pool.caches, step, window: window.as_mut().map(|w| (&mut w.pool.caches[..], &w.step)), slots };
            forward(&pass, &mut caches, states.as_mut(), ws)?;
            if sample && s.n_samples > 0 {
                b.sample(ws.logits.rows(s.n_rows, w.config.n_vocab)?, step)?;
            }
            Ok(())
        };
        match s.graph_key {
            Some(key) => b.run_step(key, &mut run),
            None => run(),
        }
    }

    /// The logits of the last step, `[rows][n_vocab]` in plan order.
    pub fn logits(&mut self) -> Result<&[f32]> {
        let len = self.plan.logit_rows.len() * self.weights.config.n_vocab;
        self.backend.read(&self.ws.logits, &mut self.host_logits[..len])?;
        Ok(&self.host_logits[..len])
    }
}
