//! The shared row machinery: every quantized block decodes to small integer
//! codes with one scale (and optionally one offset) per group of values, so
//! dequantization and dot products are written once for all formats.

use bytemuck::Pod;

/// Largest block (elements) and largest number of scale groups in one block.
pub(crate) const MAX_BLOCK: usize = 256;
pub(crate) const MAX_GROUPS: usize = 16;

/// A decoded block: value `i` is `scale[g] * codes[i]`, plus `offset[g]` when the
/// format has one, with `g = i / GROUP`. This is exactly ggml's f32 operation
/// order for every format here (`d*q`, `d*q + m`, `(d*sc)*q - dmin*m`).
pub(crate) struct Unpacked {
    pub codes: [i8; MAX_BLOCK],
    pub scale: [f32; MAX_GROUPS],
    pub offset: [f32; MAX_GROUPS],
}

impl Unpacked {
    pub(crate) fn new() -> Self {
        Unpacked { codes: [0; MAX_BLOCK], scale: [0.0; MAX_GROUPS], offset: [0.0; MAX_GROUPS] }
    }
}

/// One GGML block format that kiln decodes: its `#[repr(C)]` struct is the exact byte layout.
pub(crate) trait DecodeBlock: Pod {
    /// Elements per block.
    const N: usize;
    /// Elements sharing one scale.
    const GROUP: usize;
    /// Whether values carry a per-group offset (`d*q + m` formats).
    const HAS_OFFSET: bool;

    /// Writes codes `[..N]` and the per-group scales (and offsets).
    fn unpack(&self, out: &mut Unpacked);
}

/// A block format that kiln also encodes, as llama-quantize does without an importance matrix.
pub(crate) trait QuantBlock: Pod {
    const N: usize;
    const GROUP: usize;
    const HAS_OFFSET: bool;

    fn unpack(&self, out: &mut Unpacked);

    /// Encodes exactly `N` values.
    fn quantize(x: &[f32]) -> Self;
}

impl<B: QuantBlock> DecodeBlock for B {
    const N: usize = <B as QuantBlock>::N;
    const GROUP: usize = <B as QuantBlock>::GROUP;
    const HAS_OFFSET: bool = <B as QuantBlock>::HAS_OFFSET;

    fn unpack(&self, out: &mut Unpacked) {
        QuantBlock::unpack(self, out)
    }
}

/// Row-level decoding; `lib.rs` checks all lengths before calling these.
pub(crate) trait RowCodec {
    fn dequantize_row(src: &[u8], dst: &mut [f32]);
    fn dot_row(row: &[u8], x: &[f32]) -> f32;
    /// The integer codes of one block (exactly its bytes), or `false` for float types.
    fn block_codes(block: &[u8], out: &mut [i8]) -> bool;
}

/// Row-level encoding, for the formats with a quantizer.
pub(crate) trait RowEncoder {
    fn quantize_row(src: &[f32], dst: &mut [u8]);
}

impl<B: QuantBlock> RowEncoder for B {
    fn quantize_row(src: &[f32], dst: &mut [u8]) {
        for (x, out) in src.chunks_exact(<B as QuantBlock>::N).zip(dst.chunks_exact_mut(size_of::<B>())) {
            out.copy_from_slice(bytemuck::bytes_of(&B::quantize(x)));
        }
    }
}

impl<B: DecodeBlock> RowCodec for B {
    fn block_codes(block: &[u8], out: &mut [i8]) -> bool {
        let mut u = Unpacked::new();
        bytemuck::pod_read_unaligned::<B>(block).unpack(&mut u);
        out.copy_from_slice(&u.codes[..B::N]);
        true
    }

    fn dequantize_row(src: &[u8], dst: &mut [f32]) {
        let mut u = Unpacked::new();
        for (bytes, out) in src.chunks_exact(size_of::<B>()).zip(dst.chunks_exact_mut(B::N)) {
            bytemuck::pod_read_unaligned::<B>(bytes).unpack(&mut u);
            let groups = out.chunks_exact_mut(B::GROUP).zip(u.codes.chunks_exact(B::GROUP));
            for (g, (out_g, codes_g)) in groups.enumerate() {
                let scale = u.scale[g];
                if B::HAS_OFFSET {
                    let offset = u.offset[g];
                    for (o, &q) in out_g.iter_mut().zip(codes_g) {
                        *o = scale * q as f32 + offset;
                    }
                } else {
                    for (o, &q) in out_g.iter_mut().zip(codes_g) {
                        *o = scale * q as f32;
                    }
                }
            }
        }
    }

