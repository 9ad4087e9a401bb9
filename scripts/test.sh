#!/usr/bin/env bash
# The test suite: unit, golden and integration tests of the whole workspace, in release mode
# (the golden tests run the real default model). Fetches the default model first if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --workspace --bins
./target/release/duet model fetch
cargo test --release --locked --workspace
