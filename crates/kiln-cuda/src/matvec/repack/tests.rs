//! Tests of the repacking: every format's planes decode to kiln_quant's values.

use super::*;
use half::f16;
use rand::{Rng, SeedableRng};

/// Decodes chunk `chunk` of `row` from the planes exactly as kernels/quant.cuh does.
fn decode_chunk(layout: &QuantLayout, packed: &Repacked, row: usize, chunk: usize) -> [f32; CHUNK_VALUES] {
    let (lane, tile) = (chunk % LANES, row * packed.tiles + chunk / LANES);
    let lane_bytes = |plane: &Range<usize>, bytes: usize| &packed.bytes[plane.start + (tile * LANES + lane) * bytes..][..bytes];
    if layout.selector_order() {
        let low = u32::from_le_bytes(lane_bytes(&packed.codes, 4).try_into().expect("4 code bytes"));
        let high = u16::from_le_bytes(lane_bytes(&packed.extra, 2).try_into().expect("2 extra bytes"));
        let indices = selector_order_indices(low, high);
        assert!(indices.iter().all(|&i| i < 8), "{}: a selector nibble with bit 3 set replicates a sign", layout.ty);
        return decode_values(layout, packed, tile, lane, indices);
    }
    let low = if layout.grouped() {
        let (first, k) = (tile * LANES + lane - lane % layout.group_chunks(), lane % layout.group_chunks());
        unpack_group_chunk(layout.code_bits, &packed.bytes[packed.codes.start + first * layout.code_bytes()..][..GROUP_BYTES], k)
    } else if layout.nibbles_in_value_order() {
        unpack_nibbles_in_value_order(lane_bytes(&packed.codes, layout.code_bytes()))
    } else {
        unpack_bits(layout.code_bits, lane_bytes(&packed.codes, layout.code_bytes()))
    };
    let codes: [u8; CHUNK_VALUES] = if layout.extra_bits > 0 {
        let high = unpack_bits(layout.extra_bits, lane_bytes(&packed.extra, layout.extra_bytes()));
        std::array::from_fn(|i| low[i] | high[i] << layout.code_bits)
    } else {
        low
    };
    decode_values(layout, packed, tile, lane, codes)
}

