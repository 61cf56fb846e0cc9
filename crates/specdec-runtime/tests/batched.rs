//! Several sequences on one model: a batched forward pass gives every sequence the logits of a pass of
//! its own, bit for bit, and continuous batching with the real runtime gives every sequence the tokens
//! it gets alone.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::HashMap;
use std::ops::ControlFlow;

use candle_core::quantized::GgmlDType;
use common::{decode_together, score_alone, tiny_model};
use specdec_core::{
    generate, Batch, DraftLenPolicy, GenerateConfig, Logits, ModelDrafter, NoDraft, SamplingParams,
    Score, SeqId, Target, TokenId,
};
use specdec_runtime::testing::TinySpec;
use specdec_runtime::{Arch, Error, Session, Sessions};

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + seed * 11 + 5) % 256)
        .collect()
}

/// Prompts that share their first 40 tokens (each then has 6 of its own, from `tail`) on a tiny
/// Qwen2 model, generated greedily for 6 tokens, and what each gives decoded alone.
struct SharedPrefix {
    model: std::sync::Arc<specdec_runtime::Model>,
    config: GenerateConfig,
}

impl SharedPrefix {
    fn new() -> Self {
        SharedPrefix {
            model: tiny_model(&TinySpec::new(Arch::Qwen2, GgmlDType::Q8_0)),
            config: GenerateConfig {
                max_new_tokens: 6,
                sampling: SamplingParams::greedy(),
                ..GenerateConfig::default()
            },
        }
    }

    fn prompt(tail: u32) -> Vec<TokenId> {
        [tokens(40, 3), tokens(6, tail)].concat()
    }

