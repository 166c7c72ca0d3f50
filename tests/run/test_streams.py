"""Following growing log files: whole lines only, bounded memory."""

from __future__ import annotations

import pytest

from labutils.runtime import runfiles
from labutils.run.streams import EventTail, LineTail, RankOutput, decode


def test_partial_line_waits_for_its_newline(tmp_path):
    path = tmp_path / "f.log"
    tail = LineTail(path)
    assert tail.read() == []  # file not there yet
    with open(path, "ab") as f:
        f.write(b"one\ntw")
        f.flush()
        assert tail.read() == [b"one"]
        f.write(b"o\nthree")
        f.flush()
        assert tail.read() == [b"two"]
    assert tail.read_all() == [b"three"]


def test_read_all_drains_more_than_one_chunk(tmp_path):
    path = tmp_path / "big.log"
    path.write_bytes(b"x" * 100 + b"\n" + b"y" * 10)
    tail = LineTail(path)
    assert tail.read(max_bytes=30) == []  # no newline in the first 30 bytes
    assert tail.read_all() == [b"x" * 100, b"y" * 10]


def test_carriage_return_keeps_what_a_terminal_shows():
    assert decode(b"10%\r50%\r100%") == "100%"
    assert decode(b"done\r") == "done"
    assert decode(b"\xff ok") == "\ufffd ok"


def test_rank_output_is_bounded_but_counts_everything(tmp_path):
    out_path = runfiles.stream_path(tmp_path, 0, "stdout")
    out_path.parent.mkdir(parents=True)
    out_path.write_text("".join(f"line {i}\n" for i in range(5000)))
    out = RankOutput(tmp_path, 0, keep=100)
    new = out.poll(final=True)
    assert len(new["stdout"]) == 5000
    assert out.counts == {"stdout": 5000, "stderr": 0}
    assert len(out.tail["stdout"]) == 100 and out.tail["stdout"][-1] == "line 4999"
    assert len(out.combined) == 100


def test_a_line_too_long_to_show_is_cut_and_says_where_it_is_whole(tmp_path):
    """A 50 MB line once went whole to the display (100 MB of text for 2 ranks in a
    notebook's browser); it is shown cut, and the log file keeps it."""
    from labutils.run.streams import SHOWN_LINE_CHARS

    out_path = runfiles.stream_path(tmp_path, 1, "stderr")
    out_path.parent.mkdir(parents=True)
    long = "y" * (SHOWN_LINE_CHARS + 12_345)
    out_path.write_text(f"short\n{long}\n{'z' * SHOWN_LINE_CHARS}\n")
    new = RankOutput(tmp_path, 1).poll(final=True)["stderr"]
    assert new[0] == "short" and new[2] == "z" * SHOWN_LINE_CHARS  # at the bound: whole
    assert new[1] == ("y" * SHOWN_LINE_CHARS + " ... [12,345 more characters; the whole line is "
                      "in rank1/stderr.log]")
    assert out_path.read_text().splitlines()[1] == long


def test_a_line_redrawn_in_place_shows_as_it_stands_while_it_lasts(tmp_path, monkeypatch):
    """A progress bar (tqdm: carriage returns, a newline only when it is done) showed
    nothing until it ended; now its state every REDRAWN_EVERY_S, and its end once. The
    counts stay the lines the rank wrote."""
    from labutils.run import streams

    clock = [100.0]
    monkeypatch.setattr(streams.time, "monotonic", lambda: clock[0])
    path = runfiles.stream_path(tmp_path, 0, "stderr")
    path.parent.mkdir(parents=True)
    out = RankOutput(tmp_path, 0)

    def write(text: str) -> list[str]:
        with path.open("a") as f:
            f.write(text)
        return out.poll().get("stderr", [])

    assert write("\rstep 1/4") == ["step 1/4"]  # at once the first time
    assert write("\rstep 2/4") == []  # too soon
    clock[0] += streams.REDRAWN_EVERY_S
    assert write("\rstep 3/4") == ["step 3/4"]
    clock[0] += streams.REDRAWN_EVERY_S
    assert write("") == []  # unchanged: not again
    assert write("\n") == []  # it ended as last shown
    assert write("\rstep 1/2") == ["step 1/2"]  # a new bar: at once
    assert write("\rstep 2/2\nnext\n") == ["step 2/2", "next"]  # it ended unlike last shown
    assert out.counts["stderr"] == 3 and list(out.tail["stderr"]) == [
        "step 1/4", "step 3/4", "step 1/2", "step 2/2", "next"]


