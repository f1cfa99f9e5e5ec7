//! Tensor parallelism in the Megatron style: each of N ranks holds 1/N of every layer and
//! computes its slice of the step; two all-reduces per layer join the slices.
//!
//! - Attention: q, k and v are split by heads (column-parallel: each rank keeps whole rows of
//!   its heads), so each rank attends over its own heads and holds only their KV cache; the
//!   output projection is split by its input columns (row-parallel), so each rank's product is
//!   a partial sum of the full-width output, summed by an all-reduce before the residual add.
//!   With fewer KV heads than ranks each KV head is replicated on the ranks whose query heads
//!   read it (as vLLM does).
//! - FFN: gate and up split by rows, down by its input columns, then an all-reduce.
//! - Embeddings, norms and the LM head are replicated: every rank then holds the same residual
//!   stream and the same logits, samples the same token with the same seed, and no all-gather
//!   is needed; a vocabulary-split head would save its memory (0.4 GB of the 8B's Q6_K head per
//!   rank) at the cost of a gather and a distributed sampler every token.
//!
//! Splits fall on block boundaries of each weight's format: the row-parallel weights' row
//! slices must be whole blocks, which [`check`] verifies before anything is loaded.

use std::ops::Range;
use std::sync::Arc;

use kiln_core::{Backend, GroupHandle, SamplingParams};
use kiln_gguf::GgufFile;

use crate::config::{Arch, BlockStyle, FfnConfig, KvSource, Mixer, ModelConfig};
use crate::engine::EngineOptions;
use crate::error::{ModelError, Result};
use crate::generate::Decoder;
use crate::model::{Logits, Model, ModelOptions};
use crate::weights::Weights;

/// The slice of the model one rank holds: `rank` of `ranks`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub ranks: usize,
}

impl Shard {
    /// The whole model on one rank.
    pub const WHOLE: Shard = Shard { rank: 0, ranks: 1 };

    pub fn is_whole(&self) -> bool {
        self.ranks == 1
    }

    /// This rank's equal part of `n` items.
    pub fn part(&self, n: usize) -> Range<usize> {
        n * self.rank / self.ranks..n * (self.rank + 1) / self.ranks
    }

    /// This rank's KV heads of `n_kv`: its part, or with fewer heads than ranks the one head
    /// its query heads read.
    pub fn kv_heads(&self, n_kv: usize) -> Range<usize> {
        if n_kv >= self.ranks {
            self.part(n_kv)
        } else {
            let head = n_kv * self.rank / self.ranks;
            head..head + 1
        }
    }
}

fn scaled(r: Range<usize>, by: usize) -> Range<usize> {
    r.start * by..r.end * by
}

/// Rows of the query projection a rank keeps (its heads' `head_dim` rows each).
pub(crate) fn q_rows(s: Shard, n_head: usize, head_dim: usize) -> Range<usize> {
    scaled(s.part(n_head), head_dim)
}

/// Rows of the key and value projections a rank keeps.
pub(crate) fn kv_rows(s: Shard, n_head_kv: usize, head_dim: usize) -> Range<usize> {
    scaled(s.kv_heads(n_head_kv), head_dim)
}

fn unshardable(ranks: usize, reason: String) -> ModelError {
    ModelError::Unshardable { ranks, reason }
}

/// Whether `config` (read from `file`) can be split `ranks` ways: a dense pre-norm model whose
/// heads, KV heads and FFN width divide evenly, with every row-parallel slice whole blocks.
pub fn check(config: &ModelConfig, file: &GgufFile, ranks: usize) -> Result<()> {
    if ranks == 0 {
        return Err(unshardable(ranks, "the group needs at least one rank".into()));
    }
    let supported = matches!(config.arch, Arch::Llama | Arch::Qwen2 | Arch::Qwen3) && config.arch.block_style() == BlockStyle::PreNorm;
    if !supported {
        return Err(unshardable(ranks, format!("tensor parallelism supports dense llama, qwen2 and qwen3 models; this one is {}", config.arch.name())));
    }
    for (l, lc) in config.layers.iter().enumerate() {
        let (Mixer::Attention(a), FfnConfig::Dense { n_ff }) = (&lc.mixer, &lc.ffn) else {
            return Err(unshardable(ranks, format!("layer {l} is not dense attention + dense FFN")));
        };
        if a.gated || a.kv != (KvSource::Own { v_from_k: false }) || file.tensor(&format!("blk.{l}.attn_output.bias")).is_some() {
            return Err(unshardable(ranks, format!("layer {l}'s attention has parts the sharded forward does not split")));
        }
        if !a.n_head.is_multiple_of(ranks) {
            return Err(unshardable(ranks, format!("layer {l} has {} query heads", a.n_head)));
        }
        if !(a.n_head_kv.is_multiple_of(ranks) || ranks.is_multiple_of(a.n_head_kv)) {
            return Err(unshardable(ranks, format!("layer {l}'s {} KV heads neither split {ranks} ways nor replicate evenly", a.n_head_kv)));
        }
        if !n_ff.is_multiple_of(ranks) {
            return Err(unshardable(ranks, format!("layer {l}'s FFN width {n_ff} does not split {ranks} ways")));
        }
        for (name, cols) in [("attn_output", a.n_head * a.head_dim), ("ffn_down", *n_ff)] {
            let name = format!("blk.{l}.{name}.weight");
            let t = file.tensor(&name).ok_or_else(|| ModelError::MissingTensor(name.clone()))?;
            let block = t.ty.block_size();
            if !(cols / ranks).is_multiple_of(block) {
                return Err(unshardable(
                    ranks,
                    format!("{name} ({}) would be split into rows of {} values, not whole {block}-value blocks", t.ty, cols / ranks),
                ));
            }
        }
    }
    Ok(())
}

