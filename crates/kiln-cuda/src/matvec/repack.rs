//! Host-side repacking of GGUF weight bytes into the GPU layouts that `kernels/quant.cuh`
//! decodes. Done once, at upload.
//!
//! # Quantized formats
//! A row is cut into tiles of [`TILE_VALUES`] values, zero-padded to whole tiles; lane `l` of a
//! warp owns chunk `l` of every tile: 16 consecutive values `[512 t + 16 l, 512 t + 16 l + 16)`.
//! A chunk lies inside one scale group, so it is 16 small integer codes plus one scale and one
//! offset. The weight is stored as three planes, each starting on a 256-byte boundary:
//! - `codes`: per (row, tile, lane), `2 * code_bits` bytes holding the low `code_bits` bits of
//!   the 16 codes, so one aligned 2-, 4-, 8- or 16-byte load fetches a lane's chunk;
//! - `extra`: the same for the remaining high bits (Q5_0/Q5_1/Q5_K: bit 4; Q3_K: bit 2;
//!   Q6_K: bits 4..6), `2 * extra_bits` bytes per lane;
//! - `scales`: per (row, tile), the raw scale fields of the tile's blocks, field by field
//!   (each field's copies for the tile's blocks side by side), exactly the bytes of the
//!   original blocks, so the planes together take the original size (plus row padding).
//!
//! Bit order within a lane's bytes, for codes `c[0..16]` (so that masks and shifts yield
//! `int` words holding codes `4k..4k+4` in bytes 0..3, ready for `dp4a`):
//! - 8 bits: byte `i` = `c[i]`;
//! - 4 bits: byte `j` (0..8) holds `c[8 (j/4) + j%4]` (low nibble) and `c[8 (j/4) + 4 + j%4]` (high);
//!   the 4-bit codebook indices (IQ4_NL, IQ4_XS, MXFP4, NVFP4, IQ3_XXS) instead in value
//!   order, byte `j` holding `c[2j]` (low) and `c[2j + 1]` (high): their lookup (`codebook16_word`)
//!   takes a word's nibbles in order, so its results need no sorting into code words;
//! - 2 bits: bits `2k..2k+2` of byte `b` (0..4) hold `c[4k + b]`;
//! - 1 bit: bit `i` of a little-endian u16 holds `c[i]`;
//! - the 3-bit codebook indices (2 + 1 bits: IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M) instead in
//!   prmt selector order: the low two bits of `c[4k + b]` at bits `16 (k / 2) + 4 b + 2 (k % 2)` of
//!   the little-endian u32, its third at bit `4 b + k` of the u16, so that one shift and two masks
//!   make the selector that looks `c[4k..4k + 4]` up (`book3_codes`).
//!
//! The 1- and 2-bit formats whose scale spans at least 64 values (Q1_0, Q2_0, TQ2_0, TQ1_0:
//! "grouped") store instead 16-byte groups of `8 / bits` consecutive chunks: byte `j` of a
//! group holds `c[j]` of chunk `k` in bits `bits k .. bits (k + 1)`. One mask per word then
//! gives chunk `k`'s codes (times `2^(bits k)`) for `dp4a`, and a lane of the grouped mat-vec
//! loads a whole group, all under one scale, with one 16-byte load.
//!
//! Codes and scales per format (value = scale * code + offset):
//! | format | codes | scale fields per block (tile region bytes) | scale, offset |
//! |--------|-------|------------------------------------|---------------|
//! | Q8_0   | 8-bit signed `qs` | `d` (32) | d, 0 |
//! | Q4_0   | 4-bit `q` | `d` (32) | d, -8 d |
//! | Q4_1   | 4-bit `q` | `d, m` (64) | d, m |
//! | Q5_0   | 4 + 1 bits | `d` (32) | d, -16 d |
//! | Q5_1   | 4 + 1 bits | `d, m` (64) | d, m |
//! | IQ4_NL | 4-bit codebook index | `d` (32) | d, 0 (code = codebook value) |
//! | Q1_0   | 1-bit sign | `d` (8) | 2 d, -d |
//! | Q2_K   | 2-bit `q` | `scales[16]`, `d, dmin` (40) | d (sc & 15), -dmin (sc >> 4) |
//! | Q3_K   | 2 + 1 bits (`q + 4 hbit`) | `scales[12]`, `d` (28) | d (sc - 32), -4 scale |
//! | Q4_K   | 4-bit `q` | `d, dmin, scales[12]` (32) | d sc, -dmin m |
//! | Q5_K   | 4 + 1 bits | `d, dmin, scales[12]` (32) | d sc, -dmin m |
//! | Q6_K   | 4 + 2 bits | `scales[16]`, `d` (36) | d sc, -32 scale |
//! | IQ4_XS | 4-bit codebook index | `d, scales_h, scales_l[4]` (16) | d (ls - 32), 0 |
//! | TQ2_0  | 2-bit `t + 1` | `d` (4) | d, -d |
//! | TQ1_0  | stored as TQ2_0 (its base-3 packing has no aligned lane access; +22% bytes) | | |
//! | Q2_0   | 2-bit `q` | `d` (16) | d, -d |
//! | MXFP4  | 4-bit E2M1 index | `e` (16) | 2^(e-128), 0 (code = doubled E2M1 value) |
//! | NVFP4  | 4-bit E2M1 index | `d[4]` (32) | ue4m3(d[g]) / 2, 0 |
//!
//! The codebook formats are expanded at upload: each value's grid entry and sign become an
//! index into a small signed codebook (3 bits: 2 + 1 in the extra plane, or 4 bits), so a
//! lane's chunk decodes without grid tables; only the bytes holding scales are copied.
//! | format  | codes (codebook) | scale fields per super-block (tile bytes) | scale |
//! |---------|------------------|----------------------------|-------|
//! | IQ2_XXS | 2 + 1 bits (+-8, 25, 43) | `d`, the byte with group g's scale nibble, g = 0..8 (20) | d (0.5 + s) / 4 |
//! | IQ2_XS  | 2 + 1 bits | `d`, `scales[8]` (20) | d (0.5 + s) / 4, per 16 |
//! | IQ2_S   | 2 + 1 bits | `d`, `scales[8]` (20) | d (0.5 + s) / 4, per 16 |
//! | IQ3_XXS | 4 bits (+-4 .. 62) | `d`, the byte with group g's scale nibble (20) | d (0.5 + s) / 2 |
//! | IQ3_S   | 4 bits `u`, value 2 u - 15 (+-1, 3 .. 15) | `d`, `scales[4]` (12) | 2 d (1 + 2 s), offset -15 d (1 + 2 s) |
//! | IQ1_S   | 2 + 1 bits (8 (grid + delta)) | `d`, `qh[8]` (36) | d (2 s + 1) / 8 |
//! | IQ1_M   | 2 + 1 bits (8 (grid + delta)) | `scales[8]` (16) | d (2 s + 1) / 8, per 16 |
//!
//! # Float formats
//! F32, F16 and BF16 rows are kept as they are, with the row stride rounded up to 16 elements
//! (zero-padded) when the row length is not a multiple of 16.

