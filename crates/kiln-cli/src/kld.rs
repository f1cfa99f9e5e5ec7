//! The base file of `kiln perplexity --kl-divergence-base` and the statistics of
//! `--kl-divergence` against it.
//!
//! Format (little endian): the 8 bytes `KILNKLD1`, then u32 `n_vocab`, u32 `n_ctx`, u32
//! `n_chunk`, then `n_chunk * n_ctx` u32 token ids (each chunk as evaluated, BOS first), then
//! for every chunk and every scored position (`n_ctx - 1 - n_ctx / 2` of them, in order)
//! `n_vocab` f32 log-probabilities (log-softmax of the logits). f32 rather than llama.cpp's
//! 16-bit quantization, so a model compared with its own base gives exactly 0.

use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

pub const MAGIC: &[u8; 8] = b"KILNKLD1";
const HEADER_BYTES: u64 = 8 + 3 * 4;

#[derive(Debug, thiserror::Error)]
pub enum KldError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: not a kiln KL-divergence base file (written by `kiln perplexity --kl-divergence-base`)")]
    BadMagic { path: PathBuf },
    #[error("{path}: {what}")]
    Malformed { path: PathBuf, what: String },
    #[error("{path}: the base has a vocabulary of {base} tokens, this model {model}")]
    VocabMismatch { path: PathBuf, base: usize, model: usize },
    #[error("{path}: the base was made with chunks of {base} tokens, but -c is {given}")]
    ContextMismatch { path: PathBuf, base: usize, given: usize },
}

/// Scored positions of a chunk of `n_ctx` tokens: the logits at `n_ctx/2 .. n_ctx-1`, each
/// predicting the token after it.
pub fn scored_range(n_ctx: usize) -> std::ops::Range<usize> {
    n_ctx / 2..n_ctx - 1
}

/// Writes the base while chunks are evaluated.
pub struct BaseWriter {
    path: PathBuf,
    out: BufWriter<std::fs::File>,
}

impl BaseWriter {
    pub fn create(path: &Path, n_vocab: usize, n_ctx: usize, chunks: &[Vec<u32>]) -> Result<BaseWriter, KldError> {
        let io = |source| KldError::Io { path: path.to_path_buf(), source };
        let mut out = BufWriter::new(std::fs::File::create(path).map_err(io)?);
        let mut head = MAGIC.to_vec();
        for v in [n_vocab, n_ctx, chunks.len()] {
            head.extend_from_slice(&(v as u32).to_le_bytes());
        }
        for t in chunks.iter().flatten() {
            head.extend_from_slice(&t.to_le_bytes());
        }
        out.write_all(&head).map_err(io)?;
        Ok(BaseWriter { path: path.to_path_buf(), out })
    }

    /// The log-probabilities of one scored position.
    pub fn push(&mut self, log_probs: &[f32]) -> Result<(), KldError> {
        let bytes: Vec<u8> = log_probs.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.out.write_all(&bytes).map_err(|source| KldError::Io { path: self.path.clone(), source })
    }

    pub fn finish(mut self) -> Result<(), KldError> {
        self.out.flush().map_err(|source| KldError::Io { path: self.path.clone(), source })
    }
}

/// A base being read back, one scored position at a time.
pub struct BaseReader {
    pub path: PathBuf,
    pub chunks: Vec<Vec<u32>>,
    input: BufReader<std::fs::File>,
    row: Vec<u8>,
}

impl BaseReader {
    /// Opens `path` and checks its header and its length against `n_vocab` (the model's) and
    /// `n_ctx` (the `-c` given, if any).
    pub fn open(path: &Path, n_vocab: usize, n_ctx: Option<usize>) -> Result<BaseReader, KldError> {
        let p = || path.to_path_buf();
        let io = |source| KldError::Io { path: p(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let mut input = BufReader::new(file);
        let mut head = [0u8; HEADER_BYTES as usize];
        if len < HEADER_BYTES {
            return Err(KldError::BadMagic { path: p() });
        }
        input.read_exact(&mut head).map_err(io)?;
        if &head[..8] != MAGIC {
            return Err(KldError::BadMagic { path: p() });
        }
        let word = |i: usize| u32::from_le_bytes(head[8 + 4 * i..12 + 4 * i].try_into().unwrap()) as usize;
        let (base_vocab, base_ctx, n_chunk) = (word(0), word(1), word(2));
        if base_ctx < 4 || n_chunk == 0 || base_vocab == 0 {
            return Err(KldError::Malformed { path: p(), what: format!("header says vocab {base_vocab}, {n_chunk} chunks of {base_ctx} tokens") });
        }
        if base_vocab != n_vocab {
            return Err(KldError::VocabMismatch { path: p(), base: base_vocab, model: n_vocab });
        }
        if let Some(given) = n_ctx.filter(|&c| c != base_ctx) {
            return Err(KldError::ContextMismatch { path: p(), base: base_ctx, given });
        }
        let n_scored = scored_range(base_ctx).len() as u64;
        let expected = (n_chunk as u64)
            .checked_mul(base_ctx as u64 * 4 + n_scored * base_vocab as u64 * 4)
            .and_then(|b| b.checked_add(HEADER_BYTES))
            .ok_or_else(|| KldError::Malformed { path: p(), what: "header sizes overflow".into() })?;
        if len != expected {
            return Err(KldError::Malformed {
                path: p(),
                what: format!("{len} bytes, but {n_chunk} chunks of {base_ctx} tokens over a vocabulary of {base_vocab} take {expected}"),
            });
        }
        let mut ids = vec![0u8; n_chunk * base_ctx * 4];
        input.read_exact(&mut ids).map_err(io)?;
        let all: Vec<u32> = ids.chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().unwrap())).collect();
        if let Some(&bad) = all.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(KldError::Malformed { path: p(), what: format!("token id {bad} is outside the vocabulary of {n_vocab}") });
        }
        let chunks = all.chunks(base_ctx).map(<[u32]>::to_vec).collect();
        Ok(BaseReader { path: p(), chunks, input, row: vec![0; n_vocab * 4] })
    }

    /// The next scored position's log-probabilities into `out`.
    pub fn next_row(&mut self, out: &mut Vec<f32>) -> Result<(), KldError> {
        self.input.read_exact(&mut self.row).map_err(|source| KldError::Io { path: self.path.clone(), source })?;
        out.clear();
        out.extend(self.row.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())));
        Ok(())
    }
}

