//! Q8_K: the activation format for K-quant dot products (256 values, f32 scale, 16-value sums).

use super::QK_K;

/// A Q8_K block, byte-identical to ggml's `block_q8_K` (292 bytes). Quants lie in `-127..=127`.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct BlockQ8K {
    /// Scale (negative when the largest-magnitude value is positive, as in ggml).
    pub d: f32,
    /// Quants, in value order.
    pub qs: [i8; QK_K],
    /// `bsums[i]` = sum of `qs[16 i .. 16 i + 16]`.
    pub bsums: [i16; QK_K / 16],
}

/// ggml's `nearest_int`: round to nearest, ties to even, through the float adder (valid for
/// `|x| ≤ 2^22`).
fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0; // 1.5 · 2^23: the sum's low mantissa bits are the rounded integer
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Quantises `x` (a multiple of 256 long) to Q8_K exactly as ggml's `quantize_row_q8_K_ref`: the value
/// of largest magnitude `max` (first one on ties) gives `iscale = -127 / max`, `q = min(127,
/// nearest_int(iscale · x))`, `d = 1 / iscale`; an all-zero block gets `d = 0`.
///
/// # Panics
/// If `out.len() * 256 != x.len()`.
pub fn quantize_row_q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    assert_eq!(out.len() * QK_K, x.len(), "one block per 256 values");
    for (x, block) in x.chunks_exact(QK_K).zip(out) {
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *block = BlockQ8K {
                d: 0.0,
                qs: [0; QK_K],
                bsums: [0; QK_K / 16],
            };
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in block.qs.iter_mut().zip(x) {
            // nearest_int(iscale · v) ≥ -127 since |iscale · v| ≤ 127 up to rounding; min caps the top.
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (sum, qs) in block.bsums.iter_mut().zip(block.qs.chunks_exact(16)) {
            // 16 values of magnitude ≤ 127: |sum| ≤ 2032.
            *sum = qs.iter().map(|&q| i16::from(q)).sum();
        }
        block.d = 1.0 / iscale;
    }
}

impl BlockQ8K {
    /// Dequantises into `out` (256 long): `d · q`.
    ///
    /// # Panics
    /// If `out.len() != 256`.
    pub fn dequantize(&self, out: &mut [f32]) {
        assert_eq!(out.len(), QK_K, "a Q8_K block holds 256 values");
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = self.d * f32::from(q);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let mut out = [BlockQ8K {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; 16],
        }];
        quantize_row_q8_k(&x, &mut out);
        let b = &out[0];
        // The largest magnitude is the last value (positive), so its quant is -127 and d < 0.
        assert_eq!(b.qs[QK_K - 1], -127);
        assert!(b.d < 0.0);
        for (i, s) in b.bsums.iter().enumerate() {
            assert_eq!(
                i32::from(*s),
                b.qs[16 * i..16 * i + 16]
                    .iter()
                    .map(|&q| i32::from(q))
                    .sum::<i32>()
            );
        }
        for (i, &v) in x.iter().enumerate() {
            assert!((b.d * f32::from(b.qs[i]) - v).abs() <= b.d.abs() * 0.5 + 1e-5);
        }
    }

    #[test]
    fn q8_k_of_zeros_is_zero() {
        let mut out = [BlockQ8K {
            d: 1.0,
            qs: [1; QK_K],
            bsums: [1; 16],
        }];
        quantize_row_q8_k(&[0.0; QK_K], &mut out);
        assert_eq!(out[0].d, 0.0);
        assert!(out[0].qs.iter().all(|&q| q == 0) && out[0].bsums.iter().all(|&s| s == 0));
    }
}
