//! Fused AVX2 kernels of the 256-value super-blocks (K-quants, IQ4_XS, TQ2_0) and Q1_0.

use std::arch::x86_64::*;

use kiln_quant::IQ4_NL_CODEBOOK;

use super::{bit_bytes, dot_signed, dot_small, f16_at, hsum, prefetch_ahead, u8x8_to_f32};
use crate::cpu_int::acts::QuantizedActs;
use crate::cpu_int::fused_avx512::k4_scales;

/// Bit `from` of every byte of `v` moved to bit `to` of the byte (`keep` the bit `to` of every
/// byte), for `from`, `to` < 8.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bit_plane(v: __m256i, from: i32, to: i32, keep: __m256i) -> __m256i {
    // A 16-bit shift by at most 7 moves no bit of one byte onto the kept bit of the other.
    let moved = if from >= to { _mm256_srl_epi16(v, _mm_cvtsi32_si128(from - to)) } else { _mm256_sll_epi16(v, _mm_cvtsi32_si128(to - from)) };
    _mm256_and_si256(moved, keep)
}

/// `vpmaddwd` multipliers for 32 values whose two 16-value groups have the i16 scales at lanes
/// `2k` and `2k + 1` of `s` (8 i16 lanes, the same in both 128-bit halves): group `2k`'s scale in
/// the low 128 bits, group `2k + 1`'s in the high.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pick_pair(s: __m256i, k: i32) -> __m256i {
    let lane = |i: i32| ((4 * k + 2 * i + 1) << 8 | (4 * k + 2 * i)) as i16;
    _mm256_shuffle_epi8(s, _mm256_set_m128i(_mm_set1_epi16(lane(1)), _mm_set1_epi16(lane(0))))
}

/// The 16-value-group kernel body of Q2_K and Q3_K: block `b` of token `t`, 16 i16 scales in
/// `scales`, `codes(h, k)` the 32 codes (below 64) of values 128h + 32k.., `d` the block scale.
/// Each 32 values take one `vpmaddwd` by their two groups' scales and one f32 multiply-add.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn groups16_block(acts: &QuantizedActs, t: usize, b: usize, d: f32, scales: __m256i, codes: impl Fn(usize, i32) -> __m256i, main: &mut [__m256; 2]) {
    let cols = acts.cols;
    let qs = acts.qs.as_ptr().add(t * cols + 256 * b);
    let mut c = [0f32; 8];
    // SAFETY: block b's 8 activation scales and 256 codes lie inside token t's activations.
    _mm256_storeu_ps(c.as_mut_ptr(), _mm256_mul_ps(_mm256_set1_ps(d), _mm256_loadu_ps(acts.scale.as_ptr().add(t * cols / 32 + 8 * b))));
    for h in 0..2 {
        let half = if h == 0 { _mm256_permute2x128_si256::<0x00>(scales, scales) } else { _mm256_permute2x128_si256::<0x11>(scales, scales) };
        for k in 0..4 {
            let pairs = _mm256_maddubs_epi16(codes(h, k), _mm256_loadu_si256(qs.add(128 * h + 32 * k as usize).cast()));
            let dot = _mm256_madd_epi16(pairs, pick_pair(half, k));
            main[k as usize % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(c[4 * h + k as usize]), main[k as usize % 2]);
        }
    }
}

/// Q2_K: 84-byte blocks (16 scale bytes: scale low nibble, min high nibble; 64 bytes of 2-bit
/// codes, value 128h + 32k + l at bits 2k of byte 32h + l; f16 d, dmin), 16 groups of 16,
/// value = d * sc * q - dmin * m.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `row` holds `acts.cols` values of the format.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q2_k(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let cols = acts.cols;
    let sums = acts.scaled_sum16.as_ptr().add(t * cols / 16);
    let (mut main, mut offsets) = ([_mm256_setzero_ps(); 2], _mm256_setzero_ps());
    let (three, nibble) = (_mm256_set1_epi8(3), _mm_set1_epi8(0x0f));
    for b in 0..cols / 256 {
        let block = &row[84 * b..84 * (b + 1)];
        prefetch_ahead(block.as_ptr(), block.len());
        let (d, dmin) = (f16_at(block, 80), f16_at(block, 82));
        // SAFETY: the block's 16 scale bytes and 64 code bytes; 16 scaled sums of token t.
        let packed = _mm_loadu_si128(block.as_ptr().cast());
        let m = _mm_and_si128(_mm_srli_epi16::<4>(packed), nibble);
        let m_terms = _mm256_fmadd_ps(
            u8x8_to_f32(m),
            _mm256_loadu_ps(sums.add(16 * b)),
            _mm256_mul_ps(u8x8_to_f32(_mm_srli_si128::<8>(m)), _mm256_loadu_ps(sums.add(16 * b + 8))),
        );
        offsets = _mm256_fnmadd_ps(_mm256_set1_ps(dmin), m_terms, offsets);
        let q = [_mm256_loadu_si256(block.as_ptr().add(16).cast()), _mm256_loadu_si256(block.as_ptr().add(48).cast())];
        let codes = |h: usize, k: i32| _mm256_and_si256(_mm256_srl_epi16(q[h], _mm_cvtsi32_si128(2 * k)), three);
        groups16_block(acts, t, b, d, _mm256_cvtepu8_epi16(_mm_and_si128(packed, nibble)), codes, &mut main);
    }
    hsum(_mm256_add_ps(main[0], main[1])) + hsum(offsets)
}

