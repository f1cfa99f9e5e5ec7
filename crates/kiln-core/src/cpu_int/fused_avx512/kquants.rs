//! Fused kernels of the 256-value K-quant and IQ4_XS super-blocks.

use std::arch::x86_64::*;

use super::{f16_at, finish, lanes_of, quads, Quad, LANE_GROUP_16};
use crate::cpu_int::acts::QuantizedActs;

/// The 6-bit scales and mins of a Q4_K/Q5_K block as 8 + 8 bytes (ggml's `get_scale_min_k4`).
#[inline]
pub(crate) fn k4_scales(packed: &[u8]) -> (u64, u64) {
    let word = |i: usize| u32::from_le_bytes([packed[4 * i], packed[4 * i + 1], packed[4 * i + 2], packed[4 * i + 3]]);
    let (a0, a1, a2) = (word(0), word(1), word(2));
    let sc_lo = a0 & 0x3f3f_3f3f;
    let m_lo = a1 & 0x3f3f_3f3f;
    let sc_hi = (a2 & 0x0f0f_0f0f) | ((a0 >> 6) & 0x0303_0303) << 4;
    let m_hi = ((a2 >> 4) & 0x0f0f_0f0f) | ((a1 >> 6) & 0x0303_0303) << 4;
    (u64::from(sc_lo) | u64::from(sc_hi) << 32, u64::from(m_lo) | u64::from(m_hi) << 32)
}

/// Q4_K: 144-byte blocks of 256 (f16 d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of
/// nibbles: byte 32p + l holds value 64p + l low and 64p + 32 + l high), 8 groups of 32,
/// value = d * sc * u - dmin * m: bias 0, offset -dmin * m.
///
/// # Safety
/// The CPU must have AVX-512F/BW/VL, VNNI and F16C; `row` holds `acts.cols` values of the format.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
pub unsafe fn q4_k(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    k4_style::<false>(row, acts, t)
}

/// Q5_K: Q4_K with a fifth bit per value: bit g of qh[l] (32 bytes after the scales) belongs to
/// value 32g + l; 176-byte blocks.
///
/// # Safety
/// As [`q4_k`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
pub unsafe fn q5_k(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    k4_style::<true>(row, acts, t)
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
unsafe fn k4_style<const FIVE: bool>(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let (block_bytes, qs_at) = if FIVE { (176, 48) } else { (144, 16) };
    let cols = acts.cols;
    let (blocks, groups) = (cols / 256, cols / 32);
    let qs = acts.qs.as_ptr().add(t * cols);
    let (act_scale, sums) = (acts.scale.as_ptr().add(t * groups), acts.scaled_sum32.as_ptr().add(t * groups));
    let (mut main, mut offsets) = (_mm512_setzero_ps(), _mm256_setzero_ps());
    let mask = _mm512_set1_epi8(0x0f);
    // Lanes 0-7 of a low-nibble vector are group 4q, lanes 8-15 group 4q + 2; high nibbles 4q + 1, 4q + 3.
    let lo_groups = [lanes_of([0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2]), lanes_of([4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6])];
    let hi_groups = [lanes_of([1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3]), lanes_of([5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7])];
    for b in 0..blocks {
        let block = &row[b * block_bytes..(b + 1) * block_bytes];
        let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
        let (sc, m) = k4_scales(&block[4..16]);
        let to_f32 = |bytes: u64| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes as i64)));
        // SAFETY (loads): group 8b..8b+8 of the activation scales and sums, values 256b.. of the codes.
        let ws = _mm256_mul_ps(_mm256_set1_ps(d), to_f32(sc));
        let c = _mm512_castps256_ps512(_mm256_mul_ps(ws, _mm256_loadu_ps(act_scale.add(8 * b))));
        let wo = _mm256_mul_ps(_mm256_set1_ps(-dmin), to_f32(m));
        offsets = _mm256_fmadd_ps(wo, _mm256_loadu_ps(sums.add(8 * b)), offsets);
        let a = qs.add(256 * b);
        let qh = if FIVE { _mm256_loadu_si256(block.as_ptr().add(16).cast()) } else { _mm256_setzero_si256() };
        // The bytes of group g's values (as laid out in qh) whose fifth bit is set.
        let fifth = |g: u32| u64::from(_mm256_test_epi8_mask(qh, _mm256_set1_epi8(1 << g)));
        for q in 0..2 {
            let w = _mm512_loadu_si512(block.as_ptr().add(qs_at + 64 * q).cast());
            let (mut lo, mut hi) = (_mm512_and_si512(w, mask), _mm512_and_si512(_mm512_srli_epi16::<4>(w), mask));
            if FIVE {
                let g = 4 * q as u32;
                let bit = _mm512_set1_epi8(0x10);
                lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(fifth(g) | fifth(g + 2) << 32, bit));
                hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(fifth(g + 1) | fifth(g + 3) << 32, bit));
            }
            let at = a.add(128 * q);
            let a_lo = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(_mm256_loadu_si256(at.cast())), _mm256_loadu_si256(at.add(64).cast()));
            let a_hi = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(_mm256_loadu_si256(at.add(32).cast())), _mm256_loadu_si256(at.add(96).cast()));
            let dot_lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, a_lo);
            let dot_hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, a_hi);
            main = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_lo), _mm512_permutexvar_ps(lo_groups[q], c), main);
            main = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_hi), _mm512_permutexvar_ps(hi_groups[q], c), main);
        }
    }
    finish(main, _mm512_setzero_ps(), 0.0, _mm512_zextps256_ps512(offsets))
}

