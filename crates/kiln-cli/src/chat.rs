//! `kiln chat`: a terminal conversation with a model through its chat template, like
//! llama-cli's conversation mode. Each turn renders the whole conversation, but only the tokens
//! after what the KV cache already holds are fed.
//!
//! With stdin not a terminal, lines are read from it without a prompt, and each reply on stdout
//! is followed by a line holding only [`REPLY_END`], so that a program can split the replies.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use clap::Parser;
use kiln_core::{Backend, CpuBackend};
use kiln_gguf::GgufFile;
use kiln_models::{generate, GenerateParams, Model, ModelOptions, StopReason};
use kiln_tokenizer::{ChatInputs, ChatTemplate, Tokenizer};
use serde_json::{json, Value};

use crate::kv_args::KvArgs;
use crate::run::{on_cpu_workers, open_gpu, open_model, set_threads, DeviceKind, SamplingArgs};
use crate::CliResult;

/// The ASCII record separator, on a line of its own after each reply when stdin is not a terminal.
pub const REPLY_END: char = '\u{1e}';

#[derive(Parser, Debug)]
pub struct ChatArgs {
    /// GGUF model file (default: the stories260K model shipped with kiln).
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
    /// System message that opens the conversation.
    #[arg(long = "system-prompt", visible_alias = "sys")]
    pub system_prompt: Option<String>,
    /// A built-in template name (chatml, llama3, gemma, ...) or a Jinja file; default: the
    /// model's tokenizer.chat_template.
    #[arg(long = "chat-template")]
    pub chat_template: Option<String>,
    /// Most tokens per reply; -1 runs until end of generation or a full context.
    #[arg(short = 'n', long = "n-predict", default_value_t = -1, allow_negative_numbers = true)]
    pub n_predict: i64,
    /// Context size in tokens, for the whole conversation; 0 uses the model's training context.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 0)]
    pub ctx_size: usize,
    /// Prompt tokens per forward pass.
    #[arg(short = 'b', long = "batch-size", default_value_t = 512)]
    pub batch_size: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// CPU threads (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// Where to run: `cuda` (GPU 0) or `cpu`; by default the GPU when one is available.
    #[arg(long, value_enum)]
    pub device: Option<DeviceKind>,
    #[command(flatten)]
    pub kv: KvArgs,
}

/// What Ctrl-C does: stop the reply being generated, or, pressed twice at the prompt, quit.
#[derive(Default)]
struct Interrupts {
    generating: AtomicBool,
    stop_reply: AtomicBool,
    at_prompt: AtomicU32,
}

impl Interrupts {
    fn on_sigint(&self, interactive: bool) {
        if self.generating.load(Ordering::SeqCst) {
            self.stop_reply.store(true, Ordering::SeqCst);
        } else if self.at_prompt.fetch_add(1, Ordering::SeqCst) >= 1 || !interactive {
            eprintln!();
            std::process::exit(130);
        } else {
            eprint!("\n(Ctrl-C again or /exit to quit)\n> ");
        }
    }
}

pub fn chat(args: ChatArgs) -> CliResult {
    set_threads(args.threads);
    let file = open_model(&args.model)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let template = ChatTemplate::resolve(args.chat_template.as_deref(), tokenizer.chat_template())?;
    let interactive = std::io::stdin().is_terminal();
    let interrupts = Arc::new(Interrupts::default());
    let handler = interrupts.clone();
    ctrlc::set_handler(move || handler.on_sigint(interactive)).map_err(|e| format!("cannot handle Ctrl-C: {e}"))?;
    let session = Session { tokenizer: &tokenizer, template: &template, args: &args, interactive, interrupts: &interrupts };
    let gpu = match args.device {
        Some(DeviceKind::Cpu) => None,
        Some(DeviceKind::Cuda) => Some(open_gpu()?),
        None => open_gpu().map_err(|e| eprintln!("kiln: no usable GPU: {e}; running on the CPU")).ok(),
    };
    match gpu {
        Some(gpu) => session.run(Arc::new(gpu), file),
        None => on_cpu_workers(args.threads, || session.run(Arc::new(CpuBackend::new()), file)),
    }
}

struct Session<'a> {
    tokenizer: &'a Tokenizer,
    template: &'a ChatTemplate,
    args: &'a ChatArgs,
    interactive: bool,
    interrupts: &'a Interrupts,
}

