//! Decode-step dot products straight from the packed blocks on AVX2 (no VNNI): codes are
//! unpacked in registers and multiplied with the activations by `vpmaddubsw`, which cannot
//! saturate while codes stay below 64 (2 x 63 x 127 < 2^15); `vpmaddwd` then sums each 4
//! products into an i32 lane (by ones, or, for formats with 16-value groups, by the groups'
//! integer scales, so that one f32 multiply-add covers 32 values). Q8_0's signed codes and the
//! codebook formats (IQ4_NL, IQ4_XS) take the sign trick of [`super::avx2`] instead.
//!
//! Per group g, with exact integer sums: `ws[g] * as[g] * sum(u * a) - bias * ws[g] * (as[g] *
//! sum(a)) + wo[g] * (as[g] * sum(a))`, as the AVX-512 kernels compute it.

mod blocks32;
mod kquants;

use std::arch::x86_64::*;

use super::fused_avx512::FusedRow;
use kiln_quant::GgmlType;

/// The fused AVX2 kernel for `ty`, if there is one. Each requests its row's weight bytes ahead of
/// use itself ([`prefetch_ahead`]).
pub fn kernel(ty: GgmlType) -> Option<FusedRow> {
    Some(match ty {
        GgmlType::Q4_0 => blocks32::q4_0,
        GgmlType::Q4_1 => blocks32::q4_1,
        GgmlType::Q5_0 => blocks32::q5_0,
        GgmlType::Q5_1 => blocks32::q5_1,
        GgmlType::Q8_0 => blocks32::q8_0,
        GgmlType::IQ4_NL => blocks32::iq4_nl,
        GgmlType::MXFP4 => blocks32::mxfp4,
        GgmlType::NVFP4 => blocks32::nvfp4,
        GgmlType::Q2_K => kquants::q2_k,
        GgmlType::Q3_K => kquants::q3_k,
        GgmlType::Q4_K => kquants::q4_k,
        GgmlType::Q5_K => kquants::q5_k,
        GgmlType::Q6_K => kquants::q6_k,
        GgmlType::IQ4_XS => kquants::iq4_xs,
        GgmlType::TQ2_0 => kquants::tq2_0,
        GgmlType::Q1_0 => kquants::q1_0,
        _ => return None,
    })
}

/// How far ahead of the block being multiplied these kernels request weight bytes. Each kernel
/// asks, block by block, for the lines this far on (further along the row, or into the rows
/// after it), so the requests leave at the pace of the work; a whole row's lines requested at
/// the row's start fill the miss buffers and stall the core (docs/cpu.md, "The Llama-3-8B row").
const PREFETCH_AHEAD: usize = 2048;

/// Requests the cache lines of the `bytes` bytes that start [`PREFETCH_AHEAD`] past `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn prefetch_ahead(p: *const u8, bytes: usize) {
    let mut offset = 0;
    while offset < bytes {
        // A hint never faults, whatever the address (`wrapping_add` forms it without claiming it
        // lies in the row's allocation).
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_AHEAD + offset).cast());
        offset += 64;
    }
}

/// `sum(u[4i..4i+4] * a[4i..4i+4])` in i32 lane i, for unsigned codes `u` below 64.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_small(u: __m256i, a: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1))
}

/// `sum(s[4i..4i+4] * a[4i..4i+4])` in i32 lane i, for signed codes `s` (not -128) by the sign
/// trick: `|s| * (a * sign(s))`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_signed(s: __m256i, a: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(s), _mm256_sign_epi8(a, s)), _mm256_set1_epi16(1))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_at(bytes: &[u8], at: usize) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(u16::from_le_bytes([bytes[at], bytes[at + 1]])))))
}

/// 32 bytes, 0xff where bit j of `bits` is set and 0 elsewhere.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bit_bytes(bits: u32) -> __m256i {
    // Byte j takes byte j / 8 of the bits, then tests bit j % 8.
    let spread =
        _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), _mm256_setr_epi64x(0, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303));
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit)
}

/// The sum of the 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    super::avx2::hsum(v)
}

/// The sum of the 4 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum128(v: __m128) -> f32 {
    let half = _mm_add_ps(v, _mm_movehl_ps(v, v));
    _mm_cvtss_f32(_mm_add_ss(half, _mm_shuffle_ps::<1>(half, half)))
}

/// Eight bytes (the low 64 bits of `v`) as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn u8x8_to_f32(v: __m128i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
}
