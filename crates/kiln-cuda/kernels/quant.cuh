// Weight formats as the GPU stores them (repacked at upload by src/matvec/repack.rs, which
// documents each layout), each with its fetch and decode (built on quant_bits.cuh). Shared by
// the mat-vec, mat-mat and embedding kernels, so each format's layout logic is written once.
//
// Geometry of every quantized format: a row is cut into tiles of 512 values (the row is
// zero-padded to whole tiles); lane l (0..31) owns the chunk of 16 consecutive values
// [512 t + 16 l, 512 t + 16 l + 16) of tile t. A chunk always lies inside one scale group, so
// it decodes to 16 small integer codes with one scale and one offset:
//     value i = scale * code_i + offset.
// Planes, each its own aligned array:
//   codes:  CODE_BYTES per lane per tile, at (tile * 32 + lane) * CODE_BYTES
//   extra:  EXTRA_BYTES per lane per tile (high code bits of 5/6-bit formats, Q3_K)
//   scales: SCALE_BYTES per tile (raw scale fields of the tile's blocks)
// where `tile` is the global tile index row * tiles + t.
#pragma once
#include "activation_q8.cuh"
#include "quant_bits.cuh"

#define TILE_VALUES 512

// ---- Formats ----

struct Planes {
    const u8* codes;
    const u8* extra;
    const u8* scales;
    u32 tiles;  // tiles per row
};

// A decoded chunk: value i = scale * code_i + offset, code i is signed byte i % 4 of q[i / 4].
struct Chunk {
    int q[4];
    float scale;
    float offset;
    int q2[4];  // codebook formats in the mat-vec: second lookups, whose dot adds to q's
};

// A format's optional compile-time property MEMBER, or FALLBACK where it declares none.
#define FORMAT_PROPERTY(NAME, TYPE, MEMBER, FALLBACK) \
    template <class F, class = void>                  \
    struct NAME {                                     \
        static constexpr TYPE value = FALLBACK;       \
    };                                                \
    template <class F>                                \
    struct NAME<F, decltype(void(F::MEMBER))> {       \
        static constexpr TYPE value = F::MEMBER;      \
    };

// Values are scale * code: the dot products skip the offset term (an FMA with 0 that IEEE rules
// keep the compiler from dropping).
FORMAT_PROPERTY(NoOffset, bool, NO_OFFSET, false)
// The offset is a fixed multiple of the scale (value = scale * (code + OFFSET_PER_SCALE)): the
// dot products apply the scale once.
FORMAT_PROPERTY(ScaledOffset, float, OFFSET_PER_SCALE, 0.0f)
// Scale and offset are constant over each 32-value group: a chunk pair (2u, 2u + 1) decodes
// them once.
FORMAT_PROPERTY(ScalePer32, bool, SCALE_PER_32, false)
// A 16-entry codebook: the one-token mat-vec looks it up as two halves (codebook16_codes).
FORMAT_PROPERTY(SplitsBook, bool, BOOK16, false)
// decode<true> is the mat-vec's variant (Q4_K / Q5_K: the scales decoded without a branch).
FORMAT_PROPERTY(MatvecDecode, bool, MATVEC_DECODE, false)

// A weight's chunk indices fit 32 bits (upload_weight checks), so an address is one wide
// multiply-add.
__device__ __forceinline__ const u8* lane_bytes(const u8* plane, u64 tile, u32 lane, u32 bytes) {
    return plane + (u64)((u32)tile * 32 + lane) * bytes;
}

// Per-tile scale bytes of a format whose SCALE_BYTES-wide tile region starts at `tile`.
template <class F>
__device__ __forceinline__ const u8* tile_scales(const Planes& p, u64 tile) {
    return p.scales + (u64)(u32)tile * F::SCALE_BYTES;
}

// Each format: CODE_BYTES / EXTRA_BYTES per lane and SCALE_BYTES per tile, a Raw struct holding
// exactly what fetch() loads (so callers can issue many fetches before decoding), and decode().

// 32-value blocks, f16 d per block (16 per tile, lane reads block lane/2): value = d * int8.
struct FmtQ8_0 {
    static constexpr u32 CODE_BYTES = 16, EXTRA_BYTES = 0, SCALE_BYTES = 32;
    static constexpr bool NO_OFFSET = true;
    struct Raw {
        uint4 codes;
        u32 d;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        return {ld_weight_u128(lane_bytes(p.codes, tile, lane, CODE_BYTES)),
                ld_weight_u16(tile_scales<FmtQ8_0>(p, tile) + 2 * (lane >> 1))};
    }
    static __device__ __forceinline__ Chunk decode(const Raw& r, u32) {
        return {{(int)r.codes.x, (int)r.codes.y, (int)r.codes.z, (int)r.codes.w}, f16_low(r.d), 0.0f};
    }
};

