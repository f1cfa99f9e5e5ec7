//! The `kiln` command line.

mod bench;
mod info;
mod quantize;
mod random_model;
mod run;
mod tokenize;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

pub type CliResult<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[derive(Parser)]
#[command(name = "kiln", version, about = "Run quantized GGUF language models on NVIDIA GPUs or the CPU")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt (the default command).
    Run(run::RunArgs),
    /// Describe a GGUF file: architecture, hyper-parameters, tokenizer, tensors.
    Info(info::InfoArgs),
    /// Print the token ids of a text.
    Tokenize(tokenize::TokenizeArgs),
    /// Convert a GGUF model to another file type (like llama-quantize).
    Quantize(quantize::QuantizeArgs),
    /// Measure prompt and generation speed (like llama-bench).
    Bench(bench::BenchArgs),
    /// Developer tools.
    Dev {
        #[command(subcommand)]
        command: random_model::DevCommand,
    },
}

/// The model shipped in the repository, used when no `-m` is given.
pub fn default_model() -> PathBuf {
    let shipped = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/stories260K.gguf");
    let local = PathBuf::from("models/stories260K.gguf");
    if local.exists() {
        local
    } else {
        shipped
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_env("KILN_LOG")).with_writer(std::io::stderr).init();
    let cli = Cli::parse();
    let result = match cli.command.unwrap_or_else(|| Command::Run(run::RunArgs::parse_from(["run"]))) {
        Command::Run(a) => run::run(a),
        Command::Info(a) => info::info(a),
        Command::Tokenize(a) => tokenize::tokenize(a),
        Command::Quantize(a) => quantize::quantize(a),
        Command::Bench(a) => bench::bench(a),
        Command::Dev { command } => random_model::dev(command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
