//! The cost model's calibration, measured once per (target file, draft file, CPU model, threads) and
//! kept under `$SPECDEC_HOME/calibration/`, so that `--draft-len auto` starts calibrated instead of
//! warming up; the cost model keeps measuring online and replaces it as samples come in.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use specdec_core::{isotonic_curve, ContextCost, DraftLenPolicy, FixedCost};
use specdec_runtime::fetch::home;
use specdec_runtime::Session;

use crate::bench::median;
use crate::engine::{Loaded, Ui};

/// Measured costs: `r[m - 1] = t(m) / t(1)` for the target and the draft's step cost over `t(1)`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Calibration {
    /// Seconds of one target step on one token.
    pub target_step_s: f64,
    /// Seconds of one draft step on one token.
    pub draft_step_s: Option<f64>,
    /// `c`.
    pub c: Option<f64>,
    /// `r(m)` for `m = 1..=16`.
    pub r: Vec<f64>,
    /// How the target's costs grow with context, from blocks timed after [`LONG_CONTEXT`] tokens;
    /// `None` where the context size leaves no room for them (or in files written before stop 30).
    #[serde(default)]
    pub context: Option<ContextCost>,
    /// The context the blocks for `context` were timed after; `None` where they were not timed.
    #[serde(default)]
    pub long_context: Option<usize>,
}

/// Repetitions of each timing in [`measure`].
const SWEEPS: usize = 5;

/// The context after which [`measure`] times blocks again, to see how costs grow with context.
pub const LONG_CONTEXT: usize = 1024;

/// The block lengths timed after [`LONG_CONTEXT`] tokens.
const LONG_BLOCKS: [usize; 4] = [1, 4, 8, 16];

/// What is saved: the calibration and what it was measured on.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Saved {
    target: String,
    draft: Option<String>,
    cpu: String,
    threads: usize,
    kernels: String,
    calibration: Calibration,
}

/// Times the target on blocks of 1..=16 tokens after `context`, and the draft on single tokens:
/// medians of [`SWEEPS`] repetitions (three single target steps per repetition, which every ratio
/// is divided by). The repetitions are sweeps over all lengths, so that a
/// disturbance of the machine (another tenant, a frequency change) spoils one sample of several
/// lengths instead of all samples of one. Where the context size allows, each sweep also times
/// blocks of [`LONG_BLOCKS`] tokens in a second target session [`LONG_CONTEXT`] tokens long (at
/// least half of it past `context`), which gives [`ContextCost`].
pub fn measure(loaded: &Loaded, context: &[u32]) -> Result<Calibration> {
    let vocab = loaded.target.config().vocab.max(1) as u32;
    let time_block = |s: &mut Session, base: usize, m: usize, rep: u32| -> Result<f64> {
        s.rollback(base)?;
        let block: Vec<u32> = (0..m as u32)
            .map(|i| (100 + 7 * i + rep) % 1000 % vocab)
            .collect();
        let start = Instant::now();
        s.feed(&block, m)?;
        Ok(start.elapsed().as_secs_f64())
    };
    let at = context.len();
    let mut s = loaded.target_session();
    s.feed(context, 1)?;
    // A second session `long - at` tokens further on, timed in the same sweeps, so that a change in
    // the machine's speed weighs on both alike.
    let long = LONG_CONTEXT.max(at + LONG_CONTEXT / 2);
    let mut far = if long + 16 <= loaded.ctx {
        let mut far = loaded.target_session();
        let filler: Vec<u32> = (0..(long - at) as u32)
            .map(|i| (300 + 11 * i) % 4000 % vocab)
            .collect();
        far.feed(context, 1)?;
        far.feed(&filler, 1)?;
        Some(far)
    } else {
        None
    };
    let mut samples: Vec<Vec<f64>> = (0..16).map(|_| Vec::with_capacity(SWEEPS)).collect();
    let mut far_samples: Vec<Vec<f64>> = LONG_BLOCKS.iter().map(|_| Vec::new()).collect();
    for rep in 0..SWEEPS as u32 {
        for m in 1..=16 {
            samples[m - 1].push(time_block(&mut s, at, m, rep)?);
            // Single steps also mid-sweep and at its end: every ratio is divided by their median,
            // so a slow moment during the few single steps spoils the whole curve (one
            // calibration read t(1) 19% above the others and r(8) 1.62 where most read 1.9).
            if m == 8 || m == 16 {
                samples[0].push(time_block(&mut s, at, 1, rep)?);
            }
        }
        if let Some(far) = far.as_mut() {
            for (&m, t) in LONG_BLOCKS.iter().zip(far_samples.iter_mut()) {
                t.push(time_block(far, long, m, rep)?);
            }
        }
    }
    let times: Vec<f64> = samples.iter_mut().map(|t| median(t)).collect();
    let t1 = times[0];
    let r: Vec<f64> = times.iter().map(|t| t / t1).collect();
    let context_cost = far.as_ref().and_then(|_| {
        let timed: Vec<(usize, f64)> = LONG_BLOCKS
            .iter()
            .zip(far_samples.iter_mut())
            .map(|(&m, t)| (m, median(t) / t1))
            .collect();
        // Against the medians at the same lengths, not the smoothed curve.
        ContextCost::fit(at, long, &r, &timed)
    });
    drop(far);
    let draft_step_s = match &loaded.draft {
        Some(d) => {
            let mut ds = Session::new(d.clone(), loaded.ctx);
            ds.feed(context, 1)?;
            let mut t = Vec::new();
            for rep in 0..3 * SWEEPS as u32 {
                t.push(time_block(&mut ds, at, 1, rep)?);
            }
            Some(median(&mut t))
        }
        None => None,
    };
    Ok(Calibration {
        target_step_s: t1,
        draft_step_s,
        c: draft_step_s.map(|d| d / t1),
        r,
        context: context_cost,
        long_context: (long + 16 <= loaded.ctx).then_some(long),
    })
}

