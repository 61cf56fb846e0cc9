//! `specdec generate` and the generation step shared with `chat`.

use std::io::Write;
use std::ops::ControlFlow;
use std::sync::atomic::Ordering;

use anyhow::{Context, Result};
use serde_json::json;
use specdec_core::{
    generate, DraftLenPolicy, FixedCost, GenerateConfig, Metrics, Output, StopReason, TokenId,
};
use specdec_runtime::{Session, StreamDecoder, Tokenizer};
use specdec_server::text::{Release, StopText};

use crate::cli::GenerateArgs;
use crate::engine::{Drafter, Loaded, Ui, INTERRUPTED};

/// The result of one generation: what was produced, even when a model failed part-way.
pub struct Generation {
    /// Output and metrics.
    pub output: Output,
    /// The decoded text.
    pub text: String,
    /// The model failure that ended it, if any.
    pub error: Option<String>,
    /// A stop string ended it (the text ends before it).
    pub stopped_by_string: bool,
}

/// Generates, streaming text to `sink` as it is committed (when given). Generation ends at the first
/// of `stops` in the decoded text, which is not printed; text that could start a stop string is held
/// back until it is known not to.
pub fn run(
    target: &mut Session,
    drafter: &mut Drafter,
    tokenizer: &Tokenizer,
    prompt: &[TokenId],
    config: &GenerateConfig,
    stops: &[String],
    mut sink: Option<&mut dyn Write>,
) -> Result<Generation> {
    let mut stream = StreamDecoder::new();
    let mut stop = StopText::new(stops.to_vec());
    let mut stopped_by_string = false;
    let mut text = String::new();
    let mut io_error = None;
    let mut write = |piece: &str, text: &mut String| -> std::io::Result<()> {
        if let Some(w) = sink.as_mut() {
            w.write_all(piece.as_bytes()).and_then(|_| w.flush())?;
        }
        text.push_str(piece);
        Ok(())
    };
    let mut on_token = |t: TokenId| {
        if let Ok(Some(piece)) = stream.push(tokenizer, t) {
            let (out, end) = match stop.push(&piece) {
                Release::Text(out) => (out, false),
                Release::Stopped(out) => (out, true),
            };
            if let Err(e) = write(&out, &mut text) {
                io_error = Some(e);
                return ControlFlow::Break(());
            }
            if end {
                stopped_by_string = true;
                return ControlFlow::Break(());
            }
        }
        if INTERRUPTED.load(Ordering::SeqCst) {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    };
    let result = generate(target, drafter, prompt, config, &mut on_token);
    if let Some(e) = io_error {
        // A closed pipe (e.g. `| head`) is not a model error; report it as the caller's.
        return Err(e).context("writing the generated text");
    }
    let (output, error) = match result {
        Ok(o) => (o, None),
        Err(e) => {
            let error = e.to_string();
            (*e.output, Some(error))
        }
    };
    if !stopped_by_string {
        let rest = stream.finish(tokenizer).ok().flatten().unwrap_or_default();
        let out = match stop.push(&rest) {
            Release::Text(out) => out + &stop.finish(),
            Release::Stopped(out) => {
                stopped_by_string = true;
                out
            }
        };
        write(&out, &mut text)?;
    }
    Ok(Generation {
        output,
        text,
        error,
        stopped_by_string,
    })
}

/// [`run`] streaming to stdout, ending the text with a newline.
pub fn run_to_stdout(
    target: &mut Session,
    drafter: &mut Drafter,
    tokenizer: &Tokenizer,
    prompt: &[TokenId],
    config: &GenerateConfig,
    stops: &[String],
) -> Result<Generation> {
    let mut out = std::io::stdout().lock();
    let g = run(
        target,
        drafter,
        tokenizer,
        prompt,
        config,
        stops,
        Some(&mut out),
    )?;
    writeln!(out)?;
    Ok(g)
}

/// `stop_reason` as the JSON output spells it.
pub fn stop_reason_name(g: &Generation) -> &'static str {
    match (g.error.as_ref(), g.output.stop_reason) {
        (Some(_), _) => "error",
        (None, _) if g.stopped_by_string => "stop_string",
        (None, Some(StopReason::MaxTokens)) => "max_tokens",
        (None, Some(StopReason::StopToken(_))) => "stop_token",
        (None, Some(StopReason::ContextFull)) => "context_full",
        (None, Some(StopReason::Cancelled)) => "cancelled",
        (None, None) => "unknown",
    }
}

