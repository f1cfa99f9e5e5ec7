//! AVX2 decoders for the linear, K-quant, non-linear 4-bit and ternary formats.
//! Codes are built with 16-bit shifts and byte masks (a shift never leaks into the
//! bits a mask keeps); scales are vectorized where a block has eight or more.

use super::util::*;
use crate::GgmlType;
use std::arch::x86_64::*;

/// Decodes `ty` when it has an AVX2 kernel here or in `grids`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn decode(ty: GgmlType, src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) -> bool {
    use GgmlType::*;
    match ty {
        Q4_0 => q4_0(src, codes, scale, offset),
        Q4_1 => q4_1(src, codes, scale, offset),
        Q5_0 => q5_0(src, codes, scale, offset),
        Q5_1 => q5_1(src, codes, scale, offset),
        Q8_0 => q8_0(src, codes, scale, offset),
        IQ4_NL => iq4_nl(src, codes, scale, offset),
        MXFP4 => mxfp4(src, codes, scale, offset),
        Q2_K => q2_k(src, codes, scale, offset),
        Q3_K => q3_k(src, codes, scale, offset),
        Q4_K => q4_k(src, codes, scale, offset),
        Q5_K => q5_k(src, codes, scale, offset),
        Q6_K => q6_k(src, codes, scale, offset),
        IQ4_XS => iq4_xs(src, codes, scale, offset),
        TQ2_0 => tq2_0(src, codes, scale, offset),
        TQ1_0 => tq1_0(src, codes, scale, offset),
        Q1_0 => q1_0(src, codes, scale, offset),
        Q2_0 => q2_0(src, codes, scale, offset),
        NVFP4 => nvfp4(src, codes, scale, offset),
        _ => return super::grids::decode(ty, src, codes, scale, offset),
    }
    true
}

/// 16 packed bytes as 32 nibbles: bytes 0..16 the low nibbles, 16..32 the high ones.
#[inline]
#[target_feature(enable = "avx2")]
fn split_nibbles16(x: __m128i) -> __m256i {
    _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(0x0f))
}

