"""The sandbox and the process-tree cleanup, on plain Python commands (no torchrun)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

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


# The sandbox as a user whose id maps the machine refuses (podman's default seccomp lets
# uid 1000 in a container create a user namespace, then refuses writing its uid_map).
REFUSED_MAPS = textwrap.dedent("""
    import os, sys
    from labutils.grading import sandbox
    os.geteuid = lambda: 1000      # not root: the sandbox asks for a user namespace too
    def refuse():
        raise PermissionError(1, "uid_map: Operation not permitted")
    sandbox._map_ids = refuse
    sys.exit(sandbox.main(sys.argv[1:]))
""")
FORK_PIDS = textwrap.dedent("""
    import json, os
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(write_end, str(os.getpid()).encode())
        os._exit(0)
    os.waitpid(child, 0)
    print(json.dumps({"forked": child, "child_says": int(os.read(read_end, 32))}))
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a user namespace as root to stand for one a container allows")
def test_namespaces_made_but_id_maps_refused_leave_no_half_sandbox(tmp_path):
    """The command runs without namespaces, and the pids its children report are the
    pids its parent sees: a half-made PID namespace once made a run's "rank pid" the
    grader's own, and the grader killed itself."""
    spec = {"cwd": str(tmp_path), "isolate": True, "report": str(tmp_path / "enforced.json")}
    out = subprocess.run([sys.executable, "-c", REFUSED_MAPS, json.dumps(spec), "--",
                          sys.executable, "-c", FORK_PIDS], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    enforced = json.loads((tmp_path / "enforced.json").read_text())
    assert enforced["namespaces"] == [] and "uid_map" in enforced["namespaces_error"]
    pids = json.loads(out.stdout)
    assert pids["child_says"] == pids["forked"]


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can run a command as another user")
def test_root_runs_the_command_as_the_given_user_with_hidden_paths_covered():
    tmp_path = Path(tempfile.mkdtemp(prefix="labutils-sandbox-"))   # pytest's are closed
    try:
        _as_another_user(tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _as_another_user(tmp_path: Path) -> None:
    secret_dir, work = tmp_path / "solutions", tmp_path / "work"
    secret_dir.mkdir()
    (secret_dir / "answer.py").write_text("42")
    (tmp_path / "hidden_checks.py").write_text("42")
    work.mkdir()
    work.chmod(0o777)
    stub = tmp_path / "stub"
    stub.touch(mode=0o000)
    tmp_path.chmod(0o755)
    for parent in tmp_path.parents:
        if not parent.stat().st_mode & 0o001:
            pytest.skip(f"{parent} cannot be entered by other users")
    spec = {"cwd": str(work), "isolate": True, "user": [45678, 45678], "hide_stub": str(stub),
            "hide": [str(secret_dir), str(tmp_path / "hidden_checks.py")],
            "report": str(tmp_path / "enforced.json")}
    script = (f"id -u; cat {tmp_path}/hidden_checks.py; ls {secret_dir}; "
              f"cat {secret_dir}/answer.py; touch mine; echo done")
    out = subprocess.run([sys.executable, "-m", "labutils.grading.sandbox", json.dumps(spec), "--",
                          "/bin/sh", "-c", script], capture_output=True, text=True, timeout=60)
    enforced = json.loads((tmp_path / "enforced.json").read_text())
    if "mount" not in enforced["namespaces"]:
        pytest.skip(f"this machine refuses namespaces: {enforced.get('namespaces_error')}")
    assert out.stdout.split() == ["45678", "done"], out.stdout + out.stderr
    assert out.stderr.count("Permission denied") == 3, out.stderr
    assert enforced["user"] == "uid 45678" and enforced["capabilities"] == "all dropped"
    assert sorted(enforced["hidden"]) == sorted(spec["hide"])
    assert (work / "mine").stat().st_uid == 45678
    assert (tmp_path / "hidden_checks.py").read_text() == "42"   # covered, never changed


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
