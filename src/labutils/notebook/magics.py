"""%%torchrun: run the cell itself on N ranks, a thin wrapper over launch().

    %load_ext labutils

    %%torchrun -n 4 --hang-timeout 10 --out run -- --epochs 2
    from labutils.dist import init, report
    rank, world_size, device = init()
    report(rank=rank)

The cell becomes a script, <runs>/cells/cell-<hash of the cell>.py, which stays
there as part of the run's record (the run's command.txt names it; the same cell
always maps to the same file). Its ranks start in the notebook's folder with that
folder on PYTHONPATH, so the cell opens files and imports modules as the notebook
would. The RunResult lands in the user namespace under --out (default
``_torchrun``), also when the run is stopped or interrupted. Bad options are a
one-line UsageError and no rank starts.

All the work is in run_cell(), which tests call directly; the magic only hands
it the line, the cell and the user namespace.
"""

from __future__ import annotations

import hashlib
import keyword
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, cast

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import ArgDecorator, argument, magic_arguments

from labutils.errors import LaunchConfigError
from labutils.notebook.modes import DISPLAY_MODES
from labutils.run.launcher import last_result, launch
from labutils.run.options import add_launch_arguments, launch_kwargs, split_script_args
from labutils.run.result import RunResult
from labutils.run.spec import runs_root
from labutils.runtime import runfiles

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

DEFAULT_OUT = "_torchrun"


class _launch_options(ArgDecorator):
    """The launch options %%torchrun offers, from the one table (labutils.run.options)."""

    def add_to_parser(self, parser, group) -> None:
        add_launch_arguments(parser, magic=True)


@magics_class
class TorchrunMagics(Magics):
    """The %%torchrun cell magic."""

    @magic_arguments()
    @_launch_options()
    @argument("--out", default=DEFAULT_OUT,
              help=f"variable that receives the RunResult (default {DEFAULT_OUT})")
    @argument("--display", default="auto", choices=DISPLAY_MODES,
              help="live panes, [rank N] text, or nothing (default auto)")
    @cell_magic
    def torchrun(self, line: str, cell: str) -> None:
        """Run this cell as a script on N ranks with torchrun (labutils.launch).

        Arguments for the script go after --:  %%torchrun -n 4 -- --epochs 2
        """
        shell = cast("InteractiveShell", self.shell)  # set once the magics are registered
        run_cell(line, cell, namespace=shell.user_ns)


def parse_line(line: str):
    """The magic's options (argparse.Namespace, script arguments in ``.args``).

    Raises UsageError, with one line saying what is wrong, for anything bad.
    """
    try:
        tokens = shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"%%torchrun: cannot split the options ({exc}): {line}") from None
    tokens, script_args = split_script_args(tokens)
    opts = TorchrunMagics.torchrun.parser.parse_args(tokens)
    opts.args = script_args
    if not opts.out.isidentifier() or keyword.iskeyword(opts.out):
        raise UsageError(f"%%torchrun: --out expects a Python variable name, got {opts.out!r}")
    return opts


def cell_script(cell: str, *, log_dir: str | os.PathLike | None = None) -> Path:
    """Write the cell to <runs>/cells/cell-<hash>.py (kept with the runs) and return the path."""
    root = runs_root(log_dir)
    digest = hashlib.sha256(cell.encode()).hexdigest()[:12]
    path = (root / "cells" / f"cell-{digest}.py").resolve()
    if not path.exists():  # same name, same text: an existing file is already right
        path.parent.mkdir(parents=True, exist_ok=True)
        runfiles.write_atomic(path, cell)  # a rank never reads a half-written cell
    return path


def run_cell(line: str, cell: str, *, namespace: dict) -> RunResult:
    """What %%torchrun does: parse ``line``, run ``cell`` on N ranks, store the result.

    Args:
        line: the magic's options, e.g. "-n 4 --out run -- --epochs 2".
        cell: the cell's source, run unchanged in every rank.
        namespace: where the RunResult is stored under --out (the user namespace).

    Returns:
        The RunResult (also in ``namespace``). A stop or interrupt re-raises
        KeyboardInterrupt after storing the result; bad options raise UsageError.
    """
    opts = parse_line(line)
    script = cell_script(cell, log_dir=opts.log_dir)
    cwd = os.getcwd()
    path = os.pathsep.join(p for p in (cwd, os.environ.get("PYTHONPATH")) if p)
    before = last_result()
    try:
        result = launch(script, args=opts.args, display=opts.display, env={"PYTHONPATH": path},
                        **launch_kwargs(opts))
    except LaunchConfigError as exc:
        raise UsageError(f"%%torchrun: {exc}") from None
    except KeyboardInterrupt:
        if last_result() is not before:  # the run started and was stopped: keep what it did
            namespace[opts.out] = last_result()
        raise
    namespace[opts.out] = result
    return result


def register(ipython) -> None:
    """Add %%torchrun to an IPython shell (what %load_ext labutils calls)."""
    ipython.register_magics(TorchrunMagics)
