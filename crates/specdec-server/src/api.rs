//! OpenAI's request and response shapes: parsing and validating `/v1/chat/completions` and
//! `/v1/completions` bodies into engine jobs, and building responses and stream chunks.
//!
//! Every check happens here, before anything reaches the engine; a bad request is a 400 naming the
//! field. Unknown fields are ignored, as OpenAI's own server does for optional extensions.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};
use specdec_core::{DraftLenPolicy, GenerateConfig, SamplingParams, TokenId, VerifyMode};
use tokio::sync::mpsc::UnboundedSender;

use crate::engine::{token_string, Codec, DrafterKind, Event, Info, Job, Summary, TokenOut};
use crate::error::ApiError;

/// The most stop strings a request may give.
pub const MAX_STOPS: usize = 16;
/// The longest stop string, in bytes.
pub const MAX_STOP_LEN: usize = 256;
const _: () = assert!(
    MAX_STOPS == 16 && MAX_STOP_LEN == 256,
    "stop_problem's messages"
);

/// The server's defaults for what a request leaves out.
#[derive(Clone, Debug)]
pub struct Defaults {
    /// Sampling (temperature 0 = greedy).
    pub sampling: SamplingParams,
    /// `max_tokens` when absent (clamped to the room left in the context).
    pub max_tokens: usize,
    /// The drafter.
    pub drafter: DrafterKind,
    /// The draft-length policy.
    pub draft_len: DraftLenPolicy,
    /// Verification of sampled drafts.
    pub verify_mode: VerifyMode,
    /// The draft model's early-stop confidence.
    pub min_confidence: f32,
    /// Keep generating past end-of-turn tokens.
    pub ignore_eos: bool,
    /// `seed` when absent (`None`: drawn from the clock per request).
    pub seed: Option<u64>,
    /// `stop` when absent.
    pub stop: Vec<String>,
}

impl Default for Defaults {
    fn default() -> Self {
        Self {
            sampling: SamplingParams::greedy(),
            max_tokens: 256,
            drafter: DrafterKind::None,
            draft_len: DraftLenPolicy::Fixed { draft_len: 4 },
            verify_mode: VerifyMode::Rejection,
            min_confidence: 0.0,
            ignore_eos: false,
            seed: None,
            stop: Vec::new(),
        }
    }
}

impl Defaults {
    /// Checks every value as a request's own would be checked, so that a server never starts with
    /// defaults that would fail every request that leaves them out.
    pub fn validate(&self) -> specdec_core::Result<()> {
        GenerateConfig {
            sampling: self.sampling.clone(),
            draft_len: self.draft_len.clone(),
            min_confidence: self.min_confidence,
            ..GenerateConfig::default()
        }
        .validate()?;
        match stop_problem(&self.stop) {
            Some(expected) => Err(specdec_core::Error::InvalidConfig {
                field: "stop",
                value: format!("{:?}", self.stop),
                expected,
            }),
            None => Ok(()),
        }
    }
}

/// What is wrong with a list of stop strings, if anything: the one rule for a request's `stop` and
/// the server's default.
fn stop_problem(stop: &[String]) -> Option<&'static str> {
    if stop.len() > MAX_STOPS {
        Some("at most 16 stop strings")
    } else if stop.iter().any(|s| s.is_empty() || s.len() > MAX_STOP_LEN) {
        Some("stop strings must be 1 to 256 bytes long")
    } else {
        None
    }
}

/// Which endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completion,
}

/// A validated request.
#[derive(Debug)]
pub struct Request {
    /// Which endpoint.
    pub kind: Kind,
    /// Stream the answer as server-sent events.
    pub stream: bool,
    /// Send a usage chunk before `[DONE]`.
    pub include_usage: bool,
    /// Report log-probabilities with this many alternatives.
    pub logprobs: Option<usize>,
    prompt: Vec<TokenId>,
    config: GenerateConfig,
    drafter: DrafterKind,
    stop: Vec<String>,
}

