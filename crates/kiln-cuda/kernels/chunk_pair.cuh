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

// The 8-byte code formats whose pair shares every other field (a pair lies in one 32-value
// group): IQ4_XS (its super-block's head), MXFP4 (the exponent byte), IQ3_XXS / IQ3_S (d and the
// scale byte). The first chunk's fetch supplies those fields; its code load is dead and dropped.
template <class F>
struct CodesPair {
    static constexpr bool WIDE = true;
    struct Raw {
        uint4 codes;
        typename F::Raw first;
    };
    static __device__ __forceinline__ Raw fetch(const Planes& p, u64 tile, u32 lane) {
        return {ld_weight_u128(lane_bytes(p.codes, tile, lane, F::CODE_BYTES)), F::fetch(p, tile, lane)};
    }
    static __device__ __forceinline__ typename F::Raw half(const Raw& r, int i) {
        typename F::Raw h = r.first;
        h.codes = half_of(r.codes, i);
        return h;
    }
};
template <>
struct ChunkPair<FmtIQ4_XS> : CodesPair<FmtIQ4_XS> {};
template <>
struct ChunkPair<FmtMXFP4> : CodesPair<FmtMXFP4> {};
template <>
struct ChunkPair<FmtIQ3_XXS> : CodesPair<FmtIQ3_XXS> {};
template <>
struct ChunkPair<FmtIQ3_S> : CodesPair<FmtIQ3_S> {};

// The same for the 4-byte code formats with a 2-byte extra plane (IQ2_XXS / IQ2_XS / IQ2_S,
// IQ1_S / IQ1_M): the pair's codes and extra bits are loaded together.
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

