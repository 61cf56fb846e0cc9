//! Sampling and verification cost at the default pair's vocabulary (151,936) with k = 8.
//!
//! `cargo bench -p specdec-core --bench verify`

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use criterion::{criterion_group, criterion_main, Criterion};
use specdec_core::verify::{verify_greedy, verify_onehot, verify_rejection};
use specdec_core::{CounterRng, Probs, Sampler, SamplingParams, Stream};
use std::hint::black_box;

const VOCAB: usize = 151_936;
const K: usize = 8;

/// Logits shaped like a language model's: a few strong candidates over a broad, low floor.
fn logits(seed: u64, rows: usize) -> Vec<Vec<f32>> {
    let rng = CounterRng::new(seed);
    (0..rows)
        .map(|r| {
            (0..VOCAB)
                .map(|j| {
                    let u = rng.uniform(r * VOCAB + j, Stream::Target) as f32;
                    if j % 9973 == r {
                        12.0 + u
                    } else {
                        6.0 * u - 3.0
                    }
                })
                .collect()
        })
        .collect()
}

fn round(c: &mut Criterion) {
    let draft_logits = logits(1, K);
    let target_logits = logits(2, K + 1);
    let rng = CounterRng::new(3);
    let history: Vec<u32> = (0..64).collect();

    for (name, params) in [
        ("greedy", SamplingParams::greedy()),
        (
            "t0.8",
            SamplingParams {
                temperature: 0.8,
                ..SamplingParams::default()
            },
        ),
        (
            "t0.8_topk40_topp0.95",
            SamplingParams {
                temperature: 0.8,
                top_k: 40,
                top_p: 0.95,
                ..SamplingParams::default()
            },
        ),
        (
            "t0.8_topp0.95_rep1.1",
            SamplingParams {
                temperature: 0.8,
                top_p: 0.95,
                repetition_penalty: 1.1,
                ..SamplingParams::default()
            },
        ),
    ] {
        let mut sampler = Sampler::new(params.clone());
        let mut q: Vec<Probs> = vec![Probs::OneHot(0); K];
        let mut p: Vec<Probs> = vec![Probs::OneHot(0); K + 1];
        let mut residual = Vec::new();
        c.bench_function(&format!("probs_one_row/{name}"), |b| {
            b.iter(|| {
                sampler
                    .probs(black_box(&target_logits[0]), &history, &mut p[0])
                    .unwrap()
            })
        });
        // Target side of a round: k + 1 distributions and the verdict.
        c.bench_function(&format!("target_side_k8/{name}"), |b| {
            b.iter(|| {
                for (row, out) in target_logits.iter().zip(p.iter_mut()) {
                    sampler.probs(row, &history, out).unwrap();
                }
                let draft: Vec<u32> = (0..K as u32).collect();
                if params.is_greedy() {
                    black_box(verify_greedy(&draft, &p))
                } else {
                    black_box(verify_onehot(&draft, &p, &rng, 100))
                }
            })
        });
        // A whole round: k draft distributions and samples, k + 1 target distributions, rejection
        // sampling (a rejection at the first position, so the residual is formed too).
        c.bench_function(&format!("full_round_k8_rejection/{name}"), |b| {
            b.iter(|| {
                let mut draft = Vec::with_capacity(K);
                for (i, (row, out)) in draft_logits.iter().zip(q.iter_mut()).enumerate() {
                    sampler.probs(row, &history, out).unwrap();
                    draft.push(out.sample(rng.uniform(100 + i, Stream::Draft)));
                }
                for (row, out) in target_logits.iter().zip(p.iter_mut()) {
                    sampler.probs(row, &history, out).unwrap();
                }
                black_box(verify_rejection(&draft, &q, &p, &rng, 100, &mut residual))
            })
        });
    }
}

criterion_group!(benches, round);
criterion_main!(benches);
