//! Fused kernels of the 32-value block formats: Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4
//! (four blocks at a time through [`quads`]) and Q8_0.

use std::arch::x86_64::*;

use kiln_quant::{e8m0_half, GgmlType, E2M1_X2, IQ4_NL_CODEBOOK};

use super::{f16_at, f16x4, finish, lanes_of, quads, runs4, tail_terms, Quad};
use crate::cpu_int::acts::QuantizedActs;

/// Splits four 16-byte nibble runs into the codes of values 0..16 (low) and 16..32 (high).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
fn nibbles(w: __m512i) -> (__m512i, __m512i) {
    let mask = _mm512_set1_epi8(0x0f);
    (_mm512_and_si512(w, mask), _mm512_and_si512(_mm512_srli_epi16::<4>(w), mask))
}

/// The fifth bits of four Q5 blocks (their little-endian u32 `qh` at `row[at + k * stride]`):
/// 0x10 in the bytes of values 0..16 (low) and 16..32 (high) whose bit is set.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
fn fifth_bits(row: &[u8], at: usize, stride: usize) -> (__m512i, __m512i) {
    let (mut lo, mut hi) = (0u64, 0u64);
    for k in 0..4 {
        let p = at + k * stride;
        let qh = u32::from_le_bytes([row[p], row[p + 1], row[p + 2], row[p + 3]]);
        lo |= u64::from(qh & 0xffff) << (16 * k);
        hi |= u64::from(qh >> 16) << (16 * k);
    }
    let bit = _mm512_set1_epi8(0x10);
    (_mm512_maskz_mov_epi8(lo, bit), _mm512_maskz_mov_epi8(hi, bit))
}

/// A 16-entry table of biased codebook values in every 128-bit lane, for `vpshufb`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
fn codebook(values: [i8; 16]) -> __m512i {
    let biased: [u8; 16] = std::array::from_fn(|i| (values[i] as u8) ^ 0x80);
    // SAFETY: reads the 16 bytes of the array.
    _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(biased.as_ptr().cast()) })
}

/// Q4_0: 18-byte blocks (f16 d, 16 nibble bytes: value j low, j + 16 high); u = q, bias 8.
///
/// # Safety
/// The CPU must have AVX-512F/BW/VL, VNNI and F16C; `row` holds `acts.cols` values of the format.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
pub unsafe fn q4_0(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let n = acts.cols / 128;
    // SAFETY (each decode): quad q's four blocks lie inside the row.
    let body = quads(acts, t, n, 8.0, false, |q| {
        let (lo, hi) = nibbles(runs4(row.as_ptr().add(72 * q + 2), 18));
        Quad { lo, hi, scale: f16x4(row, 72 * q, 18), offset: _mm_setzero_ps() }
    });
    body + tail_terms(GgmlType::Q4_0, &row[72 * n..], acts, t, 4 * n)
}

/// Q4_1: 20-byte blocks (f16 d, f16 m, 16 nibble bytes); value = d * q + m: bias 0, offset m.
///
/// # Safety
/// As [`q4_0`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
pub unsafe fn q4_1(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let n = acts.cols / 128;
    // SAFETY (each decode): as in q4_0.
    let body = quads(acts, t, n, 0.0, true, |q| {
        let (lo, hi) = nibbles(runs4(row.as_ptr().add(80 * q + 4), 20));
        Quad { lo, hi, scale: f16x4(row, 80 * q, 20), offset: f16x4(row, 80 * q + 2, 20) }
    });
    body + tail_terms(GgmlType::Q4_1, &row[80 * n..], acts, t, 4 * n)
}

/// Q5_0: 22-byte blocks (f16 d, u32 fifth bits, 16 nibble bytes); u = 5-bit code, bias 16.
///
/// # Safety
/// As [`q4_0`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
pub unsafe fn q5_0(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let n = acts.cols / 128;
    // SAFETY (each decode): as in q4_0.
    let body = quads(acts, t, n, 16.0, false, |q| {
        let (lo, hi) = nibbles(runs4(row.as_ptr().add(88 * q + 6), 22));
        let (top_lo, top_hi) = fifth_bits(row, 88 * q + 2, 22);
        Quad { lo: _mm512_or_si512(lo, top_lo), hi: _mm512_or_si512(hi, top_hi), scale: f16x4(row, 88 * q, 22), offset: _mm_setzero_ps() }
    });
    body + tail_terms(GgmlType::Q5_0, &row[88 * n..], acts, t, 4 * n)
}

/// Q5_1: 24-byte blocks (f16 d, f16 m, u32 fifth bits, 16 nibble bytes): bias 0, offset m.
///
/// # Safety
/// As [`q4_0`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
pub unsafe fn q5_1(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let n = acts.cols / 128;
    // SAFETY (each decode): as in q4_0.
    let body = quads(acts, t, n, 0.0, true, |q| {
        let (lo, hi) = nibbles(runs4(row.as_ptr().add(96 * q + 8), 24));
        let (top_lo, top_hi) = fifth_bits(row, 96 * q + 4, 24);
        Quad { lo: _mm512_or_si512(lo, top_lo), hi: _mm512_or_si512(hi, top_hi), scale: f16x4(row, 96 * q, 24), offset: f16x4(row, 96 * q + 2, 24) }
    });
    body + tail_terms(GgmlType::Q5_1, &row[96 * n..], acts, t, 4 * n)
}