/// Q6_K: 210-byte blocks of 256 (ql[128], qh[64], 16 signed scales, f16 d), 16 groups of 16,
/// value = d * sc * (u - 32): bias 32. Value 128h + 32k + l has its low nibble in
/// ql[64h + 32(k % 2) + l] (high nibble for k >= 2) and its top two bits at bit 2k of qh[32h + l].
///
/// # Safety
/// As [`q4_k`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
pub unsafe fn q6_k(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let cols = acts.cols;
    let blocks = cols / 256;
    let qs = acts.qs.as_ptr().add(t * cols);
    let (act_scale, sums) = (acts.scale.as_ptr().add(t * cols / 32), acts.scaled_sum16.as_ptr().add(t * cols / 16));
    let (mut main, mut bias_terms) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let (nibble, two_bits) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x30));
    let spread2 = lanes_of([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]);
    let groups_from = |first: i32| _mm512_add_epi32(lanes_of(LANE_GROUP_16), _mm512_set1_epi32(first));
    let (g0, g1, g2, g3) = (groups_from(0), groups_from(4), groups_from(8), groups_from(12));
    // qh bits for k = 0, 1 (low/high 256 bits) shifted to bits 4-5, and for k = 2, 3.
    let (shift_lo, shift_hi) = (_mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0), _mm512_set_epi64(6, 6, 6, 6, 4, 4, 4, 4));
    for b in 0..blocks {
        let block = &row[b * 210..(b + 1) * 210];
        let d = f16_at(block, 208);
        // SAFETY (loads): the 16 scales of this block, the activation scales of its 8 x 32 values and sums of its 16 groups.
        let sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(block.as_ptr().add(192).cast())));
        let ws = _mm512_mul_ps(_mm512_set1_ps(d), sc);
        let a_scale = _mm512_permutexvar_ps(spread2, _mm512_castps256_ps512(_mm256_loadu_ps(act_scale.add(8 * b))));
        let c = _mm512_mul_ps(ws, a_scale);
        bias_terms = _mm512_fmadd_ps(ws, _mm512_loadu_ps(sums.add(16 * b)), bias_terms);
        let a = qs.add(256 * b);
        for h in 0..2 {
            let ql = _mm512_loadu_si512(block.as_ptr().add(64 * h).cast());
            let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(block.as_ptr().add(128 + 32 * h).cast()));
            // Bits 4-5 of each code: (qh >> 2k) << 4, done as a 64-bit shift per half, then masked.
            let top_lo = _mm512_and_si512(_mm512_sllv_epi64(_mm512_srlv_epi64(qh, shift_lo), _mm512_set1_epi64(4)), two_bits);
            let top_hi = _mm512_and_si512(_mm512_sllv_epi64(_mm512_srlv_epi64(qh, shift_hi), _mm512_set1_epi64(4)), two_bits);
            let u_lo = _mm512_or_si512(_mm512_and_si512(ql, nibble), top_lo);
            let u_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(ql), nibble), top_hi);
            let at = a.add(128 * h);
            let dot_lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u_lo, _mm512_loadu_si512(at.cast()));
            let dot_hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u_hi, _mm512_loadu_si512(at.add(64).cast()));
            let (gl, gh) = if h == 0 { (g0, g1) } else { (g2, g3) };
            main = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_lo), _mm512_permutexvar_ps(gl, c), main);
            main = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_hi), _mm512_permutexvar_ps(gh, c), main);
        }
    }
    finish(main, bias_terms, 32.0, _mm512_setzero_ps())
}

