//! The fuzz harness body, shared by the cargo-fuzz target and the mutation tests.

use std::hint::black_box;

use crate::{GgufFile, GgufWriter, Value};

fn touch_value(value: &Value) -> u64 {
    let scalar = value.as_u64().unwrap_or(0)
        ^ value.as_i64().unwrap_or(0) as u64
        ^ value.as_f64().unwrap_or(0.0).to_bits()
        ^ u64::from(value.as_f32().unwrap_or(0.0).to_bits())
        ^ u64::from(value.as_bool().unwrap_or(false))
        ^ value.as_str().map_or(0, |s| s.len() as u64)
        ^ u64::from(value.value_type().id());
    value.as_array().unwrap_or(&[]).iter().fold(scalar, |acc, v| acc.wrapping_add(touch_value(v)))
}

/// Writes `file` back out with `GgufWriter` (tensor data copied, offsets repacked).
pub fn rewrite(file: &GgufFile) -> Vec<u8> {
    let mut writer = GgufWriter::new();
    for (key, value) in file.metadata() {
        writer.add_kv(key.clone(), value.clone());
    }
    for t in file.tensors() {
        writer.add_tensor(t.name.clone(), t.dims.clone(), t.ty).expect("a validated tensor must be accepted by the writer");
    }
    writer.to_bytes(|i, out| out.write_all(file.tensor_data(&file.tensors()[i]))).expect("a validated file must be writable")
}

/// Parses `bytes` and reads every value and tensor byte through the public
/// API. When the file is valid, also checks that writing it back and reading
/// that gives the same tensors and data, and that a second rewrite is byte
/// identical. Returns whether the input parsed. Panics only on a bug.
pub fn exercise(bytes: Vec<u8>) -> bool {
    let Ok(file) = GgufFile::from_bytes(bytes) else {
        return false;
    };
    let mut acc = file.version() as u64 ^ file.alignment() ^ file.data_offset() ^ file.file_size();
    for (key, value) in file.metadata() {
        assert!(file.get(key).is_some_and(|v| std::ptr::eq(v, value)), "lookup of {key:?}");
        acc = acc.wrapping_add(touch_value(value));
    }
    acc ^= file.architecture().map_or(0, |a| a.len() as u64);
    for t in file.tensors() {
        assert!(file.tensor(&t.name).is_some_and(|found| std::ptr::eq(found, t)));
        let data = file.tensor_data(t);
        assert_eq!(data.len() as u64, t.n_bytes);
        assert!(t.n_elements() > 0);
        acc = data.iter().fold(acc, |a, &b| a.wrapping_mul(31).wrapping_add(b as u64));
    }
    black_box(acc);

    let first = rewrite(&file);
    let reread = GgufFile::from_bytes(first.clone()).expect("rewritten file must parse");
    assert_eq!(reread.metadata().len(), file.metadata().len());
    assert_eq!(reread.tensors().len(), file.tensors().len());
    for (a, b) in file.tensors().iter().zip(reread.tensors()) {
        assert_eq!((&a.name, &a.dims, a.ty, a.n_bytes), (&b.name, &b.dims, b.ty, b.n_bytes));
        assert_eq!(file.tensor_data(a), reread.tensor_data(b));
    }
    assert!(rewrite(&reread) == first, "second rewrite differs");
    true
}
