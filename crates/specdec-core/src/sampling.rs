//! Sampling transforms: logits and the committed history in, a probability distribution out.
//!
//! The same [`Sampler`] forms every distribution the decoder uses, the draft's and the target's, so
//! speculative and plain decoding see identical probabilities. The order of the transforms is Hugging
//! Face's: penalties, temperature, softmax, top-k, top-p, min-p, renormalisation. llama.cpp's default
//! chain applies temperature after top-k, top-p and min-p instead, so with top-p or min-p at a
//! temperature other than 1 the two engines keep different sets of tokens.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::kernels;
use crate::TokenId;

/// The smallest temperature above 0 (greedy) that [`SamplingParams::validate`] accepts.
pub const MIN_TEMPERATURE: f32 = 1e-3;
/// The range of repetition penalties [`SamplingParams::validate`] accepts.
pub const MIN_REPETITION_PENALTY: f32 = 1e-3;
/// See [`MIN_REPETITION_PENALTY`].
pub const MAX_REPETITION_PENALTY: f32 = 1e3;

/// How logits become a distribution. The defaults change nothing: temperature 1, no truncation, no
/// penalty.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Divides the logits; 0 means greedy (always the most likely token).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose mass reaches `top_p`; 1 keeps all.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 keeps all.
    pub min_p: f32,
    /// Divides positive (multiplies negative) logits of tokens in the penalty window; 1 is off.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token present in the penalty window; 0 is off.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per occurrence in the penalty window; 0 is off.
    pub frequency_penalty: f32,
    /// How many of the most recent committed tokens the penalties look at.
    pub penalty_last_n: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding: temperature 0 and nothing else.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// True when the distribution is a one-hot on the most likely token.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    fn has_penalties(&self) -> bool {
        self.penalty_last_n > 0
            && (self.repetition_penalty != 1.0
                || self.presence_penalty != 0.0
                || self.frequency_penalty != 0.0)
    }

    /// Checks every value's range.
    pub fn validate(&self) -> Result<()> {
        let t = self.temperature;
        // Below 1e-3 (but above 0) 1/t overflows the softmax's arithmetic on real logits.
        if !(t.is_finite() && (t == 0.0 || t >= MIN_TEMPERATURE)) {
            return Err(Error::config(
                "temperature",
                t,
                "0 (greedy) or a finite number >= 0.001",
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::config("top_p", self.top_p, "a number in (0, 1]"));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(Error::config("min_p", self.min_p, "a number in [0, 1]"));
        }
        let r = self.repetition_penalty;
        if !((MIN_REPETITION_PENALTY..=MAX_REPETITION_PENALTY).contains(&r)) {
            return Err(Error::config(
                "repetition_penalty",
                r,
                "a number in [0.001, 1000] (1 = off)",
            ));
        }
        if !self.presence_penalty.is_finite() {
            return Err(Error::config(
                "presence_penalty",
                self.presence_penalty,
                "a finite number",
            ));
        }
        if !self.frequency_penalty.is_finite() {
            return Err(Error::config(
                "frequency_penalty",
                self.frequency_penalty,
                "a finite number",
            ));
        }
        Ok(())
    }
}

/// A probability distribution over the vocabulary.
#[derive(Clone, Debug, PartialEq)]
pub enum Probs {
    /// All mass on one token: greedy decoding and deterministic drafters.
    OneHot(TokenId),
    /// One probability per token, summing to one (up to rounding).
    Dense(Vec<f32>),
}

impl Probs {
    /// The probability of `token`.
    pub fn prob(&self, token: TokenId) -> f32 {
        match self {
            Probs::OneHot(t) => f32::from(u8::from(*t == token)),
            Probs::Dense(p) => p.get(token as usize).copied().unwrap_or(0.0),
        }
    }

    /// The most likely token (the lowest index on ties).
    pub fn argmax(&self) -> TokenId {
        match self {
            Probs::OneHot(t) => *t,
            Probs::Dense(p) => kernels::argmax(p) as TokenId,
        }
    }

    /// Draws a token by inverting the cumulative distribution at `u` in `[0, 1)`.
    pub fn sample(&self, u: f64) -> TokenId {
        match self {
            Probs::OneHot(t) => *t,
            Probs::Dense(p) => sample_dense(p, u) as TokenId,
        }
    }
}

