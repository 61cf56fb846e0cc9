//! Quantised weight matrices on candle's CPU kernels.
//!
//! invariant: [`QWeight::matmul`] is row-independent. Each output element is one `vec_dot` of a weight
//! row with that activation row quantised on its own, whatever the number of rows in the call. candle's
//! `QMatMul` module would instead pick repacked kernels by row count (Q6_K uses a different kernel for
//! one row than for many), so block logits would not match single-token logits bit for bit; calling the
//! kernels through `QuantizedType::matmul_t` keeps the guarantee.

use std::borrow::Cow;
use std::ops::Range;

use candle_core::backend::BackendStorage;
use candle_core::quantized::{GgmlDType, QuantizedType};
use candle_core::CpuStorage;

use specdec_kernels::{
    ActivationFormat, BlockFormat, Kernels, MatmulJob, QMatrix, QuantizedActivations, ThreadPool,
};

use crate::error::{Error, Result};

/// The types a weight may have.
pub fn supported(dtype: GgmlDType) -> bool {
    use GgmlDType as D;
    matches!(
        dtype,
        D::F32
            | D::F16
            | D::BF16
            | D::Q4_0
            | D::Q4_1
            | D::Q5_0
            | D::Q5_1
            | D::Q8_0
            | D::Q2K
            | D::Q3K
            | D::Q4K
            | D::Q5K
            | D::Q6K
    )
}

/// The logit of a token a model was told not to score (see [`QWeight::matmul_prefix`]): the lowest
/// finite `f32`, whose probability after a softmax is exactly 0.
pub const MASKED: f32 = f32::MIN;

/// The rows listed in `also` (ascending) that lie in `limit..rows`, as runs of consecutive rows
/// (computed where they are used: no allocation per pass).
fn also_runs(also: &[u32], limit: usize, rows: usize) -> impl Iterator<Item = Range<usize>> + '_ {
    let mut ids = also
        .iter()
        .map(|&r| r as usize)
        .filter(move |&r| r >= limit && r < rows)
        .peekable();
    std::iter::from_fn(move || {
        let start = ids.next()?;
        let mut end = start + 1;
        // Consecutive ids (and repeats) extend the run.
        while let Some(&r) = ids.peek() {
            if r > end {
                break;
            }
            end = end.max(r + 1);
            ids.next();
        }
        Some(start..end)
    })
}

/// The block format of our own kernels for a GGUF type, if they cover it.
fn own_format(dtype: GgmlDType) -> Option<BlockFormat> {
    match dtype {
        GgmlDType::Q8_0 => Some(BlockFormat::Q8_0),
        GgmlDType::Q4_0 => Some(BlockFormat::Q4_0),
        GgmlDType::Q5_0 => Some(BlockFormat::Q5_0),
        GgmlDType::Q4K => Some(BlockFormat::Q4K),
        GgmlDType::Q6K => Some(BlockFormat::Q6K),
        _ => None,
    }
}

/// Whether [`QWeight`] runs a type on our own kernels (else on candle's).
pub fn has_own_kernel(dtype: GgmlDType) -> bool {
    own_format(dtype).is_some()
}

enum Storage {
    Own(QMatrix),
    Candle(Box<dyn QuantizedType>),
}

/// A matrix of `rows` rows of `cols` values, stored in a GGUF quantisation type.
pub struct QWeight {
    data: Storage,
    dtype: GgmlDType,
    rows: usize,
    cols: usize,
}

/// Buffers for the quantised forms of activations, kept between forward passes.
#[derive(Clone, Debug, Default)]
pub struct ActivationBuffers {
    q8_0: Option<QuantizedActivations>,
    q8k: Option<QuantizedActivations>,
}

/// An activation matrix `[m, cols]` with its quantised forms made on first use (in reused buffers),
/// so the matrices that read the same input (q, k and v; gate and up) quantise it once.
pub struct Activations<'a> {
    x: &'a [f32],
    m: usize,
    buffers: &'a mut ActivationBuffers,
    q8_0: bool,
    q8k: bool,
}

impl<'a> Activations<'a> {
    /// `m` rows of `x`, quantised into `buffers` when a matrix needs it.
    pub fn new(x: &'a [f32], m: usize, buffers: &'a mut ActivationBuffers) -> Self {
        Self {
            x,
            m,
            buffers,
            q8_0: false,
            q8k: false,
        }
    }