// Nibble formats with 32-value blocks: value = d * (q - 8) (Q4_0) or d * q + m (Q4_1), or
// d * codebook[q] (IQ4_NL). Q4_1 stores (d, m) per block.
template <int KIND>  // 0: Q4_0, 1: Q4_1, 2: IQ4_NL
struct FmtNibble32 {
    static constexpr u32 CODE_BYTES = 8, EXTRA_BYTES = 0, SCALE_BYTES = KIND == 1 ? 64 : 32;
    static constexpr bool SCALE_PER_32 = true;
    static constexpr float OFFSET_PER_SCALE = KIND == 0 ? -8.0f : 0.0f;
    static constexpr bool NO_OFFSET = KIND == 2;
    struct Raw {
        uint2 codes;
        u32 dm;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        const u8* scales = tile_scales<FmtNibble32>(p, tile);
        return {ld_weight_u64(lane_bytes(p.codes, tile, lane, CODE_BYTES)),
                KIND == 1 ? ld_weight_u32(scales + 4 * (lane >> 1)) : ld_weight_u16(scales + 2 * (lane >> 1))};
    }
    static constexpr bool BOOK16 = KIND == 2;
    template <bool SPLIT = false>
    static __device__ __forceinline__ Chunk decode(const Raw& r, u32) {
        Chunk c;
        const float d = f16_low(r.dm);
        if constexpr (KIND == 2) {
            codebook16_codes<Iq4Book, SPLIT>(r.codes, c);
        } else {
            nibble_codes(r.codes, c.q);
        }
        c.scale = d;
        c.offset = KIND == 0 ? -8.0f * d : KIND == 1 ? f16_high(r.dm) : 0.0f;
        return c;
    }
};
typedef FmtNibble32<0> FmtQ4_0;
typedef FmtNibble32<1> FmtQ4_1;
typedef FmtNibble32<2> FmtIQ4_NL;

// 5-bit formats with 32-value blocks: low nibbles as Q4, the fifth bits in a 2-byte-per-lane
// plane; value = d * (q - 16) (Q5_0) or d * q + m (Q5_1).
template <bool WITH_MIN>
struct FmtQ5 {
    static constexpr u32 CODE_BYTES = 8, EXTRA_BYTES = 2, SCALE_BYTES = WITH_MIN ? 64 : 32;
    static constexpr float OFFSET_PER_SCALE = WITH_MIN ? 0.0f : -16.0f;
    struct Raw {
        uint2 codes;
        u32 high;
        u32 dm;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        const u8* scales = tile_scales<FmtQ5>(p, tile);
        return {ld_weight_u64(lane_bytes(p.codes, tile, lane, CODE_BYTES)),
                ld_weight_u16(lane_bytes(p.extra, tile, lane, EXTRA_BYTES)),
                WITH_MIN ? ld_weight_u32(scales + 4 * (lane >> 1)) : ld_weight_u16(scales + 2 * (lane >> 1))};
    }
    static __device__ __forceinline__ Chunk decode(const Raw& r, u32) {
        Chunk c;
        nibble_codes(r.codes, c.q);
        add_bit_plane<4>(r.high, c.q);
        c.scale = f16_low(r.dm);
        c.offset = WITH_MIN ? f16_high(r.dm) : -16.0f * c.scale;
        return c;
    }
};
typedef FmtQ5<false> FmtQ5_0;
typedef FmtQ5<true> FmtQ5_1;

// The grouped layouts (repack.rs): 16-byte groups of CHUNKS = 8 / BITS chunks under one scale;
// byte j of a group holds code j of chunk k in bits BITS k .. BITS k + BITS - 1.
template <int BITS_>
struct CodeGroup {
    static constexpr int BITS = BITS_;
    static constexpr u32 CHUNKS = 8 / BITS;
    static_assert(BITS == 1 || BITS == 2, "code groups hold 1- or 2-bit codes");
    static constexpr u32 MASK = BITS == 1 ? 0x01010101u : 0x03030303u;
    // The group holding chunk `lane` of `tile`.
    static __device__ __forceinline__ uint4 fetch(const Planes& p, u64 tile, u32 lane) {
        return ld_weight_u128(lane_bytes(p.codes, tile, lane - lane % CHUNKS, 2 * BITS));
    }
    // Chunk k's codes in dp4a order.
    static __device__ __forceinline__ void codes(const uint4& g, u32 k, int (&q)[4]) {
        q[0] = (g.x >> (BITS * k)) & MASK;
        q[1] = (g.y >> (BITS * k)) & MASK;
        q[2] = (g.z >> (BITS * k)) & MASK;
        q[3] = (g.w >> (BITS * k)) & MASK;
    }
};

