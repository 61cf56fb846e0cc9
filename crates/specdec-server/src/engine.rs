//! The engine: one thread owns the models and decodes every active request together (continuous
//! batching through [`specdec_core::Batch`]); HTTP handlers talk to it over channels.
//!
//! - Requests wait in a bounded queue ([`EngineHandle::submit`] answers 429 when it is full) and join
//!   the batch between steps while fewer than `parallel` sequences are active.
//! - Each step drafts for all active sequences in one call and scores all their blocks in one target
//!   call, so concurrent requests share the weights' reads.
//! - Tokens become text ([`crate::text`]), stop strings end a sequence at once, and events go back
//!   to the handler; a handler that went away (client disconnected) ends its sequence before the
//!   next step.

use std::collections::{HashMap, VecDeque};
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use specdec_core::{
    AnswerLengths, Batch, DeferredReads, Draft, DraftLenPolicy, DraftRequest, Emitted,
    GenerateConfig, HybridPlan, LookupDrafter, LookupSavings, Metrics, ModelDrafter, ModelLag,
    PrefillRequest, Proposal, ReadSavings, RecentAnswers, SeqId, StopReason, Target, TokenId,
    TokenLogprob, READ_PROBE_AFTER,
};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

use crate::error::ApiError;
use crate::metrics::ServerMetrics;
use crate::text::{Detokenizer, Release, StopText};

/// Text in and out of the model's vocabulary.
pub trait Codec: Send + Sync + 'static {
    /// Encodes raw text (with the beginning-of-sequence token the model wants).
    fn encode(&self, text: &str) -> Result<Vec<TokenId>, String>;
    /// Encodes a conversation through the model's chat template, ready for the assistant's turn.
    /// `messages` are `(role, content)` with roles `system`, `user` and `assistant`.
    fn encode_chat(&self, messages: &[(String, String)]) -> Result<Vec<TokenId>, String>;
    /// Decodes tokens (an incomplete UTF-8 character becomes U+FFFD).
    fn decode(&self, ids: &[TokenId]) -> String;
    /// The bytes one token stands for, possibly part of a UTF-8 character: log-probabilities
    /// report them, and the detokenizer tells from them whether a text ends inside a character
    /// (its U+FFFD) or with a U+FFFD of its own.
    fn token_bytes(&self, id: TokenId) -> Vec<u8>;
    /// The tokens that end generation (end of turn, end of text).
    fn stop_tokens(&self) -> Vec<TokenId>;
}

impl Codec for specdec_runtime::Tokenizer {
    fn encode(&self, text: &str) -> Result<Vec<TokenId>, String> {
        specdec_runtime::Tokenizer::encode(self, text, true).map_err(|e| e.to_string())
    }

    fn encode_chat(&self, messages: &[(String, String)]) -> Result<Vec<TokenId>, String> {
        let m: Vec<specdec_runtime::Message> = messages
            .iter()
            .map(|(r, c)| specdec_runtime::Message::new(r.as_str(), c.as_str()))
            .collect();
        specdec_runtime::Tokenizer::encode_chat(self, &m).map_err(|e| e.to_string())
    }

    fn decode(&self, ids: &[TokenId]) -> String {
        specdec_runtime::Tokenizer::decode(self, ids).unwrap_or_default()
    }

    fn token_bytes(&self, id: TokenId) -> Vec<u8> {
        specdec_runtime::Tokenizer::token_bytes(self, id).unwrap_or_default()
    }

    fn stop_tokens(&self) -> Vec<TokenId> {
        specdec_runtime::Tokenizer::stop_tokens(self).to_vec()
    }
}

/// The drafters a request can choose by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DrafterKind {
    /// Plain decoding.
    None,
    /// Prompt lookup.
    Ngram,
    /// The draft model.
    Model,
    /// Lookup, the draft model, or the lookup draft extended by the model, whichever pays most
    /// each round.
    Hybrid,
}

impl DrafterKind {
    /// The name in requests and responses.
    pub fn name(self) -> &'static str {
        match self {
            DrafterKind::None => "none",
            DrafterKind::Ngram => "ngram",
            DrafterKind::Model => "model",
            DrafterKind::Hybrid => "hybrid",
        }
    }

    /// Parses a name (`lookup` is another name of `ngram`).
    pub fn parse(s: &str) -> Option<Self> {
        if s == "lookup" {
            return Some(Self::Ngram);
        }
        [Self::None, Self::Ngram, Self::Model, Self::Hybrid]
            .into_iter()
            .find(|k| k.name() == s)
    }

    fn needs_model(self) -> bool {
        matches!(self, DrafterKind::Model | DrafterKind::Hybrid)
    }

    fn uses_lookup(self) -> bool {
        matches!(self, DrafterKind::Ngram | DrafterKind::Hybrid)
    }
}

/// A drafter per sequence: each request picks plain decoding, lookup, the draft model or the hybrid;
/// the sequences that draft with the model do so in one batched call.
#[derive(Debug)]
pub struct MultiDrafter<M: Target> {
    lookup: LookupDrafter,
    model: Option<ModelDrafter<M>>,
    lag: ModelLag,
    choice: HashMap<SeqId, DrafterKind>,
    /// Sequences whose prompt the draft model is not to read: it could not repay it
    /// ([`Draft::prefill_priced`]), until the rounds since forgo its price while the tokens left
    /// can still repay it ([`specdec_core::DeferredReads`]).
    reads: DeferredReads,
    /// What the model's rounds saved against the lookup alone in the hybrid requests whose
    /// prompt it read, which prices the next hybrid request's reading.
    hybrid_savings: LookupSavings,
    /// What the model's drafts saved against plain decoding in the model-kind requests whose
    /// prompt it read, which prices the next model-kind request's reading.
    model_savings: ReadSavings,
    /// The answers of the model-kind requests lately, read or left unread (none covered by a
    /// lookup): how many tokens the next one is expected to emit, which prices its reading.
    model_answers: AnswerLengths,
    /// Model-kind prompts left unread at prefill in a row: after
    /// [`specdec_core::READ_PROBE_AFTER`] the next one is read whatever its price, as a
    /// [`ModelDrafter`] alone does, since `model_savings` is measured only on prompts read.
    model_unread_in_a_row: usize,
    /// The same count for hybrid-kind prompts, as a [`specdec_core::HybridDrafter`] keeps it
    /// (since stop 69): `hybrid_savings` too is measured only on prompts read.
    hybrid_unread_in_a_row: usize,
}

impl<M: Target> MultiDrafter<M> {
    /// Lookup always; the model kinds only with a draft model.
    pub fn new(model: Option<ModelDrafter<M>>) -> Self {
        Self {
            lookup: LookupDrafter::default(),
            model,
            lag: ModelLag::default(),
            choice: HashMap::new(),
            reads: DeferredReads::default(),
            hybrid_savings: LookupSavings::default(),
            model_savings: ReadSavings::default(),
            model_answers: AnswerLengths::default(),
            model_unread_in_a_row: 0,
            hybrid_unread_in_a_row: 0,
        }
    }

