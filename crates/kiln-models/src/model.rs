//! One sequence over the batched engine: the single-stream API that `kiln run`, `kiln bench`
//! and the reference tests use.

use std::sync::Arc;

use kiln_core::plan::LogitRows;
use kiln_core::{Backend, KvType, SamplingParams};
use kiln_gguf::GgufFile;
use kiln_quant::GgmlType;

use crate::config::ModelConfig;
use crate::engine::{Engine, EngineOptions, SeqWork, Sequence};
use crate::error::{ModelError, Result};
use crate::kv_pool::KvBudget;
use crate::weights::Weights;

/// Which logits a forward pass produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only for the last token of the batch (generation).
    Last,
    /// For every token (teacher-forced evaluation); needs `ModelOptions::all_logits`.
    All,
}

#[derive(Clone, Debug)]
pub struct ModelOptions {
    /// Context length (KV cache capacity); `None` uses the training context.
    pub n_ctx: Option<usize>,
    /// Most tokens per forward pass; longer prompts are split.
    pub n_batch: usize,
    /// Allocate logits for every token of a batch.
    pub all_logits: bool,
    /// Tokens the repetition penalty can look back on.
    pub max_history: usize,
    pub k_type: KvType,
    pub v_type: KvType,
    /// Most KV memory; `None`: the whole context of the one sequence (taken as it grows).
    pub kv_budget: Option<KvBudget>,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions { n_ctx: None, n_batch: 512, all_logits: false, max_history: 256, k_type: KvType::F16, v_type: KvType::F16, kv_budget: None }
    }
}

impl ModelOptions {
    /// The engine options of one sequence with these settings, for a model trained on `n_ctx_train`.
    pub fn engine_options(&self, n_ctx_train: usize) -> EngineOptions {
        let n_ctx = self.n_ctx.unwrap_or(n_ctx_train).max(1);
        EngineOptions {
            max_seq_len: n_ctx,
            max_batch_tokens: self.n_batch.clamp(1, n_ctx),
            max_seqs: 1,
            all_logits: self.all_logits,
            max_history: self.max_history,
            k_type: self.k_type,
            v_type: self.v_type,
            kv_budget: self.kv_budget,
        }
    }
}

pub struct Model<B: Backend> {
    pub config: ModelConfig,
    engine: Engine<B>,
    seq: Sequence,
}

impl<B: Backend> Model<B> {
    pub fn load(backend: Arc<B>, file: Arc<GgufFile>, options: &ModelOptions) -> Result<Model<B>> {
        let weights = Arc::new(Weights::load(&*backend, &file)?);
        let engine_options = options.engine_options(weights.config.n_ctx_train);
        Self::with_weights(backend, weights, &engine_options)
    }

    /// A model over weights already loaded (shared with other engines).
    pub fn with_weights(backend: Arc<B>, weights: Arc<Weights<B>>, options: &EngineOptions) -> Result<Model<B>> {
        Ok(Self::with_engine(Engine::new(backend, weights, options)?))
    }

    /// One sequence over `engine` (a tensor-parallel one, say); `config` is its first rank's.
    pub fn with_engine(engine: Engine<B>) -> Model<B> {
        let config = engine.weights().config.clone();
        let seq = Sequence::with_capacity(engine.options().max_seq_len, SamplingParams::greedy());
        Model { config, engine, seq }
    }