/// Q3_K: 110-byte blocks (32 bytes of high bits: bit g of hmask[l] for value 32g + l; 64 bytes
/// of 2-bit codes as Q2_K's; 12 bytes of 6-bit scales; f16 d), 16 groups of 16,
/// value = d * (sc - 32) * (q + 4 * hbit - 4): u = q + 4 * hbit, bias 4.
///
/// # Safety
/// As [`q2_k`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q3_k(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let cols = acts.cols;
    let sums = acts.scaled_sum16.as_ptr().add(t * cols / 16);
    let (mut main, mut bias_terms) = ([_mm256_setzero_ps(); 2], _mm256_setzero_ps());
    let (three, four) = (_mm256_set1_epi8(3), _mm256_set1_epi8(4));
    for b in 0..cols / 256 {
        let block = &row[110 * b..110 * (b + 1)];
        prefetch_ahead(block.as_ptr(), block.len());
        let d = f16_at(block, 108);
        let s = &block[96..108];
        let low = u64::from_le_bytes(s[..8].try_into().expect("8 bytes"));
        let high = u32::from_le_bytes(s[8..12].try_into().expect("4 bytes"));
        let bits = |shift: u32| u64::from((high >> shift) & 0x0303_0303);
        let first = (low & 0x0f0f_0f0f_0f0f_0f0f) | (bits(0) | bits(2) << 32) << 4;
        let second = ((low >> 4) & 0x0f0f_0f0f_0f0f_0f0f) | (bits(4) | bits(6) << 32) << 4;
        let sc = _mm_sub_epi8(_mm_set_epi64x(second as i64, first as i64), _mm_set1_epi8(32));
        let sc_f = [_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(sc)))];
        // SAFETY: the block's 32 high-bit bytes and 64 code bytes; 16 scaled sums of token t.
        let scaled = _mm256_fmadd_ps(sc_f[0], _mm256_loadu_ps(sums.add(16 * b)), _mm256_mul_ps(sc_f[1], _mm256_loadu_ps(sums.add(16 * b + 8))));
        bias_terms = _mm256_fmadd_ps(_mm256_set1_ps(d), scaled, bias_terms);
        let hmask = _mm256_loadu_si256(block.as_ptr().cast());
        let q = [_mm256_loadu_si256(block.as_ptr().add(32).cast()), _mm256_loadu_si256(block.as_ptr().add(64).cast())];
        let codes = |h: usize, k: i32| {
            let low = _mm256_and_si256(_mm256_srl_epi16(q[h], _mm_cvtsi32_si128(2 * k)), three);
            _mm256_or_si256(low, bit_plane(hmask, 4 * h as i32 + k, 2, four))
        };
        groups16_block(acts, t, b, d, _mm256_cvtepi8_epi16(sc), codes, &mut main);
    }
    hsum(_mm256_add_ps(main[0], main[1])) - 4.0 * hsum(bias_terms)
}

