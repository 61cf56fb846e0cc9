//! Every path against one reference: greedy speculative output equals greedy target-only output, token
//! for token, for every draft length, policy and drafter kind, on many contexts.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use std::ops::ControlFlow;

use specdec_core::mock::{MockLogits, MockModel};
use specdec_core::{
    generate, Draft, DraftLenPolicy, FixedCost, GenerateConfig, HybridDrafter, LookupDrafter,
    ModelDrafter, NGramDrafter, NoDraft, Output, SamplingParams, SeqId, TokenId,
};

const VOCAB: usize = 48;

fn target_logits() -> MockLogits {
    MockLogits::Hashed {
        vocab: VOCAB,
        seed: 11,
        scale: 3.0,
    }
}

fn run<D: Draft>(drafter: &mut D, prompt: &[TokenId], config: &GenerateConfig) -> Output {
    let mut target = MockModel::new(target_logits());
    let mut streamed = Vec::new();
    let out = generate(&mut target, drafter, prompt, config, &mut |t| {
        streamed.push(t);
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(streamed, out.tokens, "the callback sees exactly the output");
    out
}

fn policies(k: usize) -> Vec<DraftLenPolicy> {
    vec![
        DraftLenPolicy::Fixed { draft_len: k },
        DraftLenPolicy::Adaptive {
            initial: k,
            min: 1,
            max: k.max(2),
            target_acceptance: 0.6,
            smoothing: 0.3,
        },
        DraftLenPolicy::CostModel {
            max: k,
            cost: Some(FixedCost {
                c: 0.05,
                draft_fixed: 0.0,
                r: vec![1.0, 1.1, 1.2, 1.3, 1.4],
                context: None,
                step_secs: None,
                acceptance: Vec::new(),
                draft_read: None,
                draft_step_secs: None,
            }),
            probe_every: 3,
            prior: None,
        },
        DraftLenPolicy::CostModel {
            max: k,
            cost: None,
            probe_every: 5,
            prior: None,
        },
        DraftLenPolicy::CostModel {
            max: k,
            cost: None,
            probe_every: 7,
            prior: Some(FixedCost {
                c: 0.1,
                draft_fixed: 0.3,
                r: vec![1.0, 1.05, 1.1],
                context: None,
                step_secs: None,
                acceptance: Vec::new(),
                draft_read: None,
                draft_step_secs: None,
            }),
        },
    ]
}

fn drafters() -> Vec<(&'static str, MockLogits)> {
    vec![
        (
            "close",
            MockLogits::Perturbed {
                base: Box::new(target_logits()),
                seed: 5,
                noise: 1.0,
            },
        ),
        (
            "far",
            MockLogits::Perturbed {
                base: Box::new(target_logits()),
                seed: 6,
                noise: 4.0,
            },
        ),
        (
            "adversarial",
            MockLogits::Negated(Box::new(target_logits())),
        ),
        (
            "fixed",
            MockLogits::Fixed((0..VOCAB).map(|i| (i % 7) as f32).collect()),
        ),
        (
            "scripted",
            MockLogits::Scripted(
                (0..5)
                    .map(|s| (0..VOCAB).map(|i| ((i * 3 + s) % 11) as f32).collect())
                    .collect(),
            ),
        ),
    ]
}

#[test]
fn greedy_speculative_equals_greedy_target_only() {
    let mut extended = 0;
    for (penalty, stop) in [(1.0, vec![]), (1.3, vec![7])] {
        let config = |policy| GenerateConfig {
            max_new_tokens: 40,
            sampling: SamplingParams {
                repetition_penalty: penalty,
                ..SamplingParams::greedy()
            },
            stop_tokens: stop.clone(),
            draft_len: policy,
            ..GenerateConfig::default()
        };
        for p in 0..12u64 {
            let prompt = common::prompt(p, 3 + p as usize, VOCAB);
            let reference = run(&mut NoDraft, &prompt, &config(DraftLenPolicy::default()));
            assert!(!reference.tokens.is_empty());
            for k in 1..=8 {
                for policy in policies(k) {
                    let cfg = config(policy.clone());
                    for (name, logits) in drafters() {
                        let mut drafter = ModelDrafter::new(MockModel::new(logits));
                        let out = run(&mut drafter, &prompt, &cfg);
                        assert_eq!(
                            out.tokens, reference.tokens,
                            "drafter {name}, k {k}, policy {policy:?}, prompt {p}"
                        );
                        assert_eq!(out.stop_reason, reference.stop_reason);
                        let m = &out.metrics;
                        assert!(m.accepted <= m.drafted);
                        // The first token comes from prefill, the rest from rounds.
                        assert_eq!(
                            out.tokens.len() as u64,
                            m.emitted + u64::from(!out.tokens.is_empty())
                        );
                    }
                    let out = run(&mut NGramDrafter::default(), &prompt, &cfg);
                    assert_eq!(out.tokens, reference.tokens, "ngram, k {k}, prompt {p}");
                    let mut lookup = LookupDrafter::default();
                    let out = run(&mut lookup, &prompt, &cfg);
                    assert_eq!(out.tokens, reference.tokens, "lookup, k {k}, prompt {p}");
                    // Again, now with the first output in the lookup's history.
                    let out = run(&mut lookup, &prompt, &cfg);
                    assert_eq!(
                        out.tokens, reference.tokens,
                        "lookup again, k {k}, prompt {p}"
                    );
                    let mut hybrid = HybridDrafter::new(
                        LookupDrafter::default(),
                        ModelDrafter::new(MockModel::new(MockLogits::Perturbed {
                            base: Box::new(target_logits()),
                            seed: 5,
                            noise: 1.0,
                        })),
                    );
                    let out = run(&mut hybrid, &prompt, &cfg);
                    assert_eq!(out.tokens, reference.tokens, "hybrid, k {k}, prompt {p}");
                    // The hybrid's model leaving a prompt it could not repay unread.
                    if let DraftLenPolicy::CostModel {
                        prior: Some(prior), ..
                    } = &policy
                    {
                        let dear = config(DraftLenPolicy::CostModel {
                            max: k,
                            cost: None,
                            probe_every: 3,
                            prior: Some(FixedCost {
                                draft_read: Some(1_000.0),
                                draft_step_secs: None,
                                ..prior.clone()
                            }),
                        });
                        let mut hybrid = HybridDrafter::new(
                            LookupDrafter::default(),
                            ModelDrafter::new(MockModel::new(target_logits())),
                        );
                        let out = run(&mut hybrid, &prompt, &dear);
                        assert_eq!(
                            out.tokens, reference.tokens,
                            "hybrid leaving the prompt unread, k {k}, prompt {p}"
                        );
                        assert!(hybrid.left_unread(SeqId(0)));
                        assert_eq!(hybrid.model.model().stats().calls, 0);
                    }
                    let mut extending = common::ExtendingHybrid::new(ModelDrafter::new(
                        MockModel::new(MockLogits::Perturbed {
                            base: Box::new(target_logits()),
                            seed: 5,
                            noise: 1.0,
                        }),
                    ));
                    let out = run(&mut extending, &prompt, &cfg);
                    assert_eq!(
                        out.tokens, reference.tokens,
                        "extending hybrid, k {k}, prompt {p}"
                    );
                    extended += out.metrics.extended_rounds;
                }
            }
        }
    }
    assert!(
        extended > 100,
        "only {extended} rounds extended a lookup draft"
    );
}

#[test]
fn a_close_draft_is_accepted_and_an_adversarial_one_is_not() {
    let prompt = common::prompt(1, 8, VOCAB);
    let config = GenerateConfig {
        max_new_tokens: 64,
        sampling: SamplingParams::greedy(),
        draft_len: DraftLenPolicy::Fixed { draft_len: 4 },
        ..GenerateConfig::default()
    };
    let mut close = ModelDrafter::new(MockModel::new(MockLogits::Perturbed {
        base: Box::new(target_logits()),
        seed: 5,
        noise: 0.05,
    }));
    let out = run(&mut close, &prompt, &config);
    assert!(out.metrics.acceptance_rate() > 0.5, "{:?}", out.metrics);
    let mut same = ModelDrafter::new(MockModel::new(target_logits()));
    let out = run(&mut same, &prompt, &config);
    assert_eq!(out.metrics.acceptance_rate(), 1.0);
    assert!(out.metrics.mean_accepted_len() > 4.5);
    let mut adversarial = ModelDrafter::new(MockModel::new(MockLogits::Negated(Box::new(
        target_logits(),
    ))));
    let out = run(&mut adversarial, &prompt, &config);
    assert_eq!(out.metrics.accepted, 0);
    assert_eq!(out.metrics.mean_accepted_len(), 1.0);
}

#[test]
fn the_target_scores_each_round_in_one_call_and_rolls_back() {
    let prompt = common::prompt(2, 10, VOCAB);
    let config = GenerateConfig {
        max_new_tokens: 50,
        sampling: SamplingParams::greedy(),
        draft_len: DraftLenPolicy::Fixed { draft_len: 5 },
        ..GenerateConfig::default()
    };
    let mut target = MockModel::new(target_logits());
    let mut drafter = ModelDrafter::new(MockModel::new(MockLogits::Perturbed {
        base: Box::new(target_logits()),
        seed: 9,
        noise: 2.0,
    }));
    let out = generate(&mut target, &mut drafter, &prompt, &config, &mut |_| {
        ControlFlow::Continue(())
    })
    .unwrap();
    let m = &out.metrics;
    // One call for prefill, one per round.
    assert_eq!(target.stats().calls, m.rounds + 1);
    // Every scored token is fed once: the prompt, and each round's next token plus its draft.
    assert_eq!(
        target.stats().fed,
        prompt.len() as u64 + m.rounds + m.drafted
    );
    // After the last commit the cache holds exactly the committed sequence minus the newest token
    // (never fed), or less.
    let committed: Vec<TokenId> = prompt.iter().chain(&out.tokens).copied().collect();
    let cached = target.cached_tokens(SeqId(0));
    assert!(committed.starts_with(cached));
    assert!(cached.len() >= committed.len() - 1);
    // The draft never drafts more than asked.
    assert!(m.per_position.len() <= 5);
    assert!(drafter.model().stats().calls > 0);
}

#[test]
fn early_stop_on_low_draft_confidence_drafts_less_and_stays_lossless() {
    let prompt = common::prompt(3, 6, VOCAB);
    let draft = || {
        ModelDrafter::new(MockModel::new(MockLogits::Perturbed {
            base: Box::new(target_logits()),
            seed: 5,
            noise: 1.0,
        }))
    };
    for params in [SamplingParams::greedy(), SamplingParams::default()] {
        let config = |min_confidence| GenerateConfig {
            max_new_tokens: 60,
            sampling: params.clone(),
            seed: 3,
            verify_mode: specdec_core::VerifyMode::OneHot,
            draft_len: DraftLenPolicy::Fixed { draft_len: 6 },
            min_confidence,
            ..GenerateConfig::default()
        };
        let all = run(&mut draft(), &prompt, &config(0.0));
        let confident = run(&mut draft(), &prompt, &config(0.3));
        assert_eq!(
            confident.tokens, all.tokens,
            "early stop must not change the output"
        );
        assert!(
            confident.metrics.drafted < all.metrics.drafted,
            "{} vs {} drafted",
            confident.metrics.drafted,
            all.metrics.drafted
        );
    }
}