/// Log-softmax in f64 (written back as f32), so its sums do not lose the small terms.
pub fn log_softmax(logits: &[f32], out: &mut Vec<f32>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    let log_z = max + sum.ln();
    out.clear();
    out.extend(logits.iter().map(|&l| (l as f64 - log_z) as f32));
}

/// Running mean and standard error of a sample.
#[derive(Default, Clone, Copy, Debug)]
pub struct Moments {
    pub n: usize,
    sum: f64,
    sum2: f64,
}

impl Moments {
    pub fn add(&mut self, x: f64) {
        self.n += 1;
        self.sum += x;
        self.sum2 += x * x;
    }
    pub fn mean(&self) -> f64 {
        self.sum / self.n as f64
    }
    /// Standard error of the mean (0 with fewer than two values).
    pub fn stderr(&self) -> f64 {
        if self.n < 2 {
            return 0.0;
        }
        let m = self.mean();
        ((self.sum2 / self.n as f64 - m * m).max(0.0) / (self.n - 1) as f64).sqrt()
    }
}

/// KL divergence statistics over the scored tokens.
#[derive(Default)]
pub struct KlStats {
    pub kld: Moments,
    /// ln p_model(token) - ln p_base(token).
    pub log_ratio: Moments,
    pub nll_base: Moments,
    pub same_top: Moments,
    pub values: Vec<f64>,
}

impl KlStats {
    /// One scored position: `base` and `model` are log-probabilities, `token` the actual next one.
    pub fn add(&mut self, base: &[f32], model: &[f32], token: u32) {
        let kld: f64 = base.iter().zip(model).map(|(&b, &m)| (b as f64).exp() * (b as f64 - m as f64)).sum();
        // Rounding can make a zero divergence slightly negative.
        let kld = kld.max(0.0);
        self.kld.add(kld);
        self.values.push(kld);
        let t = token as usize;
        self.log_ratio.add(model[t] as f64 - base[t] as f64);
        self.nll_base.add(-(base[t] as f64));
        let top = |v: &[f32]| kiln_core::sampling::argmax(v);
        self.same_top.add(if top(base) == top(model) { 1.0 } else { 0.0 });
    }

    /// The `q`-quantile of the per-token divergences (0 <= q <= 1).
    pub fn quantile(&self, q: f64) -> f64 {
        let mut v = self.values.clone();
        v.sort_by(f64::total_cmp);
        v.get(((v.len() - 1) as f64 * q).round() as usize).copied().unwrap_or(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_sums_to_one() {
        let mut out = Vec::new();
        log_softmax(&[1.0, 2.0, -3.0, 0.5], &mut out);
        let s: f64 = out.iter().map(|&v| (v as f64).exp()).sum();
        assert!((s - 1.0).abs() < 1e-6, "{s}");
        assert!(out[1] > out[0] && out[0] > out[3] && out[3] > out[2]);
    }

    #[test]
    fn kl_of_a_distribution_against_itself_is_zero_and_otherwise_positive() {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        log_softmax(&[1.0, 2.0, -3.0], &mut a);
        log_softmax(&[2.0, 1.0, -3.0], &mut b);
        let mut s = KlStats::default();
        s.add(&a, &a, 0);
        assert_eq!(s.kld.mean(), 0.0);
        s.add(&a, &b, 0);
        assert!(s.values[1] > 0.01);
        assert_eq!(s.same_top.mean(), 0.5);
    }

    #[test]
    fn moments_give_the_standard_error() {
        let mut m = Moments::default();
        for x in [1.0, 2.0, 3.0, 4.0] {
            m.add(x);
        }
        assert_eq!(m.mean(), 2.5);
        // population variance 1.25, / (n - 1)
        assert!((m.stderr() - (1.25f64 / 3.0).sqrt()).abs() < 1e-12);
    }
}
