//! CPU feature dispatch: which SIMD level the kernels use, chosen once per process.

use crate::KernelError;
use std::sync::OnceLock;

/// The environment variable that overrides the detected level: `scalar`, `avx2`, `avx512vnni`,
/// `avx512zmm-k`, `avx512zmm`, `amx` or `auto`.
pub const LEVEL_ENV: &str = "SPECDEC_KERNELS";

/// A kernel implementation level. Every level returns bit-identical results; they differ in speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CpuLevel {
    /// Portable Rust, the reference.
    Scalar,
    /// x86-64 AVX2, F16C and FMA (`maddubs`/`madd` integer dot products; fused multiply-adds in
    /// attention).
    Avx2,
    /// [`CpuLevel::Avx2`] with the integer dot products of AVX-512 VNNI on 256-bit vectors
    /// (`vpdpbusd`, `vpdpwssd`; needs AVX512F, AVX512VL and AVX512_VNNI): the same integer lanes in
    /// fewer instructions per activation row.
    Avx512Vnni,
    /// [`CpuLevel::Avx512Vnni`] with the interleaved K-quant passes (Q4_K, Q6_K) of 4 or more rows
    /// (of any row count on AMD's EPYC Zen 5, stop 78) on 512-bit vectors (needs AVX512BW besides): two groups of 8 weight rows side by side, so
    /// one `vpdpbusd` does the work of two; attention on 512-bit vectors too. The same integer
    /// lanes and float operations per weight row as the other levels. Zen 4 executes a 512-bit
    /// operation as two 256-bit halves, yet these passes still pay there: fewer instructions and
    /// loads per product (stop 41, `rcurve 2 8960` with 48 copies of the matrix on an EPYC Zen 4, 2
    /// alternations: Q4_K 334–335 against 263–299 GMAC/s, r(16) 2.99–3.05 against 3.45–3.54; Q6_K
    /// r(16) 2.54–2.64 against 2.93–2.95), where the 32-value formats' 512-bit passes lose (Q4_0
    /// 201–230 against 271–273 GMAC/s, Q5_0 200–203 against 260). On AMD's EPYC Zen 5, whose
    /// 512-bit operations run at full width, the 32-value formats' passes of 6 or more rows take
    /// 512-bit vectors too (stop 76: Q4_0 399–463 against 287–329 GMAC/s). The best level detected
    /// where [`full_width_512`] is false.
    Avx512ZmmK,
    /// [`CpuLevel::Avx512ZmmK`] with the interleaved 32-value formats (Q4_0, Q5_0) on 512-bit
    /// vectors too, and the K-quants' from 6 rows (Intel's count). Detected as the best level only
    /// on Intel ([`full_width_512`]); AMD's EPYC Zen 5 gets the 32-value formats' 512-bit passes at
    /// [`CpuLevel::Avx512ZmmK`].
    Avx512Zmm,
    /// [`CpuLevel::Avx512Zmm`] with the interleaved Q4_K passes of [`crate::AMX_FROM_ROWS`] rows on
    /// Intel's AMX tiles (needs AMX-TILE and AMX-INT8, and an operating system that lets the
    /// process use the tiles: Linux 5.16 or later, asked once with `arch_prctl`): per pair of
    /// groups and sub-block, one `tdpbsud` multiplies the pass's activation rows by 16 weight rows,
    /// and 512-bit vectors unpack the weights and do the scales and the float arithmetic as at
    /// [`CpuLevel::Avx512Zmm`], so the results are the same bits. Never detected, only asked for
    /// (`SPECDEC_KERNELS=amx`): on a 16-core Xeon with AMX (stop 54, 2 threads, a 1536 × 8960
    /// matrix) its passes took a median 1.36 times as long as the 512-bit ones up to 8 rows and
    /// 0.95 times from 9 to 16; verification blocks of a model were no faster, a 64-token prefill
    /// was (see [`crate::AMX_FROM_ROWS`]). Interleaved Q4_K matmuls of
    /// [`crate::AMX_GEMM_FROM_ROWS`] rows or more (stop 63) run their whole slabs of 16 rows as a
    /// gemm on the tiles, each block's weights unpacked and multiplied by their scales once for
    /// all rows: a 256-row matmul at a median 1.23 times the 512-bit passes' rate, a model's
    /// prefill not measurably faster (see the `amx` module).
    Amx,
}

