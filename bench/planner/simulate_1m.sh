#!/usr/bin/env bash
# The simulator's own speed: 1,000,000 requests of a chat-like workload on a 64-worker cluster
# (32 prefill + 32 decode GPUs of the H200 profile), timed end to end (loading the profile,
# drawing the workload, simulating, summarising), wall and CPU time (the dev machine is shared:
# its CPU time is what the simulation costs). The router's in-flight limit is lifted so that every
# request is served, not shed. The issue's bound: 60 s on the 2-core dev machine.
#   bench/planner/simulate_1m.sh [RATE] [REQUESTS]
set -euo pipefail
rate=${1:-900} requests=${2:-1000000}
duet=${DUET:-target/ci/duet}
start=$(date +%s.%N)
/usr/bin/time -f "CPU: %U s user, %S s system, %M KiB peak" "$duet" simulate --profile bench/results/planner/profile-h200-llama3-8b.json --device cuda \
  --kv-transport cuda-ipc --launch disaggregated --prefill-workers 32 --decode-workers 32 \
  --max-step-tokens 2048 --rate "$rate" --requests "$requests" --max-queued-requests 10000000 --prompt-tokens 128..1024 \
  --output-tokens 32..256 --ttft-slo-ms 2000 --tpot-slo-ms 100 --seed 1 > /dev/null
end=$(date +%s.%N)
echo "$requests requests on 64 workers simulated in $(echo "$end - $start" | bc) s (wall, whole command)"
