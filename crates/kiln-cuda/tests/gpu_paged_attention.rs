//! GPU tests of the paged attention kernels (src/paged_attention.rs) against an f64 CPU
//! reference that reads the same cache bytes through the same block tables, plus a benchmark.
//! They need an NVIDIA GPU: run them on the device with scripts/gpu-tests.sh (which passes
//! --include-ignored).
//!
//! Every case uses random caches in every type pair, shuffled physical blocks, several
//! sequences of different lengths per step (1, 31, 32, 33 ... 4096 positions), decode-only and
//! prefill steps (including chunks that continue an existing prefix), GQA groups 1 to 8 and
//! head dims 8, 64, 128, 256 and 512. Outputs are poisoned (NaN) before each run and every one is checked.
//! Each test checks every case and reports all failures at the end.

mod common;
use common::rng;
use std::sync::{OnceLock, PoisonError, RwLock, RwLockReadGuard};

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaSlice;
use half::f16;
use kiln_core::plan::{BatchPlan, FlatPlan, KvType, LogitRows, SeqStep, StepCapacity, KV_BLOCK_SIZE};
use kiln_cuda::kv::KvView;
use kiln_cuda::matvec::{self, QuantizedActivations};
use kiln_cuda::paged_attention::{cache_bytes, AttentionInputs, PagedAttention, PagedAttentionParams, StepCounts};
use kiln_cuda::plan_words::PlanLayout;
use kiln_cuda::{CacheDir, CudaDevice, CudaError, RegistryConfig};
use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// The split kernels compute in f32 on the exact cache values (q8_0 dequantized with its f16
/// scale, f16 widened), with f32 queries: only f32 rounding of the dot products, exp2 and the
/// sums over up to 4096 rows differs from the f64 reference, a relative error of order 1e-6.
/// 1e-4 leaves a wide margin and still catches any wrong row, scale or split, which give
/// errors of order 1e-1.
const SPLIT_TOLERANCE: f64 = 1e-4;
/// The flash kernel rounds Q, the probabilities P and (for f32 and q8_0 caches) K and V to f16
/// for the tensor cores: unit roundoff 2^-11 = 4.9e-4, about 3e-4 rms per value. Scores
/// (|s| around 1) get errors of about 3e-4, the weights as much, and the output, a weighted
/// mean of V, inherits the relative errors of its weights and values: a few 1e-4 relative
/// L2. 2e-3 leaves a 4x margin; a wrong row or mask gives errors above 1e-1.
const FLASH_TOLERANCE: f64 = 2e-3;

fn device() -> &'static CudaDevice {
    static DEVICE: OnceLock<CudaDevice> = OnceLock::new();
    DEVICE.get_or_init(|| {
        CudaDevice::new(0, RegistryConfig { cache_dir: CacheDir::Default, ..Default::default() }).unwrap_or_else(|e| panic!("opening GPU 0 failed: {e}"))
    })
}

/// The tests share one device stream: correctness tests hold this lock shared, the benchmark
/// (which captures the stream into a graph) exclusively, so no launch lands in its capture.
static GPU_USE: RwLock<()> = RwLock::new(());

fn shared_gpu() -> RwLockReadGuard<'static, ()> {
    GPU_USE.read().unwrap_or_else(PoisonError::into_inner)
}

/// The inputs of a call without sinks (the backend tests cover those, gpu_arch_ops.rs).
fn inputs<'a>(q: &'a CudaSlice<f32>, kv: &'a KvView, step: &'a CudaSlice<u32>) -> AttentionInputs<'a> {
    AttentionInputs { q, kv, step, sinks: None, prologue: None }
}

fn attention() -> &'static PagedAttention {
    static ATTENTION: OnceLock<PagedAttention> = OnceLock::new();
    ATTENTION.get_or_init(PagedAttention::new)
}

/// A cache buffer as the kernels read it, and the values it stands for ([rows][width]).
struct HostCache {
    bytes: Vec<u8>,
    values: Vec<f32>,
}

