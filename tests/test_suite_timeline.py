"""benchmarks/suite_timeline.py: the plugin notes each test's wall and CPU time, with the
CPU of the processes the test started; the report sums them per file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import suite_timeline


def test_the_report_sums_each_file_and_says_how_many_cores_it_kept_busy(tmp_path):
    rows = [("tests/a.py::one", "gw0", 0, 10, 12.0), ("tests/a.py::two", "gw0", 10, 20, 8.0),
            ("tests/b.py::one", "gw1", 0, 20, 6.0)]
    path = tmp_path / "timeline.jsonl"
    path.write_text("".join(json.dumps({"test": t, "worker": w, "start": 100 + a, "end": 100 + b,
                                        "cpu_s": c}) + "\n" for t, w, a, b, c in rows))
    lines = suite_timeline.report(str(path)).splitlines()
    a = next(line for line in lines if line.startswith("tests/a.py"))
    b = next(line for line in lines if line.startswith("tests/b.py"))
    assert a.split()[1:4] == ["20.0", "20.0", "1.00"] and "0-20" in a
    assert b.split()[1:4] == ["6.0", "20.0", "0.30"]
    assert lines.index(a) < lines.index(b)  # the costliest file first
    assert lines[-1].startswith("3 tests; pass 20 s; CPU 26 s (1.30 cores on average)")
    assert "gw0 20 s, gw1 20 s" in lines[-1]


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/proc/self/cgroup"),
                    reason="the CPU of a worker's children is read from a cgroup: needs root")
def test_a_tests_cpu_counts_the_processes_it_started(tmp_path):
    """A test whose child burns about 1 s of CPU while the test itself sleeps is noted
    with about that CPU time, under a worker (xdist) as in make test."""
    test = tmp_path / "test_burn.py"
    test.write_text(textwrap.dedent("""
        import subprocess, sys

        def test_burn():
            subprocess.run([sys.executable, "-c",
                            "import time\\nt = time.process_time()\\n"
                            "while time.process_time() - t < 1.0: pass"], check=True)

        def test_sleep():
            import time; time.sleep(0.5)
    """))
    out = tmp_path / "timeline.jsonl"
    env = {**os.environ, "SUITE_TIMELINE": str(out),
           "PYTHONPATH": os.pathsep.join([str(REPO / "benchmarks"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "suite_timeline", "-n", "1", "-o", "addopts=", str(test)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {r["test"].split("::")[1]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"test_burn", "test_sleep"}  # once each: not again by the controller
    assert rows["test_burn"]["worker"] == "gw0"
    assert 0.9 <= rows["test_burn"]["cpu_s"] < 3.0, rows["test_burn"]
    assert rows["test_sleep"]["cpu_s"] < 0.3 and rows["test_sleep"]["end"] - rows["test_sleep"]["start"] >= 0.5


def test_bad_arguments_get_one_line(tmp_path, capsys):
    """--help and a file that is not there gave a traceback: now usage, or one line."""
    with pytest.raises(SystemExit) as done:
        suite_timeline.main(["--help"])
    assert done.value.code == 0 and "usage: suite_timeline.py" in capsys.readouterr().out
    for argv, said in (([], "usage:"), (["a", "b"], "usage:"), (["--cores"], "usage:"),
                       ([str(tmp_path / "gone.jsonl")], "gone.jsonl: no such file")):
        with pytest.raises(SystemExit, match=said):
            suite_timeline.main(argv)
    (tmp_path / "t.jsonl").write_text("")
    assert suite_timeline.main([str(tmp_path / "t.jsonl")]) == "no tests noted"
