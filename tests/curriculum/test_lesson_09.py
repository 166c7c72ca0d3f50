"""Lesson 09: DETAIL misses two wrongly paired all_reduce calls of the same shape (a real
torchrun run), torch's fr_trace on gloo-shaped dumps (it crashes on the group gloo
registers as '', and works once the group is named), py-spy on a live process, and the
notebook's pure helpers: error lines, fingerprints, fr_trace's report, py-spy stacks."""

from __future__ import annotations

import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import LESSONS

from labutils import launch
from labutils.course import lesson

LESSON = LESSONS / "09_debugging_at_scale"


@pytest.fixture
def lesson09():
    return lesson.load(LESSON, "lesson09")


@pytest.fixture
def stack_dump():
    return lesson.load(LESSON, "stack_dump")


# ------------------------------------------------------------------- a real run


def test_detail_misses_same_shape_calls_paired_in_another_order(runs_dir, lesson09):
    result = launch(LESSON / "class_counts.py", 2, display="none", hang_timeout=90, timeout=300,
                    env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert result.ok, result.summary()
    by_rank = {r["rank"]: r for r in result.records}
    assert {r["debug_level"] for r in by_rank.values()} == {"DebugLevel.DETAIL"}
    assert by_rank[0]["order"] != by_rank[1]["order"]
    correct = {c: by_rank[0]["own"][c] + by_rank[1]["own"][c] for c in by_rank[0]["own"]}
    for rec in by_rank.values():
        assert rec["correct"] == correct
        assert rec["summed"] != correct and sum(rec["summed"].values()) == sum(correct.values())
    # the i-th call of each rank met the i-th call of the other: the same sum on both sides
    firsts = [by_rank[r]["summed"][by_rank[r]["order"][0]] for r in (0, 1)]
    assert firsts[0] == firsts[1] == by_rank[0]["own"][by_rank[0]["order"][0]] + \
        by_rank[1]["own"][by_rank[1]["order"][0]]
    table = lesson09.counts_table(result)
    assert table.splitlines()[0].split()[:3] == ["rank", "Counter", "order"]


# ------------------------------------------------------------ fr_trace on gloo dumps


def _gloo_dump(rank: int, last_op: str) -> dict:
    """A dump shaped like torch 2.13's gloo dumps: the default group registered as ''."""
    def entry(seq, op, sizes):
        return {"record_id": seq - 1, "pg_id": 0, "process_group": ("0", "default_pg"),
                "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": op,
                "time_created_ns": seq, "input_sizes": sizes, "input_dtypes": ["Float"] * len(sizes),
                "output_sizes": sizes, "output_dtypes": ["Float"] * len(sizes), "state": "scheduled",
                "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
                "retired": True, "timeout_ms": 3000, "is_p2p": False, "thread_name": "python",
                "thread_id": "1", "frames": [{"name": "evaluate", "filename": "/x/desync.py", "line": 54}]}
    last = entry(2, "gloo:all_reduce", [[]]) if last_op == "all_reduce" else entry(2, "gloo:barrier", [])
    return {"version": "2.10", "comm_lib_version": "", "entries": [entry(1, "gloo:all_reduce", [[4]]), last],
            "pg_config": {"": {"name": "", "desc": "", "ranks": "[0, 1]"}},
            "pg_status": {"0": {"last_enqueued_collective": 2, "last_started_collective": -1,
                                "last_completed_collective": 1}}}


def _fr_trace(folder: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                          str(folder), "--prefix", "rank_"], capture_output=True, text=True, timeout=60)
    return out.stdout + out.stderr


def test_fr_trace_crashes_on_gloo_dumps_and_reads_them_once_the_group_is_named(tmp_path, lesson09):
    raw, named = tmp_path / "raw", tmp_path / "named"
    raw.mkdir(), named.mkdir()
    for rank, op in ((0, "all_reduce"), (1, "barrier")):
        dump = _gloo_dump(rank, op)
        (raw / f"rank_{rank}").write_bytes(pickle.dumps(dump))
        dump["pg_config"] = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}
        (named / f"rank_{rank}").write_bytes(pickle.dumps(dump))
    assert lesson09.fr_verdict(_fr_trace(raw), script="desync.py") == "fr_trace crashed: KeyError: ('0', 0)"
    verdict = lesson09.fr_verdict(_fr_trace(named), script="desync.py")
    assert verdict.startswith("Collective sequence number: 2 has errors")
    assert "Culprit rank 1" in verdict and "found collective type: 'barrier'" in verdict
    assert verdict.endswith("evaluate at desync.py:54")
    assert "/x/" not in verdict and "tabulate" not in verdict
    table = lesson09.fr_table(lesson09.fr_dumps(raw), last=1)
    assert [line.split() for line in table.splitlines()[2:]] == [
        ["0", "2", "gloo:all_reduce", "[[]]", "scheduled"], ["1", "2", "gloo:barrier", "[]", "scheduled"]]


