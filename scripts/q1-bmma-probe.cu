// Standalone probe: the 1-bit mat-vec at one token on binary tensor cores (mma .b1 and.popc)
// against kiln's grouped dp4a loop, on the Qwen3-8B shapes. Activations become P bit-planes of
// P-bit integers with one scale per 128 values (the B operand's 8 columns: 8 planes an mma);
// the weights' sign bits are the A operand, so one m16n8k128 takes 16 rows x 128 values, and
// sum_p coef_p popc(w & plane_p) is the integer dot. Prints registers, grid, time cold and
// L2-resident, and the error against a float64 reference. Run on the GPU machine:
//     nvcc -O3 -arch=sm_90 -o /tmp/q1b scripts/q1-bmma-probe.cu && /tmp/q1b
#include "q1-grouped.cuh"

__device__ __forceinline__ void bmma16(int (&d)[4], u32 a0, u32 a1, u32 b) {
    asm("mma.sync.aligned.m16n8k128.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3},{%4,%5},{%6},{%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(b));
}

// Adds each row's partial sums over its quad's four lanes, then over the SPLIT warps sharing
// the tiles, and writes rows row0 .. row0 + 16 TILES - 1.
template <int TILES, int SPLIT>
__device__ __forceinline__ void finish_tiles(float (&acc)[TILES][2], int row0, int rows, float* out) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < TILES; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            acc[i][e] += __shfl_xor_sync(0xffffffffu, acc[i][e], 1);
            acc[i][e] += __shfl_xor_sync(0xffffffffu, acc[i][e], 2);
        }
    if constexpr (SPLIT > 1) {
        __shared__ float part[SPLIT][TILES][16];
        if (t == 0) {
#pragma unroll
            for (int i = 0; i < TILES; ++i) {
                part[warp][i][gid] = acc[i][0];
                part[warp][i][gid + 8] = acc[i][1];
            }
        }
        __syncthreads();
        for (int k = threadIdx.x; k < TILES * 16; k += 32 * SPLIT) {
            float v = 0.0f;
#pragma unroll
            for (int q = 0; q < SPLIT; ++q) v += part[q][k / 16][k % 16];
            if (row0 + k < rows) out[row0 + k] = v;
        }
    } else if (t == 0) {
#pragma unroll
        for (int i = 0; i < TILES; ++i) {
            out[row0 + i * 16 + gid] = acc[i][0];
            out[row0 + i * 16 + gid + 8] = acc[i][1];
        }
    }
}

// 2 coef_p for the planes p = 8 j + 2 t + e whose popcounts lane (g, t) holds: 2^p, and -2^p
// for the sign plane P - 1; doubled because a sign bit c stands for 2 c - 1.
template <int P>
__device__ __forceinline__ void plane_coefs(int t, int (&coef)[P / 8][2]) {
#pragma unroll
    for (int j = 0; j < P / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int p = 8 * j + 2 * t + e;
            coef[j][e] = p == P - 1 ? -(2 << p) : (2 << p);
        }
}

// The B operands (planes 8 j .. 8 j + 7) and (scale, sum / 4) of groups first .. first + N - 1.
template <int P, int N>
__device__ __forceinline__ void load_groups(const u32* __restrict__ planes, const float2* __restrict__ xg, int first,
                                            int lane, u32 (&b)[N][P / 8], float2 (&x)[N]) {
#pragma unroll
    for (int h = 0; h < N; ++h) {
#pragma unroll
        for (int j = 0; j < P / 8; ++j) b[h][j] = __ldg(planes + (size_t)(first + h) * P * 4 + j * 32 + lane);
        x[h] = __ldg(xg + first + h);
    }
}

