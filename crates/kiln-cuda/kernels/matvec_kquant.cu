// Mat-vec of the 256-value formats: K-quants, IQ formats, ternary (TQ1_0 repacked to TQ2_0), against
// int8 activations; see matvec.cuh. matvec_* writes out (or adds to it when `accumulate` is non-zero);
// matvec_swiglu_* writes act(x.Wg) * (x.Wu) (SiLU for SwiGLU), and given next_xq also its int8 quantization
// (matvec.cuh's quantize_block_rows).
// kiln-test-defines: NTOK=1,ROWS_PER_WARP=1
// kiln-test-defines: NTOK=3,ROWS_PER_WARP=2
// kiln-test-defines: NTOK=8,ROWS_PER_WARP=4
// kiln-test-defines: NTOK=8,ROWS_PER_WARP=4,MV_BATCH=2
// kiln-test-defines: NTOK=2,ROWS_PER_WARP=1,MV_BATCH=8
// kiln-test-defines: NTOK=1,ROWS_PER_WARP=4,MV_BATCH=2,MV_SPLIT=4
// kiln-test-defines: NTOK=1,ROWS_PER_WARP=2,MV_BATCH=4,MV_SPLIT=4
// kiln-test-defines: NTOK=1,ROWS_PER_WARP=4,MV_BATCH=2,MV_SPLIT=4,MV_WARPS=16
// kiln-test-defines: NTOK=1,ROWS_PER_WARP=4,MV_BATCH=2,MV_SPLIT=2,MV_WARPS=16
// kiln-test-defines: NTOK=1,ROWS_PER_WARP=8,MV_BATCH=2
// kiln-test-defines: NTOK=1,ROWS_PER_WARP=16,MV_BATCH=1,MV_TYPE=35
// kiln-test-defines: NTOK=1,ROWS_PER_WARP=4,MV_BATCH=1,MV_SPLIT=4,MV_TYPE=35
// kiln-test-defines: NTOK=1,ROWS_PER_WARP=8,MV_BATCH=1,MV_SPLIT=4,MV_WARPS=16,MV_TYPE=35
// kiln-waits-for-inputs
#include "matvec.cuh"

#define MV_ARGS const i8* xq, const float2* xds, InputNorm xn, float* out, u32 rows
// MV_TYPE (a GGML type id) compiles only that format's pair, so a model pays for the formats it
// has; without it every format is compiled (the compile check).
#ifndef MV_TYPE
#define MV_TYPE -1
#endif
#define MV_WANTS(ggml_type) (MV_TYPE < 0 || MV_TYPE == (ggml_type))

#if MV_WANTS(10)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_q2_k(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtQ2_K>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_q2_k(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtQ2_K>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_q2_k(MV_STACKED_PARAMS) {
    matvec_stacked<FmtQ2_K>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_q2_k(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtQ2_K>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_q2_k(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtQ2_K>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_q2_k(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtQ2_K>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(11)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_q3_k(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtQ3_K>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_q3_k(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtQ3_K>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_q3_k(MV_STACKED_PARAMS) {
    matvec_stacked<FmtQ3_K>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_q3_k(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtQ3_K>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_q3_k(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtQ3_K>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_q3_k(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtQ3_K>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(12)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_q4_k(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtQ4_K>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_q4_k(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtQ4_K>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_q4_k(MV_STACKED_PARAMS) {
    matvec_stacked<FmtQ4_K>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_q4_k(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtQ4_K>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_q4_k(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtQ4_K>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_q4_k(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtQ4_K>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(13)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_q5_k(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtQ5_K>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_q5_k(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtQ5_K>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_q5_k(MV_STACKED_PARAMS) {
    matvec_stacked<FmtQ5_K>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_q5_k(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtQ5_K>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_q5_k(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtQ5_K>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_q5_k(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtQ5_K>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(14)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_q6_k(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtQ6_K>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_q6_k(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtQ6_K>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_q6_k(MV_STACKED_PARAMS) {
    matvec_stacked<FmtQ6_K>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_q6_k(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtQ6_K>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_q6_k(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtQ6_K>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_q6_k(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtQ6_K>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(23)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_iq4_xs(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtIQ4_XS>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_iq4_xs(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtIQ4_XS>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_iq4_xs(MV_STACKED_PARAMS) {
    matvec_stacked<FmtIQ4_XS>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_iq4_xs(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtIQ4_XS>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_iq4_xs(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtIQ4_XS>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_iq4_xs(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtIQ4_XS>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(35)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_tq2_0(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtTQ2_0>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_tq2_0(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtTQ2_0>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_tq2_0(MV_STACKED_PARAMS) {
    matvec_stacked<FmtTQ2_0>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_tq2_0(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtTQ2_0>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_tq2_0(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtTQ2_0>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_tq2_0(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtTQ2_0>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(16)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_iq2_xxs(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtIQ2_XXS>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_iq2_xxs(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtIQ2_XXS>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_iq2_xxs(MV_STACKED_PARAMS) {
    matvec_stacked<FmtIQ2_XXS>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_iq2_xxs(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtIQ2_XXS>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_iq2_xxs(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtIQ2_XXS>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_iq2_xxs(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtIQ2_XXS>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(17)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_iq2_xs(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtIQ2_XS>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_iq2_xs(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtIQ2_XS>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_iq2_xs(MV_STACKED_PARAMS) {
    matvec_stacked<FmtIQ2_XS>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_iq2_xs(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtIQ2_XS>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_iq2_xs(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtIQ2_XS>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_iq2_xs(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtIQ2_XS>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(22)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_iq2_s(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtIQ2_S>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_iq2_s(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtIQ2_S>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_iq2_s(MV_STACKED_PARAMS) {
    matvec_stacked<FmtIQ2_S>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_iq2_s(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtIQ2_S>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_iq2_s(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtIQ2_S>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_iq2_s(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtIQ2_S>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(18)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_iq3_xxs(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtIQ3_XXS>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_iq3_xxs(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtIQ3_XXS>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_iq3_xxs(MV_STACKED_PARAMS) {
    matvec_stacked<FmtIQ3_XXS>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_iq3_xxs(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtIQ3_XXS>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_iq3_xxs(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtIQ3_XXS>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_iq3_xxs(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtIQ3_XXS>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(21)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_iq3_s(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtIQ3_S>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_iq3_s(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtIQ3_S>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_iq3_s(MV_STACKED_PARAMS) {
    matvec_stacked<FmtIQ3_S>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_iq3_s(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtIQ3_S>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_iq3_s(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtIQ3_S>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_iq3_s(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtIQ3_S>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(19)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_iq1_s(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtIQ1_S>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_iq1_s(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtIQ1_S>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_iq1_s(MV_STACKED_PARAMS) {
    matvec_stacked<FmtIQ1_S>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_iq1_s(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtIQ1_S>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_iq1_s(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtIQ1_S>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_iq1_s(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtIQ1_S>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(29)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_iq1_m(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtIQ1_M>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_iq1_m(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtIQ1_M>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_iq1_m(MV_STACKED_PARAMS) {
    matvec_stacked<FmtIQ1_M>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_iq1_m(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtIQ1_M>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_iq1_m(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtIQ1_M>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_iq1_m(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtIQ1_M>(MV_EXPERT_GROUPS_ARGS);
}
#endif
