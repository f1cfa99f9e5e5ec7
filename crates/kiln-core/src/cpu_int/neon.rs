//! aarch64 kernels. The biased u8 weight codes become signed by flipping their top bit
//! (`code ^ 0x80 == code - CODE_BIAS` as i8), so products need no bias term:
//! - `Neon` (every aarch64 CPU): `smull`/`sadalp` widen the i8 x i8 products to i32;
//! - `NeonDot` (FEAT_DotProd): `sdot` sums each 4 i8 x i8 products into an i32 lane.

use std::arch::aarch64::*;
use std::arch::asm;

use super::acts::{QuantizedActs, TOKEN_TILE};
use super::DecodedRow;

/// `acc[i] += a[4i..4i+4] · b[4i..4i+4]` in i32 (FEAT_DotProd `sdot`).
///
/// Through `asm!` because Rust's `vdotq_s32` is still unstable; the instruction is one
/// register-to-register op with no memory or flag effects.
#[inline]
#[target_feature(enable = "dotprod")]
fn sdot(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    // SAFETY: the caller's CPU has FEAT_DotProd (this function's target feature).
    unsafe {
        asm!("sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b", acc = inout(vreg) acc, a = in(vreg) a, b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags))
    };
    acc
}

/// The i32 dot product of 16 signed weight codes with 16 activation codes, by plain NEON
/// widening multiplies, as 4 lanes of partial sums.
#[inline]
fn widening_dot(acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe {
        let lo = vmull_s8(vget_low_s8(w), vget_low_s8(a));
        let hi = vmull_high_s8(w, a);
        vpadalq_s16(vpadalq_s16(acc, lo), hi)
    }
}

/// 16 weight codes at `codes`, as signed values.
///
/// # Safety
/// `codes` points at 16 readable bytes.
#[inline]
unsafe fn signed_codes(codes: *const u8) -> int8x16_t {
    vreinterpretq_s8_u8(veorq_u8(vld1q_u8(codes), vdupq_n_u8(0x80)))
}

/// `row · x[t]`, one group (16 or 32 values) per integer sum.
///
/// # Safety
/// `row` and `acts` have `acts.cols` values; with `DOT`, the CPU has FEAT_DotProd.
#[inline(always)]
unsafe fn matvec_row_with<const DOT: bool>(row: &DecodedRow, acts: &QuantizedActs, t: usize) -> f32 {
    let (cols, group) = (acts.cols, row.group);
    let act_scale = &acts.scale[t * cols / 32..][..cols / 32];
    let (codes, qs) = (row.codes.as_ptr(), acts.qs.as_ptr().add(t * cols));
    let mut acc = [vdupq_n_f32(0.0); 2];
    for g in 0..cols / group {
        let mut dot = vdupq_n_s32(0);
        for k in (g * group..(g + 1) * group).step_by(16) {
            // SAFETY: k + 16 <= cols, inside the row's codes and the token's activations.
            let (w, a) = (signed_codes(codes.add(k)), vld1q_s8(qs.add(k)));
            // SAFETY: FEAT_DotProd where DOT, as the caller promised.
            dot = if DOT { sdot(dot, w, a) } else { widening_dot(dot, w, a) };
        }
        let coef = row.scale[g] * act_scale[g * group / 32];
        acc[g & 1] = vfmaq_n_f32(acc[g & 1], vcvtq_f32_s32(dot), coef);
    }
    let mut total = vaddvq_f32(vaddq_f32(acc[0], acc[1]));
    if row.has_offset {
        let groups = cols / group;
        let sums = if group == 16 { &acts.scaled_sum16[t * cols / 16..][..groups] } else { &acts.scaled_sum32[t * cols / 32..][..groups] };
        total += row.offset[..groups].iter().zip(sums).map(|(o, s)| o * s).sum::<f32>();
    }
    total
}

/// `row · x[t]` with widening multiplies.
pub fn matvec_row(row: &DecodedRow, acts: &QuantizedActs, t: usize) -> f32 {
    // SAFETY: the callers pass rows and activations of `acts.cols` values; no extension needed.
    unsafe { matvec_row_with::<false>(row, acts, t) }
}

/// `row · x[t]` with `sdot`.
///
/// # Safety
/// The CPU must have FEAT_DotProd; `row` and `acts` have `acts.cols` values.
#[target_feature(enable = "dotprod")]
pub unsafe fn matvec_row_dot(row: &DecodedRow, acts: &QuantizedActs, t: usize) -> f32 {
    matvec_row_with::<true>(row, acts, t)
}