@pytest.mark.parametrize("output, verdict", [
    ("tabulate is not installed. Proceeding without it.\nTraceback (most recent call last):\n"
     '  File "x.py", line 1, in <module>\nKeyError: (\'0\', 0)\n', "fr_trace crashed: KeyError: ('0', 0)"),
    ("no errors found\n", "no errors found"),
    ("collective stack trace:\n all_reduce at /v/site-packages/torch/distributed/distributed_c10d.py:3245\n"
     "evaluate at /w/lessons/desync.py:54\n_run_code at <frozen runpy>:88\n",
     "collective stack trace:\n  evaluate at desync.py:54"),
    ("", "(fr_trace printed nothing)"),
])
def test_fr_verdict_keeps_the_finding_and_the_scripts_frames(lesson09, output, verdict):
    assert lesson09.fr_verdict(output, script="desync.py") == verdict


# ------------------------------------------------------------------------ py-spy

PY_SPY = """\
Process 4242: python -m labutils.runtime.worker straggler.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    \x1b[32mCondition.wait\x1b[0m (threading.py:327)
    read_batch (straggler.py:49)
    <module> (straggler.py:72)
    _run_code (<frozen runpy>:88)
    main (labutils/runtime/worker.py:204)
Thread 4250 (idle): "watchdog"
    watchdog (straggler.py:58)
"""


def test_main_thread_stops_at_the_scripts_top_level(stack_dump):
    assert stack_dump.main_thread(PY_SPY).splitlines() == [
        'Thread 4242 (idle): "MainThread"', "    Condition.wait (threading.py:327)",
        "    read_batch (straggler.py:49)", "    <module> (straggler.py:72)"]
    assert stack_dump.main_thread("no threads here\n") == "no threads here"
    unnamed = ("Thread 7 (active)\n    work (a.py:3)\n    <module> (a.py:9)\n"
               "    run_path (<frozen runpy>:291)\n")
    assert stack_dump.main_thread(unnamed).splitlines()[-1] == "    <module> (a.py:9)"


@pytest.mark.parametrize("stderr, begins", [
    ("Permission Denied: Try running again with elevated permissions by going 'sudo env \"PATH=$PATH\" !!'",
     "py-spy was refused (permission denied): allow ptrace"),
    ("Error: Failed to get process executable name.\n\nCaused by:\n    0: Permission denied (os error 13)",
     "py-spy was refused (permission denied)"),
    ("Error: Operation not permitted (os error 1)", "py-spy was refused (permission denied)"),
    ("Error: Failed to get process executable name.\nCaused by:\n 0: No such file or directory (os error 2)",
     "py-spy found no such process"),
    ("Error: something else\nmore", "py-spy failed: Error: something else"),
    ("", "py-spy failed: no message"),
])
def test_a_refused_py_spy_is_one_line_with_the_fix(stack_dump, stderr, begins):
    line = stack_dump.refusal(stderr)
    assert line.startswith(begins) and "\n" not in line
    if "refused" in begins:
        assert "CAP_SYS_PTRACE" in line and "ptrace_scope" in line


def test_py_spy_reads_a_live_process(stack_dump):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time\nfor _ in range(600): time.sleep(0.05)"])
    try:
        time.sleep(1.0)  # past the interpreter's start-up
        stack = stack_dump.py_spy_dump(sleeper.pid, timeout_s=20)
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
    if stack.startswith(("py-spy was refused", "py-spy is not installed")):
        pytest.skip(stack)
    # py-spy names threads only in processes that imported threading: then the first one
    assert stack.startswith("Thread ") and stack.splitlines()[-1].strip() == "<module> (<string>:2)"


def test_py_spy_stacks_and_the_launchers_lines_side_by_side(lesson09):
    printed = ("step 1: sum 3\npy-spy dump --pid <rank 0>\nThread 1 (idle): \"MainThread\"\n"
               "    all_reduce (torch/distributed/distributed_c10d.py:3252)\n    <module> (straggler.py:75)\n"
               "py-spy dump --pid <rank 1>\npy-spy was refused (permission denied): allow ptrace\n"
               "step 2: sum 5\n")
    stacks = lesson09.py_spy_stacks(printed)
    assert sorted(stacks) == [0, 1] and stacks[1].startswith("py-spy was refused")
    assert lesson09.innermost_line(stacks[0], "straggler.py") == "straggler.py:75"
    assert lesson09.innermost_line(stacks[1], "straggler.py") is None
    faulthandler = ('  File ".../threading.py", line 327 in wait\n'
                    '  File "09/straggler.py", line 49 in read_batch')
    assert lesson09.innermost_line(faulthandler, "straggler.py") == "straggler.py:49"


