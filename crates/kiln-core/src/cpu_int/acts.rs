//! Activations quantized to 8 bits once per matmul, in the layouts the kernels read.
//!
//! Per token: codes `q = round(x / d)` with one scale `d = amax / 127` per 32 values
//! (as ggml's Q8_0, rounding half to even), the exact integer sum of every 16 codes,
//! and those sums times their scale. For prompts and batches, tiles of [`TOKEN_TILE`] tokens
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
    /// `[n][cols / 4]`: `-CODE_BIAS * (sum of 4 codes)`, which cancels the weights' code
    /// bias exactly inside the integer accumulators of the row-by-row kernels.
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

    /// Block `b`'s scale and the sums of its two halves' codes.
    fn set_block(&mut self, b: usize, d: f32, s_lo: i32, s_hi: i32) {
        self.scale[b] = d;
        self.sum16[2 * b] = s_lo;
        self.sum16[2 * b + 1] = s_hi;
        self.scaled_sum16[2 * b] = d * s_lo as f32;
        self.scaled_sum16[2 * b + 1] = d * s_hi as f32;
        self.scaled_sum32[b] = d * (s_lo + s_hi) as f32;
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

/// The AVX-512 or AVX2 quantizer where the CPU has it, else the scalar one; all round the same
/// products the same way, so they write identical codes.
fn quantize_rows(acts: &mut QuantizedActs, x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
        // SAFETY: the features were just detected; `quantize` sized every buffer for n x cols.
        return unsafe { quantize_rows_avx512(acts, x) };
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: as above.
        return unsafe { quantize_rows_avx2(acts, x) };
    }
    quantize_rows_scalar(acts, x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn quantize_rows_avx512(acts: &mut QuantizedActs, x: &[f32]) {
    use std::arch::x86_64::*;
    let blocks = acts.n * acts.cols / 32;
    let (xp, qs) = (x.as_ptr(), acts.qs.as_mut_ptr());
    let abs_mask = _mm512_set1_epi32(0x7fff_ffff);
    for b in 0..blocks {
        // SAFETY: block b of n x cols values, codes, scales and sums (buffers sized by `quantize`).
        let (lo, hi) = (_mm512_loadu_ps(xp.add(32 * b)), _mm512_loadu_ps(xp.add(32 * b + 16)));
        let abs = |v: __m512| _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), abs_mask));
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(abs(lo), abs(hi)));
        let d = amax / 127.0;
        let id = _mm512_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        // The default rounding mode is to nearest, ties to even.
        let (q_lo, q_hi) = (_mm512_cvtps_epi32(_mm512_mul_ps(lo, id)), _mm512_cvtps_epi32(_mm512_mul_ps(hi, id)));
        _mm_storeu_si128(qs.add(32 * b).cast(), _mm512_cvtsepi32_epi8(q_lo));
        _mm_storeu_si128(qs.add(32 * b + 16).cast(), _mm512_cvtsepi32_epi8(q_hi));
        let (s_lo, s_hi) = (_mm512_reduce_add_epi32(q_lo), _mm512_reduce_add_epi32(q_hi));
        // Sums of each 4 lanes end up in lanes 0, 4, 8, 12, then packed together.
        let fours = |q: __m512i| {
            let pairs = _mm512_add_epi32(q, _mm512_shuffle_epi32::<0b10_11_00_01>(q));
            let quads = _mm512_add_epi32(pairs, _mm512_shuffle_epi32::<0b01_00_11_10>(pairs));
            _mm512_castsi512_si128(_mm512_maskz_compress_epi32(0x1111, _mm512_mullo_epi32(quads, _mm512_set1_epi32(-CODE_BIAS))))
        };
        _mm_storeu_si128(acts.neg_bias4.as_mut_ptr().add(8 * b).cast(), fours(q_lo));
        _mm_storeu_si128(acts.neg_bias4.as_mut_ptr().add(8 * b + 4).cast(), fours(q_hi));
        acts.set_block(b, d, s_lo, s_hi);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_rows_avx2(acts: &mut QuantizedActs, x: &[f32]) {
    use std::arch::x86_64::*;
    let blocks = acts.n * acts.cols / 32;
    let (xp, qs) = (x.as_ptr(), acts.qs.as_mut_ptr());
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    // packs_epi32 then packs_epi16 leave each 4 codes' dword in the order 0, 2, 4, 6, 1, 3, 5, 7.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for b in 0..blocks {
        // SAFETY: block b of n x cols values, codes, scales and sums (buffers sized by `quantize`).
        let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(xp.add(32 * b + 8 * i)));
        let m = _mm256_max_ps(
            _mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
            _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)),
        );
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        // The default rounding mode is to nearest, ties to even.
        let q: [__m256i; 4] = std::array::from_fn(|i| _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id)));
        let codes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
        _mm256_storeu_si256(qs.add(32 * b).cast(), codes);
        let fours = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), codes), _mm256_set1_epi16(1));
        _mm256_storeu_si256(acts.neg_bias4.as_mut_ptr().add(8 * b).cast(), _mm256_mullo_epi32(fours, _mm256_set1_epi32(-CODE_BIAS)));
        let mut sums = [0i32; 8];
        _mm256_storeu_si256(sums.as_mut_ptr().cast(), fours);
        acts.set_block(b, d, sums[..4].iter().sum(), sums[4..].iter().sum());
    }
}

/// The reference quantizer.
fn quantize_rows_scalar(acts: &mut QuantizedActs, x: &[f32]) {
    let blocks = acts.n * acts.cols / 32;
    for b in 0..blocks {
        let xb = &x[32 * b..32 * b + 32];
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let qb = &mut acts.qs[32 * b..32 * b + 32];
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = (v * id).round_ties_even().clamp(-128.0, 127.0) as i8;
        }
        let sum = |q: &[i8]| q.iter().map(|&q| i32::from(q)).sum::<i32>();
        let (s_lo, s_hi) = (sum(&qb[..16]), sum(&qb[16..]));
        for j in 0..8 {
            acts.neg_bias4[8 * b + j] = -CODE_BIAS * sum(&qb[4 * j..4 * j + 4]);
        }
        acts.set_block(b, d, s_lo, s_hi);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_simd_quantizer_writes_what_the_scalar_one_writes() {
        let mut state = 5u64;
        let mut next = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 8.0
        };
        for (n, cols) in [(1, 32), (3, 96), (17, 1024)] {
            let mut x: Vec<f32> = (0..n * cols).map(|_| next()).collect();
            x[5] = 0.0;
            let last = x.len() - 1;
            x[40.min(last)] = 2.5; // a tie
            x[..32].fill(0.0); // an all-zero block
            let (mut simd, mut scalar) = (QuantizedActs::default(), QuantizedActs::default());
            simd.quantize(&x, n, cols, true);
            scalar.quantize(&x, n, cols, true);
            quantize_rows_scalar(&mut scalar, &x);
            assert_eq!(simd.qs, scalar.qs, "{n}x{cols}");
            assert_eq!(simd.sum16, scalar.sum16);
            assert_eq!(simd.neg_bias4, scalar.neg_bias4);
            assert_eq!(simd.scale.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), scalar.scale.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            assert_eq!(simd.scaled_sum32.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), scalar.scaled_sum32.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            // Codes reproduce x within half a step.
            for (i, (&q, &v)) in scalar.qs.iter().zip(&x).enumerate() {
                let d = scalar.scale[i / 32];
                assert!((f32::from(q) * d - v).abs() <= 0.5001 * d, "{i}: {q} * {d} vs {v}");
            }
        }
    }
}