// A grouped format: Raw is the group and its f16 scale word; value = d * (MUL code + BIAS).
template <int BITS, int MUL, int BIAS, int SCALE_BYTES_, int LANES_PER_SCALE>
struct FmtGrouped {
    typedef CodeGroup<BITS> Group;
    static constexpr u32 CODE_BYTES = 2 * BITS, EXTRA_BYTES = 0, SCALE_BYTES = SCALE_BYTES_;
    struct Raw {
        uint4 codes;
        u32 d;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        return {Group::fetch(p, tile, lane), ld_weight_u16(tile_scales<FmtGrouped>(p, tile) + 2 * (lane / LANES_PER_SCALE))};
    }
    // (scale, offset) of every value of the group.
    static __device__ __forceinline__ float2 scale_offset(const Raw& r) {
        const float d = f16_low(r.d);
        return make_float2((float)MUL * d, (float)BIAS * d);
    }
    static __device__ __forceinline__ Chunk decode(const Raw& r, u32 lane) {
        Chunk c;
        Group::codes(r.codes, lane % Group::CHUNKS, c.q);
        const float2 so = scale_offset(r);
        c.scale = so.x;
        c.offset = so.y;
        return c;
    }
};

template <class F>
struct IsGrouped {
    static constexpr bool value = false;
};
template <int BITS, int MUL, int BIAS, int SCALE_BYTES_, int LANES_PER_SCALE>
struct IsGrouped<FmtGrouped<BITS, MUL, BIAS, SCALE_BYTES_, LANES_PER_SCALE>> {
    static constexpr bool value = true;
};

// Q1_0: 1-bit signs, 128-value blocks (4 per tile): value = d * (2 bit - 1).
typedef FmtGrouped<1, 2, -1, 8, 8> FmtQ1_0;
// Ternary TQ2_0 (and TQ1_0, repacked to it): codes t + 1, 256-value super-blocks (2 per tile).
typedef FmtGrouped<2, 1, -1, 4, 16> FmtTQ2_0;
// Q2_0: codes q + 1, 64-value blocks (8 per tile): value = d * (code - 1).
typedef FmtGrouped<2, 1, -1, 16, 4> FmtQ2_0;

// The 256-value formats: two super-blocks per tile, lanes 0..15 in the first, 16..31 in the
// second; lane l's chunk is 16-value sub-block l % 16 of super-block l / 16.

// Q2_K: tile scales = scales[16] of both super-blocks (32 B), then (d, dmin) of both (8 B).
// value = d * (sc & 15) * q - dmin * (sc >> 4).
struct FmtQ2_K {
    static constexpr u32 CODE_BYTES = 4, EXTRA_BYTES = 0, SCALE_BYTES = 40;
    struct Raw {
        u32 codes;
        u32 sc;
        u32 dm;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        const u8* scales = tile_scales<FmtQ2_K>(p, tile);
        return {ld_weight_u32(lane_bytes(p.codes, tile, lane, CODE_BYTES)), ld_weight_u8(scales + lane),
                ld_weight_u32(scales + 32 + 4 * (lane >> 4))};
    }
    static __device__ __forceinline__ Chunk decode(const Raw& r, u32) {
        Chunk c;
        crumb_codes(r.codes, c.q);
        c.scale = f16_low(r.dm) * (float)(r.sc & 0xf);
        c.offset = -(f16_high(r.dm) * (float)(r.sc >> 4));
        return c;
    }
};

