//! GGML block formats: exact byte layouts, dequantization, reference
//! quantizers and scalar dot products.
//!
//! Dequantization is bit-exact with ggml's `dequantize_row_*` (same f32
//! operation order), and the quantizers reproduce ggml's reference quantizers
//! (`quantize_row_*_ref`, MXFP4's included, and for IQ4_NL/IQ4_XS/IQ3_S the scale search
//! llama-quantize runs without an importance matrix) byte for byte; IQ2_XXS, IQ2_XS and
//! IQ1_S, which ggml only quantizes with an importance matrix, as ggml does given one of ones.
//!
//! The row-level entry points work on whole rows of bytes and floats, block by
//! block, without allocating. Above them, [`file`] converts whole GGUF files
//! with llama-quantize's per-tensor type rules, and [`synthetic`] writes
//! random-weight models in the shapes of real ones through the same path.

mod block;
pub mod file;
mod float;
mod fp4;
pub mod int_rows;
mod int_rows_x86;
mod iq;
mod iq1;
mod iq1_search;
mod iq2;
mod iq3;
mod iq_grids;
mod iq_search;
mod kquants;
mod legacy;
pub mod synthetic;
mod ternary;

pub use fp4::{e8m0_half, ue4m3_half, BlockMXFP4, BlockNVFP4, E2M1_X2};
pub use iq::{BlockIQ4_NL, BlockIQ4_XS, IQ4_NL_CODEBOOK};
pub use iq1::{BlockIQ1_M, BlockIQ1_S};
pub use iq2::{BlockIQ2_S, BlockIQ2_XS, BlockIQ2_XXS};
pub use iq3::{BlockIQ3_S, BlockIQ3_XXS};
pub use kiln_gguf::{GgmlType, ALL_TYPES};
pub use kquants::{BlockQ2_K, BlockQ3_K, BlockQ4_K, BlockQ5_K, BlockQ6_K, BlockQ8_K};
pub use legacy::{BlockQ1_0, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, BlockQ8_1};
pub use ternary::{BlockQ2_0, BlockTQ1_0, BlockTQ2_0};

use block::{RowCodec, RowEncoder};

// Block structs are read from file bytes as native-endian plain data; GGUF is little-endian.
#[cfg(not(target_endian = "little"))]
compile_error!("kiln-quant reads GGML blocks as little-endian plain data");

/// Errors of the row-level entry points. None of them panics on bad input.
#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    #[error("{op} is not supported for GGML type {ty}")]
    Unsupported { ty: GgmlType, op: &'static str },
    #[error("unknown GGML type id {0}")]
    UnknownTypeId(u32),
    #[error("{ty}: {n_elements} elements take {expected} bytes, but the byte buffer holds {n_bytes}")]
    BadLength { ty: GgmlType, n_elements: usize, n_bytes: usize, expected: usize },
    #[error("{ty}: {n} elements is not a multiple of the block size {block_size}")]
    NotBlockMultiple { ty: GgmlType, n: usize, block_size: usize },
    #[error("{ty}: the byte size of {n_elements} elements overflows usize")]
    TooLarge { ty: GgmlType, n_elements: usize },
}

/// The type for a GGUF type id, as a typed error for ids this build does not know.
pub fn type_from_id(id: u32) -> Result<GgmlType, QuantError> {
    GgmlType::from_id(id).ok_or(QuantError::UnknownTypeId(id))
}

/// Maps a type to the codec implementing it and evaluates `$body` with `$C` naming that
/// codec, or `$other` for types without one. Every codec both decodes and encodes.
macro_rules! with_codec {
    ($ty:expr, $C:ident => $body:expr, $other:expr) => {
        codec_table!(@table $ty, $C, $body, $other,
            F32 => float::FloatCodec<f32>, F16 => float::FloatCodec<half::f16>,
            BF16 => float::FloatCodec<half::bf16>, Q4_0 => BlockQ4_0, Q4_1 => BlockQ4_1,
            Q5_0 => BlockQ5_0, Q5_1 => BlockQ5_1, Q8_0 => BlockQ8_0, Q8_1 => BlockQ8_1,
            Q1_0 => BlockQ1_0, Q2_0 => BlockQ2_0, Q2_K => BlockQ2_K, Q3_K => BlockQ3_K,
            Q4_K => BlockQ4_K, Q5_K => BlockQ5_K, Q6_K => BlockQ6_K, Q8_K => BlockQ8_K,
            IQ4_NL => BlockIQ4_NL, IQ4_XS => BlockIQ4_XS, TQ1_0 => BlockTQ1_0, TQ2_0 => BlockTQ2_0,
            MXFP4 => BlockMXFP4, NVFP4 => BlockNVFP4, IQ3_XXS => BlockIQ3_XXS, IQ3_S => BlockIQ3_S,
            IQ2_XXS => iq2::BlockIQ2_XXS, IQ2_XS => iq2::BlockIQ2_XS, IQ2_S => iq2::BlockIQ2_S,
            IQ1_S => iq1::BlockIQ1_S, IQ1_M => iq1::BlockIQ1_M)
    };
}

macro_rules! codec_table {
    (@table $ty:expr, $C:ident, $body:expr, $other:expr, $($variant:ident => $codec:ty),* $(,)?) => {
        match $ty {
            $(GgmlType::$variant => {
                type $C = $codec;
                $body
            })*
            _ => $other,
        }
    };
}

