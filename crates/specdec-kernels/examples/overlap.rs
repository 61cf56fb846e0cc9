//! Does this machine overlap a stream's memory reads with arithmetic? A read loop over 1 GiB split
//! over the threads (as `bench --cost-curve` times the read roofline), with `W` fused multiply-adds
//! per 64-byte line on accumulators that do not wait on each other, timed from memory and in cache:
//! `cargo run --release -p specdec-kernels --example overlap [threads] [passes]`.
//!
//! Each line prints the in-cache rate (the arithmetic alone), the rate from memory without software
//! prefetch and with `prefetcht1` 4 and 16 KiB ahead, and two predictions from the `W = 0` memory
//! rate `M` and the in-cache rate `C`: `min(M, C)` where reads and arithmetic overlap fully,
//! `1 / (1/M + 1/C)` where they add up. A single-token decoding step is such a stream (its weights
//! read once, about 70–80 GB/s of arithmetic in cache), so the figures say which bound it meets.
//! x86-64 with AVX2 and FMA only.

#[cfg(target_arch = "x86_64")]
mod imp {
    use specdec_kernels::ThreadPool;
    use std::arch::x86_64::*;
    use std::sync::Mutex;
    use std::time::Instant;

    /// Floats per 64-byte line.
    const LINE: usize = 16;

    /// One pass over `data`: per line two loads added into two accumulators and `W` multiply-adds
    /// spread over six more; `AHEAD` bytes ahead prefetched into L2 (0: none).
    ///
    /// # Safety
    /// AVX2 and FMA must be available.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn pass<const W: usize, const AHEAD: usize>(data: &[f32]) -> f32 {
        let p = data.as_ptr();
        let k = _mm256_set1_ps(0.999_9);
        let mut acc = [_mm256_setzero_ps(); 8];
        for l in 0..data.len() / LINE {
            // SAFETY: `l * LINE + LINE <= data.len()`; the prefetch address is not dereferenced.
            unsafe {
                let at = p.add(l * LINE);
                if AHEAD > 0 {
                    _mm_prefetch::<_MM_HINT_T1>(at.cast::<i8>().wrapping_add(AHEAD));
                }
                let a = _mm256_loadu_ps(at);
                let b = _mm256_loadu_ps(at.add(8));
                acc[0] = _mm256_add_ps(acc[0], a);
                acc[1] = _mm256_add_ps(acc[1], b);
                for w in 0..W {
                    let j = 2 + w % 6;
                    acc[j] = _mm256_fmadd_ps(acc[j], k, if w % 2 == 0 { a } else { b });
                }
            }
        }
        let mut s = [0f32; 8];
        for a in acc {
            let mut v = [0f32; 8];
            // SAFETY: `v` holds 8 floats.
            unsafe { _mm256_storeu_ps(v.as_mut_ptr(), a) };
            for (s, v) in s.iter_mut().zip(v) {
                *s += v;
            }
        }
        s.iter().sum()
    }

    type Pass = unsafe fn(&[f32]) -> f32;

    fn passes<const W: usize>() -> [Pass; 3] {
        [pass::<W, 0>, pass::<W, 4096>, pass::<W, 16384>]
    }

    /// GB/s of `f` over `slices`, each read `reps` times by the thread that claims it; the median of
    /// `n` timings.
    fn rate(pool: &ThreadPool, slices: &[&[f32]], reps: usize, f: Pass, n: usize) -> f64 {
        let sink = Mutex::new(0f32);
        let bytes: usize = slices
            .iter()
            .map(|s| std::mem::size_of_val(*s))
            .sum::<usize>()
            * reps;
        let mut t: Vec<f64> = (0..n)
            .map(|_| {
                let start = Instant::now();
                pool.for_chunks(slices.len(), 1, &|r| {
                    for s in &slices[r] {
                        for _ in 0..reps {
                            // SAFETY: `main` checked AVX2 and FMA.
                            let v = unsafe { f(s) };
                            if let Ok(mut g) = sink.lock() {
                                *g += v;
                            }
                        }
                    }
                });
                bytes as f64 / start.elapsed().as_secs_f64() / 1e9
            })
            .collect();
        std::hint::black_box(sink.lock().map(|g| *g).unwrap_or_default());
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    }

    pub fn main() -> Result<(), Box<dyn std::error::Error>> {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            println!("overlap: skipped, this CPU lacks AVX2 or FMA");
            return Ok(());
        }
        let threads = std::env::args().nth(1).map_or(Ok(2), |s| s.parse())?;
        let n: usize = std::env::args().nth(2).map_or(Ok(5), |s| s.parse())?;
        let pool = ThreadPool::new(threads)?;
        // 1 GiB of ones (normal floats: no slow denormal arithmetic) in 8 MiB chunks that the threads
        // claim in turn, as the read passes of `bench --cost-curve` do.
        let big = vec![1f32; (1 << 30) / 4];
        let mem: Vec<&[f32]> = big.chunks(2 << 20).collect();
        // 192 KiB, in every core's L2 on the machines we run on, read by 16 tasks per thread.
        let small: Vec<&[f32]> = vec![&big[..48 * 1024]; 16 * threads];
        let in_cache_reps = (1 << 30) / (small.len() * 192 * 1024);
        // More multiply-adds per line than 16 spill the accumulators to the stack (the in-cache rate
        // then falls far below what the arithmetic alone would allow).
        let table: [(usize, [Pass; 3]); 6] = [
            (0, passes::<0>()),
            (2, passes::<2>()),
            (4, passes::<4>()),
            (8, passes::<8>()),
            (12, passes::<12>()),
            (16, passes::<16>()),
        ];
        println!(
            "{threads} threads; GB/s, medians of {n}: W multiply-adds per 64-byte line, in cache, \
             from memory (no prefetch, prefetcht1 4 KiB ahead, 16 KiB ahead), and the rates \
             predicted from memory at W = 0 if reads and arithmetic overlap (min) or add up"
        );
        let mut m0 = 0.0;
        for (w, [none, near, far]) in table {
            let c = rate(&pool, &small, in_cache_reps, none, n);
            let m = [none, near, far].map(|f| rate(&pool, &mem, 1, f, n));
            if w == 0 {
                m0 = m[0];
            }
            println!(
                "W {w:2}: cache {c:6.1}  memory {:5.1} {:5.1} {:5.1}  overlap {:5.1}  add {:5.1}",
                m[0],
                m[1],
                m[2],
                m0.min(c),
                1.0 / (1.0 / m0 + 1.0 / c)
            );
        }
        Ok(())
    }
}

#[cfg(target_arch = "x86_64")]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    imp::main()
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("overlap: skipped, x86-64 only");
}
