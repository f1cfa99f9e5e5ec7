//! Decode-step dot products straight from the packed blocks on AVX2 (no VNNI), for the formats
//! whose unsigned codes are small: codes are unpacked in registers and multiplied with the
//! activations by `vpmaddubsw`, which cannot saturate while codes stay below 64
//! (2 x 63 x 127 < 2^15); `vpmaddwd` by ones then sums each 4 products into an i32 lane.
//! Q8_0's signed codes take the sign trick of [`super::avx2`] instead.
//!
//! Per group g, with exact integer sums: `ws[g] * as[g] * sum(u * a) - bias * ws[g] * (as[g] *
//! sum(a)) + wo[g] * (as[g] * sum(a))`, as the AVX-512 kernels compute it.

use std::arch::x86_64::*;

use super::acts::QuantizedActs;
use super::avx2::hsum;
use super::fused_avx512::FusedRow;
use kiln_quant::GgmlType;

/// The fused AVX2 kernel for `ty`, if there is one.
pub fn kernel(ty: GgmlType) -> Option<FusedRow> {
    Some(match ty {
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4_1 => q4_1,
        GgmlType::Q5_0 => q5_0,
        GgmlType::Q5_1 => q5_1,
        GgmlType::Q8_0 => q8_0,
        GgmlType::Q4_K => q4_k,
        GgmlType::Q6_K => q6_k,
        _ => return None,
    })
}

/// `sum(u[4i..4i+4] * a[4i..4i+4])` in i32 lane i, for unsigned codes `u` below 64.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_small(u: __m256i, a: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_at(bytes: &[u8], at: usize) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(u16::from_le_bytes([bytes[at], bytes[at + 1]])))))
}

/// 32 bytes, 0x10 where bit j of `qh` is set (the fifth bits of a Q5 block's values).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fifth_bits(qh: u32) -> __m256i {
    // Byte j takes byte j / 8 of qh, then tests bit j % 8.
    let spread = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), _mm256_setr_epi64x(0, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303));
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
    _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10))
}

/// The 32-value block formats: `BYTES` per block, f16 d first, then an f16 min when `HAS_MIN`,
/// the u32 fifth bits at `QH_AT` (0: none), the 16 nibble bytes at `QS_AT` (value j low, j + 16
/// high); value = d * (u - bias) + m. Four blocks a step: their scales are converted and
/// multiplied together, and two accumulators take turns.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn blocks32<const BYTES: usize, const QS_AT: usize, const QH_AT: usize, const HAS_MIN: bool>(
    row: &[u8],
    acts: &QuantizedActs,
    t: usize,
    bias: f32,
) -> f32 {
    let cols = acts.cols;
    let blocks = cols / 32;
    let qs = acts.qs.as_ptr().add(t * cols);
    let (act_scale, sums) = (&acts.scale[t * blocks..][..blocks], &acts.scaled_sum32[t * blocks..][..blocks]);
    let row = &row[..blocks * BYTES];
    let mask = _mm_set1_epi8(0x0f);
    let block_dot = |b: usize| {
        let block = &row[b * BYTES..(b + 1) * BYTES];
        // SAFETY: the block holds its 16 nibble bytes at QS_AT; values 32b..32b+32 are in the activations.
        let w = _mm_loadu_si128(block.as_ptr().add(QS_AT).cast());
        let mut u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(w), mask), _mm_and_si128(w, mask));
        if QH_AT != 0 {
            u = _mm256_or_si256(u, fifth_bits(u32::from_le_bytes([block[QH_AT], block[QH_AT + 1], block[QH_AT + 2], block[QH_AT + 3]])));
        }
        _mm256_cvtepi32_ps(dot_small(u, _mm256_loadu_si256(qs.add(32 * b).cast())))
    };
    // The f16 at byte `at` of blocks b..b+4, as f32.
    let halves4 = |b: usize, at: usize| {
        let bits = (0..4).fold(0u64, |acc, i| acc | u64::from(u16::from_le_bytes([row[(b + i) * BYTES + at], row[(b + i) * BYTES + at + 1]])) << (16 * i));
        _mm_cvtph_ps(_mm_cvtsi64_si128(bits as i64))
    };
    let (mut main, mut rest) = ([_mm256_setzero_ps(); 2], _mm_setzero_ps());
    let mut b = 0;
    while b + 4 <= blocks {
        let d = halves4(b, 0);
        let mut c = [0f32; 4];
        // SAFETY: blocks b..b+4 have activation scales and sums.
        _mm_storeu_ps(c.as_mut_ptr(), _mm_mul_ps(d, _mm_loadu_ps(act_scale.as_ptr().add(b))));
        let offset = if HAS_MIN { halves4(b, 2) } else { _mm_setzero_ps() };
        rest = _mm_fmadd_ps(_mm_fnmadd_ps(_mm_set1_ps(bias), d, offset), _mm_loadu_ps(sums.as_ptr().add(b)), rest);
        for (i, &c) in c.iter().enumerate() {
            main[i % 2] = _mm256_fmadd_ps(block_dot(b + i), _mm256_set1_ps(c), main[i % 2]);
        }
        b += 4;
    }
    let mut tail = 0f32;
    for b in b..blocks {
        let d = f16_at(row, b * BYTES);
        main[0] = _mm256_fmadd_ps(block_dot(b), _mm256_set1_ps(d * act_scale[b]), main[0]);
        let offset = if HAS_MIN { f16_at(row, b * BYTES + 2) } else { 0.0 };
        tail += (offset - bias * d) * sums[b];
    }
    let rest = _mm_add_ps(rest, _mm_movehl_ps(rest, rest));
    hsum(_mm256_add_ps(main[0], main[1])) + _mm_cvtss_f32(_mm_add_ss(rest, _mm_shuffle_ps::<1>(rest, rest))) + tail
}