impl Request {
    /// The engine job, sending its events to `events`.
    pub fn job(&self, events: UnboundedSender<Event>) -> Job {
        Job {
            prompt: self.prompt.clone(),
            config: self.config.clone(),
            drafter: self.drafter,
            logprobs: self.logprobs,
            stop: self.stop.clone(),
            events,
            submitted: Instant::now(),
        }
    }
}

fn field<T: DeserializeOwned>(obj: &Map<String, Value>, name: &str) -> Result<Option<T>, ApiError> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => serde_json::from_value(v.clone())
            .map(Some)
            .map_err(|e| ApiError::invalid(name, format!("`{name}`: {e}"))),
    }
}

fn number(
    obj: &Map<String, Value>,
    name: &str,
    range: std::ops::RangeInclusive<f64>,
) -> Result<Option<f32>, ApiError> {
    let Some(v) = field::<f64>(obj, name)? else {
        return Ok(None);
    };
    if !v.is_finite() || !range.contains(&v) {
        return Err(ApiError::invalid(
            name,
            format!(
                "`{name}` = {v} is out of range: expected a number in [{}, {}]",
                range.start(),
                range.end()
            ),
        ));
    }
    Ok(Some(v as f32))
}

fn integer(
    obj: &Map<String, Value>,
    name: &str,
    range: std::ops::RangeInclusive<i64>,
) -> Result<Option<i64>, ApiError> {
    let v = match obj.get(name) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Number(n)) => n.as_i64().or_else(|| {
            n.as_f64()
                .filter(|f| f.fract() == 0.0 && f.abs() < 9e15)
                .map(|f| f as i64)
        }),
        Some(_) => None,
    };
    match v {
        Some(v) if range.contains(&v) => Ok(Some(v)),
        _ => Err(ApiError::invalid(
            name,
            format!(
                "`{name}` must be an integer in [{}, {}], got {}",
                range.start(),
                range.end(),
                obj.get(name).map(Value::to_string).unwrap_or_default()
            ),
        )),
    }
}

