//! Q6_K with 8 weight rows interleaved: the same bytes as 8 blocks of the file, rearranged so that a
//! 32-byte load holds 4 quants of each of the 8 rows, and with one `f32` accumulator per row.
//!
//! A group holds block `b` of weight rows `8g .. 8g + 8`. Its quants are stored sub-block pair by
//! sub-block pair, in the order the passes read them: pair `s` (`s < 8`) takes the 192 bytes of `q`
//! from `192 s`, the high 2 bits first (64 bytes), then the low 4 bits (128 bytes). The low bits
//! are stored as [`super::BlockQ4Kx8`] stores its nibbles: byte `192 s + 64 + 32 c + 4 k + b`
//! (`c < 4`, `k < 8`, `b < 4`) holds those of row `k`'s value `32 s + 4 c + b` in its low nibble
//! and of value `32 s + 16 + 4 c + b` in its high one. The high 2 bits of the same two values are
//! bits `2 c .. 2 c + 2` of bytes `192 s + 4 k + b` and `192 s + 32 + 4 k + b`. So the 6 loads of
//! sub-block pair `s` give, with ggml's shifts and masks, 8 vectors `V_t` (`t < 8`) whose 4-byte
//! lane `k` is row `k`'s quants of values `32 s + 4 t .. + 4`; against a broadcast of the
//! activation quants of the same 4 values their products sum, lane by lane, into each row's
//! sub-block sums (`t < 4`: sub-block `2 s`; `t ≥ 4`: sub-block `2 s + 1`), with no horizontal
//! reduction. The 16 sub-block scales are stored sub-block by sub-block (byte `8 j + k` is row `k`'s
//! scale `j`).
//!
//! # The arithmetic
//!
//! With the rows in the lanes, a block's float work is one vector operation for 8 rows, so this
//! format has its own reference ([`dot_q6_kx8_q8_k`]): per block the exact `i32` sum `Σ_j sc[j] Σ
//! (q - 32) · y` over the 16 sub-blocks `j`, one multiplication by `d` and one fused multiply-add
//! with the activation's `d` into a single `f32` accumulator. [`crate::QMatrix`] stores Q6_K
//! matrices whose row count is a multiple of 8 this way, and every level computes this arithmetic;
//! a Q6_K matrix of other row counts keeps [`crate::formats::dot_q6_k_q8_k`]'s.

use super::{bytes, q8k_position, words, BlockQ6K, BlockQ8K, Interleaved, GROUP_ROWS};
use crate::f16::F16;

/// Block `b` of 8 Q6_K weight rows (1680 bytes, as the 8 blocks), interleaved (see the module).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ6Kx8 {
    /// The rows' super-block scales.
    pub d: [F16; GROUP_ROWS],
    /// The rows' sub-block scales: byte `8 j + k` is row `k`'s scale of sub-block `j`.
    pub scales: [i8; 128],
    /// The rows' quants, interleaved, sub-block pair by sub-block pair: 192 bytes each, the high 2
    /// bits (64 bytes) then the low 4 bits (128 bytes) (see the module). In one run, not as two
    /// arrays, so that a single row's pass reads its weights in order, a stream the hardware
    /// prefetchers follow (stop 43: with the two arrays a 1536 × 8960 matrix read from memory at
    /// 14–16 GB/s without software prefetch, against 28–34 for Q4_K on the same 2-core EPYC).
    pub q: [u8; 1536],
}

/// Where sub-block pair `s`'s high 2 bits start in [`BlockQ6Kx8::q`] (64 bytes).
pub(crate) const fn qh_at(s: usize) -> usize {
    192 * s
}

/// Where sub-block pair `s`'s low 4 bits start in [`BlockQ6Kx8::q`] (128 bytes).
pub(crate) const fn ql_at(s: usize) -> usize {
    192 * s + 64
}

const _: () = assert!(std::mem::size_of::<BlockQ6Kx8>() == 8 * 210);

