//! `SPECDEC_KERNELS=scalar` forces the portable path (its own test binary: the level is cached per
//! process, and no other test here may run first).

use specdec_kernels::{CpuLevel, KernelError, Kernels, LEVEL_ENV};

#[test]
fn the_environment_forces_the_scalar_level() {
    // SAFETY-free in edition 2021; this binary has a single test, so no thread reads the environment
    // concurrently.
    std::env::set_var(LEVEL_ENV, "scalar");
    assert_eq!(Kernels::get().level(), CpuLevel::Scalar);
    assert_eq!(Kernels::from_env().unwrap().level(), CpuLevel::Scalar);
    std::env::set_var(LEVEL_ENV, "bogus");
    assert!(matches!(
        Kernels::from_env(),
        Err(KernelError::UnknownLevel { .. })
    ));
    // The process-wide choice was made once and stays.
    assert_eq!(Kernels::get().level(), CpuLevel::Scalar);
}
