//! GGUF block formats: the byte layouts, dequantisation and the scalar reference dot products.
//!
//! One module per format. Each weight block type is `#[repr(C)]` with the exact size and field order of
//! ggml's `block_*` struct. The 32-value formats' bytes are the file's; the K-quants (Q4_K, Q6_K) keep
//! their quants in the kernels' order (see [`BlockQ8K`]), so a tensor's bytes become blocks only
//! through [`WeightBlock::read`], which repacks them (and [`WeightBlock::write`] gives them back).
//!
//! # The reference arithmetic
//!
//! Every dot product here has a fixed shape, chosen so that a SIMD kernel can reproduce it bit for bit.
//! Integer products are always summed *exactly* in `i32`, so only the float operations need a fixed
//! order (fused multiply-adds, `f32::mul_add` in the references, where the formats say so):
//!
//! - **K-quants** (Q4_K, Q6_K): within a block the products go into 8 lanes (lane `j` takes the
//!   products at positions `32t + 4j .. 32t + 4j + 4` of every 32-byte vector `t` of the activation
//!   block, whose quants are stored in the transposed order described at [`BlockQ8K`], each with
//!   its sub-block's integer scale applied); each lane is converted to `f32` and folded into a
//!   per-lane `f32` accumulator with the block's float scales in a fixed sequence of fused
//!   multiply-adds, and after the last block the 8 accumulators are summed by [`hsum8`]'s fixed tree.
//! - **32-value formats** (Q8_0, Q4_0, Q5_0): a block's 32 products are summed into one `i32`, which
//!   is converted to `f32`, multiplied by `d_w · d_x` and added to a single `f32` accumulator, block
//!   after block. With one number per block, a kernel can compute 8 weight rows side by side in the
//!   8 lanes of a vector, so the float work and the scale conversion are shared by 8 rows. Q4_0 and
//!   Q5_0 matrices are stored with 8 rows interleaved ([`BlockQ4_0x8`], [`BlockQ5_0x8`]), so that
//!   each row's sum lands in its lane without a horizontal reduction.
//!
//! - **Q4_K stored with 8 rows interleaved** ([`BlockQ4Kx8`], what [`crate::QMatrix`] makes of a Q4_K
//!   matrix whose row count is a multiple of 8): a block's products are summed into one exact `i32`
//!   per row, its mins term into another, and both go into a single `f32` accumulator with two fused
//!   multiply-adds ([`dot_q4_kx8_q8_k`]), so that the 8 rows of a group share the float work.
//! - **Q6_K stored with 8 rows interleaved** ([`BlockQ6Kx8`], likewise): a block's products, less
//!   the quants' offset of 32, are summed into one exact `i32` per row, which is multiplied by `d`
//!   and goes into a single `f32` accumulator with one fused multiply-add ([`dot_q6_kx8_q8_k`]).
//!
//! The AVX2 kernels produce the same integers with `maddubs`/`madd` and the same float operations, so
//! every CPU level returns identical bits. (For the K-quants they add several vectors' `maddubs`
//! results in `i16` before one `madd` by the scales, all 8 of a Q4_K block and two of a Q6_K block,
//! which the transposed order makes possible.)
//!
//! This is llama.cpp's arithmetic up to the grouping of the float operations: ggml's own scalar and
//! AVX2 dot products already differ from each other in that grouping (and in FMA use), so llama.cpp
//! results agree with ours to rounding, not bit for bit. Quantisation of activations
//! ([`quantize_row_q8_k`], [`quantize_row_q8_0`]) follows ggml's `_ref` functions exactly; only the
//! order in which [`BlockQ8K`] stores its quants is ours.

use crate::f16::F16;

pub(crate) mod interleaved;
pub(crate) mod q4_0;
pub(crate) mod q4_k;
pub(crate) mod q4_k_x8;
pub(crate) mod q5_0;
pub(crate) mod q6_k;
pub(crate) mod q6_k_x8;
pub(crate) mod q8_0;
pub(crate) mod q8_k;

