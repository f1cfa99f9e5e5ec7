//! The 32-element formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1 and the 1-bit Q1_0.

use crate::block::{abs_max, f16_of, f32_of, pack_nibbles, unpack_nibbles, QuantBlock, Unpacked};
use bytemuck::{Pod, Zeroable};
use half::f16;

/// 4-bit symmetric: value = d * (q - 8).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; 16],
}

/// 4-bit with minimum: value = d * q + m.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; 16],
}

/// 5-bit symmetric: value = d * (q - 16); bit 4 of code j is bit j of `qh` (little-endian u32).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5_0 {
    pub d: f16,
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}

/// 5-bit with minimum: value = d * q + m.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}

/// 8-bit symmetric: value = d * q.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; 32],
}

/// 8-bit activation format: as Q8_0 plus `s = d * sum(q)` for offset formats' dot products.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_1 {
    pub d: f16,
    pub s: f16,
    pub qs: [i8; 32],
}

/// 1-bit, 128 elements: value j = +d if bit j of `qs` (LSB first) is set, else -d.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ1_0 {
    pub d: f16,
    pub qs: [u8; 16],
}

const _: () = assert!(size_of::<BlockQ4_0>() == 18);
const _: () = assert!(size_of::<BlockQ4_1>() == 20);
const _: () = assert!(size_of::<BlockQ5_0>() == 22);
const _: () = assert!(size_of::<BlockQ5_1>() == 24);
const _: () = assert!(size_of::<BlockQ8_0>() == 34);
const _: () = assert!(size_of::<BlockQ8_1>() == 36);
const _: () = assert!(size_of::<BlockQ1_0>() == 18);

/// ggml's symmetric 2^bits-level rounding: d = max / -(levels/2) for the signed
/// element of largest magnitude, code = min(levels-1, trunc(x/d + levels/2 + 0.5)).
fn quantize_symmetric(x: &[f32], levels: u8) -> (f16, [u8; 32]) {
    let half_levels = f32::from(levels / 2);
    let (_, max) = abs_max(x);
    let d = max / -half_levels;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let codes = std::array::from_fn(|j| ((x[j] * id + (half_levels + 0.5)) as i8).min(levels as i8 - 1) as u8);
    (f16_of(d), codes)
}

/// ggml's min/max rounding: d = (max - min) / (levels-1), code = trunc((x - min)/d + 0.5).
fn quantize_affine(x: &[f32], levels: u8) -> (f16, f16, [u8; 32]) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    let d = (max - min) / f32::from(levels - 1);
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let codes = std::array::from_fn(|j| (((x[j] - min) * id + 0.5) as u8).min(levels - 1));
    (f16_of(d), f16_of(min), codes)
}

/// Splits 5-bit codes into packed low nibbles and the 32 high bits.
fn pack_5bit(codes: &[u8; 32]) -> ([u8; 16], [u8; 4]) {
    let qh = codes.iter().enumerate().fold(0u32, |acc, (j, &c)| acc | (u32::from(c >> 4) & 1) << j);
    (pack_nibbles(codes), qh.to_le_bytes())
}

fn unpack_5bit(qs: &[u8; 16], qh: &[u8; 4], bias: i8, out: &mut [i8]) {
    unpack_nibbles(qs, out, |q| q as i8);
    let qh = u32::from_le_bytes(*qh);
    for (j, c) in out[..32].iter_mut().enumerate() {
        *c += (((qh >> j) & 1) << 4) as i8 - bias;
    }
}

/// ggml's Q8_0 rounding: d = amax/127, q = round-half-away(x/d).
fn quantize_q8(x: &[f32]) -> (f32, [i8; 32]) {
    let (amax, _) = abs_max(x);
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    (d, std::array::from_fn(|j| (x[j] * id).round() as i8))
}

