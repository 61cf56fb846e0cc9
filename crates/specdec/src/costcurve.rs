//! `specdec bench --cost-curve`: what one token, a block of m tokens and a prompt cost on this machine,
//! for the target and the draft, against the machine's measured read bandwidth.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use serde::Serialize;
use specdec_core::TokenId;
use specdec_kernels::{Kernels, ThreadPool};
use specdec_runtime::{thread_pool, Model, Session};

use crate::cli::{BenchArgs, DrafterKind};
use crate::engine::{Loaded, Ui};

/// Sweeps per run. Each sweep times, for the target and then the draft, blocks of 1..=16 tokens
/// after [`SHORT`] tokens of context, single steps after [`SHORT`] and after [`LONG`] tokens in
/// pairs, and then the machine's read bandwidth; every figure is a median over the sweeps. Other
/// tenants share this machine's memory, whose read rate moved between 27 and 55 GB/s from one run
/// to the next (stop 41): timed one after the other, each figure would carry the moment it was
/// timed in, and their ratios (r(m), context 2048 against 128, the roofline fraction, c) the
/// difference between two moments; timed in turn, a slow moment weighs on all of them alike.
const SWEEPS: usize = 9;
/// Tokens of context of the decode steps and the blocks.
const SHORT: usize = 128;
/// Tokens of context of the long decode steps.
const LONG: usize = 2048;
/// Single steps timed at each context per sweep (one after every fourth block length).
const PAIRS_PER_SWEEP: usize = 4;
/// Passes over 1 GiB that time the read bandwidth per sweep.
const READ_PASSES: usize = 3;

/// The cost figures of one model.
#[derive(Clone, Debug, Serialize)]
pub struct ModelCosts {
    /// The model file.
    pub model: String,
    /// Bytes of weights one token streams.
    pub weight_bytes: usize,
    /// Decode tokens/s with 128 tokens of context (median step).
    pub decode_tok_s_ctx128: f64,
    /// Decode tokens/s with 2,048 tokens of context (median step, the steps timed in pairs with
    /// those at 128), if the context allows it.
    pub decode_tok_s_ctx2048: Option<f64>,
    /// Prefill tokens/s of a 512-token prompt.
    pub prefill_tok_s_512: f64,
    /// `r(m) = t(m) / t(1)` for `m = 1..=16`, after 128 tokens of context: medians over the sweeps,
    /// `t(1)` the median single step.
    pub r: Vec<f64>,
    /// Seconds of one step on one token at context 128 (`t(1)`).
    pub step_s: f64,
    /// Weight bytes over the median step time: the read rate one decode step achieves.
    pub achieved_gb_s: f64,
    /// `achieved_gb_s` over the measured read bandwidth.
    pub roofline_fraction: f64,
}

/// Everything `--cost-curve` prints.
#[derive(Clone, Debug, Serialize)]
pub struct CostCurve {
    /// Kernel threads.
    pub threads: usize,
    /// The kernel level running ([`specdec_kernels::CpuLevel`]).
    pub kernels: String,
    /// Read bandwidth of this machine with `threads` threads, GB/s: the median of the passes over 1
    /// GiB, 3 per sweep (each the faster of a plain and a prefetching read loop). The median, as
    /// the decode figures are medians of steps timed in the same sweeps: a pass takes about as long
    /// as a step, and the best pass would compare a quiet moment of the machine against a typical
    /// step.
    pub read_gb_s: f64,
    /// The fastest of those passes, GB/s.
    pub read_gb_s_best: f64,
    /// The target's figures.
    pub target: ModelCosts,
    /// The draft's figures, when a draft model is loaded.
    pub draft: Option<ModelCosts>,
    /// `c` = draft step / target step, both at context 128.
    pub c: Option<f64>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Ordinary text tokens, deterministic, so the runs need no tokenizer or prompt file.
fn tokens(n: usize, vocab: usize, salt: usize) -> Vec<TokenId> {
    let span = vocab.clamp(2, 30_000) - 1;
    (0..n)
        .map(|i| (1 + (i * 7919 + salt * 104_729) % span) as TokenId)
        .collect()
}

/// A 1 GiB buffer to time reads of: the machine's read bandwidth.
struct Memory {
    buf: Vec<u64>,
}

impl Memory {
    const BYTES: usize = 1 << 30;

    fn new() -> Self {
        // Written once so every page is really backed (a zeroed allocation would read the zero page).
        Self {
            buf: (0..(Self::BYTES / 8) as u64).collect(),
        }
    }