fn policy_name(p: &DraftLenPolicy) -> String {
    match p {
        DraftLenPolicy::Fixed { draft_len } => format!("fixed:{draft_len}"),
        DraftLenPolicy::Adaptive { min, max, .. } => format!("adaptive:{min}..{max}"),
        DraftLenPolicy::CostModel { max, .. } => format!("auto:0..{max}"),
    }
}

/// The calibration the cost model started from, moved to the generation's mean context (the prompt
/// and half the generated tokens; [`specdec_core::FixedCost::at_context`]): the shape of `r(m)` by
/// which a run's predicted speedup is read when it timed no single-token step.
pub fn calibration_at_run(config: &GenerateConfig, m: &Metrics) -> Option<FixedCost> {
    let context = m.prompt_tokens + (m.emitted / 2) as usize;
    config
        .draft_len
        .calibration()
        .map(|p| p.at_context(context))
}

/// The statistics object of `--json` (and of bench records).
pub fn stats_json(g: &Generation, config: &GenerateConfig, drafter: &str) -> serde_json::Value {
    let m = &g.output.metrics;
    let calibration = calibration_at_run(config, m);
    let prior = calibration.as_ref().map(|p| p.r.as_slice());
    let cost = m.cost_profile_with(prior);
    json!({
        "prompt_tokens": m.prompt_tokens,
        "generated_tokens": g.output.tokens.len(),
        "prefill_s": m.prefill_secs,
        "first_token_s": m.first_token_secs,
        "decode_s": m.decode_secs,
        "decode_tokens_per_s": m.decode_tokens_per_s(),
        "rounds": m.rounds,
        "drafted": m.drafted,
        "accepted": m.accepted,
        "acceptance_rate": m.acceptance_rate(),
        "mean_accepted_len": m.mean_accepted_len(),
        "per_position_acceptance": m.per_position_acceptance(),
        "non_finite_rounds": m.non_finite_rounds,
        "drafter": drafter,
        "draft_len_policy": policy_name(&config.draft_len),
        "seed": config.seed,
        "cost_ratio": if m.drafted > 0 { cost.as_ref().map(|c| c.c) } else { None },
        "verify_cost": cost.as_ref().map(|c| c.measured.clone()),
        "predicted_speedup": if m.drafted > 0 { m.predicted_speedup_with(prior) } else { None },
    })
}

/// The one-line summary on stderr; `config` is the generation's (its calibration completes the cost
/// model's prediction).
pub fn stats_line(g: &Generation, config: &GenerateConfig) -> String {
    let m = &g.output.metrics;
    let mut s = format!(
        "{} tokens, {:.1} tok/s decode, prefill {:.2}s ({} prompt tokens), first token {:.2}s",
        g.output.tokens.len(),
        m.decode_tokens_per_s(),
        m.prefill_secs,
        m.prompt_tokens,
        m.first_token_secs
    );
    if m.drafted > 0 {
        s.push_str(&format!(
            ", acceptance {:.1}%, mean accepted length {:.2}, {} rounds",
            100.0 * m.acceptance_rate(),
            m.mean_accepted_len(),
            m.rounds
        ));
        let calibration = calibration_at_run(config, m);
        if let Some(p) = m.predicted_speedup_with(calibration.as_ref().map(|p| p.r.as_slice())) {
            s.push_str(&format!(", predicted speedup {p:.2}x"));
        }
    }
    // Outside the drafted case: a draft model whose logits are never finite drafts nothing.
    if m.non_finite_rounds > 0 {
        s.push_str(&format!(
            ", draft logits not finite in {} rounds (their drafts ended there)",
            m.non_finite_rounds
        ));
    }
    s
}

/// Where `generate`'s prompt comes from.
enum PromptSource {
    /// `--prompt`.
    Text(String),
    /// `--prompt-file`, opened.
    File(PromptFile),
}

/// A `--prompt-file`, opened but not read.
struct PromptFile {
    what: String,
    file: std::fs::File,
}