/// Q4_K and Q5_K: f16 d, dmin, 12 bytes of 6-bit scales/mins, (Q5_K: 32 bytes of fifth bits,
/// bit g of qh[l] for value 32g + l), 128 nibble bytes (byte 32p + l holds value 64p + l low and
/// 64p + 32 + l high); 8 groups of 32, value = d * sc * u - dmin * m.
///
/// A group's 32 products leave `vpmaddubsw` as 16 i16 pair sums. Rather than widening each
/// group by a `vpmaddwd` and scaling it by its own f32 multiply-add (eight of each per block,
/// on the pipes the multiplies need), the eight groups are folded together by horizontal i16
/// adds, widened once and scaled by one multiply-add per block. Two levels of adds sum 4 pair
/// sums, at most 4 x 2 x 31 x 128 < 2^15 for codes below 32, so nothing wraps.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_style<const FIVE: bool>(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let (block_bytes, qs_at) = if FIVE { (176, 48) } else { (144, 16) };
    let cols = acts.cols;
    let (blocks, groups) = (cols / 256, cols / 32);
    let qs = acts.qs.as_ptr().add(t * cols);
    let (act_scale, sums) = (acts.scale.as_ptr().add(t * groups), acts.scaled_sum32.as_ptr().add(t * groups));
    let (mut main, mut offsets) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let (mask, fifth, ones) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x10), _mm256_set1_epi16(1));
    for b in 0..blocks {
        let block = &row[b * block_bytes..(b + 1) * block_bytes];
        prefetch_ahead(block.as_ptr(), block.len());
        let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
        let (sc, m) = k4_scales(&block[4..16]);
        let to_f32 = |bytes: u64| u8x8_to_f32(_mm_cvtsi64_si128(bytes as i64));
        // SAFETY (loads): groups 8b..8b+8 of the activation scales and sums, values 256b.. of the codes.
        let coef = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d), to_f32(sc)), _mm256_loadu_ps(act_scale.add(8 * b)));
        offsets = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(-dmin), to_f32(m)), _mm256_loadu_ps(sums.add(8 * b)), offsets);
        let qh = if FIVE { _mm256_loadu_si256(block.as_ptr().add(16).cast()) } else { _mm256_setzero_si256() };
        // pairs[g]: group g's 16 i16 pair sums (group 2p: the low nibbles of bytes 32p.., 2p + 1 the high).
        let mut pairs = [_mm256_setzero_si256(); 8];
        for p in 0..4 {
            let w = _mm256_loadu_si256(block.as_ptr().add(qs_at + 32 * p).cast());
            let (mut lo, mut hi) = (_mm256_and_si256(w, mask), _mm256_and_si256(_mm256_srli_epi16::<4>(w), mask));
            if FIVE {
                lo = _mm256_or_si256(lo, bit_plane(qh, 2 * p as i32, 4, fifth));
                hi = _mm256_or_si256(hi, bit_plane(qh, 2 * p as i32 + 1, 4, fifth));
            }
            let at = qs.add(256 * b + 64 * p);
            pairs[2 * p] = _mm256_maddubs_epi16(lo, _mm256_loadu_si256(at.cast()));
            pairs[2 * p + 1] = _mm256_maddubs_epi16(hi, _mm256_loadu_si256(at.add(32).cast()));
        }
        // Within each 128-bit half, two levels of horizontal adds leave groups 0-3 (then 4-7)
        // two i16 sums each, in group order; vpmaddwd by ones widens them to one i32 per group
        // and half; the two halves of every group are then added.
        let quads = |g: usize| {
            let first = _mm256_hadd_epi16(pairs[g], pairs[g + 1]);
            let second = _mm256_hadd_epi16(pairs[g + 2], pairs[g + 3]);
            _mm256_madd_epi16(_mm256_hadd_epi16(first, second), ones)
        };
        let (low_groups, high_groups) = (quads(0), quads(4));
        let sums_i32 = _mm256_add_epi32(_mm256_permute2x128_si256::<0x20>(low_groups, high_groups), _mm256_permute2x128_si256::<0x31>(low_groups, high_groups));
        main = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums_i32), coef, main);
    }
    hsum(main) + hsum(offsets)
}

/// Q4_K: 144-byte blocks of 256 (see [`k4_style`]).
///
/// # Safety
/// As [`q2_k`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q4_k(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    k4_style::<false>(row, acts, t)
}

/// Q5_K: 176-byte blocks of 256, Q4_K with a fifth bit per value (see [`k4_style`]).
///
/// # Safety
/// As [`q2_k`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q5_k(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    k4_style::<true>(row, acts, t)
}

