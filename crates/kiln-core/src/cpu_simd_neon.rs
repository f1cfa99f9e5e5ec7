//! aarch64 NEON kernels behind [`Simd`](crate::cpu_simd::Simd), four f32 lanes a vector. NEON
//! is part of the aarch64 baseline, so these are safe functions. Tails shorter than a vector
//! are done one value at a time; loads slice first, so every pointer read is in bounds.

use std::arch::aarch64::*;

use half::f16;

use crate::cpu_simd::{dot_tail, matmul_add_by_tiles, EXP_COEFFS, EXP_HI, EXP_LO, LN2_HI, LN2_LO};

#[inline]
fn load(x: &[f32]) -> float32x4_t {
    let x = &x[..4];
    // SAFETY: `x` holds 4 floats.
    unsafe { vld1q_f32(x.as_ptr()) }
}

#[inline]
fn store(y: &mut [f32], v: float32x4_t) {
    let y = &mut y[..4];
    // SAFETY: `y` holds 4 floats.
    unsafe { vst1q_f32(y.as_mut_ptr(), v) }
}

/// 4 halves as floats, by bit arithmetic (Rust's f16 vector conversions are unstable): the
/// exponent and mantissa shifted into f32 position and rescaled by 2^112 are exact for normal
/// and subnormal halves; infinities and NaNs get the f32 all-ones exponent instead.
#[inline]
fn load_f16(x: &[f16]) -> float32x4_t {
    let x = &x[..4];
    // SAFETY: `x` holds 4 halves (8 bytes); `f16` is a plain u16.
    unsafe {
        let h = vmovl_u16(vld1_u16(x.as_ptr().cast()));
        let magnitude = vshlq_n_u32::<13>(vandq_u32(h, vdupq_n_u32(0x7fff)));
        let sign = vshlq_n_u32::<16>(vandq_u32(h, vdupq_n_u32(0x8000)));
        let finite = vreinterpretq_u32_f32(vmulq_n_f32(vreinterpretq_f32_u32(magnitude), f32::from_bits(0x7780_0000)));
        let special = vcgeq_u32(magnitude, vdupq_n_u32(0x7c00 << 13));
        let bits = vbslq_u32(special, vorrq_u32(magnitude, vdupq_n_u32(0x7f80_0000)), finite);
        vreinterpretq_f32_u32(vorrq_u32(bits, sign))
    }
}

/// 4 signed bytes as floats.
#[inline]
fn load_i8(x: &[u8]) -> float32x4_t {
    let x = &x[..4];
    let wide = [x[0] as i8, x[1] as i8, x[2] as i8, x[3] as i8].map(i32::from);
    // SAFETY: `wide` holds 4 i32s.
    unsafe { vcvtq_f32_s32(vld1q_s32(wide.as_ptr())) }
}

/// A q8_0 block's scale.
#[inline]
fn scale(block: &[u8]) -> f32 {
    f16::from_le_bytes([block[0], block[1]]).to_f32()
}

#[inline]
fn splat(v: f32) -> float32x4_t {
    // SAFETY: NEON is baseline on aarch64.
    unsafe { vdupq_n_f32(v) }
}

#[inline]
fn fma(acc: float32x4_t, a: float32x4_t, b: float32x4_t) -> float32x4_t {
    // SAFETY: as above.
    unsafe { vfmaq_f32(acc, a, b) }
}

#[inline]
fn hsum(v: float32x4_t) -> f32 {
    // SAFETY: as above.
    unsafe { vaddvq_f32(v) }
}

#[inline]
fn add(a: float32x4_t, b: float32x4_t) -> float32x4_t {
    // SAFETY: as above.
    unsafe { vaddq_f32(a, b) }
}

#[inline]
fn mul(a: float32x4_t, b: float32x4_t) -> float32x4_t {
    // SAFETY: as above.
    unsafe { vmulq_f32(a, b) }
}

/// The same polynomial as the x86 kernels: `2^n * p(r)`, `n` rounded to nearest even.
#[inline]
pub(crate) fn exp(x: float32x4_t) -> float32x4_t {
    // SAFETY: as above.
    unsafe {
        let c = vminq_f32(splat(EXP_HI), vmaxq_f32(splat(EXP_LO), x));
        let n = vrndnq_f32(vmulq_n_f32(c, std::f32::consts::LOG2_E));
        let r = vfmsq_f32(vfmsq_f32(c, n, splat(LN2_HI)), n, splat(LN2_LO));
        let mut p = splat(EXP_COEFFS[7]);
        for &k in EXP_COEFFS[..7].iter().rev() {
            p = vfmaq_f32(splat(k), p, r);
        }
        let scale = vreinterpretq_f32_s32(vshlq_n_s32::<23>(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127))));
        let under = vcltq_f32(x, splat(EXP_LO));
        vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(vmulq_f32(p, scale)), under))
    }
}

pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut s = [splat(0.0); 4];
    let (a16, b16) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (a16.remainder(), b16.remainder());
    for (x, y) in a16.zip(b16) {
        for (i, s) in s.iter_mut().enumerate() {
            *s = fma(*s, load(&x[4 * i..]), load(&y[4 * i..]));
        }
    }
    let (a4, b4) = (ra.chunks_exact(4), rb.chunks_exact(4));
    let tail = dot_tail(a4.remainder(), b4.remainder().iter().copied());
    for (x, y) in a4.zip(b4) {
        s[0] = fma(s[0], load(x), load(y));
    }
    hsum(add(add(s[0], s[1]), add(s[2], s[3]))) + tail
}

pub(crate) fn dot_f16(a: &[f32], b: &[f16]) -> f32 {
    let mut s = [splat(0.0); 2];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (a8.remainder(), b8.remainder());
    for (x, y) in a8.zip(b8) {
        s[0] = fma(s[0], load(x), load_f16(y));
        s[1] = fma(s[1], load(&x[4..]), load_f16(&y[4..]));
    }
    let (a4, b4) = (ra.chunks_exact(4), rb.chunks_exact(4));
    let tail = dot_tail(a4.remainder(), b4.remainder().iter().map(|h| h.to_f32()));
    for (x, y) in a4.zip(b4) {
        s[0] = fma(s[0], load(x), load_f16(y));
    }
    hsum(add(s[0], s[1])) + tail
}

/// `a` against whole q8_0 blocks (`a.len() / 32` of them).
pub(crate) fn dot_q8(a: &[f32], blocks: &[u8]) -> f32 {
    let mut acc = splat(0.0);
    for (x, b) in a.chunks_exact(32).zip(blocks.chunks_exact(34)) {
        let q = &b[2..];
        let mut s = mul(load(x), load_i8(q));
        for i in (4..32).step_by(4) {
            s = fma(s, load(&x[i..]), load_i8(&q[i..]));
        }
        acc = fma(acc, splat(scale(b)), s);
    }
    hsum(acc)
}

/// `y = a * x + y` four lanes at a time, then one value at a time.
#[inline]
fn axpy_with<T: Copy>(a: f32, x: &[T], y: &mut [f32], load_x: impl Fn(&[T]) -> float32x4_t, one: impl Fn(T) -> f32) {
    let va = splat(a);
    let n = x.len().min(y.len()) / 4 * 4;
    for (xv, yv) in x[n..].iter().zip(&mut y[n..]) {
        *yv += a * one(*xv);
    }
    for (xv, yv) in x[..n].chunks_exact(4).zip(y[..n].chunks_exact_mut(4)) {
        let r = fma(load(yv), va, load_x(xv));
        store(yv, r);
    }
}

pub(crate) fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    axpy_with(a, x, y, load, |v| v);
}

pub(crate) fn axpy_f16(a: f32, x: &[f16], y: &mut [f32]) {
    axpy_with(a, x, y, load_f16, f16::to_f32);
}

/// `y += a * row` over whole q8_0 blocks.
pub(crate) fn axpy_q8(a: f32, blocks: &[u8], y: &mut [f32]) {
    for (yb, b) in y.chunks_exact_mut(32).zip(blocks.chunks_exact(34)) {
        let ad = splat(a * scale(b));
        for i in (0..32).step_by(4) {
            let r = fma(load(&yb[i..]), ad, load_i8(&b[2 + i..]));
            store(&mut yb[i..], r);
        }
    }
}

pub(crate) fn max(x: &[f32]) -> f32 {
    let mut m = splat(f32::NEG_INFINITY);
    let x4 = x.chunks_exact(4);
    let tail = x4.remainder().iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for v in x4 {
        // SAFETY: NEON is baseline; `fmaxnm` ignores NaNs as the scalar fold does.
        m = unsafe { vmaxnmq_f32(m, load(v)) };
    }
    // SAFETY: as above.
    unsafe { vmaxnmvq_f32(m) }.max(tail)
}

