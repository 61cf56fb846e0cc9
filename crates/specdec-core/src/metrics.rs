//! Metrics: plain, serialisable counters and timings of a generation, and the figures derived from them.

use serde::{Deserialize, Serialize};

use crate::verify::expected_tokens;

/// What one round did, as the decoder reports it to [`Metrics`] and to the draft-length controller.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Round {
    /// Tokens drafted.
    pub drafted: usize,
    /// Drafted tokens accepted.
    pub accepted: usize,
    /// Tokens emitted (`accepted + 1`, fewer when a stop token or the limit cut the round).
    pub emitted: usize,
    /// Seconds spent drafting.
    pub draft_secs: f64,
    /// Seconds the target spent scoring.
    pub verify_secs: f64,
    /// Tokens the target scored in one pass: `drafted + 1`.
    pub verified: usize,
    /// Whether the draft came from lookup (a proposal with confidence estimates) rather than a model.
    pub lookup: bool,
    /// Tokens the round was expected to emit, estimated before verification, with no bonus token
    /// after a draft whose last token ends the generation (0 when unknown): a lookup token at the
    /// lookup's estimate as the cost model calibrates it in this sequence, a model token at the
    /// draft model's confidence as the cost model calibrates it where the drafter gave one
    /// ([`crate::ConfidenceCalibration`]), else at the cost model's acceptance for its position.
    /// Sums to the predicted speedup's tokens.
    pub expected: f64,
    /// [`Round::expected`] with every model token at the cost model's acceptance for its position
    /// (the estimates that planned the round), which the cost model's realised factors compare
    /// the round against.
    pub expected_by_position: f64,
    /// Of the drafted tokens, how many a model drafted to extend a lookup draft (then `lookup` holds
    /// too); 0 otherwise.
    pub extension: usize,
    /// Of the drafted tokens, how many a model drafted before the lookup continued them (then
    /// `lookup` holds too); 0 otherwise.
    pub prefix: usize,
    /// The model's catch-up before drafting ([`crate::Proposal::lag`]).
    pub lag: usize,
    /// Whether the model's draft ended at logits that were not finite
    /// ([`crate::Proposal::non_finite`]).
    pub non_finite: bool,
}

/// Acceptance at one draft position.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PositionStats {
    /// Rounds in which this position was drafted and every earlier one accepted.
    pub reached: u64,
    /// Of those, rounds in which it was accepted.
    pub accepted: u64,
}

/// Target calls that scored `m` tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct VerifyTiming {
    /// Tokens per call.
    pub m: usize,
    /// Calls.
    pub calls: u64,
    /// Seconds in all.
    pub secs: f64,
}

/// The draft model's cost as a cost model measured it in a generation's drafting rounds: a round
/// drafting `k` tokens took `fixed_secs + per_token_secs · k` seconds (a least-squares line through
/// the median time at each length; [`crate::Controller::draft_cost`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DraftCost {
    /// Seconds a round costs whatever its length (reading the tokens the last verification added).
    pub fixed_secs: f64,
    /// Seconds per drafted token.
    pub per_token_secs: f64,
    /// The drafting rounds behind the line.
    pub rounds: u64,
}