/// Q6_K: 210-byte blocks of 256 (ql[128], qh[64], 16 signed scales, f16 d), 16 groups of 16,
/// value = d * sc * (u - 32). Value 128h + 32k + l has its low nibble in ql[64h + 32(k % 2) + l]
/// (high nibble for k >= 2) and its top two bits at bit 2k of qh[32h + l].
///
/// # Safety
/// As [`q2_k`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q6_k(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let cols = acts.cols;
    let blocks = cols / 256;
    let qs = acts.qs.as_ptr().add(t * cols);
    let (act_scale, sums) = (acts.scale.as_ptr().add(t * cols / 32), acts.scaled_sum16.as_ptr().add(t * cols / 16));
    let (mut main, mut bias_terms) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let (nibble, two_bits, ones) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x30), _mm256_set1_epi16(1));
    // The folded sums of 8 groups come out as groups (0, 2, 4, 6, 1, 3, 5, 7); their weight
    // scales are permuted to match, and chunk c's activation scale serves groups 2c and 2c + 1.
    let even_odd = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    let act_of = [_mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3), _mm256_setr_epi32(4, 5, 6, 7, 4, 5, 6, 7)];
    for b in 0..blocks {
        let block = &row[b * 210..(b + 1) * 210];
        prefetch_ahead(block.as_ptr(), block.len());
        let d = _mm256_set1_ps(f16_at(block, 208));
        // SAFETY (loads): the 16 scales of this block, the activation scales of its 8 x 32 values and sums of its 16 groups.
        let scales = _mm_loadu_si128(block.as_ptr().add(192).cast());
        let ws = [
            _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(scales))),
            _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(scales)))),
        ];
        bias_terms = _mm256_fmadd_ps(ws[0], _mm256_loadu_ps(sums.add(16 * b)), bias_terms);
        bias_terms = _mm256_fmadd_ps(ws[1], _mm256_loadu_ps(sums.add(16 * b + 8)), bias_terms);
        let act = _mm256_loadu_ps(act_scale.add(8 * b));
        // pairs[c]: chunk c's 16 i16 pair sums, group 2c in the low 128 bits, 2c + 1 in the high.
        let mut pairs = [_mm256_setzero_si256(); 8];
        for h in 0..2 {
            let qh = _mm256_loadu_si256(block.as_ptr().add(128 + 32 * h).cast());
            let ql = [_mm256_loadu_si256(block.as_ptr().add(64 * h).cast()), _mm256_loadu_si256(block.as_ptr().add(64 * h + 32).cast())];
            for k in 0..4 {
                let low = if k < 2 { _mm256_and_si256(ql[k], nibble) } else { _mm256_and_si256(_mm256_srli_epi16::<4>(ql[k - 2]), nibble) };
                let top = _mm256_and_si256(_mm256_sll_epi16(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k as i32)), _mm_cvtsi32_si128(4)), two_bits);
                let chunk = 4 * h + k;
                pairs[chunk] = _mm256_maddubs_epi16(_mm256_or_si256(low, top), _mm256_loadu_si256(qs.add(256 * b + 32 * chunk).cast()));
            }
        }
        // One i16 add of two pair sums stays below 2^15 (2 x 2 x 63 x 128); the rest in i32.
        for h in 0..2 {
            let widened = |c: usize| _mm256_madd_epi16(_mm256_hadd_epi16(pairs[c], pairs[c + 1]), ones);
            let group_sums = _mm256_hadd_epi32(widened(4 * h), widened(4 * h + 2));
            let coef = _mm256_mul_ps(_mm256_permutevar8x32_ps(ws[h], even_odd), _mm256_permutevar8x32_ps(act, act_of[h]));
            main = _mm256_fmadd_ps(_mm256_cvtepi32_ps(group_sums), coef, main);
        }
    }
    hsum(main) - 32.0 * hsum(bias_terms)
}

/// IQ4_XS: 136-byte blocks of 256 (f16 d, u16 high scale bits, 4 bytes of low scale nibbles,
/// 128 nibble bytes, group g's 16 at 8 + 16g as in IQ4_NL), 8 groups of 32, scale d * (ls - 32),
/// codebook values (signed, through the sign trick; no bias).
///
/// # Safety
/// As [`q2_k`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn iq4_xs(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let cols = acts.cols;
    let qs = acts.qs.as_ptr().add(t * cols);
    let act_scale = acts.scale.as_ptr().add(t * cols / 32);
    let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(IQ4_NL_CODEBOOK.as_ptr().cast()));
    let mask = _mm_set1_epi8(0x0f);
    let mut main = [_mm256_setzero_ps(); 2];
    for b in 0..cols / 256 {
        let block = &row[136 * b..136 * (b + 1)];
        prefetch_ahead(block.as_ptr(), block.len());
        let high = u16::from_le_bytes([block[2], block[3]]);
        let ls: [i32; 8] = std::array::from_fn(|g| i32::from((block[4 + g / 2] >> (4 * (g % 2))) & 0xf | (((high >> (2 * g)) & 3) as u8) << 4) - 32);
        let mut c = [0f32; 8];
        // SAFETY (loads): the 8 scales, the block's 128 nibble bytes; 8 activation scales and 256 codes of token t.
        let ws = _mm256_mul_ps(_mm256_set1_ps(f16_at(block, 0)), _mm256_cvtepi32_ps(_mm256_loadu_si256(ls.as_ptr().cast())));
        _mm256_storeu_ps(c.as_mut_ptr(), _mm256_mul_ps(ws, _mm256_loadu_ps(act_scale.add(8 * b))));
        for (g, &c) in c.iter().enumerate() {
            let w = _mm_loadu_si128(block.as_ptr().add(8 + 16 * g).cast());
            let u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(w), mask), _mm_and_si128(w, mask));
            let dot = dot_signed(_mm256_shuffle_epi8(table, u), _mm256_loadu_si256(qs.add(256 * b + 32 * g).cast()));
            main[g % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(c), main[g % 2]);
        }
    }
    hsum(_mm256_add_ps(main[0], main[1]))
}

