//! Q6_K: 256 values in 16 sub-blocks of 16 with `i8` scales; `value = d · sc[p / 16] · (q - 32)` with `q`
//! a 6-bit quant.

use super::{hsum8, le_u16, q8k_value, BlockFormat, BlockQ8K, WeightBlock, QK_K};
use crate::f16::F16;

/// A Q6_K block, byte-identical to ggml's `block_q6_K` (210 bytes).
///
/// In each half `h` of 128 values, value `32 g + l` (g in 0..4, l in 0..32) has its low 4 bits in
/// `ql[64 h + l + 32 (g % 2)]` (low nibble for g < 2, high nibble otherwise) and its high 2 bits at bit
/// `2 g` of `qh[32 h + l]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ6K {
    /// Low 4 bits of the quants.
    pub ql: [u8; QK_K / 2],
    /// High 2 bits of the quants.
    pub qh: [u8; QK_K / 4],
    /// Scales of the 16 sub-blocks.
    pub scales: [i8; QK_K / 16],
    /// Super-block scale.
    pub d: F16,
}

impl BlockQ6K {
    /// The unsigned 6-bit quants (0..64, before the offset of 32), in value order.
    pub fn quants(&self) -> [u8; QK_K] {
        std::array::from_fn(|p| {
            let (h, g, l) = (p / 128, (p % 128) / 32, p % 32);
            let low = self.ql[64 * h + l + 32 * (g % 2)] >> (4 * (g / 2)) & 0x0f;
            let high = (self.qh[32 * h + l] >> (2 * g)) & 3;
            low | (high << 4)
        })
    }
}

impl WeightBlock for BlockQ6K {
    const FORMAT: BlockFormat = BlockFormat::Q6K;
    const VALUES: usize = QK_K;
    const BYTES: usize = 210;

    fn read(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != Self::BYTES {
            return None;
        }
        Some(BlockQ6K {
            ql: std::array::from_fn(|i| bytes[i]),
            qh: std::array::from_fn(|i| bytes[128 + i]),
            scales: std::array::from_fn(|i| bytes[192 + i] as i8),
            d: F16(le_u16(bytes, 208)),
        })
    }

    fn write(&self, out: &mut [u8]) {
        assert_eq!(out.len(), Self::BYTES, "a Q6_K block is 210 bytes");
        out[..128].copy_from_slice(&self.ql);
        out[128..192].copy_from_slice(&self.qh);
        for (o, s) in out[192..208].iter_mut().zip(self.scales) {
            *o = s as u8;
        }
        out[208..].copy_from_slice(&self.d.0.to_le_bytes());
    }

    /// As ggml's `dequantize_row_q6_K`: `(d · sc) · (q - 32)`.
    fn dequantize(&self, out: &mut [f32]) {
        assert_eq!(out.len(), QK_K, "a Q6_K block holds 256 values");
        let d = self.d.to_f32();
        for (p, (o, q)) in out.iter_mut().zip(self.quants()).enumerate() {
            *o = d * f32::from(self.scales[p / 16]) * f32::from(q as i8 - 32);
        }
    }
}

