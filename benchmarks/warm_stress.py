"""Many warm runs in a row: none may hang, fail the wrong way or leave a process.

    .venv/bin/python benchmarks/warm_stress.py [--runs 1000] [--json FILE]

A warm run forks its torchrun agent from the caller's warm server, and the agent
forks the ranks while it has threads of its own (its rendezvous store, its timers).
A lock one of those threads held at the fork would stay held in the rank forever:
a hang. This script runs --runs warm runs from one process, cycling through four
kinds, each with its own expected ending:

- hello: 4 ranks, gloo, one all_reduce (ok);
- fail: rank 2 raises after an all_reduce, its peers lose it (failed, root cause rank 2);
- restart: rank 1 is SIGKILLed at step 2 and torchrun restarts every rank (ok, 2 attempts);
- timeout: ranks train until a 1.5 s timeout stops them (timeout).

Every run has a 60 s wall-clock limit on top (a hang would end as "timeout" there
instead of its kind's ending, and count as a failure). After each run no process of
it may be left: the server must have no child, and no process may carry the run's
folder in its environment. Exit status 0 when every run ended as expected.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from labutils import launch
from labutils.run import warm
from labutils.runtime.procs import carrying, tree
from labutils.runtime.runfiles import ENV_RUN_DIR

SCRIPTS = Path(__file__).resolve().parent.parent / "tests" / "scripts"
WALL_LIMIT_S = 60.0


# (name, launch() arguments, expected reason)
KINDS: list[tuple[str, dict, str]] = [
    ("hello", dict(script=SCRIPTS / "hello.py", nproc=4), "ok"),
    ("fail", dict(script=SCRIPTS / "fail_rank2.py", nproc=4), "failed"),
    ("restart", dict(script=SCRIPTS / "resume.py", nproc=2, max_restarts=1,
                     fault={"rank": 1, "step": 2}), "ok"),
    ("timeout", dict(script=SCRIPTS / "forever.py", nproc=2, timeout=1.5), "timeout"),
]


def left_of(run_dir: Path) -> list[int]:
    """Processes still carrying this run's folder, and what the warm servers still have
    below them."""
    left = carrying(ENV_RUN_DIR, str(run_dir))
    for server in warm.servers():
        left += tree(server.pid)
    return left


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000, help="warm runs (default 1000)")
    parser.add_argument("--json", metavar="FILE", help="also write every run's figures")
    args = parser.parse_args(argv)
    started = time.monotonic()
    load_before = os.getloadavg()
    bad, rows = [], []
    with tempfile.TemporaryDirectory(prefix="labutils-stress-") as tmp:
        runs = Path(tmp) / "runs"
        for i in range(args.runs):
            name, kwargs, expected = KINDS[i % len(KINDS)]
            kwargs = dict(kwargs)
            if name == "restart":
                kwargs["args"] = [str(Path(tmp) / f"ckpt-{i}")]
            t0 = time.monotonic()
            result = launch(kwargs.pop("script"), display="none", log_dir=runs,
                            timeout=kwargs.pop("timeout", WALL_LIMIT_S), hang_timeout=None,
                            **kwargs)
            took = time.monotonic() - t0
            time.sleep(0.05)
            left = left_of(result.log_dir)
            deadline = time.monotonic() + 5
            while left and time.monotonic() < deadline:
                time.sleep(0.1)
                left = left_of(result.log_dir)
            ok = (result.reason == expected and result.start == "warm" and not left
                  and (name != "fail" or (result.failure and result.failure.rank == 2))
                  and (name != "restart" or len(result.attempts) == 2))
            rows.append({"run": i, "kind": name, "reason": result.reason, "start": result.start,
                         "seconds": round(took, 3), "left": left, "ok": ok})
            if not ok:
                bad.append(rows[-1])
                print(f"run {i} ({name}): {result.reason}, start {result.start}, left {left}: "
                      f"{result.headline()}", file=sys.stderr, flush=True)
            if (i + 1) % 50 == 0:
                print(f"  {i + 1}/{args.runs} runs, {len(bad)} bad, "
                      f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    wall = time.monotonic() - started
    print(f"{args.runs} warm runs in {wall:.0f} s; load {load_before[0]:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after; {len(bad)} ended otherwise than expected or left "
          "a process")
    for name, _, expected in KINDS:
        took = [r["seconds"] for r in rows if r["kind"] == name]
        if took:
            print(f"  {name:<8} {len(took):>5} runs, expected {expected:<8} median "
                  f"{statistics.median(took):.2f} s, max {max(took):.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": rows, "wall_s": wall}, indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
