//! Q8_0: 32 values per block, `value = d · q` with `q` an `i8` and `d` an f16 scale.

use super::{
    dequantize_signed, dot_signed_q8_0, le_u16, BlockFormat, SignedBlock32, WeightBlock, QK8_0,
};
use crate::f16::F16;

/// A Q8_0 block, byte-identical to ggml's `block_q8_0` (34 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ8_0 {
    /// Scale.
    pub d: F16,
    /// Quants, in value order.
    pub qs: [i8; QK8_0],
}

impl SignedBlock32 for BlockQ8_0 {
    fn scale(&self) -> F16 {
        self.d
    }

    fn signed_quants(&self) -> [i8; QK8_0] {
        self.qs
    }
}

impl WeightBlock for BlockQ8_0 {
    const FORMAT: BlockFormat = BlockFormat::Q8_0;
    const VALUES: usize = QK8_0;
    const BYTES: usize = 34;

    fn read(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != Self::BYTES {
            return None;
        }
        Some(BlockQ8_0 {
            d: F16(le_u16(bytes, 0)),
            qs: std::array::from_fn(|i| bytes[2 + i] as i8),
        })
    }

    fn write(&self, out: &mut [u8]) {
        assert_eq!(out.len(), Self::BYTES, "a Q8_0 block is 34 bytes");
        out[..2].copy_from_slice(&self.d.0.to_le_bytes());
        for (o, q) in out[2..].iter_mut().zip(self.qs) {
            *o = q as u8;
        }
    }

    fn dequantize(&self, out: &mut [f32]) {
        dequantize_signed(self, out);
    }
}

/// A Q8_0-quantised activation block: ggml's `block_q8_0` numbers (the scale is rounded to f16),
/// with the scale kept widened to `f32` so the hot loop need not convert it, and the sum of the
/// quants (what a kernel subtracts once per block for weights stored with an offset). Quants lie in
/// `-127..=127`, but for a block so small that the reciprocal of its scale overflows (its scale
/// then rounds to 0 as an f16, so its quants count for nothing): there they saturate, to -128 for a
/// negative value.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct ActQ8_0 {
    /// Scale: an f16 value, widened.
    pub d: f32,
    /// The sum of `qs`.
    pub sum: i32,
    /// Quants, in value order.
    pub qs: [i8; QK8_0],
}

impl ActQ8_0 {
    /// The equivalent ggml `block_q8_0` (exact: `d` is an f16 value).
    pub fn to_block(&self) -> BlockQ8_0 {
        BlockQ8_0 {
            d: F16::from_f32(self.d),
            qs: self.qs,
        }
    }
}

/// Quantises `x` (a multiple of 32 long) to Q8_0 activation blocks exactly as ggml's
/// `quantize_row_q8_0_ref`: `d = amax / 127` rounded to f16, `q = round(x / d)` (halves away from zero)
/// with the unrounded reciprocal.
///
/// # Panics
/// If `out.len() * 32 != x.len()`.
pub fn quantize_row_q8_0(x: &[f32], out: &mut [ActQ8_0]) {
    assert_eq!(out.len() * QK8_0, x.len(), "one block per 32 values");
    #[cfg(target_arch = "x86_64")]
    if crate::Kernels::get().level().has_avx2() {
        // SAFETY: levels with AVX2 are only chosen on CPUs with AVX2.
        unsafe { quantize_avx2(x, out) };
        return;
    }
    quantize_blocks(x, out);
}

/// [`quantize_blocks`] in 256-bit vectors, with the same quants and scales: the largest magnitude
/// (NaN ignored, as `f32::max` does) and the scale as there, then per value the same product and
/// rounding addend ([`round_to_i8`]'s, its sign taken from the value, as the product's sign is but
/// where the product is NaN, which becomes 0 anyway), the cast's saturation (NaN to 0, beyond the
/// `i8` range to its ends) done by a mask and a clamp before the truncating conversion.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_avx2(x: &[f32], out: &mut [ActQ8_0]) {
    use std::arch::x86_64::*;
    let sign = _mm256_set1_ps(-0.0);
    let half = _mm256_set1_ps(JUST_BELOW_HALF);
    let (lo, hi) = (_mm256_set1_ps(-128.0), _mm256_set1_ps(127.0));
    for (x, block) in x.chunks_exact(QK8_0).zip(out) {
        // SAFETY: `x` holds 32 values, four vectors of 8.
        let v: [__m256; 4] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(x[8 * i..].as_ptr()) });
        let mut m = _mm256_setzero_ps();
        for &v in &v {
            // The second operand where either is NaN: a NaN value leaves the maximum as it was.
            m = _mm256_max_ps(_mm256_andnot_ps(sign, v), m);
        }
        let amax = super::hmax_avx2(m);
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        block.d = F16::from_f32(d).to_f32();
        let idv = _mm256_set1_ps(id);
        let q: [__m256i; 4] = std::array::from_fn(|i| {
            let r = _mm256_add_ps(
                _mm256_mul_ps(v[i], idv),
                _mm256_or_ps(half, _mm256_and_ps(sign, v[i])),
            );
            // NaN to 0, then the range of `i8`, then truncation toward zero.
            let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(r, r));
            _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
        });
        let total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let t4 = _mm_add_epi32(
            _mm256_castsi256_si128(total),
            _mm256_extracti128_si256::<1>(total),
        );
        let t2 = _mm_add_epi32(t4, _mm_unpackhi_epi64(t4, t4));
        let t1 = _mm_add_epi32(t2, _mm_shuffle_epi32::<0b01>(t2));
        block.sum = _mm_cvtsi128_si32(t1);
        let bytes = super::pack_i8_avx2(q);
        // SAFETY: `qs` is 32 bytes.
        unsafe { _mm256_storeu_si256(block.qs.as_mut_ptr().cast(), bytes) };
    }
}

