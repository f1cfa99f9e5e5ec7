//! What the GPU weight-product tests and benchmarks share: the device, the formats, random
//! weights with their exact values, f64 reference products and the checks against them.
#![allow(dead_code)]

use std::sync::{Arc, OnceLock};

use cudarc::driver::CudaSlice;
use kiln_core::WeightSource;
use kiln_cuda::matvec::{self, GpuWeight};
use kiln_cuda::{CacheDir, CudaDevice, RegistryConfig};
use kiln_quant::GgmlType;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
pub const FORMATS: &[GgmlType] = &[
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

/// Random blocks of an IQ1/IQ2 codebook format with a small finite f16 super-block scale
/// (IQ1_M keeps it in the top nibbles of its four scale words), so values stay well inside f16.
pub fn random_codebook_blocks(rng: &mut ChaCha8Rng, ty: GgmlType, bytes: &mut [u8]) {
    rng.fill(bytes);
    kiln_quant::set_codebook_scales(ty, bytes, || half::f16::from_f32(rng.gen_range(-0.05f32..0.05)).to_bits()).expect("an IQ1/IQ2 type and whole blocks");
}

/// Token counts: every mat-vec specialization class (1, 2-3, 4-8 rows per warp) and the mat-mat.
pub const TOKEN_COUNTS: &[usize] = &[1, 2, 3, 5, 8, 37];
/// Mat-mat token counts: just past the mat-vec, partial 32- and 64-token tiles, one whole
/// 64-token tile, a partial 128-token tile, several whole ones.
pub const MATMAT_TOKEN_COUNTS: &[usize] = &[9, 17, 64, 100, 512];

/// Kernel against an f64 reference on the same inputs (for quantized mat-vecs: the activations
/// rounded to int8 exactly as the kernel rounds them), so only f32 rounding differs. The error
/// is measured against sum_c |W[r][c] x[t][c]|, which bounds every summation order's rounding
/// (an output itself may cancel to near zero); that ratio is about 1e-7, and 1e-5 still catches
/// any wrong code, scale or index, which gives errors of order 1e-2 or more.
pub const ROUNDING_TOLERANCE: f64 = 1e-5;
/// Quantized mat-vecs against the exact product with f32 activations, as the relative L2 error
/// pooled over all cases of a format (a single case may have one output, whose ratio is
/// meaningless). Activations are rounded to int8 per 16 values, an error of at most
/// max|x|/254 per value; for uniform activations the relative error of a dot product is about
/// (1/254/sqrt(3)) / rms(x) = 0.4%, so 1e-2 leaves a 2.5x margin.
pub const Q8_TOLERANCE: f64 = 1e-2;
/// silu(g) * u combines the errors of two products (silu's slope is at most 1.1).
pub const Q8_SWIGLU_TOLERANCE: f64 = 2e-2;
/// The tensor-core mat-mat against the exact product with f32 operands, pooled relative L2.
/// It multiplies weights and activations rounded to f16 (round to nearest even; the f64
/// reference of exactly those operands is checked separately at ROUNDING_TOLERANCE). Rounding
/// one value costs a relative error uniform within half an ulp, 2^-11 = 4.9e-4 at most and
/// about 2e-4 RMS; weight and activation errors are independent, so a product term is off by
/// about 3e-4 RMS, and a dot product of independent random-sign terms has the same relative L2
/// error. 2e-3 leaves a 7x margin and still fails on any wrong scale, code or index (1e-2 and up).
pub const F16_TOLERANCE: f64 = 2e-3;
/// silu(g) * u combines the errors of two products.
pub const F16_SWIGLU_TOLERANCE: f64 = 4e-3;

pub fn device() -> &'static CudaDevice {
    static DEVICE: OnceLock<CudaDevice> = OnceLock::new();
    DEVICE.get_or_init(|| {
        CudaDevice::new(0, RegistryConfig { cache_dir: CacheDir::Default, ..Default::default() }).unwrap_or_else(|e| panic!("opening GPU 0 failed: {e}"))
    })
}

