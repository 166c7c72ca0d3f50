"""Showing a run while it goes: the Display interface and the plain-text display.

The launcher calls a Display from the thread that called launch(): start() once,
lines() as complete lines arrive, record() with each labutils.dist.report(...),
state() on state changes, tick() a few times a second, finish() with the RunResult.
A display may set ``stop_requested`` (the widget display's Stop button does) and
the launcher stops the run.

Plain text is used wherever no widget frontend is there to render panes:
papermill, nbval, ``jupyter nbconvert --execute``, a terminal. Each line is
printed as ``[rank N] line`` so it is saved with the notebook. In a notebook the
output is bounded: after ``limit`` lines of one rank the rest is counted, not
shown, and the end of the run shows that rank's last lines and where the
complete log is.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import TextIO

from labutils.result import RunResult
from labutils.runfiles import shorten_traceback_paths

DISPLAY_MODES = ("auto", "widgets", "text", "terminal", "none")


class Display:
    """Base display: does nothing, which is also the "none" mode."""

    def __init__(self) -> None:
        self.stop_requested = threading.Event()

    def start(self, *, world_size: int, log_dir: str, script: str) -> None:
        """The run is about to start."""

    def lines(self, rank: int, stream: str, lines: list[str]) -> None:
        """New complete lines of one rank's stream, in order."""

    def record(self, rank: int, values: dict) -> None:
        """A rank called labutils.dist.report(**values) (step and total drive progress bars)."""

    def state(self, rank: int, state: str) -> None:
        """A rank changed state (starting, running, done, failed, hung, killed)."""

    def note(self, text: str) -> None:
        """A message from the launcher (a restart, a hang being diagnosed...)."""

    def tick(self) -> None:
        """Called a few times a second: the moment to push coalesced updates."""

    def finish(self, result: RunResult) -> None:
        """The run ended; every process is gone."""


class TextDisplay(Display):
    """``[rank N] line`` per line, bounded per rank when ``limit`` is set."""

    def __init__(
        self,
        *,
        out: TextIO | None = None,
        err: TextIO | None = None,
        limit: int | None = 200,
        tail_lines: int = 10,
        summary: bool = True,
    ) -> None:
        super().__init__()
        self._out = out
        self._err = err
        self.limit = limit
        self.tail_lines = tail_lines
        self.summary = summary
        self._shown: dict[int, int] = {}
        self._hidden: dict[int, int] = {}
        self._last: dict[int, list[tuple[str, str]]] = {}
        self._log_dir = ""

    @property
    def out(self) -> TextIO:
        return self._out or sys.stdout  # looked up late: Jupyter swaps sys.stdout per cell

    @property
    def err(self) -> TextIO:
        return self._err or sys.stderr

    def start(self, *, world_size: int, log_dir: str, script: str) -> None:
        self._log_dir = log_dir

    def lines(self, rank: int, stream: str, lines: list[str]) -> None:
        # Stack dumps written from C (faulthandler on a crash) carry absolute paths;
        # show them as the worker shows Python tracebacks, so saved notebooks hold
        # no machine paths. The log files keep the original text.
        lines = [shorten_traceback_paths(ln) if 'File "' in ln else ln for ln in lines]
        target = self.out if stream == "stdout" else self.err
        shown = self._shown.get(rank, 0)
        room = len(lines) if self.limit is None else max(0, self.limit - shown)
        if room:
            target.write("".join(f"[rank {rank}] {line}\n" for line in lines[:room]))
            self._shown[rank] = shown + min(room, len(lines))
        rest = lines[room:]
        if rest:
            if not self._hidden.get(rank):
                self.out.write(f"[rank {rank}] ... more output than the {self.limit} lines shown "
                               "here; the last lines follow at the end\n")
            self._hidden[rank] = self._hidden.get(rank, 0) + len(rest)
            keep = self._last.setdefault(rank, [])
            keep.extend((stream, line) for line in rest[-self.tail_lines:])
            del keep[: -self.tail_lines]

    def note(self, text: str) -> None:
        self.out.write(f"[labutils] {text}\n")

    def tick(self) -> None:
        self.out.flush()

    def finish(self, result: RunResult) -> None:
        for rank, hidden in sorted(self._hidden.items()):
            tail = self._last.get(rank, [])
            earlier = hidden - len(tail)
            path = os.path.join(_rel(result.log_dir), f"rank{rank}")
            self.out.write(f"[rank {rank}] ... {earlier} earlier lines in {path}/stdout.log "
                           "and stderr.log\n")
            for stream, line in tail:
                (self.out if stream == "stdout" else self.err).write(f"[rank {rank}] {line}\n")
        self.err.flush()
        if self.summary:
            self.out.write(result.summary() + "\n")
        self.out.flush()


def _rel(path) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return str(path)
    return rel if not rel.startswith("..") else str(path)


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def choose_mode(mode: str = "auto") -> str:
    """Resolve "auto": widgets in a live JupyterLab, text elsewhere.

    JupyterLab's server sets JPY_SESSION_NAME for the kernels it starts; papermill,
    nbval and nbconvert start kernels without it and render no widgets, so they get
    text that is saved in the notebook. LABUTILS_DISPLAY overrides the choice.
    """
    mode = os.environ.get("LABUTILS_DISPLAY", mode) if mode == "auto" else mode
    if mode != "auto":
        return mode
    if _in_kernel():
        return "widgets" if os.environ.get("JPY_SESSION_NAME") else "text"
    return "text"


def make_display(mode: str = "auto") -> Display:
    """A display for the mode ("auto", "widgets", "text", "terminal" or "none")."""
    if mode not in DISPLAY_MODES:
        from labutils.errors import LaunchConfigError

        raise LaunchConfigError("display", expected=" | ".join(DISPLAY_MODES), given=mode,
                                fix="pass display='auto' to choose by where the code runs")
    mode = choose_mode(mode)
    if mode == "widgets":
        from labutils.widgets import WidgetDisplay

        return WidgetDisplay()
    if mode == "terminal":
        return TextDisplay(limit=None)
    if mode == "none":
        return Display()
    return TextDisplay()
