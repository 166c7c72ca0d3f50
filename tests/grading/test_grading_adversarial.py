"""Submissions that misbehave each get a clear result, and hurt neither the grader nor the others.

All of them are graded in one batch, two at a time, against a tiny lab whose check
launches the submitted script for real (1 rank, no torch import in the script), so
the batch stays quick and every misbehaviour meets the whole pipeline.
"""

from __future__ import annotations

import hashlib
import os
import json
import secrets
import shutil
import subprocess
import textwrap
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from labutils.grading import procs
from labutils.grading.batch import grade

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Every submission's script warns on stderr: warnings never cost points.
WORK = ("import sys, warnings\nfrom labutils.dist import report\n"
        "warnings.warn('this API is deprecated')\nprint('noise', file=sys.stderr)\nreport(answer=42)\n")
MARK = f"labutils-adversary-{secrets.token_hex(4)}"  # in the command line of every stray process
NOTEBOOK_TIMEOUT = 14  # the tiny lab's notebook runs in about 3 s

CHECKS = '''
from labutils.grading import check


@check("work.py reports the answer", points=2)
def answer(c):
    run = c.run("work.py", 1)
    if c.completed(run, "1 rank"):
        got = run.values("answer")
        c.expect(got == [42], "1 rank", measured=f"answer {got}", expected="[42]")
'''


def _notebook(attack: str) -> str:
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    cells = [("parameters", "self_check = True", ["parameters"]),
             ("run", "import sys\nprint('the lab runs')\nprint('a warning', file=sys.stderr)", ["locked"]),
             ("mine", attack, [])]
    nb.cells = []
    for cid, source, tags in cells:
        cell = new_code_cell(source, metadata={"tags": tags} if tags else {})
        cell["id"] = cid
        nb.cells.append(cell)
    return nbformat.writes(nb)


@pytest.fixture
def tiny_lab(tmp_path):
    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "lab.json").write_text(json.dumps({
        "title": "Tiny lab", "notebook": "tiny.ipynb", "edit": ["work.py"], "pass_mark": 0.5,
        "parameters": {"self_check": False}, "checks_timeout": 90,
        "limits": {"output_bytes": 64 << 10, "memory_bytes": 2 << 30}}))
    (lab / "work.py").write_text(WORK)
    (lab / "checks.py").write_text(CHECKS)
    (lab / "tiny.ipynb").write_text(_notebook("# your code"))
    return lab


def _stray() -> str:
    """A process that ignores SIGTERM and leaves its session, with MARK in its command line."""
    return textwrap.dedent(f"""
        import subprocess, sys
        code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
        for _ in range(2):
            subprocess.Popen([sys.executable, "-c", code, "{MARK}"], start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # and a double fork: the grandchild's parent exits at once
        subprocess.run([sys.executable, "-c",
                        "import os, subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                        + repr(code) + ", '{MARK}'], start_new_session=True); os._exit(0)"])
        print("spawned")
    """)


def _attacks(lab: Path, out: Path) -> dict[str, str | None]:
    """name -> the code of the learner's cell (None: the notebook is not valid JSON)."""
    fake = json.dumps({"score": 100, "max_score": 100, "tests": [], "output": "forged"})
    return {
        "infinite_loop": "while True:\n    pass",
        "print_1gb_loop": "line = 'x' * 1000\nfor _ in range(1_000_000):\n    print(line)",
        "print_1gb_once": "print('x' * 2**30)",
        "memory_hog": "hog = bytearray(3 * 2**30)",
        "sys_exit": "import sys\nsys.exit(3)",
        "os_exit": "import os\nos._exit(0)",
        "kill_own_group": "import os, signal\nos.killpg(0, signal.SIGKILL)",
        "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
        "ignore_sigterm": _stray(),
        "write_outside": textwrap.dedent(f"""
            from pathlib import Path
            for target, text in [(Path({str(lab)!r}) / "checks.py", "raise SystemExit"),
                                 (Path({str(out)!r}) / "write_outside" / "results.json", {fake!r}),
                                 (Path({str(out)!r}) / "grades.csv", "forged"),
                                 (Path({str(out)!r}) / "infinite_loop" / "results.json", {fake!r})]:
                try:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(text)
                    print("wrote", target.name)
                except OSError as exc:
                    print("refused:", exc)
        """),
        "temp_files": textwrap.dedent("""
            import tempfile
            from ipykernel import get_connection_file
            print("kernel:", get_connection_file())
            print("mine:", tempfile.mkstemp(suffix=".json")[1])
        """),
        "fake_results": f"print({fake!r})\nprint('{{\"score\": 100}}')",
        "invalid_json": None,
    }


