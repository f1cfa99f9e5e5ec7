//! The device-resident step block: the step's [`FlatPlan`] as 32-bit words (`plan_words`,
//! `kernels/plan.cuh`) and the sampled tokens. `write` fills a pinned host mirror and sends it
//! with one asynchronous copy, so a captured graph reads each step's values from device memory.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::sys::CUstreamCaptureMode;
use cudarc::driver::{CudaEvent, CudaSlice, PinnedHostSlice};
use kiln_core::backend::{BackendError, Result};
use kiln_core::plan::{FlatPlan, StepCapacity};

use crate::graph::{StepGraphExec, StepProfile};
use crate::plan_words::PlanLayout;
use crate::step_clock::StepClock;
use crate::CudaDevice;

/// What `run_step` holds for one (step object, key).
pub(crate) enum StepGraph {
    /// Ran once uncaptured, so every lazily loaded kernel and scratch buffer now exists.
    WarmedUp,
    Captured(StepGraphExec),
}

/// The backend's recorded steps, keyed by (step object id, run_step key). A graph bakes in the
/// addresses of the buffers its step used, so it belongs to the step object (and the model
/// around it) that recorded it, and goes when that step object is dropped.
pub(crate) type StepGraphs = Arc<Mutex<HashMap<(u64, u64), StepGraph>>>;

/// Runs the steps as graphs: per key of the step object written last, the first call runs
/// `record` directly, so lazily loaded kernels and scratch buffers are created outside any
/// capture; the second captures `record` into a graph and launches it; later calls launch the
/// graph only. Counts the programmatic edges of what it captured and, once asked, profiles each
/// graph at its first replay.
#[derive(Default)]
pub(crate) struct StepGraphRunner {
    pub(crate) graphs: StepGraphs,
    /// Id of the step object written last.
    current_step: AtomicU64,
    /// Kernel-to-kernel edges made programmatic in the graphs captured so far.
    overlapped_edges: AtomicUsize,
    profile_graphs: AtomicBool,
    profiles: Mutex<Vec<StepProfile>>,
}

impl StepGraphRunner {
    /// The step object whose graphs `run` records and replays from now on.
    pub(crate) fn set_current(&self, step_id: u64) {
        self.current_step.store(step_id, Ordering::Relaxed);
    }

    pub(crate) fn overlapped_edges(&self) -> usize {
        self.overlapped_edges.load(Ordering::Relaxed)
    }

    /// From now on, profile every graph once, at its first replay.
    pub(crate) fn profile(&self) {
        self.profile_graphs.store(true, Ordering::Relaxed);
    }

    pub(crate) fn profiles(&self) -> Vec<StepProfile> {
        self.profiles.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    pub(crate) fn run(&self, device: &CudaDevice, key: u64, record: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let slot = (self.current_step.load(Ordering::Relaxed), key);
        let mut graphs = self.graphs.lock().unwrap_or_else(PoisonError::into_inner);
        let stream = device.stream();
        let graph_error = |what: &'static str| move |e| BackendError::Device(format!("{what} the graph of step {key}: {e:?}"));
        match graphs.get(&slot) {
            None => {
                record()?;
                graphs.insert(slot, StepGraph::WarmedUp);
            }
            Some(StepGraph::WarmedUp) => {
                stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(graph_error("starting the capture of"))?;
                let recorded = record();
                // The capture always ends, so a failed record leaves the stream usable.
                let registry = device.registry();
                let captured = StepGraphExec::end_capture(stream, &|function| registry.waits_for_inputs(function));
                recorded?;
                let (graph, overlapped) =
                    captured.map_err(graph_error("capturing"))?.ok_or_else(|| BackendError::Device(format!("step {key} recorded no work to capture")))?;
                self.overlapped_edges.fetch_add(overlapped, Ordering::Relaxed);
                tracing::debug!(key, overlapped, "step graph captured");
                graph.launch().map_err(graph_error("launching"))?;
                graphs.insert(slot, StepGraph::Captured(graph));
            }
            Some(StepGraph::Captured(graph)) => {
                graph.launch().map_err(graph_error("launching"))?;
                if self.profile_graphs.load(Ordering::Relaxed) {
                    let mut profiles = self.profiles.lock().unwrap_or_else(PoisonError::into_inner);
                    if !profiles.iter().any(|p| p.slot == slot) {
                        let nodes = graph.profile_nodes().map_err(graph_error("profiling"))?;
                        profiles.push(StepProfile { slot, key, nodes });
                    }
                }
            }
        }
        Ok(())
    }
}

pub struct CudaStep {
    /// Unique for the process's lifetime, so a new model never inherits an old one's graphs.
    pub(crate) id: u64,
    graphs: StepGraphs,
    pub(crate) block: CudaSlice<u32>,
    /// The sampler's per-sample best (value, id) key and count of finished parts, zero
    /// between launches (sampling.cu).
    pub(crate) sample_keys: CudaSlice<u64>,
    pub(crate) sample_tickets: CudaSlice<u32>,
    /// Each sample's top-k candidates, by part of its row (sampling.cu's MERGE_CAP a sample).
    pub(crate) sample_part_keys: CudaSlice<u64>,
    staging: PinnedHostSlice<u32>,
    /// Recorded after each copy out of `staging`, which must not be rewritten before it.
    copied: CudaEvent,
    pub(crate) layout: PlanLayout,
    cache_blocks: usize,
    /// Counts of the last `write`, to size launches and check ops against.
    pub(crate) n_tokens: usize,
    pub(crate) n_seqs: usize,
    pub(crate) n_logit_rows: usize,
    pub(crate) n_samples: usize,
    pub(crate) n_tiles: usize,
    pub(crate) decode_only: bool,
    /// One past the highest block the plan reads (`FlatPlan::blocks_end`).
    pub(crate) blocks_end: usize,
    /// The widest window the plan's block tables cover (`FlatPlan::widest_window`).
    pub(crate) widest_window: Option<u32>,
}

impl CudaStep {
    pub(crate) fn new(device: &CudaDevice, graphs: &StepGraphs, capacity: &StepCapacity, cache_blocks: usize) -> Result<CudaStep> {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let layout = PlanLayout::new(*capacity);
        if u32::try_from(layout.words).is_err() {
            return Err(BackendError::PlanTooLarge { what: "step words".into(), need: layout.words, capacity: u32::MAX as usize });
        }
        let block = device.alloc_zeros::<u32>(layout.words, "step block").map_err(crate::backend::backend_error)?;
        let samples = capacity.seqs.max(1);
        let sample_keys = device.alloc_zeros::<u64>(samples, "sampler keys").map_err(crate::backend::backend_error)?;
        let sample_tickets = device.alloc_zeros::<u32>(samples, "sampler tickets").map_err(crate::backend::backend_error)?;
        let sample_part_keys =
            device.alloc_zeros::<u64>(samples * crate::backend::SAMPLE_MERGE_CAP, "sampler top-k candidates").map_err(crate::backend::backend_error)?;
        // SAFETY: zeroed below before the first copy.
        let mut staging = unsafe { device.context().alloc_pinned::<u32>(layout.words) }
            .map_err(|e| BackendError::Device(format!("allocating {} bytes of pinned memory for the step block: {e:?}", layout.words * 4)))?;
        staging.as_mut_slice().map_err(|e| BackendError::Device(format!("mapping the step block: {e:?}")))?.fill(0);
        let copied = device.context().new_event(None).map_err(|e| BackendError::Device(format!("creating the step event: {e:?}")))?;
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        Ok(CudaStep {
            id,
            graphs: graphs.clone(),
            block,
            sample_keys,
            sample_tickets,
            sample_part_keys,
            staging,
            copied,
            layout,
            cache_blocks,
            n_tokens: 0,
            n_seqs: 0,
            n_logit_rows: 0,
            n_samples: 0,
            n_tiles: 0,
            decode_only: false,
            blocks_end: 0,
            widest_window: None,
        })
    }

