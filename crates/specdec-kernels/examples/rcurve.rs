//! Quick r(m) of the matmul per format on a 1.5B-like FFN shape, threaded as the runtime runs it:
//! `cargo run --release -p specdec-kernels --example rcurve [threads] [rows] [every]` (`every`: r(m)
//! for every m in 1..=16, not only powers of two; `RCURVE_COLS=N` sets the input features, default 1536;
//! `RCURVE_FORMATS=Q4K,Q6K` times only those formats; `RCURVE_COPIES=N` cycles through N copies of
//! the matrix, enough of which read it from memory instead of cache; `RCURVE_MS=1,64,256` times
//! those row counts instead, the first taken as r's unit, so `r(m)` there is a ratio to its time). Each line ends with the fastest pass's
//! multiply-accumulate rate and the median pass's rate at the last row count: on a shared machine
//! the model's passes run at or below the median (stop 77: Q4_K at 200 rows, fastest 415–483
//! GMAC/s, median 347–377).

use specdec_kernels::{BlockFormat, Kernels, QMatrix, ThreadPool};
use std::time::Instant;

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

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let threads = std::env::args()
        .nth(1)
        .map_or(Ok(2), |s| s.parse::<usize>())?;
    let pool = ThreadPool::new(threads)?;
    let kernels = Kernels::get();
    let rows: usize = std::env::args().nth(2).map_or(Ok(8960), |s| s.parse())?;
    let cols: usize = std::env::var("RCURVE_COLS").map_or(Ok(1536), |s| s.parse())?;
    let only = std::env::var("RCURVE_FORMATS").unwrap_or_default();
    for format in [
        BlockFormat::Q4K,
        BlockFormat::Q6K,
        BlockFormat::Q8_0,
        BlockFormat::Q5_0,
        BlockFormat::Q4_0,
    ] {
        if !only.is_empty()
            && !only
                .split(',')
                .any(|f| f.eq_ignore_ascii_case(&format!("{format:?}")))
        {
            continue;
        }
        let n = rows * cols / format.block_len();
        let mut raw = bytes(7, n * format.block_bytes());
        // Small finite f16 scales (0x2000 ≈ 0.0078) at the start of every block but Q6_K's (at its end).
        for b in raw.chunks_exact_mut(format.block_bytes()) {
            let at = if format == BlockFormat::Q6K { 208 } else { 0 };
            b[at] = 0;
            b[at + 1] = 0x20;
            if format == BlockFormat::Q4K {
                b[2] = 0;
                b[3] = 0x20;
            }
        }
        // Copies of the matrix, used in turn: with enough of them their bytes outgrow the caches
        // and every pass reads its weights from memory, as a model's step does.
        let copies: usize = std::env::var("RCURVE_COPIES").map_or(Ok(1), |s| s.parse())?;
        let ws = (0..copies.max(1))
            .map(|_| QMatrix::from_bytes(format, rows, cols, &raw))
            .collect::<Result<Vec<_>, _>>()?;
        let w = &ws[0];
        let mut t1 = 0.0;
        let mut line = Vec::new();
        // The multiply-accumulate rate of the fastest pass: the kernel's compute throughput where
        // the matrix stays in cache.
        let mut peak = 0f64;
        // The last row count's median pass.
        let mut median_rate = 0f64;
        let every = std::env::args().nth(3).is_some_and(|s| s == "every");
        let ms: Vec<usize> = if let Ok(list) = std::env::var("RCURVE_MS") {
            list.split(',').map(str::parse).collect::<Result<_, _>>()?
        } else if every {
            (1..=16).collect()
        } else {
            vec![1, 2, 4, 8, 16, 32]
        };
        for &m in &ms {
            let x: Vec<f32> = bytes(m as u64, m * cols)
                .iter()
                .map(|&b| f32::from(b) / 64.0 - 2.0)
                .collect();
            let xq = w.quantize_activations(m, &x)?;
            let mut out = vec![0.0; m * rows];
            let mut times = Vec::new();
            for i in 0..201 {
                let w = &ws[i % ws.len()];
                let start = Instant::now();
                kernels.matmul_threaded(w, &xq, &mut out, &pool)?;
                times.push(start.elapsed().as_secs_f64());
            }
            times.sort_by(f64::total_cmp);
            let t = times[0]; // the fastest: least disturbed by other tenants of the machine
            peak = peak.max((m * rows * cols) as f64 / t / 1e9);
            median_rate = (m * rows * cols) as f64 / times[times.len() / 2] / 1e9;
            if t1 == 0.0 {
                t1 = t;
                line.push(format!(
                    "t({m}) {:.3} ms ({:.1} GB/s)",
                    t * 1e3,
                    w.size_bytes() as f64 / t / 1e9
                ));
            } else {
                line.push(format!("r({m}) {:.2}", t / t1));
            }
        }
        line.push(format!(
            "{peak:.0} GMAC/s (median pass at m = {}: {median_rate:.0})",
            ms.last().copied().unwrap_or(1)
        ));
        println!("{format:?} {}: {}", kernels.level().name(), line.join(", "));
    }
    Ok(())
}
