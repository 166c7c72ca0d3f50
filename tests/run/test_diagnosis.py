"""Root cause and victims; stacks, waiting lines and stragglers."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from labutils.run.diagnosis import Failure, find_failure, looks_like_victim
from labutils.run.hang import analyse_hang, parse_faulthandler

GLOO_PEER_GONE = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                  "[127.0.0.1]:28037")


def _exc(t, exc_type="ValueError", message="bad shape", line=8):
    return {"t": t, "exc_type": exc_type, "message": message, "file": "train.py", "line": line,
            "traceback": "Traceback ...", "source": "raise ValueError()"}


def test_root_cause_is_the_earliest_non_victim_exception():
    exceptions = {
        1: _exc(10.2, "RuntimeError", GLOO_PEER_GONE, 9),
        2: _exc(10.5),  # later than rank 1's, but rank 1 only lost its peer
        3: _exc(10.3, "RuntimeError", GLOO_PEER_GONE, 9),
    }
    failure = find_failure(exceptions, {0: -15, 1: 1, 2: 1, 3: 1}, [0, 1, 2, 3])
    assert (failure.rank, failure.exc_type, failure.line) == (2, "ValueError", 8)
    assert failure.victims == [0, 1, 3]
    rank, exc_type, message, file, line, tb = failure  # the contract's tuple (docs/architecture.md)
    assert (rank, file) == (2, "train.py")


def test_sigkill_without_exception_is_a_root_cause_sigterm_is_not():
    exceptions = {0: _exc(5.0, "RuntimeError", "Connection reset by peer", 12)}
    failure = find_failure(exceptions, {0: 1, 1: -9, 2: -15}, [0, 1, 2])
    assert failure.rank == 1 and failure.exc_type == "SIGKILL"
    assert failure.victims == [0, 2]


def test_crash_after_the_script_finished_says_so():
    failure = find_failure({}, {0: -15, 1: -6}, [0, 1], finished={1},
                           stderr_tails={1: "terminate called without an active exception"})
    assert failure.rank == 1 and failure.exc_type == "SIGABRT"
    assert "destroy_process_group" in failure.message
    assert "terminate called" in failure.traceback


def test_non_zero_exit_without_exception():
    # sys.exit(3): the bootstrap's exit event says where
    exit_event = {"kind": "exit", "t": 4.0, "code": 3, "file": "train.py", "line": 7,
                  "source": "sys.exit(3)"}
    failure = find_failure({}, {0: 0, 1: 3}, [1], exit_events={1: exit_event})
    assert (failure.rank, failure.exc_type, failure.message) == (1, "SystemExit", "exit code 3")
    assert (failure.kind, failure.line, failure.source) == ("exit", 7, "sys.exit(3)")
    # sys.exit("why"): exit code 1, and the text it printed
    failure = find_failure({}, {0: 0, 1: 1}, [1], exit_events={1: {
        **exit_event, "code": 1, "message": "no config file", "source": 'sys.exit("no config file")'}})
    assert failure.message == "exit code 1: no config file"
    # os._exit(3): no event, only the code the agent reaped
    failure = find_failure({}, {0: 0, 1: 3}, [1])
    assert (failure.rank, failure.kind, failure.line) == (1, "exit", None)
    assert failure.message.startswith("exit code 3 without a Python exception")


def test_a_rank_that_exits_or_dies_first_outranks_its_peers_lost_connection():
    lost = {0: _exc(10.3, "RuntimeError", GLOO_PEER_GONE, 9)}
    for code in (3, -6, -9, -11):
        failure = find_failure(lost, {0: 1, 1: code}, [0, 1], ended_at={1: 10.2})
        assert (failure.rank, failure.exit_code, failure.victims) == (1, code, [0])
        assert failure.kind == ("exit" if code > 0 else "signal")


def test_the_earlier_of_an_own_error_and_a_crash_is_the_root_cause():
    own = {0: _exc(10.3)}
    assert find_failure(own, {0: 1, 1: -11}, [0, 1], ended_at={1: 10.2}).rank == 1
    assert find_failure(own, {0: 1, 1: -11}, [0, 1], ended_at={1: 10.4}).rank == 0


def test_a_rank_that_ended_before_its_peers_lost_it_is_the_root_cause():
    lost = {0: _exc(10.3, "RuntimeError", GLOO_PEER_GONE, 9),
            2: _exc(10.4, "RuntimeError", GLOO_PEER_GONE, 9)}
    exit_event = {"code": 0, "t": 10.1, "file": "train.py", "line": 30, "source": "return"}
    failure = find_failure(lost, {0: 1, 1: 0, 2: 1}, [0, 2], ended_at={1: 10.1},
                           exit_events={1: exit_event})
    assert (failure.rank, failure.kind, failure.line, failure.victims) == \
        (1, "early_exit", 30, [0, 2])
    assert "ranks 0, 2 were still running, and lost it in a collective" in failure.message
    # a victim that torchrun ended before its error was read is named all the same
    failure = find_failure({2: lost[2]}, {0: -15, 1: 0, 2: 1}, [0, 2], ended_at={1: 10.1},
                           exit_events={1: exit_event})
    assert (failure.rank, failure.victims) == (1, [0, 2])
    assert "ranks 0, 2 were still running" in failure.message
    # a rank that finished after its peers failed is not the cause
    failure = find_failure(lost, {0: 1, 1: 0, 2: 1}, [0, 2], ended_at={1: 10.5})
    assert (failure.rank, failure.kind) == (0, "exception")


@pytest.mark.parametrize(("message", "victim"), [
    (GLOO_PEER_GONE, True),
    ("Connection reset by peer", True),
    # gloo (pair.cc:553) in a rank whose peer aborted during the same collective
    ("[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1437. This is "
     "typically caused by a remote worker crashing.", True),
    ("NCCL communicator was aborted on rank 1", True),
    ("mat1 and mat2 shapes cannot be multiplied", False),
    ("Expected to have finished reduction in the prior iteration", False),
])
def test_victim_messages(message, victim):
    assert looks_like_victim(message) is victim


def _real_dump(tmp_path, body: str) -> tuple[str, int]:
    """Run a script that blocks in ``body``, dump its stacks with faulthandler, return text."""
    script = tmp_path / "sleeper.py"
    out = tmp_path / "stacks.txt"
    script.write_text(
        "import faulthandler, signal, threading, time, sys\n"
        f"f = open({str(out)!r}, 'a')\n"
        "faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print(threading.main_thread().ident, flush=True)\n"
        "def wait_here():\n"
        f"    {body}\n"
        "wait_here()\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        main_tid = int(proc.stdout.readline())
        time.sleep(0.3)
        proc.send_signal(signal.SIGUSR1)
        for _ in range(50):
            if out.exists() and "wait_here" in out.read_text():
                break
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    return out.read_text(), main_tid, str(script)


def test_parse_real_faulthandler_dump_picks_the_main_thread(tmp_path):
    text, main_tid, script = _real_dump(tmp_path, "time.sleep(60)")
    frames = parse_faulthandler(text, main_tid)
    assert [f.func for f in frames][:2] == ["wait_here", "<module>"]
    assert frames[0].line == 7 and frames[0].file == script


def test_straggler_is_the_rank_outside_the_collective(tmp_path):
    c10d = "/x/site-packages/torch/distributed/distributed_c10d.py"
    waiting = ('Current thread 0x0000000000000001 (most recent call first):\n'
               f'  File "{c10d}", line 3252 in all_reduce\n'
               '  File "/x/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper\n'
               f'  File "{tmp_path}/train.py", line 10 in <module>\n')
    sleeping = ('Current thread 0x0000000000000001 (most recent call first):\n'
                f'  File "{tmp_path}/train.py", line 9 in <module>\n')
    dumps = {0: waiting, 1: sleeping, 2: waiting, 3: waiting}
    hang = analyse_hang(dumps, dict.fromkeys(dumps, 1), str(tmp_path / "train.py"), silent_s=3)
    stacks, where, stragglers = hang
    assert stragglers == [1]
    assert where[0].endswith("train.py:10") and where[1].endswith("train.py:9")
    assert hang.calls[0] == "all_reduce" and hang.calls[1] == ""
    assert "rank 1 has not reached" in hang.explanation
    # rank 3 read at the all_reduce's line but in no call: going in, or coming out with the
    # collective's error (its peer on another node stopped first) as SIGTERM came. It
    # reached the collective: no straggler (it was named one beside rank 1, once in 900 runs)
    leaving = sleeping.replace("line 9", "line 10")
    unwinding = leaving.replace(
        "(most recent call first):\n",
        '(most recent call first):\n  File "/usr/lib/python3.11/logging/__init__.py", line 1 in debug\n'
        '  File "/x/site-packages/torch/distributed/c10d_logger.py", line 88 in wrapper\n')
    for dump in (leaving, unwinding):
        hang = analyse_hang({**dumps, 3: dump}, dict.fromkeys(dumps, 1), str(tmp_path / "train.py"))
        assert (hang.stragglers, hang.calls[3]) == ([1], "")
        assert "ranks 0, 2, 3 wait in a collective that rank 1 has not reached" in hang.explanation
    # at another line than the waiting ranks', or at theirs inside a call of its own, it is one
    computing = leaving.replace("(most recent call first):\n", '(most recent call first):\n'
                                '  File "/x/site-packages/torch/nn/modules/linear.py", line 1 in forward\n')
    for dump in (sleeping.replace("line 9", "line 12"), computing):
        hang = analyse_hang({**dumps, 3: dump}, dict.fromkeys(dumps, 1), str(tmp_path / "train.py"))
        assert hang.stragglers == [1, 3]


@pytest.mark.parametrize(("lines", "exited", "stragglers", "phrase"), [
    ({0: 5, 1: 5, 2: 5}, {}, [], "every rank waits at"),
    # world_size=4 given by hand to 3 ranks: they wait for a fourth that never starts
    ({0: 5, 1: 5, 2: 5}, {}, [], "returns once world_size ranks have joined, and 3 are running"),
    ({0: 5}, {}, [], "rank 0 waits at"),  # a cell on one rank of a world
    ({0: 5, 1: 7, 2: 5}, {}, [1], "somewhere else"),
    ({0: 5, 1: 7}, {}, [], "do not match"),
    ({0: 5, 1: 5}, {2: 0}, [], "already left the run"),
    ({0: 5, 1: 5}, {2: 1}, [], "rank 2, whose script ended but whose process runs on"),
])
def test_stragglers_when_every_rank_is_in_a_collective(tmp_path, lines, exited, stragglers, phrase):
    c10d = "/x/site-packages/torch/distributed/distributed_c10d.py"
    call = "init_process_group" if "world_size" in phrase else "barrier"
    dumps = {
        r: ('Thread 0x0000000000000001 (most recent call first):\n'
            f'  File "{c10d}", line 1 in {call}\n'
            f'  File "{tmp_path}/train.py", line {ln} in <module>\n')
        for r, ln in lines.items()
    }
    lingering = {2: "raised ValueError"} if "runs on" in phrase else {}  # its process lives
    hang = analyse_hang(dumps, dict.fromkeys(dumps, 1), str(tmp_path / "train.py"), exited=exited,
                        lingering=lingering)
    assert hang.stragglers == stragglers
    assert phrase in hang.explanation
    assert hang.to_json()["lingering"] == {str(r): how for r, how in lingering.items()}


def test_ranks_compiling_at_the_same_line_are_no_mismatch(tmp_path):
    """Two ranks silent in torch.compile's first compilation (a slow machine), each in the
    module inductor generated in a temporary cache folder of its own: the learner's line
    is the script's, the same on both, and no word of collectives that do not match."""
    script = tmp_path / "compile_ddp.py"
    inductor = "/x/site-packages/torch/_inductor"

    def compiling(cache: str, inner: str) -> str:
        return ('Thread 0x0000000000000001 (most recent call first):\n'
                f'  File "{inner}", line 9 in wait\n'
                f'  File "{inductor}/codecache.py", line 3879 in _worker_compile_cpp\n'
                f'  File "{cache}/ms/cmsuiykei7xeyapamr.py", line 33 in <module>\n'
                f'  File "{inductor}/runtime/compile_tasks.py", line 35 in _reload_python_module\n'
                f'  File "{inductor}/compile_fx.py", line 2782 in compile_fx\n'
                f'  File "{script}", line 107 in __call__\n'
                '  File "/x/site-packages/torch/_dynamo/eval_frame.py", line 511 in __call__\n'
                f'  File "{script}", line 85 in step\n'
                f'  File "{script}", line 141 in <module>\n')

    dumps = {0: compiling("/tmp/inductor-zk5jqam1", "/x/site-packages/filelock/_api.py"),
             1: compiling("/tmp/inductor-ry4wgwuc", "/usr/lib/python3.11/subprocess.py")}
    hang = analyse_hang(dumps, dict.fromkeys(dumps, 1), str(script), silent_s=30)
    assert hang.waiting[0] == hang.waiting[1] and hang.waiting[0].endswith("compile_ddp.py:107")
    assert hang.calls == {0: "", 1: ""} and hang.stragglers == []
    assert hang.explanation.startswith("every rank waits at") and "compile_ddp.py:107" in hang.explanation
    # at lines of their own, in no collective: computing or waiting on something else
    apart = {0: dumps[0], 1: dumps[1].replace("line 107 in __call__", "line 108 in __call__")}
    hang = analyse_hang(apart, dict.fromkeys(apart, 1), str(script), silent_s=30)
    assert "do not match" not in hang.explanation
    assert hang.explanation.startswith("no rank is in a collective")


