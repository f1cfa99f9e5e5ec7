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
    /// Model shape: llama3-8b, qwen3-8b, qwen3-0.6b, tiny-llama, tiny-qwen3.
    #[arg(long)]
    pub shape: String,
    /// File type, as for `kiln quantize`.
    #[arg(long = "type", default_value = "Q4_K_M")]
    pub file_type: String,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Number of layers instead of the shape's (for quick tests).
    #[arg(long)]
    pub layers: Option<u64>,
    /// Every quantizable tensor in TYPE, without the mix's per-tensor choices.
    #[arg(long)]
    pub pure: bool,
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
    let ftype = parse_file_type(&args.file_type)?;
    let options = QuantizeOptions { ftype, pure: args.pure, allow_requantize: false };
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
    let result = RandomModel::new(shape, args.seed).write(&args.output, &options, &progress);
    progress.finish();
    print_summary(&args.output, &result?);
    Ok(())
}
