// Loads of weight bytes and the bit manipulations and codebook lookups that turn them into
// dp4a-ready codes (quant.cuh's formats are built from these).
#pragma once
#include "common.cuh"

// ---- Loads ----

// Weights are read once per launch: they skip L1 so the activations stay cached there, and
// ask L2 to fetch whole 256-byte segments since neighbouring lanes read the rest.
__device__ __forceinline__ uint4 ld_weight_u128(const u8* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ uint2 ld_weight_u64(const u8* p) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

__device__ __forceinline__ u32 ld_weight_u32(const u8* p) {
    u32 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ u32 ld_weight_u16(const u8* p) {
    u16 v;
    asm("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ u32 ld_weight_u8(const u8* p) {
    u16 v;
    asm("ld.global.nc.L1::no_allocate.u8 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

// ---- Code words ----

// Byte `b` of word `a` (b = 0..3), or of `b_word` for b = 4..7, per selector nibble; a nibble
// with bit 3 set replicates the sign bit of the byte it selects.
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 selector) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
    return r;
}

// 8 bytes of packed nibbles: byte j holds value (j/4)*8 + j%4 (low) and (j/4)*8 + 4 + j%4 (high),
// so that masking gives the four code words in value order.
__device__ __forceinline__ void nibble_codes(uint2 w, int (&q)[4]) {
    q[0] = w.x & 0x0f0f0f0f;
    q[1] = (w.x >> 4) & 0x0f0f0f0f;
    q[2] = w.y & 0x0f0f0f0f;
    q[3] = (w.y >> 4) & 0x0f0f0f0f;
}

// 4 bytes of 2-bit codes: bits 2k..2k+1 of byte b hold value 4k + b.
__device__ __forceinline__ void crumb_codes(u32 w, int (&q)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        q[k] = (w >> (2 * k)) & 0x03030303;
    }
}

// Four bits (value 4k+b at bit b) spread to bit SHIFT of bytes 0..3. The multiplier places copy
// i of the nibble 7i+SHIFT bits up; the 16 product bits land on distinct positions, so nothing
// carries, and the mask keeps bit b of copy b.
template <int SHIFT>
__device__ __forceinline__ u32 spread_bits(u32 nibble) {
    return (nibble * (0x00204081u << SHIFT)) & (0x01010101u << SHIFT);
}

// Adds bit i of `bits` (16 bits, value order) as bit SHIFT of code i.
template <int SHIFT>
__device__ __forceinline__ void add_bit_plane(u32 bits, int (&q)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        q[k] |= spread_bits<SHIFT>((bits >> (4 * k)) & 0xf);
    }
}

// Maps the eight 4-bit indices of a word (value order, nibble n = value n; repack.rs stores the
// codebook formats so) through a 16-entry codebook of signed bytes, given as four words of four
// entries (entry 4k + b in byte b of word k): `first` gets values 0..3, `second` values 4..7.
// Each prmt looks four indices up in eight entries; a third picks, per index, the half its bit 3
// names: 1.5 instructions a value.
__device__ __forceinline__ void codebook16_word(u32 indices, u32 levels0, u32 levels1, u32 levels2, u32 levels3,
                                                int& first, int& second) {
    const u32 low3 = indices & 0x77777777u;  // no selector msb: prmt would sign-replicate
    const u32 half_of_each = 0x32103210u | ((indices >> 1) & 0x44444444u);
    u32 looked_up[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 selector = low3 >> (16 * h);
        looked_up[h] = prmt(prmt(levels0, levels1, selector), prmt(levels2, levels3, selector), half_of_each >> (16 * h));
    }
    first = (int)looked_up[0];
    second = (int)looked_up[1];
}

// A 16-entry codebook of signed bytes: entry 4k + b in byte b of word w[k].
struct Book16 {
    u32 w[4];
};

// The codebook as two 8-entry halves A and B for the mat-vec's dot products, which add what two
// lookups give: prmt with a selector nibble of bit 3 set yields the sign (0 or -1) of the byte
// it names, so the indices looked up in A give A[q] for q < 8 and sign(A[q - 8]) above, and with
// bit 3 flipped in B give B[q - 8] for q >= 8 and sign(B[q]) below. A[i] = T[i] - sign(B[i]) and
// B[i] = T[i + 8] - sign(A[i]) make each pair add up to T[q]; split_book finds them.
struct SplitBook {
    u32 a0, a1, b0, b1;
};

constexpr int book_entry(const Book16& t, int i) {
    return (int)((t.w[i / 4] >> (8 * (i % 4))) & 0xff) - (((t.w[i / 4] >> (8 * (i % 4))) & 0x80) ? 256 : 0);
}

constexpr int sign_of(int v) {
    return v < 0 ? -1 : 0;
}

constexpr SplitBook split_book(const Book16& t) {
    int a[8] = {}, b[8] = {};
    for (int i = 0; i < 8; ++i) {
        a[i] = book_entry(t, i);
    }
    for (int round = 0; round < 2; ++round) {
        for (int i = 0; i < 8; ++i) {
            b[i] = book_entry(t, i + 8) - sign_of(a[i]);
        }
        for (int i = 0; i < 8; ++i) {
            a[i] = book_entry(t, i) - sign_of(b[i]);
        }
    }
    SplitBook s = {0, 0, 0, 0};
    for (int i = 0; i < 8; ++i) {
        const u32 a_byte = (u32)(a[i] & 0xff) << (8 * (i % 4)), b_byte = (u32)(b[i] & 0xff) << (8 * (i % 4));
        (i < 4 ? s.a0 : s.a1) |= a_byte;
        (i < 4 ? s.b0 : s.b1) |= b_byte;
    }
    return s;
}

// Whether the halves, stored as signed bytes, add up to the codebook.
constexpr bool split_book_holds(const Book16& t) {
    const SplitBook s = split_book(t);
    const Book16 a = {{s.a0, s.a1, 0, 0}}, b = {{s.b0, s.b1, 0, 0}};
    for (int i = 0; i < 8; ++i) {
        if (book_entry(a, i) + sign_of(book_entry(b, i)) != book_entry(t, i) ||
            sign_of(book_entry(a, i)) + book_entry(b, i) != book_entry(t, i + 8)) {
            return false;
        }
    }
    return true;
}

// A codebook as a type, so its split is a compile-time constant.
template <u32 W0, u32 W1, u32 W2, u32 W3>
struct Codebook {
    static constexpr Book16 table = {{W0, W1, W2, W3}};
    static constexpr SplitBook split = split_book(table);
    static_assert(split_book_holds(table), "this codebook has no split into two 8-entry lookups");
};

// The IQ4_NL codebook: -127 -104 -83 -65 | -49 -35 -22 -10 | 1 13 25 38 | 53 69 89 113.
typedef Codebook<0xbfad9881u, 0xf6eaddcfu, 0x26190d01u, 0x71594535u> Iq4Book;
// Twice the E2M1 values by 4-bit code: 0 1 2 3 | 4 6 8 12 | 0 -1 -2 -3 | -4 -6 -8 -12.
typedef Codebook<0x03020100u, 0x0c080604u, 0xfdfeff00u, 0xf4f8fafcu> E2m1Book;
// IQ3_XXS: +-4, 12, .., 52, 62.
typedef Codebook<0x1c140c04u, 0x3e342c24u, 0xe4ecf4fcu, 0xc2ccd4dcu> Iq3xxsBook;

// A chunk's 16 indices (value order) through codebook B: with SPLIT, as the lookups in its two
// halves whose dot products add up (c.q and c.q2: one prmt a four values each); else the entries
// themselves (c.q).
// The halves as device memory, read once a step (a 16-byte load from L1): as constants in prmt's
// data operands, which must be registers, ptxas rematerialized them before every lookup (a move
// each, about a seventh of the loop); loaded words it keeps.
template <class B>
__device__ const uint4 split_words = {B::split.a0, B::split.a1, B::split.b0, B::split.b1};

template <class B, bool SPLIT, class C>
__device__ __forceinline__ void codebook16_codes(uint2 w, C& c) {
    if constexpr (SPLIT) {
        const u32 words[2] = {w.x, w.y};
        const uint4 s = __ldg(&split_words<B>);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const u32 flipped = words[k] ^ 0x88888888u;
            c.q[2 * k] = (int)prmt(s.x, s.y, words[k]);
            c.q[2 * k + 1] = (int)prmt(s.x, s.y, words[k] >> 16);
            c.q2[2 * k] = (int)prmt(s.z, s.w, flipped);
            c.q2[2 * k + 1] = (int)prmt(s.z, s.w, flipped >> 16);
        }
    } else {
        codebook16_word(w.x, B::table.w[0], B::table.w[1], B::table.w[2], B::table.w[3], c.q[0], c.q[1]);
        codebook16_word(w.y, B::table.w[0], B::table.w[1], B::table.w[2], B::table.w[3], c.q[2], c.q[3]);
    }
}

__device__ __forceinline__ float f16_low(u32 word) {
    return f16_bits_to_f32((u16)(word & 0xffff));
}

__device__ __forceinline__ float f16_high(u32 word) {
    return f16_bits_to_f32((u16)(word >> 16));
}

// Byte `index` (0..3) of a word.
__device__ __forceinline__ u32 byte_of(u32 word, u32 index) {
    return (word >> (8 * index)) & 0xff;
}
