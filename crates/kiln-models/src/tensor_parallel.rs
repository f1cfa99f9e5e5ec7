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

use kiln_core::{Backend, GroupHandle};
use kiln_gguf::GgufFile;

use crate::config::{Arch, BlockStyle, FfnConfig, KvSource, Mixer, ModelConfig};
use crate::engine::{Engine, EngineOptions};
use crate::error::{ModelError, Result};
use crate::model::{Model, ModelOptions};
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

/// An engine over the model in `file` split over `backends.len()` ranks: rank `r`'s slice on
/// `backends[r]`, joined by `reducers[r]` (one group, handles in rank order). It runs each step
/// on every rank at once and samples on the first; everything above it (the single-sequence
/// [`Model`], the server's scheduler, the batched benchmark) is unchanged.
pub fn engine<B: Backend>(backends: Vec<Arc<B>>, reducers: Vec<GroupHandle<B>>, file: &Arc<GgufFile>, options: &EngineOptions) -> Result<Engine<B>> {
    let ranks = backends.len();
    if reducers.len() != ranks || reducers.iter().enumerate().any(|(r, g)| g.rank() != r || g.ranks() != ranks) {
        return Err(unshardable(ranks, "one all-reduce handle per rank, in rank order, is needed".into()));
    }
    check(&ModelConfig::from_gguf(file)?, file, ranks)?;
    let engines = backends
        .into_iter()
        .enumerate()
        .map(|(rank, backend)| {
            let weights = Arc::new(Weights::load_shard(&*backend, file, Shard { rank, ranks })?);
            Engine::new(backend, weights, options)
        })
        .collect::<Result<Vec<_>>>()?;
    Engine::group(engines, reducers)
}

/// [`engine`] under the single-sequence API, with `options` as [`Model::load`] takes them.
pub fn model<B: Backend>(backends: Vec<Arc<B>>, reducers: Vec<GroupHandle<B>>, file: &Arc<GgufFile>, options: &ModelOptions) -> Result<Model<B>> {
    let n_ctx_train = ModelConfig::from_gguf(file)?.n_ctx_train;
    Ok(Model::with_engine(engine(backends, reducers, file, &options.engine_options(n_ctx_train))?))
}