/// The 32-value blocks with their f16 scale first (and an f16 offset next when `with_min`):
/// codes from `codes_of`, scales converted eight blocks at a time.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn blocks32<const B: usize>(src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32], with_min: bool, codes_of: impl Fn(&[u8; B]) -> __m256i) {
    // Groups of 8 whole blocks, then the rest one by one.
    let full = codes.len() / 256 * 8;
    let (src8, src_rest) = src.split_at(full * B);
    let (codes8, codes_rest) = codes.split_at_mut(full * 32);
    let (scale8, scale_rest) = scale.split_at_mut(full);
    let (offset8, offset_rest) = offset.split_at_mut(full);
    let groups = src8.chunks_exact(8 * B).zip(blocks_mut::<256, _>(codes8)).zip(blocks_mut::<8, _>(scale8)).zip(blocks_mut::<8, _>(offset8));
    for (((b, out), s), o) in groups {
        for i in 0..8 {
            st32(arr_mut(out, 32 * i), codes_of(arr(b, B * i)));
        }
        let f16s = |at: usize| f16x8(std::array::from_fn(|i| u16::from_le_bytes(*arr(b, B * i + at))));
        st_ps(s, f16s(0));
        st_ps(o, if with_min { f16s(2) } else { _mm256_setzero_ps() });
    }
    let rest = blocks::<B, _>(src_rest).zip(blocks_mut::<32, _>(codes_rest)).zip(scale_rest).zip(offset_rest);
    for (((b, out), s), o) in rest {
        st32(out, codes_of(b));
        *s = f16_at(b, 0);
        *o = if with_min { f16_at(b, 2) } else { 0.0 };
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q4_0(src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) {
    // (q - 8) ^ 0x80 = q + 120.
    let bias = _mm256_set1_epi8(120);
    blocks32::<18>(src, codes, scale, offset, false, |b| _mm256_add_epi8(split_nibbles16(ld16(arr(b, 2))), bias));
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q4_1(src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) {
    let flip = _mm256_set1_epi8(-128);
    blocks32::<20>(src, codes, scale, offset, true, |b| _mm256_or_si256(split_nibbles16(ld16(arr(b, 4))), flip));
}

#[target_feature(enable = "avx2,fma,f16c")]
fn iq4_nl(src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) {
    let lut = biased_lut(&crate::IQ4_NL_CODEBOOK);
    blocks32::<18>(src, codes, scale, offset, false, |b| _mm256_shuffle_epi8(lut, split_nibbles16(ld16(arr(b, 2)))));
}

#[target_feature(enable = "avx2,fma,f16c")]
fn mxfp4(src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) {
    let lut = biased_lut(&crate::E2M1_X2);
    let blocks = blocks::<17, _>(src).zip(blocks_mut::<32, _>(codes));
    for ((b, out), s) in blocks.zip(scale.iter_mut()) {
        st32(out, _mm256_shuffle_epi8(lut, split_nibbles16(ld16(arr(b, 1)))));
        *s = crate::e8m0_half(b[0]);
    }
    offset.fill(0.0);
}

/// Q5_0/Q5_1 codes: nibbles plus bit j of `qh` as bit 4 of value j, then `bias` added.
#[inline]
#[target_feature(enable = "avx2")]
fn five_bit<const B: usize>(b: &[u8; B], qh_at: usize, bias: __m256i) -> __m256i {
    let nib = split_nibbles16(ld16(arr(b, qh_at + 4)));
    let high = _mm256_and_si256(bit_mask32(u32_at(b, qh_at)), _mm256_set1_epi8(0x10));
    _mm256_add_epi8(_mm256_or_si256(nib, high), bias)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q5_0(src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) {
    // (q - 16) ^ 0x80 = q + 112.
    let bias = _mm256_set1_epi8(112);
    blocks32::<22>(src, codes, scale, offset, false, |b| five_bit(b, 2, bias));
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q5_1(src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) {
    let flip = _mm256_set1_epi8(-128);
    blocks32::<24>(src, codes, scale, offset, true, |b| five_bit(b, 4, flip));
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q8_0(src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) {
    let flip = _mm256_set1_epi8(-128);
    blocks32::<34>(src, codes, scale, offset, false, |b| _mm256_xor_si256(ld32(arr(b, 2)), flip));
}

/// Field `k` (bits 2k..2k+2) of each byte of `x`, for k = 0..4.
#[inline]
#[target_feature(enable = "avx2")]
fn crumbs(x: __m256i) -> [__m256i; 4] {
    let m = _mm256_set1_epi8(3);
    [
        _mm256_and_si256(x, m),
        _mm256_and_si256(_mm256_srli_epi16(x, 2), m),
        _mm256_and_si256(_mm256_srli_epi16(x, 4), m),
        _mm256_and_si256(_mm256_srli_epi16(x, 6), m),
    ]
}

/// The 2-bit layout of Q2_K, Q3_K and TQ2_0: value 128h + 32k + l is field k of `qs[32h + l]`.
/// `f(value_group, fields)` finishes each 32 codes (value_group = 4h + k).
#[inline]
#[target_feature(enable = "avx2")]
fn two_bit(qs: &[u8; 64], out: &mut [u8; 256], mut f: impl FnMut(usize, __m256i) -> __m256i) {
    for h in 0..2 {
        let fields = crumbs(ld32(arr(qs, 32 * h)));
        for (k, v) in fields.into_iter().enumerate() {
            st32(arr_mut(out, 128 * h + 32 * k), f(4 * h + k, v));
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q2_k(src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) {
    let flip = _mm256_set1_epi8(-128);
    let blocks = blocks::<84, _>(src).zip(blocks_mut::<256, _>(codes));
    let groups = blocks_mut::<16, _>(scale).zip(blocks_mut::<16, _>(offset));
    for ((b, out), (s, o)) in blocks.zip(groups) {
        two_bit(arr(b, 16), out, |_, v| _mm256_or_si256(v, flip));
        let (d, dmin) = (_mm256_set1_ps(f16_at(b, 80)), _mm256_set1_ps(f16_at(b, 82)));
        let sc = u128::from_le_bytes(*arr(b, 0));
        let low = u128::from_le_bytes([0x0f; 16]);
        let (lo, hi) = (sc & low, (sc >> 4) & low);
        let neg = _mm256_set1_ps(-0.0);
        for half in 0..2 {
            st_ps(arr_mut(s, 8 * half), _mm256_mul_ps(d, u8x8_ps((lo >> (64 * half)) as u64)));
            st_ps(arr_mut(o, 8 * half), _mm256_xor_ps(_mm256_mul_ps(dmin, u8x8_ps((hi >> (64 * half)) as u64)), neg));
        }
    }
}

/// Bit `g` of each byte of `bits`, moved to bit `to`, for g = 0..8.
#[inline]
#[target_feature(enable = "avx2")]
fn bit_planes(bits: __m256i, to: i32) -> [__m256i; 8] {
    let mut cur = bits;
    let keep = _mm256_set1_epi8(1 << to);
    std::array::from_fn(|_| {
        // Right shifts by 16-bit lanes only feed bit 7 of the low byte from the high one;
        // at most 7 shifts never bring it down to bit 0.
        let plane = _mm256_and_si256(_mm256_sll_epi16(cur, _mm_cvtsi32_si128(to)), keep);
        cur = _mm256_srli_epi16(cur, 1);
        plane
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q3_k(src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) {
    // (q + 4*hbit - 4) ^ 0x80 = (q | hbit << 2) + 124.
    let bias = _mm256_set1_epi8(124);
    let blocks = blocks::<110, _>(src).zip(blocks_mut::<256, _>(codes));
    for ((b, out), s) in blocks.zip(blocks_mut::<16, _>(scale)) {
        let planes = bit_planes(ld32(arr(b, 0)), 2);
        two_bit(arr(b, 32), out, |g, v| _mm256_add_epi8(_mm256_or_si256(v, planes[g]), bias));
        let (w0, w1, w2) = (u32_at(b, 96), u32_at(b, 100), u32_at(b, 104));
        let (lo4, hi2) = (0x0f0f_0f0fu32, 0x3030_3030u32);
        let s6 = [(w0 & lo4) | ((w2 << 4) & hi2), (w1 & lo4) | ((w2 << 2) & hi2), ((w0 >> 4) & lo4) | (w2 & hi2), ((w1 >> 4) & lo4) | ((w2 >> 2) & hi2)];
        let d = _mm256_set1_ps(f16_at(b, 108));
        for half in 0..2 {
            let bytes = u64::from(s6[2 * half]) | u64::from(s6[2 * half + 1]) << 32;
            let signed = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes as i64)), _mm256_set1_epi32(32));
            st_ps(arr_mut(s, 8 * half), _mm256_mul_ps(d, _mm256_cvtepi32_ps(signed)));
        }
    }
    offset.fill(0.0);
}

/// Q4_K/Q5_K 6-bit scales and mins of the 8 groups, one byte each (ggml's `get_scale_min_k4`
/// on all groups at once).
#[inline(always)]
fn k4_scale_min(q: &[u8; 12]) -> (u64, u64) {
    let (w0, w1, w2) = (u32_at(q, 0), u32_at(q, 4), u32_at(q, 8));
    let (low6, low4, top2) = (0x3f3f_3f3fu32, 0x0f0f_0f0fu32, 0x3030_3030u32);
    let sc = (w0 & low6) as u64 | (((w2 & low4) | ((w0 >> 2) & top2)) as u64) << 32;
    let m = (w1 & low6) as u64 | ((((w2 >> 4) & low4) | ((w1 >> 2) & top2)) as u64) << 32;
    (sc, m)
}

/// d * sc and -(dmin * m) of Q4_K/Q5_K.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn k4_scales(b: &[u8], s: &mut [f32; 8], o: &mut [f32; 8]) {
    let (sc, m) = k4_scale_min(arr(b, 4));
    st_ps(s, _mm256_mul_ps(_mm256_set1_ps(f16_at(b, 0)), u8x8_ps(sc)));
    st_ps(o, _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(f16_at(b, 2)), u8x8_ps(m)), _mm256_set1_ps(-0.0)));
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q4_k(src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) {
    let (low, flip) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(-128));
    let blocks = blocks::<144, _>(src).zip(blocks_mut::<256, _>(codes));
    let groups = blocks_mut::<8, _>(scale).zip(blocks_mut::<8, _>(offset));
    for ((b, out), (s, o)) in blocks.zip(groups) {
        for p in 0..4 {
            let x = ld32(arr(b, 16 + 32 * p));
            st32(arr_mut(out, 64 * p), _mm256_or_si256(_mm256_and_si256(x, low), flip));
            st32(arr_mut(out, 64 * p + 32), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(x, 4), low), flip));
        }
        k4_scales(b, s, o);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q5_k(src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) {
    let (low, flip) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(-128));
    let blocks = blocks::<176, _>(src).zip(blocks_mut::<256, _>(codes));
    let groups = blocks_mut::<8, _>(scale).zip(blocks_mut::<8, _>(offset));
    for ((b, out), (s, o)) in blocks.zip(groups) {
        let planes = bit_planes(ld32(arr(b, 16)), 4);
        for p in 0..4 {
            let x = ld32(arr(b, 48 + 32 * p));
            let lo = _mm256_or_si256(_mm256_and_si256(x, low), planes[2 * p]);
            let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(x, 4), low), planes[2 * p + 1]);
            st32(arr_mut(out, 64 * p), _mm256_or_si256(lo, flip));
            st32(arr_mut(out, 64 * p + 32), _mm256_or_si256(hi, flip));
        }
        k4_scales(b, s, o);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q6_k(src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) {
    let (low, top, bias) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x30), _mm256_set1_epi8(96));
    let blocks = blocks::<210, _>(src).zip(blocks_mut::<256, _>(codes));
    for ((b, out), s) in blocks.zip(blocks_mut::<16, _>(scale)) {
        for h in 0..2 {
            let (ql0, ql1, qh) = (ld32(arr(b, 64 * h)), ld32(arr(b, 64 * h + 32)), ld32(arr(b, 128 + 32 * h)));
            let six = [
                (_mm256_and_si256(ql0, low), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top)),
                (_mm256_and_si256(ql1, low), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top)),
                (_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), _mm256_and_si256(qh, top)),
                (_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low), _mm256_and_si256(_mm256_srli_epi16(qh, 2), top)),
            ];
            // (q - 32) ^ 0x80 = q + 96.
            for (k, (l, t)) in six.into_iter().enumerate() {
                st32(arr_mut(out, 128 * h + 32 * k), _mm256_add_epi8(_mm256_or_si256(l, t), bias));
            }
        }
        let d = _mm256_set1_ps(f16_at(b, 208));
        let sc = ld16(arr(b, 192));
        st_ps(arr_mut(s, 0), _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
        st_ps(arr_mut(s, 8), _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
    }
    offset.fill(0.0);
}

