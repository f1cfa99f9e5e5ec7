//! Expert-indexed products of a mixture of experts (`matvec_experts` in kernels/matvec.cuh):
//! every (token, chosen expert) slot multiplies its input row by the expert the router picked,
//! whose id the kernel reads from device memory. Nothing goes back to the host, so the product
//! sits inside a captured decode graph, and a token reads only its chosen experts' weights.
//!
//! The kernel finds the experts through a device table of their weight descriptors (one per
//! expert), made on the first product over that set of experts and kept for later ones: the
//! set is known by the descriptors themselves (the weights' device addresses), so a table can
//! never describe other weights than the ones it was made for.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::matmat::is_capturing;
use super::matvec_shape::{default_shape, MatvecKind, MATVEC_SHAPES};
use super::{check_len, invalid, to_u32, GpuWeight, Kernel, QuantizedActivations, Storage, MV_WARPS};
use crate::{CudaDevice, CudaError};

const OP: &str = "matmul_experts";

/// Slots one launch covers (the grid's y dimension is at most 65535).
const MAX_SLOTS_PER_LAUNCH: usize = 65535;

/// Which input row a slot reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertInputRows {
    /// Token `slot / n_used`'s row, shared by its chosen experts (gate and up products).
    PerToken,
    /// The slot's own row (the down product of the slots' activations).
    PerSlot,
}

/// The expert tables and the quantized inputs of the expert products of one device.
#[derive(Default)]
pub struct ExpertProducts {
    /// Device copies of the descriptor tables, by their bytes.
    tables: Mutex<HashMap<Vec<u8>, CudaSlice<u8>>>,
    /// Quantized input rows by row length, grown (outside graph captures) to the most rows
    /// asked; a grown buffer's predecessor is kept, since graphs captured earlier read it.
    inputs: Mutex<HashMap<usize, QuantizedActivations>>,
    retired: Mutex<Vec<QuantizedActivations>>,
}

/// The bytes of one expert's descriptor, as the kernel's table holds it.
fn descriptor(w: &GpuWeight) -> Vec<u8> {
    // SAFETY: PlanesArg and FloatArg are plain #[repr(C)] structs of integers (no padding
    // bytes left uninitialized: their explicit `_pad` fields are part of the value).
    unsafe {
        match &w.storage {
            Storage::Quant { planes, .. } => {
                std::slice::from_raw_parts((planes as *const super::PlanesArg).cast::<u8>(), size_of::<super::PlanesArg>()).to_vec()
            }
            Storage::Float { rows, .. } => std::slice::from_raw_parts((rows as *const super::FloatArg).cast::<u8>(), size_of::<super::FloatArg>()).to_vec(),
        }
    }
}

