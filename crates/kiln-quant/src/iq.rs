//! The non-linear 4-bit formats IQ4_NL (32-element blocks) and IQ4_XS (256-element
//! super-blocks of eight IQ4_NL-like groups with 6-bit scales).

use crate::block::{abs_max, f16_of, f32_of, nearest_int, pack_nibbles, unpack_nibbles, QuantBlock, Unpacked};
use bytemuck::{Pod, Zeroable};
use half::f16;

/// The 16 IQ4_NL levels (ggml's `kvalues_iq4nl`); a 4-bit code indexes this table.
pub const IQ4_NL_CODEBOOK: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// value = d * IQ4_NL_CODEBOOK[q], nibbles packed as in Q4_0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ4_NL {
    pub d: f16,
    pub qs: [u8; 16],
}

/// Group g of 32: value = d * (ls_g - 32) * IQ4_NL_CODEBOOK[q], with the 6-bit ls_g split
/// into a nibble of `scales_l` and two bits of `scales_h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ4_XS {
    pub d: f16,
    pub scales_h: u16,
    pub scales_l: [u8; 4],
    pub qs: [u8; 128],
}

const _: () = assert!(size_of::<BlockIQ4_NL>() == 18);
const _: () = assert!(size_of::<BlockIQ4_XS>() == 136);

/// Trial scales each side of the first fit, as llama-quantize runs ggml's search (ntry = 7).
const NTRY: i32 = 7;
const GROUP_MAX_EPS: f32 = 1e-15;

fn codebook_value(q: u8) -> i8 {
    IQ4_NL_CODEBOOK[usize::from(q & 0xf)]
}

/// Index of the codebook entry nearest to `x` (ties to the upper entry), by bisection.
fn nearest_code(x: f32) -> u8 {
    let v = |i: usize| f32::from(IQ4_NL_CODEBOOK[i]);
    if x <= v(0) {
        return 0;
    }
    if x >= v(15) {
        return 15;
    }
    let (mut lo, mut hi) = (0, 15);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if x < v(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    if x - v(hi - 1) < v(hi) - x {
        (hi - 1) as u8
    } else {
        hi as u8
    }
}

/// ggml's per-32 scale search (x²-weighted least squares over 2*NTRY+1 trial scales).
/// Returns 0 for an all-zero group.
fn fit_group_scale(x: &[f32]) -> f32 {
    let (amax, max) = abs_max(x);
    if amax < GROUP_MAX_EPS {
        return 0.0;
    }
    let fit = |id: f32| {
        let (mut sumqx, mut sumq2) = (0f32, 0f32);
        for &v in x {
            let (q, w) = (f32::from(codebook_value(nearest_code(id * v))), v * v);
            sumqx += w * q * v;
            sumq2 += w * q * q;
        }
        (sumqx, sumq2)
    };
    let first = f32::from(IQ4_NL_CODEBOOK[0]);
    let (sumqx, sumq2) = fit(1.0 / (-max / first));
    let mut d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    let mut best = d * sumqx;
    for itry in -NTRY..=NTRY {
        let (sumqx, sumq2) = fit((itry + i32::from(IQ4_NL_CODEBOOK[0])) as f32 / max);
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    d
}

/// Codes of `x` for the (float) scale `d`.
fn codes_for(x: &[f32], d: f32) -> [u8; 32] {
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    std::array::from_fn(|j| nearest_code(id * x[j]))
}

impl QuantBlock for BlockIQ4_NL {
    const N: usize = 32;
    const GROUP: usize = 32;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        unpack_nibbles(&self.qs, &mut u.codes, codebook_value);
        u.scale[0] = f32_of(self.d);
    }

    fn quantize(x: &[f32]) -> Self {
        let d = fit_group_scale(x);
        BlockIQ4_NL { d: f16_of(d), qs: pack_nibbles(&codes_for(x, d)) }
    }
}

impl QuantBlock for BlockIQ4_XS {
    const N: usize = 256;
    const GROUP: usize = 32;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        let d = f32_of(self.d);
        for (g, s) in u.scale[..8].iter_mut().enumerate() {
            let low = (self.scales_l[g / 2] >> (4 * (g % 2))) & 0xf;
            let high = ((self.scales_h >> (2 * g)) & 3) as u8;
            *s = d * f32::from((low | high << 4) as i8 - 32);
        }
        for (qs, out) in self.qs.chunks_exact(16).zip(u.codes.chunks_exact_mut(32)) {
            unpack_nibbles(qs, out, codebook_value);
        }
    }

    /// ggml's `quantize_iq4_xs` without importance weights: per-group scales from the
    /// search, quantized to 6 bits against d = -max/32, then codes for the rounded scales.
    fn quantize(x: &[f32]) -> Self {
        let scales: [f32; 8] = std::array::from_fn(|g| fit_group_scale(&x[32 * g..32 * g + 32]));
        let (mut amax_scale, mut max_scale) = (0f32, 0f32);
        for &s in &scales {
            if s.abs() > amax_scale {
                amax_scale = s.abs();
                max_scale = s;
            }
        }
        let d = -max_scale / 32.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut block = BlockIQ4_XS { d: f16_of(d), scales_h: 0, scales_l: [0; 4], qs: [0; 128] };
        for (g, &s) in scales.iter().enumerate() {
            let l = nearest_int(id * s).clamp(-32, 31);
            let xg = &x[32 * g..32 * g + 32];
            block.qs[16 * g..16 * g + 16].copy_from_slice(&pack_nibbles(&codes_for(xg, d * l as f32)));
            let l = (l + 32) as u8;
            block.scales_l[g / 2] |= (l & 0xf) << (4 * (g % 2));
            block.scales_h |= u16::from(l >> 4) << (2 * g);
        }
        block
    }
}
