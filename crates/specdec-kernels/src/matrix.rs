//! Quantised weight matrices, quantised activations, and the multi-row matmul over them.

#[cfg(target_arch = "x86_64")]
use crate::amx::{AMX_FROM_ROWS, AMX_GEMM_FROM_ROWS};
#[cfg(target_arch = "x86_64")]
use crate::dispatch::CpuLevel;
use crate::dispatch::Kernels;
use crate::formats::{
    dequantize_row, interleave_rows, quantize_row_q8_0, quantize_row_q8_k, ActQ8_0,
    ActivationFormat, BlockFormat, BlockQ4K, BlockQ4Kx8, BlockQ4_0, BlockQ4_0x8, BlockQ5_0,
    BlockQ5_0x8, BlockQ6K, BlockQ6Kx8, BlockQ8K, BlockQ8_0, Interleaved, WeightBlock, GROUP_ROWS,
    QK8_0, QK_K,
};
use crate::pool::ThreadPool;
use crate::simd::{self, pass, pass_groups, Out, Window, MAX_PASS_ROWS};
use crate::KernelError;
use std::ops::Range;
use std::sync::OnceLock;

/// The blocks of a weight matrix, row-major (row `n` is blocks `n · cols / block_len ..`), or for the
/// interleaved variants group-major (group `g · nb + b` is block `b` of rows `8g .. 8g + 8`, with `nb`
/// blocks per row).
#[derive(Clone, Debug, PartialEq)]
pub enum Weights {
    /// Q8_0 blocks.
    Q8_0(Vec<BlockQ8_0>),
    /// Q4_0 blocks ([`QMatrix::from_blocks`] interleaves them when the rows are a multiple of 8).
    Q4_0(Vec<BlockQ4_0>),
    /// Q4_0 blocks of 8 rows interleaved.
    Q4_0x8(Vec<BlockQ4_0x8>),
    /// Q5_0 blocks ([`QMatrix::from_blocks`] interleaves them when the rows are a multiple of 8).
    Q5_0(Vec<BlockQ5_0>),
    /// Q5_0 blocks of 8 rows interleaved.
    Q5_0x8(Vec<BlockQ5_0x8>),
    /// Q4_K blocks ([`QMatrix::from_blocks`] interleaves them when the rows are a multiple of 8).
    Q4K(Vec<BlockQ4K>),
    /// Q4_K blocks of 8 rows interleaved, with their own arithmetic
    /// ([`crate::formats::dot_q4_kx8_q8_k`]).
    Q4Kx8(Vec<BlockQ4Kx8>),
    /// Q6_K blocks ([`QMatrix::from_blocks`] interleaves them when the rows are a multiple of 8).
    Q6K(Vec<BlockQ6K>),
    /// Q6_K blocks of 8 rows interleaved, with their own arithmetic
    /// ([`crate::formats::dot_q6_kx8_q8_k`]).
    Q6Kx8(Vec<BlockQ6Kx8>),
}

impl Weights {
    /// The blocks' format.
    pub fn format(&self) -> BlockFormat {
        match self {
            Weights::Q8_0(_) => BlockFormat::Q8_0,
            Weights::Q4_0(_) | Weights::Q4_0x8(_) => BlockFormat::Q4_0,
            Weights::Q5_0(_) | Weights::Q5_0x8(_) => BlockFormat::Q5_0,
            Weights::Q4K(_) | Weights::Q4Kx8(_) => BlockFormat::Q4K,
            Weights::Q6K(_) | Weights::Q6Kx8(_) => BlockFormat::Q6K,
        }
    }

    /// The number of blocks (8 per group of the interleaved variants).
    fn len(&self) -> usize {
        match self {
            Weights::Q8_0(b) => b.len(),
            Weights::Q4_0(b) => b.len(),
            Weights::Q4_0x8(g) => GROUP_ROWS * g.len(),
            Weights::Q5_0(b) => b.len(),
            Weights::Q5_0x8(g) => GROUP_ROWS * g.len(),
            Weights::Q4K(b) => b.len(),
            Weights::Q4Kx8(g) => GROUP_ROWS * g.len(),
            Weights::Q6K(b) => b.len(),
            Weights::Q6Kx8(g) => GROUP_ROWS * g.len(),
        }
    }
}

/// A quantised weight matrix of `rows` output features by `cols` input features (a GGUF tensor of
/// shape `[cols, rows]` in ggml's order).
#[derive(Clone, Debug, PartialEq)]
pub struct QMatrix {
    rows: usize,
    cols: usize,
    weights: Weights,
}

fn blocks_per_row(format: BlockFormat, cols: usize) -> Result<usize, KernelError> {
    let block_len = format.block_len();
    if !cols.is_multiple_of(block_len) {
        return Err(KernelError::RaggedRow {
            format,
            cols,
            block_len,
        });
    }
    Ok(cols / block_len)
}

