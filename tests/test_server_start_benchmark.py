"""benchmarks/server_start.py runs, and says what it measured in one line."""

from __future__ import annotations

import re
import subprocess
import sys

from helpers import REPO

BENCHMARK = REPO / "benchmarks" / "server_start.py"


def test_the_benchmark_compares_a_server_start_with_a_plain_import():
    out = subprocess.run([sys.executable, str(BENCHMARK), "--repeats", "1"], capture_output=True,
                         text=True, timeout=240, cwd=REPO)
    assert out.returncode == 0, out.stderr
    line = re.fullmatch(r"medians of 1: warm server start (\S+) CPU-s, plain import (\S+) CPU-s, "
                        r"server / plain (\S+)x\n", out.stdout)
    assert line, out.stdout
    server, plain, ratio = map(float, line.groups())
    assert server > 0.2 and plain > 0.2 and abs(ratio - server / plain) < 0.02  # each printed to 2 places


def test_a_repeat_count_below_one_is_refused_in_one_line():
    out = subprocess.run([sys.executable, str(BENCHMARK), "--repeats", "0"], capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    assert out.returncode == 2 and "--repeats must be at least 1" in out.stderr
