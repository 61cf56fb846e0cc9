#!/usr/bin/env bash
# The kernel tests on an emulated CPU with AVX-512 VNNI (Bochs's Tiger Lake model, through
# scripts/emulated-cpu/run.sh), so that the avx512vnni and avx512zmm kernel levels are tested on
# machines without AVX-512. On a CPU that has it, the ordinary `cargo test` already runs that level natively, and this
# script says so and exits.
#
#   scripts/test-emulated-avx512.sh          # kernel level tests and matmul tests (a few minutes)
#   scripts/test-emulated-avx512.sh --all    # also whole tiny models at every level (+5 minutes)
#
# Needs root for apt-get (bochs, busybox-static, isolinux, xorriso) on the first run.
set -euo pipefail
cd "$(dirname "$0")/.."

if grep -qw avx512_vnni /proc/cpuinfo && grep -qw avx512vl /proc/cpuinfo; then
    echo "this CPU has AVX-512 VNNI: cargo test runs the avx512 levels natively; nothing to emulate"
    exit 0
fi

# Static binaries: the guest has no shared libraries.
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}/emulated
export RUSTFLAGS="-C target-feature=+crt-static"
target=x86_64-unknown-linux-gnu
tests=(--test levels --test matmul)
build_log=$(mktemp)
trap 'rm -f "$build_log"' EXIT
# The build's output goes to our stderr as it comes (through the inherited descriptor: reopening
# /dev/stderr would truncate a log file it points to) and to a file, where `cargo test --no-run`
# names each test executable.
cargo test --locked --release -p specdec-kernels "${tests[@]}" --no-run --target "$target" 2>&1 |
    tee "$build_log" >&2
if [ "${1:-}" = "--all" ]; then
    cargo test --locked --release -p specdec-runtime --features testing --test tiny_models \
        --no-run --target "$target" 2>&1 | tee -a "$build_log" >&2
fi
mapfile -t bins < <(sed -n 's/.*Executable tests\/[a-z_]*\.rs (\(.*\))$/\1/p' "$build_log")
[ "${#bins[@]}" -gt 0 ] || { echo "no test binaries built" >&2; exit 1; }

status=0
for bin in "${bins[@]}"; do
    args=(--color never)
    expect=()
    case "$(basename "$bin")" in
    levels-*)
        expect=('avx512vnni::matches_the_scalar_reference_for_every_m *\.\.\. ok'
            'avx512zmm-k::matches_the_scalar_reference_for_every_m *\.\.\. ok'
            'avx512zmm::matches_the_scalar_reference_for_every_m *\.\.\. ok'
            'amx::the_pass_with_emulated_tiles_matches_the_reference *\.\.\. ok'
            'amx::the_folded_gemm_with_emulated_tiles_matches_the_reference *\.\.\. ok')
        ;;
    tiny_models-*)
        # The test that compares the logits of every level; the others run natively anyway.
        args+=(every_kernel_level_gives_the_same_logits --exact --nocapture)
        expect=('compared kernel levels: .*"avx512vnni", "avx512zmm-k", "avx512zmm"')
        ;;
    esac
    echo "=== $(basename "$bin") ${args[*]} on the emulated CPU"
    out=$(mktemp)
    if ! scripts/emulated-cpu/run.sh "$bin" "${args[@]}" 2>&1 | tee "$out"; then
        status=1
    fi
    # The levels must have run, not been reported as ignored.
    for e in "${expect[@]}"; do
        if ! grep -q "$e" "$out"; then
            echo "an avx512 level did not run on the emulated CPU (no line matching '$e')" >&2
            status=1
        fi
    done
    rm -f "$out"
done
exit "$status"