# ------------------------------------------------------------ errors and answers

DETAIL_0 = ("RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running collective: "
            "CollectiveFingerPrint(SequenceNumber=6, OpType=ALLREDUCE, TensorShape=[], TensorDtypes=Float), "
            "but Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=0OpType=REDUCE).")
DETAIL_1 = ("RuntimeError: Detected mismatch between collectives on ranks. Rank 1 is running collective: "
            "CollectiveFingerPrint(SequenceNumber=6OpType=BARRIER), but Rank 0 is running collective: "
            "CollectiveFingerPrint(SequenceNumber=0OpType=ALLGATHER_COALESCED).")


@pytest.mark.parametrize("stderr, rank, own", [
    (DETAIL_0, 0, "call #6: ALLREDUCE, shape []"),
    (DETAIL_1, 1, "call #6: BARRIER"),
    (DETAIL_1, 0, None),  # what rank 1 says of rank 0's call is not rank 0's own description
    ("RuntimeError: Timed out", 0, None),
])
def test_own_fingerprint_reads_each_rank_for_its_own_call(lesson09, stderr, rank, own):
    assert lesson09.own_fingerprint(stderr, rank) == own


@pytest.mark.parametrize("stderr, last", [
    ("Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: [/__w/pytorch/pytorch/"
     "third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms\n",
     "RuntimeError: [.../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms"),
    ("RuntimeError: Rank 1 successfully reached monitoredBarrier\n Original exception: \n"
     "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer\n",
     "RuntimeError: Rank 1 successfully reached monitoredBarrier"),
    ("just a line\n", "just a line"),
    ("", ""),
])
def test_last_error_is_the_last_exception_line_without_build_paths(lesson09, stderr, last):
    assert lesson09.last_error(stderr) == last


@pytest.mark.parametrize("line, message", [
    ("RuntimeError: [.../unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete",
     "Timed out waiting 3000ms for recv operation to complete"),
    ("Timed out waiting 5ms", "Timed out waiting 5ms"),
])
def test_gloo_message_drops_the_exception_name_and_source(lesson09, line, message):
    assert lesson09.gloo_message(line) == message


def test_self_check_accepts_the_right_answers(lesson09, capsys):
    lesson09.check_answers({name: want for name, (want, _) in lesson09.EXPECTED.items()})
    assert capsys.readouterr().out.count(": correct") == len(lesson09.EXPECTED)
    lesson09.check_answers({"q2_detail_catches": True, "q6_prctl_option": "prctl(PR_SET_PTRACER, ANY)"})
    out = capsys.readouterr().out
    assert "q2_detail_catches: not quite" in out and "q6_prctl_option: correct" in out


def test_a_terminal_types_into_the_debugger_of_a_rank_at_a_breakpoint(runs_dir, lesson09):
    terminal = lesson09.TerminalSession(["up", "p step", "c"], script="breakpoint_rank", runs=runs_dir)
    result = launch(LESSON / "breakpoint_rank.py", 2, display="text", hang_timeout=5, timeout=60)
    transcript = terminal.transcript()
    assert result.ok, result.summary()
    assert "(Pdb rank 1) 1" in transcript and "rank 1 continues" in transcript, transcript
    assert "/site-packages/" not in transcript.replace(".../site-packages/", "")


@pytest.mark.parametrize("stderr, line", [
    ("[rank0]:[E1125 15:26:17.605 ProcessGroupGloo.cpp:2901] [Rank 0]: Rank 2 failed to pass "
     "monitoredBarrier in 3000 ms\n[rank0]:[E1125 15:26:17.605 ProcessGroupGloo.cpp:67] [Rank 0]: "
     "Ranks 2, 3 failed to pass monitoredBarrier in 3000 ms\nTraceback (most recent call last):\n",
     "[Rank 0]: Ranks 2, 3 failed to pass monitoredBarrier in 3000 ms"),
    ("[rank1]:[E1125 15:26:17.585 ProcessGroupGloo.cpp:67] Rank 1 successfully reached "
     "monitoredBarrier, but received errors while waiting for send/recv from rank 0. Please check "
     "rank 0 logs for faulty rank.\n",
     "Rank 1 successfully reached monitoredBarrier, but received errors while waiting for send/recv "
     "from rank 0. Please check rank 0 logs for faulty rank."),
    ("RuntimeError: Rank 1 successfully reached monitoredBarrier\n", None),  # not a log line
    ("", None),
])
def test_monitored_barrier_line_drops_the_log_prefix(lesson09, stderr, line):
    assert lesson09.monitored_barrier_line(stderr) == line
