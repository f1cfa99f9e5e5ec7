//! Streaming GGUF v3 writer: the header is built in memory, tensor data is
//! pulled from a callback one tensor at a time.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::error::GgufError;
use crate::reader::MAX_ARRAY_DEPTH;
use crate::types::GgmlType;
use crate::value::Value;
use crate::{align_up, alignment_from_value, tensor_n_bytes, TensorInfo, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC};

type Result<T> = std::result::Result<T, GgufError>;

/// The version `GgufWriter` writes.
pub const WRITE_VERSION: u32 = 3;

/// Declares metadata and tensors, then writes a GGUF v3 file. Tensor offsets
/// are assigned at write time, each aligned to `general.alignment` (32 if unset).
#[derive(Debug, Default, Clone)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
}

/// Passes writes through and counts the bytes.
struct CountingWriter<'a> {
    inner: &'a mut dyn Write,
    written: u64,
}

impl Write for CountingWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

fn write_zeros(out: &mut dyn Write, mut n: u64) -> io::Result<()> {
    const ZEROS: [u8; 4096] = [0; 4096];
    while n > 0 {
        let chunk = n.min(ZEROS.len() as u64) as usize;
        out.write_all(&ZEROS[..chunk])?;
        n -= chunk as u64;
    }
    Ok(())
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Appends the payload of `value` (without its type id).
fn put_value(out: &mut Vec<u8>, key: &str, value: &Value, depth: usize) -> Result<()> {
    match value {
        Value::U8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::String(s) => put_str(out, s),
        Value::Array(elem, items) => {
            if depth >= MAX_ARRAY_DEPTH {
                return Err(GgufError::NestingTooDeep { key: key.to_owned(), offset: out.len() as u64, max_depth: MAX_ARRAY_DEPTH });
            }
            out.extend_from_slice(&elem.id().to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for (index, item) in items.iter().enumerate() {
                if item.value_type() != *elem {
                    return Err(GgufError::MixedArray { key: key.to_owned(), expected: *elem, found: item.value_type(), index });
                }
                put_value(out, key, item, depth + 1)?;
            }
        }
    }
    Ok(())
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets a metadata value; setting an existing key replaces its value in place.
    pub fn add_kv(&mut self, key: impl Into<String>, value: Value) {
        let key = key.into();
        match self.metadata.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => self.metadata.push((key, value)),
        }
    }

    /// Declares the next tensor; its bytes are asked for at write time.
    pub fn add_tensor(&mut self, name: impl Into<String>, dims: Vec<u64>, ty: GgmlType) -> Result<()> {
        let name = name.into();
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(GgufError::DuplicateTensor { tensor: name, offset: self.tensors.len() as u64 });
        }
        let n_bytes = tensor_n_bytes(&name, &dims, ty)?;
        self.tensors.push(TensorInfo { name, dims, ty, offset: 0, n_bytes });
        Ok(())
    }

    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// Declared tensors; offsets are only final once written.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Assigns tensor offsets and encodes everything before the data section
    /// except its alignment padding. Returns the alignment and the header.
    fn encode_header(&mut self) -> Result<(u64, Vec<u8>)> {
        let alignment = match self.metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
            Some((_, v)) => alignment_from_value(v)?,
            None => DEFAULT_ALIGNMENT,
        };
        let overflow = || GgufError::DataOffsetOverflow { alignment };
        let mut next = 0u64;
        for t in &mut self.tensors {
            t.offset = align_up(next, alignment).ok_or_else(overflow)?;
            next = t.offset.checked_add(t.n_bytes).ok_or_else(overflow)?;
        }

        let mut out = Vec::new();
        out.extend_from_slice(&GGUF_MAGIC);
        out.extend_from_slice(&WRITE_VERSION.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_str(&mut out, key);
            out.extend_from_slice(&value.value_type().id().to_le_bytes());
            put_value(&mut out, key, value, 0)?;
        }
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ty.id().to_le_bytes());
            out.extend_from_slice(&t.offset.to_le_bytes());
        }
        Ok((alignment, out))
    }

    /// Writes the file: header, then each tensor's bytes from `data(index, out)`
    /// in declaration order, zero padding to the alignment after each tensor.
    fn write_stream(
        mut self,
        out: &mut dyn Write,
        io_error: impl Fn(io::Error) -> GgufError,
        mut data: impl FnMut(usize, &mut dyn Write) -> io::Result<()>,
    ) -> Result<()> {
        let (alignment, header) = self.encode_header()?;
        out.write_all(&header).map_err(&io_error)?;
        // Alignment is a power of two, so this is the distance to the next multiple.
        let padding = |len: u64| len.wrapping_neg() & (alignment - 1);
        // A file without tensors has an empty data section and needs no padding
        // (llama.cpp's vocab-only files end right after the header too).
        if !self.tensors.is_empty() {
            write_zeros(out, padding(header.len() as u64)).map_err(&io_error)?;
        }
        for (index, t) in self.tensors.iter().enumerate() {
            let mut counted = CountingWriter { inner: out, written: 0 };
            data(index, &mut counted).map_err(|source| GgufError::TensorData { tensor: t.name.clone(), source })?;
            if counted.written != t.n_bytes {
                return Err(GgufError::TensorDataSize { tensor: t.name.clone(), expected: t.n_bytes, written: counted.written });
            }
            write_zeros(out, padding(t.n_bytes)).map_err(&io_error)?;
        }
        out.flush().map_err(&io_error)
    }

    /// Streams the file to `path` through a `.tmp` sibling that is renamed into
    /// place only once everything was written, so a failure never leaves a
    /// partial file under `path`.
    pub fn write_to_file(self, path: impl AsRef<Path>, data: impl FnMut(usize, &mut dyn Write) -> io::Result<()>) -> Result<()> {
        let path = path.as_ref();
        let mut tmp_name = path.as_os_str().to_owned();
        tmp_name.push(".tmp");
        let tmp = PathBuf::from(tmp_name);
        let result = (|| {
            let io_error = |source| GgufError::Io { path: tmp.clone(), source };
            let file = std::fs::File::create(&tmp).map_err(io_error)?;
            let mut out = io::BufWriter::with_capacity(1 << 20, file);
            self.write_stream(&mut out, io_error, data)?;
            let file = out.into_inner().map_err(|e| io_error(e.into_error()))?;
            file.sync_all().map_err(io_error)?;
            std::fs::rename(&tmp, path).map_err(|source| GgufError::Io { path: path.to_path_buf(), source })
        })();
        if result.is_err() {
            // Best effort: the original error is the one worth reporting.
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }

    /// Builds the whole file in memory (tests, small files).
    pub fn to_bytes(self, data: impl FnMut(usize, &mut dyn Write) -> io::Result<()>) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        let io_error = |source| GgufError::Io { path: PathBuf::from("<memory>"), source };
        self.write_stream(&mut out, io_error, data)?;
        Ok(out)
    }
}
