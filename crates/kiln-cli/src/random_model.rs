//! `kiln dev ...`: developer tools. `random-model` writes a random-weight GGUF
//! in the shape of a real model, quantized as `kiln quantize` would.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use kiln_quant::file::{parse_file_type, QuantizeOptions};
use kiln_quant::synthetic::{find_shape, RandomModel, SHAPES};

use crate::quantize::{print_summary, ProgressReport};
use crate::CliResult;

#[derive(Subcommand, Debug)]
pub enum DevCommand {
    /// Write a random-weight model in a real model's shape.
    RandomModel(RandomModelArgs),
}

#[derive(Parser, Debug)]
pub struct RandomModelArgs {
    /// Output GGUF file.
    pub output: PathBuf,
    /// Model shape: llama3-8b, llama3-70b, qwen3-8b, qwen2.5-7b, qwen3-0.6b, qwen3-30b-a3b,
    /// gemma4-26b-a4b, qwen3.5-35b-a3b, gpt-oss-20b, tiny-llama, tiny-qwen3, tiny-qwen2.
    #[arg(long)]
    pub shape: String,
    /// File type, as for `kiln quantize`, and the IQ1, IQ2, IQ3_XXS and Q2_K_S mixes, which
    /// `kiln quantize` refuses without an importance matrix (quantized here as ggml does
    /// without one, or with a uniform one) [default: Q4_K_M; gpt-oss: MXFP4_MOE, as released].
    #[arg(long = "type")]
    pub file_type: Option<String>,
    /// Print the tensor plan and the size the file would have, without writing it.
    #[arg(long)]
    pub dry_run: bool,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Number of layers instead of the shape's (for quick tests).
    #[arg(long)]
    pub layers: Option<u64>,
    /// Every quantizable tensor in TYPE, without the mix's per-tensor choices.
    #[arg(long)]
    pub pure: bool,
    /// Every weight matrix repeats its first N rows (routers keep all theirs): a file for speed
    /// measurements only, written many times faster, with the same bytes to read per token.
    #[arg(long, value_name = "N")]
    pub distinct_rows: Option<usize>,
    /// Threads (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
}

pub fn dev(command: DevCommand) -> CliResult {
    match command {
        DevCommand::RandomModel(args) => random_model(args),
    }
}

fn random_model(args: RandomModelArgs) -> CliResult {
    crate::run::set_threads(args.threads);
    let mut shape = find_shape(&args.shape).ok_or_else(|| {
        let known: Vec<&str> = SHAPES.iter().map(|s| s.name).collect();
        format!("unknown shape '{}'; known shapes: {}", args.shape, known.join(", "))
    })?;
    match args.layers {
        Some(0) => return Err("--layers must be at least 1".into()),
        Some(n) => shape.n_layer = n,
        None => {}
    }
    let ftype = match &args.file_type {
        Some(name) => parse_file_type(name)?,
        None => shape.default_file_type(),
    };
    // A benchmark file's quality does not matter: the tensors llama-quantize refuses without
    // an importance matrix are quantized anyway (see `allow_without_imatrix`).
    let options = QuantizeOptions { ftype, pure: args.pure, allow_requantize: false, allow_without_imatrix: true };
    let model = match args.distinct_rows {
        Some(0) => return Err("--distinct-rows must be at least 1".into()),
        Some(rows) => RandomModel::new(shape, args.seed).with_distinct_rows(rows),
        None => RandomModel::new(shape, args.seed),
    };
    if args.dry_run {
        return dry_run(&model, &options);
    }
    eprintln!(
        "random {} model ({} layers, seed {}) as {} -> {} ({} threads)",
        shape.name,
        shape.n_layer,
        args.seed,
        ftype,
        args.output.display(),
        rayon::current_num_threads()
    );
    let progress = ProgressReport::stderr();
    let result = model.write(&args.output, &options, &progress);
    progress.finish();
    print_summary(&args.output, &result?);
    Ok(())
}

/// The plan of every tensor, then the totals (`tensor data: N bytes`, parsed by the tests).
fn dry_run(model: &RandomModel, options: &QuantizeOptions) -> CliResult {
    let plans = model.plan(options)?;
    let mut counts = std::collections::BTreeMap::new();
    for p in &plans {
        println!("{:40} {:>6} {:?}", p.name, p.dst_type.to_string(), p.dims);
        *counts.entry(p.dst_type.to_string()).or_insert(0usize) += 1;
    }
    let n_params: u64 = plans.iter().map(|p| p.n_elements()).sum();
    let bytes = model.tensor_bytes(options)?;
    let types: Vec<String> = counts.iter().map(|(t, n)| format!("{t}x{n}")).collect();
    println!("tensors: {} ({})", plans.len(), types.join(", "));
    println!("parameters: {n_params}");
    println!("tensor data: {bytes} bytes ({:.2} GiB, {:.2} BPW)", bytes as f64 / (1u64 << 30) as f64, bytes as f64 * 8.0 / n_params as f64);
    Ok(())
}
