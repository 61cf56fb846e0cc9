//! Intel's AMX tiles ([`crate::CpuLevel::Amx`]): whether this process may use them, the tile
//! products the interleaved Q4_K pass and gemm ask for, and the activations' quants in the order a
//! tile reads them.
//!
//! A tile is a matrix of up to 16 rows of up to 64 bytes held in one of eight tile registers.
//! `tdpbsud c, a, b` adds to each `i32` element `c[i][n]` the exact products of signed bytes
//! `a[i][4k + j]` and unsigned bytes `b[k][4n + j]` over `k` and `j < 4`. The Q4_K pass puts up to
//! 16 activation rows' quants of one 32-value sub-block in `a` (one row each, in natural order) and
//! the same values of 16 weight rows in `b` (a pair of interleaved groups: row `t` of `b` is the
//! vector `V_t` of both groups, whose lane `n` holds weight row `n`'s values `4t .. 4t + 4`), so
//! `c[i][n]` is the sub-block's integer sum of activation row `i` and weight row `n`, the same
//! integer every other level computes. Only Q4_K runs on the tiles: a Q6_K pass built the same way
//! (16-value sub-blocks, so 16 products of half the depth per block) took 0.83–2.5 times as long as
//! the 512-bit one (median 1.41 over 120 pairs of row counts 2–16, in cache and from memory), and
//! was removed.
//!
//! Why it is not faster was not measured (the machine showed no counters). A 2-row product of a
//! 1536 × 8960 matrix took 0.13–0.33 ms more than with the 512-bit passes in cache (where those
//! took 0.2 ms) and up to 0.19 ms more from memory (0.24–0.34 ms): more than the tiles' arithmetic
//! explains;
//! overlapping the stages of consecutive blocks ([`pass`]) changed little. Each sub-block's sums
//! still need their own scale per weight row, so every sum is stored from its tile and scaled by
//! vectors (8 loads, multiplies and adds per activation row and block): that halves the vector
//! work per row against the 512-bit pass rather than removing it, and the weights are unpacked into
//! bytes at every pass.
//!
//! Stop 63 built both ideas stop 54 left untried, for matmuls of [`AMX_GEMM_FROM_ROWS`] rows or
//! more (a prefill's chunks): a gemm (`formats::q4_k_x8::amx::gemm`) that unpacks each block of a
//! pair of groups once for all the rows, and multiplies the weights by their sub-block's scale
//! split in two parts that fit a byte (`scale >> 3` and `scale & 7`, one `vpmullw` each:
//! [`FOLDED_BYTES`]), so that four products of depth 64 per block accumulate each part whole
//! ([`Tiles::folded`], [`Tiles::folded_pair`]) and the vectors only combine `8 · high + low`, the
//! integer the 512-bit pass makes, once per block instead of scaling every sub-block. Measured on
//! a 2-core Xeon with AMX (stop 63, `rcurve` for 256 rows of a 1536 × 8960 Q4_K matrix, levels
//! alternated, 11 pairs, two of them with a first version that took one slab at a time): the
//! gemm's rate 0.92–1.93 times the 512-bit passes' (median 1.23; 2 threads 265–511 GMAC/s against
//! 255–327, 1 thread 112–196 against 90–163). The split doubles the products: on
//! that machine one `tdpbsud` took 17 ns (967 GMAC/s a core with the tiles resident), a slab's
//! products with their loads 198 ns (a C loop alone), so the tiles' work caps the gemm at about
//! 330 useful GMAC/s a core; the vectors' unpacking and float arithmetic add to it. A 1,401-token
//! prefill of the 1.5B target was not measurably faster (5 alternated runs each, medians 11.6 s
//! with the gemm and 10.7 s without, runs spread −18% to +30% around their median; one
//! 512-token prefill each in `bench --cost-curve`, 156.1 with a first version against 132.7
//! tok/s; 20 grounded prompts' time to first token 2% shorter in all), so the level stays opt-in.

#[cfg(target_arch = "x86_64")]
use crate::simd::avx512::write_pair;
#[cfg(target_arch = "x86_64")]
use crate::simd::{Ahead, Window};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{__m512, _mm512_setzero_ps};