/// Dequantises row `k` of a run of groups into `out`, block by block.
fn dequantize_grouped<G: Interleaved>(groups: &[G], k: usize, out: &mut [f32])
where
    G::Block: WeightBlock,
{
    assert_eq!(
        out.len(),
        groups.len() * G::Block::VALUES,
        "output length must match the blocks"
    );
    for (group, out) in groups.iter().zip(out.chunks_exact_mut(G::Block::VALUES)) {
        group.row(k).dequantize(out);
    }
}

fn read_blocks<B: WeightBlock>(bytes: &[u8]) -> Vec<B> {
    bytes.chunks_exact(B::BYTES).filter_map(B::read).collect()
}

/// [`interleave_rows`] of the blocks in `bytes` (whole groups of 8 rows of `nb` blocks), read where
/// they lie.
fn interleave_bytes<G: Interleaved>(bytes: &[u8], nb: usize) -> Vec<G>
where
    G::Block: WeightBlock,
{
    let size = G::Block::BYTES;
    let block = |i: usize| bytes.get(i * size..(i + 1) * size).and_then(G::Block::read);
    let mut out = Vec::with_capacity(bytes.len() / size / GROUP_ROWS);
    for first in (0..bytes.len() / size).step_by(GROUP_ROWS * nb) {
        for b in 0..nb {
            let rows: [Option<G::Block>; GROUP_ROWS] =
                std::array::from_fn(|k| block(first + k * nb + b));
            if let [Some(r0), Some(r1), Some(r2), Some(r3), Some(r4), Some(r5), Some(r6), Some(r7)] =
                rows
            {
                out.push(G::pack([&r0, &r1, &r2, &r3, &r4, &r5, &r6, &r7]));
            }
        }
    }
    out
}

impl QMatrix {
    /// A matrix from its blocks. Q4_0, Q5_0, Q4_K and Q6_K blocks are interleaved in groups of 8
    /// rows ([`BlockQ4_0x8`], [`BlockQ5_0x8`], [`BlockQ4Kx8`], [`BlockQ6Kx8`]) when `rows` is a
    /// multiple of 8, at every kernel level, so that every level computes the same arithmetic.
    ///
    /// # Errors
    /// [`KernelError::RaggedRow`] if `cols` is not a multiple of the block length,
    /// [`KernelError::BlockCount`] if there are not `rows · cols / block_len` blocks,
    /// [`KernelError::RaggedGroups`] for interleaved blocks if `rows` is not a multiple of 8.
    pub fn from_blocks(rows: usize, cols: usize, weights: Weights) -> Result<QMatrix, KernelError> {
        let nb = blocks_per_row(weights.format(), cols)?;
        let expected = rows * nb;
        if weights.len() != expected {
            return Err(KernelError::BlockCount {
                expected,
                actual: weights.len(),
            });
        }
        let grouped = rows.is_multiple_of(GROUP_ROWS);
        let weights = match weights {
            Weights::Q4_0x8(_) | Weights::Q5_0x8(_) | Weights::Q4Kx8(_) | Weights::Q6Kx8(_)
                if !grouped =>
            {
                return Err(KernelError::RaggedGroups { rows });
            }
            Weights::Q4_0(b) if grouped && nb > 0 => Weights::Q4_0x8(interleave_rows(&b, nb)),
            Weights::Q5_0(b) if grouped && nb > 0 => Weights::Q5_0x8(interleave_rows(&b, nb)),
            Weights::Q4K(b) if grouped && nb > 0 => Weights::Q4Kx8(interleave_rows(&b, nb)),
            Weights::Q6K(b) if grouped && nb > 0 => Weights::Q6Kx8(interleave_rows(&b, nb)),
            weights => weights,
        };
        Ok(QMatrix {
            rows,
            cols,
            weights,
        })
    }