def test_event_tail_skips_a_torn_last_line(tmp_path):
    path = runfiles.events_path(tmp_path, 1)
    writer = runfiles.EventWriter(path)
    writer.write({"kind": "start", "pid": 1})
    with open(path, "ab") as f:
        f.write(b'{"kind": "reco')
    events = EventTail(tmp_path, 1).poll(final=True)
    assert events == [{"kind": "start", "pid": 1}]


def test_paths_are_shortened_for_reading(tmp_path, monkeypatch):
    import sys

    from labutils.runtime.runfiles import short_path, shorten_traceback_paths

    monkeypatch.chdir(tmp_path)
    site = f"{sys.prefix}/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    assert short_path(str(tmp_path / "lesson" / "train.py")) == "lesson/train.py"
    assert short_path(site) == ".../site-packages/torch/distributed/distributed_c10d.py"
    assert short_path("/elsewhere/x.py") == "/elsewhere/x.py"
    assert short_path("<frozen runpy>") == "<frozen runpy>"
    import labutils.runtime.worker as worker
    assert short_path(worker.__file__) == ".../labutils/runtime/worker.py"
    text = f'  File "{tmp_path}/train.py", line 3, in <module>\n  File "{site}", line 9, in f\n'
    assert shorten_traceback_paths(text) == (
        '  File "train.py", line 3, in <module>\n'
        '  File ".../site-packages/torch/distributed/distributed_c10d.py", line 9, in f\n')


@pytest.mark.parametrize("text, shown", [
    ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
     "Connection closed by peer [127.0.0.1]:38108.",
     "RuntimeError: [.../third_party/gloo/gloo/transport/tcp/pair.cc:553] "
     "Connection closed by peer [127.0.0.1]:38108."),
    ("Exception raised from run at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/"
     "ProcessGroupGloo.cpp:123 (most recent call first):",
     "Exception raised from run at .../torch/csrc/distributed/c10d/ProcessGroupGloo.cpp:123 "
     "(most recent call first):"),
    ("frame #3: /var/lib/jenkins/workspace/c10/util/Exception.cpp:45",
     "frame #3: .../c10/util/Exception.cpp:45"),
    ("(/pytorch/aten/src/ATen/native/Copy.hpp, /pytorch/aten/src/ATen/x.h)",
     "(.../aten/src/ATen/native/Copy.hpp, .../aten/src/ATen/x.h)"),
    ("built in /__w/pytorch/pytorch/tools/setup_helpers/x.py", "built in .../tools/setup_helpers/x.py"),
    # not torch's build paths: unchanged
    ("/usr/include/c++/12/bits/stl_vector.h:1125", "/usr/include/c++/12/bits/stl_vector.h:1125"),
    ("lessons/torch/notes.cpp and .../site-packages/torch/csrc/x.h",
     "lessons/torch/notes.cpp and .../site-packages/torch/csrc/x.h"),
    ("/home/me/torch/train.py", "/home/me/torch/train.py"),
    ("loss 1/2 at step 3", "loss 1/2 at step 3"),
])
def test_torch_build_paths_are_cut_to_the_source_tree(text, shown):
    from labutils.runtime.runfiles import shorten_build_paths

    assert shorten_build_paths(text) == shown


def test_shorten_paths_does_tracebacks_and_build_paths(tmp_path, monkeypatch):
    from labutils.runtime.runfiles import shorten_paths

    monkeypatch.chdir(tmp_path)
    line = f'  File "{tmp_path}/train.py", line 3, in <module>'
    assert shorten_paths(line) == '  File "train.py", line 3, in <module>'
    assert shorten_paths("[/__w/pytorch/pytorch/torch/csrc/a.cpp:1] x") == "[.../torch/csrc/a.cpp:1] x"
    warning = f"{tmp_path}/lesson/train.py:12: UserWarning: careful"  # warnings.showwarning
    assert shorten_paths(warning) == "lesson/train.py:12: UserWarning: careful"
    assert shorten_paths("see lesson/train.py:12") == "see lesson/train.py:12"
