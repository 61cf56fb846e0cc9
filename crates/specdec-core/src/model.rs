//! What the decoder needs from models: a [`Target`] that scores a context plus drafted tokens in one
//! call, and a [`Draft`] that proposes tokens. Both take a batch of requests (one per sequence) so a
//! batched runtime implements them without changes here; the single-sequence decoder passes batches of
//! one.
//!
//! Caches: a model keeps whatever cache it likes per [`SeqId`]. Every call carries the full committed
//! context, so a model can always find the longest common prefix between its cache and the context and
//! truncate to it; [`Target::commit`] and [`Draft::commit`] say what was committed so caches can be
//! truncated at once.

use crate::policy::RoundCosts;
use crate::sampling::{Probs, SamplingParams};
use crate::{CounterRng, TokenId};

/// Identifies a sequence within a model's caches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

/// Logits for consecutive positions of one sequence: `[rows, vocab]`, row-major.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Logits {
    vocab: usize,
    data: Vec<f32>,
}

impl Logits {
    /// Empty logits for a vocabulary of `vocab` tokens.
    pub fn new(vocab: usize) -> Self {
        Self {
            vocab,
            data: Vec::new(),
        }
    }

    /// Clears the rows, sets the vocabulary size and lets `fill` write rows straight into the buffer
    /// (`[rows, vocab]`, row-major), so a model can put its output where the verifier reads it. A
    /// trailing partial row, a bug in `fill`, is dropped.
    ///
    /// # Errors
    /// `fill`'s error; the rows are then cleared.
    pub fn fill_with<E>(
        &mut self,
        vocab: usize,
        fill: impl FnOnce(&mut Vec<f32>) -> Result<(), E>,
    ) -> Result<(), E> {
        self.reset(vocab);
        let r = fill(&mut self.data);
        if r.is_err() {
            self.data.clear();
        }
        let whole = self.data.len().checked_div(vocab).map_or(0, |r| r * vocab);
        debug_assert_eq!(whole, self.data.len(), "a partial row of logits");
        self.data.truncate(whole);
        r
    }

    /// Clears the rows, sets the vocabulary size and returns the buffer for a model to write whole
    /// rows into (`[rows, vocab]`, row-major), for callers that fill several `Logits` at once, where
    /// [`Logits::fill_with`] takes one at a time. A trailing partial row is a bug in the caller.
    pub fn buffer(&mut self, vocab: usize) -> &mut Vec<f32> {
        self.reset(vocab);
        &mut self.data
    }

    /// Clears the rows and sets the vocabulary size, keeping the buffer.
    pub fn reset(&mut self, vocab: usize) {
        self.vocab = vocab;
        self.data.clear();
    }

    /// Appends one row. Panics if `row.len()` differs from the vocabulary size, a bug in the model.
    pub fn push_row(&mut self, row: &[f32]) {
        assert_eq!(
            row.len(),
            self.vocab,
            "a logits row must span the vocabulary"
        );
        self.data.extend_from_slice(row);
    }

    /// Appends rows given as one flat slice of whole rows.
    pub fn extend_rows(&mut self, rows: &[f32]) {
        assert_eq!(rows.len() % self.vocab.max(1), 0, "whole rows only");
        self.data.extend_from_slice(rows);
    }

    /// The vocabulary size.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// How many rows.
    pub fn rows(&self) -> usize {
        self.data.len().checked_div(self.vocab).unwrap_or(0)
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }
}

/// One sequence's request to [`Target::score`].
#[derive(Clone, Copy, Debug)]
pub struct Score<'a> {
    /// The sequence.
    pub seq: SeqId,
    /// All committed tokens, prompt included.
    pub context: &'a [TokenId],
    /// Drafted tokens that follow the context (possibly none).
    pub draft: &'a [TokenId],
}

/// The model whose distribution the output follows.
pub trait Target {
    /// The model's error type.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The vocabulary size: the length of every logits row.
    fn vocab_size(&self) -> usize;

    /// The most tokens a sequence can hold (prompt, drafted and generated).
    fn capacity(&self) -> usize;