    pub(crate) fn write(&mut self, device: &CudaDevice, plan: &FlatPlan) -> Result<()> {
        plan.check_fits(&self.layout.capacity, self.cache_blocks)?;
        let device_error = |what: &'static str| move |e| BackendError::Device(format!("{what} the step block: {e:?}"));
        // The previous copy may still be queued behind earlier work: wait for it to finish.
        self.copied.synchronize().map_err(device_error("waiting to refill"))?;
        let host = self.staging.as_mut_slice().map_err(device_error("mapping"))?;
        self.layout.write(plan, host);
        device.stream().memcpy_htod(&self.staging, &mut self.block).map_err(device_error("copying"))?;
        self.copied.record(device.stream()).map_err(device_error("recording the copy of"))?;
        self.n_tokens = plan.n_tokens();
        self.n_seqs = plan.seqs.len();
        self.n_logit_rows = plan.logit_rows.len();
        self.n_samples = plan.samples.len();
        self.n_tiles = plan.tiles.len();
        self.decode_only = plan.is_decode_only();
        self.blocks_end = plan.blocks_end as usize;
        self.widest_window = plan.widest_window;
        Ok(())
    }

    /// Refuses a step that would read or write blocks of `cache` with no memory behind them
    /// (a fault there would poison the whole context).
    pub(crate) fn check_usable(&self, cache: &crate::kv::CudaKvCache) -> Result<()> {
        if self.blocks_end > cache.usable_blocks() {
            return Err(BackendError::BadPlan(format!(
                "the step reads block {} but only {} blocks of the cache have memory (grow_kv first)",
                self.blocks_end - 1,
                cache.usable_blocks()
            )));
        }
        Ok(())
    }

    /// The token ids of the step, for kernels that take them as a separate pointer.
    pub(crate) fn tokens(&self) -> cudarc::driver::CudaView<'_, u32> {
        self.block.slice(self.layout.tokens_at..self.layout.tokens_at + self.layout.capacity.tokens.max(1))
    }

    /// The tokens the last `sample` stored: one copy, then a wait for the stream; `clock`
    /// times the step on the device.
    pub(crate) fn sampled(&self, device: &CudaDevice, out: &mut [u32], clock: Option<&mut StepClock>) -> Result<()> {
        if out.len() > self.n_samples {
            return Err(BackendError::Device(format!("{} sampled tokens asked for, the step sampled {}", out.len(), self.n_samples)));
        }
        if out.is_empty() {
            return Ok(());
        }
        let at = self.layout.sampled_at;
        let slot = self.block.slice(at..at + out.len());
        let stream = device.stream();
        let read = |e| BackendError::Device(format!("reading the sampled tokens: {e:?}"));
        stream.memcpy_dtoh(&slot, out).map_err(read)?;
        match clock {
            Some(clock) => {
                let timing = |e| BackendError::Device(format!("timing the step: {e:?}"));
                clock.step_sampled(stream).map_err(timing)?;
                stream.synchronize().map_err(read)?;
                clock.step_done().map_err(timing)
            }
            None => stream.synchronize().map_err(read),
        }
    }
}

impl Drop for CudaStep {
    fn drop(&mut self) {
        let id = self.id;
        self.graphs.lock().unwrap_or_else(PoisonError::into_inner).retain(|&(step, _), _| step != id);
    }
}