/// [`quantize_row_q8_0`]'s arithmetic in loops the compiler vectorises.
#[inline(always)]
fn quantize_blocks(x: &[f32], out: &mut [ActQ8_0]) {
    for (x, block) in x.chunks_exact(QK8_0).zip(out) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        block.d = F16::from_f32(d).to_f32();
        for (q, &v) in block.qs.iter_mut().zip(x) {
            // |v · id| ≤ 127 (up to rounding of id, which rounding absorbs), so the cast cannot
            // saturate, but where `1 / d` overflows (the f16 scale is then 0).
            *q = round_to_i8(v * id);
        }
        block.sum = block.qs.iter().map(|&q| i32::from(q)).sum();
    }
}

/// `v.round() as i8` (halves away from zero): a truncating cast of `v` plus the float just below ½
/// with `v`'s sign. Exact (the sum rounds up to the next integer exactly where `v`'s fraction is ½ or
/// more), and unlike `round()`, which calls `libm`'s `roundf` value by value, it vectorises.
#[inline]
fn round_to_i8(v: f32) -> i8 {
    (v + JUST_BELOW_HALF.copysign(v)) as i8
}

/// The largest `f32` below ½ ([`round_to_i8`]).
const JUST_BELOW_HALF: f32 = 0.499_999_97;

