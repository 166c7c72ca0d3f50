"""Follow the run folder's files: complete lines per rank, bounded in memory.

Each rank writes its own stdout.log and stderr.log (the worker bootstrap points
fd 1 and fd 2 there), so ranks can never mix within a line. The launcher polls
these files; a LineTail hands out complete lines only and keeps a trailing
partial line until its newline arrives (or the run ends). RankOutput keeps the
last ``keep`` lines of each stream in memory and counts the rest: the full text
stays on disk.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path
from typing import BinaryIO

from labutils.runtime import runfiles
from labutils.runtime.frames import DUMP_FRAME, DUMP_THREAD, script_depth

READ_CHUNK = 4 << 20  # bytes read per file per poll; a flood is drained over several polls
# A line longer than this is shown cut (the log file keeps it whole): a 50 MB line once
# went whole to the display, 100 MB of text for a notebook's browser to render.
SHOWN_LINE_CHARS = 10_000
# A line redrawn in place (a progress bar: carriage returns, no newline until it is done)
# is shown as it stands this often while it lasts, not only once it ends.
REDRAWN_EVERY_S = 2.0


class LineTail:
    """Complete lines appended to one file since the last read."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fh: BinaryIO | None = None
        self._partial = b""
        self.bytes_read = 0

    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def _read_bytes(self, max_bytes: int) -> bytes:
        if self._fh is None:
            try:
                self._fh = open(self.path, "rb")  # noqa: SIM115 - kept open while following
            except FileNotFoundError:
                return b""
        data = self._fh.read(max_bytes)
        self.bytes_read += len(data)
        return data

    def _split(self, data: bytes) -> list[bytes]:
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        return lines

    def redrawn(self) -> bytes | None:
        """What a terminal shows of the line not yet ended, when it is being redrawn in
        place (it holds a carriage return): the text after the last one; else None."""
        head, cr, last = self._partial.rpartition(b"\r")
        return (last or head.rsplit(b"\r", 1)[-1]) if cr else None

    def read(self, max_bytes: int = READ_CHUNK) -> list[bytes]:
        data = self._read_bytes(max_bytes)
        return self._split(data) if data else []

    def read_all(self) -> list[bytes]:
        """Everything left, the final partial line included."""
        lines: list[bytes] = []
        while data := self._read_bytes(READ_CHUNK):
            lines.extend(self._split(data))
        if self._partial:
            lines.append(self._partial)
            self._partial = b""
        return lines

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def decode(line: bytes) -> str:
    """A log line as text; a carriage return keeps only what a terminal would show."""
    text = line.decode("utf-8", errors="replace")
    if "\r" in text:
        text = text.rstrip("\r").rsplit("\r", 1)[-1]
    return text


class FatalDumpCut:
    """A fatal signal's faulthandler dump (a segfault, an abort) as a learner reads it:
    each thread's stack cut at the worker bootstrap like every other stack
    (frames.script_depth: no runpy, worker, multiprocessing, torchrun or warm server
    frames below the script), and the bootstrap's own threads (the progress watcher)
    left out. Lines outside a dump pass unchanged; a thread's frames wait until its
    block ends."""

    def __init__(self) -> None:
        self.in_dump = False
        self.block: list[str] | None = None  # the current thread's header and frames
        self.dropped = False  # a thread was left out: so is the blank line after it

    def feed(self, lines: list[str], *, final: bool = False) -> list[str]:
        out: list[str] = []
        for line in lines:
            if line.startswith("Fatal Python error"):
                out += self._flush()
                self.in_dump = True
            elif self.in_dump and DUMP_THREAD.match(line):
                out += self._flush()
                self.block = [line]
                continue
            elif self.block is not None and DUMP_FRAME.match(line):
                self.block.append(line)
                continue
            elif self.in_dump:
                out += self._flush()
                self.in_dump = not line.strip() or line.startswith("Stack (most recent")
                if self.dropped and not line.strip():
                    self.dropped = False
                    continue
            out.append(line)
        return out + (self._flush() if final else [])

    def _flush(self) -> list[str]:
        block, self.block = self.block, None
        if not block:
            return []
        frames = block[1:]
        depth = script_depth([m["file"] for f in frames if (m := DUMP_FRAME.match(f))])
        self.dropped = bool(frames) and depth == 0
        if self.dropped:
            return []  # a thread of the bootstrap, not of the script
        return [block[0], *frames[:depth]]