    /// The activations quantised for the matrix in `data`, if [`Activations::quantized`] made them.
    fn ready(&self, data: &Storage) -> Option<&QuantizedActivations> {
        let Storage::Own(w) = data else {
            return None;
        };
        match w.format().activation_format() {
            ActivationFormat::Q8_0 if self.q8_0 => self.buffers.q8_0.as_ref(),
            ActivationFormat::Q8K if self.q8k => self.buffers.q8k.as_ref(),
            _ => None,
        }
    }

    /// The activations quantised for `format`, made now if this is the first matrix that needs them.
    fn quantized(&mut self, w: &QMatrix, pool: &ThreadPool) -> Result<&QuantizedActivations> {
        let format = w.format().activation_format();
        let (slot, done) = match format {
            ActivationFormat::Q8_0 => (&mut self.buffers.q8_0, &mut self.q8_0),
            ActivationFormat::Q8K => (&mut self.buffers.q8k, &mut self.q8k),
        };
        if !*done {
            match slot {
                Some(q) => q.requantize_threaded(self.m, w.cols(), self.x, pool)?,
                None => {
                    let mut q = w.quantize_activations(0, &[])?;
                    q.requantize_threaded(self.m, w.cols(), self.x, pool)?;
                    *slot = Some(q);
                }
            }
            *done = true;
        }
        match slot {
            Some(q) => Ok(q),
            // Filled just above.
            None => Err(Error::Shape {
                what: "activation quantisation",
                expected: (self.m * w.cols(), 0),
                actual: (self.x.len(), 0),
            }),
        }
    }
}

impl std::fmt::Debug for QWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QWeight")
            .field("dtype", &self.dtype())
            .field("own_kernel", &self.is_own_kernel())
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

impl QWeight {
    /// Wraps raw GGUF bytes; the caller checked the type, the size and that `cols` is a whole number
    /// of blocks.
    pub(crate) fn from_bytes(
        dtype: GgmlDType,
        bytes: &[u8],
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        let data = match own_format(dtype) {
            Some(format) => Storage::Own(QMatrix::from_bytes(format, rows, cols, bytes)?),
            None => Storage::Candle(dtype.from_data(Cow::Borrowed(bytes))),
        };
        Ok(Self {
            data,
            dtype,
            rows,
            cols,
        })
    }

    /// Quantises an f32 matrix (`rows * cols` values, row-major), with candle's quantisers.
    pub fn quantize(values: &[f32], rows: usize, cols: usize, dtype: GgmlDType) -> Result<Self> {
        let mut data = dtype.cpu_zeros(rows * cols);
        data.from_float(values);
        if own_format(dtype).is_some() {
            return Self::from_bytes(dtype, candle_bytes(data.as_ref()), rows, cols);
        }
        Ok(Self {
            data: Storage::Candle(data),
            dtype,
            rows,
            cols,
        })
    }

    /// The quantisation type.
    pub fn dtype(&self) -> GgmlDType {
        self.dtype
    }

    /// Whether this matrix runs on our own kernels.
    pub fn is_own_kernel(&self) -> bool {
        matches!(self.data, Storage::Own(_))
    }

    /// Rows (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns (input features).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held.
    pub fn size_in_bytes(&self) -> usize {
        match &self.data {
            Storage::Own(w) => w.size_bytes(),
            Storage::Candle(d) => d.storage_size_in_bytes(),
        }
    }

    /// Checks that `x` is `[m, cols]` and `out` is `[m, rows]`.
    fn check_shape(&self, x: &Activations<'_>, out: &[f32]) -> Result<()> {
        let m = x.m;
        if x.x.len() != m * self.cols || out.len() != m * self.rows {
            return Err(Error::Shape {
                what: "matmul",
                expected: (m * self.cols, m * self.rows),
                actual: (x.x.len(), out.len()),
            });
        }
        Ok(())
    }