/// Block size of the two-level inverse-CDF walk.
const SAMPLE_BLOCK: usize = 512;

/// Inverse-CDF sampling over unnormalised non-negative weights: the first index `i` with `w[i] > 0`
/// whose cumulative weight exceeds `u * total`. Block sums first, then a walk inside one block, so a draw
/// costs one pass of vector sums rather than a scalar walk over the whole vocabulary. A zero-weight index
/// is never returned.
pub fn sample_dense(w: &[f32], u: f64) -> usize {
    let blocks = w.chunks(SAMPLE_BLOCK);
    let sums: Vec<f64> = blocks.clone().map(kernels::sum).collect();
    let total: f64 = sums.iter().sum();
    let target = u * total;
    let mut cum = 0.0f64;
    let mut last_nonzero = None;
    for (b, (block, s)) in blocks.zip(&sums).enumerate() {
        if *s > 0.0 {
            if cum + s > target {
                for (i, &v) in block.iter().enumerate() {
                    if v > 0.0 {
                        cum += f64::from(v);
                        last_nonzero = Some(b * SAMPLE_BLOCK + i);
                        if cum > target {
                            return b * SAMPLE_BLOCK + i;
                        }
                    }
                }
                // Rounding made the block walk fall short of its sum; carry on with the next block.
                continue;
            }
            cum += s;
            last_nonzero = block
                .iter()
                .rposition(|&v| v > 0.0)
                .map(|i| b * SAMPLE_BLOCK + i)
                .or(last_nonzero);
        }
    }
    // Only rounding gets here (u * total at the very end of the mass) or an all-zero input.
    last_nonzero.unwrap_or(0)
}

/// Forms distributions from logits. Owns scratch space, so one sampler per thread of work.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    counts: Vec<(TokenId, u32)>,
    keep: Vec<u64>,
}