#[target_feature(enable = "avx2,fma,f16c")]
fn iq4_xs(src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) {
    let (low, lut) = (_mm256_set1_epi8(0x0f), biased_lut(&crate::IQ4_NL_CODEBOOK));
    let blocks = blocks::<136, _>(src).zip(blocks_mut::<256, _>(codes));
    for ((b, out), s) in blocks.zip(blocks_mut::<8, _>(scale)) {
        for p in 0..4 {
            // Bytes 0..16 hold group 2p, 16..32 group 2p + 1.
            let x = ld32(arr(b, 8 + 32 * p));
            let lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(x, low));
            let hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(x, 4), low));
            st32(arr_mut(out, 64 * p), _mm256_permute2x128_si256(lo, hi, 0x20));
            st32(arr_mut(out, 64 * p + 32), _mm256_permute2x128_si256(lo, hi, 0x31));
        }
        let ls =
            _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(u32_at(b, 4) as i32), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)), _mm256_set1_epi32(0xf));
        let hs = _mm256_and_si256(
            _mm256_srlv_epi32(_mm256_set1_epi32(u32_at(b, 0) as i32 >> 16), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
            _mm256_set1_epi32(3),
        );
        let l = _mm256_sub_epi32(_mm256_or_si256(ls, _mm256_slli_epi32(hs, 4)), _mm256_set1_epi32(32));
        st_ps(s, _mm256_mul_ps(_mm256_set1_ps(f16_at(b, 0)), _mm256_cvtepi32_ps(l)));
    }
    offset.fill(0.0);
}

