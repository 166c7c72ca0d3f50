"""Lesson 13's tables and checks (lessons/13_where_time_goes/lesson13.py) on hand-made
traces and debug-server pages, each check turned False by the fact it claims; and the
traces put on one clock (labutils.course.spans)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from helpers import LESSONS

from labutils.course import lesson
from labutils.course.spans import merge_traces, trace_events
from labutils.errors import InputError

L = lesson.load(LESSONS / "13_where_time_goes", "lesson13")
BWD = "autograd::engine::evaluate_function: AddmmBackward0"


def write_trace(path, spans, *, base_us: float) -> None:
    """spans: (name, start ms, duration ms, tid) on the rank's own clock, which starts at base_us."""
    events = [{"ph": "X", "name": name, "ts": base_us + start * 1e3, "dur": dur * 1e3, "tid": tid, "pid": 1}
              for name, start, dur, tid in spans]
    path.write_text(json.dumps({"traceEvents": [{"ph": "M", "name": "thread_name"}, *events]}))


def step_spans(i: int, *, slow: float = 0, comm_start: float = 200, comm: float = 150,
               buckets: int = 1) -> list:
    """One step of 500 ms at 500 i: data (10 ms, + slow), then forward (100 ms), backward
    ops (4 of 49 ms) and the optimizer at 480; all-reduces from comm_start for comm ms in
    total, on thread 9."""
    t = 500.0 * i
    spans = [(f"step {i}", t, 500, 1), ("data", t, 10 + slow, 1), ("forward", t + 10 + slow, 100, 1)]
    spans += [(BWD, t + 110 + slow + 50 * k, 49, 1) for k in range(4)]
    spans += [("optimizer", t + 480, 10, 1)]
    spans += [("gloo:all_reduce", t + comm_start + k * comm / buckets, comm / buckets, 9) for k in range(buckets)]
    spans += [("c10d::allreduce_", t + comm_start, 0.1, 1)]
    return spans


def make_run(tmp_path, name, per_rank, *, bucket_mb=1.0, slow_rank=-1, slow_ms=0.0, offset_us=None):
    """A run of 2 ranks whose traces start at different profiler clocks; clock_ns says where."""
    records = []
    for rank, spans in per_rank.items():
        base = 1_000_000.0 * (rank + 1) if offset_us is None else offset_us[rank]
        path = tmp_path / f"{name}{rank}.json"
        write_trace(path, [("clock", -1, 0.01, 1), *spans], base_us=base)
        # every rank opened its clock span at the same wall-clock instant, 1 ms before its spans
        records.append({"rank": rank, "part": "trace", "path": str(path), "clock_ns": 1_800_000_000_000_000_000,
                        "bucket_mb": bucket_mb, "slow_rank": slow_rank, "slow_ms": slow_ms, "batch": 2048})
    return SimpleNamespace(records=records, log_dir=tmp_path)


def steps(**kw):
    return [s for i in range(3) for s in step_spans(i, **kw)]


def test_exposed_time_is_communication_while_the_rank_has_no_work(tmp_path):
    one = make_run(tmp_path, "one", {0: steps(comm_start=320, comm=150), 1: steps(comm_start=320, comm=150)},
                   bucket_mb=64)
    many = make_run(tmp_path, "many", {0: steps(comm_start=160, comm=150, buckets=4),
                                       1: steps(comm_start=160, comm=150, buckets=4)})
    s = L.rank_steps(one)[0][1]
    assert s["step"] == pytest.approx(0.5) and s["comm"] == pytest.approx(0.15)
    assert s["exposed"] == pytest.approx(0.15)  # 320..470: after backward, before the optimizer
    m = L.rank_steps(many)[0][1]
    assert m["exposed"] == pytest.approx(0.003, abs=1e-5)  # 1 ms after each of the last 3 backward ops
    assert "False" not in L.overlap_claims(one, many)
    assert "one bucket 30%" in L.exposure_line(one, many)
    assert "exposed share" in L.step_table({"one": one, "many": many})
    # buckets that start after backward hide nothing: the claims say so
    late = make_run(tmp_path, "late", {0: steps(comm_start=320, comm=150, buckets=4),
                                       1: steps(comm_start=320, comm=150, buckets=4)})
    claims = L.overlap_claims(one, late)
    assert "before backward's last op ends, on every rank: False" in claims
    assert "at least a fifth shorter: False" in claims
    # one bucket whose all-reduce ran beside backward is not what the lesson says
    assert "(< 5%): False" in L.overlap_claims(many, many)


