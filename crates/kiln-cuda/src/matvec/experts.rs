//! Expert-indexed products of a mixture of experts (`matvec_experts` in kernels/matvec.cuh):
//! every (token, chosen expert) slot multiplies its input row by the expert the router picked,
//! whose id the kernel reads from device memory. Nothing goes back to the host, so the product
//! sits inside a captured decode graph, and a token reads only its chosen experts' weights.
//! Past 8 tokens the slots are sorted into groups by expert and each group multiplied at
//! once, by the grouped mat-vec or the tensor-core mat-mat (`matmat_groups_*`), whichever
//! measured faster for the shape.
//!
//! The kernel finds the experts through a device table of their weight descriptors (one per
//! expert), made on the first product over that set of experts and kept for later ones: the
//! set is known by the descriptors themselves (the weights' device addresses), so a table can
//! never describe other weights than the ones it was made for.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use kiln_core::{Activation, ExpertInput};

use super::matmat::{fastest, gpu_key, group_tiles, is_capturing, launch_groups};
use super::matvec_shape::{choose_shape, default_shape, MatvecKind, TuneKey, MATVEC_SHAPES};
use super::{check_len, invalid, to_u32, GpuWeight, Kernel, QuantizedActivations, Storage, MAX_MATVEC_TOKENS};
use crate::tuning::{Tunable, TuningTable};
use crate::{CudaDevice, CudaError};

const OP: &str = "matmul_experts";

/// Slots one launch covers (the grid's y dimension is at most 65535).
const MAX_SLOTS_PER_LAUNCH: usize = 65535;
/// Slots of one expert per group of the grouped mat-vec (its kernels' NTOK).
const GROUP: usize = MAX_MATVEC_TOKENS;
/// `arch_ops.cu`'s GROUP_THREADS and GROUP_MAX_EXPERTS.
const GROUP_THREADS: u32 = 1024;
const GROUP_MAX_EXPERTS: usize = 1024;

/// The expert tables and the quantized inputs of the expert products of one device.
#[derive(Default)]
pub struct ExpertProducts {
    /// Device copies of the descriptor tables, by their bytes.
    tables: Mutex<HashMap<Vec<u8>, CudaSlice<u8>>>,
    /// Quantized input rows by row length, grown (outside graph captures) to the most rows
    /// asked; a grown buffer's predecessor is kept, since graphs captured earlier read it.
    inputs: Mutex<HashMap<usize, QuantizedActivations>>,
    retired: Mutex<Vec<QuantizedActivations>>,
    /// The grouped product's buffers, grown like the inputs (predecessors kept).
    grouping: Mutex<Option<Grouping>>,
    retired_groupings: Mutex<Vec<Grouping>>,
    /// The fused router's per-token tickets (router.rs), made on its first uncaptured call.
    pub(super) route_tickets: Mutex<Option<CudaSlice<u32>>>,
    /// The quantized input the last fused router wrote, until the next router call.
    pub(super) prefilled: Mutex<Option<Prefill>>,
}

/// A quantized input written beside its f32 source by the fused router: the source's device
/// address, its tokens and row length, and the buffer's fill count right after, so that a
/// product of that source skips the quantization while no other fill came between.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Prefill {
    pub(super) x: u64,
    pub(super) n: usize,
    pub(super) cols: usize,
    pub(super) fills: u64,
}

/// How a grouped product multiplies its groups: the mat-vec over groups of [`GROUP`] slots
/// (int8 activations), or the tensor-core mat-mat with streaming tile `tile`, whose token count
/// is the group size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GroupedWay {
    Matvec,
    Tiles { tile: usize, group: usize },
}

impl GroupedWay {
    fn group(self) -> usize {
        match self {
            GroupedWay::Matvec => GROUP,
            GroupedWay::Tiles { group, .. } => group,
        }
    }
}

/// Which way is fastest depends on the expert shape and on how many slots an expert gets on
/// average, so it is measured on the first uncaptured product of each (GPU, shape, type,
/// slots-per-expert bucket) and remembered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct GroupedKey {
    gpu: usize,
    rows: usize,
    cols: usize,
    ty: u32,
    /// log2 of the slots per expert, rounded up.
    per_expert: u32,
}

