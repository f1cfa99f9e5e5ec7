//! GGUF files: a validating reader over a memory map, a streaming writer, and
//! the table of GGML tensor types (ids, names, block and byte sizes).
//!
//! Versions 2 and 3 are read (little-endian only); version 3 is written.
//! Opening a file validates the whole header and every tensor's data range
//! before anything large is allocated, so a malformed file yields a typed
//! [`GgufError`] naming the key, tensor or offset involved, never a panic.

mod error;
#[doc(hidden)]
pub mod fuzzing;
mod reader;
mod types;
mod value;
mod writer;

pub use error::GgufError;
pub use reader::{GgufFile, MAX_ARRAY_DEPTH};
pub use types::{GgmlType, ALL_TYPES};
pub use value::{Value, ValueType};
pub use writer::{GgufWriter, WRITE_VERSION};

pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// GGML_MAX_DIMS.
pub const MAX_DIMS: usize = 4;

/// One tensor's header entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF `ne` order: `dims[0]` is the contiguous row length.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Byte offset relative to the start of the data section.
    pub offset: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Product of the dims (saturating; validated infos never overflow).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).unwrap_or(u64::MAX)
    }
}

/// Rounds `n` up to a multiple of the power of two `alignment`.
fn align_up(n: u64, alignment: u64) -> Option<u64> {
    n.checked_add(alignment - 1).map(|v| v & !(alignment - 1))
}

/// `general.alignment` must be a nonzero power of two; the GGUF spec types it
/// u32, and any integer type holding such a value is accepted.
fn alignment_from_value(value: &Value) -> Result<u64, GgufError> {
    value.as_u64().filter(|a| a.is_power_of_two() && *a <= u32::MAX as u64).ok_or_else(|| GgufError::BadAlignment { found: value.clone() })
}

fn check_dim_count(tensor: &str, n_dims: u64) -> Result<(), GgufError> {
    if n_dims == 0 || n_dims > MAX_DIMS as u64 {
        return Err(GgufError::InvalidDimCount { tensor: tensor.to_owned(), n_dims });
    }
    Ok(())
}

/// Validates a tensor's shape for its type and returns its size in bytes.
fn tensor_n_bytes(tensor: &str, dims: &[u64], ty: GgmlType) -> Result<u64, GgufError> {
    check_dim_count(tensor, dims.len() as u64)?;
    if let Some(dim) = dims.iter().position(|&d| d == 0) {
        return Err(GgufError::ZeroDim { tensor: tensor.to_owned(), dim });
    }
    let overflow = || GgufError::ElementCountOverflow { tensor: tensor.to_owned(), dims: dims.to_vec() };
    // ggml stores element counts as i64.
    let n_elements = dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).filter(|&n| n <= i64::MAX as u64).ok_or_else(overflow)?;
    let block_size = ty.block_size() as u64;
    if !dims[0].is_multiple_of(block_size) {
        return Err(GgufError::RowNotBlockAligned { tensor: tensor.to_owned(), ty, row_len: dims[0], block_size });
    }
    ty.bytes_for(n_elements).ok_or_else(overflow)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<GgufFile>();
        assert_send_sync::<GgufWriter>();
        assert_send_sync::<GgufError>();
    }

    #[test]
    fn align_up_rounds_to_power_of_two_multiples() {
        assert_eq!(align_up(0, 32), Some(0));
        assert_eq!(align_up(1, 32), Some(32));
        assert_eq!(align_up(64, 32), Some(64));
        assert_eq!(align_up(65, 1), Some(65));
        assert_eq!(align_up(u64::MAX - 3, 32), None);
    }
}
