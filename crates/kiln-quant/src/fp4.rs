//! The 4-bit float formats: MXFP4 (gpt-oss; 32 E2M1 values sharing an E8M0 power of
//! two) and NVFP4 (64 values in four 16-value groups, each with an unsigned E4M3 scale).
//!
//! Codes index the E2M1 values doubled (so they are integers); the scales carry the
//! compensating factor 1/2, as ggml's `GGML_E8M0_TO_FP32_HALF` and `ggml_ue4m3_to_fp32` do.

use crate::block::{QuantBlock, Unpacked};
use bytemuck::{Pod, Zeroable};

/// Twice the E2M1 values, by 4-bit code (sign in bit 3); ggml's `kvalues_mxfp4`.
pub const E2M1_X2: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// value j = E2M1_X2[code j] * 2^(e - 128); codes packed as in Q4_0 (j low, j+16 high nibble).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockMXFP4 {
    pub e: u8,
    pub qs: [u8; 16],
}

/// Group g of 16: value = E2M1_X2[code] * ue4m3(d[g]) / 2, codes of group g in
/// `qs[8g..8g+8]` (value i low, i+8 high nibble).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockNVFP4 {
    pub d: [u8; 4],
    pub qs: [u8; 32],
}

const _: () = assert!(size_of::<BlockMXFP4>() == 17);
const _: () = assert!(size_of::<BlockNVFP4>() == 36);

/// 2^(e - 128) for an E8M0 exponent byte, exactly (subnormal for e < 2).
pub fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { u32::from(e - 1) << 23 };
    f32::from_bits(bits)
}

/// Half the value of an unsigned E4M3 byte (bias 7; bit 7 ignored; 0x7f reads as zero).
pub fn ue4m3_half(x: u8) -> f32 {
    if x == 0 || x == 0x7f {
        return 0.0;
    }
    let (exp, man) = (i32::from((x >> 3) & 0xf), f32::from(x & 7));
    // Both branches are exact: at most 4 significant bits times a power of two.
    let raw = if exp == 0 { man * 2f32.powi(-9) } else { (1.0 + man / 8.0) * 2f32.powi(exp - 7) };
    raw * 0.5
}

/// ggml's f32 -> unsigned E4M3: clamps to 448, rounds half up on the fourth mantissa
/// bit, saturates at 0x7e; non-positive and NaN inputs give 0.
pub fn ue4m3_of(x: f32) -> u8 {
    if x.is_nan() || x <= 0.0 {
        return 0;
    }
    let x = x.min(448.0);
    let bits = x.to_bits();
    let exp = ((bits >> 23) & 0xff) as i32 - 127 + 7;
    if exp <= 0 {
        let man = ((x * 512.0 + 0.5) as i32).min(7);
        return if man < 1 { 0 } else { man as u8 };
    }
    if exp >= 15 {
        return 0x7e;
    }
    let man = ((bits >> 20) & 7) as i32 + ((bits >> 19) & 1) as i32;
    let (exp, man) = if man > 7 { (exp + 1, 0) } else { (exp, man) };
    if exp >= 15 {
        return 0x7e;
    }
    ((exp << 3) | man) as u8
}

fn e2m1(q: u8) -> i8 {
    E2M1_X2[usize::from(q & 0xf)]
}

/// ggml's `best_index_mxfp4`: the first code of least |value*d - x|.
fn best_code(x: f32, d: f32) -> u8 {
    let mut best = (0u8, (f32::from(E2M1_X2[0]) * d - x).abs());
    for (i, &v) in E2M1_X2.iter().enumerate().skip(1) {
        let err = (f32::from(v) * d - x).abs();
        if err < best.1 {
            best = (i as u8, err);
        }
    }
    best.0
}

fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |m, v| if m < v.abs() { v.abs() } else { m })
}

impl QuantBlock for BlockMXFP4 {
    const N: usize = 32;
    const GROUP: usize = 32;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        crate::block::unpack_nibbles(&self.qs, &mut u.codes, e2m1);
        u.scale[0] = e8m0_half(self.e);
    }

    /// ggml: e = floor(log2(max|x|)) - 2 + 127 (so max|x| lands in the top binade of
    /// E2M1 at 4..8 times 2^(e-127)), then the nearest value for each element.
    fn quantize(x: &[f32]) -> Self {
        let a = amax(x);
        // Through i32 as x86 converts it, for the (out of E8M0 range) tiny and huge amax.
        let e = if a > 0.0 { (a.log2().floor() - 2.0 + 127.0) as i32 as u8 } else { 0 };
        let d = e8m0_half(e);
        let qs = std::array::from_fn(|j| best_code(x[j], d) | best_code(x[j + 16], d) << 4);
        BlockMXFP4 { e, qs }
    }
}

impl QuantBlock for BlockNVFP4 {
    const N: usize = 64;
    const GROUP: usize = 16;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        for (g, (qs, out)) in self.qs.chunks_exact(8).zip(u.codes.chunks_exact_mut(16)).enumerate() {
            for (i, &b) in qs.iter().enumerate() {
                out[i] = e2m1(b & 0xf);
                out[i + 8] = e2m1(b >> 4);
            }
            u.scale[g] = ue4m3_half(self.d[g]);
        }
    }

    /// ggml: per 16 values, scale byte = ue4m3(max|x| / 6), then nearest codes against
    /// the decoded scale.
    fn quantize(x: &[f32]) -> Self {
        let mut block = BlockNVFP4 { d: [0; 4], qs: [0; 32] };
        for (g, xg) in x.chunks_exact(16).enumerate() {
            let ue = ue4m3_of(amax(xg) / 6.0);
            block.d[g] = ue;
            let d = ue4m3_half(ue);
            for i in 0..8 {
                block.qs[8 * g + i] = best_code(xg[i], d) | best_code(xg[i + 8], d) << 4;
            }
        }
        block
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ue4m3_encoder_recovers_every_finite_code() {
        // ggml's encoder stops at exponent 14, then saturates to 0x7e (448).
        for b in (1..0x78u8).chain([0x7e]) {
            let v = 2.0 * ue4m3_half(b);
            assert_eq!(ue4m3_of(v), b, "{b:#04x} = {v}");
        }
        assert_eq!((ue4m3_of(0.0), ue4m3_of(-1.0), ue4m3_of(f32::NAN), ue4m3_of(300.0), ue4m3_of(1e9)), (0, 0, 0, 0x7e, 0x7e));
        assert_eq!(ue4m3_half(0x7f), 0.0);
        for b in (1..0x7fu8).filter(|&b| b != 0x7f) {
            assert_eq!(ue4m3_half(b | 0x80), ue4m3_half(b), "bit 7 is ignored: {b:#04x}");
        }
    }

    #[test]
    fn e8m0_is_a_power_of_two() {
        for e in 0..=255u8 {
            assert_eq!(e8m0_half(e), 2f64.powi(i32::from(e) - 128) as f32, "{e}");
        }
    }
}