    /// The output features `0..limit` and those listed in `also` only: `out[i, r]` for those `r` as
    /// [`QWeight::matmul`] computes it (the same bits), and [`MASKED`] for the others (`out` is
    /// `[m, rows]`; `also` ascending). Our kernels skip the other rows' weights; candle's compute them
    /// and overwrite them.
    pub fn matmul_prefix(
        &self,
        x: &mut Activations<'_>,
        limit: usize,
        also: &[u32],
        out: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<()> {
        let limit = limit.min(self.rows);
        let runs = || also_runs(also, limit, self.rows);
        match &self.data {
            Storage::Own(w) if limit < self.rows => {
                self.check_shape(x, out)?;
                let q = x.quantized(w, pool)?;
                let kernels = Kernels::get();
                kernels.matmul_threaded_columns(w, q, 0..limit, out, self.rows, pool)?;
                for run in runs() {
                    // Column `run.start` of row 0 is `out[run.start]`; the stride moves by rows.
                    // (No rows, no output: nothing to compute.)
                    if let Some(at) = out.get_mut(run.start..) {
                        kernels.matmul_threaded_columns(w, q, run, at, self.rows, pool)?;
                    }
                }
            }
            _ => self.matmul(x, out, pool)?,
        }
        for row in out.chunks_exact_mut(self.rows.max(1)) {
            let mut from = limit;
            for run in runs() {
                row[from..run.start].fill(MASKED);
                from = run.end;
            }
            row[from..].fill(MASKED);
        }
        Ok(())
    }

    /// [`QWeight::matmul`] of the same activations by `N` matrices, each into its output: one job
    /// on `pool`'s threads where all of them run on our kernels
    /// ([`Kernels::matmul_threaded_many`], the same bits), one after the other otherwise.
    pub fn matmul_many<const N: usize>(
        x: &mut Activations<'_>,
        jobs: [(&QWeight, &mut [f32]); N],
        pool: &ThreadPool,
    ) -> Result<()> {
        for (w, out) in &jobs {
            w.check_shape(x, out)?;
        }
        if !jobs.iter().all(|(w, _)| w.is_own_kernel()) {
            for (w, out) in jobs {
                w.matmul(x, out, pool)?;
            }
            return Ok(());
        }
        for (w, _) in &jobs {
            if let Storage::Own(q) = &w.data {
                x.quantized(q, pool)?;
            }
        }
        let x = &*x;
        let mut missing = None;
        let kernel_jobs = jobs.into_iter().filter_map(|(w, out)| {
            match (&w.data, x.ready(&w.data)) {
                (Storage::Own(q), Some(acts)) => Some(MatmulJob { w: q, x: acts, out }),
                // Not reached: every matrix runs on our kernels and its activations were made
                // above.
                _ => {
                    missing = Some(w.cols);
                    None
                }
            }
        });
        Kernels::get().matmul_threaded_many(kernel_jobs, pool)?;
        match missing {
            Some(cols) => Err(Error::Shape {
                what: "activation quantisation",
                expected: (x.m * cols, 0),
                actual: (x.x.len(), 0),
            }),
            None => Ok(()),
        }
    }

    /// `out[i, r] = Σ_c x[i, c] w[r, c]` for `m` rows of `x` (`[m, cols]` in, `[m, rows]` out), on
    /// `pool`'s threads.
    pub fn matmul(
        &self,
        x: &mut Activations<'_>,
        out: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<()> {
        self.check_shape(x, out)?;
        let m = x.m;
        match &self.data {
            Storage::Own(w) => {
                let q = x.quantized(w, pool)?;
                Kernels::get().matmul_threaded(w, q, out, pool)?;
            }
            Storage::Candle(d) => d.matmul_t((m, self.cols, self.rows), x.x, out)?,
        }
        Ok(())
    }

    /// Row `row`, dequantised into `out` (`cols` values): an embedding lookup without a dense copy of
    /// the table.
    pub fn row_into(&self, row: usize, out: &mut [f32]) -> Result<()> {
        let d = match &self.data {
            Storage::Own(w) => {
                w.dequantize_row(row, out);
                return Ok(());
            }
            Storage::Candle(d) => d,
        };
        match d.embedding(&[row as u32], self.rows, self.cols)? {
            CpuStorage::F32(v) => {
                out.copy_from_slice(&v);
                Ok(())
            }
            other => Err(candle_core::Error::Msg(format!(
                "embedding returned {:?}, expected f32",
                other.dtype()
            ))
            .into()),
        }
    }

    /// The whole matrix as f32.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let d = match &self.data {
            Storage::Own(w) => {
                let mut out = vec![0.0; self.rows * self.cols];
                for (r, row) in out.chunks_exact_mut(self.cols.max(1)).enumerate() {
                    w.dequantize_row(r, row);
                }
                return Ok(out);
            }
            Storage::Candle(d) => d,
        };
        match d.dequantize(self.rows * self.cols)? {
            CpuStorage::F32(v) => Ok(v),
            other => Err(candle_core::Error::Msg(format!(
                "dequantize returned {:?}, expected f32",
                other.dtype()
            ))
            .into()),
        }
    }

