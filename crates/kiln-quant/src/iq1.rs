//! The 1.5-bit codebook formats IQ1_S and IQ1_M: 8 values per grid entry with levels
//! {-1, 0, 1}, shifted by a shared delta of +-1/8 and scaled by an odd 3-bit multiple
//! of the super-block scale. Codes hold 8 * (grid + delta), an odd integer in -9..=9,
//! and the scale dl / 8: the product rounds once, exactly as ggml's dl * (grid + delta).
//! Both also encode, byte for byte as ggml: IQ1_M as ggml does without an importance matrix,
//! IQ1_S (which ggml only quantizes with one) given an importance matrix of ones; the
//! searches are in `iq1_search`. llama-quantize refuses both without an importance matrix;
//! kiln uses them for random-weight benchmark files.

use crate::block::{f16_of, f32_of, nearest_int, QuantBlock, Unpacked};
use crate::iq1_search::{fit_iq1_m_group, fit_iq1_s_group, iq1_m_super_scale, Iq1Fit};
use crate::iq_grids::IQ1S_GRID;
use crate::iq_search::c_max;
use bytemuck::{Pod, Zeroable};
use half::f16;

/// Per 32 values: 4 grid bytes in `qs` and a u16 `qh` (3 high index bits per 8 values,
/// a 3-bit scale, the delta's sign in bit 15).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ1_S {
    pub d: f16,
    pub qs: [u8; 32],
    pub qh: [u8; 16],
}

/// Per 8 values a grid byte in `qs` and a nibble of `qh` (3 high index bits, delta sign);
/// four u16 `scales` words hold 3-bit scales per 16 values in their low 12 bits and
/// the f16 super-block scale spread over their top nibbles.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ1_M {
    pub qs: [u8; 32],
    pub qh: [u8; 16],
    pub scales: [u8; 8],
}

const _: () = assert!(size_of::<BlockIQ1_S>() == 50);
const _: () = assert!(size_of::<BlockIQ1_M>() == 56);

/// 8 * (grid value + delta) for grid entry `idx`, negative delta if `neg`.
fn shifted_grid(idx: u32, neg: bool, out: &mut [i8]) {
    let grid = IQ1S_GRID[idx as usize].to_le_bytes();
    let delta = if neg { -1 } else { 1 };
    for (o, &g) in out.iter_mut().zip(&grid) {
        *o = 8 * (g as i8) + delta;
    }
}

impl QuantBlock for BlockIQ1_S {
    const N: usize = 256;
    const GROUP: usize = 32;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        let d = f32_of(self.d);
        for ib in 0..8 {
            let qh = u32::from(u16::from_le_bytes([self.qh[2 * ib], self.qh[2 * ib + 1]]));
            let dl = d * (2 * ((qh >> 12) & 7) + 1) as f32;
            u.scale[ib] = dl * 0.125;
            for l in 0..4 {
                let idx = u32::from(self.qs[4 * ib + l]) | (((qh >> (3 * l)) & 7) << 8);
                shifted_grid(idx, qh & 0x8000 != 0, &mut u.codes[32 * ib + 8 * l..][..8]);
            }
        }
    }
    fn quantize(x: &[f32]) -> Self {
        BlockIQ1_S::encode(x)
    }
}

impl BlockIQ1_M {
    fn scale_words(&self) -> [u32; 4] {
        std::array::from_fn(|i| u32::from(u16::from_le_bytes([self.scales[2 * i], self.scales[2 * i + 1]])))
    }

    /// The f16 super-block scale, reassembled from the words' top nibbles.
    pub fn d(&self) -> f16 {
        let sc = self.scale_words();
        let bits = (sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000);
        f16::from_bits(bits as u16)
    }
}

impl QuantBlock for BlockIQ1_M {
    const N: usize = 256;
    const GROUP: usize = 16;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        let d = f32_of(self.d());
        let sc = self.scale_words();
        for ib in 0..8 {
            for half in 0..2 {
                let s = (sc[ib / 2] >> (6 * (ib % 2) + 3 * half)) & 7;
                u.scale[2 * ib + half] = d * (2 * s + 1) as f32 * 0.125;
            }
            for l in 0..4 {
                let qh = u32::from(self.qh[2 * ib + l / 2]) >> (4 * (l % 2));
                let idx = u32::from(self.qs[4 * ib + l]) | ((qh & 7) << 8);
                shifted_grid(idx, qh & 8 != 0, &mut u.codes[32 * ib + 8 * l..][..8]);
            }
        }
    }
    fn quantize(x: &[f32]) -> Self {
        BlockIQ1_M::encode(x)
    }
}

