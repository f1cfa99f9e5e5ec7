//! The codebook formats IQ2_XXS, IQ2_XS, IQ2_S (8 values per grid entry, 3 levels),
//! with explicit or parity-coded signs and 256-value super-blocks. Codes are the
//! signed grid values, so value = scale * code reproduces ggml's `db * grid[j] * sign`
//! exactly. All three also encode, byte for byte as ggml: IQ2_S as ggml does without an
//! importance matrix, IQ2_XXS and IQ2_XS (which ggml only quantizes with one) given an
//! importance matrix of ones. llama-quantize refuses all three without an importance
//! matrix; kiln uses them for random-weight benchmark files.

use crate::block::{f16_of, f32_of, QuantBlock, Unpacked};
use crate::iq3::scales_of;
use crate::iq_grids::{IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID};
use crate::iq_search::{c_max, fit_iq2_pair_group, fit_iq2_xxs_group, scale_code, GroupFit, Iq2Weights};
use bytemuck::{Pod, Zeroable};
use half::f16;

/// Per 32 values: 4 grid bytes, then a word with four 7-bit sign indices and a 4-bit scale.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ2_XXS {
    pub d: f16,
    pub qs: [u8; 64],
}

/// Per 8 values a u16: 9-bit grid index, 7-bit sign index; 4-bit scales per 16 values.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ2_XS {
    pub d: f16,
    pub qs: [u8; 64],
    pub scales: [u8; 8],
}

/// Per 8 values: a grid byte in `qs[..32]` plus 2 bits of `qh`, a sign byte in `qs[32..]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ2_S {
    pub d: f16,
    pub qs: [u8; 64],
    pub qh: [u8; 8],
    pub scales: [u8; 8],
}

const _: () = assert!(size_of::<BlockIQ2_XXS>() == 66);
const _: () = assert!(size_of::<BlockIQ2_XS>() == 74);
const _: () = assert!(size_of::<BlockIQ2_S>() == 82);

/// ggml's `ksigns_iq2xs`: 7 stored sign bits plus an eighth making the count of minus signs even.
pub(crate) fn ksigns(i: u32) -> u8 {
    let i = (i & 127) as u8;
    i | ((i.count_ones() as u8 & 1) << 7)
}

pub(crate) fn word(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Writes `grid` bytes (the first `out.len()`), negated where `signs` has bit `shift + j`.
pub(crate) fn signed(grid: &[u8], signs: u8, shift: usize, out: &mut [i8]) {
    for (j, (o, &g)) in out.iter_mut().zip(grid).enumerate() {
        *o = if signs >> (shift + j) & 1 != 0 { -(g as i8) } else { g as i8 };
    }
}

/// ggml's IQ2 sub-scale: d * (0.5 + s) * 0.25 (IQ3_XXS: * 0.5), in that order.
pub(crate) fn half_step_scale(d: f32, s: u32, mul: f32) -> f32 {
    d * (0.5 + s as f32) * mul
}

impl QuantBlock for BlockIQ2_XXS {
    const N: usize = 256;
    const GROUP: usize = 32;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        let d = f32_of(self.d);
        for ib in 0..8 {
            let (idx, aux) = (&self.qs[8 * ib..8 * ib + 4], word(&self.qs, 8 * ib + 4));
            u.scale[ib] = half_step_scale(d, aux >> 28, 0.25);
            for l in 0..4 {
                let grid = IQ2XXS_GRID[usize::from(idx[l])].to_le_bytes();
                signed(&grid, ksigns(aux >> (7 * l)), 0, &mut u.codes[32 * ib + 8 * l..][..8]);
            }
        }
    }

    /// Per 32 values: the 4 grid indices in one word; 4 x 7 sign bits and the 4-bit scale
    /// in the next.
    fn quantize(x: &[f32]) -> Self {
        let mut block = BlockIQ2_XXS::zeroed();
        let sigma2 = x.iter().fold(0f32, |sum, &v| sum + v * v) / 256.0;
        let fits: [Option<GroupFit<4>>; 8] = std::array::from_fn(|ib| fit_iq2_xxs_group(&x[32 * ib..32 * ib + 32], sigma2));
        let max_scale = fits.iter().flatten().fold(0f32, |m, f| c_max(m, f.scale));
        if max_scale == 0.0 {
            return block;
        }
        let d = max_scale / 31.0;
        block.d = f16_of(d);
        let id = 1.0 / d;
        let scales = scales_of(&fits);
        for (ib, fit) in fits.iter().enumerate() {
            let (mut indices, mut aux) = (0u32, u32::from(scale_code(id, scales[ib])) << 28);
            if let Some(fit) = fit {
                indices = fit.grid.iter().enumerate().fold(0, |a, (k, &g)| a | u32::from(g) << (8 * k));
                aux |= fit.signs.iter().enumerate().fold(0, |a, (k, &s)| a | u32::from(s) << (7 * k));
            }
            block.qs[8 * ib..8 * ib + 4].copy_from_slice(&indices.to_le_bytes());
            block.qs[8 * ib + 4..8 * ib + 8].copy_from_slice(&aux.to_le_bytes());
        }
        block
    }
}

