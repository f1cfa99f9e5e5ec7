//! `kiln run`: generate text, flags as in llama.cpp's llama-cli.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Parser;
use kiln_core::{Backend, CpuBackend, SamplingParams};
use kiln_cuda::CudaBackend;
use kiln_gguf::GgufFile;
use kiln_models::{generate, GenerateParams, Model, ModelConfig, ModelOptions};
use kiln_tokenizer::Tokenizer;

use crate::devices::{self, Devices, SplitArgs};
use crate::kv_args::KvArgs;
use crate::CliResult;

#[derive(Parser, Debug)]
pub struct RunArgs {
    /// GGUF model file (default: the stories260K model shipped with kiln).
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
    /// Prompt text.
    #[arg(short = 'p', long, default_value = "Once upon a time")]
    pub prompt: String,
    /// Tokens to generate; -1 runs until end of generation or a full context.
    #[arg(short = 'n', long = "n-predict", default_value_t = -1, allow_negative_numbers = true)]
    pub n_predict: i64,
    /// Context size in tokens; 0 uses the model's training context.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 0)]
    pub ctx_size: usize,
    /// Prompt tokens per forward pass.
    #[arg(short = 'b', long = "batch-size", default_value_t = 512)]
    pub batch_size: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Stop when the output contains this text (repeatable).
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// CPU threads (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// Do not print the prompt before the generated text.
    #[arg(long)]
    pub no_display_prompt: bool,
    /// Print one JSON object (prompt and generated token ids, text, finish reason, timings)
    /// instead of streaming the text.
    #[arg(long)]
    pub json: bool,
    /// Where to run: `cuda` (GPU 0) or `cpu`; by default the GPU when one is available.
    #[arg(long, value_enum)]
    pub device: Option<DeviceKind>,
    #[command(flatten)]
    pub kv: KvArgs,
    #[command(flatten)]
    pub split: SplitArgs,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cuda,
    Cpu,
}

/// GPU 0, when a driver, a device and NVRTC are all there.
pub fn open_gpu() -> CliResult<CudaBackend> {
    open_gpu_with(kiln_cuda::GraphEdges::default())
}

pub fn open_gpu_with(graph_edges: kiln_cuda::GraphEdges) -> CliResult<CudaBackend> {
    open_gpu_numbered(0, graph_edges)
}

/// GPU `ordinal` with the default settings.
pub fn open_gpu_at(ordinal: usize) -> CliResult<CudaBackend> {
    open_gpu_numbered(ordinal, kiln_cuda::GraphEdges::default())
}

pub fn open_gpu_numbered(ordinal: usize, graph_edges: kiln_cuda::GraphEdges) -> CliResult<CudaBackend> {
    if kiln_cuda::device_count()? == 0 {
        return Err("the CUDA driver reports no GPU".into());
    }
    Ok(CudaBackend::with_config(ordinal, kiln_cuda::RegistryConfig { graph_edges, ..Default::default() })?)
}

/// The sampler's flags, as llama-cli's.
#[derive(clap::Args, Debug)]
pub struct SamplingArgs {
    /// Temperature; 0 is greedy.
    #[arg(long = "temp", default_value_t = 0.8, value_parser = finite)]
    pub temperature: f32,
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    #[arg(long = "top-p", default_value_t = 0.95, value_parser = finite)]
    pub top_p: f32,
    #[arg(long = "min-p", default_value_t = 0.05, value_parser = finite)]
    pub min_p: f32,
    #[arg(long = "repeat-penalty", default_value_t = 1.0, value_parser = positive_finite)]
    pub repeat_penalty: f32,
    #[arg(long = "repeat-last-n", default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Random seed; -1 picks one.
    #[arg(short = 's', long, default_value_t = -1, allow_negative_numbers = true)]
    pub seed: i64,
}

/// A sampling setting: NaN or infinity would make every draw meaningless.
fn finite(text: &str) -> Result<f32, String> {
    let x: f32 = text.trim().parse().map_err(|_| format!("'{text}' is not a number"))?;
    if x.is_finite() {
        Ok(x)
    } else {
        Err(format!("'{text}' must be a finite number"))
    }
}

/// The repetition penalty divides logits: it must be above 0 and finite.
fn positive_finite(text: &str) -> Result<f32, String> {
    match finite(text)? {
        x if x > 0.0 => Ok(x),
        _ => Err(format!("'{text}' must be greater than 0 (1 is off)")),
    }
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        let seed = if self.seed < 0 {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
        } else {
            self.seed as u64
        };
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            seed,
            ..SamplingParams::default()
        }
    }
}

pub fn set_threads(threads: Option<usize>) {
    if let Some(t) = threads {
        // Only fails if the pool already exists, in which case its size stays.
        let _ = rayon::ThreadPoolBuilder::new().num_threads(t.max(1)).build_global();
    }
}

