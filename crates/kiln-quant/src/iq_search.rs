//! The searches behind ggml's codebook quantizers: each group of 32 values (16 for IQ2_XS
//! and IQ2_S) gets a scale and, per 4 values (IQ3_XXS, IQ3_S) or 8 values (the IQ2 formats),
//! a point of the format's grid (values 2l + 1 for levels l). Level codes off the grid are
//! replaced by their best neighbour from a precomputed list, exactly as ggml's
//! `iq3xs_init_impl` / `iq2xs_init_impl` build it, so ties resolve the same way.

use std::sync::OnceLock;

use crate::block::nearest_int;
use crate::iq_grids::{IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID};

/// Where a level code lands: on a grid point, on a slice of `neighbours`, or nowhere
/// (a code with a level the rounding never produces).
#[derive(Clone, Copy)]
enum Cell {
    OnGrid(u16),
    OffGrid { start: u32, len: u32 },
    Unreachable,
}

/// A grid of points of `D` values with its code map and neighbour lists. A code packs a
/// point's levels, level i at bits `bits * i`.
pub(crate) struct Lattice<const D: usize> {
    /// The levels of each grid point.
    points: Vec<[u8; D]>,
    bits: u32,
    /// Rounded levels are clamped to `0..levels`.
    levels: u8,
    cells: Vec<Cell>,
    neighbours: Vec<u16>,
}

/// The grid value of a level: 2l + 1.
fn odd_value(level: u8) -> i32 {
    2 * i32::from(level) + 1
}

impl<const D: usize> Lattice<D> {
    fn pack_code(&self, levels: [u8; D]) -> usize {
        levels.iter().enumerate().fold(0, |code, (i, &l)| code | usize::from(l) << (self.bits as usize * i))
    }

    fn levels_of(&self, code: usize) -> [u8; D] {
        std::array::from_fn(|i| (code >> (self.bits as usize * i)) as u8 & ((1u8 << self.bits) - 1))
    }

    /// `neighbour_distances`: an off-grid code keeps every grid point at its this many
    /// smallest squared distances (ggml: 2 for the 256-point grids, 3 for 512), ordered
    /// by distance, then index.
    fn new(points: Vec<[u8; D]>, bits: u32, levels: u8, neighbour_distances: usize) -> Lattice<D> {
        let mut lattice = Lattice { points, bits, levels, cells: vec![Cell::Unreachable; 1 << (bits as usize * D)], neighbours: Vec::new() };
        for (index, &p) in lattice.points.iter().enumerate() {
            let code = lattice.pack_code(p);
            lattice.cells[code] = Cell::OnGrid(index as u16);
        }
        let mut by_distance: Vec<(i32, u16)> = Vec::with_capacity(lattice.points.len());
        for code in 0..lattice.cells.len() {
            let at = lattice.levels_of(code);
            if matches!(lattice.cells[code], Cell::OnGrid(_)) || at.iter().any(|&l| l >= levels) {
                continue;
            }
            by_distance.clear();
            by_distance.extend(lattice.points.iter().enumerate().map(|(j, p)| {
                let d2 = (0..D).map(|i| (odd_value(p[i]) - odd_value(at[i])).pow(2)).sum::<i32>();
                (d2, j as u16)
            }));
            by_distance.sort_unstable();
            let start = lattice.neighbours.len();
            let (mut distance, mut n_distances) = (by_distance[0].0, 1);
            for &(d2, j) in &by_distance {
                if d2 > distance {
                    if n_distances == neighbour_distances {
                        break;
                    }
                    distance = d2;
                    n_distances += 1;
                }
                lattice.neighbours.push(j);
            }
            lattice.cells[code] = Cell::OffGrid { start: start as u32, len: (lattice.neighbours.len() - start) as u32 };
        }
        lattice
    }

