//! The cost model's calibration, measured once per (target file, draft file, CPU model, threads) and
//! kept under `$SPECDEC_HOME/calibration/`, so that `--draft-len auto` starts calibrated instead of
//! warming up; the cost model keeps measuring online and replaces it as samples come in, and each
//! generation's own block timings are folded back into the saved curve ([`Calibration::learn`]), so
//! that the next run starts from what runs cost, not only from what the calibration's isolated
//! blocks cost.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use specdec_core::{isotonic_curve, ContextCost, DraftCost, DraftLenPolicy, FixedCost, Metrics};
use specdec_runtime::fetch::home;
use specdec_runtime::{Device, Session};

use crate::bench::median;
use crate::engine::{Loaded, Ui};

/// Measured costs: `r[m - 1] = t(m) / t(1)` for the target and the draft's step cost over `t(1)`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Calibration {
    /// Seconds of one target step on one token.
    pub target_step_s: f64,
    /// Seconds of one draft step on one token.
    pub draft_step_s: Option<f64>,
    /// `c`.
    pub c: Option<f64>,
    /// Seconds of the draft model reading one prompt token, in a block of [`READ_BLOCK`] tokens
    /// (`None` without a draft, where the context size leaves no room for the block, or in files
    /// written before stop 52).
    #[serde(default)]
    pub draft_read_s: Option<f64>,
    /// `r(m)` for `m = 1..=16`.
    pub r: Vec<f64>,
    /// How the target's costs grow with context, from blocks timed after [`LONG_CONTEXT`] tokens;
    /// `None` where the context size leaves no room for them (or in files written before stop 30).
    #[serde(default)]
    pub context: Option<ContextCost>,
    /// The context the blocks for `context` were timed after; `None` where they were not timed.
    #[serde(default)]
    pub long_context: Option<usize>,
    /// Timed calls behind each `r(m)` (index `m - 1`); empty as measured, which counts
    /// [`MEASURED_WEIGHT`] each ([`Calibration::learn`]).
    #[serde(default)]
    pub weights: Vec<f64>,
    /// Timed target blocks of generations folded into `r` since it was measured.
    #[serde(default)]
    pub learned_blocks: u64,
    /// The mean single step of the last generation that timed enough of them, moved to the
    /// calibration's context, and when it was learned ([`Calibration::learn`]): what a step costs
    /// on the machine now, which the next generation of the same process prices its first blocks
    /// against ([`FixedCost::step_secs`]) while it is at most [`RECENT_STEP_MAX_AGE`] old. Never
    /// saved: a later process may find the machine in another stretch.
    #[serde(skip)]
    pub recent_step: Option<(f64, Instant)>,
    /// The model's drafts in the generations learned lately: by position, `(reached, accepted)`
    /// counts, each run's weighing [`RECENT_RUN_DECAY`] times the one after it; what
    /// [`Calibration::recent_acceptance`] reads. Never saved, like `recent_step`.
    #[serde(skip)]
    pub recent_positions: Vec<(f64, f64)>,
    /// The draft model's cost as the last generation that timed at least [`MIN_DRAFT_ROUNDS`]
    /// drafting rounds measured it ([`Metrics::draft_cost`]), and when it was learned: while it
    /// is at most [`RECENT_STEP_MAX_AGE`] old, the next generation of the process prices the
    /// draft by it ([`FixedCost::draft_step_secs`], [`FixedCost::draft_fixed`]) instead of by the
    /// calibration's isolated steps, which one slow stretch of the machine can put far off (stop
    /// 70: a calibration's draft step of 9.1 ms where the others of the session read 5.5 and 6.3
    /// priced every prompt reading of a benchmark 44–65% too high). Never saved, like
    /// `recent_step`.
    #[serde(skip)]
    pub recent_draft_cost: Option<(DraftCost, Instant)>,
}

/// Drafting rounds a generation must have timed for its draft cost to price the next one's
/// ([`Calibration::recent_draft_cost`]).
pub const MIN_DRAFT_ROUNDS: u64 = 4;

/// The range, as multiples of the calibrated draft step, of a run's cost per drafted token that
/// [`Calibration::learn_draft`] takes for a measure (stop 70's runs: 0.9–1.5 times the step).
pub const DRAFT_COST_BAND: (f64, f64) = (0.5, 2.0);

/// The weight of a run's model-draft counts in [`Calibration::recent_positions`] against the next
/// run's: the acceptance seen lately follows the last two or three runs (in a benchmark, a mode's
/// own last two or three runs, of the prompts before, mostly of the same kind).
pub const RECENT_RUN_DECAY: f64 = 0.5;

/// How long [`Calibration::recent_step`] is the next generation's unit: these machines' memory
/// switches between slow and fast stretches within minutes, so a step timed longer ago (a chat
/// turn after a pause) may belong to the other kind.
pub const RECENT_STEP_MAX_AGE: Duration = Duration::from_secs(60);

/// Timed calls a measured `r(m)` counts as when a run's blocks are folded in: the calibration's
/// medians are steady, but blocks timed in isolation cost less than blocks in a generation (stop
/// 36's benchmark: 2–5% more in the runs at every length from 2 to 8, at every context, against
/// the same runs' single steps), so a few runs should outweigh it.
pub const MEASURED_WEIGHT: f64 = 16.0;

/// The most timed calls a learned `r(m)` keeps behind it, so that it follows a drifting machine.
pub const MAX_LEARNED_WEIGHT: f64 = 256.0;

/// Single-token steps a run must have timed for its blocks to count: they are its unit.
pub const MIN_SINGLE_STEPS: u64 = 4;

