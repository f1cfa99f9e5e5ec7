//! SIMD decoders for [`int_rows`](crate::int_rows), chosen at run time by CPU
//! feature detection. Each writes exactly what the scalar decoder writes: codes
//! byte for byte, and scales and offsets from the same f32 operations.
//!
//! `avx2` covers every format it has a kernel for; `avx512` overrides the hottest
//! ones and falls back to `avx2` for the rest (its feature set includes AVX2's).

use crate::GgmlType;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod grids;
#[cfg(target_arch = "x86_64")]
mod util;

/// An instruction set level with its own decoders.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimdLevel {
    /// AVX2 with FMA and F16C (Haswell, Zen 1 and later).
    Avx2,
    /// AVX-512 F/BW/VL/VBMI on top of AVX2 (Ice Lake, Zen 4 and later).
    Avx512,
}

/// The levels this CPU runs, lowest first (empty off x86-64).
pub fn available_levels() -> &'static [SimdLevel] {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static LEVELS: OnceLock<&'static [SimdLevel]> = OnceLock::new();
        LEVELS.get_or_init(|| {
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            let avx512 = avx2
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vbmi");
            match (avx2, avx512) {
                (true, true) => &[SimdLevel::Avx2, SimdLevel::Avx512],
                (true, false) => &[SimdLevel::Avx2],
                _ => &[],
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
            // SAFETY: as above; AVX-512's feature set includes AVX2's.
            SimdLevel::Avx512 => unsafe { avx512::decode(ty, src, codes, scale, offset) || avx2::decode(ty, src, codes, scale, offset) },
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ty, src, codes, scale, offset);
        false
    }
}
