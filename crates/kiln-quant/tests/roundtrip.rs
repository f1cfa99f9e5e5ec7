//! Quantize -> dequantize error bounds, vec_dot against dequantize-then-dot, and the
//! typed errors of the row API.

mod common;

use common::*;
use kiln_quant::{dequantize, quantize, quantized_size, type_from_id, vec_dot, GgmlType, QuantError};

fn roundtrip(ty: GgmlType, x: &[f32]) -> Vec<f32> {
    let mut q = vec![0u8; quantized_size(ty, x.len()).unwrap()];
    quantize(ty, x, &mut q).unwrap_or_else(|e| panic!("quantize {ty}: {e}"));
    let mut y = vec![f32::NAN; x.len()];
    dequantize(ty, &q, &mut y).unwrap_or_else(|e| panic!("dequantize {ty}: {e}"));
    y
}

fn rel_rms(x: &[f32], y: &[f32]) -> f64 {
    let err: f64 = x.iter().zip(y).map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2)).sum();
    let norm: f64 = x.iter().map(|&a| f64::from(a).powi(2)).sum();
    (err / norm).sqrt()
}

/// Upper bound on the relative RMS error ||x - deq(q(x))|| / ||x|| for i.i.d. Gaussian
/// data, from the theory of each format, with ~25% headroom for sampling noise over a
/// few hundred values. A uniform quantizer of step D has RMS error D/sqrt(12):
///  - symmetric absmax formats: D = amax/2^(b-1), amax ~ 2.4 sigma over 32 values
///    (3-4 sigma over 256): Q4_0 0.087, Q5_0 0.043, Q8_0 0.0054, Q8_K 0.007-0.009;
///  - min/max formats: D = (max-min)/(2^b-1) with range ~4.6 sigma: Q4_1 0.08, Q5_1 0.04;
///  - K-quants / IQ4 fit scales by least squares, landing near the same per-bit curve
///    (error halves per extra bit): Q2_K 0.30, Q3_K 0.15, Q4_K/IQ4 0.075, Q5_K 0.037,
///    Q6_K 0.019;
///  - Q1_0 keeps sign(x)*mean|x|: error variance 1 - 2/pi, i.e. 0.603 exactly;
///  - MXFP4/NVFP4: E2M1's 8 magnitudes are spaced like a 3-bit float (steps 1/8..1/4
///    of the value), with a power-of-two (MXFP4: 0.113) or E4M3 (NVFP4: 0.098) scale;
///  - Q2_0 is ternary over 64 values (amax ~2.5 sigma): 0.72;
///  - IQ3_S/IQ3_XXS have Q3_K's 8 levels, but only 512/256 of the 8^4 level patterns
///    of 4 values: the nearest allowed pattern costs extra error (measured 0.166 and
///    0.213 over 64K values), and IQ3_XXS flips the cheapest sign of an octet with an
///    odd number of negatives;
///  - ternary TQ*: t*amax with amax ~ 3-4 sigma zeroes |x| < amax/2: 0.8-0.9, so the
///    RMS bound only rules out an all-zero output; `ternary_error_within_half_step` pins
///    these formats down value by value instead.
///  - F16/BF16 round to 11/8 significant bits: relative error at most 2^-11 / 2^-8 per value
///    (worst case, so no headroom; RMS ~ that / sqrt(3)).
///
/// A broken quantizer (wrong layout, zero output, off-by-one level) lands at >= 1.0 or at
/// least 2x these, so the bounds catch it.
fn rel_rms_bound(ty: GgmlType) -> f64 {
    use GgmlType::*;
    match ty {
        F32 => 0.0,
        F16 => 4.9e-4,
        BF16 => 3.9e-3,
        Q8_0 | Q8_1 => 0.0068,
        Q8_K => 0.012,
        Q6_K => 0.024,
        Q5_K => 0.046,
        Q5_0 => 0.055,
        Q5_1 => 0.05,
        Q4_0 => 0.11,
        Q4_1 => 0.10,
        Q4_K | IQ4_NL | IQ4_XS => 0.095,
        Q3_K => 0.19,
        IQ3_S => 0.22,
        IQ3_XXS => 0.28,
        Q2_K => 0.37,
        IQ2_XXS => 0.45,
        IQ2_XS => 0.4,
        IQ2_S => 0.37,
        IQ1_S => 0.62,
        // Without an importance matrix ggml weighs by x^2, so the small values fare worse.
        IQ1_M => 0.72,
        Q1_0 => 0.66,
        TQ1_0 | TQ2_0 => 0.97,
        Q2_0 => 0.85,
        MXFP4 => 0.14,
        NVFP4 => 0.13,
        _ => panic!("no bound for {ty}"),
    }
}

