#!/usr/bin/env bash
# What metrics and tracing cost: `duet bench serve` against `duet up --processes` (router,
# 1 prefill, 1 decode) with and without `--otlp-endpoint` (tests/otlp/receiver.py, counting the
# spans) and `--metrics-listen`, interleaved off/on, REPEATS times each; prints each run's mean
# TTFT and TPOT and the on/off ratios of their means. Needs `cargo build --release --workspace
# --bins`, the default model (`duet model fetch`) and PyPI grpcio + opentelemetry-proto.
# Environment: REPEATS (3), REQUESTS (16), CONCURRENCY (4), PROMPT_TOKENS (256), OUTPUT_TOKENS
# (32), OUT (a temporary directory) for the bench JSON reports.
set -euo pipefail
cd "$(dirname "$0")/.."
REPEATS=${REPEATS:-3} REQUESTS=${REQUESTS:-16} CONCURRENCY=${CONCURRENCY:-4}
PROMPT_TOKENS=${PROMPT_TOKENS:-256} OUTPUT_TOKENS=${OUTPUT_TOKENS:-32}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
duet=./target/release/duet
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_for_line() { # FILE: until FILE has a line
  until [ -s "$1" ]; do sleep 0.2; done
}
python3 tests/otlp/receiver.py >"$OUT/receiver.out" &
receiver=$!
trap 'kill "$receiver" 2>/dev/null || true' EXIT
wait_for_line "$OUT/receiver.out"
otlp_port=$(awk '{print $2}' "$OUT/receiver.out")

run() { # MODE REPEAT
  local router="127.0.0.1:$(free_port)" flags=()
  if [ "$1" = on ]; then
    flags=(--otlp-endpoint "http://127.0.0.1:$otlp_port" --metrics-listen "127.0.0.1:$(free_port)")
  fi
  "$duet" up --processes --listen "$router" "${flags[@]}" >"$OUT/up-$1-$2.out" 2>/dev/null &
  local up_pid=$!
  wait_for_line "$OUT/up-$1-$2.out" # the ready line
  "$duet" bench serve --server "$router" --requests "$REQUESTS" --concurrency "$CONCURRENCY" \
    --prompt-tokens "$PROMPT_TOKENS" --output-tokens "$OUTPUT_TOKENS" --seed "$2" \
    --json-out "$OUT/$1-$2.json" >/dev/null 2>&1
  kill -INT "$up_pid"
  wait "$up_pid" || true
}

for i in $(seq 1 "$REPEATS"); do
  run off "$i"
  run on "$i"
done

python3 - "$OUT" "$REPEATS" <<'PY'
import json, statistics, sys
out, repeats = sys.argv[1], int(sys.argv[2])
def mean(mode, key):
    vals = []
    for i in range(1, repeats + 1):
        run = json.load(open(f"{out}/{mode}-{i}.json"))["runs"][0]
        assert run["failed"] == 0, run["first_error"]
        vals.append(run[key]["mean"])
    return vals
for key in ("ttft_ms", "tpot_ms"):
    off, on = mean("off", key), mean("on", key)
    print(f"{key}: off {' '.join(f'{v:.2f}' for v in off)} | on {' '.join(f'{v:.2f}' for v in on)}"
          f" | ratio on/off of means {statistics.mean(on) / statistics.mean(off):.3f}"
          f" (per pair {' '.join(f'{b / a:.3f}' for a, b in zip(off, on))})")
PY
