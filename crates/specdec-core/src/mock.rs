//! Mock models for tests: deterministic logits that depend on the context in chosen ways, behind a
//! cache that behaves like a real one (prefix reuse, truncation, capacity), with failure injection.
//! Enabled by the `mock` feature so other crates' tests can use them.

use std::collections::HashMap;

use crate::model::{Logits, Score, SeqId, Target};
use crate::rng::philox4x32_10;
use crate::TokenId;

/// How a mock model's logits depend on the context.
#[derive(Clone, Debug, PartialEq)]
pub enum MockLogits {
    /// The same logits whatever the context.
    Fixed(Vec<f32>),
    /// `script[context.len() % script.len()]`: logits scripted by position.
    Scripted(Vec<Vec<f32>>),
    /// Pseudo-random logits seeded by a hash of the whole context, in `[-scale, scale]`.
    Hashed {
        /// Vocabulary size.
        vocab: usize,
        /// Seed of the hash.
        seed: u64,
        /// Half-width of the logit range; larger is more peaked.
        scale: f32,
    },
    /// The base logits negated: the most likely token becomes the least likely. An adversarial drafter
    /// that always disagrees with its base.
    Negated(Box<MockLogits>),
    /// The base logits plus context-seeded noise in `[-noise, noise]`: a drafter that mostly agrees.
    Perturbed {
        /// The logits perturbed.
        base: Box<MockLogits>,
        /// Seed of the noise.
        seed: u64,
        /// Half-width of the noise.
        noise: f32,
    },
}

impl MockLogits {
    /// The vocabulary size.
    pub fn vocab(&self) -> usize {
        match self {
            MockLogits::Fixed(v) => v.len(),
            MockLogits::Scripted(s) => s.first().map_or(0, Vec::len),
            MockLogits::Hashed { vocab, .. } => *vocab,
            MockLogits::Negated(b) | MockLogits::Perturbed { base: b, .. } => b.vocab(),
        }
    }

    /// The logits of the token that follows `context`.
    pub fn logits(&self, context: &[TokenId]) -> Vec<f32> {
        match self {
            MockLogits::Fixed(v) => v.clone(),
            MockLogits::Scripted(s) => s[context.len() % s.len()].clone(),
            MockLogits::Hashed { vocab, seed, scale } => {
                noise(hash(context, *seed), *vocab, *scale)
            }
            MockLogits::Negated(b) => b.logits(context).into_iter().map(|v| -v).collect(),
            MockLogits::Perturbed {
                base,
                seed,
                noise: n,
            } => {
                let mut v = base.logits(context);
                let e = noise(hash(context, *seed), v.len(), *n);
                for (x, e) in v.iter_mut().zip(e) {
                    *x += e;
                }
                v
            }
        }
    }
}

fn hash(context: &[TokenId], seed: u64) -> u64 {
    // FNV-1a over the tokens, then the seed.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &t in context.iter().chain(std::iter::once(&(seed as u32))) {
        for b in t
            .to_le_bytes()
            .into_iter()
            .chain((seed >> 32).to_le_bytes())
        {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

fn noise(h: u64, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|j| {
            let b = philox4x32_10([h as u32, (h >> 32) as u32, j as u32, 0], [0x5eed, 1]);
            let u = b[0] as f32 / u32::MAX as f32;
            scale * (2.0 * u - 1.0)
        })
        .collect()
}

/// What a mock model was asked to do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MockStats {
    /// `score` calls.
    pub calls: u64,
    /// Tokens fed through the model (not served from the cache).
    pub fed: u64,
    /// `commit` calls.
    pub commits: u64,
}

/// Why a mock model failed.
#[derive(Debug, thiserror::Error)]
pub enum MockError {
    /// The injected failure.
    #[error("injected failure at call {call}")]
    Injected {
        /// The failing call, counting from 1.
        call: u64,
    },
    /// The sequence would exceed the capacity.
    #[error("context overflow: {len} > {capacity}")]
    ContextOverflow {
        /// Tokens needed.
        len: usize,
        /// Capacity.
        capacity: usize,
    },
}

/// A model with scripted logits and a realistic cache.
#[derive(Clone, Debug)]
pub struct MockModel {
    logits: MockLogits,
    capacity: usize,
    cache: HashMap<SeqId, Vec<TokenId>>,
    stats: MockStats,
    fail_at_call: Option<u64>,
}

