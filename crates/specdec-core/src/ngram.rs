//! Model-free drafting: plain prompt lookup over the committed context, and a hybrid of the learning
//! lookup ([`LookupDrafter`]) and a model drafter.

use crate::lookup::LookupDrafter;
use crate::model::{
    Draft, DraftRequest, PrefillRequest, Proposal, ReadSavings, RecentAnswers, SeqId,
};
use crate::policy::{RoundCosts, PAY_MARGIN};
use crate::rng::CounterRng;
use crate::sampling::{Probs, SamplingParams};
use crate::TokenId;
use std::collections::{HashMap, HashSet};

/// Prompt lookup (n-gram) drafting: find the most recent earlier occurrence of the context's last `n`
/// tokens, for `n` from `max_n` down to `min_n`, and propose the tokens that followed it, one-hot.
/// Costs microseconds, and pays on inputs that repeat themselves (code edits, quoting, summaries).
/// The simple baseline of [`LookupDrafter`], which also searches earlier outputs, votes among all
/// occurrences and estimates its acceptance. Drafts [`DraftRequest::model_len`] tokens at most.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NGramDrafter {
    /// Shortest suffix to match.
    pub min_n: usize,
    /// Longest suffix to match.
    pub max_n: usize,
}

impl Default for NGramDrafter {
    fn default() -> Self {
        Self { min_n: 2, max_n: 4 }
    }
}

impl NGramDrafter {
    /// The continuation of the longest matching suffix, at most `max_len` tokens.
    pub fn lookup<'a>(&self, ctx: &'a [TokenId], max_len: usize) -> &'a [TokenId] {
        let len = ctx.len();
        for n in (self.min_n.max(1)..=self.max_n).rev() {
            if n >= len {
                continue;
            }
            let suffix = &ctx[len - n..];
            // Most recent earlier occurrence that has at least one token after it.
            let hit = (0..len - n).rev().find(|&i| &ctx[i..i + n] == suffix);
            if let Some(i) = hit {
                let start = i + n;
                return &ctx[start..(start + max_len).min(len)];
            }
        }
        &[]
    }
}

impl Draft for NGramDrafter {
    type Error = std::convert::Infallible;

    fn vocab_size(&self) -> Option<usize> {
        None
    }

    fn propose(
        &mut self,
        batch: &[DraftRequest<'_>],
        out: &mut [Proposal],
    ) -> Result<(), Self::Error> {
        for (req, out) in batch.iter().zip(out) {
            out.clear();
            for &t in self.lookup(req.context, req.model_len()) {
                out.push(t, Probs::OneHot(t));
            }
        }
        Ok(())
    }

    fn commit(&mut self, _seq: SeqId, _committed: &[TokenId]) -> Result<(), Self::Error> {
        Ok(())
    }

    fn model_drafts(&self, _seq: SeqId) -> bool {
        false
    }
}

/// Lookup, a model draft, or the lookup draft extended by the model, whichever pays more this round
/// ([`plan_hybrid`]).
///
/// The model reads the prompt at prefill, unless the cost model says that reading it cannot pay
/// for itself within the tokens the sequence is expected to emit that the lookup is not expected
/// to draft ([`RoundCosts::prompt_read_pays`], [`LookupDrafter::recent_answers`], through
/// [`Draft::prefill_priced`]; after [`crate::READ_PROBE_AFTER`] prompts left unread in a row, or
/// after an answer left unread that calls for measuring again ([`LookupSavings::finish`]), it
/// reads the next whatever its price): the sequence is then drafted by the lookup alone until the savings
/// the model's drafts were expected to bring in its rounds since reach the price of reading what
/// it has not read ([`forgone`]), if the tokens left can still repay it ([`DeferredReads`]), and
/// the model then reads it, as a catch-up, in the next round without a lookup draft. Once it has
/// measured what the model's rounds saved in answers whose prompt it read ([`ReadSavings`]), that
/// measure prices the reading in place of the prediction:
/// each model round is settled against the lookup alone replayed over the tokens the round emitted
/// ([`LookupSavings`]), which after the round's first token may have copied the rest.
#[derive(Debug)]
pub struct HybridDrafter<D> {
    /// The lookup drafter.
    pub lookup: LookupDrafter,
    /// The model drafter.
    pub model: D,
    lag: ModelLag,
    /// Sequences whose prompt the model did not read, drafted by the lookup alone until it is due.
    reads: DeferredReads,
    /// What the model's rounds saved in the sequences whose prompt it read.
    savings: LookupSavings,
    /// Prompts left unread at prefill in a row since the last one read there.
    unread_in_a_row: usize,
}

/// What a hybrid's model rounds saved, in target steps, in the sequences whose prompt the model
/// read, against the lookup alone: a [`ReadSavings`] whose rounds are each settled by replaying the
/// lookup over the tokens the round emitted (`lookup_replay_steps`), with the lookup's coverage of
/// the answers the measure was taken on, which says when an answer left unread is of another kind
/// ([`LookupSavings::finish`]). Kept by [`HybridDrafter`] and by a server's drafter for its hybrid
/// requests.
#[derive(Debug, Default)]
pub struct LookupSavings {
    savings: ReadSavings,
    /// Per sequence, its model round awaiting the target's verdict.
    replays: HashMap<SeqId, Replay>,
    /// The answers the measure was taken on, with the tokens the lookup had right in each (over
    /// the whole answer; a reading deferred into it measures only the tokens after it).
    measured: RecentAnswers,
    /// The same answers, those of [`EARLY_LOOK_TOKENS`] or more, as they were at an early look
    /// ([`LookupDrafter::early_answer`]): an answer's first tokens are covered less than the
    /// whole (its first is never covered).
    measured_early: RecentAnswers,
    /// The next prompt is to be read whatever its price, to measure again: an answer left unread
    /// called for it ([`LookupSavings::answer_over`]), or the early look at one found it unlike
    /// the measured ones ([`DeferredReads::look_early_at`]; since stop 73). One flag for
    /// [`HybridDrafter`] and the server's drafter alike (since stop 74; each kept its own).
    remeasure: bool,
}

impl LookupSavings {
    /// The measure, which prices a prompt's reading ([`PrefillRequest::read_pays`]).
    pub fn savings(&self) -> &ReadSavings {
        &self.savings
    }

    /// The model read the sequence's first `len` tokens ([`ReadSavings::read`]).
    pub fn read(&mut self, seq: SeqId, len: usize) {
        self.savings.read(seq, len);
    }

    /// A round of `req` whose draft `out` the model made in whole or in part (`plan` is not
    /// [`HybridPlan::Lookup`]): priced from the cost model (its drafting, a catch-up included,
    /// and the target's scoring of the whole draft), to be settled at [`LookupSavings::committed`].
    /// A round that reads the prompt (the sequence not open yet: a due read, or a model that reads
    /// it at its first round) opens the account and is not charged for that reading, which is
    /// the price the account is weighed against.
    pub fn drafted(&mut self, req: &DraftRequest<'_>, out: &Proposal, plan: HybridPlan) {
        if plan == HybridPlan::Lookup {
            return;
        }
        let reads_prompt = !self.savings.is_open(req.seq);
        self.savings.read(req.seq, req.context.len());
        let Some(c) = req.costs else {
            return;
        };
        let len = out.tokens.len();
        let lag = if reads_prompt { 0 } else { out.lag };
        let cost = match plan {
            HybridPlan::Extend(_) => {
                c.extension_draft_cost(lag, len - out.extension, out.extension) + c.r(len + 1)
            }
            // The model's tokens are a continued draft's prefix, or the whole draft.
            _ => {
                let model_tokens = if out.prefix > 0 { out.prefix } else { len };
                c.model_round_steps(model_tokens, len, lag)
            }
        };
        // Plain decoding's rate settles the round only where the replay has nothing to go by.
        self.savings
            .drafted(req.seq, req.context.len(), len, cost, 1.0 / c.r(1));
        self.replays.insert(
            req.seq,
            Replay {
                at: req.context.len(),
                most: len + 1,
                max_len: req.max_len,
                costs: c.clone(),
                stop_tokens: req.stop_tokens.to_vec(),
                sampling: req.sampling.clone(),
                rng: req.rng,
            },
        );
    }

    /// The target committed `committed` for `seq`: a pending model round is settled against the
    /// lookup replayed over what it emitted. Called before `lookup` learns from the commit.
    pub fn committed(&mut self, lookup: &mut LookupDrafter, seq: SeqId, committed: &[TokenId]) {
        match self
            .replays
            .remove(&seq)
            .and_then(|r| lookup_replay_steps(lookup, seq, &r, committed))
        {
            Some(steps) => self.savings.committed_against(seq, committed.len(), steps),
            None => self.savings.committed(seq, committed.len()),
        }
    }

    /// The pending model round's draft is cut to `len` tokens before the target scores it (a
    /// batch's trim of what reads as a lookup draft: a round the model was to extend and did not):
    /// it is repriced for the rows it lost, and replayed over what the shorter draft can emit.
    pub fn truncated(&mut self, seq: SeqId, len: usize) {
        let Some(r) = self.replays.get_mut(&seq) else {
            return;
        };
        if len + 1 >= r.most {
            return;
        }
        let cheaper = r.costs.r(r.most) - r.costs.r(len + 1);
        r.most = len + 1;
        self.savings.truncated(seq, len, cheaper);
    }

    /// The sequence's answer is over (it is released, or its id starts a new prompt): its account
    /// is closed ([`LookupSavings::finish`], with the answer as `lookup` holds it and whether
    /// `reads` says its rounds forwent the price of reading its prompt), and the next prompt is to
    /// be read whatever its price where the answer calls for it
    /// ([`LookupSavings::take_remeasure`]). Called before the lookup records the answer.
    pub fn answer_over(&mut self, seq: SeqId, lookup: &LookupDrafter, reads: &DeferredReads) {
        let (answer, early) = (lookup.answer(seq), lookup.early_answer(seq));
        let forwent = reads.forwent_its_price(seq);
        self.remeasure |= self.finish(seq, answer, early, forwent);
    }

    /// Whether the next prompt is to be read whatever its price, to measure again (an answer
    /// over, [`LookupSavings::answer_over`], or an early look, [`DeferredReads::look_early_at`],
    /// called for it); asking clears it, as a prompt's prefill does, read or not.
    pub fn take_remeasure(&mut self) -> bool {
        std::mem::take(&mut self.remeasure)
    }

    /// The sequence is over, or its id starts a new prompt ([`ReadSavings::finish`]), with
    /// `answer` its tokens and those the lookup had right ([`LookupDrafter::answer`]), `early` the
    /// same at its early look ([`LookupDrafter::early_answer`], recorded with a measured answer
    /// for [`LookupSavings::unlike_measured_early`]), and `forwent` whether, its prompt left
    /// unread, its rounds forwent the price of reading it, or it was due and never read
    /// ([`DeferredReads::forwent_its_price`]). Returns whether the next prompt is to be read
    /// whatever its price, to measure again: where an answer left unread, whose rounds forwent
    /// that price, was covered by the lookup less than [`REMEASURE_COVERAGE`] times as much as
    /// the answers the measure was taken on, the measure is of another kind of answer. Without a
    /// measure there is nothing to doubt: the prediction that prices a reading then already
    /// follows the coverage of every recent answer, read or not.
    #[must_use]
    pub fn finish(
        &mut self,
        seq: SeqId,
        answer: Option<(usize, usize)>,
        early: Option<(usize, usize)>,
        forwent: bool,
    ) -> bool {
        self.replays.remove(&seq);
        let recorded = self.savings.finish(seq);
        let Some((emitted, covered)) = answer.filter(|a| a.0 > 0) else {
            return false;
        };
        if recorded {
            self.measured.record(emitted, covered);
            if let Some((emitted, covered)) = early {
                self.measured_early.record(emitted, covered);
            }
            return false;
        }
        forwent && self.unlike(&self.measured, (emitted, covered))
    }