/// From how many activation rows [`crate::CpuLevel::Amx`] runs the interleaved Q4_K passes on the
/// tiles; smaller passes take [`crate::CpuLevel::Avx512Zmm`]'s. Measured on a 16-core Xeon with AMX
/// (stop 54, 2 threads, `rcurve 2 8960 every` alternating the two levels, the tiles used from 2
/// rows; times on the tiles over times on 512-bit vectors, 56 and 64 pairs): 0.85–2.4 (median
/// 1.36) up to 8 rows, 0.6–1.6 (median 0.95) from 9 to 16; on a 4-layer model with
/// the 1.5B target's shapes (random Q4_K weights, `step_time`), 8-token blocks 1.1–1.6, 16-token
/// blocks 0.9–1.3 and a 64-token prefill (passes of 16 rows) 0.85 (1,274 against 1,085 tok/s,
/// medians of 16 runs each). So only 16-row passes (prefill chunks, 16-token blocks) take the
/// tiles.
pub const AMX_FROM_ROWS: usize = 16;

/// From how many activation rows [`crate::CpuLevel::Amx`] runs an interleaved Q4_K matmul (rows a
/// multiple of 8) as a gemm on the
/// tiles (`formats::q4_k_x8::amx::gemm`: each block's weights unpacked and multiplied by their
/// scales once for all rows, whole slabs of 16 rows per product, no scaling per sub-block); the
/// rows past the last whole slab go through the passes. Not measured against other thresholds:
/// two slabs are the least that share a block's unpacking, and a 16-row pass keeps the tiles of
/// [`AMX_FROM_ROWS`].
pub const AMX_GEMM_FROM_ROWS: usize = 32;

/// The activation quants of `x` (Q8_K blocks, in the kernels' order) in natural order: value `v`
/// of block `j` at `256 j + v`. The kernels' order is an 8 × 8 transpose of 4-value words, its own
/// inverse, so word `8 s + t` of a natural block is word `8 t + s` of the stored one.
pub(crate) fn natural_order(x: &[crate::BlockQ8K]) -> Vec<i8> {
    let mut out = vec![0i8; 256 * x.len()];
    for (block, o) in x.iter().zip(out.chunks_exact_mut(256)) {
        for s in 0..8 {
            for t in 0..8 {
                o[32 * s + 4 * t..][..4].copy_from_slice(&block.qs[32 * t + 4 * s..][..4]);
            }
        }
    }
    out
}

/// The tile products a pass or a gemm needs, on the hardware ([`Hardware`]) or, in tests,
/// emulated.
///
/// In a pass ([`Tiles::product`]) two sets of tiles take turns so that one product can start while
/// the last is stored: set `S` (0 or 1) uses `tmm{S}` for the sums, `tmm{2 + S}` for the
/// activations and `tmm{4 + S}` for the weights. The gemm's products ([`Tiles::folded`],
/// [`Tiles::folded_pair`]) use all eight tiles, each 16 rows of 64 bytes.
pub(crate) trait Tiles {
    /// Sets the tiles up for products of `rows` activation rows (1 ..= 16) over `depth` values
    /// (a multiple of 4 up to 64: 32 for a Q4_K sub-block).
    ///
    /// # Safety
    /// The CPU must support [`crate::CpuLevel::Amx`].
    unsafe fn configure(&mut self, rows: usize, depth: usize);

    /// `c[i][n] = Σ_{k < depth} a[i · stride + k] · b[64 (k / 4) + 4 n + k % 4]` for the configured
    /// rows `i` and `n < 16`, written to `c` (16 `i32` per row), on tile set `S`.
    ///
    /// # Safety
    /// [`Tiles::configure`] was called on this thread since the last [`Tiles::release`]; `a` is
    /// readable for `depth` bytes at each of the rows' offsets, `b` for `16 · depth` bytes, `c`
    /// writable for 16 `i32` per row.
    unsafe fn product<const S: usize>(
        &mut self,
        a: *const i8,
        stride: usize,
        b: *const u8,
        c: *mut i32,
    );

    /// Sets all eight tiles up as 16 rows of 64 bytes, for [`Tiles::folded`].
    ///
    /// # Safety
    /// The CPU must support [`crate::CpuLevel::Amx`].
    unsafe fn configure_folded(&mut self);

