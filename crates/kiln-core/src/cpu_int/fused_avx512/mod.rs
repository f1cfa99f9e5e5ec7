//! Decode-step dot products straight from the packed blocks, AVX-512 VNNI: codes are
//! unpacked in registers, never stored, which is what a memory-bound mat-vec needs.
//!
//! Every kernel computes, per group g of the row, with exact integer dot products,
//! `ws[g] * as[g] * sum(u * a) - bias * ws[g] * (as[g] * sum(a)) + wo[g] * (as[g] * sum(a))`,
//! where `u` are the format's unsigned codes, `bias` its code offset (value = ws * (u - bias) + wo),
//! `as` the activation scales and `as * sum(a)` the activations' scaled sums.

mod blocks32;
mod kquants;

pub(super) use kquants::k4_scales;

use std::arch::x86_64::*;

use kiln_quant::GgmlType;

use super::acts::QuantizedActs;

/// A fused row kernel: `row` is the packed bytes of one weight row.
pub type FusedRow = unsafe fn(row: &[u8], acts: &QuantizedActs, t: usize) -> f32;

/// The fused kernel for `ty`, if there is one.
pub fn kernel(ty: GgmlType) -> Option<FusedRow> {
    Some(match ty {
        GgmlType::Q4_0 => blocks32::q4_0,
        GgmlType::Q4_1 => blocks32::q4_1,
        GgmlType::Q5_0 => blocks32::q5_0,
        GgmlType::Q5_1 => blocks32::q5_1,
        GgmlType::Q8_0 => blocks32::q8_0,
        GgmlType::IQ4_NL => blocks32::iq4_nl,
        GgmlType::MXFP4 => blocks32::mxfp4,
        GgmlType::Q2_K => kquants::q2_k,
        GgmlType::Q3_K => kquants::q3_k,
        GgmlType::Q4_K => kquants::q4_k,
        GgmlType::Q5_K => kquants::q5_k,
        GgmlType::Q6_K => kquants::q6_k,
        GgmlType::IQ4_XS => kquants::iq4_xs,
        GgmlType::Q1_0 => kquants::q1_0,
        GgmlType::TQ2_0 => kquants::tq2_0,
        _ => return None,
    })
}

/// Lane `j` (4 values) of a 64-value vector of 16-value groups belongs to group `j / 4`.
const LANE_GROUP_16: [i32; 16] = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3];

