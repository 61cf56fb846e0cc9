//! The cost model's calibration, measured once per (target file, draft file, CPU model, threads) and
//! kept under `$SPECDEC_HOME/calibration/`, so that `--draft-len auto` starts calibrated instead of
//! warming up; the cost model keeps measuring online and replaces it as samples come in.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use specdec_core::{isotonic_curve, DraftLenPolicy, FixedCost};
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
}

/// Repetitions of each timing in [`measure`].
const SWEEPS: usize = 5;

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
/// medians of [`SWEEPS`] repetitions. The repetitions are sweeps over all lengths, so that a
/// disturbance of the machine (another tenant, a frequency change) spoils one sample of several
/// lengths instead of all samples of one.
pub fn measure(loaded: &Loaded, context: &[u32]) -> Result<Calibration> {
    let vocab = loaded.target.config().vocab.max(1) as u32;
    let time_block = |s: &mut Session, m: usize, rep: u32| -> Result<f64> {
        s.rollback(context.len())?;
        let block: Vec<u32> = (0..m as u32)
            .map(|i| (100 + 7 * i + rep) % 1000 % vocab)
            .collect();
        let start = Instant::now();
        s.feed(&block, m)?;
        Ok(start.elapsed().as_secs_f64())
    };
    let mut s = loaded.target_session();
    s.feed(context, 1)?;
    let mut samples: Vec<Vec<f64>> = (0..16).map(|_| Vec::with_capacity(SWEEPS)).collect();
    for rep in 0..SWEEPS as u32 {
        for (m, t) in samples.iter_mut().enumerate() {
            t.push(time_block(&mut s, m + 1, rep)?);
        }
    }
    let times: Vec<f64> = samples.iter_mut().map(|t| median(t)).collect();
    let t1 = times[0];
    let draft_step_s = match &loaded.draft {
        Some(d) => {
            let mut ds = Session::new(d.clone(), loaded.ctx);
            ds.feed(context, 1)?;
            let mut t = Vec::new();
            for rep in 0..SWEEPS as u32 {
                t.push(time_block(&mut ds, 1, rep)?);
            }
            Some(median(&mut t))
        }
        None => None,
    };
    Ok(Calibration {
        target_step_s: t1,
        draft_step_s,
        c: draft_step_s.map(|d| d / t1),
        r: times.iter().map(|t| t / t1).collect(),
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
    let text = std::fs::read_to_string(path).ok()?;
    let saved: Saved = serde_json::from_str(&text).ok()?;
    let cal = saved.calibration;
    // The file keeps the medians as measured; the cost model reads them as a non-decreasing curve.
    let cost = FixedCost {
        c: cal.c.unwrap_or(0.0),
        draft_fixed: 0.0,
        r: isotonic_curve(&cal.r, &[]),
    };
    let policy = DraftLenPolicy::auto(Some(cost.clone()));
    policy.validate().ok()?;
    Some(cost)
}

/// Gives a cost-model policy without a prior the saved calibration of `loaded`, measuring and saving
/// one first (a few seconds, once per models, CPU and thread count) when `measure_if_missing`.
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
    if let Some(saved) = load_path(&p) {
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
    ui.note("cost model: calibrating once for these models on this machine (a few seconds)");
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