impl Sampler {
    /// A sampler for `params`; they must already be valid (see [`SamplingParams::validate`]).
    pub fn new(params: SamplingParams) -> Self {
        Self {
            params,
            counts: Vec::new(),
            keep: Vec::new(),
        }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The distribution of the next token given `logits` and the committed `history` (for penalties).
    /// Reuses `out`'s buffer when it is already dense.
    pub fn probs(&mut self, logits: &[f32], history: &[TokenId], out: &mut Probs) -> Result<()> {
        let (max, argmax, bad) = kernels::max_checked(logits);
        if let Some(index) = bad {
            return Err(Error::NonFiniteLogits {
                index,
                value: logits[index],
            });
        }
        let penalties = self.params.has_penalties();
        if self.params.is_greedy() && !penalties {
            *out = Probs::OneHot(argmax as TokenId);
            return Ok(());
        }
        let mut buf = match std::mem::replace(out, Probs::OneHot(0)) {
            Probs::Dense(v) => v,
            Probs::OneHot(_) => Vec::new(),
        };
        let inv_t = if self.params.is_greedy() {
            1.0
        } else {
            1.0 / self.params.temperature
        };
        let total = if penalties {
            buf.clear();
            buf.extend_from_slice(logits);
            self.apply_penalties(&mut buf, history);
            let max = kernels::max(&buf);
            if self.params.is_greedy() {
                *out = Probs::OneHot(kernels::position(&buf, max) as TokenId);
                return Ok(());
            }
            kernels::exp_shift_sum(&mut buf, max, inv_t)
        } else {
            // A reused buffer already has the length: no copy and no clearing pass.
            buf.resize(logits.len(), 0.0);
            kernels::exp_shift_sum_into(logits, &mut buf, max, inv_t)
        };
        kernels::scale(&mut buf, (1.0 / total) as f32);
        self.truncate(&mut buf);
        *out = Probs::Dense(buf);
        Ok(())
    }

    /// llama.cpp's penalties over the last `penalty_last_n` tokens of `history`.
    fn apply_penalties(&mut self, logits: &mut [f32], history: &[TokenId]) {
        let p = &self.params;
        let window = &history[history.len().saturating_sub(p.penalty_last_n)..];
        self.counts.clear();
        for &t in window {
            match self.counts.iter_mut().find(|(u, _)| *u == t) {
                Some((_, c)) => *c += 1,
                None => self.counts.push((t, 1)),
            }
        }
        for &(t, c) in &self.counts {
            let Some(l) = logits.get_mut(t as usize) else {
                continue;
            };
            if *l > 0.0 {
                *l /= p.repetition_penalty;
            } else {
                *l *= p.repetition_penalty;
            }
            // Finite penalties large enough to overflow `f32` would leave an infinite logit, and
            // the probabilities then NaN: keep every logit finite.
            *l = (*l - (c as f32 * p.frequency_penalty + p.presence_penalty))
                .clamp(f32::MIN, f32::MAX);
        }
    }

    /// Top-k, top-p and min-p on normalised probabilities, then renormalisation.
    fn truncate(&mut self, probs: &mut [f32]) {
        let p = self.params.clone();
        let vocab = probs.len();
        let k = if p.top_k == 0 {
            vocab
        } else {
            p.top_k.min(vocab)
        };
        let mut changed = false;
        if k < vocab || p.top_p < 1.0 {
            // Candidates sorted by probability, most likely first: the top k, or for top-p alone a pool
            // that grows until it holds the nucleus.
            let mut pool = if k < vocab { k } else { 64.min(vocab) };
            loop {
                self.top_keys(probs, pool);
                let mass: f64 = self.keep.iter().map(|&key| f64::from(key_prob(key))).sum();
                if pool == vocab || k < vocab || mass >= f64::from(p.top_p) {
                    break;
                }
                pool = (pool * 8).min(vocab);
            }
            if p.top_p < 1.0 {
                // Top-p acts on the top-k set renormalised (as Hugging Face's warpers do), else on the
                // whole, already normalised, distribution.
                let total: f64 = if k < vocab {
                    self.keep.iter().map(|&key| f64::from(key_prob(key))).sum()
                } else {
                    1.0
                };
                let mut cum = 0.0f64;
                let mut n = 0;
                for &key in &self.keep {
                    cum += f64::from(key_prob(key));
                    n += 1;
                    if cum >= f64::from(p.top_p) * total {
                        break;
                    }
                }
                self.keep.truncate(n);
            }
            if self.keep.len() < vocab {
                changed = true;
                let kept: Vec<(usize, f32)> = self
                    .keep
                    .iter()
                    .map(|&key| (key_index(key), key_prob(key)))
                    .collect();
                probs.fill(0.0);
                for (i, v) in kept {
                    probs[i] = v;
                }
            }
        }
        if p.min_p > 0.0 {
            let max = probs[kernels::argmax(probs)];
            let floor = p.min_p * max;
            for v in probs.iter_mut() {
                if *v < floor {
                    *v = 0.0;
                    changed = true;
                }
            }
        }
        if changed {
            let total = kernels::sum(probs);
            kernels::scale(probs, (1.0 / total) as f32);
        }
    }

    /// Fills `self.keep` with the keys of the `n` most likely tokens, most likely first (lowest index
    /// first among equals).
    ///
    /// The `n`-th largest of the block maxima is a lower bound on the `n`-th largest value (at least `n`
    /// blocks hold a value that large), so one vectorised pass of block maxima and one comparison pass
    /// leave only a handful of candidates to sort.
    fn top_keys(&mut self, probs: &[f32], n: usize) {
        self.keep.clear();
        let blocks: Vec<f32> = probs.chunks(TOP_BLOCK).map(kernels::max).collect();
        let floor = if n < blocks.len() {
            let mut b = blocks.clone();
            let (_, nth, _) = b.select_nth_unstable_by(n - 1, |x, y| y.total_cmp(x));
            *nth
        } else {
            f32::NEG_INFINITY
        };
        // Only blocks whose maximum reaches the floor can hold a candidate.
        for (bi, (block, &bmax)) in probs.chunks(TOP_BLOCK).zip(&blocks).enumerate() {
            if bmax >= floor {
                let base = bi * TOP_BLOCK;
                self.keep.extend(
                    block
                        .iter()
                        .enumerate()
                        .filter(|(_, &v)| v >= floor)
                        .map(|(i, &v)| make_key(base + i, v)),
                );
            }
        }
        self.keep.sort_unstable_by(|a, b| b.cmp(a));
        self.keep.truncate(n);
    }
}

/// Block length of the top-k prefilter.
const TOP_BLOCK: usize = 256;

/// A sort key: larger for a more likely token, and for the lower index among equals. The bit pattern of
/// a non-negative `f32` orders like its value.
fn make_key(index: usize, prob: f32) -> u64 {
    (u64::from(prob.to_bits()) << 32) | u64::from(u32::MAX - index as u32)
}

fn key_index(key: u64) -> usize {
    (u32::MAX - key as u32) as usize
}

fn key_prob(key: u64) -> f32 {
    f32::from_bits((key >> 32) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dense(p: &Probs) -> Vec<f32> {
        match p {
            Probs::Dense(v) => v.clone(),
            Probs::OneHot(_) => panic!("expected a dense distribution"),
        }
    }

    fn run(params: SamplingParams, logits: &[f32], history: &[TokenId]) -> Probs {
        params.validate().unwrap();
        let mut s = Sampler::new(params);
        let mut out = Probs::OneHot(0);
        s.probs(logits, history, &mut out).unwrap();
        out
    }

    #[test]
    fn softmax_matches_f64_reference() {
        let logits = [1.0f32, 2.0, 3.0, -1.0, 0.5];
        let p = dense(&run(SamplingParams::default(), &logits, &[]));
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        for (i, &l) in logits.iter().enumerate() {
            assert!((f64::from(p[i]) - f64::from(l).exp() / z).abs() < 1e-6);
        }
    }

    #[test]
    fn temperature_sharpens() {
        let logits = [1.0f32, 2.0];
        let hot = dense(&run(
            SamplingParams {
                temperature: 0.5,
                ..Default::default()
            },
            &logits,
            &[],
        ));
        let want = 1.0 / (1.0 + (-2.0f64).exp());
        assert!((f64::from(hot[1]) - want).abs() < 1e-6);
    }

    #[test]
    fn greedy_is_one_hot_on_argmax() {
        assert_eq!(
            run(SamplingParams::greedy(), &[0.1, 3.0, 3.0, 1.0], &[]),
            Probs::OneHot(1)
        );
    }

    #[test]
    fn top_k_keeps_k_tokens() {
        let logits = [0.0f32, 4.0, 1.0, 3.0, 2.0];
        let p = dense(&run(
            SamplingParams {
                top_k: 2,
                ..Default::default()
            },
            &logits,
            &[],
        ));
        assert_eq!(p.iter().filter(|&&v| v > 0.0).count(), 2);
        assert!(p[1] > 0.0 && p[3] > 0.0);
        let want = 1.0 / (1.0 + (-1.0f64).exp());
        assert!((f64::from(p[1]) - want).abs() < 1e-6);
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        // Probabilities 0.5, 0.3, 0.2 (as logs). top_p = 0.7 keeps the first two: 0.5 < 0.7 <= 0.8.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let p = dense(&run(
            SamplingParams {
                top_p: 0.7,
                ..Default::default()
            },
            &logits,
            &[],
        ));
        assert!((p[0] - 0.625).abs() < 1e-5 && (p[1] - 0.375).abs() < 1e-5 && p[2] == 0.0);
    }