/// Counters and timings of one generation (or the sum of several).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Rounds after prefill (each emits at least one token).
    pub rounds: u64,
    /// Tokens drafted.
    pub drafted: u64,
    /// Drafted tokens accepted.
    pub accepted: u64,
    /// Tokens emitted by rounds; the first token, sampled at prefill, is not counted.
    pub emitted: u64,
    /// Acceptance by draft position (index 0 is the first drafted token of a round).
    pub per_position: Vec<PositionStats>,
    /// [`Metrics::per_position`] of the model's drafts alone, as the cost model counts them: a
    /// lookup draft's positions count only where it continued a model draft, up to the model's
    /// last token.
    #[serde(default)]
    pub model_per_position: Vec<PositionStats>,
    /// Rounds by the number of tokens drafted (index = draft length).
    pub rounds_by_draft_len: Vec<u64>,
    /// Target calls by block length (index `m - 1`), decode only.
    pub verify_by_len: Vec<VerifyTiming>,
    /// Seconds of prompt processing, target and draft, and the first token: the time to the first
    /// token ([`Metrics::first_token_secs`]) and the drafter's reading of the prompt after it.
    pub prefill_secs: f64,
    /// Seconds from the start of prefill to the first token: the target's prefill and sampling
    /// (the drafter reads the prompt after the first token is out).
    #[serde(default)]
    pub first_token_secs: f64,
    /// Seconds of drafting.
    pub draft_secs: f64,
    /// Seconds of target scoring during decode.
    pub verify_secs: f64,
    /// Wall-clock seconds of the rounds after prefill (drafting, scoring, sampling, verification).
    pub decode_secs: f64,
    /// The sum of the rounds' expected tokens ([`Round::expected`]).
    #[serde(default)]
    pub expected: f64,
    /// Rounds whose lookup draft a model extended.
    #[serde(default)]
    pub extended_rounds: u64,
    /// Rounds whose model draft the lookup continued ([`crate::continue_by_lookup`]).
    #[serde(default)]
    pub continued_rounds: u64,
    /// Rounds whose model draft ended because the draft model's logits were not finite (NaN or
    /// infinite; [`crate::Proposal::non_finite`]): the target decodes on, but a draft model that
    /// does so in every round drafts nothing, and this says why.
    #[serde(default)]
    pub non_finite_rounds: u64,
    /// The draft model's cost as the generation's cost model last measured it, where it timed
    /// drafting rounds of its own (`--draft-len auto`): what a later generation of the same
    /// process may start from instead of a calibration timed minutes before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft_cost: Option<DraftCost>,
}

impl Metrics {
    /// Folds this run's model-draft counts by position ([`Metrics::model_per_position`]) into
    /// `positions`, the `(reached, accepted)` counts of earlier runs, which first weigh `decay`
    /// each; a run whose model drafted nothing leaves them as they are. What a later run's cost
    /// model starts from ([`crate::acceptance_by_position`]).
    pub fn fold_model_positions(&self, positions: &mut Vec<(f64, f64)>, decay: f64) {
        let run = &self.model_per_position;
        if run.iter().all(|p| p.reached == 0) {
            return;
        }
        for p in positions.iter_mut() {
            p.0 *= decay;
            p.1 *= decay;
        }
        if positions.len() < run.len() {
            positions.resize(run.len(), (0.0, 0.0));
        }
        for (p, s) in positions.iter_mut().zip(run) {
            p.0 += s.reached as f64;
            p.1 += s.accepted as f64;
        }
    }

    /// Adds one round.
    pub fn record(&mut self, r: &Round) {
        self.rounds += 1;
        self.drafted += r.drafted as u64;
        self.accepted += r.accepted as u64;
        self.emitted += r.emitted as u64;
        self.draft_secs += r.draft_secs;
        self.verify_secs += r.verify_secs;
        self.expected += r.expected;
        self.extended_rounds += u64::from(r.extension > 0);
        self.continued_rounds += u64::from(r.prefix > 0);
        self.non_finite_rounds += u64::from(r.non_finite);
        grow(&mut self.rounds_by_draft_len, r.drafted + 1);
        self.rounds_by_draft_len[r.drafted] += 1;
        grow(&mut self.per_position, r.drafted);
        for (i, s) in self.per_position.iter_mut().take(r.drafted).enumerate() {
            if i > r.accepted {
                break;
            }
            s.reached += 1;
            s.accepted += u64::from(i < r.accepted);
        }
        let model_drafted = if r.lookup { r.prefix } else { r.drafted };
        grow(&mut self.model_per_position, model_drafted);
        let model = self.model_per_position.iter_mut().take(model_drafted);
        for (i, s) in model.take(r.accepted + 1).enumerate() {
            s.reached += 1;
            s.accepted += u64::from(i < r.accepted);
        }
        if r.verified > 0 {
            grow(&mut self.verify_by_len, r.verified);
            let t = &mut self.verify_by_len[r.verified - 1];
            t.m = r.verified;
            t.calls += 1;
            t.secs += r.verify_secs;
        }
    }

    /// Accepted / drafted.
    pub fn acceptance_rate(&self) -> f64 {
        ratio(self.accepted as f64, self.drafted as f64)
    }

