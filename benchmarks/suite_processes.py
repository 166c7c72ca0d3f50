"""Where a command's CPU goes by kind of process: warm servers, forked and cold ranks,
torchrun agents, notebook kernels, the grader's processes, browsers, compilers.

    .venv/bin/python benchmarks/suite_processes.py -- .venv/bin/python -m pytest -n 3 ...
    .venv/bin/python benchmarks/suite_processes.py -- make test

benchmarks/suite_timeline.py says which test files cost the most; this says which
processes inside them do. The kernel's process accounting (acct(2), root only) writes
one record for every process that ends: its pid, its parent, its CPU time and the name
of its main thread. A thread of this script reads /proc every 20 ms and notes each new
process's command line, so records are named by it; a process forked without exec keeps
its parent's command line, and torchrun's agent names its main thread "pt_elastic",
which the ranks it forks inherit. Only the command's own descendants count (accounting
sees the whole machine); a process still alive when the command ends (a daemon) has no
record and is not counted. Last, the warm servers started, by the kind of process that
started each.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

# struct acct_v3 (linux/acct.h): flag, version, tty, exitcode, uid, gid, pid, ppid,
# btime (s since the epoch), etime (float, ticks), utime, stime, mem, io, rw, minflt,
# majflt, swaps (comp_t), comm[16]
RECORD = struct.Struct("<BBHIIIIIIf8H16s")
TICKS = 100  # AHZ: the unit of comp_t times in a v3 record

# (what the command line contains, or "comm:" and the thread name, a trailing * for any
# that starts so, -> kind): the first that matches; the specific before the general
KINDS = (
    ("torch.distributed.run", "torchrun agents started cold"),
    ("labutils.runtime.agent", "torchrun agents started cold"),
    ("comm:pt_elastic", "warm runs: torchrun agents and ranks forked from a warm server"),
    ("labutils.runtime.server", "warm servers (torch and torch._dynamo imported) and their keepers"),
    ("labutils.runtime.worker", "ranks started cold (each imports torch)"),
    ("ipykernel_launcher", "notebook kernels"),
    ("labutils.grading.runner", "the grader's check runners"),
    ("labutils.grading.wrongfix", "the grader's check runners"),
    ("labutils.grading.", "the grader's supervisors, sandboxes and papermill"),
    ("sys.stdin.readline()", "pytest and its xdist workers"),
    ("pytest", "pytest and its xdist workers"),
    ("jupyter", "JupyterLab servers"),
    ("comm:chrom*", "Chromium"),
    ("comm:headless*", "Chromium"),
    ("comm:cc1plus", "the C++ compiler (inductor's kernels)"),
    ("comm:ld", "the C++ compiler (inductor's kernels)"),
    ("comm:as", "the C++ compiler (inductor's kernels)"),
    ("comm:slurm*", "SLURM"),
    ("comm:munged", "SLURM"),
    ("comm:srun", "SLURM"),
    ("comm:sbatch", "SLURM"),
    ("labutils.cli", "labutils commands (launch, nodes, grade ...)"),
    ("comm:labutils", "labutils commands (launch, nodes, grade ...)"),
    ("comm:python*", "other Python processes"),
)


def comp_t(value: int) -> int:
    """A comp_t: 13 bits of mantissa, 3 of base-8 exponent."""
    return (value & 0x1FFF) << (3 * (value >> 13))


def records(data: bytes) -> list[dict]:
    """The v3 records of a process accounting file."""
    out = []
    for offset in range(0, len(data) - RECORD.size + 1, RECORD.size):
        f = RECORD.unpack_from(data, offset)
        if f[1] & 0x7F != 3:
            raise ValueError(f"record {offset // RECORD.size}: version {f[1] & 0x7F}, expected 3")
        out.append({"pid": f[6], "ppid": f[7], "btime": f[8],
                    "cpu_s": (comp_t(f[10]) + comp_t(f[11])) / TICKS,
                    "comm": f[18].split(b"\0", 1)[0].decode(errors="replace")})
    return out


def kind(command: str, comm: str) -> str:
    """The kind of a process, from its command line (may be "") and thread name."""
    for pattern, name in KINDS:
        if not pattern.startswith("comm:"):
            if pattern in command:
                return name
        elif comm == pattern[5:] or pattern.endswith("*") and comm.startswith(pattern[5:-1]):
            return name
    return f"other: {comm}"


class Names:
    """The processes that start while it runs: (pid, start) -> (command line, parent)."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.seen: dict[tuple[int, float], tuple[str, int]] = {}
        self.done = threading.Event()
        boot = next(line for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        self.boot, self.hz = int(boot.split()[1]), os.sysconf("SC_CLK_TCK")
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        known: dict[str, float] = {}  # pid -> when it started
        while not self.done.is_set():
            now, listed = time.time(), os.listdir("/proc")
            for pid in listed:
                if not pid.isdigit() or (pid in known and now - known[pid] >= 1.0):
                    continue  # an old process, named already: no reads
                try:
                    stat = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
                    start = self.boot + int(stat[19]) / self.hz
                    key = (int(pid), round(start, 2))
                    # read again while young: a fork is seen before its exec now and then
                    line = Path(f"/proc/{pid}/cmdline").read_bytes()
                    parent = self.seen[key][1] if key in self.seen else int(stat[1])
                    self.seen[key] = (line.replace(b"\0", b" ").decode(errors="replace").strip(),
                                      parent)
                    known[pid] = start
                except (OSError, IndexError, ValueError):
                    continue
            if len(known) > 2 * len(listed):  # forget the ended ones now and then
                alive = set(listed)
                known = {pid: v for pid, v in known.items() if pid in alive}
            self.done.wait(self.interval)

    def finder(self):
        """find(pid, btime): (command line, parent when first seen) of the process pid
        that started at btime (whole seconds since the epoch); ("", None) if never seen."""
        by_pid: dict[int, list[tuple[float, tuple[str, int]]]] = {}
        for (pid, start), seen in self.seen.items():
            by_pid.setdefault(pid, []).append((start, seen))

        def find(pid: int, btime: int) -> tuple[str, int | None]:
            found = [(abs(start - btime), seen) for start, seen in by_pid.get(pid, ())
                     if abs(start - btime) <= 1.5]
            return min(found)[1] if found else ("", None)

        return find


def descendants(rows: list[dict], root: int) -> list[dict]:
    """The records of root and of the processes under it: by the parent a record names,
    or the one the process had when first seen (an orphan's record names init)."""
    parents: dict[int, set[int]] = {}
    for r in rows:
        parents.setdefault(r["pid"], set()).update(p for p in (r["ppid"], r["parent"]) if p)
    memo: dict[int, bool] = {root: True}

    def under(pid: int, depth: int = 0) -> bool:
        if pid not in memo:
            memo[pid] = False  # a loop (a reused pid) ends here
            memo[pid] = depth < 64 and any(under(p, depth + 1) for p in parents.get(pid, ()))
        return memo[pid]

    return [r for r in rows if under(r["pid"])]


SERVER = "labutils.runtime.server"


def servers_started(rows: list[dict]) -> str:
    """Who started the warm servers: a server is a process whose command line is the
    server's and whose parent's is not (its keepers and their runs are forks of it, with
    the same command line). Per kind of starter: how many, and the CPU they took."""
    by_pid = {r.get("pid"): r for r in rows}
    count: Counter[str] = Counter()
    cpu: Counter[str] = Counter()
    for r in rows:
        parent = by_pid.get(r.get("parent") or r.get("ppid")) or by_pid.get(r.get("ppid"))
        if SERVER in r.get("line", "") and not (parent and SERVER in parent.get("line", "")):
            starter = parent["kind"] if parent else "a process that ended unseen"
            count[starter] += 1
            cpu[starter] += r["cpu_s"]
    if not count:
        return ""
    lines = [f"{sum(count.values())} warm servers started, {sum(cpu.values()):.0f} CPU-s "
             f"(without their keepers and runs), by:"]
    lines += [f"{cpu[k]:8.1f} {n:9d}  {k}" for k, n in count.most_common()]
    return "\n".join(lines)


def report(rows: list[dict], wall_s: float) -> str:
    cpu: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for r in rows:
        cpu[r["kind"]] += r["cpu_s"]
        count[r["kind"]] += 1
    total = sum(cpu.values())
    lines = [f"{'CPU s':>8s} {'share':>6s} {'processes':>9s}  kind"]
    for name, seconds in cpu.most_common():
        if seconds >= 0.05:
            lines.append(f"{seconds:8.1f} {seconds / max(total, 1e-9):6.1%} {count[name]:9d}  {name}")
    lines.append(f"{total:.0f} CPU-s in {wall_s:.0f} s ({total / max(wall_s, 1e-9):.2f} cores on "
                 f"average), {len(rows)} processes ended")
    servers = servers_started(rows)
    return "\n".join(lines + ([servers] if servers else []))


# Held while a measure runs: the machine has one accounting file, and a second measure
# (this script's own test, in a suite being measured, or another suite beside it) would
# take it over and then turn accounting off for both.
LOCK = Path("/tmp/suite_processes.lock")
RUNNING = "a measure is running already on this machine"


@contextlib.contextmanager
def held() -> Iterator[None]:
    """LOCK, held for the block; SystemExit with one line when a measure holds it now."""
    with open(LOCK, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(f"suite_processes.py: {RUNNING} (the kernel keeps one accounting "
                             "file): measure once, from outside") from None
        yield


def measure(command: list[str]) -> tuple[int, str]:
    """Run command under process accounting; (its exit status, the report)."""
    with held():
        status, rows, root, wall = account(command)
    return status, report(descendants(rows, root), wall)


def account(command: list[str]) -> tuple[int, list[dict], int, float]:
    """Run command under process accounting, the caller holding LOCK: (its exit status,
    the record of every process of the machine that ended meanwhile, each named by its
    kind, the command's pid, the wall time)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with tempfile.TemporaryDirectory(prefix="suite-processes-") as tmp:
        path = Path(tmp) / "pacct"
        path.touch()
        if libc.acct(str(path).encode()) != 0:
            err = ctypes.get_errno()
            raise SystemExit(f"suite_processes.py: process accounting (acct(2)) refused: "
                             f"{os.strerror(err)}; run it as root")
        names = Names()
        names.thread.start()
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(command)
            status = proc.wait()
        finally:
            wall = time.monotonic() - t0
            libc.acct(None)
            names.done.set()
            names.thread.join()
        rows = records(path.read_bytes())
    find = names.finder()
    for r in rows:
        line, r["parent"] = find(r["pid"], r["btime"])
        r["kind"], r["line"] = kind(line, r["comm"]), line
    return status, rows, proc.pid, wall


USAGE = "usage: suite_processes.py -- COMMAND [ARGS...] (as root)"


def command_of(argv: list[str]) -> list[str]:
    """The command to measure, from this script's arguments; SystemExit with a one-line
    message for none, for options of this script's own (it has none but -h), and for a
    command that is not there, before accounting starts."""
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE + "\n\n" + (__doc__ or "").split("\n\n")[0])
        raise SystemExit(0)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    elif argv[:1] and argv[0].startswith("-"):
        raise SystemExit(f"suite_processes.py: unknown option {argv[0]}; {USAGE}")
    if not argv:
        raise SystemExit(USAGE)
    if shutil.which(argv[0]) is None:
        raise SystemExit(f"suite_processes.py: {argv[0]}: no such command (expected a program "
                         "on PATH or a path to an executable file, after --)")
    return argv


if __name__ == "__main__":
    code, text = measure(command_of(sys.argv[1:]))
    print(text)
    sys.exit(code)
