//! AVX2 kernels for CPUs without VNNI. `vpmaddubsw` multiplies u8 by i8 into saturating i16
//! pairs, so the biased codes cannot go in as they are (255 x 127 x 2 overflows). Instead each
//! code becomes its signed value `s = code ^ 0x80`, and `|s| * (a * sign(s))` is summed: at most
//! 128 x 127 x 2 = 32,512 per pair, which fits. `vpmaddwd` by ones then adds each 4 products
//! into an i32 lane, as `vpdpbusd` would, and the signed values need no bias term.

use std::arch::x86_64::*;

use super::acts::{QuantizedActs, TOKEN_TILE};
use super::DecodedRow;

/// `acc[i] += sum of the 4 products s[4i..4i+4] * a[4i..4i+4]` of signed bytes (|a| <= 127).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn dot4(acc: __m256i, s: __m256i, a: __m256i) -> __m256i {
    let pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(s), _mm256_sign_epi8(a, s));
    _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
}

/// `row · x[t]`; `coef` is scratch of at least `cols / group + 8` values.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `row` and `acts` have `acts.cols` values, a multiple of 32.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn matvec_row(row: &DecodedRow, acts: &QuantizedActs, t: usize, coef: &mut [f32]) -> f32 {
    if row.group == 32 {
        matvec_row_in::<32>(row, acts, t, coef)
    } else {
        matvec_row_in::<16>(row, acts, t, coef)
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn matvec_row_in<const G: usize>(row: &DecodedRow, acts: &QuantizedActs, t: usize, coef: &mut [f32]) -> f32 {
    let cols = acts.cols;
    let groups = cols / G;
    let act_scale = &acts.scale[t * cols / 32..][..cols / 32];
    // coef[g] = weight scale * activation scale (one activation scale per 32 values).
    for (g, c) in coef[..groups].iter_mut().enumerate() {
        *c = row.scale[g] * act_scale[g * G / 32];
    }
    coef[groups..groups + 8].fill(0.0);
    // Lane j of a 32-value chunk covers values 4j..4j+4: its group, from the chunk's first.
    let lane_group = if G == 32 { _mm256_setzero_si256() } else { _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1) };
    let flip = _mm256_set1_epi8(-128);
    let (codes, qs) = (row.codes.as_ptr(), acts.qs.as_ptr().add(t * cols));
    let chunk = |k: usize, acc: __m256| {
        // SAFETY: k + 32 <= cols, so every load is inside the row, its codes and its coefficients (+8 padding).
        let s = _mm256_xor_si256(_mm256_loadu_si256(codes.add(k).cast()), flip);
        let dot = dot4(_mm256_setzero_si256(), s, _mm256_loadu_si256(qs.add(k).cast()));
        let c = _mm256_permutevar8x32_ps(_mm256_loadu_ps(coef.as_ptr().add(k / G)), lane_group);
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), c, acc)
    };
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut k = 0;
    while k + 64 <= cols {
        acc0 = chunk(k, acc0);
        acc1 = chunk(k + 32, acc1);
        k += 64;
    }
    if k < cols {
        acc0 = chunk(k, acc0);
    }
    let mut total = hsum(_mm256_add_ps(acc0, acc1));
    if row.has_offset {
        let sums = if G == 16 { &acts.scaled_sum16[t * cols / 16..][..groups] } else { &acts.scaled_sum32[t * cols / 32..][..groups] };
        total += row.offset[..groups].iter().zip(sums).map(|(o, s)| o * s).sum::<f32>();
    }
    total
}

/// The sum of the 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn hsum(v: __m256) -> f32 {
    let half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    _mm_cvtss_f32(_mm_add_ss(quarter, _mm_shuffle_ps::<1>(quarter, quarter)))
}