    /// Tokens per round as vLLM defines it: `1 + accepted / rounds`.
    pub fn mean_accepted_len(&self) -> f64 {
        1.0 + ratio(self.accepted as f64, self.rounds as f64)
    }

    /// Conditional acceptance rate at each draft position.
    pub fn per_position_acceptance(&self) -> Vec<f64> {
        self.per_position
            .iter()
            .map(|s| ratio(s.accepted as f64, s.reached as f64))
            .collect()
    }

    /// Tokens emitted by rounds per second of decoding (after prefill).
    pub fn decode_tokens_per_s(&self) -> f64 {
        ratio(self.emitted as f64, self.decode_secs)
    }

    /// The cost profile measured in this generation: the draft/target step-cost ratio `c` and the
    /// verification cost curve `r(m)`.
    pub fn cost_profile(&self) -> Option<CostProfile> {
        self.cost_profile_with(None)
    }

    /// [`Metrics::cost_profile`] with the shape of a calibrated curve `r(m)` (`prior[m - 1]`) for
    /// `t(1)` when this generation never timed a single-token step (see [`CostProfile::fit_with`]).
    pub fn cost_profile_with(&self, prior: Option<&[f64]>) -> Option<CostProfile> {
        CostProfile::fit_with(
            ratio(self.draft_secs, self.drafted as f64),
            &self.verify_by_len,
            prior,
        )
    }

    /// The speedup the cost model predicts: the tokens the rounds were expected to emit before they
    /// were verified ([`Round::expected`]; where unknown, `E(k)` from the measured per-position
    /// acceptance) over their cost in target steps, `Σ_k n_k (k c + r(k + 1))` with the fitted `c`
    /// and `r`. `None` until the target was timed at two or more block lengths: from one length
    /// alone, `t(1)` and so `c` and `r(m)` would rest on [`CostProfile::PRIOR_SLOPE`], and the
    /// prediction on a guess.
    pub fn predicted_speedup(&self) -> Option<f64> {
        self.predicted_speedup_with(None)
    }

    /// [`Metrics::predicted_speedup`] with a calibrated curve `r(m)` (`prior[m - 1]`) whose shape
    /// gives `t(1)` when this generation never timed a single-token step (a model drafter that
    /// drafted in every round). With a prior, one timed block length suffices.
    pub fn predicted_speedup_with(&self, prior: Option<&[f64]>) -> Option<f64> {
        self.prediction_with(prior).map(|p| p.speedup())
    }

    /// The terms of [`Metrics::predicted_speedup_with`]: the tokens the rounds were expected to
    /// emit, their cost in target steps and the step's seconds in this run.
    pub fn prediction_with(&self, prior: Option<&[f64]>) -> Option<Prediction> {
        let cost = self.cost_profile_with(prior)?;
        if cost.measured.len() < 2 && prior.is_none() {
            return None;
        }
        let a = self.per_position_acceptance();
        let (mut pooled, mut time) = (0.0, 0.0);
        for (k, &n) in self.rounds_by_draft_len.iter().enumerate() {
            let n = n as f64;
            if self.expected == 0.0 {
                pooled += n * expected_tokens(&a[..k.min(a.len())]);
            }
            time += n * (k as f64 * cost.c + cost.r(k + 1));
        }
        let tokens = if self.expected > 0.0 {
            self.expected
        } else {
            pooled
        };
        (time > 0.0).then_some(Prediction {
            tokens,
            steps: time,
            target_step_secs: cost.target_step_secs,
        })
    }

    /// The mean seconds of the run's single-token target steps (its plain rounds and probes, or
    /// every step of plain decoding) and how many it timed; `None` where it timed none.
    pub fn single_steps(&self) -> Option<(f64, u64)> {
        self.verify_by_len
            .first()
            .filter(|t| t.m == 1 && t.calls > 0 && t.secs > 0.0)
            .map(|t| (t.secs / t.calls as f64, t.calls))
    }

    /// Decode tokens/s relative to a baseline run (plain decoding through the same loop).
    pub fn measured_speedup(&self, baseline: &Metrics) -> f64 {
        ratio(self.decode_tokens_per_s(), baseline.decode_tokens_per_s())
    }
}

