//! `kiln bench --batched`: aggregate throughput of many sequences decoded together, measured and
//! printed like llama.cpp's llama-batched-bench (columns PP, TG, B, N_KV, T_PP, S_PP, T_TG,
//! S_TG, T, S): per case, `B` prompts of `PP` tokens are processed (in steps of at most `-b`
//! tokens), then `TG` steps decode one token of every sequence.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use kiln_core::plan::LogitRows;
use kiln_core::{Backend, SamplingParams};
use kiln_gguf::GgufFile;
use kiln_models::{Engine, EngineOptions, SeqWork, Sequence};

use crate::devices::Devices;

use crate::bench::{BenchArgs, TokenDraw};
use crate::kv_args::MemoryWatch;
use crate::CliResult;

#[derive(Args, Debug, Clone)]
pub struct BatchedArgs {
    /// Prompt lengths (comma-separated), llama-batched-bench's -npp.
    #[arg(long = "npp", value_delimiter = ',', default_value = "128")]
    pub npp: Vec<usize>,
    /// Generated tokens per sequence (comma-separated), -ntg.
    #[arg(long = "ntg", value_delimiter = ',', default_value = "128")]
    pub ntg: Vec<usize>,
    /// Sequences decoded together (comma-separated), -npl.
    #[arg(long = "npl", value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    pub npl: Vec<usize>,
}

struct CaseResult {
    pp: usize,
    tg: usize,
    b: usize,
    t_pp: f64,
    t_tg: f64,
}

impl CaseResult {
    fn row(&self) -> String {
        let n_kv = self.b * (self.pp + self.tg);
        let t = self.t_pp + self.t_tg;
        let rate = |n: usize, t: f64| if t > 0.0 { n as f64 / t } else { 0.0 };
        format!(
            "| {:5} | {:6} | {:4} | {:6} | {:8.3} | {:8.2} | {:8.3} | {:8.2} | {:8.3} | {:8.2} |",
            self.pp,
            self.tg,
            self.b,
            n_kv,
            self.t_pp,
            rate(self.b * self.pp, self.t_pp),
            self.t_tg,
            rate(self.b * self.tg, self.t_tg),
            t,
            rate(n_kv, t)
        )
    }
}

pub const HEADER: &str = "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |\n\
                          |-------|--------|------|--------|----------|----------|----------|----------|----------|----------|";

/// Feeds every sequence's pending prompt in steps of at most `n_batch` tokens; each sequence
/// samples once its prompt is done, and the sampled token is appended.
fn prefill<B: Backend>(engine: &mut Engine<B>, seqs: &mut [Sequence], n_batch: usize) -> CliResult {
    let mut next = 0;
    while next < seqs.len() {
        let mut budget = n_batch;
        let mut work = Vec::new();
        for seq in seqs[next..].iter_mut() {
            if budget == 0 {
                break;
            }
            let n = seq.n_pending().min(budget);
            budget -= n;
            let done = n == seq.n_pending();
            work.push(SeqWork { seq, n_tokens: n, logits: if done { LogitRows::Last } else { LogitRows::None }, sample: done });
        }
        let finished = work.iter().filter(|w| w.sample).count();
        let sampled = engine.step(&mut work)?.to_vec();
        let mut sampled = sampled.into_iter();
        for w in work.iter_mut().filter(|w| w.sample) {
            w.seq.tokens.push(sampled.next().expect("one token per sampling sequence"));
        }
        next += finished;
    }
    Ok(())
}

/// `steps` decode steps over all sequences, each appending its sampled token.
fn decode<B: Backend>(engine: &mut Engine<B>, seqs: &mut [Sequence], steps: usize) -> CliResult {
    for _ in 0..steps {
        let mut work: Vec<SeqWork> = seqs.iter_mut().map(|seq| SeqWork { seq, n_tokens: 1, logits: LogitRows::Last, sample: true }).collect();
        let sampled = engine.step(&mut work)?;
        for (w, &t) in work.iter_mut().zip(sampled) {
            w.seq.tokens.push(t);
        }
    }
    Ok(())
}

