//! Float weights (F32, F16, BF16) on the fast backend: each row is widened to f32 and
//! multiplied with the f32 activations by FMA, so nothing is rounded beyond f32 (no activation
//! quantization for float weights, as in llama.cpp's F16 path). Decode steps dot each row with
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

/// Whether `w` is a float type these kernels handle at `level`.
pub fn supports(level: SimdLevel, w: &WeightSource) -> bool {
    level == SimdLevel::Avx512Vnni && matches!(w.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// `out[t * rows + r] = W[r] · x[t]` for `n` tokens; `level` and `w.ty` as [`supports`] says.
pub(crate) fn matmul(simd: Simd, w: &WeightSource, x: &[f32], n: usize, out: SharedOut) {
    if n >= TILED_MIN_TOKENS {
        return matmul_tiled(simd, w, x, n, out);
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
                let v = dot_row(w.ty, packed, &x[t * cols..(t + 1) * cols]);
                // SAFETY: row r belongs to this task alone; in bounds as checked by the caller.
                unsafe { out.write(t * rows + r, v) };
            }
        }
    });
}

/// The tiled path: blocks of [`TILED_ROWS`] rows widened to f32 once, times the transposed
/// activations (`Simd::matmul_add`: each output sums its products in depth order).
fn matmul_tiled(simd: Simd, w: &WeightSource, x: &[f32], n: usize, out: SharedOut) {
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
                    widen_row(w.ty, packed, dst);
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

/// One packed row of `ty` dotted with `x`, in f32.
fn dot_row(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `supports` admitted only an AVX-512 level this CPU has; the row holds `x.len()` values of `ty`.
    return unsafe { avx512::dot(ty, row, x) };
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("no float kernels on this target: {ty} {} {}", row.len(), x.len())
}

/// One packed row of `ty` widened to f32 into `dst`.
fn widen_row(ty: GgmlType, row: &[u8], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as in `dot_row`.
    return unsafe { avx512::widen(ty, row, dst) };
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("no float kernels on this target: {ty} {} {}", row.len(), dst.len())
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use kiln_quant::GgmlType;

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

    /// The value `i` of a row of `ty` as f32.
    fn value(ty: GgmlType, row: &[u8], i: usize) -> f32 {
        match ty {
            GgmlType::F16 => half::f16::from_le_bytes([row[2 * i], row[2 * i + 1]]).to_f32(),
            GgmlType::BF16 => half::bf16::from_le_bytes([row[2 * i], row[2 * i + 1]]).to_f32(),
            _ => f32::from_le_bytes([row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]]),
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
