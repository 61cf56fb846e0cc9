//! Causal attention over the f16 KV cache for a block of rows, threaded over the model's pool: the
//! query heads that share a KV head read its key tiles and values once for all of them.
//!
//! invariant: row `i` of a block at position `pos` attends to keys `0..=pos + i` exactly, in one fixed
//! order, with no mask; every score and every output element is one chain of fused multiply-adds in a
//! fixed order at every CPU level (the portable level uses `f32::mul_add` in the same order), so a
//! row's result does not depend on the block, the batch, the thread or the level.

use specdec_kernels::f16::f16_to_f32;
use specdec_kernels::{Kernels, ThreadPool};

use crate::config::ModelConfig;
use crate::kv::KEY_TILE;
use crate::model::exp;

/// Causal attention for rows at positions `pos..pos + m`: row `i` attends to keys `0..=pos + i`
/// exactly, in order, with no mask, so its result is independent of the other rows.
///
/// Two jobs on `pool` per [`ATTN_ROWS`] rows. Scores: the query heads that share a KV head, of all
/// the rows, in batches of at most [`BATCH_HEADS`], each batch reading the KV head's key tiles once
/// ([`HalfOps::score_tile`]). Then per (row, KV head): the softmax of each query head's scores, and
/// the weighted sums of the values, [`VALUE_LANES`] elements of every query head of the KV head at a
/// time, each value read once for all of them ([`HalfOps::value_lanes`]). Every score and every output
/// element is one sum in a fixed order, whichever batch, item or thread computes it.
pub(crate) fn attention(
    c: &ModelConfig,
    q: &[f32],
    (keys, values, head_stride): (&[u16], &[u16], usize),
    pos: usize,
    out: &mut [f32],
    scores: &mut Vec<f32>,
    pool: &ThreadPool,
) {
    let q_dim = c.q_dim();
    let m = q.len() / q_dim;
    let level = Kernels::get().level();
    let avx2 = level.has_avx2();
    // The 512-bit loops at the levels whose K-quant passes are 512-bit: on Zen 4, which splits
    // them in two, single tokens at context 200 ran as fast or faster (step_time, 4 alternations:
    // 30.2–34.9 against 30.6–36.9 ms), at context 2000 as fast (34.6–40.9 against 36.2–41.3 ms).
    let zmm = level.has_zmm();
    for first in (0..m).step_by(ATTN_ROWS) {
        let rows = ATTN_ROWS.min(m - first);
        let at = first * q_dim..(first + rows) * q_dim;
        let job = AttentionRows {
            c,
            q: &q[at.clone()],
            keys,
            values,
            head_stride,
            pos: pos + first,
            span: pos + first + rows,
        };
        #[cfg(target_arch = "x86_64")]
        if zmm {
            job.run::<Avx512>(&mut out[at], scores, pool);
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            job.run::<Avx2>(&mut out[at], scores, pool);
            continue;
        }
        let _ = (avx2, zmm);
        job.run::<Portable>(&mut out[at], scores, pool);
    }
}

/// Rows of one [`attention`] call handled together (bounding the score buffer to `ATTN_ROWS ·
/// n_head · context` values).
const ATTN_ROWS: usize = 16;

/// The most query heads whose sums attention keeps in registers at once (two 8-lane vectors each).
const BATCH_HEADS: usize = 6;

/// Output elements of a query head that [`HalfOps::value_lanes`] computes at once.
const VALUE_LANES: usize = 16;

/// `f(H)` dispatched on a batch's number of heads (1 ..= [`BATCH_HEADS`]).
macro_rules! by_heads {
    ($n:expr, $f:ident::<$l:ty>($($arg:expr),*)) => {
        match $n {
            1 => $f::<$l, 1>($($arg),*),
            2 => $f::<$l, 2>($($arg),*),
            3 => $f::<$l, 3>($($arg),*),
            4 => $f::<$l, 4>($($arg),*),
            5 => $f::<$l, 5>($($arg),*),
            _ => $f::<$l, BATCH_HEADS>($($arg),*),
        }
    };
}

/// `0..n` in `n.div_ceil(BATCH_HEADS)` ranges of as even a size as possible.
fn batches(n: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let k = n.div_ceil(BATCH_HEADS);
    (0..k).map(move |b| b * n / k..(b + 1) * n / k)
}