/// Whether `dequantize` and `vec_dot` handle this type.
pub fn can_dequantize(ty: GgmlType) -> bool {
    with_codec!(ty, _C => true, false)
}

/// Whether `quantize` handles this type: those ggml encodes without an importance matrix,
/// and IQ2_XXS / IQ2_XS / IQ1_S as ggml encodes them given an importance matrix of ones.
pub fn can_quantize(ty: GgmlType) -> bool {
    with_codec!(ty, _C => true, false)
}

/// Bytes taken by `n_elements` values of type `ty`.
pub fn quantized_size(ty: GgmlType, n_elements: usize) -> Result<usize, QuantError> {
    let block_size = ty.block_size();
    if !n_elements.is_multiple_of(block_size) {
        return Err(QuantError::NotBlockMultiple { ty, n: n_elements, block_size });
    }
    (n_elements / block_size).checked_mul(ty.type_size()).ok_or(QuantError::TooLarge { ty, n_elements })
}

/// Checks that `n_bytes` is exactly the size of `n_elements` values of `ty`.
fn check_lengths(ty: GgmlType, n_elements: usize, n_bytes: usize) -> Result<(), QuantError> {
    let expected = quantized_size(ty, n_elements)?;
    if n_bytes != expected {
        return Err(QuantError::BadLength { ty, n_elements, n_bytes, expected });
    }
    Ok(())
}

/// Decodes `dst.len()` values of type `ty` from `src`, which must hold exactly their bytes.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    with_codec!(
        ty,
        C => {
            check_lengths(ty, dst.len(), src.len())?;
            C::dequantize_row(src, dst);
            Ok(())
        },
        Err(QuantError::Unsupported { ty, op: "dequantize" })
    )
}

/// Encodes `src` (a whole number of blocks; blocks are independent, so rows may be
/// concatenated) into `dst`, which must be exactly the encoded size.
pub fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    with_codec!(
        ty,
        C => {
            check_lengths(ty, src.len(), dst.len())?;
            C::quantize_row(src, dst);
            Ok(())
        },
        Err(QuantError::Unsupported { ty, op: "quantize" })
    )
}

/// Writes an f16 super-block scale (`d_bits()`, one call a block) into every block of `bytes`, which holds whole
/// blocks of an IQ1/IQ2 codebook format (IQ1_M keeps it in the top nibbles of its four scale
/// words, the others in their first two bytes): tests fill such blocks with random bytes, which
/// reach every grid point and sign pattern, and then need a finite scale.
pub fn set_codebook_scales(ty: GgmlType, bytes: &mut [u8], mut d_bits: impl FnMut() -> u16) -> Result<(), QuantError> {
    if !matches!(ty, GgmlType::IQ1_S | GgmlType::IQ1_M | GgmlType::IQ2_XXS | GgmlType::IQ2_XS | GgmlType::IQ2_S) {
        return Err(QuantError::Unsupported { ty, op: "set_codebook_scales" });
    }
    if !bytes.chunks_exact(ty.type_size()).remainder().is_empty() {
        let n_elements = bytes.len() / ty.type_size() * ty.block_size();
        return Err(QuantError::BadLength { ty, n_elements, n_bytes: bytes.len(), expected: n_elements / ty.block_size() * ty.type_size() });
    }
    for block in bytes.chunks_exact_mut(ty.type_size()) {
        let d = d_bits();
        if ty == GgmlType::IQ1_M {
            for k in 0..4 {
                let at = 48 + 2 * k;
                let word = u16::from_le_bytes([block[at], block[at + 1]]) & 0x0fff | ((d >> (4 * k)) & 0xf) << 12;
                block[at..at + 2].copy_from_slice(&word.to_le_bytes());
            }
        } else {
            block[..2].copy_from_slice(&d.to_le_bytes());
        }
    }
    Ok(())
}

/// The integer codes of one block of `ty` (`block` holds exactly its bytes, `codes` one
/// entry per value): value i = scale * code i (+ offset) with the per-group scale of
/// `dequantize`. For the codebook formats the code is the signed codebook value
/// (IQ1_S/IQ1_M: 8 * (grid value + delta)).
pub fn block_codes(ty: GgmlType, block: &[u8], codes: &mut [i8]) -> Result<(), QuantError> {
    with_codec!(
        ty,
        C => {
            check_lengths(ty, codes.len(), block.len())?;
            if codes.len() == ty.block_size() && C::block_codes(block, codes) {
                Ok(())
            } else {
                Err(QuantError::Unsupported { ty, op: "block_codes of one block" })
            }
        },
        Err(QuantError::Unsupported { ty, op: "block_codes" })
    )
}

/// Scalar reference dot product `sum_i dequant(row)_i * x_i`, where `row` holds exactly the
/// bytes of `x.len()` values. Works block by block; the sum is accumulated in f64.
pub fn vec_dot(ty: GgmlType, row: &[u8], x: &[f32]) -> Result<f32, QuantError> {
    with_codec!(
        ty,
        C => {
            check_lengths(ty, x.len(), row.len())?;
            Ok(C::dot_row(row, x))
        },
        Err(QuantError::Unsupported { ty, op: "vec_dot" })
    )
}
