//! CPU kernels for GGUF-quantised matrices: block formats, activation quantisation, a multi-row matmul
//! and the thread pool it runs on. `specdec-runtime` runs its Q4_0, Q5_0, Q8_0, Q4_K and Q6_K matrices
//! on them.
//!
//! Speculative decoding scores a handful of tokens at once, so the target model's matmuls see `m` = 2..16
//! activation rows. Row-by-row kernels stream every weight block `m` times; [`Kernels::matmul`] unpacks
//! each weight block once per pass of up to 16 rows and dots it against all of them.
//!
//! - [`formats`]: ggml's `block_q8_0`, `block_q4_0` and `block_q5_0` byte-for-byte, `block_q4_K`,
//!   `block_q6_K` and `block_q8_K` with their fields and sizes but the quants in a transposed order
//!   for the kernels (weights repacked when read from a file's bytes), their dequantisation,
//!   activation quantisation ([`quantize_row_q8_k`], [`quantize_row_q8_0`], exactly ggml's `_ref`
//!   functions) and the scalar reference dot products.
//! - [`Kernels`]: the matmul at a [`CpuLevel`] (portable scalar, AVX2 with F16C and FMA, AVX2 with
//!   AVX-512 VNNI dot products, and the interleaved formats' passes of 6 or more rows on 512-bit
//!   vectors, the K-quants' only, from 4 rows, on CPUs that split 512-bit operations in two, and the
//!   K-quants' from one row on AMD's EPYC Zen 5), detected once per
//!   process and overridable with
//!   `SPECDEC_KERNELS=scalar|avx2|avx512vnni|avx512zmm-k|avx512zmm|amx|auto` (`amx`: Q4_K's
//!   16-row passes on Intel's AMX tiles, never detected since it measured no faster for
//!   verification);
//!   [`Kernels::matmul_threaded`]
//!   splits the output columns over a [`ThreadPool`].
//! - [`pool`]: the fork-join [`ThreadPool`].
//! - [`mod@f16`]: exact f16 conversions.
//!
//! Invariant: a result depends only on its weight row and activation row: it is bit-identical whatever
//! the number of rows in the call, whatever the other rows hold, and at every [`CpuLevel`] (all levels
//! perform the same exact integer sums and the same float operations in the same order; see
//! [`formats`]).
//!
//! This crate knows no models, files or tensors; the caller hands it a tensor's bytes.
//!
//! ```
//! use specdec_kernels::{BlockFormat, BlockQ8_0, F16, Kernels, QMatrix, Weights};
//!
//! // A 2 × 64 Q8_0 matrix: row 0 is all 1.0 (scale 0.5, quant 2), row 1 all -0.5.
//! let block = |d: f32, q: i8| BlockQ8_0 { d: F16::from_f32(d), qs: [q; 32] };
//! let weights = Weights::Q8_0(vec![block(0.5, 2), block(0.5, 2), block(-0.5, 1), block(-0.5, 1)]);
//! let w = QMatrix::from_blocks(2, 64, weights)?;
//!
//! // Three activation rows, all 127.0, all -254.0 and all 0.0 (exact in Q8_0: scales 1 and 2).
//! let x: Vec<f32> = [127.0, -254.0, 0.0].iter().flat_map(|&v| vec![v; 64]).collect();
//! let xq = w.quantize_activations(3, &x)?;
//!
//! let mut out = vec![0.0; 3 * 2]; // [activation row, weight row]
//! Kernels::get().matmul(&w, &xq, &mut out)?;
//! assert_eq!(out, [8128.0, -4064.0, -16256.0, 8128.0, 0.0, 0.0]);
//! assert_eq!(w.format(), BlockFormat::Q8_0);
//! # Ok::<(), specdec_kernels::KernelError>(())
//! ```

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
mod amx;
pub mod dispatch;
pub mod f16;
pub mod formats;
mod matrix;
pub mod pool;
mod simd;
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod testing;

pub use amx::{AMX_FROM_ROWS, AMX_GEMM_FROM_ROWS};
pub use dispatch::{CpuLevel, Kernels, LEVEL_ENV};
pub use f16::F16;
pub use formats::{
    dequantize_row, dot_q4_0_q8_0, dot_q4_k_q8_k, dot_q4_kx8_q8_k, dot_q5_0_q8_0, dot_q6_k_q8_k,
    dot_q6_kx8_q8_k, dot_q8_0_q8_0, hsum8, interleave_rows, q8k_position, q8k_value,
    quantize_row_q8_0, quantize_row_q8_k, ActQ8_0, ActivationFormat, BlockFormat, BlockQ4K,
    BlockQ4Kx8, BlockQ4_0, BlockQ4_0x8, BlockQ5_0, BlockQ5_0x8, BlockQ6K, BlockQ6Kx8, BlockQ8K,
    BlockQ8_0, Interleaved, WeightBlock, GROUP_ROWS,
};
pub use matrix::{matmul, MatmulJob, QMatrix, QuantizedActivations, Weights};
pub use pool::{ThreadPool, MAX_THREADS};
pub use simd::MAX_PASS_ROWS;

