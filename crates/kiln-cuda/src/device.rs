//! One GPU: its context, default stream, kernel registry and properties, plus allocation and
//! upload helpers that report out-of-memory with the size and purpose of the request.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::sys::{CUdevice_attribute, CUresult};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtrMut, DeviceRepr, DriverError, PinnedHostSlice, ValidAsZeroBits};

use crate::error::library_candidates;
use crate::registry::{KernelRegistry, RegistryConfig};
use crate::CudaError;

/// Byte written by [`CudaDevice::alloc_poisoned`]: 0xFFFF.. is a NaN in f32, f16 and bf16.
pub const POISON_BYTE: u8 = 0xFF;

/// Weights are staged through two pinned buffers of this size, so the host copy of one chunk
/// overlaps the DMA of the previous one.
pub const STAGING_CHUNK_BYTES: usize = 32 << 20;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_memory_bytes: usize,
    /// At the time of the query.
    pub free_memory_bytes: usize,
    pub multiprocessor_count: u32,
    pub l2_cache_bytes: usize,
    /// Shared memory a block may use after opting in through the function attribute.
    pub max_shared_memory_per_block_optin: usize,
    /// CUDA version the driver supports, e.g. (13, 0).
    pub driver_version: (i32, i32),
}

impl DeviceInfo {
    /// `sm_<major><minor>`, the architecture kernels are compiled for by default.
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.compute_capability.0, self.compute_capability.1)
    }

    fn query(ctx: &Arc<CudaContext>) -> Result<Self, CudaError> {
        let ordinal = ctx.ordinal();
        let context = |what: &str| format!("reading the {what} of device {ordinal}");
        let attribute = |attribute, what: &str| -> Result<usize, CudaError> {
            let value = ctx.attribute(attribute).map_err(CudaError::driver(context(what)))?;
            Ok(usize::try_from(value).unwrap_or(0))
        };
        let (free_memory_bytes, total_memory_bytes) = ctx.mem_get_info().map_err(CudaError::driver(context("memory size")))?;
        Ok(DeviceInfo {
            ordinal,
            name: ctx.name().map_err(CudaError::driver(context("name")))?,
            compute_capability: ctx.compute_capability().map_err(CudaError::driver(context("compute capability")))?,
            total_memory_bytes,
            free_memory_bytes,
            multiprocessor_count: attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "multiprocessor count")? as u32,
            l2_cache_bytes: attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, "L2 size")?,
            max_shared_memory_per_block_optin: attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, "shared memory limit")?,
            driver_version: driver_version()?,
        })
    }
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const GIB: f64 = (1u64 << 30) as f64;
        write!(
            f,
            "cuda:{} {} ({}, {} SMs, {:.1} GiB total, {:.1} GiB free, L2 {} MiB, driver CUDA {}.{})",
            self.ordinal,
            self.name,
            self.arch(),
            self.multiprocessor_count,
            self.total_memory_bytes as f64 / GIB,
            self.free_memory_bytes as f64 / GIB,
            self.l2_cache_bytes >> 20,
            self.driver_version.0,
            self.driver_version.1
        )
    }
}

/// Fails with `DriverUnavailable` unless libcuda can be loaded; checked once per process.
pub fn ensure_driver() -> Result<(), CudaError> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only opens and closes the shared library to see whether it loads.
    if *PRESENT.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() }) {
        Ok(())
    } else {
        tracing::debug!(tried = ?library_candidates("cuda"), "libcuda did not load");
        Err(CudaError::DriverUnavailable("libcuda did not load".into()))
    }
}

fn driver_version() -> Result<(i32, i32), CudaError> {
    let mut version = 0;
    // SAFETY: the driver library is loaded (ensured before any context exists).
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }.result().map_err(CudaError::driver("reading the driver version"))?;
    Ok((version / 1000, version % 1000 / 10))
}

/// Number of CUDA devices; an error (not a panic) without a driver.
pub fn device_count() -> Result<usize, CudaError> {
    ensure_driver()?;
    let count = CudaContext::device_count().map_err(CudaError::driver("counting CUDA devices"))?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// Every visible device with its properties, for `kiln info --devices`.
pub fn list_devices() -> Result<Vec<DeviceInfo>, CudaError> {
    (0..device_count()?)
        .map(|ordinal| {
            let ctx = CudaContext::new(ordinal).map_err(CudaError::driver(format!("opening a context on device {ordinal}")))?;
            DeviceInfo::query(&ctx)
        })
        .collect()
}

/// How GPU `from` reaches GPU `to`'s memory (the driver's peer-to-peer attributes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerLink {
    pub from: usize,
    pub to: usize,
    /// Direct loads and stores into the peer's memory (NVLink or PCIe peer-to-peer).
    pub access: bool,
    /// Native atomics over the link (NVLink and NVSwitch have them, PCIe usually not).
    pub native_atomics: bool,
    /// The driver's relative performance of the link; 0 is the fastest.
    pub performance_rank: i32,
}

