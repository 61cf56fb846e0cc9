//! Lookup drafting that learns (after SuffixDecoding, Oliaro et al. 2024): the longest suffix of the
//! context that occurred before, in the context itself or in earlier outputs, and the continuation its
//! occurrences agree on, with an estimate of each drafted token's acceptance.
//!
//! - **Where it looks**: the whole committed context (prompt and generated tokens), and a bounded
//!   history of the outputs of earlier sequences of this drafter (chat turns, server requests),
//!   indexed by token so a round costs microseconds.
//! - **What it drafts**: every occurrence of the longest matching suffix votes for the next token; the
//!   majority wins (the most recent occurrence breaks ties), the occurrences that disagree drop out, and
//!   the walk goes on while the estimated probability of reaching the next token stays above
//!   [`LookupConfig::min_reach`], and ends after a token that ends the generation
//!   ([`crate::DraftRequest::stop_tokens`]).
//! - **How sure it is**: each token's conditional acceptance is estimated per (match length, agreement)
//!   bucket from what the target later committed, a Beta estimate that starts from a prior, times
//!   the sequence's own record against those estimates (its drafts may do better or worse than
//!   the buckets' other sequences'). Every
//!   proposal is checked against the committed tokens, also the ones a hybrid did not use, so the
//!   estimates keep learning. With a cost model ([`crate::DraftRequest::costs`]) the draft is cut at
//!   the length with the most expected tokens per unit of target time.
//!
//! Drafts are one-hot and depend only on tokens committed before the round (and on the history of
//! earlier, finished sequences), so rejection sampling stays exact.

use std::collections::HashMap;

use crate::model::{Draft, DraftRequest, Proposal, RecentAnswers, SeqId};
use crate::sampling::Probs;
use crate::TokenId;

/// Settings of a [`LookupDrafter`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LookupConfig {
    /// The shortest suffix that counts as a match.
    pub min_n: usize,
    /// The longest suffix compared (longer matches count as this long).
    pub max_n: usize,
    /// Stop drafting where the estimated probability that the next token is reached and accepted
    /// falls below this.
    pub min_reach: f32,
    /// Tokens of earlier outputs kept for lookup (the oldest half is dropped when full); 0 disables
    /// the history.
    pub history_tokens: usize,
}

impl Default for LookupConfig {
    fn default() -> Self {
        Self {
            min_n: 1,
            max_n: 32,
            min_reach: 0.05,
            history_tokens: 1 << 18,
        }
    }
}

/// Never a token: separates the outputs in the history, so no match crosses from one to the next.
const SEP: TokenId = TokenId::MAX;

/// Match-length buckets: 1, 2, 3, 4, 5-6, 7-9, 10-14, 15+.
const LEN_BUCKETS: usize = 8;
/// Agreement buckets: one occurrence; several, unanimous; a majority; a plurality below half.
const AGREE_BUCKETS: usize = 4;
/// Source buckets, where the occurrences that vote for the token lie (the first that holds one):
/// the prompt; the tokens generated since; the history of earlier outputs.
const SOURCE_BUCKETS: usize = 3;
/// Pseudo-observations behind each bucket's prior.
const PRIOR_WEIGHT: f64 = 2.0;
/// A bucket's counts are scaled down past this many observations, so that it follows drift.
const MAX_WEIGHT: f64 = 500.0;

fn len_bucket(n: usize) -> usize {
    match n {
        0..=4 => n.saturating_sub(1),
        5..=6 => 4,
        7..=9 => 5,
        10..=14 => 6,
        _ => 7,
    }
}

fn agree_bucket(count: usize, total: usize) -> usize {
    if total == 1 {
        0
    } else if count == total {
        1
    } else if 2 * count > total {
        2
    } else {
        3
    }
}

/// The prior acceptance of a bucket (by match-length bucket and agreement bucket): longer matches
/// and more agreement are likelier to be right, and a match of one or two tokens is mostly
/// coincidence (on HumanEval completions a quarter of such single-token drafts were accepted), so
/// the prior keeps short matches from drafting until the estimates have learned otherwise.
fn prior(len_bucket: usize, agree: usize, source: usize) -> f64 {
    let base = [0.15, 0.3, 0.2, 0.1][agree];
    (base + 0.1 * len_bucket as f64).min(0.9) * [1.0, 0.9, 0.5][source]
}

