//! Q8_K: the activation format for K-quant dot products (256 values, f32 scale, 16-value sums).

use super::QK_K;

/// A Q8_K block: the fields and values of ggml's `block_q8_K`, with the quants in the order the K-quant
/// kernels read them. Quants lie in `-127..=127`.
///
/// # The order of the quants
///
/// Seen as 8 vectors of 32 bytes, `qs` is the block's 256 quants as an 8 × 8 matrix of 4-value groups,
/// transposed: 4-byte lane `j` of vector `t` holds values `32 j + 4 t .. + 4`
/// ([`q8k_value`], its own inverse [`q8k_position`]). So every 4-byte lane of all 8 vectors belongs
/// to one 32-value group (Q4_K sub-block `j`), and lane `j` of vectors 0..4 and 4..8 to one 16-value
/// Q6_K sub-block each (`2 j` and `2 j + 1`). A kernel can add the `maddubs` products of all 8 vectors
/// of a Q4_K block in `i16` (two of a Q6_K block) before applying one scale per lane. The K-quant
/// weight blocks store their quants in the same order ([`crate::formats::BlockQ4K`],
/// [`crate::formats::BlockQ6K`]), so a dot product is position by position, with no shuffle.
///
/// The quants come first and the block is aligned to 32 bytes (320 bytes in all), so that no 32-byte
/// vector of quants straddles two cache lines.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C, align(32))]
pub struct BlockQ8K {
    /// Quants, in the kernels' order (see above): value `v` is at `qs[q8k_position(v)]`.
    pub qs: [i8; QK_K],
    /// `bsums[i]` = sum of the quants of values `16 i .. 16 i + 16`.
    pub bsums: [i16; QK_K / 16],
    /// Scale (negative when the largest-magnitude value is positive, as in ggml).
    pub d: f32,
    /// `sums32[j]` = `bsums[2 j] + bsums[2 j + 1]`, the sum of the quants of values `32 j .. 32 j +
    /// 32` (Q4_K sub-block `j`; at most 32 · 127 in magnitude). Not in ggml's block: it lies in
    /// what would otherwise be padding, so that the interleaved Q4_K passes broadcast each pair of
    /// them straight from memory instead of adding and shuffling `bsums` for every row and block.
    pub sums32: [i16; QK_K / 32],
}

// The sums of 32 values take 16 of the 28 bytes of padding that the alignment left.
const _: () = assert!(std::mem::size_of::<BlockQ8K>() == 320);

impl BlockQ8K {
    /// The block of 256 zeros (scale 0).
    pub const ZERO: BlockQ8K = BlockQ8K {
        qs: [0; QK_K],
        bsums: [0; QK_K / 16],
        d: 0.0,
        sums32: [0; QK_K / 32],
    };
}

/// The value (0..256) whose quant is at position `i` of [`BlockQ8K::qs`]: position `32 t + 4 j + b`
/// holds value `32 j + 4 t + b` (the transpose of 4-value groups; see [`BlockQ8K`]).
///
/// # Panics
/// If `i >= 256`.
pub const fn q8k_value(i: usize) -> usize {
    assert!(i < QK_K, "a Q8_K block holds 256 values");
    32 * ((i % 32) / 4) + 4 * (i / 32) + i % 4
}

/// The position in [`BlockQ8K::qs`] of value `v` (0..256): the inverse of [`q8k_value`], which is its
/// own inverse.
///
/// # Panics
/// If `v >= 256`.
pub const fn q8k_position(v: usize) -> usize {
    q8k_value(v)
}

