//! GPU tests of the weight products (src/matvec.rs): every format against the CPU reference
//! (kiln_quant::dequantize, then f64 dot products), plus bandwidth and mat-mat benchmarks. They need an
//! NVIDIA GPU: run them on the device with scripts/gpu-tests.sh (which passes --include-ignored).
//!
//! Each test checks every case and reports all failures at the end, so one run on the device
//! shows the full picture.

mod common;
use common::rng;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaSlice;
use kiln_core::WeightSource;
use kiln_cuda::matvec::{self, GpuWeight, QuantizedActivations};
use kiln_cuda::{CacheDir, CudaDevice, CudaError, RegistryConfig};
use kiln_quant::GgmlType;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

const FORMATS: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::TQ1_0,
    GgmlType::TQ2_0,
    GgmlType::Q1_0,
    GgmlType::Q2_0,
    GgmlType::MXFP4,
    GgmlType::NVFP4,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ3_S,
    GgmlType::IQ1_S,
    GgmlType::IQ1_M,
];

/// Random blocks of a decode-only (codebook) format with a small finite f16 super-block scale
/// (IQ1_M keeps it in the top nibbles of its four scale words), so values stay well inside f16.
fn random_codebook_blocks(rng: &mut ChaCha8Rng, ty: GgmlType, bytes: &mut [u8]) {
    rng.fill(bytes);
    for block in bytes.chunks_exact_mut(ty.type_size()) {
        let d = half::f16::from_f32(rng.gen_range(-0.05f32..0.05)).to_bits();
        if ty == GgmlType::IQ1_M {
            for k in 0..4 {
                let at = 48 + 2 * k;
                let word = u16::from_le_bytes([block[at], block[at + 1]]) & 0x0fff | ((d >> (4 * k)) & 0xf) << 12;
                block[at..at + 2].copy_from_slice(&word.to_le_bytes());
            }
        } else {
            block[..2].copy_from_slice(&d.to_le_bytes());
        }
    }
}

/// Token counts: every mat-vec specialization class (1, 2-3, 4-8 rows per warp) and the mat-mat.
const TOKEN_COUNTS: &[usize] = &[1, 2, 3, 5, 8, 37];
/// Mat-mat token counts: just past the mat-vec, partial 32- and 64-token tiles, one whole
/// 64-token tile, a partial 128-token tile, several whole ones.
const MATMAT_TOKEN_COUNTS: &[usize] = &[9, 17, 64, 100, 512];

/// Kernel against an f64 reference on the same inputs (for quantized mat-vecs: the activations
/// rounded to int8 exactly as the kernel rounds them), so only f32 rounding differs. The error
/// is measured against sum_c |W[r][c] x[t][c]|, which bounds every summation order's rounding
/// (an output itself may cancel to near zero); that ratio is about 1e-7, and 1e-5 still catches
/// any wrong code, scale or index, which gives errors of order 1e-2 or more.
const ROUNDING_TOLERANCE: f64 = 1e-5;
/// Quantized mat-vecs against the exact product with f32 activations, as the relative L2 error
/// pooled over all cases of a format (a single case may have one output, whose ratio is
/// meaningless). Activations are rounded to int8 per 16 values, an error of at most
/// max|x|/254 per value; for uniform activations the relative error of a dot product is about
/// (1/254/sqrt(3)) / rms(x) = 0.4%, so 1e-2 leaves a 2.5x margin.
const Q8_TOLERANCE: f64 = 1e-2;
/// silu(g) * u combines the errors of two products (silu's slope is at most 1.1).
const Q8_SWIGLU_TOLERANCE: f64 = 2e-2;
/// The tensor-core mat-mat against the exact product with f32 operands, pooled relative L2.
/// It multiplies weights and activations rounded to f16 (round to nearest even; the f64
/// reference of exactly those operands is checked separately at ROUNDING_TOLERANCE). Rounding
/// one value costs a relative error uniform within half an ulp, 2^-11 = 4.9e-4 at most and
/// about 2e-4 RMS; weight and activation errors are independent, so a product term is off by
/// about 3e-4 RMS, and a dot product of independent random-sign terms has the same relative L2
/// error. 2e-3 leaves a 7x margin and still fails on any wrong scale, code or index (1e-2 and up).
const F16_TOLERANCE: f64 = 2e-3;
/// silu(g) * u combines the errors of two products.
const F16_SWIGLU_TOLERANCE: f64 = 4e-3;