/// Every ordered pair of distinct visible GPUs and how they reach each other (tensor
/// parallelism's all-reduces run over these links).
pub fn peer_links() -> Result<Vec<PeerLink>, CudaError> {
    use cudarc::driver::sys::CUdevice_P2PAttribute as Attr;
    let n = device_count()?;
    let devices = (0..n)
        .map(|o| CudaContext::new(o).map(|c| c.cu_device()).map_err(CudaError::driver(format!("opening a context on device {o}"))))
        .collect::<Result<Vec<_>, _>>()?;
    let attribute = |attr: Attr, from: usize, to: usize| -> Result<i32, CudaError> {
        let mut value = 0;
        // SAFETY: both handles come from live contexts and `value` outlives the call.
        unsafe { cudarc::driver::sys::cuDeviceGetP2PAttribute(&mut value, attr, devices[from], devices[to]) }
            .result()
            .map_err(CudaError::driver(format!("querying the link from GPU {from} to GPU {to}")))?;
        Ok(value)
    };
    let mut links = Vec::new();
    for from in 0..n {
        for to in (0..n).filter(|&to| to != from) {
            links.push(PeerLink {
                from,
                to,
                access: attribute(Attr::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED, from, to)? != 0,
                native_atomics: attribute(Attr::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED, from, to)? != 0,
                performance_rank: attribute(Attr::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK, from, to)?,
            });
        }
    }
    Ok(links)
}

pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    registry: KernelRegistry,
    info: DeviceInfo,
    staging: Mutex<Option<Staging>>,
    /// The quantized mat-vec inputs, one per row length (see `matvec::shared_input`).
    pub(crate) matvec_inputs: Mutex<std::collections::HashMap<usize, crate::matvec::SharedInput>>,
    /// The normed inputs residual products fill, one per row length (`matvec::normed_input`).
    pub(crate) normed_inputs: Mutex<std::collections::HashMap<usize, crate::matvec::SharedInput>>,
}

impl CudaDevice {
    pub fn new(ordinal: usize, config: RegistryConfig) -> Result<Self, CudaError> {
        ensure_driver()?;
        let ctx = CudaContext::new(ordinal).map_err(CudaError::driver(format!("opening a context on device {ordinal}")))?;
        let info = DeviceInfo::query(&ctx)?;
        let registry = KernelRegistry::new(ctx.clone(), config)?;
        // One stream orders all work, so cudarc's per-buffer events are not needed; they would
        // put waits on pre-capture events into CUDA graph captures, and the legacy default
        // stream cannot be captured at all.
        // SAFETY: no buffer has been allocated through this context yet.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(CudaError::driver("creating the device stream"))?;
        Ok(CudaDevice { stream, ctx, registry, info, staging: Mutex::new(None), matvec_inputs: Mutex::default(), normed_inputs: Mutex::default() })
    }

    /// Properties as read when the device was opened (free memory included).
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn registry(&self) -> &KernelRegistry {
        &self.registry
    }