    /// For every request, writes into `out[b]` the logits of the `draft.len() + 1` positions that follow
    /// `context[..len - 1]`: row `i` is the distribution of the token at position `context.len() + i`.
    /// One call scores a whole block; that is what makes verification cheap.
    fn score(&mut self, batch: &[Score<'_>], out: &mut [Logits]) -> Result<(), Self::Error>;

    /// `committed` is the sequence's whole committed context; cached positions past it may be dropped.
    fn commit(&mut self, seq: SeqId, committed: &[TokenId]) -> Result<(), Self::Error>;

    /// The sequence is finished; its cache may be freed.
    fn release(&mut self, _seq: SeqId) {}

    /// How many leading tokens of `context` the model holds for the sequence already (a scoring
    /// request reads only the rest). The default holds none.
    fn cached(&self, _seq: SeqId, _context: &[TokenId]) -> usize {
        0
    }

    /// [`Target::cached`] for a sequence about to start, after readying the cache it will use now,
    /// so that what it finds is its own: where several new sequences could find the same prefix
    /// in one kept cache, a batch claims them one after another and each counts only what it
    /// gets. The target may then hold state for the sequence: the caller releases it
    /// ([`Target::release`]) even if it is never scored. The default is [`Target::cached`].
    fn claim(&mut self, seq: SeqId, context: &[TokenId]) -> Result<usize, Self::Error> {
        Ok(self.cached(seq, context))
    }

    /// The shortest prefix that a new sequence, when it is claimed ([`Target::claim`]), takes as a
    /// copy of what a running sequence already holds, or `None` where the target copies none (the
    /// default). With chunked prefill a batch then lets a new sequence wait while an earlier one
    /// is still computing a longer prefix the two share, and claims it once that one holds it.
    fn min_prefix_copy(&self) -> Option<usize> {
        None
    }
}

/// One sequence's request to [`Draft::propose`].
#[derive(Clone, Copy, Debug)]
pub struct DraftRequest<'a> {
    /// The sequence.
    pub seq: SeqId,
    /// All committed tokens, prompt included.
    pub context: &'a [TokenId],
    /// Propose at most this many tokens.
    pub max_len: usize,
    /// The sampling parameters of the target, for drafters that sample.
    pub sampling: &'a SamplingParams,
    /// Numbers for drafting come from `rng.uniform(pos, Stream::Draft)`, `pos` being the drafted
    /// token's absolute position. A [`crate::Batch`] gives each drafting round its own draw
    /// ([`crate::CounterRng::with_draw`]), so that a position drafted again after a rejection is
    /// drawn with a new number.
    pub rng: CounterRng,
    /// Stop drafting at a position where the draft distribution's largest probability (at
    /// temperature 1 when decoding greedily) is below this, decided before the token is drawn
    /// (0 = never stop early).
    pub min_confidence: f32,
    /// The cost model's view of this round, when the draft length is chosen by one
    /// ([`crate::DraftLenPolicy::CostModel`], once it has measured its costs). A drafter with several
    /// options (lookup of any length, a model draft of up to [`RoundCosts::model_len`] tokens, a lookup
    /// draft extended by the model, nothing) picks the one with the most expected tokens per unit of
    /// time; `max_len` is then only a cap.
    pub costs: Option<&'a RoundCosts>,
    /// The tokens that end this sequence's generation ([`crate::GenerateConfig::stop_tokens`]): if
    /// the target accepts one, nothing after it is emitted, and if it rejects one, it rejects what
    /// follows too, so a drafter that draws one may stop there.
    pub stop_tokens: &'a [TokenId],
}

impl DraftRequest<'_> {
    /// How many tokens a model drafter should draft at most: the cost model's choice when there is
    /// one (which the model drafter may end sooner, [`RoundCosts::drafts_on`]), else `max_len`.
    pub fn model_len(&self) -> usize {
        self.costs
            .map_or(self.max_len, |c| c.model_len.min(self.max_len))
    }
}

/// Tokens proposed for one sequence, each with the distribution it was drawn from.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Proposal {
    /// Drafted tokens, in order.
    pub tokens: Vec<TokenId>,
    /// `probs[i]` is the distribution `tokens[i]` was drawn from; [`Probs::OneHot`] for deterministic
    /// drafters.
    pub probs: Vec<Probs>,
    /// The drafter's own estimate, per token, of the probability that it is accepted given that the
    /// tokens before it were, decided before the token was drawn; empty when the drafter makes none
    /// (a model drafter). A proposal with estimates is a lookup draft: the cost model keeps its
    /// acceptance apart from the model draft's.
    pub confidence: Vec<f32>,
    /// How many of the last tokens a model drafted to extend a lookup draft (0 for a lookup draft or
    /// a model draft alone). Their `confidence` entries are the cost model's acceptance estimates.
    pub extension: usize,
    /// How many of the first tokens a model drafted before the lookup continued its draft (0
    /// otherwise; see [`crate::continue_by_lookup`]). Their `confidence` entries are the cost
    /// model's acceptance estimates.
    pub prefix: usize,
    /// For a draft a model made (alone or extending a lookup draft): the committed tokens it had not
    /// read before this round and read first (its catch-up); 0 otherwise.
    pub lag: usize,
    /// Whether a model's draft ended early because the draft model's logits were not finite (NaN or
    /// infinite): the round verifies what was drafted before, and [`crate::Metrics`] counts it
    /// ([`crate::Metrics::non_finite_rounds`]) so that a draft model that fails silently shows.
    pub non_finite: bool,
    /// For the tokens a model drafted alone (a model draft, or the prefix of one the lookup
    /// continued): per token, the largest probability of the distribution it was drawn from, the
    /// draft model's confidence in its position, where the drafter computed it (under a cost
    /// model); empty otherwise. The cost model calibrates it into each token's chance of being
    /// accepted ([`crate::ConfidenceCalibration`]).
    pub top_probs: Vec<f32>,
}

