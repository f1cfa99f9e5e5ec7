//! `kiln bench`: prompt-processing and generation speed, measured and printed
//! like llama.cpp's llama-bench so the two outputs can be compared line by line.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use clap::{Parser, ValueEnum};
use kiln_core::{Backend, CpuBackend, CpuOptions, SamplingParams, SimdLevel};
use kiln_gguf::{GgufFile, Value};
use kiln_models::{Logits, Model, ModelOptions};
use kiln_quant::file::{describe_file_type, FileType, QuantHparams, FILE_TYPE_GUESSED};
use serde_json::json;

use crate::devices::{self, Devices, SplitArgs};
use crate::kv_args::KvArgs;
use crate::run::{on_cpu_workers, open_gpu_numbered, DeviceKind};
use crate::CliResult;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Md,
    Json,
}

#[derive(Parser, Debug)]
pub struct BenchArgs {
    /// GGUF model file (default: the stories260K model shipped with kiln).
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
    /// Prompt lengths to test (comma-separated; 0 skips prompt tests).
    #[arg(short = 'p', long = "n-prompt", value_delimiter = ',', default_value = "512")]
    pub n_prompt: Vec<usize>,
    /// Generation lengths to test (comma-separated; 0 skips generation tests).
    #[arg(short = 'n', long = "n-gen", value_delimiter = ',', default_value = "128")]
    pub n_gen: Vec<usize>,
    /// Tokens already in the context when a test starts (comma-separated).
    #[arg(short = 'd', long = "n-depth", value_delimiter = ',', default_value = "0")]
    pub n_depth: Vec<usize>,
    /// Timed repetitions of each test.
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub repetitions: usize,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value = "md")]
    pub output: OutputFormat,
    /// Where to run: `cuda` (GPU 0) or `cpu`; by default the GPU when one is available.
    #[arg(long, value_enum)]
    pub device: Option<DeviceKind>,
    /// CPU threads (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// Most tokens per forward pass.
    #[arg(short = 'b', long = "batch-size", default_value_t = 2048)]
    pub batch_size: usize,
    /// Skip the warm-up run before each test.
    #[arg(long)]
    pub no_warmup: bool,
    #[command(flatten)]
    pub kv: KvArgs,
    #[command(flatten)]
    pub split: SplitArgs,
    /// How the kernels of a step graph follow each other: `overlapped` starts each kernel that
    /// waits for its inputs while the one before it drains; `serial` waits for it to finish.
    #[arg(long = "graph-edges", value_enum, default_value = "overlapped")]
    pub graph_edges: GraphEdgesArg,
    /// The CPU's integer kernels: `auto` takes the widest this CPU runs; a narrower level
    /// measures what a CPU without the wider instructions would get.
    #[arg(long = "cpu-kernels", value_enum, default_value = "auto")]
    pub cpu_kernels: CpuKernelsArg,
    /// llama-batched-bench instead: many sequences decoded together (`--npp`, `--ntg`, `--npl`).
    #[arg(long)]
    pub batched: bool,
    /// After the table, each decode step graph's kernels with their times (GPU only): every
    /// graph is replayed once more, serially, with an event after each kernel, during the
    /// warm-up (which then generates three tokens instead of one); with `-o json` the profile
    /// goes to stderr. Not with --no-warmup: the profile would fall into a timed run.
    #[arg(long)]
    pub kernel_profile: bool,
    /// After the table, how long each sampled decode step kept the GPU busy and how long the
    /// GPU sat idle between one step's end and the next one's start: the host's time per token
    /// (GPU only; events around each step).
    #[arg(long)]
    pub step_times: bool,
    #[command(flatten)]
    pub batched_args: crate::batched_bench::BatchedArgs,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphEdgesArg {
    Overlapped,
    Serial,
}

