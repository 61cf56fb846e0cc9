//! Property tests: bounds that must hold for any input.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use std::cell::Cell;
use std::ops::ControlFlow;
use std::rc::Rc;

use proptest::prelude::*;
use specdec_core::mock::{MockLogits, MockModel};
use specdec_core::verify::{residual_into, verify_onehot, verify_rejection};
use specdec_core::{
    generate, CounterRng, DraftLenPolicy, FixedCost, GenerateConfig, Logits, ModelDrafter, Probs,
    Round, SamplingParams, Score, SeqId, Stream, Target, TokenId, VerifyMode,
};

fn dist(vocab: usize) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(0.0f32..1.0, vocab).prop_map(|mut v| {
        v[0] += 1e-3;
        let s: f32 = v.iter().sum();
        v.iter_mut().for_each(|x| *x /= s);
        v
    })
}

fn round_inputs() -> impl Strategy<Value = (usize, Vec<Vec<f32>>, Vec<Vec<f32>>, u64)> {
    (2usize..12, 1usize..9).prop_flat_map(|(vocab, k)| {
        (
            Just(k),
            prop::collection::vec(dist(vocab), k),
            prop::collection::vec(dist(vocab), k + 1),
            any::<u64>(),
        )
    })
}

proptest! {
    #[test]
    fn accepted_is_at_most_k_and_next_is_in_the_vocabulary((k, q, p, seed) in round_inputs()) {
        let vocab = p[0].len();
        let rng = CounterRng::new(seed);
        let q: Vec<Probs> = q.into_iter().map(Probs::Dense).collect();
        let p: Vec<Probs> = p.into_iter().map(Probs::Dense).collect();
        let draft: Vec<TokenId> = (0..k).map(|i| q[i].sample(rng.uniform(i, Stream::Draft))).collect();
        let v = verify_rejection(&draft, &q, &p, &rng, 0, &mut Vec::new());
        prop_assert!(v.accepted <= k);
        prop_assert!((v.next as usize) < vocab);
        prop_assert!(p[v.accepted].prob(v.next) > 0.0, "the next token has target mass");
        let v = verify_onehot(&draft, &p, &rng, 0);
        prop_assert!(v.accepted <= k);
        prop_assert!(p[v.accepted].prob(v.next) > 0.0);
    }

    #[test]
    fn residual_is_non_negative_and_normalises(p in dist(16), q in dist(16)) {
        let mut r = Vec::new();
        let mass = residual_into(&Probs::Dense(p.clone()), &Probs::Dense(q.clone()), &mut r);
        prop_assert!(r.iter().all(|&x| x >= 0.0));
        // The residual mass is the total variation distance: sum max(0, p - q) = 1 - sum min(p, q).
        let overlap: f64 = p.iter().zip(&q).map(|(&a, &b)| f64::from(a.min(b))).sum();
        prop_assert!((mass - (1.0 - overlap)).abs() < 1e-5);
        if mass > 1e-6 {
            let normalised: f64 = r.iter().map(|&x| f64::from(x) / mass).sum();
            prop_assert!((normalised - 1.0).abs() < 1e-5);
        }
    }

    #[test]
    fn policies_stay_within_bounds(
        rounds in prop::collection::vec((0usize..10, 0usize..10, 0.0f64..0.01, 0.0f64..0.01), 1..80),
        min in 1usize..4,
        span in 0usize..6,
    ) {
        let max = min + span;
        let policies = [
            DraftLenPolicy::Fixed { draft_len: max },
            DraftLenPolicy::Adaptive { initial: min, min, max, target_acceptance: 0.6, smoothing: 0.4 },
            DraftLenPolicy::CostModel { max, cost: None, probe_every: 4, prior: None },
            DraftLenPolicy::CostModel { max, cost: Some(FixedCost { c: 0.2, draft_fixed: 0.0, r: vec![1.0, 1.2], context: None, step_secs: None, acceptance: Vec::new(), draft_read: None, draft_step_secs: None }), probe_every: 3, prior: None },
            DraftLenPolicy::CostModel { max, cost: None, probe_every: 5, prior: Some(FixedCost { c: 0.3, draft_fixed: 0.2, r: vec![1.0, 1.1, 1.3], context: None, step_secs: None, acceptance: Vec::new(), draft_read: None, draft_step_secs: None }) },
        ];
        for policy in policies {
            policy.validate().unwrap();
            let mut c = policy.controller();
            for &(d, a, ds, vs) in &rounds {
                let k = c.next_draft_len();
                match policy {
                    DraftLenPolicy::Fixed { draft_len } => prop_assert_eq!(k, draft_len),
                    DraftLenPolicy::Adaptive { .. } => prop_assert!((min..=max).contains(&k)),
                    DraftLenPolicy::CostModel { .. } => prop_assert!(k <= max),
                }
                let drafted = d.min(k);
                let accepted = a.min(drafted);
                c.observe(&Round { drafted, accepted, emitted: accepted + 1, draft_secs: ds, verify_secs: vs, verified: drafted + 1, ..Round::default() });
            }
        }
    }
}

