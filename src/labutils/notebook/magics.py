"""%%torchrun: run the cell itself on N ranks, a thin wrapper over launch(); and
%dist / %%ranks: cells on ranks that stay up between cells (labutils.run.world).

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

A persistent world, whose ranks keep their variables from one cell to the next:

    %dist start -n 4            # --backend, --hang-timeout S, --cold, --display
    %%ranks                     # this cell on every rank; %%ranks 0,2 on some
    x = torch.ones(2) * rank
    dist.all_reduce(x)
    x                           # each rank's value: _ranks[0], _ranks[1], ...
    %dist pull x                # x in the kernel: {rank: value}
    %dist status | %dist stop

dist_line() and ranks_cell() do the work, as run_cell() does for %%torchrun.
"""

from __future__ import annotations

import argparse
import hashlib
import keyword
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, cast

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import ArgDecorator, argument, magic_arguments

from labutils.errors import LaunchConfigError
from labutils.notebook.modes import DISPLAY_MODES
from labutils.run import world as world_api
from labutils.run.launcher import last_result, launch
from labutils.run.options import (
    add_launch_arguments,
    command_line_error,
    launch_kwargs,
    parser_error_line,
    split_script_args,
)
from labutils.run.result import RunResult
from labutils.run.spec import BACKENDS, runs_root
from labutils.runtime import runfiles
from labutils.runtime.runfiles import relative_path

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


def _without(tokens: list[str], extra: list[str]) -> list[str]:
    """tokens less the words of extra (in their order), matched from the end."""
    kept, left = list(tokens), list(extra)
    for i in range(len(kept) - 1, -1, -1):
        if left and kept[i] == left[-1]:
            del kept[i]
            left.pop()
    return kept


def parse_line(line: str):
    """The magic's options (argparse.Namespace, script arguments in ``.args``).

    Raises UsageError, with one line saying what is wrong, for anything bad.
    """
    try:
        tokens = shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"%%torchrun: cannot split the options ({exc}): {line}") from None
    tokens, script_args = split_script_args(tokens)
    parser = TorchrunMagics.torchrun.parser
    try:
        opts, extra = parser.parse_known_args(tokens)
    except UsageError as exc:  # IPython's parser raises argparse's message as it is
        raise UsageError(f"%%torchrun: {parser_error_line(parser, str(exc), help_says='%%torchrun?')}") \
            from None
    if extra:
        known = " ".join(_without(tokens, extra))
        raise UsageError(f"%%torchrun: unrecognized arguments: {' '.join(extra)}; its options are "
                         f"in %%torchrun?, and the cell's own arguments (its sys.argv) go after "
                         f"--: %%torchrun {known + ' ' if known else ''}-- {' '.join(extra)}")
    opts.args = script_args
    if not opts.out.isidentifier() or keyword.iskeyword(opts.out):
        raise UsageError(f"%%torchrun: --out expects a Python variable name, got {opts.out!r}")
    return opts


def cell_script(cell: str, *, log_dir: str | os.PathLike | None = None) -> Path:
    """Write the cell to <runs>/cells/cell-<hash>.py (kept with the runs) and return the path."""
    root = runs_root(log_dir)
    digest = hashlib.sha256(cell.encode()).hexdigest()[:12]
    path = runfiles.cell_path(root, digest).resolve()
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
        raise UsageError(f"%%torchrun: {command_line_error(exc)}") from None
    except KeyboardInterrupt:
        if last_result() is not before:  # the run started and was stopped: keep what it did
            namespace[opts.out] = last_result()
        raise
    namespace[opts.out] = result
    return result


@magics_class
class DistMagics(Magics):
    """%dist and %%ranks: a persistent world of ranks (labutils.run.world)."""

    @line_magic
    def dist(self, line: str) -> None:
        """%dist start -n N [--backend B] [--hang-timeout S] [--cold] | stop | status | pull NAME [--ranks 0,1]"""
        shell = cast("InteractiveShell", self.shell)
        dist_line(line, namespace=shell.user_ns)  # what it returns is for callers, not shown

    @cell_magic
    def ranks(self, line: str, cell: str) -> None:
        """%%ranks [R,R...] [--hang-timeout S] [--display MODE]: this cell on the world's ranks."""
        shell = cast("InteractiveShell", self.shell)
        ranks_cell(line, cell, namespace=shell.user_ns)


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, add_help=False, exit_on_error=False)
    parser.error = lambda message: (_ for _ in ()).throw(  # type: ignore[method-assign]
        UsageError(f"{prog}: {_one_line(parser, message)}"))
    return parser