/// ggml's `nearest_int`: round to nearest, ties to even, through the float adder (valid for
/// `|x| ≤ 2^22`).
fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0; // 1.5 · 2^23: the sum's low mantissa bits are the rounded integer
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Quantises `x` (a multiple of 256 long) to Q8_K exactly as ggml's `quantize_row_q8_K_ref`: the value
/// of largest magnitude `max` (first one on ties) gives `iscale = -127 / max`, `q = min(127,
/// nearest_int(iscale · x))`, `d = 1 / iscale`; an all-zero block gets `d = 0`. The quants are stored
/// in [`BlockQ8K`]'s order.
///
/// # Panics
/// If `out.len() * 256 != x.len()`.
pub fn quantize_row_q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    assert_eq!(out.len() * QK_K, x.len(), "one block per 256 values");
    #[cfg(target_arch = "x86_64")]
    if crate::Kernels::get().level().has_avx2() {
        // SAFETY: levels with AVX2 are only chosen on CPUs with AVX2.
        unsafe { quantize_avx2(x, out) };
        return;
    }
    quantize_blocks(x, out);
}

/// [`quantize_blocks`] in 256-bit vectors, the same operations value by value, so the same blocks:
/// the largest magnitude (NaN ignored, as `f32::max` does) and the first value that has it, the
/// quants through the float adder's rounding and the truncating cast, and per 32 values their bytes
/// in value order, whose 4-byte groups an 8 × 8 transpose puts into [`BlockQ8K`]'s order, and
/// their two 16-value sums.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_avx2(x: &[f32], out: &mut [BlockQ8K]) {
    use std::arch::x86_64::*;
    let sign = _mm256_set1_ps(-0.0);
    let round = _mm256_set1_ps(12_582_912.0);
    let (mantissa, bias) = (
        _mm256_set1_epi32(0x007f_ffff),
        _mm256_set1_epi32(0x0040_0000),
    );
    let top = _mm256_set1_epi32(127);
    for (x, block) in x.chunks_exact(QK_K).zip(out) {
        // SAFETY: 8 values from `8 i`, in bounds (checked).
        let load = |i: usize| unsafe { _mm256_loadu_ps(x[8 * i..][..8].as_ptr()) };
        let mut m = [_mm256_setzero_ps(); 4];
        for i in 0..QK_K / 8 {
            // The second operand where either is NaN: a NaN value leaves the maximum as it was.
            m[i % 4] = _mm256_max_ps(_mm256_andnot_ps(sign, load(i)), m[i % 4]);
        }
        let m = _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]));
        let amax = super::hmax_avx2(m);
        if amax == 0.0 {
            *block = BlockQ8K::ZERO;
            continue;
        }
        // The first value of the largest magnitude.
        let target = _mm256_set1_ps(amax);
        let mut max = amax;
        for i in 0..QK_K / 8 {
            let abs = _mm256_andnot_ps(sign, load(i));
            let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(abs, target));
            if hit != 0 {
                max = x[8 * i + hit.trailing_zeros() as usize];
                break;
            }
        }
        let iscale = -127.0 / max;
        let scale = _mm256_set1_ps(iscale);
        // Row `j`: the 8 groups of 4 quants of values 32 j .. 32 j + 32, in value order.
        let mut rows = [_mm256_setzero_si256(); 8];
        for (j, row) in rows.iter_mut().enumerate() {
            let q: [__m256i; 4] = std::array::from_fn(|k| {
                let t = _mm256_add_ps(_mm256_mul_ps(scale, load(4 * j + k)), round);
                let n = _mm256_sub_epi32(_mm256_and_si256(_mm256_castps_si256(t), mantissa), bias);
                // `as i8`: the low byte, sign-extended (only a scale that overflows to infinity
                // leaves the range of `i8` here).
                _mm256_srai_epi32::<24>(_mm256_slli_epi32::<24>(_mm256_min_epi32(n, top)))
            });
            // The sums of values 32 j .. + 16 and 32 j + 16 .. + 32 in lanes 0 and 1.
            let h = _mm256_hadd_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let h = _mm256_hadd_epi32(h, h);
            let s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
            // 16 values of magnitude ≤ 127: the sums fit in `i16`.
            block.bsums[2 * j] = _mm_cvtsi128_si32(s) as i16;
            block.bsums[2 * j + 1] = _mm_extract_epi32::<1>(s) as i16;
            block.sums32[j] = block.bsums[2 * j] + block.bsums[2 * j + 1];
            *row = super::pack_i8_avx2(q);
        }
        // Vector `t` of `qs` holds group `t` of every row: the transpose of rows × groups.
        let t: [__m256i; 8] = std::array::from_fn(|k| {
            let (a, b) = (rows[2 * (k / 2)], rows[2 * (k / 2) + 1]);
            if k % 2 == 0 {
                _mm256_unpacklo_epi32(a, b)
            } else {
                _mm256_unpackhi_epi32(a, b)
            }
        });
        let u: [__m256i; 8] = std::array::from_fn(|k| {
            // u[4h + 2p + e]: rows 4h .. 4h + 4, groups 2p + e (low lane) and 2p + e + 4 (high).
            let (h, p, e) = (k / 4, (k % 4) / 2, k % 2);
            let (a, b) = (t[4 * h + p], t[4 * h + p + 2]);
            if e == 0 {
                _mm256_unpacklo_epi64(a, b)
            } else {
                _mm256_unpackhi_epi64(a, b)
            }
        });
        for g in 0..8 {
            // Group g of rows 0 .. 4 and 4 .. 8: lane g / 4 of u[g % 4] and of u[4 + g % 4].
            let (a, b) = (u[g % 4], u[4 + g % 4]);
            let v = if g < 4 {
                _mm256_permute2x128_si256::<0x20>(a, b)
            } else {
                _mm256_permute2x128_si256::<0x31>(a, b)
            };
            // SAFETY: `qs` is 256 bytes; vector `g` is bytes 32 g .. 32 g + 32.
            unsafe { _mm256_storeu_si256(block.qs.as_mut_ptr().add(32 * g).cast(), v) };
        }
        block.d = 1.0 / iscale;
    }
}