impl From<GraphEdgesArg> for kiln_cuda::GraphEdges {
    fn from(arg: GraphEdgesArg) -> Self {
        match arg {
            GraphEdgesArg::Overlapped => kiln_cuda::GraphEdges::Overlapped,
            GraphEdgesArg::Serial => kiln_cuda::GraphEdges::Serial,
        }
    }
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuKernelsArg {
    Auto,
    Avx512Vnni,
    AvxVnni,
    Avx2,
    NeonDot,
    Neon,
    Scalar,
}

impl CpuKernelsArg {
    /// The CPU backend with these kernels, or why this CPU cannot run them.
    fn backend(self) -> CliResult<CpuBackend> {
        let simd = match self {
            CpuKernelsArg::Auto => return Ok(CpuBackend::new()),
            CpuKernelsArg::Avx512Vnni => SimdLevel::Avx512Vnni,
            CpuKernelsArg::AvxVnni => SimdLevel::AvxVnni,
            CpuKernelsArg::Avx2 => SimdLevel::Avx2,
            CpuKernelsArg::NeonDot => SimdLevel::NeonDot,
            CpuKernelsArg::Neon => SimdLevel::Neon,
            CpuKernelsArg::Scalar => SimdLevel::Scalar,
        };
        if !simd.is_available() {
            return Err(format!("--cpu-kernels {self:?}: this CPU does not have the instructions for {simd:?}").into());
        }
        Ok(CpuBackend::with_options(CpuOptions { simd, ..CpuOptions::default() }))
    }
}

/// One row of the table: a prompt test (`n_gen == 0`) or a generation test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TestSpec {
    n_prompt: usize,
    n_gen: usize,
    n_depth: usize,
}

impl TestSpec {
    /// llama-bench's test name: "pp512", "tg128", "pp512 @ d4096".
    fn name(&self) -> String {
        let base = match (self.n_prompt, self.n_gen) {
            (p, 0) => format!("pp{p}"),
            (0, n) => format!("tg{n}"),
            (p, n) => format!("pp{p}+tg{n}"),
        };
        if self.n_depth > 0 {
            format!("{base} @ d{}", self.n_depth)
        } else {
            base
        }
    }
}

/// llama-bench's test order: per depth, the prompt tests then the generation tests.
fn test_list(args: &BenchArgs) -> Vec<TestSpec> {
    let mut tests = Vec::new();
    for &n_depth in &args.n_depth {
        tests.extend(args.n_prompt.iter().filter(|&&p| p > 0).map(|&n_prompt| TestSpec { n_prompt, n_gen: 0, n_depth }));
        tests.extend(args.n_gen.iter().filter(|&&n| n > 0).map(|&n_gen| TestSpec { n_prompt: 0, n_gen, n_depth }));
    }
    tests
}

/// What llama-bench reports about the model.
struct ModelSummary {
    /// llama.cpp's `llama_model_desc`, e.g. "llama 8B Q4_K - Medium".
    description: String,
    size_bytes: u64,
    n_params: u64,
    bos: Option<u32>,
    add_bos: bool,
}

/// `general.file_type`, or llama.cpp's guess from the most common tensor type.
fn file_type_id(file: &GgufFile) -> u32 {
    if let Some(id) = file.get("general.file_type").and_then(Value::as_u64) {
        return id as u32;
    }
    let mut counts: Vec<(kiln_quant::GgmlType, usize)> = Vec::new();
    for t in file.tensors() {
        match counts.iter_mut().find(|(ty, _)| *ty == t.ty) {
            Some((_, n)) => *n += 1,
            None => counts.push((t.ty, 1)),
        }
    }
    let most_common = counts.into_iter().max_by_key(|&(_, n)| n).map(|(ty, _)| ty);
    most_common.and_then(FileType::guess_from).map_or(FileType::AllF32.id(), FileType::id) | FILE_TYPE_GUESSED
}

impl ModelSummary {
    fn of(file: &GgufFile) -> CliResult<ModelSummary> {
        let hp = QuantHparams::from_metadata(file.metadata())?;
        let description = format!("{} {} {}", hp.arch, hp.size_label().unwrap_or("?B"), describe_file_type(file_type_id(file)));
        // Without the key, llama.cpp adds BOS for SentencePiece and Llama 3 vocabularies.
        let model = file.get("tokenizer.ggml.model").and_then(Value::as_str);
        let pre = file.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("");
        let bos_by_default = model == Some("llama") || matches!(pre, "llama3" | "llama-v3" | "llama-bpe" | "falcon3");
        Ok(ModelSummary {
            description,
            size_bytes: file.tensors().iter().map(|t| t.n_bytes).sum(),
            n_params: file.tensors().iter().map(|t| t.n_elements()).sum(),
            bos: file.get("tokenizer.ggml.bos_token_id").and_then(Value::as_u64).map(|b| b as u32),
            add_bos: file.get("tokenizer.ggml.add_bos_token").and_then(Value::as_bool).unwrap_or(bos_by_default),
        })
    }
}

