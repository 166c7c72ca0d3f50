"""scripts/run_notebooks.py: what it says about a notebook run on another machine (the GPU
machine of issue 28): the cell that failed, and each checked cell whose output changed."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import run_notebooks  # noqa: E402

LESSON03 = ROOT / "lessons" / "03_bucketing_and_overlap.ipynb"


def _stream(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_output("stream", name="stdout", text=text)


def test_a_claim_that_turned_false_is_named_with_its_cell_and_times_are_not():
    stored = nbformat.read(LESSON03, as_version=4)
    ran = copy.deepcopy(stored)
    rules = run_notebooks.sanitizers(LESSON03.parent)
    assert run_notebooks.check_differences(stored, ran, rules) == []
    checked = [i for i, c in enumerate(ran.cells)
               if run_notebooks.checked(c) and "True" in run_notebooks.cell_text(c, [])]
    index = checked[0]
    before = run_notebooks.cell_text(ran.cells[index], [])
    # another duration in the same cell is no difference (sanitize.cfg), a False is
    ran.cells[index].outputs = [_stream(before + "finished in 3.7 s\n")]
    stored.cells[index].outputs = [_stream(before + "finished in 12.0 s\n")]
    assert run_notebooks.check_differences(stored, ran, rules) == []
    ran.cells[index].outputs = [_stream(before.replace("True", "False") + "finished in 3.7 s\n")]
    found = run_notebooks.check_differences(stored, ran, rules)
    assert len(found) == 1 and found[0].startswith(f"cell {index}: ") and "False" in found[0]


@pytest.mark.parametrize("how", ["tag", "comment"])
def test_a_cell_that_did_not_run_and_an_unchecked_cell_are_not_compared(how):
    first = (nbformat.v4.new_code_cell("print(1)", outputs=[_stream("1\n")],
                                       metadata={"tags": ["nbval-check-output"]}) if how == "tag"
             else nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUT\nprint(1)", outputs=[_stream("1\n")]))
    stored = nbformat.v4.new_notebook(cells=[
        first, nbformat.v4.new_code_cell("print(2)", outputs=[_stream("2\n")],
                                         metadata={"tags": ["other"]})])
    ran = copy.deepcopy(stored)
    ran.cells[0].outputs, ran.cells[1].outputs = [], [_stream("3\n")]
    ran.cells[1].execution_count = 1
    assert run_notebooks.check_differences(stored, ran, []) == []
    ran.cells[0].execution_count = 1
    assert run_notebooks.check_differences(stored, ran, []) == ["cell 0: stored '1', now '(no line)'"]


def test_the_lessons_mark_their_checked_cells_with_the_tag_not_a_comment():
    """A learner reads the cells' source: nbval's tag is in the cell's metadata, out of sight."""
    tagged = 0
    for path in sorted(ROOT.glob("lessons/*.ipynb")):
        cells = nbformat.read(path, as_version=4).cells
        assert not [i for i, c in enumerate(cells) if "NBVAL" in c.source], path.name
        tagged += sum(run_notebooks.checked(c) for c in cells)
    assert tagged >= 150


@pytest.mark.timeout(120)
def test_the_script_runs_a_notebook_and_reports_the_error_and_the_changed_check(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUT\nprint('holds:', 1 + 1 == 3)",
                                  outputs=[_stream("holds: True\n")]),
        nbformat.v4.new_code_cell("raise ValueError('broken here')")])
    path = tmp_path / "claims.ipynb"
    nbformat.write(nb, path)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_notebooks.py"), str(path),
                          "--out", str(tmp_path / "out"), "--timeout", "60"],
                         capture_output=True, text=True, timeout=110)
    assert out.returncode == 1, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("claims.ipynb: error in ") and "(cell 1: " in lines[0] \
        and "broken here" in lines[0]
    assert lines[1] == "  differs from the stored output: cell 0: stored 'holds: True', now 'holds: False'"
    assert (tmp_path / "out" / "claims.ipynb").exists() and (tmp_path / "out" / "summary.json").exists()