/// Row lengths per block size: whole rows of 256*k, and ragged counts of 32-blocks.
fn shapes(ty: GgmlType) -> Vec<usize> {
    match ty.block_size() {
        1 => vec![37, 256, 4096],
        32 => vec![224, 1184, 4096, 14336],
        64 => vec![192, 1344, 4096],
        128 => vec![384, 4096],
        _ => vec![256, 768, 4096],
    }
}

#[test]
fn roundtrip_error_within_format_bounds() {
    let mut rng = Rng::new(0x5eed_0001);
    for &ty in SUPPORTED {
        for n in shapes(ty) {
            // The relative error must not depend on the data's magnitude. Not much below 0.02
            // (typical LLM weights), though: there the K-quants' f16 super-block scale
            // (~1e-3 of the data) turns subnormal and loses precision, in ggml too.
            for scale in [1.0, 0.02, 300.0] {
                let x = rng.gaussian_vec(n, scale);
                let err = rel_rms(&x, &roundtrip(ty, &x));
                let bound = rel_rms_bound(ty);
                assert!(err <= bound, "{ty} n={n} scale={scale}: rel RMS error {err:.5} > {bound}");
            }
        }
    }
}

/// ggml's own test-quantize-fns check: data 0.1 + 2 cos(i), n = 4096, error
/// sqrt(sum d^2) / n, against its per-type thresholds.
#[test]
fn roundtrip_error_within_ggml_thresholds() {
    let n = 32 * 128;
    let x: Vec<f32> = (0..n).map(|i| 0.1 + 2.0 * (i as f32).cos()).collect();
    for &ty in SUPPORTED {
        use GgmlType::*;
        let threshold = match ty {
            // The 1-bit bound; kiln (= ggml) gives 0.00976 (IQ1_S) and 0.0122 (IQ1_M).
            Q1_0 | IQ1_S | IQ1_M => 0.025,
            TQ1_0 | TQ2_0 | Q2_0 => 0.01,
            MXFP4 | NVFP4 => 0.003,
            Q2_K => 0.0075,
            Q3_K | IQ3_S => 0.004,
            IQ3_XXS => 0.005,
            // ggml's 2-bit bound; the input is fixed, and kiln (= ggml) gives 0.00741 / 0.00651 / 0.00531.
            IQ2_XXS | IQ2_XS | IQ2_S => 0.0075,
            _ => 0.002,
        };
        let y = roundtrip(ty, &x);
        let err = x.iter().zip(&y).map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2)).sum::<f64>().sqrt() / n as f64;
        assert!(err < threshold, "{ty}: ggml total error {err:.6} >= {threshold}");
    }
}

/// Ternary values are t*d with d = f16(max|x| of the 256-block) and t = round(x/max|x|),
/// so every value is within half a step (plus d's f16 rounding) of its input.
#[test]
fn ternary_error_within_half_step() {
    let mut rng = Rng::new(0x5eed_0002);
    for ty in [GgmlType::TQ1_0, GgmlType::TQ2_0] {
        let x = rng.gaussian_vec(4096, 1.0);
        let y = roundtrip(ty, &x);
        for (b, (xb, yb)) in x.chunks(256).zip(y.chunks(256)).enumerate() {
            let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            for (i, (&xi, &yi)) in xb.iter().zip(yb).enumerate() {
                assert!((xi - yi).abs() <= 0.5 * amax * (1.0 + 1e-3), "{ty} block {b} value {i}: {xi} -> {yi}, amax {amax}");
            }
        }
    }
}

