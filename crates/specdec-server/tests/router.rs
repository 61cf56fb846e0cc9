//! The HTTP API without a socket (`oneshot`), on mock models and a byte-level codec: response
//! schemas, SSE framing, validation errors, stop strings across tokens, the API key, the body limit,
//! the bounded queue, disconnects, random bodies, and concurrent requests getting their solo answers.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use specdec_core::mock::{MockLogits, MockModel};
use specdec_core::{Logits, ModelDrafter, Score, SeqId, Target, TokenId};
use specdec_server::{
    router, start, Codec, Defaults, DrafterKind, EngineHandle, EngineOptions, Learner, Loaded,
    MultiDrafter, ServerOptions,
};
use tower::ServiceExt;

/// 256 byte tokens, then an end-of-turn token.
const VOCAB: usize = 260;
const EOT: TokenId = 256;

/// Bytes are tokens; text decodes as UTF-8 (lossy).
struct ByteCodec;

impl Codec for ByteCodec {
    fn encode(&self, text: &str) -> Result<Vec<TokenId>, String> {
        Ok(text.bytes().map(TokenId::from).collect())
    }

    fn encode_chat(&self, messages: &[(String, String)]) -> Result<Vec<TokenId>, String> {
        let mut s = String::new();
        for (r, c) in messages {
            s.push_str(&format!("{r}: {c}\n"));
        }
        s.push_str("assistant: ");
        self.encode(&s)
    }