/// Whether [`CpuLevel::detect`] picks [`CpuLevel::Avx512Zmm`]: where 512-bit vector operations run
/// at full width and the level's row counts were measured. Intel's AVX-512 cores run them so
/// (measured on a Xeon with AVX-512 VNNI, stop 33: `vpdpbusd` on `zmm` at the same instruction rate
/// as on `ymm`, twice the products); AMD's Zen 4 executes each as two 256-bit halves, and there
/// [`CpuLevel::Avx512ZmmK`] is the best level. AMD's EPYC Zen 5 runs them at full width (stop 76)
/// but keeps [`CpuLevel::Avx512ZmmK`], with the 32-value formats' 512-bit passes added there and
/// the K-quant ones run from one row (stop 78). Other vendors are not measured, so they get
/// [`CpuLevel::Avx512ZmmK`] too unless `SPECDEC_KERNELS` asks for another.
pub fn full_width_512() -> bool {
    vendor() == *b"GenuineIntel"
}

/// Whether this is an AMD EPYC Zen 5 (family 0x1a, models 0x00–0x1f: Turin and Turin dense), whose
/// 512-bit operations run at full width, so that [`CpuLevel::Avx512ZmmK`] runs the 32-value
/// formats' passes of [`crate::simd::ZMM_FROM_ROWS`] rows or more (Intel's count, not measured
/// here) on 512-bit vectors too. The mobile Zen 5 cores (Strix Point and later models of the
/// family) run 512-bit operations on 256-bit datapaths, as Zen 4 does, and later families are not
/// measured, so they keep the 256-bit pass. Measured on a 2-core EPYC Zen 5 (model 0x02, stop 76):
/// `vpdpbusd` at 6.7–6.9 G instructions a second per core on `zmm` against 6.9–7.1 on `ymm`;
/// `rcurve 2 4864` with 896 columns, 3 alternations, Q4_0 399–463 GMAC/s on the 512-bit pass
/// against 287–329 on the 256-bit one (Q5_0 371–441 against 271–310), r(16) 7.5–8.1 against
/// 8.8–12.2; the draft model's 200-token blocks (`step_time`) 336–351 ms against 415–564. Its
/// K-quant passes run on 512-bit vectors from one row (stop 78, `simd::zmm_k_from_rows`), and Zen
/// 4 keeps the 256-bit passes for the 32-value formats (stop 41's measurement there was made before
/// stop 76 let the 512-bit pass broadcast its activations from memory; not measured since).
/// Detected once.
pub(crate) fn amd_full_width_512() -> bool {
    static FULL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FULL.get_or_init(|| {
        vendor() == *b"AuthenticAMD" && matches!(family_model(), (0x1a, 0x00..=0x1f))
    })
}