    /// The integer sums of one 256-value block for 16 activation rows and 16 weight rows whose
    /// weights were multiplied by the two parts of their sub-blocks' scales ([`FOLDED_BYTES`]):
    /// `c[16 i + n] = Σ_{k < 256} a[i · stride + k] · b[1024 (k / 64) + 64 (k % 64 / 4) + 4 n + k % 4]`
    /// and `c[256 + 16 i + n]` the same with `b[4096 + ..]`, for `i, n < 16`: four products of
    /// depth 64 into each of two sums' tiles.
    ///
    /// # Safety
    /// [`Tiles::configure_folded`] was called on this thread since the last [`Tiles::release`];
    /// `a` is readable for 256 bytes at each of the 16 rows' offsets, `b` for [`FOLDED_BYTES`]
    /// bytes, `c` writable for 512 `i32`.
    unsafe fn folded(&mut self, a: *const i8, stride: usize, b: *const u8, c: *mut i32);

    /// [`Tiles::folded`] for two slabs of 16 activation rows at once (the second's rows at
    /// `a + 16 · stride`, its sums at `c + 512`), each chunk's weights loaded once for both: four
    /// chains of products that do not wait on each other.
    ///
    /// # Safety
    /// As [`Tiles::folded`], for 32 rows of `a` and 1024 `i32` of `c`.
    unsafe fn folded_pair(&mut self, a: *const i8, stride: usize, b: *const u8, c: *mut i32);

    /// Gives the tiles back (their state no longer needs saving at a context switch).
    ///
    /// # Safety
    /// As [`Tiles::configure`].
    unsafe fn release(&mut self);
}

/// The weights' bytes of one block of a pair of groups for [`Tiles::folded`]: the unpacked values
/// times the high part of their sub-block's scale (`scale >> 3`), then times the low part
/// (`scale & 7`), 4096 bytes each; every product is at most 15 · 7, so it fits a byte.
pub(crate) const FOLDED_BYTES: usize = 8192;

/// Values per sub-block of a Q4_K block: the depth of one tile product.
const DEPTH: usize = 32;

/// Sub-blocks per block: tile products per block of a pair of groups.
const SUBS: usize = 8;

/// An interleaved format's part of the pass on tiles ([`pass`]; Q4_K's, blocks of [`SUBS`]
/// sub-blocks of [`DEPTH`] values): how a block of a pair of groups becomes the weights' tiles, and
/// what the vectors do with the tiles' sums.
#[cfg(target_arch = "x86_64")]
pub(crate) trait TileFormat {
    /// The interleaved group.
    type Group;
    /// Constants [`TileFormat::finish`] needs, made once per pass.
    type Constants;

    /// The constants.
    ///
    /// # Safety
    /// The CPU must support [`crate::CpuLevel::Avx512Zmm`].
    unsafe fn constants() -> Self::Constants;

    /// Block `b` of both groups as the weights' tiles: sub-block `j`'s (`DEPTH / 4` rows of 64
    /// bytes, row `t` the values `4 t .. 4 t + 4` of the 16 weight rows) at byte `16 · DEPTH · j`
    /// (`512 j`) of `tiles`; prefetching `ahead` a part per 32 values ([`crate::simd::Ahead::part`]).
    ///
    /// # Safety
    /// As [`TileFormat::constants`].
    unsafe fn unpack(g0: &Self::Group, g1: &Self::Group, tiles: &mut [u8; 4096], ahead: Ahead);

    /// Adds to `acc[i]` (`i < n`, 16 weight rows each) the block's part of the dot products of
    /// activation row `i` (its block at `x[i * nb]`), from the block's sums `c[j]` (sub-block
    /// `j`'s tile: row `i` holds the 16 weight rows' integer sums).
    ///
    /// # Safety
    /// As [`TileFormat::constants`]; `x` must hold `(n - 1) * nb + 1` blocks.
    #[allow(clippy::too_many_arguments)]
    unsafe fn finish(
        k: &Self::Constants,
        g0: &Self::Group,
        g1: &Self::Group,
        c: &[[i32; 256]; SUBS],
        x: &[crate::BlockQ8K],
        nb: usize,
        n: usize,
        acc: &mut [__m512; 16],
    );

    /// The format's 256-bit VNNI pass, for a last odd group.
    ///
    /// # Safety
    /// As [`pass`].
    unsafe fn single(w: &[Self::Group], nb: usize, x: &[crate::BlockQ8K], out: Window);
}

