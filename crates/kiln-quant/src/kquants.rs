//! The K-quant super-blocks (256 elements): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and the
//! Q8_K activation format, with ggml's reference scale searches.

use crate::block::{abs_max, f16_of, f32_of, nearest_int, QuantBlock, Unpacked};
use bytemuck::{Pod, Zeroable};
use half::f16;

const QK_K: usize = 256;
/// ggml treats groups below this magnitude as all zero.
const GROUP_MAX_EPS: f32 = 1e-15;

/// 2-bit: 16 groups of 16, value = d*(sc & 15)*q - dmin*(sc >> 4).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ2_K {
    pub scales: [u8; 16],
    pub qs: [u8; 64],
    pub d: f16,
    pub dmin: f16,
}

/// 3-bit: 16 groups of 16 with 6-bit signed scales, value = d*(sc - 32)*(q - 4*!hbit).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ3_K {
    pub hmask: [u8; 32],
    pub qs: [u8; 64],
    pub scales: [u8; 12],
    pub d: f16,
}

/// 4-bit: 8 groups of 32 with 6-bit scales and mins, value = d*sc*q - dmin*m.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qs: [u8; 128],
}

/// 5-bit: as Q4_K with a fifth bit per value in `qh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5_K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qh: [u8; 32],
    pub qs: [u8; 128],
}

/// 6-bit: 16 groups of 16 with 8-bit signed scales, value = d*sc*(q - 32).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ6_K {
    pub ql: [u8; 128],
    pub qh: [u8; 64],
    pub scales: [i8; 16],
    pub d: f16,
}

/// 8-bit activation format with an f32 scale and sums of each 16 codes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_K {
    pub d: f32,
    pub qs: [i8; 256],
    pub bsums: [i16; 16],
}

const _: () = assert!(size_of::<BlockQ2_K>() == 84);
const _: () = assert!(size_of::<BlockQ3_K>() == 110);
const _: () = assert!(size_of::<BlockQ4_K>() == 144);
const _: () = assert!(size_of::<BlockQ5_K>() == 176);
const _: () = assert!(size_of::<BlockQ6_K>() == 210);
const _: () = assert!(size_of::<BlockQ8_K>() == 292);

// ---------------------------------------------------------------- scale searches