#[target_feature(enable = "avx2,fma,f16c")]
fn tq2_0(src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) {
    // (q - 1) ^ 0x80 = q + 127.
    let bias = _mm256_set1_epi8(127);
    let blocks = blocks::<66, _>(src).zip(blocks_mut::<256, _>(codes));
    for ((b, out), s) in blocks.zip(blocks_mut::<8, _>(scale)) {
        two_bit(arr(b, 0), out, |_, v| _mm256_add_epi8(v, bias));
        s.fill(f16_at(b, 64));
    }
    offset.fill(0.0);
}

/// Trit `n` (0 = most significant) of each byte holding ceil(T * 256 / 243), plus 128:
/// `((byte * 3^n) mod 256) * 3 >> 8`, on even and odd bytes in separate 16-bit lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn trits(x: __m256i, pow3: i16) -> __m256i {
    let (p, three) = (_mm256_set1_epi16(pow3), _mm256_set1_epi16(3));
    // Each byte moved to the top of its lane, so the product's top byte is (byte * 3^n) mod 256.
    let even = _mm256_mulhi_epu16(_mm256_mullo_epi16(_mm256_slli_epi16(x, 8), p), three);
    let odd = _mm256_mulhi_epu16(_mm256_mullo_epi16(_mm256_and_si256(x, _mm256_set1_epi16(-256)), p), three);
    // (t - 1) ^ 0x80 = t + 127.
    _mm256_add_epi8(_mm256_or_si256(even, _mm256_slli_epi16(odd, 8)), _mm256_set1_epi8(127))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn tq1_0(src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) {
    const POW3: [i16; 5] = [1, 3, 9, 27, 81];
    let blocks = blocks::<54, _>(src).zip(blocks_mut::<256, _>(codes));
    for ((b, out), s) in blocks.zip(blocks_mut::<8, _>(scale)) {
        let x = ld32(arr(b, 0));
        for (n, &p) in POW3.iter().enumerate() {
            st32(arr_mut(out, 32 * n), trits(x, p));
        }
        // qs[32..48] give values 160 + 16n + m: two trit rows per 32 codes (the last alone).
        let y = ld16(arr(b, 32));
        let yy = _mm256_set_m128i(y, y);
        for n in 0..2 {
            let p = _mm256_setr_m128i(_mm_set1_epi16(POW3[2 * n]), _mm_set1_epi16(POW3[2 * n + 1]));
            st32(arr_mut(out, 160 + 32 * n), trits_lanes(yy, p));
        }
        st16(arr_mut(out, 224), _mm256_castsi256_si128(trits(yy, POW3[4])));
        // qh: 4 trits of 4 bytes, value 240 + 4n + j; dword n holds the 4 bytes times 3^n.
        let qh = _mm256_set1_epi32(u32_at(b, 48) as i32);
        let p = _mm256_setr_epi32(1 | 1 << 16, 3 | 3 << 16, 9 | 9 << 16, 27 | 27 << 16, 0, 0, 0, 0);
        st16(arr_mut(out, 240), _mm256_castsi256_si128(trits_lanes(qh, p)));
        s.fill(f16_at(b, 52));
    }
    offset.fill(0.0);
}