impl QuantBlock for BlockQ4_0 {
    const N: usize = 32;
    const GROUP: usize = 32;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        unpack_nibbles(&self.qs, &mut u.codes, |q| q as i8 - 8);
        u.scale[0] = f32_of(self.d);
    }

    fn quantize(x: &[f32]) -> Self {
        let (d, codes) = quantize_symmetric(x, 16);
        BlockQ4_0 { d, qs: pack_nibbles(&codes) }
    }
}

impl QuantBlock for BlockQ4_1 {
    const N: usize = 32;
    const GROUP: usize = 32;
    const HAS_OFFSET: bool = true;

    fn unpack(&self, u: &mut Unpacked) {
        unpack_nibbles(&self.qs, &mut u.codes, |q| q as i8);
        u.scale[0] = f32_of(self.d);
        u.offset[0] = f32_of(self.m);
    }

    fn quantize(x: &[f32]) -> Self {
        let (d, m, codes) = quantize_affine(x, 16);
        BlockQ4_1 { d, m, qs: pack_nibbles(&codes) }
    }
}

impl QuantBlock for BlockQ5_0 {
    const N: usize = 32;
    const GROUP: usize = 32;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        unpack_5bit(&self.qs, &self.qh, 16, &mut u.codes);
        u.scale[0] = f32_of(self.d);
    }

    fn quantize(x: &[f32]) -> Self {
        let (d, codes) = quantize_symmetric(x, 32);
        let (qs, qh) = pack_5bit(&codes);
        BlockQ5_0 { d, qh, qs }
    }
}

impl QuantBlock for BlockQ5_1 {
    const N: usize = 32;
    const GROUP: usize = 32;
    const HAS_OFFSET: bool = true;

    fn unpack(&self, u: &mut Unpacked) {
        unpack_5bit(&self.qs, &self.qh, 0, &mut u.codes);
        u.scale[0] = f32_of(self.d);
        u.offset[0] = f32_of(self.m);
    }

    fn quantize(x: &[f32]) -> Self {
        let (d, m, codes) = quantize_affine(x, 32);
        let (qs, qh) = pack_5bit(&codes);
        BlockQ5_1 { d, m, qh, qs }
    }
}

impl QuantBlock for BlockQ8_0 {
    const N: usize = 32;
    const GROUP: usize = 32;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        u.codes[..32].copy_from_slice(&self.qs);
        u.scale[0] = f32_of(self.d);
    }

    fn quantize(x: &[f32]) -> Self {
        let (d, qs) = quantize_q8(x);
        BlockQ8_0 { d: f16_of(d), qs }
    }
}

impl QuantBlock for BlockQ8_1 {
    const N: usize = 32;
    const GROUP: usize = 32;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        u.codes[..32].copy_from_slice(&self.qs);
        u.scale[0] = f32_of(self.d);
    }

    fn quantize(x: &[f32]) -> Self {
        let (d, qs) = quantize_q8(x);
        let sum: i32 = qs.iter().map(|&q| i32::from(q)).sum();
        BlockQ8_1 { d: f16_of(d), s: f16_of(sum as f32 * d), qs }
    }
}

impl QuantBlock for BlockQ1_0 {
    const N: usize = 128;
    const GROUP: usize = 128;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        for (&byte, out) in self.qs.iter().zip(u.codes.chunks_exact_mut(8)) {
            for (bit, c) in out.iter_mut().enumerate() {
                *c = ((byte >> bit) & 1) as i8 * 2 - 1;
            }
        }
        u.scale[0] = f32_of(self.d);
    }

    /// ggml: d = mean |x| (the L2-optimal magnitude for a fixed sign pattern), bit = x >= 0.
    fn quantize(x: &[f32]) -> Self {
        let sum_abs = x.iter().fold(0f32, |s, v| s + v.abs());
        let mut qs = [0u8; 16];
        for (j, &v) in x.iter().enumerate() {
            if v >= 0.0 {
                qs[j / 8] |= 1 << (j % 8);
            }
        }
        BlockQ1_0 { d: f16_of(sum_abs / 128.0), qs }
    }
}
