"""No process outlives its run: the ranks' own children and daemons included.

Each rank of tests/scripts/owned_children.py starts a child that ignores SIGTERM and
a double-forked setsid daemon that ignores it too; whatever ends the run, both must
be gone within 5 s (each agent's keeper adopts and ends them: runtime/agent.py).

The default suite runs three endings once (Stop, SIGTERM to the CLI, kill -9 of
the caller); `pytest tests/run/test_lifetime.py --stress` runs every ending 20 times.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import SCRIPTS, stop_once

from labutils import launch
from labutils.run.display import Display
from labutils.runtime import runfiles
from labutils.runtime.procs import pid_alive

# Every test here runs warm and cold (conftest.py: the `start` fixture).
pytestmark = pytest.mark.usefixtures("start")

SCRIPT = SCRIPTS / "owned_children.py"
ENDINGS = ["ok", "failed", "hang", "timeout", "stop", "interrupt", "cli-sigterm", "cli-sighup",
           "cli-kill9", "caller-kill9"]
IN_SUITE = ["stop", "cli-sigterm", "caller-kill9"]
STRESS_TRIALS = 20


def pytest_generate_tests(metafunc):
    if "ending" in metafunc.fixturenames:
        stress = metafunc.config.getoption("--stress")
        cases = [(e, k) for e in (ENDINGS if stress else IN_SUITE)
                 for k in range(STRESS_TRIALS if stress else 1)]
        metafunc.parametrize(("ending", "trial"), cases,
                             ids=[f"{e}-{k}" if stress else e for e, k in cases])


def _started(pids_file: Path, ranks: int, timeout: float = 60.0) -> list[int]:
    """The children and daemons of every rank, once all ranks have written them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pids_file.exists():
            lines = pids_file.read_text().splitlines()
            if len(lines) >= ranks and all(len(ln.split()) == 2 for ln in lines):
                return [int(p) for ln in lines for p in ln.split()]
        time.sleep(0.05)
    raise AssertionError(f"the ranks did not start their children within {timeout:.0f} s")


def _left_after(pids: list[int], within: float) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in pids):
            return []
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


class _StopWhenStarted(Display):
    """Presses Stop once every rank has started its children."""

    def __init__(self, pids_file: Path, ranks: int) -> None:
        super().__init__()
        threading.Thread(target=lambda: (_started(pids_file, ranks), self.stop_requested.set()),
                         daemon=True).start()


def _in_process(ending: str, pids_file: Path, start: str):
    mode = {"ok": "ok", "failed": "fail", "hang": "hang"}.get(ending, "sleep")
    display = _StopWhenStarted(pids_file, 2) if ending == "stop" else "none"
    result = launch(SCRIPT, 2, args=[str(pids_file), mode], display=display,
                    hang_timeout=2 if ending == "hang" else None,
                    timeout=10 if ending == "timeout" else None)
    assert result.reason == {"failed": "failed", "stop": "stopped"}.get(ending, ending), result
    assert result.ownership == "subreaper" and result.start == start
    if ending == "stop":
        # the keeper let the agent collect its stopped ranks and write how they ended (a
        # launcher on another node reads only these): two, by SIGTERM, or SIGKILL
        # for one that outlived its grace
        ended = [json.loads(line) for path in runfiles.endings_files(result.log_dir)
                 for line in path.read_text().splitlines()]
        assert sorted(e["code"] in (-signal.SIGTERM, -signal.SIGKILL) for e in ended) == [True, True], ended
    return result


def _in_child(ending: str, pids_file: Path, tmp_path: Path) -> int:
    """Run from another process (a CLI, or a Python caller of launch()), signal it once
    every rank has started its children; its exit status."""
    if ending.startswith("cli"):
        argv = [sys.executable, "-m", "labutils", "launch", "-n", "2", "--hang-timeout", "0",
                "--json", str(tmp_path / "summary.json"), str(SCRIPT), "--",
                str(pids_file), "sleep"]
    else:
        argv = [sys.executable, "-c", "from labutils import launch; "
                f"launch({str(SCRIPT)!r}, 2, args=[{str(pids_file)!r}, 'sleep'], "
                "display='none', hang_timeout=None)"]
    caller = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _started(pids_file, 2)
        sig = {"cli-sigterm": signal.SIGTERM, "cli-sighup": signal.SIGHUP,
               "interrupt": signal.SIGINT}.get(ending, signal.SIGKILL)
        caller.send_signal(sig)
        return caller.wait(timeout=30)
    finally:
        caller.kill()
        caller.wait()


