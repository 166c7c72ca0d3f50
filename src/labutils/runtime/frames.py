"""Stack frames: how tracebacks and faulthandler dumps write them, and whose code a
frame is in (the bootstrap's, a library's, or the learner's).

The worker uses this to cut its own frames from a rank's exception, the diagnosis
to find the line a hung or failed rank was on, the grader to name a learner's line;
all read frames with the same patterns and the same file names.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Frame:
    """One frame of a stack: its file, line and function ("" where the text gives none)."""

    file: str
    line: int
    func: str


# A frame as a Python traceback writes it, '  File "train.py", line 12, in main' (a
# SyntaxError's location has no ", in"), and as a faulthandler dump (a hang's stacks, a
# fatal signal) writes it, '  File "train.py", line 12 in main'. Matched line by line
# (match) or in a whole text (finditer: re.M).
TRACEBACK_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+)(?:, in (?P<func>.*))?$', re.M)
DUMP_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$', re.M)


# The header of each thread's stack in a faulthandler dump: "Thread 0x00007f06...
# (most recent call first):", and "Current thread 0x..." for the thread that wrote it.
DUMP_THREAD = re.compile(r"^(?:Current thread|Thread) (?P<ident>0x[0-9a-fA-F]+)", re.M)


def dump_thread(text: str, ident: int) -> str | None:
    """The stack of thread `ident` (threading.get_ident()) in a faulthandler dump of
    all threads, as the text after its header; None when the dump has no such thread."""
    heads = list(DUMP_THREAD.finditer(text))
    for head, following in zip(heads, [*heads[1:], None]):
        if int(head["ident"], 16) == ident:
            return text[head.end():following.start() if following else len(text)]
    return None


def traceback_frames(text: str) -> list[Frame]:
    """The frames of the Python tracebacks in text, in the text's order (outermost first)."""
    return [_frame(m) for m in TRACEBACK_FRAME.finditer(text)]


def dump_frames(text: str) -> list[Frame]:
    """The frames of the faulthandler dumps in text, in the text's order (innermost first
    in each thread)."""
    return [_frame(m) for m in DUMP_FRAME.finditer(text)]


def _frame(m: re.Match) -> Frame:
    return Frame(m["file"], int(m["line"]), (m["func"] or "").strip())


_RUNTIME = os.path.dirname(os.path.abspath(__file__))
_PACKAGE = os.path.dirname(_RUNTIME)  # labutils, installed or (as in the course) editable
# The loop a persistent world's ranks run the notebook's cells in (labutils/cells.py).
_CELLS = os.path.join(_PACKAGE, "cells.py")


def is_bootstrap(path: str) -> bool:
    """A frame of what runs the learner's script: runpy, labutils' worker, or the loop
    that runs a persistent world's cells."""
    return path == "<frozen runpy>" or path.endswith(("/runpy.py", "labutils/runtime/worker.py")) \
        or path.startswith(_RUNTIME) or path == _CELLS


_INDUCTOR = f"{os.sep}torch{os.sep}_inductor{os.sep}"  # torch.compile's code generator


def is_library(path: str) -> bool:
    """A frame outside the learner's code: installed packages, the standard library,
    frozen or generated code, labutils itself (its bootstrap, the grader's probe, the
    course's helpers), wherever it is installed."""
    return (
        "site-packages" in path or "dist-packages" in path or path.startswith("<")
        or "/lib/python3" in path or path.startswith((sys.base_prefix, sys.prefix))
        or path.startswith(_PACKAGE + os.sep) or is_bootstrap(path)
    )


def learners_frame(files: Sequence[str], script: str | None) -> int | None:
    """Which frame of a stack is the learner's line: the index in files (each frame's
    file, outermost first, as a traceback lists them) of the innermost frame in the
    learner's own files, else of the innermost in the script, else None.

    The innermost, not the script's: a lab's harness (ring_test.py) calls the learner's
    module (ring.py), and the line that raised or waits is in the module; a grader's
    run launches the probe, which runs the learner's script. The script counts where
    nothing of the learner's is on the stack but it is (a script of labutils' own).

    What torch's compiler runs is torch's, the code it generated included: the modules
    it writes to its cache folder (TORCHINDUCTOR_CACHE_DIR, a temporary folder of each
    rank's) are called from torch/_inductor, so no frame inside the compiler's first
    one is the learner's."""
    compiler = next((i for i, f in enumerate(files) if _INDUCTOR in f), len(files))
    mine = [i for i, f in enumerate(files[:compiler]) if not is_library(f)]
    if not mine and script:
        script_abs = os.path.abspath(script)
        mine = [i for i, f in enumerate(files[:compiler]) if os.path.abspath(f) == script_abs]
    return mine[-1] if mine else None


def script_depth(files: list[str]) -> int:
    """How many frames of a stack (innermost first) are the script's own and what it
    called: the frames under the script (runpy, the worker bootstrap, and in a warm
    run's forked rank, multiprocessing and torchrun's function entry point below
    them) are cut at the innermost frame of the worker bootstrap."""
    worker = [i for i, f in enumerate(files) if f.endswith("labutils/runtime/worker.py")]
    depth = worker[0] if worker else len(files)
    while depth and is_bootstrap(files[depth - 1]):
        depth -= 1
    return depth


# torch re-raises, in the process that waited, an exception a DataLoader worker process
# (or a DataParallel replica's thread) caught, its traceback text in the new message:
# "Caught KeyError in DataLoader worker process 0.\nOriginal Traceback (most recent
# call last):\n  File ...\nKeyError: 'item 3'" (torch/_utils.py, ExceptionWrapper).
_CAUGHT = re.compile(r"Caught (?P<type>[\w.]+) (?P<where>in [^\n]+?)\.\n"
                     r"Original (?P<tb>Traceback \(most recent call last\):\n.*)", re.S)


@dataclass(frozen=True)
class Caught:
    """An exception raised in another process or thread, as torch re-raised it."""

    exc_type: str
    message: str  # the original exception's own message
    where: str  # "in DataLoader worker process 0"
    frames: tuple[tuple[str, int, str], ...]  # (file, line, source), outermost first


def caught_elsewhere(message: str) -> Caught | None:
    """The original exception inside a message torch wrote when it re-raised an
    exception a DataLoader worker or a DataParallel replica caught; None for any other
    message. Of chained exceptions, the last (the one that was raised) counts."""
    found = _CAUGHT.match(message)
    if found is None:
        return None
    lines = found["tb"].splitlines()
    start = max(i for i, text in enumerate(lines) if text == "Traceback (most recent call last):")
    frames: list[tuple[str, int, str]] = []
    rest = len(lines)
    for i in range(start + 1, len(lines)):
        frame = TRACEBACK_FRAME.match(lines[i])
        if frame:
            source = lines[i + 1].strip() if i + 1 < len(lines) and lines[i + 1].startswith("    ") else ""
            frames.append((frame["file"], int(frame["line"]), source))
        elif not lines[i].startswith(" "):
            rest = i
            break
    exception = "\n".join(lines[rest:]).strip()
    head, sep, tail = exception.partition(": ")
    if sep and head.rsplit(".", 1)[-1] == found["type"].rsplit(".", 1)[-1]:
        exception = tail
    elif exception.rsplit(".", 1)[-1] == found["type"].rsplit(".", 1)[-1]:
        exception = ""  # raised without a message
    return Caught(found["type"], exception, found["where"], tuple(frames))
