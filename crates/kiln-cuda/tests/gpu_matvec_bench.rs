//! Benchmarks of the weight products on Llama-3-8B's shapes (src/matvec.rs): the mat-vec's
//! weight bandwidth and the mat-mat's throughput, printed as tables. They need an NVIDIA GPU:
//! run them on the device with scripts/gpu-tests.sh (which passes --include-ignored).

mod common;
mod matvec_support;
use common::rng;
use matvec_support::*;

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use kiln_core::WeightSource;
use kiln_cuda::matvec::{self, QuantizedActivations};
use kiln_quant::GgmlType;
use rand_chacha::ChaCha8Rng;

/// A rows x cols weight of valid blocks made cheaply: 64 random rows quantized, then repeated.
fn benchmark_weight(rng: &mut ChaCha8Rng, ty: GgmlType, rows: usize, cols: usize) -> WeightSource {
    const DISTINCT_ROWS: usize = 64;
    let seed_rows = HostWeight::random(rng, ty, DISTINCT_ROWS, cols);
    let row_bytes = seed_rows.bytes.len() / DISTINCT_ROWS;
    let mut bytes = Vec::with_capacity(rows * row_bytes);
    while bytes.len() < rows * row_bytes {
        let take = (rows * row_bytes - bytes.len()).min(seed_rows.bytes.len());
        bytes.extend_from_slice(&seed_rows.bytes[..take]);
    }
    let len = bytes.len();
    WeightSource { name: format!("{ty} {rows}x{cols}"), ty, rows, cols, range: 0..len, owner: Arc::new(bytes) }
}

/// Mean milliseconds of `launch` over `rounds` calls (after one warm-up call), by CUDA events.
fn time_ms(rounds: usize, mut launch: impl FnMut(usize)) -> f64 {
    let ctx = device().context();
    let (start, end) =
        (ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).expect("event"), ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).expect("event"));
    launch(0);
    start.record(device().stream()).expect("record");
    for round in 0..rounds {
        launch(round);
    }
    end.record(device().stream()).expect("record");
    f64::from(start.elapsed_ms(&end).expect("elapsed")) / rounds as f64
}

/// Prints, per format, the weight bandwidth of the mat-vec on Llama-3-8B's FFN shapes
/// (14336 x 4096 and 4096 x 14336): `matmul` for 1 token (activation quantization included),
/// the mat-vec kernel alone for 1, 4 and 8 tokens, and the mat-mat's TFLOP/s for 512 tokens.
/// Each measurement cycles through enough copies of the weight to defeat the L2 cache.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn matvec_bandwidth_on_8b_shapes() {
    const ROUNDS: usize = 24;
    const PEAK_GBPS: f64 = 4200.0; // measured copy bandwidth of an H200
    let mut rng = rng("bandwidth");
    let l2 = device().info().l2_cache_bytes.max(1 << 20);
    println!("{}", device().info());
    println!(
        "{:<7} {:>11} {:>9} | {:>15} | kernel alone GB/s (% of {PEAK_GBPS:.0}, measured rows per warp x tiles in flight) for n = 1, 4, 8 | pp512 TFLOP/s",
        "format", "shape", "MiB", "matmul n=1 GB/s"
    );
    let mut failures = Vec::new();
    for &ty in FORMATS {
        for (rows, cols) in [(14336, 4096), (4096, 14336)] {
            let source = benchmark_weight(&mut rng, ty, rows, cols);
            let first = matvec::upload_weight(device(), &source).expect("upload");
            prepare_modules(&first);
            let bytes = first.device_bytes();
            let copies = (5 * l2 / 2).div_ceil(bytes).clamp(2, 12);
            let mut weights = vec![first];
            weights.extend((1..copies).map(|_| matvec::upload_weight(device(), &source).expect("upload")));
            let x = upload_f32(&random_f32(&mut rng, 512 * cols));
            let mut out = device().alloc_zeros::<f32>(512 * rows, "benchmark output").expect("alloc");
            let gbps = |ms: f64| bytes as f64 / (ms * 1e-3) / 1e9;
            let matmul_ms = time_ms(ROUNDS * copies, |i| matvec::matmul(device(), &weights[i % copies], &x, &mut out, 1).expect("matmul"));
            let mut kernel = Vec::new();
            if weights[0].ty.block_size() > 1 {
                let mut q = QuantizedActivations::new(device(), 8, cols).expect("activations");
                matvec::quantize_activations(device(), &x, 8, &mut q).expect("quantize");
                for n in [1, 4, 8] {
                    let ms =
                        time_ms(ROUNDS * copies, |i| matvec::matmul_quantized(device(), &weights[i % copies], &q, None, &mut out, n, false).expect("matvec"));
                    let (rows_per_warp, batch) = matvec::matvec_shape(device(), &weights[0], n, false);
                    kernel.push(format!("{:6.0} ({:4.1}%, {rows_per_warp}x{batch})", gbps(ms), 100.0 * gbps(ms) / PEAK_GBPS));
                }
            } else {
                for n in [1, 4, 8] {
                    let ms = time_ms(ROUNDS * copies, |i| matvec::matmul(device(), &weights[i % copies], &x, &mut out, n).expect("matvec"));
                    kernel.push(format!("{:6.0} ({:4.1}%)", gbps(ms), 100.0 * gbps(ms) / PEAK_GBPS));
                }
            }
            let matmat_ms = time_ms(2, |i| matvec::matmul(device(), &weights[i % copies], &x, &mut out, 512).expect("matmat"));
            let tflops = 2.0 * rows as f64 * cols as f64 * 512.0 / (matmat_ms * 1e-3) / 1e12;
            println!(
                "{:<7} {:>5}x{:<5} {:>9.1} | {:>8.0} ({:4.1}%) | {} | {tflops:6.1}",
                ty.name(),
                rows,
                cols,
                bytes as f64 / (1 << 20) as f64,
                gbps(matmul_ms),
                100.0 * gbps(matmul_ms) / PEAK_GBPS,
                kernel.join(" ")
            );
            let result = device().download(&out).expect("download");
            if !result[..512 * rows].iter().all(|v| v.is_finite()) {
                failures.push(format!("{ty} {rows}x{cols}: non-finite outputs"));
            }
        }
    }
    report("bandwidth", failures);
}

