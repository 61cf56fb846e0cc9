//! Random blocks and matrices for the kernel tests (no `rand` dependency: SplitMix64).

#![allow(dead_code)]

use specdec_kernels::{
    dot_q4_0_q8_0, dot_q4_k_q8_k, dot_q4_kx8_q8_k, dot_q5_0_q8_0, dot_q6_k_q8_k, dot_q6_kx8_q8_k,
    dot_q8_0_q8_0, BlockFormat, BlockQ4K, BlockQ4_0, BlockQ5_0, BlockQ6K, BlockQ8_0, QMatrix,
    QuantizedActivations, Weights, F16,
};

pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn byte(&mut self) -> u8 {
        self.next() as u8
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// A scale: usually ordinary, sometimes zero, subnormal, large or negative.
    pub fn scale(&mut self) -> F16 {
        let x = match self.below(8) {
            0 => 0.0,
            1 => 6e-8,   // f16 subnormal
            2 => 3000.0, // large
            3 => -0.01 * self.unit().abs(),
            _ => 0.02 * self.unit(),
        };
        F16::from_f32(x)
    }
    /// Random bytes, sometimes all minimum or all maximum.
    pub fn bytes<const N: usize>(&mut self) -> [u8; N] {
        match self.below(6) {
            0 => [0; N],
            1 => [0xff; N],
            _ => std::array::from_fn(|_| self.byte()),
        }
    }
}

pub fn random_matrix(rng: &mut Rng, format: BlockFormat, rows: usize, cols: usize) -> QMatrix {
    let n = rows * cols / format.block_len();
    let weights = match format {
        BlockFormat::Q8_0 => Weights::Q8_0(
            (0..n)
                .map(|_| BlockQ8_0 {
                    d: rng.scale(),
                    qs: rng.bytes::<32>().map(|b| b as i8),
                })
                .collect(),
        ),
        BlockFormat::Q4_0 => Weights::Q4_0(
            (0..n)
                .map(|_| BlockQ4_0 {
                    d: rng.scale(),
                    qs: rng.bytes(),
                })
                .collect(),
        ),
        BlockFormat::Q5_0 => Weights::Q5_0(
            (0..n)
                .map(|_| BlockQ5_0 {
                    d: rng.scale(),
                    qh: rng.bytes(),
                    qs: rng.bytes(),
                })
                .collect(),
        ),
        BlockFormat::Q4K => Weights::Q4K(
            (0..n)
                .map(|_| BlockQ4K {
                    d: rng.scale(),
                    dmin: rng.scale(),
                    scales: rng.bytes(),
                    qs: rng.bytes(),
                })
                .collect(),
        ),
        BlockFormat::Q6K => Weights::Q6K(
            (0..n)
                .map(|_| BlockQ6K {
                    ql: rng.bytes(),
                    qh: rng.bytes(),
                    scales: rng.bytes::<16>().map(|b| b as i8),
                    d: rng.scale(),
                })
                .collect(),
        ),
    };
    QMatrix::from_blocks(rows, cols, weights).expect("shape built to match")
}

/// `m` activation rows: mostly uniform, with an all-zero row, a row dominated by one large value, and a
/// row of tiny values.
pub fn random_activations(rng: &mut Rng, m: usize, cols: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(m * cols);
    for r in 0..m {
        for i in 0..cols {
            x.push(match r % 7 {
                3 => 0.0,
                5 if i == cols / 3 => -1e4,
                6 => 1e-30 * rng.unit(),
                _ => 4.0 * rng.unit(),
            });
        }
    }
    x
}

pub const FORMATS: [BlockFormat; 5] = [
    BlockFormat::Q8_0,
    BlockFormat::Q4_0,
    BlockFormat::Q5_0,
    BlockFormat::Q4K,
    BlockFormat::Q6K,
];

pub fn same_bits(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Activation row counts the tests run: single rows, every pass size class, and several passes.
pub const MS: [usize; 10] = [1, 2, 3, 4, 5, 8, 9, 16, 17, 33];

pub fn cols_for(format: BlockFormat) -> usize {
    // Several blocks per row, so the accumulation across blocks is exercised.
    4 * format.block_len()
}

/// The reference dot product of weight row `n` and activation row `r`.
pub fn reference(w: &QMatrix, x: &QuantizedActivations, n: usize, r: usize) -> f32 {
    match w.row_weights(n) {
        Weights::Q8_0(b) => dot_q8_0_q8_0(&b, x.q8_0_row(r).expect("Q8_0 activations")),
        Weights::Q4_0(b) => dot_q4_0_q8_0(&b, x.q8_0_row(r).expect("Q8_0 activations")),
        Weights::Q5_0(b) => dot_q5_0_q8_0(&b, x.q8_0_row(r).expect("Q8_0 activations")),
        // A Q4_K matrix stored interleaved has the interleaved format's own arithmetic.
        Weights::Q4K(b) if matches!(w.weights(), Weights::Q4Kx8(_)) => {
            dot_q4_kx8_q8_k(&b, x.q8k_row(r).expect("Q8_K activations"))
        }
        Weights::Q4K(b) => dot_q4_k_q8_k(&b, x.q8k_row(r).expect("Q8_K activations")),
        // Likewise Q6_K.
        Weights::Q6K(b) if matches!(w.weights(), Weights::Q6Kx8(_)) => {
            dot_q6_kx8_q8_k(&b, x.q8k_row(r).expect("Q8_K activations"))
        }
        Weights::Q6K(b) => dot_q6_k_q8_k(&b, x.q8k_row(r).expect("Q8_K activations")),
        other => panic!("row_weights gave grouped blocks: {:?}", other.format()),
    }
}