static TUNED_WAYS: TuningTable<GroupedKey, GroupedWay> = TuningTable::new("expert group shapes", |way| all_ways().any(|w| w == *way));

impl Tunable for GroupedWay {
    fn to_words(self) -> Vec<u64> {
        match self {
            GroupedWay::Matvec => vec![0],
            GroupedWay::Tiles { tile, group } => vec![1, tile as u64, group as u64],
        }
    }

    fn from_words(words: &[u64]) -> Option<Self> {
        match *words {
            [0] => Some(GroupedWay::Matvec),
            [1, tile, group] => Some(GroupedWay::Tiles { tile: usize::try_from(tile).ok()?, group: usize::try_from(group).ok()? }),
            _ => None,
        }
    }
}

/// Where the grouped product sorts a step's slots: each group's slots and expert, the group
/// count (all written on the device), the gathered input rows and the grouped outputs.
struct Grouping {
    group_slot: CudaSlice<u32>,
    group_expert: CudaSlice<u32>,
    n_groups: CudaSlice<u32>,
    x: CudaSlice<f32>,
    out: CudaSlice<f32>,
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
    /// the row `input` says; `out` is `[n][n_used][rows of an expert]`. Every expert must have
    /// one type and shape. The first call over a set of experts (and any call needing more
    /// input rows than before) must not be inside a graph capture; the engine runs every
    /// step shape once uncaptured first.
    pub fn matmul(&self, device: &CudaDevice, call: ExpertCall, out: &mut CudaSlice<f32>) -> Result<(), CudaError> {
        self.matmul_shaped(device, call, out, None, None)
    }

    /// [`ExpertProducts::matmul`] plus row r of `bias` (`[n_experts][rows]`) for each slot's
    /// expert, in the same launch; false, with nothing launched, where that launch does not
    /// apply (float experts, more than [`MAX_MATVEC_TOKENS`] tokens): the caller composes it.
    pub fn matmul_bias(&self, device: &CudaDevice, call: ExpertCall, bias: &CudaSlice<f32>, out: &mut CudaSlice<f32>) -> Result<bool, CudaError> {
        let first = call.check(out)?;
        if call.n > MAX_MATVEC_TOKENS || !matches!(first.storage, Storage::Quant { .. }) {
            return Ok(false);
        }
        check_len(OP, "bias", bias.len(), call.experts.len() * first.rows)?;
        self.matmul_shaped(device, call, out, None, Some(super::device_address(device, bias)))?;
        Ok(true)
    }

    /// [`ExpertProducts::matmul`] (with `bias` as [`ExpertProducts::matmul_bias`] adds it) of 1
    /// to [`MAX_MATVEC_TOKENS`] tokens in launch shape `shape` (< `MATVEC_SHAPE_COUNT`, a
    /// one-token shape of the experts' format) whatever measurement would pick, for tests and
    /// benchmarks.
    pub fn matmul_with_shape(
        &self,
        device: &CudaDevice,
        call: ExpertCall,
        bias: Option<&CudaSlice<f32>>,
        out: &mut CudaSlice<f32>,
        shape: usize,
    ) -> Result<(), CudaError> {
        let first = call.check(out)?;
        if call.n > MAX_MATVEC_TOKENS {
            return Err(invalid(OP, format!("a launch shape for {} tokens (the grouped product takes more than {MAX_MATVEC_TOKENS})", call.n)));
        }
        if !matches!(first.storage, Storage::Quant { .. }) {
            return Err(invalid(OP, format!("a launch shape or bias for {} experts (float experts take one row a warp and no bias)", first.ty)));
        }
        if let Some(bias) = bias {
            check_len(OP, "bias", bias.len(), call.experts.len() * first.rows)?;
        }
        self.matmul_shaped(device, call, out, Some(shape), bias.map(|b| super::device_address(device, b)))
    }

