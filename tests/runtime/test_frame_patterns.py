"""The two ways a stack is written, read by one pair of patterns (runtime/frames.py):
a Python traceback, outermost frame first, and a faulthandler dump (a hang's stacks, a
fatal signal), innermost first. The texts here are the interpreter's own."""

from __future__ import annotations

import faulthandler
import traceback

from labutils.runtime.frames import DUMP_FRAME, TRACEBACK_FRAME, Frame, dump_frames, traceback_frames

HERE = __file__


def _inner():
    raise ValueError("deep")


def _outer():
    _inner()


def test_a_traceback_reads_outermost_first_with_lines_and_functions():
    try:
        _outer()
    except ValueError:
        text = traceback.format_exc()
    frames = traceback_frames(text)
    assert [(f.file, f.func) for f in frames] == [
        (HERE, "test_a_traceback_reads_outermost_first_with_lines_and_functions"),
        (HERE, "_outer"), (HERE, "_inner")]
    assert frames[-1].line == _inner.__code__.co_firstlineno + 1


def test_a_syntax_errors_location_is_a_frame_without_a_function():
    try:
        compile("x = 1\nif x\n", "broken.py", "exec")
    except SyntaxError:
        text = traceback.format_exc()
    assert traceback_frames(text)[-1] == Frame("broken.py", 2, "")


def test_a_dump_reads_innermost_first(tmp_path):
    with open(tmp_path / "dump.txt", "w+") as out:
        faulthandler.dump_traceback(out, all_threads=False)
        out.seek(0)
        text = out.read()
    frames = dump_frames(text)
    assert frames[0] == Frame(HERE, frames[0].line, "test_a_dump_reads_innermost_first")
    assert frames[0].line == test_a_dump_reads_innermost_first.__code__.co_firstlineno + 2


def test_each_pattern_leaves_the_other_forms_line_alone():
    """A traceback's frame has ", in", a dump's " in": a dump is never read as a
    traceback (its frames' order is the other way round), nor the reverse."""
    traceback_line = '  File "/w/train.py", line 12, in main'
    dump_line = '  File "/w/train.py", line 12 in main'
    assert TRACEBACK_FRAME.match(traceback_line) and not TRACEBACK_FRAME.match(dump_line)
    assert DUMP_FRAME.match(dump_line) and not DUMP_FRAME.match(traceback_line)
    assert traceback_frames('  File "/w/a "quoted" name.py", line 3, in f') == [
        Frame('/w/a "quoted" name.py', 3, "f")]
