//! A counter-based random number generator: Philox4x32-10 (Salmon et al., SC'11, "Parallel random
//! numbers: as easy as 1, 2, 3").
//!
//! A counter-based generator has no state to advance: the uniform number used for a decision is a pure
//! function of `(seed, lane, draw, position, stream)`. That is what lets speculative decoding in
//! [`VerifyMode::OneHot`](crate::VerifyMode::OneHot) reproduce non-speculative sampling token for token:
//! both draw the token at position `pos` with the very same number (the target's streams are drawn
//! at draw 0), however many tokens were drafted, rejected or redrafted before. Drafting numbers
//! are drawn anew in each drafting round ([`CounterRng::with_draw`]).

/// Philox multiplier for lane 0.
const M0: u32 = 0xD251_1F53;
/// Philox multiplier for lane 2.
const M1: u32 = 0xCD9E_8D57;
/// Weyl key increment, first word (golden ratio).
const W0: u32 = 0x9E37_79B9;
/// Weyl key increment, second word (sqrt(3) - 1).
const W1: u32 = 0xBB67_AE85;

#[inline]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = u64::from(a) * u64::from(b);
    ((p >> 32) as u32, p as u32)
}

/// The Philox4x32 bijection with 10 rounds: maps a 128-bit counter under a 64-bit key to 128 random
/// bits. Matches the known-answer vectors of the Random123 distribution.
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = ctr;
    let mut k = key;
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(W0);
            k[1] = k[1].wrapping_add(W1);
        }
        let (hi0, lo0) = mulhilo(M0, c[0]);
        let (hi1, lo1) = mulhilo(M1, c[2]);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// What a uniform number is used for. Each purpose draws from its own stream so that, for example, the
/// acceptance test at a position never reuses the number that sampled the token there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Stream {
    /// Sampling the target's token at a position; plain decoding uses only this stream.
    Target = 0,
    /// Sampling a drafted token.
    Draft = 1,
    /// The acceptance test `u < p(x) / q(x)` of rejection sampling.
    Accept = 2,
    /// Resampling from the residual `norm(max(0, p - q))` after a rejection.
    Residual = 3,
}

/// A seeded counter-based generator: `uniform(pos, stream)` is a pure function of the seed, the lane,
/// the draw, the absolute position of the token in the sequence and the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CounterRng {
    key: [u32; 2],
    /// Separates independent sequences that share a seed (a batch); 0 for a single sequence.
    lane: u32,
    /// Separates the draws of one position: a batch gives each drafting round of a sequence its own
    /// ([`CounterRng::with_draw`]); 0 for everything else.
    draw: u32,
}

impl CounterRng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            key: [seed as u32, (seed >> 32) as u32],
            lane: 0,
            draw: 0,
        }
    }

    /// The same seed on another lane: independent numbers for another sequence of a batch.
    pub fn with_lane(self, lane: u32) -> Self {
        Self { lane, ..self }
    }

    /// The same generator with other numbers for every position: draw `draw` of them. A drafting
    /// round draws its tokens from `uniform(pos, Stream::Draft)`, and after a rejection the next
    /// round drafts some of the same positions again; a round's choices (how far to draft, with
    /// which drafter) depend on the rounds before, whose draws they saw, so were a position's number
    /// the same in every round, the choice to draft it could depend on the number it is drawn with,
    /// and the drafted token would no longer follow the distribution reported with it. Each
    /// round's own draw keeps its numbers independent of everything decided before it. Draw 0 is
    /// [`CounterRng::new`]'s.
    pub fn with_draw(self, draw: u32) -> Self {
        Self { draw, ..self }
    }

    /// 128 random bits for `(pos, stream)` (and the draw, in the bits above the stream's two).
    pub fn bits(&self, pos: usize, stream: Stream) -> [u32; 4] {
        let pos = pos as u64;
        philox4x32_10(
            [
                pos as u32,
                (pos >> 32) as u32,
                stream as u32 | self.draw << 2,
                self.lane,
            ],
            self.key,
        )
    }

    /// A uniform number in `[0, 1)` with 53 random bits.
    pub fn uniform(&self, pos: usize, stream: Stream) -> f64 {
        let b = self.bits(pos, stream);
        let x = (u64::from(b[0]) << 32 | u64::from(b[1])) >> 11;
        x as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The three `philox4x32 10` lines of Random123's `kat_vectors`: counter, key, expected output.
    #[test]
    fn philox_known_answer_vectors() {
        let cases: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
            (
                [0, 0, 0, 0],
                [0, 0],
                [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8],
            ),
            (
                [u32::MAX; 4],
                [u32::MAX; 2],
                [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd],
            ),
            (
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0],
                [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1],
            ),
        ];
        for (ctr, key, want) in cases {
            assert_eq!(philox4x32_10(ctr, key), want);
        }
    }

    #[test]
    fn uniform_is_a_pure_function_of_seed_position_and_stream() {
        let a = CounterRng::new(7);
        let b = CounterRng::new(7);
        assert_eq!(a.uniform(3, Stream::Target), b.uniform(3, Stream::Target));
        assert_ne!(a.uniform(3, Stream::Target), a.uniform(3, Stream::Draft));
        assert_ne!(a.uniform(3, Stream::Target), a.uniform(4, Stream::Target));
        assert_ne!(
            a.uniform(3, Stream::Target),
            CounterRng::new(8).uniform(3, Stream::Target)
        );
        assert_ne!(
            a.uniform(3, Stream::Target),
            a.with_lane(1).uniform(3, Stream::Target)
        );
        assert_eq!(a.with_draw(0), a);
        for draw in 1..4 {
            assert_ne!(
                a.uniform(3, Stream::Draft),
                a.with_draw(draw).uniform(3, Stream::Draft)
            );
            // Draws stay apart from the other streams too.
            for stream in [Stream::Target, Stream::Accept, Stream::Residual] {
                assert_ne!(
                    a.uniform(3, stream),
                    a.with_draw(draw).uniform(3, Stream::Draft)
                );
            }
        }
    }

    #[test]
    fn uniform_mean_and_range() {
        let rng = CounterRng::new(42);
        let n = 100_000;
        let mut sum = 0.0;
        for i in 0..n {
            let u = rng.uniform(i, Stream::Accept);
            assert!((0.0..1.0).contains(&u));
            sum += u;
        }
        // The mean of n uniforms has standard deviation 1/sqrt(12 n) ~ 0.0009; 6 sigma: false-failure
        // rate below 1e-8.
        assert!((sum / n as f64 - 0.5).abs() < 6.0 * (1.0 / (12.0 * n as f64)).sqrt());
    }
}
