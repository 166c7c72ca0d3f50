"""Every lab's catalogue of wrong fixes (labs/<lab>/wrong_fixes.py): each one graded by the
lab's checks, hidden ones included, must stay below its bound and the pass mark.

The checks run alone on each wrong fix (the notebook adds nothing to what they measure,
and its points are counted as earned), and stop once the verdict is certain:
`labutils wrongfixes LAB --full` runs every check.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import REPO

from labutils.errors import GradingError
from labutils.grading.batch import lab_files
from labutils.grading.release import learner_files
from labutils.grading.wrongfix import WRONG_FIXES_FILE, WrongFix, apply, catalogue, score_all

LABS = sorted(p.parent.name for p in (REPO / "labs").glob("*/lab.json"))
CATALOGUED = [lab for lab in LABS if (REPO / "labs" / lab / WRONG_FIXES_FILE).is_file()]


def check_catalogue(lab: str, tmp_path) -> None:
    """Every wrong fix of the lab, graded in one process (one warm server for them all)."""
    rows = score_all(REPO / "labs" / lab, catalogue(REPO / "labs" / lab), scratch=tmp_path)
    passing = [f"{r.fix.name!r}: " + (r.error or f"{r.fraction:.3f}, not below {r.bound:g} "
                                      f"({r.checks})") for r in rows if not r.caught]
    assert not passing, f"{lab}: " + "; ".join(passing)


# The first half of the labs here, the second in test_wrong_fixes_second_half.py: the suite
# keeps a file on one worker, and the whole catalogue takes minutes.
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("lab", CATALOGUED[: len(CATALOGUED) // 2])
def test_every_wrong_fix_stays_below_its_bound(lab, tmp_path):
    check_catalogue(lab, tmp_path)


def test_every_lab_keeps_at_least_three_wrong_fixes():
    assert {lab: len(catalogue(REPO / "labs" / lab)) for lab in LABS
            if len(catalogue(REPO / "labs" / lab)) < 3} == {}


def test_the_catalogue_is_the_instructors_only():
    for lab in CATALOGUED:
        folder = REPO / "labs" / lab
        assert WRONG_FIXES_FILE not in lab_files(folder)       # not sent to the grader
        assert WRONG_FIXES_FILE not in learner_files(folder)   # not in a learner's copy


def test_an_edit_that_no_longer_fits_the_solution_is_refused(tmp_path):
    lab = REPO / "labs" / "07_resume_after_kill"
    gone = WrongFix("stale", why="", edits={"train.py": [("no such line", "x")]})
    with pytest.raises(GradingError, match="occurs 0 times"):
        apply(gone, lab, tmp_path)
    with pytest.raises(GradingError, match="base must be one of"):
        WrongFix("odd base", why="", edits={"train.py": [("a", "b")]}, base="elsewhere")
    edited = apply(WrongFix("fine", why="", edits={"train.py": [
        ('start = checkpoint["step"] + 1', 'start = checkpoint["step"]')]}), lab, tmp_path / "c")
    assert 'start = checkpoint["step"]  #' in (edited / "train.py").read_text()
    assert not (edited / "hidden_checks.py").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_solution_that_loses_points_here_voids_every_verdict(tmp_path, capsys):
    """On a machine where the solution itself fails (torch 2.11 refused lab 09's DDP flag),
    every wrong fix was "caught" and `labutils wrongfixes` said all was well. The unchanged
    solution is now graded first and must score 1."""
    import shutil

    from labutils.cli import main as cli
    from labutils.grading.wrongfix import format_scored, prepare_solution

    name = "02_rank_zero_collective"
    lab, solution = tmp_path / "labs" / name, tmp_path / "solutions" / name
    shutil.copytree(REPO / "labs" / name, lab)
    shutil.copytree(REPO / "solutions" / name, solution)
    prepared = prepare_solution(lab, tmp_path / "control")
    assert (prepared / "train.py").read_text() == (solution / "train.py").read_text()
    assert not (prepared / "hidden_checks.py").exists()
    # the solution as a machine without the API it uses would run it
    text = (solution / "train.py").read_text()
    (solution / "train.py").write_text(text.replace(
        "rank, world_size, device = init()",
        'raise TypeError("an API this torch lacks")\nrank, world_size, device = init()', 1))
    first = catalogue(lab)[:1]
    rows = score_all(lab, first, scratch=tmp_path / "work", control=True)
    assert [r.fix for r in rows] == [None, first[0]]
    assert not rows[0].full_marks and rows[0].fraction < 1 and not rows[0].caught
    assert rows[1].caught   # vacuously: the base itself fails
    table = format_scored(name, rows)
    assert table.startswith(f"{name}: the solution itself loses points on this machine")
    assert "LOSES" in table.splitlines()[1] and "loses points on: " in table
    assert cli(["wrongfixes", str(lab), "--only", first[0].name]) == 1
    assert "the solution itself loses points" in capsys.readouterr().out


def test_the_command_says_what_is_wrong_with_its_lab_folder(tmp_path, capsys):
    from labutils.cli import main as cli

    for folder, expected in ((tmp_path / "absent", "is not a lab: expected lab.json there"),
                             (REPO / "lessons", "is not a lab: expected lab.json there")):
        assert cli(["wrongfixes", str(folder)]) == 2
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1, err


def test_a_name_the_catalogue_lacks_is_one_line_that_shows_a_name_it_has(capsys):
    from labutils.cli import main as cli

    lab = REPO / "labs" / "09_batchnorm"
    assert cli(["wrongfixes", str(lab), "--only", "nosuch"]) == 2
    err = capsys.readouterr().err
    first = catalogue(lab)[0].name
    assert err.count("\n") == 1 and "no wrong fix named 'nosuch'" in err, err
    assert f"one of the {len(catalogue(lab))} in its wrong_fixes.py, e.g. --only {first!r}" in err


def _lab_with_a_notebook_answer(root, notebook_checks) -> tuple:
    """A lab of two checks without launches: one of the edited file, one of the answer the
    notebook saves (runs/answer.json, as lab 12's diagnosis), which a wrong fix, an edit of
    the file, has no notebook to write."""
    import json

    lab, solution = root / "labs" / "answers", root / "solutions" / "answers"
    lab.mkdir(parents=True)
    solution.mkdir(parents=True)
    (lab / "lab.json").write_text(json.dumps({
        "title": "Answers", "notebook": "answers.ipynb", "edit": ["value.txt"],
        "starter_fails": ["The value"], "notebook_checks": notebook_checks}))
    (lab / "answers.ipynb").write_text(json.dumps({
        "cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    (lab / "value.txt").write_text("41\n")
    (solution / "value.txt").write_text("42\n")
    (lab / "checks.py").write_text(
        "from labutils.grading import check\n\n\n"
        "def number(c):\n    return int(c.learner_file('value.txt').read_text())\n\n\n"
        "@check('The value is 42', points=2, required=True)\n"
        "def value(c):\n    c.expect(number(c) == 42, 'value.txt')\n\n\n"
        "@check('The saved answer is yes', points=1)\n"
        "def answer(c):\n"
        "    path = c.learner_file('runs/answer.json')\n"
        "    c.expect(path.is_file() and path.read_text() == '\"yes\"', 'runs/answer.json')\n\n\n"
        "@check('The value is even', points=1)\n"
        "def even(c):\n    c.expect(number(c) % 2 == 0, 'value.txt')\n")
    return lab, WrongFix("a value off by two", why="", edits={"value.txt": [("42", "40")]})


def test_checks_of_the_notebooks_answers_count_as_passed_for_wrong_fixes(tmp_path):
    """lab.json's "notebook_checks" name the checks that grade what the notebook saves: a
    wrong fix is an edit of the files, so they count as earned, like the notebook's
    points. Without them lab 12's unchanged solution lost its diagnosis's 3 of 14
    points and `labutils wrongfixes` said every verdict meant nothing."""
    from labutils.grading.batch import load_lab
    from labutils.grading.release import learner_config

    lab, fix = _lab_with_a_notebook_answer(tmp_path / "with", ["The saved answer"])
    control, wrong = score_all(lab, [fix], scratch=tmp_path / "w1", control=True, decide=False)
    assert control.full_marks and control.fraction == 1.0
    assert [c["name"] for c in wrong.checks] == ["The value is 42", "The value is even"]
    assert wrong.fraction == 3 / 5 and wrong.caught and wrong.required_failed  # the answer's not run
    # deciding, a required check failed is the verdict: the checks after it do not run
    (decided,) = score_all(lab, [fix], scratch=tmp_path / "w3")
    assert [c["name"] for c in decided.checks] == ["The value is 42"] and decided.caught
    assert "notebook_checks" not in learner_config(lab, load_lab(lab).config)  # the instructor's
    lab, fix = _lab_with_a_notebook_answer(tmp_path / "without", [])
    control, _ = score_all(lab, [fix], scratch=tmp_path / "w2", control=True, decide=False)
    assert not control.full_marks and control.fraction == 4 / 5
    lab, _ = _lab_with_a_notebook_answer(tmp_path / "typo", ["The answer saved"])
    with pytest.raises(GradingError, match="\"notebook_checks\" must be a list of the starts of its "
                                           "checks' names, got \\['The answer saved'\\]"):
        load_lab(lab)


def test_the_runs_of_wrong_fixes_leave_nothing_in_the_temporary_folder(tmp_path):
    """A script's DataLoader workers leave pymp-* folders in the temporary folder; the
    checks of `labutils wrongfixes` run with a temporary folder of their own, removed at
    the end (the helpers' runs of the catalogues left 24 in /tmp)."""
    import secrets
    import tempfile

    lab, fix = _lab_with_a_notebook_answer(tmp_path, ["The saved answer"])
    name = f"left-by-a-check-{secrets.token_hex(4)}"
    with (lab / "checks.py").open("a") as f:
        f.write("\n\n@check('Leaves a file in its temporary folder', points=1)\n"
                "def leaves(c):\n    import os, tempfile\n"
                f"    open(os.path.join(tempfile.gettempdir(), {name!r}), 'w').close()\n"
                "    c.expect(True, 'a file left')\n")
    (row,) = score_all(lab, [fix], scratch=tmp_path / "work", decide=False)
    assert "Leaves a file in its temporary folder" in [c["name"] for c in row.checks]
    assert not (Path(tempfile.gettempdir()) / name).exists()
    assert not list(tmp_path.rglob(name))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_look_at_one_batch_and_an_evaluation_loop_are_no_epochs_in_lab_08(tmp_path):
    """Lab 08 reads the data each step trained on from the DataLoader: batches taken since
    the step before, of another pass over the loader than the step's (a look at one batch
    before training, an evaluation loop after each epoch), trained nothing. An audit's
    correct fixes with either lost the lab (0.867 and 0.500): the look made every epoch
    one pass late, the evaluation's batches were charged to the next step."""
    lab = REPO / "labs" / "08_three_bugs"
    both = WrongFix("the solution, with a look at one batch and an evaluation each epoch",
                    why="correct: neither trains", edits={"train.py": [
                        ("step = 0\n", "x0, y0, i0 = next(iter(loader))  # a look at one batch\n"
                                       "print0(f\"a batch of {tuple(x0.shape)}\")\nstep = 0\n"),
                        ("    print0(f\"epoch {epoch}: mean loss {total_loss / len(loader):.4f}\")\n",
                         "    with torch.no_grad():\n"
                         "        held = sum(F.mse_loss(model(x), y).item() for x, y, _ in loader)\n"
                         "    print0(f\"epoch {epoch}: mean loss {total_loss / len(loader):.4f}, "
                         "evaluated {held / len(loader):.4f}\")\n")]})
    (row,) = score_all(lab, [both], scratch=tmp_path, decide=False)
    assert row.fraction == 1.0 and not row.error, row.checks