    fn alone(&self, p: &[TokenId]) -> Vec<TokenId> {
        let mut t = Session::new(self.model.clone(), 128);
        generate(&mut t, &mut NoDraft, p, &self.config, &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap()
        .tokens
    }

    /// A batch of at most 2 sequences on the model, prefilling chunks of 8 tokens.
    fn batch(&self) -> Batch<Sessions, NoDraft> {
        let mut batch = Batch::new(Sessions::new(self.model.clone(), 128, 2), NoDraft);
        batch.set_prefill_chunk(Some(8));
        batch
    }
}

#[test]
fn batched_scores_equal_separate_scores_bit_for_bit() {
    for (arch, dtype) in [
        (Arch::Llama, GgmlDType::Q4K),
        (Arch::Qwen2, GgmlDType::Q8_0),
        (Arch::Qwen2, GgmlDType::Q6K),
    ] {
        let model = tiny_model(&TinySpec::new(arch, dtype));
        let mut batched = Sessions::new(model.clone(), 128, 4);
        // Contexts of different lengths, drafts of different lengths, and a second round that
        // rolls back part of a draft.
        let contexts: Vec<Vec<u32>> = (0..4).map(|s| tokens(3 + 5 * s, s as u32)).collect();
        let drafts: Vec<Vec<u32>> = (0..4).map(|s| tokens(s * 2, 7 + s as u32)).collect();
        for round in 0..2 {
            let reqs: Vec<Score<'_>> = (0..4)
                .map(|s| Score {
                    seq: SeqId(s as u64),
                    context: &contexts[s][..contexts[s].len() - round],
                    draft: &drafts[s],
                })
                .collect();
            let mut out = vec![Logits::new(0); 4];
            batched.score(&reqs, &mut out).unwrap();
            for (s, req) in reqs.iter().enumerate() {
                let want = score_alone(&model, req);
                assert_eq!(out[s].rows(), req.draft.len() + 1);
                for r in 0..out[s].rows() {
                    let same = out[s]
                        .row(r)
                        .iter()
                        .zip(want.row(r))
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{arch:?} {dtype:?} round {round} seq {s} row {r}");
                }
            }
        }
        assert_eq!(batched.active(), 4);
        batched.release(SeqId(0));
        assert_eq!(batched.active(), 3);
    }
}

#[test]
fn sessions_refuse_too_many_sequences_and_duplicates() {
    let model = tiny_model(&TinySpec::new(Arch::Llama, GgmlDType::Q8_0));
    let mut s = Sessions::new(model, 64, 2);
    let ctx = tokens(4, 1);
    let req = |i| Score {
        seq: SeqId(i),
        context: &ctx,
        draft: &[],
    };
    let mut out = vec![Logits::new(0); 3];
    let e = s.score(&[req(0), req(1), req(2)], &mut out).unwrap_err();
    assert!(matches!(e, Error::TooManySequences { max: 2 }), "{e}");
    let e = s.score(&[req(0), req(0)], &mut out).unwrap_err();
    assert!(matches!(e, Error::DuplicateSequence(0)), "{e}");
    // After the errors the sessions still work.
    s.score(&[req(0), req(1)], &mut out).unwrap();
    assert_eq!(out[1].rows(), 1);
}

/// With chunked prefill a batch claims a new sequence's cache when it plans the first chunk: one
/// the sessions have no room for fails alone, with its error, and the others go on.
#[test]
fn a_sequence_whose_cache_cannot_be_claimed_fails_alone() {
    let model = tiny_model(&TinySpec::new(Arch::Qwen2, GgmlDType::Q8_0));
    let config = GenerateConfig {
        max_new_tokens: 6,
        sampling: SamplingParams::greedy(),
        ..GenerateConfig::default()
    };
    let mut batch = Batch::new(Sessions::new(model.clone(), 128, 1), NoDraft);
    batch.set_prefill_chunk(Some(8));
    let (p1, p2) = (tokens(20, 1), tokens(20, 2));
    batch
        .add(SeqId(1), p1.clone(), config.clone(), None)
        .unwrap();
    batch.add(SeqId(2), p2, config.clone(), None).unwrap();
    let mut got = HashMap::new();
    while got.len() < 2 {
        for f in batch.step(&mut |_, _| ControlFlow::Continue(())) {
            got.insert(f.seq, f.result);
        }
    }
    let e = got.remove(&SeqId(2)).unwrap().unwrap_err();
    assert!(e.output.tokens.is_empty());
    assert!(e.error.to_string().contains("sequences"), "{}", e.error);
    let mut alone = Session::new(model, 128);
    let want = generate(&mut alone, &mut NoDraft, &p1, &config, &mut |_| {
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(got[&SeqId(1)].as_ref().unwrap().tokens, want.tokens);
}

#[test]
fn continuous_batching_on_tiny_models_gives_each_sequence_its_own_tokens() {
    let target = tiny_model(&TinySpec::new(Arch::Qwen2, GgmlDType::Q8_0));
    let draft = tiny_model(&TinySpec::new(Arch::Qwen2, GgmlDType::Q4_0));
    let configs: Vec<(Vec<TokenId>, GenerateConfig)> = (0..4)
        .map(|i| {
            let sampling = if i % 2 == 0 {
                SamplingParams::greedy()
            } else {
                SamplingParams {
                    temperature: 0.9,
                    ..SamplingParams::default()
                }
            };
            let config = GenerateConfig {
                max_new_tokens: 12 + 4 * i,
                sampling,
                seed: i as u64,
                draft_len: DraftLenPolicy::Fixed { draft_len: 1 + i },
                ..GenerateConfig::default()
            };
            (tokens(4 + 3 * i, i as u32), config)
        })
        .collect();
    let alone: Vec<Vec<TokenId>> = configs
        .iter()
        .map(|(p, c)| {
            let mut t = Session::new(target.clone(), 128);
            let mut d = ModelDrafter::new(Session::new(draft.clone(), 128));
            generate(&mut t, &mut d, p, c, &mut |_| ControlFlow::Continue(()))
                .unwrap()
                .tokens
        })
        .collect();
    let mut batch = Batch::new(
        Sessions::new(target, 128, 4),
        ModelDrafter::new(Sessions::new(draft, 128, 4)),
    );
    let mut got: HashMap<SeqId, Vec<TokenId>> = HashMap::new();
    let mut step = 0;
    while got.len() < configs.len() {
        if step < configs.len() {
            let (p, c) = configs[step].clone();
            batch.add(SeqId(step as u64), p, c, None).unwrap();
        }
        for f in batch.step(&mut |_, _| ControlFlow::Continue(())) {
            got.insert(f.seq, f.result.unwrap().tokens);
            batch.release(f.seq);
        }
        step += 1;
    }
    for (i, want) in alone.iter().enumerate() {
        assert_eq!(&got[&SeqId(i as u64)], want, "sequence {i}");
    }
}

/// With chunked prefill (the server's), a new sequence takes over a released cache's whole shared
/// prefix, not only its first chunk, and decodes as it would from scratch.
#[test]
fn chunked_prefill_reuses_the_whole_released_prefix() {
    let case = SharedPrefix::new();
    let (config, prompt) = (&case.config, SharedPrefix::prompt);
    let alone = |p: &[TokenId]| case.alone(p);
    let mut batch = case.batch();
    for (id, tail) in [(1, 8), (2, 9)] {
        let p = prompt(tail);
        batch
            .add(SeqId(id), p.clone(), config.clone(), None)
            .unwrap();
        let mut done = Vec::new();
        while done.is_empty() {
            done = batch.step(&mut |_, _| ControlFlow::Continue(()));
        }
        let f = done.pop().unwrap();
        assert_eq!(f.result.unwrap().tokens, alone(&p), "sequence {id}");
        batch.release(f.seq);
    }
    assert_eq!(
        batch.target().reused_tokens(),
        40,
        "the second prompt's shared 40 tokens came from the released cache"
    );
    // Two new sequences with the same beginning in one step, and one released cache for it: one
    // takes the cache over, the other (claimed after it) copies the shared prefix from the first;
    // both decode as alone.
    let (p3, p4) = (prompt(10), prompt(11));
    let got = decode_together(&mut batch, &[(SeqId(3), &p3), (SeqId(4), &p4)], config);
    assert_eq!(got[&SeqId(3)], alone(&p3));
    assert_eq!(got[&SeqId(4)], alone(&p4));
    assert_eq!(batch.target().reused_tokens(), 120);
}

/// Two new sequences sharing a 40-token prefix, added together to a batch with nothing cached:
/// the second waits, unscored, while the first computes the prefix chunk by chunk, then copies it
/// (`Target::min_prefix_copy`) instead of computing it too; both decode as alone.
#[test]
fn a_new_sequence_waits_for_an_earlier_one_computing_their_shared_prefix() {
    let case = SharedPrefix::new();
    let (config, prompt) = (&case.config, SharedPrefix::prompt);
    let alone = |p: &[TokenId]| case.alone(p);
    let mut batch = case.batch();
    let (p1, p2) = (prompt(8), prompt(9));
    let got = decode_together(&mut batch, &[(SeqId(1), &p1), (SeqId(2), &p2)], config);
    assert_eq!(got[&SeqId(1)], alone(&p1));
    assert_eq!(got[&SeqId(2)], alone(&p2));
    assert_eq!(
        batch.target().reused_tokens(),
        40,
        "the second sequence copied the 40 shared tokens from the first"
    );
}

#[test]
fn a_new_sequence_reuses_the_longest_released_prefix_with_the_same_logits() {
    let model = tiny_model(&TinySpec::new(Arch::Qwen2, GgmlDType::Q4K));
    let mut s = Sessions::new(model, 128, 2);
    let shared = tokens(20, 3);
    let a = [shared.clone(), tokens(5, 8)].concat();
    let b = [shared.clone(), tokens(7, 9)].concat();
    scores_as_alone(&mut s, 1, &a, &[]);
    s.release(SeqId(1));
    assert_eq!(s.reused_tokens(), 0);
    scores_as_alone(&mut s, 2, &b, &[4, 5]);
    assert_eq!(
        s.reused_tokens(),
        20,
        "the shared prompt came from the released cache"
    );
}

/// The logits of `context` and `draft` scored for `seq` on `s`, and on a fresh session, row by row
/// bit for bit equal.
fn scores_as_alone(s: &mut Sessions, seq: u64, context: &[TokenId], draft: &[TokenId]) {
    let mut out = vec![Logits::new(0)];
    let req = Score {
        seq: SeqId(seq),
        context,
        draft,
    };
    s.score(&[req], &mut out).unwrap();
    let want = score_alone(s.model(), &req);
    for r in 0..=draft.len() {
        let same = out[0]
            .row(r)
            .iter()
            .zip(want.row(r))
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "sequence {seq}, row {r}");
    }
}

#[test]
fn a_new_sequence_copies_a_running_sequences_prefix_with_the_same_logits() {
    for (arch, dtype) in [
        (Arch::Qwen2, GgmlDType::Q4K),
        (Arch::Llama, GgmlDType::Q8_0),
    ] {
        let model = tiny_model(&TinySpec::new(arch, dtype));
        let mut s = Sessions::new(model, 128, 3);
        // 37 shared tokens: whole key tiles and a partial one.
        let shared = tokens(37, 3);
        let a = [shared.clone(), tokens(5, 8)].concat();
        let b = [shared.clone(), tokens(7, 9)].concat();
        scores_as_alone(&mut s, 1, &a, &[]);
        assert_eq!(s.reused_tokens(), 0);
        // Sequence 1 is still running: sequence 2 copies its 37 shared tokens.
        assert_eq!(s.cached(SeqId(2), &b), 37);
        scores_as_alone(&mut s, 2, &b, &[4, 5]);
        assert_eq!(s.reused_tokens(), 37, "the shared prefix was copied");
        // The source goes on as before, and so does the copy.
        let a2 = [a.clone(), tokens(3, 4)].concat();
        scores_as_alone(&mut s, 1, &a2, &[6]);
        let b2 = [b.clone(), tokens(2, 5)].concat();
        scores_as_alone(&mut s, 2, &b2, &[]);
        // A prefix shorter than `MIN_COPY` is computed.
        let c = [shared[..10].to_vec(), tokens(4, 6)].concat();
        assert_eq!(s.cached(SeqId(3), &c), 0);
        scores_as_alone(&mut s, 3, &c, &[]);
        assert_eq!(s.reused_tokens(), 37);
    }
}
