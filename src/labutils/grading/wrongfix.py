"""Wrong fixes: the submissions a hurried learner would make, which a lab must fail.

Each lab keeps a catalogue in its folder, ``wrong_fixes.py``, for instructors and the
tests (never in a learner's copy: it is left out of the lab's files like a run folder)::

    from labutils.grading.wrongfix import WrongFix

    WRONG_FIXES = [
        WrongFix("never loads the checkpoint", below=0.6,
                 why="saves every step, but the restarted run trains again from step 0",
                 edits={"train.py": [("state = load(path)", "state = None")]}),
    ]

A wrong fix is the solution (or, with ``base="starter"``, the lab's starter) with each
``(old, new)`` edit applied to the file it names; ``old`` must occur exactly once, so an
edit that no longer fits the solution fails loudly instead of testing nothing.

`score()` runs the lab's checks, hidden ones included, on the edited files, the way the
grader runs them minus the notebook (which adds nothing to what they measure), and gives
the fraction of the lab's points the wrong fix would get with full notebook points: the
most a submission with this fix could score. It stops once the verdict is certain.
Each wrong fix must stay strictly below its bound, and every bound is at most the pass
mark. ``labutils wrongfixes LAB`` prints the table.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labutils.errors import GradingError
from labutils.grading import procs
from labutils.grading.batch import WRONG_FIXES_FILE, load_lab

BASES = ("solution", "starter")


@dataclass
class WrongFix:
    """One wrong or half fix of a lab (see the module's docstring)."""

    name: str
    why: str
    edits: dict[str, list[tuple[str, str]]]
    below: float | None = None   # None: the lab's pass mark
    base: str = "solution"

    def __post_init__(self) -> None:
        if self.base not in BASES:
            raise GradingError(f"wrong fix {self.name!r}: base must be one of {BASES}, "
                               f"not {self.base!r}")
        if not self.edits or not all(self.edits.values()):
            raise GradingError(f"wrong fix {self.name!r}: give at least one (old, new) edit "
                               "per file it changes")


@dataclass
class Scored:
    """A wrong fix graded by the lab's checks."""

    fix: WrongFix
    fraction: float          # of the lab's points, with the notebook's counted as earned
    bound: float
    checks: list[dict] = field(default_factory=list)   # name, score, points, hidden
    error: str = ""

    @property
    def caught(self) -> bool:
        return not self.error and self.fraction < self.bound - 1e-9


def catalogue(lab: str | os.PathLike) -> list[WrongFix]:
    """The wrong fixes of a lab folder ([] when it keeps none)."""
    path = Path(lab) / WRONG_FIXES_FILE
    if not path.is_file():
        return []
    spec = importlib.util.spec_from_file_location(f"labutils_wrong_fixes_{Path(lab).name}", path)
    if spec is None or spec.loader is None:
        raise GradingError(f"{path}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fixes = getattr(module, "WRONG_FIXES", None)
    if not isinstance(fixes, list) or not all(isinstance(f, WrongFix) for f in fixes):
        raise GradingError(f"{path}: expected WRONG_FIXES = [WrongFix(...), ...]")
    names = [f.name for f in fixes]
    if len(set(names)) != len(names):
        raise GradingError(f"{path}: two wrong fixes share a name")
    return fixes


def solution_folder(lab: Path) -> Path:
    return lab.parent.parent / "solutions" / lab.name


def apply(fix: WrongFix, lab: Path, target: Path) -> Path:
    """Write the lab's files with the fix applied into target (a learner's folder)."""
    from labutils.grading.release import learner_files

    for rel, data in learner_files(lab).items():
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        (target / rel).write_bytes(data)
    source = solution_folder(lab) if fix.base == "solution" else lab
    for rel, edits in fix.edits.items():
        if not (source / rel).is_file():
            raise GradingError(f"wrong fix {fix.name!r}: no {rel} in {source}")
        text = (source / rel).read_text()
        for old, new in edits:
            found = text.count(old)
            if found != 1:
                raise GradingError(f"wrong fix {fix.name!r}: {old!r} occurs {found} times in "
                                   f"the {fix.base}'s {rel}; each edit must match exactly once")
            text = text.replace(old, new)
        (target / rel).write_text(text)
    return target


def score(lab: str | os.PathLike, fix: WrongFix, *, scratch: Path | None = None,
          decide: bool = True) -> Scored:
    """Run the lab's checks (hidden ones too) on the wrong fix, in a process of their own
    as the grader runs them.

    decide: stop as soon as the points still to come cannot lift the fix to its bound
    (the verdict is then certain; the fraction is the most it could still have scored).
    """
    the_lab = load_lab(lab)
    bound = the_lab.pass_mark if fix.below is None else fix.below
    if bound > the_lab.pass_mark + 1e-9:
        raise GradingError(f"wrong fix {fix.name!r}: its bound {bound:g} is above the lab's "
                           f"pass mark {the_lab.pass_mark:g}")
    notebook = float(the_lab.config.get("notebook_points", 1))
    total = notebook + sum(float(c["points"]) for c in the_lab.checks)
    own = scratch is None
    work = Path(scratch) if scratch is not None else Path(tempfile.mkdtemp(prefix="labutils-wrongfix-"))
    tests: list[dict[str, Any]] = []
    errors: list[str] = []
    try:
        learner = apply(fix, the_lab.folder, work / "learner")
        (work / "scratch").mkdir(parents=True, exist_ok=True)
        tag = secrets.token_hex(8)
        command = [sys.executable, "-m", "labutils.grading.runner", "--checks",
                   str(the_lab.folder), "--learner", str(learner), "--scratch",
                   str(work / "scratch"), "--hidden"]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True, cwd=learner, start_new_session=True,
                                env={**os.environ, procs.TAG_ENV: tag})
        try:
            for line in proc.stdout or ():
                message = json.loads(line) if line.startswith("{") else {}
                tests += [message["test"]] if "test" in message else []
                errors += [message["error"]] if "error" in message else []
                lost = sum(float(t["points"]) - float(t["score"]) for t in tests)
                if decide and (total - lost) / total < bound - 1e-9:
                    break  # whatever the other checks give, the fix stays below its bound
        finally:
            procs.kill_everything(roots=[proc.pid], tag=tag, keep={proc.pid})
            proc.wait()
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    lost = sum(float(t["points"]) - float(t["score"]) for t in tests)
    checks = [{"name": t["name"], "score": t["score"], "points": t["points"],
               "hidden": t.get("hidden", False)} for t in tests]
    error = errors[0] if errors else ("" if tests else "the checks did not run")
    return Scored(fix=fix, fraction=(total - lost) / total if total else 0.0, bound=bound,
                  checks=checks, error=error)


def format_row(r: Scored) -> str:
    verdict = "caught" if r.caught else ("ERROR" if r.error else "PASSES")
    line = f"  {verdict:7} {r.fraction:5.3f} (must stay < {r.bound:g})  {r.fix.name}"
    return line + (f"\n          {r.error}" if r.error else "")


def format_scored(lab: str, rows: list[Scored]) -> str:
    return "\n".join([f"{lab}: {sum(r.caught for r in rows)} of {len(rows)} wrong fixes caught",
                      *(format_row(r) for r in rows)])


def add_subcommand(sub) -> None:
    """Register ``labutils wrongfixes``; its handler is ns.handler(ns) -> exit status."""
    p = sub.add_parser(
        "wrongfixes", help="grade a lab's catalogue of wrong fixes: each must stay below its bound",
        description="Run the checks of LAB (hidden ones too) on each wrong fix in its "
        f"{WRONG_FIXES_FILE}: the solution (or the starter) with a hurried learner's edit. "
        "Prints each fix's score as a fraction of the lab's points, notebook points counted "
        "as earned. Exit status: 0 when every fix stays below its bound, 1 when one reaches "
        "it, 2 for bad input.")
    p.add_argument("lab", help="the lab folder (lab.json, checks, wrong_fixes.py)")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help="grade only this wrong fix (repeatable)")
    p.add_argument("--full", action="store_true",
                   help="run every check, even once the verdict is certain")

    def handler(ns) -> int:
        fixes = catalogue(ns.lab)
        unknown = sorted(set(ns.only) - {f.name for f in fixes})
        if not fixes or unknown:
            raise GradingError(f"{ns.lab}: no wrong fix named {unknown[0]!r}" if unknown else
                               f"{ns.lab} keeps no {WRONG_FIXES_FILE}; see labs/07_resume_after_kill")
        rows = []
        for fix in fixes:
            if ns.only and fix.name not in ns.only:
                continue
            rows.append(score(ns.lab, fix, decide=not ns.full))
            print(format_row(rows[-1]), flush=True)
        print(format_scored(Path(ns.lab).resolve().name, rows).splitlines()[0])
        return 0 if all(r.caught for r in rows) else 1

    p.set_defaults(handler=handler)
