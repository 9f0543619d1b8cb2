//! `mlx-spec serve`: an OpenAI-compatible HTTP server over the verify loop.
//!
//! The HTTP side (axum on a small tokio runtime) reads and checks requests, tokenizes them
//! and turns tokens back into text; the [`engine`] thread owns the model and runs every
//! request's rounds. Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both
//! streaming as server-sent events when asked), `GET /v1/models`, `GET /health`,
//! `GET /metrics` (Prometheus text) and `GET /` (a page to try it on).

pub mod api;
pub mod engine;
pub mod metrics;
pub mod text;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::generate::{GenerateRequest, StopReason};
use crate::sampler::{DrawPlace, SamplingParams};
use crate::tokenizer::Tokenizer;
use api::{ApiError, GenRequest, Input, SpeculationChoice};
use engine::{
    DrafterSpec, Engine, EngineConfig, Event, Finished, Job, ModelInfo, Speculation, Submitter,
    Ticket,
};
use metrics::Metrics;
use text::TextAssembler;

/// Sampling settings of requests that leave them out (the deploy file's `[sampling]`).
#[derive(Debug, Clone, Copy)]
pub struct Defaults {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub min_p: f32,
    pub max_tokens: usize,
    pub draw: DrawPlace,
}

/// The server's limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_active: usize,
    pub queue_length: usize,
    pub max_prompt_tokens: usize,
    pub max_new_tokens: usize,
    pub max_body_bytes: usize,
    pub request_timeout: Duration,
}

/// Everything `serve` needs, resolved from the deploy file and the flags.
pub struct ServeOptions {
    pub engine: EngineConfig,
    pub addr: SocketAddr,
    pub api_key: Option<String>,
    pub model_name: String,
    /// The drafter (by name) of requests that do not choose; `None`: off.
    pub default_drafter: Option<String>,
    pub defaults: Defaults,
    pub limits: Limits,
}

/// Seconds the client is told to wait when the queue is full.
const RETRY_AFTER_S: u64 = 1;

struct AppState {
    submitter: Submitter,
    tokenizer: Arc<Tokenizer>,
    info: ModelInfo,
    model_name: String,
    default_drafter: Option<usize>,
    api_key: Option<String>,
    defaults: Defaults,
    limits: Limits,
    admitted: Arc<AtomicUsize>,
    metrics: Arc<Metrics>,
    next_id: AtomicU64,
    draining: AtomicBool,
    started: u64,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Loads everything (plugins first, then the model), binds, serves until SIGTERM or Ctrl-C,
/// then finishes what is in flight and returns.
pub fn serve(options: ServeOptions) -> Result<()> {
    let metrics = Arc::new(Metrics::new());
    let names: Vec<String> = options
        .engine
        .drafters
        .iter()
        .map(|d: &DrafterSpec| d.name.clone())
        .collect();
    let default_drafter = match &options.default_drafter {
        None => None,
        Some(name) => Some(names.iter().position(|n| n == name).with_context(|| {
            format!("the default drafter {name:?} is not among the configured drafters")
        })?),
    };
    let max_active = options.engine.max_active;
    let (engine, info) = Engine::start(options.engine, metrics.clone())?;
    for d in &info.drafters {
        metrics.register_drafter(&d.name);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("mlx-spec-http")
        .build()
        .context("cannot start the HTTP runtime")?;
    let state = Arc::new(AppState {
        submitter: engine.submitter(),
        tokenizer: info.tokenizer.clone(),
        info,
        model_name: options.model_name,
        default_drafter,
        api_key: options.api_key,
        defaults: options.defaults,
        limits: Limits {
            max_active,
            ..options.limits
        },
        admitted: Arc::new(AtomicUsize::new(0)),
        metrics,
        next_id: AtomicU64::new(1),
        draining: AtomicBool::new(false),
        started: unix_now(),
    });
    let result = runtime.block_on(run_http(state.clone(), options.addr));
    drop(state);
    // Every connection has closed: the engine finishes what it still holds, then stops.
    engine.shutdown();
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}

async fn run_http(state: Arc<AppState>, addr: SocketAddr) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let local = listener.local_addr()?;
    // The one line a script (or test) waits for; on stderr as every log line.
    eprintln!("mlx-spec: listening on http://{local}");
    tracing::info!("serving {} on http://{local}", state.model_name);
    let app = router(state.clone());
    let draining = state.clone();
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown_signal().await;
            draining.draining.store(true, Ordering::SeqCst);
            eprintln!("mlx-spec: draining: finishing requests in flight, accepting no more");
        })
        .await
        .context("the HTTP server failed")?;
    eprintln!("mlx-spec: stopped");
    Ok(())
}