/// The cost model's prediction for one generation ([`Metrics::prediction_with`]), in its terms.
///
/// Against a plain run that emitted its tokens at `t_plain` seconds each, the measured speedup is
/// `emitted · t_plain / decode_secs`, so the prediction over it is exactly the product of three
/// factors ([`Prediction::factors`]): the acceptance (`tokens / emitted`), the time (`decode_secs`
/// over `steps · target_step_secs`) and the machine (`target_step_secs / t_plain`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Tokens the rounds were expected to emit before they were verified.
    pub tokens: f64,
    /// The rounds' cost in target steps, `Σ_k n_k (k c + r(k + 1))`.
    pub steps: f64,
    /// Seconds of one target step in this generation (`t(1)` of its [`CostProfile`]).
    pub target_step_secs: f64,
}

impl Prediction {
    /// Predicted speedup: tokens per target step.
    pub fn speedup(&self) -> f64 {
        self.tokens / self.steps
    }

    /// Where the prediction and a measured speedup part: given the generation's emitted tokens and
    /// decoding seconds and a plain run's seconds per token, the factors whose product is the
    /// predicted over the measured speedup. `None` where a factor is not finite.
    pub fn factors(
        &self,
        emitted: u64,
        decode_secs: f64,
        plain_token_secs: f64,
    ) -> Option<PredictionFactors> {
        let f = PredictionFactors {
            acceptance: self.tokens / emitted as f64,
            time: decode_secs / (self.steps * self.target_step_secs),
            machine: self.target_step_secs / plain_token_secs,
        };
        [f.acceptance, f.time, f.machine]
            .iter()
            .all(|x| x.is_finite() && *x > 0.0)
            .then_some(f)
    }
}

/// The predicted over the measured speedup of one generation, as the product of three factors
/// ([`Prediction::factors`]); each is 1 where that part of the prediction held.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PredictionFactors {
    /// The tokens the rounds were expected to emit over those they emitted: the acceptance
    /// estimate's error (above 1: fewer drafted tokens were accepted than expected).
    pub acceptance: f64,
    /// Decoding seconds over the cost model's (its steps at this generation's own target step):
    /// what the cost of drafts and blocks relative to a step, and the round's overhead, add.
    pub time: f64,
    /// This generation's target step over the plain run's seconds per token: the machine's speed
    /// drifting between the two runs (both do the same work per step).
    pub machine: f64,
}

impl PredictionFactors {
    /// The product: the predicted over the measured speedup.
    pub fn product(&self) -> f64 {
        self.acceptance * self.time * self.machine
    }
}

/// The costs that decide whether speculation pays, in units of one target step on one token.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostProfile {
    /// Seconds of one target step on one token (`t(1)`).
    pub target_step_secs: f64,
    /// Draft cost per drafted token divided by `t(1)`.
    pub c: f64,
    /// `r(m) = 1 + slope (m - 1)` where no measurement exists.
    pub slope: f64,
    /// Measured `(m, r(m))` pairs.
    pub measured: Vec<(usize, f64)>,
}

impl CostProfile {
    /// The slope assumed when only one block length was measured: r(m) = 1 + 0.15 (m - 1), r(8) = 2.05.
    /// An optimistic prior, so that speculation is tried until two block lengths are measured: on this
    /// project's two-core machines `specdec bench` calibrates about 4.4 with the row-by-row kernels.
    pub const PRIOR_SLOPE: f64 = 0.15;

    /// Fits `t(m) = t1 (1 + slope (m - 1))` to the measured per-call times (weighted by calls) and
    /// derives `c` from the draft's seconds per token: `t1` is the measured single-token time when
    /// there is one (so `r(1) = 1` and every measured `r(m)` is relative to it), else the intercept
    /// of a least-squares line. `None` without any timing.
    pub fn fit(draft_secs_per_token: f64, verify: &[VerifyTiming]) -> Option<Self> {
        Self::fit_with(draft_secs_per_token, verify, None)
    }

