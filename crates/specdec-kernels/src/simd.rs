//! The multi-row loop, written once, compiled per CPU level and shared by every weight format.
//!
//! For each weight row (output column) of the requested range, each weight block is unpacked once and
//! then dotted against the same block of every activation row of the pass. The per-(row, column)
//! arithmetic is the reference lane arithmetic of [`crate::formats`] and does not depend on how many
//! rows share the pass, so results are row-independent.

use crate::dispatch::CpuLevel;
use crate::formats::{
    dot_q4_0_q8_0, dot_q4_k_q8_k, dot_q4_kx8_q8_k, dot_q5_0_q8_0, dot_q6_k_q8_k, dot_q6_kx8_q8_k,
    dot_q8_0_q8_0, ActQ8_0, BlockQ4K, BlockQ4Kx8, BlockQ4_0, BlockQ4_0x8, BlockQ5_0, BlockQ5_0x8,
    BlockQ6K, BlockQ6Kx8, BlockQ8K, BlockQ8_0, Interleaved, GROUP_ROWS,
};

/// Most activation rows dotted against one unpacked weight block.
pub const MAX_PASS_ROWS: usize = 16;

/// From how many activation rows [`CpuLevel::Avx512Zmm`] and [`CpuLevel::Avx512ZmmK`] run the
/// 512-bit passes; smaller passes take the 256-bit VNNI ones. Both give the same bits, so the
/// choice is only about speed: measured with `step_time` on the 1.5B target (Xeon, AVX-512 VNNI,
/// stop 33), single-token steps ran 7–10% slower on the 512-bit passes (memory-bound: a pair of
/// groups is read as two streams), 2 to 6 rows about as fast or slower, 8 and 16 rows and prefill
/// faster. Since the 512-bit pass
/// spreads its prefetches ([`Ahead`], stop 39), 6- and 7-token target blocks run 3–7% faster on it
/// (`step_time`, 2 alternations: 60–62 against 63–64 ms, 66 against 70), 4 and 5 as fast or
/// slower, single tokens slower.
pub(crate) const ZMM_FROM_ROWS: usize = 6;

/// [`ZMM_FROM_ROWS`] for [`CpuLevel::Avx512ZmmK`] (AMD): measured on Zen 4 with `step_time` on the
/// 1.5B target, steps alternating between 256-bit and 512-bit passes in one run (stop 42): 5-token
/// blocks 6% faster on the 512-bit passes at context 200 (43.0, 43.4 against 40.5, 41.1 ms) and 1–3%
/// at 1000, 4-token blocks 1–4% faster (37.6, 38.8 against 37.4, 36.9 ms; 42.4, 42.7 against 40.6,
/// 41.5 at 1000), 3-token blocks 1–2% slower.
pub(crate) const ZMM_K_FROM_ROWS: usize = 4;

/// From how many activation rows [`CpuLevel::Avx512ZmmK`] runs the K-quant formats' 512-bit passes:
/// [`ZMM_K_FROM_ROWS`], except on AMD's EPYC Zen 5 ([`crate::dispatch::amd_full_width_512`]),
/// whose full-width 512-bit units make those passes the faster ones at every row count. Measured
/// there (stop 78) with `step_time` on the 1.5B target, the two thresholds taking turns step by
/// step in one run (200–300 steps): single steps up to 3% faster (26.31 → 25.62, 26.03 → 25.40, 25.97
/// → 25.52, 25.70 → 25.13, 19.10 → 19.13 ms medians), 2-token blocks 6% (27.05 → 25.40, 30.55 →
/// 28.67), 3-token blocks 9–16% (25.42 → 21.32, 27.08 → 24.74). The 32-value formats keep
/// [`ZMM_FROM_ROWS`] there: the draft model's (Q4_0) single steps and 2-token blocks took 7–9%
/// longer on the 512-bit pass in the same kind of run (5.99 → 6.54, 6.08 → 6.57, 6.77 → 7.22 ms),
/// 4-token blocks as fast.
#[cfg(target_arch = "x86_64")]
fn zmm_k_from_rows() -> usize {
    if crate::dispatch::amd_full_width_512() {
        1
    } else {
        ZMM_K_FROM_ROWS
    }
}

/// A weight format's kernels: the scalar reference dot and, on x86-64, the AVX2 and AVX-512 VNNI
/// passes.
pub(crate) trait Format {
    type Block;
    type Act;
    fn dot(w: &[Self::Block], x: &[Self::Act]) -> f32;
    /// [`pass`] at [`CpuLevel::Avx2`].
    ///
    /// # Safety
    /// The CPU must support AVX2, F16C and FMA; `out` as [`pass`].
    #[cfg(target_arch = "x86_64")]
    unsafe fn avx2_pass(w: &[Self::Block], nb: usize, x: &[Self::Act], out: Out);
    /// [`pass`] at [`CpuLevel::Avx512Vnni`].
    ///
    /// # Safety
    /// The CPU must support AVX2, F16C, FMA, AVX512F, AVX512VL and AVX512_VNNI; `out` as [`pass`].
    #[cfg(target_arch = "x86_64")]
    unsafe fn vnni_pass(w: &[Self::Block], nb: usize, x: &[Self::Act], out: Out);
}

macro_rules! format {
    ($name:ident, $block:ty, $act:ty, $dot:path, $pass:ident, $vnni:ident, $avx2:path) => {
        pub(crate) struct $name;
        impl Format for $name {
            type Block = $block;
            type Act = $act;
            fn dot(w: &[$block], x: &[$act]) -> f32 {
                $dot(w, x)
            }
            #[cfg(target_arch = "x86_64")]
            unsafe fn avx2_pass(w: &[$block], nb: usize, x: &[$act], out: Out) {
                // SAFETY: the caller's contract.
                unsafe { avx2::$pass::<$avx2>(w, nb, x, out) }
            }
            #[cfg(target_arch = "x86_64")]
            unsafe fn vnni_pass(w: &[$block], nb: usize, x: &[$act], out: Out) {
                // SAFETY: the caller's contract.
                unsafe { avx2::$vnni::<$avx2>(w, nb, x, out) }
            }
        }
    };
}

format!(
    Q8_0,
    BlockQ8_0,
    ActQ8_0,
    dot_q8_0_q8_0,
    pass32,
    pass32_vnni,
    crate::formats::q8_0::avx2::Q8_0
);
format!(
    Q4_0,
    BlockQ4_0,
    ActQ8_0,
    dot_q4_0_q8_0,
    pass32,
    pass32_vnni,
    crate::formats::q4_0::avx2::Q4_0
);
format!(
    Q5_0,
    BlockQ5_0,
    ActQ8_0,
    dot_q5_0_q8_0,
    pass32,
    pass32_vnni,
    crate::formats::q5_0::avx2::Q5_0
);
format!(
    Q4K,
    BlockQ4K,
    BlockQ8K,
    dot_q4_k_q8_k,
    pass,
    pass_vnni,
    crate::formats::q4_k::avx2::Q4K
);
format!(
    Q6K,
    BlockQ6K,
    BlockQ8K,
    dot_q6_k_q8_k,
    pass,
    pass_vnni,
    crate::formats::q6_k::avx2::Q6K
);

/// An interleaved weight format's kernels ([`crate::BlockQ4_0x8`], [`crate::BlockQ5_0x8`],
/// [`crate::BlockQ4Kx8`], [`crate::BlockQ6Kx8`]): the reference dot of its plain blocks and the AVX2 and AVX-512 VNNI passes
/// over groups of 8 rows.
pub(crate) trait GroupFormat {
    /// Whether the format is a K-quant, whose 512-bit pass runs at [`CpuLevel::Avx512ZmmK`] too
    /// (the 32-value formats' runs at [`CpuLevel::Avx512Zmm`], and at [`CpuLevel::Avx512ZmmK`]
    /// only on AMD's EPYC Zen 5: [`crate::dispatch::amd_full_width_512`]).
    const K_QUANT: bool = false;
    type Group: Interleaved;
    /// The activation blocks.
    type Act;
    fn dot(w: &[<Self::Group as Interleaved>::Block], x: &[Self::Act]) -> f32;
    /// [`pass_groups`] at [`CpuLevel::Avx2`].
    ///
    /// # Safety
    /// The CPU must support AVX2, F16C and FMA; `out` as [`pass_groups`].
    #[cfg(target_arch = "x86_64")]
    unsafe fn avx2_pass(w: &[Self::Group], nb: usize, x: &[Self::Act], out: Window);
    /// [`pass_groups`] at [`CpuLevel::Avx512Vnni`].
    ///
    /// # Safety
    /// The CPU must support AVX2, F16C, FMA, AVX512F, AVX512VL and AVX512_VNNI; `out` as
    /// [`pass_groups`].
    #[cfg(target_arch = "x86_64")]
    unsafe fn vnni_pass(w: &[Self::Group], nb: usize, x: &[Self::Act], out: Window);
    /// [`pass_groups`] at [`CpuLevel::Avx512Zmm`]: the [`CpuLevel::Avx512Vnni`] pass unless the
    /// format has one on 512-bit vectors.
    ///
    /// # Safety
    /// The CPU must support the level ([`CpuLevel::features`]); `out` as [`pass_groups`].
    #[cfg(target_arch = "x86_64")]
    unsafe fn zmm_pass(w: &[Self::Group], nb: usize, x: &[Self::Act], out: Window) {
        // SAFETY: the caller's contract (the level includes the VNNI level's features).
        unsafe { Self::vnni_pass(w, nb, x, out) }
    }
}

