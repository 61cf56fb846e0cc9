//! `specdec serve`: fetch the models (with progress), bind, then load them on the engine thread while
//! `/health` answers 503, and serve until SIGINT or SIGTERM.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use specdec_core::{DraftLenPolicy, ModelDrafter};
use specdec_runtime::Sessions;
use specdec_server::{DrafterKind, EngineOptions, MultiDrafter, ServerOptions};

use crate::cli::{DrafterKind as CliDrafter, ServeArgs};
use crate::engine::{Loaded, Ui};

/// `specdec serve`.
pub fn command(args: &ServeArgs, ui: Ui) -> Result<()> {
    if args.prefill_chunk == 0 {
        bail!("--prefill-chunk must be at least 1");
    }
    if args.parallel == 0 {
        bail!("--parallel must be at least 1");
    }
    let Ok(shutdown_grace) = Duration::try_from_secs_f64(args.shutdown_grace) else {
        bail!("--shutdown-grace must be a number of seconds >= 0 (and below 2^64)");
    };
    if args.decode.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if let Some(why) = args.api_key.as_deref().and_then(unsendable_key) {
        bail!("--api-key (or SPECDEC_API_KEY): {why}; every request would be refused");
    }
    let drafter = match args.decode.drafter {
        CliDrafter::None => DrafterKind::None,
        CliDrafter::Ngram => DrafterKind::Ngram,
        CliDrafter::Model => DrafterKind::Model,
        CliDrafter::Hybrid => DrafterKind::Hybrid,
    };
    // Fetch before binding, so download progress shows and a failure is reported at once.
    let target_path = ui.model_path(&args.model.target)?;
    let draft_path = if matches!(drafter, DrafterKind::Model | DrafterKind::Hybrid) {
        Some(ui.model_path(&args.model.draft)?)
    } else {
        None
    };
    // `--draft-len auto` starts from a saved calibration of these models on this machine, if any
    // (`specdec generate` or `bench` with `auto` measures one).
    let threads = specdec_runtime::thread_pool(args.model.threads)?.threads();
    let variant = crate::engine::draft_variant(&args.model);
    let calibration = crate::calibration::path(
        &target_path,
        draft_path.as_deref().map(|p| (p, variant.as_str())),
        threads,
        args.model.device,
    );
    // The engine's cost models learn from every finished request in memory (`Learning`), so a
    // request starts from what the ones before it saw; the file is left as it was.
    let saved = crate::calibration::load(&calibration);
    let prior = saved.as_ref().and_then(crate::calibration::as_prior);
    if prior.is_some() {
        ui.note(format!(
            "cost model: calibration from {}, learning across requests",
            calibration.display()
        ));
    }
    let learner = saved
        .filter(|_| prior.is_some())
        .map(crate::calibration::Learning::new);
    // The alias when the target is a known model, else the file name without `.gguf`.
    let model_name = if specdec_runtime::fetch::known(&args.model.target).is_some() {
        args.model.target.clone()
    } else {
        let name = std::path::Path::new(&args.model.target)
            .file_name()
            .map_or_else(
                || args.model.target.clone(),
                |s| s.to_string_lossy().into_owned(),
            );
        name.strip_suffix(".gguf")
            .map(str::to_string)
            .unwrap_or(name)
    };

    let defaults = {
        let d = &args.decode;
        specdec_server::Defaults {
            sampling: specdec_core::SamplingParams {
                temperature: d.temperature,
                top_k: d.top_k,
                top_p: d.top_p,
                min_p: d.min_p,
                repetition_penalty: d.repetition_penalty,
                presence_penalty: d.presence_penalty,
                frequency_penalty: d.frequency_penalty,
                ..specdec_core::SamplingParams::default()
            },
            max_tokens: d.max_tokens,
            drafter,
            draft_len: match crate::engine::draft_len_policy(&d.draft_len)? {
                DraftLenPolicy::CostModel { .. } => DraftLenPolicy::auto(prior),
                other => other,
            },
            verify_mode: match d.verify_mode {
                crate::cli::VerifyModeArg::Rejection => specdec_core::VerifyMode::Rejection,
                crate::cli::VerifyModeArg::Onehot => specdec_core::VerifyMode::OneHot,
            },
            min_confidence: d.min_confidence,
            ignore_eos: d.ignore_eos,
            seed: d.seed,
            stop: d.stop.clone(),
        }
    };
    // Checked before binding: defaults every request would fail on stop the server at once.
    defaults.validate().map_err(|e| anyhow::anyhow!("{e}"))?;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let addr = format!("{}:{}", args.host, args.port);
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(&addr))
        .with_context(|| format!("binding {addr}"))?;
    let local = listener.local_addr()?;

    let (model_args, parallel) = (args.model.clone(), args.parallel);
    let cli_drafter = args.decode.drafter;
    let engine = specdec_server::start(
        &EngineOptions {
            parallel,
            queue: args.queue,
            batch_draft_len: args.batch_draft_len.0,
            prefill_chunk: Some(args.prefill_chunk),
        },
        move || {
            let loaded =
                Loaded::load(&model_args, &[cli_drafter], ui).map_err(|e| format!("{e:#}"))?;
            let ctx = loaded.ctx;
            let target = Sessions::new(loaded.target.clone(), ctx, parallel);
            let draft = loaded
                .draft
                .clone()
                .map(|d| ModelDrafter::new(Sessions::new(d, ctx, parallel)));
            ui.note(format!(
                "ready: {ctx} tokens of context per sequence, {parallel} sequences at a time"
            ));
            Ok(specdec_server::Loaded {
                target,
                drafter: MultiDrafter::new(draft),
                codec: Arc::new(loaded.tokenizer),
                model: model_name,
                learner: learner.map(|l| Box::new(l) as Box<dyn specdec_server::Learner>),
            })
        },
    );
    let shared = engine.shared.clone();
    let app = specdec_server::router(
        engine,
        ServerOptions {
            api_key: args.api_key.clone(),
            cors: args.cors,
            max_body_bytes: args.max_body_bytes,
            defaults,
        },
    );
    ui.note(format!(
        "listening on http://{local} (chat page at /, OpenAI API at /v1); loading the models…"
    ));
    runtime
        .block_on(specdec_server::serve(
            listener,
            app,
            shared.clone(),
            shutdown_grace,
        ))
        .context("serving")?;
    if let Some(e) = shared.load_error.get() {
        bail!("the models failed to load: {e}");
    }
    ui.note("stopped");
    Ok(())
}

/// Why no client could send `key` as `Authorization: Bearer KEY`, if that is so: the header's
/// value arrives with the whitespace at its ends trimmed, and the server reads only a value of
/// visible ASCII, spaces and tabs. The key itself is never echoed (it may come from the
/// environment, into a log).
fn unsendable_key(key: &str) -> Option<&'static str> {
    if key.is_empty() {
        Some("the API key is empty (to serve without one, leave out --api-key and unset SPECDEC_API_KEY)")
    } else if key.ends_with([' ', '\t']) {
        Some("the API key ends with whitespace, which a client's header loses")
    } else if !key
        .bytes()
        .all(|b| b.is_ascii_graphic() || b == b' ' || b == b'\t')
    {
        Some("the API key holds characters other than visible ASCII, spaces and tabs, which no header carries")
    } else {
        None
    }
}