    /// `bias`: the device address of a quantized product's per-expert bias rows.
    fn matmul_shaped(
        &self,
        device: &CudaDevice,
        call: ExpertCall,
        out: &mut CudaSlice<f32>,
        forced: Option<usize>,
        bias: Option<u64>,
    ) -> Result<(), CudaError> {
        let ExpertCall { experts, x, ids, n, n_used, input } = call;
        let first = call.check(out)?;
        let slots = n * n_used;
        let in_rows = if input == ExpertInput::PerSlot { slots } else { n };
        if slots == 0 {
            return Ok(());
        }
        let float = matches!(first.storage, Storage::Float { .. });
        if float && first.cols % 4 != 0 {
            return Err(invalid(OP, format!("float experts of {} columns (a multiple of 4 is needed)", first.cols)));
        }
        let capturing = is_capturing(device);
        let table = self.table(device, experts, capturing)?;
        // Many tokens (a prompt, a large batch): slots grouped by expert, so each expert's
        // weights are read once per group of GROUP slots rather than once per slot.
        let max_groups = slots.div_ceil(GROUP) + experts.len().min(slots);
        if n > MAX_MATVEC_TOKENS && !float && experts.len() <= GROUP_MAX_EXPERTS && max_groups <= MAX_SLOTS_PER_LAUNCH {
            return self.matmul_grouped(device, &GroupedCall { call, table, capturing }, out);
        }
        let (n_experts, n_used32, per_slot) = (to_u32(OP, "experts", experts.len())?, to_u32(OP, "n_used", n_used)?, u32::from(input == ExpertInput::PerSlot));
        let (out_rows, cols) = (to_u32(OP, "rows", first.rows)?, to_u32(OP, "cols", first.cols)?);
        let inputs = if float { None } else { Some(self.quantized_input(device, first.cols, in_rows, capturing)?) };
        let quantized = match &inputs {
            Some(inputs) => {
                let buffer = &inputs[&first.cols];
                self.fill_unless_prefilled(device, buffer, x, in_rows)?;
                Some(buffer)
            }
            None => None,
        };
        let bias_address = bias.unwrap_or(0);
        let mut run = |shape: usize| -> Result<(), CudaError> {
            let function = first.kernels.get(device, &first.storage, Kernel::Matvec { ntok: 1, kind: MatvecKind::Experts, shape })?;
            let rows_per_block = MATVEC_SHAPES[shape].rows_per_block(MatvecKind::Experts);
            for slot0 in (0..slots).step_by(MAX_SLOTS_PER_LAUNCH) {
                let count = (slots - slot0).min(MAX_SLOTS_PER_LAUNCH);
                let cfg = LaunchConfig {
                    grid_dim: (out_rows.div_ceil(rows_per_block), count as u32, 1),
                    block_dim: (MATVEC_SHAPES[shape].threads(), 1, 1),
                    shared_mem_bytes: 0,
                };
                let slot0_32 = to_u32(OP, "slot", slot0)?;
                let mut target = out.slice_mut(slot0 * first.rows..(slot0 + count) * first.rows);
                let mut launch = device.stream().launch_builder(function);
                launch.arg(&table).arg(ids).arg(&n_experts).arg(&n_used32).arg(&per_slot).arg(&slot0_32);
                match quantized {
                    Some(q) => launch.arg(&q.codes).arg(&q.scales),
                    None => launch.arg(x).arg(&cols),
                };
                launch.arg(&mut target).arg(&out_rows);
                if quantized.is_some() {
                    launch.arg(&bias_address);
                }
                // SAFETY: argument lists match matvec_experts_* (matvec_{legacy,kquant,float}.cu);
                // the table holds one descriptor per expert (each covering rows x cols), the kernel
                // checks every id against n_experts, the input holds in_rows rows of cols values
                // (checked or quantized above), the output `count` slots of `rows` values and the
                // bias, where given, rows values per expert (matmul_bias checked it).
                unsafe { launch.launch(cfg) }.map_err(CudaError::driver(format!("launching the expert product of {}", first.name)))?;
            }
            Ok(())
        };
        // Float experts keep one row a warp (their callers force no shape and pass no bias); the
        // measured shapes are the quantized loop's.
        let shape = match forced {
            _ if float => default_shape(1),
            Some(shape) => one_token_shape(first, shape)?,
            None => choose_shape(device, TuneKey::experts(device, first, MatvecKind::Experts, slots), first, |_| 0.0, &mut run)?,
        };
        run(shape)
    }