pub use interleaved::{interleave_rows, BlockQ4_0x8, BlockQ5_0x8, Interleaved, GROUP_ROWS};
pub use q4_0::{dot_q4_0_q8_0, BlockQ4_0};
pub use q4_k::{dot_q4_k_q8_k, BlockQ4K};
pub use q4_k_x8::{dot_q4_kx8_q8_k, BlockQ4Kx8};
pub use q5_0::{dot_q5_0_q8_0, BlockQ5_0};
pub use q6_k::{dot_q6_k_q8_k, BlockQ6K};
pub use q6_k_x8::{dot_q6_kx8_q8_k, BlockQ6Kx8};
pub use q8_0::{dot_q8_0_q8_0, quantize_row_q8_0, ActQ8_0, BlockQ8_0};
pub use q8_k::{q8k_position, q8k_value, quantize_row_q8_k, BlockQ8K};

/// Values per K-quant super-block (ggml's `QK_K`).
pub const QK_K: usize = 256;
/// Values per Q8_0 / Q4_0 block (ggml's `QK8_0`, `QK4_0`).
pub const QK8_0: usize = 32;

/// A supported weight format, named as in ggml (`GGML_TYPE_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockFormat {
    /// 32 values, one f16 scale, `i8` quants (ggml type 8).
    Q8_0,
    /// 32 values, one f16 scale, 4-bit quants offset by 8 (ggml type 2).
    Q4_0,
    /// 32 values, one f16 scale, 5-bit quants offset by 16 (ggml type 6).
    Q5_0,
    /// 256 values in 8 sub-blocks with 6-bit scales and mins, 4-bit quants (ggml type 12).
    Q4K,
    /// 256 values in 16 sub-blocks with `i8` scales, 6-bit quants offset by 32 (ggml type 14).
    Q6K,
}

impl BlockFormat {
    /// Values per block.
    pub const fn block_len(self) -> usize {
        match self {
            BlockFormat::Q8_0 | BlockFormat::Q4_0 | BlockFormat::Q5_0 => QK8_0,
            BlockFormat::Q4K | BlockFormat::Q6K => QK_K,
        }
    }

    /// Bytes per block, as stored in a GGUF file.
    pub const fn block_bytes(self) -> usize {
        match self {
            BlockFormat::Q8_0 => BlockQ8_0::BYTES,
            BlockFormat::Q4_0 => BlockQ4_0::BYTES,
            BlockFormat::Q5_0 => BlockQ5_0::BYTES,
            BlockFormat::Q4K => BlockQ4K::BYTES,
            BlockFormat::Q6K => BlockQ6K::BYTES,
        }
    }

    /// The activation format this weight format is dotted against.
    pub const fn activation_format(self) -> ActivationFormat {
        match self {
            BlockFormat::Q8_0 | BlockFormat::Q4_0 | BlockFormat::Q5_0 => ActivationFormat::Q8_0,
            BlockFormat::Q4K | BlockFormat::Q6K => ActivationFormat::Q8K,
        }
    }
}

/// How activations are quantised for a weight format's dot product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActivationFormat {
    /// 32-value blocks, f16-rounded scale ([`ActQ8_0`]).
    Q8_0,
    /// 256-value blocks with an f32 scale and 16-value sums ([`BlockQ8K`]).
    Q8K,
}

impl ActivationFormat {
    /// Values per block.
    pub const fn block_len(self) -> usize {
        match self {
            ActivationFormat::Q8_0 => QK8_0,
            ActivationFormat::Q8K => QK_K,
        }
    }
}

