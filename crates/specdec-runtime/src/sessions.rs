//! Many sequences on one model: a KV cache per [`SeqId`], and a batched [`Target::score`] that runs the
//! blocks of every sequence in the batch through one forward pass, so concurrent sequences share each
//! read of the weights. A sequence's logits are those of a [`crate::Session`] of its own, bit for bit
//! (see [`crate::model`]).
//!
//! Prefix caching: a released sequence's cache is kept (up to [`SPARE_CACHES`], least recently
//! released dropped first) with its tokens, and a new sequence starts from the kept cache that shares
//! the longest prefix with its context, so a shared system prompt or the history of a chat is not
//! computed again. Where a sequence still running shares a longer prefix (requests with the same
//! system prompt or documents, one arriving while another is answered), the new sequence gets a
//! cache of its own with a copy of that prefix's keys and values instead (from [`MIN_COPY`]
//! tokens; [`Target::min_prefix_copy`], so that a batch lets a new sequence wait while an earlier
//! one computes the prefix they share, and then copy it). Keys and values of a token prefix do not
//! depend on how they were computed (blocks, batches and single steps give the same bits), so this
//! changes no output.

use std::collections::HashMap;
use std::sync::Arc;

use specdec_core::{Logits, Score, SeqId, Target, TokenId};

use crate::error::{Error, Result};
use crate::model::{Model, Part, Scratch};
use crate::session::{Seq, PREFILL_CHUNK};

/// Released caches kept for reuse (and their prefixes), at most this many.
pub const SPARE_CACHES: usize = 8;

/// The shortest prefix a new sequence copies from a live one: a copy costs a fresh cache's
/// memory, and computing a few tokens costs about one step.
pub const MIN_COPY: usize = 16;

/// Where a new sequence's cache comes from ([`Sessions::start`]).
enum Start<'a> {
    /// A copy of this running sequence's first `n` positions.
    Copy(&'a Seq, usize),
    /// Kept cache `i`, whose first `n` positions the sequence shares.
    Spare(usize, usize),
    /// A new, empty cache.
    Fresh,
}

/// Sequences on a shared model, each with its own KV cache of `capacity` positions, created on first
/// use and freed by [`Target::release`].
#[derive(Debug)]
pub struct Sessions {
    model: Arc<Model>,
    capacity: usize,
    max_seqs: usize,
    seqs: HashMap<SeqId, Seq>,
    /// Released sequences, oldest first.
    spare: Vec<Seq>,
    scratch: Scratch,
    reused_tokens: u64,
}

impl Sessions {
    /// Room for `capacity` tokens per sequence (clamped to the model's trained context) and at most
    /// `max_seqs` sequences at a time.
    pub fn new(model: Arc<Model>, capacity: usize, max_seqs: usize) -> Self {
        let capacity = capacity.min(model.config().ctx_train).max(1);
        Self {
            model,
            capacity,
            max_seqs: max_seqs.max(1),
            seqs: HashMap::new(),
            spare: Vec::new(),
            scratch: Scratch::default(),
            reused_tokens: 0,
        }
    }

    /// The model.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Sequences holding a cache.
    pub fn active(&self) -> usize {
        self.seqs.len()
    }

    /// The tokens cached for `seq` (empty if none).
    pub fn tokens(&self, seq: SeqId) -> &[TokenId] {
        self.seqs.get(&seq).map_or(&[], |s| &s.tokens)
    }

    /// Where a new sequence with `context` starts: the kept cache sharing the longest prefix with
    /// it, or a copy of a running sequence's (one in the map or in `taken`) where that is longer
    /// and at least [`MIN_COPY`] tokens, else a new cache. [`Sessions::take`] takes it and
    /// [`Target::cached`] reports it, so the two agree.
    fn start<'a>(&'a self, taken: &'a [Seq], context: &[TokenId]) -> Start<'a> {
        // Longest shared prefix first; among equals the oldest, the first to be dropped anyway.
        let spare = self
            .spare
            .iter()
            .enumerate()
            .map(|(i, s)| (s.common_prefix(context), i))
            .max_by_key(|&(n, i)| (n, usize::MAX - i));
        let live = self
            .seqs
            .values()
            .chain(taken)
            .map(|s| (s.common_prefix(context), s))
            .max_by_key(|&(n, _)| n);
        match (spare, live) {
            (spare, Some((n, src))) if n >= MIN_COPY && n > spare.map_or(0, |s| s.0) => {
                Start::Copy(src, n)
            }
            (Some((n, i)), _) => Start::Spare(i, n),
            (None, _) => Start::Fresh,
        }
    }