/// `src` ([rows][width]) stored as `ty` (kernels/kv.cuh): f16 rounded to nearest even; q8_0
/// per 32 values of a row as ggml: d = amax / 127, q = round-half-away(x / d), d kept as f16.
fn store_cache(ty: KvType, src: &[f32], rows: usize, width: usize) -> HostCache {
    let mut bytes = vec![0u8; cache_bytes(ty, rows, width)];
    let mut values = vec![0f32; rows * width];
    match ty {
        KvType::F32 => {
            for (i, &x) in src.iter().enumerate() {
                bytes[i * 4..i * 4 + 4].copy_from_slice(&x.to_le_bytes());
                values[i] = x;
            }
        }
        KvType::F16 => {
            for (i, &x) in src.iter().enumerate() {
                let h = f16::from_f32(x);
                bytes[i * 2..i * 2 + 2].copy_from_slice(&h.to_bits().to_le_bytes());
                values[i] = h.to_f32();
            }
        }
        KvType::Q8_0 => {
            let scales_at = (rows * width).div_ceil(16) * 16;
            for (b, block) in src.chunks(32).enumerate() {
                let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
                let d = amax / 127.0;
                let d16 = f16::from_f32(d);
                bytes[scales_at + b * 2..scales_at + b * 2 + 2].copy_from_slice(&d16.to_bits().to_le_bytes());
                for (i, &x) in block.iter().enumerate() {
                    let q = if d == 0.0 { 0i8 } else { (x / d).round() as i8 };
                    bytes[b * 32 + i] = q as u8;
                    values[b * 32 + i] = d16.to_f32() * f32::from(q);
                }
            }
        }
    }
    HostCache { bytes, values }
}

/// One layer's shape and cache types.
#[derive(Clone, Copy, Debug)]
struct Shape {
    head_dim: usize,
    group: usize,
    n_kv_heads: usize,
    k_type: KvType,
    v_type: KvType,
}

