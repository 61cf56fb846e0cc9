//! Q4_0: 32 values per block, `value = d · (q - 8)` with `q` a 4-bit quant.

use super::{
    dequantize_signed, dot_signed_q8_0, le_u16, ActQ8_0, BlockFormat, SignedBlock32, WeightBlock,
    QK8_0,
};
use crate::f16::F16;

/// A Q4_0 block, byte-identical to ggml's `block_q4_0` (18 bytes). Value `i < 16` is the low nibble of
/// `qs[i]`, value `i + 16` its high nibble.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ4_0 {
    /// Scale.
    pub d: F16,
    /// Nibbles: values 0..16 low, 16..32 high.
    pub qs: [u8; QK8_0 / 2],
}

impl BlockQ4_0 {
    /// The signed quants `q - 8` in value order.
    pub fn quants(&self) -> [i8; QK8_0] {
        std::array::from_fn(|p| {
            let nibble = if p < 16 {
                self.qs[p] & 0x0f
            } else {
                self.qs[p - 16] >> 4
            };
            nibble as i8 - 8
        })
    }
}

impl SignedBlock32 for BlockQ4_0 {
    fn scale(&self) -> F16 {
        self.d
    }

    fn signed_quants(&self) -> [i8; QK8_0] {
        self.quants()
    }
}

impl WeightBlock for BlockQ4_0 {
    const FORMAT: BlockFormat = BlockFormat::Q4_0;
    const VALUES: usize = QK8_0;
    const BYTES: usize = 18;

    fn read(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != Self::BYTES {
            return None;
        }
        Some(BlockQ4_0 {
            d: F16(le_u16(bytes, 0)),
            qs: std::array::from_fn(|i| bytes[2 + i]),
        })
    }

    fn write(&self, out: &mut [u8]) {
        assert_eq!(out.len(), Self::BYTES, "a Q4_0 block is 18 bytes");
        out[..2].copy_from_slice(&self.d.0.to_le_bytes());
        out[2..].copy_from_slice(&self.qs);
    }

    fn dequantize(&self, out: &mut [f32]) {
        dequantize_signed(self, out);
    }
}

/// Reference dot product of a Q4_0 weight row with a Q8_0 activation row (lane arithmetic as in
/// [`crate::formats`]).
///
/// # Panics
/// If the rows differ in length.
pub fn dot_q4_0_q8_0(w: &[BlockQ4_0], x: &[ActQ8_0]) -> f32 {
    dot_signed_q8_0(w, x)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::BlockQ4_0;
    use crate::formats::q8_0::avx2::Quants32;
    use std::arch::x86_64::*;

    pub(crate) struct Q4_0;

    impl Quants32 for Q4_0 {
        type Block = BlockQ4_0;

        /// The nibbles as they are (`q = nibble - 8`); a pair sum is at most 2 · 15 · 127.
        const OFFSET: i32 = 8;

        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn unpack(block: &BlockQ4_0) -> [__m256i; 2] {
            // SAFETY: `block.qs` is 16 bytes, one unaligned 128-bit load.
            let v = unsafe { _mm_loadu_si128(block.qs.as_ptr().cast()) };
            let low = _mm_set1_epi8(0x0f);
            let lo = _mm_and_si128(v, low);
            let hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
            [_mm256_set_m128i(hi, lo), _mm256_setzero_si256()]
        }
    }
}
