#!/usr/bin/env python3
"""Per-GPU goodput of the best disaggregated placement against the best colocated one, for 8, 16
and 64 GPUs, per (SLOs, workload), from the `duet plan --json-out` reports at_scale.sh wrote: a
unit of up to N GPUs is replicated over N (DistServe's way)."""
import glob
import json
import os
import sys

print("| SLOs, workload | GPUs | best disaggregated: req/s per GPU (unit) | best colocated: req/s per GPU (unit) | ratio | goodput of the GPUs, best placement |")
print("|---|---|---|---|---|---|")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    r = json.load(open(path))
    name = os.path.basename(path)[:-5]
    for gpus in (8, 16, 64):
        fits = [p for p in r["placements"] if p["candidate"]["prefill"] + p["candidate"]["decode"] <= gpus]
        best = {}
        for p in fits:
            d = p["candidate"]["design"]
            if d not in best or p["goodput_per_device"] > best[d]["goodput_per_device"]:
                best[d] = p
        dis, col = best.get("disaggregated"), best.get("colocated")
        total = lambda p: (gpus // (p["candidate"]["prefill"] + p["candidate"]["decode"])) * p["max_rate"]
        winner = max(fits, key=total)
        ratio = dis["goodput_per_device"] / col["goodput_per_device"] if dis and col and col["goodput_per_device"] > 0 else float("nan")
        fmt = lambda p: f"{p['goodput_per_device']:.2f} ({p['name']})" if p else "-"
        print(f"| {name} | {gpus} | {fmt(dis)} | {fmt(col)} | {ratio:.2f}x | {total(winner):.1f} req/s ({winner['name']}) |")
