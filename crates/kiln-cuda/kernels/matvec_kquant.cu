// Mat-vec of the K-quants, IQ4_XS and the ternary formats (TQ1_0 is repacked to TQ2_0) against
// int8 activations; see matvec.cuh. matvec_* writes out (or adds to it when `accumulate` is non-zero);
// matvec_swiglu_* writes silu(x.Wg) * (x.Wu).
// kiln-test-defines: NTOK=1,ROWS_PER_WARP=1
// kiln-test-defines: NTOK=3,ROWS_PER_WARP=2
// kiln-test-defines: NTOK=8,ROWS_PER_WARP=4
// kiln-test-defines: NTOK=8,ROWS_PER_WARP=4,MV_BATCH=2
// kiln-test-defines: NTOK=2,ROWS_PER_WARP=1,MV_BATCH=8
#include "matvec.cuh"

#define MV_ARGS const i8* xq, const float2* xds, float* out, u32 rows
// MV_TYPE (a GGML type id) compiles only that format's pair, so a model pays for the formats it
// has; without it every format is compiled (the compile check).
#ifndef MV_TYPE
#define MV_TYPE -1
#endif
#define MV_WANTS(ggml_type) (MV_TYPE < 0 || MV_TYPE == (ggml_type))

#if MV_WANTS(10)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_q2_k(Planes w, MV_ARGS, u32 accumulate) {
    matvec_one<FmtQ2_K>(w, xq, xds, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_q2_k(Planes gate, Planes up, MV_ARGS) {
    matvec_two<FmtQ2_K>(gate, up, xq, xds, out, rows);
}
#endif

#if MV_WANTS(11)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_q3_k(Planes w, MV_ARGS, u32 accumulate) {
    matvec_one<FmtQ3_K>(w, xq, xds, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_q3_k(Planes gate, Planes up, MV_ARGS) {
    matvec_two<FmtQ3_K>(gate, up, xq, xds, out, rows);
}
#endif

#if MV_WANTS(12)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_q4_k(Planes w, MV_ARGS, u32 accumulate) {
    matvec_one<FmtQ4_K>(w, xq, xds, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_q4_k(Planes gate, Planes up, MV_ARGS) {
    matvec_two<FmtQ4_K>(gate, up, xq, xds, out, rows);
}
#endif

#if MV_WANTS(13)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_q5_k(Planes w, MV_ARGS, u32 accumulate) {
    matvec_one<FmtQ5_K>(w, xq, xds, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_q5_k(Planes gate, Planes up, MV_ARGS) {
    matvec_two<FmtQ5_K>(gate, up, xq, xds, out, rows);
}
#endif

#if MV_WANTS(14)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_q6_k(Planes w, MV_ARGS, u32 accumulate) {
    matvec_one<FmtQ6_K>(w, xq, xds, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_q6_k(Planes gate, Planes up, MV_ARGS) {
    matvec_two<FmtQ6_K>(gate, up, xq, xds, out, rows);
}
#endif

#if MV_WANTS(23)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_iq4_xs(Planes w, MV_ARGS, u32 accumulate) {
    matvec_one<FmtIQ4_XS>(w, xq, xds, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_iq4_xs(Planes gate, Planes up, MV_ARGS) {
    matvec_two<FmtIQ4_XS>(gate, up, xq, xds, out, rows);
}
#endif

#if MV_WANTS(35)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_tq2_0(Planes w, MV_ARGS, u32 accumulate) {
    matvec_one<FmtTQ2_0>(w, xq, xds, out, rows, accumulate);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_tq2_0(Planes gate, Planes up, MV_ARGS) {
    matvec_two<FmtTQ2_0>(gate, up, xq, xds, out, rows);
}
#endif
