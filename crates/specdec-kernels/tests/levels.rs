//! Every CPU level against the scalar reference dot products, bit for bit, and row independence at
//! every level. A level this CPU cannot run is reported as ignored, with the features it lacks, so a
//! run on a machine without AVX-512 says so instead of passing silently.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use common::{cols_for, random_activations, random_matrix, reference, same_bits, Rng, FORMATS, MS};
use libtest_mimic::{Completion, Failed, Trial};
use specdec_kernels::{BlockFormat, CpuLevel, Kernels, QMatrix, QuantizedActivations, ThreadPool};

/// A check run at one level.
type Check = fn(Kernels);

fn main() {
    let mut trials = Vec::new();
    for level in CpuLevel::ALL {
        let checks: [(&str, Check); 3] = [
            (
                "matches_the_scalar_reference_for_every_m",
                matches_the_reference,
            ),
            (
                "gives_a_row_the_same_bits_alone_and_in_any_batch",
                row_independence,
            ),
            ("matches_the_reference_at_extreme_values", extreme_values),
        ];
        for (name, check) in checks {
            trials.push(Trial::ignorable_test(
                format!("{}::{name}", level.name()),
                move || match Kernels::with_level(level) {
                    Ok(kernels) => {
                        check(kernels);
                        Ok(Completion::Completed)
                    }
                    Err(_) if !level.is_supported() => Ok(unsupported(level)),
                    Err(e) => Err(Failed::from(e.to_string())),
                },
            ));
        }
    }
    // The `amx` level's gemm through the public matmuls, against the 512-bit passes' bits.
    trials.push(Trial::ignorable_test(
        "amx::the_gemm_gives_the_passes_bits_through_columns_and_threads",
        || match Kernels::with_level(CpuLevel::Amx) {
            Ok(amx) => {
                gemm_gives_the_passes_bits(amx);
                Ok(Completion::Completed)
            }
            Err(_) => Ok(unsupported(CpuLevel::Amx)),
        },
    ));
    // The AMX kernels' layouts, on emulated tiles (any AVX-512 CPU) and on this CPU's.
    for check in specdec_kernels::testing::checks() {
        trials.push(Trial::ignorable_test(check.name, move || {
            if !check.needs.is_supported() {
                return Ok(unsupported(check.needs));
            }
            (check.run)();
            Ok(Completion::Completed)
        }));
    }
    libtest_mimic::run(&libtest_mimic::Arguments::from_args(), trials).exit()
}

/// A test this CPU cannot run: ignored, with the features it lacks.
fn unsupported(level: CpuLevel) -> Completion {
    Completion::ignored_with(format!("needs {}, which this CPU lacks", level.features()))
}

/// The `amx` level's gemm (Q4_K matmuls of 32 rows or more, in whole slabs of 16 and the rest in
/// passes) gives the 512-bit passes' bits through column ranges that cut groups, an output wider
/// than the range and threads (the gemm's layout is checked on emulated tiles too, through
/// `specdec_kernels::testing`).
fn gemm_gives_the_passes_bits(amx: Kernels) {
    let zmm = Kernels::with_level(CpuLevel::Avx512Zmm).expect("the amx level includes avx512zmm");
    let mut rng = Rng(63);
    let format = BlockFormat::Q4K;
    let cols = cols_for(format);
    for (rows, m) in [(24, 33), (296, 48), (1000, 65)] {
        let w = random_matrix(&mut rng, format, rows, cols);
        let x = w
            .quantize_activations(m, &random_activations(&mut rng, m, cols))
            .unwrap();
        let mut want = vec![0.0; m * rows];
        zmm.matmul(&w, &x, &mut want).unwrap();
        for range in [3..11, 5..21, 16..24, 0..rows] {
            let mut part = vec![0.0; m * range.len()];
            amx.matmul_columns(&w, &x, range.clone(), &mut part)
                .unwrap();
            for r in 0..m {
                for (i, n) in range.clone().enumerate() {
                    assert!(
                        same_bits(part[r * range.len() + i], want[r * rows + n]),
                        "rows {rows} m {m} columns {range:?} row {r} column {n}"
                    );
                }
            }
        }
        for pool in [1, 2, 3].map(|n| ThreadPool::new(n).unwrap()).iter() {
            let (cols, stride) = (rows / 3 + 1..rows, rows + 5);
            let mut part = vec![-7.0; m * stride];
            amx.matmul_threaded_columns(&w, &x, cols.clone(), &mut part, stride, pool)
                .unwrap();
            for r in 0..m {
                for i in 0..stride {
                    let got = part[r * stride + i];
                    match cols.clone().nth(i) {
                        Some(n) => assert!(
                            same_bits(got, want[r * rows + n]),
                            "rows {rows} m {m} threads {} row {r} column {n}",
                            pool.threads()
                        ),
                        None => assert_eq!(got, -7.0),
                    }
                }
            }
        }
    }
}