impl MockModel {
    /// A model with the given logits and a context of 4096.
    pub fn new(logits: MockLogits) -> Self {
        Self {
            logits,
            capacity: 4096,
            cache: HashMap::new(),
            stats: MockStats::default(),
            fail_at_call: None,
        }
    }

    /// Sets the capacity.
    pub fn with_capacity(mut self, capacity: usize) -> Self {
        self.capacity = capacity;
        self
    }

    /// Makes the `call`-th `score` call (counting from 1) fail.
    pub fn fail_at_call(mut self, call: u64) -> Self {
        self.fail_at_call = Some(call);
        self
    }

    /// The logits definition.
    pub fn logits(&self) -> &MockLogits {
        &self.logits
    }

    /// What the model was asked to do.
    pub fn stats(&self) -> MockStats {
        self.stats
    }

    /// The cached tokens of a sequence.
    pub fn cached_tokens(&self, seq: SeqId) -> &[TokenId] {
        self.cache.get(&seq).map_or(&[], Vec::as_slice)
    }
}

impl Target for MockModel {
    type Error = MockError;

    fn vocab_size(&self) -> usize {
        self.logits.vocab()
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn score(&mut self, batch: &[Score<'_>], out: &mut [Logits]) -> Result<(), MockError> {
        self.stats.calls += 1;
        if self.fail_at_call == Some(self.stats.calls) {
            return Err(MockError::Injected {
                call: self.stats.calls,
            });
        }
        let vocab = self.vocab_size();
        for (req, out) in batch.iter().zip(out.iter_mut()) {
            let full: Vec<TokenId> = req.context.iter().chain(req.draft).copied().collect();
            if full.len() > self.capacity {
                return Err(MockError::ContextOverflow {
                    len: full.len(),
                    capacity: self.capacity,
                });
            }
            let cached = self.cache.entry(req.seq).or_default();
            let common = cached.iter().zip(&full).take_while(|(a, b)| a == b).count();
            self.stats.fed += (full.len() - common) as u64;
            *cached = full.clone();
            out.reset(vocab);
            for i in 0..=req.draft.len() {
                out.push_row(&self.logits.logits(&full[..req.context.len() + i]));
            }
        }
        Ok(())
    }

    fn commit(&mut self, seq: SeqId, committed: &[TokenId]) -> Result<(), MockError> {
        self.stats.commits += 1;
        let cached = self.cache.entry(seq).or_default();
        let common = cached
            .iter()
            .zip(committed)
            .take_while(|(a, b)| a == b)
            .count();
        cached.truncate(common);
        Ok(())
    }

    fn release(&mut self, seq: SeqId) {
        self.cache.remove(&seq);
    }

    fn cached(&self, seq: SeqId, context: &[TokenId]) -> usize {
        self.cached_tokens(seq)
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count()
    }
}

/// The prices the tests of a prompt's reading use: a linear cost curve (`r(m) = 1 + 0.1 (m - 1)`,
/// to 17 tokens), a draft token at 0.25 steps, a prompt token read at 0.05, and 2-token model
/// drafts accepted at 0.8 and predicted at 1.5 tokens per step (2 steps a round), so that each
/// token the model drafts for saves a third of a step against plain decoding.
pub fn reading_costs() -> crate::RoundCosts {
    crate::RoundCosts {
        r: (1..=17).map(|m| 1.0 + 0.1 * (m - 1) as f64).collect(),
        draft_per_token: 0.25,
        prompt_read: 0.05,
        model_len: 2,
        model_rate: 1.5,
        model_steps: 2.0,
        model_acceptance: vec![0.8; 2],
        ..crate::RoundCosts::default()
    }
}

/// A request of up to 8 tokens of `seq` after `context`, sampled by `sampling` with the RNG of
/// seed 0, no confidence floor and no stop tokens: the request most drafter tests make.
pub fn draft_request<'a>(
    seq: crate::SeqId,
    context: &'a [crate::TokenId],
    sampling: &'a crate::SamplingParams,
    costs: Option<&'a crate::RoundCosts>,
) -> crate::DraftRequest<'a> {
    crate::DraftRequest {
        seq,
        context,
        max_len: 8,
        sampling,
        rng: crate::CounterRng::new(0),
        min_confidence: 0.0,
        costs,
        stop_tokens: &[],
    }
}
