//! Replays whole greedy decodes offline, through the real decoding loop, drafters and cost model,
//! with the models replaced by what they are known to say: how a change to drafting or to the cost
//! model would have fared on a benchmark's prompts, without the timing noise of a shared machine.
//!
//! `decode_replay BENCH.json PRED.jsonl`. `BENCH.json` is `specdec bench --json FILE`'s output
//! (its calibration gives the costs: `c`, `r(m)`, the draft's prompt reading); `PRED.jsonl` is
//! the `draft_predictions` example's (specdec-runtime) over it: each prompt's ids, its greedy answer
//! and the draft model's greedy prediction at every answer position. The target of the replay
//! answers every context on that answer's path with the answer's next token (and a stop token
//! after it); the draft model answers with its recorded prediction, at its recorded probability
//! (`conf`, where the file has it; the position's also where a draft left the answer). With greedy verification that
//! is exactly what the real models decide: a draft is accepted as far as it follows the answer.
//!
//! Time is simulated by spinning: a target pass verifying `m` rows takes `r(m)` target steps of
//! `REPLAY_STEP_MS` milliseconds (default 5; `r` continued past 16 rows with its last slope), a
//! draft pass `c` steps (reading `n > 2` rows at once `c · (1 + r(n) − r(2))`, more than 16 rows
//! at the calibrated prompt-reading price per token), the target's prefill `REPLAY_PREFILL` steps
//! per token (default 0.15). Plain decoding, the baseline, takes one step a token after the first
//! (and one for a stop token). The loop measures those
//! times as it measures real ones, so the cost model learns as it would. Each mode of
//! `REPLAY_MODES` (default `ngram,model,hybrid`) keeps one drafter over the prompts, in the
//! file's order, and starts each prompt from the acceptance its earlier prompts saw, as `bench`
//! does; the calibration stays fixed. Prints per category the median decoding and end-to-end
//! speedups against plain decoding (one target step per token; also all the prompts' time
//! together), the mean accepted length, the median over prompts of the cost model's predicted
//! speedup over the replayed one and how many prompts it predicted within 10% (from stop 69), and
//! the rounds by draft length; `REPLAY_VERBOSE=1` adds a line per prompt, `REPLAY_FIXED=k` drafts `k` tokens a round instead of the cost model's choice,
//! `REPLAY_MIN_CONFIDENCE=p` sets `--min-confidence`.
//! Stop 66 found with it that fixed draft lengths beat `auto` by about 10% in some categories,
//! that a burst of rejections stopped drafting for most of an answer, and that the hybrid's
//! deferred readings cost it most of its losses (docs/HISTORY.md, section "Stop 66").
//!
//! Leaves out: the cost of a longer context, timing noise, sampled decoding, a draft model whose
//! teacher-forced prediction differs from its step-by-step one in the last bits, and which stop
//! token ended an answer (the replay's target ends each with the first stop token).

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;
use std::time::{Duration, Instant};

use specdec_core::{
    acceptance_by_position, generate, isotonic_curve, DraftLenPolicy, FixedCost, GenerateConfig,
    HybridDrafter, Logits, LookupDrafter, ModelDrafter, RoundCosts, SamplingParams, Score, SeqId,
    StopReason, Target, VerifyMode,
};

/// One prompt's path: the prompt and greedy answer, and the draft's prediction after each prefix.
#[derive(Default)]
struct Path {
    full: Vec<u32>,
    prompt_len: usize,
    pred: Vec<u32>,
    conf: Vec<f32>,
    stop: u32,
    off: u32,
}

impl Path {
    /// The token after `prefix`: the answer's (the target) or the draft's prediction; `off` where
    /// the prefix left the answer (a rejected draft, never used), `stop` past its end.
    fn next(&self, prefix: &[u32], draft: bool) -> u32 {
        let n = prefix.len();
        if n > self.full.len() || prefix != &self.full[..n] {
            return self.off;
        }
        if draft {
            n.checked_sub(self.prompt_len)
                .and_then(|j| self.pred.get(j).copied())
                .unwrap_or(self.stop)
        } else {
            self.full.get(n).copied().unwrap_or(self.stop)
        }
    }