/// Whether this CPU's hardware prefetchers keep up on their own with a single-row pass of the
/// K-quant formats (Q4_K, Q6_K), which reads its weights in order, so that the pass asks for none
/// ahead: true on AMD from Zen 4. Measured on a 2-core EPYC (Zen 4, stop 43), a 1536 × 8960
/// matrix read from memory: Q4_K at 31–34 GB/s without the software prefetch against 28–33 with it, and 46.5 against
/// 36.8 while a plain read loop ran at 55 (the prefetches compete with the hardware's own stream);
/// Q6_K likewise once its quants were stored in reading order ([`crate::BlockQ6Kx8::q`]). Target
/// steps took 4–7% less (`step_time`, 6 alternations, contexts 200 and 2,000), 24% less in
/// `bench --cost-curve` where the machine's read bandwidth was high. Since stop 45 passes of 2 rows
/// leave it to the hardware too (2-token target blocks 11% cheaper where memory was fast, 2–3%
/// where slow, once stop 44's pool let each thread read one region; see `UNAIDED_ROWS` in
/// `simd.rs`); passes of 3 or more rows keep their prefetch, the 512-bit pass too (it reads a
/// pair of groups as two streams: 4-token blocks 35 → 49 ms without), and so do the 32-value
/// formats (draft steps 1–5% slower without). On a 16-core Xeon with AMX the single-row Q4_K pass
/// without it read at 13–16 GB/s against 21–24 (the hardware there follows no stream past a page),
/// as stop 40's Xeon had shown for whole steps. AMD's cores before Zen 4 keep the software
/// prefetch: on a 2-core EPYC Zen 3 (stop 61, `step_time` on the 1.5B target with the two ways
/// taking turns step by step in one run, contexts 100–1,500) 2-token blocks took 6–10% less with it
/// (68.5 → 63.7, 66.7 → 62.2, 66.6 → 62.5, 76.0 → 68.3, 70.7 → 66.3, 67.7 → 61.6 ms) and single
/// steps 2–6% less in five of six runs (60.7 → 59.3, 61.8 → 60.4, 68.7 → 65.2, 60.8 → 57.4, 64.8 →
/// 63.4 ms; one 61.6 → 62.0); blocks of 3 to 16 rows −7% to +4%, no direction. Zen 5 and later are
/// taken to be as Zen 4 (not measured). Detected once.
pub(crate) fn streams_unaided() -> bool {
    static UNAIDED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *UNAIDED.get_or_init(|| vendor() == *b"AuthenticAMD" && amd_zen4_or_later(family_model()))
}

/// Whether an AMD CPU of this (family, model) is a Zen 4 core or newer: family 0x19 (Zen 3 and
/// Zen 4) models 0x10–0x1f (Genoa), 0x60–0x7f (Raphael, Phoenix) and 0xa0–0xaf (Bergamo, Siena);
/// any later family (Zen 5 is 0x1a).
fn amd_zen4_or_later((family, model): (u32, u32)) -> bool {
    match family {
        0x19 => matches!(model, 0x10..=0x1f | 0x60..=0x7f | 0xa0..=0xaf),
        f => f > 0x19,
    }
}

/// The CPU's display family and model ([`decode_family_model`] of `cpuid` leaf 1); zeros off
/// x86-64.
fn family_model() -> (u32, u32) {
    #[cfg(target_arch = "x86_64")]
    {
        decode_family_model(std::arch::x86_64::__cpuid(1).eax)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        (0, 0)
    }
}

/// The display family and model of `cpuid` leaf 1's EAX: the extended family added where the base
/// family is 0xf, the extended model prefixed where it is 0x6 or 0xf.
fn decode_family_model(eax: u32) -> (u32, u32) {
    let base_family = (eax >> 8) & 0xf;
    let family = if base_family == 0xf {
        base_family + ((eax >> 20) & 0xff)
    } else {
        base_family
    };
    let model = if base_family == 0x6 || base_family == 0xf {
        ((eax >> 12) & 0xf0) | ((eax >> 4) & 0xf)
    } else {
        (eax >> 4) & 0xf
    };
    (family, model)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amd_cores_from_zen_4_are_told_from_earlier_ones() {
        // EPYC 7763 (Milan, Zen 3), EPYC 9654 (Genoa, Zen 4), Ryzen 7950X (Raphael, Zen 4),
        // EPYC 7742 (Rome, Zen 2), a Zen 5 and a Sapphire Rapids Xeon's leaf 1.
        let milan = decode_family_model(0x00a0_0f11);
        assert_eq!(milan, (0x19, 0x01));
        assert!(!amd_zen4_or_later(milan));
        assert!(amd_zen4_or_later(decode_family_model(0x00a1_0f11)));
        assert!(amd_zen4_or_later(decode_family_model(0x00a6_0f12)));
        let rome = decode_family_model(0x0083_0f10);
        assert_eq!(rome, (0x17, 0x31));
        assert!(!amd_zen4_or_later(rome));
        assert!(amd_zen4_or_later(decode_family_model(0x00b4_0f40)));
        assert_eq!(decode_family_model(0x0008_06f8), (6, 0x8f));
    }
}

