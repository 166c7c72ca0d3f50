"""The grader's pure parts: scoring, locked cells, reports, names, lab loading. No runs."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

import nbformat
import pytest
from helpers import REPO
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from labutils.cli import main as cli
from labutils.run.diagnosis import Failure
from labutils.run.hang import Hang
from labutils.grading import report
from labutils.grading.batch import GradingError, grade, load_lab, submission_names
from labutils.grading.checks import Checker, CheckResult, Part, Run, check, collect_checks, run_check
from labutils.grading.execute import first_error
from labutils.grading.notebook import cell_label, read_notebook, restore_locked_cells
from labutils.run.result import RankResult, RunResult

LABS = sorted(p.name for p in (REPO / "labs").iterdir() if (p / "lab.json").is_file())


# ------------------------------------------------------------------------ scoring

@pytest.mark.parametrize(
    ("parts", "error", "score", "passed"),
    [
        ([True, True], "", 4.0, True),
        ([True, False], "", 2.0, False),
        ([False, False], "", 0.0, False),
        ([True, True, False], "", 2.67, False),
        ([], "", 0.0, False),                      # nothing measured is not a pass
        ([True, True], "KeyError: 'x'", 0.0, False),  # a crashed check scores nothing
    ],
)
def test_partial_credit(parts, error, score, passed):
    result = CheckResult(name="c", points=4, parts=[Part(f"p{i}", ok) for i, ok in enumerate(parts)],
                         error=error)
    assert (result.score, result.passed) == (score, passed)
    assert CheckResult.from_json(result.to_json()).score == score


def test_weights_share_the_points():
    result = CheckResult(name="c", points=3, parts=[Part("big", True, weight=2), Part("small", False)])
    assert result.score == 2.0


def test_feedback_says_measured_and_expected():
    part = Part("3 ranks", False, measured="12 predictions", expected="11")
    assert part.line() == "[FAIL] 3 ranks\n       measured: 12 predictions\n       expected: 11"
    assert "expected" not in Part("2 ranks", True, measured="11", expected="11").line()


@pytest.mark.parametrize("points", [0, -1, "3", True, None])
def test_check_needs_positive_points(points):
    with pytest.raises(ValueError, match="points must be a number > 0"):
        check("x", points=points)


def test_checks_keep_their_order_and_a_crash_costs_only_that_check(tmp_path):
    import types

    module = types.ModuleType("fake_checks")
    source = (
        "from labutils.grading import check\n"
        "@check('second in file', points=1)\n"
        "def b(c):\n    c.expect(True, 'fine')\n"
        "@check('third in file', points=2)\n"
        "def a(c):\n    raise KeyError('rank 3')\n"
    )
    path = tmp_path / "fake_checks.py"
    path.write_text(source)
    exec(compile(source, str(path), "exec"), module.__dict__)
    fns = collect_checks(module)
    assert [fn.__labutils_check__.name for fn in fns] == ["second in file", "third in file"]
    checker = Checker(tmp_path, tmp_path, tmp_path / "scratch")
    results = [run_check(fn, checker) for fn in fns]
    assert [r.score for r in results] == [1.0, 0.0]
    assert results[1].error == "KeyError: 'rank 3'"
    assert "the check stopped: KeyError" in results[1].output()


# ---------------------------------------------------------------- run problems

def _result(reason, *, failure=None, hang=None, attempts=1, at_stop=None):
    return RunResult(ok=reason == "ok", world_size=2, duration_s=12.0, log_dir=Path("."),
                     ranks=[RankResult(rank=0), RankResult(rank=1)], failure=failure, hang=hang,
                     reason=reason, attempts=[{}] * attempts, at_stop=at_stop)


def test_run_problem_names_the_learners_line(tmp_path):
    learner = tmp_path / "work"
    learner.mkdir()
    tb = (f'Traceback (most recent call last):\n  File "/somewhere/labutils/grading/probe.py", line 9, '
          f'in main\n  File "{learner}/train.py", line 57, in <module>\n    loss.backward()\n'
          'RuntimeError: Expected to have finished reduction')
    failure = Failure(rank=1, exc_type="RuntimeError", message="Expected to have finished reduction",
                      file="/somewhere/probe.py", line=9, traceback=tb)
    run = Run(label="x", result=_result("failed", failure=failure), learner_dir=learner)
    assert run.problem == ("failed: rank 1 raised RuntimeError: Expected to have finished "
                           "reduction (at train.py:57)")
    stack = f'Current thread 0x00007f (most recent call first):\n  File "{learner}/ring.py", line 24 in ring_all_reduce\n'
    hang = Hang(stacks={0: stack, 1: stack}, waiting={0: "probe.py:3", 1: "probe.py:3"},
                stragglers=[], calls={0: "send", 1: "send"}, silent_s=10.2)
    run = Run(label="x", result=_result("hang", hang=hang), learner_dir=learner)
    assert run.problem == ("hung: no rank made progress for 10 s; rank 0 waits at ring.py:24 in "
                           "send(); rank 1 waits at ring.py:24 in send()")
    assert Run(label="x", result=_result("timeout"), learner_dir=learner).problem == "timed out after 12 s"
    spin = f'Current thread 0x00007f (most recent call first):\n  File "{learner}/train.py", line 8 in <module>\n'
    at = Hang(stacks={0: stack, 1: spin}, waiting={0: "probe.py:3", 1: "train.py:8"}, stragglers=[1],
              calls={0: "send", 1: ""})
    assert Run(label="x", result=_result("timeout", at_stop=at), learner_dir=learner).problem == (
        "timed out after 12 s; rank 0 was at ring.py:24 in send(); rank 1 was at train.py:8")
    assert Run(label="x", error="syntax error in train.py:3", learner_dir=learner).problem == \
        "could not start: syntax error in train.py:3"


def test_completed_records_why_not(tmp_path):
    checker = Checker(tmp_path, tmp_path, tmp_path)
    ok_twice = Run(label="x", result=_result("ok", attempts=2), learner_dir=tmp_path)
    assert checker.completed(ok_twice, "killed run", restarts=1)
    assert not checker.completed(ok_twice, "plain run")
    assert checker.parts[-1].measured == "finished after 1 restart(s)"


def test_the_required_checks_can_run_first_each_group_in_the_files_order(tmp_path):
    """The wrong fixes' scoring stops at the first failed required check: run first, a
    required check decides a fix before the others' runs are made."""
    from labutils.grading.runner import run_lab_checks

    (tmp_path / "checks.py").write_text(
        "from labutils.grading import check\n\n\n"
        "@check('first, optional', points=1)\ndef a(c):\n    c.expect(True, 'x')\n\n\n"
        "@check('second, required', points=1, required=True)\ndef b(c):\n    c.expect(True, 'x')\n\n\n"
        "@check('third, optional', points=1)\ndef d(c):\n    c.expect(True, 'x')\n\n\n"
        "@check('fourth, required', points=1, required=True)\ndef e(c):\n    c.expect(True, 'x')\n")
    for first, names in ((False, ["first", "second", "third", "fourth"]),
                         (True, ["second", "fourth", "first", "third"])):
        results, _ = run_lab_checks(tmp_path, tmp_path, tmp_path / f"scratch-{first}", required_first=first)
        assert [r.name.split(",")[0] for r in results] == names


