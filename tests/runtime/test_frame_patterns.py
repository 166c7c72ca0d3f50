"""The two ways a stack is written, read by one pair of patterns (runtime/frames.py):
a Python traceback, outermost frame first, and a faulthandler dump (a hang's stacks, a
fatal signal), innermost first. The texts here are the interpreter's own."""

from __future__ import annotations

import faulthandler
import traceback

from labutils.runtime.frames import (
    DUMP_FRAME,
    TRACEBACK_FRAME,
    Frame,
    dump_frames,
    is_library,
    learners_frame,
    traceback_frames,
)

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


def test_the_learners_line_is_the_innermost_of_their_own_files(tmp_path):
    """A lab's harness (ring_test.py) calls the learner's module (ring.py), which calls
    torch: the line is ring.py's, not the harness's; labutils' own files (the grader's
    probe, the course's helpers) count as a library's, however labutils is installed."""
    import torch

    import labutils.grading.probe as probe

    harness, mine, torch_file = str(tmp_path / "ring_test.py"), str(tmp_path / "ring.py"), torch.__file__
    assert learners_frame([harness, mine, torch_file], harness) == 1
    assert learners_frame([probe.__file__, "<frozen runpy>", harness, mine, torch_file],
                          probe.__file__) == 3
    # nothing of the learner's on the stack: the script's own innermost frame, else none
    assert learners_frame([probe.__file__, torch_file, probe.__file__], probe.__file__) == 2
    assert learners_frame([torch_file], harness) is None
    # torch.compile's generated modules, in a cache folder anywhere, are torch's, and so is
    # whatever runs inside the compiler: the line is the one that called into it
    compiler = torch_file.replace("__init__.py", "_inductor/compile_fx.py")
    generated = str(tmp_path / "inductor-cache" / "ms" / "cmsuiykei7xeyapamr.py")
    assert learners_frame([harness, mine, torch_file, compiler, generated, torch_file], harness) == 1
    assert learners_frame([compiler, generated], harness) is None
    assert is_library(probe.__file__) and not is_library(mine)
