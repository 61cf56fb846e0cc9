//! Q4_K: 256 values in 8 sub-blocks of 32; sub-block `s` has a 6-bit scale `sc[s]` and min `m[s]`, and
//! `value = d · sc[s] · q - dmin · m[s]` with `q` a 4-bit quant.

use super::{
    bytes, hsum8, le_u16, q8k_position, q8k_value, words, BlockFormat, BlockQ8K, WeightBlock, QK_K,
};
use crate::f16::F16;

/// A Q4_K block: the fields and size of ggml's `block_q4_K` (144 bytes), with the quants in the
/// kernels' order.
///
/// In ggml's layout, `qs[32 c + l]` holds value `64 c + l` in its low nibble and value `64 c + 32 + l`
/// in its high nibble. Here the same nibble holds the quant of value [`q8k_value`]`(p)` instead of
/// value `p` (for `p` = `64 c + l` or `64 c + 32 + l`): [`BlockQ8K`]'s order, a transpose of 4-value
/// groups, so that the low and high nibbles of bytes `32 c ..` are vectors `2 c` and `2 c + 1` of that
/// order. [`WeightBlock::read`] and [`WeightBlock::write`] convert from and to ggml's layout (the
/// transpose is its own inverse); the block stays the file's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ4K {
    /// Super-block scale of the sub-block scales.
    pub d: F16,
    /// Super-block scale of the sub-block mins.
    pub dmin: F16,
    /// Eight 6-bit scales and eight 6-bit mins, packed as ggml's `get_scale_min_k4` reads them.
    pub scales: [u8; 12],
    /// Nibbles, in the kernels' order (not the file's: build blocks from a file's bytes with
    /// [`WeightBlock::read`]).
    pub qs: [u8; QK_K / 2],
}

impl BlockQ4K {
    /// The 6-bit scales and mins of the 8 sub-blocks (ggml's `get_scale_min_k4` for `j` in 0..8).
    #[inline]
    pub fn scales_mins(&self) -> ([u8; 8], [u8; 8]) {
        let q = &self.scales;
        let mut sc = [0u8; 8];
        let mut m = [0u8; 8];
        for j in 0..4 {
            sc[j] = q[j] & 63;
            m[j] = q[j + 4] & 63;
        }
        for j in 4..8 {
            sc[j] = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
            m[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        }
        (sc, m)
    }

    /// The 4-bit quants of sub-block `s` (0..8), in value order.
    #[inline]
    pub fn sub_block(&self, s: usize) -> [u8; 32] {
        std::array::from_fn(|l| {
            let p = q8k_position(32 * s + l);
            (self.qs[32 * (p / 64) + p % 32] >> (4 * ((p / 32) % 2))) & 0x0f
        })
    }
}

/// The nibbles of a Q4_K block (ggml's layout, see [`BlockQ4K`]) with the 8 × 8 matrix of 4-value
/// groups transposed: group `(a, b)` (values `32 a + 4 b .. + 4`) moves to `(b, a)`. Its own inverse.
fn transpose_groups(src: &[u8; QK_K / 2]) -> [u8; QK_K / 2] {
    let src: [u32; 32] = words(src);
    let mut out = [0u32; 32];
    // Group (a, b): the 4 nibbles of word 8 (a / 2) + b, the high ones for odd a.
    for a in 0..8 {
        for b in 0..8 {
            let nibbles = (src[8 * (a / 2) + b] >> (4 * (a % 2))) & 0x0f0f_0f0f;
            out[8 * (b / 2) + a] |= nibbles << (4 * (b % 2));
        }
    }
    bytes(&out)
}

impl WeightBlock for BlockQ4K {
    const FORMAT: BlockFormat = BlockFormat::Q4K;
    const VALUES: usize = QK_K;
    const BYTES: usize = 144;

    fn read(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != Self::BYTES {
            return None;
        }
        Some(BlockQ4K {
            d: F16(le_u16(bytes, 0)),
            dmin: F16(le_u16(bytes, 2)),
            scales: std::array::from_fn(|i| bytes[4 + i]),
            qs: transpose_groups(&std::array::from_fn(|i| bytes[16 + i])),
        })
    }