def test_ranks_failing_with_their_own_error_are_not_victims():
    same = "Expected to have finished reduction in the prior iteration"
    exceptions = {0: _exc(3.0, "RuntimeError", same, 20), 1: _exc(3.1, "RuntimeError", same, 20),
                  2: _exc(3.2, "RuntimeError", GLOO_PEER_GONE, 20)}
    failure = find_failure(exceptions, {0: 1, 1: 1, 2: 1}, [0, 1, 2])
    assert failure.rank == 0 and failure.also_failed == [1] and failure.victims == [2]
    assert failure.same_error == [1]  # the same type at the same line: every rank's bug
    # which of them raised first is a matter of milliseconds: the lowest rank, warm or cold
    later = {**exceptions, 0: _exc(3.2, "RuntimeError", same, 20), 1: _exc(3.0, "RuntimeError", same, 20)}
    failure = find_failure(later, {0: 1, 1: 1, 2: 1}, [0, 1, 2])
    assert (failure.rank, failure.also_failed, failure.same_error) == (0, [1], [1])
    exceptions[1] = _exc(3.1, "RuntimeError", same, 21)
    failure = find_failure(exceptions, {0: 1, 1: 1, 2: 1}, [0, 1, 2])
    assert failure.also_failed == [1] and failure.same_error == []
    assert "same_error" not in failure.to_json()  # the JSON summary's fields are unchanged