impl Calibration {
    /// Folds a generation's timed target blocks into `r`: a block of `m` tokens timed `calls` times
    /// after about `n` tokens of context gives `r_n(m)`, its mean time over the run's mean single
    /// step, which [`ContextCost`] moves back to the calibration's context (the inverse of
    /// [`FixedCost::at_context`]); `r(m)` becomes the weighted mean of the two, the run counting
    /// `min(calls, single steps)` calls and the curve its [`Calibration::weights`] (at most
    /// [`MAX_LEARNED_WEIGHT`]). A run that timed fewer than [`MIN_SINGLE_STEPS`] single steps has
    /// no unit and teaches the curve nothing. The timings must be the run's own: a sequence batched
    /// with others shares its calls' time (the CLI's runs are single sequences; `serve` does not
    /// learn). Returns whether `r` changed (what is saved).
    ///
    /// What the run saw is also kept for the next run of the process, never saved: its mean single
    /// step, moved to the calibration's context, as [`Calibration::recent_step`] (where it timed
    /// [`MIN_SINGLE_STEPS`]), its model drafts' acceptance by position, timed or not, in
    /// [`Calibration::recent_positions`], and the draft cost its cost model measured, as
    /// [`Calibration::recent_draft_cost`] (where it timed [`MIN_DRAFT_ROUNDS`]).
    pub fn learn(&mut self, m: &Metrics) -> bool {
        self.learn_positions(m);
        self.learn_costs(m)
    }

    /// The run's draft cost into [`Calibration::recent_draft_cost`], where it timed at least
    /// [`MIN_DRAFT_ROUNDS`] drafting rounds and the line is a cost (finite, not negative) whose
    /// cost per token lies within [`DRAFT_COST_BAND`] of the calibrated step, where there is one
    /// (a line through a few rounds of two close lengths is a difference of medians: a slope far
    /// from any step is noise, not the machine).
    pub(crate) fn learn_draft(&mut self, m: &Metrics) {
        let Some(d) = m.draft_cost else {
            return;
        };
        let (low, high) = DRAFT_COST_BAND;
        let valid = d.rounds >= MIN_DRAFT_ROUNDS
            && d.fixed_secs.is_finite()
            && d.fixed_secs >= 0.0
            && d.per_token_secs.is_finite()
            && d.per_token_secs > 0.0
            && self
                .draft_step_s
                .is_none_or(|s| (low * s..=high * s).contains(&d.per_token_secs));
        if valid {
            self.recent_draft_cost = Some((d, Instant::now()));
        }
    }

    /// The model-draft counts of `m` into [`Calibration::recent_positions`].
    fn learn_positions(&mut self, m: &Metrics) {
        fold_positions(&mut self.recent_positions, m);
    }

    /// Conditional acceptance of the model's drafts by position in the runs learned lately: each
    /// position's counts behind one pseudo-round of the position before (of
    /// [`specdec_core::PRIOR_ACCEPTANCE`] at the first), up to the last position a run reached.
    pub fn recent_acceptance(&self) -> Vec<f64> {
        specdec_core::acceptance_by_position(&self.recent_positions)
    }

    /// The run's mean single step into [`Calibration::recent_step`] (moved to the calibration's
    /// context), where it timed at least [`MIN_SINGLE_STEPS`]: that step, its count and the run's
    /// mean context.
    fn learn_step(&mut self, m: &Metrics) -> Option<(f64, u64, f64)> {
        let (t1, calls) = m.single_steps().filter(|s| s.1 >= MIN_SINGLE_STEPS)?;
        let n = m.prompt_tokens as f64 + m.emitted as f64 / 2.0;
        let step = t1 / self.context.map_or(1.0, |cc| cc.step_at(n));
        if step.is_finite() && step > 0.0 {
            self.recent_step = Some((step, Instant::now()));
        }
        Some((t1, calls, n))
    }

    /// The curve's part of [`Calibration::learn`], the recent step and the recent draft cost.
    pub(crate) fn learn_costs(&mut self, m: &Metrics) -> bool {
        self.learn_draft(m);
        let Some((t1, singles, n)) = self.learn_step(m) else {
            return false;
        };
        let mut changed = false;
        if self.weights.len() != self.r.len() {
            self.weights = vec![MEASURED_WEIGHT; self.r.len()];
        }
        for t in &m.verify_by_len {
            if t.m < 2 || t.m > self.r.len() || t.calls == 0 || t.secs <= 0.0 {
                continue;
            }
            let at_n = t.secs / t.calls as f64 / t1;
            let r_at = self
                .context
                .map_or(at_n, |cc| cc.to_calibration_context(t.m, n, at_n));
            if !r_at.is_finite() || r_at <= 0.0 {
                continue;
            }
            let (i, calls) = (t.m - 1, t.calls.min(singles) as f64);
            let w = self.weights[i];
            self.r[i] = (w * self.r[i] + calls * r_at) / (w + calls);
            self.weights[i] = (w + calls).min(MAX_LEARNED_WEIGHT);
            self.learned_blocks = self.learned_blocks.saturating_add(t.calls);
            changed = true;
        }
        changed
    }

    /// This calibration as the prior of a cost-model `policy` that has one or none (a policy
    /// with given costs, or another policy, is left as it is).
    pub fn set_prior(&self, policy: &mut DraftLenPolicy) {
        if let DraftLenPolicy::CostModel {
            prior, cost: None, ..
        } = policy
        {
            if let Some(p) = as_prior(self) {
                *prior = Some(p);
            }
        }
    }
}

/// Folds the model-draft counts of `m` into `positions` (a run's
/// [`Calibration::recent_positions`]), the counts before weighing [`RECENT_RUN_DECAY`]; a run
/// whose model drafted nothing leaves them as they are.
fn fold_positions(positions: &mut Vec<(f64, f64)>, m: &Metrics) {
    m.fold_model_positions(positions, RECENT_RUN_DECAY);
}