    /// A matrix from a tensor's bytes as stored in a GGUF file (copied into typed blocks).
    ///
    /// # Errors
    /// [`KernelError::RaggedRow`], or [`KernelError::ByteLength`] if `bytes` is not exactly the
    /// matrix's size.
    pub fn from_bytes(
        format: BlockFormat,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Result<QMatrix, KernelError> {
        let expected = rows
            .checked_mul(blocks_per_row(format, cols)?)
            .and_then(|n| n.checked_mul(format.block_bytes()))
            .unwrap_or(usize::MAX);
        if bytes.len() != expected || expected == usize::MAX {
            return Err(KernelError::ByteLength {
                expected,
                actual: bytes.len(),
            });
        }
        // Interleaved straight from the bytes where the rows make whole groups (what `from_blocks`
        // would make of the blocks), so that loading holds the file's bytes and one copy, not two.
        let nb = blocks_per_row(format, cols)?;
        let grouped = rows.is_multiple_of(GROUP_ROWS) && nb > 0;
        let weights = match format {
            BlockFormat::Q8_0 => Weights::Q8_0(read_blocks(bytes)),
            BlockFormat::Q4_0 if grouped => Weights::Q4_0x8(interleave_bytes(bytes, nb)),
            BlockFormat::Q4_0 => Weights::Q4_0(read_blocks(bytes)),
            BlockFormat::Q5_0 if grouped => Weights::Q5_0x8(interleave_bytes(bytes, nb)),
            BlockFormat::Q5_0 => Weights::Q5_0(read_blocks(bytes)),
            BlockFormat::Q4K if grouped => Weights::Q4Kx8(interleave_bytes(bytes, nb)),
            BlockFormat::Q4K => Weights::Q4K(read_blocks(bytes)),
            BlockFormat::Q6K if grouped => Weights::Q6Kx8(interleave_bytes(bytes, nb)),
            BlockFormat::Q6K => Weights::Q6K(read_blocks(bytes)),
        };
        QMatrix::from_blocks(rows, cols, weights)
    }

    /// Output features (weight rows).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features (values per weight row).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The weight format.
    pub fn format(&self) -> BlockFormat {
        self.weights.format()
    }

    /// The blocks, as stored: Q4_0, Q5_0, Q4_K and Q6_K matrices whose row count is a multiple of
    /// 8 as [`Weights::Q4_0x8`], [`Weights::Q5_0x8`], [`Weights::Q4Kx8`] and [`Weights::Q6Kx8`]
    /// ([`QMatrix::row_weights`] gives a row's blocks as the file has them).
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// Bytes of quantised weights (what one pass of a matmul streams).
    pub fn size_bytes(&self) -> usize {
        self.weights.len() * self.format().block_bytes()
    }

    /// Where row `n` is stored: its blocks in a row-major matrix, or the groups that hold it and its
    /// place in them in an interleaved one.
    ///
    /// # Panics
    /// If `n >= rows`.
    fn row_place(&self, n: usize) -> (Range<usize>, Range<usize>, usize) {
        assert!(n < self.rows, "row {n} out of {}", self.rows);
        let nb = self.cols / self.format().block_len();
        let g = n / GROUP_ROWS;
        (n * nb..(n + 1) * nb, g * nb..(g + 1) * nb, n % GROUP_ROWS)
    }

    /// Dequantises weight row `n` into `out` (`cols` long).
    ///
    /// # Panics
    /// If `n >= rows` or `out.len() != cols`.
    pub fn dequantize_row(&self, n: usize, out: &mut [f32]) {
        let (blocks, groups, k) = self.row_place(n);
        match &self.weights {
            Weights::Q8_0(b) => dequantize_row(&b[blocks], out),
            Weights::Q4_0(b) => dequantize_row(&b[blocks], out),
            Weights::Q4_0x8(b) => dequantize_grouped(&b[groups], k, out),
            Weights::Q5_0(b) => dequantize_row(&b[blocks], out),
            Weights::Q5_0x8(b) => dequantize_grouped(&b[groups], k, out),
            Weights::Q4K(b) => dequantize_row(&b[blocks], out),
            Weights::Q4Kx8(b) => dequantize_grouped(&b[groups], k, out),
            Weights::Q6K(b) => dequantize_row(&b[blocks], out),
            Weights::Q6Kx8(b) => dequantize_grouped(&b[groups], k, out),
        }
    }

    /// Row `n`'s blocks as the file stores them (taken back out of their groups for the interleaved
    /// variants).
    ///
    /// # Panics
    /// If `n >= self.rows()`.
    pub fn row_weights(&self, n: usize) -> Weights {
        let (blocks, groups, k) = self.row_place(n);
        match &self.weights {
            Weights::Q8_0(b) => Weights::Q8_0(b[blocks].to_vec()),
            Weights::Q4_0(b) => Weights::Q4_0(b[blocks].to_vec()),
            Weights::Q4_0x8(b) => Weights::Q4_0(b[groups].iter().map(|g| g.row(k)).collect()),
            Weights::Q5_0(b) => Weights::Q5_0(b[blocks].to_vec()),
            Weights::Q5_0x8(b) => Weights::Q5_0(b[groups].iter().map(|g| g.row(k)).collect()),
            Weights::Q4K(b) => Weights::Q4K(b[blocks].to_vec()),
            Weights::Q4Kx8(b) => Weights::Q4K(b[groups].iter().map(|g| g.row(k)).collect()),
            Weights::Q6K(b) => Weights::Q6K(b[blocks].to_vec()),
            Weights::Q6Kx8(b) => Weights::Q6K(b[groups].iter().map(|g| g.row(k)).collect()),
        }
    }

    /// Quantises `rows` activation rows of `x` (row-major, `rows × cols`) in the format this matrix's
    /// dot product takes.
    ///
    /// # Errors
    /// As [`QuantizedActivations::quantize`].
    pub fn quantize_activations(
        &self,
        rows: usize,
        x: &[f32],
    ) -> Result<QuantizedActivations, KernelError> {
        QuantizedActivations::quantize(self.format().activation_format(), rows, self.cols, x)
    }
}

#[derive(Clone, Debug, PartialEq)]
enum ActBlocks {
    Q8_0(Vec<ActQ8_0>),
    Q8K(Vec<BlockQ8K>),
}

/// `rows` activation vectors of `cols` values, quantised for a weight format's dot product.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedActivations {
    rows: usize,
    cols: usize,
    blocks: ActBlocks,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    natural: Natural,
}

