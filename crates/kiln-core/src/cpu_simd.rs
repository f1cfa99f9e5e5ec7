//! Run-time dispatched f32 kernels for the CPU backend's attention and element-wise ops.
//!
//! The crate is built for baseline x86-64, so wider instructions are used only after the CPU
//! was seen to have them. A [`Simd`] value is proof of that: it is made by [`Simd::best`] or,
//! for tests that force a narrower level, [`Simd::at`], and every kernel dispatches on it. The
//! scalar kernels are the reference the others are tested against.

use std::sync::OnceLock;

use half::f16;

#[cfg(target_arch = "aarch64")]
use crate::cpu_simd_neon as neon;
#[cfg(target_arch = "x86_64")]
use crate::cpu_simd_x86 as x86;

/// An instruction-set level, widest last.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    Scalar,
    /// AVX2 with FMA and F16C.
    Avx2,
    /// AVX-512F, on top of everything `Avx2` needs.
    Avx512,
    /// aarch64 NEON (part of the baseline there).
    Neon,
}

impl SimdLevel {
    /// Every level of every target.
    pub const ALL: [SimdLevel; 4] = [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512, SimdLevel::Neon];

    fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            match self {
                SimdLevel::Scalar => true,
                SimdLevel::Avx2 => avx2,
                SimdLevel::Avx512 => avx2 && is_x86_feature_detected!("avx512f"),
                SimdLevel::Neon => false,
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            matches!(self, SimdLevel::Scalar | SimdLevel::Neon)
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            self == SimdLevel::Scalar
        }
    }
}

/// A level this CPU supports; kernels are its methods.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Simd(SimdLevel);

/// Every kernel has the same shape: the x86 or NEON version for the level, else the scalar one.
macro_rules! dispatch {
    ($simd:expr, $avx512:ident, $avx2:ident, $f:ident($($arg:expr),*)) => {
        dispatch!($simd, $avx512, $avx2, $f($($arg),*), scalar::$f($($arg),*))
    };
    ($simd:expr, $avx512:ident, $avx2:ident, $f:ident($($arg:expr),*), $fallback:expr) => {{
        #[cfg(target_arch = "x86_64")]
        match $simd.0 {
            // SAFETY: a `Simd` holds a level only once the CPU was seen to support it, and
            // `Avx512` includes everything `Avx2` needs.
            SimdLevel::Avx512 => return unsafe { x86::$avx512::$f($($arg),*) },
            // SAFETY: as above.
            SimdLevel::Avx2 => return unsafe { x86::$avx2::$f($($arg),*) },
            SimdLevel::Scalar | SimdLevel::Neon => {}
        }
        #[cfg(target_arch = "aarch64")]
        if $simd.0 == SimdLevel::Neon {
            return neon::$f($($arg),*);
        }
        $fallback
    }};
}

/// `exp(x)` by `2^n * p(r)`, `x = n ln2 + r`, `|r| <= ln2 / 2`; the degree-7 Taylor
/// polynomial's truncation error there is 5e-9, below f32 rounding. Inputs under -87 give 0
/// (`exp(-87)` is 1.6e-38) and inputs over 88.3 give `exp(88.3)`; NaN stays NaN.
pub(crate) const EXP_LO: f32 = -87.0;
pub(crate) const EXP_HI: f32 = 88.3;
pub(crate) const LN2_HI: f32 = 0.693_145_75;
pub(crate) const LN2_LO: f32 = 1.428_606_8e-6;
pub(crate) const EXP_COEFFS: [f32; 8] = [1.0, 1.0, 0.5, 1.0 / 6.0, 1.0 / 24.0, 1.0 / 120.0, 1.0 / 720.0, 1.0 / 5040.0];

/// The scalar tail of every vector dot product.
pub(crate) fn dot_tail(a: &[f32], b: impl Iterator<Item = f32>) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The walk of `matmul_add` over tiles of 4 rows x `$cols` columns, shared by every level: each
/// level's `tile::<R>` does the arithmetic, the scalar kernel the columns past the last tile.
macro_rules! matmul_add_by_tiles {
    ($cols:expr, $m:expr, $n:expr, $depth:expr, $a:expr, $lda:expr, $b:expr, $ldb:expr, $c:expr, $ldc:expr) => {{
        let (m, n, depth, a, lda, b, ldb, c, ldc) = ($m, $n, $depth, $a, $lda, $b, $ldb, $c, $ldc);
        let wide = n / $cols * $cols;
        for j in (0..wide).step_by($cols) {
            for r in (0..m).step_by(4) {
                let (a, b, c) = (&a[r * lda..], &b[j..], &mut c[r * ldc + j..]);
                match m - r {
                    1 => tile::<1>(depth, a, lda, b, ldb, c, ldc),
                    2 => tile::<2>(depth, a, lda, b, ldb, c, ldc),
                    3 => tile::<3>(depth, a, lda, b, ldb, c, ldc),
                    _ => tile::<4>(depth, a, lda, b, ldb, c, ldc),
                }
            }
        }
        if wide < n {
            crate::cpu_simd::scalar::matmul_add(m, n - wide, depth, a, lda, &b[wide..], ldb, &mut c[wide..], ldc);
        }
    }};
}
pub(crate) use matmul_add_by_tiles;

