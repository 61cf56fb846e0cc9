//! Continuous batching: sequences decoded together, joining and leaving between steps, each get exactly
//! the tokens they get alone (greedy and sampled, every drafter), and one sequence's end or failure
//! leaves the others running.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::HashMap;
use std::ops::ControlFlow;

use common::{Hooks, Watched};
use specdec_core::mock::{MockLogits, MockModel};
use specdec_core::{
    generate, Batch, Draft, DraftLenPolicy, Emitted, GenerateConfig, HybridDrafter, LookupConfig,
    LookupDrafter, ModelDrafter, NGramDrafter, NoDraft, SamplingParams, SeqId, StopReason, Stream,
    TokenId,
};

const VOCAB: usize = 40;

fn target() -> MockModel {
    MockModel::new(MockLogits::Hashed {
        vocab: VOCAB,
        seed: 5,
        scale: 3.0,
    })
}

fn draft_model() -> ModelDrafter<MockModel> {
    ModelDrafter::new(MockModel::new(MockLogits::Perturbed {
        base: Box::new(MockLogits::Hashed {
            vocab: VOCAB,
            seed: 5,
            scale: 3.0,
        }),
        seed: 9,
        noise: 1.0,
    }))
}

/// Six requests with different prompts, lengths, sampling and draft lengths.
fn requests() -> Vec<(Vec<TokenId>, GenerateConfig)> {
    (0..6u32)
        .map(|i| {
            let prompt: Vec<TokenId> = (0..3 + i).map(|j| (i * 7 + j * 3) % VOCAB as u32).collect();
            let sampling = if i % 2 == 0 {
                SamplingParams::greedy()
            } else {
                SamplingParams {
                    temperature: 0.8,
                    top_p: 0.95,
                    ..SamplingParams::default()
                }
            };
            let config = GenerateConfig {
                max_new_tokens: 10 + 3 * i as usize,
                sampling,
                seed: 100 + u64::from(i),
                draft_len: DraftLenPolicy::Fixed {
                    draft_len: 1 + i as usize % 4,
                },
                stop_tokens: vec![7],
                ..GenerateConfig::default()
            };
            (prompt, config)
        })
        .collect()
}

fn alone<D: Draft>(mut make: impl FnMut() -> D) -> Vec<(Vec<TokenId>, Option<StopReason>)> {
    requests()
        .into_iter()
        .map(|(prompt, config)| {
            let out = generate(&mut target(), &mut make(), &prompt, &config, &mut |_| {
                ControlFlow::Continue(())
            })
            .unwrap();
            (out.tokens, out.stop_reason)
        })
        .collect()
}

/// Adds request `i` at step `2 * i`, so sequences join while others are mid-way.
fn batched<D: Draft>(drafter: D) -> Vec<(Vec<TokenId>, Option<StopReason>)> {
    let reqs = requests();
    let mut batch = Batch::new(target(), drafter);
    let mut streamed: HashMap<SeqId, Vec<TokenId>> = HashMap::new();
    let mut results = vec![None; reqs.len()];
    let mut step = 0;
    while results.iter().any(Option::is_none) {
        if step % 2 == 0 && step / 2 < reqs.len() {
            let i = step / 2;
            let (p, c) = reqs[i].clone();
            batch.add(SeqId(i as u64), p, c, None).unwrap();
        }
        let done = batch.step(&mut |seq, e: &Emitted| {
            streamed.entry(seq).or_default().push(e.token);
            ControlFlow::Continue(())
        });
        for f in done {
            let out = f.result.unwrap();
            assert_eq!(
                streamed.get(&f.seq).cloned().unwrap_or_default(),
                out.tokens
            );
            batch.release(f.seq);
            results[f.seq.0 as usize] = Some((out.tokens, out.stop_reason));
        }
        step += 1;
        assert!(step < 1000, "the batch never finished");
    }
    assert!(batch.is_empty());
    results.into_iter().map(Option::unwrap).collect()
}

#[test]
fn batched_sequences_get_the_tokens_they_get_alone() {
    let expect = alone(|| NoDraft);
    assert_eq!(batched(NoDraft), expect);
    assert_eq!(batched(draft_model()), alone(draft_model));
    assert_eq!(
        batched(NGramDrafter::default()),
        alone(NGramDrafter::default)
    );
    // The learning lookup shares its history and estimates across sequences, so a sampled sequence's
    // drafts (never its distribution) depend on the others; without history and without the
    // estimate-based stop its drafts depend on the sequence's own context alone.
    let stateless = || LookupConfig {
        history_tokens: 0,
        min_reach: 0.0,
        ..LookupConfig::default()
    };
    let hybrid = || HybridDrafter::new(LookupDrafter::new(stateless()), draft_model());
    assert_eq!(batched(hybrid()), alone(hybrid));
    // Greedy sequences get the same tokens with the learning lookup too.
    let learning = || HybridDrafter::new(LookupDrafter::default(), draft_model());
    for (i, ((a, _), (b, _))) in batched(learning()).iter().zip(&expect).enumerate() {
        if i % 2 == 0 {
            assert_eq!(a, b, "greedy sequence {i}, learning lookup");
        }
    }
    // Greedy sequences get the target's own greedy tokens whatever the drafter.
    for (i, ((a, _), (b, _))) in batched(draft_model()).iter().zip(&expect).enumerate() {
        if i % 2 == 0 {
            assert_eq!(a, b, "greedy sequence {i}");
        }
    }
}

