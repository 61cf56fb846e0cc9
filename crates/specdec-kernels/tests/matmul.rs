//! Column ranges, threading, accuracy against dequantised f32 arithmetic and shape errors at every
//! level this CPU supports (each level against the reference, and row independence: `levels.rs`).

mod common;

use common::{cols_for, random_activations, random_matrix, reference, same_bits, Rng, FORMATS};
use specdec_kernels::{
    BlockFormat, CpuLevel, KernelError, Kernels, MatmulJob, QMatrix, QuantizedActivations,
    ThreadPool,
};

fn kernels() -> Vec<Kernels> {
    CpuLevel::supported()
        .into_iter()
        .map(|l| Kernels::with_level(l).expect("supported level"))
        .collect()
}

/// Pools of 1, 2 and 3 threads.
fn pools() -> Vec<ThreadPool> {
    [1, 2, 3]
        .into_iter()
        .map(|n| ThreadPool::new(n).expect("a thread pool"))
        .collect()
}

#[test]
fn column_ranges_compose_into_the_full_matmul() {
    let mut rng = Rng(3);
    for format in FORMATS {
        // 24 rows: Q4_0 and Q5_0 interleaved in groups of 8, cut inside and across groups.
        let (rows, cols, m) = (24, cols_for(format), 4);
        let w = random_matrix(&mut rng, format, rows, cols);
        let x = w
            .quantize_activations(m, &random_activations(&mut rng, m, cols))
            .unwrap();
        for k in kernels() {
            let mut full = vec![0.0; m * rows];
            k.matmul(&w, &x, &mut full).unwrap();
            for range in [0..4, 4..9, 3..3, 8..9, 5..21, 16..24, 7..8, 0..24] {
                let mut part = vec![0.0; m * range.len()];
                k.matmul_columns(&w, &x, range.clone(), &mut part).unwrap();
                for r in 0..m {
                    for (i, n) in range.clone().enumerate() {
                        assert!(same_bits(part[r * range.len() + i], full[r * rows + n]));
                    }
                }
            }
        }
    }
}

#[test]
fn threaded_matmul_gives_the_single_threaded_bits() {
    let mut rng = Rng(31);
    let pools = pools();
    for format in FORMATS {
        for (rows, m) in [(1, 1), (37, 3), (300, 17), (1000, 1), (296, 5), (1024, 1)] {
            let cols = cols_for(format);
            let w = random_matrix(&mut rng, format, rows, cols);
            let x = w
                .quantize_activations(m, &random_activations(&mut rng, m, cols))
                .unwrap();
            for k in kernels() {
                let mut want = vec![0.0; m * rows];
                k.matmul(&w, &x, &mut want).unwrap();
                for pool in &pools {
                    // A column range written with a wider stride leaves the rest untouched.
                    let (cols, stride) = (rows / 3..rows, rows + 5);
                    let mut part = vec![-7.0; m * stride];
                    k.matmul_threaded_columns(&w, &x, cols.clone(), &mut part, stride, pool)
                        .unwrap();
                    for r in 0..m {
                        for i in 0..stride {
                            let got = part[r * stride + i];
                            match cols.clone().nth(i) {
                                Some(n) => assert!(same_bits(got, want[r * rows + n])),
                                None => assert_eq!(got, -7.0),
                            }
                        }
                    }
                    let mut got = vec![f32::NAN; m * rows];
                    k.matmul_threaded(&w, &x, &mut got, pool).unwrap();
                    assert!(
                        got.iter().zip(&want).all(|(a, b)| same_bits(*a, *b)),
                        "{format:?} rows {rows} m {m} threads {}",
                        pool.threads()
                    );
                }
            }
        }
    }
}

