//! `kiln info`: what a GGUF file holds.

use std::path::PathBuf;

use clap::Parser;
use kiln_models::model::dominant_weight_type;
use kiln_models::ModelConfig;
use kiln_tokenizer::Tokenizer;
use serde_json::json;

use crate::CliResult;

#[derive(Parser, Debug)]
pub struct InfoArgs {
    /// GGUF file (default: the shipped stories260K model).
    pub file: Option<PathBuf>,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
    /// List the CUDA GPUs (name, memory, compute capability) instead of describing a file.
    #[arg(long)]
    pub devices: bool,
}

pub fn info(args: InfoArgs) -> CliResult {
    if args.devices {
        return list_gpus(args.json);
    }
    let file = crate::run::open_model(&args.file)?;
    let path = args.file.clone().unwrap_or_else(crate::default_model);
    let config = ModelConfig::from_gguf(&file)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let file_type = dominant_weight_type(&file).map(|t| t.name()).unwrap_or("none");
    let total_bytes: u64 = file.tensors().iter().map(|t| t.n_bytes).sum();
    let n_params: u64 = file.tensors().iter().map(|t| t.n_elements()).sum();
    let tensors: Vec<_> = file
        .tensors()
        .iter()
        .map(|t| json!({"name": t.name, "type": t.ty.name(), "shape": t.dims, "bytes": t.n_bytes, "offset": file.data_offset() + t.offset}))
        .collect();
    let c = &config;
    let hparams = json!({
        "n_embd": c.n_embd, "n_layer": c.n_layer, "n_head": c.n_head, "n_head_kv": c.n_head_kv,
        "head_dim": c.head_dim, "n_rot": c.n_rot, "n_ff": c.n_ff, "n_vocab": c.n_vocab,
        "n_ctx_train": c.n_ctx_train, "rms_eps": c.rms_eps, "rope_base": c.rope_base,
        "rope_kind": format!("{:?}", c.rope_kind), "rope_scaling": format!("{:?}", c.rope_scaling),
        "tied_embeddings": c.tied_embeddings,
    });
    if args.json {
        let doc = json!({
            "file": path.display().to_string(), "gguf_version": file.version(), "architecture": c.arch.name(),
            "name": c.name, "file_type": file_type, "n_params": n_params, "tensor_bytes": total_bytes,
            "hparams": hparams, "tokenizer": {"kind": format!("{:?}", tokenizer.kind()), "vocab_size": tokenizer.vocab_size(),
            "bos": tokenizer.bos(), "eos": tokenizer.eos()}, "tensors": tensors,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    println!("file:         {} (GGUF v{})", path.display(), file.version());
    println!("architecture: {}{}", c.arch.name(), c.name.as_deref().map(|n| format!(" ({n})")).unwrap_or_default());
    println!("file type:    {file_type}");
    println!("parameters:   {} ({:.2} M), {:.2} MiB of tensors", n_params, n_params as f64 / 1e6, total_bytes as f64 / (1 << 20) as f64);
    println!("tokenizer:    {:?}, {} tokens, bos {:?}, eos {:?}", tokenizer.kind(), tokenizer.vocab_size(), tokenizer.bos(), tokenizer.eos());
    if let Some(obj) = hparams.as_object() {
        for (k, v) in obj {
            println!("  {k:16} {v}");
        }
    }
    println!("\n{:<32} {:>8} {:>22} {:>12}", "tensor", "type", "shape", "bytes");
    for t in file.tensors() {
        let shape = t.dims.iter().map(u64::to_string).collect::<Vec<_>>().join(" x ");
        println!("{:<32} {:>8} {:>22} {:>12}", t.name, t.ty.name(), shape, t.n_bytes);
    }
    Ok(())
}

fn list_gpus(as_json: bool) -> CliResult {
    let devices = kiln_cuda::list_devices()?;
    if as_json {
        let rows: Vec<_> = devices
            .iter()
            .map(|d| {
                json!({"ordinal": d.ordinal, "name": d.name, "compute_capability": format!("{}.{}", d.compute_capability.0, d.compute_capability.1),
                "total_memory_bytes": d.total_memory_bytes, "free_memory_bytes": d.free_memory_bytes, "multiprocessors": d.multiprocessor_count})
            })
            .collect();
        let links: Vec<_> = if devices.len() > 1 { kiln_cuda::peer_links()? } else { Vec::new() };
        let links: Vec<_> = links
            .iter()
            .map(|l| json!({"from": l.from, "to": l.to, "peer_access": l.access, "native_atomics": l.native_atomics, "performance_rank": l.performance_rank}))
            .collect();
        println!("{}", serde_json::to_string_pretty(&json!({"devices": rows, "peer_links": links}))?);
        return Ok(());
    }
    if devices.is_empty() {
        println!("no CUDA GPU found");
    }
    for d in &devices {
        println!("{d}");
    }
    if devices.len() > 1 {
        println!("peer links (for -tp):");
        for l in kiln_cuda::peer_links()? {
            let how = match (l.access, l.native_atomics) {
                (false, _) => "no direct access (through host memory)".to_string(),
                (true, true) => format!("direct, native atomics (NVLink class), rank {}", l.performance_rank),
                (true, false) => format!("direct, no native atomics (PCIe class), rank {}", l.performance_rank),
            };
            println!("  GPU {} -> GPU {}: {how}", l.from, l.to);
        }
    }
    Ok(())
}
