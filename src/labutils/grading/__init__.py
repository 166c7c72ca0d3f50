"""Grading: run a learner's notebook in a sandbox, then check their scripts for real.

Public API::

    from labutils.grading import check          # in a lab's checks.py
    from labutils.grading import run_checks     # a learner checks their own work
    from labutils.grading import grade          # what `labutils grade` calls

Modules, one concern each: checks (the @check framework), probe (measurements
inside ranks), runner (checks in their own process), notebook (locked cells,
parameters), execute (papermill with a whole-notebook deadline and an output cap),
sandbox (namespaces and limits), procs (process trees), supervisor (one
submission, start to end), report (results.json, feedback page, grades.csv),
batch (many submissions in parallel), release (a learner's copy of a lab), wrongfix
(a lab's catalogue of wrong fixes, graded), gradescope (the autograder zip), export
(grades for Canvas).
"""

from typing import Any

from labutils.grading.batch import GradingError, grade
from labutils.grading.checks import Checker, CheckResult, Part, check

__all__ = ["check", "Checker", "CheckResult", "Part", "run_checks", "grade", "GradingError"]


def __getattr__(name: str) -> Any:
    # run_checks is imported on first use: the grader starts `python -m
    # labutils.grading.runner`, and a runner already imported by this package would be
    # loaded twice (runpy warns about it on the checks' stderr)
    if name == "run_checks":
        from labutils.grading.runner import run_checks

        return run_checks
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
