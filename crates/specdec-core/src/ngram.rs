//! Model-free drafting: plain prompt lookup over the committed context, and a hybrid of the learning
//! lookup ([`LookupDrafter`]) and a model drafter.

use crate::lookup::LookupDrafter;
use crate::model::{Draft, DraftRequest, Proposal, SeqId};
use crate::sampling::Probs;
use crate::TokenId;

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
}

/// Lookup or a model draft, whichever pays more this round. With a cost model
/// ([`DraftRequest::costs`]) the lookup draft's expected tokens per unit of time (from its own
/// acceptance estimates) is weighed against the model draft's ([`crate::RoundCosts::model_rate`]);
/// without one, lookup drafts when it finds a match and the model otherwise.
#[derive(Debug)]
pub struct HybridDrafter<D> {
    /// The lookup drafter.
    pub lookup: LookupDrafter,
    /// The model drafter.
    pub model: D,
}

/// Whether a hybrid should draft with the model rather than use the lookup draft `lookup` whose
/// expected tokens per target step is `lookup_rate` (from [`LookupDrafter::propose_one`]).
pub fn prefer_model(req: &DraftRequest<'_>, lookup: &Proposal, lookup_rate: f64) -> bool {
    match req.costs {
        Some(c) => c.model_len > 0 && c.model_rate > lookup_rate * c.lookup_factor,
        None => lookup.tokens.is_empty(),
    }
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
        let mut fallback = Vec::new();
        for (b, (req, out)) in batch.iter().zip(out.iter_mut()).enumerate() {
            let rate = self.lookup.propose_one(req, out);
            if prefer_model(req, out, rate) {
                fallback.push(b);
            }
        }
        if fallback.is_empty() {
            return Ok(());
        }
        let requests: Vec<DraftRequest<'_>> = fallback.iter().map(|&b| batch[b]).collect();
        let mut proposals: Vec<Proposal> = fallback
            .iter()
            .map(|&b| std::mem::take(&mut out[b]))
            .collect();
        let r = self.model.propose(&requests, &mut proposals);
        for (&b, p) in fallback.iter().zip(proposals) {
            out[b] = p;
        }
        r
    }

    fn commit(&mut self, seq: SeqId, committed: &[TokenId]) -> Result<(), Self::Error> {
        let Ok(()) = self.lookup.commit(seq, committed);
        self.model.commit(seq, committed)
    }

    /// Both read the prompt now, so the model's first drafting round does not pay for it: a round's
    /// costs, as the cost model prices them, leave out catching up on a whole prompt. (The server's
    /// drafter reads it lazily instead, where a sequence that never drafts with the model is common.)
    fn prefill(&mut self, seq: SeqId, context: &[TokenId]) -> Result<(), Self::Error> {
        let Ok(()) = self.lookup.prefill(seq, context);
        self.model.prefill(seq, context)
    }

    fn release(&mut self, seq: SeqId) {
        self.lookup.release(seq);
        self.model.release(seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
