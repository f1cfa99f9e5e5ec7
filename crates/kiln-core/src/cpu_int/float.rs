//! Float weights (F32, F16, BF16) on the fast backend: each row is widened to f32 in
//! registers and multiplied with the f32 activations by FMA, so nothing is rounded beyond
//! f32 (no activation quantization for float weights, as in llama.cpp's F16 path).

use kiln_quant::GgmlType;
use rayon::prelude::*;

use super::SimdLevel;
use crate::backend::WeightSource;
use crate::cpu::SharedOut;

/// Whether `w` is a float type these kernels handle at `level`.
pub fn supports(level: SimdLevel, w: &WeightSource) -> bool {
    level == SimdLevel::Avx512Vnni && matches!(w.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// `out[t * rows + r] = W[r] · x[t]` for `n` tokens; `level` and `w.ty` as [`supports`] says.
pub(crate) fn matmul(w: &WeightSource, x: &[f32], n: usize, out: SharedOut) {
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
            let (ty, row) = (w.ty, packed);
            for t in 0..n {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `supports` checked the level is available; the row holds `cols` values of `ty`.
                let v = unsafe { avx512::dot(ty, row, &x[t * cols..(t + 1) * cols]) };
                #[cfg(not(target_arch = "x86_64"))]
                let v = unreachable!("no float kernels on this target: {row:?}");
                // SAFETY: row r belongs to this task alone; in bounds as checked by the caller.
                unsafe { out.write(t * rows + r, v) };
            }
        }
    });
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use kiln_quant::GgmlType;

    /// # Safety
    /// AVX-512F/BW must be available; `row` holds `x.len()` values of `ty` (F32, F16 or BF16).
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    pub unsafe fn dot(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
        let n = x.len();
        let p = row.as_ptr();
        let load = |k: usize| -> __m512 {
            // SAFETY: k + 16 <= n, so 16 values of the row's type lie inside it.
            match ty {
                GgmlType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.add(2 * k).cast())),
                GgmlType::BF16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.add(2 * k).cast())))),
                _ => _mm512_loadu_ps(p.add(4 * k).cast()),
            }
        };
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
        for i in k..n {
            let v = match ty {
                GgmlType::F16 => half::f16::from_le_bytes([row[2 * i], row[2 * i + 1]]).to_f32(),
                GgmlType::BF16 => half::bf16::from_le_bytes([row[2 * i], row[2 * i + 1]]).to_f32(),
                _ => f32::from_le_bytes([row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]]),
            };
            total += v * x[i];
        }
        total
    }
}
