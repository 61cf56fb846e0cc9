//! Sampled speculative output follows the target distribution.
//!
//! Each test draws many generations with fixed seeds and applies Pearson's chi-square test to the
//! observed counts against the distribution computed analytically from the mock target. Threshold:
//! p-value >= 1e-6, i.e. a correct implementation fails with probability 1e-6 per test (and, the seeds
//! being fixed, the outcome is deterministic). `a_broken_verifier_is_caught` proves the same test
//! rejects a verifier that skips the residual.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use std::ops::ControlFlow;

use common::{chi_square, target_probs, Hooks, Watched};
use specdec_core::mock::{MockLogits, MockModel};
use specdec_core::verify::{verify_onehot, verify_rejection, Verdict};
use specdec_core::{
    generate, Batch, CounterRng, Draft, DraftLenPolicy, Emitted, FixedCost, GenerateConfig,
    HybridDrafter, LookupDrafter, ModelDrafter, NGramDrafter, Probs, SamplingParams, SeqId, Stream,
    TokenId, VerifyMode, READ_PROBE_AFTER,
};

/// The false-failure rate of every test here.
const ALPHA: f64 = 1e-6;
const VOCAB: usize = 5;
const PROMPT: [TokenId; 3] = [1, 2, 3];

fn target_logits() -> MockLogits {
    MockLogits::Hashed {
        vocab: VOCAB,
        seed: 3,
        scale: 1.5,
    }
}

fn draft_logits() -> MockLogits {
    MockLogits::Perturbed {
        base: Box::new(target_logits()),
        seed: 4,
        noise: 1.5,
    }
}

fn configs() -> Vec<(&'static str, SamplingParams, usize)> {
    let d = SamplingParams::default();
    vec![
        ("t1", d.clone(), 4),
        (
            "t0.7_topk3",
            SamplingParams {
                temperature: 0.7,
                top_k: 3,
                ..d.clone()
            },
            3,
        ),
        (
            "t1.3_topp0.8",
            SamplingParams {
                temperature: 1.3,
                top_p: 0.8,
                ..d.clone()
            },
            6,
        ),
        (
            "minp0.2_penalties",
            SamplingParams {
                min_p: 0.2,
                repetition_penalty: 1.3,
                presence_penalty: 0.2,
                ..d
            },
            2,
        ),
    ]
}

/// Exact joint distribution of the first three generated tokens: the first comes from prefill, the
/// second and third from the first speculative round(s).
fn exact_joint(params: &SamplingParams) -> Vec<f64> {
    exact_joint_of(&target_logits(), params)
}

fn exact_joint_of(logits: &MockLogits, params: &SamplingParams) -> Vec<f64> {
    let mut out = vec![0.0; VOCAB.pow(3)];
    let p1 = target_probs(logits, params, &PROMPT);
    for a in 0..VOCAB {
        let ctx_a: Vec<TokenId> = PROMPT.iter().copied().chain([a as TokenId]).collect();
        let p2 = target_probs(logits, params, &ctx_a);
        for b in 0..VOCAB {
            let ctx_ab: Vec<TokenId> = ctx_a.iter().copied().chain([b as TokenId]).collect();
            let p3 = target_probs(logits, params, &ctx_ab);
            for c in 0..VOCAB {
                out[(a * VOCAB + b) * VOCAB + c] = p1[a] * p2[b] * p3[c];
            }
        }
    }
    out
}

fn sample_joint(mode: VerifyMode, params: &SamplingParams, k: usize, n: u64) -> Vec<u64> {
    let mut drafter = ModelDrafter::new(MockModel::new(draft_logits()));
    let config = GenerateConfig {
        sampling: params.clone(),
        verify_mode: mode,
        draft_len: DraftLenPolicy::Fixed { draft_len: k },
        ..GenerateConfig::default()
    };
    sample_joint_with(&target_logits(), &mut drafter, &config, n)
}

/// Counts of the first three generated tokens over `n` seeds, with `drafter` and `base` (its seed
/// replaced by each run's).
fn sample_joint_with<D: Draft>(
    target_logits: &MockLogits,
    drafter: &mut D,
    base: &GenerateConfig,
    n: u64,
) -> Vec<u64> {
    sample_joint_counted(target_logits, drafter, base, n).0
}

/// [`sample_joint_with`], plus the tokens drafted and the rounds run over all `n` generations.
fn sample_joint_counted<D: Draft>(
    target_logits: &MockLogits,
    drafter: &mut D,
    base: &GenerateConfig,
    n: u64,
) -> (Vec<u64>, u64, u64) {
    let (counts, drafted, rounds, _, _) = sample_joint_extended(target_logits, drafter, base, n);
    (counts, drafted, rounds)
}

