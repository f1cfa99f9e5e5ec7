//! Shared test helpers: test data locations and a raw GGUF byte builder that
//! is independent of `GgufWriter`, so reader tests do not trust the writer.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use kiln_gguf::{GgmlType, GgufWriter, Value, ValueType};

pub fn stories260k() -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/stories260K.gguf");
    assert!(path.is_file(), "test model missing: {}", path.display());
    path
}

/// Every `.gguf` in `dir` (sorted); fails if the folder is missing or has none.
pub fn gguf_files_in(dir: &Path) -> Vec<PathBuf> {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("test data folder {} unreadable: {e}", dir.display()));
    let mut files: Vec<PathBuf> = entries.map(|e| e.expect("read_dir entry").path()).filter(|p| p.extension().is_some_and(|x| x == "gguf")).collect();
    files.sort();
    assert!(!files.is_empty(), "no .gguf files in {}", dir.display());
    files
}

pub fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// Little-endian GGUF bytes assembled field by field.
#[derive(Clone, Default)]
pub struct Raw(pub Vec<u8>);

impl Raw {
    pub fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        Raw(b"GGUF".to_vec()).u32(version).u64(n_tensors).u64(n_kv)
    }
    pub fn u8(mut self, v: u8) -> Raw {
        self.0.push(v);
        self
    }
    pub fn u32(mut self, v: u32) -> Raw {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(mut self, v: u64) -> Raw {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(mut self, b: &[u8]) -> Raw {
        self.0.extend_from_slice(b);
        self
    }
    pub fn str(self, s: &str) -> Raw {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    /// A KV holding a u32.
    pub fn kv_u32(self, key: &str, v: u32) -> Raw {
        self.str(key).u32(4).u32(v)
    }
    /// A KV holding a string.
    pub fn kv_str(self, key: &str, v: &str) -> Raw {
        self.str(key).u32(8).str(v)
    }
    pub fn tensor(self, name: &str, dims: &[u64], type_id: u32, offset: u64) -> Raw {
        let mut raw = self.str(name).u32(dims.len() as u32);
        for &d in dims {
            raw = raw.u64(d);
        }
        raw.u32(type_id).u64(offset)
    }
    /// Zero padding up to a multiple of `alignment`.
    pub fn pad(mut self, alignment: usize) -> Raw {
        let len = self.0.len().next_multiple_of(alignment);
        self.0.resize(len, 0);
        self
    }
    pub fn zeros(mut self, n: usize) -> Raw {
        self.0.resize(self.0.len() + n, 0);
        self
    }
}

/// A small deterministic generator (xorshift64*), so tests need no extra crates.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in 0..n (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// One metadata entry of every value type, arrays of arrays included.
pub fn every_value_kind() -> Vec<(String, Value)> {
    let strings = |items: &[&str]| Value::Array(ValueType::String, items.iter().map(|s| Value::String(s.to_string())).collect());
    vec![
        ("general.architecture".into(), Value::String("llama".into())),
        ("t.u8".into(), Value::U8(200)),
        ("t.i8".into(), Value::I8(-100)),
        ("t.u16".into(), Value::U16(60000)),
        ("t.i16".into(), Value::I16(-30000)),
        ("t.u32".into(), Value::U32(4_000_000_000)),
        ("t.i32".into(), Value::I32(-2_000_000_000)),
        ("t.f32".into(), Value::F32(-1.25e-5)),
        ("t.bool".into(), Value::Bool(true)),
        ("t.string".into(), Value::String("héllo ▁wörld 🦀".into())),
        ("t.empty_string".into(), Value::String(String::new())),
        ("t.u64".into(), Value::U64(u64::MAX)),
        ("t.i64".into(), Value::I64(i64::MIN)),
        ("t.f64".into(), Value::F64(std::f64::consts::PI)),
        ("t.strings".into(), strings(&["a", "", "<0x0A>", "▁the"])),
        ("t.empty_array".into(), Value::Array(ValueType::F32, vec![])),
        ("t.i32s".into(), Value::Array(ValueType::I32, (-5..5).map(Value::I32).collect())),
        ("t.bools".into(), Value::Array(ValueType::Bool, vec![Value::Bool(false), Value::Bool(true)])),
        (
            "t.nested".into(),
            Value::Array(
                ValueType::Array,
                vec![
                    strings(&["x", "y"]),
                    Value::Array(ValueType::U64, vec![Value::U64(7)]),
                    Value::Array(ValueType::Array, vec![Value::Array(ValueType::F64, vec![Value::F64(-0.5)])]),
                ],
            ),
        ),
    ]
}

/// (name, dims, type) for a spread of block sizes and ranks.
pub fn tensor_specs() -> Vec<(String, Vec<u64>, GgmlType)> {
    vec![
        ("norm".into(), vec![7], GgmlType::F32),
        ("f16".into(), vec![3, 5], GgmlType::F16),
        ("q4_0".into(), vec![64, 3], GgmlType::Q4_0),
        ("q6_k".into(), vec![256, 2, 1], GgmlType::Q6_K),
        ("q1_0".into(), vec![128, 1, 2, 1], GgmlType::Q1_0),
        ("i8".into(), vec![5], GgmlType::I8),
    ]
}

pub fn random_data(rng: &mut Rng, specs: &[(String, Vec<u64>, GgmlType)]) -> Vec<Vec<u8>> {
    specs
        .iter()
        .map(|(_, dims, ty)| {
            let n = ty.bytes_for(dims.iter().product()).unwrap();
            (0..n).map(|_| rng.next_u64() as u8).collect()
        })
        .collect()
}

/// A small valid file holding every value kind and a few tensors of random bytes.
pub fn synthetic_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    for (k, v) in every_value_kind() {
        w.add_kv(k, v);
    }
    let specs = tensor_specs();
    for (name, dims, ty) in &specs {
        w.add_tensor(name.clone(), dims.clone(), *ty).unwrap();
    }
    let data = random_data(&mut Rng::new(7), &specs);
    w.to_bytes(|i, out| out.write_all(&data[i])).unwrap()
}