/// One KV cache row's values for one head, in the cache's storage type.
#[derive(Clone, Copy)]
pub(crate) enum KvRow<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    /// The whole row's q8_0 blocks and the first column wanted.
    Q8 {
        blocks: &'a [u8],
        col: usize,
    },
}

impl KvRow<'_> {
    /// Starts loading the row into the cache. Attention walks rows of 128-512 bytes a cache
    /// row apart, too short a run for the hardware prefetcher to get ahead of.
    pub(crate) fn prefetch(self) {
        let (ptr, bytes) = match self {
            KvRow::F32(r) => (r.as_ptr() as *const u8, std::mem::size_of_val(r)),
            KvRow::F16(r) => (r.as_ptr() as *const u8, std::mem::size_of_val(r)),
            KvRow::Q8 { blocks, .. } => (blocks.as_ptr(), blocks.len()),
        };
        #[cfg(target_arch = "x86_64")]
        for at in (0..bytes).step_by(64) {
            // SAFETY: a prefetch never faults and changes nothing visible; SSE is baseline x86-64.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(ptr.add(at) as *const i8) };
        }
        #[cfg(target_arch = "aarch64")]
        for at in (0..bytes).step_by(64) {
            crate::cpu_int::prefetch_line(ptr.wrapping_add(at));
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        let _ = (ptr, bytes);
    }
}

impl Simd {
    /// The widest level this CPU supports, detected once.
    pub fn best() -> Simd {
        static BEST: OnceLock<SimdLevel> = OnceLock::new();
        Simd(*BEST.get_or_init(|| [SimdLevel::Avx512, SimdLevel::Avx2, SimdLevel::Neon].into_iter().find(|l| l.supported()).unwrap_or(SimdLevel::Scalar)))
    }

    /// `level`, if this CPU supports it.
    pub fn at(level: SimdLevel) -> Option<Simd> {
        level.supported().then_some(Simd(level))
    }

    pub fn level(self) -> SimdLevel {
        self.0
    }

    pub(crate) fn dot(self, a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        dispatch!(self, avx512, avx2, dot(a, b))
    }

    pub(crate) fn dot_f16(self, a: &[f32], b: &[f16]) -> f32 {
        assert_eq!(a.len(), b.len());
        dispatch!(self, avx512, avx2, dot_f16(a, b))
    }

    /// `a` against values `col..col + a.len()` of a row of q8_0 blocks.
    pub(crate) fn dot_q8(self, a: &[f32], blocks: &[u8], col: usize) -> f32 {
        assert!((col + a.len()).div_ceil(32) * 34 <= blocks.len());
        // The vector kernels take whole blocks.
        if !(col.is_multiple_of(32) && a.len().is_multiple_of(32)) {
            return scalar::dot_q8(a, blocks, col);
        }
        let whole = &blocks[col / 32 * 34..];
        dispatch!(self, avx512, avx2, dot_q8(a, whole), scalar::dot_q8(a, blocks, col))
    }

