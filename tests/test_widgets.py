"""The widget display: bounded panes, coalesced updates, and a Stop button that works
while the cell is busy (proved against a real ipykernel)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from labutils import widgets as lw
from labutils._proc import pid_alive
from labutils.errors import LaunchConfigError
from labutils.result import RankResult, RunResult
from conftest import iopub_until


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
    w = lw.LineWindow(keep)
    w.add(0, "stdout", [f"o{i}" for i in range(counts[0])])
    w.add(0, "stderr", [f"e{i}" for i in range(counts[1])])
    assert len(w.window) == shown_lines
    assert w.hidden() == hidden


def test_line_window_html_escapes_cuts_and_colours():
    w = lw.LineWindow(10)
    w.add(3, "stdout", ["<b>tag</b>", "x" * (lw.MAX_LINE_CHARS + 7)])
    w.add(3, "stderr", ["oops"])
    page = w.html(prefix=True, earlier_in="r/{stream}.log")
    assert "[rank 3] &lt;b&gt;tag&lt;/b&gt;" in page
    assert "... (7 more characters)" in page and "x" * (lw.MAX_LINE_CHARS + 1) not in page
    assert f"color:{lw.STDERR_COLOR}'>[rank 3] oops" in page
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
    assert "999960 earlier lines in " + os.path.join(lw._rel(str(tmp_path / "run")),
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


def test_stop_click_sets_the_flag_the_launcher_polls(tmp_path, shown):
    d = started(tmp_path)
    d.stop.click()
    assert d.stop_requested.is_set()
    time.sleep(d.interval_s)
    d.tick()
    assert d.stop.description == "stopping" and d.stop.disabled


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
