//! Q4_K: 256 values in 8 sub-blocks of 32; sub-block `s` has a 6-bit scale `sc[s]` and min `m[s]`, and
//! `value = d · sc[s] · q - dmin · m[s]` with `q` a 4-bit quant.

use super::{hsum8, le_u16, q8k_value, BlockFormat, BlockQ8K, WeightBlock, QK_K};
use crate::f16::F16;

/// A Q4_K block, byte-identical to ggml's `block_q4_K` (144 bytes).
///
/// `qs[32 c + l]` holds value `64 c + l` in its low nibble and value `64 c + 32 + l` in its high nibble.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ4K {
    /// Super-block scale of the sub-block scales.
    pub d: F16,
    /// Super-block scale of the sub-block mins.
    pub dmin: F16,
    /// Eight 6-bit scales and eight 6-bit mins, packed as ggml's `get_scale_min_k4` reads them.
    pub scales: [u8; 12],
    /// Nibbles.
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
        let bytes = &self.qs[32 * (s / 2)..32 * (s / 2) + 32];
        let shift = 4 * (s % 2);
        std::array::from_fn(|l| (bytes[l] >> shift) & 0x0f)
    }
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
            qs: std::array::from_fn(|i| bytes[16 + i]),
        })
    }

    fn write(&self, out: &mut [u8]) {
        assert_eq!(out.len(), Self::BYTES, "a Q4_K block is 144 bytes");
        out[..2].copy_from_slice(&self.d.0.to_le_bytes());
        out[2..4].copy_from_slice(&self.dmin.0.to_le_bytes());
        out[4..16].copy_from_slice(&self.scales);
        out[16..].copy_from_slice(&self.qs);
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
/// .. + 4` of every vector `t` of [`BlockQ8K`]'s order (`s` the sub-block of the value at that position),
/// and `mins[j] = m[j] · (bsums[2j] + bsums[2j+1])`; then, with `fma(a, b, c) = a · b + c` rounded
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
    use crate::simd::avx2::{
        chained_lanes_vnni, f16_to_f32, paired_lanes, pick_i16, shuffle, Dequantizer,
    };
    use std::arch::x86_64::*;

    pub(crate) struct Q4K;

    /// Pair `p` holds groups `g`, `g + 2` (g = 0, 1, 4, 5): lanes 0..2 of each half take the scale of
    /// `g`, lanes 2..4 that of `g + 2` (`i16` scales 0..8 in both halves of the source).
    const PICK: [[u8; 32]; 4] = {
        const fn pair(g: u8) -> [u8; 32] {
            let (a, b) = (g, g + 2);
            let lanes = [a, a, a, a, b, b, b, b];
            pick_i16(lanes, lanes)
        }
        [pair(0), pair(1), pair(4), pair(5)]
    };

    /// [`PICK`] with the high `i16` of every `i32` lane zeroed (a control byte with its top bit set
    /// writes 0): the scales as [`chained_lanes_vnni`] takes them.
    const PICK_VNNI: [[u8; 32]; 4] = {
        let mut table = PICK;
        let mut p = 0;
        while p < 4 {
            let mut b = 2;
            while b < 32 {
                table[p][b] = 0x80;
                table[p][b + 1] = 0x80;
                b += 4;
            }
            p += 1;
        }
        table
    };

    pub(crate) struct Unpacked {
        /// The nibbles as unsigned bytes in [`BlockQ8K`]'s order: vectors `2p`, `2p + 1` of pair `p`.
        q: [__m256i; 8],
        /// Pair `p`'s scales: `i16` lanes `2j`, `2j + 1` hold the scale of the sub-block in lane `j`
        /// ([`PICK`]), or lane `2j` holds it and lane `2j + 1` is 0 ([`PICK_VNNI`]).
        sc: [__m256i; 4],
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

        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn unpack(block: &BlockQ4K) -> Unpacked {
            unpack_picked(block, &PICK)
        }

        /// Exact integer lanes: a nibble times a quant is ≤ 15 · 127, so the `i16` sums of 4 products
        /// fit, and a lane's total over the block is ≤ 63 · 32 · 15 · 127 < 2^24 (exact in f32 too).
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

        /// The scales with 0 in the high `i16` of each lane, as [`chained_lanes_vnni`] takes them.
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn unpack_vnni(block: &BlockQ4K) -> Unpacked {
            unpack_picked(block, &PICK_VNNI)
        }

        /// Pair by pair through [`chained_lanes_vnni`], then the float arithmetic of
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

    /// A block in registers, with the scales arranged by `pick` ([`PICK`] or [`PICK_VNNI`]).
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn unpack_picked(block: &BlockQ4K, pick: &[[u8; 32]; 4]) -> Unpacked {
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
        let scales = _mm256_permute2x128_si256(sm, sm, 0x00);
        let m = _mm256_extracti128_si256(sm, 1);
        let mins = _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
        // Bytes `32c ..` hold sub-block `2c` in their low nibbles and `2c + 1` in their high
        // ones. Interleaving the 8-byte words of chunks `2k` and `2k + 1` puts groups `4k`, `4k + 2`
        // (low nibbles) and `4k + 1`, `4k + 3` (high) into pairs `2k` and `2k + 1` of the order.
        let low = _mm256_set1_epi8(0x0f);
        let mut q = [_mm256_setzero_si256(); 8];
        for k in 0..2 {
            // SAFETY: `block.qs` is 128 bytes; bytes 64k .. 64k + 64 are in bounds for k < 2.
            let (v0, v1) = unsafe {
                (
                    _mm256_loadu_si256(block.qs.as_ptr().add(64 * k).cast()),
                    _mm256_loadu_si256(block.qs.as_ptr().add(64 * k + 32).cast()),
                )
            };
            let (a, b) = (_mm256_unpacklo_epi64(v0, v1), _mm256_unpackhi_epi64(v0, v1));
            q[4 * k] = _mm256_and_si256(a, low);
            q[4 * k + 1] = _mm256_and_si256(b, low);
            q[4 * k + 2] = _mm256_and_si256(_mm256_srli_epi16(a, 4), low);
            q[4 * k + 3] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
        }
        let sc = [
            shuffle(scales, &pick[0]),
            shuffle(scales, &pick[1]),
            shuffle(scales, &pick[2]),
            shuffle(scales, &pick[3]),
        ];
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
