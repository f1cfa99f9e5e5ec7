//! AVX2 decoders for the codebook (grid) formats.

use crate::GgmlType;

/// Decodes `ty` when it has an AVX2 grid kernel.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn decode(ty: GgmlType, src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) -> bool {
    let _ = (ty, src, codes, scale, offset);
    false
}