/// Q4_0: 18-byte blocks (f16 d, 16 nibble bytes); u = q, bias 8.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `row` holds `acts.cols` values of the format.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q4_0(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    blocks32::<18, 2, 0, false>(row, acts, t, 8.0)
}

/// Q4_1: 20-byte blocks (f16 d, f16 m, 16 nibble bytes); value = d * q + m.
///
/// # Safety
/// As [`q4_0`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q4_1(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    blocks32::<20, 4, 0, true>(row, acts, t, 0.0)
}

/// Q5_0: 22-byte blocks (f16 d, u32 fifth bits, 16 nibble bytes); u = 5-bit code, bias 16.
///
/// # Safety
/// As [`q4_0`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q5_0(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    blocks32::<22, 6, 2, false>(row, acts, t, 16.0)
}

/// Q5_1: 24-byte blocks (f16 d, f16 m, u32 fifth bits, 16 nibble bytes); value = d * u + m.
///
/// # Safety
/// As [`q4_0`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q5_1(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    blocks32::<24, 8, 4, true>(row, acts, t, 0.0)
}

/// Q8_0: 34-byte blocks (f16 d, 32 signed codes), by the sign trick.
///
/// # Safety
/// As [`q4_0`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q8_0(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let cols = acts.cols;
    let blocks = cols / 32;
    let qs = acts.qs.as_ptr().add(t * cols);
    let act_scale = &acts.scale[t * blocks..][..blocks];
    let row = &row[..blocks * 34];
    let block_dot = |b: usize| {
        // SAFETY: block b's 32 codes follow its scale; values 32b..32b+32 are in the activations.
        let s = _mm256_loadu_si256(row.as_ptr().add(34 * b + 2).cast());
        let pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(s), _mm256_sign_epi8(_mm256_loadu_si256(qs.add(32 * b).cast()), s));
        _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    };
    let mut main = [_mm256_setzero_ps(); 2];
    let mut b = 0;
    while b + 4 <= blocks {
        let bits = (0..4).fold(0u64, |acc, i| acc | u64::from(u16::from_le_bytes([row[34 * (b + i)], row[34 * (b + i) + 1]])) << (16 * i));
        let mut c = [0f32; 4];
        // SAFETY: blocks b..b+4 have activation scales.
        _mm_storeu_ps(c.as_mut_ptr(), _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi64_si128(bits as i64)), _mm_loadu_ps(act_scale.as_ptr().add(b))));
        for (i, &c) in c.iter().enumerate() {
            main[i % 2] = _mm256_fmadd_ps(block_dot(b + i), _mm256_set1_ps(c), main[i % 2]);
        }
        b += 4;
    }
    for (b, &a) in act_scale.iter().enumerate().skip(b) {
        main[0] = _mm256_fmadd_ps(block_dot(b), _mm256_set1_ps(f16_at(row, 34 * b) * a), main[0]);
    }
    hsum(_mm256_add_ps(main[0], main[1]))
}

