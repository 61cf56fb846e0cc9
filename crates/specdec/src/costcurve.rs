//! `specdec bench --cost-curve`: what one token, a block of m tokens and a prompt cost on this machine,
//! for the target and the draft, against the machine's measured read bandwidth.

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

/// Single-token steps timed per decode measurement.
const DECODE_STEPS: usize = 24;
/// Repetitions per block size of the r(m) curve (the median is kept).
const BLOCK_REPS: usize = 9;

/// The cost figures of one model.
#[derive(Clone, Debug, Serialize)]
pub struct ModelCosts {
    /// The model file.
    pub model: String,
    /// Bytes of weights one token streams.
    pub weight_bytes: usize,
    /// Decode tokens/s with 128 tokens of context (median step).
    pub decode_tok_s_ctx128: f64,
    /// Decode tokens/s with 2,048 tokens of context (median step), if the context allows it.
    pub decode_tok_s_ctx2048: Option<f64>,
    /// Prefill tokens/s of a 512-token prompt.
    pub prefill_tok_s_512: f64,
    /// `r(m) = t(m) / t(1)` for `m = 1..=16`, after 128 tokens of context.
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
    /// Read bandwidth of this machine with `threads` threads, GB/s (best of 3 passes over 1 GiB).
    pub read_gb_s: f64,
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

/// Best-of-3 read bandwidth over a 1 GiB buffer, split over `pool`'s threads.
pub fn read_bandwidth(pool: &ThreadPool) -> f64 {
    const BYTES: usize = 1 << 30;
    let words = BYTES / 8;
    // Written once so every page is really backed (a zeroed allocation would read the zero page).
    let buf: Vec<u64> = (0..words as u64).collect();
    let sink = AtomicU64::new(0);
    let mut best = 0.0f64;
    for _ in 0..3 {
        let start = Instant::now();
        pool.for_chunks(words, 1 << 20, &|r| {
            let mut acc = [0u64; 8];
            for c in buf[r].chunks_exact(8) {
                for (a, &x) in acc.iter_mut().zip(c) {
                    *a ^= x;
                }
            }
            sink.fetch_xor(acc.iter().fold(0, |a, &b| a ^ b), Ordering::Relaxed);
        });
        let gb_s = BYTES as f64 / start.elapsed().as_secs_f64() / 1e9;
        best = best.max(gb_s);
    }
    std::hint::black_box(sink.load(Ordering::Relaxed));
    best
}

fn model_costs(model: &Arc<Model>, name: &str, ctx: usize, read_gb_s: f64) -> Result<ModelCosts> {
    let vocab = model.config().vocab;
    let cap = ctx.min(model.config().ctx_train);
    // Decode after 128 tokens, and r(m) at the same context.
    let mut s = Session::new(model.clone(), cap);
    let context = tokens(128, vocab, 1);
    s.feed(&context, 1)?;
    let step = |s: &mut Session, n: usize, salt: usize| -> Result<f64> {
        let start_len = s.tokens().len();
        let toks = tokens(n, vocab, salt);
        let mut t = Vec::with_capacity(n);
        for &tok in &toks {
            let start = Instant::now();
            s.feed(&[tok], 1)?;
            t.push(start.elapsed().as_secs_f64());
        }
        s.rollback(start_len)?;
        Ok(median(t))
    };
    step(&mut s, 4, 9)?; // warm-up
    let t128 = step(&mut s, DECODE_STEPS, 2)?;
    let mut times = Vec::with_capacity(16);
    for m in 1..=16 {
        let mut t = Vec::with_capacity(BLOCK_REPS);
        for rep in 0..BLOCK_REPS {
            let block = tokens(m, vocab, 3 + rep);
            let start = Instant::now();
            s.feed(&block, m)?;
            t.push(start.elapsed().as_secs_f64());
            s.rollback(context.len())?;
        }
        times.push(median(t));
    }
    let t1 = times[0];
    // Decode after 2,048 tokens.
    let t2048 = if cap >= 2048 + DECODE_STEPS {
        let mut s = Session::new(model.clone(), cap);
        s.feed(&tokens(2048, vocab, 4), 1)?;
        step(&mut s, 4, 9)?;
        Some(step(&mut s, DECODE_STEPS, 5)?)
    } else {
        None
    };
    // Prefill of 512 tokens: best of 2.
    let mut prefill = Vec::new();
    for rep in 0..2 {
        let mut s = Session::new(model.clone(), cap.max(513));
        let p = tokens(512, vocab, 6 + rep);
        let start = Instant::now();
        s.feed(&p, 1)?;
        prefill.push(512.0 / start.elapsed().as_secs_f64());
    }
    let achieved = model.step_bytes() as f64 / t128 / 1e9;
    Ok(ModelCosts {
        model: name.to_string(),
        weight_bytes: model.step_bytes(),
        decode_tok_s_ctx128: 1.0 / t128,
        decode_tok_s_ctx2048: t2048.map(|t| 1.0 / t),
        prefill_tok_s_512: prefill.iter().copied().fold(0.0, f64::max),
        r: times.iter().map(|t| t / t1).collect(),
        step_s: t128,
        achieved_gb_s: achieved,
        roofline_fraction: achieved / read_gb_s,
    })
}

fn print(name: &str, m: &ModelCosts) {
    let r: Vec<String> = m.r.iter().map(|r| format!("{r:.2}")).collect();
    println!(
        "{name}: decode {:.1} tok/s at context 128, {} at 2048; prefill {:.1} tok/s (512 tokens); \
         {:.2} GB/s of weights per step ({:.0}% of the read roofline)",
        m.decode_tok_s_ctx128,
        m.decode_tok_s_ctx2048
            .map_or("-".into(), |t| format!("{t:.1} tok/s")),
        m.prefill_tok_s_512,
        m.achieved_gb_s,
        100.0 * m.roofline_fraction
    );
    println!("{name}: r(m) for m = 1..16: {}", r.join(" "));
}

/// `specdec bench --cost-curve`.
pub fn command(args: &BenchArgs, ui: Ui) -> Result<()> {
    let loaded = Loaded::load(&args.model, &[DrafterKind::Model], ui)?;
    let pool = thread_pool(args.model.threads)?;
    ui.note("measuring read bandwidth (1 GiB, best of 3)");
    let read_gb_s = read_bandwidth(&pool);
    ui.note("timing the target: decode at context 128 and 2048, r(m) for m = 1..16, prefill 512");
    let target = model_costs(&loaded.target, &args.model.target, loaded.ctx, read_gb_s)?;
    let draft = match &loaded.draft {
        Some(d) => {
            ui.note("timing the draft");
            Some(model_costs(d, &args.model.draft, loaded.ctx, read_gb_s)?)
        }
        None => None,
    };
    let c = draft.as_ref().map(|d| d.step_s / target.step_s);
    let curve = CostCurve {
        threads: pool.threads(),
        kernels: Kernels::get().level().name().to_string(),
        read_gb_s,
        target,
        draft,
        c,
    };
    println!(
        "threads {}, kernels {}, read bandwidth {:.1} GB/s",
        curve.threads, curve.kernels, curve.read_gb_s
    );
    print("target", &curve.target);
    if let Some(d) = &curve.draft {
        print("draft", d);
    }
    let r = &curve.target.r;
    println!(
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
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&curve)?)
            .with_context(|| format!("writing {}", path.display()))?;
        ui.note(format!("wrote {}", path.display()));
    }
    Ok(())
}