use std::mem::{offset_of, size_of};
use std::ops::Range;

use kiln_quant::{
    BlockIQ1_M, BlockIQ1_S, BlockIQ2_S, BlockIQ2_XS, BlockIQ2_XXS, BlockIQ3_S, BlockIQ3_XXS, BlockIQ4_NL, BlockIQ4_XS, BlockMXFP4, BlockNVFP4, BlockQ1_0,
    BlockQ2_0, BlockQ2_K, BlockQ3_K, BlockQ4_0, BlockQ4_1, BlockQ4_K, BlockQ5_0, BlockQ5_1, BlockQ5_K, BlockQ6_K, BlockQ8_0, BlockTQ1_0, BlockTQ2_0, GgmlType,
};
use rayon::prelude::*;

pub(crate) const TILE_VALUES: usize = 512;
pub(crate) const CHUNK_VALUES: usize = 16;
pub(crate) const LANES: usize = TILE_VALUES / CHUNK_VALUES;
/// Alignment of each plane inside the uploaded buffer.
const PLANE_ALIGN: usize = 256;

/// How one quantized format is stored on the GPU.
#[derive(Debug)]
pub(crate) struct QuantLayout {
    pub ty: GgmlType,
    /// Suffix of the kernel names (`matvec_<kernel>` ...).
    pub kernel: &'static str,
    pub code_bits: usize,
    pub extra_bits: usize,
    /// (byte offset, length) of each scale field in the original block.
    scale_fields: &'static [(usize, usize)],
    /// How `kiln_quant::block_codes` become stored codes, for the formats repacked that way.
    code_map: Option<CodeMap>,
}

