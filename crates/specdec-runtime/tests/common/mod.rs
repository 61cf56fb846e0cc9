//! Shared helpers for the runtime's tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use specdec_runtime::testing::TinySpec;
use specdec_runtime::{Arch, LoadOptions, Model};

/// Writes a tiny model into a fresh temporary folder; the folder lives as long as the guard.
pub fn tiny(spec: &TinySpec) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    spec.write(&path).unwrap();
    (dir, path)
}

pub fn tiny_model(spec: &TinySpec) -> Arc<Model> {
    let (_dir, path) = tiny(spec);
    Arc::new(Model::load(&path, &LoadOptions::default()).unwrap())
}

/// Every architecture with every quantisation type the tests cover.
pub fn all_specs() -> Vec<TinySpec> {
    let mut out = Vec::new();
    for arch in [Arch::Llama, Arch::Qwen2] {
        for dtype in [
            GgmlDType::F32,
            GgmlDType::F16,
            GgmlDType::Q8_0,
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
        ] {
            out.push(TinySpec::new(arch, dtype));
        }
    }
    out
}

/// A real model from the cache, or `None` after printing why the test is skipped.
pub fn real_model(alias: &str) -> Option<PathBuf> {
    let m = specdec_runtime::fetch::known(alias).expect("a known alias");
    if m.is_present() {
        Some(m.path())
    } else {
        eprintln!(
            "SKIPPED: {alias} is not in {} (run `specdec fetch` or set SPECDEC_HOME)",
            specdec_runtime::fetch::models_dir().display()
        );
        None
    }
}

/// The default pair's files (target, draft), or `None` after printing why the test is skipped.
pub fn default_pair() -> Option<(PathBuf, PathBuf)> {
    let target = real_model("qwen2.5-coder-1.5b-instruct");
    let draft = real_model("qwen2.5-coder-0.5b-instruct");
    target.zip(draft)
}
