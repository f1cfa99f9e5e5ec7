//! Fused AVX2 kernels of the 32-value block formats: Q4_0, Q4_1, Q5_0, Q5_1, MXFP4
//! (through [`blocks32`]), IQ4_NL and Q8_0; and NVFP4's 64-value blocks.

use std::arch::x86_64::*;

use kiln_quant::{e8m0_half, ue4m3_half, E2M1_X2, IQ4_NL_CODEBOOK};

use super::{bit_bytes, dot_signed, dot_small, f16_at, hsum, hsum128, prefetch_ahead};
use crate::cpu_int::acts::QuantizedActs;

/// How a block's nibbles become codes.
const PLAIN: u8 = 0;
/// MXFP4's E2M1 values times 2, plus 12 (unsigned, below 64), through `vpshufb`.
const MXFP4: u8 = 1;

/// The 32-value block formats: `BYTES` per block, the scale first (f16 d, or MXFP4's e8m0
/// exponent byte), then an f16 min when `HAS_MIN`, the u32 fifth bits at `QH_AT` (0: none),
/// the 16 nibble bytes at `QS_AT` (value j low, j + 16 high); value = d * (code - bias) + m,
/// the code being the nibble (or 5-bit value), or its MXFP4 value as `CODES` says. Four
/// blocks a step: their scales are converted and multiplied together, and two accumulators
/// take turns.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn blocks32<const BYTES: usize, const QS_AT: usize, const QH_AT: usize, const HAS_MIN: bool, const CODES: u8>(
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
    let table = match CODES {
        MXFP4 => {
            let shifted: [i8; 16] = std::array::from_fn(|i| E2M1_X2[i] + 12);
            _mm256_broadcastsi128_si256(_mm_loadu_si128(shifted.as_ptr().cast()))
        }
        _ => _mm256_setzero_si256(),
    };
    // Block b's 16 `vpmaddubsw` pair sums (codes below 64).
    let block_pairs = |b: usize| {
        let block = &row[b * BYTES..(b + 1) * BYTES];
        // SAFETY: the block holds its 16 nibble bytes at QS_AT; values 32b..32b+32 are in the activations.
        let w = _mm_loadu_si128(block.as_ptr().add(QS_AT).cast());
        let mut u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(w), mask), _mm_and_si128(w, mask));
        if QH_AT != 0 {
            let qh = u32::from_le_bytes([block[QH_AT], block[QH_AT + 1], block[QH_AT + 2], block[QH_AT + 3]]);
            u = _mm256_or_si256(u, _mm256_and_si256(bit_bytes(qh), _mm256_set1_epi8(0x10)));
        }
        let a = _mm256_loadu_si256(qs.add(32 * b).cast());
        match CODES {
            MXFP4 => _mm256_maddubs_epi16(_mm256_shuffle_epi8(table, u), a),
            _ => _mm256_maddubs_epi16(u, a),
        }
    };
    let scale_of = |b: usize| if CODES == MXFP4 { e8m0_half(row[b * BYTES]) } else { f16_at(row, b * BYTES) };
    // The scales of blocks b..b+4 (or the f16 at byte `at` of each), as f32.
    let scales4 = |b: usize, at: usize| {
        if CODES == MXFP4 {
            _mm_setr_ps(scale_of(b), scale_of(b + 1), scale_of(b + 2), scale_of(b + 3))
        } else {
            // SAFETY: b + 4 <= blocks, and `at` + 2 <= BYTES.
            f16x4(row.as_ptr().add(b * BYTES + at), BYTES)
        }
    };
    let (mut main, mut rest) = (_mm256_setzero_ps(), _mm_setzero_ps());
    let mut b = 0;
    while b + 4 <= blocks {
        prefetch_ahead(row.as_ptr().add(b * BYTES), 4 * BYTES);
        let d = scales4(b, 0);
        // SAFETY: blocks b..b+4 have activation scales and sums.
        let c = _mm_mul_ps(d, _mm_loadu_ps(act_scale.as_ptr().add(b)));
        if bias != 0.0 || HAS_MIN {
            let offset = if HAS_MIN { scales4(b, 2) } else { _mm_setzero_ps() };
            rest = _mm_fmadd_ps(_mm_fnmadd_ps(_mm_set1_ps(bias), d, offset), _mm_loadu_ps(sums.as_ptr().add(b)), rest);
        }
        let dots = fold_small_blocks4(block_pairs(b), block_pairs(b + 1), block_pairs(b + 2), block_pairs(b + 3));
        main = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_set_m128(c, c), main);
        b += 4;
    }
    let mut tail = 0f32;
    for b in b..blocks {
        let d = scale_of(b);
        let dot = _mm256_madd_epi16(block_pairs(b), _mm256_set1_epi16(1));
        main = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * act_scale[b]), main);
        let offset = if HAS_MIN { f16_at(row, b * BYTES + 2) } else { 0.0 };
        tail += (offset - bias * d) * sums[b];
    }
    let rest = _mm_add_ps(rest, _mm_movehl_ps(rest, rest));
    hsum(main) + _mm_cvtss_f32(_mm_add_ss(rest, _mm_shuffle_ps::<1>(rest, rest))) + tail
}

