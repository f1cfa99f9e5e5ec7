//! The search behind ggml's IQ3_XXS and IQ3_S quantizers without an importance
//! matrix: each group of 32 values gets a scale and, per 4 values, a point of the
//! format's grid (values 2l + 1 for levels l in 0..8). Level codes off the grid are
//! replaced by their best neighbour from a precomputed list, exactly as ggml's
//! `iq3xs_init_impl` builds it, so ties resolve the same way.

use std::sync::OnceLock;

use crate::block::nearest_int;
use crate::iq_grids::{IQ3S_GRID, IQ3XXS_GRID};

/// Levels per value (3 bits); a group of 4 packs into a 12-bit code, level i at bits 3i.
const LEVELS: usize = 8;
const N_CODES: usize = LEVELS * LEVELS * LEVELS * LEVELS;

/// Where a 12-bit level code lands: on a grid point, or on a slice of `neighbours`.
#[derive(Clone, Copy)]
enum Cell {
    OnGrid(u16),
    OffGrid { start: u32, len: u32 },
}

/// A grid with its code map and neighbour lists.
pub(crate) struct Lattice {
    /// The levels of each grid point.
    points: Vec<[u8; 4]>,
    cells: Vec<Cell>,
    neighbours: Vec<u16>,
}

fn pack_code(levels: [u8; 4]) -> usize {
    levels.iter().enumerate().fold(0, |code, (i, &l)| code | usize::from(l) << (3 * i))
}

/// The grid value of a level: 2l + 1.
fn odd_value(level: u8) -> i32 {
    2 * i32::from(level) + 1
}

impl Lattice {
    /// `neighbour_distances`: an off-grid code keeps every grid point at its this many
    /// smallest squared distances (ggml: 2 for the 256-point grid, 3 for 512), ordered
    /// by distance, then index.
    fn new(points: Vec<[u8; 4]>, neighbour_distances: usize) -> Lattice {
        let mut on_grid = vec![None; N_CODES];
        for (index, &p) in points.iter().enumerate() {
            on_grid[pack_code(p)] = Some(index as u16);
        }
        let mut cells = Vec::with_capacity(N_CODES);
        let mut neighbours = Vec::new();
        let mut by_distance: Vec<(i32, u16)> = Vec::with_capacity(points.len());
        for (code, on) in on_grid.into_iter().enumerate() {
            if let Some(index) = on {
                cells.push(Cell::OnGrid(index));
                continue;
            }
            let at: [i32; 4] = std::array::from_fn(|i| odd_value((code >> (3 * i)) as u8 & 7));
            by_distance.clear();
            by_distance.extend(points.iter().enumerate().map(|(j, p)| {
                let d2 = (0..4).map(|i| (odd_value(p[i]) - at[i]).pow(2)).sum::<i32>();
                (d2, j as u16)
            }));
            by_distance.sort_unstable();
            let start = neighbours.len();
            let (mut distance, mut n_distances) = (by_distance[0].0, 1);
            for &(d2, j) in &by_distance {
                if d2 > distance {
                    if n_distances == neighbour_distances {
                        break;
                    }
                    distance = d2;
                    n_distances += 1;
                }
                neighbours.push(j);
            }
            cells.push(Cell::OffGrid { start: start as u32, len: (neighbours.len() - start) as u32 });
        }
        Lattice { points, cells, neighbours }
    }

