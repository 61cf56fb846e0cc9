//! Q4_K with 8 weight rows interleaved: the same bytes as 8 blocks of the file, rearranged so that a
//! 32-byte load holds 4 quants of each of the 8 rows, and with one `f32` accumulator per row.
//!
//! A group holds block `b` of weight rows `8g .. 8g + 8`. Its quants are stored sub-block by
//! sub-block: bytes `128 s + 32 c + 4 k + b` (`s < 8`, `c < 4`, `k < 8`, `b < 4`) hold row `k`'s
//! value `32 s + 4 c + b` in their low nibble and value `32 s + 16 + 4 c + b` in their high one. So
//! the 4 loads of sub-block `s` give 8 vectors `V_t` (`t < 8`) whose 4-byte lane `k` is row `k`'s
//! values `32 s + 4 t .. + 4`; against a broadcast of the activation quants of the same 4 values,
//! their products sum, lane by lane, into each row's sub-block sum, with no horizontal reduction.
//! The rows' 12 scale bytes are stored as 3 words side by side (bytes `32 i + 4 k ..` are word `i` of
//! row `k`), so ggml's `get_scale_min_k4` runs on all 8 rows at once in 32-bit lanes.
//!
//! # The arithmetic
//!
//! With the rows in the lanes, a block's float work (the conversion of its integer sums, the
//! multiplications by `d`, `dmin` and the activation's scale) is one vector operation for 8 rows.
//! That needs one number per row and block, so this format has its own reference
//! ([`dot_q4_kx8_q8_k`]): per block the exact `i32` sums `Σ_s sc[s] Σ q y` and `Σ_j m[j] (bsums[2j]
//! + bsums[2j + 1])`, one fused multiply-add with `d` and `-(mins · dmin)`, and one with the
//! activation's `d` into a single `f32` accumulator. [`crate::QMatrix`] stores Q4_K matrices whose
//! row count is a multiple of 8 this way, and every level computes this arithmetic; a Q4_K matrix
//! of other row counts keeps [`crate::formats::dot_q4_k_q8_k`]'s.

use super::{q8k_position, BlockQ4K, BlockQ8K, Interleaved, GROUP_ROWS};
use crate::f16::F16;

/// Block `b` of 8 Q4_K weight rows (1152 bytes, as the 8 blocks), interleaved (see the module).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ4Kx8 {
    /// The rows' super-block scales of the sub-block scales.
    pub d: [F16; GROUP_ROWS],
    /// The rows' super-block scales of the sub-block mins.
    pub dmin: [F16; GROUP_ROWS],
    /// The rows' packed scales and mins: bytes `32 i + 4 k .. + 4` are bytes `4 i .. 4 i + 4` of row
    /// `k`'s ([`BlockQ4K::scales`]).
    pub scales: [u8; 96],
    /// The rows' nibbles, interleaved (see the module).
    pub qs: [u8; 1024],
}

const _: () = assert!(std::mem::size_of::<BlockQ4Kx8>() == 8 * 144);

impl Interleaved for BlockQ4Kx8 {
    type Block = BlockQ4K;

    fn pack(rows: [&BlockQ4K; GROUP_ROWS]) -> Self {
        let mut scales = [0u8; 96];
        let mut qs = [0u8; 1024];
        for (k, row) in rows.iter().enumerate() {
            for (j, &byte) in row.scales.iter().enumerate() {
                scales[32 * (j / 4) + 4 * k + j % 4] = byte;
            }
            for s in 0..8 {
                let q = row.sub_block(s);
                for c in 0..4 {
                    for b in 0..4 {
                        qs[128 * s + 32 * c + 4 * k + b] = q[4 * c + b] | (q[16 + 4 * c + b] << 4);
                    }
                }
            }
        }
        BlockQ4Kx8 {
            d: rows.map(|r| r.d),
            dmin: rows.map(|r| r.dmin),
            scales,
            qs,
        }
    }

    fn row(&self, k: usize) -> BlockQ4K {
        assert!(k < GROUP_ROWS, "a group holds 8 rows");
        let mut qs = [0u8; 128];
        for s in 0..8 {
            for l in 0..32 {
                let (c, high, b) = ((l % 16) / 4, l / 16, l % 4);
                let q = (self.qs[128 * s + 32 * c + 4 * k + b] >> (4 * high)) & 0x0f;
                // Where `BlockQ4K` keeps the quant of value `32 s + l` (see `BlockQ4K::sub_block`).
                let p = q8k_position(32 * s + l);
                qs[32 * (p / 64) + p % 32] |= q << (4 * ((p / 32) % 2));
            }
        }
        BlockQ4K {
            d: self.d[k],
            dmin: self.dmin[k],
            scales: std::array::from_fn(|j| self.scales[32 * (j / 4) + 4 * k + j % 4]),
            qs,
        }
    }
}

/// Reference dot product of a Q4_K weight row with a Q8_K activation row in the arithmetic of the
/// interleaved storage (see the module): per block, exactly in `i32`, `sumi = Σ_s sc[s] Σ q · y`
/// and `mins = Σ_j m[j] · (bsums[2j] + bsums[2j + 1])`; then `acc = fma(fma(sumi, d, -(mins ·
/// dmin)), dy, acc)` into one `f32`.
///
/// # Panics
/// If the rows differ in length.
pub fn dot_q4_kx8_q8_k(w: &[BlockQ4K], x: &[BlockQ8K]) -> f32 {
    assert_eq!(w.len(), x.len(), "rows must have the same number of blocks");
    let mut acc = 0f32;
    for (wb, xb) in w.iter().zip(x) {
        let (sc, m) = wb.scales_mins();
        let mut sumi = 0i32;
        for (s, &scale) in sc.iter().enumerate() {
            let sub: i32 = wb
                .sub_block(s)
                .iter()
                .enumerate()
                .map(|(l, &q)| i32::from(q) * i32::from(xb.qs[q8k_position(32 * s + l)]))
                .sum();
            sumi += i32::from(scale) * sub;
        }
        let mins: i32 = m
            .iter()
            .enumerate()
            .map(|(j, &m)| {
                i32::from(m) * (i32::from(xb.bsums[2 * j]) + i32::from(xb.bsums[2 * j + 1]))
            })
            .sum();
        let block = (sumi as f32).mul_add(wb.d.to_f32(), -(mins as f32 * wb.dmin.to_f32()));
        acc = block.mul_add(xb.d, acc);
    }
    acc
}