/// A bucket's index in [`LookupDrafter::buckets`].
fn bucket_index(len: usize, agree: usize, source: usize) -> usize {
    (source * LEN_BUCKETS + len_bucket(len)) * AGREE_BUCKETS + agree
}

/// A Beta estimate of one bucket's acceptance.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    accepted: f64,
    reached: f64,
    prior: f64,
}

impl Bucket {
    fn estimate(&self) -> f64 {
        (self.accepted + PRIOR_WEIGHT * self.prior) / (self.reached + PRIOR_WEIGHT)
    }

    fn observe(&mut self, accepted: bool) {
        if self.reached >= MAX_WEIGHT {
            self.reached *= 0.5;
            self.accepted *= 0.5;
        }
        self.reached += 1.0;
        self.accepted += f64::from(u8::from(accepted));
    }
}

/// Where a candidate continuation reads its next token.
#[derive(Clone, Copy, Debug)]
enum Cand {
    /// Position in the context (past its end: in the tokens drafted this round).
    Context(usize),
    /// Position in the history.
    History(usize),
}

impl Cand {
    /// Its source bucket: 0 in the prompt, 1 in the tokens generated since (or drafted this
    /// round), 2 in the history.
    fn source(self, prompt_len: usize) -> usize {
        match self {
            Cand::Context(i) if i < prompt_len => 0,
            Cand::Context(_) => 1,
            Cand::History(_) => 2,
        }
    }
}

/// Pseudo-observations behind a sequence's calibration factor of 1 ([`Calibration::scale`]).
const CALIBRATION_PRIOR: f64 = 4.0;
/// Per-token decay of a sequence's calibration counts (a half-life of ~70 checked tokens).
const CALIBRATION_DECAY: f64 = 0.99;

/// How one sequence's drafted tokens have done against their buckets' estimates: the buckets learn
/// over every sequence of the drafter (and so from other kinds of text: stop 36's benchmark, in its
/// order of code, edits, QA, summaries, translations and chat, found the lookup's expected tokens
/// 8–12% over the accepted on QA and translations and 5–9% under on edits and summaries), this
/// ratio from the sequence alone, within a few rounds. It only ever lowers the estimates: raised
/// (stop 37, by the same ratio up to 0.98), the drafts on edits grew from 5.6 to 6.6 tokens a
/// round and the rounds ran 3% slower; what a walk's first tokens gain (most of the checked
/// tokens) its last ones do not.
#[derive(Clone, Copy, Debug, Default)]
struct Calibration {
    /// Decayed count of checked tokens the target accepted.
    accepted: f64,
    /// Decayed sum of their estimates.
    estimated: f64,
}

impl Calibration {
    fn observe(&mut self, estimate: f64, accepted: bool) {
        self.accepted = self.accepted * CALIBRATION_DECAY + f64::from(u8::from(accepted));
        self.estimated = self.estimated * CALIBRATION_DECAY + estimate;
    }

    /// The factor on the buckets' estimates for this sequence: accepted over estimated, behind
    /// [`CALIBRATION_PRIOR`] pseudo-tokens at 1, and at most 1.
    fn scale(&self) -> f64 {
        ((self.accepted + CALIBRATION_PRIOR) / (self.estimated + CALIBRATION_PRIOR)).min(1.0)
    }
}

/// A proposal kept until the target's verdict is known, to learn from it.
#[derive(Clone, Debug, Default)]
struct Pending {
    /// Context length when proposed.
    at: usize,
    tokens: Vec<TokenId>,
    /// Each token's bucket and that bucket's estimate when the token was walked.
    buckets: Vec<(u8, f32)>,
    /// The first this-many tokens were drafted (the rest of the walk is kept for learning only).
    kept: usize,
}

#[derive(Clone, Debug, Default)]
struct SeqState {
    /// Prompt length; the tokens after it are this sequence's output.
    prompt_len: Option<usize>,
    /// The output so far, added to the history when the sequence is released.
    output: Vec<TokenId>,
    pending: Option<Pending>,
    /// This sequence's drafts against their estimates.
    calibration: Calibration,
    /// Output tokens that a draft of this drafter had right (drafted and committed, and the token
    /// the target emitted after them), whether or not the round used it; of a draft a batch
    /// trimmed ([`Draft::truncated`]), only the kept tokens.
    covered: usize,
    /// The output's length and `covered` at the commit that first brought it to
    /// [`crate::EARLY_LOOK_TOKENS`] tokens or more (forgotten if a rollback cuts it below).
    early: Option<(usize, usize)>,
}