/// Where value `32 s + 16 h + 4 c + b` of row `k` keeps its low bits (byte of `q`, shift) and its
/// high bits (byte of `q`, shift).
fn places(k: usize, v: usize) -> ((usize, usize), (usize, usize)) {
    let (s, h, c, b) = (v / 32, (v % 32) / 16, (v % 16) / 4, v % 4);
    (
        (ql_at(s) + 32 * c + 4 * k + b, 4 * h),
        (qh_at(s) + 32 * h + 4 * k + b, 2 * c),
    )
}

impl Interleaved for BlockQ6Kx8 {
    type Block = BlockQ6K;

    /// Four values at a time, as 32-bit words: the values `32 s + 4 t .. + 4` of a row are 4
    /// consecutive bytes of its low bits and of its high bits (at the [`q8k_position`] `32 t + 4 s`,
    /// see [`BlockQ6K`]), and 4 consecutive bytes of the group's (see the module).
    fn pack(rows: [&BlockQ6K; GROUP_ROWS]) -> Self {
        let mut scales = [0i8; 128];
        let mut q = [0u32; 384];
        for (k, row) in rows.iter().enumerate() {
            for (j, &scale) in row.scales.iter().enumerate() {
                scales[8 * j + k] = scale;
            }
            let (row_ql, row_qh): ([u32; 32], [u32; 16]) = (words(&row.ql), words(&row.qh));
            for s in 0..8 {
                for t in 0..8 {
                    // Where `BlockQ6K::quants` reads the values 32s + 4t .. + 4.
                    let p = 32 * t + 4 * s;
                    let (h, g, l) = (p / 128, (p % 128) / 32, p % 32);
                    let low =
                        (row_ql[(64 * h + l + 32 * (g % 2)) / 4] >> (4 * (g / 2))) & 0x0f0f_0f0f;
                    let high = (row_qh[(32 * h + l) / 4] >> (2 * g)) & 0x0303_0303;
                    let (half, c) = (t / 4, t % 4);
                    q[(ql_at(s) + 32 * c + 4 * k) / 4] |= low << (4 * half);
                    q[(qh_at(s) + 32 * half + 4 * k) / 4] |= high << (2 * c);
                }
            }
        }
        BlockQ6Kx8 {
            d: rows.map(|r| r.d),
            scales,
            q: bytes(&q),
        }
    }

    fn row(&self, k: usize) -> BlockQ6K {
        assert!(k < GROUP_ROWS, "a group holds 8 rows");
        let quants = std::array::from_fn(|v| {
            let ((l, ls), (h, hs)) = places(k, v);
            ((self.q[l] >> ls) & 0x0f) | (((self.q[h] >> hs) & 3) << 4)
        });
        BlockQ6K::from_quants(
            &quants,
            std::array::from_fn(|j| self.scales[8 * j + k]),
            self.d[k],
        )
    }
}

