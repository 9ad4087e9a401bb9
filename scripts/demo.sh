#!/usr/bin/env bash
# The main job on a fresh machine: build, fetch the default model, start a cluster on loopback
# (`duet up`: router + 1 prefill + 1 decode worker), and send it a sample Generate call.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --workspace --bins
./target/release/duet model fetch
listen="${DUET_ROUTER_LISTEN:-127.0.0.1:50051}"
log="$(mktemp)"
./target/release/duet up --listen "$listen" >"$log" 2>&1 &
up_pid=$!
trap 'kill $up_pid 2>/dev/null; wait $up_pid 2>/dev/null; rm -f "$log"' EXIT
until grep -q "is ready" "$log"; do
  if ! kill -0 $up_pid 2>/dev/null; then cat "$log"; exit 1; fi
  sleep 0.5
done
grep "is ready" "$log"
./target/release/duet generate --server "$listen" --chat --temperature 0 --max-tokens 64 \
  --prompt "${1:-What is the capital of France?}"