/// Parses and validates a request body against the loaded model.
pub fn parse(
    kind: Kind,
    body: &[u8],
    info: &Info,
    defaults: &Defaults,
) -> Result<Request, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    let Value::Object(obj) = value else {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    };
    field::<String>(&obj, "model")?;
    if let Some(n) = integer(&obj, "n", 1..=i64::MAX)? {
        if n != 1 {
            return Err(ApiError::invalid("n", "only n = 1 is supported"));
        }
    }

    let codec = &*info.codec;
    let prompt = match kind {
        Kind::Chat => chat_prompt(&obj, codec)?,
        Kind::Completion => completion_prompt(&obj, codec)?,
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    if prompt.len() >= info.ctx {
        return Err(ApiError::invalid(
            match kind {
                Kind::Chat => "messages",
                Kind::Completion => "prompt",
            },
            format!(
                "the prompt has {} tokens; the context holds {} (prompt and completion together)",
                prompt.len(),
                info.ctx
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let room = info.ctx - prompt.len();

    // Token limit: `max_completion_tokens` is the newer name (a null one is unset, as everywhere).
    let limit_name = if obj
        .get("max_completion_tokens")
        .is_some_and(|v| !v.is_null())
    {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let max_tokens = match integer(&obj, limit_name, i64::MIN..=i64::MAX)? {
        None => defaults.max_tokens.min(room),
        Some(n) if n < 1 => {
            return Err(ApiError::invalid(
                limit_name,
                format!("`{limit_name}` must be at least 1, got {n}"),
            ))
        }
        Some(n) if n as u64 > room as u64 => {
            return Err(ApiError::invalid(
                limit_name,
                format!(
                    "the prompt ({} tokens) plus `{limit_name}` ({n}) exceeds the context of {} \
                     tokens",
                    prompt.len(),
                    info.ctx
                ),
            )
            .with_code("context_length_exceeded"))
        }
        Some(n) => n as usize,
    };

    let d = &defaults.sampling;
    let sampling = SamplingParams {
        temperature: number(&obj, "temperature", 0.0..=2.0)?.unwrap_or(d.temperature),
        top_p: match number(&obj, "top_p", 0.0..=1.0)? {
            Some(p) if p <= 0.0 => {
                return Err(ApiError::invalid("top_p", "`top_p` must be greater than 0"))
            }
            Some(p) => p,
            None => d.top_p,
        },
        top_k: integer(&obj, "top_k", 0..=i64::from(u32::MAX))?.map_or(d.top_k, |k| k as usize),
        min_p: number(&obj, "min_p", 0.0..=1.0)?.unwrap_or(d.min_p),
        presence_penalty: number(&obj, "presence_penalty", -2.0..=2.0)?
            .unwrap_or(d.presence_penalty),
        frequency_penalty: number(&obj, "frequency_penalty", -2.0..=2.0)?
            .unwrap_or(d.frequency_penalty),
        repetition_penalty: match number(&obj, "repetition_penalty", 0.0..=10.0)? {
            Some(r) if r <= 0.0 => {
                return Err(ApiError::invalid(
                    "repetition_penalty",
                    "`repetition_penalty` must be greater than 0",
                ))
            }
            Some(r) => r,
            None => d.repetition_penalty,
        },
        ..d.clone()
    };
    let seed = match obj.get("seed") {
        None | Some(Value::Null) => defaults.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |t| t.as_nanos() as u64)
        }),
        Some(v) => v
            .as_u64()
            .or_else(|| v.as_i64().map(|i| i as u64))
            .ok_or_else(|| ApiError::invalid("seed", "`seed` must be an integer"))?,
    };

    let stop = match obj.get("stop") {
        None | Some(Value::Null) => defaults.stop.clone(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str().map(str::to_string).ok_or_else(|| {
                    ApiError::invalid("stop", "`stop` must be a string or an array of strings")
                })
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "`stop` must be a string or an array of strings",
            ))
        }
    };
    if let Some(problem) = stop_problem(&stop) {
        return Err(ApiError::invalid("stop", problem));
    }

    let stream = field::<bool>(&obj, "stream")?.unwrap_or(false);
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => field::<bool>(o, "include_usage")?.unwrap_or(false),
        Some(_) => {
            return Err(ApiError::invalid(
                "stream_options",
                "`stream_options` must be an object",
            ))
        }
    };

    let logprobs = match kind {
        Kind::Chat => {
            let on = field::<bool>(&obj, "logprobs")?.unwrap_or(false);
            let top = integer(&obj, "top_logprobs", 0..=20)?;
            match (on, top) {
                (false, Some(_)) => {
                    return Err(ApiError::invalid(
                        "top_logprobs",
                        "`top_logprobs` needs `logprobs: true`",
                    ))
                }
                (false, None) => None,
                (true, t) => Some(t.unwrap_or(0) as usize),
            }
        }
        Kind::Completion => integer(&obj, "logprobs", 0..=20)?.map(|n| n as usize),
    };

    let drafter = match field::<String>(&obj, "drafter")? {
        None => defaults.drafter,
        Some(name) => DrafterKind::parse(&name)
            .filter(|k| info.drafters.contains(k))
            .ok_or_else(|| {
                let offered: Vec<&str> = info.drafters.iter().map(|k| k.name()).collect();
                ApiError::invalid(
                    "drafter",
                    format!(
                        "unknown or unavailable drafter `{name}`; this server offers {}",
                        offered.join(", ")
                    ),
                )
            })?,
    };
    let draft_len = match obj.get("draft_len") {
        None | Some(Value::Null) => defaults.draft_len.clone(),
        // The server's own `auto` carries the calibration it was started with.
        Some(Value::String(s)) if s == "auto" => match &defaults.draft_len {
            auto @ DraftLenPolicy::CostModel { .. } => auto.clone(),
            _ => DraftLenPolicy::auto(None),
        },
        Some(Value::String(s)) if s == "adaptive" => DraftLenPolicy::ADAPTIVE,
        Some(_) => DraftLenPolicy::Fixed {
            draft_len: integer(&obj, "draft_len", 1..=64)?.unwrap_or(4) as usize,
        },
    };
    let verify_mode = match field::<String>(&obj, "verify_mode")?.as_deref() {
        None => defaults.verify_mode,
        Some("rejection") => VerifyMode::Rejection,
        Some("onehot") => VerifyMode::OneHot,
        Some(other) => {
            return Err(ApiError::invalid(
                "verify_mode",
                format!("unknown verify_mode `{other}`: expected `rejection` or `onehot`"),
            ))
        }
    };

    let config = GenerateConfig {
        max_new_tokens: max_tokens,
        stop_tokens: if defaults.ignore_eos {
            Vec::new()
        } else {
            codec.stop_tokens()
        },
        sampling,
        seed,
        verify_mode,
        draft_len,
        min_confidence: defaults.min_confidence,
    };
    config.validate().map_err(|e| match e {
        specdec_core::Error::InvalidConfig { field, .. } => ApiError::invalid(field, e.to_string()),
        other => ApiError::bad_request(other.to_string()),
    })?;
    Ok(Request {
        kind,
        stream,
        include_usage,
        logprobs,
        prompt,
        config,
        drafter,
        stop,
    })
}

