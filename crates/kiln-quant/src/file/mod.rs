//! `kiln quantize`: llama-quantize's file types and per-tensor type rules,
//! and a streaming converter from one GGUF file to another.

mod ftype;
mod plan;
mod stream;

use std::path::{Path, PathBuf};

use kiln_gguf::{GgufError, GgufFile, Value};

use crate::{GgmlType, QuantError};

pub use ftype::{describe_file_type, FileType, FILE_TYPE_GUESSED};
pub use plan::{plan_tensors, QuantHparams, TensorPlan};
pub use stream::{write_planned, Progress, TensorSource, WriteSummary};

#[derive(Debug, thiserror::Error)]
pub enum QuantizeError {
    #[error("unknown quantization type '{name}'; valid types: {valid}")]
    UnknownFileType { name: String, valid: String },
    #[error("cannot read {}: {}", path.display(), reason(source))]
    Open { path: PathBuf, source: GgufError },
    #[error("cannot write {}: {}", path.display(), reason(source))]
    Write { path: PathBuf, source: GgufError },
    #[error("the output {} is the input file", path.display())]
    SameFile { path: PathBuf },
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("metadata key {0} is missing")]
    MissingKey(String),
    #[error("metadata key {key} is not {expected}")]
    BadKey { key: String, expected: &'static str },
    #[error("tensor {tensor}: its layer number is not in 0..{n_layer}")]
    BadLayer { tensor: String, n_layer: u64 },
    #[error("tensor {tensor}: rows of {row_len} are not a multiple of the {ty} block size, and llama.cpp defines no fallback type for {ty}")]
    NoFallback { tensor: String, ty: GgmlType, row_len: u64 },
    #[error("tensor {tensor} is already quantized ({from}); converting it to {to} needs --allow-requantize")]
    RequantizeDisabled { tensor: String, from: GgmlType, to: GgmlType },
    #[error("tensor {tensor}: kiln cannot decode type {ty}")]
    CannotDequantize { tensor: String, ty: GgmlType },
    #[error("tensor {tensor}: llama-quantize refuses type {ty} without an importance matrix, which kiln does not take")]
    NeedsImatrix { tensor: String, ty: GgmlType },
    #[error("tensor {tensor}: kiln cannot encode type {ty}")]
    CannotQuantize { tensor: String, ty: GgmlType },
    #[error("tensor {tensor}: {source}")]
    Quant { tensor: String, source: QuantError },
}

pub type Result<T, E = QuantizeError> = std::result::Result<T, E>;

/// A GGUF error without the path it may repeat.
fn reason(e: &GgufError) -> String {
    match e {
        GgufError::Io { source, .. } => source.to_string(),
        other => other.to_string(),
    }
}

/// What `kiln quantize` is asked to do (llama-quantize's flags of the same names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantizeOptions {
    pub ftype: FileType,
    /// Every quantizable tensor in the file type's default type (no mix rules).
    pub pure: bool,
    /// Allow converting tensors that are already quantized.
    pub allow_requantize: bool,
    /// Quantize the tensors llama-quantize refuses without an importance matrix instead of
    /// refusing them: as ggml does without one where it can (IQ3_XXS, IQ2_S, IQ1_M), else
    /// given an importance of 1 for every value (IQ2_XXS, IQ2_XS, IQ1_S). For random-weight
    /// benchmark files, whose quality does not matter.
    pub allow_without_imatrix: bool,
}

impl QuantizeOptions {
    pub fn new(ftype: FileType) -> Self {
        QuantizeOptions { ftype, pure: false, allow_requantize: false, allow_without_imatrix: false }
    }
}

/// Parses a file type argument, failing with the list of valid names.
pub fn parse_file_type(name: &str) -> Result<FileType> {
    let unknown = || QuantizeError::UnknownFileType { name: name.to_string(), valid: FileType::all().map(FileType::name).collect::<Vec<_>>().join(", ") };
    FileType::parse(name).ok_or_else(unknown)
}

/// Split files are written whole, so their split keys are dropped.
const SPLIT_KEYS: &[&str] = &["split.no", "split.count", "split.tensors.count"];

/// The input metadata with llama-quantize's changes: split keys removed, the
/// quantization version and the file type set (in place when present).
pub fn output_metadata(input: &[(String, Value)], ftype: FileType) -> Vec<(String, Value)> {
    let mut out: Vec<(String, Value)> = input.iter().filter(|(k, _)| !SPLIT_KEYS.contains(&k.as_str())).cloned().collect();
    for (key, value) in [("general.quantization_version", 2), ("general.file_type", ftype.id())] {
        match out.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = Value::U32(value),
            None => out.push((key.to_string(), Value::U32(value))),
        }
    }
    out
}

/// Tensors of an open GGUF file, decoded row by row.
struct FileSource<'a> {
    file: &'a GgufFile,
}

impl TensorSource for FileSource<'_> {
    fn stored_bytes(&self, index: usize) -> Option<&[u8]> {
        Some(self.file.tensor_data(&self.file.tensors()[index]))
    }

    fn row_f32(&self, index: usize, row: usize, out: &mut [f32]) -> Result<()> {
        let t = &self.file.tensors()[index];
        let row_bytes = t.ty.bytes_for(out.len() as u64).unwrap_or(0) as usize;
        let bytes = &self.file.tensor_data(t)[row * row_bytes..(row + 1) * row_bytes];
        crate::dequantize(t.ty, bytes, out).map_err(|source| QuantizeError::Quant { tensor: t.name.clone(), source })
    }
}

/// Converts the GGUF file `input` into `output` the way llama-quantize
/// would, keeping the input's tensor order.
pub fn quantize_file(input: &Path, output: &Path, options: &QuantizeOptions, progress: &dyn Progress) -> Result<WriteSummary> {
    let file = GgufFile::open(input).map_err(|source| QuantizeError::Open { path: input.to_path_buf(), source })?;
    if let (Ok(a), Ok(b)) = (input.canonicalize(), output.canonicalize()) {
        if a == b {
            return Err(QuantizeError::SameFile { path: output.to_path_buf() });
        }
    }
    let hparams = QuantHparams::from_metadata(file.metadata())?;
    let plans = plan_tensors(&hparams, file.tensors(), options)?;
    let metadata = output_metadata(file.metadata(), options.ftype);
    write_planned(output, metadata, &plans, &FileSource { file: &file }, progress)
}
