//! Q5_0: 32 values per block, `value = d · (q - 16)` with `q` a 5-bit quant (a nibble plus one high bit).

use super::{
    dequantize_signed, dot_signed_q8_0, le_u16, ActQ8_0, BlockFormat, SignedBlock32, WeightBlock,
    QK8_0,
};
use crate::f16::F16;

/// A Q5_0 block, byte-identical to ggml's `block_q5_0` (22 bytes). Value `i < 16` is the low nibble of
/// `qs[i]`, value `i + 16` its high nibble; bit `i` of the little-endian `qh` is value `i`'s fifth bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ5_0 {
    /// Scale.
    pub d: F16,
    /// The fifth bit of each value, little-endian.
    pub qh: [u8; 4],
    /// Nibbles: values 0..16 low, 16..32 high.
    pub qs: [u8; QK8_0 / 2],
}

impl BlockQ5_0 {
    /// The signed quants `q - 16` in value order (in `-16..=15`).
    pub fn quants(&self) -> [i8; QK8_0] {
        let qh = u32::from_le_bytes(self.qh);
        std::array::from_fn(|p| {
            let nibble = if p < 16 {
                self.qs[p] & 0x0f
            } else {
                self.qs[p - 16] >> 4
            };
            let high = ((qh >> p) & 1) as u8;
            (nibble | (high << 4)) as i8 - 16
        })
    }
}

impl SignedBlock32 for BlockQ5_0 {
    fn scale(&self) -> F16 {
        self.d
    }

    fn signed_quants(&self) -> [i8; QK8_0] {
        self.quants()
    }
}

impl WeightBlock for BlockQ5_0 {
    const FORMAT: BlockFormat = BlockFormat::Q5_0;
    const VALUES: usize = QK8_0;
    const BYTES: usize = 22;

    fn read(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != Self::BYTES {
            return None;
        }
        Some(BlockQ5_0 {
            d: F16(le_u16(bytes, 0)),
            qh: std::array::from_fn(|i| bytes[2 + i]),
            qs: std::array::from_fn(|i| bytes[6 + i]),
        })
    }

    fn write(&self, out: &mut [u8]) {
        assert_eq!(out.len(), Self::BYTES, "a Q5_0 block is 22 bytes");
        out[..2].copy_from_slice(&self.d.0.to_le_bytes());
        out[2..6].copy_from_slice(&self.qh);
        out[6..].copy_from_slice(&self.qs);
    }

    /// As ggml's `dequantize_row_q5_0`: `(q - 16) · d`.
    fn dequantize(&self, out: &mut [f32]) {
        dequantize_signed(self, out);
    }
}

/// Reference dot product of a Q5_0 weight row with a Q8_0 activation row (lane arithmetic as in
/// [`crate::formats`]).
///
/// # Panics
/// If the rows differ in length.
pub fn dot_q5_0_q8_0(w: &[BlockQ5_0], x: &[ActQ8_0]) -> f32 {
    dot_signed_q8_0(w, x)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::BlockQ5_0;
    use crate::formats::q8_0::avx2::Quants32;
    use std::arch::x86_64::*;

    pub(crate) struct Q5_0;

    impl Quants32 for Q5_0 {
        type Block = BlockQ5_0;

        /// The 5-bit quants as they are (`q = u - 16`); a pair sum is at most 2 · 31 · 127.
        const OFFSET: i32 = 16;

        /// Nibbles in value order, with `0x10` or-ed into every byte whose fifth bit is set.
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn unpack(block: &BlockQ5_0) -> [__m256i; 2] {
            // SAFETY: `block.qs` is 16 bytes, one unaligned 128-bit load.
            let v = unsafe { _mm_loadu_si128(block.qs.as_ptr().cast()) };
            let low = _mm_set1_epi8(0x0f);
            let lo = _mm_and_si128(v, low);
            let hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
            let nibbles = _mm256_set_m128i(hi, lo);
            // Byte `i` of the broadcast picks qh byte `i / 8`; or-ing every bit but `i % 8` and
            // comparing with all-ones tests bit `i`.
            let qh = i32::from_le_bytes(block.qh);
            let pick = _mm256_set_epi64x(
                0x0303_0303_0303_0303,
                0x0202_0202_0202_0202,
                0x0101_0101_0101_0101,
                0,
            );
            let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(qh), pick);
            let others = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
            let set = _mm256_cmpeq_epi8(_mm256_or_si256(bytes, others), _mm256_set1_epi8(-1));
            [
                _mm256_or_si256(nibbles, _mm256_and_si256(set, _mm256_set1_epi8(0x10))),
                _mm256_setzero_si256(),
            ]
        }
    }
}
