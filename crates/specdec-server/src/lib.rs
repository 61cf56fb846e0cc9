//! # specdec-server
//!
//! An OpenAI-compatible HTTP server for lossless speculative decoding (axum and tokio).
//!
//! - `POST /v1/chat/completions`, `POST /v1/completions`: non-streaming and streaming (server-sent
//!   events ending with `data: [DONE]`), with `usage` and a `speculative` object in every answer.
//! - `GET /v1/models`, `GET /health` (200 once the models are loaded), `GET /metrics` (Prometheus).
//! - `GET /`: a chat page, embedded, that streams answers and shows the drafted tokens accepted.
//!
//! [`engine`] owns the models on a thread of its own and decodes the active requests together
//! (continuous batching); [`api`] validates requests before they reach it; [`text`] turns tokens
//! into text and matches stop strings.

pub mod api;
pub mod engine;
pub mod error;
pub mod metrics;
pub mod text;

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request as HttpRequest, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use serde_json::{json, Value};
use subtle::ConstantTimeEq;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

pub use api::{Defaults, Kind};
pub use engine::{
    start, Codec, DrafterKind, EngineHandle, EngineOptions, Event, Learner, Loaded, MultiDrafter,
    Shared,
};
pub use error::ApiError;

/// The chat page, served at `/`.
pub const PAGE: &str = include_str!("page.html");

/// HTTP settings.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Require `Authorization: Bearer <key>` on `/v1/*` and `/metrics`.
    pub api_key: Option<String>,
    /// Allow cross-origin requests from any origin.
    pub cors: bool,
    /// The largest request body, in bytes (413 beyond).
    pub max_body_bytes: usize,
    /// What requests leave out.
    pub defaults: Defaults,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            api_key: None,
            cors: false,
            max_body_bytes: 1 << 20,
            defaults: Defaults::default(),
        }
    }
}

#[derive(Clone, Debug)]
struct AppState {
    engine: EngineHandle,
    options: Arc<ServerOptions>,
}

/// The application: routes, body limit, API key, CORS, request counting.
pub fn router(engine: EngineHandle, options: ServerOptions) -> Router {
    let cors = options.cors;
    let limit = options.max_body_bytes;
    let state = AppState {
        engine,
        options: Arc::new(options),
    };
    let app = Router::new()
        .route("/", get(page))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_and_auth,
        ))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state);
    if cors {
        app.layer(tower_http::cors::CorsLayer::permissive())
    } else {
        app
    }
}

