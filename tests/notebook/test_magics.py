"""%%torchrun through a real IPython shell, and its plain function run_cell()."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

from labutils.notebook import magics
from labutils.run.result import RunResult

CELL = """\
import sys
from labutils.dist import rank, report, world_size
import helper_module                      # found in the notebook's folder
report(rank=rank(), world_size=world_size(), value=helper_module.VALUE, argv=sys.argv[1:])
print(f"hello from rank {rank()}")
"""


@pytest.fixture
def shell(tmp_path, runs_dir, monkeypatch):
    """A real IPython shell with %load_ext labutils, working in tmp_path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "helper_module.py").write_text("VALUE = 42\n")
    config = Config()
    config.HistoryManager.enabled = False  # no history database for a test shell
    ip = InteractiveShell.instance(config=config)
    ip.run_line_magic("load_ext", "labutils")
    yield ip
    InteractiveShell.clear_instance()  # later tests see no IPython, as before


@pytest.mark.slow
def test_cell_runs_on_two_ranks_and_the_result_is_stored(shell, runs_dir, capsys):
    shell.run_cell_magic("torchrun", "-n 2 --out run --display text -- --lr 0.1", CELL)
    result = shell.user_ns["run"]
    assert isinstance(result, RunResult) and result.ok, result.summary()
    assert sorted(result.values("rank")) == [0, 1]
    assert result.values("value") == [42, 42]
    assert result.values("argv") == [["--lr", "0.1"]] * 2
    out = capsys.readouterr().out
    assert "[rank 0] hello from rank 0" in out and "[rank 1] hello from rank 1" in out
    # the cell is kept next to the runs, and the run's command names it
    cells = list((runs_dir / "cells").glob("cell-*.py"))
    assert [c.read_text() for c in cells] == [CELL]
    assert str(cells[0]) in (result.log_dir / "command.txt").read_text()


@pytest.mark.parametrize("line, message", [
    ("-n 0", "-n/--nproc: expected a whole number of ranks >= 1, got 0; pass e.g. -n/--nproc 2"),
    ("-n two", "-n/--nproc: expected a whole number, got 'two'; %%torchrun? says: ranks per agent"),
    ("--backend mpi", "--backend: expected one of auto, gloo, nccl, got 'mpi'; %%torchrun? says: "),
    ("--display txt", "--display: expected one of auto, widgets, text, terminal, none, got 'txt'; "
     "did you mean text?"),
    ("--timeout", "--timeout: expected a value after it, got none; e.g. --timeout TIMEOUT"),
    ("--hang-timeout -1", "--hang-timeout: expected a number >= 0.5, got -1.0; --help says: "),
    ("--frobnicate", "unrecognized arguments: --frobnicate"),
    # the cell's own arguments without the separator: where they go, with them in place
    ("-n 3 --epochs 3 --timeout 5", "unrecognized arguments: --epochs 3; its options are in "
     "%%torchrun?, and the cell's own arguments (its sys.argv) go after --: %%torchrun -n 3 "
     "--timeout 5 -- --epochs 3"),
    ("--out 2run", "--out expects a Python variable name, got '2run'"),
    ("--out class", "--out expects a Python variable name, got 'class'"),
    ("-n 2 'unclosed", "cannot split the options"),
])
def test_bad_options_are_one_line_usage_errors(shell, runs_dir, line, message):
    with pytest.raises(UsageError) as info:
        shell.run_cell_magic("torchrun", line, CELL)
    assert message in str(info.value)
    assert "\n" not in str(info.value).strip()
    assert magics.DEFAULT_OUT not in shell.user_ns
    assert not [p for p in runs_dir.glob("*") if p.name != "cells"], "no run started"


def test_a_bad_option_in_a_cell_shows_one_line(shell, runs_dir, capsys):
    outcome = shell.run_cell("%%torchrun -n 2 --backend mpi\nprint('never')\n")
    assert isinstance(outcome.error_in_exec, UsageError)
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.strip()] == [
        f"UsageError: {outcome.error_in_exec}"]


def test_syntax_error_in_the_cell_starts_no_rank(shell, runs_dir):
    with pytest.raises(UsageError, match=r"syntax error in .*cell-\w+\.py:2"):
        shell.run_cell_magic("torchrun", "-n 2", "x = 1\nif x\n")
    assert not [p for p in runs_dir.glob("*") if p.name != "cells"]


@pytest.mark.slow
def test_interrupted_run_still_stores_its_result(shell, runs_dir):
    """Ctrl-C / Jupyter's interrupt while the ranks run: every rank stops, the result is kept."""
    def interrupt_once_ranks_print():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(p.stat().st_size for p in runs_dir.glob("*/rank*/stdout.log")):
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)

    threading.Thread(target=interrupt_once_ranks_print, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        magics.run_cell("-n 2 --display none --hang-timeout 0",
                        "import time\nprint('up', flush=True)\ntime.sleep(60)\n",
                        namespace=shell.user_ns)
    result = shell.user_ns[magics.DEFAULT_OUT]
    assert result.reason == "interrupted"
    assert [r.state for r in result.ranks] == ["killed", "killed"]


def test_parse_line_splits_script_arguments():
    opts = magics.parse_line("-n 4 --timeout 5 --max-restarts 1 --out r -- --epochs 2 --name 'a b'")
    assert (opts.nproc, opts.timeout, opts.max_restarts, opts.out) == (4, 5.0, 1, "r")
    assert opts.args == ["--epochs", "2", "--name", "a b"]
    defaults = magics.parse_line("")
    assert (defaults.nproc, defaults.hang_timeout, defaults.out, defaults.args) == (
        2, 30.0, magics.DEFAULT_OUT, [])


def test_the_same_cell_maps_to_the_same_file(tmp_path):
    first = magics.cell_script("print(1)\n", log_dir=tmp_path)
    assert magics.cell_script("print(1)\n", log_dir=tmp_path) == first
    assert magics.cell_script("print(2)\n", log_dir=tmp_path) != first
    assert first.parent == (tmp_path / "cells").resolve()


@pytest.mark.parametrize("line, message", [
    ("start -n x", "%dist start: -n/--nproc: expected a whole number, got 'x'; %dist? lists the options"),
    ("start --display y", "%dist start: --display: expected one of auto, widgets, text, terminal, "
     "none, got 'y'"),
    ("pull", "%dist pull: expected name, got none; usage: %dist pull [options] name"),
])
def test_the_worlds_magics_refuse_bad_options_in_one_line(line, message):
    """%dist and %%ranks parse before they touch a world: no world is started here."""
    with pytest.raises(UsageError) as info:
        magics.dist_line(line, namespace={})
    assert str(info.value) == message or str(info.value).startswith(message), str(info.value)
    with pytest.raises(UsageError, match=r"^%%ranks: --display: expected one of .*, got 'z'"):
        magics.ranks_cell("--display z", "x = 1", namespace={})