// Q3_K: codes = low 2 bits + 4 * high bit (0..7); tile scales = the 12 packed scale bytes of
// both super-blocks (24 B), then d of both (4 B). value = d * (sc - 32) * (code - 4).
struct FmtQ3_K {
    static constexpr u32 CODE_BYTES = 4, EXTRA_BYTES = 2, SCALE_BYTES = 28;
    static constexpr float OFFSET_PER_SCALE = -4.0f;
    struct Raw {
        u32 codes;
        u32 high;
        u32 low_byte;
        u32 high_byte;
        u32 d;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        const u8* scales = tile_scales<FmtQ3_K>(p, tile) + 12 * (lane >> 4);
        const u32 j = lane & 15;
        return {ld_weight_u32(lane_bytes(p.codes, tile, lane, CODE_BYTES)),
                ld_weight_u16(lane_bytes(p.extra, tile, lane, EXTRA_BYTES)), ld_weight_u8(scales + (j & 7)),
                ld_weight_u8(scales + 8 + (j & 3)), ld_weight_u16(tile_scales<FmtQ3_K>(p, tile) + 24 + 2 * (lane >> 4))};
    }
    static __device__ __forceinline__ Chunk decode(const Raw& r, u32 lane) {
        Chunk c;
        crumb_codes(r.codes, c.q);
        add_bit_plane<2>(r.high, c.q);
        const u32 j = lane & 15;
        // Low nibble of scales[j] for j < 8, high nibble of scales[j - 8] above; the top two
        // bits come from scales[8 + j % 4] at bit 2 * (j / 4).
        const u32 sc = ((r.low_byte >> (4 * (j >> 3))) & 0xf) | (((r.high_byte >> (2 * (j >> 2))) & 3) << 4);
        c.scale = f16_low(r.d) * (float)((int)sc - 32);
        c.offset = -4.0f * c.scale;
        return c;
    }
};

// Q4_K / Q5_K header (d, dmin, 12 packed scale bytes): the 6-bit scale and min of 32-value
// sub-block j (ggml's get_scale_min_k4) without a branch: j < 4 takes the low six bits of
// bytes j and j + 4; j >= 4 the nibbles of byte j + 4 and the top two bits of bytes j - 4 and j.
// Each comes out as the float bits of 2^23 + value, so one subtraction converts it exactly.
__device__ __forceinline__ void k4_scale_min(const uint4& head, u32 j, float& scale, float& offset) {
    const u32 shift = 8 * (j & 3);
    const bool low = j < 4;
    const u32 a = head.y >> shift;  // scales[j % 4] in bits 0..7
    const u32 b = head.z >> shift;  // scales[j % 4 + 4]
    const u32 e = head.w >> shift;  // scales[j % 4 + 8]
    const u32 keep = low ? 0x3fu : 0x0fu;
    const u32 top = low ? 0x4b000000u : 0x4b000030u;  // bits 4, 5 from a / b's top bits (j >= 4)
    const u32 sc = ((low ? a : e) & keep) | (((a >> 2) | 0x4b000000u) & top);
    const u32 m = ((low ? b : e >> 4) & keep) | (((b >> 2) | 0x4b000000u) & top);
    scale = f16_low(head.x) * (__uint_as_float(sc) - 8388608.0f);
    offset = -(f16_high(head.x) * (__uint_as_float(m) - 8388608.0f));
}

// The same with a branch on j < 4: the tiles of the exact mat-mat decode, capped at 128
// registers, spill less with it (Q5_K's streaming tile 64 -> 144 bytes with the selects).
__device__ __forceinline__ void k4_scale_min_branched(const uint4& head, u32 j, float& scale, float& offset) {
    const u32 jj = j & 3;
    const u32 a = byte_of(head.y, jj);  // scales[jj]
    const u32 b = byte_of(head.z, jj);  // scales[jj + 4]
    const u32 e = byte_of(head.w, jj);  // scales[jj + 8]
    u32 sc, m;
    if (j < 4) {
        sc = a & 63;
        m = b & 63;
    } else {
        sc = (e & 0xf) | ((a >> 6) << 4);
        m = (e >> 4) | ((b >> 6) << 4);
    }
    scale = f16_low(head.x) * (float)sc;
    offset = -(f16_high(head.x) * (float)m);
}

// Q4_K / Q5_K: tile scales = the 16-byte headers of both super-blocks; lane l's chunk is half
// of 32-value sub-block (l % 16) / 2. value = d * sc * q - dmin * m.
template <bool FIVE_BITS>
struct FmtQ45_K {
    static constexpr u32 CODE_BYTES = 8, EXTRA_BYTES = FIVE_BITS ? 2 : 0, SCALE_BYTES = 32;
    static constexpr bool SCALE_PER_32 = true;
    struct Raw {
        uint2 codes;
        u32 high;
        uint4 head;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        return {ld_weight_u64(lane_bytes(p.codes, tile, lane, CODE_BYTES)),
                FIVE_BITS ? ld_weight_u16(lane_bytes(p.extra, tile, lane, 2)) : 0u,
                ld_weight_u128(tile_scales<FmtQ45_K>(p, tile) + 16 * (lane >> 4))};
    }
    static constexpr bool MATVEC_DECODE = true;
    template <bool MATVEC = false>
    static __device__ __forceinline__ Chunk decode(const Raw& r, u32 lane) {
        Chunk c;
        nibble_codes(r.codes, c.q);
        if (FIVE_BITS) {
            add_bit_plane<4>(r.high, c.q);
        }
        if constexpr (MATVEC) {
            k4_scale_min(r.head, (lane & 15) >> 1, c.scale, c.offset);
        } else {
            k4_scale_min_branched(r.head, (lane & 15) >> 1, c.scale, c.offset);
        }
        return c;
    }
};
typedef FmtQ45_K<false> FmtQ4_K;
typedef FmtQ45_K<true> FmtQ5_K;