/// `sums32[2 i]` and `sums32[2 i + 1]` of `x` as the low and high `i16` of one `i32` (`i < 4`): the
/// activation side of a pair of sub-blocks' mins in one `madd` or `vpdpwssd` lane.
#[cfg(target_arch = "x86_64")]
#[inline]
fn pair_of_sums(x: &BlockQ8K, i: usize) -> i32 {
    let (lo, hi) = (x.sums32[2 * i], x.sums32[2 * i + 1]);
    i32::from(lo as u16) | (i32::from(hi) << 16)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::{BlockQ4Kx8, BlockQ8K};
    use crate::simd::avx2::{k_quant_prefetch, prefetch_ahead_by, write_group};
    use crate::simd::Window;
    use std::arch::x86_64::*;

    /// A group's scales in registers.
    struct Scales {
        /// Sub-block `s`'s scales: `i32` lane `k` holds row `k`'s in both `i16` halves.
        sc: [__m256i; 8],
        /// Mins `2p` and `2p + 1` of row `k` in the low and high `i16` of lane `k`.
        mins: [__m256i; 4],
        d: __m256,
        dmin: __m256,
    }

    /// A `pshufb` pattern that puts byte `lo` of each 32-bit lane in its low `i16` and byte `hi` in
    /// its high one (zero-extended), for one 128-bit lane.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(super) fn spread128(lo: i8, hi: i8) -> __m128i {
        let z = -128i8; // 0x80: a zero byte
        let lane = |l: i8| [4 * l + lo, z, 4 * l + hi, z];
        let [a, b, c, d] = [lane(0), lane(1), lane(2), lane(3)];
        let half = [
            a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3], d[0], d[1],
            d[2], d[3],
        ];
        // SAFETY: `half` is 16 bytes.
        unsafe { _mm_loadu_si128(half.as_ptr().cast()) }
    }

    /// [`spread128`] in both 128-bit lanes.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn spread(lo: i8, hi: i8) -> __m256i {
        let h = spread128(lo, hi);
        _mm256_set_m128i(h, h)
    }

    /// The [`spread`] patterns [`scales`] uses: byte `b` to both halves (`b < 4`), then bytes 0, 1
    /// and 2, 3 paired.
    struct Patterns([__m256i; 6]);

    impl Patterns {
        /// Each scale in both `i16` halves of its lane, for a `madd` (or `vpdpwssd`) of `i16`
        /// sums.
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        fn new() -> Self {
            Patterns([
                spread(0, 0),
                spread(1, 1),
                spread(2, 2),
                spread(3, 3),
                spread(0, 1),
                spread(2, 3),
            ])
        }
    }

    /// ggml's `get_scale_min_k4` for the 8 rows at once (lane `k` for row `k`), then each scale
    /// spread to both `i16` halves and the mins paired.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn scales(g: &BlockQ4Kx8, pat: &Patterns) -> Scales {
        let p = g.scales.as_ptr();
        // SAFETY: `scales` is 96 bytes: three 32-byte loads.
        let (u0, u1, u2) = unsafe {
            (
                _mm256_loadu_si256(p.cast()),
                _mm256_loadu_si256(p.add(32).cast()),
                _mm256_loadu_si256(p.add(64).cast()),
            )
        };
        let (k1, k2, k3) = (
            _mm256_set1_epi32(0x3f3f_3f3f),
            _mm256_set1_epi32(0x0f0f_0f0f),
            _mm256_set1_epi32(0x0303_0303),
        );
        // Bytes of each lane: scales 0..4, scales 4..8, mins 0..4, mins 4..8.
        let sc_lo = _mm256_and_si256(u0, k1);
        let sc_hi = _mm256_or_si256(
            _mm256_and_si256(u2, k2),
            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), k3), 4),
        );
        let m_lo = _mm256_and_si256(u1, k1);
        let m_hi = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi32(u2, 4), k2),
            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), k3), 4),
        );
        let p = &pat.0;
        let sc = std::array::from_fn(|s| {
            let src = if s < 4 { sc_lo } else { sc_hi };
            _mm256_shuffle_epi8(src, p[s % 4])
        });
        let mins = [
            _mm256_shuffle_epi8(m_lo, p[4]),
            _mm256_shuffle_epi8(m_lo, p[5]),
            _mm256_shuffle_epi8(m_hi, p[4]),
            _mm256_shuffle_epi8(m_hi, p[5]),
        ];
        // SAFETY: `d` and `dmin` are 8 `u16` each, one unaligned 128-bit load.
        let (d, dmin) = unsafe {
            (
                _mm256_cvtph_ps(_mm_loadu_si128(g.d.as_ptr().cast())),
                _mm256_cvtph_ps(_mm_loadu_si128(g.dmin.as_ptr().cast())),
            )
        };
        Scales { sc, mins, d, dmin }
    }

    /// Lane `k`: `Σ_j m[j] · sums32[j]` of row `k`, exactly (`sums32[j]` is at most 32 · 127 in
    /// magnitude, so it fits `i16`): per pair of sub-blocks one `madd` against the pair's two
    /// `sums32` broadcast from memory.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn mins(mins: &[__m256i; 4], x: &BlockQ8K) -> __m256i {
        let at = |i: usize| _mm256_set1_epi32(super::pair_of_sums(x, i));
        _mm256_add_epi32(
            _mm256_add_epi32(
                _mm256_madd_epi16(mins[0], at(0)),
                _mm256_madd_epi16(mins[1], at(1)),
            ),
            _mm256_add_epi32(
                _mm256_madd_epi16(mins[2], at(2)),
                _mm256_madd_epi16(mins[3], at(3)),
            ),
        )
    }

    /// Sub-block `s`'s integer lanes for one activation row at [`crate::CpuLevel::Avx2`]: 8
    /// `maddubs` of the unpacked vectors `v` against broadcast activation quads (`y` points at the
    /// row's quants `4 s ..`), summed in `i16` (at most 8 · 2 · 15 · 127 = 30480), and one `madd` by
    /// the 8 rows' scales `sc` (each in both `i16` halves of its lane).
    ///
    /// # Safety
    /// The CPU must support AVX2; `y.add(32 * t)` must be 4 readable bytes for t < 8.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn sub_block_lanes(
        acc: __m256i,
        v: &[__m256i; 8],
        y: *const i8,
        sc: __m256i,
    ) -> __m256i {
        let mut sum = _mm256_setzero_si256();
        for (t, &v) in v.iter().enumerate() {
            // SAFETY: the caller's contract.
            let word = unsafe { y.add(32 * t).cast::<i32>().read_unaligned() };
            sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(v, _mm256_set1_epi32(word)));
        }
        _mm256_add_epi32(acc, _mm256_madd_epi16(sum, sc))
    }

    /// [`sub_block_lanes`] at [`crate::CpuLevel::Avx512Vnni`]: the same products summed exactly in
    /// `i32` by `vpdpbusd`, in two chains of 4 vectors (each at most 16 · 15 · 127 = 30480, so it
    /// fits `i16`); the second chain moves to the high `i16` of each lane beside the first's low
    /// one, and one `vpdpwssd` by the scales (in both halves, as for [`sub_block_lanes`]) adds both.
    /// The same integers, so the same results, in 11 vector instructions instead of 18, 9 of them
    /// on the multiply pipes (a second `vpdpwssd` in place of the shift and the blend measured
    /// slower).
    ///
    /// # Safety
    /// The CPU must support AVX2, F16C, FMA, AVX512F, AVX512VL and AVX512_VNNI; `y` as
    /// [`sub_block_lanes`].
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni")]
    unsafe fn sub_block_lanes_vnni(
        acc: __m256i,
        v: &[__m256i; 8],
        y: *const i8,
        sc: __m256i,
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
        let ab = _mm256_blend_epi16::<0xaa>(a, _mm256_slli_epi32::<16>(b));
        _mm256_dpwssd_epi32(acc, ab, sc)
    }

    /// The most activation rows whose sums a pass keeps in registers at once (here and in
    /// [`crate::formats::q6_k_x8`]).
    pub(crate) const CHUNK: usize = 8;

    /// `$f::<K>(args)` for the first constant `K` of the list equal to `$n`; nothing if none is.
    macro_rules! by_const {
        ($n:expr, $f:ident $args:tt, [$($k:literal),*]) => {
            match $n {
                $($k => $f::<$k> $args,)*
                _ => {}
            }
        };
    }
    pub(crate) use by_const;

    /// `$f::<N>(args)` for the pass's row count `N` (1 ..= [`crate::MAX_PASS_ROWS`]).
    macro_rules! by_rows {
        ($n:expr, $f:ident $args:tt) => {
            by_const!($n, $f $args, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16])
        };
    }
    pub(crate) use by_rows;

    /// `$f::<R>(args)` for a chunk's row count `R` (0: nothing; 1 ..= [`CHUNK`]).
    macro_rules! by_chunk {
        ($n:expr, $f:ident $args:tt) => {
            by_const!($n, $f $args, [1, 2, 3, 4, 5, 6, 7, 8])
        };
    }
    pub(crate) use by_chunk;

    /// How a pass of `n` rows (at most 2 · [`CHUNK`]) splits into two chunks that each keep their
    /// sums in registers: all in the first up to [`CHUNK`], else halves (9 rows as 5 + 4). Each
    /// chunk's size is a constant of its code ([`by_chunk`]), so its row loop unrolls.
    pub(crate) const fn chunks(n: usize) -> (usize, usize) {
        if n <= CHUNK {
            (n, 0)
        } else {
            (n.div_ceil(2), n / 2)
        }
    }

    /// The pass compiled once per level: the levels differ only in how a sub-block's integer lanes
    /// are summed (`$lanes`).
    macro_rules! level {
        (
            features: $features:literal, pass: $pass:ident, rows: $rows:ident, chunk: $chunk:ident,
            lanes: $lanes:ident $(,)?
        ) => {
            /// [`rows8`] with the pass's row count (1 ..= [`crate::MAX_PASS_ROWS`]) as the
            /// constant.
            ///
            /// # Safety
            #[doc = concat!("The CPU must support `", $features, "`; `nb > 0`; `out` as")]
            /// [`crate::simd::pass_groups`].
            pub(crate) unsafe fn $pass(w: &[BlockQ4Kx8], nb: usize, x: &[BlockQ8K], out: Window) {
                // SAFETY: the caller's contract.
                unsafe { by_rows!(x.len() / nb, $rows(w, nb, x, out)) }
            }

            /// `N` activation rows against the groups of 8 weight rows in `w` (`nb` groups each): per
            /// group the scales unpacked once, then the rows in at most two chunks of at most
            /// [`CHUNK`] ([`chunks`]).
            ///
            /// # Safety
            #[doc = concat!("The CPU must support `", $features, "`; `out` as")]
            /// [`crate::simd::pass_groups`].
            #[target_feature(enable = $features)]
            unsafe fn $rows<const N: usize>(
                w: &[BlockQ4Kx8],
                nb: usize,
                x: &[BlockQ8K],
                out: Window,
            ) {
                assert_eq!(x.len(), N * nb, "a pass holds N rows of nb blocks");
                let pat = Patterns::new();
                let (first, second) = chunks(N);
                let prefetch = k_quant_prefetch(N);
                for (g, groups) in w.chunks_exact(nb).enumerate() {
                    let mut acc = [_mm256_setzero_ps(); N];
                    for (b, group) in groups.iter().enumerate() {
                        if let Some(distance) = prefetch {
                            prefetch_ahead_by(group, distance);
                        }
                        let u = scales(group, &pat);
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

            /// `R` activation rows (row `i`'s block at `x[i * nb]`) against one group: per
            /// sub-block its 8 vectors unpacked (again for a second chunk, from L1) and, per row,
            /// the sub-block's integer lanes (`
            #[doc = stringify!($lanes)]
            /// `); then per row the float arithmetic of [`super::dot_q4_kx8_q8_k`] for the 8 rows
            /// at once, into `acc[i]`.
            ///
            /// # Safety
            #[doc = concat!("The CPU must support `", $features, "`; `x` must hold")]
            /// `(R - 1) * nb + 1` blocks and `acc` `R` accumulators.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn $chunk<const R: usize>(
                group: &BlockQ4Kx8,
                u: &Scales,
                x: &[BlockQ8K],
                nb: usize,
                acc: &mut [__m256],
            ) {
                let low = _mm256_set1_epi8(0x0f);
                let mut sumi = [_mm256_setzero_si256(); R];
                for (s, &sc) in u.sc.iter().enumerate() {
                    let mut v = [_mm256_setzero_si256(); 8];
                    for c in 0..4 {
                        // SAFETY: `qs` is 1024 bytes; bytes 128s + 32c .. + 32 are in bounds for
                        // s < 8, c < 4.
                        let q = unsafe {
                            _mm256_loadu_si256(group.qs.as_ptr().add(128 * s + 32 * c).cast())
                        };
                        v[c] = _mm256_and_si256(q, low);
                        v[c + 4] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
                    }
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
                    let m = _mm256_cvtepi32_ps(mins(&u.mins, xb));
                    let block =
                        _mm256_fmsub_ps(_mm256_cvtepi32_ps(*sumi), u.d, _mm256_mul_ps(m, u.dmin));
                    *acc = _mm256_fmadd_ps(block, _mm256_set1_ps(xb.d), *acc);
                }
            }
        };
    }

    level! {
        features: "avx2,f16c,fma", pass: pass8, rows: rows8, chunk: chunk8,
        lanes: sub_block_lanes,
    }

    level! {
        features: "avx2,f16c,fma,avx512f,avx512vl,avx512vnni", pass: pass8_vnni, rows: rows8_vnni,
        chunk: chunk8_vnni, lanes: sub_block_lanes_vnni,
    }
}

/// The pass at [`crate::CpuLevel::Avx512Zmm`]: the arithmetic and integer lanes of
/// [`avx2::pass8_vnni`] on 512-bit vectors holding two groups side by side (group `2p` in the low
/// half, `2p + 1` in the high one), so each `vpdpbusd` serves 16 weight rows and the broadcast
/// activation quads are loaded once for both. Every lane computes what the 256-bit pass computes
/// for its row, in the same order, so the results are the same bits.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use super::{BlockQ4Kx8, BlockQ8K};
    use crate::simd::avx512::{join, quads, Pairs};
    use crate::simd::Ahead;
    use crate::simd::Window;
    use std::arch::x86_64::*;

    /// Two groups' scales in registers: the lanes of [`super::avx2`]'s `Scales`, group `2p` in the
    /// low half and `2p + 1` in the high one.
    pub(crate) struct Scales {
        /// Sub-block `s`'s scales: `i32` lane `k` holds row `k`'s in both `i16` halves.
        pub(crate) sc: [__m512i; 8],
        /// Mins `2p` and `2p + 1` of row `k` in the low and high `i16` of lane `k`.
        pub(crate) mins: [__m512i; 4],
        pub(crate) d: __m512,
        pub(crate) dmin: __m512,
    }

    /// `avx2::spread128` in all four 128-bit lanes.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
    fn spread(lo: i8, hi: i8) -> __m512i {
        _mm512_broadcast_i32x4(super::avx2::spread128(lo, hi))
    }

    /// The [`spread`] patterns [`scales`] uses (as in [`super::avx2`]).
    pub(crate) struct Patterns([__m512i; 6]);

    impl Patterns {
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
        pub(crate) fn new() -> Self {
            Patterns([
                spread(0, 0),
                spread(1, 1),
                spread(2, 2),
                spread(3, 3),
                spread(0, 1),
                spread(2, 3),
            ])
        }
    }

    /// ggml's `get_scale_min_k4` for the 16 rows of two groups at once (see [`super::avx2`]).
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
    pub(crate) fn scales(g0: &BlockQ4Kx8, g1: &BlockQ4Kx8, pat: &Patterns) -> Scales {
        let (p0, p1) = (g0.scales.as_ptr(), g1.scales.as_ptr());
        // SAFETY: `scales` is 96 bytes: three 32-byte loads from each group.
        let (u0, u1, u2) = unsafe {
            (
                join(p0, p1),
                join(p0.add(32), p1.add(32)),
                join(p0.add(64), p1.add(64)),
            )
        };
        let (k1, k2, k3) = (
            _mm512_set1_epi32(0x3f3f_3f3f),
            _mm512_set1_epi32(0x0f0f_0f0f),
            _mm512_set1_epi32(0x0303_0303),
        );
        // Bytes of each lane: scales 0..4, scales 4..8, mins 0..4, mins 4..8.
        let sc_lo = _mm512_and_si512(u0, k1);
        let sc_hi = _mm512_or_si512(
            _mm512_and_si512(u2, k2),
            _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(u0), k3)),
        );
        let m_lo = _mm512_and_si512(u1, k1);
        let m_hi = _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi32::<4>(u2), k2),
            _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(u1), k3)),
        );
        let p = &pat.0;
        let sc = std::array::from_fn(|s| {
            let src = if s < 4 { sc_lo } else { sc_hi };
            _mm512_shuffle_epi8(src, p[s % 4])
        });
        let mins = [
            _mm512_shuffle_epi8(m_lo, p[4]),
            _mm512_shuffle_epi8(m_lo, p[5]),
            _mm512_shuffle_epi8(m_hi, p[4]),
            _mm512_shuffle_epi8(m_hi, p[5]),
        ];
        // SAFETY: `d` and `dmin` are 8 `u16` each, one unaligned 128-bit load per group.
        let half = |a: &[crate::f16::F16; 8], b: &[crate::f16::F16; 8]| unsafe {
            _mm512_cvtph_ps(_mm256_set_m128i(
                _mm_loadu_si128(b.as_ptr().cast()),
                _mm_loadu_si128(a.as_ptr().cast()),
            ))
        };
        Scales {
            sc,
            mins,
            d: half(&g0.d, &g1.d),
            dmin: half(&g0.dmin, &g1.dmin),
        }
    }

    /// Lane `k` of each half: `Σ_j m[j] · sums32[j]` of that group's row `k`, exactly: one `madd`
    /// and three `vpdpwssd`, each against a pair of `sums32` broadcast from memory.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
    fn mins(mins: &[__m512i; 4], x: &BlockQ8K) -> __m512i {
        let at = |i: usize| _mm512_set1_epi32(super::pair_of_sums(x, i));
        let m = _mm512_madd_epi16(mins[0], at(0));
        let m = _mm512_dpwssd_epi32(m, mins[1], at(1));
        let m = _mm512_dpwssd_epi32(m, mins[2], at(2));
        _mm512_dpwssd_epi32(m, mins[3], at(3))
    }

    /// The float arithmetic of [`super::dot_q4_kx8_q8_k`] for one activation block and the 16
    /// weight rows of a pair of groups: `acc += (sumi · d - mins · dmin) · x.d`, `sumi` the
    /// block's scaled integer sums and the mins from `x`'s sums of 32 values. Every 512-bit pass
    /// (on vectors or on tiles) ends a block with it, so they round alike.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
    pub(crate) fn finish_block(u: &Scales, sumi: __m512i, x: &BlockQ8K, acc: &mut __m512) {
        let m = _mm512_cvtepi32_ps(mins(&u.mins, x));
        let block = _mm512_fmsub_ps(_mm512_cvtepi32_ps(sumi), u.d, _mm512_mul_ps(m, u.dmin));
        *acc = _mm512_fmadd_ps(block, _mm512_set1_ps(x.d), *acc);
    }

    /// Interleaved Q4_K as [`Pairs`].
    pub(crate) struct Q4Kx8;

    impl Pairs for Q4Kx8 {
        type Group = BlockQ4Kx8;
        type Act = BlockQ8K;
        type Unpacked = Scales;
        type Constants = Patterns;

        unsafe fn single(w: &[BlockQ4Kx8], nb: usize, x: &[BlockQ8K], out: Window) {
            // SAFETY: the caller's contract; the level includes the VNNI level's features.
            unsafe { super::avx2::pass8_vnni(w, nb, x, out) }
        }

        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
        unsafe fn constants() -> Patterns {
            Patterns::new()
        }

        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
        unsafe fn unpack(pat: &Patterns, g0: &BlockQ4Kx8, g1: &BlockQ4Kx8) -> Scales {
            scales(g0, g1, pat)
        }

        /// Per sub-block the vectors of both groups unpacked, and per row the sub-block's integer
        /// lanes as `avx2::sub_block_lanes_vnni` sums them; then per row the float arithmetic of
        /// [`super::dot_q4_kx8_q8_k`] for the 16 weight rows at once, into `acc[i]`.
        ///
        /// # Safety
        /// As [`Pairs::chunk`].
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
        unsafe fn chunk<const R: usize>(
            g0: &BlockQ4Kx8,
            g1: &BlockQ4Kx8,
            u: &Scales,
            x: &[BlockQ8K],
            nb: usize,
            acc: &mut [__m512],
            ahead: Ahead,
        ) {
            let low = _mm512_set1_epi8(0x0f);
            let mut sumi = [_mm512_setzero_si512(); R];
            for (s, &sc) in u.sc.iter().enumerate() {
                ahead.part(s, 8);
                // Per row, `avx2::sub_block_lanes_vnni`'s two `vpdpbusd` chains (vectors 0..4 and
                // 4..8, each activation quad broadcast to all 16 lanes), the rows side by side so that
                // neighbouring instructions do not wait on each other.
                let mut a = [_mm512_setzero_si512(); R];
                let mut b = [_mm512_setzero_si512(); R];
                for c in 0..4 {
                    let at = 128 * s + 32 * c;
                    // SAFETY: `qs` is 1024 bytes; bytes 128s + 32c .. + 32 are in bounds for s < 8,
                    // c < 4.
                    let q = unsafe { join(g0.qs.as_ptr().add(at), g1.qs.as_ptr().add(at)) };
                    let lo = _mm512_and_si512(q, low);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), low);
                    // Activation values 32s + 4t .. + 4 lie at positions 32t + 4s .. + 4: here
                    // t = c and c + 4.
                    // SAFETY: the caller's contract; 4s + 32c < 128 for s < 8, c < 4.
                    unsafe { quads(&mut a, &mut b, (lo, hi), x, nb, 4 * s + 32 * c) };
                }
                for i in 0..R {
                    // The odd `i16` (each lane's high half) from `b << 16`, the even ones from `a`,
                    // times the sub-block's scales.
                    let ab =
                        _mm512_mask_blend_epi16(0xaaaa_aaaa, a[i], _mm512_slli_epi32::<16>(b[i]));
                    sumi[i] = _mm512_dpwssd_epi32(sumi[i], ab, sc);
                }
            }
            for (i, (&sumi, acc)) in sumi.iter().zip(acc.iter_mut()).enumerate() {
                finish_block(u, sumi, &x[i * nb], acc);
            }
        }
    }
}

