//! Drafting with a model: any [`Target`] (a smaller model of the same family) becomes a [`Draft`].

use crate::kernels;
use crate::model::{
    AnswerLengths, Draft, DraftRequest, Logits, PrefillRequest, Proposal, ReadSavings,
    RecentAnswers, Score, SeqId, Target,
};
use crate::ngram::{DeferredReads, HybridPlan};
use crate::rng::Stream;
use crate::sampling::{Probs, Sampler};
use crate::TokenId;

/// Drafts by running a model one token at a time, sampling each token with the target's sampling
/// parameters (greedy stays greedy) and the draft stream of the RNG. All sequences of a batch advance
/// together, one model call per drafted position. A sequence's draft ends after a token that ends its
/// generation ([`DraftRequest::stop_tokens`]): nothing after it can be emitted; under a cost model
/// it also ends where its own confidence no longer pays for more ([`crate::RoundCosts::drafts_on`]).
/// Exact: whether position `i + 1` is drafted depends only on the tokens drawn before it, as any
/// draft length may, and a token once drawn is never dropped.
#[derive(Debug)]
pub struct ModelDrafter<M> {
    model: M,
    /// One sampler per request of the batch (sequences may sample differently).
    samplers: Vec<Sampler>,
    contexts: Vec<Vec<TokenId>>,
    logits: Vec<Logits>,
    scratch: Vec<f32>,
    /// Dense buffers of the previous round's draft distributions, reused for the next round's.
    spare: Vec<Vec<f32>>,
    /// Sequences whose prompt the model left unread ([`Draft::prefill_priced`]): nothing is
    /// drafted for them until the rounds since forgo the price of reading it, where the tokens
    /// left can still repay it ([`DeferredReads`]).
    reads: DeferredReads,
    /// The answers of the sequences it was given the prompt of lately ([`Draft::prefill`],
    /// [`Draft::prefill_priced`]), read or left unread (none covered by a lookup).
    answers: AnswerLengths,
    /// What its drafts saved against plain decoding in the sequences whose prompt it read.
    savings: ReadSavings,
    /// Prompts left unread at prefill in a row since the last one read there
    /// ([`READ_PROBE_AFTER`]).
    unread_in_a_row: usize,
}

/// Prompts in a row a [`ModelDrafter`] leaves unread at prefill before it reads the next one
/// whatever its price: the savings that price a reading ([`ReadSavings`]) are measured only on
/// prompts it read, so without this a run of answers where its drafts saved little could keep it
/// from reading, and from measuring, for long. Stop 67's benchmark found it so: the model drafter
/// alone (stop 66's code, same session) drafted nothing in 14 prompts in a row from
/// `HumanEval/2` on, all ten code edit and qa prompts among them, and decoded them plainly (0.99×
/// both), where the run of stop 67's first change (the acceptance prior, not this) read them and
/// decoded qa at 1.08× and edits at 1.56×; that run in turn left three summaries unread, two of
/// which the other had read (0.66× and 1.87×). At most one reading in five prompts is the price
/// of measuring again. A [`crate::HybridDrafter`] keeps the same count (since stop 69), and the
/// server's drafter one for its model-kind requests and one for its hybrid-kind ones; the hybrid
/// kinds also read the next prompt after an answer that calls for measuring again
/// ([`crate::LookupSavings::finish`], since stop 71), which this bound does not cover.
pub const READ_PROBE_AFTER: usize = 4;

impl<M: Target> ModelDrafter<M> {
    /// Drafts with `model`.
    pub fn new(model: M) -> Self {
        Self {
            model,
            samplers: Vec::new(),
            contexts: Vec::new(),
            logits: Vec::new(),
            scratch: Vec::new(),
            spare: Vec::new(),
            reads: DeferredReads::default(),
            answers: AnswerLengths::default(),
            savings: ReadSavings::default(),
            unread_in_a_row: 0,
        }
    }