/// Q8_K quants in natural order ([`crate::amx::natural_order`]), made at most once per
/// quantisation by the first pass on AMX tiles that needs them (the threads of a matmul share
/// them; a new buffer each time, at the opt-in `amx` level only). A cache: it never makes two
/// activations unequal, and a clone starts without it.
#[derive(Default)]
struct Natural(OnceLock<Vec<i8>>);

impl Clone for Natural {
    fn clone(&self) -> Self {
        Natural::default()
    }
}

impl PartialEq for Natural {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl std::fmt::Debug for Natural {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Natural")
    }
}

impl QuantizedActivations {
    /// Quantises `x` (row-major, `rows × cols`) with [`quantize_row_q8_0`] or [`quantize_row_q8_k`].
    ///
    /// # Errors
    /// [`KernelError::RaggedActivations`] if `cols` is not a multiple of the block length,
    /// [`KernelError::InputLength`] if `x.len() != rows · cols`.
    pub fn quantize(
        format: ActivationFormat,
        rows: usize,
        cols: usize,
        x: &[f32],
    ) -> Result<Self, KernelError> {
        let blocks = match format {
            ActivationFormat::Q8_0 => ActBlocks::Q8_0(Vec::new()),
            ActivationFormat::Q8K => ActBlocks::Q8K(Vec::new()),
        };
        let mut q = QuantizedActivations {
            rows: 0,
            cols: 0,
            blocks,
            natural: Natural::default(),
        };
        q.requantize(rows, cols, x)?;
        Ok(q)
    }

    /// Quantises `x` into `self`, keeping `self`'s format and reusing its buffer (no allocation once
    /// the buffer has grown to the largest `rows · cols` seen).
    ///
    /// # Errors
    /// As [`QuantizedActivations::quantize`].
    pub fn requantize(&mut self, rows: usize, cols: usize, x: &[f32]) -> Result<(), KernelError> {
        self.requantize_with(rows, cols, x, None)
    }

    /// [`QuantizedActivations::requantize`], its blocks spread over `pool`'s threads where there are
    /// enough of them to pay for the job. Each block is quantised alone, so the result is the same
    /// on any number of threads.
    ///
    /// # Errors
    /// As [`QuantizedActivations::quantize`].
    pub fn requantize_threaded(
        &mut self,
        rows: usize,
        cols: usize,
        x: &[f32],
        pool: &ThreadPool,
    ) -> Result<(), KernelError> {
        self.requantize_with(rows, cols, x, Some(pool))
    }

    fn requantize_with(
        &mut self,
        rows: usize,
        cols: usize,
        x: &[f32],
        pool: Option<&ThreadPool>,
    ) -> Result<(), KernelError> {
        let block_len = self.format().block_len();
        if !cols.is_multiple_of(block_len) {
            return Err(KernelError::RaggedActivations { cols, block_len });
        }
        if x.len() != rows * cols {
            return Err(KernelError::InputLength {
                expected: rows * cols,
                actual: x.len(),
            });
        }
        let n = x.len() / block_len;
        match &mut self.blocks {
            ActBlocks::Q8_0(out) => {
                out.resize(
                    n,
                    ActQ8_0 {
                        d: 0.0,
                        sum: 0,
                        qs: [0; 32],
                    },
                );
                // At least 2,048 values a chunk: a job costs a few microseconds.
                spread(pool, out, 64, &|start, part| {
                    quantize_row_q8_0(&x[start * QK8_0..(start + part.len()) * QK8_0], part);
                });
            }
            ActBlocks::Q8K(out) => {
                out.resize(n, BlockQ8K::ZERO);
                spread(pool, out, 8, &|start, part| {
                    quantize_row_q8_k(&x[start * QK_K..(start + part.len()) * QK_K], part);
                });
            }
        }
        self.rows = rows;
        self.cols = cols;
        self.natural = Natural::default();
        Ok(())
    }

    /// The Q8_K quants in natural order (empty for Q8_0 activations), made on the first call after a
    /// quantisation.
    #[cfg(target_arch = "x86_64")]
    fn natural(&self) -> &[i8] {
        self.natural.0.get_or_init(|| match &self.blocks {
            ActBlocks::Q8K(b) => crate::amx::natural_order(b),
            ActBlocks::Q8_0(_) => Vec::new(),
        })
    }