/// The tile kernel of the 8-lane levels (AVX2, AVX-VNNI): `R` rows x the 16 tokens of token
/// tile `tile`, as two 8-lane halves. Each row's word of 4 codes is broadcast against 4 codes of
/// 8 tokens: `$step(acc, word, a)` adds their 4-products to the i32 lanes, which start each
/// group at `$init(bias16, g, per16, half)` (the activations' `tiled_neg_bias16`).
macro_rules! tile_rows_8_lanes {
    ($tile_fn:ident, $rows_fn:ident, $features:literal, $init:expr, $step:expr) => {
        /// # Safety
        /// The CPU has this level; `acts` holds the tiled layout; `rows.len() == R == out.len()`.
        #[target_feature(enable = $features)]
        unsafe fn $rows_fn<const R: usize>(rows: &[DecodedRow], acts: &QuantizedActs, tile: usize, out: &mut [[f32; TOKEN_TILE]]) {
            let (init, step) = ($init, $step);
            let cols = acts.cols;
            let (group, has_offset) = (rows[0].group, rows[0].has_offset);
            let qs = acts.tiled_qs.as_ptr().add(tile * cols * TOKEN_TILE);
            let bias16 = acts.tiled_neg_bias16.as_ptr().add(tile * cols / 16 * TOKEN_TILE);
            let sums16 = acts.tiled_scaled_sum16.as_ptr().add(tile * cols / 16 * TOKEN_TILE);
            let scale = acts.tiled_scale.as_ptr().add(tile * cols / 32 * TOKEN_TILE);
            let codes: [*const u8; R] = std::array::from_fn(|r| rows[r].codes.as_ptr());
            let per16 = group / 16;
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            for g in 0..cols / group {
                let mut dot = [[init(bias16, g, per16, 0), init(bias16, g, per16, 1)]; R];
                for k4 in g * group / 4..(g + 1) * group / 4 {
                    // SAFETY: k4 < cols / 4: 64 bytes of tile codes and 4 bytes of each row are in bounds.
                    let a0 = _mm256_loadu_si256(qs.add(k4 * 4 * TOKEN_TILE).cast());
                    let a1 = _mm256_loadu_si256(qs.add(k4 * 4 * TOKEN_TILE + 32).cast());
                    for r in 0..R {
                        let word = codes[r].add(4 * k4).cast::<u32>().read_unaligned();
                        dot[r][0] = step(dot[r][0], word, a0);
                        dot[r][1] = step(dot[r][1], word, a1);
                    }
                }
                for half in 0..2 {
                    // SAFETY: group g's scales and sums of this tile's 16 tokens are in their buffers.
                    let act_scale = _mm256_loadu_ps(scale.add(g * group / 32 * TOKEN_TILE + 8 * half));
                    let sums = if !has_offset {
                        _mm256_setzero_ps()
                    } else if per16 == 1 {
                        _mm256_loadu_ps(sums16.add(g * TOKEN_TILE + 8 * half))
                    } else {
                        _mm256_add_ps(
                            _mm256_loadu_ps(sums16.add(2 * g * TOKEN_TILE + 8 * half)),
                            _mm256_loadu_ps(sums16.add((2 * g + 1) * TOKEN_TILE + 8 * half)),
                        )
                    };
                    for r in 0..R {
                        let c = _mm256_mul_ps(_mm256_set1_ps(*rows[r].scale.get_unchecked(g)), act_scale);
                        acc[r][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][half]), c, acc[r][half]);
                        if has_offset {
                            acc[r][half] = _mm256_fmadd_ps(_mm256_set1_ps(*rows[r].offset.get_unchecked(g)), sums, acc[r][half]);
                        }
                    }
                }
            }
            for r in 0..R {
                _mm256_storeu_ps(out[r].as_mut_ptr(), acc[r][0]);
                _mm256_storeu_ps(out[r].as_mut_ptr().add(8), acc[r][1]);
            }
        }

        /// Up to 8 rows, four at a time.
        ///
        /// # Safety
        /// As the rows kernel.
        pub unsafe fn $tile_fn(rows: &[DecodedRow], acts: &QuantizedActs, tile: usize, out: &mut [[f32; TOKEN_TILE]]) {
            for (rows, out) in rows.chunks(4).zip(out.chunks_mut(4)) {
                match rows.len() {
                    4 => $rows_fn::<4>(rows, acts, tile, out),
                    3 => $rows_fn::<3>(rows, acts, tile, out),
                    2 => $rows_fn::<2>(rows, acts, tile, out),
                    1 => $rows_fn::<1>(rows, acts, tile, out),
                    n => unreachable!("{n} rows in a chunk of four"),
                }
            }
        }
    };
}
pub(super) use tile_rows_8_lanes;

// Signed codes need no bias: every group's sums start at zero.
tile_rows_8_lanes!(
    matmat_tile_signed,
    matmat_rows_signed,
    "avx2,fma",
    |_: *const i32, _: usize, _: usize, _: usize| _mm256_setzero_si256(),
    |acc: __m256i, word: u32, a: __m256i| { dot4(acc, _mm256_set1_epi32((word ^ 0x8080_8080) as i32), a) }
);

// Codes within 64 of the bias go in as `u - 64` (0..127: 2 x 127 x 127 fits an i16), with no
// abs or sign per row; the sums start at -64 * sum(a), half the activations' bias terms.
tile_rows_8_lanes!(
    matmat_tile_near,
    matmat_rows_near,
    "avx2,fma",
    |bias16: *const i32, g: usize, per16: usize, half: usize| {
        let lanes = |h: usize| _mm256_loadu_si256(bias16.add((g * per16 + h) * TOKEN_TILE + 8 * half).cast());
        let bias = if per16 == 1 { lanes(0) } else { _mm256_add_epi32(lanes(0), lanes(1)) };
        _mm256_srai_epi32::<1>(bias)
    },
    |acc: __m256i, word: u32, a: __m256i| {
        let pairs = _mm256_maddubs_epi16(_mm256_set1_epi32(word.wrapping_sub(0x4040_4040) as i32), a);
        _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    }
);

/// Whether every code lies in 64..192 (signed value within -64..63).
#[target_feature(enable = "avx2,fma")]
fn codes_near_bias(codes: &[u8]) -> bool {
    let chunks = codes.chunks_exact(32);
    let tail = chunks.remainder().iter().all(|&c| (64..192).contains(&c));
    let mut any_far = _mm256_setzero_si256();
    for chunk in chunks {
        // SAFETY: the chunk holds 32 bytes.
        let v = unsafe { _mm256_loadu_si256(chunk.as_ptr().cast()) };
        any_far = _mm256_or_si256(any_far, _mm256_sub_epi8(v, _mm256_set1_epi8(64)));
    }
    tail && _mm256_movemask_epi8(any_far) == 0
}

/// Up to 8 rows x token tile `tile`: the unsigned path when every code of the rows is within
/// 64 of the bias (4-, 5- and 6-bit codes), else the sign trick.
///
/// # Safety
/// The CPU has AVX2 and FMA; `acts` holds the tiled layout; `out` has one entry per row.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn matmat_tile(rows: &[DecodedRow], acts: &QuantizedActs, tile: usize, out: &mut [[f32; TOKEN_TILE]]) {
    if rows.iter().all(|r| codes_near_bias(r.codes)) {
        matmat_tile_near(rows, acts, tile, out)
    } else {
        matmat_tile_signed(rows, acts, tile, out)
    }
}
