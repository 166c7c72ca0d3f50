"""Live per-rank panes in JupyterLab: the widget display.

One pane per rank (state badge, elapsed time, a progress bar once the rank
reports ``step`` and ``total``, the rank's last lines; see panes.py), a combined
view of every rank's lines in arrival order, launcher notes and a Stop button.
The launcher calls every method from the thread that called launch() (the
kernel's main thread), which is also where the widgets are created and shown.

Bounded, whatever the run prints: lines() only appends to fixed-size windows
and counts the rest, each line is cut at MAX_LINE_CHARS, and tick() sends the
changed panes to the browser at most ``updates_per_s`` times a second. A rank
printing a million lines costs the browser a few updates a second of about
``lines`` lines each; the complete output stays in the run folder, and each
pane says how many earlier lines are there and in which file.

The Stop button has to work while launch() keeps the main thread busy; see
subshell.py for how, and for the fallback.
"""

from __future__ import annotations

import html
import os
import time
from collections import deque

import ipywidgets as widgets
from IPython.display import display

from labutils.errors import LaunchConfigError, real_number
from labutils.notebook.console import PaneConsole

# LineWindow, Progress and the constants were defined here before panes.py; the old
# path labutils.widgets still names them.
from labutils.notebook.panes import (  # noqa: F401
    BAR_STYLES,
    FINAL_STATES,
    MAX_LINE_CHARS,
    STDERR_COLOR,
    LineWindow,
    Progress,
    RankPane,
    elapsed,
)
from labutils.notebook.subshell import route_clicks_to_subshell
from labutils.run.display import Display
from labutils.run.result import RankResult, RunResult
from labutils.runtime import runfiles
from labutils.runtime.debugger import DebuggerGone


