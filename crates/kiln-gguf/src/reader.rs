//! Parsing and validation of a GGUF file held in memory or mapped from disk.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::GgufError;
use crate::types::GgmlType;
use crate::value::{Value, ValueType};
use crate::{align_up, check_dim_count, tensor_n_bytes, TensorInfo, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC};

type Result<T> = std::result::Result<T, GgufError>;

/// Arrays of arrays deeper than this are rejected: real files never nest, and
/// unbounded nesting would let a small file exhaust the stack.
pub const MAX_ARRAY_DEPTH: usize = 16;
/// Smallest possible metadata KV: empty key (u64 length), type id, one-byte value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Smallest possible tensor info: empty name, n_dims, one dim, type id, offset.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 8 + 4 + 8;

/// A bounds-checked little-endian reader. `what` closures describe the item
/// being read for error messages; they only run when an error is built.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

type What<'w> = &'w dyn Fn() -> String;

impl<'a> Cursor<'a> {
    fn offset(&self) -> u64 {
        self.pos as u64
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: What) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(GgufError::Truncated { what: what(), offset: self.offset() });
        }
        let bytes = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(bytes)
    }

    fn fixed<const N: usize>(&mut self, what: What) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: What) -> Result<u32> {
        self.fixed(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: What) -> Result<u64> {
        self.fixed(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: What) -> Result<String> {
        let len_offset = self.offset();
        let len = self.u64(what)?;
        if len > self.remaining() {
            return Err(GgufError::StringTooLong { what: what(), len, offset: len_offset, remaining: self.remaining() });
        }
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(GgufError::InvalidUtf8 { what: what(), offset: len_offset + 8 }),
        }
    }

    fn value_type(&mut self, key: &str, what: What) -> Result<ValueType> {
        let offset = self.offset();
        let id = self.u32(what)?;
        ValueType::from_id(id).ok_or_else(|| GgufError::UnknownValueType { key: key.to_owned(), id, offset })
    }

    fn value(&mut self, ty: ValueType, key: &str, depth: usize) -> Result<Value> {
        let what = || format!("value of key {key:?}");
        let what: What = &what;
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.fixed(what)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.fixed(what)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.fixed(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.fixed(what)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.fixed(what)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.fixed(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.fixed(what)?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.fixed(what)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.fixed(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.fixed(what)?)),
            ValueType::Bool => {
                let offset = self.offset();
                match self.fixed::<1>(what)?[0] {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    byte => return Err(GgufError::InvalidBool { key: key.to_owned(), byte, offset }),
                }
            }
            ValueType::String => Value::String(self.string(what)?),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::NestingTooDeep { key: key.to_owned(), offset: self.offset(), max_depth: MAX_ARRAY_DEPTH });
                }
                let elem = self.value_type(key, what)?;
                let len_offset = self.offset();
                let len = self.u64(what)?;
                let remaining = self.remaining();
                if len.checked_mul(elem.min_encoded_size()).is_none_or(|b| b > remaining) {
                    return Err(GgufError::ArrayTooLong { key: key.to_owned(), len, offset: len_offset, remaining });
                }
                let mut items = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}

/// Everything parsed from the header; the bytes it describes are owned elsewhere.
struct Header {
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

fn parse(buf: &[u8]) -> Result<Header> {
    let mut c = Cursor { buf, pos: 0 };
    let found: [u8; 4] = c.fixed(&|| "magic".into())?;
    if found != GGUF_MAGIC {
        return Err(GgufError::BadMagic { found });
    }
    let version = c.u32(&|| "version".into())?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion(version));
    }

    // Both counts are judged against the bytes left before anything is allocated.
    let count_offset = c.offset();
    let n_tensors = c.u64(&|| "tensor count".into())?;
    let n_kv = c.u64(&|| "metadata KV count".into())?;
    let remaining = c.remaining();
    let tensor_info_bytes = n_tensors.checked_mul(MIN_TENSOR_INFO_BYTES).filter(|&b| b <= remaining).ok_or(GgufError::TensorCountTooLarge {
        count: n_tensors,
        offset: count_offset,
        remaining,
    })?;
    if n_kv.checked_mul(MIN_KV_BYTES).is_none_or(|b| b > remaining - tensor_info_bytes) {
        return Err(GgufError::KvCountTooLarge { count: n_kv, offset: count_offset + 8, remaining });
    }

    let mut metadata = Vec::with_capacity(n_kv as usize);
    let mut key_index = HashMap::with_capacity(n_kv as usize);
    for i in 0..n_kv as usize {
        let kv_offset = c.offset();
        let key = c.string(&|| format!("key of metadata KV #{i}"))?;
        if key_index.contains_key(&key) {
            return Err(GgufError::DuplicateKey { key, offset: kv_offset });
        }
        let ty = c.value_type(&key, &|| format!("value type of key {key:?}"))?;
        let value = c.value(ty, &key, 0)?;
        key_index.insert(key.clone(), i);
        metadata.push((key, value));
    }
    let alignment = match key_index.get(ALIGNMENT_KEY) {
        Some(&i) => crate::alignment_from_value(&metadata[i].1)?,
        None => DEFAULT_ALIGNMENT,
    };

    let mut tensors = Vec::with_capacity(n_tensors as usize);
    let mut tensor_index = HashMap::with_capacity(n_tensors as usize);
    for i in 0..n_tensors as usize {
        let info_offset = c.offset();
        let name = c.string(&|| format!("name of tensor #{i}"))?;
        if tensor_index.contains_key(&name) {
            return Err(GgufError::DuplicateTensor { tensor: name, offset: info_offset });
        }
        let what = || format!("info of tensor {name:?}");
        let what: What = &what;
        let n_dims = c.u32(what)?;
        check_dim_count(&name, n_dims as u64)?;
        let dims = (0..n_dims).map(|_| c.u64(what)).collect::<Result<Vec<u64>>>()?;
        let type_id = c.u32(what)?;
        let offset = c.u64(what)?;
        let ty = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType { tensor: name.clone(), id: type_id })?;
        let n_bytes = tensor_n_bytes(&name, &dims, ty)?;
        if offset % alignment != 0 {
            return Err(GgufError::MisalignedTensor { tensor: name, offset, alignment });
        }
        tensor_index.insert(name.clone(), i);
        tensors.push(TensorInfo { name, dims, ty, offset, n_bytes });
    }

    // Vocab-only files end right after the header without padding, so the
    // data section may start past the end when there are no tensors.
    let data_offset = align_up(c.offset(), alignment).ok_or(GgufError::DataOffsetOverflow { alignment })?;
    let file_size = buf.len() as u64;
    for t in &tensors {
        let end = data_offset.checked_add(t.offset).and_then(|s| s.checked_add(t.n_bytes));
        if end.is_none_or(|e| e > file_size) {
            return Err(GgufError::TensorOutOfRange { tensor: t.name.clone(), offset: t.offset, n_bytes: t.n_bytes, data_offset, file_size });
        }
    }
    let mut by_offset: Vec<&TensorInfo> = tensors.iter().collect();
    by_offset.sort_by_key(|t| t.offset);
    for pair in by_offset.windows(2) {
        // Cannot overflow: every end was checked against the file size above.
        if pair[0].offset + pair[0].n_bytes > pair[1].offset {
            return Err(GgufError::OverlappingTensors { first: pair[0].name.clone(), second: pair[1].name.clone(), offset: pair[1].offset });
        }
    }

    Ok(Header { version, alignment, data_offset, metadata, key_index, tensors, tensor_index })
}

