//! NVTX ranges, so that launches show up labelled on a profiler timeline. Inert when the NVTX
//! library (libnvToolsExt) cannot be loaded, which is common: tracing then costs nothing.

use std::sync::OnceLock;

/// Ends its range when dropped.
#[must_use = "the range ends when this guard is dropped"]
pub struct ProfileRange(Option<cudarc::nvtx::Range>);

/// Opens an NVTX range named `label` (e.g. the kernel name) until the guard is dropped.
pub fn profile_range(label: &str) -> ProfileRange {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only opens and closes the shared library to see whether it loads.
    if *PRESENT.get_or_init(|| unsafe { cudarc::nvtx::sys::is_culib_present() }) {
        ProfileRange(Some(cudarc::nvtx::scoped_range(label)))
    } else {
        ProfileRange(None)
    }
}

impl ProfileRange {
    /// Whether NVTX is loaded and this range is being recorded.
    pub fn is_recording(&self) -> bool {
        self.0.is_some()
    }
}