    /// Activation rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Values per row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The quantisation format.
    pub fn format(&self) -> ActivationFormat {
        match self.blocks {
            ActBlocks::Q8_0(_) => ActivationFormat::Q8_0,
            ActBlocks::Q8K(_) => ActivationFormat::Q8K,
        }
    }

    /// Row `r`'s Q8_0 blocks, if these activations are Q8_0 and `r < rows`.
    pub fn q8_0_row(&self, r: usize) -> Option<&[ActQ8_0]> {
        let nb = self.cols / ActivationFormat::Q8_0.block_len();
        match &self.blocks {
            ActBlocks::Q8_0(b) => b.get(r * nb..(r + 1) * nb),
            ActBlocks::Q8K(_) => None,
        }
    }

    /// Row `r`'s Q8_K blocks, if these activations are Q8_K and `r < rows`.
    pub fn q8k_row(&self, r: usize) -> Option<&[BlockQ8K]> {
        let nb = self.cols / ActivationFormat::Q8K.block_len();
        match &self.blocks {
            ActBlocks::Q8K(b) => b.get(r * nb..(r + 1) * nb),
            ActBlocks::Q8_0(_) => None,
        }
    }
}

impl Kernels {
    /// `out[r · w.rows() + n] = dot(weight row n, activation row r)` for every activation row `r` and
    /// weight row `n`.
    ///
    /// # Errors
    /// As [`Kernels::matmul_columns`].
    pub fn matmul(
        &self,
        w: &QMatrix,
        x: &QuantizedActivations,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        self.matmul_columns(w, x, 0..w.rows(), out)
    }

    /// The output columns (weight rows) `columns` only: `out[r · columns.len() + (n - columns.start)]
    /// = dot(weight row n, activation row r)`. Disjoint ranges can run on different threads.
    ///
    /// Activation rows go in passes of up to 16; within a pass each weight block is unpacked once and
    /// dotted against every row of the pass. Each result is bit-identical to the one-row call and to
    /// every other [`crate::CpuLevel`].
    ///
    /// # Errors
    /// [`KernelError::ActivationFormat`] or [`KernelError::WidthMismatch`] if `x` does not fit `w`,
    /// [`KernelError::ColumnRange`] if `columns` is not within `0..w.rows()`,
    /// [`KernelError::OutputLength`] if `out.len() != x.rows() · columns.len()`.
    pub fn matmul_columns(
        &self,
        w: &QMatrix,
        x: &QuantizedActivations,
        columns: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        self.check(w, x, columns.clone(), out.len())?;
        if columns.is_empty() {
            return Ok(());
        }
        let out = Out {
            ptr: out.as_mut_ptr(),
            stride: columns.len(),
        };
        // SAFETY: `out` holds `x.rows() · columns.len()` values (checked above) and is borrowed
        // mutably for the whole call.
        unsafe { self.columns_into(w, x, columns.clone(), columns.start, out) };
        Ok(())
    }

