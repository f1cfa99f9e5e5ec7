//! AVX-512 VNNI kernels: `vpdpbusd` multiplies the biased u8 weight codes by the i8
//! activation codes and sums each 4 products into an i32 lane, without saturation.

use std::arch::x86_64::*;

use super::acts::{QuantizedActs, TOKEN_TILE};
use super::{scalar, DecodedRow};

/// Lane `j` of a 64-value chunk covers values `4j..4j+4`; these pick each lane's group
/// coefficient from the chunk's first group on.
const LANE_GROUP_32: [i32; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1];
const LANE_GROUP_16: [i32; 16] = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3];

/// `row · x[t]`; `coef` is scratch of at least `cols / group + 16` values.
///
/// # Safety
/// The CPU must have AVX-512F/BW and AVX-512 VNNI; `row` and `acts` have `acts.cols` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub unsafe fn matvec_row(row: &DecodedRow, acts: &QuantizedActs, t: usize, coef: &mut [f32]) -> f32 {
    if row.group == 32 {
        matvec_row_in::<32>(row, acts, t, coef)
    } else {
        matvec_row_in::<16>(row, acts, t, coef)
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn matvec_row_in<const G: usize>(row: &DecodedRow, acts: &QuantizedActs, t: usize, coef: &mut [f32]) -> f32 {
    let cols = acts.cols;
    let groups = cols / G;
    let act_scale = acts.scale.as_ptr().add(t * cols / 32);
    // coef[g] = weight scale * activation scale, 16 groups at a time (the activation scale
    // covers 32 values: two groups of 16 share one).
    let spread = _mm512_loadu_si512([0i32, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7].as_ptr().cast());
    let mut g = 0;
    while g + 16 <= groups {
        // SAFETY: g + 16 <= groups; the activation scales hold groups * G / 32 values.
        let a = if G == 32 {
            _mm512_loadu_ps(act_scale.add(g))
        } else {
            _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(_mm256_loadu_ps(act_scale.add(g / 2))))
        };
        _mm512_storeu_ps(coef.as_mut_ptr().add(g), _mm512_mul_ps(_mm512_loadu_ps(row.scale.as_ptr().add(g)), a));
        g += 16;
    }
    for (g, c) in coef.iter_mut().enumerate().take(groups).skip(g) {
        *c = row.scale[g] * *act_scale.add(g * G / 32);
    }
    coef[groups..groups + 16].fill(0.0);
    let lane_group = _mm512_loadu_si512(if G == 32 { LANE_GROUP_32.as_ptr() } else { LANE_GROUP_16.as_ptr() }.cast());
    let (codes, qs, bias) = (row.codes.as_ptr(), acts.qs.as_ptr().add(t * cols), acts.neg_bias4.as_ptr().add(t * cols / 4));
    let chunk = |k: usize, acc: __m512| {
        // SAFETY: k + 64 <= cols, so every load is inside the row, its codes and its coefficients (+16 padding).
        let w = _mm512_loadu_si512(codes.add(k).cast());
        let a = _mm512_loadu_si512(qs.add(k).cast());
        let dot = _mm512_dpbusd_epi32(_mm512_loadu_si512(bias.add(k / 4).cast()), w, a);
        let c = _mm512_permutexvar_ps(lane_group, _mm512_loadu_ps(coef.as_ptr().add(k / G)));
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), c, acc)
    };
    let (mut acc0, mut acc1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut k = 0;
    while k + 128 <= cols {
        acc0 = chunk(k, acc0);
        acc1 = chunk(k + 64, acc1);
        k += 128;
    }
    if k + 64 <= cols {
        acc0 = chunk(k, acc0);
        k += 64;
    }
    let mut tail = 0f32;
    if row.has_offset {
        let sums = if G == 16 { acts.scaled_sum16.as_ptr().add(t * cols / 16) } else { acts.scaled_sum32.as_ptr().add(t * cols / 32) };
        let mut g = 0;
        while g + 16 <= groups {
            // SAFETY: g + 16 <= groups, the length of both.
            acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(row.offset.as_ptr().add(g)), _mm512_loadu_ps(sums.add(g)), acc1);
            g += 16;
        }
        for g in g..groups {
            tail += row.offset[g] * *sums.add(g);
        }
    }
    let mut total = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + tail;
    if k < cols {
        total += scalar::group_terms(row, acts, t, k / G..groups, false);
    }
    total
}