/// The tiles' operands in memory, two of each so that one block's can be written while the last
/// one's are read.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct Buffers {
    /// The weights' tiles of a block ([`TileFormat::unpack`]).
    b: [[u8; 4096]; 2],
    /// The sums' tiles of a block: per sub-block, row `i` holds activation row `i`'s sums with the
    /// 16 weight rows.
    c: [[[i32; 256]; SUBS]; 2],
}

/// `x.len() / nb` (1 ..= 16) activation rows against the groups of 8 weight rows in `w` (`nb`
/// groups each), two groups at a time on the tiles; a last odd group goes through the format's
/// 256-bit VNNI pass. `natural` holds the rows' quants in natural order ([`natural_order`]).
///
/// The blocks of all pairs go through three stages a block apart, so that no stage reads memory
/// another has just written (a tile load may not take its bytes from stores still in flight, nor a
/// vector load from a tile store): block `j`'s weights are unpacked into tiles while block
/// `j - 1`'s products run and block `j - 2`'s sums are scaled into the accumulators. Against one
/// block at a time it changed little on the Xeon of stop 54 (`rcurve`, Q4_K in cache: r(8)
/// 2.49–2.93 against 2.77–3.26, r(2) 1.95–2.27 against 2.05–2.76).
///
/// # Safety
/// The CPU must support [`crate::CpuLevel::Amx`] (for [`Hardware`]; the
/// [`crate::CpuLevel::Avx512Zmm`] features for another `T`); `nb > 0`; `out` as
/// [`crate::simd::pass_groups`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni,avx512bw")]
pub(crate) unsafe fn pass<F: TileFormat, T: Tiles>(
    tiles: &mut T,
    w: &[F::Group],
    nb: usize,
    x: &[crate::BlockQ8K],
    natural: &[i8],
    out: Window,
) {
    let n = x.len() / nb;
    assert!(
        (1..=16).contains(&n) && x.len() == n * nb && natural.len() == 256 * x.len(),
        "a pass holds 1 to 16 rows of nb blocks and their natural quants"
    );
    let groups = w.len() / nb;
    let items = groups / 2 * nb;
    // SAFETY: the caller's contract.
    let k = unsafe { F::constants() };
    let mut buf = Buffers {
        b: [[0; 4096]; 2],
        c: [[[0; 256]; SUBS]; 2],
    };
    let stride = 256 * nb;
    let pair = |j: usize| {
        let (p, b) = (j / nb, j % nb);
        (p, b, &w[2 * p * nb + b], &w[(2 * p + 1) * nb + b])
    };
    let mut acc = [_mm512_setzero_ps(); 16];
    // SAFETY: the caller's contract.
    unsafe { tiles.configure(n, DEPTH) };
    for j in 0..items + 2 {
        if (1..=items).contains(&j) {
            // Block j - 1's products, from the weights' tiles unpacked one step ago. Row i's
            // quants of sub-block s: natural[256 (i nb + b) + DEPTH s ..][..DEPTH].
            let b = (j - 1) % nb;
            let a = natural.as_ptr().wrapping_add(256 * b);
            let bt = buf.b[(j - 1) % 2].as_ptr();
            let ct = &mut buf.c[(j - 1) % 2];
            for (s, ct) in ct.iter_mut().enumerate() {
                let (a, bt, ct) = (
                    a.wrapping_add(DEPTH * s),
                    bt.wrapping_add(16 * DEPTH * s),
                    ct.as_mut_ptr(),
                );
                // SAFETY: the tiles are configured for n rows of DEPTH values; row i's bytes at
                // a + i · stride lie in `natural` (i < n); the weights' tile lies in the 4096-byte
                // buffer (16 · DEPTH · SUBS = 4096) and the sums' tile is 256 `i32`.
                unsafe {
                    if s % 2 == 0 {
                        tiles.product::<0>(a, stride, bt, ct);
                    } else {
                        tiles.product::<1>(a, stride, bt, ct);
                    }
                }
            }
        }
        if j < items {
            let (p, b, g0, g1) = pair(j);
            let ahead = Ahead::pair(w.as_ptr().wrapping_add(2 * (p + 1) * nb), b);
            // SAFETY: the caller's contract.
            unsafe { F::unpack(g0, g1, &mut buf.b[j % 2], ahead) };
        }
        if j >= 2 {
            let (p, b, g0, g1) = pair(j - 2);
            // SAFETY: the caller's contract; rows i < n have their block b at x[b + i nb].
            unsafe { F::finish(&k, g0, g1, &buf.c[j % 2], &x[b..], nb, n, &mut acc) };
            if b == nb - 1 {
                for (r, a) in acc.iter_mut().enumerate().take(n) {
                    // SAFETY: the caller's contract.
                    unsafe { write_pair(out, r, 2 * p, *a) };
                    *a = _mm512_setzero_ps();
                }
            }
        }
    }
    // SAFETY: the caller's contract.
    unsafe { tiles.release() };
    if groups % 2 == 1 {
        let g = groups - 1;
        // SAFETY: the caller's contract.
        unsafe { F::single(&w[g * nb..], nb, x, out.past_groups(g)) };
    }
}