def test_a_rank_blocked_in_ddp_backward_waits_in_a_collective(tmp_path):
    in_backward = ('Thread 0x0000000000000001 (most recent call first):\n'
                   '  File "/x/site-packages/torch/autograd/graph.py", line 8 in _engine_run_backward\n'
                   '  File "/x/site-packages/torch/_tensor.py", line 6 in backward\n'
                   f'  File "{tmp_path}/train.py", line 30 in <module>\n')
    elsewhere = ('Thread 0x0000000000000001 (most recent call first):\n'
                 f'  File "{tmp_path}/train.py", line 12 in <module>\n')
    hang = analyse_hang({0: in_backward, 1: elsewhere}, {0: 1, 1: 1}, str(tmp_path / "train.py"))
    assert hang.calls[0] == "backward" and hang.stragglers == [1]



def _dump(tmp_path, line: int, *frames: tuple[str, int, str]) -> str:
    """A faulthandler dump of a main thread: library frames (innermost first), then train.py."""
    return ('Thread 0x0000000000000001 (most recent call first):\n'
            + "".join(f'  File "/x/site-packages/torch/{f}", line {n} in {func}\n' for f, n, func in frames)
            + f'  File "{tmp_path}/train.py", line {line} in <module>\n')


def test_a_rank_in_ddps_forward_or_constructor_waits_in_ddps_collective(tmp_path):
    """DDP's forward broadcasts (the bucket rebuild of the second iteration, the buffers)
    and its constructor checks and broadcasts the parameters, in C++ below DDP's own
    Python frames: a rank blocked there waits in a collective, it is no straggler
    (lab 02: rank 0's extra all_reduce against rank 1's bucket-rebuild broadcast)."""
    module = [("nn/modules/module.py", 1789, "_call_impl"), ("nn/modules/module.py", 1778, "_wrapped_call_impl")]
    rebuild = _dump(tmp_path, 47, ("nn/parallel/distributed.py", 1775, "_pre_forward"),
                    ("nn/parallel/distributed.py", 1886, "forward"), *module)
    buffers = _dump(tmp_path, 36, ("nn/parallel/distributed.py", 2312, "_default_broadcast_coalesced"),
                    ("nn/parallel/distributed.py", 2290, "_sync_buffers"),
                    ("nn/parallel/distributed.py", 1782, "_pre_forward"),
                    ("nn/parallel/distributed.py", 1886, "forward"), *module)
    built = _dump(tmp_path, 20, ("distributed/utils.py", 300, "_verify_param_shape_across_processes"),
                  ("nn/parallel/distributed.py", 830, "__init__"))
    computing = _dump(tmp_path, 47, ("nn/modules/linear.py", 134, "forward"), *module)
    all_reduce = _dump(tmp_path, 56, ("distributed/distributed_c10d.py", 3252, "all_reduce"),
                       ("distributed/c10d_logger.py", 83, "wrapper"))
    hang = analyse_hang({0: all_reduce, 1: rebuild, 2: buffers, 3: built, 4: computing},
                        dict.fromkeys(range(5), 1), str(tmp_path / "train.py"))
    assert hang.calls == {0: "all_reduce", 1: "forward", 2: "forward", 3: "DistributedDataParallel", 4: ""}
    assert hang.stragglers == [4]  # a module's own forward computes: no collective
    pair = analyse_hang({0: all_reduce, 1: rebuild}, {0: 1, 1: 1}, str(tmp_path / "train.py"))
    assert pair.stragglers == [] and "do not match" in pair.explanation

