//! Dequantizes every tensor of every shipped test model and compares it with the
//! reference statistics in its `.ref.json` (shared/testdata/README.md, "Dequantization"):
//! first16/last16 bit-exact, and sum, sum_sq, wsum within the tight bounds that hold
//! for a dequantizer with ggml's exact operation order.

mod common;

use common::*;
use kiln_gguf::GgufFile;
use kiln_quant::dequantize;

struct Stats {
    sum: f64,
    sum_sq: f64,
    wsum: f64,
}

/// Sums in memory order, in f64, as the reference does.
fn stats(values: &[f32]) -> Stats {
    let mut s = Stats { sum: 0.0, sum_sq: 0.0, wsum: 0.0 };
    for (i, &v) in values.iter().enumerate() {
        let v = f64::from(v);
        s.sum += v;
        s.sum_sq += v * v;
        s.wsum += v * ((i % 251) + 1) as f64;
    }
    s
}

fn f64_of(v: &serde_json::Value, what: &str) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("{what} is not a number: {v}"))
}

#[test]
fn every_model_tensor_dequantizes_to_its_reference() {
    let models = kiln_testdata::path("models");
    let mut refs: Vec<_> = std::fs::read_dir(&models)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", models.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".ref.json"))
        .collect();
    refs.sort();
    let (mut n_models, mut n_tensors) = (0, 0);
    let mut types_seen = std::collections::BTreeSet::new();
    for ref_path in refs {
        let reference = read_json(&ref_path);
        let Some(rel) = reference["path"].as_str() else {
            continue;
        }; // F32 tiny models are not shipped
        let model_path = kiln_testdata::shared_path(rel);
        let file = GgufFile::open(&model_path).unwrap_or_else(|e| panic!("{}: {e}", model_path.display()));
        let entries = reference["tensors"].as_array().unwrap();
        assert_eq!(file.tensors().len(), entries.len(), "{rel}: tensor count");
        for entry in entries {
            let name = entry["name"].as_str().unwrap();
            let ctx = format!("{rel} {name}");
            let t = file.tensor(name).unwrap_or_else(|| panic!("{ctx}: missing from the file"));
            assert_eq!(t.ty.name(), entry["type"].as_str().unwrap(), "{ctx}: type");
            assert_eq!(t.n_bytes, entry["n_bytes"].as_u64().unwrap(), "{ctx}: n_bytes");
            let shape: Vec<u64> = entry["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).collect();
            assert_eq!(t.dims, shape, "{ctx}: shape");
            assert_eq!(file.data_offset() + t.offset, entry["data_offset"].as_u64().unwrap(), "{ctx}: data offset");

            // Row by row, as the CPU backend calls it.
            let row_len = t.dims[0] as usize;
            let n = t.n_elements() as usize;
            let data = file.tensor_data(t);
            let row_bytes = data.len() / (n / row_len);
            let mut values = vec![f32::NAN; n];
            for (src, dst) in data.chunks_exact(row_bytes).zip(values.chunks_exact_mut(row_len)) {
                dequantize(t.ty, src, dst).unwrap_or_else(|e| panic!("{ctx}: {e}"));
            }

            for (key, got) in [("first16", &values[..16]), ("last16", &values[n - 16..])] {
                let want: Vec<f32> = entry[key].as_array().unwrap().iter().map(|v| f64_of(v, key) as f32).collect();
                let same = got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits() || (*g == 0.0 && *w == 0.0));
                assert!(same, "{ctx}: {key} differs:\n got  {got:?}\n want {want:?}");
            }
            let s = stats(&values);
            let (sum, sum_sq, wsum) = (f64_of(&entry["sum"], "sum"), f64_of(&entry["sum_sq"], "sum_sq"), f64_of(&entry["wsum"], "wsum"));
            // Bit-exact values leave only f64 summation-order and 12-digit printing error.
            let tol = 1e-9 * (n as f64 * sum_sq).sqrt();
            assert!((s.sum - sum).abs() <= tol, "{ctx}: sum {} vs {sum} (tol {tol:e})", s.sum);
            assert!((s.wsum - wsum).abs() <= 251.0 * tol, "{ctx}: wsum {} vs {wsum} (tol {:e})", s.wsum, 251.0 * tol);
            assert!((s.sum_sq - sum_sq).abs() <= 1e-9 * sum_sq, "{ctx}: sum_sq {} vs {sum_sq}", s.sum_sq);
            types_seen.insert(t.ty);
            n_tensors += 1;
        }
        n_models += 1;
    }
    // 3 stories260K variants, 15 tiny-llama and 4 tiny-qwen3 files are shipped.
    assert_eq!(n_models, 22, "expected 22 shipped models");
    assert_eq!(types_seen.len(), 18, "types covered: {types_seen:?}");
    assert!(n_tensors > 400, "only {n_tensors} tensors checked");
}

/// gpt-oss's MXFP4 experts were written by ggml's reference quantizer from values that MXFP4
/// holds exactly (testdata/archs README), so dequantizing and quantizing them again must give
/// back every byte.
#[test]
fn mxfp4_expert_tensors_requantize_byte_for_byte() {
    let file = GgufFile::open(kiln_testdata::path("archs/tiny-gpt-oss-MXFP4.gguf")).unwrap();
    let mut checked = 0;
    for t in file.tensors().iter().filter(|t| t.ty == kiln_quant::GgmlType::MXFP4) {
        let bytes = file.tensor_data(t);
        let mut values = vec![0f32; t.n_elements() as usize];
        dequantize(t.ty, bytes, &mut values).unwrap();
        let mut again = vec![0u8; bytes.len()];
        kiln_quant::quantize(t.ty, &values, &mut again).unwrap();
        assert!(again == bytes, "{}: requantized bytes differ", t.name);
        checked += 1;
    }
    assert_eq!(checked, 6, "expected gate/up/down experts of 2 layers");
}
