//! The HTTP layer: routes, the API key check, body limits, panic isolation, and the endpoints
//! that do not generate (health, models, tokenize, detokenize, apply-template, metrics).

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::FutureExt;
use kiln_tokenizer::Tokenizer;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::generate::AnswerParsers;
use crate::metrics::Metrics;
use crate::reasoning::{ReasoningFormat, ReasoningSyntax};
use crate::request::{chat_messages, chat_tools, opt_bool, opt_str, parse_object, Object, MAX_CHOICES};
use crate::scheduler::SchedulerHandle;
use crate::template::{self, TemplateInputs};
use crate::tool_calls::{ToolCallCatcher, ToolSyntax};
use kiln_tokenizer::{ChatTemplate, TokenizerError};

/// What the endpoints need once the model is loaded.
pub struct Ready {
    pub tokenizer: Arc<Tokenizer>,
    pub template: Option<ChatTemplate>,
    /// How the template's model marks its reasoning, if it does.
    pub reasoning_syntax: Option<ReasoningSyntax>,
    /// The server's `--reasoning-format`.
    pub reasoning_format: ReasoningFormat,
    /// How the template's model writes tool calls, if it is taught to.
    pub tool_syntax: Option<ToolSyntax>,
    /// The name `/v1/models` lists and responses carry.
    pub model_name: String,
    pub n_ctx: usize,
    pub n_vocab: usize,
    pub created: u64,
}

impl Ready {
    pub fn check_tokens(&self, tokens: &[u32], field: &str) -> Result<(), ApiError> {
        match tokens.iter().find(|&&t| t as usize >= self.n_vocab) {
            Some(t) => Err(ApiError::field(field, format!("token id {t} is outside the vocabulary of {}", self.n_vocab))),
            None => Ok(()),
        }
    }

    pub fn render_chat(&self, o: &Object, add_generation_prompt: bool) -> Result<String, ApiError> {
        let messages = chat_messages(o)?;
        let template = self.template.as_ref().ok_or_else(|| {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "this model has no chat template: start the server with --chat-template NAME|FILE")
        })?;
        let extra = match o.get("chat_template_kwargs") {
            None | Some(Value::Null) => None,
            Some(Value::Object(m)) => Some(m),
            Some(_) => return Err(ApiError::field("chat_template_kwargs", "must be an object")),
        };
        let inputs = TemplateInputs { messages, tools: chat_tools(o)?, add_generation_prompt, extra };
        template::render(template, &self.tokenizer, &inputs).map_err(|e| match e {
            TokenizerError::TemplateException(message) => ApiError::bad_request(message),
            other => ApiError::bad_request(other.to_string()),
        })
    }

    /// The parsers of a chat answer to `prompt` (rendered): its reasoning split out where the
    /// request's `reasoning_format` (else the server's) says so, its tool calls read where the
    /// request offers `tools` and reads calls; each where the template has a known syntax.
    pub fn answer_parsers(&self, format: Option<ReasoningFormat>, tools: Vec<Value>, read_calls: bool, prompt: &str) -> AnswerParsers {
        let reasoning = self.reasoning_syntax.filter(|_| format.unwrap_or(self.reasoning_format) == ReasoningFormat::Auto);
        let calls = self.tool_syntax.filter(|_| read_calls && !tools.is_empty());
        let markers = reasoning.map_or(&[][..], ReasoningSyntax::markers).iter().chain(calls.map_or(&[][..], ToolSyntax::markers));
        AnswerParsers {
            reasoning: reasoning.map(|syntax| syntax.splitter(prompt)),
            tool_calls: calls.map(|syntax| ToolCallCatcher::new(syntax, tools)),
            shown: markers.filter_map(|m| self.tokenizer.token_id(m)).filter(|&id| self.tokenizer.is_control(id)).collect(),
        }
    }

    /// Token ids of a rendered chat prompt: special tokens parsed, BOS added unless the
    /// template already wrote it.
    pub fn tokenize_chat(&self, text: &str) -> Vec<u32> {
        let bos_text = self.tokenizer.bos().and_then(|b| self.tokenizer.token_text(b));
        let has_bos = bos_text.is_some_and(|b| !b.is_empty() && text.starts_with(b));
        self.tokenizer.encode(text, !has_bos, true)
    }
}

pub struct AppState {
    pub ready: OnceLock<Ready>,
    pub scheduler: SchedulerHandle,
    pub metrics: Arc<Metrics>,
    pub api_key: Option<String>,
    pub max_body_bytes: usize,
    /// How long a request's body may take to arrive (408 past that).
    pub body_read_timeout: Duration,
    /// The most choices (`n`) one request may take: each enters the scheduler's waiting queue,
    /// so no more than it holds.
    pub max_choices: usize,
    next_id: AtomicU64,
}

impl AppState {
    pub fn new(scheduler: SchedulerHandle, metrics: Arc<Metrics>, api_key: Option<String>, max_body_bytes: usize) -> AppState {
        AppState {
            ready: OnceLock::new(),
            scheduler,
            metrics,
            api_key,
            max_body_bytes,
            body_read_timeout: Duration::from_secs(60),
            max_choices: MAX_CHOICES,
            next_id: AtomicU64::new(1),
        }
    }

    pub fn ready(&self) -> Result<&Ready, ApiError> {
        self.ready.get().ok_or_else(|| ApiError::unavailable("the model is still loading", 1))
    }

