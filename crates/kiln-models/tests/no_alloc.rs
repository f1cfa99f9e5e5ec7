//! A decode step on the CPU backend allocates nothing once warmed up: a
//! counting global allocator watches many steps.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use kiln_core::{CpuBackend, SamplingParams};
use kiln_gguf::GgufFile;
use kiln_models::{Model, ModelOptions};

struct Counting;
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
/// The pool being measured; allocations on other threads (the test harness,
/// the other test's pool starting up or shutting down) are not counted.
static MEASURED_POOL: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        System.realloc(ptr, layout, new_size)
    }
}

thread_local! {
    /// The id of the pool this rayon worker belongs to (0 elsewhere).
    static POOL: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

fn count() {
    let pool = POOL.try_with(|p| p.get()).unwrap_or(0);
    if pool != 0 && pool == MEASURED_POOL.load(Ordering::Relaxed) {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn decode_steps_do_not_allocate() {
    // As in `kiln run`, generation runs on a rayon worker thread, so the ops'
    // parallel loops use the worker's own job deque (work injected from a
    // foreign thread goes through rayon's global queue, which allocates a block
    // per 63 jobs). On one worker, every allocation would be kiln's own.
    let allocations = measure(1, 1, 100, &stories());
    assert_eq!(allocations, 0, "{allocations} allocations in 100 decode steps");
}

/// The same for the new layer kinds: experts, sliding windows with sinks (gpt-oss), per-layer
/// embeddings and KV sharing (gemma4), Gated DeltaNet states and a shared expert (qwen35moe).
#[test]
fn decode_steps_of_the_new_architectures_do_not_allocate() {
    for (id, name) in [(3, "tiny-gpt-oss-MXFP4.gguf"), (4, "tiny-gemma4-Q4_K.gguf"), (5, "tiny-qwen35moe-Q8_0.gguf")] {
        let allocations = measure(id, 1, 60, &kiln_testdata::path("archs").join(name));
        assert_eq!(allocations, 0, "{name}: {allocations} allocations in 60 decode steps");
    }
}

fn stories() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/stories260K.gguf")
}

#[test]
fn decode_steps_on_two_workers_allocate_almost_nothing() {
    // With work stealing, rayon's own bookkeeping allocates now and then
    // (seen: 0 to 4 times per 100 steps, never per step); kiln's code adds none.
    let allocations = measure(2, 2, 100, &stories());
    assert!(allocations <= 10, "{allocations} allocations in 100 decode steps");
}

/// Allocations on the workers of a fresh `threads`-thread pool (tagged `id`)
/// during `steps` decode steps run on that pool.
fn measure(id: u64, threads: usize, steps: u64, path: &Path) -> usize {
    // The counter is process-wide: one measurement at a time.
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    pool.broadcast(|_| POOL.with(|p| p.set(id)));
    pool.install(|| decode_loop(id, steps, path))
}

fn decode_loop(id: u64, steps: u64, path: &Path) -> usize {
    let file = Arc::new(GgufFile::open(path).unwrap());
    let options = ModelOptions { n_ctx: Some(256), ..Default::default() };
    let mut model = Model::load(Arc::new(CpuBackend::new()), file, &options).unwrap();
    let sampling = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.05,
        repeat_penalty: 1.1,
        repeat_last_n: 64,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        seed: 5,
    };
    let mut tok = model.prompt(&[1], &sampling).unwrap();
    // Warm-up: thread-local scratch, sampler buffers and the sequence's token vector reach
    // their final size.
    for _ in 1..8 {
        tok = model.decode_sample(tok, &sampling).unwrap();
    }
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    MEASURED_POOL.store(id, Ordering::Relaxed);
    for _ in 8..8 + steps {
        tok = model.decode_sample(tok, &sampling).unwrap();
    }
    MEASURED_POOL.store(0, Ordering::Relaxed);
    ALLOCATIONS.load(Ordering::Relaxed) - before
}
