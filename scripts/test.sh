#!/usr/bin/env bash
# The whole test suite: the Rust tests, then the server's end-to-end tests (the official openai client,
# a load test, garbage on the wire, graceful shutdown, and the chat page in headless Chromium when
# Chromium and chromedriver are installed; tests that need the real models skip visibly until
# `specdec fetch` has run), and the tests of the benchmark scripts. The GPU tests run where
# there is an NVIDIA GPU and are reported as ignored elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --release
# The GPU path's tests: on a machine without an NVIDIA GPU they are reported as ignored, with the
# reason (SPECDEC_REQUIRE_GPU=1 makes that a failure, for a machine that has one); its host-side
# unit tests (the f16 weights) run everywhere.
cargo test --release -p specdec-runtime --features cuda --lib --test cuda --test tiny_models
# The server tests drive the release binary and the tiny-model writer.
cargo build --release -p specdec --bin specdec
cargo build --release -p specdec-runtime --features testing --example write_tiny
python3 -m pip install --quiet --disable-pip-version-check -r tests/server/requirements.txt
python3 -m pytest -q -rs tests/server tests/scripts