async fn shutdown_signal() {
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
            Err(e) => {
                tracing::warn!("cannot watch SIGTERM ({e}); Ctrl-C still stops the server");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_key,
        ));
    Router::new()
        .merge(v1)
        .route("/", get(page))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.limits.max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .with_state(state)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (status, Json(self.body())).into_response();
        if self.status == 503 {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_S));
        }
        if self.status == 401 {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

async fn count_requests(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".to_owned());
    let response = next.run(req).await;
    state.metrics.http(&route, response.status().as_u16());
    response
}

/// Compares two byte strings in time independent of where they differ.
fn same_key(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn require_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let ok = given.is_some_and(|g| same_key(g.as_bytes(), key.as_bytes()));
        if !ok {
            let message = if given.is_some() {
                "the API key is not valid"
            } else {
                "this server needs an API key: send the header 'Authorization: Bearer KEY'"
            };
            return ApiError::new(401, "invalid_request_error", message)
                .with_code("invalid_api_key")
                .into_response();
        }
    }
    next.run(req).await
}

async fn not_found(req: Request) -> ApiError {
    ApiError::new(
        404,
        "invalid_request_error",
        format!(
            "no route {} {}: this server has POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics and GET /",
            req.method(),
            req.uri().path()
        ),
    )
    .with_code("not_found")
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        405,
        "invalid_request_error",
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
    .with_code("method_not_allowed")
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    let (running, waiting) = state.metrics.queue();
    if state.draining.load(Ordering::SeqCst) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "draining", "running": running, "waiting": waiting})),
        )
            .into_response();
    }
    Json(json!({"status": "ok", "running": running, "waiting": waiting})).into_response()
}

async fn metrics_text(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        state.metrics.render(),
    )
        .into_response()
}

async fn page() -> Html<&'static str> {
    Html(include_str!("page.html"))
}

async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    let default = state
        .default_drafter
        .map(|i| state.info.drafters[i].name.clone());
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.model_name,
            "object": "model",
            "created": state.started,
            "owned_by": "mlx-spec",
            "speculation": {
                "drafters": state.info.drafters,
                "default": default,
            },
        }],
    }))
}

async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(state, body, false).await
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(state, body, true).await
}

/// One admitted request on its way through the engine.
struct Run {
    events: UnboundedReceiver<Event>,
    stop: Arc<AtomicBool>,
    text: TextAssembler,
    tokenizer: Arc<Tokenizer>,
    completion_tokens: usize,
    detail: bool,
}

/// What the next engine event means for the response.
enum Step {
    Delta {
        text: String,
        tokens: Vec<Value>,
    },
    End {
        text: String,
        reason: &'static str,
        finished: Box<Finished>,
    },
    Fail(ApiError),
}

