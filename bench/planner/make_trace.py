#!/usr/bin/env python3
"""Writes a shared-prefix trace in the Mooncake format (JSONL: `timestamp` ms, `input_length`,
`output_length`, `hash_ids` of 512-token blocks): Poisson arrivals at --rate, each request one of
--groups system prompts of --system-blocks blocks followed by its own question, as chat traffic
with a few long system prompts looks. Replay it faster with `--trace-speedup`."""
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
p.add_argument("--seed", type=int, default=1)
p.add_argument("--out", required=True)
a = p.parse_args()
rng = random.Random(a.seed)
rng_range = lambda s: (lambda lo, hi: rng.randint(int(lo), int(hi)))(*s.split(".."))
next_id = a.groups * a.system_blocks
t = 0.0
with open(a.out, "w") as f:
    for _ in range(a.requests):
        t += rng.expovariate(a.rate)
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
