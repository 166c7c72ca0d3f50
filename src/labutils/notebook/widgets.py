"""Live per-rank panes in JupyterLab: the widget display.

One pane per rank (state badge, elapsed time, a progress bar once the rank
reports ``step`` and ``total``, the rank's last lines), a combined view of every
rank's lines in arrival order, launcher notes and a Stop button.
The launcher calls every method from the thread that called launch() (the
kernel's main thread), which is also where the widgets are created and shown.

Bounded, whatever the run prints: lines() only appends to fixed-size windows
and counts the rest, each line is cut at MAX_LINE_CHARS, and tick() sends the
changed panes to the browser at most ``updates_per_s`` times a second. A rank
printing a million lines costs the browser a few updates a second of about
``lines`` lines each; the complete output stays in the run folder, and each
pane says how many earlier lines are there and in which file.

The Stop button has to work while launch() keeps the main thread busy; see
_route_clicks_to_subshell() for how, and for the fallback.
"""

from __future__ import annotations

import concurrent.futures
import html
import os
import time
from collections import deque

import ipywidgets as widgets
from IPython.display import display

from labutils.runtime import runfiles
from labutils.notebook.display import Display
from labutils.errors import LaunchConfigError
from labutils.run.result import RankResult, RunResult, state_badge

FINAL_STATES = ("done", "failed", "hung", "killed")
MAX_LINE_CHARS = 1000  # a longer line is cut in the pane (never in the log file)
STDERR_COLOR = "#cf222e"
# The bar's colour once a rank has ended: green done, red failed, amber stopped.
BAR_STYLES = {"done": "success", "failed": "danger", "hung": "warning", "killed": "warning"}


class LineWindow:
    """The last ``keep`` lines of a stream of lines, and how many came before them.

    Appending is O(keep) per call however many lines arrive, so a flood is cheap;
    lines longer than MAX_LINE_CHARS are cut. Entries are (rank, stream, line).
    """

    def __init__(self, keep: int) -> None:
        self.window: deque[tuple[int, str, str]] = deque(maxlen=keep)
        self.counts = {s: 0 for s in runfiles.STREAMS}

    def add(self, rank: int, stream: str, lines: list[str]) -> None:
        self.counts[stream] += len(lines)
        self.window.extend((rank, stream, _cut(line)) for line in lines[-self.window.maxlen:])

    def hidden(self) -> dict[str, int]:
        """Lines per stream that arrived but are no longer in the window."""
        shown = {s: 0 for s in runfiles.STREAMS}
        for _, stream, _ in self.window:
            shown[stream] += 1
        return {s: self.counts[s] - shown[s] for s in runfiles.STREAMS}

    def html(self, *, prefix: bool, earlier_in: str) -> str:
        """The window as HTML: the "earlier lines" note, then the lines, stderr in red.

        Args:
            prefix: put "[rank N] " before each line (the combined view).
            earlier_in: where the earlier lines are; "{stream}" is replaced by
                stdout or stderr.
        """
        rows = []
        hidden = self.hidden()
        earlier = [f"{n} earlier {'line' if n == 1 else 'lines'} in "
                   f"{earlier_in.format(stream=s)}" for s, n in hidden.items() if n]
        if earlier:
            rows.append(f"<i style='color:#6e7781'>{html.escape('; '.join(earlier))}</i>")
        for rank, stream, line in self.window:
            text = html.escape(f"[rank {rank}] {line}" if prefix else line)
            rows.append(f"<span style='color:{STDERR_COLOR}'>{text}</span>"
                        if stream == "stderr" else text)
        return _scroll_box("\n".join(rows))


def _cut(line: str) -> str:
    if len(line) <= MAX_LINE_CHARS:
        return line
    return f"{line[:MAX_LINE_CHARS]} ... ({len(line) - MAX_LINE_CHARS} more characters)"


def _scroll_box(body: str, height: str = "18em") -> str:
    # column-reverse keeps the scroll position at the bottom, where new lines arrive.
    return (f"<div style='display:flex;flex-direction:column-reverse;max-height:{height};"
            "overflow:auto;border:1px solid #d0d7de;border-radius:4px'>"
            # flex:none: JupyterLab's CSS would let the pre shrink and clip its end, not scroll.
            f"<pre style='flex:none;margin:0;padding:4px;font-size:12px;line-height:1.3'>"
            f"{body}</pre></div>")