/// At most [`ATTN_ROWS`] rows of [`attention`], the first at position `pos`.
struct AttentionRows<'a> {
    c: &'a ModelConfig,
    /// `[rows, q_dim]`.
    q: &'a [f32],
    keys: &'a [u16],
    values: &'a [u16],
    head_stride: usize,
    pos: usize,
    /// Keys visible to the last row: the length of a row of scores.
    span: usize,
}

impl AttentionRows<'_> {
    fn run<L: HalfOps>(&self, out: &mut [f32], scores: &mut Vec<f32>, pool: &ThreadPool) {
        let c = self.c;
        let (group, q_dim) = (c.n_head / c.n_head_kv, c.q_dim());
        let m = self.q.len() / q_dim;
        // Row `i`, query head `h`: scores at `(i · n_head + h) · span ..`, the first `pos + i + 1`.
        // Every score read is written first: the buffer only grows, without zeroing it each time.
        let need = m * c.n_head * self.span;
        if scores.len() < need {
            scores.resize(need, 0.0);
        }
        let shared = SharedMut(scores.as_mut_ptr());
        let out_ptr = SharedMut(out.as_mut_ptr());
        let heads = group * c.head_dim;
        if m == 1 {
            // One job: per KV head, its query heads' scores and then their values.
            pool.for_chunks(c.n_head_kv, 1, &|items| {
                let (shared, out_ptr) = (&shared, &out_ptr);
                for kvh in items {
                    // SAFETY: as for the two jobs below: each KV head's score rows and output
                    // values are its own.
                    unsafe {
                        for batch in batches(group) {
                            L::score_batch(self, kvh, batch, shared);
                        }
                        let o = std::slice::from_raw_parts_mut(out_ptr.0.add(kvh * heads), heads);
                        L::weigh_values(self, 0, kvh, shared, o);
                    }
                }
            });
            return;
        }
        // The query heads of one KV head, rows first: (row i, head g) is number `i · group + g`.
        let per_kv = m * group;
        let nb = per_kv.div_ceil(BATCH_HEADS);
        pool.for_chunks(c.n_head_kv * nb, 1, &|items| {
            let shared = &shared;
            for item in items {
                let (kvh, b) = (item / nb, item % nb);
                let heads = batches(per_kv).nth(b).unwrap_or_default();
                // SAFETY: a batch writes only the score rows of its own query heads, disjoint from
                // every other item's, within the buffer, which outlives the job; `L` is only
                // instantiated where the CPU supports it (`attention`).
                unsafe { L::score_batch(self, kvh, heads, shared) };
            }
        });
        pool.for_chunks(m * c.n_head_kv, 1, &|items| {
            let (shared, out_ptr) = (&shared, &out_ptr);
            for item in items {
                let (i, kvh) = (item / c.n_head_kv, item % c.n_head_kv);
                // SAFETY: items are disjoint (row, KV head) pairs: each reads and writes the score
                // rows and the output values of its own query heads, within buffers that outlive
                // the job. `L` as above.
                unsafe {
                    let o = std::slice::from_raw_parts_mut(
                        out_ptr.0.add(i * q_dim + kvh * heads),
                        heads,
                    );
                    L::weigh_values(self, i, kvh, shared, o);
                }
            }
        });
    }

    /// The scores of the query heads `heads` (numbered as in [`AttentionRows::run`]) of KV head
    /// `kvh`, at most [`BATCH_HEADS`].
    ///
    /// # Safety
    /// The CPU must support `L`; `scores` points at the score buffer of [`AttentionRows::run`], of
    /// which no other thread touches these heads' rows meanwhile.
    #[inline(always)]
    unsafe fn score_batch<L: HalfOps>(
        &self,
        kvh: usize,
        heads: std::ops::Range<usize>,
        scores: &SharedMut,
    ) {
        let first = heads.start;
        // SAFETY: the caller's contract.
        unsafe { by_heads!(heads.len(), score_heads::<L>(self, kvh, first, scores)) }
    }

    /// Row `i`'s softmax of the scores of KV head `kvh`'s query heads, then into `out` (`[group,
    /// head_dim]`) the weighted sums of the values, in batches of at most [`BATCH_HEADS`] query
    /// heads.
    ///
    /// # Safety
    /// The CPU must support `L`; `scores` points at the score buffer of [`AttentionRows::run`], of
    /// which no other thread touches these heads' rows of row `i` meanwhile.
    #[inline(always)]
    unsafe fn weigh_values<L: HalfOps>(
        &self,
        i: usize,
        kvh: usize,
        scores: &SharedMut,
        out: &mut [f32],
    ) {
        let c = self.c;
        let (hd, group) = (c.head_dim, c.n_head / c.n_head_kv);
        let n = self.pos + i + 1;
        for g in 0..group {
            let row = (i * c.n_head + kvh * group + g) * self.span;
            // SAFETY: the caller's contract; the first `n` scores of the row are in the buffer.
            let w = unsafe { std::slice::from_raw_parts_mut(scores.0.add(row), n) };
            let max = w.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            // The exponentials first (a loop the compiler vectorises), then their sum.
            for x in w.iter_mut() {
                *x = exp(*x - max);
            }
            let total = sum8(w);
            for x in w.iter_mut() {
                *x /= total;
            }
        }
        for heads in batches(group) {
            let o = &mut out[heads.start * hd..heads.end * hd];
            // SAFETY: the caller's contract.
            unsafe {
                by_heads!(
                    heads.len(),
                    weigh_heads::<L>(self, i, kvh, heads.start, scores, o)
                )
            }
        }
    }
}

