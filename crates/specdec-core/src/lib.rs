//! # specdec-core
//!
//! Lossless speculative decoding as pure Rust: no tensors, no files, no network, no async.
//!
//! A cheap [`Draft`] proposes up to `k` tokens after the committed context; the [`Target`] scores the
//! context plus all `k` in one call and returns `k + 1` rows of logits; [`verify`] decides how many
//! drafted tokens to accept and which token comes next, so that the output follows the target's
//! distribution exactly (with greedy decoding: the target's greedy output, token for token).
//!
//! - [`model`]: the [`Target`] and [`Draft`] traits (batched), [`NoDraft`] (plain decoding).
//! - [`drafter`]: [`ModelDrafter`], any target-like model used as a drafter.
//! - [`lookup`]: [`LookupDrafter`], lookup over the context and earlier outputs that estimates its own
//!   acceptance (after SuffixDecoding).
//! - [`ngram`]: [`NGramDrafter`] (plain prompt lookup) and [`HybridDrafter`] (lookup or a model draft,
//!   whichever pays more each round).
//! - [`sampling`]: temperature, top-k, top-p, min-p and penalties, applied identically everywhere.
//! - [`verify`]: greedy, one-hot and rejection-sampling verification, single and batched.
//! - [`rng`]: Philox4x32-10, a counter-based RNG keyed by (seed, position, stream).
//! - [`policy`]: fixed, adaptive and cost-model draft lengths.
//! - [`metrics`]: acceptance, mean accepted length, timings, the cost profile and predicted speedup.
//! - [`decode`]: the loop that ties them together; [`batch`]: the same for many sequences at once
//!   (continuous batching).
//!
//! ```
//! use specdec_core::mock::{MockLogits, MockModel};
//! use specdec_core::{generate, GenerateConfig, ModelDrafter, NoDraft, SamplingParams};
//! use std::ops::ControlFlow;
//!
//! let target_logits = MockLogits::Hashed { vocab: 32, seed: 1, scale: 4.0 };
//! let draft_logits = MockLogits::Perturbed {
//!     base: Box::new(target_logits.clone()),
//!     seed: 2,
//!     noise: 1.0,
//! };
//! let config = GenerateConfig {
//!     max_new_tokens: 20,
//!     sampling: SamplingParams::greedy(),
//!     ..GenerateConfig::default()
//! };
//! let prompt = [1, 2, 3];
//!
//! let mut target = MockModel::new(target_logits.clone());
//! let mut drafter = ModelDrafter::new(MockModel::new(draft_logits));
//! let speculative =
//!     generate(&mut target, &mut drafter, &prompt, &config, &mut |_| ControlFlow::Continue(()))?;
//!
//! let mut target = MockModel::new(target_logits);
//! let plain = generate(&mut target, &mut NoDraft, &prompt, &config, &mut |_| ControlFlow::Continue(()))?;
//!
//! // Greedy speculative decoding is lossless: the same tokens as plain decoding.
//! assert_eq!(speculative.tokens, plain.tokens);
//! assert_eq!(speculative.tokens.len(), 20);
//! # Ok::<(), specdec_core::DecodeError>(())
//! ```

pub mod batch;
pub mod decode;
pub mod drafter;
pub mod error;
mod kernels;
pub mod lookup;
pub mod metrics;
#[cfg(feature = "mock")]
pub mod mock;
pub mod model;
pub mod ngram;
pub mod policy;
pub mod rng;
pub mod sampling;
pub mod verify;

/// A token id.
pub type TokenId = u32;

pub use batch::{Batch, Emitted, Finished, TokenLogprob};
pub use decode::{generate, DecodeError, GenerateConfig, Output, StopReason};
pub use drafter::{DraftError, ModelDrafter, READ_PROBE_AFTER};
pub use error::{Error, Result, Side};
pub use lookup::{LookupConfig, LookupDrafter};
pub use metrics::{CostProfile, DraftCost, Metrics, Prediction, PredictionFactors, Round};
pub use model::{
    AnswerLengths, Draft, DraftRequest, Logits, NoDraft, PrefillRequest, Proposal, ReadSavings,
    RecentAnswers, Score, SeqId, Target, RECENT_ANSWERS, RECENT_ANSWER_DECAY,
};
pub use ngram::{
    continue_by_lookup, draft_planned, forgone, plan_hybrid, DeferredReads, HybridDrafter,
    HybridPlan, LookupSavings, ModelLag, NGramDrafter, EARLY_LOOK_TOKENS, REMEASURE_COVERAGE,
};
pub use policy::{
    acceptance_by_position, best_batch_draft_cap, best_batch_trim, best_draft_len,
    best_draft_len_with, isotonic_curve, ConfidenceCalibration, ContextCost, Controller,
    DraftLenPolicy, FixedCost, RoundCosts, PRIOR_ACCEPTANCE,
};
pub use rng::{CounterRng, Stream};
pub use sampling::{Probs, Sampler, SamplingParams};
pub use verify::{Verdict, VerifyMode};
