//! The plain float element types F32, F16 and BF16.

use crate::block::{RowCodec, RowEncoder};
use bytemuck::Pod;
use std::marker::PhantomData;

/// A float element stored as-is in GGUF.
pub(crate) trait FloatElem: Pod {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
}

impl FloatElem for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl FloatElem for half::f16 {
    fn to_f32(self) -> f32 {
        crate::block::f32_of(self)
    }
    /// Round to nearest even, as ggml and numpy.
    fn from_f32(v: f32) -> Self {
        half::f16::from_f32(v)
    }
}

impl FloatElem for half::bf16 {
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
    /// ggml's conversion: NaNs become quiet NaNs, everything else rounds to nearest even.
    fn from_f32(v: f32) -> Self {
        let bits = v.to_bits();
        let rounded = if bits & 0x7fff_ffff > 0x7f80_0000 { (bits >> 16) | 64 } else { (bits + (0x7fff + ((bits >> 16) & 1))) >> 16 };
        half::bf16::from_bits(rounded as u16)
    }
}

/// Row codec for a float element type.
pub(crate) struct FloatCodec<T>(PhantomData<T>);

impl<T: FloatElem> RowCodec for FloatCodec<T> {
    fn block_codes(_: &[u8], _: &mut [i8]) -> bool {
        false
    }

    fn dequantize_row(src: &[u8], dst: &mut [f32]) {
        for (bytes, out) in src.chunks_exact(size_of::<T>()).zip(dst) {
            *out = bytemuck::pod_read_unaligned::<T>(bytes).to_f32();
        }
    }

    fn dot_row(row: &[u8], x: &[f32]) -> f32 {
        let mut total = 0f64;
        for (bytes, &xi) in row.chunks_exact(size_of::<T>()).zip(x) {
            total += f64::from(bytemuck::pod_read_unaligned::<T>(bytes).to_f32() * xi);
        }
        total as f32
    }
}

impl<T: FloatElem> RowEncoder for FloatCodec<T> {
    fn quantize_row(src: &[f32], dst: &mut [u8]) {
        for (&v, out) in src.iter().zip(dst.chunks_exact_mut(size_of::<T>())) {
            out.copy_from_slice(bytemuck::bytes_of(&T::from_f32(v)));
        }
    }
}
