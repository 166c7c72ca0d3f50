"""Keep part of one core busy, to try the suite or a lesson on a loaded machine.

    python benchmarks/busy.py ON_MS OFF_MS    # e.g. 40 40: half a core, until killed

It spins for ON_MS, sleeps for OFF_MS, and again, so another process gets a core
back in short gaps, as a shared machine does. The suite's serial pass prints how
much CPU other processes took while it ran (tests/conftest.py), which measures it.
"""

from __future__ import annotations

import sys
import time


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not all(a.replace(".", "", 1).isdigit() for a in argv):
        print("usage: python benchmarks/busy.py ON_MS OFF_MS (e.g. 40 40 for half a core)",
              file=sys.stderr)
        return 2
    on, off = float(argv[0]) / 1000, float(argv[1]) / 1000
    while True:
        until = time.perf_counter() + on
        while time.perf_counter() < until:
            pass
        time.sleep(off)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
