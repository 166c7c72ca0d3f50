"""Shared fixtures: a scratch folder per test for run folders, and a leak check."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
import uuid
from pathlib import Path

import json

import pytest



# Every process this test session starts inherits this token, so the leak check
# sees only our own processes, even on a machine where other runs are going on.
SESSION_TOKEN = f"LABUTILS_TEST_SESSION={uuid.uuid4().hex}"
os.environ["LABUTILS_TEST_SESSION"] = SESSION_TOKEN.split("=", 1)[1]


def _environ(pid: str) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def _ours(pid: str) -> bool:
    return SESSION_TOKEN.encode() in _environ(pid)


SERVER = "labutils.runtime.server"


def _processes() -> list[tuple[str, str, str, str]]:
    """(pid, ppid, state, command line) of every process, read from /proc: what
    `ps -eo pid,ppid,stat,args` gives, without starting a process twice per test."""
    rows = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # it ended meanwhile
            continue
        rows.append((pid, fields[1].decode(), fields[0].decode(), line))
    return rows


def distributed_pids() -> list[str]:
    """Processes of ours that must not outlive a test: torchrun agents, ranks, and
    whatever a rank started (they all inherit the run folder's variable); and what a
    warm server forked (keepers, agents and ranks of warm runs carry the server's
    command line: any process with it whose parent has it too, or that lost its parent).
    A warm server itself lives as long as its caller, this test session."""
    rows = _processes()
    args = {pid: line for pid, _, _, line in rows}
    found = []
    for pid, ppid, stat, line in rows:
        if stat.startswith("Z"):
            continue
        named = ("labutils.runtime.agent" in line or "labutils.runtime.worker" in line
                 or "torch.distributed.run" in line)
        if SERVER in line:
            named = SERVER in args.get(ppid, "") or ppid == "1" or ppid not in args
        environ = _environ(pid)
        in_a_run = any(v.startswith(b"LABUTILS_RUN_DIR=") for v in environ)
        if (named or in_a_run) and SESSION_TOKEN.encode() in environ:
            found.append(f"{pid} {stat} {line}".strip())
    return found


@pytest.fixture(autouse=True)
def default_sigint(request):
    """Each test starts with Python's own SIGINT handler, and leaves it so.

    Tests here interrupt launch() with SIGINT (in-process and in child processes, which
    inherit an ignored SIGINT); a library that swaps the handler in one test must not
    silently turn another test's Ctrl-C into nothing.
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    changed = signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if changed:
        print(f"\n[conftest] {request.node.nodeid} changed the SIGINT handler; restored")


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Every test must end with no agent or rank alive (checked for up to 5 s)."""
    before = set(distributed_pids())
    yield
    deadline = time.monotonic() + 5
    while True:
        left = [p for p in distributed_pids() if p not in before]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"processes left behind: {left}"


STARTS = ("warm", "cold")


def pytest_generate_tests(metafunc):
    """A test that uses the `start` fixture (launcher test modules take it with
    pytestmark = pytest.mark.usefixtures("start")) runs once per start: warm (forked
    from the session's warm server) and cold (new interpreters). A test marked
    warm_only("why its cold path is covered elsewhere") runs warm only: the long ones
    whose cold run would test again what a shorter cold test already does."""
    if "start" in metafunc.fixturenames:
        warm_only = metafunc.definition.get_closest_marker("warm_only")
        metafunc.parametrize("start", ("warm",) if warm_only else STARTS, indirect=True)


@pytest.fixture
def start(request, monkeypatch):
    """This test's runs start warm or cold: LABUTILS_START for launch() here and for
    every process the test starts (CLI, kernels), as an instructor would set it."""
    if request.param == "cold":
        monkeypatch.setenv("LABUTILS_START", "cold")
    else:
        monkeypatch.delenv("LABUTILS_START", raising=False)
    return request.param


@pytest.fixture
def runs_dir(tmp_path, monkeypatch):
    """Run folders go under the test's tmp_path."""
    d = tmp_path / "runs"
    monkeypatch.setenv("LABUTILS_RUNS_DIR", str(d))
    return d


@pytest.fixture
def write_script(tmp_path):
    """write_script("name.py", source) -> path of a dedented script in tmp_path."""
    def write(name: str, source: str) -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path
    return write


PYTHON = sys.executable


from helpers import REPO, this_python_kernel  # noqa: E402,F401 - fixtures below use them


# The order in which the parallel pass hands out its longest files (`--no-loadscope-reorder`
# keeps it; the rest follow in collection order). A worker takes the next file when it
# is nearly done with its own, so neighbours in this list run side by side: the graded
# labs (one lab at a time, about a core for 6 minutes) beside files that mostly wait
# (the endings table and the elastic tests wait on hang timeouts and rendezvous: about
# 0.6 of a core each). Measured with benchmarks/suite_timeline.py (2026-11-27, fresh
# clone, 2 cores): 2 workers, the graded labs two at a time: 912 s for 1,418 tests,
# 1,485 CPU-s; 3 workers, one lab at a time: 843 s for 1,436 tests, 1,531 CPU-s.
LONGEST_FIRST = ("tests/grading/test_grading_labs.py", "tests/run/test_endings.py",
                 "tests/grading/test_lab12_cases.py", "tests/run/test_elastic.py",
                 "tests/grading/test_wrong_fixes.py", "lessons/10_current_stack.ipynb",
                 "tests/run/test_launcher.py", "tests/grading/test_wrong_fixes_second_half.py",
                 "tests/grading/test_grading_adversarial.py", "tests/run/test_multinode.py",
                 "tests/grading/test_grading_instructor.py")


# The lessons whose notebooks run in the parallel pass: every checked output is a value,
# a verdict or a table of bytes, which a busy machine cannot change, or a comparison of
# times whose margin held with both cores of the 2-core machine kept busy by other
# processes, each in a session of its own: the kernel shares the cores between sessions
# (autogroup) before it shares them between processes, so busy loops started from one
# shell take one share together and load a run far less than the parallel pass does
# (lesson 13's straggler held under three such loops in one session and failed under four
# in sessions of their own, as it once did in the pass; at 512 rows and 7 steps it held
# under six, 2026-11-30). Lesson 04's hang cell gives its ranks 4 s of silence, as the launcher's hang
# tests of the parallel pass do; lesson 05's faults are injected at steps, not at times.
# Lesson 00's hang cell gives 3 s, and lesson 09's tools race timeouts of 1.5 to 3 s
# (py-spy, monitored barriers): both stay serial. A lesson not named here measures
# against a bound a busy machine could miss, and runs in the serial pass: lesson 11's
# bubble (1F1B within 15 points of GPipe) held with both cores kept busy, but once
# failed in the parallel pass, whose load two busy processes do not reproduce.
NOTEBOOKS_FOR_THE_PARALLEL_PASS = (
    "04_sampler_pitfalls.ipynb",  # which items each rank sees, a hang at a barrier
    "05_elastic_training.ipynb",  # restarts after kills at steps, equal weights
    "08_async_data_parallel.ipynb",  # pushes and pulls counted, replays bit for bit; times
    # compared at 20 ms per gradient held under four busy processes in sessions of their own
    "10_current_stack.ipynb",     # placements, bytes per collective, equal weights
    "12_where_memory_goes.ipynb",  # bytes held, FLOPs and ops counted, equal gradients
    "13_where_time_goes.ipynb",  # shares of a step and a straggler's waiting, with margins; a hang of 8 s
)


def pytest_collection_modifyitems(config, items):
    """Most lessons' notebooks measure (overlap, bandwidth, time per step) and say whether
    a prediction held: they run in `make test`'s serial pass, on a quiet machine, with the
    tests marked serial (those that assert a time or a rate); the rest run in parallel,
    the longest files first."""
    for item in items:
        path = Path(str(item.fspath))
        if path.parent.name == "lessons" and path.suffix == ".ipynb" \
                and path.name not in NOTEBOOKS_FOR_THE_PARALLEL_PASS:
            item.add_marker(pytest.mark.serial)
    root = Path(str(config.rootpath))

    def rank(item) -> int:
        rel = Path(str(item.fspath)).resolve().relative_to(root).as_posix() \
            if Path(str(item.fspath)).resolve().is_relative_to(root) else ""
        return LONGEST_FIRST.index(rel) if rel in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)   # stable: within a file, and among the rest, the order stays


_LOAD: dict = {}


def _measuring_pass(config) -> bool:
    """The serial pass and plain runs: no xdist here (not a worker, no -n)."""
    return not hasattr(config, "workerinput") and not getattr(config.option, "numprocesses", None)


_SESSION: dict = {}


def pytest_sessionstart(session):
    """Start noting what other processes take while this session runs (summary below),
    and when it started (what it leaves in the temporary folder: pytest_sessionfinish)."""
    from helpers import OtherLoad

    if not hasattr(session.config, "workerinput"):
        _SESSION["started"] = time.time()
    if _measuring_pass(session.config):
        _LOAD.update(wall=time.monotonic(),
                     others=OtherLoad(os.getpid(), token=SESSION_TOKEN.encode()))


def pytest_terminal_summary(terminalreporter, config):
    """The serial pass and the notebooks measure and need a quiet machine: say how much
    CPU other processes took while this session ran (a busy neighbour, or a process
    an earlier pass left behind), so a failed timing can be read against it."""
    if not _LOAD:
        return
    wall = time.monotonic() - _LOAD["wall"]
    others = _LOAD["others"].finish()
    total = sum(seconds for _, seconds in others)
    top = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in others[:3] if seconds >= 0.5)
    busiest = _LOAD["others"].busiest()
    terminalreporter.write_line(
        f"other processes while this session ran: {total:.0f} CPU-s in {wall:.0f} s "
        f"({total / max(wall, 1e-9):.2f} cores on average){'; most: ' + top if top else ''}"
        + (f"; the busiest one ({busiest[1]:.0f} s): {busiest[0]}" if busiest and busiest[1] >= 5 else ""))


