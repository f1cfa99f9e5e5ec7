//! Which compiled kernel each product of a weight runs: the source, name and defines of every
//! kernel a weight's storage may launch, and the per-weight slots that keep each one after its
//! first lookup.

use std::sync::OnceLock;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::CudaFunction;

use super::matmat::MMA_TILES;
use super::matvec_shape::{candidates, default_shape, MatvecKind, MATVEC_SHAPES};
use super::{GpuWeight, Storage, MATMAT_TILES, MAX_MATVEC_TOKENS, MV_WARPS};
use crate::{CudaDevice, CudaError};

/// Kernels of one weight, looked up on first use and kept for later launches. On the heap: a
/// model's weights would otherwise carry several hundred slots each wherever they are moved,
/// enough to overflow a 2 MiB thread stack while a model loads.
pub(super) struct KernelSlots(Box<[OnceLock<CudaFunction>]>);

impl Default for KernelSlots {
    fn default() -> Self {
        KernelSlots((0..KernelSlots::COUNT).map(|_| OnceLock::new()).collect())
    }
}

#[derive(Clone, Copy)]
pub(super) enum Kernel {
    Matvec {
        ntok: usize,
        kind: MatvecKind,
        /// Index into [`MATVEC_SHAPES`].
        shape: usize,
    },
    Matmat {
        tile: usize,
        swiglu: bool,
    },
    /// Experts over groups of gathered slots (`matmat_groups_*`), streaming tiles only.
    MatmatGroups {
        tile: usize,
    },
    /// The f16 activation conversion (`mma_half_activations`) of `tile`'s module.
    MatmatHalf {
        tile: usize,
    },
    /// The split-K reduction (`mma_reduce_splits`) of `tile`'s module.
    MatmatReduce {
        tile: usize,
    },
    /// Two or three weights on one input (`matmat_stacked_*`), pipelined tiles only.
    MatmatStacked {
        tile: usize,
    },
    /// The split-K reduction of a stacked launch (`mma_reduce_stacked`).
    MatmatReduceStacked {
        tile: usize,
    },
    Embed,
}

impl KernelSlots {
    const MATVECS: usize = MatvecKind::COUNT * MAX_MATVEC_TOKENS * MATVEC_SHAPES.len();
    const COUNT: usize = Self::MATVECS + 7 * MATMAT_TILES + 1;

    pub(super) fn get(&self, device: &CudaDevice, storage: &Storage, kernel: Kernel) -> Result<&CudaFunction, CudaError> {
        let index = match kernel {
            Kernel::Matvec { ntok, kind, shape } => (shape * MAX_MATVEC_TOKENS + ntok - 1) * MatvecKind::COUNT + kind.index(),
            Kernel::Matmat { tile, swiglu } => Self::MATVECS + 2 * tile + usize::from(swiglu),
            Kernel::MatmatHalf { tile } => Self::MATVECS + 2 * MATMAT_TILES + tile,
            Kernel::MatmatReduce { tile } => Self::MATVECS + 3 * MATMAT_TILES + tile,
            Kernel::MatmatGroups { tile } => Self::MATVECS + 4 * MATMAT_TILES + tile,
            Kernel::MatmatStacked { tile } => Self::MATVECS + 5 * MATMAT_TILES + tile,
            Kernel::MatmatReduceStacked { tile } => Self::MATVECS + 6 * MATMAT_TILES + tile,
            Kernel::Embed => Self::MATVECS + 7 * MATMAT_TILES,
        };
        if let Some(function) = self.0[index].get() {
            return Ok(function);
        }
        let (source, name, defines) = kernel_id(storage, kernel);
        let function = device.registry().function(source, &name, &defines)?;
        if let Kernel::Matmat { tile, .. } | Kernel::MatmatGroups { tile } | Kernel::MatmatStacked { tile } = kernel {
            let shared = MMA_TILES[tile].shared_bytes();
            if shared > 0 {
                function
                    .set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared as i32)
                    .map_err(CudaError::driver(format!("raising {name}'s shared memory limit")))?;
            }
        }
        Ok(self.0[index].get_or_init(|| function))
    }
}

/// The modules `w`'s kernels come from: the mat-vec ones of [`matvec_module_keys`], every
/// mat-mat tile (prompts and large batches) and the embedding lookup.
pub fn module_keys(w: &GpuWeight) -> Vec<(&'static str, Vec<(&'static str, i64)>)> {
    let mut kernels = vec![Kernel::Embed];
    kernels.extend((0..MATMAT_TILES).map(|tile| Kernel::Matmat { tile, swiglu: false }));
    let mut keys = sources_of(w, kernels);
    keys.extend(matvec_module_keys(w));
    keys
}

/// The mat-vec modules of `w` for every token count and launch shape the tuner may time (decode
/// and small batches); a quantized format's modules hold only its own kernels, so they compile
/// quickly.
pub fn matvec_module_keys(w: &GpuWeight) -> Vec<(&'static str, Vec<(&'static str, i64)>)> {
    let mut kernels = Vec::new();
    for ntok in 1..=MAX_MATVEC_TOKENS {
        if w.is_quantized() {
            kernels.extend(candidates(ntok, w).map(|shape| Kernel::Matvec { ntok, kind: MatvecKind::Plain, shape }));
        } else {
            kernels.push(Kernel::Matvec { ntok, kind: MatvecKind::Plain, shape: default_shape(ntok) });
        }
    }
    sources_of(w, kernels)
}

