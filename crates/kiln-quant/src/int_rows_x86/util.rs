//! Bounds-safe loads and stores over fixed-size arrays, and small shared pieces.

use std::arch::x86_64::*;

/// `N` bytes of `s` from `at` (a constant offset into a fixed-size block, so the check folds away).
#[inline(always)]
pub(super) fn arr<const N: usize>(s: &[u8], at: usize) -> &[u8; N] {
    s[at..at + N].try_into().unwrap()
}

#[inline(always)]
pub(super) fn arr_mut<const N: usize, T>(s: &mut [T], at: usize) -> &mut [T; N] {
    (&mut s[at..at + N]).try_into().unwrap()
}

/// `s` as whole blocks of `N` (the length checks fold away).
#[inline(always)]
pub(super) fn blocks<const N: usize, T>(s: &[T]) -> impl Iterator<Item = &[T; N]> {
    s.chunks_exact(N).map(|c| c.try_into().unwrap())
}

#[inline(always)]
pub(super) fn blocks_mut<const N: usize, T>(s: &mut [T]) -> impl Iterator<Item = &mut [T; N]> {
    s.chunks_exact_mut(N).map(|c| c.try_into().unwrap())
}

/// The f16 at byte `at`, converted as the scalar decoder does.
#[inline(always)]
pub(super) fn f16_at(s: &[u8], at: usize) -> f32 {
    crate::block::f32_of(half::f16::from_bits(u16::from_le_bytes(*arr(s, at))))
}

#[inline(always)]
pub(super) fn u32_at(s: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(*arr(s, at))
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn ld16(b: &[u8; 16]) -> __m128i {
    // SAFETY: `b` has 16 readable bytes; the load is unaligned.
    unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn ld32(b: &[u8; 32]) -> __m256i {
    // SAFETY: `b` has 32 readable bytes; the load is unaligned.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn st16(out: &mut [u8; 16], v: __m128i) {
    // SAFETY: `out` has 16 writable bytes; the store is unaligned.
    unsafe { _mm_storeu_si128(out.as_mut_ptr().cast(), v) }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn st32(out: &mut [u8; 32], v: __m256i) {
    // SAFETY: `out` has 32 writable bytes; the store is unaligned.
    unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), v) }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn st_ps(out: &mut [f32; 8], v: __m256) {
    // SAFETY: `out` has 8 writable floats; the store is unaligned.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) }
}

/// 8 bytes (u64, lowest first) zero-extended to f32 lanes.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn u8x8_ps(bytes: u64) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes as i64)))
}

/// Byte `j` all ones where bit `j` of `bits` is set.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn bit_mask32(bits: u32) -> __m256i {
    let idx = _mm256_setr_epi64x(0, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303);
    let rep = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), idx);
    let select = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(rep, select), select)
}

/// Codebook for 4-bit codes, biased (`table[q] ^ 0x80`), in both 128-bit lanes.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn biased_lut(table: &[i8; 16]) -> __m256i {
    let biased: [u8; 16] = std::array::from_fn(|i| table[i] as u8 ^ 0x80);
    _mm256_broadcastsi128_si256(ld16(&biased))
}

/// 8 f16 values (bits) to f32 exactly as [`f32_of`](crate::block::f32_of) does. Not F16C:
/// `vcvtph2ps` quiets signaling NaNs, the scalar decoder keeps them.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn f16x8(bits: [u16; 8]) -> __m256 {
    // SAFETY: `bits` has 16 readable bytes; the load is unaligned.
    let x = _mm256_cvtepu16_epi32(unsafe { _mm_loadu_si128(bits.as_ptr().cast()) });
    let shifted = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fff)), 13);
    let finite = _mm256_mul_ps(_mm256_castsi256_ps(shifted), _mm256_set1_ps(f32::from_bits((127 + 112) << 23)));
    // Infinities and NaNs: the exponent field set, the payload kept.
    let special = _mm256_or_si256(shifted, _mm256_set1_epi32(0x7f80_0000));
    let is_special = _mm256_cmpgt_epi32(shifted, _mm256_set1_epi32(0x7bff << 13));
    let magnitude = _mm256_blendv_ps(finite, _mm256_castsi256_ps(special), _mm256_castsi256_ps(is_special));
    _mm256_or_ps(magnitude, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x8000)), 16)))
}

#[cfg(test)]
mod tests {
    #[test]
    fn f16x8_matches_f32_of_for_every_bit_pattern() {
        if !(is_x86_feature_detected!("avx2")) {
            return;
        }
        for base in (0..=u16::MAX).step_by(8) {
            let bits: [u16; 8] = std::array::from_fn(|i| base + i as u16);
            let mut got = [0f32; 8];
            // SAFETY: the CPU has AVX2 (checked above).
            unsafe { super::st_ps(&mut got, super::f16x8(bits)) };
            for (g, b) in got.iter().zip(bits) {
                assert_eq!(g.to_bits(), crate::block::f32_of(half::f16::from_bits(b)).to_bits(), "{b:#06x}");
            }
        }
    }
}
