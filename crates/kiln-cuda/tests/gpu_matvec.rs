//! GPU tests of the weight products (src/matvec.rs): every format against the CPU reference
//! (kiln_quant::dequantize, then f64 dot products). They need an NVIDIA GPU: run them on the
//! device with scripts/gpu-tests.sh (which passes --include-ignored). The benchmarks are in
//! gpu_matvec_bench.rs.
//!
//! Each test checks every case and reports all failures at the end, so one run on the device
//! shows the full picture.

mod common;
mod matvec_support;
use common::rng;
use matvec_support::*;

use std::sync::Arc;

use kiln_core::WeightSource;
use kiln_cuda::matvec::{self, GatedPair, GpuWeight, QuantizedActivations};
use kiln_cuda::CudaError;
use kiln_quant::GgmlType;
use rand::Rng;

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn matmul_matches_the_cpu_reference_for_every_format() {
    let mut rng = rng("matmul");
    let mut failures = Vec::new();
    for &ty in FORMATS {
        let mut pool = Pool::default();
        for (rows, cols) in shapes(ty) {
            let host = HostWeight::random(&mut rng, ty, rows, cols);
            let weight = host.upload(&format!("{ty} {rows}x{cols}"));
            for &n in TOKEN_COUNTS {
                let case = format!("matmul {ty} {rows}x{cols} n={n}");
                let x = random_f32(&mut rng, n * cols);
                let mut out = poisoned(n * rows);
                if let Err(e) = matvec::matmul(device(), &weight, &upload_f32(&x), &mut out, n) {
                    failures.push(format!("{case}: {e}"));
                    continue;
                }
                let got = download(&out, n * rows, &mut failures, &case);
                let (computed, exact) = host.computed(&x, n);
                check_any(&mut failures, &case, &got, &computed.iter().collect::<Vec<_>>());
                pool.add(&got, &exact.values);
            }
        }
        pool.check(&mut failures, &format!("matmul {ty}"), Q8_TOLERANCE);
    }
    report("matmul", failures);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn matmul_add_accumulates_into_the_output() {
    let mut rng = rng("matmul_add");
    let mut failures = Vec::new();
    for &ty in FORMATS {
        let [_, mid, big] = column_choices(ty);
        for (rows, cols) in [(33, big), (7, mid)] {
            let host = HostWeight::random(&mut rng, ty, rows, cols);
            let weight = host.upload("add");
            for n in [1, 3, 8, 37] {
                let case = format!("matmul_add {ty} {rows}x{cols} n={n}");
                let x = random_f32(&mut rng, n * cols);
                let residual = random_f32(&mut rng, n * rows);
                let mut out = poisoned(n * rows);
                device().stream().memcpy_htod(&residual, &mut out.slice_mut(..n * rows)).expect("upload residual");
                if let Err(e) = matvec::matmul_add(device(), &weight, &upload_f32(&x), &mut out, n) {
                    failures.push(format!("{case}: {e}"));
                    continue;
                }
                let got = download(&out, n * rows, &mut failures, &case);
                let (mut computed, _) = host.computed(&x, n);
                for reference in &mut computed {
                    reference.values.iter_mut().zip(&residual).for_each(|(w, &r)| *w += f64::from(r));
                }
                check_any(&mut failures, &case, &got, &computed.iter().collect::<Vec<_>>());
            }
        }
    }
    report("matmul_add", failures);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn matmul_swiglu_fuses_gate_and_up() {
    let mut rng = rng("matmul_swiglu");
    let mut failures = Vec::new();
    for &ty in FORMATS {
        let mut pool = Pool::default();
        let [_, mid, big] = column_choices(ty);
        for (rows, cols) in [(33, big), (7, mid), (4097, mid)] {
            let gate_host = HostWeight::random(&mut rng, ty, rows, cols);
            let up_host = HostWeight::random(&mut rng, ty, rows, cols);
            let (gate, up) = (gate_host.upload("gate"), up_host.upload("up"));
            for &n in TOKEN_COUNTS {
                let case = format!("matmul_swiglu {ty} {rows}x{cols} n={n}");
                let x = random_f32(&mut rng, n * cols);
                let mut out = poisoned(n * rows);
                if let Err(e) = matvec::matmul_swiglu(device(), &gate, &up, &upload_f32(&x), &mut out, n) {
                    failures.push(format!("{case}: {e}"));
                    continue;
                }
                let got = download(&out, n * rows, &mut failures, &case);
                // Gate and up share the tile, so their references pair up.
                let ((gate_computed, gate_exact), (up_computed, up_exact)) = (gate_host.computed(&x, n), up_host.computed(&x, n));
                let fused: Vec<Expected> = gate_computed.iter().zip(&up_computed).map(|(g, u)| Expected::swiglu(g, u)).collect();
                check_any(&mut failures, &case, &got, &fused.iter().collect::<Vec<_>>());
                pool.add(&got, &Expected::swiglu(&gate_exact, &up_exact).values);
            }
        }
        pool.check(&mut failures, &format!("matmul_swiglu {ty}"), Q8_SWIGLU_TOLERANCE);
    }
    report("matmul_swiglu", failures);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn embed_rows_decodes_rows_exactly() {
    let mut rng = rng("embed_rows");
    let mut failures = Vec::new();
    for &ty in FORMATS {
        let [small, mid, big] = column_choices(ty);
        for (rows, cols) in [(37, big), (300, mid), (5, small)] {
            let host = HostWeight::random(&mut rng, ty, rows, cols);
            let table = host.upload("table");
            for n in [1, 4, 37] {
                let case = format!("embed {ty} {rows}x{cols} n={n}");
                let mut ids: Vec<u32> = (0..n).map(|_| rng.gen_range(0..rows as u32)).collect();
                // The last id of the batch is out of range: its row must come back as NaN.
                let bad = n > 1;
                if bad {
                    ids[n - 1] = rows as u32 + 3;
                }
                let ids_gpu = device().upload(&ids, "ids").expect("upload ids");
                let mut out = poisoned(n * cols);
                if let Err(e) = matvec::embed_rows(device(), &table, &ids_gpu.slice(..), &mut out, n) {
                    failures.push(format!("{case}: {e}"));
                    continue;
                }
                let got = download(&out, n * cols, &mut failures, &case);
                for (t, &id) in ids.iter().enumerate() {
                    let row = &got[t * cols..(t + 1) * cols];
                    if bad && t == n - 1 {
                        if !row.iter().all(|v| v.is_nan()) {
                            failures.push(format!("{case}: out-of-range id {id} did not give a NaN row"));
                        }
                        continue;
                    }
                    let want = &host.values[id as usize * cols..(id as usize + 1) * cols];
                    // Decoding is exact (the same f32 operations as the CPU), so values match bit for bit.
                    if let Some(c) = (0..cols).find(|&c| row[c].to_bits() != want[c].to_bits() && row[c] != want[c]) {
                        failures.push(format!("{case}: token {t} (row {id}) column {c}: {} != {}", row[c], want[c]));
                    }
                }
            }
        }
    }
    report("embed_rows", failures);
}

/// One quantization shared by two weights gives exactly what matmul gives each of them.
/// Every launch shape the mat-vec tuner can pick computes the same exact product, plain,
/// accumulating and as the fused SwiGLU, for every quantized format and token count.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn every_matvec_shape_matches_the_reference() {
    let mut rng = rng("matvec shapes");
    let mut failures = Vec::new();
    let quantized: Vec<GgmlType> = FORMATS.iter().copied().filter(|t| !matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)).collect();
    prepare_matvec_modules(&mut rng, &quantized);
    for ty in quantized {
        let [small, _, big] = column_choices(ty);
        for (rows, cols) in [(37, big), (4099, small)] {
            let every_shape: Vec<usize> = (0..matvec::MATVEC_SHAPE_COUNT).collect();
            check_shapes(&mut rng, &mut failures, ty, (rows, cols), 1..=matvec::MAX_MATVEC_TOKENS, &every_shape);
        }
    }
    report("matvec shapes", failures);
}

/// The split shapes (warps sharing rows, their sums added in finish_rows) on one token, for a
/// format of each mat-vec loop (paired, single-chunk, grouped) and rows that leave a group or
/// a block partly empty; quicker than the test above, which covers them too.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn split_shapes_match_the_reference() {
    let mut rng = rng("matvec split shapes");
    let mut failures = Vec::new();
    let split: Vec<usize> = (0..matvec::MATVEC_SHAPE_COUNT).filter(|&s| matvec::matvec_shape_split(s) > 1).collect();
    assert!(!split.is_empty(), "no split shape to test");
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::Q2_K, GgmlType::IQ4_XS, GgmlType::Q1_0, GgmlType::TQ2_0] {
        let [small, _, big] = column_choices(ty);
        for (rows, cols) in [(37, big), (4099, small), (6, 7 * big)] {
            check_shapes(&mut rng, &mut failures, ty, (rows, cols), 1..=1, &split);
        }
    }
    report("matvec split shapes", failures);
}

