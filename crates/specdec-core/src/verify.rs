//! Verification: given the drafted tokens, the distributions they were drawn from and the target's
//! distributions, decide how many drafted tokens to accept and which token comes next.
//!
//! These are pure functions. Emitting tokens, updating metrics and truncating caches happen in the
//! decoder after they return. The statistical tests that check each algorithm against its doc comment
//! are in `tests/distribution.rs`.
//!
//! Notation: `p_i` is the target distribution and `q_i` the draft distribution of the token at
//! position `pos + i`; `x_i` is the drafted token there; `k = draft.len()`; `target` holds `k + 1`
//! distributions, the last one for the bonus token after all `k` drafted tokens.

use crate::rng::{CounterRng, Stream};
use crate::sampling::{sample_dense, Probs};
use crate::TokenId;

/// The outcome of verifying one round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// How many drafted tokens are accepted, a prefix of the draft: `0..=k`.
    pub accepted: usize,
    /// The token that follows the accepted prefix: a resampled or corrected token after a rejection,
    /// or the bonus token when all `k` were accepted. Every round therefore emits `accepted + 1` tokens.
    pub next: TokenId,
}

/// How sampled (non-greedy) output is verified.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum VerifyMode {
    /// Exact rejection sampling ([`verify_rejection`]). Acceptance at a position is
    /// `Σ_x min(p(x), q(x))`, the most any lossless verifier can get from a sampled draft. Wins with a
    /// model drafter sampling at the same temperature as the target.
    #[default]
    Rejection,
    /// Draw the target's own token and accept while it equals the draft ([`verify_onehot`]). Output is
    /// identical, token for token, to plain decoding with the same seed. Acceptance at a position is
    /// `p(x)` for the drafted `x`: `p(argmax q)` for a greedy or deterministic drafter (n-gram, prompt
    /// lookup), where it is the natural choice; it loses to rejection sampling when the draft samples.
    OneHot,
}

/// Greedy verification: accept while the drafted token is the target's argmax; the next token is the
/// target's argmax after the accepted prefix. Needs no randomness. Greedy speculative output therefore
/// equals greedy target-only output token for token.
pub fn verify_greedy(draft: &[TokenId], target: &[Probs]) -> Verdict {
    debug_assert_eq!(target.len(), draft.len() + 1);
    for (i, (&x, p)) in draft.iter().zip(target).enumerate() {
        let t = p.argmax();
        if t != x {
            return Verdict {
                accepted: i,
                next: t,
            };
        }
    }
    Verdict {
        accepted: draft.len(),
        next: target[draft.len()].argmax(),
    }
}

/// One-hot verification for deterministic drafts: at each position `pos + i`, draw the target's token
/// `y_i = F_{p_i}^{-1}(u)` with `u = rng.uniform(pos + i, Stream::Target)`, the very number plain
/// decoding uses at that position; accept while `y_i == x_i`. The first mismatch `y_i` (or, when all `k`
/// match, the bonus `y_k`) is the next token.
///
/// Every emitted token is the token plain decoding would have drawn at its position given the same
/// prefix and seed, so the output is identical to plain decoding's, whatever the draft was.
pub fn verify_onehot(draft: &[TokenId], target: &[Probs], rng: &CounterRng, pos: usize) -> Verdict {
    debug_assert_eq!(target.len(), draft.len() + 1);
    for (i, (&x, p)) in draft.iter().zip(target).enumerate() {
        let y = p.sample(rng.uniform(pos + i, Stream::Target));
        if y != x {
            return Verdict {
                accepted: i,
                next: y,
            };
        }
    }
    let k = draft.len();
    Verdict {
        accepted: k,
        next: target[k].sample(rng.uniform(pos + k, Stream::Target)),
    }
}

