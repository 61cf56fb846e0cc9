//! Draft-length policies: how many tokens to draft in the next round.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::metrics::{CostProfile, DraftCost, Round, VerifyTiming};
use crate::verify::expected_tokens;

/// The longest draft any policy may ask for.
pub const MAX_DRAFT_LEN: usize = 64;

/// How the draft length is chosen each round.
// A configuration value, made once per generation and never stored in bulk: the cost model's two
// inline `FixedCost`s are cheaper to keep than boxes every caller would have to build.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DraftLenPolicy {
    /// Always draft `draft_len` tokens.
    Fixed {
        /// Tokens per round, 1..=64.
        draft_len: usize,
    },
    /// An EWMA of the per-round acceptance rate steers the length: one longer while the average is at or
    /// above `target_acceptance`, one shorter once it falls more than 0.1 below it.
    Adaptive {
        /// Length of the first round.
        initial: usize,
        /// Shortest length.
        min: usize,
        /// Longest length.
        max: usize,
        /// The acceptance rate to hold, in (0, 1).
        target_acceptance: f64,
        /// Weight of the newest round in the average, in (0, 1].
        smoothing: f64,
    },
    /// Each round, the length `k` in `0..=max` that maximises expected tokens per unit of time,
    /// `E(k) / (k c + r(k + 1))`, from the per-position acceptance measured so far and the cost profile
    /// (given, or measured online). `k = 0` (no speculation) is chosen when speculation cannot pay.
    CostModel {
        /// Longest length.
        max: usize,
        /// Fixed costs; `None` measures them online from the round timings.
        cost: Option<FixedCost>,
        /// Every this many rounds, draft one more (or, at `max`, one fewer) than the best length, so that
        /// acceptance beyond it and a second point of the cost curve keep being measured. While the best
        /// length is 0 the first probe comes at the second round, the gap doubles after each probe, a
        /// probe lasts two rounds (the draft cost `c` is sampled only from rounds that follow a drafting
        /// round, since the first round after rounds without drafting also pays for a model drafter
        /// catching up), and after three probes that leave the choice at 0 the sequence stops probing:
        /// each of them made the drafter catch up on every token since the one before.
        probe_every: usize,
        /// Costs measured earlier (a calibration saved by an earlier run on the same models, CPU and
        /// threads): used from the first round instead of a warm-up, and wherever the online
        /// measurements have no sample yet (a block length not timed in this run). Unlike `cost`,
        /// the online measurements replace it as they come in.
        #[serde(default)]
        prior: Option<FixedCost>,
    },
}

impl Default for DraftLenPolicy {
    fn default() -> Self {
        DraftLenPolicy::Fixed { draft_len: 4 }
    }
}

/// A cost profile given rather than measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FixedCost {
    /// Draft cost per token over the target's cost per single-token step.
    pub c: f64,
    /// The model drafter's fixed cost per drafting round (feeding the tokens verification added),
    /// in the same unit: a round drafting `k` tokens costs `draft_fixed + k c`.
    #[serde(default)]
    pub draft_fixed: f64,
    /// `r[m - 1] = cost(target on m tokens) / cost(target on 1 token)`, for `m = 1..`; past the end the
    /// curve continues with its last slope.
    pub r: Vec<f64>,
    /// How the target's costs grow with the context they attend to, where measured: `c` and `r`
    /// hold at [`ContextCost::at`] tokens of context, and [`FixedCost::at_context`] moves them.
    #[serde(default)]
    pub context: Option<ContextCost>,
    /// Seconds of a single-token target step at the curve's context as timed lately (by an earlier
    /// generation of the same process), where known. A measuring cost model that has not timed a
    /// step itself divides its timed blocks by this one instead of inferring the step from them
    /// through `r`: on machines whose memory speeds up and slows down, `r`'s proportions hold in
    /// one kind of stretch only (see [`PLAIN_PROBE_EVERY`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_secs: Option<f64>,
    /// Conditional acceptance of model drafts at positions `1..` as seen lately (by earlier
    /// generations of the same process), where known: as the prior of a measuring cost model
    /// ([`DraftLenPolicy::CostModel`]'s `prior`), the estimates start from it instead of
    /// [`PRIOR_ACCEPTANCE`]. An answer of a few rounds (a question on a given passage) ends before
    /// its own counts outweigh the prior, and the model's acceptance differs by kind of text far
    /// more than a fixed prior allows (stop 48: a short answer on a passage whose drafts, mostly the
    /// model's, were accepted at 46% where the prior expected 70%, which made its model drafts look
    /// better than the lookup's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub acceptance: Vec<f64>,
    /// The draft model's cost of reading one prompt token, in its own single-token steps, where
    /// measured (prompts are read in long blocks, far cheaper per token than steps): what
    /// [`RoundCosts::prompt_read`] prices a prompt's reading with. Without it, `r(16) / 16`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft_read: Option<f64>,
    /// Seconds of one draft step, as calibrated, where measured (or, from stop 70, the cost per
    /// drafted token a generation of the same process measured lately). The draft's step does not follow
    /// the target's through the machine's stretches (stop 56's six calibrations, minutes apart:
    /// target steps of 22.2–32.4 ms, draft steps of 6.9–8.9 ms and no faster with the target), so
    /// where the target's step is known now (timed lately, [`FixedCost::step_secs`], or by the
    /// run), `c` is this over that step rather than the calibration's ratio ([`FixedCost::c_at`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft_step_secs: Option<f64>,
}

/// The target's attention cost as a function of context: scoring `m` tokens after `n` tokens of
/// context costs `r(m) + (shared + m · per_row) · (n - at)` single-token steps at context `at`.
///
/// Reading the cache is shared by the rows of a block, the dot products over it are not, so a
/// long context makes every step dearer and blocks more so: calibrated on the default pair (stop 30,
/// `shared` ≈ 2·10⁻⁴, `per_row` ≈ 4·10⁻⁵), a single step at 1,000 tokens costs 1.2 times one at 64,
/// and `r(4)` grows from 1.15 to about 1.22. A cost curve measured at a short context alone makes
/// the cost model overrate speculation on long prompts, and the predicted speedup with it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ContextCost {
    /// The context the curve was measured at, in tokens.
    pub at: usize,
    /// Cost per call per token of context beyond `at`, in single-token steps at `at`.
    pub shared: f64,
    /// Cost per scored token per token of context beyond `at`, in the same unit.
    pub per_row: f64,
}

impl ContextCost {
    /// The unit of [`FixedCost::at_context`] after `n` tokens of context: a single step at `n` in
    /// single steps at `at`, `1 + (shared + per_row) (n - at)`, and `n - at`; `None` where it is
    /// not a positive number (the curve is then left unmoved).
    fn unit(&self, n: f64) -> Option<(f64, f64)> {
        let d = n - self.at as f64;
        let unit = 1.0 + (self.shared + self.per_row) * d;
        (unit > 0.0).then_some((unit, d))
    }

    /// A single step after `n` tokens of context in single steps at [`ContextCost::at`] (1 where
    /// that is not a positive number).
    pub fn step_at(&self, n: f64) -> f64 {
        self.unit(n).map_or(1.0, |(unit, _)| unit)
    }

    /// The inverse of [`FixedCost::at_context`] for one length: `r_n`, the cost of scoring `m`
    /// tokens after `n` tokens of context in single steps at `n`, as `r(m)` at the curve's context
    /// `at`.
    pub fn to_calibration_context(&self, m: usize, n: f64, r_n: f64) -> f64 {
        match self.unit(n) {
            Some((unit, d)) => r_n * unit - (self.shared + m as f64 * self.per_row) * d,
            None => r_n,
        }
    }

    /// Fits `t(m, long) / t(1, at) - r(m) = (shared + m · per_row) · (long - at)` by least squares
    /// to blocks of `m` tokens timed after `long` tokens of context (`(m, t(m, long) / t(1, at))`
    /// pairs), with `r(m)` measured at `at`. `None` without two block lengths or with `long <= at`.
    /// A negative cost is read as noise: clamped to 0 (the other refitted without it).
    pub fn fit(at: usize, long: usize, r: &[f64], timed: &[(usize, f64)]) -> Option<ContextCost> {
        if long <= at || timed.is_empty() {
            return None;
        }
        let d = (long - at) as f64;
        let pts: Vec<(f64, f64)> = timed
            .iter()
            .map(|&(m, t)| (m as f64, (t - curve_r(r, m)) / d))
            .collect();
        let n = pts.len() as f64;
        let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
        let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
        if sxx <= 0.0 {
            return None;
        }
        let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        let (mut shared, mut per_row) = (my - sxy / sxx * mx, sxy / sxx);
        if per_row < 0.0 {
            (shared, per_row) = (my.max(0.0), 0.0);
        } else if shared < 0.0 {
            let sxy0: f64 = pts.iter().map(|p| p.0 * p.1).sum();
            let sxx0: f64 = pts.iter().map(|p| p.0 * p.0).sum();
            (shared, per_row) = (0.0, (sxy0 / sxx0).max(0.0));
        }
        (shared.is_finite() && per_row.is_finite()).then_some(ContextCost {
            at,
            shared,
            per_row,
        })
    }
}

impl FixedCost {
    /// The draft's cost per token in target steps of `step` seconds: the draft's calibrated step
    /// over `step` where both are known and positive, else `c`.
    pub fn c_at(&self, step: Option<f64>) -> f64 {
        match (self.draft_step_secs, step) {
            (Some(d), Some(s)) if d.is_finite() && d > 0.0 && s.is_finite() && s > 0.0 => d / s,
            _ => self.c,
        }
    }

    /// The draft's fixed cost per round in target steps of `step` seconds: `draft_fixed` moved
    /// from the unit of `c` to that step as [`FixedCost::c_at`] moves `c` (both came from seconds
    /// over the same unit), else as it is.
    pub fn draft_fixed_at(&self, step: Option<f64>) -> f64 {
        if self.c > 0.0 && self.c.is_finite() {
            self.draft_fixed * self.c_at(step) / self.c
        } else {
            self.draft_fixed
        }
    }

    /// `r(m)`, extended past the measured lengths with the last slope.
    pub fn r(&self, m: usize) -> f64 {
        curve_r(&self.r, m)
    }

    /// The costs after `n` tokens of context, in single-token steps at `n`: `r(m)` is
    /// `(r_at(m) + (shared + m per_row) d) / (1 + (shared + per_row) d)` with `d = n - at` (negative
    /// below `at`), and `c` and the fixed draft cost scale by the same denominator (the draft's own
    /// growth is not modelled; online measurement replaces it), while [`FixedCost::step_secs`] is
    /// multiplied by it. Unchanged without a [`ContextCost`]; the result carries none (its unit is
    /// a step at `n`).
    pub fn at_context(&self, n: usize) -> FixedCost {
        let Some(cc) = self.context else {
            return self.clone();
        };
        let Some((unit, d)) = cc.unit(n as f64) else {
            return self.clone();
        };
        FixedCost {
            c: self.c / unit,
            draft_fixed: self.draft_fixed / unit,
            r: (1..=self.r.len())
                .map(|m| (self.r(m) + (cc.shared + m as f64 * cc.per_row) * d) / unit)
                .collect(),
            context: None,
            step_secs: self.step_secs.map(|s| s * unit),
            acceptance: self.acceptance.clone(),
            draft_read: self.draft_read,
            draft_step_secs: self.draft_step_secs,
        }
    }
}

impl DraftLenPolicy {
    /// The calibration the cost model starts from (`prior` of [`DraftLenPolicy::CostModel`]), if any.
    pub fn calibration(&self) -> Option<&FixedCost> {
        match self {
            DraftLenPolicy::CostModel { prior, .. } => prior.as_ref(),
            _ => None,
        }
    }

    /// The adaptive policy of `--draft-len adaptive`: start at 4, between 1 and 8, holding an
    /// acceptance rate of 0.7 with an EWMA of weight 0.3.
    pub const ADAPTIVE: DraftLenPolicy = DraftLenPolicy::Adaptive {
        initial: 4,
        min: 1,
        max: 8,
        target_acceptance: 0.7,
        smoothing: 0.3,
    };

    /// The cost model of `--draft-len auto`: lengths 0..=8 for a model draft, a probe every 16 rounds,
    /// starting from `prior` when a calibration of these models on this machine is known.
    pub fn auto(prior: Option<FixedCost>) -> Self {
        DraftLenPolicy::CostModel {
            max: 8,
            cost: None,
            probe_every: 16,
            prior,
        }
    }

