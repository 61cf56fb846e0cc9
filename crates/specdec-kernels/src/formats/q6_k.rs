//! Q6_K: 256 values in 16 sub-blocks of 16 with `i8` scales; `value = d · sc[p / 16] · (q - 32)` with `q`
//! a 6-bit quant.

use super::{
    bytes, hsum8, le_u16, q8k_position, q8k_value, words, BlockFormat, BlockQ8K, WeightBlock, QK_K,
};
use crate::f16::F16;

/// A Q6_K block: the fields and size of ggml's `block_q6_K` (210 bytes), with the quants in the
/// kernels' order.
///
/// In ggml's layout, in each half `h` of 128 values, value `32 g + l` (g in 0..4, l in 0..32) has its
/// low 4 bits in `ql[64 h + l + 32 (g % 2)]` (low nibble for g < 2, high nibble otherwise) and its
/// high 2 bits at bit `2 g` of `qh[32 h + l]`. Here the bits of value `p` in that layout hold the
/// quant of value [`q8k_value`]`(p)`: [`BlockQ8K`]'s order, a transpose of 4-value groups, so that
/// ggml's unpacking yields the 8 vectors of that order. [`WeightBlock::read`] and
/// [`WeightBlock::write`] convert from and to ggml's layout (the transpose is its own inverse); the
/// block stays the file's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ6K {
    /// Low 4 bits of the quants, in the kernels' order (not the file's: build blocks from a file's
    /// bytes with [`WeightBlock::read`]).
    pub ql: [u8; QK_K / 2],
    /// High 2 bits of the quants, in the same order.
    pub qh: [u8; QK_K / 4],
    /// Scales of the 16 sub-blocks.
    pub scales: [i8; QK_K / 16],
    /// Super-block scale.
    pub d: F16,
}

impl BlockQ6K {
    /// A block from its unsigned 6-bit quants in value order (each below 64), sub-block scales and
    /// super-block scale: the inverse of [`BlockQ6K::quants`].
    pub fn from_quants(quants: &[u8; QK_K], scales: [i8; QK_K / 16], d: F16) -> BlockQ6K {
        let (mut ql, mut qh) = ([0u8; QK_K / 2], [0u8; QK_K / 4]);
        for (v, &q) in quants.iter().enumerate() {
            let p = q8k_position(v);
            let (h, g, l) = (p / 128, (p % 128) / 32, p % 32);
            ql[64 * h + l + 32 * (g % 2)] |= (q & 0x0f) << (4 * (g / 2));
            qh[32 * h + l] |= ((q >> 4) & 3) << (2 * g);
        }
        BlockQ6K { ql, qh, scales, d }
    }

    /// The unsigned 6-bit quants (0..64, before the offset of 32), in value order.
    pub fn quants(&self) -> [u8; QK_K] {
        std::array::from_fn(|v| {
            let p = q8k_position(v);
            let (h, g, l) = (p / 128, (p % 128) / 32, p % 32);
            let low = self.ql[64 * h + l + 32 * (g % 2)] >> (4 * (g / 2)) & 0x0f;
            let high = (self.qh[32 * h + l] >> (2 * g)) & 3;
            low | (high << 4)
        })
    }
}

/// The quants of a Q6_K block (ggml's layout, see [`BlockQ6K`]) with the 8 × 8 matrix of 4-value
/// groups transposed: group `(a, b)` (values `32 a + 4 b .. + 4`) moves to `(b, a)`. Its own inverse.
fn transpose_groups(ql: &[u8; QK_K / 2], qh: &[u8; QK_K / 4]) -> ([u8; QK_K / 2], [u8; QK_K / 4]) {
    let ql: [u32; 32] = words(ql);
    let qh: [u32; 16] = words(qh);
    let (mut out_ql, mut out_qh) = ([0u32; 32], [0u32; 16]);
    // Group (a, b), values `32 a + 4 b ..`, keeps its low bits in word `16 h + 8 (g % 2) + b` of `ql`
    // at shift `4 (g / 2)` and its high bits in word `8 h + b` of `qh` at shift `2 g`, with
    // `(h, g) = (a / 4, a % 4)`.
    for a in 0..8 {
        let (h, g) = (a / 4, a % 4);
        for b in 0..8 {
            let (h2, g2) = (b / 4, b % 4);
            let low = (ql[16 * h + 8 * (g % 2) + b] >> (4 * (g / 2))) & 0x0f0f_0f0f;
            let high = (qh[8 * h + b] >> (2 * g)) & 0x0303_0303;
            out_ql[16 * h2 + 8 * (g2 % 2) + a] |= low << (4 * (g2 / 2));
            out_qh[8 * h2 + a] |= high << (2 * g2);
        }
    }
    (bytes(&out_ql), bytes(&out_qh))
}

impl WeightBlock for BlockQ6K {
    const FORMAT: BlockFormat = BlockFormat::Q6K;
    const VALUES: usize = QK_K;
    const BYTES: usize = 210;

    fn read(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != Self::BYTES {
            return None;
        }
        let (ql, qh) = transpose_groups(
            &std::array::from_fn(|i| bytes[i]),
            &std::array::from_fn(|i| bytes[128 + i]),
        );
        Some(BlockQ6K {
            ql,
            qh,
            scales: std::array::from_fn(|i| bytes[192 + i] as i8),
            d: F16(le_u16(bytes, 208)),
        })
    }