/// Exact rejection sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023). For
/// `i = 0, 1, ...`: accept `x_i` when `u_i < min(1, p_i(x_i) / q_i(x_i))` with
/// `u_i = rng.uniform(pos + i, Stream::Accept)`; at the first rejection the next token is drawn from the
/// residual `norm(max(0, p_i - q_i))` with `rng.uniform(pos + i, Stream::Residual)`; if all `k` are
/// accepted, the bonus token is drawn from `p_k` with `rng.uniform(pos + k, Stream::Target)`.
///
/// When `x_i ~ q_i`, each emitted token is distributed exactly as `p_i` given the prefix: the accepted
/// mass is `min(p, q)`, the residual supplies `p - min(p, q)`. If the residual has no mass (`p = q` up to
/// rounding, where a rejection has probability zero in exact arithmetic) the next token is drawn from `p`.
/// `residual` is scratch space.
pub fn verify_rejection(
    draft: &[TokenId],
    draft_probs: &[Probs],
    target: &[Probs],
    rng: &CounterRng,
    pos: usize,
    residual: &mut Vec<f32>,
) -> Verdict {
    debug_assert_eq!(draft.len(), draft_probs.len());
    debug_assert_eq!(target.len(), draft.len() + 1);
    for (i, ((&x, q), p)) in draft.iter().zip(draft_probs).zip(target).enumerate() {
        let u = rng.uniform(pos + i, Stream::Accept);
        if u < acceptance_prob(p, q, x) {
            continue;
        }
        let u = rng.uniform(pos + i, Stream::Residual);
        let next = if residual_into(p, q, residual) > 0.0 {
            sample_dense(residual, u) as TokenId
        } else {
            p.sample(u)
        };
        return Verdict { accepted: i, next };
    }
    let k = draft.len();
    Verdict {
        accepted: k,
        next: target[k].sample(rng.uniform(pos + k, Stream::Target)),
    }
}

/// `min(1, p(x) / q(x))`: the probability that rejection sampling accepts the drafted token `x`.
/// Zero when `q(x) = 0` (a token the draft could not have drawn), and where either probability is
/// not a number (`f64::min` would make a NaN ratio 1: every such draft accepted).
pub fn acceptance_prob(p: &Probs, q: &Probs, x: TokenId) -> f64 {
    let qx = f64::from(q.prob(x));
    if qx.is_nan() || qx <= 0.0 {
        return 0.0;
    }
    let ratio = f64::from(p.prob(x)) / qx;
    if ratio.is_nan() {
        return 0.0;
    }
    ratio.min(1.0)
}

/// Writes `max(0, p - q)` (unnormalised) into `out`, sized to `vocab`, and returns its mass. Sampling
/// from it with [`sample_dense`] samples from the normalised residual.
pub fn residual_into(p: &Probs, q: &Probs, out: &mut Vec<f32>) -> f64 {
    out.clear();
    match p {
        Probs::Dense(pv) => out.extend_from_slice(pv),
        Probs::OneHot(t) => {
            let len = match q {
                Probs::Dense(qv) => qv.len(),
                Probs::OneHot(u) => (*t).max(*u) as usize + 1,
            };
            out.resize(len, 0.0);
            out[*t as usize] = 1.0;
        }
    }
    match q {
        Probs::Dense(qv) => {
            for (r, &qx) in out.iter_mut().zip(qv) {
                *r = (*r - qx).max(0.0);
            }
        }
        Probs::OneHot(u) => {
            if let Some(r) = out.get_mut(*u as usize) {
                *r = (*r - 1.0).max(0.0);
            }
        }
    }
    crate::kernels::sum(out)
}

/// Expected tokens emitted per round when position `i` (1-based) is accepted with probability `a_i`
/// given that all before it were: `Σ_{i=1..k} Π_{j≤i} a_j + 1` (the `+ 1` is the resampled or bonus
/// token).
pub fn expected_tokens(acceptance: &[f64]) -> f64 {
    expected_tokens_ending(acceptance.iter().copied(), false)
}

/// [`expected_tokens`] for a draft whose last token ends the generation (`ends`): accepted whole,
/// it emits its `k` tokens and no bonus after the last, so the last term `Π_{j≤k} a_j` is not
/// counted once more. Without `ends` (or for an empty draft), [`expected_tokens`].
pub fn expected_tokens_ending(acceptance: impl IntoIterator<Item = f64>, ends: bool) -> f64 {
    let (mut prod, mut total, mut any) = (1.0, 1.0, false);
    for a in acceptance {
        prod *= a;
        total += prod;
        any = true;
    }
    if ends && any {
        total -= prod;
    }
    total
}

/// Verification over a batch held as flat row-major slices, the layout a tensor runtime produces.
pub mod batch {
    use super::*;

