//! Vocabulary-wide loops (max, softmax, sums, argmax), written once in portable Rust and compiled again
//! for AVX2 and AVX-512 behind run-time detection.
//!
//! invariant: every path gives bit-identical results. The code uses only IEEE additions and
//! multiplications in a fixed order (16 independent lanes, combined in a fixed order); Rust never fuses
//! them into FMAs on its own, so a wider vector unit changes the speed and not one bit of the result.
//! That is what keeps speculative and plain decoding identical across machines.

/// Lanes of every reduction; fixed, so the summation order never depends on the vector width.
const LANES: usize = 16;

/// exp(x) for x <= 0 (Cephes' `expf` polynomial, relative error about 2e-7); x below -87 gives
/// about 1.6e-38 rather than 0, which is harmless for probabilities.
#[inline(always)]
fn exp_neg(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer without a rounding instruction.
    const ROUND: f32 = 12_582_912.0;
    let x = if x < -87.0 { -87.0 } else { x };
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_2e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * (r * r) + r + 1.0;
    // 2^n from the bits of n + 127 held exactly in the low mantissa bits of ROUND + n + 127, with no
    // float-to-int conversion (which would not vectorise as cheaply).
    let biased = (n + (ROUND + 127.0))
        .to_bits()
        .wrapping_sub(ROUND.to_bits());
    let scale = f32::from_bits(biased << 23);
    e * scale
}

#[inline(always)]
fn combine(acc: [f32; LANES]) -> f64 {
    acc.iter().map(|&v| f64::from(v)).sum()
}

/// Max, its first index, and the index of the first non-finite value, if any. A NaN or an infinity
/// makes the sum non-finite; only then (or if finite values overflow the sum, which the scan tells
/// apart) is the slice scanned value by value. Separate passes vectorise; one fused pass did not.
#[inline(always)]
fn max_and_check_generic(x: &[f32]) -> (f32, usize, Option<usize>) {
    if !sum_generic(x).is_finite() {
        if let Some(i) = x.iter().position(|v| !v.is_finite()) {
            return (f32::NAN, 0, Some(i));
        }
    }
    let (m, i) = max_argmax_generic(x);
    (m, i, None)
}

/// Block length of [`max_argmax_generic`].
const ARGMAX_BLOCK: usize = 256;

/// The maximum and its first index: vector maxima per block, then a search inside the first block
/// holding the overall maximum.
#[inline(always)]
fn max_argmax_generic(x: &[f32]) -> (f32, usize) {
    let mut best = f32::NEG_INFINITY;
    let mut best_block = 0;
    for (b, block) in x.chunks(ARGMAX_BLOCK).enumerate() {
        let m = max_generic(block);
        if m > best {
            best = m;
            best_block = b;
        }
    }
    let start = best_block * ARGMAX_BLOCK;
    let end = (start + ARGMAX_BLOCK).min(x.len());
    (best, start + position_generic(&x[start..end], best))
}

#[inline(always)]
fn fold_max(acc: [f32; LANES]) -> f32 {
    acc.iter()
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

/// The maximum of `x` (NaN-free input).
#[inline(always)]
fn max_generic(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            acc[l] = if c[l] > acc[l] { c[l] } else { acc[l] };
        }
    }
    for &v in tail {
        acc[0] = if v > acc[0] { v } else { acc[0] };
    }
    fold_max(acc)
}

/// `x[i] = exp((x[i] - max) * inv_t)`, returning the sum.
#[inline(always)]
fn exp_shift_sum_generic(x: &mut [f32], max: f32, inv_t: f32) -> f64 {
    let mut acc = [0.0f32; LANES];
    let mut chunks = x.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            let e = exp_neg((c[l] - max) * inv_t);
            c[l] = e;
            acc[l] += e;
        }
    }
    for (l, v) in chunks.into_remainder().iter_mut().enumerate() {
        let e = exp_neg((*v - max) * inv_t);
        *v = e;
        acc[l] += e;
    }
    combine(acc)
}

/// `dst[i] = exp((src[i] - max) * inv_t)`, returning the sum; the same arithmetic as
/// [`exp_shift_sum_generic`] without a copy first.
#[inline(always)]
fn exp_shift_sum_into_generic(src: &[f32], dst: &mut [f32], max: f32, inv_t: f32) -> f64 {
    let mut acc = [0.0f32; LANES];
    let mut out = dst.chunks_exact_mut(LANES);
    let mut inp = src.chunks_exact(LANES);
    for (o, c) in (&mut out).zip(&mut inp) {
        for l in 0..LANES {
            let e = exp_neg((c[l] - max) * inv_t);
            o[l] = e;
            acc[l] += e;
        }
    }
    for (l, (o, &v)) in out
        .into_remainder()
        .iter_mut()
        .zip(inp.remainder())
        .enumerate()
    {
        let e = exp_neg((v - max) * inv_t);
        *o = e;
        acc[l] += e;
    }
    combine(acc)
}

#[inline(always)]
fn scale_generic(x: &mut [f32], s: f32) {
    for v in x {
        *v *= s;
    }
}

#[inline(always)]
fn sum_generic(x: &[f32]) -> f64 {
    let mut acc = [0.0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            acc[l] += c[l];
        }
    }
    for (l, &v) in tail.iter().enumerate() {
        acc[l] += v;
    }
    combine(acc)
}