/// Four blocks' dot products from their `vpmaddubsw` pair sums, as i32 lanes (b0, b1, b2, b3)
/// in each 128-bit half (that half's 16 values of each block): one multiply-add then scales all
/// four. For codes below 64 (pair sums below 2^14), so one i16 add of two cannot wrap.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fold_small_blocks4(p0: __m256i, p1: __m256i, p2: __m256i, p3: __m256i) -> __m256i {
    let ones = _mm256_set1_epi16(1);
    let first = _mm256_madd_epi16(_mm256_hadd_epi16(p0, p1), ones);
    let second = _mm256_madd_epi16(_mm256_hadd_epi16(p2, p3), ones);
    _mm256_hadd_epi32(first, second)
}

/// As [`fold_small_blocks4`] for pair sums of any size (the sign trick's signed codes): each
/// block widened first, then added in i32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fold_blocks4(p0: __m256i, p1: __m256i, p2: __m256i, p3: __m256i) -> __m256i {
    let ones = _mm256_set1_epi16(1);
    let (w0, w1) = (_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones));
    let (w2, w3) = (_mm256_madd_epi16(p2, ones), _mm256_madd_epi16(p3, ones));
    _mm256_hadd_epi32(_mm256_hadd_epi32(w0, w1), _mm256_hadd_epi32(w2, w3))
}

/// The f16 values at `p + i * stride`, i < 4, as f32. A function, not a closure: called twice
/// per step (Q4_1, Q5_1), a closure was not inlined and cost half the kernel's speed.
///
/// # Safety
/// The four f16 must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x4(p: *const u8, stride: usize) -> __m128 {
    let half = |i: usize| u64::from(p.add(i * stride).cast::<u16>().read_unaligned());
    _mm_cvtph_ps(_mm_cvtsi64_si128((half(0) | half(1) << 16 | half(2) << 32 | half(3) << 48) as i64))
}

/// Q4_0: 18-byte blocks (f16 d, 16 nibble bytes); u = q, bias 8.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `row` holds `acts.cols` values of the format.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q4_0(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    blocks32::<18, 2, 0, false, PLAIN>(row, acts, t, 8.0)
}

/// Q4_1: 20-byte blocks (f16 d, f16 m, 16 nibble bytes); value = d * q + m.
///
/// # Safety
/// As [`q4_0`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q4_1(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    blocks32::<20, 4, 0, true, PLAIN>(row, acts, t, 0.0)
}

/// Q5_0: 22-byte blocks (f16 d, u32 fifth bits, 16 nibble bytes); u = 5-bit code, bias 16.
///
/// # Safety
/// As [`q4_0`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q5_0(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    blocks32::<22, 6, 2, false, PLAIN>(row, acts, t, 16.0)
}

/// Q5_1: 24-byte blocks (f16 d, f16 m, u32 fifth bits, 16 nibble bytes); value = d * u + m.
///
/// # Safety
/// As [`q4_0`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q5_1(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    blocks32::<24, 8, 4, true, PLAIN>(row, acts, t, 0.0)
}