    /// [`ExpertProducts::matmul`] over groups of slots, forced to way `way` (below
    /// [`grouped_ways`]: 0 the mat-vec over groups of 8 slots, then the tensor-core tiles), for
    /// tests and benchmarks; `matmul` measures the ways and picks one itself. Quantized experts
    /// only, uncaptured.
    pub fn matmul_grouped_way(&self, device: &CudaDevice, call: ExpertCall, out: &mut CudaSlice<f32>, way: usize) -> Result<(), CudaError> {
        let experts = call.experts;
        let first = call.check(out)?;
        if !matches!(first.storage, Storage::Quant { .. }) || experts.len() > GROUP_MAX_EXPERTS {
            return Err(invalid(OP, format!("grouped products take at most {GROUP_MAX_EXPERTS} quantized experts")));
        }
        let way = all_ways().nth(way).ok_or_else(|| invalid(OP, format!("way {way} of {}", grouped_ways())))?;
        let table = self.table(device, experts, false)?;
        self.grouped_with(device, &GroupedCall { call, table, capturing: false }, way, out)
    }

    /// `out[s] = act(x_t . gate[e] + gate_bias[e]) * (x_t . up[e] + up_bias[e])`, e = ids[s],
    /// for the `n * n_used` slots of `n` tokens (t = s / n_used), `call.experts` the gate
    /// experts and `gated` the up ones, their biases and the activation; all of one quantized
    /// type and shape, in one launch from one quantized input (`call.input` must be per token).
    /// `None` when the fused product does not apply (float experts, more than
    /// [`MAX_MATVEC_TOKENS`] tokens, mismatched sets), for the caller to compose it.
    pub fn matmul_gated(&self, device: &CudaDevice, call: ExpertCall, gated: GatedCall, out: &mut CudaSlice<f32>) -> Result<Option<()>, CudaError> {
        self.gated_shaped(device, call, gated, out, None)
    }

    /// [`ExpertProducts::matmul_gated`] in launch shape `shape` (as
    /// [`ExpertProducts::matmul_with_shape`]), for tests and benchmarks.
    pub fn matmul_gated_with_shape(
        &self,
        device: &CudaDevice,
        call: ExpertCall,
        gated: GatedCall,
        out: &mut CudaSlice<f32>,
        shape: usize,
    ) -> Result<Option<()>, CudaError> {
        self.gated_shaped(device, call, gated, out, Some(shape))
    }