/// Serves `app` on `listener` until SIGINT or SIGTERM; then stops accepting, lets in-flight
/// requests finish for up to `grace`, cancels what is left, and returns.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    shared: Arc<Shared>,
    grace: Duration,
) -> std::io::Result<()> {
    let (signalled_tx, signalled_rx) = tokio::sync::oneshot::channel::<()>();
    let shared_load = shared.clone();
    let on_signal = {
        let shared = shared.clone();
        async move {
            shutdown_signal().await;
            tracing::info!(
                "shutting down: no new requests; in-flight ones get {}s",
                grace.as_secs_f64()
            );
            shared.closing.store(true, Ordering::SeqCst);
            let _ = signalled_tx.send(());
        }
    };
    let server = axum::serve(listener, app).with_graceful_shutdown(on_signal);
    let deadline = async move {
        if signalled_rx.await.is_err() {
            return std::future::pending().await;
        }
        tokio::time::sleep(grace).await;
        tracing::warn!("the grace period ended: cancelling the requests still running");
        shared.cancel_all.store(true, Ordering::SeqCst);
        // Streams end once the engine cancels them; give them a moment, then stop regardless.
        tokio::time::sleep(Duration::from_secs(3)).await;
    };
    let failed = async {
        loop {
            if let Some(e) = shared_load.load_error.get() {
                return std::io::Error::other(format!("the models failed to load: {e}"));
            }
            if let Some(e) = shared_load.engine_error.get() {
                return std::io::Error::other(format!("the engine stopped: {e}"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    tokio::select! {
        r = std::future::IntoFuture::into_future(server) => r,
        () = deadline => Ok(()),
        e = failed => Err(e),
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

/// Counts API responses by status, and checks the API key where one is set.
async fn count_and_auth(State(s): State<AppState>, req: HttpRequest, next: Next) -> Response {
    let path = req.uri().path();
    let api = path.starts_with("/v1/");
    let guarded = api || path == "/metrics";
    let response = match &s.options.api_key {
        Some(key) if guarded && !authorized(&req, key) => ApiError::unauthorized().into_response(),
        _ => next.run(req).await,
    };
    if api {
        if let Ok(mut m) = s.engine.shared.metrics.lock() {
            *m.requests.entry(response.status().as_u16()).or_default() += 1;
        }
    }
    response
}

fn authorized(req: &HttpRequest, key: &str) -> bool {
    let Some(given) = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    else {
        return false;
    };
    // Constant time for equal lengths; a length mismatch reveals only the length.
    given.as_bytes().ct_eq(key.as_bytes()).into()
}

async fn page() -> Html<&'static str> {
    Html(PAGE)
}

async fn not_found() -> ApiError {
    ApiError::not_found("no such route")
}

async fn method_not_allowed() -> ApiError {
    ApiError::method_not_allowed()
}

async fn health(State(s): State<AppState>) -> Response {
    if s.engine.shared.closing.load(Ordering::SeqCst) {
        return ApiError::unavailable("the server is shutting down").into_response();
    }
    match s.engine.info() {
        Ok(info) => Json(json!({"status": "ok", "model": info.model})).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn metrics(State(s): State<AppState>) -> Response {
    let shared = &s.engine.shared;
    let text = match shared.metrics.lock() {
        Ok(m) => m.render(
            shared.queued.load(Ordering::SeqCst),
            shared.active.load(Ordering::SeqCst),
        ),
        Err(_) => return ApiError::internal("the metrics are unavailable").into_response(),
    };
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        text,
    )
        .into_response()
}

async fn models(State(s): State<AppState>) -> Response {
    match s.engine.info() {
        Ok(info) => Json(json!({
            "object": "list",
            "data": [{
                "id": info.model,
                "object": "model",
                "created": info.created,
                "owned_by": "specdec",
                "context_length": info.ctx,
                "drafters": info.drafters.iter().map(|k| k.name()).collect::<Vec<_>>(),
            }],
        }))
        .into_response(),
        Err(e) => e.into_response(),
    }
}

async fn chat(State(s): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    complete(s, Kind::Chat, body).await
}

async fn completions(State(s): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    complete(s, Kind::Completion, body).await
}

async fn complete(s: AppState, kind: Kind, body: Result<Bytes, BytesRejection>) -> Response {
    let body = match body {
        Ok(b) => b,
        Err(r) if r.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return ApiError::too_large(s.options.max_body_bytes).into_response()
        }
        Err(r) => return ApiError::bad_request(r.body_text()).into_response(),
    };
    let info = match s.engine.info() {
        Ok(i) => i,
        Err(e) => return e.into_response(),
    };
    // Templating and tokenising a large body takes a while: off the async workers.
    let parsed = {
        let (engine, options) = (s.engine.clone(), s.options.clone());
        tokio::task::spawn_blocking(move || {
            let info = engine.info()?;
            api::parse(kind, &body, info, &options.defaults)
        })
        .await
    };
    let req = match parsed {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return e.into_response(),
        Err(e) => {
            return ApiError::internal(format!("parsing the request failed: {e}")).into_response()
        }
    };
    let (tx, mut rx) = unbounded_channel();
    if let Err(e) = s.engine.submit(req.job(tx)) {
        return e.into_response();
    }
    if req.stream {
        return Sse::new(sse_stream(info, req, rx))
            .keep_alive(KeepAlive::default())
            .into_response();
    }
    let (text, tokens, result) = engine::collect(&mut rx).await;
    match result {
        Ok(summary) => Json(api::response(&req, info, &text, &tokens, &summary)).into_response(),
        Err(e) => ApiError::internal(format!("generation failed: {e}"))
            .with_partial_text(text)
            .into_response(),
    }
}

/// State of a response stream.
struct Streaming {
    model: String,
    codec: Arc<dyn Codec>,
    req: api::Request,
    rx: UnboundedReceiver<Event>,
    id: String,
    created: u64,
    /// Events ready to go out.
    out: std::collections::VecDeque<SseEvent>,
    started: bool,
    ended: bool,
    /// Bytes of text sent (for completion logprobs' offsets).
    sent: usize,
}

fn sse_stream(
    info: &engine::Info,
    req: api::Request,
    rx: UnboundedReceiver<Event>,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let st = Streaming {
        model: info.model.clone(),
        codec: info.codec.clone(),
        id: api::response_id(req.kind),
        created: api::now(),
        req,
        rx,
        out: Default::default(),
        started: false,
        ended: false,
        sent: 0,
    };
    stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.out.pop_front() {
                return Some((Ok(e), st));
            }
            if st.ended {
                return None;
            }
            st.advance().await;
        }
    })
}

impl Streaming {
    fn chunk(&self, choice: Value, extra: Option<(&str, Value)>) -> SseEvent {
        let object = match self.req.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        let mut v = json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": if choice.is_null() { json!([]) } else { json!([choice]) },
        });
        if let (Some((k, x)), Some(o)) = (extra, v.as_object_mut()) {
            o.insert(k.to_string(), x);
        }
        SseEvent::default().data(v.to_string())
    }

    /// Waits for the engine's next event and turns it into stream events.
    async fn advance(&mut self) {
        if !self.started && self.req.kind == Kind::Chat {
            self.started = true;
            let c = json!({"index": 0, "delta": {"role": "assistant", "content": ""},
                           "logprobs": null, "finish_reason": null});
            let e = self.chunk(c, None);
            self.out.push_back(e);
            return;
        }
        self.started = true;
        let Some(event) = self.rx.recv().await else {
            self.fail("the engine stopped");
            return;
        };
        let codec = self.codec.clone();
        match event {
            Event::Chunk { text, tokens, live } => {
                let lp = self.req.logprobs.map(|_| match self.req.kind {
                    Kind::Chat => api::chat_logprobs(&tokens, &*codec),
                    Kind::Completion => api::completion_logprobs(&tokens, &*codec, self.sent),
                });
                let drafted = tokens.iter().filter(|t| t.drafted).count();
                let choice = match self.req.kind {
                    Kind::Chat => json!({"index": 0, "delta": {"content": text},
                                         "logprobs": lp, "finish_reason": null}),
                    Kind::Completion => json!({"index": 0, "text": text,
                                               "logprobs": lp, "finish_reason": null}),
                };
                self.sent += text.len();
                let x = json!({
                    "tokens": tokens.len(),
                    "drafted": drafted,
                    "rounds": live.rounds,
                    "drafted_total": live.drafted,
                    "accepted_total": live.accepted,
                });
                let e = self.chunk(choice, Some(("x_specdec", x)));
                self.out.push_back(e);
            }
            Event::Done(s) => {
                let choice = match self.req.kind {
                    Kind::Chat => json!({"index": 0, "delta": {}, "logprobs": null,
                                         "finish_reason": s.finish.as_str()}),
                    Kind::Completion => json!({"index": 0, "text": "", "logprobs": null,
                                               "finish_reason": s.finish.as_str()}),
                };
                let e = self.chunk(choice, Some(("speculative", api::speculative(&s))));
                self.out.push_back(e);
                if self.req.include_usage {
                    let e = self.chunk(Value::Null, Some(("usage", api::usage(&s))));
                    self.out.push_back(e);
                }
                self.done();
            }
            Event::Failed(msg) => self.fail(&format!("generation failed: {msg}")),
        }
    }

    fn fail(&mut self, msg: &str) {
        let e = ApiError::internal(msg);
        self.out
            .push_back(SseEvent::default().data(e.body().to_string()));
        self.done();
    }

    fn done(&mut self) {
        self.out.push_back(SseEvent::default().data("[DONE]"));
        self.ended = true;
    }
}