impl Proposal {
    /// Whether the last drafted token is one of `stop_tokens`, so that the draft, accepted whole,
    /// ends the generation with no token after it.
    pub fn ends_at(&self, stop_tokens: &[TokenId]) -> bool {
        self.tokens.last().is_some_and(|t| stop_tokens.contains(t))
    }

    /// The draft model's confidences in the tokens it drafted alone ([`Proposal::top_probs`]): all
    /// of a model draft's, or the prefix's of one the lookup continued; `None` where it did not give
    /// one for each of them (a lookup draft, an extended one, no cost model).
    pub fn model_top_probs(&self) -> Option<&[f32]> {
        let model_tokens = if self.confidence.is_empty() {
            self.tokens.len()
        } else {
            self.prefix
        };
        (model_tokens > 0 && self.top_probs.len() == model_tokens).then_some(&self.top_probs[..])
    }

    /// Empties the proposal.
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.probs.clear();
        self.confidence.clear();
        self.top_probs.clear();
        self.extension = 0;
        self.prefix = 0;
        self.lag = 0;
        self.non_finite = false;
    }

    /// Keeps the first `len` tokens.
    pub fn truncate(&mut self, len: usize) {
        let cut = self.tokens.len().saturating_sub(len);
        self.extension = self.extension.saturating_sub(cut);
        self.prefix = self.prefix.min(len);
        self.tokens.truncate(len);
        self.probs.truncate(len);
        self.confidence.truncate(len);
        self.top_probs.truncate(len);
    }

    /// Appends a drafted token.
    pub fn push(&mut self, token: TokenId, probs: Probs) {
        self.tokens.push(token);
        self.probs.push(probs);
    }
}

/// Something that proposes tokens: a small model, an n-gram table, prompt lookup...
pub trait Draft {
    /// The drafter's error type.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The vocabulary the drafter proposes from, when it has a fixed one. Must equal the target's.
    fn vocab_size(&self) -> Option<usize>;

    /// Fills `out[b]` with at most `batch[b].max_len` tokens for each request.
    fn propose(
        &mut self,
        batch: &[DraftRequest<'_>],
        out: &mut [Proposal],
    ) -> Result<(), Self::Error>;

    /// `committed` is the sequence's whole committed context.
    fn commit(&mut self, seq: SeqId, committed: &[TokenId]) -> Result<(), Self::Error>;

    /// The caller scores only the first `len` tokens of the sequence's last proposal (a batch
    /// whose step pays best with shorter drafts, [`crate::best_batch_trim`]); the target's verdict
    /// on the rest will not come. The default does nothing.
    fn truncated(&mut self, _seq: SeqId, _len: usize) {}

    /// Called once with the prompt before the first round (after the target's prefill has emitted
    /// the first token, which [`Draft::commit`] then reports), so that prompt processing is not
    /// charged to drafting and the time to the first token is the target's alone. Until then
    /// [`Draft::commit`] is not called for the sequence. The default does nothing.
    fn prefill(&mut self, _seq: SeqId, _context: &[TokenId]) -> Result<(), Self::Error> {
        Ok(())
    }

    /// [`Draft::prefill`], told what the sequence may still emit and the cost model's prices, so
    /// that a drafter whose reading of the prompt could not pay for itself may leave it unread
    /// ([`crate::HybridDrafter`]). A decode loop calls this in place of [`Draft::prefill`]; the
    /// default reads the prompt.
    fn prefill_priced(&mut self, req: &PrefillRequest<'_>) -> Result<(), Self::Error> {
        self.prefill(req.seq, req.prompt)
    }

    /// How many leading tokens of `context` the drafter's model holds for the sequence already, so
    /// that reading them again costs nothing (0 for a drafter without a model, the default).
    fn cached(&self, _seq: SeqId, _context: &[TokenId]) -> usize {
        0
    }

    /// Whether the drafter may draft for the sequence with a model: not a drafter without one, nor
    /// one whose model left the sequence's prompt unread ([`Draft::prefill_priced`]). A batch
    /// weighs the model drafts of a step over these sequences only
    /// ([`crate::best_batch_draft_cap`]). True by default.
    fn model_drafts(&self, _seq: SeqId) -> bool {
        true
    }

    /// The sequence is finished.
    fn release(&mut self, _seq: SeqId) {}
}

/// What a drafter is told when it reads a prompt ([`Draft::prefill_priced`]).
#[derive(Clone, Copy, Debug)]
pub struct PrefillRequest<'a> {
    /// The sequence.
    pub seq: SeqId,
    /// The prompt.
    pub prompt: &'a [TokenId],
    /// How many tokens the sequence may still emit (its token limit and the context's room).
    pub remaining: usize,
    /// The cost model's view of the first round, when the draft length is chosen by one
    /// ([`DraftRequest::costs`]).
    pub costs: Option<&'a RoundCosts>,
}

