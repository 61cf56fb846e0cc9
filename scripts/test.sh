#!/usr/bin/env bash
# The whole test suite: the Rust tests, then the server's end-to-end tests (the official openai client,
# a load test, garbage on the wire, graceful shutdown, and the chat page in headless Chromium when
# Chromium and chromedriver are installed; tests that need the real models skip visibly until
# `specdec fetch` has run), and the tests of the benchmark scripts.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --release
# The server tests drive the release binary and the tiny-model writer.
cargo build --release -p specdec --bin specdec
cargo build --release -p specdec-runtime --features testing --example write_tiny
python3 -m pip install --quiet --disable-pip-version-check -r tests/server/requirements.txt
python3 -m pytest -q -rs tests/server tests/scripts
