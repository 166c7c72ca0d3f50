"""launch() inside a real Jupyter kernel: the interrupt button and a kernel killed with -9."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from helpers import SCRIPTS

from helpers import execute_reply, iopub_until
from labutils.runtime.procs import pid_alive

# Every test here runs warm and cold (conftest.py: the `start` fixture).
pytestmark = pytest.mark.usefixtures("start")


CELL = """
from labutils import launch, last_result
import json
try:
    launch({script!r}, nproc=2, display="text", hang_timeout=None)
finally:
    r = last_result()
    print("RESULT " + json.dumps({{"reason": r.reason, "states": [x.state for x in r.ranks],
                                  "pids": [x.pid for x in r.ranks]}}))
"""


def _stream_with(text):
    return lambda msg: msg["msg_type"] == "stream" and text in msg["content"]["text"]


def _kernel_pid(kernel) -> int:
    msg_id = kernel.execute("import os; print('PID', os.getpid())")
    msg = iopub_until(kernel, _stream_with("PID "), timeout=30)
    execute_reply(kernel, msg_id, timeout=30)
    return int(msg["content"]["text"].split()[1])


def _run_pids(runs_dir: Path) -> list[int]:
    pids = []
    for events in runs_dir.glob("*/rank*/events.jsonl"):
        pids += [json.loads(ln)["pid"] for ln in events.read_text().splitlines()
                 if '"kind":"start"' in ln]
    return pids


def _run_processes(kernel_pid: int) -> list[int]:
    """The run's keeper, torchrun agent and ranks under the kernel (a warm run's are
    forks of the kernel's warm server, which is not counted)."""
    import psutil

    return [p.pid for p in psutil.Process(kernel_pid).children(recursive=True)
            if not _is_server(p)]


def _servers(kernel_pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(kernel_pid).children() if _is_server(p)]


def _is_server(proc) -> bool:
    return "labutils.runtime.server" in " ".join(proc.cmdline()) and \
        "labutils.runtime.server" not in " ".join(proc.parent().cmdline())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_jupyter_interrupt_stops_every_rank(kernel, runs_dir):
    kernel_pid = _kernel_pid(kernel)
    msg_id = kernel.execute(CELL.format(script=str(SCRIPTS / "forever.py")))
    iopub_until(kernel, _stream_with("[rank 1] step 0"), timeout=90)  # running, cell busy
    pids = _run_processes(kernel_pid)
    assert set(_run_pids(runs_dir)) < set(pids) and len(pids) == 4  # keeper, agent, two ranks
    t0 = time.monotonic()
    os.kill(kernel_pid, signal.SIGINT)  # what Jupyter's interrupt button sends
    result = iopub_until(kernel, _stream_with("RESULT "), timeout=20)
    reply = execute_reply(kernel, msg_id, timeout=20)
    assert time.monotonic() - t0 < 5
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    summary = json.loads(result["content"]["text"].split("RESULT ", 1)[1])
    assert summary["reason"] == "interrupted" and summary["states"] == ["killed", "killed"]
    assert not any(pid_alive(p) for p in pids)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_kernel_killed_with_sigkill_takes_its_run_down(kernel, runs_dir, start):
    kernel_pid = _kernel_pid(kernel)
    kernel.execute(CELL.format(script=str(SCRIPTS / "forever.py")))
    iopub_until(kernel, _stream_with("[rank 1] step 0"), timeout=90)
    pids = _run_processes(kernel_pid)
    assert set(_run_pids(runs_dir)) < set(pids) and len(pids) == 4  # keeper, agent, two ranks
    servers = _servers(kernel_pid)
    assert len(servers) == (1 if start == "warm" else 0)
    pids += servers  # a warm server dies with its kernel
    os.kill(kernel_pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.05)
    assert not any(pid_alive(p) for p in pids), "ranks or agent outlived the kernel"
    assert "step 0" in next(runs_dir.glob("*/rank0/stdout.log")).read_text()
