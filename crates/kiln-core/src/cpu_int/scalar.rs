//! The reference kernels: exact integer group sums, then f32 scaling, one value at a time.

use super::acts::{QuantizedActs, TOKEN_TILE};
use super::DecodedRow;
use kiln_quant::int_rows::CODE_BIAS;
use std::ops::Range;

/// `row · x[t]`.
pub fn matvec_row(row: &DecodedRow, acts: &QuantizedActs, t: usize) -> f32 {
    group_terms(row, acts, t, 0..acts.cols / row.group, row.has_offset)
}

/// The sum over `groups` of one row's group terms, with or without the offsets.
pub fn group_terms(row: &DecodedRow, acts: &QuantizedActs, t: usize, groups: Range<usize>, with_offset: bool) -> f32 {
    let cols = acts.cols;
    let (qs, scale, sum16) = (&acts.qs[t * cols..][..cols], &acts.scale[t * cols / 32..], &acts.sum16[t * cols / 16..]);
    let per16 = row.group / 16;
    let mut acc = 0f32;
    for g in groups {
        let range = g * row.group..(g + 1) * row.group;
        let dot: i32 = row.codes[range.clone()].iter().zip(&qs[range]).map(|(&w, &a)| i32::from(w) * i32::from(a)).sum();
        let sum: i32 = sum16[g * per16..(g + 1) * per16].iter().sum();
        let mut term = row.scale[g] * (dot - CODE_BIAS * sum) as f32;
        if with_offset {
            term += row.offset[g] * sum as f32;
        }
        acc += scale[g * row.group / 32] * term;
    }
    acc
}

/// Rows × the tokens of token tile `tile`, read from the tiled layout:
/// `out[r][lane]` for token `tile * TOKEN_TILE + lane`.
pub fn matmat_tile(rows: &[DecodedRow], acts: &QuantizedActs, tile: usize, out: &mut [[f32; TOKEN_TILE]]) {
    let cols = acts.cols;
    let qs = &acts.tiled_qs[tile * cols * TOKEN_TILE..][..cols * TOKEN_TILE];
    let nb16 = &acts.tiled_neg_bias16[tile * cols / 16 * TOKEN_TILE..];
    let ss16 = &acts.tiled_scaled_sum16[tile * cols / 16 * TOKEN_TILE..];
    let scale = &acts.tiled_scale[tile * cols / 32 * TOKEN_TILE..];
    for (row, out) in rows.iter().zip(out) {
        let per16 = row.group / 16;
        for (lane, o) in out.iter_mut().enumerate() {
            let mut acc = 0f32;
            for g in 0..cols / row.group {
                let mut dot: i32 = (0..per16).map(|h| nb16[(g * per16 + h) * TOKEN_TILE + lane]).sum();
                for k in g * row.group..(g + 1) * row.group {
                    dot += i32::from(row.codes[k]) * i32::from(qs[(k / 4 * TOKEN_TILE + lane) * 4 + k % 4]);
                }
                let mut term = row.scale[g] * scale[g * row.group / 32 * TOKEN_TILE + lane] * dot as f32;
                if row.has_offset {
                    term += row.offset[g] * (0..per16).map(|h| ss16[(g * per16 + h) * TOKEN_TILE + lane]).sum::<f32>();
                }
                acc += term;
            }
            *o = acc;
        }
    }
}