    /// [`Kernels::matmul`] with the output columns spread over `pool`'s threads in chunks of whole
    /// weight rows. Each result is computed by one thread with the same arithmetic, so it is
    /// bit-identical to the single-threaded call.
    ///
    /// # Errors
    /// As [`Kernels::matmul_columns`].
    pub fn matmul_threaded(
        &self,
        w: &QMatrix,
        x: &QuantizedActivations,
        out: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<(), KernelError> {
        self.matmul_threaded_columns(w, x, 0..w.rows(), out, w.rows(), pool)
    }

    /// The output columns (weight rows) `columns` only, spread over `pool`'s threads, written with a
    /// row stride of `stride`: `out[r · stride + (n - columns.start)] = dot(weight row n, activation
    /// row r)`; the other elements of `out` are left as they are. With `stride = w.rows()` and all
    /// columns this is [`Kernels::matmul_threaded`].
    ///
    /// # Errors
    /// As [`Kernels::matmul_columns`], with [`KernelError::OutputLength`] when `stride <
    /// columns.len()` or `out` is shorter than `(x.rows() - 1) · stride + columns.len()`.
    pub fn matmul_threaded_columns(
        &self,
        w: &QMatrix,
        x: &QuantizedActivations,
        columns: Range<usize>,
        out: &mut [f32],
        stride: usize,
        pool: &ThreadPool,
    ) -> Result<(), KernelError> {
        let need = match x.rows() {
            0 => 0,
            rows => (rows - 1) * stride + columns.len(),
        };
        if stride < columns.len() || out.len() < need {
            return Err(KernelError::OutputLength {
                expected: need.max(x.rows() * columns.len()),
                actual: out.len(),
            });
        }
        // The shape checks, as for a dense output of the same columns.
        self.check(w, x, columns.clone(), x.rows() * columns.len())?;
        if columns.is_empty() {
            return Ok(());
        }
        let base = columns.start;
        let out = SharedOut(Out {
            ptr: out.as_mut_ptr(),
            stride,
        });
        let n = columns.len();
        let per = chunk_columns(n, pool.threads());
        pool.for_chunks(n, per, &|cols| {
            let out = &out;
            let cols = base + cols.start..base + cols.end;
            // SAFETY: `out` holds every element `(r, n - base)` of the call (checked above) and
            // outlives it; chunks are disjoint column ranges, so no two threads write one element.
            unsafe { self.columns_into(w, x, cols, base, out.0) };
        });
        Ok(())
    }

    /// Several matmuls as one job on `pool`'s threads: each [`MatmulJob`] as
    /// [`Kernels::matmul_threaded`] computes it (the same bits), their chunks claimed from one
    /// counter, so the threads meet once for all of them instead of once per matrix (up to
    /// 4 at a time). For the projections of the same activations: query, key and
    /// value; gate and up.
    ///
    /// # Errors
    /// As [`Kernels::matmul`], for any of the jobs; the jobs of the failing one's turn are not
    /// computed.
    pub fn matmul_threaded_many<'a>(
        &self,
        jobs: impl IntoIterator<Item = MatmulJob<'a>>,
        pool: &ThreadPool,
    ) -> Result<(), KernelError> {
        let mut jobs = jobs.into_iter().peekable();
        while jobs.peek().is_some() {
            // Per job of this turn: its matrix, activations and output, its columns per chunk and
            // the end of its chunks in the count.
            let mut turn: [Option<(&QMatrix, &QuantizedActivations, SharedOut)>; MAX_JOBS] =
                std::array::from_fn(|_| None);
            let (mut per, mut ends) = ([1; MAX_JOBS], [0; MAX_JOBS]);
            let mut total = 0;
            for (i, j) in jobs.by_ref().take(MAX_JOBS).enumerate() {
                let n = j.w.rows();
                self.check(j.w, j.x, 0..n, j.out.len())?;
                per[i] = chunk_columns(n, pool.threads());
                total += n.div_ceil(per[i]);
                ends[i] = total;
                let out = SharedOut(Out {
                    ptr: j.out.as_mut_ptr(),
                    stride: n,
                });
                turn[i] = Some((j.w, j.x, out));
            }
            pool.for_chunks(total, 1, &|chunks| {
                for c in chunks {
                    let i = ends.iter().position(|&e| c < e).unwrap_or(0);
                    let Some((w, x, out)) = &turn[i] else {
                        continue;
                    };
                    let k = c - if i == 0 { 0 } else { ends[i - 1] };
                    let cols = k * per[i]..((k + 1) * per[i]).min(w.rows());
                    // SAFETY: `out` holds every element of its job's output (checked above) and
                    // outlives the call; chunks are disjoint column ranges of one job each, so no
                    // two threads write one element.
                    unsafe { self.columns_into(w, x, cols, 0, out.0) };
                }
            });
        }
        Ok(())
    }

    fn check(
        &self,
        w: &QMatrix,
        x: &QuantizedActivations,
        columns: Range<usize>,
        out_len: usize,
    ) -> Result<(), KernelError> {
        if x.format() != w.format().activation_format() {
            return Err(KernelError::ActivationFormat {
                weights: w.format(),
                activations: x.format(),
            });
        }
        if x.cols() != w.cols() {
            return Err(KernelError::WidthMismatch {
                weights: w.cols(),
                activations: x.cols(),
            });
        }
        if columns.start > columns.end || columns.end > w.rows() {
            return Err(KernelError::ColumnRange {
                start: columns.start,
                end: columns.end,
                rows: w.rows(),
            });
        }
        let expected = x.rows() * columns.len();
        if out_len != expected {
            return Err(KernelError::OutputLength {
                expected,
                actual: out_len,
            });
        }
        Ok(())
    }