    #[test]
    fn top_p_pool_grows_past_64_tokens() {
        let logits = vec![0.0f32; 1000];
        let p = dense(&run(
            SamplingParams {
                top_p: 0.5,
                ..Default::default()
            },
            &logits,
            &[],
        ));
        assert_eq!(p.iter().filter(|&&v| v > 0.0).count(), 500);
        // Ties resolve to the lowest indices.
        assert!(p[499] > 0.0 && p[500] == 0.0);
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let logits = [0.6f32.ln(), 0.3f32.ln(), 0.1f32.ln()];
        let p = dense(&run(
            SamplingParams {
                min_p: 0.2,
                ..Default::default()
            },
            &logits,
            &[],
        ));
        assert!(p[2] == 0.0 && (p[0] - 2.0 / 3.0).abs() < 1e-5);
    }

    #[test]
    fn penalties_follow_llama_cpp() {
        let logits = [2.0f32, -2.0, 1.0];
        let params = SamplingParams {
            temperature: 0.0,
            repetition_penalty: 2.0,
            ..Default::default()
        };
        // Token 0 is repeated: 2.0 / 2 = 1.0 ties with token 2, the lower index wins.
        assert_eq!(run(params.clone(), &logits, &[0]), Probs::OneHot(0));
        let params = SamplingParams {
            frequency_penalty: 0.3,
            presence_penalty: 0.5,
            ..params
        };
        // Token 0: 1.0 - 2 * 0.3 - 0.5 = -0.1 < 1.0.
        assert_eq!(run(params.clone(), &logits, &[0, 0]), Probs::OneHot(2));
        // Outside the window the history does not count.
        let params = SamplingParams {
            penalty_last_n: 1,
            ..params
        };
        assert_eq!(run(params, &logits, &[0, 0, 1]), Probs::OneHot(0));
    }

