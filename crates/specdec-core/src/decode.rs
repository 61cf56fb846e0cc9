//! The decode loop: propose → verify → commit → roll back the rejected positions, until the token
//! limit, a stop token, the context capacity or the caller says stop.

use std::ops::ControlFlow;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result, Side};
use crate::metrics::{Metrics, Round};
use crate::model::{Draft, DraftRequest, Logits, Proposal, Score, SeqId, Target};
use crate::policy::DraftLenPolicy;
use crate::rng::{CounterRng, Stream};
use crate::sampling::{Probs, Sampler, SamplingParams};
use crate::verify::{verify_greedy, verify_onehot, verify_rejection, Verdict, VerifyMode};
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
/// it is committed (return [`ControlFlow::Break`] to stop). Sequence `SeqId(0)` of both models is used.
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
    let mut run = Run {
        seq: SeqId(0),
        tokens: prompt.to_vec(),
        output: Output {
            tokens: Vec::new(),
            stop_reason: None,
            metrics: Metrics {
                prompt_tokens: prompt.len(),
                ..Metrics::default()
            },
        },
    };
    match run.go(target, drafter, config, on_token) {
        Ok(reason) => {
            run.output.stop_reason = Some(reason);
            Ok(run.output)
        }
        Err(error) => Err(DecodeError {
            output: Box::new(run.output),
            error,
        }),
    }
}

struct Run {
    seq: SeqId,
    /// The committed sequence, prompt included.
    tokens: Vec<TokenId>,
    output: Output,
}