def test_no_descendant_outlives_the_run(ending, trial, runs_dir, tmp_path, start):
    pids_file = tmp_path / "pids.txt"
    try:
        if ending in ("interrupt", "caller-kill9") or ending.startswith("cli"):
            status = _in_child(ending, pids_file, tmp_path)
            expected = {"cli-sigterm": 143, "cli-sighup": 129, "cli-kill9": -9,
                        "caller-kill9": -9, "interrupt": -signal.SIGINT}[ending]
            assert status == expected
            if ending in ("cli-sigterm", "cli-sighup"):  # handled like Ctrl-C: summary written
                summary = json.loads((tmp_path / "summary.json").read_text())
                assert summary["reason"] == "interrupted" and summary["ownership"] == "subreaper"
                assert summary["start"] == start
        else:
            _in_process(ending, pids_file, start)
        pids = _started(pids_file, 2, timeout=1)
        assert len(pids) == 4
        assert _left_after(pids, within=5) == []
    finally:
        for pid in _started(pids_file, 0, timeout=1) if pids_file.exists() else []:
            try:
                os.kill(pid, signal.SIGKILL)  # a failing trial must not leak into the next
            except OSError:
                pass


def test_a_stopped_rank_gets_one_sigterm(runs_dir, tmp_path):
    """A rank writes its stacks as SIGTERM ends it (the timeout's and Stop's report of
    where each rank was, a mismatch's collectives); a second SIGTERM while it writes
    ends it mid-stack. The launcher, the keeper and torchrun's agent each sent one (the
    agent two: it got two, and the keeper one every 20 ms): 1 rank's stacks in 20
    runs were lost on a loaded machine. Now torchrun's agent sends the one. The ranks
    here note each SIGTERM and live on, so the keeper's last resort follows when the
    agent's grace is over (runtime/agent.py: AGENT_GRACE_S), then SIGKILL."""
    from labutils.runtime.agent import AGENT_GRACE_S

    # Stop once both ranks' handlers are in place (a fixed timeout of 4 s came first on a
    # loaded machine, cold: a rank had not yet made its file)
    handlers = [tmp_path / f"rank{rank}.txt" for rank in (0, 1)]
    script = SCRIPTS / "counts_sigterm.py"
    result = launch(script, 2, args=[str(tmp_path)], hang_timeout=None, timeout=120,
                    display=stop_once(lambda d: all(p.exists() for p in handlers), after_s=0.2))
    assert result.reason == "stopped", result.summary()
    for rank in (0, 1):
        times = [float(t) for t in (tmp_path / f"rank{rank}.txt").read_text().split()]
        assert times and [t for t in times if t - times[0] < AGENT_GRACE_S * 0.75] == times[:1], \
            f"rank {rank}: SIGTERMs at {[round(t - times[0], 3) for t in times]} s"


def test_the_tree_reaches_children_of_a_process_whose_main_thread_has_exited(tmp_path):
    """A torchrun agent winding down shows as a zombie while its other threads finish, and
    its ranks are still its children: the keeper must see through it (found in the suite:
    the ranks' children outlived a stopped run when the walk stopped at the zombie)."""
    from labutils.runtime.procs import tree

    script = tmp_path / "leader_exits.py"
    script.write_text(
        "import ctypes, subprocess, threading, time\n"
        "def keep():\n"
        "    child = subprocess.Popen(['sleep', '30'])\n"
        "    print(child.pid, flush=True)\n"
        "    time.sleep(30)\n"
        "threading.Thread(target=keep).start()\n"
        "time.sleep(0.3)\n"
        "ctypes.CDLL(None).pthread_exit(None)  # the main thread ends, the process goes on\n")
    leader = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = int(leader.stdout.readline())
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(f"/proc/{leader.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.05)
        else:
            pytest.fail("the main thread did not exit")
        found = tree(os.getpid())
        assert child in found and leader.pid not in found
    finally:
        leader.kill()
        leader.wait()
        os.kill(child, signal.SIGKILL)