impl PromptFile {
    /// Opens `path`, refusing what cannot be read as text (a directory opens on Linux).
    fn open(path: &std::path::Path) -> Result<Self> {
        let what = format!("--prompt-file {}", path.display());
        let file = std::fs::File::open(path).with_context(|| format!("opening {what}"))?;
        if file
            .metadata()
            .with_context(|| format!("reading {what}"))?
            .is_dir()
        {
            anyhow::bail!("{what} is a directory");
        }
        Ok(Self { what, file })
    }

    /// Reads the file, at most [`Loaded::byte_limit`] bytes for the context: a larger file is
    /// refused by its size unread, and one whose size the system does not tell (a pipe, `/proc`)
    /// once that many bytes came.
    fn read(self, loaded: &Loaded) -> Result<String> {
        let Self { what, file } = self;
        let size = file
            .metadata()
            .with_context(|| format!("reading {what}"))?
            .len();
        loaded.check_fits(&what, size, loaded.ctx, "--ctx")?;
        let limit = loaded.byte_limit(loaded.ctx);
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(
            &mut std::io::Read::take(file, limit.saturating_add(1)),
            &mut bytes,
        )
        .with_context(|| format!("reading {what}"))?;
        if bytes.len() as u64 > limit {
            anyhow::bail!(
                "{what} holds more than {limit} bytes, far more than {} tokens (--ctx) can hold; \
                 shorten it or raise --ctx",
                loaded.ctx
            );
        }
        String::from_utf8(bytes).with_context(|| format!("reading {what}: not UTF-8 text"))
    }
}

/// `specdec generate`.
pub fn command(args: &GenerateArgs, ui: Ui) -> Result<()> {
    // A prompt file is opened before the models load (a wrong path fails at once) and read after,
    // at most as many bytes as could fit the context.
    let file = match (&args.prompt, &args.prompt_file) {
        (Some(p), _) => PromptSource::Text(p.clone()),
        (None, Some(f)) => PromptSource::File(PromptFile::open(f)?),
        (None, None) => anyhow::bail!("give --prompt TEXT or --prompt-file FILE"),
    };
    crate::engine::install_ctrl_c();
    let loaded = Loaded::load(&args.model, &[args.decode.drafter], ui)?;
    let prompt_text = match file {
        PromptSource::Text(text) => text,
        PromptSource::File(f) => f.read(&loaded)?,
    };
    let mut config = crate::engine::generate_config(&args.decode, &loaded.tokenizer)?;
    crate::calibration::apply(&mut config.draft_len, &loaded, true, ui)?;
    let prompt = loaded.prompt(
        &prompt_text,
        args.chat,
        args.system.as_deref(),
        args.parse_special,
    )?;
    let mut target = loaded.target_session();
    let mut drafter = loaded.drafter(args.decode.drafter)?;
    let drafter_name = format!("{:?}", args.decode.drafter).to_lowercase();
    let g = if args.json {
        run(
            &mut target,
            &mut drafter,
            &loaded.tokenizer,
            &prompt,
            &config,
            &args.decode.stop,
            None,
        )?
    } else {
        run_to_stdout(
            &mut target,
            &mut drafter,
            &loaded.tokenizer,
            &prompt,
            &config,
            &args.decode.stop,
        )?
    };
    // The next run starts from what this one's blocks cost.
    let _ = crate::calibration::learn_saved(&loaded, &g.output.metrics, None, ui);
    if args.json {
        let obj = json!({
            "text": g.text,
            "tokens": g.output.tokens,
            "stop_reason": stop_reason_name(&g),
            "error": g.error,
            "stats": stats_json(&g, &config, &drafter_name),
        });
        writeln!(std::io::stdout(), "{}", serde_json::to_string(&obj)?)
            .context("printing the JSON result")?;
    } else {
        ui.note(stats_line(&g, &config));
    }
    if g.output.stop_reason == Some(StopReason::Cancelled) && !g.stopped_by_string {
        ui.note("interrupted");
    }
    match g.error {
        Some(e) if g.output.tokens.is_empty() => {
            Err(anyhow::anyhow!(e)).context("generation failed before its first token")
        }
        Some(e) => Err(anyhow::anyhow!(e))
            .context("generation stopped early (the text above is what was produced)"),
        None => Ok(()),
    }
}