    /// The rates of [`READ_PASSES`] passes over the buffer, split over `pool`'s threads, in GB/s.
    /// Each is the faster of two passes back to back, one a plain read loop and one that also
    /// prefetches 4 KiB ahead into L2 (x86-64): machines differ in which reads faster (stop 43: a
    /// 2-core EPYC, whose hardware prefetchers follow the stream, 52–60 GB/s plain against 44–54
    /// with the prefetch; a 16-core Xeon with AMX, whose do not, 19 against 23 with 2 threads), and
    /// the roofline is what the memory gives, however asked.
    fn read_gb_s(&self, pool: &ThreadPool) -> [f64; READ_PASSES] {
        let sink = AtomicU64::new(0);
        let pass = |prefetch: bool| {
            let start = Instant::now();
            pool.for_chunks(self.buf.len(), 1 << 20, &|r| {
                let mut acc = [0u64; 8];
                for c in self.buf[r].chunks_exact(8) {
                    if prefetch {
                        prefetch_l2(c.as_ptr().cast::<i8>().wrapping_add(4096));
                    }
                    for (a, &x) in acc.iter_mut().zip(c) {
                        *a ^= x;
                    }
                }
                sink.fetch_xor(acc.iter().fold(0, |a, &b| a ^ b), Ordering::Relaxed);
            });
            Self::BYTES as f64 / start.elapsed().as_secs_f64() / 1e9
        };
        let rates = std::array::from_fn(|_| pass(false).max(pass(true)));
        std::hint::black_box(sink.load(Ordering::Relaxed));
        rates
    }
}

/// Asks for the cache line at `at` in L2; a no-op off x86-64.
#[inline(always)]
fn prefetch_l2(at: *const i8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE, which the prefetch needs, is part of x86-64; a prefetch reads nothing the
    // program sees and cannot fault, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(at);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}

/// One model's timings, gathered over the sweeps.
struct Timings {
    model: Arc<Model>,
    /// After [`SHORT`] tokens.
    short: Session,
    /// After [`LONG`] tokens, where the context allows it.
    long: Option<Session>,
    /// Samples of `t(m)` after [`SHORT`] tokens, `m = 1..=16` (single steps at index 0).
    blocks: Vec<Vec<f64>>,
    /// Samples of single steps after [`LONG`] tokens.
    long_steps: Vec<f64>,
}

impl Timings {
    fn new(model: &Arc<Model>, ctx: usize) -> Result<Self> {
        let vocab = model.config().vocab;
        let cap = ctx.min(model.config().ctx_train);
        let mut short = Session::new(model.clone(), cap);
        short.feed(&tokens(SHORT, vocab, 1), 1)?;
        let long = if cap >= LONG + 16 {
            let mut s = Session::new(model.clone(), cap);
            s.feed(&tokens(LONG, vocab, 4), 1)?;
            Some(s)
        } else {
            None
        };
        let mut t = Self {
            model: model.clone(),
            short,
            long,
            blocks: (0..16).map(|_| Vec::new()).collect(),
            long_steps: Vec::new(),
        };
        // Warm-up, not kept.
        for salt in 0..4 {
            t.time(false, 1, salt)?;
            if t.long.is_some() {
                t.time(true, 1, salt)?;
            }
        }
        Ok(t)
    }

    /// Seconds of one pass over `m` tokens (with `m` rows of logits, as a verification scores
    /// them), rolled back afterwards.
    fn time(&mut self, long: bool, m: usize, salt: usize) -> Result<f64> {
        let vocab = self.model.config().vocab;
        let s = match (long, self.long.as_mut()) {
            (true, Some(s)) => s,
            _ => &mut self.short,
        };
        let base = s.tokens().len();
        let block = tokens(m, vocab, salt);
        let start = Instant::now();
        s.feed(&block, m)?;
        let secs = start.elapsed().as_secs_f64();
        s.rollback(base)?;
        Ok(secs)
    }

    /// One sweep: blocks of 1..=16 tokens, and after every fourth length a single step at each
    /// context.
    fn sweep(&mut self, rep: usize) -> Result<()> {
        for m in 1..=16 {
            let t = self.time(false, m, 3 + rep)?;
            self.blocks[m - 1].push(t);
            if m % (16 / PAIRS_PER_SWEEP) == 0 {
                let salt = 100 + rep * 16 + m;
                let t = self.time(false, 1, salt)?;
                self.blocks[0].push(t);
                if self.long.is_some() {
                    let t = self.time(true, 1, salt)?;
                    self.long_steps.push(t);
                }
            }
        }
        Ok(())
    }

    /// The figures, with the prefill of 512 tokens timed now (best of 2) and `read_gb_s` the
    /// sweeps' bandwidth.
    fn finish(self, name: &str, ctx: usize, read_gb_s: f64) -> Result<ModelCosts> {
        let vocab = self.model.config().vocab;
        let cap = ctx.min(self.model.config().ctx_train);
        let times: Vec<f64> = self.blocks.into_iter().map(median).collect();
        let t1 = times[0];
        let t2048 = (!self.long_steps.is_empty()).then(|| median(self.long_steps));
        drop(self.short);
        drop(self.long);
        let mut prefill = Vec::new();
        for rep in 0..2 {
            let mut s = Session::new(self.model.clone(), cap.max(513));
            let p = tokens(512, vocab, 6 + rep);
            let start = Instant::now();
            s.feed(&p, 1)?;
            prefill.push(512.0 / start.elapsed().as_secs_f64());
        }
        let achieved = self.model.step_bytes() as f64 / t1 / 1e9;
        Ok(ModelCosts {
            model: name.to_string(),
            weight_bytes: self.model.step_bytes(),
            decode_tok_s_ctx128: 1.0 / t1,
            decode_tok_s_ctx2048: t2048.map(|t| 1.0 / t),
            prefill_tok_s_512: prefill.iter().copied().fold(0.0, f64::max),
            r: times.iter().map(|t| t / t1).collect(),
            step_s: t1,
            achieved_gb_s: achieved,
            roofline_fraction: achieved / read_gb_s,
        })
    }
}

/// The two lines of one model's figures.
fn lines(name: &str, m: &ModelCosts) -> String {
    let r: Vec<String> = m.r.iter().map(|r| format!("{r:.2}")).collect();
    format!(
        "{name}: decode {:.1} tok/s at context 128, {} at 2048; prefill {:.1} tok/s (512 tokens); \
         {:.2} GB/s of weights per step ({:.0}% of the read roofline)",
        m.decode_tok_s_ctx128,
        m.decode_tok_s_ctx2048
            .map_or("-".into(), |t| format!("{t:.1} tok/s")),
        m.prefill_tok_s_512,
        m.achieved_gb_s,
        100.0 * m.roofline_fraction
    ) + &format!("\n{name}: r(m) for m = 1..16: {}\n", r.join(" "))
}

/// `specdec bench --cost-curve`.
pub fn command(args: &BenchArgs, ui: Ui) -> Result<()> {
    let loaded = Loaded::load(&args.model, &[DrafterKind::Model], ui)?;
    let pool = thread_pool(args.model.threads)?;
    let memory = Memory::new();
    let mut target = Timings::new(&loaded.target, loaded.ctx)?;
    let mut draft = match &loaded.draft {
        Some(d) => Some(Timings::new(d, loaded.ctx)?),
        None => None,
    };
    let mut read = Vec::with_capacity(SWEEPS);
    for rep in 0..SWEEPS {
        ui.note(format!(
            "sweep {} of {SWEEPS}: r(m) for m = 1..16 and decode at context {SHORT} and {LONG}, \
             target{}, then read bandwidth (3 pairs of passes over 1 GiB)",
            rep + 1,
            if draft.is_some() { " and draft" } else { "" }
        ));
        target.sweep(rep)?;
        if let Some(d) = draft.as_mut() {
            d.sweep(rep)?;
        }
        read.extend(memory.read_gb_s(&pool));
    }
    drop(memory);
    let read_gb_s_best = read.iter().copied().fold(0.0, f64::max);
    let read_gb_s = median(read);
    ui.note("timing prefill of 512 tokens");
    let target = target.finish(&args.model.target, loaded.ctx, read_gb_s)?;
    let draft = match draft {
        Some(d) => Some(d.finish(&args.model.draft, loaded.ctx, read_gb_s)?),
        None => None,
    };
    let c = draft.as_ref().map(|d| d.step_s / target.step_s);
    let curve = CostCurve {
        threads: pool.threads(),
        kernels: Kernels::get().level().name().to_string(),
        read_gb_s,
        read_gb_s_best,
        target,
        draft,
        c,
    };
    let mut out = format!(
        "threads {}, kernels {}, read bandwidth {:.1} GB/s (median of {} passes; fastest {:.1})\n",
        curve.threads,
        curve.kernels,
        curve.read_gb_s,
        SWEEPS * READ_PASSES,
        curve.read_gb_s_best
    );
    out += &lines("target", &curve.target);
    if let Some(d) = &curve.draft {
        out += &lines("draft", d);
    }
    let r = &curve.target.r;
    out += &format!(
        "calibration: target step {:.1} ms, draft step {}, c = {}, r(m) for m = 1..16: {}",
        curve.target.step_s * 1e3,
        curve
            .draft
            .as_ref()
            .map_or("-".into(), |d| format!("{:.1} ms", d.step_s * 1e3)),
        c.map_or("-".into(), |c| format!("{c:.3}")),
        r.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    // The figures first, then the file: a failure of one loses nothing of the other (a closed
    // stdout is an error, not a panic).
    let printed = writeln!(std::io::stdout(), "{out}").context("printing the figures");
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&curve)?)
            .with_context(|| format!("writing {}", path.display()))?;
        ui.note(format!("wrote {}", path.display()));
    }
    printed
}