/// Several matmuls of the same activations as one job give each matmul's own bits, for more jobs
/// than one turn holds and matrices of different formats (the same activation format) and sizes.
#[test]
fn matmuls_as_one_job_give_each_matmuls_bits() {
    let mut rng = Rng(47);
    let pools = pools();
    // Formats that share an activation format, as a layer's projections may.
    let sets = [
        [BlockFormat::Q4K, BlockFormat::Q6K],
        [BlockFormat::Q4_0, BlockFormat::Q5_0],
    ];
    for formats in sets {
        let cols = cols_for(formats[0]);
        assert_eq!(cols, cols_for(formats[1]));
        for m in [1, 5, 17] {
            let x_f32 = random_activations(&mut rng, m, cols);
            let shapes = [1000, 256, 296, 37, 8, 1, 520];
            let ws: Vec<QMatrix> = shapes
                .iter()
                .enumerate()
                .map(|(i, &rows)| random_matrix(&mut rng, formats[i % 2], rows, cols))
                .collect();
            let x = ws[0].quantize_activations(m, &x_f32).unwrap();
            for k in kernels() {
                let want: Vec<Vec<f32>> = ws
                    .iter()
                    .map(|w| {
                        let mut out = vec![0.0; m * w.rows()];
                        k.matmul(w, &x, &mut out).unwrap();
                        out
                    })
                    .collect();
                for pool in &pools {
                    let mut got: Vec<Vec<f32>> =
                        ws.iter().map(|w| vec![f32::NAN; m * w.rows()]).collect();
                    let jobs =
                        ws.iter()
                            .zip(got.iter_mut())
                            .map(|(w, out)| MatmulJob { w, x: &x, out });
                    k.matmul_threaded_many(jobs, pool).unwrap();
                    for (g, w) in got.iter().zip(&want) {
                        assert!(
                            g.iter().zip(w).all(|(a, b)| same_bits(*a, *b)),
                            "{formats:?} m {m} threads {}",
                            pool.threads()
                        );
                    }
                }
            }
        }
    }
    // A job whose output has the wrong length is an error, not a panic.
    let w = random_matrix(&mut rng, BlockFormat::Q4K, 16, cols_for(BlockFormat::Q4K));
    let x = w
        .quantize_activations(2, &random_activations(&mut rng, 2, w.cols()))
        .unwrap();
    let mut short = vec![0.0; 31];
    let pool = ThreadPool::new(2).unwrap();
    let err = Kernels::get()
        .matmul_threaded_many(
            [MatmulJob {
                w: &w,
                x: &x,
                out: &mut short,
            }],
            &pool,
        )
        .unwrap_err();
    assert!(matches!(err, KernelError::OutputLength { .. }), "{err}");
}

#[test]
fn quantised_dot_matches_the_dequantised_f32_dot() {
    let mut rng = Rng(4);
    for format in FORMATS {
        let (rows, cols, m) = (6, cols_for(format), 5);
        let w = random_matrix(&mut rng, format, rows, cols);
        let x = random_activations(&mut rng, m, cols);
        let xq = w.quantize_activations(m, &x).unwrap();
        let mut out = vec![0.0; m * rows];
        specdec_kernels::matmul(&w, &xq, &mut out).unwrap();
        let mut wrow = vec![0.0; cols];
        for n in 0..rows {
            w.dequantize_row(n, &mut wrow);
            for r in 0..m {
                let xd = dequantised_activations(&xq, r, cols);
                let exact: f64 = wrow
                    .iter()
                    .zip(&xd)
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum();
                let magnitude: f64 = wrow
                    .iter()
                    .zip(&xd)
                    .map(|(&a, &b)| (f64::from(a) * f64::from(b)).abs())
                    .sum();
                let got = f64::from(out[r * rows + n]);
                // f32 rounding of the block scales' products and of the lane sums: a few ulps of the
                // magnitude, far below any quantisation error.
                assert!(
                    (got - exact).abs() <= 1e-5 * magnitude + 1e-30,
                    "{format:?} r={r} n={n}: {got} vs {exact} (magnitude {magnitude})"
                );
            }
        }
    }
}

fn dequantised_activations(x: &QuantizedActivations, r: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; cols];
    if let Some(blocks) = x.q8k_row(r) {
        for (b, o) in blocks.iter().zip(out.chunks_exact_mut(256)) {
            b.dequantize(o);
        }
    } else {
        for (b, o) in x
            .q8_0_row(r)
            .expect("Q8_0 or Q8_K")
            .iter()
            .zip(out.chunks_exact_mut(32))
        {
            for (v, &q) in o.iter_mut().zip(&b.qs) {
                *v = b.d * f32::from(q);
            }
        }
    }
    out
}