/// The tiles of this CPU.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Hardware;

/// The 64-byte tile configuration `ldtilecfg` reads (palette 1).
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct Config([u8; 64]);

#[cfg(target_arch = "x86_64")]
impl Config {
    /// Configures this thread's tiles (`ldtilecfg`).
    ///
    /// # Safety
    /// The CPU must support [`crate::CpuLevel::Amx`] (with the operating system's permission).
    #[inline]
    unsafe fn load(&self) {
        // SAFETY: the caller's contract; `self` is 64 readable bytes.
        unsafe {
            std::arch::asm!(
                "ldtilecfg [{0}]",
                in(reg) self.0.as_ptr(),
                options(nostack, readonly, preserves_flags)
            );
        }
    }

    /// All eight tiles 16 rows × 64 bytes ([`Tiles::folded`]).
    fn folded() -> Config {
        let mut c = [0u8; 64];
        c[0] = 1;
        for tile in 0..8 {
            c[16 + 2 * tile..18 + 2 * tile].copy_from_slice(&64u16.to_le_bytes());
            c[48 + tile] = 16;
        }
        Config(c)
    }

    /// Tiles 0, 1: `rows` × 64 bytes (the sums); 2, 3: `rows` × `depth` bytes (activations); 4,
    /// 5: `depth / 4` × 64 bytes (weights).
    fn new(rows: usize, depth: usize) -> Config {
        let mut c = [0u8; 64];
        c[0] = 1;
        let rows = rows.clamp(1, 16) as u8;
        let depth = depth.clamp(4, 64) as u8 & !3;
        for (tile, r, bytes) in [
            (0, rows, 64u16),
            (1, rows, 64),
            (2, rows, u16::from(depth)),
            (3, rows, u16::from(depth)),
            (4, depth / 4, 64),
            (5, depth / 4, 64),
        ] {
            c[16 + 2 * tile..18 + 2 * tile].copy_from_slice(&bytes.to_le_bytes());
            c[48 + tile] = r;
        }
        Config(c)
    }
}

#[cfg(target_arch = "x86_64")]
impl Tiles for Hardware {
    #[inline]
    unsafe fn configure(&mut self, rows: usize, depth: usize) {
        // SAFETY: the caller's contract.
        unsafe { Config::new(rows, depth).load() }
    }

    #[inline]
    unsafe fn product<const S: usize>(
        &mut self,
        a: *const i8,
        stride: usize,
        b: *const u8,
        c: *mut i32,
    ) {
        /// The product on tiles `$c` (sums), `$a` (activations) and `$b` (weights).
        macro_rules! product {
            ($c:literal, $a:literal, $b:literal) => {
                std::arch::asm!(
                    concat!("tilezero ", $c),
                    concat!("tileloadd ", $a, ", [{a} + {stride}*1]"),
                    concat!("tileloadd ", $b, ", [{b} + {row}*1]"),
                    concat!("tdpbsud ", $c, ", ", $a, ", ", $b),
                    concat!("tilestored [{c} + {row}*1], ", $c),
                    a = in(reg) a,
                    stride = in(reg) stride,
                    b = in(reg) b,
                    c = in(reg) c,
                    row = in(reg) 64usize,
                    options(nostack, preserves_flags)
                )
            };
        }
        // SAFETY: the caller's contract: the tiles are configured, and the rows of `a`, `b` and `c`
        // are in bounds.
        unsafe {
            if S == 0 {
                product!("tmm0", "tmm2", "tmm4");
            } else {
                product!("tmm1", "tmm3", "tmm5");
            }
        }
    }