    /// The sequence's answer is over: its hybrid account is closed, and the next hybrid-kind
    /// prompt is to be read whatever its price where the answer calls for it
    /// ([`LookupSavings::answer_over`]; only a hybrid request's prompt is left unread with a
    /// lookup answer). Called before the lookup records the answer.
    fn answer_over(&mut self, seq: SeqId) {
        self.hybrid_savings
            .answer_over(seq, &self.lookup, &self.reads);
    }

    /// The kinds offered.
    pub fn kinds(&self) -> Vec<DrafterKind> {
        let mut k = vec![DrafterKind::None, DrafterKind::Ngram];
        if self.model.is_some() {
            k.extend([DrafterKind::Model, DrafterKind::Hybrid]);
        }
        k
    }

    /// Sets the drafter of `seq`; false if this kind is not offered.
    pub fn select(&mut self, seq: SeqId, kind: DrafterKind) -> bool {
        if kind.needs_model() && self.model.is_none() {
            return false;
        }
        self.choice.insert(seq, kind);
        true
    }

    fn kind(&self, seq: SeqId) -> DrafterKind {
        self.choice.get(&seq).copied().unwrap_or(DrafterKind::None)
    }
}

impl<M: Target> Draft for MultiDrafter<M> {
    type Error = specdec_core::DraftError<M::Error>;

    fn vocab_size(&self) -> Option<usize> {
        self.model.as_ref().and_then(|m| m.vocab_size())
    }

    fn propose(
        &mut self,
        batch: &[DraftRequest<'_>],
        out: &mut [Proposal],
    ) -> Result<(), Self::Error> {
        let mut plans = Vec::with_capacity(batch.len());
        for (req, out) in batch.iter().zip(out.iter_mut()) {
            out.clear();
            let kind = self.kind(req.seq);
            let rate = if kind.uses_lookup() {
                self.lookup.propose_one(req, out)
            } else {
                f64::NAN
            };
            // A prompt left unread is read after all once the model's drafts would have saved
            // its price in the rounds since and the tokens left can repay it, or where the early
            // look at a hybrid request's answer finds it unlike the measured ones (as
            // `HybridDrafter` does; only a hybrid request's prompt is left unread with a lookup
            // answer); the model then reads the whole context as its catch-up (counted as its lag),
            // and such an answer has the next hybrid prompt read whatever its price.
            let was_unread = self.reads.is_unread(req.seq);
            self.reads
                .look_early_at(req.seq, &self.lookup, &mut self.hybrid_savings);
            let (model, lag) = (self.model.as_ref(), &self.lag);
            let plan = self.reads.plan(
                req,
                out,
                rate,
                || model.map_or(0, |m| m.cached(req.seq, req.context)),
                || match kind {
                    DrafterKind::Model => HybridPlan::Model,
                    DrafterKind::Hybrid => {
                        specdec_core::plan_hybrid(req, out, rate, lag.lag(req.seq, req.context))
                    }
                    _ => HybridPlan::Lookup,
                },
            );
            if was_unread && !self.reads.is_unread(req.seq) {
                self.lag.prefill(req.seq, 0);
            }
            plans.push(plan);
        }
        if let Some(model) = self.model.as_mut() {
            specdec_core::draft_planned(model, &mut self.lag, batch, out, &plans)?;
        }
        for ((req, out), &plan) in batch.iter().zip(out.iter_mut()).zip(&plans) {
            if plan == HybridPlan::Lookup {
                continue;
            }
            // The first model round reads the prompt (this drafter's model reads it lazily): the
            // account opens there, and that reading is the price it is weighed against.
            if self.kind(req.seq) == DrafterKind::Model {
                self.model_savings.model_drafted(req, out);
            }
            if self.kind(req.seq) != DrafterKind::Hybrid {
                continue;
            }
            if plan == HybridPlan::Model {
                specdec_core::continue_by_lookup(&mut self.lookup, req, out);
            }
            self.hybrid_savings.drafted(req, out, plan);
        }
        Ok(())
    }

    fn commit(&mut self, seq: SeqId, committed: &[TokenId]) -> Result<(), Self::Error> {
        if self.kind(seq).uses_lookup() {
            self.hybrid_savings
                .committed(&mut self.lookup, seq, committed);
            let Ok(()) = self.lookup.commit(seq, committed);
        }
        self.model_savings.committed(seq, committed.len());
        self.model_answers.committed(seq, committed.len());
        match &mut self.model {
            Some(m) if self.choice.get(&seq).is_some_and(|k| k.needs_model()) => {
                m.commit(seq, committed)
            }
            _ => Ok(()),
        }
    }

    /// Only lookup drafts are cut after they are made ([`specdec_core::Batch`]); a hybrid round
    /// the model was to extend and did not reads as one, and its pending price is cut too.
    fn truncated(&mut self, seq: SeqId, len: usize) {
        if self.kind(seq).uses_lookup() {
            self.hybrid_savings.truncated(seq, len);
            self.lookup.truncated(seq, len);
        }
    }

    /// The lookup notes where the prompt ends; the draft model reads the prompt at the sequence's
    /// first drafting round instead.
    /// A sequence that never drafts (plain decoding, lookup hits only, or a batch under a draft cap)
    /// then never costs a draft-model prefill; one that drafts does the same work a round later.
    /// The prompt is not counted as the model's lag either: that first round does the work a
    /// prefill would have.
    fn prefill(&mut self, seq: SeqId, context: &[TokenId]) -> Result<(), Self::Error> {
        self.answer_over(seq);
        if self.kind(seq).uses_lookup() {
            let Ok(()) = self.lookup.prefill(seq, context);
        }
        self.reads.release(seq);
        self.model_savings.finish(seq);
        if self.kind(seq) == DrafterKind::Model {
            self.model_answers.start(seq, context.len());
        } else {
            self.model_answers.finish(seq);
        }
        self.lag.prefill(seq, context.len());
        Ok(())
    }

    /// [`Draft::prefill`]; where the cost model says that the draft model's reading of the prompt
    /// (what it does not hold already, a released sequence's cache or a copy of a running one's
    /// included) cannot pay for itself within the tokens the request is expected to emit
    /// ([`specdec_core::RoundCosts::prompt_read_pays`], [`RecentAnswers::model_tokens`]), the
    /// model leaves it unread: the hybrid drafts from the lookup alone, the model kind decodes
    /// plainly, until [`DeferredReads`] finds it due. Each kind reads the next prompt whatever
    /// its price after [`READ_PROBE_AFTER`] of its own left unread in a row, the hybrid kind also
    /// after an answer left unread that calls for measuring again ([`LookupSavings::finish`]);
    /// a hybrid request's prompt left unread is due at once where the early look at its answer
    /// finds it unlike the measured ones ([`DeferredReads::look_early`]).
    fn prefill_priced(&mut self, req: &PrefillRequest<'_>) -> Result<(), Self::Error> {
        self.prefill(req.seq, req.prompt)?;
        // The lookup's recent answers say how much of an answer it drafts, for the kinds that
        // use it; the model kind's own recent answers how long an answer is (as a `ModelDrafter`
        // alone prices its reading; this drafter's model never reads a prompt at prefill, so its
        // own record is empty), and like the hybrid it reads a prompt left unread once the rounds
        // since forwent its price. The hybrid's reading is priced by what its model rounds
        // measurably saved in the hybrid requests whose prompt it read ([`LookupSavings`]), once
        // there are any; the model kind's by what its drafts saved against plain decoding in the
        // model-kind requests whose prompt it read (the draft model's own account mixes both
        // kinds' rounds).
        let kind = self.kind(req.seq);
        let remeasure = kind == DrafterKind::Hybrid && self.hybrid_savings.take_remeasure();
        let none = (RecentAnswers::default(), ReadSavings::default());
        let (recent, saved) = match kind {
            DrafterKind::Hybrid => (self.lookup.recent_answers(), self.hybrid_savings.savings()),
            DrafterKind::Model => (self.model_answers.answers(), &self.model_savings),
            DrafterKind::Ngram => (self.lookup.recent_answers(), &none.1),
            DrafterKind::None => (&none.0, &none.1),
        };
        let in_a_row = match kind {
            DrafterKind::Model => Some(&mut self.model_unread_in_a_row),
            DrafterKind::Hybrid => Some(&mut self.hybrid_unread_in_a_row),
            DrafterKind::Ngram | DrafterKind::None => None,
        };
        let probe = remeasure || in_a_row.as_ref().is_some_and(|n| **n >= READ_PROBE_AFTER);
        let cached = self
            .model
            .as_ref()
            .map_or(0, |m| m.cached(req.seq, req.prompt));
        if kind.needs_model() && !probe && !req.read_pays(cached, recent, saved) {
            if let Some(n) = in_a_row {
                *n += 1;
            }
            self.reads.leave_unread(req);
        } else if let Some(n) = in_a_row {
            *n = 0;
        }
        Ok(())
    }

    fn cached(&self, seq: SeqId, context: &[TokenId]) -> usize {
        self.model.as_ref().map_or(0, |m| m.cached(seq, context))
    }

    fn model_drafts(&self, seq: SeqId) -> bool {
        self.model.is_some() && self.kind(seq).needs_model() && !self.reads.is_unread(seq)
    }

    fn release(&mut self, seq: SeqId) {
        self.answer_over(seq);
        self.reads.release(seq);
        self.model_savings.finish(seq);
        self.model_answers.finish(seq);
        if self.kind(seq).uses_lookup() {
            self.lookup.release(seq);
        }
        if let Some(m) = &mut self.model {
            m.release(seq);
        }
        self.lag.release(seq);
        self.choice.remove(&seq);
    }
}

/// A request for the engine, validated.
#[derive(Debug)]
pub struct Job {
    /// Prompt tokens.
    pub prompt: Vec<TokenId>,
    /// How to generate (stop tokens included).
    pub config: GenerateConfig,
    /// Which drafter.
    pub drafter: DrafterKind,
    /// Log-probabilities with this many alternatives.
    pub logprobs: Option<usize>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Where events go.
    pub events: UnboundedSender<Event>,
    /// When the request arrived (time to first token counts from here).
    pub submitted: Instant,
}

/// One generated token as reported to clients.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenOut {
    /// Its id.
    pub id: TokenId,
    /// The bytes it stands for (possibly part of a UTF-8 character).
    pub bytes: Vec<u8>,
    /// Drafted and accepted, rather than chosen by the target.
    pub drafted: bool,
    /// The target's log-probabilities, when asked.
    pub logprob: Option<TokenLogprob>,
}