#[test]
fn the_scalar_level_is_always_available_and_explicit() {
    assert_eq!(
        Kernels::with_level(CpuLevel::Scalar).unwrap().level(),
        CpuLevel::Scalar
    );
    assert!(CpuLevel::supported().contains(&CpuLevel::Scalar));
    assert_eq!(CpuLevel::parse("AVX2").unwrap(), CpuLevel::Avx2);
    assert!(matches!(
        CpuLevel::parse("avx9"),
        Err(KernelError::UnknownLevel { .. })
    ));
}

#[test]
fn every_level_parses_from_its_name_and_amx_is_never_detected() {
    for level in CpuLevel::ALL {
        assert_eq!(CpuLevel::parse(level.name()).unwrap(), level);
    }
    // The AMX level measured no faster than the 512-bit one: asked for, never chosen.
    assert_ne!(CpuLevel::detect(), CpuLevel::Amx);
    assert_ne!(CpuLevel::parse("auto").unwrap(), CpuLevel::Amx);
}

#[test]
fn shape_errors_are_reported_not_panicked() {
    let mut rng = Rng(5);
    let w = random_matrix(&mut rng, BlockFormat::Q4K, 3, 512);
    let x = w.quantize_activations(2, &vec![1.0; 1024]).unwrap();
    let k = Kernels::get();
    assert_eq!(
        k.matmul(&w, &x, &mut [0.0; 5]),
        Err(KernelError::OutputLength {
            expected: 6,
            actual: 5
        })
    );
    assert!(matches!(
        k.matmul_columns(&w, &x, 2..4, &mut [0.0; 4]),
        Err(KernelError::ColumnRange { .. })
    ));
    let narrow =
        QuantizedActivations::quantize(specdec_kernels::ActivationFormat::Q8K, 1, 256, &[0.0; 256])
            .unwrap();
    assert!(matches!(
        k.matmul(&w, &narrow, &mut [0.0; 3]),
        Err(KernelError::WidthMismatch { .. })
    ));
    let q8 = QuantizedActivations::quantize(
        specdec_kernels::ActivationFormat::Q8_0,
        1,
        512,
        &[0.0; 512],
    )
    .unwrap();
    assert!(matches!(
        k.matmul(&w, &q8, &mut [0.0; 3]),
        Err(KernelError::ActivationFormat { .. })
    ));
    assert!(matches!(
        QMatrix::from_bytes(BlockFormat::Q4K, 1, 300, &[0; 144]),
        Err(KernelError::RaggedRow { cols: 300, .. })
    ));
    assert_eq!(
        QMatrix::from_bytes(BlockFormat::Q6K, 2, 256, &[0; 210]),
        Err(KernelError::ByteLength {
            expected: 420,
            actual: 210
        })
    );
    assert!(matches!(
        w.quantize_activations(2, &[0.0; 10]),
        Err(KernelError::InputLength { .. })
    ));
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Any bit pattern (NaN and infinite scales included) gives the reference bits at every level.
        #[test]
        fn arbitrary_tensor_bytes_match_the_reference(
            format_index in 0usize..5,
            rows in prop_oneof![1usize..4, Just(8usize), Just(16usize)],
            blocks in 1usize..3,
            m in 1usize..20,
            seed in any::<u64>(),
        ) {
            let format = FORMATS[format_index];
            let cols = blocks * format.block_len();
            let mut rng = Rng(seed);
            let bytes: Vec<u8> = (0..rows * blocks * format.block_bytes()).map(|_| rng.byte()).collect();
            let w = QMatrix::from_bytes(format, rows, cols, &bytes).unwrap();
            let x = w.quantize_activations(m, &random_activations(&mut rng, m, cols)).unwrap();
            for k in kernels() {
                let mut out = vec![0.0; m * rows];
                k.matmul(&w, &x, &mut out).unwrap();
                for r in 0..m {
                    for n in 0..rows {
                        prop_assert!(same_bits(out[r * rows + n], reference(&w, &x, n, r)));
                    }
                }
            }
        }
    }
}