macro_rules! group_format {
    ($name:ident, $group:ty, $dot:path, $avx2:path) => {
        pub(crate) struct $name;
        impl GroupFormat for $name {
            type Group = $group;
            type Act = ActQ8_0;
            fn dot(w: &[<$group as Interleaved>::Block], x: &[ActQ8_0]) -> f32 {
                $dot(w, x)
            }
            #[cfg(target_arch = "x86_64")]
            unsafe fn avx2_pass(w: &[$group], nb: usize, x: &[ActQ8_0], out: Window) {
                // SAFETY: the caller's contract.
                unsafe { avx2::pass8::<$avx2>(w, nb, x, out) }
            }
            #[cfg(target_arch = "x86_64")]
            unsafe fn vnni_pass(w: &[$group], nb: usize, x: &[ActQ8_0], out: Window) {
                // SAFETY: the caller's contract.
                unsafe { avx2::pass8_vnni::<$avx2>(w, nb, x, out) }
            }
            #[cfg(target_arch = "x86_64")]
            unsafe fn zmm_pass(w: &[$group], nb: usize, x: &[ActQ8_0], out: Window) {
                // SAFETY: the caller's contract.
                unsafe { avx512::pass16::<avx512::Groups<$avx2>>(w, nb, x, out) }
            }
        }
    };
}

/// Q4_K with 8 rows interleaved ([`crate::formats::q4_k_x8`]).
pub(crate) struct Q4Kx8;

