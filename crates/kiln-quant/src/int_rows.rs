//! Weight rows decoded for integer dot products against 8-bit activations.
//!
//! Every block format here decodes to small integer codes with one scale (and
//! optionally one offset) per group of 16 or 32 values. This module writes a row
//! in that form with the codes biased to unsigned bytes, which is what x86's
//! `vpdpbusd` (u8 x i8) multiplies: value `i` is
//! `scale[g] * (codes[i] as i32 - CODE_BIAS) + offset[g]` with `g = i / group`.
//! Formats whose groups are larger than 32 repeat their scale every 32 values.
//!
//! The scalar decoder is the reference; [`int_rows_x86`](crate::int_rows_x86)
//! has AVX2 decoders for every format here, chosen at run time, that write
//! exactly the same bytes and floats.

use crate::block::{DecodeBlock, Unpacked};
use crate::{check_lengths, GgmlType, QuantError};

/// Added to every signed code so that it fits an unsigned byte.
pub const CODE_BIAS: i32 = 128;

/// The shape of a decoded row of `ty`: values per scale group and whether groups
/// carry an offset. `None` for the float types (F32, F16, BF16) and Q8_K/Q8_1,
/// which have no integer dot product against activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IntLayout {
    pub group: usize,
    pub has_offset: bool,
}

macro_rules! with_int_codec {
    ($ty:expr, $C:ident => $body:expr, $other:expr) => {
        match $ty {
            GgmlType::Q4_0 => {
                type $C = crate::BlockQ4_0;
                $body
            }
            GgmlType::Q4_1 => {
                type $C = crate::BlockQ4_1;
                $body
            }
            GgmlType::Q5_0 => {
                type $C = crate::BlockQ5_0;
                $body
            }
            GgmlType::Q5_1 => {
                type $C = crate::BlockQ5_1;
                $body
            }
            GgmlType::Q8_0 => {
                type $C = crate::BlockQ8_0;
                $body
            }
            GgmlType::Q1_0 => {
                type $C = crate::BlockQ1_0;
                $body
            }
            GgmlType::Q2_0 => {
                type $C = crate::BlockQ2_0;
                $body
            }
            GgmlType::Q2_K => {
                type $C = crate::BlockQ2_K;
                $body
            }
            GgmlType::Q3_K => {
                type $C = crate::BlockQ3_K;
                $body
            }
            GgmlType::Q4_K => {
                type $C = crate::BlockQ4_K;
                $body
            }
            GgmlType::Q5_K => {
                type $C = crate::BlockQ5_K;
                $body
            }
            GgmlType::Q6_K => {
                type $C = crate::BlockQ6_K;
                $body
            }
            GgmlType::IQ4_NL => {
                type $C = crate::BlockIQ4_NL;
                $body
            }
            GgmlType::IQ4_XS => {
                type $C = crate::BlockIQ4_XS;
                $body
            }
            GgmlType::TQ1_0 => {
                type $C = crate::BlockTQ1_0;
                $body
            }
            GgmlType::TQ2_0 => {
                type $C = crate::BlockTQ2_0;
                $body
            }
            GgmlType::MXFP4 => {
                type $C = crate::BlockMXFP4;
                $body
            }
            GgmlType::NVFP4 => {
                type $C = crate::BlockNVFP4;
                $body
            }
            GgmlType::IQ2_XXS => {
                type $C = crate::BlockIQ2_XXS;
                $body
            }
            GgmlType::IQ2_XS => {
                type $C = crate::BlockIQ2_XS;
                $body
            }
            GgmlType::IQ2_S => {
                type $C = crate::BlockIQ2_S;
                $body
            }
            GgmlType::IQ3_XXS => {
                type $C = crate::BlockIQ3_XXS;
                $body
            }
            GgmlType::IQ3_S => {
                type $C = crate::BlockIQ3_S;
                $body
            }
            GgmlType::IQ1_S => {
                type $C = crate::BlockIQ1_S;
                $body
            }
            GgmlType::IQ1_M => {
                type $C = crate::BlockIQ1_M;
                $body
            }
            _ => $other,
        }
    };
}

