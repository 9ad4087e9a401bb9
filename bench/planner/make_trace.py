#!/usr/bin/env python3
"""Writes a shared-prefix trace in the Mooncake format (JSONL: `timestamp` ms, `input_length`,
`output_length`, `hash_ids` of 512-token blocks): Poisson arrivals at --rate, each request one of
--groups system prompts of --system-blocks blocks followed by its own question, as chat traffic
with a few long system prompts looks (`--system-blocks 0`: distinct prompts). With `--burst-rate`,
the rate swings: --phase-s seconds at --rate, then --phase-s at --burst-rate, and again, for
--duration-s (instead of --requests). Replay it faster with `--trace-speedup`."""
import argparse
import json
import random

p = argparse.ArgumentParser()
p.add_argument("--requests", type=int, default=200)
p.add_argument("--rate", type=float, default=1.0)
p.add_argument("--groups", type=int, default=4)
p.add_argument("--system-blocks", type=int, default=1)
p.add_argument("--question-tokens", default="32..160")
p.add_argument("--output-tokens", default="16..48")
p.add_argument("--burst-rate", type=float)
p.add_argument("--phase-s", type=float, default=60.0)
p.add_argument("--duration-s", type=float)
p.add_argument("--seed", type=int, default=1)
p.add_argument("--out", required=True)
a = p.parse_args()
rng_range = lambda s: (lambda lo, hi: rng.randint(int(lo), int(hi)))(*s.split(".."))
if (a.burst_rate is None) != (a.duration_s is None):
    p.error("--burst-rate and --duration-s go together")
if min(a.rate, a.burst_rate or 1, a.phase_s) <= 0:
    p.error("rates and --phase-s must be positive")
rng = random.Random(a.seed)


def rate_at(t):
    if a.burst_rate is None:
        return a.rate
    return a.burst_rate if int(t // a.phase_s) % 2 else a.rate


def arrivals():
    """Poisson arrivals at the rate of each phase (memoryless: a phase's gaps start afresh at
    its boundary)."""
    t, n = 0.0, 0
    while True:
        gap = rng.expovariate(rate_at(t))
        boundary = (t // a.phase_s + 1) * a.phase_s
        if a.burst_rate is not None and t + gap >= boundary:
            t = boundary
            continue
        t += gap
        if a.duration_s is not None and t >= a.duration_s:
            return
        if a.duration_s is None and n == a.requests:
            return
        n += 1
        yield t


next_id = a.groups * a.system_blocks
with open(a.out, "w") as f:
    for t in arrivals():
        g = rng.randrange(a.groups)
        system = [g * a.system_blocks + b for b in range(a.system_blocks)]
        question = rng_range(a.question_tokens)
        # The question shares nothing: one id of its own (a partial block).
        ids = system + [next_id]
        next_id += 1
        rec = {
            "timestamp": round(t * 1000),
            "input_length": a.system_blocks * 512 + question,
            "output_length": rng_range(a.output_tokens),
            "hash_ids": ids,
        }
        f.write(json.dumps(rec) + "\n")