    /// Penalties large enough to overflow `f32` (finite, so valid) leave every logit finite: a
    /// distribution, not NaN.
    #[test]
    fn huge_penalties_keep_the_distribution_finite() {
        for penalty in [-3e38f32, 3e38] {
            let mut s = Sampler::new(SamplingParams {
                temperature: 1.0,
                presence_penalty: penalty,
                frequency_penalty: penalty,
                ..SamplingParams::default()
            });
            let mut out = Probs::OneHot(0);
            s.probs(&[0.0, 1.0, 2.0], &[0, 0], &mut out).unwrap();
            let p: Vec<f32> = (0..3).map(|t| out.prob(t)).collect();
            assert!(p.iter().all(|x| x.is_finite()), "{penalty}: {p:?}");
            assert!(
                (p.iter().sum::<f32>() - 1.0).abs() < 1e-5,
                "{penalty}: {p:?}"
            );
            // A penalty that favours token 0 makes it the only choice; one against it rules it out.
            assert_eq!(p[0] > 0.5, penalty < 0.0, "{penalty}: {p:?}");
        }
    }

    #[test]
    fn non_finite_logits_are_an_error() {
        let mut s = Sampler::new(SamplingParams::default());
        let mut out = Probs::OneHot(0);
        let err = s.probs(&[0.0, f32::NAN, 1.0], &[], &mut out).unwrap_err();
        assert!(matches!(err, Error::NonFiniteLogits { index: 1, .. }));
        let err = s
            .probs(&[0.0, 1.0, f32::NEG_INFINITY], &[], &mut out)
            .unwrap_err();
        assert!(matches!(err, Error::NonFiniteLogits { index: 2, .. }));
    }

    #[test]
    fn invalid_parameters_are_rejected() {
        let bad = [
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            },
            SamplingParams {
                temperature: f32::NAN,
                ..Default::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            SamplingParams {
                top_p: 1.5,
                ..Default::default()
            },
            SamplingParams {
                min_p: -0.1,
                ..Default::default()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
            SamplingParams {
                frequency_penalty: f32::INFINITY,
                ..Default::default()
            },
        ];
        for p in bad {
            assert!(
                matches!(p.validate(), Err(Error::InvalidConfig { .. })),
                "{p:?}"
            );
        }
    }

    #[test]
    fn sample_dense_inverts_the_cdf_and_skips_zeros() {
        let w = [0.0f32, 0.25, 0.0, 0.75];
        assert_eq!(sample_dense(&w, 0.0), 1);
        assert_eq!(sample_dense(&w, 0.2499), 1);
        assert_eq!(sample_dense(&w, 0.2501), 3);
        assert_eq!(sample_dense(&w, 0.999_999), 3);
        // Across blocks.
        let mut big = vec![0.0f32; 3 * SAMPLE_BLOCK];
        big[10] = 1.0;
        big[SAMPLE_BLOCK + 5] = 1.0;
        big[2 * SAMPLE_BLOCK + 7] = 2.0;
        assert_eq!(sample_dense(&big, 0.1), 10);
        assert_eq!(sample_dense(&big, 0.3), SAMPLE_BLOCK + 5);
        assert_eq!(sample_dense(&big, 0.6), 2 * SAMPLE_BLOCK + 7);
        assert_eq!(sample_dense(&big, 0.999_999_999), 2 * SAMPLE_BLOCK + 7);
    }
}
