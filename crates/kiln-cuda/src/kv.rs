//! One layer's paged KV cache on the GPU, laid out as `kernels/kv.cuh` describes. Each of K
//! and V is one range of virtual addresses reserved for the whole budget, with device memory
//! mapped into it chunk by chunk as the pool grows: memory is taken as sequences grow, while
//! the addresses that captured graphs bake in never change.

use std::sync::Arc;

use cudarc::driver::sys::{
    self, CUdeviceptr, CUmemAccessDesc, CUmemAccess_flags, CUmemAllocationGranularity_flags, CUmemAllocationProp, CUmemAllocationType,
    CUmemGenericAllocationHandle, CUmemLocation, CUmemLocationType, CUresult,
};
use cudarc::driver::CudaContext;
use kiln_core::backend::{BackendError, Result};
use kiln_core::{KvCacheSpec, KvType, KV_BLOCK_SIZE};

use crate::CudaDevice;

fn check(what: &str, result: CUresult) -> Result<()> {
    if result == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(BackendError::Device(format!("{what}: {result:?}")))
    }
}

/// Byte offset of the q8_0 scales in a buffer of `rows` rows (`kv_q8_scales_at` in kv.cuh).
pub fn q8_scales_at(rows: usize, width: usize) -> usize {
    (rows * width).div_ceil(16) * 16
}

/// Bytes a K or V buffer of `rows` rows of `width` values of `ty` occupies.
pub fn cache_bytes(ty: KvType, rows: usize, width: usize) -> usize {
    match ty {
        KvType::F32 | KvType::F16 => rows * ty.row_bytes(width),
        KvType::Q8_0 => q8_scales_at(rows, width) + rows * (width / 32) * 2,
    }
}

/// Bytes of a K or V buffer of `rows` rows, and the byte ranges rows `0..used` occupy.
fn layout(ty: KvType, rows: usize, width: usize, used: usize) -> (usize, [std::ops::Range<usize>; 2]) {
    let total = cache_bytes(ty, rows, width);
    match ty {
        KvType::F32 | KvType::F16 => (total, [0..used * ty.row_bytes(width), 0..0]),
        KvType::Q8_0 => {
            let scales = q8_scales_at(rows, width);
            (total, [0..used * width, scales..scales + used * width / 32 * 2])
        }
    }
}

/// A reserved address range with device memory mapped into it one granule at a time.
struct GrowableBuffer {
    ctx: Arc<CudaContext>,
    ordinal: i32,
    base: CUdeviceptr,
    reserved: usize,
    granularity: usize,
    /// The physical allocation of each granule, once mapped.
    granules: Vec<Option<CUmemGenericAllocationHandle>>,
}

// SAFETY: the handles and addresses are plain values owned by this buffer; the driver calls
// that use them are thread-safe once the context is bound.
unsafe impl Send for GrowableBuffer {}
unsafe impl Sync for GrowableBuffer {}

impl GrowableBuffer {
    fn prop(ordinal: i32) -> CUmemAllocationProp {
        // SAFETY: a plain C struct for which all-zero is the documented default.
        let mut prop: CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location = CUmemLocation { type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal };
        prop
    }

    fn reserve(device: &CudaDevice, bytes: usize, what: &str) -> Result<GrowableBuffer> {
        let ctx = device.context().clone();
        ctx.bind_to_thread().map_err(|e| BackendError::Device(format!("binding the context: {e:?}")))?;
        let ordinal = device.info().ordinal as i32;
        let prop = Self::prop(ordinal);
        let mut granularity = 0usize;
        // SAFETY: out-pointer to a local; prop is valid.
        check("querying the allocation granularity", unsafe {
            sys::cuMemGetAllocationGranularity(&mut granularity, &prop, CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        })?;
        let reserved = bytes.max(1).div_ceil(granularity) * granularity;
        let mut base: CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; no fixed address asked for.
        check(&format!("reserving {reserved} bytes of addresses for {what}"), unsafe { sys::cuMemAddressReserve(&mut base, reserved, granularity, 0, 0) })?;
        Ok(GrowableBuffer { ctx, ordinal, base, reserved, granularity, granules: vec![None; reserved / granularity] })
    }

    /// Maps memory behind every granule that `range` (bytes from the base) touches.
    fn back(&mut self, range: std::ops::Range<usize>, what: &str) -> Result<()> {
        if range.is_empty() {
            return Ok(());
        }
        self.ctx.bind_to_thread().map_err(|e| BackendError::Device(format!("binding the context: {e:?}")))?;
        let prop = Self::prop(self.ordinal);
        for g in range.start / self.granularity..range.end.div_ceil(self.granularity) {
            if self.granules[g].is_some() {
                continue;
            }
            let mut handle: CUmemGenericAllocationHandle = 0;
            // SAFETY: out-pointer to a local; prop valid.
            let created = unsafe { sys::cuMemCreate(&mut handle, self.granularity, &prop, 0) };
            if created == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                return Err(BackendError::OutOfMemory { device: "GPU".into(), what: what.into(), requested_bytes: self.granularity as u64, free_bytes: None });
            }
            check("creating KV cache memory", created)?;
            let at = self.base + (g * self.granularity) as CUdeviceptr;
            // SAFETY: `at` is a granule of our reservation that nothing is mapped to yet.
            let mapped = unsafe { sys::cuMemMap(at, self.granularity, 0, handle, 0) };
            if let Err(e) = check("mapping KV cache memory", mapped) {
                // SAFETY: the handle was created above and is mapped nowhere.
                unsafe { sys::cuMemRelease(handle) };
                return Err(e);
            }
            self.granules[g] = Some(handle);
            let access = CUmemAccessDesc { location: prop.location, flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
            // SAFETY: the granule was just mapped.
            check("enabling access to KV cache memory", unsafe { sys::cuMemSetAccess(at, self.granularity, &access, 1) })?;
        }
        Ok(())
    }

    fn mapped_bytes(&self) -> usize {
        self.granules.iter().filter(|g| g.is_some()).count() * self.granularity
    }
}

impl Drop for GrowableBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // Work queued on the cache must finish before its memory goes.
        let _ = self.ctx.synchronize();
        for (g, handle) in self.granules.iter().enumerate() {
            if let Some(handle) = handle {
                // SAFETY: granule g is mapped to `handle`, and nothing uses it any more.
                unsafe {
                    sys::cuMemUnmap(self.base + (g * self.granularity) as CUdeviceptr, self.granularity);
                    sys::cuMemRelease(*handle);
                }
            }
        }
        // SAFETY: the reservation is ours and now has nothing mapped.
        unsafe { sys::cuMemAddressFree(self.base, self.reserved) };
    }
}