    /// Whether an answer so far, at its early look (its tokens, and those the lookup had right:
    /// [`LookupDrafter::early_answer`]), was covered by the lookup less than
    /// [`REMEASURE_COVERAGE`] times as much as the answers the measure was taken on were at
    /// theirs: the measure then is of another kind of answer ([`DeferredReads::look_early`]).
    /// Weighed against the measured answers' whole coverage instead, every answer's first tokens
    /// read as less covered than they are. False without a measure, or for an empty answer.
    pub fn unlike_measured_early(&self, answer: (usize, usize)) -> bool {
        self.unlike(&self.measured_early, answer)
    }

    /// Whether `(emitted, covered)` was covered less than [`REMEASURE_COVERAGE`] times as much
    /// as `measured`, with a measure taken.
    fn unlike(&self, measured: &RecentAnswers, (emitted, covered): (usize, usize)) -> bool {
        emitted > 0
            && self.savings.saved_per_token().is_some()
            && !measured.is_empty()
            && (covered as f64) < REMEASURE_COVERAGE * measured.coverage() * emitted as f64
    }
}

/// An answer left unread calls for the next prompt's reading whatever its price
/// ([`LookupSavings::finish`]) where the share of it that the lookup had right is below this
/// times the share in the answers the hybrid's measure was taken on. That measure, of what the
/// model's rounds save, is taken only on answers whose prompt the model read, and it differs
/// between kinds of answer, most with how much of them the lookup copies. In stop 70's runs at
/// temperature 0.7, after questions and summaries had measured 0.005 steps saved a token, four of
/// five translations were left unread and decoded at 1.04–1.10 times plain decoding (read, they
/// ran at 1.20–1.52 times); in its greedy runs the lookup alone had right 38–78% of a summary's
/// tokens and 3–37% (median 10%) of a translation's. Replayed over stop 70's greedy run
/// (`decode_replay`, whose decisions vary with the lookup's timing), stop 70's code decoded the
/// translations at 1.01–1.15× in 5 of 20 replays, leaving most of them unread, at 1.23–1.28× in
/// 2 and at 1.31–1.39× in 13; with this rule, at 1.31–1.39× in all 20.
pub const REMEASURE_COVERAGE: f64 = 0.5;

/// The tokens an answer left unread has emitted when [`DeferredReads::look_early`] looks at how
/// much of it the lookup covered: early, so that a reading then can still be repaid, and late
/// enough that its coverage says something. Replayed over stop 70's greedy run (`decode_replay`,
/// hybrid; each figure the median over five prompts, its range over the replays), stop 71's code
/// decoded the summaries at 1.72–1.79× and the translations at 1.32–1.39× (six replays); looking
/// at 16 tokens, 2.00–2.01× and 1.32–1.41× (six; the unread `summarize/threads` and
/// `translate/kv-cache` read at their look, 1.79 → 2.00× and 1.21 → 1.36×); at 8, 1.72–1.75×
/// and 1.38–1.43×, code edits 0.05 slower (three); at 32, 1.79× and 1.32× (three). Those weighed
/// the answer so far against the measured answers' whole coverage, which an answer's first
/// tokens fall short of (its first is never covered: at 16 tokens the replay's unread summaries
/// were covered 12–60%, against 37–59% for the whole measured answers), and of the four summaries
/// read after their prefill in the measured runs (at the look or by the rounds' forgone price,
/// one greedy and three at temperature 0.7), three decoded slower than the same prompt in stop
/// 71's paired run; weighed against the measured answers' own early looks
/// ([`LookupSavings::unlike_measured_early`], the final rule), 1.93–2.01× and 1.32–1.41× (six).
pub const EARLY_LOOK_TOKENS: usize = 16;

/// A model round of a sequence whose prompt the model read, to be replayed by the lookup alone
/// once the target has committed what it emitted ([`lookup_replay_steps`]): the request's parts
/// that the lookup's drafts depend on.
#[derive(Debug)]
struct Replay {
    /// The committed length the round drafted after.
    at: usize,
    /// The most tokens the round can emit (its draft and the target's token after it).
    most: usize,
    max_len: usize,
    costs: RoundCosts,
    stop_tokens: Vec<TokenId>,
    sampling: SamplingParams,
    rng: CounterRng,
}

/// What the lookup alone would have paid, in target steps, to emit `committed[at..end]`, the
/// tokens a model round emitted, where `end` is the committed length or `at + most`, whichever is
/// less: its drafts are replayed round after round from `at` (each cut where it pays best, as the
/// lookup drafter alone cuts it, [`RoundCosts::best_free_len`]), each emitting the tokens it had
/// right and the target's token after them at `r(len + 1)` steps, the last charged only for its
/// share of the tokens up to `end`. The model's rounds are where the lookup had nothing or less,
/// but after their first token the lookup may copy the rest: stop 58's measure, which priced all of
/// a round's tokens at the round's own alternative (plain decoding, mostly), had the hybrid read
/// 8 of 10 code-editing prompts and decode them no faster than the lookup alone (2.25 against
/// 2.32), 1.50 against 1.73 times plain decoding end to end. Exact for greedy decoding; sampled,
/// a one-token draft's token is accepted with the probability that the target draws it, so the
/// replay against the drawn tokens is an estimate of the same. `None` where nothing was emitted.
fn lookup_replay_steps(
    lookup: &mut LookupDrafter,
    seq: SeqId,
    replay: &Replay,
    committed: &[TokenId],
) -> Option<f64> {
    let end = committed.len().min(replay.at + replay.most);
    if end <= replay.at {
        return None;
    }
    let (mut pos, mut steps) = (replay.at, 0.0);
    let mut draft = Proposal::default();
    while pos < end {
        let req = DraftRequest {
            seq,
            context: &committed[..pos],
            max_len: replay.max_len,
            sampling: &replay.sampling,
            rng: replay.rng,
            min_confidence: 0.0,
            costs: Some(&replay.costs),
            stop_tokens: &replay.stop_tokens,
        };
        lookup.continuation(&req, &mut draft);
        let ends = draft.ends_at(&replay.stop_tokens);
        let (len, _) = replay.costs.best_free_len(&draft.confidence, ends);
        let right = draft.tokens[..len.min(draft.tokens.len())]
            .iter()
            .zip(&committed[pos..])
            .take_while(|(d, c)| d == c)
            .count();
        let emitted = right + 1;
        let share = (end - pos).min(emitted) as f64 / emitted as f64;
        steps += share * replay.costs.r(len + 1);
        pos += emitted;
    }
    Some(steps)
}

impl<D> HybridDrafter<D> {
    /// Drafts with `lookup` and `model`.
    pub fn new(lookup: LookupDrafter, model: D) -> Self {
        Self {
            lookup,
            model,
            lag: ModelLag::default(),
            reads: DeferredReads::default(),
            savings: LookupSavings::default(),
            unread_in_a_row: 0,
        }
    }

    /// What the model's rounds saved in recent answers whose prompt it read, which prices the
    /// next prompt's reading ([`Draft::prefill_priced`]).
    pub fn read_savings(&self) -> &ReadSavings {
        self.savings.savings()
    }

    /// Whether the model left the sequence's prompt unread ([`Draft::prefill_priced`]), so that
    /// the lookup alone drafts for it.
    pub fn left_unread(&self, seq: SeqId) -> bool {
        self.reads.is_unread(seq)
    }

    /// The sequence's answer is over ([`LookupSavings::answer_over`]).
    fn answer_over(&mut self, seq: SeqId) {
        self.savings.answer_over(seq, &self.lookup, &self.reads);
    }
}

/// What a hybrid's model has read of each sequence, so that a model draft can be priced with the
/// catch-up it pays after lookup rounds ([`crate::Proposal::lag`]).
#[derive(Debug, Default)]
pub struct ModelLag {
    /// Per sequence: the context length the model last drafted from, and the tokens it then drafted
    /// (all but the last of which it read).
    read: HashMap<SeqId, (usize, Vec<TokenId>)>,
}

impl ModelLag {
    /// The model has read the first `len` tokens of the sequence.
    pub fn prefill(&mut self, seq: SeqId, len: usize) {
        self.read.insert(seq, (len, Vec::new()));
    }

    /// How many tokens of `context` the model has not read (all of them for an unknown sequence).
    pub fn lag(&self, seq: SeqId, context: &[TokenId]) -> usize {
        let Some((len, drafted)) = self.read.get(&seq) else {
            return context.len();
        };
        let fed = &drafted[..drafted.len().saturating_sub(1)];
        let kept = context
            .get(*len..)
            .unwrap_or_default()
            .iter()
            .zip(fed)
            .take_while(|(a, b)| a == b)
            .count();
        context.len().saturating_sub(len + kept)
    }

    /// The model drafted `drafted` after the first `len` tokens of the sequence.
    fn drafted(&mut self, seq: SeqId, len: usize, drafted: &[TokenId]) {
        let entry = self.read.entry(seq).or_default();
        entry.0 = len;
        entry.1.clear();
        entry.1.extend_from_slice(drafted);
    }

    /// The sequence is finished.
    pub fn release(&mut self, seq: SeqId) {
        self.read.remove(&seq);
    }
}

/// The sequences whose prompt a hybrid's model left unread ([`Draft::prefill_priced`]), and the
/// ski-rental rule that reads it after all: each round adds what it forwent ([`forgone`]), and once
/// the sum reaches the price of reading what the model does not hold, the prompt is due, read by
/// the model as the catch-up of its next draft (forced at the next round without a lookup draft),
/// if the tokens the sequence may still emit can repay that price at the rate its rounds forwent
/// savings so far (the rule's horizon, since stop 65; else it stays unread). Since stop 72 an
/// early look at the answer can make it due sooner ([`DeferredReads::look_early`]).
/// Both [`HybridDrafter`] and the server's drafter plan their rounds through it.
#[derive(Debug, Default)]
pub struct DeferredReads {
    /// Sequences whose prompt is unread, with the savings forgone in their rounds since.
    unread: HashMap<SeqId, Unread>,
    /// Sequences whose prompt is read after all, at their next round that calls the model.
    due: HashSet<SeqId>,
}

impl DeferredReads {
    /// The model leaves the prompt of `req`'s sequence unread: its rounds go to the lookup alone
    /// until they forgo the price of reading it, if the tokens the sequence may still emit then
    /// can repay it ([`DeferredReads::plan`]).
    pub fn leave_unread(&mut self, req: &PrefillRequest<'_>) {
        self.due.remove(&req.seq);
        self.unread.insert(
            req.seq,
            Unread {
                saved: 0.0,
                remaining: req.remaining,
                start: None,
                first_price: None,
                looked: false,
            },
        );
    }

    /// Looks once at the answer of a sequence whose prompt is unread, at its first round after
    /// the answer reached [`EARLY_LOOK_TOKENS`] tokens (`early`: the answer as it was then,
    /// [`LookupDrafter::early_answer`]; `emitted`: its tokens now): where the lookup covered it
    /// far less than the answers that `savings` was measured on at the same point
    /// ([`LookupSavings::unlike_measured_early`]), the measure that left the prompt unread is of
    /// another kind of answer, and the prompt is due now, if the sequence may still emit at least
    /// as many tokens as it has (most of the answer is then still to come; else it stays unread,
    /// as the ski-rental rule's horizon would keep it). The look is spent whatever it finds, also
    /// where there is no measure yet to doubt. Returns whether the prompt became due.
    pub fn look_early(
        &mut self,
        seq: SeqId,
        early: Option<(usize, usize)>,
        emitted: usize,
        savings: &LookupSavings,
    ) -> bool {
        let (Some(u), Some(early)) = (self.unread.get_mut(&seq), early) else {
            return false;
        };
        if u.looked {
            return false;
        }
        u.looked = true;
        let left = u.remaining.saturating_sub(emitted);
        if left < emitted || !savings.unlike_measured_early(early) {
            return false;
        }
        self.unread.remove(&seq);
        self.due.insert(seq);
        true
    }