/// Index of the maximum; the lowest index wins ties.
#[inline(always)]
fn argmax_generic(x: &[f32]) -> usize {
    max_argmax_generic(x).1
}

/// Index of the first element equal to `m` (0 if none).
#[inline(always)]
fn position_generic(x: &[f32], m: f32) -> usize {
    // The first chunk holding `m`, found with one vector compare per chunk.
    let mut chunks = x.chunks_exact(LANES);
    for (ci, c) in chunks.by_ref().enumerate() {
        let mut hit = 0u32;
        for &v in c {
            hit |= u32::from(v == m);
        }
        if hit != 0 {
            return ci * LANES + c.iter().position(|&v| v == m).unwrap_or(0);
        }
    }
    let start = x.len() - chunks.remainder().len();
    start + chunks.remainder().iter().position(|&v| v == m).unwrap_or(0)
}

macro_rules! dispatch {
    ($(#[$doc:meta])* pub fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty => $generic:ident) => {
        $(#[$doc])*
        pub fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                fn avx512($($arg: $ty),*) -> $ret {
                    $generic($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                fn avx2($($arg: $ty),*) -> $ret {
                    $generic($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU supports AVX-512F, checked just above.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU supports AVX2, checked just above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $generic($($arg),*)
        }
    };
}

dispatch! {
    /// The maximum of `x` and its first index, or the index of the first NaN or infinity.
    pub fn max_checked(x: &[f32]) -> (f32, usize, Option<usize>) => max_and_check_generic
}
dispatch! {
    /// The maximum of `x`, which must be free of NaN.
    pub fn max(x: &[f32]) -> f32 => max_generic
}
dispatch! {
    /// Replaces `x[i]` by `exp((x[i] - max) * inv_t)` and returns the sum of the results.
    pub fn exp_shift_sum(x: &mut [f32], max: f32, inv_t: f32) -> f64 => exp_shift_sum_generic
}
dispatch! {
    /// Writes `exp((src[i] - max) * inv_t)` into `dst` and returns the sum: bit-identical to copying
    /// `src` into `dst` and calling [`exp_shift_sum`].
    pub fn exp_shift_sum_into(src: &[f32], dst: &mut [f32], max: f32, inv_t: f32) -> f64 => exp_shift_sum_into_generic
}
dispatch! {
    /// The index of the first element equal to `value` (0 if none).
    pub fn position(x: &[f32], value: f32) -> usize => position_generic
}
dispatch! {
    /// Multiplies every element by `s`.
    pub fn scale(x: &mut [f32], s: f32) -> () => scale_generic
}
dispatch! {
    /// The sum of `x`, in a fixed lane order.
    pub fn sum(x: &[f32]) -> f64 => sum_generic
}
dispatch! {
    /// The index of the maximum of `x`; the lowest index wins ties. `x` must not be empty.
    pub fn argmax(x: &[f32]) -> usize => argmax_generic
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_neg_is_accurate() {
        let mut x = -87.0f32;
        while x <= 0.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp_neg(x));
            assert!(
                ((got - want) / want).abs() < 5e-7,
                "exp({x}) = {got}, want {want}"
            );
            x += 0.013;
        }
        assert_eq!(exp_neg(0.0), 1.0);
    }

    #[test]
    fn dispatched_and_generic_paths_agree_bit_for_bit() {
        let v: Vec<f32> = (0..1003)
            .map(|i| ((i * 7919) % 1000) as f32 * 0.037 - 20.0)
            .collect();
        let (m, i, bad) = max_checked(&v);
        assert_eq!(bad, None);
        assert_eq!((m, i, None), max_and_check_generic(&v));
        assert_eq!(v[i], m);
        assert!(v[..i].iter().all(|&x| x < m));
        let mut a = v.clone();
        let mut b = v.clone();
        let sa = exp_shift_sum(&mut a, m, 0.7);
        let sb = exp_shift_sum_generic(&mut b, m, 0.7);
        assert_eq!(sa.to_bits(), sb.to_bits());
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
        assert_eq!(argmax(&v), argmax_generic(&v));
        let mut c = vec![0.0f32; v.len()];
        let sc = exp_shift_sum_into(&v, &mut c, m, 0.7);
        assert_eq!(sc.to_bits(), sa.to_bits());
        assert!(a.iter().zip(&c).all(|(x, y)| x.to_bits() == y.to_bits()));
        assert_eq!(position(&v, m), argmax(&v));
        assert_eq!(sum(&v).to_bits(), sum_generic(&v).to_bits());
    }

    #[test]
    fn argmax_prefers_the_lowest_index_on_ties() {
        let mut v = vec![0.0f32; 100];
        v[37] = 5.0;
        v[90] = 5.0;
        v[3] = 5.0;
        assert_eq!(argmax(&v), 3);
        assert_eq!(argmax(&[1.0, 2.0, 2.0]), 1);
    }

    #[test]
    fn non_finite_values_are_found() {
        let mut v = vec![0.0f32; 40];
        v[33] = f32::NAN;
        assert_eq!(max_checked(&v).2, Some(33));
        v[33] = 0.0;
        v[2] = f32::INFINITY;
        assert_eq!(max_checked(&v).2, Some(2));
    }
}
