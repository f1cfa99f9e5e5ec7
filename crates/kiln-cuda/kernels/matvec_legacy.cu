// Mat-vec of the 32- and 64-value block formats (Q1_0: 128) against int8 activations; see
// matvec.cuh. matvec_* writes out (or adds to it when `accumulate` is non-zero);
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
// kiln-test-defines: NTOK=1,ROWS_PER_WARP=16,MV_BATCH=1,MV_TYPE=41
// kiln-test-defines: NTOK=1,ROWS_PER_WARP=16,MV_BATCH=1,MV_TYPE=42
// kiln-test-defines: NTOK=1,ROWS_PER_WARP=4,MV_BATCH=1,MV_SPLIT=4,MV_TYPE=41
// kiln-test-defines: NTOK=1,ROWS_PER_WARP=8,MV_BATCH=1,MV_SPLIT=4,MV_WARPS=16,MV_TYPE=41
// kiln-test-defines: NTOK=1,ROWS_PER_WARP=4,MV_BATCH=1,MV_SPLIT=4,MV_TYPE=42
// kiln-test-defines: NTOK=1,ROWS_PER_WARP=8,MV_BATCH=1,MV_SPLIT=4,MV_WARPS=16,MV_TYPE=42
// kiln-waits-for-inputs
#include "matvec.cuh"

#define MV_ARGS const i8* xq, const float2* xds, InputNorm xn, float* out, u32 rows
// MV_TYPE (a GGML type id) compiles only that format's pair, so a model pays for the formats it
// has; without it every format is compiled (the compile check).
#ifndef MV_TYPE
#define MV_TYPE -1
#endif
#define MV_WANTS(ggml_type) (MV_TYPE < 0 || MV_TYPE == (ggml_type))

#if MV_WANTS(8)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_q8_0(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtQ8_0>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_q8_0(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtQ8_0>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_q8_0(MV_STACKED_PARAMS) {
    matvec_stacked<FmtQ8_0>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_q8_0(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtQ8_0>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_q8_0(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtQ8_0>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_q8_0(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtQ8_0>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(2)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_q4_0(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtQ4_0>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_q4_0(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtQ4_0>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_q4_0(MV_STACKED_PARAMS) {
    matvec_stacked<FmtQ4_0>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_q4_0(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtQ4_0>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_q4_0(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtQ4_0>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_q4_0(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtQ4_0>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(3)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_q4_1(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtQ4_1>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_q4_1(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtQ4_1>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_q4_1(MV_STACKED_PARAMS) {
    matvec_stacked<FmtQ4_1>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_q4_1(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtQ4_1>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_q4_1(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtQ4_1>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_q4_1(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtQ4_1>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(6)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_q5_0(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtQ5_0>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_q5_0(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtQ5_0>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_q5_0(MV_STACKED_PARAMS) {
    matvec_stacked<FmtQ5_0>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_q5_0(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtQ5_0>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_q5_0(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtQ5_0>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_q5_0(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtQ5_0>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(7)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_q5_1(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtQ5_1>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_q5_1(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtQ5_1>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_q5_1(MV_STACKED_PARAMS) {
    matvec_stacked<FmtQ5_1>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_q5_1(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtQ5_1>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_q5_1(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtQ5_1>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_q5_1(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtQ5_1>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(20)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_iq4_nl(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtIQ4_NL>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_iq4_nl(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtIQ4_NL>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_iq4_nl(MV_STACKED_PARAMS) {
    matvec_stacked<FmtIQ4_NL>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_iq4_nl(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtIQ4_NL>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_iq4_nl(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtIQ4_NL>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_iq4_nl(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtIQ4_NL>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(41)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_q1_0(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtQ1_0>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_q1_0(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtQ1_0>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_q1_0(MV_STACKED_PARAMS) {
    matvec_stacked<FmtQ1_0>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_q1_0(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtQ1_0>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_q1_0(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtQ1_0>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_q1_0(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtQ1_0>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(42)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_q2_0(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtQ2_0>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_q2_0(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtQ2_0>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_q2_0(MV_STACKED_PARAMS) {
    matvec_stacked<FmtQ2_0>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_q2_0(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtQ2_0>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_q2_0(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtQ2_0>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_q2_0(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtQ2_0>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(39)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_mxfp4(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtMXFP4>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_mxfp4(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtMXFP4>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_mxfp4(MV_STACKED_PARAMS) {
    matvec_stacked<FmtMXFP4>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_mxfp4(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtMXFP4>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_mxfp4(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtMXFP4>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_mxfp4(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtMXFP4>(MV_EXPERT_GROUPS_ARGS);
}
#endif

#if MV_WANTS(40)
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_nvfp4(Planes w, MV_ARGS, u32 accumulate, const float* bias, NextNorm next) {
    matvec_one<FmtNVFP4>(w, xq, xds, xn, out, rows, accumulate, bias, next);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_swiglu_nvfp4(Planes gate, Planes up, MV_ARGS, MV_GATED_PARAMS) {
    matvec_two<FmtNVFP4>(gate, up, xq, xds, xn, out, rows, MV_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_stacked_nvfp4(MV_STACKED_PARAMS) {
    matvec_stacked<FmtNVFP4>(MV_STACKED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_nvfp4(MV_EXPERTS_PARAMS) {
    matvec_experts<FmtNVFP4>(MV_EXPERTS_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_experts_gated_nvfp4(MV_EXPERTS_GATED_PARAMS) {
    matvec_experts_gated<FmtNVFP4>(MV_EXPERTS_GATED_ARGS);
}
extern "C" __global__ void __launch_bounds__(MV_THREADS) matvec_expert_groups_nvfp4(MV_EXPERT_GROUPS_PARAMS) {
    matvec_expert_groups<FmtNVFP4>(MV_EXPERT_GROUPS_ARGS);
}
#endif