    /// The cache of `id`, taken out of the map (`taken` others already are); for a new sequence,
    /// where [`Sessions::start`] says.
    fn take(&mut self, id: SeqId, taken: &[Seq], context: &[TokenId]) -> Result<Seq> {
        if let Some(s) = self.seqs.remove(&id) {
            return Ok(s);
        }
        if self.seqs.len() + taken.len() >= self.max_seqs {
            return Err(Error::TooManySequences { max: self.max_seqs });
        }
        let (s, reused) = match self.start(taken, context) {
            Start::Copy(src, n) => (Seq::copy_of(src, n, self.model.cache(self.capacity))?, n),
            Start::Spare(i, n) => {
                let mut s = self.spare.remove(i);
                s.rollback(n)?;
                (s, n)
            }
            Start::Fresh => (Seq::new(self.model.cache(self.capacity)), 0),
        };
        self.reused_tokens += reused as u64;
        Ok(s)
    }

    /// Context tokens whose keys and values came from a released sequence's cache, or were copied
    /// from a running one's, instead of being computed, since the sessions were made.
    pub fn reused_tokens(&self) -> u64 {
        self.reused_tokens
    }

    fn score_taken(
        &mut self,
        batch: &[Score<'_>],
        seqs: &mut [Seq],
        out: &mut [Logits],
    ) -> Result<()> {
        // What each sequence must feed: from the end of its cached prefix (at least the last context
        // token, whose logits are the first row asked for) to the end of its draft.
        let mut feeds = Vec::with_capacity(batch.len());
        for (req, s) in batch.iter().zip(seqs.iter_mut()) {
            feeds.push(s.prepare(req, self.capacity)?);
        }
        // The last pass holds every sequence's rows asked for and, within one `PREFILL_CHUNK` for
        // the whole batch, tokens just before them (as `Session::feed` does): a drafter that
        // missed the last verified token reads it there instead of in a pass of its own.
        let mut budget =
            PREFILL_CHUNK.saturating_sub(batch.iter().map(|r| r.draft.len() + 1).sum::<usize>());
        let tails: Vec<usize> = batch
            .iter()
            .zip(&feeds)
            .map(|(req, feed)| {
                let rows = req.draft.len() + 1;
                let extra = (feed.len() - rows).min(budget);
                budget -= extra;
                rows + extra
            })
            .collect();
        // Long prompts first, up to those tails: in rounds of one chunk per sequence, all
        // sequences' chunks of a round in one pass, at most `PREFILL_CHUNK` rows per pass.
        let heads: Vec<&[TokenId]> = feeds
            .iter()
            .zip(&tails)
            .map(|(feed, &tail)| &feed[..feed.len() - tail])
            .collect();
        let mut done = vec![0; heads.len()];
        let mut ignored: Vec<Vec<f32>> = vec![Vec::new(); heads.len()];
        loop {
            let mut budget = PREFILL_CHUNK;
            let mut parts = Vec::new();
            for (((s, head), at), logits) in seqs
                .iter_mut()
                .zip(&heads)
                .zip(done.iter_mut())
                .zip(ignored.iter_mut())
            {
                let n = (head.len() - *at).min(budget);
                if n == 0 {
                    continue;
                }
                budget -= n;
                parts.push((
                    Part {
                        cache: &mut s.cache,
                        tokens: &head[*at..*at + n],
                        logits_rows: 0,
                        logits,
                    },
                    &mut s.tokens,
                ));
                *at += n;
            }
            if parts.is_empty() {
                break;
            }
            let (mut passes, tokens): (Vec<Part<'_>>, Vec<&mut Vec<TokenId>>) =
                parts.into_iter().unzip();
            self.model.forward_parts(&mut passes, &mut self.scratch)?;
            for (p, t) in passes.iter().zip(tokens) {
                t.extend_from_slice(p.tokens);
            }
        }
        // Then the tails, of every sequence, in one pass, the rows asked for straight into the
        // callers' buffers.
        let vocab = self.model.config().vocab;
        let mut parts: Vec<Part<'_>> = batch
            .iter()
            .zip(seqs.iter_mut())
            .zip(feeds.iter().zip(&tails))
            .zip(out.iter_mut())
            .map(|(((req, s), (feed, &tail)), out)| {
                let rows = req.draft.len() + 1;
                Part {
                    cache: &mut s.cache,
                    tokens: &feed[feed.len() - tail..],
                    logits_rows: rows,
                    logits: out.buffer(vocab),
                }
            })
            .collect();
        let r = self.model.forward_parts(&mut parts, &mut self.scratch);
        drop(parts);
        if let Err(e) = r {
            out.iter_mut().for_each(|o| o.reset(vocab));
            return Err(e);
        }
        for ((s, feed), &tail) in seqs.iter_mut().zip(&feeds).zip(&tails) {
            s.tokens.extend_from_slice(&feed[feed.len() - tail..]);
        }
        Ok(())
    }
}

impl Target for Sessions {
    type Error = Error;

    fn vocab_size(&self) -> usize {
        self.model.config().vocab
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn score(&mut self, batch: &[Score<'_>], out: &mut [Logits]) -> Result<()> {
        if out.len() < batch.len() {
            return Err(Error::BatchUnsupported(batch.len()));
        }
        for (i, r) in batch.iter().enumerate() {
            if batch[..i].iter().any(|o| o.seq == r.seq) {
                return Err(Error::DuplicateSequence(r.seq.0));
            }
        }
        let mut seqs = Vec::with_capacity(batch.len());
        let mut r = Ok(());
        for req in batch {
            match self.take(req.seq, &seqs, req.context) {
                Ok(s) => seqs.push(s),
                Err(e) => {
                    r = Err(e);
                    break;
                }
            }
        }
        if r.is_ok() {
            r = self.score_taken(batch, &mut seqs, out);
        }
        // Every cache goes back, whatever happened (a failed pass marks no position valid).
        for (req, s) in batch.iter().zip(seqs) {
            self.seqs.insert(req.seq, s);
        }
        r
    }

    /// The sequence's cached prefix of `context`; for a sequence not yet scored, that of the
    /// released cache it would take over, or of the live sequence it would copy.
    fn cached(&self, seq: SeqId, context: &[TokenId]) -> usize {
        match self.seqs.get(&seq) {
            Some(s) => s.common_prefix(context),
            None => match self.start(&[], context) {
                Start::Copy(_, n) | Start::Spare(_, n) => n,
                Start::Fresh => 0,
            },
        }
    }

    /// Takes the cache a new sequence starts from now (a released one's shared prefix, or a copy
    /// of a running one's: see the module), so that another new sequence claimed after it counts
    /// it as running and copies from it instead of counting the same released cache twice.
    fn claim(&mut self, seq: SeqId, context: &[TokenId]) -> Result<usize> {
        let s = self.take(seq, &[], context)?;
        let n = s.common_prefix(context);
        self.seqs.insert(seq, s);
        Ok(n)
    }

    fn min_prefix_copy(&self) -> Option<usize> {
        Some(MIN_COPY)
    }

    fn commit(&mut self, seq: SeqId, committed: &[TokenId]) -> Result<()> {
        match self.seqs.get_mut(&seq) {
            Some(s) => s.commit(committed),
            None => Ok(()),
        }
    }

    fn release(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.remove(&seq) {
            if self.spare.len() >= SPARE_CACHES {
                self.spare.remove(0);
            }
            self.spare.push(s);
        }
    }
}
