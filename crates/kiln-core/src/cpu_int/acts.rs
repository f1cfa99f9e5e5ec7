//! Activations quantized to 8 bits once per matmul, in the layouts the kernels read.
//!
//! Per token: codes `q = round(x / d)` with one scale `d = amax / 127` per 32 values
//! (as ggml's Q8_0), the exact integer sum of every 16 codes, and for the mat-vec
//! kernels `-128 * (sum of each 4 codes)`, which cancels the weights' code bias inside
//! the integer accumulators. For prompts and batches, tiles of [`TOKEN_TILE`] tokens
//! are also interleaved so that one vector holds the same 4 values of 16 tokens.

use kiln_quant::int_rows::CODE_BIAS;

/// Tokens per lane tile of the mat-mat kernels (one 512-bit vector of i32).
pub const TOKEN_TILE: usize = 16;

/// Quantized activations of `n` tokens of `cols` values; buffers keep their capacity.
#[derive(Default)]
pub struct QuantizedActs {
    pub n: usize,
    pub cols: usize,
    /// `[n][cols]` codes.
    pub qs: Vec<i8>,
    /// `[n][cols / 32]` scales.
    pub scale: Vec<f32>,
    /// `[n][cols / 16]` integer sums of 16 codes.
    pub sum16: Vec<i32>,
    /// `[n][cols / 4]`: `-CODE_BIAS * (sum of 4 codes)`.
    pub neg_bias4: Vec<i32>,
    /// `[n][cols / 16]` and `[n][cols / 32]`: scale * code sum, for the weight offsets.
    pub scaled_sum16: Vec<f32>,
    pub scaled_sum32: Vec<f32>,
    /// Token tiles: `[tile][cols / 4][TOKEN_TILE][4]` codes (padding tokens are zero).
    pub tiled_qs: Vec<i8>,
    /// `[tile][cols / 16][TOKEN_TILE]`: `-CODE_BIAS * sum16`.
    pub tiled_neg_bias16: Vec<i32>,
    /// `[tile][cols / 32][TOKEN_TILE]` scales.
    pub tiled_scale: Vec<f32>,
    /// `[tile][cols / 16][TOKEN_TILE]`: scale * sum16, for the weight offsets.
    pub tiled_scaled_sum16: Vec<f32>,
}

fn resize<T: Clone + Default>(v: &mut Vec<T>, len: usize) {
    v.clear();
    v.resize(len, T::default());
}

impl QuantizedActs {
    /// Quantizes `x` (`n` rows of `cols` values, `cols` a multiple of 32); `tiled` also
    /// writes the token-tile layout.
    pub fn quantize(&mut self, x: &[f32], n: usize, cols: usize, tiled: bool) {
        debug_assert!(cols.is_multiple_of(32) && x.len() >= n * cols);
        self.n = n;
        self.cols = cols;
        resize(&mut self.qs, n * cols);
        resize(&mut self.scale, n * cols / 32);
        resize(&mut self.sum16, n * cols / 16);
        resize(&mut self.neg_bias4, n * cols / 4);
        resize(&mut self.scaled_sum16, n * cols / 16);
        resize(&mut self.scaled_sum32, n * cols / 32);
        quantize_rows(self, x);
        if tiled {
            self.tile();
        }
    }

    pub fn n_tiles(&self) -> usize {
        self.n.div_ceil(TOKEN_TILE)
    }

    fn tile(&mut self) {
        let (n, cols, tiles) = (self.n, self.cols, self.n_tiles());
        resize(&mut self.tiled_qs, tiles * cols * TOKEN_TILE);
        resize(&mut self.tiled_neg_bias16, tiles * cols / 16 * TOKEN_TILE);
        resize(&mut self.tiled_scale, tiles * cols / 32 * TOKEN_TILE);
        resize(&mut self.tiled_scaled_sum16, tiles * cols / 16 * TOKEN_TILE);
        for t in 0..n {
            let (tile, lane) = (t / TOKEN_TILE, t % TOKEN_TILE);
            let qs = &self.qs[t * cols..(t + 1) * cols];
            let base = tile * cols * TOKEN_TILE;
            for k4 in 0..cols / 4 {
                let at = base + (k4 * TOKEN_TILE + lane) * 4;
                self.tiled_qs[at..at + 4].copy_from_slice(&qs[4 * k4..4 * k4 + 4]);
            }
            for g in 0..cols / 16 {
                let at = (tile * cols / 16 + g) * TOKEN_TILE + lane;
                let sum = self.sum16[t * cols / 16 + g];
                self.tiled_neg_bias16[at] = -CODE_BIAS * sum;
                self.tiled_scaled_sum16[at] = self.scale[t * cols / 32 + g / 2] * sum as f32;
            }
            for b in 0..cols / 32 {
                self.tiled_scale[(tile * cols / 32 + b) * TOKEN_TILE + lane] = self.scale[t * cols / 32 + b];
            }
        }
    }
}

/// Picks the widest vector instructions for the same loops (the arithmetic is identical,
/// so every level quantizes to the same codes).
fn quantize_rows(acts: &mut QuantizedActs, x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
            // SAFETY: the features were just detected.
            return unsafe { quantize_rows_avx512(acts, x) };
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: as above.
            return unsafe { quantize_rows_avx2(acts, x) };
        }
    }
    quantize_rows_body(acts, x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn quantize_rows_avx512(acts: &mut QuantizedActs, x: &[f32]) {
    quantize_rows_body(acts, x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_rows_avx2(acts: &mut QuantizedActs, x: &[f32]) {
    quantize_rows_body(acts, x)
}

#[inline(always)]
fn quantize_rows_body(acts: &mut QuantizedActs, x: &[f32]) {
    let (n, cols) = (acts.n, acts.cols);
    for t in 0..n {
        let row = &x[t * cols..(t + 1) * cols];
        let qs = &mut acts.qs[t * cols..(t + 1) * cols];
        for (b, (xb, qb)) in row.chunks_exact(32).zip(qs.chunks_exact_mut(32)).enumerate() {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            for (q, &v) in qb.iter_mut().zip(xb) {
                *q = (v * id).round_ties_even() as i8;
            }
            acts.scale[t * cols / 32 + b] = d;
        }
        for (j, s) in acts.sum16[t * cols / 16..(t + 1) * cols / 16].iter_mut().enumerate() {
            *s = qs[16 * j..16 * j + 16].iter().map(|&q| i32::from(q)).sum();
        }
        for j in 0..cols / 32 {
            let (lo, hi) = (acts.sum16[t * cols / 16 + 2 * j], acts.sum16[t * cols / 16 + 2 * j + 1]);
            let d = acts.scale[t * cols / 32 + j];
            acts.scaled_sum16[t * cols / 16 + 2 * j] = d * lo as f32;
            acts.scaled_sum16[t * cols / 16 + 2 * j + 1] = d * hi as f32;
            acts.scaled_sum32[t * cols / 32 + j] = d * (lo + hi) as f32;
        }
        for (j, s) in acts.neg_bias4[t * cols / 4..(t + 1) * cols / 4].iter_mut().enumerate() {
            *s = -CODE_BIAS * qs[4 * j..4 * j + 4].iter().map(|&q| i32::from(q)).sum::<i32>();
        }
    }
}
