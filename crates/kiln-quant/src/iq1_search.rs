//! ggml's searches behind the IQ1_S and IQ1_M quantizers (`quantize_row_iq1_s_impl`,
//! `quantize_row_iq1_m_impl`). Values take levels {-1, 0, 1} shifted by a delta of +-1/8,
//! so a group's best three-way split of its sorted values is found exhaustively; the
//! levels of each 8 values are then snapped to the 2048-point grid. IQ1_S has one delta
//! sign per 32 values and, as ggml only quantizes it with an importance matrix, is given
//! one of ones; IQ1_M has a delta sign per 8 values and is quantized as ggml does without
//! an importance matrix.

use std::cmp::Ordering;

use crate::iq_search::{c_max, iq1_lattice, Lattice};

const DELTA: f32 = 0.125;
/// The three values of a positive-delta and a negative-delta group.
const PLUS: [f32; 3] = [-1.0 + DELTA, DELTA, 1.0 + DELTA];
const MINUS: [f32; 3] = [-1.0 - DELTA, -DELTA, 1.0 - DELTA];

/// One group's fit: its scale, grid points and delta signs (bit k set: octet k takes
/// `MINUS`).
pub(crate) struct Iq1Fit<const P: usize> {
    pub scale: f32,
    pub grid: [u16; P],
    pub minus: u8,
}

/// The values of octet `k` under the delta signs `minus`.
fn shifted(minus: u8, k: usize) -> &'static [f32; 3] {
    if minus >> k & 1 == 1 {
        &MINUS
    } else {
        &PLUS
    }
}

/// The order of `x` ascending, ties in index order (glibc's qsort is a stable merge sort
/// at this size). NaN sorts last, where ggml's comparison would leave it anywhere.
fn ascending<const N: usize>(x: &[f32]) -> [usize; N] {
    let mut order: [usize; N] = std::array::from_fn(|i| i);
    order.sort_by(|&a, &b| {
        let (a, b) = (x[a], x[b]);
        if a < b {
            Ordering::Less
        } else if a > b {
            Ordering::Greater
        } else {
            a.is_nan().cmp(&b.is_nan())
        }
    });
    order
}

/// The best neighbour of an off-grid octet (`iq1_find_best_neighbour2`): least weighted
/// squared error at `scale`, the first on ties.
fn best_neighbour(lattice: &Lattice<8>, candidates: &[u16], x: &[f32], weight: &[f32], scale: f32, values: &[f32; 3]) -> u16 {
    // ggml aborts when no candidate beats f32::MAX (non-finite input); kiln keeps the first.
    let (mut best_d2, mut best) = (f32::MAX, candidates[0]);
    for &j in candidates {
        let point = lattice.point(j);
        let mut d2 = 0f32;
        for i in 0..8 {
            let diff = scale * values[usize::from(point[i])] - x[i];
            d2 += weight[i] * diff * diff;
        }
        if d2 < best_d2 {
            (best_d2, best) = (d2, j);
        }
    }
    best
}

/// Snaps the split's levels to the grid, octet by octet, and fits the scale again when an
/// octet moved off its levels.
fn snap_to_grid<const N: usize, const P: usize>(x: &[f32], weight: &[f32; N], levels: &[u8; N], mut scale: f32, minus: u8) -> (f32, [u16; P]) {
    let lattice = iq1_lattice();
    let mut grid = [0u16; P];
    let mut all_on_grid = true;
    for (k, g) in grid.iter_mut().enumerate() {
        let octet = 8 * k..8 * k + 8;
        let own: [u8; 8] = std::array::from_fn(|i| levels[8 * k + i]);
        *g = match lattice.lookup(own) {
            Ok(index) => index,
            Err(candidates) => {
                all_on_grid = false;
                best_neighbour(lattice, candidates, &x[octet.clone()], &weight[octet], scale, shifted(minus, k))
            }
        };
    }
    if !all_on_grid {
        let (mut sumqx, mut sumq2) = (0f32, 0f32);
        for (k, &g) in grid.iter().enumerate() {
            let (point, values) = (lattice.point(g), shifted(minus, k));
            for j in 0..8 {
                let (w, q) = (weight[8 * k + j], values[usize::from(point[j])]);
                sumqx += w * q * x[8 * k + j];
                sumq2 += w * q * q;
            }
        }
        if sumqx > 0.0 && sumq2 > 0.0 {
            scale = sumqx / sumq2;
        }
    }
    (scale, grid)
}

/// Levels 0 / 1 / 2 for the sorted positions below `i1`, in `i1..i2` and from `i2`.
fn split_levels<const N: usize>(order: &[usize; N], i1: usize, i2: usize) -> [u8; N] {
    let mut levels = [0u8; N];
    for (j, &i) in order.iter().enumerate() {
        levels[i] = if j < i1 {
            0
        } else if j < i2 {
            1
        } else {
            2
        };
    }
    levels
}

/// The largest magnitude, ggml's `MAX` chain from the first.
fn max_magnitude(x: &[f32]) -> f32 {
    x[1..].iter().fold(x[0].abs(), |m, &v| c_max(m, v.abs()))
}

