//! AVX-VNNI kernels (the 256-bit `vpdpbusd` of CPUs with VNNI but without AVX-512, such as
//! Alder Lake and later client cores): the AVX-512 kernels' arithmetic on 8 lanes, so that
//! the biased u8 codes multiply the i8 activations 4 at a time into i32 without saturating.

use std::arch::x86_64::*;

use super::acts::{QuantizedActs, TOKEN_TILE};
use super::DecodedRow;

/// `row · x[t]`; `coef` is scratch of at least `cols / group + 16` values.
///
/// # Safety
/// The CPU must have AVX2, FMA and AVX-VNNI; `row` and `acts` have `acts.cols` values, a
/// multiple of 32.
#[target_feature(enable = "avx2,fma,avxvnni")]
pub unsafe fn matvec_row(row: &DecodedRow, acts: &QuantizedActs, t: usize, coef: &mut [f32]) -> f32 {
    if row.group == 32 {
        matvec_row_in::<32>(row, acts, t, coef)
    } else {
        matvec_row_in::<16>(row, acts, t, coef)
    }
}

#[target_feature(enable = "avx2,fma,avxvnni")]
unsafe fn matvec_row_in<const G: usize>(row: &DecodedRow, acts: &QuantizedActs, t: usize, coef: &mut [f32]) -> f32 {
    let cols = acts.cols;
    let groups = cols / G;
    let act_scale = &acts.scale[t * cols / 32..][..cols / 32];
    // coef[g] = weight scale * activation scale (one activation scale per 32 values).
    for (g, c) in coef[..groups].iter_mut().enumerate() {
        *c = row.scale[g] * act_scale[g * G / 32];
    }
    coef[groups..groups + 8].fill(0.0);
    // Lane j of a 32-value chunk covers values 4j..4j+4: its group, from the chunk's first.
    let lane_group = if G == 32 { _mm256_setzero_si256() } else { _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1) };
    let (codes, qs, bias) = (row.codes.as_ptr(), acts.qs.as_ptr().add(t * cols), acts.neg_bias4.as_ptr().add(t * cols / 4));
    let chunk = |k: usize, acc: __m256| {
        // SAFETY: k + 32 <= cols, so every load is inside the row, its codes and its coefficients (+8 padding).
        let w = _mm256_loadu_si256(codes.add(k).cast());
        let a = _mm256_loadu_si256(qs.add(k).cast());
        let dot = _mm256_dpbusd_avx_epi32(_mm256_loadu_si256(bias.add(k / 4).cast()), w, a);
        let c = _mm256_permutevar8x32_ps(_mm256_loadu_ps(coef.as_ptr().add(k / G)), lane_group);
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), c, acc)
    };
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut k = 0;
    while k + 64 <= cols {
        acc0 = chunk(k, acc0);
        acc1 = chunk(k + 32, acc1);
        k += 64;
    }
    if k < cols {
        acc0 = chunk(k, acc0);
    }
    let sum = _mm256_add_ps(acc0, acc1);
    let half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps::<1>(sum));
    let quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    let mut total = _mm_cvtss_f32(_mm_add_ss(quarter, _mm_shuffle_ps::<1>(quarter, quarter)));
    if row.has_offset {
        let sums = if G == 16 { &acts.scaled_sum16[t * cols / 16..][..groups] } else { &acts.scaled_sum32[t * cols / 32..][..groups] };
        total += row.offset[..groups].iter().zip(sums).map(|(o, s)| o * s).sum::<f32>();
    }
    total
}