/// The interleaved Q4_K pass at [`crate::CpuLevel::Amx`] ([`crate::amx::pass`]): per pair of
/// groups, block and sub-block, one tile product of the pass's activation rows (up to 16) by the
/// pair's 16 weight rows gives each (row, weight row)'s exact sub-block sum; 512-bit vectors unpack
/// the weights for it and then do, per activation row, what [`avx512`]'s pass does with its sums:
/// the scales, the mins and the float arithmetic of [`dot_q4_kx8_q8_k`], in the same order, so
/// the results are the same bits.
#[cfg(target_arch = "x86_64")]
pub(crate) mod amx {
    use super::avx512::{finish_block, scales, Patterns};
    use super::{BlockQ4Kx8, BlockQ8K};
    use crate::amx::{TileFormat, Tiles, FOLDED_BYTES};
    use crate::simd::avx512::{join, write_pair};
    use crate::simd::{Ahead, Window};
    use std::arch::x86_64::*;

    /// Interleaved Q4_K as [`TileFormat`].
    pub(crate) struct Q4Kx8;

    impl TileFormat for Q4Kx8 {
        type Group = BlockQ4Kx8;
        type Constants = Patterns;

        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
        unsafe fn constants() -> Patterns {
            Patterns::new()
        }

        /// Sub-block `s`'s tile: row `t` is the vector `V_t` of both groups (the low nibbles of
        /// load `t` for `t < 4`, the high ones of load `t - 4` after).
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
        unsafe fn unpack(g0: &BlockQ4Kx8, g1: &BlockQ4Kx8, tiles: &mut [u8; 4096], ahead: Ahead) {
            let low = _mm512_set1_epi8(0x0f);
            for s in 0..8 {
                ahead.part(s, 8);
                for c in 0..4 {
                    let at = 128 * s + 32 * c;
                    // SAFETY: `qs` is 1024 bytes; bytes at .. at + 32 are in bounds for s < 8,
                    // c < 4; rows c and c + 4 of sub-block s's 512 bytes lie in the 4096.
                    unsafe {
                        let q = join(g0.qs.as_ptr().add(at), g1.qs.as_ptr().add(at));
                        let row = tiles.as_mut_ptr().add(512 * s);
                        _mm512_storeu_si512(row.add(64 * c).cast(), _mm512_and_si512(q, low));
                        _mm512_storeu_si512(
                            row.add(64 * (c + 4)).cast(),
                            _mm512_and_si512(_mm512_srli_epi16::<4>(q), low),
                        );
                    }
                }
            }
        }

        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
        unsafe fn finish(
            pat: &Patterns,
            g0: &BlockQ4Kx8,
            g1: &BlockQ4Kx8,
            c: &[[i32; 256]; 8],
            x: &[BlockQ8K],
            nb: usize,
            n: usize,
            acc: &mut [__m512; 16],
        ) {
            let u = scales(g0, g1, pat);
            let low16 = _mm512_set1_epi32(0xffff);
            let sc: [__m512i; 8] = std::array::from_fn(|s| _mm512_and_si512(u.sc[s], low16));
            for (i, acc) in acc.iter_mut().enumerate().take(n) {
                let mut sumi = _mm512_setzero_si512();
                for (c, &sc) in c.iter().zip(&sc) {
                    // SAFETY: row i < 16 of a 16 × 16 `i32` tile.
                    let c = unsafe { _mm512_loadu_si512(c.as_ptr().add(16 * i).cast()) };
                    sumi = _mm512_add_epi32(sumi, _mm512_mullo_epi32(c, sc));
                }
                finish_block(&u, sumi, &x[i * nb], acc);
            }
        }

