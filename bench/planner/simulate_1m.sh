#!/usr/bin/env bash
# The simulator's own speed: 1,000,000 requests of a chat-like workload on a 64-worker cluster
# (32 prefill + 32 decode GPUs of the H200 profile), timed end to end (loading the profile,
# drawing the workload, simulating, summarising). The issue's bound: 60 s on the 2-core dev
# machine.
#   bench/planner/simulate_1m.sh [RATE]
set -euo pipefail
rate=${1:-900}
duet=${DUET:-target/ci/duet}
start=$(date +%s.%N)
"$duet" simulate --profile bench/results/planner/profile-h200-llama3-8b.json --device cuda \
  --kv-transport cuda-ipc --launch disaggregated --prefill-workers 32 --decode-workers 32 \
  --max-step-tokens 2048 --rate "$rate" --requests 1000000 --prompt-tokens 128..1024 \
  --output-tokens 32..256 --ttft-slo-ms 2000 --tpot-slo-ms 100 --seed 1
end=$(date +%s.%N)
echo "1,000,000 requests on 64 workers simulated in $(echo "$end - $start" | bc) s (wall, whole command)"
