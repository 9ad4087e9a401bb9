#!/usr/bin/env python3
"""Runs a command and reports what each thread of every duet process did while it ran.

    bench/planner/thread_times.py [--out FILE] -- COMMAND [ARGS...]

Every 0.2 s it reads /proc/PID/task/TID/{schedstat,status,stat,sched} of the processes whose
executable is a duet binary, and prints, per thread that ran at least 5 ms: CPU time, time
waiting on a run queue (runnable, another thread on its core), voluntary and involuntary
context switches, migrations between cores, user and kernel time (clock ticks, 10 ms) and
minor page faults, from its first sample to its last. It answers "was the engine thread
waiting for a core, or slower itself?" (issue 83: a prefill worker beside a decoding one).
"""
import argparse
import os
import subprocess
import sys
import time


def sample(seen):
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            if not cmd or not os.path.basename(cmd[0]).startswith(b"duet"):
                continue
            name = os.path.basename(cmd[0]).decode(errors="replace")
            # `duet bench serve`: the subcommand; a service binary: its own name says it.
            process = " ".join([name] + [c.decode(errors="replace") for c in cmd[1:3]]) if name == "duet" else name
            for tid in os.listdir(f"/proc/{pid}/task"):
                base = f"/proc/{pid}/task/{tid}"
                with open(base + "/comm") as f:
                    comm = f.read().strip()
                with open(base + "/schedstat") as f:
                    run_ns, wait_ns, _ = map(int, f.read().split())
                with open(base + "/status") as f:
                    status = dict(line.split(":", 1) for line in f if ":" in line)
                with open(base + "/stat") as f:
                    stat = f.read().rsplit(")", 1)[1].split()
                with open(base + "/sched") as f:
                    migrations = next(
                        int(line.split()[-1]) for line in f if line.startswith("se.nr_migrations")
                    )
                values = (
                    run_ns / 1e6,
                    wait_ns / 1e6,
                    int(status["voluntary_ctxt_switches"]),
                    int(status["nonvoluntary_ctxt_switches"]),
                    migrations,
                    int(stat[11]) * 10,  # utime, in 10 ms ticks
                    int(stat[12]) * 10,  # stime
                    int(stat[7]),  # minflt
                )
                key = (pid, tid)
                if key not in seen:
                    seen[key] = [process, comm, values, values]
                seen[key][3] = values
        except (FileNotFoundError, ProcessLookupError, StopIteration, KeyError, ValueError):
            continue  # a process or thread that ended between two reads


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the table here too")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a command to run after --")
    seen = {}
    child = subprocess.Popen(command)
    while child.poll() is None:
        sample(seen)
        time.sleep(0.2)
    header = ("pid", "process", "thread", "cpu_ms", "rq_wait_ms", "vol", "invol", "migr",
              "user_ms", "sys_ms", "minflt")
    rows = []
    for (pid, _), (process, comm, first, last) in seen.items():
        d = [b - a for a, b in zip(first, last)]
        if d[0] >= 5:
            rows.append((pid, process, comm, *d))
    rows.sort(key=lambda r: -r[3])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append("| " + " | ".join([r[0], r[1], r[2]] + [f"{v:.0f}" for v in r[3:]]) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    sys.exit(child.returncode)


if __name__ == "__main__":
    main()