impl ExpertProducts {
    /// `out[s] = x_in(s) . experts[ids[s]]` for the `n * n_used` slots of `n` tokens, `x_in(s)`
    /// the row `rows` says; `out` is `[n][n_used][rows of an expert]`. Every expert must have
    /// one type and shape. The first call over a set of experts (and any call needing more
    /// input rows than before) must not be inside a graph capture; the engine runs every
    /// step shape once uncaptured first.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        device: &CudaDevice,
        experts: &[GpuWeight],
        x: &CudaSlice<f32>,
        ids: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        n: usize,
        n_used: usize,
        rows: ExpertInputRows,
    ) -> Result<(), CudaError> {
        let first = experts.first().ok_or_else(|| invalid(OP, "a product over no experts"))?;
        if let Some(w) = experts.iter().find(|w| (w.ty, w.rows, w.cols) != (first.ty, first.rows, first.cols)) {
            return Err(invalid(OP, format!("expert {} ({} {}x{}) among experts of {} {}x{}", w.name, w.ty, w.rows, w.cols, first.ty, first.rows, first.cols)));
        }
        let slots = n * n_used;
        let in_rows = if rows == ExpertInputRows::PerSlot { slots } else { n };
        check_len(OP, "ids", ids.len(), slots)?;
        check_len(OP, "x", x.len(), in_rows * first.cols)?;
        check_len(OP, "out", out.len(), slots * first.rows)?;
        if slots == 0 {
            return Ok(());
        }
        let float = matches!(first.storage, Storage::Float { .. });
        if float && first.cols % 4 != 0 {
            return Err(invalid(OP, format!("float experts of {} columns (a multiple of 4 is needed)", first.cols)));
        }
        let capturing = is_capturing(device);
        let table = self.table(device, experts, capturing)?;
        let shape = default_shape(1);
        let function = first.kernels.get(device, &first.storage, Kernel::Matvec { ntok: 1, kind: MatvecKind::Experts, shape })?;
        let rows_per_block = MV_WARPS * MATVEC_SHAPES[shape].rows(MatvecKind::Experts);
        let (n_experts, n_used32, per_slot) =
            (to_u32(OP, "experts", experts.len())?, to_u32(OP, "n_used", n_used)?, u32::from(rows == ExpertInputRows::PerSlot));
        let (out_rows, cols) = (to_u32(OP, "rows", first.rows)?, to_u32(OP, "cols", first.cols)?);
        let mut inputs = self.inputs.lock().unwrap_or_else(PoisonError::into_inner);
        let quantized = if float {
            None
        } else {
            if inputs.get(&first.cols).is_none_or(|have| have.max_tokens() < in_rows) {
                if capturing {
                    return Err(invalid(OP, format!("{in_rows} input rows of {} values need a larger buffer inside a graph capture", first.cols)));
                }
                let grown = QuantizedActivations::new(device, in_rows.next_power_of_two(), first.cols)?;
                if let Some(old) = inputs.insert(first.cols, grown) {
                    self.retired.lock().unwrap_or_else(PoisonError::into_inner).push(old);
                }
            }
            let buffer = &inputs[&first.cols];
            buffer.fill(device, x, in_rows)?;
            Some(buffer)
        };
        for slot0 in (0..slots).step_by(MAX_SLOTS_PER_LAUNCH) {
            let count = (slots - slot0).min(MAX_SLOTS_PER_LAUNCH);
            let cfg = LaunchConfig { grid_dim: (out_rows.div_ceil(rows_per_block), count as u32, 1), block_dim: (MV_WARPS * 32, 1, 1), shared_mem_bytes: 0 };
            let slot0_32 = to_u32(OP, "slot", slot0)?;
            let mut target = out.slice_mut(slot0 * first.rows..(slot0 + count) * first.rows);
            let mut launch = device.stream().launch_builder(function);
            launch.arg(&table).arg(ids).arg(&n_experts).arg(&n_used32).arg(&per_slot).arg(&slot0_32);
            match quantized {
                Some(q) => launch.arg(&q.codes).arg(&q.scales),
                None => launch.arg(x).arg(&cols),
            };
            launch.arg(&mut target).arg(&out_rows);
            // SAFETY: argument lists match matvec_experts_* (matvec_{legacy,kquant,float}.cu);
            // the table holds one descriptor per expert (each covering rows x cols), the kernel
            // checks every id against n_experts, the input holds in_rows rows of cols values
            // (checked or quantized above) and the output `count` slots of `rows` values.
            unsafe { launch.launch(cfg) }.map_err(CudaError::driver(format!("launching the expert product of {}", first.name)))?;
        }
        Ok(())
    }

    /// The device table of these experts' descriptors, uploaded on first use.
    fn table(&self, device: &CudaDevice, experts: &[GpuWeight], capturing: bool) -> Result<u64, CudaError> {
        let bytes: Vec<u8> = experts.iter().flat_map(descriptor).collect();
        let mut tables = self.tables.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(table) = tables.get(&bytes) {
            return Ok(super::device_address(device, table));
        }
        if capturing {
            return Err(invalid(OP, format!("the expert table of {} is first needed inside a graph capture", experts[0].name)));
        }
        let table = device.upload(&bytes, "expert table")?;
        let address = super::device_address(device, &table);
        tables.insert(bytes, table);
        Ok(address)
    }
}
