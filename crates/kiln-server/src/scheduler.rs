//! The scheduler: it owns the engine on one dedicated thread and runs continuous batching over
//! it. Handlers submit requests through a channel and receive their tokens through another.
//! Between steps it admits waiting requests (taking shared prefix blocks from the
//! [`PrefixCache`]), and every step decodes one token of each running sequence and spends the
//! rest of the token budget on prompt chunks. When blocks of either pool (the full one, and
//! the sliding-window layers' one) run out it evicts cached blocks, then preempts the newest
//! running sequence, which waits at the front of the queue and is recomputed later.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

use kiln_core::plan::LogitRows;
use kiln_core::{Backend, SamplingParams, KV_BLOCK_SIZE, RELEASED_BLOCK};
use kiln_models::window_kv::window_blocks_per_seq;
use kiln_models::{Engine, SeqWork, Sequence};
use tokio::sync::{mpsc, oneshot};

use crate::metrics::Metrics;
use crate::prefix_cache::{PrefixCache, ROOT_HASH};

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Most sequences in one step (`-np`).
    pub max_running: usize,
    /// Most requests waiting for a slot or KV blocks; past it requests are refused.
    pub max_waiting: usize,
    /// Most tokens one step feeds (decodes first, then prompt chunks).
    pub step_tokens: usize,
}

/// What a handler asks the scheduler to generate.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// Tokens to generate at most (end-of-generation tokens stop earlier unless `ignore_eos`).
    pub max_tokens: usize,
    pub ignore_eos: bool,
    /// `Some(n)`: report each token's log-probability and the `n` most likely alternatives.
    pub top_logprobs: Option<usize>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
}

/// What a request's stream carries, in order: `Started`, tokens, then one `Finished` or
/// `Failed` (a request failed before it started sees only that).
#[derive(Debug, PartialEq)]
pub enum Event {
    /// The sequence got its first batch slot; `cached_tokens` of its prompt came from the cache.
    Started {
        cached_tokens: usize,
    },
    Token {
        id: u32,
        logprobs: Option<TokenLogprobs>,
    },
    Finished {
        reason: FinishReason,
        usage: Usage,
    },
    Failed(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rejection {
    QueueFull {
        waiting: usize,
    },
    /// The prompt needs more KV blocks than the whole pool has.
    TooLarge {
        blocks: usize,
        capacity: usize,
    },
    ShuttingDown,
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rejection::QueueFull { waiting } => write!(f, "the server is busy: {waiting} requests are already waiting for KV cache memory; retry later"),
            Rejection::TooLarge { blocks, capacity } => {
                write!(f, "the prompt needs {blocks} KV blocks and the whole pool has {capacity} (raise --kv-mem)")
            }
            Rejection::ShuttingDown => write!(f, "the server is shutting down"),
        }
    }
}

pub struct Submission {
    request: GenerationRequest,
    events: mpsc::UnboundedSender<Event>,
    reply: oneshot::Sender<Result<(), Rejection>>,
    arrived: Instant,
}

pub enum Command {
    Submit(Box<Submission>),
    Shutdown,
}

/// The handlers' side of the scheduler.
#[derive(Clone)]
pub struct SchedulerHandle {
    commands: Sender<Command>,
}

impl SchedulerHandle {
    pub fn new(commands: Sender<Command>) -> SchedulerHandle {
        SchedulerHandle { commands }
    }

    /// Queues a request; its events arrive on the returned receiver. Dropping the receiver
    /// cancels the request and frees its blocks.
    pub async fn submit(&self, request: GenerationRequest) -> Result<mpsc::UnboundedReceiver<Event>, Rejection> {
        let (events, receiver) = mpsc::unbounded_channel();
        let (reply, accepted) = oneshot::channel();
        let submission = Submission { request, events, reply, arrived: Instant::now() };
        self.commands.send(Command::Submit(Box::new(submission))).map_err(|_| Rejection::ShuttingDown)?;
        accepted.await.map_err(|_| Rejection::ShuttingDown)??;
        Ok(receiver)
    }

    /// Ends every request with an error and stops the scheduler thread.
    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
    }
}

