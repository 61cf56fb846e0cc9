//! Tiny random-weight models written by the tests: loading, shapes, the block-vs-single numerics
//! invariant, rollback, greedy speculative == greedy plain, malformed files.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use std::ops::ControlFlow;
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use common::{all_specs, generate_drafted, tiny, tiny_model};
use proptest::prelude::*;
use specdec_core::{
    generate, DraftLenPolicy, GenerateConfig, ModelDrafter, NoDraft, SamplingParams, Target,
};
use specdec_runtime::testing::TinySpec;
use specdec_runtime::{Arch, Error, LoadOptions, Model, Session};

fn tokens(n: usize, vocab: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + seed * 11 + 5) % vocab as u32)
        .collect()
}

/// Block sizes that cross the tile boundaries of multi-row kernels (1, 2, 4, 8, 16 rows and one past).
const BLOCK_SIZES: [usize; 9] = [1, 2, 3, 4, 5, 8, 9, 16, 17];

/// Scores `toks[3..]` as one block after a 3-token prefix, for every size in [`BLOCK_SIZES`], and
/// checks every row against the same positions fed one token at a time.
fn check_block_equals_single(model: &Arc<Model>, what: &str) {
    let vocab = model.config().vocab;
    let toks = tokens(3 + 17, vocab, 1);
    let mut single = Session::new(model.clone(), 64);
    let mut one_by_one = Vec::new();
    for &t in &toks {
        one_by_one.extend_from_slice(single.feed(&[t], 1).unwrap());
    }
    for m in BLOCK_SIZES {
        let mut block = Session::new(model.clone(), 64);
        block.feed(&toks[..3], 1).unwrap();
        let got = block.feed(&toks[3..3 + m], m).unwrap();
        let want = &one_by_one[3 * vocab..(3 + m) * vocab];
        assert_eq!(got.len(), want.len(), "{what}, m {m}");
        let differ = got
            .iter()
            .zip(want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ, 0,
            "{what}: {differ} logits of a block of {m} differ from single-token scoring"
        );
        assert!(got.iter().all(|v| v.is_finite()), "{what}, m {m}");
    }
}

/// The kernels really exercised, per file type: what the model runs after loading. Q5_1 files are
/// re-quantised to Q8_0 by default, so they are also checked as loaded as they are (Q5_0 has its own
/// kernel and is never re-quantised).
#[test]
fn block_logits_equal_single_token_logits_bit_for_bit() {
    use GgmlDType::*;
    for spec in all_specs() {
        let (_dir, path) = tiny(&spec);
        for requantize_q5 in [true, false] {
            if !requantize_q5 && !matches!(spec.dtype, Q5_0 | Q5_1) {
                continue;
            }
            let options = LoadOptions {
                requantize_q5,
                ..LoadOptions::default()
            };
            let model = Arc::new(Model::load(&path, &options).unwrap());
            let expected = match spec.dtype {
                Q5_1 if requantize_q5 => vec![Q8_0, spec.dtype],
                other => vec![other],
            };
            let mut loaded = model.matrix_types();
            loaded.sort_by_key(|t| format!("{t:?}"));
            let mut expected_sorted = expected.clone();
            expected_sorted.sort_by_key(|t| format!("{t:?}"));
            // The embedding table keeps the file's type; the other matrices are as listed.
            assert_eq!(loaded, expected_sorted, "{:?} {:?}", spec.arch, spec.dtype);
            let what = format!(
                "{:?} {:?} file, {:?} kernels",
                spec.arch, spec.dtype, expected[0]
            );
            check_block_equals_single(&model, &what);
        }
    }
}