/// Median milliseconds of one `launch` call over `runs` runs of `per_run` calls each (after a
/// warm-up run), timed by CUDA events around each run.
fn median_ms(runs: usize, per_run: usize, mut launch: impl FnMut(usize)) -> f64 {
    let ctx = device().context();
    let event = || ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).expect("event");
    for i in 0..per_run {
        launch(i);
    }
    let mut times: Vec<f64> = (0..runs)
        .map(|_| {
            let (start, end) = (event(), event());
            start.record(device().stream()).expect("record");
            for i in 0..per_run {
                launch(i);
            }
            end.record(device().stream()).expect("record");
            f64::from(start.elapsed_ms(&end).expect("elapsed")) / per_run as f64
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[runs / 2]
}

/// Prints the tensor-core mat-mat's TFLOP/s and weight GB/s on Llama-3-8B's FFN shapes
/// (4096 cols x 14336 rows, 14336 cols x 4096 rows) at 512, 64, 32 and 8 tokens (8: `auto` is the mat-vec) for Q4_K, Q8_0,
/// Q4_0, Q6_K and Q1_0: `matmul`'s own (measured) pick of block shape, then every shape forced,
/// then the fused SwiGLU pair for the 14336-row shape, auto and every shape. Launches cycle through enough weight copies to defeat
/// the L2 cache; each figure is the median of 7 timed runs after a warm-up.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn matmat_throughput_on_8b_shapes() {
    const RUNS: usize = 7;
    let mut rng = rng("matmat_throughput");
    let l2 = device().info().l2_cache_bytes.max(1 << 20);
    println!("{}", device().info());
    println!("{:<6} {:>11} {:>4} {:<14} {:>8} {:>8} {:>8}", "format", "rows x cols", "n", "kernel", "ms", "TFLOP/s", "GB/s");
    let mut failures = Vec::new();
    for ty in [GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q6_K, GgmlType::Q1_0] {
        for (rows, cols) in [(14336, 4096), (4096, 14336)] {
            let source = benchmark_weight(&mut rng, ty, rows, cols);
            let first = matvec::upload_weight(device(), &source).expect("upload");
            prepare_modules(&first);
            let bytes = first.device_bytes();
            // The SwiGLU runs read two weights per launch, so count copies in pairs.
            let copies = (5 * l2 / 2).div_ceil(bytes).clamp(2, 12).next_multiple_of(2);
            let mut weights = vec![first];
            weights.extend((1..copies).map(|_| matvec::upload_weight(device(), &source).expect("upload")));
            let x = upload_f32(&random_f32(&mut rng, 512 * cols));
            let mut out = device().alloc_zeros::<f32>(512 * rows, "benchmark output").expect("alloc");
            for n in [512, 64, 32, 8] {
                let line = |kernel: String, ms: f64, weight_bytes: usize, flops: f64| {
                    println!(
                        "{:<6} {:>5}x{:<5} {n:>4} {kernel:<14} {ms:>8.4} {:>8.1} {:>8.0}",
                        ty.name(),
                        rows,
                        cols,
                        flops / (ms * 1e-3) / 1e12,
                        weight_bytes as f64 / (ms * 1e-3) / 1e9
                    );
                };
                let flops = 2.0 * rows as f64 * cols as f64 * n as f64;
                // The first call measures every shape (untimed warm-up); `auto` is then its pick.
                let ms = median_ms(RUNS, copies, |i| matvec::matmul(device(), &weights[i % copies], &x, &mut out, n).expect("matmul"));
                let auto = matvec::matmat_tile(device(), &weights[0], n, false);
                line(format!("auto (tile {auto})"), ms, bytes, flops);
                for tile in 0..matvec::MATMAT_TILES {
                    let ms = median_ms(RUNS, copies, |i| {
                        matvec::matmul_with_tile(device(), &weights[i % copies], None, &x, &mut out, n, false, tile).expect("matmul_with_tile")
                    });
                    line(format!("tile {tile}"), ms, bytes, flops);
                }
                if rows > cols {
                    let ms = median_ms(RUNS, copies / 2, |i| {
                        let (gate, up) = (&weights[(2 * i) % copies], &weights[(2 * i + 1) % copies]);
                        matvec::matmul_swiglu(device(), gate, up, &x, &mut out, n).expect("matmul_swiglu")
                    });
                    let auto = matvec::matmat_tile(device(), &weights[0], n, true);
                    line(format!("swiglu (tile {auto})"), ms, 2 * bytes, 2.0 * flops);
                    for tile in 0..matvec::MATMAT_TILES {
                        let ms = median_ms(RUNS, copies / 2, |i| {
                            let (gate, up) = (&weights[(2 * i) % copies], &weights[(2 * i + 1) % copies]);
                            matvec::matmul_with_tile(device(), gate, Some(up), &x, &mut out, n, false, tile).expect("swiglu with tile")
                        });
                        line(format!("swiglu tile {tile}"), ms, 2 * bytes, 2.0 * flops);
                    }
                }
                let result = device().download(&out).expect("download");
                if !result[..n * rows].iter().all(|v| v.is_finite()) {
                    failures.push(format!("{ty} {rows}x{cols} n={n}: non-finite outputs"));
                }
            }
        }
    }
    report("matmat throughput", failures);
}

