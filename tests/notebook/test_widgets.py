"""The widget display: bounded panes, coalesced updates, and a Stop button that works
while the cell is busy (proved against a real ipykernel)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from labutils.notebook import panes
from labutils.notebook import widgets as lw
from labutils.runtime import runfiles
from labutils.runtime.procs import pid_alive
from labutils.errors import LaunchConfigError
from labutils.run.result import RankResult, RunResult
from helpers import iopub_until


@pytest.fixture
def shown(monkeypatch):
    """Widgets shown with display() are collected here instead of printed."""
    out = []
    monkeypatch.setattr(lw, "display", out.append)
    return out


def started(tmp_path, world_size=2, **options) -> lw.WidgetDisplay:
    d = lw.WidgetDisplay(**options)
    d.start(world_size=world_size, log_dir=str(tmp_path / "run"), script="train.py")
    return d


# ------------------------------------------------------------------ LineWindow
@pytest.mark.parametrize("counts, keep, shown_lines, hidden", [
    ((0, 0), 3, 0, {"stdout": 0, "stderr": 0}),
    ((2, 0), 3, 2, {"stdout": 0, "stderr": 0}),
    ((5, 0), 3, 3, {"stdout": 2, "stderr": 0}),
    ((5, 4), 3, 3, {"stdout": 5, "stderr": 1}),  # stdout came first, so it scrolled out
])
def test_line_window_counts_what_scrolled_out(counts, keep, shown_lines, hidden):
    w = panes.LineWindow(keep)
    w.add(0, "stdout", [f"o{i}" for i in range(counts[0])])
    w.add(0, "stderr", [f"e{i}" for i in range(counts[1])])
    assert len(w.window) == shown_lines
    assert w.hidden() == hidden


def test_line_window_html_escapes_cuts_and_colours():
    w = panes.LineWindow(10)
    w.add(3, "stdout", ["<b>tag</b>", "x" * (panes.MAX_LINE_CHARS + 7)])
    w.add(3, "stderr", ["oops"])
    page = w.html(prefix=True, earlier_in="r/{stream}.log")
    assert "[rank 3] &lt;b&gt;tag&lt;/b&gt;" in page
    assert "... (7 more characters)" in page and "x" * (panes.MAX_LINE_CHARS + 1) not in page
    assert f"color:{panes.STDERR_COLOR}'>[rank 3] oops" in page
    assert "earlier" not in page


# ------------------------------------------------------------ WidgetDisplay
def test_flood_of_a_million_lines_stays_bounded_and_coalesced(tmp_path, shown):
    d = started(tmp_path, lines=40, updates_per_s=4)
    assert shown == [d.root]
    pushes_before = d.pushes
    sent = []
    d.panes[0].body.observe(lambda change: sent.append(len(change["new"])), "value")
    t0 = time.monotonic()
    for chunk in range(100):  # 1,000,000 lines of rank 0, ticking as the launcher does
        d.lines(0, "stdout", [f"line {chunk * 10_000 + i}" for i in range(10_000)])
        d.tick()
    elapsed = time.monotonic() - t0
    d.tick()
    ticks_allowed = int(elapsed * 4) + 2
    assert d.pushes - pushes_before <= ticks_allowed
    assert len(sent) <= ticks_allowed
    time.sleep(0.3)
    d.tick()  # the last lines arrive once the interval has passed
    body = d.panes[0].body.value
    assert len(body) < 5000, "a pane holds about 40 short lines, not the flood"
    assert "999960 earlier lines in " + os.path.join(runfiles.relative_path(str(tmp_path / "run")),
                                                     "rank0", "stdout.log") in body
    assert "line 999999" in body and "line 999959<" not in body
    assert body.count("\n") == 40  # the note plus 40 lines
    combined = d.combined_view.value
    assert "[rank 0] line 999999" in combined and "999800 earlier lines in" in combined
    assert len(combined) < 20_000


def test_lines_between_ticks_are_one_update(tmp_path, shown):
    d = started(tmp_path)
    d.tick()
    changes = []
    d.panes[1].body.observe(lambda change: changes.append(change), "value")
    time.sleep(d.interval_s)
    for i in range(50):
        d.lines(1, "stderr", [f"warning {i}"])
    assert changes == [], "lines() only buffers"
    d.tick()
    d.tick()
    assert len(changes) == 1
    assert "10 earlier lines in" in changes[0]["new"] and "stderr.log" in changes[0]["new"]


def test_panes_cut_build_paths_as_the_text_display_does(tmp_path, shown):
    d = started(tmp_path)
    d.lines(0, "stderr", ["[W1123 socket.cpp:207] [/__w/pytorch/pytorch/torch/csrc/distributed/"
                          "c10d/socket.cpp:207] warning"])
    time.sleep(d.interval_s)
    d.tick()
    body = d.panes[0].body.value
    assert "/__w/" not in body and ".../torch/csrc/distributed/c10d/socket.cpp:207" in body


def test_states_notes_and_finish(tmp_path, shown):
    d = started(tmp_path)
    assert d.stop.disabled, "outside a kernel there is no subshell: Stop is off"
    assert "interrupt button" in d.stop_hint.value
    d.state(0, "running")
    d.state(1, "running")
    d.note("no rank made progress for 30 s: reading every rank's stack")
    d.lines(1, "stdout", ["hello"])
    d.state(0, "hung")
    ranks = [RankResult(rank=0, state="hung"), RankResult(rank=1, state="killed")]
    result = RunResult(ok=False, world_size=2, duration_s=1.0, log_dir=tmp_path / "run",
                       ranks=ranks, reason="hang")
    d.finish(result)
    assert shown == [d.root, result], "the summary is a normal output below the panes"
    assert ">hung<" in d.panes[0].head.value and ">killed<" in d.panes[1].head.value
    assert "hello" in d.panes[1].body.value
    assert "reading every rank&#x27;s stack" in d.notes.value
    assert d.stop.disabled


def test_panes_name_the_root_cause_its_victims_and_the_straggler(tmp_path, shown):
    from labutils.run.diagnosis import Failure
    from labutils.run.hang import Hang

    d = started(tmp_path, world_size=3)
    failure = Failure(rank=1, exc_type="ValueError", message="bad", file="t.py", line=3,
                      traceback="", victims=[0])
    ranks = [RankResult(rank=0, state="failed", victim=True), RankResult(rank=1, state="failed"),
             RankResult(rank=2, state="killed")]
    d.finish(RunResult(ok=False, world_size=3, duration_s=1.0, log_dir=tmp_path / "run",
                       ranks=ranks, failure=failure, reason="failed"))
    heads = [p.head.value for p in d.panes]
    assert "victim of rank 1" in heads[0] and "root cause" in heads[1]
    assert "&middot;" not in heads[2], "a rank stopped by the launcher plays no part"

    d = started(tmp_path, world_size=2)
    hang = Hang(stacks={}, waiting={0: "t.py:5", 1: "t.py:9"}, stragglers=[1])
    d.finish(RunResult(ok=False, world_size=2, duration_s=1.0, log_dir=tmp_path / "run",
                       ranks=[RankResult(rank=0, state="hung"), RankResult(rank=1, state="hung")],
                       hang=hang, reason="hang"))
    assert "straggler" not in d.panes[0].head.value and "straggler" in d.panes[1].head.value


def test_stop_click_sets_the_flag_the_launcher_polls(tmp_path, shown):
    d = started(tmp_path)
    d.stop.click()
    assert d.stop_requested.is_set()
    time.sleep(d.interval_s)
    d.tick()
    assert d.stop.description == "stopping" and d.stop.disabled


# ------------------------------------------------------------ progress bars
@pytest.mark.parametrize("values, shown", [
    ({"step": 0, "total": 10}, (1, 10)),        # step counts from 0, like range(total)
    ({"step": 9, "total": 10, "loss": 0.1}, (10, 10)),
    ({"step": 12, "total": 10}, (10, 10)),      # past the end stays full
    ({"step": 3}, None),                        # no total: no bar
    ({"total": 10}, None),
    ({"step": 1.0, "total": 10}, None),         # counts are ints
    ({"step": True, "total": 10}, None),
    ({"step": -1, "total": 10}, None),
    ({"step": 1, "total": 0}, None),
    ({"step": "3", "total": 10}, None),
])
def test_progress_takes_step_and_total_counts(values, shown):
    p = panes.Progress()
    assert p.update(values, now=0.0) is (shown is not None)
    if shown:
        assert (p.done, p.total) == shown


def test_progress_label_estimates_time_left_from_the_pace_since_the_first_report():
    p = panes.Progress()
    p.update({"step": 0, "total": 10}, now=100.0)
    assert p.label() == "1/10"  # one report: no pace yet
    p.update({"step": 4, "total": 10}, now=108.0)  # 4 steps in 8 s: 2 s a step
    assert p.label() == "5/10 · ~10 s left"
    assert p.label(ended=True) == "5/10"
    p.update({"step": 0, "total": 10}, now=200.0)  # a restart starts the pace again
    p.update({"step": 1, "total": 10}, now=201.0)
    assert p.label() == "2/10 · ~8 s left"


def test_step_and_total_records_show_a_bar_coloured_by_the_final_state(tmp_path, shown):
    d = started(tmp_path, world_size=3)
    d.record(0, {"step": 4, "total": 20, "loss": 1.5})
    d.record(1, {"loss": 2.0})  # no step/total: rank 1 gets no bar
    d.record(7, {"step": 1, "total": 2})  # a rank the display does not have: ignored
    assert d.panes[0].bar is None, "records are buffered until the next push"
    time.sleep(d.interval_s)
    d.tick()
    bar = d.panes[0].bar
    assert (bar.value, bar.max, bar.bar_style) == (5, 20, "")
    assert d.panes[0].box.children[1].children == (bar, d.panes[0].bar_label)
    assert ">5/20<" in d.panes[0].bar_label.value
    assert d.panes[1].bar is None and len(d.panes[1].box.children) == 2
    d.record(2, {"step": 0, "total": 3})
    d.record(2, {"step": 2, "total": 3})
    d.state(2, "done")
    d.state(0, "failed")
    ranks = [RankResult(rank=0, state="failed"), RankResult(rank=1, state="killed"),
             RankResult(rank=2, state="done")]
    d.finish(RunResult(ok=False, world_size=3, duration_s=1.0, log_dir=tmp_path / "run",
                       ranks=ranks, reason="failed"))
    assert (d.panes[2].bar.value, d.panes[2].bar.max) == (3, 3)
    assert [p.bar and p.bar.bar_style for p in d.panes] == ["danger", None, "success"]
    assert "left" not in d.panes[0].bar_label.value, "no estimate once a rank has ended"


def test_a_bar_whose_total_shrinks_keeps_value_within_max(tmp_path, shown):
    d = started(tmp_path, world_size=1)
    d.record(0, {"step": 90, "total": 100})
    d.push(time.monotonic())
    d.record(0, {"step": 4, "total": 5})  # a new loop with fewer steps
    d.push(time.monotonic())
    assert (d.panes[0].bar.value, d.panes[0].bar.max) == (5, 5)


PROGRESS_SCRIPT = """\
from labutils.dist import init, report