GLOO_TIMEOUT = ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "8000ms for recv operation to complete")
NCCL_TIMEOUT = ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, "
                "OpType=BARRIER, NumelIn=1, NumelOut=1, Timeout(ms)=8000) ran for 8002 milliseconds")


def _in_collective(call: str) -> str:
    return ('Traceback (most recent call last):\n  File "train.py", line 9, in <module>\n'
            '  File ".../torch/distributed/c10d_logger.py", line 83, in wrapper\n'
            f'  File ".../torch/distributed/distributed_c10d.py", line 3252, in {call}\n'
            'RuntimeError: ...')


@pytest.mark.parametrize("message", [GLOO_TIMEOUT, NCCL_TIMEOUT])
def test_ranks_that_all_timed_out_in_collectives_are_a_mismatch_not_one_root_cause(message):
    exceptions = {0: dict(_exc(18.1, "RuntimeError", message, 10), traceback=_in_collective("all_reduce"),
                          source="dist.all_reduce(x)"),
                  1: dict(_exc(18.0, "RuntimeError", message, 11), traceback=_in_collective("barrier"),
                          source="dist.barrier()"),
                  2: _exc(18.3, "RuntimeError", GLOO_PEER_GONE, 11)}
    failure = find_failure(exceptions, {0: 1, 1: 1, 2: 1}, [0, 1, 2])
    assert failure.mismatch == {
        0: {"collective": "all_reduce", "where": "train.py:10", "source": "dist.all_reduce(x)"},
        1: {"collective": "barrier", "where": "train.py:11", "source": "dist.barrier()"}}
    assert failure.victims == [2] and failure.also_failed == [0]
    # timeouts beside a rank's own error: that error is the root cause, even when later
    exceptions[2] = _exc(18.3)
    failure = find_failure(exceptions, {0: 1, 1: 1, 2: 1}, [0, 1, 2])
    assert failure.mismatch == {} and (failure.rank, failure.exc_type) == (2, "ValueError")