/// This CPU's model name, from `/proc/cpuinfo` where there is one.
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

fn file_key(path: &Path) -> String {
    let size = std::fs::metadata(path).map_or(0, |m| m.len());
    let stem = path
        .file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    format!("{stem}-{size}")
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Where the calibration of these models on this machine and kernels lives (the kernel level and
/// [`specdec_kernels::REVISION`]); `draft` is the file and how it was prepared at load
/// ([`crate::engine::draft_variant`]).
pub fn path(target: &Path, draft: Option<(&Path, &str)>, threads: usize) -> PathBuf {
    let name = format!(
        "{}__{}__{}__{}t__{}-r{}.json",
        file_key(target),
        draft.map_or_else(|| "none".into(), |(p, v)| format!("{}-{v}", file_key(p))),
        cpu_model(),
        threads,
        specdec_kernels::Kernels::get().level().name(),
        specdec_kernels::REVISION
    );
    home().join("calibration").join(sanitize(&name))
}

fn saved_path(loaded: &Loaded) -> PathBuf {
    path(
        &loaded.target_path,
        loaded
            .draft_path
            .as_deref()
            .map(|p| (p, loaded.draft_variant.as_str())),
        loaded.threads,
    )
}

/// Saves a calibration of `loaded`.
pub fn save(loaded: &Loaded, cal: &Calibration) -> Result<PathBuf> {
    let p = saved_path(loaded);
    if let Some(dir) = p.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let saved = Saved {
        target: loaded.target_path.display().to_string(),
        draft: loaded.draft_path.as_ref().map(|p| p.display().to_string()),
        cpu: cpu_model(),
        threads: loaded.threads,
        kernels: format!(
            "{}-r{}",
            specdec_kernels::Kernels::get().level().name(),
            specdec_kernels::REVISION
        ),
        calibration: cal.clone(),
    };
    let tmp = p.with_extension("partial");
    std::fs::write(&tmp, serde_json::to_string_pretty(&saved)?)
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &p).with_context(|| format!("writing {}", p.display()))?;
    Ok(p)
}

/// The saved calibration at `path` as a cost-model prior; `None` if there is none or it is unreadable.
pub fn load_path(path: &Path) -> Option<FixedCost> {
    read(path).and_then(|cal| as_prior(&cal))
}

/// The calibration saved at `path`, if there is a readable one.
fn read(path: &Path) -> Option<Calibration> {
    let text = std::fs::read_to_string(path).ok()?;
    let saved: Saved = serde_json::from_str(&text).ok()?;
    Some(saved.calibration)
}

/// A calibration as a cost-model prior; `None` if it is not a valid one.
fn as_prior(cal: &Calibration) -> Option<FixedCost> {
    // The file keeps the medians as measured; the cost model reads them as a non-decreasing curve.
    let cost = FixedCost {
        c: cal.c.unwrap_or(0.0),
        draft_fixed: 0.0,
        r: isotonic_curve(&cal.r, &[]),
        context: cal.context,
    };
    let policy = DraftLenPolicy::auto(Some(cost.clone()));
    policy.validate().ok()?;
    Some(cost)
}

/// Gives a cost-model policy without a prior the saved calibration of `loaded`, measuring and saving
/// one first (about ten seconds, once per models, CPU and thread count) when `measure_if_missing`.
pub fn apply(
    policy: &mut DraftLenPolicy,
    loaded: &Loaded,
    measure_if_missing: bool,
    ui: Ui,
) -> Result<()> {
    let DraftLenPolicy::CostModel { prior, cost, .. } = policy else {
        return Ok(());
    };
    if prior.is_some() || cost.is_some() {
        return Ok(());
    }
    let p = saved_path(loaded);
    let saved = read(&p);
    // A calibration that did not time blocks after a long context (written before stop 30, or with
    // a context size too small for it) is measured again where this run's context allows and
    // measuring is allowed; else it serves as it is.
    let stale = saved.as_ref().is_some_and(|s| s.long_context.is_none())
        && loaded.ctx >= LONG_CONTEXT + 16
        && measure_if_missing;
    if let Some(saved) = saved.filter(|_| !stale).as_ref().and_then(as_prior) {
        ui.note(format!("cost model: calibration from {}", p.display()));
        *prior = Some(saved);
        return Ok(());
    }
    if !measure_if_missing {
        return Ok(());
    }
    // 64 tokens of context and blocks of up to 16; a smaller context is not worth calibrating.
    if loaded.ctx < 128 {
        return Ok(());
    }
    ui.note("cost model: calibrating once for these models on this machine (about ten seconds)");
    let vocab = loaded.target.config().vocab.max(1) as u32;
    let context: Vec<u32> = (0..64).map(|i| (100 + 13 * i) % vocab).collect();
    // Without a calibration the cost model measures online from a short warm-up: a failure here
    // costs speed at the start, never the run.
    match measure(loaded, &context).and_then(|cal| save(loaded, &cal)) {
        Ok(p) => {
            ui.note(format!("cost model: calibration saved to {}", p.display()));
            *prior = load_path(&p);
        }
        Err(e) => ui.note(format!("cost model: calibration skipped: {e:#}")),
    }
    Ok(())
}
