//! Byte-exact agreement of the quantizers with the reference implementations:
//! gguf-py (fixtures written by tests/fixtures/gen_fixtures.py), llama.cpp's
//! llama-quantize (the model files in shared/testdata, quantized from weights the
//! fixture script regenerates bit for bit) and, for the IQ3, IQ2 and IQ1 codebook formats, ggml itself
//! (fixtures written by the tests/fixtures/codebook_ref.c harness).

mod common;

use common::*;
use kiln_quant::{dequantize, quantize, quantized_size, vec_dot, GgmlType};

/// Index of the first differing byte, for a readable failure.
fn first_mismatch(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y).or((a.len() != b.len()).then_some(a.len().min(b.len())))
}

fn quantize_to_vec(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; quantized_size(ty, x.len()).unwrap()];
    quantize(ty, x, &mut out).unwrap_or_else(|e| panic!("quantize {ty}: {e}"));
    out
}

#[test]
fn quantizers_match_gguf_py_byte_for_byte() {
    let dir = fixtures_dir();
    let manifest = read_json(&dir.join("manifest.json"));
    let input = f32s_from_le(&read(&dir.join("gguf_py_input.f32")));
    let n_rows = manifest["gguf_py_rows"].as_u64().unwrap() as usize;
    let row_len = manifest["gguf_py_row_len"].as_u64().unwrap() as usize;
    assert_eq!(input.len(), n_rows * row_len);
    let types = manifest["gguf_py_types"].as_array().unwrap();
    assert!(types.len() >= 10, "fixture manifest lists only {} types", types.len());
    let refs = manifest["ref_quant_types"].as_array().unwrap();
    assert!(refs.len() >= 2, "fixture manifest lists only {} reference quantizer types", refs.len());
    let files = types.iter().map(|t| (t, "gguf_py")).chain(refs.iter().map(|t| (t, "ref")));
    for (name, source) in files {
        let name = name.as_str().unwrap();
        let ty = GgmlType::from_name(name).unwrap_or_else(|| panic!("unknown type {name} in manifest"));
        let expected = read(&dir.join(format!("{source}_{name}.bin")));
        let got = quantize_to_vec(ty, &input);
        if let Some(at) = first_mismatch(&got, &expected) {
            let block = at / ty.type_size();
            panic!(
                "{name}: byte {at} (block {block}) differs from {source}: got {:?} want {:?}",
                &got[block * ty.type_size()..][..ty.type_size()],
                &expected[block * ty.type_size()..][..ty.type_size()]
            );
        }
    }
}

/// The bytes of tensor `name` in the model described by `ref_json` (offsets from the ref).
fn tensor_bytes(ref_json: &serde_json::Value, name: &str) -> (GgmlType, Vec<u8>) {
    let path = kiln_testdata::shared_path(ref_json["path"].as_str().expect("model not shipped"));
    let entry = ref_json["tensors"].as_array().unwrap().iter().find(|t| t["name"] == name).unwrap_or_else(|| panic!("{}: no tensor {name}", path.display()));
    let ty = GgmlType::from_name(entry["type"].as_str().unwrap()).unwrap();
    let offset = entry["data_offset"].as_u64().unwrap() as usize;
    let n_bytes = entry["n_bytes"].as_u64().unwrap() as usize;
    let file = read(&path);
    (ty, file[offset..offset + n_bytes].to_vec())
}

#[test]
fn quantizers_match_llama_quantize_byte_for_byte() {
    let models = kiln_testdata::path("models");
    let manifest = read_json(&fixtures_dir().join("manifest.json"));
    let rows = f32s_from_le(&read(&fixtures_dir().join("tiny_llama_rows.f32")));
    let types = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "Q1_0"];
    for name in types {
        let ref_json = read_json(&models.join(format!("tiny-llama-{name}.ref.json")));
        for pick in manifest["tiny_llama_rows"].as_array().unwrap() {
            let tensor = pick["name"].as_str().unwrap();
            let offset = pick["offset"].as_u64().unwrap() as usize;
            let n = (pick["rows"].as_u64().unwrap() * pick["row_len"].as_u64().unwrap()) as usize;
            let (ty, file_bytes) = tensor_bytes(&ref_json, tensor);
            assert_eq!(ty.name(), name, "{tensor} in tiny-llama-{name}");
            let got = quantize_to_vec(ty, &rows[offset..offset + n]);
            if let Some(at) = first_mismatch(&got, &file_bytes[..got.len()]) {
                panic!("{name} {tensor}: byte {at} (block {}) differs from llama-quantize", at / ty.type_size());
            }
        }
    }
    // F16/BF16: stories260K's F32 weights against llama-quantize's conversions.
    let f32_ref = read_json(&models.join("stories260K.ref.json"));
    for name in ["F16", "BF16"] {
        let conv_ref = read_json(&models.join(format!("stories260K-{name}.ref.json")));
        let (_, src) = tensor_bytes(&f32_ref, "blk.0.ffn_down.weight");
        let (ty, expected) = tensor_bytes(&conv_ref, "blk.0.ffn_down.weight");
        assert_eq!(ty.name(), name);
        let got = quantize_to_vec(ty, &f32s_from_le(&src));
        assert_eq!(first_mismatch(&got, &expected), None, "{name} conversion differs from llama-quantize");
    }
}