impl PrefillRequest<'_> {
    /// Whether a model that holds the first `cached` tokens of the prompt should read the rest:
    /// always without prices, else where [`RoundCosts::prompt_read_pays`] says it can pay within
    /// the tokens a model is expected to draft for ([`RecentAnswers::model_tokens`] of the
    /// drafter's recent answers).
    ///
    /// Where the drafter measured what its model's drafts saved in recent answers whose prompt it
    /// read (`saved`, [`ReadSavings::saved_per_token`]), the prediction gives way to that measure:
    /// reading pays where its price is within the steps saved per answer token times the tokens
    /// the sequence is expected to emit ([`RecentAnswers::expected_len`]).
    pub fn read_pays(&self, cached: usize, recent: &RecentAnswers, saved: &ReadSavings) -> bool {
        self.costs.is_none_or(|c| {
            let unread = self.prompt.len().saturating_sub(cached);
            match saved.saved_per_token() {
                Some(s) => c.prompt_read * unread as f64 <= s * recent.expected_len(self.remaining),
                None => c.prompt_read_pays(unread, recent.model_tokens(self.remaining)),
            }
        })
    }
}

/// What a draft model's drafts saved, in target steps, in the answers whose prompt it read: the
/// measure that prices the next prompt's reading ([`PrefillRequest::read_pays`]) once there is one.
/// The cost model's prediction of a model draft's rate holds over the rounds the model drafts, but
/// the rounds it is asked to draft in a hybrid are the ones the lookup had nothing for, where the
/// answer is new text and the model's drafts fare worse: in stop 57's benchmark the hybrid read
/// the prompts (170–520 tokens, 0.6–2.2 s each) of all ten code edit runs, as the prediction said
/// each reading would pay, and decoded them 0.04 s faster in all than the lookup alone for 12.2 s
/// of reading (faster by more than its reading in 2 of the 10 runs, and in 2 of the 8 summary
/// runs it read), 1.36× end to end against the lookup's 1.54× on edits.
///
/// Each model round is priced when it is drafted ([`ReadSavings::drafted`]: its cost in target
/// steps, and the rate of what the round would have done without the model) and settled when the
/// target commits ([`ReadSavings::committed`]): it saved the steps its emitted tokens would have
/// taken at that rate, less its cost. Rounds without the model save nothing and count their tokens.
#[derive(Clone, Debug, Default)]
pub struct ReadSavings {
    /// Per sequence whose prompt the model read: what its rounds saved since.
    open: std::collections::HashMap<SeqId, Ledger>,
    /// `(saved, tokens)` per finished answer whose prompt the model read, oldest first.
    answers: std::collections::VecDeque<(f64, usize)>,
}

/// One sequence's account in [`ReadSavings`].
#[derive(Clone, Debug, Default)]
struct Ledger {
    /// Steps saved so far.
    saved: f64,
    /// Tokens committed since the model read the prompt.
    tokens: usize,
    /// The committed length at the last commit (or the read).
    len: usize,
    /// A model round drafted and not yet settled: the committed length it drafted after, the
    /// most tokens it can emit (its draft and the target's token after it), its cost, and the
    /// rate of the round without the model.
    pending: Option<(usize, usize, f64, f64)>,
}

impl ReadSavings {
    /// The model read the first `len` tokens of the sequence (its prompt, at prefill or as the
    /// catch-up of a round after [`DeferredReads`](crate::DeferredReads) found it due): its
    /// rounds are accounted from here. A sequence already open keeps its account.
    pub fn read(&mut self, seq: SeqId, len: usize) {
        self.open.entry(seq).or_insert(Ledger {
            len,
            ..Ledger::default()
        });
    }