/// [`quantize_row_q8_k`]'s arithmetic in loops the compiler vectorises: the largest magnitude first,
/// then the first value that has it; the quants in value order, their sums, and then the transpose
/// of 4-value groups into [`BlockQ8K`]'s order.
#[inline(always)]
fn quantize_blocks(x: &[f32], out: &mut [BlockQ8K]) {
    for (x, block) in x.chunks_exact(QK_K).zip(out) {
        let amax = x.iter().fold(0f32, |a, &v| a.max(v.abs()));
        if amax == 0.0 {
            *block = BlockQ8K::ZERO;
            continue;
        }
        // The first value of the largest magnitude (`amax` is the magnitude of one of them).
        let max = x.iter().copied().find(|v| v.abs() == amax).unwrap_or(amax);
        let iscale = -127.0 / max;
        let mut q = [0i8; QK_K];
        for (q, &v) in q.iter_mut().zip(x) {
            // nearest_int(iscale · v) ≥ -127 since |iscale · v| ≤ 127 up to rounding; min caps the
            // top.
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (sum, q) in block.bsums.iter_mut().zip(q.chunks_exact(16)) {
            // 16 values of magnitude ≤ 127: |sum| ≤ 2032.
            *sum = q.iter().map(|&q| i16::from(q)).sum();
        }
        for (j, sum) in block.sums32.iter_mut().enumerate() {
            *sum = block.bsums[2 * j] + block.bsums[2 * j + 1];
        }
        // Position 32 t + 4 j + b holds value 32 j + 4 t + b.
        for (t, vector) in block.qs.chunks_exact_mut(32).enumerate() {
            for (j, group) in vector.chunks_exact_mut(4).enumerate() {
                group.copy_from_slice(&q[32 * j + 4 * t..][..4]);
            }
        }
        block.d = 1.0 / iscale;
    }
}

impl BlockQ8K {
    /// The quant of value `v` (0..256).
    ///
    /// # Panics
    /// If `v >= 256`.
    pub fn quant(&self, v: usize) -> i8 {
        self.qs[q8k_position(v)]
    }

    /// Dequantises into `out` (256 long, value order): `d · q`.
    ///
    /// # Panics
    /// If `out.len() != 256`.
    pub fn dequantize(&self, out: &mut [f32]) {
        assert_eq!(out.len(), QK_K, "a Q8_K block holds 256 values");
        for (v, o) in out.iter_mut().enumerate() {
            *o = self.d * f32::from(self.quant(v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ggml's `quantize_row_q8_K_ref` as written there (one pass for the largest magnitude, then
    /// value by value), with the quants stored in [`BlockQ8K`]'s order.
    fn quantize_ref(x: &[f32], out: &mut [BlockQ8K]) {
        for (x, block) in x.chunks_exact(QK_K).zip(out) {
            let (mut max, mut amax) = (0f32, 0f32);
            for &v in x {
                if v.abs() > amax {
                    amax = v.abs();
                    max = v;
                }
            }
            if amax == 0.0 {
                *block = BlockQ8K::ZERO;
                continue;
            }
            let iscale = -127.0 / max;
            for (v, &x) in x.iter().enumerate() {
                block.qs[q8k_position(v)] = nearest_int(iscale * x).min(127) as i8;
            }
            for i in 0..QK_K / 16 {
                let sum = (16 * i..16 * i + 16)
                    .map(|v| i16::from(block.quant(v)))
                    .sum();
                block.bsums[i] = sum;
            }
            for j in 0..QK_K / 32 {
                let sum = (32 * j..32 * j + 32)
                    .map(|v| i16::from(block.quant(v)))
                    .sum();
                block.sums32[j] = sum;
            }
            block.d = 1.0 / iscale;
        }
    }

    #[test]
    fn q8_k_equals_the_reference_with_ties_zeros_and_nans() {
        let zero = BlockQ8K::ZERO;
        let mut x: Vec<f32> = (0..8 * QK_K)
            .map(|i| ((i * 2_654_435_761) % 1_000_003) as f32 / 1_000_003.0 - 0.5)
            .collect();
        // Block 1: a tie of opposite signs for the largest magnitude (the first one wins).
        x[QK_K + 17] = 3.0;
        x[QK_K + 200] = -3.0;
        // Block 2: the tie the other way round.
        x[2 * QK_K + 5] = -3.0;
        x[2 * QK_K + 6] = 3.0;
        // Block 3: zeros; block 4: a NaN among values; block 5: tiny values.
        x[3 * QK_K..4 * QK_K].fill(0.0);
        x[4 * QK_K + 9] = f32::NAN;
        for v in &mut x[5 * QK_K..6 * QK_K] {
            *v *= 1e-30;
        }
        let (mut want, mut got) = (vec![zero; 8], vec![zero; 8]);
        quantize_ref(&x, &mut want);
        quantize_row_q8_k(&x, &mut got);
        assert_eq!(got, want);
        quantize_blocks(&x, &mut got);
        assert_eq!(got, want);
    }

    /// The AVX2 quantisation gives the portable loop's blocks bit for bit: on random blocks of
    /// several magnitudes and on blocks holding zeros, NaN, infinities, ties for the largest
    /// magnitude and subnormal values.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_quantisation_equals_the_portable_loop() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            eprintln!("skipped: this CPU has no AVX2");
            return;
        }
        let specials = [
            0.0,
            -0.0,
            f32::NAN,
            f32::from_bits(0x7fc0_0005),
            f32::from_bits(0xff80_0001),
            f32::INFINITY,
            f32::NEG_INFINITY,
            3.0,
            -3.0,
            1e-39,
            -3e-39,
        ];
        let mut next = crate::formats::xorshift(0x9e37_79b9_7f4a_7c15);
        let mut x = crate::formats::quantiser_test_values(QK_K, &specials, 5, &mut next);
        // Ties of opposite signs for the largest magnitude, in one vector and in two, either way
        // round (the first one sets the scale's sign), and +∞ before -∞.
        for (first, second, a, b) in [
            (3.0f32, -3.0f32, 5, 6),
            (-3.0, 3.0, 5, 6),
            (3.0, -3.0, 17, 200),
            (-3.0, 3.0, 17, 200),
            (f32::INFINITY, f32::NEG_INFINITY, 40, 41),
        ] {
            let mut block: Vec<f32> = (0..QK_K).map(|_| next() - 0.5).collect();
            (block[a], block[b]) = (first, second);
            x.extend(block);
        }
        let mut portable = vec![BlockQ8K::ZERO; x.len() / QK_K];
        let mut avx2 = portable.clone();
        quantize_blocks(&x, &mut portable);
        // SAFETY: AVX2 was detected above.
        unsafe { quantize_avx2(&x, &mut avx2) };
        for (i, (p, a)) in portable.iter().zip(&avx2).enumerate() {
            let bits = |b: &BlockQ8K| (b.d.to_bits(), b.qs, b.bsums, b.sums32);
            assert_eq!(bits(p), bits(a), "block {i}");
        }
    }

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        assert_eq!(nearest_int(0.5), 0);
        assert_eq!(nearest_int(1.5), 2);
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(-0.5), 0);
        assert_eq!(nearest_int(-1.5), -2);
        assert_eq!(nearest_int(-126.7), -127);
        assert_eq!(nearest_int(126.49), 126);
    }

    #[test]
    fn q8_k_maps_the_extreme_value_to_minus_127_and_keeps_sums() {
        let x: Vec<f32> = (0..QK_K).map(|i| (i as f32 - 100.0) * 0.37).collect();
        let mut out = [BlockQ8K::ZERO];
        quantize_row_q8_k(&x, &mut out);
        let b = &out[0];
        // The largest magnitude is the last value (positive), so its quant is -127 and d < 0.
        assert_eq!(b.quant(QK_K - 1), -127);
        assert!(b.d < 0.0);
        let sum = |from: usize, n: usize| -> i32 {
            (from..from + n).map(|v| i32::from(b.quant(v))).sum()
        };
        for (i, s) in b.bsums.iter().enumerate() {
            assert_eq!(i32::from(*s), sum(16 * i, 16));
        }
        for (j, s) in b.sums32.iter().enumerate() {
            assert_eq!(i32::from(*s), sum(32 * j, 32));
        }
        for (i, &v) in x.iter().enumerate() {
            assert!((b.d * f32::from(b.quant(i)) - v).abs() <= b.d.abs() * 0.5 + 1e-5);
        }
        let mut back = [0f32; QK_K];
        b.dequantize(&mut back);
        for (i, &v) in back.iter().enumerate() {
            assert_eq!(v, b.d * f32::from(b.quant(i)));
        }
    }

    #[test]
    fn the_order_is_a_transpose_of_4_value_groups_with_one_sub_block_per_lane() {
        let mut seen = [false; QK_K];
        for i in 0..QK_K {
            let v = q8k_value(i);
            assert!(!seen[v], "value {v} twice");
            seen[v] = true;
            assert_eq!(q8k_position(v), i);
            // Groups of 4 consecutive values.
            assert_eq!(v % 4, i % 4);
            // Lane `j` of every vector holds Q4_K sub-block `j`; of vectors 0..4 Q6_K sub-block
            // `2 j`, of vectors 4..8 sub-block `2 j + 1`.
            let (t, j) = (i / 32, (i % 32) / 4);
            assert_eq!(v / 32, j, "position {i}");
            assert_eq!(v / 16, 2 * j + t / 4, "position {i}");
        }
    }

    #[test]
    fn q8_k_of_zeros_is_zero() {
        let mut out = [BlockQ8K {
            d: 1.0,
            qs: [1; QK_K],
            bsums: [1; 16],
            sums32: [1; 8],
        }];
        quantize_row_q8_k(&[0.0; QK_K], &mut out);
        assert_eq!(out[0].d, 0.0);
        assert_eq!(out[0], BlockQ8K::ZERO);
    }
}