def pytest_sessionfinish(session, exitstatus):
    """A session (with xdist: once every worker is done) fails if the runs it made left
    anything of theirs in the temporary folder."""
    from helpers import left_behind

    if "started" not in _SESSION:
        return
    found = left_behind(_SESSION["started"])
    if found:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        line = f"left in the temporary folder by this session's runs: {', '.join(found)}"
        if reporter is not None:
            reporter.write("\n")
            reporter.write_line(line, red=True)
        else:
            print(line, file=sys.stderr)
        if session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_addoption(parser):
    parser.addoption("--stress", action="store_true", default=False,
                     help="run the lifetime tests' every ending 20 times (tests/run/test_lifetime.py)")
    parser.addoption("--endings-all", action="store_true", default=False,
                     help="run every ending of tests/run/test_endings.py with 2 and 4 ranks, "
                          "the failing rank first and last")


@pytest.fixture
def kernel(request, tmp_path, runs_dir):
    """A real ipykernel (this Python) started with jupyter_client, and its client."""
    if "start" in request.fixturenames:
        request.getfixturevalue("start")  # the start's variable set before the kernel starts
    km = this_python_kernel(tmp_path, "labutils-test")
    km.start_kernel(cwd=str(tmp_path), env={**os.environ, "LABUTILS_RUNS_DIR": str(runs_dir)})
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


