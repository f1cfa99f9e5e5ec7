//! The 1.5-bit codebook formats IQ1_S and IQ1_M: 8 values per grid entry with levels
//! {-1, 0, 1}, shifted by a shared delta of +-1/8 and scaled by an odd 3-bit multiple
//! of the super-block scale. Codes hold 8 * (grid + delta), an odd integer in -9..=9,
//! and the scale dl / 8: the product rounds once, exactly as ggml's dl * (grid + delta).
//! Decode only: llama-quantize needs an importance matrix for both.

use crate::block::{f32_of, DecodeBlock, Unpacked};
use crate::iq_grids::IQ1S_GRID;
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

impl DecodeBlock for BlockIQ1_S {
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

impl DecodeBlock for BlockIQ1_M {
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
}
