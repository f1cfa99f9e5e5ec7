//! Device-free compilation of kernel sources to CUBIN with NVRTC.
//!
//! cudarc loads libnvrtc lazily and panics when it is missing, so every entry point here first
//! checks that the library can be opened and turns its absence into `NvrtcUnavailable`.

use std::ffi::{c_char, c_int, CString};
use std::sync::OnceLock;

use cudarc::nvrtc::result::NvrtcError;
use cudarc::nvrtc::sys;

use crate::cache::CubinKey;
use crate::error::{format_defines, library_candidates};
use crate::sources::kernel_headers;
use crate::CudaError;

/// Options every module is compiled with, besides the architecture and the defines. Fast math
/// is deliberately absent: it changes results (flushed denormals, approximate division).
const BASE_OPTIONS: &[&str] = &["-default-device", "--std=c++17", "-lineinfo"];

/// Fails with `NvrtcUnavailable` unless libnvrtc can be loaded; checked once per process.
pub fn ensure_nvrtc() -> Result<(), CudaError> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only opens and closes the shared library to see whether it loads.
    if *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() }) {
        Ok(())
    } else {
        Err(CudaError::NvrtcUnavailable(format!(
            "none of {:?} could be loaded; add the directory holding libnvrtc to LD_LIBRARY_PATH \
             (e.g. `eval \"$(scripts/nvrtc-env.sh)\"`)",
            library_candidates("nvrtc")
        )))
    }
}

/// (major, minor) of the loaded libnvrtc.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    static VERSION: OnceLock<Result<(i32, i32), NvrtcError>> = OnceLock::new();
    ensure_nvrtc()?;
    let version = VERSION.get_or_init(|| {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: libnvrtc is present; both pointers are valid for the call.
        unsafe { sys::nvrtcVersion(&mut major, &mut minor) }.result().map(|()| (major, minor))
    });
    version.map_err(|error| CudaError::Nvrtc { what: "nvrtcVersion", error })
}

/// Compiles a registered source (by file stem) for `arch` (e.g. `sm_90`) with the given
/// `-DNAME=VALUE` defines. Needs only libnvrtc, no device.
pub fn compile_cubin(source: &str, defines: &[(&str, i64)], arch: &str) -> Result<Vec<u8>, CudaError> {
    compile_key(&CubinKey::new(source, defines, arch)?)
}

/// The full NVRTC option list for a key; also hashed into the disk-cache file name.
pub(crate) fn compile_options(key: &CubinKey) -> Vec<String> {
    let mut options = vec![format!("--gpu-architecture={}", key.arch())];
    options.extend(BASE_OPTIONS.iter().map(|option| option.to_string()));
    options.extend(key.defines().iter().map(|(name, value)| format!("-D{name}={}", c_literal(*value))));
    options
}

/// A C expression for `value`, parenthesized when negative; i64::MIN has no literal of its own.
fn c_literal(value: i64) -> String {
    match value {
        i64::MIN => "(-9223372036854775807LL-1)".to_string(),
        v if v < 0 => format!("({v})"),
        v => v.to_string(),
    }
}

pub(crate) fn compile_key(key: &CubinKey) -> Result<Vec<u8>, CudaError> {
    ensure_nvrtc()?;
    let source = key.source();
    let started = std::time::Instant::now();
    let program = Program::create(source.name, source.code)?;
    let options = compile_options(key);
    let option_strings: Vec<CString> = options.iter().map(|o| CString::new(o.as_str()).expect("options hold no NUL")).collect();
    let option_ptrs: Vec<*const c_char> = option_strings.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: the program is live and the option pointers outlive the call.
    let compiled = unsafe { sys::nvrtcCompileProgram(program.handle, option_ptrs.len() as c_int, option_ptrs.as_ptr()) }.result();
    let log = program.log()?;
    if compiled.is_err() {
        return Err(CudaError::Compile { source_name: source.name.to_string(), defines: format_defines(key.defines()), arch: key.arch().to_string(), log });
    }
    if !log.trim().is_empty() {
        tracing::debug!(source = source.name, log = %log, "NVRTC warnings");
    }
    let cubin = program.cubin()?;
    tracing::debug!(
        source = source.name,
        defines = %format_defines(key.defines()),
        arch = key.arch(),
        bytes = cubin.len(),
        millis = started.elapsed().as_millis() as u64,
        "compiled kernel module"
    );
    Ok(cubin)
}

