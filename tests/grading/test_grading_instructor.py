"""What an instructor runs a class with: hidden checks, release, the Gradescope
autograder, grade export.

The real labs are graded in test_grading_labs (their released copies as the
starters); here: what a learner's copy holds, `python checks.py` in it, the
autograder zip run end to end in a folder standing in for /autograder, and the
Canvas and per-check exports.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from helpers import REPO

from labutils.grading import export, gradescope
from labutils.grading.batch import GradingError, load_lab, max_score
from labutils.grading.checks import VISIBILITY
from labutils.grading.release import learner_files, release
from labutils.grading.runner import HIDDEN_CHECKS_FILE

LABS = sorted(p.parent.name for p in (REPO / "labs").glob("*/lab.json"))
LABUTILS = [sys.executable, "-m", "labutils.cli"]


# ----------------------------------------------------------------- the learner's copy

@pytest.mark.parametrize("lab", LABS)
def test_a_learner_copy_holds_no_hidden_check_and_no_solution(lab, tmp_path):
    folder = REPO / "labs" / lab
    assert (folder / HIDDEN_CHECKS_FILE).is_file(), "every lab has hidden checks"
    copy = release(folder, tmp_path / lab, verify=False, progress=None)
    text = {p.relative_to(copy).as_posix(): p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    assert HIDDEN_CHECKS_FILE not in {Path(rel).name for rel in text}
    hidden = [c for c in load_lab(folder).checks if c["hidden"]]
    assert hidden and all(c["visibility"] in VISIBILITY for c in hidden)
    blob = b"\n".join(text.values())
    for c in hidden:   # not even the title of a hidden check
        assert c["name"].encode() not in blob, c["name"]
    solved = REPO / "solutions" / lab
    for rel in json.loads(text["lab.json"])["edit"]:
        assert text[rel] != (solved / rel).read_bytes(), f"{rel} is the solution"
    for path in solved.iterdir():   # no file of the solution that differs from the lab's
        if path.is_file() and path.read_bytes() != (folder / path.name).read_bytes():
            assert path.read_bytes() not in text.values(), path.name
    config = json.loads(text["lab.json"])
    assert "starter_fails" not in config
    assert config["hidden_checks"] == {"count": len(hidden),
                                       "points": sum(c["points"] for c in hidden),
                                       "required": sum(c["required"] for c in hidden)}


def _tiny_lab(root: Path) -> Path:
    """A lab whose checks measure a file (no launches): enough to test what surrounds them."""
    lab = root / "labs" / "tiny"
    lab.mkdir(parents=True)
    (lab / "lab.json").write_text(json.dumps({
        "title": "Tiny", "notebook": "tiny.ipynb", "edit": ["answer.txt"],
        "starter_fails": ["The answer is 42"]}))
    (lab / "tiny.ipynb").write_text(json.dumps({
        "cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    (lab / "answer.txt").write_text("41\n")
    (lab / "checks.py").write_text(
        "from labutils.grading import check\n\n\n"
        "def answer(c):\n    return c.learner_file('answer.txt').read_text().strip()\n\n\n"
        "@check('The answer is 42', points=2)\n"
        "def right(c):\n    c.expect(answer(c) == '42', 'answer.txt', measured=answer(c))\n\n\n"
        "if __name__ == '__main__':\n    from labutils.grading import run_checks\n\n    run_checks()\n")
    (lab / HIDDEN_CHECKS_FILE).write_text(
        "from checks import answer\n\nfrom labutils.grading import check\n\n\n"
        "@check('The answer has no spaces around it', points=1.5, visibility='after_due_date')\n"
        "def tidy(c):\n    c.expect(answer(c) == c.learner_file('answer.txt').read_text()"
        ".rstrip('\\n'), 'answer.txt')\n")
    return lab


def test_python_checks_py_in_a_learner_copy_runs_the_public_checks_and_counts_the_hidden(tmp_path):
    lab = _tiny_lab(tmp_path)
    copy = release(lab, tmp_path / "copy", verify=False, progress=None)
    run = subprocess.run([sys.executable, "checks.py"], cwd=copy, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "0/2  The answer is 42" in run.stdout
    assert "no spaces" not in run.stdout
    assert "The grader also runs 1 hidden check worth 1.5 points" in run.stdout
    # the instructor's folder runs both with hidden=True
    from labutils.grading import run_checks

    results = run_checks(lab, quiet=True, hidden=True)
    assert [(r.name, r.hidden, r.visibility) for r in results] == [
        ("The answer is 42", False, "visible"),
        ("The answer has no spaces around it", True, "after_due_date")]
    with pytest.raises(FileNotFoundError, match="no hidden_checks.py"):
        run_checks(copy, quiet=True, hidden=True)


def test_release_refuses_a_used_folder_and_a_lab_holding_its_solution(tmp_path):
    lab = _tiny_lab(tmp_path)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    with pytest.raises(GradingError, match="expected a new or empty folder"):
        release(lab, tmp_path / "used", verify=False, progress=None)
    (tmp_path / "solutions" / "tiny").mkdir(parents=True)
    (tmp_path / "solutions" / "tiny" / "answer.txt").write_text("41\n")   # the lab's own file
    with pytest.raises(GradingError, match="hand the solution to learners"):
        learner_files(lab)
    out = subprocess.run([*LABUTILS, "release", str(lab), "--out", str(tmp_path / "used")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("labutils release: ")
    # a folder that is no lab is named first, not the --out inside it
    with pytest.raises(GradingError, match=f"^{tmp_path} is not a lab: expected lab.json"):
        release(tmp_path, tmp_path / "copy", verify=False, progress=None)


@pytest.mark.slow
def test_labutils_release_verifies_the_copy_by_grading_it(tmp_path):
    """The command as an instructor types it: written, graded, verified; and a lab whose
    starter_fails does not hold is refused. (Every real lab's released copy is graded
    as its starter in test_grading_labs.)"""
    lab = _tiny_lab(tmp_path)
    out = subprocess.run([*LABUTILS, "release", str(lab), "--out", str(tmp_path / "copy")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "verified" in out.stdout
    (lab / "answer.txt").write_text("42\n")   # the starter now passes what it should fail
    out = subprocess.run([*LABUTILS, "release", str(lab), "--out", str(tmp_path / "copy2")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "not a proper starter: expected to fail but passed: The answer is 42" in out.stderr


# ------------------------------------------------------------------ Gradescope

def _autograder_root(tmp_path: Path, lab: Path, submission: Path) -> Path:
    """Unzip the autograder as Gradescope does, in a folder standing in for /autograder."""
    zip_path = gradescope.build(lab, tmp_path / "autograder.zip")
    root = tmp_path / "autograder"
    names = _unzip(zip_path, root / "source")
    assert {"setup.sh", "run_autograder", "README.md"} <= set(names)   # at the zip's root
    assert "## What this lab needs" in (root / "source" / "README.md").read_text()
    assert f"lab/{HIDDEN_CHECKS_FILE}" in names and "labutils/pyproject.toml" in names
    os.symlink(sys.prefix, root / "venv")   # what setup.sh builds (tested on its own below)
    shutil.copytree(submission, root / "submission")
    return root


def _unzip(zip_path: Path, dest: Path) -> list[str]:
    """Unzip with the modes the zip records (zipfile's extractall drops them)."""
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(dest)
        for info in zf.infolist():
            os.chmod(dest / info.filename, (info.external_attr >> 16) & 0o777)
        return zf.namelist()


def _gradescope_run(root: Path) -> dict:
    env = {**os.environ, gradescope.ROOT_ENV: str(root)}
    out = subprocess.run([str(root / "source" / "run_autograder")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads((root / "results" / "results.json").read_text())


@pytest.mark.slow
def test_the_autograder_zip_grades_a_solution_and_a_starter_in_a_relocated_root(tmp_path):
    """Lab 06's solution, and the tiny lab's starter (a real lab's starter costs a real
    grading more, and test_grading_labs grades every starter)."""
    runs = {}
    cases = (("solution", "06_distributed_evaluation", REPO / "labs",
              REPO / "solutions" / "06_distributed_evaluation"),
             ("starter", "tiny", _tiny_lab(tmp_path / "t").parent, _tiny_lab(tmp_path / "t2")))
    for kind, lab, labs, folder in cases:
        sub = tmp_path / kind / "submitted"
        # the solution as Gradescope unpacks a zipped folder: one folder down; the starter
        # as loose files
        inner = sub / "my-lab-06" if kind == "solution" else sub
        shutil.copytree(folder, inner, ignore=shutil.ignore_patterns(
            "checks.py", HIDDEN_CHECKS_FILE, "lab.json", "runs"))
        root = _autograder_root(tmp_path / kind, labs / lab, sub)
        (root / "submission_metadata.json").write_text(json.dumps(
            {"created_at": "2026-11-20T10:00:00.0+00:00",
             "assignment": {"due_date": "2026-11-19T23:59:00.0+00:00"},
             "users": [{"name": "Ada Lovelace", "email": "ada@example.org"}]}))
        runs[kind] = _gradescope_run(root)
    for data in runs.values():   # Gradescope's results.json
        assert isinstance(data["score"], float) and data["execution_time"] > 0
        assert data["max_score"] == sum(t["max_score"] for t in data["tests"])
        for t in data["tests"]:
            assert {"name", "score", "max_score", "status", "output", "visibility"} <= set(t)
            assert t["status"] in ("passed", "failed") and t["visibility"] in VISIBILITY
        assert any(t["visibility"] != "visible" for t in data["tests"]), "hidden checks ran"
        # the output is visible at once: no total that counts the held-back checks
        held = sum(t["max_score"] for t in data["tests"] if t["visibility"] != "visible")
        first = data["output"].splitlines()[0]
        assert held and f"/{data['max_score']:g}" not in first and "shown now" in first, first
        assert "Submitted by Ada Lovelace (late)." in data["output"]
        assert data["extra_data"]["late"] is True
    assert runs["solution"]["score"] == runs["solution"]["max_score"]
    assert not runs["starter"]["extra_data"]["passed"]
    assert runs["starter"]["score"] < 0.6 * runs["starter"]["max_score"]


def test_the_submitted_notebook_is_found_where_the_upload_put_it(tmp_path):
    lab = REPO / "labs" / "06_distributed_evaluation"
    name = load_lab(lab).config["notebook"]
    loose = tmp_path / "loose"
    (loose / ".ipynb_checkpoints").mkdir(parents=True)
    for path in (loose / name, loose / ".ipynb_checkpoints" / name):
        path.write_text("{}")
    assert gradescope.find_submission(loose, lab) == loose
    nested = tmp_path / "nested"
    (nested / "repo" / "lab06").mkdir(parents=True)
    (nested / "repo" / "lab06" / name).write_text("{}")
    (nested / "repo" / "scratch.ipynb").write_text("{}")   # the lab's notebook wins
    assert gradescope.find_submission(nested, lab) == nested / "repo" / "lab06"
    two = tmp_path / "two"
    for sub in ("a", "b"):
        (two / sub).mkdir(parents=True)
        (two / sub / name).write_text("{}")
    with pytest.raises(GradingError, match=f"2 notebooks in the submission .*upload one {name}"):
        gradescope.find_submission(two, lab)
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "train.py").write_text("")
    with pytest.raises(GradingError, match="no notebook in the submission"):
        gradescope.find_submission(tmp_path / "none", lab)


def test_submission_metadata_gives_the_names_and_the_late_flag(tmp_path):
    path = tmp_path / "submission_metadata.json"
    assert gradescope.read_metadata(path) == {}   # missing: grading goes on without it
    path.write_text(json.dumps({"created_at": "2026-11-19T09:00:00.0-05:00",
                                "assignment": {"due_date": "2026-11-19T23:59:00.0+00:00"},
                                "users": [{"name": "Ada"}, {"email": "b@example.org"}]}))
    assert gradescope.read_metadata(path) == {"names": ["Ada", "b@example.org"], "late": False}
    path.write_text("not json")
    assert gradescope.read_metadata(path) == {}


def test_the_setup_script_installs_python3_venv_when_ensurepip_is_missing(tmp_path):
    """Ubuntu's python3 without python3-venv: `venv --help` works, ensurepip is missing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/apt.log\n')
    (bin_dir / "fake-python").write_text(
        '#!/bin/sh\ncase "$*" in\n  *ensurepip*) exit 1 ;;\n  *"-m venv --help"*) exit 0 ;;\n'
        '  *"-m venv"*) exit 3 ;;\n  *) exit 0 ;;\nesac\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    script = tmp_path / "setup.sh"
    script.write_text(gradescope.SETUP_SH)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": "fake-python",
           gradescope.ROOT_ENV: str(tmp_path / "autograder")}
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 3, out.stderr   # it went on to make the venv
    assert "install -y -qq python3-venv" in (tmp_path / "apt.log").read_text()


def test_an_empty_submission_still_gets_a_results_json(tmp_path):
    root = tmp_path / "autograder"
    (root / "submission").mkdir(parents=True)
    data = gradescope.run(root)
    assert data["score"] == 0 and "submission is empty" in data["output"]
    assert data["max_score"] == 0 and data["execution_time"] >= 0  # no lab to count its points
    assert json.loads((root / "results" / "results.json").read_text()) == data
    shutil.copytree(REPO / "labs" / LABS[0], root / "source" / "lab")
    data = gradescope.run(root)
    assert data["score"] == 0 and data["max_score"] == max_score(load_lab(root / "source" / "lab")) > 0
    assert {"score", "max_score", "execution_time", "output", "tests"} <= set(data)


@pytest.mark.skipif(not os.environ.get("LABUTILS_INSTALL_TESTS"),
                    reason="installs torch and every pinned package into a fresh venv "
                           "(minutes); set LABUTILS_INSTALL_TESTS=1 to run it")
@pytest.mark.timeout(1800)
def test_setup_sh_builds_the_autograder_environment_from_scratch(tmp_path):
    zip_path = gradescope.build(REPO / "labs" / "06_distributed_evaluation", tmp_path / "ag.zip")
    root = tmp_path / "autograder"
    _unzip(zip_path, root / "source")
    env = {**os.environ, gradescope.ROOT_ENV: str(root),
           # this machine reaches only its package mirrors, whose torch is the CPU build
           "LABUTILS_TORCH_INDEX": os.environ.get("LABUTILS_TORCH_INDEX", "")}
    env.pop("VIRTUAL_ENV", None)
    t0 = time.monotonic()
    out = subprocess.run(["bash", str(root / "source" / "setup.sh")], env=env,
                         capture_output=True, text=True, timeout=1700)
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(f"setup.sh: {took:.0f} s")
    assert "torch 2.13.0" in out.stdout
    shutil.copytree(REPO / "solutions" / "06_distributed_evaluation", root / "submission",
                    ignore=shutil.ignore_patterns("checks.py", "runs"))
    data = _gradescope_run(root)
    assert data["score"] == data["max_score"]


# ------------------------------------------------------------------ exports

def _results(scores: dict[str, dict[str, float]]) -> dict[str, dict]:
    """name -> a results.json with the given check scores (each check out of 2)."""
    out = {}
    for name, checks in scores.items():
        tests = [{"name": check, "score": s, "max_score": 2.0,
                  "status": "passed" if s == 2 else "failed",
                  "visibility": "after_published" if check == "hidden one" else "visible"}
                 for check, s in checks.items()]
        tests.append({"name": "Locked cells and lab files are unchanged", "score": 0.0,
                      "max_score": 0.0, "status": "passed", "visibility": "visible"})
        out[name] = {"score": sum(checks.values()), "max_score": 2.0 * len(checks),
                     "tests": tests, "extra_data": {"lab": "tiny"}}
    return out


def test_the_per_check_summary_puts_the_most_failed_check_first(tmp_path):
    results = _results({"ann": {"a": 2, "b": 0, "hidden one": 0},
                        "bob": {"a": 2, "b": 1, "hidden one": 2},
                        "cy": {"a": 0, "b": 0, "hidden one": 2}})
    rows = export.write_summary(tmp_path, list(results.values()), "Tiny")
    assert [(r["check"], r["failed"], r["failed_percent"], r["mean_score"]) for r in rows] == [
        ("b", 3, 100.0, 0.33), ("a", 1, 33.3, 1.33), ("hidden one", 1, 33.3, 1.33)]
    assert rows[2]["visibility"] == "after_published"
    table = list(csv.DictReader((tmp_path / "checks.csv").open()))
    assert table[0] == {"check": "b", "visibility": "visible", "max_score": "2.0",
                        "submissions": "3", "failed": "3", "failed_percent": "100.0",
                        "mean_score": "0.33"}
    assert (tmp_path / "checks.png").read_bytes()[:4] == b"\x89PNG"


ROSTER = ("Student,ID,SIS User ID,SIS Login ID,Section,Lab 01 (77)\n"
          "    Points Possible,,,,,8\n"
          "\"Lee, Ann\",101,S1,ann,Tue,\n"
          "\"Ng, Bob\",102,S2,bob,Tue,\n"
          "\"Roy, Dee\",104,S4,dee,Wed,\n")


def test_labutils_export_writes_a_canvas_gradebook_csv(tmp_path):
    grades = tmp_path / "grades"
    for name, data in _results({"ann": {"a": 2, "b": 1}, "bob": {"a": 2, "b": 2},
                                "zed": {"a": 0, "b": 0}}).items():
        (grades / name).mkdir(parents=True)
        (grades / name / "results.json").write_text(json.dumps(data))
    (tmp_path / "roster.csv").write_text(ROSTER)
    out = subprocess.run([*LABUTILS, "export", str(grades), "--roster", str(tmp_path / "roster.csv"),
                          "--assignment", "Lab 01 (77)"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "2 grades for Lab 01 (77)" in out.stdout and "not in the roster" in out.stdout
    assert "zed" in out.stdout and "1 learner(s) of the roster have no submission" in out.stdout
    rows = list(csv.reader((grades / "canvas.csv").open()))
    assert rows == [["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "Lab 01 (77)"],
                    ["Points Possible", "", "", "", "", "4"],
                    ["Lee, Ann", "101", "S1", "ann", "Tue", "3"],
                    ["Ng, Bob", "102", "S2", "bob", "Tue", "4"]]
    assert (grades / "checks.csv").is_file()
    bad = subprocess.run([*LABUTILS, "export", str(grades), "--roster", str(tmp_path / "roster.csv"),
                          "--assignment", "Lab 01", "--match", "Email"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no column 'Email'" in bad.stderr and bad.stderr.count("\n") == 1
    roster = tmp_path / "roster.csv"
    bad = subprocess.run([*LABUTILS, "export", str(grades), "--roster", str(roster),
                          "--assignment", "Lab 01 (77)", "--out", str(roster / "canvas.csv")],
                         capture_output=True, text=True, timeout=120)
    assert (bad.returncode, bad.stderr) == (2, (
        f"labutils export: --out {roster / 'canvas.csv'}: cannot write the CSV there ({roster} is "
        "a file); expected a .csv in a folder this user can write, e.g. --out canvas.csv\n"))


def _canvas_zip(path: Path, files: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return path


def test_a_canvas_download_is_unpacked_one_folder_per_learner(tmp_path):
    zip_path = _canvas_zip(tmp_path / "submissions.zip", {
        "leeann_101_9001_tiny.ipynb": "{}", "leeann_101_9002_answer-1.txt": "42\n",
        "ngbob_LATE_102_9003_answer.txt": "41\n", "ngbob_LATE_102_9004_notes-2.txt": "x"})
    folders = export.unpack_canvas(zip_path, tmp_path / "subs", ["tiny.ipynb", "answer.txt"],
                                   tmp_path)
    assert [f.name for f in folders] == ["101", "102"]
    assert sorted(p.name for p in folders[0].iterdir()) == ["answer.txt", "tiny.ipynb"]
    assert sorted(p.name for p in folders[1].iterdir()) == ["answer.txt", "notes-2.txt"]
    assert json.loads((tmp_path / export.CANVAS_INDEX).read_text()) == {
        "101": {"student": "leeann", "late": False}, "102": {"student": "ngbob", "late": True}}
    bad = _canvas_zip(tmp_path / "other.zip", {"my_lab/tiny.ipynb": "{}"})
    with pytest.raises(GradingError, match="expected Canvas's Download Submissions zip"):
        export.unpack_canvas(bad, tmp_path / "subs2", ["tiny.ipynb"], tmp_path)


def test_the_export_scales_points_marks_complete_and_zeroes_missing_work():
    results = _results({"ann": {"a": 2, "b": 1}, "bob": {"a": 2, "b": 2}})
    results["ann"]["extra_data"]["passed"], results["bob"]["extra_data"]["passed"] = False, True
    roster = list(csv.DictReader(io.StringIO(ROSTER)))[1:]
    rows = lambda text: [r[-1] for r in csv.reader(io.StringIO(text))][1:]  # noqa: E731
    text, _, absent = export.canvas_csv(results, roster, "Lab", match="SIS Login ID", points=10)
    assert rows(text) == ["10", "7.5", "10"] and absent == ["Roy, Dee"]
    text, _, _ = export.canvas_csv(results, roster, "Lab", match="SIS Login ID", complete=True,
                                   missing_zero=True)
    assert rows(text) == ["", "incomplete", "complete", "incomplete"]
    text, _, _ = export.canvas_csv(results, roster, "Lab", match="SIS Login ID", missing_zero=True)
    assert rows(text) == ["4", "3", "4", "0"]
    with pytest.raises(GradingError, match="--points -1"):
        export.canvas_csv(results, roster, "Lab", match="SIS Login ID", points=-1)


@pytest.mark.slow
def test_a_canvas_zip_is_graded_and_exported_on_the_learners_canvas_ids(tmp_path):
    lab = _tiny_lab(tmp_path)
    notebook = (lab / "tiny.ipynb").read_text()
    zip_path = _canvas_zip(tmp_path / "submissions.zip", {
        "leeann_101_9001_tiny.ipynb": notebook, "leeann_101_9002_answer-1.txt": "42\n",
        "ngbob_LATE_102_9003_tiny.ipynb": notebook, "ngbob_LATE_102_9004_answer.txt": "41\n"})
    out = subprocess.run([*LABUTILS, "grade", str(lab), str(zip_path), "--out",
                          str(tmp_path / "grades"), "--jobs", "2"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    (tmp_path / "roster.csv").write_text(ROSTER)
    out = subprocess.run([*LABUTILS, "export", str(tmp_path / "grades"), "--roster",
                          str(tmp_path / "roster.csv"), "--assignment", "Lab 01 (77)",
                          "--points", "7", "--missing-zero"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "late: 102" in out.stdout
    rows = list(csv.reader((tmp_path / "grades" / "canvas.csv").open()))
    # matched on Canvas's user id (the roster's ID); scaled to 7 points (Bob: 2.5 of 4.5,
    # the notebook and the hidden check); Dee sent nothing
    assert rows[1:] == [["Points Possible", "", "", "", "", "7"],
                        ["Lee, Ann", "101", "S1", "ann", "Tue", "7"],
                        ["Ng, Bob", "102", "S2", "bob", "Tue", "3.89"],
                        ["Roy, Dee", "104", "S4", "dee", "Wed", "0"]]


def test_checks_that_die_say_so_and_the_grader_log_keeps_their_last_words(tmp_path):
    """A checks process that ends without a result (exit code 127 on a GPU machine, whose
    CUDA could not start under the address-space limit) left no reason anywhere."""
    from labutils.grading import grade
    from labutils.grading.report import GRADER_LOG

    lab = _tiny_lab(tmp_path)
    checks = (lab / "checks.py").read_text().replace(
        "def right(c):\n",
        "def right(c):\n    import os, sys\n    print('libfoo: cannot start: out of memory', "
        "file=sys.stderr, flush=True)\n    os._exit(127)\n")
    (lab / "checks.py").write_text(checks)
    copy = release(lab, tmp_path / "copy", verify=False, progress=None)
    [result] = grade(lab, [copy], out_dir=tmp_path / "grades", progress=None)
    right = next(t for t in result["tests"] if t["name"] == "The answer is 42")
    assert right["output"] == ("[FAIL] not measured: the checks ended (exit code 127) before this "
                               "one ran; what they printed is in the instructor's grader.log")
    log = (tmp_path / "grades" / result["name"] / GRADER_LOG).read_text()
    assert "== checks: stderr\n" in log and "libfoo: cannot start: out of memory" in log
    published = (tmp_path / "grades" / result["name"] / "results.json").read_text()
    assert "libfoo" not in published and "libfoo" not in (
        tmp_path / "grades" / result["name"] / "feedback.html").read_text()
