//! The server's decoding path keeps the target distribution in rejection mode: sequences decoded
//! together in a `Batch` (drafting allowed in batches), each choosing its drafter through
//! `MultiDrafter` (lookup, the draft model, the hybrid, mixed within one batch). Pearson's chi-square
//! test of the first three tokens (125 cells) against the analytic target distribution, threshold
//! p >= 1e-6: a correct implementation fails with probability 1e-6 (the seeds are fixed, so a run is
//! reproducible).

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

#[path = "../../specdec-core/tests/common/mod.rs"]
mod stats;

use std::collections::HashMap;
use std::ops::ControlFlow;

use specdec_core::mock::{MockLogits, MockModel};
use specdec_core::{
    Batch, DraftLenPolicy, GenerateConfig, ModelDrafter, SamplingParams, SeqId, TokenId, VerifyMode,
};
use specdec_server::{DrafterKind, MultiDrafter};
use stats::{chi_square, target_probs};

const ALPHA: f64 = 1e-6;
const VOCAB: usize = 5;
const PROMPT: [TokenId; 4] = [1, 2, 1, 2];

fn target_logits() -> MockLogits {
    MockLogits::Hashed {
        vocab: VOCAB,
        seed: 3,
        scale: 1.5,
    }
}

fn exact_joint(params: &SamplingParams) -> Vec<f64> {
    let logits = target_logits();
    let mut out = vec![0.0; VOCAB.pow(3)];
    let p1 = target_probs(&logits, params, &PROMPT);
    for a in 0..VOCAB {
        let ctx_a: Vec<TokenId> = PROMPT.iter().copied().chain([a as TokenId]).collect();
        let p2 = target_probs(&logits, params, &ctx_a);
        for b in 0..VOCAB {
            let ctx_ab: Vec<TokenId> = ctx_a.iter().copied().chain([b as TokenId]).collect();
            let p3 = target_probs(&logits, params, &ctx_ab);
            for c in 0..VOCAB {
                out[(a * VOCAB + b) * VOCAB + c] = p1[a] * p2[b] * p3[c];
            }
        }
    }
    out
}

#[test]
fn rejection_mode_is_exact_for_every_drafter_in_mixed_batches() {
    let kinds = [DrafterKind::Ngram, DrafterKind::Model, DrafterKind::Hybrid];
    let params = SamplingParams {
        temperature: 0.9,
        ..SamplingParams::default()
    };
    let draft = MockModel::new(MockLogits::Perturbed {
        base: Box::new(target_logits()),
        seed: 4,
        noise: 1.5,
    });
    let mut batch = Batch::new(
        MockModel::new(target_logits()),
        MultiDrafter::new(Some(ModelDrafter::new(draft))),
    );
    let per_kind = 24_000u64;
    let total = per_kind * kinds.len() as u64;
    let mut counts: HashMap<DrafterKind, Vec<u64>> =
        kinds.iter().map(|&k| (k, vec![0; VOCAB.pow(3)])).collect();
    let mut got: HashMap<SeqId, Vec<TokenId>> = HashMap::new();
    let mut drafted = 0;
    let (mut next, mut done) = (0u64, 0u64);
    while done < total {
        // Eight sequences at a time, the kinds interleaved, joining as others leave.
        while batch.len() < 8 && next < total {
            let id = SeqId(next);
            let kind = kinds[(next % 3) as usize];
            assert!(batch.drafter_mut().select(id, kind));
            let config = GenerateConfig {
                max_new_tokens: 3,
                sampling: params.clone(),
                seed: next,
                verify_mode: VerifyMode::Rejection,
                draft_len: DraftLenPolicy::Fixed { draft_len: 3 },
                ..GenerateConfig::default()
            };
            batch.add(id, PROMPT.to_vec(), config, None).unwrap();
            next += 1;
        }
        let finished = batch.step(&mut |seq, e| {
            got.entry(seq).or_default().push(e.token);
            ControlFlow::Continue(())
        });
        for f in finished {
            let out = f.result.unwrap();
            drafted += out.metrics.drafted;
            let toks = got.remove(&f.seq).unwrap();
            assert_eq!(toks, out.tokens);
            let [a, b, c] = toks[..] else {
                panic!("expected 3 tokens, got {toks:?}")
            };
            let kind = kinds[(f.seq.0 % 3) as usize];
            counts.get_mut(&kind).unwrap()
                [(a as usize * VOCAB + b as usize) * VOCAB + c as usize] += 1;
            batch.release(f.seq);
            done += 1;
        }
    }
    assert!(drafted > 0, "the test would not exercise drafting");
    let expected = exact_joint(&params);
    for kind in kinds {
        let (stat, df, p) = chi_square(&counts[&kind], &expected);
        eprintln!("{}: chi2 {stat:.1} on {df} df, p = {p:.3}", kind.name());
        assert!(
            p >= ALPHA,
            "{}: chi2 {stat:.1} on {df} df, p = {p:.3e}",
            kind.name()
        );
    }
}
