//! Peak resident memory of the default pair: at most 1.5x the two files. A test binary of its own, so
//! that no other test's models share the process, with its own harness so that missing models are
//! reported as `ignored` (or fail with `SPECDEC_REQUIRE_MODELS=1`).

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;

use specdec_core::{generate, GenerateConfig, ModelDrafter, SamplingParams};
use specdec_runtime::testing::{real_trial, run_trials};
use specdec_runtime::{Gguf, LoadOptions, Model, Session, Tokenizer};

fn main() {
    run_trials(vec![real_trial(
        "default_pair_peak_rss_is_at_most_one_and_a_half_times_the_files",
        &["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"],
        |m| peak_rss(&m[0], &m[1]),
    )])
}

fn vm_hwm_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn peak_rss(tp: &Path, dp: &Path) {
    // Linux, the only platform the project runs its tests on, always has it.
    let before = vm_hwm_bytes().expect("/proc/self/status has VmHWM");
    let files = std::fs::metadata(tp).unwrap().len() + std::fs::metadata(dp).unwrap().len();
    let tg = Gguf::open(tp).unwrap();
    let tok = Tokenizer::from_gguf(&tg).unwrap();
    let target = Arc::new(Model::from_gguf(&tg, &LoadOptions::default()).unwrap());
    let draft = Arc::new(Model::load(dp, &LoadOptions::default()).unwrap());
    let mut t = Session::new(target, 4096);
    let mut d = ModelDrafter::new(Session::new(draft, 4096));
    let prompt = tok.encode("def quicksort(xs):", true).unwrap();
    let config = GenerateConfig {
        max_new_tokens: 32,
        sampling: SamplingParams::greedy(),
        ..GenerateConfig::default()
    };
    generate(&mut t, &mut d, &prompt, &config, &mut |_| {
        ControlFlow::Continue(())
    })
    .unwrap();
    let hwm = vm_hwm_bytes().unwrap();
    eprintln!(
        "peak RSS {:.2} GB (test harness before loading: {:.2} GB) for {:.2} GB of files: {:.2}x",
        hwm as f64 / 1e9,
        before as f64 / 1e9,
        files as f64 / 1e9,
        hwm as f64 / files as f64
    );
    assert!(
        hwm as f64 <= 1.5 * files as f64,
        "peak RSS {hwm} exceeds 1.5x the files ({files})"
    );
}
