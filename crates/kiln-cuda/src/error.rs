use cudarc::driver::DriverError;
use cudarc::nvrtc::result::NvrtcError;

/// Every failure of the CUDA layer. Nothing here panics on a missing library or device.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("unknown kernel source `{name}` (available: {available:?})")]
    UnknownSource { name: String, available: Vec<&'static str> },

    #[error("kernel `{kernel}` not found in {source_name}.cu (available: {available:?})")]
    KernelNotFound { source_name: String, kernel: String, available: Vec<&'static str> },

    #[error("invalid compile-time define `{name}`: {reason}")]
    InvalidDefine { name: String, reason: &'static str },

    #[error("invalid GPU architecture `{arch}`: expected a real architecture such as `sm_90` or `sm_90a`")]
    InvalidArch { arch: String },

    #[error("NVRTC failed to compile {source_name}.cu for {arch} with defines [{defines}]:\n{log}")]
    Compile { source_name: String, defines: String, arch: String, log: String },

    #[error("NVRTC {what} failed: {error}")]
    Nvrtc { what: &'static str, error: NvrtcError },

    #[error("libnvrtc is not available: {0}")]
    NvrtcUnavailable(String),

    #[error("libnccl is not available ({0})")]
    NcclUnavailable(String),

    #[error("NCCL {what} failed: {error}")]
    Nccl { what: &'static str, error: String },

    #[error("no NVIDIA driver found ({0})")]
    DriverUnavailable(String),

    #[error("CUDA driver call failed while {context}: {error:?}")]
    Driver { context: String, error: DriverError },

    #[error("loading the module of {source_name}.cu (defines [{defines}], {arch}) failed: {error:?}")]
    Load { source_name: String, defines: String, arch: String, error: DriverError },

    #[error("out of GPU memory allocating {requested_bytes} bytes for {what} ({free_bytes} bytes free)")]
    OutOfMemory { requested_bytes: usize, free_bytes: usize, what: String },

    /// A call whose arguments do not fit together (shapes, buffer sizes, weight types).
    #[error("{op}: {reason}")]
    InvalidArgument { op: &'static str, reason: String },
}

impl CudaError {
    pub(crate) fn driver(context: impl Into<String>) -> impl FnOnce(DriverError) -> CudaError {
        let context = context.into();
        move |error| CudaError::Driver { context, error }
    }
}

/// `NAME=VALUE,...` as shown in messages.
pub(crate) fn format_defines(defines: &[(String, i64)]) -> String {
    defines.iter().map(|(name, value)| format!("{name}={value}")).collect::<Vec<_>>().join(",")
}

/// The file names cudarc tries when loading `lib`, without repeats, for error messages.
pub(crate) fn library_candidates(lib: &str) -> Vec<String> {
    let mut names = cudarc::get_lib_name_candidates(lib);
    let mut seen = std::collections::HashSet::new();
    names.retain(|name| seen.insert(name.clone()));
    names
}