/// An NVRTC program that owns its source and header strings and is destroyed on drop.
struct Program {
    handle: sys::nvrtcProgram,
    _strings: Vec<CString>,
}

impl Program {
    fn create(name: &str, code: &str) -> Result<Self, CudaError> {
        let no_nul = |what: &str, text: &str| {
            CString::new(text).map_err(|_| CudaError::Compile {
                source_name: name.to_string(),
                defines: String::new(),
                arch: String::new(),
                log: format!("{what} contains a NUL byte"),
            })
        };
        let code = no_nul("the source", code)?;
        let file_name = no_nul("the file name", &format!("{name}.cu"))?;
        let mut header_codes = Vec::new();
        let mut header_names = Vec::new();
        for header in kernel_headers() {
            header_codes.push(no_nul(header.name, header.code)?);
            header_names.push(no_nul("a header name", header.name)?);
        }
        let code_ptrs: Vec<*const c_char> = header_codes.iter().map(|h| h.as_ptr()).collect();
        let name_ptrs: Vec<*const c_char> = header_names.iter().map(|h| h.as_ptr()).collect();
        let mut handle: sys::nvrtcProgram = std::ptr::null_mut();
        // SAFETY: every pointer refers to a NUL-terminated string kept alive in `_strings`.
        unsafe { sys::nvrtcCreateProgram(&mut handle, code.as_ptr(), file_name.as_ptr(), code_ptrs.len() as c_int, code_ptrs.as_ptr(), name_ptrs.as_ptr()) }
            .result()
            .map_err(|error| CudaError::Nvrtc { what: "nvrtcCreateProgram", error })?;
        let mut strings = vec![code, file_name];
        strings.extend(header_codes);
        strings.extend(header_names);
        Ok(Program { handle, _strings: strings })
    }

    fn log(&self) -> Result<String, CudaError> {
        let bytes = self.read_buffer("nvrtcGetProgramLog", sys::nvrtcGetProgramLogSize, sys::nvrtcGetProgramLog)?;
        Ok(String::from_utf8_lossy(&bytes).trim_end_matches('\0').to_string())
    }

    fn cubin(&self) -> Result<Vec<u8>, CudaError> {
        self.read_buffer("nvrtcGetCUBIN", sys::nvrtcGetCUBINSize, sys::nvrtcGetCUBIN)
    }

    fn read_buffer(
        &self,
        what: &'static str,
        size_of: unsafe fn(sys::nvrtcProgram, *mut usize) -> sys::nvrtcResult,
        read: unsafe fn(sys::nvrtcProgram, *mut c_char) -> sys::nvrtcResult,
    ) -> Result<Vec<u8>, CudaError> {
        let fail = |error| CudaError::Nvrtc { what, error };
        let mut size = 0usize;
        // SAFETY: the program is live; `buffer` has exactly the size NVRTC reported.
        unsafe { size_of(self.handle, &mut size) }.result().map_err(fail)?;
        let mut buffer = vec![0u8; size];
        unsafe { read(self.handle, buffer.as_mut_ptr().cast()) }.result().map_err(fail)?;
        Ok(buffer)
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the handle came from nvrtcCreateProgram and is destroyed exactly once.
        let destroyed = unsafe { sys::nvrtcDestroyProgram(&mut self.handle) }.result();
        if let Err(error) = destroyed {
            tracing::warn!(?error, "nvrtcDestroyProgram failed");
        }
    }
}