    /// [`CostProfile::fit`], where a single-token step was not timed but a calibrated curve `r(m)`
    /// (`prior[m - 1]`, continued past its end with its last slope) is known: `t(1)` is then the
    /// measured time over the calibrated cost, `Σ secs / Σ calls · r_prior(m)`, so that the measured
    /// blocks keep their calibrated proportions instead of resting on a line's intercept (which a
    /// convex `r(m)` measured at two or three lengths puts far off).
    pub fn fit_with(
        draft_secs_per_token: f64,
        verify: &[VerifyTiming],
        prior: Option<&[f64]>,
    ) -> Option<Self> {
        let pts: Vec<(f64, f64, f64)> = verify
            .iter()
            .filter(|t| t.calls > 0 && t.secs > 0.0)
            .map(|t| (t.m as f64, t.secs / t.calls as f64, t.calls as f64))
            .collect();
        let first = pts.first()?;
        // The slope of r(m) - 1 on m - 1 through the origin, by least squares (a line through the
        // single-token time).
        let slope_from = |t1: f64| {
            let (mut sxy, mut sxx) = (0.0, 0.0);
            for &(m, t, w) in pts.iter().filter(|p| p.0 > 1.0) {
                sxy += w * (m - 1.0) * (t / t1 - 1.0);
                sxx += w * (m - 1.0) * (m - 1.0);
            }
            if sxx > 0.0 {
                (sxy / sxx).max(0.0)
            } else {
                Self::PRIOR_SLOPE
            }
        };
        let prior = prior.filter(|r| !r.is_empty() && first.0 != 1.0);
        let (t1, slope) = if first.0 == 1.0 && pts.len() >= 2 {
            // t(1) was measured: every r(m) is relative to it.
            let t1 = first.1;
            (t1, slope_from(t1))
        } else if let Some(r) = prior {
            let secs: f64 = pts.iter().map(|p| p.2 * p.1).sum();
            let cost: f64 = pts
                .iter()
                .map(|p| p.2 * crate::policy::curve_r(r, p.0 as usize))
                .sum();
            let t1 = secs / cost;
            (t1, slope_from(t1))
        } else if pts.len() == 1 {
            let (m, t, _) = *first;
            let t1 = t / (1.0 + Self::PRIOR_SLOPE * (m - 1.0));
            (t1, Self::PRIOR_SLOPE)
        } else {
            // Weighted least squares of t on (m - 1): t = a + b (m - 1).
            let w: f64 = pts.iter().map(|p| p.2).sum();
            let mx = pts.iter().map(|p| p.2 * (p.0 - 1.0)).sum::<f64>() / w;
            let my = pts.iter().map(|p| p.2 * p.1).sum::<f64>() / w;
            let sxx: f64 = pts.iter().map(|p| p.2 * (p.0 - 1.0 - mx).powi(2)).sum();
            let sxy: f64 = pts
                .iter()
                .map(|p| p.2 * (p.0 - 1.0 - mx) * (p.1 - my))
                .sum();
            let b = (sxy / sxx).max(0.0);
            let a = (my - b * mx).max(my * 1e-3);
            (a, b / a)
        };
        // Read as a non-decreasing curve (weighted by calls), as the cost model reads it.
        let r: Vec<f64> = pts.iter().map(|&(_, t, _)| t / t1).collect();
        let weights: Vec<f64> = pts.iter().map(|p| p.2).collect();
        let measured = pts
            .iter()
            .zip(crate::policy::isotonic_curve(&r, &weights))
            .map(|(&(m, _, _), r)| (m as usize, r))
            .collect();
        Some(Self {
            target_step_secs: t1,
            c: draft_secs_per_token / t1,
            slope,
            measured,
        })
    }

