//! The `specdec` binary on the real default pair from the cache. A test binary with its own harness: a
//! test whose models are missing is reported by `cargo test` as `ignored, needs the real models`, or
//! fails when `SPECDEC_REQUIRE_MODELS=1` (as in CI, which fetches them first).

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::process::Command;

use serde_json::Value;
use specdec_runtime::testing::{real_trial, run_trials};

const PAIR: &[&str] = &["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"];

fn main() {
    run_trials(vec![real_trial(
        "real_default_pair_generates_and_matches_plain_decoding",
        PAIR,
        |_| real_default_pair_generates_and_matches_plain_decoding(),
    )])
}

fn real_default_pair_generates_and_matches_plain_decoding() {
    let run = |drafter: &str| -> Value {
        let out = Command::new(env!("CARGO_BIN_EXE_specdec"))
            .args([
                "generate",
                "--quiet",
                "--json",
                "--chat",
                "--prompt",
                "Write a function that reverses a string in Python.",
                "--max-tokens",
                "48",
                "--drafter",
                drafter,
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let plain = run("none");
    let spec = run("model");
    assert_eq!(spec["tokens"], plain["tokens"]);
    assert!(
        spec["text"].as_str().unwrap().contains("def "),
        "{}",
        spec["text"]
    );
    assert!(spec["stats"]["accepted"].as_u64().unwrap() > 0);
}