class WidgetDisplay(Display):
    """Per-rank panes, a combined view, notes and a Stop button, updated a few times a second.

    Args:
        lines: lines each rank pane shows (the rest are counted and stay in the logs).
        combined_lines: lines the combined view shows.
        updates_per_s: most pushes to the browser per second; lines arriving in
            between are coalesced into the next push.
    """

    def __init__(self, *, lines: int = 40, combined_lines: int = 200,
                 updates_per_s: float = 4.0) -> None:
        super().__init__()
        for name, value, minimum in (("lines", lines, 1), ("combined_lines", combined_lines, 1),
                                     ("updates_per_s", updates_per_s, 0.1)):
            if not real_number(value) or value < minimum:
                raise LaunchConfigError(name, expected=f"a number >= {minimum}", given=value,
                                        fix="the defaults (40, 200, 4.0) suit most runs")
        self.keep = lines
        self.interval_s = 1.0 / updates_per_s
        self.combined = LineWindow(combined_lines)
        self.panes: list[RankPane] = []
        self.pushes = 0  # how many times changes were sent (the tests count them)
        self._notes: deque[str] = deque(maxlen=20)
        self._log_dir = ""
        self._t0 = 0.0
        self._last_push = float("-inf")
        self._combined_dirty = self._notes_dirty = False
        self._stopping = False
        self._consoles: dict[int, PaneConsole] = {}  # rank -> its debugger, while it lasts

    # ------------------------------------------------------------ Display API
    def start(self, *, world_size: int, log_dir: str, script: str) -> None:
        self._t0 = time.monotonic()
        self._log_dir = runfiles.relative_path(log_dir)
        self.panes = [RankPane(r, self.keep) for r in range(world_size)]
        self.title = widgets.HTML(
            f"<b>{html.escape(os.path.basename(script))}</b> on {world_size} "
            f"rank{'s' if world_size != 1 else ''} <span style='color:#6e7781'>"
            f"logs in {html.escape(self._log_dir)}</span>")
        self.clock = widgets.HTML()
        self.stop = widgets.Button(description="Stop", icon="stop", button_style="danger",
                                   tooltip="stop every rank (SIGTERM, then SIGKILL)",
                                   layout=widgets.Layout(width="auto"))
        self.stop.add_class("labutils-stop")
        self.stop_hint = widgets.HTML()
        self.combined_view = widgets.HTML()
        self.notes = widgets.HTML()
        columns = 1 if world_size == 1 else 2 if world_size <= 4 else 4
        grid = widgets.GridBox(
            [p.box for p in self.panes],
            layout=widgets.Layout(grid_template_columns=f"repeat({columns}, minmax(0, 1fr))",
                                  grid_gap="6px"))
        tabs = widgets.Tab([grid, self.combined_view], titles=("per rank", "all ranks, in order"))
        self.notes.add_class("labutils-notes")
        # The CSS classes name the parts for the browser tests (tests/e2e).
        self.root = widgets.VBox([
            widgets.HBox([self.stop, self.title, self.clock],
                         layout=widgets.Layout(align_items="center", grid_gap="8px")),
            self.stop_hint, tabs, self.notes,
        ]).add_class("labutils-run")
        # The button's clicks are wired before it is shown, so no click can go elsewhere.
        self.stop.on_click(lambda _button: self.stop_requested.set())
        if not route_clicks_to_subshell(self.stop):
            self.stop.disabled = True
            self.stop_hint.value = (
                "<span style='color:#9a6700'>This kernel cannot take a click while the cell "
                "runs (no kernel subshells): press Jupyter's interrupt button (&#9632;) to stop "
                "the run; every rank is stopped either way.</span>")
        self.push(time.monotonic())
        display(self.root)

    def lines(self, rank: int, stream: str, lines: list[str]) -> None:
        lines = runfiles.lines_to_show(lines)  # as the text display shows them
        if not lines:
            return
        if 0 <= rank < len(self.panes):
            pane = self.panes[rank]
            pane.output.add(rank, stream, lines)
            pane.dirty = True
        self.combined.add(rank, stream, lines)
        self._combined_dirty = True

    def record(self, rank: int, values: dict) -> None:
        if 0 <= rank < len(self.panes) and self.panes[rank].progress.update(values,
                                                                           time.monotonic()):
            self.panes[rank].progress_dirty = True

    def state(self, rank: int, state: str) -> None:
        if 0 <= rank < len(self.panes) and self.panes[rank].state != state:
            pane = self.panes[rank]
            pane.state = state
            pane.ended_at = time.monotonic() if state in FINAL_STATES else None
            pane.progress_dirty |= pane.bar is not None  # the bar's colour follows the state

    def note(self, text: str) -> None:
        self._notes.append(text)
        self._notes_dirty = True

    def debugger(self, rank: int, event: dict) -> None:
        if not 0 <= rank < len(self.panes):
            return
        state, pane = event.get("state"), self.panes[rank]
        if state == "waiting":
            where = event.get("where", "a breakpoint")
            try:
                console = PaneConsole(rank, event["socket"])
            except DebuggerGone:
                self.note(f"rank {rank} stopped at {where} and ended before its debugger opened")
                return
            if console.live:
                self._consoles[rank] = console
                pane.console = console.widget
                pane.lay_out()
                self.note(f"rank {rank} stopped at {where}: type pdb commands in its pane "
                          "(c continues, q ends the run); the other ranks wait")
            else:  # no subshell: the box could not answer before the cell ends
                console.close()
                self.note(f"rank {rank} stopped at {where}; the other ranks wait. Debug it from "
                          f"a terminal: labutils debug {self._log_dir} --rank {rank}")
        elif state == "ended":
            self._close_console(rank)

    def _close_console(self, rank: int) -> None:
        console = self._consoles.pop(rank, None)
        if console is not None:
            self._exchange(rank, console)
            console.close()
            self.panes[rank].console = None
            self.panes[rank].lay_out()

    def _exchange(self, rank: int, console: PaneConsole) -> None:
        lines = console.exchange()
        if lines:
            self.lines(rank, "stdout", lines)

    def tick(self) -> None:
        for rank, console in list(self._consoles.items()):
            self._exchange(rank, console)
            if console.closed:
                self._close_console(rank)
        now = time.monotonic()
        if now - self._last_push >= self.interval_s:
            self.push(now)

    def finish(self, result: RunResult) -> None:
        for rank in list(self._consoles):
            self._close_console(rank)
        for r in result.ranks:
            self.state(r.rank, r.state)
            if 0 <= r.rank < len(self.panes):
                self.panes[r.rank].role = _role(result, r)
        self.push(time.monotonic())
        self.stop.disabled, self.stop.description = True, "Stop"
        self.stop_hint.value = ""
        display(result)  # the HTML summary, a normal output saved with the notebook

    # ------------------------------------------------------------- pushing changes
    def push(self, now: float) -> None:
        """Send now what changed since the last push: one value per changed widget.

        tick() calls it at most ``updates_per_s`` times a second, start() and
        finish() always.

        Args:
            now: time.monotonic() of the push (the clock shows the time since start()).
        """
        self._last_push = now
        self.pushes += 1
        if self.stop_requested.is_set() and not self._stopping:
            self._stopping = True
            self.stop.disabled, self.stop.description = True, "stopping"
        self._set(self.clock, f"<span style='color:#6e7781'>{elapsed(now - self._t0)}</span>")
        for pane in self.panes:
            self._set(pane.head, pane.head_html(now, self._t0))
            if pane.dirty:
                path = os.path.join(self._log_dir, f"rank{pane.rank}", "{stream}.log")
                pane.body.value = pane.output.html(prefix=False, earlier_in=path)
                pane.dirty = False
            if pane.progress_dirty:
                pane.show_progress()
                pane.progress_dirty = False
        if self._combined_dirty:
            path = os.path.join(self._log_dir, "rank*", "{stream}.log")
            self.combined_view.value = self.combined.html(prefix=True, earlier_in=path)
            self._combined_dirty = False
        if self._notes_dirty:
            self.notes.value = "<br>".join(
                f"<span style='color:#6e7781'>[labutils] {html.escape(n)}</span>"
                for n in self._notes)
            self._notes_dirty = False

    @staticmethod
    def _set(widget: widgets.HTML, value: str) -> None:
        if widget.value != value:  # an unchanged value would still cost a message
            widget.value = value


def _role(result: RunResult, rank: RankResult) -> str:
    """What a rank's pane says it was in the run's end: the one to read first, or not."""
    if result.failure and rank.rank in result.failure.mismatch:
        call = result.failure.mismatch[rank.rank]["collective"]
        return f"timed out in {call}()" if call else "timed out in a collective"
    if result.failure and rank.rank == result.failure.rank:
        return "root cause"
    if result.failure and rank.victim:
        return f"victim of rank {result.failure.rank}"
    if result.hang and rank.rank in result.hang.stragglers:
        return "straggler"
    return ""
