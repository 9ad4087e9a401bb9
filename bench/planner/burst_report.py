#!/usr/bin/env python3
"""The burst runs' table and plot (bench/planner/burst.sh's OUT): for each arm, SLO attainment
over the whole trace and in its calm and burst phases, p90 TTFT and TPOT, failures, and the
planner's role switches; and burst.svg, attainment over time per arm beside the trace's arrival
rate, with the planner's switches marked. Writes burst.md and burst.svg into OUT.
  bench/planner/burst_report.py OUT TRACE PHASE_S"""
import json
import os
import sys

out, trace_path, phase_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
arms = sorted(d for d in os.listdir(out) if os.path.exists(os.path.join(out, d, "bench.json")))
arrivals = [json.loads(line)["timestamp"] / 1000 for line in open(trace_path)]
window = 10.0
rows, series, switches = [], {}, {}
for arm in arms:
    run = json.load(open(os.path.join(out, arm, "bench.json")))["runs"][0]
    timeline = run["timeline"]
    window = timeline[1]["start_s"] - timeline[0]["start_s"] if len(timeline) > 1 else window
    series[arm] = [(w["start_s"], w["attained"] / w["requests"] if w["requests"] else None)
                   for w in timeline]
    phases = {"calm": [0, 0], "burst": [0, 0]}
    for w in timeline:
        # A window belongs to the phase it starts in.
        phase = "burst" if int(w["start_s"] // phase_s) % 2 else "calm"
        phases[phase][0] += w["requests"]
        phases[phase][1] += w["attained"]
    started = float(open(os.path.join(out, arm, "started")).read())
    made = []
    decisions = os.path.join(out, arm, "decisions.jsonl")
    if os.path.exists(decisions):
        seen = set()
        for line in open(decisions):
            d = json.loads(line)
            if d.get("action") == "switch" and not d.get("switch_error") and d["at"] not in seen:
                seen.add(d["at"])
                made.append((d["at"] - started, d["switch"]["to"]))
    switches[arm] = made
    share = lambda p: f"{p[1] / p[0]:.1%}" if p[0] else "-"
    rows.append(f"| {arm} | {run['requests']} | {run['failed']} | {run['slo_attainment']:.1%} | "
                f"{share(phases['calm'])} | {share(phases['burst'])} | "
                f"{run['ttft_ms']['p90']:.0f} | {run['tpot_ms']['p90']:.1f} | "
                + (", ".join(f"{t:.0f} s → {to}" for t, to in made) or "none") + " |")
lines = ["| arm | requests | failed | attainment | calm phases | burst phases | TTFT p90 ms | "
         "TPOT p90 ms | role switches (s after the start) |", "|---|---|---|---|---|---|---|---|---|"]
lines += rows
open(os.path.join(out, "burst.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))

# The plot: attainment per window (left axis, 0-100%) per arm, the trace's rate (right axis).
W, H, L, R, T, B = 900, 420, 60, 60, 30, 50
end = max(arrivals[-1], max(s[-1][0] + window for s in series.values()))
rate = [0] * (int(end // window) + 1)
for t in arrivals:
    rate[int(t // window)] += 1
top_rate = max(rate) / window * 1.1
x = lambda t: L + (W - L - R) * t / end
y = lambda f: H - B - (H - T - B) * f
yr = lambda r: H - B - (H - T - B) * r / top_rate
colors = ["#d62728", "#ff7f0e", "#1f77b4", "#17becf", "#2ca02c", "#9467bd"]
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
       '<rect width="100%" height="100%" fill="white"/>',
       f'<text x="{W / 2}" y="18" text-anchor="middle">SLO attainment by arrival window ({window:.0f} s) under a bursty trace</text>']
for k in range(0, 11, 2):
    svg.append(f'<line x1="{L}" x2="{W - R}" y1="{y(k / 10)}" y2="{y(k / 10)}" stroke="#eee"/>')
    svg.append(f'<text x="{L - 6}" y="{y(k / 10) + 4}" text-anchor="end">{k * 10}%</text>')
for k in range(0, int(end) + 1, 30):
    svg.append(f'<text x="{x(k)}" y="{H - B + 16}" text-anchor="middle">{k}</text>')
svg.append(f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">seconds from the start</text>')
svg.append(f'<text x="{W - R + 40}" y="{T + 10}" text-anchor="middle" fill="#888">req/s</text>')
for k in range(0, int(top_rate) + 1):
    svg.append(f'<text x="{W - R + 6}" y="{yr(k) + 4}" fill="#888">{k}</text>')
bars = "".join(f'<rect x="{x(i * window)}" y="{yr(n / window)}" width="{x(window) - x(0)}" '
               f'height="{H - B - yr(n / window)}" fill="#ddd"/>' for i, n in enumerate(rate))
svg.append(bars)
svg.append(f'<line x1="{L}" x2="{L}" y1="{T}" y2="{H - B}" stroke="black"/>')
svg.append(f'<line x1="{L}" x2="{W - R}" y1="{H - B}" y2="{H - B}" stroke="black"/>')
for i, arm in enumerate(arms):
    c = colors[i % len(colors)]
    points = " ".join(f"{x(t + window / 2):.1f},{y(f):.1f}" for t, f in series[arm] if f is not None)
    svg.append(f'<polyline points="{points}" fill="none" stroke="{c}" stroke-width="2"/>')
    svg.append(f'<text x="{L + 10}" y="{T + 16 + 16 * i}" fill="{c}">{arm}</text>')
    for t, to in switches[arm]:
        svg.append(f'<line x1="{x(t)}" x2="{x(t)}" y1="{T}" y2="{H - B}" stroke="{c}" stroke-dasharray="4 3"/>')
        svg.append(f'<text x="{x(t) + 3}" y="{H - B - 6}" fill="{c}">→{to}</text>')
svg.append("</svg>")
open(os.path.join(out, "burst.svg"), "w").write("\n".join(svg) + "\n")
