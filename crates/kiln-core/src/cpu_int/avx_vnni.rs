//! AVX-VNNI kernels (the 256-bit `vpdpbusd` of CPUs with VNNI but without AVX-512, such as
//! Alder Lake and later client cores): the AVX-512 kernels' arithmetic on 8 lanes, so that
//! the biased u8 codes multiply the i8 activations 4 at a time into i32 without saturating.

use std::arch::x86_64::*;

use super::acts::{QuantizedActs, TOKEN_TILE};
use super::DecodedRow;

/// `row · x[t]`; `coef` is scratch of at least `cols / group + 16` values.
///
/// # Safety
/// The CPU must have AVX2, FMA and AVX-VNNI; `row` and `acts` have `acts.cols` values, a
/// multiple of 32.
#[target_feature(enable = "avx2,fma,avxvnni")]
pub unsafe fn matvec_row(row: &DecodedRow, acts: &QuantizedActs, t: usize, coef: &mut [f32]) -> f32 {
    if row.group == 32 {
        matvec_row_in::<32>(row, acts, t, coef)
    } else {
        matvec_row_in::<16>(row, acts, t, coef)
    }
}

#[target_feature(enable = "avx2,fma,avxvnni")]
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
    let (codes, qs, bias) = (row.codes.as_ptr(), acts.qs.as_ptr().add(t * cols), acts.neg_bias4.as_ptr().add(t * cols / 4));
    let chunk = |k: usize, acc: __m256| {
        // SAFETY: k + 32 <= cols, so every load is inside the row, its codes and its coefficients (+8 padding).
        let w = _mm256_loadu_si256(codes.add(k).cast());
        let a = _mm256_loadu_si256(qs.add(k).cast());
        let dot = _mm256_dpbusd_avx_epi32(_mm256_loadu_si256(bias.add(k / 4).cast()), w, a);
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
    let sum = _mm256_add_ps(acc0, acc1);
    let half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps::<1>(sum));
    let quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    let mut total = _mm_cvtss_f32(_mm_add_ss(quarter, _mm_shuffle_ps::<1>(quarter, quarter)));
    if row.has_offset {
        let sums = if G == 16 { &acts.scaled_sum16[t * cols / 16..][..groups] } else { &acts.scaled_sum32[t * cols / 32..][..groups] };
        total += row.offset[..groups].iter().zip(sums).map(|(o, s)| o * s).sum::<f32>();
    }
    total
}

// The biased codes' sums start at the activations' bias terms, which cancel the code bias.
super::avx2::tile_rows_8_lanes!(
    matmat_tile,
    matmat_rows,
    "avx2,fma,avxvnni",
    |bias16: *const i32, g: usize, per16: usize, half: usize| {
        let lanes = |h: usize| _mm256_loadu_si256(bias16.add((g * per16 + h) * TOKEN_TILE + 8 * half).cast());
        if per16 == 1 {
            lanes(0)
        } else {
            _mm256_add_epi32(lanes(0), lanes(1))
        }
    },
    |acc: __m256i, word: u32, a: __m256i| _mm256_dpbusd_avx_epi32(acc, _mm256_set1_epi32(word as i32), a)
);
