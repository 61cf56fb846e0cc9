//! The forward pass on an NVIDIA GPU (`--features cuda`), on tiny random-weight models of every
//! architecture and quantisation type: block scoring equals single steps bit for bit, a rollback
//! rescored gives the same bits, batched sequences get the logits of passes of their own, greedy
//! speculative output equals greedy plain output, and the logits agree with the CPU's within the
//! rounding of f16 weights. On a machine with no CUDA device every test is reported as ignored,
//! with the reason, or fails when `SPECDEC_REQUIRE_GPU=1`.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use std::ops::ControlFlow;
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use common::{all_specs, decode_together, generate_drafted, score_alone, tiny};
use libtest_mimic::{Completion, Failed, Trial};
use specdec_core::{
    generate, Batch, GenerateConfig, Logits, NoDraft, SamplingParams, Score, SeqId, Target,
};
use specdec_runtime::testing::{run_trials, TinySpec};
use specdec_runtime::{Arch, Device, Error, LoadOptions, Model, Session, Sessions};

/// Makes a missing GPU a failure rather than a skip (set it where a GPU must be present).
const REQUIRE_GPU: &str = "SPECDEC_REQUIRE_GPU";

fn load(spec: &TinySpec, options: &LoadOptions) -> Arc<Model> {
    let (_dir, path) = tiny(spec);
    Arc::new(Model::load(&path, options).unwrap())
}

fn on_gpu() -> LoadOptions {
    LoadOptions {
        device: Device::Cuda(0),
        ..LoadOptions::default()
    }
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + seed * 11 + 5) % 256)
        .collect()
}