/// Reference dot product of a Q8_0 weight row with a Q8_0 activation row (see the module docs of
/// [`crate::formats`] for the lane arithmetic every kernel reproduces).
///
/// # Panics
/// If the rows differ in length.
pub fn dot_q8_0_q8_0(w: &[BlockQ8_0], x: &[ActQ8_0]) -> f32 {
    dot_signed_q8_0(w, x)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::BlockQ8_0;
    use crate::formats::SignedBlock32;
    use std::arch::x86_64::*;

    /// The AVX2 half of a 32-value format (Q8_0, Q4_0, Q5_0): a block's quants in registers, and the
    /// `i16` pair sums of their products with 32 activation quants. The kernel
    /// ([`crate::simd::avx2::pass32`]) does the rest, the same for all of them.
    pub(crate) trait Quants32 {
        /// The weight block.
        type Block: SignedBlock32;

        /// The quants are stored as `u = q + OFFSET` (`u` unsigned); 0 for signed quants.
        const OFFSET: i32;

        /// The quants in value order: `u` as unsigned bytes, or for `OFFSET == 0` the signed quants
        /// in `[0]` and their magnitudes in `[1]`.
        ///
        /// # Safety
        /// The CPU must support AVX2.
        unsafe fn unpack(block: &Self::Block) -> [__m256i; 2];

        /// The 16 `i16` sums `u[2i] · y[2i] + u[2i + 1] · y[2i + 1]` (or with `q` for signed quants),
        /// exact for activation quants in `-127..=127`.
        ///
        /// # Safety
        /// The CPU must support AVX2.
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn pairs(w: &[__m256i; 2], y: __m256i) -> __m256i {
            _mm256_maddubs_epi16(w[0], y)
        }

        /// The 8 `i32` sums of 4 products, bytes `4j .. 4j + 4` in lane `j`: [`Quants32::pairs`]
        /// summed by `madd`.
        ///
        /// # Safety
        /// The CPU must support AVX2.
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn quads(w: &[__m256i; 2], y: __m256i) -> __m256i {
            // SAFETY: the caller's contract.
            _mm256_madd_epi16(unsafe { Self::pairs(w, y) }, _mm256_set1_epi16(1))
        }

        /// [`Quants32::quads`] in one `vpdpbusd` (the same integers). The default reads `w[0]` as
        /// unsigned quants, so a signed format (`OFFSET == 0`) must override it, as Q8_0 does.
        ///
        /// # Safety
        /// The CPU must support AVX2, F16C, FMA, AVX512F, AVX512VL and AVX512_VNNI.
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni")]
        unsafe fn quads_vnni(w: &[__m256i; 2], y: __m256i) -> __m256i {
            const { assert!(Self::OFFSET != 0, "signed quants need their own quads_vnni") };
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[0], y)
        }
    }

    pub(crate) struct Q8_0;

    impl Quants32 for Q8_0 {
        type Block = BlockQ8_0;

        const OFFSET: i32 = 0;

        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn unpack(block: &BlockQ8_0) -> [__m256i; 2] {
            // SAFETY: `block.qs` is 32 bytes, one unaligned 256-bit load.
            let w = unsafe { _mm256_loadu_si256(block.qs.as_ptr().cast()) };
            [w, _mm256_sign_epi8(w, w)]
        }

        /// `maddubs(|w|, sign(y, w))`: `|w| ≤ 128` and `|y| ≤ 127`, so a pair sum stays below
        /// `i16::MAX`; `y` is never -128, so `sign` cannot overflow.
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn pairs(w: &[__m256i; 2], y: __m256i) -> __m256i {
            _mm256_maddubs_epi16(w[1], _mm256_sign_epi8(y, w[0]))
        }

        /// `vpdpbusd(|w|, sign(y, w))`, as [`Quants32::pairs`].
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni")]
        unsafe fn quads_vnni(w: &[__m256i; 2], y: __m256i) -> __m256i {
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[1], _mm256_sign_epi8(y, w[0]))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::round_to_i8;

    /// The AVX2 quantisation gives the portable loop's blocks bit for bit: on random rows of
    /// several magnitudes; on blocks holding zeros, NaN, infinities and magnitudes so small that
    /// the reciprocal scale overflows, each alone, at one place among tiny values and at every
    /// third among ordinary ones; and on a block of scale 1 whose values are halves and their
    /// neighbouring floats.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_quantisation_equals_the_portable_loop() {
        use super::{quantize_blocks, ActQ8_0};
        if !std::arch::is_x86_feature_detected!("avx2") {
            eprintln!("skipped: this CPU has no AVX2");
            return;
        }
        let specials = [
            0.0,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.5,
            -0.5,
            127.0,
            -127.0,
            1e-39,
            -3e-39,
            f32::MIN_POSITIVE,
        ];
        let mut next = crate::formats::xorshift(0x2545_f491_4f6c_dd1d);
        let mut x = crate::formats::quantiser_test_values(32, &specials, 3, &mut next);
        // Scale 1 (127 is the largest magnitude): the halves round away from zero, and their
        // neighbouring floats to the nearer integer.
        let mut halves = vec![127.0f32];
        for k in [0.5f32, 1.5, 2.5, 63.5, 126.5] {
            for v in [k, -k] {
                halves.extend([
                    v,
                    f32::from_bits(v.to_bits() + 1),
                    f32::from_bits(v.to_bits() - 1),
                ]);
            }
        }
        halves.resize(32, 0.0);
        x.extend(halves);
        let zero = ActQ8_0 {
            d: 0.0,
            sum: 0,
            qs: [0; 32],
        };
        let mut portable = vec![zero; x.len() / 32];
        let mut avx2 = portable.clone();
        quantize_blocks(&x, &mut portable);
        // SAFETY: AVX2 was detected above.
        unsafe { super::quantize_avx2(&x, &mut avx2) };
        for (i, (p, a)) in portable.iter().zip(&avx2).enumerate() {
            assert_eq!(
                (p.d.to_bits(), p.sum, p.qs),
                (a.d.to_bits(), a.sum, a.qs),
                "block {i}"
            );
        }
    }

    /// The vectorisable rounding equals `round()`: at every half and its neighbouring floats, and on
    /// a sweep through the bit patterns of every float of magnitude up to 127.
    #[test]
    fn rounding_equals_round() {
        let check = |v: f32| assert_eq!(round_to_i8(v), v.round() as i8, "{v:e}");
        for k in -127..127 {
            let half = k as f32 + 0.5;
            check(half);
            check(f32::from_bits(half.to_bits() + 1));
            check(f32::from_bits(half.to_bits() - 1));
        }
        let top = 127f32.to_bits();
        for bits in (0..=top).step_by(101) {
            check(f32::from_bits(bits));
            check(-f32::from_bits(bits));
        }
    }
}
