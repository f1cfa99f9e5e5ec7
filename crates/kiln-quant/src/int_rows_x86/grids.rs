//! AVX2 decoders for the codebook formats: grid entries are looked up with scalar loads
//! (8 values each) or gathers (IQ3, 4 values each), signs applied as a byte mask, and
//! the per-group scales computed in scalar code with the scalar decoder's operations.

use super::util::*;
use crate::iq_grids::{IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID};
use crate::GgmlType;
use std::arch::x86_64::*;

/// Decodes `ty` when it has an AVX2 grid kernel.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn decode(ty: GgmlType, src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) -> bool {
    use GgmlType::*;
    match ty {
        IQ2_XXS => iq2_xxs(src, codes, scale),
        IQ2_XS => iq2_xs(src, codes, scale),
        IQ2_S => iq2_s(src, codes, scale),
        IQ3_XXS => iq3_xxs(src, codes, scale),
        IQ3_S => iq3_s(src, codes, scale),
        IQ1_S => iq1_s(src, codes, scale),
        IQ1_M => iq1_m(src, codes, scale),
        _ => return false,
    }
    offset.fill(0.0);
    true
}

/// ggml's `ksigns_iq2xs` (as `iq2::ksigns`): 7 sign bits and an even-parity eighth.
const KSIGNS: [u8; 128] = {
    let mut t = [0u8; 128];
    let mut i = 0;
    while i < 128 {
        t[i] = i as u8 | ((i.count_ones() as u8 & 1) << 7);
        i += 1;
    }
    t
};

/// Four 7-bit sign indices (bits 0..28 of `aux`) as 32 sign bits.
#[inline(always)]
fn ksigns4(aux: u32) -> u32 {
    (0..4).fold(0, |acc, l| acc | u32::from(KSIGNS[((aux >> (7 * l)) & 127) as usize]) << (8 * l))
}

/// Magnitudes negated where bit j of `signs` is set, then biased.
#[inline]
#[target_feature(enable = "avx2")]
fn signed(grid: __m256i, signs: u32) -> __m256i {
    let m = bit_mask32(signs);
    _mm256_xor_si256(_mm256_sub_epi8(_mm256_xor_si256(grid, m), m), _mm256_set1_epi8(-128))
}

#[inline]
#[target_feature(enable = "avx2")]
fn grid4(g: [u64; 4]) -> __m256i {
    _mm256_setr_epi64x(g[0] as i64, g[1] as i64, g[2] as i64, g[3] as i64)
}

/// ggml's IQ2 sub-scale: d * (0.5 + s) * mul, in that order.
#[inline(always)]
fn half_step(d: f32, s: u32, mul: f32) -> f32 {
    d * (0.5 + s as f32) * mul
}