rank, world_size, device = init()
for step in range(6):
    report(step=step, total=6, rank_times_step=rank * step)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_launch_hands_each_report_to_the_display(write_script, runs_dir, shown):
    from labutils import launch

    d = lw.WidgetDisplay()
    result = launch(write_script("progress.py", PROGRESS_SCRIPT), nproc=2, display=d)
    assert result.ok, result.summary()
    assert [(p.bar.value, p.bar.max, p.bar.bar_style) for p in d.panes] == [(6, 6, "success")] * 2
    assert len(result.records) == 12, "the records still reach the result"


@pytest.mark.parametrize("options", [{"lines": 0}, {"combined_lines": -1},
                                     {"updates_per_s": 0}, {"lines": "40"}])
def test_bad_options_are_rejected(options):
    with pytest.raises(LaunchConfigError, match=next(iter(options))):
        lw.WidgetDisplay(**options)


# ----------------------------------------------------- a real kernel, a real click
LONG_SCRIPT = """\
import time
for step in range(600):   # about 60 s
    print(f"step {step}", flush=True)
    time.sleep(0.1)
"""

CELL = """\
import json
from labutils import launch
result = launch({script!r}, nproc=2, display="widgets", hang_timeout=None)
print("RESULT " + json.dumps({{"reason": result.reason, "pids": [r.pid for r in result.ranks],
                              "states": [r.state for r in result.ranks]}}))
"""