/// ggml's IQ1_S search over 32 values given an importance of 1 for each: weights
/// sqrt(sigma2 + x^2), sigma2 = 2 sumx2 / 256 (`sumx2`: the super-block's sum of squares).
/// `None` for a group it stores as zeros.
pub(crate) fn fit_iq1_s_group(x: &[f32], sumx2: f32) -> Option<Iq1Fit<4>> {
    let sigma2 = 2.0 * sumx2 / 256.0;
    let weight: [f32; 32] = std::array::from_fn(|i| (sigma2 + x[i] * x[i]).sqrt());
    if max_magnitude(&x[..32]) < 1e-12 {
        return None;
    }
    let order: [usize; 32] = ascending(&x[..32]);
    // Prefix sums over the sorted values: the split (i1, i2) is scored in O(1).
    let (mut sumx, mut sumw) = ([0f32; 33], [0f32; 33]);
    for (j, &i) in order.iter().enumerate() {
        sumx[j + 1] = sumx[j] + weight[i] * x[i];
        sumw[j + 1] = sumw[j] + weight[i];
    }
    let (mut best_score, mut scale) = (-f32::MAX, 0f32);
    let mut best: Option<(usize, usize, bool)> = None;
    for i1 in 0..=32 {
        for i2 in i1..=32 {
            for (minus, v) in [(false, &PLUS), (true, &MINUS)] {
                let sumqx = (sumx[i1] - sumx[0]) * v[0] + (sumx[i2] - sumx[i1]) * v[1] + (sumx[32] - sumx[i2]) * v[2];
                let sumq2 = (sumw[i1] - sumw[0]) * v[0] * v[0] + (sumw[i2] - sumw[i1]) * v[1] * v[1] + (sumw[32] - sumw[i2]) * v[2] * v[2];
                if sumq2 > 0.0 && sumqx * sumqx > best_score * sumq2 {
                    scale = sumqx / sumq2;
                    best_score = scale * sumqx;
                    best = Some((i1, i2, minus));
                }
            }
        }
    }
    let (i1, i2, mut minus) = best?;
    let mut levels = split_levels(&order, i1, i2);
    if scale < 0.0 {
        // A negative scale mirrors the levels and the delta.
        levels.iter_mut().for_each(|l| *l = 2 - *l);
        (scale, minus) = (-scale, !minus);
    }
    let minus = if minus { 0b1111 } else { 0 };
    let (scale, grid) = snap_to_grid(x, &weight, &levels, scale, minus);
    Some(Iq1Fit { scale, grid, minus })
}

/// ggml's IQ1_M search over 16 values without an importance matrix (weights x^2): each
/// half takes its own delta sign, so the four sign pairs are scored for every split.
/// `None` for a group it stores as zeros.
pub(crate) fn fit_iq1_m_group(x: &[f32]) -> Option<Iq1Fit<2>> {
    let weight: [f32; 16] = std::array::from_fn(|i| x[i] * x[i]);
    if max_magnitude(&x[..16]) < 1e-7 {
        return None;
    }
    let order: [usize; 16] = ascending(&x[..16]);
    // Pair k: bit 1 the first half's delta sign, bit 0 the second's (ggml's order).
    let pair_minus = |k: usize| ((k >> 1) & 1 | (k & 1) << 1) as u8;
    let (mut best_score, mut scale) = (-f32::MAX, 0f32);
    let mut best: Option<(usize, usize, usize)> = None;
    for i1 in 0..=16 {
        for i2 in i1..=16 {
            let (mut sumqx, mut sumq2) = ([0f32; 4], [0f32; 4]);
            for (j, &i) in order.iter().enumerate() {
                let level = usize::from(j >= i1) + usize::from(j >= i2);
                for k in 0..4 {
                    let q = shifted(pair_minus(k), i / 8)[level];
                    sumqx[k] += weight[i] * q * x[i];
                    sumq2[k] += weight[i] * q * q;
                }
            }
            for k in 0..4 {
                if sumq2[k] > 0.0 && sumqx[k] * sumqx[k] > best_score * sumq2[k] {
                    scale = sumqx[k] / sumq2[k];
                    best_score = scale * sumqx[k];
                    best = Some((i1, i2, k));
                }
            }
        }
    }
    let (i1, i2, mut k) = best?;
    let mut levels = split_levels(&order, i1, i2);
    if scale < 0.0 {
        levels.iter_mut().for_each(|l| *l = 2 - *l);
        (scale, k) = (-scale, 3 - k);
    }
    let minus = pair_minus(k);
    let (scale, grid) = snap_to_grid(x, &weight, &levels, scale, minus);
    Some(Iq1Fit { scale, grid, minus })
}

/// IQ1_M's super-block scale: the least-squares fit of the stored values (grid points,
/// deltas and 3-bit group scales `codes`) to `x` with weights x^2, over all 16 groups.
pub(crate) fn iq1_m_super_scale(x: &[f32], grids: &[[u16; 2]; 16], minus: &[u8; 16], codes: &[u8; 16]) -> Option<f32> {
    let lattice = iq1_lattice();
    let (mut sumqx, mut sumq2) = (0f32, 0f32);
    for ib in 0..16 {
        let multiple = f32::from(2 * codes[ib] + 1);
        for (k, &g) in grids[ib].iter().enumerate() {
            let (point, values) = (lattice.point(g), shifted(minus[ib], k));
            for j in 0..8 {
                let i = 16 * ib + 8 * k + j;
                let w = x[i] * x[i];
                let q = values[usize::from(point[j])] * multiple;
                sumqx += w * q * x[i];
                sumq2 += w * q * q;
            }
        }
    }
    (sumq2 > 0.0).then(|| sumqx / sumq2)
}