/// One layer's K and V cache.
pub struct CudaKvCache {
    pub(crate) spec: KvCacheSpec,
    k: GrowableBuffer,
    v: GrowableBuffer,
    usable_blocks: usize,
    what: String,
}

impl CudaKvCache {
    pub(crate) fn new(device: &CudaDevice, spec: &KvCacheSpec, what: &str) -> Result<CudaKvCache> {
        spec.k_type.check_width(spec.width)?;
        spec.v_type.check_width(spec.width)?;
        let rows = spec.rows();
        let k = GrowableBuffer::reserve(device, layout(spec.k_type, rows, spec.width, 0).0, what)?;
        let v = GrowableBuffer::reserve(device, layout(spec.v_type, rows, spec.width, 0).0, what)?;
        Ok(CudaKvCache { spec: *spec, k, v, usable_blocks: 0, what: what.into() })
    }

    pub(crate) fn grow(&mut self, n_blocks: usize) -> Result<()> {
        if n_blocks > self.spec.n_blocks {
            return Err(BackendError::BadPlan(format!("{}: {n_blocks} blocks asked of a cache of {}", self.what, self.spec.n_blocks)));
        }
        let (rows, used) = (self.spec.rows(), n_blocks * KV_BLOCK_SIZE);
        for (buffer, ty) in [(&mut self.k, self.spec.k_type), (&mut self.v, self.spec.v_type)] {
            for range in layout(ty, rows, self.spec.width, used).1 {
                buffer.back(range, &self.what)?;
            }
        }
        self.usable_blocks = self.usable_blocks.max(n_blocks);
        Ok(())
    }

    pub fn spec(&self) -> &KvCacheSpec {
        &self.spec
    }

    pub fn usable_blocks(&self) -> usize {
        self.usable_blocks
    }

    /// Device addresses of the K and V buffers.
    pub fn pointers(&self) -> (u64, u64) {
        (self.k.base, self.v.base)
    }

    pub fn view(&self) -> KvView {
        KvView { k: self.k.base, v: self.v.base, k_bytes: self.k.reserved, v_bytes: self.v.reserved, usable_rows: self.usable_blocks * KV_BLOCK_SIZE }
    }

    /// Device memory mapped behind K and V now.
    pub fn mapped_bytes(&self) -> usize {
        self.k.mapped_bytes() + self.v.mapped_bytes()
    }
}

/// Device addresses and sizes of one layer's K and V buffers, as kernels take them.
#[derive(Clone, Copy, Debug)]
pub struct KvView {
    pub k: u64,
    pub v: u64,
    pub k_bytes: usize,
    pub v_bytes: usize,
    /// Rows backed by memory: a kernel reading past them faults (a growable cache maps only
    /// what the pool has handed out so far).
    pub usable_rows: usize,
}

impl KvView {
    /// A view of two plain buffers laid out as kv.cuh describes (tests build caches this way).
    pub fn of_slices(stream: &cudarc::driver::CudaStream, k: &cudarc::driver::CudaSlice<u8>, v: &cudarc::driver::CudaSlice<u8>) -> KvView {
        use cudarc::driver::DevicePtr;
        let (k_ptr, _k_record) = k.device_ptr(stream);
        let (v_ptr, _v_record) = v.device_ptr(stream);
        KvView { k: k_ptr, v: v_ptr, k_bytes: k.len(), v_bytes: v.len(), usable_rows: usize::MAX }
    }
}

/// `kiln_core::KvType` as the `KV_*` codes of kv.cuh.
pub fn kv_type_code(ty: KvType) -> i64 {
    match ty {
        KvType::F32 => 0,
        KvType::F16 => 1,
        KvType::Q8_0 => 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_kernel_header() {
        let header = include_str!("../kernels/kv.cuh");
        for (name, ty) in [("KV_F32", KvType::F32), ("KV_F16", KvType::F16), ("KV_Q8_0", KvType::Q8_0)] {
            assert!(header.contains(&format!("#define {name} {}", kv_type_code(ty))), "{name}");
        }
        assert!(header.contains("return (rows * width + 15) / 16 * 16;"));
        assert_eq!(q8_scales_at(3, 32), 96);
        let (bytes, ranges) = layout(KvType::Q8_0, 64, 32, 32);
        assert_eq!(bytes, 64 * 32 + 64 * 2);
        assert_eq!(ranges, [0..1024, 2048..2112]);
    }
}