/// Reference dot product of a Q6_K weight row with a Q8_K activation row in the arithmetic of the
/// interleaved storage (see the module): per block, exactly in `i32`, `sumi = Σ_j sc[j] Σ (q - 32) ·
/// y` over the 16 sub-blocks; then `acc = fma(sumi · d, dy, acc)` into one `f32` (the product
/// rounded once).
///
/// # Panics
/// If the rows differ in length.
pub fn dot_q6_kx8_q8_k(w: &[BlockQ6K], x: &[BlockQ8K]) -> f32 {
    assert_eq!(w.len(), x.len(), "rows must have the same number of blocks");
    let mut acc = 0f32;
    for (wb, xb) in w.iter().zip(x) {
        let q = wb.quants();
        let mut sumi = 0i32;
        for (j, &scale) in wb.scales.iter().enumerate() {
            let sub: i32 = (16 * j..16 * j + 16)
                .map(|v| (i32::from(q[v]) - 32) * i32::from(xb.qs[q8k_position(v)]))
                .sum();
            sumi += i32::from(scale) * sub;
        }
        let block = sumi as f32 * wb.d.to_f32();
        acc = block.mul_add(xb.d, acc);
    }
    acc
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::{qh_at, ql_at, BlockQ6Kx8, BlockQ8K};
    use crate::formats::q4_k_x8::avx2::{by_chunk, by_const, by_rows, chunks};
    use crate::simd::avx2::{k_quant_prefetch, prefetch_ahead_by, write_group};
    use crate::simd::Window;
    use std::arch::x86_64::*;

    /// A group's scales in registers.
    struct Scales {
        /// Sub-block `j`'s scales, lane `k` for row `k`: as `i32` lanes for the VNNI level
        /// (`vpmulld`), in both `i16` halves of the lane for the AVX2 level (`madd`).
        sc: [__m256i; 16],
        /// `-32 ·` the scales of sub-blocks `2 j` and `2 j + 1` in the low and high `i16` of lane
        /// `k`, for the quants' offset of 32 (at most 32 · 128 = 4096 in magnitude).
        offset: [__m256i; 8],
        d: __m256,
    }

    /// The group's scales; `BOTH`: each scale in both `i16` halves of its lane (AVX2), else as `i32`.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn scales<const BOTH: bool>(g: &BlockQ6Kx8) -> Scales {
        let p = g.scales.as_ptr();
        let mut sc = [_mm256_setzero_si256(); 16];
        for (j, sc) in sc.iter_mut().enumerate() {
            // SAFETY: `scales` is 128 bytes; bytes 8j .. 8j + 8 are in bounds for j < 16.
            *sc = _mm256_cvtepi8_epi32(unsafe { _mm_loadl_epi64(p.add(8 * j).cast()) });
        }
        let minus32 = _mm256_set1_epi16(-32);
        let mut offset = [_mm256_setzero_si256(); 8];
        for (j, o) in offset.iter_mut().enumerate() {
            let pair =
                _mm256_blend_epi16::<0xaa>(sc[2 * j], _mm256_slli_epi32::<16>(sc[2 * j + 1]));
            *o = _mm256_mullo_epi16(pair, minus32);
        }
        if BOTH {
            for sc in &mut sc {
                *sc = _mm256_blend_epi16::<0xaa>(*sc, _mm256_slli_epi32::<16>(*sc));
            }
        }
        // SAFETY: `d` is 8 `u16`, one unaligned 128-bit load.
        let d = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(g.d.as_ptr().cast())) };
        Scales { sc, offset, d }
    }

    /// Bits `2 c .. 2 c + 2` of each byte of `h` moved to bits 4, 5 (the rest masked off by `high`).
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn high_bits(h: __m256i, c: usize, high: __m256i) -> __m256i {
        let h = match c {
            0 => _mm256_slli_epi16::<4>(h),
            1 => _mm256_slli_epi16::<2>(h),
            2 => h,
            _ => _mm256_srli_epi16::<2>(h),
        };
        _mm256_and_si256(h, high)
    }

    /// Sub-block pair `s`'s 8 vectors `V_t` (see the module): the unsigned 6-bit quants.
    ///
    /// # Safety
    /// `s < 8`.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn unpack(g: &BlockQ6Kx8, s: usize) -> [__m256i; 8] {
        let (low, high) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x30));
        // SAFETY: `q` is 1536 bytes; the pair's 192 bytes are in bounds for s < 8 (the caller's
        // contract).
        let (h0, h1) = unsafe {
            (
                _mm256_loadu_si256(g.q.as_ptr().add(qh_at(s)).cast()),
                _mm256_loadu_si256(g.q.as_ptr().add(qh_at(s) + 32).cast()),
            )
        };
        let mut v = [_mm256_setzero_si256(); 8];
        for c in 0..4 {
            // SAFETY: as above, for c < 4.
            let l = unsafe { _mm256_loadu_si256(g.q.as_ptr().add(ql_at(s) + 32 * c).cast()) };
            v[c] = _mm256_or_si256(_mm256_and_si256(l, low), high_bits(h0, c, high));
            v[c + 4] = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(l), low),
                high_bits(h1, c, high),
            );
        }
        v
    }

    /// Sub-blocks `2 s` and `2 s + 1` of one activation row at [`crate::CpuLevel::Avx2`], added to
    /// `acc`: `maddubs` of the vectors `v` against broadcast activation quads (`y` points at the
    /// row's quants `4 s ..`), two at a time summed in `i16` (at most 4 · 63 · 127 = 32004), each
    /// sum `madd`-ed by its sub-block's scales (`sc`: in both `i16` halves of each lane).
    ///
    /// # Safety
    /// The CPU must support AVX2; `y.add(32 * t)` must be 4 readable bytes for t < 8.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn sub_blocks(
        acc: __m256i,
        v: &[__m256i; 8],
        y: *const i8,
        sc: [__m256i; 2],
    ) -> __m256i {
        let mut acc = acc;
        for t in (0..8).step_by(2) {
            // SAFETY: the caller's contract.
            let (w0, w1) = unsafe {
                (
                    y.add(32 * t).cast::<i32>().read_unaligned(),
                    y.add(32 * (t + 1)).cast::<i32>().read_unaligned(),
                )
            };
            let pair = _mm256_add_epi16(
                _mm256_maddubs_epi16(v[t], _mm256_set1_epi32(w0)),
                _mm256_maddubs_epi16(v[t + 1], _mm256_set1_epi32(w1)),
            );
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pair, sc[t / 4]));
        }
        acc
    }

    /// [`sub_blocks`] at [`crate::CpuLevel::Avx512Vnni`]: each sub-block's 4 vectors summed
    /// exactly in `i32` by a chain of `vpdpbusd` (at most 16 · 63 · 127 = 128016) and multiplied by
    /// its scales (`sc`: `i32` lanes) with one `vpmulld`. The same integers, so the same results.
    ///
    /// # Safety
    /// The CPU must support AVX2, F16C, FMA, AVX512F, AVX512VL and AVX512_VNNI; `y` as
    /// [`sub_blocks`].
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni")]
    unsafe fn sub_blocks_vnni(
        acc: __m256i,
        v: &[__m256i; 8],
        y: *const i8,
        sc: [__m256i; 2],
    ) -> __m256i {
        let (mut a, mut b) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        for t in 0..4 {
            // SAFETY: the caller's contract.
            let (wa, wb) = unsafe {
                (
                    y.add(32 * t).cast::<i32>().read_unaligned(),
                    y.add(32 * (t + 4)).cast::<i32>().read_unaligned(),
                )
            };
            a = _mm256_dpbusd_epi32(a, v[t], _mm256_set1_epi32(wa));
            b = _mm256_dpbusd_epi32(b, v[t + 4], _mm256_set1_epi32(wb));
        }
        _mm256_add_epi32(
            acc,
            _mm256_add_epi32(_mm256_mullo_epi32(a, sc[0]), _mm256_mullo_epi32(b, sc[1])),
        )
    }

    /// `acc` plus the offset term of one activation row at [`crate::CpuLevel::Avx2`]: `Σ_j -32 ·
    /// sc[j] · bsums[j]`, pair by pair with `madd` (each at most 2 · 4096 · 2032 in magnitude).
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn offset(acc: __m256i, offset: &[__m256i; 8], x: &BlockQ8K) -> __m256i {
        let mut acc = acc;
        for (j, &o) in offset.iter().enumerate() {
            // SAFETY: `bsums` is 16 `i16`; the pair 2j, 2j + 1 is in bounds for j < 8.
            let pair = unsafe { x.bsums.as_ptr().add(2 * j).cast::<i32>().read_unaligned() };
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(o, _mm256_set1_epi32(pair)));
        }
        acc
    }

    /// [`offset`] at [`crate::CpuLevel::Avx512Vnni`], with `vpdpwssd`.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni")]
    fn offset_vnni(acc: __m256i, offset: &[__m256i; 8], x: &BlockQ8K) -> __m256i {
        let mut acc = acc;
        for (j, &o) in offset.iter().enumerate() {
            // SAFETY: as in `offset`.
            let pair = unsafe { x.bsums.as_ptr().add(2 * j).cast::<i32>().read_unaligned() };
            acc = _mm256_dpwssd_epi32(acc, o, _mm256_set1_epi32(pair));
        }
        acc
    }

    /// The pass compiled once per level: the levels differ in how a sub-block pair's integer lanes
    /// are summed (`$lanes`), how the offset is taken off (`$offset`), and so in how the scales are
    /// held (`$both`).
    macro_rules! level {
        (
            features: $features:literal, pass: $pass:ident, rows: $rows:ident, chunk: $chunk:ident,
            both: $both:literal, lanes: $lanes:ident, offset: $offset:ident $(,)?
        ) => {
            /// [`rows8`] with the pass's row count (1 ..= [`crate::MAX_PASS_ROWS`]) as the
            /// constant.
            ///
            /// # Safety
            #[doc = concat!("The CPU must support `", $features, "`; `nb > 0`; `out` as")]
            /// [`crate::simd::pass_groups`].
            pub(crate) unsafe fn $pass(w: &[BlockQ6Kx8], nb: usize, x: &[BlockQ8K], out: Window) {
                // SAFETY: the caller's contract.
                unsafe { by_rows!(x.len() / nb, $rows(w, nb, x, out)) }
            }

            /// `N` activation rows against the groups of 8 weight rows in `w` (`nb` groups each): per
            /// group the scales unpacked once, then the rows in at most two chunks of at most
            /// [`CHUNK`] ([`rows_of`]).
            ///
            /// # Safety
            #[doc = concat!("The CPU must support `", $features, "`; `out` as")]
            /// [`crate::simd::pass_groups`].
            #[target_feature(enable = $features)]
            unsafe fn $rows<const N: usize>(
                w: &[BlockQ6Kx8],
                nb: usize,
                x: &[BlockQ8K],
                out: Window,
            ) {
                assert_eq!(x.len(), N * nb, "a pass holds N rows of nb blocks");
                let (first, second) = chunks(N);
                let prefetch = k_quant_prefetch(N);
                for (g, groups) in w.chunks_exact(nb).enumerate() {
                    let mut acc = [_mm256_setzero_ps(); N];
                    for (b, group) in groups.iter().enumerate() {
                        if let Some(distance) = prefetch {
                            prefetch_ahead_by(group, distance);
                        }
                        let u = scales::<$both>(group);
                        let (a0, a1) = acc.split_at_mut(first);
                        // SAFETY: the chunks' rows are rows of the pass; the level's features are
                        // enabled here.
                        unsafe {
                            by_chunk!(first, $chunk(group, &u, &x[b..], nb, a0));
                            by_chunk!(second, $chunk(group, &u, &x[first * nb + b..], nb, a1));
                        }
                    }
                    for (r, &a) in acc.iter().enumerate() {
                        // SAFETY: the caller's contract.
                        unsafe { write_group(out, r, g, a) };
                    }
                }
            }

            /// `R` activation rows (row `i`'s block at `x[i * nb]`) against one group: per sub-block
            /// pair its 8 vectors unpacked (again for a second chunk: unpacking them once into L1
            /// for both measured slower) and, per row, the pair's integer lanes (`
            #[doc = stringify!($lanes)]
            /// `); then per row the offset and the float arithmetic of
            /// [`super::dot_q6_kx8_q8_k`] for the 8 rows at once, into `acc[i]`.
            ///
            /// # Safety
            #[doc = concat!("The CPU must support `", $features, "`; `x` must hold")]
            /// `(R - 1) * nb + 1` blocks and `acc` `R` accumulators.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn $chunk<const R: usize>(
                group: &BlockQ6Kx8,
                u: &Scales,
                x: &[BlockQ8K],
                nb: usize,
                acc: &mut [__m256],
            ) {
                let mut sumi = [_mm256_setzero_si256(); R];
                for s in 0..8 {
                    // SAFETY: s < 8.
                    let v = unsafe { unpack(group, s) };
                    let sc = [u.sc[2 * s], u.sc[2 * s + 1]];
                    for (i, sumi) in sumi.iter_mut().enumerate() {
                        // Activation values 32s + 4t .. + 4 lie at positions 32t + 4s .. + 4, in
                        // bounds of the 256 quants for t < 8, s < 8.
                        let y = x[i * nb].qs.as_ptr().wrapping_add(4 * s);
                        // SAFETY: as above; the level's features are enabled here.
                        *sumi = unsafe { $lanes(*sumi, &v, y, sc) };
                    }
                }
                for (i, (sumi, acc)) in sumi.iter().zip(acc.iter_mut()).enumerate() {
                    let xb = &x[i * nb];
                    let total = $offset(*sumi, &u.offset, xb);
                    let block = _mm256_mul_ps(_mm256_cvtepi32_ps(total), u.d);
                    *acc = _mm256_fmadd_ps(block, _mm256_set1_ps(xb.d), *acc);
                }
            }
        };
    }

    level! {
        features: "avx2,f16c,fma", pass: pass8, rows: rows8, chunk: chunk8,
        both: true,
        lanes: sub_blocks, offset: offset,
    }

    level! {
        features: "avx2,f16c,fma,avx512f,avx512vl,avx512vnni", pass: pass8_vnni, rows: rows8_vnni,
        chunk: chunk8_vnni, both: false, lanes: sub_blocks_vnni, offset: offset_vnni,
    }
}

