//! Q4_0 and Q5_0 with 8 weight rows interleaved: the same bytes as 8 blocks of the file, rearranged
//! so that a 32-byte load holds 4 quants of each of the 8 rows.
//!
//! A group holds block `b` of weight rows `8g .. 8g + 8`. Its quant bytes are the rows' `qs` as 4-byte
//! words, transposed: bytes `32c + 4k .. 32c + 4k + 4` are bytes `4c .. 4c + 4` of row `k`'s `qs`
//! (`c < 4`). So the low nibbles of load `c` hold values `4c .. 4c + 4` of every row, 4-byte lane `k`
//! for row `k`, and its high nibbles values `16 + 4c ..`: 8 vectors `V_t` (`t < 8`) whose lane `k` is
//! row `k`'s values `4t .. 4t + 4`. Against a broadcast of activation quants `4t .. 4t + 4`, a vector's
//! products sum, lane by lane, into each row's block sum, with no horizontal reduction. Q5_0's fifth
//! bits are stored the same way, one bit per quant byte of the vectors: bit `t` of byte `4k + b` of
//! `qh` is the fifth bit of value `4t + b` of row `k`. The 8 scales lie side by side, one 128-bit load.
//!
//! [`crate::QMatrix`] stores Q4_0 and Q5_0 matrices whose row count is a multiple of 8 this way; the
//! integers the kernels compute are those of the reference ([`crate::formats::dot_q4_0_q8_0`],
//! [`crate::formats::dot_q5_0_q8_0`]), so the results are the same bits.

use super::{BlockQ4_0, BlockQ5_0, QK8_0};
use crate::f16::F16;

/// Weight rows per group.
pub const GROUP_ROWS: usize = 8;

/// Byte `i` of the interleaved quants: byte `4c + b` of row `k`'s `qs`, for `i = 32c + 4k + b`.
const fn source(i: usize) -> (usize, usize) {
    let (c, k, b) = (i / 32, (i / 4) % 8, i % 4);
    (k, 4 * c + b)
}

/// The interleaved quant bytes of 8 rows' 16-byte `qs`.
fn interleave(qs: [&[u8; QK8_0 / 2]; GROUP_ROWS]) -> [u8; 128] {
    std::array::from_fn(|i| {
        let (k, j) = source(i);
        qs[k][j]
    })
}

/// Row `k`'s 16 `qs` bytes back out of the interleaved quants.
fn row_quants(qs: &[u8; 128], k: usize) -> [u8; QK8_0 / 2] {
    std::array::from_fn(|j| qs[32 * (j / 4) + 4 * k + j % 4])
}

/// Block `b` of 8 Q4_0 weight rows (144 bytes, as the 8 blocks), interleaved: quant bytes
/// `32c + 4k .. 32c + 4k + 4` are bytes `4c .. 4c + 4` of row `k`'s `qs` (`c < 4`), so the low nibbles
/// of 32 bytes `c` are values `4c .. 4c + 4` of every row (4-byte lane `k` for row `k`) and the high
/// nibbles values `16 + 4c ..`. Each lane's products with 4 broadcast activation quants add up, lane
/// by lane, to each row's block sum: the 8 rows' sums come out in 8 lanes without a horizontal
/// reduction. [`crate::QMatrix`] stores Q4_0 matrices whose row count is a multiple of 8 this way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ4_0x8 {
    /// The rows' scales.
    pub d: [F16; GROUP_ROWS],
    /// The rows' nibbles, interleaved (see the module).
    pub qs: [u8; 128],
}

/// Block `b` of 8 Q5_0 weight rows (176 bytes, as the 8 blocks), with the nibbles of
/// [`BlockQ4_0x8`] and one fifth bit per quant byte of its 8 vectors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ5_0x8 {
    /// The rows' scales.
    pub d: [F16; GROUP_ROWS],
    /// The rows' fifth bits: bit `t` of byte `4k + b` is that of row `k`'s value `4t + b`.
    pub qh: [u8; 32],
    /// The rows' nibbles, interleaved (see the module).
    pub qs: [u8; 128],
}

const _: () = assert!(std::mem::size_of::<BlockQ4_0x8>() == 8 * 18);
const _: () = assert!(std::mem::size_of::<BlockQ5_0x8>() == 8 * 22);