/// A token's bytes as the `token` of OpenAI's log-probabilities: the text when the bytes are whole
/// UTF-8 characters, else `bytes:` followed by the bytes with each one outside a whole character
/// written `\xNN` (OpenAI's spelling; the exact bytes are in the `bytes` field beside it).
pub(crate) fn token_string(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) => text.to_string(),
        Err(_) => {
            let mut s = String::from("bytes:");
            for chunk in bytes.utf8_chunks() {
                s.push_str(chunk.valid());
                for b in chunk.invalid() {
                    s.push_str(&format!("\\x{b:02x}"));
                }
            }
            s
        }
    }
}

/// Running speculation counters of a request.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Live {
    /// Rounds so far.
    pub rounds: u64,
    /// Drafted tokens so far.
    pub drafted: u64,
    /// Accepted drafted tokens so far.
    pub accepted: u64,
}

/// Why a request ended, as OpenAI's `finish_reason`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// A stop token or stop string.
    Stop,
    /// The token limit or the context.
    Length,
}

impl Finish {
    /// OpenAI's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// What the engine reports about a finished request.
#[derive(Clone, Debug)]
pub struct Summary {
    /// Why it ended.
    pub finish: Finish,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens (those after a stop string's end are never generated).
    pub completion_tokens: usize,
    /// The core's counters and timings.
    pub metrics: Metrics,
    /// Which drafter.
    pub drafter: DrafterKind,
    /// The draft-length policy.
    pub draft_len: String,
}

/// From the engine to a handler.
#[derive(Clone, Debug)]
pub enum Event {
    /// New text and the tokens it completes.
    Chunk {
        /// Text (never ends inside a character, never contains a stop string).
        text: String,
        /// The tokens whose text is now complete.
        tokens: Vec<TokenOut>,
        /// Counters as of the last step.
        live: Live,
    },
    /// The end.
    Done(Box<Summary>),
    /// A failure; the text sent before stands.
    Failed(String),
}

/// What the handlers need to know once the models are loaded.
pub struct Info {
    /// The served model's name.
    pub model: String,
    /// Tokens per sequence (prompt + generated).
    pub ctx: usize,
    /// Text in and out.
    pub codec: Arc<dyn Codec>,
    /// The drafters a request may ask for.
    pub drafters: Vec<DrafterKind>,
    /// Unix time the models were loaded.
    pub created: u64,
}

impl std::fmt::Debug for Info {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Info")
            .field("model", &self.model)
            .field("ctx", &self.ctx)
            .field("drafters", &self.drafters)
            .finish_non_exhaustive()
    }
}

/// State shared by the engine thread and the handlers.
#[derive(Debug, Default)]
pub struct Shared {
    /// Set once the models are loaded.
    pub info: OnceLock<Info>,
    /// Set if loading failed.
    pub load_error: OnceLock<String>,
    /// Set if the engine stopped after loading (it panicked): no request can be served.
    pub engine_error: OnceLock<String>,
    /// Requests waiting for a slot.
    pub queued: AtomicUsize,
    /// Sequences being decoded.
    pub active: AtomicUsize,
    /// No new requests (shutdown began).
    pub closing: AtomicBool,
    /// End every request now (the shutdown timeout passed).
    pub cancel_all: AtomicBool,
    /// Counters and histograms for `/metrics`.
    pub metrics: Mutex<ServerMetrics>,
}

/// The handlers' side of the engine.
#[derive(Clone, Debug)]
pub struct EngineHandle {
    /// To the engine, which moves each job into its own queue at its next turn: the `queued`
    /// count, not the channel, bounds the jobs waiting.
    tx: Sender<Job>,
    /// Shared state.
    pub shared: Arc<Shared>,
    queue: usize,
    parallel: usize,
}

impl EngineHandle {
    /// The model information, or 503 while loading.
    pub fn info(&self) -> Result<&Info, ApiError> {
        if let Some(e) = self.shared.load_error.get() {
            return Err(ApiError::unavailable(format!(
                "the models failed to load: {e}"
            )));
        }
        if let Some(e) = self.shared.engine_error.get() {
            return Err(ApiError::unavailable(format!("the engine stopped: {e}")));
        }
        self.shared
            .info
            .get()
            .ok_or_else(|| ApiError::unavailable("the models are still loading"))
    }