// acc[0] += row g's dot with one group, acc[1] += row g + 8's (a0, a1: their sign words t),
// each times its weight scale (d0, d1) and the group's activation scale.
template <int P>
__device__ __forceinline__ void tile_group(u32 a0, u32 a1, const u32 (&b)[P / 8], float2 x, float d0, float d1,
                                           const int (&coef)[P / 8][2], float (&acc)[2]) {
    constexpr int J = P / 8;
    int c[J][4];
#pragma unroll
    for (int j = 0; j < J; ++j) {
        c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0;
        bmma16(c[j], a0, a1, b[j]);
    }
    int v0 = 0, v1 = 0;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        v0 += c[j][0] * coef[j][0] + c[j][1] * coef[j][1];
        v1 += c[j][2] * coef[j][0] + c[j][3] * coef[j][1];
    }
    acc[0] = fmaf(d0 * x.x, (float)v0 - x.y, acc[0]);
    acc[1] = fmaf(d1 * x.x, (float)v1 - x.y, acc[1]);
}

// Weights: per 16-row tile and pair of 128-value groups, lane (g = lane / 4, t = lane % 4) holds
// uint4 {word t of row g, of row g + 8: group 2 gp; the same of group 2 gp + 1}; scales
// per tile, pair and g: halves {row g, row g + 8} of group 2 gp, then of 2 gp + 1.
// Activations: planes[(group * P + p) * 4 + t] (bit i: bit p of value 32 t + i), xg[group] =
// (scale, sum of the integers / 4).
template <int P, int TILES, int SPLIT, int AHEAD, bool COMPUTE>
__global__ void __launch_bounds__(32 * SPLIT) bmma_matvec(const uint4* __restrict__ w, const uint2* __restrict__ sc,
                                                         const u32* __restrict__ planes, const float2* __restrict__ xg,
                                                         float* out, int rows, int gps) {
    constexpr int J = P / 8;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, t = lane & 3;
    const int tile0 = blockIdx.x * TILES;
    int coef[J][2];
    plane_coefs<P>(t, coef);
    float acc[TILES][2];
#pragma unroll
    for (int i = 0; i < TILES; ++i) acc[i][0] = acc[i][1] = 0.0f;
    u32 sink = 0;
    for (int gp0 = warp; gp0 < gps; gp0 += SPLIT * AHEAD) {
        uint4 a[AHEAD][TILES];
        uint2 s[AHEAD][TILES];
        u32 b[AHEAD][2][J];
        float2 x[AHEAD][2];
#pragma unroll
        for (int u = 0; u < AHEAD; ++u) {
            const int gp = min(gp0 + u * SPLIT, gps - 1);
#pragma unroll
            for (int i = 0; i < TILES; ++i) {
                const size_t at = (size_t)(tile0 + i) * gps + gp;
                a[u][i] = __ldg(w + at * 32 + lane);
                s[u][i] = __ldg(sc + at * 8 + gid);
            }
            load_groups<P, 2>(planes, xg, 2 * gp, lane, b[u], x[u]);
        }
#pragma unroll
        for (int u = 0; u < AHEAD; ++u) {
            if (gp0 + u * SPLIT >= gps) break;
#pragma unroll
            for (int i = 0; i < TILES; ++i) {
                if constexpr (!COMPUTE) {
                    sink ^= a[u][i].x ^ a[u][i].y ^ a[u][i].z ^ a[u][i].w ^ s[u][i].x ^ s[u][i].y;
                    continue;
                }
                const __half2 d0 = *reinterpret_cast<const __half2*>(&s[u][i].x);
                const __half2 d1 = *reinterpret_cast<const __half2*>(&s[u][i].y);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float2 dd = __half22float2(h ? d1 : d0);
                    tile_group<P>(h ? a[u][i].z : a[u][i].x, h ? a[u][i].w : a[u][i].y, b[u][h], x[u][h], dd.x, dd.y, coef, acc[i]);
                }
            }
        }
        if constexpr (!COMPUTE) {
#pragma unroll
            for (int u = 0; u < AHEAD; ++u)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int j = 0; j < J; ++j) sink ^= b[u][h][j];
        }
    }
    if constexpr (!COMPUTE) {
        if (sink == 0x12345u) out[0] = 1.0f;
        return;
    }
    finish_tiles<TILES, SPLIT>(acc, tile0 * 16, rows, out);
}

