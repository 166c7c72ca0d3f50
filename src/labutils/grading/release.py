"""A lab as learners get it: `labutils release LAB --out DIR`.

The lab folder is the instructor's copy: the notebook, the scripts, the public
checks (checks.py) and the hidden ones (hidden_checks.py). The learner's copy has
everything but the hidden checks; its lab.json says how many hidden checks the
grader runs and what they are worth (so `python checks.py` can tell the learner),
and drops what only the instructor needs ("starter_fails").

A release is verified the way it will be graded: the real grader grades the
learner's copy as a submission (notebook in the sandbox, every check, hidden ones
included) and the result must be the starter's: the notebook runs to its end, the
checks named in lab.json's "starter_fails" fail, every other check passes, and the
score is below the pass mark.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import cast

from labutils.errors import GradingError, cannot_write
from labutils.grading.batch import LAB_CONFIG, grade, load_lab
from labutils.grading.report import totals
from labutils.grading.runner import HIDDEN_CHECKS_FILE, hidden_summary

INSTRUCTOR_KEYS = ("starter_fails", "notebook_checks")   # lab.json keys a learner's copy leaves out


def learner_config(lab_folder: Path, config: dict) -> dict:
    """lab.json as the learner's copy has it."""
    public = {k: v for k, v in config.items() if k not in INSTRUCTOR_KEYS}
    public["hidden_checks"] = hidden_summary(lab_folder)
    return public


def learner_files(lab_folder: str | os.PathLike) -> dict[str, bytes]:
    """Every file of the learner's copy of a lab: the lab's files but the hidden checks."""
    lab = load_lab(lab_folder)
    files = {rel: data for rel, data in lab.files.items() if Path(rel).name != HIDDEN_CHECKS_FILE}
    config = learner_config(lab.folder, lab.config)
    files[LAB_CONFIG] = (json.dumps(config, indent=2) + "\n").encode()
    _refuse_solutions(lab.folder, lab.config.get("edit", []), files)
    return files


def _refuse_solutions(folder: Path, edit: list[str], files: dict[str, bytes]) -> None:
    """A file the learner edits must not be the course's solution (solutions/<lab>/)."""
    solved = folder.parent.parent / "solutions" / folder.name
    for rel in edit:
        answer = solved / rel
        if answer.is_file() and answer.read_bytes() == files.get(rel):
            raise GradingError(f"{rel} in lab {folder.name} is the same as the solution's; a "
                               "release would hand the solution to learners")


def starter_problems(result: dict, starter_fails: list[str]) -> list[str]:
    """How a graded starter differs from what lab.json's starter_fails promises ([] if not)."""
    problems = []
    if result.get("grader_error"):
        problems.append(f"the grader failed: {result['grader_error']}")
    if result.get("notebook", {}).get("status") != "completed":
        problems.append(f"the notebook did not run to its end "
                        f"({result.get('notebook', {}).get('status')})")
    failing = [t["name"] for t in result["tests"] if t["status"] != "passed" and t["max_score"]
               and t["name"] != "The notebook runs from top to bottom"]
    scored = [t["name"] for t in result["tests"] if t["max_score"]]
    for prefix in starter_fails:
        named = [name for name in scored if name.startswith(prefix)]
        if len(named) > 1:
            problems.append(f"starter_fails' {prefix!r} names {len(named)} checks ("
                            + "; ".join(named) + "): give each check a prefix of its own")
        if not any(name.startswith(prefix) for name in failing):
            problems.append(f"expected to fail but passed: {prefix}...")
    unexpected = [n for n in failing if not any(n.startswith(p) for p in starter_fails)]
    problems += [f"fails but should pass: {name}" for name in unexpected]
    if result.get("passed"):
        score, max_score = totals(result["tests"])
        problems.append(f"the starter passes ({score:g}/{max_score:g})")
    return problems


def release(lab: str | os.PathLike, out: str | os.PathLike, *, verify: bool = True,
            progress=print) -> Path:
    """Write the learner's copy of a lab into ``out`` (a new or empty folder) and,
    with verify, grade it to confirm it behaves as the lab's starter must.

    Raises GradingError when the lab cannot be read, ``out`` is not empty, or the
    verification finds the copy is not a proper starter (the copy stays for a look).
    """
    folder = Path(lab).resolve()
    target = Path(out).resolve()
    config = load_lab(folder).config  # not a lab: say so before anything about --out
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise GradingError(f"--out {out}: expected a new or empty folder (a release never "
                           "overwrites files); pick another folder or empty it")
    if target == folder or folder in target.parents:
        raise GradingError(f"--out {out}: expected a folder outside the lab {folder.name}")
    why = cannot_write(target)
    if why:
        raise GradingError(f"--out {out}: cannot write there ({why}); expected a new or "
                           "empty folder this user can write")
    files = learner_files(folder)
    starter_fails = config.get("starter_fails")
    if verify and not isinstance(starter_fails, list):
        raise GradingError(f"lab {folder.name}: {LAB_CONFIG} needs \"starter_fails\" (title "
                           "prefixes of the checks the starter fails) to verify a release; "
                           "add it, or release with --no-verify")
    for rel, data in files.items():
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        (target / rel).write_bytes(data)
    if progress is not None:
        progress(f"wrote {len(files)} files to {target} (no {HIDDEN_CHECKS_FILE}, "
                 f"{files_summary(files)})")
    if verify:
        problems = verify_release(folder, target, cast(list[str], starter_fails))  # checked above
        if problems:
            raise GradingError(f"the release in {out} is not a proper starter: "
                               + "; ".join(problems))
        if progress is not None:
            progress("verified: graded as a submission, the copy fails exactly the checks "
                     "its starter must fail, and its notebook runs to the end")
    return target


def files_summary(files: dict[str, bytes]) -> str:
    config = json.loads(files[LAB_CONFIG])
    hidden = config["hidden_checks"]
    return f"{hidden['count']} hidden check(s) worth {hidden['points']:g} points left out"


def verify_release(lab: Path, copy: Path, starter_fails: list[str]) -> list[str]:
    """Grade the learner's copy with the real grader; the ways it is not the starter."""
    with tempfile.TemporaryDirectory(prefix="labutils-release-") as tmp:
        # Graded from a copy of the copy: grading never writes into what learners get.
        submission = Path(tmp) / "submission"
        shutil.copytree(copy, submission)
        result = grade(lab, [submission], out_dir=Path(tmp) / "grades", jobs=1, progress=None)[0]
    return starter_problems(result, starter_fails)


def add_subcommand(sub) -> None:
    """Register ``labutils release``; its handler is ns.handler(ns) -> exit status."""
    p = sub.add_parser(
        "release", help="write the learner's copy of a lab (no hidden checks) and verify it",
        description="Write the learner's copy of LAB into DIR: the notebook, the scripts, the "
        "public checks; no hidden_checks.py, no solution. Then grade the copy with the real "
        "grader to confirm it is a proper starter (its notebook runs, the checks lab.json's "
        "starter_fails names fail, the others pass). Exit status: 0 written and verified, "
        "2 bad input or a failed verification.")
    p.add_argument("lab", help="the lab folder (lab.json, notebook, scripts, checks)")
    p.add_argument("--out", required=True, metavar="DIR", help="a new or empty folder")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="write the copy without grading it")
    def handler(ns) -> int:
        release(ns.lab, ns.out, verify=ns.verify)   # a bad lab or a failed check raises
        return 0

    p.set_defaults(handler=handler)
