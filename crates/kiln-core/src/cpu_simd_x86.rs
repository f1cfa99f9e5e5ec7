//! x86-64 kernels behind [`Simd`](crate::cpu_simd::Simd): AVX2 (+FMA, F16C) for everything,
//! AVX-512F for the kernels attention spends its time in. Tails shorter than a vector are
//! done one value at a time. Loads go through small helpers that slice first, so every
//! pointer read is in bounds by construction.

use std::arch::x86_64::*;

use half::f16;

use crate::cpu_simd::{dot_tail, matmul_add_by_tiles, EXP_COEFFS, EXP_HI, EXP_LO, LN2_HI, LN2_LO};

pub(crate) mod avx2 {
    use super::*;

    /// A q8_0 block's f16 scale, converted in-line (`half` calls out for each one).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn scale(block: &[u8]) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(u16::from_le_bytes([block[0], block[1]]) as i32)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn load(x: &[f32]) -> __m256 {
        let x = &x[..8];
        // SAFETY: `x` holds 8 floats; the load is unaligned.
        unsafe { _mm256_loadu_ps(x.as_ptr()) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn store(y: &mut [f32], v: __m256) {
        let y = &mut y[..8];
        // SAFETY: `y` holds 8 floats; the store is unaligned.
        unsafe { _mm256_storeu_ps(y.as_mut_ptr(), v) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn load_f16(x: &[f16]) -> __m256 {
        let x = &x[..8];
        // SAFETY: `x` holds 8 halves (16 bytes); `f16` is a plain u16.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(x.as_ptr() as *const __m128i)) }
    }

    /// 8 signed bytes as floats.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn load_i8(x: &[u8]) -> __m256 {
        let x = &x[..8];
        // SAFETY: `x` holds 8 bytes; `_mm_loadl_epi64` reads exactly 8.
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(x.as_ptr() as *const __m128i))) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hmax(v: __m256) -> f32 {
        let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn exp(x: __m256) -> __m256 {
        let c = _mm256_min_ps(_mm256_set1_ps(EXP_HI), _mm256_max_ps(_mm256_set1_ps(EXP_LO), x));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(c, _mm256_set1_ps(std::f32::consts::LOG2_E)));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), c));
        let mut p = _mm256_set1_ps(EXP_COEFFS[7]);
        for &k in EXP_COEFFS[..7].iter().rev() {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(k));
        }
        let scale = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127))));
        let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_LO));
        _mm256_andnot_ps(under, _mm256_mul_ps(p, scale))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
        let (mut s0, mut s1, mut s2, mut s3) = (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
        let (a32, b32) = (a.chunks_exact(32), b.chunks_exact(32));
        let (ra, rb) = (a32.remainder(), b32.remainder());
        for (x, y) in a32.zip(b32) {
            s0 = _mm256_fmadd_ps(load(x), load(y), s0);
            s1 = _mm256_fmadd_ps(load(&x[8..]), load(&y[8..]), s1);
            s2 = _mm256_fmadd_ps(load(&x[16..]), load(&y[16..]), s2);
            s3 = _mm256_fmadd_ps(load(&x[24..]), load(&y[24..]), s3);
        }
        let (a8, b8) = (ra.chunks_exact(8), rb.chunks_exact(8));
        let tail = dot_tail(a8.remainder(), b8.remainder().iter().copied());
        for (x, y) in a8.zip(b8) {
            s0 = _mm256_fmadd_ps(load(x), load(y), s0);
        }
        hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3))) + tail
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn dot_f16(a: &[f32], b: &[f16]) -> f32 {
        let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let (a16, b16) = (a.chunks_exact(16), b.chunks_exact(16));
        let (ra, rb) = (a16.remainder(), b16.remainder());
        for (x, y) in a16.zip(b16) {
            s0 = _mm256_fmadd_ps(load(x), load_f16(y), s0);
            s1 = _mm256_fmadd_ps(load(&x[8..]), load_f16(&y[8..]), s1);
        }
        let (a8, b8) = (ra.chunks_exact(8), rb.chunks_exact(8));
        let tail = dot_tail(a8.remainder(), b8.remainder().iter().map(|h| h.to_f32()));
        for (x, y) in a8.zip(b8) {
            s0 = _mm256_fmadd_ps(load(x), load_f16(y), s0);
        }
        hsum(_mm256_add_ps(s0, s1)) + tail
    }

    /// `a` against whole q8_0 blocks (`a.len() / 32` of them).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn dot_q8(a: &[f32], blocks: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (x, b) in a.chunks_exact(32).zip(blocks.chunks_exact(34)) {
            let d = scale(b);
            let q = &b[2..];
            let s = _mm256_fmadd_ps(load(&x[8..]), load_i8(&q[8..]), _mm256_mul_ps(load(x), load_i8(q)));
            let s = _mm256_fmadd_ps(load(&x[16..]), load_i8(&q[16..]), s);
            let s = _mm256_fmadd_ps(load(&x[24..]), load_i8(&q[24..]), s);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), s, acc);
        }
        hsum(acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        let va = _mm256_set1_ps(a);
        let n = x.len().min(y.len()) / 8 * 8;
        for (xv, yv) in x[n..].iter().zip(&mut y[n..]) {
            *yv += a * xv;
        }
        for (xv, yv) in x[..n].chunks_exact(8).zip(y[..n].chunks_exact_mut(8)) {
            let r = _mm256_fmadd_ps(va, load(xv), load(yv));
            store(yv, r);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn axpy_f16(a: f32, x: &[f16], y: &mut [f32]) {
        let va = _mm256_set1_ps(a);
        let n = x.len().min(y.len()) / 8 * 8;
        for (xv, yv) in x[n..].iter().zip(&mut y[n..]) {
            *yv += a * xv.to_f32();
        }
        for (xv, yv) in x[..n].chunks_exact(8).zip(y[..n].chunks_exact_mut(8)) {
            let r = _mm256_fmadd_ps(va, load_f16(xv), load(yv));
            store(yv, r);
        }
    }

    /// `y += a * row` over whole q8_0 blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn axpy_q8(a: f32, blocks: &[u8], y: &mut [f32]) {
        for (yb, b) in y.chunks_exact_mut(32).zip(blocks.chunks_exact(34)) {
            let ad = _mm256_set1_ps(a * scale(b));
            for i in (0..32).step_by(8) {
                let r = _mm256_fmadd_ps(ad, load_i8(&b[2 + i..]), load(&yb[i..]));
                store(&mut yb[i..], r);
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn max(x: &[f32]) -> f32 {
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        let x8 = x.chunks_exact(8);
        let tail = x8.remainder().iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for v in x8 {
            m = _mm256_max_ps(m, load(v));
        }
        hmax(m).max(tail)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn exp_sum(x: &mut [f32], sub: f32) -> f32 {
        let (vs, mut acc) = (_mm256_set1_ps(sub), _mm256_setzero_ps());
        let n = x.len() / 8 * 8;
        let mut tail = 0.0;
        for v in &mut x[n..] {
            *v = (*v - sub).exp();
            tail += *v;
        }
        for v in x[..n].chunks_exact_mut(8) {
            let e = exp(_mm256_sub_ps(load(v), vs));
            acc = _mm256_add_ps(acc, e);
            store(v, e);
        }
        hsum(acc) + tail
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn sum_squares(x: &[f32]) -> f32 {
        dot(x, x)
    }

    /// `out = f(a, b)` eight lanes at a time; the tail goes through `f` too, padded, so that a
    /// value's result never depends on where it sits in the buffer (batches of other lengths).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn map2(a: &[f32], b: &[f32], out: &mut [f32], f: impl Fn(__m256, __m256) -> __m256) {
        let n = a.len().min(b.len()).min(out.len());
        let full = n / 8 * 8;
        for ((o, x), y) in out[..full].chunks_exact_mut(8).zip(a[..full].chunks_exact(8)).zip(b[..full].chunks_exact(8)) {
            store(o, f(load(x), load(y)));
        }
        if full < n {
            let (mut x, mut y, mut o) = ([0f32; 8], [0f32; 8], [0f32; 8]);
            x[..n - full].copy_from_slice(&a[full..n]);
            y[..n - full].copy_from_slice(&b[full..n]);
            store(&mut o, f(load(&x), load(&y)));
            out[full..n].copy_from_slice(&o[..n - full]);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn rms_apply(x: &[f32], s: f32, w: &[f32], out: &mut [f32]) {
        let vs = _mm256_set1_ps(s);
        map2(x, w, out, |v, w| _mm256_mul_ps(_mm256_mul_ps(v, vs), w));
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let one = _mm256_set1_ps(1.0);
        map2(gate, up, out, |g, u| _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, exp(_mm256_sub_ps(_mm256_setzero_ps(), g)))), u));
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn geglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let (half, one, two) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0), _mm256_set1_ps(2.0));
        let (k, c) = (_mm256_set1_ps(0.797_884_6), _mm256_set1_ps(0.044715));
        map2(gate, up, out, |x, u| {
            // tanh(z) = 1 - 2 / (exp(2z) + 1): exact limits at both ends, no cancellation
            // that matters since gelu adds 1 to it.
            let z = _mm256_mul_ps(k, _mm256_fmadd_ps(_mm256_mul_ps(c, x), _mm256_mul_ps(x, x), x));
            let t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(exp(_mm256_mul_ps(two, z)), one)));
            _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, t)), u)
        });
    }

    /// Tiles of 4 rows x 16 columns summed in registers over the whole depth, column panels
    /// outermost so that a panel of `b` stays in L1 for every row tile; columns past the last
    /// whole tile by the scalar kernel.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn matmul_add(m: usize, n: usize, depth: usize, a: &[f32], lda: usize, b: &[f32], ldb: usize, c: &mut [f32], ldc: usize) {
        matmul_add_by_tiles!(16, m, n, depth, a, lda, b, ldb, c, ldc);
    }

    /// `R` rows x 16 columns of [`matmul_add`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn tile<const R: usize>(depth: usize, a: &[f32], lda: usize, b: &[f32], ldb: usize, c: &mut [f32], ldc: usize) {
        let rows: [&[f32]; R] = std::array::from_fn(|r| &a[r * lda..r * lda + depth]);
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for i in 0..depth {
            let panel = &b[i * ldb..i * ldb + 16];
            let (b0, b1) = (load(panel), load(&panel[8..]));
            for (acc, row) in acc.iter_mut().zip(&rows) {
                let x = _mm256_set1_ps(row[i]);
                acc[0] = _mm256_fmadd_ps(x, b0, acc[0]);
                acc[1] = _mm256_fmadd_ps(x, b1, acc[1]);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            let out = &mut c[r * ldc..r * ldc + 16];
            let (lo, hi) = (_mm256_add_ps(load(out), acc[0]), _mm256_add_ps(load(&out[8..]), acc[1]));
            store(out, lo);
            store(&mut out[8..], hi);
        }
    }
}

