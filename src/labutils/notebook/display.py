"""Showing a run while it goes: the plain-text display.

The Display interface it implements is the engine's (labutils.run.display).
Plain text is used wherever no widget frontend is there to render panes:
papermill, nbval, ``jupyter nbconvert --execute``, a terminal (modes.py makes that
choice; the widget display is in widgets.py). Each line is printed as
``[rank N] line`` so it is saved with the notebook. In a notebook the output is
bounded: after ``limit`` lines of one rank the rest is counted, not shown, and the
end of the run shows that rank's last lines and where the complete log is. A
traceback or a Python warning that repeats one shown before (another rank's, or the
same rank's in an earlier attempt) is shown as one line that names the rank it
repeats, and the summary at the end does not print a traceback shown above; torch's
build paths are cut as machine paths are, and the profiler's start and stop markers
left out (runfiles.lines_to_show). The log files keep every line as the rank wrote it.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TextIO, cast

from labutils.run.display import Display
from labutils.run.result import RunResult
from labutils.runtime.debugger import Console, DebuggerGone, bridge_terminal
from labutils.runtime.runfiles import lines_to_show, relative_path, shorten_paths

__all__ = ["Display", "TextDisplay"]  # Display: the interface, defined with the engine


TRACEBACK_START = "Traceback (most recent call last):"
# An exception group's traceback (Python 3.11): every line drawn in a margin of "|" and
# "+", the group's own frames and exception at the first level ("  | ValueError: ...").
GROUP_START = re.compile(r"^\s*\+ Exception Group Traceback \(most recent call last\):$")
_GROUP_MARGIN = re.compile(r"^\s*[|+]")
_GROUP_EXCEPTION = re.compile(r"^\s*\| (?=\S)")
# Python's warnings.showwarning(): "path:line: Category: message", then the source line.
WARNING_START = re.compile(r"^\S+:\d+: (\w*Warning): ")
MAX_TRACEBACK_LINES = 400  # a longer block is not compared (it is shown as it comes)
MAX_MESSAGE_LINES = 40     # lines of an exception's message after its first
HOLD_S = 1.0  # a possible repeat that stops growing this long is settled at the next tick


def _same_key(line: str) -> str:
    """A line as two ranks' copies of one error compare: numbers (ranks, ports,
    addresses) do not count."""
    return re.sub(r"0x[0-9a-fA-F]+|\d+", "#", line)


# What differs between two ranks' copies of one message without changing what it says:
# addresses and ports (each rank names its own peer), pids and memory addresses.
_NOISE = re.compile(r"\d{1,3}(?:\.\d{1,3}){3}(?:\]?:\d+)?|(?:localhost|\])\s?:\d+"
                    r"|\bpid[ =:]?\s?\d+|0x[0-9a-fA-F]+")


def _message_key(line: str) -> str:
    """A line of an exception's message as two ranks' copies compare: the same when
    only addresses, ports and pids differ. Other numbers count: a shape, a size or a
    rank is what the message says ("Rank 1 is running ... TensorShape=[8]")."""
    return _NOISE.sub("<>", line)


def _block_kind(line: str) -> str | None:
    """'traceback' or 'warning' when the line starts one, else None."""
    if line == TRACEBACK_START or GROUP_START.match(line):
        return "traceback"
    return "warning" if WARNING_START.match(line) else None


@dataclass
class _Block:
    """A traceback or warning as shown: its rank and its lines, compared with _same_key()."""

    rank: int
    kind: str
    keys: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)  # as written (keys are for matching)

    @property
    def group(self) -> bool:
        """An exception group's traceback, drawn in its margin."""
        return bool(GROUP_START.match(self.lines[0]))

    @property
    def exception_at(self) -> int | None:
        """Index of the line naming the exception (or warning): for a traceback the
        first line after the frames (a group's: in its margin)."""
        if self.kind == "warning":
            return 0
        if self.group:
            return next((i for i, k in enumerate(self.keys)
                         if i and _GROUP_EXCEPTION.match(k)), None)
        return next((i for i, k in enumerate(self.keys)
                     if i and k and not k[0].isspace()), None)

    def takes(self, line: str) -> bool:
        """Whether the next line of this rank still belongs to the block: a warning's
        indented source line; a traceback's frames and its message's lines; every line
        of a group's margin (its sub-exceptions' tracebacks)."""
        if len(self.keys) >= MAX_TRACEBACK_LINES:
            return False
        if self.kind == "warning":
            return line[:1].isspace()
        if self.group:
            return bool(_GROUP_MARGIN.match(line))
        at = self.exception_at
        return at is None or len(self.keys) - at <= MAX_MESSAGE_LINES

    def name(self, lines: list[str]) -> str:
        """The exception's or warning's class, from the block's own lines."""
        first = lines[self.exception_at or 0]
        if self.kind == "warning":
            m = WARNING_START.match(first)
            return m.group(1) if m else "Warning"
        return _GROUP_EXCEPTION.sub("", first).split(":", 1)[0]


