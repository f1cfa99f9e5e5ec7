//! SIMD decoders for [`int_rows`](crate::int_rows), chosen at run time by CPU
//! feature detection. Each writes exactly what the scalar decoder writes.

use crate::GgmlType;

/// Decodes with a SIMD path when this CPU and format have one; `false` leaves the work to
/// the scalar decoder. Lengths are checked by the caller.
pub(crate) fn decode(ty: GgmlType, src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) -> bool {
    let _ = (ty, src, codes, scale, offset);
    false
}
