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

`score_all()` runs the lab's checks, hidden ones included, on the edited files, the way the
grader runs them minus the notebook (which adds nothing to what they measure), and gives
the fraction of the lab's points the wrong fix would get with full notebook points: the
most a submission with this fix could score. The checks lab.json's "notebook_checks" names
grade what the notebook saves (lab 12's diagnosis), which no edit of the files changes:
they are not run, and count as passed too. It stops once the verdict is certain.
Each wrong fix must stay strictly below its bound, and every bound is at most the pass
mark. ``labutils wrongfixes LAB`` prints the table, after a control: the unchanged
solution, which must score 1 (where it does not, every fix is "caught" for nothing).
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


CONTROL = "the solution, unchanged"


@dataclass
class Scored:
    """A wrong fix graded by the lab's checks (fix None: the unchanged solution, the
    control that says the checks can give full marks on this machine)."""

    fix: WrongFix | None
    fraction: float          # of the lab's points, with the notebook's counted as earned
    bound: float
    checks: list[dict] = field(default_factory=list)   # name, score, points, hidden, required
    error: str = ""
    pass_mark: float = 0.6

    @property
    def required_failed(self) -> list[str]:
        return [c["name"] for c in self.checks if c.get("required") and not c.get("passed")]

    @property
    def name(self) -> str:
        return self.fix.name if self.fix is not None else CONTROL

    @property
    def full_marks(self) -> bool:
        return not self.error and self.fraction >= 1 - 1e-9

    @property
    def caught(self) -> bool:
        """Below its bound; or, where the bound is the pass mark (the fix must fail the
        lab), failing a required check, which fails the lab at any score."""
        if self.error or self.fix is None:
            return False
        failing_lab = self.bound >= self.pass_mark - 1e-9 and bool(self.required_failed)
        return self.fraction < self.bound - 1e-9 or failing_lab


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


def _learner_copy(lab: Path, target: Path, versions: Path | None = None) -> Path:
    """The learner's files of lab in target, each from the folder versions where it has one."""
    from labutils.grading.release import learner_files

    for rel, data in learner_files(lab).items():
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        theirs = versions / rel if versions is not None else None
        (target / rel).write_bytes(theirs.read_bytes() if theirs and theirs.is_file() else data)
    return target


def prepare_solution(lab: Path, target: Path) -> Path:
    """The learner's files with the solution's versions of them (the control)."""
    return _learner_copy(lab, target, solution_folder(lab))


def apply(fix: WrongFix, lab: Path, target: Path) -> Path:
    """Write the lab's files with the fix applied into target (a learner's folder)."""
    _learner_copy(lab, target)
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


class _Decided(Exception):
    """The fix cannot reach its bound any more: its remaining checks need not run."""


def _bound(the_lab, fix: WrongFix) -> float:
    bound = the_lab.pass_mark if fix.below is None else fix.below
    if bound > the_lab.pass_mark + 1e-9:
        raise GradingError(f"wrong fix {fix.name!r}: its bound {bound:g} is above the lab's "
                           f"pass mark {the_lab.pass_mark:g}")
    return bound


def _lost(tests: list[dict]) -> float:
    return sum(float(t["points"]) - float(t["score"]) for t in tests)


def score_all(lab: str | os.PathLike, fixes: list[WrongFix], *, scratch: Path | None = None,
              decide: bool = True, on_row=None, control: bool = False) -> list[Scored]:
    """Run the lab's checks (hidden ones too) on each wrong fix, one after the other in
    one process of their own (it keeps one warm server for all their runs), as the
    grader runs them minus the notebook.

    decide: stop a fix's checks as soon as the points still to come cannot lift it to
    its bound, or it failed a required check and its bound is the pass mark (the verdict
    is then certain; the fraction is the most it could still have scored).
    on_row(Scored) is called as each fix is done.
    control: first the unchanged solution (its row's fix is None), which must score 1:
    where it does not (another torch, a machine the checks do not suit), every fix is
    "caught" whatever it does, and the rows say nothing.
    """
    the_lab = load_lab(lab)
    entries: list[WrongFix | None] = [*([None] if control else []), *fixes]
    bounds = [1.0 if fix is None else _bound(the_lab, fix) for fix in entries]
    notebook = float(the_lab.config.get("notebook_points", 1))
    total = notebook + sum(float(c["points"]) for c in the_lab.checks)
    work = Path(scratch) if scratch is not None else Path(tempfile.mkdtemp(prefix="labutils-wrongfix-"))
    # the runs' temporary files (a script's DataLoader workers leave pymp-* folders) go
    # in a folder of their own, gone at the end: short, as a socket's path must be
    temporary = Path(tempfile.mkdtemp(prefix="labutils-wrongfix-tmp-"))
    rows: list[Scored] = []
    try:
        for i, fix in enumerate(entries):
            if fix is None:
                prepare_solution(the_lab.folder, work / f"fix{i}" / "learner")
            else:
                apply(fix, the_lab.folder, work / f"fix{i}" / "learner")
        tag = secrets.token_hex(8)
        command = [sys.executable, "-m", "labutils.grading.wrongfix", str(the_lab.folder),
                   str(work), str(len(entries)), *([] if decide else ["--full"]),
                   "--bounds", json.dumps(bounds)]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True, cwd=work, start_new_session=True,
                                env={**os.environ, procs.TAG_ENV: tag, "TMPDIR": str(temporary)})
        try:
            for line in proc.stdout or ():
                message = json.loads(line) if line.startswith("{") else {}
                if "index" not in message:
                    continue
                i, tests = message["index"], message["tests"]
                error = message.get("error") or ("" if tests else "the checks did not run")
                rows.append(Scored(
                    fix=entries[i], fraction=(total - _lost(tests)) / total if total else 0.0,
                    bound=bounds[i], error=error, pass_mark=the_lab.pass_mark,
                    checks=[{"name": t["name"], "score": t["score"], "points": t["points"],
                             "hidden": t.get("hidden", False), "passed": t.get("passed", False),
                             "required": t.get("required", False)} for t in tests]))
                if on_row is not None:
                    on_row(rows[-1])
        finally:
            procs.kill_everything(roots=[proc.pid], tag=tag, keep={proc.pid})
            proc.wait()
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
        if scratch is None:
            shutil.rmtree(work, ignore_errors=True)
    done = {id(r.fix) for r in rows}
    rows += [Scored(fix=f, fraction=1.0 if f is not None else 0.0, bound=b,
                    error="the checks did not run")
             for f, b in zip(entries, bounds) if id(f) not in done]
    return rows