fn chat_prompt(obj: &Map<String, Value>, codec: &dyn Codec) -> Result<Vec<TokenId>, ApiError> {
    let Some(messages) = obj.get("messages") else {
        return Err(ApiError::invalid("messages", "`messages` is required"));
    };
    let Value::Array(messages) = messages else {
        return Err(ApiError::invalid("messages", "`messages` must be an array"));
    };
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "`messages` is empty"));
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let param = format!("messages[{i}]");
        let Value::Object(m) = m else {
            return Err(ApiError::invalid(
                &param,
                format!("{param} must be an object"),
            ));
        };
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("system" | "user" | "assistant")) => r.to_string(),
            Some("developer") => "system".to_string(),
            Some(other) => {
                return Err(ApiError::invalid(
                    &format!("{param}.role"),
                    format!(
                        "unsupported role `{other}`: expected system, developer, user or assistant"
                    ),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    &format!("{param}.role"),
                    format!("{param} needs a string `role`"),
                ))
            }
        };
        let content =
            match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut text = String::new();
                    for p in parts {
                        match (p.get("type").and_then(Value::as_str), p.get("text")) {
                            (Some("text"), Some(Value::String(t))) => text.push_str(t),
                            _ => return Err(ApiError::invalid(
                                &format!("{param}.content"),
                                "only text content parts ({\"type\": \"text\", \"text\": ...}) \
                                 are supported",
                            )),
                        }
                    }
                    text
                }
                _ => {
                    return Err(ApiError::invalid(
                        &format!("{param}.content"),
                        format!("{param} needs `content`: a string or an array of text parts"),
                    ))
                }
            };
        if content.is_empty() && role == "user" {
            return Err(ApiError::invalid(
                &format!("{param}.content"),
                format!("{param} is an empty user message"),
            ));
        }
        out.push((role, content));
    }
    codec
        .encode_chat(&out)
        .map_err(|e| ApiError::invalid("messages", format!("the chat template failed: {e}")))
}