/// The configuration a rank runs: its heads, KV heads and FFN width.
pub fn shard_config(config: &ModelConfig, s: Shard) -> ModelConfig {
    let mut c = config.clone();
    for lc in &mut c.layers {
        if let Mixer::Attention(a) = &mut lc.mixer {
            a.n_head = s.part(a.n_head).len();
            a.n_head_kv = s.kv_heads(a.n_head_kv).len();
        }
        if let FfnConfig::Dense { n_ff } = &mut lc.ffn {
            *n_ff = s.part(*n_ff).len();
        }
    }
    c.n_head = s.part(c.n_head).len();
    c.n_head_kv = s.kv_heads(c.n_head_kv).len();
    c.n_ff = s.part(c.n_ff).len();
    c
}

/// A model split over several ranks, each a [`Model`] on its own backend with its slice of the
/// weights and KV cache, run in lockstep (one thread per rank). Every rank computes the same
/// logits and samples the same token; rank 0's are returned.
pub struct TensorParallel<B: Backend> {
    ranks: Vec<Model<B>>,
}

impl<B: Backend> TensorParallel<B> {
    /// Loads rank `r`'s slice onto `backends[r]`, joined by `reducers[r]` (one group, ranks in order).
    pub fn load(backends: Vec<Arc<B>>, reducers: Vec<GroupHandle<B>>, file: &Arc<GgufFile>, options: &ModelOptions) -> Result<Self> {
        let ranks = backends.len();
        if reducers.len() != ranks || reducers.iter().enumerate().any(|(r, g)| g.rank() != r || g.ranks() != ranks) {
            return Err(unshardable(ranks, "one all-reduce handle per rank, in rank order, is needed".into()));
        }
        let config = ModelConfig::from_gguf(file)?;
        check(&config, file, ranks)?;
        let engine_options: EngineOptions = options.engine_options(config.n_ctx_train);
        let models = backends
            .into_iter()
            .zip(reducers)
            .enumerate()
            .map(|(rank, (backend, reduce))| {
                let weights = Arc::new(Weights::load_shard(&*backend, file, Shard { rank, ranks })?);
                Ok(Model::with_weights(backend, weights, &engine_options)?.with_all_reduce(reduce))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(TensorParallel { ranks: models })
    }

    pub fn n_ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Rank `r`'s model (its sliced configuration and engine).
    pub fn rank(&self, r: usize) -> &Model<B> {
        &self.ranks[r]
    }

    /// Runs `f` on every rank at once and returns rank 0's result; ranks must agree.
    fn on_all<T: Send + PartialEq + std::fmt::Debug>(&mut self, f: impl Fn(&mut Model<B>) -> Result<T> + Sync) -> Result<T> {
        let f = &f;
        let mut results: Vec<Result<T>> = std::thread::scope(|s| {
            let (first, rest) = self.ranks.split_first_mut().expect("at least one rank");
            let others: Vec<_> = rest.iter_mut().map(|m| s.spawn(move || f(m))).collect();
            let mut results = vec![f(first)];
            results.extend(others.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(unshardable(0, "a rank's thread panicked".into())))));
            results
        });
        let first = results.remove(0)?;
        for (r, other) in results.into_iter().enumerate() {
            let other = other?;
            if other != first {
                return Err(unshardable(self.ranks.len(), format!("rank {} disagrees with rank 0: {other:?} against {first:?}", r + 1)));
            }
        }
        Ok(first)
    }

    /// Feeds `tokens` after the cached ones on every rank and returns the logits (rank 0's).
    pub fn forward(&mut self, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        let mut logits = Vec::new();
        self.on_all(|m| m.forward(tokens, which).map(|_| ()))?;
        logits.extend_from_slice(self.ranks[0].logits()?);
        Ok(logits)
    }

    /// Feeds a prompt and samples the token that follows it (every rank samples the same one).
    pub fn prompt(&mut self, tokens: &[u32], sampling: &SamplingParams) -> Result<u32> {
        self.on_all(|m| m.prompt(tokens, sampling))
    }

    /// Forgets every rank's cached sequence.
    pub fn reset(&mut self) {
        self.ranks.iter_mut().for_each(Model::reset);
    }
}

impl<B: Backend> Decoder for TensorParallel<B> {
    fn n_past(&self) -> usize {
        self.ranks[0].n_past()
    }
    fn n_ctx(&self) -> usize {
        self.ranks[0].n_ctx()
    }
    fn prompt(&mut self, tokens: &[u32], sampling: &SamplingParams) -> Result<u32> {
        TensorParallel::prompt(self, tokens, sampling)
    }
}