/// Stored code of a signed code: plus a bias, or its index in a codebook.
#[derive(Debug)]
pub(crate) enum CodeMap {
    Bias(i8),
    Codebook(&'static [i8]),
}

impl CodeMap {
    fn apply(&self, code: i8) -> u8 {
        match self {
            CodeMap::Bias(bias) => (code + bias) as u8,
            // Every code the format can produce is in its codebook (see the tests).
            CodeMap::Codebook(book) => book.iter().position(|&c| c == code).unwrap_or(0) as u8,
        }
    }
}

/// The codebooks of the expanded formats; quant_bits.cuh and quant.cuh hold the same bytes.
pub(crate) const IQ2_BOOK: &[i8] = &[8, 25, 43, 0, -8, -25, -43, 0];
pub(crate) const IQ3_XXS_BOOK: &[i8] = &[4, 12, 20, 28, 36, 44, 52, 62, -4, -12, -20, -28, -36, -44, -52, -62];
/// IQ3_S's values are the odd numbers -15..15: index u is 2 u - 15, so its codes decode as Q4_0's
/// do (a mask, no lookup), with an offset.
pub(crate) const IQ3_S_BOOK: &[i8] = &[-15, -13, -11, -9, -7, -5, -3, -1, 1, 3, 5, 7, 9, 11, 13, 15];
pub(crate) const IQ1_BOOK: &[i8] = &[-7, 1, 9, 0, -9, -1, 7, 0];

impl QuantLayout {
    pub fn block_values(&self) -> usize {
        self.ty.block_size()
    }

    pub fn block_bytes(&self) -> usize {
        self.ty.type_size()
    }

    pub fn blocks_per_tile(&self) -> usize {
        TILE_VALUES / self.block_values()
    }

    /// Bytes of one lane's chunk in the codes plane.
    pub fn code_bytes(&self) -> usize {
        self.code_bits * CHUNK_VALUES / 8
    }

    pub fn extra_bytes(&self) -> usize {
        self.extra_bits * CHUNK_VALUES / 8
    }

    /// Bytes of one tile in the scales plane (`SCALE_BYTES` in quant.cuh).
    pub fn scale_bytes(&self) -> usize {
        self.scale_fields.iter().map(|&(_, len)| len).sum::<usize>() * self.blocks_per_tile()
    }

    /// Codes stored in 16-byte groups (module docs); `CodeGroup` in quant.cuh decodes them.
    pub fn grouped(&self) -> bool {
        matches!(self.ty, GgmlType::Q1_0 | GgmlType::Q2_0 | GgmlType::TQ2_0 | GgmlType::TQ1_0)
    }

    /// 4-bit codebook indices stored in value order (module docs).
    pub fn nibbles_in_value_order(&self) -> bool {
        matches!(self.ty, GgmlType::IQ4_NL | GgmlType::IQ4_XS | GgmlType::MXFP4 | GgmlType::NVFP4 | GgmlType::IQ3_XXS)
    }

    /// 3-bit codebook indices stored in prmt selector order (module docs).
    pub fn selector_order(&self) -> bool {
        matches!(self.ty, GgmlType::IQ2_XXS | GgmlType::IQ2_XS | GgmlType::IQ2_S | GgmlType::IQ1_S | GgmlType::IQ1_M)
    }