    /// Whether the sequence is accounted (its prompt read).
    pub fn is_open(&self, seq: SeqId) -> bool {
        self.open.contains_key(&seq)
    }

    /// A round of the sequence, after `len` committed tokens, whose draft of `tokens` tokens the
    /// model made (in whole or in part) at `cost` target steps (its drafting and the target's
    /// scoring of the whole draft), where the round would otherwise have emitted `alt_rate`
    /// tokens per step (`1 / r(1)` for plain decoding, the lookup draft's rate where it had one).
    /// Ignored for a sequence not open or a rate that is not positive.
    pub fn drafted(&mut self, seq: SeqId, len: usize, tokens: usize, cost: f64, alt_rate: f64) {
        if let Some(l) = self.open.get_mut(&seq) {
            l.pending =
                (alt_rate > 0.0 && cost.is_finite()).then_some((len, tokens + 1, cost, alt_rate));
        }
    }

    /// [`ReadSavings::drafted`] for a round whose draft the model made alone, against plain
    /// decoding, at the round's prices ([`DraftRequest::costs`]; nothing without them or without
    /// a draft): the model's drafting and catch-up, and the target's scoring of the draft. The
    /// sequence's account opens at its first such round where the prompt was not read before,
    /// and that round's catch-up (the prompt, read lazily) is the price the account is weighed
    /// against, not a cost of the round.
    pub fn model_drafted(&mut self, req: &DraftRequest<'_>, out: &Proposal) {
        let (Some(c), false) = (req.costs, out.tokens.is_empty()) else {
            return;
        };
        let lag = if self.is_open(req.seq) { out.lag } else { 0 };
        self.read(req.seq, req.context.len());
        let cost = c.model_round_steps(out.tokens.len(), out.tokens.len(), lag);
        self.drafted(
            req.seq,
            req.context.len(),
            out.tokens.len(),
            cost,
            1.0 / c.r(1),
        );
    }

    /// The pending round's draft is cut to `len` tokens before the target scores it (a batch's
    /// trim): it can emit at most `len + 1` tokens, and costs `cheaper` target steps less.
    pub fn truncated(&mut self, seq: SeqId, len: usize, cheaper: f64) {
        if let Some((_, most, cost, _)) = self.open.get_mut(&seq).and_then(|l| l.pending.as_mut()) {
            *most = (*most).min(len + 1);
            *cost -= cheaper;
        }
    }

    /// The target committed the sequence's first `len` tokens: the pending round, if any, is
    /// settled, for at most the tokens it could emit (a caller may commit more at once, a chat
    /// turn's next prompt).
    pub fn committed(&mut self, seq: SeqId, len: usize) {
        self.settle(seq, len, None);
    }

    /// [`ReadSavings::committed`], where the caller knows what the pending round's emitted tokens
    /// would have cost without the model, `alt_steps` target steps (a hybrid replays its lookup
    /// alone over them, [`crate::HybridDrafter`]), in place of their count over the round's rate.
    pub fn committed_against(&mut self, seq: SeqId, len: usize, alt_steps: f64) {
        self.settle(seq, len, Some(alt_steps).filter(|s| s.is_finite()));
    }

    fn settle(&mut self, seq: SeqId, len: usize, alt_steps: Option<f64>) {
        let Some(l) = self.open.get_mut(&seq) else {
            return;
        };
        l.tokens += len.saturating_sub(l.len);
        l.len = len;
        if let Some((at, most, cost, alt_rate)) = l.pending.take() {
            let alt = alt_steps.unwrap_or(len.saturating_sub(at).min(most) as f64 / alt_rate);
            l.saved += alt - cost;
        }
    }

    /// The sequence is over (released, or its id given a new prompt): its answer is recorded if
    /// it emitted anything since the read. Returns whether it was.
    pub fn finish(&mut self, seq: SeqId) -> bool {
        let Some(l) = self.open.remove(&seq) else {
            return false;
        };
        if l.tokens == 0 {
            return false;
        }
        if self.answers.len() == RECENT_ANSWERS {
            self.answers.pop_front();
        }
        self.answers.push_back((l.saved, l.tokens));
        true
    }

    /// Answers recorded (at most [`RECENT_ANSWERS`]).
    pub fn len(&self) -> usize {
        self.answers.len()
    }

    /// Whether none is recorded.
    pub fn is_empty(&self) -> bool {
        self.answers.is_empty()
    }

