//! Model-free drafting: prompt lookup over the committed context, and a hybrid that falls back to a
//! model drafter when lookup finds nothing.

use crate::model::{Draft, DraftRequest, Proposal, SeqId};
use crate::sampling::Probs;
use crate::TokenId;

/// Prompt lookup (n-gram) drafting: find the most recent earlier occurrence of the context's last `n`
/// tokens, for `n` from `max_n` down to `min_n`, and propose the tokens that followed it, one-hot.
/// Costs microseconds, and pays on inputs that repeat themselves (code edits, quoting, summaries).
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
            for &t in self.lookup(req.context, req.max_len) {
                out.push(t, Probs::OneHot(t));
            }
        }
        Ok(())
    }

    fn commit(&mut self, _seq: SeqId, _committed: &[TokenId]) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// Prompt lookup first; when it finds nothing for a sequence, the model drafter proposes instead.
#[derive(Debug)]
pub struct HybridDrafter<D> {
    /// The lookup drafter.
    pub ngram: NGramDrafter,
    /// The fallback.
    pub model: D,
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
            out.clear();
            let hit = self.ngram.lookup(req.context, req.max_len);
            if hit.is_empty() {
                fallback.push(b);
            }
            for &t in hit {
                out.push(t, Probs::OneHot(t));
            }
        }
        if fallback.is_empty() {
            return Ok(());
        }
        let requests: Vec<DraftRequest<'_>> = fallback.iter().map(|&b| batch[b]).collect();
        let mut proposals = vec![Proposal::default(); requests.len()];
        self.model.propose(&requests, &mut proposals)?;
        for (b, p) in fallback.into_iter().zip(proposals) {
            out[b] = p;
        }
        Ok(())
    }

    fn commit(&mut self, seq: SeqId, committed: &[TokenId]) -> Result<(), Self::Error> {
        self.model.commit(seq, committed)
    }

    fn prefill(&mut self, seq: SeqId, context: &[TokenId]) -> Result<(), Self::Error> {
        self.model.prefill(seq, context)
    }

    fn release(&mut self, seq: SeqId) {
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