def test_a_rank_that_waited_elsewhere_and_ended_before_its_own_timeout_is_one_of_the_mismatch():
    """Rank 1 timed out in all_reduce; rank 0, in a barrier, lost its peer (or torchrun
    stopped it) a moment before its own timeout: the same mismatch as when both time out."""
    timed_out = dict(_exc(18.0, "RuntimeError", GLOO_TIMEOUT, 10), traceback=_in_collective("all_reduce"),
                     source="dist.all_reduce(x)")
    both = {0: {"collective": "barrier", "where": "train.py:11", "source": "dist.barrier()"},
            1: {"collective": "all_reduce", "where": "train.py:10", "source": "dist.all_reduce(x)"}}
    lost = dict(_exc(18.1, "RuntimeError", GLOO_PEER_GONE, 11), traceback=_in_collective("barrier"),
                source="dist.barrier()")
    failure = find_failure({0: lost, 1: timed_out}, {0: 1, 1: 1}, [0, 1])
    assert failure.kind == "mismatch" and failure.mismatch == both
    assert failure.victims == [] and failure.also_failed == [0]
    failure = find_failure({1: timed_out}, {0: -15, 1: 1}, [0, 1], stopped_in={0: both[0]})
    assert failure.kind == "mismatch" and failure.mismatch == both
    # waiting in the very same call: a rank was missing from it, not a mismatch of calls
    same = dict(lost, traceback=_in_collective("all_reduce"), line=10, source="dist.all_reduce(x)")
    failure = find_failure({0: same, 1: timed_out}, {0: 1, 1: 1}, [0, 1])
    assert failure.kind == "exception" and failure.rank == 1 and failure.victims == [0]