/// `--draft-quant q4_k`: Q4_K where a matrix's rows are whole 256-value super-blocks (here the
/// feed-forward down matrix, 256 wide), Q4_0 elsewhere (the 64-wide ones); the model still scores
/// blocks exactly as single tokens.
#[test]
fn requantizing_to_a_k_quant_falls_back_where_rows_are_too_short() {
    use GgmlDType::*;
    let spec = TinySpec {
        n_ff: 256,
        ..TinySpec::new(Arch::Qwen2, Q8_0)
    };
    let (_dir, path) = tiny(&spec);
    let options = LoadOptions {
        requantize: Some(Q4K),
        ..LoadOptions::default()
    };
    let model = Arc::new(Model::load(&path, &options).unwrap());
    let mut loaded = model.matrix_types();
    loaded.sort_by_key(|t| format!("{t:?}"));
    assert_eq!(loaded, vec![Q4K, Q4_0]);
    assert_eq!(specdec_runtime::requantized_type(Q4K, 4864), Some(Q4K));
    assert_eq!(specdec_runtime::requantized_type(Q4K, 896), Some(Q4_0));
    assert_eq!(specdec_runtime::requantized_type(Q8_0, 896), Some(Q8_0));
    assert_eq!(specdec_runtime::requantized_type(Q4_0, 40), None);
    check_block_equals_single(&model, "Q8_0 file re-quantised to Q4_K");
}

/// A float model whose rows no 32-value block divides keeps those matrices' own type when a
/// re-quantisation is asked for (`--draft-quant`'s default is Q4_0), and re-quantises the others,
/// instead of failing to load.
#[test]
fn requantizing_keeps_the_files_type_where_no_block_divides_the_rows() {
    use GgmlDType::*;
    let spec = TinySpec {
        n_embd: 40,
        ..TinySpec::new(Arch::Llama, F32)
    };
    let (_dir, path) = tiny(&spec);
    let options = LoadOptions {
        requantize: Some(Q4_0),
        ..LoadOptions::default()
    };
    let model = Arc::new(Model::load(&path, &options).unwrap());
    let mut loaded = model.matrix_types();
    loaded.sort_by_key(|t| format!("{t:?}"));
    assert_eq!(loaded, vec![F32, Q4_0]);
    check_block_equals_single(
        &model,
        "F32 file 40 wide, its 128-wide rows re-quantised to Q4_0",
    );
}

#[test]
fn chunked_prefill_equals_one_pass() {
    let spec = TinySpec {
        ctx: 1024,
        ..TinySpec::new(Arch::Qwen2, GgmlDType::Q8_0)
    };
    let model = tiny_model(&spec);
    let toks = tokens(300, model.config().vocab, 2);
    // 300 tokens go in as chunks of 256 + 44.
    let mut a = Session::new(model.clone(), 1024);
    let la = a.feed(&toks, 3).unwrap().to_vec();
    let mut b = Session::new(model.clone(), 1024);
    b.feed(&toks[..150], 1).unwrap();
    let lb = b.feed(&toks[150..], 3).unwrap().to_vec();
    assert!(la.iter().zip(&lb).all(|(x, y)| x.to_bits() == y.to_bits()));
}