    /// The same matrix in another type (e.g. Q5_1 to Q8_0, which our kernels cover), quantised with
    /// candle's quantisers 4 Mi values (16 MB of f32) at a time: no f32 copy of the whole matrix
    /// (the draft's 151,936 × 896 embedding table would take 545 MB). Blocks are quantised one by
    /// one, so the result is the same as [`QWeight::quantize`] of [`QWeight::to_f32`].
    pub fn requantize(&self, dtype: GgmlDType) -> Result<Self> {
        self.requantize_in_chunks(dtype, REQUANTIZE_CHUNK)
    }

    /// [`QWeight::requantize`] in chunks of whole rows of about `chunk` values (at least one row).
    fn requantize_in_chunks(&self, dtype: GgmlDType, chunk: usize) -> Result<Self> {
        let (rows, cols) = (self.rows, self.cols);
        let chunk_rows = (chunk / cols.max(1)).clamp(1, rows.max(1));
        let mut values = vec![0.0f32; chunk_rows * cols];
        let mut bytes = Vec::with_capacity(rows * cols / dtype.block_size() * dtype.type_size());
        for start in (0..rows).step_by(chunk_rows) {
            let part = &mut values[..chunk_rows.min(rows - start) * cols];
            for (i, row) in part.chunks_exact_mut(cols.max(1)).enumerate() {
                self.row_into(start + i, row)?;
            }
            let mut data = dtype.cpu_zeros(part.len());
            data.from_float(part);
            bytes.extend_from_slice(candle_bytes(data.as_ref()));
        }
        Self::from_bytes(dtype, &bytes, rows, cols)
    }
}

/// Values [`QWeight::requantize`] holds as f32 at a time (16 MB).
const REQUANTIZE_CHUNK: usize = 1 << 22;

/// The raw GGUF bytes of a candle block buffer.
fn candle_bytes(d: &dyn QuantizedType) -> &[u8] {
    let n = d.storage_size_in_bytes();
    // SAFETY: `as_ptr` points at the `storage_size_in_bytes` bytes of candle's block array, which lives
    // as long as `d` is borrowed.
    unsafe { std::slice::from_raw_parts(d.as_ptr(), n) }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use super::*;

    /// Requantising a few rows at a time gives the matrix that quantising the whole f32 copy gives,
    /// for a type of our kernels and one of candle's, from either kind of storage.
    #[test]
    fn requantizing_in_chunks_equals_requantizing_the_whole_matrix() {
        let (rows, cols) = (13, 64);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 2_654_435_761) % 1_000_003) as f32 / 1_000_003.0 - 0.5)
            .collect();
        for from in [GgmlDType::Q5_0, GgmlDType::Q4_1] {
            let w = QWeight::quantize(&values, rows, cols, from).unwrap();
            for to in [GgmlDType::Q4_0, GgmlDType::Q8_0, GgmlDType::Q5_1] {
                let whole = QWeight::quantize(&w.to_f32().unwrap(), rows, cols, to).unwrap();
                // 3 rows a chunk (13 = 4 · 3 + 1), a row a chunk, and all at once.
                for chunk in [3 * cols, 1, rows * cols] {
                    let got = w.requantize_in_chunks(to, chunk).unwrap();
                    assert_eq!(got.dtype(), to);
                    let (a, b) = (got.to_f32().unwrap(), whole.to_f32().unwrap());
                    assert!(
                        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{from:?} -> {to:?}, chunks of {chunk} values"
                    );
                }
            }
        }
    }
}
