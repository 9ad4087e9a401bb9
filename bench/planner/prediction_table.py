#!/usr/bin/env python3
"""The prediction table: for each (shape, workload, rate), `duet simulate`'s p50 and p90 TTFT and
TPOT against `duet bench serve`'s on the same flags, with the relative error of each, and the
median and worst error over all of them. Reads the JSON pairs predict.sh wrote."""
import glob
import json
import os
import statistics
import sys

root = sys.argv[1]
rows, errors = [], []
for bench_path in sorted(glob.glob(os.path.join(root, "*.bench.json"))):
    name = os.path.basename(bench_path)[: -len(".bench.json")]
    sim_path = os.path.join(root, name + ".sim.json")
    if not os.path.exists(sim_path):
        continue
    bench = json.load(open(bench_path))["runs"][0]
    sim = json.load(open(sim_path))["runs"][0]
    cells = []
    for metric in ["ttft_ms", "tpot_ms"]:
        for q in ["p50", "p90"]:
            m, s = bench[metric][q], sim[metric][q]
            err = abs(s - m) / m * 100 if m > 0 else 0.0
            errors.append(err)
            cells.append(f"{m:.1f} / {s:.1f} ({err:.0f}%)")
    att = f"{bench['slo_attainment']*100:.0f}% / {sim['slo_attainment']*100:.0f}%"
    rows.append(f"| {name} | " + " | ".join(cells) + f" | {att} |")
print("| run (shape, workload, rate) | TTFT p50 measured / predicted (error) | TTFT p90 | TPOT p50 | TPOT p90 | SLO attainment |")
print("|---|---|---|---|---|---|")
print("\n".join(rows))
if errors:
    print(f"\n{len(errors)} predictions: median error {statistics.median(errors):.1f}%, worst {max(errors):.1f}%")
