#!/usr/bin/env bash
# The main job on a fresh machine: build, fetch the default model, and generate with it.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p duet-cli
./target/release/duet model fetch
./target/release/duet generate --chat --temperature 0 --max-tokens 64 \
  --prompt "${1:-What is the capital of France?}"
