#!/usr/bin/env python3
"""The machine's compute speed now against another moment, for `duet simulate --compute-scale`.

  speed_ratio.py measure DUET OUT.json   one short engine benchmark (`duet bench engine`: a
                                         128-token prefill and a one-row decode step at context
                                         128, one kernel thread, 20 repeats), its JSON to OUT
  speed_ratio.py ratio THEN.json NOW.json  prints how many times longer a step takes now: the
                                         geometric mean of the prefill's and the decode's ratios
"""
import json
import math
import subprocess
import sys


def measure(duet, out):
    subprocess.run(
        [duet, "bench", "engine", "--threads", "1", "--prefill-tokens", "128",
         "--contexts", "128", "--batch", "1", "--repeats", "20", "--json-out", out],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def speeds(path):
    with open(path) as f:
        d = json.load(f)
    return d["prefill"][0]["tokens_per_s"], d["decode"][0]["tokens_per_s"]


def ratio(then, now):
    (p0, d0), (p1, d1) = speeds(then), speeds(now)
    return math.sqrt((p0 / p1) * (d0 / d1))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "measure":
        measure(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "ratio":
        print(f"{ratio(sys.argv[2], sys.argv[3]):.4f}")
    else:
        sys.exit(__doc__)