// Q6_K: low nibbles as Q4, top two bits in a 4-byte-per-lane plane (layout of crumb_codes);
// tile scales = int8 scales[16] of both super-blocks (32 B), then d of both (4 B).
// value = d * sc * (code - 32).
struct FmtQ6_K {
    static constexpr u32 CODE_BYTES = 8, EXTRA_BYTES = 4, SCALE_BYTES = 36;
    static constexpr float OFFSET_PER_SCALE = -32.0f;
    struct Raw {
        uint2 codes;
        u32 high;
        u32 sc;
        u32 d;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        const u8* scales = tile_scales<FmtQ6_K>(p, tile);
        return {ld_weight_u64(lane_bytes(p.codes, tile, lane, CODE_BYTES)),
                ld_weight_u32(lane_bytes(p.extra, tile, lane, EXTRA_BYTES)), ld_weight_u8(scales + lane),
                ld_weight_u16(scales + 32 + 2 * (lane >> 4))};
    }
    static __device__ __forceinline__ Chunk decode(const Raw& r, u32) {
        Chunk c;
        nibble_codes(r.codes, c.q);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            c.q[k] |= ((r.high >> (2 * k)) & 0x03030303) << 4;
        }
        c.scale = f16_low(r.d) * (float)(int)(i8)(u8)r.sc;
        c.offset = -32.0f * c.scale;
        return c;
    }
};

// IQ4_XS: codebook nibbles as IQ4_NL; tile scales = the 8-byte headers (d, scales_h,
// scales_l[4]) of both super-blocks. value = d * (ls - 32) * codebook[q] for 32-value group g.
struct FmtIQ4_XS {
    static constexpr u32 CODE_BYTES = 8, EXTRA_BYTES = 0, SCALE_BYTES = 16;
    static constexpr bool NO_OFFSET = true, SCALE_PER_32 = true;
    struct Raw {
        uint2 codes;
        uint2 head;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        return {ld_weight_u64(lane_bytes(p.codes, tile, lane, CODE_BYTES)),
                ld_weight_u64(tile_scales<FmtIQ4_XS>(p, tile) + 8 * (lane >> 4))};
    }
    static constexpr bool BOOK16 = true;
    template <bool SPLIT = false>
    static __device__ __forceinline__ Chunk decode(const Raw& r, u32 lane) {
        Chunk c;
        codebook16_codes<Iq4Book, SPLIT>(r.codes, c);
        const u32 g = (lane & 15) >> 1;
        const u32 ls = ((r.head.y >> (4 * g)) & 0xf) | (((r.head.x >> (16 + 2 * g)) & 3) << 4);
        c.scale = f16_low(r.head.x) * (float)((int)ls - 32);
        c.offset = 0.0f;
        return c;
    }
};

// MXFP4: 32-value blocks (16 per tile, lane reads block lane/2); tile scales = the E8M0 byte
// of each block. value = 2^(e - 128) * code (exactly: subnormal for e < 2).
struct FmtMXFP4 {
    static constexpr u32 CODE_BYTES = 8, EXTRA_BYTES = 0, SCALE_BYTES = 16;
    static constexpr bool NO_OFFSET = true, SCALE_PER_32 = true;
    struct Raw {
        uint2 codes;
        u32 e;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        return {ld_weight_u64(lane_bytes(p.codes, tile, lane, CODE_BYTES)),
                ld_weight_u8(tile_scales<FmtMXFP4>(p, tile) + (lane >> 1))};
    }
    static constexpr bool BOOK16 = true;
    template <bool SPLIT = false>
    static __device__ __forceinline__ Chunk decode(const Raw& r, u32) {
        Chunk c;
        codebook16_codes<E2m1Book, SPLIT>(r.codes, c);
        c.scale = __uint_as_float(r.e < 2 ? 0x00200000u << r.e : (r.e - 1) << 23);
        c.offset = 0.0f;
        return c;
    }
};