#[test]
fn a_batch_step_makes_one_draft_and_one_target_call_per_position() {
    let mut batch = Batch::new(target(), NoDraft);
    for (i, (p, c)) in requests().into_iter().enumerate().take(4) {
        batch.add(SeqId(i as u64), p, c, None).unwrap();
    }
    batch.step(&mut |_, _| ControlFlow::Continue(()));
    batch.step(&mut |_, _| ControlFlow::Continue(()));
    // One prefill call and one decode call for all four.
    assert_eq!(batch.target().stats().calls, 2);
}

#[test]
fn cancel_and_break_end_one_sequence_only() {
    let reqs = requests();
    let mut batch = Batch::new(target(), draft_model());
    for (i, (p, c)) in reqs.iter().cloned().enumerate().take(3) {
        batch.add(SeqId(i as u64), p, c, None).unwrap();
    }
    // Sequence 1 stops itself after its second token; sequence 2 is cancelled from outside.
    let mut count = 0;
    let mut finished = Vec::new();
    let mut step = |batch: &mut Batch<MockModel, ModelDrafter<MockModel>>| {
        batch.step(&mut |seq, _| {
            if seq == SeqId(1) {
                count += 1;
                if count == 2 {
                    return ControlFlow::Break(());
                }
            }
            ControlFlow::Continue(())
        })
    };
    finished.extend(step(&mut batch));
    let cancelled = batch.cancel(SeqId(2)).unwrap();
    assert_eq!(cancelled.stop_reason, Some(StopReason::Cancelled));
    assert_eq!(cancelled.tokens.len(), 1, "the prefill's token is kept");
    while !batch.is_empty() {
        finished.extend(step(&mut batch));
    }
    let by_seq: HashMap<SeqId, _> = finished.into_iter().map(|f| (f.seq, f.result)).collect();
    let one = by_seq[&SeqId(1)].as_ref().unwrap();
    assert_eq!(one.stop_reason, Some(StopReason::Cancelled));
    assert_eq!(one.tokens.len(), 2);
    let zero = by_seq[&SeqId(0)].as_ref().unwrap();
    assert_eq!(zero.tokens, alone(|| NoDraft)[0].0);
}

#[test]
fn bad_requests_are_refused_and_a_duplicate_id_too() {
    let mut batch = Batch::new(target(), NoDraft);
    let config = GenerateConfig::default();
    assert!(batch.add(SeqId(0), vec![], config.clone(), None).is_err());
    assert!(batch
        .add(SeqId(0), vec![VOCAB as u32], config.clone(), None)
        .is_err());
    assert!(batch
        .add(SeqId(0), vec![1], config.clone(), Some(21))
        .is_err());
    batch.add(SeqId(0), vec![1], config.clone(), None).unwrap();
    assert!(batch.add(SeqId(0), vec![2], config, None).is_err());
    assert_eq!(batch.len(), 1);
}

#[test]
fn a_target_failure_ends_every_sequence_of_the_call_with_its_tokens() {
    let mut batch = Batch::new(target().fail_at_call(3), NoDraft);
    for (i, (p, c)) in requests().into_iter().enumerate().take(2) {
        batch.add(SeqId(i as u64), p, c, None).unwrap();
    }
    let mut finished = Vec::new();
    for _ in 0..3 {
        finished.extend(batch.step(&mut |_, _| ControlFlow::Continue(())));
    }
    assert_eq!(finished.len(), 2);
    for f in finished {
        let e = f.result.unwrap_err();
        assert_eq!(e.output.tokens.len(), 2, "prefill's token and one round's");
    }
}

#[test]
fn logprobs_come_with_each_token_when_asked() {
    let mut batch = Batch::new(target(), draft_model());
    let (p, c) = requests()[0].clone();
    batch.add(SeqId(0), p, c, Some(3)).unwrap();
    let mut seen = Vec::new();
    while !batch.is_empty() {
        batch.step(&mut |_, e| {
            seen.push(e.clone());
            ControlFlow::Continue(())
        });
    }
    assert!(!seen.is_empty());
    for e in &seen {
        let lp = e.logprob.as_ref().unwrap();
        assert_eq!(lp.top.len(), 3);
        assert!(lp.logprob <= 0.0);
        // Greedy: the committed token is the most likely one.
        assert_eq!(lp.top[0].0, e.token);
        assert!((lp.top[0].1 - lp.logprob).abs() < 1e-6);
    }
    assert!(
        seen.iter().any(|e| e.drafted),
        "some tokens came from drafts"
    );
}

