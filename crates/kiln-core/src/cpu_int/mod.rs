//! Matmuls on 8-bit quantized activations with integer dot products, for every
//! block format with an integer form (`kiln_quant::int_rows`).
//!
//! Each weight row is decoded once per matmul into biased u8 codes with per-group
//! scales (SIMD decoders where the format has one), then multiplied with
//! the activation codes in i32: one row at a time against each token for decode
//! steps, and in register tiles of rows × 16 tokens for prompts and batches, so a
//! decoded row is reused by every token. The scalar kernels are the reference.

pub mod acts;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx_vnni;
pub mod float;
#[cfg(target_arch = "x86_64")]
mod fused_avx2;
#[cfg(target_arch = "x86_64")]
mod fused_avx512;
#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(target_arch = "aarch64")]
pub(crate) use neon::prefetch_line;
pub mod scalar;

use std::cell::RefCell;

use kiln_quant::int_rows::{decode_int_row, int_layout, IntLayout};
use rayon::prelude::*;

use crate::backend::WeightSource;
use crate::cpu::SharedOut;
pub use acts::{QuantizedActs, TOKEN_TILE};

/// The instruction set the integer kernels use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimdLevel {
    Scalar,
    /// AVX2 + FMA (+ F16C), `vpmaddubsw` on signed or small codes.
    Avx2,
    /// AVX2 + FMA with the 256-bit VNNI `vpdpbusd` (AVX-VNNI: CPUs without AVX-512).
    AvxVnni,
    /// AVX-512F/BW with VNNI `vpdpbusd`.
    Avx512Vnni,
    /// aarch64 NEON, widening to i16 and i32.
    Neon,
    /// aarch64 NEON with the dot product extension (`sdot`).
    NeonDot,
}

impl SimdLevel {
    /// Every level of every target, narrowest first within each target.
    pub const ALL: [SimdLevel; 6] = [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::AvxVnni, SimdLevel::Avx512Vnni, SimdLevel::Neon, SimdLevel::NeonDot];

    /// The best level this CPU runs.
    pub fn detect() -> SimdLevel {
        Self::ALL.into_iter().rev().find(|l| l.is_available()).unwrap_or(SimdLevel::Scalar)
    }

    pub fn is_available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                SimdLevel::Scalar => true,
                SimdLevel::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c"),
                SimdLevel::AvxVnni => SimdLevel::Avx2.is_available() && is_x86_feature_detected!("avxvnni"),
                SimdLevel::Avx512Vnni => {
                    is_x86_feature_detected!("avx512f")
                        && is_x86_feature_detected!("avx512bw")
                        && is_x86_feature_detected!("avx512vl")
                        && is_x86_feature_detected!("avx512vnni")
                        && is_x86_feature_detected!("f16c")
                }
                SimdLevel::Neon | SimdLevel::NeonDot => false,
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            match self {
                SimdLevel::Scalar | SimdLevel::Neon => true,
                SimdLevel::NeonDot => std::arch::is_aarch64_feature_detected!("dotprod"),
                SimdLevel::Avx2 | SimdLevel::AvxVnni | SimdLevel::Avx512Vnni => false,
            }
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            self == SimdLevel::Scalar
        }
    }
}

/// One decoded weight row: value i = `scale[g] * (codes[i] - 128) + offset[g]`, g = i / group.
pub struct DecodedRow<'a> {
    pub codes: &'a [u8],
    pub scale: &'a [f32],
    pub offset: &'a [f32],
    pub group: usize,
    pub has_offset: bool,
}

/// Rows × tokens at which the tiled mat-mat kernel takes over from row-by-row dot products.
pub const MATMAT_MIN_TOKENS: usize = 4;
/// Rows in one mat-mat register tile.
const TILE_ROWS: usize = 8;

