//! Engine-level checks shared by the CPU and GPU test suites: the same sequences run alone and
//! batched together (staggered, so prefill chunks and decode tokens mix in one step) must give
//! the same logits and greedy tokens.

use std::sync::Arc;

use kiln_core::plan::LogitRows;
use kiln_core::{Backend, SamplingParams};

use crate::engine::{Engine, EngineOptions, SeqWork, Sequence};
use crate::error::Result;
use crate::weights::Weights;

/// What one sequence produced: the logits of every step (its prompt's last token, then each
/// decoded token) and the greedy tokens sampled.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    pub logits: Vec<Vec<f32>>,
    pub tokens: Vec<u32>,
}

/// Runs `prompt` alone: prefill, then `steps` greedy decode steps.
pub fn run_alone<B: Backend>(backend: &Arc<B>, weights: &Arc<Weights<B>>, options: &EngineOptions, prompt: &[u32], steps: usize) -> Result<Trace> {
    let options = EngineOptions { max_seqs: 1, ..options.clone() };
    let mut engine = Engine::new(backend.clone(), weights.clone(), &options)?;
    let mut seq = Sequence::with_capacity(prompt.len() + steps + 1, SamplingParams::greedy());
    seq.tokens.extend_from_slice(prompt);
    let mut trace = Trace::default();
    for step in 0..=steps {
        let n = if step == 0 { prompt.len() } else { 1 };
        let token = engine.step(&mut [SeqWork { seq: &mut seq, n_tokens: n, logits: LogitRows::Last, sample: true }])?[0];
        trace.logits.push(engine.logits()?.to_vec());
        trace.tokens.push(token);
        seq.tokens.push(token);
    }
    Ok(trace)
}

/// Runs every prompt in one engine: sequence `i` joins at step `i` with its whole prompt while
/// the ones before it decode, and each decodes `steps` tokens.
pub fn run_staggered<B: Backend>(
    backend: &Arc<B>,
    weights: &Arc<Weights<B>>,
    options: &EngineOptions,
    prompts: &[Vec<u32>],
    steps: usize,
) -> Result<Vec<Trace>> {
    let options = EngineOptions { max_seqs: prompts.len(), ..options.clone() };
    let mut engine = Engine::new(backend.clone(), weights.clone(), &options)?;
    run_staggered_on(&mut engine, prompts, steps)
}

/// [`run_staggered`] on an engine made for at least `prompts.len()` sequences.
pub fn run_staggered_on<B: Backend>(engine: &mut Engine<B>, prompts: &[Vec<u32>], steps: usize) -> Result<Vec<Trace>> {
    let vocab = engine.weights().config.n_vocab;
    let mut seqs: Vec<Sequence> = prompts
        .iter()
        .map(|p| {
            let mut s = Sequence::with_capacity(p.len() + steps + 1, SamplingParams::greedy());
            s.tokens.extend_from_slice(p);
            s
        })
        .collect();
    let mut traces = vec![Trace::default(); prompts.len()];
    for step in 0..prompts.len() + steps {
        let mut work = Vec::new();
        let mut who = Vec::new();
        for (i, seq) in seqs.iter_mut().enumerate() {
            let fed = traces[i].tokens.len();
            if i > step || fed > steps {
                continue;
            }
            let n = if fed == 0 { prompts[i].len() } else { 1 };
            work.push(SeqWork { seq, n_tokens: n, logits: LogitRows::Last, sample: true });
            who.push(i);
        }
        if work.is_empty() {
            continue;
        }
        let sampled = engine.step(&mut work)?.to_vec();
        let logits = engine.logits()?;
        for (row, (&i, &token)) in who.iter().zip(&sampled).enumerate() {
            traces[i].logits.push(logits[row * vocab..(row + 1) * vocab].to_vec());
            traces[i].tokens.push(token);
        }
        for (w, &token) in work.iter_mut().zip(&sampled) {
            w.seq.tokens.push(token);
        }
    }
    Ok(traces)
}

/// The largest absolute logit difference, and the greedy steps at which the tokens differ
/// although `alone`'s top-2 margin there exceeded `2 * margin_floor`.
pub fn compare(alone: &Trace, batched: &Trace, margin_floor: f32) -> (f32, Vec<usize>) {
    let mut max_abs = 0f32;
    let mut bad_steps = Vec::new();
    for (step, (a, b)) in alone.logits.iter().zip(&batched.logits).enumerate() {
        max_abs = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(max_abs, f32::max);
        if alone.tokens[step] != batched.tokens[step] && top2_margin(a) > 2.0 * margin_floor {
            bad_steps.push(step);
        }
        if alone.tokens[step] != batched.tokens[step] {
            // Later steps fed different tokens: nothing more to compare.
            break;
        }
    }
    (max_abs, bad_steps)
}

/// The gap between the largest and the second largest logit.
pub fn top2_margin(logits: &[f32]) -> f32 {
    let (mut first, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &l in logits {
        if l > first {
            second = first;
            first = l;
        } else if l > second {
            second = l;
        }
    }
    first - second
}