        unsafe fn single(w: &[BlockQ4Kx8], nb: usize, x: &[BlockQ8K], out: Window) {
            // SAFETY: the caller's contract; the level includes the VNNI level's features.
            unsafe { super::avx2::pass8_vnni(w, nb, x, out) }
        }
    }

    /// Activation rows per tile product of [`gemm`].
    pub(crate) const SLAB: usize = 16;

    /// The weights of a block of a pair of groups, unpacked ([`Q4Kx8::unpack`] into `plain`) and
    /// multiplied by the two parts of their sub-block's scale ([`FOLDED_BYTES`]): `scale >> 3`
    /// into `folded[..4096]`, `scale & 7` into `folded[4096..]`. A 16-bit lane holds two values
    /// of one weight row, so one `vpmullw` by the part multiplies both bytes exactly (each product
    /// is at most 105, no carry reaches the high byte).
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
    unsafe fn fold(u: &super::avx512::Scales, plain: &[u8; 4096], folded: &mut [u8; FOLDED_BYTES]) {
        let seven = _mm512_set1_epi16(7);
        for (s, &sc) in u.sc.iter().enumerate() {
            let (hi, lo) = (_mm512_srli_epi16::<3>(sc), _mm512_and_si512(sc, seven));
            for t in 0..8 {
                let at = 512 * s + 64 * t;
                // SAFETY: `at + 64 <= 4096`, in both buffers' halves.
                unsafe {
                    let v = _mm512_loadu_si512(plain.as_ptr().add(at).cast());
                    let out = folded.as_mut_ptr().add(at);
                    _mm512_storeu_si512(out.cast(), _mm512_mullo_epi16(v, hi));
                    _mm512_storeu_si512(out.add(4096).cast(), _mm512_mullo_epi16(v, lo));
                }
            }
        }
    }