/// The one-token shapes of 8 rows a warp (16 for the grouped formats), on formats of each
/// mat-vec loop, rows that leave a warp's rows or a block partly empty, and rows of one to
/// several 16-byte steps a lane.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn eight_row_shapes_match_the_reference() {
    let mut rng = rng("matvec eight-row shapes");
    let mut failures = Vec::new();
    let eight: Vec<usize> =
        (0..matvec::MATVEC_SHAPE_COUNT).filter(|&s| matvec::matvec_shape_max_tokens(s) == 1 && matvec::matvec_shape_split(s) == 1).collect();
    assert!(!eight.is_empty(), "no eight-row shape to test");
    for ty in [GgmlType::Q1_0, GgmlType::TQ2_0, GgmlType::Q2_0, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0, GgmlType::Q4_0] {
        let [small, _, big] = column_choices(ty);
        for (rows, cols) in [(37, big), (4099, small), (6, 7 * big), (64, 4096)] {
            check_shapes(&mut rng, &mut failures, ty, (rows, cols), 1..=1, &eight);
        }
    }
    report("matvec eight-row shapes", failures);
}

/// Plain, accumulated and SwiGLU products of a random `ty` weight of `rows` x `cols` with
/// every launch shape in `shapes` for each token count in `ns`, against the reference.
fn check_shapes(
    rng: &mut rand_chacha::ChaCha8Rng,
    failures: &mut Vec<String>,
    ty: GgmlType,
    (rows, cols): (usize, usize),
    ns: std::ops::RangeInclusive<usize>,
    shapes: &[usize],
) {
    let (gate, up) = (HostWeight::random(rng, ty, rows, cols), HostWeight::random(rng, ty, rows, cols));
    let (gate_gpu, up_gpu) = (gate.upload("gate"), up.upload("up"));
    for n in ns {
        let x = random_f32(rng, n * cols);
        let mut q = QuantizedActivations::new(device(), n, cols).expect("activations");
        matvec::quantize_activations(device(), &upload_f32(&x), n, &mut q).expect("quantize");
        let (g, u) = (gate.products(&x, n).0, up.products(&x, n).0);
        let base = random_f32(rng, n * rows);
        for &shape in shapes.iter().filter(|&&s| matvec::matvec_shape_fits(s, &gate_gpu, n)) {
            let case = format!("{ty} {rows}x{cols} n={n} shape {shape}");
            let mut out = poisoned(n * rows);
            matvec::matmul_quantized_with_shape(device(), &gate_gpu, None, &q, &mut out, n, false, shape).expect("matvec");
            let got = download(&out, n * rows, failures, &case);
            check(failures, &case, &got, &g);
            let mut out = upload_f32(&base);
            matvec::matmul_quantized_with_shape(device(), &gate_gpu, None, &q, &mut out, n, true, shape).expect("matvec add");
            let added: Vec<f32> = download(&out, n * rows, failures, &case).iter().zip(&base).map(|(o, b)| o - b).collect();
            check(failures, &format!("{case} add"), &added, &g);
            let mut out = poisoned(n * rows);
            matvec::matmul_quantized_with_shape(device(), &gate_gpu, Some(&up_gpu), &q, &mut out, n, false, shape).expect("swiglu");
            let got = download(&out, n * rows, failures, &case);
            check(failures, &format!("{case} swiglu"), &got, &Expected::swiglu(&g, &u));
        }
    }
}