/// The fits of a super-block's 16 groups of 16 and the largest scale.
fn fit_pairs(x: &[f32], weights: Iq2Weights) -> ([Option<GroupFit<2>>; 16], f32) {
    let sumx2 = x.iter().fold(0f32, |sum, &v| sum + v * v);
    let fits: [Option<GroupFit<2>>; 16] = std::array::from_fn(|ib| fit_iq2_pair_group(&x[16 * ib..16 * ib + 16], sumx2, weights));
    let max_scale = fits.iter().flatten().fold(0f32, |m, f| c_max(m, f.scale));
    (fits, max_scale)
}

/// The 4-bit scale codes of 16 groups at inverse super-scale `id`, two a byte (low nibble first).
fn scale_nibbles(fits: &[Option<GroupFit<2>>; 16], id: f32) -> [u8; 8] {
    let code = |ib: usize| scale_code(id, fits[ib].as_ref().map_or(0.0, |f| f.scale));
    std::array::from_fn(|j| code(2 * j) | code(2 * j + 1) << 4)
}

impl QuantBlock for BlockIQ2_XS {
    const N: usize = 256;
    const GROUP: usize = 16;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        let d = f32_of(self.d);
        for ib in 0..8 {
            let sc = u32::from(self.scales[ib]);
            u.scale[2 * ib] = half_step_scale(d, sc & 0xf, 0.25);
            u.scale[2 * ib + 1] = half_step_scale(d, sc >> 4, 0.25);
            for l in 0..4 {
                let at = 2 * (4 * ib + l);
                let q = u32::from(u16::from_le_bytes([self.qs[at], self.qs[at + 1]]));
                let grid = IQ2XS_GRID[(q & 511) as usize].to_le_bytes();
                signed(&grid, ksigns(q >> 9), 0, &mut u.codes[32 * ib + 8 * l..][..8]);
            }
        }
    }
    /// Per 8 values a u16: the grid index and 7 sign bits above it.
    fn quantize(x: &[f32]) -> Self {
        let mut block = BlockIQ2_XS::zeroed();
        let (fits, max_scale) = fit_pairs(x, Iq2Weights::UnitImportance);
        if max_scale == 0.0 {
            return block;
        }
        for (ib, fit) in fits.iter().enumerate() {
            let Some(fit) = fit else { continue };
            for k in 0..2 {
                let q = fit.grid[k] | u16::from(fit.signs[k]) << 9;
                block.qs[2 * (2 * ib + k)..][..2].copy_from_slice(&q.to_le_bytes());
            }
        }
        let d = max_scale / 31.0;
        block.d = f16_of(d);
        block.scales = scale_nibbles(&fits, 1.0 / d);
        block
    }
}

impl QuantBlock for BlockIQ2_S {
    const N: usize = 256;
    const GROUP: usize = 16;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        let d = f32_of(self.d);
        for ib in 0..8 {
            let sc = u32::from(self.scales[ib]);
            u.scale[2 * ib] = half_step_scale(d, sc & 0xf, 0.25);
            u.scale[2 * ib + 1] = half_step_scale(d, sc >> 4, 0.25);
            let qh = u32::from(self.qh[ib]);
            for l in 0..4 {
                let idx = u32::from(self.qs[4 * ib + l]) | ((qh << (8 - 2 * l)) & 0x300);
                let grid = IQ2S_GRID[idx as usize].to_le_bytes();
                signed(&grid, self.qs[32 + 4 * ib + l], 0, &mut u.codes[32 * ib + 8 * l..][..8]);
            }
        }
    }
    /// Per 8 values: the grid index's low byte in `qs[..32]`, its 2 high bits in `qh`, the
    /// sign byte in `qs[32..]`.
    fn quantize(x: &[f32]) -> Self {
        let mut block = BlockIQ2_S::zeroed();
        let (fits, max_scale) = fit_pairs(x, Iq2Weights::Plain);
        for (ib, fit) in fits.iter().enumerate() {
            let Some(fit) = fit else { continue };
            for k in 0..2 {
                let (octet, grid) = (2 * ib + k, fit.grid[k]);
                block.qs[octet] = grid as u8;
                block.qh[octet / 4] |= ((grid >> 8) as u8) << (2 * (octet % 4));
                block.qs[32 + octet] = fit.signs[k];
            }
        }
        if max_scale == 0.0 {
            return block;
        }
        let d = max_scale / 31.0;
        // ggml's fudge factor on the stored scale.
        block.d = f16_of(d * 0.9875);
        block.scales = scale_nibbles(&fits, 1.0 / d);
        block
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spot values of ggml-common.h's tables (`iq2xxs_grid`, `ksigns_iq2xs`), against the
    /// grids generated from gguf-py's compact copy.
    #[test]
    fn tables_match_ggml_spot_values() {
        let head = [0x0808080808080808u64, 0x080808080808082b, 0x0808080808081919, 0x0808080808082b08, 0x0808080808082b2b, 0x0808080808190819];
        assert_eq!(IQ2XXS_GRID[..6], head);
        let ksigns_head = [0u8, 129, 130, 3, 132, 5, 6, 135, 136, 9, 10, 139, 12, 141, 142, 15];
        assert_eq!((0..16).map(ksigns).collect::<Vec<_>>(), ksigns_head);
        assert_eq!(ksigns(127), 255);
        // Every grid byte is one of the format's levels.
        let levels2 = [8u8, 25, 43];
        for grid in [&IQ2XXS_GRID[..], &IQ2XS_GRID[..], &IQ2S_GRID[..]] {
            assert!(grid.iter().flat_map(|w| w.to_le_bytes()).all(|b| levels2.contains(&b)));
        }
    }
}
