//! Each kind of malformed file gives its own typed error, never a panic.

mod common;

use common::{read, stories260k, Raw};
use kiln_gguf::{GgmlType, GgufError, GgufFile, Value, ValueType};

const F32: u32 = 0;
const Q4_0: u32 = 2;

fn parse(raw: Raw) -> Result<GgufFile, GgufError> {
    GgufFile::from_bytes(raw.0)
}

/// One KV, then the given tensor infos, padding, and `data_len` zero bytes.
fn with_tensors(tensors: &[(&str, &[u64], u32, u64)], data_len: usize) -> Raw {
    let mut raw = Raw::header(3, tensors.len() as u64, 1).kv_str("general.architecture", "llama");
    for &(name, dims, ty, offset) in tensors {
        raw = raw.tensor(name, dims, ty, offset);
    }
    raw.pad(32).zeros(data_len)
}

#[test]
fn minimal_valid_files_parse() {
    let file = parse(with_tensors(&[("a", &[8], F32, 0), ("b", &[32, 2], Q4_0, 32)], 32 + 36)).unwrap();
    assert_eq!(file.alignment(), 32);
    assert_eq!(file.data_offset() % 32, 0);
    assert_eq!(file.tensors()[1].n_bytes, 36);
    assert_eq!(file.tensor_data(&file.tensors()[1]).len(), 36);
    assert_eq!(file.architecture().unwrap(), "llama");
    // Version 2 has the same little-endian layout.
    let mut v2 = with_tensors(&[("a", &[8], F32, 0)], 32);
    v2.0[4] = 2;
    assert_eq!(parse(v2).unwrap().version(), 2);
}

#[test]
fn truncated_real_file_fails_at_every_cut() {
    let bytes = read(&kiln_testdata::path("models/stories260K-F16.gguf"));
    let data_offset = GgufFile::from_bytes(bytes.clone()).unwrap().data_offset() as usize;
    // Every cut inside the header, then a spread of cuts through the tensor data.
    let cuts = (0..=data_offset).chain((data_offset..bytes.len()).step_by(251)).chain([bytes.len() - 1]);
    let mut n = 0;
    for cut in cuts {
        let err = GgufFile::from_bytes(bytes[..cut].to_vec()).expect_err("a cut file must not parse");
        assert!(
            matches!(
                err,
                GgufError::Truncated { .. }
                    | GgufError::StringTooLong { .. }
                    | GgufError::ArrayTooLong { .. }
                    | GgufError::TensorCountTooLarge { .. }
                    | GgufError::KvCountTooLarge { .. }
                    | GgufError::TensorOutOfRange { .. }
            ),
            "cut at {cut}: unexpected {err}"
        );
        n += 1;
    }
    assert!(n > data_offset);
}

#[test]
fn truncated_vocab_file_fails() {
    // No tensors here, so only the metadata can reveal the cut.
    let bytes = read(&kiln_testdata::path("tokenizer/ggml-vocab-bert-bge.gguf"));
    // Each parse reads up to 30k token strings, so the cuts past the first KVs are sampled.
    for cut in (0..2048).chain((2048..bytes.len()).step_by(613)).chain([bytes.len() - 1]) {
        assert!(GgufFile::from_bytes(bytes[..cut].to_vec()).is_err(), "cut at {cut}");
    }
}

#[test]
fn empty_file_on_disk_is_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("empty.gguf");
    std::fs::write(&path, b"").unwrap();
    let err = GgufFile::open(&path).unwrap_err();
    assert!(matches!(err, GgufError::Truncated { offset: 0, .. }), "{err}");
}

#[test]
fn missing_file_is_io_error_naming_path() {
    let err = GgufFile::open("/nonexistent/model.gguf").unwrap_err();
    match &err {
        GgufError::Io { path, .. } => assert_eq!(path.to_str(), Some("/nonexistent/model.gguf")),
        other => panic!("expected Io, got {other}"),
    }
    assert!(err.to_string().contains("/nonexistent/model.gguf"));
}

#[test]
fn wrong_magic() {
    let mut bytes = read(&stories260k());
    bytes[..4].copy_from_slice(b"GGML");
    let err = GgufFile::from_bytes(bytes).unwrap_err();
    assert!(matches!(err, GgufError::BadMagic { found } if &found == b"GGML"), "{err}");
}

