"""Following growing log files: whole lines only, bounded memory."""

from __future__ import annotations

from labutils import runfiles
from labutils.streams import EventTail, LineTail, RankOutput, decode


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

    from labutils.runfiles import short_path, shorten_traceback_paths

    monkeypatch.chdir(tmp_path)
    site = f"{sys.prefix}/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    assert short_path(str(tmp_path / "lesson" / "train.py")) == "lesson/train.py"
    assert short_path(site) == ".../site-packages/torch/distributed/distributed_c10d.py"
    assert short_path("/elsewhere/x.py") == "/elsewhere/x.py"
    assert short_path("<frozen runpy>") == "<frozen runpy>"
    text = f'  File "{tmp_path}/train.py", line 3, in <module>\n  File "{site}", line 9, in f\n'
    assert shorten_traceback_paths(text) == (
        '  File "train.py", line 3, in <module>\n'
        '  File ".../site-packages/torch/distributed/distributed_c10d.py", line 9, in f\n')
