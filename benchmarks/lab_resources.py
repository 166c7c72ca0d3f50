"""What grading one submission of each lab needs on one core: wall time, CPU time and
peak memory, for the solution and for the learner's copy as released (the starter).

    .venv/bin/python benchmarks/lab_resources.py [--labs LAB ...] [--json FILE] [--write]
    .venv/bin/python benchmarks/lab_resources.py --cpus 0.5 --labs LAB ... --json FILE

Each grading is `labutils grade` in a process of its own, pinned to one core (the
grader sees one core and stretches the labs' hang timeouts as it would on a one-core
autograder), in a memory cgroup and a cpuacct cgroup of its own. Peak memory is the
largest sum, over the cgroup's processes, of their proportional set sizes (PSS: a page
shared by forked ranks counted once in all), sampled every 0.2 s from another core, and
anon_peak_mb the same for their anonymous memory alone (the rest is torch's libraries,
mapped from files, which the kernel can drop and read again);
the cgroup's own high-water mark, which also counts the page cache of every file read
(torch's libraries), is kept as cgroup_peak_mb. CPU time is the cgroup's total. Needs
root and cgroups (v1 here; v2's memory.peak and cpu.stat where v1 is absent).

--cpus F (below 1) also caps the grading at F of that core with the cpu cgroup's CFS
quota, as Gradescope's default 0.5 vCPU container does: the grader reads the quota and
stretches the labs' hang timeouts (four times at half a CPU); the figures then say
whether every solution still scores full marks there. Only --json keeps them (--write
stores one-core figures alone).

--write stores the figures in labs/resources.json; `labutils autograder` prints them
in the zip's README with the Gradescope settings they call for.

Exit status: 0 when every solution got full marks and every starter failed, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESOURCES = REPO / "labs" / "resources.json"
CGROUP = Path("/sys/fs/cgroup")


def _own_cgroup(controller: str) -> Path:
    """This process's cgroup folder for a v1 controller (or the v2 one)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            return CGROUP / controller / path.lstrip("/")
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return CGROUP / line[3:].lstrip("/")
    raise OSError(f"no {controller} cgroup for this process")


class Meter:
    """A fresh memory cgroup and cpuacct cgroup; the process started in them is measured."""

    def __init__(self, name: str, cpus: float = 1.0) -> None:
        self.v2 = not (CGROUP / "memory").is_dir()
        parents = [_own_cgroup("memory")] if self.v2 else [_own_cgroup("memory"), _own_cgroup("cpuacct")]
        if cpus < 1 and not self.v2 and _own_cgroup("cpu").resolve() != _own_cgroup("cpuacct").resolve():
            parents.append(_own_cgroup("cpu"))  # v1 with cpu and cpuacct mounted apart
        self.groups = [p / name for p in parents]
        for g in self.groups:
            g.mkdir()
        if cpus < 1:
            period = 100_000
            if self.v2:
                (self.groups[0] / "cpu.max").write_text(f"{int(cpus * period)} {period}")
            else:
                quota = self.groups[-1]
                (quota / "cpu.cfs_period_us").write_text(str(period))
                (quota / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))

    def enter(self) -> None:  # in the child, before exec
        for g in self.groups:
            (g / "cgroup.procs").write_text(str(os.getpid()))
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

    def pss_mb(self) -> tuple[float, float]:
        """The processes' proportional set sizes together, now: (all of it, the anonymous
        part). The rest is files mapped (torch's libraries): the kernel can drop those
        pages and read them again; anonymous memory it cannot, short of killing."""
        total = anon = 0
        for pid in (self.groups[0] / "cgroup.procs").read_text().split():
            try:
                rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
            except OSError:   # gone meanwhile
                continue
            for line in rollup:
                key, _, value = line.partition(":")
                if key == "Pss":
                    total += int(value.split()[0])
                elif key in ("Pss_Anon", "Pss_Shmem"):
                    anon += int(value.split()[0])
        return total / 1024, anon / 1024

    def peak_mb(self) -> float:
        f = self.groups[0] / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")
        return int(f.read_text()) / 2**20

    def cpu_s(self) -> float:
        if self.v2:
            stat = dict(line.split() for line in (self.groups[0] / "cpu.stat").read_text().splitlines())
            return int(stat["usage_usec"]) / 1e6
        return int((self.groups[1] / "cpuacct.usage").read_text()) / 1e9

    def left(self) -> list[str]:
        """The processes still in the cgroup: "pid command" each."""
        out = []
        for pid in (self.groups[0] / "cgroup.procs").read_text().split():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
            except OSError:
                continue
            out.append(f"{pid} {cmd.strip()}")
        return out

    def close(self) -> None:
        for g in self.groups:
            for _ in range(50):
                try:
                    g.rmdir()
                    break
                except OSError:   # a process of the grading still exiting
                    time.sleep(0.1)


