#!/usr/bin/env python3
"""Where a disaggregated run's slow streams come from, request by request: the prompts each run
prefilled on a decode worker itself (`server_prefill_local`), measured against simulated, and
for every stream whose TPOT passes --tpot-ms in either, the local prefills that ran while it
decoded. Reads the `--requests-out` files of `duet bench serve` and `duet simulate` for the same
workload (the same requests in the same order).

  local_prefills.py MEASURED.jsonl SIMULATED.jsonl [--tpot-ms 5]"""
import argparse
import json


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def local_prefills(records):
    """(start, first token, prompt tokens) of each prompt a decode worker prefilled itself, in
    seconds from the run's start."""
    return [
        (r["arrival_s"] + r["server_queue_ms"] / 1e3, r["arrival_s"] + r["ttft_ms"] / 1e3, r["prompt_tokens"])
        for r in records
        if r.get("server_prefill_local")
    ]


def during_decode(r, prefills):
    """The local prefills that ran between `r`'s first and last token: (start, tokens, ms)."""
    first = r["arrival_s"] + r["ttft_ms"] / 1e3
    last = r["arrival_s"] + r["e2e_ms"] / 1e3
    return [(round(s, 2), n, round((e - s) * 1e3)) for s, e, n in prefills if s < last and e > first]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("measured")
    p.add_argument("simulated")
    p.add_argument("--tpot-ms", type=float, default=5.0)
    a = p.parse_args()
    measured, simulated = load(a.measured), load(a.simulated)
    if [r["prompt_tokens"] for r in measured] != [r["prompt_tokens"] for r in simulated]:
        raise SystemExit("the two files are not the same requests in the same order")
    mine, theirs = local_prefills(measured), local_prefills(simulated)
    both = sum(m.get("server_prefill_local", False) and s.get("server_prefill_local", False) for m, s in zip(measured, simulated))
    print(f"prefilled on a decode worker: {len(mine)} measured, {len(theirs)} simulated, {both} the same requests")
    print(f"streams with a TPOT over {a.tpot_ms} ms (measured / simulated):")
    for m, s in zip(measured, simulated):
        if max(m["tpot_ms"], s["tpot_ms"]) <= a.tpot_ms:
            continue
        print(
            f"  arrived {m['arrival_s']:6.2f} s, {m['prompt_tokens']} prompt tokens, local "
            f"{int(m.get('server_prefill_local', False))}/{int(s.get('server_prefill_local', False))}: "
            f"TPOT {m['tpot_ms']:.1f} / {s['tpot_ms']:.1f} ms; local prefills while it decoded "
            f"(start s, tokens, ms) {during_decode(m, mine)} / {during_decode(s, theirs)}"
        )


if __name__ == "__main__":
    main()
