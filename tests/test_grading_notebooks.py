"""The labs' notebooks under nbval, in the form each is meant to run.

Starters (labs/): every cell up to the one where the bug shows, which is tagged
raises-exception; the self-check cell after it is tagged nbval-skip. Solved
notebooks (solutions/): every cell, the lab's checks included, must run clean.
pyproject's testpaths only collect lessons/, so nbval runs here, in two pytest
processes side by side (one per core of a CI machine).
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p.relative_to(REPO).as_posix() for folder in ("labs", "solutions")
                   for p in (REPO / folder).glob("*/*.ipynb"))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


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


def test_notebooks_under_nbval():
    halves = [NOTEBOOKS[0::2], NOTEBOOKS[1::2]]
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(_nbval, halves))
    for paths, run in zip(halves, runs):
        assert run.returncode == 0, f"{paths}\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
        assert " passed" in run.stdout and "failed" not in run.stdout.splitlines()[-1]