#[inline]
fn f16_bits(bytes: &[u8], at: usize) -> u64 {
    u64::from(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

/// The f16 values at byte offsets `at + i * stride`, i < 4, as f32 (F16C, exact).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
fn f16x4(bytes: &[u8], at: usize, stride: usize) -> __m128 {
    let packed = (0..4).fold(0u64, |acc, i| acc | f16_bits(bytes, at + i * stride) << (16 * i));
    _mm_cvtph_ps(_mm_cvtsi64_si128(packed as i64))
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
fn f16_at(bytes: &[u8], at: usize) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi64_si128(f16_bits(bytes, at) as i64)))
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
fn lanes_of(idx: [i32; 16]) -> __m512i {
    // SAFETY: reads 64 bytes of a 16 x i32 array.
    unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
fn finish(main: __m512, bias_terms: __m512, bias: f32, offsets: __m512) -> f32 {
    _mm512_reduce_add_ps(main) - bias * _mm512_reduce_add_ps(bias_terms) + _mm512_reduce_add_ps(offsets)
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
fn hsum128(v: __m128) -> f32 {
    _mm512_reduce_add_ps(_mm512_zextps128_ps512(v))
}

/// Four groups of 32 values in registers: 128-bit lane k of `lo` holds the codes of values
/// 0..16 of group k, of `hi` those of values 16..32; one scale (and offset) per group.
struct Quad {
    lo: __m512i,
    hi: __m512i,
    scale: __m128,
    offset: __m128,
}

/// The dot product over `n_quads` quads of 32-value groups (`decode(q)` gives groups
/// 4q..4q+4), then the groups after them through the reference path.
///
/// # Safety
/// As the kernels: AVX-512F/BW/VL, VNNI and F16C; the activations hold `4 * n_quads` groups.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
unsafe fn quads(acts: &QuantizedActs, t: usize, n_quads: usize, bias: f32, has_offset: bool, decode: impl Fn(usize) -> Quad) -> f32 {
    let cols = acts.cols;
    let qs = acts.qs.as_ptr().add(t * cols);
    let (act_scale, sums) = (acts.scale.as_ptr().add(t * cols / 32), acts.scaled_sum32.as_ptr().add(t * cols / 32));
    let spread = lanes_of(LANE_GROUP_16);
    let (mut main, mut bias_terms, mut offsets) = (_mm512_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps());
    for q in 0..n_quads {
        let quad = decode(q);
        // SAFETY: groups 4q..4q+4 are inside the activations (128 values, 4 scales, 4 sums).
        let (a0, a1) = (_mm512_loadu_si512(qs.add(128 * q).cast()), _mm512_loadu_si512(qs.add(128 * q + 64).cast()));
        // 128-bit lane k: values 0..16 of group k (from a0's lanes 0, 2 and a1's 0, 2), then 16..32.
        let a_lo = _mm512_shuffle_i64x2::<0b10_00_10_00>(a0, a1);
        let a_hi = _mm512_shuffle_i64x2::<0b11_01_11_01>(a0, a1);
        let dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), quad.lo, a_lo), quad.hi, a_hi);
        let c = _mm_mul_ps(quad.scale, _mm_loadu_ps(act_scale.add(4 * q)));
        main = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(c)), main);
        let s = _mm_loadu_ps(sums.add(4 * q));
        bias_terms = _mm_fmadd_ps(quad.scale, s, bias_terms);
        if has_offset {
            offsets = _mm_fmadd_ps(quad.offset, s, offsets);
        }
    }
    _mm512_reduce_add_ps(main) - bias * hsum128(bias_terms) + hsum128(offsets)
}

/// Four 16-byte runs at `p + k * stride` (k < 4) as the 128-bit lanes of one vector.
///
/// # Safety
/// All four runs must be readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn runs4(p: *const u8, stride: usize) -> __m512i {
    let lo = _mm256_set_m128i(_mm_loadu_si128(p.add(stride).cast()), _mm_loadu_si128(p.cast()));
    let hi = _mm256_set_m128i(_mm_loadu_si128(p.add(3 * stride).cast()), _mm_loadu_si128(p.add(2 * stride).cast()));
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// The groups `first..` of a row of `ty` whose packed bytes (from that group on) are `tail`:
/// decoded by the reference decoder, dotted by the reference kernel (at most 3 groups of 32).
fn tail_terms(ty: GgmlType, tail: &[u8], acts: &QuantizedActs, t: usize, first: usize) -> f32 {
    let groups = acts.cols / 32 - first;
    if groups == 0 {
        return 0.0;
    }
    let (mut codes, mut scale, mut offset) = ([0u8; 96], [0f32; 3], [0f32; 3]);
    let n = 32 * groups;
    kiln_quant::int_rows::decode_int_row(ty, tail, &mut codes[..n], &mut scale[..groups], &mut offset[..groups]).expect("rows validated at upload");
    let layout = kiln_quant::int_rows::int_layout(ty).expect("a fused format has an integer form");
    let cols = acts.cols;
    let mut total = 0f32;
    for g in 0..groups {
        let at = t * cols + 32 * (first + g);
        let dot: i32 = codes[32 * g..32 * g + 32].iter().zip(&acts.qs[at..at + 32]).map(|(&w, &a)| i32::from(w) * i32::from(a)).sum();
        let sum = acts.sum16[at / 16] + acts.sum16[at / 16 + 1];
        let mut term = scale[g] * (dot - kiln_quant::int_rows::CODE_BIAS * sum) as f32;
        if layout.has_offset {
            term += offset[g] * sum as f32;
        }
        total += acts.scale[at / 32] * term;
    }
    total
}