/// One request's sequence, waiting or running.
struct Active {
    seq: Sequence,
    n_prompt: usize,
    max_tokens: usize,
    ignore_eos: bool,
    top_logprobs: Option<usize>,
    events: mpsc::UnboundedSender<Event>,
    arrived: Instant,
    last_token: Option<Instant>,
    /// Prompt tokens found in the prefix cache at first admission.
    cached_tokens: Option<usize>,
    /// Admission order: the largest is the newest, preempted first.
    order: u64,
    /// Full blocks of this sequence indexed in the prefix cache, and the last one's chain hash.
    registered: usize,
    chain: u64,
    /// This step's work: tokens to feed and whether to sample.
    planned: Option<(usize, bool)>,
    done: bool,
}

impl Active {
    fn generated(&self) -> usize {
        self.seq.tokens.len() - self.n_prompt
    }

    fn usage(&self) -> Usage {
        Usage { prompt_tokens: self.n_prompt, completion_tokens: self.generated(), cached_tokens: self.cached_tokens.unwrap_or(0) }
    }

    fn finish(&mut self, event: Event) {
        let _ = self.events.send(event);
        self.done = true;
    }
}

pub struct Scheduler<B: Backend> {
    engine: Engine<B>,
    cache: PrefixCache,
    config: SchedulerConfig,
    /// End-of-generation token ids, sorted.
    eog: Vec<u32>,
    metrics: Arc<Metrics>,
    commands: Receiver<Command>,
    waiting: VecDeque<Active>,
    running: Vec<Active>,
    next_order: u64,
}

impl<B: Backend> Scheduler<B> {
    pub fn new(engine: Engine<B>, config: SchedulerConfig, eog: &[u32], metrics: Arc<Metrics>, commands: Receiver<Command>) -> Scheduler<B> {
        let max_running = config.max_running.clamp(1, engine.options().max_seqs);
        let step_tokens = config.step_tokens.clamp(max_running, engine.options().max_batch_tokens);
        let config = SchedulerConfig { max_running, step_tokens, ..config };
        let mut eog = eog.to_vec();
        eog.sort_unstable();
        metrics.kv_blocks_total.store(engine.pool().allocator().capacity() as u64, Relaxed);
        metrics.kv_window_blocks_total.store(engine.window_pool().map_or(0, |p| p.allocator().capacity()) as u64, Relaxed);
        let cache = PrefixCache::new(engine.prefix_window_entries());
        Scheduler { engine, cache, config, eog, metrics, commands, waiting: VecDeque::new(), running: Vec::new(), next_order: 0 }
    }

    /// Serves requests until a shutdown command or until every handle is gone.
    pub fn run(mut self) {
        while self.receive() {
            self.drop_cancelled();
            self.admit();
            if self.running.is_empty() {
                // Nothing runs, so every block is free or evictable: a head that still does
                // not fit never will.
                if let Some(mut head) = self.waiting.pop_front() {
                    head.finish(Event::Failed("the sequence does not fit in the KV cache (raise --kv-mem)".into()));
                }
            } else {
                self.step();
            }
            self.publish_metrics();
        }
        for mut a in self.running.drain(..).chain(self.waiting.drain(..)) {
            a.finish(Event::Failed(Rejection::ShuttingDown.to_string()));
            self.engine.release(&mut a.seq);
        }
        self.publish_metrics();
    }

    /// Takes the commands that arrived; blocks while there is no work. False: stop.
    fn receive(&mut self) -> bool {
        if self.running.is_empty() && self.waiting.is_empty() {
            match self.commands.recv() {
                Ok(c) => {
                    if !self.handle(c) {
                        return false;
                    }
                }
                Err(_) => return false,
            }
        }
        loop {
            match self.commands.try_recv() {
                Ok(c) => {
                    if !self.handle(c) {
                        return false;
                    }
                }
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return false,
            }
        }
    }