/// Random blocks of every newly decoded type against gguf-py's dequantization (or, where
/// gguf-py lacks the type or decodes it wrongly, the fixture script's own decoder), bit
/// for bit; and vec_dot against the reference values.
#[test]
fn dequantize_matches_reference_values_bit_for_bit() {
    let dir = fixtures_dir();
    let manifest = read_json(&dir.join("manifest.json"));
    let entries = manifest["dequant"].as_array().unwrap();
    assert!(entries.len() >= 10, "fixture manifest lists only {} dequant types", entries.len());
    for entry in entries {
        let name = entry["type"].as_str().unwrap();
        let source = entry["source"].as_str().unwrap();
        let ty = GgmlType::from_name(name).unwrap_or_else(|| panic!("unknown type {name} in manifest"));
        let n = entry["values"].as_u64().unwrap() as usize;
        let file = read(&dir.join(format!("dequant_{name}.bin")));
        let n_bytes = quantized_size(ty, n).unwrap();
        assert_eq!(file.len(), n_bytes + 4 * n, "{name}: fixture size");
        let (blocks, values) = file.split_at(n_bytes);
        let expected = f32s_from_le(values);
        let mut got = vec![0f32; n];
        dequantize(ty, blocks, &mut got).unwrap_or_else(|e| panic!("{name}: {e}"));
        for (i, (&g, &e)) in got.iter().zip(&expected).enumerate() {
            let same = g.to_bits() == e.to_bits() || (g.is_nan() && e.is_nan());
            assert!(same, "{name} value {i} (block {}): kiln {g:e} vs {source} {e:e}", i / ty.block_size());
        }
        let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 201) as f32 / 100.0 - 1.0).collect();
        let finite: Vec<(f32, f32)> = expected.iter().zip(&x).map(|(&e, &xi)| (e, xi)).collect();
        if finite.iter().all(|(e, _)| e.is_finite()) {
            let reference: f64 = finite.iter().map(|&(e, xi)| f64::from(e) * f64::from(xi)).sum();
            let magnitude: f64 = finite.iter().map(|&(e, xi)| (f64::from(e) * f64::from(xi)).abs()).sum();
            let dot = f64::from(vec_dot(ty, blocks, &x).unwrap());
            assert!((dot - reference).abs() <= 2e-5 * magnitude + 1e-30, "{name}: vec_dot {dot} vs reference {reference}");
        }
    }
}

/// The input generator of tests/fixtures/codebook_ref.c, draw for draw and in the same f32
/// operations (all exactly rounded), so the rows are bit-identical to the harness's.
mod codebook_inputs {
    use super::Rng;

    /// `(n_per_row, n_rows, seed)`; block b of a set has kind b % 8.
    pub type InputSet = (usize, usize, u64);
    pub const SMALL: [InputSet; 3] = [(256, 8, 1), (512, 4, 2), (768, 3, 3)];
    pub const LARGE: [InputSet; 4] = [(256, 512, 11), (1024, 256, 12), (2048, 64, 13), (4096, 64, 14)];

    fn unit(s: &mut Rng) -> f32 {
        (s.next_u64() >> 40) as f32 * pow2(-24)
    }

    fn bell(s: &mut Rng) -> f32 {
        let mut a = unit(s);
        a += unit(s);
        a += unit(s);
        a += unit(s);
        a - 2.0
    }

    fn pow2(e: i32) -> f32 {
        f32::from_bits(if e >= -126 { ((e + 127) as u32) << 23 } else { 1 << (e + 149) })
    }

    fn below(s: &mut Rng, n: u64) -> u64 {
        s.next_u64() % n
    }