#[test]
fn quantizers_handle_degenerate_blocks() {
    for &ty in SUPPORTED {
        let n = ty.block_size().max(256);
        // All zeros must come back as zeros; a constant block must stay close to the constant.
        assert!(roundtrip(ty, &vec![0.0; n]).iter().all(|&v| v == 0.0), "{ty}: zeros not preserved");
        let c = roundtrip(ty, &vec![0.37; n]);
        // E2M1 has no 0.37 / 2^k closer than 12/32 = 0.375. The IQ3 searches only try
        // scales near max/15, i.e. levels 6-7 for every value, whose all-equal patterns are
        // off both grids: ggml stores a neighbour mixing 2l+1 = 9 and 13 (up to +28%).
        // IQ2_XXS's trials all round to level 2, whose all-equal point is off its grid too;
        // the neighbour mixes 3 and 5 (up to 70% here, as in ggml). IQ2_XS / IQ2_S: 7.5% / 6.2%,
        // IQ1_S / IQ1_M (one level plus a delta of 1/8): 12.5% / 11.3%.
        let tol = match ty {
            GgmlType::Q2_K => 0.05,
            GgmlType::MXFP4 | GgmlType::NVFP4 => 0.014,
            GgmlType::IQ3_XXS | GgmlType::IQ3_S => 0.3,
            GgmlType::IQ2_XXS => 0.75,
            GgmlType::IQ2_XS | GgmlType::IQ2_S => 0.1,
            GgmlType::IQ1_S | GgmlType::IQ1_M => 0.15,
            _ => 0.01,
        };
        assert!(c.iter().all(|&v| (v - 0.37).abs() <= tol * 0.37 + 1e-6), "{ty}: constant block lost: {:?}", &c[..4]);
        // Non-finite input must not panic (the values are garbage, like ggml's).
        let mut x = Rng::new(3).gaussian_vec(n, 1.0);
        x[1] = f32::NAN;
        x[5] = f32::INFINITY;
        x[9] = 1e-42;
        let _ = roundtrip(ty, &x);
    }
}

/// vec_dot sums each scale group (<= 256 products) in f32 and the groups in f64: its
/// rounding error is at most ~256 * 2^-24 = 1.5e-5 of sum |a_i x_i|. A group/offset
/// mix-up changes the result by O(sum|a x| / sqrt(n)) >= 3e-2 of it.
#[test]
fn vec_dot_matches_dequantize_then_dot() {
    let mut rng = Rng::new(0x5eed_0003);
    for ty in decodable() {
        for n in shapes(ty) {
            let x = rng.gaussian_vec(n, 1.0);
            let mut rows = vec![("random", random_valid_row(ty, n, &mut rng))];
            if kiln_quant::can_quantize(ty) {
                let mut q = vec![0u8; quantized_size(ty, n).unwrap()];
                quantize(ty, &rng.gaussian_vec(n, 2.0), &mut q).unwrap();
                rows.push(("quantized", q));
            }
            for (source, row) in rows {
                let mut a = vec![0f32; n];
                dequantize(ty, &row, &mut a).unwrap();
                assert!(a.iter().all(|v| v.is_finite()), "{ty} {source}: non-finite dequantized value");
                let reference: f64 = a.iter().zip(&x).map(|(&ai, &xi)| f64::from(ai) * f64::from(xi)).sum();
                let magnitude: f64 = a.iter().zip(&x).map(|(&ai, &xi)| (f64::from(ai) * f64::from(xi)).abs()).sum();
                let got = f64::from(vec_dot(ty, &row, &x).unwrap());
                assert!(
                    (got - reference).abs() <= 2e-5 * magnitude + 1e-30,
                    "{ty} n={n} {source}: vec_dot {got} vs dequantize-then-dot {reference} (sum|ax| {magnitude})"
                );
            }
        }
    }
}

#[test]
fn dequantize_never_panics_on_random_bytes() {
    let mut rng = Rng::new(0x5eed_0004);
    for ty in decodable() {
        let n = 2 * ty.block_size().max(256);
        let row = rng.bytes(quantized_size(ty, n).unwrap());
        let mut out = vec![0f32; n];
        dequantize(ty, &row, &mut out).unwrap();
        let x = vec![1.0f32; n];
        vec_dot(ty, &row, &x).unwrap();
    }
}