impl Run {
    async fn next(&mut self) -> Step {
        match self.events.recv().await {
            Some(Event::Tokens(tokens)) => {
                let mut text = String::new();
                let mut detail = Vec::new();
                for (id, kind) in tokens {
                    if self.text.stopped() {
                        break;
                    }
                    let (piece, ready) = match self.text.push(&self.tokenizer, id) {
                        Ok(v) => v,
                        Err(e) => {
                            return Step::Fail(ApiError::new(500, "server_error", format!("{e:#}")))
                        }
                    };
                    self.completion_tokens += 1;
                    text.push_str(&ready);
                    if self.detail {
                        detail.push(json!({"id": id, "text": piece, "kind": kind}));
                    }
                    if self.text.stopped() {
                        // A stop string: the engine ends the request after this round.
                        self.stop.store(true, Ordering::SeqCst);
                    }
                }
                Step::Delta {
                    text,
                    tokens: detail,
                }
            }
            Some(Event::Done(finished)) => {
                let text = match self.text.finish(&self.tokenizer) {
                    Ok(t) => t,
                    Err(e) => {
                        return Step::Fail(ApiError::new(500, "server_error", format!("{e:#}")))
                    }
                };
                let reason = if self.text.stopped() || finished.stop_reason == StopReason::Stop {
                    "stop"
                } else {
                    "length"
                };
                Step::End {
                    text,
                    reason,
                    finished: Box::new(finished),
                }
            }
            Some(Event::Failed { timeout, message }) => Step::Fail(if timeout {
                ApiError::new(504, "timeout_error", message).with_code("timeout")
            } else {
                ApiError::new(500, "server_error", message)
            }),
            None => Step::Fail(ApiError::new(
                500,
                "server_error",
                "the engine stopped before the request finished",
            )),
        }
    }
}

/// Checks, tokenizes and admits a request; the response is JSON, or server-sent events.
async fn generate(
    state: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    chat: bool,
) -> Response {
    match admit(&state, body, chat) {
        Ok((req, run, received)) => {
            if req.stream {
                stream_response(state, run, chat, received).into_response()
            } else {
                whole_response(state, run, chat, received).await
            }
        }
        Err(e) => e.into_response(),
    }
}