fn device() -> &'static CudaDevice {
    static DEVICE: OnceLock<CudaDevice> = OnceLock::new();
    DEVICE.get_or_init(|| {
        CudaDevice::new(0, RegistryConfig { cache_dir: CacheDir::Default, ..Default::default() }).unwrap_or_else(|e| panic!("opening GPU 0 failed: {e}"))
    })
}

fn random_f32(rng: &mut ChaCha8Rng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

/// A weight as GGUF bytes plus its exact dequantized values (row-major).
struct HostWeight {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    bytes: Arc<Vec<u8>>,
    values: Vec<f32>,
    /// `values` rounded to f16, as the mat-mat kernel stores them.
    halves: Vec<f32>,
    /// The f16 values of the streaming mat-mat tiles where they differ from `halves`
    /// (`streaming_halves`).
    streaming: Option<Vec<f32>>,
}

impl HostWeight {
    fn random(rng: &mut ChaCha8Rng, ty: GgmlType, rows: usize, cols: usize) -> HostWeight {
        let mut bytes = vec![0u8; kiln_quant::quantized_size(ty, rows * cols).expect("whole blocks")];
        if kiln_quant::can_quantize(ty) {
            let source = random_f32(rng, rows * cols);
            kiln_quant::quantize(ty, &source, &mut bytes).expect("quantize");
        } else {
            random_codebook_blocks(rng, ty, &mut bytes);
        }
        let mut values = vec![0f32; rows * cols];
        kiln_quant::dequantize(ty, &bytes, &mut values).expect("dequantize");
        let halves: Vec<f32> = values.iter().map(|&v| round_f16(v)).collect();
        let streaming = streaming_halves(ty, &bytes, &values);
        HostWeight { ty, rows, cols, bytes: Arc::new(bytes), values, halves, streaming }
    }

    fn source(&self, name: &str) -> WeightSource {
        WeightSource { name: name.to_string(), ty: self.ty, rows: self.rows, cols: self.cols, range: 0..self.bytes.len(), owner: self.bytes.clone() }
    }

    fn upload(&self, name: &str) -> GpuWeight {
        matvec::upload_weight(device(), &self.source(name)).unwrap_or_else(|e| panic!("upload {name}: {e}"))
    }

    fn is_float(&self) -> bool {
        matches!(self.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
    }

    /// out[t][r] = sum_c W[r][c] * x[t][c] in f64 for W = `weights` (`values` or `halves`),
    /// with sum_c |W[r][c] x[t][c]| as the scale. Parallel over tokens: the mat-mat cases are big.
    fn product(&self, weights: &[f32], x: &[f64], n: usize) -> Expected {
        use rayon::prelude::*;
        let per_token: Vec<(Vec<f64>, Vec<f64>)> = (0..n)
            .into_par_iter()
            .map(|t| {
                let xt = &x[t * self.cols..(t + 1) * self.cols];
                (0..self.rows)
                    .map(|r| {
                        let row = &weights[r * self.cols..(r + 1) * self.cols];
                        let (mut sum, mut abs) = (0f64, 0f64);
                        for (&w, &v) in row.iter().zip(xt) {
                            sum += f64::from(w) * v;
                            abs += (f64::from(w) * v).abs();
                        }
                        (sum, abs)
                    })
                    .unzip()
            })
            .collect();
        let mut expected = Expected { values: Vec::with_capacity(n * self.rows), scale: Vec::with_capacity(n * self.rows) };
        for (values, scale) in per_token {
            expected.values.extend(values);
            expected.scale.extend(scale);
        }
        expected
    }

    /// Whether `matmul` of `n` tokens takes the mat-mat kernel (src/matvec.rs: more tokens than
    /// the mat-vec takes, or float rows whose length is not a multiple of 4).
    fn takes_matmat(&self, n: usize) -> bool {
        n > matvec::MAX_MATVEC_TOKENS || (self.is_float() && self.cols & 3 != 0)
    }

    /// (what the kernel computes exactly, the exact product with the f32 activations): they
    /// differ for quantized weights in the mat-vec path, which rounds activations to int8, and
    /// in the mat-mat, which rounds weights and activations to f16.
    fn products(&self, x: &[f32], n: usize) -> (Expected, Expected) {
        let exact = self.product(&self.values, &widen(x), n);
        if self.takes_matmat(n) {
            return (self.product(&self.halves, &half_activations(x), n), exact);
        }
        if self.is_float() {
            return (exact.clone(), exact);
        }
        (self.product(&self.values, &dequantized_activations(x), n), exact)
    }

    /// `products`, with every result `matmul`'s own pick may compute exactly: in the mat-mat
    /// also the streaming tiles' rounding (the tuner may pick either kind of tile).
    fn computed(&self, x: &[f32], n: usize) -> (Vec<Expected>, Expected) {
        let (computed, exact) = self.products(x, n);
        if self.takes_matmat(n) && self.streaming.is_some() {
            let streaming = streaming_product(self, x, n, &computed);
            return (vec![computed, streaming], exact);
        }
        (vec![computed], exact)
    }
}

/// The mat-mat's reference under the streaming tiles' rounding of the weights: `classic`
/// (`products`' first) for every format but Q4_K.
fn streaming_product(w: &HostWeight, x: &[f32], n: usize, classic: &Expected) -> Expected {
    match &w.streaming {
        Some(halves) => w.product(halves, &half_activations(x), n),
        None => classic.clone(),
    }
}

fn half_activations(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(round_f16(v))).collect()
}

/// Q4_K and Q6_K as the streaming mat-mat tiles decode them (mma_stream.cuh): the f32 scale
/// (and offset) of each sub-block is rounded to f16, then each value is round16(s16 q + o16)
/// (one f16 fma). None for the formats they decode exactly. `values`: the exact dequantization.
fn streaming_halves(ty: GgmlType, bytes: &[u8], values: &[f32]) -> Option<Vec<f32>> {
    let f16_at = |b: &[u8], i: usize| half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
    if ty == GgmlType::Q6_K {
        // ql[128], qh[64], scales[16] (i8, one per 16 values in value order), d.
        let mut out = Vec::with_capacity(values.len());
        for (block, value) in bytes.chunks_exact(210).zip(values.chunks_exact(256)) {
            let d = f16_at(block, 208);
            for (j, &v) in value.iter().enumerate() {
                let s = d * f32::from(block[192 + j / 16] as i8);
                // d sc (q - 32) is exact in f32 (at most 24 significant bits), so q - 32 is too.
                let code = if s == 0.0 { 0.0 } else { f64::from(v / s).round() };
                out.push(half::f16::from_f64(f64::from(round_f16(s)) * code).to_f32());
            }
        }
        return Some(out);
    }
    if ty != GgmlType::Q4_K {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len() / 144 * 256);
    for block in bytes.chunks_exact(144) {
        let (d, dmin, scales, qs) = (f16_at(block, 0), f16_at(block, 2), &block[4..16], &block[16..]);
        for sub in 0..8 {
            // ggml's get_scale_min_k4.
            let (sc, m) = if sub < 4 {
                (scales[sub] & 63, scales[sub + 4] & 63)
            } else {
                ((scales[sub + 4] & 0xf) | ((scales[sub - 4] >> 6) << 4), (scales[sub + 4] >> 4) | ((scales[sub] >> 6) << 4))
            };
            let (s, o) = (f64::from(round_f16(d * f32::from(sc))), f64::from(round_f16(-(dmin * f32::from(m)))));
            for l in 0..32 {
                let byte = qs[32 * (sub / 2) + l];
                let q = if sub % 2 == 0 { byte & 0xf } else { byte >> 4 };
                out.push(half::f16::from_f64(s * f64::from(q) + o).to_f32());
            }
        }
    }
    Some(out)
}

/// Reference outputs and the per-output scale their rounding error is measured against.
#[derive(Clone)]
struct Expected {
    values: Vec<f64>,
    scale: Vec<f64>,
}

impl Expected {
    /// silu(g) * u per output; its scale propagates the scales of g and u to first order.
    fn swiglu(gate: &Expected, up: &Expected) -> Expected {
        let mut out = Expected { values: Vec::new(), scale: Vec::new() };
        for i in 0..gate.values.len() {
            let (g, u) = (gate.values[i], up.values[i]);
            out.values.push(silu(g) * u);
            out.scale.push(1.1 * u.abs() * gate.scale[i] + silu(g).abs() * up.scale[i]);
        }
        out
    }

    /// ||got - values|| / ||scale||; infinite when an output is not finite.
    fn error(&self, got: &[f32]) -> f64 {
        if !got.iter().all(|v| v.is_finite()) {
            return f64::INFINITY;
        }
        let err: f64 = got.iter().zip(&self.values).map(|(&g, &w)| (f64::from(g) - w).powi(2)).sum();
        let scale: f64 = self.scale.iter().map(|s| s * s).sum();
        (err / scale.max(f64::MIN_POSITIVE)).sqrt()
    }
}

/// Relative L2 error pooled over many cases.
#[derive(Default)]
struct Pool {
    err2: f64,
    norm2: f64,
}

impl Pool {
    fn add(&mut self, got: &[f32], want: &[f64]) {
        for (&g, &w) in got.iter().zip(want) {
            self.err2 += (f64::from(g) - w).powi(2);
            self.norm2 += w * w;
        }
    }

    fn check(&self, failures: &mut Vec<String>, what: &str, tolerance: f64) {
        let relative = (self.err2 / self.norm2.max(f64::MIN_POSITIVE)).sqrt();
        eprintln!("{what}: pooled relative L2 error against the exact product {relative:.2e}");
        if relative.is_nan() || relative > tolerance {
            failures.push(format!("{what}: pooled relative L2 error {relative:.3e} > {tolerance:.0e} against the exact product"));
        }
    }
}

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// Round to nearest even f16, like the kernels' cvt.rn.f16x2.f32.
fn round_f16(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

/// The activations as the quantized mat-vec kernels see them (matvec_input.cu): per 16 values,
/// d = max|x| / 127 and x ~ d * round-half-even(x * 127 / max|x|), all in f32 like the kernel.
fn dequantized_activations(x: &[f32]) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for chunk in x.chunks(16) {
        let amax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inverse = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        out.extend(chunk.iter().map(|&v| f64::from(d) * f64::from((v * inverse).round_ties_even())));
    }
    out
}

/// Extra poisoned values after each output: a kernel writing past `n * rows` turns them finite.
const GUARD: usize = 64;

fn poisoned(len: usize) -> CudaSlice<f32> {
    device().alloc_poisoned::<f32>(len + GUARD, "test output").expect("alloc")
}

fn upload_f32(values: &[f32]) -> CudaSlice<f32> {
    device().upload(values, "test input").expect("upload")
}

/// Downloads `len` values and checks the guard after them is still poison.
fn download(out: &CudaSlice<f32>, len: usize, failures: &mut Vec<String>, case: &str) -> Vec<f32> {
    let all = device().download(out).expect("download");
    if all[len..].iter().any(|v| !v.is_nan()) {
        failures.push(format!("{case}: wrote past the end of the output"));
    }
    all[..len].to_vec()
}

fn report(test: &str, failures: Vec<String>) {
    assert!(failures.is_empty(), "{test}: {} failing cases:\n{}", failures.len(), failures.join("\n"));
}

/// Row lengths per format: one block, a few blocks not filling a 512-value tile, and several
/// tiles plus a remainder (for floats: odd, a multiple of 4 but not 16, and long).
fn column_choices(ty: GgmlType) -> [usize; 3] {
    match ty.block_size() {
        1 => [7, 100, 4100],
        32 => [96, 512, 4128],
        64 => [64, 448, 4160],
        128 => [128, 640, 4224],
        _ => [256, 768, 4352],
    }
}

/// (rows, cols) cases: rows 1, 5, 7, 33 and 4097 (a partial last block of the grid).
fn shapes(ty: GgmlType) -> Vec<(usize, usize)> {
    let [small, mid, big] = column_choices(ty);
    vec![(1, big), (7, mid), (33, big), (5, small), (4097, small)]
}

/// The mat-mat's references a tile's result must match: the streaming tiles round Q4_K's scales
/// to f16 first; `matmul`'s own pick (None) may be either kind.
fn references<'a>(tile: Option<usize>, classic: &'a Expected, streaming: &'a Expected) -> Vec<&'a Expected> {
    match tile {
        Some(t) if matvec::matmat_tile_is_streaming(t) => vec![streaming],
        Some(_) => vec![classic],
        None => vec![classic, streaming],
    }
}

/// `check` against the closest of several references.
fn check_any(failures: &mut Vec<String>, case: &str, got: &[f32], expected: &[&Expected]) {
    let error = expected.iter().map(|e| e.error(got)).fold(f64::NAN, f64::min);
    if error.is_nan() || error > ROUNDING_TOLERANCE {
        failures.push(format!("{case}: error {error:.3e} > {ROUNDING_TOLERANCE:.0e} (relative to sum |w x|)"));
    }
}

fn check(failures: &mut Vec<String>, case: &str, got: &[f32], expected: &Expected) {
    let error = expected.error(got);
    if error.is_nan() || error > ROUNDING_TOLERANCE {
        failures.push(format!("{case}: error {error:.3e} > {ROUNDING_TOLERANCE:.0e} (relative to sum |w x|)"));
    }
}

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
    for &ty in FORMATS.iter().filter(|t| !matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)) {
        let [small, _, big] = column_choices(ty);
        for (rows, cols) in [(37, big), (4099, small)] {
            let (gate, up) = (HostWeight::random(&mut rng, ty, rows, cols), HostWeight::random(&mut rng, ty, rows, cols));
            let (gate_gpu, up_gpu) = (gate.upload("gate"), up.upload("up"));
            for n in 1..=matvec::MAX_MATVEC_TOKENS {
                let x = random_f32(&mut rng, n * cols);
                let mut q = QuantizedActivations::new(device(), n, cols).expect("activations");
                matvec::quantize_activations(device(), &upload_f32(&x), n, &mut q).expect("quantize");
                let (g, u) = (gate.products(&x, n).0, up.products(&x, n).0);
                let base = random_f32(&mut rng, n * rows);
                for shape in 0..matvec::MATVEC_SHAPE_COUNT {
                    let case = format!("{ty} {rows}x{cols} n={n} shape {shape}");
                    let mut out = poisoned(n * rows);
                    matvec::matmul_quantized_with_shape(device(), &gate_gpu, None, &q, &mut out, n, false, shape).expect("matvec");
                    let got = download(&out, n * rows, &mut failures, &case);
                    check(&mut failures, &case, &got, &g);
                    let mut out = upload_f32(&base);
                    matvec::matmul_quantized_with_shape(device(), &gate_gpu, None, &q, &mut out, n, true, shape).expect("matvec add");
                    let added: Vec<f32> = download(&out, n * rows, &mut failures, &case).iter().zip(&base).map(|(o, b)| o - b).collect();
                    check(&mut failures, &format!("{case} add"), &added, &g);
                    let mut out = poisoned(n * rows);
                    matvec::matmul_quantized_with_shape(device(), &gate_gpu, Some(&up_gpu), &q, &mut out, n, false, shape).expect("swiglu");
                    let got = download(&out, n * rows, &mut failures, &case);
                    check(&mut failures, &format!("{case} swiglu"), &got, &Expected::swiglu(&g, &u));
                }
            }
        }
    }
    report("matvec shapes", failures);
}

