"""What a rank that died without a Python exception left on its stderr.

A C++ exception that nothing catches ends the process through std::terminate: SIGABRT,
and no Python traceback. gloo does this when two ranks pass tensors of different sizes
to one collective ("Received data size doesn't match expected size"). Two things on the
rank's stderr still say what happened and where:

- std::terminate's own lines: "terminate called after throwing an instance of 'T'" and
  "  what():  <the message>";
- the dump faulthandler writes for a fatal signal (every rank has it on, for the hang
  report): each thread's Python stack, one of them at the script's line.

A rank that exits with a non-zero code and no exception of its own often does so
because another thread failed: threading prints that thread's traceback, "Exception
in thread NAME:", and the main thread goes on to exit.
"""

from __future__ import annotations

import linecache
import re

from labutils.run.diagnosis import Failure
from labutils.run.hang import parse_faulthandler
from labutils.runtime.frames import DUMP_THREAD, Frame, is_library, script_depth
from labutils.runtime.runfiles import short_path

_THROWN_RE = re.compile(r"terminate called after throwing an instance of '([^']+)'")
_WHAT_RE = re.compile(r"^\s*what\(\):\s*(.+)$", re.MULTILINE)
_THREAD_START_RE = re.compile(f"(?={DUMP_THREAD.pattern})", re.MULTILINE)  # split before each header
_THREAD_EXC_RE = re.compile(r"^Exception in thread (.+):\n((?:[ \t].*\n|Traceback.*\n)*)(\S.*)$",
                            re.MULTILINE)


def thread_exception(stderr: str) -> str:
    """The last uncaught exception of another thread on a rank's stderr, as
    "thread NAME raised Type: message" ("" if none)."""
    found = list(_THREAD_EXC_RE.finditer(stderr))
    if not found:
        return ""
    name, _, error = found[-1].groups()
    return f"thread {name} raised {error.strip()}"


def after_thread(message: str, stderr: str) -> str:
    """message, followed by the thread whose exception stderr shows, if any: what a
    rank that exited (or a cell that raised SystemExit) ended after."""
    raised = thread_exception(stderr)
    return f"{message}, after {raised}" if raised else message


def read_crash(stderr: str, dump: str = "") -> tuple[str, list[Frame]]:
    """The C++ error and the Python stack of a rank that crashed.

    Args:
        stderr: the end of the rank's stderr (the last crash in it is read).
        dump: the stacks faulthandler wrote elsewhere as the signal arrived (SIGTERM's
            go to rankN/ended-stacks.txt), read when stderr has no fatal error's dump:
            its last thread with the script's frames.

    Returns:
        ("Type: what() message" or "", the frames of the thread that ran the script,
        innermost first, cut below the script; [] when no thread did).
    """
    thrown = list(_THROWN_RE.finditer(stderr))
    what = list(_WHAT_RE.finditer(stderr))
    message = what[-1].group(1).strip() if what else ""
    if message and thrown:
        message = f"{thrown[-1].group(1)}: {message}"
    if "Fatal Python error" in stderr:
        blocks = _THREAD_START_RE.split(stderr[stderr.rfind("Fatal Python error"):])[1:]
    else:  # dumps follow one another without a header: the last thread that ran the script
        blocks = _THREAD_START_RE.split(dump)[1:][::-1]
    for block in blocks:
        frames = parse_faulthandler(block, None)
        if any(not is_library(fr.file) for fr in frames):
            return message, frames[:script_depth([fr.file for fr in frames])]
    return message, []


def explain_crash(failure: Failure, stderr: str, dump: str = "") -> None:
    """Give a failure found only by its signal (no exception event) the crash's message,
    the script's line it happened at and that thread's stack, where stderr (or dump,
    see read_crash) has them."""
    if failure.kind == "exit":
        failure.message = after_thread(failure.message, stderr)
        return
    message, frames = read_crash(stderr, dump)
    at = next((fr for fr in frames if not is_library(fr.file)), None)
    if not message and at is None:
        return
    if message:
        failure.message = f"{message} (the process died of {failure.exc_type}: no Python exception)"
    if at is not None:
        failure.file, failure.line = at.file, at.line
        failure.source = linecache.getline(at.file, at.line).strip()
        failure.traceback = "\n".join(
            ["Python stack of the thread that ran the script (innermost first):"]
            + [f'  File "{short_path(fr.file)}", line {fr.line} in {fr.func}' for fr in frames])