    pub fn backend(&self) -> &Arc<B> {
        self.engine.backend()
    }
    pub fn engine(&self) -> &Engine<B> {
        &self.engine
    }
    pub fn n_ctx(&self) -> usize {
        self.engine.options().max_seq_len
    }
    pub fn n_batch(&self) -> usize {
        self.engine.options().max_batch_tokens
    }
    /// Positions already in the KV cache.
    pub fn n_past(&self) -> usize {
        self.seq.n_cached()
    }
    /// The tokens in the KV cache, in order.
    pub fn cached_tokens(&self) -> &[u32] {
        &self.seq.tokens[..self.seq.n_cached()]
    }
    /// Keeps only the first `n` cached tokens, so that what follows is fed anew (a
    /// conversation whose new prompt shares only a prefix with the cache). The blocks stay.
    pub fn truncate(&mut self, n: usize) {
        self.seq.truncate(n);
    }
    /// Forgets the cached sequence and returns its KV blocks to the pool.
    pub fn reset(&mut self) {
        self.engine.release(&mut self.seq);
        self.seq.tokens.clear();
        self.seq.draws = 0;
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= self.config.n_vocab) {
            return Err(ModelError::BadToken { id, n_vocab: self.config.n_vocab });
        }
        let needed = self.n_past() + tokens.len();
        if needed > self.n_ctx() {
            return Err(ModelError::ContextOverflow { needed, n_ctx: self.n_ctx() });
        }
        Ok(())
    }

    /// Feeds `tokens` after the cached ones in steps of at most `n_batch`; the last step
    /// produces `logits` rows and, with `sampling`, samples the next token.
    fn feed(&mut self, tokens: &[u32], logits: LogitRows, sampling: Option<&SamplingParams>) -> Result<Option<u32>> {
        self.check_tokens(tokens)?;
        if tokens.is_empty() {
            return Err(ModelError::BadHparam { key: "prompt".into(), reason: "no tokens to feed".into() });
        }
        let keep = self.seq.tokens.len();
        self.seq.tokens.extend_from_slice(tokens);
        if let Some(s) = sampling {
            self.seq.sampling = *s;
        }
        let n_batch = self.n_batch();
        let mut sampled = None;
        while self.seq.n_pending() > 0 {
            let n = self.seq.n_pending().min(n_batch);
            let last = n == self.seq.n_pending();
            let mut work =
                [SeqWork { seq: &mut self.seq, n_tokens: n, logits: if last { logits } else { LogitRows::None }, sample: last && sampling.is_some() }];
            match self.engine.step(&mut work) {
                Ok(tokens) => sampled = tokens.first().copied(),
                Err(e) => {
                    let cached = self.seq.n_cached();
                    self.seq.truncate(cached.max(keep));
                    return Err(e);
                }
            }
        }
        Ok(sampled)
    }

    /// Feeds `tokens` after the cached ones and returns the requested logits (`[n][n_vocab]` or `[n_vocab]`).
    pub fn forward(&mut self, tokens: &[u32], which: Logits) -> Result<&[f32]> {
        if which == Logits::All && (!self.engine.options().all_logits || tokens.len() > self.n_batch()) {
            return Err(ModelError::BadHparam {
                key: "all_logits".into(),
                reason: format!("all logits of {} tokens need ModelOptions::all_logits and n_batch >= that", tokens.len()),
            });
        }
        let rows = if which == Logits::All { LogitRows::All } else { LogitRows::Last };
        self.feed(tokens, rows, None)?;
        self.engine.logits()
    }

    /// The logits of the last step (as [`Model::forward`] returned them).
    pub fn logits(&mut self) -> Result<&[f32]> {
        self.engine.logits()
    }

    /// Feeds a prompt and samples the token that follows it.
    pub fn prompt(&mut self, tokens: &[u32], sampling: &SamplingParams) -> Result<u32> {
        Ok(self.feed(tokens, LogitRows::Last, Some(sampling))?.expect("a sampling step returns its token"))
    }

    /// One decode step: feeds `token` at the next position and samples the following token on
    /// the backend. On a GPU the whole step is one graph replay, and only the token id comes back.
    pub fn decode_sample(&mut self, token: u32, sampling: &SamplingParams) -> Result<u32> {
        self.prompt(&[token], sampling)
    }
}

/// Type of the model's main weights, as `general.file_type` would describe it.
pub fn dominant_weight_type(file: &GgufFile) -> Option<GgmlType> {
    let mut bytes: Vec<(GgmlType, u64)> = Vec::new();
    for t in file.tensors().iter().filter(|t| t.dims.len() >= 2) {
        match bytes.iter_mut().find(|(ty, _)| *ty == t.ty) {
            Some((_, b)) => *b += t.n_bytes,
            None => bytes.push((t.ty, t.n_bytes)),
        }
    }
    bytes.into_iter().max_by_key(|(_, b)| *b).map(|(t, _)| t)
}