/// As the AVX-512 tile kernel, for `R` rows at a time, each token tile as two 8-lane halves.
///
/// # Safety
/// As [`matvec_row`]; `acts` holds the tiled layout and `rows.len() == R == out.len()`.
#[target_feature(enable = "avx2,fma,avxvnni")]
unsafe fn matmat_rows<const R: usize>(rows: &[DecodedRow], acts: &QuantizedActs, tile: usize, out: &mut [[f32; TOKEN_TILE]]) {
    let cols = acts.cols;
    let (group, has_offset) = (rows[0].group, rows[0].has_offset);
    let qs = acts.tiled_qs.as_ptr().add(tile * cols * TOKEN_TILE);
    let bias16 = acts.tiled_neg_bias16.as_ptr().add(tile * cols / 16 * TOKEN_TILE);
    let sums16 = acts.tiled_scaled_sum16.as_ptr().add(tile * cols / 16 * TOKEN_TILE);
    let scale = acts.tiled_scale.as_ptr().add(tile * cols / 32 * TOKEN_TILE);
    let codes: [*const u8; R] = std::array::from_fn(|r| rows[r].codes.as_ptr());
    let per16 = group / 16;
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for g in 0..cols / group {
        // SAFETY (loads below): g < cols / group, so every group, token lane and code read is in its buffer.
        let lanes = |p: *const i32, h: usize, half: usize| _mm256_loadu_si256(p.add((g * per16 + h) * TOKEN_TILE + 8 * half).cast());
        let init = |half: usize| if per16 == 1 { lanes(bias16, 0, half) } else { _mm256_add_epi32(lanes(bias16, 0, half), lanes(bias16, 1, half)) };
        let mut dot = [[init(0), init(1)]; R];
        for k4 in g * group / 4..(g + 1) * group / 4 {
            let a0 = _mm256_loadu_si256(qs.add(k4 * 4 * TOKEN_TILE).cast());
            let a1 = _mm256_loadu_si256(qs.add(k4 * 4 * TOKEN_TILE + 32).cast());
            for r in 0..R {
                let w = _mm256_set1_epi32(codes[r].add(4 * k4).cast::<i32>().read_unaligned());
                dot[r][0] = _mm256_dpbusd_avx_epi32(dot[r][0], w, a0);
                dot[r][1] = _mm256_dpbusd_avx_epi32(dot[r][1], w, a1);
            }
        }
        for half in 0..2 {
            let act_scale = _mm256_loadu_ps(scale.add(g * group / 32 * TOKEN_TILE + 8 * half));
            let sums = if !has_offset {
                _mm256_setzero_ps()
            } else if per16 == 1 {
                _mm256_loadu_ps(sums16.add(g * TOKEN_TILE + 8 * half))
            } else {
                _mm256_add_ps(_mm256_loadu_ps(sums16.add(2 * g * TOKEN_TILE + 8 * half)), _mm256_loadu_ps(sums16.add((2 * g + 1) * TOKEN_TILE + 8 * half)))
            };
            for r in 0..R {
                let c = _mm256_mul_ps(_mm256_set1_ps(*rows[r].scale.get_unchecked(g)), act_scale);
                acc[r][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][half]), c, acc[r][half]);
                if has_offset {
                    acc[r][half] = _mm256_fmadd_ps(_mm256_set1_ps(*rows[r].offset.get_unchecked(g)), sums, acc[r][half]);
                }
            }
        }
    }
    for r in 0..R {
        _mm256_storeu_ps(out[r].as_mut_ptr(), acc[r][0]);
        _mm256_storeu_ps(out[r].as_mut_ptr().add(8), acc[r][1]);
    }
}

/// Up to 8 rows, four at a time (16 registers hold four rows' two token halves).
///
/// # Safety
/// As [`matmat_rows`].
pub unsafe fn matmat_tile(rows: &[DecodedRow], acts: &QuantizedActs, tile: usize, out: &mut [[f32; TOKEN_TILE]]) {
    for (rows, out) in rows.chunks(4).zip(out.chunks_mut(4)) {
        match rows.len() {
            4 => matmat_rows::<4>(rows, acts, tile, out),
            3 => matmat_rows::<3>(rows, acts, tile, out),
            2 => matmat_rows::<2>(rows, acts, tile, out),
            1 => matmat_rows::<1>(rows, acts, tile, out),
            n => unreachable!("{n} rows in a chunk of four"),
        }
    }
}