def _one_line(parser: argparse.ArgumentParser, message: str) -> str:
    """argparse's message for a magic's line: what was expected, and how to go on."""
    return parser_error_line(parser, message, help_says=parser.prog.split()[0] + "?")


def _rank_list(text: str | None, prog: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"{prog}: expected ranks as numbers separated by commas (0,2), "
                         f"got {text!r}") from None


def _words(line: str, prog: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"{prog}: cannot split the options ({exc}): {line}") from None


def dist_line(line: str, *, namespace: dict) -> object:
    """What %dist does; the world (start, status), the stopped world's RunResult (stop)
    or the pulled values (pull, also stored in namespace under the name)."""
    words = _words(line, "%dist")
    if not words or words[0] not in ("start", "stop", "status", "pull"):
        raise UsageError("%dist: expected start -n N, stop, status or pull NAME, got "
                         f"{line.strip()!r}")
    what, rest = words[0], words[1:]
    if what == "stop":
        result = world_api.stop_current()
        print("[labutils] the world was stopped" if result else "[labutils] no world was running")
        return result
    if what == "status":
        now = world_api.current()
        print(f"[labutils] {now.nproc} ranks up, run folder {relative_path(now.run_dir)}"
              if now and now.alive else "[labutils] no world is running: %dist start -n N")
        return now
    if what == "pull":
        parser = _parser("%dist pull")
        parser.add_argument("name")
        parser.add_argument("--ranks", default=None)
        opts = _parse(parser, rest)
        now = world_api.current()
        if now is None or not now.alive:
            raise UsageError("%dist pull: no world is running: %dist start -n N first")
        try:
            values = now.pull(opts.name, _rank_list(opts.ranks, "%dist pull"))
        except (world_api.WorldError, LaunchConfigError) as exc:
            raise UsageError(f"%dist pull: {exc}") from None
        namespace[opts.name] = values
        return None
    parser = _parser("%dist start")
    parser.add_argument("-n", "--nproc", type=int, default=2)
    parser.add_argument("--backend", default="auto", choices=BACKENDS)
    parser.add_argument("--hang-timeout", type=float, default=30.0)
    parser.add_argument("--cold", action="store_true")
    parser.add_argument("--display", default="auto", choices=DISPLAY_MODES)
    opts = _parse(parser, rest)
    try:
        started = world_api.world(opts.nproc, backend=opts.backend, hang_timeout=opts.hang_timeout,
                                  warm=not opts.cold, display=opts.display)
    except (LaunchConfigError, world_api.WorldError) as exc:
        raise UsageError(f"%dist start: {exc}") from None
    print(f"[labutils] {opts.nproc} ranks up: %%ranks runs a cell on them "
          f"(run folder {relative_path(started.run_dir)})")
    return None


def _parse(parser: argparse.ArgumentParser, words: list[str]) -> argparse.Namespace:
    try:
        return parser.parse_args(words)
    except argparse.ArgumentError as exc:
        raise UsageError(f"{parser.prog}: {_one_line(parser, str(exc))}") from None


def ranks_cell(line: str, cell: str, *, namespace: dict):
    """What %%ranks does: run the cell on the current world's ranks; the CellResult,
    also in namespace["_cell"], and each rank's last value in namespace["_ranks"]."""
    parser = _parser("%%ranks")
    parser.add_argument("ranks", nargs="?", default=None)
    parser.add_argument("--hang-timeout", type=float, default=None)
    parser.add_argument("--display", default=None, choices=DISPLAY_MODES)
    opts = _parse(parser, _words(line, "%%ranks"))
    chosen = _rank_list(opts.ranks, "%%ranks")
    now = world_api.current()
    if now is None or not now.alive:
        raise UsageError("%%ranks: no world is running: start one with %dist start -n N")
    try:
        cell_result = now.run_cell(cell, chosen, display=opts.display,
                                   hang_timeout=opts.hang_timeout)
    except LaunchConfigError as exc:
        raise UsageError(f"%%ranks: {exc}") from None
    namespace["_ranks"] = cell_result.values
    namespace["_cell"] = cell_result
    return cell_result


def register(ipython) -> None:
    """Add %%torchrun, %dist and %%ranks to an IPython shell (what %load_ext labutils calls)."""
    ipython.register_magics(TorchrunMagics)
    ipython.register_magics(DistMagics)