    /// Weight rows `columns` against every activation row, in passes of up to [`MAX_PASS_ROWS`]
    /// (at [`CpuLevel::Amx`], interleaved Q4_K's whole slabs of 16 rows first as one gemm on the
    /// tiles where there are [`AMX_GEMM_FROM_ROWS`] rows or more); result `(r, n)` goes to `out` at
    /// row `r`, column `n - base`.
    ///
    /// # Safety
    /// `self.check(w, x, ..)` passed; `out` is valid for writes of those elements and no other thread
    /// accesses them meanwhile.
    unsafe fn columns_into(
        &self,
        w: &QMatrix,
        x: &QuantizedActivations,
        columns: Range<usize>,
        base: usize,
        out: Out,
    ) {
        let nb = w.cols() / w.format().block_len();
        let out = Out {
            // SAFETY: `columns.start - base` is a column of the output row (the caller's contract).
            ptr: unsafe { out.ptr.add(columns.start - base) },
            stride: out.stride,
        };
        if nb == 0 {
            for r in 0..x.rows() {
                for c in 0..columns.len() {
                    // SAFETY: the caller's contract.
                    unsafe { out.ptr.add(r * out.stride + c).write(0.0) };
                }
            }
            return;
        }
        let blocks = columns.start * nb..columns.end * nb;
        // The groups holding the columns, and the columns' place among the groups' rows.
        let groups = columns.start / GROUP_ROWS * nb..columns.end.div_ceil(GROUP_ROWS) * nb;
        let skip = columns.start % GROUP_ROWS;
        let level = self.level();
        // Interleaved Q4_K's rows in whole slabs of 16 on AMX tiles where there are enough of
        // them (a prefill), each block's weights unpacked once for all of them; the rest in passes.
        #[cfg(not(target_arch = "x86_64"))]
        let start = 0;
        #[cfg(target_arch = "x86_64")]
        let start = match (&w.weights, &x.blocks) {
            (Weights::Q4Kx8(g), ActBlocks::Q8K(a))
                if level == CpuLevel::Amx && x.rows() >= AMX_GEMM_FROM_ROWS =>
            {
                use crate::formats::q4_k_x8::amx::{gemm, SLAB};
                let full = x.rows() / SLAB * SLAB;
                let window = Window {
                    out,
                    skip,
                    len: columns.len(),
                };
                let natural = &x.natural()[..256 * full * nb];
                // SAFETY: `level` comes from a `Kernels`, so this CPU has the tiles; `out` is the
                // caller's.
                unsafe {
                    gemm(
                        &mut crate::amx::Hardware,
                        &g[groups.clone()],
                        nb,
                        &a[..full * nb],
                        natural,
                        window,
                    )
                };
                full
            }
            _ => 0,
        };
        for first in (start..x.rows()).step_by(MAX_PASS_ROWS) {
            let rows = first..(first + MAX_PASS_ROWS).min(x.rows());
            let acts = rows.start * nb..rows.end * nb;
            let out = Out {
                // SAFETY: row `rows.start` of the output (the caller's contract).
                ptr: unsafe { out.ptr.add(rows.start * out.stride) },
                stride: out.stride,
            };
            // The same columns for the interleaved formats, through their groups.
            let window = Window {
                out,
                skip,
                len: columns.len(),
            };
            // Q4_K's passes of enough rows on AMX tiles, where asked for.
            #[cfg(target_arch = "x86_64")]
            let tiles = level == CpuLevel::Amx && rows.len() >= AMX_FROM_ROWS;
            // SAFETY: `level` comes from a `Kernels`, so this CPU supports it; `out` is the caller's.
            unsafe {
                match (&w.weights, &x.blocks) {
                    (Weights::Q8_0(b), ActBlocks::Q8_0(a)) => {
                        pass::<simd::Q8_0>(level, &b[blocks.clone()], nb, &a[acts], out)
                    }
                    (Weights::Q4_0(b), ActBlocks::Q8_0(a)) => {
                        pass::<simd::Q4_0>(level, &b[blocks.clone()], nb, &a[acts], out)
                    }
                    (Weights::Q5_0(b), ActBlocks::Q8_0(a)) => {
                        pass::<simd::Q5_0>(level, &b[blocks.clone()], nb, &a[acts], out)
                    }
                    (Weights::Q4_0x8(g), ActBlocks::Q8_0(a)) => {
                        pass_groups::<simd::Q4_0x8>(level, &g[groups.clone()], nb, &a[acts], window)
                    }
                    (Weights::Q5_0x8(g), ActBlocks::Q8_0(a)) => {
                        pass_groups::<simd::Q5_0x8>(level, &g[groups.clone()], nb, &a[acts], window)
                    }
                    (Weights::Q4K(b), ActBlocks::Q8K(a)) => {
                        pass::<simd::Q4K>(level, &b[blocks.clone()], nb, &a[acts], out)
                    }
                    #[cfg(target_arch = "x86_64")]
                    (Weights::Q4Kx8(g), ActBlocks::Q8K(a)) if tiles => {
                        on_tiles::<crate::formats::q4_k_x8::amx::Q4Kx8>(
                            &g[groups.clone()],
                            nb,
                            x,
                            a,
                            acts,
                            window,
                        )
                    }
                    (Weights::Q4Kx8(g), ActBlocks::Q8K(a)) => {
                        pass_groups::<simd::Q4Kx8>(level, &g[groups.clone()], nb, &a[acts], window)
                    }
                    (Weights::Q6K(b), ActBlocks::Q8K(a)) => {
                        pass::<simd::Q6K>(level, &b[blocks.clone()], nb, &a[acts], out)
                    }
                    (Weights::Q6Kx8(g), ActBlocks::Q8K(a)) => {
                        pass_groups::<simd::Q6Kx8>(level, &g[groups.clone()], nb, &a[acts], window)
                    }
                    // `check` rules these out.
                    _ => {}
                }
            }
        }
    }
}