/// [`AttentionRows::score_batch`] for the `H` heads from `first`: the KV head's key tiles in order,
/// each scored for all `H` query heads at once.
///
/// # Safety
/// As [`AttentionRows::score_batch`].
#[inline(always)]
unsafe fn score_heads<L: HalfOps, const H: usize>(
    rows: &AttentionRows<'_>,
    kvh: usize,
    first: usize,
    scores: &SharedMut,
) {
    let c = rows.c;
    let (hd, group, q_dim) = (c.head_dim, c.n_head / c.n_head_kv, c.q_dim());
    let scale = 1.0 / (hd as f32).sqrt();
    // Head number `first + h`: row `i`, query head `kvh · group + g`.
    let at = |h: usize| ((first + h) / group, kvh * group + (first + h) % group);
    let q: [&[f32]; H] = std::array::from_fn(|h| {
        let (i, head) = at(h);
        &rows.q[i * q_dim + head * hd..][..hd]
    });
    let n_max = rows.pos + at(H - 1).0 + 1;
    let base = kvh * rows.head_stride;
    let tile_len = KEY_TILE * hd;
    let mut sums = [[0.0f32; KEY_TILE]; H];
    for t in 0..n_max.div_ceil(KEY_TILE) {
        let tile = &rows.keys[base + t * tile_len..][..tile_len];
        // Two tiles on, prefetched a line per two elements as the tile is scored.
        let ahead: &[u16] = if (t + 2) * KEY_TILE < n_max {
            &rows.keys[base + (t + 2) * tile_len..][..tile_len]
        } else {
            &[]
        };
        // SAFETY: as above.
        unsafe { L::score_tile(q, tile, ahead, &mut sums) };
        for (h, sums) in sums.iter().enumerate() {
            let (i, head) = at(h);
            let keys = t * KEY_TILE..((t + 1) * KEY_TILE).min(rows.pos + i + 1);
            let row = (i * c.n_head + head) * rows.span;
            // SAFETY: keys `..pos + i + 1` of this head's row, its own (the caller's contract).
            let dst = unsafe {
                std::slice::from_raw_parts_mut(scores.0.add(row + keys.start), keys.len())
            };
            for (s, &v) in dst.iter_mut().zip(sums) {
                *s = v * scale;
            }
        }
    }
}