    /// The grid point of `x` (`D` magnitudes) at inverse scale `id`, and whether its
    /// rounded levels were on the grid. Off the grid, the neighbour with the least
    /// `w`-weighted squared error at `scale` wins, the first on ties.
    fn snap(&self, x: &[f32], w: &[f32], id: f32, scale: f32) -> (u16, bool) {
        let levels: [u8; D] = std::array::from_fn(|i| nearest_int(0.5 * (id * x[i] - 1.0)).clamp(0, i32::from(self.levels) - 1) as u8);
        let candidates = match self.lookup(levels) {
            Ok(index) => return (index, true),
            Err(candidates) => candidates,
        };
        // ggml aborts when no candidate beats f32::MAX (non-finite input); kiln keeps the first.
        let (mut best_d2, mut best) = (f32::MAX, candidates[0]);
        for &j in candidates {
            let p = self.points[usize::from(j)];
            let mut d2 = 0f32;
            for i in 0..D {
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
    fn moments<const N: usize>(&self, grid: &[u16], weight: &[f32; N], x: &[f32; N]) -> (f32, f32) {
        let (mut sumqx, mut sumq2) = (0f32, 0f32);
        for i in 0..N {
            let q = odd_value(self.points[usize::from(grid[i / D])][i % D]) as f32;
            sumqx += weight[i] * x[i] * q;
            sumq2 += weight[i] * q * q;
        }
        (sumqx, sumq2)
    }

    /// The levels of grid point `index`.
    pub(crate) fn point(&self, index: u16) -> [u8; D] {
        self.points[usize::from(index)]
    }

    /// The grid point with these levels, or the neighbours to choose from when they are off
    /// the grid. Every level must be below `self.levels`.
    pub(crate) fn lookup(&self, levels: [u8; D]) -> Result<u16, &[u16]> {
        match self.cells[self.pack_code(levels)] {
            Cell::OnGrid(index) => Ok(index),
            Cell::OffGrid { start, len } => Err(&self.neighbours[start as usize..(start + len) as usize]),
            Cell::Unreachable => unreachable!("levels are below `self.levels`"),
        }
    }

    /// The index of the all-lowest point, which every grid holds.
    fn lowest_point(&self) -> u16 {
        match self.cells[0] {
            Cell::OnGrid(index) => index,
            _ => unreachable!("every codebook grid holds the all-lowest point"),
        }
    }
}

/// The 256-point IQ3_XXS grid; its stored bytes 4, 12, ..., 52, 62 are levels 0..8.
fn iq3_xxs_lattice() -> &'static Lattice<4> {
    static LATTICE: OnceLock<Lattice<4>> = OnceLock::new();
    const BYTES: [u8; 8] = [4, 12, 20, 28, 36, 44, 52, 62];
    let level = |b: u8| BYTES.iter().position(|&v| v == b).expect("IQ3_XXS grid bytes are its 8 levels") as u8;
    LATTICE.get_or_init(|| Lattice::new(IQ3XXS_GRID.iter().map(|w| w.to_le_bytes().map(level)).collect(), 3, 8, 2))
}

/// The 512-point IQ3_S grid; its stored bytes are the odd values themselves.
fn iq3_s_lattice() -> &'static Lattice<4> {
    static LATTICE: OnceLock<Lattice<4>> = OnceLock::new();
    LATTICE.get_or_init(|| Lattice::new(IQ3S_GRID.iter().map(|w| w.to_le_bytes().map(|b| (b - 1) / 2)).collect(), 3, 8, 3))
}

/// An IQ2 grid (stored bytes 8, 25, 43 are levels 0..3). ggml packs codes with 2 bits a
/// level, and its rounding stops at level 2.
fn iq2_lattice(grid: &[u64], neighbour_distances: usize) -> Lattice<8> {
    const BYTES: [u8; 3] = [8, 25, 43];
    let level = |b: u8| BYTES.iter().position(|&v| v == b).expect("IQ2 grid bytes are its 3 levels") as u8;
    Lattice::new(grid.iter().map(|w| w.to_le_bytes().map(level)).collect(), 2, 3, neighbour_distances)
}

/// The 256-point IQ2_XXS grid.
fn iq2_xxs_lattice() -> &'static Lattice<8> {
    static LATTICE: OnceLock<Lattice<8>> = OnceLock::new();
    LATTICE.get_or_init(|| iq2_lattice(&IQ2XXS_GRID, 2))
}

/// The 512-point IQ2_XS grid.
fn iq2_xs_lattice() -> &'static Lattice<8> {
    static LATTICE: OnceLock<Lattice<8>> = OnceLock::new();
    LATTICE.get_or_init(|| iq2_lattice(&IQ2XS_GRID, 2))
}