def test_a_repeated_launch_is_a_run_of_its_own_and_cached_as_one(tmp_path, monkeypatch):
    """Checks share one run of a launch; repeat=1 is a second run of the same launch (two
    runs with the same --seed compared), shared in turn by the checks that ask for it."""
    checker = Checker(tmp_path, tmp_path, tmp_path / "scratch")
    launched = []

    def fake_launch(path, nproc, args, measure, fault, max_restarts, timeout, hang_timeout, label):
        launched.append(label)
        return Run(label=label, result=_result("ok"), learner_dir=tmp_path)

    monkeypatch.setattr(checker, "_launch", fake_launch)
    args = ["--seed", 5]
    first = checker.run("train.py", 3, args=args, measure=["weights"])
    assert checker.run("train.py", 3, args=args, measure=["weights"]) is first
    again = checker.run("train.py", 3, args=args, measure=["weights"], repeat=1)
    assert again is not first
    assert checker.run("train.py", 3, args=args, measure=["weights"], repeat=1) is again
    assert launched == ["train.py on 3 ranks --seed 5",
                        "train.py on 3 ranks --seed 5 (run 2 of the same)"]
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="repeat must be a whole number >= 0"):
            checker.run("train.py", 3, args=args, repeat=bad)


def test_a_launch_on_two_nodes_is_a_run_of_its_own(tmp_path, monkeypatch):
    """nnodes=2 (two torchrun agents on this machine, LOCAL_RANK 0 on each) is another
    launch than the same ranks on one node, and reaches _launch; nnodes=1 is the default."""
    checker = Checker(tmp_path, tmp_path, tmp_path / "scratch")
    launched = []

    def fake_launch(path, nproc, args, measure, fault, max_restarts, timeout, hang_timeout, label,
                    nnodes=1):
        launched.append((label, nnodes))
        return Run(label=label, result=_result("ok"), learner_dir=tmp_path)

    monkeypatch.setattr(checker, "_launch", fake_launch)
    one = checker.run("train.py", 1, measure=["files"])
    two = checker.run("train.py", 1, measure=["files"], nnodes=2)
    assert two is not one and checker.run("train.py", 1, measure=["files"], nnodes=2) is two
    assert checker.run("train.py", 1, measure=["files"], nnodes=1) is one
    assert launched == [("train.py on 1 rank", 1), ("train.py on 1 rank per node x 2 nodes", 2)]
    for bad in (0, 1.5, True, "2"):
        with pytest.raises(ValueError, match="nnodes must be a whole number >= 1"):
            checker.run("train.py", 1, nnodes=bad)