pub(crate) fn exp_sum(x: &mut [f32], sub: f32) -> f32 {
    let (vs, mut acc) = (splat(sub), splat(0.0));
    let n = x.len() / 4 * 4;
    let mut tail = 0.0;
    for v in &mut x[n..] {
        *v = (*v - sub).exp();
        tail += *v;
    }
    for v in x[..n].chunks_exact_mut(4) {
        // SAFETY: NEON is baseline.
        let e = exp(unsafe { vsubq_f32(load(v), vs) });
        acc = add(acc, e);
        store(v, e);
    }
    hsum(acc) + tail
}

pub(crate) fn sum_squares(x: &[f32]) -> f32 {
    dot(x, x)
}

/// `out = f(a, b)` four lanes at a time; the tail goes through `f` too, padded, so that a
/// value's result never depends on where it sits in the buffer.
#[inline]
fn map2(a: &[f32], b: &[f32], out: &mut [f32], f: impl Fn(float32x4_t, float32x4_t) -> float32x4_t) {
    let n = a.len().min(b.len()).min(out.len());
    let full = n / 4 * 4;
    for ((o, x), y) in out[..full].chunks_exact_mut(4).zip(a[..full].chunks_exact(4)).zip(b[..full].chunks_exact(4)) {
        store(o, f(load(x), load(y)));
    }
    if full < n {
        let (mut x, mut y, mut o) = ([0f32; 4], [0f32; 4], [0f32; 4]);
        x[..n - full].copy_from_slice(&a[full..n]);
        y[..n - full].copy_from_slice(&b[full..n]);
        store(&mut o, f(load(&x), load(&y)));
        out[full..n].copy_from_slice(&o[..n - full]);
    }
}

pub(crate) fn rms_apply(x: &[f32], s: f32, w: &[f32], out: &mut [f32]) {
    let vs = splat(s);
    map2(x, w, out, |v, w| mul(mul(v, vs), w));
}

#[inline]
fn div(a: float32x4_t, b: float32x4_t) -> float32x4_t {
    // SAFETY: NEON is baseline.
    unsafe { vdivq_f32(a, b) }
}

pub(crate) fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    // SAFETY (vnegq_f32): NEON is baseline.
    map2(gate, up, out, |g, u| mul(div(g, add(splat(1.0), exp(unsafe { vnegq_f32(g) }))), u));
}

pub(crate) fn geglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let (half, one, two) = (splat(0.5), splat(1.0), splat(2.0));
    let (k, c) = (splat(0.797_884_6), splat(0.044715));
    map2(gate, up, out, |x, u| {
        // tanh(z) = 1 - 2 / (exp(2z) + 1), as the x86 kernels.
        let z = mul(k, fma(x, mul(c, x), mul(x, x)));
        // SAFETY: NEON is baseline.
        let t = unsafe { vsubq_f32(one, div(two, add(exp(mul(two, z)), one))) };
        mul(mul(mul(half, x), add(one, t)), u)
    });
}

/// Tiles of 4 rows x 16 columns summed in registers over the whole depth (16 accumulators of
/// the 32 vector registers), column panels outermost; columns past the last tile by the
/// scalar kernel.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_add(m: usize, n: usize, depth: usize, a: &[f32], lda: usize, b: &[f32], ldb: usize, c: &mut [f32], ldc: usize) {
    matmul_add_by_tiles!(16, m, n, depth, a, lda, b, ldb, c, ldc);
}

/// `R` rows x 16 columns of [`matmul_add`].
#[inline]
fn tile<const R: usize>(depth: usize, a: &[f32], lda: usize, b: &[f32], ldb: usize, c: &mut [f32], ldc: usize) {
    let rows: [&[f32]; R] = std::array::from_fn(|r| &a[r * lda..r * lda + depth]);
    let mut acc = [[splat(0.0); 4]; R];
    for i in 0..depth {
        let panel = &b[i * ldb..i * ldb + 16];
        let p = [load(panel), load(&panel[4..]), load(&panel[8..]), load(&panel[12..])];
        for (acc, row) in acc.iter_mut().zip(&rows) {
            let x = splat(row[i]);
            for (acc, p) in acc.iter_mut().zip(p) {
                *acc = fma(*acc, x, p);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let out = &mut c[r * ldc..r * ldc + 16];
        for (q, acc) in acc.iter().enumerate() {
            let v = add(load(&out[4 * q..]), *acc);
            store(&mut out[4 * q..], v);
        }
    }
}