    /// What its drafts saved in recent answers whose prompt it read, which prices the next
    /// prompt's reading ([`Draft::prefill_priced`]).
    pub fn read_savings(&self) -> &ReadSavings {
        &self.savings
    }

    /// The answers of the sequences it was given the prompt of lately, which price a prompt's
    /// reading ([`Draft::prefill_priced`]). A drafter that holds it (the hybrid) and leaves a
    /// reused id's prompt unread without telling it records that answer with the next prompt's
    /// tokens in it; the hybrid prices its reading by the lookup's answers instead.
    pub fn recent_answers(&self) -> &RecentAnswers {
        self.answers.answers()
    }

    /// A sequence starts with a prompt of `prompt_len` tokens: the answer it held before (a
    /// caller that reuses the id, like [`crate::generate`] for chat turns) is recorded.
    fn start(&mut self, seq: SeqId, prompt_len: usize) {
        self.answers.start(seq, prompt_len);
        self.savings.finish(seq);
    }

    /// The model.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The model, mutably.
    pub fn model_mut(&mut self) -> &mut M {
        &mut self.model
    }

    /// Gives the model back.
    pub fn into_model(self) -> M {
        self.model
    }
}

impl<M: Target> Draft for ModelDrafter<M> {
    type Error = DraftError<M::Error>;

    fn vocab_size(&self) -> Option<usize> {
        Some(self.model.vocab_size())
    }