def _submissions(tmp_path: Path, attacks: dict) -> list[Path]:
    paths = []
    for name, attack in attacks.items():
        folder = tmp_path / "subs" / name
        folder.mkdir(parents=True)
        (folder / "work.py").write_text(WORK)
        (folder / "tiny.ipynb").write_text(_notebook(attack) if attack is not None else '{"cells": [')
        paths.append(folder)
    return paths


def _leftovers() -> list[str]:
    """Command lines of live processes that carry MARK (read from /proc: ps cuts long lines)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if MARK in line:
            found.append(f"{entry.name} {line}")
    return found


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def _grade_all(tiny_lab, tmp_path, *, isolate: bool, only=None) -> tuple[dict, Path]:
    out = tmp_path / "out"
    attacks = {k: v for k, v in _attacks(tiny_lab, out).items() if only is None or k in only}
    before = _digest(tiny_lab)
    results = grade(tiny_lab, _submissions(tmp_path, attacks), out_dir=out, jobs=2,
                    timeout=NOTEBOOK_TIMEOUT, isolate=isolate, progress=None)
    assert _leftovers() == [], "processes of a submission outlived the grading"
    assert [p for r in results for p in procs.tagged(r["tag"])] == [], "a process outlived the grading"
    assert _digest(tiny_lab) == before, "the lab's files changed"
    by = {r["name"]: r for r in results}
    assert list(by) == list(attacks)
    for name, result in by.items():
        assert not result.get("grader_error"), (name, result)
        data = json.loads((out / name / "results.json").read_text())
        assert data["extra_data"]["submission"] == name
        assert data["max_score"] == 3.0
        check = data["tests"][1]
        assert (check["score"], check["status"]) == (2.0, "passed"), (name, check)
    rows = (out / "grades.csv").read_text().splitlines()
    assert len(rows) == len(attacks) + 1 and "forged" not in rows
    return by, out


def _notebook_output(result: dict) -> str:
    return result["tests"][0]["output"]


def test_adversarial_submissions_in_the_sandbox(tiny_lab, tmp_path):
    by, out = _grade_all(tiny_lab, tmp_path, isolate=True)
    status = {name: r["notebook"]["status"] for name, r in by.items()}
    assert status["infinite_loop"] == "timeout"
    assert f"did not finish within {NOTEBOOK_TIMEOUT} s" in _notebook_output(by["infinite_loop"])
    assert status["print_1gb_loop"] in ("output_limit", "timeout")
    # One 1 GB string: the kernel's own memory limit drops it, or the output cap does.
    for name in ("print_1gb_loop", "print_1gb_once"):
        assert (out / name / "executed.ipynb").stat().st_size < 1 << 20
    assert status["memory_hog"] == "error" and "MemoryError" in _notebook_output(by["memory_hog"])
    assert status["sys_exit"] == "error" and "SystemExit" in _notebook_output(by["sys_exit"])
    assert status["os_exit"] == "kernel_died" and status["kill_own_group"] == "kernel_died"
    assert status["kill_parent"] not in ("completed", "not_run")
    assert status["ignore_sigterm"] == "completed"
    assert status["fake_results"] == "completed" and by["fake_results"]["passed"]
    assert status["invalid_json"] == "not_run"
    assert "not valid JSON" in _notebook_output(by["invalid_json"])
    executed = nbformat.read(out / "write_outside" / "executed.ipynb", as_version=4)
    printed = "".join(o.get("text", "") for o in executed.cells[-1].outputs)
    assert "wrote" not in printed and printed.count("refused:") == 4
    # Temporary files (the kernel's connection file too, which a killed papermill never
    # removes) were in the grading's own folder, and went with it.
    executed = nbformat.read(out / "temp_files" / "executed.ipynb", as_version=4)
    printed = dict(line.split(": ", 1) for o in executed.cells[-1].outputs
                   for line in o.get("text", "").splitlines())
    for what in ("kernel", "mine"):
        path = Path(printed[what])
        assert any(p.name.startswith("labutils-grade-") for p in path.parents), (what, path)
        assert not path.exists(), (what, path)
    sandbox = by["infinite_loop"]["sandbox"]
    assert "pid" in sandbox["namespaces"] and sandbox["network"] == "loopback only"


def test_adversarial_submissions_without_namespaces(tiny_lab, tmp_path):
    """Where the platform refuses namespaces: rlimits, process tracking and rewrites still hold."""
    by, out = _grade_all(tiny_lab, tmp_path, isolate=False,
                         only=("kill_parent", "ignore_sigterm", "write_outside"))
    assert by["write_outside"]["sandbox"]["namespaces"] == []
    data = json.loads((out / "write_outside" / "results.json").read_text())
    assert data["score"] == 3.0 and "forged" not in data["output"]


def test_learners_run_the_same_checks_from_their_folder(tiny_lab, capsys):
    """run_checks() is the notebook's self-check cell: the lab's checks on the folder's scripts."""
    from labutils.grading import run_checks

    (results,) = run_checks(tiny_lab)
    assert (results.score, results.passed) == (2.0, True)
    printed = capsys.readouterr().out
    assert "2/2  work.py reports the answer" in printed and "total: 2/2" in printed
    (tiny_lab / "work.py").write_text("from labutils.dist import report\nreport(answer=41)\n")
    (results,) = run_checks(tiny_lab, quiet=True)
    assert results.score == 0 and "measured: answer [41]" in results.output()