/// The 1024-point IQ2_S grid: ggml keeps only the nearest distance's neighbours.
fn iq2_s_lattice() -> &'static Lattice<8> {
    static LATTICE: OnceLock<Lattice<8>> = OnceLock::new();
    LATTICE.get_or_init(|| iq2_lattice(&IQ2S_GRID, 1))
}

/// Which grid points the search fits again at its final scale.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refit {
    /// The off-grid points of the accepted trial (IQ3_XXS, IQ2_XS, IQ2_S).
    OffGrid,
    /// Every point, when any is off the grid or no trial was accepted (IQ3_S).
    AllWhenAnyOffGrid,
    /// Every point (IQ2_XXS).
    All,
}

/// What differs between the IQ3_XXS and IQ3_S searches.
pub(crate) struct Variant {
    pub lattice: fn() -> &'static Lattice<4>,
    /// Trial inverse scales (15 + 0.2 s) / max for s in -steps..=steps.
    pub steps: i32,
    /// A group whose largest magnitude is below this is stored as zeros.
    pub zero_below: f32,
    /// IQ3_XXS stores 7 sign bits per 8 values, their count of minus signs made even.
    pub even_signs: bool,
    pub refit: Refit,
}

pub(crate) const IQ3_XXS: Variant = Variant { lattice: iq3_xxs_lattice, steps: 15, zero_below: 1e-8, even_signs: true, refit: Refit::OffGrid };
/// ggml tests `max == 0`; magnitudes are never negative, so "below the least subnormal" is the same.
pub(crate) const IQ3_S: Variant =
    Variant { lattice: iq3_s_lattice, steps: 9, zero_below: f32::from_bits(1), even_signs: false, refit: Refit::AllWhenAnyOffGrid };