    /// Chunks per 16-byte group of a grouped layout.
    fn group_chunks(&self) -> usize {
        GROUP_BYTES / self.code_bytes()
    }
}

/// Bytes of one code group of the grouped layouts.
const GROUP_BYTES: usize = 16;

/// f16 scale fields are 2 bytes; (d, m) or (d, dmin) pairs 4.
const F16: usize = 2;

macro_rules! layout {
    ($ty:ident, $kernel:literal, $code_bits:literal, $extra_bits:literal, [$(($block:ty, $field:ident, $len:expr)),*]) => {
        layout!($ty, $kernel, $code_bits, $extra_bits, [$((offset_of!($block, $field), $len)),*], None)
    };
    ($ty:ident, $kernel:literal, $code_bits:literal, $extra_bits:literal, [$(($offset:expr, $len:expr)),*], $map:expr) => {
        QuantLayout {
            ty: GgmlType::$ty,
            kernel: $kernel,
            code_bits: $code_bits,
            extra_bits: $extra_bits,
            scale_fields: &[$(($offset, $len)),*],
            code_map: $map,
        }
    };
}

/// `d` (offset 0), then the top byte of each 32-value group's sign-and-scale word (group g's
/// word at `first + stride * g`), whose high nibble is the group's scale: IQ2_XXS / IQ3_XXS.
const fn word_scale_fields(first: usize, stride: usize) -> [(usize, usize); 9] {
    let mut fields = [(0, F16); 9];
    let mut g = 0;
    while g < 8 {
        fields[g + 1] = (first + stride * g + 3, 1);
        g += 1;
    }
    fields
}

const IQ2_XXS_SCALES: [(usize, usize); 9] = word_scale_fields(offset_of!(BlockIQ2_XXS, qs) + 4, 8);
const IQ3_XXS_SCALES: [(usize, usize); 9] = word_scale_fields(offset_of!(BlockIQ3_XXS, qs) + 64, 4);

static LAYOUTS: &[QuantLayout] = &[
    layout!(Q8_0, "q8_0", 8, 0, [(BlockQ8_0, d, F16)]),
    layout!(Q4_0, "q4_0", 4, 0, [(BlockQ4_0, d, F16)]),
    layout!(Q4_1, "q4_1", 4, 0, [(BlockQ4_1, d, 2 * F16)]),
    layout!(Q5_0, "q5_0", 4, 1, [(BlockQ5_0, d, F16)]),
    layout!(Q5_1, "q5_1", 4, 1, [(BlockQ5_1, d, 2 * F16)]),
    layout!(IQ4_NL, "iq4_nl", 4, 0, [(BlockIQ4_NL, d, F16)]),
    layout!(Q1_0, "q1_0", 1, 0, [(BlockQ1_0, d, F16)]),
    layout!(Q2_K, "q2_k", 2, 0, [(BlockQ2_K, scales, 16), (BlockQ2_K, d, 2 * F16)]),
    layout!(Q3_K, "q3_k", 2, 1, [(BlockQ3_K, scales, 12), (BlockQ3_K, d, F16)]),
    layout!(Q4_K, "q4_k", 4, 0, [(BlockQ4_K, d, 2 * F16 + 12)]),
    layout!(Q5_K, "q5_k", 4, 1, [(BlockQ5_K, d, 2 * F16 + 12)]),
    layout!(Q6_K, "q6_k", 4, 2, [(BlockQ6_K, scales, 16), (BlockQ6_K, d, F16)]),
    layout!(IQ4_XS, "iq4_xs", 4, 0, [(BlockIQ4_XS, d, F16 + 2 + 4)]),
    layout!(TQ2_0, "tq2_0", 2, 0, [(BlockTQ2_0, d, F16)]),
    layout!(TQ1_0, "tq2_0", 2, 0, [(BlockTQ1_0, d, F16)]),
    layout!(Q2_0, "q2_0", 2, 0, [(offset_of!(BlockQ2_0, d), F16)], Some(CodeMap::Bias(1))),
    layout!(MXFP4, "mxfp4", 4, 0, [(offset_of!(BlockMXFP4, e), 1)], Some(CodeMap::Codebook(&kiln_quant::E2M1_X2))),
    layout!(NVFP4, "nvfp4", 4, 0, [(offset_of!(BlockNVFP4, d), 4)], Some(CodeMap::Codebook(&kiln_quant::E2M1_X2))),
    QuantLayout { ty: GgmlType::IQ2_XXS, kernel: "iq2_xxs", code_bits: 2, extra_bits: 1, scale_fields: &IQ2_XXS_SCALES, code_map: IQ2 },
    layout!(IQ2_XS, "iq2_xs", 2, 1, [(offset_of!(BlockIQ2_XS, d), F16), (offset_of!(BlockIQ2_XS, scales), 8)], IQ2),
    layout!(IQ2_S, "iq2_s", 2, 1, [(offset_of!(BlockIQ2_S, d), F16), (offset_of!(BlockIQ2_S, scales), 8)], IQ2),
    QuantLayout { ty: GgmlType::IQ3_XXS, kernel: "iq3_xxs", code_bits: 4, extra_bits: 0, scale_fields: &IQ3_XXS_SCALES, code_map: IQ3_XXS },
    layout!(IQ3_S, "iq3_s", 4, 0, [(offset_of!(BlockIQ3_S, d), F16), (offset_of!(BlockIQ3_S, scales), 4)], Some(CodeMap::Codebook(IQ3_S_BOOK))),
    layout!(IQ1_S, "iq1_s", 2, 1, [(offset_of!(BlockIQ1_S, d), F16), (offset_of!(BlockIQ1_S, qh), 16)], IQ1),
    layout!(IQ1_M, "iq1_m", 2, 1, [(offset_of!(BlockIQ1_M, scales), 8)], IQ1),
];

const IQ2: Option<CodeMap> = Some(CodeMap::Codebook(IQ2_BOOK));
const IQ3_XXS: Option<CodeMap> = Some(CodeMap::Codebook(IQ3_XXS_BOOK));
const IQ1: Option<CodeMap> = Some(CodeMap::Codebook(IQ1_BOOK));

/// The GPU layout of a quantized type, or `None` for float and unsupported types.
pub(crate) fn quant_layout(ty: GgmlType) -> Option<&'static QuantLayout> {
    LAYOUTS.iter().find(|layout| layout.ty == ty)
}

