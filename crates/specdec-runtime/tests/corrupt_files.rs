//! Corrupted model files: a tiny model's bytes changed at random places (its header above all),
//! then opened, loaded, tokenized and run for a few tokens. Every stage may fail, but only with an
//! error: none may panic. `SPECDEC_CORRUPT_CASES` sets how many corrupted files each kind of
//! change tries (default 300; the corruptions are seeded, so a run is repeatable).

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use common::tiny;
use specdec_runtime::testing::TinySpec;
use specdec_runtime::{Arch, Gguf, LoadOptions, Message, Model, Session, Tokenizer};

/// A small deterministic generator (splitmix64): the corruptions must be the same on every run.
struct Mix(u64);

impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// What a corrupted file got to before its first error (or the end).
#[derive(Debug, Default, Clone, Copy)]
struct Reached {
    opened: usize,
    loaded: usize,
    tokenized: usize,
    ran: usize,
}

/// Runs every stage a command runs on a model file; `Err` is a panic's message.
fn exercise(path: &std::path::Path, reached: &mut Reached) -> Result<(), String> {
    let mut stage = "open";
    let result = catch_unwind(AssertUnwindSafe(|| {
        let Ok(g) = Gguf::open(path) else { return };
        reached.opened += 1;
        stage = "tokenizer";
        let tokenizer = Tokenizer::from_gguf(&g);
        stage = "load";
        // One thread: the caller runs every kernel chunk, so a panic in one reaches
        // `catch_unwind` (a pool worker's would not).
        let options = LoadOptions {
            threads: Some(1),
            ..LoadOptions::default()
        };
        let Ok(model) = Model::from_gguf(&g, &options) else {
            return;
        };
        reached.loaded += 1;
        let model = Arc::new(model);
        let Ok(tokenizer) = tokenizer else { return };
        stage = "encode";
        let Ok(prompt) = tokenizer.encode_chat(&[Message::new("user", "Hi there!")]) else {
            return;
        };
        reached.tokenized += 1;
        stage = "feed";
        let vocab = model.config().vocab;
        let prompt: Vec<u32> = prompt
            .into_iter()
            .filter(|&t| (t as usize) < vocab)
            .collect();
        let mut session = Session::new(model, 64);
        if session.feed(&prompt[..prompt.len().min(8)], 1).is_err() {
            return;
        }
        if session.feed(&[0, 1, 2], 3).is_err() {
            return;
        }
        stage = "decode";
        let _ = tokenizer.decode(&prompt);
        reached.ran += 1;
    }));
    result.map_err(|panic| {
        let msg = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        format!("panicked in {stage}: {msg}")
    })
}