/// The lookup drafter; see the module documentation.
#[derive(Clone, Debug)]
pub struct LookupDrafter {
    config: LookupConfig,
    history: Vec<TokenId>,
    /// Positions in `history` by the token there.
    index: HashMap<TokenId, Vec<u32>>,
    seqs: HashMap<SeqId, SeqState>,
    buckets: Vec<Bucket>,
    cands: Vec<Cand>,
    /// Per next token: its votes and the first source bucket that holds one.
    tally: Vec<(TokenId, usize, usize)>,
    /// The finished sequences' answers, with the tokens its drafts had right.
    answers: RecentAnswers,
}

impl Default for LookupDrafter {
    fn default() -> Self {
        Self::new(LookupConfig::default())
    }
}

impl LookupDrafter {
    /// A drafter with an empty history and the prior estimates.
    pub fn new(config: LookupConfig) -> Self {
        let buckets = (0..SOURCE_BUCKETS * LEN_BUCKETS * AGREE_BUCKETS)
            .map(|i| Bucket {
                accepted: 0.0,
                reached: 0.0,
                prior: prior(
                    (i / AGREE_BUCKETS) % LEN_BUCKETS,
                    i % AGREE_BUCKETS,
                    i / (AGREE_BUCKETS * LEN_BUCKETS),
                ),
            })
            .collect();
        Self {
            config,
            history: Vec::new(),
            index: HashMap::new(),
            seqs: HashMap::new(),
            buckets,
            cands: Vec::new(),
            tally: Vec::new(),
            answers: RecentAnswers::default(),
        }
    }

    /// The answers of its finished sequences, each with the tokens its drafts had right: how much
    /// of an answer it can be expected to draft, which prices a draft model's reading of a prompt
    /// ([`crate::HybridDrafter`]).
    pub fn recent_answers(&self) -> &RecentAnswers {
        &self.answers
    }

    /// The answer a running sequence has emitted so far: its tokens, and how many of them a draft
    /// of this drafter had right (what [`LookupDrafter::recent_answers`] records when it is
    /// over). `None` for a sequence not running.
    pub fn answer(&self, seq: SeqId) -> Option<(usize, usize)> {
        self.seqs.get(&seq).map(|s| (s.output.len(), s.covered))
    }

    /// [`LookupDrafter::answer`] as it was at the commit that first brought a running sequence's
    /// answer to [`crate::EARLY_LOOK_TOKENS`] tokens or more: what an early look at it sees
    /// ([`crate::DeferredReads::look_early`]). `None` before then, or for a sequence not running.
    pub fn early_answer(&self, seq: SeqId) -> Option<(usize, usize)> {
        self.seqs.get(&seq).and_then(|s| s.early)
    }

    /// The settings.
    pub fn config(&self) -> &LookupConfig {
        &self.config
    }

    /// Tokens in the history of earlier outputs (separators included).
    pub fn history_len(&self) -> usize {
        self.history.len()
    }

    /// The estimated acceptance of each (source, match length, agreement) bucket: by source (prompt,
    /// generated, history), then match length, then agreement.
    pub fn estimates(&self) -> Vec<f64> {
        self.buckets.iter().map(Bucket::estimate).collect()
    }

    /// Drafts for one request into `out` (cleared first) and returns the expected tokens per target
    /// step of the draft kept, `1 / r(1)` for none; without costs the walk's own stop decides the
    /// length and the rate is `NaN`.
    pub fn propose_one(&mut self, req: &DraftRequest<'_>, out: &mut Proposal) -> f64 {
        out.clear();
        let state = self.seqs.entry(req.seq).or_default();
        let prompt_len = *state.prompt_len.get_or_insert(req.context.len());
        state.pending = None;
        let mut buckets = Vec::new();
        if req.max_len > 0 {
            let scale = state.calibration.scale();
            self.walk(req, prompt_len, scale, out, &mut buckets);
        }
        // The whole walk is kept for learning; only the best prefix is drafted.
        self.remember(req, out, buckets);
        match req.costs {
            Some(costs) => {
                let ends = out.ends_at(req.stop_tokens);
                let (len, rate) = costs.best_free_len(&out.confidence, ends);
                out.truncate(len);
                if let Some(p) = self.seqs.get_mut(&req.seq).and_then(|s| s.pending.as_mut()) {
                    p.kept = len;
                }
                rate
            }
            None => f64::NAN,
        }
    }

