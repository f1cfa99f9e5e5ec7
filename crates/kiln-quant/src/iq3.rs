//! The 3-bit codebook formats IQ3_XXS and IQ3_S: 256-value super-blocks, 4 values per
//! grid entry (8 levels), 4-bit scales per 32 values. The quantizers are ggml's
//! (`quantize_row_iq3_xxs_ref`, `quantize_iq3_s`) without an importance matrix, byte
//! for byte; the per-group search is in `iq_search`.

use crate::block::{f16_of, f32_of, QuantBlock, Unpacked};
use crate::iq2::{half_step_scale, ksigns, signed, word};
use crate::iq_grids::{IQ3S_GRID, IQ3XXS_GRID};
use crate::iq_search::{c_max, fit_group, scale_code, GroupFit, Variant, IQ3_S, IQ3_XXS};
use bytemuck::{Pod, Zeroable};
use half::f16;

/// Per 32 values: 8 grid bytes in `qs[..64]`, and in `qs[64..]` a word of four 7-bit
/// sign indices and a 4-bit scale.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ3_XXS {
    pub d: f16,
    pub qs: [u8; 96],
}

/// Per 4 values a 9-bit grid index (a `qs` byte plus a `qh` bit); explicit sign bits;
/// 4-bit odd scales per 32 values.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ3_S {
    pub d: f16,
    pub qs: [u8; 64],
    pub qh: [u8; 8],
    pub signs: [u8; 32],
    pub scales: [u8; 4],
}

const _: () = assert!(size_of::<BlockIQ3_XXS>() == 98);
const _: () = assert!(size_of::<BlockIQ3_S>() == 110);

/// The fits of a super-block's 8 groups and the largest scale (ggml's `MAX` chain over
/// the groups it did not store as zeros).
fn fit_groups(x: &[f32], variant: &Variant) -> ([Option<GroupFit<8>>; 8], f32) {
    let fits: [Option<GroupFit<8>>; 8] = std::array::from_fn(|ib| fit_group(variant, &x[32 * ib..32 * ib + 32]));
    let max_scale = fits.iter().flatten().fold(0f32, |m, f| c_max(m, f.scale));
    (fits, max_scale)
}

/// The group scales of a super-block: 0 for groups stored as zeros.
pub(crate) fn scales_of<const P: usize>(fits: &[Option<GroupFit<P>>; 8]) -> [f32; 8] {
    std::array::from_fn(|ib| fits[ib].as_ref().map_or(0.0, |f| f.scale))
}

impl QuantBlock for BlockIQ3_XXS {
    const N: usize = 256;
    const GROUP: usize = 32;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        let d = f32_of(self.d);
        for ib in 0..8 {
            let aux = word(&self.qs, 64 + 4 * ib);
            u.scale[ib] = half_step_scale(d, aux >> 28, 0.5);
            for l in 0..4 {
                let signs = ksigns(aux >> (7 * l));
                let out = &mut u.codes[32 * ib + 8 * l..][..8];
                for (h, out_h) in out.chunks_exact_mut(4).enumerate() {
                    let grid = IQ3XXS_GRID[usize::from(self.qs[8 * ib + 2 * l + h])].to_le_bytes();
                    signed(&grid, signs, 4 * h, out_h);
                }
            }
        }
    }

    fn quantize(x: &[f32]) -> Self {
        let mut block = BlockIQ3_XXS::zeroed();
        let (fits, max_scale) = fit_groups(x, &IQ3_XXS);
        if max_scale == 0.0 {
            return block;
        }
        let d = max_scale / 31.0;
        // ggml's fudge factor on the stored scale.
        block.d = f16_of(d * 1.0125);
        let id = 1.0 / d;
        let scales = scales_of(&fits);
        for (ib, fit) in fits.iter().enumerate() {
            let mut aux = u32::from(scale_code(id, scales[ib])) << 28;
            if let Some(fit) = fit {
                for (q, &g) in block.qs[8 * ib..8 * ib + 8].iter_mut().zip(&fit.grid) {
                    *q = g as u8;
                }
                aux |= fit.signs.iter().enumerate().fold(0, |a, (k, &s)| a | u32::from(s) << (7 * k));
            }
            block.qs[64 + 4 * ib..68 + 4 * ib].copy_from_slice(&aux.to_le_bytes());
        }
        block
    }
}

