//! The one error type of the runtime.

use std::path::PathBuf;

/// Everything that can go wrong loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading or writing a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid GGUF (bad magic, bad header, absurd counts).
    #[error("{}: not a valid GGUF file: {reason}", path.display())]
    Gguf {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A metadata key the model needs is absent.
    #[error("{}: missing GGUF metadata key `{key}`", path.display())]
    MissingKey {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
    },
    /// A metadata key holds a value of the wrong type or range.
    #[error("{}: GGUF metadata key `{key}` is invalid: expected {expected}", path.display())]
    BadKey {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What was expected.
        expected: &'static str,
    },
    /// A metadata key this runtime neither implements nor knows to leave the forward pass unchanged (a
    /// sliding window, experts, YaRN, soft-capping, value heads of another size, a key it has never
    /// seen, ...): running the model anyway could give wrong logits without a sign.
    #[error("{}: GGUF key `{key}` = {value} is not implemented by specdec, nor known to leave the model unchanged", path.display())]
    UnsupportedKey {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// Its value, as the file has it.
        value: String,
    },
    /// A tensor the forward pass would not read (a q/k norm, an extra bias, ...): the model needs
    /// something this runtime does not implement.
    #[error("{}: tensor `{name}` is not used by specdec's forward pass; the model needs something specdec does not implement", path.display())]
    UnsupportedTensor {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
    },
    /// A tensor holds values outside their valid range.
    #[error("{}: tensor `{name}` is invalid: expected {expected}", path.display())]
    BadTensor {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// What was expected.
        expected: &'static str,
    },
    /// The CUDA driver, NVRTC or a kernel failed, or the model does not fit the GPU path.
    #[error("CUDA: {0}")]
    Cuda(String),
    /// A GPU was asked of a build without the cargo feature `cuda`.
    #[error("this build of specdec has no CUDA support: build it with `--features cuda`")]
    NoCuda,
    /// The architecture is not one this runtime implements.
    #[error("{}: unsupported architecture `{arch}` (supported: llama, qwen2)", path.display())]
    UnsupportedArch {
        /// The file.
        path: PathBuf,
        /// `general.architecture`.
        arch: String,
    },
    /// A tensor the architecture needs is absent.
    #[error("{}: missing tensor `{name}`", path.display())]
    MissingTensor {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
    },
    /// A tensor has the wrong shape.
    #[error("{}: tensor `{name}` has shape {got:?}, expected {expected:?}", path.display())]
    TensorShape {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// The shape found (rows, columns).
        got: Vec<usize>,
        /// The shape expected.
        expected: Vec<usize>,
    },
    /// A tensor's quantisation type is not supported.
    #[error("{}: tensor `{name}` has unsupported type {dtype}", path.display())]
    UnsupportedType {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// The type.
        dtype: String,
    },
    /// A tensor's data lies past the end of the file.
    #[error("{}: tensor `{name}` ends at byte {end} but the file has {len} bytes (truncated?)", path.display())]
    Truncated {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// Where its data ends.
        end: u64,
        /// The file's length.
        len: u64,
    },
    /// The sequence does not fit the cache.
    #[error("context overflow: {len} tokens do not fit a context of {capacity}")]
    ContextOverflow {
        /// Tokens needed.
        len: usize,
        /// Tokens available.
        capacity: usize,
    },
    /// A token id is outside the vocabulary.
    #[error("token {token} is out of range for a vocabulary of {vocab}")]
    TokenOutOfRange {
        /// The token.
        token: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A KV cache of a model of another shape was passed to a model's pass or copied from.
    #[error("the KV cache belongs to a model of another shape")]
    CacheShape,
    /// A rollback asked for more tokens than the cache holds.
    #[error("cannot roll back to {len} tokens: the cache holds {cached}")]
    Rollback {
        /// The length asked for.
        len: usize,
        /// The cached length.
        cached: usize,
    },
    /// Logits were asked for more positions than the block has.
    #[error("logits for {rows} positions asked from a block of {tokens} tokens")]
    RowsOutOfRange {
        /// Rows asked for.
        rows: usize,
        /// Tokens in the block.
        tokens: usize,
    },
    /// A score request had no context token to condition on.
    #[error("a score request needs at least one context token")]
    EmptyContext,
    /// A session was asked to score more than one sequence at once.
    #[error("a session holds one sequence; got a batch of {0}")]
    BatchUnsupported(usize),
    /// More sequences at once than [`crate::Sessions`] was made for.
    #[error("at most {max} sequences at a time")]
    TooManySequences {
        /// The limit.
        max: usize,
    },
    /// The same sequence twice in one batch.
    #[error("sequence {0} appears twice in one batch")]
    DuplicateSequence(u64),
    /// Building or running the tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Rendering the chat template failed.
    #[error("chat template: {0}")]
    Template(String),
    /// A model argument is neither a file nor a known alias.
    #[error("unknown model `{0}`: give a path to a .gguf file or one of the aliases {aliases}", aliases = crate::fetch::ALIASES.join(", "))]
    UnknownModel(String),
    /// Fetching a model failed.
    #[error("fetching {model}: {reason}")]
    Fetch {
        /// The alias.
        model: String,
        /// What went wrong and what to do.
        reason: String,
    },
    /// A candle kernel failed.
    #[error("kernel: {0}")]
    Kernel(#[from] candle_core::Error),
    /// One of our own kernels refused its input (a shape or format mismatch: a bug, reported rather
    /// than a panic).
    #[error("kernel: {0}")]
    OwnKernel(#[from] specdec_kernels::KernelError),
    /// A buffer handed to a matrix operation has the wrong length.
    #[error("{what}: expected input and output lengths {expected:?}, got {actual:?}")]
    Shape {
        /// The operation.
        what: &'static str,
        /// Expected (input, output) lengths.
        expected: (usize, usize),
        /// Given (input, output) lengths.
        actual: (usize, usize),
    },
    /// A restricted logits vocabulary outside `1..=vocab`.
    #[error("a logits vocabulary of {limit} tokens is not within 1..={vocab}")]
    LogitsVocab {
        /// The restriction asked for.
        limit: usize,
        /// The model's vocabulary size.
        vocab: usize,
    },
    /// A token id to score beside a restricted vocabulary that is not in the vocabulary.
    #[error("token id {id} to score is not in the vocabulary of {vocab} tokens")]
    LogitsAlso {
        /// The id asked for.
        id: u32,
        /// The model's vocabulary size.
        vocab: usize,
    },
    /// The kernel thread pool could not start its threads, or more than
    /// [`specdec_kernels::MAX_THREADS`] were asked for.
    #[error("starting {threads} kernel threads: {source}")]
    Threads {
        /// Threads asked for.
        threads: usize,
        /// The operating system's error (`InvalidInput` for too many threads).
        source: std::io::Error,
    },
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}

/// Shorthand for results of the runtime.
pub type Result<T, E = Error> = std::result::Result<T, E>;
