"""The grader's throughput: what a submission costs, for every lab and for a class.

    .venv/bin/python benchmarks/grading.py [--lab LAB] [--class-size N] [--labs all|none]
                                           [--json FILE]

Three measurements, each through grade() (what `labutils grade` calls), in one run:

1. the batch of 8: 8 submissions of one lab (--lab; half its solution, half the
   learner's copy as released), graded with --jobs 1 and then with --jobs 2: the
   ratio is what the second job slot buys on this machine;
2. a class: --class-size submissions of the same lab (a third solutions, a third
   starters, a third solutions whose notebook has its locked symptom cell edited,
   which the grader puts back and reports), --jobs 2;
3. every lab: its solution and its learner's copy, --jobs 2, one lab at a time.

For each: wall seconds, wall seconds per submission and CPU seconds per submission
(every process of the grading: the supervisors and all they ran, from
RUSAGE_CHILDREN), with the machine's load average before and after. Every
solution must get full marks and every starter must fail as its lab.json says,
or the run counts as failed.

Exit status: 0 when every grading came out as it should, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

from labutils.grading.batch import grade
from labutils.grading.release import release, starter_problems

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK_TEST = "The notebook runs from top to bottom"


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def lab_config(lab: str) -> dict:
    return json.loads((REPO / "labs" / lab / "lab.json").read_text())


def submissions(lab: str, n: int, work: Path, *, kinds=("solution", "starter")) -> list[tuple[str, Path]]:
    """n submission folders, cycling through kinds."""
    starter = release(REPO / "labs" / lab, work / "released", verify=False, progress=None)
    solved = REPO / "solutions" / lab
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        folder = work / "subs" / f"learner{i:02d}"
        source = solved if kind != "starter" else starter
        shutil.copytree(source, folder, ignore=shutil.ignore_patterns("checks.py", "runs"))
        if kind == "edited":   # a locked cell edited: the grader runs the lab's version
            nb = folder / f"{lab}.ipynb"
            text = json.loads(nb.read_text())
            cell = next(c for c in text["cells"] if c.get("id") == "symptom")
            cell["source"] = "# nothing to see here\n"
            nb.write_text(json.dumps(text))
        out.append((kind, folder))
    return out


def timed_grade(lab: str, subs: list[tuple[str, Path]], out: Path, jobs: int) -> dict:
    load0 = os.getloadavg()[0]
    t0, c0 = time.monotonic(), cpu_s()
    results = grade(REPO / "labs" / lab, [p for _, p in subs], out_dir=out, jobs=jobs,
                    progress=None)
    wall, cpu = time.monotonic() - t0, cpu_s() - c0
    problems = []
    fails = lab_config(lab)["starter_fails"]
    for (kind, _), result in zip(subs, results):
        if kind == "starter":
            problems += [f"{result['name']}: {p}" for p in starter_problems(result, fails)]
        else:
            bad = [t["name"] for t in result["tests"] if t["status"] != "passed" and t["max_score"]]
            if bad or not result["passed"]:
                problems.append(f"{result['name']} ({kind}): failed {bad}")
    n = len(subs)
    return {"lab": lab, "submissions": n, "jobs": jobs, "wall_s": round(wall, 1),
            "wall_s_per_submission": round(wall / n, 2), "cpu_s_per_submission": round(cpu / n, 2),
            "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2),
            "problems": problems}


def row(r: dict, name: str) -> str:
    return (f"| {name} | {r['submissions']} | {r['jobs']} | {r['wall_s']:.0f} s | "
            f"{r['wall_s_per_submission']:.1f} s | {r['cpu_s_per_submission']:.1f} CPU-s | "
            f"{r['load_before']:.1f} / {r['load_after']:.1f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lab", default="08_three_bugs", help="the lab of the batch and the class")
    p.add_argument("--class-size", type=int, default=30)
    p.add_argument("--labs", choices=("all", "none"), default="all",
                   help="grade every lab's solution and starter too (default all)")
    p.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    ns = p.parse_args(argv)
    print(f"{platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    figures: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-grading-") as tmp:
        work = Path(tmp)
        batch = submissions(ns.lab, 8, work / "batch")
        figures["batch_jobs1"] = timed_grade(ns.lab, batch, work / "out-j1", jobs=1)
        print(row(figures["batch_jobs1"], f"{ns.lab}, 8 submissions"), flush=True)
        figures["batch_jobs2"] = timed_grade(ns.lab, batch, work / "out-j2", jobs=2)
        print(row(figures["batch_jobs2"], f"{ns.lab}, 8 submissions"), flush=True)
        figures["batch_ratio"] = round(figures["batch_jobs2"]["wall_s"]
                                       / figures["batch_jobs1"]["wall_s"], 2)
        print(f"--jobs 2 / --jobs 1 wall time: {figures['batch_ratio']:.2f}x", flush=True)
        klass = submissions(ns.lab, ns.class_size, work / "class",
                            kinds=("solution", "starter", "edited"))
        figures["class"] = timed_grade(ns.lab, klass, work / "out-class", jobs=2)
        print(row(figures["class"], f"{ns.lab}, a class"), flush=True)
        figures["labs"] = []
        if ns.labs == "all":
            for lab in sorted(p.parent.name for p in (REPO / "labs").glob("*/lab.json")):
                subs = submissions(lab, 2, work / "labs" / lab)
                figures["labs"].append(timed_grade(lab, subs, work / "out-labs" / lab, jobs=2))
                print(row(figures["labs"][-1], f"{lab}, solution + starter"), flush=True)
    problems = [p for f in (figures["batch_jobs1"], figures["batch_jobs2"], figures["class"],
                            *figures["labs"]) for p in f["problems"]]
    for problem in problems:
        print("PROBLEM:", problem)
    if ns.json:
        Path(ns.json).write_text(json.dumps(figures, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
