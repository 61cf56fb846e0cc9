//! Bad input gets a typed error, never a panic, and nothing already produced is lost.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::ops::ControlFlow;

use specdec_core::mock::{MockLogits, MockModel};
use specdec_core::{
    generate, DecodeError, DraftLenPolicy, Error, GenerateConfig, ModelDrafter, NoDraft, Output,
    SamplingParams, Side, StopReason,
};

fn logits(vocab: usize) -> MockLogits {
    MockLogits::Hashed {
        vocab,
        seed: 1,
        scale: 3.0,
    }
}

fn greedy(max_new_tokens: usize) -> GenerateConfig {
    GenerateConfig {
        max_new_tokens,
        sampling: SamplingParams::greedy(),
        ..GenerateConfig::default()
    }
}

fn run(
    target: MockModel,
    draft: Option<MockModel>,
    prompt: &[u32],
    config: &GenerateConfig,
) -> Result<Output, DecodeError> {
    let mut target = target;
    let go = |t: &mut MockModel| -> Result<Output, DecodeError> {
        match draft.clone() {
            Some(d) => generate(t, &mut ModelDrafter::new(d), prompt, config, &mut |_| {
                ControlFlow::Continue(())
            }),
            None => generate(t, &mut NoDraft, prompt, config, &mut |_| {
                ControlFlow::Continue(())
            }),
        }
    };
    go(&mut target)
}

#[test]
fn setup_errors_are_typed() {
    let t = || MockModel::new(logits(16));
    let e = run(t(), None, &[], &greedy(4)).unwrap_err();
    assert!(matches!(e.error, Error::EmptyPrompt));
    let e = run(t(), None, &[1, 99], &greedy(4)).unwrap_err();
    assert!(matches!(
        e.error,
        Error::TokenOutOfRange {
            token: 99,
            vocab: 16,
            ..
        }
    ));
    let e = run(t(), Some(MockModel::new(logits(17))), &[1], &greedy(4)).unwrap_err();
    assert!(matches!(
        e.error,
        Error::VocabMismatch {
            draft: 17,
            target: 16
        }
    ));
    let e = run(t().with_capacity(4), None, &[1, 2, 3, 4], &greedy(4)).unwrap_err();
    assert!(matches!(
        e.error,
        Error::ContextOverflow {
            len: 5,
            capacity: 4
        }
    ));
    let bad_k = GenerateConfig {
        draft_len: DraftLenPolicy::Fixed { draft_len: 0 },
        ..greedy(4)
    };
    let e = run(t(), None, &[1], &bad_k).unwrap_err();
    assert!(
        matches!(
            e.error,
            Error::InvalidConfig {
                field: "draft_len",
                ..
            }
        ),
        "{e}"
    );
    let bad_t = GenerateConfig {
        sampling: SamplingParams {
            temperature: -0.5,
            ..SamplingParams::default()
        },
        ..greedy(4)
    };
    let e = run(t(), None, &[1], &bad_t).unwrap_err();
    assert!(matches!(
        e.error,
        Error::InvalidConfig {
            field: "temperature",
            ..
        }
    ));
    assert!(e.to_string().contains("temperature"), "{e}");
}

#[test]
fn non_finite_logits_are_an_error() {
    let mut v = vec![0.0f32; 8];
    v[3] = f32::NAN;
    let e = run(MockModel::new(MockLogits::Fixed(v)), None, &[1], &greedy(4)).unwrap_err();
    assert!(matches!(e.error, Error::NonFiniteLogits { index: 3, .. }));
}

#[test]
fn a_target_failure_keeps_what_was_produced() {
    let reference = run(MockModel::new(logits(16)), None, &[1, 2], &greedy(30)).unwrap();
    for fail_at in 2..8 {
        let e = run(
            MockModel::new(logits(16)).fail_at_call(fail_at),
            Some(MockModel::new(MockLogits::Perturbed {
                base: Box::new(logits(16)),
                seed: 3,
                noise: 0.5,
            })),
            &[1, 2],
            &GenerateConfig {
                draft_len: DraftLenPolicy::Fixed { draft_len: 3 },
                ..greedy(30)
            },
        )
        .unwrap_err();
        assert!(
            matches!(
                e.error,
                Error::Model {
                    side: Side::Target,
                    ..
                }
            ),
            "{e}"
        );
        assert!(!e.output.tokens.is_empty());
        assert!(
            reference.tokens.starts_with(&e.output.tokens),
            "the partial output is a prefix of the full one"
        );
        assert_eq!(e.output.stop_reason, None);
    }
}

/// The scripted draft logits of the non-finite tests: five positions' finite rows over 16 tokens.
fn draft_script() -> Vec<Vec<f32>> {
    (0..5)
        .map(|i| (0..16).map(|t| ((t * 7 + i * 3) % 16) as f32).collect())
        .collect()
}