    /// Checks the ranges.
    pub fn validate(&self) -> Result<()> {
        let len_ok = |v: usize| (1..=MAX_DRAFT_LEN).contains(&v);
        match self {
            DraftLenPolicy::Fixed { draft_len } => {
                if !len_ok(*draft_len) {
                    return Err(Error::config(
                        "draft_len",
                        draft_len,
                        "an integer in 1..=64",
                    ));
                }
            }
            DraftLenPolicy::Adaptive {
                initial,
                min,
                max,
                target_acceptance,
                smoothing,
            } => {
                if !(len_ok(*min) && min <= initial && initial <= max && len_ok(*max)) {
                    return Err(Error::config(
                        "draft_len",
                        format!("min {min}, initial {initial}, max {max}"),
                        "1 <= min <= initial <= max <= 64",
                    ));
                }
                if !(*target_acceptance > 0.0 && *target_acceptance < 1.0) {
                    return Err(Error::config(
                        "target_acceptance",
                        target_acceptance,
                        "a number in (0, 1)",
                    ));
                }
                if !(*smoothing > 0.0 && *smoothing <= 1.0) {
                    return Err(Error::config("smoothing", smoothing, "a number in (0, 1]"));
                }
            }
            DraftLenPolicy::CostModel {
                max,
                cost,
                probe_every,
                prior,
            } => {
                if !len_ok(*max) {
                    return Err(Error::config("draft_len max", max, "an integer in 1..=64"));
                }
                if *probe_every == 0 {
                    return Err(Error::config("probe_every", probe_every, "at least 1"));
                }
                for cost in [cost, prior].into_iter().flatten() {
                    let ok = cost.c.is_finite()
                        && cost.c >= 0.0
                        && cost.draft_fixed.is_finite()
                        && cost.draft_fixed >= 0.0
                        && !cost.r.is_empty()
                        && cost.r.iter().all(|v| v.is_finite() && *v > 0.0)
                        && cost.step_secs.is_none_or(|s| s.is_finite() && s > 0.0)
                        && cost.draft_read.is_none_or(|d| d.is_finite() && d >= 0.0)
                        && cost
                            .draft_step_secs
                            .is_none_or(|s| s.is_finite() && s > 0.0)
                        && cost.acceptance.iter().all(|a| (0.0..=1.0).contains(a))
                        && cost.context.is_none_or(|cc| {
                            cc.shared.is_finite()
                                && cc.shared >= 0.0
                                && cc.per_row.is_finite()
                                && cc.per_row >= 0.0
                        });
                    if !ok {
                        return Err(Error::config(
                            "cost",
                            format!(
                                "c {} r {:?} step {:?} acceptance {:?} draft read {:?} draft \
                                 step {:?}",
                                cost.c,
                                cost.r,
                                cost.step_secs,
                                cost.acceptance,
                                cost.draft_read,
                                cost.draft_step_secs
                            ),
                            "c >= 0, a non-empty r of positive finite numbers, context costs \
                             >= 0, a positive step, acceptance in [0, 1], a draft read >= 0, a \
                             positive draft step",
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// A controller in its initial state; the policy must be valid.
    pub fn controller(&self) -> Controller {
        Controller {
            policy: self.clone(),
            k: match self {
                DraftLenPolicy::Fixed { draft_len } => *draft_len,
                DraftLenPolicy::Adaptive { initial, .. } => *initial,
                DraftLenPolicy::CostModel { .. } => 1,
            },
            ewma: None,
            reached: Vec::new(),
            accepted: Vec::new(),
            draft_costs: Vec::new(),
            verify_times: Vec::new(),
            rounds: 0,
            next_probe: 0,
            probe_gap: 0,
            probe_left: 0,
            after_draft: false,
            idle_probes: 0,
            last_plain: None,
            last_choice: None,
            costs: None,
            realised_model: Realised::default(),
            realised_lookup: Realised::default(),
            realised_extended: Realised::default(),
            rounds_without_model: 0,
            context: 0,
            calibration: ConfidenceCalibration::default(),
            lookup_calibration: ConfidenceCalibration::default(),
        }
    }
}

/// The state of a draft-length policy across rounds.
#[derive(Clone, Debug)]
pub struct Controller {
    policy: DraftLenPolicy,
    k: usize,
    ewma: Option<f64>,
    reached: Vec<f64>,
    accepted: Vec<f64>,
    /// Recent model-drafting rounds: (tokens drafted, seconds), a window of `WINDOW`.
    draft_costs: Vec<(usize, f64)>,
    /// Recent per-call seconds by block length (index `m - 1`), a window of `WINDOW` each.
    verify_times: Vec<Vec<f64>>,
    rounds: u64,
    /// The round of the next probe, and the current gap between probes (doubling while `k = 0` wins).
    next_probe: u64,
    probe_gap: u64,
    /// Rounds left of the probe in progress (a probe from `k = 0` lasts two rounds, so that its second
    /// round measures drafting without the catch-up the first one pays).
    probe_left: u8,
    /// Whether the last round drafted with the model. A model drafter's first step after rounds
    /// without drafting also feeds the tokens it missed (after the prefill: the prompt itself, for a
    /// drafter that reads it lazily); such a round's draft time is not a sample of `c`.
    after_draft: bool,
    /// Probes in a row after which no drafting was still best.
    idle_probes: u8,
    /// The last round that timed a single-token step of the target: a round without a draft, chosen
    /// or a plain probe ([`PLAIN_PROBE_EVERY`]).
    last_plain: Option<u64>,
    last_choice: Option<Choice>,
    costs: Option<RoundCosts>,
    /// How model drafts, lookup drafts and lookup drafts extended by the model have done against
    /// their predictions.
    realised_model: Realised,
    realised_lookup: Realised,
    realised_extended: Realised,
    /// Rounds since the last one drafted by the model alone ([`RoundCosts::probe_model`]).
    rounds_without_model: u64,
    /// Tokens of context the next round's target pass attends to ([`Controller::set_context`]).
    context: usize,
    /// The draft model's confidence calibrated into acceptance ([`Controller::observe_confidence`]).
    calibration: ConfidenceCalibration,
    /// The lookup's estimates calibrated into acceptance in this sequence
    /// ([`Controller::observe_lookup_confidence`]).
    lookup_calibration: ConfidenceCalibration,
}

/// How one kind of draft (model, lookup, or extended lookup) has done against the cost model's
/// prediction for it:
/// tokens against expected tokens, and time in target steps against the predicted time. What the
/// predictions leave out shows here: a model drafter catching up on the tokens of the lookup rounds
/// it missed, acceptance that its per-position estimates overrate. Decayed sums behind a prior of
/// [`REALISED_PRIOR`] on each side, so the factor starts at 1.
#[derive(Clone, Copy, Debug, Default)]
struct Realised {
    tokens: f64,
    expected: f64,
    steps: f64,
    predicted: f64,
}

/// Pseudo-tokens and pseudo-steps behind a realised factor of 1.
const REALISED_PRIOR: f64 = 4.0;

impl Realised {
    fn decay(&mut self) {
        for v in [
            &mut self.tokens,
            &mut self.expected,
            &mut self.steps,
            &mut self.predicted,
        ] {
            *v *= DECAY;
        }
    }

    fn record(&mut self, tokens: f64, expected: f64, steps: f64, predicted: f64) {
        self.tokens += tokens;
        self.expected += expected;
        self.steps += steps;
        self.predicted += predicted;
    }

    /// Realised tokens per step over predicted tokens per step (1 before any round); with `timed`
    /// false, tokens only (the costs were given, not measured).
    fn factor(&self, timed: bool) -> f64 {
        let p = REALISED_PRIOR;
        let tokens = (self.tokens + p) / (self.expected + p);
        if timed {
            tokens * (self.predicted + p) / (self.steps + p)
        } else {
            tokens
        }
    }
}

/// What the cost model chose and why.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    /// The chosen length.
    pub draft_len: usize,
    /// Expected tokens per round at that length.
    pub expected_tokens: f64,
    /// Expected tokens per target-step of time; speculation pays when this exceeds 1.
    pub tokens_per_step: f64,
}

/// Upper ends of the bins of a [`ConfidenceCalibration`]: finer near 1, where most of a draft
/// model's tokens lie.
const CONFIDENCE_BINS: [f32; 12] = [
    0.1,
    0.2,
    0.3,
    0.4,
    0.5,
    0.6,
    0.7,
    0.8,
    0.9,
    0.95,
    0.99,
    f32::INFINITY,
];
/// Pseudo-tokens behind each bin's factor of 1 ([`ConfidenceCalibration`]).
const CONFIDENCE_PRIOR: f64 = 4.0;

/// How a draft model's confidence in a token (the largest probability of the distribution it was
/// drawn from, [`crate::Proposal::top_probs`]) translates into the chance that the target accepts
/// it, given that the tokens before it were: per confidence bin, the tokens accepted over the sum
/// of their confidences, behind four pseudo-tokens at 1, learned from the model's rounds of one
/// sequence (each generation's cost model starts from the prior) and decayed by the cost model's
/// per-round factor at each round that brings confidences. Greedy, the confidence alone is close:
/// stop 68 found the 0.5B draft's greedy token to be the 1.5B target's in 22% of the positions
/// where its probability was below 0.3, 60% at 0.5–0.7, 86% at 0.8–0.9 and 99.7% above 0.99. The
/// cost model prices a model round from it ([`crate::Round::expected`], the predicted speedup)
/// and the model drafter ends its draft by it ([`RoundCosts::drafts_on`]); the per-position
/// averages ([`RoundCosts::model_acceptance`]), which plan a round before any token is drafted,
/// rate the confident and the unsure rounds alike (stop 68's HumanEval run predicted the model
/// drafter's speedup at a median 0.87 of the measured one). A second one calibrates the lookup's
/// estimates ([`Controller::lookup_calibration`]), for the prediction only.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ConfidenceCalibration {
    /// Per bin: decayed count of observed tokens the target accepted.
    accepted: [f64; CONFIDENCE_BINS.len()],
    /// Per bin: decayed sum of those tokens' confidences.
    confidence: [f64; CONFIDENCE_BINS.len()],
}

impl ConfidenceCalibration {
    fn bin(p: f32) -> usize {
        CONFIDENCE_BINS
            .iter()
            .position(|&end| p < end)
            .unwrap_or(CONFIDENCE_BINS.len() - 1)
    }

    /// The estimated chance that a token drafted at confidence `p` (taken within `[0, 1]`) is
    /// accepted, given that the tokens before it were: `p` times its bin's factor, at most 1. A
    /// `p` that is not a number stays one.
    pub fn acceptance(&self, p: f32) -> f64 {
        if p.is_nan() {
            return f64::NAN;
        }
        let p = p.clamp(0.0, 1.0);
        let p64 = f64::from(p);
        let i = Self::bin(p);
        let factor =
            (self.accepted[i] + CONFIDENCE_PRIOR) / (self.confidence[i] + CONFIDENCE_PRIOR);
        (p64 * factor).min(1.0)
    }

    /// Learns from a round whose model-drafted tokens had confidences `top_probs` and whose first
    /// `accepted` drafted tokens were accepted: each token up to the first rejected one counts.
    /// Counts decay first, by the cost model's per-round factor.
    pub fn observe(&mut self, top_probs: &[f32], accepted: usize) {
        if top_probs.is_empty() {
            return;
        }
        for v in self.accepted.iter_mut().chain(self.confidence.iter_mut()) {
            *v *= DECAY;
        }
        for (i, &p) in top_probs.iter().enumerate().take(accepted + 1) {
            if p.is_nan() {
                continue;
            }
            let p = p.clamp(0.0, 1.0);
            let b = Self::bin(p);
            self.confidence[b] += f64::from(p);
            self.accepted[b] += f64::from(u8::from(i < accepted));
        }
    }
}

/// Acceptance assumed at a position before any round has reached it (without
/// [`FixedCost::acceptance`]).
pub const PRIOR_ACCEPTANCE: f64 = 0.7;
/// Speculation is chosen only when it is predicted at least this much faster than plain decoding:
/// the estimates are noisy, and a round that drafts for a predicted 1% gain loses more often than
/// not once the overheads the model does not see are paid.
pub const PAY_MARGIN: f64 = 0.05;

/// Rounds a model drafter's catch-up is shared by when a round decides whether to call the model
/// ([`RoundCosts::catch_up_share`]), at least.
pub const CATCH_UP_ROUNDS: f64 = 8.0;

/// Committed tokens per round a longer catch-up is shared at: a lag of `n` tokens is shared by
/// `n / CATCH_UP_TOKENS` rounds, between [`CATCH_UP_ROUNDS`] and [`CATCH_UP_MAX_ROUNDS`]
/// ([`RoundCosts::catch_up_share`]).
pub const CATCH_UP_TOKENS: f64 = 2.0;

/// The most rounds a catch-up is shared by: the generation may end before a very long lag has
/// paid for itself.
pub const CATCH_UP_MAX_ROUNDS: f64 = 32.0;

/// Rounds without a model draft after which a hybrid that has nothing from lookup drafts with the
/// model once anyway ([`RoundCosts::probe_model`]).
pub const MODEL_PROBE_ROUNDS: u64 = 16;
/// Pseudo-observations behind the prior of each position's acceptance (the calibration's, or the
/// position before's). At 2, one rejection early in a sequence pinned a position at a third below
/// its prior, and every deeper position unseen yet with it: in stop 65's benchmark, replayed
/// (`decode_replay`), the model drafter on `HumanEval/0` drafted 3 tokens in 15 of its 19 rounds,
/// with 96–99% acceptance at positions 1–3, as a draft of 5 in its second round was rejected at
/// position 4 (estimate 0.63–0.67), and the calibration carried that to the prompts after it.
/// At 4, in three replays each of stops 65's and 66's benchmarks (stop 67), the model drafter ran
/// about 2% faster over the 30 prompts (−1 to +4% per replay) and the hybrid 2–4% (+1 to +5%).
const PRIOR_WEIGHT: f64 = 4.0;
/// Per-round decay of the cost model's counts, so that it follows drift (a half-life of ~140 rounds).
const DECAY: f64 = 0.995;
/// Rounds before the cost model trusts online timings.
const WARMUP_ROUNDS: u64 = 4;
/// The draft lengths of the warm-up rounds: they time blocks of 1, 2 and 3 tokens, and the first two
/// measure drafting with no more catch-up than steady speculation has.
const WARMUP_LENS: [usize; WARMUP_ROUNDS as usize] = [1, 2, 0, 1];
/// Recent rounds whose timings the cost model keeps; it uses their medians, which ignore the rare slow
/// round (a drafter catching up after rounds without speculation, a scheduler hiccup).
const WINDOW: usize = 32;
/// Probe only while the best speculative length is predicted within this factor of the best choice.
const PROBE_THRESHOLD: f64 = 0.9;
/// The longest gap between probes while speculation does not pay.
const MAX_PROBE_GAP: u64 = 1024;
/// The round of the first probe when the cost model starts without drafting.
const FIRST_IDLE_PROBE: u64 = 2;
/// Probes from no drafting that leave the choice at no drafting, after which a sequence stops probing.
const MAX_IDLE_PROBES: u8 = 3;
/// A cost model that measures its costs online decodes one round plainly (no draft at all) when no
/// round of its sequence has timed a single-token step for this many rounds, and first at round
/// [`PLAIN_PROBE_FIRST`]: speculating rounds time only blocks, from which the step itself is
/// inferred through the calibrated curve, and on machines whose memory speeds up and slows down
/// (stop 45's EPYC: plain steps of 21 ms in fast stretches, 31 ms in slow ones, while verification
/// blocks, bound more by their multiply-adds, change far less) the calibration's curve then
/// makes every draft look cheaper than it is, the model's more than the lookup's: predicted
/// speedups of 1.8–2.5× where 1.1–1.9× were measured, and a hybrid that lost to lookup alone on the
/// grounded prompts in fast stretches. The probe costs the round's gain, about 1% of a
/// 128-token generation's speed.
pub const PLAIN_PROBE_EVERY: u64 = 64;
/// The range of the factor by which a run that timed its own steps scales the calibration's curve
/// where it has not timed a length ([`Controller`]'s measured profile).
const PRIOR_SCALE: (f64, f64) = (0.5, 3.0);
/// The round of a sequence's first plain probe ([`PLAIN_PROBE_EVERY`]): late enough that a short
/// answer pays for none (at round 6, stop 45's answers to questions on a passage, 5 to 25 rounds
/// each, lost to lookup alone: the probe cost them one round in ten), early enough that much of a
/// long one is priced with it.
pub const PLAIN_PROBE_FIRST: u64 = 16;

/// The cost curve [`RoundCosts`] carries reaches at least `r(LOOKUP_CURVE + 1)`, so that lookup
/// drafts longer than the model's longest can be priced.
const LOOKUP_CURVE: usize = 16;

fn push_window<T>(v: &mut Vec<T>, x: T) {
    if v.len() == WINDOW {
        v.remove(0);
    }
    v.push(x);
}

fn median(v: &[f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    Some(if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    })
}

impl Controller {
    /// Tells the cost model how many tokens of context the next round scores after, so that given
    /// and calibrated costs measured at another context are moved there ([`FixedCost::at_context`]).
    pub fn set_context(&mut self, tokens: usize) {
        self.context = tokens;
    }

    /// The length to draft next. Under [`DraftLenPolicy::CostModel`] this is the model draft's length;
    /// [`Controller::costs`] then holds the round's costs for drafters with other options.
    pub fn next_draft_len(&mut self) -> usize {
        match &self.policy {
            DraftLenPolicy::Fixed { .. } | DraftLenPolicy::Adaptive { .. } => self.k,
            DraftLenPolicy::CostModel {
                max,
                cost,
                probe_every,
                prior,
            } => {
                let (max, probe_every) = (*max, *probe_every as u64);
                if cost.is_none() && self.plain_probe_due() {
                    // No draft at all this round (a hybrid's lookup neither: no costs), so that
                    // the target times a single-token step.
                    self.last_plain = Some(self.rounds);
                    self.k = 0;
                    self.costs = None;
                    return 0;
                }
                let prior = prior.as_ref().map(|p| p.at_context(self.context));
                let profile = match cost {
                    Some(fixed) => Some(Profile::fixed(&fixed.at_context(self.context))),
                    None => {
                        let measured = (self.rounds >= WARMUP_ROUNDS)
                            .then(|| self.measured_profile(prior.as_ref()))
                            .flatten();
                        measured.or_else(|| prior.as_ref().map(Profile::fixed))
                    }
                };
                let Some(profile) = profile else {
                    // Warm-up: short drafts and one round without, which measure r(1..=3) and c
                    // without letting a model drafter fall far behind.
                    let i = (self.rounds as usize).min(WARMUP_LENS.len() - 1);
                    self.k = WARMUP_LENS[i].min(max);
                    self.costs = None;
                    return self.k;
                };
                let acceptance = self.acceptance(max);
                let rate = |k: usize| profile.rate(&acceptance, k);
                let mut choice =
                    best_draft_len_with(&acceptance, profile.fixed, profile.c, |m| profile.r(m));
                if choice.draft_len > 0 && choice.tokens_per_step < rate(0) * (1.0 + PAY_MARGIN) {
                    // A predicted gain within the estimates' noise is not worth the risk.
                    choice = Choice {
                        draft_len: 0,
                        expected_tokens: 1.0,
                        tokens_per_step: rate(0),
                    };
                }
                self.last_choice = Some(choice);
                // The best speculative length's predicted rate; a probe is worth its cost only when
                // speculation is close to paying.
                let best_speculative = (1..=max).map(rate).fold(0.0, f64::max);
                let worth_probing = choice.draft_len > 0
                    || best_speculative >= PROBE_THRESHOLD * choice.tokens_per_step;
                let mut k = choice.draft_len;
                let mut probing = false;
                if self.probe_gap == 0 {
                    self.probe_gap = probe_every;
                    // Not drafting from the start: probe soon, while catching up is cheap.
                    self.next_probe = self.rounds
                        + if k == 0 {
                            FIRST_IDLE_PROBE
                        } else {
                            probe_every
                        };
                }
                if self.probe_left > 0 {
                    // The second round of a probe from no speculation: draft again, now without
                    // catch-up, so the probe measures c.
                    self.probe_left -= 1;
                    probing = k == 0;
                    k = k.max(1);
                } else if self.rounds >= self.next_probe {
                    // Measure one length more (or fewer, at the top) than the best. While no
                    // speculation wins, probes grow rarer: each one costs a drafter catch-up.
                    if worth_probing {
                        if k == 0 {
                            self.probe_left = 1;
                        }
                        probing = true;
                        k = if k < max { k + 1 } else { k - 1 };
                    }
                    self.probe_gap = if choice.draft_len == 0 {
                        (self.probe_gap * 2).min(MAX_PROBE_GAP)
                    } else {
                        probe_every
                    };
                    self.idle_probes = if choice.draft_len == 0 {
                        self.idle_probes.saturating_add(1)
                    } else {
                        0
                    };
                    // Each probe from no drafting makes a model drafter catch up on every token
                    // since the last one; after a few that changed nothing, stop paying for them.
                    self.next_probe = if self.idle_probes >= MAX_IDLE_PROBES {
                        u64::MAX
                    } else {
                        self.rounds + self.probe_gap
                    };
                }
                self.k = k;
                let mut costs = self.costs.take().unwrap_or_default();
                costs.r.clear();
                costs
                    .r
                    .extend((1..=max.max(LOOKUP_CURVE) + 1).map(|m| profile.r(m)));
                costs.draft_fixed = profile.fixed;
                costs.draft_per_token = profile.c;
                let read = match cost {
                    Some(fixed) => fixed.draft_read,
                    None => prior.as_ref().and_then(|p| p.draft_read),
                };
                costs.prompt_read = profile.c * read.unwrap_or_else(|| profile.r(16) / 16.0);
                costs.model_len = k;
                // A hybrid weighs its options at their realised rates: the predictions' blind spots
                // differ between them. Fixed costs are taken as given: only tokens are corrected.
                let timed = cost.is_none();
                costs.model_factor = if k > 0 {
                    self.realised_model.factor(timed)
                } else {
                    1.0
                };
                costs.model_rate = rate(k) * costs.model_factor;
                costs.model_steps = profile.steps(k);
                costs.lookup_factor = self.realised_lookup.factor(timed);
                costs.extended_factor = self.realised_extended.factor(timed);
                costs.model_acceptance.clear();
                costs.model_acceptance.extend_from_slice(&acceptance);
                costs.probe_model = probing || self.rounds_without_model >= MODEL_PROBE_ROUNDS;
                costs.calibration = self.calibration;
                self.costs = Some(costs);
                k
            }
        }
    }

    /// Whether the next round is a plain probe ([`PLAIN_PROBE_EVERY`]): `PLAIN_PROBE_FIRST` rounds
    /// in, then whenever the last single-token step was timed (or probed for, where the round's
    /// timing was not the sequence's own) `PLAIN_PROBE_EVERY` rounds ago.
    fn plain_probe_due(&self) -> bool {
        match self.last_plain {
            None => self.rounds >= PLAIN_PROBE_FIRST,
            Some(last) => self.rounds >= last + PLAIN_PROBE_EVERY,
        }
    }

    /// Caps the model draft the cost model planned for this round at `k` tokens (a batch's cap,
    /// [`crate::best_batch_draft_cap`]), repricing it; a lookup draft keeps its own length.
    pub fn cap_model_len(&mut self, k: usize) {
        if let Some(costs) = &mut self.costs {
            costs.cap_model_len(k);
        }
    }

    /// The cost model's view of the round [`Controller::next_draft_len`] just planned; `None` for the
    /// other policies and while the cost model is warming up without a prior.
    pub fn costs(&self) -> Option<&RoundCosts> {
        self.costs.as_ref()
    }

    /// The cost profile from the recent rounds' median timings, completed by the prior where this run
    /// has no sample; `None` until the target was timed.
    fn measured_profile(&self, prior: Option<&FixedCost>) -> Option<Profile> {
        let mut verify: Vec<VerifyTiming> = self
            .verify_times
            .iter()
            .enumerate()
            .filter_map(|(i, t)| {
                median(t).map(|secs| VerifyTiming {
                    m: i + 1,
                    calls: 1,
                    secs,
                })
            })
            .collect();
        // Until this run times a step itself, the step an earlier generation timed lately is the
        // unit: the blocks' proportions to the calibration's curve then show as they do after a
        // plain probe (short answers end before their first one).
        let seeded = match prior.and_then(|p| p.step_secs) {
            Some(secs) if verify.first().is_some_and(|t| t.m > 1) => {
                verify.insert(
                    0,
                    VerifyTiming {
                        m: 1,
                        calls: 1,
                        secs,
                    },
                );
                true
            }
            _ => false,
        };
        let fit = CostProfile::fit_with(0.0, &verify, prior.map(|p| p.r.as_slice()))?;
        let t1 = fit.target_step_secs;
        let (fixed, c) = match fit_draft_cost(&self.draft_costs) {
            Some((a, b)) => (a / t1, b / t1),
            // The draft not timed yet: its calibrated step over the target's step now.
            None => prior.map_or((0.0, 0.0), |p| {
                (p.draft_fixed_at(Some(t1)), p.c_at(Some(t1)))
            }),
        };
        let samples = |m: usize| {
            if m == 1 && seeded {
                return 1.0;
            }
            self.verify_times.get(m - 1).map_or(1.0, |t| t.len() as f64)
        };
        // Where this run timed the step itself (or has one timed lately), the blocks it timed tell
        // how the machine compares with the calibration now (in a fast stretch of memory a step gets
        // much cheaper and a block, bound more by its multiply-adds, far less): the calibration's
        // lengths this run has not timed are scaled by the timed lengths' mean ratio to it,
        // weighted by their samples.
        let scale = match prior {
            Some(p) if fit.measured.first().is_some_and(|&(m, _)| m == 1) => {
                let (mut num, mut den) = (0.0, 0.0);
                for &(m, r) in fit.measured.iter().filter(|&&(m, _)| m > 1) {
                    num += samples(m) * r / p.r(m);
                    den += samples(m);
                }
                if den > 0.0 {
                    (num / den).clamp(PRIOR_SCALE.0, PRIOR_SCALE.1)
                } else {
                    1.0
                }
            }
            _ => 1.0,
        };
        // Each measured length weighs its samples; lengths this run has not timed come from the
        // prior (or the fitted line) with the weight of one sample.
        let (r, weights): (Vec<f64>, Vec<f64>) = (1..=MAX_DRAFT_LEN + 1)
            .map(
                |m| match (fit.measured.iter().find(|(mm, _)| *mm == m), prior) {
                    (Some(&(_, r)), _) => (r, samples(m)),
                    (None, Some(p)) => ((p.r(m) * scale).max(1.0), 1.0),
                    (None, None) => (fit.r(m), 1.0),
                },
            )
            .unzip();
        let r = isotonic_curve(&r, &weights);
        Some(Profile { fixed, c, r })
    }

    /// The draft model's cost as measured in this sequence's last 32 drafting rounds
    /// timed as its own (a round of a batch that scored one sequence), each right after a round
    /// that drafted too (none paid for catching up on rounds without the model), in seconds;
    /// `None` before any was timed, or under another policy.
    pub fn draft_cost(&self) -> Option<DraftCost> {
        let (fixed_secs, per_token_secs) = fit_draft_cost(&self.draft_costs)?;
        Some(DraftCost {
            fixed_secs,
            per_token_secs,
            rounds: self.draft_costs.len() as u64,
        })
    }

    /// The cost model's last decision, if it made one.
    pub fn last_choice(&self) -> Option<Choice> {
        self.last_choice
    }

    /// Estimated conditional acceptance at positions `1..=max`: this sequence's counts behind a
    /// prior of four rounds, the acceptance seen lately ([`FixedCost::acceptance`]) where the
    /// calibration carries it, else [`PRIOR_ACCEPTANCE`] at the first position and the estimate of
    /// the position before at the others.
    pub fn acceptance(&self, max: usize) -> Vec<f64> {
        let seen: &[f64] = match &self.policy {
            DraftLenPolicy::CostModel {
                prior: Some(p),
                cost: None,
                ..
            } => &p.acceptance,
            _ => &[],
        };
        let mut out = Vec::with_capacity(max);
        let mut last = PRIOR_ACCEPTANCE;
        for i in 0..max {
            let (r, a) = (
                self.reached.get(i).copied().unwrap_or(0.0),
                self.accepted.get(i).copied().unwrap_or(0.0),
            );
            let prior = match seen.get(i) {
                Some(&p) => p,
                None if i == 0 => PRIOR_ACCEPTANCE,
                None => last,
            };
            last = (a + PRIOR_WEIGHT * prior) / (r + PRIOR_WEIGHT);
            out.push(last);
        }
        out
    }

    /// The draft model's confidence calibrated into acceptance, as learned so far.
    pub fn calibration(&self) -> &ConfidenceCalibration {
        &self.calibration
    }

    /// Learns how the draft model's confidence translates into acceptance from a verified round
    /// whose model-drafted tokens had confidences `top_probs` ([`crate::Proposal::top_probs`]) and
    /// whose first `accepted` drafted tokens were accepted ([`ConfidenceCalibration::observe`]).
    pub fn observe_confidence(&mut self, top_probs: &[f32], accepted: usize) {
        self.calibration.observe(top_probs, accepted);
    }

    /// The lookup's estimates as calibrated by what the target accepted in this sequence
    /// ([`Controller::observe_lookup_confidence`]), which the predicted speedup prices lookup
    /// tokens by ([`crate::Round::expected`]). Only the prediction: the lookup drafts by its own
    /// estimates, which it never raises for a sequence (see its calibration).
    pub fn lookup_calibration(&self) -> &ConfidenceCalibration {
        &self.lookup_calibration
    }

    /// Learns how the lookup's estimates ([`crate::Proposal::confidence`]) translate into
    /// acceptance in this sequence, from a verified round whose lookup tokens had estimates
    /// `confidence` and whose first `accepted` of them were accepted (all the tokens drafted
    /// before them having been).
    pub fn observe_lookup_confidence(&mut self, confidence: &[f32], accepted: usize) {
        self.lookup_calibration.observe(confidence, accepted);
    }

    /// Learns from a finished round.
    pub fn observe(&mut self, round: &Round) {
        self.observe_inner(round, true);
    }

    /// [`Controller::observe`] for a round whose timings are not this sequence's own (its model calls
    /// were shared with other sequences in a batch): acceptance counts, timings do not.
    pub fn observe_untimed(&mut self, round: &Round) {
        self.observe_inner(round, false);
    }

    fn observe_inner(&mut self, round: &Round, timed: bool) {
        self.rounds += 1;
        self.rounds_without_model = if (!round.lookup || round.prefix > 0) && round.drafted > 0 {
            0
        } else {
            self.rounds_without_model.saturating_add(1)
        };
        self.observe_realised(round, timed);
        // Per-position acceptance of model drafts, whatever the policy (it also gives each round's
        // expected tokens by position, and for the predicted speedup where the draft model gave no
        // confidences); a lookup draft's acceptance is its own, also where it continues a model
        // draft.
        let model_drafted = if round.lookup {
            round.prefix
        } else {
            round.drafted
        };
        if !round.lookup || round.prefix > 0 {
            for v in self.reached.iter_mut().chain(self.accepted.iter_mut()) {
                *v *= DECAY;
            }
            if self.reached.len() < model_drafted {
                self.reached.resize(model_drafted, 0.0);
                self.accepted.resize(model_drafted, 0.0);
            }
            for i in 0..model_drafted.min(round.accepted + 1) {
                self.reached[i] += 1.0;
                self.accepted[i] += f64::from(u8::from(i < round.accepted));
            }
        }
        match &self.policy {
            DraftLenPolicy::Fixed { .. } => {}
            DraftLenPolicy::Adaptive {
                min,
                max,
                target_acceptance,
                smoothing,
                ..
            } => {
                if round.drafted == 0 {
                    return;
                }
                let rate = round.accepted as f64 / round.drafted as f64;
                let ewma = match self.ewma {
                    Some(e) => smoothing * rate + (1.0 - smoothing) * e,
                    None => rate,
                };
                self.ewma = Some(ewma);
                if ewma >= *target_acceptance {
                    self.k = (self.k + 1).min(*max);
                } else if ewma < target_acceptance - 0.1 {
                    self.k = self.k.saturating_sub(1).max(*min);
                }
            }
            DraftLenPolicy::CostModel { .. } if round.lookup => {
                // A lookup draft cost nothing to draft, but the target's timing is a sample of r(m)
                // like any other. The model drafter, if any, missed this round (or, extending the
                // lookup draft, read it in a block) and catches up in its next one: that round's
                // draft time is no sample of c.
                self.after_draft = false;
                self.push_verify_time(round, timed);
            }
            DraftLenPolicy::CostModel { .. } => {
                // c counts drafting only: a round right after one without drafting also paid for the
                // drafter catching up on the tokens it missed, which steady speculation does not.
                if timed && round.drafted > 0 && self.after_draft {
                    push_window(&mut self.draft_costs, (round.drafted, round.draft_secs));
                }
                // A round without its own timing gives the next one no clean draft cost either.
                self.after_draft = timed && round.drafted > 0;
                self.push_verify_time(round, timed);
            }
        }
    }

    /// Compares a timed drafting round with the plan [`Controller::next_draft_len`] made for it. Its
    /// time in target steps is `r(m)` scaled by its measured draft-plus-verify over verify seconds, so
    /// that the target's own speed drifting cancels out.
    fn observe_realised(&mut self, round: &Round, timed: bool) {
        let Some(costs) = &self.costs else {
            return;
        };
        // A NaN (a drafter's confidence, a clock) is skipped too: the realised factors keep their
        // sums round after round, and one NaN would stay in them.
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if !timed
            || round.drafted == 0
            || !positive(round.verify_secs)
            || !positive(round.expected_by_position)
            || !round.draft_secs.is_finite()
        {
            return;
        }
        let r = costs.r(round.verified);
        let steps = r * (round.draft_secs + round.verify_secs) / round.verify_secs;
        // Every kind's evidence ages with each round, so that a kind a few bad rounds put out of use
        // drifts back towards its prediction.
        for realised in [
            &mut self.realised_model,
            &mut self.realised_lookup,
            &mut self.realised_extended,
        ] {
            realised.decay();
        }
        let (realised, predicted) = if round.extension > 0 {
            let lookup_len = round.drafted - round.extension.min(round.drafted);
            let draft = costs.extension_draft_cost(round.lag, lookup_len, round.extension);
            (&mut self.realised_extended, r + draft)
        } else if round.lookup && round.prefix == 0 {
            (&mut self.realised_lookup, r)
        } else {
            // A model draft the lookup continued was planned, and paid for, as the model draft of
            // `model_len` tokens: its continuation counts to the model's realised rate. (Since
            // stop 68 the model may have ended that draft sooner where it was unsure, and drafted
            // fewer: the prediction then charges a few draft steps too many.)
            let drafted = if round.prefix > 0 {
                costs.model_len.max(round.prefix)
            } else {
                round.drafted
            };
            let draft = costs.draft_fixed
                + drafted as f64 * costs.draft_per_token
                + costs.catch_up(round.lag);
            (&mut self.realised_model, r + draft)
        };
        let tokens = (round.accepted + 1) as f64;
        realised.record(tokens, round.expected_by_position, steps, predicted);
    }

    fn push_verify_time(&mut self, round: &Round, timed: bool) {
        if timed && round.verified == 1 {
            // `rounds` already counts this one.
            self.last_plain = Some(self.rounds - 1);
        }
        if timed && round.verified > 0 {
            if self.verify_times.len() < round.verified {
                self.verify_times.resize(round.verified, Vec::new());
            }
            push_window(
                &mut self.verify_times[round.verified - 1],
                round.verify_secs,
            );
        }
    }
}

/// Fits `secs = a + b k` to model-drafting rounds: `a` is what a round costs whatever its length
/// (feeding the tokens the last verification added), `b` the cost per drafted token. The line is a
/// least-squares fit, weighted by sample counts, through the median time at each length, so a rare
/// slow round does not move it. With a single length among the samples, `a = 0` and `b` is the
/// median per-token cost. `None` without samples.
fn fit_draft_cost(samples: &[(usize, f64)]) -> Option<(f64, f64)> {
    let mut lens: Vec<usize> = samples.iter().map(|s| s.0).collect();
    lens.sort_unstable();
    lens.dedup();
    // (k, median seconds, samples)
    let pts: Vec<(f64, f64, f64)> = lens
        .iter()
        .filter_map(|&k| {
            let t: Vec<f64> = samples.iter().filter(|s| s.0 == k).map(|s| s.1).collect();
            median(&t).map(|m| (k as f64, m, t.len() as f64))
        })
        .collect();
    if let [(k, t, _)] = pts[..] {
        return Some((0.0, t / k));
    }
    let w: f64 = pts.iter().map(|p| p.2).sum();
    if w == 0.0 {
        return None;
    }
    let mk = pts.iter().map(|p| p.2 * p.0).sum::<f64>() / w;
    let mt = pts.iter().map(|p| p.2 * p.1).sum::<f64>() / w;
    let sxx: f64 = pts.iter().map(|p| p.2 * (p.0 - mk).powi(2)).sum();
    let sxy: f64 = pts.iter().map(|p| p.2 * (p.0 - mk) * (p.1 - mt)).sum();
    let b = (sxy / sxx).max(0.0);
    let a = mt - b * mk;
    if a >= 0.0 {
        Some((a, b))
    } else {
        // A negative intercept is noise: no fixed cost, the slope through the origin.
        let b = pts.iter().map(|p| p.2 * p.0 * p.1).sum::<f64>()
            / pts.iter().map(|p| p.2 * p.0 * p.0).sum::<f64>();
        Some((0.0, b))
    }
}

/// The costs the cost model decides with, in target single steps.
struct Profile {
    /// Model drafting: fixed per round.
    fixed: f64,
    /// Model drafting: per drafted token.
    c: f64,
    /// `r(m)` for `m = 1..=r.len()`.
    r: Vec<f64>,
}

impl Profile {
    fn fixed(f: &FixedCost) -> Self {
        Self {
            fixed: f.draft_fixed_at(f.step_secs),
            c: f.c_at(f.step_secs),
            r: (1..=MAX_DRAFT_LEN + 1).map(|m| f.r(m)).collect(),
        }
    }

    fn r(&self, m: usize) -> f64 {
        curve_r(&self.r, m)
    }

    /// Expected tokens per target step of a model draft of `k` tokens.
    fn rate(&self, acceptance: &[f64], k: usize) -> f64 {
        if k == 0 {
            return 1.0 / self.r(1);
        }
        expected_tokens(&acceptance[..k.min(acceptance.len())]) / self.steps(k)
    }

    /// A round's cost in target steps with a model draft of `k` tokens (`r(1)` without one).
    fn steps(&self, k: usize) -> f64 {
        if k == 0 {
            return self.r(1);
        }
        self.fixed + k as f64 * self.c + self.r(k + 1)
    }
}

/// `r[m - 1]` read as a cost curve: never below 1 nor below the cost of fewer tokens (scoring more
/// tokens cannot cost less, so a noisy measurement under an earlier one reads as that one), and past
/// the end continued with the last non-negative slope.
pub(crate) fn curve_r(r: &[f64], m: usize) -> f64 {
    let m = m.max(1);
    let upto = m.min(r.len());
    let here = r[..upto].iter().copied().fold(1.0, f64::max);
    if m <= r.len() {
        return here;
    }
    let n = r.len();
    if n == 0 {
        return 1.0;
    }
    let before = r[..n - 1].iter().copied().fold(1.0, f64::max);
    let slope = if n >= 2 { here - before } else { 0.0 };
    here + slope * (m - n) as f64
}

/// Conditional acceptance of model drafts by position from `(reached, accepted)` counts (of
/// earlier runs, [`crate::Metrics::fold_model_positions`]): each position's counts behind one
/// pseudo-round of the position before (of [`PRIOR_ACCEPTANCE`] at the first), up to the last
/// position reached. A [`FixedCost::acceptance`] for the next run's cost model.
pub fn acceptance_by_position(positions: &[(f64, f64)]) -> Vec<f64> {
    let mut last = PRIOR_ACCEPTANCE;
    positions
        .iter()
        .take_while(|p| p.0 > 0.0)
        .map(|&(reached, accepted)| {
            last = (accepted + last) / (reached + 1.0);
            last
        })
        .collect()
}

/// The non-decreasing curve closest to `values` in weighted least squares (isotonic regression, by
/// pooling adjacent violators), floored at 1: how a measured cost curve `r(1), r(2), ..` is read.
///
/// Scoring more tokens cannot cost less, so a measurement under an earlier one is noise, and so is
/// one above a later one. A running maximum reads the first kind away but carries the
/// second into every longer block: one disturbed timing (`r(5) = 2.47` between `r(4) = 1.50` and
/// `r(6) = 1.97`) priced every draft of 4 to 7 tokens at 2.47. Pooling it with its neighbours
/// spreads the error instead, by the weights (sample counts) of the points pooled. A weight of 0
/// or less counts as a tiny one, so that every point still gets a value; `weights` shorter than
/// `values` is padded with ones.
pub fn isotonic_curve(values: &[f64], weights: &[f64]) -> Vec<f64> {
    // Pooled blocks: (mean, weight, points).
    let mut blocks: Vec<(f64, f64, usize)> = Vec::with_capacity(values.len());
    for (i, &v) in values.iter().enumerate() {
        let w = weights.get(i).copied().unwrap_or(1.0).max(1e-9);
        let v = if v.is_finite() { v } else { 1.0 };
        blocks.push((v, w, 1));
        while blocks.len() >= 2 {
            let (b, a) = (blocks[blocks.len() - 1], blocks[blocks.len() - 2]);
            if a.0 <= b.0 {
                break;
            }
            let w = a.1 + b.1;
            let pooled = ((a.0 * a.1 + b.0 * b.1) / w, w, a.2 + b.2);
            blocks.pop();
            if let Some(last) = blocks.last_mut() {
                *last = pooled;
            }
        }
    }
    blocks
        .iter()
        .flat_map(|&(v, _, n)| std::iter::repeat_n(v.max(1.0), n))
        .collect()
}

/// The cost model's view of one round, handed to drafters in [`crate::DraftRequest::costs`]; every
/// cost is in units of one target step on one token.
#[derive(Clone, Debug, PartialEq)]
pub struct RoundCosts {
    /// `r(m)`, the target's cost of scoring `m` tokens in one pass, for `m = 1..=r.len()`.
    pub r: Vec<f64>,
    /// A model draft's fixed cost per round.
    pub draft_fixed: f64,
    /// A model draft's cost per drafted token (`c`).
    pub draft_per_token: f64,
    /// The draft model's cost of reading one prompt token ([`FixedCost::draft_read`] times `c`).
    pub prompt_read: f64,
    /// The model draft length the cost model chose for this round (0: a model draft does not pay):
    /// the model drafter's cap, which it may end sooner ([`RoundCosts::drafts_on`]).
    pub model_len: usize,
    /// Expected tokens per target step with that model draft (`1 / r(1)` at length 0), scaled by
    /// how the model's drafts have realised their predictions so far, for a model that has read every
    /// committed token but the last round's ([`RoundCosts::catch_up`] prices the rest).
    pub model_rate: f64,
    /// The realised factor in `model_rate` (1 without rounds, and at length 0).
    pub model_factor: f64,
    /// The predicted cost of that round in target steps (`fixed + k c + r(k + 1)`).
    pub model_steps: f64,
    /// How lookup drafts have realised their predicted tokens per step so far (1 without rounds): a
    /// lookup draft's predicted rate times this is comparable with `model_rate`.
    pub lookup_factor: f64,
    /// The same for lookup drafts extended by the model ([`RoundCosts::best_extension`]).
    pub extended_factor: f64,
    /// The cost model's estimate of a model draft's conditional acceptance at positions `1..`.
    pub model_acceptance: Vec<f64>,
    /// Whether this round's model draft is a probe of the cost model (a length it did not choose:
    /// one more or fewer than the best, or a draft after none paid), or the model has not drafted
    /// a round alone for [`MODEL_PROBE_ROUNDS`] rounds: a hybrid with no lookup draft then lets it
    /// draft anyway, as a model drafter alone would. Stop 31 found the hybrid on translation
    /// skipping the cost model's probes after an unlucky first round, and decoding plainly. Its realised factor learns only from its
    /// own rounds, so without such probes a few unlucky early rounds keep it out for good: stop
    /// 27's benchmark found the hybrid on translation decoding plainly for 100 of 107 rounds after
    /// two model rounds had put the factor at 0.8, where the model drafter alone gained 1.14×.
    pub probe_model: bool,
    /// The draft model's confidence calibrated into acceptance, as learned so far in this sequence
    /// ([`Controller::observe_confidence`]).
    pub calibration: ConfidenceCalibration,
}

impl Default for RoundCosts {
    fn default() -> Self {
        Self {
            r: Vec::new(),
            draft_fixed: 0.0,
            draft_per_token: 0.0,
            prompt_read: 0.0,
            model_len: 0,
            model_rate: 0.0,
            model_factor: 1.0,
            model_steps: 1.0,
            lookup_factor: 1.0,
            extended_factor: 1.0,
            model_acceptance: Vec::new(),
            probe_model: false,
            calibration: ConfidenceCalibration::default(),
        }
    }
}

impl RoundCosts {
    /// `r(m)`, continued past the end with the last slope.
    pub fn r(&self, m: usize) -> f64 {
        curve_r(&self.r, m)
    }

    /// Caps [`RoundCosts::model_len`] at `k`, with [`RoundCosts::model_rate`] and
    /// [`RoundCosts::model_steps`] priced for the shorter draft (the realised factor kept).
    pub fn cap_model_len(&mut self, k: usize) {
        if k >= self.model_len {
            return;
        }
        self.model_len = k;
        if k == 0 {
            self.model_steps = self.r(1);
            self.model_rate = 1.0 / self.r(1);
            self.model_factor = 1.0;
            return;
        }
        let acceptance = &self.model_acceptance[..k.min(self.model_acceptance.len())];
        self.model_steps = self.draft_fixed + k as f64 * self.draft_per_token + self.r(k + 1);
        self.model_rate = expected_tokens(acceptance) / self.model_steps * self.model_factor;
    }

    /// Whether a model draft of `drafted` tokens, all accepted with the estimated probability
    /// `reach`, should draft more (up to `limit` tokens, the request's [`RoundCosts::model_len`]
    /// within its `max_len`, [`crate::DraftRequest::model_len`]): whether some longer draft's
    /// further tokens yield, at `reach` times the cost model's acceptance estimates for their
    /// positions ([`RoundCosts::model_acceptance`]), at least what they cost (their draft steps and
    /// rows of the verification, `(len − drafted) c + r(len + 1) − r(drafted + 1)` target steps)
    /// at the rate the round expects ([`RoundCosts::model_rate`]). Looking past the next token
    /// matters where the verification's cost climbs in steps: a row that costs much may open rows
    /// that cost little (stop 68's calibration: r(2), r(3), r(4) 1.13, 1.33, 1.42). The model
    /// drafter takes `reach` from its own confidence, the product of its largest probabilities at
    /// the positions drafted as [`RoundCosts::calibration`] calibrates them (since stop 69; raw
    /// before), which the acceptance follows closely (stop 68: over the 2,950 answer
    /// positions of 30 benchmark prompts, the 0.5B draft's greedy token was the 1.5B target's in
    /// 22% of the positions where its probability was below 0.3, 79% at 0.7–0.8 and 99.7% above
    /// 0.99). The length the cost model chose is priced at each position's average acceptance;
    /// this cuts a round short where the draft is unsure. A NaN `reach` or rate drafts on; a
    /// position without an acceptance estimate counts as accepted (the draft's confidence alone
    /// then decides).
    pub fn drafts_on(&self, drafted: usize, reach: f64, limit: usize) -> bool {
        let limit = limit.min(self.model_len);
        if drafted >= limit {
            return false;
        }
        let (mut gain, mut reached) = (0.0, reach);
        for len in drafted + 1..=limit {
            reached *= self.model_acceptance.get(len - 1).copied().unwrap_or(1.0);
            gain += reached;
            let cost = (len - drafted) as f64 * self.draft_per_token + self.r(len + 1)
                - self.r(drafted + 1);
            if gain >= self.model_rate * cost {
                return true;
            }
        }
        reach.is_nan() || self.model_rate.is_nan()
    }

    /// For a draft that costs nothing to make (lookup) whose tokens have conditional acceptance
    /// `confidence`, the prefix length with the most expected tokens per target step, and that rate.
    /// Length 0 (plain decoding) scores `1 / r(1)`, and a draft must beat it by [`PAY_MARGIN`]. With
    /// `ends`, the draft's last token ends the generation: drafted whole and accepted, it brings no
    /// token after it ([`crate::verify::expected_tokens_ending`]).
    pub fn best_free_len(&self, confidence: &[f32], ends: bool) -> (usize, f64) {
        let plain = 1.0 / self.r(1);
        let mut best = (0, plain * (1.0 + PAY_MARGIN));
        let (mut reach, mut tokens) = (1.0, 1.0);
        for (j, &a) in confidence.iter().enumerate() {
            reach *= f64::from(a);
            tokens += reach;
            let whole = ends && j + 1 == confidence.len();
            let rate = (tokens - if whole { reach } else { 0.0 }) / self.r(j + 2);
            if rate > best.1 {
                best = (j + 1, rate);
            }
        }
        if best.0 == 0 {
            best.1 = plain;
        }
        best
    }

    /// Whether the draft model's reading of `unread` prompt tokens ([`RoundCosts::prompt_read`]
    /// each) can pay for itself over the `model_tokens` tokens it is expected to draft for
    /// ([`crate::RecentAnswers::model_tokens`]): whether it costs no more than the model would
    /// save against plain decoding over them at the rate the cost model predicts for its drafts
    /// ([`RoundCosts::predicted_model_rate_after`], its acceptance estimates, not every token
    /// accepted). Where it cannot, reading the prompt only loses: on a long prompt with a short
    /// answer (stop 52: questions on ten passages of about 1,700 tokens in all, answers of 18–128
    /// tokens, where the hybrid drafter's reading took 3.4–5.8 s and made it 1.33 times as slow
    /// as plain decoding end to end), and on a medium prompt whose answer is short or copied by
    /// the lookup (stop 55: the grounded questions, about 200 prompt tokens, where a bound that
    /// took every drafted token as accepted and the whole token limit as the answer read every
    /// prompt). Where this round drafts nothing with the model, the rate is that of the best
    /// length at the acceptance estimates ([`best_draft_len_with`]): a model drafter alone reads
    /// no prompt later, so a first round at length 0 must not leave it unread for good.
    pub fn prompt_read_pays(&self, unread: usize, model_tokens: f64) -> bool {
        let price = self.prompt_read * unread as f64;
        if price <= 0.0 {
            return true;
        }
        let rate = if self.model_len > 0 {
            self.predicted_model_rate_after(0)
        } else {
            // A first round that drafts nothing (the cost model probes lengths soon after): the
            // best length its acceptance estimates price.
            best_draft_len_with(
                &self.model_acceptance,
                self.draft_fixed,
                self.draft_per_token,
                |m| self.r(m),
            )
            .tokens_per_step
        };
        let saving = (self.r(1) - 1.0 / rate.max(f64::MIN_POSITIVE)).max(0.0);
        price <= saving * model_tokens
    }

    /// What a model draft costs beyond its steady price when the model has `lag` committed tokens
    /// to read first ([`crate::Proposal::lag`]): reading a block of `m` tokens is priced like the
    /// target's `r(m)` (the draft runs the same kernels), and a steady round's reading of the last
    /// round's tokens, up to `r(2)`, is already in the fixed cost.
    pub fn catch_up(&self, lag: usize) -> f64 {
        self.draft_per_token * (self.r(lag) - self.r(2)).max(0.0)
    }

    /// The part of [`RoundCosts::catch_up`] a decision charges to this round: a model that drafts
    /// again goes on drafting in the rounds after, and the tokens it missed must be read before any
    /// of them, now or later, so the catch-up is shared by [`CATCH_UP_ROUNDS`] rounds, and a longer
    /// lag by about as many rounds as it took to build up (`lag / CATCH_UP_TOKENS`, at most
    /// [`CATCH_UP_MAX_ROUNDS`]). Charged whole, or shared by a fixed number of rounds, it grows
    /// with every round the model sits out and soon keeps it out for good, even where its drafts
    /// pay: stop 26's benchmark found the hybrid on 3 of 10 open-chat prompts drafting from lookup
    /// alone all the way (1.10–1.21× where the model drafter alone ran at 1.17–1.53×). The hybrid
    /// drafter reads the prompt into the model at prefill, so a lag builds up over lookup rounds;
    /// a very long one (past `CATCH_UP_TOKENS · CATCH_UP_MAX_ROUNDS` tokens) still weighs.
    pub fn catch_up_share(&self, lag: usize) -> f64 {
        let rounds = (lag as f64 / CATCH_UP_TOKENS).clamp(CATCH_UP_ROUNDS, CATCH_UP_MAX_ROUNDS);
        self.catch_up(lag) / rounds
    }

    /// [`RoundCosts::model_rate`] for a model with `lag` committed tokens to read first, charged
    /// its [`RoundCosts::catch_up_share`].
    pub fn model_rate_after(&self, lag: usize) -> f64 {
        self.model_rate * self.model_steps / (self.model_steps + self.catch_up_share(lag))
    }

    /// [`RoundCosts::model_rate_after`] without [`RoundCosts::model_factor`]: the model draft's rate
    /// as the cost model predicts it, which is how a model drafter alone weighs it against plain
    /// decoding.
    pub fn predicted_model_rate_after(&self, lag: usize) -> f64 {
        self.model_rate_after(lag) / self.model_factor.max(f64::MIN_POSITIVE)
    }

    /// A model round's cost in target steps: the model drafting `drafted` tokens with `lag`
    /// committed tokens to read first ([`RoundCosts::catch_up`]), and the target scoring a draft
    /// of `scored` tokens (more than `drafted` where the lookup continued the model's draft).
    pub fn model_round_steps(&self, drafted: usize, scored: usize, lag: usize) -> f64 {
        self.draft_fixed
            + self.draft_per_token * drafted as f64
            + self.catch_up(lag)
            + self.r(scored + 1)
    }

    /// The draft model's cost, in target steps, of extending a lookup draft of `lookup_len` tokens by
    /// `extension` tokens with `lag` committed tokens to read first: its fixed cost per round, its
    /// first step reading the unread tokens and the lookup draft in one block (priced like the
    /// target's `r`), and a step per drafted token.
    pub fn extension_draft_cost(&self, lag: usize, lookup_len: usize, extension: usize) -> f64 {
        // As in `catch_up`, reading up to two tokens is in the fixed cost.
        let read = (self.r(lag.max(1) + lookup_len) - self.r(2)).max(0.0);
        self.draft_fixed + self.draft_per_token * (extension as f64 + read)
    }

    /// For a lookup draft whose tokens have conditional acceptance `confidence`, drafted whole, the
    /// number of model tokens to extend it by (at most `max_len` tokens in all, at most
    /// `model_acceptance.len()` from the model) with the most expected tokens per target step, and
    /// that rate (before [`RoundCosts::extended_factor`]), for a model with `lag` committed tokens
    /// to read first (charged its [`RoundCosts::catch_up_share`]). `None` for an empty lookup draft,
    /// one whose last token ends the generation (`ends`: nothing after it is emitted), without room
    /// past it, or without a measured cost per model token.
    pub fn best_extension(
        &self,
        confidence: &[f32],
        ends: bool,
        max_len: usize,
        lag: usize,
    ) -> Option<(usize, f64)> {
        let lookup_len = confidence.len();
        if lookup_len == 0 || self.draft_per_token <= 0.0 || ends {
            return None;
        }
        let (mut reach, mut tokens) = (1.0, 1.0);
        for &a in confidence {
            reach *= f64::from(a);
            tokens += reach;
        }
        let room = max_len
            .saturating_sub(lookup_len)
            .min(self.model_acceptance.len());
        let mut best: Option<(usize, f64)> = None;
        for (i, &a) in self.model_acceptance[..room].iter().enumerate() {
            let k = i + 1;
            reach *= a;
            tokens += reach;
            // Reading the lookup draft is this round's own cost; catching up is shared.
            let cost = self.extension_draft_cost(0, lookup_len, k)
                + self.catch_up_share(lag)
                + self.r(lookup_len + k + 1);
            let rate = tokens / cost;
            if best.is_none_or(|(_, b)| rate > b) {
                best = Some((k, rate));
            }
        }
        best
    }
}

/// The length `k` in `0..=acceptance.len()` that maximises `E(k) / (k c + r(k + 1))`, where
/// `E(k) = Σ_{i=1..k} Π_{j≤i} a_j + 1` and `a` is the conditional acceptance per position. The smaller
/// length wins ties; `k = 0` (plain decoding, one token per target step) scores exactly 1 when
/// `r(1) = 1`.
pub fn best_draft_len(acceptance: &[f64], c: f64, r: impl Fn(usize) -> f64) -> Choice {
    best_draft_len_with(acceptance, 0.0, c, r)
}

/// [`best_draft_len`] with a fixed draft cost per drafting round: a draft of `k >= 1` tokens costs
/// `fixed + k c + r(k + 1)`.
pub fn best_draft_len_with(
    acceptance: &[f64],
    fixed: f64,
    c: f64,
    r: impl Fn(usize) -> f64,
) -> Choice {
    let mut best = Choice {
        draft_len: 0,
        expected_tokens: 1.0,
        tokens_per_step: 1.0 / r(1),
    };
    for k in 1..=acceptance.len() {
        let e = expected_tokens(&acceptance[..k]);
        let score = e / (fixed + k as f64 * c + r(k + 1));
        if score > best.tokens_per_step {
            best = Choice {
                draft_len: k,
                expected_tokens: e,
                tokens_per_step: score,
            };
        }
    }
    best
}

/// The cap on every sequence's model draft with the most expected tokens per unit of time for a
/// batch step, where the target scores all sequences' rows in one pass and the draft model drafts
/// all sequences' tokens together. Each sequence `i` plans a model draft of `plans[i].0` tokens with
/// conditional acceptance `plans[i].1` (its cost model's [`RoundCosts::model_len`] and
/// [`RoundCosts::model_acceptance`]); `other_rows` are rows the same pass scores for sequences that
/// are not decoding (a prompt's prefill chunk). A cap `K` drafts `min(k_i, K)` tokens for each:
/// the step yields `Σ E_i` tokens for `fixed` per drafting sequence, one draft step per position
/// whose `n` rows cost `c · r(n)` (the draft model runs the target's kernels, so its blocks are
/// priced by the same curve), and `r(rows)` for the target. A cap above 0 must beat none by
/// [`PAY_MARGIN`]. Each sequence's own cost model prices its rows as if it decoded alone, which on a
/// CPU where the target's cost per row stays flat for a few rows and then climbs misjudges a batch
/// both ways: stop 47 measured the server with two concurrent requests at 55–60 tok/s with no
/// drafting in batches and 121–128 with this cap.
pub fn best_batch_draft_cap(
    plans: &[(usize, &[f64])],
    other_rows: usize,
    fixed: f64,
    c: f64,
    r: impl Fn(usize) -> f64,
) -> usize {
    // Each plan's length, at most its acceptance estimates'.
    let lens: Vec<usize> = plans.iter().map(|&(k, a)| k.min(a.len())).collect();
    let longest = lens.iter().copied().max().unwrap_or(0);
    let rate = |cap: usize| {
        let (mut tokens, mut rows, mut draft) = (0.0, other_rows, 0.0);
        for (&(_, acceptance), &k) in plans.iter().zip(&lens) {
            let k = k.min(cap);
            tokens += expected_tokens(&acceptance[..k]);
            rows += k + 1;
            if k > 0 {
                draft += fixed;
            }
        }
        // One draft step per position, over the sequences still drafting there.
        for position in 1..=cap.min(longest) {
            let n = lens.iter().filter(|&&k| k >= position).count();
            draft += c * r(n);
        }
        tokens / (draft + r(rows))
    };
    let plain = rate(0);
    let mut best = (0, plain * (1.0 + PAY_MARGIN));
    for cap in 1..=longest {
        let x = rate(cap);
        if x > best.1 {
            best = (cap, x);
        }
    }
    best.0
}

/// How many tokens of each draft already made to score when several sequences share one target
/// pass: the lengths with the most expected tokens per unit of the pass's time. `drafts[i]` holds
/// draft `i`'s conditional acceptance estimates, one per drafted token; `rows` and `tokens` are the
/// pass's other rows (each decoding sequence's own, drafts that are not to be cut, a prompt's
/// prefill chunk) and the tokens they are expected to yield (one per decoding sequence, and those
/// uncut drafts' expected tokens). The `D` tokens kept are the `D` with the highest probability of
/// being reached and accepted, so each draft keeps a prefix (those probabilities fall along a
/// draft), and `D` maximises `(tokens + Σ reach) / r(rows + D)`; every draft is kept whole unless
/// a shorter set pays strictly more.
///
/// Each sequence's drafter cut its own draft as if the sequence decoded alone, where the first few
/// rows cost the target almost nothing; in a batch those rows are taken by the other sequences, and
/// on a CPU whose cost per row climbs beyond them the drafts together cost more than they bring.
/// The drafts are made before the cut, so their own cost is spent and not weighed here.
pub fn best_batch_trim(
    drafts: &[&[f64]],
    rows: usize,
    tokens: f64,
    r: impl Fn(usize) -> f64,
) -> Vec<usize> {
    let mut reach: Vec<(f64, usize, usize)> = Vec::new();
    for (i, acceptance) in drafts.iter().enumerate() {
        let mut p = 1.0;
        for (t, &a) in acceptance.iter().enumerate() {
            p *= a.clamp(0.0, 1.0);
            reach.push((p, i, t));
        }
    }
    // Most likely first; along one draft, earlier first among equals, so the kept set is a prefix
    // of each draft.
    reach.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.2.cmp(&b.2)));
    let total = reach.len();
    let mut yield_at = Vec::with_capacity(total + 1);
    let mut sum = tokens;
    yield_at.push(sum);
    for &(p, _, _) in &reach {
        sum += p;
        yield_at.push(sum);
    }
    let rate = |d: usize| yield_at[d] / r(rows + d);
    let mut best = (total, rate(total));
    for d in (0..total).rev() {
        let x = rate(d);
        if x > best.1 {
            best = (d, x);
        }
    }
    let mut keep = vec![0; drafts.len()];
    for &(_, i, _) in &reach[..best.0] {
        keep[i] += 1;
    }
    keep
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_noisy_cost_curve_reads_as_non_decreasing_and_at_least_one() {
        let r = [1.0, 0.84, 0.95, 1.16, 1.76, 1.5];
        let read: Vec<f64> = (1..=8).map(|m| curve_r(&r, m)).collect();
        assert_eq!(read, [1.0, 1.0, 1.0, 1.16, 1.76, 1.76, 1.76, 1.76]);
        let rising = [1.0, 1.2, 1.5];
        assert!((curve_r(&rising, 5) - 2.1).abs() < 1e-12);
        assert_eq!(curve_r(&[], 3), 1.0);
        assert_eq!(curve_r(&[0.5], 0), 1.0);
    }

    #[test]
    fn an_isotonic_curve_pools_a_disturbed_timing_with_its_neighbours() {
        let r = [1.0, 1.10, 1.19, 1.50, 2.47, 1.97, 2.10, 2.33];
        let fit = isotonic_curve(&r, &[]);
        let pooled = (2.47 + 1.97 + 2.10) / 3.0;
        let want = [1.0, 1.10, 1.19, 1.50, pooled, pooled, pooled, 2.33];
        assert_eq!(fit.len(), want.len());
        for (a, b) in fit.iter().zip(want) {
            assert!((a - b).abs() < 1e-12, "{fit:?}");
        }
        // The running maximum would have read r(5..=7) as 2.47.
        assert!(curve_r(&fit, 6) < 2.2);
        // A well-sampled point moves less than a point of one sample.
        let heavy = isotonic_curve(&[1.0, 2.0, 1.5], &[1.0, 9.0, 1.0]);
        assert!(
            (heavy[1] - 1.95).abs() < 1e-12 && heavy[1] == heavy[2],
            "{heavy:?}"
        );
        // Floored at 1, and the identity on a non-decreasing curve.
        assert_eq!(isotonic_curve(&[0.8, 0.9, 1.2], &[]), [1.0, 1.0, 1.2]);
        assert_eq!(
            isotonic_curve(&[1.0, 1.3, 1.3, 2.0], &[]),
            [1.0, 1.3, 1.3, 2.0]
        );
        assert!(isotonic_curve(&[], &[]).is_empty());
    }

    proptest::proptest! {
        /// The fit is non-decreasing, at least 1, as long as its input, and (on inputs of at least 1,
        /// which the floor leaves alone) keeps the weighted sum: pooling moves values, never mass.
        #[test]
        fn an_isotonic_curve_is_monotone_and_keeps_the_weighted_sum(
            v in proptest::collection::vec(1.0f64..8.0, 0..20),
            w in proptest::collection::vec(0.5f64..10.0, 20),
        ) {
            let fit = isotonic_curve(&v, &w);
            proptest::prop_assert_eq!(fit.len(), v.len());
            for pair in fit.windows(2) {
                proptest::prop_assert!(pair[0] <= pair[1] + 1e-12);
            }
            proptest::prop_assert!(fit.iter().all(|&r| r >= 1.0));
            let sum = |x: &[f64]| x.iter().zip(&w).map(|(a, b)| a * b).sum::<f64>();
            proptest::prop_assert!((sum(&fit) - sum(&v)).abs() < 1e-9 * (1.0 + sum(&v)));
        }
    }

    fn round(drafted: usize, accepted: usize) -> Round {
        Round {
            drafted,
            accepted,
            emitted: accepted + 1,
            verified: drafted + 1,
            ..Default::default()
        }
    }

    #[test]
    fn context_cost_is_recovered_from_blocks_timed_after_a_longer_context() {
        let r = [1.0, 1.02, 1.06, 1.12, 1.3];
        let (shared, per_row) = (1e-5, 4e-5);
        let timed: Vec<(usize, f64)> = [1, 2, 4, 5]
            .iter()
            .map(|&m| (m, r[m - 1] + (shared + m as f64 * per_row) * 1000.0))
            .collect();
        let cc = ContextCost::fit(100, 1100, &r, &timed).unwrap();
        assert_eq!(cc.at, 100);
        assert!((cc.shared - shared).abs() < 1e-12, "{cc:?}");
        assert!((cc.per_row - per_row).abs() < 1e-12, "{cc:?}");
        // Costs that fall with the rows are noise: no per-row cost.
        let falling: Vec<(usize, f64)> = [(1, 1.1), (4, 1.12)].to_vec();
        let cc = ContextCost::fit(100, 1100, &r, &falling).unwrap();
        assert_eq!(cc.per_row, 0.0);
        assert!(cc.shared >= 0.0);
        // A negative shared cost is refitted through the origin.
        let steep: Vec<(usize, f64)> = [(1, 1.0), (4, 1.12 + 0.4)].to_vec();
        let cc = ContextCost::fit(100, 1100, &r, &steep).unwrap();
        assert_eq!(cc.shared, 0.0);
        assert!(cc.per_row > 0.0);
        // Nothing to fit from.
        assert_eq!(ContextCost::fit(100, 100, &r, &timed), None);
        assert_eq!(ContextCost::fit(100, 1100, &r, &timed[..1]), None);
    }

    #[test]
    fn a_long_context_makes_blocks_dearer_and_speculation_pay_less() {
        let cost = FixedCost {
            c: 0.2,
            draft_fixed: 0.0,
            r: vec![1.0, 1.02, 1.05, 1.1, 1.2, 1.3],
            context: Some(ContextCost {
                at: 64,
                shared: 1e-5,
                per_row: 5e-5,
            }),
            step_secs: None,
            acceptance: Vec::new(),
            draft_read: None,
            draft_step_secs: None,
        };
        // At the calibrated context nothing moves.
        let same = cost.at_context(64);
        for m in 1..=8 {
            assert!((same.r(m) - cost.r(m)).abs() < 1e-12);
        }
        assert!((same.c - cost.c).abs() < 1e-12);
        // Further out r(1) stays 1 and every longer block costs more relative to it.
        let long = cost.at_context(4064);
        assert!((long.r(1) - 1.0).abs() < 1e-12);
        for m in 2..=8 {
            assert!(
                long.r(m) > cost.r(m),
                "r({m}) {} <= {}",
                long.r(m),
                cost.r(m)
            );
        }
        assert!(long.c < cost.c);
        // Below it, cheaper.
        assert!(cost.at_context(0).r(4) < cost.r(4));
        // Without a context cost, no change.
        let flat = FixedCost {
            context: None,
            step_secs: None,
            acceptance: Vec::new(),
            ..cost.clone()
        };
        assert_eq!(flat.at_context(4064), flat);
        // The controller prices rounds at the context it is told.
        let choose = |n: usize| {
            let mut c = DraftLenPolicy::CostModel {
                max: 6,
                cost: Some(cost.clone()),
                probe_every: 1000,
                prior: None,
            }
            .controller();
            c.set_context(n);
            c.next_draft_len();
            c.last_choice().unwrap()
        };
        let (short, far) = (choose(64), choose(8064));
        assert!(short.draft_len > 0, "{short:?}");
        assert!(far.draft_len <= short.draft_len, "{far:?} {short:?}");
        assert!(
            far.tokens_per_step < short.tokens_per_step,
            "{far:?} {short:?}"
        );
    }

    #[test]
    fn cost_model_declines_speculation_that_cannot_pay() {
        // A draft as expensive as the target never pays.
        let choice = best_draft_len(&[0.9; 8], 1.0, |m| 1.0 + 0.1 * (m as f64 - 1.0));
        assert_eq!(choice.draft_len, 0);
        // A cheap draft with high acceptance drafts long.
        let choice = best_draft_len(&[0.9; 8], 0.05, |m| 1.0 + 0.05 * (m as f64 - 1.0));
        assert!(choice.draft_len >= 5, "{choice:?}");
        // Low acceptance: short.
        let choice = best_draft_len(&[0.3; 8], 0.1, |m| 1.0 + 0.1 * (m as f64 - 1.0));
        assert!(choice.draft_len <= 1, "{choice:?}");
    }

    #[test]
    fn adaptive_moves_within_bounds() {
        let p = DraftLenPolicy::Adaptive {
            initial: 3,
            min: 2,
            max: 5,
            target_acceptance: 0.7,
            smoothing: 0.5,
        };
        p.validate().unwrap();
        let mut c = p.controller();
        for _ in 0..10 {
            let k = c.next_draft_len();
            c.observe(&round(k, k));
        }
        assert_eq!(c.next_draft_len(), 5);
        for _ in 0..10 {
            let k = c.next_draft_len();
            c.observe(&round(k, 0));
        }
        assert_eq!(c.next_draft_len(), 2);
    }

    #[test]
    fn cost_model_learns_acceptance() {
        let p = DraftLenPolicy::CostModel {
            max: 8,
            cost: Some(FixedCost {
                c: 0.1,
                draft_fixed: 0.0,
                r: vec![1.0, 1.1, 1.2, 1.3],
                context: None,
                step_secs: None,
                acceptance: Vec::new(),
                draft_read: None,
                draft_step_secs: None,
            }),
            probe_every: 1000,
            prior: None,
        };
        p.validate().unwrap();
        let mut c = p.controller();
        for _ in 0..200 {
            let k = c.next_draft_len();
            c.observe(&round(k, 0));
        }
        // Nothing is ever accepted: stop speculating.
        assert_eq!(c.next_draft_len(), 0);
    }

    /// A model drafter pays for catching up after rounds without drafting. If those rounds counted as
    /// samples of c, speculation would look too expensive and the cost model would settle on `k = 0`
    /// (what the old warm-up of alternating 1 and 0 did); here drafting is cheap (c = 0.3), acceptance
    /// high and verification flat enough, so it must settle on drafting.
    #[test]
    fn catch_up_after_rounds_without_drafting_does_not_count_as_draft_cost() {
        let p = DraftLenPolicy::CostModel {
            max: 8,
            cost: None,
            probe_every: 16,
            prior: None,
        };
        p.validate().unwrap();
        let mut c = p.controller();
        let mut prev = 1;
        let mut drafted_rounds = 0;
        for i in 0..400 {
            let k = c.next_draft_len();
            let catch_up = if prev == 0 { 3.0 } else { 0.0 };
            // Deterministic acceptance of 0.85 per position: accept while a fixed pattern allows.
            let accepted = (0..k).take_while(|j| (i * 7 + j * 13) % 20 < 17).count();
            c.observe(&Round {
                drafted: k,
                accepted,
                emitted: accepted + 1,
                draft_secs: 0.3 * k as f64 + catch_up,
                verify_secs: 1.0 + 0.25 * k as f64,
                verified: k + 1,
                lookup: false,
                expected: 0.0,
                expected_by_position: 0.0,
                extension: 0,
                prefix: 0,
                lag: 0,
                non_finite: false,
            });
            if i >= 300 && k > 0 {
                drafted_rounds += 1;
            }
            prev = k;
        }
        assert!(
            drafted_rounds >= 90,
            "drafted in {drafted_rounds} of the last 100 rounds"
        );
        let choice = c.last_choice().unwrap();
        assert!(choice.draft_len >= 2, "{choice:?}");
    }

    /// A model drafter that catches up on the rounds it missed takes longer than the cost model's
    /// `fixed + k c` (measured on steady rounds only): the model's rate that a hybrid weighs falls
    /// by what it realised, while lookup drafts that realised their prediction keep theirs.
    #[test]
    fn realised_rates_price_the_catch_up() {
        let fixed = FixedCost {
            c: 0.2,
            draft_fixed: 0.0,
            r: (1..=17).map(|m| 1.0 + 0.1 * (m - 1) as f64).collect(),
            context: None,
            step_secs: None,
            acceptance: Vec::new(),
            draft_read: None,
            draft_step_secs: None,
        };
        let p = DraftLenPolicy::CostModel {
            max: 4,
            cost: None,
            probe_every: 1000,
            prior: Some(fixed.clone()),
        };
        let mut c = p.controller();
        let ms = 1e-3;
        let timed = |drafted: usize, lookup: bool, draft_secs: f64| Round {
            drafted,
            accepted: drafted,
            emitted: drafted + 1,
            draft_secs,
            verify_secs: fixed.r(drafted + 1) * ms,
            verified: drafted + 1,
            lookup,
            expected: (drafted + 1) as f64,
            expected_by_position: (drafted + 1) as f64,
            extension: 0,
            prefix: 0,
            lag: 0,
            non_finite: false,
        };
        for _ in 0..40 {
            // No drafting, a lookup draft, then a model draft that also catches up on both rounds:
            // one target step's worth of extra draft time.
            c.next_draft_len();
            c.observe(&timed(0, false, 0.0));
            c.next_draft_len();
            c.observe(&timed(2, true, 0.0));
            let k = c.next_draft_len().max(1);
            c.observe(&timed(k, false, (fixed.c * k as f64 + 1.0) * ms));
        }
        let k = c.next_draft_len();
        assert!(k > 0);
        let costs = c.costs().unwrap().clone();
        let predicted = expected_tokens(&c.acceptance(k)) / (k as f64 * fixed.c + fixed.r(k + 1));
        // (r(k + 1) + k c) / (r(k + 1) + k c + 1) for k = 1..=4.
        let factor = costs.model_rate / predicted;
        assert!((0.5..0.8).contains(&factor), "model factor {factor}");
        assert!(
            (costs.lookup_factor - 1.0).abs() < 0.05,
            "{}",
            costs.lookup_factor
        );
    }

    /// A cost model with given costs: `c` target steps per drafted token, `r(m) = 1 + 0.1 (m - 1)`.
    fn given_costs(c: f64) -> DraftLenPolicy {
        DraftLenPolicy::CostModel {
            max: 4,
            cost: Some(FixedCost {
                c,
                draft_fixed: 0.0,
                r: vec![1.0, 1.1, 1.2, 1.3, 1.4],
                context: None,
                step_secs: None,
                acceptance: Vec::new(),
                draft_read: None,
                draft_step_secs: None,
            }),
            probe_every: 1000,
            prior: None,
        }
    }

    /// A round whose `drafted` tokens were all rejected, verified in one second.
    fn rejected(drafted: usize, lookup: bool) -> Round {
        Round {
            drafted,
            accepted: 0,
            emitted: 1,
            draft_secs: 0.0,
            verify_secs: 1.0,
            verified: drafted + 1,
            lookup,
            expected: 1.0,
            expected_by_position: 1.0,
            extension: 0,
            prefix: 0,
            lag: 0,
            non_finite: false,
        }
    }

    /// A hybrid's model that has not drafted alone for [`MODEL_PROBE_ROUNDS`] rounds is asked for a
    /// probe, whatever the rounds without it were (plain or lookup); a model round ends the ask.
    #[test]
    fn a_model_left_out_is_probed() {
        let p = given_costs(0.2);
        let mut c = p.controller();
        for i in 0..MODEL_PROBE_ROUNDS {
            c.next_draft_len();
            assert!(!c.costs().unwrap().probe_model, "round {i}");
            c.observe(&rejected(if i % 2 == 0 { 0 } else { 2 }, true));
        }
        c.next_draft_len();
        assert!(c.costs().unwrap().probe_model);
        c.observe(&rejected(2, false));
        c.next_draft_len();
        assert!(!c.costs().unwrap().probe_model);
    }

    /// The cost model's own probes (drafts at a length it did not choose) are flagged, so that a
    /// hybrid with no lookup draft makes them as a model drafter alone would; its chosen rounds
    /// without a draft are not.
    #[test]
    fn the_cost_models_probes_are_flagged_for_a_hybrid() {
        // At the prior acceptance (0.7) one token costs 0.6 + 1.1 steps for 1.7 tokens: 1 token
        // per step, within the margin of plain decoding's 1 but worth probing.
        let p = given_costs(0.6);
        let mut c = p.controller();
        let (mut probes, mut chosen) = (0, 0);
        for i in 0..12 {
            let k = c.next_draft_len();
            let choice = c.last_choice().unwrap().draft_len;
            let probe = c.costs().unwrap().probe_model;
            assert_eq!(probe, k > choice, "round {i}: k {k}, choice {choice}");
            if k > choice {
                probes += 1;
            } else {
                chosen += 1;
            }
            c.observe(&rejected(k, false));
        }
        assert!(
            probes >= 2 && chosen >= 6,
            "{probes} probes, {chosen} chosen"
        );
    }

    /// With given costs only tokens are corrected: lookup drafts that emit half the tokens their
    /// confidence promised halve the lookup's rate.
    #[test]
    fn realised_tokens_correct_the_lookup_rate() {
        let p = given_costs(0.2);
        let mut c = p.controller();
        for _ in 0..60 {
            c.next_draft_len();
            c.observe(&Round {
                drafted: 4,
                accepted: 1,
                emitted: 2,
                draft_secs: 0.0,
                // Timings are ignored with given costs.
                verify_secs: 5.0,
                verified: 5,
                lookup: true,
                expected: 4.0,
                expected_by_position: 4.0,
                extension: 0,
                prefix: 0,
                lag: 0,
                non_finite: false,
            });
        }
        c.next_draft_len();
        let costs = c.costs().unwrap();
        assert!((costs.lookup_factor - 0.5).abs() < 0.1, "{costs:?}");
        assert_eq!(costs.extended_factor, 1.0);
    }

    #[test]
    fn an_extension_pays_where_the_lookup_is_confident_and_the_model_cheap() {
        let costs = RoundCosts {
            r: (1..=17).map(|m| 1.0 + 0.1 * (m - 1) as f64).collect(),
            draft_fixed: 0.0,
            draft_per_token: 0.05,
            model_len: 4,
            model_rate: 1.2,
            model_acceptance: vec![0.9; 4],
            ..RoundCosts::default()
        };
        // Two confident lookup tokens: 2.71 expected tokens for r(3) = 1.2.
        let (len, lookup_rate) = costs.best_free_len(&[0.9, 0.9], false);
        assert_eq!(len, 2);
        let (k, rate) = costs.best_extension(&[0.9, 0.9], false, 8, 1).unwrap();
        assert!(
            k >= 1 && rate > lookup_rate * 1.05,
            "{k} {rate} {lookup_rate}"
        );
        // A lookup draft whose last token ends the generation: priced without a bonus token after
        // it (2.71 - 0.81 = 1.9 expected tokens whole, where one token brings 1.9 for r(2) = 1.1),
        // and never extended.
        let (len, ending_rate) = costs.best_free_len(&[0.9, 0.9], true);
        assert_eq!(len, 1);
        assert!((ending_rate - 1.9 / 1.1).abs() < 1e-6, "{ending_rate}");
        assert_eq!(costs.best_extension(&[0.9, 0.9], true, 8, 1), None);
        // No room past the lookup draft, no model cost known, no lookup draft: no extension.
        assert_eq!(costs.best_extension(&[0.9, 0.9], false, 2, 1), None);
        assert_eq!(costs.best_extension(&[], false, 8, 1), None);
        let free = RoundCosts {
            draft_per_token: 0.0,
            ..costs.clone()
        };
        assert_eq!(free.best_extension(&[0.9, 0.9], false, 8, 1), None);
        // An expensive model: the lookup draft alone is better.
        let dear = RoundCosts {
            draft_per_token: 0.9,
            ..costs
        };
        let (_, rate) = dear.best_extension(&[0.9, 0.9], false, 8, 1).unwrap();
        assert!(rate < lookup_rate, "{rate} {lookup_rate}");
    }

    /// With a calibration whose curve is much flatter than the machine's current one (a fast
    /// stretch of memory), a measuring cost model infers the single-token step from the blocks
    /// and prices them close to the calibration's proportions until it times a step itself (at most
    /// r(9) 1.54 against the calibration's 1.40 and the machine's 3.40): a plain round
    /// at [`PLAIN_PROBE_FIRST`], another [`PLAIN_PROBE_EVERY`] rounds after, none in between while
    /// it drafts; after the first, its curve is the machine's.
    #[test]
    fn a_measuring_cost_model_times_a_plain_step_now_and_then() {
        let r_true = |m: usize| 1.0 + 0.3 * (m as f64 - 1.0);
        let prior = FixedCost {
            c: 0.2,
            draft_fixed: 0.0,
            r: (1..=17).map(|m| 1.0 + 0.05 * (m - 1) as f64).collect(),
            context: None,
            step_secs: None,
            acceptance: Vec::new(),
            draft_read: None,
            draft_step_secs: None,
        };
        let p = DraftLenPolicy::auto(Some(prior));
        p.validate().unwrap();
        let mut c = p.controller();
        let mut plain = Vec::new();
        let mut timed = [0usize; 20];
        let (mut checked, mut before) = (0, 0);
        for i in 0..PLAIN_PROBE_FIRST + 2 * PLAIN_PROBE_EVERY + 4 {
            let k = c.next_draft_len();
            if c.costs().is_none() {
                assert_eq!(k, 0, "round {i}");
                plain.push(i);
            } else {
                assert!(k > 0, "round {i}: the drafts pay at either curve");
                if i > PLAIN_PROBE_FIRST && timed[k + 1] >= 4 {
                    // A length this run has timed often: its measured proportion to the step.
                    let r = c.costs().unwrap().r(k + 1);
                    let want = r_true(k + 1);
                    assert!(
                        (r - want).abs() < 0.05 * want,
                        "round {i}: r({}) {r}",
                        k + 1
                    );
                    checked += 1;
                } else if i < PLAIN_PROBE_FIRST && i > 0 {
                    // Before the probe: about the calibration's proportions (1 + 0.05 k), far
                    // from the machine's (1 + 0.3 k): the fit of the blocks timed with no step
                    // timed yet follows the calibration's shape.
                    let r = c.costs().unwrap().r(k + 1);
                    assert!(r < 1.0 + 0.1 * k as f64, "round {i}: r({}) {r}", k + 1);
                    before += 1;
                }
            }
            let accepted = (0..k)
                .take_while(|j| (i as usize * 7 + j * 13) % 20 < 17)
                .count();
            timed[k + 1] += 1;
            c.observe(&Round {
                drafted: k,
                accepted,
                emitted: accepted + 1,
                draft_secs: 0.2 * k as f64,
                verify_secs: r_true(k + 1),
                verified: k + 1,
                ..Default::default()
            });
        }
        assert!(
            checked > 100 && before > 3,
            "{checked} rounds checked, {before} before"
        );
        assert_eq!(
            plain,
            [
                PLAIN_PROBE_FIRST,
                PLAIN_PROBE_FIRST + PLAIN_PROBE_EVERY,
                PLAIN_PROBE_FIRST + 2 * PLAIN_PROBE_EVERY
            ]
        );
    }

    /// A calibrated draft step in seconds ([`FixedCost::draft_step_secs`]) is priced against the
    /// target's step now: a calibration made in a fast stretch of the target (22 ms a step, 8.8 ms a
    /// draft step: c 0.4) prices a draft token, and a prompt token's reading, at 0.29 of a step once
    /// the target's step is known at 30 ms, timed lately or by the run; without either time, at
    /// the calibration's ratio.
    #[test]
    fn a_draft_step_in_seconds_is_priced_against_the_targets_step_now() {
        let prior = |step_secs, draft_step_secs| FixedCost {
            c: 0.4,
            draft_fixed: 0.0,
            r: (1..=17).map(|m| 1.0 + 0.1 * (m - 1) as f64).collect(),
            context: None,
            step_secs,
            acceptance: Vec::new(),
            draft_read: Some(0.25),
            draft_step_secs,
        };
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        // The first round's prices, after plain rounds of 30 ms where none were priced.
        let first_costs = |p: FixedCost| {
            let policy = DraftLenPolicy::auto(Some(p));
            policy.validate().unwrap();
            let mut c = policy.controller();
            for _ in 0..8 {
                c.next_draft_len();
                if let Some(costs) = c.costs() {
                    return (costs.draft_per_token, costs.prompt_read);
                }
                c.observe(&Round {
                    emitted: 1,
                    verify_secs: 0.030,
                    verified: 1,
                    ..Default::default()
                });
            }
            panic!("no round was priced");
        };
        let now = 0.0088 / 0.030;
        let (c, read) = first_costs(prior(Some(0.030), Some(0.0088)));
        assert!(close(c, now) && close(read, now * 0.25), "{c} {read}");
        assert!(close(first_costs(prior(None, Some(0.0088))).0, 0.4));
        assert!(close(first_costs(prior(Some(0.030), None)).0, 0.4));
        // Timed by the run: plain steps of 30 ms, no draft step timed.
        let mut c = DraftLenPolicy::auto(Some(prior(None, Some(0.0088)))).controller();
        for _ in 0..WARMUP_ROUNDS + 2 {
            c.next_draft_len();
            c.observe(&Round {
                emitted: 1,
                verify_secs: 0.030,
                verified: 1,
                ..Default::default()
            });
        }
        c.next_draft_len();
        let c = c.costs().map(|c| c.draft_per_token);
        assert!(c.is_some_and(|c| (c - now).abs() < 1e-6), "{c:?}");
    }

    /// A step timed lately by an earlier generation ([`FixedCost::step_secs`]) is the unit of a
    /// measuring cost model that has not timed one itself: where the machine's blocks cost far more
    /// steps than the calibration says (a fast stretch of memory), drafting stops as soon as the
    /// blocks are timed, not at the first plain probe; without it the same rounds keep drafting at
    /// the calibration's proportions.
    #[test]
    fn a_recent_step_prices_the_first_blocks_before_the_run_times_one() {
        // Each drafted token costs 0.3 steps to draft and 0.3 to score, where the calibration has
        // 0.03: at about half of the drafted tokens accepted, no draft pays on this curve.
        let r_true = |m: usize| 1.0 + 0.3 * (m as f64 - 1.0);
        let run = |step_secs: Option<f64>| {
            let prior = FixedCost {
                c: 0.3,
                draft_fixed: 0.0,
                r: (1..=17).map(|m| 1.0 + 0.03 * (m - 1) as f64).collect(),
                context: None,
                step_secs,
                acceptance: Vec::new(),
                draft_read: None,
                draft_step_secs: None,
            };
            let p = DraftLenPolicy::auto(Some(prior));
            p.validate().unwrap();
            let mut c = p.controller();
            let mut lens = Vec::new();
            for i in 0..PLAIN_PROBE_FIRST {
                let k = c.next_draft_len();
                lens.push(k);
                let accepted = (0..k)
                    .take_while(|j| (i as usize * 7 + j * 13) % 20 < 10)
                    .count();
                c.observe(&Round {
                    drafted: k,
                    accepted,
                    emitted: accepted + 1,
                    draft_secs: 0.3 * k as f64,
                    verify_secs: r_true(k + 1),
                    verified: k + 1,
                    ..Default::default()
                });
            }
            lens
        };
        // The step is 1 second, as the blocks' timings assume.
        let seeded = run(Some(1.0));
        let unseeded = run(None);
        // Two rounds after the warm-up the timed blocks have outweighed the prior's estimates.
        let after_warmup = WARMUP_ROUNDS as usize + 2;
        assert!(
            unseeded[after_warmup..].iter().all(|&k| k > 0),
            "{unseeded:?}"
        );
        assert!(seeded[after_warmup..].iter().all(|&k| k == 0), "{seeded:?}");
        // A step as the calibration's curve infers it changes nothing.
        let r_flat = |m: usize| 1.0 + 0.02 * (m as f64 - 1.0);
        let prior = |step_secs| FixedCost {
            c: 0.2,
            draft_fixed: 0.0,
            r: (1..=17).map(r_flat).collect(),
            context: None,
            step_secs,
            acceptance: Vec::new(),
            draft_read: None,
            draft_step_secs: None,
        };
        let mut a = DraftLenPolicy::auto(Some(prior(Some(1.0)))).controller();
        let mut b = DraftLenPolicy::auto(Some(prior(None))).controller();
        for i in 0..PLAIN_PROBE_FIRST {
            let (ka, kb) = (a.next_draft_len(), b.next_draft_len());
            assert_eq!(ka, kb, "round {i}");
            if let (Some(x), Some(y)) = (a.costs(), b.costs()) {
                assert!((x.r(ka + 1) - y.r(ka + 1)).abs() < 1e-9, "round {i}");
            }
            let round = Round {
                drafted: ka,
                accepted: ka,
                emitted: ka + 1,
                draft_secs: 0.2 * ka as f64,
                verify_secs: r_flat(ka + 1),
                verified: ka + 1,
                ..Default::default()
            };
            a.observe(&round);
            b.observe(&round);
        }
    }

    /// The acceptance seen lately ([`FixedCost::acceptance`]) is where a sequence's estimates
    /// start: a model whose drafts were mostly rejected lately is not drafted with at first where
    /// the fixed prior would draft, and the sequence's own rounds still move the estimates.
    #[test]
    fn the_acceptance_seen_lately_is_the_prior_of_the_estimates() {
        let prior = |acceptance: Vec<f64>| FixedCost {
            c: 0.25,
            draft_fixed: 0.0,
            r: (1..=17).map(|m| 1.0 + 0.1 * (m - 1) as f64).collect(),
            context: None,
            step_secs: None,
            acceptance,
            draft_read: None,
            draft_step_secs: None,
        };
        let fresh = DraftLenPolicy::auto(Some(prior(Vec::new())));
        let seen = DraftLenPolicy::auto(Some(prior(vec![0.3, 0.2])));
        seen.validate().unwrap();
        let (mut a, mut b) = (fresh.controller(), seen.controller());
        assert_eq!(a.acceptance(3), [PRIOR_ACCEPTANCE; 3]);
        // Positions past the seen ones continue from the last estimate.
        assert_eq!(b.acceptance(3), [0.3, 0.2, 0.2]);
        assert!(a.next_draft_len() > 0);
        assert_eq!(b.next_draft_len(), 0);
        assert_eq!(b.last_choice().map(|c| c.draft_len), Some(0));
        // Rounds whose drafts were all accepted raise it (two per pseudo-round of the prior).
        for _ in 0..(2.0 * PRIOR_WEIGHT) as usize {
            b.observe(&Round {
                drafted: 2,
                accepted: 2,
                emitted: 3,
                verified: 3,
                ..Default::default()
            });
        }
        let est = b.acceptance(2);
        assert!(est[0] > 0.7 && est[1] > 0.7, "{est:?}");
        // Out of range, it is refused.
        assert!(DraftLenPolicy::auto(Some(prior(vec![1.5])))
            .validate()
            .is_err());
    }

    /// Given costs are not measured, so there is nothing to probe for.
    #[test]
    fn given_costs_are_never_probed_plainly() {
        let mut c = given_costs(0.2).controller();
        for i in 0..3 * PLAIN_PROBE_EVERY {
            c.next_draft_len();
            assert!(c.costs().is_some(), "round {i}");
            c.observe(&rejected(2, false));
        }
    }

    #[test]
    fn a_batch_trims_the_drafts_it_has_where_its_rows_stop_being_cheap() {
        let sure = [0.9; 8];
        let doubtful = [0.9, 0.3, 0.9];
        // `n` rows cost about one step, each further row one step.
        let knee = |n: usize| {
            move |m: usize| {
                if m <= n {
                    1.0 + 0.02 * (m - 1) as f64
                } else {
                    (m - n) as f64 + 1.0 + 0.02 * (n - 1) as f64
                }
            }
        };
        // Two decoding sequences leave two of four cheap rows: one token of each draft.
        assert_eq!(best_batch_trim(&[&sure, &sure], 2, 2.0, knee(4)), [1, 1]);
        // Three cheap rows left: the likelier token takes the third, the sure draft's second
        // against the doubtful one's.
        assert_eq!(
            best_batch_trim(&[&sure, &doubtful], 2, 2.0, knee(5)),
            [2, 1]
        );
        assert_eq!(
            best_batch_trim(&[&doubtful, &sure], 2, 2.0, knee(5)),
            [1, 2]
        );
        // Rows that stay cheap: every draft whole.
        let flat = |m: usize| 1.0 + 0.02 * (m - 1) as f64;
        assert_eq!(best_batch_trim(&[&sure, &doubtful], 2, 2.0, flat), [8, 3]);
        // Every row as dear as a step: no draft pays in a pass of two sequences.
        let steep = |m: usize| m as f64;
        assert_eq!(best_batch_trim(&[&sure, &sure], 2, 2.0, steep), [0, 0]);
        // Nothing to trim.
        assert!(best_batch_trim(&[], 3, 3.0, steep).is_empty());
    }

    #[test]
    fn a_batch_drafts_where_rows_stay_cheap_and_decodes_plainly_where_they_climb() {
        let acceptance = [0.9; 4];
        let plans: Vec<(usize, &[f64])> = vec![(4, &acceptance), (4, &acceptance)];
        // Flat for 10 rows (this project's Zen 4 in a slow stretch, roughly): both drafts whole.
        let flat = |m: usize| 1.0 + 0.05 * m as f64;
        assert_eq!(best_batch_draft_cap(&plans, 0, 0.0, 0.1, flat), 4);
        // Every row as dear as a step (a CPU bound by its multiply-adds): plain batching.
        let steep = |m: usize| m as f64;
        assert_eq!(best_batch_draft_cap(&plans, 0, 0.0, 0.2, steep), 0);
        // Cheap rows but a dear draft model: no drafting either.
        assert_eq!(best_batch_draft_cap(&plans, 0, 0.0, 2.0, flat), 0);
        // Flat for 6 rows, then each row 0.6 of a step: the first two tokens of each draft pay.
        let knee = |m: usize| 1.0 + 0.05 * (m.min(6) - 1) as f64 + 0.6 * m.saturating_sub(6) as f64;
        assert_eq!(best_batch_draft_cap(&plans, 0, 0.0, 0.1, knee), 2);
        // A prompt's prefill chunk in the same pass takes the flat part.
        assert_eq!(best_batch_draft_cap(&plans, 4, 0.0, 0.1, knee), 0);
        // No sequence planned a model draft: nothing to cap.
        let none: Vec<(usize, &[f64])> = vec![(0, &[]), (0, &[])];
        assert_eq!(best_batch_draft_cap(&none, 0, 0.0, 0.2, flat), 0);
    }

    #[test]
    fn a_prompt_is_read_only_where_the_model_could_repay_it() {
        let costs = RoundCosts {
            r: (1..=17).map(|m| 1.0 + 0.1 * (m - 1) as f64).collect(),
            draft_per_token: 0.25,
            prompt_read: 0.05,
            model_len: 3,
            model_rate: 1.25,
            model_steps: 2.05,
            ..RoundCosts::default()
        };
        // The model's drafts are predicted at 1.25 tokens per step: a saving of 1 - 1 / 1.25 = 0.2
        // steps per token it drafts for, against 0.05 per prompt token read.
        let needed = |unread: usize| 0.05 * unread as f64 / 0.2;
        for unread in [1, 200, 1_700] {
            assert!(
                costs.prompt_read_pays(unread, needed(unread) * 1.01),
                "{unread}"
            );
            assert!(
                !costs.prompt_read_pays(unread, needed(unread) * 0.99),
                "{unread}"
            );
        }
        // The realised factor is left out: the model is priced as predicted.
        let unlucky = RoundCosts {
            model_rate: 1.25 * 0.5,
            model_factor: 0.5,
            ..costs.clone()
        };
        assert!(unlucky.prompt_read_pays(200, needed(200) * 1.01));
        // Nothing to read, or no known price: read.
        assert!(costs.prompt_read_pays(0, 0.0));
        let unpriced = RoundCosts {
            prompt_read: 0.0,
            ..costs.clone()
        };
        assert!(unpriced.prompt_read_pays(1_700, 1.0));
        // A round that drafts nothing with the model prices its best length at the acceptance
        // estimates: at 0.8, 2 tokens yield 2.44 for 1.7 steps, a saving of 1 - 1.7 / 2.44.
        let idle = RoundCosts {
            model_len: 0,
            model_acceptance: vec![0.8; 2],
            ..costs.clone()
        };
        let idle_saving = 1.0 - 1.7 / 2.44;
        assert!(idle.prompt_read_pays(200, 0.05 * 200.0 / idle_saving * 1.01));
        assert!(!idle.prompt_read_pays(200, 0.05 * 200.0 / idle_saving * 0.99));
        let none = RoundCosts {
            model_acceptance: Vec::new(),
            ..idle
        };
        assert!(!none.prompt_read_pays(10, 100_000.0));
        // A model slower than plain decoding never repays.
        let dear = RoundCosts {
            model_rate: 0.9,
            ..costs
        };
        assert!(!dear.prompt_read_pays(10, 100_000.0));
    }

    #[test]
    fn a_capped_model_draft_is_repriced() {
        let mut costs = RoundCosts {
            r: vec![1.0, 1.1, 1.2, 1.3, 1.4],
            draft_per_token: 0.2,
            model_len: 4,
            model_rate: 9.0,
            model_factor: 0.5,
            model_steps: 9.0,
            model_acceptance: vec![0.5; 4],
            ..RoundCosts::default()
        };
        costs.cap_model_len(6);
        assert_eq!((costs.model_len, costs.model_rate), (4, 9.0));
        costs.cap_model_len(2);
        assert_eq!(costs.model_len, 2);
        assert!((costs.model_steps - (0.4 + 1.2)).abs() < 1e-12, "{costs:?}");
        let want = (1.0 + 0.5 + 0.25) / 1.6 * 0.5;
        assert!((costs.model_rate - want).abs() < 1e-12, "{costs:?}");
        costs.cap_model_len(0);
        assert_eq!(
            (costs.model_len, costs.model_steps, costs.model_rate),
            (0, 1.0, 1.0)
        );
    }

    #[test]
    fn median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median(&[4.0, 1.0]), Some(2.5));
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn invalid_policies_are_rejected() {
        assert!(DraftLenPolicy::Fixed { draft_len: 0 }.validate().is_err());
        assert!(DraftLenPolicy::Fixed { draft_len: 65 }.validate().is_err());
        assert!(DraftLenPolicy::Adaptive {
            initial: 1,
            min: 2,
            max: 3,
            target_acceptance: 0.5,
            smoothing: 0.5
        }
        .validate()
        .is_err());
        assert!(DraftLenPolicy::CostModel {
            max: 4,
            cost: Some(FixedCost {
                c: f64::NAN,
                draft_fixed: 0.0,
                r: vec![1.0],
                context: None,
                step_secs: None,
                acceptance: Vec::new(),
                draft_read: None,
                draft_step_secs: None,
            }),
            probe_every: 8,
            prior: None,
        }
        .validate()
        .is_err());
    }

    #[test]
    fn the_draft_models_confidence_is_calibrated_by_what_the_target_accepted() {
        let mut c = ConfidenceCalibration::default();
        // Before any round, the confidence itself; not a number stays one.
        assert_eq!(c.acceptance(0.9), f64::from(0.9f32));
        assert!(c.acceptance(f32::NAN).is_nan());
        // Rounds whose first token, drafted at 0.92, was rejected: the token after it is never
        // verified and teaches nothing.
        for _ in 0..200 {
            c.observe(&[0.92, 0.5], 0);
        }
        assert!(c.acceptance(0.92) < 0.05, "{}", c.acceptance(0.92));
        assert!(c.acceptance(0.91) < 0.05);
        assert_eq!(c.acceptance(0.5), f64::from(0.5f32));
        // Tokens at 0.75 accepted in every other round: about one half.
        for i in 0..200 {
            c.observe(&[0.75], i % 2);
        }
        let half = c.acceptance(0.75);
        assert!((0.45..0.56).contains(&half), "{half}");
        // Tokens at 0.65 always accepted: raised, at most to 1.
        for _ in 0..200 {
            c.observe(&[0.65], 1);
        }
        assert!(c.acceptance(0.65) > 0.95 && c.acceptance(0.65) <= 1.0);
        // The other bins keep their own counts, decayed round by round.
        assert!(c.acceptance(0.92) < 0.3, "{}", c.acceptance(0.92));
        assert_eq!(c.acceptance(0.3), f64::from(0.3f32));
    }

    #[test]
    fn the_round_costs_carry_the_confidence_calibration_learned_so_far() {
        let mut c = DraftLenPolicy::auto(Some(FixedCost {
            c: 0.1,
            draft_fixed: 0.0,
            r: vec![1.0, 1.1, 1.2, 1.3, 1.4],
            context: None,
            step_secs: None,
            acceptance: vec![0.8; 4],
            draft_read: None,
            draft_step_secs: None,
        }))
        .controller();
        for _ in 0..50 {
            c.observe_confidence(&[0.97], 0);
        }
        c.next_draft_len();
        let costs = c.costs().expect("a prior prices the first round");
        assert_eq!(costs.calibration, *c.calibration());
        assert!(costs.calibration.acceptance(0.97) < 0.2);
    }

    #[test]
    fn a_model_draft_goes_on_while_its_reach_pays_for_the_tokens_after_it() {
        // The third row costs 0.4 steps, the fourth and fifth 0.05 each; c = 0.2, 1.5 tokens a
        // step; positions 1..=4 estimated accepted at 0.5, 0.9, 0.9, 0.6.
        let costs = RoundCosts {
            r: vec![1.0, 1.1, 1.5, 1.55, 1.6],
            draft_per_token: 0.2,
            model_len: 4,
            model_rate: 1.5,
            model_acceptance: vec![0.5, 0.9, 0.9, 0.6],
            ..RoundCosts::default()
        };
        // After one token at reach 0.9: the second alone yields 0.81 for 0.6 steps (0.9 tokens),
        // but with the third 1.54 for 0.85 steps (1.275 tokens): drafted on.
        assert!(costs.drafts_on(1, 0.9, 4));
        // Not where the request cannot reach the third token.
        assert!(!costs.drafts_on(1, 0.9, 2));
        // At reach 0.5 no length pays: 0.45, 0.86 and 1.10 tokens against 0.9, 1.275 and 1.65.
        assert!(!costs.drafts_on(1, 0.5, 4));
        // After three at reach 0.8: the fourth yields 0.48 (its estimate 0.6) for 0.25 steps
        // (0.375 tokens); at reach 0.6, 0.36.
        assert!(costs.drafts_on(3, 0.8, 4));
        assert!(!costs.drafts_on(3, 0.6, 4));
        // Never past the cost model's length; a NaN reach drafts on.
        assert!(!costs.drafts_on(4, 1.0, 8));
        assert!(costs.drafts_on(1, f64::NAN, 4));
    }
}