// NVFP4: 64-value blocks of four 16-value groups, so lane l's chunk is group l % 4 of block
// l / 4 and its UE4M3 scale byte is tile scale byte l. value = ue4m3(byte) / 2 * code.
struct FmtNVFP4 {
    static constexpr u32 CODE_BYTES = 8, EXTRA_BYTES = 0, SCALE_BYTES = 32;
    static constexpr bool NO_OFFSET = true;
    struct Raw {
        uint2 codes;
        u32 d;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        return {ld_weight_u64(lane_bytes(p.codes, tile, lane, CODE_BYTES)),
                ld_weight_u8(tile_scales<FmtNVFP4>(p, tile) + lane)};
    }
    static constexpr bool BOOK16 = true;
    template <bool SPLIT = false>
    static __device__ __forceinline__ Chunk decode(const Raw& r, u32) {
        Chunk c;
        codebook16_codes<E2m1Book, SPLIT>(r.codes, c);
        const u32 exponent = (r.d >> 3) & 0xf, mantissa = r.d & 7;
        // Half of (1 + m/8) 2^(e-7), or of m 2^-9 for e = 0; bytes 0x00 and 0x7f read as zero.
        const float half = exponent == 0 ? (float)mantissa * 9.765625e-4f : __uint_as_float(((exponent + 119) << 23) | (mantissa << 20));
        c.scale = (r.d == 0 || r.d == 0x7f) ? 0.0f : half;
        c.offset = 0.0f;
        return c;
    }
};

// ---- The codebook formats, expanded at upload (see repack.rs) ----
// Codes are indices into a small signed codebook: 2 low bits in the codes plane (crumb layout)
// plus a third in the extra plane, or 4 bits (nibble layout). 256-value super-blocks, two per
// tile; lane l's chunk is 16-value sub-block j = l % 16 of super-block sb = l / 16.

// 3-bit codebook indices to signed bytes. The planes are stored in prmt selector order
// (repack.rs, `selector_order`): bits 16 (k / 2) + 4 b + 2 (k % 2) of `codes` hold the low two
// bits of value 4k + b, bit 4 b + k of `high` its third, so the selector of values 4k..4k+3 is
// a shift and two masks away, with bit 3 of every nibble clear (no sign replication).
__device__ __forceinline__ void book3_codes(u32 codes, u32 high, u32 levels0, u32 levels1, int (&q)[4]) {
    const u32 high_at_bit2[4] = {high << 2, high << 1, high, high >> 1};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const u32 low = (codes >> (16 * (k / 2) + 2 * (k % 2))) & 0x3333u;
        q[k] = (int)prmt(levels0, levels1, low | (high_at_bit2[k] & 0x4444u));
    }
}

// IQ2_XXS / IQ2_XS / IQ2_S: codebook +-8, 25, 43. Tile scales = d of both super-blocks (4 B),
// then IQ2_XXS: for each 32-value group g the byte whose high nibble is its scale, both
// super-blocks side by side (16 B); IQ2_XS / IQ2_S: scales[8] of each super-block (nibble
// per 16 values). value = d * (0.5 + s) * 0.25 * code.
template <bool PER_32>
struct FmtIQ2 {
    static constexpr u32 CODE_BYTES = 4, EXTRA_BYTES = 2, SCALE_BYTES = 20;
    static constexpr bool NO_OFFSET = true, SCALE_PER_32 = PER_32;
    struct Raw {
        u32 codes;
        u32 high;
        u32 d;
        u32 sc;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        const u8* scales = tile_scales<FmtIQ2>(p, tile);
        const u32 sb = lane >> 4, j = lane & 15;
        return {ld_weight_u32(lane_bytes(p.codes, tile, lane, CODE_BYTES)),
                ld_weight_u16(lane_bytes(p.extra, tile, lane, EXTRA_BYTES)), ld_weight_u16(scales + 2 * sb),
                ld_weight_u8(scales + 4 + (PER_32 ? 2 * (j >> 1) + sb : 8 * sb + (j >> 1)))};
    }
    static __device__ __forceinline__ Chunk decode(const Raw& r, u32 lane) {
        Chunk c;
        book3_codes(r.codes, r.high, 0x002b1908u, 0x00d5e7f8u, c.q);
        const u32 s = PER_32 ? r.sc >> 4 : (r.sc >> (4 * (lane & 1))) & 0xf;
        c.scale = f16_low(r.d) * (0.5f + (float)s) * 0.25f;
        c.offset = 0.0f;
        return c;
    }
};
typedef FmtIQ2<true> FmtIQ2_XXS;
typedef FmtIQ2<false> FmtIQ2_XS;
typedef FmtIQ2<false> FmtIQ2_S;