/// A draft model whose logits are not finite at some positions ends its draft there, not the
/// generation: the target decodes on, the greedy text is the target's own, and the metrics count
/// the rounds whose draft ended so (a healthy draft's count none).
#[test]
fn a_draft_with_non_finite_logits_ends_its_draft_not_the_generation() {
    let mut script = draft_script();
    script[2][5] = f32::NAN;
    script[4][0] = f32::INFINITY;
    let config = GenerateConfig {
        draft_len: DraftLenPolicy::Fixed { draft_len: 3 },
        ..greedy(30)
    };
    let reference = run(MockModel::new(logits(16)), None, &[1, 2], &config).unwrap();
    let out = run(
        MockModel::new(logits(16)),
        Some(MockModel::new(MockLogits::Scripted(script))),
        &[1, 2],
        &config,
    )
    .unwrap();
    assert_eq!(out.tokens, reference.tokens);
    assert!(out.metrics.drafted > 0, "the other positions are drafted");
    assert!(out.metrics.non_finite_rounds > 0);
    assert!(out.metrics.non_finite_rounds < out.metrics.rounds);
}

/// The hybrid's model rounds count the same way: the draft ends, the target decodes on.
#[test]
fn a_hybrid_whose_model_has_non_finite_logits_counts_those_rounds() {
    let mut script = draft_script();
    script[1][2] = f32::NAN;
    let config = GenerateConfig {
        draft_len: DraftLenPolicy::Fixed { draft_len: 3 },
        ..greedy(30)
    };
    let reference = run(MockModel::new(logits(16)), None, &[1, 2], &config).unwrap();
    let mut hybrid = specdec_core::HybridDrafter::new(
        specdec_core::LookupDrafter::default(),
        ModelDrafter::new(MockModel::new(MockLogits::Scripted(script))),
    );
    let out = generate(
        &mut MockModel::new(logits(16)),
        &mut hybrid,
        &[1, 2],
        &config,
        &mut |_| ControlFlow::Continue(()),
    )
    .unwrap();
    assert_eq!(out.tokens, reference.tokens);
    assert!(out.metrics.non_finite_rounds > 0);
}

/// The same scripted draft with finite logits everywhere: no round counts as non-finite.
#[test]
fn a_draft_with_finite_logits_counts_no_non_finite_rounds() {
    let script = draft_script();
    let out = run(
        MockModel::new(logits(16)),
        Some(MockModel::new(MockLogits::Scripted(script))),
        &[1, 2],
        &GenerateConfig {
            draft_len: DraftLenPolicy::Fixed { draft_len: 3 },
            ..greedy(30)
        },
    )
    .unwrap();
    assert!(out.metrics.drafted > 0);
    assert_eq!(out.metrics.non_finite_rounds, 0);
}

