//! Kernel lookup by (source, kernel, defines): compiled once per distinct key, loaded once per
//! context, and shared as `Arc<CudaModule>` by every caller.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, PoisonError, RwLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;

use crate::arch_ops::DeltaNetSpans;
use crate::cache::{validate_arch, CacheDir, CubinCache, CubinKey, CubinOrigin};
use crate::error::format_defines;
use crate::graph::GraphEdges;
use crate::nvrtc::ensure_nvrtc;
use crate::sources::find_kernel;
use crate::CudaError;

#[derive(Clone, Debug, Default)]
pub struct RegistryConfig {
    pub cache_dir: CacheDir,
    /// Target architecture such as `sm_90a`; by default the device's own (`sm_<major><minor>`).
    pub arch: Option<String>,
    /// Whether step graphs overlap kernels that wait for their inputs with the kernel before.
    pub graph_edges: GraphEdges,
    /// Which form of the delta rule runs a Gated DeltaNet layer's spans of several tokens.
    pub delta_net_spans: DeltaNetSpans,
}

pub struct KernelRegistry {
    ctx: Arc<CudaContext>,
    arch: String,
    cubins: CubinCache,
    modules: RwLock<HashMap<CubinKey, Arc<CudaModule>>>,
    /// Handles (as addresses) of the functions from sources tagged `// kiln-waits-for-inputs`.
    waiting_functions: RwLock<HashSet<usize>>,
    graph_edges: GraphEdges,
}

impl KernelRegistry {
    /// Needs libnvrtc (checked here, so later calls cannot hit cudarc's missing-library panic).
    pub fn new(ctx: Arc<CudaContext>, config: RegistryConfig) -> Result<Self, CudaError> {
        ensure_nvrtc()?;
        let arch = match config.arch {
            Some(arch) => arch,
            None => {
                let (major, minor) = ctx.compute_capability().map_err(CudaError::driver("reading the compute capability"))?;
                format!("sm_{major}{minor}")
            }
        };
        // A malformed override fails here rather than at the first lookup.
        validate_arch(&arch)?;
        Ok(KernelRegistry {
            ctx,
            arch,
            cubins: CubinCache::new(&config.cache_dir),
            modules: RwLock::new(HashMap::new()),
            waiting_functions: RwLock::default(),
            graph_edges: config.graph_edges,
        })
    }

    /// The architecture every module is compiled for.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    pub fn cubin_cache(&self) -> &CubinCache {
        &self.cubins
    }

    /// The module of `kernels/<source>.cu` specialized by `defines` (order does not matter).
    /// The same key always returns the same `Arc`.
    pub fn module(&self, source: &str, defines: &[(&str, i64)]) -> Result<Arc<CudaModule>, CudaError> {
        let key = CubinKey::new(source, defines, &self.arch)?;
        if let Some(module) = self.modules.read().unwrap_or_else(PoisonError::into_inner).get(&key) {
            return Ok(module.clone());
        }
        // Compiled outside the lock so other keys are not held up; when two threads race on
        // one key, the first insertion wins and both get that module.
        let cubin = self.cubins.get_or_compile(&key)?;
        let module = self.ctx.load_module(Ptx::from_binary(cubin.bytes)).map_err(|error| CudaError::Load {
            source_name: source.to_string(),
            defines: format_defines(key.defines()),
            arch: self.arch.clone(),
            error,
        })?;
        if cubin.origin == CubinOrigin::Disk {
            tracing::debug!(source, defines = %format_defines(key.defines()), "kernel module loaded from the disk cache");
        }
        let mut modules = self.modules.write().unwrap_or_else(PoisonError::into_inner);
        Ok(modules.entry(key).or_insert(module).clone())
    }

    /// Compiles (or reads from the disk cache) and loads every module of `keys` not loaded yet,
    /// several at a time, so a model's first run does not compile them one after another.
    /// The first error is returned once every worker has finished.
    pub fn prepare(&self, keys: &[(&'static str, Vec<(&'static str, i64)>)]) -> Result<(), CudaError> {
        let missing: Vec<_> = {
            let loaded = self.modules.read().unwrap_or_else(PoisonError::into_inner);
            let mut seen = std::collections::HashSet::new();
            keys.iter()
                .filter(|(source, defines)| CubinKey::new(source, defines, &self.arch).is_ok_and(|key| !loaded.contains_key(&key) && seen.insert(key)))
                .collect()
        };
        if missing.is_empty() {
            return Ok(());
        }
        let workers = std::thread::available_parallelism().map_or(4, |n| n.get()).min(missing.len());
        let next = std::sync::atomic::AtomicUsize::new(0);
        let first_error = std::sync::Mutex::new(None);
        std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| {
                    if let Err(e) = self.ctx.bind_to_thread() {
                        first_error.lock().unwrap_or_else(PoisonError::into_inner).get_or_insert(CudaError::driver("binding the context")(e));
                        return;
                    }
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some((source, defines)) = missing.get(i) else { break };
                        if let Err(e) = self.module(source, defines) {
                            first_error.lock().unwrap_or_else(PoisonError::into_inner).get_or_insert(e);
                        }
                    }
                });
            }
        });
        match first_error.into_inner().unwrap_or_else(PoisonError::into_inner) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// One kernel of a module. Callers on hot paths should keep the returned function.
    pub fn function(&self, source: &str, kernel: &str, defines: &[(&str, i64)]) -> Result<CudaFunction, CudaError> {
        let declared = find_kernel(source, kernel)?;
        let function =
            self.module(source, defines)?.load_function(kernel).map_err(CudaError::driver(format!("looking up kernel `{kernel}` in {source}.cu")))?;
        if declared.waits_for_inputs {
            self.waiting_functions.write().unwrap_or_else(PoisonError::into_inner).insert(function.cu_function() as usize);
        }
        Ok(function)
    }

    /// Whether `function` came from a source whose kernels wait for their inputs (common.cuh's
    /// wait_for_inputs), so a graph may launch it before the kernel it depends on has finished.
    /// Always false under [`GraphEdges::Serial`].
    pub fn waits_for_inputs(&self, function: cudarc::driver::sys::CUfunction) -> bool {
        self.graph_edges == GraphEdges::Overlapped && self.waiting_functions.read().unwrap_or_else(PoisonError::into_inner).contains(&(function as usize))
    }
}

impl std::fmt::Debug for KernelRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let loaded = self.modules.read().unwrap_or_else(PoisonError::into_inner).len();
        f.debug_struct("KernelRegistry")
            .field("device", &self.ctx.ordinal())
            .field("arch", &self.arch)
            .field("cache_dir", &self.cubins.dir())
            .field("loaded_modules", &loaded)
            .finish()
    }
}
