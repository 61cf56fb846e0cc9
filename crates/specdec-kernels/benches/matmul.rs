//! Multi-row matmul throughput per weight format and row count, and activation quantisation's.
//!
//! Throughput is weight bytes streamed per call, so GB/s compares directly with memory bandwidth; the
//! number to watch is r(m) = time(m) / time(1): how much `m` activation rows cost over one.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use specdec_kernels::{
    quantize_row_q8_0, quantize_row_q8_k, ActQ8_0, BlockFormat, BlockQ4K, BlockQ4_0, BlockQ5_0,
    BlockQ6K, BlockQ8K, BlockQ8_0, Kernels, QMatrix, Weights, F16,
};
use std::hint::black_box;

/// A deterministic pseudo-random byte stream (SplitMix64).
fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            (z ^ (z >> 31)) as u8
        })
        .collect()
}

/// A matrix of random quants with small finite scales.
fn matrix(format: BlockFormat, rows: usize, cols: usize) -> QMatrix {
    let n = rows * cols / format.block_len();
    let raw = bytes(7, n * format.block_bytes());
    let d = F16::from_f32(0.01);
    let chunks = raw.chunks_exact(format.block_bytes());
    let weights = match format {
        BlockFormat::Q8_0 => Weights::Q8_0(
            chunks
                .map(|c| BlockQ8_0 {
                    d,
                    qs: std::array::from_fn(|i| c[i] as i8),
                })
                .collect(),
        ),
        BlockFormat::Q4_0 => Weights::Q4_0(
            chunks
                .map(|c| BlockQ4_0 {
                    d,
                    qs: std::array::from_fn(|i| c[i]),
                })
                .collect(),
        ),
        BlockFormat::Q5_0 => Weights::Q5_0(
            chunks
                .map(|c| BlockQ5_0 {
                    d,
                    qh: std::array::from_fn(|i| c[i]),
                    qs: std::array::from_fn(|i| c[4 + i]),
                })
                .collect(),
        ),
        BlockFormat::Q4K => Weights::Q4K(
            chunks
                .map(|c| BlockQ4K {
                    d,
                    dmin: d,
                    scales: std::array::from_fn(|i| c[i]),
                    qs: std::array::from_fn(|i| c[12 + i]),
                })
                .collect(),
        ),
        BlockFormat::Q6K => Weights::Q6K(
            chunks
                .map(|c| BlockQ6K {
                    ql: std::array::from_fn(|i| c[i]),
                    qh: std::array::from_fn(|i| c[128 + i]),
                    scales: std::array::from_fn(|i| (c[192 + i] % 64) as i8),
                    d,
                })
                .collect(),
        ),
    };
    QMatrix::from_blocks(rows, cols, weights).expect("shape built to match")
}

fn bench(c: &mut Criterion) {
    let kernels = Kernels::get();
    // Qwen2.5-1.5B-like shapes: a square projection, and the FFN up/gate projection.
    let shapes = [("1536x1536", 1536, 1536), ("8960x1536", 8960, 1536)];
    for format in [
        BlockFormat::Q4K,
        BlockFormat::Q8_0,
        BlockFormat::Q6K,
        BlockFormat::Q4_0,
        BlockFormat::Q5_0,
    ] {
        let mut group = c.benchmark_group(format!("matmul/{format:?}/{}", kernels.level().name()));
        for (name, rows, cols) in shapes {
            let w = matrix(format, rows, cols);
            group.throughput(Throughput::Bytes(w.size_bytes() as u64));
            for m in [1usize, 4, 8, 16] {
                let x: Vec<f32> = bytes(m as u64, m * cols)
                    .iter()
                    .map(|&b| f32::from(b) / 64.0 - 2.0)
                    .collect();
                let xq = w.quantize_activations(m, &x).expect("shape built to match");
                let mut out = vec![0.0; m * rows];
                group.bench_with_input(BenchmarkId::new(name, m), &m, |b, _| {
                    b.iter(|| {
                        kernels
                            .matmul(black_box(&w), black_box(&xq), &mut out)
                            .expect("shapes match")
                    })
                });
            }
        }
        group.finish();
    }
}

/// Activation quantisation of one 4,864-value row (the draft's FFN width) and of 200 such rows (a
/// prefill's block), in both activation formats; throughput in input values.
fn quantize(c: &mut Criterion) {
    let mut group = c.benchmark_group("quantize");
    for rows in [1usize, 200] {
        let n = rows * 4864;
        let x: Vec<f32> = bytes(3, n)
            .iter()
            .map(|&b| f32::from(b) / 64.0 - 2.0)
            .collect();
        group.throughput(Throughput::Elements(n as u64));
        let mut q8_0 = vec![
            ActQ8_0 {
                d: 0.0,
                sum: 0,
                qs: [0; 32]
            };
            n / 32
        ];
        group.bench_with_input(BenchmarkId::new("q8_0", rows), &rows, |b, _| {
            b.iter(|| quantize_row_q8_0(black_box(&x), &mut q8_0))
        });
        let mut q8_k = vec![BlockQ8K::ZERO; n / 256];
        group.bench_with_input(BenchmarkId::new("q8_k", rows), &rows, |b, _| {
            b.iter(|| quantize_row_q8_k(black_box(&x), &mut q8_k))
        });
    }
    group.finish();
}

criterion_group!(benches, bench, quantize);
criterion_main!(benches);