@dataclass
class _Candidate:
    """A rank's block held back while it repeats blocks shown earlier."""

    lines: list[str]
    matching: list[_Block]
    since: float = field(default_factory=time.monotonic)

    def repeats(self) -> _Block | None:
        """The shown block this one repeats, once it has matched past the exception line."""
        n = len(self.lines)
        return next((b for b in self.matching
                     if b.exception_at is not None and n > b.exception_at), None)


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
        console: bool = False,
    ) -> None:
        super().__init__()
        self.console = console  # this terminal becomes the debugger of a rank at a breakpoint
        self._out = out
        self._err = err
        self.limit = limit
        self.tail_lines = tail_lines
        self.summary = summary
        self._shown: dict[int, int] = {}
        self._hidden: dict[int, int] = {}
        self._last: dict[int, list[tuple[str, str]]] = {}
        self._log_dir = ""
        self._blocks: list[_Block] = []            # tracebacks and warnings shown in full
        self._open: dict[int, _Block] = {}         # a rank's block still growing
        self._held: dict[int, _Candidate] = {}     # a rank's block that may be a repeat
        # rank -> {exception line shown as a repeat: the rank whose traceback it repeats}
        self._exception_lines: dict[int, dict[str, int]] = {}
        self.repeats = 0                           # blocks shown as one line
        self._console: Console | None = None       # the rank's debugger this terminal is
        self._console_lock = threading.Lock()

    @property
    def out(self) -> TextIO:
        return self._out or sys.stdout  # looked up late: Jupyter swaps sys.stdout per cell

    @property
    def err(self) -> TextIO:
        return self._err or sys.stderr

    def start(self, *, world_size: int, log_dir: str, script: str) -> None:
        self._log_dir = log_dir

    def _pump_console(self) -> None:
        """Write what the rank's debugger said so far: called by the terminal's bridge
        and before every line of a rank or of the launcher, so that pdb's answers come before
        what the rank printed once it went on."""
        with self._console_lock:
            text = self._console.take() if self._console is not None else ""
            if text:
                self.out.write(text)
                self.out.flush()

    def lines(self, rank: int, stream: str, lines: list[str]) -> None:
        # Stack dumps written from C (faulthandler on a crash) carry absolute paths, and
        # torch's C++ errors its build machine's: show them as the worker shows Python
        # tracebacks, so saved notebooks hold no machine paths.
        lines = lines_to_show(lines)
        if stream != "stderr":
            self._write(rank, stream, lines)
            return
        for line in lines:
            self._stderr_line(rank, line)

    # ------------------------------------------------------------- repeated tracebacks
    def _stderr_line(self, rank: int, line: str) -> None:
        key, kind = _same_key(line), _block_kind(line)
        held = self._held.get(rank)
        if held is not None:
            at = len(held.lines)
            still = [b for b in held.matching if at < len(b.keys) and b.keys[at] == key]
            if still and kind is None:
                held.lines.append(line)
                held.matching = still
                held.since = time.monotonic()
                return
            self._settle(rank)
        block = self._open.get(rank)
        if block is not None and (kind is not None or not block.takes(line)):
            del self._open[rank]
            block = None
        if kind is not None:
            earlier = [b for b in self._blocks if b.kind == kind and b.keys[0] == key]
            if earlier:
                self._held[rank] = _Candidate([line], earlier)
                return
            block = _Block(rank, kind, [key], [line])
            self._blocks.append(block)
            self._open[rank] = block
        elif block is not None:
            block.keys.append(key)
            block.lines.append(line)
        self._write(rank, "stderr", [line])

    def _settle(self, rank: int) -> None:
        """Show a held block: one line if it repeats a shown one, else in full."""
        held = self._held.pop(rank)
        same = held.repeats()
        if same is None:
            kind = _block_kind(held.lines[0]) or "traceback"
            block = _Block(rank, kind, [_same_key(ln) for ln in held.lines], list(held.lines))
            self._blocks.append(block)
            self._open[rank] = block
            self._write(rank, "stderr", held.lines)
            return
        if same.kind == "traceback":
            # repeats() returns only blocks whose exception line is known
            exception = held.lines[cast(int, same.exception_at)]
            self._exception_lines.setdefault(rank, {})[_same_key(exception)] = same.rank
        whose = "its own earlier one" if same.rank == rank else f"rank {same.rank}'s"
        log = os.path.join(relative_path(self._log_dir), f"rank{rank}", "stderr.log")
        self.repeats += 1
        at = cast(int, same.exception_at)
        own = held.lines[at:]
        if list(map(_message_key, own)) == list(map(_message_key, same.lines[at:at + len(own)])):
            self._write(rank, "stderr", [f"{same.name(held.lines)}: the same {same.kind} as "
                                         f"{whose} above ({len(held.lines)} lines, in {log})"])
            return
        # The same frames, but a message of its own: the message is what the rank says
        # (its shape, its rank, its size), so it is shown.
        self._write(rank, "stderr", [f"{same.name(held.lines)}: a {same.kind} like {whose} above, "
                                     f"with a message of its own ({len(held.lines)} lines, in "
                                     f"{log}):", *own])

    def _settle_all(self, *, idle_s: float = 0.0) -> None:
        now = time.monotonic()
        for rank in [r for r, c in self._held.items() if now - c.since >= idle_s]:
            self._settle(rank)

    def _shown_as(self, rank: int, exc_type: str, message: str) -> int | None:
        """The rank whose traceback was shown in full for rank's traceback of that
        exception (rank itself, or the rank it repeats); None: not shown."""
        first = _same_key(shorten_paths(message.split("\n", 1)[0]))
        shown = {b.keys[b.exception_at]: rank for b in self._blocks
                 if b.rank == rank and b.kind == "traceback" and b.exception_at is not None}
        shown.update(self._exception_lines.get(rank, {}))
        return next((whose for k, whose in shown.items() if exc_type in k and first in k), None)

    # ------------------------------------------------------------- bounded output
    def _write(self, rank: int, stream: str, lines: list[str]) -> None:
        self._pump_console()
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
        self._pump_console()
        self.out.write(f"[labutils] {text}\n")

    def debugger(self, rank: int, event: dict) -> None:
        state = event.get("state")
        if state == "ended":
            self.note(f"rank {rank} left the debugger")
        elif state == "waiting" and self.console:
            self.note(f"rank {rank} stopped at {event.get('where', 'a breakpoint')}; this terminal "
                      "is its debugger (pdb: c continues, q ends the run; the other ranks wait)")
            try:
                console = Console(event["socket"])
            except DebuggerGone:
                self.note(f"rank {rank} ended before its debugger opened")
                return
            with self._console_lock:
                self._console = console
            threading.Thread(target=bridge_terminal, args=(event["socket"],),
                             kwargs={"stdout": self.out, "console": console, "pump": self._pump_console},
                             daemon=True).start()
        elif state == "waiting":
            self.note(f"rank {rank} stopped at {event.get('where', 'a breakpoint')}; the other ranks "
                      f"wait. Debug it from a terminal: labutils debug {relative_path(self._log_dir)}"
                      f" --rank {rank}")

    def tick(self) -> None:
        self._settle_all(idle_s=HOLD_S)
        self.out.flush()

    def finish(self, result: RunResult) -> None:
        self._pump_console()
        self._settle_all()
        for rank, hidden in sorted(self._hidden.items()):
            tail = self._last.get(rank, [])
            earlier = hidden - len(tail)
            path = os.path.join(relative_path(result.log_dir), f"rank{rank}")
            self.out.write(f"[rank {rank}] ... {earlier} earlier lines in {path}/stdout.log "
                           "and stderr.log\n")
            for stream, line in tail:
                (self.out if stream == "stdout" else self.err).write(f"[rank {rank}] {line}\n")
        self.err.flush()
        if self.summary:
            f = result.failure
            whose = (self._shown_as(f.rank, f.exc_type, f.message)
                     if f and f.traceback and f.rank not in self._hidden else None)
            self.out.write(result.summary(traceback_shown=whose is not None,
                                          traceback_like=whose) + "\n")
        self.out.flush()