fn matches_the_reference(k: Kernels) {
    let mut rng = Rng(1);
    for format in FORMATS {
        // 19 weight rows: two full groups of 8 columns and a partial one for the 32-value formats;
        // 24 rows: Q4_0 and Q5_0 interleaved in 3 groups of 8.
        for rows in [19, 24] {
            let cols = cols_for(format);
            for m in MS {
                let w = random_matrix(&mut rng, format, rows, cols);
                let x = w
                    .quantize_activations(m, &random_activations(&mut rng, m, cols))
                    .unwrap();
                assert_matches_reference(k, &w, m, &x);
            }
        }
    }
}

fn assert_matches_reference(k: Kernels, w: &QMatrix, m: usize, x: &QuantizedActivations) {
    let rows = w.rows();
    let mut out = vec![f32::NAN; m * rows];
    k.matmul(w, x, &mut out).unwrap();
    for r in 0..m {
        for n in 0..rows {
            let (got, want) = (out[r * rows + n], reference(w, x, n, r));
            assert!(
                same_bits(got, want),
                "{:?} {:?} m={m} r={r} n={n}: {got} vs {want}",
                w.format(),
                k.level()
            );
        }
    }
}

fn row_independence(k: Kernels) {
    let mut rng = Rng(2);
    for format in FORMATS {
        // 8 rows: one interleaved group of Q4_0 and Q5_0.
        let (rows, cols, m) = (8, cols_for(format), 33);
        let w = random_matrix(&mut rng, format, rows, cols);
        let x = random_activations(&mut rng, m, cols);
        let xq = w.quantize_activations(m, &x).unwrap();
        let mut batch = vec![0.0; m * rows];
        k.matmul(&w, &xq, &mut batch).unwrap();
        for r in 0..m {
            let alone = w
                .quantize_activations(1, &x[r * cols..(r + 1) * cols])
                .unwrap();
            let mut single = vec![0.0; rows];
            k.matmul(&w, &alone, &mut single).unwrap();
            // The same row next to different neighbours, at a different position in the pass.
            let mut shuffled = random_activations(&mut rng, 6, cols);
            shuffled[4 * cols..5 * cols].copy_from_slice(&x[r * cols..(r + 1) * cols]);
            let sq = w.quantize_activations(6, &shuffled).unwrap();
            let mut other = vec![0.0; 6 * rows];
            k.matmul(&w, &sq, &mut other).unwrap();
            for n in 0..rows {
                let b = batch[r * rows + n];
                assert!(
                    same_bits(b, single[n]),
                    "{format:?} {:?} r={r} n={n}",
                    k.level()
                );
                assert!(
                    same_bits(b, other[4 * rows + n]),
                    "{format:?} {:?} r={r} n={n}",
                    k.level()
                );
            }
        }
    }
}

/// Weights whose every byte but the float scales is `fill` (all quants at their largest, smallest
/// or a sign boundary), against activations that quantise to ±127 everywhere, alternating signs, or
/// one large value among small ones: the integer sums at the bounds the kernels' exactness rests on.
fn extreme_values(k: Kernels) {
    for format in FORMATS {
        let (rows, cols) = (8, cols_for(format));
        for fill in [0xff_u8, 0x80, 0x7f, 0x00, 0x55] {
            let n = rows * cols / format.block_len();
            let mut raw = vec![fill; n * format.block_bytes()];
            for b in raw.chunks_exact_mut(format.block_bytes()) {
                // A small finite f16 (0x2000 ≈ 0.0078) in every block's scale fields.
                let scales: &[usize] = match format {
                    BlockFormat::Q6K => &[208],
                    BlockFormat::Q4K => &[0, 2],
                    _ => &[0],
                };
                for &at in scales {
                    b[at] = 0;
                    b[at + 1] = 0x20;
                }
            }
            let w = QMatrix::from_bytes(format, rows, cols, &raw).unwrap();
            let patterns: Vec<Vec<f32>> = vec![
                vec![-1.0; cols],
                vec![1.0; cols],
                (0..cols)
                    .map(|i| if i % 2 == 0 { 1.0 } else { -1.0 })
                    .collect(),
                (0..cols)
                    .map(|i| if i == 5 { -9.0 } else { 0.01 })
                    .collect(),
            ];
            let x: Vec<f32> = patterns.concat();
            let m = patterns.len();
            let xq = w.quantize_activations(m, &x).unwrap();
            assert_matches_reference(k, &w, m, &xq);
        }
    }
}
