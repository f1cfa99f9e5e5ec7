//! `kiln quantize`: convert a GGUF model to another file type, like llama-quantize.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kiln_quant::file::{parse_file_type, quantize_file, Progress, QuantizeOptions, TensorPlan, WriteSummary};

use crate::CliResult;

#[derive(Parser, Debug)]
pub struct QuantizeArgs {
    /// Input GGUF model.
    pub input: PathBuf,
    /// Output GGUF file.
    pub output: PathBuf,
    /// File type: F32, F16, BF16, Q8_0, Q4_0, ..., Q4_K_M, Q5_K_M, Q6_K, IQ4_NL, IQ3_S, IQ3_M, TQ2_0, Q1_0, Q2_0, MXFP4_MOE, NVFP4 (or its llama.cpp id).
    #[arg(value_name = "TYPE")]
    pub file_type: String,
    /// Put every quantizable tensor in TYPE, without the mix's per-tensor choices.
    #[arg(long)]
    pub pure: bool,
    /// Allow converting tensors that are already quantized.
    #[arg(long)]
    pub allow_requantize: bool,
    /// Threads (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
}

/// An indicatif bar over all elements, plus llama-quantize's per-tensor line.
pub struct ProgressReport {
    bar: ProgressBar,
    n_tensors: AtomicUsize,
    /// The tensor being written, announced once it is done.
    current: Mutex<Option<(usize, TensorPlan)>>,
}

const MIB: f64 = 1024.0 * 1024.0;

fn tensor_mib(ty: kiln_quant::GgmlType, n_elements: u64) -> f64 {
    ty.bytes_for(n_elements).unwrap_or(0) as f64 / MIB
}

impl ProgressReport {
    pub fn stderr() -> ProgressReport {
        let bar = ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr());
        let style = ProgressStyle::with_template("{spinner} [{elapsed_precise}] {wide_bar} {percent:>3}% eta {eta} {msg}").expect("the template is valid");
        bar.set_style(style);
        ProgressReport { bar, n_tensors: AtomicUsize::new(0), current: Mutex::new(None) }
    }

    fn announce_done(&self) {
        if let Some((index, p)) = self.current.lock().expect("progress lock").take() {
            let shape = p.dims.iter().map(|d| format!("{d:6}")).collect::<Vec<_>>().join(", ");
            let n = p.n_elements();
            let what = if p.src_type == p.dst_type {
                format!("size = {:8.3} MiB", tensor_mib(p.src_type, n))
            } else {
                format!("converting to {} .. size = {:8.2} MiB -> {:8.2} MiB", p.dst_type, tensor_mib(p.src_type, n), tensor_mib(p.dst_type, n))
            };
            let fallback = if p.fallback { " (fallback)" } else { "" };
            let line = format!(
                "[{:4}/{:4}] {:36} - [{shape}], type = {:>6}, {what}{fallback}",
                index + 1,
                self.n_tensors.load(Ordering::Relaxed),
                p.name,
                p.src_type.name()
            );
            self.bar.suspend(|| eprintln!("{line}"));
        }
    }

    pub fn finish(&self) {
        self.announce_done();
        self.bar.finish_and_clear();
    }
}

impl Progress for ProgressReport {
    fn planned(&self, plans: &[TensorPlan]) {
        self.n_tensors.store(plans.len(), Ordering::Relaxed);
        self.bar.set_length(plans.iter().map(TensorPlan::n_elements).sum());
    }

    fn tensor_started(&self, index: usize, plan: &TensorPlan) {
        self.announce_done();
        self.bar.set_message(plan.name.clone());
        *self.current.lock().expect("progress lock") = Some((index, plan.clone()));
    }

    fn advanced(&self, n_elements: u64) {
        self.bar.inc(n_elements);
    }
}

/// llama-quantize's closing lines: sizes, bits per weight, time.
pub fn print_summary(output: &Path, s: &WriteSummary) {
    let bpw = |bytes: u64| bytes as f64 * 8.0 / s.n_elements.max(1) as f64;
    eprintln!("model size  = {:8.2} MiB ({:.2} BPW)", s.src_bytes as f64 / MIB, bpw(s.src_bytes));
    eprintln!("quant size  = {:8.2} MiB ({:.2} BPW)", s.dst_bytes as f64 / MIB, bpw(s.dst_bytes));
    if s.n_fallback > 0 {
        eprintln!("{} of {} tensor(s) required fallback quantization", s.n_fallback, s.n_tensors);
    }
    let file_size = std::fs::metadata(output).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "wrote {} ({:.2} MiB, {} tensors, {} converted) in {:.2} s",
        output.display(),
        file_size as f64 / MIB,
        s.n_tensors,
        s.n_converted,
        s.elapsed.as_secs_f64()
    );
}

pub fn quantize(args: QuantizeArgs) -> CliResult {
    crate::run::set_threads(args.threads);
    let ftype = parse_file_type(&args.file_type)?;
    let options = QuantizeOptions { ftype, pure: args.pure, allow_requantize: args.allow_requantize, allow_without_imatrix: false };
    eprintln!("quantizing {} to {} as {} ({} threads)", args.input.display(), args.output.display(), ftype, rayon::current_num_threads());
    let progress = ProgressReport::stderr();
    let result = quantize_file(&args.input, &args.output, &options, &progress);
    progress.finish();
    print_summary(&args.output, &result?);
    Ok(())
}