    fn propose(
        &mut self,
        batch: &[DraftRequest<'_>],
        out: &mut [Proposal],
    ) -> Result<(), Self::Error> {
        for p in out.iter_mut() {
            p.tokens.clear();
            p.confidence.clear();
            p.top_probs.clear();
            p.non_finite = false;
            self.spare.extend(p.probs.drain(..).filter_map(|q| match q {
                Probs::Dense(v) => Some(v),
                Probs::OneHot(_) => None,
            }));
        }
        if batch.is_empty() {
            return Ok(());
        }
        // A sampler per request, kept while the parameters stay the same.
        self.samplers.truncate(batch.len());
        for (b, req) in batch.iter().enumerate() {
            if self.samplers.get(b).map(Sampler::params) != Some(req.sampling) {
                req.sampling.validate().map_err(DraftError::Sampling)?;
                let s = Sampler::new(req.sampling.clone());
                match self.samplers.get_mut(b) {
                    Some(slot) => *slot = s,
                    None => self.samplers.push(s),
                }
            }
        }
        self.contexts.resize_with(batch.len(), Vec::new);
        for (ctx, req) in self.contexts.iter_mut().zip(batch) {
            ctx.clear();
            ctx.extend_from_slice(req.context);
        }
        let Self {
            model,
            samplers,
            contexts,
            logits,
            scratch,
            spare,
            reads,
            savings,
            ..
        } = self;
        let vocab = model.vocab_size();
        logits.resize_with(batch.len(), || Logits::new(vocab));
        let mut active = Vec::with_capacity(batch.len());
        // Each request's estimated probability that its tokens drafted so far are all accepted: the
        // product of the draft's largest probabilities at their positions, as the cost model
        // calibrates them (`RoundCosts::calibration`).
        let mut reach = vec![1.0f64; batch.len()];
        for (req, out) in batch.iter().zip(out.iter_mut()) {
            out.lag = 0;
            let mut drafts = req.model_len() > 0;
            if drafts && (reads.is_unread(req.seq) || reads.is_due(req.seq)) {
                // A round with nothing but plain decoding to weigh the model's draft against; once
                // the rounds since forwent the price of the prompt, the model reads it now, as the
                // catch-up of this round's draft (its lag, which the cost model prices).
                let cached = || model.cached(req.seq, req.context);
                let empty = Proposal::default();
                drafts = reads.plan(req, &empty, f64::NAN, cached, || HybridPlan::Model)
                    != HybridPlan::Lookup;
                if drafts {
                    out.lag = req.context.len().saturating_sub(cached());
                }
            }
            active.push(drafts);
        }
        let mut live = Vec::with_capacity(batch.len());
        loop {
            live.clear();
            live.extend((0..batch.len()).filter(|&b| active[b]));
            if live.is_empty() {
                break;
            }
            let requests: Vec<Score<'_>> = live
                .iter()
                .map(|&b| Score {
                    seq: batch[b].seq,
                    context: &contexts[b],
                    draft: &[],
                })
                .collect();
            model
                .score(&requests, &mut logits[..live.len()])
                .map_err(DraftError::Model)?;
            drop(requests);
            for (slot, &b) in live.iter().enumerate() {
                let req = &batch[b];
                let row = logits[slot].row(0);
                let mut q = spare.pop().map_or(Probs::OneHot(0), Probs::Dense);
                if samplers[b].probs(row, &contexts[b], &mut q).is_err() {
                    // Logits this sequence's draft cannot sample from (not finite) end its draft
                    // here; the target decodes on, and the other sequences' drafts go on. The
                    // round says so, for the metrics.
                    active[b] = false;
                    out[b].non_finite = true;
                    if let Probs::Dense(v) = q {
                        spare.push(v);
                    }
                    continue;
                }
                // `min_confidence` stops before this position's token is drawn, from q alone: the
                // verifier assumes each drafted token is drawn from the q reported with it, and a
                // stop that dropped a token for what was drawn would keep only the likely draws,
                // biasing rejection sampling. The cost model's stop below comes after the draw and
                // only decides whether later positions are drafted, from the tokens drawn so far
                // (their q's largest probabilities), as any draft length may: it drops nothing.
                let mut confidence = None;
                if req.min_confidence > 0.0 || req.costs.is_some() {
                    let p = match &q {
                        Probs::OneHot(_) => top_prob(row, scratch),
                        Probs::Dense(v) => kernels::max(v),
                    };
                    if p < req.min_confidence {
                        active[b] = false;
                        if let Probs::Dense(v) = q {
                            spare.push(v);
                        }
                        continue;
                    }
                    confidence = Some(p);
                }
                let pos = contexts[b].len();
                let token = q.sample(req.rng.uniform(pos, Stream::Draft));
                out[b].push(token, q);
                if let (Some(p), Some(c)) = (confidence, req.costs) {
                    // The calibrated chance that this position is accepted, given the ones before.
                    reach[b] *= c.calibration.acceptance(p);
                    out[b].top_probs.push(p);
                }
                contexts[b].push(token);
                let drafted = out[b].tokens.len();
                if drafted >= req.model_len()
                    || req.stop_tokens.contains(&token)
                    || req
                        .costs
                        .is_some_and(|c| !c.drafts_on(drafted, reach[b], req.model_len()))
                {
                    active[b] = false;
                }
            }
        }
        // Each round that drafted is priced against plain decoding for [`ReadSavings`]; a round
        // that reads a due prompt as its catch-up is not charged for it (the rounds before
        // forwent its price).
        for (req, out) in batch.iter().zip(out.iter()) {
            savings.model_drafted(req, out);
        }
        Ok(())
    }

    fn commit(&mut self, seq: SeqId, committed: &[TokenId]) -> Result<(), Self::Error> {
        self.answers.committed(seq, committed.len());
        self.savings.committed(seq, committed.len());
        self.model.commit(seq, committed).map_err(DraftError::Model)
    }

    fn prefill(&mut self, seq: SeqId, context: &[TokenId]) -> Result<(), Self::Error> {
        self.start(seq, context.len());
        self.reads.release(seq);
        self.savings.read(seq, context.len());
        let vocab = self.model.vocab_size();
        self.logits.resize_with(1, || Logits::new(vocab));
        self.model
            .score(
                &[Score {
                    seq,
                    context,
                    draft: &[],
                }],
                &mut self.logits[..1],
            )
            .map_err(DraftError::Model)
    }

    /// [`Draft::prefill`], except where the cost model says that reading the prompt (the part the
    /// model does not hold) cannot pay for itself within the tokens the sequence is expected to
    /// emit ([`crate::RoundCosts::prompt_read_pays`], [`RecentAnswers::model_tokens`]): the model
    /// then leaves it unread and drafts nothing for the sequence, which decodes plainly, until the
    /// savings its drafts were expected to bring in the rounds since ([`crate::forgone`], against
    /// plain decoding) reach the price of reading it, where the tokens left can still repay it
    /// ([`DeferredReads`]); the next round's draft then reads it first. After
    /// [`READ_PROBE_AFTER`] prompts left unread in a row it reads the next whatever its price.
    fn prefill_priced(&mut self, req: &PrefillRequest<'_>) -> Result<(), Self::Error> {
        self.start(req.seq, req.prompt.len());
        let probe = self.unread_in_a_row >= READ_PROBE_AFTER;
        if probe
            || req.read_pays(
                self.model.cached(req.seq, req.prompt),
                self.answers.answers(),
                &self.savings,
            )
        {
            self.unread_in_a_row = 0;
            return self.prefill(req.seq, req.prompt);
        }
        self.unread_in_a_row += 1;
        self.reads.leave_unread(req);
        Ok(())
    }

    fn cached(&self, seq: SeqId, context: &[TokenId]) -> usize {
        self.model.cached(seq, context)
    }

    fn model_drafts(&self, seq: SeqId) -> bool {
        !self.reads.is_unread(seq)
    }

    fn release(&mut self, seq: SeqId) {
        self.answers.finish(seq);
        self.reads.release(seq);
        self.savings.finish(seq);
        self.model.release(seq);
    }
}

/// The draft's confidence in its most likely token: the top probability at temperature 1.
fn top_prob(logits: &[f32], scratch: &mut Vec<f32>) -> f32 {
    scratch.clear();
    scratch.extend_from_slice(logits);
    let (max, _, _) = kernels::max_checked(scratch);
    let total = kernels::exp_shift_sum(scratch, max, 1.0);
    (1.0 / total) as f32
}

/// Why a [`ModelDrafter`] failed.
#[derive(Debug, thiserror::Error)]
pub enum DraftError<E: std::error::Error + 'static> {
    /// The draft model failed.
    #[error(transparent)]
    Model(E),
    /// The sampling parameters are invalid. (Draft logits that are not finite end that sequence's
    /// draft instead, since stop 64: the target decodes on.)
    #[error(transparent)]
    Sampling(crate::Error),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock::{MockLogits, MockModel};
    use crate::{RoundCosts, SamplingParams};