    /// `r(m) = t(m) / t(1)`: measured where available, else from the fitted line.
    pub fn r(&self, m: usize) -> f64 {
        self.measured
            .iter()
            .find(|(mm, _)| *mm == m)
            .map(|&(_, r)| r)
            .unwrap_or(1.0 + self.slope * (m as f64 - 1.0))
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

fn grow<T: Default + Clone>(v: &mut Vec<T>, len: usize) {
    if v.len() < len {
        v.resize(len, T::default());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_speedup_is_predicted_from_a_single_block_length() {
        let round = |drafted, accepted, draft_secs, verify_secs| Round {
            drafted,
            accepted,
            emitted: accepted + 1,
            draft_secs,
            verify_secs,
            verified: drafted + 1,
            lookup: false,
            expected: 0.0,
            expected_by_position: 0.0,
            extension: 0,
            prefix: 0,
            lag: 0,
            non_finite: false,
        };
        let mut m = Metrics::default();
        m.record(&round(4, 4, 0.04, 0.2));
        m.record(&round(4, 2, 0.04, 0.2));
        assert_eq!(m.predicted_speedup(), None);
        m.record(&round(0, 0, 0.0, 0.07));
        assert!(m.predicted_speedup().is_some());
    }

    #[test]
    fn per_position_counts_stop_after_the_first_rejection() {
        let mut m = Metrics::default();
        m.record(&Round {
            drafted: 4,
            accepted: 1,
            emitted: 2,
            verified: 5,
            ..Default::default()
        });
        m.record(&Round {
            drafted: 4,
            accepted: 4,
            emitted: 5,
            verified: 5,
            ..Default::default()
        });
        let reached: Vec<u64> = m.per_position.iter().map(|s| s.reached).collect();
        let accepted: Vec<u64> = m.per_position.iter().map(|s| s.accepted).collect();
        assert_eq!(reached, [2, 2, 1, 1]);
        assert_eq!(accepted, [2, 1, 1, 1]);
        assert_eq!(m.per_position_acceptance(), [1.0, 0.5, 1.0, 1.0]);
        assert_eq!(m.mean_accepted_len(), 1.0 + 5.0 / 2.0);
        assert_eq!(m.acceptance_rate(), 5.0 / 8.0);
    }

    /// The model's positions count as the cost model counts them: a lookup draft not at all, a
    /// model draft the lookup continued up to the model's last token.
    #[test]
    fn model_positions_leave_out_the_lookups_tokens() {
        let mut m = Metrics::default();
        let rounds = [
            // A model draft: 3 tokens, 1 accepted.
            (3, 1, false, 0),
            // A lookup draft: 4 tokens, all accepted.
            (4, 4, true, 0),
            // 2 tokens of the model continued by 3 of the lookup, 3 accepted.
            (5, 3, true, 2),
        ];
        for (drafted, accepted, lookup, prefix) in rounds {
            m.record(&Round {
                drafted,
                accepted,
                emitted: accepted + 1,
                verified: drafted + 1,
                lookup,
                prefix,
                ..Default::default()
            });
        }
        let counts = |v: &[PositionStats]| -> Vec<(u64, u64)> {
            v.iter().map(|s| (s.reached, s.accepted)).collect()
        };
        assert_eq!(counts(&m.model_per_position), [(2, 2), (2, 1), (0, 0)]);
        assert_eq!(
            counts(&m.per_position),
            [(3, 3), (3, 2), (2, 2), (2, 1), (0, 0)]
        );
    }

    #[test]
    fn cost_profile_fits_a_line() {
        let v = [
            VerifyTiming {
                m: 1,
                calls: 10,
                secs: 1.0,
            },
            VerifyTiming {
                m: 5,
                calls: 10,
                secs: 1.8,
            },
        ];
        let p = CostProfile::fit(0.05, &v).unwrap();
        assert!((p.target_step_secs - 0.1).abs() < 1e-9);
        assert!((p.slope - 0.2).abs() < 1e-9);
        assert!((p.c - 0.5).abs() < 1e-9);
        assert!((p.r(5) - 1.8).abs() < 1e-9);
        assert!((p.r(3) - 1.4).abs() < 1e-9);
        // A convex curve: r is relative to the measured single-token time, not a line's intercept.
        let t = |m, secs| VerifyTiming { m, calls: 4, secs };
        let p = CostProfile::fit(0.0, &[t(1, 0.4), t(2, 0.44), t(8, 1.6)]).unwrap();
        assert!((p.target_step_secs - 0.1).abs() < 1e-9);
        assert!((p.r(1) - 1.0).abs() < 1e-9);
        assert!((p.r(2) - 1.1).abs() < 1e-9);
        assert!((p.r(8) - 4.0).abs() < 1e-9);
    }

    #[test]
    fn a_calibrated_curve_gives_t1_when_no_single_token_step_was_timed() {
        // A convex curve, timed at 3 and 5 tokens only (every round drafted).
        let prior = [1.0, 1.1, 1.3, 1.6, 2.0];
        let t = |m: usize, calls: u64| VerifyTiming {
            m,
            calls,
            secs: 0.1 * prior[m - 1] * calls as f64,
        };
        let v = [t(3, 6), t(5, 2)];
        let p = CostProfile::fit_with(0.02, &v, Some(&prior)).unwrap();
        assert!((p.target_step_secs - 0.1).abs() < 1e-12);
        assert!((p.r(3) - 1.3).abs() < 1e-12);
        assert!((p.r(5) - 2.0).abs() < 1e-12);
        assert!((p.c - 0.2).abs() < 1e-12);
        // Without the curve, the line through the two points puts t(1) at its intercept, 0.06.
        let line = CostProfile::fit(0.02, &v).unwrap();
        assert!((line.target_step_secs - 0.06).abs() < 1e-12);
        // A measured single-token step still wins over the calibration.
        let p = CostProfile::fit_with(0.0, &[t(1, 1), t(3, 1)], Some(&[1.0, 5.0, 5.0])).unwrap();
        assert!((p.target_step_secs - 0.1).abs() < 1e-12);
        assert!((p.r(3) - 1.3).abs() < 1e-12);
        // With a calibration, one timed length is enough for a prediction.
        let mut m = Metrics::default();
        m.record(&Round {
            drafted: 2,
            accepted: 2,
            emitted: 3,
            draft_secs: 0.04,
            verify_secs: 0.13,
            verified: 3,
            ..Default::default()
        });
        assert_eq!(m.predicted_speedup(), None);
        // 3 tokens for 2 · 0.2 + 1.3 target steps.
        let want = 3.0 / (2.0 * 0.2 + 1.3);
        let got = m.predicted_speedup_with(Some(&prior)).unwrap();
        assert!((got - want).abs() < 1e-9, "{got} vs {want}");
    }

    #[test]
    fn the_prediction_factors_multiply_to_predicted_over_measured() {
        // Rounds of 3 drafted tokens verified in blocks of 4, expected to emit 3 tokens each.
        let mut m = Metrics::default();
        for accepted in [3, 1, 2, 0] {
            m.record(&Round {
                drafted: 3,
                accepted,
                emitted: accepted + 1,
                draft_secs: 0.012,
                verify_secs: 0.026,
                verified: 4,
                expected: 3.0,
                ..Default::default()
            });
        }
        m.decode_secs = 0.2;
        let prior = [1.0, 1.1, 1.2, 1.3];
        let p = m.prediction_with(Some(&prior)).unwrap();
        assert!((p.target_step_secs - 0.02).abs() < 1e-12);
        assert!((p.tokens - 12.0).abs() < 1e-12);
        // Four rounds of 3 · c + r(4), c = 0.004 / 0.02.
        assert!((p.steps - 4.0 * (3.0 * 0.2 + 1.3)).abs() < 1e-12);
        assert_eq!(p.speedup(), m.predicted_speedup_with(Some(&prior)).unwrap());
        // Against a plain run at 25 ms a token: measured 10 tokens in 0.2 s, i.e. 50 tok/s
        // against 40.
        let measured = (m.emitted as f64 / m.decode_secs) / (1.0 / 0.025);
        let f = p.factors(m.emitted, m.decode_secs, 0.025).unwrap();
        assert!((f.product() - p.speedup() / measured).abs() < 1e-12);
        assert!((f.acceptance - 1.2).abs() < 1e-12);
        assert!((f.machine - 0.8).abs() < 1e-12);
        assert!((f.time - 0.2 / (p.steps * 0.02)).abs() < 1e-12);
        assert_eq!(p.factors(0, m.decode_secs, 0.025), None);
        assert_eq!(p.factors(m.emitted, m.decode_secs, 0.0), None);
    }

    #[test]
    fn metrics_round_trip_through_json() {
        let mut m = Metrics::default();
        m.record(&Round {
            drafted: 2,
            accepted: 1,
            emitted: 2,
            draft_secs: 0.1,
            verify_secs: 0.2,
            verified: 3,
            lookup: false,
            expected: 0.0,
            expected_by_position: 0.0,
            extension: 0,
            prefix: 0,
            lag: 0,
            non_finite: false,
        });
        let s = serde_json::to_string(&m).unwrap();
        let back: Metrics = serde_json::from_str(&s).unwrap();
        assert_eq!(back, m);
    }
}
