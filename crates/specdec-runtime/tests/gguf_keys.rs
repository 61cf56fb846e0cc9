//! GGUF keys and tensors that change the forward pass: the implemented ones (Llama 3 `rope_freqs`,
//! linear rope scaling, a head size other than `n_embd / n_head`) change the logits exactly as they
//! should and keep the block-vs-single invariant; every other one is a typed error naming it, never
//! silently ignored.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::GgmlDType;
use common::{tiny, tiny_model};
use specdec_runtime::config::RopeScaling;
use specdec_runtime::testing::{llama3_rope_freqs, TinySpec};
use specdec_runtime::{Arch, Error, LoadOptions, Model, Session};

fn tokens(n: usize, vocab: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + seed * 11 + 5) % vocab as u32)
        .collect()
}

fn arch_name(arch: Arch) -> &'static str {
    match arch {
        Arch::Llama => "llama",
        Arch::Qwen2 => "qwen2",
    }
}

fn load_err(spec: &TinySpec) -> Error {
    let (_dir, path) = tiny(spec);
    Model::load(&path, &LoadOptions::default()).unwrap_err()
}

/// Logits of every position of a fixed sequence long enough for the slow rope pairs to turn.
fn logits(spec: &TinySpec) -> Vec<f32> {
    let model = tiny_model(spec);
    let toks = tokens(160, 256, 1);
    Session::new(model, 256)
        .feed(&toks, toks.len())
        .unwrap()
        .to_vec()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Factors from 1 to 8 over the pairs of a head of `rope_dim`, like Llama 3.1's at a small context.
fn factors(rope_dim: usize) -> Vec<f32> {
    llama3_rope_freqs(10_000.0, rope_dim, 8.0, (1.0, 4.0), 64)
}

fn scaled_specs() -> Vec<TinySpec> {
    let mut out = Vec::new();
    for arch in [Arch::Llama, Arch::Qwen2] {
        for dtype in [GgmlDType::F32, GgmlDType::Q8_0, GgmlDType::Q4K] {
            let base = TinySpec::new(arch, dtype);
            // Twice the default, so the k-quants still see rows of whole 256-value blocks.
            let head_dim = base.n_embd / base.n_head * 2;
            // Per-dimension factors are a Llama 3.1+ tensor; llama.cpp refuses them elsewhere.
            let llama = arch == Arch::Llama;
            if llama {
                out.push(TinySpec {
                    rope_freqs: Some(factors(base.n_embd / base.n_head)),
                    ..base.clone()
                });
            }
            out.push(TinySpec {
                rope_scaling: Some(("linear".into(), 4.0)),
                ..base.clone()
            });
            out.push(TinySpec {
                head_dim: Some(head_dim),
                rope_freqs: llama.then(|| factors(head_dim)),
                rope_scaling: Some(("linear".into(), 2.0)),
                ..base
            });
        }
    }
    out
}

#[test]
fn the_llama3_factors_are_those_of_the_converter() {
    // Llama 3.1 8B: base 500000, head 128, factor 8, low 1, high 4, original context 8192. The
    // fastest pairs keep their frequency, the slowest are divided by 8, and the blend is monotone.
    let f = llama3_rope_freqs(500_000.0, 128, 8.0, (1.0, 4.0), 8192);
    assert_eq!(f.len(), 64);
    assert_eq!(f[0], 1.0);
    assert_eq!(f[63], 8.0);
    assert!(f.windows(2).all(|w| w[0] <= w[1]), "{f:?}");
    assert!(f.iter().any(|x| *x > 1.0 && *x < 8.0), "{f:?}");
    assert!(factors(16).iter().any(|x| *x != 1.0));
}

#[test]
fn rope_freqs_of_one_change_nothing_and_other_factors_change_the_logits() {
    {
        let arch = Arch::Llama;
        let base = TinySpec::new(arch, GgmlDType::F32);
        let hd = base.n_embd / base.n_head;
        let plain = logits(&base);
        let ones = logits(&TinySpec {
            rope_freqs: Some(vec![1.0; hd / 2]),
            ..base.clone()
        });
        assert_eq!(bits(&plain), bits(&ones), "{arch:?}: factors of 1");
        let scaled = logits(&TinySpec {
            rope_freqs: Some(factors(hd)),
            ..base.clone()
        });
        assert_ne!(bits(&plain), bits(&scaled), "{arch:?}: factors ignored");
        // The first position has angle 0 whatever the factors.
        let vocab = base.vocab;
        assert_eq!(bits(&plain[..vocab]), bits(&scaled[..vocab]));
    }
}

#[test]
fn linear_scaling_of_one_equals_none_and_other_factors_change_the_logits() {
    for arch in [Arch::Llama, Arch::Qwen2] {
        let base = TinySpec::new(arch, GgmlDType::F32);
        let plain = logits(&base);
        let with = |kind: &str, factor: f32| {
            logits(&TinySpec {
                rope_scaling: Some((kind.into(), factor)),
                ..base.clone()
            })
        };
        assert_eq!(bits(&plain), bits(&with("linear", 1.0)), "{arch:?}");
        assert_eq!(
            bits(&plain),
            bits(&with("none", 4.0)),
            "{arch:?}: none ignores the factor"
        );
        let linear = with("linear", 4.0);
        assert_ne!(bits(&plain), bits(&linear), "{arch:?}: factor ignored");
        // The older key alone means linear scaling too (llama.cpp's default type).
        let old = logits(&TinySpec {
            extra_keys: vec![(
                format!("{}.rope.scale_linear", arch_name(arch)),
                Value::F32(4.0),
            )],
            ..base.clone()
        });
        assert_eq!(bits(&linear), bits(&old), "{arch:?}: rope.scale_linear");
    }
}

#[test]
fn the_configuration_reports_the_scaling() {
    let (_dir, path) = tiny(&TinySpec {
        rope_scaling: Some(("linear".into(), 2.5)),
        head_dim: Some(8),
        ..TinySpec::new(Arch::Llama, GgmlDType::Q8_0)
    });
    let m = Model::load(&path, &LoadOptions::default()).unwrap();
    assert_eq!(m.config().rope_scaling, RopeScaling::Linear { factor: 2.5 });
    assert_eq!(m.config().head_dim, 8);
    assert_eq!(m.config().q_dim(), 32);
}

#[test]
fn a_head_size_other_than_embedding_over_heads_runs() {
    for arch in [Arch::Llama, Arch::Qwen2] {
        let base = TinySpec::new(arch, GgmlDType::F32);
        for hd in [8, 32] {
            let got = logits(&TinySpec {
                head_dim: Some(hd),
                ..base.clone()
            });
            assert!(got.iter().all(|v| v.is_finite()), "{arch:?} {hd}");
        }
    }
}

#[test]
fn scaled_models_keep_block_logits_equal_to_single_token_logits() {
    for spec in scaled_specs() {
        let model = tiny_model(&spec);
        let vocab = model.config().vocab;
        let toks = tokens(12, vocab, 1);
        let mut single = Session::new(model.clone(), 64);
        let mut one_by_one = Vec::new();
        for &t in &toks {
            one_by_one.extend_from_slice(single.feed(&[t], 1).unwrap());
        }
        let mut block = Session::new(model.clone(), 64);
        let mut got = block.feed(&toks[..4], 4).unwrap().to_vec();
        got.extend_from_slice(block.feed(&toks[4..], 8).unwrap());
        assert_eq!(
            bits(&got),
            bits(&one_by_one),
            "{:?} {:?} head {:?} scaling {:?}",
            spec.arch,
            spec.dtype,
            spec.head_dim,
            spec.rope_scaling
        );
    }
}

// --- Rejected keys and tensors. ---

fn with_key(arch: Arch, key: &str, value: Value) -> TinySpec {
    TinySpec {
        extra_keys: vec![(format!("{}.{key}", arch_name(arch)), value)],
        ..TinySpec::new(arch, GgmlDType::Q8_0)
    }
}

fn assert_unsupported_key(e: &Error, want: &str, value: &str) {
    match e {
        Error::UnsupportedKey { key, value: v, .. } => {
            assert_eq!(key, want);
            assert_eq!(v, value);
            let msg = e.to_string();
            assert!(msg.contains(want) && msg.contains("tiny.gguf"), "{msg}");
        }
        _ => panic!("expected UnsupportedKey {want}, got {e}"),
    }
}

/// Malformed headers are typed errors, never crashes: an alignment of 0 (candle's parser divides
/// by it), a layer count the tensors do not hold (it sizes loops and allocations before any
/// tensor is read).
#[test]
fn malformed_headers_are_errors_not_crashes() {
    let spec = || TinySpec::new(Arch::Llama, GgmlDType::Q8_0);
    let e = load_err(&TinySpec {
        extra_keys: vec![("general.alignment".into(), Value::U32(0))],
        ..spec()
    });
    assert!(matches!(e, Error::Gguf { .. }), "{e}");
    assert!(e.to_string().contains("tiny.gguf"), "{e}");
    let layers = spec().n_layer as u32;
    for n in [layers + 1, 1 << 20, u32::MAX] {
        let e = load_err(&with_key(Arch::Llama, "block_count", Value::U32(n)));
        match &e {
            Error::BadKey { key, .. } => assert_eq!(key, "llama.block_count"),
            _ => panic!("block_count {n}: expected BadKey, got {e}"),
        }
    }
}

/// Sizes that would let a model load whose first pass panics or whose tables exhaust memory are bad
/// keys naming the key: zero sizes (a zero-width matrix holds no bytes, so the tensors' fit in the
/// file bounds nothing), a rope of no dimension, a head size no model has, a query width that
/// wraps, and rope bases or epsilons that are not finite.
#[test]
fn sizes_that_bound_nothing_are_bad_keys() {
    let arch = Arch::Llama;
    let cases: Vec<(Vec<(&str, Value)>, &str)> = vec![
        (
            vec![("rope.dimension_count", Value::U32(0))],
            "rope.dimension_count",
        ),
        (
            vec![("attention.key_length", Value::U64(1 << 40))],
            "attention.key_length",
        ),
        (
            vec![
                ("block_count", Value::U32(0)),
                ("attention.key_length", Value::U64(1 << 40)),
            ],
            "attention.key_length",
        ),
        (
            vec![
                ("attention.head_count", Value::U64(1 << 60)),
                ("attention.key_length", Value::U32(64)),
            ],
            "attention.head_count",
        ),
        (
            vec![
                ("embedding_length", Value::U32(0)),
                ("attention.key_length", Value::U32(16)),
            ],
            "embedding_length",
        ),
        (
            vec![("feed_forward_length", Value::U32(0))],
            "feed_forward_length",
        ),
        (vec![("context_length", Value::U32(0))], "context_length"),
        (vec![("block_count", Value::U32(0))], "block_count"),
        (
            vec![("rope.freq_base", Value::F32(f32::NAN))],
            "rope.freq_base",
        ),
        (vec![("rope.freq_base", Value::F32(0.0))], "rope.freq_base"),
        (
            vec![(
                "attention.layer_norm_rms_epsilon",
                Value::F32(f32::INFINITY),
            )],
            "attention.layer_norm_rms_epsilon",
        ),
        (
            vec![("attention.layer_norm_rms_epsilon", Value::F32(-1.0))],
            "attention.layer_norm_rms_epsilon",
        ),
    ];
    for (keys, want) in cases {
        let e = load_err(&TinySpec {
            extra_keys: keys
                .iter()
                .map(|(k, v)| (format!("{}.{k}", arch_name(arch)), v.clone()))
                .collect(),
            ..TinySpec::new(arch, GgmlDType::Q8_0)
        });
        match &e {
            Error::BadKey { key, .. } => assert_eq!(key, &format!("llama.{want}"), "{keys:?}"),
            _ => panic!("{keys:?}: expected BadKey {want}, got {e}"),
        }
    }
}

/// A model's pass refuses a cache of a model of another shape, with a typed error.
#[test]
fn a_cache_of_another_model_is_refused() {
    let model = tiny_model(&TinySpec::new(Arch::Llama, GgmlDType::Q8_0));
    let other = tiny_model(&TinySpec {
        n_layer: TinySpec::new(Arch::Llama, GgmlDType::Q8_0).n_layer + 1,
        ..TinySpec::new(Arch::Llama, GgmlDType::Q8_0)
    });
    let mut cache = other.cache(16);
    let mut logits = Vec::new();
    let e = model
        .forward(&mut cache, &[1, 2], 1, &mut logits)
        .unwrap_err();
    assert!(matches!(e, Error::CacheShape), "{e}");
    assert!(cache.is_empty());
    let mut own = model.cache(16);
    model.forward(&mut own, &[1, 2], 1, &mut logits).unwrap();
    assert_eq!(own.len(), 2);
}

/// A special token id that does not fit a token id is a bad key, not a truncated id.
#[test]
fn a_token_id_past_2_32_is_a_bad_key() {
    let (_dir, path) = tiny(&TinySpec {
        extra_keys: vec![(
            "tokenizer.ggml.bos_token_id".into(),
            Value::U64((1 << 32) | 256),
        )],
        ..TinySpec::new(Arch::Qwen2, GgmlDType::Q8_0)
    });
    let e = specdec_runtime::Tokenizer::from_gguf(&specdec_runtime::Gguf::open(&path).unwrap())
        .unwrap_err();
    match &e {
        Error::BadKey { key, .. } => assert_eq!(key, "tokenizer.ggml.bos_token_id"),
        _ => panic!("expected BadKey, got {e}"),
    }
}

/// A tokenizer with more tokens than the embedding table has rows is refused at load, naming the
/// key, not when a prompt first holds a token past the table; a table with more rows than tokens
/// loads.
#[test]
fn more_tokens_than_embedding_rows_is_a_bad_key() {
    for arch in [Arch::Qwen2, Arch::Llama] {
        let spec = TinySpec::new(arch, GgmlDType::Q8_0);
        let words = |n: usize| {
            Value::Array(
                (0..n)
                    .map(|i| Value::String(format!("<|token_{i}|>")))
                    .collect(),
            )
        };
        let e = load_err(&TinySpec {
            extra_keys: vec![("tokenizer.ggml.tokens".into(), words(spec.vocab + 1))],
            ..spec.clone()
        });
        match &e {
            Error::BadKey { key, .. } => assert_eq!(key, "tokenizer.ggml.tokens", "{arch:?}"),
            _ => panic!("{arch:?}: expected BadKey, got {e}"),
        }
        assert!(e.to_string().contains("token_embd.weight"), "{e}");
        let (_dir, path) = tiny(&TinySpec {
            extra_keys: vec![("tokenizer.ggml.tokens".into(), words(spec.vocab - 7))],
            ..spec
        });
        Model::load(&path, &LoadOptions::default()).unwrap();
    }
}

#[test]
fn unimplemented_rope_scaling_types_are_rejected_by_name() {
    for arch in [Arch::Llama, Arch::Qwen2] {
        for kind in ["yarn", "longrope", "su", "llama3"] {
            let e = load_err(&TinySpec {
                rope_scaling: Some((kind.into(), 4.0)),
                ..TinySpec::new(arch, GgmlDType::Q8_0)
            });
            let key = format!("{}.rope.scaling.type", arch_name(arch));
            assert_unsupported_key(&e, &key, &format!("{kind:?}"));
        }
    }
}

#[test]
fn keys_that_change_the_forward_are_rejected_by_name() {
    let cases: Vec<(&str, Value, &str)> = vec![
        ("attention.sliding_window", Value::U32(128), "128"),
        ("attention.value_length", Value::U32(32), "32"),
        ("expert_count", Value::U32(8), "8"),
        ("expert_used_count", Value::U32(2), "2"),
        ("attention.scale", Value::F32(0.5), "0.5"),
        ("embedding_scale", Value::F32(12.0), "12"),
        ("residual_scale", Value::F32(1.4), "1.4"),
        ("logit_scale", Value::F32(0.25), "0.25"),
        ("attn_logit_softcapping", Value::F32(50.0), "50"),
        ("final_logit_softcapping", Value::F32(30.0), "30"),
        ("rope.scaling.attn_factor", Value::F32(1.2), "1.2"),
        ("rope.scaling.yarn_log_multiplier", Value::F32(0.1), "0.1"),
        ("attention.causal", Value::Bool(false), "false"),
        ("attention.layer_norm_epsilon", Value::F32(1e-5), "0.00001"),
        ("some_future_key", Value::String("x".into()), "\"x\""),
    ];
    for arch in [Arch::Llama, Arch::Qwen2] {
        for (key, value, shown) in &cases {
            let e = load_err(&with_key(arch, key, value.clone()));
            assert_unsupported_key(&e, &format!("{}.{key}", arch_name(arch)), shown);
        }
    }
}

#[test]
fn keys_at_their_neutral_value_are_accepted() {
    let cases: Vec<(&str, Value)> = vec![
        ("expert_count", Value::U32(0)),
        ("expert_used_count", Value::U32(0)),
        ("rope.scaling.attn_factor", Value::F32(1.0)),
        ("attention.causal", Value::Bool(true)),
        ("vocab_size", Value::U32(272)),
        ("rope.scaling.original_context_length", Value::U32(256)),
        ("rope.scaling.finetuned", Value::Bool(true)),
        ("attention.value_length", Value::U32(16)),
        ("attention.key_length", Value::U32(16)),
        ("rope.dimension_count", Value::U32(16)),
        ("attention.sliding_window", Value::U32(0)),
        // llama.cpp reads a factor of 0 as "not set".
        ("rope.scaling.factor", Value::F32(0.0)),
    ];
    for arch in [Arch::Llama, Arch::Qwen2] {
        let plain = logits(&TinySpec::new(arch, GgmlDType::Q8_0));
        for (key, value) in &cases {
            let got = logits(&with_key(arch, key, value.clone()));
            assert_eq!(bits(&plain), bits(&got), "{arch:?} {key}");
        }
    }
}

#[test]
fn bad_scaling_factors_are_bad_keys() {
    for (key, factor) in [
        ("rope.scaling.factor", -2.0),
        ("rope.scaling.factor", f32::NAN),
        ("rope.scale_linear", f32::INFINITY),
    ] {
        let e = load_err(&with_key(Arch::Llama, key, Value::F32(factor)));
        assert!(
            matches!(&e, Error::BadKey { key: k, .. } if k == &format!("llama.{key}")),
            "{key} {factor}: {e}"
        );
    }
    let e = load_err(&with_key(Arch::Llama, "rope.scaling.type", Value::U32(1)));
    assert!(matches!(e, Error::BadKey { .. }), "{e}");
}

#[test]
fn rope_freqs_of_the_wrong_length_or_range_are_typed_errors() {
    let base = TinySpec::new(Arch::Llama, GgmlDType::Q8_0);
    let hd = base.n_embd / base.n_head;
    let e = load_err(&TinySpec {
        rope_freqs: Some(vec![1.0; hd]),
        ..base.clone()
    });
    assert!(
        matches!(&e, Error::TensorShape { name, got, expected, .. }
            if name == "rope_freqs.weight" && got == &[hd] && expected == &[hd / 2]),
        "{e}"
    );
    let mut zero = vec![1.0; hd / 2];
    zero[3] = 0.0;
    let e = load_err(&TinySpec {
        rope_freqs: Some(zero),
        ..base
    });
    assert!(
        matches!(&e, Error::BadTensor { name, .. } if name == "rope_freqs.weight"),
        "{e}"
    );
    // Qwen2 has no per-dimension factors in llama.cpp either.
    let e = load_err(&TinySpec {
        rope_freqs: Some(vec![1.0; hd / 2]),
        ..TinySpec::new(Arch::Qwen2, GgmlDType::Q8_0)
    });
    assert!(
        matches!(&e, Error::UnsupportedTensor { name, .. } if name == "rope_freqs.weight"),
        "{e}"
    );
}

#[test]
fn tensors_the_forward_does_not_read_are_rejected_by_name() {
    for arch in [Arch::Llama, Arch::Qwen2] {
        let base = TinySpec::new(arch, GgmlDType::Q8_0);
        let hd = base.n_embd / base.n_head;
        let mut cases = vec![
            ("blk.0.attn_q_norm.weight", hd),
            ("blk.1.attn_k_norm.weight", hd),
            ("blk.0.attn_output.bias", base.n_embd),
            ("blk.2.attn_norm.weight", base.n_embd), // a layer past block_count
            ("rope_factors_long.weight", hd / 2),
        ];
        if arch == Arch::Llama {
            cases.push(("blk.0.attn_q.bias", base.n_embd));
        }
        for (name, len) in cases {
            let e = load_err(&TinySpec {
                extra_tensors: vec![(name.into(), vec![0.5; len])],
                ..base.clone()
            });
            assert!(
                matches!(&e, Error::UnsupportedTensor { name: n, .. } if n == name),
                "{arch:?} {name}: {e}"
            );
            assert!(e.to_string().contains(name));
        }
    }
}