def _elapsed(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    m, s = divmod(s, 60)
    return f"{m}:{s:02d}" if m < 60 else f"{m // 60}:{m % 60:02d}:{s:02d}"


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class Progress:
    """Steps done out of total for one rank, from report(step=..., total=...).

    ``step`` counts from 0 like ``range(total)``: report(step=i, total=n) after step
    i means i + 1 of n steps are done. The pace (and the time left) is measured
    from the first report, so the start-up before the loop does not count.
    """

    def __init__(self) -> None:
        self.done = 0
        self.total = 0
        self._first: tuple[float, int] | None = None  # (time, done) of the first report
        self._last_t = 0.0

    def update(self, values: dict, now: float) -> bool:
        """Take a record's values; False when they carry no step and total."""
        step, total = values.get("step"), values.get("total")
        if not (_count(step) and _count(total) and total >= 1):
            return False
        done = min(step + 1, total)
        if self._first is None or done < self.done:  # the first report, or a restart
            self._first = (now, done)
        self.done, self.total, self._last_t = done, total, now
        return True

    def label(self, *, ended: bool = False) -> str:
        """"12/40 · ~9 s left"; no estimate before the second report or once ended."""
        text = f"{self.done}/{self.total}"
        t0, done0 = self._first or (0.0, 0)
        if not ended and done0 < self.done < self.total:
            per_step = (self._last_t - t0) / (self.done - done0)
            text += f" · ~{_elapsed(per_step * (self.total - self.done))} left"
        return text


class _RankPane:
    def __init__(self, rank: int, keep: int) -> None:
        self.rank = rank
        self.output = LineWindow(keep)
        self.state = "starting"
        self.ended_at: float | None = None
        self.role = ""  # set at the end: "root cause", "victim of rank N", "straggler"
        self.progress = Progress()
        self.head = widgets.HTML().add_class("labutils-pane-head")
        self.body = widgets.HTML().add_class("labutils-pane-body")
        self.bar: widgets.IntProgress | None = None  # made at the first step/total report
        self.bar_label = widgets.HTML().add_class("labutils-progress-label")
        self.box = widgets.VBox([self.head, self.body],
                                layout=widgets.Layout(min_width="0", overflow="hidden"))
        self.box.add_class("labutils-pane")
        self.dirty = True
        self.progress_dirty = False

    def head_html(self, now: float, t0: float) -> str:
        role = f" <b style='color:#57606a'>&middot; {html.escape(self.role)}</b>" if self.role else ""
        return (f"<b>rank {self.rank}</b> {state_badge(self.state)} "
                f"<span style='color:#6e7781'>{_elapsed((self.ended_at or now) - t0)}</span>{role}")

    def show_progress(self) -> None:
        """Send the bar's value (making the bar the first time) and its colour."""
        if self.bar is None:
            self.bar = widgets.IntProgress(min=0, layout=widgets.Layout(flex="1", width="auto"))
            self.bar.add_class("labutils-progress")
            row = widgets.HBox([self.bar, self.bar_label],
                               layout=widgets.Layout(align_items="center", grid_gap="6px"))
            self.box.children = (self.head, row, self.body)
        p = self.progress
        if self.bar.max != p.total or self.bar.value != p.done:
            # max first when it grows, value first when it shrinks, so value <= max holds
            if p.total >= self.bar.max:
                self.bar.max, self.bar.value = p.total, p.done
            else:
                self.bar.value, self.bar.max = p.done, p.total
        style = BAR_STYLES.get(self.state, "")
        if self.bar.bar_style != style:
            self.bar.bar_style = style
        label = f"<span style='color:#57606a;font-size:12px'>{html.escape(p.label(ended=self.state in FINAL_STATES))}</span>"
        if self.bar_label.value != label:
            self.bar_label.value = label


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
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
                raise LaunchConfigError(name, expected=f"a number >= {minimum}", given=value,
                                        fix="the defaults (40, 200, 4.0) suit most runs")
        self.keep = lines
        self.interval_s = 1.0 / updates_per_s
        self.combined = LineWindow(combined_lines)
        self.panes: list[_RankPane] = []
        self.pushes = 0  # how many times changes were sent (the tests count them)
        self._notes: deque[str] = deque(maxlen=20)
        self._log_dir = ""
        self._t0 = 0.0
        self._last_push = float("-inf")
        self._combined_dirty = self._notes_dirty = False
        self._stopping = False

    # ------------------------------------------------------------ Display API
    def start(self, *, world_size: int, log_dir: str, script: str) -> None:
        self._t0 = time.monotonic()
        self._log_dir = runfiles.relative_path(log_dir)
        self.panes = [_RankPane(r, self.keep) for r in range(world_size)]
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
        if not _route_clicks_to_subshell(self.stop):
            self.stop.disabled = True
            self.stop_hint.value = (
                "<span style='color:#9a6700'>This kernel cannot take a click while the cell "
                "runs (no kernel subshells): press Jupyter's interrupt button (&#9632;) to stop "
                "the run; every rank is stopped either way.</span>")
        self._push(time.monotonic())
        display(self.root)

    def lines(self, rank: int, stream: str, lines: list[str]) -> None:
        lines = [runfiles.shorten_paths(ln) for ln in lines]  # as the text display shows them
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

    def tick(self) -> None:
        now = time.monotonic()
        if now - self._last_push >= self.interval_s:
            self._push(now)

    def finish(self, result: RunResult) -> None:
        for rank in result.ranks:
            self.state(rank.rank, rank.state)
            if 0 <= rank.rank < len(self.panes):
                self.panes[rank.rank].role = _role(result, rank)
        self._push(time.monotonic())
        self.stop.disabled, self.stop.description = True, "Stop"
        self.stop_hint.value = ""
        display(result)  # the HTML summary, a normal output saved with the notebook

    # ------------------------------------------------------------- internals
    def _push(self, now: float) -> None:
        """Send what changed since the last push: one value per changed widget."""
        self._last_push = now
        self.pushes += 1
        if self.stop_requested.is_set() and not self._stopping:
            self._stopping = True
            self.stop.disabled, self.stop.description = True, "stopping"
        self._set(self.clock, f"<span style='color:#6e7781'>{_elapsed(now - self._t0)}</span>")
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
    if result.failure and rank.rank == result.failure.rank:
        return "root cause"
    if result.failure and rank.victim:
        return f"victim of rank {result.failure.rank}"
    if result.hang and rank.rank in result.hang.stragglers:
        return "straggler"
    return ""


_subshells: dict[int, str] = {}  # id(kernel) -> the subshell that takes Stop clicks


def _route_clicks_to_subshell(button: widgets.Button) -> bool:
    """Make ``button``'s clicks run while the cell is busy; False where this kernel cannot.

    Why: launch() blocks the kernel's main thread until the run ends, and a kernel
    handles widget messages on that thread, so a click would wait in the queue
    until the cell has finished, when there is nothing left to stop.

    How (ipykernel >= 7.4): the kernel reads the shell socket on its own "shell
    channel" thread and hands each message to the main thread or to a *subshell*
    (a thread with its own event loop, created by a create_subshell_request).
    For a comm_msg it asks the target comm, ``comm._reply_subshell_for(data,
    default)``, which subshell gets the message. We create one subshell per
    kernel (in the shell channel thread, as a create_subshell_request would) and
    make the button's comm answer with it, so the click's on_click runs in the
    subshell thread while the main thread is still in launch(). The callback only
    sets a threading.Event that the launcher polls; no widget is touched from
    that thread.

    Relies on ipykernel internals (shell_channel_thread.manager._create_subshell,
    BaseComm._reply_subshell_for). Outside a kernel, on older kernels or if those
    names change, it returns False and the display points at Jupyter's
    interrupt button, which launch() turns into a clean stop.
    """
    try:
        from IPython import get_ipython

        kernel = getattr(get_ipython(), "kernel", None)
        channel = getattr(kernel, "shell_channel_thread", None)
        comm = getattr(button, "comm", None)
        if channel is None or comm is None or not hasattr(comm, "_reply_subshell_for"):
            return False
        manager = channel.manager  # created lazily, and only from this (the main) thread
        subshell_id = _subshells.get(id(kernel))
        if subshell_id not in manager.list_subshell():  # none yet, or a client deleted it
            created: concurrent.futures.Future[str] = concurrent.futures.Future()

            def create() -> None:  # runs in the shell channel thread
                try:
                    created.set_result(manager._create_subshell())
                except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                    created.set_exception(exc)

            channel.io_loop.add_callback(create)
            subshell_id = _subshells[id(kernel)] = created.result(timeout=5)
    except Exception:  # noqa: BLE001 - any mismatch means: fall back to the interrupt button
        return False
    comm._reply_subshell_for = lambda data, default: subshell_id
    return True
