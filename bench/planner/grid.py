#!/usr/bin/env python3
"""The planner's pick against a measured grid: `duet plan` searches the placements of --devices
workers on this machine (objective total: the workers share its cores) from a profile measured
here; then every placement whose unit fills the devices (colocated ×N, every P:D split, each step
budget) is measured through a real cluster (`duet bench serve --processes`, the same requests):
its goodput is the highest rate at which --attainment of requests meet both SLOs, bracketed from
the predicted rate by steps of --step-factor and bisected --bisections times. Writes grid.json and
grid.md (the table, and the pick's measured goodput as a share of the best measured) into OUT.

  bench/planner/grid.py --profile PROFILE --out OUT [--devices 2] [--requests 150] \
      -- [workload and cluster flags shared by plan and bench serve, --processes aside]
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--profile", required=True)
p.add_argument("--out", required=True)
p.add_argument("--devices", type=int, default=2)
p.add_argument("--requests", type=int, default=150)
p.add_argument("--attainment", type=float, default=0.9)
p.add_argument("--step-factor", type=float, default=1.25)
p.add_argument("--bisections", type=int, default=2)
p.add_argument("--duet", default=os.environ.get("DUET", "target/ci/duet"))
p.add_argument("flags", nargs="*", help="flags shared by duet plan and duet bench serve")
a = p.parse_args()
os.makedirs(a.out, exist_ok=True)
shared = a.flags + ["--requests", str(a.requests)]


def run(cmd, log):
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    with open(log, "w") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=True)


plan_json = os.path.join(a.out, "plan.json")
run([a.duet, "plan", "--processes", "--devices", str(a.devices), "--objective", "total",
     "--profile", a.profile,
     "--attainment", str(a.attainment), "--json-out", plan_json,
     "--plot-out", os.path.join(a.out, "plan.svg"), "--rate", "1"] + shared, os.path.join(a.out, "plan.txt"))
plan = json.load(open(plan_json))
winner = plan["winner"]


def cluster_flags(c):
    base = ["--max-step-tokens", str(c["max_step_tokens"])]
    if c["design"] == "colocated":
        return base + ["--launch", "colocated", "--decode-workers", str(c["decode"])]
    return base + ["--launch", "disaggregated", "--prefill-workers", str(c["prefill"]),
                   "--decode-workers", str(c["decode"])]


def measure(placement, rate):
    name = placement["name"].replace(" ×", "x").replace("+", "").replace(", step ", "-s")
    stem = os.path.join(a.out, f"{name}-rate{rate:.3f}")
    run([a.duet, "bench", "serve", "--processes", "--rate", f"{rate:.3f}",
         "--json-out", stem + ".json"] + cluster_flags(placement["candidate"]) + shared,
        stem + ".txt")
    r = json.load(open(stem + ".json"))["runs"][0]
    point = {"rate": rate, "attainment": r["slo_attainment"], "ttft_p90_ms": r["ttft_ms"]["p90"],
             "tpot_p90_ms": r["tpot_ms"]["p90"], "failed": r["failed"]}
    print(f"  {placement['name']} at {rate:.3f} req/s: {point['attainment']:.1%}", file=sys.stderr,
          flush=True)
    return point


rows = []
started = time.time()
for placement in plan["placements"]:
    c = placement["candidate"]
    if c["prefill"] + c["decode"] != a.devices:
        continue
    points = []
    ok = lambda pt: pt["attainment"] >= a.attainment
    # Bracket: from the predicted rate up or down by the step factor.
    rate = max(placement["max_rate"], 0.05)
    first = measure(placement, rate)
    points.append(first)
    lo, hi = (rate, None) if ok(first) else (None, rate)
    for _ in range(6):
        if lo is not None and hi is not None:
            break
        rate = rate * a.step_factor if hi is None else rate / a.step_factor
        pt = measure(placement, rate)
        points.append(pt)
        if ok(pt):
            lo = rate if lo is None else max(lo, rate)
        else:
            hi = rate if hi is None else min(hi, rate)
    for _ in range(a.bisections if lo is not None and hi is not None else 0):
        mid = math.sqrt(lo * hi)
        pt = measure(placement, mid)
        points.append(pt)
        lo, hi = (mid, hi) if ok(pt) else (lo, mid)
    rows.append({"placement": placement["name"], "candidate": c,
                 "predicted_rate": placement["max_rate"], "measured_rate": lo or 0.0,
                 "first_failing_rate": hi, "points": points})

best = max(rows, key=lambda r: r["measured_rate"])
pick = next((r for r in rows if r["placement"] == winner), None)
share = pick["measured_rate"] / best["measured_rate"] if pick and best["measured_rate"] else 0.0
report = {"plan": plan_json, "winner": winner, "best_measured": best["placement"],
          "pick_share_of_best": share, "rows": rows, "minutes": (time.time() - started) / 60}
json.dump(report, open(os.path.join(a.out, "grid.json"), "w"), indent=1)
slo = plan["workload"]
lines = [f"Placements of {a.devices} workers; goodput = highest rate with ≥{a.attainment:.0%} of "
         "requests within both SLOs (predicted by `duet plan`, measured through the real cluster).",
         "", "| placement | predicted req/s | measured req/s | first failing measured | runs |",
         "|---|---|---|---|---|"]
for r in rows:
    mark = " ← pick" if r["placement"] == winner else ""
    mark += " (best measured)" if r is best else ""
    fail = f"{r['first_failing_rate']:.3f}" if r["first_failing_rate"] else "none"
    runs = ", ".join(f"{pt['rate']:.2f}:{pt['attainment']:.0%}" for pt in r["points"])
    lines.append(f"| {r['placement']}{mark} | {r['predicted_rate']:.3f} | {r['measured_rate']:.3f} | "
                 f"{fail} | {runs} |")
lines += ["", f"The pick ({winner}) reaches {share:.1%} of the best measured goodput "
          f"({best['placement']}, {best['measured_rate']:.3f} req/s)."]
open(os.path.join(a.out, "grid.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
