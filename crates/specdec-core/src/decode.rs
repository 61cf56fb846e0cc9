//! The decode loop: propose → verify → commit → roll back the rejected positions, until the token
//! limit, a stop token, the context capacity or the caller says stop.

use std::ops::ControlFlow;

use serde::{Deserialize, Serialize};

use crate::batch::Batch;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::model::{Draft, SeqId, Target};
use crate::policy::DraftLenPolicy;
use crate::sampling::SamplingParams;
use crate::verify::VerifyMode;
use crate::TokenId;

/// Everything that shapes one generation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GenerateConfig {
    /// Generate at most this many tokens.
    pub max_new_tokens: usize,
    /// Stop after any of these (the stop token itself is not part of the output).
    pub stop_tokens: Vec<TokenId>,
    /// How logits become distributions.
    pub sampling: SamplingParams,
    /// Seed of the counter-based RNG.
    pub seed: u64,
    /// How sampled drafts are verified (greedy decoding always uses the argmax path).
    pub verify_mode: VerifyMode,
    /// How many tokens to draft each round.
    pub draft_len: DraftLenPolicy,
    /// The drafter ends a round early at a position where its largest probability is below this
    /// (decided from the draft distribution alone, before drawing, so drafts still follow it); 0
    /// never stops.
    pub min_confidence: f32,
}

impl Default for GenerateConfig {
    fn default() -> Self {
        Self {
            max_new_tokens: 128,
            stop_tokens: Vec::new(),
            sampling: SamplingParams::default(),
            seed: 0,
            verify_mode: VerifyMode::default(),
            draft_len: DraftLenPolicy::default(),
            min_confidence: 0.0,
        }
    }
}

impl GenerateConfig {
    /// Checks every value.
    pub fn validate(&self) -> Result<()> {
        self.sampling.validate()?;
        self.draft_len.validate()?;
        if !(0.0..=1.0).contains(&self.min_confidence) {
            return Err(Error::config(
                "min_confidence",
                self.min_confidence,
                "a number in [0, 1]",
            ));
        }
        Ok(())
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reason", content = "token", rename_all = "snake_case")]
pub enum StopReason {
    /// `max_new_tokens` were generated.
    MaxTokens,
    /// A stop token was generated.
    StopToken(TokenId),
    /// The sequence filled the context.
    ContextFull,
    /// The token callback asked to stop.
    Cancelled,
}

/// The result of a generation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Output {
    /// Generated tokens (prompt and stop token excluded).
    pub tokens: Vec<TokenId>,
    /// Why it ended; `None` only inside a [`DecodeError`].
    pub stop_reason: Option<StopReason>,
    /// Counters and timings.
    pub metrics: Metrics,
}

/// A generation that failed part-way, with everything committed before the failure.
#[derive(Debug, thiserror::Error)]
#[error("{error} (after {} generated tokens)", output.tokens.len())]
pub struct DecodeError {
    /// The tokens committed before the failure, and the metrics so far.
    pub output: Box<Output>,
    /// What went wrong.
    #[source]
    pub error: Error,
}

/// Generates from `prompt` with `target`, drafting with `drafter`, calling `on_token` with each token as
/// it is committed (return [`ControlFlow::Break`] to stop). Sequence `SeqId(0)` of both models is used,
/// and its caches are kept, so a later call that extends this sequence reuses them. A [`Batch`] of one.
///
/// invariant: the loop never emits more than `max_new_tokens`, never lets the sequence exceed the
/// target's capacity, and on a model failure returns every token committed before it.
pub fn generate<T: Target, D: Draft>(
    target: &mut T,
    drafter: &mut D,
    prompt: &[TokenId],
    config: &GenerateConfig,
    on_token: &mut dyn FnMut(TokenId) -> ControlFlow<()>,
) -> Result<Output, DecodeError> {
    let mut batch = Batch::new(target, drafter);
    if let Err(error) = batch.add(SeqId(0), prompt.to_vec(), config.clone(), None) {
        return Err(DecodeError {
            output: Box::new(Output {
                tokens: Vec::new(),
                stop_reason: None,
                metrics: Metrics {
                    prompt_tokens: prompt.len(),
                    ..Metrics::default()
                },
            }),
            error,
        });
    }
    loop {
        let mut done = batch.step(&mut |_, e| on_token(e.token));
        if let Some(f) = done.pop() {
            return f.result;
        }
    }
}