/// Runs `f` on a worker of a rayon pool, so the CPU backend's parallel loops
/// schedule through that worker's own deque instead of rayon's global queue,
/// which would allocate every few dozen jobs.
pub fn on_cpu_workers<R: Send>(threads: Option<usize>, f: impl FnOnce() -> R + Send) -> R {
    let builder = rayon::ThreadPoolBuilder::new().num_threads(threads.unwrap_or(0));
    match builder.build() {
        Ok(pool) => pool.install(f),
        Err(_) => f(),
    }
}

pub fn open_model(path: &Option<PathBuf>) -> CliResult<Arc<GgufFile>> {
    let path = path.clone().unwrap_or_else(crate::default_model);
    let file = GgufFile::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(Arc::new(file))
}

pub fn run(args: RunArgs) -> CliResult {
    set_threads(args.threads);
    let file = open_model(&args.model)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let gpu = match args.device {
        Some(DeviceKind::Cpu) => None,
        Some(DeviceKind::Cuda) => Some(devices::gpus(args.split, open_gpu_at)?),
        None => devices::gpus_if_any("kiln", args.split, open_gpu_at)?,
    };
    match gpu {
        Some(gpus) => load_and_generate(gpus, file, &tokenizer, &args),
        None => on_cpu_workers(args.threads, || load_and_generate(devices::cpu(args.split, CpuBackend::new)?, file, &tokenizer, &args)),
    }
}

fn load_and_generate<B: Backend>(devices: Devices<B>, file: Arc<GgufFile>, tokenizer: &Tokenizer, args: &RunArgs) -> CliResult {
    let n_ctx_train = ModelConfig::from_gguf(&file)?.n_ctx_train;
    let options = ModelOptions { n_ctx: (args.ctx_size > 0).then_some(args.ctx_size), n_batch: args.batch_size, ..Default::default() };
    let backend = devices.lead();
    let engine = devices.engine(&args.kv, &file, options.engine_options(n_ctx_train))?;
    generate_with(backend, Model::with_engine(engine), tokenizer, args)
}

fn generate_with<B: Backend>(backend: Arc<B>, mut model: Model<B>, tokenizer: &Tokenizer, args: &RunArgs) -> CliResult {
    let mut memory = crate::kv_args::MemoryWatch::start(&*backend);
    let prompt = tokenizer.encode(&args.prompt, true, true);
    let sampling = args.sampling.params();
    let ranks = model.engine().n_ranks();
    eprintln!(
        "kiln: {} ({}), {} layers, ctx {}, backend {}{}, seed {}",
        model.config.name.as_deref().unwrap_or("model"),
        model.config.arch.name(),
        model.config.n_layer,
        model.n_ctx(),
        backend.name(),
        if ranks > 1 { format!(" x {ranks} ranks (tensor parallel)") } else { String::new() },
        sampling.seed
    );
    eprintln!("kiln: {}", crate::kv_args::describe(model.engine()));
    stream_generation(&mut model, tokenizer, &prompt, sampling, args)?;
    memory.sample(&*backend);
    if let Some(peak) = memory.peak_mib() {
        let kv_mib = model.engine().kv_usable_bytes() as f64 / (1u64 << 20) as f64;
        eprintln!("device memory: {peak:.0} MiB in use (KV cache {kv_mib:.1} MiB of it, {})", crate::kv_args::blocks_in_use(model.engine()));
    }
    Ok(())
}

/// Generates and prints the text (or the JSON report), then the speed line.
fn stream_generation<B: Backend>(model: &mut Model<B>, tokenizer: &Tokenizer, prompt: &[u32], sampling: SamplingParams, args: &RunArgs) -> CliResult {
    let params = GenerateParams { n_predict: (args.n_predict >= 0).then_some(args.n_predict as usize), sampling, stop: args.stop.clone() };
    let mut out = std::io::stdout().lock();
    if !args.no_display_prompt && !args.json {
        write!(out, "{}", args.prompt)?;
        out.flush()?;
    }
    let mut text = String::new();
    let stats = generate(model, tokenizer, prompt, &params, |piece| {
        if args.json {
            text.push_str(piece);
            return true;
        }
        // A closed stdout (e.g. piped into `head`) ends generation quietly.
        write!(out, "{piece}").and_then(|_| out.flush()).is_ok()
    })?;
    if args.json {
        let report = serde_json::json!({
            "prompt_tokens": prompt,
            "generated_tokens": stats.generated_ids,
            "text": text,
            "finish_reason": stats.stop_reason.finish_reason(),
            "timings": {
                "prompt_ms": stats.prompt_time.as_secs_f64() * 1e3,
                "prompt_tokens_per_second": stats.prompt_tokens_per_second(),
                "generation_ms": stats.generation_time.as_secs_f64() * 1e3,
                "generation_tokens_per_second": stats.generation_tokens_per_second(),
            },
        });
        writeln!(out, "{report}")?;
    } else {
        writeln!(out)?;
    }
    eprintln!(
        "prompt: {} tokens, {:.1} tokens/s | generation: {} tokens, {:.1} tokens/s | stop: {:?}",
        stats.prompt_tokens,
        stats.prompt_tokens_per_second(),
        stats.generated_tokens,
        stats.generation_tokens_per_second(),
        stats.stop_reason
    );
    Ok(())
}