/// As [`scalar::matmat_tile`], for `R` rows at a time in registers.
///
/// # Safety
/// As [`matvec_row`]; `acts` holds the tiled layout and `rows.len() == R == out.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn matmat_rows<const R: usize>(rows: &[DecodedRow], acts: &QuantizedActs, tile: usize, out: &mut [[f32; TOKEN_TILE]]) {
    let cols = acts.cols;
    let (group, has_offset) = (rows[0].group, rows[0].has_offset);
    let qs = acts.tiled_qs.as_ptr().add(tile * cols * TOKEN_TILE);
    let bias16 = acts.tiled_neg_bias16.as_ptr().add(tile * cols / 16 * TOKEN_TILE);
    let sums16 = acts.tiled_scaled_sum16.as_ptr().add(tile * cols / 16 * TOKEN_TILE);
    let scale = acts.tiled_scale.as_ptr().add(tile * cols / 32 * TOKEN_TILE);
    let codes: [*const u8; R] = std::array::from_fn(|r| rows[r].codes.as_ptr());
    let per16 = group / 16;
    let mut acc = [_mm512_setzero_ps(); R];
    for g in 0..cols / group {
        // SAFETY (loads below): g < cols / group, so every group, token lane and code read is in its buffer.
        let lanes16 = |p: *const i32, h: usize| _mm512_loadu_si512(p.add((g * per16 + h) * TOKEN_TILE).cast());
        let init = if per16 == 1 { lanes16(bias16, 0) } else { _mm512_add_epi32(lanes16(bias16, 0), lanes16(bias16, 1)) };
        let mut dot = [init; R];
        for k4 in g * group / 4..(g + 1) * group / 4 {
            let a = _mm512_loadu_si512(qs.add(k4 * 4 * TOKEN_TILE).cast());
            for r in 0..R {
                let w = _mm512_set1_epi32(codes[r].add(4 * k4).cast::<i32>().read_unaligned());
                dot[r] = _mm512_dpbusd_epi32(dot[r], w, a);
            }
        }
        let act_scale = _mm512_loadu_ps(scale.add(g * group / 32 * TOKEN_TILE));
        let sums = if !has_offset {
            _mm512_setzero_ps()
        } else if per16 == 1 {
            _mm512_loadu_ps(sums16.add(g * TOKEN_TILE))
        } else {
            _mm512_add_ps(_mm512_loadu_ps(sums16.add(2 * g * TOKEN_TILE)), _mm512_loadu_ps(sums16.add((2 * g + 1) * TOKEN_TILE)))
        };
        for r in 0..R {
            let c = _mm512_mul_ps(_mm512_set1_ps(*rows[r].scale.get_unchecked(g)), act_scale);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), c, acc[r]);
            if has_offset {
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(*rows[r].offset.get_unchecked(g)), sums, acc[r]);
            }
        }
    }
    for r in 0..R {
        _mm512_storeu_ps(out[r].as_mut_ptr(), acc[r]);
    }
}

/// # Safety
/// As [`matmat_rows`], with 1 to 8 rows.
pub unsafe fn matmat_tile(rows: &[DecodedRow], acts: &QuantizedActs, tile: usize, out: &mut [[f32; TOKEN_TILE]]) {
    match rows.len() {
        8 => matmat_rows::<8>(rows, acts, tile, out),
        7 => matmat_rows::<7>(rows, acts, tile, out),
        6 => matmat_rows::<6>(rows, acts, tile, out),
        5 => matmat_rows::<5>(rows, acts, tile, out),
        4 => matmat_rows::<4>(rows, acts, tile, out),
        3 => matmat_rows::<3>(rows, acts, tile, out),
        2 => matmat_rows::<2>(rows, acts, tile, out),
        1 => matmat_rows::<1>(rows, acts, tile, out),
        n => unreachable!("{n} rows in one mat-mat tile"),
    }
}