/// A chunk's values from its stored codes and its tile's scales, as kernels/quant.cuh decodes them.
fn decode_values(layout: &QuantLayout, packed: &Repacked, tile: usize, lane: usize, codes: [u8; CHUNK_VALUES]) -> [f32; CHUNK_VALUES] {
    let s = &packed.bytes[packed.scales.start + tile * layout.scale_bytes()..][..layout.scale_bytes()];
    let f16_at = |at: usize| f16::from_le_bytes([s[at], s[at + 1]]).to_f32();
    let (sb, j) = (lane / 16, lane % 16);
    let unsigned = |c: u8| f32::from(c);
    let e2m1 = |c: u8| f32::from(kiln_quant::E2M1_X2[usize::from(c)]);
    let book: &[i8] = match &layout.code_map {
        Some(CodeMap::Codebook(book)) => book,
        _ => &[],
    };
    let from_book = |c: u8| f32::from(book[usize::from(c)]);
    let (value_of, scale, offset): (&dyn Fn(u8) -> f32, f32, f32) = match layout.ty {
        GgmlType::Q8_0 => (&|c| f32::from(c as i8), f16_at(2 * (lane / 2)), 0.0),
        GgmlType::Q4_0 => (&unsigned, f16_at(2 * (lane / 2)), -8.0 * f16_at(2 * (lane / 2))),
        GgmlType::Q5_0 => (&unsigned, f16_at(2 * (lane / 2)), -16.0 * f16_at(2 * (lane / 2))),
        GgmlType::Q4_1 | GgmlType::Q5_1 => (&unsigned, f16_at(4 * (lane / 2)), f16_at(4 * (lane / 2) + 2)),
        GgmlType::IQ4_NL => (&|c| f32::from(kiln_quant::IQ4_NL_CODEBOOK[usize::from(c)]), f16_at(2 * (lane / 2)), 0.0),
        GgmlType::Q1_0 => (&unsigned, 2.0 * f16_at(2 * (lane / 8)), -f16_at(2 * (lane / 8))),
        GgmlType::Q2_K => {
            let sc = s[lane];
            (&unsigned, f16_at(32 + 4 * sb) * f32::from(sc & 0xf), -(f16_at(34 + 4 * sb) * f32::from(sc >> 4)))
        }
        GgmlType::Q3_K => {
            let (low_byte, high_byte) = (s[12 * sb + (j & 7)], s[12 * sb + 8 + (j & 3)]);
            let sc = ((low_byte >> (4 * (j >> 3))) & 0xf) | ((high_byte >> (2 * (j >> 2))) & 3) << 4;
            let scale = f16_at(24 + 2 * sb) * (i32::from(sc) - 32) as f32;
            (&unsigned, scale, -4.0 * scale)
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let head = &s[16 * sb..16 * sb + 16];
            let (sub, jj) = (j / 2, (j / 2) & 3);
            let (a, b, e) = (head[4 + jj], head[8 + jj], head[12 + jj]);
            let (sc, m) = if sub < 4 { (a & 63, b & 63) } else { ((e & 0xf) | (a >> 6) << 4, (e >> 4) | (b >> 6) << 4) };
            let (d, dmin) = (f16_at(16 * sb), f16_at(16 * sb + 2));
            (&unsigned, d * f32::from(sc), -(dmin * f32::from(m)))
        }
        GgmlType::Q6_K => {
            let scale = f16_at(32 + 2 * sb) * f32::from(s[lane] as i8);
            (&unsigned, scale, -32.0 * scale)
        }
        GgmlType::IQ4_XS => {
            let head = &s[8 * sb..8 * sb + 8];
            let g = j / 2;
            let scales_h = u16::from_le_bytes([head[2], head[3]]);
            let scales_l = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
            let ls = ((scales_l >> (4 * g)) & 0xf) as i32 | ((i32::from(scales_h) >> (2 * g)) & 3) << 4;
            (&|c| f32::from(kiln_quant::IQ4_NL_CODEBOOK[usize::from(c)]), f16_at(8 * sb) * (ls - 32) as f32, 0.0)
        }
        GgmlType::TQ1_0 | GgmlType::TQ2_0 => (&unsigned, f16_at(2 * sb), -f16_at(2 * sb)),
        GgmlType::Q2_0 => (&unsigned, f16_at(2 * (lane / 4)), -f16_at(2 * (lane / 4))),
        GgmlType::MXFP4 => (&e2m1, kiln_quant::e8m0_half(s[lane / 2]), 0.0),
        GgmlType::NVFP4 => (&e2m1, kiln_quant::ue4m3_half(s[lane]), 0.0),
        GgmlType::IQ2_XXS | GgmlType::IQ3_XXS => {
            let mul = if layout.ty == GgmlType::IQ2_XXS { 0.25 } else { 0.5 };
            let nibble = s[4 + 2 * (j / 2) + sb] >> 4;
            (&from_book, f16_at(2 * sb) * (0.5 + f32::from(nibble)) * mul, 0.0)
        }
        GgmlType::IQ2_XS | GgmlType::IQ2_S => {
            let nibble = (s[4 + 8 * sb + j / 2] >> (4 * (j % 2))) & 0xf;
            (&from_book, f16_at(2 * sb) * (0.5 + f32::from(nibble)) * 0.25, 0.0)
        }
        GgmlType::IQ3_S => {
            let g = j / 2;
            let nibble = (s[4 + 4 * sb + g / 2] >> (4 * (g % 2))) & 0xf;
            let scale = 2.0 * f16_at(2 * sb) * f32::from(1 + 2 * nibble);
            (&unsigned, scale, -7.5 * scale)
        }
        GgmlType::IQ1_S => {
            let qh = u16::from_le_bytes([s[4 + 16 * sb + 2 * (j / 2)], s[5 + 16 * sb + 2 * (j / 2)]]);
            let multiple = f32::from(2 * ((qh >> 12) & 7) + 1);
            (&from_book, f16_at(2 * sb) * multiple * 0.125, 0.0)
        }
        GgmlType::IQ1_M => {
            let w: [u16; 4] = std::array::from_fn(|k| u16::from_le_bytes([s[8 * sb + 2 * k], s[8 * sb + 2 * k + 1]]));
            let bits = (w[0] >> 12) | ((w[1] >> 8) & 0x00f0) | ((w[2] >> 4) & 0x0f00) | (w[3] & 0xf000);
            let g = j / 2;
            let multiple = f32::from(2 * ((w[g / 2] >> (6 * (g % 2) + 3 * (j % 2))) & 7) + 1);
            (&from_book, f16::from_bits(bits).to_f32() * multiple * 0.125, 0.0)
        }
        other => unreachable!("{other}"),
    };
    std::array::from_fn(|i| scale.mul_add(value_of(codes[i]), offset))
}

