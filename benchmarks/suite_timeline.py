"""Where the suite's time and CPU go: a pytest plugin that notes every test's wall time
and CPU time, and a report of them per file.

The CPU time of a test is that of its worker and of every process the worker started
(ranks, warm servers, graded notebooks, browsers): each xdist worker moves itself into
a cpuacct cgroup of its own (cgroup v1; v2's cpu.stat elsewhere) at start, and its
children inherit it. Needs root for the cgroup; without one only wall times are noted.

    SUITE_TIMELINE=/tmp/timeline.jsonl PYTHONPATH=benchmarks \\
        .venv/bin/python -m pytest -p suite_timeline -n 2 --dist loadfile ...
    .venv/bin/python benchmarks/suite_timeline.py /tmp/timeline.jsonl

The report gives, per file: its CPU seconds, its wall seconds, their ratio (how many
cores the file keeps busy: a file at 0.6 mostly waits), the worker it ran on and when;
then each worker's busy time and the pass's CPU over its wall time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
_group: Path | None = None
_started: dict[str, tuple[float, float]] = {}


def _cpu_s() -> float:
    """CPU seconds of this worker's cgroup so far (0 without one)."""
    if _group is None:
        return 0.0
    if (_group / "cpuacct.usage").exists():
        return int((_group / "cpuacct.usage").read_text()) / 1e9
    for line in (_group / "cpu.stat").read_text().splitlines():  # cgroup v2
        if line.startswith("usage_usec "):
            return int(line.split()[1]) / 1e6
    return 0.0


def _own_group(worker: str) -> Path | None:
    """A fresh cgroup under this process's own, with this process in it; None if none."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpuacct" in controllers.split(","):  # v1
            base = CGROUP / controllers / path.lstrip("/")
        elif controllers == "" and (CGROUP / "cgroup.controllers").exists():  # v2 only
            base = CGROUP / path.lstrip("/")
        else:
            continue
        group = base / f"suite-timeline-{worker}-{os.getpid()}"
        try:
            group.mkdir(exist_ok=True)
            (group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            return None
        return group
    return None


_controller = False  # xdist's controller hears every worker's logstart/logfinish too
_worker = "main"


def pytest_configure(config):
    # a worker is told so by xdist (workerinput), not by its environment: a pytest run
    # from inside a worker inherits that worker's PYTEST_XDIST_WORKER
    global _group, _controller, _worker
    workerinput = getattr(config, "workerinput", None)
    _controller = workerinput is None and bool(getattr(config.option, "numprocesses", None))
    if workerinput is not None:
        _worker = workerinput["workerid"]
        if os.environ.get("SUITE_TIMELINE"):
            _group = _own_group(_worker)


def pytest_unconfigure(config):
    """Leave the cgroup, and remove it once empty (a process still in it keeps it)."""
    if _group is not None:
        try:
            (_group.parent / "cgroup.procs").write_text(str(os.getpid()))
            _group.rmdir()
        except OSError:
            pass


def pytest_runtest_logstart(nodeid, location):
    _started[nodeid] = (time.time(), _cpu_s())


def pytest_runtest_logfinish(nodeid, location):
    out = os.environ.get("SUITE_TIMELINE")
    t0, cpu0 = _started.pop(nodeid, (None, 0.0))
    if not out or _controller or t0 is None:
        return
    with open(out, "a") as f:
        f.write(json.dumps({"worker": _worker,
                            "test": nodeid, "start": t0, "end": time.time(),
                            "cpu_s": round(_cpu_s() - cpu0, 3)}) + "\n")


def report(path: str) -> str:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        return "no tests noted"
    t0, t1 = min(r["start"] for r in rows), max(r["end"] for r in rows)
    files: dict[str, dict] = defaultdict(lambda: {"cpu": 0.0, "wall": 0.0, "start": 1e30,
                                                   "end": 0.0, "worker": ""})
    workers: dict[str, float] = defaultdict(float)
    for r in rows:
        f = files[r["test"].split("::")[0]]
        f["cpu"] += r["cpu_s"]
        f["wall"] += r["end"] - r["start"]
        f["start"], f["end"] = min(f["start"], r["start"] - t0), max(f["end"], r["end"] - t0)
        f["worker"] = r["worker"]
        workers[r["worker"]] += r["end"] - r["start"]
    lines = [f"{'file':62s} {'CPU s':>7s} {'wall s':>7s} {'cores':>5s}  worker  from-to (s)"]
    for name, f in sorted(files.items(), key=lambda kv: -kv[1]["cpu"]):
        if f["wall"] < 1:
            continue
        lines.append(f"{name[:62]:62s} {f['cpu']:7.1f} {f['wall']:7.1f} "
                     f"{f['cpu'] / f['wall']:5.2f}  {f['worker']:6s}  "
                     f"{f['start']:.0f}-{f['end']:.0f}")
    cpu = sum(r["cpu_s"] for r in rows)
    lines.append(f"{len(rows)} tests; pass {t1 - t0:.0f} s; CPU {cpu:.0f} s "
                 f"({cpu / max(t1 - t0, 1e-9):.2f} cores on average); busy per worker: "
                 + ", ".join(f"{w} {s:.0f} s" for w, s in sorted(workers.items())))
    return "\n".join(lines)


USAGE = "usage: suite_timeline.py TIMELINE.jsonl (written with SUITE_TIMELINE=... pytest -p suite_timeline)"


def main(argv: list[str]) -> str:
    """The report of the one file named in argv; SystemExit with one line otherwise."""
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE + "\n\n" + (__doc__ or "").split("\n\n")[0])
        raise SystemExit(0)
    if len(argv) != 1 or argv[0].startswith("-"):
        raise SystemExit(USAGE)
    if not Path(argv[0]).is_file():
        raise SystemExit(f"suite_timeline.py: {argv[0]}: no such file (expected the JSON lines a "
                         "suite run with SUITE_TIMELINE=FILE and -p suite_timeline wrote)")
    return report(argv[0])


if __name__ == "__main__":
    print(main(sys.argv[1:]))