/// One group in `P` grid points (of 4 or 8 values): value i is `scale * (2 l + 1)` with
/// the levels l of its grid point, negated where bit i % 8 of `signs[i / 8]` is set (the
/// first group size / 8 sign bytes are used).
pub(crate) struct GroupFit<const P: usize> {
    pub scale: f32,
    pub grid: [u16; P],
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

/// ggml's `GROUP_MAX_EPS`: groups below it are stored as zeros.
const GROUP_MAX_EPS: f32 = 1e-15;

/// The magnitudes and sign bytes of a group; with `even_signs`, the value of least
/// weight * x^2 of an octet with an odd number of negatives is flipped (its magnitude
/// goes negative).
fn split_signs<const N: usize>(x: &[f32], weight: &[f32; N], even_signs: bool) -> ([f32; N], [u8; 4]) {
    let mut xval = [0f32; N];
    let mut signs = [0u8; 4];
    for (k, s) in signs.iter_mut().enumerate().take(N / 8) {
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

/// A group's magnitudes and weights, as every search sees them.
struct Group<const N: usize> {
    xval: [f32; N],
    weight: [f32; N],
    sqrt_weight: [f32; N],
}

impl<const N: usize> Group<N> {
    /// The trial of `trials` (inverse scales) whose points fit best (largest
    /// sumqx^2 / sumq2), starting from `scale`; then the points `refit` names fitted again
    /// at the final scale. Returns the scale and the points.
    fn search<const D: usize, const P: usize>(&self, lattice: &Lattice<D>, mut scale: f32, trials: impl Iterator<Item = f32>, refit: Refit) -> (f32, [u16; P]) {
        let span = |k: usize| D * k..D * k + D;
        let mut best = 0f32;
        let (mut grid, mut on_grid) = ([lattice.lowest_point(); P], [refit == Refit::OffGrid; P]);
        for id in trials {
            let this_scale = 1.0 / id;
            let mut trial = [0u16; P];
            let mut trial_on_grid = [true; P];
            for k in 0..P {
                (trial[k], trial_on_grid[k]) = lattice.snap(&self.xval[span(k)], &self.sqrt_weight[span(k)], id, this_scale);
            }
            let (sumqx, sumq2) = lattice.moments(&trial, &self.weight, &self.xval);
            if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
                scale = sumqx / sumq2;
                best = scale * sumqx;
                (grid, on_grid) = (trial, trial_on_grid);
            }
        }
        if (refit == Refit::All || on_grid.contains(&false)) && scale > 0.0 {
            let id = 1.0 / scale;
            for k in 0..P {
                if refit != Refit::OffGrid || !on_grid[k] {
                    grid[k] = lattice.snap(&self.xval[span(k)], &self.sqrt_weight[span(k)], id, scale).0;
                }
            }
            let (sumqx, sumq2) = lattice.moments(&grid, &self.weight, &self.xval);
            if sumq2 > 0.0 {
                scale = sumqx / sumq2;
            }
        }
        (scale, grid)
    }

    /// The largest magnitude (ggml's `MAX` chain from the first).
    fn max(&self) -> f32 {
        self.xval[1..].iter().fold(self.xval[0], |m, &a| c_max(m, a))
    }
}

/// Scales are stored unsigned: a negative fit flips every sign instead.
fn unsigned_fit<const P: usize>((scale, grid): (f32, [u16; P]), mut signs: [u8; 4], sign_mask: u8) -> GroupFit<P> {
    if scale < 0.0 {
        signs.iter_mut().for_each(|s| *s = !*s & sign_mask);
    }
    GroupFit { scale: if scale < 0.0 { -scale } else { scale }, grid, signs }
}

/// ggml's IQ3 group search with weights x^2; `None` for a group it stores as zeros.
pub(crate) fn fit_group(v: &Variant, x: &[f32]) -> Option<GroupFit<8>> {
    let weight: [f32; 32] = std::array::from_fn(|i| x[i] * x[i]);
    let (xval, signs) = split_signs(x, &weight, v.even_signs);
    let group = Group { xval, weight, sqrt_weight: weight.map(f32::sqrt) };
    let max = group.max();
    if max < v.zero_below {
        return None;
    }
    let trials = (-v.steps..=v.steps).map(|step| (15.0 + step as f32 * 0.2) / max);
    let fit = group.search((v.lattice)(), max / 15.0, trials, v.refit);
    Some(unsigned_fit(fit, signs, if v.even_signs { 127 } else { 255 }))
}

/// ggml's IQ2_XXS group search (`quantize_row_iq2_xxs_impl`) with an importance of 1 for
/// every value: weights sqrt(sigma2 + x^2), where `sigma2` is the super-block's mean
/// square. `None` for a group it stores as zeros.
pub(crate) fn fit_iq2_xxs_group(x: &[f32], sigma2: f32) -> Option<GroupFit<4>> {
    const MAX_LEVEL: i32 = 3;
    let weight: [f32; 32] = std::array::from_fn(|i| (sigma2 + x[i] * x[i]).sqrt());
    let (xval, signs) = split_signs(x, &weight, true);
    let group = Group { xval, weight, sqrt_weight: weight.map(f32::sqrt) };
    if group.max() < GROUP_MAX_EPS {
        return None;
    }
    let scale = make_qp_quants(MAX_LEVEL + 1, &group.xval, &group.weight);
    let eff_max = scale * MAX_LEVEL as f32;
    if eff_max <= 0.0 {
        return None;
    }
    let trials = (-6..=6).map(|step| ((2 * MAX_LEVEL - 1) as f32 + step as f32 * 0.1) / eff_max);
    let fit = group.search(iq2_xxs_lattice(), scale, trials, Refit::All);
    Some(unsigned_fit(fit, signs, 127))
}

/// The 2048-point IQ1_S / IQ1_M grid (stored bytes -1, 0, 1 are levels 0..3): ggml keeps
/// the three nearest distances' neighbours.
pub(crate) fn iq1_lattice() -> &'static Lattice<8> {
    static LATTICE: OnceLock<Lattice<8>> = OnceLock::new();
    LATTICE.get_or_init(|| Lattice::new(IQ1S_GRID.iter().map(|w| w.to_le_bytes().map(|b| (b as i8 + 1) as u8)).collect(), 2, 3, 3))
}

/// How IQ2_XS and IQ2_S weigh a group's values (sumx2: the super-block's sum of squares).
#[derive(Clone, Copy)]
pub(crate) enum Iq2Weights {
    /// IQ2_XS, which ggml only quantizes with an importance matrix: one of ones, so
    /// sqrt(sumx2 / 256 + x^2).
    UnitImportance,
    /// IQ2_S without an importance matrix, as ggml does it: (2 sumx2 / 256) / 4 + x^2.
    Plain,
}

/// ggml's IQ2_XS / IQ2_S group search over 16 values (`quantize_row_iq2_xs_impl`,
/// `quantize_row_iq2_s_impl`): trial inverse scales (5 + 0.1 s) / max for s in -9..=9, then
/// the off-grid octets fitted again. IQ2_XS stores 7 sign bits per octet (their count of
/// minus signs made even), IQ2_S all 8. `None` for a group it stores as zeros.
pub(crate) fn fit_iq2_pair_group(x: &[f32], sumx2: f32, weights: Iq2Weights) -> Option<GroupFit<2>> {
    let (weight, lattice, even_signs, zero_below): ([f32; 16], _, _, _) = match weights {
        Iq2Weights::UnitImportance => {
            let sigma2 = sumx2 / 256.0;
            (std::array::from_fn(|i| (sigma2 + x[i] * x[i]).sqrt()), iq2_xs_lattice(), true, GROUP_MAX_EPS)
        }
        Iq2Weights::Plain => {
            let sigma2 = 2.0 * sumx2 / 256.0;
            (std::array::from_fn(|i| 0.25 * sigma2 + x[i] * x[i]), iq2_s_lattice(), false, 1e-8)
        }
    };
    let (xval, signs) = split_signs(x, &weight, even_signs);
    let group = Group { xval, weight, sqrt_weight: weight.map(f32::sqrt) };
    let max = group.max();
    if max < zero_below {
        return None;
    }
    let trials = (-9..=9).map(|step| (5.0 + step as f32 * 0.1) / max);
    let fit = group.search(lattice, max / 5.0, trials, Refit::OffGrid);
    Some(unsigned_fit(fit, signs, if even_signs { 127 } else { 255 }))
}

/// ggml's `make_qp_quants`: the weighted least-squares scale of levels 0..=nmax for `x`,
/// after a coarse scan of 9 scales and up to 5 rounds of moving single levels. Levels
/// are kept in bytes as ggml keeps them, so a negative level (a parity-flipped
/// magnitude) wraps to a large one, which the refinement then sees.
fn make_qp_quants(nmax: i32, x: &[f32; 32], weight: &[f32; 32]) -> f32 {
    let max = x.iter().fold(0f32, |m, &v| c_max(m, v));
    if max < GROUP_MAX_EPS {
        return 0.0;
    }
    let mut iscale = nmax as f32 / max;
    let mut levels: [u8; 32] = std::array::from_fn(|i| nearest_int(iscale * x[i]) as u8);
    let weighted_error = |scale: f32, level: &dyn Fn(usize) -> f32| {
        let mut mse = 0f32;
        for i in 0..32 {
            let diff = x[i] - scale * level(i);
            mse += weight[i] * diff * diff;
        }
        mse
    };
    let mut best_mse = weighted_error(1.0 / iscale, &|i| f32::from(levels[i]));
    for step in (-4..=4).filter(|&s| s != 0) {
        let iscale_step = (0.1 * step as f32 + nmax as f32) / max;
        let mse = weighted_error(1.0 / iscale_step, &|i| nearest_int(iscale_step * x[i]).min(nmax) as f32);
        if mse < best_mse {
            (best_mse, iscale) = (mse, iscale_step);
        }
    }
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for i in 0..32 {
        let l = nearest_int(iscale * x[i]).min(nmax);
        levels[i] = l as u8;
        sumlx += weight[i] * x[i] * l as f32;
        suml2 += weight[i] * l as f32 * l as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for i in 0..32 {
            let (w, old) = (weight[i], f32::from(levels[i]));
            let mut slx = sumlx - w * x[i] * old;
            let mut sl2 = suml2 - w * old * old;
            if slx > 0.0 && sl2 > 0.0 {
                let new_l = nearest_int(x[i] * sl2 / slx).min(nmax);
                if new_l != i32::from(levels[i]) {
                    slx += w * x[i] * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if slx * slx * suml2 > sumlx * sumlx * sl2 {
                        (levels[i], sumlx, suml2) = (new_l as u8, slx, sl2);
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// ggml's 4-bit sub-scale of a group: nearest_int((scale / d - 1) / 2) in 0..=15.
pub(crate) fn scale_code(id: f32, scale: f32) -> u8 {
    nearest_int(0.5 * (id * scale - 1.0)).clamp(0, 15) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    fn codes<const D: usize>(l: &Lattice<D>) -> Vec<u16> {
        l.points.iter().map(|&p| l.pack_code(p) as u16).collect()
    }

    /// Spot values of ggml's packed level tables (`kgrid_256`, `kgrid_512` in
    /// iq3xs_init_impl, `kgrid_2bit_256` in iq2xs_init_impl), which kiln derives from the
    /// decoding grids.
    #[test]
    fn grids_match_ggml_level_tables() {
        let (xxs, s, iq2) = (codes(iq3_xxs_lattice()), codes(iq3_s_lattice()), codes(iq2_xxs_lattice()));
        assert_eq!(xxs[..8], [0, 2, 4, 9, 11, 15, 16, 18]);
        assert_eq!(xxs[248..], [3803, 3824, 3857, 3873, 3904, 3906, 3924, 3992]);
        assert_eq!(s[..8], [0, 1, 2, 5, 7, 8, 9, 10]);
        assert_eq!(s[504..], [3851, 3856, 3880, 3922, 3938, 3970, 3993, 4032]);
        assert_eq!(iq2[..8], [0, 2, 5, 8, 10, 17, 20, 32]);
        assert_eq!(iq2[240..248], [37248, 37445, 37888, 37922, 37956, 38225, 39041, 39200]);
        assert_eq!(iq2[248..], [40962, 41040, 41093, 41225, 41472, 42008, 43088, 43268]);
        for table in [&xxs, &s, &iq2] {
            assert!(table.windows(2).all(|w| w[0] < w[1]), "ggml's tables are sorted");
        }
    }

    fn check_neighbour_lists<const D: usize>(lattice: &Lattice<D>, n_distances: usize, reachable_codes: usize) {
        let mut n_off = 0;
        for (code, cell) in lattice.cells.iter().enumerate() {
            let Cell::OffGrid { start, len } = *cell else { continue };
            n_off += 1;
            let at = lattice.levels_of(code);
            let list = &lattice.neighbours[start as usize..(start + len) as usize];
            let d2: Vec<i32> = list.iter().map(|&j| (0..D).map(|i| (odd_value(lattice.points[usize::from(j)][i]) - odd_value(at[i])).pow(2)).sum()).collect();
            assert!(list.windows(2).zip(d2.windows(2)).all(|(j, d)| (d[0], j[0]) < (d[1], j[1])), "code {code}");
            let mut distinct = d2.clone();
            distinct.dedup();
            assert!(distinct.len() <= n_distances, "code {code}");
        }
        assert_eq!(n_off, reachable_codes - lattice.points.len());
    }

    #[test]
    fn neighbour_lists_are_nearest_first() {
        check_neighbour_lists(iq3_xxs_lattice(), 2, 8usize.pow(4));
        check_neighbour_lists(iq3_s_lattice(), 3, 8usize.pow(4));
        check_neighbour_lists(iq2_xxs_lattice(), 2, 3usize.pow(8));
    }

    /// ggml's `make_qp_quants` keeps levels in bytes: a parity-flipped (negative) magnitude
    /// can round to level -1 = 255 and still steer the refinement. The result is a finite
    /// positive scale near the largest magnitude / nmax.
    #[test]
    fn make_qp_quants_fits_the_largest_values() {
        let mut x: [f32; 32] = std::array::from_fn(|i| 0.5 + (i % 7) as f32 * 0.25);
        x[3] = -1.0;
        let weight = x.map(|v| (1.0 + v * v).sqrt());
        let scale = make_qp_quants(4, &x, &weight);
        let max = x.iter().fold(0f32, |m, &v| m.max(v));
        assert!(scale.is_finite() && scale > 0.0 && (scale - max / 4.0).abs() < 0.5 * max / 4.0, "{scale} vs {max}");
        assert_eq!(make_qp_quants(4, &[0.0; 32], &weight), 0.0);
    }
}