/// Quantized random values, or for the IQ1/IQ2 codebook formats random blocks with a finite
/// f16 super-block scale: they reach every grid point and sign pattern, and ggml's
/// searches take up to 1.4 µs a value.
fn random_weights(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    use GgmlType::*;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut bytes = vec![0u8; kiln_quant::quantized_size(ty, rows * cols).unwrap()];
    if !matches!(ty, IQ2_XXS | IQ2_XS | IQ2_S | IQ1_S | IQ1_M) {
        let values: Vec<f32> = (0..rows * cols).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        kiln_quant::quantize(ty, &values, &mut bytes).unwrap();
        return bytes;
    }
    rng.fill(&mut bytes[..]);
    kiln_quant::set_codebook_scales(ty, &mut bytes, || f16::from_f32(rng.gen_range(-1.0f32..1.0)).to_bits()).unwrap();
    bytes
}

/// Every format: the repacked planes decode (the kernels' way) to exactly the values
/// kiln_quant::dequantize gives, padding decodes to zero, and the planes take the
/// original bytes plus padding.
#[test]
fn repacked_planes_decode_to_the_reference_values() {
    for (index, layout) in LAYOUTS.iter().enumerate() {
        let block = layout.block_values();
        // A single block, a partial tile, several whole tiles, and tiles plus a remainder.
        let mut shapes = vec![(1, block), (3, TILE_VALUES.max(block)), (2, 3 * TILE_VALUES + block)];
        if block == 32 {
            shapes.extend([(5, 96), (2, 4128)]);
        }
        for (rows, cols) in shapes {
            let bytes = random_weights(layout.ty, rows, cols, 1000 * index as u64 + cols as u64);
            let packed = repack(layout, &bytes, rows, cols);
            let row_bytes = bytes.len() / rows;
            for row in 0..rows {
                let mut want = vec![0f32; cols];
                kiln_quant::dequantize(layout.ty, &bytes[row * row_bytes..(row + 1) * row_bytes], &mut want).unwrap();
                for chunk in 0..packed.tiles * LANES {
                    let got = decode_chunk(layout, &packed, row, chunk);
                    for (i, &value) in got.iter().enumerate() {
                        let column = chunk * CHUNK_VALUES + i;
                        let expected = want.get(column).copied().unwrap_or(0.0);
                        assert!(value == expected, "{} {rows}x{cols}: row {row} column {column}: {value} != {expected}", layout.ty);
                    }
                }
            }
            if !expands(layout.ty) && cols % TILE_VALUES == 0 {
                let planes = packed.codes.len() + packed.extra.len() + packed.scales.len();
                assert_eq!(planes, bytes.len(), "{}: planes hold exactly the original bytes", layout.ty);
            }
        }
    }
}

/// The formats stored in more bytes than their GGUF blocks (codes re-encoded wider).
fn expands(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, TQ1_0 | IQ2_XXS | IQ2_XS | IQ2_S | IQ3_XXS | IQ3_S | IQ1_S | IQ1_M)
}