    fn write(&self, out: &mut [u8]) {
        assert_eq!(out.len(), Self::BYTES, "a Q4_K block is 144 bytes");
        out[..2].copy_from_slice(&self.d.0.to_le_bytes());
        out[2..4].copy_from_slice(&self.dmin.0.to_le_bytes());
        out[4..16].copy_from_slice(&self.scales);
        out[16..].copy_from_slice(&transpose_groups(&self.qs));
    }

    /// As ggml's `dequantize_row_q4_K`: `(d · sc) · q - (dmin · m)`.
    fn dequantize(&self, out: &mut [f32]) {
        assert_eq!(out.len(), QK_K, "a Q4_K block holds 256 values");
        let (d, min) = (self.d.to_f32(), self.dmin.to_f32());
        let (sc, m) = self.scales_mins();
        for (s, out) in out.chunks_exact_mut(32).enumerate() {
            let (d1, m1) = (d * f32::from(sc[s]), min * f32::from(m[s]));
            for (o, q) in out.iter_mut().zip(self.sub_block(s)) {
                *o = d1 * f32::from(q) - m1;
            }
        }
    }
}

/// Reference dot product of a Q4_K weight row with a Q8_K activation row.
///
/// Per block, exactly in `i32`: lane `j` sums `sc[s] · q · y` over the activation positions `32 t + 4 j
/// .. + 4` of every vector `t` of [`BlockQ8K`]'s order (`s` the sub-block of the value at that position,
/// which is `j`), and `mins[j] = m[j] · (bsums[2j] + bsums[2j+1])`; then, with `fma(a, b, c) = a · b + c` rounded
/// once, `acc[j] = fma(fma(lane[j], d, -(mins[j] · dmin)), dy, acc[j])`, and [`hsum8`] at the end.
///
/// # Panics
/// If the rows differ in length.
pub fn dot_q4_k_q8_k(w: &[BlockQ4K], x: &[BlockQ8K]) -> f32 {
    assert_eq!(w.len(), x.len(), "rows must have the same number of blocks");
    let mut acc = [0f32; 8];
    for (wb, xb) in w.iter().zip(x) {
        let (sc, m) = wb.scales_mins();
        let q: [[u8; 32]; 8] = std::array::from_fn(|s| wb.sub_block(s));
        let mut lanes = [0i32; 8];
        for (i, &y) in xb.qs.iter().enumerate() {
            let v = q8k_value(i);
            lanes[(i % 32) / 4] +=
                i32::from(sc[v / 32]) * i32::from(q[v / 32][v % 32]) * i32::from(y);
        }
        let (d, dmin) = (wb.d.to_f32(), wb.dmin.to_f32());
        for (j, a) in acc.iter_mut().enumerate() {
            let mins =
                i32::from(m[j]) * (i32::from(xb.bsums[2 * j]) + i32::from(xb.bsums[2 * j + 1]));
            let block = (lanes[j] as f32).mul_add(d, -(mins as f32 * dmin));
            *a = block.mul_add(xb.d, *a);
        }
    }
    hsum8(acc)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::{BlockQ4K, BlockQ8K};
    use crate::simd::avx2::{chained_lanes_vnni, f16_to_f32, summed_lanes, Dequantizer};
    use std::arch::x86_64::*;

    pub(crate) struct Q4K;

    pub(crate) struct Unpacked {
        /// The nibbles as unsigned bytes: the 8 vectors of [`BlockQ8K`]'s order.
        q: [__m256i; 8],
        /// `i32` lane `j` holds the scale of sub-block `j` in both `i16` halves ([`summed_lanes`]), or
        /// in its low `i16` with 0 in the high one ([`chained_lanes_vnni`]).
        sc: __m256i,
        /// `i16` lanes `2k`, `2k + 1` hold min `k`.
        mins: __m256i,
        /// The super-block scales, broadcast.
        d: __m256,
        dmin: __m256,
    }

    impl Dequantizer for Q4K {
        type Block = BlockQ4K;
        type Act = BlockQ8K;
        type Unpacked = Unpacked;

        const ONE_ROW_FROM: usize = 2;

        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn unpack(block: &BlockQ4K) -> Unpacked {
            let w = unpack_vnni_scales(block);
            // Each scale in both `i16` halves of its lane.
            let sc = _mm256_or_si256(w.sc, _mm256_slli_epi32(w.sc, 16));
            Unpacked { sc, ..w }
        }

        /// Exact integer lanes: a nibble times a quant is ≤ 15 · 127, so the `i16` sums of the 16
        /// products of a lane's 8 vectors fit (≤ 30480), and a lane's total is ≤ 2 · 63 · 30480 < 2^24
        /// (exact in f32 too).
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn accumulate(w: &Unpacked, x: &BlockQ8K, acc: __m256) -> __m256 {
            let mut acc = [acc];
            // SAFETY: AVX2 support is the caller's contract.
            unsafe { Self::accumulate_rows::<1>(w, [x], &mut acc) };
            acc[0]
        }

        /// Row by row through [`summed_lanes`], then each row's float arithmetic.
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn accumulate_rows<const R: usize>(
            w: &Unpacked,
            x: [&BlockQ8K; R],
            acc: &mut [__m256],
        ) {
            finish(w, summed_lanes(&w.q, w.sc, x), x, acc);
        }

        /// The scales with 0 in the high `i16` of each lane, as [`chained_lanes_vnni`] takes them.
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn unpack_vnni(block: &BlockQ4K) -> Unpacked {
            unpack_vnni_scales(block)
        }

        /// Row by row through [`chained_lanes_vnni`], then the float arithmetic of
        /// [`Dequantizer::accumulate_rows`].
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni")]
        unsafe fn accumulate_rows_vnni<const R: usize>(
            w: &Unpacked,
            x: [&BlockQ8K; R],
            acc: &mut [__m256],
        ) {
            finish(w, chained_lanes_vnni(&w.q, w.sc, x), x, acc);
        }
    }

    /// A block in registers, with its scales as [`chained_lanes_vnni`] takes them: scale `j` in the
    /// low `i16` of `i32` lane `j`, 0 in the high one.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn unpack_vnni_scales(block: &BlockQ4K) -> Unpacked {
        // ggml's `get_scale_min_k4` for all 8 sub-blocks at once, on 32-bit words: afterwards bytes
        // 0..8 of `u` are the scales and bytes 8..16 the mins.
        let w = |i: usize| {
            u32::from_le_bytes([
                block.scales[4 * i],
                block.scales[4 * i + 1],
                block.scales[4 * i + 2],
                block.scales[4 * i + 3],
            ])
        };
        let (k1, k2, k3) = (0x3f3f_3f3f_u32, 0x0f0f_0f0f_u32, 0x0303_0303_u32);
        let (u0, u1, u2) = (w(0), w(1), w(2));
        let u3 = ((u2 >> 4) & k2) | (((u1 >> 6) & k3) << 4);
        let u1n = (u2 & k2) | (((u0 >> 6) & k3) << 4);
        let u2n = u1 & k1;
        let u0n = u0 & k1;
        let bytes = _mm_set_epi32(u3 as i32, u2n as i32, u1n as i32, u0n as i32);
        // i16 scales 0..8 in the low half, mins 0..8 in the high half.
        let sm = _mm256_cvtepu8_epi16(bytes);
        let sc = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(sm));
        let m = _mm256_extracti128_si256(sm, 1);
        let mins = _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
        // The low and high nibbles of bytes `32 c ..` are vectors `2 c` and `2 c + 1` of the order.
        let low = _mm256_set1_epi8(0x0f);
        let mut q = [_mm256_setzero_si256(); 8];
        for c in 0..4 {
            // SAFETY: `block.qs` is 128 bytes; bytes 32c .. 32c + 32 are in bounds for c < 4.
            let v = unsafe { _mm256_loadu_si256(block.qs.as_ptr().add(32 * c).cast()) };
            q[2 * c] = _mm256_and_si256(v, low);
            q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        Unpacked {
            q,
            sc,
            mins,
            d: _mm256_set1_ps(f16_to_f32(block.d)),
            dmin: _mm256_set1_ps(f16_to_f32(block.dmin)),
        }
    }

    /// Each row's float arithmetic on its integer lanes `l`, as the reference: the lanes scaled by `d`
    /// less the mins term in one fused step, then scaled by the activation's `d` into `acc` in another
    /// (6 vector instructions per row and block, the activation scale broadcast straight from memory).
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
            let mins = _mm256_cvtepi32_ps(_mm256_madd_epi16(w.mins, bsums));
            let block = _mm256_fmsub_ps(_mm256_cvtepi32_ps(l), w.d, _mm256_mul_ps(mins, w.dmin));
            *a = _mm256_fmadd_ps(block, _mm256_broadcast_ss(&x.d), *a);
        }
    }
}