// IQ3_XXS / IQ3_S: 4-bit codes; tile scales = d of both super-blocks, then IQ3_XXS: the byte
// whose high nibble is group g's scale, both super-blocks side by side; IQ3_S: scales[4] of each
// (nibble per 32 values).
template <bool XXS>
struct Iq3Planes {
    static constexpr u32 CODE_BYTES = 8, EXTRA_BYTES = 0, SCALE_BYTES = XXS ? 20 : 12;
    static constexpr bool SCALE_PER_32 = true;
    struct Raw {
        uint2 codes;
        u32 d;
        u32 sc;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        const u8* scales = tile_scales<Iq3Planes>(p, tile);
        const u32 sb = lane >> 4, g = (lane & 15) >> 1;
        return {ld_weight_u64(lane_bytes(p.codes, tile, lane, CODE_BYTES)), ld_weight_u16(scales + 2 * sb),
                ld_weight_u8(scales + 4 + (XXS ? 2 * g + sb : 4 * sb + (g >> 1)))};
    }
};

// IQ3_XXS: indices into the codebook +-4, 12, .., 52, 62; value = d * (0.5 + s) * 0.5 * code.
struct FmtIQ3_XXS : Iq3Planes<true> {
    static constexpr bool NO_OFFSET = true, BOOK16 = true;
    template <bool SPLIT = false>
    static __device__ __forceinline__ Chunk decode(const Raw& r, u32) {
        Chunk c;
        codebook16_codes<Iq3xxsBook, SPLIT>(r.codes, c);
        c.scale = f16_low(r.d) * (0.5f + (float)(r.sc >> 4)) * 0.5f;
        c.offset = 0.0f;
        return c;
    }
};

// IQ3_S: its values, the odd numbers -15..15, stored as u = (value + 15) / 2 in Q4_0's nibble
// layout, so they decode with two masks a word and no lookup: value = d (1 + 2 s) (2 u - 15).
struct FmtIQ3_S : Iq3Planes<false> {
    static constexpr float OFFSET_PER_SCALE = -7.5f;
    static __device__ __forceinline__ Chunk decode(const Raw& r, u32 lane) {
        Chunk c;
        nibble_codes(r.codes, c.q);
        c.scale = 2.0f * f16_low(r.d) * (float)(1 + 2 * ((r.sc >> (4 * ((lane >> 1) & 1))) & 0xf));
        c.offset = OFFSET_PER_SCALE * c.scale;
        return c;
    }
};

// IQ1_S / IQ1_M: codebook of 8 (grid + delta) = -7 1 9 _ | -9 -1 7 _ (index = grid + 1, plus 4
// for a negative delta). IQ1_S: tile scales = d of both super-blocks (4 B), then qh[8] (u16
// each) of each, the 3-bit scale of 32-value group g in bits 12..14 of qh[g]. IQ1_M: tile
// scales = the four u16 scale words of each super-block: 3-bit scales per 16 values in their
// low 12 bits, the f16 d in their top nibbles. value = d (2 s + 1) / 8 * code.
template <bool M>
struct FmtIQ1 {
    static constexpr u32 CODE_BYTES = 4, EXTRA_BYTES = 2, SCALE_BYTES = M ? 16 : 36;
    static constexpr bool NO_OFFSET = true, SCALE_PER_32 = !M;
    struct Raw {
        u32 codes;
        u32 high;
        uint2 sc;  // IQ1_S: (d, qh[g]); IQ1_M: the four scale words
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        const u8* scales = tile_scales<FmtIQ1>(p, tile);
        const u32 sb = lane >> 4, g = (lane & 15) >> 1;
        const uint2 sc = M ? ld_weight_u64(scales + 8 * sb)
                           : make_uint2(ld_weight_u16(scales + 2 * sb), ld_weight_u16(scales + 4 + 16 * sb + 2 * g));
        return {ld_weight_u32(lane_bytes(p.codes, tile, lane, CODE_BYTES)),
                ld_weight_u16(lane_bytes(p.extra, tile, lane, EXTRA_BYTES)), sc};
    }
    static __device__ __forceinline__ Chunk decode(const Raw& r, u32 lane) {
        Chunk c;
        book3_codes(r.codes, r.high, 0x000901f9u, 0x0007fff7u, c.q);
        float d;
        u32 s;
        if (M) {
            const u32 w0 = r.sc.x & 0xffff, w1 = r.sc.x >> 16, w2 = r.sc.y & 0xffff, w3 = r.sc.y >> 16;
            d = f16_bits_to_f32((u16)((w0 >> 12) | ((w1 >> 8) & 0x00f0) | ((w2 >> 4) & 0x0f00) | (w3 & 0xf000)));
            const u32 g = (lane & 15) >> 1;
            const u32 pair = g >> 1;
            const u32 word = pair == 0 ? w0 : pair == 1 ? w1 : pair == 2 ? w2 : w3;
            s = (word >> (6 * (g & 1) + 3 * (lane & 1))) & 7;
        } else {
            d = f16_low(r.sc.x);
            s = (r.sc.y >> 12) & 7;
        }
        c.scale = d * (float)(2 * s + 1) * 0.125f;
        c.offset = 0.0f;
        return c;
    }
};
typedef FmtIQ1<false> FmtIQ1_S;
typedef FmtIQ1<true> FmtIQ1_M;

