#!/usr/bin/env python3
"""The prediction table: for each (shape, workload, rate), `duet simulate`'s p50 and p90 TTFT and
TPOT against `duet bench serve`'s on the same flags, with the relative error of each, and the
median and worst error over all of them. Reads the JSON pairs predict.sh wrote.

  prediction_table.py DIR

DIR holds the pairs of one round, or `round-N/` folders (predict.sh with ROUNDS=N): then each
cell compares the median over the rounds of the measured values with the median of the
predicted ones, and the table adds how far the measured values themselves spread over the
rounds ((max - min) / median): on a machine whose speed drifts, no prediction can be expected
closer than the same run repeated."""
import glob
import json
import os
import statistics
import sys

METRICS = [("ttft_ms", "p50"), ("ttft_ms", "p90"), ("tpot_ms", "p50"), ("tpot_ms", "p90")]


def load_round(root):
    """{run name: (measured run, simulated run)} of one round's folder."""
    pairs = {}
    for bench_path in sorted(glob.glob(os.path.join(root, "*.bench.json"))):
        name = os.path.basename(bench_path)[: -len(".bench.json")]
        sim_path = os.path.join(root, name + ".sim.json")
        if not os.path.exists(sim_path):
            continue
        with open(bench_path) as b, open(sim_path) as s:
            pairs[name] = (json.load(b)["runs"][0], json.load(s)["runs"][0])
    return pairs


def error(measured, predicted):
    return abs(predicted - measured) / measured * 100 if measured > 0 else 0.0


def main(root):
    rounds = sorted(glob.glob(os.path.join(root, "round-*")))
    rounds = [load_round(r) for r in rounds] if rounds else [load_round(root)]
    names = sorted(set().union(*rounds))
    many = len(rounds) > 1
    rows, errors, spreads, within = [], [], [], 0
    for name in names:
        pairs = [r[name] for r in rounds if name in r]
        cells, row_spread = [], 0.0
        for metric, q in METRICS:
            measured = [b[metric][q] for b, _ in pairs]
            predicted = [s[metric][q] for _, s in pairs]
            m, p = statistics.median(measured), statistics.median(predicted)
            err = error(m, p)
            errors.append(err)
            cells.append(f"{m:.1f} / {p:.1f} ({err:.0f}%)")
            if many and m > 0:
                spread = (max(measured) - min(measured)) / m * 100
                spreads.append(spread)
                row_spread = max(row_spread, spread)
                within += min(measured) <= p <= max(measured)
        att = "{:.0f}% / {:.0f}%".format(
            statistics.median(b["slo_attainment"] for b, _ in pairs) * 100,
            statistics.median(s["slo_attainment"] for _, s in pairs) * 100,
        )
        extra = f" {len(pairs)} | {row_spread:.0f}% |" if many else ""
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {att} |{extra}")
    head = "| run (shape, workload, rate) | TTFT p50 measured / predicted (error) | TTFT p90 | TPOT p50 | TPOT p90 | SLO attainment |"
    rule = "|---|---|---|---|---|---|"
    if many:
        head += " rounds | measured spread over the rounds (worst of the row) |"
        rule += "---|---|"
    print(head)
    print(rule)
    print("\n".join(rows))
    if errors:
        print(f"\n{len(errors)} predictions: median error {statistics.median(errors):.1f}%, worst {max(errors):.1f}%")
    if spreads:
        print(
            f"over {len(rounds)} rounds the measured values themselves spread by a median of "
            f"{statistics.median(spreads):.1f}% (worst {max(spreads):.1f}%); {within} of "
            f"{len(spreads)} predictions lie within the measured range"
        )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