fn run_case<B: Backend>(engine: &mut Engine<B>, draw: &mut TokenDraw, pp: usize, tg: usize, b: usize, n_batch: usize) -> CliResult<CaseResult> {
    let greedy = SamplingParams::greedy();
    let mut seqs: Vec<Sequence> = (0..b)
        .map(|_| {
            let mut s = Sequence::with_capacity(pp + tg + 1, greedy);
            s.tokens.extend((0..pp).map(|_| draw.next()));
            s
        })
        .collect();
    let backend = engine.backend().clone();
    backend.synchronize()?;
    let start = Instant::now();
    prefill(engine, &mut seqs, n_batch)?;
    backend.synchronize()?;
    let t_pp = start.elapsed().as_secs_f64();
    let start = Instant::now();
    decode(engine, &mut seqs, tg)?;
    backend.synchronize()?;
    let t_tg = start.elapsed().as_secs_f64();
    for s in seqs.iter_mut() {
        engine.release(s);
    }
    Ok(CaseResult { pp, tg, b, t_pp, t_tg })
}

pub fn run<B: Backend>(devices: Devices<B>, file: Arc<GgufFile>, args: &BenchArgs) -> CliResult {
    let backend = devices.lead();
    let a = &args.batched_args;
    if [&a.npp, &a.ntg, &a.npl].iter().any(|v| v.is_empty() || v.contains(&0)) {
        return Err("--batched needs non-empty --npp, --ntg and --npl lists of positive numbers".into());
    }
    let max_len = a.npp.iter().max().copied().unwrap_or(1) + a.ntg.iter().max().copied().unwrap_or(1) + 1;
    let max_seqs = a.npl.iter().max().copied().unwrap_or(1);
    let n_batch = args.batch_size.max(1);
    let mut memory = MemoryWatch::start(&*backend);
    let options = EngineOptions { max_seq_len: max_len, max_batch_tokens: n_batch, max_seqs, ..EngineOptions::default() };
    let mut engine = devices.engine(&args.kv, &file, options)?;
    let config = engine.weights().config.clone();
    let mut draw = TokenDraw { state: 0x9E37_79B9_7F4A_7C15, n_vocab: config.n_vocab as u32 };
    eprintln!("kiln bench --batched: {}, backend {}", crate::kv_args::describe(&engine), backend.name());
    // Warm-up: kernels load and tune, and every batch size records its decode graph, before any timing.
    for &pp in &a.npp {
        for &b in &a.npl {
            run_case(&mut engine, &mut draw, pp, 3, b, n_batch)?;
        }
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "main: n_kv_max = {}, n_batch = {n_batch}, n_ubatch = {n_batch}, is_pp_shared = 0, n_seq_max = {max_seqs}\n", engine.pool().spec().rows())?;
    writeln!(out, "{HEADER}")?;
    let mut peak_blocks = 0;
    for &pp in &a.npp {
        for &tg in &a.ntg {
            for &b in &a.npl {
                let r = run_case(&mut engine, &mut draw, pp, tg, b, n_batch)?;
                memory.sample(&*backend);
                peak_blocks = peak_blocks.max(b * (pp + tg).div_ceil(kiln_core::KV_BLOCK_SIZE));
                writeln!(out, "{}", r.row())?;
                out.flush()?;
            }
        }
    }
    let weights_mib = file.tensors().iter().map(|t| t.n_bytes).sum::<u64>() as f64 / (1u64 << 20) as f64;
    let kv_mib = engine.kv_usable_bytes() as f64 / (1u64 << 20) as f64;
    match memory.peak_mib() {
        Some(peak) => eprintln!(
            "kiln bench --batched: device memory peak {peak:.0} MiB (weights {weights_mib:.0} MiB in the file, KV {kv_mib:.0} MiB backed, most blocks in use {peak_blocks})"
        ),
        None => eprintln!("kiln bench --batched: KV {kv_mib:.0} MiB backed, most blocks in use {peak_blocks}"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_follow_llama_batched_bench() {
        let r = CaseResult { pp: 128, tg: 128, b: 8, t_pp: 0.5, t_tg: 2.0 };
        assert_eq!(r.row(), "|   128 |    128 |    8 |   2048 |    0.500 |  2048.00 |    2.000 |   512.00 |    2.500 |   819.20 |");
        assert_eq!(HEADER.lines().next().unwrap().len(), r.row().len());
    }
}