    fn handle(&mut self, command: Command) -> bool {
        let s = match command {
            Command::Shutdown => return false,
            Command::Submit(s) => *s,
        };
        let capacity = self.engine.pool().allocator().capacity();
        let blocks = (s.request.prompt.len() + 1).div_ceil(KV_BLOCK_SIZE);
        let verdict = if blocks > capacity {
            Err(Rejection::TooLarge { blocks, capacity })
        } else if self.waiting.len() >= self.config.max_waiting {
            self.metrics.rejected_total.fetch_add(1, Relaxed);
            Err(Rejection::QueueFull { waiting: self.waiting.len() })
        } else {
            Ok(())
        };
        if s.reply.send(verdict.clone()).is_err() || verdict.is_err() {
            return true;
        }
        let r = s.request;
        self.metrics.requests_total.fetch_add(1, Relaxed);
        self.metrics.prompt_tokens_total.fetch_add(r.prompt.len() as u64, Relaxed);
        let n_prompt = r.prompt.len();
        let mut seq = Sequence::with_capacity(n_prompt + r.max_tokens + 1, r.sampling);
        seq.tokens.extend_from_slice(&r.prompt);
        self.waiting.push_back(Active {
            seq,
            n_prompt,
            max_tokens: r.max_tokens,
            ignore_eos: r.ignore_eos,
            top_logprobs: r.top_logprobs,
            events: s.events,
            arrived: s.arrived,
            last_token: None,
            cached_tokens: None,
            order: 0,
            registered: 0,
            chain: ROOT_HASH,
            planned: None,
            done: false,
        });
        true
    }

    /// Requests whose client went away leave at once.
    fn drop_cancelled(&mut self) {
        for a in self.running.iter_mut().filter(|a| a.events.is_closed()) {
            a.done = true;
        }
        self.retire_done();
        self.waiting.retain(|a| !a.events.is_closed());
    }

    /// Blocks that can be had now: free ones and ones only the cache holds.
    fn obtainable(&self) -> usize {
        self.engine.pool().allocator().available() + self.cache.evictable(&self.engine)
    }

    /// [`Scheduler::obtainable`] in the window pool (0 without one).
    fn obtainable_window(&self) -> usize {
        self.engine.window_pool().map_or(0, |p| p.allocator().available()) + self.cache.evictable_window(&self.engine)
    }

    /// Whether the window pool has room for one more sequence beside the running ones (one
    /// block each to grow); always without a window pool.
    fn window_room_for_one_more(&self) -> bool {
        self.engine.window().is_none_or(|w| window_blocks_per_seq(w) + self.running.len() <= self.obtainable_window())
    }

    /// Starts waiting requests, in order, while there are slots and blocks for their prompts
    /// (leaving a block for each running sequence to grow).
    fn admit(&mut self) {
        while self.running.len() < self.config.max_running {
            let Some(front) = self.waiting.front() else { break };
            let tokens = &front.seq.tokens;
            // The last token is always fed, so there are logits to sample from.
            let shareable = if self.engine.shares_prefixes() { (tokens.len() - 1) / KV_BLOCK_SIZE } else { 0 };
            let found = self.cache.lookup(tokens, shareable);
            let refs = self.engine.pool().allocator();
            let shared_now_evictable = found.blocks.iter().filter(|&&b| refs.refs(b) == 1).count();
            let need = tokens.len().div_ceil(KV_BLOCK_SIZE) - found.blocks.len() + self.running.len();
            if need > self.obtainable() - shared_now_evictable || !self.window_room_for_one_more() {
                break;
            }
            let mut a = self.waiting.pop_front().expect("front checked");
            if let Err(e) = self.engine.attach_prefix(&mut a.seq, &found.blocks, &found.window_blocks) {
                a.finish(Event::Failed(format!("prefix cache: {e}")));
                continue;
            }
            a.registered = found.blocks.len();
            a.chain = found.last_hash;
            if a.cached_tokens.is_none() {
                let cached = found.blocks.len() * KV_BLOCK_SIZE;
                a.cached_tokens = Some(cached);
                let _ = a.events.send(Event::Started { cached_tokens: cached });
                self.metrics.prefix_cache_hit_tokens_total.fetch_add(cached as u64, Relaxed);
            }
            a.order = self.next_order;
            self.next_order += 1;
            self.running.push(a);
        }
    }