/// Stacked launches give each weight its own product: three weights of one format (q, k, v),
/// and two of one format then one of another (two launches), for every quantized format.
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
                    if let Err(e) = matvec::matmul_stacked_quantized(device(), &weights, &q, &mut [&mut a, &mut b, &mut c], n) {
                        failures.push(format!("{case}: {e}"));
                        continue;
                    }
                    for ((out, host), name) in [a, b, c].iter().zip(&hosts).zip(["a", "b", "c"]) {
                        let got = download(out, n * host.rows, &mut failures, &case);
                        check(&mut failures, &format!("{case} {name}"), &got, &host.products(&x, n).0);
                    }
                }
            }
        }
    }
    report("stacked", failures);
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
        matvec::matmul_quantized(device(), weight, &shared, &mut shared_out, n, false).expect("matmul_quantized");
        let direct = download(&direct, n * rows, &mut failures, &case);
        let shared_out = download(&shared_out, n * rows, &mut failures, &case);
        if direct.iter().zip(&shared_out).any(|(a, b)| a.to_bits() != b.to_bits()) {
            failures.push(format!("{case}: shared quantization differs from matmul's own"));
        }
        check(&mut failures, &case, &shared_out, &host.products(&x, n).0);
    }
    let mut out = poisoned(n * rows);
    matvec::matmul_swiglu_quantized(device(), &weights[0], &weights[0], &shared, &mut out, n).expect("swiglu");
    let got = download(&out, n * rows, &mut failures, "prequantized swiglu");
    let g = hosts[0].products(&x, n).0;
    check(&mut failures, "prequantized swiglu", &got, &Expected::swiglu(&g, &g));
    // More tokens than the buffer holds, and a float weight, are refused.
    assert!(matches!(matvec::quantize_activations(device(), &x_gpu, 5, &mut shared), Err(CudaError::InvalidArgument { .. })));
    let float = HostWeight::random(&mut rng, GgmlType::F16, rows, cols).upload("f16");
    let mut out = poisoned(n * rows);
    assert!(matches!(matvec::matmul_quantized(device(), &float, &shared, &mut out, n, false), Err(CudaError::InvalidArgument { .. })));
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
    // Q8_K is ggml's activation format, never a weight: no GPU layout.
    let bytes = GgmlType::Q8_K.type_size();
    let unsupported = WeightSource { name: "q8_k".into(), ty: GgmlType::Q8_K, rows: 1, cols: 256, range: 0..bytes, owner: Arc::new(vec![0u8; bytes]) };
    assert!(matches!(matvec::upload_weight(device(), &unsupported), Err(CudaError::InvalidArgument { .. })));
}

/// The product's kernel: `matmul`'s own pick (`None`) or the mat-mat with a given block shape.
/// Compiles every kernel module of `w`'s format at once, on all cores, as a model load does,
/// rather than one by one as the tiles are first launched.
fn prepare_modules(w: &GpuWeight) {
    device().registry().prepare(&matvec::module_keys(w)).expect("compiling the format's kernel modules");
}

fn tile_name(tile: Option<usize>) -> String {
    tile.map_or("auto".to_string(), |t| format!("tile {t}"))
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
                    let ms = time_ms(ROUNDS * copies, |i| matvec::matmul_quantized(device(), &weights[i % copies], &q, &mut out, n, false).expect("matvec"));
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
