//! Quantised weight matrices on candle's CPU kernels.
//!
//! invariant: [`QWeight::matmul`] is row-independent. Each output element is one `vec_dot` of a weight
//! row with that activation row quantised on its own, whatever the number of rows in the call. candle's
//! `QMatMul` module would instead pick repacked kernels by row count (Q6_K uses a different kernel for
//! one row than for many), so block logits would not match single-token logits bit for bit; calling the
//! kernels through `QuantizedType::matmul_t` keeps the guarantee.

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::quantized::{GgmlDType, QuantizedType};
use candle_core::CpuStorage;

use crate::error::Result;

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

/// A matrix of `rows` rows of `cols` values, stored in a GGUF quantisation type.
pub struct QWeight {
    data: Box<dyn QuantizedType>,
    rows: usize,
    cols: usize,
}

impl std::fmt::Debug for QWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QWeight")
            .field("dtype", &self.dtype())
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

impl QWeight {
    /// Wraps raw GGUF bytes; the caller checked the type, the size and that `cols` is a whole number
    /// of blocks.
    pub(crate) fn from_bytes(dtype: GgmlDType, bytes: &[u8], rows: usize, cols: usize) -> Self {
        Self {
            data: dtype.from_data(Cow::Borrowed(bytes)),
            rows,
            cols,
        }
    }

    /// Quantises an f32 matrix (`rows * cols` values, row-major).
    pub fn quantize(values: &[f32], rows: usize, cols: usize, dtype: GgmlDType) -> Self {
        let mut data = dtype.cpu_zeros(rows * cols);
        data.from_float(values);
        Self { data, rows, cols }
    }

    /// The quantisation type.
    pub fn dtype(&self) -> GgmlDType {
        self.data.dtype()
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
        self.data.storage_size_in_bytes()
    }

    /// `out[i, r] = Σ_c x[i, c] w[r, c]` for `m` rows of `x` (`[m, cols]` in, `[m, rows]` out).
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) -> Result<()> {
        assert_eq!(x.len(), m * self.cols, "matmul input is [m, cols]");
        assert_eq!(out.len(), m * self.rows, "matmul output is [m, rows]");
        self.data.matmul_t((m, self.cols, self.rows), x, out)?;
        Ok(())
    }

    /// Row `row`, dequantised into `out` (`cols` values): an embedding lookup without a dense copy of
    /// the table.
    pub fn row_into(&self, row: usize, out: &mut [f32]) -> Result<()> {
        match self.data.embedding(&[row as u32], self.rows, self.cols)? {
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
        match self.data.dequantize(self.rows * self.cols)? {
            CpuStorage::F32(v) => Ok(v),
            other => Err(candle_core::Error::Msg(format!(
                "dequantize returned {:?}, expected f32",
                other.dtype()
            ))
            .into()),
        }
    }

    /// The same matrix in another type (e.g. Q5_0 to Q8_0, whose dot product candle vectorises).
    pub fn requantize(&self, dtype: GgmlDType) -> Result<Self> {
        Ok(Self::quantize(&self.to_f32()?, self.rows, self.cols, dtype))
    }
}