def measure(lab: str, kind: str, submission: Path, out: Path, cpus: float = 1.0) -> dict:
    meter = Meter(f"labutils-resources-{os.getpid()}-{lab}-{kind}", cpus)
    try:
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "labutils", "grade", str(REPO / "labs" / lab),
                                 str(submission), "--out", str(out)], preexec_fn=meter.enter,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        peak = anon = 0.0
        while proc.poll() is None:
            now, now_anon = meter.pss_mb()
            peak, anon = max(peak, now), max(anon, now_anon)
            time.sleep(0.2)
        wall = time.monotonic() - t0
        output = proc.stdout.read() if proc.stdout else ""
        time.sleep(1.0)  # `labutils grade` has returned: nothing of the grading may remain
        left = meter.left()
        figures = {"wall_s": round(wall, 1), "cpu_s": round(meter.cpu_s(), 1),
                   "peak_mb": round(peak), "anon_peak_mb": round(anon),
                   "cgroup_peak_mb": round(meter.peak_mb())}
        if left:
            figures["left_behind"] = left
    finally:
        meter.close()
    results = sorted(out.glob("*/results.json"))
    data = json.loads(results[0].read_text()) if results else {}
    passed = data.get("extra_data", {}).get("passed")
    figures["score"] = f"{data.get('score', 0):g}/{data.get('max_score', 0):g}"
    figures["as_expected"] = bool(results) and passed == (kind == "solution") and (
        kind != "solution" or data.get("score") == data.get("max_score")) and not left
    if not figures["as_expected"]:
        figures["problem"] = ([f"processes left 1 s after the grading: {left}"] if left else
                              output.strip().splitlines()[-1:] or ["no results"])
    return figures


def main() -> int:
    from labutils.grading.release import release

    labs_all = sorted(p.parent.name for p in (REPO / "labs").glob("*/lab.json"))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--labs", nargs="+", default=labs_all, choices=labs_all, metavar="LAB")
    p.add_argument("--json", type=Path, help="also write the figures to this file")
    p.add_argument("--write", action="store_true", help=f"store them in {RESOURCES.relative_to(REPO)}")
    p.add_argument("--cpus", type=float, default=1.0,
                   help="the share of the one core each grading may use (CFS quota), e.g. 0.5")
    ns = p.parse_args()
    if not 0 < ns.cpus <= 1 or (ns.write and ns.cpus != 1):
        p.error("--cpus: expected a share of one core, 0 < F <= 1 (and --write with one whole core only)")
    if os.geteuid() != 0:
        print("lab_resources.py: needs root, to make cgroups; run it with sudo", file=sys.stderr)
        return 2
    load = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="labutils-resources-"))
    rows, ok = {}, True
    try:
        print(f"{'lab':28} {'submission':10} {'wall (s)':>9} {'CPU (s)':>8} {'peak (MB)':>10} "
              f"{'anon (MB)':>10}  score",
              flush=True)
        for lab in ns.labs:
            starter = release(REPO / "labs" / lab, work / "released" / lab, verify=False, progress=None)
            rows[lab] = {}
            for kind, sub in (("solution", REPO / "solutions" / lab / f"{lab}.ipynb"), ("starter", starter)):
                fig = measure(lab, kind, sub, work / "grades" / lab / kind, ns.cpus)
                rows[lab][kind] = fig
                ok &= fig["as_expected"]
                print(f"{lab:28} {kind:10} {fig['wall_s']:9.1f} {fig['cpu_s']:8.1f} {fig['peak_mb']:10.0f} "
                      f"{fig['anon_peak_mb']:10.0f}  "
                      f"{fig['score']}" + ("" if fig["as_expected"] else f"  NOT AS EXPECTED: {fig['problem']}"),
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {"measured": str(date.today()), "cores": ns.cpus,
           "machine": f"{platform.processor() or platform.machine()}, load {load:.2f} before",
           "command": "sudo .venv/bin/python benchmarks/lab_resources.py "
                      + (f"--cpus {ns.cpus:g} --labs {' '.join(ns.labs)} --json FILE" if ns.cpus != 1
                         else "--write"), "labs": rows}
    if ns.json:
        ns.json.write_text(json.dumps(doc, indent=1) + "\n")
    if ns.write:
        old = json.loads(RESOURCES.read_text()) if RESOURCES.is_file() else {"labs": {}}
        doc["labs"] = {**old.get("labs", {}), **rows}
        RESOURCES.write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