/// Q4_K: 144-byte blocks of 256 (f16 d, dmin, 12 bytes of 6-bit scales/mins, 128 nibble bytes:
/// byte 32p + l holds value 64p + l low and 64p + 32 + l high), 8 groups of 32,
/// value = d * sc * u - dmin * m.
///
/// # Safety
/// As [`q4_0`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q4_k(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let cols = acts.cols;
    let (blocks, groups) = (cols / 256, cols / 32);
    let qs = acts.qs.as_ptr().add(t * cols);
    let (act_scale, sums) = (acts.scale.as_ptr().add(t * groups), acts.scaled_sum32.as_ptr().add(t * groups));
    let (mut main, mut offsets) = ([_mm256_setzero_ps(); 2], _mm256_setzero_ps());
    let mask = _mm256_set1_epi8(0x0f);
    for b in 0..blocks {
        let block = &row[b * 144..(b + 1) * 144];
        let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
        let (sc, m) = super::fused_avx512::k4_scales(&block[4..16]);
        let to_f32 = |bytes: u64| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes as i64)));
        // SAFETY (loads): groups 8b..8b+8 of the activation scales and sums, values 256b.. of the codes.
        let mut c = [0f32; 8];
        _mm256_storeu_ps(c.as_mut_ptr(), _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d), to_f32(sc)), _mm256_loadu_ps(act_scale.add(8 * b))));
        offsets = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(-dmin), to_f32(m)), _mm256_loadu_ps(sums.add(8 * b)), offsets);
        for p in 0..4 {
            let w = _mm256_loadu_si256(block.as_ptr().add(16 + 32 * p).cast());
            let at = qs.add(256 * b + 64 * p);
            let dot_lo = dot_small(_mm256_and_si256(w, mask), _mm256_loadu_si256(at.cast()));
            let dot_hi = dot_small(_mm256_and_si256(_mm256_srli_epi16::<4>(w), mask), _mm256_loadu_si256(at.add(32).cast()));
            main[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_lo), _mm256_set1_ps(c[2 * p]), main[0]);
            main[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_hi), _mm256_set1_ps(c[2 * p + 1]), main[1]);
        }
    }
    hsum(_mm256_add_ps(main[0], main[1])) + hsum(offsets)
}

/// Q6_K: 210-byte blocks of 256 (ql[128], qh[64], 16 signed scales, f16 d), 16 groups of 16,
/// value = d * sc * (u - 32). Value 128h + 32k + l has its low nibble in ql[64h + 32(k % 2) + l]
/// (high nibble for k >= 2) and its top two bits at bit 2k of qh[32h + l].
///
/// # Safety
/// As [`q4_0`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q6_k(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let cols = acts.cols;
    let blocks = cols / 256;
    let qs = acts.qs.as_ptr().add(t * cols);
    let (act_scale, sums) = (acts.scale.as_ptr().add(t * cols / 32), acts.scaled_sum16.as_ptr().add(t * cols / 16));
    let (mut main, mut bias_terms) = ([_mm256_setzero_ps(); 2], _mm256_setzero_ps());
    let (nibble, two_bits) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x30));
    // Lanes 0-3 of a 32-value dot belong to its first group of 16, lanes 4-7 to the second.
    let halves = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    for b in 0..blocks {
        let block = &row[b * 210..(b + 1) * 210];
        let d = _mm256_set1_ps(f16_at(block, 208));
        // SAFETY (loads): the 16 scales of this block, the activation scales of its 8 x 32 values and sums of its 16 groups.
        let scales = _mm_loadu_si128(block.as_ptr().add(192).cast());
        let ws = [
            _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(scales))),
            _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(scales)))),
        ];
        bias_terms = _mm256_fmadd_ps(ws[0], _mm256_loadu_ps(sums.add(16 * b)), bias_terms);
        bias_terms = _mm256_fmadd_ps(ws[1], _mm256_loadu_ps(sums.add(16 * b + 8)), bias_terms);
        let mut ws16 = [0f32; 16];
        _mm256_storeu_ps(ws16.as_mut_ptr(), ws[0]);
        _mm256_storeu_ps(ws16.as_mut_ptr().add(8), ws[1]);
        for h in 0..2 {
            let qh = _mm256_loadu_si256(block.as_ptr().add(128 + 32 * h).cast());
            let ql = [_mm256_loadu_si256(block.as_ptr().add(64 * h).cast()), _mm256_loadu_si256(block.as_ptr().add(64 * h + 32).cast())];
            for k in 0..4 {
                let low = if k < 2 { _mm256_and_si256(ql[k], nibble) } else { _mm256_and_si256(_mm256_srli_epi16::<4>(ql[k - 2]), nibble) };
                let top = _mm256_and_si256(_mm256_sll_epi16(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k as i32)), _mm_cvtsi32_si128(4)), two_bits);
                let chunk = 4 * h + k;
                let dot = dot_small(_mm256_or_si256(low, top), _mm256_loadu_si256(qs.add(256 * b + 32 * chunk).cast()));
                let pair = _mm256_setr_ps(ws16[2 * chunk], ws16[2 * chunk + 1], 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
                let c = _mm256_mul_ps(_mm256_permutevar8x32_ps(pair, halves), _mm256_set1_ps(*act_scale.add(8 * b + chunk)));
                main[k % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), c, main[k % 2]);
            }
        }
    }
    hsum(_mm256_add_ps(main[0], main[1])) - 32.0 * hsum(bias_terms)
}