/// The model-draft counts ([`Calibration::recent_positions`]) kept per drafter kind, so that a
/// run starts from the acceptance the runs of its own kind saw lately: `bench` keeps them per
/// mode (until stop 62 its modes shared one record, so a mode started each prompt from what the
/// mode run just before it had seen on that same prompt, which a drafter running alone cannot
/// know), the server's [`Learning`] per request kind (a hybrid calls its model only in the rounds
/// the lookup has nothing for, which may fare otherwise than a model drafter's drafts in all of
/// its rounds).
#[derive(Clone, Debug)]
pub struct PositionsByKind<K> {
    kinds: Vec<(K, Vec<(f64, f64)>)>,
}

impl<K> Default for PositionsByKind<K> {
    fn default() -> Self {
        Self { kinds: Vec::new() }
    }
}

impl<K: Copy + PartialEq> PositionsByKind<K> {
    /// The counts the runs of `kind` taught.
    fn of(&self, kind: K) -> &[(f64, f64)] {
        self.kinds
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or(&[], |(_, p)| p.as_slice())
    }

    /// `cal` as the prior of a run of `kind` ([`Calibration::set_prior`]), with the acceptance
    /// the runs of `kind` saw in place of its own.
    pub fn prime(&self, kind: K, cal: &Calibration, policy: &mut DraftLenPolicy) {
        let mut cal = cal.clone();
        cal.recent_positions = self.of(kind).to_vec();
        cal.set_prior(policy);
    }

    /// A run of `kind` ended after `m`: its model drafts are folded into the kind's counts.
    pub fn learn(&mut self, kind: K, m: &Metrics) {
        match self.kinds.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, p)) => fold_positions(p, m),
            None => {
                let mut p = Vec::new();
                fold_positions(&mut p, m);
                self.kinds.push((kind, p));
            }
        }
    }
}

/// Repetitions of each timing in [`measure`].
const SWEEPS: usize = 5;

/// The context after which [`measure`] times blocks again, to see how costs grow with context.
pub const LONG_CONTEXT: usize = 1024;

/// The block lengths timed after [`LONG_CONTEXT`] tokens.
const LONG_BLOCKS: [usize; 4] = [1, 4, 8, 16];

/// The block [`measure`] times the draft model reading as a prompt ([`Calibration::draft_read_s`]),
/// in tokens (a prompt is read in chunks of up to [`specdec_runtime::session::PREFILL_CHUNK`],
/// 256; a shorter block prices the reading a little high).
const READ_BLOCK: usize = 128;

/// The context `generate` and `chat` calibrate after, in tokens.
const CALIBRATION_CONTEXT: usize = 64;

/// Repetitions of the draft's prompt read in [`measure`].
const READ_SWEEPS: u32 = 3;

/// What is saved: the calibration and what it was measured on.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Saved {
    target: String,
    draft: Option<String>,
    cpu: String,
    threads: usize,
    kernels: String,
    calibration: Calibration,
}

/// Times the target on blocks of 1..=16 tokens after `context`, the draft on single tokens and on
/// reading a prompt of [`READ_BLOCK`] tokens:
/// medians of [`SWEEPS`] repetitions (three single target steps per repetition, which every ratio
/// is divided by). The repetitions are sweeps over all lengths, so that a
/// disturbance of the machine (another tenant, a frequency change) spoils one sample of several
/// lengths instead of all samples of one. Where the context size allows, each sweep also times
/// blocks of [`LONG_BLOCKS`] tokens in a second target session [`LONG_CONTEXT`] tokens long (at
/// least half of it past `context`), which gives [`ContextCost`].
pub fn measure(loaded: &Loaded, context: &[u32]) -> Result<Calibration> {
    let vocab = loaded.target.config().vocab.max(1) as u32;
    let time_block = |s: &mut Session, base: usize, m: usize, rep: u32| -> Result<f64> {
        s.rollback(base)?;
        let block: Vec<u32> = (0..m as u32)
            .map(|i| (100 + 7 * i + rep) % 1000 % vocab)
            .collect();
        let start = Instant::now();
        s.feed(&block, m)?;
        Ok(start.elapsed().as_secs_f64())
    };
    let at = context.len();
    let mut s = loaded.target_session();
    s.feed(context, 1)?;
    // A second session `long - at` tokens further on, timed in the same sweeps, so that a change in
    // the machine's speed weighs on both alike.
    let long = LONG_CONTEXT.max(at + LONG_CONTEXT / 2);
    let mut far = if long + 16 <= loaded.ctx {
        let mut far = loaded.target_session();
        let filler: Vec<u32> = (0..(long - at) as u32)
            .map(|i| (300 + 11 * i) % 4000 % vocab)
            .collect();
        far.feed(context, 1)?;
        far.feed(&filler, 1)?;
        Some(far)
    } else {
        None
    };
    let mut samples: Vec<Vec<f64>> = (0..16).map(|_| Vec::with_capacity(SWEEPS)).collect();
    let mut far_samples: Vec<Vec<f64>> = LONG_BLOCKS.iter().map(|_| Vec::new()).collect();
    for rep in 0..SWEEPS as u32 {
        for m in 1..=16 {
            samples[m - 1].push(time_block(&mut s, at, m, rep)?);
            // Single steps also mid-sweep and at its end: every ratio is divided by their median,
            // so a slow moment during the few single steps spoils the whole curve (one
            // calibration read t(1) 19% above the others and r(8) 1.62 where most read 1.9).
            if m == 8 || m == 16 {
                samples[0].push(time_block(&mut s, at, 1, rep)?);
            }
        }
        if let Some(far) = far.as_mut() {
            for (&m, t) in LONG_BLOCKS.iter().zip(far_samples.iter_mut()) {
                t.push(time_block(far, long, m, rep)?);
            }
        }
    }
    let times: Vec<f64> = samples.iter_mut().map(|t| median(t)).collect();
    let t1 = times[0];
    let r: Vec<f64> = times.iter().map(|t| t / t1).collect();
    let context_cost = far.as_ref().and_then(|_| {
        let timed: Vec<(usize, f64)> = LONG_BLOCKS
            .iter()
            .zip(far_samples.iter_mut())
            .map(|(&m, t)| (m, median(t) / t1))
            .collect();
        // Against the medians at the same lengths, not the smoothed curve.
        ContextCost::fit(at, long, &r, &timed)
    });
    drop(far);
    let (draft_step_s, draft_read_s) = match &loaded.draft {
        Some(d) => {
            let mut ds = Session::new(d.clone(), loaded.ctx);
            ds.feed(context, 1)?;
            let mut t = Vec::new();
            for rep in 0..3 * SWEEPS as u32 {
                t.push(time_block(&mut ds, at, 1, rep)?);
            }
            // Reading a prompt: a block of tokens with the logits of its last alone.
            let mut read = Vec::new();
            if at + READ_BLOCK <= loaded.ctx {
                for rep in 0..READ_SWEEPS {
                    ds.rollback(at)?;
                    let block: Vec<u32> = (0..READ_BLOCK as u32)
                        .map(|i| (500 + 13 * i + rep) % 4000 % vocab)
                        .collect();
                    let start = Instant::now();
                    ds.feed(&block, 1)?;
                    read.push(start.elapsed().as_secs_f64() / READ_BLOCK as f64);
                }
            }
            (
                Some(median(&mut t)),
                (!read.is_empty()).then(|| median(&mut read)),
            )
        }
        None => (None, None),
    };
    Ok(Calibration {
        target_step_s: t1,
        draft_step_s,
        c: draft_step_s.map(|d| d / t1),
        draft_read_s,
        r,
        context: context_cost,
        long_context: (long + 16 <= loaded.ctx).then_some(long),
        weights: Vec::new(),
        learned_blocks: 0,
        recent_step: None,
        recent_draft_cost: None,
        recent_positions: Vec::new(),
    })
}