    /// Queues a job; 429 when the free slots and the queue are taken, 503 when shutting down.
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        if self.shared.closing.load(Ordering::SeqCst) {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        // Waiting jobs may fill the queue plus the slots that are free now.
        let free = self
            .parallel
            .saturating_sub(self.shared.active.load(Ordering::SeqCst));
        let waiting = self.shared.queued.fetch_add(1, Ordering::SeqCst);
        if waiting >= self.queue.saturating_add(free) {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::overloaded(self.queue));
        }
        self.tx.send(job).map_err(|_| {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            ApiError::unavailable("the engine has stopped")
        })
    }
}

/// What the loader returns: the models, as a target and a per-request drafter, and the codec.
pub struct Loaded<M: Target, T: Target> {
    /// The target (a batched one, such as [`specdec_runtime::Sessions`]).
    pub target: T,
    /// The drafters.
    pub drafter: MultiDrafter<M>,
    /// Text in and out.
    pub codec: Arc<dyn Codec>,
    /// The model's name.
    pub model: String,
    /// What the cost model learns across requests, if anything ([`Learner`]).
    pub learner: Option<Box<dyn Learner>>,
}

/// A cost model that learns across requests: the engine hands it every finished request's
/// metrics, and lets it set the prior of every new request's cost model
/// ([`DraftLenPolicy::CostModel`]), so that a request starts from what the requests before it
/// saw (the `specdec` binary's: the step's time, the draft model's cost and its acceptance) instead of only
/// the calibration the server started with.
pub trait Learner: Send {
    /// A request drafted by `drafter` ended after `metrics`. `alone`: no other sequence shared any
    /// of its steps, so its timings are its own (a shared step's time is not one sequence's cost);
    /// its acceptance counts either way.
    fn learn(&mut self, drafter: DrafterKind, metrics: &Metrics, alone: bool);

    /// Sets the prior of a new request's draft-length policy, where it is a cost model that
    /// measures (a policy with given costs, or another policy, is left as it is), for a request
    /// drafted by `drafter`.
    fn prime(&self, drafter: DrafterKind, policy: &mut DraftLenPolicy);
}

/// Engine settings.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Sequences decoded together.
    pub parallel: usize,
    /// Requests that may wait beyond those.
    pub queue: usize,
    /// While more than one sequence is decoding, draft at most this many tokens per sequence and
    /// round (`None`: only the batch's own cap from the cost model); see
    /// [`specdec_core::Batch::set_batch_draft_cap`].
    pub batch_draft_len: Option<usize>,
    /// Prompt tokens scored per step for a new request (`None`: all at once); see
    /// [`specdec_core::Batch::set_prefill_chunk`].
    pub prefill_chunk: Option<usize>,
}

/// Starts the engine thread, which first runs `load` (so `/health` answers 503 until it returns)
/// and then serves jobs until every handle is dropped.
pub fn start<M, T, F>(options: &EngineOptions, load: F) -> EngineHandle
where
    M: Target + 'static,
    T: Target + 'static,
    F: FnOnce() -> Result<Loaded<M, T>, String> + Send + 'static,
{
    let parallel = options.parallel.max(1);
    // `submit` bounds the jobs waiting (the queue and the free slots) by its count; the engine
    // moves them out of the channel at every turn.
    let (tx, rx) = std::sync::mpsc::channel();
    let shared = Arc::new(Shared::default());
    let handle = EngineHandle {
        tx,
        shared: shared.clone(),
        queue: options.queue,
        parallel,
    };
    let batch_draft_len = options.batch_draft_len;
    let prefill_chunk = options.prefill_chunk;
    let spawned = std::thread::Builder::new()
        .name("specdec-engine".into())
        .spawn(move || {
            // A loader that panics fails the load like one that returns an error: otherwise no
            // load error is ever set and every request waits for models that never come.
            let loaded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(load))
                .unwrap_or_else(|panic| {
                    Err(format!("the loader panicked: {}", panic_message(&*panic)))
                });
            let loaded = match loaded {
                Ok(l) => l,
                Err(e) => {
                    tracing::error!("loading failed: {e}");
                    let _ = shared.load_error.set(e);
                    return;
                }
            };
            let Loaded {
                target,
                drafter,
                codec,
                model,
                learner,
            } = loaded;
            let info = Info {
                model,
                ctx: target.capacity(),
                codec: codec.clone(),
                drafters: drafter.kinds(),
                created: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
            };
            let _ = shared.info.set(info);
            tracing::info!("models loaded; serving up to {parallel} sequences at a time");
            let mut batch = Batch::new(target, drafter);
            batch.set_batch_draft_cap(batch_draft_len);
            batch.set_prefill_chunk(prefill_chunk);
            let mut engine = Engine {
                batch,
                jobs: HashMap::new(),
                waiting: VecDeque::new(),
                codec,
                shared: shared.clone(),
                parallel,
                next_id: 0,
                learner,
            };
            // A panic ends the engine (its requests get "the engine stopped" as their senders
            // drop); it must not leave a server that reports itself healthy and takes requests.
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.run(&rx)));
            if let Err(panic) = ran {
                let e = format!("it panicked: {}", panic_message(&*panic));
                tracing::error!("the engine stopped: {e}");
                let _ = shared.engine_error.set(e);
            }
            drop(engine);
        });
    if let Err(e) = spawned {
        let _ = handle
            .shared
            .load_error
            .set(format!("could not start the engine thread: {e}"));
    }
    handle
}

/// A request being decoded.
struct Active {
    events: UnboundedSender<Event>,
    detok: Detokenizer,
    stop: StopText,
    /// Tokens whose text is held back (an incomplete character or a possible stop string).
    pending: Vec<TokenOut>,
    stopped_by_text: bool,
    live: Live,
    drafter: DrafterKind,
    draft_len: String,
    submitted: Instant,
    last_token: Option<Instant>,
    prompt_tokens: usize,
    /// No other sequence has shared a step with this one ([`Learner::learn`]).
    alone: bool,
}

struct Engine<M: Target, T: Target> {
    batch: Batch<T, MultiDrafter<M>>,
    jobs: HashMap<SeqId, Active>,
    /// Requests waiting for a slot, in the order they came: moved out of the channel every turn,
    /// so that one whose client left frees its place in the queue at once, not when a slot would
    /// have taken it.
    waiting: VecDeque<Job>,
    codec: Arc<dyn Codec>,
    shared: Arc<Shared>,
    parallel: usize,
    next_id: u64,
    learner: Option<Box<dyn Learner>>,
}