/// IQ4_NL: Q4_0's layout with codebook values (signed, through the sign trick; no bias). Two
/// blocks share each unpacking step (one vector holds both blocks' nibble bytes; their codebook
/// values are put in value order by two 128-bit permutes), four blocks share their scales' step.
///
/// # Safety
/// As [`q4_0`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn iq4_nl(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let cols = acts.cols;
    let blocks = cols / 32;
    let qs = acts.qs.as_ptr().add(t * cols);
    let act_scale = &acts.scale[t * blocks..][..blocks];
    let row = &row[..blocks * 18];
    let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(IQ4_NL_CODEBOOK.as_ptr().cast()));
    let mask = _mm256_set1_epi8(0x0f);
    // Block b's pair sums of its signed codebook values `s` by the sign trick.
    let pairs = |s: __m256i, b: usize| {
        let a = _mm256_loadu_si256(qs.add(32 * b).cast());
        _mm256_maddubs_epi16(_mm256_abs_epi8(s), _mm256_sign_epi8(a, s))
    };
    let mut main = _mm256_setzero_ps();
    let mut b = 0;
    while b + 4 <= blocks {
        prefetch_ahead(row.as_ptr().add(18 * b), 4 * 18);
        // SAFETY: blocks b..b+4 lie inside the row and have activation scales; values 32b..32b+128 are in the activations.
        let c = _mm_mul_ps(f16x4(row.as_ptr().add(18 * b), 18), _mm_loadu_ps(act_scale.as_ptr().add(b)));
        let mut p = [_mm256_setzero_si256(); 4];
        for pair in 0..2 {
            let at = row.as_ptr().add(18 * (b + 2 * pair) + 2);
            let w = _mm256_loadu2_m128i(at.add(18).cast(), at.cast());
            let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(w, mask));
            let hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16::<4>(w), mask));
            let first = b + 2 * pair;
            p[2 * pair] = pairs(_mm256_permute2x128_si256::<0x20>(lo, hi), first);
            p[2 * pair + 1] = pairs(_mm256_permute2x128_si256::<0x31>(lo, hi), first + 1);
        }
        main = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold_blocks4(p[0], p[1], p[2], p[3])), _mm256_set_m128(c, c), main);
        b += 4;
    }
    for (b, &a) in act_scale.iter().enumerate().skip(b) {
        // SAFETY: block b lies inside the row.
        let w = _mm_loadu_si128(row.as_ptr().add(18 * b + 2).cast());
        let u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(w), _mm256_castsi256_si128(mask)), _mm_and_si128(w, _mm256_castsi256_si128(mask)));
        let dot = dot_signed(_mm256_shuffle_epi8(table, u), _mm256_loadu_si256(qs.add(32 * b).cast()));
        main = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(f16_at(row, 18 * b) * a), main);
    }
    hsum(main)
}

/// MXFP4: 17-byte blocks (e8m0 exponent, 16 nibble bytes of E2M1 codes); u = 2 * value + 12,
/// bias 12, scale `e8m0_half`.
///
/// # Safety
/// As [`q4_0`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn mxfp4(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    blocks32::<17, 1, 0, false, MXFP4>(row, acts, t, 12.0)
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
        prefetch_ahead(row.as_ptr().add(34 * b), 4 * 34);
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

/// `ue4m3_half` of every byte, built once.
fn ue4m3_table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|b| ue4m3_half(b as u8)))
}

/// NVFP4: 36-byte blocks of 64 (4 unsigned E4M3 scales, one per 16 values; 32 nibble bytes,
/// group g's codes in bytes 8g..8g+8, value i low and i + 8 high); u = 2 * E2M1 value + 12,
/// bias 12. A block's nibbles are unpacked at once and put in value order by unpacking 64-bit
/// halves; lanes 0-3 of a 32-value dot belong to its first group, 4-7 to its second.
///
/// # Safety
/// As [`q4_0`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn nvfp4(row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
    let cols = acts.cols;
    let qs = acts.qs.as_ptr().add(t * cols);
    let (act_scale, sums) = (acts.scale.as_ptr().add(t * cols / 32), acts.scaled_sum16.as_ptr().add(t * cols / 16));
    let scales = ue4m3_table();
    let shifted: [i8; 16] = std::array::from_fn(|i| E2M1_X2[i] + 12);
    let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(shifted.as_ptr().cast()));
    let low = _mm256_set1_epi8(0x0f);
    let groups = [_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)];
    let (mut main, mut bias_terms) = ([_mm256_setzero_ps(); 2], _mm_setzero_ps());
    for b in 0..cols / 64 {
        let block = &row[36 * b..36 * (b + 1)];
        prefetch_ahead(block.as_ptr(), block.len());
        let ws = _mm_setr_ps(scales[usize::from(block[0])], scales[usize::from(block[1])], scales[usize::from(block[2])], scales[usize::from(block[3])]);
        // SAFETY (loads): the block's 32 nibble bytes; activation scales 2b, 2b + 1, sums 4b..4b+4, codes 64b..64b+64 of token t.
        bias_terms = _mm_fmadd_ps(ws, _mm_loadu_ps(sums.add(4 * b)), bias_terms);
        let a2 = _mm_castsi128_ps(_mm_loadl_epi64(act_scale.add(2 * b).cast()));
        let c = _mm256_castps128_ps256(_mm_mul_ps(ws, _mm_unpacklo_ps(a2, a2)));
        let x = _mm256_loadu_si256(block.as_ptr().add(4).cast());
        let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(x, low));
        let hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16::<4>(x), low));
        let (g02, g13) = (_mm256_unpacklo_epi64(lo, hi), _mm256_unpackhi_epi64(lo, hi));
        let chunks = [_mm256_permute2x128_si256::<0x20>(g02, g13), _mm256_permute2x128_si256::<0x31>(g02, g13)];
        for (j, &u) in chunks.iter().enumerate() {
            let dot = dot_small(u, _mm256_loadu_si256(qs.add(64 * b + 32 * j).cast()));
            main[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_permutevar8x32_ps(c, groups[j]), main[j]);
        }
    }
    hsum(_mm256_add_ps(main[0], main[1])) - 12.0 * hsum128(bias_terms)
}