    /// `y += a * x`.
    pub(crate) fn axpy(self, a: f32, x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len(), y.len());
        dispatch!(self, avx512, avx2, axpy(a, x, y))
    }

    pub(crate) fn axpy_f16(self, a: f32, x: &[f16], y: &mut [f32]) {
        assert_eq!(x.len(), y.len());
        dispatch!(self, avx512, avx2, axpy_f16(a, x, y))
    }

    /// `y += a * x` with `x` values `col..col + y.len()` of a row of q8_0 blocks.
    pub(crate) fn axpy_q8(self, a: f32, blocks: &[u8], col: usize, y: &mut [f32]) {
        assert!((col + y.len()).div_ceil(32) * 34 <= blocks.len());
        if !(col.is_multiple_of(32) && y.len().is_multiple_of(32)) {
            return scalar::axpy_q8(a, blocks, col, y);
        }
        let whole = &blocks[col / 32 * 34..];
        dispatch!(self, avx512, avx2, axpy_q8(a, whole, y), scalar::axpy_q8(a, blocks, col, y))
    }

    pub(crate) fn dot_kv(self, a: &[f32], row: KvRow) -> f32 {
        match row {
            KvRow::F32(r) => self.dot(a, r),
            KvRow::F16(r) => self.dot_f16(a, r),
            KvRow::Q8 { blocks, col } => self.dot_q8(a, blocks, col),
        }
    }

    pub(crate) fn axpy_kv(self, a: f32, row: KvRow, y: &mut [f32]) {
        match row {
            KvRow::F32(r) => self.axpy(a, r, y),
            KvRow::F16(r) => self.axpy_f16(a, r, y),
            KvRow::Q8 { blocks, col } => self.axpy_q8(a, blocks, col, y),
        }
    }

    /// `c[r][j] += sum_i a[r][i] b[i][j]` for `r < m`, `j < n`, `i < depth`: row-major matrices
    /// in slices, row r of `a` starting at `r * lda` (of `b` at `r * ldb`, of `c` at `r * ldc`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul_add(self, m: usize, n: usize, depth: usize, a: &[f32], lda: usize, b: &[f32], ldb: usize, c: &mut [f32], ldc: usize) {
        if m == 0 || n == 0 || depth == 0 {
            return;
        }
        assert!(a.len() >= (m - 1) * lda + depth && b.len() >= (depth - 1) * ldb + n && c.len() >= (m - 1) * ldc + n);
        dispatch!(self, avx512, avx2, matmul_add(m, n, depth, a, lda, b, ldb, c, ldc))
    }

    /// The largest value (NaNs ignored), `-inf` for none.
    pub(crate) fn max(self, x: &[f32]) -> f32 {
        dispatch!(self, avx512, avx2, max(x))
    }

    /// `x = exp(x - sub)` in place; returns the sum.
    pub(crate) fn exp_sum(self, x: &mut [f32], sub: f32) -> f32 {
        dispatch!(self, avx512, avx2, exp_sum(x, sub))
    }

    pub(crate) fn sum_squares(self, x: &[f32]) -> f32 {
        dispatch!(self, avx512, avx2, sum_squares(x))
    }

    /// `out = x * s * w`, the scaling half of an RMS norm.
    pub(crate) fn rms_apply(self, x: &[f32], s: f32, w: &[f32], out: &mut [f32]) {
        assert!(x.len() == w.len() && x.len() == out.len());
        dispatch!(self, avx2, avx2, rms_apply(x, s, w, out))
    }

    /// `out = silu(gate) * up`.
    pub(crate) fn swiglu(self, gate: &[f32], up: &[f32], out: &mut [f32]) {
        assert!(gate.len() == up.len() && gate.len() == out.len());
        dispatch!(self, avx2, avx2, swiglu(gate, up, out))
    }

    /// `out = gelu_tanh(gate) * up`.
    pub(crate) fn geglu(self, gate: &[f32], up: &[f32], out: &mut [f32]) {
        assert!(gate.len() == up.len() && gate.len() == out.len());
        dispatch!(self, avx2, avx2, geglu(gate, up, out))
    }
}

/// The reference kernels: plain loops, with the formulas the backend always used.
pub(crate) mod scalar {
    use half::f16;

    pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
        crate::cpu::dot_f32(a, b)
    }

    pub(crate) fn dot_f16(a: &[f32], b: &[f16]) -> f32 {
        a.iter().zip(b).map(|(x, y)| x * y.to_f32()).sum()
    }

    /// Value `i` of a row of q8_0 blocks, as kiln-quant dequantizes it.
    fn q8_value(blocks: &[u8], i: usize) -> f32 {
        let b = &blocks[i / 32 * 34..];
        f16::from_le_bytes([b[0], b[1]]).to_f32() * b[2 + i % 32] as i8 as f32
    }

    pub(crate) fn dot_q8(a: &[f32], blocks: &[u8], col: usize) -> f32 {
        a.iter().enumerate().map(|(i, x)| x * q8_value(blocks, col + i)).sum()
    }

    pub(crate) fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
    }

    pub(crate) fn axpy_f16(a: f32, x: &[f16], y: &mut [f32]) {
        y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x.to_f32());
    }

    pub(crate) fn axpy_q8(a: f32, blocks: &[u8], col: usize, y: &mut [f32]) {
        y.iter_mut().enumerate().for_each(|(i, y)| *y += a * q8_value(blocks, col + i));
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul_add(m: usize, n: usize, depth: usize, a: &[f32], lda: usize, b: &[f32], ldb: usize, c: &mut [f32], ldc: usize) {
        for r in 0..m {
            let c_row = &mut c[r * ldc..r * ldc + n];
            for (i, &x) in a[r * lda..r * lda + depth].iter().enumerate() {
                axpy(x, &b[i * ldb..i * ldb + n], c_row);
            }
        }
    }

    pub(crate) fn max(x: &[f32]) -> f32 {
        x.iter().copied().fold(f32::NEG_INFINITY, f32::max)
    }

    pub(crate) fn exp_sum(x: &mut [f32], sub: f32) -> f32 {
        x.iter_mut().fold(0.0, |total, v| {
            *v = (*v - sub).exp();
            total + *v
        })
    }

    pub(crate) fn sum_squares(x: &[f32]) -> f32 {
        x.iter().map(|v| v * v).sum()
    }

    pub(crate) fn rms_apply(x: &[f32], s: f32, w: &[f32], out: &mut [f32]) {
        for ((o, v), w) in out.iter_mut().zip(x).zip(w) {
            *o = v * s * w;
        }
    }

    pub(crate) fn swiglu_one(g: f32, u: f32) -> f32 {
        g / (1.0 + (-g).exp()) * u
    }

    pub(crate) fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
        for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
            *o = swiglu_one(*g, *u);
        }
    }

    pub(crate) fn geglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
        for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
            *o = crate::cpu_ops::gelu_tanh(*g) * u;
        }
    }
}

#[cfg(test)]
#[path = "cpu_simd_tests.rs"]
pub(crate) mod tests;