impl BlockIQ1_S {
    /// Encodes 256 values as ggml's `quantize_iq1_s` does given an importance matrix of ones.
    fn encode(x: &[f32]) -> Self {
        let mut block = BlockIQ1_S::zeroed();
        let sumx2 = x.iter().fold(0f32, |sum, &v| sum + v * v);
        let fits: [Option<Iq1Fit<4>>; 8] = std::array::from_fn(|ib| fit_iq1_s_group(&x[32 * ib..32 * ib + 32], sumx2));
        let mut qh = [0u16; 8];
        for (ib, fit) in fits.iter().enumerate() {
            let Some(fit) = fit else { continue };
            for (k, &g) in fit.grid.iter().enumerate() {
                block.qs[4 * ib + k] = g as u8;
                qh[ib] |= (g >> 8) << (3 * k);
            }
        }
        let max_scale = fits.iter().flatten().fold(0f32, |m, f| c_max(m, f.scale));
        if max_scale != 0.0 {
            let d = max_scale / 15.0;
            // ggml's fudge factor on the stored scale.
            block.d = f16_of(d * 1.125);
            let id = 1.0 / d;
            for (ib, fit) in fits.iter().enumerate() {
                let scale = fit.as_ref().map_or(0.0, |f| f.scale);
                let minus = fit.as_ref().is_some_and(|f| f.minus != 0);
                qh[ib] |= (u16::from(odd_multiple_code(id, scale)) | u16::from(minus) << 3) << 12;
            }
        }
        for (out, word) in block.qh.chunks_exact_mut(2).zip(qh) {
            out.copy_from_slice(&word.to_le_bytes());
        }
        block
    }
}

impl BlockIQ1_M {
    /// Encodes 256 values as ggml's `quantize_iq1_m` does without an importance matrix.
    fn encode(x: &[f32]) -> Self {
        let mut block = BlockIQ1_M::zeroed();
        let fits: [Option<Iq1Fit<2>>; 16] = std::array::from_fn(|ib| fit_iq1_m_group(&x[16 * ib..16 * ib + 16]));
        let (mut grids, mut minus) = ([[0u16; 2]; 16], [0u8; 16]);
        for (ib, fit) in fits.iter().enumerate() {
            let Some(fit) = fit else { continue };
            (grids[ib], minus[ib]) = (fit.grid, fit.minus);
            block.qs[2 * ib] = fit.grid[0] as u8;
            block.qs[2 * ib + 1] = fit.grid[1] as u8;
            block.qh[ib] = (fit.grid[0] >> 8) as u8 | ((fit.grid[1] >> 8) as u8) << 4;
        }
        let max_scale = fits.iter().flatten().fold(0f32, |m, f| c_max(m, f.scale));
        if max_scale == 0.0 {
            return block;
        }
        let d = max_scale / 15.0;
        let id = 1.0 / d;
        let codes: [u8; 16] = std::array::from_fn(|ib| odd_multiple_code(id, fits[ib].as_ref().map_or(0.0, |f| f.scale)));
        let mut words = [0u16; 4];
        for ib in 0..16 {
            words[ib / 4] |= u16::from(codes[ib]) << (3 * (ib % 4));
            // The delta signs: bit 3 for the first 8 values, bit 7 for the second.
            block.qh[ib] |= (minus[ib] & 1) << 3 | (minus[ib] >> 1 & 1) << 7;
        }
        let d = iq1_m_super_scale(x, &grids, &minus, &codes).unwrap_or(d);
        // ggml's fudge factor on the stored scale, whose bits go to the words' top nibbles.
        let bits = f16_of(d * 1.1125).to_bits();
        for (i, word) in words.iter_mut().enumerate() {
            *word |= (bits >> (4 * i) & 0xf) << 12;
            block.scales[2 * i..2 * i + 2].copy_from_slice(&word.to_le_bytes());
        }
        block
    }
}

/// ggml's 3-bit group scale: nearest_int((scale / d - 1) / 2) in 0..=7 (the group's
/// multiple of d is 2 code + 1).
fn odd_multiple_code(id: f32, scale: f32) -> u8 {
    nearest_int(0.5 * (id * scale - 1.0)).clamp(0, 7) as u8
}