/// The logits of every position of `tokens` scored in blocks of `block` tokens.
fn logits_in_blocks(model: &Arc<Model>, tokens: &[u32], block: usize) -> Vec<f32> {
    let mut cache = model.cache(tokens.len().max(128));
    let mut all = Vec::new();
    let mut out = Vec::new();
    for chunk in tokens.chunks(block) {
        model
            .forward(&mut cache, chunk, chunk.len(), &mut out)
            .unwrap();
        all.extend_from_slice(&out);
    }
    all
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The largest difference between the GPU's logits and the CPU's, and the largest CPU logit (at
/// least 1) it is measured against.
fn gap(gpu: &[f32], cpu: &[f32]) -> (f32, f32) {
    let scale = cpu.iter().fold(1.0f32, |m, x| m.max(x.abs()));
    let worst = gpu
        .iter()
        .zip(cpu)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    (worst, scale)
}

fn blocks_equal_single_steps() {
    for spec in all_specs() {
        let model = load(&spec, &on_gpu());
        let t = tokens(19, 1);
        let single = logits_in_blocks(&model, &t, 1);
        for block in [2, 5, 9, 19] {
            let blocked = logits_in_blocks(&model, &t, block);
            assert!(
                same_bits(&single, &blocked),
                "{:?} {:?}: blocks of {block} differ from single steps",
                spec.arch,
                spec.dtype
            );
        }
    }
}

/// Past 256 positions the attention is split into chunks of keys: blocks across a chunk's edge
/// give the bits of single steps too.
fn chunk_edges_do_not_change_the_bits() {
    let model = load(&TinySpec::new(Arch::Llama, GgmlDType::Q4_0), &on_gpu());
    let t: Vec<u32> = (0..300).map(|i| (i * 7 + 3) % 256).collect();
    let single = logits_in_blocks(&model, &t, 1);
    for block in [7, 300] {
        assert!(
            same_bits(&single, &logits_in_blocks(&model, &t, block)),
            "blocks of {block}"
        );
    }
}

fn rollback_rescores_the_same() {
    let model = load(&TinySpec::new(Arch::Qwen2, GgmlDType::Q4K), &on_gpu());
    let t = tokens(12, 2);
    let mut cache = model.cache(64);
    let mut first = Vec::new();
    model.forward(&mut cache, &t, 12, &mut first).unwrap();
    cache.truncate(5).unwrap();
    // Other tokens at the truncated positions, then the first ones again.
    let mut other = Vec::new();
    model
        .forward(&mut cache, &tokens(7, 9), 7, &mut other)
        .unwrap();
    cache.truncate(5).unwrap();
    let mut again = Vec::new();
    model.forward(&mut cache, &t[5..], 7, &mut again).unwrap();
    let vocab = model.config().vocab;
    assert!(same_bits(&first[5 * vocab..], &again));
    assert!(!same_bits(&other, &again), "other tokens, other logits");
}

fn batched_parts_equal_passes_of_their_own() {
    let model = load(&TinySpec::new(Arch::Llama, GgmlDType::Q6K), &on_gpu());
    let mut batched = Sessions::new(model.clone(), 128, 3);
    let contexts: Vec<Vec<u32>> = (0..3).map(|s| tokens(4 + 6 * s, s as u32)).collect();
    let drafts: Vec<Vec<u32>> = (0..3).map(|s| tokens(1 + s * 3, 7 + s as u32)).collect();
    let reqs: Vec<Score<'_>> = (0..3)
        .map(|s| Score {
            seq: SeqId(s as u64),
            context: &contexts[s],
            draft: &drafts[s],
        })
        .collect();
    let mut out = vec![Logits::new(0); 3];
    batched.score(&reqs, &mut out).unwrap();
    for (s, req) in reqs.iter().enumerate() {
        let want = score_alone(&model, req);
        for r in 0..out[s].rows() {
            assert!(same_bits(out[s].row(r), want.row(r)), "seq {s} row {r}");
        }
    }
}

/// Two sequences with a shared beginning in one batch: one computes it, the other copies its
/// keys and values on the device (`Sessions`' prefix reuse); both decode as alone.
fn a_copied_prefix_decodes_as_alone() {
    let model = load(&TinySpec::new(Arch::Qwen2, GgmlDType::Q8_0), &on_gpu());
    let config = GenerateConfig {
        max_new_tokens: 6,
        sampling: SamplingParams::greedy(),
        ..GenerateConfig::default()
    };
    let prompt = |tail: u32| [tokens(40, 3), tokens(6, tail)].concat();
    let alone = |p: &[u32]| {
        let mut t = Session::new(model.clone(), 128);
        generate(&mut t, &mut NoDraft, p, &config, &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap()
        .tokens
    };
    let mut batch = Batch::new(Sessions::new(model.clone(), 128, 2), NoDraft);
    batch.set_prefill_chunk(Some(8));
    let (p1, p2) = (prompt(8), prompt(9));
    let got = decode_together(&mut batch, &[(SeqId(1), &p1), (SeqId(2), &p2)], &config);
    assert_eq!(got[&SeqId(1)], alone(&p1));
    assert_eq!(got[&SeqId(2)], alone(&p2));
    assert_eq!(batch.target().reused_tokens(), 40, "the prefix was copied");
}

fn speculative_greedy_equals_plain() {
    let target = load(&TinySpec::new(Arch::Qwen2, GgmlDType::Q8_0), &on_gpu());
    let draft_spec = TinySpec {
        seed: 2,
        ..TinySpec::new(Arch::Qwen2, GgmlDType::Q4_0)
    };
    // A draft restricted to part of the vocabulary, with one id past it: the GPU's listed rows.
    let restricted = LoadOptions {
        logits_vocab: Some(200),
        logits_also: vec![250],
        ..on_gpu()
    };
    for draft in [load(&draft_spec, &on_gpu()), load(&draft_spec, &restricted)] {
        let prompt = tokens(9, 4);
        let plain = GenerateConfig {
            max_new_tokens: 48,
            sampling: SamplingParams::greedy(),
            ..GenerateConfig::default()
        };
        let mut t = Session::new(target.clone(), 128);
        let want = generate(&mut t, &mut NoDraft, &prompt, &plain, &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap();
        for k in [1, 3, 6] {
            let got = generate_drafted((&target, &draft), &prompt, &plain, k, 128);
            assert_eq!(got.tokens, want.tokens, "k = {k}");
            assert!(got.metrics.drafted > 0);
        }
    }
}

/// The GPU's logits against the CPU's: f16 weights and f32 activations there, activations
/// quantised to 8 bits here for quantised matrices, so close but not equal: within 1% of the
/// largest logit for float matrices, 5% for quantised ones (at most 0.6% and 3.5% on an H200); the largest
/// difference is printed.
fn logits_match_the_cpu() {
    for spec in all_specs() {
        let gpu = load(&spec, &on_gpu());
        let cpu = load(&spec, &LoadOptions::default());
        let t = tokens(16, 3);
        let (g, c) = (
            logits_in_blocks(&gpu, &t, 16),
            logits_in_blocks(&cpu, &t, 16),
        );
        let (worst, scale) = gap(&g, &c);
        println!(
            "{:?} {:?}: max |gpu - cpu| = {worst:.2e}, max |cpu| = {scale:.2}",
            spec.arch, spec.dtype
        );
        let float = matches!(
            spec.dtype,
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16
        );
        let tolerance = if float { 0.01 } else { 0.05 };
        assert!(
            worst <= tolerance * scale,
            "{:?} {:?}: {worst} against logits up to {scale}",
            spec.arch,
            spec.dtype
        );
    }
}

/// A model shaped like the real ones in what the tiny ones are not: heads of 128 values, six query
/// heads to a KV head, matrices over 512 wide, and 300 positions (two attention chunks) against
/// the CPU; blocks across the chunk edge against single steps.
fn a_wide_model_past_the_chunk_edge_matches_the_cpu() {
    let spec = TinySpec {
        n_embd: 768,
        n_head: 6,
        n_head_kv: 1,
        head_dim: Some(128),
        n_ff: 1024,
        ..TinySpec::new(Arch::Qwen2, GgmlDType::F16)
    };
    let gpu = load(&spec, &on_gpu());
    let cpu = load(&spec, &LoadOptions::default());
    let t: Vec<u32> = (0..300).map(|i| (i * 13 + 1) % 256).collect();
    let single = logits_in_blocks(&gpu, &t, 1);
    assert!(same_bits(&single, &logits_in_blocks(&gpu, &t, 7)));
    let c = logits_in_blocks(&cpu, &t, 64);
    let (worst, scale) = gap(&single, &c);
    println!(
        "wide F16 model, 300 positions: max |gpu - cpu| = {worst:.2e}, max |cpu| = {scale:.2}"
    );
    assert!(
        worst <= 0.01 * scale,
        "{worst} against logits up to {scale}"
    );
}

fn a_cpu_cache_is_refused() {
    let gpu = load(&TinySpec::new(Arch::Qwen2, GgmlDType::Q8_0), &on_gpu());
    let cpu = load(
        &TinySpec::new(Arch::Qwen2, GgmlDType::Q8_0),
        &LoadOptions::default(),
    );
    let mut cache = cpu.cache(16);
    let e = gpu
        .forward(&mut cache, &[1, 2], 1, &mut Vec::new())
        .unwrap_err();
    assert!(matches!(e, Error::CacheShape), "{e}");
    let mut cache = gpu.cache(16);
    let e = cpu
        .forward(&mut cache, &[1, 2], 1, &mut Vec::new())
        .unwrap_err();
    assert!(matches!(e, Error::CacheShape), "{e}");
}

/// Why a GPU test cannot run here, if it cannot.
fn no_gpu() -> Option<String> {
    let (_dir, path) = tiny(&TinySpec::new(Arch::Qwen2, GgmlDType::Q8_0));
    match Model::load(&path, &on_gpu()) {
        Ok(m) => {
            println!("GPU: {:?}", m.device());
            None
        }
        Err(e) => Some(format!("no usable CUDA device: {e}")),
    }
}

fn main() {
    let missing = no_gpu();
    let tests: [(&str, fn()); 9] = [
        (
            "a_copied_prefix_decodes_as_alone",
            a_copied_prefix_decodes_as_alone,
        ),
        ("blocks_equal_single_steps", blocks_equal_single_steps),
        (
            "chunk_edges_do_not_change_the_bits",
            chunk_edges_do_not_change_the_bits,
        ),
        ("rollback_rescores_the_same", rollback_rescores_the_same),
        (
            "batched_parts_equal_passes_of_their_own",
            batched_parts_equal_passes_of_their_own,
        ),
        (
            "speculative_greedy_equals_plain",
            speculative_greedy_equals_plain,
        ),
        ("logits_match_the_cpu", logits_match_the_cpu),
        (
            "a_wide_model_past_the_chunk_edge_matches_the_cpu",
            a_wide_model_past_the_chunk_edge_matches_the_cpu,
        ),
        ("a_cpu_cache_is_refused", a_cpu_cache_is_refused),
    ];
    let require = std::env::var(REQUIRE_GPU).is_ok_and(|v| v == "1");
    let trials = tests
        .into_iter()
        .map(|(name, test)| {
            let missing = missing.clone();
            Trial::ignorable_test(name, move || match missing {
                None => {
                    test();
                    Ok(Completion::Completed)
                }
                Some(why) if require => Err(Failed::from(format!(
                    "{why}; {REQUIRE_GPU}=1 makes this a failure"
                ))),
                Some(why) => Ok(Completion::ignored_with(why)),
            })
        })
        .collect();
    run_trials(trials)
}