/// Float element types stored row by row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FloatKind {
    F32,
    F16,
    BF16,
}

impl FloatKind {
    pub fn of(ty: GgmlType) -> Option<FloatKind> {
        match ty {
            GgmlType::F32 => Some(FloatKind::F32),
            GgmlType::F16 => Some(FloatKind::F16),
            GgmlType::BF16 => Some(FloatKind::BF16),
            _ => None,
        }
    }

    pub fn kernel(self) -> &'static str {
        match self {
            FloatKind::F32 => "f32",
            FloatKind::F16 => "f16",
            FloatKind::BF16 => "bf16",
        }
    }

    pub fn element_bytes(self) -> usize {
        match self {
            FloatKind::F32 => 4,
            FloatKind::BF16 | FloatKind::F16 => 2,
        }
    }
}

/// Row stride (elements) of a float weight: the row length rounded up to a whole chunk.
pub(crate) fn float_stride(cols: usize) -> usize {
    cols.next_multiple_of(CHUNK_VALUES)
}

/// Float rows with the stride of [`float_stride`]; borrows `src` when no padding is needed.
pub(crate) fn pad_float_rows(kind: FloatKind, src: &[u8], rows: usize, cols: usize) -> std::borrow::Cow<'_, [u8]> {
    let stride = float_stride(cols);
    if stride == cols {
        return std::borrow::Cow::Borrowed(src);
    }
    let (row_bytes, stride_bytes) = (cols * kind.element_bytes(), stride * kind.element_bytes());
    let mut out = vec![0u8; rows * stride_bytes];
    for (dst, row) in out.chunks_exact_mut(stride_bytes).zip(src.chunks_exact(row_bytes)) {
        dst[..row_bytes].copy_from_slice(row);
    }
    std::borrow::Cow::Owned(out)
}

/// A repacked quantized weight: one buffer holding the three planes.
pub(crate) struct Repacked {
    pub bytes: Vec<u8>,
    pub tiles: usize,
    pub codes: Range<usize>,
    pub extra: Range<usize>,
    pub scales: Range<usize>,
}

/// Number of tiles of a row of `cols` values.
pub(crate) fn tiles_of(cols: usize) -> usize {
    cols.div_ceil(TILE_VALUES)
}

/// Repacks `rows` rows of `cols` values, `src` being exactly their GGUF bytes.
pub(crate) fn repack(layout: &QuantLayout, src: &[u8], rows: usize, cols: usize) -> Repacked {
    let tiles = tiles_of(cols);
    let row_codes = tiles * LANES * layout.code_bytes();
    let row_extra = tiles * LANES * layout.extra_bytes();
    let row_scales = tiles * layout.scale_bytes();
    let codes = 0..rows * row_codes;
    let extra_start = codes.end.next_multiple_of(PLANE_ALIGN);
    let extra = extra_start..extra_start + rows * row_extra;
    let scales_start = extra.end.next_multiple_of(PLANE_ALIGN);
    let scales = scales_start..scales_start + rows * row_scales;
    let mut bytes = vec![0u8; scales.end];

    let (code_plane, rest) = bytes.split_at_mut(codes.end);
    let (extra_plane, rest) = rest[extra_start - codes.end..].split_at_mut(extra.len());
    let scale_plane = &mut rest[scales_start - extra.end..];
    let extra_rows: Vec<&mut [u8]> =
        if row_extra == 0 { (0..rows).map(|_| <&mut [u8]>::default()).collect() } else { extra_plane.chunks_mut(row_extra).collect() };
    let src_row_bytes = cols / layout.block_values() * layout.block_bytes();
    code_plane.par_chunks_mut(row_codes.max(1)).zip(scale_plane.par_chunks_mut(row_scales.max(1))).zip(extra_rows.into_par_iter()).enumerate().for_each(
        |(row, ((codes_out, scales_out), extra_out))| {
            let src_row = &src[row * src_row_bytes..(row + 1) * src_row_bytes];
            pack_row(layout, src_row, tiles, codes_out, extra_out, scales_out);
        },
    );
    Repacked { bytes, tiles, codes, extra, scales }
}

