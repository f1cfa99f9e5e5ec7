//! The KV cache flags shared by `run` and `bench` (`-ctk`, `-ctv`, `--kv-mem`), and loading a
//! model's weights and engine with them.

use std::sync::Arc;

use clap::Args;
use kiln_core::{Backend, KvType};
use kiln_gguf::GgufFile;
use kiln_models::{Engine, EngineOptions, KvBudget, Weights};

use crate::CliResult;

#[derive(Args, Debug, Clone)]
pub struct KvArgs {
    /// KV cache type for K: f16, q8_0 or f32.
    #[arg(long = "cache-type-k", visible_alias = "ctk", default_value = "f16")]
    pub cache_type_k: KvType,
    /// KV cache type for V: f16, q8_0 or f32.
    #[arg(long = "cache-type-v", visible_alias = "ctv", default_value = "f16")]
    pub cache_type_v: KvType,
    /// Most memory the KV cache may take, as a size (`8GiB`, `512M`, bytes) or as a fraction
    /// of the device memory free after loading (`0.9`). Default: every sequence at its full
    /// context. Either way memory is taken in blocks as sequences grow.
    #[arg(long = "kv-mem", value_parser = parse_kv_mem)]
    pub kv_mem: Option<KvMem>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvMem {
    Bytes(u64),
    FractionOfFree(f64),
}

/// `8GiB`, `8G`, `512MiB`, `512M`, `4096K`, `123456` (bytes; binary units), or a fraction in (0, 1].
pub fn parse_kv_mem(text: &str) -> Result<KvMem, String> {
    let t = text.trim();
    let bad = || format!("--kv-mem '{text}': expected a size such as 8GiB or 512M, or a fraction of free memory such as 0.9");
    if t.contains('.') || t == "1" {
        let f: f64 = t.parse().map_err(|_| bad())?;
        return if f > 0.0 && f <= 1.0 { Ok(KvMem::FractionOfFree(f)) } else { Err(bad()) };
    }
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        _ => return Err(bad()),
    };
    n.checked_mul(1 << shift).filter(|&b| b > 0).map(KvMem::Bytes).ok_or_else(bad)
}

impl KvArgs {
    /// The pool's budget on `backend` once the weights are loaded.
    fn budget<B: Backend>(&self, backend: &B) -> CliResult<Option<KvBudget>> {
        Ok(match self.kv_mem {
            None => None,
            Some(KvMem::Bytes(b)) => Some(KvBudget::Bytes(b)),
            Some(KvMem::FractionOfFree(f)) => {
                let free =
                    backend.free_memory().ok_or_else(|| format!("--kv-mem {f}: the {} backend does not report free memory; give a size", backend.name()))?;
                Some(KvBudget::Bytes((free as f64 * f) as u64))
            }
        })
    }

    /// Loads the weights, then fills in the KV settings of `options`.
    pub fn load<B: Backend>(&self, backend: &B, file: &Arc<GgufFile>, options: EngineOptions) -> CliResult<(Arc<Weights<B>>, EngineOptions)> {
        let weights = Arc::new(Weights::load(backend, file)?);
        let options = EngineOptions { k_type: self.cache_type_k, v_type: self.cache_type_v, kv_budget: self.budget(backend)?, ..options };
        Ok((weights, options))
    }

    /// The cache settings of a tensor-parallel engine, whose weights are not loaded yet: a
    /// size budget applies to each rank's slice of the cache; a fraction of free memory would
    /// be measured before the weights take theirs, so it is refused.
    pub fn split_options(&self, options: EngineOptions) -> CliResult<EngineOptions> {
        let kv_budget = match self.kv_mem {
            None => None,
            Some(KvMem::Bytes(bytes)) => Some(KvBudget::Bytes(bytes)),
            Some(KvMem::FractionOfFree(_)) => {
                return Err("--kv-mem as a fraction of free memory is not supported with -tp; give a size per GPU such as 8GiB".into())
            }
        };
        Ok(EngineOptions { k_type: self.cache_type_k, v_type: self.cache_type_v, kv_budget, ..options })
    }
}

/// One line on the KV cache a run may use: types, each pool's block budget and its bytes.
pub fn describe<B: Backend>(engine: &Engine<B>) -> String {
    let options = engine.options();
    let mib = |pool: &kiln_models::KvPool<B>| (pool.spec().n_blocks as u64 * pool.bytes_per_block()) as f64 / (1u64 << 20) as f64;
    let pool = engine.pool();
    let mut line = format!(
        "KV cache K {} V {}, up to {} blocks of {} positions ({:.1} MiB), taken as sequences grow",
        options.k_type,
        options.v_type,
        pool.spec().n_blocks,
        kiln_core::KV_BLOCK_SIZE,
        mib(pool)
    );
    if let (Some(window_pool), Some(window)) = (engine.window_pool(), engine.window()) {
        line += &format!(
            "; sliding-window layers (window {window}) in a pool of their own, up to {} blocks ({:.1} MiB), keeping only the blocks their window reaches",
            window_pool.spec().n_blocks,
            mib(window_pool)
        );
    }
    line
}

/// Blocks in use now: "N blocks in use", and the window pool's beside them when there is one.
pub fn blocks_in_use<B: Backend>(engine: &Engine<B>) -> String {
    let full = engine.pool().allocator().in_use();
    match engine.window_pool() {
        Some(window) => format!("{full} blocks in use, {} in the sliding-window pool", window.allocator().in_use()),
        None => format!("{full} blocks in use"),
    }
}

/// Device memory in use by this process, as the lowest free memory seen against the free
/// memory before loading.
pub struct MemoryWatch {
    free_at_start: Option<u64>,
    lowest_free: Option<u64>,
}

impl MemoryWatch {
    pub fn start<B: Backend>(backend: &B) -> MemoryWatch {
        let free = backend.free_memory();
        MemoryWatch { free_at_start: free, lowest_free: free }
    }

    pub fn sample<B: Backend>(&mut self, backend: &B) {
        if let (Some(now), Some(low)) = (backend.free_memory(), self.lowest_free) {
            self.lowest_free = Some(low.min(now));
        }
    }

    /// "peak 7,443 MiB" or `None` on a backend that reports no free memory.
    pub fn peak_mib(&self) -> Option<f64> {
        Some(self.free_at_start?.saturating_sub(self.lowest_free?) as f64 / (1u64 << 20) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_fractions_parse() {
        assert_eq!(parse_kv_mem("8GiB"), Ok(KvMem::Bytes(8 << 30)));
        assert_eq!(parse_kv_mem("512M"), Ok(KvMem::Bytes(512 << 20)));
        assert_eq!(parse_kv_mem("4096"), Ok(KvMem::Bytes(4096)));
        assert_eq!(parse_kv_mem("0.9"), Ok(KvMem::FractionOfFree(0.9)));
        for bad in ["", "0", "1.5", "8TB", "-1", "G"] {
            assert!(parse_kv_mem(bad).is_err(), "{bad}");
        }
    }
}
