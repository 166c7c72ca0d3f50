"""The parts of a rank's pane in the widget display: the last lines, progress, the pane.

LineWindow keeps a bounded window of lines and counts the rest; Progress turns
report(step=..., total=...) into "12/40 · ~9 s left"; RankPane holds one rank's
widgets and renders its head and bar. widgets.WidgetDisplay lays the panes out
and decides when to send them to the browser.
"""

from __future__ import annotations

import html
from collections import deque
from typing import TypeGuard, cast

import ipywidgets as widgets

from labutils.errors import whole_number
from labutils.run.result import state_badge
from labutils.runtime import runfiles

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
        keep = cast(int, self.window.maxlen)  # set in __init__
        self.window.extend((rank, stream, _cut(line)) for line in lines[-keep:])

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


def elapsed(seconds: float) -> str:
    """A duration as a pane shows it: "42 s", "3:07" or "1:02:03".

    Args:
        seconds: the duration; fractions of a second are dropped.
    """
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    m, s = divmod(s, 60)
    return f"{m}:{s:02d}" if m < 60 else f"{m // 60}:{m % 60:02d}:{s:02d}"


def _count(value) -> TypeGuard[int]:
    return whole_number(value) and value >= 0


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
            text += f" · ~{elapsed(per_step * (self.total - self.done))} left"
        return text


class RankPane:
    """One rank's pane: head (rank, state, time, role), a progress bar once the rank
    reports step and total, and its last lines.

    Args:
        rank: the rank it shows.
        keep: lines the pane shows (the rest are counted and stay in the logs).
    """

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
        self.row: widgets.HBox | None = None       # the progress bar and its label
        self.console: widgets.Widget | None = None  # a pdb text box while it is debugged
        self.dirty = True
        self.progress_dirty = False

    def lay_out(self) -> None:
        """The pane's parts, top to bottom: head, progress, lines, debugger input."""
        parts = [self.head, self.row, self.body, self.console]
        self.box.children = tuple(w for w in parts if w is not None)

    def head_html(self, now: float, t0: float) -> str:
        """The head's HTML: rank, state badge, time since ``t0`` (until it ended), role."""
        role = f" <b style='color:#57606a'>&middot; {html.escape(self.role)}</b>" if self.role else ""
        return (f"<b>rank {self.rank}</b> {state_badge(self.state)} "
                f"<span style='color:#6e7781'>{elapsed((self.ended_at or now) - t0)}</span>{role}")

    def show_progress(self) -> None:
        """Send the bar's value (making the bar the first time) and its colour."""
        if self.bar is None:
            self.bar = widgets.IntProgress(min=0, layout=widgets.Layout(flex="1", width="auto"))
            self.bar.add_class("labutils-progress")
            self.row = widgets.HBox([self.bar, self.bar_label],
                                    layout=widgets.Layout(align_items="center", grid_gap="6px"))
            self.lay_out()
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
        text = html.escape(p.label(ended=self.state in FINAL_STATES))
        label = f"<span style='color:#57606a;font-size:12px'>{text}</span>"
        if self.bar_label.value != label:
            self.bar_label.value = label