    /// The prompt-reading tests' drafter, over a mock model of 48 tokens sure of its drafts (so
    /// that its confidence drafts the cost model's length), and their prompt: 1,000 tokens
    /// repeating 0..40.
    fn reading_setup() -> (ModelDrafter<MockModel>, Vec<TokenId>) {
        let sure: Vec<f32> = (0..48).map(|t| if t == 7 { 12.0 } else { 0.0 }).collect();
        let model = MockModel::new(MockLogits::Fixed(sure));
        (
            ModelDrafter::new(model),
            (0..1_000).map(|i| i % 40).collect(),
        )
    }

    /// Sequence 0's prompt, priced by `costs`, with `remaining` tokens to emit.
    fn priced<'a>(
        prompt: &'a [TokenId],
        remaining: usize,
        costs: &'a RoundCosts,
    ) -> PrefillRequest<'a> {
        PrefillRequest {
            seq: SeqId(0),
            prompt,
            remaining,
            costs: Some(costs),
        }
    }

    #[test]
    fn a_prompt_the_model_could_not_repay_is_not_read_and_nothing_is_drafted() {
        // Reading a prompt token costs 0.05 steps; the model's drafts are predicted at 1.25 tokens
        // per step, a saving of 0.2 steps per token it drafts for.
        let costs = RoundCosts {
            r: (1..=17).map(|m| 1.0 + 0.1 * (m - 1) as f64).collect(),
            draft_per_token: 0.25,
            prompt_read: 0.05,
            model_len: 3,
            model_rate: 1.25,
            model_steps: 2.05,
            ..RoundCosts::default()
        };
        let (mut d, prompt) = reading_setup();
        let sampling = SamplingParams::greedy();
        let seq = SeqId(0);
        let draft = |d: &mut ModelDrafter<MockModel>| {
            let mut out = [Proposal::default()];
            d.propose(
                &[crate::mock::draft_request(
                    seq,
                    &prompt,
                    &sampling,
                    Some(&costs),
                )],
                &mut out,
            )
            .unwrap();
            out[0].tokens.len()
        };
        let read = |remaining| priced(&prompt, remaining, &costs);
        // 50 steps of reading, not repaid within 200 tokens: nothing read, nothing drafted.
        d.prefill_priced(&read(200)).unwrap();
        assert_eq!(draft(&mut d), 0);
        assert_eq!(d.model().stats().calls, 0);
        // Repaid within 1,000 (no answers seen yet: the whole limit is expected): read, then
        // drafted.
        d.prefill_priced(&read(1_000)).unwrap();
        assert_eq!(d.model().stats().calls, 1);
        assert_eq!(draft(&mut d), 3);
        // Once the sequences it drafted for answered in 100 tokens, a limit of 1,000 no longer
        // repays the reading.
        let mut answer = prompt.clone();
        answer.extend(std::iter::repeat_n(7, 100));
        d.commit(seq, &answer).unwrap();
        d.release(seq);
        assert_eq!(d.recent_answers().expected_len(1_000), 100.0);
        let calls = d.model().stats().calls;
        d.prefill_priced(&read(1_000)).unwrap();
        assert_eq!(d.model().stats().calls, calls);
        assert_eq!(draft(&mut d), 0);
    }

    #[test]
    fn after_prompts_left_unread_in_a_row_the_next_one_is_read_whatever_its_price() {
        let costs = crate::mock::reading_costs();
        let (mut d, prompt) = reading_setup();
        // 50 steps of reading that 100 tokens cannot repay (a third of a step each): left
        // unread, READ_PROBE_AFTER times.
        for i in 0..READ_PROBE_AFTER {
            d.prefill_priced(&priced(&prompt, 100, &costs)).unwrap();
            assert!(!d.model_drafts(SeqId(0)), "prompt {i}");
            assert_eq!(d.model().stats().calls, 0, "prompt {i}");
        }
        // The next is read, so that its answer measures the drafts' savings again.
        d.prefill_priced(&priced(&prompt, 100, &costs)).unwrap();
        assert!(d.model_drafts(SeqId(0)));
        assert_eq!(d.model().stats().calls, 1);
        // And the count starts over: the one after (a new sequence: nothing of it held) is
        // priced as before.
        d.release(SeqId(0));
        d.prefill_priced(&priced(&prompt, 100, &costs)).unwrap();
        assert!(!d.model_drafts(SeqId(0)));
        assert_eq!(d.model().stats().calls, 1);
    }

    #[test]
    fn a_prompt_left_unread_is_read_once_the_rounds_since_forwent_its_price() {
        // The model's drafts save 1 - 1 / 1.5 = 1/3 of a step per round of plain decoding, and
        // reading the 1,000 prompt tokens costs 50 steps, which 100 tokens cannot repay.
        let costs = crate::mock::reading_costs();
        let (mut d, prompt) = reading_setup();
        let sampling = SamplingParams::greedy();
        let seq = SeqId(0);
        let draft = |d: &mut ModelDrafter<MockModel>, costs: Option<&RoundCosts>| {
            let mut out = [Proposal::default()];
            d.propose(
                &[crate::mock::draft_request(seq, &prompt, &sampling, costs)],
                &mut out,
            )
            .unwrap();
            let [p] = out;
            (p.tokens.len(), p.lag)
        };
        d.prefill_priced(&priced(&prompt, 100, &costs)).unwrap();
        assert!(!d.model_drafts(seq));
        // A round without prices forgoes nothing.
        assert_eq!(draft(&mut d, None), (0, 0));
        // 50 / (1/3) = 150 rounds of rent (one more where the sum rounds below 50).
        let mut rounds = 0;
        let read = loop {
            rounds += 1;
            let (tokens, lag) = draft(&mut d, Some(&costs));
            if tokens > 0 {
                break lag;
            }
            assert_eq!(d.model().stats().calls, 0, "round {rounds}");
            assert!(rounds < 300, "the prompt was never read");
        };
        assert!((150..=151).contains(&rounds), "{rounds}");
        // The draft read the whole prompt first, and reports it as its catch-up.
        assert_eq!(read, prompt.len());
        assert!(d.model_drafts(seq));
        assert_eq!(draft(&mut d, Some(&costs)), (2, 0));
        // A model slower than plain decoding forgoes nothing: its prompt stays unread.
        let slow = RoundCosts {
            model_rate: 0.9,
            ..costs.clone()
        };
        d.release(seq);
        d.prefill_priced(&priced(&prompt, 1, &slow)).unwrap();
        let calls = d.model().stats().calls;
        for _ in 0..1_000 {
            assert_eq!(draft(&mut d, Some(&slow)), (0, 0));
        }
        assert_eq!(d.model().stats().calls, calls);
    }

    #[test]
    fn its_rounds_are_settled_against_plain_decoding_and_not_charged_a_deferred_read() {
        let costs = crate::mock::reading_costs();
        let (mut d, prompt) = reading_setup();
        let sampling = SamplingParams::greedy();
        let seq = SeqId(0);
        // A recent answer of 100 tokens (its prompt left unread: one token could not repay it)
        // prices the reading over 100 tokens, which cannot repay its 50 steps, though the limit
        // of 1,000 could after the 150 rounds the reading waits for.
        let other = SeqId(9);
        d.prefill_priced(&PrefillRequest {
            seq: other,
            ..priced(&prompt, 1, &costs)
        })
        .unwrap();
        let mut answer = prompt.clone();
        answer.extend(std::iter::repeat_n(7, 100));
        d.commit(other, &answer).unwrap();
        d.release(other);
        assert_eq!(d.recent_answers().expected_len(1_000), 100.0);
        d.prefill_priced(&priced(&prompt, 1_000, &costs)).unwrap();
        assert!(!d.model_drafts(seq));
        let mut context = prompt.clone();
        let mut drafted = 0;
        for round in 0..400 {
            let mut out = [Proposal::default()];
            let req = crate::mock::draft_request(seq, &context, &sampling, Some(&costs));
            d.propose(&[req], &mut out).unwrap();
            if !out[0].tokens.is_empty() {
                drafted += 1;
            }
            // Nothing drafted is accepted: the target's token differs from the first drafted
            // one, and the round emits it alone.
            let next = out[0].tokens.first().map_or(47, |&t| (t + 1) % 48);
            context.push(next);
            d.commit(seq, &context).unwrap();
            assert!(round < 399, "never drafted");
            if drafted == 10 {
                break;
            }
        }
        d.release(seq);
        // Each drafting round: 2 tokens at 0.25 and r(3) = 1.2, 1.7 steps for the one token plain
        // decoding emits in 1: 0.7 lost a round, the first one's reading of the 1,000-token prompt
        // (paid for by the rounds before) not charged. The rounds before the read are not
        // accounted, so the answer's tokens are the 10 since.
        let saved = d.read_savings().saved_per_token().unwrap_or(f64::NAN);
        assert!((saved + 0.7).abs() < 1e-9, "{saved}");
        // The next prompt, which the prediction would read (100 tokens, 5 steps, within a third
        // of a step for each of the 100 or more expected), is left unread.
        let short: Vec<TokenId> = (0..100).collect();
        d.prefill_priced(&priced(&short, 1_000, &costs)).unwrap();
        assert!(!d.model_drafts(seq));
    }

    #[test]
    fn a_model_draft_ends_where_its_confidence_no_longer_pays_for_another_token() {
        // Another token costs 0.25 + 0.1 steps, worth 0.4375 tokens at 1.25 tokens per step; each
        // position is estimated accepted at 0.9, so a draft goes on while its reach is at least
        // 0.486.
        let costs = RoundCosts {
            r: (1..=17).map(|m| 1.0 + 0.1 * (m - 1) as f64).collect(),
            draft_per_token: 0.25,
            model_len: 4,
            model_rate: 1.25,
            model_steps: 2.4,
            model_acceptance: vec![0.9; 4],
            ..RoundCosts::default()
        };
        // Over 4 tokens, token 0 with probability `p` at a position.
        let sure = |p: f32| -> Vec<f32> {
            let rest = ((1.0 - p) / 3.0).ln();
            vec![p.ln(), rest, rest, rest]
        };
        let prompt: Vec<TokenId> = vec![1, 2, 3, 1];
        let sampling = SamplingParams::greedy();
        let drafted_with = |script: Vec<Vec<f32>>, costs: Option<&RoundCosts>| {
            let mut d = ModelDrafter::new(MockModel::new(MockLogits::Scripted(script)));
            d.prefill(SeqId(0), &prompt).unwrap();
            let mut out = [Proposal::default()];
            let req = crate::mock::draft_request(SeqId(0), &prompt, &sampling, costs);
            d.propose(&[DraftRequest { max_len: 4, ..req }], &mut out)
                .unwrap();
            let [p] = out;
            (p.tokens.len(), p.top_probs)
        };
        let drafted =
            |script: Vec<Vec<f32>>, costs: Option<&RoundCosts>| drafted_with(script, costs).0;
        let unsure_third = vec![sure(0.95), sure(0.95), sure(0.4), sure(0.95)];
        // Reach 0.95, 0.90, then 0.36 after the unsure third token: drafted, and the draft ends.
        assert_eq!(drafted(unsure_third.clone(), Some(&costs)), 3);
        // Each drafted token's confidence comes with the draft.
        let (_, top) = drafted_with(unsure_third.clone(), Some(&costs));
        assert_eq!(top.len(), 3);
        for (got, want) in top.iter().zip([0.95, 0.95, 0.4]) {
            assert!((got - want).abs() < 1e-4, "{top:?}");
        }
        assert!(drafted_with(unsure_third.clone(), None).1.is_empty());
        // Where the target has rejected two in three tokens drafted at this confidence, the
        // confidence calibrated from that is too low to draft a second token.
        let mut calibration = crate::ConfidenceCalibration::default();
        for i in 0..100 {
            calibration.observe(&top[..1], usize::from(i % 3 == 0));
        }
        let burnt = RoundCosts {
            calibration,
            ..costs.clone()
        };
        assert_eq!(drafted(vec![sure(0.95); 4], Some(&burnt)), 1);
        // Confident throughout (reach 0.86 after three), the cost model's length.
        assert_eq!(drafted(vec![sure(0.95); 4], Some(&costs)), 4);
        // A slower round rate makes each token cheaper: the unsure draft goes on.
        let slow = RoundCosts {
            model_rate: 0.5,
            ..costs.clone()
        };
        assert_eq!(drafted(unsure_third.clone(), Some(&slow)), 4);
        // Without a cost model, the requested length.
        assert_eq!(drafted(unsure_third, None), 4);
    }
}
