//! AVX-512 (BW, VL, VBMI) decoders for the hottest formats.

use crate::GgmlType;

/// Decodes `ty` when it has an AVX-512 kernel.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi")]
pub(super) fn decode(ty: GgmlType, src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) -> bool {
    let _ = (ty, src, codes, scale, offset);
    false
}