    fn decode(&self, ids: &[TokenId]) -> String {
        let bytes: Vec<u8> = ids.iter().filter(|&&t| t < 256).map(|&t| t as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn token_bytes(&self, id: TokenId) -> Vec<u8> {
        u8::try_from(id).map(|b| vec![b]).unwrap_or_default()
    }

    fn stop_tokens(&self) -> Vec<TokenId> {
        vec![EOT]
    }
}

/// Logits that favour printable ASCII, so the text is readable and splits into characters.
fn target_logits() -> MockLogits {
    MockLogits::Hashed {
        vocab: VOCAB,
        seed: 3,
        scale: 6.0,
    }
}

/// A target that calls a hook before every call of the mock's `score`: sleeping in it keeps
/// requests active long enough to fill the slots; panicking in it is an engine bug.
struct Hooked(MockModel, Box<dyn FnMut() + Send>);

impl Target for Hooked {
    type Error = <MockModel as Target>::Error;
    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }
    fn capacity(&self) -> usize {
        self.0.capacity()
    }
    fn score(&mut self, b: &[Score<'_>], out: &mut [Logits]) -> Result<(), Self::Error> {
        (self.1)();
        self.0.score(b, out)
    }
    fn commit(&mut self, seq: SeqId, c: &[TokenId]) -> Result<(), Self::Error> {
        self.0.commit(seq, c)
    }
    fn release(&mut self, seq: SeqId) {
        self.0.release(seq)
    }
}

fn engine(parallel: usize, queue: usize, delay: Duration) -> EngineHandle {
    engine_capped(parallel, queue, delay, None)
}

fn engine_capped(
    parallel: usize,
    queue: usize,
    delay: Duration,
    cap: Option<usize>,
) -> EngineHandle {
    engine_learning(parallel, queue, delay, cap, None)
}

fn engine_learning(
    parallel: usize,
    queue: usize,
    delay: Duration,
    cap: Option<usize>,
    learner: Option<Box<dyn Learner>>,
) -> EngineHandle {
    let options = EngineOptions {
        parallel,
        queue,
        batch_draft_len: cap,
        prefill_chunk: Some(16),
    };
    let h = start(&options, move || {
        let draft = MockModel::new(MockLogits::Perturbed {
            base: Box::new(target_logits()),
            seed: 8,
            noise: 1.5,
        });
        Ok(Loaded {
            target: Hooked(
                MockModel::new(target_logits()).with_capacity(512),
                Box::new(move || std::thread::sleep(delay)),
            ),
            drafter: MultiDrafter::new(Some(ModelDrafter::new(draft))),
            codec: Arc::new(ByteCodec),
            model: "mock".into(),
            learner,
        })
    });
    wait(|| h.shared.info.get().is_some());
    h
}

/// One slot and a queue of one, no batch cap, no prefill chunks.
fn one_slot() -> EngineOptions {
    EngineOptions {
        parallel: 1,
        queue: 1,
        batch_draft_len: None,
        prefill_chunk: None,
    }
}

fn wait(mut ok: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < Duration::from_secs(20), "timed out waiting");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn app_with(
    options: ServerOptions,
    parallel: usize,
    queue: usize,
    delay: Duration,
) -> (Router, EngineHandle) {
    let h = engine(parallel, queue, delay);
    (router(h.clone(), options), h)
}

fn app() -> Router {
    let options = ServerOptions {
        defaults: Defaults {
            drafter: DrafterKind::Model,
            ..Defaults::default()
        },
        ..ServerOptions::default()
    };
    app_with(options, 4, 16, Duration::ZERO).0
}

async fn call(
    app: &Router,
    method: &str,
    uri: &str,
    body: impl Into<Body>,
) -> (StatusCode, Vec<u8>) {
    let req = Request::builder()
        .method(method)
        .uri(uri)
        .body(body.into())
        .unwrap();
    let r = app.clone().oneshot(req).await.unwrap();
    let status = r.status();
    let bytes = r.into_body().collect().await.unwrap().to_bytes().to_vec();
    (status, bytes)
}

async fn post(app: &Router, uri: &str, body: Value) -> (StatusCode, Value) {
    let (s, b) = call(app, "POST", uri, body.to_string()).await;
    (s, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

/// A small request still gets a 200.
async fn still_serves(app: &Router) {
    let (s, v) = post(
        app,
        "/v1/chat/completions",
        chat_body(json!({"max_tokens": 3})),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
}

/// A streaming completion request for `prompt`.
fn stream_request(prompt: &str, max_tokens: u32) -> Request<Body> {
    Request::builder()
        .method("POST")
        .uri("/v1/completions")
        .body(Body::from(
            json!({"prompt": prompt, "max_tokens": max_tokens, "stream": true}).to_string(),
        ))
        .unwrap()
}

/// The `data:` payloads of an SSE body, checking the framing.
fn sse_events(body: &[u8]) -> Vec<String> {
    let text = std::str::from_utf8(body).unwrap();
    let mut out = Vec::new();
    for block in text.split("\n\n").filter(|b| !b.is_empty()) {
        let data: Vec<&str> = block
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .collect();
        assert_eq!(data.len(), 1, "one data line per event: {block:?}");
        out.push(data[0].to_string());
    }
    assert_eq!(out.last().map(String::as_str), Some("[DONE]"));
    out
}

fn chat_body(extra: Value) -> Value {
    let mut b = json!({
        "model": "mock",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 24,
    });
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

#[tokio::test]
async fn health_models_and_page() {
    let app = app();
    let (s, b) = call(&app, "GET", "/health", Body::empty()).await;
    assert_eq!(s, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
    let (s, b) = call(&app, "GET", "/v1/models", Body::empty()).await;
    assert_eq!(s, StatusCode::OK);
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "mock");
    let (s, b) = call(&app, "GET", "/", Body::empty()).await;
    assert_eq!(s, StatusCode::OK);
    assert!(String::from_utf8_lossy(&b).contains("<title>specdec chat</title>"));
    let (s, b) = call(&app, "GET", "/nope", Body::empty()).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert!(v["error"]["message"].is_string());
}

/// What a loader without a draft model returns: `target`, the byte codec.
fn without_draft<T: Target>(target: T) -> Result<Loaded<MockModel, T>, String> {
    Ok(Loaded {
        target,
        drafter: MultiDrafter::new(None),
        codec: Arc::new(ByteCodec),
        model: "mock".into(),
        learner: None,
    })
}

#[tokio::test]
async fn health_is_503_until_the_models_are_loaded() {
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let h = start(&one_slot(), move || {
        let _ = go_rx.recv();
        without_draft(MockModel::new(target_logits()))
    });
    let app = router(h.clone(), ServerOptions::default());
    let (s, _) = call(&app, "GET", "/health", Body::empty()).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    let (s, v) = post(&app, "/v1/chat/completions", chat_body(json!({}))).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    go_tx.send(()).unwrap();
    wait(|| h.shared.info.get().is_some());
    let (s, _) = call(&app, "GET", "/health", Body::empty()).await;
    assert_eq!(s, StatusCode::OK);
    // Without a draft model, the model drafters are refused.
    let (s, v) = post(
        &app,
        "/v1/chat/completions",
        chat_body(json!({"drafter": "model"})),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["param"], "drafter");
}

/// A loader that panics fails the load like one that returns an error: the server reports it
/// instead of waiting for models that never come.
#[tokio::test]
async fn a_loader_that_panics_fails_the_load() {
    let h = start(
        &one_slot(),
        || -> Result<Loaded<MockModel, MockModel>, String> { panic!("a malformed file") },
    );
    wait(|| h.shared.load_error.get().is_some());
    let error = h.shared.load_error.get().unwrap();
    assert!(error.contains("a malformed file"), "{error}");
}

/// A null `max_completion_tokens` is unset, as every null field is: `max_tokens` still limits.
#[tokio::test]
async fn a_null_max_completion_tokens_leaves_max_tokens_in_force() {
    let app = app();
    let (s, v) = post(
        &app,
        "/v1/completions",
        json!({"prompt": "abc", "max_tokens": 2, "max_completion_tokens": null, "drafter": "none"}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(
        v["usage"]["completion_tokens"].as_u64().unwrap() <= 2,
        "{v}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
}

/// An engine that panics after loading ends its requests with an error and takes the server out
/// of service: `/health` and new requests get 503 naming the panic, and `serve` would return.
#[tokio::test]
async fn an_engine_that_panics_is_reported_not_left_healthy() {
    let h = start(&one_slot(), || {
        // Three calls, then a panic in every call: a bug of the engine's.
        let mut calls = 0;
        without_draft(Hooked(
            MockModel::new(target_logits()),
            Box::new(move || {
                calls += 1;
                assert!(calls <= 3, "an engine bug");
            }),
        ))
    });
    wait(|| h.shared.info.get().is_some());
    let app = router(h.clone(), ServerOptions::default());
    let (s, _) = call(&app, "GET", "/health", Body::empty()).await;
    assert_eq!(s, StatusCode::OK);
    let (s, v) = post(
        &app,
        "/v1/completions",
        json!({"prompt": "abc", "max_tokens": 50, "drafter": "none"}),
    )
    .await;
    assert!(s.is_server_error(), "{s} {v}");
    wait(|| h.shared.engine_error.get().is_some());
    let (s, b) = call(&app, "GET", "/health", Body::empty()).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("an engine bug"),
        "{v}"
    );
    let (s, _) = post(&app, "/v1/completions", json!({"prompt": "abc"})).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
}

/// Once shutdown begins, `/health` says so (503), so that a balancer stops sending requests.
#[tokio::test]
async fn health_is_503_once_shutdown_begins() {
    let h = engine(1, 1, Duration::ZERO);
    let app = router(h.clone(), ServerOptions::default());
    let (s, _) = call(&app, "GET", "/health", Body::empty()).await;
    assert_eq!(s, StatusCode::OK);
    h.shared.closing.store(true, Ordering::SeqCst);
    let (s, b) = call(&app, "GET", "/health", Body::empty()).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("shutting down"));
}

/// A non-streaming request whose generation fails part way keeps the text generated before the
/// failure, in `error.partial_text`, as a streaming one keeps the chunks it was sent.
#[tokio::test]
async fn a_failed_generation_returns_the_text_made_before_it() {
    let h = start(&one_slot(), || {
        // The prefill and 5 decoding steps, then a failure.
        without_draft(MockModel::new(target_logits()).fail_at_call(7))
    });
    wait(|| h.shared.info.get().is_some());
    let app = router(h.clone(), ServerOptions::default());
    let (s, v) = post(
        &app,
        "/v1/completions",
        json!({"prompt": "abc", "max_tokens": 50, "drafter": "none"}),
    )
    .await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR, "{v}");
    let partial = v["error"]["partial_text"].as_str().unwrap_or_default();
    assert!(!partial.is_empty(), "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("injected failure"));
}

#[tokio::test]
async fn chat_and_completion_responses_have_openai_shapes() {
    let app = app();
    let (s, v) = post(&app, "/v1/chat/completions", chat_body(json!({}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert!(v["created"].is_u64());
    let c = &v["choices"][0];
    assert_eq!(c["index"], 0);
    assert_eq!(c["message"]["role"], "assistant");
    assert!(c["message"]["content"].is_string());
    let finish = c["finish_reason"].as_str().unwrap();
    assert!(finish == "stop" || finish == "length");
    let u = &v["usage"];
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
    );
    assert!(u["completion_tokens"].as_u64().unwrap() <= 24);
    if finish == "length" {
        assert_eq!(u["completion_tokens"], 24);
    }
    let sp = &v["speculative"];
    for k in [
        "rounds",
        "drafted",
        "accepted",
        "acceptance_rate",
        "mean_accepted_len",
        "non_finite_rounds",
        "drafter",
        "draft_len",
    ] {
        assert!(!sp[k].is_null(), "speculative.{k}");
    }
    assert_eq!(sp["drafter"], "model");
    assert_eq!(sp["non_finite_rounds"], 0);
    assert!(sp["drafted"].as_u64().unwrap() > 0);

    let (s, v) = post(
        &app,
        "/v1/completions",
        json!({"prompt": "abc", "max_tokens": 5, "logprobs": 2, "temperature": 0}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert!(v["choices"][0]["text"].is_string());
    let lp = &v["choices"][0]["logprobs"];
    let n = lp["tokens"].as_array().unwrap().len();
    assert_eq!(n as u64, v["usage"]["completion_tokens"].as_u64().unwrap());
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), n);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
}

#[tokio::test]
async fn streaming_frames_match_the_non_streaming_answer() {
    let app = app();
    let (_, whole) = post(&app, "/v1/chat/completions", chat_body(json!({"seed": 1}))).await;
    let body =
        chat_body(json!({"stream": true, "stream_options": {"include_usage": true}, "seed": 1}));
    let (s, raw) = call(&app, "POST", "/v1/chat/completions", body.to_string()).await;
    assert_eq!(s, StatusCode::OK);
    let events = sse_events(&raw);
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut text = String::new();
    let mut finish = None;
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        if let Some(choice) = c["choices"].as_array().and_then(|a| a.first()) {
            if let Some(t) = choice["delta"]["content"].as_str() {
                text.push_str(t);
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                assert!(finish.is_none(), "one finish_reason");
                finish = Some(f.to_string());
            }
        }
    }
    let usage = chunks.last().unwrap();
    assert_eq!(
        usage["choices"].as_array().unwrap().len(),
        0,
        "the usage chunk has no choices"
    );
    assert_eq!(usage["usage"], whole["usage"]);
    assert_eq!(
        text,
        whole["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert_eq!(
        finish.as_deref(),
        whole["choices"][0]["finish_reason"].as_str()
    );
}

#[tokio::test]
async fn stop_strings_end_the_text_before_them_also_across_tokens_and_when_streaming() {
    let app = app();
    let base = json!({"max_tokens": 40, "seed": 5});
    let (_, full) = post(&app, "/v1/chat/completions", chat_body(base.clone())).await;
    let text = full["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    // A two-character stop string from the middle spans two tokens (one byte per token).
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 10, "{text:?}");
    let stop: String = chars[6..8].iter().collect();
    let cut = &text[..text.find(&stop).unwrap()];
    let mut b = base.clone();
    b["stop"] = json!([stop, "\u{1}never"]);
    let (s, v) = post(&app, "/v1/chat/completions", chat_body(b.clone())).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["choices"][0]["message"]["content"], cut);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    b["stream"] = json!(true);
    let (_, raw) = call(
        &app,
        "POST",
        "/v1/chat/completions",
        chat_body(b).to_string(),
    )
    .await;
    let mut streamed = String::new();
    for e in sse_events(&raw) {
        if e == "[DONE]" {
            break;
        }
        let c: Value = serde_json::from_str(&e).unwrap();
        if let Some(t) = c["choices"][0]["delta"]["content"].as_str() {
            streamed.push_str(t);
        }
    }
    assert_eq!(streamed, cut);
}

/// The server's `--seed` and `--stop` are the defaults of requests that leave them out, a request's
/// own values win, and defaults that every request would fail on are refused before serving.
#[tokio::test]
async fn the_servers_seed_and_stop_apply_where_a_request_leaves_them_out() {
    let sampled = |seed: Option<u64>, stop: Vec<String>| {
        let options = ServerOptions {
            defaults: Defaults {
                drafter: DrafterKind::Model,
                sampling: specdec_core::SamplingParams {
                    temperature: 1.0,
                    ..specdec_core::SamplingParams::default()
                },
                seed,
                stop,
                ..Defaults::default()
            },
            ..ServerOptions::default()
        };
        options.defaults.validate().unwrap();
        app_with(options, 2, 4, Duration::ZERO).0
    };
    let content = |v: &Value| {
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let body = chat_body(json!({"max_tokens": 40}));
    let app = sampled(Some(11), Vec::new());
    let (_, a) = post(&app, "/v1/chat/completions", body.clone()).await;
    let (_, b) = post(&app, "/v1/chat/completions", body.clone()).await;
    let text = content(&a);
    assert_eq!(text, content(&b), "the same default seed, the same sample");
    let mut with_seed = body.clone();
    with_seed["seed"] = json!(11);
    let (_, c) = post(&app, "/v1/chat/completions", with_seed.clone()).await;
    assert_eq!(text, content(&c), "the default seed is the request's seed");
    with_seed["seed"] = json!(12);
    let (_, c) = post(&app, "/v1/chat/completions", with_seed).await;
    assert_ne!(text, content(&c), "another seed, another sample");
    // A default stop string from the middle of that text ends it there.
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 10, "{text:?}");
    let stop: String = chars[6..8].iter().collect();
    let cut = text[..text.find(&stop).unwrap()].to_string();
    let app = sampled(Some(11), vec![stop.clone()]);
    let (_, d) = post(&app, "/v1/chat/completions", body.clone()).await;
    assert_eq!(content(&d), cut);
    assert_eq!(d["choices"][0]["finish_reason"], "stop");
    // The request's own stop list replaces the default one.
    let mut own_stop = body.clone();
    own_stop["stop"] = json!(["\u{1}never"]);
    let (_, e) = post(&app, "/v1/chat/completions", own_stop).await;
    assert_eq!(content(&e), text);

    for bad in [
        Defaults {
            min_confidence: 2.0,
            ..Defaults::default()
        },
        Defaults {
            stop: vec![String::new()],
            ..Defaults::default()
        },
        Defaults {
            stop: vec!["x".into(); 17],
            ..Defaults::default()
        },
    ] {
        let e = bad.validate().unwrap_err();
        assert!(
            matches!(
                e,
                specdec_core::Error::InvalidConfig {
                    field: "min_confidence" | "stop",
                    ..
                }
            ),
            "{e}"
        );
    }
}

#[tokio::test]
async fn bad_requests_get_openai_errors_naming_the_field() {
    let app = app();
    let cases: Vec<(Value, &str)> = vec![
        (json!({"messages": []}), "messages"),
        (json!({"messages": "hi"}), "messages"),
        (json!({"max_tokens": 5}), "messages"),
        (
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            "messages[0].role",
        ),
        (
            json!({"messages": [{"role": "user"}]}),
            "messages[0].content",
        ),
        (
            json!({"messages": [{"role": "user", "content": ""}]}),
            "messages[0].content",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            "messages[0].content",
        ),
        (chat_body(json!({"max_tokens": -1})), "max_tokens"),
        (chat_body(json!({"max_tokens": 0})), "max_tokens"),
        (chat_body(json!({"max_tokens": 100000000})), "max_tokens"),
        (
            chat_body(json!({"max_completion_tokens": 1e12})),
            "max_completion_tokens",
        ),
        (chat_body(json!({"max_tokens": "ten"})), "max_tokens"),
        (chat_body(json!({"temperature": 3})), "temperature"),
        (chat_body(json!({"temperature": -0.5})), "temperature"),
        (chat_body(json!({"temperature": 1e-40})), "temperature"),
        (
            chat_body(json!({"repetition_penalty": 1e-40})),
            "repetition_penalty",
        ),
        (chat_body(json!({"top_p": 0})), "top_p"),
        (chat_body(json!({"top_p": 1.5})), "top_p"),
        (chat_body(json!({"min_p": 2})), "min_p"),
        (chat_body(json!({"top_k": -3})), "top_k"),
        (
            chat_body(json!({"presence_penalty": 9})),
            "presence_penalty",
        ),
        (chat_body(json!({"n": 2})), "n"),
        (chat_body(json!({"stop": 5})), "stop"),
        (chat_body(json!({"stop": [""]})), "stop"),
        (
            chat_body(
                json!({"stop": ["a","b","c","d","e","f","g","h","i","j","k","l","m","n","o","p","q"]}),
            ),
            "stop",
        ),
        (chat_body(json!({"top_logprobs": 3})), "top_logprobs"),
        (
            chat_body(json!({"logprobs": true, "top_logprobs": 50})),
            "top_logprobs",
        ),
        (chat_body(json!({"drafter": "oracle"})), "drafter"),
        (chat_body(json!({"draft_len": 0})), "draft_len"),
        (chat_body(json!({"draft_len": "lots"})), "draft_len"),
        (chat_body(json!({"verify_mode": "trust"})), "verify_mode"),
        (chat_body(json!({"seed": "x"})), "seed"),
        (chat_body(json!({"stream": "yes"})), "stream"),
        (chat_body(json!({"stream_options": 1})), "stream_options"),
        (chat_body(json!({"model": 7})), "model"),
    ];
    for (body, param) in cases {
        let (s, v) = post(&app, "/v1/chat/completions", body.clone()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body} -> {v}");
        let e = &v["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert_eq!(e["type"], "invalid_request_error", "{v}");
        assert_eq!(e["param"], param, "{body} -> {v}");
        assert!(e.as_object().unwrap().contains_key("code"));
    }
    // A prompt that fills the context (512 tokens here).
    let long = "x".repeat(600);
    let (s, v) = post(&app, "/v1/completions", json!({"prompt": long})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    assert_eq!(v["error"]["param"], "prompt", "{v}");
    let (s, v) = post(
        &app,
        "/v1/chat/completions",
        chat_body(json!({"messages": [{"role": "user", "content": long}]})),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["param"], "messages", "{v}");
    // A route asked with another method: 405, with an OpenAI error body.
    let (s, b) = call(&app, "GET", "/v1/chat/completions", Body::empty()).await;
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert!(v["error"]["message"].is_string(), "{v}");
    for raw in ["{", "[1,2]", "null", "\"text\"", ""] {
        let (s, b) = call(&app, "POST", "/v1/completions", raw).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{raw:?}");
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert!(v["error"]["message"].is_string());
    }
    // The server still answers.
    still_serves(&app).await;
}

#[tokio::test]
async fn random_bodies_never_break_the_server() {
    let app = app();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for i in 0..300 {
        let len = (i * 7) % 200;
        let body: Vec<u8> = (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let uri = if i % 2 == 0 {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let (s, b) = call(&app, "POST", uri, body).await;
        assert!(s.is_client_error(), "{s}");
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert!(v["error"]["message"].is_string());
    }
    still_serves(&app).await;
}

/// Every request field, on both endpoints, streamed and not, set in turn to values of every JSON
/// type that make no sense for it: each answer is a success or a client error whose body is
/// well-formed (JSON, or SSE frames ending in `[DONE]`), never a server error, and the server keeps
/// answering.
#[tokio::test]
async fn every_field_with_absurd_values_gets_a_well_formed_answer() {
    let app = app();
    let fields = [
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "n",
        "stop",
        "seed",
        "stream_options",
        "logprobs",
        "top_logprobs",
        "drafter",
        "draft_len",
        "verify_mode",
        "user",
        "logit_bias",
        "echo",
        "suffix",
        "stream",
    ];
    let absurd = [
        json!(null),
        json!(true),
        json!(-1),
        json!(0),
        json!(1),
        json!(3.5),
        json!(1e308),
        json!(-1e308),
        json!(u64::MAX),
        json!(i64::MIN),
        json!(""),
        json!("x"),
        json!("\u{0}\u{ffff}🦀"),
        json!([]),
        json!([null]),
        json!([1, 2]),
        json!([4_000_000_000u64]),
        json!([[1, 2], [3]]),
        json!(["a", ""]),
        json!([{"role": "user"}]),
        json!([{"role": "user", "content": null}]),
        json!([{"role": "user", "content": [{"type": "text", "text": 5}]}]),
        json!({}),
        json!({"include_usage": "yes"}),
        json!({"a": {"b": [1]}}),
    ];
    let (mut ok, mut rejected) = (0, 0);
    for uri in ["/v1/chat/completions", "/v1/completions"] {
        for stream in [false, true] {
            for field in fields {
                for value in &absurd {
                    let mut body = json!({
                        "model": "mock",
                        "max_tokens": 4,
                        "stream": stream,
                    });
                    if uri.ends_with("chat/completions") {
                        body["messages"] = json!([{"role": "user", "content": "hello there"}]);
                    } else {
                        body["prompt"] = json!("hello there");
                    }
                    body[field] = value.clone();
                    let (s, b) = call(&app, "POST", uri, body.to_string()).await;
                    assert!(
                        s.is_success() || s.is_client_error(),
                        "{uri} {body} -> {s}: {}",
                        String::from_utf8_lossy(&b)
                    );
                    if s.is_client_error() {
                        rejected += 1;
                        let v: Value = serde_json::from_slice(&b)
                            .unwrap_or_else(|e| panic!("{uri} {body}: {e}"));
                        assert!(v["error"]["message"].is_string(), "{body} -> {v}");
                    } else if b.starts_with(b"data: ") {
                        ok += 1;
                        for event in sse_events(&b) {
                            if event != "[DONE]" {
                                serde_json::from_str::<Value>(&event)
                                    .unwrap_or_else(|e| panic!("{uri} {body}: {e}: {event}"));
                            }
                        }
                    } else {
                        ok += 1;
                        let v: Value = serde_json::from_slice(&b)
                            .unwrap_or_else(|e| panic!("{uri} {body}: {e}"));
                        assert!(v["choices"][0].is_object(), "{body} -> {v}");
                    }
                }
            }
        }
    }
    // Both outcomes occur: the values are neither all accepted nor all refused.
    assert!(
        ok > 100 && rejected > 100,
        "{ok} answered, {rejected} refused"
    );
    still_serves(&app).await;
}

#[tokio::test]
async fn oversize_bodies_are_413_and_the_api_key_is_checked() {
    let options = ServerOptions {
        api_key: Some("sekret".into()),
        max_body_bytes: 1000,
        ..ServerOptions::default()
    };
    let (app, _) = app_with(options, 1, 4, Duration::ZERO);
    let (s, _) = call(&app, "GET", "/v1/models", Body::empty()).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = call(&app, "GET", "/metrics", Body::empty()).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = call(&app, "GET", "/health", Body::empty()).await;
    assert_eq!(s, StatusCode::OK, "health needs no key");
    let authed = |uri: &str, key: &str, body: String| {
        Request::builder()
            .method("POST")
            .uri(uri)
            .header("authorization", format!("Bearer {key}"))
            .body(Body::from(body))
            .unwrap()
    };
    let ok = chat_body(json!({"max_tokens": 2})).to_string();
    let r = app
        .clone()
        .oneshot(authed("/v1/chat/completions", "wrong!", ok.clone()))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let r = app
        .clone()
        .oneshot(authed("/v1/chat/completions", "sekret", ok))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let big = json!({"prompt": "y".repeat(5000)}).to_string();
    let r = app
        .clone()
        .oneshot(authed("/v1/completions", "sekret", big))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let v: Value =
        serde_json::from_slice(&r.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("1000"));
}

/// A full queue is a 429; a client that leaves while its request waits frees its place in the
/// queue at once (not when a slot would have taken the request), and one that leaves while it
/// decodes frees its slot.
#[tokio::test]
async fn a_full_queue_is_429_and_a_client_that_leaves_frees_its_slot() {
    let (app, h) = app_with(ServerOptions::default(), 1, 1, Duration::from_millis(20));
    let stream = |n: u32| stream_request(&format!("p{n}"), 400);
    // One active, one queued, then 429.
    let first = app.clone().oneshot(stream(1)).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    wait(|| h.shared.active.load(Ordering::SeqCst) == 1);
    let second = app.clone().oneshot(stream(2)).await.unwrap();
    assert_eq!(second.status(), StatusCode::OK);
    let third = app.clone().oneshot(stream(3)).await.unwrap();
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(third.headers().contains_key("retry-after"));
    let v: Value =
        serde_json::from_slice(&third.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(v["error"]["type"], "rate_limit_error");
    // The waiting client leaves while the first still decodes (400 tokens, 20 ms a step).
    drop(second);
    wait(|| h.shared.queued.load(Ordering::SeqCst) == 0);
    assert_eq!(
        h.shared.active.load(Ordering::SeqCst),
        1,
        "the first still decodes"
    );
    let fourth = app.clone().oneshot(stream(4)).await.unwrap();
    assert_eq!(fourth.status(), StatusCode::OK, "the queue has room again");
    // Both clients leave: their sequences end and the slots free up.
    drop(first);
    drop(fourth);
    wait(|| {
        h.shared.active.load(Ordering::SeqCst) == 0 && h.shared.queued.load(Ordering::SeqCst) == 0
    });
    let (s, _) = post(
        &app,
        "/v1/completions",
        json!({"prompt": "again", "max_tokens": 2}),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let (_, m) = call(&app, "GET", "/metrics", Body::empty()).await;
    let m = String::from_utf8(m).unwrap();
    assert!(
        m.contains("specdec_requests_total{status=\"429\"} 1"),
        "{m}"
    );
    assert!(m.contains("specdec_time_to_first_token_seconds_count"));
    assert!(m.contains("specdec_active_sequences 0"));
    assert!(m.contains("specdec_non_finite_draft_rounds_total 0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_get_their_solo_answers() {
    // Without a cap on drafting in batches, the drafts are those of a solo run, so even sampled
    // requests (with a model draft) get their solo tokens.
    let app = app();
    concurrent_equals_solo(&app, false).await;
    // With drafting turned off while several sequences decode, greedy answers are still the same.
    let options = ServerOptions {
        defaults: Defaults {
            drafter: DrafterKind::Model,
            ..Defaults::default()
        },
        ..ServerOptions::default()
    };
    let capped = router(engine_capped(4, 16, Duration::ZERO, Some(0)), options);
    concurrent_equals_solo(&capped, true).await;
}

async fn concurrent_equals_solo(app: &Router, greedy_only: bool) {
    let bodies: Vec<Value> = (0..6)
        .map(|i| {
            // Sampled requests (odd i) use drafters whose drafts depend on their own context only:
            // the lookup learns from every request (history, acceptance estimates), so a sampled
            // request's drafts, and so its tokens (not their distribution), may depend on the
            // others. Greedy requests get their solo tokens with every drafter.
            let drafter = ["model", "model", "hybrid", "none", "ngram", "model"][i];
            json!({
                "messages": [{"role": "user", "content": format!("question number {i}")}],
                "max_tokens": 16 + 4 * i,
                "temperature": if i % 2 == 0 || greedy_only { 0.0 } else { 0.8 },
                "seed": i,
                "drafter": drafter,
                "draft_len": 1 + i % 4,
            })
        })
        .collect();
    let mut solo = Vec::new();
    for b in &bodies {
        let (s, v) = post(app, "/v1/chat/completions", b.clone()).await;
        assert_eq!(s, StatusCode::OK);
        solo.push(v["choices"][0]["message"]["content"].clone());
    }
    let together = futures_util::future::join_all(bodies.iter().map(|b| {
        let app = app.clone();
        let b = b.clone();
        async move { post(&app, "/v1/chat/completions", b).await }
    }))
    .await;
    for (i, ((s, v), want)) in together.iter().zip(&solo).enumerate() {
        assert_eq!(*s, StatusCode::OK);
        assert_eq!(&v["choices"][0]["message"]["content"], want, "request {i}");
    }
}

#[tokio::test]
async fn free_slots_take_requests_even_with_no_queue() {
    let (app, h) = app_with(ServerOptions::default(), 2, 0, Duration::from_millis(20));
    let stream = |n: u32| stream_request(&format!("q{n}"), 400);
    let a = app.clone().oneshot(stream(1)).await.unwrap();
    let b = app.clone().oneshot(stream(2)).await.unwrap();
    assert_eq!(a.status(), StatusCode::OK);
    assert_eq!(b.status(), StatusCode::OK, "a free slot, not a 429");
    wait(|| h.shared.active.load(Ordering::SeqCst) == 2);
    let c = app.clone().oneshot(stream(3)).await.unwrap();
    assert_eq!(c.status(), StatusCode::TOO_MANY_REQUESTS);
    drop((a, b));
}

#[tokio::test]
async fn logprobs_carry_each_tokens_own_bytes() {
    let app = app();
    let body = chat_body(json!({"logprobs": true, "top_logprobs": 2, "temperature": 0}));
    let (s, v) = post(&app, "/v1/chat/completions", body).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    let bytes_of = |t: &Value| -> Vec<u8> {
        let b = t["bytes"].as_array().unwrap();
        b.iter()
            .map(|b| u8::try_from(b.as_u64().unwrap()).unwrap())
            .collect()
    };
    // A token is its text, or `bytes:` and escapes when it holds part of a character.
    let check = |t: &Value| {
        let bytes = bytes_of(t);
        match std::str::from_utf8(&bytes) {
            Ok(s) => assert_eq!(t["token"], s),
            Err(_) => assert!(t["token"].as_str().unwrap().starts_with("bytes:"), "{t}"),
        }
        bytes
    };
    let mut raw = Vec::new();
    for t in content {
        raw.extend(check(t));
        for alt in t["top_logprobs"].as_array().unwrap() {
            check(alt);
        }
    }
    // Together the tokens spell the text (the end-of-turn token has no bytes).
    assert_eq!(String::from_utf8_lossy(&raw), text);
}

/// Records what the engine tells a [`Learner`]: per finished request its rounds and whether it
/// decoded alone; and gives every cost model it primes a prior whose acceptance counts the
/// requests learned so far.
#[derive(Default)]
struct Recorded {
    learned: Vec<(u64, bool)>,
    primed: Vec<usize>,
    /// The drafter kind of each request learned, and of each primed.
    kinds: (Vec<DrafterKind>, Vec<DrafterKind>),
}

struct Counting(Arc<std::sync::Mutex<Recorded>>);

impl Learner for Counting {
    fn learn(&mut self, drafter: DrafterKind, metrics: &specdec_core::Metrics, alone: bool) {
        let mut r = self.0.lock().unwrap();
        r.learned.push((metrics.rounds, alone));
        r.kinds.0.push(drafter);
    }

    fn prime(&self, drafter: DrafterKind, policy: &mut specdec_core::DraftLenPolicy) {
        let mut r = self.0.lock().unwrap();
        r.kinds.1.push(drafter);
        let n = r.learned.len();
        r.primed.push(n);
        if let specdec_core::DraftLenPolicy::CostModel { prior, .. } = policy {
            *prior = Some(specdec_core::FixedCost {
                c: 0.3,
                draft_fixed: 0.0,
                r: vec![1.0, 1.1, 1.2, 1.3],
                context: None,
                step_secs: None,
                acceptance: vec![0.5; n + 1],
                draft_read: None,
                draft_step_secs: None,
            });
        }
    }
}

/// The engine hands every finished request to the learner (alone, or sharing steps with another)
/// and lets it prime every new request's cost model, in order: the second request starts from
/// what the first taught.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_learner_sees_every_request_and_primes_the_next() {
    let recorded = Arc::new(std::sync::Mutex::new(Recorded::default()));
    let h = engine_learning(
        2,
        8,
        Duration::from_millis(2),
        None,
        Some(Box::new(Counting(recorded.clone()))),
    );
    let options = ServerOptions {
        defaults: Defaults {
            drafter: DrafterKind::Model,
            draft_len: specdec_core::DraftLenPolicy::auto(None),
            ..Defaults::default()
        },
        ..ServerOptions::default()
    };
    let app = router(h, options);
    let body = |i: usize| {
        json!({
            "messages": [{"role": "user", "content": format!("request {i}")}],
            "max_tokens": 24,
            "temperature": 0.0,
        })
    };
    for i in 0..2 {
        let (s, _) = post(&app, "/v1/chat/completions", body(i)).await;
        assert_eq!(s, StatusCode::OK);
    }
    {
        let r = recorded.lock().unwrap();
        assert_eq!(
            r.primed,
            [0, 1],
            "each request primed after the ones before it"
        );
        assert_eq!(r.learned.len(), 2);
        assert!(r.learned.iter().all(|&(rounds, alone)| rounds > 0 && alone));
    }
    // Two at once share their steps: learned, but not as timed alone.
    let together = futures_util::future::join_all((2..4).map(|i| {
        let app = app.clone();
        async move { post(&app, "/v1/chat/completions", body(i)).await }
    }))
    .await;
    assert!(together.iter().all(|(s, _)| *s == StatusCode::OK));
    {
        let r = recorded.lock().unwrap();
        assert_eq!(r.learned.len(), 4);
        assert!(
            r.learned[2..].iter().any(|&(_, alone)| !alone),
            "{:?}",
            r.learned
        );
    }
    // Each request is learned and primed as the kind that drafts it.
    let mut ngram = body(4);
    ngram["drafter"] = json!("ngram");
    let (s, _) = post(&app, "/v1/chat/completions", ngram).await;
    assert_eq!(s, StatusCode::OK);
    let r = recorded.lock().unwrap();
    let model = [DrafterKind::Model; 4];
    assert_eq!(r.kinds.0[..4], model);
    assert_eq!(r.kinds.1[..4], model);
    assert_eq!(r.kinds.0[4..], [DrafterKind::Ngram]);
    assert_eq!(r.kinds.1[4..], [DrafterKind::Ngram]);
}