    /// The 256-point IQ3_XXS grid; its stored bytes 4, 12, ..., 52, 62 are levels 0..8.
    pub(crate) fn iq3_xxs() -> &'static Lattice {
        static LATTICE: OnceLock<Lattice> = OnceLock::new();
        const BYTES: [u8; LEVELS] = [4, 12, 20, 28, 36, 44, 52, 62];
        let level = |b: u8| BYTES.iter().position(|&v| v == b).expect("IQ3_XXS grid bytes are its 8 levels") as u8;
        LATTICE.get_or_init(|| Lattice::new(IQ3XXS_GRID.iter().map(|w| w.to_le_bytes().map(level)).collect(), 2))
    }

    /// The 512-point IQ3_S grid; its stored bytes are the odd values themselves.
    pub(crate) fn iq3_s() -> &'static Lattice {
        static LATTICE: OnceLock<Lattice> = OnceLock::new();
        LATTICE.get_or_init(|| Lattice::new(IQ3S_GRID.iter().map(|w| w.to_le_bytes().map(|b| (b - 1) / 2)).collect(), 3))
    }

    /// The grid point of `x` (4 magnitudes) at inverse scale `id`, and whether its
    /// rounded levels were on the grid. Off the grid, the neighbour with the least
    /// `w`-weighted squared error at `scale` wins, the first on ties.
    fn snap(&self, x: &[f32], w: &[f32], id: f32, scale: f32) -> (u16, bool) {
        let levels: [u8; 4] = std::array::from_fn(|i| nearest_int(0.5 * (id * x[i] - 1.0)).clamp(0, LEVELS as i32 - 1) as u8);
        let (start, len) = match self.cells[pack_code(levels)] {
            Cell::OnGrid(index) => return (index, true),
            Cell::OffGrid { start, len } => (start as usize, len as usize),
        };
        let candidates = &self.neighbours[start..start + len];
        // ggml aborts when no candidate beats f32::MAX (non-finite input); kiln keeps the first.
        let (mut best_d2, mut best) = (f32::MAX, candidates[0]);
        for &j in candidates {
            let p = self.points[usize::from(j)];
            let mut d2 = 0f32;
            for i in 0..4 {
                let diff = scale * odd_value(p[i]) as f32 - x[i];
                d2 += w[i] * diff * diff;
            }
            if d2 < best_d2 {
                (best_d2, best) = (d2, j);
            }
        }
        (best, false)
    }

    /// `(sum w x q, sum w q^2)` over a group for the grid values q of `grid`.
    fn moments(&self, grid: &[u16; 8], weight: &[f32; 32], x: &[f32; 32]) -> (f32, f32) {
        let (mut sumqx, mut sumq2) = (0f32, 0f32);
        for i in 0..32 {
            let q = odd_value(self.points[usize::from(grid[i / 4])][i % 4]) as f32;
            sumqx += weight[i] * x[i] * q;
            sumq2 += weight[i] * q * q;
        }
        (sumqx, sumq2)
    }
}

/// What differs between the IQ3_XXS and IQ3_S searches.
pub(crate) struct Variant {
    pub lattice: fn() -> &'static Lattice,
    /// Trial inverse scales (15 + 0.2 s) / max for s in -steps..=steps.
    pub steps: i32,
    /// A group whose largest magnitude is below this is stored as zeros.
    pub zero_below: f32,
    /// IQ3_XXS stores 7 sign bits per 8 values, their count of minus signs made even.
    pub even_signs: bool,
    /// After the search, IQ3_S re-fits every quad when any is off the grid (or no trial
    /// was accepted); IQ3_XXS only the off-grid quads of the accepted trial.
    pub refit_all: bool,
}

pub(crate) const IQ3_XXS: Variant = Variant { lattice: Lattice::iq3_xxs, steps: 15, zero_below: 1e-8, even_signs: true, refit_all: false };
/// ggml tests `max == 0`; magnitudes are never negative, so "below the least subnormal" is the same.
pub(crate) const IQ3_S: Variant = Variant { lattice: Lattice::iq3_s, steps: 9, zero_below: f32::from_bits(1), even_signs: false, refit_all: true };

/// One group of 32: value 4k + i is `scale * (2 l + 1)` with the levels l of grid point
/// `grid[k]`, negated where bit i % 8 of `signs[i / 8]` is set.
pub(crate) struct GroupFit {
    pub scale: f32,
    pub grid: [u16; 8],
    pub signs: [u8; 4],
}