#[test]
fn a_batch_draft_cap_stops_drafting_while_several_sequences_decode() {
    let reqs = requests();
    let greedy: Vec<_> = reqs
        .iter()
        .filter(|(_, c)| c.sampling.is_greedy())
        .cloned()
        .collect();
    let mut batch = Batch::new(target(), draft_model());
    batch.set_batch_draft_cap(Some(0));
    for (i, (p, c)) in greedy.iter().cloned().enumerate() {
        batch.add(SeqId(i as u64), p, c, None).unwrap();
    }
    let mut outs = HashMap::new();
    while !batch.is_empty() {
        for f in batch.step(&mut |_, _| ControlFlow::Continue(())) {
            outs.insert(f.seq, f.result.unwrap());
        }
    }
    for (i, (p, c)) in greedy.iter().enumerate() {
        let alone = generate(&mut target(), &mut NoDraft, p, c, &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap();
        assert_eq!(
            outs[&SeqId(i as u64)].tokens,
            alone.tokens,
            "greedy sequence {i}"
        );
    }
    // The longest sequence decoded alone at the end and drafted then; the others never drafted
    // while it was still running.
    let drafted: Vec<u64> = (0..greedy.len())
        .map(|i| outs[&SeqId(i as u64)].metrics.drafted)
        .collect();
    assert_eq!(drafted.iter().filter(|&&d| d > 0).count(), 1, "{drafted:?}");
}

#[test]
fn a_long_prompt_is_prefilled_in_chunks_while_others_keep_decoding() {
    let mut batch = Batch::new(target(), draft_model());
    batch.set_prefill_chunk(Some(4));
    let (p0, c0) = requests()[0].clone();
    batch.add(SeqId(0), p0, c0, None).unwrap();
    // Let sequence 0 start decoding, then add a 30-token prompt.
    batch.step(&mut |_, _| ControlFlow::Continue(()));
    let long: Vec<TokenId> = (0..30).map(|i| (i * 5 + 1) % VOCAB as u32).collect();
    let config = GenerateConfig {
        max_new_tokens: 6,
        sampling: SamplingParams::greedy(),
        draft_len: DraftLenPolicy::Fixed { draft_len: 2 },
        ..GenerateConfig::default()
    };
    batch
        .add(SeqId(1), long.clone(), config.clone(), None)
        .unwrap();
    let mut first_long_token_step = None;
    let mut zero_tokens_during_prefill = 0;
    let mut outs = HashMap::new();
    let mut step = 0;
    while !batch.is_empty() {
        let mut saw = (false, false);
        for f in batch.step(&mut |seq, _| {
            if seq == SeqId(0) {
                saw.0 = true;
            } else {
                saw.1 = true;
            }
            ControlFlow::Continue(())
        }) {
            outs.insert(f.seq, f.result.unwrap());
        }
        if saw.1 && first_long_token_step.is_none() {
            first_long_token_step = Some(step);
        }
        if first_long_token_step.is_none() && saw.0 {
            zero_tokens_during_prefill += 1;
        }
        step += 1;
    }
    // 30 tokens in chunks of 4: seven partial steps, then the last one gives the first token.
    assert_eq!(first_long_token_step, Some(7));
    assert!(zero_tokens_during_prefill >= 3, "sequence 0 kept decoding");
    let alone = generate(&mut target(), &mut NoDraft, &long, &config, &mut |_| {
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(outs[&SeqId(1)].tokens, alone.tokens);
}

/// Hooks that record, for every `propose` call, each request's sequence and model draft length,
/// and the number its generator gives each position it may draft.
#[derive(Default)]
struct Recording {
    calls: Vec<Vec<(u64, usize)>>,
    numbers: Vec<(usize, f64)>,
}

impl<D: Draft> Hooks<D> for Recording {
    fn propose(
        &mut self,
        inner: &mut D,
        batch: &[specdec_core::DraftRequest<'_>],
        out: &mut [specdec_core::Proposal],
    ) -> Result<(), D::Error> {
        self.calls
            .push(batch.iter().map(|r| (r.seq.0, r.model_len())).collect());
        for r in batch {
            let first = r.context.len();
            self.numbers.extend(
                (first..first + r.model_len()).map(|pos| (pos, r.rng.uniform(pos, Stream::Draft))),
            );
        }
        inner.propose(batch, out)
    }
}

/// [`Recording`]'s hooks on `inner`.
fn recording<D: Draft>(inner: D) -> Watched<D, Recording> {
    Watched::new(inner, Recording::default())
}

/// A position drafted again after a rejection is drawn with a new number: each drafting round has
/// its own draw of the generator, so what earlier rounds saw of a position's number (and decided
/// from it) cannot steer the draw that proposes it again.
#[test]
fn each_drafting_round_draws_new_numbers() {
    let mut batch = Batch::new(target(), recording(draft_model()));
    let config = GenerateConfig {
        max_new_tokens: 40,
        sampling: SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        },
        draft_len: DraftLenPolicy::Fixed { draft_len: 4 },
        seed: 11,
        ..GenerateConfig::default()
    };
    batch.add(SeqId(0), vec![1, 2, 3], config, None).unwrap();
    while !batch.is_empty() {
        for f in batch.step(&mut |_, _| ControlFlow::Continue(())) {
            f.result.unwrap();
        }
    }
    let mut by_position: HashMap<usize, Vec<f64>> = HashMap::new();
    for &(pos, u) in &batch.drafter().hooks.numbers {
        by_position.entry(pos).or_default().push(u);
    }
    let again: Vec<&Vec<f64>> = by_position.values().filter(|u| u.len() > 1).collect();
    assert!(!again.is_empty(), "some position was drafted in two rounds");
    for u in again {
        for (i, a) in u.iter().enumerate() {
            assert!(
                u[i + 1..].iter().all(|b| b != a),
                "a number drawn twice: {u:?}"
            );
        }
    }
}

/// A cost curve where four rows cost about one step and each further row one step.
fn knee() -> Vec<f64> {
    (1..=17)
        .map(|m| {
            if m <= 4 {
                1.0 + 0.02 * (m - 1) as f64
            } else {
                m as f64 - 2.94
            }
        })
        .collect()
}

/// A cost model given the curve `r`, a draft step of 0.05 target steps, and a prompt token read
/// into the draft model at `draft_read` draft steps.
fn cost_model(r: Vec<f64>, draft_read: Option<f64>) -> DraftLenPolicy {
    DraftLenPolicy::CostModel {
        max: 4,
        cost: Some(specdec_core::FixedCost {
            c: 0.05,
            draft_fixed: 0.0,
            r,
            context: None,
            step_secs: None,
            acceptance: Vec::new(),
            draft_read,
            draft_step_secs: None,
        }),
        probe_every: 1000,
        prior: None,
    }
}

/// Greedy requests `reqs` decoded together (sequence `i` for request `i`) with the mock draft model,
/// `each_step` called after every step; checks that each got the tokens it gets alone, and
/// returns the model draft lengths of every draft call, by sequence.
fn decode_recorded(
    reqs: &[(Vec<TokenId>, GenerateConfig)],
    mut each_step: impl FnMut(&Watched<ModelDrafter<MockModel>, Recording>),
) -> Vec<Vec<(u64, usize)>> {
    let mut batch = Batch::new(target(), recording(draft_model()));
    for (i, (p, c)) in reqs.iter().cloned().enumerate() {
        batch.add(SeqId(i as u64), p, c, None).unwrap();
    }
    let mut outs = HashMap::new();
    while !batch.is_empty() {
        let finished = batch.step(&mut |_, _| ControlFlow::Continue(()));
        each_step(batch.drafter());
        for f in finished {
            outs.insert(f.seq, f.result.unwrap());
            batch.release(f.seq);
        }
    }
    for (i, (p, c)) in reqs.iter().enumerate() {
        let alone = generate(&mut target(), &mut NoDraft, p, c, &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap();
        assert_eq!(outs[&SeqId(i as u64)].tokens, alone.tokens, "sequence {i}");
    }
    batch.drafter().hooks.calls.clone()
}

/// Two greedy sequences decoded together under cost models given `r`: the model draft lengths of
/// the draft calls that served both, and of those that served one.
fn batch_draft_lens(r: Vec<f64>) -> (Vec<usize>, Vec<usize>) {
    let policy = cost_model(r, None);
    let reqs: Vec<(Vec<TokenId>, GenerateConfig)> = (0..2u32)
        .map(|i| {
            let prompt: Vec<TokenId> = (0..4).map(|j| (i * 11 + j * 5) % VOCAB as u32).collect();
            let config = GenerateConfig {
                // The second sequence decodes alone once the first is done.
                max_new_tokens: 20 + 40 * i as usize,
                sampling: SamplingParams::greedy(),
                draft_len: policy.clone(),
                ..GenerateConfig::default()
            };
            (prompt, config)
        })
        .collect();
    let calls = decode_recorded(&reqs, |_| {});
    let lens = |n: usize| -> Vec<usize> {
        calls
            .iter()
            .filter(|c| c.len() == n)
            .flatten()
            .map(|&(_, k)| k)
            .collect()
    };
    (lens(2), lens(1))
}

#[test]
fn a_batch_caps_model_drafts_where_its_rows_stop_being_cheap() {
    // Four rows cost about one step, more cost one step each: two sequences together draft 1 token
    // each (4 rows in all), the one left alone drafts longer at times (its cost model's choice from
    // the mock draft's acceptance).
    let (together, alone) = batch_draft_lens(knee());
    assert!(
        !together.is_empty() && together.iter().all(|&k| k == 1),
        "{together:?}"
    );
    assert!(alone.iter().any(|&k| k >= 2), "{alone:?}");
    // Rows that stay cheap: two sequences draft as either would alone (the lengths their cost
    // models choose, longer than 1 at times).
    let flat: Vec<f64> = (1..=17).map(|m| 1.0 + 0.02 * (m - 1) as f64).collect();
    let (together, _) = batch_draft_lens(flat);
    assert!(together.iter().any(|&k| k >= 2), "{together:?}");
}

#[test]
fn a_batch_trims_lookup_drafts_to_the_rows_that_pay() {
    // A target that repeats a cycle of five tokens, prompts that hold it three times: the lookup's
    // drafts are all accepted. Under a curve where four rows cost about one step and each further
    // row a step, a sequence alone drafts three tokens; two decoding together share two cheap rows.
    let cycle: [TokenId; 5] = [3, 8, 13, 21, 34];
    let script: Vec<Vec<f32>> = cycle
        .iter()
        .map(|&t| {
            (0..VOCAB)
                .map(|j| if j == t as usize { 8.0 } else { 0.0 })
                .collect()
        })
        .collect();
    let target = || MockModel::new(MockLogits::Scripted(script.clone()));
    let prompt: Vec<TokenId> = (0..15).map(|i| cycle[i % 5]).collect();
    let config = |max_new_tokens| GenerateConfig {
        max_new_tokens,
        sampling: SamplingParams::greedy(),
        draft_len: cost_model(knee(), None),
        ..GenerateConfig::default()
    };
    let mut batch = Batch::new(Recorded::new(target(), None), LookupDrafter::default());
    for (i, n) in [(0, 24), (1, 60)] {
        batch
            .add(
                SeqId(i),
                prompt[..15 - i as usize].to_vec(),
                config(n),
                None,
            )
            .unwrap();
    }
    let mut outs = HashMap::new();
    while !batch.is_empty() {
        for f in batch.step(&mut |_, _| ControlFlow::Continue(())) {
            outs.insert(f.seq, f.result.unwrap().tokens);
            batch.release(f.seq);
        }
    }
    let calls = &batch.target().drafted;
    let drafted = |n: usize| -> Vec<usize> {
        calls
            .iter()
            .filter(|c| c.len() == n)
            .map(|c| c.iter().sum())
            .collect()
    };
    let (together, alone) = (drafted(2), drafted(1));
    assert!(
        together.len() > 3 && together.iter().all(|&k| k <= 2),
        "{together:?}"
    );
    assert!(together.contains(&2), "{together:?}");
    assert!(alone.contains(&3), "{alone:?}");
    for (i, n) in [(0, 24), (1, 60)] {
        let p = &prompt[..15 - i as usize];
        let plain = generate(&mut target(), &mut NoDraft, p, &config(n), &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap();
        assert_eq!(outs[&SeqId(i)], plain.tokens, "sequence {i}");
    }
}

#[test]
fn a_sequence_whose_prompt_the_model_left_unread_does_not_cap_the_others_model_drafts() {
    // Four rows cost about one step, more one step each (as in the test above), and reading a
    // prompt token costs the draft model half a target step. Sequence 0's 200-token prompt cannot
    // be repaid within its 40 tokens, so the model leaves it unread and it decodes plainly: one
    // row. Sequence 1 (a 4-token prompt, read) may then draft 2 tokens beside it and stay within
    // four rows, where two sequences that both drafted would be held to 1 each.
    let policy = cost_model(knee(), Some(10.0));
    let config = |max_new_tokens| GenerateConfig {
        max_new_tokens,
        sampling: SamplingParams::greedy(),
        draft_len: policy.clone(),
        ..GenerateConfig::default()
    };
    let reqs: Vec<(Vec<TokenId>, GenerateConfig)> = vec![
        (
            (0..200).map(|j| (j * 7 % VOCAB) as TokenId).collect(),
            config(40),
        ),
        (
            (0..4).map(|j| (11 + j * 5) as TokenId).collect(),
            config(60),
        ),
    ];
    let mut unread = false;
    let calls = decode_recorded(&reqs, |d| {
        unread |= !d.model_drafts(SeqId(0)) && d.model_drafts(SeqId(1));
    });
    assert!(unread, "sequence 0's prompt was read");
    // The model drafts of sequence 1 while both decoded.
    let together: Vec<usize> = calls
        .iter()
        .filter(|c| c.iter().any(|&(s, _)| s == 0))
        .flat_map(|c| c.iter().filter(|&&(s, _)| s == 1).map(|&(_, k)| k))
        .collect();
    assert!(!together.is_empty(), "the two never drafted together");
    assert!(together.iter().any(|&k| k >= 2), "{together:?}");
}

/// What a drafter was asked, and when: `Prefill(context length)`, `Commit(context length)`,
/// `Propose`, and `Token` for each token the batch emitted, in order.
#[derive(Clone, Debug, PartialEq)]
enum Event {
    Prefill(usize),
    Commit(usize),
    Propose,
    Token,
}

/// Records the calls to the inner drafter, and fails its prefill when `fail_prefill` is set.
struct Logged<D> {
    inner: D,
    events: std::rc::Rc<std::cell::RefCell<Vec<Event>>>,
    fail_prefill: bool,
}

#[derive(Debug, thiserror::Error)]
#[error("the drafter's prefill failed")]
struct PrefillFailed;

impl<D: Draft> Draft for Logged<D> {
    type Error = PrefillFailed;

    fn vocab_size(&self) -> Option<usize> {
        self.inner.vocab_size()
    }

    fn propose(
        &mut self,
        batch: &[specdec_core::DraftRequest<'_>],
        out: &mut [specdec_core::Proposal],
    ) -> Result<(), Self::Error> {
        self.events.borrow_mut().push(Event::Propose);
        self.inner.propose(batch, out).map_err(|_| PrefillFailed)
    }

    fn commit(&mut self, seq: SeqId, committed: &[TokenId]) -> Result<(), Self::Error> {
        self.events
            .borrow_mut()
            .push(Event::Commit(committed.len()));
        self.inner.commit(seq, committed).map_err(|_| PrefillFailed)
    }

    fn prefill(&mut self, seq: SeqId, context: &[TokenId]) -> Result<(), Self::Error> {
        self.events.borrow_mut().push(Event::Prefill(context.len()));
        if self.fail_prefill {
            return Err(PrefillFailed);
        }
        self.inner.prefill(seq, context).map_err(|_| PrefillFailed)
    }

    fn model_drafts(&self, seq: SeqId) -> bool {
        self.inner.model_drafts(seq)
    }
}

/// The first token comes from the target's prefill alone: the drafter reads the prompt after it is
/// out (and is then told of it by a commit), so the time to the first token does not include the
/// draft model's prefill; the output is the same as plain decoding's, and the metrics keep the
/// drafter's reading as prompt processing. A drafter whose prefill fails ends the sequence with
/// the first token kept.
#[test]
fn the_first_token_comes_before_the_drafter_reads_the_prompt() {
    let prompt: Vec<TokenId> = vec![3, 1, 4, 1, 5];
    let config = GenerateConfig {
        max_new_tokens: 12,
        sampling: SamplingParams::greedy(),
        draft_len: DraftLenPolicy::Fixed { draft_len: 3 },
        ..GenerateConfig::default()
    };
    let events = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
    let mut drafter = Logged {
        inner: draft_model(),
        events: events.clone(),
        fail_prefill: false,
    };
    let out = generate(&mut target(), &mut drafter, &prompt, &config, &mut |_| {
        events.borrow_mut().push(Event::Token);
        ControlFlow::Continue(())
    })
    .unwrap();
    let plain = generate(&mut target(), &mut NoDraft, &prompt, &config, &mut |_| {
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(out.tokens, plain.tokens);
    let events = events.borrow();
    assert_eq!(
        events[..4],
        [
            Event::Token,
            Event::Prefill(prompt.len()),
            Event::Commit(prompt.len() + 1),
            Event::Propose
        ],
        "{events:?}"
    );
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e, Event::Prefill(_)))
            .count(),
        1
    );
    let m = &out.metrics;
    assert!(
        m.first_token_secs > 0.0 && m.first_token_secs <= m.prefill_secs,
        "{m:?}"
    );

    // The drafter fails to read the prompt: the first token stays.
    let mut failing = Logged {
        inner: draft_model(),
        events: std::rc::Rc::new(std::cell::RefCell::new(Vec::new())),
        fail_prefill: true,
    };
    let e = generate(&mut target(), &mut failing, &prompt, &config, &mut |_| {
        ControlFlow::Continue(())
    })
    .unwrap_err();
    assert_eq!(e.output.tokens, plain.tokens[..1]);
    assert!(e.to_string().contains("prefill failed"), "{e}");
}

/// A mock target that records the sequences of every scoring call and their draft lengths, and
/// may say that it copies a running sequence's prefix from some shared tokens (the mock copies
/// none, so a sequence computes what it waited for; only the schedule is tested).
struct Recorded {
    inner: MockModel,
    copies_from: Option<usize>,
    scored: Vec<Vec<SeqId>>,
    drafted: Vec<Vec<usize>>,
}

impl Recorded {
    fn new(inner: MockModel, copies_from: Option<usize>) -> Self {
        Self {
            inner,
            copies_from,
            scored: Vec::new(),
            drafted: Vec::new(),
        }
    }
}

impl specdec_core::Target for Recorded {
    type Error = specdec_core::mock::MockError;

    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    fn capacity(&self) -> usize {
        self.inner.capacity()
    }

    fn score(
        &mut self,
        batch: &[specdec_core::Score<'_>],
        out: &mut [specdec_core::Logits],
    ) -> Result<(), Self::Error> {
        self.scored.push(batch.iter().map(|s| s.seq).collect());
        self.drafted
            .push(batch.iter().map(|s| s.draft.len()).collect());
        self.inner.score(batch, out)
    }

    fn commit(&mut self, seq: SeqId, committed: &[TokenId]) -> Result<(), Self::Error> {
        self.inner.commit(seq, committed)
    }

    fn release(&mut self, seq: SeqId) {
        self.inner.release(seq)
    }

    fn cached(&self, seq: SeqId, context: &[TokenId]) -> usize {
        self.inner.cached(seq, context)
    }

    fn min_prefix_copy(&self) -> Option<usize> {
        self.copies_from
    }
}

/// Sequences 0 and 1 over a 12-token shared prefix (then 3 tokens of their own), added together
/// to a batch prefilling chunks of 4 on a target that copies prefixes.
fn waiting_batch() -> (Batch<Recorded, NoDraft>, [Vec<TokenId>; 2], GenerateConfig) {
    use specdec_core::Target as _;
    let target = Recorded::new(target(), Some(4));
    assert_eq!(target.min_prefix_copy(), Some(4));
    let mut batch = Batch::new(target, NoDraft);
    batch.set_prefill_chunk(Some(4));
    let shared: Vec<TokenId> = (0..12).map(|i| (i * 7 + 3) % VOCAB as u32).collect();
    let prompts = [0u32, 1].map(|t| [shared.clone(), vec![t + 1, t + 2, t + 3]].concat());
    let config = GenerateConfig {
        max_new_tokens: 4,
        sampling: SamplingParams::greedy(),
        ..GenerateConfig::default()
    };
    for (i, p) in prompts.iter().enumerate() {
        batch
            .add(SeqId(i as u64), p.clone(), config.clone(), None)
            .unwrap();
    }
    (batch, prompts, config)
}

#[test]
fn a_new_sequence_waits_unscored_while_an_earlier_one_computes_their_shared_prefix() {
    let (mut batch, prompts, config) = waiting_batch();
    let mut outs = HashMap::new();
    while !batch.is_empty() {
        for f in batch.step(&mut |_, _| ControlFlow::Continue(())) {
            outs.insert(f.seq, f.result.unwrap().tokens);
        }
    }
    // Sequence 0 computes the 12 shared tokens in 3 chunks alone; sequence 1 is scored from then.
    let scored = &batch.target().scored;
    assert!(scored[..3].iter().all(|s| s == &[SeqId(0)]), "{scored:?}");
    assert!(scored[3].contains(&SeqId(1)), "{scored:?}");
    for (i, p) in prompts.iter().enumerate() {
        let alone = generate(&mut target(), &mut NoDraft, p, &config, &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap();
        assert_eq!(outs[&SeqId(i as u64)], alone.tokens, "sequence {i}");
    }
}

#[test]
fn a_wait_ends_when_the_earlier_sequence_leaves_or_chunks_stop() {
    // The sequence waited for is cancelled: the other is scored in the next step.
    let (mut batch, _, _) = waiting_batch();
    batch.step(&mut |_, _| ControlFlow::Continue(()));
    assert_eq!(batch.target().scored, [vec![SeqId(0)]]);
    batch.cancel(SeqId(0)).unwrap();
    batch.step(&mut |_, _| ControlFlow::Continue(()));
    assert_eq!(batch.target().scored[1], [SeqId(1)]);
    // Chunked prefill turned off while a sequence waits: it is scored in the next step.
    let (mut batch, _, _) = waiting_batch();
    batch.step(&mut |_, _| ControlFlow::Continue(()));
    batch.set_prefill_chunk(None);
    batch.step(&mut |_, _| ControlFlow::Continue(()));
    assert!(
        batch.target().scored[1].contains(&SeqId(1)),
        "{:?}",
        batch.target().scored
    );
}

/// The cost model calibrates the draft model's confidence from the target's verdicts
/// (`ConfidenceCalibration`) and hands it to the drafter, whose drafts end after a token drafted at
/// a confidence the target has kept rejecting. The target always says 5; the draft says 5 at
/// 0.999, except at about one position in six (an irregular pattern, so that rounds start at
/// every phase), where it says 6 at 0.97. Uncalibrated, 0.97 reads as a sure token and the draft
/// goes on past it, every token after it wasted.
#[test]
fn a_draft_ends_at_a_token_whose_confidence_the_target_has_kept_rejecting() {
    let target = MockModel::new(MockLogits::Fixed(
        (0..8).map(|t| if t == 5 { 10.0 } else { 0.0 }).collect(),
    ));
    let with_top = |top: usize, p: f32| -> Vec<f32> {
        let rest = ((1.0 - p) / 7.0).ln();
        (0..8)
            .map(|t| if t == top { p.ln() } else { rest })
            .collect()
    };
    let script: Vec<Vec<f32>> = (0..97)
        .map(|i| {
            if i * 37 % 97 < 16 {
                with_top(6, 0.97)
            } else {
                with_top(5, 0.999)
            }
        })
        .collect();
    let mut drafter = ModelDrafter::new(MockModel::new(MockLogits::Scripted(script)));
    let flat: Vec<f64> = (1..=17).map(|m| 1.0 + 0.02 * (m - 1) as f64).collect();
    let config = GenerateConfig {
        max_new_tokens: 600,
        sampling: SamplingParams::greedy(),
        draft_len: cost_model(flat, None),
        ..GenerateConfig::default()
    };
    let out = generate(
        &mut target.clone(),
        &mut drafter,
        &[1, 2, 3],
        &config,
        &mut |_| ControlFlow::Continue(()),
    )
    .unwrap();
    let m = &out.metrics;
    let rejected: u64 = m.per_position.iter().map(|s| s.reached - s.accepted).sum();
    let wasted = m.drafted - m.accepted;
    assert!(rejected > 50, "{m:?}");
    // Each rejection wastes the rejected token, and a few more while the calibration learns;
    // drafting on past it, as the uncalibrated draft does, wastes about twice as many (110 for 55
    // when written, against 68 calibrated).
    assert!(
        wasted * 2 <= rejected * 3,
        "{wasted} wasted for {rejected} rejected"
    );
}

/// A generation under a cost model reports the draft cost it measured in its own drafting rounds
/// ([`specdec_core::Metrics::draft_cost`], what a later generation of the process may start from):
/// a line of seconds behind no more rounds than drafted with the model; under a fixed draft
/// length, none.
#[test]
fn a_cost_model_generation_reports_the_draft_cost_it_measured() {
    let prompt: Vec<TokenId> = vec![3, 1, 4, 1, 5];
    let config = |draft_len| GenerateConfig {
        max_new_tokens: 60,
        sampling: SamplingParams::greedy(),
        draft_len,
        ..GenerateConfig::default()
    };
    let auto = config(DraftLenPolicy::CostModel {
        max: 4,
        cost: None,
        probe_every: 5,
        prior: Some(specdec_core::FixedCost {
            c: 0.1,
            draft_fixed: 0.0,
            r: vec![1.0, 1.05, 1.1],
            context: None,
            step_secs: None,
            acceptance: Vec::new(),
            draft_read: None,
            draft_step_secs: None,
        }),
    });
    let out = generate(
        &mut target(),
        &mut draft_model(),
        &prompt,
        &auto,
        &mut |_| ControlFlow::Continue(()),
    )
    .unwrap();
    let m = &out.metrics;
    let model_rounds: u64 = m.rounds_by_draft_len.iter().skip(1).sum();
    let d = m.draft_cost.expect("the cost model timed drafting rounds");
    assert!(
        d.rounds >= 1 && d.rounds < model_rounds,
        "{d:?}, {model_rounds} model rounds"
    );
    assert!(
        d.per_token_secs.is_finite() && d.per_token_secs >= 0.0,
        "{d:?}"
    );
    assert!(d.fixed_secs.is_finite() && d.fixed_secs >= 0.0, "{d:?}");
    assert!(d.fixed_secs + d.per_token_secs > 0.0, "{d:?}");
    // Seconds: a round's cost is within the generation's drafting time.
    assert!(
        d.fixed_secs + d.per_token_secs <= m.draft_secs,
        "{d:?}, {m:?}"
    );
    let fixed = config(DraftLenPolicy::Fixed { draft_len: 3 });
    let out = generate(
        &mut target(),
        &mut draft_model(),
        &prompt,
        &fixed,
        &mut |_| ControlFlow::Continue(()),
    )
    .unwrap();
    assert!(out.metrics.draft_cost.is_none());
}
