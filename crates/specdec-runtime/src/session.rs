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

/// One sequence on a model.
#[derive(Debug)]
pub struct Session {
    model: Arc<Model>,
    cache: KvCache,
    /// The tokens whose keys and values the cache holds, in order.
    tokens: Vec<TokenId>,
    logits: Vec<f32>,
}

impl Session {
    /// A session with room for `capacity` tokens, clamped to the model's trained context.
    pub fn new(model: Arc<Model>, capacity: usize) -> Self {
        let capacity = capacity.min(model.config().ctx_train).max(1);
        Self {
            cache: model.cache(capacity),
            model,
            tokens: Vec::new(),
            logits: Vec::new(),
        }
    }

    /// The model.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The tokens in the cache.
    pub fn tokens(&self) -> &[TokenId] {
        &self.tokens
    }

    /// The most tokens the session can hold.
    pub fn capacity(&self) -> usize {
        self.cache.capacity()
    }

    /// Rolls back to the first `len` tokens in O(1); growing is an error.
    pub fn rollback(&mut self, len: usize) -> Result<()> {
        self.cache.truncate(len)?;
        self.tokens.truncate(len);
        Ok(())
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
        let end = self.tokens.len() + tokens.len();
        if end > self.cache.capacity() {
            return Err(Error::ContextOverflow {
                len: end,
                capacity: self.cache.capacity(),
            });
        }
        if rows > tokens.len() {
            return Err(Error::RowsOutOfRange {
                rows,
                tokens: tokens.len(),
            });
        }
        let split = tokens.len() - rows;
        let (head, tail) = tokens.split_at(split);
        for chunk in head.chunks(PREFILL_CHUNK) {
            self.step(chunk, 0, logits)?;
        }
        // The positions whose logits are wanted go in one pass of their own.
        logits.clear();
        self.step(tail, rows, logits)
    }

    fn step(&mut self, tokens: &[TokenId], rows: usize, logits: &mut Vec<f32>) -> Result<()> {
        if tokens.is_empty() {
            return Ok(());
        }
        // A failed pass leaves the cache as it was: `forward` marks positions valid only at the end.
        self.model.forward(&mut self.cache, tokens, rows, logits)?;
        self.tokens.extend_from_slice(tokens);
        Ok(())
    }

    fn common_prefix(&self, seq: &[TokenId]) -> usize {
        common_prefix(&self.tokens, seq)
    }
}

/// How many leading tokens `a` and `b` share.
pub(crate) fn common_prefix(a: &[TokenId], b: &[TokenId]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Target for Session {
    type Error = Error;

    fn vocab_size(&self) -> usize {
        self.model.config().vocab
    }

    fn capacity(&self) -> usize {
        self.cache.capacity()
    }

    fn score(&mut self, batch: &[Score<'_>], out: &mut [Logits]) -> Result<()> {
        let [req] = batch else {
            return Err(Error::BatchUnsupported(batch.len()));
        };
        let ctx = req.context;
        if ctx.is_empty() {
            return Err(Error::EmptyContext);
        }
        let total = ctx.len() + req.draft.len();
        if total > self.cache.capacity() {
            return Err(Error::ContextOverflow {
                len: total,
                capacity: self.cache.capacity(),
            });
        }
        // Reuse the cached prefix, but re-run from the last context token: its logits are the first
        // row asked for.
        let keep = self.common_prefix(ctx).min(ctx.len() - 1);
        self.rollback(keep)?;
        let mut feed = Vec::with_capacity(total - keep);
        feed.extend_from_slice(&ctx[keep..]);
        feed.extend_from_slice(req.draft);
        let rows = req.draft.len() + 1;
        let vocab = self.vocab_size();
        // The logits go straight into the verifier's buffer.
        out[0].fill_with(vocab, |buf| self.feed_into(&feed, rows, buf))
    }

    fn commit(&mut self, _seq: SeqId, committed: &[TokenId]) -> Result<()> {
        let keep = self.common_prefix(committed);
        self.rollback(keep)
    }
}