    /// Decodes first, one token each, then prompt chunks in admission order within the budget.
    /// Returns the blocks the step takes from the full pool and from the window pool.
    fn plan(&mut self) -> (usize, usize) {
        let mut budget = self.config.step_tokens;
        for a in self.running.iter_mut() {
            a.planned = None;
            if a.seq.n_pending() == 1 {
                a.planned = Some((1, true));
                budget -= 1;
            }
        }
        for a in self.running.iter_mut().filter(|a| a.planned.is_none()) {
            let pending = a.seq.n_pending();
            if budget > 0 {
                let n = pending.min(budget);
                budget -= n;
                a.planned = Some((n, n == pending));
            }
        }
        let planned = || self.running.iter().filter_map(|a| a.planned.map(|(n, _)| (a, n)));
        (planned().map(|(a, n)| a.seq.blocks_to_feed(n)).sum(), planned().map(|(a, n)| self.engine.window_blocks_to_feed(&a.seq, n)).sum())
    }

    /// Plans a step that the pool has blocks for, evicting cached blocks and then preempting
    /// the newest sequences as needed. False when nothing can run.
    fn plan_within_blocks(&mut self) -> bool {
        loop {
            let (needed, needed_window) = self.plan();
            let available = self.engine.pool().allocator().available();
            let full_fits = needed <= available || self.cache.evict(&mut self.engine, needed - available) >= needed - available;
            let available_window = self.engine.window_pool().map_or(0, |p| p.allocator().available());
            let window_fits = needed_window <= available_window
                || self.cache.evict_window(&mut self.engine, needed_window - available_window) >= needed_window - available_window;
            if full_fits && window_fits {
                return true;
            }
            let newest = (0..self.running.len()).max_by_key(|&i| self.running[i].order).expect("running is not empty");
            let mut a = self.running.remove(newest);
            self.release(&mut a);
            if self.running.is_empty() {
                // Alone and still out of blocks: the pool cannot hold this sequence any longer.
                let usage = a.usage();
                a.finish(Event::Finished { reason: FinishReason::Length, usage });
                return false;
            }
            a.registered = 0;
            a.chain = ROOT_HASH;
            self.metrics.preemptions_total.fetch_add(1, Relaxed);
            self.waiting.push_front(a);
        }
    }

    fn step(&mut self) {
        if !self.plan_within_blocks() {
            return;
        }
        let mut work: Vec<SeqWork> = self
            .running
            .iter_mut()
            .filter_map(|a| a.planned.map(|(n, sample)| (a, n, sample)))
            .map(|(a, n_tokens, sample)| SeqWork { seq: &mut a.seq, n_tokens, logits: if sample { LogitRows::Last } else { LogitRows::None }, sample })
            .collect();
        let sampled = match self.engine.step(&mut work) {
            Ok(tokens) => tokens.to_vec(),
            Err(e) => {
                drop(work);
                tracing::error!("engine step failed: {e}");
                for a in self.running.iter_mut().filter(|a| a.planned.is_some()) {
                    a.finish(Event::Failed(format!("the engine failed: {e}")));
                }
                self.retire_done();
                return;
            }
        };
        drop(work);
        let logprobs = self.logprobs_of_step(&sampled);
        let now = Instant::now();
        let max_len = self.engine.options().max_seq_len;
        let mut sampled = sampled.into_iter().zip(logprobs);
        for a in self.running.iter_mut() {
            let Some((_, sample)) = a.planned else { continue };
            while self.engine.shares_prefixes() && (a.registered + 1) * KV_BLOCK_SIZE <= a.seq.n_cached() {
                let r = a.registered;
                let window_block = a.seq.window_blocks().get(r).copied().filter(|&b| b != RELEASED_BLOCK);
                let tokens = &a.seq.tokens[r * KV_BLOCK_SIZE..(r + 1) * KV_BLOCK_SIZE];
                match self.cache.insert(&mut self.engine, a.chain, tokens, a.seq.blocks()[r], window_block) {
                    Ok(h) => a.chain = h,
                    Err(e) => tracing::error!("prefix cache: {e}"),
                }
                a.registered += 1;
            }
            if !sample {
                continue;
            }
            let (token, logprobs) = sampled.next().expect("one token per sampling sequence");
            a.seq.tokens.push(token);
            self.metrics.generated_tokens_total.fetch_add(1, Relaxed);
            match a.last_token {
                None => self.metrics.time_to_first_token.observe(now - a.arrived),
                Some(t) => self.metrics.inter_token_latency.observe(now - t),
            }
            a.last_token = Some(now);
            if !a.ignore_eos && self.eog.binary_search(&token).is_ok() {
                let usage = a.usage();
                a.finish(Event::Finished { reason: FinishReason::Stop, usage });
                continue;
            }
            if a.events.send(Event::Token { id: token, logprobs }).is_err() {
                a.done = true;
            } else if a.generated() >= a.max_tokens || a.seq.tokens.len() > max_len {
                let usage = a.usage();
                a.finish(Event::Finished { reason: FinishReason::Length, usage });
            }
        }
        self.retire_done();
    }

