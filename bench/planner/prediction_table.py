#!/usr/bin/env python3
"""The prediction table: for each (shape, workload, rate), `duet simulate`'s p50 and p90 TTFT and
TPOT against `duet bench serve`'s on the same flags, with the relative error of each, and the
median and worst error over all of them. Reads the JSON pairs predict.sh wrote.

  prediction_table.py DIR

DIR holds the pairs of one round, or `round-N/` folders (predict.sh with ROUNDS=N): then each
cell compares the median over the rounds of the measured values with the median of the
predicted ones, and the table adds how far the measured values themselves spread over the
rounds ((max - min) / median): on a machine whose speed drifts, no prediction can be expected
closer than the same run repeated.

Where the runs wrote their requests (`RUN.bench.requests.jsonl`, `RUN.sim.requests.jsonl`), a
last column gives each run's prompt compute as measured against as simulated: the median over
its requests, matched in arrival order, of the servers' prefill time measured over predicted
(over the rounds: the lowest and highest). At light load that is the machine's speed during the
run against the profile's; it uses the run, so it explains an error and predicts nothing."""
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


def prefill_ratio(root, name):
    """The run's median measured / predicted server prefill time, request by request; None
    without both request files."""
    paths = [os.path.join(root, f"{name}.{kind}.requests.jsonl") for kind in ("bench", "sim")]
    if not all(os.path.exists(p) for p in paths):
        return None
    measured, simulated = ([json.loads(l) for l in open(p)] for p in paths)
    ratios = [
        b["server_prefill_ms"] / s["server_prefill_ms"]
        for b, s in zip(measured, simulated)
        if b["prompt_tokens"] == s["prompt_tokens"] and s.get("server_prefill_ms", 0) > 0
        and b.get("server_prefill_ms") is not None
    ]
    return statistics.median(ratios) if ratios else None


# The bound on the worst error (%): the table counts the predictions past it.
WORST_BOUND = 30


def error(measured, predicted):
    return abs(predicted - measured) / measured * 100 if measured > 0 else 0.0


def main(root):
    folders = sorted(glob.glob(os.path.join(root, "round-*"))) or [root]
    rounds = [load_round(r) for r in folders]
    names = sorted(set().union(*rounds))
    many = len(rounds) > 1
    rows, errors, spreads, within = [], [], [], 0
    with_ratios = False
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
        ratios = [r for r in (prefill_ratio(f, name) for f in folders) if r is not None]
        if ratios:
            lo, hi = min(ratios), max(ratios)
            extra += f" ×{lo:.2f} |" if lo == hi else f" ×{lo:.2f}-{hi:.2f} |"
            with_ratios = True
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {att} |{extra}")
    head = "| run (shape, workload, rate) | TTFT p50 measured / predicted (error) | TTFT p90 | TPOT p50 | TPOT p90 | SLO attainment |"
    rule = "|---|---|---|---|---|---|"
    if many:
        head += " rounds | measured spread over the rounds (worst of the row) |"
        rule += "---|---|"
    if with_ratios:
        head += " prompt compute measured / predicted |"
        rule += "---|"
    print(head)
    print(rule)
    print("\n".join(rows))
    if errors:
        over = sum(e > WORST_BOUND for e in errors)
        print(
            f"\n{len(errors)} predictions: median error {statistics.median(errors):.1f}%, worst "
            f"{max(errors):.1f}%, {over} over {WORST_BOUND}%"
        )
    if many:
        for folder, pairs in zip(folders, rounds):
            errs = [error(b[m][q], s[m][q]) for b, s in pairs.values() for m, q in METRICS]
            print(
                f"{os.path.basename(folder)} alone: {len(errs)} predictions, median error "
                f"{statistics.median(errs):.1f}%, worst {max(errs):.1f}%"
            )
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