/// ggml's `make_qx_quants` with rmse_type 1 (weights x²): levels in [-nmax, nmax-1]
/// (stored + nmax), scale fitted by weighted least squares over 19 trial inverse scales.
fn make_qx_quants(x: &[f32], nmax: i32, levels: &mut [i8]) -> f32 {
    let (amax, max) = abs_max(x);
    if amax < GROUP_MAX_EPS {
        levels.fill(0);
        return 0.0;
    }
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let fit = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for &v in x {
            let (l, w) = (level(iscale, v) as f32, v * v);
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let mut iscale = -(nmax as f32) / max;
    for (out, &v) in levels.iter_mut().zip(x) {
        *out = (level(iscale, v) + nmax) as i8;
    }
    let (sumlx, suml2) = fit(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in (-9..=9).filter(|&is| is != 0) {
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = fit(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (out, &v) in levels.iter_mut().zip(x) {
                *out = (level(iscale, v) + nmax) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// ggml's `make_q3_quants` with rmse: start from max-based levels in [-nmax, nmax-1], then
/// up to 5 passes of coordinate descent on the x²-weighted fit. Levels are stored + nmax.
fn make_q3_quants(x: &[f32], nmax: i32, levels: &mut [i8]) -> f32 {
    let (amax, max) = abs_max(x);
    if amax < GROUP_MAX_EPS {
        levels.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (out, &v) in levels.iter_mut().zip(x) {
        let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        *out = l as i8;
        let (w, l) = (v * v, l as f32);
        sumlx += w * v * l;
        suml2 += w * l * l;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for (out, &v) in levels.iter_mut().zip(x) {
            let (w, old) = (v * v, f32::from(*out));
            let mut slx = sumlx - w * v * old;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * old * old;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != i32::from(*out) {
                    let nl = new_l as f32;
                    slx += w * v * nl;
                    sl2 += w * nl * nl;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        *out = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    for l in levels.iter_mut() {
        *l += nmax as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// Parameters of ggml's `make_qkx2_quants` trial-scale sweep.
struct ScaleSweep {
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
}

/// ggml's `make_qkx2_quants`: levels in [0, nmax] for `x = scale*l - min` (min >= 0),
/// refining scale and min by weighted least squares over `nstep + 1` trial inverse
/// scales. Returns `(scale, min)`.
fn make_qkx2_quants(x: &[f32], weights: &[f32], nmax: i32, levels: &mut [u8], sweep: &ScaleSweep) -> (f32, f32) {
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for (&v, &w) in x.iter().zip(weights).skip(1) {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
        sum_w += w;
        sum_x += w * v;
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        levels.fill(0);
        return (0.0, -min);
    }
    let nmaxf = nmax as f32;
    let level = |iscale: f32, v: f32, min: f32| nearest_int(iscale * (v - min)).clamp(0, nmax) as u8;
    let error = |scale: f32, min: f32, levels: &[u8]| {
        let mut err = 0f32;
        for ((&v, &w), &l) in x.iter().zip(weights).zip(levels) {
            let diff = scale * f32::from(l) + min - v;
            err += w * if sweep.use_mad { diff.abs() } else { diff * diff };
        }
        err
    };
    let iscale = nmaxf / (max - min);
    let mut scale = 1.0 / iscale;
    for (out, &v) in levels.iter_mut().zip(x) {
        *out = level(iscale, v, min);
    }
    let mut best_error = error(scale, min, levels);
    let mut trial = [0u8; 32];
    let trial = &mut trial[..x.len()];
    for is in 0..=sweep.nstep {
        let iscale = (sweep.rmin + sweep.rdelta * is as f32 + nmaxf) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for ((out, &v), &w) in trial.iter_mut().zip(x).zip(weights) {
            *out = level(iscale, v, min);
            let l = f32::from(*out);
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * v;
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let cur_error = error(this_scale, this_min, trial);
            if cur_error < best_error {
                levels.copy_from_slice(trial);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

// ---------------------------------------------------------------- shared packing

/// Packs 2-bit values: byte `32*h + l` holds values `128*h + l + 32*k` at bits `2k`.
fn pack_2bit(levels: &[u8; QK_K]) -> [u8; 64] {
    std::array::from_fn(|i| {
        let (h, l) = (i / 32, i % 32);
        (0..4).fold(0u8, |acc, k| acc | (levels[128 * h + l + 32 * k] & 3) << (2 * k))
    })
}

/// Inverse of [`pack_2bit`] (also TQ2_0's layout): the 256 raw 2-bit fields.
pub(crate) fn unpack_2bit(qs: &[u8; 64], out: &mut [i8]) {
    for (half_qs, half_out) in qs.chunks_exact(32).zip(out.chunks_exact_mut(128)) {
        for (k, out_k) in half_out.chunks_exact_mut(32).enumerate() {
            for (o, &b) in out_k.iter_mut().zip(half_qs) {
                *o = ((b >> (2 * k)) & 3) as i8;
            }
        }
    }
}

/// Adds bit `g` of `bits[l]`, shifted left by `shift`, to value `32*g + l` (g = 0..8):
/// the per-32-group high-bit planes of Q3_K and Q5_K.
fn add_bit_planes(bits: &[u8; 32], shift: u32, out: &mut [i8]) {
    for (g, out_g) in out.chunks_exact_mut(32).enumerate() {
        for (o, &b) in out_g.iter_mut().zip(bits) {
            *o += (((b >> g) & 1) << shift) as i8;
        }
    }
}

/// Q4_K/Q5_K 6-bit (scale, min) of group `j` (ggml's `get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

fn pack_scale_min_k4(ls: &[u8; 8], lm: &[u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            q[j] = ls[j];
            q[j + 4] = lm[j];
        } else {
            q[j + 4] = (ls[j] & 0xf) | ((lm[j] & 0xf) << 4);
            q[j - 4] |= (ls[j] >> 4) << 6;
            q[j] |= (lm[j] >> 4) << 6;
        }
    }
    q
}

/// Q3_K 6-bit scale `j` (stored + 32): low nibbles in bytes 0..8, high pairs in bytes 8..12.
fn scale_q3(j: usize, q: &[u8; 12]) -> u8 {
    let low = if j < 8 { q[j] & 0xf } else { q[j - 8] >> 4 };
    low | (((q[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)
}

/// Shared by Q4_K and Q5_K: fit (scale, min) per 32-group with `make_qkx2_quants`,
/// quantize them to 6 bits against the super-block maxima, then requantize the
/// values with the rounded scales. Returns (d, dmin, packed scales, levels).
fn quantize_k4_style(x: &[f32], nmax: i32, sweep: &ScaleSweep) -> (f16, f16, [u8; 12], [u8; QK_K]) {
    let mut levels = [0u8; QK_K];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..8 {
        let xg = &x[32 * j..32 * j + 32];
        let sum_x2 = xg.iter().fold(0f32, |s, v| s + v * v);
        let av_x = (sum_x2 / 32.0).sqrt();
        let weights: [f32; 32] = std::array::from_fn(|l| av_x + xg[l].abs());
        (scales[j], mins[j]) = make_qkx2_quants(xg, &weights, nmax, &mut levels[32 * j..32 * j + 32], sweep);
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let ls: [u8; 8] = std::array::from_fn(|j| (nearest_int(inv_scale * scales[j]) as u8).min(63));
    let lm: [u8; 8] = std::array::from_fn(|j| (nearest_int(inv_min * mins[j]) as u8).min(63));
    let packed = pack_scale_min_k4(&ls, &lm);
    let (d, dmin) = (f16_of(max_scale / 63.0), f16_of(max_min / 63.0));
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &packed);
        let dj = f32_of(d) * f32::from(sc);
        if dj == 0.0 {
            continue;
        }
        let dm = f32_of(dmin) * f32::from(m);
        for (l, &v) in levels[32 * j..32 * j + 32].iter_mut().zip(&x[32 * j..]) {
            *l = nearest_int((v + dm) / dj).clamp(0, nmax) as u8;
        }
    }
    (d, dmin, packed, levels)
}

/// Q4_K/Q5_K group scales: d*sc and the offset -(dmin*m).
fn unpack_k4_scales(d: f16, dmin: f16, scales: &[u8; 12], u: &mut Unpacked) {
    let (d, dmin) = (f32_of(d), f32_of(dmin));
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, scales);
        u.scale[j] = d * f32::from(sc);
        u.offset[j] = -(dmin * f32::from(m));
    }
}

/// Q4_K/Q5_K low nibbles: byte `32*p + l` holds values `64*p + l` (low) and `64*p + 32 + l` (high).
fn unpack_k4_nibbles(qs: &[u8; 128], out: &mut [i8]) {
    for (q, o) in qs.chunks_exact(32).zip(out.chunks_exact_mut(64)) {
        let (lo, hi) = o.split_at_mut(32);
        for ((&b, l), h) in q.iter().zip(lo).zip(hi) {
            *l = (b & 0xf) as i8;
            *h = (b >> 4) as i8;
        }
    }
}

fn pack_k4_nibbles(levels: &[u8; QK_K]) -> [u8; 128] {
    std::array::from_fn(|i| {
        let (p, l) = (i / 32, i % 32);
        (levels[64 * p + l] & 0xf) | (levels[64 * p + 32 + l] << 4)
    })
}

// ---------------------------------------------------------------- formats

impl QuantBlock for BlockQ2_K {
    const N: usize = QK_K;
    const GROUP: usize = 16;
    const HAS_OFFSET: bool = true;

    fn unpack(&self, u: &mut Unpacked) {
        let (d, dmin) = (f32_of(self.d), f32_of(self.dmin));
        for (j, &sc) in self.scales.iter().enumerate() {
            u.scale[j] = d * f32::from(sc & 0xf);
            u.offset[j] = -(dmin * f32::from(sc >> 4));
        }
        unpack_2bit(&self.qs, &mut u.codes);
    }

    fn quantize(x: &[f32]) -> Self {
        const SWEEP: ScaleSweep = ScaleSweep { rmin: -0.5, rdelta: 0.1, nstep: 15, use_mad: true };
        let mut levels = [0u8; QK_K];
        let (mut scales, mut mins) = ([0f32; 16], [0f32; 16]);
        let (mut max_scale, mut max_min) = (0f32, 0f32);
        for j in 0..16 {
            let xg = &x[16 * j..16 * j + 16];
            let weights: [f32; 16] = std::array::from_fn(|l| xg[l].abs());
            (scales[j], mins[j]) = make_qkx2_quants(xg, &weights, 3, &mut levels[16 * j..16 * j + 16], &SWEEP);
            if scales[j] > max_scale {
                max_scale = scales[j];
            }
            if mins[j] > max_min {
                max_min = mins[j];
            }
        }
        let mut packed = [0u8; 16];
        let mut d = f16::ZERO;
        if max_scale > 0.0 {
            let iscale = 15.0 / max_scale;
            for (p, &s) in packed.iter_mut().zip(&scales) {
                *p = nearest_int(iscale * s) as u8;
            }
            d = f16_of(max_scale / 15.0);
        }
        let mut dmin = f16::ZERO;
        if max_min > 0.0 {
            let iscale = 15.0 / max_min;
            for (p, &m) in packed.iter_mut().zip(&mins) {
                *p |= nearest_int(iscale * m).wrapping_shl(4) as u8;
            }
            dmin = f16_of(max_min / 15.0);
        }
        for (j, &sc) in packed.iter().enumerate() {
            let dj = f32_of(d) * f32::from(sc & 0xf);
            if dj == 0.0 {
                continue;
            }
            let dm = f32_of(dmin) * f32::from(sc >> 4);
            for (l, &v) in levels[16 * j..16 * j + 16].iter_mut().zip(&x[16 * j..]) {
                *l = nearest_int((v + dm) / dj).clamp(0, 3) as u8;
            }
        }
        BlockQ2_K { scales: packed, qs: pack_2bit(&levels), d, dmin }
    }
}

impl QuantBlock for BlockQ3_K {
    const N: usize = QK_K;
    const GROUP: usize = 16;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        let d = f32_of(self.d);
        for j in 0..16 {
            u.scale[j] = d * f32::from(scale_q3(j, &self.scales) as i8 - 32);
        }
        // Stored as q + 4*hbit; the value is q - 4 when the high bit is clear.
        unpack_2bit(&self.qs, &mut u.codes);
        add_bit_planes(&self.hmask, 2, &mut u.codes);
        for c in u.codes.iter_mut() {
            *c -= 4;
        }
    }

    fn quantize(x: &[f32]) -> Self {
        let mut levels = [0i8; QK_K];
        let mut scales = [0f32; 16];
        let (mut amax, mut max_scale) = (0f32, 0f32);
        for j in 0..16 {
            scales[j] = make_q3_quants(&x[16 * j..16 * j + 16], 4, &mut levels[16 * j..16 * j + 16]);
            if scales[j].abs() > amax {
                amax = scales[j].abs();
                max_scale = scales[j];
            }
        }
        let mut packed = [0u8; 12];
        let mut d = f16::ZERO;
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for (j, &s) in scales.iter().enumerate() {
                let l = ((nearest_int(iscale * s) as i8).clamp(-32, 31) + 32) as u8;
                if j < 8 {
                    packed[j] = l & 0xf;
                } else {
                    packed[j - 8] |= (l & 0xf) << 4;
                }
                packed[8 + j % 4] |= (l >> 4) << (2 * (j / 4));
            }
            d = f16_of(1.0 / iscale);
        }
        for j in 0..16 {
            let dj = f32_of(d) * f32::from(scale_q3(j, &packed) as i8 - 32);
            if dj == 0.0 {
                continue;
            }
            for (l, &v) in levels[16 * j..16 * j + 16].iter_mut().zip(&x[16 * j..]) {
                *l = (nearest_int(v / dj).clamp(-4, 3) + 4) as i8;
            }
        }
        let mut hmask = [0u8; 32];
        let mut low = [0u8; QK_K];
        for (e, (&l, lo)) in levels.iter().zip(&mut low).enumerate() {
            let l = l as u8;
            if l > 3 {
                hmask[e % 32] |= 1 << (e / 32);
            }
            *lo = if l > 3 { l - 4 } else { l };
        }
        BlockQ3_K { hmask, qs: pack_2bit(&low), scales: packed, d }
    }
}

impl QuantBlock for BlockQ4_K {
    const N: usize = QK_K;
    const GROUP: usize = 32;
    const HAS_OFFSET: bool = true;

    fn unpack(&self, u: &mut Unpacked) {
        unpack_k4_scales(self.d, self.dmin, &self.scales, u);
        unpack_k4_nibbles(&self.qs, &mut u.codes);
    }

    fn quantize(x: &[f32]) -> Self {
        const SWEEP: ScaleSweep = ScaleSweep { rmin: -1.0, rdelta: 0.1, nstep: 20, use_mad: false };
        let (d, dmin, scales, levels) = quantize_k4_style(x, 15, &SWEEP);
        BlockQ4_K { d, dmin, scales, qs: pack_k4_nibbles(&levels) }
    }
}

impl QuantBlock for BlockQ5_K {
    const N: usize = QK_K;
    const GROUP: usize = 32;
    const HAS_OFFSET: bool = true;

    fn unpack(&self, u: &mut Unpacked) {
        unpack_k4_scales(self.d, self.dmin, &self.scales, u);
        unpack_k4_nibbles(&self.qs, &mut u.codes);
        add_bit_planes(&self.qh, 4, &mut u.codes);
    }

    fn quantize(x: &[f32]) -> Self {
        const SWEEP: ScaleSweep = ScaleSweep { rmin: -0.5, rdelta: 0.1, nstep: 15, use_mad: false };
        let (d, dmin, scales, levels) = quantize_k4_style(x, 31, &SWEEP);
        let mut qh = [0u8; 32];
        for (e, &l) in levels.iter().enumerate() {
            qh[e % 32] |= ((l >> 4) & 1) << (e / 32);
        }
        BlockQ5_K { d, dmin, scales, qh, qs: pack_k4_nibbles(&levels) }
    }
}

impl QuantBlock for BlockQ6_K {
    const N: usize = QK_K;
    const GROUP: usize = 16;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        let d = f32_of(self.d);
        for (s, &sc) in u.scale.iter_mut().zip(&self.scales) {
            *s = d * f32::from(sc);
        }
        // Value 128*h + 32*k + l: low nibble from ql[64h + 32*(k%2) + l] (high nibble when
        // k >= 2), top two bits from qh[32h + l] at bit 2k.
        for (h, out_h) in u.codes.chunks_exact_mut(128).enumerate() {
            let qh = &self.qh[32 * h..32 * h + 32];
            for (k, out_k) in out_h.chunks_exact_mut(32).enumerate() {
                let ql = &self.ql[64 * h + 32 * (k % 2)..][..32];
                for ((o, &low), &high) in out_k.iter_mut().zip(ql).zip(qh) {
                    *o = (((low >> (4 * (k / 2))) & 0xf) | ((high >> (2 * k)) & 3) << 4) as i8 - 32;
                }
            }
        }
    }

    fn quantize(x: &[f32]) -> Self {
        let mut levels = [0i8; QK_K];
        let mut scales = [0f32; 16];
        let (mut max_abs_scale, mut max_scale) = (0f32, 0f32);
        for j in 0..16 {
            scales[j] = make_qx_quants(&x[16 * j..16 * j + 16], 32, &mut levels[16 * j..16 * j + 16]);
            if scales[j].abs() > max_abs_scale {
                max_abs_scale = scales[j].abs();
                max_scale = scales[j];
            }
        }
        if max_abs_scale < GROUP_MAX_EPS {
            return BlockQ6_K::zeroed();
        }
        let iscale = -128.0 / max_scale;
        let d = f16_of(1.0 / iscale);
        let packed: [i8; 16] = std::array::from_fn(|j| nearest_int(iscale * scales[j]).min(127) as i8);
        for (j, &sc) in packed.iter().enumerate() {
            let dj = f32_of(d) * f32::from(sc);
            if dj == 0.0 {
                continue;
            }
            for (l, &v) in levels[16 * j..16 * j + 16].iter_mut().zip(&x[16 * j..]) {
                *l = (nearest_int(v / dj).clamp(-32, 31) + 32) as i8;
            }
        }
        let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
        for (e, &l) in levels.iter().enumerate() {
            let (h, k, i) = (e / 128, (e % 128) / 32, e % 32);
            let l = l as u8;
            ql[64 * h + i + 32 * (k % 2)] |= (l & 0xf) << (4 * (k / 2));
            qh[32 * h + i] |= ((l >> 4) & 3) << (2 * k);
        }
        BlockQ6_K { ql, qh, scales: packed, d }
    }
}

impl QuantBlock for BlockQ8_K {
    const N: usize = QK_K;
    const GROUP: usize = QK_K;
    const HAS_OFFSET: bool = false;

    fn unpack(&self, u: &mut Unpacked) {
        u.codes.copy_from_slice(&self.qs);
        u.scale[0] = self.d;
    }

    /// ggml's Q8_K: d = max/-127 for the signed element of largest magnitude (f32 scale).
    fn quantize(x: &[f32]) -> Self {
        let (amax, max) = abs_max(x);
        if amax == 0.0 {
            return BlockQ8_K::zeroed();
        }
        let iscale = -127.0 / max;
        let qs: [i8; 256] = std::array::from_fn(|j| nearest_int(iscale * x[j]).min(127) as i8);
        let bsums = std::array::from_fn(|j| qs[16 * j..16 * j + 16].iter().map(|&q| i16::from(q)).sum());
        BlockQ8_K { d: 1.0 / iscale, qs, bsums }
    }
}