/// IQ4_XS: 136-byte blocks of 256 (f16 d, u16 high scale bits, 4 bytes of low scale nibbles,
/// 128 nibble bytes, group g's 16 at 8 + 16g as in IQ4_NL), scale d * (ls - 32); u = codebook
/// value + 128, bias 128.
///
/// # Safety
/// As [`q4_k`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
pub unsafe fn iq4_xs(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let biased: [u8; 16] = std::array::from_fn(|i| (kiln_quant::IQ4_NL_CODEBOOK[i] as u8) ^ 0x80);
    let table = _mm512_broadcast_i32x4(_mm_loadu_si128(biased.as_ptr().cast()));
    let mask = _mm512_set1_epi8(0x0f);
    // SAFETY (each decode): quad q is half of block q / 2, inside the row.
    quads(acts, t, acts.cols / 128, 128.0, false, |q| {
        let (b, half) = (q / 2, q % 2);
        let block = &row[136 * b..136 * (b + 1)];
        let w = _mm512_loadu_si512(block.as_ptr().add(8 + 64 * half).cast());
        let (lo, hi) = (_mm512_and_si512(w, mask), _mm512_and_si512(_mm512_srli_epi16::<4>(w), mask));
        let d = f16_at(block, 0);
        let high = u16::from_le_bytes([block[2], block[3]]);
        let scale = |k: usize| {
            let g = 4 * half + k;
            let ls = (block[4 + g / 2] >> (4 * (g % 2))) & 0xf | (((high >> (2 * g)) & 3) as u8) << 4;
            d * f32::from(ls as i8 - 32)
        };
        Quad {
            lo: _mm512_shuffle_epi8(table, lo),
            hi: _mm512_shuffle_epi8(table, hi),
            scale: _mm_set_ps(scale(3), scale(2), scale(1), scale(0)),
            offset: _mm_setzero_ps(),
        }
    })
}

/// The 2-bit codes of one 128-value half of a Q2_K/Q3_K block (32 bytes at `qs`, value
/// 32k + l at bits 2k of byte l): values 0..64 and 64..128 of the half as two vectors.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn two_bit_half(qs: *const u8) -> (__m512i, __m512i) {
    // SAFETY: the caller passes 32 readable bytes.
    let b = _mm512_broadcast_i64x4(_mm256_loadu_si256(qs.cast()));
    let three = _mm512_set1_epi8(3);
    let lo = _mm512_and_si512(_mm512_srlv_epi64(b, _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0)), three);
    let hi = _mm512_and_si512(_mm512_srlv_epi64(b, _mm512_set_epi64(6, 6, 6, 6, 4, 4, 4, 4)), three);
    (lo, hi)
}