#[test]
fn unsupported_and_unknown_types_are_errors() {
    for ty in [GgmlType::I8, GgmlType::I16, GgmlType::I32, GgmlType::I64, GgmlType::F64] {
        assert!(!kiln_quant::can_dequantize(ty) && !kiln_quant::can_quantize(ty), "{ty}");
        let n = ty.block_size() * 2;
        let bytes = vec![0u8; quantized_size(ty, n).unwrap()];
        let mut out = vec![0f32; n];
        let err = dequantize(ty, &bytes, &mut out).unwrap_err();
        assert!(matches!(err, QuantError::Unsupported { ty: t, op: "dequantize" } if t == ty), "{err}");
        assert!(err.to_string().contains(ty.name()), "message must name the type: {err}");
        let mut q = bytes.clone();
        assert!(matches!(quantize(ty, &out, &mut q), Err(QuantError::Unsupported { op: "quantize", .. })));
        assert!(matches!(vec_dot(ty, &bytes, &out), Err(QuantError::Unsupported { op: "vec_dot", .. })));
    }
    for &ty in SUPPORTED {
        assert!(kiln_quant::can_dequantize(ty) && kiln_quant::can_quantize(ty), "{ty}");
    }
    // Every type the GGUF reader knows is either handled or refused, never both.
    for &ty in kiln_quant::ALL_TYPES {
        let listed = decodable().any(|t| t == ty);
        assert_eq!(kiln_quant::can_dequantize(ty), listed, "{ty}");
    }
    // block_codes: one whole block of a block format only.
    let mut codes = [0i8; 256];
    assert!(matches!(kiln_quant::block_codes(GgmlType::F16, &[0; 2], &mut codes[..1]), Err(QuantError::Unsupported { .. })));
    assert!(matches!(kiln_quant::block_codes(GgmlType::IQ2_XXS, &[0; 65], &mut codes), Err(QuantError::BadLength { .. })));
    assert!(matches!(kiln_quant::block_codes(GgmlType::Q4_0, &[0; 36], &mut codes[..64]), Err(QuantError::Unsupported { .. })));
    kiln_quant::block_codes(GgmlType::IQ2_XXS, &[0; 66], &mut codes).unwrap();
    assert!(codes.iter().all(|&c| c == 8), "grid entry 0 is all 8s, no signs: {codes:?}");
    assert!(matches!(type_from_id(99), Err(QuantError::UnknownTypeId(99))));
    assert!(matches!(type_from_id(43), Err(QuantError::UnknownTypeId(43))));
    assert_eq!(type_from_id(42).unwrap(), GgmlType::Q2_0);
    assert_eq!(type_from_id(40).unwrap(), GgmlType::NVFP4);
    assert_eq!(type_from_id(12).unwrap(), GgmlType::Q4_K);
}

#[test]
fn wrong_lengths_are_errors() {
    let ty = GgmlType::Q4_K;
    let good = vec![0u8; 144];
    let mut out = vec![0f32; 256];
    assert!(matches!(dequantize(ty, &good[..143], &mut out), Err(QuantError::BadLength { n_elements: 256, n_bytes: 143, expected: 144, .. })));
    assert!(matches!(dequantize(ty, &good, &mut out[..255]), Err(QuantError::NotBlockMultiple { n: 255, block_size: 256, .. })));
    let mut long = vec![0u8; 145];
    assert!(matches!(quantize(ty, &out, &mut long), Err(QuantError::BadLength { n_bytes: 145, .. })));
    assert!(matches!(quantize(GgmlType::Q4_0, &out[..48], &mut long), Err(QuantError::NotBlockMultiple { n: 48, .. })));
    assert!(matches!(vec_dot(ty, &good, &out[..128]), Err(QuantError::NotBlockMultiple { .. })));
    assert!(matches!(vec_dot(ty, &good, &[0.0; 512]), Err(QuantError::BadLength { expected: 288, .. })));
    assert!(matches!(quantized_size(GgmlType::Q8_0, usize::MAX - 31), Err(QuantError::TooLarge { .. })));
    assert_eq!(quantized_size(GgmlType::Q6_K, 512).unwrap(), 420);
    assert_eq!(quantized_size(GgmlType::F16, 3).unwrap(), 6);
    let msg = dequantize(GgmlType::Q8_0, &[0u8; 33], &mut [0f32; 32]).unwrap_err().to_string();
    assert!(msg.contains("Q8_0") && msg.contains("33") && msg.contains("34"), "{msg}");
}

#[test]
fn codebook_scales_are_written_where_dequantize_reads_them() {
    for ty in [GgmlType::IQ2_XXS, GgmlType::IQ1_M] {
        let mut bytes = vec![0x5au8; 2 * ty.type_size()];
        let mut scales = [0x3c00u16, 0x4000].into_iter();
        kiln_quant::set_codebook_scales(ty, &mut bytes, || scales.next().unwrap()).unwrap();
        let mut values = vec![0f32; 2 * ty.block_size()];
        kiln_quant::dequantize(ty, &bytes, &mut values).unwrap();
        // The same codes under scales 1.0 and 2.0: the second block is twice the first.
        let (first, second) = values.split_at(ty.block_size());
        assert!(first.iter().zip(second).all(|(a, b)| 2.0 * a == *b), "{ty}");
    }
    let mut bytes = vec![0u8; 70];
    let err = kiln_quant::set_codebook_scales(GgmlType::Q4_0, &mut bytes, || 0).unwrap_err();
    assert!(err.to_string().contains("set_codebook_scales"), "{err}");
    let err = kiln_quant::set_codebook_scales(GgmlType::IQ2_XXS, &mut bytes, || 0).unwrap_err();
    assert!(matches!(err, kiln_quant::QuantError::BadLength { .. }), "{err}");
}