fn admit(
    state: &Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    chat: bool,
) -> Result<(GenRequest, Run, Instant), ApiError> {
    let received = Instant::now();
    let body = body.map_err(|rejection| {
        let status = rejection.status().as_u16();
        if status == 413 {
            ApiError::new(
                413,
                "invalid_request_error",
                format!(
                    "the request body is larger than this server's limit of {} bytes",
                    state.limits.max_body_bytes
                ),
            )
            .with_code("request_too_large")
        } else {
            ApiError::new(status, "invalid_request_error", rejection.body_text())
        }
    })?;
    let req = api::parse(&body, chat, state.limits.max_new_tokens)?;
    if let Some(model) = &req.model {
        if model != &state.model_name {
            return Err(ApiError {
                status: 404,
                message: format!(
                    "the model {model:?} is not served here; this server serves {:?}",
                    state.model_name
                ),
                kind: "invalid_request_error",
                param: Some("model".into()),
                code: Some("model_not_found"),
            });
        }
    }
    let speculation = resolve_speculation(state, &req.speculation)?;
    let d = &state.defaults;
    let seed = req.seed.unwrap_or_else(|| {
        // No seed: a fresh one for each request.
        let n = state.next_id.load(Ordering::Relaxed);
        (SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|t| t.as_nanos() as u64)
            .unwrap_or(0))
            ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    });
    let sampling = SamplingParams {
        temperature: req.temperature.unwrap_or(d.temperature),
        top_k: req.top_k.unwrap_or(d.top_k),
        top_p: req.top_p.unwrap_or(d.top_p),
        min_p: req.min_p.unwrap_or(d.min_p),
        seed,
        draw: d.draw,
    };
    sampling
        .validate()
        .map_err(|e| ApiError::invalid("temperature", format!("{e:#}")))?;
    let max_tokens = req
        .max_tokens
        .unwrap_or(d.max_tokens.min(state.limits.max_new_tokens));
    let (param, prompt_ids) = match &req.input {
        Input::Text(text) => ("prompt", state.tokenizer.encode_prompt(text)),
        Input::Ids(ids) => ("prompt", Ok(ids.clone())),
        Input::Chat(messages) => ("messages", state.tokenizer.encode_chat(messages)),
    };
    let prompt_ids = prompt_ids.map_err(|e| ApiError::invalid(param, format!("{e:#}")))?;
    if prompt_ids.is_empty() {
        return Err(ApiError::invalid(param, format!("'{param}' is empty")));
    }
    if let Some(bad) = prompt_ids
        .iter()
        .find(|&&id| id as usize >= state.info.vocab_size)
    {
        return Err(ApiError::invalid(
            param,
            format!(
                "token id {bad} is outside the vocabulary (size {})",
                state.info.vocab_size
            ),
        ));
    }
    if prompt_ids.len() > state.limits.max_prompt_tokens {
        return Err(ApiError::invalid(
            param,
            format!(
                "the prompt has {} tokens; this server takes at most {}",
                prompt_ids.len(),
                state.limits.max_prompt_tokens
            ),
        )
        .with_code("context_length_exceeded"));
    }
    if let Some(bad) = req
        .stop_ids
        .iter()
        .find(|&&id| id as usize >= state.info.vocab_size)
    {
        return Err(ApiError::invalid(
            "stop",
            format!("stop token id {bad} is outside the vocabulary"),
        ));
    }
    if state.draining.load(Ordering::SeqCst) {
        return Err(ApiError::new(
            503,
            "server_error",
            "the server is shutting down and takes no new requests",
        )
        .with_code("shutting_down"));
    }
    let limit = state.limits.max_active + state.limits.queue_length;
    let ticket = Ticket::take(&state.admitted, limit).ok_or_else(|| {
        ApiError::new(
            503,
            "server_error",
            format!(
                "the server is full ({} requests generating or waiting); retry after {RETRY_AFTER_S} s",
                limit
            ),
        )
        .with_code("queue_full")
    })?;
    let mut stop_ids = req.stop_ids.clone();
    if !req.ignore_eos {
        stop_ids.extend_from_slice(&state.info.stop_ids);
    }
    let (events_tx, events_rx) = tokio::sync::mpsc::unbounded_channel();
    let stop = Arc::new(AtomicBool::new(false));
    let job = Job {
        request: GenerateRequest {
            prompt_ids,
            max_tokens,
            sampling,
            stop_ids,
            ignore_eos: false,
        },
        speculation,
        events: events_tx,
        received,
        deadline: received + state.limits.request_timeout,
        stop: stop.clone(),
        ticket,
    };
    state.next_id.fetch_add(1, Ordering::Relaxed);
    if !state.submitter.submit(job) {
        return Err(ApiError::new(503, "server_error", "the engine has stopped"));
    }
    let run = Run {
        events: events_rx,
        stop,
        text: TextAssembler::new(req.stop_strings.clone()),
        tokenizer: state.tokenizer.clone(),
        completion_tokens: 0,
        detail: req.speculation_detail,
    };
    Ok((req, run, received))
}

fn resolve_speculation(
    state: &AppState,
    choice: &Option<SpeculationChoice>,
) -> Result<Option<Speculation>, ApiError> {
    let drafters = &state.info.drafters;
    let names = || {
        let mut n: Vec<String> = drafters.iter().map(|d| d.name.clone()).collect();
        n.push("off".into());
        n.join(", ")
    };
    let (index, k) = match choice {
        None => match state.default_drafter {
            Some(i) => (i, None),
            None => return Ok(None),
        },
        Some(SpeculationChoice::Off) => return Ok(None),
        Some(SpeculationChoice::Drafter {
            name,
            num_draft_tokens,
        }) => {
            let index = match name {
                Some(name) => drafters
                    .iter()
                    .position(|d| &d.name == name)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "speculation.drafter",
                            format!("no drafter named {name:?} is loaded (loaded: {})", names()),
                        )
                    })?,
                None => state.default_drafter.ok_or_else(|| {
                    ApiError::invalid(
                        "speculation.drafter",
                        format!(
                            "this server has no default drafter: name one (loaded: {})",
                            names()
                        ),
                    )
                })?,
            };
            (index, *num_draft_tokens)
        }
    };
    Ok(Some(Speculation {
        drafter: index,
        num_draft_tokens: k.unwrap_or(drafters[index].num_draft_tokens),
    }))
}

fn response_id(state: &AppState, chat: bool) -> String {
    let n = state.next_id.load(Ordering::Relaxed);
    let prefix = if chat { "chatcmpl" } else { "cmpl" };
    format!("{prefix}-{:x}{n:06x}", state.started)
}

fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

async fn whole_response(
    state: Arc<AppState>,
    mut run: Run,
    chat: bool,
    received: Instant,
) -> Response {
    let id = response_id(&state, chat);
    let mut text = String::new();
    let mut tokens = Vec::new();
    // A client that closes its connection makes hyper drop this future, and with it `run`:
    // the engine sees the closed event channel and ends the request before its next round.
    loop {
        match run.next().await {
            Step::Delta { text: t, tokens: d } => {
                text.push_str(&t);
                tokens.extend(d);
            }
            Step::End {
                text: t,
                reason,
                finished,
            } => {
                text.push_str(&t);
                state.metrics.latency(received.elapsed().as_secs_f64());
                let choice = if chat {
                    json!({"index": 0, "message": {"role": "assistant", "content": text},
                           "logprobs": null, "finish_reason": reason})
                } else {
                    json!({"index": 0, "text": text, "logprobs": null, "finish_reason": reason})
                };
                let mut body = json!({
                    "id": id,
                    "object": if chat { "chat.completion" } else { "text_completion" },
                    "created": unix_now(),
                    "model": state.model_name,
                    "choices": [choice],
                    "usage": usage(finished.prompt_tokens, run.completion_tokens),
                    "speculation": finished.speculation,
                });
                if run.detail {
                    body["speculation_tokens"] = Value::Array(tokens);
                }
                return Json(body).into_response();
            }
            Step::Fail(e) => return e.into_response(),
        }
    }
}

fn stream_response(
    state: Arc<AppState>,
    mut run: Run,
    chat: bool,
    received: Instant,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let (tx, rx) = tokio::sync::mpsc::channel::<SseEvent>(64);
    let id = response_id(&state, chat);
    let metrics = state.metrics.clone();
    let created = unix_now();
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let model_name = state.model_name.clone();
    let chunk = move |text: Option<&str>, reason: Option<&str>, first: bool| -> Value {
        let choice = if chat {
            let mut delta = json!({});
            if first {
                delta["role"] = json!("assistant");
            }
            if let Some(t) = text {
                delta["content"] = json!(t);
            }
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": reason})
        } else {
            json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": reason})
        };
        json!({"id": id, "object": object, "created": created, "model": model_name, "choices": [choice]})
    };
    tokio::spawn(async move {
        let send = |v: Value| SseEvent::default().data(v.to_string());
        let mut first = true;
        loop {
            // A client that leaves drops the stream: stop waiting for the engine then, even
            // while the request still waits in the queue.
            let step = tokio::select! {
                step = run.next() => step,
                _ = tx.closed() => break,
            };
            let event = match step {
                Step::Delta { text, tokens } => {
                    if text.is_empty() && tokens.is_empty() && !first {
                        continue;
                    }
                    let mut c = chunk(Some(&text), None, first);
                    if run.detail {
                        c["speculation_tokens"] = Value::Array(tokens);
                    }
                    first = false;
                    send(c)
                }
                Step::End {
                    text,
                    reason,
                    finished,
                } => {
                    metrics.latency(received.elapsed().as_secs_f64());
                    if !text.is_empty() {
                        let _ = tx.send(send(chunk(Some(&text), None, first))).await;
                        first = false;
                    }
                    let mut last = chunk(None, Some(reason), first);
                    last["usage"] = usage(finished.prompt_tokens, run.completion_tokens);
                    last["speculation"] = json!(finished.speculation);
                    let _ = tx.send(send(last)).await;
                    let _ = tx.send(SseEvent::default().data("[DONE]")).await;
                    break;
                }
                Step::Fail(e) => {
                    let _ = tx.send(send(e.body())).await;
                    let _ = tx.send(SseEvent::default().data("[DONE]")).await;
                    break;
                }
            };
            if tx.send(event).await.is_err() {
                // The client left: dropping `run` tells the engine.
                break;
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|e| (Ok::<_, Infallible>(e), rx))
    });
    Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(1)))
}