/// This CPU's model name, from `/proc/cpuinfo` where there is one.
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

fn file_key(path: &Path) -> String {
    let size = std::fs::metadata(path).map_or(0, |m| m.len());
    let stem = path
        .file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    format!("{stem}-{size}")
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Where the calibration of these models on this machine and kernels lives (the kernel level and
/// [`specdec_kernels::REVISION`]); `draft` is the file and how it was prepared at load
/// ([`crate::engine::draft_variant`]).
/// On a GPU the threads and the CPU's kernels do not enter the costs; the device does.
pub fn path(
    target: &Path,
    draft: Option<(&Path, &str)>,
    threads: usize,
    device: Device,
) -> PathBuf {
    let runs_on = match device {
        Device::Cpu => format!(
            "{}t__{}-r{}",
            threads,
            specdec_kernels::Kernels::get().level().name(),
            specdec_kernels::REVISION
        ),
        Device::Cuda(n) => format!("cuda{n}-r{}", specdec_kernels::REVISION),
    };
    let name = format!(
        "{}__{}__{}__{runs_on}.json",
        file_key(target),
        draft.map_or_else(|| "none".into(), |(p, v)| format!("{}-{v}", file_key(p))),
        cpu_model(),
    );
    home().join("calibration").join(sanitize(&name))
}

fn saved_path(loaded: &Loaded) -> PathBuf {
    path(
        &loaded.target_path,
        loaded
            .draft_path
            .as_deref()
            .map(|p| (p, loaded.draft_variant.as_str())),
        loaded.threads,
        loaded.device,
    )
}

/// Saves a calibration of `loaded`.
pub fn save(loaded: &Loaded, cal: &Calibration) -> Result<PathBuf> {
    let p = saved_path(loaded);
    if let Some(dir) = p.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let saved = Saved {
        target: loaded.target_path.display().to_string(),
        draft: loaded.draft_path.as_ref().map(|p| p.display().to_string()),
        cpu: cpu_model(),
        threads: loaded.threads,
        kernels: format!(
            "{}-r{}",
            specdec_kernels::Kernels::get().level().name(),
            specdec_kernels::REVISION
        ),
        calibration: cal.clone(),
    };
    // Every run now writes it (`learn_saved`): a temporary file per process, renamed into place.
    let tmp = p.with_extension(format!("partial-{}", std::process::id()));
    std::fs::write(&tmp, serde_json::to_string_pretty(&saved)?)
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &p).with_context(|| format!("writing {}", p.display()))?;
    Ok(p)
}

/// The saved calibration at `path` as a cost-model prior; `None` if there is none or it is unreadable.
pub fn load_path(path: &Path) -> Option<FixedCost> {
    read(path).and_then(|cal| as_prior(&cal))
}

/// The saved calibration at `path`; `None` if there is none or it is unreadable.
pub fn load(path: &Path) -> Option<Calibration> {
    read(path)
}

/// A calibration that learns across a server's requests ([`specdec_server::Learner`]): each
/// finished request's model-draft acceptance, and its single step and draft cost where it decoded
/// alone, become what the next request's cost model starts from
/// ([`Calibration::recent_acceptance`], [`Calibration::recent_step`],
/// [`Calibration::recent_draft_cost`]), the acceptance per drafter kind ([`PositionsByKind`]). Not the
/// curve: stop 49 measured a server that also folded the requests' blocks into `r` 1.5% slower
/// end to end. In memory only: the saved file is `generate`'s and `bench`'s to update.
#[derive(Debug)]
pub struct Learning {
    /// The calibration, whose [`Calibration::recent_positions`] stay empty: the counts are
    /// kept per kind.
    pub calibration: Calibration,
    positions: PositionsByKind<specdec_server::DrafterKind>,
}

impl Learning {
    /// Learns from requests, starting from `calibration`.
    pub fn new(calibration: Calibration) -> Self {
        Self {
            calibration,
            positions: PositionsByKind::default(),
        }
    }
}

impl specdec_server::Learner for Learning {
    fn learn(&mut self, drafter: specdec_server::DrafterKind, metrics: &Metrics, alone: bool) {
        self.positions.learn(drafter, metrics);
        if alone {
            self.calibration.learn_step(metrics);
            self.calibration.learn_draft(metrics);
        }
    }

    fn prime(&self, drafter: specdec_server::DrafterKind, policy: &mut DraftLenPolicy) {
        self.positions.prime(drafter, &self.calibration, policy);
    }
}

/// Folds a finished generation of `loaded` into its saved calibration ([`Calibration::learn`]), if
/// there is one, saves it where its curve changed and returns it; a failure to write it is
/// reported, never fatal (the run's output is complete). `recent`, the calibration an earlier
/// generation of this process returned, carries what was seen lately (never saved) into it.
pub fn learn_saved(
    loaded: &Loaded,
    m: &Metrics,
    recent: Option<&Calibration>,
    ui: Ui,
) -> Option<Calibration> {
    let mut cal = read(&saved_path(loaded))?;
    if let Some(r) = recent {
        cal.recent_step = r.recent_step;
        cal.recent_draft_cost = r.recent_draft_cost;
        cal.recent_positions.clone_from(&r.recent_positions);
    }
    if cal.learn(m) {
        if let Err(e) = save(loaded, &cal) {
            ui.note(format!("cost model: calibration not updated: {e:#}"));
        }
    }
    Some(cal)
}

/// The calibration saved at `path`, if there is a readable one.
fn read(path: &Path) -> Option<Calibration> {
    let text = std::fs::read_to_string(path).ok()?;
    let saved: Saved = serde_json::from_str(&text).ok()?;
    Some(saved.calibration)
}

/// A calibration as a cost-model prior; `None` if it is not a valid one.
pub fn as_prior(cal: &Calibration) -> Option<FixedCost> {
    let step_secs = cal
        .recent_step
        .filter(|(_, at)| at.elapsed() <= RECENT_STEP_MAX_AGE)
        .map(|(secs, _)| secs);
    // The draft as a generation of this process measured it lately, where one did: its cost per
    // token in place of the calibration's step, its fixed cost per round in target steps. The
    // prompt reading keeps its calibrated proportion to a step (`draft_read`, in draft steps), so
    // its price follows the draft's cost now too.
    let recent_draft_cost = cal
        .recent_draft_cost
        .filter(|(_, at)| at.elapsed() <= RECENT_STEP_MAX_AGE)
        .map(|(d, _)| d);
    let unit = step_secs.unwrap_or(cal.target_step_s);
    let (c, draft_fixed, draft_step_secs) = match recent_draft_cost {
        Some(d) if unit > 0.0 => (
            d.per_token_secs / unit,
            d.fixed_secs / unit,
            Some(d.per_token_secs),
        ),
        _ => (cal.c.unwrap_or(0.0), 0.0, cal.draft_step_s),
    };
    // The file keeps the medians as measured; the cost model reads them as a non-decreasing curve.
    let cost = FixedCost {
        c,
        draft_fixed,
        r: isotonic_curve(&cal.r, &[]),
        context: cal.context,
        step_secs,
        acceptance: cal.recent_acceptance(),
        draft_read: cal
            .draft_read_s
            .zip(cal.draft_step_s)
            .filter(|&(_, step)| step > 0.0)
            .map(|(read, step)| read / step),
        draft_step_secs,
    };
    let policy = DraftLenPolicy::auto(Some(cost.clone()));
    policy.validate().ok()?;
    Some(cost)
}

/// Gives a cost-model policy without a prior the saved calibration of `loaded`, measuring and saving
/// one first (about ten seconds, once per models, CPU and thread count) when `measure_if_missing`.
pub fn apply(
    policy: &mut DraftLenPolicy,
    loaded: &Loaded,
    measure_if_missing: bool,
    ui: Ui,
) -> Result<()> {
    let DraftLenPolicy::CostModel { prior, cost, .. } = policy else {
        return Ok(());
    };
    if prior.is_some() || cost.is_some() {
        return Ok(());
    }
    let p = saved_path(loaded);
    let saved = read(&p);
    // A calibration that did not time blocks after a long context (written before stop 30, or with
    // a context size too small for it) is measured again where this run's context allows and
    // measuring is allowed, as is one with a draft model that did not time its reading of a
    // prompt (written before stop 52); else it serves as it is.
    let stale = saved.as_ref().is_some_and(|s| {
        (s.long_context.is_none() && loaded.ctx >= LONG_CONTEXT + 16)
            || (s.draft_read_s.is_none()
                && s.draft_step_s.is_some()
                && loaded.ctx >= CALIBRATION_CONTEXT + READ_BLOCK)
    }) && measure_if_missing;
    if let Some(saved) = saved.filter(|_| !stale).as_ref().and_then(as_prior) {
        ui.note(format!("cost model: calibration from {}", p.display()));
        *prior = Some(saved);
        return Ok(());
    }
    if !measure_if_missing {
        return Ok(());
    }
    // 64 tokens of context and blocks of up to 16; a smaller context is not worth calibrating.
    if loaded.ctx < 128 {
        return Ok(());
    }
    ui.note("cost model: calibrating once for these models on this machine (about ten seconds)");
    let vocab = loaded.target.config().vocab.max(1) as u32;
    let context: Vec<u32> = (0..CALIBRATION_CONTEXT as u32)
        .map(|i| (100 + 13 * i) % vocab)
        .collect();
    // Without a calibration the cost model measures online from a short warm-up: a failure here
    // costs speed at the start, never the run.
    match measure(loaded, &context).and_then(|cal| save(loaded, &cal)) {
        Ok(p) => {
            ui.note(format!("cost model: calibration saved to {}", p.display()));
            *prior = load_path(&p);
        }
        Err(e) => ui.note(format!("cost model: calibration skipped: {e:#}")),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use specdec_core::metrics::{PositionStats, VerifyTiming};
    use specdec_core::PRIOR_ACCEPTANCE;
    use specdec_server::DrafterKind;

    /// Attention costs of the size stop 30 calibrated on the default pair.
    fn context_cost() -> ContextCost {
        ContextCost {
            at: 64,
            shared: 2e-4,
            per_row: 4e-5,
        }
    }

    fn calibration(context: Option<ContextCost>) -> Calibration {
        Calibration {
            target_step_s: 0.04,
            draft_step_s: Some(0.01),
            c: Some(0.25),
            draft_read_s: Some(0.002),
            r: (0..16).map(|i| 1.0 + 0.1 * i as f64).collect(),
            context,
            long_context: None,
            weights: Vec::new(),
            learned_blocks: 0,
            recent_step: None,
            recent_draft_cost: None,
            recent_positions: Vec::new(),
        }
    }

    /// A run that timed `calls` blocks of each length in `blocks` and `singles` single steps, each
    /// costing `t(m) = r(m) · t1` seconds.
    fn run(prompt: usize, singles: u64, blocks: &[(usize, u64, f64)]) -> Metrics {
        let t1 = 0.05;
        let mut verify = vec![VerifyTiming {
            m: 1,
            calls: singles,
            secs: singles as f64 * t1,
        }];
        for &(m, calls, r) in blocks {
            verify.resize(m, VerifyTiming::default());
            verify[m - 1] = VerifyTiming {
                m,
                calls,
                secs: calls as f64 * r * t1,
            };
        }
        Metrics {
            prompt_tokens: prompt,
            emitted: 100,
            verify_by_len: verify,
            ..Metrics::default()
        }
    }

    #[test]
    fn a_runs_blocks_move_the_curve_by_their_weight() {
        let mut cal = calibration(None);
        // r(2) is 1.1; 10 blocks at 1.3 against 12 single steps count 10 calls against 16.
        assert!(cal.learn(&run(50, 12, &[(2, 10, 1.3)])));
        let want = (16.0 * 1.1 + 10.0 * 1.3) / 26.0;
        assert!((cal.r[1] - want).abs() < 1e-12, "{}", cal.r[1]);
        assert_eq!(cal.weights[1], 26.0);
        assert_eq!(cal.weights[2], MEASURED_WEIGHT);
        assert_eq!(cal.r[2], 1.2);
        assert_eq!(cal.learned_blocks, 10);
        // Fewer single steps than blocks bound the run's weight: 4 calls, not 10.
        let before = cal.r[1];
        let mut fewer = cal.clone();
        assert!(fewer.learn(&run(50, MIN_SINGLE_STEPS, &[(2, 10, 2.0)])));
        let w = MIN_SINGLE_STEPS as f64;
        assert!((fewer.r[1] - (26.0 * before + w * 2.0) / (26.0 + w)).abs() < 1e-12);
        // Without enough single steps a run has no unit and teaches the curve nothing; nor does
        // plain decoding (no blocks).
        assert!(!cal.learn(&run(50, MIN_SINGLE_STEPS - 1, &[(2, 10, 2.0)])));
        assert!(!cal.learn(&run(50, 40, &[])));
        assert_eq!(cal.r[1], before);
        // The weight is capped, so that later runs still count.
        for _ in 0..100 {
            cal.learn(&run(50, 40, &[(2, 40, 1.3)]));
        }
        assert_eq!(cal.weights[1], MAX_LEARNED_WEIGHT);
        assert!((cal.r[1] - 1.3).abs() < 1e-6);
    }

    #[test]
    fn blocks_after_a_longer_context_are_moved_back_to_the_calibrations() {
        let cc = context_cost();
        let mut cal = calibration(Some(cc));
        let prior = as_prior(&cal).expect("a valid calibration");
        // A run whose blocks cost exactly what the calibration predicts at its context (prompt 550
        // plus half of 100 emitted tokens: 600) leaves the curve where it was.
        let at = prior.at_context(600);
        let blocks: Vec<(usize, u64, f64)> = (2..=16).map(|m| (m, 8, at.r(m))).collect();
        assert!(cal.learn(&run(550, 20, &blocks)));
        for m in 1..=16 {
            assert!(
                (cal.r[m - 1] - prior.r(m)).abs() < 1e-9,
                "r({m}) {}",
                cal.r[m - 1]
            );
        }
        // Blocks 5% dearer there move every length up.
        let dearer: Vec<(usize, u64, f64)> =
            blocks.iter().map(|&(m, c, r)| (m, c, 1.05 * r)).collect();
        assert!(cal.learn(&run(550, 20, &dearer)));
        assert!((2..=16).all(|m| cal.r[m - 1] > prior.r(m)));
    }

    /// Every run that timed enough single steps leaves its step, moved to the calibration's
    /// context, for the next run's cost model; it is never saved.
    #[test]
    fn a_runs_step_is_the_next_runs_unit() {
        let cc = context_cost();
        let mut cal = calibration(Some(cc));
        let mut policy = DraftLenPolicy::auto(None);
        cal.set_prior(&mut policy);
        assert_eq!(policy.calibration().and_then(|p| p.step_secs), None);
        // Plain decoding (no blocks) teaches the step, not the curve: 0.05 s at context 550 +
        // 100 / 2.
        assert!(!cal.learn(&run(550, 40, &[])));
        let want = 0.05 / cc.step_at(600.0);
        let (step, _) = cal.recent_step.unwrap();
        assert!((step - want).abs() < 1e-12, "{step}");
        assert!(want < 0.05);
        cal.set_prior(&mut policy);
        let prior = policy.calibration().expect("a prior");
        assert_eq!(prior.step_secs, Some(step));
        // Moved to the context of the run's next round, it is that run's single step again.
        let there = prior.at_context(600).step_secs.unwrap();
        assert!((there - 0.05).abs() < 1e-12, "{there}");
        // Too few single steps leave it.
        cal.learn(&run(50, MIN_SINGLE_STEPS - 1, &[]));
        assert_eq!(cal.recent_step.map(|(s, _)| s), Some(step));
        // Older than RECENT_STEP_MAX_AGE, it is no unit.
        let then = Instant::now().checked_sub(RECENT_STEP_MAX_AGE + Duration::from_secs(1));
        if let Some(then) = then {
            cal.recent_step = Some((step, then));
            cal.set_prior(&mut policy);
            assert_eq!(policy.calibration().and_then(|p| p.step_secs), None);
        }
        // The saved form has none.
        let text = serde_json::to_string(&cal).unwrap();
        let back: Calibration = serde_json::from_str(&text).unwrap();
        assert!(back.recent_step.is_none());
        assert!(!text.contains("recent"));
    }

    /// A run that timed enough drafting rounds leaves its draft cost for the next run's cost model,
    /// in place of the calibration's step (which priced the prompt reading too); too few rounds,
    /// a line that is no cost, or one older than [`RECENT_STEP_MAX_AGE`] leave the calibration's.
    /// It is never saved.
    #[test]
    fn a_runs_draft_cost_prices_the_next_runs_draft() {
        let mut cal = calibration(None);
        let mut policy = DraftLenPolicy::auto(None);
        cal.set_prior(&mut policy);
        let calibrated = policy.calibration().cloned().expect("a prior");
        assert_eq!(calibrated.draft_step_secs, Some(0.01));
        assert_eq!(calibrated.draft_fixed, 0.0);
        let drafted = |fixed_secs: f64, per_token_secs: f64, rounds: u64| Metrics {
            draft_cost: Some(DraftCost {
                fixed_secs,
                per_token_secs,
                rounds,
            }),
            ..Metrics::default()
        };
        // A run without single steps still teaches the draft's cost (it teaches no curve).
        assert!(!cal.learn(&drafted(0.002, 0.006, MIN_DRAFT_ROUNDS)));
        cal.set_prior(&mut policy);
        let prior = policy.calibration().cloned().expect("a prior");
        assert_eq!(prior.draft_step_secs, Some(0.006));
        // In target steps of the calibration's 0.04 s.
        assert!(
            (prior.draft_fixed - 0.05).abs() < 1e-12,
            "{}",
            prior.draft_fixed
        );
        assert!((prior.c - 0.15).abs() < 1e-12, "{}", prior.c);
        assert!((prior.c_at(Some(0.03)) - 0.2).abs() < 1e-12);
        // Against a step of 0.03 s, as a run that timed one prices it: 0.002 / 0.03.
        let fixed = prior.draft_fixed_at(Some(0.03));
        assert!((fixed - 0.002 / 0.03).abs() < 1e-12, "{fixed}");
        // The prompt reading keeps its calibrated 0.2 draft steps a token, now of the cheaper step.
        assert_eq!(prior.draft_read, calibrated.draft_read);
        // Too few rounds, a line that is no cost, or a cost per token outside DRAFT_COST_BAND of
        // the calibrated 0.01 s step, teach nothing.
        for bad in [
            drafted(0.002, 0.02, MIN_DRAFT_ROUNDS - 1),
            drafted(0.002, 0.0049, MIN_DRAFT_ROUNDS),
            drafted(0.002, 0.0201, MIN_DRAFT_ROUNDS),
            drafted(0.002, 0.0, MIN_DRAFT_ROUNDS),
            drafted(-0.001, 0.02, MIN_DRAFT_ROUNDS),
            drafted(0.002, f64::NAN, MIN_DRAFT_ROUNDS),
            Metrics::default(),
        ] {
            cal.learn(&bad);
            assert_eq!(
                cal.recent_draft_cost.map(|(d, _)| d.per_token_secs),
                Some(0.006)
            );
        }
        // A recent step is the unit of the fixed cost.
        cal.recent_step = Some((0.05, Instant::now()));
        cal.set_prior(&mut policy);
        let prior = policy.calibration().expect("a prior");
        assert!(
            (prior.draft_fixed - 0.04).abs() < 1e-12,
            "{}",
            prior.draft_fixed
        );
        // Older than RECENT_STEP_MAX_AGE, the calibration prices the draft again.
        let then = Instant::now().checked_sub(RECENT_STEP_MAX_AGE + Duration::from_secs(1));
        if let Some(then) = then {
            cal.recent_draft_cost = cal.recent_draft_cost.map(|(d, _)| (d, then));
            cal.recent_step = None;
            cal.set_prior(&mut policy);
            assert_eq!(policy.calibration(), Some(&calibrated));
        }
        let text = serde_json::to_string(&cal).unwrap();
        assert!(!text.contains("recent"));
    }

    /// The model's acceptance by position in the runs learned lately, the latest weighing most;
    /// a run without model drafts leaves it.
    #[test]
    fn the_runs_model_acceptance_is_the_next_runs_prior() {
        let positions = |v: &[(u64, u64)]| -> Metrics {
            Metrics {
                model_per_position: v
                    .iter()
                    .map(|&(reached, accepted)| PositionStats { reached, accepted })
                    .collect(),
                ..Metrics::default()
            }
        };
        let mut cal = calibration(None);
        assert!(cal.recent_acceptance().is_empty());
        // Untimed runs teach it too: 9 of 10 first tokens accepted, 3 of 9 second ones.
        cal.learn(&positions(&[(10, 9), (9, 3), (0, 0)]));
        let want0 = (9.0 + PRIOR_ACCEPTANCE) / 11.0;
        let want1 = (3.0 + want0) / 10.0;
        let got = cal.recent_acceptance();
        assert_eq!(got.len(), 2, "{got:?}");
        assert!((got[0] - want0).abs() < 1e-12 && (got[1] - want1).abs() < 1e-12);
        // The next run, all rejected, counts twice as much as the first.
        cal.learn(&positions(&[(10, 0)]));
        let first = (9.0 * RECENT_RUN_DECAY + PRIOR_ACCEPTANCE) / (10.0 * RECENT_RUN_DECAY + 11.0);
        assert!((cal.recent_acceptance()[0] - first).abs() < 1e-12);
        let before = cal.recent_acceptance();
        cal.learn(&positions(&[]));
        assert_eq!(cal.recent_acceptance(), before);
        let mut policy = DraftLenPolicy::auto(None);
        cal.set_prior(&mut policy);
        let prior = policy.calibration().expect("a prior");
        assert_eq!(prior.acceptance, cal.recent_acceptance());
    }

    /// The server's learner keeps a request's model-draft acceptance, and its single step where
    /// it decoded alone (not where it shared its steps), never its blocks; and primes a new
    /// request's cost model with them.
    #[test]
    fn the_servers_learner_times_only_requests_that_decoded_alone() {
        use specdec_server::Learner;
        let mut shared = run(50, 12, &[(2, 10, 1.3)]);
        shared.model_per_position = vec![PositionStats {
            reached: 10,
            accepted: 2,
        }];
        shared.draft_cost = Some(DraftCost {
            fixed_secs: 0.001,
            per_token_secs: 0.012,
            rounds: 10,
        });
        let mut l = Learning::new(calibration(None));
        l.learn(DrafterKind::Model, &shared, false);
        assert_eq!(
            l.calibration.r,
            calibration(None).r,
            "a shared step's time is no sequence's cost"
        );
        assert!(l.calibration.recent_step.is_none());
        assert!(
            l.calibration.recent_draft_cost.is_none(),
            "a shared draft pass is no sequence's cost"
        );
        assert_eq!(l.calibration.learned_blocks, 0);
        let low = (2.0 + PRIOR_ACCEPTANCE) / 11.0;
        let primed = || {
            let mut policy = DraftLenPolicy::auto(None);
            l.prime(DrafterKind::Model, &mut policy);
            policy.calibration().expect("a prior").acceptance.clone()
        };
        assert!((primed()[0] - low).abs() < 1e-12, "{:?}", primed());
        l.learn(DrafterKind::Model, &shared, true);
        assert_eq!(
            l.calibration.r,
            calibration(None).r,
            "the curve stays the calibration's"
        );
        let (step, _) = l
            .calibration
            .recent_step
            .expect("the step of a request that decoded alone");
        assert!((step - 0.05).abs() < 1e-12, "{step}");
        assert_eq!(
            l.calibration
                .recent_draft_cost
                .map(|(d, _)| d.per_token_secs),
            Some(0.012)
        );
        let mut policy = DraftLenPolicy::auto(None);
        l.prime(DrafterKind::Model, &mut policy);
        let prior = policy.calibration().expect("a prior");
        // The first request's counts weigh half the second's.
        let both = (3.0 + PRIOR_ACCEPTANCE) / 16.0;
        assert!(
            (prior.acceptance[0] - both).abs() < 1e-12,
            "{:?}",
            prior.acceptance
        );
        assert!(l.calibration.recent_positions.is_empty());
        assert!(prior.step_secs.is_some());
    }

    /// The server's learner keeps each drafter kind's model-draft acceptance apart: a request
    /// starts from what requests of its own kind saw, and a kind none has taught from the prior.
    #[test]
    fn the_servers_learner_keeps_each_drafter_kinds_acceptance_apart() {
        use specdec_server::Learner;
        let taught = |accepted| {
            let mut m = run(50, 12, &[(2, 10, 1.3)]);
            m.model_per_position = vec![PositionStats {
                reached: 10,
                accepted,
            }];
            m
        };
        let mut l = Learning::new(calibration(None));
        l.learn(DrafterKind::Model, &taught(9), false);
        l.learn(DrafterKind::Hybrid, &taught(2), false);
        let primed = |kind| {
            let mut policy = DraftLenPolicy::auto(None);
            l.prime(kind, &mut policy);
            policy.calibration().expect("a prior").acceptance.clone()
        };
        let (model, hybrid) = (primed(DrafterKind::Model), primed(DrafterKind::Hybrid));
        assert!(
            (model[0] - (9.0 + PRIOR_ACCEPTANCE) / 11.0).abs() < 1e-12,
            "{model:?}"
        );
        assert!(
            (hybrid[0] - (2.0 + PRIOR_ACCEPTANCE) / 11.0).abs() < 1e-12,
            "{hybrid:?}"
        );
        assert!(primed(DrafterKind::Ngram).is_empty());
    }

    #[test]
    fn a_learned_calibration_becomes_the_prior_of_a_cost_model() {
        let mut cal = calibration(None);
        let mut policy = DraftLenPolicy::auto(None);
        cal.set_prior(&mut policy);
        assert_eq!(policy.calibration().map(|p| p.r(2)), Some(1.1));
        // The draft's reading of a prompt token, in its own steps: 2 ms against 10 ms a step.
        let read = policy.calibration().and_then(|p| p.draft_read);
        assert!(read.is_some_and(|r| (r - 0.2).abs() < 1e-12), "{read:?}");
        cal.learn(&run(50, 20, &[(2, 20, 1.5)]));
        cal.set_prior(&mut policy);
        let r2 = policy.calibration().map_or(0.0, |p| p.r(2));
        assert!(r2 > 1.2, "{r2}");
        // A fixed draft length has no prior to set.
        let mut fixed = DraftLenPolicy::default();
        cal.set_prior(&mut fixed);
        assert_eq!(fixed, DraftLenPolicy::default());
    }
}
