//! Float weights (F32, F16, BF16) on the fast backend: each row is widened to f32 and
//! multiplied with the f32 activations by FMA, so nothing is rounded beyond f32 (no activation
//! quantization for float weights, as in llama.cpp's F16 path), 16 lanes wide at AVX-512 and 8 at
//! AVX2. Decode steps dot each row with
//! each token in registers; prompts and batches of [`TILED_MIN_TOKENS`] or more widen a block
//! of rows once and run the register-tiled f32 mat-mat over all tokens.

use std::cell::RefCell;

use kiln_quant::GgmlType;
use rayon::prelude::*;

use super::SimdLevel;
use crate::backend::WeightSource;
use crate::cpu::SharedOut;
use crate::cpu_simd::Simd;

/// Tokens from which the tiled path runs: the mat-mat's register tiles are 32 tokens wide, so
/// fewer would be mostly padding.
pub const TILED_MIN_TOKENS: usize = 32;
/// Token columns of the tiled path are padded to a multiple of this.
const TOKEN_PAD: usize = 32;
/// Weight rows widened together per task of the tiled path.
const TILED_ROWS: usize = 16;

thread_local! {
    /// The activations transposed to [cols][padded tokens], on the calling thread.
    static TRANSPOSED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// A task's widened rows and their outputs, on the thread running it.
    static ROWS: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Whether `w` is a float type these kernels handle at `level` (the x86 levels).
pub fn supports(level: SimdLevel, w: &WeightSource) -> bool {
    matches!(level, SimdLevel::Avx2 | SimdLevel::AvxVnni | SimdLevel::Avx512Vnni) && matches!(w.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// `out[t * rows + r] = W[r] · x[t]` for `n` tokens; `level` and `w.ty` as [`supports`] says.
pub(crate) fn matmul(level: SimdLevel, simd: Simd, w: &WeightSource, x: &[f32], n: usize, out: SharedOut) {
    let wide = level == SimdLevel::Avx512Vnni;
    if n >= TILED_MIN_TOKENS {
        return matmul_tiled(wide, simd, w, x, n, out);
    }
    let (rows, cols) = (w.rows, w.cols);
    let elem = w.ty.type_size();
    let rows_per_task = (16384 / cols.max(1)).clamp(1, 64);
    let all = w.bytes();
    let row_bytes = cols * elem;
    (0..rows.div_ceil(rows_per_task)).into_par_iter().for_each(|task| {
        for r in task * rows_per_task..((task + 1) * rows_per_task).min(rows) {
            let ahead = (r + 1) * row_bytes + super::PREFETCH_BYTES.max(row_bytes);
            super::prefetch(&all[(ahead - row_bytes).min(all.len())..ahead.min(all.len())]);
            let packed = &all[r * row_bytes..(r + 1) * row_bytes];
            for t in 0..n {
                let v = dot_row(wide, w.ty, packed, &x[t * cols..(t + 1) * cols]);
                // SAFETY: row r belongs to this task alone; in bounds as checked by the caller.
                unsafe { out.write(t * rows + r, v) };
            }
        }
    });
}

/// The tiled path: blocks of [`TILED_ROWS`] rows widened to f32 once, times the transposed
/// activations (`Simd::matmul_add`: each output sums its products in depth order).
fn matmul_tiled(avx512: bool, simd: Simd, w: &WeightSource, x: &[f32], n: usize, out: SharedOut) {
    let (rows, cols) = (w.rows, w.cols);
    let padded = n.next_multiple_of(TOKEN_PAD);
    let row_bytes = cols * w.ty.type_size();
    let all = w.bytes();
    TRANSPOSED.with(|cell| {
        let mut xt = cell.borrow_mut();
        xt.clear();
        xt.resize(cols * padded, 0.0);
        for (t, token) in x.chunks_exact(cols).take(n).enumerate() {
            for (c, &v) in token.iter().enumerate() {
                xt[c * padded + t] = v;
            }
        }
        let xt = &*xt;
        (0..rows.div_ceil(TILED_ROWS)).into_par_iter().for_each(|task| {
            let first = task * TILED_ROWS;
            let count = TILED_ROWS.min(rows - first);
            ROWS.with(|cell| {
                let mut scratch = cell.borrow_mut();
                let (wide, sums) = &mut *scratch;
                wide.resize(TILED_ROWS * cols, 0.0);
                sums.clear();
                sums.resize(TILED_ROWS * padded, 0.0);
                for (r, dst) in wide.chunks_exact_mut(cols).take(count).enumerate() {
                    let packed = &all[(first + r) * row_bytes..(first + r + 1) * row_bytes];
                    widen_row(avx512, w.ty, packed, dst);
                }
                simd.matmul_add(count, padded, cols, wide, cols, xt, padded, sums, padded);
                for r in 0..count {
                    for t in 0..n {
                        // SAFETY: rows first..first + count belong to this task alone; in bounds as checked by the caller.
                        unsafe { out.write(t * rows + first + r, sums[r * padded + t]) };
                    }
                }
            });
        });
    });
}

/// One packed row of `ty` dotted with `x`, in f32: 16 lanes at a time when `wide` (AVX-512),
/// else 8 (AVX2).
fn dot_row(wide: bool, ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `supports` admitted only an x86 level this CPU has (AVX-512 when `wide`, else at
    // least AVX2 with FMA and F16C); the row holds `x.len()` values of `ty`.
    return unsafe {
        if wide {
            avx512::dot(ty, row, x)
        } else {
            avx2::dot(ty, row, x)
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("no float kernels on this target: {wide} {ty} {} {}", row.len(), x.len())
}

/// One packed row of `ty` widened to f32 into `dst`.
fn widen_row(wide: bool, ty: GgmlType, row: &[u8], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as in `dot_row`.
    return unsafe {
        if wide {
            avx512::widen(ty, row, dst)
        } else {
            avx2::widen(ty, row, dst)
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("no float kernels on this target: {wide} {ty} {} {}", row.len(), dst.len())
}

/// The value `i` of a row of `ty` as f32 (the tails of the SIMD loops).
#[cfg(target_arch = "x86_64")]
fn value(ty: GgmlType, row: &[u8], i: usize) -> f32 {
    match ty {
        GgmlType::F16 => half::f16::from_le_bytes([row[2 * i], row[2 * i + 1]]).to_f32(),
        GgmlType::BF16 => half::bf16::from_le_bytes([row[2 * i], row[2 * i + 1]]).to_f32(),
        _ => f32::from_le_bytes([row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]]),
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use kiln_quant::GgmlType;

    use super::value;

    /// Values `k..k + 8` of a row of `ty` as f32.
    ///
    /// # Safety
    /// AVX2 and F16C; the 8 values lie inside the row at `p`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(ty: GgmlType, p: *const u8, k: usize) -> __m256 {
        match ty {
            GgmlType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * k).cast())),
            GgmlType::BF16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(2 * k).cast())))),
            _ => _mm256_loadu_ps(p.add(4 * k).cast()),
        }
    }

    /// A row of `out.len()` values of `ty` widened to f32.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; `row` holds `out.len()` values of `ty`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn widen(ty: GgmlType, row: &[u8], out: &mut [f32]) {
        let n = out.len();
        let mut k = 0;
        while k + 8 <= n {
            _mm256_storeu_ps(out.as_mut_ptr().add(k), load8(ty, row.as_ptr(), k));
            k += 8;
        }
        for (i, o) in out.iter_mut().enumerate().skip(k) {
            *o = value(ty, row, i);
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C must be available; `row` holds `x.len()` values of `ty`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
        let n = x.len();
        let p = row.as_ptr();
        // SAFETY: callers below keep k + 8 <= n, so 8 values of the row's type lie inside it.
        let load = |k: usize| -> __m256 { load8(ty, p, k) };
        // Four accumulators: an FMA's latency is four of its issue slots.
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut k = 0;
        while k + 32 <= n {
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(load(k + 8 * j), _mm256_loadu_ps(x.as_ptr().add(k + 8 * j)), *a);
            }
            k += 32;
        }
        while k + 8 <= n {
            acc[0] = _mm256_fmadd_ps(load(k), _mm256_loadu_ps(x.as_ptr().add(k)), acc[0]);
            k += 8;
        }
        let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps::<1>(sum));
        let pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
        let mut total = _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps::<1>(pair, pair)));
        for (i, &v) in x.iter().enumerate().skip(k) {
            total += value(ty, row, i) * v;
        }
        total
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use kiln_quant::GgmlType;

    use super::value;

    /// Values `k..k + 16` of a row of `ty` as f32.
    ///
    /// # Safety
    /// AVX-512F/BW; the 16 values lie inside the row at `p`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    unsafe fn load16(ty: GgmlType, p: *const u8, k: usize) -> __m512 {
        match ty {
            GgmlType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.add(2 * k).cast())),
            GgmlType::BF16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.add(2 * k).cast())))),
            _ => _mm512_loadu_ps(p.add(4 * k).cast()),
        }
    }

    /// A row of `out.len()` values of `ty` widened to f32.
    ///
    /// # Safety
    /// AVX-512F/BW must be available; `row` holds `out.len()` values of `ty`.
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    pub unsafe fn widen(ty: GgmlType, row: &[u8], out: &mut [f32]) {
        let n = out.len();
        let mut k = 0;
        while k + 16 <= n {
            _mm512_storeu_ps(out.as_mut_ptr().add(k), load16(ty, row.as_ptr(), k));
            k += 16;
        }
        for (i, o) in out.iter_mut().enumerate().skip(k) {
            *o = value(ty, row, i);
        }
    }

    /// # Safety
    /// AVX-512F/BW must be available; `row` holds `x.len()` values of `ty` (F32, F16 or BF16).
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    pub unsafe fn dot(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
        let n = x.len();
        let p = row.as_ptr();
        // SAFETY: callers below keep k + 16 <= n, so 16 values of the row's type lie inside it.
        let load = |k: usize| -> __m512 { load16(ty, p, k) };
        let (mut acc0, mut acc1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut k = 0;
        while k + 32 <= n {
            acc0 = _mm512_fmadd_ps(load(k), _mm512_loadu_ps(x.as_ptr().add(k)), acc0);
            acc1 = _mm512_fmadd_ps(load(k + 16), _mm512_loadu_ps(x.as_ptr().add(k + 16)), acc1);
            k += 32;
        }
        if k + 16 <= n {
            acc0 = _mm512_fmadd_ps(load(k), _mm512_loadu_ps(x.as_ptr().add(k)), acc0);
            k += 16;
        }
        let mut total = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
        for (i, &v) in x.iter().enumerate().skip(k) {
            total += value(ty, row, i) * v;
        }
        total
    }
}
