//! `kiln perplexity`: a model's perplexity over a text and its KL divergence against a base
//! model, as llama.cpp's llama-perplexity measures them.
//!
//! The text is tokenized once (with BOS) and cut into chunks of `-c` tokens; each chunk is
//! evaluated alone from an empty cache with its first token replaced by BOS, and only the
//! second half of each chunk is scored, so every scored token sees at least `c/2` tokens of
//! context. Unlike llama-perplexity, one full chunk of text is enough (it asks for two).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use kiln_core::{Backend, CpuBackend, CpuMatmul, CpuOptions};
use kiln_gguf::GgufFile;
use kiln_models::{Logits, Model, ModelConfig, ModelOptions};
use kiln_tokenizer::Tokenizer;

use crate::kld::{log_softmax, scored_range, BaseReader, BaseWriter, KlStats, Moments};
use crate::kv_args::KvArgs;
use crate::run::{on_cpu_workers, open_gpu, DeviceKind};
use crate::CliResult;

#[derive(Parser, Debug)]
pub struct PerplexityArgs {
    /// GGUF model file (default: the stories260K model shipped with kiln).
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
    /// Text file to score (not needed with --kl-divergence, which takes the base's tokens).
    #[arg(short = 'f', long = "file")]
    pub file: Option<PathBuf>,
    /// Tokens per chunk [default: 512; with --kl-divergence, the base's].
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx_size: Option<usize>,
    /// Tokens per forward pass (a chunk longer than this is fed in several).
    #[arg(short = 'b', long = "batch-size", default_value_t = 2048)]
    pub batch_size: usize,
    /// Score only the first N chunks.
    #[arg(long)]
    pub chunks: Option<usize>,
    /// CPU threads (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// Where to run: `cuda` (GPU 0) or `cpu`; by default the GPU when one is available.
    #[arg(long, value_enum)]
    pub device: Option<DeviceKind>,
    /// CPU products: `quantized` (8-bit activations, fast) or `exact` (f32 on dequantized weights).
    #[arg(long = "cpu-matmul", value_enum, default_value = "quantized")]
    pub cpu_matmul: CpuMatmulArg,
    /// Save the log-probabilities of every scored token to this file, as a base for --kl-divergence.
    #[arg(long = "kl-divergence-base", value_name = "FILE")]
    pub kl_divergence_base: Option<PathBuf>,
    /// Compare this model's token distributions with those in --kl-divergence-base.
    #[arg(long = "kl-divergence", requires = "kl_divergence_base")]
    pub kl_divergence: bool,
    #[command(flatten)]
    pub kv: KvArgs,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuMatmulArg {
    Quantized,
    Exact,
}

#[derive(Debug, thiserror::Error)]
pub enum PerplexityError {
    #[error("no text to score: give -f FILE (or --kl-divergence with a base)")]
    NoText,
    #[error("{path}: {source}")]
    ReadText { path: PathBuf, source: std::io::Error },
    #[error("-c {0}: a chunk needs at least 3 tokens (the second half of it is scored)")]
    ContextTooSmall(usize),
    #[error("the text has {tokens} tokens, fewer than one chunk of {n_ctx}; give a longer text or a smaller -c")]
    TextTooShort { tokens: usize, n_ctx: usize },
    #[error("--chunks 0: nothing to score")]
    NoChunks,
}

/// Chunk size when neither -c nor a base gives one (llama-perplexity's default context).
const DEFAULT_CTX: usize = 512;

/// Cuts the tokenized text into chunks of `n_ctx`, each starting with `bos`.
pub fn chunks_of(tokens: &[u32], n_ctx: usize, bos: Option<u32>, limit: Option<usize>) -> Result<Vec<Vec<u32>>, PerplexityError> {
    if n_ctx < 3 {
        return Err(PerplexityError::ContextTooSmall(n_ctx));
    }
    if tokens.len() < n_ctx {
        return Err(PerplexityError::TextTooShort { tokens: tokens.len(), n_ctx });
    }
    let n = (tokens.len() / n_ctx).min(limit.unwrap_or(usize::MAX));
    Ok(tokens
        .chunks_exact(n_ctx)
        .take(n)
        .map(|c| {
            let mut c = c.to_vec();
            if let Some(b) = bos {
                c[0] = b;
            }
            c
        })
        .collect())
}

pub fn perplexity(args: PerplexityArgs) -> CliResult {
    crate::run::set_threads(args.threads);
    if args.chunks == Some(0) {
        return Err(PerplexityError::NoChunks.into());
    }
    if !args.kl_divergence && args.file.is_none() {
        return Err(PerplexityError::NoText.into());
    }
    let file = crate::run::open_model(&args.model)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let gpu = match args.device {
        Some(DeviceKind::Cpu) => None,
        Some(DeviceKind::Cuda) => Some(open_gpu()?),
        None => open_gpu().map_err(|e| eprintln!("kiln: no usable GPU: {e}; running on the CPU")).ok(),
    };
    match gpu {
        Some(gpu) => evaluate(Arc::new(gpu), file, &tokenizer, &args),
        None => {
            let matmul = match args.cpu_matmul {
                CpuMatmulArg::Quantized => CpuMatmul::Quantized,
                CpuMatmulArg::Exact => CpuMatmul::Exact,
            };
            let cpu = CpuBackend::with_options(CpuOptions { matmul, ..CpuOptions::default() });
            on_cpu_workers(args.threads, || evaluate(Arc::new(cpu), file, &tokenizer, &args))
        }
    }
}

/// What the command accumulates over the scored tokens.
struct Scores {
    nll: Moments,
    kl: Option<KlStats>,
}

fn evaluate<B: Backend>(backend: Arc<B>, file: Arc<GgufFile>, tokenizer: &Tokenizer, args: &PerplexityArgs) -> CliResult {
    let config = ModelConfig::from_gguf(&file)?;
    let n_vocab = config.n_vocab;
    let (chunks, mut base) = if args.kl_divergence {
        let path = args.kl_divergence_base.as_ref().expect("clap requires the base");
        let base = BaseReader::open(path, n_vocab, args.ctx_size)?;
        let limit = args.chunks.unwrap_or(usize::MAX);
        (base.chunks.iter().take(limit).cloned().collect::<Vec<_>>(), Some(base))
    } else {
        let path = args.file.as_ref().ok_or(PerplexityError::NoText)?;
        let text = std::fs::read_to_string(path).map_err(|source| PerplexityError::ReadText { path: path.clone(), source })?;
        let tokens = tokenizer.encode(&text, true, false);
        let n_ctx = args.ctx_size.unwrap_or(DEFAULT_CTX);
        let bos = if tokenizer.add_bos() { tokenizer.bos() } else { None };
        (chunks_of(&tokens, n_ctx, bos, args.chunks)?, None)
    };
    let n_ctx = chunks[0].len();
    let n_batch = args.batch_size.clamp(1, n_ctx);
    let options = ModelOptions { n_ctx: Some(n_ctx), n_batch, all_logits: true, ..ModelOptions::default() };
    let (weights, engine_options) = args.kv.load(&*backend, &file, options.engine_options(n_ctx))?;
    let mut model = Model::with_weights(backend.clone(), weights, &engine_options)?;
    eprintln!(
        "perplexity: {} ({}), backend {}: {} chunks of {n_ctx} tokens, batch {n_batch}, {} scored per chunk",
        config.name.as_deref().unwrap_or("model"),
        config.arch.name(),
        backend.name(),
        chunks.len(),
        scored_range(n_ctx).len()
    );
    // Without --kl-divergence, --kl-divergence-base names the file to write.
    let mut writer = match (&args.kl_divergence_base, args.kl_divergence) {
        (Some(path), false) => Some(BaseWriter::create(path, n_vocab, n_ctx, &chunks)?),
        _ => None,
    };
    let mut scores = Scores { nll: Moments::default(), kl: base.as_ref().map(|_| KlStats::default()) };
    let (mut log_probs, mut base_row) = (Vec::new(), Vec::new());
    let mut out = std::io::stdout().lock();
    let start = Instant::now();
    for (k, chunk) in chunks.iter().enumerate() {
        let logits = chunk_logits(&mut model, chunk, n_batch)?;
        for i in scored_range(n_ctx) {
            log_softmax(&logits[i * n_vocab..(i + 1) * n_vocab], &mut log_probs);
            let next = chunk[i + 1];
            scores.nll.add(-(log_probs[next as usize] as f64));
            if let Some(w) = writer.as_mut() {
                w.push(&log_probs)?;
            }
            if let (Some(b), Some(kl)) = (base.as_mut(), scores.kl.as_mut()) {
                b.next_row(&mut base_row)?;
                kl.add(&base_row, &log_probs, next);
            }
        }
        if k == 0 {
            let per = start.elapsed().as_secs_f64();
            eprintln!("perplexity: {per:.2} seconds per pass - ETA {:.2} minutes", per * chunks.len() as f64 / 60.0);
        }
        write!(out, "[{}]{:.4},", k + 1, scores.nll.mean().exp())?;
        out.flush()?;
    }
    writeln!(out)?;
    let ppl = scores.nll.mean().exp();
    writeln!(out, "Final estimate: PPL = {ppl:.6} +/- {:.6}", ppl * scores.nll.stderr())?;
    if let Some(kl) = &scores.kl {
        print_kl(&mut out, &scores.nll, kl)?;
    }
    if let Some(w) = writer {
        w.finish()?;
        let path = args.kl_divergence_base.as_ref().expect("a writer has a path");
        eprintln!("perplexity: saved the log-probabilities of {} tokens to {}", scores.nll.n, path.display());
    }
    Ok(())
}

/// All logits of one chunk (`[n_ctx][n_vocab]`), fed from an empty cache in steps of `n_batch`.
fn chunk_logits<B: Backend>(model: &mut Model<B>, chunk: &[u32], n_batch: usize) -> CliResult<Vec<f32>> {
    model.reset();
    let mut logits = Vec::with_capacity(chunk.len() * model.config.n_vocab);
    for part in chunk.chunks(n_batch) {
        logits.extend_from_slice(model.forward(part, Logits::All)?);
    }
    Ok(logits)
}

fn print_kl(out: &mut impl Write, nll: &Moments, kl: &KlStats) -> std::io::Result<()> {
    let ppl = nll.mean().exp();
    let ppl_base = kl.nll_base.mean().exp();
    let ratio = kl.log_ratio.mean();
    writeln!(out, "====== KL divergence statistics ({} tokens) ======", kl.kld.n)?;
    writeln!(out, "Mean PPL(Q)                   : {ppl:.6} +/- {:.6}", ppl * nll.stderr())?;
    writeln!(out, "Mean PPL(base)                : {ppl_base:.6} +/- {:.6}", ppl_base * kl.nll_base.stderr())?;
    // PPL(Q)/PPL(base) = exp(mean(ln p_base - ln p_Q)).
    writeln!(out, "Mean ln(PPL(Q)/PPL(base))     : {:.6} +/- {:.6}", -ratio, kl.log_ratio.stderr())?;
    writeln!(out, "Mean PPL(Q)/PPL(base)         : {:.6} +/- {:.6}", (-ratio).exp(), (-ratio).exp() * kl.log_ratio.stderr())?;
    writeln!(out, "Mean    KLD: {:.8} +/- {:.8}", kl.kld.mean(), kl.kld.stderr())?;
    writeln!(out, "Maximum KLD: {:.8}", kl.quantile(1.0))?;
    writeln!(out, "99.0%   KLD: {:.8}", kl.quantile(0.99))?;
    writeln!(out, "Median  KLD: {:.8}", kl.quantile(0.5))?;
    writeln!(out, "Minimum KLD: {:.8}", kl.quantile(0.0))?;
    writeln!(out, "Same top p: {:.3} +/- {:.3} %", 100.0 * kl.same_top.mean(), 100.0 * kl.same_top.stderr())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_start_with_bos_and_drop_the_remainder() {
        let tokens: Vec<u32> = (10..21).collect();
        let c = chunks_of(&tokens, 4, Some(1), None).unwrap();
        assert_eq!(c, vec![vec![1, 11, 12, 13], vec![1, 15, 16, 17]]);
        assert_eq!(chunks_of(&tokens, 4, None, Some(1)).unwrap(), vec![vec![10, 11, 12, 13]]);
        assert!(matches!(chunks_of(&tokens, 12, Some(1), None), Err(PerplexityError::TextTooShort { tokens: 11, n_ctx: 12 })));
        assert!(matches!(chunks_of(&tokens, 2, Some(1), None), Err(PerplexityError::ContextTooSmall(2))));
    }

    #[test]
    fn scored_positions_are_the_second_half() {
        assert_eq!(scored_range(512), 256..511);
        assert_eq!(scored_range(20), 10..19);
        assert_eq!(scored_range(3), 1..2);
    }
}