/// Prints the grouped expert product (a prompt's mixture of experts) on real MoE shapes, every
/// way forced and `matmul`'s measured pick: Qwen3-30B-A3B (128 experts of 768 x 2048, 8 per
/// token; gate/up Q4_K, down Q6_K) and gpt-oss-20b (32 experts of 2880 x 2880 MXFP4, 4 per
/// token), at 512 and 64 tokens. GB/s counts each chosen expert's bytes once.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn expert_groups_on_moe_shapes() {
    const RUNS: usize = 5;
    let mut rng = rng("expert_groups");
    let products = matvec::ExpertProducts::default();
    println!("{:<24} {:>4} {:<10} {:>9} {:>8} {:>8}", "experts", "n", "way", "ms", "TFLOP/s", "GB/s");
    let mut failures = Vec::new();
    for (label, ty, n_experts, rows, cols, n_used) in [
        ("qwen3-30b-a3b gate Q4_K", GgmlType::Q4_K, 128, 768, 2048, 8),
        ("qwen3-30b-a3b down Q6_K", GgmlType::Q6_K, 128, 2048, 768, 8),
        ("gpt-oss-20b MXFP4", GgmlType::MXFP4, 32, 2880, 2880, 4),
    ] {
        let experts: Vec<_> = (0..n_experts).map(|_| matvec::upload_weight(device(), &benchmark_weight(&mut rng, ty, rows, cols)).expect("upload")).collect();
        let expert_bytes = experts[0].device_bytes();
        for n in [512, 64] {
            let mut all: Vec<usize> = (0..n_experts).collect();
            let ids: Vec<f32> = (0..n)
                .flat_map(|_| {
                    rand::seq::SliceRandom::shuffle(all.as_mut_slice(), &mut rng);
                    all[..n_used].iter().map(|&e| e as f32).collect::<Vec<_>>()
                })
                .collect();
            let chosen = ids.iter().map(|&e| e as usize).collect::<std::collections::HashSet<_>>().len();
            let (x, ids) = (upload_f32(&random_f32(&mut rng, n * cols)), upload_f32(&ids));
            let mut out = device().alloc_zeros::<f32>(n * n_used * rows, "benchmark output").expect("alloc");
            let flops = 2.0 * (n * n_used * rows * cols) as f64;
            let call = matvec::ExpertCall { experts: &experts, x: &x, ids: &ids, n, n_used, input: kiln_core::ExpertInput::PerToken };
            let line = |way: String, ms: f64| {
                println!(
                    "{label:<24} {n:>4} {way:<10} {ms:>9.4} {:>8.1} {:>8.0}",
                    flops / (ms * 1e-3) / 1e12,
                    (chosen * expert_bytes) as f64 / (ms * 1e-3) / 1e9
                );
            };
            let ms = median_ms(RUNS, 4, |_| products.matmul(device(), call, &mut out).expect("matmul"));
            line("auto".into(), ms);
            for way in 0..matvec::grouped_ways() {
                let ms = median_ms(RUNS, 4, |_| products.matmul_grouped_way(device(), call, &mut out, way).expect("grouped"));
                line(format!("way {way}"), ms);
            }
            let result = device().download(&out).expect("download");
            if !result.iter().all(|v| v.is_finite()) {
                failures.push(format!("{label} n={n}: non-finite outputs"));
            }
        }
    }
    report("expert groups", failures);
}
