"""How much work this machine's cores do together, against one core alone.

    .venv/bin/python benchmarks/cores.py [--rounds N]

The course's timing claims (lesson 01's processes against threads, the scaling lessons)
and the test suite's parallel pass assume that N processes on N cores do N times the
work of one. On two hyperthreads of one physical core, or on a virtual machine's vCPUs
that share their host, they do less. Two kinds of work, each a loop of fixed length run
by one process alone, then by one process per core at once, in rounds that alternate
(the fastest round of each kept):

- python: a pure-Python loop (the interpreter's work, like a step of small operations);
- matmul: torch matrix products on one thread each (like a step of big operations).

Printed: per kind, the seconds of one process alone and of each process when all run
at once, and the work the cores did together as a multiple of one core's (cores x
alone / together; the number of cores on truly separate cores).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

WORK = {
    "python": "x = 0\nfor i in range({n}): x += i",
    "matmul": ("import torch\ntorch.set_num_threads(1)\na = torch.randn(384, 384)\n"
               "for _ in range({n}): a @ a"),
}
SIZE = {"python": 6_000_000, "matmul": 300}  # about half a second each on one core here
TIMED = ("import time, sys\nt0 = time.perf_counter()\n{body}\n"
         "sys.stdout.write(repr(time.perf_counter() - t0))")


def seconds(kind: str, copies: int) -> list[float]:
    """Run `copies` processes of the kind's loop at once; the seconds each took."""
    code = TIMED.format(body=WORK[kind].format(n=SIZE[kind]))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
             for _ in range(copies)]
    return [float(p.communicate()[0]) for p in procs]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of (alone, all at once) per kind")
    ns = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"{cores} cores; {ns.rounds} rounds per kind, the fastest of each kept")
    print(f"{'work':<8} {'one alone (s)':>14} {'each, all at once (s)':>22} {'work done (cores)':>18}")
    for kind in WORK:
        alone, together = [], []
        for _ in range(ns.rounds):
            alone.append(seconds(kind, 1)[0])
            together.append(max(seconds(kind, cores)))
        a, t = min(alone), min(together)
        print(f"{kind:<8} {a:>14.2f} {t:>22.2f} {cores * a / t:>18.2f}")
    return 0


if __name__ == "__main__":
    t0 = time.monotonic()
    status = main()
    print(f"({time.monotonic() - t0:.0f} s)")
    sys.exit(status)
