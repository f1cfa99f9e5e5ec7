//! Decode-step dot products straight from the packed blocks of the most common formats
//! (Q4_0, Q8_0, Q4_K, Q6_K), AVX-512 VNNI: codes are unpacked in registers, never stored,
//! which is what a memory-bound mat-vec needs.
//!
//! Every kernel computes, per group g of the row, with exact integer dot products,
//! `ws[g] * as[g] * sum(u * a) - bias * ws[g] * (as[g] * sum(a)) + wo[g] * (as[g] * sum(a))`,
//! where `u` are the format's unsigned codes, `bias` its code offset (value = ws * (u - bias) + wo),
//! `as` the activation scales and `as * sum(a)` the activations' scaled sums.

use std::arch::x86_64::*;

use kiln_quant::GgmlType;

use super::acts::QuantizedActs;

/// A fused row kernel: `row` is the packed bytes of one weight row.
pub type FusedRow = unsafe fn(row: &[u8], acts: &QuantizedActs, t: usize) -> f32;

/// The fused kernel for `ty`, if there is one.
pub fn kernel(ty: GgmlType) -> Option<FusedRow> {
    match ty {
        GgmlType::Q4_0 => Some(q4_0),
        GgmlType::Q8_0 => Some(q8_0),
        GgmlType::Q4_K => Some(q4_k),
        GgmlType::Q6_K => Some(q6_k),
        _ => None,
    }
}

/// Lane `j` (4 values) of a 64-value vector of 16-value groups belongs to group `j / 4`.
const LANE_GROUP_16: [i32; 16] = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3];

#[inline]
fn f16_bits(bytes: &[u8], at: usize) -> u64 {
    u64::from(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

/// The f16 values at byte offsets `at + i * stride`, i < 4, as f32 (F16C, exact).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
fn f16x4(bytes: &[u8], at: usize, stride: usize) -> __m128 {
    let packed = (0..4).fold(0u64, |acc, i| acc | f16_bits(bytes, at + i * stride) << (16 * i));
    _mm_cvtph_ps(_mm_cvtsi64_si128(packed as i64))
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
fn f16_at(bytes: &[u8], at: usize) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi64_si128(f16_bits(bytes, at) as i64)))
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn lanes_of(idx: [i32; 16]) -> __m512i {
    // SAFETY: reads 64 bytes of a 16 x i32 array.
    unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn finish(main: __m512, bias_terms: __m512, bias: f32, offsets: __m512) -> f32 {
    _mm512_reduce_add_ps(main) - bias * _mm512_reduce_add_ps(bias_terms) + _mm512_reduce_add_ps(offsets)
}

/// Q4_0: 18-byte blocks of 32 (f16 d, 16 bytes: value j low nibble, value j + 16 high), u = q, bias 8.
///
/// # Safety
/// The CPU must have AVX-512F/BW, VNNI and F16C; `row` holds `acts.cols` values of Q4_0.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn q4_0(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let cols = acts.cols;
    let blocks = cols / 32;
    let qs = acts.qs.as_ptr().add(t * cols);
    let (act_scale, sums) = (&acts.scale[t * blocks..][..blocks], &acts.scaled_sum32[t * blocks..][..blocks]);
    let (mut main, mut bias_terms) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let spread = lanes_of(LANE_GROUP_16);
    let mask = _mm512_set1_epi8(0x0f);
    let mut b = 0;
    while b + 4 <= blocks {
        let p = row.as_ptr().add(b * 18);
        // SAFETY (loads): blocks b..b+4 lie inside the row and values 32b..32b+128 inside the activations.
        let w = _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_set_m128i(_mm_loadu_si128(p.add(20).cast()), _mm_loadu_si128(p.add(2).cast()))),
            _mm256_set_m128i(_mm_loadu_si128(p.add(56).cast()), _mm_loadu_si128(p.add(38).cast())),
        );
        let (lo, hi) = (_mm512_and_si512(w, mask), _mm512_and_si512(_mm512_srli_epi16::<4>(w), mask));
        let (a0, a1) = (_mm512_loadu_si512(qs.add(32 * b).cast()), _mm512_loadu_si512(qs.add(32 * b + 64).cast()));
        // 128-bit lane k of `lo` holds values 0..16 of block b + k, of `hi` values 16..32.
        let a_lo = _mm512_shuffle_i64x2::<0b10_00_10_00>(a0, a1);
        let a_hi = _mm512_shuffle_i64x2::<0b11_01_11_01>(a0, a1);
        let dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, a_lo), hi, a_hi);
        let ws = f16x4(row, b * 18, 18);
        let c = _mm_mul_ps(ws, _mm_loadu_ps(act_scale.as_ptr().add(b)));
        let lane_c = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(c));
        main = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), lane_c, main);
        let bias_c = _mm_mul_ps(ws, _mm_loadu_ps(sums.as_ptr().add(b)));
        bias_terms = _mm512_add_ps(bias_terms, _mm512_zextps128_ps512(bias_c));
        b += 4;
    }
    let mut tail = 0f32;
    for b in b..blocks {
        let (d, block) = (f16_at(row, b * 18), &row[b * 18 + 2..b * 18 + 18]);
        let a = &acts.qs[t * cols + 32 * b..][..32];
        let dot: i32 = (0..16).map(|j| i32::from(block[j] & 15) * i32::from(a[j]) + i32::from(block[j] >> 4) * i32::from(a[j + 16])).sum();
        tail += d * act_scale[b] * dot as f32 - 8.0 * d * sums[b];
    }
    finish(main, bias_terms, 8.0, _mm512_setzero_ps()) + tail
}

/// Q8_0: 34-byte blocks of 32 (f16 d, 32 signed codes), u = q + 128, bias 128.
///
/// # Safety
/// As [`q4_0`], for Q8_0.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn q8_0(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
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

/// The 6-bit scales and mins of a Q4_K/Q5_K block as 8 + 8 bytes (ggml's `get_scale_min_k4`).
#[inline]
fn k4_scales(packed: &[u8]) -> (u64, u64) {
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
/// As [`q4_0`], for Q4_K.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn q4_k(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
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
        let block = &row[b * 144..(b + 1) * 144];
        let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
        let (sc, m) = k4_scales(&block[4..16]);
        let to_f32 = |bytes: u64| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes as i64)));
        // SAFETY (loads): group 8b..8b+8 of the activation scales and sums, values 256b.. of the codes.
        let ws = _mm256_mul_ps(_mm256_set1_ps(d), to_f32(sc));
        let c = _mm512_castps256_ps512(_mm256_mul_ps(ws, _mm256_loadu_ps(act_scale.add(8 * b))));
        let wo = _mm256_mul_ps(_mm256_set1_ps(-dmin), to_f32(m));
        offsets = _mm256_fmadd_ps(wo, _mm256_loadu_ps(sums.add(8 * b)), offsets);
        let a = qs.add(256 * b);
        for q in 0..2 {
            let w = _mm512_loadu_si512(block.as_ptr().add(16 + 64 * q).cast());
            let (lo, hi) = (_mm512_and_si512(w, mask), _mm512_and_si512(_mm512_srli_epi16::<4>(w), mask));
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
/// As [`q4_0`], for Q6_K.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn q6_k(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
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