fn pack_row(layout: &QuantLayout, src: &[u8], tiles: usize, codes_out: &mut [u8], extra_out: &mut [u8], scales_out: &mut [u8]) {
    let (block_values, block_bytes) = (layout.block_values(), layout.block_bytes());
    let blocks_per_tile = layout.blocks_per_tile();
    let scale_bytes = layout.scale_bytes();
    let mut codes = vec![0u8; tiles * TILE_VALUES];
    let mut signed = vec![0i8; block_values];
    for (index, block) in src.chunks_exact(block_bytes).enumerate() {
        let out = &mut codes[index * block_values..(index + 1) * block_values];
        match &layout.code_map {
            Some(map) => {
                kiln_quant::block_codes(layout.ty, block, &mut signed).expect("one whole block of a decodable type");
                out.iter_mut().zip(&signed).for_each(|(o, &c)| *o = map.apply(c));
            }
            None => block_codes(layout.ty, block, out),
        }
        let tile_scales = &mut scales_out[index / blocks_per_tile * scale_bytes..][..scale_bytes];
        let slot = index % blocks_per_tile;
        let mut field_start = 0;
        for &(offset, len) in layout.scale_fields {
            tile_scales[field_start + slot * len..][..len].copy_from_slice(&block[offset..offset + len]);
            field_start += len * blocks_per_tile;
        }
    }
    if layout.grouped() {
        let group_values = layout.group_chunks() * CHUNK_VALUES;
        for (values, out) in codes.chunks_exact(group_values).zip(codes_out.chunks_exact_mut(GROUP_BYTES)) {
            pack_group(layout.code_bits, values, out);
        }
        return;
    }
    let (code_bytes, extra_bytes) = (layout.code_bytes(), layout.extra_bytes());
    let low_mask = if layout.code_bits == 8 { 0xff } else { (1u8 << layout.code_bits) - 1 };
    for (chunk, values) in codes.chunks_exact(CHUNK_VALUES).enumerate() {
        let values: &[u8; CHUNK_VALUES] = values.try_into().expect("chunk of 16 codes");
        let low: [u8; CHUNK_VALUES] = std::array::from_fn(|i| values[i] & low_mask);
        let out = &mut codes_out[chunk * code_bytes..(chunk + 1) * code_bytes];
        let high: [u8; CHUNK_VALUES] = std::array::from_fn(|i| values[i] >> layout.code_bits);
        let extra = &mut extra_out[chunk * extra_bytes..(chunk + 1) * extra_bytes];
        if layout.selector_order() {
            let (low_bits, high_bits) = pack_selector_order(values);
            out.copy_from_slice(&low_bits.to_le_bytes());
            extra.copy_from_slice(&high_bits.to_le_bytes());
            continue;
        }
        if layout.nibbles_in_value_order() {
            pack_nibbles_in_value_order(&low, out);
        } else {
            pack_bits(layout.code_bits, &low, out);
        }
        if extra_bytes > 0 {
            pack_bits(layout.extra_bits, &high, extra);
        }
    }
}

/// Packs 16 codes of `bits` bits into `2 * bits` bytes in the lane order of the module docs.
pub(crate) fn pack_bits(bits: usize, codes: &[u8; CHUNK_VALUES], out: &mut [u8]) {
    match bits {
        8 => out.copy_from_slice(codes),
        4 => {
            for (j, byte) in out.iter_mut().enumerate() {
                let first = 8 * (j / 4) + j % 4;
                *byte = (codes[first] & 0xf) | (codes[first + 4] << 4);
            }
        }
        2 => {
            for (b, byte) in out.iter_mut().enumerate() {
                *byte = (0..4).fold(0, |acc, k| acc | (codes[4 * k + b] & 3) << (2 * k));
            }
        }
        1 => {
            let word = (0..16).fold(0u16, |acc, i| acc | u16::from(codes[i] & 1) << i);
            out.copy_from_slice(&word.to_le_bytes());
        }
        _ => unreachable!("plane widths are 1, 2, 4 or 8 bits"),
    }
}