/// The shared body of Q2_K and Q3_K: 16 groups of 16 with scales `ws` (and offsets `wo`),
/// codes from `codes(h)` for each 128-value half.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
unsafe fn groups16_block(acts: &QuantizedActs, t: usize, b: usize, ws: __m512, codes: [(__m512i, __m512i); 2], acc: &mut (__m512, __m512)) {
    let cols = acts.cols;
    let qs = acts.qs.as_ptr().add(t * cols + 256 * b);
    // SAFETY: block b's 8 activation scales and 256 codes lie inside token t's activations.
    let spread2 = lanes_of([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]);
    let a_scale = _mm512_permutexvar_ps(spread2, _mm512_castps256_ps512(_mm256_loadu_ps(acts.scale.as_ptr().add(t * cols / 32 + 8 * b))));
    let c = _mm512_mul_ps(ws, a_scale);
    let groups = lanes_of(LANE_GROUP_16);
    for (h, (lo, hi)) in codes.into_iter().enumerate() {
        let dot_lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(qs.add(128 * h).cast()));
        let dot_hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_loadu_si512(qs.add(128 * h + 64).cast()));
        let first = _mm512_set1_epi32(8 * h as i32);
        acc.0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_lo), _mm512_permutexvar_ps(_mm512_add_epi32(groups, first), c), acc.0);
        let second = _mm512_set1_epi32(8 * h as i32 + 4);
        acc.1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_hi), _mm512_permutexvar_ps(_mm512_add_epi32(groups, second), c), acc.1);
    }
}

/// Q2_K: 84-byte blocks (16 scale bytes: scale low nibble, min high nibble; 64 bytes of 2-bit
/// codes; f16 d, dmin), 16 groups of 16, value = d * sc * q - dmin * m: bias 0, offset -dmin * m.
///
/// # Safety
/// As [`q4_k`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
pub unsafe fn q2_k(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let cols = acts.cols;
    let sums = acts.scaled_sum16.as_ptr().add(t * cols / 16);
    let (mut acc, mut offsets) = ((_mm512_setzero_ps(), _mm512_setzero_ps()), _mm512_setzero_ps());
    for b in 0..cols / 256 {
        let block = &row[84 * b..84 * (b + 1)];
        let (d, dmin) = (f16_at(block, 80), f16_at(block, 82));
        // SAFETY: the block's 16 scale bytes and 64 code bytes; 16 scaled sums of token t.
        let packed = _mm512_cvtepu8_epi32(_mm_loadu_si128(block.as_ptr().cast()));
        let ws = _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_and_si512(packed, _mm512_set1_epi32(15))));
        let wo = _mm512_mul_ps(_mm512_set1_ps(-dmin), _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(packed)));
        offsets = _mm512_fmadd_ps(wo, _mm512_loadu_ps(sums.add(16 * b)), offsets);
        let codes = [two_bit_half(block.as_ptr().add(16)), two_bit_half(block.as_ptr().add(48))];
        groups16_block(acts, t, b, ws, codes, &mut acc);
    }
    finish(_mm512_add_ps(acc.0, acc.1), _mm512_setzero_ps(), 0.0, offsets)
}

/// Q3_K: 110-byte blocks (32 bytes of high bits: bit g of hmask[l] for value 32g + l; 64 bytes
/// of 2-bit codes; 12 bytes of 6-bit scales; f16 d), 16 groups of 16,
/// value = d * (sc - 32) * (q + 4 * hbit - 4): u = q + 4 * hbit, bias 4.
///
/// # Safety
/// As [`q4_k`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
pub unsafe fn q3_k(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let cols = acts.cols;
    let sums = acts.scaled_sum16.as_ptr().add(t * cols / 16);
    let (mut acc, mut bias_terms) = ((_mm512_setzero_ps(), _mm512_setzero_ps()), _mm512_setzero_ps());
    let four = _mm512_set1_epi8(4);
    for b in 0..cols / 256 {
        let block = &row[110 * b..110 * (b + 1)];
        let d = f16_at(block, 108);
        let s = &block[96..108];
        let low = u64::from_le_bytes(s[..8].try_into().expect("8 bytes"));
        let high = u32::from_le_bytes(s[8..12].try_into().expect("4 bytes"));
        let bits = |shift: u32| u64::from((high >> shift) & 0x0303_0303);
        let first = (low & 0x0f0f_0f0f_0f0f_0f0f) | (bits(0) | bits(2) << 32) << 4;
        let second = ((low >> 4) & 0x0f0f_0f0f_0f0f_0f0f) | (bits(4) | bits(6) << 32) << 4;
        let sc = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_set_epi64x(second as i64, first as i64)), _mm512_set1_epi32(32));
        let ws = _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(sc));
        // SAFETY: the block's 32 high-bit bytes and 64 code bytes; 16 scaled sums of token t.
        bias_terms = _mm512_fmadd_ps(ws, _mm512_loadu_ps(sums.add(16 * b)), bias_terms);
        let hmask = _mm256_loadu_si256(block.as_ptr().cast());
        let plane = |g: u32| u64::from(_mm256_test_epi8_mask(hmask, _mm256_set1_epi8(1 << g)));
        let with_high = |h: usize| {
            let (lo, hi) = two_bit_half(block.as_ptr().add(32 + 32 * h));
            let g = 4 * h as u32;
            (
                _mm512_or_si512(lo, _mm512_maskz_mov_epi8(plane(g) | plane(g + 1) << 32, four)),
                _mm512_or_si512(hi, _mm512_maskz_mov_epi8(plane(g + 2) | plane(g + 3) << 32, four)),
            )
        };
        groups16_block(acts, t, b, ws, [with_high(0), with_high(1)], &mut acc);
    }
    finish(_mm512_add_ps(acc.0, acc.1), bias_terms, 4.0, _mm512_setzero_ps())
}