/// Reference dot product of a Q6_K weight row with a Q8_K activation row.
///
/// Per block, exactly in `i32`: lane `j` sums `sc[v / 16] · q · y` (unsigned `q` of value `v`) over the
/// activation positions `32 t + 4 j .. + 4` of every vector `t` of [`BlockQ8K`]'s order, minus `32 ·
/// (sc[2j] · bsums[2j] + sc[2j+1] · bsums[2j+1])` (the offset of 32, via the activation sums); then
/// `acc[j] = fma(lane[j], d · dy, acc[j])` (`fma(a, b, c) = a · b + c` rounded once), and [`hsum8`] at
/// the end.
///
/// # Panics
/// If the rows differ in length.
pub fn dot_q6_k_q8_k(w: &[BlockQ6K], x: &[BlockQ8K]) -> f32 {
    assert_eq!(w.len(), x.len(), "rows must have the same number of blocks");
    let mut acc = [0f32; 8];
    for (wb, xb) in w.iter().zip(x) {
        let q = wb.quants();
        let sc = wb.scales.map(i32::from);
        let mut lanes = [0i32; 8];
        for (i, &y) in xb.qs.iter().enumerate() {
            let v = q8k_value(i);
            lanes[(i % 32) / 4] += sc[v / 16] * i32::from(q[v]) * i32::from(y);
        }
        for (j, lane) in lanes.iter_mut().enumerate() {
            let offset = sc[2 * j] * i32::from(xb.bsums[2 * j])
                + sc[2 * j + 1] * i32::from(xb.bsums[2 * j + 1]);
            *lane -= 32 * offset;
        }
        let dd = wb.d.to_f32() * xb.d;
        for (a, lane) in acc.iter_mut().zip(lanes) {
            *a = (lane as f32).mul_add(dd, *a);
        }
    }
    hsum8(acc)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::{BlockQ6K, BlockQ8K};
    use crate::simd::avx2::{
        f16_to_f32, paired_lanes, paired_lanes_vnni, pick_i16, shuffle, Dequantizer,
    };
    use std::arch::x86_64::*;

    pub(crate) struct Q6K;

    /// Lane `j` of half `h` of pair `p` (groups `g`, `g + 2`) holds 16-value sub-block `2 (g + 2s) + h`,
    /// `s = j / 2`. From `i16` scales 0..8 in both halves for pairs 0 and 1 (`g` = 0, 1), and from
    /// scales 8..16 for pairs 2 and 3 (`g` = 4, 5) with the same controls.
    const PICK: [[u8; 32]; 2] = {
        const fn pair(g: u8) -> [u8; 32] {
            let (a, b) = (2 * g, 2 * g + 4);
            pick_i16(
                [a, a, a, a, b, b, b, b],
                [a + 1, a + 1, a + 1, a + 1, b + 1, b + 1, b + 1, b + 1],
            )
        }
        [pair(0), pair(1)]
    };

    pub(crate) struct Unpacked {
        /// The unsigned 6-bit quants in [`BlockQ8K`]'s order: vectors `2p`, `2p + 1` of pair `p`.
        q: [__m256i; 8],
        /// Pair `p`'s scales: `i16` lanes `2j`, `2j + 1` hold the scale of the sub-block in lane `j`.
        sc: [__m256i; 4],
        /// The 16 scales times 32 (the quants' offset) as `i16`.
        offset_scales: __m256i,
        /// The super-block scale, broadcast.
        d: __m256,
    }

    impl Dequantizer for Q6K {
        type Block = BlockQ6K;
        type Act = BlockQ8K;
        type Unpacked = Unpacked;

        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn unpack(block: &BlockQ6K) -> Unpacked {
            let low = _mm256_set1_epi8(0x0f);
            let high = _mm256_set1_epi8(0x30);
            // Values `32 g .. 32 g + 32` in `v[g]`.
            let mut v = [_mm256_setzero_si256(); 8];
            for h in 0..2 {
                // SAFETY: `ql` is 128 bytes and `qh` 64; offsets 64h + 32 + 32 ≤ 128 and 32h + 32 ≤ 64.
                let (qla, qlb, qh) = unsafe {
                    (
                        _mm256_loadu_si256(block.ql.as_ptr().add(64 * h).cast()),
                        _mm256_loadu_si256(block.ql.as_ptr().add(64 * h + 32).cast()),
                        _mm256_loadu_si256(block.qh.as_ptr().add(32 * h).cast()),
                    )
                };
                // Bits 2g, 2g + 1 of `qh` move to bits 4, 5; bits shifted across a byte are masked off.
                v[4 * h] = _mm256_or_si256(
                    _mm256_and_si256(qla, low),
                    _mm256_and_si256(_mm256_slli_epi16(qh, 4), high),
                );
                v[4 * h + 1] = _mm256_or_si256(
                    _mm256_and_si256(qlb, low),
                    _mm256_and_si256(_mm256_slli_epi16(qh, 2), high),
                );
                v[4 * h + 2] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(qla, 4), low),
                    _mm256_and_si256(qh, high),
                );
                v[4 * h + 3] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(qlb, 4), low),
                    _mm256_and_si256(_mm256_srli_epi16(qh, 2), high),
                );
            }
            // SAFETY: `scales` is 16 bytes, one unaligned 128-bit load.
            let scales =
                _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(block.scales.as_ptr().cast()) });
            // Groups `g` and `g + 2` (g = 0, 1, 4, 5) word by word into pair `p`: 8-byte word `2h + s`
            // of either vector is half `h` of group `g + 2s`.
            let q = [
                _mm256_unpacklo_epi64(v[0], v[2]),
                _mm256_unpackhi_epi64(v[0], v[2]),
                _mm256_unpacklo_epi64(v[1], v[3]),
                _mm256_unpackhi_epi64(v[1], v[3]),
                _mm256_unpacklo_epi64(v[4], v[6]),
                _mm256_unpackhi_epi64(v[4], v[6]),
                _mm256_unpacklo_epi64(v[5], v[7]),
                _mm256_unpackhi_epi64(v[5], v[7]),
            ];
            let first = _mm256_permute2x128_si256(scales, scales, 0x00);
            let second = _mm256_permute2x128_si256(scales, scales, 0x11);
            let sc = [
                shuffle(first, &PICK[0]),
                shuffle(first, &PICK[1]),
                shuffle(second, &PICK[0]),
                shuffle(second, &PICK[1]),
            ];
            Unpacked {
                q,
                sc,
                // |32 · scale| ≤ 4096 fits an `i16`.
                offset_scales: _mm256_slli_epi16(scales, 5),
                d: _mm256_set1_ps(f16_to_f32(block.d)),
            }
        }

        /// Exact integer lanes: the `i16` sums of 4 products are ≤ 4 · 63 · 127 = 32004 < 2^15, a
        /// lane's total is ≤ 128 · 32 · 63 · 127 < 2^31, and the offset term ≤ 32 · 2 · 128 · 2032.
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn accumulate(w: &Unpacked, x: &BlockQ8K, acc: __m256) -> __m256 {
            let mut acc = [acc];
            // SAFETY: AVX2 support is the caller's contract.
            unsafe { Self::accumulate_rows::<1>(w, [x], &mut acc) };
            acc[0]
        }

        /// Pair by pair through [`paired_lanes`], then each row's float arithmetic.
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn accumulate_rows<const R: usize>(
            w: &Unpacked,
            x: [&BlockQ8K; R],
            acc: &mut [__m256],
        ) {
            finish(w, paired_lanes(&w.q, &w.sc, x), x, acc);
        }

        /// Pair by pair through [`paired_lanes_vnni`], then the float arithmetic of
        /// [`Dequantizer::accumulate_rows`].
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni")]
        unsafe fn accumulate_rows_vnni<const R: usize>(
            w: &Unpacked,
            x: [&BlockQ8K; R],
            acc: &mut [__m256],
        ) {
            finish(w, paired_lanes_vnni(&w.q, &w.sc, x), x, acc);
        }
    }

    /// Each row's integer lanes `l` less the offset of 32 in the quants, then its float arithmetic in
    /// one fused multiply-add, as the reference.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn finish<const R: usize>(
        w: &Unpacked,
        lanes: [__m256i; R],
        x: [&BlockQ8K; R],
        acc: &mut [__m256],
    ) {
        for ((a, l), x) in acc.iter_mut().zip(lanes).zip(x) {
            // SAFETY: `x.bsums` is 16 `i16`, 32 bytes.
            let bsums = unsafe { _mm256_loadu_si256(x.bsums.as_ptr().cast()) };
            let l = _mm256_sub_epi32(l, _mm256_madd_epi16(w.offset_scales, bsums));
            let dd = _mm256_mul_ps(w.d, _mm256_broadcast_ss(&x.d));
            *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l), dd, *a);
        }
    }
}