    /// `x.len() / nb` activation rows, a multiple of [`SLAB`], against the groups of 8 weight rows
    /// in `w` (`nb` blocks each), two groups at a time on the tiles, with each block's weights
    /// unpacked and scaled once for all the rows ([`fold`]): per block and slab of 16 rows,
    /// [`Tiles::folded`] gives each (row, weight row)'s `Σ_j scale_j · sum_j` as its high and low
    /// parts, `8 · high + low` is the same integer the 512-bit pass makes, and [`finish_block`]
    /// does its float arithmetic, so the results are the same bits. A last odd group goes through
    /// the 256-bit VNNI pass, a slab at a time. `natural` holds the rows' quants in natural order
    /// ([`crate::amx::natural_order`]).
    ///
    /// # Safety
    /// The CPU must support [`crate::CpuLevel::Amx`] (for [`crate::amx::Hardware`]; the
    /// [`crate::CpuLevel::Avx512Zmm`] features for another `T`); `nb > 0`; `out` as
    /// [`crate::simd::pass_groups`].
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
    pub(crate) unsafe fn gemm<T: Tiles>(
        tiles: &mut T,
        w: &[BlockQ4Kx8],
        nb: usize,
        x: &[BlockQ8K],
        natural: &[i8],
        out: Window,
    ) {
        let n = x.len() / nb;
        assert!(
            n > 0 && n.is_multiple_of(SLAB) && x.len() == n * nb && natural.len() == 256 * x.len(),
            "a gemm holds whole slabs of nb blocks and their natural quants"
        );
        let slabs = n / SLAB;
        let groups = w.len() / nb;
        let pat = Patterns::new();
        let stride = 256 * nb;
        #[repr(C, align(64))]
        struct Buffers {
            plain: [u8; 4096],
            folded: [u8; FOLDED_BYTES],
        }
        let mut buf = Buffers {
            plain: [0; 4096],
            folded: [0; FOLDED_BYTES],
        };
        // Per slab its 512 sums, two slabs side by side for `folded_pair`.
        let mut sums = vec![0i32; 512 * slabs];
        let mut acc = vec![_mm512_setzero_ps(); n];
        // The float arithmetic of slab `slab`'s rows for block `b`, from its stored sums.
        let finish =
            |u: &super::avx512::Scales, sums: &[i32], acc: &mut [__m512], slab: usize, b: usize| {
                for i in 0..SLAB {
                    let r = SLAB * slab + i;
                    // SAFETY: rows i < 16 of the slab's two 16 × 16 `i32` halves.
                    let (hi, lo) = unsafe {
                        let at = sums.as_ptr().add(512 * slab + 16 * i);
                        (
                            _mm512_loadu_si512(at.cast()),
                            _mm512_loadu_si512(at.add(256).cast()),
                        )
                    };
                    let sumi = _mm512_add_epi32(_mm512_slli_epi32::<3>(hi), lo);
                    finish_block(u, sumi, &x[r * nb + b], &mut acc[r]);
                }
            };
        // SAFETY: the caller's contract.
        unsafe { tiles.configure_folded() };
        for p in 0..groups / 2 {
            for b in 0..nb {
                let (g0, g1) = (&w[2 * p * nb + b], &w[(2 * p + 1) * nb + b]);
                let ahead = Ahead::pair(w.as_ptr().wrapping_add(2 * (p + 1) * nb), b);
                let u = scales(g0, g1, &pat);
                // SAFETY: the caller's contract.
                unsafe {
                    Q4Kx8::unpack(g0, g1, &mut buf.plain, ahead);
                    fold(&u, &buf.plain, &mut buf.folded);
                }
                // Two slabs at a time; the vectors finish the last two while the tiles multiply.
                for first in (0..slabs).step_by(2) {
                    let a = natural
                        .as_ptr()
                        .wrapping_add(SLAB * first * stride + 256 * b);
                    let c = sums.as_mut_ptr().wrapping_add(512 * first);
                    // SAFETY: the tiles are configured; the slabs' rows' quants of block b (256
                    // bytes at a + i · stride) lie in `natural`; the folded weights are
                    // FOLDED_BYTES and each slab's sums 512 `i32`.
                    unsafe {
                        if first + 1 < slabs {
                            tiles.folded_pair(a, stride, buf.folded.as_ptr(), c);
                        } else {
                            tiles.folded(a, stride, buf.folded.as_ptr(), c);
                        }
                    }
                    if first >= 2 {
                        finish(&u, &sums, &mut acc, first - 2, b);
                        finish(&u, &sums, &mut acc, first - 1, b);
                    }
                }
                let last = (slabs - 1) / 2 * 2;
                for slab in last..slabs {
                    finish(&u, &sums, &mut acc, slab, b);
                }
            }
            for (r, a) in acc.iter_mut().enumerate() {
                // SAFETY: the caller's contract.
                unsafe { write_pair(out, r, 2 * p, *a) };
                *a = _mm512_setzero_ps();
            }
        }
        // SAFETY: the caller's contract.
        unsafe { tiles.release() };
        if groups % 2 == 1 {
            let g = groups - 1;
            for slab in 0..slabs {
                let rows = SLAB * slab * nb..SLAB * (slab + 1) * nb;
                let window = Window {
                    out: crate::simd::Out {
                        ptr: out.out.ptr.wrapping_add(SLAB * slab * out.out.stride),
                        stride: out.out.stride,
                    },
                    ..out
                };
                // SAFETY: the caller's contract, for the slab's rows.
                unsafe { Q4Kx8::single(&w[g * nb..], nb, &x[rows], window.past_groups(g)) };
            }
        }
    }
}