/// Two rows x the 16 tokens of token tile `tile` (the tiled layout: 4 codes of 16 tokens per
/// 64 bytes): each weight word of 4 codes is broadcast and `sdot`-ed against 4 tokens at a time.
///
/// # Safety
/// FEAT_DotProd; `acts` holds the tiled layout; `rows` and `out` have 1 or 2 entries.
#[target_feature(enable = "dotprod")]
unsafe fn matmat_pair(rows: &[DecodedRow], acts: &QuantizedActs, tile: usize, out: &mut [[f32; TOKEN_TILE]]) {
    let cols = acts.cols;
    let (group, has_offset) = (rows[0].group, rows[0].has_offset);
    let qs = acts.tiled_qs.as_ptr().add(tile * cols * TOKEN_TILE);
    let sums16 = &acts.tiled_scaled_sum16[tile * cols / 16 * TOKEN_TILE..];
    let scale = &acts.tiled_scale[tile * cols / 32 * TOKEN_TILE..];
    // A single row runs as a pair of the same row; only the first result is kept.
    let second = rows.len() - 1;
    let codes = [rows[0].codes.as_ptr(), rows[second].codes.as_ptr()];
    let per16 = group / 16;
    let mut acc = [[vdupq_n_f32(0.0); 4]; 2];
    for g in 0..cols / group {
        let mut dot = [[vdupq_n_s32(0); 4]; 2];
        for k4 in g * group / 4..(g + 1) * group / 4 {
            // SAFETY: k4 < cols / 4: 64 bytes of tile codes and 4 bytes of each row are in bounds.
            let a = qs.add(k4 * 4 * TOKEN_TILE);
            let a = [vld1q_s8(a), vld1q_s8(a.add(16)), vld1q_s8(a.add(32)), vld1q_s8(a.add(48))];
            for r in 0..2 {
                let word = codes[r].add(4 * k4).cast::<u32>().read_unaligned() ^ 0x8080_8080;
                let w = vreinterpretq_s8_u32(vdupq_n_u32(word));
                for q in 0..4 {
                    dot[r][q] = sdot(dot[r][q], w, a[q]);
                }
            }
        }
        let act_scale = &scale[g * group / 32 * TOKEN_TILE..][..TOKEN_TILE];
        let mut sums = [0f32; TOKEN_TILE];
        if has_offset {
            for h in 0..per16 {
                for (s, v) in sums.iter_mut().zip(&sums16[(g * per16 + h) * TOKEN_TILE..][..TOKEN_TILE]) {
                    *s += v;
                }
            }
        }
        for r in 0..2 {
            let row = &rows[r.min(second)];
            let w_scale = vdupq_n_f32(row.scale[g]);
            for q in 0..4 {
                let c = vmulq_f32(w_scale, vld1q_f32(act_scale.as_ptr().add(4 * q)));
                acc[r][q] = vfmaq_f32(acc[r][q], vcvtq_f32_s32(dot[r][q]), c);
                if has_offset {
                    acc[r][q] = vfmaq_n_f32(acc[r][q], vld1q_f32(sums.as_ptr().add(4 * q)), row.offset[g]);
                }
            }
        }
    }
    for (r, out) in out.iter_mut().enumerate().take(rows.len()) {
        for q in 0..4 {
            vst1q_f32(out.as_mut_ptr().add(4 * q), acc[r][q]);
        }
    }
}

/// As [`super::scalar::matmat_tile`], two rows at a time.
///
/// # Safety
/// FEAT_DotProd; `acts` holds the tiled layout; `out` has one entry per row.
#[target_feature(enable = "dotprod")]
pub unsafe fn matmat_tile(rows: &[DecodedRow], acts: &QuantizedActs, tile: usize, out: &mut [[f32; TOKEN_TILE]]) {
    for (rows, out) in rows.chunks(2).zip(out.chunks_mut(2)) {
        matmat_pair(rows, acts, tile, out);
    }
}

/// Asks for the 64-byte line at `p` to be brought into L1 (`prfm` has no stable intrinsic).
#[inline]
pub(crate) fn prefetch_line(p: *const u8) {
    // SAFETY: a prefetch hint never faults and changes nothing visible.
    unsafe { asm!("prfm pldl1keep, [{p}]", p = in(reg) p, options(nostack, preserves_flags, readonly)) };
}