    /// Log-probabilities of the tokens just sampled, for the sequences that asked (the logit
    /// rows of a step are its sampling sequences, in order).
    fn logprobs_of_step(&mut self, sampled: &[u32]) -> Vec<Option<TokenLogprobs>> {
        let asks: Vec<Option<usize>> = self.running.iter().filter(|a| matches!(a.planned, Some((_, true)))).map(|a| a.top_logprobs).collect();
        if asks.iter().all(Option::is_none) {
            return vec![None; asks.len()];
        }
        let n_vocab = self.engine.weights().config.n_vocab;
        let logits = match self.engine.logits() {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("reading logits for logprobs: {e}");
                return vec![None; asks.len()];
            }
        };
        asks.iter()
            .zip(sampled)
            .enumerate()
            .map(|(row, (ask, &token))| ask.map(|n| token_logprobs(&logits[row * n_vocab..(row + 1) * n_vocab], token, n)))
            .collect()
    }

    fn release(&mut self, a: &mut Active) {
        self.engine.release(&mut a.seq);
        self.cache.touch_chain(a.chain, a.registered);
    }

    fn retire_done(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].done {
                // In place, so prompt chunks keep going in admission order.
                let mut a = self.running.remove(i);
                self.release(&mut a);
            } else {
                i += 1;
            }
        }
    }

    fn publish_metrics(&self) {
        let m = &self.metrics;
        let cached_only = self.cache.evictable(&self.engine);
        m.requests_running.store(self.running.len() as u64, Relaxed);
        m.requests_waiting.store(self.waiting.len() as u64, Relaxed);
        m.kv_blocks_used.store((self.engine.pool().allocator().in_use() - cached_only) as u64, Relaxed);
        m.kv_blocks_cached.store(cached_only as u64, Relaxed);
        if let Some(window) = self.engine.window_pool() {
            let cached_only = self.cache.evictable_window(&self.engine);
            m.kv_window_blocks_used.store((window.allocator().in_use() - cached_only) as u64, Relaxed);
            m.kv_window_blocks_cached.store(cached_only as u64, Relaxed);
        }
    }
}

/// The log-softmax of `logits` at `token`, and the `n` most likely tokens with theirs.
pub fn token_logprobs(logits: &[f32], token: u32, n: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_total = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let n = n.min(ids.len());
    let by_logit_desc = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    if n > 0 && n < ids.len() {
        ids.select_nth_unstable_by(n - 1, by_logit_desc);
    }
    ids.truncate(n);
    ids.sort_unstable_by(by_logit_desc);
    let logprob = logits.get(token as usize).map_or(f32::NEG_INFINITY, |&l| l - log_total);
    TokenLogprobs { logprob, top: ids.into_iter().map(|id| (id, logits[id as usize] - log_total)).collect() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_a_log_softmax() {
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let lp = token_logprobs(&logits, 1, 2);
        assert!((lp.logprob - 0.3f32.ln()).abs() < 1e-6);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![0, 1]);
        assert!((lp.top[0].1 - 0.5f32.ln()).abs() < 1e-6);
        assert!(token_logprobs(&logits, 0, 0).top.is_empty());
        assert_eq!(token_logprobs(&logits, 2, 20).top.len(), 3);
    }
}