/// The CPU's vendor string (`cpuid` leaf 0: EBX, EDX, ECX); zeros off x86-64.
fn vendor() -> [u8; 12] {
    #[cfg(target_arch = "x86_64")]
    {
        let id = std::arch::x86_64::__cpuid(0);
        let mut v = [0u8; 12];
        for (i, r) in [id.ebx, id.edx, id.ecx].iter().enumerate() {
            v[4 * i..4 * i + 4].copy_from_slice(&r.to_le_bytes());
        }
        v
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        [0; 12]
    }
}

impl CpuLevel {
    /// Every level, lowest first.
    pub const ALL: [CpuLevel; 6] = [
        CpuLevel::Scalar,
        CpuLevel::Avx2,
        CpuLevel::Avx512Vnni,
        CpuLevel::Avx512ZmmK,
        CpuLevel::Avx512Zmm,
        CpuLevel::Amx,
    ];

    /// The best level this CPU supports ([`CpuLevel::Avx512Zmm`] only where [`full_width_512`],
    /// else [`CpuLevel::Avx512ZmmK`]; never [`CpuLevel::Amx`], which is not faster).
    pub fn detect() -> CpuLevel {
        CpuLevel::ALL
            .into_iter()
            .rev()
            .filter(|&l| l != CpuLevel::Amx)
            .filter(|&l| l != CpuLevel::Avx512Zmm || full_width_512())
            .find(|l| l.is_supported())
            .unwrap_or(CpuLevel::Scalar)
    }

    /// Whether the level includes AVX2, F16C and FMA, so that code outside the matmul (the runtime's
    /// attention) may take its AVX2 path.
    pub fn has_avx2(self) -> bool {
        matches!(
            self,
            CpuLevel::Avx2
                | CpuLevel::Avx512Vnni
                | CpuLevel::Avx512ZmmK
                | CpuLevel::Avx512Zmm
                | CpuLevel::Amx
        )
    }

    /// Whether the level runs the K-quant passes of several rows (6 or more on Intel, 4 or more on
    /// AMD) and attention on 512-bit vectors.
    pub fn has_zmm(self) -> bool {
        matches!(
            self,
            CpuLevel::Avx512ZmmK | CpuLevel::Avx512Zmm | CpuLevel::Amx
        )
    }