/// ggml's `MAX(a, b)`, NaN behaviour included.
pub(crate) fn c_max(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// The magnitudes and sign bytes of a group; with `even_signs`, the value of least x^4
/// of an octet with an odd number of negatives is flipped (its magnitude goes negative).
fn split_signs(x: &[f32], weight: &[f32; 32], even_signs: bool) -> ([f32; 32], [u8; 4]) {
    let mut xval = [0f32; 32];
    let mut signs = [0u8; 4];
    for (k, s) in signs.iter_mut().enumerate() {
        let octet = 8 * k..8 * k + 8;
        for i in octet.clone() {
            if x[i] >= 0.0 {
                xval[i] = x[i];
            } else {
                xval[i] = -x[i];
                *s |= 1 << (i - 8 * k);
            }
        }
        if even_signs && s.count_ones() % 2 == 1 {
            let cost = |i: usize| weight[i] * x[i] * x[i];
            let mut imin = 8 * k;
            for i in octet.skip(1) {
                if cost(i) < cost(imin) {
                    imin = i;
                }
            }
            xval[imin] = -xval[imin];
            *s ^= 1 << (imin - 8 * k);
        }
        if even_signs {
            *s &= 127;
        }
    }
    (xval, signs)
}

/// ggml's per-group search with weights x^2; `None` for a group it stores as zeros.
pub(crate) fn fit_group(v: &Variant, x: &[f32]) -> Option<GroupFit> {
    let lattice = (v.lattice)();
    let weight: [f32; 32] = std::array::from_fn(|i| x[i] * x[i]);
    let sqrt_weight: [f32; 32] = std::array::from_fn(|i| weight[i].sqrt());
    let (xval, mut signs) = split_signs(x, &weight, v.even_signs);
    let max = xval[1..].iter().fold(xval[0], |m, &a| c_max(m, a));
    if max < v.zero_below {
        return None;
    }
    let quad = |k: usize| 4 * k..4 * k + 4;
    let zero_point = match lattice.cells[0] {
        Cell::OnGrid(index) => index,
        Cell::OffGrid { .. } => unreachable!("both IQ3 grids hold the all-lowest point"),
    };
    let (mut scale, mut best) = (max / 15.0, 0f32);
    let (mut grid, mut on_grid) = ([zero_point; 8], [!v.refit_all; 8]);
    for step in -v.steps..=v.steps {
        let id = (15.0 + step as f32 * 0.2) / max;
        let this_scale = 1.0 / id;
        let mut trial = [0u16; 8];
        let mut trial_on_grid = [true; 8];
        for k in 0..8 {
            (trial[k], trial_on_grid[k]) = lattice.snap(&xval[quad(k)], &sqrt_weight[quad(k)], id, this_scale);
        }
        let (sumqx, sumq2) = lattice.moments(&trial, &weight, &xval);
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            scale = sumqx / sumq2;
            best = scale * sumqx;
            (grid, on_grid) = (trial, trial_on_grid);
        }
    }
    if on_grid.contains(&false) && scale > 0.0 {
        let id = 1.0 / scale;
        for k in 0..8 {
            if v.refit_all || !on_grid[k] {
                grid[k] = lattice.snap(&xval[quad(k)], &sqrt_weight[quad(k)], id, scale).0;
            }
        }
        let (sumqx, sumq2) = lattice.moments(&grid, &weight, &xval);
        if sumq2 > 0.0 {
            scale = sumqx / sumq2;
        }
    }
    if scale < 0.0 {
        // Scales are stored unsigned: flip every sign instead.
        scale = -scale;
        let mask = if v.even_signs { 127 } else { 255 };
        signs.iter_mut().for_each(|s| *s = !*s & mask);
    }
    Some(GroupFit { scale, grid, signs })
}

/// ggml's 4-bit sub-scale of a group: nearest_int((scale / d - 1) / 2) in 0..=15.
pub(crate) fn scale_code(id: f32, scale: f32) -> u8 {
    nearest_int(0.5 * (id * scale - 1.0)).clamp(0, 15) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spot values of ggml's packed level tables (`kgrid_256`, `kgrid_512` in
    /// iq3xs_init_impl), which kiln derives from the decoding grids.
    #[test]
    fn grids_match_ggml_level_tables() {
        let codes = |l: &Lattice| l.points.iter().map(|&p| pack_code(p) as u16).collect::<Vec<_>>();
        let (xxs, s) = (codes(Lattice::iq3_xxs()), codes(Lattice::iq3_s()));
        assert_eq!(xxs[..8], [0, 2, 4, 9, 11, 15, 16, 18]);
        assert_eq!(xxs[248..], [3803, 3824, 3857, 3873, 3904, 3906, 3924, 3992]);
        assert_eq!(s[..8], [0, 1, 2, 5, 7, 8, 9, 10]);
        assert_eq!(s[504..], [3851, 3856, 3880, 3922, 3938, 3970, 3993, 4032]);
        for table in [&xxs, &s] {
            assert!(table.windows(2).all(|w| w[0] < w[1]), "ggml's tables are sorted");
        }
    }

    #[test]
    fn neighbour_lists_are_nearest_first() {
        for (lattice, n_distances) in [(Lattice::iq3_xxs(), 2), (Lattice::iq3_s(), 3)] {
            let mut n_off = 0;
            for (code, cell) in lattice.cells.iter().enumerate() {
                let Cell::OffGrid { start, len } = *cell else { continue };
                n_off += 1;
                let at: [i32; 4] = std::array::from_fn(|i| odd_value((code >> (3 * i)) as u8 & 7));
                let list = &lattice.neighbours[start as usize..(start + len) as usize];
                let d2: Vec<i32> = list.iter().map(|&j| (0..4).map(|i| (odd_value(lattice.points[usize::from(j)][i]) - at[i]).pow(2)).sum()).collect();
                assert!(list.windows(2).zip(d2.windows(2)).all(|(j, d)| (d[0], j[0]) < (d[1], j[1])), "code {code}");
                let mut distinct = d2.clone();
                distinct.dedup();
                assert!(distinct.len() <= n_distances, "code {code}");
            }
            assert_eq!(n_off, N_CODES - lattice.points.len());
        }
    }
}