// The same on a row-major layout that kiln's grouped mat-mat and embedding could also read:
// per row, tiles of 4 groups (64 bytes) whose bytes 16 t .. 16 t + 15 are word t of groups
// 0..3, so lane (g, t) loads one uint4 of row g and one of row g + 8 a tile, and the scales as
// [row][tile] uint2 (4 halves).
template <int P, int TILES, int SPLIT, int AHEAD>
__global__ void __launch_bounds__(32 * SPLIT) bmma_rowmajor(const uint4* __restrict__ w, const uint2* __restrict__ sc,
                                                           const u32* __restrict__ planes, const float2* __restrict__ xg,
                                                           float* out, int rows, int quads) {
    constexpr int J = P / 8;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * TILES * 16;
    int coef[J][2];
    plane_coefs<P>(t, coef);
    float acc[TILES][2];
#pragma unroll
    for (int i = 0; i < TILES; ++i) acc[i][0] = acc[i][1] = 0.0f;
    for (int q0 = warp; q0 < quads; q0 += SPLIT * AHEAD) {
        uint4 a[AHEAD][TILES][2];
        uint2 s[AHEAD][TILES][2];
        u32 b[AHEAD][4][J];
        float2 x[AHEAD][4];
#pragma unroll
        for (int u = 0; u < AHEAD; ++u) {
            const int q = min(q0 + u * SPLIT, quads - 1);
#pragma unroll
            for (int i = 0; i < TILES; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const size_t at = (size_t)(row0 + i * 16 + gid + 8 * h) * quads + q;
                    a[u][i][h] = __ldg(w + at * 4 + t);
                    s[u][i][h] = __ldg(sc + at);
                }
            load_groups<P, 4>(planes, xg, 4 * q, lane, b[u], x[u]);
        }
#pragma unroll
        for (int u = 0; u < AHEAD; ++u) {
            if (q0 + u * SPLIT >= quads) break;
#pragma unroll
            for (int i = 0; i < TILES; ++i) {
                const u32 w0[4] = {a[u][i][0].x, a[u][i][0].y, a[u][i][0].z, a[u][i][0].w};
                const u32 w1[4] = {a[u][i][1].x, a[u][i][1].y, a[u][i][1].z, a[u][i][1].w};
                const u32 s0[2] = {s[u][i][0].x, s[u][i][0].y};
                const u32 s1[2] = {s[u][i][1].x, s[u][i][1].y};
#pragma unroll
                for (int G = 0; G < 4; ++G) {
                    const float d0 = __half2float(__ushort_as_half((unsigned short)(s0[G / 2] >> (16 * (G % 2)))));
                    const float d1 = __half2float(__ushort_as_half((unsigned short)(s1[G / 2] >> (16 * (G % 2)))));
                    tile_group<P>(w0[G], w1[G], b[u][G], x[u][G], d0, d1, coef, acc[i]);
                }
            }
        }
    }
    finish_tiles<TILES, SPLIT>(acc, row0, rows, out);
}

// kiln's dp4a loop with its split shapes (matvec_grouped's MV_SPLIT): WARPS warps a block in
// groups of SPLIT sharing R rows, a warp taking BATCH lane-steps (32 groups each) then skipping
// the other warps' ones; the sums meet in shared memory.
template <int R, int SPLIT, int BATCH, int WARPS>
__global__ void __launch_bounds__(32 * WARPS) kiln_split(const uint4* codes, const __half* scales, const uint4* xq,
                                                        const float2* xds, float* out, int rows, int groups) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int part = warp % SPLIT, group = warp / SPLIT;
    const int row0 = (blockIdx.x * (WARPS / SPLIT) + group) * R;
    const int steps = (groups + 31) / 32;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    for (int s0 = part * BATCH; s0 < steps; s0 += BATCH * SPLIT) {
        uint4 c[BATCH][R];
        float d[BATCH][R];
#pragma unroll
        for (int b = 0; b < BATCH; ++b) fetch<R>(codes, scales, row0, rows, groups, (s0 + b) * 32 + lane, c[b], d[b]);
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            const int g = (s0 + b) * 32 + lane;
            if (s0 + b < steps && g < groups) group_dot<R>(c[b], d[b], xq, xds, g, acc);
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
    __shared__ float part_sums[WARPS][R];
    if (lane == 0)
#pragma unroll
        for (int r = 0; r < R; ++r) part_sums[warp][r] = acc[r];
    __syncthreads();
    if (part == 0 && lane < R && row0 + lane < rows) {
        float v = 0.0f;
#pragma unroll
        for (int q = 0; q < SPLIT; ++q) v += part_sums[group * SPLIT + q][lane];
        out[row0 + lane] = v;
    }
}

