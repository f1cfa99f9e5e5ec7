//! The device-resident step block: token ids, first position, sampler settings, repetition
//! history, draw counter and the sampled token, as 32-bit words. `write_step` fills a pinned
//! host mirror and sends it with one asynchronous copy, so a captured graph reads each step's
//! values from device memory. The layout is `kernels/step.cuh`'s.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaEvent, CudaGraph, CudaSlice, PinnedHostSlice};
use kiln_core::backend::{BackendError, Result, StepInput};

use crate::CudaDevice;

/// Header word offsets (the `STEP_*` defines of `kernels/step.cuh`).
pub(crate) mod word {
    pub const N_TOKENS: usize = 0;
    pub const POS0: usize = 1;
    pub const N_HISTORY: usize = 2;
    pub const HISTORY_AT: usize = 3;
    pub const SEED_LO: usize = 4;
    pub const SEED_HI: usize = 5;
    pub const DRAW_LO: usize = 6;
    pub const DRAW_HI: usize = 7;
    pub const TEMPERATURE: usize = 8;
    pub const TOP_K: usize = 9;
    pub const TOP_P: usize = 10;
    pub const MIN_P: usize = 11;
    pub const REPEAT_PENALTY: usize = 12;
    pub const REPEAT_LAST_N: usize = 13;
    pub const SAMPLED: usize = 14;
    pub const TOKENS_AT: usize = 16;
}

/// What `run_step` holds for one (step object, key).
pub(crate) enum StepGraph {
    /// Ran once uncaptured, so every lazily loaded kernel and scratch buffer now exists.
    WarmedUp,
    Captured(SendGraph),
}

pub(crate) struct SendGraph(pub CudaGraph);
// SAFETY: a graph is only touched while its map's mutex is held, one thread at a time.
unsafe impl Send for SendGraph {}

/// The backend's recorded steps, keyed by (step object id, run_step key). A graph bakes in the
/// addresses of the buffers its step used, so it belongs to the step object (and the model
/// around it) that recorded it, and goes when that step object is dropped.
pub(crate) type StepGraphs = Arc<Mutex<HashMap<(u64, u64), StepGraph>>>;

pub struct CudaStep {
    /// Unique for the process's lifetime, so a new model never inherits an old one's graphs.
    pub(crate) id: u64,
    graphs: StepGraphs,
    pub(crate) block: CudaSlice<u32>,
    staging: PinnedHostSlice<u32>,
    /// Recorded after each copy out of `staging`, which must not be rewritten before it.
    copied: CudaEvent,
    max_tokens: usize,
    max_history: usize,
    /// Tokens of the last `write_step`, to check ops against.
    pub(crate) n_tokens: usize,
}

fn saturate(value: usize) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}

impl CudaStep {
    pub(crate) fn new(device: &CudaDevice, graphs: &StepGraphs, max_tokens: usize, max_history: usize) -> Result<CudaStep> {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let words = word::TOKENS_AT + max_tokens + max_history;
        if u32::try_from(words).is_err() {
            return Err(BackendError::BatchTooLarge { n_tokens: max_tokens + max_history, capacity: u32::MAX as usize });
        }
        let block = device.alloc_zeros::<u32>(words, "step block").map_err(crate::backend::backend_error)?;
        // SAFETY: every word is written by `write` before the first copy.
        let staging = unsafe { device.context().alloc_pinned::<u32>(words) }
            .map_err(|e| BackendError::Device(format!("allocating {} bytes of pinned memory for the step block: {e:?}", words * 4)))?;
        let copied = device.context().new_event(None).map_err(|e| BackendError::Device(format!("creating the step event: {e:?}")))?;
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        Ok(CudaStep { id, graphs: graphs.clone(), block, staging, copied, max_tokens, max_history, n_tokens: 0 })
    }

    /// Word offset of the token ids, for kernels that take them as a separate pointer.
    pub(crate) fn tokens_at(&self) -> usize {
        word::TOKENS_AT
    }