/// The weighted sums of the values for the `H` query heads `first..` of KV head `kvh` (row `i`,
/// weights in place of its scores), into `out` (`[H, head_dim]`): per block of [`VALUE_ROWS`] value
/// rows (read from memory once, then from L1), [`VALUE_LANES`] elements at a time
/// ([`HalfOps::value_lanes`]); then the last `head_dim % VALUE_LANES` elements one by one. Each element
/// adds its rows in order.
///
/// # Safety
/// As [`AttentionRows::weigh_values`].
#[inline(always)]
unsafe fn weigh_heads<L: HalfOps, const H: usize>(
    rows: &AttentionRows<'_>,
    i: usize,
    kvh: usize,
    first: usize,
    scores: &SharedMut,
    out: &mut [f32],
) {
    let c = rows.c;
    let (hd, group) = (c.head_dim, c.n_head / c.n_head_kv);
    let n = rows.pos + i + 1;
    let w: [&[f32]; H] = std::array::from_fn(|h| {
        let row = (i * c.n_head + kvh * group + first + h) * rows.span;
        // SAFETY: the caller's contract; no thread writes these rows meanwhile.
        unsafe { std::slice::from_raw_parts(scores.0.add(row), n) }
    });
    let values = &rows.values[kvh * rows.head_stride..][..n * hd];
    let wide = hd - hd % VALUE_LANES;
    // A block's value rows in as many parts as there are groups of lanes.
    let part = VALUE_ROWS * hd / (wide / VALUE_LANES).max(1);
    out.fill(0.0);
    for js in (0..n).step_by(VALUE_ROWS) {
        let block = js..(js + VALUE_ROWS).min(n);
        let wb: [&[f32]; H] = std::array::from_fn(|h| &w[h][block.clone()]);
        let vb = &values[block.start * hd..block.end * hd];
        // The next block, prefetched a part per group of lanes, so that its requests wait for
        // memory among the multiply-adds rather than in one burst that outruns the core's
        // outstanding misses (the prefetch of stop 41 and before asked for all 8 KiB at once):
        // measured with steps alternating between the two in one run (Zen 4, 1.5B target, context
        // 2048), this and the keys' spread prefetch in `score_heads` took 5% off a single step and
        // 6% off a 4-token block; no change at context 128.
        let next = (block.end + VALUE_ROWS <= n)
            .then(|| &values[block.end * hd..(block.end + VALUE_ROWS) * hd]);
        for (c, d) in (0..wide).step_by(VALUE_LANES).enumerate() {
            if let Some(next) = next {
                // SAFETY: the caller's contract.
                unsafe { L::prefetch(&next[c * part..(c + 1) * part]) };
            }
            // SAFETY: as above.
            unsafe { L::value_lanes(wb, vb, hd, d, out) };
        }
    }
    for d in wide..hd {
        for (o, w) in out.chunks_exact_mut(hd).zip(&w) {
            o[d] = w.iter().enumerate().fold(0.0, |a, (j, &wj)| {
                wj.mul_add(f16_to_f32(values[j * hd + d]), a)
            });
        }
    }
}

/// Value rows [`weigh_heads`] applies together (8 KiB of f16 at head size 128).
const VALUE_ROWS: usize = 32;

/// A buffer shared by the threads of one attention job, each touching its own elements.
struct SharedMut(*mut f32);
// SAFETY: the threads touch disjoint elements and the buffer outlives the job (see `attention`).
unsafe impl Sync for SharedMut {}

/// The sum of `w`: eight partial sums of every eighth element, in order, then added in order from the
/// first, then the last `w.len() % 8` elements in order.
#[inline(always)]
fn sum8(w: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = w.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] += c[l];
        }
    }
    rest.iter().fold(acc.iter().sum::<f32>(), |a, &b| a + b)
}

/// The scores of `H` query heads against one tile of [`KEY_TILE`] keys (`tile[d · KEY_TILE + l]` is
/// element `d` of key `l`): `sums[h][l] = Σ_d q[h][d] · key_l[d]`, a fused multiply-add per element
/// in order from `d = 0`. The reference for [`HalfOps::score_tile`].
#[inline(always)]
fn score_tile_portable<const H: usize>(
    q: [&[f32]; H],
    tile: &[u16],
    sums: &mut [[f32; KEY_TILE]; H],
) {
    *sums = [[0.0; KEY_TILE]; H];
    for (d, keys) in tile.chunks_exact(KEY_TILE).take(q[0].len()).enumerate() {
        let keys: [f32; KEY_TILE] = std::array::from_fn(|l| f16_to_f32(keys[l]));
        for (q, sums) in q.iter().zip(sums.iter_mut()) {
            for (s, &k) in sums.iter_mut().zip(&keys) {
                *s = q[d].mul_add(k, *s);
            }
        }
    }
}

/// Adds to elements `d..d + VALUE_LANES` of the weighted sums of `H` query heads (`out` is `[H,
/// hd]`) the value rows `values[j · hd ..][..hd]` weighted by `w[h][j]`: `out[h][d + l] ← fma(w[h][j],
/// value_j[d + l], out[h][d + l])` for j = 0, 1, ... in order. The reference for
/// [`HalfOps::value_lanes`].
#[inline(always)]
fn value_lanes_portable<const H: usize>(
    w: [&[f32]; H],
    values: &[u16],
    hd: usize,
    d: usize,
    out: &mut [f32],
) {
    for j in 0..w[0].len() {
        let v: [f32; VALUE_LANES] = std::array::from_fn(|l| f16_to_f32(values[j * hd + d + l]));
        for (w, o) in w.iter().zip(out.chunks_exact_mut(hd)) {
            for (o, &v) in o[d..d + VALUE_LANES].iter_mut().zip(&v) {
                *o = w[j].mul_add(v, *o);
            }
        }
    }
}

