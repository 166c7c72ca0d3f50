"""Process trees of a submission: find every process, watch their size, end them all.

A submission may start processes that leave its session, double-fork away from
their parents or ignore SIGTERM. The supervisor of a submission is a child
subreaper, so orphans of the submission are re-parented to it and stay its
descendants; every process also carries the submission's tag in its environment
(LABUTILS_GRADE_TAG), which finds processes that escaped even that. Ending a tree
is SIGKILL, repeated until nothing is left: a submission gets no grace period.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

import psutil

from labutils.runtime import runfiles
from labutils.runtime.procs import carrying

TAG_ENV = runfiles.ENV_GRADE_TAG



def tagged(tag: str) -> list[int]:
    """Processes whose environment carries LABUTILS_GRADE_TAG=tag."""
    return carrying(TAG_ENV, tag)


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def own_children() -> list[int]:
    """This process's children, the orphans it adopted as a subreaper included."""
    return [c.pid for c in psutil.Process().children()]


def kill_everything(*, roots: list[int], tag: str | None, keep: AbstractSet[int] = frozenset(),
                    timeout_s: float = 10.0) -> int:
    """SIGKILL the roots, their descendants and the tagged processes until none is left.

    Returns how many processes were killed. Zombies that are our own children are
    reaped so they do not linger, except those in ``keep`` (a Popen reaps its own).
    """
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while True:
        pids = set(roots) | {p.pid for r in roots for p in descendants(r)}
        if tag:
            pids |= set(tagged(tag))
        pids.discard(os.getpid())
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() > deadline:
            reap_children(keep)
            return len(killed)
        for pid in alive:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            killed.add(pid)
        time.sleep(0.05)
        reap_children(keep)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def reap_children(keep: AbstractSet[int] = frozenset()) -> None:
    """Collect exit statuses of dead children (adopted orphans), except those in keep."""
    for child in psutil.Process().children():
        if child.pid in keep:
            continue
        try:
            os.waitpid(child.pid, os.WNOHANG)
        except ChildProcessError:
            pass


@dataclass
class TreeSize:
    processes: int
    rss_bytes: int


def tree_size(root: int) -> TreeSize:
    """Processes under root (root included) and their summed resident memory."""
    procs = [*descendants(root)]
    try:
        procs.append(psutil.Process(root))
    except psutil.Error:
        pass
    rss = 0
    for p in procs:
        try:
            rss += p.memory_info().rss
        except psutil.Error:
            pass
    return TreeSize(processes=len(procs), rss_bytes=rss)


def folder_bytes(path: str | os.PathLike, *, limit: int) -> int:
    """Bytes under path, counting stops once past limit (so a flood of files stays cheap)."""
    total, stack = 0, [os.fspath(path)]
    while stack and total <= limit:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        else:
                            total += entry.stat(follow_symlinks=False).st_size
                    except OSError:
                        continue
        except OSError:
            continue
    return total


LAB_CPUS = 2.0   # the labs' hang timeouts are set for a 2-core machine


def available_cpus(cgroup_root: str = "/sys/fs/cgroup", membership: str | None = None) -> float:
    """CPUs this process may use: its affinity, capped by every CPU quota on the way from
    its own cgroup up to the root (v2's cpu.max, v1's cpu.cfs_quota_us): 0.5 in
    Gradescope's default container, whose cgroup is the root it sees, or in a cgroup
    nested under the machine's (benchmarks/lab_resources.py --cpus 0.5).

    membership: /proc/self/cgroup's text (read when None)."""
    cpus = float(len(os.sched_getaffinity(0)))
    root = Path(cgroup_root)
    if membership is None:
        try:
            membership = Path("/proc/self/cgroup").read_text()
        except OSError:
            membership = ""
    own: dict[str, str] = {}  # controller ("" for v2) -> this process's cgroup path
    for line in membership.splitlines():
        _, names, path = (line.split(":", 2) + ["", ""])[:3]
        for name in names.split(",") if names else [""]:
            own[name] = path.strip("/")

    def up(base: Path, path: str) -> list[Path]:
        """base/path and each of its parents, down to base."""
        parts = [part for part in path.split("/") if part]
        return [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]

    quotas: list[float] = []
    for folder in up(root, own.get("", "")):  # v2
        try:
            quota, period = (folder / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        if quota != "max":
            quotas.append(int(quota) / int(period))
    for mount in ("cpu,cpuacct", "cpu"):  # v1
        for folder in up(root / mount, own.get("cpu", "")):
            try:
                quota_us = int((folder / "cpu.cfs_quota_us").read_text())
                period_us = int((folder / "cpu.cfs_period_us").read_text())
            except (OSError, ValueError):
                continue
            if quota_us > 0 and period_us > 0:
                quotas.append(quota_us / period_us)
    return min([cpus, *quotas])


def hang_scale(cpus: float | None = None) -> float:
    """How much longer a hang timeout must be on this machine than on the 2 cores the labs
    were set for: a rank that merely waits for a CPU must not count as hung."""
    cpus = available_cpus() if cpus is None else cpus
    return max(1.0, LAB_CPUS / max(cpus, 0.05))