pub fn random_f32(rng: &mut ChaCha8Rng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

/// A weight as GGUF bytes plus its exact dequantized values (row-major).
pub struct HostWeight {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: Arc<Vec<u8>>,
    pub values: Vec<f32>,
    /// `values` rounded to f16, as the mat-mat kernel stores them.
    pub halves: Vec<f32>,
    /// The f16 values of the streaming mat-mat tiles where they differ from `halves`
    /// (`streaming_halves`).
    pub streaming: Option<Vec<f32>>,
}

impl HostWeight {
    pub fn random(rng: &mut ChaCha8Rng, ty: GgmlType, rows: usize, cols: usize) -> HostWeight {
        let mut bytes = vec![0u8; kiln_quant::quantized_size(ty, rows * cols).expect("whole blocks")];
        // The IQ1/IQ2 codebook formats get random blocks: they reach every grid point and sign
        // pattern, and ggml's searches take up to 1.4 µs a value.
        if !matches!(ty, GgmlType::IQ2_XXS | GgmlType::IQ2_XS | GgmlType::IQ2_S | GgmlType::IQ1_S | GgmlType::IQ1_M) {
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

    pub fn source(&self, name: &str) -> WeightSource {
        WeightSource { name: name.to_string(), ty: self.ty, rows: self.rows, cols: self.cols, range: 0..self.bytes.len(), owner: self.bytes.clone() }
    }

    pub fn upload(&self, name: &str) -> GpuWeight {
        matvec::upload_weight(device(), &self.source(name)).unwrap_or_else(|e| panic!("upload {name}: {e}"))
    }

    pub fn is_float(&self) -> bool {
        matches!(self.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
    }

    /// out[t][r] = sum_c W[r][c] * x[t][c] in f64 for W = `weights` (`values` or `halves`),
    /// with sum_c |W[r][c] x[t][c]| as the scale. Parallel over tokens: the mat-mat cases are big.
    pub fn product(&self, weights: &[f32], x: &[f64], n: usize) -> Expected {
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
    pub fn takes_matmat(&self, n: usize) -> bool {
        n > matvec::MAX_MATVEC_TOKENS || (self.is_float() && self.cols & 3 != 0)
    }

    /// (what the kernel computes exactly, the exact product with the f32 activations): they
    /// differ for quantized weights in the mat-vec path, which rounds activations to int8, and
    /// in the mat-mat, which rounds weights and activations to f16.
    pub fn products(&self, x: &[f32], n: usize) -> (Expected, Expected) {
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
    pub fn computed(&self, x: &[f32], n: usize) -> (Vec<Expected>, Expected) {
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
pub fn streaming_product(w: &HostWeight, x: &[f32], n: usize, classic: &Expected) -> Expected {
    match &w.streaming {
        Some(halves) => w.product(halves, &half_activations(x), n),
        None => classic.clone(),
    }
}

pub fn half_activations(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(round_f16(v))).collect()
}

/// Q4_K and Q6_K as the streaming mat-mat tiles decode them (mma_stream.cuh): the f32 scale
/// (and offset) of each sub-block is rounded to f16, then each value is round16(s16 q + o16)
/// (one f16 fma). None for the formats they decode exactly. `values`: the exact dequantization.
pub fn streaming_halves(ty: GgmlType, bytes: &[u8], values: &[f32]) -> Option<Vec<f32>> {
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
pub struct Expected {
    pub values: Vec<f64>,
    pub scale: Vec<f64>,
}

impl Expected {
    /// silu(g) * u per output; its scale propagates the scales of g and u to first order.
    pub fn swiglu(gate: &Expected, up: &Expected) -> Expected {
        let mut out = Expected { values: Vec::new(), scale: Vec::new() };
        for i in 0..gate.values.len() {
            let (g, u) = (gate.values[i], up.values[i]);
            out.values.push(silu(g) * u);
            out.scale.push(1.1 * u.abs() * gate.scale[i] + silu(g).abs() * up.scale[i]);
        }
        out
    }

    /// The product plus a bias per row (outputs `[n][rows]`); the bias adds one f32 rounding,
    /// far under the product's.
    pub fn with_bias(&self, bias: &[f32]) -> Expected {
        let values = self.values.iter().enumerate().map(|(i, v)| v + f64::from(bias[i % bias.len()])).collect();
        Expected { values, scale: self.scale.clone() }
    }

    /// ||got - values|| / ||scale||; infinite when an output is not finite.
    pub fn error(&self, got: &[f32]) -> f64 {
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
pub struct Pool {
    pub err2: f64,
    pub norm2: f64,
}

impl Pool {
    pub fn add(&mut self, got: &[f32], want: &[f64]) {
        for (&g, &w) in got.iter().zip(want) {
            self.err2 += (f64::from(g) - w).powi(2);
            self.norm2 += w * w;
        }
    }

    pub fn check(&self, failures: &mut Vec<String>, what: &str, tolerance: f64) {
        let relative = (self.err2 / self.norm2.max(f64::MIN_POSITIVE)).sqrt();
        eprintln!("{what}: pooled relative L2 error against the exact product {relative:.2e}");
        if relative.is_nan() || relative > tolerance {
            failures.push(format!("{what}: pooled relative L2 error {relative:.3e} > {tolerance:.0e} against the exact product"));
        }
    }
}

pub fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// Round to nearest even f16, like the kernels' cvt.rn.f16x2.f32.
pub fn round_f16(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

pub fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

/// The activations as the quantized mat-vec kernels see them (matvec_input.cu): per 16 values,
/// d = max|x| / 127 and x ~ d * round-half-even(x * 127 / max|x|), all in f32 like the kernel.
pub fn dequantized_activations(x: &[f32]) -> Vec<f64> {
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
pub const GUARD: usize = 64;

pub fn poisoned(len: usize) -> CudaSlice<f32> {
    device().alloc_poisoned::<f32>(len + GUARD, "test output").expect("alloc")
}

pub fn upload_f32(values: &[f32]) -> CudaSlice<f32> {
    device().upload(values, "test input").expect("upload")
}

/// Downloads `len` values and checks the guard after them is still poison.
pub fn download(out: &CudaSlice<f32>, len: usize, failures: &mut Vec<String>, case: &str) -> Vec<f32> {
    let all = device().download(out).expect("download");
    if all[len..].iter().any(|v| !v.is_nan()) {
        failures.push(format!("{case}: wrote past the end of the output"));
    }
    all[..len].to_vec()
}

pub fn report(test: &str, failures: Vec<String>) {
    assert!(failures.is_empty(), "{test}: {} failing cases:\n{}", failures.len(), failures.join("\n"));
}

/// Row lengths per format: one block, a few blocks not filling a 512-value tile, and several
/// tiles plus a remainder (for floats: odd, a multiple of 4 but not 16, and long).
pub fn column_choices(ty: GgmlType) -> [usize; 3] {
    match ty.block_size() {
        1 => [7, 100, 4100],
        32 => [96, 512, 4128],
        64 => [64, 448, 4160],
        128 => [128, 640, 4224],
        _ => [256, 768, 4352],
    }
}

/// (rows, cols) cases: rows 1, 5, 7, 9, 33 and 4097 (a partial last block of the grid); the
/// float formats' widths are 4 past a multiple of 8 except 4 * mid.
pub fn shapes(ty: GgmlType) -> Vec<(usize, usize)> {
    let [small, mid, big] = column_choices(ty);
    vec![(1, big), (7, mid), (33, big), (5, small), (4097, small), (9, 4 * mid)]
}

/// The mat-mat's references a tile's result must match: the streaming tiles round Q4_K's scales
/// to f16 first; `matmul`'s own pick (None) may be either kind.
pub fn references<'a>(tile: Option<usize>, classic: &'a Expected, streaming: &'a Expected) -> Vec<&'a Expected> {
    match tile {
        Some(t) if matvec::matmat_tile_is_streaming(t) => vec![streaming],
        Some(_) => vec![classic],
        None => vec![classic, streaming],
    }
}

/// `check` against the closest of several references.
pub fn check_any(failures: &mut Vec<String>, case: &str, got: &[f32], expected: &[&Expected]) {
    let error = expected.iter().map(|e| e.error(got)).fold(f64::NAN, f64::min);
    if error.is_nan() || error > ROUNDING_TOLERANCE {
        failures.push(format!("{case}: error {error:.3e} > {ROUNDING_TOLERANCE:.0e} (relative to sum |w x|)"));
    }
}

pub fn check(failures: &mut Vec<String>, case: &str, got: &[f32], expected: &Expected) {
    let error = expected.error(got);
    if error.is_nan() || error > ROUNDING_TOLERANCE {
        failures.push(format!("{case}: error {error:.3e} > {ROUNDING_TOLERANCE:.0e} (relative to sum |w x|)"));
    }
}

/// Compiles every kernel module of `w`'s format at once, on all cores, as a model load does,
/// rather than one by one as the tiles are first launched.
pub fn prepare_modules(w: &GpuWeight) {
    device().registry().prepare(&matvec::module_keys(w)).expect("compiling the format's kernel modules");
}

/// Compiles the mat-vec modules of every format in `types` (each token count and launch shape)
/// in one go on all cores; one after another they take more than ten minutes on a cold machine.
pub fn prepare_matvec_modules(rng: &mut ChaCha8Rng, types: &[GgmlType]) {
    let keys: Vec<_> =
        types.iter().flat_map(|&ty| matvec::matvec_module_keys(&HostWeight::random(rng, ty, 1, column_choices(ty)[0]).upload("module preparation"))).collect();
    device().registry().prepare(&keys).expect("compiling the mat-vec kernel modules");
}

/// The product's kernel: `matmul`'s own pick (`None`) or the mat-mat with a given block shape.
pub fn tile_name(tile: Option<usize>) -> String {
    tile.map_or("auto".to_string(), |t| format!("tile {t}"))
}
