//! Helpers shared by the kiln-quant integration tests.
#![allow(dead_code)]

use kiln_quant::{quantized_size, GgmlType};
use std::path::{Path, PathBuf};

/// Every type kiln-quant encodes and decodes.
pub const SUPPORTED: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q8_1,
    GgmlType::Q1_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::IQ3_XXS,
    GgmlType::IQ3_S,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ1_S,
    GgmlType::IQ1_M,
    GgmlType::TQ1_0,
    GgmlType::TQ2_0,
    GgmlType::Q2_0,
    GgmlType::MXFP4,
    GgmlType::NVFP4,
];

/// Every type kiln-quant decodes (each one also encodes).
pub fn decodable() -> impl Iterator<Item = GgmlType> {
    SUPPORTED.iter().copied()
}

pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

pub fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

pub fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&read(path)).unwrap_or_else(|e| panic!("bad JSON in {}: {e}", path.display()))
}

pub fn f32s_from_le(bytes: &[u8]) -> Vec<f32> {
    assert_eq!(bytes.len() % 4, 0, "f32 data length {} is not a multiple of 4", bytes.len());
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Deterministic SplitMix64 generator (tests must not depend on a crate's RNG stream).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    pub fn gaussian(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    pub fn gaussian_vec(&mut self, n: usize, scale: f64) -> Vec<f32> {
        (0..n).map(|_| (self.gaussian() * scale) as f32).collect()
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

/// Byte offsets of the f16 scale fields in one block (the f32 scale of Q8_K is handled apart).
pub fn f16_scale_offsets(ty: GgmlType) -> &'static [usize] {
    use GgmlType::*;
    match ty {
        Q4_0 | Q5_0 | Q8_0 | Q1_0 | Q2_0 | IQ4_NL | IQ4_XS => &[0],
        IQ2_XXS | IQ2_XS | IQ2_S | IQ3_XXS | IQ3_S | IQ1_S => &[0],
        Q4_1 | Q5_1 | Q8_1 | Q4_K | Q5_K => &[0, 2],
        Q2_K => &[80, 82],
        Q3_K => &[108],
        Q6_K => &[208],
        TQ1_0 => &[52],
        TQ2_0 => &[64],
        _ => &[],
    }
}

/// A row of random bytes made valid: every scale is a finite f16 (or f32) of moderate size.
pub fn random_valid_row(ty: GgmlType, n: usize, rng: &mut Rng) -> Vec<u8> {
    let finite = |rng: &mut Rng| (rng.gaussian() * 0.5) as f32;
    match ty {
        GgmlType::F32 => (0..n).flat_map(|_| finite(rng).to_le_bytes()).collect(),
        GgmlType::F16 => (0..n).flat_map(|_| half::f16::from_f32(finite(rng)).to_le_bytes()).collect(),
        GgmlType::BF16 => (0..n).flat_map(|_| half::bf16::from_f32(finite(rng)).to_le_bytes()).collect(),
        _ => {
            let mut row = rng.bytes(quantized_size(ty, n).unwrap());
            for block in row.chunks_exact_mut(ty.type_size()) {
                match ty {
                    GgmlType::Q8_K => block[..4].copy_from_slice(&(finite(rng) * 0.01).to_le_bytes()),
                    // A power of two near 1, well inside f32 even times the largest code.
                    GgmlType::MXFP4 => block[0] = 118 + (rng.next_u64() % 20) as u8,
                    // The f16 scale lives in the top nibbles of the four scale words.
                    GgmlType::IQ1_M => {
                        let d = half::f16::from_f32(finite(rng)).to_bits();
                        for k in 0..4 {
                            let at = 48 + 2 * k;
                            let word = u16::from_le_bytes([block[at], block[at + 1]]) & 0x0fff | ((d >> (4 * k)) & 0xf) << 12;
                            block[at..at + 2].copy_from_slice(&word.to_le_bytes());
                        }
                    }
                    _ => {}
                }
                for &off in f16_scale_offsets(ty) {
                    block[off..off + 2].copy_from_slice(&half::f16::from_f32(finite(rng)).to_le_bytes());
                }
            }
            row
        }
    }
}