    /// (free, total) bytes of device memory now.
    pub fn memory_info(&self) -> Result<(usize, usize), CudaError> {
        self.ctx.mem_get_info().map_err(CudaError::driver("reading free device memory"))
    }

    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(CudaError::driver("synchronizing the stream"))
    }

    /// # Safety
    /// The memory is uninitialized: it must be written before it is read.
    pub unsafe fn alloc_uninit<T: DeviceRepr>(&self, len: usize, what: &str) -> Result<CudaSlice<T>, CudaError> {
        let out_of_memory = |free_bytes| CudaError::OutOfMemory { requested_bytes: len.saturating_mul(size_of::<T>()), free_bytes, what: what.to_string() };
        // cudarc multiplies without checking; an overflow must not become a small allocation.
        let bytes = len
            .checked_mul(size_of::<T>())
            .filter(|&bytes| bytes <= isize::MAX as usize)
            .ok_or_else(|| out_of_memory(self.memory_info().map_or(0, |(free, _)| free)))?;
        self.stream.alloc::<T>(len).map_err(|error| match error {
            DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY) => out_of_memory(self.memory_info().map_or(0, |(free, _)| free)),
            error => CudaError::Driver { context: format!("allocating {bytes} bytes for {what}"), error },
        })
    }

    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize, what: &str) -> Result<CudaSlice<T>, CudaError> {
        // SAFETY: filled with zeros before it is handed out.
        let mut slice = unsafe { self.alloc_uninit(len, what)? };
        self.stream.memset_zeros(&mut slice).map_err(CudaError::driver(format!("zeroing {what}")))?;
        Ok(slice)
    }

    /// Filled with [`POISON_BYTE`], so elements a kernel fails to write stand out as NaN.
    pub fn alloc_poisoned<T: DeviceRepr + bytemuck::Pod>(&self, len: usize, what: &str) -> Result<CudaSlice<T>, CudaError> {
        // SAFETY: every byte is set below, and any bit pattern is a valid `Pod` value.
        let mut slice = unsafe { self.alloc_uninit::<T>(len, what)? };
        let bytes = slice.num_bytes();
        {
            // `_record` marks the write for cudarc's stream tracking when it goes out of scope.
            let (pointer, _record) = slice.device_ptr_mut(&self.stream);
            // SAFETY: `pointer` addresses exactly `bytes` bytes owned by `slice`.
            unsafe { cudarc::driver::result::memset_d8_async(pointer, POISON_BYTE, bytes, self.stream.cu_stream()) }
                .map_err(CudaError::driver(format!("poisoning {what}")))?;
        }
        Ok(slice)
    }

    /// Copies from pageable memory; see [`Self::upload_via_pinned`] for large weights.
    pub fn upload<T: DeviceRepr>(&self, data: &[T], what: &str) -> Result<CudaSlice<T>, CudaError> {
        // SAFETY: fully overwritten by the copy.
        let mut slice = unsafe { self.alloc_uninit(data.len(), what)? };
        self.stream.memcpy_htod(data, &mut slice).map_err(CudaError::driver(format!("uploading {what}")))?;
        Ok(slice)
    }

    /// Uploads through reusable pinned staging buffers, `STAGING_CHUNK_BYTES` at a time. The
    /// copy is asynchronous on the device's stream; kernels queued later on it see the data.
    pub fn upload_via_pinned(&self, bytes: &[u8], what: &str) -> Result<CudaSlice<u8>, CudaError> {
        // SAFETY: every chunk of the slice is overwritten by the copies below.
        let mut slice = unsafe { self.alloc_uninit::<u8>(bytes.len(), what)? };
        let mut guard = self.staging.lock().unwrap_or_else(PoisonError::into_inner);
        let staging = match &mut *guard {
            Some(staging) => staging,
            empty => empty.insert(Staging::new(&self.ctx)?),
        };
        let fail = |step: &str| CudaError::driver(format!("{step} while uploading {what}"));
        for (index, chunk) in bytes.chunks(STAGING_CHUNK_BYTES).enumerate() {
            let slot = index % staging.buffers.len();
            staging.copied[slot].synchronize().map_err(fail("waiting for a staging buffer"))?;
            let host = staging.buffers[slot].as_mut_slice().map_err(fail("mapping a staging buffer"))?;
            host[..chunk.len()].copy_from_slice(chunk);
            let offset = index * STAGING_CHUNK_BYTES;
            let mut target = slice.slice_mut(offset..offset + chunk.len());
            self.stream.memcpy_htod(&host[..chunk.len()], &mut target).map_err(fail("copying a chunk"))?;
            staging.copied[slot].record(&self.stream).map_err(fail("recording a copy"))?;
        }
        Ok(slice)
    }

    /// Copies to the host and waits for the copy.
    pub fn download<T: DeviceRepr>(&self, slice: &CudaSlice<T>) -> Result<Vec<T>, CudaError> {
        let data = self.stream.clone_dtoh(slice).map_err(CudaError::driver("downloading a buffer"))?;
        self.synchronize()?;
        Ok(data)
    }
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice").field("info", &self.info).field("registry", &self.registry).finish()
    }
}

/// Two pinned buffers and, for each, an event marking when its last copy finished.
struct Staging {
    buffers: [PinnedHostSlice<u8>; 2],
    copied: [CudaEvent; 2],
}

impl Staging {
    fn new(ctx: &Arc<CudaContext>) -> Result<Self, CudaError> {
        let pinned = || {
            // SAFETY: staging bytes are always written before the copy that reads them.
            unsafe { ctx.alloc_pinned::<u8>(STAGING_CHUNK_BYTES) }.map_err(CudaError::driver("allocating pinned staging memory"))
        };
        let event = || ctx.new_event(None).map_err(CudaError::driver("creating a staging event"));
        Ok(Staging { buffers: [pinned()?, pinned()?], copied: [event()?, event()?] })
    }
}

impl Drop for Staging {
    /// Pinned memory must outlive the DMA reading it.
    fn drop(&mut self) {
        for event in &self.copied {
            if let Err(error) = event.synchronize() {
                tracing::warn!(?error, "waiting for a staging copy failed");
            }
        }
    }
}