    /// The walk's draft after `req.context` (the committed tokens followed by tokens drafted this
    /// round, of the sequence `req.seq` this drafter knows) into `out` (cleared first), uncut by
    /// costs and not remembered for learning: a continuation is conditional on the tokens drafted
    /// before it, so the target's verdict on it says nothing where those were rejected.
    pub fn continuation(&mut self, req: &DraftRequest<'_>, out: &mut Proposal) {
        out.clear();
        let Some((prompt_len, scale)) = self
            .seqs
            .get(&req.seq)
            .and_then(|s| Some((s.prompt_len?, s.calibration.scale())))
        else {
            return;
        };
        if req.max_len > 0 {
            self.walk(req, prompt_len, scale, out, &mut Vec::new());
        }
    }

    fn remember(&mut self, req: &DraftRequest<'_>, out: &Proposal, buckets: Vec<(u8, f32)>) {
        if out.tokens.is_empty() {
            return;
        }
        if let Some(state) = self.seqs.get_mut(&req.seq) {
            state.pending = Some(Pending {
                at: req.context.len(),
                tokens: out.tokens.clone(),
                buckets,
                kept: out.tokens.len(),
            });
        }
    }

    /// Finds the longest earlier match of the context's suffix and walks the continuation its
    /// occurrences agree on, up to `req.max_len` tokens and no further than a token that ends the
    /// generation (nothing after it can be emitted). Each token's estimate is its bucket's times
    /// `scale`, the sequence's own calibration ([`Calibration::scale`]).
    fn walk(
        &mut self,
        req: &DraftRequest<'_>,
        prompt_len: usize,
        scale: f64,
        out: &mut Proposal,
        buckets: &mut Vec<(u8, f32)>,
    ) {
        let (ctx, max_len) = (req.context, req.max_len);
        let len = ctx.len();
        let Some(&last) = ctx.last() else {
            return;
        };
        let max_n = self.config.max_n.max(1);
        let mut best = 0;
        self.cands.clear();
        // In the context: continuations starting at i (so ctx[i - 1] == last), newest first.
        for i in (1..len).rev() {
            if ctx[i - 1] != last {
                continue;
            }
            let mut n = 1;
            while n < max_n && n < i && ctx[i - 1 - n] == ctx[len - 1 - n] {
                n += 1;
            }
            if n > best {
                best = n;
                self.cands.clear();
            }
            if n == best {
                self.cands.push(Cand::Context(i));
            }
        }
        // In the history of earlier outputs.
        if let Some(positions) = self.index.get(&last) {
            for &p in positions.iter().rev() {
                let p = p as usize;
                if self.history.get(p + 1).is_none_or(|&t| t == SEP) {
                    continue;
                }
                let mut n = 1;
                while n < max_n && n <= p && n < len && self.history[p - n] == ctx[len - 1 - n] {
                    n += 1;
                }
                if n > best {
                    best = n;
                    self.cands.clear();
                }
                if n == best {
                    self.cands.push(Cand::History(p + 1));
                }
            }
        }
        if best < self.config.min_n.max(1) || self.cands.is_empty() {
            return;
        }
        let mut n_eff = best;
        let mut reach = 1.0f64;
        while out.tokens.len() < max_len {
            // Each candidate's next token; the most frequent wins, the newest breaking ties.
            self.tally.clear();
            let mut total = 0;
            for c in &self.cands {
                let Some(t) = next_token(*c, ctx, &out.tokens, &self.history) else {
                    continue;
                };
                total += 1;
                let source = c.source(prompt_len);
                match self.tally.iter_mut().find(|(tt, _, _)| *tt == t) {
                    Some(e) => (e.1, e.2) = (e.1 + 1, e.2.min(source)),
                    None => self.tally.push((t, 1, source)),
                }
            }
            let Some(&(token, count, source)) =
                self.tally
                    .iter()
                    .reduce(|a, b| if b.1 > a.1 { b } else { a })
            else {
                break;
            };
            let bucket = bucket_index(n_eff, agree_bucket(count, total), source);
            let raw = self.buckets[bucket].estimate();
            let a = raw * scale;
            reach *= a;
            if reach < f64::from(self.config.min_reach) {
                break;
            }
            out.push(token, Probs::OneHot(token));
            out.confidence.push(a as f32);
            buckets.push((bucket as u8, raw as f32));
            let drafted = &out.tokens;
            self.cands.retain_mut(|c| {
                if next_token(*c, ctx, &drafted[..drafted.len() - 1], &self.history) != Some(token)
                {
                    return false;
                }
                *c = match *c {
                    Cand::Context(i) => Cand::Context(i + 1),
                    Cand::History(i) => Cand::History(i + 1),
                };
                true
            });
            n_eff += 1;
            if req.stop_tokens.contains(&token) {
                break;
            }
        }
    }