/// Every code a codebook format can produce has a codebook entry (so `CodeMap::apply`'s
/// fallback is never taken): all grid entries and signs, through `block_codes`.
#[test]
fn codebooks_cover_every_code() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    for layout in LAYOUTS {
        let Some(CodeMap::Codebook(book)) = &layout.code_map else { continue };
        assert!(book.len() <= 1 << (layout.code_bits + layout.extra_bits), "{}", layout.ty);
        let mut codes = vec![0i8; layout.block_values()];
        for _ in 0..2000 {
            let mut block = vec![0u8; layout.block_bytes()];
            rng.fill(&mut block[..]);
            kiln_quant::block_codes(layout.ty, &block, &mut codes).unwrap();
            for &c in &codes {
                assert!(book.contains(&c), "{}: code {c} not in its codebook", layout.ty);
            }
        }
    }
}

/// quant_bits.cuh and quant.cuh spell each codebook as words of four signed bytes; they
/// must be the codebooks the repacking indexes (the decoders themselves only run on a GPU).
#[test]
fn kernel_codebook_words_match_the_repack_codebooks() {
    let source = [include_str!("../../../kernels/quant_bits.cuh"), include_str!("../../../kernels/quant.cuh")].concat();
    let words = |book: &[i8]| -> Vec<String> {
        let mut padded = book.to_vec();
        padded.resize(16, 0);
        padded.chunks(4).map(|c| format!("0x{:08x}u", u32::from_le_bytes([c[0] as u8, c[1] as u8, c[2] as u8, c[3] as u8]))).collect()
    };
    for (book, used) in [(&kiln_quant::E2M1_X2[..], 4), (IQ3_XXS_BOOK, 4), (IQ2_BOOK, 2), (IQ1_BOOK, 2)] {
        let spelled = words(book)[..used].join(", ");
        assert!(source.contains(&spelled), "the kernel headers lack the codebook {book:?} as {spelled}");
    }
    let iq4: Vec<i8> = kiln_quant::IQ4_NL_CODEBOOK.to_vec();
    assert!(source.contains(&words(&iq4).join(", ")), "IQ4_NL codebook");
}

#[test]
fn every_computable_type_has_a_gpu_layout() {
    for &ty in kiln_quant::ALL_TYPES {
        if kiln_quant::can_dequantize(ty) && !matches!(ty, GgmlType::Q8_1 | GgmlType::Q8_K) {
            assert!(quant_layout(ty).is_some() || FloatKind::of(ty).is_some(), "{ty} has no GPU layout");
        }
    }
    for layout in LAYOUTS {
        assert_eq!(TILE_VALUES % layout.block_values(), 0, "{}", layout.ty);
        assert!(layout.scale_fields.iter().all(|&(offset, len)| offset + len <= layout.block_bytes()), "{}", layout.ty);
    }
}

#[test]
fn bit_planes_round_trip() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    for bits in [1, 2, 4, 8] {
        for _ in 0..100 {
            let codes: [u8; CHUNK_VALUES] = std::array::from_fn(|_| rng.gen_range(0..=((1u16 << bits) - 1) as u8));
            let mut packed = vec![0u8; 2 * bits];
            pack_bits(bits, &codes, &mut packed);
            assert_eq!(unpack_bits(bits, &packed), codes, "{bits} bits");
        }
    }
}

#[test]
fn float_rows_are_padded_to_whole_chunks() {
    let src: Vec<u8> = (0..3 * 7 * 2).map(|i| i as u8 + 1).collect();
    let padded = pad_float_rows(FloatKind::F16, &src, 3, 7);
    assert_eq!(padded.len(), 3 * 16 * 2);
    for row in 0..3 {
        assert_eq!(&padded[row * 32..row * 32 + 14], &src[row * 14..row * 14 + 14]);
        assert!(padded[row * 32 + 14..row * 32 + 32].iter().all(|&b| b == 0));
    }
    let aligned = [1u8; 2 * 16 * 4];
    assert!(matches!(pad_float_rows(FloatKind::F32, &aligned, 2, 16), std::borrow::Cow::Borrowed(_)));
}