    /// The logit that gives the draft's token after `prefix` its recorded probability over `vocab`
    /// tokens (the answer position's, also off the answer), or 10 where none was recorded (or it
    /// was not finite).
    fn draft_logit(&self, prefix: &[u32], vocab: usize) -> f32 {
        let j = prefix.len().saturating_sub(self.prompt_len);
        match self.conf.get(j.min(self.conf.len().saturating_sub(1))) {
            Some(&p) if p.is_finite() => {
                let p = f64::from(p).clamp(1e-6, 1.0 - 1e-6);
                (p * (vocab - 1) as f64 / (1.0 - p)).ln() as f32
            }
            _ => 10.0,
        }
    }
}

/// The simulated costs, in target steps.
#[derive(Clone)]
struct Costs {
    step: Duration,
    r: Vec<f64>,
    c: f64,
    read: f64,
    prefill: f64,
}

impl Costs {
    /// `r(m)`, continued past the calibrated lengths with the last slope, as the cost model reads it.
    fn r(&self, m: usize) -> f64 {
        RoundCosts {
            r: self.r.clone(),
            ..RoundCosts::default()
        }
        .r(m)
    }

    /// A pass over `rows` new rows: a verification (a block with a draft, or a short one) on the
    /// target's curve, a prompt at the prefill price; a draft step, a catch-up on the curve, a
    /// prompt at the reading price.
    fn steps(&self, rows: usize, draft: bool, verifies: bool) -> f64 {
        match (draft, rows) {
            (_, 0) => 0.0,
            (false, _) if verifies || rows <= 16 => self.r(rows),
            (false, _) => rows as f64 * self.prefill,
            (true, 1..=2) => self.c,
            (true, 3..=16) => self.c * (1.0 + self.r(rows) - self.r(2)),
            (true, _) => rows as f64 * self.read,
        }
    }
}