/// One token of float weights runs a block per two rows (`matvec_float_row`), and q/k/v-like
/// triples one launch (`matmul_stacked_float`): plain, added, SwiGLU and stacked products on
/// widths that end mid-way through a thread's eight values (4100, 100) and ones that do not.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn float_weights_on_one_token_match_the_reference() {
    let mut rng = rng("float_one_token");
    let mut failures = Vec::new();
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        for (rows, cols) in [(1, 4100), (1027, 4096), (37, 100), (5, 400)] {
            let case = format!("{ty} {rows}x{cols}");
            let hosts: Vec<HostWeight> = [rows, rows, 5, 64].iter().map(|&r| HostWeight::random(&mut rng, ty, r, cols)).collect();
            let gpu: Vec<GpuWeight> = hosts.iter().map(|h| h.upload("float")).collect();
            let x = random_f32(&mut rng, cols);
            let xg = upload_f32(&x);
            let computed = |h: &HostWeight| h.computed(&x, 1).0;

            let mut out = poisoned(rows);
            match matvec::matmul(device(), &gpu[0], &xg, &mut out, 1) {
                Ok(()) => {
                    let got = download(&out, rows, &mut failures, &case);
                    check_any(&mut failures, &format!("{case} plain"), &got, &computed(&hosts[0]).iter().collect::<Vec<_>>());
                }
                Err(e) => failures.push(format!("{case} plain: {e}")),
            }

            let residual = random_f32(&mut rng, rows);
            let mut out = poisoned(rows);
            device().stream().memcpy_htod(&residual, &mut out.slice_mut(..rows)).expect("upload residual");
            let mut added = computed(&hosts[0]);
            for reference in &mut added {
                reference.values.iter_mut().zip(&residual).for_each(|(w, &r)| *w += f64::from(r));
            }
            match matvec::matmul_add(device(), &gpu[0], &xg, &mut out, 1) {
                Ok(()) => {
                    let got = download(&out, rows, &mut failures, &case);
                    check_any(&mut failures, &format!("{case} add"), &got, &added.iter().collect::<Vec<_>>());
                }
                Err(e) => failures.push(format!("{case} add: {e}")),
            }

            let mut out = poisoned(rows);
            let fused: Vec<Expected> = computed(&hosts[0]).iter().zip(&computed(&hosts[1])).map(|(g, u)| Expected::swiglu(g, u)).collect();
            match matvec::matmul_swiglu(device(), &gpu[0], &gpu[1], &xg, &mut out, 1) {
                Ok(()) => {
                    let got = download(&out, rows, &mut failures, &case);
                    check_any(&mut failures, &format!("{case} swiglu"), &got, &fused.iter().collect::<Vec<_>>());
                }
                Err(e) => failures.push(format!("{case} swiglu: {e}")),
            }

            for picked in [vec![0, 2, 3], vec![3, 0]] {
                let weights: Vec<&GpuWeight> = picked.iter().map(|&i| &gpu[i]).collect();
                let mut outs: Vec<_> = picked.iter().map(|&i| poisoned(hosts[i].rows)).collect();
                let stacked = format!("{case} stacked {picked:?}");
                match matvec::matmul_stacked_float(device(), &weights, &xg, &mut outs.iter_mut().collect::<Vec<_>>(), 1, None) {
                    Ok(true) => {
                        for (out, &i) in outs.iter().zip(&picked) {
                            let got = download(out, hosts[i].rows, &mut failures, &stacked);
                            check_any(&mut failures, &format!("{stacked} weight {i}"), &got, &computed(&hosts[i]).iter().collect::<Vec<_>>());
                        }
                    }
                    Ok(false) => failures.push(format!("{stacked}: not launched")),
                    Err(e) => failures.push(format!("{stacked}: {e}")),
                }
            }
        }
    }
    report("float_one_token", failures);
}