# ----------------------------------------------------------------- notebooks

def _nb(*cells):
    nb = new_notebook()
    nb.cells = list(cells)
    return nb


def _cell(cid, source, tags=(), kind="code"):
    cell = (new_code_cell if kind == "code" else new_markdown_cell)(source)
    cell["id"] = cid
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


LAB_NB = _nb(_cell("intro", "# Lab", kind="md"), _cell("parameters", "n = 2", ["parameters"]),
             _cell("run", "r = launch()", ["locked"]), _cell("mine", "# yours"),
             _cell("check", "run_checks()", ["locked", "nbval-skip"]))


@pytest.mark.parametrize(
    ("cells", "order", "notes"),
    [
        ([c for c in LAB_NB.cells], ["intro", "parameters", "run", "mine", "check"], []),
        # the learner's own cells stay where they put them
        ([LAB_NB.cells[1], _cell("new", "x = 3"), LAB_NB.cells[2], LAB_NB.cells[4]],
         ["parameters", "new", "run", "check"], []),
        # an edit is undone and reported; trailing blanks are no edit
        ([LAB_NB.cells[1], _cell("run", "r = launch()   \n\n"), _cell("check", "print('all fine')")],
         ["parameters", "run", "check"], ["locked cell 'check' was edited"]),
        # removed cells come back where the lab has them
        ([LAB_NB.cells[0], LAB_NB.cells[3]], ["intro", "parameters", "run", "mine", "check"],
         ["'parameters' was removed", "'run' was removed", "'check' was removed"]),
        # a duplicated locked cell runs once
        ([LAB_NB.cells[1], LAB_NB.cells[2], LAB_NB.cells[2], LAB_NB.cells[4]],
         ["parameters", "run", "check"], ["'run' appeared twice"]),
    ],
)
def test_locked_cells_are_restored(cells, order, notes):
    nb, found = restore_locked_cells(_nb(*cells), LAB_NB)
    assert [c["id"] for c in nb.cells] == order
    assert len(found) == len(notes) and all(n in f for n, f in zip(notes, found))
    by_id = {c["id"]: c for c in nb.cells}
    for lab_cell in LAB_NB.cells:
        if lab_cell["id"] in ("parameters", "run", "check"):
            assert by_id[lab_cell["id"]].source == lab_cell.source
            assert by_id[lab_cell["id"]].metadata.get("tags") == lab_cell.metadata["tags"]


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "not valid JSON (Expecting property name"),
        ('{"cells": 3}', "JSON but not a notebook"),
        ("[1, 2]", "JSON but not a notebook"),
        ('{"cells": [], "nbformat": 4, "nbformat_minor": 5, "metadata": {}, "extra": 1}',
         "does not follow the notebook format"),
    ],
)
def test_broken_notebooks_are_described(tmp_path, content, problem):
    path = tmp_path / "nb.ipynb"
    path.write_text(content)
    read = read_notebook(path)
    assert read.nb is None and problem in read.problem
    assert read_notebook(tmp_path / "missing.ipynb").problem.startswith("the notebook could not be read")


def test_first_error_respects_raises_exception():
    error = {"output_type": "error", "ename": "AssertionError", "evalue": "", "traceback": []}
    allowed = _cell("symptom", "assert False", ["raises-exception"])
    allowed["outputs"] = [error]
    bad = _cell("scratch", "1/0")
    bad["outputs"] = [dict(error, ename="ZeroDivisionError")]
    assert first_error(_nb(_cell("a", "x = 1"), allowed)) is None
    assert first_error(_nb(allowed, _cell("b", "y"), bad)) == 2
    assert cell_label(_nb(allowed, bad), 1) == "cell 2 (id scratch): 1/0"


# -------------------------------------------------------------------- reports

