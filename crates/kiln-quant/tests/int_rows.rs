//! Rows decoded for integer dot products: the decoded form reproduces dequantization
//! bit for bit, and the SIMD decoders write exactly what the scalar reference writes.

mod common;

use common::*;
use kiln_quant::int_rows::{decode_int_row, decode_int_row_at, decode_int_row_scalar, int_layout, simd_levels, CODE_BIAS};
use kiln_quant::{dequantize, GgmlType};

/// Every type with an integer form, and the float types without one.
fn int_types() -> Vec<GgmlType> {
    decodable().filter(|&ty| int_layout(ty).is_some()).collect()
}

#[test]
fn every_block_format_has_an_integer_form() {
    let without: Vec<GgmlType> = decodable().filter(|&ty| int_layout(ty).is_none()).collect();
    assert_eq!(without, [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_1, GgmlType::Q8_K]);
}

struct Decoded {
    codes: Vec<u8>,
    scale: Vec<f32>,
    offset: Vec<f32>,
}

fn decode_with(ty: GgmlType, row: &[u8], n: usize, scalar: bool) -> Decoded {
    let groups = n / int_layout(ty).unwrap().group;
    let mut d = Decoded { codes: vec![0x55; n], scale: vec![f32::NAN; groups], offset: vec![f32::NAN; groups] };
    let decode = if scalar { decode_int_row_scalar } else { decode_int_row };
    decode(ty, row, &mut d.codes, &mut d.scale, &mut d.offset).unwrap_or_else(|e| panic!("{ty}: {e}"));
    d
}

/// value = scale * (code - 128) + offset is ggml's own f32 operation order, so the
/// reconstruction equals `dequantize` bit for bit (a wrong group, bias or offset would not).
#[test]
fn decoded_rows_reproduce_dequantize_exactly() {
    let mut rng = Rng::new(71);
    for ty in int_types() {
        for blocks in [1, 3, 8] {
            let n = blocks * ty.block_size();
            let row = random_valid_row(ty, n, &mut rng);
            let mut want = vec![0f32; n];
            dequantize(ty, &row, &mut want).unwrap();
            let layout = int_layout(ty).unwrap();
            let d = decode_with(ty, &row, n, true);
            for (i, (&w, &c)) in want.iter().zip(&d.codes).enumerate() {
                let g = i / layout.group;
                let q = (c as i32 - CODE_BIAS) as f32;
                let got = if layout.has_offset { d.scale[g] * q + d.offset[g] } else { d.scale[g] * q };
                assert_eq!(got.to_bits(), w.to_bits(), "{ty} value {i} of {n}: {got} vs {w}");
            }
        }
    }
}

#[test]
fn simd_decoders_match_the_scalar_decoder() {
    let mut rng = Rng::new(72);
    for ty in int_types() {
        for blocks in [1, 2, 5, 16] {
            let n = blocks * ty.block_size();
            let row = random_valid_row(ty, n, &mut rng);
            let (want, got) = (decode_with(ty, &row, n, true), decode_with(ty, &row, n, false));
            assert_eq!(got.codes, want.codes, "{ty}: codes of {n} values");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got.scale), bits(&want.scale), "{ty}: scales of {n} values");
            assert_eq!(bits(&got.offset), bits(&want.offset), "{ty}: offsets of {n} values");
        }
    }
}

/// Every SIMD level this CPU has, not only the one `decode_int_row` picks; 19 blocks mix
/// the 8-block batches of scales with a remainder. Also rows of random bytes, whose f16
/// scales take any value (NaN, infinity, subnormal).
#[test]
fn every_simd_level_matches_the_scalar_decoder() {
    let mut rng = Rng::new(73);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for &level in simd_levels() {
        let mut covered = Vec::new();
        for ty in int_types() {
            for blocks in [1, 2, 3, 7, 16, 19] {
                let n = blocks * ty.block_size();
                let valid = random_valid_row(ty, n, &mut rng);
                let raw = rng.bytes(valid.len());
                for row in [valid, raw] {
                    let want = decode_with(ty, &row, n, true);
                    let groups = want.scale.len();
                    let mut got = Decoded { codes: vec![0x55; n], scale: vec![f32::NAN; groups], offset: vec![f32::NAN; groups] };
                    if !decode_int_row_at(level, ty, &row, &mut got.codes, &mut got.scale, &mut got.offset).unwrap() {
                        continue;
                    }
                    if !covered.contains(&ty) {
                        covered.push(ty);
                    }
                    assert_eq!(got.codes, want.codes, "{level:?} {ty}: codes of {n} values");
                    assert_eq!(bits(&got.scale), bits(&want.scale), "{level:?} {ty}: scales of {n} values");
                    assert_eq!(bits(&got.offset), bits(&want.offset), "{level:?} {ty}: offsets of {n} values");
                }
            }
        }
        eprintln!("{level:?}: {} formats: {covered:?}", covered.len());
    }
}

#[test]
fn bad_lengths_are_typed_errors() {
    let mut codes = vec![0u8; 64];
    let (mut s, mut o) = (vec![0f32; 2], vec![0f32; 2]);
    assert!(decode_int_row(GgmlType::F16, &[0; 128], &mut codes, &mut s, &mut o).is_err());
    assert!(decode_int_row(GgmlType::Q4_0, &[0; 35], &mut codes, &mut s, &mut o).is_err());
    assert!(decode_int_row(GgmlType::Q4_0, &[0; 36], &mut codes, &mut s[..1], &mut o).is_err());
    decode_int_row(GgmlType::Q4_0, &[0; 36], &mut codes, &mut s, &mut o).unwrap();
}

/// Decode throughput per format on a 4096-value row, scalar against each SIMD level:
/// `cargo test -p kiln-quant --release --test int_rows -- --ignored --nocapture`.
#[test]
#[ignore]
fn decode_throughput() {
    use std::hint::black_box;
    use std::time::{Duration, Instant};
    let mut rng = Rng::new(74);
    let n = 4096;
    // The best of 20 runs of 2 ms: the machine is shared, the minimum is the steady state.
    let time = |f: &mut dyn FnMut()| {
        let mut best = f64::INFINITY;
        for _ in 0..20 {
            let (mut reps, start) = (0u32, Instant::now());
            while start.elapsed() < Duration::from_millis(2) {
                f();
                reps += 1;
            }
            best = best.min(start.elapsed().as_nanos() as f64 / (f64::from(reps) * n as f64));
        }
        best
    };
    let levels = simd_levels();
    eprintln!("ns/value   scalar {}", levels.iter().map(|l| format!("{:>8}", format!("{l:?}"))).collect::<String>());
    for ty in int_types() {
        let row = random_valid_row(ty, n, &mut rng);
        let groups = n / int_layout(ty).unwrap().group;
        let (mut codes, mut scale, mut offset) = (vec![0u8; n], vec![0f32; groups], vec![0f32; groups]);
        let scalar = time(&mut || decode_int_row_scalar(ty, black_box(&row), &mut codes, &mut scale, &mut offset).unwrap());
        let mut line = format!("{:<9} {scalar:>7.3}", ty.to_string());
        for &level in levels {
            let mut has = true;
            let t = time(&mut || has = decode_int_row_at(level, ty, black_box(&row), &mut codes, &mut scale, &mut offset).unwrap());
            line += &if has { format!(" {t:>7.3}") } else { format!(" {:>7}", "-") };
        }
        eprintln!("{line}");
        black_box((&codes, &scale, &offset));
    }
}