def test_peers_that_timed_out_waiting_for_a_rank_outside_any_collective_name_it():
    """Rank 1 loops (or computes) outside any collective while the others wait in one
    barrier until the process group's timeout: rank 1 is the root cause, as the hang
    report names it the straggler when the hang timeout comes first. It was called a
    victim of rank 0's timeout (2 ranks), or the timeouts a mismatch of calls (4)."""
    def waited(t, message=GLOO_TIMEOUT):
        return dict(_exc(t, "RuntimeError", message, 11), traceback=_in_collective("barrier"),
                    source="dist.barrier()")
    loop = {"collective": "", "where": "train.py:7", "source": "n += 1", "file": "train.py",
            "line": 7}
    failure = find_failure({0: waited(18.0)}, {0: 1, 1: -15}, [0, 1], stopped_in={1: loop})
    assert (failure.rank, failure.kind, failure.exc_type, failure.exit_code) == \
        (1, "straggler", "SIGTERM", -15)
    assert (failure.where, failure.source, failure.victims, failure.also_failed) == \
        ("train.py:7", "n += 1", [0], [])
    assert failure.message.startswith("barrier() at train.py:11, until the process group's "
                                      "timeout ran out; rank 1 ran outside any collective")
    from labutils.run.result import RunResult
    text = RunResult(ok=False, world_size=2, duration_s=9.0, log_dir="runs/x", ranks=[],
                     failure=failure, reason="failed").summary()
    assert text.splitlines()[1:] == [
        "root cause: rank 1 never reached the collective its peers waited in: " + failure.message,
        "  at train.py:7    n += 1", "  rank 0 waited for it in vain"]
    from labutils.run.outcome import attempt_entry
    assert attempt_entry(0, failure, {})["why"] == \
        "never reached the collective its peers waited in: " + failure.message
    # 4 ranks: two time out, one loses its peer first, one is stopped waiting there too
    at_barrier = {"collective": "barrier", "where": "train.py:11", "source": "dist.barrier()"}
    failure = find_failure({0: waited(18.0), 2: waited(18.1), 3: waited(18.2, GLOO_PEER_GONE)},
                           {0: 1, 1: -15, 2: 1, 3: 1, 4: -15}, [0, 1, 2, 3, 4],
                           stopped_in={1: loop, 4: at_barrier})
    assert (failure.rank, failure.kind, failure.victims) == (1, "straggler", [0, 2, 3, 4])
    assert failure.mismatch == {}
    # rank 0 stopped at the barrier's line but in no call (its timeout raised, SIGTERM came
    # before it was reported): it reached the barrier, and rank 1 is still the straggler
    leaving = dict(loop, where="train.py:11", source="dist.barrier()", line=11, passing=True)
    failure = find_failure({2: waited(18.0)}, {0: -15, 1: -15, 2: 1}, [0, 1, 2],
                           stopped_in={0: leaving, 1: loop})
    assert (failure.rank, failure.kind, failure.victims, failure.also_failed) == \
        (1, "straggler", [0, 2], [])
    assert "rank 1 ran outside any collective" in failure.message
    failure = find_failure({1: waited(18.0)}, {0: -15, 1: 1}, [0, 1], stopped_in={0: leaving})
    assert failure.kind != "straggler"
    # at that line but computing in a call of its own (a model's forward): it is one
    failure = find_failure({1: waited(18.0)}, {0: -15, 1: 1}, [0, 1],
                           stopped_in={0: dict(leaving, passing=False)})
    assert (failure.rank, failure.kind) == (0, "straggler")
    # two ranks outside: the first is the root cause, the other failed on its own too
    failure = find_failure({0: waited(18.0)}, {0: 1, 1: -15, 2: -15}, [0, 1, 2],
                           stopped_in={1: loop, 2: dict(loop, where="train.py:9")})
    assert (failure.rank, failure.victims, failure.also_failed) == (1, [0], [2])
    assert "ranks 1, 2 ran outside any collective" in failure.message
    # the waiting ranks' calls differ too: still a mismatch of calls
    other = dict(waited(18.1), line=10, traceback=_in_collective("all_reduce"))
    failure = find_failure({0: waited(18.0), 2: other}, {0: 1, 1: -15, 2: 1}, [0, 1, 2],
                           stopped_in={1: loop})
    assert failure.kind == "mismatch" and sorted(failure.mismatch) == [0, 2]
    # an error of a rank's own comes first, wherever the others were
    failure = find_failure({0: _exc(17.0)}, {0: 1, 1: -15}, [0, 1], stopped_in={1: loop})
    assert (failure.rank, failure.kind, failure.victims) == (0, "exception", [1])


