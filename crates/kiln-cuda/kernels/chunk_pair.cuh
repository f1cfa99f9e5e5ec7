// Two neighbouring chunks (2u, 2u + 1) of a row, fetched together: for kernels bound by load
// requests per weight byte (the streaming mat-mat, the paired mat-vec). Formats whose per-lane
// planes are 8 or 16 bytes load both lanes' bytes with 16-byte accesses and their shared scale
// fields once (WIDE); every other format fetches the two chunks apart.
#pragma once
#include "quant.cuh"

template <class F>
struct ChunkPair {
    static constexpr bool WIDE = false;
    struct Raw {
        typename F::Raw c[2];
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        return {{F::fetch(p, tile, lane), F::fetch(p, tile, lane + 1)}};
    }
    static __device__ __forceinline__ typename F::Raw half(const Raw& r, int i) { return r.c[i]; }
};

__device__ __forceinline__ uint2 half_of(const uint4& v, int i) {
    return i ? make_uint2(v.z, v.w) : make_uint2(v.x, v.y);
}

template <int KIND>
struct ChunkPair<FmtNibble32<KIND>> {
    static constexpr bool WIDE = true;
    typedef FmtNibble32<KIND> F;
    struct Raw {
        uint4 codes;
        u32 dm;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        const typename F::Raw first = F::fetch(p, tile, lane);  // the pair shares its 32-value block's scale
        return {ld_weight_u128(lane_bytes(p.codes, tile, lane, F::CODE_BYTES)), first.dm};
    }
    static __device__ __forceinline__ typename F::Raw half(const Raw& r, int i) { return {half_of(r.codes, i), r.dm}; }
};

// IQ4_XS and MXFP4: a pair lies in one 256-value super-block (one 32-value block), so it
// shares the head (the exponent byte).
template <>
struct ChunkPair<FmtIQ4_XS> {
    static constexpr bool WIDE = true;
    struct Raw {
        uint4 codes;
        uint2 head;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        const FmtIQ4_XS::Raw first = FmtIQ4_XS::fetch(p, tile, lane);
        return {ld_weight_u128(lane_bytes(p.codes, tile, lane, FmtIQ4_XS::CODE_BYTES)), first.head};
    }
    static __device__ __forceinline__ FmtIQ4_XS::Raw half(const Raw& r, int i) { return {half_of(r.codes, i), r.head}; }
};

template <>
struct ChunkPair<FmtMXFP4> {
    static constexpr bool WIDE = true;
    struct Raw {
        uint4 codes;
        u32 e;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        const FmtMXFP4::Raw first = FmtMXFP4::fetch(p, tile, lane);
        return {ld_weight_u128(lane_bytes(p.codes, tile, lane, FmtMXFP4::CODE_BYTES)), first.e};
    }
    static __device__ __forceinline__ FmtMXFP4::Raw half(const Raw& r, int i) { return {half_of(r.codes, i), r.e}; }
};

// IQ3_XXS / IQ3_S: a pair lies in one 32-value group, so it shares d and the scale byte.
template <bool XXS>
struct ChunkPair<FmtIQ3<XXS>> {
    static constexpr bool WIDE = true;
    typedef FmtIQ3<XXS> F;
    struct Raw {
        uint4 codes;
        u32 d;
        u32 sc;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        const typename F::Raw first = F::fetch(p, tile, lane);
        return {ld_weight_u128(lane_bytes(p.codes, tile, lane, F::CODE_BYTES)), first.d, first.sc};
    }
    static __device__ __forceinline__ typename F::Raw half(const Raw& r, int i) { return {half_of(r.codes, i), r.d, r.sc}; }
};

// The 4-byte code formats with a 2-byte extra plane (IQ2_XXS / IQ2_XS / IQ2_S, IQ1_S / IQ1_M):
// a pair lies in one 32-value group, so it shares the scale fields.
template <class F>
struct CrumbPair {
    static constexpr bool WIDE = true;
    struct Raw {
        uint2 codes;
        u32 high;
        typename F::Raw first;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        return {ld_weight_u64(lane_bytes(p.codes, tile, lane, F::CODE_BYTES)),
                ld_weight_u32(lane_bytes(p.extra, tile, lane, F::EXTRA_BYTES)), F::fetch(p, tile, lane)};
    }
    static __device__ __forceinline__ typename F::Raw half(const Raw& r, int i) {
        typename F::Raw h = r.first;
        h.codes = i ? r.codes.y : r.codes.x;
        h.high = i ? r.high >> 16 : r.high & 0xffff;
        return h;
    }
};
template <bool PER_32>
struct ChunkPair<FmtIQ2<PER_32>> : CrumbPair<FmtIQ2<PER_32>> {};
template <bool M>
struct ChunkPair<FmtIQ1<M>> : CrumbPair<FmtIQ1<M>> {};

template <>
struct ChunkPair<FmtQ8_0> {
    static constexpr bool WIDE = true;
    struct Raw {
        uint4 codes[2];
        u32 d;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        const FmtQ8_0::Raw first = FmtQ8_0::fetch(p, tile, lane);
        return {{first.codes, ld_weight_u128(lane_bytes(p.codes, tile, lane + 1, FmtQ8_0::CODE_BYTES))}, first.d};
    }
    static __device__ __forceinline__ FmtQ8_0::Raw half(const Raw& r, int i) { return {r.codes[i], r.d}; }
};

template <bool FIVE_BITS>
struct ChunkPair<FmtQ45_K<FIVE_BITS>> {
    static constexpr bool WIDE = true;
    typedef FmtQ45_K<FIVE_BITS> F;
    struct Raw {
        uint4 codes;
        u32 high;
        uint4 head;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        return {ld_weight_u128(lane_bytes(p.codes, tile, lane, F::CODE_BYTES)), FIVE_BITS ? ld_weight_u32(lane_bytes(p.extra, tile, lane, 2)) : 0u,
                ld_weight_u128(tile_scales<F>(p, tile) + 16 * (lane >> 4))};
    }
    static __device__ __forceinline__ typename F::Raw half(const Raw& r, int i) {
        return {half_of(r.codes, i), i ? r.high >> 16 : r.high & 0xffff, r.head};
    }
};

template <>
struct ChunkPair<FmtQ6_K> {
    static constexpr bool WIDE = true;
    struct Raw {
        uint4 codes;
        uint2 high;
        u32 sc;
        u32 d;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        const u8* scales = tile_scales<FmtQ6_K>(p, tile);
        return {ld_weight_u128(lane_bytes(p.codes, tile, lane, FmtQ6_K::CODE_BYTES)),
                ld_weight_u64(lane_bytes(p.extra, tile, lane, FmtQ6_K::EXTRA_BYTES)), ld_weight_u16(scales + lane),
                ld_weight_u16(scales + 32 + 2 * (lane >> 4))};
    }
    static __device__ __forceinline__ FmtQ6_K::Raw half(const Raw& r, int i) {
        return {half_of(r.codes, i), i ? r.high.y : r.high.x, i ? r.sc >> 8 : r.sc & 0xff, r.d};
    }
};