    /// The target steps the model's drafts saved per token of the recent answers whose prompt it
    /// read, weighted like [`RecentAnswers`] ([`RECENT_ANSWER_DECAY`] to the power of an answer's
    /// age); negative where they cost more than they saved, `None` without any.
    pub fn saved_per_token(&self) -> Option<f64> {
        let mut w = 1.0;
        let (mut saved, mut tokens) = (0.0, 0.0);
        for &(s, n) in self.answers.iter().rev() {
            saved += w * s;
            tokens += w * n as f64;
            w *= RECENT_ANSWER_DECAY;
        }
        (tokens > 0.0).then(|| saved / tokens)
    }
}

/// Answers kept in [`RecentAnswers`], the oldest dropped first.
pub const RECENT_ANSWERS: usize = 16;

/// The weight of an answer in [`RecentAnswers`]' means against the one after it: the estimates
/// follow a change in the kind of request within a few answers (a benchmark's categories run in
/// turn: stop 55's first version, unweighted over 16 answers, still priced the questions on a
/// passage by the code edits and completions before them and read 8 of 10 grounded prompts).
pub const RECENT_ANSWER_DECAY: f64 = 0.6;

/// What a drafter's recent sequences emitted: how many tokens, and how many of them a lookup draft
/// had right (drafted and accepted, or would have been where the round drafted otherwise). A
/// prompt's reading by the draft model pays only through the tokens the model drafts for, which a
/// short answer, or one the lookup copies from the prompt, leaves few of (stop 55: questions on a
/// given passage, answers mostly of 18–60 tokens, where the hybrid's reading of the prompt made it
/// as slow end to end as plain decoding and 1.28 times as slow as the lookup alone).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RecentAnswers {
    /// `(emitted, covered)` per answer, oldest first.
    answers: std::collections::VecDeque<(usize, usize)>,
}

impl RecentAnswers {
    /// A finished answer of `emitted` tokens, `covered` of them a lookup draft had right (at most
    /// `emitted`). An empty answer is not one.
    pub fn record(&mut self, emitted: usize, covered: usize) {
        if emitted == 0 {
            return;
        }
        if self.answers.len() == RECENT_ANSWERS {
            self.answers.pop_front();
        }
        self.answers.push_back((emitted, covered.min(emitted)));
    }

    /// Answers recorded (at most [`RECENT_ANSWERS`]).
    pub fn len(&self) -> usize {
        self.answers.len()
    }

    /// Whether none is recorded.
    pub fn is_empty(&self) -> bool {
        self.answers.is_empty()
    }

    /// The answers with their weights, newest first: [`RECENT_ANSWER_DECAY`] to the power of
    /// their age.
    fn weighted(&self) -> impl Iterator<Item = (f64, usize, usize)> + '_ {
        self.answers.iter().rev().scan(1.0, |w, &(n, c)| {
            let item = (*w, n, c);
            *w *= RECENT_ANSWER_DECAY;
            Some(item)
        })
    }

    /// The tokens a sequence that may emit `remaining` more is expected to emit: the weighted mean
    /// of the recent answers' lengths, each cut at `remaining`; `remaining` without any.
    pub fn expected_len(&self, remaining: usize) -> f64 {
        let (sum, weight) = self.weighted().fold((0.0, 0.0), |(s, t), (w, n, _)| {
            (s + w * n.min(remaining) as f64, t + w)
        });
        if weight > 0.0 {
            sum / weight
        } else {
            remaining as f64
        }
    }

    /// The weighted share of the recent answers' tokens that lookup drafts had right (0 without
    /// any).
    pub fn coverage(&self) -> f64 {
        let (n, c) = self.weighted().fold((0.0, 0.0), |(n, c), (w, e, v)| {
            (n + w * e as f64, c + w * v as f64)
        });
        if n > 0.0 {
            c / n
        } else {
            0.0
        }
    }

    /// The tokens a model is expected to draft for in a sequence that may emit `remaining` more:
    /// [`RecentAnswers::expected_len`] less the [`RecentAnswers::coverage`] share of it.
    pub fn model_tokens(&self, remaining: usize) -> f64 {
        self.expected_len(remaining) * (1.0 - self.coverage())
    }
}

/// The answers of sequences as they run, for [`RecentAnswers`]: each one's prompt length and
/// committed length, recorded (none covered by a lookup) when it ends or its id starts again.
#[derive(Clone, Debug, Default)]
pub struct AnswerLengths {
    /// Per running sequence: its prompt's length and its committed length.
    lens: std::collections::HashMap<SeqId, (usize, usize)>,
    answers: RecentAnswers,
}

impl AnswerLengths {
    /// `seq` starts with a prompt of `prompt_len` tokens; the answer it held before (a caller
    /// that reuses the id, like [`crate::generate`] for chat turns) is recorded.
    pub fn start(&mut self, seq: SeqId, prompt_len: usize) {
        if let Some((p, n)) = self.lens.insert(seq, (prompt_len, prompt_len)) {
            self.answers.record(n.saturating_sub(p), 0);
        }
    }