    /// [`DeferredReads::look_early`] with the answer as `lookup` holds it
    /// ([`LookupDrafter::early_answer`], [`LookupDrafter::answer`]), read only for a sequence
    /// whose prompt is unread and not yet looked at: the one call a drafter makes each round.
    /// A look that makes the prompt due also has the next prompt read whatever its price
    /// ([`LookupSavings::take_remeasure`], since stop 73): it is likely of the same kind, and the
    /// measure that would price its reading holds at most one answer of that kind, measured from
    /// its look on.
    pub fn look_early_at(
        &mut self,
        seq: SeqId,
        lookup: &LookupDrafter,
        savings: &mut LookupSavings,
    ) {
        if self.unread.get(&seq).is_none_or(|u| u.looked) {
            return;
        }
        let emitted = lookup.answer(seq).map_or(0, |a| a.0);
        if self.look_early(seq, lookup.early_answer(seq), emitted, savings) {
            savings.remeasure = true;
        }
    }

    /// Whether the sequence's prompt is unread, and its rounds forwent the price that reading
    /// what the model did not hold had at the first of them: the reading would have paid, as the
    /// cost model priced the rounds, had it been made at the start ([`LookupSavings::finish`]).
    /// A prompt due and not read yet counts too (since stop 72): it became due for the same
    /// reason, or because its answer was unlike the measured ones
    /// ([`DeferredReads::look_early`]).
    pub fn forwent_its_price(&self, seq: SeqId) -> bool {
        self.due.contains(&seq)
            || self
                .unread
                .get(&seq)
                .is_some_and(|u| u.first_price.is_some_and(|p| u.saved >= p))
    }

    /// Whether the sequence's prompt is unread and not yet due.
    pub fn is_unread(&self, seq: SeqId) -> bool {
        self.unread.contains_key(&seq)
    }

    /// Whether the sequence's prompt is due: to be read by its next round that calls the model.
    pub fn is_due(&self, seq: SeqId) -> bool {
        self.due.contains(&seq)
    }

    /// The plan of one round of `req`, after the lookup proposed `lookup` at `lookup_rate`
    /// ([`LookupDrafter::propose_one`]): for an unread prompt, [`HybridPlan::Lookup`] until the
    /// rounds since forwent the price of reading what the model does not hold (`cached`, asked
    /// only then) and the tokens the sequence may still emit can repay it at the rate its rounds
    /// forwent savings per token so far; for a due one, [`HybridPlan::Model`] where the lookup has
    /// no draft and the costs allow a model draft; otherwise `plan`. Any plan that calls the model
    /// reads what it has not read, so it clears the prompt's due read.
    pub fn plan(
        &mut self,
        req: &DraftRequest<'_>,
        lookup: &Proposal,
        lookup_rate: f64,
        cached: impl FnOnce() -> usize,
        plan: impl FnOnce() -> HybridPlan,
    ) -> HybridPlan {
        if let Some(u) = self.unread.get_mut(&req.seq) {
            let Some(c) = req.costs else {
                return HybridPlan::Lookup;
            };
            u.saved += forgone(c, lookup, lookup_rate);
            // The start is taken at the first round: a decode loop reads the prompt once the
            // first token is out, so the context then may hold tokens the prompt did not.
            let len = req.context.len();
            u.start.get_or_insert(len);
            let unread = len.saturating_sub(cached());
            let price = c.prompt_read * unread as f64;
            u.first_price.get_or_insert(price);
            // A price that is not a number is never reached.
            let due = u.saved >= price && u.repays(len, price);
            if !due {
                return HybridPlan::Lookup;
            }
            self.unread.remove(&req.seq);
            self.due.insert(req.seq);
        }
        // The reading was paid for by the rounds before, so a model draft then reads the context,
        // as its catch-up, whatever that costs; the round's prediction includes it, so the
        // model's realised rate is judged fairly.
        let read_now = lookup.tokens.is_empty()
            && req.costs.is_some_and(|c| c.model_len > 0)
            && self.due.contains(&req.seq);
        let plan = if read_now { HybridPlan::Model } else { plan() };
        if plan != HybridPlan::Lookup {
            self.due.remove(&req.seq);
        }
        plan
    }

    /// The sequence is finished, or its prompt was read at prefill.
    pub fn release(&mut self, seq: SeqId) {
        self.unread.remove(&seq);
        self.due.remove(&seq);
    }
}

/// A sequence whose prompt the model left unread ([`DeferredReads`]).
#[derive(Clone, Copy, Debug)]
struct Unread {
    /// The savings forgone in its rounds since ([`forgone`]), in target steps.
    saved: f64,
    /// The tokens it could still emit when the prompt was left unread.
    remaining: usize,
    /// Its context length at its first round: that plus `remaining` is the context length by
    /// which it ends at the latest.
    start: Option<usize>,
    /// The price of reading what the model did not hold at its first round:
    /// [`DeferredReads::forwent_its_price`].
    first_price: Option<f64>,
    /// Whether [`DeferredReads::look_early`] looked at its answer.
    looked: bool,
}

impl Unread {
    /// Whether the tokens the sequence may still emit after `len` committed tokens can repay a
    /// reading of `price` steps at the rate its rounds forwent savings so far (per token emitted
    /// since its first round): the horizon of the ski-rental rule. At a steady rate `s` a token,
    /// the rent reaches the price after `price / s` tokens, and the reading is made only if as
    /// many are left then, so a prompt the rent pays for only in the second half of the token
    /// limit stays unread: reading it then costs what the rounds left cannot bring back. (In
    /// stop 65's run at temperature 0.7, before this horizon, the hybrid left four of five
    /// translation prompts unread and read each later, at a point the run did not record; the
    /// draft model's time, reading and drafting, was 0.8–2.0 s, 11–26% of their decoding, it
    /// then drafted in 4–19 rounds of each, and those four decoded at 0.84–0.89 times plain
    /// decoding's speed.)
    fn repays(&self, len: usize, price: f64) -> bool {
        let Some(start) = self.start else {
            return true;
        };
        let emitted = len.saturating_sub(start) as f64;
        let left = start.saturating_add(self.remaining).saturating_sub(len) as f64;
        self.saved * left >= price * emitted
    }
}

/// What a hybrid drafts in one round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HybridPlan {
    /// The lookup draft as it is (when empty: no drafting).
    Lookup,
    /// A model draft of up to [`DraftRequest::model_len`] tokens instead.
    Model,
    /// The lookup draft, extended by this many tokens the model drafts after it.
    Extend(usize),
}

/// What a round of a sequence whose prompt the model left unread forwent, in target steps: where
/// the model's draft, at the rate the cost model predicts for it
/// ([`RoundCosts::predicted_model_rate_after`], nothing read to catch up), beats the lookup's
/// draft at `lookup_rate` expected tokens per step (times [`RoundCosts::lookup_factor`]; plain
/// decoding, `1 / r(1)`, where the lookup has none), the time the round's expected tokens take at
/// the lookup's rate less their time at the model's. Summed over the rounds since the prompt was
/// left unread, it is the rent of a ski-rental rule: the prompt is read once the sum reaches the
/// price of reading it (where the tokens left can still repay it: [`DeferredReads`]), so that a
/// sequence mispriced at its start (an answer longer, or less copied from the prompt, than the
/// recent ones) loses at most about that price again.
pub fn forgone(costs: &RoundCosts, lookup: &Proposal, lookup_rate: f64) -> f64 {
    if costs.model_len == 0 {
        return 0.0;
    }
    let (rate, tokens) = if lookup.tokens.is_empty() {
        (1.0 / costs.r(1), 1.0)
    } else {
        let rate = lookup_rate * costs.lookup_factor;
        (rate, rate * costs.r(lookup.tokens.len() + 1))
    };
    let model = costs.predicted_model_rate_after(0);
    if !(rate > 0.0 && model > rate) {
        return 0.0;
    }
    tokens * (1.0 / rate - 1.0 / model)
}

/// The plan with the most expected tokens per unit of time, after the lookup proposed `lookup` at
/// `lookup_rate` expected tokens per target step ([`LookupDrafter::propose_one`]). With a cost model
/// ([`DraftRequest::costs`]) each option is priced at its realised rate: the model draft at
/// [`RoundCosts::model_rate`], the lookup draft times [`RoundCosts::lookup_factor`], an extension
/// from [`RoundCosts::best_extension`] times [`RoundCosts::extended_factor`]. The lookup draft is
/// free to make, so an option that calls the model must beat it by [`PAY_MARGIN`]. The model options
/// are charged a share of reading the `lag` committed tokens the model has not read
/// ([`ModelLag::lag`], [`RoundCosts::catch_up_share`]). Where lookup has no draft, the model draft
/// is weighed against plain decoding at its predicted rate
/// ([`RoundCosts::predicted_model_rate_after`]). A round with no lookup draft goes to the
/// model when [`RoundCosts::probe_model`] asks for a probe. Without a cost model: the lookup draft
/// when there is one, else the model.
///
/// [`RoundCosts::model_rate`]: crate::RoundCosts::model_rate
/// [`RoundCosts::lookup_factor`]: crate::RoundCosts::lookup_factor
/// [`RoundCosts::best_extension`]: crate::RoundCosts::best_extension
/// [`RoundCosts::catch_up_share`]: crate::RoundCosts::catch_up_share
/// [`RoundCosts::predicted_model_rate_after`]: crate::RoundCosts::predicted_model_rate_after
/// [`RoundCosts::extended_factor`]: crate::RoundCosts::extended_factor
/// [`RoundCosts::probe_model`]: crate::RoundCosts::probe_model
pub fn plan_hybrid(
    req: &DraftRequest<'_>,
    lookup: &Proposal,
    lookup_rate: f64,
    lag: usize,
) -> HybridPlan {
    let Some(c) = req.costs else {
        return if lookup.tokens.is_empty() {
            HybridPlan::Model
        } else {
            HybridPlan::Lookup
        };
    };
    // Plain decoding (no lookup draft) has no prediction to fall short of.
    let factor = if lookup.tokens.is_empty() {
        1.0
    } else {
        c.lookup_factor
    };
    let (mut plan, mut best) = (HybridPlan::Lookup, lookup_rate * factor);
    // The lookup draft costs nothing to make; a model call must beat it by the margin.
    let bar = best * (1.0 + PAY_MARGIN);
    // Against plain decoding the model is weighed as the model drafter alone weighs it: its
    // acceptance estimates already learn from every model round, and the realised factor on top
    // counts an unlucky start twice. Stop 31 found the hybrid on translation decoding plainly for
    // 16 rounds after its first model draft was rejected (factor 0.88), and again after the
    // probe, where the model drafter alone drafted on and gained 1.26×.
    let model_rate = if lookup.tokens.is_empty() {
        c.predicted_model_rate_after(lag)
    } else {
        c.model_rate_after(lag)
    };
    // A probe: the model has been out for a while and lookup has nothing, so the round would
    // otherwise decode plainly (see [`RoundCosts::probe_model`]).
    let probe = c.probe_model && lookup.tokens.is_empty();
    if c.model_len > 0 && (model_rate > bar || probe) {
        (plan, best) = (HybridPlan::Model, model_rate);
    }
    let ends = lookup.ends_at(req.stop_tokens);
    if let Some((k, rate)) = c.best_extension(&lookup.confidence, ends, req.max_len, lag) {
        let rate = rate * c.extended_factor;
        if rate > bar && rate > best {
            plan = HybridPlan::Extend(k);
        }
    }
    plan
}