/// The attention loops per CPU level: every implementation gives the same values (widening f16 is
/// exact; each sum is fused multiply-adds in one order).
trait HalfOps {
    /// [`AttentionRows::score_batch`], compiled for the implementation's instructions.
    ///
    /// # Safety
    /// The CPU must support the implementation's instructions; as [`AttentionRows::score_batch`].
    unsafe fn score_batch(
        rows: &AttentionRows<'_>,
        kvh: usize,
        heads: std::ops::Range<usize>,
        scores: &SharedMut,
    );

    /// [`AttentionRows::weigh_values`], compiled for the implementation's instructions.
    ///
    /// # Safety
    /// The CPU must support the implementation's instructions; as [`AttentionRows::weigh_values`].
    unsafe fn weigh_values(
        rows: &AttentionRows<'_>,
        i: usize,
        kvh: usize,
        scores: &SharedMut,
        out: &mut [f32],
    );

    /// [`score_tile_portable`]'s values; meanwhile the cache lines of `ahead` (another tile, or
    /// empty) are asked for, one every two elements (a hint: no effect on any value).
    ///
    /// # Safety
    /// The CPU must support the implementation's instructions.
    unsafe fn score_tile<const H: usize>(
        q: [&[f32]; H],
        tile: &[u16],
        ahead: &[u16],
        sums: &mut [[f32; KEY_TILE]; H],
    );

    /// [`value_lanes_portable`]'s values.
    ///
    /// # Safety
    /// The CPU must support the implementation's instructions.
    unsafe fn value_lanes<const H: usize>(
        w: [&[f32]; H],
        values: &[u16],
        hd: usize,
        d: usize,
        out: &mut [f32],
    );

    /// Asks for the cache lines of `src` ahead of their use (a hint: no effect on any value).
    ///
    /// # Safety
    /// The CPU must support the implementation's instructions.
    unsafe fn prefetch(src: &[u16]);
}

/// [`HalfOps::score_batch`] and [`HalfOps::weigh_values`] for an implementation whose instructions
/// need the target features `$features`: the shared glue of both jobs, compiled with them, so that
/// the implementation's loops inline and the softmax loops vectorise at its width.
#[cfg(target_arch = "x86_64")]
macro_rules! glue {
    ($features:literal) => {
        #[target_feature(enable = $features)]
        unsafe fn score_batch(
            rows: &AttentionRows<'_>,
            kvh: usize,
            heads: std::ops::Range<usize>,
            scores: &SharedMut,
        ) {
            // SAFETY: the caller's contract.
            unsafe { rows.score_batch::<Self>(kvh, heads, scores) }
        }

        #[target_feature(enable = $features)]
        unsafe fn weigh_values(
            rows: &AttentionRows<'_>,
            i: usize,
            kvh: usize,
            scores: &SharedMut,
            out: &mut [f32],
        ) {
            // SAFETY: the caller's contract.
            unsafe { rows.weigh_values::<Self>(i, kvh, scores, out) }
        }
    };
}

struct Portable;

impl HalfOps for Portable {
    unsafe fn score_batch(
        rows: &AttentionRows<'_>,
        kvh: usize,
        heads: std::ops::Range<usize>,
        scores: &SharedMut,
    ) {
        // SAFETY: the caller's contract.
        unsafe { rows.score_batch::<Self>(kvh, heads, scores) }
    }

    unsafe fn weigh_values(
        rows: &AttentionRows<'_>,
        i: usize,
        kvh: usize,
        scores: &SharedMut,
        out: &mut [f32],
    ) {
        // SAFETY: the caller's contract.
        unsafe { rows.weigh_values::<Self>(i, kvh, scores, out) }
    }

    #[inline(always)]
    unsafe fn score_tile<const H: usize>(
        q: [&[f32]; H],
        tile: &[u16],
        _ahead: &[u16],
        sums: &mut [[f32; KEY_TILE]; H],
    ) {
        score_tile_portable(q, tile, sums)
    }

    #[inline(always)]
    unsafe fn value_lanes<const H: usize>(
        w: [&[f32]; H],
        values: &[u16],
        hd: usize,
        d: usize,
        out: &mut [f32],
    ) {
        value_lanes_portable(w, values, hd, d, out)
    }

    #[inline(always)]
    unsafe fn prefetch(_: &[u16]) {}
}

#[cfg(target_arch = "x86_64")]
struct Avx2;

#[cfg(target_arch = "x86_64")]
impl HalfOps for Avx2 {
    glue!("avx2,f16c,fma");