/// Stacked launches give each weight its own product: three weights of one format (q, k, v),
/// and two of one format then one of another (two launches), for every quantized format; with
/// biases on every weight (3 tokens), on the first and last (1 token: a null one between, and
/// a weight launched alone), or none (8 tokens).
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn stacked_products_match_each_weight() {
    let mut rng = rng("stacked");
    let mut failures = Vec::new();
    for &ty in FORMATS.iter().filter(|t| !matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)) {
        let other = if ty == GgmlType::Q8_0 { GgmlType::Q4_0 } else { GgmlType::Q8_0 };
        let [small, _, big] = column_choices(ty);
        for (cols, rows) in [(big, [33, 7, 130]), (small, [4097, 5, 64])] {
            for types in [[ty, ty, ty], [ty, ty, other]] {
                let hosts: Vec<HostWeight> = types.iter().zip(rows).map(|(&t, r)| HostWeight::random(&mut rng, t, r, cols)).collect();
                let gpu: Vec<GpuWeight> = hosts.iter().map(|h| h.upload("stacked")).collect();
                for n in [1, 3, 8] {
                    let case = format!("{types:?} {rows:?}x{cols} n={n}");
                    let x = random_f32(&mut rng, n * cols);
                    let mut q = QuantizedActivations::new(device(), n, cols).expect("activations");
                    matvec::quantize_activations(device(), &upload_f32(&x), n, &mut q).expect("quantize");
                    let [mut a, mut b, mut c] = rows.map(|r| poisoned(n * r));
                    let weights: Vec<&GpuWeight> = gpu.iter().collect();
                    let biased = match n {
                        1 => [true, false, true],
                        3 => [true; 3],
                        _ => [false; 3],
                    };
                    let biases: Vec<Option<Vec<f32>>> = rows.iter().zip(biased).map(|(&r, b)| b.then(|| random_f32(&mut rng, r))).collect();
                    let gpu_biases: Vec<_> = biases.iter().map(|b| b.as_ref().map(|b| upload_f32(b))).collect();
                    let bias_refs: Vec<_> = gpu_biases.iter().map(Option::as_ref).collect();
                    if let Err(e) = matvec::matmul_stacked_quantized(device(), &weights, &bias_refs, &q, &mut [&mut a, &mut b, &mut c], n) {
                        failures.push(format!("{case}: {e}"));
                        continue;
                    }
                    for (((out, host), name), bias) in [a, b, c].iter().zip(&hosts).zip(["a", "b", "c"]).zip(&biases) {
                        let got = download(out, n * host.rows, &mut failures, &case);
                        let product = host.products(&x, n).0;
                        let want = bias.as_ref().map_or(product.clone(), |b| product.with_bias(b));
                        check(&mut failures, &format!("{case} {name}, bias {}", bias.is_some()), &got, &want);
                    }
                }
            }
        }
    }
    report("stacked", failures);
}