    /// A sequence is over: its output goes to the history and its answer to the recent ones.
    fn finish(&mut self, state: &SeqState) {
        self.answers.record(state.output.len(), state.covered);
        self.add_history(&state.output);
    }

    /// Appends a finished output to the history, dropping the oldest half when it is full.
    fn add_history(&mut self, output: &[TokenId]) {
        let cap = self.config.history_tokens;
        if cap == 0 || output.is_empty() {
            return;
        }
        let output = &output[output.len().saturating_sub(cap / 2)..];
        if self.history.len() + output.len() + 1 > cap {
            let drop = self.history.len().min(cap / 2).max(output.len() + 1);
            let drop = drop.min(self.history.len());
            self.history.drain(..drop);
            self.index.clear();
            for (p, &t) in self.history.iter().enumerate() {
                if t != SEP {
                    self.index.entry(t).or_default().push(p as u32);
                }
            }
        }
        for &t in output {
            self.index
                .entry(t)
                .or_default()
                .push(self.history.len() as u32);
            self.history.push(t);
        }
        self.history.push(SEP);
    }
}

/// The token a candidate reads next: the context, then this round's drafted tokens; the history up to
/// a separator.
fn next_token(
    c: Cand,
    ctx: &[TokenId],
    drafted: &[TokenId],
    history: &[TokenId],
) -> Option<TokenId> {
    match c {
        Cand::Context(i) if i < ctx.len() => Some(ctx[i]),
        Cand::Context(i) => drafted.get(i - ctx.len()).copied(),
        Cand::History(i) => history.get(i).copied().filter(|&t| t != SEP),
    }
}