typedef void (*BKernel)(const uint4*, const uint2*, const u32*, const float2*, float*, int, int);

struct BVariant {
    const char* name;
    BKernel k;
    int p, tiles, split;
    bool compute;
    bool rowmajor = false;
};

#define BV(P, T, S, A) {"P" #P " tiles " #T " split " #S " ahead " #A, bmma_matvec<P, T, S, A, true>, P, T, S, true}
#define BR(P, T, S, A) {"rowmajor P" #P " t" #T " s" #S " a" #A, bmma_rowmajor<P, T, S, A>, P, T, S, true, true}
#define BL(P, T, S, A) {"loads P" #P " t" #T " s" #S " a" #A, bmma_matvec<P, T, S, A, false>, P, T, S, false}

static void run_shape(cudaStream_t s, int rows, int cols, const char* what, const std::vector<BVariant>& variants) {
    const int groups = cols / 128, gps = groups / 2, tiles = rows / 16, copies = 12;
    // Logical weights and activations.
    std::vector<u32> bits((size_t)rows * groups * 4);
    std::vector<float> dw((size_t)rows * groups);
    for (auto& v : bits) v = ((u32)rand() << 16) ^ (u32)rand();
    for (auto& v : dw) v = __half2float(__float2half(0.001f * (1 + rand() % 100)));
    const std::vector<int> plane_counts = {8, 16};
    // Packed weights.
    std::vector<uint4> hw((size_t)tiles * gps * 32);
    std::vector<uint2> hs((size_t)tiles * gps * 8);
    for (int tile = 0; tile < tiles; ++tile)
        for (int gp = 0; gp < gps; ++gp) {
            for (int lane = 0; lane < 32; ++lane) {
                const int g = lane / 4, t = lane % 4, r0 = tile * 16 + g, r1 = r0 + 8;
                auto word = [&](int r, int grp) { return bits[((size_t)r * groups + grp) * 4 + t]; };
                hw[((size_t)tile * gps + gp) * 32 + lane] = make_uint4(word(r0, 2 * gp), word(r1, 2 * gp), word(r0, 2 * gp + 1), word(r1, 2 * gp + 1));
            }
            for (int g = 0; g < 8; ++g) {
                const int r0 = tile * 16 + g, r1 = r0 + 8;
                auto pack = [&](float a, float b) {
                    __half2 h = __halves2half2(__float2half(a), __float2half(b));
                    return *reinterpret_cast<u32*>(&h);
                };
                hs[((size_t)tile * gps + gp) * 8 + g] = make_uint2(pack(dw[(size_t)r0 * groups + 2 * gp], dw[(size_t)r1 * groups + 2 * gp]),
                                                                  pack(dw[(size_t)r0 * groups + 2 * gp + 1], dw[(size_t)r1 * groups + 2 * gp + 1]));
            }
        }
    // Row-major tiles of 4 groups, word t of the 4 groups at bytes 16 t.
    const int quads = groups / 4;
    std::vector<uint4> rw((size_t)rows * quads * 4);
    std::vector<uint2> rs((size_t)rows * quads);
    for (int r = 0; r < rows; ++r)
        for (int q = 0; q < quads; ++q) {
            for (int t = 0; t < 4; ++t) {
                auto word = [&](int grp) { return bits[((size_t)r * groups + grp) * 4 + t]; };
                rw[((size_t)r * quads + q) * 4 + t] = make_uint4(word(4 * q), word(4 * q + 1), word(4 * q + 2), word(4 * q + 3));
            }
            auto pack = [&](float a, float b) {
                __half2 h = __halves2half2(__float2half(a), __float2half(b));
                return *reinterpret_cast<u32*>(&h);
            };
            const float* d = &dw[(size_t)r * groups + 4 * q];
            rs[(size_t)r * quads + q] = make_uint2(pack(d[0], d[1]), pack(d[2], d[3]));
        }
    struct Copy {
        uint4* w;
        uint2* s;
        uint4* rw;
        uint2* rs;
    };
    std::vector<Copy> dev(copies);
    for (auto& c : dev) {
        CK(cudaMalloc(&c.w, hw.size() * 16));
        CK(cudaMalloc(&c.s, hs.size() * 8));
        CK(cudaMemcpy(c.w, hw.data(), hw.size() * 16, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(c.s, hs.data(), hs.size() * 8, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&c.rw, rw.size() * 16));
        CK(cudaMalloc(&c.rs, rs.size() * 8));
        CK(cudaMemcpy(c.rw, rw.data(), rw.size() * 16, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(c.rs, rs.data(), rs.size() * 8, cudaMemcpyHostToDevice));
    }
    const double mb = (hw.size() * 16 + hs.size() * 8) / 1e6;
    float* dout;
    CK(cudaMalloc(&dout, rows * 4));
    printf("\n%s, %.1f MB: variant | regs | blocks/SM | grid | cold us (GB/s) | L2-resident us | rel err\n", what, mb);
    for (int P : plane_counts) {
        // P-bit activations, one scale a group.
        std::vector<int> q(cols);
        const int lim = (1 << (P - 1)) - 1;
        for (auto& v : q) v = (rand() % (2 * lim + 1)) - lim;
        std::vector<float> da(groups);
        for (int g = 0; g < groups; ++g) da[g] = 0.01f * (1 + g % 7) / lim;
        std::vector<u32> hp((size_t)groups * P * 4, 0);
        std::vector<float2> hx(groups);
        for (int g = 0; g < groups; ++g) {
            long sum = 0;
            for (int k = 0; k < 128; ++k) {
                const u32 u = (u32)q[g * 128 + k];
                sum += q[g * 128 + k];
                for (int p = 0; p < P; ++p)
                    if ((u >> p) & 1) hp[((size_t)g * P + p) * 4 + k / 32] |= 1u << (k % 32);
            }
            hx[g] = make_float2(da[g], (float)sum / 4.0f);
        }
        std::vector<double> ref(rows, 0.0);
        double ref_max = 0;
        for (int r = 0; r < rows; ++r) {
            double acc = 0;
            for (int g = 0; g < groups; ++g) {
                long dot = 0;
                for (int k = 0; k < 128; ++k) {
                    const u32 word = bits[((size_t)r * groups + g) * 4 + k / 32];
                    dot += ((word >> (k % 32)) & 1) ? q[g * 128 + k] : -q[g * 128 + k];
                }
                acc += (double)dw[(size_t)r * groups + g] * da[g] * dot;
            }
            ref[r] = acc;
            ref_max = fmax(ref_max, fabs(acc));
        }
        u32* dp;
        float2* dx;
        CK(cudaMalloc(&dp, hp.size() * 4));
        CK(cudaMalloc(&dx, hx.size() * 8));
        CK(cudaMemcpy(dp, hp.data(), hp.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dx, hx.data(), hx.size() * 8, cudaMemcpyHostToDevice));
        for (const BVariant& v : variants) {
            if (v.p != P) continue;
            cudaFuncAttributes attr;
            CK(cudaFuncGetAttributes(&attr, v.k));
            int per_sm = 0;
            CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, v.k, 32 * v.split, 0));
            const int grid = tiles / v.tiles;
            CK(cudaMemset(dout, 0xff, rows * 4));
            v.k<<<grid, 32 * v.split, 0, s>>>(v.rowmajor ? dev[0].rw : dev[0].w, v.rowmajor ? dev[0].rs : dev[0].s, dp, dx, dout, rows,
                                             v.rowmajor ? quads : gps);
            CK(cudaStreamSynchronize(s));
            CK(cudaGetLastError());
            std::vector<float> got(rows);
            CK(cudaMemcpy(got.data(), dout, rows * 4, cudaMemcpyDeviceToHost));
            double err = 0;
            for (int r = 0; r < rows; ++r) err = fmax(err, fabs(got[r] - ref[r]));
            float us[2];
            for (int hot = 0; hot < 2; ++hot) {
                us[hot] = time_launches(s, 24, [&](int i) {
                    const Copy& c = dev[hot ? 0 : i % copies];
                    v.k<<<grid, 32 * v.split, 0, s>>>(v.rowmajor ? c.rw : c.w, v.rowmajor ? c.rs : c.s, dp, dx, dout, rows,
                                                     v.rowmajor ? quads : gps);
                });
            }
            printf("  %-30s %4d %3d %6d | %6.2f (%5.0f) | %6.2f | %.2e\n", v.name, attr.numRegs, per_sm, grid, us[0], mb * 1e3 / us[0], us[1],
                   v.compute ? err / ref_max : 0.0);
        }
        CK(cudaFree(dp));
        CK(cudaFree(dx));
    }
    for (auto& c : dev) {
        CK(cudaFree(c.w));
        CK(cudaFree(c.s));
        CK(cudaFree(c.rw));
        CK(cudaFree(c.rs));
    }
    CK(cudaFree(dout));
}

