#!/usr/bin/env bash
# The simulator against the real cluster on this machine: each shape (colocated ×1, 1P+1D, 1P+2D,
# 2P+1D, as processes with one kernel thread each) at three rates, on a Poisson workload and on a
# shared-prefix trace, run by `duet bench serve` and simulated by `duet simulate` with the same
# flags from a profile measured here; then the table (bench/planner/prediction_table.py).
#   bench/planner/predict.sh PROFILE OUT_DIR "RATE1 RATE2 RATE3" [REQUESTS]
# PROFILE `fresh`: each shape is simulated from a profile measured just before its runs
# (`duet profile --threads 1`, about a minute, written as OUT_DIR/profile-SHAPE.json): a
# machine whose speed drifts within the quarter hour the runs take is profiled as it runs them.
# CALIBRATE=1 (with `fresh`): a short engine benchmark (bench/planner/speed_ratio.py) runs right
# after each profile and again right before each run; the simulation of that run takes the ratio
# as --compute-scale (the machine's speed now against when it was profiled), written beside it
# as RUN.scale.txt. It uses nothing of the run it predicts.
# ROUNDS=N: the whole table N times over (OUT_DIR/round-1 ... round-N, each with its own fresh
# profiles), and the table compares each cell's median measured value over the rounds with its
# median prediction, beside how far the measured values spread over the rounds: on a machine
# whose speed drifts, that spread is how close any prediction can be expected to come.
# Every run also writes its requests one by one (RUN.bench.requests.jsonl, RUN.sim.requests.jsonl).
# SIMULATE_ONLY=1: measures nothing; simulates again the runs already in OUT_DIR (with `fresh`,
# from the profiles there), with the same flags: the same measured runs, against a changed
# simulator or changed profiles.
set -euo pipefail
profile=$1 out=$2 rates=$3 requests=${4:-120} rounds=${ROUNDS:-1}
duet=${DUET:-target/ci/duet}
mkdir -p "$out"
[ "${SIMULATE_ONLY:-0}" = 1 ] || python3 bench/planner/make_trace.py --requests "$requests" --rate 1 --out "$out/shared-prefix.jsonl"
trace=$out/shared-prefix.jsonl
top=$out
common=(--processes --threads 1 --ttft-slo-ms 2000 --tpot-slo-ms 100 --local-prefill-threshold 32)
shapes=("colocated-1:--launch colocated --decode-workers 1"
        "1P1D:--launch disaggregated --prefill-workers 1 --decode-workers 1"
        "1P2D:--launch disaggregated --prefill-workers 1 --decode-workers 2"
        "2P1D:--launch disaggregated --prefill-workers 2 --decode-workers 1")
for round in $(seq 1 "$rounds"); do
  if [ "$rounds" -gt 1 ]; then out=$top/round-$round; mkdir -p "$out"; echo "== round $round of $rounds" >&2; fi
  for entry in "${shapes[@]}"; do
    name=${entry%%:*}; shape=(${entry#*:})
    shape_profile=$profile
    if [ "$profile" = fresh ]; then
      shape_profile="$out/profile-$name.json"
      echo "== profile for $name" >&2
      [ "${SIMULATE_ONLY:-0}" = 1 ] || "$duet" profile --threads 1 --out "$shape_profile" > "$out/profile-$name.txt"
      if [ "${CALIBRATE:-0}" = 1 ]; then
        python3 bench/planner/speed_ratio.py measure "$duet" "$out/speed-$name.json"
      fi
    fi
    for rate in $rates; do
      for workload in poisson trace; do
        case $workload in
          poisson) load=(--rate "$rate" --requests "$requests" --prompt-tokens 64..256 --output-tokens 16..48 --seed 7);;
          trace) load=(--trace "$trace" --trace-speedup "$rate");;
        esac
        run="$name-$workload-$rate"
        echo "== $run" >&2
        scale=1
        if [ "$profile" = fresh ] && [ "${CALIBRATE:-0}" = 1 ]; then
          python3 bench/planner/speed_ratio.py measure "$duet" "$out/speed-$run.json"
          scale=$(python3 bench/planner/speed_ratio.py ratio "$out/speed-$name.json" "$out/speed-$run.json")
          echo "$scale" > "$out/$run.scale.txt"
        fi
        [ "${SIMULATE_ONLY:-0}" = 1 ] || "$duet" bench serve "${shape[@]}" "${common[@]}" "${load[@]}" --json-out "$out/$run.bench.json" --requests-out "$out/$run.bench.requests.jsonl" > "$out/$run.bench.txt"
        "$duet" simulate --profile "$shape_profile" --compute-scale "$scale" "${shape[@]}" "${common[@]}" "${load[@]}" --json-out "$out/$run.sim.json" --requests-out "$out/$run.sim.requests.jsonl" > "$out/$run.sim.txt"
      done
    done
  done
done
python3 bench/planner/prediction_table.py "$top" | tee "$top/prediction-table.md"
