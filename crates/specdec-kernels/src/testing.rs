//! The AMX kernels' layout checks, which need a CPU feature at run time (AVX-512 for the emulated
//! tiles' vectors, AMX for the hardware's tiles): `tests/levels.rs` runs each as a test where the
//! CPU has what it needs and reports it as ignored, with the features it lacks, where it does not
//! (a unit test could only pass silently there). Behind the `testing` feature; not part of the API.

use crate::CpuLevel;

/// One check: its name, the level whose features it needs, and the check itself (it panics on a
/// mismatch).
pub struct Check {
    /// The test's name.
    pub name: &'static str,
    /// The level this CPU must support for the check to run.
    pub needs: CpuLevel,
    /// The check.
    pub run: fn(),
}

/// Every check this target has (none off x86-64).
pub fn checks() -> Vec<Check> {
    #[cfg(target_arch = "x86_64")]
    {
        vec![
            Check {
                name: "amx::the_pass_with_emulated_tiles_matches_the_reference",
                needs: CpuLevel::Avx512Zmm,
                run: x86::pass_on_emulated_tiles,
            },
            Check {
                name: "amx::the_folded_gemm_with_emulated_tiles_matches_the_reference",
                needs: CpuLevel::Avx512Zmm,
                run: x86::folded_gemm_on_emulated_tiles,
            },
            Check {
                name: "amx::the_folded_gemm_on_this_cpus_tiles_matches_the_reference",
                needs: CpuLevel::Amx,
                run: x86::folded_gemm_on_this_cpus_tiles,
            },
        ]
    }
    #[cfg(not(target_arch = "x86_64"))]
    Vec::new()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use crate::amx::{check_emulated, Emulated, Hardware};
    use crate::formats::q4_k_x8::amx::Q4Kx8;
    use crate::formats::q4_k_x8::testing::{check_gemm, q4k};
    use crate::{dot_q4_kx8_q8_k, BlockQ4K, CpuLevel};

    /// Five groups of 8 weight rows of `nb` blocks, from `step` and `modulus`.
    fn rows(nb: usize, step: usize, modulus: usize) -> Vec<BlockQ4K> {
        (0..8 * 5 * nb)
            .map(|i| q4k((i * step % modulus) as u8))
            .collect()
    }

    /// The AMX pass's layout (the weights' tile, the natural activation rows, the sums' tile and
    /// what the vectors make of it), with the tiles emulated: bit for bit the reference for every
    /// row count, an odd last group and a window that cuts groups. The hardware's tiles are tested
    /// against the reference at [`CpuLevel::Amx`] by the level tests where a CPU has them.
    pub(super) fn pass_on_emulated_tiles() {
        assert!(CpuLevel::Avx512Zmm.is_supported(), "the caller checks");
        check_emulated::<Q4Kx8>(&rows(3, 37, 251), 3, dot_q4_kx8_q8_k);
    }

    /// The folded gemm's layout ([`crate::formats::q4_k_x8::amx::gemm`]: weights times the parts
    /// of their scales, four products of depth 64 per block into two sums' tiles), with the tiles
    /// emulated: bit for bit the reference for 1, 2, 3 and 5 slabs of rows (one slab alone, pairs,
    /// pairs and one), an odd last group, a window that cuts groups and an output wider than the
    /// window. Scales of every value 0..63 occur ([`q4k`]'s bytes cover them).
    pub(super) fn folded_gemm_on_emulated_tiles() {
        assert!(CpuLevel::Avx512Zmm.is_supported(), "the caller checks");
        check_gemm(
            &rows(2, 37, 251),
            2,
            &mut Emulated::default(),
            &[16, 32, 48, 80],
        );
    }

    /// The folded gemm on this CPU's tiles.
    pub(super) fn folded_gemm_on_this_cpus_tiles() {
        assert!(CpuLevel::Amx.is_supported(), "the caller checks");
        check_gemm(&rows(3, 41, 253), 3, &mut Hardware, &[16, 32, 48, 64, 80]);
    }
}