    /// Shapes of a batched verification: `batch` sequences, `k` drafted tokens each, `vocab` tokens.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Shape {
        /// Sequences.
        pub batch: usize,
        /// Drafted tokens per sequence.
        pub k: usize,
        /// Vocabulary size.
        pub vocab: usize,
    }

    /// Inputs of [`verify`]: `draft` is `[batch, k]`, `q` is `[batch, k, vocab]`, `p` is
    /// `[batch, k + 1, vocab]`, `pos[b]` the position of sequence `b`'s first drafted token.
    #[derive(Clone, Copy, Debug)]
    pub struct Inputs<'a> {
        /// The shape.
        pub shape: Shape,
        /// Drafted tokens.
        pub draft: &'a [TokenId],
        /// Draft probabilities.
        pub q: &'a [f32],
        /// Target probabilities.
        pub p: &'a [f32],
        /// Position of each sequence's first drafted token.
        pub pos: &'a [usize],
    }

    /// [`verify_rejection`] for every sequence; sequence `b` uses `rng.with_lane(b)`. Slices of the
    /// wrong length are a [`ShapeMismatch`](crate::Error::ShapeMismatch).
    pub fn verify(inputs: &Inputs<'_>, rng: &CounterRng) -> crate::Result<Vec<Verdict>> {
        inputs.check()?;
        let Shape { batch, k, vocab } = inputs.shape;
        let mut residual = Vec::new();
        Ok((0..batch)
            .map(|b| {
                let q: Vec<Probs> = (0..k)
                    .map(|i| Probs::Dense(row(inputs.q, b * k + i, vocab).to_vec()))
                    .collect();
                let p: Vec<Probs> = (0..=k)
                    .map(|i| Probs::Dense(row(inputs.p, b * (k + 1) + i, vocab).to_vec()))
                    .collect();
                super::verify_rejection(
                    &inputs.draft[b * k..(b + 1) * k],
                    &q,
                    &p,
                    &rng.with_lane(b as u32),
                    inputs.pos[b],
                    &mut residual,
                )
            })
            .collect())
    }

    impl Inputs<'_> {
        /// Checks every slice against the shape.
        pub fn check(&self) -> crate::Result<()> {
            let Shape { batch, k, vocab } = self.shape;
            // A shape whose sizes overflow matches no slice (`usize::MAX` here).
            let size = |dims: &[usize]| {
                dims.iter()
                    .try_fold(1usize, |n, &d| n.checked_mul(d))
                    .unwrap_or(usize::MAX)
            };
            let checks: [(&'static str, usize, usize); 4] = [
                ("draft [batch, k]", size(&[batch, k]), self.draft.len()),
                (
                    "q [batch, k, vocab]",
                    size(&[batch, k, vocab]),
                    self.q.len(),
                ),
                (
                    "p [batch, k + 1, vocab]",
                    size(&[batch, k.saturating_add(1), vocab]),
                    self.p.len(),
                ),
                ("pos [batch]", batch, self.pos.len()),
            ];
            for (what, expected, got) in checks {
                if expected != got || expected == usize::MAX {
                    return Err(crate::Error::ShapeMismatch {
                        side: crate::Side::Target,
                        what,
                        expected,
                        got,
                    });
                }
            }
            if let Some(&token) = self.draft.iter().find(|&&t| t as usize >= vocab) {
                return Err(crate::Error::TokenOutOfRange {
                    side: crate::Side::Draft,
                    token,
                    vocab,
                });
            }
            Ok(())
        }
    }

    /// Per-entry acceptance probabilities `min(1, p(x)/q(x))` at the drafted tokens: `[batch, k]`.
    pub fn acceptance_probs(inputs: &Inputs<'_>) -> crate::Result<Vec<f64>> {
        inputs.check()?;
        let Shape { batch, k, vocab } = inputs.shape;
        let mut out = Vec::with_capacity(batch * k);
        for b in 0..batch {
            for i in 0..k {
                let x = inputs.draft[b * k + i] as usize;
                let qx = f64::from(row(inputs.q, b * k + i, vocab)[x]);
                let px = f64::from(row(inputs.p, b * (k + 1) + i, vocab)[x]);
                let ratio = px / qx;
                out.push(if qx > 0.0 && !ratio.is_nan() {
                    ratio.min(1.0)
                } else {
                    0.0
                });
            }
        }
        Ok(out)
    }

    /// Residuals `max(0, p - q)`, unnormalised: `[batch, k, vocab]`.
    pub fn residuals(inputs: &Inputs<'_>) -> crate::Result<Vec<f32>> {
        inputs.check()?;
        let Shape { batch, k, vocab } = inputs.shape;
        let mut out = Vec::with_capacity(batch * k * vocab);
        for b in 0..batch {
            for i in 0..k {
                let q = row(inputs.q, b * k + i, vocab);
                let p = row(inputs.p, b * (k + 1) + i, vocab);
                out.extend(p.iter().zip(q).map(|(&p, &q)| (p - q).max(0.0)));
            }
        }
        Ok(out)
    }

    /// Expected tokens per round for each sequence from per-position acceptance rates `[batch, k]`.
    pub fn expected_tokens(rates: &[f64], k: usize) -> Vec<f64> {
        if k == 0 {
            return vec![1.0; rates.len()];
        }
        rates.chunks(k).map(super::expected_tokens).collect()
    }

    fn row(x: &[f32], r: usize, vocab: usize) -> &[f32] {
        &x[r * vocab..(r + 1) * vocab]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(v: &[f32]) -> Probs {
        Probs::Dense(v.to_vec())
    }

    /// A probability that is not a number accepts nothing (`f64::min` would make the ratio 1).
    #[test]
    fn a_nan_probability_accepts_nothing() {
        let q = d(&[0.5, 0.5]);
        assert_eq!(acceptance_prob(&d(&[f32::NAN, 0.5]), &q, 0), 0.0);
        assert_eq!(
            acceptance_prob(&d(&[0.5, 0.5]), &d(&[f32::NAN, 0.5]), 0),
            0.0
        );
        assert_eq!(acceptance_prob(&d(&[0.5, 0.5]), &q, 0), 1.0);
        let inputs = batch::Inputs {
            shape: batch::Shape {
                batch: 1,
                k: 1,
                vocab: 2,
            },
            draft: &[0],
            q: &[0.5, 0.5],
            p: &[f32::NAN, 0.5, 0.5, 0.5],
            pos: &[0],
        };
        assert_eq!(batch::acceptance_probs(&inputs).unwrap(), [0.0]);
    }

    /// A shape whose sizes overflow is an error, not a wrapped size that some slices match.
    #[test]
    fn a_shape_that_overflows_is_an_error() {
        let inputs = batch::Inputs {
            shape: batch::Shape {
                batch: 2,
                k: 0,
                vocab: 1 << (usize::BITS - 1),
            },
            draft: &[],
            q: &[],
            p: &[],
            pos: &[0, 0],
        };
        assert!(inputs.check().is_err());
        assert!(batch::acceptance_probs(&inputs).is_err());
    }

    #[test]
    fn a_draft_that_ends_the_generation_expects_no_bonus_after_it() {
        assert_eq!(expected_tokens(&[0.5, 0.5]), 1.75);
        assert_eq!(expected_tokens_ending([0.5, 0.5], false), 1.75);
        // All accepted: two tokens, the second ending the generation, and nothing after.
        assert_eq!(expected_tokens_ending([0.5, 0.5], true), 1.5);
        assert_eq!(expected_tokens_ending([], true), 1.0);
    }

    #[test]
    fn greedy_accepts_the_matching_prefix() {
        let target = [d(&[0.1, 0.9]), d(&[0.8, 0.2]), d(&[0.3, 0.7])];
        assert_eq!(
            verify_greedy(&[1, 0], &target),
            Verdict {
                accepted: 2,
                next: 1
            }
        );
        assert_eq!(
            verify_greedy(&[1, 1], &target),
            Verdict {
                accepted: 1,
                next: 0
            }
        );
        assert_eq!(
            verify_greedy(&[0, 0], &target),
            Verdict {
                accepted: 0,
                next: 1
            }
        );
    }

    #[test]
    fn rejection_accepts_when_p_dominates_q() {
        // p(x) >= q(x) at every drafted token: always accepted.
        let rng = CounterRng::new(1);
        let mut r = Vec::new();
        for pos in 0..200 {
            let v = verify_rejection(
                &[0, 1],
                &[d(&[0.5, 0.5]), d(&[0.5, 0.5])],
                &[d(&[0.6, 0.4]), d(&[0.2, 0.8]), d(&[1.0, 0.0])],
                &rng,
                pos,
                &mut r,
            );
            assert_eq!(
                v,
                Verdict {
                    accepted: 2,
                    next: 0
                }
            );
        }
    }

    #[test]
    fn rejection_never_accepts_a_token_the_target_forbids() {
        let rng = CounterRng::new(2);
        let mut r = Vec::new();
        for pos in 0..200 {
            let v = verify_rejection(
                &[0],
                &[d(&[0.9, 0.1, 0.0])],
                &[d(&[0.0, 0.5, 0.5]), d(&[1.0, 0.0, 0.0])],
                &rng,
                pos,
                &mut r,
            );
            assert_eq!(v.accepted, 0);
            // The residual max(0, p - q) = [0, 0.4, 0.5]: token 0 is impossible.
            assert_ne!(v.next, 0);
        }
    }

    #[test]
    fn residual_is_max_of_difference() {
        let mut r = Vec::new();
        let mass = residual_into(&d(&[0.5, 0.3, 0.2]), &d(&[0.2, 0.6, 0.2]), &mut r);
        assert!((mass - 0.3).abs() < 1e-6);
        assert!((r[0] - 0.3).abs() < 1e-6 && r[1] == 0.0 && r[2] == 0.0);
        // One-hot draft against a dense target.
        let mass = residual_into(&d(&[0.5, 0.5]), &Probs::OneHot(0), &mut r);
        assert!((mass - 0.5).abs() < 1e-6 && r[0] == 0.0);
        // One-hot target against a one-hot draft on another token.
        let mass = residual_into(&Probs::OneHot(2), &Probs::OneHot(0), &mut r);
        assert_eq!((mass, r.as_slice()), (1.0, [0.0, 0.0, 1.0].as_slice()));
    }

    #[test]
    fn expected_tokens_formula() {
        assert_eq!(expected_tokens(&[]), 1.0);
        assert!((expected_tokens(&[0.5, 0.5]) - 1.75).abs() < 1e-12);
        assert!((expected_tokens(&[1.0, 1.0, 1.0]) - 4.0).abs() < 1e-12);
    }

    #[test]
    fn batch_matches_single_sequence_verification() {
        let shape = batch::Shape {
            batch: 2,
            k: 2,
            vocab: 3,
        };
        let q = [
            0.2, 0.5, 0.3, 0.1, 0.1, 0.8, //
            0.3, 0.3, 0.4, 0.6, 0.2, 0.2,
        ];
        let p = [
            0.3, 0.3, 0.4, 0.2, 0.2, 0.6, 0.5, 0.25, 0.25, //
            0.1, 0.1, 0.8, 0.1, 0.8, 0.1, 0.2, 0.2, 0.6,
        ];
        let inputs = batch::Inputs {
            shape,
            draft: &[1, 2, 2, 0],
            q: &q,
            p: &p,
            pos: &[5, 9],
        };
        let rng = CounterRng::new(3);
        let verdicts = batch::verify(&inputs, &rng).unwrap();
        let mut r = Vec::new();
        let single = verify_rejection(
            &[2, 0],
            &[d(&q[6..9]), d(&q[9..12])],
            &[d(&p[9..12]), d(&p[12..15]), d(&p[15..18])],
            &rng.with_lane(1),
            9,
            &mut r,
        );
        assert_eq!(verdicts[1], single);
        let a = batch::acceptance_probs(&inputs).unwrap();
        let want = [0.6, 0.75, 1.0, 1.0 / 6.0];
        for (x, w) in a.iter().zip(want) {
            assert!((x - w).abs() < 1e-6, "{a:?}");
        }
        let res = batch::residuals(&inputs).unwrap();
        let bad = batch::Inputs {
            pos: &[5],
            ..inputs
        };
        assert!(matches!(
            batch::verify(&bad, &rng),
            Err(crate::Error::ShapeMismatch {
                expected: 2,
                got: 1,
                ..
            })
        ));
        assert_eq!(res.len(), 12);
        assert!((res[0] - 0.1).abs() < 1e-6 && res[1] == 0.0);
        let e = batch::expected_tokens(&a, 2);
        assert!((e[0] - (1.0 + 0.6 + 0.45)).abs() < 1e-6);
    }
}