def test_the_straggler_is_the_rank_with_the_most_work_and_the_least_waiting(tmp_path):
    slow = make_run(tmp_path, "slow", {0: steps(comm_start=160, comm=300, buckets=4),
                                       1: steps(slow=150, comm_start=300, comm=160, buckets=4)},
                    slow_rank=1, slow_ms=150)
    assert "False" not in L.straggler_claims(slow)
    assert "waiting in all-reduce ms" in L.straggler_table(slow)
    named_wrong = make_run(tmp_path, "wrong", {0: steps(comm_start=160, comm=300, buckets=4),
                                               1: steps(slow=150, comm_start=300, comm=160, buckets=4)},
                           slow_rank=0, slow_ms=150)
    assert "the one slowed: False" in L.straggler_claims(named_wrong)
    lanes, t0 = L.timeline_lanes(slow)
    assert set(lanes[1]) == {"data", "forward", "backward ops", "optimizer", "all-reduce"}


def test_traces_of_different_profiler_clocks_land_on_one_wall_clock(tmp_path):
    run = make_run(tmp_path, "clk", {0: steps(), 1: steps()}, offset_us={0: 5_000.0, 1: 9_000_000.0})
    a, b = (trace_events(r["path"], marker=("clock", r["clock_ns"])) for r in run.records)
    first = {e["name"]: e["start"] for e in reversed(a)}, {e["name"]: e["start"] for e in reversed(b)}
    assert first[0]["step 1"] == pytest.approx(first[1]["step 1"], abs=1e-6)
    merged = json.loads(L.merged_trace(run).read_text())["traceEvents"]
    starts = {e["pid"]: e["ts"] for e in merged if e.get("name") == "step 1"}
    assert starts[0] == pytest.approx(starts[1], abs=1e-3)
    assert {e["args"]["name"] for e in merged if e.get("name") == "process_name"} == {"rank 0", "rank 1"}
    with pytest.raises(InputError, match="a span named 'nowhere'"):
        merge_traces({0: (run.records[0]["path"], 0)}, tmp_path / "x.json", marker="nowhere")


def page(bodies: dict[int, str]) -> str:
    return "<html>" + "".join(f"<h2>Rank {r}: http://vm:1/handler/x?</h2>\n  <pre>{b}</pre>" for r, b in bodies.items())


def fr(last: int) -> str:
    return json.dumps({"pg_status": {"0": {"last_enqueued_collective": str(last)}}}).replace('"', "&#34;")


STACKS = {0: 'Thread 0x1 (most recent call first):\n  File "/x/13_where_time_goes/stuck.py", line 45 in <module>\n',
          1: 'Thread 0x1 (most recent call first):\n  File "/x/threading.py", line 327 in wait\n'
             '  File "/x/13_where_time_goes/stuck.py", line 37 in wait_for_data\n'
             '  File "/x/13_where_time_goes/stuck.py", line 42 in <module>\n'}


def hang_run(stragglers, lines=(45, 37)):
    summary = (f"hang: ...\n  rank 0 waits at 13_where_time_goes/stuck.py:{lines[0]} in all_reduce()\n"
               f"  rank 1 waits at 13_where_time_goes/stuck.py:{lines[1]}  <- straggler")
    return SimpleNamespace(reason="hang", hang=SimpleNamespace(stragglers=stragglers), summary=lambda: summary)


def test_the_debug_server_pages_are_read_per_rank_and_set_beside_the_hang_report():
    pages = {"/fr_trace_json": page({0: fr(4), 1: fr(3)}), "/stacks": page(STACKS)}
    assert L.flight_recorder(pages["/fr_trace_json"]) == {0: 4, 1: 3}
    assert L.script_frames(pages["/stacks"], "stuck.py") == {0: "stuck.py:45 in <module>",
                                                             1: "stuck.py:37 in wait_for_data"}
    assert "stuck.py:37 in wait_for_data" in L.debug_server_table(pages, "stuck.py")
    assert "False" not in L.debug_server_claims(pages, hang_run([1]), "stuck.py")
    assert "straggler: False" in L.debug_server_claims(pages, hang_run([0]), "stuck.py")
    assert "hang report's: False" in L.debug_server_claims(pages, hang_run([1], lines=(45, 38)), "stuck.py")


def test_the_watch_says_when_no_stuck_job_showed_up():
    watch = L.DebugServerWatch(L.free_port(), timeout=1.0)
    watch.start()
    watch.join(5)
    assert not watch.pages and "showed no stuck job within 1 s" in watch.error