    fn gated_shaped(
        &self,
        device: &CudaDevice,
        call: ExpertCall,
        gated: GatedCall,
        out: &mut CudaSlice<f32>,
        forced: Option<usize>,
    ) -> Result<Option<()>, CudaError> {
        let (ExpertCall { experts: gate, x, ids, n, n_used, input }, up) = (call, gated.up);
        if input != ExpertInput::PerToken {
            return Err(invalid(OP, "the gated expert product takes one input row per token"));
        }
        let Some(first) = gate.first() else { return Ok(None) };
        let same = |w: &GpuWeight| (w.ty, w.rows, w.cols) == (first.ty, first.rows, first.cols) && matches!(w.storage, Storage::Quant { .. });
        if n > MAX_MATVEC_TOKENS || gate.len() != up.len() || !gate.iter().chain(up).all(same) {
            return Ok(None);
        }
        let biases = match gated.bias {
            Some(pair) => {
                for bias in pair {
                    check_len(OP, "bias", bias.len(), gate.len() * first.rows)?;
                }
                pair.map(|bias| super::device_address(device, bias))
            }
            None => [0, 0],
        };
        let (act, alpha, limit) = super::gate_code(gated.act);
        let slots = n * n_used;
        check_len(OP, "ids", ids.len(), slots)?;
        check_len(OP, "x", x.len(), n * first.cols)?;
        check_len(OP, "out", out.len(), slots * first.rows)?;
        if slots == 0 {
            return Ok(Some(()));
        }
        let capturing = is_capturing(device);
        let (gate_table, up_table) = (self.table(device, gate, capturing)?, self.table(device, up, capturing)?);
        let inputs = self.quantized_input(device, first.cols, n, capturing)?;
        let q = &inputs[&first.cols];
        self.fill_unless_prefilled(device, q, x, n)?;
        let (n_experts, n_used32, rows32, slot0) = (to_u32(OP, "experts", gate.len())?, to_u32(OP, "n_used", n_used)?, to_u32(OP, "rows", first.rows)?, 0u32);
        let slots32 = to_u32(OP, "slots", slots)?;
        let mut run = |shape: usize| -> Result<(), CudaError> {
            let function = first.kernels.get(device, &first.storage, Kernel::Matvec { ntok: 1, kind: MatvecKind::ExpertsGated, shape })?;
            let rows_per_block = MATVEC_SHAPES[shape].rows_per_block(MatvecKind::ExpertsGated);
            let cfg = LaunchConfig {
                grid_dim: (rows32.div_ceil(rows_per_block), slots32, 1),
                block_dim: (MATVEC_SHAPES[shape].threads(), 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: matvec_experts_gated_* (matvec_{legacy,kquant}.cu): both tables hold one
            // descriptor per expert of one shape, the kernel checks every id, the quantized input
            // holds n rows of cols, out slots rows of `rows` and each bias, where given, rows
            // values per expert (checked above; slots <= 64).
            unsafe {
                device
                    .stream()
                    .launch_builder(function)
                    .arg(&gate_table)
                    .arg(&up_table)
                    .arg(ids)
                    .arg(&n_experts)
                    .arg(&n_used32)
                    .arg(&slot0)
                    .arg(&q.codes)
                    .arg(&q.scales)
                    .arg(&mut *out)
                    .arg(&rows32)
                    .arg(&biases[0])
                    .arg(&biases[1])
                    .arg(&act)
                    .arg(&alpha)
                    .arg(&limit)
                    .launch(cfg)
            }
            .map_err(CudaError::driver(format!("launching the gated expert product of {}", first.name)))?;
            Ok(())
        };
        let shape = match forced {
            Some(shape) => one_token_shape(first, shape)?,
            None => choose_shape(device, TuneKey::experts(device, first, MatvecKind::ExpertsGated, slots), first, |_| 0.0, &mut run)?,
        };
        run(shape)?;
        Ok(Some(()))
    }

    /// Quantizes `n` rows of `x` into `q`, unless the fused router wrote exactly those.
    fn fill_unless_prefilled(&self, device: &CudaDevice, q: &QuantizedActivations, x: &CudaSlice<f32>, n: usize) -> Result<(), CudaError> {
        if self.holds_prefilled(device, q, x, n) {
            return Ok(());
        }
        q.fill(device, x, n)
    }

    fn holds_prefilled(&self, device: &CudaDevice, q: &QuantizedActivations, x: &CudaSlice<f32>, n: usize) -> bool {
        let written = Prefill { x: super::device_address(device, x), n, cols: q.cols(), fills: q.fills() };
        *self.prefilled.lock().unwrap_or_else(PoisonError::into_inner) == Some(written)
    }

    /// The experts' int8 input of `n` rows of `cols` values, locked, where the experts' norm
    /// wrote it beside `x` and nothing has filled it since (a shared expert's products read
    /// it too); None otherwise. As for the expert products, the caller must not have written
    /// `x` since the norm: the check sees the buffer's address and fills, not its values.
    pub fn prefilled_input(
        &self,
        device: &CudaDevice,
        x: &CudaSlice<f32>,
        n: usize,
        cols: usize,
    ) -> Option<MutexGuard<'_, HashMap<usize, QuantizedActivations>>> {
        let inputs = self.inputs.lock().unwrap_or_else(PoisonError::into_inner);
        let held = inputs.get(&cols).is_some_and(|q| self.holds_prefilled(device, q, x, n));
        held.then_some(inputs)
    }

    pub(super) fn quantized_input(
        &self,
        device: &CudaDevice,
        cols: usize,
        rows: usize,
        capturing: bool,
    ) -> Result<std::sync::MutexGuard<'_, HashMap<usize, QuantizedActivations>>, CudaError> {
        let mut inputs = self.inputs.lock().unwrap_or_else(PoisonError::into_inner);
        if inputs.get(&cols).is_none_or(|have| have.max_tokens() < rows) {
            if capturing {
                return Err(invalid(OP, format!("{rows} input rows of {cols} values need a larger buffer inside a graph capture")));
            }
            let grown = QuantizedActivations::new(device, rows.next_power_of_two(), cols)?;
            if let Some(old) = inputs.insert(cols, grown) {
                self.retired.lock().unwrap_or_else(PoisonError::into_inner).push(old);
            }
        }
        Ok(inputs)
    }