    /// Two 8-lane vectors of sums per query head, a lane per key: per element `d`, the tile's row
    /// widened once and multiplied into every head's sums with the head's `q[d]` broadcast.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn score_tile<const H: usize>(
        q: [&[f32]; H],
        tile: &[u16],
        ahead: &[u16],
        sums: &mut [[f32; KEY_TILE]; H],
    ) {
        use std::arch::x86_64::*;
        let hd = q[0].len();
        assert!(tile.len() >= hd * KEY_TILE && q.iter().all(|q| q.len() >= hd));
        let tp = tile.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); 2]; H];
        // SAFETY: `d < hd`, so every load is within `tile` and each `q[h]` (asserted above); a
        // prefetch reads nothing the program sees and cannot fault.
        unsafe {
            for d in 0..hd {
                if d % 2 == 0 && d * KEY_TILE < ahead.len() {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.as_ptr().add(d * KEY_TILE).cast());
                }
                let row = tp.add(d * KEY_TILE);
                let k0 = _mm256_cvtph_ps(_mm_loadu_si128(row.cast()));
                let k1 = _mm256_cvtph_ps(_mm_loadu_si128(row.add(8).cast()));
                for (a, q) in acc.iter_mut().zip(&q) {
                    let qd = _mm256_set1_ps(*q.get_unchecked(d));
                    a[0] = _mm256_fmadd_ps(qd, k0, a[0]);
                    a[1] = _mm256_fmadd_ps(qd, k1, a[1]);
                }
            }
            for (a, s) in acc.iter().zip(sums.iter_mut()) {
                _mm256_storeu_ps(s.as_mut_ptr(), a[0]);
                _mm256_storeu_ps(s.as_mut_ptr().add(8), a[1]);
            }
        }
    }

    /// Two 8-lane vectors of sums per query head, a lane per output element, loaded from `out` and
    /// stored back: per value row, its 16 elements widened once and multiplied into every head's
    /// sums with the head's weight broadcast.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn value_lanes<const H: usize>(
        w: [&[f32]; H],
        values: &[u16],
        hd: usize,
        d: usize,
        out: &mut [f32],
    ) {
        use std::arch::x86_64::*;
        let n = w[0].len();
        assert!(
            d + VALUE_LANES <= hd
                && values.len() >= n * hd
                && out.len() >= H * hd
                && w.iter().all(|w| w.len() >= n)
        );
        let (vp, op) = (values.as_ptr(), out.as_mut_ptr());
        // SAFETY: `j < n`, `h < H` and `d + 16 <= hd`, so every access is within `values`, `out`
        // and each `w[h]` (asserted above).
        unsafe {
            let mut acc: [[__m256; 2]; H] = std::array::from_fn(|h| {
                let o = op.add(h * hd + d);
                [_mm256_loadu_ps(o), _mm256_loadu_ps(o.add(8))]
            });
            for j in 0..n {
                let row = vp.add(j * hd + d);
                let v0 = _mm256_cvtph_ps(_mm_loadu_si128(row.cast()));
                let v1 = _mm256_cvtph_ps(_mm_loadu_si128(row.add(8).cast()));
                for (a, w) in acc.iter_mut().zip(&w) {
                    let wj = _mm256_set1_ps(*w.get_unchecked(j));
                    a[0] = _mm256_fmadd_ps(wj, v0, a[0]);
                    a[1] = _mm256_fmadd_ps(wj, v1, a[1]);
                }
            }
            for (h, a) in acc.iter().enumerate() {
                let o = op.add(h * hd + d);
                _mm256_storeu_ps(o, a[0]);
                _mm256_storeu_ps(o.add(8), a[1]);
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn prefetch(src: &[u16]) {
        use std::arch::x86_64::*;
        // 32 halves per 64-byte line.
        for i in (0..src.len()).step_by(32) {
            // SAFETY: `i` is within `src`; a prefetch does not fault in any case.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(src.as_ptr().add(i).cast()) };
        }
    }
}

/// [`Avx2`] on 512-bit vectors (AVX512F): one 16-lane vector per query head where [`Avx2`] needs
/// two, so half the widenings and fused multiply-adds per key or value row. The same lanes in the
/// same order, so the same bits.
#[cfg(target_arch = "x86_64")]
struct Avx512;

#[cfg(target_arch = "x86_64")]
impl HalfOps for Avx512 {
    glue!("avx2,f16c,fma,avx512f");

    /// One 16-lane vector of sums per query head, a lane per key: per element `d`, the tile's row
    /// widened once and multiplied into every head's sums with the head's `q[d]` broadcast.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f")]
    unsafe fn score_tile<const H: usize>(
        q: [&[f32]; H],
        tile: &[u16],
        ahead: &[u16],
        sums: &mut [[f32; KEY_TILE]; H],
    ) {
        use std::arch::x86_64::*;
        const { assert!(KEY_TILE == 16) };
        let hd = q[0].len();
        assert!(tile.len() >= hd * KEY_TILE && q.iter().all(|q| q.len() >= hd));
        let tp = tile.as_ptr();
        let mut acc = [_mm512_setzero_ps(); H];
        // SAFETY: `d < hd`, so every load is within `tile` and each `q[h]` (asserted above); a
        // prefetch reads nothing the program sees and cannot fault.
        unsafe {
            for d in 0..hd {
                if d % 2 == 0 && d * KEY_TILE < ahead.len() {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.as_ptr().add(d * KEY_TILE).cast());
                }
                let k = _mm512_cvtph_ps(_mm256_loadu_si256(tp.add(d * KEY_TILE).cast()));
                for (a, q) in acc.iter_mut().zip(&q) {
                    *a = _mm512_fmadd_ps(_mm512_set1_ps(*q.get_unchecked(d)), k, *a);
                }
            }
            for (a, s) in acc.iter().zip(sums.iter_mut()) {
                _mm512_storeu_ps(s.as_mut_ptr(), *a);
            }
        }
    }

    /// One 16-lane vector of sums per query head, a lane per output element, loaded from `out` and
    /// stored back: per value row, its 16 elements widened once and multiplied into every head's
    /// sums with the head's weight broadcast.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f")]
    unsafe fn value_lanes<const H: usize>(
        w: [&[f32]; H],
        values: &[u16],
        hd: usize,
        d: usize,
        out: &mut [f32],
    ) {
        use std::arch::x86_64::*;
        const { assert!(VALUE_LANES == 16) };
        let n = w[0].len();
        assert!(
            d + VALUE_LANES <= hd
                && values.len() >= n * hd
                && out.len() >= H * hd
                && w.iter().all(|w| w.len() >= n)
        );
        let (vp, op) = (values.as_ptr(), out.as_mut_ptr());
        // SAFETY: `j < n`, `h < H` and `d + 16 <= hd`, so every access is within `values`, `out`
        // and each `w[h]` (asserted above).
        unsafe {
            let mut acc: [__m512; H] = std::array::from_fn(|h| _mm512_loadu_ps(op.add(h * hd + d)));
            for j in 0..n {
                let v = _mm512_cvtph_ps(_mm256_loadu_si256(vp.add(j * hd + d).cast()));
                for (a, w) in acc.iter_mut().zip(&w) {
                    *a = _mm512_fmadd_ps(_mm512_set1_ps(*w.get_unchecked(j)), v, *a);
                }
            }
            for (h, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(op.add(h * hd + d), *a);
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c,fma,avx512f")]
    unsafe fn prefetch(src: &[u16]) {
        // SAFETY: the caller's contract (AVX2 is part of this implementation's features).
        unsafe { Avx2::prefetch(src) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use specdec_kernels::f16::f32_to_f16;

    /// Values with very different magnitudes, so that any change of the order of additions shows.
    fn spread(i: usize) -> f32 {
        let x = ((i * 2_654_435_761) % 1_000_003) as f32 / 1_000_003.0 - 0.5;
        x * 10f32.powi((i % 7) as i32 - 3)
    }

    /// The attention levels this CPU can run.
    fn levels() -> Vec<(&'static str, AttnFns)> {
        let mut levels: Vec<(&'static str, AttnFns)> = vec![(
            "portable",
            (
                |q, t, s| unsafe { Portable::score_tile(q, t, &[], s) },
                |w, v, hd, d, s| unsafe { Portable::value_lanes(w, v, hd, d, s) },
            ),
        )];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("f16c")
            && std::arch::is_x86_feature_detected!("fma")
        {
            levels.push((
                "avx2",
                (
                    |q, t, s| unsafe { Avx2::score_tile(q, t, t, s) },
                    |w, v, hd, d, s| unsafe { Avx2::value_lanes(w, v, hd, d, s) },
                ),
            ));
        }
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("f16c")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("avx512f")
        {
            levels.push((
                "avx512",
                (
                    |q, t, s| unsafe { Avx512::score_tile(q, t, t, s) },
                    |w, v, hd, d, s| unsafe { Avx512::value_lanes(w, v, hd, d, s) },
                ),
            ));
        }
        levels
    }

    type AttnFns = (
        fn([&[f32]; 3], &[u16], &mut [[f32; KEY_TILE]; 3]),
        fn([&[f32]; 3], &[u16], usize, usize, &mut [f32]),
    );

    #[test]
    fn score_tile_gives_the_reference_bits_at_every_level() {
        for hd in [8, 13, 64, 80, 128] {
            let qs: Vec<Vec<f32>> = (0..3)
                .map(|h| (0..hd).map(|d| spread(d + 1000 * h)).collect())
                .collect();
            let tile: Vec<u16> = (0..hd * KEY_TILE)
                .map(|i| f32_to_f16(spread(i + 7919)))
                .collect();
            // Key `l`'s element `d` is `tile[d * KEY_TILE + l]`; a fused multiply-add per element,
            // in order from the first.
            let want: Vec<Vec<u32>> = qs
                .iter()
                .map(|q| {
                    (0..KEY_TILE)
                        .map(|l| {
                            let mut s = 0.0f32;
                            for (d, &x) in q.iter().enumerate() {
                                s = x.mul_add(f16_to_f32(tile[d * KEY_TILE + l]), s);
                            }
                            s.to_bits()
                        })
                        .collect()
                })
                .collect();
            for (name, (score_tile, _)) in levels() {
                let mut sums = [[0.0f32; KEY_TILE]; 3];
                score_tile([&qs[0], &qs[1], &qs[2]], &tile, &mut sums);
                let got: Vec<Vec<u32>> = sums
                    .iter()
                    .map(|s| s.iter().map(|x| x.to_bits()).collect())
                    .collect();
                assert_eq!(got, want, "{name}, head size {hd}");
            }
        }
    }

    #[test]
    fn sum8_is_eight_partial_sums_in_order() {
        for n in [0, 1, 7, 8, 9, 64, 1000, 1003] {
            let w: Vec<f32> = (0..n).map(|i| spread(i + 11).abs()).collect();
            let mut lanes = [0.0f32; 8];
            for (i, &x) in w.iter().enumerate().take(n - n % 8) {
                lanes[i % 8] += x;
            }
            let mut want = 0.0f32;
            for l in lanes {
                want += l;
            }
            for &x in &w[n - n % 8..] {
                want += x;
            }
            assert_eq!(sum8(&w).to_bits(), want.to_bits(), "{n} values");
        }
    }

    #[test]
    fn value_lanes_add_rows_in_order_at_every_level() {
        for (hd, rows) in [(16, 3), (29, 5), (64, 32), (80, 7), (128, 33), (208, 1)] {
            let ws: Vec<Vec<f32>> = (0..3)
                .map(|h| (0..rows).map(|j| spread(j + 31 + 100 * h).abs()).collect())
                .collect();
            let values: Vec<u16> = (0..rows * hd)
                .map(|i| f32_to_f16(spread(i + 101)))
                .collect();
            let start: Vec<f32> = (0..3 * hd).map(|i| spread(i + 5)).collect();
            for d in (0..hd - hd % VALUE_LANES).step_by(VALUE_LANES) {
                let mut want = start.clone();
                for (h, w) in ws.iter().enumerate() {
                    for l in d..d + VALUE_LANES {
                        for (j, &wj) in w.iter().enumerate() {
                            let o = &mut want[h * hd + l];
                            *o = wj.mul_add(f16_to_f32(values[j * hd + l]), *o);
                        }
                    }
                }
                let want: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
                for (name, (_, value_lanes)) in levels() {
                    let mut out = start.clone();
                    value_lanes([&ws[0], &ws[1], &ws[2]], &values, hd, d, &mut out);
                    let got: Vec<u32> = out.iter().map(|x| x.to_bits()).collect();
                    assert_eq!(
                        got, want,
                        "{name}, head size {hd}, {rows} rows, lanes {d}.."
                    );
                }
            }
        }
    }

    #[test]
    fn head_batches_cover_the_heads_evenly() {
        for n in 1..40 {
            let b: Vec<_> = batches(n).collect();
            assert_eq!(b.len(), n.div_ceil(BATCH_HEADS));
            assert_eq!(b.first().map(|r| r.start), Some(0));
            assert_eq!(b.last().map(|r| r.end), Some(n));
            assert!(b.windows(2).all(|p| p[0].end == p[1].start));
            assert!(b.iter().all(|r| !r.is_empty() && r.len() <= BATCH_HEADS));
        }
    }
}
