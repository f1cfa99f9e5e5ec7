//! `kiln serve`: the OpenAI-compatible HTTP server (flags as in llama.cpp's llama-server).

use std::path::PathBuf;

use clap::Parser;
use kiln_core::{Backend, CpuBackend};
use kiln_models::{EngineOptions, ModelConfig};
use kiln_server::{EngineSlot, ReasoningFormat, SchedulerConfig, ServerConfig};
use kiln_tokenizer::Tokenizer;

use crate::devices::{self, Devices, SplitArgs};
use crate::kv_args::KvArgs;
use crate::run::{on_cpu_workers, open_gpu_at, open_model, DeviceKind};
use crate::CliResult;

#[derive(Parser, Debug, Clone)]
pub struct ServeArgs {
    /// GGUF model file (default: the stories260K model shipped with kiln).
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
    /// Address to listen on; loopback unless told otherwise.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on; 0 picks a free one.
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Most sequences decoded together (requests beyond wait in the queue).
    #[arg(long = "parallel", visible_alias = "np", default_value_t = 4)]
    pub parallel: usize,
    /// Context of each request in tokens (prompt and generated); 0 uses the model's training context.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 0)]
    pub ctx_size: usize,
    /// Clients must send `Authorization: Bearer KEY`.
    #[arg(long = "api-key", conflicts_with = "api_key_file")]
    pub api_key: Option<String>,
    /// Read the API key from this file (its first line).
    #[arg(long = "api-key-file")]
    pub api_key_file: Option<PathBuf>,
    /// Chat template: a built-in name (chatml) or a Jinja file; default: the model's own.
    #[arg(long = "chat-template")]
    pub chat_template: Option<String>,
    /// Chat answers: `auto` sends the reasoning (`<think>` blocks, gpt-oss's analysis channel)
    /// as `reasoning_content` beside `content`; `none` sends the text as generated. A request's
    /// `reasoning_format` overrides it.
    #[arg(long = "reasoning-format", default_value = "auto", value_parser = reasoning_format)]
    pub reasoning_format: ReasoningFormat,
    /// Model name listed by /v1/models and returned in responses (default: the file name).
    #[arg(long)]
    pub alias: Option<String>,
    /// Where to run: `cuda` (GPU 0) or `cpu`; by default the GPU when one is available.
    #[arg(long, value_enum)]
    pub device: Option<DeviceKind>,
    #[command(flatten)]
    pub kv: KvArgs,
    #[command(flatten)]
    pub split: SplitArgs,
}

/// Tokens one step feeds at most: running decodes first, then chunks of waiting prompts.
const STEP_TOKENS: usize = 512;
/// Requests that may wait for a slot or KV blocks, per running slot.
const WAITING_PER_SLOT: usize = 8;

fn reasoning_format(name: &str) -> Result<ReasoningFormat, String> {
    ReasoningFormat::parse(name).ok_or_else(|| format!("{name:?} is not a reasoning format (auto, deepseek, none)"))
}

impl ServeArgs {
    fn api_key(&self) -> CliResult<Option<String>> {
        match (&self.api_key, &self.api_key_file) {
            (Some(k), _) => Ok(Some(k.clone())),
            (None, Some(f)) => {
                let text = std::fs::read_to_string(f).map_err(|e| format!("--api-key-file {}: {e}", f.display()))?;
                let key = text.lines().next().unwrap_or("").trim().to_string();
                if key.is_empty() {
                    return Err(format!("--api-key-file {}: the file holds no key", f.display()).into());
                }
                Ok(Some(key))
            }
            (None, None) => Ok(None),
        }
    }

    fn config(&self) -> CliResult<ServerConfig> {
        let parallel = self.parallel.max(1);
        Ok(ServerConfig {
            host: self.host.clone(),
            port: self.port,
            api_key: self.api_key()?,
            alias: self.alias.clone(),
            chat_template: self.chat_template.clone(),
            reasoning_format: self.reasoning_format,
            scheduler: SchedulerConfig { max_running: parallel, max_waiting: parallel * WAITING_PER_SLOT, step_tokens: STEP_TOKENS.max(parallel) },
            ..ServerConfig::default()
        })
    }
}

fn load_and_run<B: Backend>(devices: Devices<B>, args: &ServeArgs, slot: EngineSlot) -> CliResult {
    let backend = devices.lead();
    let path = args.model.clone().unwrap_or_else(crate::default_model);
    let file = open_model(&Some(path.clone()))?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let config = ModelConfig::from_gguf(&file)?;
    let parallel = args.parallel.max(1);
    let max_seq_len = if args.ctx_size > 0 { args.ctx_size } else { config.n_ctx_train };
    let options = EngineOptions { max_seq_len, max_batch_tokens: STEP_TOKENS.max(parallel), max_seqs: parallel, ..EngineOptions::default() };
    let engine = devices.engine(&args.kv, &file, options)?;
    eprintln!(
        "kiln serve: {} ({}), backend {}, {parallel} parallel sequences of up to {max_seq_len} tokens; {}",
        config.name.as_deref().unwrap_or("model"),
        config.arch.name(),
        backend.name(),
        crate::kv_args::describe(&engine)
    );
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    slot.run(engine, tokenizer, &name)?;
    Ok(())
}

pub fn serve(args: ServeArgs) -> CliResult {
    let config = args.config()?;
    let load = move |slot: EngineSlot| -> Result<(), String> {
        let gpu = match args.device {
            Some(DeviceKind::Cpu) => None,
            Some(DeviceKind::Cuda) => Some(devices::gpus(args.split, open_gpu_at).map_err(|e| e.to_string())?),
            None => devices::gpus_if_any("kiln serve", args.split, open_gpu_at).map_err(|e| e.to_string())?,
        };
        let result = match gpu {
            Some(gpus) => load_and_run(gpus, &args, slot),
            None => on_cpu_workers(None, || load_and_run(devices::cpu(args.split, CpuBackend::new)?, &args, slot)),
        };
        result.map_err(|e| e.to_string())
    };
    kiln_server::serve(config, load)?;
    Ok(())
}