/// One scale for whole blocks of `values` (a multiple of 64) values: `dot` lanes 0-7 and 8-15
/// of each 64-value vector take activation blocks 2v and 2v + 1.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
unsafe fn one_scale_block(acts: &QuantizedActs, t: usize, first_value: usize, d: f32, codes: &[__m512i], main: &mut __m512, bias_terms: &mut __m512) {
    let cols = acts.cols;
    let qs = acts.qs.as_ptr().add(t * cols + first_value);
    let blocks = acts.scale.as_ptr().add((t * cols + first_value) / 32);
    let sums = acts.scaled_sum32.as_ptr().add((t * cols + first_value) / 32);
    let pair = lanes_of([0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]);
    let d = _mm512_set1_ps(d);
    for (v, &u) in codes.iter().enumerate() {
        // SAFETY: the caller's block covers 64 * codes.len() values from first_value.
        let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(qs.add(64 * v).cast()));
        let scales = _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64(blocks.add(2 * v).cast())));
        *main = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_permutexvar_ps(pair, scales)), *main);
        let s = _mm512_zextps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64(sums.add(2 * v).cast())));
        *bias_terms = _mm512_fmadd_ps(d, s, *bias_terms);
    }
}

/// Q1_0: 18-byte blocks of 128 (f16 d, 16 bytes of sign bits, LSB first): value = d * (2b - 1),
/// u = 2b, bias 1.
///
/// # Safety
/// As [`q4_k`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
pub unsafe fn q1_0(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let (mut main, mut bias_terms) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let two = _mm512_set1_epi8(2);
    for b in 0..acts.cols / 128 {
        let block = &row[18 * b..18 * (b + 1)];
        let bits = |at: usize| u64::from_le_bytes(block[at..at + 8].try_into().expect("8 bytes"));
        let codes = [_mm512_maskz_mov_epi8(bits(2), two), _mm512_maskz_mov_epi8(bits(10), two)];
        one_scale_block(acts, t, 128 * b, f16_at(block, 0), &codes, &mut main, &mut bias_terms);
    }
    finish(main, bias_terms, 1.0, _mm512_setzero_ps())
}

/// TQ2_0: 66-byte blocks of 256 (64 bytes of 2-bit codes laid out as Q2_K's, f16 d):
/// value = d * (q - 1), bias 1.
///
/// # Safety
/// As [`q4_k`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
pub unsafe fn tq2_0(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let (mut main, mut bias_terms) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    for b in 0..acts.cols / 256 {
        let block = &row[66 * b..66 * (b + 1)];
        let (a, c) = two_bit_half(block.as_ptr());
        let (e, f) = two_bit_half(block.as_ptr().add(32));
        one_scale_block(acts, t, 256 * b, f16_at(block, 64), &[a, c, e, f], &mut main, &mut bias_terms);
    }
    finish(main, bias_terms, 1.0, _mm512_setzero_ps())
}
