#!/usr/bin/env bash
# The run-time planner under bursts, through a real cluster on this machine: etcd, two workers
# that can switch roles (`duet-decode --role-switch on`, one kernel thread each), a router, and
# `duet bench serve --trace` replaying a trace whose rate swings (bench/planner/make_trace.py
# --burst-rate). Each arm is NAME:ROLES:PLANNER: the workers' initial roles (e.g.
# decode,decode or prefill,decode) and whether `duet planner` runs beside them (on: it may
# switch their roles; off: a static placement). Each arm's report, logs and the planner's
# decisions go under OUT/NAME; bench/planner/burst_report.py tabulates and plots them.
#   bench/planner/burst.sh PROFILE TRACE OUT ARM... 
# Environment: TTFT_SLO_MS (1000), TPOT_SLO_MS (50), STEP_TOKENS (128), PERIOD_S (30),
# BURST_WINDOW_S (10), DUET (target/ci/duet).
set -euo pipefail
profile=$1 trace=$2 out=$3
shift 3
duet=${DUET:-target/ci/duet}
bin=$(dirname "$duet")
model=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
ttft=${TTFT_SLO_MS:-1000} tpot=${TPOT_SLO_MS:-50} step=${STEP_TOKENS:-128}
period=${PERIOD_S:-30} window=${BURST_WINDOW_S:-10}
token=burst-bench-token-0123456789abcdef
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
pids=()
# Last started, first stopped: etcd outlives the services that hold leases in it.
stop_all() {
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill "${pids[i]}" 2>/dev/null || true; done
  wait 2>/dev/null || true
  pids=()
}
trap stop_all EXIT
for arm in "$@"; do
  IFS=: read -r name roles planner <<< "$arm"
  dir=$out/$name
  rm -rf "$dir"; mkdir -p "$dir"
  echo "== $name: roles $roles, planner $planner" >&2
  etcd_client=$(free_port) etcd_peer=$(free_port)
  etcd --data-dir "$dir/etcd" --listen-client-urls "http://127.0.0.1:$etcd_client" \
    --advertise-client-urls "http://127.0.0.1:$etcd_client" \
    --listen-peer-urls "http://127.0.0.1:$etcd_peer" > "$dir/etcd.log" 2>&1 &
  pids+=($!)
  membership=(--etcd "http://127.0.0.1:$etcd_client" --cluster burst --cluster-token "$token")
  engine=(--threads 1 --max-step-tokens "$step" --model "$model")
  i=0
  for role in ${roles//,/ }; do
    "$bin/duet-decode" --listen "127.0.0.1:$(free_port)" --role-switch on --initial-role "$role" \
      "${membership[@]}" "${engine[@]}" > "$dir/worker-$i.log" 2>&1 &
    pids+=($!)
    i=$((i + 1))
  done
  router=127.0.0.1:$(free_port) router_metrics=127.0.0.1:$(free_port)
  "$bin/duet-router" --listen "$router" --metrics-listen "$router_metrics" --model "$model" \
    --local-prefill-threshold 32 "${membership[@]}" > "$dir/router.log" 2>&1 &
  pids+=($!)
  # Serving; then a few seconds for every worker's card to reach the router through etcd.
  for _ in $(seq 120); do
    "$duet" health --server "$router" >/dev/null 2>&1 && break
    sleep 1
  done
  sleep 5
  if [ "$planner" = on ]; then
    "$duet" planner --profile "$profile" --router-metrics "http://$router_metrics" \
      "${membership[@]}" "${engine[@]}" --sharing cores --machine-cores 2 \
      --local-prefill-threshold 32 --ttft-slo-ms "$ttft" --tpot-slo-ms "$tpot" \
      --period-s "$period" --poll-interval-s 2 --burst-window-s "$window" --max-workers 2 \
      --decisions-out "$dir/decisions.jsonl" --metrics-listen "127.0.0.1:$(free_port)" \
      > "$dir/planner.log" 2>&1 &
    pids+=($!)
  fi
  date +%s.%N > "$dir/started"
  "$duet" bench serve --server "$router" --model "$model" --trace "$trace" \
    --ttft-slo-ms "$ttft" --tpot-slo-ms "$tpot" --timeline-window-s 10 \
    --json-out "$dir/bench.json" > "$dir/bench.txt" 2> "$dir/bench.err"
  curl -s "http://$router_metrics/metrics" > "$dir/router-metrics.txt" || true
  stop_all
  rm -rf "$dir/etcd"
done