class RankOutput:
    """One rank's two streams: last ``keep`` lines of each in memory, counts of all."""

    def __init__(self, run_dir: str | os.PathLike, rank: int, *, keep: int = 1000) -> None:
        self.rank = rank
        self.paths = {s: runfiles.stream_path(run_dir, rank, s) for s in runfiles.STREAMS}
        self._tails = {s: LineTail(p) for s, p in self.paths.items()}
        self.tail: dict[str, deque[str]] = {s: deque(maxlen=keep) for s in runfiles.STREAMS}
        # (stream, line) in arrival order
        self.combined: deque[tuple[str, str]] = deque(maxlen=keep)
        self.keep = keep
        self.counts = {s: 0 for s in runfiles.STREAMS}
        self._dump = FatalDumpCut()  # faulthandler writes fatal dumps to stderr
        self._redrawn = {s: ("", 0.0) for s in runfiles.STREAMS}  # last shown, when

    def poll(self, *, final: bool = False) -> dict[str, list[str]]:
        """New complete lines per stream (all remaining ones when final), and a line
        still being redrawn in place as it stands, every REDRAWN_EVERY_S (counts: the
        lines the rank wrote, the redrawn one once, when it ends)."""
        new = {}
        for stream, tail in self._tails.items():
            raw = tail.read_all() if final else tail.read()
            lines = [self._shown(decode(b), stream) for b in raw]
            if stream == "stderr":
                lines = self._dump.feed(lines, final=final)
            self.counts[stream] += len(lines)
            shown, _ = self._redrawn[stream]
            if lines and shown:  # the redrawn line has ended: shown already if unchanged
                self._redrawn[stream] = ("", 0.0)
                if lines[0] == shown:
                    lines = lines[1:]
            lines += [] if final else self._redrawing(stream, tail)
            if not lines:
                continue
            self.tail[stream].extend(lines)
            self.combined.extend((stream, line) for line in lines[-self.keep:])
            new[stream] = lines
        return new

    def _redrawing(self, stream: str, tail: LineTail) -> list[str]:
        """The line being redrawn in place, as it stands, when it changed and
        REDRAWN_EVERY_S have passed since it was last shown ([] otherwise)."""
        now_shown = tail.redrawn()
        shown, at = self._redrawn[stream]
        now = time.monotonic()
        if now_shown is None or now - at < REDRAWN_EVERY_S:
            return []
        text = self._shown(decode(now_shown), stream)
        if not text or text == shown:
            return []
        self._redrawn[stream] = (text, now)
        return [text]

    def _shown(self, line: str, stream: str) -> str:
        """The line as the display, the summary and the tails keep it: cut after
        SHOWN_LINE_CHARS, saying where the whole of it is."""
        if len(line) <= SHOWN_LINE_CHARS:
            return line
        return (f"{line[:SHOWN_LINE_CHARS]} ... [{len(line) - SHOWN_LINE_CHARS:,} more characters; "
                f"the whole line is in rank{self.rank}/{self.paths[stream].name}]")

    def close(self) -> None:
        for tail in self._tails.values():
            tail.close()


def json_lines(tail: LineTail, *, final: bool = False) -> list[dict]:
    """The JSON objects in a tail's new lines (all of them when final); a torn last line,
    from a process killed mid-write, is passed over."""
    objects = []
    for line in tail.read_all() if final else tail.read():
        try:
            objects.append(json.loads(line))
        except ValueError:
            continue
    return objects


class EventTail:
    """Events of one rank as dicts, in the order the rank wrote them."""

    def __init__(self, run_dir: str | os.PathLike, rank: int) -> None:
        self._tail = LineTail(runfiles.events_path(run_dir, rank))

    def poll(self, *, final: bool = False) -> list[dict]:
        return json_lines(self._tail, final=final)

    def close(self) -> None:
        self._tail.close()


class EndingsTail:
    """The agents' endings files (runtime/agent.py): how each rank they reaped ended."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = run_dir
        self._tails: dict[Path, LineTail] = {}

    def poll(self, *, final: bool = False) -> list[dict]:
        for path in runfiles.endings_files(self.run_dir):
            self._tails.setdefault(path, LineTail(path))
        return [record for tail in self._tails.values()
                for record in json_lines(tail, final=final)]

    def close(self) -> None:
        for tail in self._tails.values():
            tail.close()