/// Records the block length of every target call (one per round, after the prefill call).
struct Recording<T> {
    inner: T,
    calls: Rc<Cell<usize>>,
    drafted: Vec<usize>,
}

impl<T: Target> Target for Recording<T> {
    type Error = T::Error;
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn capacity(&self) -> usize {
        self.inner.capacity()
    }
    fn score(&mut self, batch: &[Score<'_>], out: &mut [Logits]) -> Result<(), T::Error> {
        self.inner.score(batch, out)?;
        self.drafted.push(batch[0].draft.len());
        self.calls.set(self.calls.get() + 1);
        Ok(())
    }
    fn commit(&mut self, seq: SeqId, committed: &[TokenId]) -> Result<(), T::Error> {
        self.inner.commit(seq, committed)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn every_round_emits_between_one_and_k_plus_one_tokens(
        seed in any::<u64>(),
        k in 1usize..9,
        max_new in 1usize..60,
        temperature in prop::sample::select(vec![0.0f32, 0.7, 1.0]),
        onehot in any::<bool>(),
        noise in 0.0f32..4.0,
    ) {
        let target_logits = MockLogits::Hashed { vocab: 20, seed: 1, scale: 3.0 };
        let calls = Rc::new(Cell::new(0));
        let mut target = Recording { inner: MockModel::new(target_logits.clone()), calls: calls.clone(), drafted: Vec::new() };
        let mut drafter = ModelDrafter::new(MockModel::new(MockLogits::Perturbed { base: Box::new(target_logits), seed: 2, noise }));
        let config = GenerateConfig {
            max_new_tokens: max_new,
            sampling: SamplingParams { temperature, ..SamplingParams::default() },
            seed,
            verify_mode: if onehot { VerifyMode::OneHot } else { VerifyMode::Rejection },
            draft_len: DraftLenPolicy::Fixed { draft_len: k },
            ..GenerateConfig::default()
        };
        // Tokens emitted per target call, counted by the streaming callback; call 0 is prefill.
        let mut per_round = vec![0usize];
        let out = generate(&mut target, &mut drafter, &[1, 2, 3], &config, &mut |_| {
            let r = calls.get() - 1;
            if per_round.len() <= r { per_round.resize(r + 1, 0); }
            per_round[r] += 1;
            ControlFlow::Continue(())
        }).unwrap();
        prop_assert!(out.tokens.len() <= max_new);
        prop_assert_eq!(out.tokens.len(), max_new, "no stop tokens: the limit is reached");
        prop_assert_eq!(per_round[0], 1);
        for (r, &n) in per_round.iter().enumerate().skip(1) {
            let drafted = target.drafted[r];
            prop_assert!(drafted <= k);
            prop_assert!(n >= 1 && n <= drafted + 1, "round {} emitted {} with {} drafted", r, n, drafted);
        }
        prop_assert!(out.metrics.accepted <= out.metrics.drafted);
    }
}