/// A group of 8 rows' blocks of one 32-value format.
pub trait Interleaved: Copy + Send + Sync + 'static {
    /// The format's block.
    type Block: Copy;
    /// Interleaves block `b` of 8 rows.
    fn pack(rows: [&Self::Block; GROUP_ROWS]) -> Self;
    /// Row `k`'s block, as the file stores it.
    ///
    /// # Panics
    /// If `k >= 8`.
    fn row(&self, k: usize) -> Self::Block;
}

impl Interleaved for BlockQ4_0x8 {
    type Block = BlockQ4_0;

    fn pack(rows: [&BlockQ4_0; GROUP_ROWS]) -> Self {
        BlockQ4_0x8 {
            d: rows.map(|r| r.d),
            qs: interleave(rows.map(|r| &r.qs)),
        }
    }

    fn row(&self, k: usize) -> BlockQ4_0 {
        BlockQ4_0 {
            d: self.d[k],
            qs: row_quants(&self.qs, k),
        }
    }
}

impl Interleaved for BlockQ5_0x8 {
    type Block = BlockQ5_0;

    fn pack(rows: [&BlockQ5_0; GROUP_ROWS]) -> Self {
        let qh = rows.map(|r| u32::from_le_bytes(r.qh));
        BlockQ5_0x8 {
            d: rows.map(|r| r.d),
            qh: std::array::from_fn(|i| {
                let (k, b) = (i / 4, i % 4);
                (0..8).fold(0u8, |byte, t| {
                    byte | ((((qh[k] >> (4 * t + b)) & 1) as u8) << t)
                })
            }),
            qs: interleave(rows.map(|r| &r.qs)),
        }
    }

    fn row(&self, k: usize) -> BlockQ5_0 {
        let qh = (0..QK8_0).fold(0u32, |word, v| {
            let (t, b) = (v / 4, v % 4);
            word | (u32::from((self.qh[4 * k + b] >> t) & 1) << v)
        });
        BlockQ5_0 {
            d: self.d[k],
            qh: qh.to_le_bytes(),
            qs: row_quants(&self.qs, k),
        }
    }
}

