//! Which devices an engine runs on: one backend, or with `-tp N` a tensor-parallel group (N
//! GPUs joined by NCCL, or N ranks simulated on the CPU), for `run`, `bench` and `serve` alike.

use std::sync::Arc;

use kiln_core::{Backend, CpuBackend, GroupHandle, HostAllReduce};
use kiln_cuda::{CudaBackend, NcclAllReduce};
use kiln_gguf::GgufFile;
use kiln_models::{tensor_parallel, Engine, EngineOptions};

use crate::kv_args::KvArgs;
use crate::CliResult;

/// `-tp N` / `--tensor-parallel N`.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct SplitArgs {
    /// Split the model over this many GPUs (one rank each, NCCL between them); with `--device
    /// cpu`, over this many ranks simulated on the CPU.
    #[arg(long = "tensor-parallel", visible_alias = "tp")]
    pub tensor_parallel: Option<usize>,
}

/// The backends an engine's weights go to.
pub enum Devices<B: Backend> {
    One(Arc<B>),
    Split { backends: Vec<Arc<B>>, reducers: Vec<GroupHandle<B>> },
}

impl<B: Backend> Devices<B> {
    /// The backend of the first (or only) rank: the one that samples and reports.
    pub fn lead(&self) -> Arc<B> {
        match self {
            Devices::One(b) => b.clone(),
            Devices::Split { backends, .. } => backends[0].clone(),
        }
    }

    /// An engine over `file` on these devices, with the cache settings of `kv`.
    pub fn engine(self, kv: &KvArgs, file: &Arc<GgufFile>, options: EngineOptions) -> CliResult<Engine<B>> {
        match self {
            Devices::One(backend) => {
                let (weights, options) = kv.load(&*backend, file, options)?;
                Ok(Engine::new(backend, weights, &options)?)
            }
            Devices::Split { backends, reducers } => Ok(tensor_parallel::engine(backends, reducers, file, &kv.split_options(options)?)?),
        }
    }
}

fn check_ranks(ranks: usize) -> CliResult<usize> {
    if ranks == 0 {
        return Err("-tp needs at least one rank".into());
    }
    Ok(ranks)
}

/// The CPU, as one backend or `-tp N` simulated ranks (each made by `make`).
pub fn cpu(split: SplitArgs, make: impl Fn() -> CpuBackend) -> CliResult<Devices<CpuBackend>> {
    Ok(match split.tensor_parallel {
        None => Devices::One(Arc::new(make())),
        Some(ranks) => {
            let ranks = check_ranks(ranks)?;
            Devices::Split { backends: (0..ranks).map(|_| Arc::new(make())).collect(), reducers: HostAllReduce::handles(ranks) }
        }
    })
}

/// The GPUs when `--device` is not given: `None` (the caller runs on the CPU, after `command`
/// says why) on a machine without a usable GPU; an error on one whose GPUs cannot take the
/// request (`-tp` larger than their count), which must not quietly become a CPU simulation.
pub fn gpus_if_any(command: &str, split: SplitArgs, open: impl Fn(usize) -> CliResult<CudaBackend>) -> CliResult<Option<Devices<CudaBackend>>> {
    match gpus(split, open) {
        Ok(devices) => Ok(Some(devices)),
        Err(e) if split.tensor_parallel.is_some() && kiln_cuda::device_count().unwrap_or(0) > 0 => Err(e),
        Err(e) => {
            eprintln!("{command}: no usable GPU: {e}; running on the CPU");
            Ok(None)
        }
    }
}

/// GPU 0 (made by `open`), or GPUs 0..N for `-tp N`, joined by NCCL.
pub fn gpus(split: SplitArgs, open: impl Fn(usize) -> CliResult<CudaBackend>) -> CliResult<Devices<CudaBackend>> {
    let Some(ranks) = split.tensor_parallel else { return Ok(Devices::One(Arc::new(open(0)?))) };
    let ranks = check_ranks(ranks)?;
    let present = kiln_cuda::device_count()?;
    if ranks > present {
        return Err(format!("-tp {ranks} needs {ranks} GPUs; this host has {present} (--device cpu simulates the ranks on the CPU)").into());
    }
    let backends = (0..ranks).map(|d| open(d).map(Arc::new)).collect::<CliResult<Vec<_>>>()?;
    let refs: Vec<&CudaBackend> = backends.iter().map(|b| &**b).collect();
    let reducers = NcclAllReduce::handles(&refs)?;
    Ok(Devices::Split { backends, reducers })
}