/// A weight block of a GGUF format: its layout and its dequantisation.
pub trait WeightBlock: Copy + Send + Sync + 'static {
    /// The format this block belongs to.
    const FORMAT: BlockFormat;
    /// Values per block.
    const VALUES: usize;
    /// Bytes per block in a GGUF file (equal to `size_of::<Self>()`).
    const BYTES: usize;

    /// Reads a block from its little-endian file bytes; `None` unless `bytes.len() == Self::BYTES`.
    fn read(bytes: &[u8]) -> Option<Self>;

    /// Writes the block's little-endian file bytes into `out` (`Self::BYTES` long).
    ///
    /// # Panics
    /// If `out.len() != Self::BYTES`.
    fn write(&self, out: &mut [u8]);

    /// Dequantises the block into `out` (`Self::VALUES` long), as ggml's `dequantize_row_*`.
    ///
    /// # Panics
    /// If `out.len() != Self::VALUES`.
    fn dequantize(&self, out: &mut [f32]);
}

/// Dequantises a row of blocks into `out`.
///
/// # Panics
/// If `out.len() != blocks.len() * B::VALUES`.
pub fn dequantize_row<B: WeightBlock>(blocks: &[B], out: &mut [f32]) {
    assert_eq!(
        out.len(),
        blocks.len() * B::VALUES,
        "output length must match the blocks"
    );
    for (block, out) in blocks.iter().zip(out.chunks_exact_mut(B::VALUES)) {
        block.dequantize(out);
    }
}

/// The fixed summation tree for the 8 lane accumulators:
/// `((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))`, which is what the AVX2 horizontal sum
/// (add the 128-bit halves, then `movehl`, then `movehdup`) computes.
#[inline]
pub fn hsum8(a: [f32; 8]) -> f32 {
    let s = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (s[0] + s[2]) + (s[1] + s[3])
}

/// A 32-value block whose values are `d · q` with signed integer quants (Q8_0, Q4_0, Q5_0).
pub(crate) trait SignedBlock32 {
    /// The scale.
    fn scale(&self) -> F16;
    /// The signed quants in value order.
    fn signed_quants(&self) -> [i8; QK8_0];
}

/// `out[i] = q[i] · d`, as ggml's `dequantize_row_q{4,5,8}_0`.
pub(crate) fn dequantize_signed<B: SignedBlock32>(block: &B, out: &mut [f32]) {
    assert_eq!(out.len(), QK8_0, "a 32-value block holds 32 values");
    let d = block.scale().to_f32();
    for (o, q) in out.iter_mut().zip(block.signed_quants()) {
        *o = f32::from(q) * d;
    }
}

/// Reference dot product of a row of [`SignedBlock32`] weights with a Q8_0 activation row (one exact
/// `i32` per block, as in [`crate::formats`]).
///
/// # Panics
/// If the rows differ in length.
pub(crate) fn dot_signed_q8_0<B: SignedBlock32>(w: &[B], x: &[ActQ8_0]) -> f32 {
    assert_eq!(w.len(), x.len(), "rows must have the same number of blocks");
    let mut acc = 0f32;
    for (wb, xb) in w.iter().zip(x) {
        let sum: i32 = wb
            .signed_quants()
            .iter()
            .zip(&xb.qs)
            .map(|(&q, &y)| i32::from(q) * i32::from(y))
            .sum();
        acc += (wb.scale().to_f32() * xb.d) * sum as f32;
    }
    acc
}

pub(crate) fn le_u16(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

/// Little-endian 32-bit words of `B` bytes (`W = B / 4`).
pub(crate) fn words<const B: usize, const W: usize>(bytes: &[u8; B]) -> [u32; W] {
    const { assert!(B == 4 * W, "4 bytes per word") };
    std::array::from_fn(|i| {
        u32::from_le_bytes([
            bytes[4 * i],
            bytes[4 * i + 1],
            bytes[4 * i + 2],
            bytes[4 * i + 3],
        ])
    })
}

/// The largest of `m`'s 8 lanes, none of them NaN (the activation quantisers' largest magnitude, in
/// any order, is exact).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn hmax_avx2(m: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps::<0b01>(m2, m2)))
}