    /// The grouped product: sort the slots by expert into groups (moe_group_slots), gather
    /// their input rows group by group, multiply each group by its expert (the mat-vec over
    /// groups of 8 or the tensor-core mat-mat over groups of a streaming tile's token count,
    /// whichever measured faster for this shape) and scatter the rows back to the slots.
    fn matmul_grouped(&self, device: &CudaDevice, call: &GroupedCall, out: &mut CudaSlice<f32>) -> Result<(), CudaError> {
        let (experts, slots) = (call.call.experts, call.call.n * call.call.n_used);
        let first = &experts[0];
        let per_expert = slots.div_ceil(experts.len()).next_power_of_two().trailing_zeros();
        let key = GroupedKey { gpu: gpu_key(device), rows: first.rows, cols: first.cols, ty: first.ty.id(), per_expert };
        let remembered = TUNED_WAYS.get(device, &key);
        let way = match remembered {
            Some(way) => way,
            None if call.capturing => GroupedWay::Matvec,
            None => {
                let ways: Vec<GroupedWay> = all_ways().collect();
                let way = fastest(device, "expert group shapes", &ways, |way| self.grouped_with(device, call, way, out))?;
                TUNED_WAYS.insert(device, key, way);
                way
            }
        };
        self.grouped_with(device, call, way, out)
    }