/// Deterministic token ids in the vocabulary (llama-bench uses `rand() % n_vocab`).
pub(crate) struct TokenDraw {
    pub(crate) state: u64,
    pub(crate) n_vocab: u32,
}

impl TokenDraw {
    pub(crate) fn next(&mut self) -> u32 {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        (self.state % self.n_vocab as u64) as u32
    }

    /// A prompt as llama-bench builds one: BOS first when the model wants it.
    fn prompt(&mut self, n: usize, model: &ModelSummary) -> Vec<u32> {
        (0..n).map(|i| if i == 0 && model.add_bos { model.bos.unwrap_or_else(|| self.next()) } else { self.next() }).collect()
    }
}

/// The timings of one test.
struct TestResult {
    spec: TestSpec,
    samples_ns: Vec<u64>,
}

impl TestResult {
    fn tokens_per_second(&self) -> Vec<f64> {
        let n = (self.spec.n_prompt + self.spec.n_gen) as f64;
        self.samples_ns.iter().map(|&ns| 1e9 * n / ns.max(1) as f64).collect()
    }
}

/// Mean and sample standard deviation (0 for fewer than two samples).
fn mean_std(v: &[f64]) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    if v.len() < 2 {
        return (mean, 0.0);
    }
    let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

fn prefill<B: Backend>(model: &mut Model<B>, tokens: &[u32]) -> CliResult {
    model.forward(tokens, Logits::Last)?;
    model.backend().synchronize()?;
    Ok(())
}

fn generate<B: Backend>(model: &mut Model<B>, tokens: &[u32]) -> CliResult {
    let greedy = SamplingParams::greedy();
    for &t in tokens {
        model.decode_sample(t, &greedy)?;
    }
    Ok(())
}

/// llama-bench's method: one warm-up, then per repetition an emptied cache,
/// the depth prefilled untimed, and the timed prompt or generation run.
/// Token ids are drawn before the clock starts.
fn run_test<B: Backend>(
    model: &mut Model<B>,
    summary: &ModelSummary,
    draw: &mut TokenDraw,
    spec: TestSpec,
    reps: usize,
    warmup: Option<usize>,
) -> CliResult<TestResult> {
    let timed = |model: &mut Model<B>, tokens: &[u32]| -> CliResult<u64> {
        let start = Instant::now();
        if spec.n_prompt > 0 {
            prefill(model, tokens)?;
        } else {
            generate(model, tokens)?;
        }
        Ok(start.elapsed().as_nanos() as u64)
    };
    if let Some(gen_tokens) = warmup {
        // The whole prompt, or `gen_tokens` generated tokens (llama-bench: one).
        model.reset();
        let n = if spec.n_prompt > 0 { spec.n_prompt } else { gen_tokens };
        timed(model, &draw.prompt(n, summary))?;
    }
    let mut samples_ns = Vec::with_capacity(reps);
    for _ in 0..reps {
        model.reset();
        if spec.n_depth > 0 {
            prefill(model, &draw.prompt(spec.n_depth, summary))?;
        }
        let tokens = draw.prompt(spec.n_prompt.max(spec.n_gen), summary);
        samples_ns.push(timed(model, &tokens)?);
    }
    Ok(TestResult { spec, samples_ns })
}

/// llama-bench's markdown columns: (display name, width; negative = left-aligned).
fn columns(cpu: bool, threads_given: bool) -> Vec<(&'static str, i32)> {
    let mut cols = vec![("model", -30), ("size", 10), ("params", 10), ("backend", -10)];
    if !cpu {
        cols.push(("ngl", 3));
    }
    if cpu || threads_given {
        cols.push(("threads", 7));
    }
    cols.extend([("test", 15), ("t/s", 20)]);
    cols
}

fn cell(value: &str, width: i32) -> String {
    let w = width.unsigned_abs() as usize;
    if width < 0 {
        format!(" {value:<w$} |")
    } else {
        format!(" {value:>w$} |")
    }
}