def _graded(**extra):
    tests = [{"name": "notebook", "score": 1.0, "max_score": 1.0, "status": "passed", "output": ""},
             {"name": "<b>checks</b>", "score": 2.5, "max_score": 4.0, "status": "failed",
              "output": "[FAIL] 3 ranks <script>"},
             {"name": "integrity", "score": 0.0, "max_score": 0.0, "status": "passed", "output": ""}]
    return {"name": "alice", "lab": "01_x", "lab_title": "Lab 01", "pass_mark": 0.6, "passed": True,
            "tests": tests, "duration_s": 12.3, **extra}


def test_results_json_is_gradescope_format():
    data = report.gradescope_results(_graded())
    assert (data["score"], data["max_score"], data["execution_time"]) == (3.5, 5.0, 12.3)
    assert set(data["tests"][0]) >= {"name", "score", "max_score", "status", "output"}
    assert data["extra_data"]["passed"] is True
    json.dumps(data)


def test_feedback_page_escapes_what_the_learner_controls():
    page = report.feedback_page(_graded(grader_error="", integrity=["x"]))
    assert "<script>" not in page and "&lt;script&gt;" in page and "&lt;b&gt;checks" in page


def test_hidden_results_keep_their_visibility_and_stay_off_the_feedback_page():
    result = _graded()
    result["tests"].insert(2, {"name": "secret: 5 ranks", "score": 0.0, "max_score": 3.0,
                               "status": "failed", "output": "[FAIL] measured: 7",
                               "visibility": "after_published", "hidden": True})
    data = report.gradescope_results(result)
    assert [t["visibility"] for t in data["tests"]] == [
        "visible", "visible", "after_published", "visible"]
    assert data["max_score"] == 8.0    # Gradescope adds every test, shown or not
    page = report.feedback_page(result)
    assert "secret" not in page and "measured: 7" not in page
    assert "3.5 / 5 on the checks shown here; 1 more check worth 3 points is graded too" in page
    assert "shown when the grades are published" in page
    with pytest.raises(ValueError, match="visibility must be one of"):
        check("x", points=1, visibility="later")
    with pytest.raises(ValueError, match="learner never sees the result, and a check carries points"):
        check("x", points=1, visibility="hidden")


def test_a_required_check_that_fails_fails_the_lab_at_any_score():
    """@check(required=True): the score stays, the verdict names the check."""
    tests = _graded()["tests"]
    tests[1].update(required=True, status="passed", score=4.0)
    assert report.passes(tests, 0.6) and report.required_failed(tests) == []
    tests[1].update(status="failed", score=3.9)  # 4.9 of 5: far above the pass mark
    assert not report.passes(tests, 0.6)
    assert report.required_failed(tests) == ["<b>checks</b>"]
    result = _graded(passed=report.passes(tests, 0.6))
    result["tests"] = tests
    assert report.verdict(result) == "not passed: a required check failed (<b>checks</b>)"
    assert "4.9/5 (not passed: a required check failed (<b>checks</b>), pass mark 60%)" in \
        report.gradescope_results(result)["output"]
    page = report.feedback_page(result)
    assert "not passed: a required check failed (&lt;b&gt;checks&lt;/b&gt;)" in page
    assert "(required to pass)" in page
    assert not report.passes([dict(tests[0], score=0.0)], 0.6)  # below the mark, nothing required
    with pytest.raises(ValueError, match="required must be True or False"):
        check("x", points=1, required="yes")
    spec = check("y", points=1, required=True)(lambda c: None).__labutils_check__
    assert spec.required and CheckResult.from_json(
        CheckResult(name="y", points=1, required=True).to_json()).required


def test_a_wrong_fix_that_fails_a_required_check_is_caught_when_it_must_fail_the_lab():
    from labutils.grading.wrongfix import Scored, WrongFix

    fix = WrongFix("freeze", why="", edits={"train.py": [("a", "b")]})
    failed = [{"name": "trains", "score": 0.0, "points": 1.0, "passed": False, "required": True}]
    assert Scored(fix, fraction=0.92, bound=0.6, checks=failed, pass_mark=0.6).caught
    assert Scored(fix, fraction=0.92, bound=0.6, checks=failed, pass_mark=0.6).required_failed == ["trains"]
    # a lower bound asks for a lower score: the verdict "fails the lab" is not enough
    assert not Scored(fix, fraction=0.92, bound=0.5, checks=failed, pass_mark=0.6).caught
    passed = [dict(failed[0], score=1.0, passed=True)]
    assert not Scored(fix, fraction=0.92, bound=0.6, checks=passed, pass_mark=0.6).caught
    assert not Scored(fix, fraction=0.92, bound=0.6, checks=failed, pass_mark=0.6, error="x").caught