// kiln's dp4a loop on its own layout, for the same shapes (time only).
static void run_kiln(cudaStream_t s, int rows, int cols, const char* what) {
    const int groups = cols / 128, copies = 12;
    const Activations act = upload_activations(cols);
    std::vector<uint4> hc((size_t)rows * groups);
    std::vector<__half> hs((size_t)rows * groups);
    for (auto& v : hc) v = make_uint4(rand(), rand(), rand(), rand());
    for (auto& v : hs) v = __float2half(0.001f * (1 + rand() % 100));
    std::vector<std::pair<uint4*, __half*>> w(copies);
    for (auto& x : w) {
        CK(cudaMalloc(&x.first, hc.size() * 16));
        CK(cudaMalloc(&x.second, hs.size() * 2));
        CK(cudaMemcpy(x.first, hc.data(), hc.size() * 16, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(x.second, hs.data(), hs.size() * 2, cudaMemcpyHostToDevice));
    }
    float *dout, *dref;
    CK(cudaMalloc(&dout, rows * 4));
    CK(cudaMalloc(&dref, rows * 4));
    one_batch<4><<<(rows / 4 + 3) / 4, 128, 0, s>>>(w[0].first, w[0].second, act.d_codes, act.d_scales, dref, rows, groups);
    std::vector<float> ref(rows), got(rows);
    CK(cudaMemcpy(ref.data(), dref, rows * 4, cudaMemcpyDeviceToHost));
    const double mb = (hc.size() * 16 + hs.size() * 2) / 1e6;
    struct K {
        const char* name;
        void (*k)(const uint4*, const __half*, const uint4*, const float2*, float*, int, int);
        int r;
        int warps = 4, split = 1;
    };
    const K ks[] = {{"kiln dp4a, 4 rows a warp", one_batch<4>, 4},
                    {"kiln dp4a, 8 rows a warp", one_batch<8>, 8},
                    {"kiln dp4a, 16 rows a warp", one_batch<16>, 16},
                    {"split r4 s4 b2 w4 (kiln's)", kiln_split<4, 4, 2, 4>, 4, 4, 4},
                    {"split r4 s4 b1 w4", kiln_split<4, 4, 1, 4>, 4, 4, 4},
                    {"split r4 s4 b1 w16", kiln_split<4, 4, 1, 16>, 4, 16, 4},
                    {"split r8 s4 b1 w16", kiln_split<8, 4, 1, 16>, 8, 16, 4},
                    {"split r2 s4 b1 w16", kiln_split<2, 4, 1, 16>, 2, 16, 4},
                    {"split r4 s2 b1 w8", kiln_split<4, 2, 1, 8>, 4, 8, 2},
                    {"split r8 s2 b1 w8", kiln_split<8, 2, 1, 8>, 8, 8, 2},
                    {"split r16 s4 b1 w16", kiln_split<16, 4, 1, 16>, 16, 16, 4}};
    printf("\n%s (kiln's layout), %.1f MB\n", what, mb);
    for (const K& k : ks) {
        const int per_block = k.warps / k.split * k.r;
        const int grid = (rows + per_block - 1) / per_block;
        CK(cudaMemset(dout, 0xff, rows * 4));
        k.k<<<grid, 32 * k.warps, 0, s>>>(w[0].first, w[0].second, act.d_codes, act.d_scales, dout, rows, groups);
        CK(cudaStreamSynchronize(s));
        CK(cudaGetLastError());
        CK(cudaMemcpy(got.data(), dout, rows * 4, cudaMemcpyDeviceToHost));
        double diff = 0;
        for (int r = 0; r < rows; ++r) diff = fmax(diff, fabs((double)got[r] - ref[r]));
        float us[2];
        for (int hot = 0; hot < 2; ++hot) {
            us[hot] = time_launches(s, 24, [&](int i) {
                const auto& x = w[hot ? 0 : i % copies];
                k.k<<<grid, 32 * k.warps, 0, s>>>(x.first, x.second, act.d_codes, act.d_scales, dout, rows, groups);
            });
        }
        printf("  %-30s %6d | %6.2f (%5.0f) | %6.2f | max diff %.1e\n", k.name, grid, us[0], mb * 1e3 / us[0], us[1], diff);
    }
    for (auto& x : w) {
        CK(cudaFree(x.first));
        CK(cudaFree(x.second));
    }
    CK(cudaFree(dout));
    CK(cudaFree(dref));
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    srand(7);
    const std::vector<BVariant> wide = {
        BV(8, 1, 1, 8), BV(8, 1, 1, 16), BV(8, 2, 1, 8), BV(8, 1, 2, 8), BV(8, 1, 4, 4), BV(8, 2, 2, 4),
        BV(16, 1, 1, 8), BV(16, 1, 2, 8), BV(16, 2, 1, 8), BV(16, 1, 4, 4), BL(8, 1, 1, 8), BL(8, 1, 2, 8),
        BR(8, 1, 1, 4), BR(8, 1, 1, 8), BR(8, 1, 2, 4), BR(16, 1, 1, 4), BR(16, 1, 2, 4), BR(16, 2, 1, 4),
    };
    const std::vector<BVariant> tall = {
        BV(8, 1, 4, 4), BV(8, 1, 8, 2), BV(8, 1, 8, 6), BV(8, 1, 16, 3), BV(8, 2, 8, 3), BV(8, 1, 12, 4),
        BV(16, 1, 4, 4), BV(16, 1, 8, 2), BV(16, 1, 8, 6), BV(16, 1, 16, 3), BV(16, 1, 12, 4), BL(8, 1, 8, 6), BL(8, 1, 16, 3),
        BR(8, 1, 8, 3), BR(8, 1, 12, 2), BR(8, 1, 4, 3), BR(16, 1, 8, 3), BR(16, 1, 12, 2), BR(16, 1, 4, 6), BR(16, 1, 24, 1),
    };
    run_kiln(s, 24576, 4096, "gate+up 2x12288x4096");
    run_shape(s, 24576, 4096, "gate+up 2x12288x4096 on b1 mma", wide);
    run_kiln(s, 4096, 12288, "down 4096x12288");
    run_shape(s, 4096, 12288, "down 4096x12288 on b1 mma", tall);
    run_kiln(s, 6144, 4096, "q/k/v 6144x4096");
    run_shape(s, 6144, 4096, "q/k/v 6144x4096 on b1 mma", wide);
    return 0;
}