    pub(crate) fn write(&mut self, device: &CudaDevice, input: &StepInput) -> Result<()> {
        if input.tokens.len() > self.max_tokens {
            return Err(BackendError::BatchTooLarge { n_tokens: input.tokens.len(), capacity: self.max_tokens });
        }
        let history = &input.history[input.history.len().saturating_sub(self.max_history)..];
        let s = input.sampling;
        let history_at = word::TOKENS_AT + self.max_tokens;
        let device_error = |what: &'static str| move |e| BackendError::Device(format!("{what} the step block: {e:?}"));
        // The previous copy may still be queued behind earlier work: wait for it to finish.
        self.copied.synchronize().map_err(device_error("waiting to refill"))?;
        let host = self.staging.as_mut_slice().map_err(device_error("mapping"))?;
        host.fill(0);
        host[word::N_TOKENS] = saturate(input.tokens.len());
        host[word::POS0] = saturate(input.pos0);
        host[word::N_HISTORY] = saturate(history.len());
        host[word::HISTORY_AT] = saturate(history_at);
        host[word::SEED_LO] = s.seed as u32;
        host[word::SEED_HI] = (s.seed >> 32) as u32;
        host[word::DRAW_LO] = input.draw as u32;
        host[word::DRAW_HI] = (input.draw >> 32) as u32;
        host[word::TEMPERATURE] = s.temperature.to_bits();
        host[word::TOP_K] = saturate(s.top_k);
        host[word::TOP_P] = s.top_p.to_bits();
        host[word::MIN_P] = s.min_p.to_bits();
        host[word::REPEAT_PENALTY] = s.repeat_penalty.to_bits();
        host[word::REPEAT_LAST_N] = saturate(s.repeat_last_n);
        host[word::TOKENS_AT..word::TOKENS_AT + input.tokens.len()].copy_from_slice(input.tokens);
        host[history_at..history_at + history.len()].copy_from_slice(history);
        device.stream().memcpy_htod(&self.staging, &mut self.block).map_err(device_error("copying"))?;
        self.copied.record(device.stream()).map_err(device_error("recording the copy of"))?;
        self.n_tokens = input.tokens.len();
        Ok(())
    }

    /// The token the last `sample` stored: one 4-byte copy, then a wait for the stream.
    pub(crate) fn sampled(&self, device: &CudaDevice) -> Result<u32> {
        let mut token = [0u32; 1];
        let slot = self.block.slice(word::SAMPLED..word::SAMPLED + 1);
        device
            .stream()
            .memcpy_dtoh(&slot, &mut token)
            .and_then(|()| device.stream().synchronize())
            .map_err(|e| BackendError::Device(format!("reading the sampled token: {e:?}")))?;
        Ok(token[0])
    }
}

impl Drop for CudaStep {
    fn drop(&mut self) {
        let id = self.id;
        self.graphs.lock().unwrap_or_else(PoisonError::into_inner).retain(|&(step, _), _| step != id);
    }
}

#[cfg(test)]
mod tests {
    use super::word;

    /// The Rust offsets and kernels/step.cuh describe the same layout.
    #[test]
    fn layout_matches_the_kernel_header() {
        let header = include_str!("../kernels/step.cuh");
        let defines: Vec<(&str, usize)> = header
            .lines()
            .filter_map(|line| line.strip_prefix("#define STEP_"))
            .map(|rest| {
                let (name, value) = rest.split_once(' ').expect("#define NAME VALUE");
                (name, value.trim().parse().expect("numeric offset"))
            })
            .collect();
        let rust = [
            ("N_TOKENS", word::N_TOKENS),
            ("POS0", word::POS0),
            ("N_HISTORY", word::N_HISTORY),
            ("HISTORY_AT", word::HISTORY_AT),
            ("SEED_LO", word::SEED_LO),
            ("SEED_HI", word::SEED_HI),
            ("DRAW_LO", word::DRAW_LO),
            ("DRAW_HI", word::DRAW_HI),
            ("TEMPERATURE", word::TEMPERATURE),
            ("TOP_K", word::TOP_K),
            ("TOP_P", word::TOP_P),
            ("MIN_P", word::MIN_P),
            ("REPEAT_PENALTY", word::REPEAT_PENALTY),
            ("REPEAT_LAST_N", word::REPEAT_LAST_N),
            ("SAMPLED", word::SAMPLED),
            ("TOKENS_AT", word::TOKENS_AT),
        ];
        assert_eq!(defines.len(), rust.len(), "step.cuh defines {defines:?}");
        for (name, offset) in rust {
            assert!(defines.contains(&(name, offset)), "STEP_{name} = {offset} is not in step.cuh: {defines:?}");
        }
    }
}