def test_grades_csv_lists_failing_checks():
    rows = list(csv.DictReader(io.StringIO(report.grades_csv([_graded(), _graded(name="bob", passed=False)]))))
    assert [r["submission"] for r in rows] == ["alice", "bob"]
    assert rows[0]["score"] == "3.5" and rows[0]["percent"] == "70.0" and rows[1]["passed"] == "no"
    assert rows[0]["problems"] == "<b>checks</b>"


def test_write_atomic_leaves_no_temporary_file(tmp_path):
    report.write_atomic(tmp_path / "a" / "results.json", "{}")
    report.write_atomic(tmp_path / "a" / "results.json", "[1]")
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["results.json"]
    assert (tmp_path / "a" / "results.json").read_text() == "[1]"


# ---------------------------------------------------------------- batch, CLI

@pytest.mark.parametrize(
    ("paths", "names"),
    [
        (["/x/alice/lab.ipynb", "/x/bob"], ["alice", "bob"]),
        (["/a/solutions/01/01.ipynb", "/a/labs/01/01.ipynb"], ["solutions-01", "labs-01"]),
        (["/x/s/a.ipynb", "/x/s/b.ipynb"], ["x-s-a", "x-s-b"]),
        (["/x/s/a.ipynb", "/x/s/a.ipynb"], ["x-s-a-1", "x-s-a-2"]),
        (["/x/Ann Lee (late)/nb.ipynb"], ["Ann_Lee_late"]),
    ],
)
def test_submission_names(paths, names):
    assert submission_names([Path(p) for p in paths]) == names


@pytest.mark.parametrize("lab", LABS)
def test_every_lab_loads(lab):
    loaded = load_lab(REPO / "labs" / lab)
    assert loaded.checks and sum(c["points"] for c in loaded.checks) > 0
    assert "checks.py" in loaded.files and loaded.config["notebook"] in loaded.files
    nb = nbformat.reads(loaded.files[loaded.config["notebook"]].decode(), as_version=4)
    tags = [set(c.metadata.get("tags", [])) for c in nb.cells]
    assert any("parameters" in t for t in tags)
    assert any("raises-exception" in t for t in tags), "the starter must show its bug"


@pytest.mark.parametrize("lab", LABS)
def test_solved_notebooks_keep_the_labs_locked_cells(lab):
    starter = nbformat.read(REPO / "labs" / lab / f"{lab}.ipynb", as_version=4)
    solved = nbformat.read(REPO / "solutions" / lab / f"{lab}.ipynb", as_version=4)
    _, notes = restore_locked_cells(solved, starter)
    assert notes == []


def test_bad_labs_are_usage_errors(tmp_path):
    with pytest.raises(GradingError, match="expected lab.json"):
        load_lab(tmp_path)
    (tmp_path / "lab.json").write_text('{"notebook": "lab.ipynb", "edit": ["train.py"]}')
    with pytest.raises(GradingError, match=r"missing: \['lab.ipynb', 'train.py', 'checks.py'\]"):
        load_lab(tmp_path)
    for name in ("lab.ipynb", "train.py"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "checks.py").write_text("import no_such_module\n")
    with pytest.raises(GradingError, match="checks.py does not load: ModuleNotFoundError"):
        load_lab(tmp_path)
    (tmp_path / "checks.py").write_text("x = 1\n")
    with pytest.raises(GradingError, match="declares no @check"):
        load_lab(tmp_path)