/// Waits `steps` target steps, busily: sleeping overshoots by more than a short step's noise.
fn spin(costs: &Costs, steps: f64) {
    let until = Instant::now() + costs.step.mul_f64(steps);
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

/// A model that says what the path says.
struct ReplayModel {
    path: Rc<RefCell<Rc<Path>>>,
    draft: bool,
    vocab: usize,
    cached_tokens: Vec<u32>,
    costs: Costs,
}

fn common(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Target for ReplayModel {
    type Error = std::convert::Infallible;

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn capacity(&self) -> usize {
        1 << 16
    }

    fn score(&mut self, batch: &[Score<'_>], out: &mut [Logits]) -> Result<(), Self::Error> {
        for (s, logits) in batch.iter().zip(out.iter_mut()) {
            let all: Vec<u32> = s.context.iter().chain(s.draft).copied().collect();
            let cached = common(&self.cached_tokens, s.context);
            spin(
                &self.costs,
                self.costs
                    .steps(all.len() - cached, self.draft, !s.draft.is_empty()),
            );
            self.cached_tokens = all;
            let path = self.path.borrow();
            let buf = logits.buffer(self.vocab);
            for i in 0..=s.draft.len() {
                let token =
                    path.next(&self.cached_tokens[..s.context.len() + i], self.draft) as usize;
                let start = buf.len();
                buf.resize(start + self.vocab, 0.0);
                let prefix = &self.cached_tokens[..s.context.len() + i];
                buf[start + token] = if self.draft {
                    path.draft_logit(prefix, self.vocab)
                } else {
                    10.0
                };
            }
        }
        Ok(())
    }

    fn commit(&mut self, _seq: SeqId, committed: &[u32]) -> Result<(), Self::Error> {
        let keep = common(&self.cached_tokens, committed);
        self.cached_tokens.truncate(keep);
        Ok(())
    }

    fn release(&mut self, _seq: SeqId) {
        self.cached_tokens.clear();
    }

    fn cached(&self, _seq: SeqId, context: &[u32]) -> usize {
        common(&self.cached_tokens, context)
    }
}

enum Mode {
    Lookup(Box<LookupDrafter>),
    Model(Box<ModelDrafter<ReplayModel>>),
    Hybrid(Box<HybridDrafter<ModelDrafter<ReplayModel>>>),
}

/// A replayed prompt.
struct Line {
    id: String,
    category: String,
    decode: f64,
    e2e: f64,
    mean_len: f64,
    plain: f64,
    spent: f64,
    by_len: Vec<u64>,
    /// The cost model's predicted decoding speedup over the replayed one.
    pred: Option<f64>,
}

fn ids(v: &serde_json::Value, map: &mut HashMap<u64, u32>) -> Vec<u32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(serde_json::Value::as_u64)
                .map(|x| {
                    let next = map.len() as u32;
                    *map.entry(x).or_insert(next)
                })
                .collect()
        })
        .unwrap_or_default()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, bench, preds] = &args[..] else {
        return Err("usage: decode_replay BENCH.json PRED.jsonl".into());
    };
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(bench)?)?;
    let cal = &doc["calibration"];
    let r: Vec<f64> = cal["r"]
        .as_array()
        .ok_or("no calibrated r(m)")?
        .iter()
        .filter_map(serde_json::Value::as_f64)
        .collect();
    // Non-decreasing, as the CLI hands a calibration to the cost model.
    let r = isotonic_curve(&r, &[]);
    let c = cal["c"].as_f64().ok_or("no calibrated c")?;
    let target_step = cal["target_step_s"].as_f64().ok_or("no target step")?;
    let draft_read = cal["draft_read_s"].as_f64().ok_or("no draft read")? / target_step;
    let max_tokens = doc["max_tokens"].as_u64().unwrap_or(128) as usize;
    let costs = Costs {
        step: Duration::from_secs_f64(env_or("REPLAY_STEP_MS", 5.0) / 1e3),
        r: r.clone(),
        c,
        read: draft_read,
        prefill: env_or("REPLAY_PREFILL", 0.15),
    };

    // Token ids made dense over everything the prompts hold, so that logits rows are short.
    let mut map: HashMap<u64, u32> = HashMap::new();
    let mut paths = Vec::new();
    let mut stops = Vec::new();
    for line in std::fs::read_to_string(preds)?.lines() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)?;
        let prompt = ids(&v["prompt"], &mut map);
        let output = ids(&v["output"], &mut map);
        let pred = ids(&v["pred"], &mut map);
        // A probability that was not finite (written as null) keeps its place, as NaN.
        let conf: Vec<f32> = v["conf"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|x| x.as_f64().map_or(f32::NAN, |x| x as f32))
                    .collect()
            })
            .unwrap_or_default();
        stops = ids(&v["stop"], &mut map);
        let full: Vec<u32> = prompt.iter().chain(&output).copied().collect();
        paths.push((
            v["id"].as_str().unwrap_or("?").to_string(),
            v["category"].as_str().unwrap_or("?").to_string(),
            Path {
                prompt_len: prompt.len(),
                full,
                pred,
                conf,
                stop: 0,
                off: 0,
            },
        ));
    }
    let off = map.len() as u32;
    let vocab = map.len() + 1;
    let stop = *stops.first().ok_or("no stop token")?;
    // Shared, not copied: the replay models read the prompt being replayed through `current`.
    let paths: Vec<(String, String, Rc<Path>)> = paths
        .into_iter()
        .map(|(id, category, p)| (id, category, Rc::new(Path { stop, off, ..p })))
        .collect();

    let modes: Vec<String> = std::env::var("REPLAY_MODES")
        .unwrap_or_else(|_| "ngram,model,hybrid".into())
        .split(',')
        .map(str::to_string)
        .collect();
    let verbose = std::env::var_os("REPLAY_VERBOSE").is_some();
    let fixed: Option<usize> = std::env::var("REPLAY_FIXED")
        .ok()
        .and_then(|v| v.parse().ok());
    let current = Rc::new(RefCell::new(Rc::new(Path::default())));
    let model = |draft: bool| ReplayModel {
        path: current.clone(),
        draft,
        vocab,
        cached_tokens: Vec::new(),
        costs: costs.clone(),
    };
    for name in &modes {
        let mut mode = match name.as_str() {
            "ngram" => Mode::Lookup(Box::default()),
            "model" => Mode::Model(Box::new(ModelDrafter::new(model(true)))),
            "hybrid" => Mode::Hybrid(Box::new(HybridDrafter::new(
                LookupDrafter::default(),
                ModelDrafter::new(model(true)),
            ))),
            other => return Err(format!("unknown mode {other}").into()),
        };
        let mut target = model(false);
        let mut recent: Vec<(f64, f64)> = Vec::new();
        let mut lines = Vec::new();
        for (id, category, path) in &paths {
            let prompt_len = path.prompt_len;
            *current.borrow_mut() = path.clone();
            let prior = FixedCost {
                c,
                draft_fixed: 0.0,
                r: r.clone(),
                context: None,
                step_secs: Some(costs.step.as_secs_f64()),
                acceptance: acceptance_by_position(&recent),
                draft_read: Some(draft_read / c),
                draft_step_secs: Some(c * costs.step.as_secs_f64()),
            };
            let config = GenerateConfig {
                max_new_tokens: max_tokens,
                stop_tokens: stops.clone(),
                sampling: SamplingParams {
                    temperature: 0.0,
                    ..SamplingParams::default()
                },
                seed: 0,
                verify_mode: VerifyMode::Rejection,
                draft_len: match fixed {
                    Some(k) => DraftLenPolicy::Fixed { draft_len: k },
                    None => DraftLenPolicy::auto(Some(prior)),
                },
                min_confidence: env_or("REPLAY_MIN_CONFIDENCE", 0.0),
            };
            target.cached_tokens.clear();
            let prompt = &path.full[..prompt_len];
            let out = match &mut mode {
                Mode::Lookup(d) => generate(&mut target, d.as_mut(), prompt, &config, &mut |_| {
                    std::ops::ControlFlow::Continue(())
                }),
                Mode::Model(d) => {
                    d.model_mut().cached_tokens.clear();
                    generate(&mut target, d.as_mut(), prompt, &config, &mut |_| {
                        std::ops::ControlFlow::Continue(())
                    })
                }
                Mode::Hybrid(d) => {
                    d.model.model_mut().cached_tokens.clear();
                    generate(&mut target, d.as_mut(), prompt, &config, &mut |_| {
                        std::ops::ControlFlow::Continue(())
                    })
                }
            }
            .map_err(|e| format!("{id}: {e}"))?;
            let want = &path.full[prompt_len..];
            let n = out.tokens.len();
            if out.tokens[..] != want[..n.min(want.len())] {
                return Err(format!("{id}: the replay left the recorded answer").into());
            }
            let m = &out.metrics;
            // `bench`'s `RECENT_RUN_DECAY`.
            m.fold_model_positions(&mut recent, 0.5);
            let step = costs.step.as_secs_f64();
            // Plain decoding's steps after the first token: one a token, and one for a stop token.
            let stopped = matches!(out.stop_reason, Some(StopReason::StopToken(_)));
            let plain = (n.saturating_sub(1) + usize::from(stopped)) as f64;
            let prefill = prompt_len as f64 * costs.prefill;
            let line = Line {
                id: id.clone(),
                category: category.clone(),
                decode: plain / (m.decode_secs / step),
                e2e: (prefill + plain) / ((m.prefill_secs + m.decode_secs) / step),
                mean_len: m.mean_accepted_len(),
                plain,
                spent: m.decode_secs / step,
                by_len: m.rounds_by_draft_len.clone(),
                pred: m.predicted_speedup_with(Some(&r)),
            };
            let pred = line.pred.map_or(f64::NAN, |p| p / line.decode);
            if verbose {
                eprintln!(
                    "{name:7} {:24} {:5.2}x decoding {:5.2}x e2e, mean len {:.2}, {} rounds by draft length {:?}, draft {:.1} steps, prompt read {:.1} steps, pred/meas {pred:.2}",
                    line.id, line.decode, line.e2e, line.mean_len, m.rounds, m.rounds_by_draft_len, m.draft_secs / step, (m.prefill_secs - m.first_token_secs) / step
                );
            }
            lines.push(line);
        }
        let mut by: BTreeMap<&str, Vec<&Line>> = BTreeMap::new();
        for l in &lines {
            by.entry("all").or_default().push(l);
            by.entry(l.category.as_str()).or_default().push(l);
        }
        for (cat, ls) in by {
            let mut by_len = vec![0u64; 17];
            for l in &ls {
                for (k, &n) in l.by_len.iter().enumerate() {
                    by_len[k.min(16)] += n;
                }
            }
            while by_len.len() > 1 && by_len.last() == Some(&0) {
                by_len.pop();
            }
            let ratios: Vec<f64> = ls
                .iter()
                .filter_map(|l| l.pred.map(|p| p / l.decode))
                .collect();
            let within = ratios.iter().filter(|q| (*q - 1.0).abs() <= 0.1).count();
            println!(
                "{name:7} {cat:10} {:3} prompts  {:5.3}x decoding (median; {:5.3}x in all)  {:5.3}x e2e  mean len {:.2}  pred/meas {:.2}, {within} within 10%  rounds by draft length {by_len:?}",
                ls.len(),
                median(ls.iter().map(|l| l.decode).collect()),
                ls.iter().map(|l| l.plain).sum::<f64>() / ls.iter().map(|l| l.spent).sum::<f64>(),
                median(ls.iter().map(|l| l.e2e).collect()),
                ls.iter().map(|l| l.mean_len).sum::<f64>() / ls.len() as f64,
                median(ratios),
            );
        }
    }
    Ok(())
}
