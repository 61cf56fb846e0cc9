//! A session: shared immutable weights plus the mutable state of one sequence (KV cache and the tokens
//! in it). It implements the core's [`Target`], so it serves as the target and, through
//! [`specdec_core::ModelDrafter`], as the draft.

use std::sync::Arc;

use specdec_core::{Logits, Score, SeqId, Target, TokenId};

use crate::error::{Error, Result};
use crate::kv::KvCache;
use crate::model::Model;

/// Prompt tokens per forward pass during prefill; bounds the activations' memory.
pub const PREFILL_CHUNK: usize = 256;

/// One sequence's KV cache and the tokens whose keys and values it holds, in order: the state that
/// [`Session`] keeps for its one sequence and [`crate::Sessions`] for each of its sequences.
#[derive(Debug)]
pub(crate) struct Seq {
    pub(crate) cache: KvCache,
    pub(crate) tokens: Vec<TokenId>,
}

impl Seq {
    pub(crate) fn new(cache: KvCache) -> Self {
        Self {
            cache,
            tokens: Vec::new(),
        }
    }

    /// A sequence in `cache` holding the first `n` tokens of `src`, copied
    /// ([`KvCache::copy_prefix`]).
    pub(crate) fn copy_of(src: &Seq, n: usize, mut cache: KvCache) -> Result<Self> {
        cache.copy_prefix(&src.cache, n)?;
        Ok(Self {
            cache,
            tokens: src.tokens[..n].to_vec(),
        })
    }

    /// How many leading tokens the cache shares with `seq`.
    pub(crate) fn common_prefix(&self, seq: &[TokenId]) -> usize {
        common_prefix(&self.tokens, seq)
    }

    /// Rolls back to the first `len` tokens in O(1); growing is an error.
    pub(crate) fn rollback(&mut self, len: usize) -> Result<()> {
        self.cache.truncate(len)?;
        self.tokens.truncate(len);
        Ok(())
    }

    /// Readies the cache for a [`Target::score`] request and returns the tokens to feed: the cached
    /// prefix is kept, but the last context token is always fed again (its logits are the first row
    /// asked for), then the draft. The logits wanted are those of the last `draft.len() + 1` tokens.
    ///
    /// # Errors
    /// [`Error::EmptyContext`], or [`Error::ContextOverflow`] if context and draft exceed `capacity`.
    pub(crate) fn prepare(&mut self, req: &Score<'_>, capacity: usize) -> Result<Vec<TokenId>> {
        let ctx = req.context;
        if ctx.is_empty() {
            return Err(Error::EmptyContext);
        }
        let total = ctx.len() + req.draft.len();
        if total > capacity {
            return Err(Error::ContextOverflow {
                len: total,
                capacity,
            });
        }
        let keep = self.common_prefix(ctx).min(ctx.len() - 1);
        self.rollback(keep)?;
        let mut feed = Vec::with_capacity(total - keep);
        feed.extend_from_slice(&ctx[keep..]);
        feed.extend_from_slice(req.draft);
        Ok(feed)
    }

    /// [`Target::commit`]: keeps the cached tokens that agree with `committed`.
    pub(crate) fn commit(&mut self, committed: &[TokenId]) -> Result<()> {
        let keep = self.common_prefix(committed);
        self.rollback(keep)
    }
}

/// One sequence on a model.
#[derive(Debug)]
pub struct Session {
    model: Arc<Model>,
    seq: Seq,
    logits: Vec<f32>,
}

impl Session {
    /// A session with room for `capacity` tokens, clamped to the model's trained context.
    pub fn new(model: Arc<Model>, capacity: usize) -> Self {
        let capacity = capacity.min(model.config().ctx_train).max(1);
        Self {
            seq: Seq::new(model.cache(capacity)),
            model,
            logits: Vec::new(),
        }
    }

    /// The model.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The tokens in the cache.
    pub fn tokens(&self) -> &[TokenId] {
        &self.seq.tokens
    }

    /// The most tokens the session can hold.
    pub fn capacity(&self) -> usize {
        self.seq.cache.capacity()
    }

    /// Rolls back to the first `len` tokens in O(1); growing is an error.
    pub fn rollback(&mut self, len: usize) -> Result<()> {
        self.seq.rollback(len)
    }

    /// Appends `tokens` and returns the logits of the last `rows` of them (`[rows, vocab]`). Long
    /// inputs are fed in chunks of [`PREFILL_CHUNK`]; that changes no value (see [`crate::model`]).
    pub fn feed(&mut self, tokens: &[TokenId], rows: usize) -> Result<&[f32]> {
        let mut logits = std::mem::take(&mut self.logits);
        let r = self.feed_into(tokens, rows, &mut logits);
        self.logits = logits;
        r?;
        Ok(&self.logits)
    }

    /// [`Session::feed`], writing the logits into `logits` (cleared first) instead of the session's
    /// own buffer.
    pub fn feed_into(
        &mut self,
        tokens: &[TokenId],
        rows: usize,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let end = self.seq.tokens.len() + tokens.len();
        if end > self.capacity() {
            return Err(Error::ContextOverflow {
                len: end,
                capacity: self.capacity(),
            });
        }
        if rows > tokens.len() {
            return Err(Error::RowsOutOfRange {
                rows,
                tokens: tokens.len(),
            });
        }
        let (head, tail) = tokens.split_at(tokens.len() - tail_len(tokens.len(), rows));
        for chunk in head.chunks(PREFILL_CHUNK) {
            self.step(chunk, 0, logits)?;
        }
        logits.clear();
        self.step(tail, rows, logits)
    }

    fn step(&mut self, tokens: &[TokenId], rows: usize, logits: &mut Vec<f32>) -> Result<()> {
        if tokens.is_empty() {
            return Ok(());
        }
        // A failed pass leaves the cache as it was: `forward` marks positions valid only at the end.
        self.model
            .forward(&mut self.seq.cache, tokens, rows, logits)?;
        self.seq.tokens.extend_from_slice(tokens);
        Ok(())
    }
}

/// How many of `len` tokens to feed go in the last pass, the one that returns the logits of the last
/// `rows`: up to [`PREFILL_CHUNK`] (or `rows`, if more), so that a few tokens before the rows (the
/// last token a verification added, the tokens a drafter missed) share their pass instead of
/// costing one of their own. The others go first, in chunks. (`Sessions` shares one chunk among
/// the sequences of a batch.)
fn tail_len(len: usize, rows: usize) -> usize {
    len.min(rows.max(PREFILL_CHUNK))
}

/// How many leading tokens `a` and `b` share.
fn common_prefix(a: &[TokenId], b: &[TokenId]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Target for Session {
    type Error = Error;

    fn vocab_size(&self) -> usize {
        self.model.config().vocab
    }

    fn capacity(&self) -> usize {
        self.seq.cache.capacity()
    }

    fn score(&mut self, batch: &[Score<'_>], out: &mut [Logits]) -> Result<()> {
        let [req] = batch else {
            return Err(Error::BatchUnsupported(batch.len()));
        };
        let capacity = self.capacity();
        let feed = self.seq.prepare(req, capacity)?;
        let rows = req.draft.len() + 1;
        let vocab = self.vocab_size();
        // The logits go straight into the verifier's buffer.
        out[0].fill_with(vocab, |buf| self.feed_into(&feed, rows, buf))
    }

    fn commit(&mut self, _seq: SeqId, committed: &[TokenId]) -> Result<()> {
        self.seq.commit(committed)
    }

    fn cached(&self, _seq: SeqId, context: &[TokenId]) -> usize {
        self.seq.common_prefix(context)
    }
}
