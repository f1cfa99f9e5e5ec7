//! SIMD decoders for [`int_rows`](crate::int_rows), chosen at run time by CPU
//! feature detection. Each writes exactly what the scalar decoder writes: codes
//! byte for byte, and scales and offsets from the same f32 operations.
//!
//! There is one level, AVX2: AVX-512 kernels for the K-quants measured 0-20% faster
//! (the scales and stores dominate, not the bit unpacking), and their intrinsics need
//! Rust 1.89 while the workspace supports 1.87. [`SimdLevel`] leaves room for more.

use crate::GgmlType;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod grids;
#[cfg(target_arch = "x86_64")]
mod util;

/// An instruction set level with its own decoders.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimdLevel {
    /// AVX2 with FMA and F16C (Haswell, Zen 1 and later).
    Avx2,
}

/// The levels this CPU runs, lowest first (empty off x86-64).
pub fn available_levels() -> &'static [SimdLevel] {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static LEVELS: OnceLock<&'static [SimdLevel]> = OnceLock::new();
        LEVELS.get_or_init(|| {
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            if avx2 {
                &[SimdLevel::Avx2]
            } else {
                &[]
            }
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        &[]
    }
}

/// Decodes with the best SIMD path of this CPU when the format has one; `false` leaves the
/// work to the scalar decoder. Lengths are checked by the caller.
pub(crate) fn decode(ty: GgmlType, src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) -> bool {
    match available_levels().last() {
        Some(&level) => decode_at(level, ty, src, codes, scale, offset),
        None => false,
    }
}

/// Decodes at `level`, or returns `false` where this CPU lacks it or the format has no
/// kernel there. Lengths are checked by the caller.
pub(crate) fn decode_at(level: SimdLevel, ty: GgmlType, src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) -> bool {
    if !available_levels().contains(&level) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        match level {
            // SAFETY: the CPU has every feature of this level (checked above).
            SimdLevel::Avx2 => unsafe { avx2::decode(ty, src, codes, scale, offset) },
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ty, src, codes, scale, offset);
        false
    }
}