def _grade_prepared(lab: Path, work: Path, count: int, bounds: list[float], decide: bool,
                    out) -> None:
    """The child of score_all: the checks on each prepared fix folder, one JSON line each."""
    from labutils.grading.runner import run_lab_checks

    the_lab = load_lab(lab)
    total = float(the_lab.config.get("notebook_points", 1)) + sum(
        float(c["points"]) for c in the_lab.checks)
    for i in range(count):
        tests: list[dict] = []

        def seen(result, bound=bounds[i], tests=tests) -> None:
            tests.append(result.to_json())
            # certain: it cannot reach its bound any more, or it failed a required check
            # (which fails the lab at any score, and the bound is the pass mark)
            required_failed = tests[-1].get("required") and not tests[-1].get("passed")
            if decide and ((total - _lost(tests)) / total < bound - 1e-9
                           or required_failed and bound >= the_lab.pass_mark - 1e-9):
                raise _Decided

        error = ""
        try:
            run_lab_checks(lab, work / f"fix{i}" / "learner", work / f"fix{i}" / "scratch",
                           hidden=True, on_result=seen, skip=the_lab.notebook_checks,
                           required_first=decide)
        except _Decided:
            pass
        except Exception as exc:  # noqa: BLE001 - the lab's checks broke on this fix
            error = f"{type(exc).__name__}: {exc}"
        out.write(json.dumps({"index": i, "tests": tests, "error": error}) + "\n")
        out.flush()