    #[inline]
    unsafe fn configure_folded(&mut self) {
        // SAFETY: the caller's contract.
        unsafe { Config::folded().load() }
    }

    /// Sums in `tmm0` (high parts) and `tmm1` (low parts); the activations of even and odd
    /// 64-value chunks in `tmm2` and `tmm3`, their weights in `tmm4`/`tmm6` and `tmm5`/`tmm7`, so
    /// that a chunk's loads need not wait for the last chunk's products.
    #[inline]
    unsafe fn folded(&mut self, a: *const i8, stride: usize, b: *const u8, c: *mut i32) {
        // SAFETY: the caller's contract: the tiles are configured, and the rows of `a`, `b` and `c`
        // are in bounds.
        unsafe {
            std::arch::asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tileloadd tmm2, [{a} + {stride}*1]",
                "tileloadd tmm4, [{b} + {row}*1]",
                "tileloadd tmm6, [{b} + {row}*1 + 4096]",
                "tdpbsud tmm0, tmm2, tmm4",
                "tdpbsud tmm1, tmm2, tmm6",
                "tileloadd tmm3, [{a} + {stride}*1 + 64]",
                "tileloadd tmm5, [{b} + {row}*1 + 1024]",
                "tileloadd tmm7, [{b} + {row}*1 + 5120]",
                "tdpbsud tmm0, tmm3, tmm5",
                "tdpbsud tmm1, tmm3, tmm7",
                "tileloadd tmm2, [{a} + {stride}*1 + 128]",
                "tileloadd tmm4, [{b} + {row}*1 + 2048]",
                "tileloadd tmm6, [{b} + {row}*1 + 6144]",
                "tdpbsud tmm0, tmm2, tmm4",
                "tdpbsud tmm1, tmm2, tmm6",
                "tileloadd tmm3, [{a} + {stride}*1 + 192]",
                "tileloadd tmm5, [{b} + {row}*1 + 3072]",
                "tileloadd tmm7, [{b} + {row}*1 + 7168]",
                "tdpbsud tmm0, tmm3, tmm5",
                "tdpbsud tmm1, tmm3, tmm7",
                "tilestored [{c} + {row}*1], tmm0",
                "tilestored [{c} + {row}*1 + 1024], tmm1",
                a = in(reg) a,
                stride = in(reg) stride,
                b = in(reg) b,
                c = in(reg) c,
                row = in(reg) 64usize,
                options(nostack, preserves_flags)
            )
        }
    }

    /// Sums in `tmm0`/`tmm1` (first slab, high and low parts) and `tmm2`/`tmm3` (second slab);
    /// each chunk's activations in `tmm4` and `tmm5`, its weights in `tmm6` (high) and `tmm7`
    /// (low).
    #[inline]
    unsafe fn folded_pair(&mut self, a: *const i8, stride: usize, b: *const u8, c: *mut i32) {
        /// One 64-value chunk: its loads at these offsets, then its four products.
        macro_rules! chunk {
            ($a:literal, $bh:literal, $bl:literal) => {
                concat!(
                    "tileloadd tmm6, [{b} + {row}*1 + ",
                    $bh,
                    "]\n",
                    "tileloadd tmm7, [{b} + {row}*1 + ",
                    $bl,
                    "]\n",
                    "tileloadd tmm4, [{a} + {stride}*1 + ",
                    $a,
                    "]\n",
                    "tileloadd tmm5, [{a2} + {stride}*1 + ",
                    $a,
                    "]\n",
                    "tdpbsud tmm0, tmm4, tmm6\n",
                    "tdpbsud tmm1, tmm4, tmm7\n",
                    "tdpbsud tmm2, tmm5, tmm6\n",
                    "tdpbsud tmm3, tmm5, tmm7\n",
                )
            };
        }
        // SAFETY: the caller's contract: the tiles are configured, and the rows of `a`, `b` and `c`
        // are in bounds.
        unsafe {
            std::arch::asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                chunk!("0", "0", "4096"),
                chunk!("64", "1024", "5120"),
                chunk!("128", "2048", "6144"),
                chunk!("192", "3072", "7168"),
                "tilestored [{c} + {row}*1], tmm0",
                "tilestored [{c} + {row}*1 + 1024], tmm1",
                "tilestored [{c} + {row}*1 + 2048], tmm2",
                "tilestored [{c} + {row}*1 + 3072], tmm3",
                a = in(reg) a,
                a2 = in(reg) a.wrapping_add(16 * stride),
                stride = in(reg) stride,
                b = in(reg) b,
                c = in(reg) c,
                row = in(reg) 64usize,
                options(nostack, preserves_flags)
            )
        }
    }

    #[inline]
    unsafe fn release(&mut self) {
        // SAFETY: the caller's contract.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
    }
}