def test_cli_usage_errors_exit_2(tmp_path, capsys):
    lab = REPO / "labs" / LABS[0]
    assert cli(["grade", str(lab), str(tmp_path / "nope.ipynb"), "--out", str(tmp_path / "o")]) == 2
    assert "submission not found" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("my answer\n")
    assert cli(["grade", str(lab), str(tmp_path / "notes.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "cannot grade" in capsys.readouterr().err
    assert cli(["grade", str(lab), str(lab), "--out", "/proc/no/such"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "labutils grade: --out /proc/no/such: cannot write there (No such file or directory); "
        "expected a folder this user can write, e.g. --out grades"]
    assert cli(["grade", str(tmp_path), str(lab), "--out", str(tmp_path / "o")]) == 2
    with pytest.raises(GradingError, match="jobs"):
        grade(lab, [lab], out_dir=tmp_path / "o", jobs=0)
    for timeout in (0, -5.0, float("nan")):  # 0 once meant the lab's deadline, silently
        with pytest.raises(GradingError, match="timeout: expected seconds > 0"):
            grade(lab, [lab], out_dir=tmp_path / "o", timeout=timeout)


@pytest.mark.parametrize(("files", "expected"), [
    ({}, 2.0),                                                     # no quota: the affinity
    ({"cpu.max": "50000 100000\n"}, 0.5),                          # cgroup v2, Gradescope's
    ({"cpu.max": "max 100000\n"}, 2.0),
    ({"cpu,cpuacct/cpu.cfs_quota_us": "150000\n",
      "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 1.5),          # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),
])
def test_the_grader_counts_the_cpus_its_cgroup_allows(tmp_path, monkeypatch, files, expected):
    from labutils.grading import procs

    monkeypatch.setattr(procs.os, "sched_getaffinity", lambda pid: {0, 1})
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert procs.available_cpus(str(tmp_path), membership="") == expected
    assert procs.hang_scale(expected) == max(1.0, 2.0 / expected)


@pytest.mark.parametrize(("membership", "files", "expected"), [
    # v1, cpu and cpuacct mounted apart: a cgroup nested under the machine's
    ("2:cpuacct:/\n1:cpu:/grading/job\n0::/\n",
     {"cpu/grading/job/cpu.cfs_quota_us": "50000\n", "cpu/grading/job/cpu.cfs_period_us": "100000\n",
      "cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, 0.5),
    # a parent's quota caps its children too
    ("1:cpu,cpuacct:/a/b\n", {"cpu,cpuacct/a/cpu.cfs_quota_us": "75000\n",
                              "cpu,cpuacct/a/cpu.cfs_period_us": "100000\n"}, 0.75),
    # v2: the process's own cgroup, and the root's
    ("0::/box\n", {"box/cpu.max": "25000 100000\n", "cpu.max": "max 100000\n"}, 0.25),
])
def test_the_grader_reads_the_quota_of_its_own_cgroup_and_its_parents(
        tmp_path, monkeypatch, membership, files, expected):
    from labutils.grading import procs

    monkeypatch.setattr(procs.os, "sched_getaffinity", lambda pid: {0, 1})
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert procs.available_cpus(str(tmp_path), membership=membership) == expected


def test_a_grader_on_half_a_cpu_gives_the_notebook_four_times_the_hang_timeout(monkeypatch):
    from labutils.grading import procs, supervisor

    monkeypatch.setattr(procs, "available_cpus", lambda: 0.5)
    sup = supervisor.Supervisor.__new__(supervisor.Supervisor)
    sup.config = {"parameters": {"hang_timeout": 8, "self_check": False}}
    assert sup._parameters() == {"hang_timeout": 32.0, "self_check": False}


def test_the_autograder_readme_gives_the_settings_the_measured_figures_call_for(tmp_path):
    """labs/resources.json (benchmarks/lab_resources.py) -> the zip's README: memory and
    timeout from the peak and the slower grading; a lab not measured says how to measure."""
    import shutil

    from labutils.grading.gradescope import readme

    lab = tmp_path / "labs" / "04_gradient_accumulation"
    shutil.copytree(REPO / "labs" / lab.name, lab)
    assert "Not measured yet" in readme(load_lab(lab))
    assert "lab_resources.py --labs 04_gradient_accumulation --write" in readme(load_lab(lab))
    figures = {"solution": {"wall_s": 50.0, "cpu_s": 41.5, "peak_mb": 700, "anon_peak_mb": 600},
               "starter": {"wall_s": 70.0, "cpu_s": 30.0, "peak_mb": 500, "anon_peak_mb": 420}}
    (lab.parent / "resources.json").write_text(json.dumps(
        {"measured": "2026-11-26", "machine": "x86_64, load 0.10 before",
         "labs": {lab.name: figures}}))
    text = readme(load_lab(lab))
    assert "| solution | 50 | 41.5 | 700 | 600 |" in text
    assert "| learner copy, unchanged | 70 | 30 | 500 | 420 |" in text
    assert "at least 1024 MB" in text and "768 MB: too little" in text     # 900 -> 1024
    assert "at least 5 minutes" in text and "10: enough" in text           # 210 s -> 4 -> 5
    figures["solution"]["anon_peak_mb"], figures["starter"]["wall_s"] = 300, 400  # 630 > 500
    (lab.parent / "resources.json").write_text(json.dumps({"labs": {lab.name: figures}}))
    text = readme(load_lab(lab))
    assert "at least 768 MB" in text and "768 MB: enough" in text and "at least 20 minutes" in text  # 630
    assert "10: raise it" in text


def test_a_cuda_build_of_torch_gets_no_address_space_limit_and_the_report_says_why(
        tmp_path, monkeypatch):
    """CUDA's driver fails to start under RLIMIT_AS ("out of memory", then a dead kernel or
    checks process: seen on a GPU machine); the resident-size watch stays."""
    from labutils.grading import batch
    from labutils.grading.sandbox import set_limits

    lab = batch.load_lab(REPO / "labs" / "02_rank_zero_collective")
    assert batch.torch_is_gpu_build() is False        # this machine's pinned CPU build
    cpu = batch.Batch(lab, out_dir=tmp_path, timeout=None, isolate=False)
    assert cpu.limits["memory_bytes"] == 4 << 30 and "memory_note" not in cpu.limits
    monkeypatch.setattr(batch, "torch_is_gpu_build", lambda: True)
    gpu = batch.Batch(lab, out_dir=tmp_path, timeout=None, isolate=False)
    assert gpu.limits["memory_bytes"] == 0 and gpu.limits["tree_memory_bytes"] == 4 << 30
    for b in (cpu, gpu):
        b.close()
    # what the sandbox applies and reports, in a child (setrlimit cannot be undone)
    import multiprocessing as mp
    import resource

    def child(queue, limits):
        held = set_limits(limits, os.getuid())
        queue.put((held, resource.getrlimit(resource.RLIMIT_AS)[0]))

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(queue, {"memory_bytes": 0, "memory_note": batch.NO_ADDRESS_LIMIT,
                                                   "file_bytes": 1 << 30}))
    proc.start()
    held, address_space = queue.get(timeout=30)
    proc.join()
    assert address_space == resource.RLIM_INFINITY
    assert held[0].startswith("memory per process: no address-space limit (a CUDA build")
    assert not any("<=" in h and h.startswith("memory") for h in held)


def test_the_grader_log_keeps_the_end_of_each_phases_stderr(tmp_path):
    from labutils.grading import report

    quiet, loud, kernel = tmp_path / "quiet.log", tmp_path / "checks.log", tmp_path / "nb.log"
    quiet.write_text("  \n")
    kernel.write_text("Fatal Python error: Segmentation fault\n")
    loud.write_bytes(b"x" * (report.LOG_TAIL_BYTES + 10) + b"\nthe last words\n")
    log = report.grader_log({"notebook": str(kernel), "checks": str(loud)}, quiet).decode()
    assert log.startswith("== notebook: stderr\nFatal Python error: Segmentation fault\n")
    assert f"== checks: stderr (its last 64 KiB of {report.LOG_TAIL_BYTES + 26:,} bytes)" in log
    assert log.endswith("the last words\n") and "supervisor" not in log
    assert report.grader_log({"checks": str(quiet)}, tmp_path / "missing.log") is None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the limit is set for another user")
def test_the_process_limit_leaves_room_for_each_process_threads_and_still_stops_a_bomb():
    """RLIMIT_NPROC counts threads: with 'processes <= 64' a 16-core machine's ranks could not
    start torch's thread pools ("Resource temporarily unavailable", a dead kernel: seen on a
    GPU machine). One allowed process now holds threads_per_process() threads, no more."""
    import threading

    from labutils.grading.sandbox import set_limits, threads_per_process

    per = threads_per_process()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # a child that becomes an unused uid under the limit of one process
        code = 3
        try:
            held = set_limits({"processes": 1}, 45999)
            os.setgid(45999)
            os.setuid(45999)
            stop = threading.Event()
            started = 0
            try:
                for _ in range(per + 20):
                    threading.Thread(target=stop.wait, daemon=True).start()
                    started += 1
            except RuntimeError:
                pass
            stop.set()
            os.write(write, json.dumps({"held": held, "started": started}).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        seen = json.loads(f.read() or "{}")
    assert os.waitpid(pid, 0)[1] == 0
    assert seen["held"][0] == f"processes <= 1 (threads <= {per} in all)"
    assert per - 5 <= seen["started"] < per, seen   # the main thread counts too


@pytest.mark.slow
def test_a_file_named_like_a_module_torch_imports_is_named_in_the_feedback(tmp_path):
    """A submission with queue.py beside its notebook: the notebook runner (nbclient
    imports queue) cannot start, nor can any run of the checks. The feedback says why,
    naming the file as the learner does, never the grader's folders."""
    import shutil

    lab = "02_rank_zero_collective"
    submission = tmp_path / "with_queue"
    shutil.copytree(REPO / "solutions" / lab, submission)
    (submission / "queue.py").write_text("jobs = []\n")
    [result] = grade(REPO / "labs" / lab, [submission], out_dir=tmp_path / "out", progress=None)
    tests = {t["name"]: t["output"] for t in result["tests"]}
    assert tests["The notebook runs from top to bottom"].endswith(
        "its last words: ImportError: cannot import name 'Empty' from 'queue' (queue.py)."), tests
    runs = [out for name, out in tests.items() if "could not start" in out]
    assert runs and all("got 'queue.py'; rename it (e.g. my_queue.py)" in out for out in runs), tests
    assert not any("labutils-grade-" in out or str(tmp_path) in out for out in tests.values()), tests


def test_a_rename_counts_as_from_outside_only_from_beyond_the_targets_folder(tmp_path):
    """Labs 07 and 10: a temporary file beside the checkpoint or in a folder inside its
    folder is on its file system; one from the system's temporary folder (absolute, as
    the probe writes paths outside the run's folder) or from a folder above is not. A
    correct fix writing checkpoints/.tmp/x scored 0.588 in lab 10 when any other folder
    counted."""
    result = _result("ok")
    result.records = [{"rank": rank, "probe": "files", "writes": [], "loads": [], "renames": renames}
                      for rank, renames in enumerate([
                          [["ckpt/checkpoint.pt.partial", "ckpt/checkpoint.pt"]],   # beside it
                          [["ckpt/.tmp/x", "ckpt/checkpoint.pt"]],                  # inside its folder
                          [["/tmp/x", "ckpt/checkpoint.pt"]],                       # another file system
                          [["other/x", "ckpt/checkpoint.pt"]],                      # a folder beside
                          [["ckpt/../x", "ckpt/checkpoint.pt"]],
                          [["/tmp/x", "/data/ckpt/checkpoint.pt"]],                 # both absolute
                          [["/data/ckpt/.tmp/x", "/data/ckpt/checkpoint.pt"]],
                          [["/tmp/x", "ckpt/elsewhere.pt"]]])]                      # not a target
    run = Run(label="train.py on 8 ranks", result=result, learner_dir=tmp_path)
    assert run.renames_from_outside({"ckpt/checkpoint.pt", "/data/ckpt/checkpoint.pt"}) == [2, 3, 4, 5]
    assert run.renames_from_outside(set()) == []


def test_a_starter_fails_prefix_that_names_two_checks_is_a_problem_of_the_release():
    """lab.json's starter_fails names each check the starter fails by a prefix of its
    title: a new hidden check whose title began like an older one's ("One rank writes
    checkpoint.pt") was counted with it, and release verified a starter that failed five
    checks against four prefixes."""
    from labutils.grading.release import starter_problems

    def graded(*failing_names):
        tests = [{"name": name, "status": "failed" if name in failing_names else "passed", "max_score": 1}
                 for name in ("One rank writes checkpoint.pt at 2 ranks",
                              "One rank writes checkpoint.pt on a cluster", "The run resumes")]
        return {"tests": tests, "notebook": {"status": "completed"}, "passed": False}

    both = graded("One rank writes checkpoint.pt at 2 ranks", "One rank writes checkpoint.pt on a cluster")
    problems = starter_problems(both, ["One rank writes checkpoint.pt"])
    assert problems == ["starter_fails' 'One rank writes checkpoint.pt' names 2 checks (One rank writes "
                        "checkpoint.pt at 2 ranks; One rank writes checkpoint.pt on a cluster): give each "
                        "check a prefix of its own"]
    assert starter_problems(both, ["One rank writes checkpoint.pt at", "One rank writes checkpoint.pt on"]) == []
    assert starter_problems(graded("The run resumes"), ["The run"]) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="the grader gives each submission a user of "
                    "its own only when it runs as root")
def test_two_submissions_graded_at_once_never_share_a_learner_user(monkeypatch):
    """The user is drawn from the job's tag; two gradings at once that drew the same one
    would share its process limit (a fork bomb in one starves the other). Each holds its
    id while it grades; the next takes another, and the id is free again after. (Where
    Python's files are closed to other users, as under /root, the grader keeps root and
    draws no user: the paths are taken as open here.)"""
    import tempfile

    from labutils.grading import supervisor as module
    from labutils.grading.supervisor import LEARNER_IDS, Supervisor

    monkeypatch.setattr(module, "_open_to_others", lambda path: True)

    def supervisor(root: str) -> Supervisor:
        made = Supervisor.__new__(Supervisor)   # only what choosing the user reads
        made.job, made.root, made._uid_claim = {"tag": "0a1b2c3d"}, Path(root), None
        return made

    with tempfile.TemporaryDirectory() as root:
        first, second = supervisor(root), supervisor(root)
        (uid, _), why = first._learner_user()
        assert LEARNER_IDS[0] <= uid < LEARNER_IDS[1], why
        (other, _), _ = second._learner_user()
        assert other != uid
        first._uid_claim.release()
        (again, _), _ = supervisor(root)._learner_user()
        assert again == uid