/// The kernels' revision, raised whenever a change moves their speed (r(m), a step's time): a saved
/// cost calibration names it, so a new revision is calibrated afresh instead of starting from costs
/// measured on the old kernels. 23: the transposed K-quant order (stop 23); 24: Q4_0 and Q5_0 with
/// 8 weight rows interleaved (stop 24); 25: Q4_K with 8 weight rows interleaved (stop 25); 27: the
/// VNNI passes of interleaved Q4_K and of Q6_K chain `vpdpbusd`, and weights are prefetched into L2
/// (stop 27); 28: interleaved Q4_K keeps at most 8 rows' sums in registers and adds both chains
/// with one `vpdpwssd`, and Q6_K is stored with 8 rows interleaved (stop 28); 33: the
/// [`CpuLevel::Avx512Zmm`] level, chosen on Intel's AVX-512 CPUs (stop 33); 34: the 32-value
/// formats' 512-bit passes prefetch in one burst (and so compile to `vpdpbusd` broadcasting its
/// activations from memory) and run at [`CpuLevel::Avx512ZmmK`] on AMD's EPYC Zen 5, and Q8_0 and
/// Q8_K activations are quantised in AVX2 intrinsics (stop 76); 35: on AMD's EPYC Zen 5 the K-quant
/// passes run on 512-bit vectors from one row (stop 78).
pub const REVISION: u32 = 35;

/// Everything that can go wrong in this crate: shapes and levels, never arithmetic.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// A weight row is not a whole number of blocks.
    #[error("{cols} values per row is not a multiple of the {format:?} block length {block_len}")]
    RaggedRow {
        /// The weight format.
        format: BlockFormat,
        /// Values per row.
        cols: usize,
        /// Values per block.
        block_len: usize,
    },
    /// An activation row is not a whole number of blocks.
    #[error("{cols} activation values per row is not a multiple of the block length {block_len}")]
    RaggedActivations {
        /// Values per row.
        cols: usize,
        /// Values per block.
        block_len: usize,
    },
    /// The number of blocks does not match the shape.
    #[error("expected {expected} blocks, got {actual}")]
    BlockCount {
        /// Blocks the shape needs.
        expected: usize,
        /// Blocks given.
        actual: usize,
    },
    /// Interleaved blocks for a row count that is not a multiple of the group's 8 rows.
    #[error("{rows} rows cannot be interleaved in groups of 8")]
    RaggedGroups {
        /// Weight rows.
        rows: usize,
    },
    /// The tensor bytes do not match the shape.
    #[error("expected {expected} bytes, got {actual}")]
    ByteLength {
        /// Bytes the shape needs.
        expected: usize,
        /// Bytes given.
        actual: usize,
    },
    /// The activation input does not match the shape.
    #[error("expected {expected} activation values, got {actual}")]
    InputLength {
        /// Values the shape needs.
        expected: usize,
        /// Values given.
        actual: usize,
    },
    /// The activations were quantised for another weight format.
    #[error("{weights:?} weights need {:?} activations, got {activations:?}", weights.activation_format())]
    ActivationFormat {
        /// The weight format.
        weights: BlockFormat,
        /// The activations' format.
        activations: ActivationFormat,
    },
    /// Activation rows and weight rows differ in length.
    #[error("weight rows have {weights} values, activation rows {activations}")]
    WidthMismatch {
        /// Values per weight row.
        weights: usize,
        /// Values per activation row.
        activations: usize,
    },
    /// The requested output columns are not within the matrix.
    #[error("columns {start}..{end} are not within the matrix's {rows} rows")]
    ColumnRange {
        /// Range start.
        start: usize,
        /// Range end.
        end: usize,
        /// Weight rows.
        rows: usize,
    },
    /// The output buffer has the wrong length.
    #[error("expected an output of {expected} values, got {actual}")]
    OutputLength {
        /// Values the call writes.
        expected: usize,
        /// Values given.
        actual: usize,
    },
    /// The CPU cannot run the requested level.
    #[error("this CPU does not support the {level} kernels (they need {needs})")]
    UnsupportedLevel {
        /// The level's name.
        level: &'static str,
        /// What the level needs ([`CpuLevel::features`]).
        needs: &'static str,
    },
    /// An unknown level name (in `SPECDEC_KERNELS` or [`CpuLevel::parse`]).
    #[error(
        "unknown kernel level {name:?} (expected scalar, avx2, avx512vnni, avx512zmm-k, avx512zmm, amx or auto)"
    )]
    UnknownLevel {
        /// The name given.
        name: String,
    },
}