#[test]
fn append_truncate_append_equals_append() {
    for spec in [
        TinySpec::new(Arch::Llama, GgmlDType::Q4_1),
        TinySpec::new(Arch::Qwen2, GgmlDType::Q4K),
    ] {
        let model = tiny_model(&spec);
        let vocab = model.config().vocab;
        let a = tokens(6, vocab, 3);
        let b = tokens(5, vocab, 4);
        let c = tokens(5, vocab, 5);
        let mut s = Session::new(model.clone(), 64);
        s.feed(&a, 1).unwrap();
        let first = s.feed(&b, 5).unwrap().to_vec();
        s.rollback(a.len()).unwrap();
        s.feed(&c, 2).unwrap();
        s.rollback(a.len()).unwrap();
        let again = s.feed(&b, 5).unwrap().to_vec();
        assert!(first
            .iter()
            .zip(&again)
            .all(|(x, y)| x.to_bits() == y.to_bits()));
        assert_eq!(s.tokens().len(), a.len() + b.len());
        assert!(matches!(
            s.rollback(100),
            Err(Error::Rollback { len: 100, .. })
        ));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn truncate_never_grows_the_cache(ops in prop::collection::vec((any::<bool>(), 0usize..12), 1..20)) {
        let model = tiny_model(&TinySpec::new(Arch::Llama, GgmlDType::Q8_0));
        let mut s = Session::new(model, 48);
        let mut len = 0usize;
        for (feed, n) in ops {
            if feed {
                let r = s.feed(&tokens(n.max(1), 100, n as u32), 1);
                if len + n.max(1) > 48 {
                    let overflow = matches!(r, Err(Error::ContextOverflow { .. }));
                    prop_assert!(overflow);
                } else {
                    prop_assert!(r.is_ok());
                    len += n.max(1);
                }
            } else {
                let r = s.rollback(n);
                if n > len {
                    prop_assert!(r.is_err());
                } else {
                    prop_assert!(r.is_ok());
                    len = n;
                }
            }
            prop_assert_eq!(s.tokens().len(), len);
        }
    }
}

#[test]
fn greedy_speculative_equals_greedy_plain_on_tiny_models() {
    for arch in [Arch::Llama, Arch::Qwen2] {
        let target = tiny_model(&TinySpec::new(arch, GgmlDType::Q8_0));
        // The same weights in a coarser type: a draft that mostly agrees.
        let draft = tiny_model(&TinySpec::new(arch, GgmlDType::Q4_0));
        let prompt = tokens(7, 256, 6);
        let base = GenerateConfig {
            max_new_tokens: 40,
            sampling: SamplingParams::greedy(),
            ..GenerateConfig::default()
        };
        let mut t = Session::new(target.clone(), 256);
        let reference = generate(&mut t, &mut NoDraft, &prompt, &base, &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap();
        assert_eq!(reference.tokens.len(), 40);
        let mut accepted = 0;
        for k in 1..=8 {
            let out = generate_drafted((&target, &draft), &prompt, &base, k, 256);
            assert_eq!(out.tokens, reference.tokens, "{arch:?} k {k}");
            accepted += out.metrics.accepted;
        }
        assert!(
            accepted > 0,
            "{arch:?}: the draft never agreed; the test would not exercise acceptance"
        );
    }
}

#[test]
fn vocabulary_mismatch_and_context_overflow_are_errors() {
    let target = tiny_model(&TinySpec::new(Arch::Qwen2, GgmlDType::Q8_0));
    let draft = tiny_model(&TinySpec {
        vocab: 300,
        ..TinySpec::new(Arch::Qwen2, GgmlDType::Q8_0)
    });
    let config = GenerateConfig {
        sampling: SamplingParams::greedy(),
        ..GenerateConfig::default()
    };
    let mut t = Session::new(target.clone(), 64);
    let mut d = ModelDrafter::new(Session::new(draft, 64));
    let e = generate(&mut t, &mut d, &[1, 2, 3], &config, &mut |_| {
        ControlFlow::Continue(())
    })
    .unwrap_err();
    assert!(
        matches!(
            e.error,
            specdec_core::Error::VocabMismatch {
                draft: 300,
                target: 272
            }
        ),
        "{e}"
    );
    let mut t = Session::new(target, 16);
    assert_eq!(t.capacity(), 16);
    let e = generate(
        &mut t,
        &mut NoDraft,
        &tokens(20, 256, 1),
        &config,
        &mut |_| ControlFlow::Continue(()),
    )
    .unwrap_err();
    assert!(
        matches!(
            e.error,
            specdec_core::Error::ContextOverflow {
                len: 21,
                capacity: 16
            }
        ),
        "{e}"
    );
}

#[test]
fn a_session_clamps_its_capacity_to_the_trained_context() {
    let model = tiny_model(&TinySpec::new(Arch::Llama, GgmlDType::Q8_0));
    assert_eq!(Session::new(model, 1 << 20).capacity(), 512);
}

#[test]
fn q5_1_weights_are_requantised_to_q8_0_on_request_and_q5_0_never() {
    let (_dir, q5_0) = tiny(&TinySpec::new(Arch::Qwen2, GgmlDType::Q5_0));
    let a = Model::load(&q5_0, &LoadOptions::default()).unwrap();
    let b = Model::load(
        &q5_0,
        &LoadOptions {
            requantize_q5: false,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    assert_eq!(a.weight_bytes(), b.weight_bytes());
    assert_eq!(a.matrix_types(), vec![GgmlDType::Q5_0]);
    let (_dir, path) = tiny(&TinySpec::new(Arch::Qwen2, GgmlDType::Q5_1));
    let fast = Model::load(&path, &LoadOptions::default()).unwrap();
    let exact = Model::load(
        &path,
        &LoadOptions {
            requantize_q5: false,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    assert!(fast.weight_bytes() > exact.weight_bytes());
    // Both produce finite logits that mostly agree on the argmax.
    let toks = tokens(8, 256, 2);
    let mut a = Session::new(Arc::new(fast), 32);
    let mut b = Session::new(Arc::new(exact), 32);
    let la = a.feed(&toks, 1).unwrap().to_vec();
    let lb = b.feed(&toks, 1).unwrap().to_vec();
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|x, y| x.1.total_cmp(y.1))
            .unwrap()
            .0
    };
    assert_eq!(argmax(&la), argmax(&lb));
}

// --- Malformed files. ---

fn load_err(bytes: &[u8]) -> Error {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.gguf");
    std::fs::write(&p, bytes).unwrap();
    Model::load(&p, &LoadOptions::default()).unwrap_err()
}

#[test]
fn malformed_files_are_typed_errors() {
    let (_dir, path) = tiny(&TinySpec::new(Arch::Qwen2, GgmlDType::Q8_0));
    let good = std::fs::read(&path).unwrap();

    let e = load_err(&good[..good.len() / 2]);
    assert!(
        matches!(e, Error::Truncated { .. } | Error::Gguf { .. }),
        "{e}"
    );
    assert!(
        e.to_string().contains("bad.gguf"),
        "the error names the file: {e}"
    );

    let mut bad = good.clone();
    bad[..4].copy_from_slice(b"GGML");
    assert!(matches!(load_err(&bad), Error::Gguf { .. }));

    // Absurd tensor and metadata counts right after the magic and version: no huge allocation.
    let mut bad = good.clone();
    bad[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(load_err(&bad), Error::Gguf { .. }));
    let mut bad = good.clone();
    bad[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(load_err(&bad), Error::Gguf { .. }));

    assert!(matches!(load_err(b""), Error::Gguf { .. }));
    assert!(matches!(load_err(b"GGUF"), Error::Gguf { .. }));
}

#[test]
fn wrong_architecture_key_and_shape_are_typed_errors() {
    use candle_core::quantized::gguf_file::{self, Value};
    use candle_core::quantized::QTensor;
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, meta: Vec<(&str, Value)>, tensors: Vec<(&str, QTensor)>| {
        let p = dir.path().join(name);
        let mut f = std::fs::File::create(&p).unwrap();
        let m: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
        let t: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (*k, v)).collect();
        gguf_file::write(&mut f, &m, &t).unwrap();
        Model::load(&p, &LoadOptions::default()).unwrap_err()
    };
    let e = write(
        "arch.gguf",
        vec![("general.architecture", Value::String("mamba".into()))],
        vec![],
    );
    assert!(
        matches!(&e, Error::UnsupportedArch { arch, .. } if arch == "mamba"),
        "{e}"
    );
    let e = write(
        "key.gguf",
        vec![("general.architecture", Value::String("llama".into()))],
        vec![],
    );
    assert!(
        matches!(&e, Error::MissingKey { key, .. } if key == "llama.embedding_length"),
        "{e}"
    );

    // A model whose q projection has the wrong shape.
    let (_d, path) = tiny(&TinySpec::new(Arch::Llama, GgmlDType::F32));
    let g = specdec_runtime::Gguf::open(&path).unwrap();
    let mut meta: Vec<(&str, Value)> = g
        .content()
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    meta.sort_by(|a, b| a.0.cmp(b.0));
    let mut f = std::fs::File::open(&path).unwrap();
    let mut tensors: Vec<(&str, QTensor)> = Vec::new();
    for name in g.content().tensor_infos.keys() {
        let mut t = g
            .content()
            .tensor(&mut f, name, &candle_core::Device::Cpu)
            .unwrap();
        if name == "blk.0.attn_q.weight" {
            let x = candle_core::Tensor::zeros(
                (32, 64),
                candle_core::DType::F32,
                &candle_core::Device::Cpu,
            )
            .unwrap();
            t = QTensor::quantize(&x, GgmlDType::F32).unwrap();
        }
        tensors.push((name.as_str(), t));
    }
    let e = write("shape.gguf", meta, tensors);
    assert!(
        matches!(&e, Error::TensorShape { name, .. } if name == "blk.0.attn_q.weight"),
        "{e}"
    );
}

#[test]
fn a_model_target_reports_its_vocabulary_and_capacity() {
    let model = tiny_model(&TinySpec::new(Arch::Llama, GgmlDType::Q8_0));
    let s = Session::new(model, 100);
    assert_eq!(s.vocab_size(), 272);
    assert_eq!(Target::capacity(&s), 100);
}

/// Where the child run of [`every_kernel_level_gives_the_same_logits`] writes its logits.
const LOGITS_OUT: &str = "SPECDEC_TEST_LOGITS_OUT";

/// The fallback kernels, forced with `SPECDEC_KERNELS`, give the same logits bit for bit as the
/// detected ones, for every type with a kernel of our own and for both architectures (attention and
/// the f16 cache reads included). The kernel level is chosen once per process, so each level runs
/// in a child process of this test binary.
#[test]
fn every_kernel_level_gives_the_same_logits() {
    use specdec_kernels::{CpuLevel, Kernels};
    use GgmlDType::*;
    if let Ok(path) = std::env::var(LOGITS_OUT) {
        // The child: the level asked for must be the one running.
        let want = std::env::var(specdec_kernels::LEVEL_ENV).unwrap();
        assert_eq!(Kernels::get().level().name(), want);
        let mut bits: Vec<u8> = Vec::new();
        for arch in [Arch::Llama, Arch::Qwen2] {
            for dtype in [Q4K, Q6K, Q8_0, Q5_0, Q4_0] {
                let model = tiny_model(&TinySpec::new(arch, dtype));
                let vocab = model.config().vocab;
                let mut s = Session::new(model, 64);
                // 20 rows: a pass of 16 (the 512-bit level's passes) and one of 4.
                let first = s.feed(&tokens(20, vocab, 3), 20).unwrap().to_vec();
                let logits = s.feed(&tokens(6, vocab, 4), 6).unwrap();
                for v in first.iter().chain(logits.iter()) {
                    bits.extend(v.to_le_bytes());
                }
            }
        }
        std::fs::write(path, bits).unwrap();
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut outputs = Vec::new();
    for level in CpuLevel::supported() {
        let path = dir.path().join(level.name());
        let status = std::process::Command::new(&exe)
            .args(["every_kernel_level_gives_the_same_logits", "--exact"])
            .env(specdec_kernels::LEVEL_ENV, level.name())
            .env(LOGITS_OUT, &path)
            .status()
            .unwrap();
        assert!(status.success(), "the {} run failed", level.name());
        let bits = std::fs::read(&path).unwrap();
        assert!(!bits.is_empty());
        outputs.push((level, bits));
    }
    eprintln!(
        "compared kernel levels: {:?}",
        outputs.iter().map(|(l, _)| l.name()).collect::<Vec<_>>()
    );
    for (level, bits) in &outputs[1..] {
        assert!(
            *bits == outputs[0].1,
            "{} logits differ from {}",
            level.name(),
            outputs[0].0.name()
        );
    }
}

#[test]
fn a_restricted_logits_vocabulary_scores_only_its_tokens() {
    use specdec_runtime::weights::MASKED;
    let spec = TinySpec::new(Arch::Qwen2, GgmlDType::Q8_0);
    let (_dir, path) = tiny(&spec);
    let full = Arc::new(Model::load(&path, &LoadOptions::default()).unwrap());
    let vocab = full.config().vocab;
    for limit in [1, 100, vocab - 1, vocab] {
        let options = LoadOptions {
            logits_vocab: Some(limit),
            ..LoadOptions::default()
        };
        let part = Arc::new(Model::load(&path, &options).unwrap());
        assert_eq!(part.logits_vocab(), limit);
        let toks = tokens(9, vocab, 5);
        let a = Session::new(full.clone(), 64)
            .feed(&toks, 3)
            .unwrap()
            .to_vec();
        let b = Session::new(part, 64).feed(&toks, 3).unwrap().to_vec();
        for (ra, rb) in a.chunks_exact(vocab).zip(b.chunks_exact(vocab)) {
            assert!(ra[..limit]
                .iter()
                .zip(&rb[..limit])
                .all(|(x, y)| x.to_bits() == y.to_bits()));
            assert!(rb[limit..].iter().all(|&x| x == MASKED));
        }
    }
    for bad in [0, vocab + 1] {
        let options = LoadOptions {
            logits_vocab: Some(bad),
            ..LoadOptions::default()
        };
        let err = Model::load(&path, &options).unwrap_err();
        assert!(matches!(err, Error::LogitsVocab { .. }), "{err}");
    }
}

/// The tokens that end generation, listed last in a vocabulary, are scored beside a restricted one
/// (`LoadOptions::logits_also`), with the full model's bits; ids already in the prefix change
/// nothing, and an id past the vocabulary is an error.
#[test]
fn tokens_scored_beside_a_restricted_vocabulary_get_the_full_models_logits() {
    use specdec_runtime::weights::MASKED;
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q4K] {
        let spec = TinySpec::new(Arch::Qwen2, dtype);
        let (_dir, path) = tiny(&spec);
        let full = Arc::new(Model::load(&path, &LoadOptions::default()).unwrap());
        let vocab = full.config().vocab;
        let limit = 64;
        let also = [
            vocab as u32 - 1,
            3,
            vocab as u32 - 3,
            vocab as u32 - 2,
            70,
            70,
        ];
        let options = LoadOptions {
            logits_vocab: Some(limit),
            logits_also: also.to_vec(),
            ..LoadOptions::default()
        };
        let part = Arc::new(Model::load(&path, &options).unwrap());
        let want: Vec<usize> = vec![70, vocab - 3, vocab - 2, vocab - 1];
        let got: Vec<usize> = part.logits_also().iter().map(|&t| t as usize).collect();
        assert_eq!(got, want);
        let toks = tokens(11, vocab, 6);
        let a = Session::new(full.clone(), 64)
            .feed(&toks, 4)
            .unwrap()
            .to_vec();
        // A pass that asks for no logits (a drafter reading tokens it missed) computes none.
        assert!(Session::new(part.clone(), 64)
            .feed(&toks, 0)
            .unwrap()
            .is_empty());
        let b = Session::new(part, 64).feed(&toks, 4).unwrap().to_vec();
        for (ra, rb) in a.chunks_exact(vocab).zip(b.chunks_exact(vocab)) {
            for (t, (x, y)) in ra.iter().zip(rb).enumerate() {
                if t < limit || want.contains(&t) {
                    assert_eq!(x.to_bits(), y.to_bits(), "{dtype:?}: token {t}");
                } else {
                    assert_eq!(*y, MASKED, "{dtype:?}: token {t}");
                }
            }
        }
        let options = LoadOptions {
            logits_vocab: Some(limit),
            logits_also: vec![vocab as u32],
            ..LoadOptions::default()
        };
        let err = Model::load(&path, &options).unwrap_err();
        assert!(matches!(err, Error::LogitsAlso { .. }), "{err}");
    }
}

#[path = "../../specdec-core/tests/common/mod.rs"]
mod stats;

/// A draft restricted to part of the vocabulary proposes from a distribution with zero mass on the
/// other tokens; rejection sampling must still give exactly the target's distribution (the residual
/// puts the mass back). Pearson chi-square of the first three sampled tokens (top-k 3 at temperature
/// 1, so at most 27 cells; the second and third are drafted in one round of two) against the target's
/// exact joint distribution, with the draft being the target itself restricted so that some of the
/// candidates at the drafted positions can never be drafted. Passes at p ≥ 1e-6: a false-failure
/// rate of 1e-6 (the seeds are fixed, so a run is reproducible).
#[test]
fn rejection_sampling_with_a_restricted_draft_vocabulary_keeps_the_target_distribution() {
    use specdec_core::{Probs, Sampler, VerifyMode};
    let spec = TinySpec::new(Arch::Qwen2, GgmlDType::Q8_0);
    let (_dir, path) = tiny(&spec);
    let target = Arc::new(Model::load(&path, &LoadOptions::default()).unwrap());
    let vocab = target.config().vocab;
    let prompt = tokens(6, vocab, 9);
    let sampling = SamplingParams {
        temperature: 1.0,
        top_k: 3,
        ..SamplingParams::default()
    };
    // The target's distribution of the next token after `ctx`, formed as the decoder forms it.
    let dist = |ctx: &[u32]| -> Vec<(u32, f64)> {
        let mut s = Session::new(target.clone(), 64);
        let logits = s.feed(ctx, 1).unwrap().to_vec();
        let mut sampler = Sampler::new(sampling.clone());
        let mut p = Probs::OneHot(0);
        sampler.probs(&logits, ctx, &mut p).unwrap();
        (0..vocab as u32)
            .map(|t| (t, f64::from(p.prob(t))))
            .filter(|&(_, q)| q > 0.0)
            .collect()
    };
    let mut cells: Vec<([u32; 3], f64)> = Vec::new();
    for (t0, p0) in dist(&prompt) {
        let c1 = [prompt.clone(), vec![t0]].concat();
        for (t1, p1) in dist(&c1) {
            let c2 = [c1.clone(), vec![t1]].concat();
            for (t2, p2) in dist(&c2) {
                cells.push(([t0, t1, t2], p0 * p1 * p2));
            }
        }
    }
    // The draft scores the tokens below the median candidate id of the drafted positions.
    let mut drafted_ids: Vec<u32> = cells.iter().flat_map(|(t, _)| [t[1], t[2]]).collect();
    drafted_ids.sort_unstable();
    let limit = drafted_ids[drafted_ids.len() / 2] as usize;
    assert!(
        drafted_ids[0] < limit as u32 && drafted_ids[drafted_ids.len() - 1] >= limit as u32,
        "some candidates must be draftable and some not"
    );
    let options = LoadOptions {
        logits_vocab: Some(limit),
        ..LoadOptions::default()
    };
    let draft = Arc::new(Model::load(&path, &options).unwrap());
    let n = 12_000;
    let mut counts = vec![0u64; cells.len()];
    let (mut drafted, mut accepted) = (0, 0);
    for seed in 0..n {
        let config = GenerateConfig {
            max_new_tokens: 4,
            sampling: sampling.clone(),
            seed,
            verify_mode: VerifyMode::Rejection,
            draft_len: DraftLenPolicy::Fixed { draft_len: 2 },
            ..GenerateConfig::default()
        };
        let mut t = Session::new(target.clone(), 64);
        let mut d = ModelDrafter::new(Session::new(draft.clone(), 64));
        let out = generate(&mut t, &mut d, &prompt, &config, &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap();
        drafted += out.metrics.drafted;
        accepted += out.metrics.accepted;
        let first = [out.tokens[0], out.tokens[1], out.tokens[2]];
        let i = cells
            .iter()
            .position(|(t, _)| *t == first)
            .unwrap_or_else(|| panic!("{first:?} has probability 0 under the target"));
        counts[i] += 1;
    }
    let expected: Vec<f64> = cells.iter().map(|c| c.1).collect();
    let (stat, df, p) = stats::chi_square(&counts, &expected);
    eprintln!(
        "restricted draft (first {limit} of {vocab} tokens): chi-square {stat:.2} on {df} df, \
         p = {p:.3}; {accepted} of {drafted} drafted tokens accepted"
    );
    assert!(
        accepted > 0 && accepted < drafted,
        "both verdicts must occur"
    );
    assert!(p >= 1e-6, "chi-square {stat} on {df} df, p = {p}");
}

#[test]
fn a_gpu_without_cuda_is_a_clear_error() {
    let (_dir, path) = tiny(&TinySpec::new(Arch::Qwen2, GgmlDType::Q8_0));
    let options = LoadOptions {
        device: specdec_runtime::Device::Cuda(0),
        ..LoadOptions::default()
    };
    let r = Model::load(&path, &options);
    #[cfg(not(feature = "cuda"))]
    {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::NoCuda), "{e}");
        assert!(e.to_string().contains("--features cuda"), "{e}");
    }
    // With the feature: a model on the GPU where there is one, else a CUDA error saying why.
    #[cfg(feature = "cuda")]
    if let Err(e) = r {
        assert!(matches!(e, Error::Cuda(_)), "{e}");
    }
}

#[test]
fn a_token_past_the_vocabulary_is_refused_and_the_cache_keeps_its_length() {
    let model = tiny_model(&TinySpec::new(Arch::Qwen2, GgmlDType::Q8_0));
    let vocab = model.config().vocab as u32;
    let mut cache = model.cache(16);
    model
        .forward(&mut cache, &[1, 2], 1, &mut Vec::new())
        .unwrap();
    let e = model
        .forward(&mut cache, &[3, vocab], 1, &mut Vec::new())
        .unwrap_err();
    assert!(
        matches!(e, Error::TokenOutOfRange { token, .. } if token == vocab),
        "{e}"
    );
    assert_eq!(cache.len(), 2);
}