/// The tiles' arithmetic in plain Rust, for testing a pass's layout on CPUs without AMX.
#[cfg(any(test, feature = "testing"))]
#[derive(Default)]
pub(crate) struct Emulated {
    rows: usize,
    depth: usize,
}

#[cfg(any(test, feature = "testing"))]
impl Tiles for Emulated {
    unsafe fn configure(&mut self, rows: usize, depth: usize) {
        self.rows = rows;
        self.depth = depth;
    }

    unsafe fn product<const S: usize>(
        &mut self,
        a: *const i8,
        stride: usize,
        b: *const u8,
        c: *mut i32,
    ) {
        for i in 0..self.rows {
            for n in 0..16 {
                let mut sum = 0i32;
                for k in 0..self.depth {
                    // SAFETY: the caller's contract.
                    let (x, w) =
                        unsafe { (*a.add(i * stride + k), *b.add(64 * (k / 4) + 4 * n + k % 4)) };
                    sum += i32::from(x) * i32::from(w);
                }
                // SAFETY: the caller's contract.
                unsafe { c.add(16 * i + n).write(sum) };
            }
        }
    }

    unsafe fn configure_folded(&mut self) {
        self.rows = 16;
        self.depth = 64;
    }

    unsafe fn folded(&mut self, a: *const i8, stride: usize, b: *const u8, c: *mut i32) {
        for part in 0..2 {
            for i in 0..16 {
                for n in 0..16 {
                    let mut sum = 0i32;
                    for k in 0..256 {
                        let at = 4096 * part + 1024 * (k / 64) + 64 * (k % 64 / 4) + 4 * n + k % 4;
                        // SAFETY: the caller's contract.
                        let (x, w) = unsafe { (*a.add(i * stride + k), *b.add(at)) };
                        sum += i32::from(x) * i32::from(w);
                    }
                    // SAFETY: the caller's contract.
                    unsafe { c.add(256 * part + 16 * i + n).write(sum) };
                }
            }
        }
    }

    unsafe fn folded_pair(&mut self, a: *const i8, stride: usize, b: *const u8, c: *mut i32) {
        // SAFETY: the caller's contract, for each slab.
        unsafe {
            self.folded(a, stride, b, c);
            self.folded(a.wrapping_add(16 * stride), stride, b, c.wrapping_add(512));
        }
    }

    unsafe fn release(&mut self) {
        self.rows = 0;
    }
}

/// `rows` (weight rows of `nb` blocks each) packed as interleaved groups, which must be five (two
/// pairs and an odd one), and their count.
#[cfg(all(any(test, feature = "testing"), target_arch = "x86_64"))]
pub(crate) fn five_groups<G: crate::Interleaved>(rows: &[G::Block], nb: usize) -> (usize, Vec<G>) {
    let groups = rows.len() / (8 * nb);
    assert_eq!(groups, 5, "two pairs of groups and an odd one");
    let w = (0..groups)
        .flat_map(|g| {
            (0..nb).map(move |b| G::pack(std::array::from_fn(|k| &rows[(8 * g + k) * nb + b])))
        })
        .collect();
    (groups, w)
}

/// Activation values in -1..1 from `seed`, one per call.
#[cfg(all(any(test, feature = "testing"), target_arch = "x86_64"))]
pub(crate) fn values(mut seed: u64) -> impl FnMut() -> f32 {
    move || {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }
}

/// A reference dot product of a weight row with an activation row.
#[cfg(all(any(test, feature = "testing"), target_arch = "x86_64"))]
type Dot<B> = fn(&[B], &[crate::BlockQ8K]) -> f32;