impl Shape {
    fn n_heads(&self) -> usize {
        self.group * self.n_kv_heads
    }
    fn width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// A sequence of a step: `n_tokens` fed at positions pos0.. .
#[derive(Clone, Copy, Debug)]
struct Seq {
    pos0: usize,
    n_tokens: usize,
}

/// A flattened step with shuffled physical blocks, its words, and the cache size it needs.
struct Step {
    flat: FlatPlan,
    words: Vec<u32>,
    n_blocks: usize,
}

fn build_step(rng: &mut ChaCha8Rng, seqs: &[Seq]) -> Step {
    let needs: Vec<usize> = seqs.iter().map(|s| (s.pos0 + s.n_tokens).div_ceil(KV_BLOCK_SIZE)).collect();
    // Spare blocks hold random rows no sequence owns: reading one shows up as an error.
    let n_blocks = needs.iter().sum::<usize>() + 7;
    let mut ids: Vec<u32> = (0..n_blocks as u32).collect();
    ids.shuffle(rng);
    let mut tables = Vec::new();
    let mut at = 0;
    for &need in &needs {
        tables.push(ids[at..at + need].to_vec());
        at += need;
    }
    let tokens: Vec<Vec<u32>> = seqs.iter().map(|s| vec![0u32; s.n_tokens]).collect();
    let steps: Vec<SeqStep> = seqs
        .iter()
        .zip(&tokens)
        .zip(&tables)
        .map(|((s, tokens), blocks)| SeqStep { tokens, pos0: s.pos0, blocks, logits: LogitRows::None, sample: None })
        .collect();
    let cap = StepCapacity { tokens: tokens.iter().map(Vec::len).sum(), seqs: seqs.len(), blocks: needs.iter().sum(), logit_rows: 0, history: 0 };
    let mut flat = FlatPlan::default();
    flat.fill(&BatchPlan { seqs: &steps }, &cap, n_blocks).expect("valid plan");
    let layout = PlanLayout::new(cap);
    let mut words = vec![0u32; layout.words];
    layout.write(&flat, &mut words);
    Step { flat, words, n_blocks }
}

/// out[t][h] in f64: softmax over positions 0..=pos of token t's sequence, read through its
/// block table.
fn reference(shape: &Shape, flat: &FlatPlan, q: &[f32], k: &HostCache, v: &HostCache, scale: f64) -> Vec<f64> {
    let (hd, n_heads, width) = (shape.head_dim, shape.n_heads(), shape.width());
    let mut out = vec![0f64; flat.n_tokens() * n_heads * hd];
    let mut scores = Vec::new();
    for t in 0..flat.n_tokens() {
        let (seq, pos) = (flat.token_seq[t] as usize, flat.positions[t] as usize);
        let rows: Vec<usize> = (0..=pos).map(|p| flat.row_of(seq, p)).collect();
        for h in 0..n_heads {
            let col = h / shape.group * hd;
            let qh = &q[(t * n_heads + h) * hd..][..hd];
            scores.clear();
            for &row in &rows {
                let kr = &k.values[row * width + col..][..hd];
                scores.push(qh.iter().zip(kr).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum::<f64>() * scale);
            }
            let max = scores.iter().fold(f64::NEG_INFINITY, |m, &s| m.max(s));
            let o = &mut out[(t * n_heads + h) * hd..][..hd];
            let mut sum = 0f64;
            for (&s, &row) in scores.iter().zip(&rows) {
                let w = (s - max).exp();
                sum += w;
                for (od, &vd) in o.iter_mut().zip(&v.values[row * width + col..][..hd]) {
                    *od += w * f64::from(vd);
                }
            }
            o.iter_mut().for_each(|x| *x /= sum);
        }
    }
    out
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Path {
    /// `attention`, which picks the kernel from the step's counts.
    Auto,
    /// The split kernels with this many splits (None: the automatic count).
    Split(Option<usize>),
    /// The same also storing the output as a product's int8 input (`attention_quantized`).
    SplitQuantized(Option<usize>),
    Prefill,
}

/// `attention_quantized` (decode steps: the split kernels) into a fresh buffer: where a head is whole chunks of 16 values its codes
/// and scales must equal what `quantize_activations` makes of the output it wrote (the same
/// quantize_chunk on the same f32 values); elsewhere it must refuse, and `split` runs instead.
fn split_quantized(
    dev: &CudaDevice,
    inputs: AttentionInputs,
    out: &mut CudaSlice<f32>,
    counts: StepCounts,
    p: &PagedAttentionParams,
    n_splits: Option<usize>,
) -> Result<(), String> {
    let fail = |e: CudaError| e.to_string();
    let (n, cols) = (counts.n_tokens, p.n_heads * p.head_dim);
    let whole_chunks = p.head_dim.is_multiple_of(16);
    let buffer = QuantizedActivations::new(dev, n + 3, cols.div_ceil(16) * 16).map_err(fail)?;
    let target = buffer.target(dev);
    let att = attention();
    if cols % 16 != 0 {
        // No quantized buffer takes these rows; the call is refused on the head size anyway.
        return att.split(dev, inputs, out, counts, p, n_splits, None).map_err(fail);
    }
    match att.attention_quantized(dev, inputs, out, counts, p, n_splits, target).map_err(fail)? {
        true if !whole_chunks => Err(format!("heads of {} values were quantized in place", p.head_dim)),
        false if whole_chunks => Err("split_quantized refused heads of whole chunks".into()),
        false => att.split(dev, inputs, out, counts, p, n_splits, None).map_err(fail),
        true => {
            buffer.mark_filled(n);
            let got = buffer.download(dev, n).map_err(fail)?;
            let mut again = QuantizedActivations::new(dev, n, cols).map_err(fail)?;
            matvec::quantize_activations(dev, out, n, &mut again).map_err(fail)?;
            let want = again.download(dev, n).map_err(fail)?;
            if let Some(i) = (0..got.0.len()).find(|&i| got.0[i] != want.0[i]) {
                return Err(format!("int8 code {i} is {}, quantizing the output gives {}", got.0[i], want.0[i]));
            }
            match (0..got.1.len()).find(|&i| got.1[i] != want.1[i]) {
                Some(i) => Err(format!("chunk {i}'s scales are {:?}, quantizing the output gives {:?}", got.1[i], want.1[i])),
                None => Ok(()),
            }
        }
    }
}

/// Runs one step on the GPU and returns (relative L2 error, tolerance), or why it failed.
fn run_case(rng: &mut ChaCha8Rng, shape: &Shape, seqs: &[Seq], path: Path) -> Result<(f64, f64), String> {
    let step = build_step(rng, seqs);
    let rows = step.n_blocks * KV_BLOCK_SIZE;
    let width = shape.width();
    let random = |rng: &mut ChaCha8Rng, len: usize, amplitude: f32| -> Vec<f32> { (0..len).map(|_| rng.gen_range(-amplitude..amplitude)).collect() };
    let k = store_cache(shape.k_type, &random(rng, rows * width, 1.0), rows, width);
    let v = store_cache(shape.v_type, &random(rng, rows * width, 1.0), rows, width);
    let n = step.flat.n_tokens();
    let q_len = n * shape.n_heads() * shape.head_dim;
    // Queries of amplitude 2 make the softmax peaked enough that a wrong score shows.
    let q = random(rng, q_len, 2.0);
    let scale = 1.0 / (shape.head_dim as f32).sqrt();
    let p = PagedAttentionParams {
        n_heads: shape.n_heads(),
        n_kv_heads: shape.n_kv_heads,
        head_dim: shape.head_dim,
        rows,
        max_seq_len: 8192,
        scale,
        k_type: shape.k_type,
        v_type: shape.v_type,
        window: None,
    };
    let counts = StepCounts { n_tokens: n, n_tiles: step.flat.tiles.len(), decode_only: seqs.iter().all(|s| s.n_tokens == 1) };
    let dev = device();
    let fail = |e: CudaError| e.to_string();
    let q_gpu = dev.upload(&q, "q").map_err(fail)?;
    let k_gpu = dev.upload(&k.bytes, "k cache").map_err(fail)?;
    let v_gpu = dev.upload(&v.bytes, "v cache").map_err(fail)?;
    let step_gpu = dev.upload(&step.words, "step").map_err(fail)?;
    let kv = KvView::of_slices(dev.stream(), &k_gpu, &v_gpu);
    let mut out = dev.alloc_poisoned::<f32>(q_len, "out").map_err(fail)?;
    let att = attention();
    match path {
        Path::Auto => att.attention(dev, inputs(&q_gpu, &kv, &step_gpu), &mut out, counts, &p),
        Path::Split(n_splits) => att.split(dev, inputs(&q_gpu, &kv, &step_gpu), &mut out, counts, &p, n_splits, None),
        Path::SplitQuantized(n_splits) => {
            split_quantized(dev, inputs(&q_gpu, &kv, &step_gpu), &mut out, counts, &p, n_splits)?;
            Ok(())
        }
        Path::Prefill => att.prefill(dev, inputs(&q_gpu, &kv, &step_gpu), &mut out, counts, &p),
    }
    .map_err(fail)?;
    let got = dev.download(&out).map_err(fail)?;
    let want = reference(shape, &step.flat, &q, &k, &v, f64::from(scale));
    if let Some(i) = got.iter().position(|x| !x.is_finite()) {
        let hd = shape.head_dim;
        return Err(format!("output {i} (token {}, head {}, dim {}) is {} (not written?)", i / hd / shape.n_heads(), i / hd % shape.n_heads(), i % hd, got[i]));
    }
    let (mut err, mut norm) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(&want) {
        err += (f64::from(g) - w).powi(2);
        norm += w * w;
    }
    // Flash steps where prefill ran use the f16 tolerance; decode-only Auto runs the split path.
    let flash = path == Path::Prefill || (path == Path::Auto && !counts.decode_only && counts.n_tiles > 0);
    Ok(((err / norm.max(1e-300)).sqrt(), if flash { FLASH_TOLERANCE } else { SPLIT_TOLERANCE }))
}

fn all_type_pairs() -> Vec<(KvType, KvType)> {
    KvType::ALL.iter().flat_map(|&k| KvType::ALL.iter().map(move |&v| (k, v))).collect()
}

fn shapes() -> Vec<Shape> {
    let shape = |head_dim, group, n_kv_heads, (k_type, v_type)| Shape { head_dim, group, n_kv_heads, k_type, v_type };
    let mut shapes: Vec<Shape> = all_type_pairs().into_iter().map(|types| shape(64, 2, 2, types)).collect();
    shapes.extend([
        shape(128, 4, 2, (KvType::F16, KvType::F16)),
        // The tensor-core decode kernel's widest group and an odd one with five k steps.
        shape(128, 8, 1, (KvType::F16, KvType::F16)),
        shape(80, 7, 1, (KvType::F16, KvType::F16)),
        // Two 64 KiB decode stages (f32 rows of 1 KiB) instead of three.
        shape(256, 2, 1, (KvType::F32, KvType::F16)),
        // Gemma 4's global layers: heads of 512 values, 8 query heads a kv head.
        shape(512, 8, 1, (KvType::F16, KvType::F16)),
        shape(512, 2, 2, (KvType::Q8_0, KvType::F16)),
        shape(128, 8, 1, (KvType::Q8_0, KvType::Q8_0)),
        shape(128, 1, 3, (KvType::F32, KvType::F16)),
        shape(128, 2, 2, (KvType::Q8_0, KvType::F16)),
        shape(64, 4, 2, (KvType::F16, KvType::F16)),
        shape(64, 8, 1, (KvType::F16, KvType::Q8_0)),
        shape(64, 1, 2, (KvType::Q8_0, KvType::F32)),
        shape(8, 2, 4, (KvType::F16, KvType::F16)),
        shape(8, 2, 4, (KvType::F32, KvType::Q8_0)),
        shape(8, 1, 4, (KvType::Q8_0, KvType::F32)),
    ]);
    shapes
}

fn decode(lens: &[usize]) -> Vec<Seq> {
    lens.iter().map(|&len| Seq { pos0: len - 1, n_tokens: 1 }).collect()
}

fn report(test: &str, cases: usize, failures: Vec<String>) {
    eprintln!("{test}: {cases} cases, {} failed", failures.len());
    assert!(failures.is_empty(), "{test}: {} of {cases} cases failed:\n{}", failures.len(), failures.join("\n"));
}

fn check_all(test: &str, rng: &mut ChaCha8Rng, cases: &[(Shape, Vec<Seq>, Path)]) {
    let mut failures = Vec::new();
    for (shape, seqs, path) in cases {
        let lens: Vec<String> = seqs.iter().map(|s| format!("{}+{}", s.pos0, s.n_tokens)).collect();
        let what = format!("{shape:?} {path:?} seqs [{}]", lens.join(" "));
        match run_case(rng, shape, seqs, *path) {
            Ok((err, tolerance)) if err <= tolerance => eprintln!("ok   {what}: rel L2 {err:.2e}"),
            Ok((err, tolerance)) => failures.push(format!("{what}: rel L2 {err:.3e} > {tolerance:.0e}")),
            Err(why) => failures.push(format!("{what}: {why}")),
        }
    }
    report(test, cases.len(), failures);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn decode_steps_match_the_reference() {
    let _gpu = shared_gpu();
    let mut rng = rng("decode_steps_match_the_reference");
    let mut cases = Vec::new();
    for shape in shapes() {
        let seqs = decode(&[1, 31, 32, 33, 1000, 4096]);
        // 128 and 256 splits cut 4096 positions into the smallest chunks (one block on CUDA
        // cores, eight on tensor cores); 3 and 5 leave partial last tiles in every split. Spans
        // shorter than one chunk (1, 31, 32, 33 with several splits) have one live split, which
        // writes its output without the merge.
        for path in [Path::Auto, Path::Split(Some(1)), Path::Split(Some(3)), Path::Split(Some(5)), Path::Split(Some(128)), Path::Split(Some(256))] {
            cases.push((shape, seqs.clone(), path));
        }
        // One sequence alone uses many splits (the measured count), down to one block each.
        cases.push((shape, decode(&[4096]), Path::Auto));
        cases.push((shape, decode(&[33]), Path::Auto));
        cases.push((shape, decode(&[65, 96]), Path::Split(Some(66))));
        // More (token, kv head) pairs than any GPU has multiprocessors: the tensor-core kernel's
        // narrow blocks instead of its wide ones.
        let many: Vec<usize> = (0..300).map(|i| 1 + i * 37 % 700).collect();
        cases.push((shape, decode(&many), Path::Auto));
        // The output also as int8: written by the single split, by the merging block, with
        // fewer tokens than the buffer holds.
        for path in [Path::SplitQuantized(Some(1)), Path::SplitQuantized(Some(5)), Path::SplitQuantized(None)] {
            cases.push((shape, decode(&[1, 33, 1000, 4096]), path));
        }
    }
    check_all("decode_steps_match_the_reference", &mut rng, &cases);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn measured_split_counts_are_fixed_per_grid() {
    let _gpu = shared_gpu();
    let mut rng = rng("measured_split_counts_are_fixed_per_grid");
    let shape = Shape { head_dim: 128, group: 4, n_kv_heads: 2, k_type: KvType::F16, v_type: KvType::F16 };
    let mut failures = Vec::new();
    for lens in [vec![1000], vec![7, 2048, 300]] {
        // The first automatic call times the candidates; later ones, at any depth, reuse the count.
        let mut seen = None;
        for scale in [1, 2, 4] {
            let seqs = decode(&lens.iter().map(|&l| l * scale).collect::<Vec<_>>());
            match run_case(&mut rng, &shape, &seqs, Path::Auto) {
                Ok((err, tolerance)) if err <= tolerance => {}
                Ok((err, _)) => failures.push(format!("{lens:?} x{scale}: rel L2 {err:.3e}")),
                Err(why) => failures.push(format!("{lens:?} x{scale}: {why}")),
            }
            let p = PagedAttentionParams {
                n_heads: shape.n_heads(),
                n_kv_heads: shape.n_kv_heads,
                head_dim: shape.head_dim,
                rows: 0,
                max_seq_len: 8192,
                scale: 0.0,
                k_type: shape.k_type,
                v_type: shape.v_type,
                window: None,
            };
            let choice = attention().split_choice(lens.len(), &p).expect("an automatic call fixes the split count");
            eprintln!("{} tokens: {} splits from {:?} at {} positions", lens.len(), choice.n_splits, choice.timings, choice.timed_positions);
            if choice.timings.len() > 1 && !choice.timings.iter().any(|&(n, _)| n == choice.n_splits) {
                failures.push(format!("{lens:?}: chose {} splits, not a candidate of {:?}", choice.n_splits, choice.timings));
            }
            if *seen.get_or_insert(choice.n_splits) != choice.n_splits {
                failures.push(format!("{lens:?}: the split count changed to {}", choice.n_splits));
            }
        }
    }
    report("measured_split_counts_are_fixed_per_grid", 6, failures);
}

/// Prefill chunks from position 0 and continuing a prefix, partial and full tiles, tiles
/// straddling KV blocks, and a decode token in the same step.
fn prefill_mix() -> Vec<Seq> {
    [(0, 1), (0, 31), (0, 33), (0, 64), (0, 65), (5, 40), (100, 70), (31, 64), (1000, 1), (32, 128)]
        .iter()
        .map(|&(pos0, n_tokens)| Seq { pos0, n_tokens })
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn prefill_steps_match_the_reference() {
    let _gpu = shared_gpu();
    let mut rng = rng("prefill_steps_match_the_reference");
    let mut cases = Vec::new();
    for shape in shapes() {
        for path in [Path::Auto, Path::Prefill, Path::Split(None)] {
            cases.push((shape, prefill_mix(), path));
        }
    }
    // Long prompts from 0 and a chunk continuing at depth, for the main shapes.
    for shape in shapes().into_iter().filter(|s| s.head_dim == 128 || s.k_type == s.v_type) {
        let long = vec![Seq { pos0: 0, n_tokens: 1000 }, Seq { pos0: 3000, n_tokens: 96 }];
        cases.push((shape, long.clone(), Path::Prefill));
        cases.push((shape, long, Path::Split(None)));
    }
    check_all("prefill_steps_match_the_reference", &mut rng, &cases);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn bad_shapes_are_typed_errors() {
    let _gpu = shared_gpu();
    let dev = device();
    let step = build_step(&mut rng("bad_shapes"), &decode(&[40]));
    let step_gpu = dev.upload(&step.words, "step").expect("upload");
    let rows = step.n_blocks * KV_BLOCK_SIZE;
    let p = PagedAttentionParams {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        rows,
        max_seq_len: 64,
        scale: 0.125,
        k_type: KvType::F16,
        v_type: KvType::Q8_0,
        window: None,
    };
    let k = dev.alloc_zeros::<u8>(cache_bytes(KvType::F16, rows, 128), "k").expect("alloc");
    let v = dev.alloc_zeros::<u8>(cache_bytes(KvType::Q8_0, rows, 128), "v").expect("alloc");
    let kv = KvView::of_slices(dev.stream(), &k, &v);
    let q = dev.alloc_zeros::<f32>(4 * 64, "q").expect("alloc");
    let mut out = dev.alloc_zeros::<f32>(4 * 64, "out").expect("alloc");
    let counts = StepCounts { n_tokens: 1, n_tiles: 1, decode_only: true };
    let att = attention();
    att.attention(dev, inputs(&q, &kv, &step_gpu), &mut out, counts, &p).expect("valid call");
    let invalid = |result: Result<(), CudaError>, what: &str| match result {
        Err(CudaError::InvalidArgument { reason, .. }) => eprintln!("{what}: {reason}"),
        other => panic!("{what}: expected InvalidArgument, got {other:?}"),
    };
    invalid(att.attention(dev, inputs(&q, &kv, &step_gpu), &mut out, counts, &PagedAttentionParams { n_kv_heads: 3, ..p }), "uneven heads");
    invalid(att.attention(dev, inputs(&q, &kv, &step_gpu), &mut out, counts, &PagedAttentionParams { rows: rows + 32, ..p }), "cache too small");
    invalid(att.attention(dev, inputs(&q, &kv, &step_gpu), &mut out, StepCounts { n_tokens: 2, ..counts }, &p), "query too short");
    invalid(att.split(dev, inputs(&q, &kv, &step_gpu), &mut out, counts, &p, Some(0), None), "zero splits");
    invalid(att.prefill(dev, inputs(&q, &kv, &step_gpu), &mut out, StepCounts { n_tiles: 0, ..counts }, &p), "prefill without tiles");
}

/// Mean milliseconds of `launch` over `rounds` calls (after two warm-up calls), by CUDA events.
fn time_ms(rounds: usize, mut launch: impl FnMut(usize)) -> f64 {
    let ctx = device().context();
    let (start, end) =
        (ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).expect("event"), ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).expect("event"));
    launch(0);
    launch(1);
    start.record(device().stream()).expect("record");
    for round in 0..rounds {
        launch(round);
    }
    end.record(device().stream()).expect("record");
    end.synchronize().expect("sync");
    f64::from(start.elapsed_ms(&end).expect("elapsed")) / rounds as f64
}

/// Step words for `seqs`, with sequence i owning blocks i * blocks_per_seq.. (no shuffling:
/// the benchmark measures the kernels, not the block order).
fn bench_step(seqs: &[Seq], first_block: usize, blocks_per_seq: usize) -> (Vec<u32>, usize) {
    let tables: Vec<Vec<u32>> =
        (0..seqs.len()).map(|i| ((first_block + i) * blocks_per_seq..(first_block + i + 1) * blocks_per_seq).map(|b| b as u32).collect()).collect();
    let tokens: Vec<Vec<u32>> = seqs.iter().map(|s| vec![0u32; s.n_tokens]).collect();
    let steps: Vec<SeqStep> = seqs
        .iter()
        .zip(&tokens)
        .zip(&tables)
        .map(|((s, tokens), blocks)| SeqStep { tokens, pos0: s.pos0, blocks, logits: LogitRows::None, sample: None })
        .collect();
    let cap = StepCapacity { tokens: tokens.iter().map(Vec::len).sum(), seqs: seqs.len(), blocks: seqs.len() * blocks_per_seq, logit_rows: 0, history: 0 };
    let mut flat = FlatPlan::default();
    flat.fill(&BatchPlan { seqs: &steps }, &cap, usize::MAX).expect("valid plan");
    let layout = PlanLayout::new(cap);
    let mut words = vec![0u32; layout.words];
    layout.write(&flat, &mut words);
    (words, flat.tiles.len())
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn benchmark_paged_attention() {
    let _gpu = GPU_USE.write().unwrap_or_else(PoisonError::into_inner);
    const LEN: usize = 8192;
    const SEQS: usize = 64;
    let dev = device();
    let blocks_per_seq = LEN / KV_BLOCK_SIZE;
    let rows = SEQS * LEN;
    let p = PagedAttentionParams {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        rows,
        max_seq_len: LEN,
        scale: 0.088,
        k_type: KvType::F16,
        v_type: KvType::F16,
        window: None,
    };
    let width = p.n_kv_heads * p.head_dim;
    // Contents do not change the speed; zeros are quick to make.
    let k: CudaSlice<u8> = dev.alloc_zeros(cache_bytes(p.k_type, rows, width), "k").expect("alloc");
    let v: CudaSlice<u8> = dev.alloc_zeros(cache_bytes(p.v_type, rows, width), "v").expect("alloc");
    let kv = KvView::of_slices(dev.stream(), &k, &v);
    let q: CudaSlice<f32> = dev.alloc_zeros(4096 * p.n_heads * p.head_dim, "q").expect("alloc");
    let mut out: CudaSlice<f32> = dev.alloc_zeros(4096 * p.n_heads * p.head_dim, "out").expect("alloc");
    let att = attention();

    for n_seqs in [1, SEQS] {
        // Steps over different sequences in turn, so the caches come from memory, not from L2.
        let variants: Vec<Vec<u32>> = (0..SEQS / n_seqs).map(|i| bench_step(&decode(&vec![LEN; n_seqs]), i * n_seqs, blocks_per_seq).0).collect();
        let steps: Vec<CudaSlice<u32>> = variants.iter().map(|w| dev.upload(w, "step").expect("upload")).collect();
        let counts = StepCounts { n_tokens: n_seqs, n_tiles: n_seqs, decode_only: true };
        let bytes = (n_seqs * LEN * width * 2 * 2) as f64;
        let rate = |ms: f64| format!("{:.1} us, {:.0} GB/s", ms * 1e3, bytes / (ms * 1e-3) / 1e9);
        // Every split count the tuner did not pick, then the picked one (the first automatic call picks it).
        att.attention(dev, inputs(&q, &kv, &steps[0]), &mut out, counts, &p).expect("attention");
        let choice = att.split_choice(n_seqs, &p).expect("split choice");
        for &(n, tuned_ms) in &choice.timings {
            let ms = time_ms(20, |round| att.split(dev, inputs(&q, &kv, &steps[round % steps.len()]), &mut out, counts, &p, Some(n), None).expect("split"));
            eprintln!("  decode {n_seqs:>2} x {LEN}, {n:>3} splits: {} (tuner: {:.1} us)", rate(ms), tuned_ms * 1e3);
        }
        let ms = time_ms(50, |round| att.attention(dev, inputs(&q, &kv, &steps[round % steps.len()]), &mut out, counts, &p).expect("attention"));
        eprintln!("decode {n_seqs:>2} x {LEN} positions, 32/8 heads of 128, f16 cache, {} splits: {}", choice.n_splits, rate(ms));
        // As the engine runs it: replays of a captured graph, with no launch gaps from the host.
        let stream = dev.stream();
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).expect("begin capture");
        for step in &steps {
            att.attention(dev, inputs(&q, &kv, step), &mut out, counts, &p).expect("attention");
        }
        let graph = stream.end_capture(CUgraphInstantiate_flags(0)).expect("end capture").expect("a graph");
        let ms = time_ms(10, |_| graph.launch().expect("graph launch")) / steps.len() as f64;
        eprintln!("decode {n_seqs:>2} x {LEN} positions in a CUDA graph: {}", rate(ms));
    }

    for depth in [0, 4096] {
        let n = 4096;
        let (words, n_tiles) = bench_step(&[Seq { pos0: depth, n_tokens: n }], 0, blocks_per_seq);
        let step = dev.upload(&words, "step").expect("upload");
        let counts = StepCounts { n_tokens: n, n_tiles, decode_only: false };
        let ms = time_ms(10, |_| att.attention(dev, inputs(&q, &kv, &step), &mut out, counts, &p).expect("attention"));
        // Q K^T and P V: 2 * 2 * head_dim flops per (query head, visible position).
        let visible: usize = (depth + 1..=depth + n).sum();
        let flops = 4.0 * (p.n_heads * p.head_dim) as f64 * visible as f64;
        eprintln!("prefill {n} tokens at depth {depth}, 32/8 heads of 128, f16 cache: {ms:.3} ms, {:.1} TFLOP/s", flops / (ms * 1e-3) / 1e12);
    }
}
