//! IEEE 754 binary16, the scale type of GGUF blocks.
//!
//! Only the two conversions the kernels need, written with integer bit manipulation so that they are
//! exact, branch-light and identical on every CPU level (no `half` crate, no F16C: the widening
//! conversion is exact anyway, so a hardware path could not change a result, only its cost).

/// An IEEE 754 half-precision number, stored as its bit pattern (little-endian in GGUF files).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct F16(pub u16);

impl F16 {
    /// Positive zero.
    pub const ZERO: F16 = F16(0);

    /// The exact `f32` value of this half (every f16 value, subnormals, infinities and NaNs included, is
    /// representable in f32; NaN payloads are kept).
    #[inline]
    pub fn to_f32(self) -> f32 {
        f16_to_f32(self.0)
    }

    /// The nearest half to `x`, ties to even (IEEE round-to-nearest); overflow gives ±infinity, NaN becomes
    /// the canonical NaN `0x7e00` (sign kept). This is ggml's scalar `GGML_FP32_TO_FP16`, so scales written here match llama.cpp's.
    #[inline]
    pub fn from_f32(x: f32) -> F16 {
        F16(f32_to_f16(x))
    }
}

/// Widens an f16 bit pattern to the exactly equal `f32`.
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x03ff);
    let bits = match exp {
        // Zero or subnormal: man · 2^-24, exact in f32 (man < 2^10, and the scale is a power of two).
        0 => (man as f32 * (1.0 / 16_777_216.0)).to_bits(),
        // Infinity or NaN: keep the payload in the top mantissa bits.
        0x1f => 0x7f80_0000 | (man << 13),
        // Normal: rebias the exponent from 15 to 127.
        _ => ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(sign | bits)
}

/// Narrows an `f32` to the nearest f16 bit pattern, ties to even.
///
/// The float-arithmetic trick of Maratyszcza's FP16 library (which ggml uses): scaling by 2^112 then
/// 2^-110 lets the FPU do the rounding, including into the subnormal range and to infinity.
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    let scale_to_inf = f32::from_bits(0x7780_0000); // 2^112
    let scale_to_zero = f32::from_bits(0x0880_0000); // 2^-110
    let mut base = (x.abs() * scale_to_inf) * scale_to_zero;
    let w = x.to_bits();
    let shl1_w = w.wrapping_add(w);
    let sign = w & 0x8000_0000;
    let bias = (shl1_w & 0xff00_0000).max(0x7100_0000);
    base += f32::from_bits((bias >> 1) + 0x0780_0000);
    let bits = base.to_bits();
    let exp_bits = (bits >> 13) & 0x0000_7c00;
    let mantissa_bits = bits & 0x0000_0fff;
    let nonsign = exp_bits + mantissa_bits;
    let out = (sign >> 16)
        | if shl1_w > 0xff00_0000 {
            0x7e00
        } else {
            nonsign
        };
    // Every branch above yields at most 16 significant bits (sign >> 16 ≤ 0x8000, nonsign ≤ 0x7c00 + 0xfff).
    out as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The textbook definition, in f64: (-1)^s · 2^(e-15) · (1 + m/1024), or 2^-14 · m/1024 when e = 0.
    fn reference(h: u16) -> f64 {
        let s = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
        let e = i32::from((h >> 10) & 0x1f);
        let m = f64::from(h & 0x3ff);
        match e {
            0 => s * m / 1024.0 * 2f64.powi(-14),
            31 if m == 0.0 => s * f64::INFINITY,
            31 => f64::NAN,
            _ => s * (1.0 + m / 1024.0) * 2f64.powi(e - 15),
        }
    }

    #[test]
    fn widening_is_exact_for_all_65536_halves() {
        for h in 0..=u16::MAX {
            let got = f16_to_f32(h);
            let want = reference(h);
            if want.is_nan() {
                // The payload is kept in the top mantissa bits (narrowing canonicalises NaNs, as ggml).
                let payload = u32::from(h & 0x3ff) << 13;
                assert_eq!(
                    got.to_bits(),
                    (u32::from(h & 0x8000) << 16) | 0x7f80_0000 | payload,
                    "{h:#06x}"
                );
            } else {
                assert_eq!(f64::from(got), want, "{h:#06x}");
                // -0.0 == 0.0 numerically; the sign bit must still be right.
                assert_eq!(got.is_sign_negative(), h & 0x8000 != 0, "{h:#06x}");
            }
        }
    }

    #[test]
    fn narrowing_round_trips_every_non_nan_half() {
        for h in 0..=u16::MAX {
            let x = f16_to_f32(h);
            if !x.is_nan() {
                assert_eq!(f32_to_f16(x), h, "{h:#06x}");
            }
        }
    }

    #[test]
    fn narrowing_rounds_to_nearest_even_between_every_pair_of_finite_halves() {
        // Positive finite halves 0x0000..0x7bff; the midpoint of neighbours has 12 significant bits, so it
        // is exact in f32, and just below/above it must round down/up.
        for h in 0..0x7bffu16 {
            let (lo, hi) = (f16_to_f32(h), f16_to_f32(h + 1));
            let mid = (f64::from(lo) + f64::from(hi)) / 2.0;
            let mid32 = mid as f32;
            assert_eq!(f64::from(mid32), mid);
            let even = if h % 2 == 0 { h } else { h + 1 };
            assert_eq!(f32_to_f16(mid32), even, "midpoint after {h:#06x}");
            assert_eq!(
                f32_to_f16(-mid32),
                even | 0x8000,
                "negative midpoint after {h:#06x}"
            );
            assert_eq!(f32_to_f16(f32::from_bits(mid32.to_bits() - 1)), h);
            assert_eq!(f32_to_f16(f32::from_bits(mid32.to_bits() + 1)), h + 1);
        }
    }

    #[test]
    fn narrowing_overflows_to_infinity_and_underflows_to_zero() {
        assert_eq!(f32_to_f16(65504.0), 0x7bff);
        assert_eq!(f32_to_f16(65519.99), 0x7bff);
        assert_eq!(f32_to_f16(65520.0), 0x7c00); // the midpoint to "65536" rounds to even = infinity
        assert_eq!(f32_to_f16(1e10), 0x7c00);
        assert_eq!(f32_to_f16(-1e10), 0xfc00);
        assert_eq!(f32_to_f16(f32::INFINITY), 0x7c00);
        assert_eq!(f32_to_f16(2f32.powi(-25)), 0); // half of the smallest subnormal: ties to even = 0
        assert_eq!(f32_to_f16(2f32.powi(-25) * 1.01), 1);
        assert_eq!(f32_to_f16(-0.0), 0x8000);
        assert!(f16_to_f32(f32_to_f16(f32::NAN)).is_nan());
    }
}
