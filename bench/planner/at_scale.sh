#!/usr/bin/env bash
# DistServe's question at scale, by simulation from the H200 profile of a Llama-3-8B-shaped model
# (bench/results/planner/profile-h200-llama3-8b.json, derived by bench/planner/h200_profile.py):
# for MLPerf's Llama-3.1-8B server SLOs (TTFT 2 s, TPOT 100 ms at p99) and interactive SLOs
# (500 ms, 30 ms), on a chat-like and a long-prompt workload, `duet plan` over units of up to 8
# GPUs (each unit's goodput found once; 8, 16 and 64 GPUs hold whole replicas of a unit); then the
# per-GPU goodput of the best disaggregated placement against the best colocated one, and the
# goodput of 8, 16 and 64 GPUs (bench/planner/at_scale_table.py).
#   bench/planner/at_scale.sh OUT_DIR [REQUESTS]
set -euo pipefail
out=$1 requests=${2:-3000}
duet=${DUET:-target/ci/duet}
profile=bench/results/planner/profile-h200-llama3-8b.json
mkdir -p "$out"
slos=("server:--ttft-slo-ms 2000 --tpot-slo-ms 100" "interactive:--ttft-slo-ms 500 --tpot-slo-ms 30")
workloads=("chat:--prompt-tokens 128..2048 --output-tokens 64..512"
           "long-prompt:--prompt-tokens 4096..8192 --output-tokens 64..256")
for s in "${slos[@]}"; do
  for w in "${workloads[@]}"; do
    name="${s%%:*}-${w%%:*}"
    echo "== $name" >&2
    # shellcheck disable=SC2086
    "$duet" plan --profile "$profile" --device cuda --kv-transport cuda-ipc \
      --devices 64 --max-unit-devices 8 --step-tokens 2048,8192 \
      --attainment 0.99 --iterations 5 --rate 4 --requests "$requests" --seed 3 \
      ${s#*:} ${w#*:} --json-out "$out/$name.json" --plot-out "$out/$name.svg" > "$out/$name.txt"
  done
done
python3 bench/planner/at_scale_table.py "$out" | tee "$out/at-scale-table.md"
