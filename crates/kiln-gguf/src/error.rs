use std::path::PathBuf;

use crate::types::GgmlType;
use crate::value::{Value, ValueType};

/// Everything that can be wrong with a GGUF file or with a writer's input.
/// Offsets are absolute byte offsets in the file unless a field says otherwise.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },

    #[error("not a GGUF file: magic at offset 0 is {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },

    #[error("unsupported GGUF version {0} at offset 4 (supported: 2 and 3, little-endian)")]
    UnsupportedVersion(u32),

    #[error("file truncated: {what} at offset {offset} runs past the end of the file")]
    Truncated { what: String, offset: u64 },

    #[error("tensor count {count} at offset {offset} cannot fit in the {remaining} bytes left")]
    TensorCountTooLarge { count: u64, offset: u64, remaining: u64 },

    #[error("metadata KV count {count} at offset {offset} cannot fit in the {remaining} bytes left")]
    KvCountTooLarge { count: u64, offset: u64, remaining: u64 },

    #[error("array length {len} of key {key:?} at offset {offset} cannot fit in the {remaining} bytes left")]
    ArrayTooLong { key: String, len: u64, offset: u64, remaining: u64 },

    #[error("string length {len} of {what} at offset {offset} exceeds the {remaining} bytes left")]
    StringTooLong { what: String, len: u64, offset: u64, remaining: u64 },

    #[error("{what} at offset {offset} is not valid UTF-8")]
    InvalidUtf8 { what: String, offset: u64 },

    #[error("key {key:?}: unknown value type id {id} at offset {offset}")]
    UnknownValueType { key: String, id: u32, offset: u64 },

    #[error("key {key:?}: bool byte {byte} at offset {offset} is neither 0 nor 1")]
    InvalidBool { key: String, byte: u8, offset: u64 },

    #[error("key {key:?}: arrays nested deeper than {max_depth} levels at offset {offset}")]
    NestingTooDeep { key: String, offset: u64, max_depth: usize },

    #[error("duplicate metadata key {key:?} at offset {offset}")]
    DuplicateKey { key: String, offset: u64 },

    #[error("general.alignment must be a nonzero power of two that fits in u32, found {found:?}")]
    BadAlignment { found: Value },

    #[error("tensor {tensor:?}: {n_dims} dimensions (must be 1..=4)")]
    InvalidDimCount { tensor: String, n_dims: u64 },

    #[error("tensor {tensor:?}: dimension {dim} is zero")]
    ZeroDim { tensor: String, dim: usize },

    #[error("tensor {tensor:?}: element count or byte size of dims {dims:?} overflows")]
    ElementCountOverflow { tensor: String, dims: Vec<u64> },

    #[error("tensor {tensor:?}: unknown GGML type id {id}")]
    UnknownTensorType { tensor: String, id: u32 },

    #[error("tensor {tensor:?}: row length {row_len} is not a multiple of the {ty} block size {block_size}")]
    RowNotBlockAligned { tensor: String, ty: GgmlType, row_len: u64, block_size: u64 },

    #[error("tensor {tensor:?}: data offset {offset} (relative to the data section) is not a multiple of the alignment {alignment}")]
    MisalignedTensor { tensor: String, offset: u64, alignment: u64 },

    #[error("tensor {tensor:?}: data at offset {offset} (relative, data section at {data_offset}) of {n_bytes} bytes ends past the file size {file_size}")]
    TensorOutOfRange { tensor: String, offset: u64, n_bytes: u64, data_offset: u64, file_size: u64 },

    #[error("tensors {first:?} and {second:?} overlap: {second:?} starts at relative offset {offset}, before {first:?} ends")]
    OverlappingTensors { first: String, second: String, offset: u64 },

    /// `offset` is the tensor info's file offset; for `GgufWriter::add_tensor`,
    /// the index the duplicate declaration would have had.
    #[error("duplicate tensor name {tensor:?} (second declaration at {offset})")]
    DuplicateTensor { tensor: String, offset: u64 },

    #[error("header ends past the largest possible offset (alignment {alignment})")]
    DataOffsetOverflow { alignment: u64 },

    #[error("missing metadata key {0:?}")]
    MissingKey(String),

    #[error("metadata key {key:?}: expected {expected}, found {found}")]
    WrongType { key: String, expected: &'static str, found: ValueType },

    #[error("metadata key {key:?}: array of {expected} has an element {index} of type {found}")]
    MixedArray { key: String, expected: ValueType, found: ValueType, index: usize },

    #[error("tensor {tensor:?}: data callback wrote {written} bytes, expected {expected}")]
    TensorDataSize { tensor: String, expected: u64, written: u64 },

    #[error("tensor {tensor:?}: writing data failed: {source}")]
    TensorData { tensor: String, source: std::io::Error },
}