/// 32 quants in `i32` lanes, in value order and within the range of `i8`, as 32 bytes in value
/// order: `_mm256_packs_epi32` then `_mm256_packs_epi16` leave the 4-value groups in the order 0 2
/// 4 6 1 3 5 7, and a permute gathers them back.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn pack_i8_avx2(q: [std::arch::x86_64::__m256i; 4]) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let packed = _mm256_packs_epi16(
        _mm256_packs_epi32(q[0], q[1]),
        _mm256_packs_epi32(q[2], q[3]),
    );
    _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// Values for the activation quantisers' tests, in blocks of `block`: 8 random blocks at each of
/// several magnitudes, then for each special value a block of it alone, one with it at a single
/// place (the `i`-th special at `31 i % block`) among tiny values, and one with it at every
/// `every`-th place among ordinary ones. `next` gives uniform values in `[0, 1)`.
#[cfg(all(test, target_arch = "x86_64"))]
pub(crate) fn quantiser_test_values(
    block: usize,
    specials: &[f32],
    every: usize,
    next: &mut impl FnMut() -> f32,
) -> Vec<f32> {
    let mut x = Vec::new();
    for scale in [1e-3f32, 1.0, 37.5, 1e4] {
        x.extend((0..8 * block).map(|_| (next() * 2.0 - 1.0) * scale));
    }
    for (i, &v) in specials.iter().enumerate() {
        x.extend(std::iter::repeat_n(v, block));
        x.extend((0..block).map(|j| {
            if j == 31 * i % block {
                v
            } else {
                next() * 1e-38
            }
        }));
        x.extend((0..block).map(|j| if j % every == 0 { v } else { next() - 0.5 }));
    }
    x
}

/// A xorshift generator of uniform values in `[0, 1)` for tests.
#[cfg(all(test, target_arch = "x86_64"))]
pub(crate) fn xorshift(mut s: u64) -> impl FnMut() -> f32 {
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 11) as f64 / (1u64 << 53) as f64) as f32
    }
}

/// The bytes of little-endian 32-bit words (`B = 4 W`).
pub(crate) fn bytes<const W: usize, const B: usize>(words: &[u32; W]) -> [u8; B] {
    const { assert!(B == 4 * W, "4 bytes per word") };
    std::array::from_fn(|i| words[i / 4].to_le_bytes()[i % 4])
}

/// Asserts that a K-quant row's two arithmetics, `grouped` (an interleaved format's) and `per_lane`
/// (the plain blocks'), agree on `w` against a fixed activation row: the same integers, grouped
/// differently into float operations, so within a few rounding errors of the sum of magnitudes.
#[cfg(test)]
pub(crate) fn assert_arithmetics_agree<B: WeightBlock>(
    w: &[B],
    grouped: fn(&[B], &[BlockQ8K]) -> f32,
    per_lane: fn(&[B], &[BlockQ8K]) -> f32,
) {
    let n = w.len() * QK_K;
    let x: Vec<f32> = (0..n)
        .map(|i| ((i * 7919 % 1000) as f32 / 250.0 - 2.0) * if i % 13 == 0 { 8.0 } else { 1.0 })
        .collect();
    let mut xq = vec![BlockQ8K::ZERO; w.len()];
    quantize_row_q8_k(&x, &mut xq);
    let (a, b) = (grouped(w, &xq), per_lane(w, &xq));
    // The magnitudes: every dequantised weight times its activation.
    let mut wf = vec![0f32; n];
    for (blk, out) in w.iter().zip(wf.chunks_exact_mut(QK_K)) {
        blk.dequantize(out);
    }
    let mag: f32 = wf.iter().zip(&x).map(|(w, x)| (w * x).abs()).sum();
    assert!((a - b).abs() <= 1e-6 * mag, "{a} vs {b} (magnitude {mag})");
}
