#!/usr/bin/env bash
# Speculative decoding (n-gram) against decoding one token per step, on the default model: `duet
# bench serve` on a colocated cluster (router + one worker, launched per run) for two workloads —
# copy edits (spelling and typo fixes of paragraphs, whose answers copy the prompt's text:
# bench/workloads/copy-edits.jsonl) and free chat (bench/workloads/free-chat.jsonl) — at
# concurrency 1 and 8, speculation off and on in turn (the order alternating by round), ROUNDS
# rounds. Greedy, so both modes
# generate the same tokens. Prints the median over rounds of each cell and the ratio on/off, and
# writes every run's report and the summary under OUT.
#
#   bench/speculative.sh [OUT=bench/results/speculative] [ROUNDS=4] [extra `bench serve` flags]
#
# SPECULATIVE (default ngram) is the mode compared with off, e.g. draft:models/small.gguf (its runs
# are named "draft"); CONCURRENCY (default "1 8") the concurrencies run.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/speculative}
rounds=${2:-4}
shift $(($# < 2 ? $# : 2))
speculative=${SPECULATIVE:-ngram}
label=${speculative%%:*}
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for workload in copy-edits free-chat; do
    for concurrency in ${CONCURRENCY:-1 8}; do
      # ABBA: a run after a heavy one starts slower, so the order alternates by round.
      modes="off $label"
      [ $((round % 2)) = 0 ] && modes="$label off"
      for mode in $modes; do
        flag=off
        [ "$mode" = off ] || flag=$speculative
        echo "round $round: $workload, concurrency $concurrency, speculative $flag" >&2
        ./target/release/duet bench serve --launch colocated \
          --dataset "bench/workloads/$workload.jsonl" --requests $((concurrency * 10 > 20 ? concurrency * 10 : 20)) \
          --concurrency "$concurrency" --speculative "$flag" "$@" \
          --json-out "$out/$workload-c$concurrency-$mode-r$round.json" >/dev/null 2>&1
      done
    done
  done
done
python3 - "$out" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
cells = {}
for path in sorted(glob.glob(os.path.join(out, "*-r*.json"))):
    name = os.path.basename(path).rsplit("-r", 1)[0]
    workload, rest = name.rsplit("-c", 1)
    concurrency, mode = rest.split("-")
    run = json.load(open(path))["runs"][0]
    cells.setdefault((workload, int(concurrency), mode), []).append(run)
summary = []
print(f"{'workload':<11} {'conc':>4} {'mode':<6} {'out tok/s':>9} {'TPOT ms':>8} {'accept':>7} {'tok/step':>8} {'tok/s on/off':>12} {'TPOT off/on':>11}")
for (workload, concurrency, mode), runs in sorted(cells.items()):
    med = lambda f: statistics.median(f(r) for r in runs)
    row = {
        "workload": workload, "concurrency": concurrency, "speculative": mode, "rounds": len(runs),
        "output_tokens_per_s": med(lambda r: r["output_tokens_per_s"]),
        "tpot_ms_mean": med(lambda r: r["tpot_ms"]["mean"]),
        "acceptance_rate": med(lambda r: r["speculation"]["acceptance_rate"]),
        "tokens_per_step": med(lambda r: r["speculation"]["tokens_per_step"]),
    }
    off = cells.get((workload, concurrency, "off"))
    if mode != "off" and off:
        # Ratios round by round (each pair ran back to back), then their median.
        row["tokens_per_s_ratio"] = statistics.median(
            r["output_tokens_per_s"] / o["output_tokens_per_s"] for r, o in zip(runs, off))
        row["tpot_speedup"] = statistics.median(
            o["tpot_ms"]["mean"] / r["tpot_ms"]["mean"] for r, o in zip(runs, off))
    summary.append(row)
    print(f"{workload:<11} {concurrency:>4} {mode:<6} {row['output_tokens_per_s']:>9.1f} {row['tpot_ms_mean']:>8.2f} "
          f"{row['acceptance_rate']:>7.0%} {row['tokens_per_step']:>8.2f} "
          f"{row.get('tokens_per_s_ratio', float('nan')):>11.2f}× {row.get('tpot_speedup', float('nan')):>10.2f}×")
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
PY