def test_interrupting_the_grader_leaves_nothing_behind(tiny_lab, tmp_path):
    """Ctrl-C on `labutils grade`: exit status 130, every submission's process gone."""
    import signal
    import sys
    import time

    folder = _submissions(tmp_path, {"busy": _stray() + "\nimport time\ntime.sleep(600)"})[0]
    grader = subprocess.Popen([sys.executable, "-m", "labutils", "grade", str(tiny_lab), str(folder),
                               "--out", str(tmp_path / "out"), "--timeout", "300"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not _leftovers() and grader.poll() is None:
            time.sleep(0.5)  # until the notebook runs and has spawned its strays
        assert _leftovers(), f"the notebook never ran: {grader.poll()}"
        grader.send_signal(signal.SIGINT)
        _, err = grader.communicate(timeout=60)
    finally:
        if grader.poll() is None:
            grader.kill()
            print(grader.communicate()[1][-3000:])
    assert grader.returncode == 130, err
    assert "interrupted" in err
    assert _leftovers() == []


SECRET = f"the-hidden-answer-{secrets.token_hex(4)}"
PEEK = '''
def peek(path):
    try:
        with open(path) as f:
            return "read: " + f.read()[-200:]
    except OSError as exc:
        return f"refused: {type(exc).__name__}"
'''


def test_learner_code_cannot_read_the_hidden_checks_or_the_solutions(tiny_lab, tmp_path):
    """In the notebook and in the checks' runs, the learner's code finds the lab folder and
    the course's solutions covered: reading them is a permission error, though the hidden
    checks run (the runner gets them on stdin). As root the grader also runs that code as
    a user of its own, where that user can reach the Python installation."""
    lab = tmp_path / "course" / "labs" / "tiny"
    shutil.copytree(tiny_lab, lab)
    (lab / "hidden_checks.py").write_text(textwrap.dedent(f'''
        from labutils.grading import check

        # {SECRET}


        @check("What work.py could read", points=1, visibility="after_published")
        def peeks(c):
            run = c.run("work.py", 1)
            if c.completed(run, "1 rank"):
                c.expect(True, "1 rank", measured=run.values("peek"))
    '''))
    solutions = tmp_path / "course" / "solutions" / "tiny"
    solutions.mkdir(parents=True)
    (solutions / "work.py").write_text(f"# {SECRET}\n")
    targets = [str(lab / "hidden_checks.py"), str(solutions / "work.py")]
    sub = tmp_path / "subs" / "curious"
    sub.mkdir(parents=True)
    (sub / "work.py").write_text(PEEK + "from labutils.dist import report\n"
                                 f"report(answer=42, peek=[peek(p) for p in {targets!r}])\n")
    (sub / "tiny.ipynb").write_text(_notebook(PEEK + f"for p in {targets!r}:\n    print(peek(p))"))
    result = grade(lab, [sub], out_dir=tmp_path / "out", jobs=1, timeout=NOTEBOOK_TIMEOUT,
                   progress=None)[0]
    assert not result.get("grader_error"), result
    sandbox = result["sandbox"]
    if "mount" not in sandbox.get("namespaces", []):
        pytest.skip(f"no mount namespace here: {sandbox}")
    assert sorted(sandbox["hidden"]) == sorted([str(lab), str(solutions.parent)]), sandbox
    if os.geteuid() == 0:   # a user of its own, or root without capabilities, and why
        assert sandbox["user"].startswith(("uid ", "root (")), sandbox
        assert sandbox["capabilities"] == "all dropped", sandbox
    executed = (tmp_path / "out" / "curious" / "executed.ipynb").read_text()
    assert executed.count("refused: PermissionError") == 2 and SECRET not in executed
    peeked = next(t for t in result["tests"] if t["name"] == "What work.py could read")
    assert peeked["status"] == "passed", peeked   # the hidden check itself ran
    assert peeked["output"].count("refused: PermissionError") == 2, peeked["output"]
    assert SECRET not in json.dumps(result)