    /// `seq`'s context is `len` tokens long now (nothing for a sequence not started).
    pub fn committed(&mut self, seq: SeqId, len: usize) {
        if let Some(lens) = self.lens.get_mut(&seq) {
            lens.1 = len;
        }
    }

    /// `seq` is over: its answer is recorded (nothing for a sequence not started).
    pub fn finish(&mut self, seq: SeqId) {
        if let Some((p, n)) = self.lens.remove(&seq) {
            self.answers.record(n.saturating_sub(p), 0);
        }
    }

    /// The finished answers.
    pub fn answers(&self) -> &RecentAnswers {
        &self.answers
    }
}

/// The drafter that proposes nothing: plain autoregressive decoding with the target, through the same
/// decode loop as speculation. The baseline of every speedup.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoDraft;

impl Draft for NoDraft {
    type Error = std::convert::Infallible;

    fn vocab_size(&self) -> Option<usize> {
        None
    }

    fn propose(
        &mut self,
        _batch: &[DraftRequest<'_>],
        out: &mut [Proposal],
    ) -> Result<(), Self::Error> {
        out.iter_mut().for_each(Proposal::clear);
        Ok(())
    }

    fn commit(&mut self, _seq: SeqId, _committed: &[TokenId]) -> Result<(), Self::Error> {
        Ok(())
    }

    fn model_drafts(&self, _seq: SeqId) -> bool {
        false
    }
}

impl<T: Target + ?Sized> Target for &mut T {
    type Error = T::Error;

    fn vocab_size(&self) -> usize {
        (**self).vocab_size()
    }

    fn capacity(&self) -> usize {
        (**self).capacity()
    }

    fn score(&mut self, batch: &[Score<'_>], out: &mut [Logits]) -> Result<(), Self::Error> {
        (**self).score(batch, out)
    }

    fn commit(&mut self, seq: SeqId, committed: &[TokenId]) -> Result<(), Self::Error> {
        (**self).commit(seq, committed)
    }

    fn release(&mut self, seq: SeqId) {
        (**self).release(seq)
    }

    fn cached(&self, seq: SeqId, context: &[TokenId]) -> usize {
        (**self).cached(seq, context)
    }

    fn claim(&mut self, seq: SeqId, context: &[TokenId]) -> Result<usize, Self::Error> {
        (**self).claim(seq, context)
    }

    fn min_prefix_copy(&self) -> Option<usize> {
        (**self).min_prefix_copy()
    }
}

impl<D: Draft + ?Sized> Draft for &mut D {
    type Error = D::Error;

    fn vocab_size(&self) -> Option<usize> {
        (**self).vocab_size()
    }