    /// Factors each group's scale out of its sum: `scale*sum(q*x) + offset*sum(x)`.
    fn dot_row(row: &[u8], x: &[f32]) -> f32 {
        let mut u = Unpacked::new();
        let mut total = 0f64;
        for (bytes, xb) in row.chunks_exact(size_of::<B>()).zip(x.chunks_exact(B::N)) {
            bytemuck::pod_read_unaligned::<B>(bytes).unpack(&mut u);
            let groups = xb.chunks_exact(B::GROUP).zip(u.codes.chunks_exact(B::GROUP));
            for (g, (x_g, codes_g)) in groups.enumerate() {
                let (mut sum_qx, mut sum_x) = (0f32, 0f32);
                for (&xi, &q) in x_g.iter().zip(codes_g) {
                    sum_qx += q as f32 * xi;
                    sum_x += xi;
                }
                total += f64::from(u.scale[g] * sum_qx);
                if B::HAS_OFFSET {
                    total += f64::from(u.offset[g] * sum_x);
                }
            }
        }
        total as f32
    }
}

/// ggml's `nearest_int`: round half to even through the float mantissa, bit for bit
/// (also for out-of-range inputs, which ggml clamps afterwards just like we do).
pub(crate) fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12_582_912.0).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// The first element of largest magnitude: `(|x|max, signed value)`, as ggml scans it.
pub(crate) fn abs_max(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    (amax, max)
}

/// Exact FP16->FP32, written so that loops over f16 data vectorize: the exponent and
/// mantissa bits shifted into an f32 and scaled by 2^112 give normals and subnormals
/// exactly; infinities and NaNs keep their payload.
pub(crate) fn f32_of(h: half::f16) -> f32 {
    const TWO_POW_112: f32 = f32::from_bits((127 + 112) << 23);
    let bits = u32::from(h.to_bits());
    let magnitude = bits & 0x7fff;
    let value = if magnitude >= 0x7c00 { f32::from_bits(0x7f80_0000 | (magnitude & 0x3ff) << 13) } else { f32::from_bits(magnitude << 13) * TWO_POW_112 };
    f32::from_bits(value.to_bits() | (bits & 0x8000) << 16)
}

/// ggml's FP32->FP16 conversion (round to nearest even).
pub(crate) fn f16_of(v: f32) -> half::f16 {
    half::f16::from_f32(v)
}

/// Packs 32 4-bit codes the ggml way: byte `j` holds code `j` (low) and code `j + 16` (high).
pub(crate) fn pack_nibbles(codes: &[u8]) -> [u8; 16] {
    std::array::from_fn(|j| (codes[j] & 0x0f) | (codes[j + 16] << 4))
}

/// Inverse of [`pack_nibbles`] for 16 bytes, mapping each 4-bit code through `f`.
pub(crate) fn unpack_nibbles(qs: &[u8], out: &mut [i8], f: impl Fn(u8) -> i8) {
    let (lo, hi) = out[..32].split_at_mut(16);
    for ((&b, l), h) in qs.iter().zip(lo).zip(hi) {
        *l = f(b & 0x0f);
        *h = f(b >> 4);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_to_f32_is_exact_for_every_bit_pattern() {
        for bits in 0..=u16::MAX {
            let h = half::f16::from_bits(bits);
            let (ours, theirs) = (f32_of(h), h.to_f32());
            assert!(ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()), "{bits:#06x}: {ours} vs {theirs}");
        }
    }

    #[test]
    fn nearest_int_rounds_half_to_even() {
        for (v, want) in [(0.5, 0), (1.5, 2), (2.5, 2), (-0.5, 0), (-1.5, -2), (3.49, 3), (-7.51, -8), (4194303.0, 4194303)] {
            assert_eq!(nearest_int(v), want, "{v}");
        }
    }
}