// ---- Chunks as f32 values (mat-mat and embedding kernels) ----

// A quantized weight seen as rows of 16-value chunks.
template <class F>
struct QuantRows {
    Planes p;
    __device__ __forceinline__ u32 chunks_per_row() const { return p.tiles * 32; }
    __device__ __forceinline__ void values(u32 row, u32 chunk, float (&w)[16]) const {
        const u32 lane = chunk & 31;
        const Chunk c = F::decode(F::fetch(p, (u64)row * p.tiles + (chunk >> 5), lane), lane);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const float code = (float)(int)(i8)(u8)((u32)c.q[i / 4] >> (8 * (i % 4)));
            w[i] = fmaf(c.scale, code, c.offset);
        }
    }
};

// Plain float rows of `stride` elements (a multiple of 16, zero-padded past the row length).
// KIND 0: f32, 1: f16, 2: bf16.
template <int KIND>
struct FloatRows {
    const u8* data;
    u32 stride;
    static constexpr u32 ELEMENT_BYTES = KIND == 0 ? 4 : 2;
    __device__ __forceinline__ u32 chunks_per_row() const { return stride / CHUNK_VALUES; }
    // Four consecutive values starting at `first` (a multiple of 4) of row `row`.
    static __device__ __forceinline__ float4 expand(uint4 raw4) {
        return make_float4(__uint_as_float(raw4.x), __uint_as_float(raw4.y), __uint_as_float(raw4.z),
                           __uint_as_float(raw4.w));
    }
    static __device__ __forceinline__ float4 expand(uint2 raw2) {
        if (KIND == 1) {
            return make_float4(f16_low(raw2.x), f16_high(raw2.x), f16_low(raw2.y), f16_high(raw2.y));
        }
        return make_float4(__uint_as_float(raw2.x << 16), __uint_as_float(raw2.x & 0xffff0000u),
                           __uint_as_float(raw2.y << 16), __uint_as_float(raw2.y & 0xffff0000u));
    }
    __device__ __forceinline__ const u8* at(u32 row, u32 column) const {
        return data + ((u64)row * stride + column) * ELEMENT_BYTES;
    }
    __device__ __forceinline__ float4 load4(u32 row, u32 column) const {
        if (KIND == 0) {
            return expand(ld_weight_u128(at(row, column)));
        }
        return expand(ld_weight_u64(at(row, column)));
    }
    // Eight consecutive values starting at `first` (a multiple of 8): RAW8 16-byte loads.
    static constexpr int RAW8 = KIND == 0 ? 2 : 1;
    __device__ __forceinline__ void load8(u32 row, u32 first, uint4 (&raw)[RAW8]) const {
#pragma unroll
        for (int i = 0; i < RAW8; ++i) {
            raw[i] = ld_weight_u128(at(row, first + 4 * i));
        }
    }
    static __device__ __forceinline__ void expand8(const uint4 (&raw)[RAW8], float (&v)[8]) {
        if (KIND == 0) {
#pragma unroll
            for (int i = 0; i < RAW8; ++i) {
                const float4 f = expand(raw[i]);
                v[4 * i] = f.x;
                v[4 * i + 1] = f.y;
                v[4 * i + 2] = f.z;
                v[4 * i + 3] = f.w;
            }
        } else {
            const float4 lo = expand(make_uint2(raw[0].x, raw[0].y));
            const float4 hi = expand(make_uint2(raw[0].z, raw[0].w));
            v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w;
            v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
        }
    }
    __device__ __forceinline__ void values(u32 row, u32 chunk, float (&w)[16]) const {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float4 v = load4(row, chunk * CHUNK_VALUES + 4 * i);
            w[4 * i] = v.x;
            w[4 * i + 1] = v.y;
            w[4 * i + 2] = v.z;
            w[4 * i + 3] = v.w;
        }
    }
};