/// Continues a model draft with the lookup: for each prefix of the model's `draft` (made for `req`,
/// whose costs price it), the lookup's walk after the context and that prefix
/// ([`LookupDrafter::continuation`]), cut where it pays best; the draft becomes the prefix and its
/// continuation where that is expected to yield more tokens per target step of verification than
/// the model's draft whole (the model's drafting is paid either way). A model draft often starts a
/// span the lookup could not find from the context alone (the first words of a quote, a renamed
/// identifier) and the lookup copies the rest in the same round. The model tokens' `confidence`
/// entries are the cost model's acceptance estimates, and [`Proposal::prefix`] counts them. Returns
/// whether it continued the draft; never without a cost model, or for a draft that is not a model
/// draft alone.
///
/// The continuation is a function of the context and the drafted tokens before it, so its tokens
/// are one-hot draws. A sampled model token is verified against the q it was drawn from, which
/// holds only if whether it stays in the draft is decided without looking at it or at the tokens
/// drawn after it: a sampled draft is cut at the *first* prefix whose continuation beats the draft
/// whole as planned ([`DraftRequest::model_len`] tokens), not at the best one. (Cutting at the
/// best prefix kept a drawn token where the continuation after it was good and dropped it where it
/// was not, which biases sampled output; stop 46 found it.) A greedy draft is a function of the
/// context, and is cut at the best prefix.
pub fn continue_by_lookup(
    lookup: &mut LookupDrafter,
    req: &DraftRequest<'_>,
    draft: &mut Proposal,
) -> bool {
    let Some(c) = req.costs else {
        return false;
    };
    let k = draft.tokens.len();
    // A sampled draft is cut at the first prefix whose continuation beats the planned draft whole,
    // so that whether a drawn token stays is decided by the tokens before it alone; a greedy draft
    // (a function of the context) is cut where it pays best.
    let first = !req.sampling.is_greedy();
    // The length the model was asked for: a sampled draft that a stop token it drew, or its own
    // confidence (`RoundCosts::drafts_on`), cut short is weighed, and let continue, as planned. Not
    // `k`: the length drawn depends on the draws, and a baseline that moved with the draws after a
    // prefix would make whether that prefix's tokens stay depend on them.
    let planned = if first { k.max(req.model_len()) } else { k };
    if k == 0 || !draft.confidence.is_empty() || draft.extension > 0 || planned >= req.max_len {
        return false;
    }
    let acceptance = |i: usize| c.model_acceptance.get(i).copied().unwrap_or(0.0);
    // expected[j]: the expected tokens of the model's first j tokens and the bonus; reach[j]: the
    // estimated probability that they are all accepted.
    let (mut reach, mut expected) = (vec![1.0; planned + 1], vec![1.0; planned + 1]);
    for i in 0..planned {
        reach[i + 1] = reach[i] * acceptance(i);
        expected[i + 1] = expected[i] + reach[i + 1];
    }
    let whole = expected[planned] / c.r(planned + 1);
    let mut best: Option<(usize, Proposal)> = None;
    let mut best_rate = whole;
    let mut context = req.context.to_vec();
    let mut walk = Proposal::default();
    for j in 1..=k {
        context.truncate(req.context.len());
        context.extend_from_slice(&draft.tokens[..j]);
        lookup.continuation(
            &DraftRequest {
                context: &context,
                max_len: req.max_len - j,
                ..*req
            },
            &mut walk,
        );
        // The expected tokens with the first l + 1 tokens of the walk after the prefix.
        let (mut tokens, mut reached) = (expected[j], reach[j]);
        let ends = walk.ends_at(req.stop_tokens);
        for (l, &a) in walk.confidence.iter().enumerate() {
            reached *= f64::from(a);
            tokens += reached;
            // A walk ending the generation brings no token after its last.
            let last_ends = ends && l + 1 == walk.confidence.len();
            let rate = (tokens - if last_ends { reached } else { 0.0 }) / c.r(j + l + 2);
            if rate > best_rate {
                best_rate = rate;
                let mut kept = walk.clone();
                kept.truncate(l + 1);
                best = Some((j, kept));
            }
        }
        if first && best.is_some() {
            break;
        }
    }
    let Some((j, cont)) = best else {
        return false;
    };
    draft.truncate(j);
    draft.confidence.clear();
    draft
        .confidence
        .extend((0..j).map(|i| acceptance(i) as f32));
    for (&token, &a) in cont.tokens.iter().zip(&cont.confidence) {
        draft.push(token, Probs::OneHot(token));
        draft.confidence.push(a);
    }
    draft.prefix = j;
    true
}