/// The two planes of 16 3-bit codebook indices in prmt selector order (module docs): the low
/// two bits of each and its third.
fn pack_selector_order(codes: &[u8; CHUNK_VALUES]) -> (u32, u16) {
    let (mut low, mut high) = (0u32, 0u16);
    for (v, &c) in codes.iter().enumerate() {
        let (k, b) = (v / 4, v % 4);
        low |= u32::from(c & 3) << (16 * (k / 2) + 4 * b + 2 * (k % 2));
        high |= u16::from((c >> 2) & 1) << (4 * b + k);
    }
    (low, high)
}

/// The indices `book3_codes` (quant.cuh) looks up from planes in selector order: its selector
/// of values `4k..4k + 4`, nibble by nibble.
#[cfg(test)]
fn selector_order_indices(low: u32, high: u16) -> [u8; CHUNK_VALUES] {
    let high = u32::from(high);
    let high_at_bit2 = [high << 2, high << 1, high, high >> 1];
    let selectors: [u32; 4] = std::array::from_fn(|k| ((low >> (16 * (k / 2) + 2 * (k % 2))) & 0x3333) | (high_at_bit2[k] & 0x4444));
    std::array::from_fn(|v| ((selectors[v / 4] >> (4 * (v % 4))) & 0xf) as u8)
}

/// Packs 16 4-bit codes into 8 bytes, byte `j` holding `codes[2j]` (low) and `codes[2j + 1]`.
fn pack_nibbles_in_value_order(codes: &[u8; CHUNK_VALUES], out: &mut [u8]) {
    for (byte, pair) in out.iter_mut().zip(codes.chunks_exact(2)) {
        *byte = (pair[0] & 0xf) | (pair[1] << 4);
    }
}

/// Inverse of [`pack_nibbles_in_value_order`].
#[cfg(test)]
fn unpack_nibbles_in_value_order(packed: &[u8]) -> [u8; CHUNK_VALUES] {
    std::array::from_fn(|i| (packed[i / 2] >> (4 * (i % 2))) & 0xf)
}

/// Packs the `8 / bits` chunks of one group: byte `j` holds code `j` of chunk `k` at bit `bits k`.
fn pack_group(bits: usize, values: &[u8], out: &mut [u8]) {
    let mask = (1u8 << bits) - 1;
    for (j, byte) in out.iter_mut().enumerate() {
        *byte = values.chunks_exact(CHUNK_VALUES).enumerate().fold(0, |acc, (k, chunk)| acc | (chunk[j] & mask) << (bits * k));
    }
}

/// Chunk `k` of a packed group (the inverse of [`pack_group`]).
#[cfg(test)]
fn unpack_group_chunk(bits: usize, group: &[u8], k: usize) -> [u8; CHUNK_VALUES] {
    std::array::from_fn(|j| (group[j] >> (bits * k)) & ((1u8 << bits) - 1))
}

/// Inverse of [`pack_bits`].
#[cfg(test)]
pub(crate) fn unpack_bits(bits: usize, packed: &[u8]) -> [u8; CHUNK_VALUES] {
    std::array::from_fn(|i| match bits {
        8 => packed[i],
        4 => {
            let (k, b) = (i / 4, i % 4);
            (packed[4 * (k / 2) + b] >> (4 * (k % 2))) & 0xf
        }
        2 => (packed[i % 4] >> (2 * (i / 4))) & 3,
        1 => (u16::from_le_bytes([packed[0], packed[1]]) >> i) as u8 & 1,
        _ => unreachable!("plane widths are 1, 2, 4 or 8 bits"),
    })
}

fn read<B: bytemuck::Pod>(block: &[u8]) -> B {
    bytemuck::pod_read_unaligned(&block[..size_of::<B>()])
}

/// Low nibble of `qs[i]` for i < 16, high nibble of `qs[i - 16]` above (the 32-value layout).
fn nibble32(qs: &[u8; 16], i: usize) -> u8 {
    (qs[i % 16] >> (4 * (i / 16))) & 0xf
}