impl<M: Target, T: Target> Engine<M, T> {
    fn run(&mut self, rx: &Receiver<Job>) {
        loop {
            if self.shared.cancel_all.load(Ordering::SeqCst) {
                self.cancel_everything(rx);
            }
            // Clients that left free their slots before the step.
            let gone: Vec<SeqId> = self
                .jobs
                .iter()
                .filter(|(_, a)| a.events.is_closed())
                .map(|(&id, _)| id)
                .collect();
            for id in gone {
                if let Some(out) = self.batch.cancel(id) {
                    self.finish(id, Ok(out));
                }
            }
            // New requests wait here; those whose clients left while waiting leave the queue.
            let mut disconnected = false;
            loop {
                match rx.try_recv() {
                    Ok(j) => self.waiting.push_back(j),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        disconnected = true;
                        break;
                    }
                }
            }
            let before = self.waiting.len();
            self.waiting.retain(|j| !j.events.is_closed());
            let left = before - self.waiting.len();
            if left > 0 {
                self.shared.queued.fetch_sub(left, Ordering::SeqCst);
            }
            // With nothing to do, wait for a request, and take those that came with it too.
            if self.batch.is_empty() && self.waiting.is_empty() && !disconnected {
                match rx.recv_timeout(Duration::from_millis(100)) {
                    Ok(j) => {
                        self.waiting.push_back(j);
                        while let Ok(j) = rx.try_recv() {
                            self.waiting.push_back(j);
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            // They join between steps.
            while self.batch.len() < self.parallel {
                let Some(job) = self.waiting.pop_front() else {
                    break;
                };
                // Counted active before it stops counting as queued, so that `submit` never sees
                // its slot free in between.
                self.shared.active.fetch_add(1, Ordering::SeqCst);
                self.shared.queued.fetch_sub(1, Ordering::SeqCst);
                self.admit(job);
            }
            if disconnected && self.batch.is_empty() && self.waiting.is_empty() {
                return;
            }
            self.shared.active.store(self.batch.len(), Ordering::SeqCst);
            if self.batch.is_empty() {
                continue;
            }
            self.step();
        }
    }

    fn admit(&mut self, mut job: Job) {
        if job.events.is_closed() {
            return;
        }
        if let Some(l) = &self.learner {
            l.prime(job.drafter, &mut job.config.draft_len);
        }
        let id = SeqId(self.next_id);
        self.next_id += 1;
        let draft_len = describe(&job.config.draft_len, job.drafter);
        if !self.batch.drafter_mut().select(id, job.drafter) {
            let _ = job.events.send(Event::Failed(format!(
                "drafter `{}` is not available on this server",
                job.drafter.name()
            )));
            return;
        }
        let prompt_tokens = job.prompt.len();
        if let Err(e) = self.batch.add(id, job.prompt, job.config, job.logprobs) {
            self.batch.release(id);
            let _ = job.events.send(Event::Failed(e.to_string()));
            return;
        }
        self.jobs.insert(
            id,
            Active {
                events: job.events,
                detok: Detokenizer::default(),
                stop: StopText::new(job.stop),
                pending: Vec::new(),
                stopped_by_text: false,
                live: Live::default(),
                drafter: job.drafter,
                draft_len,
                submitted: job.submitted,
                last_token: None,
                prompt_tokens,
                alone: true,
            },
        );
        if let Ok(mut m) = self.shared.metrics.lock() {
            m.prompt_tokens += prompt_tokens as u64;
        }
    }

    fn step(&mut self) {
        let Self {
            batch,
            jobs,
            codec,
            shared,
            ..
        } = self;
        if batch.len() > 1 {
            for a in jobs.values_mut() {
                a.alone = false;
            }
        }
        let codec = &**codec;
        let mut latencies: Vec<(bool, f64)> = Vec::new();
        let finished = batch.step(&mut |seq, e: &Emitted| {
            let Some(a) = jobs.get_mut(&seq) else {
                return ControlFlow::Break(());
            };
            let now = Instant::now();
            match a.last_token {
                None => latencies.push((true, (now - a.submitted).as_secs_f64())),
                Some(t) => latencies.push((false, (now - t).as_secs_f64())),
            }
            a.last_token = Some(now);
            a.on_token(codec, e)
        });
        for id in batch.ids().collect::<Vec<_>>() {
            if let (Some(a), Some(m)) = (jobs.get_mut(&id), batch.metrics(id)) {
                a.live = Live {
                    rounds: m.rounds,
                    drafted: m.drafted,
                    accepted: m.accepted,
                };
            }
        }
        if let Ok(mut m) = shared.metrics.lock() {
            m.steps += 1;
            for (first, secs) in latencies {
                if first {
                    m.ttft.observe(secs);
                } else {
                    m.itl.observe(secs);
                }
            }
        }
        for f in finished {
            self.finish(f.seq, f.result);
        }
        self.shared.active.store(self.batch.len(), Ordering::SeqCst);
    }

    fn finish(
        &mut self,
        id: SeqId,
        result: Result<specdec_core::Output, specdec_core::DecodeError>,
    ) {
        self.batch.release(id);
        // Before the client hears of the end, so `/metrics` never shows it active afterwards.
        self.shared.active.store(self.batch.len(), Ordering::SeqCst);
        let Some(mut a) = self.jobs.remove(&id) else {
            return;
        };
        let (output, error) = match result {
            Ok(o) => (o, None),
            Err(e) => (*e.output, Some(e.error.to_string())),
        };
        if let Ok(mut m) = self.shared.metrics.lock() {
            m.record_output(&output.metrics, output.tokens.len());
        }
        if let Some(l) = &mut self.learner {
            l.learn(a.drafter, &output.metrics, a.alone);
        }
        if !a.stopped_by_text {
            // The text still held back: an incomplete character, or the start of a stop string
            // that never came.
            let tail = a.detok.finish(&*self.codec);
            match a.stop.push(&tail) {
                Release::Text(t) => {
                    let rest = a.stop.finish();
                    a.send_text(t + &rest);
                }
                Release::Stopped(t) => {
                    a.stopped_by_text = true;
                    a.send_text(t);
                }
            }
            if !a.pending.is_empty() {
                a.send_text(String::new());
            }
        }
        if let Some(e) = error {
            let _ = a.events.send(Event::Failed(e));
            return;
        }
        let finish = if a.stopped_by_text {
            Finish::Stop
        } else {
            match output.stop_reason {
                Some(StopReason::StopToken(_)) => Finish::Stop,
                Some(StopReason::MaxTokens) | Some(StopReason::ContextFull) => Finish::Length,
                // Cut short: by a client that left (it hears nothing) or by the server shutting
                // down. OpenAI has no finish reason for that, so the client gets an error after the
                // text it already has.
                Some(StopReason::Cancelled) | None => {
                    let _ = a.events.send(Event::Failed(format!(
                        "the server shut down before the request finished ({} tokens generated)",
                        output.tokens.len()
                    )));
                    return;
                }
            }
        };
        let _ = a.events.send(Event::Done(Box::new(Summary {
            finish,
            prompt_tokens: a.prompt_tokens,
            completion_tokens: output.tokens.len(),
            metrics: output.metrics,
            drafter: a.drafter,
            draft_len: a.draft_len,
        })));
    }

    fn cancel_everything(&mut self, rx: &Receiver<Job>) {
        let ids: Vec<SeqId> = self.batch.ids().collect();
        for id in ids {
            if let Some(out) = self.batch.cancel(id) {
                self.finish(id, Ok(out));
            }
        }
        while let Ok(job) = rx.try_recv() {
            self.waiting.push_back(job);
        }
        for job in self.waiting.drain(..) {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            let _ = job
                .events
                .send(Event::Failed("the server is shutting down".into()));
        }
    }
}

impl Active {
    fn on_token(&mut self, codec: &dyn Codec, e: &Emitted) -> ControlFlow<()> {
        let piece = self.detok.push(codec, e.token);
        self.pending.push(TokenOut {
            id: e.token,
            bytes: codec.token_bytes(e.token),
            drafted: e.drafted,
            logprob: e.logprob.clone(),
        });
        if piece.is_empty() {
            return ControlFlow::Continue(());
        }
        let sent = match self.stop.push(&piece) {
            Release::Text(t) if t.is_empty() => true,
            Release::Text(t) => self.send_text(t),
            Release::Stopped(t) => {
                self.stopped_by_text = true;
                self.send_text(t);
                return ControlFlow::Break(());
            }
        };
        if sent {
            ControlFlow::Continue(())
        } else {
            ControlFlow::Break(())
        }
    }

    /// Sends text with the tokens waiting for it; false if the client is gone.
    fn send_text(&mut self, text: String) -> bool {
        let tokens = std::mem::take(&mut self.pending);
        if text.is_empty() && tokens.is_empty() {
            return true;
        }
        self.events
            .send(Event::Chunk {
                text,
                tokens,
                live: self.live,
            })
            .is_ok()
    }
}

/// The draft-length policy as reported to clients.
fn describe(p: &DraftLenPolicy, drafter: DrafterKind) -> String {
    if drafter == DrafterKind::None {
        return "none".into();
    }
    match p {
        DraftLenPolicy::Fixed { draft_len } => draft_len.to_string(),
        DraftLenPolicy::Adaptive { .. } => "adaptive".into(),
        DraftLenPolicy::CostModel { .. } => "auto".into(),
    }
}

/// Collects a job's events until the end: the text, the tokens, and the summary or error.
pub async fn collect(
    rx: &mut UnboundedReceiver<Event>,
) -> (String, Vec<TokenOut>, Result<Summary, String>) {
    let mut text = String::new();
    let mut tokens = Vec::new();
    while let Some(e) = rx.recv().await {
        match e {
            Event::Chunk {
                text: t, tokens: k, ..
            } => {
                text.push_str(&t);
                tokens.extend(k);
            }
            Event::Done(s) => return (text, tokens, Ok(*s)),
            Event::Failed(e) => return (text, tokens, Err(e)),
        }
    }
    (text, tokens, Err("the engine stopped".into()))
}

/// A panic's message, where it is a string.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

#[cfg(test)]
mod tests {
    use super::{token_string, DrafterKind, MultiDrafter};
    use specdec_core::mock::{reading_costs, MockLogits, MockModel};
    use specdec_core::{
        Draft, ModelDrafter, PrefillRequest, Proposal, SamplingParams, SeqId, TokenId,
        READ_PROBE_AFTER,
    };

    /// A drafter with a draft model of hashed logits over 1,024 tokens, spread so wide that it is
    /// sure of each token (so that its confidence drafts the cost model's length: these tests
    /// are about readings).
    fn hashed_drafter() -> MultiDrafter<MockModel> {
        MultiDrafter::new(Some(ModelDrafter::new(MockModel::new(
            MockLogits::Hashed {
                vocab: 1_024,
                seed: 3,
                scale: 100_000.0,
            },
        ))))
    }

    /// `seq` drafts with `kind` and its prompt is priced at prefill.
    fn select_and_read(
        d: &mut MultiDrafter<MockModel>,
        seq: SeqId,
        kind: DrafterKind,
        prompt: &[TokenId],
        remaining: usize,
        costs: &specdec_core::RoundCosts,
    ) {
        assert!(d.select(seq, kind));
        d.prefill_priced(&PrefillRequest {
            seq,
            prompt,
            remaining,
            costs: Some(costs),
        })
        .unwrap();
    }

    /// Reading a prompt the draft model could not repay within the request's tokens is left
    /// undone: the hybrid drafts from the lookup alone, the model kind decodes plainly, and a
    /// request with room to repay it drafts with the model as before.
    #[test]
    fn a_prompt_the_draft_model_could_not_repay_is_never_read() {
        let costs = reading_costs();
        // 1,000 distinct tokens: nothing for the lookup to find.
        let prompt: Vec<TokenId> = (0..1_000).collect();
        let mut d = hashed_drafter();
        let (hybrid, model, roomy) = (SeqId(1), SeqId(2), SeqId(3));
        for (seq, kind, remaining) in [
            (hybrid, DrafterKind::Hybrid, 16),
            (model, DrafterKind::Model, 16),
            (roomy, DrafterKind::Hybrid, 1_000),
        ] {
            select_and_read(&mut d, seq, kind, &prompt, remaining, &costs);
        }
        let sampling = SamplingParams::greedy();
        let req = |seq| specdec_core::mock::draft_request(seq, &prompt, &sampling, Some(&costs));
        let mut out = vec![Proposal::default(); 3];
        d.propose(&[req(hybrid), req(model), req(roomy)], &mut out)
            .unwrap();
        assert!(out[0].tokens.is_empty(), "{:?}", out[0]);
        assert!(out[1].tokens.is_empty(), "{:?}", out[1]);
        assert_eq!(out[2].tokens.len(), 2);
        let m = d.model.as_ref().unwrap().model();
        // Two drafted positions, each one call for the one sequence that drafts.
        assert_eq!(m.stats().calls, 2);
        assert!(m.cached_tokens(hybrid).is_empty() && m.cached_tokens(model).is_empty());
        // A batch weighs the model drafts of the sequence that reads only.
        let lookup = SeqId(4);
        assert!(d.select(lookup, DrafterKind::Ngram));
        assert!(!d.model_drafts(hybrid) && !d.model_drafts(model) && !d.model_drafts(lookup));
        assert!(d.model_drafts(roomy));
    }

    /// After [`READ_PROBE_AFTER`] model-kind prompts left unread in a row, the next is read
    /// whatever its price (its model drafts, reading it as their catch-up), and the count starts
    /// over; hybrid-kind prompts keep a count of their own (since stop 69, as a `HybridDrafter`).
    #[test]
    fn after_prompts_of_a_kind_left_unread_in_a_row_the_next_one_is_read() {
        let costs = reading_costs();
        let prompt: Vec<TokenId> = (0..1_000).collect();
        let mut d = hashed_drafter();
        let mut next = 0;
        let mut read = |d: &mut MultiDrafter<MockModel>, kind| {
            next += 1;
            let seq = SeqId(next);
            select_and_read(d, seq, kind, &prompt, 16, &costs);
            d.model_drafts(seq)
        };
        assert!(!read(&mut d, DrafterKind::Hybrid));
        for i in 0..READ_PROBE_AFTER {
            assert!(!read(&mut d, DrafterKind::Model), "prompt {i}");
            if i + 1 < READ_PROBE_AFTER {
                assert!(!read(&mut d, DrafterKind::Hybrid), "prompt {i}");
            }
        }
        assert!(read(&mut d, DrafterKind::Model));
        assert!(!read(&mut d, DrafterKind::Model));
        assert!(read(&mut d, DrafterKind::Hybrid));
        assert!(!read(&mut d, DrafterKind::Hybrid));
        assert!(!read(&mut d, DrafterKind::Model));
    }

    /// Gives `d`'s hybrid requests a measure taken on an answer of 100 tokens, after a prompt of
    /// `prompt_len`, that the lookup had 80% right (16 of its first 20 too) and where the model
    /// saved nothing.
    fn measure_nothing_saved(d: &mut MultiDrafter<MockModel>, prompt_len: usize) {
        d.hybrid_savings.read(SeqId(100), prompt_len);
        let measured: Vec<TokenId> = (0..prompt_len as TokenId + 100).collect();
        d.hybrid_savings
            .committed(&mut d.lookup, SeqId(100), &measured);
        assert!(!d
            .hybrid_savings
            .finish(SeqId(100), Some((100, 80)), Some((20, 16)), false));
        assert_eq!(d.hybrid_savings.savings().saved_per_token(), Some(0.0));
    }

    /// A hybrid answer left unread whose rounds forwent the price its reading had, and which the
    /// lookup covered far less than the answers the measure was taken on, has the next
    /// hybrid-kind prompt read whatever its price (as a `HybridDrafter`).
    #[test]
    fn an_unread_hybrid_answer_unlike_the_measured_ones_has_the_next_prompt_read() {
        let costs = reading_costs();
        let prompt: Vec<TokenId> = (0..40).collect();
        let mut d = hashed_drafter();
        // Every prompt after the measure is left unread by its price.
        measure_nothing_saved(&mut d, prompt.len());
        let sampling = SamplingParams::greedy();
        // 40 tokens at 0.05 are 2 steps, more than 4 tokens repay: left unread. `rounds` plain
        // rounds of new tokens follow (a third of a step forgone each; the horizon of 4 tokens
        // keeps the prompt unread).
        let unread_answer = |d: &mut MultiDrafter<MockModel>, seq, rounds| {
            select_and_read(d, seq, DrafterKind::Hybrid, &prompt, 4, &costs);
            assert!(!d.model_drafts(seq));
            let mut context = prompt.clone();
            d.commit(seq, &context).unwrap();
            for t in 0..rounds {
                let mut out = vec![Proposal::default()];
                let req = specdec_core::mock::draft_request(seq, &context, &sampling, Some(&costs));
                d.propose(&[req], &mut out).unwrap();
                assert!(out[0].tokens.is_empty());
                context.push(500 + t);
                d.commit(seq, &context).unwrap();
            }
            assert!(!d.model_drafts(seq));
            d.release(seq);
        };
        // Three rounds forgo 1 step: the next prompt is priced as before, and left unread.
        unread_answer(&mut d, SeqId(1), 3);
        // Ten forgo 3.3, more than 2: the next is read.
        unread_answer(&mut d, SeqId(2), 10);
        select_and_read(&mut d, SeqId(3), DrafterKind::Hybrid, &prompt, 4, &costs);
        assert!(d.model_drafts(SeqId(3)));
        d.release(SeqId(3));
        select_and_read(&mut d, SeqId(4), DrafterKind::Hybrid, &prompt, 4, &costs);
        assert!(!d.model_drafts(SeqId(4)));
    }

    #[test]
    fn an_unread_hybrid_answer_unlike_the_measured_ones_is_read_at_its_early_look() {
        let costs = reading_costs();
        let prompt: Vec<TokenId> = (0..400).collect();
        let mut d = hashed_drafter();
        measure_nothing_saved(&mut d, prompt.len());
        let sampling = SamplingParams::greedy();
        // 400 tokens at 0.05 are 20 steps: left unread. 16 plain rounds of new tokens forgo 5.3
        // steps, short of that price; the round after them looks at the answer so far (none of
        // it covered, 84 of 100 tokens left) and drafts with the model, which reads the whole
        // context.
        let seq = SeqId(1);
        select_and_read(&mut d, seq, DrafterKind::Hybrid, &prompt, 100, &costs);
        let mut context = prompt.clone();
        d.commit(seq, &context).unwrap();
        for t in 0..=16 {
            let mut out = vec![Proposal::default()];
            let req = specdec_core::mock::draft_request(seq, &context, &sampling, Some(&costs));
            d.propose(&[req], &mut out).unwrap();
            assert_eq!(out[0].tokens.is_empty(), t < 16, "round {t}: {:?}", out[0]);
            assert_eq!(d.model_drafts(seq), t == 16, "round {t}");
            if t == 16 {
                assert_eq!(out[0].lag, context.len());
            }
            context.push(500 + t);
            d.commit(seq, &context).unwrap();
        }
        // The next hybrid prompt is likely of the same kind: read whatever its price, though the
        // measure (nothing saved a token) would leave it unread; the one after it is priced again.
        // A model-kind prompt in between leaves that to the hybrid prompt.
        d.release(seq);
        select_and_read(&mut d, SeqId(5), DrafterKind::Model, &prompt, 100, &costs);
        d.release(SeqId(5));
        select_and_read(&mut d, SeqId(2), DrafterKind::Hybrid, &prompt, 100, &costs);
        assert!(d.model_drafts(SeqId(2)));
        d.release(SeqId(2));
        select_and_read(&mut d, SeqId(3), DrafterKind::Hybrid, &prompt, 100, &costs);
        assert!(!d.model_drafts(SeqId(3)));
    }

    /// A prompt left unread is read after all, by a model draft, once the plain rounds since
    /// forwent the price of reading it (a third of a step each here, against 0.05 a token) and
    /// the tokens left could repay it.
    #[test]
    fn a_prompt_left_unread_is_read_once_the_rounds_since_forwent_its_price() {
        let costs = reading_costs();
        let prompt: Vec<TokenId> = (0..40).collect();
        let mut d = hashed_drafter();
        let read = |d: &mut MultiDrafter<MockModel>, seq, remaining| {
            assert!(d.select(seq, DrafterKind::Model));
            d.prefill_priced(&PrefillRequest {
                seq,
                prompt: &prompt,
                remaining,
                costs: Some(&costs),
            })
            .unwrap();
        };
        // 40 tokens at 0.05 are 2 steps, more than 4 tokens repay: a model-kind answer of 4
        // tokens, its prompt left unread, prices the next one over 4 tokens, though that may
        // emit 100.
        let short = SeqId(9);
        read(&mut d, short, 4);
        assert!(!d.model_drafts(short));
        let mut answer = prompt.clone();
        answer.extend(900..904);
        d.commit(short, &answer).unwrap();
        d.release(short);
        assert_eq!(d.model_answers.answers().expected_len(100), 4.0);
        let seq = SeqId(1);
        read(&mut d, seq, 100);
        assert!(!d.model_drafts(seq));
        let sampling = SamplingParams::greedy();
        let mut context = prompt.clone();
        let mut rounds = 0;
        loop {
            let mut out = vec![Proposal::default()];
            d.propose(
                &[specdec_core::mock::draft_request(
                    seq,
                    &context,
                    &sampling,
                    Some(&costs),
                )],
                &mut out,
            )
            .unwrap();
            rounds += 1;
            if !out[0].tokens.is_empty() {
                // The whole context read as the catch-up of the first model draft.
                assert_eq!(out[0].lag, context.len());
                break;
            }
            assert!(rounds < 8, "nothing drafted after {rounds} rounds");
            context.push(100 + rounds);
        }
        // The price after n plain rounds is 0.05 (40 + n - 1) steps, forgone at n = 7.
        assert_eq!(rounds, 7);
        assert!(d.model_drafts(seq));
        let m = d.model.as_ref().unwrap().model();
        assert_eq!(m.cached_tokens(seq).len(), context.len() + 1);
    }

    /// Each kind's model rounds are settled against what the request would have done without the
    /// model (a model-kind request's against plain decoding, a hybrid one's against the lookup
    /// alone): where they lost (every draft rejected), the next request of that kind leaves its
    /// prompt unread although the prediction would read it, and the other kind is still read.
    #[test]
    fn each_kind_prices_the_next_reading_by_what_its_model_rounds_saved() {
        let costs = reading_costs();
        let prompt: Vec<TokenId> = (0..100).collect();
        let mut d = hashed_drafter();
        let read = |d: &mut MultiDrafter<MockModel>, seq, kind| {
            select_and_read(d, seq, kind, &prompt, 1_000, &costs);
        };
        // 100 tokens at 0.05 are 5 steps, predicted to be repaid by a third of a step a token.
        let lose = |d: &mut MultiDrafter<MockModel>, seq, kind| {
            read(d, seq, kind);
            assert!(d.model_drafts(seq));
            let sampling = SamplingParams::greedy();
            let mut context = prompt.clone();
            for round in 0..20 {
                let mut out = vec![Proposal::default()];
                let req = specdec_core::mock::draft_request(seq, &context, &sampling, Some(&costs));
                d.propose(&[req], &mut out).unwrap();
                // Tokens new to the context: the lookup has nothing, and the model drafts.
                assert!(!out[0].tokens.is_empty(), "{kind:?} round {round}");
                // The target rejects the draft's first token: one token for a round of 1.7 steps
                // or more, where plain decoding (or the lookup alone, which has nothing) would
                // have decoded it in one.
                let next = if out[0].tokens[0] == 200 + round {
                    700 + round
                } else {
                    200 + round
                };
                context.push(next);
                d.commit(seq, &context).unwrap();
            }
            d.release(seq);
        };
        lose(&mut d, SeqId(1), DrafterKind::Model);
        let saved = d.model_savings.saved_per_token().unwrap();
        assert!(saved <= -0.7 + 1e-9, "{saved}");
        assert!(d.hybrid_savings.savings().saved_per_token().is_none());
        // The prediction alone would read the next prompt (over the 20-token answer); the
        // measure does not.
        assert!(costs.prompt_read_pays(100, d.model_answers.answers().model_tokens(1_000)));
        read(&mut d, SeqId(2), DrafterKind::Model);
        assert!(!d.model_drafts(SeqId(2)));
        read(&mut d, SeqId(3), DrafterKind::Hybrid);
        assert!(d.model_drafts(SeqId(3)));
        d.release(SeqId(2));
        d.release(SeqId(3));

        let mut d = MultiDrafter::new(d.model.take());
        lose(&mut d, SeqId(4), DrafterKind::Hybrid);
        let saved = d.hybrid_savings.savings().saved_per_token().unwrap();
        assert!(saved <= -0.7 + 1e-9, "{saved}");
        assert!(d.model_savings.saved_per_token().is_none());
        assert!(costs.prompt_read_pays(100, d.lookup.recent_answers().model_tokens(1_000)));
        read(&mut d, SeqId(5), DrafterKind::Hybrid);
        assert!(!d.model_drafts(SeqId(5)));
        read(&mut d, SeqId(6), DrafterKind::Model);
        assert!(d.model_drafts(SeqId(6)));
    }

    /// A model-kind request's reading is priced over the answers that model-kind requests gave
    /// lately: after short answers (none drafted by the model, so no measured savings), the
    /// prediction no longer expects the whole token limit and leaves a long prompt unread, while a
    /// hybrid request (whose lookup saw no answers) still reads it.
    #[test]
    fn a_model_kind_reading_is_priced_over_the_model_kind_answers_lately() {
        let costs = reading_costs();
        let prompt: Vec<TokenId> = (0..100).collect();
        let mut d = hashed_drafter();
        let read = |d: &mut MultiDrafter<MockModel>, seq, kind| {
            select_and_read(d, seq, kind, &prompt, 1_000, &costs);
        };
        // 100 tokens at 0.05 are 5 steps, repaid by a third of a step a token in 15 tokens: the
        // whole limit is expected before any answer.
        read(&mut d, SeqId(1), DrafterKind::Model);
        assert!(d.model_drafts(SeqId(1)));
        let mut context = prompt.clone();
        context.extend([500, 501, 502]);
        d.commit(SeqId(1), &context).unwrap();
        d.release(SeqId(1));
        assert_eq!(d.model_answers.answers().expected_len(1_000), 3.0);
        assert!(d.model_savings.saved_per_token().is_none());
        read(&mut d, SeqId(2), DrafterKind::Model);
        assert!(!d.model_drafts(SeqId(2)));
        read(&mut d, SeqId(3), DrafterKind::Hybrid);
        assert!(d.model_drafts(SeqId(3)));
        // The unread request's answer counts too: a long one makes the next reading pay again.
        context = prompt.clone();
        context.extend(1_000..1_200);
        d.commit(SeqId(2), &context).unwrap();
        d.release(SeqId(2));
        assert!(d.model_answers.answers().expected_len(1_000) > 15.0);
        read(&mut d, SeqId(4), DrafterKind::Model);
        assert!(d.model_drafts(SeqId(4)));
    }

    #[test]
    fn a_token_string_is_its_text_or_its_escaped_bytes() {
        assert_eq!(token_string(b"hello"), "hello");
        assert_eq!(token_string("é".as_bytes()), "é");
        assert_eq!(token_string(b""), "");
        // Part of a character: the whole characters stay text, the rest is escaped.
        assert_eq!(token_string(&[0xc3]), "bytes:\\xc3");
        assert_eq!(token_string(&[b' ', 0xf0, 0x9f]), "bytes: \\xf0\\x9f");
        assert_eq!(token_string(&[0x80, b'a']), "bytes:\\x80a");
    }
}