/// Runs [`pass`] on emulated tiles for 1 to 16 activation rows against `rows` (weight rows of `nb`
/// blocks each, five groups of 8: two pairs and an odd last group) packed as `F::Group`, over the
/// whole window and over one that cuts groups, and compares every result with `dot` bit for bit.
#[cfg(all(any(test, feature = "testing"), target_arch = "x86_64"))]
pub(crate) fn check_emulated<F>(
    rows: &[<F::Group as crate::Interleaved>::Block],
    nb: usize,
    dot: Dot<<F::Group as crate::Interleaved>::Block>,
) where
    F: TileFormat,
    F::Group: crate::Interleaved,
{
    use crate::simd::Out;
    let (groups, w) = five_groups::<F::Group>(rows, nb);
    let mut next = values(12345);
    for n in 1..=16 {
        let values: Vec<f32> = (0..n * nb * 256).map(|_| next()).collect();
        let mut x = vec![crate::BlockQ8K::ZERO; n * nb];
        crate::quantize_row_q8_k(&values, &mut x);
        let natural = natural_order(&x);
        for (skip, len) in [(0, 8 * groups), (3, 8 * groups - 7)] {
            let mut out = vec![f32::NAN; n * len];
            let window = Window {
                out: Out {
                    ptr: out.as_mut_ptr(),
                    stride: len,
                },
                skip,
                len,
            };
            // SAFETY: the caller checked the 512-bit level's features; `out` holds every (row,
            // column) of the window.
            unsafe { pass::<F, _>(&mut Emulated::default(), &w, nb, &x, &natural, window) };
            for i in 0..n {
                for c in 0..len {
                    let want = dot(&rows[(skip + c) * nb..][..nb], &x[i * nb..][..nb]);
                    assert_eq!(
                        out[i * len + c].to_bits(),
                        want.to_bits(),
                        "rows {n}, row {i}, column {c}, skip {skip}"
                    );
                }
            }
        }
    }
}

/// Whether this CPU has AMX's tiles and 8-bit products (`cpuid` leaf 7: AMX-TILE, AMX-INT8) and the
/// operating system lets this process use them. Linux asks each process to request the tiles'
/// state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, Linux 5.16 and later; the
/// permission holds for all its threads); without it the first tile instruction faults. Asked
/// once, by the first check of [`crate::CpuLevel::Amx`]'s support (also by
/// [`crate::CpuLevel::supported`], which `specdec --version` lists), even where the level is then
/// not used: the request only lets the kernel save the tiles' state for this process.
#[cfg(target_arch = "x86_64")]
pub(crate) fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| has_amx_int8() && permitted())
}

#[cfg(target_arch = "x86_64")]
fn has_amx_int8() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    if __cpuid(0).eax < 7 {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    edx & (1 << 24) != 0 && edx & (1 << 25) != 0
}

/// Asks Linux for the tiles' state for this process.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn permitted() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: u64 = 0x1023;
    const XFEATURE_XTILEDATA: u64 = 18;
    let ret: i64;
    // SAFETY: `arch_prctl` with these arguments only changes which state the kernel saves for this
    // process; it reads and writes no memory of ours. `syscall` clobbers rcx and r11.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack)
        );
    }
    ret == 0
}

/// Other systems: not known how to ask, so not used.
#[cfg(all(target_arch = "x86_64", not(target_os = "linux")))]
fn permitted() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{q8k_position, BlockQ8K};

    #[test]
    fn natural_order_puts_every_value_in_its_place() {
        let mut b = BlockQ8K::ZERO;
        for v in 0..256 {
            b.qs[q8k_position(v)] = (v as i32 - 128) as i8;
        }
        let n = natural_order(&[b, b]);
        for (v, &q) in n.iter().enumerate() {
            assert_eq!(q, ((v % 256) as i32 - 128) as i8, "value {v}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_configuration_sizes_the_tiles() {
        let c = Config::new(5, 32);
        assert_eq!(c.0[0], 1);
        assert_eq!(&c.0[48..54], &[5, 5, 5, 5, 8, 8]);
        assert_eq!(&c.0[16..28], &[64, 0, 64, 0, 32, 0, 32, 0, 64, 0, 64, 0]);
        assert!(c.0[28..48].iter().chain(&c.0[54..]).all(|&b| b == 0));
        let c = Config::new(16, 16);
        assert_eq!(&c.0[48..54], &[16, 16, 16, 16, 4, 4]);
        assert_eq!(&c.0[16..28], &[64, 0, 64, 0, 16, 0, 16, 0, 64, 0, 64, 0]);
    }
}
