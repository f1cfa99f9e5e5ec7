//! The ternary formats TQ1_0 (base-3 packing, 1.6875 bpw) and TQ2_0 (2-bit packing):
//! value = d * t with t in {-1, 0, 1}, d = max |x| over the 256-element block; and Q2_0,
//! Ternary-Bonsai's 64-element format, whose 2-bit codes also allow +2.

use crate::block::{abs_max, f16_of, f32_of, QuantBlock, Unpacked};
use crate::kquants::unpack_2bit;
use bytemuck::{Pod, Zeroable};
use half::f16;

/// Values 0..160 are the 5 trits of `qs[0..32]` (value 32n + m is trit n of byte m,
/// most significant first), 160..240 those of `qs[32..48]` (160 + 16n + m), and 240..256
/// the top 4 trits of `qh` (240 + 4n + j). A byte stores its trits as ceil(T * 256 / 243).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockTQ1_0 {
    pub qs: [u8; 48],
    pub qh: [u8; 4],
    pub d: f16,
}

/// Value 128h + 32k + m is bits 2k..2k+2 of `qs[32h + m]`, minus 1.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockTQ2_0 {
    pub qs: [u8; 64],
    pub d: f16,
}

/// Value j = d * (code j - 1), code j in bits 2(j%4).. of `qs[j/4]` (values -1, 0, 1, 2).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ2_0 {
    pub d: f16,
    pub qs: [u8; 16],
}

const _: () = assert!(size_of::<BlockQ2_0>() == 18);
const _: () = assert!(size_of::<BlockTQ1_0>() == 54);
const _: () = assert!(size_of::<BlockTQ2_0>() == 66);

/// Trits 0..=2 (t + 1) of a block, with its scale: round-half-away(x / max|x|) + 1.
fn ternarize(x: &[f32]) -> (f16, [u8; 256]) {
    let (amax, _) = abs_max(x);
    let id = if amax != 0.0 { 1.0 / amax } else { 0.0 };
    (f16_of(amax), std::array::from_fn(|j| (((x[j] * id).round() as i32).clamp(-1, 1) + 1) as u8))
}

/// Trit `n` (0 = most significant) of a byte holding ceil(T * 256 / 243).
fn trit(byte: u8, n: usize) -> i8 {
    const POW3: [u8; 5] = [1, 3, 9, 27, 81];
    let shifted = byte.wrapping_mul(POW3[n]);
    ((u16::from(shifted) * 3) >> 8) as i8 - 1
}

/// Packs trits (most significant first) into one byte as ceil(T * 256 / 243).
fn pack_trits(trits: impl Iterator<Item = u8>) -> u8 {
    let t = trits.fold(0u16, |acc, t| acc * 3 + u16::from(t));
    (t * 256).div_ceil(243) as u8
}

/// Expands bytes holding 5 (or 4) trits: value `n * bytes.len() + m` is trit n of byte m.
fn unpack_trits(bytes: &[u8], out: &mut [i8]) {
    for (n, out_n) in out.chunks_exact_mut(bytes.len()).enumerate() {
        for (o, &b) in out_n.iter_mut().zip(bytes) {
            *o = trit(b, n);
        }
    }
}

impl QuantBlock for BlockTQ1_0 {
    const N: usize = 256;
    const GROUP: usize = 256;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        unpack_trits(&self.qs[..32], &mut u.codes[..160]);
        unpack_trits(&self.qs[32..], &mut u.codes[160..240]);
        unpack_trits(&self.qh, &mut u.codes[240..256]);
        u.scale[0] = f32_of(self.d);
    }

    fn quantize(x: &[f32]) -> Self {
        let (d, t) = ternarize(x);
        let qs =
            std::array::from_fn(|b| if b < 32 { pack_trits((0..5).map(|n| t[32 * n + b])) } else { pack_trits((0..5).map(|n| t[160 + 16 * n + (b - 32)])) });
        // qh bytes carry 4 trits; the fifth (least significant) trit slot is zero.
        let qh = std::array::from_fn(|j| pack_trits((0..4).map(|n| t[240 + 4 * n + j]).chain([0])));
        BlockTQ1_0 { qs, qh, d }
    }
}

impl QuantBlock for BlockTQ2_0 {
    const N: usize = 256;
    const GROUP: usize = 256;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        unpack_2bit(&self.qs, &mut u.codes);
        for c in u.codes.iter_mut() {
            *c -= 1;
        }
        u.scale[0] = f32_of(self.d);
    }

    fn quantize(x: &[f32]) -> Self {
        let (d, t) = ternarize(x);
        let qs = std::array::from_fn(|i| {
            let (h, m) = (i / 32, i % 32);
            (0..4).fold(0u8, |acc, k| acc | t[128 * h + 32 * k + m] << (2 * k))
        });
        BlockTQ2_0 { qs, d }
    }
}

impl QuantBlock for BlockQ2_0 {
    const N: usize = 64;
    const GROUP: usize = 64;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        for (&byte, out) in self.qs.iter().zip(u.codes.chunks_exact_mut(4)) {
            for (k, c) in out.iter_mut().enumerate() {
                *c = ((byte >> (2 * k)) & 3) as i8 - 1;
            }
        }
        u.scale[0] = f32_of(self.d);
    }

    /// ggml: d = max |x|, code = round-half-away(x / d) + 1 with the f32 d, so the
    /// quantizer itself never writes code 3 (+2).
    fn quantize(x: &[f32]) -> Self {
        let (amax, _) = abs_max(x);
        let id = if amax > 0.0 { 1.0 / amax } else { 0.0 };
        let mut qs = [0u8; 16];
        for (j, &v) in x.iter().enumerate() {
            let q = ((v * id).round() as i32 + 1).clamp(0, 3) as u8;
            qs[j / 4] |= q << (2 * (j % 4));
        }
        BlockQ2_0 { d: f16_of(amax), qs }
    }
}