fn completion_prompt(
    obj: &Map<String, Value>,
    codec: &dyn Codec,
) -> Result<Vec<TokenId>, ApiError> {
    let text = match obj.get("prompt") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            a[0].as_str().unwrap_or_default().to_string()
        }
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid(
                "prompt",
                "`prompt` must be one string (batches of prompts are not supported)",
            ))
        }
        None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(_) => return Err(ApiError::invalid("prompt", "`prompt` must be a string")),
    };
    if text.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` is empty"));
    }
    codec
        .encode(&text)
        .map_err(|e| ApiError::invalid("prompt", format!("could not encode the prompt: {e}")))
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A fresh response id.
pub fn response_id(kind: Kind) -> String {
    let n = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    match kind {
        Kind::Chat => format!("chatcmpl-{n:016x}"),
        Kind::Completion => format!("cmpl-{n:016x}"),
    }
}

/// The `usage` object.
pub fn usage(s: &Summary) -> Value {
    json!({
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "total_tokens": s.prompt_tokens + s.completion_tokens,
    })
}

/// The `speculative` object: what drafting did for this request.
pub fn speculative(s: &Summary) -> Value {
    let m = &s.metrics;
    json!({
        "drafter": s.drafter.name(),
        "draft_len": s.draft_len,
        "rounds": m.rounds,
        "drafted": m.drafted,
        "accepted": m.accepted,
        "acceptance_rate": m.acceptance_rate(),
        "mean_accepted_len": m.mean_accepted_len(),
        "non_finite_rounds": m.non_finite_rounds,
        "prefill_secs": m.prefill_secs,
        "first_token_secs": m.first_token_secs,
        "decode_secs": m.decode_secs,
        "decode_tokens_per_s": m.decode_tokens_per_s(),
    })
}

/// Chat `logprobs.content` entries.
pub fn chat_logprobs(tokens: &[TokenOut], codec: &dyn Codec) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .filter_map(|t| {
            let lp = t.logprob.as_ref()?;
            let top: Vec<Value> = lp
                .top
                .iter()
                .map(|&(id, l)| {
                    let bytes = codec.token_bytes(id);
                    json!({"token": token_string(&bytes), "logprob": l, "bytes": bytes})
                })
                .collect();
            Some(json!({
                "token": token_string(&t.bytes),
                "logprob": lp.logprob,
                "bytes": t.bytes,
                "top_logprobs": top,
            }))
        })
        .collect();
    json!({ "content": content })
}

/// Legacy completion `logprobs`: tokens, their log-probabilities, the alternatives, text offsets.
pub fn completion_logprobs(tokens: &[TokenOut], codec: &dyn Codec, offset: usize) -> Value {
    let mut at = offset;
    let mut toks = Vec::new();
    let mut lps = Vec::new();
    let mut tops = Vec::new();
    let mut offs = Vec::new();
    for t in tokens {
        let Some(lp) = &t.logprob else { continue };
        toks.push(Value::String(token_string(&t.bytes)));
        lps.push(json!(lp.logprob));
        let top: Map<String, Value> = lp
            .top
            .iter()
            .map(|&(id, l)| (token_string(&codec.token_bytes(id)), json!(l)))
            .collect();
        tops.push(Value::Object(top));
        offs.push(json!(at));
        at += t.bytes.len();
    }
    json!({"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs})
}

/// The whole response of a non-streaming request.
pub fn response(req: &Request, info: &Info, text: &str, tokens: &[TokenOut], s: &Summary) -> Value {
    let codec = &*info.codec;
    let created = now();
    let choice = match req.kind {
        Kind::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": req.logprobs.map(|_| chat_logprobs(tokens, codec)),
            "finish_reason": s.finish.as_str(),
        }),
        Kind::Completion => json!({
            "index": 0,
            "text": text,
            "logprobs": req.logprobs.map(|_| completion_logprobs(tokens, codec, 0)),
            "finish_reason": s.finish.as_str(),
        }),
    };
    json!({
        "id": response_id(req.kind),
        "object": match req.kind { Kind::Chat => "chat.completion", Kind::Completion => "text_completion" },
        "created": created,
        "model": info.model,
        "choices": [choice],
        "usage": usage(s),
        "speculative": speculative(s),
    })
}

/// Seconds since the Unix epoch.
pub fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
