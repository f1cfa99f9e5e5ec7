//! The `kiln` command line.

mod batched_bench;
mod bench;
mod chat;
mod devices;
mod info;
mod kernel_profile;
mod kld;
mod kv_args;
mod perplexity;
mod quantize;
mod random_model;
mod run;
mod serve;
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
    /// Talk with a model through its chat template (like llama-cli's conversation mode).
    Chat(chat::ChatArgs),
    /// Describe a GGUF file: architecture, hyper-parameters, tokenizer, tensors.
    Info(info::InfoArgs),
    /// Print the token ids of a text.
    Tokenize(tokenize::TokenizeArgs),
    /// Convert a GGUF model to another file type (like llama-quantize).
    Quantize(quantize::QuantizeArgs),
    /// Measure prompt and generation speed (like llama-bench).
    Bench(bench::BenchArgs),
    /// Perplexity over a text, and KL divergence against a base model (like llama-perplexity).
    Perplexity(perplexity::PerplexityArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (like llama-server).
    Serve(serve::ServeArgs),
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

/// llama.cpp spells some long flags with one dash (`-ctk`, `-npp`, `-sys`); clap wants two.
fn llama_style_args(args: impl Iterator<Item = String>) -> Vec<String> {
    const ONE_DASH_LONG: [&str; 8] = ["-ctk", "-ctv", "-npp", "-ntg", "-npl", "-np", "-sys", "-tp"];
    args.map(|a| {
        let flag = a.split('=').next().unwrap_or(&a);
        if ONE_DASH_LONG.contains(&flag) {
            format!("-{a}")
        } else {
            a
        }
    })
    .collect()
}

fn main() -> ExitCode {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_env("KILN_LOG")).with_writer(std::io::stderr).init();
    let cli = Cli::parse_from(llama_style_args(std::env::args()));
    let result = match cli.command.unwrap_or_else(|| Command::Run(run::RunArgs::parse_from(["run"]))) {
        Command::Run(a) => run::run(a),
        Command::Chat(a) => chat::chat(a),
        Command::Info(a) => info::info(a),
        Command::Tokenize(a) => tokenize::tokenize(a),
        Command::Quantize(a) => quantize::quantize(a),
        Command::Bench(a) => bench::bench(a),
        Command::Perplexity(a) => perplexity::perplexity(a),
        Command::Serve(a) => serve::serve(a),
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

#[cfg(test)]
mod tests {
    #[test]
    fn one_dash_llama_flags_become_long_flags() {
        let args = ["kiln", "bench", "-npp", "128", "-ctk=q8_0", "-n", "4", "-c", "8"].map(String::from);
        assert_eq!(super::llama_style_args(args.into_iter()), ["kiln", "bench", "--npp", "128", "--ctk=q8_0", "-n", "4", "-c", "8"]);
    }
}