/// Compiles (or loads) the modules of `kernels` of `w` on all cores, so that a tuner's first
/// timing of several candidates does not compile them one after another.
pub(super) fn prepare_kernels(device: &CudaDevice, w: &GpuWeight, kernels: impl IntoIterator<Item = Kernel>) -> Result<(), CudaError> {
    device.registry().prepare(&sources_of(w, kernels.into_iter().collect()))
}

fn sources_of(w: &GpuWeight, kernels: Vec<Kernel>) -> Vec<(&'static str, Vec<(&'static str, i64)>)> {
    kernels
        .into_iter()
        .map(|k| {
            let (source, _, defines) = kernel_id(&w.storage, k);
            (source, defines)
        })
        .collect()
}

/// Looks up the mat-mat kernels of `w` that take dynamic shared memory (their modules compiled,
/// see [`module_keys`]) and raises their limit. Raising it is not allowed while a stream is
/// being captured, so a backend does this when it loads a model, before any graph; the other
/// tiles are looked up on first use, which a capture allows.
pub fn resolve_matmat_kernels(device: &CudaDevice, w: &GpuWeight) -> Result<(), CudaError> {
    for tile in (0..MATMAT_TILES).filter(|&t| MMA_TILES[t].shared_bytes() > 0) {
        for swiglu in [false, true] {
            w.kernels.get(device, &w.storage, Kernel::Matmat { tile, swiglu })?;
        }
    }
    Ok(())
}

/// The GGML type whose name is the kernel suffix `suffix` (`q4_k`, `f16`), as the `MMA_TYPE`
/// that selects its kernels in matmat_mma.cu.
pub(super) fn kernel_type_id(suffix: &str) -> i64 {
    kiln_quant::ALL_TYPES.iter().find(|t| t.to_string().eq_ignore_ascii_case(suffix)).map_or(-1, |t| i64::from(t.id()))
}

/// Source file, kernel name and compile-time defines of `kernel` for weights stored as `storage`.
pub(super) fn kernel_id(storage: &Storage, kernel: Kernel) -> (&'static str, String, Vec<(&'static str, i64)>) {
    let suffix = match storage {
        Storage::Quant { layout, .. } => layout.kernel,
        Storage::Float { kind, .. } => kind.kernel(),
    };
    let fused = |swiglu: bool| if swiglu { "swiglu_" } else { "" };
    match kernel {
        Kernel::Matvec { ntok, kind, shape } => {
            let source = match storage {
                Storage::Float { .. } => "matvec_float",
                Storage::Quant { layout, .. } if layout.block_values() == 256 => "matvec_kquant",
                Storage::Quant { .. } => "matvec_legacy",
            };
            let s = MATVEC_SHAPES[shape];
            let mut defines = vec![("NTOK", ntok as i64), ("ROWS_PER_WARP", i64::from(s.rows_per_warp))];
            if matches!(storage, Storage::Quant { .. }) {
                defines.extend([("MV_BATCH", i64::from(s.batch)), ("MV_TYPE", kernel_type_id(suffix))]);
                if s.split > 1 {
                    defines.push(("MV_SPLIT", i64::from(s.split)));
                }
                if s.warps != MV_WARPS {
                    defines.push(("MV_WARPS", i64::from(s.warps)));
                }
            }
            (source, format!("matvec_{}{suffix}", kind.prefix()), defines)
        }
        Kernel::Matmat { tile, swiglu } => {
            let mut defines = MMA_TILES[tile].defines();
            defines.push(("MMA_TYPE", kernel_type_id(suffix)));
            ("matmat_mma", format!("matmat_{}{suffix}", fused(swiglu)), defines)
        }
        Kernel::MatmatGroups { tile } => {
            let mut defines = MMA_TILES[tile].defines();
            defines.push(("MMA_TYPE", kernel_type_id(suffix)));
            ("matmat_mma", format!("matmat_groups_{suffix}"), defines)
        }
        Kernel::MatmatStacked { tile } => {
            let mut defines = MMA_TILES[tile].defines();
            defines.push(("MMA_TYPE", kernel_type_id(suffix)));
            ("matmat_mma", format!("matmat_stacked_{suffix}"), defines)
        }
        Kernel::MatmatHalf { tile } | Kernel::MatmatReduce { tile } | Kernel::MatmatReduceStacked { tile } => {
            let mut defines = MMA_TILES[tile].defines();
            defines.push(("MMA_TYPE", kernel_type_id(suffix)));
            let name = match kernel {
                Kernel::MatmatHalf { .. } => "mma_half_activations",
                Kernel::MatmatReduce { .. } => "mma_reduce_splits",
                _ => "mma_reduce_stacked",
            };
            ("matmat_mma", name.to_string(), defines)
        }
        Kernel::Embed => ("matmat", format!("embed_{suffix}"), Vec::new()),
    }
}