/// The pass at [`crate::CpuLevel::Avx512Zmm`]: the arithmetic and integer lanes of
/// [`avx2::pass8_vnni`] on 512-bit vectors holding two groups side by side (group `2p` in the low
/// half, `2p + 1` in the high one), so each `vpdpbusd` serves 16 weight rows and each broadcast
/// activation quad is loaded once for both. Every lane computes what the 256-bit pass computes for
/// its row, in the same order, so the results are the same bits.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use super::{qh_at, ql_at, BlockQ6Kx8, BlockQ8K};
    use crate::simd::avx512::{join, quads, Pairs};
    use crate::simd::Ahead;
    use crate::simd::Window;
    use std::arch::x86_64::*;

    /// Two groups' scales in registers (group `2p` in the low half, `2p + 1` in the high one).
    pub(crate) struct Scales {
        /// Sub-block `j`'s scales as `i32` lanes.
        sc: [__m512i; 16],
        /// `-32 ·` the scales of sub-blocks `2 j` and `2 j + 1` in the low and high `i16` of each
        /// lane.
        offset: [__m512i; 8],
        d: __m512,
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
    fn scales(g0: &BlockQ6Kx8, g1: &BlockQ6Kx8) -> Scales {
        let (p0, p1) = (g0.scales.as_ptr(), g1.scales.as_ptr());
        let mut sc = [_mm512_setzero_si512(); 16];
        for (j, sc) in sc.iter_mut().enumerate() {
            // SAFETY: `scales` is 128 bytes; bytes 8j .. 8j + 8 are in bounds for j < 16.
            let both = unsafe {
                _mm_unpacklo_epi64(
                    _mm_loadl_epi64(p0.add(8 * j).cast()),
                    _mm_loadl_epi64(p1.add(8 * j).cast()),
                )
            };
            *sc = _mm512_cvtepi8_epi32(both);
        }
        let minus32 = _mm512_set1_epi16(-32);
        let mut offset = [_mm512_setzero_si512(); 8];
        for (j, o) in offset.iter_mut().enumerate() {
            let pair = _mm512_mask_blend_epi16(
                0xaaaa_aaaa,
                sc[2 * j],
                _mm512_slli_epi32::<16>(sc[2 * j + 1]),
            );
            *o = _mm512_mullo_epi16(pair, minus32);
        }
        // SAFETY: `d` is 8 `u16` in each group, one unaligned 128-bit load each.
        let d = unsafe {
            _mm512_cvtph_ps(_mm256_set_m128i(
                _mm_loadu_si128(g1.d.as_ptr().cast()),
                _mm_loadu_si128(g0.d.as_ptr().cast()),
            ))
        };
        Scales { sc, offset, d }
    }

    /// Bits `2 c .. 2 c + 2` of each byte of `h` moved to bits 4, 5 (the rest masked off by `high`).
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
    fn high_bits(h: __m512i, c: usize, high: __m512i) -> __m512i {
        let h = match c {
            0 => _mm512_slli_epi16::<4>(h),
            1 => _mm512_slli_epi16::<2>(h),
            2 => h,
            _ => _mm512_srli_epi16::<2>(h),
        };
        _mm512_and_si512(h, high)
    }

    /// `avx2::offset_vnni` for two groups.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
    fn offset(acc: __m512i, offset: &[__m512i; 8], x: &BlockQ8K) -> __m512i {
        let mut acc = acc;
        for (j, &o) in offset.iter().enumerate() {
            // SAFETY: `bsums` is 16 `i16`; the pair 2j, 2j + 1 is in bounds for j < 8.
            let pair = unsafe { x.bsums.as_ptr().add(2 * j).cast::<i32>().read_unaligned() };
            acc = _mm512_dpwssd_epi32(acc, o, _mm512_set1_epi32(pair));
        }
        acc
    }

    /// Interleaved Q6_K as [`Pairs`].
    pub(crate) struct Q6Kx8;

    impl Pairs for Q6Kx8 {
        type Group = BlockQ6Kx8;
        type Act = BlockQ8K;
        type Unpacked = Scales;
        type Constants = ();

        unsafe fn single(w: &[BlockQ6Kx8], nb: usize, x: &[BlockQ8K], out: Window) {
            // SAFETY: the caller's contract; the level includes the VNNI level's features.
            unsafe { super::avx2::pass8_vnni(w, nb, x, out) }
        }

        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
        unsafe fn constants() {}

        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
        unsafe fn unpack(_: &(), g0: &BlockQ6Kx8, g1: &BlockQ6Kx8) -> Scales {
            scales(g0, g1)
        }

        /// Per sub-block pair `s` the vectors of both groups unpacked, and per row the two sub-blocks'
        /// `vpdpbusd` chains of `avx2::sub_blocks_vnni`, the rows side by side so that neighbouring
        /// instructions do not wait on each other, each chain multiplied by its scales (`vpmulld`);
        /// then per row the offset and the float arithmetic of [`super::dot_q6_kx8_q8_k`] for the 16
        /// weight rows at once, into `acc[i]`.
        ///
        /// # Safety
        /// As [`Pairs::chunk`].
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
        unsafe fn chunk<const R: usize>(
            g0: &BlockQ6Kx8,
            g1: &BlockQ6Kx8,
            u: &Scales,
            x: &[BlockQ8K],
            nb: usize,
            acc: &mut [__m512],
            ahead: Ahead,
        ) {
            let (low, high) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x30));
            let mut sumi = [_mm512_setzero_si512(); R];
            for s in 0..8 {
                let at = qh_at(s);
                ahead.part(s, 8);
                // SAFETY: `q` is 1536 bytes; the pair's 192 bytes are in bounds for s < 8.
                let (h0, h1) = unsafe {
                    (
                        join(g0.q.as_ptr().add(at), g1.q.as_ptr().add(at)),
                        join(g0.q.as_ptr().add(at + 32), g1.q.as_ptr().add(at + 32)),
                    )
                };
                let mut a = [_mm512_setzero_si512(); R];
                let mut b = [_mm512_setzero_si512(); R];
                for c in 0..4 {
                    let at = ql_at(s) + 32 * c;
                    // SAFETY: as above, for c < 4.
                    let l = unsafe { join(g0.q.as_ptr().add(at), g1.q.as_ptr().add(at)) };
                    let lo = _mm512_or_si512(_mm512_and_si512(l, low), high_bits(h0, c, high));
                    let hi = _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16::<4>(l), low),
                        high_bits(h1, c, high),
                    );
                    // Activation values 32s + 4t .. + 4 lie at positions 32t + 4s .. + 4: here
                    // t = c and c + 4.
                    // SAFETY: the caller's contract; 4s + 32c < 128 for s < 8, c < 4.
                    unsafe { quads(&mut a, &mut b, (lo, hi), x, nb, 4 * s + 32 * c) };
                }
                for i in 0..R {
                    sumi[i] = _mm512_add_epi32(
                        sumi[i],
                        _mm512_add_epi32(
                            _mm512_mullo_epi32(a[i], u.sc[2 * s]),
                            _mm512_mullo_epi32(b[i], u.sc[2 * s + 1]),
                        ),
                    );
                }
            }
            for (i, (sumi, acc)) in sumi.iter().zip(acc.iter_mut()).enumerate() {
                let xb = &x[i * nb];
                let total = offset(*sumi, &u.offset, xb);
                let block = _mm512_mul_ps(_mm512_cvtepi32_ps(total), u.d);
                *acc = _mm512_fmadd_ps(block, _mm512_set1_ps(xb.d), *acc);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q6k(seed: u8) -> BlockQ6K {
        let quants: [u8; 256] =
            std::array::from_fn(|v| seed.wrapping_mul(31).wrapping_add(v as u8 * 17) % 64);
        BlockQ6K::from_quants(
            &quants,
            std::array::from_fn(|j| seed.wrapping_mul(29).wrapping_add(j as u8 * 13) as i8),
            F16(0x3c00 + u16::from(seed)),
        )
    }

    /// The two arithmetics of a Q6_K row differ only in how the float operations are grouped: the
    /// same integers, so results agree to a few rounding errors of the sum of magnitudes.
    #[test]
    fn the_grouped_arithmetic_agrees_with_the_per_lane_one() {
        let w: Vec<BlockQ6K> = (0..6).map(|b| q6k(17 * b + 5)).collect();
        super::super::assert_arithmetics_agree(&w, dot_q6_kx8_q8_k, super::super::dot_q6_k_q8_k);
    }

    #[test]
    fn groups_give_back_their_rows() {
        let rows: Vec<BlockQ6K> = (0..8).map(|k| q6k(11 * k + 3)).collect();
        let g = BlockQ6Kx8::pack(std::array::from_fn(|k| &rows[k]));
        for (k, row) in rows.iter().enumerate() {
            assert_eq!(g.row(k), *row);
        }
    }

    #[test]
    fn quants_round_trip_through_their_places() {
        let rows: Vec<BlockQ6K> = (0..8).map(|k| q6k(7 * k + 1)).collect();
        let g = BlockQ6Kx8::pack(std::array::from_fn(|k| &rows[k]));
        for (k, row) in rows.iter().enumerate() {
            let q = row.quants();
            for s in 0..8 {
                for t in 0..8 {
                    for b in 0..4 {
                        // Lane k of vector t of pair s: value 32s + 4t + b.
                        let (c, half) = (t % 4, t / 4);
                        let low = (g.q[ql_at(s) + 32 * c + 4 * k + b] >> (4 * half)) & 0x0f;
                        let high = (g.q[qh_at(s) + 32 * half + 4 * k + b] >> (2 * c)) & 3;
                        assert_eq!(
                            low | (high << 4),
                            q[32 * s + 4 * t + b],
                            "row {k} s {s} t {t}"
                        );
                    }
                }
            }
        }
    }
}
