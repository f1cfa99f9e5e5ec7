//! The integer matmul path against exact arithmetic, and every SIMD level against the
//! scalar kernels, on random weights of every kernel shape (groups of 16 and 32, with
//! and without offsets, groups larger than 32) and awkward sizes.

use std::sync::Arc;

use kiln_core::{Backend, CpuBackend, CpuMatmul, CpuOptions, DeviceBuffer, SimdLevel, WeightSource};
use kiln_quant::GgmlType;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Roughly normal: the sum of four uniforms, centred.
    fn normal(&mut self) -> f32 {
        (0..4).map(|_| (self.next() >> 40) as f32 / (1u64 << 24) as f32).sum::<f32>() - 2.0
    }
}

/// Formats covering every kernel shape: (group 32 | 16) x (offset | none), and groups above 32.
const TYPES: &[GgmlType] = &[
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::IQ4_NL,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_XS,
    GgmlType::MXFP4,
    GgmlType::NVFP4,
    GgmlType::TQ2_0,
    GgmlType::Q1_0,
];

fn weight(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> (WeightSource, Vec<f32>) {
    let values: Vec<f32> = (0..rows * cols).map(|_| rng.normal()).collect();
    let mut bytes = vec![0u8; kiln_quant::quantized_size(ty, rows * cols).unwrap()];
    kiln_quant::quantize(ty, &values, &mut bytes).unwrap();
    let mut dequantized = vec![0f32; rows * cols];
    kiln_quant::dequantize(ty, &bytes, &mut dequantized).unwrap();
    let range = 0..bytes.len();
    (WeightSource { name: format!("{ty} {rows}x{cols}"), ty, rows, cols, owner: Arc::new(bytes), range }, dequantized)
}

fn matmul(backend: &CpuBackend, w: &WeightSource, x: &[f32], n: usize) -> Vec<f32> {
    let w = backend.upload_weight(w.clone()).unwrap();
    let mut xb = backend.alloc(x.len(), "x").unwrap();
    backend.write(&mut xb, x).unwrap();
    let mut out = backend.alloc(n * w.rows, "out").unwrap();
    // Poisoned, so that an output the kernel never writes fails the comparison.
    backend.write(&mut out, &vec![f32::NAN; n * w.rows]).unwrap();
    backend.matmul(&w, xb.rows(n, w.cols).unwrap(), out.rows_mut(n, w.rows).unwrap()).unwrap();
    let mut host = vec![0f32; n * w.rows];
    backend.read(&out, &mut host).unwrap();
    host
}

/// The error 8-bit activations may cause in `w · x`: each x is off by at most half its
/// block's step `amax / 127`, so `|err| <= sum_i |w_i| * step_i / 2`.
fn quantization_bound(w: &[f32], x: &[f32]) -> f64 {
    let mut bound = 0f64;
    for (wb, xb) in w.chunks(32).zip(x.chunks(32)) {
        let step = f64::from(xb.iter().fold(0f32, |m, v| m.max(v.abs()))) / 127.0;
        bound += wb.iter().map(|v| f64::from(v.abs())).sum::<f64>() * step / 2.0;
    }
    bound
}

fn levels() -> Vec<SimdLevel> {
    let all = SimdLevel::ALL;
    let available: Vec<SimdLevel> = all.into_iter().filter(|l| l.is_available()).collect();
    if available.len() < all.len() {
        eprintln!("SKIPPED on this CPU: {:?}", all.iter().filter(|l| !available.contains(l)).collect::<Vec<_>>());
    }
    available
}

#[test]
fn integer_matmul_is_within_the_activation_rounding_bound_of_exact() {
    let mut rng = Rng(11);
    for &ty in TYPES {
        for (rows, cols, n) in [(7, 256usize, 1), (9, 512, 3), (17, 768, 5), (33, 256, 20), (3, 160, 2), (4, 352, 1), (6, 96, 17)] {
            if !cols.is_multiple_of(ty.block_size()) {
                continue;
            }
            let (w, dequantized) = weight(ty, rows, cols, &mut rng);
            let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
            for level in levels() {
                let backend = CpuBackend::with_options(CpuOptions { matmul: CpuMatmul::Quantized, simd: level });
                let got = matmul(&backend, &w, &x, n);
                for t in 0..n {
                    for r in 0..rows {
                        let (wr, xt) = (&dequantized[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
                        let exact: f64 = wr.iter().zip(xt).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
                        let magnitude: f64 = wr.iter().zip(xt).map(|(&a, &b)| f64::from(a * b).abs()).sum();
                        // Beyond rounding the activations: f32 sums of at most `cols` terms.
                        let bound = quantization_bound(wr, xt) + 1e-5 * magnitude;
                        let err = (f64::from(got[t * rows + r]) - exact).abs();
                        assert!(
                            err <= bound,
                            "{ty} {level:?} {rows}x{cols} n={n} token {t} row {r}: {} vs {exact}, err {err:.3e} > {bound:.3e}",
                            got[t * rows + r]
                        );
                    }
                }
            }
        }
    }
}

/// Every level and both kernels (row by row, and tiles of rows x 16 tokens) compute the
/// same integer sums; only the f32 order of the group terms differs (<= 1e-5 relative to
/// the sum of their magnitudes, bounded here by the exact magnitudes plus the rounding bound).
#[test]
fn every_simd_level_and_tile_shape_matches_the_scalar_kernels() {
    let mut rng = Rng(12);
    let scalar = CpuBackend::with_options(CpuOptions { matmul: CpuMatmul::Quantized, simd: SimdLevel::Scalar });
    for &ty in TYPES {
        for (rows, cols) in [(1, 256usize), (8, 512), (13, 1024 + 256), (21, 256 * 3), (5, 160), (9, 352)] {
            if !cols.is_multiple_of(ty.block_size()) {
                continue;
            }
            let (w, dequantized) = weight(ty, rows, cols, &mut rng);
            for n in [1, 2, 3, 4, 5, 15, 16, 17, 33] {
                let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
                let want = matmul(&scalar, &w, &x, n);
                for level in levels() {
                    let backend = CpuBackend::with_options(CpuOptions { matmul: CpuMatmul::Quantized, simd: level });
                    let got = matmul(&backend, &w, &x, n);
                    for t in 0..n {
                        for r in 0..rows {
                            let (wr, xt) = (&dequantized[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
                            let magnitude: f64 = wr.iter().zip(xt).map(|(&a, &b)| f64::from(a * b).abs()).sum();
                            let tol = 1e-5 * (magnitude + quantization_bound(wr, xt));
                            let (g, e) = (got[t * rows + r], want[t * rows + r]);
                            assert!((f64::from(g) - f64::from(e)).abs() <= tol, "{ty} {level:?} {rows}x{cols} n={n} token {t} row {r}: {g} vs scalar {e}");
                        }
                    }
                }
            }
        }
    }
}

/// Float weights are widened to f32 and never rounded: the fast backend agrees with the exact
/// one up to f32 summation order (<= cols * 2^-24 of the magnitude; 1e-5 covers 168 values).
/// 32 tokens and more take the tiled path (padded token columns, blocks of 16 rows).
#[test]
fn float_weights_are_exact_up_to_summation_order() {
    let mut rng = Rng(13);
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        for (rows, cols, n) in [(5, 96, 3), (3, 7, 2), (17, 168, 5), (2, 1024, 1), (37, 100, 32), (5, 7, 33), (18, 160, 70)] {
            let values: Vec<f32> = (0..rows * cols).map(|_| rng.normal()).collect();
            let bytes: Vec<u8> = match ty {
                GgmlType::F16 => values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
                GgmlType::BF16 => values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
                _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            };
            let w = WeightSource { name: format!("{ty}"), ty, rows, cols, owner: Arc::new(bytes.clone()), range: 0..bytes.len() };
            let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
            let mut dequantized = vec![0f32; rows * cols];
            kiln_quant::dequantize(ty, &bytes, &mut dequantized).unwrap();
            let (fast, exact) = (matmul(&CpuBackend::new(), &w, &x, n), matmul(&CpuBackend::exact(), &w, &x, n));
            for t in 0..n {
                for r in 0..rows {
                    let magnitude: f32 = (0..cols).map(|k| (dequantized[r * cols + k] * x[t * cols + k]).abs()).sum();
                    let (f, e) = (fast[t * rows + r], exact[t * rows + r]);
                    assert!((f - e).abs() <= 1e-5 * magnitude, "{ty} {rows}x{cols} token {t} row {r}: {f} vs {e}");
                }
            }
        }
    }
}

/// Throughput of the integer matmul on Qwen3-0.6B's FFN shape at every SIMD level of this CPU (run with --ignored --nocapture;
/// one thread, best of several runs, so that other load on the machine matters less).
/// `KILN_THROUGHPUT_TYPES=Q5_1,IQ4_XS`, `KILN_THROUGHPUT_N=1,64` and `KILN_THROUGHPUT_SHAPE=512x4096`
/// (rows x cols; 512 x 1024 fits in a 512 KiB L2 in the 4-bit formats) choose other formats, token
/// counts and shapes; `KILN_THROUGHPUT_THREADS` and `KILN_THROUGHPUT_REPS` the threads (1) and
/// the repetitions the best is taken of (7).
#[test]
#[ignore]
fn matmul_throughput() {
    let threads = std::env::var("KILN_THROUGHPUT_THREADS").map_or(1, |t| t.parse().expect("threads"));
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    let mut rng = Rng(14);
    let types: Vec<GgmlType> = match std::env::var("KILN_THROUGHPUT_TYPES") {
        Ok(list) => list.split(',').map(|t| GgmlType::from_name(t).unwrap_or_else(|| panic!("unknown type {t}"))).collect(),
        Err(_) => vec![GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0, GgmlType::Q4_0],
    };
    let ns: Vec<usize> = match std::env::var("KILN_THROUGHPUT_N") {
        Ok(list) => list.split(',').map(|n| n.parse().expect("token counts")).collect(),
        Err(_) => vec![1, 2, 4, 8, 16, 64],
    };
    for ty in types {
        let (rows, cols) = match std::env::var("KILN_THROUGHPUT_SHAPE") {
            Ok(shape) => {
                let (r, c) = shape.split_once('x').expect("ROWSxCOLS");
                (r.parse().expect("rows"), c.parse().expect("cols"))
            }
            Err(_) => (3072, 1024),
        };
        let (w, _) = weight(ty, rows, cols, &mut rng);
        for (level, n) in levels().into_iter().filter(|&l| l != SimdLevel::Scalar).flat_map(|l| ns.iter().map(move |&n| (l, n))) {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
            let backend = CpuBackend::with_options(CpuOptions { matmul: CpuMatmul::Quantized, simd: level });
            let w = backend.upload_weight(w.clone()).unwrap();
            let mut xb = backend.alloc(x.len(), "x").unwrap();
            backend.write(&mut xb, &x).unwrap();
            let mut out = backend.alloc(n * rows, "out").unwrap();
            let best = pool.install(|| {
                (0..std::env::var("KILN_THROUGHPUT_REPS").map_or(7, |r| r.parse().expect("repetitions")))
                    .map(|_| {
                        let start = std::time::Instant::now();
                        backend.matmul(&w, xb.rows(n, w.cols).unwrap(), out.rows_mut(n, w.rows).unwrap()).unwrap();
                        start.elapsed().as_secs_f64()
                    })
                    .fold(f64::INFINITY, f64::min)
            });
            let gmacs = (rows * cols * n) as f64 / best / 1e9;
            let gbs = w.bytes().len() as f64 / best / 1e9;
            println!("{ty:6} {level:10?} n={n:3}: {:8.3} ms  {gmacs:7.1} GMAC/s  {gbs:6.1} GB/s of weights", best * 1e3);
        }
    }
}