    fn special_group(y: &mut [f32], which: u64, s: &mut Rng) {
        match which {
            0 => y.fill(0.0),
            1 => y.fill(0.37),
            2 => {
                y.iter_mut().for_each(|v| *v = bell(s) * 0.01);
                let at = below(s, 32) as usize;
                y[at] = if s.next_u64() & 1 != 0 { 1000.0 } else { -1000.0 };
            }
            3 => y.iter_mut().for_each(|v| {
                let b = bell(s);
                *v = if b > 0.0 { -b } else { b };
            }),
            4 => y.iter_mut().for_each(|v| *v = bell(s) * pow2(-30)),
            5 => y.iter_mut().for_each(|v| *v = bell(s) * pow2(-140)),
            6 => y.iter_mut().for_each(|v| *v = bell(s) * pow2(30)),
            _ => y.iter_mut().for_each(|v| *v = (below(s, 9) as i32 - 4) as f32),
        }
    }

    /// One 256-value block: plain, power-of-two group scales, heavy tails, special
    /// groups (zeros, constant, outlier, all negative, tiny, subnormal, huge, integers),
    /// zeros, tiny weights, LLM-like with outliers, sparse +-0.5 after a zero group.
    fn fill_block(x: &mut [f32], kind: usize, s: &mut Rng) {
        match kind {
            0 => x.iter_mut().for_each(|v| *v = bell(s)),
            1 => {
                for g in x.chunks_exact_mut(32) {
                    let scale = pow2(below(s, 21) as i32 - 10);
                    g.iter_mut().for_each(|v| *v = bell(s) * scale);
                }
            }
            2 => x.iter_mut().for_each(|v| {
                let b = bell(s);
                *v = b / (unit(s) + 0.015625);
            }),
            3 => {
                let rot = below(s, 8);
                for (g, y) in x.chunks_exact_mut(32).enumerate() {
                    special_group(y, (g as u64 + rot) % 8, s);
                }
            }
            4 => x.fill(0.0),
            5 => x.iter_mut().for_each(|v| *v = bell(s) * pow2(-20)),
            6 => x.iter_mut().for_each(|v| {
                *v = bell(s) * 0.02;
                if below(s, 64) == 0 {
                    *v *= 40.0;
                }
            }),
            _ => {
                for (i, v) in x.iter_mut().enumerate() {
                    let r = s.next_u64();
                    *v = if i < 32 || r.is_multiple_of(3) {
                        0.0
                    } else if r & 8 != 0 {
                        0.5
                    } else {
                        -0.5
                    };
                }
            }
        }
    }

    pub fn rows(&(n_per_row, n_rows, seed): &InputSet) -> Vec<f32> {
        let mut x = vec![0f32; n_per_row * n_rows];
        let mut s = Rng::new(seed);
        for (b, block) in x.chunks_exact_mut(256).enumerate() {
            fill_block(block, b % 8, &mut s);
        }
        x
    }
}

fn fnv1a64(bytes: &[u8], mut h: u64) -> u64 {
    for &b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// IQ3_XXS / IQ3_S / IQ2_S / IQ1_M against ggml_quantize_chunk without an importance matrix,
/// IQ2_XXS / IQ2_XS / IQ1_S with an importance matrix of ones (the tests/fixtures/codebook_ref.c harness): a small set
/// byte for byte, a larger one (3072 blocks of four row widths) by digest.
#[test]
fn codebook_quantizers_match_ggml_byte_for_byte() {
    let dir = fixtures_dir();
    let digests = read_json(&dir.join("codebook_ref.json"));
    for ty in [GgmlType::IQ3_XXS, GgmlType::IQ3_S, GgmlType::IQ2_XXS, GgmlType::IQ2_XS, GgmlType::IQ2_S, GgmlType::IQ1_S, GgmlType::IQ1_M] {
        let name = ty.name();
        let expected = read(&dir.join(format!("codebook_ref_{name}.bin")));
        let got: Vec<u8> = codebook_inputs::SMALL.iter().flat_map(|set| quantize_to_vec(ty, &codebook_inputs::rows(set))).collect();
        if let Some(at) = first_mismatch(&got, &expected) {
            let (block, size) = (at / ty.type_size(), ty.type_size());
            panic!(
                "{name}: byte {at} (block {block}, kind {}) differs from ggml:\n got {:?}\nwant {:?}",
                block % 8,
                &got[block * size..][..size],
                &expected[block * size..][..size]
            );
        }
        let digest = codebook_inputs::LARGE.iter().fold(0xcbf2_9ce4_8422_2325, |h, set| fnv1a64(&quantize_to_vec(ty, &codebook_inputs::rows(set)), h));
        let want = digests["fnv1a64_of_large_set"][name].as_str().unwrap();
        assert_eq!(format!("{digest:016x}"), want, "{name}: the large set differs from ggml");
    }
}