def format_row(r: Scored) -> str:
    if r.fix is None:
        verdict = "full" if r.full_marks else ("ERROR" if r.error else "LOSES")
        line = f"  {verdict:7} {r.fraction:5.3f} (must be 1)        {r.name}"
        if not r.full_marks and not r.error:
            lost = [c["name"] for c in r.checks if float(c["score"]) < float(c["points"])]
            line += f"\n          loses points on: {'; '.join(lost)}"
        return line + (f"\n          {r.error}" if r.error else "")
    verdict = "caught" if r.caught else ("ERROR" if r.error else "PASSES")
    line = f"  {verdict:7} {r.fraction:5.3f} (must stay < {r.bound:g})  {r.name}"
    if r.required_failed and r.caught and r.fraction >= r.bound - 1e-9:
        line += f"\n          fails the required check: {'; '.join(r.required_failed)}"
    return line + (f"\n          {r.error}" if r.error else "")


def format_scored(lab: str, rows: list[Scored]) -> str:
    fixes = [r for r in rows if r.fix is not None]
    head = f"{lab}: {sum(r.caught for r in fixes)} of {len(fixes)} wrong fixes caught"
    if any(r.fix is None and not r.full_marks for r in rows):
        head = (f"{lab}: the solution itself loses points on this machine, so the wrong "
                "fixes' verdicts say nothing (see its row)")
    return "\n".join([head, *(format_row(r) for r in rows)])


def add_subcommand(sub) -> None:
    """Register ``labutils wrongfixes``; its handler is ns.handler(ns) -> exit status."""
    p = sub.add_parser(
        "wrongfixes", help="grade a lab's catalogue of wrong fixes: each must stay below its bound",
        description="Run the checks of LAB (hidden ones too) on each wrong fix in its "
        f"{WRONG_FIXES_FILE}: the solution (or the starter) with a hurried learner's edit. "
        "Prints each fix's score as a fraction of the lab's points, notebook points counted "
        "as earned, after the unchanged solution's, which must be 1 (else no verdict means "
        "anything on this machine). Exit status: 0 when the solution scores 1 and every fix "
        "stays below its bound, 1 otherwise, 2 for bad input.")
    p.add_argument("lab", help="the lab folder (lab.json, checks, wrong_fixes.py)")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help="grade only this wrong fix (repeatable)")
    p.add_argument("--full", action="store_true",
                   help="run every check, even once the verdict is certain")

    def handler(ns) -> int:
        load_lab(ns.lab)  # a folder that is no lab, or none at all, says so
        fixes = catalogue(ns.lab)
        unknown = sorted(set(ns.only) - {f.name for f in fixes})
        if not fixes:
            raise GradingError(f"{ns.lab} keeps no {WRONG_FIXES_FILE}; see labs/07_resume_after_kill")
        if unknown:
            raise GradingError(f"{ns.lab}: no wrong fix named {unknown[0]!r}; expected the whole "
                               f"name of one of the {len(fixes)} in its {WRONG_FIXES_FILE}, e.g. "
                               f"--only {fixes[0].name!r}, or no --only to grade them all")
        chosen = [fix for fix in fixes if not ns.only or fix.name in ns.only]
        rows = score_all(ns.lab, chosen, decide=not ns.full, control=True,
                         on_row=lambda row: print(format_row(row), flush=True))
        print(format_scored(Path(ns.lab).resolve().name, rows).splitlines()[0])
        return 0 if all(r.caught if r.fix is not None else r.full_marks for r in rows) else 1

    p.set_defaults(handler=handler)


def main(argv: list[str] | None = None) -> int:
    """python -m labutils.grading.wrongfix LAB WORK COUNT [--full] --bounds JSON: the
    process score_all starts (WORK/fix<i>/learner prepared by it)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m labutils.grading.wrongfix")
    p.add_argument("lab", type=Path)
    p.add_argument("work", type=Path)
    p.add_argument("count", type=int)
    p.add_argument("--full", action="store_true")
    p.add_argument("--bounds", required=True)
    ns = p.parse_args(argv)
    result_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the checks or the scripts print goes to stderr
    sys.stdout = sys.stderr
    _grade_prepared(ns.lab, ns.work, ns.count, json.loads(ns.bounds), not ns.full, result_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