#[test]
fn unsupported_versions() {
    for version in [1u32, 99, 0, 0x0300_0000 /* a big-endian v3 file */] {
        let mut raw = with_tensors(&[("a", &[8], F32, 0)], 32);
        raw.0[4..8].copy_from_slice(&version.to_le_bytes());
        let err = parse(raw).unwrap_err();
        assert!(matches!(err, GgufError::UnsupportedVersion(v) if v == version), "{err}");
    }
}

#[test]
fn absurd_counts_fail_before_allocating() {
    for count in [1u64 << 60, u64::MAX, 1000] {
        let err = parse(Raw::header(3, count, 0).zeros(64)).unwrap_err();
        assert!(matches!(err, GgufError::TensorCountTooLarge { count: c, offset: 8, .. } if c == count), "{err}");
        let err = parse(Raw::header(3, 0, count).zeros(64)).unwrap_err();
        assert!(matches!(err, GgufError::KvCountTooLarge { count: c, offset: 16, .. } if c == count), "{err}");
    }
}

#[test]
fn absurd_array_length() {
    for elem in [0u32 /* u8 */, 8 /* string */, 9 /* array */] {
        let raw = Raw::header(3, 0, 1).str("tokenizer.ggml.tokens").u32(9).u32(elem).u64(1 << 60).zeros(64);
        let err = parse(raw).unwrap_err();
        assert!(matches!(&err, GgufError::ArrayTooLong { key, len, .. } if key == "tokenizer.ggml.tokens" && *len == 1 << 60), "{err}");
    }
    // Plausible by count alone, but the u64 elements do not fit.
    let raw = Raw::header(3, 0, 1).str("k").u32(9).u32(10).u64(8).zeros(60);
    assert!(matches!(parse(raw).unwrap_err(), GgufError::ArrayTooLong { len: 8, .. }));
}

#[test]
fn absurd_string_lengths() {
    // In a key.
    let err = parse(Raw::header(3, 0, 1).u64(1 << 62).zeros(64)).unwrap_err();
    assert!(matches!(&err, GgufError::StringTooLong { what, len, offset: 24, .. } if what.contains("key") && *len == 1 << 62), "{err}");
    // In a value.
    let err = parse(Raw::header(3, 0, 1).str("general.name").u32(8).u64(u64::MAX).zeros(64)).unwrap_err();
    assert!(matches!(&err, GgufError::StringTooLong { what, .. } if what.contains("general.name")), "{err}");
    // In a tensor name.
    let err = parse(Raw::header(3, 1, 0).u64(1000).zeros(64)).unwrap_err();
    assert!(matches!(&err, GgufError::StringTooLong { what, .. } if what.contains("tensor")), "{err}");
}

#[test]
fn invalid_utf8() {
    let err = parse(Raw::header(3, 0, 1).u64(2).bytes(&[0xff, 0xfe]).u32(4).u32(1)).unwrap_err();
    assert!(matches!(&err, GgufError::InvalidUtf8 { offset: 32, .. }), "{err}");
    let err = parse(Raw::header(3, 0, 1).str("general.name").u32(8).u64(1).bytes(&[0x80])).unwrap_err();
    assert!(matches!(&err, GgufError::InvalidUtf8 { what, .. } if what.contains("general.name")), "{err}");
}

#[test]
fn unknown_value_type() {
    let err = parse(Raw::header(3, 0, 1).str("k").u32(13).u32(0)).unwrap_err();
    assert!(matches!(&err, GgufError::UnknownValueType { key, id: 13, offset: 33 } if key == "k"), "{err}");
    // Unknown element type of an array.
    let err = parse(Raw::header(3, 0, 1).str("k").u32(9).u32(77).u64(0)).unwrap_err();
    assert!(matches!(&err, GgufError::UnknownValueType { id: 77, .. }), "{err}");
}

#[test]
fn invalid_bool() {
    let err = parse(Raw::header(3, 0, 1).str("flag").u32(7).u8(2)).unwrap_err();
    assert!(matches!(&err, GgufError::InvalidBool { key, byte: 2, .. } if key == "flag"), "{err}");
}

