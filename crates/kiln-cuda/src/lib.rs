//! CUDA support for kiln: the kernel registry (NVRTC compilation of the embedded
//! `kernels/*.cu` sources, specialized by compile-time defines, cached in memory and on disk)
//! and the device layer (context, stream, properties, allocation and upload helpers).
//!
//! libcuda and libnvrtc are loaded at run time. Their absence is reported as
//! [`CudaError::DriverUnavailable`] / [`CudaError::NvrtcUnavailable`], never as a panic.
//!
//! # Writing kernels
//! - One file per op family, `kernels/<family>.cu`; its file stem is the source name given to
//!   [`KernelRegistry::function`]. All kernels of a file share one module.
//! - Declare kernels exactly as `extern "C" __global__ void name(...)` (`__launch_bounds__(..)`
//!   may precede the name). `build.rs` derives the kernel table from these declarations and
//!   fails the build on a `__global__` function in any other form. Names are unique across
//!   files, so a profiler trace names one kernel.
//! - `#include "common.cuh"` (or another `kernels/*.cuh`) for shared helpers: f16/bf16
//!   conversions, index helpers, warp and block reductions. Toolkit headers (`#include <...>`)
//!   are rejected: kernels must build with libnvrtc alone.
//! - Compile-time constants come from the `defines` argument as `-DNAME=VALUE`. A file that
//!   needs some declares the specializations the CI compile test builds, one line each:
//!   `// kiln-test-defines: BLOCK_SIZE=128,UNROLL=4`.
//! - Modules are compiled with `--gpu-architecture=sm_XX -default-device --std=c++17
//!   -lineinfo` and without fast math.
//! - Launch with cudarc: `device.stream().launch_builder(&function).arg(..).launch(cfg)`.
//!   Keep the [`cudarc::driver::CudaFunction`] on hot paths rather than looking it up per launch.

mod arch_ops;
mod backend;
mod cache;
mod collective;
mod device;
mod error;
mod graph;
pub mod kv;
pub mod matvec;
mod norm_chain;
mod nvrtc;
pub mod paged_attention;
pub mod plan_words;
mod profile;
mod prologue;
mod registry;
// Used by build.rs (through #[path]); compiled into the library only for its tests.
#[cfg(test)]
mod scan;
mod shared_products;
mod sources;
mod step;
mod step_clock;
mod tuning;

pub use arch_ops::DeltaNetSpans;
pub use backend::CudaBackend;
pub use cache::{CacheDir, Cubin, CubinCache, CubinKey, CubinOrigin};
pub use collective::NcclAllReduce;
pub use device::{device_count, ensure_driver, list_devices, peer_links, CudaDevice, DeviceInfo, PeerLink, POISON_BYTE, STAGING_CHUNK_BYTES};
pub use error::CudaError;
pub use graph::{GraphEdges, NodeTime, StepProfile};
pub use norm_chain::CudaNormedInput;
pub use nvrtc::{compile_cubin, ensure_nvrtc, nvrtc_version};
pub use profile::{profile_range, ProfileRange};
pub use prologue::HeadNorms;
pub use registry::{KernelRegistry, RegistryConfig};
pub use sources::{find_kernel, find_source, kernel_headers, kernel_sources, KernelHeader, KernelSource};
pub use step::CudaStep;
pub use step_clock::StepTime;

/// The cudarc version this crate is built against, for callers that launch kernels.
pub use cudarc;