def is_stop_button(msg) -> bool:
    state = msg["content"].get("data", {}).get("state", {})
    return (msg["msg_type"] == "comm_open" and state.get("_model_name") == "ButtonModel"
            and state.get("description") == "Stop")


def widget_update_with(text: str):
    def found(msg) -> bool:
        state = msg["content"].get("data", {}).get("state", {})
        return msg["msg_type"] == "comm_msg" and text in str(state.get("value", ""))
    return found


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_stop_button_stops_the_run_while_the_cell_is_busy(kernel, write_script):
    script = write_script("long.py", LONG_SCRIPT)
    msg_id = kernel.execute(CELL.format(script=str(script)))
    stop = iopub_until(kernel, is_stop_button, timeout=60)
    iopub_until(kernel, widget_update_with(">running<"), timeout=60)
    iopub_until(kernel, widget_update_with("step 3\n"), timeout=30)  # live lines, cell busy

    click = kernel.session.msg("comm_msg", {
        "comm_id": stop["content"]["comm_id"],
        "data": {"method": "custom", "content": {"event": "click"}},
    })
    clicked_at = time.monotonic()
    kernel.shell_channel.send(click)

    printed = iopub_until(
        kernel, lambda m: m["msg_type"] == "stream" and "RESULT " in m["content"]["text"],
        timeout=30)
    took = time.monotonic() - clicked_at
    reply = kernel.get_shell_msg(timeout=30)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kernel.get_shell_msg(timeout=30)
    assert reply["content"]["status"] == "ok"
    assert took < 8, f"the run ended {took:.1f} s after the click: the click waited for the cell"
    result = json.loads(printed["content"]["text"].split("RESULT ", 1)[1])
    assert result["reason"] == "stopped"
    assert result["states"] == ["killed", "killed"]
    assert all(pid and not pid_alive(pid) for pid in result["pids"])