    /// Runs `work` on tokio's blocking pool: rendering and tokenizing a prompt take time that
    /// grows with the request (up to the body limit), which would otherwise hold an HTTP worker
    /// and every connection it serves.
    pub async fn off_the_workers<T: Send + 'static>(
        self: &Arc<Self>,
        work: impl FnOnce(&Ready) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let state = self.clone();
        let task = tokio::task::spawn_blocking(move || work(state.ready()?));
        task.await.map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("preparing the prompt failed: {e}")))?
    }

    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Relaxed)
    }

    /// The body, at most `max_body_bytes` of it (413 past that).
    pub async fn read_body(&self, headers: &HeaderMap, body: Body) -> Result<Object, ApiError> {
        let too_large = || ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("the request body is over the limit of {} bytes", self.max_body_bytes));
        let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > self.max_body_bytes as u64) {
            return Err(too_large());
        }
        let timeout = self.body_read_timeout;
        let late = || ApiError::new(StatusCode::REQUEST_TIMEOUT, format!("the request body did not arrive within {} s", timeout.as_secs_f32()));
        let bytes = tokio::time::timeout(timeout, axum::body::to_bytes(body, self.max_body_bytes)).await.map_err(|_| late())?.map_err(|e| {
            if std::error::Error::source(&e).is_some_and(|s| s.to_string().contains("length limit")) || e.to_string().contains("length limit") {
                too_large()
            } else {
                ApiError::bad_request(format!("reading the request body: {e}"))
            }
        })?;
        parse_object(&bytes)
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/v1/completions", post(crate::generate::completions))
        .route("/completions", post(crate::generate::completions))
        .route("/v1/chat/completions", post(crate::generate::chat_completions))
        .route("/chat/completions", post(crate::generate::chat_completions))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/apply-template", post(apply_template))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such endpoint") })
        .method_not_allowed_fallback(|| async { ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "this endpoint does not take that method") })
        .layer(middleware::from_fn_with_state(state.clone(), check_api_key))
        .layer(middleware::from_fn(isolate_panics))
        .with_state(state)
}

/// Equal-length inputs take the same time whatever their contents.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y));
    diff == 0 && a.len() == b.len()
}

async fn check_api_key(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let Some(key) = &state.api_key else { return next.run(request).await };
    if matches!(request.uri().path(), "/health" | "/v1/health") {
        return next.run(request).await;
    }
    let given = request.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(bearer_token);
    match given {
        Some(g) if constant_time_eq(g.trim().as_bytes(), key.as_bytes()) => next.run(request).await,
        Some(_) => ApiError::new(StatusCode::UNAUTHORIZED, "invalid API key").into_response(),
        None => ApiError::new(StatusCode::UNAUTHORIZED, "missing API key: send \"Authorization: Bearer KEY\"").into_response(),
    }
}

/// The token of an `Authorization: Bearer TOKEN` value; the scheme's name is case-insensitive
/// (RFC 9110), and clients send "bearer" too.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(token)
}

/// A handler that panics answers 500; the server and other requests go on.
async fn isolate_panics(request: Request, next: Next) -> Response {
    match AssertUnwindSafe(next.run(request)).catch_unwind().await {
        Ok(response) => response,
        Err(panic) => {
            let what = panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned()).unwrap_or_default();
            tracing::error!("a handler panicked: {what}");
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error").into_response()
        }
    }
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    match state.ready.get() {
        Some(_) => Json(json!({"status": "ok"})).into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "loading", "error": {"message": "the model is still loading", "code": 503}})))
            .into_response(),
    }
}

async fn models(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let r = state.ready()?;
    let model = json!({"id": r.model_name, "object": "model", "created": r.created, "owned_by": "kiln", "meta": {"n_ctx": r.n_ctx, "n_vocab": r.n_vocab}});
    Ok(Json(json!({"object": "list", "data": [model]})).into_response())
}

async fn tokenize(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let o = state.read_body(&headers, body).await?;
    state.ready()?;
    let content = opt_str(&o, "content")?.ok_or_else(|| ApiError::field("content", "is required"))?.to_string();
    let add_special = opt_bool(&o, "add_special")?.unwrap_or(false);
    let parse_special = opt_bool(&o, "parse_special")?.unwrap_or(true);
    let tokens = state.off_the_workers(move |r| Ok(r.tokenizer.encode(&content, add_special, parse_special))).await?;
    Ok(Json(json!({"tokens": tokens})).into_response())
}

async fn detokenize(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let o = state.read_body(&headers, body).await?;
    let r = state.ready()?;
    let bad = || ApiError::field("tokens", "must be a list of token ids");
    let tokens: Vec<u32> = match o.get("tokens") {
        Some(Value::Array(items)) => items.iter().map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or_else(bad)).collect::<Result<_, _>>()?,
        None => return Err(ApiError::field("tokens", "is required")),
        Some(_) => return Err(bad()),
    };
    r.check_tokens(&tokens, "tokens")?;
    Ok(Json(json!({"content": r.tokenizer.decode(&tokens)})).into_response())
}

async fn apply_template(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let o = state.read_body(&headers, body).await?;
    let r = state.ready()?;
    let add_generation_prompt = opt_bool(&o, "add_generation_prompt")?.unwrap_or(true);
    Ok(Json(json!({"prompt": r.render_chat(&o, add_generation_prompt)?})).into_response())
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render()).into_response()
}

#[cfg(test)]
mod tests {
    #[test]
    fn key_comparison() {
        assert!(super::constant_time_eq(b"secret", b"secret"));
        assert!(!super::constant_time_eq(b"secret", b"secreT"));
        assert!(!super::constant_time_eq(b"secret", b"secret2"));
        assert!(!super::constant_time_eq(b"", b"x"));
    }

    #[test]
    fn the_bearer_scheme_is_read_in_any_case() {
        for value in ["Bearer k1", "bearer k1", "BEARER k1", " Bearer k1"] {
            assert_eq!(super::bearer_token(value), Some("k1"), "{value}");
        }
        for value in ["Basic k1", "Bearerk1", "k1", ""] {
            assert_eq!(super::bearer_token(value), None, "{value}");
        }
    }
}