/// How many leading elements `a` and `b` share.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Session<'_> {
    fn run<B: Backend>(&self, backend: Arc<B>, file: Arc<GgufFile>) -> CliResult {
        let args = self.args;
        let options = ModelOptions { n_ctx: (args.ctx_size > 0).then_some(args.ctx_size), n_batch: args.batch_size, ..Default::default() };
        let n_ctx_train = kiln_models::ModelConfig::from_gguf(&file)?.n_ctx_train;
        let (weights, engine_options) = args.kv.load(&*backend, &file, options.engine_options(n_ctx_train))?;
        let mut model = Model::with_weights(backend.clone(), weights, &engine_options)?;
        let params = GenerateParams { n_predict: (args.n_predict >= 0).then_some(args.n_predict as usize), sampling: args.sampling.params(), stop: Vec::new() };
        eprintln!(
            "kiln: {} ({}), ctx {}, backend {}, seed {}",
            model.config.name.as_deref().unwrap_or("model"),
            model.config.arch.name(),
            model.n_ctx(),
            backend.name(),
            params.sampling.seed
        );
        if self.interactive {
            eprintln!("kiln: chatting; Ctrl-C stops a reply, /exit or Ctrl-D quits");
        }
        let mut messages: Vec<Value> = Vec::new();
        if let Some(system) = &args.system_prompt {
            messages.push(json!({"role": "system", "content": system}));
        }
        let stdin = std::io::stdin();
        let mut input = stdin.lock();
        let mut line = String::new();
        loop {
            if self.interactive {
                print!("> ");
                std::io::stdout().flush()?;
            }
            line.clear();
            self.interrupts.at_prompt.store(0, Ordering::SeqCst);
            if input.read_line(&mut line)? == 0 {
                if self.interactive {
                    println!();
                }
                return Ok(());
            }
            let text = line.trim_end_matches(['\n', '\r']);
            if text.trim() == "/exit" {
                return Ok(());
            }
            if text.trim().is_empty() {
                continue;
            }
            messages.push(json!({"role": "user", "content": text}));
            match self.reply(&mut model, &messages, &params)? {
                Some(reply) => messages.push(json!({"role": "assistant", "content": reply})),
                None => {
                    messages.pop();
                }
            }
        }
    }

    /// The prompt of the whole conversation, tokenized with special tokens; BOS added when the
    /// model wants one and the template did not write it.
    fn prompt_tokens(&self, messages: &[Value]) -> Result<Vec<u32>, kiln_tokenizer::TokenizerError> {
        let messages = Value::Array(messages.to_vec());
        let inputs = ChatInputs {
            messages: &messages,
            add_generation_prompt: true,
            bos_token: self.tokenizer.bos_text(),
            eos_token: self.tokenizer.eos_text(),
            ..Default::default()
        };
        let rendered = self.template.render(&inputs)?;
        let mut tokens = self.tokenizer.encode(&rendered, false, true);
        if let Some(bos) = self.tokenizer.bos().filter(|_| self.tokenizer.add_bos()) {
            if tokens.first() != Some(&bos) {
                tokens.insert(0, bos);
            }
        }
        Ok(tokens)
    }

    /// Generates the assistant's reply to the conversation, streaming it to stdout. `None`
    /// when the template refused the conversation (the error is printed; the session goes on).
    fn reply<B: Backend>(&self, model: &mut Model<B>, messages: &[Value], params: &GenerateParams) -> CliResult<Option<String>> {
        let tokens = match self.prompt_tokens(messages) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("kiln: {e}");
                return Ok(None);
            }
        };
        if tokens.is_empty() {
            eprintln!("kiln: the chat template rendered an empty prompt");
            return Ok(None);
        }
        // Reuse the cached prefix; at least one token must be fed to get logits.
        let keep = common_prefix(model.cached_tokens(), &tokens).min(tokens.len() - 1);
        if keep < model.n_past() {
            model.truncate(keep);
        }
        tracing::debug!("chat turn: prompt {} tokens, {keep} reused from the cache", tokens.len());
        if tokens.len() >= model.n_ctx() {
            return Err(format!("context full: the conversation takes {} tokens, the context holds {} (-c)", tokens.len(), model.n_ctx()).into());
        }
        self.interrupts.stop_reply.store(false, Ordering::SeqCst);
        self.interrupts.generating.store(true, Ordering::SeqCst);
        let mut reply = String::new();
        let mut out = std::io::stdout().lock();
        let result = generate(model, self.tokenizer, &tokens[keep..], params, |piece| {
            reply.push_str(piece);
            let written = write!(out, "{piece}").and_then(|_| out.flush()).is_ok();
            written && !self.interrupts.stop_reply.load(Ordering::SeqCst)
        });
        self.interrupts.generating.store(false, Ordering::SeqCst);
        let stats = result?;
        writeln!(out)?;
        if !self.interactive {
            writeln!(out, "{REPLY_END}")?;
        }
        out.flush()?;
        match stats.stop_reason {
            StopReason::TokenLimit => eprintln!("kiln: reply stopped at the -n limit ({} tokens)", stats.generated_tokens),
            StopReason::ContextFull => eprintln!("kiln: reply stopped: the context ({} tokens, -c) is full", model.n_ctx()),
            StopReason::Cancelled => eprintln!("kiln: reply interrupted"),
            StopReason::EndOfGeneration | StopReason::StopString => {}
        }
        Ok(Some(reply))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn common_prefix_counts_shared_leading_tokens() {
        assert_eq!(super::common_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert_eq!(super::common_prefix(&[], &[1]), 0);
        assert_eq!(super::common_prefix(&[1, 2], &[1, 2]), 2);
    }
}