@pytest.mark.parametrize(("kind", "exc_type", "said"), [
    ("straggler", "SIGTERM", "rank 1 never reached the collective its peers waited in"),
    ("exception", "ValueError", "rank 1 raised ValueError"),
    ("exit", "SystemExit", "rank 1 raised SystemExit"),
    ("exit", "exit", "rank 1 exited"),
    ("signal", "SIGSEGV", "rank 1 died of SIGSEGV"),
    ("early_exit", "exit 0", "rank 1 ended early"),
    ("torchrun", "torchrun", "torchrun failed"),
])
def test_the_summary_words_each_ending_as_it_happened(kind, exc_type, said):
    """A signal is not raised, and a failed agent has no rank (-1) nor a line."""
    from labutils.run.result import RunResult

    failure = Failure(rank=-1 if kind == "torchrun" else 1, exc_type=exc_type, message="m",
                      file=None, line=None, traceback="", kind=kind)
    assert failure.ended_how() == said
    text = RunResult(ok=False, world_size=2, duration_s=1.0, log_dir="runs/x", ranks=[],
                     failure=failure, reason="failed").summary()
    assert f"root cause: {said}: m" in text
    assert ("unknown location" in text) is (kind != "torchrun")


def test_an_exception_without_a_message_is_named_alone():
    """`raise KeyboardInterrupt` has no message: the summary and the attempt say its name,
    as Python's traceback does, with nothing after it."""
    from labutils.run.outcome import attempt_entry
    from labutils.run.result import RunResult

    failure = Failure(rank=1, exc_type="KeyboardInterrupt", message="", file="train.py", line=3,
                      traceback="", kind="exception")
    text = RunResult(ok=False, world_size=2, duration_s=1.0, log_dir="runs/x", ranks=[],
                     failure=failure, reason="failed").summary()
    assert "root cause: rank 1 raised KeyboardInterrupt\n" in text
    assert attempt_entry(0, failure, {})["why"] == "KeyboardInterrupt"


def test_at_a_timeout_ranks_that_all_compute_are_no_mismatch():
    """Every rank busy at its own line when the timeout came: where each was, and no
    word of collectives that do not match (that is said of a hang, where all wait)."""
    from labutils.run.hang import Hang
    from labutils.run.result import RunResult

    at = Hang(stacks={0: "", 1: ""}, waiting={0: "train.py:20", 1: "train.py:31"}, stragglers=[],
              sources={0: "loss.backward()", 1: "evaluate(model)"},
              explanation="the ranks wait at different lines: their collectives do not match")
    text = RunResult(ok=False, world_size=2, duration_s=30.0, log_dir="runs/x", ranks=[],
                     reason="timeout", at_stop=at).summary()
    assert text.splitlines()[1:] == ["where each rank was at the timeout:",
                                     "  rank 0 was at train.py:20    loss.backward()",
                                     "  rank 1 was at train.py:31    evaluate(model)"]


def test_a_notebook_cell_is_named_by_its_file_alone(tmp_path, monkeypatch):
    """A world's cell hung "at runs/<run>/cells/cell-3.py:1" while its failures said
    "cell-3.py:1"; both say the latter now, and a %%torchrun cell's file the same way."""
    from labutils.run.hang import where_text
    from labutils.runtime.runfiles import cell_path

    monkeypatch.chdir(tmp_path)
    assert where_text(str(cell_path(tmp_path / "runs" / "a-run", 3))) == "cell-3.py"
    assert where_text(str(cell_path(tmp_path / "runs", "0123abcd"))) == "cell-0123abcd.py"
    assert where_text(str(tmp_path / "train.py")) == "train.py"
    assert where_text(str(tmp_path / "cells" / "train.py")) == "cells/train.py"  # no cell's name
