"""Shared fixtures: a scratch folder per test for run folders, and a leak check."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def distributed_pids() -> list[str]:
    """Processes of ours that must not outlive a test: torchrun agents and ranks."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [
        line.strip() for line in out.splitlines()
        if ("labutils._agent" in line or "labutils.worker" in line
            or "torch.distributed.run" in line) and "ps -eo" not in line
    ]


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Every test must end with no agent or rank alive (checked for up to 5 s)."""
    before = set(distributed_pids())
    yield
    deadline = time.monotonic() + 5
    while True:
        left = [p for p in distributed_pids() if p not in before]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"processes left behind: {left}"


@pytest.fixture
def runs_dir(tmp_path, monkeypatch):
    """Run folders go under the test's tmp_path."""
    d = tmp_path / "runs"
    monkeypatch.setenv("LABUTILS_RUNS_DIR", str(d))
    return d


@pytest.fixture
def write_script(tmp_path):
    """write_script("name.py", source) -> path of a dedented script in tmp_path."""
    def write(name: str, source: str) -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path
    return write


PYTHON = sys.executable