/// One scale `d` for the `codes.len()` chunks of 32 values from `first_value` (bias 1): each
/// chunk's dot product times `d` and its activation scale, and `d` times its scaled sum.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn one_scale_chunks(acts: &QuantizedActs, t: usize, first_value: usize, d: f32, codes: &[__m256i], main: &mut [__m256; 2], bias_terms: &mut f32) {
    let at = t * acts.cols + first_value;
    let (qs, act_scale, sums) = (acts.qs.as_ptr().add(at), acts.scale.as_ptr().add(at / 32), acts.scaled_sum32.as_ptr().add(at / 32));
    for (j, &u) in codes.iter().enumerate() {
        // SAFETY: the caller's chunks lie inside token t's activations.
        let dot = dot_small(u, _mm256_loadu_si256(qs.add(32 * j).cast()));
        main[j % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * *act_scale.add(j)), main[j % 2]);
    }
    *bias_terms += d * (0..codes.len()).map(|j| *sums.add(j)).sum::<f32>();
}

/// TQ2_0: 66-byte blocks of 256 (64 bytes of 2-bit codes laid out as Q2_K's, f16 d):
/// value = d * (q - 1), bias 1. The block's 8 coefficients and its bias term are vector
/// operations, and each 32 values' codes come from one running shift.
///
/// # Safety
/// As [`q2_k`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn tq2_0(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let cols = acts.cols;
    let qs = acts.qs.as_ptr().add(t * cols);
    let (act_scale, sums) = (acts.scale.as_ptr().add(t * cols / 32), acts.scaled_sum32.as_ptr().add(t * cols / 32));
    let (mut main, mut bias_terms) = ([_mm256_setzero_ps(); 2], _mm256_setzero_ps());
    let three = _mm256_set1_epi8(3);
    for b in 0..cols / 256 {
        let block = &row[66 * b..66 * (b + 1)];
        prefetch_ahead(block.as_ptr(), block.len());
        let d = _mm256_set1_ps(f16_at(block, 64));
        let mut c = [0f32; 8];
        // SAFETY (loads): the block's 64 code bytes; 8 activation scales and sums and 256 codes of token t.
        _mm256_storeu_ps(c.as_mut_ptr(), _mm256_mul_ps(d, _mm256_loadu_ps(act_scale.add(8 * b))));
        bias_terms = _mm256_fmadd_ps(d, _mm256_loadu_ps(sums.add(8 * b)), bias_terms);
        for h in 0..2 {
            let mut q = _mm256_loadu_si256(block.as_ptr().add(32 * h).cast());
            for k in 0..4 {
                let dot = dot_small(_mm256_and_si256(q, three), _mm256_loadu_si256(qs.add(256 * b + 128 * h + 32 * k).cast()));
                main[k % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(c[4 * h + k]), main[k % 2]);
                q = _mm256_srli_epi16::<2>(q);
            }
        }
    }
    hsum(_mm256_add_ps(main[0], main[1])) - hsum(bias_terms)
}

/// Q1_0: 18-byte blocks of 128 (f16 d, 16 bytes of sign bits, LSB first): value = d * (2b - 1),
/// u = 2b, bias 1.
///
/// # Safety
/// As [`q2_k`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q1_0(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let (mut main, mut bias_terms) = ([_mm256_setzero_ps(); 2], 0f32);
    let two = _mm256_set1_epi8(2);
    for b in 0..acts.cols / 128 {
        let block = &row[18 * b..18 * (b + 1)];
        prefetch_ahead(block.as_ptr(), block.len());
        let codes: [__m256i; 4] =
            std::array::from_fn(|j| _mm256_and_si256(bit_bytes(u32::from_le_bytes(block[2 + 4 * j..6 + 4 * j].try_into().expect("4 bytes"))), two));
        one_scale_chunks(acts, t, 128 * b, f16_at(block, 0), &codes, &mut main, &mut bias_terms);
    }
    hsum(_mm256_add_ps(main[0], main[1])) - bias_terms
}