impl Draft for LookupDrafter {
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
            self.propose_one(req, out);
        }
        Ok(())
    }

    /// Learns from the last proposal: its tokens up to the first one the target did not commit.
    fn commit(&mut self, seq: SeqId, committed: &[TokenId]) -> Result<(), Self::Error> {
        let state = self.seqs.entry(seq).or_default();
        let prompt_len = *state.prompt_len.get_or_insert(committed.len());
        let have = prompt_len + state.output.len();
        if committed.len() < have {
            state
                .output
                .truncate(committed.len().saturating_sub(prompt_len));
            if state.output.len() < crate::EARLY_LOOK_TOKENS {
                state.early = None;
            }
        } else if let Some(new) = committed.get(have..) {
            state.output.extend_from_slice(new);
        }
        if let Some(p) = state.pending.take() {
            let mut right = 0;
            for (i, (&t, &(b, raw))) in p.tokens.iter().zip(&p.buckets).enumerate() {
                let Some(&c) = committed.get(p.at + i) else {
                    break;
                };
                // Against the estimate the walk used: the bucket may have learned since.
                state.calibration.observe(f64::from(raw), c == t);
                self.buckets[b as usize].observe(c == t);
                if c != t {
                    break;
                }
                right += usize::from(i < p.kept);
            }
            // The drafted tokens it had right, and the target's token after them, which the same
            // round emits.
            if right > 0 {
                state.covered += right + usize::from(committed.len() > p.at + right);
            }
        }
        if state.early.is_none() && state.output.len() >= crate::EARLY_LOOK_TOKENS {
            state.early = Some((state.output.len(), state.covered));
        }
        Ok(())
    }

    /// Only the first `len` tokens of the last draft are scored: the walk's tokens after them are
    /// learnt from as the uncut rest of a walk is, and the answer's coverage counts the kept ones.
    fn truncated(&mut self, seq: SeqId, len: usize) {
        if let Some(p) = self.seqs.get_mut(&seq).and_then(|s| s.pending.as_mut()) {
            p.kept = p.kept.min(len);
        }
    }

    /// A new prompt for `seq`: an output it held (a caller that reuses the id without releasing it,
    /// like [`crate::generate`] for chat turns) goes to the history first.
    fn prefill(&mut self, seq: SeqId, context: &[TokenId]) -> Result<(), Self::Error> {
        if let Some(old) = self.seqs.remove(&seq) {
            self.finish(&old);
        }
        self.seqs.insert(
            seq,
            SeqState {
                prompt_len: Some(context.len()),
                ..SeqState::default()
            },
        );
        Ok(())
    }

    /// Adds the sequence's output to the history.
    fn release(&mut self, seq: SeqId) {
        if let Some(state) = self.seqs.remove(&seq) {
            self.finish(&state);
        }
    }

    fn model_drafts(&self, _seq: SeqId) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::RoundCosts;
    use crate::{CounterRng, SamplingParams};

    fn request<'a>(
        ctx: &'a [TokenId],
        max_len: usize,
        sampling: &'a SamplingParams,
        costs: Option<&'a RoundCosts>,
    ) -> DraftRequest<'a> {
        DraftRequest {
            seq: SeqId(0),
            context: ctx,
            max_len,
            sampling,
            rng: CounterRng::new(0),
            min_confidence: 0.0,
            costs,
            stop_tokens: &[],
        }
    }

    #[test]
    fn an_answer_records_the_tokens_its_drafts_had_right_and_the_token_after_them() {
        let sampling = SamplingParams::greedy();
        let mut d = LookupDrafter::default();
        // The prompt holds 1 ..= 10 once.
        let prompt: Vec<TokenId> = [9].into_iter().chain(1..=10).chain([9, 8]).collect();
        let Ok(()) = d.prefill(SeqId(0), &prompt);
        let mut ctx = prompt.clone();
        ctx.extend(1..=6);
        let Ok(()) = d.commit(SeqId(0), &ctx);
        // After 1 ..= 6 the walk drafts 7 8 9 10 (unpriced: kept whole).
        let mut out = Proposal::default();
        d.propose_one(&request(&ctx, 4, &sampling, None), &mut out);
        assert_eq!(out.tokens, [7, 8, 9, 10]);
        // The target accepts 7 8, rejects 9 and emits 77: 2 right, and the token after them.
        ctx.extend([7, 8, 77]);
        let Ok(()) = d.commit(SeqId(0), &ctx);
        // Nothing to draft after 77: nothing covered.
        d.propose_one(&request(&ctx, 4, &sampling, None), &mut out);
        assert!(out.tokens.is_empty());
        ctx.push(11);
        let Ok(()) = d.commit(SeqId(0), &ctx);
        // 10 tokens: not yet the answer of an early look.
        assert_eq!(d.early_answer(SeqId(0)), None);
        // Next, a walk its costs cut to nothing covers nothing, even where it would have been
        // right.
        let dear = RoundCosts {
            r: vec![1.0, 100.0, 100.0, 100.0, 100.0],
            ..RoundCosts::default()
        };
        ctx.extend(1..=6);
        let Ok(()) = d.commit(SeqId(0), &ctx);
        // (16 tokens, 3 covered: what an early look sees, kept as the answer goes on.)
        assert_eq!(d.early_answer(SeqId(0)), Some((16, 3)));
        d.propose_one(&request(&ctx, 4, &sampling, Some(&dear)), &mut out);
        assert!(out.tokens.is_empty());
        ctx.extend([7, 8]);
        let Ok(()) = d.commit(SeqId(0), &ctx);
        assert_eq!(d.answer(SeqId(0)), Some((18, 3)));
        assert_eq!(d.early_answer(SeqId(0)), Some((16, 3)));
        // A rollback below 16 tokens forgets it; it is taken again when the answer is back.
        let Ok(()) = d.commit(SeqId(0), &ctx[..ctx.len() - 4]);
        assert_eq!(d.early_answer(SeqId(0)), None);
        let Ok(()) = d.commit(SeqId(0), &ctx);
        assert_eq!(d.early_answer(SeqId(0)), Some((18, 3)));
        d.release(SeqId(0));
        // The answer: 1 ..= 8, 77, 11, 1 ..= 8: 18 tokens, of which 7, 8 and 77 were covered.
        let recent = d.recent_answers();
        assert_eq!(recent.len(), 1);
        assert_eq!(recent.expected_len(100), 18.0);
        assert_eq!(recent.coverage(), 3.0 / 18.0);
    }

    #[test]
    fn drafts_the_continuation_of_the_longest_match() {
        let greedy = SamplingParams::greedy();
        let mut d = LookupDrafter::default();
        // "1 2 3 9 9" earlier, "7 2 3 7 8" later: the suffix "2 3" matches both, "7 2 3" only the
        // second, whose continuation is "7 8".
        let ctx = [1, 2, 3, 9, 9, 5, 7, 2, 3, 7, 8, 6, 7, 2, 3];
        let mut out = Proposal::default();
        d.propose_one(&request(&ctx, 2, &greedy, None), &mut out);
        assert_eq!(out.tokens, [7, 8]);
        assert_eq!(out.confidence.len(), 2);
        assert!(out.confidence.iter().all(|&c| c > 0.0 && c < 1.0));
        // Nothing to match.
        d.propose_one(&request(&[4, 5, 6], 3, &greedy, None), &mut out);
        assert!(out.tokens.is_empty());
    }

    #[test]
    fn a_draft_ends_at_a_token_that_ends_the_generation() {
        let greedy = SamplingParams::greedy();
        let mut d = LookupDrafter::default();
        // "7 8 1 2" was followed by "3 0 5 6"; 0 ends the generation, so nothing after it is
        // drafted.
        let ctx = [7, 8, 1, 2, 3, 0, 5, 6, 9, 7, 8, 1, 2];
        let mut out = Proposal::default();
        let req = DraftRequest {
            stop_tokens: &[0],
            ..request(&ctx, 8, &greedy, None)
        };
        d.propose_one(&req, &mut out);
        assert_eq!(out.tokens, [3, 0]);
        d.propose_one(&request(&ctx, 8, &greedy, None), &mut out);
        assert!(out.tokens.starts_with(&[3, 0, 5]), "{:?}", out.tokens);
    }

    #[test]
    fn a_sequence_whose_drafts_fail_trusts_them_less_and_one_whose_drafts_pass_no_more() {
        let greedy = SamplingParams::greedy();
        let mut d = LookupDrafter::default();
        let ctx: Vec<TokenId> = vec![1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4];
        for seq in [SeqId(0), SeqId(1)] {
            d.prefill(seq, &ctx).unwrap();
        }
        let mut out = Proposal::default();
        // Round after round, sequence 0's draft is rejected at its first token and sequence 1's
        // accepted (each then rolled back to the same context).
        let mut committed = ctx.clone();
        for _ in 0..8 {
            for (seq, offset) in [(SeqId(0), 100), (SeqId(1), 0)] {
                let req = DraftRequest {
                    seq,
                    ..request(&committed, 4, &greedy, None)
                };
                d.propose_one(&req, &mut out);
                assert!(!out.tokens.is_empty());
                committed.push(out.tokens[0] + offset);
                d.commit(seq, &committed).unwrap();
                committed.truncate(ctx.len());
                d.commit(seq, &committed).unwrap();
            }
        }
        // Sequence `seq`'s draft after `ctx`.
        let propose = |d: &mut LookupDrafter, seq| {
            let mut out = Proposal::default();
            d.propose_one(
                &DraftRequest {
                    seq,
                    ..request(&ctx, 4, &greedy, None)
                },
                &mut out,
            );
            out
        };
        // Both sequences read the same buckets for the same context; only their own records
        // differ.
        let failing = propose(&mut d, SeqId(0));
        let passing = propose(&mut d, SeqId(1));
        assert_eq!(failing.tokens.first(), passing.tokens.first());
        assert!(
            failing.confidence[0] < 0.6 * passing.confidence[0],
            "{:?} {:?}",
            failing.confidence,
            passing.confidence
        );
        // Doing better than the buckets does not raise them: a sequence with no record of its
        // own reads the same estimates as the passing one.
        d.prefill(SeqId(2), &ctx).unwrap();
        let fresh = propose(&mut d, SeqId(2));
        assert_eq!(fresh.confidence, passing.confidence);
    }

    #[test]
    fn the_majority_continuation_wins_and_repetition_runs_into_the_draft() {
        let greedy = SamplingParams::greedy();
        let mut d = LookupDrafter::default();
        // After "5": 6 twice, 7 once.
        let ctx = [5, 6, 1, 5, 7, 2, 5, 6, 3, 5];
        let mut out = Proposal::default();
        d.propose_one(&request(&ctx, 1, &greedy, None), &mut out);
        assert_eq!(out.tokens, [6]);
        // A period-2 pattern continues past the end of the context into the draft.
        let ctx = [1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2];
        d.propose_one(&request(&ctx, 6, &greedy, None), &mut out);
        assert_eq!(out.tokens, [1, 2, 1, 2, 1, 2]);
    }

    #[test]
    fn earlier_outputs_are_found_and_estimates_learn() {
        let greedy = SamplingParams::greedy();
        let mut d = LookupDrafter::default();
        d.prefill(SeqId(0), &[1]).unwrap();
        let first: Vec<TokenId> = std::iter::once(1).chain(10..=20).collect();
        d.commit(SeqId(0), &first).unwrap();
        d.release(SeqId(0));
        assert_eq!(d.history_len(), 12);
        // A new sequence ending in "11 12 13 14" drafts the continuation from the history.
        let ctx = [2, 11, 12, 13, 14];
        d.prefill(SeqId(0), &ctx).unwrap();
        let mut out = Proposal::default();
        d.propose_one(&request(&ctx, 8, &greedy, None), &mut out);
        assert!(out.tokens.starts_with(&[15, 16]), "{:?}", out.tokens);
        let before = d.estimates();
        // The target commits "15 99": the first token accepted, the second rejected.
        d.commit(SeqId(0), &[2, 11, 12, 13, 14, 15, 99]).unwrap();
        let after = d.estimates();
        let moved: Vec<usize> = (0..before.len())
            .filter(|&i| before[i] != after[i])
            .collect();
        assert_eq!(moved.len(), 2, "{before:?} {after:?}");
        assert!(after[moved[0]] > before[moved[0]]);
        assert!(after[moved[1]] < before[moved[1]]);
    }

    #[test]
    fn the_cost_model_cuts_the_draft_where_it_stops_paying() {
        let greedy = SamplingParams::greedy();
        let mut d = LookupDrafter::default();
        let ctx: Vec<TokenId> = (0..40).chain(0..20).collect();
        let mut out = Proposal::default();
        d.propose_one(&request(&ctx, 16, &greedy, None), &mut out);
        assert_eq!(out.tokens.len(), 16);
        // Verification so expensive that one extra token costs a whole step: drafting never pays.
        let costs = RoundCosts {
            r: (1..=17).map(|m| m as f64).collect(),
            ..RoundCosts::default()
        };
        let rate = d.propose_one(&request(&ctx, 16, &greedy, Some(&costs)), &mut out);
        assert!(out.tokens.is_empty());
        assert_eq!(rate, 1.0);
        // Flat verification: draft it all.
        let costs = RoundCosts {
            r: vec![1.0; 17],
            ..RoundCosts::default()
        };
        let rate = d.propose_one(&request(&ctx, 16, &greedy, Some(&costs)), &mut out);
        assert_eq!(out.tokens, (20..36).collect::<Vec<_>>());
        assert!(rate > 2.0);
    }

    #[test]
    fn the_history_stays_bounded() {
        let mut d = LookupDrafter::new(LookupConfig {
            history_tokens: 100,
            ..LookupConfig::default()
        });
        for s in 0..50u64 {
            d.prefill(SeqId(s), &[0]).unwrap();
            let ctx: Vec<TokenId> = std::iter::once(0).chain(0..30).collect();
            d.commit(SeqId(s), &ctx).unwrap();
            d.release(SeqId(s));
            assert!(d.history_len() <= 100, "{}", d.history_len());
        }
        assert!(d
            .index
            .values()
            .flatten()
            .all(|&p| (p as usize) < d.history.len()));
    }
}