    fn write(&self, out: &mut [u8]) {
        assert_eq!(out.len(), Self::BYTES, "a Q6_K block is 210 bytes");
        let (ql, qh) = transpose_groups(&self.ql, &self.qh);
        out[..128].copy_from_slice(&ql);
        out[128..192].copy_from_slice(&qh);
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
        f16_to_f32, half_sums_vnni, paired_lanes, pick_i16, shuffle, Dequantizer,
    };
    use std::arch::x86_64::*;

    pub(crate) struct Q6K;

    /// 4-byte lane `j` of vectors 0..4 holds 16-value sub-block `2 j`, of vectors 4..8 sub-block
    /// `2 j + 1`: their scales in both `i16` halves of the lane, from `i16` scales 0..8 in the low
    /// half of the source and 8..16 in the high half.
    const PICK: [[u8; 32]; 2] = {
        const fn sub_blocks(first: u8) -> [u8; 32] {
            let (a, b, c, d) = (first, first + 2, first + 4, first + 6);
            let lanes = [a, a, b, b, c, c, d, d];
            pick_i16(lanes, lanes)
        }
        [sub_blocks(0), sub_blocks(1)]
    };

    pub(crate) struct Unpacked {
        /// The unsigned 6-bit quants: the 8 vectors of [`BlockQ8K`]'s order.
        q: [__m256i; 8],
        /// The scales of vectors 0..4 and of vectors 4..8: `i16` lanes `2j`, `2j + 1` hold the scale of
        /// the sub-block in lane `j` ([`PICK`]).
        sc: [__m256i; 2],
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
            // ggml's unpacking: "values" `32 g .. 32 g + 32` of the layout, so vector `g` of the order,
            // in `q[g]`.
            let mut q = [_mm256_setzero_si256(); 8];
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
                q[4 * h] = _mm256_or_si256(
                    _mm256_and_si256(qla, low),
                    _mm256_and_si256(_mm256_slli_epi16(qh, 4), high),
                );
                q[4 * h + 1] = _mm256_or_si256(
                    _mm256_and_si256(qlb, low),
                    _mm256_and_si256(_mm256_slli_epi16(qh, 2), high),
                );
                q[4 * h + 2] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(qla, 4), low),
                    _mm256_and_si256(qh, high),
                );
                q[4 * h + 3] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(qlb, 4), low),
                    _mm256_and_si256(_mm256_srli_epi16(qh, 2), high),
                );
            }
            // SAFETY: `scales` is 16 bytes, one unaligned 128-bit load.
            let scales =
                _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(block.scales.as_ptr().cast()) });
            let sc = [shuffle(scales, &PICK[0]), shuffle(scales, &PICK[1])];
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

        /// The scales as [`chained_lanes_vnni`] takes them: `i32` lane `j` of `sc[h]` holds the
        /// scale of sub-block `2 j + h`.
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn unpack_vnni(block: &BlockQ6K) -> Unpacked {
            // SAFETY: AVX2 support is the caller's contract.
            let mut u = unsafe { Self::unpack(block) };
            // SAFETY: `scales` is 16 bytes, one unaligned 128-bit load.
            let scales = unsafe { _mm_loadu_si128(block.scales.as_ptr().cast()) };
            // The even scales in bytes 0..8, the odd ones in bytes 8..16.
            let split = _mm_shuffle_epi8(
                scales,
                _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15),
            );
            u.sc = [
                _mm256_cvtepi8_epi32(split),
                _mm256_cvtepi8_epi32(_mm_srli_si128(split, 8)),
            ];
            u
        }

        /// Through [`chained_lanes_vnni`], then the float arithmetic of
        /// [`Dequantizer::accumulate_rows`].
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni")]
        unsafe fn accumulate_rows_vnni<const R: usize>(
            w: &Unpacked,
            x: [&BlockQ8K; R],
            acc: &mut [__m256],
        ) {
            finish(w, chained_lanes_vnni(&w.q, &w.sc, x), x, acc);
        }
    }

    /// [`paired_lanes`] with `vpdpbusd`: per row, the 4 vectors whose lanes hold the even
    /// sub-blocks summed exactly in `i32` (at most 16 · 63 · 127 = 128016 a lane), and the 4 of the
    /// odd ones, each multiplied by its sub-blocks' scales (`sc`, as [`Q6K::unpack_vnni`] leaves
    /// them) in `i32`: the same integers in 12 vector instructions per row instead of 16.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni")]
    fn chained_lanes_vnni<const R: usize>(
        q: &[__m256i; 8],
        sc: &[__m256i; 2],
        x: [&BlockQ8K; R],
    ) -> [__m256i; R] {
        // A loop, not `map`: a closure would not inline the VNNI function.
        let mut lanes = [_mm256_setzero_si256(); R];
        for (l, x) in lanes.iter_mut().zip(x) {
            let (a, b) = half_sums_vnni(q, x);
            *l = _mm256_add_epi32(_mm256_mullo_epi32(a, sc[0]), _mm256_mullo_epi32(b, sc[1]));
        }
        lanes
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