/// `row · x[t]` at `level` (which must be available); `coef` is scratch of `cols / group + 16`.
pub fn matvec_row(level: SimdLevel, row: &DecodedRow, acts: &QuantizedActs, t: usize, coef: &mut [f32]) -> f32 {
    #[cfg(not(target_arch = "x86_64"))]
    let _ = coef;
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level was checked available when chosen; lengths match by construction.
        SimdLevel::Avx512Vnni => unsafe { avx512::matvec_row(row, acts, t, coef) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        SimdLevel::AvxVnni => unsafe { avx_vnni::matvec_row(row, acts, t, coef) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        SimdLevel::Avx2 => unsafe { avx2::matvec_row(row, acts, t, coef) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above.
        SimdLevel::NeonDot => unsafe { neon::matvec_row_dot(row, acts, t) },
        #[cfg(target_arch = "aarch64")]
        SimdLevel::Neon => neon::matvec_row(row, acts, t),
        _ => scalar::matvec_row(row, acts, t),
    }
}

/// Up to [`TILE_ROWS`] rows × token tile `tile` (`acts` quantized with `tiled`).
pub fn matmat_tile(level: SimdLevel, rows: &[DecodedRow], acts: &QuantizedActs, tile: usize, out: &mut [[f32; TOKEN_TILE]], coef: &mut [f32]) {
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level was checked available when chosen; the tiled layout exists.
        SimdLevel::Avx512Vnni => unsafe { avx512::matmat_tile(rows, acts, tile, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        SimdLevel::AvxVnni => unsafe { avx_vnni::matmat_tile(rows, acts, tile, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        SimdLevel::Avx2 => unsafe { avx2::matmat_tile(rows, acts, tile, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above.
        SimdLevel::NeonDot => unsafe { neon::matmat_tile(rows, acts, tile, out) },
        SimdLevel::Scalar => scalar::matmat_tile(rows, acts, tile, out),
        _ => {
            // Without a 4-way byte dot product across token lanes, row-by-row it is.
            for (row, out) in rows.iter().zip(out) {
                for (lane, o) in out.iter_mut().enumerate() {
                    let t = tile * TOKEN_TILE + lane;
                    *o = if t < acts.n { matvec_row(level, row, acts, t, coef) } else { 0.0 };
                }
            }
        }
    }
}

/// A kernel that dots packed rows of one format with a token's activations directly.
#[derive(Clone, Copy)]
struct FusedKernel {
    #[cfg(target_arch = "x86_64")]
    row: fused_avx512::FusedRow,
    /// The kernel requests its row's bytes ahead of use itself (the AVX2 ones), so the caller
    /// does not prefetch rows for it.
    prefetches: bool,
}

impl FusedKernel {
    fn find(level: SimdLevel, ty: kiln_quant::GgmlType) -> Option<FusedKernel> {
        #[cfg(target_arch = "x86_64")]
        match level {
            SimdLevel::Avx512Vnni => return fused_avx512::kernel(ty).map(|row| FusedKernel { row, prefetches: false }),
            SimdLevel::Avx2 => return fused_avx2::kernel(ty).map(|row| FusedKernel { row, prefetches: true }),
            _ => {}
        }
        let _ = (level, ty);
        None
    }

    fn dot(self, row: &[u8], acts: &QuantizedActs, t: usize) -> f32 {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: found only for an available level; `row` holds exactly `acts.cols` values of its format.
        return unsafe { (self.row)(row, acts, t) };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("no fused kernels on this target: {row:?} {}", acts.n + t)
    }
}

/// How far ahead of the row being multiplied its task's weight bytes are requested from
/// memory, so that a decode step's weight stream does not wait on each new row.
pub(crate) const PREFETCH_BYTES: usize = 4096;

/// Asks for `bytes` to be brought into the caches.
#[inline]
pub(crate) fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        // SAFETY: a prefetch hint on a valid address; it never faults.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(line.as_ptr().cast()) };
    }
    #[cfg(target_arch = "aarch64")]
    for line in bytes.chunks(64) {
        neon::prefetch_line(line.as_ptr());
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = bytes;
}

/// Whether `ty` goes through these kernels.
pub fn supports(w: &WeightSource) -> bool {
    int_layout(w.ty).is_some()
}

#[derive(Default)]
struct Scratch {
    codes: Vec<u8>,
    scale: Vec<f32>,
    offset: Vec<f32>,
    coef: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// `out[t * rows + r] = W[r] · x[t]` for the `acts.n` tokens; `acts` tiled when
/// `acts.n >= MATMAT_MIN_TOKENS`.
pub(crate) fn matmul(level: SimdLevel, w: &WeightSource, acts: &QuantizedActs, out: SharedOut) {
    let layout = int_layout(w.ty).expect("caller checked `supports`");
    let (rows, cols, n) = (w.rows, w.cols, acts.n);
    let rows_per_task = if n >= MATMAT_MIN_TOKENS { TILE_ROWS } else { (16384 / cols).clamp(1, 64) };
    let fused = if n < MATMAT_MIN_TOKENS { FusedKernel::find(level, w.ty) } else { None };
    let row_bytes = cols / w.ty.block_size() * w.ty.type_size();
    (0..rows.div_ceil(rows_per_task)).into_par_iter().for_each(|task| {
        let first = task * rows_per_task;
        let count = rows_per_task.min(rows - first);
        if let Some(kernel) = fused {
            let all = w.bytes();
            for r in first..first + count {
                let bytes = &all[r * row_bytes..(r + 1) * row_bytes];
                if !kernel.prefetches {
                    let ahead = (r + 1) * row_bytes + PREFETCH_BYTES.max(row_bytes);
                    prefetch(&all[(ahead - row_bytes).min(all.len())..ahead.min(all.len())]);
                }
                for t in 0..n {
                    // SAFETY: row r belongs to this task alone; in bounds as checked by the caller.
                    unsafe { out.write(t * rows + r, kernel.dot(bytes, acts, t)) };
                }
            }
            return;
        }
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            decode_rows(w, layout, first, count, &mut s);
            let Scratch { codes, scale, offset, coef } = &mut *s;
            let groups = cols / layout.group;
            let row = |i: usize| DecodedRow {
                codes: &codes[i * cols..(i + 1) * cols],
                scale: &scale[i * groups..(i + 1) * groups],
                offset: &offset[i * groups..(i + 1) * groups],
                group: layout.group,
                has_offset: layout.has_offset,
            };
            if n >= MATMAT_MIN_TOKENS {
                let tile_rows: [DecodedRow; TILE_ROWS] = std::array::from_fn(|i| row(i.min(count - 1)));
                let mut tile_out = [[0f32; TOKEN_TILE]; TILE_ROWS];
                for tile in 0..acts.n_tiles() {
                    matmat_tile(level, &tile_rows[..count], acts, tile, &mut tile_out[..count], coef);
                    for (i, lanes) in tile_out[..count].iter().enumerate() {
                        for (lane, &v) in lanes.iter().enumerate().take(n - tile * TOKEN_TILE) {
                            // SAFETY: row first + i belongs to this task alone; in bounds as checked by the caller.
                            unsafe { out.write((tile * TOKEN_TILE + lane) * rows + first + i, v) };
                        }
                    }
                }
            } else {
                for i in 0..count {
                    for t in 0..n {
                        let v = matvec_row(level, &row(i), acts, t, coef);
                        // SAFETY: as above.
                        unsafe { out.write(t * rows + first + i, v) };
                    }
                }
            }
        })
    });
}

/// The expert products of [`crate::Backend::moe_matmul`]: slot `s` (token `s / n_used`) times
/// expert `ids[s]`, reading input row `input_row(s)` of `acts`. Each row of a chosen expert is
/// decoded once for all slots that chose it; experts nobody chose are never read.
pub(crate) fn moe_matmul(
    level: SimdLevel,
    experts: &[WeightSource],
    acts: &QuantizedActs,
    ids: &[f32],
    input_row: impl Fn(usize) -> usize + Sync,
    out: SharedOut,
) {
    let first = &experts[0];
    let layout = int_layout(first.ty).expect("caller checked `supports`");
    let (rows, cols) = (first.rows, first.cols);
    let rows_per_task = (16384 / cols).clamp(1, 64);
    let blocks = rows.div_ceil(rows_per_task);
    let fused = FusedKernel::find(level, first.ty);
    let row_bytes = cols / first.ty.block_size() * first.ty.type_size();
    (0..experts.len() * blocks).into_par_iter().for_each(|task| {
        let (e, block) = (task / blocks, task % blocks);
        let id = e as f32;
        if !ids.contains(&id) {
            return;
        }
        let first_row = block * rows_per_task;
        let count = rows_per_task.min(rows - first_row);
        if let Some(kernel) = fused {
            let all = experts[e].bytes();
            for r in first_row..first_row + count {
                let bytes = &all[r * row_bytes..(r + 1) * row_bytes];
                if !kernel.prefetches {
                    let ahead = (r + 1) * row_bytes + PREFETCH_BYTES;
                    prefetch(&all[(ahead - row_bytes).min(all.len())..ahead.min(all.len())]);
                }
                for (slot, _) in ids.iter().enumerate().filter(|(_, &chosen)| chosen == id) {
                    // SAFETY: slot `slot` of expert e, row r is written by this task only; bounds checked by the caller.
                    unsafe { out.write(slot * rows + r, kernel.dot(bytes, acts, input_row(slot))) };
                }
            }
            return;
        }
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            decode_rows(&experts[e], layout, first_row, count, &mut s);
            let Scratch { codes, scale, offset, coef } = &mut *s;
            let groups = cols / layout.group;
            for i in 0..count {
                let row = DecodedRow {
                    codes: &codes[i * cols..(i + 1) * cols],
                    scale: &scale[i * groups..(i + 1) * groups],
                    offset: &offset[i * groups..(i + 1) * groups],
                    group: layout.group,
                    has_offset: layout.has_offset,
                };
                for (slot, _) in ids.iter().enumerate().filter(|(_, &chosen)| chosen == id) {
                    let v = matvec_row(level, &row, acts, input_row(slot), coef);
                    // SAFETY: slot `slot` of expert e, row first_row + i is written by this task only; bounds checked by the caller.
                    unsafe { out.write(slot * rows + first_row + i, v) };
                }
            }
        })
    });
}

fn decode_rows(w: &WeightSource, layout: IntLayout, first: usize, count: usize, s: &mut Scratch) {
    let cols = w.cols;
    let groups = cols / layout.group;
    let row_bytes = cols / w.ty.block_size() * w.ty.type_size();
    for v in [&mut s.scale, &mut s.offset] {
        if v.len() < count * groups {
            v.resize(count * groups, 0.0);
        }
    }
    if s.codes.len() < count * cols {
        s.codes.resize(count * cols, 0);
    }
    if s.coef.len() < groups + 16 {
        s.coef.resize(groups + 16, 0.0);
    }
    let all = w.bytes();
    let bytes = &all[first * row_bytes..(first + count) * row_bytes];
    for i in 0..count {
        let ahead = (first + i + 1) * row_bytes + PREFETCH_BYTES;
        prefetch(&all[(ahead - row_bytes).min(all.len())..ahead.min(all.len())]);
        let (scale, offset) = (&mut s.scale[i * groups..(i + 1) * groups], &mut s.offset[i * groups..(i + 1) * groups]);
        decode_int_row(w.ty, &bytes[i * row_bytes..(i + 1) * row_bytes], &mut s.codes[i * cols..(i + 1) * cols], scale, offset)
            .expect("rows validated at upload");
    }
}