/// Interleaves rows of `nb` blocks (`blocks.len()` a multiple of `8 · nb`): group `g · nb + b` is
/// block `b` of rows `8g .. 8g + 8`. Empty for `nb == 0`.
pub fn interleave_rows<G: Interleaved>(blocks: &[G::Block], nb: usize) -> Vec<G> {
    if nb == 0 {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(blocks.len() / GROUP_ROWS);
    for rows in blocks.chunks_exact(GROUP_ROWS * nb) {
        for b in 0..nb {
            out.push(G::pack(std::array::from_fn(|k| &rows[k * nb + b])));
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::{BlockQ4_0x8, BlockQ5_0x8};
    use crate::simd::avx512::join;
    use std::arch::x86_64::*;

    /// The AVX2 half of an interleaved format: a group's quants in registers as the 8 vectors `V_t`
    /// of the module's layout (unsigned, `u = q + OFFSET`), and its 8 scales as `f32`. The kernel
    /// ([`crate::simd::avx2::pass8`]) does the rest, the same for both formats.
    pub(crate) trait Groups8 {
        /// The group.
        type Group;
        /// The quants are stored as `u = q + OFFSET`.
        const OFFSET: i32;
        /// How many `maddubs` results of a row may be summed in `i16` exactly: a pair sum of `u · y`
        /// is at most `2 · u_max · 127`.
        const I16_TERMS: usize;

        /// # Safety
        /// The CPU must support AVX2.
        unsafe fn unpack(group: &Self::Group) -> [__m256i; 8];

        /// The 8 rows' scales.
        ///
        /// # Safety
        /// The CPU must support AVX2 and F16C.
        unsafe fn d(group: &Self::Group) -> __m256;

        /// [`Groups8::unpack`] of two groups side by side in 512-bit vectors (`g0` in the low
        /// halves, `g1` in the high ones), for [`crate::simd::avx512::pass16`].
        ///
        /// # Safety
        /// The CPU must support [`crate::CpuLevel::Avx512Zmm`].
        unsafe fn unpack_pair(g0: &Self::Group, g1: &Self::Group) -> [__m512i; 8];

        /// [`Groups8::d`] of two groups side by side.
        ///
        /// # Safety
        /// As [`Groups8::unpack_pair`].
        unsafe fn d_pair(g0: &Self::Group, g1: &Self::Group) -> __m512;
    }

    /// Two groups' 8 `f16` scales as 16 `f32`, `a`'s first.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
    fn scales_pair(a: &[crate::F16; 8], b: &[crate::F16; 8]) -> __m512 {
        // SAFETY: `a` and `b` are 8 `u16` each, one unaligned 128-bit load each.
        unsafe {
            _mm512_cvtph_ps(_mm256_set_m128i(
                _mm_loadu_si128(b.as_ptr().cast()),
                _mm_loadu_si128(a.as_ptr().cast()),
            ))
        }
    }

    /// [`nibbles`] of two groups side by side.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
    fn nibbles_pair(a: &[u8; 128], b: &[u8; 128]) -> [__m512i; 8] {
        let low = _mm512_set1_epi8(0x0f);
        let mut v = [_mm512_setzero_si512(); 8];
        for c in 0..4 {
            // SAFETY: `qs` is 128 bytes; bytes 32c .. 32c + 32 are in bounds for c < 4.
            let q = unsafe { join(a.as_ptr().add(32 * c), b.as_ptr().add(32 * c)) };
            v[c] = _mm512_and_si512(q, low);
            v[c + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(q), low);
        }
        v
    }

    /// 8 `f16` scales as `f32`.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn scales(d: &[crate::F16; 8]) -> __m256 {
        // SAFETY: `d` is 8 `u16`, 16 bytes: one unaligned 128-bit load.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(d.as_ptr().cast()) })
    }

    /// The nibbles as the vectors `V_t`: load `c` gives `V_c` (low nibbles) and `V_{c + 4}` (high).
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn nibbles(qs: &[u8; 128]) -> [__m256i; 8] {
        let low = _mm256_set1_epi8(0x0f);
        let mut v = [_mm256_setzero_si256(); 8];
        for c in 0..4 {
            // SAFETY: `qs` is 128 bytes; bytes 32c .. 32c + 32 are in bounds for c < 4.
            let q = unsafe { _mm256_loadu_si256(qs.as_ptr().add(32 * c).cast()) };
            v[c] = _mm256_and_si256(q, low);
            v[c + 4] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
        }
        v
    }

    pub(crate) struct Q4_0x8;

    impl Groups8 for Q4_0x8 {
        type Group = BlockQ4_0x8;
        const OFFSET: i32 = 8;
        /// 8 · 2 · 15 · 127 = 30480 < 2^15.
        const I16_TERMS: usize = 8;

        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn unpack(group: &BlockQ4_0x8) -> [__m256i; 8] {
            nibbles(&group.qs)
        }

        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn d(group: &BlockQ4_0x8) -> __m256 {
            scales(&group.d)
        }

        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
        unsafe fn unpack_pair(g0: &BlockQ4_0x8, g1: &BlockQ4_0x8) -> [__m512i; 8] {
            nibbles_pair(&g0.qs, &g1.qs)
        }

        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
        unsafe fn d_pair(g0: &BlockQ4_0x8, g1: &BlockQ4_0x8) -> __m512 {
            scales_pair(&g0.d, &g1.d)
        }
    }

    pub(crate) struct Q5_0x8;

    impl Groups8 for Q5_0x8 {
        type Group = BlockQ5_0x8;
        const OFFSET: i32 = 16;
        /// 4 · 2 · 31 · 127 = 31496 < 2^15.
        const I16_TERMS: usize = 4;

        /// The nibbles with each fifth bit shifted from bit `t` of `qh` to bit 4 of `V_t`'s byte. A
        /// 16-bit shift moves bits across a byte boundary only into bits the mask clears: left by
        /// `4 - t ≤ 4`, bit 4 of either byte comes from bit `t` of the same byte; right by `t - 4 ≤
        /// 3`, from bit `t ≤ 7` of the same byte.
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn unpack(group: &BlockQ5_0x8) -> [__m256i; 8] {
            let mut v = nibbles(&group.qs);
            // SAFETY: `qh` is 32 bytes, one unaligned 256-bit load.
            let h = unsafe { _mm256_loadu_si256(group.qh.as_ptr().cast()) };
            let bit = _mm256_set1_epi8(0x10);
            let fifth = [
                _mm256_slli_epi16(h, 4),
                _mm256_slli_epi16(h, 3),
                _mm256_slli_epi16(h, 2),
                _mm256_slli_epi16(h, 1),
                h,
                _mm256_srli_epi16(h, 1),
                _mm256_srli_epi16(h, 2),
                _mm256_srli_epi16(h, 3),
            ];
            for (v, f) in v.iter_mut().zip(fifth) {
                *v = _mm256_or_si256(*v, _mm256_and_si256(f, bit));
            }
            v
        }

        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn d(group: &BlockQ5_0x8) -> __m256 {
            scales(&group.d)
        }

        /// [`Groups8::unpack`]'s fifth bits, on both groups at once.
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
        unsafe fn unpack_pair(g0: &BlockQ5_0x8, g1: &BlockQ5_0x8) -> [__m512i; 8] {
            let mut v = nibbles_pair(&g0.qs, &g1.qs);
            // SAFETY: `qh` is 32 bytes in each group.
            let h = unsafe { join(g0.qh.as_ptr(), g1.qh.as_ptr()) };
            let bit = _mm512_set1_epi8(0x10);
            let fifth = [
                _mm512_slli_epi16::<4>(h),
                _mm512_slli_epi16::<3>(h),
                _mm512_slli_epi16::<2>(h),
                _mm512_slli_epi16::<1>(h),
                h,
                _mm512_srli_epi16::<1>(h),
                _mm512_srli_epi16::<2>(h),
                _mm512_srli_epi16::<3>(h),
            ];
            for (v, f) in v.iter_mut().zip(fifth) {
                *v = _mm512_or_si512(*v, _mm512_and_si512(f, bit));
            }
            v
        }

        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
        unsafe fn d_pair(g0: &BlockQ5_0x8, g1: &BlockQ5_0x8) -> __m512 {
            scales_pair(&g0.d, &g1.d)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q5(seed: u8) -> BlockQ5_0 {
        BlockQ5_0 {
            d: F16(0x3c00 + u16::from(seed)),
            qh: [seed, seed.wrapping_mul(37), !seed, seed ^ 0x5a],
            qs: std::array::from_fn(|i| seed.wrapping_mul(31).wrapping_add(i as u8 * 17)),
        }
    }

    #[test]
    fn groups_give_back_their_rows() {
        let rows: Vec<BlockQ5_0> = (0..8).map(|k| q5(11 * k + 3)).collect();
        let g = BlockQ5_0x8::pack(std::array::from_fn(|k| &rows[k]));
        for (k, row) in rows.iter().enumerate() {
            assert_eq!(g.row(k), *row);
        }
        let q4: Vec<BlockQ4_0> = rows
            .iter()
            .map(|r| BlockQ4_0 { d: r.d, qs: r.qs })
            .collect();
        let g = BlockQ4_0x8::pack(std::array::from_fn(|k| &q4[k]));
        for (k, row) in q4.iter().enumerate() {
            assert_eq!(g.row(k), *row);
        }
    }

    #[test]
    fn lanes_hold_each_rows_values() {
        // Vector t, byte 4k + b is row k's value 4t + b: its nibble from load t % 4, its fifth bit
        // from bit t of qh byte 4k + b.
        let rows: Vec<BlockQ5_0> = (0..8).map(|k| q5(7 * k + 1)).collect();
        let g = BlockQ5_0x8::pack(std::array::from_fn(|k| &rows[k]));
        for t in 0..8 {
            for (k, row) in rows.iter().enumerate() {
                for b in 0..4 {
                    let byte = g.qs[32 * (t % 4) + 4 * k + b];
                    let nibble = if t < 4 { byte & 0x0f } else { byte >> 4 };
                    let fifth = (g.qh[4 * k + b] >> t) & 1;
                    let u = i32::from(nibble | (fifth << 4));
                    assert_eq!(u - 16, i32::from(row.quants()[4 * t + b]));
                }
            }
        }
    }
}