#[target_feature(enable = "avx2,fma,f16c")]
fn iq2_xxs(src: &[u8], codes: &mut [u8], scale: &mut [f32]) {
    for ((b, out), s) in blocks::<66, _>(src).zip(blocks_mut::<256, _>(codes)).zip(blocks_mut::<8, _>(scale)) {
        let d = f16_at(b, 0);
        for (ib, s) in s.iter_mut().enumerate() {
            let (idx, aux) = (arr::<4>(b, 2 + 8 * ib), u32_at(b, 6 + 8 * ib));
            let grid = grid4(std::array::from_fn(|l| IQ2XXS_GRID[usize::from(idx[l])]));
            st32(arr_mut(out, 32 * ib), signed(grid, ksigns4(aux)));
            *s = half_step(d, aux >> 28, 0.25);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn iq2_xs(src: &[u8], codes: &mut [u8], scale: &mut [f32]) {
    for ((b, out), s) in blocks::<74, _>(src).zip(blocks_mut::<256, _>(codes)).zip(blocks_mut::<16, _>(scale)) {
        let d = f16_at(b, 0);
        for ib in 0..8 {
            let q: [u32; 4] = std::array::from_fn(|l| u32::from(u16::from_le_bytes(*arr(b, 2 + 2 * (4 * ib + l)))));
            let grid = grid4(std::array::from_fn(|l| IQ2XS_GRID[(q[l] & 511) as usize]));
            let signs = (0..4).fold(0, |acc, l| acc | u32::from(KSIGNS[(q[l] >> 9) as usize]) << (8 * l));
            st32(arr_mut(out, 32 * ib), signed(grid, signs));
            let sc = u32::from(b[66 + ib]);
            s[2 * ib] = half_step(d, sc & 0xf, 0.25);
            s[2 * ib + 1] = half_step(d, sc >> 4, 0.25);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn iq2_s(src: &[u8], codes: &mut [u8], scale: &mut [f32]) {
    for ((b, out), s) in blocks::<82, _>(src).zip(blocks_mut::<256, _>(codes)).zip(blocks_mut::<16, _>(scale)) {
        let d = f16_at(b, 0);
        for ib in 0..8 {
            let qh = u32::from(b[66 + ib]);
            let idx = |l: usize| (u32::from(b[2 + 4 * ib + l]) | ((qh << (8 - 2 * l)) & 0x300)) as usize;
            let grid = grid4(std::array::from_fn(|l| IQ2S_GRID[idx(l)]));
            st32(arr_mut(out, 32 * ib), signed(grid, u32_at(b, 34 + 4 * ib)));
            let sc = u32::from(b[74 + ib]);
            s[2 * ib] = half_step(d, sc & 0xf, 0.25);
            s[2 * ib + 1] = half_step(d, sc >> 4, 0.25);
        }
    }
}

/// Eight 4-value grid entries of `table` (dword k = entry `idx[k] mod N`).
#[inline]
#[target_feature(enable = "avx2")]
fn gather8<const N: usize>(table: &[u32; N], idx: __m256i) -> __m256i {
    const { assert!(N.is_power_of_two() && N <= 1 << 16) };
    let idx = _mm256_and_si256(idx, _mm256_set1_epi32(N as i32 - 1));
    // SAFETY: every index is below N (masked above); the table is N readable u32s.
    unsafe { _mm256_i32gather_epi32::<4>(table.as_ptr().cast(), idx) }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn iq3_xxs(src: &[u8], codes: &mut [u8], scale: &mut [f32]) {
    for ((b, out), s) in blocks::<98, _>(src).zip(blocks_mut::<256, _>(codes)).zip(blocks_mut::<8, _>(scale)) {
        let d = f16_at(b, 0);
        for (ib, s) in s.iter_mut().enumerate() {
            let idx = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(i64::from_le_bytes(*arr(b, 2 + 8 * ib))));
            let aux = u32_at(b, 66 + 4 * ib);
            st32(arr_mut(out, 32 * ib), signed(gather8(&IQ3XXS_GRID, idx), ksigns4(aux)));
            *s = half_step(d, aux >> 28, 0.5);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn iq3_s(src: &[u8], codes: &mut [u8], scale: &mut [f32]) {
    let (shifts, bit8) = (_mm256_setr_epi32(8, 7, 6, 5, 4, 3, 2, 1), _mm256_set1_epi32(256));
    for ((b, out), s) in blocks::<110, _>(src).zip(blocks_mut::<256, _>(codes)).zip(blocks_mut::<8, _>(scale)) {
        let d = f16_at(b, 0);
        for ib in 0..8 {
            // Entry k of the group: qs byte k, and bit k of qh as bit 8.
            let low = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(i64::from_le_bytes(*arr(b, 2 + 8 * ib))));
            let high = _mm256_and_si256(_mm256_sllv_epi32(_mm256_set1_epi32(i32::from(b[66 + ib])), shifts), bit8);
            let grid = gather8(&IQ3S_GRID, _mm256_or_si256(low, high));
            st32(arr_mut(out, 32 * ib), signed(grid, u32_at(b, 74 + 4 * ib)));
            let sc = (b[106 + ib / 2] >> (4 * (ib % 2))) & 0xf;
            s[ib] = d * f32::from(1 + 2 * sc);
        }
    }
}

/// 8 * grid + delta, biased: grid bytes are -1, 0, 1; `delta` is +-1 per 8 values.
#[inline]
#[target_feature(enable = "avx2")]
fn iq1_codes(grid: __m256i, biased_delta: __m256i) -> __m256i {
    // A 16-bit shift by 3 moves only the low byte's top bits into the high byte's bits 0..3.
    let times8 = _mm256_and_si256(_mm256_slli_epi16(grid, 3), _mm256_set1_epi8(-8));
    _mm256_add_epi8(times8, biased_delta)
}

/// 128 + delta in every byte of 8 values.
#[inline(always)]
fn biased_delta(neg: bool) -> u64 {
    if neg {
        0x7f7f_7f7f_7f7f_7f7f
    } else {
        0x8181_8181_8181_8181
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn iq1_s(src: &[u8], codes: &mut [u8], scale: &mut [f32]) {
    for ((b, out), s) in blocks::<50, _>(src).zip(blocks_mut::<256, _>(codes)).zip(blocks_mut::<8, _>(scale)) {
        let d = f16_at(b, 0);
        for ib in 0..8 {
            let qh = u32::from(u16::from_le_bytes(*arr(b, 34 + 2 * ib)));
            let idx = |l: usize| (u32::from(b[2 + 4 * ib + l]) | (((qh >> (3 * l)) & 7) << 8)) as usize;
            let grid = grid4(std::array::from_fn(|l| IQ1S_GRID[idx(l)]));
            let delta = _mm256_set1_epi64x(biased_delta(qh & 0x8000 != 0) as i64);
            st32(arr_mut(out, 32 * ib), iq1_codes(grid, delta));
            let dl = d * (2 * ((qh >> 12) & 7) + 1) as f32;
            s[ib] = dl * 0.125;
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn iq1_m(src: &[u8], codes: &mut [u8], scale: &mut [f32]) {
    for ((b, out), s) in blocks::<56, _>(src).zip(blocks_mut::<256, _>(codes)).zip(blocks_mut::<16, _>(scale)) {
        let sc: [u32; 4] = std::array::from_fn(|i| u32::from(u16::from_le_bytes(*arr(b, 48 + 2 * i))));
        let d_bits = (sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000);
        let d = crate::block::f32_of(half::f16::from_bits(d_bits as u16));
        for ib in 0..8 {
            // Per 8 values a nibble of qh: 3 high index bits and the delta's sign.
            let qh = |l: usize| u32::from(b[32 + 2 * ib + l / 2]) >> (4 * (l % 2));
            let grid = grid4(std::array::from_fn(|l| IQ1S_GRID[(u32::from(b[4 * ib + l]) | ((qh(l) & 7) << 8)) as usize]));
            let delta = grid4(std::array::from_fn(|l| biased_delta(qh(l) & 8 != 0)));
            st32(arr_mut(out, 32 * ib), iq1_codes(grid, delta));
            for half in 0..2 {
                let v = (sc[ib / 2] >> (6 * (ib % 2) + 3 * half)) & 7;
                s[2 * ib + half] = d * (2 * v + 1) as f32 * 0.125;
            }
        }
    }
}