fn cases() -> usize {
    std::env::var("SPECDEC_CORRUPT_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300)
}

/// Values that make counts, lengths, offsets, types and dimensions absurd.
const WORDS: [u64; 10] = [
    0,
    1,
    2,
    7,
    255,
    0xFFFF,
    0x7FFF_FFFF,
    0xFFFF_FFFF,
    1 << 40,
    u64::MAX,
];

#[test]
fn corrupted_files_are_errors_never_panics() {
    let cases = cases();
    let mut failures = Vec::new();
    let mut reached = Reached::default();
    let mut tried = 0;
    for (n, (arch, dtype)) in [
        (Arch::Qwen2, GgmlDType::Q8_0),
        (Arch::Llama, GgmlDType::Q4K),
    ]
    .into_iter()
    .enumerate()
    {
        let (dir, path) = tiny(&TinySpec::new(arch, dtype));
        let good = std::fs::read(&path).unwrap();
        // The header ends where the tensor data starts (aligned after the tensor infos).
        let header = {
            let g = Gguf::open(&path).unwrap();
            g.content().tensor_data_offset as usize
        };
        assert!(header > 64 && header < good.len());
        let bad_path = dir.path().join("corrupt.gguf");
        let mut mix = Mix(0x5EED + n as u64);
        for case in 0..cases * 3 {
            let mut bad = good.clone();
            let what = match case % 3 {
                // A few random bytes of the header.
                0 => {
                    for _ in 0..1 + mix.below(3) {
                        let at = mix.below(header);
                        bad[at] = mix.next() as u8;
                    }
                    "bytes"
                }
                // One absurd little-endian word at a random place of the header.
                1 => {
                    let word = WORDS[mix.below(WORDS.len())];
                    let width = [4usize, 8][mix.below(2)];
                    let at = mix.below(header - width);
                    bad[at..at + width].copy_from_slice(&word.to_le_bytes()[..width]);
                    "word"
                }
                // Cut short anywhere, or a random byte of the tensor data changed.
                _ => {
                    if mix.below(2) == 0 {
                        bad.truncate(mix.below(good.len()));
                        "truncated"
                    } else {
                        let at = header + mix.below(good.len() - header);
                        bad[at] = mix.next() as u8;
                        "data"
                    }
                }
            };
            std::fs::write(&bad_path, &bad).unwrap();
            tried += 1;
            if let Err(e) = exercise(&bad_path, &mut reached) {
                failures.push(format!("{arch:?} {dtype:?} case {case} ({what}): {e}"));
            }
        }
    }
    eprintln!("{tried} corrupted files: {reached:?}");
    // The corruptions must reach past the header parser, or the test checks little.
    assert!(
        tried > 0 && reached.ran > tried / 10,
        "too few corrupted files ran: {reached:?}"
    );
    assert!(
        failures.is_empty(),
        "{} of {tried} corrupted files panicked:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Every metadata key of a tiny model replaced in turn by values of the right type that make no
/// sense (zero, huge, negative, not a number, empty) and by values of other types.
#[test]
fn absurd_metadata_values_are_errors_never_panics() {
    use candle_core::quantized::gguf_file::{self, Value};
    use candle_core::quantized::QTensor;
    let absurd = || {
        vec![
            Value::U32(0),
            Value::U32(1),
            Value::U32(3),
            Value::U32(u32::MAX),
            Value::U64(1 << 40),
            Value::I32(-1),
            Value::F32(0.0),
            Value::F32(-1.0),
            Value::F32(f32::NAN),
            Value::F32(f32::INFINITY),
            Value::F64(1e300),
            Value::Bool(true),
            Value::String(String::new()),
            Value::String("{% for".into()),
            Value::Array(Vec::new()),
            Value::Array(vec![Value::U32(7); 3]),
        ]
    };
    let mut failures = Vec::new();
    let mut reached = Reached::default();
    let mut tried = 0;
    for (arch, dtype) in [
        (Arch::Qwen2, GgmlDType::Q8_0),
        (Arch::Llama, GgmlDType::Q4K),
    ] {
        let (dir, path) = tiny(&TinySpec::new(arch, dtype));
        let g = Gguf::open(&path).unwrap();
        let mut f = std::fs::File::open(&path).unwrap();
        let mut names: Vec<&String> = g.content().tensor_infos.keys().collect();
        names.sort();
        let tensors: Vec<(&str, QTensor)> = names
            .iter()
            .map(|n| {
                let t = g
                    .content()
                    .tensor(&mut f, n, &candle_core::Device::Cpu)
                    .unwrap();
                (n.as_str(), t)
            })
            .collect();
        let mut keys: Vec<&String> = g.content().metadata.keys().collect();
        keys.sort();
        let bad_path = dir.path().join("absurd.gguf");
        for key in keys {
            for value in absurd() {
                let meta: Vec<(&str, &Value)> = g
                    .content()
                    .metadata
                    .iter()
                    .map(|(k, v)| (k.as_str(), if k == key { &value } else { v }))
                    .collect();
                let t: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (*k, v)).collect();
                let mut out = std::fs::File::create(&bad_path).unwrap();
                gguf_file::write(&mut out, &meta, &t).unwrap();
                drop(out);
                tried += 1;
                if let Err(e) = exercise(&bad_path, &mut reached) {
                    failures.push(format!("{arch:?} {dtype:?} {key} = {value:?}: {e}"));
                }
            }
        }
    }
    eprintln!("{tried} files with an absurd metadata value: {reached:?}");
    assert!(
        failures.is_empty(),
        "{} of {tried} files panicked:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
