"""The text display: what a learner reads of a run (paths cut, repeats folded); and
which display a run gets (labutils.notebook.modes)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from helpers import SCRIPTS

from labutils.run.diagnosis import Failure
from labutils.errors import LaunchConfigError
from labutils.notebook.display import Display, TextDisplay
from labutils.notebook.modes import make_display
from labutils.run.result import RankResult, RunResult

GLOO = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]"


def traceback_lines(rank: int, *, line: int = 55, error: str | None = None) -> list[str]:
    return [
        "Traceback (most recent call last):",
        f'  File "lesson/train.py", line {line}, in <module>',
        "    dist.all_reduce(p.grad)",
        '  File ".../site-packages/torch/distributed/distributed_c10d.py", line 3252, in all_reduce',
        "    work.wait()",
        error or f"RuntimeError: {GLOO} Connection closed by peer [127.0.0.1]:{38000 + rank}.",
    ]


def display(limit=200):
    out, err = io.StringIO(), io.StringIO()
    d = TextDisplay(out=out, err=err, limit=limit)
    d.start(world_size=4, log_dir="runs/r1", script="lesson/train.py")
    return d, out, err


def failed_run(rank: int, message: str, traceback: str) -> RunResult:
    failure = Failure(rank=rank, exc_type="RuntimeError", message=message, file="lesson/train.py",
                      line=55, traceback=traceback)
    return RunResult(ok=False, world_size=4, duration_s=1.0, log_dir=Path("runs/r1"),
                     ranks=[RankResult(r, state="failed", exit_code=1) for r in range(4)],
                     failure=failure, reason="failed")


def test_a_traceback_repeated_by_other_ranks_is_shown_once():
    d, out, err = display()
    for rank in (0, 1, 3):
        d.lines(rank, "stderr", traceback_lines(rank))
    d.lines(1, "stderr", ["after the error"])
    d.finish(failed_run(0, "x", ""))
    shown = err.getvalue()
    assert shown.count("Traceback (most recent call last):") == 1
    assert shown.count("[rank 0]") == 6
    assert ("[rank 1] RuntimeError: the same traceback as rank 0's above "
            "(6 lines, in runs/r1/rank1/stderr.log)\n") in shown
    assert "[rank 3] RuntimeError: the same traceback as rank 0's above" in shown
    assert shown.endswith("[rank 3] RuntimeError: the same traceback as rank 0's above "
                          "(6 lines, in runs/r1/rank3/stderr.log)\n")
    assert "[rank 1] after the error\n" in shown  # what follows a repeat is shown
    assert d.repeats == 2


def test_a_repeat_arriving_in_pieces_is_folded_and_settles_when_idle(monkeypatch):
    import labutils.notebook.display as display_module

    d, _, err = display()
    d.lines(0, "stderr", traceback_lines(0))
    d.lines(2, "stderr", traceback_lines(2)[:3])
    assert "[rank 2]" not in err.getvalue()  # held while it may be a repeat
    d.lines(2, "stderr", traceback_lines(2)[3:])
    d.tick()
    assert "[rank 2]" not in err.getvalue()  # not idle long enough yet
    monkeypatch.setattr(display_module, "HOLD_S", 0.0)
    d.tick()
    assert "[rank 2] RuntimeError: the same traceback as rank 0's above" in err.getvalue()


@pytest.mark.parametrize("other", [
    traceback_lines(1, error="ValueError: bad batch"),   # another exception
    traceback_lines(1)[:1] + ['  File "lesson/other.py", line 5, in <module>'] + traceback_lines(1)[2:],
])
def test_a_different_traceback_is_shown_in_full(other):
    d, _, err = display()
    d.lines(0, "stderr", traceback_lines(0))
    d.lines(1, "stderr", other)
    d.finish(failed_run(0, "x", ""))
    shown = err.getvalue()
    assert shown.count("Traceback (most recent call last):") == 2
    assert "the same traceback" not in shown
    assert f"[rank 1] {other[-1].replace(GLOO, '[.../third_party/gloo/gloo/transport/tcp/pair.cc:553]')}\n" in shown


def test_a_repeat_whose_message_says_something_else_shows_its_message():
    """Two ranks' mismatch errors share their frames, and their messages differ only in
    numbers; but the numbers are what they say (each rank's own shape), so the second
    rank's message is shown under a line that names the traceback it shares."""
    def mismatch(me: int, other: int, mine: int, theirs: int) -> list[str]:
        return traceback_lines(me, error=(
            f"RuntimeError: Detected mismatch between collectives on ranks. Rank {me} is "
            f"running collective: TensorShape=[{mine}], but Rank {other} is running "
            f"collective: TensorShape=[{theirs}]."))

    d, _, err = display()
    d.lines(1, "stderr", mismatch(1, 0, 8, 1))
    d.lines(0, "stderr", mismatch(0, 1, 1, 8))
    d.finish(failed_run(1, "x", ""))
    shown = err.getvalue()
    assert shown.count("Traceback (most recent call last):") == 1
    assert "the same traceback" not in shown
    assert ("[rank 0] RuntimeError: a traceback like rank 1's above, with a message of its own "
            "(6 lines, in runs/r1/rank0/stderr.log):\n[rank 0] RuntimeError: Detected mismatch "
            "between collectives on ranks. Rank 0 is running collective: TensorShape=[1]") in shown
    assert d.repeats == 1


@pytest.mark.parametrize("noise", [
    ("[127.0.0.1]:38000", "[127.0.0.1]:38001"), ("10.1.2.3:29500", "10.1.2.4:29511"),
    ("pid 4242", "pid 4250"), ("0x7f3a2c", "0x7f3b10"), ("localhost:1234", "localhost:1240"),
])
def test_a_repeat_whose_message_differs_in_addresses_or_pids_only_is_one_line(noise):
    d, _, err = display()
    for rank, value in enumerate(noise):
        d.lines(rank, "stderr", traceback_lines(rank, error=f"RuntimeError: lost {value}, step 3"))
    d.finish(failed_run(0, "x", ""))
    assert err.getvalue().endswith("[rank 1] RuntimeError: the same traceback as rank 0's above "
                                   "(6 lines, in runs/r1/rank1/stderr.log)\n")


def test_a_repeat_cut_short_is_shown_in_full():
    d, _, err = display()
    d.lines(0, "stderr", traceback_lines(0))
    d.lines(1, "stderr", traceback_lines(1)[:4])  # the rank died before the exception line
    d.finish(failed_run(0, "x", ""))
    assert err.getvalue().count("Traceback (most recent call last):") == 2


def test_the_same_rank_repeating_its_error_after_a_restart_is_folded():
    d, _, err = display()
    d.lines(1, "stderr", traceback_lines(1))
    d.lines(1, "stderr", traceback_lines(1, line=57))
    d.finish(failed_run(1, "x", ""))
    assert "[rank 1] RuntimeError: the same traceback as its own earlier one above" in err.getvalue()


def test_a_warning_repeated_by_other_ranks_is_shown_once():
    site = ".../site-packages/torch/distributed/c10d_logger.py"
    warning = [f"{site}:83: FutureWarning: `reduce_scatter_tensor` is deprecated.",
               "  return func(*args, **kwargs)"]
    d, _, err = display()
    for rank in range(3):
        d.lines(rank, "stderr", warning + [f"rank {rank} goes on"])
    d.finish(failed_run(0, "x", ""))
    shown = err.getvalue()
    assert shown.count("FutureWarning: `reduce_scatter_tensor`") == 1
    assert ("[rank 1] FutureWarning: the same warning as rank 0's above "
            "(2 lines, in runs/r1/rank1/stderr.log)\n[rank 1] rank 1 goes on\n") in shown
    assert "[rank 2] FutureWarning: the same warning as rank 0's above" in shown
    assert "[rank 0] rank 0 goes on" in shown  # a line after the warning is not part of it


def test_lines_after_a_warning_are_never_folded_into_it():
    d, _, err = display()
    d.lines(0, "stderr", ["x.py:1: UserWarning: careful", "step 1 loss 0.5"])
    d.lines(1, "stderr", ["x.py:1: UserWarning: careful", "step 1 loss 0.7"])
    d.finish(failed_run(0, "x", ""))
    assert "[rank 1] step 1 loss 0.7" in err.getvalue()


def test_build_paths_are_cut_in_every_line_shown():
    import sys

    d, out, err = display()
    d.lines(0, "stdout", [f"caught: {GLOO} Connection reset by peer"])
    d.lines(1, "stderr", [f"{sys.prefix}/lib/python3.11/site-packages/torch/x.py:8: UserWarning: w"])
    d.lines(0, "stderr", traceback_lines(0))
    shown = out.getvalue() + err.getvalue()
    assert "/__w/" not in shown
    assert "[rank 0] caught: [.../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection" in shown
    assert "[rank 1] .../site-packages/torch/x.py:8: UserWarning: w" in shown


def test_the_summary_refers_to_a_traceback_shown_above():
    d, out, err = display()
    tb = traceback_lines(0)
    d.lines(0, "stderr", tb)
    d.lines(2, "stderr", traceback_lines(2))
    message = f"{GLOO} Connection closed by peer [127.0.0.1]:38000."
    d.finish(failed_run(0, message + "\nthe rest of a long message", "\n".join(tb) + "\n"))
    summary = out.getvalue()
    assert "traceback of rank 0: shown above" in summary
    assert "work.wait()" not in summary  # the traceback is not printed twice
    assert ("root cause: rank 0 raised RuntimeError: [.../third_party/gloo/gloo/transport/tcp/"
            "pair.cc:553] Connection closed by peer [127.0.0.1]:38000. [...]") in summary
    assert "/__w/" not in summary


def test_a_long_one_line_message_shown_above_is_cut_in_the_summary():
    """TORCH_DISTRIBUTED_DEBUG=DETAIL's mismatch: one line of some 700 characters, already
    in the traceback above: the summary keeps its start."""
    d, out, _ = display()
    message = ("Detected mismatch between collectives on ranks. Rank 0 is running collective: "
               + "CollectiveFingerPrint(SequenceNumber=1, OpType=ALLREDUCE, " * 12)
    tb = traceback_lines(0, error=f"RuntimeError: {message}")
    d.lines(0, "stderr", tb)
    d.finish(failed_run(0, message, "\n".join(tb) + "\n"))
    root = next(line for line in out.getvalue().splitlines() if line.startswith("root cause:"))
    assert root.startswith("root cause: rank 0 raised RuntimeError: Detected mismatch between "
                           "collectives on ranks. Rank 0 is running collective:")
    assert root.endswith(" [...]") and len(root) < 260, root


def test_the_summary_prints_a_traceback_the_display_did_not_show():
    d, out, _ = display()
    tb = traceback_lines(0)
    d.lines(1, "stderr", traceback_lines(1, error="ValueError: elsewhere"))
    d.finish(failed_run(0, f"{GLOO} Connection closed by peer [127.0.0.1]:38000.", "\n".join(tb)))
    summary = out.getvalue()
    assert "traceback of rank 0:\n  Traceback (most recent call last):" in summary
    assert "    work.wait()" in summary and "/__w/" not in summary


def test_a_traceback_beyond_the_line_limit_is_printed_in_the_summary():
    d, out, _ = display(limit=3)
    tb = traceback_lines(0)
    d.lines(0, "stderr", tb)
    d.finish(failed_run(0, f"{GLOO} Connection closed by peer [127.0.0.1]:38000.", "\n".join(tb)))
    assert "traceback of rank 0:\n" in out.getvalue()


def test_summary_and_json_of_a_run_without_display():
    tb = "\n".join(traceback_lines(0))
    result = failed_run(0, f"{GLOO} Connection closed by peer", tb)
    assert "/__w/" not in result.summary()
    assert "traceback of rank 0:\n  Traceback" in result.summary()
    assert GLOO in result.to_json()["failure"]["message"]  # the JSON keeps the message as raised


@pytest.mark.parametrize("mode, env, kind, limit", [
    ("text", None, TextDisplay, 200),
    ("terminal", None, TextDisplay, None),   # the CLI prints every line
    ("none", None, Display, None),
    ("auto", None, TextDisplay, 200),        # no kernel here: text
    ("auto", "none", Display, None),         # LABUTILS_DISPLAY overrides "auto"...
    ("text", "none", TextDisplay, 200),      # ...and only "auto"
])
def test_make_display_picks_by_mode_and_environment(monkeypatch, mode, env, kind, limit):
    monkeypatch.delenv("LABUTILS_DISPLAY", raising=False)
    if env:
        monkeypatch.setenv("LABUTILS_DISPLAY", env)
    d = make_display(mode)
    assert type(d) is kind
    assert getattr(d, "limit", None) == limit


def test_make_display_rejects_an_unknown_mode():
    with pytest.raises(LaunchConfigError, match="display"):
        make_display("pretty")


@pytest.mark.slow
def test_a_real_run_shows_one_traceback_and_keeps_every_one_on_disk(runs_dir):
    from labutils import launch

    script = SCRIPTS / "same_traceback.py"
    d, out, err = display()
    result = launch(script, 3, display=d)
    assert result.ok, result.summary()
    shown = err.getvalue()
    assert shown.count("Traceback (most recent call last):") == 1, shown
    assert shown.count("RuntimeError: the same traceback as rank") == 2, shown
    assert "/__w/" not in shown + out.getvalue()
    assert "[.../third_party/gloo/gloo/transport/tcp/pair.cc:553]" in shown
    for r in result.ranks:  # the logs keep every line as the rank wrote it
        assert r.stderr.count("Traceback (most recent call last):") == 1
        assert GLOO in r.stderr and f"[127.0.0.1]:{40000 + r.rank}" in r.stderr
        assert f"[rank {r.rank}] rank {r.rank} carried on" in out.getvalue()


@pytest.mark.parametrize("others, same, said", [
    ([2], [], ["  rank 2 raised an error of its own too (see its stderr)"]),
    ([1, 3], [], ["  ranks 1, 3 raised errors of their own too (see their stderr)"]),
    ([1, 2, 3], [1, 2, 3], ["  ranks 1, 2, 3 raised RuntimeError at the same line too"]),
    ([1, 3], [3], ["  rank 3 raised RuntimeError at the same line too",
                   "  rank 1 raised an error of its own too (see its stderr)"]),
])
def test_the_summary_names_the_ranks_that_failed_on_their_own(others, same, said):
    result = failed_run(0, "the batch is empty", "")
    assert result.failure is not None and result.failure.exc_type == "RuntimeError"
    result.failure.also_failed, result.failure.same_error = others, same
    lines = result.summary().splitlines()
    assert lines[lines.index(said[0]):lines.index(said[0]) + len(said)] == said


def test_the_profilers_start_and_stop_markers_are_not_shown():
    """torch.profiler's C++ side writes two lines to stderr at every profile; the display
    leaves them out (the rank's log keeps them), and nothing else that looks like them."""
    d, _, err = display()
    d.lines(0, "stderr", [
        "USDT:2026-11-27 12:15:58 16774:16774 SyncActivityProfilerHandler.cpp:52] profiler_start",
        "the step took 12 ms",
        "USDT:2026-11-27 12:15:59 16774:16774 SyncActivityProfilerHandler.cpp:59] profiler_stop",
        "STAGE:2026-11-27 12:15:59 16774:16774 SyncActivityProfilerHandler.cpp:60] Completed Stage: Collection",
        "USDT: profiler_start is what kineto prints",
    ])
    assert err.getvalue().splitlines() == [
        "[rank 0] the step took 12 ms",
        "[rank 0] STAGE:2026-11-27 12:15:59 16774:16774 SyncActivityProfilerHandler.cpp:60] Completed "
        "Stage: Collection",
        "[rank 0] USDT: profiler_start is what kineto prints"]


def test_the_summary_says_whose_traceback_the_root_causes_was_shown_as():
    """Both ranks raise the same error; rank 1's is shown as a repeat of rank 0's, and
    rank 1 is the root cause: the summary points at rank 0's traceback."""
    d, out, _ = display()
    d.lines(0, "stderr", traceback_lines(0, error="OSError: [Errno 22] Invalid argument"))
    d.lines(1, "stderr", traceback_lines(1, error="OSError: [Errno 22] Invalid argument"))
    result = failed_run(1, "[Errno 22] Invalid argument", "Traceback ...")
    result.failure.exc_type = "OSError"
    d.finish(result)
    assert "traceback of rank 1: like rank 0's, shown above" in out.getvalue().splitlines()
    d, out, _ = display()
    d.lines(1, "stderr", traceback_lines(1, error="OSError: [Errno 22] Invalid argument"))
    d.finish(result)
    assert "traceback of rank 1: shown above" in out.getvalue().splitlines()


def group_lines(shard: int) -> list[str]:
    """An exception group's traceback as Python 3.11 prints it, in its margin."""
    return ["  + Exception Group Traceback (most recent call last):",
            '  |   File "lesson/load.py", line 12, in <module>',
            '  |     raise ExceptionGroup("2 shards failed to load", errors)',
            "  | ExceptionGroup: 2 shards failed to load (2 sub-exceptions)",
            "  +-+---------------- 1 ----------------",
            "    | Traceback (most recent call last):",
            '    |   File "lesson/load.py", line 4, in load',
            '    |     raise ValueError(f"shard {i} is missing")',
            f"    | ValueError: shard {shard} is missing",
            "    +------------------------------------"]


def test_an_exception_groups_traceback_is_one_block_like_any_other():
    """Its lines sit in a margin, so none was taken for the start of a traceback: the
    summary printed the group's traceback a second time, and a rank that raised the
    same group showed all of it again."""
    d, out, err = display()
    d.lines(0, "stderr", group_lines(0))
    d.lines(1, "stderr", group_lines(0))
    d.lines(2, "stderr", group_lines(7))
    d.lines(2, "stderr", ["after the error"])
    failure = Failure(rank=0, exc_type="ExceptionGroup",
                      message="2 shards failed to load (2 sub-exceptions)", file="lesson/load.py",
                      line=12, traceback="\n".join(group_lines(0)) + "\n")
    d.finish(RunResult(ok=False, world_size=4, duration_s=1.0, log_dir=Path("runs/r1"),
                       ranks=[RankResult(r, state="failed", exit_code=1) for r in range(4)],
                       failure=failure, reason="failed"))
    shown, summary = err.getvalue(), out.getvalue()
    assert shown.count("Exception Group Traceback") == 1, shown
    assert ("[rank 1] ExceptionGroup: the same traceback as rank 0's above (10 lines, in "
            "runs/r1/rank1/stderr.log)") in shown
    assert "[rank 2] ExceptionGroup: a traceback like rank 0's above, with a message of its own" \
        in shown and "[rank 2]     | ValueError: shard 7 is missing" in shown
    assert "[rank 2] after the error" in shown
    assert "traceback of rank 0: shown above" in summary and "Exception Group" not in summary
