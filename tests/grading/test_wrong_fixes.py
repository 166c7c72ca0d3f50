"""Every lab's catalogue of wrong fixes (labs/<lab>/wrong_fixes.py): each one graded by the
lab's checks, hidden ones included, must stay below its bound and the pass mark.

The checks run alone on each wrong fix (the notebook adds nothing to what they measure,
and its points are counted as earned), and stop once the verdict is certain:
`labutils wrongfixes LAB --full` runs every check.
"""

from __future__ import annotations

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