enum Backing {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mapped(map) => map,
            Backing::Owned(vec) => vec,
        }
    }
}

/// A validated GGUF file. Construction checks the whole header and every
/// tensor's data range, so accessors cannot fail on the file's contents.
pub struct GgufFile {
    backing: Backing,
    path: Option<PathBuf>,
    header: Header,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.header.version)
            .field("file_size", &self.file_size())
            .field("n_kv", &self.header.metadata.len())
            .field("n_tensors", &self.header.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps `path` read-only and validates it.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let io = |source| GgufError::Io { path: path.to_path_buf(), source };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the map is read-only. As with every mmap-based model loader,
        // the file must not be truncated or rewritten while it is open.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::from_backing(Backing::Mapped(map), Some(path.to_path_buf()))
    }

    /// Validates a GGUF image held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile> {
        Self::from_backing(Backing::Owned(bytes), None)
    }

    fn from_backing(backing: Backing, path: Option<PathBuf>) -> Result<GgufFile> {
        let header = parse(backing.bytes())?;
        Ok(GgufFile { backing, path, header })
    }

    /// The path given to `open`, or `None` for `from_bytes`.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    pub fn version(&self) -> u32 {
        self.header.version
    }

    pub fn alignment(&self) -> u64 {
        self.header.alignment
    }

    /// Absolute file offset of the data section. Past the end of the file for a
    /// file without tensors that was not padded.
    pub fn data_offset(&self) -> u64 {
        self.header.data_offset
    }

    pub fn file_size(&self) -> u64 {
        self.backing.bytes().len() as u64
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.backing.bytes()
    }

    /// Metadata in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.header.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.header.key_index.get(key).map(|&i| &self.header.metadata[i].1)
    }

    /// Tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.header.tensor_index.get(name).map(|&i| &self.header.tensors[i])
    }

    /// The bytes of a tensor of this file.
    ///
    /// # Panics
    /// If `t` does not describe a range inside this file (a `TensorInfo` built
    /// by hand or taken from another file); infos from `tensors()` never do.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let start = self.header.data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.n_bytes));
        start
            .zip(end)
            .and_then(|(s, e)| self.bytes().get(usize::try_from(s).ok()?..usize::try_from(e).ok()?))
            .unwrap_or_else(|| panic!("tensor {:?} is not a tensor of this GGUF file", t.name))
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }

    fn get_as<'s, T>(&'s self, key: &str, expected: &'static str, convert: impl FnOnce(&'s Value) -> Option<T>) -> Result<T> {
        let value = self.get(key).ok_or_else(|| GgufError::MissingKey(key.to_owned()))?;
        convert(value).ok_or_else(|| GgufError::WrongType { key: key.to_owned(), expected, found: value.value_type() })
    }

    /// Any non-negative integer value.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.get_as(key, "non-negative integer", Value::as_u64)
    }

    /// Any float or integer value, rounded to f32.
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.get_as(key, "number", Value::as_f32)
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.get_as(key, "string", Value::as_str)
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        self.get_as(key, "bool", Value::as_bool)
    }

    pub fn get_array(&self, key: &str) -> Result<&[Value]> {
        self.get_as(key, "array", Value::as_array)
    }
}
