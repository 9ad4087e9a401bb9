#!/usr/bin/env bash
# One 256-token prompt computed by a prefill worker while its decode worker decodes another
# stream, against the same prompt while the decode worker is idle, measured (1P+1D, processes,
# one kernel thread each) and simulated from PROFILE: the interference between a prefill
# worker and a decode worker on one machine that the simulator does not model.
#   bench/planner/beside_decode.sh PROFILE OUT_DIR [PAIRS]
# Each pair: at 0 ms a 64-token prompt (A) answering 150 tokens (`busy`) or 2 (`idle`), at 150
# ms a 256-token prompt (B) answering 2; pairs 1.5 s apart. Prints, for each arm, B's prefill
# time and TTFT (median, measured / simulated) and A's TPOT; writes the runs' requests to
# OUT_DIR (`--requests-out`) and what each duet thread did in each run (`thread_times.py`:
# CPU, run-queue wait, kernel time, page faults) to OUT_DIR/ARM-ROUND.threads.md. A third arm,
# `idle-bare`, runs the idle trace beside a bare `duet bench engine` decoding on the other core
# (measured only: the simulator knows no bare engine).
set -euo pipefail
profile=$1 out=$2 pairs=${3:-10}
duet=${DUET:-target/ci/duet}
mkdir -p "$out"
for arm in busy idle; do
  python3 - "$arm" "$pairs" "$out/$arm.jsonl" <<'EOF'
import json, sys
arm, pairs, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
a_out = 150 if arm == "busy" else 2
with open(path, "w") as f:
    for i in range(pairs):
        t = i * 1500
        f.write(json.dumps({"timestamp": t, "input_length": 64, "output_length": a_out, "hash_ids": [2 * i]}) + "\n")
        f.write(json.dumps({"timestamp": t + 150, "input_length": 256, "output_length": 2, "hash_ids": [2 * i + 1]}) + "\n")
EOF
done
flags=(--launch disaggregated --prefill-workers 1 --decode-workers 1 --processes --threads 1
       --local-prefill-threshold 32 --ttft-slo-ms 2000 --tpot-slo-ms 100)
here=$(dirname "$0")
# A bare engine decoding at batch 1 until killed (each run 8,000 steps: within the context).
bare_decode() {
  trap 'kill "$child" 2>/dev/null; exit 0' TERM
  while true; do
    "$duet" bench engine --threads 1 --prefill-tokens 16 --decode-steps 8000 --repeats 1 \
      --contexts 64 --batch 1 > /dev/null 2>&1 &
    child=$!
    wait "$child" || return
  done
}
# Alternated twice, so that the machine's drift falls on every arm.
for round in 1 2; do
  for arm in busy idle idle-bare; do
    trace=${arm%-bare}
    bare=
    if [ "$arm" = idle-bare ]; then
      bare_decode & bare=$!
      sleep 3 # the model loaded and decoding
    fi
    python3 "$here/thread_times.py" --out "$out/$arm-$round.threads.md" -- \
      "$duet" bench serve "${flags[@]}" --trace "$out/$trace.jsonl" \
      --json-out "$out/$arm-$round.bench.json" --requests-out "$out/$arm-$round.bench.requests.jsonl" > /dev/null
    if [ -n "$bare" ]; then
      kill "$bare"; wait "$bare" 2>/dev/null || true
    fi
  done
done
for arm in busy idle; do
  "$duet" simulate --profile "$profile" "${flags[@]}" --trace "$out/$arm.jsonl" \
    --json-out "$out/$arm.sim.json" --requests-out "$out/$arm.sim.requests.jsonl" > /dev/null
done
python3 - "$out" <<'EOF'
import json, statistics, sys
out = sys.argv[1]
def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f]
def medians(records):
    b = [r for r in records if r["prompt_tokens"] == 256]
    a = [r for r in records if r["prompt_tokens"] == 64]
    return (statistics.median(r["server_prefill_ms"] for r in b), statistics.median(r["ttft_ms"] for r in b),
            statistics.median(r["tpot_ms"] for r in a), sum(r["server_prefill_local"] for r in records))
print("| arm | round | B prefill ms | B TTFT ms | A TPOT ms | prefilled on the decode worker |")
print("|---|---|---|---|---|---|")
for arm in ("busy", "idle", "idle-bare"):
    for run in ("1", "2") if arm == "idle-bare" else ("1", "2", "sim"):
        path = f"{out}/{arm}.sim.requests.jsonl" if run == "sim" else f"{out}/{arm}-{run}.bench.requests.jsonl"
        p, t, a, local = medians(load(path))
        print(f"| {arm} | {'simulated' if run == 'sim' else 'measured ' + run} | {p:.1f} | {t:.1f} | {a:.2f} | {local} |")
EOF