/// IQ4_NL: Q4_0's layout with codebook values; u = value + 128, bias 128.
///
/// # Safety
/// As [`q4_0`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
pub unsafe fn iq4_nl(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let n = acts.cols / 128;
    let table = codebook(IQ4_NL_CODEBOOK);
    // SAFETY (each decode): as in q4_0.
    let body = quads(acts, t, n, 128.0, false, |q| {
        let (lo, hi) = nibbles(runs4(row.as_ptr().add(72 * q + 2), 18));
        Quad { lo: _mm512_shuffle_epi8(table, lo), hi: _mm512_shuffle_epi8(table, hi), scale: f16x4(row, 72 * q, 18), offset: _mm_setzero_ps() }
    });
    body + tail_terms(GgmlType::IQ4_NL, &row[72 * n..], acts, t, 4 * n)
}

/// MXFP4: 17-byte blocks (e8m0 exponent, 16 nibble bytes of E2M1 codes); u = 2 * value + 128, bias 128.
///
/// # Safety
/// As [`q4_0`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
pub unsafe fn mxfp4(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let n = acts.cols / 128;
    let table = codebook(E2M1_X2);
    // SAFETY (each decode): as in q4_0.
    let body = quads(acts, t, n, 128.0, false, |q| {
        let (lo, hi) = nibbles(runs4(row.as_ptr().add(68 * q + 1), 17));
        let e = |k: usize| e8m0_half(row[68 * q + 17 * k]);
        Quad { lo: _mm512_shuffle_epi8(table, lo), hi: _mm512_shuffle_epi8(table, hi), scale: _mm_set_ps(e(3), e(2), e(1), e(0)), offset: _mm_setzero_ps() }
    });
    body + tail_terms(GgmlType::MXFP4, &row[68 * n..], acts, t, 4 * n)
}

/// Q8_0: 34-byte blocks of 32 (f16 d, 32 signed codes), u = q + 128, bias 128.
///
/// # Safety
/// As [`q4_0`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
pub unsafe fn q8_0(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let cols = acts.cols;
    let blocks = cols / 32;
    let qs = acts.qs.as_ptr().add(t * cols);
    let (act_scale, sums) = (&acts.scale[t * blocks..][..blocks], &acts.scaled_sum32[t * blocks..][..blocks]);
    let (mut main, mut bias_terms) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let pair = lanes_of([0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]);
    let pair_hi = lanes_of([2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3]);
    let flip = _mm512_set1_epi8(-128);
    let mut b = 0;
    while b + 4 <= blocks {
        let p = row.as_ptr().add(b * 34);
        // SAFETY: blocks b..b+4 lie inside the row, values 32b..32b+128 inside the activations.
        let ws = f16x4(row, b * 34, 34);
        let c = _mm_mul_ps(ws, _mm_loadu_ps(act_scale.as_ptr().add(b)));
        bias_terms = _mm512_add_ps(bias_terms, _mm512_zextps128_ps512(_mm_mul_ps(ws, _mm_loadu_ps(sums.as_ptr().add(b)))));
        let lane_c = _mm512_castps128_ps512(c);
        for half in 0..2 {
            let at = p.add(68 * half);
            let w = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(_mm256_loadu_si256(at.add(2).cast())), _mm256_loadu_si256(at.add(36).cast()));
            let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(w, flip), _mm512_loadu_si512(qs.add(32 * b + 64 * half).cast()));
            let lanes = if half == 0 { pair } else { pair_hi };
            main = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(lanes, lane_c), main);
        }
        b += 4;
    }
    while b + 2 <= blocks {
        let p = row.as_ptr().add(b * 34);
        // SAFETY: blocks b, b + 1 lie inside the row, values 32b..32b+64 inside the activations.
        let w = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(_mm256_loadu_si256(p.add(2).cast())), _mm256_loadu_si256(p.add(36).cast()));
        let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(w, flip), _mm512_loadu_si512(qs.add(32 * b).cast()));
        let ws = _mm_set_ps(0.0, 0.0, f16_at(row, (b + 1) * 34), f16_at(row, b * 34));
        let c = _mm_mul_ps(ws, _mm_castsi128_ps(_mm_loadl_epi64(act_scale.as_ptr().add(b).cast())));
        main = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pair, _mm512_castps128_ps512(c)), main);
        let bias_c = _mm_mul_ps(ws, _mm_castsi128_ps(_mm_loadl_epi64(sums.as_ptr().add(b).cast())));
        bias_terms = _mm512_add_ps(bias_terms, _mm512_zextps128_ps512(bias_c));
        b += 2;
    }
    let mut tail = 0f32;
    if b < blocks {
        let (d, block) = (f16_at(row, b * 34), &row[b * 34 + 2..b * 34 + 34]);
        let a = &acts.qs[t * cols + 32 * b..][..32];
        let dot: i32 = block.iter().zip(a).map(|(&w, &x)| i32::from(w as i8) * i32::from(x)).sum();
        tail = d * act_scale[b] * dot as f32;
    }
    finish(main, bias_terms, 128.0, _mm512_setzero_ps()) + tail
}
