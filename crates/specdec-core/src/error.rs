//! The one error type of the core.

use std::fmt;

/// Which model a failure or a mismatch belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    /// The drafter (a small model, an n-gram table, ...).
    Draft,
    /// The target model whose distribution the output follows.
    Target,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Draft => "draft",
            Side::Target => "target",
        })
    }
}

/// Everything that can go wrong in the core.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration value is outside its valid range.
    #[error("invalid {field} = {value}: {expected}")]
    InvalidConfig {
        /// The field, as the user spells it (`temperature`, `draft_len`, ...).
        field: &'static str,
        /// The offending value, printed.
        value: String,
        /// What would have been valid.
        expected: &'static str,
    },
    /// The draft and the target do not share one vocabulary.
    #[error("vocabulary mismatch: the draft has {draft} tokens, the target {target}")]
    VocabMismatch {
        /// Vocabulary size of the draft.
        draft: usize,
        /// Vocabulary size of the target.
        target: usize,
    },
    /// Generation needs at least one prompt token.
    #[error("the prompt is empty: generation needs at least one token")]
    EmptyPrompt,
    /// A model returned data of the wrong shape.
    #[error("shape mismatch from the {side} in {what}: expected {expected}, got {got}")]
    ShapeMismatch {
        /// The model that returned it.
        side: Side,
        /// What was being checked (`logits rows`, `vocab`, ...).
        what: &'static str,
        /// The expected length.
        expected: usize,
        /// The length received.
        got: usize,
    },
    /// A token id is not in the vocabulary.
    #[error("token {token} from the {side} is out of range for a vocabulary of {vocab}")]
    TokenOutOfRange {
        /// Where the token came from (the prompt counts as target).
        side: Side,
        /// The token id.
        token: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// The sequence does not fit the model's context.
    #[error("context overflow: {len} tokens do not fit a context of {capacity}")]
    ContextOverflow {
        /// Tokens needed.
        len: usize,
        /// Tokens available.
        capacity: usize,
    },
    /// A drafter's confidence estimate ([`crate::Proposal::confidence`]) or a draft model's
    /// confidence ([`crate::Proposal::top_probs`]) is not a probability.
    #[error("confidence {value} for drafted token {index} is not a probability in [0, 1]")]
    BadConfidence {
        /// The drafted token's index in its draft.
        index: usize,
        /// The estimate.
        value: f32,
    },
    /// A logit was NaN or infinite.
    #[error("non-finite logit {value} at token {index}")]
    NonFiniteLogits {
        /// The token index of the first bad logit.
        index: usize,
        /// The bad value.
        value: f32,
    },
    /// A model call failed.
    #[error("the {side} model failed: {source}")]
    Model {
        /// Which model failed.
        side: Side,
        /// The model's own error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl Error {
    /// Wraps a model's error, remembering which side it came from.
    pub fn model(side: Side, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        Error::Model {
            side,
            source: Box::new(source),
        }
    }

    pub(crate) fn config(
        field: &'static str,
        value: impl fmt::Display,
        expected: &'static str,
    ) -> Self {
        Error::InvalidConfig {
            field,
            value: value.to_string(),
            expected,
        }
    }
}

/// Shorthand for results of the core.
pub type Result<T, E = Error> = std::result::Result<T, E>;