/// q, k and v of a batch through `matmul_shared_input`: each run of weights of one format in one
/// stacked mat-mat launch (its shape and split count measured on first use), a change of
/// format starting a new run, each weight's output against its f64 reference (either decode's
/// rounding: the measured shape may stream). A second call, with the shape remembered, gives
/// the same bits.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn stacked_matmat_matches_each_weight() {
    use GgmlType::{Q4_0, Q4_K, Q6_K, Q8_0};
    let mut rng = rng("stacked matmat");
    let mut failures = Vec::new();
    for types in [[Q4_K, Q4_K, Q4_K], [Q4_K, Q4_K, Q6_K], [Q8_0, Q8_0, Q8_0], [Q4_0, Q8_0, Q8_0]] {
        let cols = column_choices(types[0])[1];
        let rows = [200, 64, 37];
        let hosts: Vec<HostWeight> = types.iter().zip(rows).map(|(&t, r)| HostWeight::random(&mut rng, t, r, cols)).collect();
        let gpu: Vec<GpuWeight> = hosts.iter().map(|h| h.upload("stacked matmat")).collect();
        let weights: Vec<&GpuWeight> = gpu.iter().collect();
        for n in [12, 32, 64, 100] {
            let case = format!("{types:?} {rows:?}x{cols} n={n}");
            let x = random_f32(&mut rng, n * cols);
            let x_gpu = upload_f32(&x);
            let mut first_bits = Vec::new();
            for call in ["first", "second"] {
                let [mut a, mut b, mut c] = rows.map(|r| poisoned(n * r));
                if let Err(e) = matvec::matmul_shared_input(device(), &weights, &x_gpu, &mut [&mut a, &mut b, &mut c], n, None) {
                    failures.push(format!("{case} {call} call: {e}"));
                    break;
                }
                let mut bits = Vec::new();
                for ((out, host), name) in [a, b, c].iter().zip(&hosts).zip(["a", "b", "c"]) {
                    let got = download(out, n * host.rows, &mut failures, &case);
                    let (classic, _) = host.products(&x, n);
                    let streamed = streaming_product(host, &x, n, &classic);
                    check_any(&mut failures, &format!("{case} {name} ({call} call)"), &got, &references(None, &classic, &streamed));
                    bits.extend(got.iter().map(|v| v.to_bits()));
                }
                if call == "first" {
                    first_bits = bits;
                } else if bits != first_bits {
                    failures.push(format!("{case}: the second call's outputs differ from the first's"));
                }
            }
        }
    }
    report("stacked matmat", failures);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn prequantized_activations_serve_several_weights() {
    let mut rng = rng("prequantized");
    let mut failures = Vec::new();
    let (rows, cols, n) = (300, 1024, 3);
    let hosts = [HostWeight::random(&mut rng, GgmlType::Q4_K, rows, cols), HostWeight::random(&mut rng, GgmlType::Q6_K, rows, cols)];
    let weights: Vec<GpuWeight> = hosts.iter().map(|h| h.upload("shared input")).collect();
    let x = random_f32(&mut rng, n * cols);
    let x_gpu = upload_f32(&x);
    let mut shared = QuantizedActivations::new(device(), 4, cols).expect("activation buffer");
    matvec::quantize_activations(device(), &x_gpu, n, &mut shared).expect("quantize");
    for (host, weight) in hosts.iter().zip(&weights) {
        let case = format!("prequantized {}", host.ty);
        let (mut direct, mut shared_out) = (poisoned(n * rows), poisoned(n * rows));
        matvec::matmul(device(), weight, &x_gpu, &mut direct, n).expect("matmul");
        matvec::matmul_quantized(device(), weight, &shared, None, &mut shared_out, n, false).expect("matmul_quantized");
        let direct = download(&direct, n * rows, &mut failures, &case);
        let shared_out = download(&shared_out, n * rows, &mut failures, &case);
        if direct.iter().zip(&shared_out).any(|(a, b)| a.to_bits() != b.to_bits()) {
            failures.push(format!("{case}: shared quantization differs from matmul's own"));
        }
        check(&mut failures, &case, &shared_out, &host.products(&x, n).0);
    }
    let mut out = poisoned(n * rows);
    matvec::matmul_gated_quantized(device(), GatedPair::swiglu(&weights[0], &weights[0]), &shared, &mut out, n).expect("swiglu");
    let got = download(&out, n * rows, &mut failures, "prequantized swiglu");
    let g = hosts[0].products(&x, n).0;
    check(&mut failures, "prequantized swiglu", &got, &Expected::swiglu(&g, &g));
    // More tokens than the buffer holds, and a float weight, are refused.
    assert!(matches!(matvec::quantize_activations(device(), &x_gpu, 5, &mut shared), Err(CudaError::InvalidArgument { .. })));
    let float = HostWeight::random(&mut rng, GgmlType::F16, rows, cols).upload("f16");
    let mut out = poisoned(n * rows);
    assert!(matches!(matvec::matmul_quantized(device(), &float, &shared, None, &mut out, n, false), Err(CudaError::InvalidArgument { .. })));
    report("prequantized", failures);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn bad_arguments_are_typed_errors() {
    let mut rng = rng("bad_arguments");
    let a = HostWeight::random(&mut rng, GgmlType::Q4_0, 8, 64).upload("a");
    let b = HostWeight::random(&mut rng, GgmlType::Q8_0, 8, 64).upload("b");
    let x = upload_f32(&random_f32(&mut rng, 2 * 64));
    let mut out = poisoned(2 * 8);
    let invalid = |result: Result<(), CudaError>, what: &str| match result {
        Err(CudaError::InvalidArgument { reason, .. }) => eprintln!("{what}: {reason}"),
        other => panic!("{what}: expected InvalidArgument, got {other:?}"),
    };
    invalid(matvec::matmul_swiglu(device(), &a, &b, &x, &mut out, 2), "gate/up of different types");
    invalid(matvec::matmul(device(), &a, &x, &mut out, 3), "x shorter than n * cols");
    let mut short = device().alloc_poisoned::<f32>(2 * 8 - 1, "short output").expect("alloc");
    invalid(matvec::matmul(device(), &a, &x, &mut short, 2), "output shorter than n * rows");
    // A shape of the grouped formats only (16 rows a warp) on a Q4_0 weight.
    let grouped_only = (0..matvec::MATVEC_SHAPE_COUNT).find(|&s| matvec::matvec_shape_max_tokens(s) == 1 && !matvec::matvec_shape_fits(s, &a, 1));
    let grouped_only = grouped_only.expect("a shape for the grouped formats only");
    let mut q = QuantizedActivations::new(device(), 1, 64).expect("activations");
    matvec::quantize_activations(device(), &x, 1, &mut q).expect("quantize");
    invalid(matvec::matmul_quantized_with_shape(device(), &a, None, &q, &mut out, 1, false, grouped_only), "grouped-only shape on Q4_0");
    // The SwiGLU storing the next input into its own input buffer (a square weight makes the
    // widths agree), or into a buffer of the wrong width.
    let square = HostWeight::random(&mut rng, GgmlType::Q4_0, 64, 64).upload("square");
    let stored = |result: Result<bool, CudaError>| result.map(drop);
    invalid(
        stored(matvec::matmul_gated_quantized_into(device(), GatedPair::swiglu(&square, &square), &q, &mut out, 1, &q, None)),
        "next input aliasing the input",
    );
    let narrow = QuantizedActivations::new(device(), 1, 32).expect("activations");
    invalid(
        stored(matvec::matmul_gated_quantized_into(device(), GatedPair::swiglu(&square, &square), &q, &mut out, 1, &narrow, None)),
        "next input of the wrong width",
    );
    // Q8_K is ggml's activation format, never a weight: no GPU layout.
    let bytes = GgmlType::Q8_K.type_size();
    let unsupported = WeightSource { name: "q8_k".into(), ty: GgmlType::Q8_K, rows: 1, cols: 256, range: 0..bytes, owner: Arc::new(vec![0u8; bytes]) };
    assert!(matches!(matvec::upload_weight(device(), &unsupported), Err(CudaError::InvalidArgument { .. })));
}

/// The tensor-core mat-mat for every format and every block shape (plus `matmul`'s own pick):
/// 9..512 tokens, row counts that leave partial blocks for every shape (1, 37, 200 rows; the
/// SwiGLU pair halves the rows per block), row lengths per `column_choices` (partial 512-value
/// tiles, and for floats lengths that are not multiples of 4 or 16), the plain product, the
/// residual add and the SwiGLU pair. Outputs are poisoned first and a guard after them must
/// stay poisoned. Each result must match the f64 product of the f16-rounded operands to f32
/// rounding (ROUNDING_TOLERANCE), and the pool over a format the exact product (F16_TOLERANCE).
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn matmat_matches_the_cpu_reference_for_every_format_and_tile() {
    let mut rng = rng("matmat");
    let mut failures = Vec::new();
    let tiles: Vec<Option<usize>> = std::iter::once(None).chain((0..matvec::MATMAT_TILES).map(Some)).collect();
    for &ty in FORMATS {
        let [small, mid, big] = column_choices(ty);
        prepare_modules(&HostWeight::random(&mut rng, ty, 1, small).upload("module preparation"));
        let (mut plain_pool, mut add_pool, mut swiglu_pool) = (Pool::default(), Pool::default(), Pool::default());
        for &n in MATMAT_TOKEN_COUNTS {
            // Plain product and residual add.
            for (rows, cols) in [(37, big), (200, mid), (1, small)] {
                let host = HostWeight::random(&mut rng, ty, rows, cols);
                let weight = host.upload(&format!("{ty} {rows}x{cols}"));
                let x = random_f32(&mut rng, n * cols);
                let x_gpu = upload_f32(&x);
                let residual = random_f32(&mut rng, n * rows);
                let (computed, exact) = host.products(&x, n);
                let streamed = streaming_product(&host, &x, n, &computed);
                let with_residual = |e: &Expected| {
                    let mut sum = e.clone();
                    sum.values.iter_mut().zip(&residual).for_each(|(w, &r)| *w += f64::from(r));
                    sum
                };
                let (computed_sum, streamed_sum) = (with_residual(&computed), with_residual(&streamed));
                let exact_sum: Vec<f64> = exact.values.iter().zip(&residual).map(|(w, &r)| w + f64::from(r)).collect();
                for &tile in &tiles {
                    let case = format!("matmat {ty} {rows}x{cols} n={n} {}", tile_name(tile));
                    let mut out = poisoned(n * rows);
                    let result = match tile {
                        None => matvec::matmul(device(), &weight, &x_gpu, &mut out, n),
                        Some(t) => matvec::matmul_with_tile(device(), &weight, None, &x_gpu, &mut out, n, false, t),
                    };
                    if let Err(e) = result {
                        failures.push(format!("{case}: {e}"));
                        continue;
                    }
                    let got = download(&out, n * rows, &mut failures, &case);
                    check_any(&mut failures, &case, &got, &references(tile, &computed, &streamed));
                    plain_pool.add(&got, &exact.values);

                    let case = format!("matmat add {ty} {rows}x{cols} n={n} {}", tile_name(tile));
                    let mut out = poisoned(n * rows);
                    device().stream().memcpy_htod(&residual, &mut out.slice_mut(..n * rows)).expect("upload residual");
                    let result = match tile {
                        None => matvec::matmul_add(device(), &weight, &x_gpu, &mut out, n),
                        Some(t) => matvec::matmul_with_tile(device(), &weight, None, &x_gpu, &mut out, n, true, t),
                    };
                    if let Err(e) = result {
                        failures.push(format!("{case}: {e}"));
                        continue;
                    }
                    let got = download(&out, n * rows, &mut failures, &case);
                    check_any(&mut failures, &case, &got, &references(tile, &computed_sum, &streamed_sum));
                    add_pool.add(&got, &exact_sum);
                }
            }
            // SwiGLU pair.
            for (rows, cols) in [(37, mid), (200, small)] {
                let (gate_host, up_host) = (HostWeight::random(&mut rng, ty, rows, cols), HostWeight::random(&mut rng, ty, rows, cols));
                let (gate, up) = (gate_host.upload("gate"), up_host.upload("up"));
                let x = random_f32(&mut rng, n * cols);
                let x_gpu = upload_f32(&x);
                let (gate_computed, gate_exact) = gate_host.products(&x, n);
                let (up_computed, up_exact) = up_host.products(&x, n);
                let computed = Expected::swiglu(&gate_computed, &up_computed);
                let streamed = Expected::swiglu(&streaming_product(&gate_host, &x, n, &gate_computed), &streaming_product(&up_host, &x, n, &up_computed));
                let exact = Expected::swiglu(&gate_exact, &up_exact);
                for &tile in &tiles {
                    let case = format!("matmat swiglu {ty} {rows}x{cols} n={n} {}", tile_name(tile));
                    let mut out = poisoned(n * rows);
                    let result = match tile {
                        None => matvec::matmul_swiglu(device(), &gate, &up, &x_gpu, &mut out, n),
                        Some(t) => matvec::matmul_with_tile(device(), &gate, Some(&up), &x_gpu, &mut out, n, false, t),
                    };
                    if let Err(e) = result {
                        failures.push(format!("{case}: {e}"));
                        continue;
                    }
                    let got = download(&out, n * rows, &mut failures, &case);
                    check_any(&mut failures, &case, &got, &references(tile, &computed, &streamed));
                    swiglu_pool.add(&got, &exact.values);
                }
            }
        }
        plain_pool.check(&mut failures, &format!("matmat {ty}"), F16_TOLERANCE);
        add_pool.check(&mut failures, &format!("matmat add {ty}"), F16_TOLERANCE);
        swiglu_pool.check(&mut failures, &format!("matmat swiglu {ty}"), F16_SWIGLU_TOLERANCE);
    }
    let mut out = poisoned(9);
    let one = HostWeight::random(&mut rng, GgmlType::Q4_0, 1, 32).upload("one");
    assert!(matches!(
        matvec::matmul_with_tile(device(), &one, None, &upload_f32(&[0.0; 9 * 32]), &mut out, 9, false, matvec::MATMAT_TILES),
        Err(CudaError::InvalidArgument { .. })
    ));
    report("matmat", failures);
}

/// The SwiGLU mat-vec that also stores its output as the down product's int8 input
/// (`matmul_gated_quantized_into`): for every one-token launch shape, where the shape allows it
/// (blocks of whole 16-row chunks dividing the rows) the stored codes and scales must be bit for
/// bit what quantizing the output separately gives, and the output itself that of the plain
/// SwiGLU launch; where it does not, nothing is claimed stored. Rows of 1,024 and 1,536 (the
/// 16-row shapes' blocks of 32 rows fit both), 2,112 and 528 (not whole tiles: their padding
/// chunks keep the quantization's zeros; the down products past them are checked end to end by
/// gpu_archs, whose Gemma 4 FFNs are 128 and 256 wide).
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn swiglu_stores_the_next_input_where_its_launch_shape_allows() {
    let mut rng = rng("swiglu_next_input");
    let mut failures = Vec::new();
    for ty in [GgmlType::Q1_0, GgmlType::TQ2_0, GgmlType::Q2_0, GgmlType::Q4_K, GgmlType::Q8_0] {
        for (rows, cols) in [(1024, 512), (1536, 1024), (528, 512), (2112, 512)] {
            let case = format!("{ty} {rows}x{cols}");
            let gate = HostWeight::random(&mut rng, ty, rows, cols).upload("gate");
            let up = HostWeight::random(&mut rng, ty, rows, cols).upload("up");
            let mut x = QuantizedActivations::new(device(), 1, cols).expect("activations");
            matvec::quantize_activations(device(), &upload_f32(&random_f32(&mut rng, cols)), 1, &mut x).expect("quantize");
            let mut stored_by = Vec::new();
            for shape in (0..matvec::MATVEC_SHAPE_COUNT).filter(|&s| matvec::matvec_shape_fits(s, &gate, 1)) {
                let mut want = poisoned(rows);
                matvec::matmul_quantized_with_shape(device(), &gate, Some(&up), &x, &mut want, 1, false, shape).expect("plain SwiGLU");
                let mut want_next = QuantizedActivations::new(device(), 1, rows).expect("next");
                matvec::quantize_activations(device(), &want, 1, &mut want_next).expect("quantize the output");
                // The buffer starts out holding another row, so a claimed store must overwrite it.
                let mut next = QuantizedActivations::new(device(), 1, rows).expect("next");
                matvec::quantize_activations(device(), &upload_f32(&random_f32(&mut rng, rows)), 1, &mut next).expect("stale row");
                let mut got = poisoned(rows);
                let stored = match matvec::matmul_gated_quantized_into(device(), GatedPair::swiglu(&gate, &up), &x, &mut got, 1, &next, Some(shape)) {
                    Ok(stored) => stored,
                    Err(e) => {
                        failures.push(format!("{case} shape {shape}: {e}"));
                        continue;
                    }
                };
                let (got, want) = (download(&got, rows, &mut failures, &case), download(&want, rows, &mut failures, &case));
                if got.iter().zip(&want).any(|(a, b)| a.to_bits() != b.to_bits()) {
                    failures.push(format!("{case} shape {shape}: the output differs from the plain SwiGLU launch's"));
                }
                if stored {
                    stored_by.push(shape);
                    if next.download(device(), 1).expect("download") != want_next.download(device(), 1).expect("download") {
                        failures.push(format!("{case} shape {shape}: the stored input differs from quantizing the output"));
                    }
                }
            }
            // One token stores past whole tiles too: 2,112 rows (Gemma-4-26B-A4B's FFN) fill
            // blocks of up to 64 rows, 528 only blocks of 16.
            check_stored_by(&mut failures, &case, (rows % 64 == 0, true), &stored_by);
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// A residual product that prepares the next product's normed input
/// (`matmul_add_normed`), for every launch shape: the residual must be bit for bit the plain
/// accumulating launch's of the same shape; where the shape stores (blocks of whole 16-row
/// chunks, rows filling whole tiles), a product reading the prepared input must match one
/// reading `rms_norm_quantize` of the new residual within 1e-3 relative L2 (the codes quantize
/// `x * weight` instead of `x * weight / rms`: the same but at rounding ties, one step of a
/// chunk's scale), and elsewhere nothing is claimed stored. Rows of 1,024 and 528 (not whole
/// tiles: never stored); 1 and 3 tokens, the second with a bias.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn residual_products_prepare_the_next_norm_where_their_shape_allows() {
    let mut rng = rng("matmul_add_normed");
    let mut failures = Vec::new();
    let eps = 1e-5;
    for ty in [GgmlType::Q1_0, GgmlType::TQ2_0, GgmlType::Q8_0, GgmlType::Q4_K] {
        for (rows, cols) in [(1024, 512), (528, 512)] {
            let w = HostWeight::random(&mut rng, ty, rows, cols).upload("w");
            // A reader of the prepared input (rows not filling whole tiles are never prepared).
            let reader = (rows % 512 == 0).then(|| HostWeight::random(&mut rng, ty, 64, rows).upload("reader"));
            let norm = upload_f32(&random_f32(&mut rng, rows).iter().map(|v| 1.0 + 0.5 * v).collect::<Vec<_>>());
            for n in [1, 3] {
                // Three tokens with a bias, added in the same launch.
                let bias = (n == 3).then(|| random_f32(&mut rng, rows));
                let gpu_bias = bias.as_ref().map(|b| upload_f32(b));
                let case = format!("{ty} {rows}x{cols} n={n}, bias {}", bias.is_some());
                let mut x = QuantizedActivations::new(device(), n, cols).expect("activations");
                matvec::quantize_activations(device(), &upload_f32(&random_f32(&mut rng, n * cols)), n, &mut x).expect("quantize");
                let residual = random_f32(&mut rng, n * rows);
                let mut stored_by = Vec::new();
                for shape in (0..matvec::MATVEC_SHAPE_COUNT).filter(|&s| matvec::matvec_shape_fits(s, &w, n)) {
                    let mut want = upload_f32(&residual);
                    matvec::matmul_quantized_with_shape(device(), &w, None, &x, &mut want, n, true, shape).expect("plain add");
                    let mut got = upload_f32(&residual);
                    let next = QuantizedActivations::new(device(), n, rows).expect("next");
                    let stored = match matvec::matmul_add_normed(device(), &w, &x, gpu_bias.as_ref(), &mut got, n, (&norm, eps), &next, Some(shape)) {
                        Ok(stored) => stored,
                        Err(e) => {
                            failures.push(format!("{case} shape {shape}: {e}"));
                            continue;
                        }
                    };
                    let (got_x, want_x) = (download(&got, n * rows, &mut failures, &case), download(&want, n * rows, &mut failures, &case));
                    match &bias {
                        // The bias is added to the product before the residual: a rounding or two apart.
                        Some(bias) => {
                            let want_biased: Vec<f32> = want_x.iter().enumerate().map(|(i, v)| v + bias[i % rows]).collect();
                            if got_x.iter().zip(&want_biased).any(|(a, b)| (a - b).abs() > 1e-5 * b.abs().max(1.0)) {
                                failures.push(format!("{case} shape {shape}: the residual differs from the plain accumulating launch's plus the bias"));
                            }
                            want = upload_f32(&want_biased);
                        }
                        None if got_x.iter().zip(&want_x).any(|(a, b)| a.to_bits() != b.to_bits()) => {
                            failures.push(format!("{case} shape {shape}: the residual differs from the plain accumulating launch's"));
                        }
                        None => {}
                    }
                    if stored != next.has_deferred_norm() {
                        failures.push(format!("{case} shape {shape}: stored {stored}, but the input's deferred norm says otherwise"));
                    }
                    if !stored {
                        continue;
                    }
                    stored_by.push(shape);
                    let Some(reader) = &reader else { continue };
                    let separate = QuantizedActivations::new(device(), n, rows).expect("separate");
                    matvec::rms_norm_quantize(device(), &want, &norm, eps, n, &separate).expect("norm");
                    let (mut y, mut y_want) = (poisoned(n * 64), poisoned(n * 64));
                    matvec::matmul_quantized(device(), reader, &next, None, &mut y, n, false).expect("reader of the prepared input");
                    matvec::matmul_quantized(device(), reader, &separate, None, &mut y_want, n, false).expect("reader of the separate norm");
                    let (y, y_want) = (download(&y, n * 64, &mut failures, &case), download(&y_want, n * 64, &mut failures, &case));
                    let (diff, norm2) = y.iter().zip(&y_want).fold((0f64, 0f64), |(d, w), (a, b)| (d + f64::from(a - b).powi(2), w + f64::from(*b).powi(2)));
                    let rel_l2 = (diff / norm2.max(f64::MIN_POSITIVE)).sqrt();
                    if rel_l2.is_nan() || rel_l2 > 1e-3 {
                        failures.push(format!("{case} shape {shape}: the reader of the prepared input is {rel_l2:.2e} (relative L2) from the separate norm's"));
                    }
                }
                check_stored_by(&mut failures, &case, (rows % 512 == 0, rows % 512 == 0), &stored_by);
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// Rows filling whole tiles must have been stored by some launch shape, others by none.
/// Which launch shapes stored the next input: `must`, at least one; `may`, any at all.
fn check_stored_by(failures: &mut Vec<String>, case: &str, (must, may): (bool, bool), stored_by: &[usize]) {
    match (must, may, stored_by.is_empty()) {
        (true, _, true) => failures.push(format!("{case}: no launch shape stored the next input")),
        (_, false, false) => failures.push(format!("{case}: shapes {stored_by:?} stored rows that do not fill whole tiles")),
        _ => eprintln!("{case}: stored by shapes {stored_by:?}"),
    }
}