    fn propose(
        &mut self,
        batch: &[DraftRequest<'_>],
        out: &mut [Proposal],
    ) -> Result<(), Self::Error> {
        (**self).propose(batch, out)
    }

    fn commit(&mut self, seq: SeqId, committed: &[TokenId]) -> Result<(), Self::Error> {
        (**self).commit(seq, committed)
    }

    fn truncated(&mut self, seq: SeqId, len: usize) {
        (**self).truncated(seq, len)
    }

    fn prefill(&mut self, seq: SeqId, context: &[TokenId]) -> Result<(), Self::Error> {
        (**self).prefill(seq, context)
    }

    fn prefill_priced(&mut self, req: &PrefillRequest<'_>) -> Result<(), Self::Error> {
        (**self).prefill_priced(req)
    }

    fn cached(&self, seq: SeqId, context: &[TokenId]) -> usize {
        (**self).cached(seq, context)
    }

    fn model_drafts(&self, seq: SeqId) -> bool {
        (**self).model_drafts(seq)
    }

    fn release(&mut self, seq: SeqId) {
        (**self).release(seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_savings_settle_each_model_round_against_what_the_round_would_have_done() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        let (a, b, never) = (SeqId(1), SeqId(2), SeqId(3));
        let mut s = ReadSavings::default();
        assert_eq!(s.saved_per_token(), None);
        s.read(a, 100);
        // A model round after 100 tokens at 1.5 steps against plain decoding (1 token a step):
        // 3 tokens emitted save 1.5 steps.
        s.drafted(a, 100, 4, 1.5, 1.0);
        s.committed(a, 103);
        // A round without the model: its tokens count, nothing saved.
        s.committed(a, 104);
        // A model round against a lookup draft of 2 tokens a step: 2 tokens emitted, worth 1
        // step, cost 1.5: half a step lost.
        s.drafted(a, 104, 3, 1.5, 2.0);
        s.committed(a, 106);
        // A sequence never read is not accounted.
        s.drafted(never, 0, 1, 1.0, 1.0);
        s.committed(never, 50);
        s.finish(never);
        s.finish(a);
        assert_eq!(s.len(), 1);
        assert!(close(s.saved_per_token().unwrap_or(f64::NAN), 1.0 / 6.0));
        // A newer answer weighs more: 2 tokens at a loss of 2.5 steps.
        s.read(b, 10);
        s.drafted(b, 10, 8, 3.5, 1.0);
        s.committed(b, 11);
        s.committed(b, 12);
        s.finish(b);
        let w = RECENT_ANSWER_DECAY;
        let expected = (-2.5 + w * 1.0) / (2.0 + w * 6.0);
        assert!(close(s.saved_per_token().unwrap_or(f64::NAN), expected));
        // A round emits at most its draft and one token: committing more at once (a chat turn's
        // next prompt) settles it for 2 + 1 tokens, 3 steps at 2 steps' cost.
        s.read(a, 0);
        s.drafted(a, 0, 2, 2.0, 1.0);
        s.committed(a, 50);
        s.finish(a);
        let expected = (1.0 + w * -2.5 + w * w * 1.0) / (50.0 + w * 2.0 + w * w * 6.0);
        assert!(close(s.saved_per_token().unwrap_or(f64::NAN), expected));
        // An answer of no tokens is not one.
        s.read(a, 5);
        s.finish(a);
        assert_eq!(s.len(), 3);
    }

    #[test]
    fn measured_savings_price_a_prompt_in_place_of_the_prediction() {
        let costs = crate::mock::reading_costs();
        let prompt: Vec<TokenId> = (0..100).collect();
        let req = PrefillRequest {
            seq: SeqId(0),
            prompt: &prompt,
            remaining: 1_000,
            costs: Some(&costs),
        };
        // 100 tokens at 0.05 are 5 steps; predicted, a third of a step a token repays them.
        let mut recent = RecentAnswers::default();
        recent.record(100, 0);
        let mut saved = ReadSavings::default();
        assert!(req.read_pays(0, &recent, &saved));
        // Measured: an answer of 100 tokens whose model rounds saved 4 steps in all.
        saved.read(SeqId(1), 100);
        saved.drafted(SeqId(1), 100, 4, 1.0, 1.0);
        saved.committed(SeqId(1), 105);
        saved.committed(SeqId(1), 200);
        saved.finish(SeqId(1));
        assert!(!req.read_pays(0, &recent, &saved));
        // 20 of the prompt's tokens unread: 1 step, within 4.
        assert!(req.read_pays(80, &recent, &saved));
        // Without prices the prompt is read.
        let unpriced = PrefillRequest { costs: None, ..req };
        assert!(unpriced.read_pays(0, &recent, &saved));
    }

    #[test]
    fn recent_answers_expect_their_mean_length_cut_at_the_limit_less_what_lookup_drafts() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        let mut a = RecentAnswers::default();
        // Nothing seen: the whole limit, none of it covered.
        assert_eq!(a.expected_len(128), 128.0);
        assert_eq!(a.model_tokens(128), 128.0);
        a.record(20, 5);
        a.record(200, 45);
        a.record(0, 0);
        assert_eq!(a.len(), 2);
        // 200 (cut at 128) and, one answer older, 20.
        let d = RECENT_ANSWER_DECAY;
        let len = (128.0 + d * 20.0) / (1.0 + d);
        assert!(close(a.expected_len(128), len));
        assert!(close(a.expected_len(10), 10.0));
        let coverage = (45.0 + d * 5.0) / (200.0 + d * 20.0);
        assert!(close(a.coverage(), coverage));
        assert!(close(a.model_tokens(128), len * (1.0 - coverage)));
        // Covered tokens past the answer's length count as the answer.
        a.record(10, 99);
        assert!(close(
            a.coverage(),
            (10.0 + d * 45.0 + d * d * 5.0) / (10.0 + d * 200.0 + d * d * 20.0)
        ));
        // The oldest are dropped, and the newest weigh most.
        for _ in 0..RECENT_ANSWERS {
            a.record(40, 0);
        }
        assert_eq!(a.len(), RECENT_ANSWERS);
        assert!(close(a.expected_len(128), 40.0));
        assert_eq!(a.coverage(), 0.0);
        a.record(100, 100);
        assert!(a.expected_len(128) > 60.0 && a.coverage() > 0.6, "{a:?}");
    }
}