#[test]
fn nested_arrays_parse_and_excess_nesting_fails() {
    // [[1u8, 2u8], []] as an array of arrays.
    let raw = Raw::header(3, 0, 1).str("nested").u32(9).u32(9).u64(2).u32(0).u64(2).u8(1).u8(2).u32(0).u64(0);
    let file = parse(raw).unwrap();
    let expected = Value::Array(ValueType::Array, vec![Value::Array(ValueType::U8, vec![Value::U8(1), Value::U8(2)]), Value::Array(ValueType::U8, vec![])]);
    assert_eq!(file.get("nested"), Some(&expected));

    let mut raw = Raw::header(3, 0, 1).str("deep").u32(9);
    for _ in 0..100 {
        raw = raw.u32(9).u64(1);
    }
    let err = parse(raw.u32(0).u64(0)).unwrap_err();
    assert!(matches!(&err, GgufError::NestingTooDeep { key, .. } if key == "deep"), "{err}");
}

#[test]
fn duplicate_key_and_tensor() {
    let raw = Raw::header(3, 0, 2).kv_u32("a.b", 1).kv_u32("a.b", 2);
    let err = parse(raw).unwrap_err();
    assert!(matches!(&err, GgufError::DuplicateKey { key, offset: 43 } if key == "a.b"), "{err}");

    let err = parse(with_tensors(&[("w", &[8], F32, 0), ("w", &[8], F32, 32)], 64)).unwrap_err();
    assert!(matches!(&err, GgufError::DuplicateTensor { tensor, .. } if tensor == "w"), "{err}");
}

#[test]
fn bad_alignment_values() {
    for value in [0u32, 3, 48] {
        let raw = Raw::header(3, 0, 1).kv_u32("general.alignment", value);
        let err = parse(raw).unwrap_err();
        assert!(matches!(&err, GgufError::BadAlignment { found: Value::U32(v) } if *v == value), "{err}");
    }
    let err = parse(Raw::header(3, 0, 1).kv_str("general.alignment", "32")).unwrap_err();
    assert!(matches!(err, GgufError::BadAlignment { found: Value::String(_) }), "{err}");
    // A valid non-default alignment is honoured.
    let raw = Raw::header(3, 1, 1).kv_u32("general.alignment", 64).tensor("w", &[8], F32, 0).pad(64).zeros(32);
    let file = parse(raw).unwrap();
    assert_eq!((file.alignment(), file.data_offset() % 64), (64, 0));
}

#[test]
fn tensor_offset_out_of_range() {
    let err = parse(with_tensors(&[("w", &[8], F32, 64)], 64)).unwrap_err();
    assert!(matches!(&err, GgufError::TensorOutOfRange { tensor, offset: 64, n_bytes: 32, .. } if tensor == "w"), "{err}");
    // Offset so large that data_offset + offset overflows.
    let err = parse(with_tensors(&[("w", &[8], F32, u64::MAX - 31)], 64)).unwrap_err();
    assert!(matches!(err, GgufError::TensorOutOfRange { .. }), "{err}");
    // Data ending one byte past the end.
    let err = parse(with_tensors(&[("w", &[8], F32, 0)], 31)).unwrap_err();
    assert!(matches!(err, GgufError::TensorOutOfRange { .. }), "{err}");
}

#[test]
fn overlapping_tensors() {
    // b starts inside a (a is 64 bytes long).
    let err = parse(with_tensors(&[("a", &[16], F32, 0), ("b", &[8], F32, 32)], 96)).unwrap_err();
    assert!(matches!(&err, GgufError::OverlappingTensors { first, second, offset: 32 } if first == "a" && second == "b"), "{err}");
    // Same start, declared in the other order.
    let err = parse(with_tensors(&[("b", &[8], F32, 0), ("a", &[8], F32, 0)], 64)).unwrap_err();
    assert!(matches!(err, GgufError::OverlappingTensors { .. }), "{err}");
}

#[test]
fn misaligned_tensor_offset() {
    let err = parse(with_tensors(&[("w", &[8], F32, 4)], 64)).unwrap_err();
    assert!(matches!(&err, GgufError::MisalignedTensor { tensor, offset: 4, alignment: 32 } if tensor == "w"), "{err}");
}

