//! MXFP4 (OCP microscaling FP4, gpt-oss's expert format): blocks of 32 E2M1 values sharing
//! one E8M0 power-of-two scale.

use crate::block::{abs_max, pack_nibbles, unpack_nibbles, QuantBlock, Unpacked};
use bytemuck::{Pod, Zeroable};

/// The E2M1 values doubled (ggml's `kvalues_mxfp4`), so that with the scale halved
/// (`2^(e-128)`) every value is a small integer times a power of two.
pub const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// value = MXFP4_VALUES[q] * 2^(e-128); byte `j` of `qs` holds element `j` (low nibble) and
/// element `j + 16` (high nibble).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockMXFP4 {
    pub e: u8,
    pub qs: [u8; 16],
}

const _: () = assert!(size_of::<BlockMXFP4>() == 17);

/// `2^(e-128)` exactly, as ggml's `ggml_e8m0_to_fp32_half` (e < 2 gives f32 subnormals).
fn half_scale(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000 << e)
    } else {
        f32::from_bits(u32::from(e - 1) << 23)
    }
}

fn value(q: u8) -> i8 {
    MXFP4_VALUES[usize::from(q & 0xf)]
}

/// The code whose value times `d` is nearest to `x`, the first on ties (ggml's `best_index_mxfp4`).
fn nearest_code(x: f32, d: f32) -> u8 {
    let mut best = 0;
    let mut best_err = (f32::from(MXFP4_VALUES[0]) * d - x).abs();
    for (i, &v) in MXFP4_VALUES.iter().enumerate().skip(1) {
        let err = (f32::from(v) * d - x).abs();
        if err < best_err {
            best = i as u8;
            best_err = err;
        }
    }
    best
}

impl QuantBlock for BlockMXFP4 {
    const N: usize = 32;
    const GROUP: usize = 32;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        unpack_nibbles(&self.qs, &mut u.codes, value);
        u.scale[0] = half_scale(self.e);
    }

    /// ggml's `quantize_row_mxfp4_ref`: e = floor(log2 amax) - 2 + 127 (0 for an all-zero block).
    fn quantize(x: &[f32]) -> Self {
        let (amax, _) = abs_max(x);
        let e = if amax > 0.0 { (amax.log2().floor() - 2.0 + 127.0).clamp(0.0, 255.0) as u8 } else { 0 };
        let d = half_scale(e);
        let codes: [u8; 32] = std::array::from_fn(|i| nearest_code(x[i], d));
        BlockMXFP4 { e, qs: pack_nibbles(&codes) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_are_exact_powers_of_two() {
        for e in 0..=255u8 {
            assert_eq!(f64::from(half_scale(e)), 2f64.powi(i32::from(e) - 128), "e = {e}");
        }
    }

    #[test]
    fn representable_blocks_round_trip_byte_for_byte() {
        // Every value a multiple of the scale by an MXFP4 code, with a 12 (the largest) among them.
        let d = half_scale(120);
        let codes: [u8; 32] = std::array::from_fn(|i| if i == 3 { 7 } else { (i * 5 % 16) as u8 });
        let x: Vec<f32> = codes.iter().map(|&q| f32::from(value(q)) * d).collect();
        let block = BlockMXFP4::quantize(&x);
        assert_eq!(block.e, 120);
        let mut u = Unpacked::new();
        block.unpack(&mut u);
        for (i, &want) in x.iter().enumerate() {
            assert_eq!(u.scale[0] * f32::from(u.codes[i]), want, "element {i}");
        }
    }
}