/// [`crate::amx::pass`] on this CPU's tiles: activation rows `acts` (as block indices) of `x`, whose
/// blocks are `a`, against the groups `w`.
///
/// # Safety
/// As [`crate::amx::pass`] with [`crate::amx::Hardware`].
#[cfg(target_arch = "x86_64")]
unsafe fn on_tiles<F: crate::amx::TileFormat>(
    w: &[F::Group],
    nb: usize,
    x: &QuantizedActivations,
    a: &[BlockQ8K],
    acts: Range<usize>,
    out: Window,
) {
    let natural = &x.natural()[256 * acts.start..256 * acts.end];
    // SAFETY: the caller's contract.
    unsafe { crate::amx::pass::<F, _>(&mut crate::amx::Hardware, w, nb, &a[acts], natural, out) }
}

/// `f(start, part)` over `blocks` in chunks of at least `min_chunk` blocks, on `pool`'s threads
/// (about four chunks per thread) or, without a pool, on the caller alone.
fn spread<T: Send>(
    pool: Option<&ThreadPool>,
    blocks: &mut [T],
    min_chunk: usize,
    f: &(dyn Fn(usize, &mut [T]) + Sync),
) {
    match pool {
        Some(pool) => {
            let chunk = blocks.len().div_ceil(4 * pool.threads()).max(min_chunk);
            pool.for_chunks_mut(blocks, chunk, f);
        }
        None => f(0, blocks),
    }
}

/// An output pointer shared by the threads of one matmul, each writing its own columns.
/// Output columns per chunk of a threaded matmul of `n` columns: enough chunks per thread that a
/// thread slowed by a busy core hands its share to the others, few enough that claiming one costs
/// nothing next to computing it; a multiple of 16, so that chunks from an aligned start cover whole
/// pairs of groups of an interleaved format (the 512-bit passes take two groups at a time).
fn chunk_columns(n: usize, threads: usize) -> usize {
    n.div_ceil(8 * threads)
        .clamp(16, 512)
        .next_multiple_of(2 * GROUP_ROWS)
}

/// Matmuls one [`Kernels::matmul_threaded_many`] job holds at most (more are run in turns).
const MAX_JOBS: usize = 4;

/// One matmul of [`Kernels::matmul_threaded_many`]: `out = x · wᵀ` (`[x.rows(), w.rows()]`).
pub struct MatmulJob<'a> {
    /// The weights.
    pub w: &'a QMatrix,
    /// The quantised activations.
    pub x: &'a QuantizedActivations,
    /// The output, `x.rows() · w.rows()` values.
    pub out: &'a mut [f32],
}

struct SharedOut(Out);
// SAFETY: the threads write disjoint elements (see `matmul_threaded`), and the buffer outlives the job.
unsafe impl Sync for SharedOut {}

/// [`Kernels::matmul`] with the process-wide [`Kernels::get`].
///
/// # Errors
/// As [`Kernels::matmul_columns`].
pub fn matmul(w: &QMatrix, x: &QuantizedActivations, out: &mut [f32]) -> Result<(), KernelError> {
    Kernels::get().matmul(w, x, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes interleaved where they lie make the same matrix as blocks read first and interleaved
    /// after (NaN scales included, hence the comparison of the debug text).
    #[test]
    fn interleaving_bytes_equals_interleaving_blocks() {
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut byte = || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 56) as u8
        };
        for format in [
            BlockFormat::Q4_0,
            BlockFormat::Q5_0,
            BlockFormat::Q4K,
            BlockFormat::Q6K,
        ] {
            for (rows, nb) in [(8, 1), (16, 3), (24, 2)] {
                let cols = nb * format.block_len();
                let bytes: Vec<u8> = (0..rows * nb * format.block_bytes())
                    .map(|_| byte())
                    .collect();
                let weights = match format {
                    BlockFormat::Q4_0 => Weights::Q4_0(read_blocks(&bytes)),
                    BlockFormat::Q5_0 => Weights::Q5_0(read_blocks(&bytes)),
                    BlockFormat::Q4K => Weights::Q4K(read_blocks(&bytes)),
                    BlockFormat::Q6K => Weights::Q6K(read_blocks(&bytes)),
                    BlockFormat::Q8_0 => Weights::Q8_0(read_blocks(&bytes)),
                };
                let direct = QMatrix::from_bytes(format, rows, cols, &bytes).unwrap();
                let via_blocks = QMatrix::from_blocks(rows, cols, weights).unwrap();
                assert_eq!(
                    format!("{direct:?}"),
                    format!("{via_blocks:?}"),
                    "{format:?} {rows}×{cols}"
                );
            }
        }
    }
}