impl QuantBlock for BlockIQ3_S {
    const N: usize = 256;
    const GROUP: usize = 32;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        let d = f32_of(self.d);
        for ib in 0..8 {
            let sc = (self.scales[ib / 2] >> (4 * (ib % 2))) & 0xf;
            u.scale[ib] = d * f32::from(1 + 2 * sc);
            let qh = u32::from(self.qh[ib]);
            for l in 0..4 {
                let signs = self.signs[4 * ib + l];
                let out = &mut u.codes[32 * ib + 8 * l..][..8];
                for (h, out_h) in out.chunks_exact_mut(4).enumerate() {
                    let high = (qh << (8 - 2 * l - h)) & 256;
                    let idx = u32::from(self.qs[8 * ib + 2 * l + h]) | high;
                    signed(&IQ3S_GRID[idx as usize].to_le_bytes(), signs, 4 * h, out_h);
                }
            }
        }
    }

    fn quantize(x: &[f32]) -> Self {
        let mut block = BlockIQ3_S::zeroed();
        let (fits, max_scale) = fit_groups(x, &IQ3_S);
        // ggml moves its qs/signs cursor past stored groups only, so a group after an
        // all-zero one lands in the zero group's slots (qh is indexed by group). Kept
        // for byte identity; it only matters for exactly-zero groups.
        let mut slot = 0;
        for (ib, fit) in fits.iter().enumerate() {
            let Some(fit) = fit else { continue };
            for (k, &g) in fit.grid.iter().enumerate() {
                block.qs[8 * slot + k] = g as u8;
                block.qh[ib] |= ((g >> 8) as u8) << k;
            }
            block.signs[4 * slot..4 * slot + 4].copy_from_slice(&fit.signs);
            slot += 1;
        }
        if max_scale == 0.0 {
            return block;
        }
        let d = max_scale / 31.0;
        // ggml's fudge factor on the stored scale.
        block.d = f16_of(d * 1.033);
        let id = 1.0 / d;
        let scales = scales_of(&fits);
        for (pair, out) in scales.chunks_exact(2).zip(&mut block.scales) {
            *out = scale_code(id, pair[0]) | scale_code(id, pair[1]) << 4;
        }
        block
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_bytes_are_the_format_levels() {
        assert!(IQ3XXS_GRID.iter().flat_map(|w| w.to_le_bytes()).all(|b| [4u8, 12, 20, 28, 36, 44, 52, 62].contains(&b)));
        assert!(IQ3S_GRID.iter().flat_map(|w| w.to_le_bytes()).all(|b| b % 2 == 1 && b <= 15));
    }

    /// A group of zeros before a non-zero one: ggml writes the second group's grid bytes
    /// and signs into the first group's slots, its high index bits in its own.
    #[test]
    fn iq3_s_zero_group_shifts_the_following_groups() {
        let mut x = [0f32; 256];
        for (i, v) in x.iter_mut().enumerate().skip(32) {
            *v = ((i * 37) % 17) as f32 - 8.0;
        }
        let b = BlockIQ3_S::quantize(&x);
        let fit = fit_group(&IQ3_S, &x[32..64]).unwrap();
        assert_eq!(b.qs[..8], fit.grid.map(|g| g as u8));
        assert_eq!(b.signs[..4], fit.signs);
        assert_eq!(b.qh[0], 0);
        assert_eq!(b.qh[1], fit.grid.iter().enumerate().fold(0, |a, (k, &g)| a | ((g >> 8) as u8) << k));
    }
}
