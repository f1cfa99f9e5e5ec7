//! AVX2 kernels for CPUs without VNNI: codes widened to i16 and multiplied with
//! `vpmaddwd`, which cannot saturate (u8 x i8 `vpmaddubsw` would, for 8-bit codes).

use std::arch::x86_64::*;

use super::acts::QuantizedActs;
use super::DecodedRow;

/// `row · x[t]`.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `row` and `acts` have `acts.cols` values.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn matvec_row(row: &DecodedRow, acts: &QuantizedActs, t: usize) -> f32 {
    let (cols, group) = (acts.cols, row.group);
    let act_scale = &acts.scale[t * cols / 32..][..cols / 32];
    let (codes, qs) = (row.codes.as_ptr(), acts.qs.as_ptr().add(t * cols));
    let bias = _mm256_set1_epi16(kiln_quant::int_rows::CODE_BIAS as i16);
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for k in (0..cols).step_by(32) {
        // SAFETY: k + 32 <= cols (cols is a multiple of 32), so both 32-byte loads are in bounds.
        let w = _mm256_loadu_si256(codes.add(k).cast());
        let a = _mm256_loadu_si256(qs.add(k).cast());
        let w_lo = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(w)), bias);
        let w_hi = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256::<1>(w)), bias);
        let a_lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(a));
        let a_hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(a));
        let (g_lo, g_hi) = (k / group, (k + 16) / group);
        let c_lo = _mm256_set1_ps(row.scale[g_lo] * act_scale[k / 32]);
        let c_hi = _mm256_set1_ps(row.scale[g_hi] * act_scale[k / 32]);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(w_lo, a_lo)), c_lo, acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(w_hi, a_hi)), c_hi, acc1);
    }
    let sum = _mm256_add_ps(acc0, acc1);
    let half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps::<1>(sum));
    let quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    let mut total = _mm_cvtss_f32(_mm_add_ss(quarter, _mm_shuffle_ps::<1>(quarter, quarter)));
    if row.has_offset {
        let groups = cols / group;
        let sums = if group == 16 { &acts.scaled_sum16[t * cols / 16..][..groups] } else { &acts.scaled_sum32[t * cols / 32..][..groups] };
        total += row.offset[..groups].iter().zip(sums).map(|(o, s)| o * s).sum::<f32>();
    }
    total
}