impl GroupFormat for Q4Kx8 {
    const K_QUANT: bool = true;
    type Group = BlockQ4Kx8;
    type Act = BlockQ8K;
    fn dot(w: &[BlockQ4K], x: &[BlockQ8K]) -> f32 {
        dot_q4_kx8_q8_k(w, x)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn avx2_pass(w: &[BlockQ4Kx8], nb: usize, x: &[BlockQ8K], out: Window) {
        // SAFETY: the caller's contract.
        unsafe { crate::formats::q4_k_x8::avx2::pass8(w, nb, x, out) }
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn vnni_pass(w: &[BlockQ4Kx8], nb: usize, x: &[BlockQ8K], out: Window) {
        // SAFETY: the caller's contract.
        unsafe { crate::formats::q4_k_x8::avx2::pass8_vnni(w, nb, x, out) }
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn zmm_pass(w: &[BlockQ4Kx8], nb: usize, x: &[BlockQ8K], out: Window) {
        // SAFETY: the caller's contract.
        unsafe { avx512::pass16::<crate::formats::q4_k_x8::avx512::Q4Kx8>(w, nb, x, out) }
    }
}

/// Q6_K with 8 rows interleaved ([`crate::formats::q6_k_x8`]).
pub(crate) struct Q6Kx8;

impl GroupFormat for Q6Kx8 {
    const K_QUANT: bool = true;
    type Group = BlockQ6Kx8;
    type Act = BlockQ8K;
    fn dot(w: &[BlockQ6K], x: &[BlockQ8K]) -> f32 {
        dot_q6_kx8_q8_k(w, x)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn avx2_pass(w: &[BlockQ6Kx8], nb: usize, x: &[BlockQ8K], out: Window) {
        // SAFETY: the caller's contract.
        unsafe { crate::formats::q6_k_x8::avx2::pass8(w, nb, x, out) }
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn vnni_pass(w: &[BlockQ6Kx8], nb: usize, x: &[BlockQ8K], out: Window) {
        // SAFETY: the caller's contract.
        unsafe { crate::formats::q6_k_x8::avx2::pass8_vnni(w, nb, x, out) }
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn zmm_pass(w: &[BlockQ6Kx8], nb: usize, x: &[BlockQ8K], out: Window) {
        // SAFETY: the caller's contract.
        unsafe { avx512::pass16::<crate::formats::q6_k_x8::avx512::Q6Kx8>(w, nb, x, out) }
    }
}

group_format!(
    Q4_0x8,
    BlockQ4_0x8,
    dot_q4_0_q8_0,
    crate::formats::interleaved::avx2::Q4_0x8
);
group_format!(
    Q5_0x8,
    BlockQ5_0x8,
    dot_q5_0_q8_0,
    crate::formats::interleaved::avx2::Q5_0x8
);

/// Bytes a chunk of the 512-bit pass prefetches into L2 while it computes, a part per sub-block
/// ([`Ahead::part`]), so that the prefetches wait for memory among the multiplies instead of in one
/// burst before them, which held up the whole step: 8-token target blocks 78–82 → 67–71 ms,
/// 16-token 130–133 → 113–116 (stop 39, `step_time`, alternated). The 256-bit passes keep their
/// burst ([`avx2::prefetch_ahead`]): spread the same way, 1- to 6-token blocks ran 4–7% slower. The
/// 32-value formats' 512-bit chunk has asked for the whole part in one burst since stop 76 (see
/// `avx512::Groups::chunk`).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct Ahead {
    start: *const i8,
    lines: usize,
}

#[cfg(target_arch = "x86_64")]
impl Ahead {
    /// Nothing to prefetch.
    pub(crate) const NONE: Ahead = Ahead {
        start: std::ptr::null(),
        lines: 0,
    };

    /// Block `b`'s share of the next pair of groups (`next` is its first block; a prefetch reads
    /// nothing the program sees and cannot fault, so it may lie past the matrix): the two groups of
    /// a pair are `2 · nb` blocks in a row, read as two streams `nb` blocks apart, which the
    /// hardware prefetchers and [`avx2::prefetch_ahead`]'s fixed distance serve poorly; so each of
    /// the pair's `nb` block steps prefetches 2 blocks of the next pair, in order.
    #[inline]
    pub(crate) fn pair<T>(next: *const T, b: usize) -> Ahead {
        let size = std::mem::size_of::<T>();
        Ahead {
            start: next.cast::<i8>().wrapping_add(2 * b * size),
            lines: (2 * size).div_ceil(64),
        }
    }

    /// The lines of part `i` of `n`: together the parts cover every line once, in order.
    fn range(self, i: usize, n: usize) -> std::ops::Range<usize> {
        self.lines * i / n..self.lines * (i + 1) / n
    }

    /// Prefetches part `i` of `n` of the lines into L2 (a prefetch reads nothing the program sees
    /// and cannot fault).
    #[inline]
    pub(crate) fn part(self, i: usize, n: usize) {
        for line in self.range(i, n) {
            // SAFETY: SSE, which the prefetch needs, is part of x86-64; a prefetch reads nothing
            // the program sees and cannot fault.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                    self.start.wrapping_add(64 * line),
                );
            }
        }
    }
}

/// Where a pass writes: `out[r * stride + c]` for activation row `r` and column `c` of the pass.
#[derive(Clone, Copy)]
pub(crate) struct Out {
    pub(crate) ptr: *mut f32,
    pub(crate) stride: usize,
}

impl Out {
    /// # Safety
    /// `r * stride + c` must be within the buffer, and no other thread may access that element now.
    #[inline]
    unsafe fn write(self, r: usize, c: usize, v: f32) {
        // SAFETY: the caller's contract.
        unsafe { self.ptr.add(r * self.stride + c).write(v) }
    }
}

/// Where a pass over groups of 8 weight rows writes: of the group rows' columns `0, 1, ..` (row `k`
/// of group `g` is column `8g + k`), columns `skip .. skip + len`, to column `c - skip` of `out`.
#[derive(Clone, Copy)]
pub(crate) struct Window {
    pub(crate) out: Out,
    pub(crate) skip: usize,
    pub(crate) len: usize,
}

impl Window {
    /// Writes `v` as column `c` of row `r` if `c` is in the window.
    ///
    /// # Safety
    /// As [`Out::write`] for every column of the window.
    #[inline]
    pub(crate) unsafe fn write(self, r: usize, c: usize, v: f32) {
        if c >= self.skip && c - self.skip < self.len {
            // SAFETY: the caller's contract.
            unsafe { self.out.write(r, c - self.skip, v) }
        }
    }

    /// Where columns `first .. first + n` of row `r` go when all of them are in the window (a
    /// pass's chunks are cut at group boundaries, so all but the window's edges are), else `None`.
    ///
    /// # Safety
    /// As [`Window::write`]; the pointer is valid for `n` writes.
    #[inline]
    pub(crate) unsafe fn whole(self, r: usize, first: usize, n: usize) -> Option<*mut f32> {
        (first >= self.skip && first - self.skip + n <= self.len).then(|| {
            // SAFETY: the columns are in the window (the caller's contract).
            unsafe { self.out.ptr.add(r * self.out.stride + first - self.skip) }
        })
    }

    /// Writes `lanes` (one per weight row, as the passes keep them) as columns `first ..` of row
    /// `r`, those in the window.
    ///
    /// # Safety
    /// As [`Window::write`].
    #[inline]
    pub(crate) unsafe fn write_lanes(self, r: usize, first: usize, lanes: &[f32]) {
        for (k, &v) in lanes.iter().enumerate() {
            // SAFETY: the caller's contract.
            unsafe { self.write(r, first + k, v) };
        }
    }

    /// The same window for a pass over the groups past the first `g` (whose column 0 is this
    /// window's column `8g`).
    pub(crate) fn past_groups(self, g: usize) -> Window {
        let first = GROUP_ROWS * g;
        if first <= self.skip {
            Window {
                skip: self.skip - first,
                ..self
            }
        } else {
            let shift = first - self.skip;
            Window {
                out: Out {
                    // Not dereferenced unless a column is written, which `len` rules out past
                    // the window's end.
                    ptr: self.out.ptr.wrapping_add(shift),
                    stride: self.out.stride,
                },
                skip: 0,
                len: self.len.saturating_sub(shift),
            }
        }
    }
}

/// [`pass`] for an interleaved format: `w` holds whole groups (`nb` per 8 weight rows), and only the
/// columns of the window are written.
///
/// # Safety
/// As [`pass`], with `out` valid for every `(r, c)` of the window.
pub(crate) unsafe fn pass_groups<G: GroupFormat>(
    level: CpuLevel,
    w: &[G::Group],
    nb: usize,
    x: &[G::Act],
    out: Window,
) {
    match level {
        // SAFETY: the caller's contract.
        CpuLevel::Scalar => unsafe { scalar_groups::<G>(w, nb, x, out) },
        // SAFETY: `level` is supported by this CPU (the caller's contract, upheld by `Kernels`).
        #[cfg(target_arch = "x86_64")]
        CpuLevel::Avx2 => unsafe { G::avx2_pass(w, nb, x, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        CpuLevel::Avx512Vnni => unsafe { G::vnni_pass(w, nb, x, out) },
        // SAFETY: as above. Passes of few rows take the 256-bit pass.
        #[cfg(target_arch = "x86_64")]
        CpuLevel::Avx512Zmm | CpuLevel::Amx if x.len() < ZMM_FROM_ROWS * nb => unsafe {
            G::vnni_pass(w, nb, x, out)
        },
        // SAFETY: as above. Passes of few rows take the 256-bit pass; so do the 32-value formats'
        // at this level, except on AMD's EPYC Zen 5 ([`crate::dispatch::amd_full_width_512`]) from
        // as many rows as at the full 512-bit level.
        #[cfg(target_arch = "x86_64")]
        CpuLevel::Avx512ZmmK
            if x.len() < zmm_k_from_rows() * nb
                || (!G::K_QUANT
                    && (x.len() < ZMM_FROM_ROWS * nb
                        || !crate::dispatch::amd_full_width_512())) =>
        unsafe { G::vnni_pass(w, nb, x, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        CpuLevel::Avx512ZmmK | CpuLevel::Avx512Zmm | CpuLevel::Amx => unsafe {
            G::zmm_pass(w, nb, x, out)
        },
        // SAFETY: the caller's contract.
        #[cfg(not(target_arch = "x86_64"))]
        CpuLevel::Avx2
        | CpuLevel::Avx512Vnni
        | CpuLevel::Avx512ZmmK
        | CpuLevel::Avx512Zmm
        | CpuLevel::Amx => unsafe { scalar_groups::<G>(w, nb, x, out) },
    }
}

/// The scalar level for interleaved formats: each row's blocks taken back out of its groups, then the
/// reference dot product.
///
/// # Safety
/// As [`pass_groups`].
unsafe fn scalar_groups<G: GroupFormat>(w: &[G::Group], nb: usize, x: &[G::Act], out: Window) {
    let mut row = Vec::with_capacity(nb);
    for (g, groups) in w.chunks_exact(nb).enumerate() {
        for k in 0..GROUP_ROWS {
            let c = GROUP_ROWS * g + k;
            if c < out.skip || c - out.skip >= out.len {
                continue;
            }
            row.clear();
            row.extend(groups.iter().map(|group| group.row(k)));
            for (r, x) in x.chunks_exact(nb).enumerate() {
                // SAFETY: the caller's contract.
                unsafe { out.write(r, c, G::dot(&row, x)) };
            }
        }
    }
}

/// One pass: 1 ..= [`MAX_PASS_ROWS`] activation rows (`x`, `nb` blocks each, contiguous) against the
/// weight rows in `w` (`nb` blocks each) at `level`; writes column `c` of row `r` through `out`.
///
/// # Safety
/// `level` must be supported by this CPU (a [`crate::Kernels`] guarantees it), and `out` must be valid
/// for writes of every `(r, c)` of the pass, which no other thread accesses meanwhile.
pub(crate) unsafe fn pass<F: Format>(
    level: CpuLevel,
    w: &[F::Block],
    nb: usize,
    x: &[F::Act],
    out: Out,
) {
    match level {
        // SAFETY: the caller's contract.
        CpuLevel::Scalar => unsafe { scalar_rows(F::dot, w, nb, x, out) },
        // SAFETY: `level` is supported by this CPU (the caller's contract, upheld by `Kernels`).
        #[cfg(target_arch = "x86_64")]
        CpuLevel::Avx2 => unsafe { F::avx2_pass(w, nb, x, out) },
        // SAFETY: as above.
        // The row formats have no 512-bit pass: the zmm level runs the VNNI one.
        #[cfg(target_arch = "x86_64")]
        CpuLevel::Avx512Vnni | CpuLevel::Avx512ZmmK | CpuLevel::Avx512Zmm | CpuLevel::Amx => unsafe {
            F::vnni_pass(w, nb, x, out)
        },
        // SAFETY: the caller's contract.
        #[cfg(not(target_arch = "x86_64"))]
        CpuLevel::Avx2
        | CpuLevel::Avx512Vnni
        | CpuLevel::Avx512ZmmK
        | CpuLevel::Avx512Zmm
        | CpuLevel::Amx => unsafe { scalar_rows(F::dot, w, nb, x, out) },
    }
}

/// The scalar level: the reference dot product for every (row, column) pair.
///
/// # Safety
/// As [`pass`].
pub(crate) unsafe fn scalar_rows<B, A>(
    dot: fn(&[B], &[A]) -> f32,
    w: &[B],
    nb: usize,
    x: &[A],
    out: Out,
) {
    for (c, wrow) in w.chunks_exact(nb).enumerate() {
        for (r, x) in x.chunks_exact(nb).enumerate() {
            // SAFETY: the caller's contract.
            unsafe { out.write(r, c, dot(wrow, x)) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use crate::formats::interleaved::avx2::Groups8;
    use crate::formats::q8_0::avx2::Quants32;
    use crate::formats::{ActQ8_0, SignedBlock32};
    use std::arch::x86_64::*;

    /// One weight format's half of the SIMD kernel: unpack a block into registers, and fold one
    /// activation block into a row's 8-lane accumulator exactly as the format's reference dot does.
    pub(crate) trait Dequantizer {
        /// The weight block.
        type Block;
        /// The activation block.
        type Act;
        /// A weight block unpacked into registers.
        type Unpacked;

        /// From how many activation rows on the multi-row loop passes one row at a time over a
        /// block unpacked into registers, instead of up to 4 rows together (5 as 3 + 2): at most 6,
        /// since from 6 rows on every format goes one row at a time.
        const ONE_ROW_FROM: usize = 6;

        /// # Safety
        /// The CPU must support AVX2.
        unsafe fn unpack(block: &Self::Block) -> Self::Unpacked;

        /// # Safety
        /// The CPU must support AVX2.
        unsafe fn accumulate(w: &Self::Unpacked, x: &Self::Act, acc: __m256) -> __m256;

        /// [`Dequantizer::accumulate`] for `R` activation rows at once (`acc` holds their `R`
        /// accumulators), with the same arithmetic per row. A format overrides it to load each
        /// unpacked vector once for all `R` rows, so that the rows' integer lanes, not the unpacked
        /// block, stay in registers.
        ///
        /// # Safety
        /// The CPU must support AVX2.
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn accumulate_rows<const R: usize>(
            w: &Self::Unpacked,
            x: [&Self::Act; R],
            acc: &mut [__m256],
        ) {
            for (a, x) in acc.iter_mut().zip(x) {
                // SAFETY: AVX2 support is the caller's contract.
                *a = unsafe { Self::accumulate(w, x, *a) };
            }
        }

        /// [`Dequantizer::unpack`] for [`Dequantizer::accumulate_rows_vnni`] (by default the same).
        ///
        /// # Safety
        /// The CPU must support AVX2.
        #[inline]
        #[target_feature(enable = "avx2,f16c,fma")]
        unsafe fn unpack_vnni(block: &Self::Block) -> Self::Unpacked {
            // SAFETY: the caller's contract.
            unsafe { Self::unpack(block) }
        }

        /// [`Dequantizer::accumulate_rows`] with the dot products of AVX-512 VNNI: the same integer
        /// lanes and the same float arithmetic, so bit-identical results in fewer instructions.
        ///
        /// # Safety
        /// The CPU must support AVX2, F16C, FMA, AVX512F, AVX512VL and AVX512_VNNI.
        unsafe fn accumulate_rows_vnni<const R: usize>(
            w: &Self::Unpacked,
            x: [&Self::Act; R],
            acc: &mut [__m256],
        );
    }

    /// `lanes[r]` folded over the 4 pairs of vectors of `R` activation blocks: `$fold(lane, q0, q1,
    /// y0, y1, sc)` with a pair's two unpacked weight vectors, the row's two activation vectors and the
    /// pair's scales (`$sc[0]` for pairs 0 and 1, `$sc[1]` for pairs 2 and 3). Each unpacked vector
    /// is loaded once for all `R` rows.
    macro_rules! fold_pairs {
        ($q:expr, $sc:expr, $x:expr, $fold:expr) => {{
            let mut lanes = [_mm256_setzero_si256(); R];
            for p in 0..4 {
                let sc = $sc[p / 2];
                for (l, x) in lanes.iter_mut().zip($x) {
                    // SAFETY: `x.qs` is 256 bytes; bytes 64p .. 64p + 64 are in bounds for p < 4.
                    let (y0, y1) = unsafe {
                        (
                            _mm256_loadu_si256(x.qs.as_ptr().add(64 * p).cast()),
                            _mm256_loadu_si256(x.qs.as_ptr().add(64 * p + 32).cast()),
                        )
                    };
                    *l = $fold(*l, $q[2 * p], $q[2 * p + 1], y0, y1, sc);
                }
            }
            lanes
        }};
    }

    /// The integer lanes of `R` Q8_K activation blocks against a Q6_K block unpacked into
    /// [`crate::formats::BlockQ8K`]'s order: 8 vectors `q[t]` of 32 unsigned quants, in 4 pairs
    /// (vectors `2p`, `2p + 1`) whose two vectors hold the same 16-value sub-block in each 4-byte lane,
    /// with the per-lane scales of vectors 0..4 in `sc[0]` and of vectors 4..8 in `sc[1]`. Per pair
    /// and row: two `maddubs`, their sum in `i16`, one `madd` by the scales, and the sum over pairs in
    /// `i32`. The format bounds the values so that every sum is exact, so the order of summation
    /// cannot change a result.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(crate) fn paired_lanes<const R: usize>(
        q: &[__m256i; 8],
        sc: &[__m256i; 2],
        x: [&crate::formats::BlockQ8K; R],
    ) -> [__m256i; R] {
        fold_pairs!(q, sc, x, |l, q0, q1, y0, y1, sc| {
            let pair = _mm256_add_epi16(_mm256_maddubs_epi16(q0, y0), _mm256_maddubs_epi16(q1, y1));
            _mm256_add_epi32(l, _mm256_madd_epi16(pair, sc))
        })
    }

    /// The integer lanes of `R` Q8_K activation blocks against a Q4_K block unpacked into
    /// [`crate::formats::BlockQ8K`]'s order, whose 4-byte lane `j` belongs to sub-block `j` in all 8
    /// vectors, with each lane's scale in both `i16` halves of `sc`. Per row: 8 `maddubs`, their sum in
    /// `i16` (exact: 16 products of a nibble and a quant, ≤ 16 · 15 · 127 < 2^15), and one `madd` by
    /// the scales: 9 multiplies per row and block. The unpacked vectors are loaded once for all rows.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(crate) fn summed_lanes<const R: usize>(
        q: &[__m256i; 8],
        sc: __m256i,
        x: [&crate::formats::BlockQ8K; R],
    ) -> [__m256i; R] {
        let mut lanes = [_mm256_setzero_si256(); R];
        for (l, x) in lanes.iter_mut().zip(x) {
            let y = x.qs.as_ptr();
            // SAFETY: `x.qs` is 256 bytes; bytes 32t .. 32t + 32 are in bounds for t < 8.
            let p: [__m256i; 8] = unsafe {
                [
                    _mm256_maddubs_epi16(q[0], _mm256_loadu_si256(y.cast())),
                    _mm256_maddubs_epi16(q[1], _mm256_loadu_si256(y.add(32).cast())),
                    _mm256_maddubs_epi16(q[2], _mm256_loadu_si256(y.add(64).cast())),
                    _mm256_maddubs_epi16(q[3], _mm256_loadu_si256(y.add(96).cast())),
                    _mm256_maddubs_epi16(q[4], _mm256_loadu_si256(y.add(128).cast())),
                    _mm256_maddubs_epi16(q[5], _mm256_loadu_si256(y.add(160).cast())),
                    _mm256_maddubs_epi16(q[6], _mm256_loadu_si256(y.add(192).cast())),
                    _mm256_maddubs_epi16(q[7], _mm256_loadu_si256(y.add(224).cast())),
                ]
            };
            let sum = _mm256_add_epi16(
                _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])),
                _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7])),
            );
            *l = _mm256_madd_epi16(sum, sc);
        }
        lanes
    }

    /// The two `vpdpbusd` chains of a K-quant block unpacked into [`crate::formats::BlockQ8K`]'s
    /// order against one activation block: lane by lane, the exact `i32` sums of the 4-byte lanes of
    /// vectors 0..4 and of vectors 4..8 (16 products each).
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni")]
    pub(crate) fn half_sums_vnni(
        q: &[__m256i; 8],
        x: &crate::formats::BlockQ8K,
    ) -> (__m256i, __m256i) {
        let y = x.qs.as_ptr();
        let (mut a, mut b) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        for t in 0..4 {
            // SAFETY: `x.qs` is 256 bytes; bytes 32t .. 32t + 32 and 128 + 32t .. + 32 are in
            // bounds for t < 4.
            let (ya, yb) = unsafe {
                (
                    _mm256_loadu_si256(y.add(32 * t).cast()),
                    _mm256_loadu_si256(y.add(128 + 32 * t).cast()),
                )
            };
            a = _mm256_dpbusd_epi32(a, q[t], ya);
            b = _mm256_dpbusd_epi32(b, q[t + 4], yb);
        }
        (a, b)
    }

    /// [`summed_lanes`] with AVX-512 VNNI: per row, [`half_sums_vnni`] (each at most 16 · 15 · 127 <
    /// 2^15 in magnitude), and two `vpdpwssd` multiply them by the lane's scale and add: 10
    /// instructions per row and block. `sc` must hold each lane's scale in its low `i16` and 0 in its
    /// high one: the high `i16` of a negative sum is -1, and the low one alone is the sum.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni")]
    pub(crate) fn chained_lanes_vnni<const R: usize>(
        q: &[__m256i; 8],
        sc: __m256i,
        x: [&crate::formats::BlockQ8K; R],
    ) -> [__m256i; R] {
        // A loop, not `map`: a closure would not inline the VNNI function.
        let mut lanes = [_mm256_setzero_si256(); R];
        for (l, x) in lanes.iter_mut().zip(x) {
            let (a, b) = half_sums_vnni(q, x);
            *l = _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), a, sc), b, sc);
        }
        lanes
    }

    /// Lane `k` of the result: the exact sum `Σ_t Σ_b V_t[4k + b] · y[4t + b]` of a group's vectors
    /// against one activation block's 32 quants `y` (row `k`'s unsigned block sum), with each 4 quants
    /// `y[4t ..]` broadcast: [`Groups8::I16_TERMS`] `maddubs` at a time summed in `i16`, then one
    /// `madd` by ones.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(crate) fn group_sums<G: Groups8>(v: &[__m256i; 8], y: &[i8; 32]) -> __m256i {
        let ones = _mm256_set1_epi16(1);
        let mut total = _mm256_setzero_si256();
        for first in (0..8).step_by(G::I16_TERMS) {
            let mut sum = _mm256_setzero_si256();
            for (t, &v) in v.iter().enumerate().skip(first).take(G::I16_TERMS) {
                // SAFETY: `y` is 32 bytes; bytes 4t .. 4t + 4 are in bounds for t < 8.
                let word = unsafe { y.as_ptr().add(4 * t).cast::<i32>().read_unaligned() };
                sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(v, _mm256_set1_epi32(word)));
            }
            total = _mm256_add_epi32(total, _mm256_madd_epi16(sum, ones));
        }
        total
    }

    /// [`group_sums`] with AVX-512 VNNI: two chains of four `vpdpbusd`, exact in `i32` for any format.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni")]
    pub(crate) fn group_sums_vnni<G: Groups8>(v: &[__m256i; 8], y: &[i8; 32]) -> __m256i {
        let (mut a, mut b) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        for t in 0..4 {
            // SAFETY: `y` is 32 bytes; bytes 4t .. 4t + 4 and 16 + 4t .. 20 + 4t are in bounds.
            let (ya, yb) = unsafe {
                (
                    y.as_ptr().add(4 * t).cast::<i32>().read_unaligned(),
                    y.as_ptr().add(16 + 4 * t).cast::<i32>().read_unaligned(),
                )
            };
            a = _mm256_dpbusd_epi32(a, v[t], _mm256_set1_epi32(ya));
            b = _mm256_dpbusd_epi32(b, v[t + 4], _mm256_set1_epi32(yb));
        }
        _mm256_add_epi32(a, b)
    }

    /// The `shuffle_epi8` control that makes `i16` lane `k` of the low half of the result lane
    /// `lo[k]` of the source's low half, and the same for the high half with `hi`.
    pub(crate) const fn pick_i16(lo: [u8; 8], hi: [u8; 8]) -> [u8; 32] {
        let mut control = [0u8; 32];
        let mut k = 0;
        while k < 8 {
            control[2 * k] = 2 * lo[k];
            control[2 * k + 1] = 2 * lo[k] + 1;
            control[16 + 2 * k] = 2 * hi[k];
            control[16 + 2 * k + 1] = 2 * hi[k] + 1;
            k += 1;
        }
        control
    }

    /// `shuffle_epi8(src, control)` with a control from [`pick_i16`].
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(crate) fn shuffle(src: __m256i, control: &[u8; 32]) -> __m256i {
        // SAFETY: `control` is 32 bytes, one unaligned 256-bit load.
        let control = unsafe { _mm256_loadu_si256(control.as_ptr().cast()) };
        _mm256_shuffle_epi8(src, control)
    }

    /// The exact `f32` of an f16 (F16C; equal to [`crate::F16::to_f32`], which is exact too).
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(crate) fn f16_to_f32(h: crate::F16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h.0))))
    }

    /// [`crate::formats::hsum8`]'s tree: halves, then `movehl`, then `movehdup`.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(crate) fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let t = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)))
    }

    /// `$f::<$t, N>(args)` with the row count `$rows` (1 ..= [`super::MAX_PASS_ROWS`]) as the constant
    /// `N`, so that the accumulators of a pass live in registers.
    macro_rules! by_rows {
        ($rows:expr, $f:ident::<$t:ident>($($arg:expr),*)) => {
            match $rows {
                1 => $f::<$t, 1>($($arg),*),
                2 => $f::<$t, 2>($($arg),*),
                3 => $f::<$t, 3>($($arg),*),
                4 => $f::<$t, 4>($($arg),*),
                5 => $f::<$t, 5>($($arg),*),
                6 => $f::<$t, 6>($($arg),*),
                7 => $f::<$t, 7>($($arg),*),
                8 => $f::<$t, 8>($($arg),*),
                9 => $f::<$t, 9>($($arg),*),
                10 => $f::<$t, 10>($($arg),*),
                11 => $f::<$t, 11>($($arg),*),
                12 => $f::<$t, 12>($($arg),*),
                13 => $f::<$t, 13>($($arg),*),
                14 => $f::<$t, 14>($($arg),*),
                15 => $f::<$t, 15>($($arg),*),
                16 => $f::<$t, 16>($($arg),*),
                _ => {}
            }
        };
    }
    pub(crate) use by_rows;

    /// How far ahead a K-quant pass of `rows` activation rows asks for its weights
    /// ([`prefetch_ahead_by`]), in bytes: [`PREFETCH`], but on a CPU whose hardware prefetchers
    /// follow the pass's stream on their own ([`crate::dispatch::streams_unaided`]) nothing for one
    /// or two rows ([`UNAIDED_ROWS`]) and [`UNAIDED_AHEAD`] for more.
    #[inline]
    pub(crate) fn k_quant_prefetch(rows: usize) -> Option<usize> {
        if !crate::dispatch::streams_unaided() {
            Some(PREFETCH)
        } else if rows > UNAIDED_ROWS {
            Some(UNAIDED_AHEAD)
        } else {
            None
        }
    }

    /// The most rows of a K-quant pass that leaves its weight stream to the hardware where
    /// [`crate::dispatch::streams_unaided`]. Measured on Zen 4 (stop 45, `step_time` on the 1.5B
    /// target with each variant taking every other step of one run, context 300): 2-token blocks
    /// without the software prefetch 28.99 → 25.92, 28.73 → 25.45 and 28.39 → 25.20 ms where the
    /// machine's memory was fast (single steps there 20.8 ms), 34.39 → 33.57, 35.16 → 34.13 and
    /// 33.82 → 33.01 ms where it was slow; 3-token blocks slower without it (31.4 → 32.7, 35.6 →
    /// 42.0, 35.3 → 43.4 ms). Before stop 44's pool gave each thread one contiguous region, the
    /// 2-row pass had been 1–3% slower without it.
    const UNAIDED_ROWS: usize = 2;

    /// How far ahead the K-quant passes of more than [`UNAIDED_ROWS`] rows prefetch where
    /// [`crate::dispatch::streams_unaided`]: with the hardware's stream running as well, a distance
    /// of [`PREFETCH`] asks for lines it has mostly fetched already. Measured as for
    /// [`UNAIDED_ROWS`] (stop 45, 3-token blocks, [`PREFETCH`] against the distance, 2 alternating
    /// runs each): 2 KiB 32.6 → 39.4 and 32.5 → 39.4 ms, 8 KiB 32.6 → 31.2, 33.5 → 32.2, 34.9 → 33.9
    /// and 35.1 → 34.1, 12 KiB 32.4 → 30.5 and 35.7 → 34.3, 16 KiB 35.8 → 34.5, 31.5 → 29.5, 34.3 →
    /// 33.3 and 34.0 → 33.1, 24 KiB 35.9 → 34.9 and 33.6 → 32.7, 32 KiB 35.8 → 35.1 and 35.1 → 34.1.
    /// (The 32-value formats' passes keep [`PREFETCH`]: the Q4_0 draft's single steps took 5–7%
    /// longer at 16 KiB.) The 512-bit passes (from 4 rows; from one on EPYC Zen 5) prefetch the next pair of groups instead
    /// ([`super::Ahead`]): without it 4-token blocks took 35.5 → 50.2 and 35.7 → 49.8 ms, with the
    /// pair after next 34.3 → 34.7 and 34.4 → 34.8.
    const UNAIDED_AHEAD: usize = 16384;

    /// How far ahead of the block being unpacked [`rows`] prefetches weights, in bytes.
    const PREFETCH: usize = 4096;

    /// [`prefetch_ahead_by`] at [`PREFETCH`].
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(crate) fn prefetch_ahead<T>(block: &T) {
        prefetch_ahead_by(block, PREFETCH);
    }

    /// Prefetches the bytes `distance` ahead of `block` into L2, one cache line per 64 bytes of `T`:
    /// the rows of a pass are adjacent, so that is where the pass reads next.
    ///
    /// L2 (`T1`), not L1 (`T0`): the loads bring each line on to L1 when the pass gets there, and L1
    /// keeps the activation rows, which at 4 rows of a wide matrix (the FFN down projection's 8,960
    /// inputs: 10 KB of Q8_K per row) already fill it. Measured with `step_time` on the 1.5B target
    /// (stop 27, Zen 4, old and new alternating, 3 rounds): 4-token blocks 51–57 → 41–43 ms, 2-token
    /// blocks 36–47 → 29–36 ms, single tokens 32–37 → 28–37 ms, 16-token blocks unchanged; the draft
    /// (Q4_0) unchanged.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(crate) fn prefetch_ahead_by<T>(block: &T, distance: usize) {
        let ahead = std::ptr::from_ref(block)
            .cast::<i8>()
            .wrapping_add(distance);
        for line in (0..std::mem::size_of::<T>()).step_by(64) {
            // A prefetch reads nothing the program sees and cannot fault.
            _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(line));
        }
    }

    /// Writes the 8 lanes of `a`, one per row of group `g`, as columns `8g ..` of row `r`.
    ///
    /// # Safety
    /// As [`super::Window::write`].
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(crate) unsafe fn write_group(out: super::Window, r: usize, g: usize, a: __m256) {
        // SAFETY: the caller's contract.
        if let Some(at) = unsafe { out.whole(r, 8 * g, 8) } {
            // SAFETY: `whole` checked that the 8 columns are in the window.
            unsafe { _mm256_storeu_ps(at, a) };
            return;
        }
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` is 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), a) };
        // SAFETY: the caller's contract.
        unsafe { out.write_lanes(r, 8 * g, &lanes) };
    }

    /// Lane `k` = the sum of the 8 `i32` lanes of `p[k]`.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn reduce8(p: [__m256i; 8]) -> __m256i {
        let a = _mm256_hadd_epi32(p[0], p[1]);
        let b = _mm256_hadd_epi32(p[2], p[3]);
        let c = _mm256_hadd_epi32(p[4], p[5]);
        let d = _mm256_hadd_epi32(p[6], p[7]);
        // `ab` holds the sums of columns 0..4, over input lanes 0..4 in its low half and 4..8 in
        // its high half; `cd` the same for columns 4..8.
        let ab = _mm256_hadd_epi32(a, b);
        let cd = _mm256_hadd_epi32(c, d);
        _mm256_add_epi32(
            _mm256_permute2x128_si256(ab, cd, 0x20),
            _mm256_permute2x128_si256(ab, cd, 0x31),
        )
    }

    /// The multi-row loops, compiled once per level: `$features` are the level's target features,
    /// and the levels differ only in the per-row integer dot products the loops call (`$unpack`,
    /// `$accumulate` for the K-quants, `$quads` for the 32-value formats), which give the same integer
    /// lanes at every level.
    macro_rules! multi_row {
        (
            features: $features:literal,
            pass: $pass:ident, rows: $rows:ident, group: $group:ident,
            pass32: $pass32:ident, rows32: $rows32:ident,
            pass8: $pass8:ident, rows8: $rows8:ident,
            unpack: $unpack:ident, accumulate: $accumulate:ident, quads: $quads:ident,
            group_sums: $group_sums:ident $(,)?
        ) => {
            /// `N` activation rows against the weight rows in `w` (`nb` blocks each).
            ///
            /// # Safety
            #[doc = concat!("The CPU must support `", $features, "`; `out` as [`super::pass`].")]
            #[target_feature(enable = $features)]
            unsafe fn $rows<D: Dequantizer, const N: usize>(
                w: &[D::Block],
                nb: usize,
                x: &[D::Act],
                out: super::Out,
            ) {
                assert_eq!(x.len(), N * nb, "a pass holds N rows of nb blocks");
                // Up to 4 rows go together, each unpacked vector loaded once for all of them, and 5
                // rows as 3 + 2. From `D::ONE_ROW_FROM` rows (6 unless a format says otherwise;
                // Q4_K from 2 rows, measured with `examples/rcurve.rs`), one row at a time with the
                // unpacked block in registers, in a loop kept rolled (`black_box` hides the
                // constant): unrolled, the rows interleave and spill to the stack. Measured with
                // `examples/step_time.rs` on the 1.5B target: blocks of 5, 6, 8 and 12 tokens 8-15%
                // faster than groups of 4 rows (and 6, 7, 8 rows as 3 + 3, 4 + 3, 4 + 4 slower than
                // one at a time by 4-14%); 2-4 rows together as fast as before.
                let rows = std::hint::black_box(N);
                for (c, wrow) in w.chunks_exact(nb).enumerate() {
                    let mut acc = [_mm256_setzero_ps(); N];
                    for (b, block) in wrow.iter().enumerate() {
                        prefetch_ahead(block);
                        // SAFETY: the level's target features are enabled for this function.
                        let u = unsafe { D::$unpack(block) };
                        // Block `b` of row `r` is `xb.add(r * nb)`, in bounds for r < N (asserted above).
                        let xb = x[b..].as_ptr();
                        if N < D::ONE_ROW_FROM && N <= 4 {
                            // SAFETY: as above; rows 0 .. N.
                            unsafe { $group::<D, N>(&u, xb, nb, 0, &mut acc) };
                        } else if N < D::ONE_ROW_FROM && N == 5 {
                            // SAFETY: as above; rows 0 .. 5.
                            unsafe {
                                $group::<D, 3>(&u, xb, nb, 0, &mut acc);
                                $group::<D, 2>(&u, xb, nb, 3, &mut acc);
                            }
                        } else {
                            for r in 0..rows {
                                // SAFETY: as above; r < N.
                                unsafe { $group::<D, 1>(&u, xb, nb, r, &mut acc) };
                            }
                        }
                    }
                    for (r, a) in acc.into_iter().enumerate() {
                        // SAFETY: the caller's contract.
                        unsafe { out.write(r, c, hsum(a)) };
                    }
                }
            }

            /// Rows `r .. r + G` of one block through the level's [`Dequantizer`] accumulation
            /// (`accumulate_rows` or `accumulate_rows_vnni`): row `i`'s activation block is
            /// `xb.add(i * nb)`.
            ///
            /// # Safety
            #[doc = concat!("The CPU must support `", $features, "`;")]
            /// `xb.add((r + G - 1) * nb)` must point to a block, and `r + G <= acc.len()`.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn $group<D: Dequantizer, const G: usize>(
                u: &D::Unpacked,
                xb: *const D::Act,
                nb: usize,
                r: usize,
                acc: &mut [__m256],
            ) {
                // SAFETY: the caller's contract.
                let x: [&D::Act; G] = std::array::from_fn(|i| unsafe { &*xb.add((r + i) * nb) });
                // SAFETY: the caller's contract.
                unsafe { D::$accumulate::<G>(u, x, &mut acc[r..r + G]) };
            }

            /// Runs one pass (1 ..= [`super::MAX_PASS_ROWS`] activation rows) with the row count as a constant,
            /// so the accumulators live in registers.
            ///
            /// # Safety
            #[doc = concat!("The CPU must support `", $features, "`; `out` as [`super::pass`].")]
            pub(crate) unsafe fn $pass<D: Dequantizer>(
                w: &[D::Block],
                nb: usize,
                x: &[D::Act],
                out: super::Out,
            ) {
                // SAFETY: the caller's contract.
                unsafe { by_rows!(x.len() / nb, $rows::<D>(w, nb, x, out)) }
            }

            /// The 32-value formats' pass: 8 weight rows (output columns) side by side, lane `k` of a
            /// vector for column `k` of the group. Per block, each row's 32 products are summed
            /// exactly into one `i32` (the level's [`Quants32`] sums of 4 products, then a
            /// horizontal reduction that leaves column `k`'s sum in lane `k`), the weights' offset is
            /// taken off once per activation block, and the float scale conversion, multiply and add
            /// run once for all 8 columns.
            ///
            /// # Safety
            #[doc = concat!("The CPU must support `", $features, "`; `out` as [`super::pass`].")]
            pub(crate) unsafe fn $pass32<Q: Quants32>(
                w: &[Q::Block],
                nb: usize,
                x: &[ActQ8_0],
                out: super::Out,
            ) {
                // SAFETY: the caller's contract.
                unsafe { by_rows!(x.len() / nb, $rows32::<Q>(w, nb, x, out)) }
            }

            /// `N` activation rows against the weight rows in `w` (`nb` blocks each), 8 weight rows at a
            /// time; a last group of fewer than 8 repeats its last row in the spare lanes and does not write
            /// them.
            ///
            /// # Safety
            #[doc = concat!("The CPU must support `", $features, "`; `out` as [`super::pass`].")]
            #[target_feature(enable = $features)]
            unsafe fn $rows32<Q: Quants32, const N: usize>(
                w: &[Q::Block],
                nb: usize,
                x: &[ActQ8_0],
                out: super::Out,
            ) {
                let cols = w.len() / nb;
                for c in (0..cols).step_by(8) {
                    // The 8 weight rows of the group, by pointer: `wp[k].add(b)` is block `b` of row `k`.
                    let wp: [*const Q::Block; 8] =
                        std::array::from_fn(|k| w[(c + k).min(cols - 1) * nb..].as_ptr());
                    let mut acc = [_mm256_setzero_ps(); N];
                    // The 8 rows are adjacent, so the group reads one contiguous run of bytes, but as 8
                    // interleaved streams, which the hardware prefetchers follow poorly from memory: each
                    // block step prefetches its share of the next group's run instead.
                    let group_bytes = 8 * nb * std::mem::size_of::<Q::Block>();
                    let step_bytes = 8 * std::mem::size_of::<Q::Block>();
                    let next = wp[0].cast::<i8>().wrapping_add(group_bytes);
                    for b in 0..nb {
                        let mut line = b * step_bytes;
                        while line < (b + 1) * step_bytes {
                            // A prefetch reads nothing the program sees and cannot fault.
                            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(line));
                            line += 64;
                        }
                        // SAFETY: `b < nb` and each row pointer starts a row of `nb` blocks of `w`.
                        let bl = |k: usize| unsafe { &*wp[k].add(b) };
                        // SAFETY (all unsafe calls of this loop): the level's target features are
                        // enabled for this function.
                        let u = unsafe {
                            [
                                Q::unpack(bl(0)),
                                Q::unpack(bl(1)),
                                Q::unpack(bl(2)),
                                Q::unpack(bl(3)),
                                Q::unpack(bl(4)),
                                Q::unpack(bl(5)),
                                Q::unpack(bl(6)),
                                Q::unpack(bl(7)),
                            ]
                        };
                        let h = |k: usize| bl(k).scale().0 as i16;
                        let d = _mm256_cvtph_ps(_mm_set_epi16(
                            h(7),
                            h(6),
                            h(5),
                            h(4),
                            h(3),
                            h(2),
                            h(1),
                            h(0),
                        ));
                        for (r, a) in acc.iter_mut().enumerate() {
                            let xb = &x[r * nb + b];
                            // SAFETY: `xb.qs` is 32 bytes, one unaligned 256-bit load.
                            let y = unsafe { _mm256_loadu_si256(xb.qs.as_ptr().cast()) };
                            let p = unsafe {
                                [
                                    Q::$quads(&u[0], y),
                                    Q::$quads(&u[1], y),
                                    Q::$quads(&u[2], y),
                                    Q::$quads(&u[3], y),
                                    Q::$quads(&u[4], y),
                                    Q::$quads(&u[5], y),
                                    Q::$quads(&u[6], y),
                                    Q::$quads(&u[7], y),
                                ]
                            };
                            let mut sums = reduce8(p);
                            if Q::OFFSET != 0 {
                                sums =
                                    _mm256_sub_epi32(sums, _mm256_set1_epi32(Q::OFFSET * xb.sum));
                            }
                            let dd = _mm256_mul_ps(d, _mm256_set1_ps(xb.d));
                            *a = _mm256_add_ps(*a, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(sums)));
                        }
                    }
                    for (r, a) in acc.iter().enumerate() {
                        let mut lanes = [0f32; 8];
                        // SAFETY: `lanes` is 8 floats.
                        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *a) };
                        for (k, &v) in lanes.iter().enumerate().take(cols - c) {
                            // SAFETY: the caller's contract (column `c + k < cols`).
                            unsafe { out.write(r, c + k, v) };
                        }
                    }
                }
            }

            /// The interleaved formats' pass ([`crate::formats::interleaved`]).
            ///
            /// # Safety
            #[doc = concat!("The CPU must support `", $features, "`; `out` as [`super::pass_groups`].")]
            pub(crate) unsafe fn $pass8<G: Groups8>(
                w: &[G::Group],
                nb: usize,
                x: &[ActQ8_0],
                out: super::Window,
            ) {
                // SAFETY: the caller's contract.
                unsafe { by_rows!(x.len() / nb, $rows8::<G>(w, nb, x, out)) }
            }

            /// `N` activation rows against the groups of 8 weight rows in `w` (`nb` groups each):
            /// each group unpacked once, then per activation row its 8 block sums in the 8 lanes
            /// ([`group_sums`]), less the offset, and the float arithmetic of [`$pass32`] for the 8
            /// rows at once.
            ///
            /// # Safety
            #[doc = concat!("The CPU must support `", $features, "`; `out` as [`super::pass_groups`].")]
            #[target_feature(enable = $features)]
            unsafe fn $rows8<G: Groups8, const N: usize>(
                w: &[G::Group],
                nb: usize,
                x: &[ActQ8_0],
                out: super::Window,
            ) {
                assert_eq!(x.len(), N * nb, "a pass holds N rows of nb blocks");
                for (g, groups) in w.chunks_exact(nb).enumerate() {
                    let mut acc = [_mm256_setzero_ps(); N];
                    for (b, group) in groups.iter().enumerate() {
                        prefetch_ahead(group);
                        // SAFETY (both): the level's target features are enabled for this function.
                        let v = unsafe { G::unpack(group) };
                        let d = unsafe { G::d(group) };
                        for (r, a) in acc.iter_mut().enumerate() {
                            let xb = &x[r * nb + b];
                            let mut sums = $group_sums::<G>(&v, &xb.qs);
                            sums = _mm256_sub_epi32(sums, _mm256_set1_epi32(G::OFFSET * xb.sum));
                            let dd = _mm256_mul_ps(d, _mm256_set1_ps(xb.d));
                            *a = _mm256_add_ps(*a, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(sums)));
                        }
                    }
                    for (r, &a) in acc.iter().enumerate() {
                        // SAFETY: the caller's contract.
                        unsafe { write_group(out, r, g, a) };
                    }
                }
            }
        };
    }

    multi_row! {
        features: "avx2,f16c,fma",
        pass: pass, rows: rows, group: group,
        pass32: pass32, rows32: rows32,
        pass8: pass8, rows8: rows8,
        unpack: unpack, accumulate: accumulate_rows, quads: quads,
        group_sums: group_sums,
    }

    multi_row! {
        features: "avx2,f16c,fma,avx512f,avx512vl,avx512vnni",
        pass: pass_vnni, rows: rows_vnni, group: group_vnni,
        pass32: pass32_vnni, rows32: rows32_vnni,
        pass8: pass8_vnni, rows8: rows8_vnni,
        unpack: unpack_vnni, accumulate: accumulate_rows_vnni, quads: quads_vnni,
        group_sums: group_sums_vnni,
    }
}

/// The passes of the interleaved 32-value formats on 512-bit vectors ([`CpuLevel::Avx512Zmm`], and
/// [`CpuLevel::Avx512ZmmK`] on AMD's EPYC Zen 5), and helpers of the K-quants' ones.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use super::avx2::by_rows;
    use super::Ahead;
    use super::Window;
    use crate::formats::interleaved::avx2::Groups8;
    use crate::formats::q4_k_x8::avx2::chunks;
    use crate::formats::ActQ8_0;
    use std::arch::x86_64::*;

    /// An interleaved format's pass on 512-bit vectors, two groups side by side (group `2p` in the
    /// low half of every vector, `2p + 1` in the high one): what a block of a pair of groups needs in
    /// registers for all the rows of a pass ([`Pairs::unpack`]), and the rows' arithmetic
    /// ([`Pairs::chunk`]). [`pass16`] does the rest, the same for every format.
    pub(crate) trait Pairs {
        /// The interleaved group.
        type Group;
        /// The activation blocks.
        type Act;
        /// What [`Pairs::unpack`] makes of a pair's block.
        type Unpacked;
        /// Constants [`Pairs::unpack`] needs, made once per pass ([`Pairs::constants`]).
        type Constants;

        /// The format's 256-bit VNNI pass, for a last odd group.
        ///
        /// # Safety
        /// As [`pass16`].
        unsafe fn single(w: &[Self::Group], nb: usize, x: &[Self::Act], out: Window);

        /// The constants of [`Pairs::unpack`].
        ///
        /// # Safety
        /// The CPU must support [`super::CpuLevel::Avx512Zmm`].
        unsafe fn constants() -> Self::Constants;

        /// Block `b` of two groups, made ready for every row of a pass.
        ///
        /// # Safety
        /// As [`Pairs::constants`].
        unsafe fn unpack(k: &Self::Constants, g0: &Self::Group, g1: &Self::Group)
            -> Self::Unpacked;

        /// `R` activation rows (row `i`'s block at `x[i * nb]`) against block `b` of two groups
        /// (`g0`, `g1`, unpacked as `u`), added to `acc[i]` (16 weight rows' sums each),
        /// prefetching `ahead` as it goes (a part per sub-block, [`Ahead::part`]) or all
        /// of it first.
        ///
        /// # Safety
        /// As [`Pairs::unpack`]; `x` must hold `(R - 1) * nb + 1` blocks and `acc` `R`
        /// accumulators.
        unsafe fn chunk<const R: usize>(
            g0: &Self::Group,
            g1: &Self::Group,
            u: &Self::Unpacked,
            x: &[Self::Act],
            nb: usize,
            acc: &mut [__m512],
            ahead: Ahead,
        );
    }

    /// `N` activation rows against the groups of 8 weight rows in `w` (`nb` groups each), two groups
    /// at a time; a last odd group goes through [`Pairs::single`].
    ///
    /// # Safety
    /// The CPU must support [`super::CpuLevel::Avx512Zmm`]; `nb > 0`; `out` as
    /// [`super::pass_groups`].
    pub(crate) unsafe fn pass16<P: Pairs>(w: &[P::Group], nb: usize, x: &[P::Act], out: Window) {
        // SAFETY: the caller's contract.
        unsafe { by_rows!(x.len() / nb, rows16::<P>(w, nb, x, out)) }
    }

    /// `P::chunk::<R>(args)` for a chunk's row count `R` (0: nothing; 1 ..= 8).
    macro_rules! by_chunk {
        ($n:expr, $p:ident::chunk($($arg:expr),*)) => {
            match $n {
                1 => $p::chunk::<1>($($arg),*),
                2 => $p::chunk::<2>($($arg),*),
                3 => $p::chunk::<3>($($arg),*),
                4 => $p::chunk::<4>($($arg),*),
                5 => $p::chunk::<5>($($arg),*),
                6 => $p::chunk::<6>($($arg),*),
                7 => $p::chunk::<7>($($arg),*),
                8 => $p::chunk::<8>($($arg),*),
                _ => {}
            }
        };
    }

    /// [`pass16`] with the row count as the constant `N`: per pair of groups and block, the pair
    /// unpacked once, then the rows in at most two chunks that keep their sums in registers
    /// ([`chunks`]).
    ///
    /// # Safety
    /// As [`pass16`].
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
    unsafe fn rows16<P: Pairs, const N: usize>(
        w: &[P::Group],
        nb: usize,
        x: &[P::Act],
        out: Window,
    ) {
        assert_eq!(x.len(), N * nb, "a pass holds N rows of nb blocks");
        let (first, second) = chunks(N);
        let groups = w.len() / nb;
        // SAFETY: the level's features are enabled here.
        let k = unsafe { P::constants() };
        for p in 0..groups / 2 {
            let (w0, w1) = (&w[2 * p * nb..][..nb], &w[(2 * p + 1) * nb..][..nb]);
            let next = w.as_ptr().wrapping_add(2 * (p + 1) * nb);
            let mut acc = [_mm512_setzero_ps(); N];
            for (b, (g0, g1)) in w0.iter().zip(w1).enumerate() {
                let ahead = Ahead::pair(next, b);
                // SAFETY: the level's features are enabled here; the chunks' rows are rows of the
                // pass.
                unsafe {
                    let u = P::unpack(&k, g0, g1);
                    let (a0, a1) = acc.split_at_mut(first);
                    by_chunk!(first, P::chunk(g0, g1, &u, &x[b..], nb, a0, ahead));
                    by_chunk!(
                        second,
                        P::chunk(g0, g1, &u, &x[first * nb + b..], nb, a1, Ahead::NONE)
                    );
                }
            }
            for (r, &a) in acc.iter().enumerate() {
                // SAFETY: the caller's contract.
                unsafe { write_pair(out, r, 2 * p, a) };
            }
        }
        if groups % 2 == 1 {
            let g = groups - 1;
            // SAFETY: the caller's contract.
            unsafe { P::single(&w[g * nb..], nb, x, out.past_groups(g)) };
        }
    }

    /// The 32-value interleaved formats (Q4_0, Q5_0) as [`Pairs`]: both groups' 8 vectors unpacked
    /// and their scales, then per row the 16 block sums in 16 lanes (the two `vpdpbusd` chains of
    /// `group_sums_vnni`, the rows side by side so that neighbouring instructions do not wait on
    /// each other), less the offset, and the float arithmetic of the 256-bit pass for the 16
    /// weight rows at once.
    pub(crate) struct Groups<G>(std::marker::PhantomData<G>);

    impl<G: Groups8> Pairs for Groups<G> {
        type Group = G::Group;
        type Act = ActQ8_0;
        type Unpacked = ([__m512i; 8], __m512);
        type Constants = ();

        unsafe fn single(w: &[G::Group], nb: usize, x: &[ActQ8_0], out: Window) {
            // SAFETY: the caller's contract; the level includes the VNNI level's features.
            unsafe { super::avx2::pass8_vnni::<G>(w, nb, x, out) }
        }

        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
        unsafe fn constants() {}

        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
        unsafe fn unpack(_: &(), g0: &G::Group, g1: &G::Group) -> Self::Unpacked {
            // SAFETY: the level's features are enabled here.
            unsafe { (G::unpack_pair(g0, g1), G::d_pair(g0, g1)) }
        }

        #[inline]
        #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
        unsafe fn chunk<const R: usize>(
            _: &G::Group,
            _: &G::Group,
            (v, d): &Self::Unpacked,
            x: &[ActQ8_0],
            nb: usize,
            acc: &mut [__m512],
            ahead: Ahead,
        ) {
            let mut a = [_mm512_setzero_si512(); R];
            let mut c = [_mm512_setzero_si512(); R];
            // The rows' quants, bounds-checked once here rather than at every load.
            let rows: [*const i8; R] = std::array::from_fn(|i| x[i * nb].qs.as_ptr());
            // The next pair's lines in one burst (5 for Q4_0, 6 or 7 for Q5_0), before the
            // multiplies, unlike the K-quant chunks' parts per sub-block: a prefetch among them
            // had the compiler load every activation quad into a general register up front
            // (spilled, for 8 rows) and broadcast it from there instead of from memory as part
            // of `vpdpbusd` (as it did too with the loads in a function of their own, like the
            // K-quants' `quads`). With both changes, on Zen 5 (stop 76, `rcurve 2 4864`, 896
            // columns, 3 alternations) this pass ran Q4_0 at 399–463 GMAC/s, against 271–338
            // before and 287–329 for the 256-bit pass. Not measured on Intel, where
            // `CpuLevel::Avx512Zmm` takes this chunk too.
            ahead.part(0, 1);
            for t in 0..4 {
                for (i, (a, c)) in a.iter_mut().zip(c.iter_mut()).enumerate() {
                    let y = rows[i];
                    // SAFETY: `qs` is 32 bytes; bytes 4t .. 4t + 4 and 16 + 4t .. 20 + 4t are in
                    // bounds for t < 4.
                    let (ya, yc) = unsafe {
                        (
                            y.add(4 * t).cast::<i32>().read_unaligned(),
                            y.add(16 + 4 * t).cast::<i32>().read_unaligned(),
                        )
                    };
                    *a = _mm512_dpbusd_epi32(*a, v[t], _mm512_set1_epi32(ya));
                    *c = _mm512_dpbusd_epi32(*c, v[t + 4], _mm512_set1_epi32(yc));
                }
            }
            for (i, acc) in acc.iter_mut().enumerate() {
                let xb = &x[i * nb];
                let sums = _mm512_sub_epi32(
                    _mm512_add_epi32(a[i], c[i]),
                    _mm512_set1_epi32(G::OFFSET * xb.sum),
                );
                let dd = _mm512_mul_ps(*d, _mm512_set1_ps(xb.d));
                *acc = _mm512_add_ps(*acc, _mm512_mul_ps(dd, _mm512_cvtepi32_ps(sums)));
            }
        }
    }

    /// Writes the 16 lanes of `a`, one per row of groups `g` and `g + 1`, as columns `8g ..` of
    /// row `r`.
    ///
    /// # Safety
    /// As [`super::Window::write`].
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
    pub(crate) unsafe fn write_pair(out: super::Window, r: usize, g: usize, a: __m512) {
        // SAFETY: the caller's contract.
        if let Some(at) = unsafe { out.whole(r, 8 * g, 16) } {
            // SAFETY: `whole` checked that the 16 columns are in the window.
            unsafe { _mm512_storeu_ps(at, a) };
            return;
        }
        let mut lanes = [0f32; 16];
        // SAFETY: `lanes` is 16 floats.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), a) };
        // SAFETY: the caller's contract.
        unsafe { out.write_lanes(r, 8 * g, &lanes) };
    }

    /// For each of `R` Q8_K activation rows (row `i`'s block at `x[i * nb]`): `a[i] += vpdpbusd(lo,
    /// quad)` and `b[i] += vpdpbusd(hi, quad')`, `quad` the row's 4 quants at position `at` and
    /// `quad'` those at `at + 128` (the K-quants' vectors `V_t` and `V_{t + 4}` of one load),
    /// broadcast to all 16 lanes. The rows go side by side so that neighbouring instructions do not
    /// wait on each other.
    ///
    /// # Safety
    /// `x` must hold `(R - 1) * nb + 1` blocks; `at < 128` and a multiple of 4.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
    pub(crate) unsafe fn quads<const R: usize>(
        a: &mut [__m512i; R],
        b: &mut [__m512i; R],
        (lo, hi): (__m512i, __m512i),
        x: &[crate::formats::BlockQ8K],
        nb: usize,
        at: usize,
    ) {
        for i in 0..R {
            let y = x[i * nb].qs.as_ptr().wrapping_add(at);
            // SAFETY: `qs` is 256 bytes; bytes at .. at + 4 and at + 128 .. at + 132 are in bounds
            // for at < 128 (the caller's contract).
            let (wa, wb) = unsafe {
                (
                    y.cast::<i32>().read_unaligned(),
                    y.add(128).cast::<i32>().read_unaligned(),
                )
            };
            a[i] = _mm512_dpbusd_epi32(a[i], lo, _mm512_set1_epi32(wa));
            b[i] = _mm512_dpbusd_epi32(b[i], hi, _mm512_set1_epi32(wb));
        }
    }

    /// A 512-bit vector of the 32 bytes at `lo` (low half) and the 32 at `hi` (high half).
    ///
    /// # Safety
    /// `lo` and `hi` must each point to 32 readable bytes.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
    pub(crate) unsafe fn join(lo: *const u8, hi: *const u8) -> __m512i {
        // SAFETY: the caller's contract; unaligned loads.
        unsafe {
            _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_loadu_si256(lo.cast())),
                _mm256_loadu_si256(hi.cast()),
            )
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::Ahead;
    use crate::formats::{BlockQ4Kx8, BlockQ4_0x8, BlockQ5_0x8, BlockQ6Kx8};

    /// The parts a chunk prefetches, one per sub-block, cover the next pair's block (both groups'
    /// bytes) line by line, each line once.
    fn covers<T>(parts: usize) {
        let ahead = Ahead::pair(std::ptr::null::<T>(), 0);
        let bytes = 2 * std::mem::size_of::<T>();
        let lines: Vec<usize> = (0..parts).flat_map(|i| ahead.range(i, parts)).collect();
        assert_eq!(lines, (0..bytes.div_ceil(64)).collect::<Vec<_>>());
        assert!(lines.len() * 64 >= bytes && (lines.len() - 1) * 64 < bytes);
    }

    #[test]
    fn a_chunks_prefetch_parts_cover_the_next_pairs_block_once() {
        covers::<BlockQ4Kx8>(8);
        covers::<BlockQ6Kx8>(8);
        covers::<BlockQ4_0x8>(4);
        covers::<BlockQ5_0x8>(4);
    }
}