/// Weights and checks for the tests: here and [`crate::testing`]'s layout checks.
#[cfg(any(test, feature = "testing"))]
pub(crate) mod testing {
    use super::*;

    /// A Q4_K block from `seed`: its scale bytes cover every 6-bit scale and minimum over a few
    /// seeds.
    pub(crate) fn q4k(seed: u8) -> BlockQ4K {
        BlockQ4K {
            d: F16(0x3c00 + u16::from(seed)),
            dmin: F16(0x3800 + u16::from(seed)),
            scales: std::array::from_fn(|i| seed.wrapping_mul(29).wrapping_add(i as u8 * 13)),
            qs: std::array::from_fn(|i| seed.wrapping_mul(31).wrapping_add(i as u8 * 17)),
        }
    }

    /// [`amx::gemm`] on `tiles` for each row count in `counts` against `rows` (weight rows of `nb`
    /// blocks, five groups of 8), over the whole window and over one that cuts groups, compared
    /// with the reference bit for bit.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn check_gemm<T: crate::amx::Tiles>(
        rows: &[BlockQ4K],
        nb: usize,
        tiles: &mut T,
        counts: &[usize],
    ) {
        use crate::simd::{Out, Window};
        let (groups, w) = crate::amx::five_groups::<BlockQ4Kx8>(rows, nb);
        let mut next = crate::amx::values(987);
        for &n in counts {
            let values: Vec<f32> = (0..n * nb * 256).map(|_| next()).collect();
            let mut x = vec![BlockQ8K::ZERO; n * nb];
            crate::quantize_row_q8_k(&values, &mut x);
            let natural = crate::amx::natural_order(&x);
            for (skip, len) in [(0, 8 * groups), (3, 8 * groups - 7)] {
                // A wider output: the columns past the window stay as they were.
                let stride = len + 5;
                let mut out = vec![f32::NAN; n * stride];
                let window = Window {
                    out: Out {
                        ptr: out.as_mut_ptr(),
                        stride,
                    },
                    skip,
                    len,
                };
                // SAFETY: the caller checked the level's features; `out` holds every (row,
                // column) of the window.
                unsafe { amx::gemm(tiles, &w, nb, &x, &natural, window) };
                for i in 0..n {
                    for c in 0..stride {
                        let got = out[i * stride + c];
                        if c >= len {
                            assert!(
                                got.is_nan(),
                                "rows {n}, row {i}, column {c} past the window"
                            );
                            continue;
                        }
                        let want =
                            dot_q4_kx8_q8_k(&rows[(skip + c) * nb..][..nb], &x[i * nb..][..nb]);
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "rows {n}, row {i}, column {c}, skip {skip}"
                        );
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::q4k;
    use super::*;

    /// The two arithmetics of a Q4_K row differ only in how the float operations are grouped: the
    /// same integers, so results agree to a few rounding errors of the sum of magnitudes.
    #[test]
    fn the_grouped_arithmetic_agrees_with_the_per_lane_one() {
        let w: Vec<BlockQ4K> = (0..6).map(|b| q4k(17 * b + 5)).collect();
        super::super::assert_arithmetics_agree(&w, dot_q4_kx8_q8_k, super::super::dot_q4_k_q8_k);
    }

    #[test]
    fn groups_give_back_their_rows() {
        let rows: Vec<BlockQ4K> = (0..8).map(|k| q4k(11 * k + 3)).collect();
        let g = BlockQ4Kx8::pack(std::array::from_fn(|k| &rows[k]));
        for (k, row) in rows.iter().enumerate() {
            assert_eq!(g.row(k), *row);
        }
    }

    #[test]
    fn lanes_hold_each_rows_values() {
        let rows: Vec<BlockQ4K> = (0..8).map(|k| q4k(7 * k + 1)).collect();
        let g = BlockQ4Kx8::pack(std::array::from_fn(|k| &rows[k]));
        for (k, row) in rows.iter().enumerate() {
            for s in 0..8 {
                let q = row.sub_block(s);
                for t in 0..8 {
                    for b in 0..4 {
                        let byte = g.qs[128 * s + 32 * (t % 4) + 4 * k + b];
                        let nibble = if t < 4 { byte & 0x0f } else { byte >> 4 };
                        assert_eq!(nibble, q[4 * t + b], "row {k} sub-block {s} t {t} b {b}");
                    }
                }
            }
        }
    }
}