/// Runs `model` for the rounds whose plan needs it: a [`HybridPlan::Model`] draft replaces `out[b]`;
/// a [`HybridPlan::Extend`] draft continues the lookup draft in `out[b]`, drafted from the context
/// followed by that draft, each model token's confidence being the cost model's acceptance estimate
/// for its position (0 without a cost model). One model call serves the whole batch; `lag` learns
/// what the model read.
pub fn draft_planned<D: Draft>(
    model: &mut D,
    lag: &mut ModelLag,
    batch: &[DraftRequest<'_>],
    out: &mut [Proposal],
    plans: &[HybridPlan],
) -> Result<(), D::Error> {
    let picked: Vec<usize> = (0..batch.len())
        .filter(|&b| plans[b] != HybridPlan::Lookup)
        .collect();
    if picked.is_empty() {
        return Ok(());
    }
    let contexts: Vec<Vec<TokenId>> = picked
        .iter()
        .map(|&b| match plans[b] {
            HybridPlan::Extend(_) => [batch[b].context, &out[b].tokens].concat(),
            _ => Vec::new(),
        })
        .collect();
    let requests: Vec<DraftRequest<'_>> = picked
        .iter()
        .zip(&contexts)
        .map(|(&b, context)| match plans[b] {
            HybridPlan::Extend(k) => DraftRequest {
                context,
                max_len: k,
                costs: None,
                ..batch[b]
            },
            _ => batch[b],
        })
        .collect();
    let mut proposals: Vec<Proposal> = picked
        .iter()
        .map(|&b| match plans[b] {
            HybridPlan::Model => std::mem::take(&mut out[b]),
            _ => Proposal::default(),
        })
        .collect();
    let lags: Vec<usize> = picked
        .iter()
        .map(|&b| lag.lag(batch[b].seq, batch[b].context))
        .collect();
    let r = model.propose(&requests, &mut proposals);
    for ((&b, mut p), behind) in picked.iter().zip(proposals).zip(lags) {
        let req = &batch[b];
        if let HybridPlan::Extend(_) = plans[b] {
            let acceptance = req.costs.map_or(&[][..], |c| &c.model_acceptance[..]);
            let out = &mut out[b];
            let extended = p.tokens.len();
            out.extension = extended;
            out.lag = behind;
            out.non_finite = p.non_finite;
            for (i, (token, q)) in p.tokens.into_iter().zip(p.probs).enumerate() {
                out.push(token, q);
                out.confidence
                    .push(acceptance.get(i).copied().unwrap_or(0.0) as f32);
            }
            if extended > 0 {
                lag.drafted(req.seq, req.context.len(), &out.tokens);
            }
        } else {
            p.lag = behind;
            // A model asked for no tokens read nothing.
            if !p.tokens.is_empty() {
                lag.drafted(req.seq, req.context.len(), &p.tokens);
            }
            out[b] = p;
        }
    }
    r
}

impl<D: Draft> Draft for HybridDrafter<D> {
    type Error = D::Error;

    fn vocab_size(&self) -> Option<usize> {
        self.model.vocab_size()
    }

    fn propose(
        &mut self,
        batch: &[DraftRequest<'_>],
        out: &mut [Proposal],
    ) -> Result<(), Self::Error> {
        let mut plans = Vec::with_capacity(batch.len());
        for (req, out) in batch.iter().zip(out.iter_mut()) {
            // An answer unlike the measured ones has its own prompt read now, and the next
            // prompt read whatever its price.
            self.reads
                .look_early_at(req.seq, &self.lookup, &mut self.savings);
            let rate = self.lookup.propose_one(req, out);
            let (model, lag) = (&self.model, &self.lag);
            plans.push(self.reads.plan(
                req,
                out,
                rate,
                || model.cached(req.seq, req.context),
                || plan_hybrid(req, out, rate, lag.lag(req.seq, req.context)),
            ));
        }
        draft_planned(&mut self.model, &mut self.lag, batch, out, &plans)?;
        for ((req, out), &plan) in batch.iter().zip(out.iter_mut()).zip(&plans) {
            if plan == HybridPlan::Model {
                continue_by_lookup(&mut self.lookup, req, out);
            }
            self.savings.drafted(req, out, plan);
        }
        Ok(())
    }

    fn commit(&mut self, seq: SeqId, committed: &[TokenId]) -> Result<(), Self::Error> {
        // A model round, replayed before the lookup learns from its own draft of the round.
        self.savings.committed(&mut self.lookup, seq, committed);
        let Ok(()) = self.lookup.commit(seq, committed);
        self.model.commit(seq, committed)
    }

    /// Only lookup drafts are cut after they are made ([`crate::Batch`]); a round the model was to
    /// extend and did not reads as one, and its pending price is cut too.
    fn truncated(&mut self, seq: SeqId, len: usize) {
        self.savings.truncated(seq, len);
        self.lookup.truncated(seq, len);
    }

    /// Both read the prompt now, so the model's first drafting round does not pay for it: a round's
    /// costs, as the cost model prices them, leave out catching up on a whole prompt. (The server's
    /// drafter reads it lazily instead, where a sequence that never drafts with the model is common.)
    fn prefill(&mut self, seq: SeqId, context: &[TokenId]) -> Result<(), Self::Error> {
        self.answer_over(seq);
        // This prompt is read, and measured: what an answer before called for is done.
        self.savings.take_remeasure();
        let Ok(()) = self.lookup.prefill(seq, context);
        self.reads.release(seq);
        self.savings.read(seq, context.len());
        self.lag.prefill(seq, context.len());
        self.model.prefill(seq, context)
    }

    /// [`Draft::prefill`], except that the model leaves a prompt unread where the cost model says
    /// reading it cannot pay ([`crate::RoundCosts::prompt_read_pays`], for the tokens the model
    /// does not hold already, over the tokens of an answer the lookup is not expected to draft,
    /// [`LookupDrafter::recent_answers`]): the lookup then drafts the sequence alone. After
    /// [`crate::READ_PROBE_AFTER`] prompts left unread in a row it reads the next whatever its
    /// price, as a [`crate::ModelDrafter`] does (since stop 69): what its model rounds save is
    /// measured only on prompts read. It reads the next whatever its price too after an answer
    /// left unread that calls for measuring again ([`LookupSavings::finish`], since stop 71). From
    /// stop 72 a prompt left unread becomes due where the early look at its answer, after 16
    /// tokens, finds it unlike the measured ones ([`DeferredReads::look_early`]); since stop 73
    /// such an answer has the next prompt read whatever its price too: it is likely of the same
    /// kind, and the measure that would price its reading holds at most one answer of that kind,
    /// measured from its look on (replayed over stop 70's greedy run, the first translation,
    /// after a summary read at its look, was read at prefill and decoded at 1.51–1.57× instead
    /// of 1.32–1.34×). (Replayed on
    /// stop 68's benchmark, the hybrid had left all 15 QA, summary and translation prompts unread, the translations decoding at 1.00×; with
    /// the probe it read one of each kind, the fifth, and the translations decoded at 1.14×.)
    fn prefill_priced(&mut self, req: &PrefillRequest<'_>) -> Result<(), Self::Error> {
        // The answer the sequence held before (a reused id) is over, then the lookup records it.
        self.answer_over(req.seq);
        let Ok(()) = self.lookup.prefill(req.seq, req.prompt);
        let probe =
            self.savings.take_remeasure() || self.unread_in_a_row >= crate::READ_PROBE_AFTER;
        if probe
            || req.read_pays(
                self.model.cached(req.seq, req.prompt),
                self.lookup.recent_answers(),
                self.savings.savings(),
            )
        {
            self.unread_in_a_row = 0;
            self.reads.release(req.seq);
            self.savings.read(req.seq, req.prompt.len());
            self.lag.prefill(req.seq, req.prompt.len());
            return self.model.prefill(req.seq, req.prompt);
        }
        self.unread_in_a_row += 1;
        self.reads.leave_unread(req);
        self.lag.prefill(req.seq, 0);
        Ok(())
    }

    fn cached(&self, seq: SeqId, context: &[TokenId]) -> usize {
        self.model.cached(seq, context)
    }

    fn model_drafts(&self, seq: SeqId) -> bool {
        !self.left_unread(seq) && self.model.model_drafts(seq)
    }

    fn release(&mut self, seq: SeqId) {
        self.answer_over(seq);
        self.lookup.release(seq);
        self.lag.release(seq);
        self.reads.release(seq);
        self.model.release(seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock::reading_costs;
    use crate::{CounterRng, RoundCosts, SamplingParams, Stream};

    #[test]
    fn a_model_draft_that_starts_a_known_span_is_continued_by_the_lookup() {
        let sampling = SamplingParams::greedy();
        let costs = RoundCosts {
            r: (1..=17).map(|m| 1.0 + 0.05 * (m - 1) as f64).collect(),
            model_acceptance: vec![0.9; 4],
            ..RoundCosts::default()
        };
        // The prompt quotes a span (1 ..= 8) after 10, 11; it ends with 10, 11 again, and the
        // model drafts the span's first token.
        let prompt: Vec<TokenId> = vec![10, 11, 1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 10, 11];
        let seq = SeqId(0);
        let mut lookup = LookupDrafter::default();
        let Ok(()) = lookup.prefill(seq, &prompt);
        let req = |costs, max_len| DraftRequest {
            seq,
            context: &prompt,
            max_len,
            sampling: &sampling,
            rng: CounterRng::new(0),
            min_confidence: 0.0,
            costs,
            stop_tokens: &[],
        };
        let model_draft = || {
            let mut p = Proposal::default();
            p.push(1, Probs::Dense(vec![0.5; 2]));
            p
        };
        let mut draft = model_draft();
        assert!(continue_by_lookup(
            &mut lookup,
            &req(Some(&costs), 8),
            &mut draft
        ));
        assert_eq!(draft.prefix, 1);
        assert!(draft.tokens.len() > 2, "{:?}", draft.tokens);
        assert!(draft.tokens.iter().zip(1..).all(|(&t, want)| t == want));
        assert_eq!(draft.confidence.len(), draft.tokens.len());
        assert_eq!(draft.confidence[0], 0.9);
        assert!(matches!(draft.probs[0], Probs::Dense(_)));
        assert!(draft.probs[1..]
            .iter()
            .all(|q| matches!(q, Probs::OneHot(_))));
        // No cost model, or no room past the model's draft: the model's draft as it was.
        for (costs, max_len) in [(None, 8), (Some(&costs), 1)] {
            let mut draft = model_draft();
            assert!(!continue_by_lookup(
                &mut lookup,
                &req(costs, max_len),
                &mut draft
            ));
            assert_eq!((draft.tokens, draft.prefix), (vec![1], 0));
        }
        // Verification so dear that the model's draft alone pays best.
        let dear = RoundCosts {
            r: (1..=17).map(|m| m as f64).collect(),
            ..costs.clone()
        };
        let mut draft = model_draft();
        assert!(!continue_by_lookup(
            &mut lookup,
            &req(Some(&dear), 8),
            &mut draft
        ));
        assert!(draft.confidence.is_empty());
    }

    #[test]
    fn a_sampled_model_draft_keeps_a_drawn_token_by_the_tokens_before_it_alone() {
        // Verification of a sampled model token against its q is exact only if whether the token
        // stays in the draft does not depend on the token itself (or on any drawn after it): two
        // drafts that agree on their first p tokens must keep the same number of them, up to p + 1
        // (the (p + 1)-th is kept by both or by neither), and continue them alike where both cut
        // within the first p. Greedy drafts are a function of the context, free of this.
        let sampled = SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        };
        let (rng, mut drawn) = (CounterRng::new(46), 0);
        let mut next = |n: u64| {
            drawn += 1;
            u64::from(rng.bits(drawn, Stream::Target)[0]) % n
        };
        let (mut checked, mut cut) = (0, 0);
        for _ in 0..3000 {
            let prompt: Vec<TokenId> = (0..40).map(|_| next(5) as TokenId).collect();
            let slope = 0.01 + next(30) as f64 / 100.0;
            let costs = RoundCosts {
                r: (1..=17).map(|m| 1.0 + slope * (m - 1) as f64).collect(),
                model_len: 3,
                model_acceptance: (0..3).map(|_| 0.2 + next(80) as f64 / 100.0).collect(),
                ..RoundCosts::default()
            };
            let seq = SeqId(0);
            let mut lookup = LookupDrafter::default();
            let Ok(()) = lookup.prefill(seq, &prompt);
            let a: Vec<TokenId> = (0..3).map(|_| next(5) as TokenId).collect();
            let p = next(3) as usize;
            let mut b = a.clone();
            b[p] = (b[p] + 1 + next(4) as TokenId) % 5;
            let mut run = |tokens: &[TokenId]| {
                let mut draft = Proposal::default();
                for &t in tokens {
                    draft.push(t, Probs::Dense(vec![0.2; 5]));
                }
                let req = DraftRequest {
                    seq,
                    context: &prompt,
                    max_len: 12,
                    sampling: &sampled,
                    rng: CounterRng::new(0),
                    min_confidence: 0.0,
                    costs: Some(&costs),
                    stop_tokens: &[],
                };
                let continued = continue_by_lookup(&mut lookup, &req, &mut draft);
                let kept = if continued {
                    draft.prefix
                } else {
                    tokens.len()
                };
                (kept, draft.tokens)
            };
            let (ka, da) = run(&a);
            let (kb, db) = run(&b);
            cut += usize::from(ka < 3) + usize::from(kb < 3);
            assert_eq!(
                ka.min(p + 1),
                kb.min(p + 1),
                "drafts {a:?} and {b:?} (same first {p}) keep {ka} and {kb} tokens"
            );
            if ka <= p {
                assert_eq!(da, db, "drafts {a:?} and {b:?}");
            }
            checked += 1;
        }
        // The property was exercised: many drafts were cut.
        assert!(cut > checked / 10, "{cut} cuts in {checked} pairs");
    }

    #[test]
    fn the_hybrid_plans_by_realised_rates() {
        let sampling = SamplingParams::greedy();
        let costs = RoundCosts {
            r: (1..=17).map(|m| 1.0 + 0.1 * (m - 1) as f64).collect(),
            draft_per_token: 0.05,
            model_len: 4,
            model_rate: 1.2,
            model_acceptance: vec![0.9; 4],
            ..RoundCosts::default()
        };
        let request = |costs| DraftRequest {
            seq: SeqId(0),
            context: &[1, 2, 3],
            max_len: 8,
            sampling: &sampling,
            rng: CounterRng::new(0),
            min_confidence: 0.0,
            costs,
            stop_tokens: &[],
        };
        let mut lookup = Proposal::default();
        // Without a cost model: the model when the lookup has nothing, else the lookup.
        assert_eq!(
            plan_hybrid(&request(None), &lookup, f64::NAN, 0),
            HybridPlan::Model
        );
        lookup.push(7, Probs::OneHot(7));
        lookup.push(8, Probs::OneHot(8));
        lookup.confidence = vec![0.9, 0.9];
        assert_eq!(
            plan_hybrid(&request(None), &lookup, f64::NAN, 0),
            HybridPlan::Lookup
        );
        // A confident lookup draft and a cheap model: extend it.
        let (_, rate) = costs.best_free_len(&lookup.confidence, false);
        let plan = plan_hybrid(&request(Some(&costs)), &lookup, rate, 1);
        assert!(matches!(plan, HybridPlan::Extend(k) if k >= 1), "{plan:?}");
        // Extensions that realised a third of their prediction: the lookup draft alone.
        let disappointing = RoundCosts {
            extended_factor: 0.3,
            ..costs.clone()
        };
        let plan = plan_hybrid(&request(Some(&disappointing)), &lookup, rate, 1);
        assert_eq!(plan, HybridPlan::Lookup);
        // No lookup draft: the model draft beats plain decoding.
        let plan = plan_hybrid(&request(Some(&costs)), &Proposal::default(), 1.0, 1);
        assert_eq!(plan, HybridPlan::Model);
        // Disappointing lookup drafts do not lower the bar of plain decoding.
        let weak = RoundCosts {
            lookup_factor: 0.5,
            model_rate: 1.0,
            ..costs.clone()
        };
        let plan = plan_hybrid(&request(Some(&weak)), &Proposal::default(), 1.0, 1);
        assert_eq!(plan, HybridPlan::Lookup);
        // A model whose drafts realised less than predicted (an unlucky start) still beats plain
        // decoding at its predicted rate, as a model drafter alone would find, but its realised
        // rate weighs against a lookup draft.
        let unlucky = RoundCosts {
            model_rate: 1.2 * 0.8,
            model_factor: 0.8,
            ..costs.clone()
        };
        let plan = plan_hybrid(&request(Some(&unlucky)), &Proposal::default(), 1.0, 1);
        assert_eq!(plan, HybridPlan::Model);
        let mut single = Proposal::default();
        single.push(7, Probs::OneHot(7));
        single.confidence = vec![0.25];
        let (len, single_rate) = unlucky.best_free_len(&single.confidence, false);
        assert_eq!(len, 1);
        assert!(single_rate * 1.05 > 0.96 && single_rate * 1.05 < 1.2);
        let no_extension = RoundCosts {
            extended_factor: 0.3,
            ..unlucky.clone()
        };
        let plan = plan_hybrid(&request(Some(&no_extension)), &single, single_rate, 1);
        assert_eq!(plan, HybridPlan::Lookup);
        // A probe: the model drafts although it is priced below plain decoding, but only where
        // lookup has nothing, and only while the cost model still drafts (`model_len > 0`).
        let probing = RoundCosts {
            probe_model: true,
            ..weak.clone()
        };
        let plan = plan_hybrid(&request(Some(&probing)), &Proposal::default(), 1.0, 1);
        assert_eq!(plan, HybridPlan::Model);
        let plan = plan_hybrid(&request(Some(&probing)), &lookup, rate, 1);
        assert_ne!(plan, HybridPlan::Model);
        let idle = RoundCosts {
            model_len: 0,
            ..probing.clone()
        };
        let plan = plan_hybrid(&request(Some(&idle)), &Proposal::default(), 1.0, 1);
        assert_eq!(plan, HybridPlan::Lookup);
        // A model draft that beats plain decoding loses if the model must first read 2000 tokens
        // it missed (10 target steps, a share of 0.31 in this round: shared by at most 32 rounds),
        // and wins after 20 (a share of 0.01).
        let plan = plan_hybrid(&request(Some(&costs)), &Proposal::default(), 1.0, 2000);
        assert_eq!(plan, HybridPlan::Lookup);
        let plan = plan_hybrid(&request(Some(&costs)), &Proposal::default(), 1.0, 20);
        assert_eq!(plan, HybridPlan::Model);
        // A lag built up over lookup rounds is shared by about as many rounds (2 tokens each, at
        // most 32): at 100 tokens (0.49 target steps, a share of 0.015) the model still wins,
        // where sharing by 8 rounds (0.061) would not against a lookup rate just below its bar.
        let near = plan_hybrid(&request(Some(&costs)), &Proposal::default(), 1.12, 100);
        assert_eq!(near, HybridPlan::Model);
        assert!((costs.catch_up_share(100) - costs.catch_up(100) / 32.0).abs() < 1e-12);
        assert!((costs.catch_up_share(40) - costs.catch_up(40) / 20.0).abs() < 1e-12);
        assert!((costs.catch_up_share(6) - costs.catch_up(6) / 8.0).abs() < 1e-12);
    }

    #[test]
    fn the_model_lag_counts_what_the_model_has_not_read() {
        let mut lag = ModelLag::default();
        let seq = SeqId(3);
        assert_eq!(lag.lag(seq, &[1, 2, 3]), 3);
        lag.prefill(seq, 3);
        assert_eq!(lag.lag(seq, &[1, 2, 3]), 0);
        assert_eq!(lag.lag(seq, &[1, 2, 3, 4, 5]), 2);
        // It drafted 7 8 9 after 1 2 3 4 and read 7 8: two accepted, then a correction.
        lag.drafted(seq, 4, &[7, 8, 9]);
        assert_eq!(lag.lag(seq, &[1, 2, 3, 4, 7, 8, 6]), 1);
        // The first rejected: it must read from there.
        assert_eq!(lag.lag(seq, &[1, 2, 3, 4, 5, 6]), 2);
        lag.release(seq);
        assert_eq!(lag.lag(seq, &[1]), 1);
    }

    /// A model that drafts token 7 and counts what it is asked; given an answer (after a prompt of
    /// `prompt_len` tokens), it drafts what the target will emit instead, up to ten tokens.
    #[derive(Default)]
    struct Counting {
        prefills: usize,
        proposals: usize,
        held: usize,
        prompt_len: usize,
        answer: Vec<TokenId>,
    }

    impl Draft for Counting {
        type Error = std::convert::Infallible;

        fn vocab_size(&self) -> Option<usize> {
            None
        }

        fn propose(
            &mut self,
            batch: &[DraftRequest<'_>],
            out: &mut [Proposal],
        ) -> Result<(), Self::Error> {
            self.proposals += batch.len();
            for (req, p) in batch.iter().zip(out.iter_mut()) {
                p.clear();
                if self.answer.is_empty() {
                    p.push(7, Probs::OneHot(7));
                }
                let done = req.context.len().saturating_sub(self.prompt_len);
                for &t in self.answer.iter().skip(done).take(10) {
                    p.push(t, Probs::OneHot(t));
                }
            }
            Ok(())
        }

        fn commit(&mut self, _seq: SeqId, _committed: &[TokenId]) -> Result<(), Self::Error> {
            Ok(())
        }

        fn prefill(&mut self, _seq: SeqId, _context: &[TokenId]) -> Result<(), Self::Error> {
            self.prefills += 1;
            Ok(())
        }

        fn cached(&self, _seq: SeqId, context: &[TokenId]) -> usize {
            self.held.min(context.len())
        }
    }

    #[test]
    fn a_prompt_the_model_could_not_repay_is_left_to_the_lookup() {
        let sampling = SamplingParams::greedy();
        // Reading a prompt token costs 0.05 steps; the model's drafts are predicted at 1.5 tokens
        // per step, a saving of a third of a step per token it drafts for.
        let costs = reading_costs();
        let prompt: Vec<TokenId> = (100..1_100).collect();
        let (long, short) = (SeqId(1), SeqId(2));
        let mut hybrid = HybridDrafter::new(LookupDrafter::default(), Counting::default());
        let read = |seq, remaining| PrefillRequest {
            seq,
            prompt: &prompt,
            remaining,
            costs: Some(&costs),
        };
        // 1,000 tokens at 0.05 are 50 steps: not repaid within 16 tokens, repaid within 1,000.
        let Ok(()) = hybrid.prefill_priced(&read(short, 16));
        assert!(hybrid.left_unread(short));
        assert_eq!(hybrid.model.prefills, 0);
        let Ok(()) = hybrid.prefill_priced(&read(long, 1_000));
        assert!(!hybrid.left_unread(long));
        assert_eq!(hybrid.model.prefills, 1);
        // The lookup has nothing after token 1,099; the read sequence drafts with the model, the
        // other decodes plainly.
        let req = |seq| crate::mock::draft_request(seq, &prompt, &sampling, Some(&costs));
        let mut out = [Proposal::default(), Proposal::default()];
        let Ok(()) = hybrid.propose(&[req(short), req(long)], &mut out);
        assert!(out[0].tokens.is_empty(), "{:?}", out[0]);
        assert_eq!(out[1].tokens, [7]);
        assert_eq!(hybrid.model.proposals, 1);
        // What the model holds already costs nothing to read: 960 of the 1,000 tokens cached
        // leave 2 steps, repaid within 16 tokens.
        hybrid.model.held = 960;
        let Ok(()) = hybrid.prefill_priced(&read(short, 16));
        assert!(!hybrid.left_unread(short));
        assert_eq!(hybrid.model.prefills, 2);
        // Without prices, a prompt is read as before.
        hybrid.model.held = 0;
        let Ok(()) = hybrid.prefill_priced(&PrefillRequest {
            costs: None,
            ..read(SeqId(3), 1)
        });
        assert!(!hybrid.left_unread(SeqId(3)));
        hybrid.release(short);
        assert!(!hybrid.left_unread(short));
    }

    /// The prompt `context` of `seq` left unread, with no limit on the tokens it may emit.
    fn unread_prompt(seq: SeqId, context: &[TokenId]) -> PrefillRequest<'_> {
        PrefillRequest {
            seq,
            prompt: context,
            remaining: usize::MAX,
            costs: None,
        }
    }

    /// A due read waits through rounds with a lookup draft, and any round that calls the model (an
    /// extension of the lookup's draft too) reads it: the prompt is then neither unread nor due.
    #[test]
    fn a_due_read_waits_for_a_round_that_calls_the_model_and_an_extension_is_one() {
        let sampling = SamplingParams::greedy();
        let costs = reading_costs();
        let context: Vec<TokenId> = (100..140).collect();
        let req = crate::mock::draft_request(SeqId(1), &context, &sampling, Some(&costs));
        let plain = Proposal::default();
        let mut lookup = Proposal::default();
        lookup.push(7, Probs::OneHot(7));
        lookup.confidence.push(0.9);
        let mut reads = DeferredReads::default();
        reads.leave_unread(&unread_prompt(SeqId(1), &context));
        // 40 tokens unread cost 2 steps; a plain round forgoes a third of one (the model's
        // drafts are predicted at 1.5 tokens a step), five of them 1.67 steps.
        for round in 1..=5 {
            let plan = reads.plan(&req, &plain, f64::NAN, || 0, || unreachable!());
            assert_eq!(plan, HybridPlan::Lookup, "round {round}");
            assert!(reads.is_unread(SeqId(1)), "round {round}");
        }
        // A lookup draft of one token at a token a step forgoes 1.1 (1 - 1 / 1.5) = 0.37 steps:
        // the read is due, and waits, as the planner keeps the lookup's draft.
        let plan = reads.plan(&req, &lookup, 1.0, || 0, || HybridPlan::Lookup);
        assert_eq!(plan, HybridPlan::Lookup);
        assert!(reads.is_due(SeqId(1)) && !reads.is_unread(SeqId(1)));
        let plan = reads.plan(&req, &lookup, 1.0, || 0, || HybridPlan::Lookup);
        assert_eq!(plan, HybridPlan::Lookup);
        assert!(reads.is_due(SeqId(1)));
        // One that the model extends reads it.
        let plan = reads.plan(&req, &lookup, 1.0, || 0, || HybridPlan::Extend(2));
        assert_eq!(plan, HybridPlan::Extend(2));
        assert!(!reads.is_due(SeqId(1)) && !reads.is_unread(SeqId(1)));
        // Without a lookup draft, the round that finds the price forgone reads the prompt by a
        // model draft, whatever the planner would say.
        reads.leave_unread(&unread_prompt(SeqId(2), &context));
        let req2 = DraftRequest {
            seq: SeqId(2),
            ..req
        };
        let mut plans = Vec::new();
        while plans.last() != Some(&HybridPlan::Model) {
            assert!(plans.len() < 8, "{plans:?}");
            plans.push(reads.plan(&req2, &plain, f64::NAN, || 0, || HybridPlan::Lookup));
        }
        assert_eq!(plans.len(), 6);
        assert!(!reads.is_due(SeqId(2)) && !reads.is_unread(SeqId(2)));
    }

    #[test]
    fn a_prompt_the_rounds_pay_for_only_late_in_the_answer_stays_unread() {
        let sampling = SamplingParams::greedy();
        let costs = reading_costs();
        let plain = Proposal::default();
        let prompt: Vec<TokenId> = (100..140).collect();
        // Reading the context costs 0.05 steps a token; a plain round forgoes a third of a step
        // (the model's drafts are predicted at 1.5 tokens a step): round 7's 7/3 steps pay the
        // 2.3 steps of its 46 tokens, 6 of them emitted since the prompt.
        let due_at = |remaining: usize| {
            let mut reads = DeferredReads::default();
            reads.leave_unread(&PrefillRequest {
                seq: SeqId(1),
                prompt: &prompt,
                remaining,
                costs: None,
            });
            let mut context = prompt.clone();
            for round in 1..=remaining {
                let req = crate::mock::draft_request(SeqId(1), &context, &sampling, Some(&costs));
                let plan = reads.plan(&req, &plain, f64::NAN, || 0, || HybridPlan::Lookup);
                if plan == HybridPlan::Model {
                    return Some(round);
                }
                assert!(reads.is_unread(SeqId(1)));
                context.push(1_000 + round as TokenId);
            }
            None
        };
        assert_eq!(due_at(100), Some(7));
        // At the 7/18 of a step a token forgone so far, the 6 tokens left of 12 repay 2.33 steps,
        // more than the price; the 5 left of 11 do not (1.94), nor fewer later.
        assert_eq!(due_at(12), Some(7));
        assert_eq!(due_at(11), None);
    }

    #[test]
    fn a_prompt_left_unread_is_read_once_the_rounds_since_forwent_its_price() {
        let sampling = SamplingParams::greedy();
        // The model's drafts are predicted at 1.5 tokens per step: a plain round forgoes a third
        // of a step.
        let costs = reading_costs();
        let prompt: Vec<TokenId> = (100..1_100).collect();
        let mut hybrid = HybridDrafter::new(LookupDrafter::default(), Counting::default());
        // 30 tokens unread: 1.5 steps, more than 4 tokens repay (1.33 steps). A recent answer of
        // 4 tokens (its prompt left unread too) prices the reading over 4 tokens, though the
        // sequence may emit 100, which can repay it after the rounds the reading waits for.
        hybrid.model.held = 970;
        let read = |seq, remaining| PrefillRequest {
            seq,
            prompt: &prompt,
            remaining,
            costs: Some(&costs),
        };
        let Ok(()) = hybrid.prefill_priced(&read(SeqId(9), 4));
        assert!(hybrid.left_unread(SeqId(9)));
        let mut answer = prompt.clone();
        answer.extend(9_000..9_004);
        let Ok(()) = hybrid.commit(SeqId(9), &answer);
        hybrid.release(SeqId(9));
        assert_eq!(hybrid.lookup.recent_answers().expected_len(100), 4.0);
        let Ok(()) = hybrid.prefill_priced(&read(SeqId(1), 100));
        assert!(hybrid.left_unread(SeqId(1)));
        // Tokens the lookup never saw: every round is plain, and forgoes a third of a step. At
        // round n the context holds n - 1 new tokens, so the price is 0.05 (29 + n) steps:
        // reached at n = 6.
        let mut context = prompt.clone();
        let mut rounds = 0;
        while hybrid.left_unread(SeqId(1)) {
            assert!(rounds < 6, "still unread after {rounds} rounds");
            let mut out = [Proposal::default()];
            let Ok(()) = hybrid.propose(
                &[crate::mock::draft_request(
                    SeqId(1),
                    &context,
                    &sampling,
                    Some(&costs),
                )],
                &mut out,
            );
            rounds += 1;
            if hybrid.left_unread(SeqId(1)) {
                assert!(out[0].tokens.is_empty(), "{:?}", out[0]);
                assert_eq!(hybrid.model.proposals, 0);
            } else {
                // The round that found the price forgone drafts with the model, which reads the
                // whole context first: a lag of all of it.
                assert_eq!(out[0].tokens, [7]);
                assert_eq!(out[0].lag, context.len());
            }
            context.push(5_000 + rounds);
        }
        assert_eq!(rounds, 6);
        assert_eq!(hybrid.model.proposals, 1);
        assert!(hybrid.model_drafts(SeqId(1)));
    }

    /// Commits to `seq` an answer of at least `len` tokens that copies `prompt` from its token 500
    /// on: after its first token the lookup drafts every one (unpriced rounds draft the lookup's
    /// whole walk, rounds priced by `costs` up to 8 tokens). Returns the context committed.
    fn answer_by_copying(
        hybrid: &mut HybridDrafter<Counting>,
        seq: SeqId,
        prompt: &[TokenId],
        len: usize,
        costs: Option<&RoundCosts>,
    ) -> Vec<TokenId> {
        let sampling = SamplingParams::greedy();
        let mut context = prompt.to_vec();
        context.push(500);
        let Ok(()) = hybrid.commit(seq, &context);
        while context.len() < prompt.len() + len {
            let mut out = [Proposal::default()];
            let req = crate::mock::draft_request(seq, &context, &sampling, costs);
            let Ok(()) = hybrid.propose(&[req], &mut out);
            // The target copies on: what was drafted right, then the next token.
            let next = context[context.len() - 1] + 1;
            let right = out[0]
                .tokens
                .iter()
                .zip(next..)
                .take_while(|(&t, n)| t == *n)
                .count();
            context.extend((0..=right as u32).map(|i| next + i));
            let Ok(()) = hybrid.commit(seq, &context);
        }
        context
    }

    #[test]
    fn a_prompt_is_left_unread_where_the_lookup_drafted_the_recent_answers() {
        let costs = reading_costs();
        let prompt: Vec<TokenId> = (100..1_100).collect();
        let mut hybrid = HybridDrafter::new(LookupDrafter::default(), Counting::default());
        // 400 of the prompt's tokens unread: 20 steps, repaid by a third of a step per token
        // within 60 of them.
        hybrid.model.held = 600;
        let read = |seq| PrefillRequest {
            seq,
            prompt: &prompt,
            remaining: 128,
            costs: Some(&costs),
        };
        let Ok(()) = hybrid.prefill_priced(&read(SeqId(1)));
        assert!(!hybrid.left_unread(SeqId(1)));
        answer_by_copying(&mut hybrid, SeqId(1), &prompt, 100, None);
        hybrid.release(SeqId(1));
        let recent = hybrid.lookup.recent_answers().clone();
        assert_eq!(recent.len(), 1);
        assert!(recent.coverage() > 0.9, "{recent:?}");
        // The next prompt's reading would pay back within 60 tokens of 100 drafted by the model,
        // but the lookup is expected to draft nearly all of them (and the model, which drafted
        // no round, saved nothing).
        let Ok(()) = hybrid.prefill_priced(&read(SeqId(2)));
        assert!(hybrid.left_unread(SeqId(2)), "{recent:?}");
        assert_eq!(hybrid.read_savings().saved_per_token(), Some(0.0));
    }

    #[test]
    fn a_model_round_is_settled_against_the_lookup_replayed_over_the_tokens_it_emitted() {
        let sampling = SamplingParams::greedy();
        let costs = reading_costs();
        let prompt: Vec<TokenId> = (100..400).collect();
        // Two answers of 11 tokens, each a new token and then ten more: copied from the prompt,
        // which the lookup drafts after their first, or new too.
        let copied: Vec<TokenId> = [5_000].into_iter().chain(250..260).collect();
        let new: Vec<TokenId> = (6_000..6_011).collect();
        let mut saved = Vec::new();
        for answer in [&copied, &new] {
            let seq = SeqId(1);
            let model = Counting {
                prompt_len: prompt.len(),
                answer: answer.clone(),
                ..Counting::default()
            };
            let mut hybrid = HybridDrafter::new(LookupDrafter::default(), model);
            let Ok(()) = hybrid.prefill(seq, &prompt);
            // The lookup has nothing after token 399: the model drafts ten tokens, all accepted,
            // and the target emits the eleventh.
            let mut out = [Proposal::default()];
            let mut req = crate::mock::draft_request(seq, &prompt, &sampling, Some(&costs));
            req.max_len = 10;
            let Ok(()) = hybrid.propose(&[req], &mut out);
            assert_eq!(out[0].tokens, answer[..10]);
            let Ok(()) = hybrid.commit(seq, &[&prompt[..], answer].concat());
            hybrid.release(seq);
            saved.push(hybrid.read_savings().saved_per_token().unwrap_or(f64::NAN) * 11.0);
        }
        let cost = costs.model_round_steps(10, 10, 0);
        // New tokens: the lookup alone decodes each plainly, 11 steps.
        assert!((saved[1] - (11.0 - cost)).abs() < 1e-9, "{saved:?}");
        // Copied: two plain steps (5000, and 250 after it), then the lookup copies the other nine
        // in a few rounds (a fresh lookup's estimates cut its drafts short): stop 58's measure
        // priced them at plain decoding, as the new ones.
        assert!(saved[0] < saved[1] - 4.0, "{saved:?}");
    }

    #[test]
    fn a_trimmed_round_is_priced_for_the_rows_it_kept() {
        let sampling = SamplingParams::greedy();
        let costs = reading_costs();
        let prompt: Vec<TokenId> = (100..400).collect();
        let answer: Vec<TokenId> = (6_000..6_011).collect();
        let seq = SeqId(1);
        let mut saved = Vec::new();
        for trim in [None, Some(4)] {
            let mut lookup = LookupDrafter::default();
            let Ok(()) = lookup.prefill(seq, &prompt);
            let mut s = LookupSavings::default();
            s.read(seq, prompt.len());
            let mut out = Proposal::default();
            for &t in &answer[..10] {
                out.push(t, Probs::OneHot(t));
            }
            let req = crate::mock::draft_request(seq, &prompt, &sampling, Some(&costs));
            s.drafted(&req, &out, HybridPlan::Model);
            if let Some(len) = trim {
                s.truncated(seq, len);
            }
            let emitted = trim.map_or(11, |len| len + 1);
            s.committed(
                &mut lookup,
                seq,
                &[&prompt[..], &answer[..emitted]].concat(),
            );
            assert!(!s.finish(seq, lookup.answer(seq), lookup.early_answer(seq), false));
            saved.push(s.savings().saved_per_token().unwrap_or(f64::NAN) * emitted as f64);
        }
        // New tokens, which the lookup alone decodes plainly: 11 steps for the whole round, 5 for
        // the one trimmed to 4 tokens, which costs the 6 rows it lost less.
        let whole = costs.model_round_steps(10, 10, 0);
        let trimmed = whole - (costs.r(11) - costs.r(5));
        assert!((saved[0] - (11.0 - whole)).abs() < 1e-9, "{saved:?}");
        assert!((saved[1] - (5.0 - trimmed)).abs() < 1e-9, "{saved:?}");
    }

    #[test]
    fn model_rounds_that_did_not_repay_their_cost_leave_the_next_prompt_unread() {
        let sampling = SamplingParams::greedy();
        let costs = reading_costs();
        let prompt: Vec<TokenId> = (100..200).collect();
        let mut hybrid = HybridDrafter::new(LookupDrafter::default(), Counting::default());
        let read = |seq| PrefillRequest {
            seq,
            prompt: &prompt,
            remaining: 1_000,
            costs: Some(&costs),
        };
        // 100 tokens at 0.05 are 5 steps, predicted to be repaid by a third of a step a token.
        let Ok(()) = hybrid.prefill_priced(&read(SeqId(1)));
        assert!(!hybrid.left_unread(SeqId(1)));
        // An answer of new tokens, so the lookup never drafts: every round is the model's (token
        // 7, 0.25 steps, scored with r(2) = 1.1), and the target rejects it, emitting one token
        // for 1.35 steps: 0.35 steps lost a round.
        let mut context = prompt.clone();
        for next in 5_000..5_050 {
            let mut out = [Proposal::default()];
            let req = crate::mock::draft_request(SeqId(1), &context, &sampling, Some(&costs));
            let Ok(()) = hybrid.propose(&[req], &mut out);
            assert_eq!(out[0].tokens, [7]);
            context.push(next);
            let Ok(()) = hybrid.commit(SeqId(1), &context);
        }
        hybrid.release(SeqId(1));
        let saved = hybrid.read_savings().saved_per_token().unwrap_or(f64::NAN);
        assert!((saved + 0.35).abs() < 1e-9, "{saved}");
        // The prediction alone would read the next prompt; the measure does not.
        let recent = hybrid.lookup.recent_answers();
        assert!(costs.prompt_read_pays(100, recent.model_tokens(1_000)));
        let Ok(()) = hybrid.prefill_priced(&read(SeqId(2)));
        assert!(hybrid.left_unread(SeqId(2)));
        hybrid.release(SeqId(2));
        // After `READ_PROBE_AFTER` prompts left unread in a row, the next is read to measure
        // again, and the count starts over.
        let mut seq = 2;
        for _ in 1..crate::READ_PROBE_AFTER {
            seq += 1;
            let Ok(()) = hybrid.prefill_priced(&read(SeqId(seq)));
            assert!(hybrid.left_unread(SeqId(seq)));
            hybrid.release(SeqId(seq));
        }
        let Ok(()) = hybrid.prefill_priced(&read(SeqId(seq + 1)));
        assert!(!hybrid.left_unread(SeqId(seq + 1)));
        hybrid.release(SeqId(seq + 1));
        let Ok(()) = hybrid.prefill_priced(&read(SeqId(seq + 2)));
        assert!(hybrid.left_unread(SeqId(seq + 2)));
    }

    #[test]
    fn an_unread_answer_covered_far_less_than_the_measured_ones_calls_for_measuring_again() {
        let mut s = LookupSavings::default();
        let mut lookup = LookupDrafter::default();
        // No measure yet: nothing to doubt.
        assert!(!s.finish(SeqId(1), Some((100, 0)), None, true));
        // An answer read that emitted nothing since is not measured.
        s.read(SeqId(2), 10);
        assert!(!s.finish(SeqId(2), Some((100, 60)), None, false));
        assert!(!s.finish(SeqId(3), Some((100, 20)), None, true));
        // One that emitted 100 tokens is, and its coverage, 60%, goes with the measure.
        s.read(SeqId(2), 10);
        let answer: Vec<TokenId> = (0..110).collect();
        s.committed(&mut lookup, SeqId(2), &answer);
        assert!(!s.finish(SeqId(2), Some((100, 60)), None, false));
        assert_eq!(s.savings().saved_per_token(), Some(0.0));
        // Unread, its rounds forwent the price, the lookup had right 20% (< 0.5 × 60%).
        assert!(s.finish(SeqId(3), Some((100, 20)), None, true));
        // Not when it had right 40%, when the rounds did not forgo the price, or when it emitted
        // nothing.
        assert!(!s.finish(SeqId(4), Some((100, 40)), None, true));
        assert!(!s.finish(SeqId(5), Some((100, 0)), None, false));
        assert!(!s.finish(SeqId(6), Some((0, 0)), None, true));
        assert!(!s.finish(SeqId(7), None, None, true));
    }

    #[test]
    fn an_unread_prompts_rounds_forgo_the_price_it_had_at_the_first_of_them() {
        let sampling = SamplingParams::greedy();
        let costs = reading_costs();
        let plain = Proposal::default();
        let prompt: Vec<TokenId> = (100..141).collect();
        // 41 tokens unread at the first round: 2.05 steps, forgone by seven plain rounds at a
        // third of a step each, though the context has grown to 47 tokens (2.35 steps) by then. A
        // sequence that may emit only 10 is not read (the horizon), and is never due.
        let mut reads = DeferredReads::default();
        reads.leave_unread(&PrefillRequest {
            seq: SeqId(1),
            prompt: &prompt,
            remaining: 10,
            costs: None,
        });
        assert!(!reads.forwent_its_price(SeqId(1)));
        let mut context = prompt.clone();
        for round in 1..=10 {
            let req = crate::mock::draft_request(SeqId(1), &context, &sampling, Some(&costs));
            let plan = reads.plan(&req, &plain, f64::NAN, || 0, || HybridPlan::Lookup);
            assert_eq!(plan, HybridPlan::Lookup);
            assert_eq!(
                reads.forwent_its_price(SeqId(1)),
                round >= 7,
                "round {round}"
            );
            context.push(1_000 + round as TokenId);
        }
        // Nothing for a sequence not unread.
        reads.release(SeqId(1));
        assert!(!reads.forwent_its_price(SeqId(1)));
    }

    #[test]
    fn a_prompt_follows_an_unread_answer_that_calls_for_measuring_again_and_is_read() {
        let sampling = SamplingParams::greedy();
        let costs = reading_costs();
        let prompt: Vec<TokenId> = (100..1_100).collect();
        // 400 of the prompt's tokens unread: 20 steps.
        let held = 600;
        let read = |seq| PrefillRequest {
            seq,
            prompt: &prompt,
            remaining: 100,
            costs: Some(&costs),
        };
        // Each case: a first answer read, that copies the prompt (the lookup drafts nearly all of
        // it, and the model saves nothing: the measure is 0), then a second left unread, that
        // copies the prompt for its first 30 tokens (so that its early look finds it like the
        // measured one, [`DeferredReads::look_early`]) and then has `new` tokens the lookup
        // never saw; is the third prompt read?
        let third_read = |new: u32| {
            let mut hybrid = HybridDrafter::new(LookupDrafter::default(), Counting::default());
            hybrid.model.held = held;
            let Ok(()) = hybrid.prefill_priced(&read(SeqId(1)));
            assert!(!hybrid.left_unread(SeqId(1)));
            answer_by_copying(&mut hybrid, SeqId(1), &prompt, 100, None);
            hybrid.release(SeqId(1));
            assert_eq!(hybrid.read_savings().saved_per_token(), Some(0.0));
            let Ok(()) = hybrid.prefill_priced(&read(SeqId(2)));
            assert!(hybrid.left_unread(SeqId(2)));
            // Plain rounds after the copy (but the first, which drafts the copy's continuation),
            // each forgoing a third of a step; the tokens left never repay the growing price in
            // time (the horizon), so the prompt stays unread.
            let mut context = answer_by_copying(&mut hybrid, SeqId(2), &prompt, 30, Some(&costs));
            let proposals = hybrid.model.proposals;
            for t in 0..new {
                let mut out = [Proposal::default()];
                let req = crate::mock::draft_request(SeqId(2), &context, &sampling, Some(&costs));
                let Ok(()) = hybrid.propose(&[req], &mut out);
                assert!(t == 0 || out[0].tokens.is_empty(), "{t}: {:?}", out[0]);
                assert!(hybrid.left_unread(SeqId(2)));
                context.push(7_000 + t);
                let Ok(()) = hybrid.commit(SeqId(2), &context);
            }
            assert_eq!(hybrid.model.proposals, proposals);
            hybrid.release(SeqId(2));
            let Ok(()) = hybrid.prefill_priced(&read(SeqId(3)));
            !hybrid.left_unread(SeqId(3))
        };
        // 100 rounds forwent 33 steps, more than the 20 the prompt cost at the first: the measure,
        // taken on an answer the lookup drafted, is doubted, and the next prompt read.
        assert!(third_read(100));
        // 40 rounds forwent 13: the measure stands.
        assert!(!third_read(40));
    }

    #[test]
    fn an_early_look_makes_due_an_unread_prompt_whose_answer_is_unlike_the_measured_ones() {
        let prompt: Vec<TokenId> = (100..141).collect();
        // A measure, taken on an answer the lookup had right at 60%, at its early look (12 of 20)
        // as over the whole; and one whose answer it had right at 60% but 4 of 16 at its look.
        let answer: Vec<TokenId> = (0..110).collect();
        let measure = |early| {
            let mut savings = LookupSavings::default();
            savings.read(SeqId(9), 10);
            savings.committed(&mut LookupDrafter::default(), SeqId(9), &answer);
            assert!(!savings.finish(SeqId(9), Some((100, 60)), Some(early), false));
            savings
        };
        let (savings, slow_start) = (measure((20, 12)), measure((16, 4)));
        let unread = |seq| {
            let mut reads = DeferredReads::default();
            reads.leave_unread(&PrefillRequest {
                seq,
                prompt: &prompt,
                remaining: 100,
                costs: None,
            });
            reads
        };
        // Not before 16 tokens; at 16, covered 4 (25% < 0.5 × 60%): due, which counts as having
        // forgone its price.
        let mut reads = unread(SeqId(1));
        assert!(!reads.look_early(SeqId(1), None, 15, &savings));
        assert!(reads.is_unread(SeqId(1)));
        assert!(!reads.forwent_its_price(SeqId(1)));
        assert!(reads.look_early(SeqId(1), Some((16, 4)), 16, &savings));
        assert!(!reads.is_unread(SeqId(1)));
        assert!(reads.is_due(SeqId(1)));
        assert!(reads.forwent_its_price(SeqId(1)));
        // The same answer where the sequence may emit 30 tokens in all: 14 left, fewer than the
        // 16 out, so it stays unread.
        let mut reads = DeferredReads::default();
        reads.leave_unread(&PrefillRequest {
            seq: SeqId(1),
            prompt: &prompt,
            remaining: 30,
            costs: None,
        });
        assert!(!reads.look_early(SeqId(1), Some((16, 4)), 16, &savings));
        assert!(reads.is_unread(SeqId(1)));
        // Against answers that started as slowly, 4 of 16 is alike: the whole answers' 60% is not
        // what an early look is weighed against.
        let mut reads = unread(SeqId(1));
        assert!(!reads.look_early(SeqId(1), Some((16, 4)), 16, &slow_start));
        assert!(reads.is_unread(SeqId(1)));
        // Covered 5 of 16 (31%): it looks like the measured ones, and is not looked at again.
        let mut reads = unread(SeqId(1));
        assert!(!reads.look_early(SeqId(1), Some((16, 5)), 16, &savings));
        assert!(!reads.look_early(SeqId(1), Some((16, 0)), 40, &savings));
        assert!(reads.is_unread(SeqId(1)));
        // Nothing without a measure, for a sequence not unread, or without an answer.
        let mut reads = unread(SeqId(1));
        assert!(!reads.look_early(SeqId(2), Some((16, 0)), 16, &savings));
        assert!(!reads.look_early(SeqId(1), None, 16, &savings));
        assert!(!reads.look_early(SeqId(1), Some((16, 0)), 16, &LookupSavings::default()));
        assert!(reads.is_unread(SeqId(1)));
    }

    #[test]
    fn an_unread_answer_unlike_the_measured_ones_is_read_at_its_early_look() {
        let sampling = SamplingParams::greedy();
        let costs = reading_costs();
        let prompt: Vec<TokenId> = (100..1_100).collect();
        let read = |seq| PrefillRequest {
            seq,
            prompt: &prompt,
            remaining: 100,
            costs: Some(&costs),
        };
        let mut hybrid = HybridDrafter::new(LookupDrafter::default(), Counting::default());
        hybrid.model.held = 600;
        // The measure, 0 steps saved a token, on an answer that copies the prompt.
        let Ok(()) = hybrid.prefill_priced(&read(SeqId(1)));
        answer_by_copying(&mut hybrid, SeqId(1), &prompt, 100, None);
        hybrid.release(SeqId(1));
        let Ok(()) = hybrid.prefill_priced(&read(SeqId(2)));
        assert!(hybrid.left_unread(SeqId(2)));
        // Tokens the lookup never saw: plain rounds, until the round after the 16th token,
        // which looks at the answer, finds the prompt due and drafts with the model, which reads
        // the whole context as its catch-up. (The rounds alone would not have made it due: they
        // forgo a third of a step each against a price of 20 steps.)
        let mut context = prompt.clone();
        for t in 0..16 {
            let mut out = [Proposal::default()];
            let req = crate::mock::draft_request(SeqId(2), &context, &sampling, Some(&costs));
            let Ok(()) = hybrid.propose(&[req], &mut out);
            assert!(out[0].tokens.is_empty(), "token {t}: {:?}", out[0]);
            assert!(hybrid.left_unread(SeqId(2)));
            context.push(7_000 + t);
            let Ok(()) = hybrid.commit(SeqId(2), &context);
        }
        assert_eq!(hybrid.model.proposals, 0);
        let mut out = [Proposal::default()];
        let req = crate::mock::draft_request(SeqId(2), &context, &sampling, Some(&costs));
        let Ok(()) = hybrid.propose(&[req], &mut out);
        assert!(!hybrid.left_unread(SeqId(2)));
        assert_eq!(hybrid.model.proposals, 1);
        assert_eq!(out[0].tokens, [7]);
        assert_eq!(out[0].lag, context.len());
        // The next prompt is likely of the same kind: it is read whatever its price, though the
        // measure (nothing saved a token) would leave it unread; the one after it is priced again.
        hybrid.release(SeqId(2));
        assert_eq!(hybrid.read_savings().saved_per_token(), Some(0.0));
        let Ok(()) = hybrid.prefill_priced(&read(SeqId(3)));
        assert!(!hybrid.left_unread(SeqId(3)));
        hybrid.release(SeqId(3));
        let Ok(()) = hybrid.prefill_priced(&read(SeqId(4)));
        assert!(hybrid.left_unread(SeqId(4)));
    }

    #[test]
    fn lookup_finds_the_most_recent_longest_match() {
        let d = NGramDrafter { min_n: 1, max_n: 3 };
        // ... 1 2 3 [9 9] ... 1 2 3 [7 8] ... 1 2 3
        let ctx = [1, 2, 3, 9, 9, 5, 1, 2, 3, 7, 8, 6, 1, 2, 3];
        assert_eq!(d.lookup(&ctx, 2), &[7, 8]);
        assert_eq!(d.lookup(&ctx, 10), &[7, 8, 6, 1, 2, 3]);
        assert_eq!(d.lookup(&[4, 5, 6], 3), &[] as &[u32]);
        // Falls back to shorter suffixes.
        let ctx = [5, 3, 8, 4, 3];
        assert_eq!(d.lookup(&ctx, 2), &[8, 4]);
    }
}
