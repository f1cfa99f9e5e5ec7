//! The `Backend` trait every compute device implements, the host-side
//! sampling reference, and the CPU backend.

pub mod backend;
pub mod collective;
mod compose;
pub mod cpu;
mod cpu_attention;
mod cpu_attention_tiled;
mod cpu_delta_chunk;
pub mod cpu_int;
mod cpu_kv;
mod cpu_ops;
mod cpu_recurrent;
mod cpu_simd;
#[cfg(target_arch = "aarch64")]
mod cpu_simd_neon;
#[cfg(target_arch = "x86_64")]
mod cpu_simd_x86;
mod op_args;
pub mod plan;
pub mod sampling;
pub mod shapes;
pub mod tensor;

pub use backend::{
    Activation, AttentionArgs, AttentionParams, Backend, BackendError, DeferredPrologue, DeltaNetParams, ExpertInput, GatedExperts, GatedFfn, GatedNorm,
    Linear, NormChain, QkNorm, Qkv, RopeKind, RopeParams, RouterArgs, RouterParams, StateSlots, WeightSource,
};
pub use collective::{AllReduce, GroupHandle, HostAllReduce};
pub use cpu::{CpuBackend, CpuMatmul, CpuOptions};
pub use cpu_int::SimdLevel;
pub use cpu_simd::Simd;
pub use plan::{BatchPlan, FlatPlan, KvCacheSpec, KvType, LogitRows, SampleSpec, SeqStep, StepCapacity, KV_BLOCK_SIZE, RELEASED_BLOCK};
pub use sampling::SamplingParams;
pub use tensor::{DType, DeviceBuffer, Shape, Tensor, TensorMut};