/// The decoded layout of `ty`, or `None` where integer dot products do not apply.
pub fn int_layout(ty: GgmlType) -> Option<IntLayout> {
    with_int_codec!(ty, C => Some(IntLayout { group: <C as DecodeBlock>::GROUP.min(32), has_offset: <C as DecodeBlock>::HAS_OFFSET }), None)
}

/// Decodes `codes.len()` values of `ty` from `src` (exactly their bytes): biased codes, and
/// one scale and offset per group (`codes.len() / group` of each; offsets are 0 without one).
pub fn decode_int_row(ty: GgmlType, src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) -> Result<(), QuantError> {
    let layout = int_layout(ty).ok_or(QuantError::Unsupported { ty, op: "integer decode" })?;
    check_lengths(ty, codes.len(), src.len())?;
    let groups = codes.len() / layout.group;
    if scale.len() != groups || offset.len() != groups {
        return Err(QuantError::BadLength { ty, n_elements: codes.len(), n_bytes: scale.len().min(offset.len()), expected: groups });
    }
    if crate::int_rows_x86::decode(ty, src, codes, scale, offset) {
        return Ok(());
    }
    with_int_codec!(ty, C => decode_scalar::<C>(src, codes, scale, offset), unreachable!("int_layout covers the same types"));
    Ok(())
}

#[doc(hidden)]
pub use crate::int_rows_x86::{available_levels as simd_levels, SimdLevel};

/// Decodes with the SIMD kernels of `level` only (for tests and benchmarks): `Ok(false)`
/// where this CPU lacks the level or the format has no kernel there, leaving the
/// outputs untouched.
#[doc(hidden)]
pub fn decode_int_row_at(level: SimdLevel, ty: GgmlType, src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) -> Result<bool, QuantError> {
    let layout = int_layout(ty).ok_or(QuantError::Unsupported { ty, op: "integer decode" })?;
    check_lengths(ty, codes.len(), src.len())?;
    let groups = codes.len() / layout.group;
    if scale.len() != groups || offset.len() != groups {
        return Err(QuantError::BadLength { ty, n_elements: codes.len(), n_bytes: scale.len().min(offset.len()), expected: groups });
    }
    Ok(crate::int_rows_x86::decode_at(level, ty, src, codes, scale, offset))
}

/// The reference decoder, over the same `unpack` as dequantization.
pub fn decode_int_row_scalar(ty: GgmlType, src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) -> Result<(), QuantError> {
    let layout = int_layout(ty).ok_or(QuantError::Unsupported { ty, op: "integer decode" })?;
    check_lengths(ty, codes.len(), src.len())?;
    let groups = codes.len() / layout.group;
    if scale.len() != groups || offset.len() != groups {
        return Err(QuantError::BadLength { ty, n_elements: codes.len(), n_bytes: scale.len().min(offset.len()), expected: groups });
    }
    with_int_codec!(ty, C => decode_scalar::<C>(src, codes, scale, offset), unreachable!("int_layout covers the same types"));
    Ok(())
}

fn decode_scalar<B: DecodeBlock>(src: &[u8], codes: &mut [u8], scale: &mut [f32], offset: &mut [f32]) {
    let group = B::GROUP.min(32);
    let per_block = B::N / group;
    let mut u = Unpacked::new();
    let blocks = src.chunks_exact(size_of::<B>()).zip(codes.chunks_exact_mut(B::N));
    for (b, (bytes, out)) in blocks.enumerate() {
        bytemuck::pod_read_unaligned::<B>(bytes).unpack(&mut u);
        for (o, &c) in out.iter_mut().zip(&u.codes[..B::N]) {
            *o = (c as u8) ^ 0x80;
        }
        for g in 0..per_block {
            let source = g * group / B::GROUP;
            scale[b * per_block + g] = u.scale[source];
            offset[b * per_block + g] = if B::HAS_OFFSET { u.offset[source] } else { 0.0 };
        }
    }
}