/// Value `128 h + 32 k + m` of the 2-bit K-quant / TQ2_0 layout: bits 2k of `qs[32 h + m]`.
fn crumb256(qs: &[u8; 64], e: usize) -> u8 {
    (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3
}

/// Trit `n` (most significant first) of a byte holding ceil(T * 256 / 243), as 0..=2.
fn trit(byte: u8, n: usize) -> u8 {
    const POW3: [u8; 5] = [1, 3, 9, 27, 81];
    ((u16::from(byte.wrapping_mul(POW3[n])) * 3) >> 8) as u8
}

/// The codes of one block in the convention of the module docs' table.
fn block_codes(ty: GgmlType, block: &[u8], out: &mut [u8]) {
    match ty {
        GgmlType::Q8_0 => {
            let b: BlockQ8_0 = read(block);
            out.copy_from_slice(bytemuck::cast_slice(&b.qs));
        }
        GgmlType::Q4_0 => {
            let b: BlockQ4_0 = read(block);
            out.iter_mut().enumerate().for_each(|(i, c)| *c = nibble32(&b.qs, i));
        }
        GgmlType::Q4_1 => {
            let b: BlockQ4_1 = read(block);
            out.iter_mut().enumerate().for_each(|(i, c)| *c = nibble32(&b.qs, i));
        }
        GgmlType::IQ4_NL => {
            let b: BlockIQ4_NL = read(block);
            out.iter_mut().enumerate().for_each(|(i, c)| *c = nibble32(&b.qs, i));
        }
        GgmlType::Q5_0 => {
            let b: BlockQ5_0 = read(block);
            let qh = u32::from_le_bytes(b.qh);
            out.iter_mut().enumerate().for_each(|(i, c)| *c = nibble32(&b.qs, i) | (((qh >> i) & 1) as u8) << 4);
        }
        GgmlType::Q5_1 => {
            let b: BlockQ5_1 = read(block);
            let qh = u32::from_le_bytes(b.qh);
            out.iter_mut().enumerate().for_each(|(i, c)| *c = nibble32(&b.qs, i) | (((qh >> i) & 1) as u8) << 4);
        }
        GgmlType::Q1_0 => {
            let b: BlockQ1_0 = read(block);
            out.iter_mut().enumerate().for_each(|(i, c)| *c = (b.qs[i / 8] >> (i % 8)) & 1);
        }
        GgmlType::Q2_K => {
            let b: BlockQ2_K = read(block);
            out.iter_mut().enumerate().for_each(|(e, c)| *c = crumb256(&b.qs, e));
        }
        GgmlType::Q3_K => {
            let b: BlockQ3_K = read(block);
            out.iter_mut().enumerate().for_each(|(e, c)| *c = crumb256(&b.qs, e) | ((b.hmask[e % 32] >> (e / 32)) & 1) << 2);
        }
        GgmlType::Q4_K => {
            let b: BlockQ4_K = read(block);
            out.iter_mut().enumerate().for_each(|(e, c)| *c = (b.qs[32 * (e / 64) + e % 32] >> (4 * ((e % 64) / 32))) & 0xf);
        }
        GgmlType::Q5_K => {
            let b: BlockQ5_K = read(block);
            out.iter_mut().enumerate().for_each(|(e, c)| {
                let low = (b.qs[32 * (e / 64) + e % 32] >> (4 * ((e % 64) / 32))) & 0xf;
                *c = low | ((b.qh[e % 32] >> (e / 32)) & 1) << 4;
            });
        }
        GgmlType::Q6_K => {
            let b: BlockQ6_K = read(block);
            out.iter_mut().enumerate().for_each(|(e, c)| {
                let (h, k, m) = (e / 128, (e % 128) / 32, e % 32);
                let low = (b.ql[64 * h + 32 * (k % 2) + m] >> (4 * (k / 2))) & 0xf;
                *c = low | ((b.qh[32 * h + m] >> (2 * k)) & 3) << 4;
            });
        }
        GgmlType::IQ4_XS => {
            let b: BlockIQ4_XS = read(block);
            out.iter_mut().enumerate().for_each(|(e, c)| {
                let (g, i) = (e / 32, e % 32);
                *c = (b.qs[16 * g + i % 16] >> (4 * (i / 16))) & 0xf;
            });
        }
        GgmlType::TQ2_0 => {
            let b: BlockTQ2_0 = read(block);
            out.iter_mut().enumerate().for_each(|(e, c)| *c = crumb256(&b.qs, e));
        }
        GgmlType::TQ1_0 => {
            let b: BlockTQ1_0 = read(block);
            out.iter_mut().enumerate().for_each(|(e, c)| {
                *c = match e {
                    0..160 => trit(b.qs[e % 32], e / 32),
                    160..240 => trit(b.qs[32 + (e - 160) % 16], (e - 160) / 16),
                    _ => trit(b.qh[(e - 240) % 4], (e - 240) / 4),
                };
            });
        }
        other => unreachable!("{other} has no quantized GPU layout"),
    }
}

#[cfg(test)]
mod tests;
