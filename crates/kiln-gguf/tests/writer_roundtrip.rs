//! GgufWriter output reads back with identical metadata, tensors and data.

mod common;

use common::{every_value_kind, random_data, tensor_specs, Rng};
use kiln_gguf::{GgmlType, GgufError, GgufFile, GgufWriter, Value, ValueType};

fn build(alignment: Option<u32>) -> (GgufWriter, Vec<Vec<u8>>) {
    let mut w = GgufWriter::new();
    for (k, v) in every_value_kind() {
        w.add_kv(k, v);
    }
    if let Some(a) = alignment {
        w.add_kv("general.alignment", Value::U32(a));
    }
    let specs = tensor_specs();
    for (name, dims, ty) in &specs {
        w.add_tensor(name.clone(), dims.clone(), *ty).unwrap();
    }
    let data = random_data(&mut Rng::new(0x9e37_79b9), &specs);
    (w, data)
}

fn check(file: &GgufFile, alignment: Option<u32>, data: &[Vec<u8>]) {
    assert_eq!(file.version(), 3);
    assert_eq!(file.alignment(), alignment.map_or(32, u64::from));
    let mut expected = every_value_kind();
    if let Some(a) = alignment {
        expected.push(("general.alignment".into(), Value::U32(a)));
    }
    assert_eq!(file.metadata(), expected.as_slice());
    let specs = tensor_specs();
    assert_eq!(file.tensors().len(), specs.len());
    for (i, (t, (name, dims, ty))) in file.tensors().iter().zip(&specs).enumerate() {
        assert_eq!((&t.name, &t.dims, t.ty), (name, dims, *ty));
        assert_eq!(t.offset % file.alignment(), 0);
        assert_eq!(file.tensor_data(t), data[i].as_slice(), "{name}");
    }
    assert_eq!(file.file_size() % file.alignment(), 0, "file ends padded");
}

#[test]
fn round_trip_in_memory_and_on_disk() {
    for alignment in [None, Some(64), Some(1)] {
        let (w, data) = build(alignment);
        let bytes = w.clone().to_bytes(|i, out| out.write_all(&data[i])).unwrap();
        check(&GgufFile::from_bytes(bytes.clone()).unwrap(), alignment, &data);

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.gguf");
        // Write in uneven pieces: the callback may call write any number of times.
        w.write_to_file(&path, |i, out| {
            for chunk in data[i].chunks(7) {
                out.write_all(chunk)?;
            }
            Ok(())
        })
        .unwrap();
        let file = GgufFile::open(&path).unwrap();
        check(&file, alignment, &data);
        assert_eq!(std::fs::read(&path).unwrap(), bytes, "file and in-memory output agree");
        assert!(!dir.path().join("out.gguf.tmp").exists());
    }
}

#[test]
fn add_kv_replaces_in_place() {
    let mut w = GgufWriter::new();
    w.add_kv("a", Value::U32(1));
    w.add_kv("b", Value::U32(2));
    w.add_kv("a", Value::String("x".into()));
    let file = GgufFile::from_bytes(w.to_bytes(|_, _| Ok(())).unwrap()).unwrap();
    assert_eq!(file.metadata(), &[("a".into(), Value::String("x".into())), ("b".into(), Value::U32(2))]);
    assert_eq!(file.file_size(), 24 + (8 + 1 + 4 + 8 + 1) + (8 + 1 + 4 + 4), "no padding without tensors");
}

#[test]
fn callback_writing_wrong_size_is_rejected_and_leaves_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.gguf");
    for delta in [-1i64, 1] {
        let mut w = GgufWriter::new();
        w.add_tensor("a", vec![4], GgmlType::F32).unwrap();
        w.add_tensor("b", vec![4], GgmlType::F32).unwrap();
        let err = w.write_to_file(&path, |i, out| out.write_all(&vec![0u8; (16 + if i == 1 { delta } else { 0 }) as usize])).unwrap_err();
        assert!(matches!(&err, GgufError::TensorDataSize { tensor, expected: 16, written } if tensor == "b" && *written == (16 + delta) as u64), "{err}");
        assert!(!path.exists() && !dir.path().join("bad.gguf.tmp").exists());
    }
    let mut w = GgufWriter::new();
    w.add_tensor("a", vec![4], GgmlType::F32).unwrap();
    let err = w.to_bytes(|_, _| Err(std::io::Error::other("source gone"))).unwrap_err();
    assert!(matches!(&err, GgufError::TensorData { tensor, .. } if tensor == "a"), "{err}");
}

#[test]
fn writer_rejects_invalid_declarations() {
    let mut w = GgufWriter::new();
    w.add_tensor("a", vec![32], GgmlType::Q8_0).unwrap();
    assert!(matches!(w.add_tensor("a", vec![32], GgmlType::F32), Err(GgufError::DuplicateTensor { .. })));
    assert!(matches!(w.add_tensor("b", vec![16], GgmlType::Q8_0), Err(GgufError::RowNotBlockAligned { .. })));
    assert!(matches!(w.add_tensor("c", vec![0], GgmlType::F32), Err(GgufError::ZeroDim { .. })));
    assert!(matches!(w.add_tensor("d", vec![1; 5], GgmlType::F32), Err(GgufError::InvalidDimCount { n_dims: 5, .. })));
    assert!(matches!(w.add_tensor("e", vec![u64::MAX, 2], GgmlType::F32), Err(GgufError::ElementCountOverflow { .. })));
    assert_eq!(w.tensors().len(), 1);

    let mut w = GgufWriter::new();
    w.add_kv("mixed", Value::Array(ValueType::U32, vec![Value::U32(1), Value::I32(2)]));
    let err = w.to_bytes(|_, _| Ok(())).unwrap_err();
    assert!(matches!(&err, GgufError::MixedArray { key, index: 1, .. } if key == "mixed"), "{err}");

    let mut w = GgufWriter::new();
    w.add_kv("general.alignment", Value::U32(24));
    assert!(matches!(w.to_bytes(|_, _| Ok(())), Err(GgufError::BadAlignment { .. })));
}