/// [`trits`] with a power of three per 16-bit lane.
#[inline]
#[target_feature(enable = "avx2")]
fn trits_lanes(x: __m256i, p: __m256i) -> __m256i {
    let three = _mm256_set1_epi16(3);
    let even = _mm256_mulhi_epu16(_mm256_mullo_epi16(_mm256_slli_epi16(x, 8), p), three);
    let odd = _mm256_mulhi_epu16(_mm256_mullo_epi16(_mm256_and_si256(x, _mm256_set1_epi16(-256)), p), three);
    _mm256_add_epi8(_mm256_or_si256(even, _mm256_slli_epi16(odd, 8)), _mm256_set1_epi8(127))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q1_0(src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) {
    // Bit set: +1 ^ 0x80 = 129, clear: -1 ^ 0x80 = 127.
    let (two, base) = (_mm256_set1_epi8(2), _mm256_set1_epi8(127));
    let blocks = blocks::<18, _>(src).zip(blocks_mut::<128, _>(codes));
    for ((b, out), s) in blocks.zip(blocks_mut::<4, _>(scale)) {
        for k in 0..4 {
            let set = bit_mask32(u32_at(b, 2 + 4 * k));
            st32(arr_mut(out, 32 * k), _mm256_add_epi8(base, _mm256_and_si256(set, two)));
        }
        s.fill(f16_at(b, 0));
    }
    offset.fill(0.0);
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q2_0(src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) {
    let (m, bias) = (_mm_set1_epi8(3), _mm_set1_epi8(127));
    let blocks = blocks::<18, _>(src).zip(blocks_mut::<64, _>(codes));
    for ((b, out), s) in blocks.zip(blocks_mut::<2, _>(scale)) {
        // Value 4i + k is field k of byte i: interleave the four field vectors.
        let x = ld16(arr(b, 2));
        let f = [_mm_and_si128(x, m), _mm_and_si128(_mm_srli_epi16(x, 2), m), _mm_and_si128(_mm_srli_epi16(x, 4), m), _mm_and_si128(_mm_srli_epi16(x, 6), m)];
        let (a_lo, a_hi) = (_mm_unpacklo_epi8(f[0], f[1]), _mm_unpackhi_epi8(f[0], f[1]));
        let (b_lo, b_hi) = (_mm_unpacklo_epi8(f[2], f[3]), _mm_unpackhi_epi8(f[2], f[3]));
        let quads = [_mm_unpacklo_epi16(a_lo, b_lo), _mm_unpackhi_epi16(a_lo, b_lo), _mm_unpacklo_epi16(a_hi, b_hi), _mm_unpackhi_epi16(a_hi, b_hi)];
        for (k, q) in quads.into_iter().enumerate() {
            st16(arr_mut(out, 16 * k), _mm_add_epi8(q, bias));
        }
        s.fill(f16_at(b, 0));
    }
    offset.fill(0.0);
}

#[target_feature(enable = "avx2,fma,f16c")]
fn nvfp4(src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) {
    let (low, lut) = (_mm256_set1_epi8(0x0f), biased_lut(&crate::E2M1_X2));
    let table = ue4m3_table();
    let blocks = blocks::<36, _>(src).zip(blocks_mut::<64, _>(codes));
    for ((b, out), s) in blocks.zip(blocks_mut::<4, _>(scale)) {
        // Group g is qs[8g..8g+8]: low nibbles then high ones.
        let x = ld32(arr(b, 4));
        let lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(x, low));
        let hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(x, 4), low));
        let (g02, g13) = (_mm256_unpacklo_epi64(lo, hi), _mm256_unpackhi_epi64(lo, hi));
        st32(arr_mut(out, 0), _mm256_permute2x128_si256(g02, g13, 0x20));
        st32(arr_mut(out, 32), _mm256_permute2x128_si256(g02, g13, 0x31));
        *s = std::array::from_fn(|g| table[usize::from(b[g])]);
    }
    offset.fill(0.0);
}

/// `ue4m3_half` of every byte, built once.
fn ue4m3_table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|b| crate::ue4m3_half(b as u8)))
}