    /// Whether this CPU can run the level.
    pub fn is_supported(self) -> bool {
        match self {
            CpuLevel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            CpuLevel::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("f16c")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            CpuLevel::Avx512Vnni => {
                CpuLevel::Avx2.is_supported()
                    && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "x86_64")]
            CpuLevel::Avx512ZmmK | CpuLevel::Avx512Zmm => {
                CpuLevel::Avx512Vnni.is_supported()
                    && std::arch::is_x86_feature_detected!("avx512bw")
            }
            #[cfg(target_arch = "x86_64")]
            CpuLevel::Amx => CpuLevel::Avx512Zmm.is_supported() && crate::amx::available(),
            #[cfg(not(target_arch = "x86_64"))]
            CpuLevel::Avx2
            | CpuLevel::Avx512Vnni
            | CpuLevel::Avx512ZmmK
            | CpuLevel::Avx512Zmm
            | CpuLevel::Amx => false,
        }
    }

    /// The CPU features the level needs, for messages.
    pub fn features(self) -> &'static str {
        match self {
            CpuLevel::Scalar => "nothing",
            CpuLevel::Avx2 => "x86-64 with AVX2, F16C and FMA",
            CpuLevel::Avx512Vnni => {
                "x86-64 with AVX2, F16C, FMA, AVX512F, AVX512VL and AVX512_VNNI"
            }
            CpuLevel::Avx512ZmmK | CpuLevel::Avx512Zmm => {
                "x86-64 with AVX2, F16C, FMA, AVX512F, AVX512VL, AVX512BW and AVX512_VNNI"
            }
            CpuLevel::Amx => {
                "x86-64 with AVX2, F16C, FMA, AVX512F, AVX512VL, AVX512BW, AVX512_VNNI, AMX-TILE and \
                 AMX-INT8, and an operating system that lets the process use the tiles"
            }
        }
    }

    /// The levels this CPU supports, lowest first (what tests compare against each other).
    pub fn supported() -> Vec<CpuLevel> {
        CpuLevel::ALL
            .into_iter()
            .filter(|l| l.is_supported())
            .collect()
    }

    /// The level's name, as accepted by [`CpuLevel::parse`] and [`LEVEL_ENV`].
    pub fn name(self) -> &'static str {
        match self {
            CpuLevel::Scalar => "scalar",
            CpuLevel::Avx2 => "avx2",
            CpuLevel::Avx512Vnni => "avx512vnni",
            CpuLevel::Avx512ZmmK => "avx512zmm-k",
            CpuLevel::Avx512Zmm => "avx512zmm",
            CpuLevel::Amx => "amx",
        }
    }

    /// Parses a level name; `auto` means [`CpuLevel::detect`].
    pub fn parse(name: &str) -> Result<CpuLevel, KernelError> {
        match name.trim().to_ascii_lowercase().as_str() {
            "scalar" => Ok(CpuLevel::Scalar),
            "avx2" => Ok(CpuLevel::Avx2),
            "avx512vnni" => Ok(CpuLevel::Avx512Vnni),
            "avx512zmm-k" => Ok(CpuLevel::Avx512ZmmK),
            "avx512zmm" => Ok(CpuLevel::Avx512Zmm),
            "amx" => Ok(CpuLevel::Amx),
            "auto" | "" => Ok(CpuLevel::detect()),
            _ => Err(KernelError::UnknownLevel {
                name: name.to_owned(),
            }),
        }
    }
}

/// The kernels at one [`CpuLevel`]: the entry point for [`Kernels::matmul`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernels {
    level: CpuLevel,
}

impl Kernels {
    /// The process-wide kernels: [`LEVEL_ENV`] if it is set, valid and supported by this CPU, else the
    /// detected level. Decided on the first call and cached; use [`Kernels::from_env`] to see why an
    /// override was refused.
    pub fn get() -> Kernels {
        static KERNELS: OnceLock<Kernels> = OnceLock::new();
        *KERNELS.get_or_init(|| {
            Kernels::from_env().unwrap_or(Kernels {
                level: CpuLevel::detect(),
            })
        })
    }

    /// Reads [`LEVEL_ENV`] now (not cached): the named level, or the detected one when the variable is
    /// unset.
    ///
    /// # Errors
    /// [`KernelError::UnknownLevel`] for an unknown name, [`KernelError::UnsupportedLevel`] when this CPU
    /// cannot run the named level.
    pub fn from_env() -> Result<Kernels, KernelError> {
        match std::env::var(LEVEL_ENV) {
            Ok(name) => Kernels::with_level(CpuLevel::parse(&name)?),
            Err(_) => Ok(Kernels {
                level: CpuLevel::detect(),
            }),
        }
    }

    /// The kernels at an explicit level.
    ///
    /// # Errors
    /// [`KernelError::UnsupportedLevel`] when this CPU cannot run it.
    pub fn with_level(level: CpuLevel) -> Result<Kernels, KernelError> {
        if level.is_supported() {
            Ok(Kernels { level })
        } else {
            Err(KernelError::UnsupportedLevel {
                level: level.name(),
                needs: level.features(),
            })
        }
    }

    /// The level these kernels run at.
    pub fn level(&self) -> CpuLevel {
        self.level
    }
}
