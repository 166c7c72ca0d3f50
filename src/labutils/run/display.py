"""The interface through which the engine shows a run while it goes: Display.

The launcher calls a Display from the thread that called launch(): start() once,
lines() as complete lines arrive, record() with each labutils.dist.report(...),
state() on state changes, note() with the launcher's own messages, debugger() when a
rank stops at a breakpoint, tick() a few times a second, finish() with the RunResult.
A display may set ``stop_requested`` (the widget display's Stop button does) and the
launcher stops the run.

launch(display=MODE) names a display: make_display() resolves "auto" (choose_mode)
and makes it. The displays themselves (plain text, live panes) live in
labutils.notebook, above the engine, which finds them by name in DISPLAYS, as it
finds a scheduler's back end (run/backends.py, SCHEDULERS).
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import TYPE_CHECKING

from labutils.errors import LaunchConfigError
from labutils.runtime import runfiles

if TYPE_CHECKING:
    from labutils.run.result import RunResult


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

    def debugger(self, rank: int, event: dict) -> None:
        """A rank stopped at a breakpoint and waits for a debugger (event "state":
        "waiting", with its "socket" and "where"), got one ("attached"), or went on
        ("ended"). Nobody can type here (display="none"): the rank is told to continue."""
        if event.get("state") == "waiting":
            from labutils.runtime.debugger import Console, DebuggerGone

            try:
                console = Console(event["socket"])
            except DebuggerGone:
                return  # the rank has already gone: nothing to continue
            console.send("continue")
            console.closed.wait(10)  # the rank ends the session once it has continued
            console.close()

    def finish(self, result: RunResult) -> None:
        """The run ended; every process is gone."""


# display mode -> "module:function" that makes it ("none" is the base Display itself)
DISPLAYS = {
    "widgets": "labutils.notebook.modes:widget_display",
    "text": "labutils.notebook.modes:text_display",
    "terminal": "labutils.notebook.modes:terminal_display",
}
DISPLAY_MODES = ("auto", *DISPLAYS, "none")


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

    Args:
        mode: one of DISPLAY_MODES; any mode but "auto" is returned as it is.
    """
    mode = os.environ.get(runfiles.ENV_DISPLAY, mode) if mode == "auto" else mode
    if mode != "auto":
        return mode
    if _in_kernel():
        return "widgets" if os.environ.get("JPY_SESSION_NAME") else "text"
    return "text"


def check_display_mode(mode: object) -> None:
    """LaunchConfigError, one line, unless mode is one of DISPLAY_MODES."""
    if mode not in DISPLAY_MODES:
        raise LaunchConfigError("display", expected=" | ".join(DISPLAY_MODES), given=mode,
                                fix="pass display='auto' to choose by where the code runs")


def make_display(mode: str = "auto") -> Display:
    """A display for the mode ("auto", "widgets", "text", "terminal" or "none").

    Args:
        mode: one of DISPLAY_MODES; "auto" is resolved by choose_mode().
    """
    check_display_mode(mode)
    mode = choose_mode(mode)
    if mode == "none":
        return Display()
    module, _, function = DISPLAYS[mode].partition(":")
    return getattr(importlib.import_module(module), function)()