#[test]
fn unknown_tensor_type() {
    for id in [4u32 /* removed Q4_2 */, 31, 1000, u32::MAX] {
        let err = parse(with_tensors(&[("blk.0.w", &[32], id, 0)], 64)).unwrap_err();
        assert!(matches!(&err, GgufError::UnknownTensorType { tensor, id: i } if tensor == "blk.0.w" && *i == id), "{err}");
    }
}

#[test]
fn zero_dim() {
    let err = parse(with_tensors(&[("w", &[8, 0], F32, 0)], 64)).unwrap_err();
    assert!(matches!(&err, GgufError::ZeroDim { tensor, dim: 1 } if tensor == "w"), "{err}");
}

#[test]
fn bad_dim_counts() {
    let err = parse(with_tensors(&[("w", &[1, 1, 1, 1, 8], F32, 0)], 64)).unwrap_err();
    assert!(matches!(&err, GgufError::InvalidDimCount { tensor, n_dims: 5 } if tensor == "w"), "{err}");
    let err = parse(with_tensors(&[("w", &[], F32, 0)], 64)).unwrap_err();
    assert!(matches!(err, GgufError::InvalidDimCount { n_dims: 0, .. }), "{err}");
    // A huge n_dims fails before any dims are read.
    let raw = Raw::header(3, 1, 0).str("w").u32(u32::MAX).zeros(64);
    assert!(matches!(parse(raw).unwrap_err(), GgufError::InvalidDimCount { n_dims: 0xffff_ffff, .. }));
}

#[test]
fn element_count_overflow() {
    let err = parse(with_tensors(&[("w", &[1 << 32, 1 << 32, 1 << 32], F32, 0)], 64)).unwrap_err();
    assert!(matches!(&err, GgufError::ElementCountOverflow { tensor, .. } if tensor == "w"), "{err}");
    // Fits in u64 but not in ggml's i64.
    let err = parse(with_tensors(&[("w", &[1 << 32, 1 << 31], F32, 0)], 64)).unwrap_err();
    assert!(matches!(err, GgufError::ElementCountOverflow { .. }), "{err}");
}

#[test]
fn row_not_multiple_of_block() {
    // Q4_0 blocks hold 32 values; 16 * 4 = 64 elements is a whole number of
    // blocks, but a 16-long row is not.
    let err = parse(with_tensors(&[("w", &[16, 4], Q4_0, 0)], 64)).unwrap_err();
    assert!(matches!(&err, GgufError::RowNotBlockAligned { tensor, ty: GgmlType::Q4_0, row_len: 16, block_size: 32 } if tensor == "w"), "{err}");
}

#[test]
fn typed_getters_name_the_key() {
    let file = GgufFile::open(stories260k()).unwrap();
    assert!(matches!(file.get_u64("llama.nope"), Err(GgufError::MissingKey(k)) if k == "llama.nope"));
    let err = file.get_u64("general.architecture").unwrap_err();
    assert!(matches!(&err, GgufError::WrongType { key, found: ValueType::String, .. } if key == "general.architecture"), "{err}");
    assert!(matches!(file.get_str("llama.block_count"), Err(GgufError::WrongType { .. })));
    assert!(matches!(file.get_bool("llama.block_count"), Err(GgufError::WrongType { .. })));
    assert!(matches!(file.get_array("llama.block_count"), Err(GgufError::WrongType { .. })));
    assert!(matches!(file.get_f32("general.architecture"), Err(GgufError::WrongType { .. })));
    assert_eq!(file.get_u64("llama.block_count").unwrap(), 5);
    assert_eq!(file.get_f32("llama.block_count").unwrap(), 5.0);
    let no_arch = parse(Raw::header(3, 0, 0)).unwrap();
    assert!(matches!(no_arch.architecture(), Err(GgufError::MissingKey(k)) if k == "general.architecture"));
}

#[test]
fn vocab_only_file_may_end_before_data_offset() {
    // 24-byte header + a 1-byte KV value: the aligned data offset lies past the end.
    let file = parse(Raw::header(3, 0, 1).str("k").u32(0).u8(7)).unwrap();
    assert_eq!(file.file_size(), 38);
    assert_eq!(file.data_offset(), 64);
    assert_eq!(file.get("k"), Some(&Value::U8(7)));
}
