"""The labs' notebooks, in the form each is meant to run.

Starters (labs/) run every cell up to the one where the bug shows, tagged
raises-exception; the self-check after it is tagged nbval-skip. Solved notebooks
(solutions/) run every cell, and must run clean.

Every one of the 14 notebooks runs in CI through the grader: test_grading_labs grades
each solved and each starter notebook, and papermill there executes every cell with
nbval-lax's rule (an error only counts in a cell without raises-exception; the
notebook's status must be "completed"). The only cell the grader does not run is the
self-check (the grader injects self_check=False and runs the same checks itself).
Running all 14 under nbval as well would add some five CPU-minutes of torchrun
launches to CI, so here nbval runs on two of them, one of each form, self-check
included; LABUTILS_NBVAL_ALL=1 runs it on all 14.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest
from helpers import REPO

NOTEBOOKS = sorted(p.relative_to(REPO).as_posix() for folder in ("labs", "solutions")
                   for p in (REPO / folder).glob("*/*.ipynb"))
SMOKE = ["labs/03_unused_parameters/03_unused_parameters.ipynb",
         "solutions/06_distributed_evaluation/06_distributed_evaluation.ipynb"]


def _nbval(paths: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths],
                          cwd=REPO, capture_output=True, text=True, timeout=840)


def test_every_lab_has_a_starter_and_a_solved_notebook():
    labs = {Path(p).parent.name for p in NOTEBOOKS if p.startswith("labs/")}
    solved = {Path(p).parent.name for p in NOTEBOOKS if p.startswith("solutions/")}
    assert len(labs) >= 7 and labs == solved


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_tags_say_how_each_notebook_runs(path):
    nb = nbformat.read(REPO / path, as_version=4)
    tags = {c.get("id"): set(c.metadata.get("tags", [])) for c in nb.cells}
    starter = path.startswith("labs/")
    assert "parameters" in tags["parameters"]
    assert ("raises-exception" in tags["symptom"]) == starter
    assert ("nbval-skip" in tags["self-check"]) == starter
    if starter:
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
            "starters are stored without outputs"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_notebooks_under_nbval():
    chosen = NOTEBOOKS if os.environ.get("LABUTILS_NBVAL_ALL") else SMOKE
    halves = [chosen[0::2], chosen[1::2]]
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(_nbval, halves))
    for paths, run in zip(halves, runs):
        assert run.returncode == 0, f"{paths}\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
        assert " passed" in run.stdout and "failed" not in run.stdout.splitlines()[-1]