fn markdown_header(cols: &[(&str, i32)]) -> String {
    let names: String = cols.iter().map(|&(name, w)| cell(name, w)).collect();
    let rule: String = cols.iter().map(|&(_, w)| format!(" {}{} |", "-".repeat(w.unsigned_abs() as usize - 1), if w > 0 { ":" } else { "-" })).collect();
    format!("|{names}\n|{rule}")
}

/// Everything printed about one test, in llama-bench's field order.
struct Report<'a> {
    path: &'a Path,
    model: &'a ModelSummary,
    backend_label: String,
    backend_name: String,
    n_batch: usize,
    n_threads: usize,
    n_gpu_layers: i64,
    type_k: String,
    type_v: String,
}

impl Report<'_> {
    fn is_cpu(&self) -> bool {
        self.backend_label == "CPU"
    }

    fn size(&self) -> String {
        let b = self.model.size_bytes as f64;
        if self.model.size_bytes < 1 << 30 {
            format!("{:.2} MiB", b / (1u64 << 20) as f64)
        } else {
            format!("{:.2} GiB", b / (1u64 << 30) as f64)
        }
    }

    fn params(&self) -> String {
        let n = self.model.n_params as f64;
        if self.model.n_params < 1_000_000_000 {
            format!("{:.2} M", n / 1e6)
        } else {
            format!("{:.2} B", n / 1e9)
        }
    }

    fn markdown_row(&self, cols: &[(&str, i32)], r: &TestResult) -> String {
        let (avg, std) = mean_std(&r.tokens_per_second());
        let value = |name: &str| match name {
            "model" => self.model.description.clone(),
            "size" => self.size(),
            "params" => self.params(),
            "backend" => self.backend_label.clone(),
            "ngl" => self.n_gpu_layers.to_string(),
            "threads" => self.n_threads.to_string(),
            "test" => r.spec.name(),
            _ => format!("{avg:.2} ± {std:.2}"),
        };
        let cells: String = cols.iter().map(|&(name, w)| cell(&value(name), w)).collect();
        format!("|{cells}")
    }

    fn json_object(&self, r: &TestResult) -> String {
        let ts = r.tokens_per_second();
        let (avg_ts, std_ts) = mean_std(&ts);
        let ns: Vec<f64> = r.samples_ns.iter().map(|&n| n as f64).collect();
        let (avg_ns, std_ns) = mean_std(&ns);
        let cpu = self.is_cpu();
        let fields = [
            ("build_commit", json!(format!("kiln-{}", env!("CARGO_PKG_VERSION")))),
            ("build_number", json!(0)),
            ("cpu_info", json!(cpu_info())),
            ("gpu_info", json!(if cpu { String::new() } else { self.backend_name.clone() })),
            ("backends", json!(self.backend_label)),
            ("model_filename", json!(self.path.display().to_string())),
            ("model_type", json!(self.model.description)),
            ("model_size", json!(self.model.size_bytes)),
            ("model_n_params", json!(self.model.n_params)),
            ("n_batch", json!(self.n_batch)),
            ("n_ubatch", json!(self.n_batch)),
            ("n_threads", json!(self.n_threads)),
            ("cpu_mask", json!("0x0")),
            ("cpu_strict", json!(false)),
            ("poll", json!(50)),
            ("type_k", json!(self.type_k)),
            ("type_v", json!(self.type_v)),
            ("n_gpu_layers", json!(self.n_gpu_layers)),
            ("n_cpu_moe", json!(0)),
            ("split_mode", json!("layer")),
            ("main_gpu", json!(0)),
            ("no_kv_offload", json!(false)),
            ("flash_attn", json!(0)),
            ("devices", json!("auto")),
            ("tensor_split", json!("0.00")),
            ("tensor_buft_overrides", json!("none")),
            ("load_mode", json!("mmap")),
            ("embeddings", json!(false)),
            ("no_op_offload", json!(0)),
            ("no_host", json!(false)),
            ("fit_target", json!(0)),
            ("fit_min_ctx", json!(0)),
            ("n_prompt", json!(r.spec.n_prompt)),
            ("n_gen", json!(r.spec.n_gen)),
            ("n_depth", json!(r.spec.n_depth)),
            ("test_time", json!(utc_timestamp())),
            ("avg_ns", json!(avg_ns.round() as u64)),
            ("stddev_ns", json!(std_ns.round() as u64)),
            ("avg_ts", json!(avg_ts)),
            ("stddev_ts", json!(std_ts)),
            ("samples_ns", json!(r.samples_ns)),
            ("samples_ts", json!(ts)),
        ];
        let body: Vec<String> = fields.iter().map(|(k, v)| format!("    \"{k}\": {v}")).collect();
        format!("  {{\n{}\n  }}", body.join(",\n"))
    }
}