/// [`sample_joint_counted`], plus the rounds whose lookup draft a model extended and the rounds
/// whose model draft the lookup continued.
fn sample_joint_extended<D: Draft>(
    target_logits: &MockLogits,
    drafter: &mut D,
    base: &GenerateConfig,
    n: u64,
) -> (Vec<u64>, u64, u64, u64, u64) {
    let (mut drafted, mut rounds, mut extended, mut continued) = (0, 0, 0, 0);
    let mut counts = vec![0u64; VOCAB.pow(3)];
    let mut target = MockModel::new(target_logits.clone());
    for seed in 0..n {
        let config = GenerateConfig {
            max_new_tokens: 16,
            seed,
            ..base.clone()
        };
        let mut got = Vec::with_capacity(3);
        let out = generate(&mut target, drafter, &PROMPT, &config, &mut |t| {
            got.push(t);
            if got.len() == 3 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
        .unwrap();
        assert_eq!(out.tokens, got);
        drafted += out.metrics.drafted;
        rounds += out.metrics.rounds;
        extended += out.metrics.extended_rounds;
        continued += out.metrics.continued_rounds;
        let [a, b, c] = got[..] else {
            panic!("expected 3 tokens, got {got:?}")
        };
        counts[(a as usize * VOCAB + b as usize) * VOCAB + c as usize] += 1;
    }
    (counts, drafted, rounds, extended, continued)
}

#[test]
fn speculative_joint_distribution_matches_the_target() {
    for mode in [VerifyMode::Rejection, VerifyMode::OneHot] {
        for (name, params, k) in configs() {
            let expected = exact_joint(&params);
            let observed = sample_joint(mode, &params, k, 30_000);
            let (stat, df, p) = chi_square(&observed, &expected);
            eprintln!("{mode:?} {name}: chi2 {stat:.1} on {df} df, p = {p:.3}");
            assert!(
                p >= ALPHA,
                "{mode:?} {name}: chi2 {stat:.1} on {df} df, p = {p:.3e}"
            );
            // Marginal of the second token, the first drawn by a speculative round.
            let mut obs2 = vec![0u64; VOCAB];
            let mut exp2 = vec![0.0; VOCAB];
            for (i, (&o, &e)) in observed.iter().zip(&expected).enumerate() {
                obs2[(i / VOCAB) % VOCAB] += o;
                exp2[(i / VOCAB) % VOCAB] += e;
            }
            let (stat, df, p) = chi_square(&obs2, &exp2);
            assert!(
                p >= ALPHA,
                "{mode:?} {name} (2nd token): chi2 {stat:.1} on {df} df, p = {p:.3e}"
            );
        }
    }
}

/// Rejection mode must be exact for every drafter option the binary offers: the draft model (with and
/// without the early stop on low confidence), prompt lookup, and the hybrid of both. One-hot mode is
/// lossless for any draft, so only rejection mode can catch a drafter whose tokens do not follow the
/// `q` it reports.
#[test]
fn rejection_mode_is_exact_for_every_drafter_option() {
    let sampled = SamplingParams {
        temperature: 0.9,
        ..SamplingParams::default()
    };
    for (name, params, k) in [
        ("t0.9", sampled.clone(), 4),
        ("t1_topk3", configs()[1].1.clone(), 3),
    ] {
        let expected = exact_joint(&params);
        let config = |min_confidence| GenerateConfig {
            sampling: params.clone(),
            verify_mode: VerifyMode::Rejection,
            draft_len: DraftLenPolicy::Fixed { draft_len: k },
            min_confidence,
            ..GenerateConfig::default()
        };
        // A cost model that starts calibrated, so that it prices rounds from the first one: flat
        // enough verification that lookup drafts long and the model draft sometimes wins.
        let priced = |min_confidence| GenerateConfig {
            draft_len: DraftLenPolicy::CostModel {
                max: k,
                cost: None,
                probe_every: 8,
                prior: Some(FixedCost {
                    c: 0.2,
                    draft_fixed: 0.1,
                    r: vec![1.0, 1.05, 1.1, 1.15, 1.2],
                    context: None,
                    step_secs: None,
                    acceptance: Vec::new(),
                    draft_read: None,
                    draft_step_secs: None,
                }),
            },
            ..config(min_confidence)
        };
        // The same, but reading a prompt token costs the draft model as much as 1,000 of its
        // steps: the hybrid's model leaves every prompt unread, and the lookup drafts alone.
        let unread_priced = || {
            let mut config = priced(0.0);
            if let DraftLenPolicy::CostModel {
                prior: Some(prior), ..
            } = &mut config.draft_len
            {
                prior.draft_read = Some(1_000.0);
            }
            config
        };
        // The counts, once it is clear the drafter really drafted.
        let drafting = |what: &str, (counts, drafted, rounds): (Vec<u64>, u64, u64)| {
            eprintln!("{what}, {name}: {drafted} drafted in {rounds} rounds");
            assert!(
                drafted > rounds / 10,
                "{what}: {drafted} drafted in {rounds} rounds"
            );
            counts
        };
        let n = 30_000;
        let cases: Vec<(&str, Vec<u64>)> = vec![
            ("model, min_confidence 0.45", {
                let (counts, drafted, rounds) = sample_joint_counted(
                    &target_logits(),
                    &mut ModelDrafter::new(MockModel::new(draft_logits())),
                    &config(0.45),
                    n,
                );
                // The early stop really happens: rounds draft fewer than k tokens, yet some draft.
                assert!(
                    drafted > 0 && drafted < rounds * k as u64,
                    "{name}: {drafted} drafted in {rounds} rounds of k = {k}"
                );
                counts
            }),
            ("model, draft ended after token 2", {
                // Token 2 ends every draft it is drawn in, as a token that ends generation does
                // (here generation goes on past it): the draft's length then depends on its own
                // draws, each stop decided from the tokens before it.
                let (counts, drafted, rounds) = sample_joint_counted(
                    &target_logits(),
                    &mut Watched::new(
                        ModelDrafter::new(MockModel::new(draft_logits())),
                        StopsDraftingAfter2,
                    ),
                    &config(0.0),
                    n,
                );
                assert!(
                    drafted > rounds && drafted < rounds * k as u64,
                    "{name}: {drafted} drafted in {rounds} rounds of k = {k}"
                );
                counts
            }),
            ("model, cost model, drafts cut by its confidence", {
                // The cost model's length, each draft ending early where the draft's confidence
                // no longer pays for another token (`RoundCosts::drafts_on`), a stop decided from
                // the q of the tokens drafted before.
                let mut drafter = Watched::new(
                    ModelDrafter::new(MockModel::new(draft_logits())),
                    CountsCutDrafts::default(),
                );
                let (counts, drafted, rounds) =
                    sample_joint_counted(&target_logits(), &mut drafter, &priced(0.0), n);
                eprintln!(
                    "model, cost model, {name}: {drafted} drafted in {rounds} rounds, {} cut by \
                     confidence",
                    drafter.hooks.cut
                );
                assert!(
                    drafter.hooks.cut > rounds / 10 && drafted > rounds / 10,
                    "{name}: {} of {rounds} rounds cut, {drafted} drafted",
                    drafter.hooks.cut
                );
                counts
            }),
            (
                "ngram",
                sample_joint_with(
                    &target_logits(),
                    &mut NGramDrafter { min_n: 1, max_n: 2 },
                    &config(0.0),
                    n,
                ),
            ),
            (
                "hybrid, min_confidence 0.45",
                sample_joint_with(
                    &target_logits(),
                    &mut HybridDrafter::new(
                        LookupDrafter::default(),
                        ModelDrafter::new(MockModel::new(draft_logits())),
                    ),
                    &config(0.45),
                    n,
                ),
            ),
            (
                // Lookup over the context and the outputs of the earlier generations (the history
                // is shared across all n), its length cut by the cost model each round.
                "lookup with history, cost model",
                drafting(
                    "lookup",
                    sample_joint_counted(
                        &target_logits(),
                        &mut LookupDrafter::default(),
                        &priced(0.0),
                        n,
                    ),
                ),
            ),
            (
                // The lookup ending its drafts after token 2 (stop 37), each sequence's estimates
                // lowered by its own record.
                "lookup stopping after token 2, cost model",
                sample_joint_counted(
                    &target_logits(),
                    &mut Watched::new(LookupDrafter::default(), StopsDraftingAfter2),
                    &priced(0.0),
                    n,
                )
                .0,
            ),
            (
                // The hybrid's lookup, model drafts and continuations all ending after token 2.
                "hybrid stopping after token 2, cost model",
                sample_joint_counted(
                    &target_logits(),
                    &mut Watched::new(
                        HybridDrafter::new(
                            LookupDrafter::default(),
                            ModelDrafter::new(MockModel::new(draft_logits())),
                        ),
                        StopsDraftingAfter2,
                    ),
                    &priced(0.0),
                    n,
                )
                .0,
            ),
            (
                // The per-round choice between the lookup and the model draft, and the lookup's
                // continuation of model drafts (one-hot tokens after the model's, which carry q).
                "hybrid, cost model",
                {
                    let (counts, drafted, rounds, _, continued) = sample_joint_extended(
                        &target_logits(),
                        &mut HybridDrafter::new(
                            LookupDrafter::default(),
                            ModelDrafter::new(MockModel::new(draft_logits())),
                        ),
                        &priced(0.0),
                        n,
                    );
                    eprintln!(
                        "hybrid, {name}: {drafted} drafted in {rounds} rounds, {continued} \
                         continued by the lookup"
                    );
                    // Since the model's drafts end where its confidence no longer pays (stop 68),
                    // fewer are long enough for a continuation to beat: 6% of rounds at t0.9.
                    assert!(
                        drafted > rounds / 10 && continued > rounds / 25,
                        "{name}: {drafted} drafted, {continued} continued in {rounds} rounds"
                    );
                    counts
                },
            ),
            (
                // The hybrid whose model left the prompt unread: the lookup's drafts alone, cut
                // by the cost model (the same path a long prompt with a short answer takes).
                "hybrid, prompt left unread, cost model",
                {
                    let mut hybrid = Watched::new(
                        HybridDrafter::new(
                            LookupDrafter::default(),
                            ModelDrafter::new(MockModel::new(draft_logits())),
                        ),
                        CountsReads::default(),
                    );
                    let (counts, drafted, rounds) =
                        sample_joint_counted(&target_logits(), &mut hybrid, &unread_priced(), n);
                    eprintln!(
                        "unread hybrid, {name}: {drafted} drafted in {rounds} rounds, {} of {n} \
                         prompts read that the model did not hold",
                        hybrid.hooks.read
                    );
                    // Only the probes that measure again, one prompt in five (since stop 69).
                    assert_eq!(
                        hybrid.hooks.read,
                        n / (READ_PROBE_AFTER as u64 + 1),
                        "{name}: the model read prompts it could not repay"
                    );
                    assert!(
                        drafted > rounds / 10,
                        "{name}: {drafted} drafted in {rounds} rounds"
                    );
                    counts
                },
            ),
            (
                // Every lookup draft extended by the model (a model draft where the lookup finds
                // nothing): the lookup's tokens are one-hot, the model's carry its q.
                "hybrid, lookup extended by the model",
                {
                    let (counts, drafted, rounds, extended, _) = sample_joint_extended(
                        &target_logits(),
                        &mut common::ExtendingHybrid::new(ModelDrafter::new(MockModel::new(
                            draft_logits(),
                        ))),
                        &config(0.0),
                        n,
                    );
                    eprintln!(
                        "extending hybrid, {name}: {drafted} drafted in {rounds} rounds, \
                         {extended} extended"
                    );
                    assert!(
                        extended > rounds / 10,
                        "{name}: {extended} of {rounds} rounds extended"
                    );
                    counts
                },
            ),
        ];
        for (drafter, observed) in cases {
            let (stat, df, p) = chi_square(&observed, &expected);
            eprintln!("rejection, {drafter}, {name}: chi2 {stat:.1} on {df} df, p = {p:.3}");
            assert!(
                p >= ALPHA,
                "rejection, {drafter}, {name}: chi2 {stat:.1} on {df} df, p = {p:.3e}"
            );
        }
    }
}

/// Two sampled sequences decoded together in a [`Batch`] whose step cuts their drafts, given costs
/// under which the first few rows cost about one step and each further row a step: model drafts
/// capped before they are made (`best_batch_draft_cap`, four cheap rows), lookup drafts trimmed
/// after (`best_batch_trim`, three cheap rows: of two one-token drafts, the likelier is kept).
/// Each sequence's draft length then depends on the other's history as well, still decided before
/// the target scores the draft, so each sequence's first three tokens follow the target. Also
/// checks that the cut binds: the batch drafts fewer tokens per round than the same sequence alone.
#[test]
fn a_batch_draft_cap_keeps_sampled_output_on_the_target_distribution() {
    let params = SamplingParams {
        temperature: 0.9,
        ..SamplingParams::default()
    };
    let config = |cheap: usize| {
        let knee: Vec<f64> = (1..=8)
            .map(|m| {
                if m <= cheap {
                    1.0 + 0.02 * (m - 1) as f64
                } else {
                    (m - cheap) as f64 + 1.0 + 0.02 * (cheap - 1) as f64
                }
            })
            .collect();
        GenerateConfig {
            sampling: params.clone(),
            verify_mode: VerifyMode::Rejection,
            draft_len: DraftLenPolicy::CostModel {
                max: 3,
                cost: Some(FixedCost {
                    c: 0.05,
                    draft_fixed: 0.0,
                    r: knee,
                    context: None,
                    step_secs: None,
                    acceptance: Vec::new(),
                    draft_read: None,
                    draft_step_secs: None,
                }),
                probe_every: 1000,
                prior: None,
            },
            max_new_tokens: 16,
            ..GenerateConfig::default()
        }
    };
    let model = || ModelDrafter::new(MockModel::new(draft_logits()));
    check_batch_cut("model", model, &config(4), &params, 20_000, 0.5);
    check_batch_cut(
        "lookup",
        LookupDrafter::default,
        &config(3),
        &params,
        20_000,
        0.1,
    );
}

/// [`a_batch_draft_cap_keeps_sampled_output_on_the_target_distribution`] for the drafters `make`
/// makes (a new one per batch): the chi-square test of sequence 0's first three tokens over `n`
/// batches of two, and fewer tokens drafted per round in those batches than in batches of sequence
/// 0 alone by at least `margin`.
fn check_batch_cut<D: Draft>(
    name: &str,
    make: impl Fn() -> D,
    config: &GenerateConfig,
    params: &SamplingParams,
    n: u64,
    margin: f64,
) {
    let mut counts = vec![0u64; VOCAB.pow(3)];
    let [mut together, mut alone] = [(0, 0); 2];
    for seed in 0..n {
        let mut got = batch_of(make(), config, &[seed, seed + n], &mut together);
        let [a, b, c] = got.swap_remove(0)[..] else {
            panic!("expected 3 tokens")
        };
        counts[(a as usize * VOCAB + b as usize) * VOCAB + c as usize] += 1;
        if seed < 2_000 {
            batch_of(make(), config, &[seed], &mut alone);
        }
    }
    let rate = |(drafted, rounds): (u64, u64)| drafted as f64 / rounds as f64;
    let (together, alone) = (rate(together), rate(alone));
    eprintln!("batch cut, {name}: {together:.2} drafted per round together, {alone:.2} alone");
    assert!(
        together > 0.2 && together < alone - margin,
        "{name}: {together:.2} drafted per round together, {alone:.2} alone"
    );
    let (stat, df, p) = chi_square(&counts, &exact_joint(params));
    eprintln!("batch cut, {name}: chi2 {stat:.1} on {df} df, p = {p:.3}");
    assert!(
        p >= ALPHA,
        "batch cut, {name}: chi2 {stat:.1} on {df} df, p = {p:.3e}"
    );
}

/// Sequences with `config` and the given seeds (ids 0, 1, ...) decoded together in one [`Batch`]
/// with `drafter`, each until its third token: their tokens, and sequence 0's tokens drafted and
/// rounds added to `counted`.
fn batch_of<D: Draft>(
    drafter: D,
    config: &GenerateConfig,
    seeds: &[u64],
    counted: &mut (u64, u64),
) -> Vec<Vec<TokenId>> {
    let mut batch = Batch::new(MockModel::new(target_logits()), drafter);
    for (id, &seed) in seeds.iter().enumerate() {
        let config = GenerateConfig {
            seed,
            ..config.clone()
        };
        batch
            .add(SeqId(id as u64), PROMPT.to_vec(), config, None)
            .unwrap();
    }
    let mut got = vec![Vec::new(); seeds.len()];
    while !batch.is_empty() {
        let done = batch.step(&mut |seq, e: &Emitted| {
            let mine = &mut got[seq.0 as usize];
            mine.push(e.token);
            if mine.len() == 3 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        });
        for f in done {
            let out = f.result.unwrap();
            if f.seq == SeqId(0) {
                counted.0 += out.metrics.drafted;
                counted.1 += out.metrics.rounds;
            }
            batch.release(f.seq);
        }
    }
    got
}

/// The case of the review that found the bias: q = (0.9, 0.1), p = (0.5, 0.5), threshold 0.5. Deciding
/// to stop from the token just drafted gave (0.55, 0.45); deciding from q alone keeps (0.5, 0.5). Then a
/// draft whose largest probability falls below the threshold at some positions, so that rounds do end
/// early, and the output still follows the target.
#[test]
fn early_stop_on_low_confidence_keeps_the_target_distribution() {
    let pad = [-100.0; 3];
    let two = |a: f32, b: f32| -> Vec<f32> { [a.ln(), b.ln()].into_iter().chain(pad).collect() };
    let cases = [
        (
            "review case",
            MockLogits::Fixed(two(0.5, 0.5)),
            MockLogits::Fixed(two(0.9, 0.1)),
            0.5,
        ),
        (
            "position-dependent",
            MockLogits::Scripted(vec![two(0.5, 0.5), two(0.2, 0.8), two(0.7, 0.3)]),
            MockLogits::Scripted(vec![two(0.9, 0.1), two(0.6, 0.4), two(0.3, 0.7)]),
            0.65,
        ),
    ];
    let params = SamplingParams::default();
    for (name, target, draft, threshold) in cases {
        let expected = exact_joint_of(&target, &params);
        for k in [1, 3] {
            let config = GenerateConfig {
                sampling: params.clone(),
                verify_mode: VerifyMode::Rejection,
                draft_len: DraftLenPolicy::Fixed { draft_len: k },
                min_confidence: threshold,
                ..GenerateConfig::default()
            };
            let mut drafter = ModelDrafter::new(MockModel::new(draft.clone()));
            let (observed, drafted, rounds) =
                sample_joint_counted(&target, &mut drafter, &config, 20_000);
            let (stat, df, p) = chi_square(&observed, &expected);
            eprintln!(
                "early stop, {name}, k {k}: chi2 {stat:.1} on {df} df, p = {p:.3}; \
                 {drafted} drafted in {rounds} rounds"
            );
            assert!(
                p >= ALPHA,
                "early stop, {name}, k {k}: chi2 {stat:.1} on {df} df, p = {p:.3e}"
            );
            if name == "position-dependent" {
                assert!(
                    drafted > 0 && drafted < rounds * k as u64,
                    "{name}, k {k}: rounds must end early: {drafted} drafted in {rounds} rounds"
                );
            }
        }
    }
}

/// Hooks whose drafter's requests name token 2 as a token that ends generation
/// ([`specdec_core::DraftRequest::stop_tokens`]), while the generation itself goes on past it.
/// The drafter reads every prompt, whatever the cost model's price, so that a model's drafts and
/// the lookup's continuations of them are among those that end (the case of a prompt left unread
/// is `CountsReads`').
#[derive(Debug)]
struct StopsDraftingAfter2;

impl<D: Draft> Hooks<D> for StopsDraftingAfter2 {
    fn prefill_priced(
        &mut self,
        inner: &mut D,
        req: &specdec_core::PrefillRequest<'_>,
    ) -> Result<(), D::Error> {
        inner.prefill(req.seq, req.prompt)
    }

    fn propose(
        &mut self,
        inner: &mut D,
        batch: &[specdec_core::DraftRequest<'_>],
        out: &mut [specdec_core::Proposal],
    ) -> Result<(), D::Error> {
        let batch: Vec<_> = batch
            .iter()
            .map(|req| specdec_core::DraftRequest {
                stop_tokens: &[2],
                ..*req
            })
            .collect();
        inner.propose(&batch, out)
    }
}

/// Hooks that count the drafts that ended before the cost model's length
/// ([`specdec_core::DraftRequest::model_len`]) without a stop token: with no `min_confidence`,
/// the model drafter's confidence ended them.
#[derive(Debug, Default)]
struct CountsCutDrafts {
    cut: u64,
}

impl<D: Draft> Hooks<D> for CountsCutDrafts {
    fn propose(
        &mut self,
        inner: &mut D,
        batch: &[specdec_core::DraftRequest<'_>],
        out: &mut [specdec_core::Proposal],
    ) -> Result<(), D::Error> {
        inner.propose(batch, out)?;
        for (req, p) in batch.iter().zip(out.iter()) {
            let len = p.tokens.len();
            if len > 0 && len < req.model_len() && !p.ends_at(req.stop_tokens) {
                self.cut += 1;
            }
        }
        Ok(())
    }
}

/// Hooks that count the prompts a hybrid's model read at prefill without holding them, each
/// sample's sequence released before its prompt is given (a decode loop gives a prompt through
/// [`specdec_core::Draft::prefill_priced`]).
#[derive(Debug, Default)]
struct CountsReads {
    read: u64,
}

type MockHybrid = HybridDrafter<ModelDrafter<MockModel>>;

impl Hooks<MockHybrid> for CountsReads {
    fn prefill_priced(
        &mut self,
        inner: &mut MockHybrid,
        req: &specdec_core::PrefillRequest<'_>,
    ) -> Result<(), <MockHybrid as Draft>::Error> {
        // Each sample a new request, as a server's: its prompt not held from the one before,
        // which the probe read would otherwise leave for every later one to read for nothing.
        inner.release(req.seq);
        let held = inner.cached(req.seq, req.prompt) >= req.prompt.len();
        inner.prefill_priced(req)?;
        if !held && !inner.left_unread(req.seq) {
            self.read += 1;
        }
        Ok(())
    }
}

/// The bias that `early_stop_on_low_confidence_keeps_the_target_distribution` guards against: a drafter
/// that draws from q = (0.9, 0.1) but drops a draw q gives less than 0.5, so its drafts do not follow
/// the q it reports. The same chi-square test must reject it.
#[derive(Debug)]
struct StopsOnUnlikelyDraws;

impl Draft for StopsOnUnlikelyDraws {
    type Error = std::convert::Infallible;

    fn vocab_size(&self) -> Option<usize> {
        Some(VOCAB)
    }

    fn propose(
        &mut self,
        batch: &[specdec_core::DraftRequest<'_>],
        out: &mut [specdec_core::Proposal],
    ) -> Result<(), Self::Error> {
        let q = dense([0.9, 0.1, 0.0, 0.0, 0.0]);
        for (req, out) in batch.iter().zip(out) {
            out.clear();
            for i in 0..req.max_len {
                let pos = req.context.len() + i;
                let token = q.sample(req.rng.uniform(pos, Stream::Draft));
                if q.prob(token) < 0.5 {
                    break;
                }
                out.push(token, q.clone());
            }
        }
        Ok(())
    }

    fn commit(&mut self, _seq: specdec_core::SeqId, _c: &[TokenId]) -> Result<(), Self::Error> {
        Ok(())
    }
}

#[test]
fn a_drafter_biased_by_its_own_draws_is_caught() {
    let target = MockLogits::Fixed(vec![0.0, 0.0, -100.0, -100.0, -100.0]);
    let params = SamplingParams::default();
    let expected = exact_joint_of(&target, &params);
    let config = GenerateConfig {
        sampling: params,
        verify_mode: VerifyMode::Rejection,
        draft_len: DraftLenPolicy::Fixed { draft_len: 1 },
        ..GenerateConfig::default()
    };
    let observed = sample_joint_with(&target, &mut StopsOnUnlikelyDraws, &config, 20_000);
    let (stat, df, p) = chi_square(&observed, &expected);
    eprintln!("biased drafter: chi2 {stat:.1} on {df} df, p = {p:.3e}");
    assert!(p < ALPHA, "the biased drafter passed with p = {p:.3e}");
}

// --- One round at the level of the verify functions, with a pluggable verifier. ---

type Verifier = fn(&[TokenId], &[Probs], &[Probs], &CounterRng, usize) -> Verdict;

fn rejection(d: &[TokenId], q: &[Probs], p: &[Probs], rng: &CounterRng, pos: usize) -> Verdict {
    verify_rejection(d, q, p, rng, pos, &mut Vec::new())
}

fn onehot(d: &[TokenId], _q: &[Probs], p: &[Probs], rng: &CounterRng, pos: usize) -> Verdict {
    verify_onehot(d, p, rng, pos)
}

/// Rejection sampling with the residual skipped: after a rejection it resamples from p. Biased.
fn broken(d: &[TokenId], q: &[Probs], p: &[Probs], rng: &CounterRng, pos: usize) -> Verdict {
    for (i, ((&x, q), p)) in d.iter().zip(q).zip(p).enumerate() {
        let a = (f64::from(p.prob(x)) / f64::from(q.prob(x))).min(1.0);
        if rng.uniform(pos + i, Stream::Accept) >= a {
            return Verdict {
                accepted: i,
                next: p.sample(rng.uniform(pos + i, Stream::Residual)),
            };
        }
    }
    Verdict {
        accepted: d.len(),
        next: p[d.len()].sample(rng.uniform(pos + d.len(), Stream::Target)),
    }
}

fn dense(v: [f32; VOCAB]) -> Probs {
    let s: f32 = v.iter().sum();
    Probs::Dense(v.iter().map(|x| x / s).collect())
}

/// Position-dependent, context-independent distributions: tokens are independent with marginals p_pos.
fn p_at(pos: usize) -> Probs {
    [
        dense([0.5, 0.2, 0.1, 0.1, 0.1]),
        dense([0.05, 0.05, 0.3, 0.3, 0.3]),
        dense([0.2, 0.2, 0.2, 0.2, 0.2]),
    ][pos % 3]
        .clone()
}

fn q_at(pos: usize) -> Probs {
    [
        dense([0.1, 0.1, 0.2, 0.3, 0.3]),
        dense([0.6, 0.1, 0.1, 0.1, 0.1]),
        dense([0.4, 0.0, 0.3, 0.3, 0.0]),
    ][pos % 3]
        .clone()
}

/// Emits two tokens starting at position 0 with rounds of `k` drafted tokens, verified by `verify`.
fn first_two(verify: Verifier, k: usize, seed: u64) -> (TokenId, TokenId) {
    let rng = CounterRng::new(seed);
    let mut emitted = Vec::new();
    let mut pos = 0;
    while emitted.len() < 2 {
        let draft: Vec<TokenId> = (0..k)
            .map(|i| q_at(pos + i).sample(rng.uniform(pos + i, Stream::Draft)))
            .collect();
        let q: Vec<Probs> = (0..k).map(|i| q_at(pos + i)).collect();
        let p: Vec<Probs> = (0..=k).map(|i| p_at(pos + i)).collect();
        let v = verify(&draft, &q, &p, &rng, pos);
        emitted.extend_from_slice(&draft[..v.accepted]);
        emitted.push(v.next);
        pos += v.accepted + 1;
    }
    (emitted[0], emitted[1])
}

fn round_p_value(verify: Verifier, k: usize, n: u64) -> f64 {
    let mut counts = vec![0u64; VOCAB * VOCAB];
    for seed in 0..n {
        let (a, b) = first_two(verify, k, seed);
        counts[a as usize * VOCAB + b as usize] += 1;
    }
    let (p0, p1) = (p_at(0), p_at(1));
    let expected: Vec<f64> = (0..VOCAB * VOCAB)
        .map(|i| {
            f64::from(p0.prob((i / VOCAB) as TokenId)) * f64::from(p1.prob((i % VOCAB) as TokenId))
        })
        .collect();
    let (stat, df, p) = chi_square(&counts, &expected);
    eprintln!("k {k}: chi2 {stat:.1} on {df} df, p = {p:.3e}");
    p
}

#[test]
fn verify_functions_give_the_target_distribution() {
    for k in [1, 2, 3, 5] {
        let p = round_p_value(rejection, k, 40_000);
        assert!(p >= ALPHA, "rejection, k {k}: p = {p:.3e}");
        let p = round_p_value(onehot, k, 40_000);
        assert!(p >= ALPHA, "onehot, k {k}: p = {p:.3e}");
    }
}

#[test]
fn a_broken_verifier_is_caught() {
    for k in [1, 3] {
        let p = round_p_value(broken, k, 40_000);
        assert!(
            p < ALPHA,
            "the biased verifier passed with p = {p:.3e} at k {k}"
        );
    }
}

#[test]
fn onehot_mode_reproduces_plain_sampling_with_the_same_seed() {
    let d = SamplingParams::default();
    let cases = [
        SamplingParams {
            temperature: 0.9,
            top_p: 0.9,
            ..d.clone()
        },
        SamplingParams {
            temperature: 1.2,
            top_k: 3,
            repetition_penalty: 1.2,
            ..d.clone()
        },
        d,
    ];
    for params in cases {
        for seed in 0..20 {
            for k in 1..=8 {
                let config = GenerateConfig {
                    max_new_tokens: 30,
                    sampling: params.clone(),
                    seed,
                    verify_mode: VerifyMode::OneHot,
                    draft_len: DraftLenPolicy::Fixed { draft_len: k },
                    ..GenerateConfig::default()
                };
                let mut target = MockModel::new(target_logits());
                let plain = generate(
                    &mut target,
                    &mut specdec_core::NoDraft,
                    &PROMPT,
                    &config,
                    &mut |_| ControlFlow::Continue(()),
                )
                .unwrap();
                let mut target = MockModel::new(target_logits());
                let mut drafter = ModelDrafter::new(MockModel::new(draft_logits()));
                let spec = generate(&mut target, &mut drafter, &PROMPT, &config, &mut |_| {
                    ControlFlow::Continue(())
                })
                .unwrap();
                assert_eq!(spec.tokens, plain.tokens, "seed {seed}, k {k}, {params:?}");
                assert!(spec.metrics.drafted > 0);
                let mut target = MockModel::new(target_logits());
                let mut ngram = specdec_core::NGramDrafter { min_n: 1, max_n: 2 };
                let spec = generate(&mut target, &mut ngram, &PROMPT, &config, &mut |_| {
                    ControlFlow::Continue(())
                })
                .unwrap();
                assert_eq!(spec.tokens, plain.tokens, "ngram, seed {seed}, k {k}");
            }
        }
    }
}
