"""The sandbox and the process-tree cleanup, on plain Python commands (no torchrun)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from labutils.grading import procs

PROBE = textwrap.dedent("""
    import errno, json, os, resource, socket, sys
    facts = {"pid": os.getpid(), "as": resource.getrlimit(resource.RLIMIT_AS)[0]}
    try:
        open(sys.argv[1] + "/x", "w").write("x")
        facts["write"] = "ok"
    except OSError as exc:
        facts["write"] = errno.errorcode[exc.errno]
    open("here.txt", "w").write("the working copy stays writable")
    s = socket.socket()
    s.settimeout(1)
    try:
        s.connect(("10.255.255.1", 9))
        facts["net"] = "reached"
    except OSError as exc:
        facts["net"] = type(exc).__name__
    print(json.dumps(facts))
""")


def _sandboxed(tmp_path, *, isolate: bool) -> tuple[dict, dict]:
    guarded, work = tmp_path / "guarded", tmp_path / "work"
    guarded.mkdir()
    work.mkdir()
    spec = {"cwd": str(work), "isolate": isolate, "readonly": [str(guarded)],
            "limits": {"memory_bytes": 1 << 30, "file_bytes": 1 << 20},
            "report": str(tmp_path / "enforced.json")}
    out = subprocess.run([sys.executable, "-m", "labutils.grading.sandbox", json.dumps(spec), "--",
                          sys.executable, "-c", PROBE, str(guarded)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (work / "here.txt").is_file()
    return json.loads(out.stdout), json.loads((tmp_path / "enforced.json").read_text())


def test_sandbox_with_namespaces(tmp_path):
    facts, enforced = _sandboxed(tmp_path, isolate=True)
    if not enforced["namespaces"]:
        pytest.skip(f"this machine refuses namespaces: {enforced.get('namespaces_error')}")
    assert facts["pid"] == 2, "the command runs under its own PID 1"
    assert facts["write"] == "EROFS" and str(tmp_path / "guarded") in enforced["readonly"]
    assert facts["net"] != "reached" and enforced["network"] == "loopback only"
    assert facts["as"] == 1 << 30
    if os.geteuid() == 0:
        assert enforced["capabilities"] == "all dropped"


def test_sandbox_without_namespaces_still_limits(tmp_path):
    facts, enforced = _sandboxed(tmp_path, isolate=False)
    assert enforced["namespaces"] == [] and facts["write"] == "ok"
    assert facts["as"] == 1 << 30 and "memory per process <= 1073741824" in enforced["limits"]


def test_kill_everything_reaches_escaped_processes():
    """Double-forked, own session, SIGTERM ignored: found by the tag and killed."""
    tag = "test-" + os.urandom(4).hex()
    code = ("import os, signal, subprocess, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "child = 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'\n"
            "subprocess.Popen([sys.executable, '-c', child], start_new_session=True)\n"
            "if os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
            "print('ready', flush=True)\ntime.sleep(60)\n")
    root = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, procs.TAG_ENV: tag},
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert root.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 10
    while len(procs.tagged(tag)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(procs.tagged(tag)) == 3
    assert procs.kill_everything(roots=[root.pid], tag=tag, keep={root.pid}) == 3
    root.wait()
    assert procs.tagged(tag) == []
