//! `kiln serve`: an OpenAI-compatible HTTP server over kiln's batched engine.
//!
//! Three parts, as in vLLM v1: the [`scheduler`] (continuous batching, chunked prefill,
//! preemption) owns the engine (the model runner) on one dedicated thread; the
//! [`prefix_cache`] is the KV-cache manager's sharing of full blocks across requests; the
//! HTTP layer ([`http`], [`generate`]) runs on a small tokio runtime and talks to the
//! scheduler only through channels.

pub mod error;
pub mod generate;
pub mod http;
pub mod listen;
pub mod metrics;
pub mod prefix_cache;
pub mod reasoning;
pub mod request;
pub mod respond;
pub mod scheduler;
pub mod stop;
pub mod template;
pub mod tool_calls;

use std::io::Write;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kiln_core::Backend;
use kiln_models::Engine;
use kiln_tokenizer::Tokenizer;
use tokio::sync::{oneshot, watch};

use crate::http::{AppState, Ready};
use crate::metrics::Metrics;
pub use crate::reasoning::ReasoningFormat;
use crate::reasoning::ReasoningSyntax;
pub use crate::scheduler::SchedulerConfig;
use crate::scheduler::{Command, Scheduler, SchedulerHandle};
use crate::tool_calls::ToolSyntax;

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub host: String,
    /// 0 picks a free port (the ready line says which).
    pub port: u16,
    pub api_key: Option<String>,
    /// The model name to list and answer with; default: the file name.
    pub alias: Option<String>,
    /// `--chat-template NAME|FILE`, replacing the model's own template.
    pub chat_template: Option<String>,
    /// Chat answers' reasoning split from their content, unless a request says otherwise.
    pub reasoning_format: ReasoningFormat,
    pub max_body_bytes: usize,
    pub scheduler: SchedulerConfig,
    /// How long in-flight responses get to end after a stop signal.
    pub shutdown_grace: Duration,
    /// How long a request's headers, and then its body, may take to arrive.
    pub header_read_timeout: Duration,
    pub body_read_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            api_key: None,
            alias: None,
            chat_template: None,
            reasoning_format: ReasoningFormat::Auto,
            max_body_bytes: 8 << 20,
            scheduler: SchedulerConfig { max_running: 4, max_waiting: 256, step_tokens: 512 },
            shutdown_grace: Duration::from_secs(10),
            header_read_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(60),
        }
    }
}

/// Handed to the loader on the engine thread: load the model there, then call [`EngineSlot::run`].
pub struct EngineSlot {
    commands: Receiver<Command>,
    state: Arc<AppState>,
    config: ServerConfig,
    url: String,
}

impl EngineSlot {
    /// Publishes the model as ready and runs the scheduler until the server stops.
    /// `file_name` names the model when no alias is given.
    pub fn run<B: Backend>(self, engine: Engine<B>, tokenizer: Tokenizer, file_name: &str) -> Result<(), String> {
        let template = template::resolve(self.config.chat_template.as_deref(), tokenizer.chat_template())?;
        let eog = tokenizer.end_of_generation_ids().to_vec();
        let ready = Ready {
            model_name: self.config.alias.clone().unwrap_or_else(|| file_name.to_string()),
            n_ctx: engine.options().max_seq_len,
            n_vocab: engine.weights().config.n_vocab,
            created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            tokenizer: Arc::new(tokenizer),
            reasoning_syntax: template.as_ref().and_then(|t| ReasoningSyntax::of_template(t.source())),
            reasoning_format: self.config.reasoning_format,
            tool_syntax: template.as_ref().and_then(|t| ToolSyntax::of_template(t.source())),
            template,
        };
        let has_template = ready.template.is_some();
        let scheduler = Scheduler::new(engine, self.config.scheduler.clone(), &eog, self.state.metrics.clone(), self.commands);
        let _ = self.state.ready.set(ready);
        if !has_template {
            eprintln!("kiln serve: the model has no chat template; /v1/chat/completions answers an error unless --chat-template is given");
        }
        println!("kiln serve: ready, listening on {}", self.url);
        let _ = std::io::stdout().flush();
        scheduler.run();
        Ok(())
    }
}

async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|&s| s).await;
}

/// Binds, then loads the model on a dedicated engine thread through `load` while `/health`
/// answers 503, then serves until SIGINT/SIGTERM (or until the engine thread ends). In-flight
/// streams end with an error event; returns once they have (or after the grace period).
pub fn serve(config: ServerConfig, load: impl FnOnce(EngineSlot) -> Result<(), String> + Send + 'static) -> Result<(), String> {
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 4));
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(workers).enable_all().build().map_err(|e| format!("tokio runtime: {e}"))?;
    runtime.block_on(async move {
        let listener =
            tokio::net::TcpListener::bind((config.host.as_str(), config.port)).await.map_err(|e| format!("binding {}:{}: {e}", config.host, config.port))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let url = format!("http://{addr}");
        eprintln!("kiln serve: bound to {url}, loading the model");

        let (commands, receiver) = std::sync::mpsc::channel();
        let scheduler = SchedulerHandle::new(commands);
        let mut state = AppState::new(scheduler.clone(), Arc::new(Metrics::default()), config.api_key.clone(), config.max_body_bytes);
        state.body_read_timeout = config.body_read_timeout;
        state.max_choices = state.max_choices.min(config.scheduler.max_waiting);
        let state = Arc::new(state);
        let slot = EngineSlot { commands: receiver, state: state.clone(), config: config.clone(), url };
        let (engine_done, engine_result) = oneshot::channel();
        std::thread::Builder::new()
            .name("kiln-engine".into())
            .spawn(move || {
                let result = std::panic::catch_unwind(AssertUnwindSafe(|| load(slot))).unwrap_or_else(|_| Err("the engine thread panicked".into()));
                let _ = engine_done.send(result);
            })
            .map_err(|e| format!("starting the engine thread: {e}"))?;

        let (stop, stop_rx) = watch::channel(false);
        let watcher = tokio::spawn(async move {
            let outcome = tokio::select! {
                _ = stop_signal() => {
                    eprintln!("kiln serve: stopping");
                    Ok(())
                }
                r = engine_result => r.unwrap_or_else(|_| Err("the engine thread ended".into())).and(Err("the engine thread ended".into())),
            };
            scheduler.shutdown();
            let _ = stop.send(true);
            outcome
        });
        let server = listen::serve_http(listener, http::router(state), config.header_read_timeout, stopped(stop_rx.clone()));
        let grace = config.shutdown_grace;
        tokio::select! {
            () = server => {}
            _ = async { stopped(stop_rx).await; tokio::time::sleep(grace).await } => {
                eprintln!("kiln serve: responses still open after {grace:?}; closing them");
            }
        }
        watcher.await.map_err(|e| e.to_string())?
    })
}