impl Run {
    fn check_setup<T: Target, D: Draft>(
        &self,
        target: &T,
        drafter: &D,
        config: &GenerateConfig,
    ) -> Result<()> {
        config.validate()?;
        let vocab = target.vocab_size();
        if let Some(draft) = drafter.vocab_size() {
            if draft != vocab {
                return Err(Error::VocabMismatch {
                    draft,
                    target: vocab,
                });
            }
        }
        if self.tokens.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        if let Some(&token) = self.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::TokenOutOfRange {
                side: Side::Target,
                token,
                vocab,
            });
        }
        if self.tokens.len() >= target.capacity() {
            return Err(Error::ContextOverflow {
                len: self.tokens.len() + 1,
                capacity: target.capacity(),
            });
        }
        Ok(())
    }

    fn go<T: Target, D: Draft>(
        &mut self,
        target: &mut T,
        drafter: &mut D,
        config: &GenerateConfig,
        on_token: &mut dyn FnMut(TokenId) -> ControlFlow<()>,
    ) -> Result<StopReason> {
        self.check_setup(target, drafter, config)?;
        let vocab = target.vocab_size();
        let capacity = target.capacity();
        let rng = CounterRng::new(config.seed);
        let greedy = config.sampling.is_greedy();
        let mut sampler = Sampler::new(config.sampling.clone());
        let mut controller = config.draft_len.controller();
        let mut logits = [Logits::new(vocab)];
        let mut proposal = [Proposal::default()];
        let mut target_probs: Vec<Probs> = Vec::new();
        let mut residual = Vec::new();
        let mut history = Vec::new();
        if config.max_new_tokens == 0 {
            return Ok(StopReason::MaxTokens);
        }

        // Prefill: the prompt through both models; the target's last row gives the first token.
        let start = Instant::now();
        drafter
            .prefill(self.seq, &self.tokens)
            .map_err(|e| Error::model(Side::Draft, e))?;
        self.score(target, &[], &mut logits)?;
        target_probs.resize_with(1, || Probs::OneHot(0));
        sampler.probs(logits[0].row(0), &self.tokens, &mut target_probs[0])?;
        let pos = self.tokens.len();
        let first = target_probs[0].sample(rng.uniform(pos, Stream::Target));
        self.output.metrics.prefill_secs = start.elapsed().as_secs_f64();
        if let Some(reason) = self.emit(&[first], config, on_token) {
            self.commit(target, drafter)?;
            return Ok(reason);
        }

        let decode_start = Instant::now();
        let result = loop {
            let room = (config.max_new_tokens - self.output.tokens.len())
                .min(capacity.saturating_sub(self.tokens.len()));
            if room == 0 {
                break StopReason::ContextFull;
            }
            // Emitting at most k + 1 tokens must fit both the token limit and the context.
            let k = controller.next_draft_len().min(room - 1);
            let pos = self.tokens.len();

            let t0 = Instant::now();
            if k > 0 {
                let request = DraftRequest {
                    seq: self.seq,
                    context: &self.tokens,
                    max_len: k,
                    sampling: &config.sampling,
                    rng,
                    min_confidence: config.min_confidence,
                };
                drafter
                    .propose(&[request], &mut proposal)
                    .map_err(|e| Error::model(Side::Draft, e))?;
            } else {
                proposal[0].clear();
            }
            let draft = &proposal[0];
            check_proposal(draft, k, vocab)?;
            let draft_secs = t0.elapsed().as_secs_f64();

            let t1 = Instant::now();
            self.score(target, &draft.tokens, &mut logits)?;
            let verify_secs = t1.elapsed().as_secs_f64();

            // Target distributions, each with the history plain decoding would have at its position.
            let m = draft.tokens.len() + 1;
            target_probs.resize_with(m, || Probs::OneHot(0));
            history.clear();
            let window = config.sampling.penalty_last_n;
            history.extend_from_slice(&self.tokens[self.tokens.len().saturating_sub(window)..]);
            for (i, probs) in target_probs.iter_mut().enumerate() {
                if i > 0 {
                    history.push(draft.tokens[i - 1]);
                }
                sampler.probs(logits[0].row(i), &history, probs)?;
            }
            let verdict = if greedy {
                verify_greedy(&draft.tokens, &target_probs)
            } else {
                match config.verify_mode {
                    VerifyMode::OneHot => verify_onehot(&draft.tokens, &target_probs, &rng, pos),
                    VerifyMode::Rejection => verify_rejection(
                        &draft.tokens,
                        &draft.probs,
                        &target_probs,
                        &rng,
                        pos,
                        &mut residual,
                    ),
                }
            };
            let Verdict { accepted, next } = verdict;
            let mut emitted: Vec<TokenId> = draft.tokens[..accepted].to_vec();
            emitted.push(next);
            let before = self.output.tokens.len();
            let stop = self.emit(&emitted, config, on_token);
            let round = Round {
                drafted: draft.tokens.len(),
                accepted,
                emitted: self.output.tokens.len() - before,
                draft_secs,
                verify_secs,
                verified: m,
            };
            self.output.metrics.record(&round);
            controller.observe(&round);
            self.commit(target, drafter)?;
            if let Some(reason) = stop {
                break reason;
            }
        };
        self.output.metrics.decode_secs = decode_start.elapsed().as_secs_f64();
        Ok(result)
    }

    /// Scores the committed tokens plus `draft` with the target and checks the shape.
    fn score<T: Target>(
        &self,
        target: &mut T,
        draft: &[TokenId],
        out: &mut [Logits; 1],
    ) -> Result<()> {
        let vocab = target.vocab_size();
        out[0].reset(vocab);
        let request = Score {
            seq: self.seq,
            context: &self.tokens,
            draft,
        };
        target
            .score(&[request], out)
            .map_err(|e| Error::model(Side::Target, e))?;
        let got = &out[0];
        if got.vocab() != vocab {
            return Err(Error::ShapeMismatch {
                side: Side::Target,
                what: "logits row length",
                expected: vocab,
                got: got.vocab(),
            });
        }
        if got.rows() != draft.len() + 1 {
            return Err(Error::ShapeMismatch {
                side: Side::Target,
                what: "logits rows",
                expected: draft.len() + 1,
                got: got.rows(),
            });
        }
        Ok(())
    }

    /// Appends tokens until a stop condition; returns it if one was met.
    fn emit(
        &mut self,
        tokens: &[TokenId],
        config: &GenerateConfig,
        on_token: &mut dyn FnMut(TokenId) -> ControlFlow<()>,
    ) -> Option<StopReason> {
        for &t in tokens {
            if config.stop_tokens.contains(&t) {
                return Some(StopReason::StopToken(t));
            }
            self.tokens.push(t);
            self.output.tokens.push(t);
            if on_token(t).is_break() {
                return Some(StopReason::Cancelled);
            }
            if self.output.tokens.len() >= config.max_new_tokens {
                return Some(StopReason::MaxTokens);
            }
        }
        None
    }

    fn commit<T: Target, D: Draft>(&self, target: &mut T, drafter: &mut D) -> Result<()> {
        target
            .commit(self.seq, &self.tokens)
            .map_err(|e| Error::model(Side::Target, e))?;
        drafter
            .commit(self.seq, &self.tokens)
            .map_err(|e| Error::model(Side::Draft, e))
    }
}

fn check_proposal(p: &Proposal, k: usize, vocab: usize) -> Result<()> {
    if p.tokens.len() > k {
        return Err(Error::ShapeMismatch {
            side: Side::Draft,
            what: "drafted tokens (at most the draft length)",
            expected: k,
            got: p.tokens.len(),
        });
    }
    if p.probs.len() != p.tokens.len() {
        return Err(Error::ShapeMismatch {
            side: Side::Draft,
            what: "draft distributions (one per drafted token)",
            expected: p.tokens.len(),
            got: p.probs.len(),
        });
    }
    for (&token, q) in p.tokens.iter().zip(&p.probs) {
        if token as usize >= vocab {
            return Err(Error::TokenOutOfRange {
                side: Side::Draft,
                token,
                vocab,
            });
        }
        if let Probs::Dense(q) = q {
            if q.len() != vocab {
                return Err(Error::ShapeMismatch {
                    side: Side::Draft,
                    what: "draft distribution length",
                    expected: vocab,
                    got: q.len(),
                });
            }
        }
    }
    Ok(())
}