pub(crate) mod avx512 {
    use super::avx2::scale;
    use super::*;

    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn load(x: &[f32]) -> __m512 {
        let x = &x[..16];
        // SAFETY: `x` holds 16 floats; the load is unaligned.
        unsafe { _mm512_loadu_ps(x.as_ptr()) }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn store(y: &mut [f32], v: __m512) {
        let y = &mut y[..16];
        // SAFETY: `y` holds 16 floats; the store is unaligned.
        unsafe { _mm512_storeu_ps(y.as_mut_ptr(), v) }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn load_f16(x: &[f16]) -> __m512 {
        let x = &x[..16];
        // SAFETY: `x` holds 16 halves (32 bytes); `f16` is a plain u16.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(x.as_ptr() as *const __m256i)) }
    }

    /// 16 signed bytes as floats.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn load_i8(x: &[u8]) -> __m512 {
        let x = &x[..16];
        // SAFETY: `x` holds 16 bytes.
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(x.as_ptr() as *const __m128i))) }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn exp(x: __m512) -> __m512 {
        let c = _mm512_min_ps(_mm512_set1_ps(EXP_HI), _mm512_max_ps(_mm512_set1_ps(EXP_LO), x));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(c, _mm512_set1_ps(std::f32::consts::LOG2_E)));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), c));
        let mut p = _mm512_set1_ps(EXP_COEFFS[7]);
        for &k in EXP_COEFFS[..7].iter().rev() {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(k));
        }
        let scale = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127))));
        let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, _mm512_set1_ps(EXP_LO));
        _mm512_maskz_mul_ps(keep, p, scale)
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
        let (mut s0, mut s1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let (a32, b32) = (a.chunks_exact(32), b.chunks_exact(32));
        let (ra, rb) = (a32.remainder(), b32.remainder());
        for (x, y) in a32.zip(b32) {
            s0 = _mm512_fmadd_ps(load(x), load(y), s0);
            s1 = _mm512_fmadd_ps(load(&x[16..]), load(&y[16..]), s1);
        }
        let (a16, b16) = (ra.chunks_exact(16), rb.chunks_exact(16));
        let tail = dot_tail(a16.remainder(), b16.remainder().iter().copied());
        for (x, y) in a16.zip(b16) {
            s0 = _mm512_fmadd_ps(load(x), load(y), s0);
        }
        _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) + tail
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(crate) fn dot_f16(a: &[f32], b: &[f16]) -> f32 {
        let (mut s0, mut s1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let (a32, b32) = (a.chunks_exact(32), b.chunks_exact(32));
        let (ra, rb) = (a32.remainder(), b32.remainder());
        for (x, y) in a32.zip(b32) {
            s0 = _mm512_fmadd_ps(load(x), load_f16(y), s0);
            s1 = _mm512_fmadd_ps(load(&x[16..]), load_f16(&y[16..]), s1);
        }
        let (a16, b16) = (ra.chunks_exact(16), rb.chunks_exact(16));
        let tail = dot_tail(a16.remainder(), b16.remainder().iter().map(|h| h.to_f32()));
        for (x, y) in a16.zip(b16) {
            s0 = _mm512_fmadd_ps(load(x), load_f16(y), s0);
        }
        _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) + tail
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(crate) fn dot_q8(a: &[f32], blocks: &[u8]) -> f32 {
        let mut acc = _mm512_setzero_ps();
        for (x, b) in a.chunks_exact(32).zip(blocks.chunks_exact(34)) {
            let d = scale(b);
            let s = _mm512_fmadd_ps(load(&x[16..]), load_i8(&b[18..]), _mm512_mul_ps(load(x), load_i8(&b[2..])));
            acc = _mm512_fmadd_ps(_mm512_set1_ps(d), s, acc);
        }
        _mm512_reduce_add_ps(acc)
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(crate) fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        let va = _mm512_set1_ps(a);
        let n = x.len().min(y.len()) / 16 * 16;
        for (xv, yv) in x[n..].iter().zip(&mut y[n..]) {
            *yv += a * xv;
        }
        for (xv, yv) in x[..n].chunks_exact(16).zip(y[..n].chunks_exact_mut(16)) {
            let r = _mm512_fmadd_ps(va, load(xv), load(yv));
            store(yv, r);
        }
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(crate) fn axpy_f16(a: f32, x: &[f16], y: &mut [f32]) {
        let va = _mm512_set1_ps(a);
        let n = x.len().min(y.len()) / 16 * 16;
        for (xv, yv) in x[n..].iter().zip(&mut y[n..]) {
            *yv += a * xv.to_f32();
        }
        for (xv, yv) in x[..n].chunks_exact(16).zip(y[..n].chunks_exact_mut(16)) {
            let r = _mm512_fmadd_ps(va, load_f16(xv), load(yv));
            store(yv, r);
        }
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(crate) fn axpy_q8(a: f32, blocks: &[u8], y: &mut [f32]) {
        for (yb, b) in y.chunks_exact_mut(32).zip(blocks.chunks_exact(34)) {
            let ad = _mm512_set1_ps(a * scale(b));
            let lo = _mm512_fmadd_ps(ad, load_i8(&b[2..]), load(yb));
            let hi = _mm512_fmadd_ps(ad, load_i8(&b[18..]), load(&yb[16..]));
            store(yb, lo);
            store(&mut yb[16..], hi);
        }
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(crate) fn max(x: &[f32]) -> f32 {
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        let x16 = x.chunks_exact(16);
        let tail = x16.remainder().iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for v in x16 {
            m = _mm512_max_ps(m, load(v));
        }
        _mm512_reduce_max_ps(m).max(tail)
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(crate) fn exp_sum(x: &mut [f32], sub: f32) -> f32 {
        let (vs, mut acc) = (_mm512_set1_ps(sub), _mm512_setzero_ps());
        let n = x.len() / 16 * 16;
        let mut tail = 0.0;
        for v in &mut x[n..] {
            *v = (*v - sub).exp();
            tail += *v;
        }
        for v in x[..n].chunks_exact_mut(16) {
            let e = exp(_mm512_sub_ps(load(v), vs));
            acc = _mm512_add_ps(acc, e);
            store(v, e);
        }
        _mm512_reduce_add_ps(acc) + tail
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(crate) fn sum_squares(x: &[f32]) -> f32 {
        dot(x, x)
    }

    /// Tiles of 4 rows x 32 columns summed in registers over the whole depth, column panels
    /// outermost so that a panel of `b` stays in L1 for every row tile; columns past the last
    /// whole tile by the scalar kernel.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(crate) fn matmul_add(m: usize, n: usize, depth: usize, a: &[f32], lda: usize, b: &[f32], ldb: usize, c: &mut [f32], ldc: usize) {
        matmul_add_by_tiles!(32, m, n, depth, a, lda, b, ldb, c, ldc);
    }

    /// `R` rows x 32 columns of [`matmul_add`].
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn tile<const R: usize>(depth: usize, a: &[f32], lda: usize, b: &[f32], ldb: usize, c: &mut [f32], ldc: usize) {
        let rows: [&[f32]; R] = std::array::from_fn(|r| &a[r * lda..r * lda + depth]);
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        for i in 0..depth {
            let panel = &b[i * ldb..i * ldb + 32];
            let (b0, b1) = (load(panel), load(&panel[16..]));
            for (acc, row) in acc.iter_mut().zip(&rows) {
                let x = _mm512_set1_ps(row[i]);
                acc[0] = _mm512_fmadd_ps(x, b0, acc[0]);
                acc[1] = _mm512_fmadd_ps(x, b1, acc[1]);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            let out = &mut c[r * ldc..r * ldc + 32];
            let (lo, hi) = (_mm512_add_ps(load(out), acc[0]), _mm512_add_ps(load(&out[16..]), acc[1]));
            store(out, lo);
            store(&mut out[16..], hi);
        }
    }
}