    /// The grouped product with `way`.
    fn grouped_with(&self, device: &CudaDevice, call: &GroupedCall, way: GroupedWay, out: &mut CudaSlice<f32>) -> Result<(), CudaError> {
        let &GroupedCall { call: ExpertCall { experts, x, ids, n, n_used, input }, table, capturing } = call;
        let slots = n * n_used;
        let first = &experts[0];
        let group = way.group();
        let max_groups = slots.div_ceil(group) + experts.len().min(slots);
        let entries = max_groups * group;
        let mut grouping = self.grouping.lock().unwrap_or_else(PoisonError::into_inner);
        let fits = |g: &Grouping| {
            g.group_slot.len() >= entries && g.group_expert.len() >= max_groups && g.x.len() >= entries * first.cols && g.out.len() >= entries * first.rows
        };
        if !grouping.as_ref().is_some_and(fits) {
            if capturing {
                return Err(invalid(OP, format!("{slots} expert slots need larger grouping buffers inside a graph capture")));
            }
            let have = |f: fn(&Grouping) -> usize| grouping.as_ref().map_or(0, f);
            let grown = Grouping {
                group_slot: device.alloc_zeros(entries.max(have(|g| g.group_slot.len())).next_power_of_two(), "expert group slots")?,
                group_expert: device.alloc_zeros(max_groups.max(have(|g| g.group_expert.len())).next_power_of_two(), "expert group experts")?,
                n_groups: device.alloc_zeros(1, "expert group count")?,
                x: device.alloc_zeros((entries * first.cols).max(have(|g| g.x.len())).next_power_of_two(), "expert group inputs")?,
                out: device.alloc_zeros((entries * first.rows).max(have(|g| g.out.len())).next_power_of_two(), "expert group outputs")?,
            };
            if let Some(old) = grouping.replace(grown) {
                self.retired_groupings.lock().unwrap_or_else(PoisonError::into_inner).push(old);
            }
        }
        let g = grouping.as_mut().expect("made above");
        let function = |name: &str| device.registry().function("arch_ops", name, &[]);
        let (sort, gather, scatter) = (function("moe_group_slots")?, function("moe_gather_rows")?, function("moe_scatter_rows")?);
        let (slots32, experts32, group32, max_groups32) =
            (to_u32(OP, "slots", slots)?, to_u32(OP, "experts", experts.len())?, to_u32(OP, "group", group)?, to_u32(OP, "groups", max_groups)?);
        let (rows32, cols32, n_used32, per_slot) =
            (to_u32(OP, "rows", first.rows)?, to_u32(OP, "cols", first.cols)?, to_u32(OP, "n_used", n_used)?, u32::from(input == ExpertInput::PerSlot));
        let stream = device.stream();
        let one_block = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (GROUP_THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: moe_group_slots(ids, n_slots, n_experts, group, max_groups, group_slot,
        // group_expert, n_groups, out, rows): ids hold `slots` values, the group buffers
        // max_groups groups of `group` (sized above), out slots * rows values (checked by the
        // caller).
        unsafe {
            stream
                .launch_builder(&sort)
                .arg(ids)
                .arg(&slots32)
                .arg(&experts32)
                .arg(&group32)
                .arg(&max_groups32)
                .arg(&mut g.group_slot)
                .arg(&mut g.group_expert)
                .arg(&mut g.n_groups)
                .arg(&mut *out)
                .arg(&rows32)
                .launch(one_block)
        }
        .map_err(CudaError::driver("launching moe_group_slots"))?;
        let gather_len = (entries * first.cols) as u64;
        // SAFETY: moe_gather_rows(dst, src, group_slot, n_groups, group, n_used, per_slot, cols,
        // n): dst holds entries rows of cols, src every slot's (or token's) row (checked).
        unsafe {
            stream
                .launch_builder(&gather)
                .arg(&mut g.x)
                .arg(x)
                .arg(&g.group_slot)
                .arg(&g.n_groups)
                .arg(&group32)
                .arg(&n_used32)
                .arg(&per_slot)
                .arg(&cols32)
                .arg(&gather_len)
                .launch(super::stride_launch(entries * first.cols))
        }
        .map_err(CudaError::driver("launching moe_gather_rows"))?;
        match way {
            GroupedWay::Matvec => self.matvec_groups(device, first, table, g, entries, max_groups32)?,
            GroupedWay::Tiles { tile, .. } => {
                if !launch_groups(device, first, table, &g.group_expert, &g.n_groups, &g.x, &mut g.out, max_groups, tile)? {
                    return Err(invalid(OP, format!("{slots} expert slots need a larger f16 scratch inside a graph capture")));
                }
            }
        }
        let scatter_len = (entries * first.rows) as u64;
        // SAFETY: moe_scatter_rows(out, src, group_slot, n_groups, group, rows, n): every slot
        // id in group_slot is below `slots`, whose rows `out` holds.
        unsafe {
            stream
                .launch_builder(&scatter)
                .arg(out)
                .arg(&g.out)
                .arg(&g.group_slot)
                .arg(&g.n_groups)
                .arg(&group32)
                .arg(&rows32)
                .arg(&scatter_len)
                .launch(super::stride_launch(entries * first.rows))
        }
        .map_err(CudaError::driver("launching moe_scatter_rows"))?;
        Ok(())
    }

    /// The grouped mat-vec: the gathered rows quantized to int8, each group of [`GROUP`] rows
    /// multiplied by its expert.
    fn matvec_groups(&self, device: &CudaDevice, first: &GpuWeight, table: u64, g: &mut Grouping, entries: usize, max_groups32: u32) -> Result<(), CudaError> {
        let inputs = self.quantized_input(device, first.cols, entries, is_capturing(device))?;
        let q = &inputs[&first.cols];
        q.fill(device, &g.x, entries)?;
        let rows32 = to_u32(OP, "rows", first.rows)?;
        let shape = default_shape(GROUP);
        let product = first.kernels.get(device, &first.storage, Kernel::Matvec { ntok: GROUP, kind: MatvecKind::ExpertGroups, shape })?;
        let rows_per_block = MATVEC_SHAPES[shape].rows_per_block(MatvecKind::ExpertGroups);
        let cfg = LaunchConfig {
            grid_dim: (rows32.div_ceil(rows_per_block), max_groups32, 1),
            block_dim: (MATVEC_SHAPES[shape].threads(), 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matvec_expert_groups_* (matvec_{legacy,kquant}.cu): the table holds one
        // descriptor per expert, the sort kernel wrote only valid experts into group_expert,
        // the quantized rows and the outputs hold entries = max_groups * GROUP rows.
        unsafe {
            device
                .stream()
                .launch_builder(product)
                .arg(&table)
                .arg(&g.group_expert)
                .arg(&g.n_groups)
                .arg(&q.codes)
                .arg(&q.scales)
                .arg(&mut g.out)
                .arg(&rows32)
                .launch(cfg)
        }
        .map_err(CudaError::driver(format!("launching the grouped expert product of {}", first.name)))?;
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

/// `shape` if it is a one-token launch shape of `w`'s format (an expert product's kernels are
/// the one-token module's), else an error naming it.
fn one_token_shape(w: &GpuWeight, shape: usize) -> Result<usize, CudaError> {
    match MATVEC_SHAPES.get(shape) {
        Some(s) if s.fits(1, w.is_grouped()) => Ok(shape),
        _ => Err(invalid(OP, format!("launch shape {shape} is not a one-token shape of {}", w.ty))),
    }
}

/// The ways a grouped product can run: the mat-vec, then the tensor-core tiles.
fn all_ways() -> impl Iterator<Item = GroupedWay> {
    [GroupedWay::Matvec].into_iter().chain(group_tiles().map(|(tile, group)| GroupedWay::Tiles { tile, group }))
}

/// How many ways [`ExpertProducts::matmul_grouped_way`] takes.
pub fn grouped_ways() -> usize {
    all_ways().count()
}

/// The operands of an expert product: `n` tokens choosing `n_used` experts each (their ids in
/// `ids`, `[n][n_used]`), the input rows `x` per token or per slot as `input` says.
#[derive(Clone, Copy)]
pub struct ExpertCall<'a> {
    pub experts: &'a [GpuWeight],
    pub x: &'a CudaSlice<f32>,
    pub ids: &'a CudaSlice<f32>,
    pub n: usize,
    pub n_used: usize,
    pub input: ExpertInput,
}

impl<'a> ExpertCall<'a> {
    /// Checks the operands against each other and `out`; the first expert, whose type and
    /// shape all share.
    fn check(&self, out: &CudaSlice<f32>) -> Result<&'a GpuWeight, CudaError> {
        let first = self.experts.first().ok_or_else(|| invalid(OP, "a product over no experts"))?;
        if let Some(w) = self.experts.iter().find(|w| (w.ty, w.rows, w.cols) != (first.ty, first.rows, first.cols)) {
            return Err(invalid(OP, format!("expert {} ({} {}x{}) among experts of {} {}x{}", w.name, w.ty, w.rows, w.cols, first.ty, first.rows, first.cols)));
        }
        let slots = self.n * self.n_used;
        let in_rows = if self.input == ExpertInput::PerSlot { slots } else { self.n };
        check_len(OP, "ids", self.ids.len(), slots)?;
        check_len(OP, "x", self.x.len(), in_rows * first.cols)?;
        check_len(OP, "out", out.len(), slots * first.rows)?;
        Ok(first)
    }
}

/// The second half of a gated expert product ([`ExpertProducts::matmul_gated`]): the up experts,
/// the per-expert biases of gate and up (`[n_experts][rows]` each) and the activation.
#[derive(Clone, Copy)]
pub struct GatedCall<'a> {
    pub up: &'a [GpuWeight],
    pub bias: Option<[&'a CudaSlice<f32>; 2]>,
    pub act: Activation,
}

/// The operands of one grouped product: the call, its experts' device table, and whether the
/// stream is being captured.
struct GroupedCall<'a> {
    call: ExpertCall<'a>,
    table: u64,
    capturing: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grouped_ways_round_trip_through_their_words() {
        for way in all_ways() {
            assert_eq!(GroupedWay::from_words(&way.to_words()), Some(way));
        }
        assert_eq!(GroupedWay::from_words(&[2]), None);
    }
}