#[test]
fn a_draft_failure_names_the_draft() {
    let e = run(
        MockModel::new(logits(16)),
        Some(MockModel::new(logits(16)).fail_at_call(4)),
        &[1, 2],
        &greedy(30),
    )
    .unwrap_err();
    assert!(
        matches!(
            e.error,
            Error::Model {
                side: Side::Draft,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("draft"), "{e}");
    assert!(!e.output.tokens.is_empty());
}

/// A drafter that proposes token 1 with a confidence estimate of its choosing.
struct Confident(f32);

impl specdec_core::Draft for Confident {
    type Error = std::convert::Infallible;

    fn vocab_size(&self) -> Option<usize> {
        None
    }

    fn propose(
        &mut self,
        batch: &[specdec_core::DraftRequest<'_>],
        out: &mut [specdec_core::Proposal],
    ) -> Result<(), Self::Error> {
        for p in out.iter_mut().take(batch.len()) {
            p.tokens.push(1);
            p.probs.push(specdec_core::Probs::OneHot(1));
            p.confidence.push(self.0);
        }
        Ok(())
    }

    fn commit(&mut self, _: specdec_core::SeqId, _: &[u32]) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// A confidence estimate that is not a probability (NaN would otherwise stay in the cost model's
/// sums for good) is a typed error naming it; a probability is fine.
#[test]
fn a_confidence_that_is_not_a_probability_is_an_error() {
    let go = |c: f32| {
        generate(
            &mut MockModel::new(logits(16)),
            &mut Confident(c),
            &[1, 2],
            &greedy(8),
            &mut |_| ControlFlow::Continue(()),
        )
    };
    for bad in [f32::NAN, -0.5, 1.5, f32::INFINITY] {
        let e = go(bad).unwrap_err();
        assert!(
            matches!(e.error, Error::BadConfidence { index: 0, .. }),
            "{bad}: {e}"
        );
    }
    assert!(go(0.5).is_ok());
}

/// A drafter that proposes token 1 as a model draft with draft-model confidences of its choosing.
struct TopProbs(Vec<f32>);

impl specdec_core::Draft for TopProbs {
    type Error = std::convert::Infallible;

    fn vocab_size(&self) -> Option<usize> {
        None
    }

    fn propose(
        &mut self,
        batch: &[specdec_core::DraftRequest<'_>],
        out: &mut [specdec_core::Proposal],
    ) -> Result<(), Self::Error> {
        for p in out.iter_mut().take(batch.len()) {
            p.clear();
            p.push(1, specdec_core::Probs::OneHot(1));
            p.top_probs.clone_from(&self.0);
        }
        Ok(())
    }

    fn commit(&mut self, _: specdec_core::SeqId, _: &[u32]) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// A draft model's confidence that is not a probability, or more confidences than drafted tokens,
/// is a typed error (they would stay in the cost model's calibration); a probability is fine.
#[test]
fn a_draft_models_confidence_that_is_not_a_probability_is_an_error() {
    let go = |top: Vec<f32>| {
        generate(
            &mut MockModel::new(logits(16)),
            &mut TopProbs(top),
            &[1, 2],
            &greedy(8),
            &mut |_| ControlFlow::Continue(()),
        )
    };
    for bad in [f32::NAN, -0.5, 1.5, f32::INFINITY] {
        let e = go(vec![bad]).unwrap_err();
        assert!(
            matches!(e.error, Error::BadConfidence { index: 0, .. }),
            "{bad}: {e}"
        );
    }
    let e = go(vec![0.5, 0.5]).unwrap_err();
    assert!(matches!(e.error, Error::ShapeMismatch { .. }), "{e}");
    assert!(go(vec![0.5]).is_ok());
}

#[test]
fn generation_stops_at_the_context_capacity_without_overflowing() {
    for k in 1..=8 {
        let config = GenerateConfig {
            draft_len: DraftLenPolicy::Fixed { draft_len: k },
            ..greedy(100)
        };
        let out = run(
            MockModel::new(logits(16)).with_capacity(20),
            Some(MockModel::new(logits(16)).with_capacity(20)),
            &[1, 2, 3],
            &config,
        )
        .unwrap();
        assert_eq!(out.stop_reason, Some(StopReason::ContextFull), "k {k}");
        assert_eq!(
            out.tokens.len(),
            17,
            "k {k}: the sequence fills the context exactly"
        );
    }
}

#[test]
fn stop_tokens_end_generation_and_are_not_emitted() {
    let reference = run(MockModel::new(logits(16)), None, &[1, 2], &greedy(40)).unwrap();
    let stop = reference.tokens[5];
    let first = reference.tokens.iter().position(|&t| t == stop).unwrap();
    for k in 1..=6 {
        let config = GenerateConfig {
            stop_tokens: vec![stop],
            draft_len: DraftLenPolicy::Fixed { draft_len: k },
            ..greedy(40)
        };
        let out = run(
            MockModel::new(logits(16)),
            Some(MockModel::new(logits(16))),
            &[1, 2],
            &config,
        )
        .unwrap();
        assert_eq!(out.stop_reason, Some(StopReason::StopToken(stop)));
        assert_eq!(out.tokens, reference.tokens[..first]);
    }
}

#[test]
fn the_callback_can_cancel() {
    let mut target = MockModel::new(logits(16));
    let mut drafter = ModelDrafter::new(MockModel::new(logits(16)));
    let mut n = 0;
    let config = GenerateConfig {
        draft_len: DraftLenPolicy::Fixed { draft_len: 8 },
        ..greedy(100)
    };
    let out = generate(&mut target, &mut drafter, &[1], &config, &mut |_| {
        n += 1;
        if n == 5 {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })
    .unwrap();
    assert_eq!(out.stop_reason, Some(StopReason::Cancelled));
    assert_eq!(out.tokens.len(), 5);
}

#[test]
fn max_new_tokens_is_exact_for_every_draft_length() {
    for max in [1, 2, 7, 33] {
        for k in 1..=8 {
            let config = GenerateConfig {
                draft_len: DraftLenPolicy::Fixed { draft_len: k },
                ..greedy(max)
            };
            let out = run(
                MockModel::new(logits(16)),
                Some(MockModel::new(logits(16))),
                &[1],
                &config,
            )
            .unwrap();
            assert_eq!(out.tokens.len(), max);
            assert_eq!(out.stop_reason, Some(StopReason::MaxTokens));
        }
    }
    let out = run(MockModel::new(logits(16)), None, &[1], &greedy(0)).unwrap();
    assert!(out.tokens.is_empty());
}
