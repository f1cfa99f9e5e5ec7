//! The generation loop: prompt as a batch, then one sampled token per step,
//! streaming UTF-8-safe text and stopping at end-of-generation tokens, the
//! token limit, the context limit or a stop string.

use std::time::{Duration, Instant};

use kiln_core::{Backend, SamplingParams};
use kiln_tokenizer::{StreamDecoder, Tokenizer};

use crate::error::{ModelError, Result};
use crate::model::Model;

#[derive(Clone, Debug)]
pub struct GenerateParams {
    /// Most tokens to generate; `None` runs until end of generation or a full context.
    pub n_predict: Option<usize>,
    pub sampling: SamplingParams,
    /// Generation stops when the text contains any of these; it is not printed.
    pub stop: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    EndOfGeneration,
    TokenLimit,
    ContextFull,
    StopString,
    Cancelled,
}

#[derive(Clone, Debug)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub prompt_time: Duration,
    pub generated_tokens: usize,
    /// The generated token ids, end-of-generation token excluded.
    pub generated_ids: Vec<u32>,
    pub generation_time: Duration,
    pub stop_reason: StopReason,
}

impl StopReason {
    /// The OpenAI-style name: `stop` (end of generation or a stop string), `length` (token
    /// limit or full context) or `cancelled`.
    pub fn finish_reason(self) -> &'static str {
        match self {
            StopReason::EndOfGeneration | StopReason::StopString => "stop",
            StopReason::TokenLimit | StopReason::ContextFull => "length",
            StopReason::Cancelled => "cancelled",
        }
    }
}

impl GenerationStats {
    pub fn prompt_tokens_per_second(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_time.as_secs_f64().max(1e-9)
    }
    pub fn generation_tokens_per_second(&self) -> f64 {
        self.generated_tokens as f64 / self.generation_time.as_secs_f64().max(1e-9)
    }
}

/// Holds back text that might be the start of a stop string.
struct StopFilter<'a> {
    stops: &'a [String],
    pending: String,
}

impl StopFilter<'_> {
    /// Adds `text`; returns what is safe to emit and whether a stop string was hit.
    fn push(&mut self, text: &str) -> (String, bool) {
        self.pending.push_str(text);
        if let Some(at) = self.stops.iter().filter(|s| !s.is_empty()).filter_map(|s| self.pending.find(s.as_str())).min() {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Keep the longest suffix that is a prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| (1..s.len().min(self.pending.len() + 1)).rev().filter(move |&k| s.is_char_boundary(k)).map(move |k| &s[..k]))
            .filter(|p| self.pending.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }
}

/// Generates from `prompt` (already tokenized, BOS included if wanted) after
/// whatever the model has cached. `on_text` receives each piece of new text and
/// returns false to stop early.
pub fn generate<B: Backend>(
    model: &mut Model<B>,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    params: &GenerateParams,
    mut on_text: impl FnMut(&str) -> bool,
) -> Result<GenerationStats> {
    if prompt.is_empty() {
        return Err(ModelError::BadHparam { key: "prompt".into(), reason: "the prompt has no tokens".into() });
    }
    let needed = model.n_past() + prompt.len();
    if needed >= model.n_ctx() {
        return Err(ModelError::ContextOverflow { needed: needed + 1, n_ctx: model.n_ctx() });
    }
    let limit = params.n_predict.unwrap_or(usize::MAX);

    let t0 = Instant::now();
    let mut token = model.prompt(prompt, &params.sampling)?;
    let prompt_time = t0.elapsed();

    let t1 = Instant::now();
    let mut decoder = StreamDecoder::new(tokenizer);
    let mut filter = StopFilter { stops: &params.stop, pending: String::new() };
    let mut generated_ids = Vec::new();
    let stop_reason = loop {
        if tokenizer.is_end_of_generation(token) {
            break StopReason::EndOfGeneration;
        }
        generated_ids.push(token);
        let (text, hit) = filter.push(&decoder.push(token));
        if !text.is_empty() && !on_text(&text) {
            break StopReason::Cancelled;
        }
        if hit {
            break StopReason::StopString;
        }
        if generated_ids.len() >= limit {
            break StopReason::TokenLimit;
        }
        if model.n_past() + 1 >= model.n_ctx() {
            break StopReason::ContextFull;
        }
        token = model.decode_sample(token, &params.sampling)?;
    };
    if stop_reason != StopReason::StopString {
        let (text, _) = filter.push(&decoder.finish());
        let rest = text + &filter.pending;
        if !rest.is_empty() {
            on_text(&rest);
        }
    }
    Ok(GenerationStats {
        prompt_tokens: prompt.len(),
        prompt_time,
        generated_tokens: generated_ids.len(),
        generated_ids,
        generation_time: t1.elapsed(),
        stop_reason,
    })
}

#[cfg(test)]
mod tests {
    use super::StopFilter;

    #[test]
    fn stop_filter_holds_back_prefixes_and_cuts_at_stop() {
        let stops = vec!["END".to_string(), "\n\n".to_string()];
        let mut f = StopFilter { stops: &stops, pending: String::new() };
        assert_eq!(f.push("hello E"), ("hello ".to_string(), false));
        assert_eq!(f.push("N"), (String::new(), false));
        assert_eq!(f.push("X world"), ("ENX world".to_string(), false));
        assert_eq!(f.push(" and\n"), (" and".to_string(), false));
        assert_eq!(f.push("\nmore"), (String::new(), true));
    }
}