fn cpu_info() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    info.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split_once(':')).map(|(_, v)| v.trim().to_string()).unwrap_or_default()
}

/// The current time as RFC 3339 ("2024-05-01T12:34:56Z"), as llama-bench writes it.
fn utc_timestamp() -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = ((secs / 86400) as i64, secs % 86400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// The short backend name llama-bench prints ("CPU", "CUDA"): the first word
/// of the backend's own description.
fn backend_label(name: &str) -> String {
    name.split(|c: char| c.is_whitespace() || c == '(').next().unwrap_or(name).to_string()
}

pub fn bench(args: BenchArgs) -> CliResult {
    crate::run::set_threads(args.threads);
    let path = args.model.clone().unwrap_or_else(crate::default_model);
    let file = crate::run::open_model(&Some(path.clone()))?;
    let edges = args.graph_edges.into();
    let open = |ordinal| open_gpu_numbered(ordinal, edges);
    let gpu = match args.device {
        Some(DeviceKind::Cpu) => None,
        Some(DeviceKind::Cuda) => Some(devices::gpus(args.split, open)?),
        None => devices::gpus_if_any("kiln bench", args.split, open)?,
    };
    if args.kernel_profile && gpu.is_none() {
        return Err("--kernel-profile times the kernels of GPU step graphs; this run is on the CPU".into());
    }
    if args.step_times && gpu.is_none() {
        return Err("--step-times times decode steps on the GPU; this run is on the CPU".into());
    }
    if args.kernel_profile && args.no_warmup {
        return Err("--kernel-profile profiles each decode graph during the warm-up; it cannot go with --no-warmup".into());
    }
    match (gpu, args.batched) {
        (Some(gpus), batched) => {
            let lead = gpus.lead();
            if args.kernel_profile {
                lead.profile_step_graphs();
            }
            if args.step_times {
                lead.time_steps()?;
            }
            if batched {
                crate::batched_bench::run(gpus, file, &args)?;
            } else {
                bench_with(gpus, file, &path, &args)?;
            }
            if args.kernel_profile {
                // After a JSON table the profile goes to stderr, so stdout stays one JSON value.
                let profiles = lead.step_profiles();
                match args.output {
                    OutputFormat::Md => crate::kernel_profile::print(&profiles, &mut std::io::stdout().lock())?,
                    OutputFormat::Json => crate::kernel_profile::print(&profiles, &mut std::io::stderr().lock())?,
                }
            }
            if args.step_times {
                let summary = crate::kernel_profile::step_times_summary(&lead.step_times());
                match args.output {
                    OutputFormat::Md => writeln!(std::io::stdout().lock(), "\n{summary}")?,
                    OutputFormat::Json => eprintln!("{summary}"),
                }
            }
            Ok(())
        }
        (None, batched) => {
            args.cpu_kernels.backend()?;
            let cpu = devices::cpu(args.split, || args.cpu_kernels.backend().expect("checked above"))?;
            if batched {
                on_cpu_workers(args.threads, || crate::batched_bench::run(cpu, file, &args))
            } else {
                on_cpu_workers(args.threads, || bench_with(cpu, file, &path, &args))
            }
        }
    }
}

fn bench_with<B: Backend>(devices: Devices<B>, file: Arc<GgufFile>, path: &Path, args: &BenchArgs) -> CliResult {
    let backend = devices.lead();
    let tests = test_list(args);
    if tests.is_empty() {
        return Err("nothing to run: every -p and -n value is 0".into());
    }
    let summary = ModelSummary::of(&file)?;
    let n_ctx = tests.iter().map(|t| t.n_depth + t.n_prompt + t.n_gen).max().unwrap_or(1);
    let longest_batch = tests.iter().map(|t| t.n_depth.max(t.n_prompt)).max().unwrap_or(1);
    let n_batch = args.batch_size.min(longest_batch).max(1);
    let options = ModelOptions { n_ctx: Some(n_ctx), n_batch, ..ModelOptions::default() };
    eprintln!("kiln bench: loading {} (context {n_ctx}, batch {n_batch})", path.display());
    let mut model = Model::with_engine(devices.engine(&args.kv, &file, options.engine_options(n_ctx))?);
    let engine_options = model.engine().options().clone();
    let backend_name = backend.name();
    let label = backend_label(&backend_name);
    // llama-bench shows the -ngl it was given; offloading everything is "99" by convention.
    let n_gpu_layers = if label == "CPU" { 0 } else { 99 };
    let report = Report {
        path,
        model: &summary,
        backend_label: label,
        backend_name,
        n_batch,
        n_threads: rayon::current_num_threads(),
        n_gpu_layers,
        type_k: engine_options.k_type.to_string(),
        type_v: engine_options.v_type.to_string(),
    };
    let cols = columns(report.is_cpu(), args.threads.is_some());
    let mut draw = TokenDraw { state: 0x9E37_79B9_7F4A_7C15, n_vocab: model.config.n_vocab as u32 };
    // A decode graph is recorded at a key's second step and first replayed (and, under
    // --kernel-profile, profiled) at its third: warm up through that step so that no timed
    // repetition includes the profile.
    let warmup = (!args.no_warmup).then_some(if args.kernel_profile { 3 } else { 1 });
    let mut out = std::io::stdout().lock();
    match args.output {
        OutputFormat::Md => writeln!(out, "{}", markdown_header(&cols))?,
        OutputFormat::Json => writeln!(out, "[")?,
    }
    for (i, &spec) in tests.iter().enumerate() {
        eprintln!("kiln bench: {} ({}/{})", spec.name(), i + 1, tests.len());
        let result = run_test(&mut model, &summary, &mut draw, spec, args.repetitions, warmup)?;
        match args.output {
            OutputFormat::Md => writeln!(out, "{}", report.markdown_row(&cols, &result))?,
            OutputFormat::Json => write!(out, "{}{}", if i > 0 { ",\n" } else { "" }, report.json_object(&result))?,
        }
        out.flush()?;
    }
    match args.output {
        OutputFormat::Md => writeln!(out, "\nbuild: kiln {}", env!("CARGO_PKG_VERSION"))?,
        OutputFormat::Json => writeln!(out, "\n]")?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markdown_header_matches_llama_bench() {
        let header = markdown_header(&columns(true, false));
        let expected = "| model                          |       size |     params | backend    | threads |            test |                  t/s |\n\
                        | ------------------------------ | ---------: | ---------: | ---------- | ------: | --------------: | -------------------: |";
        assert_eq!(header, expected);
        let gpu = markdown_header(&columns(false, false));
        assert!(gpu.starts_with("| model                          |       size |     params | backend    | ngl |            test |"), "{gpu}");
    }

    #[test]
    fn test_names_and_order_follow_llama_bench() {
        let args = BenchArgs::parse_from(["bench", "-p", "512", "-n", "128", "-d", "0,4096"]);
        let names: Vec<String> = test_list(&args).iter().map(TestSpec::name).collect();
        assert_eq!(names, ["pp512", "tg128", "pp512 @ d4096", "tg128 @ d4096"]);
    }

    #[test]
    fn statistics_and_timestamp() {
        let (m, s) = mean_std(&[2.0, 4.0, 6.0]);
        assert_eq!((m, s), (4.0, 2.0));
        assert_eq!(mean_std(&[5.0]), (5.0, 0.0));
        let ts = utc_timestamp();
        assert_eq!(ts.len(), 20, "{ts}");
        assert!(ts.ends_with('Z') && ts.as_bytes()[10] == b'T', "{ts}");
        assert_eq!(backend_label("CPU (2 threads)"), "CPU");
        assert_eq!(backend_label("CUDA"), "CUDA");
    }
}
