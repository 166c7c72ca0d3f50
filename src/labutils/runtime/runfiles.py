"""Where a run keeps its files, shared by the launcher and the worker bootstrap.

A run folder looks like this::

    runs/20261121-184501-train-3f2a/
        command.txt          the torchrun command line, one argument per line
                             (one block per agent when a run has several)
        agent.log            torchrun's own output (kept out of the cells)
        agent1.log ...       the output of the other agents of a multi-agent run
                             (agentnode1.log ...: other machines' nodes of a job)
        summary.json         the RunResult as JSON, written when the run ends
                             (summary-node1.json ...: each node's own of a job)
        stack-request.json   ranks asked to dump their stacks (multi-node hangs)
        ended-HOST-PID.jsonl how each rank the agent PID on HOST reaped ended:
                             {"host", "pid", "code" (exit code or -signal), "t"}
        stop.json            the reason a node's launcher ended the job early
        done-node1 ...       a node's agent has exited (the other nodes stop waiting)
        lease                kept fresh by the launcher following a SLURM job
        rank0/stdout.log     everything rank 0 wrote to fd 1, all attempts
        rank0/stderr.log     everything rank 0 wrote to fd 2, all attempts
        rank0/events.jsonl   start / progress / record / exception / exit events
        rank0/stacks.txt     Python stacks dumped on request (hang reports)
        rank0/ended-stacks.txt  Python stacks dumped as SIGTERM ended the rank (where a
                             rank torchrun stopped was waiting: collective mismatches)
        elastic/             torchrun's --log-dir: a folder per agent and attempt, where a
                             script decorated with torch's @record leaves error.json
                             (without it torchrun makes one in /tmp and never removes it)

Events are JSON objects, one per line, written with a single write() so a
reader never sees half of one. This module must stay import-light: the worker
bootstrap imports it before the learner's script imports torch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

# Every LABUTILS_* environment variable, here and nowhere else.
# Set by the launcher for the agent, and so for every rank:
ENV_RUN_DIR = "LABUTILS_RUN_DIR"
ENV_AGENT_PID = "LABUTILS_AGENT_PID"  # the torchrun agent (set by the keeper's child)
ENV_PARENT_PID = "LABUTILS_PARENT_PID"  # the launcher that started the keeper
ENV_BACKEND = "LABUTILS_BACKEND"  # launch(backend=...): labutils.dist.init() reads it
ENV_AGENT_INDEX = "LABUTILS_AGENT_INDEX"  # which of the run's agents started this rank
# "I/N": this rank's agent is the I-th of the N agents on this machine (local_agents=N,
# or one agent per host of a virtual cluster): ranks of all N share the machine's GPUs,
# so labutils.dist.init() counts them all.
ENV_LOCAL_AGENT = "LABUTILS_LOCAL_AGENT"
# Which launcher (host and pid) started this rank: in a multi-node job several launchers,
# one per machine, share a run folder and each one signals only its own ranks.
ENV_NODE = "LABUTILS_NODE"
# A pid the `labutils` command must not outlive (it asks the kernel for SIGKILL when
# its parent, that pid, dies); set by labutils code that starts the command itself.
ENV_DIE_WITH = "LABUTILS_DIE_WITH"
# JSON list of {"restart": K, "rank": R, "step": S[, "phase": P]}: in restart K, rank R
# SIGKILLs itself when it calls report(step=S[, phase=P]); {"restart": K, "agent": A,
# "step": S}: the rank of agent A that reports step S first SIGKILLs that agent, then
# itself (the agent's other ranks die with it).
ENV_FAULT = "LABUTILS_FAULT"
# The network interface of this host's link on a virtual cluster (labutils.cluster),
# set for every node it launches: labutils.dist.link_bytes() reads its counters.
ENV_LINK = "LABUTILS_LINK"
# The Unix socket of a persistent world's caller (labutils.run.world): every rank of the
# world connects to it and runs the cells it is sent (runtime/cells.py).
ENV_WORLD_SOCKET = "LABUTILS_WORLD_SOCKET"
# ...in a private folder of this name; a keeper whose caller died removes it (runtime/agent.py)
WORLD_SOCKET_PREFIX = "labutils-world-"
# A rank at a breakpoint listens in a private folder of this name (runtime/debugger.py);
# the launcher removes it when the run ends with the rank still there (run/follow.py)
DEBUG_SOCKET_PREFIX = "labutils-debug-"
# Read by the launcher and the display:
ENV_RUNS_DIR = "LABUTILS_RUNS_DIR"  # where run folders go when launch() gets no log_dir
ENV_DISPLAY = "LABUTILS_DISPLAY"  # what display="auto" means ("text" under the grader)
ENV_LEASE_STALE_S = "LABUTILS_LEASE_STALE_S"  # a SLURM job's nodes: when a lease is stale
ENV_START = "LABUTILS_START"  # "cold": every run starts cold, as with warm=False (run/warm.py)
# Set by the grader on every process of one submission, to find them all:
ENV_GRADE_TAG = "LABUTILS_GRADE_TAG"

STREAMS = ("stdout", "stderr")


def rank_dir(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / f"rank{rank}"


def cell_path(folder: str | os.PathLike, name: str | int) -> Path:
    """Where a notebook cell run on ranks is written: <folder>/cells/cell-<name>.py (a
    world's cell N in its run folder, a %%torchrun cell by its hash in the runs folder)."""
    return Path(folder) / "cells" / f"cell-{name}.py"


def is_cell_path(path: str | os.PathLike) -> bool:
    """Whether path is a cell_path(): reports name it by its file name alone."""
    p = Path(path)
    return p.parent.name == "cells" and p.name.startswith("cell-") and p.suffix == ".py"


def stream_path(run_dir: str | os.PathLike, rank: int, stream: str) -> Path:
    return rank_dir(run_dir, rank) / f"{stream}.log"


def events_path(run_dir: str | os.PathLike, rank: int) -> Path:
    return rank_dir(run_dir, rank) / "events.jsonl"


def stacks_path(run_dir: str | os.PathLike, rank: int) -> Path:
    return rank_dir(run_dir, rank) / "stacks.txt"


def ended_stacks_path(run_dir: str | os.PathLike, rank: int) -> Path:
    """The stacks a rank dumped as SIGTERM ended it (appended: one dump per attempt)."""
    return rank_dir(run_dir, rank) / "ended-stacks.txt"


def endings_path(run_dir: str | os.PathLike, host: str, agent_pid: int) -> Path:
    """The ranks one torchrun agent reaped, one JSON line each: {"host", "pid", "code",
    "t"}; code is the exit code, or -N for death by signal N (runtime/agent.py)."""
    return Path(run_dir) / f"ended-{host}-{agent_pid}.jsonl"


def endings_files(run_dir: str | os.PathLike) -> list[Path]:
    """Every agent's endings file in a run folder."""
    return sorted(Path(run_dir).glob("ended-*.jsonl"))


def agent_log_path(run_dir: str | os.PathLike, agent: int | str) -> Path:
    return Path(run_dir) / ("agent.log" if agent == 0 else f"agent{agent}.log")


def elastic_dir(run_dir: str | os.PathLike) -> Path:
    """torchrun's --log-dir for the run's agents (each makes a folder of its own in it)."""
    return Path(run_dir) / "elastic"


def agent_logs(run_dir: str | os.PathLike) -> list[Path]:
    """Every agent log in a run folder, those of other machines' nodes included."""
    return sorted(Path(run_dir).glob("agent*.log"))


# Files through which the launchers of a multi-node job, one per machine, work together
# in a shared run folder (they cannot signal each other's processes):
def stack_request_path(run_dir: str | os.PathLike) -> Path:
    """JSON {"by": node token, "ranks": [...]}: those ranks dump their stacks (hang
    reports across machines); every rank's progress watcher polls it."""
    return Path(run_dir) / "stack-request.json"


def stop_path(run_dir: str | os.PathLike) -> Path:
    """Written by the launcher that ends a run early; every other node's launcher stops."""
    return Path(run_dir) / "stop.json"


def lease_path(run_dir: str | os.PathLike) -> Path:
    """Touched every second by the launcher that submitted a job (scheduler="slurm");
    the job's nodes end the job when it goes stale (that launcher was killed)."""
    return Path(run_dir) / "lease"


def node_done_path(run_dir: str | os.PathLike, node: str) -> Path:
    """Written by a node's launcher once its agent has exited (its ranks are gone)."""
    return Path(run_dir) / f"done-{node}"


def node_done_paths(run_dir: str | os.PathLike) -> list[Path]:
    """Every node's done-<node> file written so far."""
    return sorted(Path(run_dir).glob("done-*"))


def node_summary_path(run_dir: str | os.PathLike, node: str) -> Path:
    """The summary one node's launcher writes when it is done (summary.json is the
    single-machine run's, or the scheduler view's)."""
    return Path(run_dir) / f"summary-{node}.json"


SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path holds 108 with the NUL)


def socket_folder(prefix: str, name: str) -> str:
    """A new private folder (0700) for a Unix socket called name: in the temporary
    folder (TMPDIR), or in /tmp when the socket's path there would be too long to bind
    (a deep TMPDIR: "AF_UNIX path too long")."""
    folder = tempfile.mkdtemp(prefix=prefix)
    if len(os.fsencode(os.path.join(folder, name))) <= SOCKET_PATH_MAX:
        return folder
    os.rmdir(folder)
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def remove_socket_folder(path: str | None, prefix: str) -> None:
    """Remove the folder socket_folder(prefix, ...) made for the socket at path, when
    that is what the folder is (its name starts with prefix); anything else is left."""
    if path and os.path.basename(os.path.dirname(path)).startswith(prefix):
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def write_atomic(path: str | os.PathLike, data: str | bytes, *, sync: bool = False) -> None:
    """Write path so that a reader sees the old file or the whole new one, never a part:
    a temporary file beside it (named for this process), then a rename. sync: also
    flush it to disk first (grades, which must survive a crash of the machine)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a folder at path, an interrupt: no half file left
        tmp.unlink(missing_ok=True)
        raise


def relative_path(path: str | os.PathLike) -> str:
    """path relative to the current folder when it lies inside it, else as it is
    (a run folder or a log as the display and the summaries name it)."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive
        return str(path)
    return rel if not rel.startswith("..") else str(path)


def short_path(path: str) -> str:
    """A path as a learner wants to read it: relative to the current folder when inside
    it, with the installation's prefix cut from library files; other paths unchanged."""
    import sys

    if not path or path.startswith("<"):
        return path
    for marker in ("site-packages", "dist-packages"):
        if f"{os.sep}{marker}{os.sep}" in path:
            return "..." + os.sep + marker + path.split(marker, 1)[1]
    # labutils' own files where it is installed in place (`make setup`: pip install -e),
    # as a fatal signal's faulthandler dump quotes them
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if path.startswith(package + os.sep):
        return "..." + os.sep + "labutils" + path[len(package):]
    cwd = os.getcwd() + os.sep
    if path.startswith(cwd):
        return path[len(cwd):]
    stdlib = os.path.join(sys.base_prefix, "lib") + os.sep
    if path.startswith(stdlib):
        return "..." + os.sep + path[len(stdlib):]
    return path


def shorten_traceback_paths(text: str) -> str:
    """Every 'File "..."' of a traceback or stack dump through short_path()."""
    return re.sub(r'File "([^"]+)"', lambda m: f'File "{short_path(m.group(1))}"', text)


# A C/C++ source path of the machine torch was built on, as torch's and gloo's error
# messages quote it: /__w/pytorch/pytorch/torch/csrc/.../ProcessGroupGloo.cpp:123 or
# /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553. The part from
# the source tree's top folder on says where to look; the build machine's prefix does not.
_BUILD_TREE_TOPS = "torch|aten|c10|caffe2|third_party|functorch"
_SOURCE_SUFFIXES = "c|cc|cpp|cxx|cu|cuh|h|hpp|hh|inl"
_SEGMENT = r"[^\s/:\"'\[\]()<>]+"
_BUILD_PATH_RE = re.compile(
    # an absolute path (not the tail of a longer one), its prefix up to the first top
    # folder of torch's source tree, then the rest, ending in a C/C++ suffix
    rf"(?<![\w./-])/(?:{_SEGMENT}/)*?(?=(?:{_BUILD_TREE_TOPS})/)"
    rf"((?:{_SEGMENT}/)*{_SEGMENT}\.(?:{_SOURCE_SUFFIXES}))(?![\w.])"
    # any other path in GitHub Actions' workspace (/__w/<repo>/<repo>/...)
    rf"|(?<![\w./-])/__w/(?:{_SEGMENT}/){{0,2}}"
)


def shorten_build_paths(text: str) -> str:
    """torch's build-machine paths in error messages cut to the source tree's part:
    ``[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]`` becomes
    ``[.../third_party/gloo/gloo/transport/tcp/pair.cc:553]``."""
    if "/" not in text:
        return text
    return _BUILD_PATH_RE.sub(lambda m: ".../" + (m.group(1) or ""), text)


# A Python file quoted with a line number outside a traceback, as warnings print it:
# "/x/site-packages/torch/distributed/c10d_logger.py:83: FutureWarning: ..."
_PY_LINE_RE = re.compile(r"(?<![\w./-])(/[^\s:\"'<>()\[\]]+\.py)(?=:\d+)")


def shorten_paths(text: str) -> str:
    """What a learner reads of any output line: traceback and warning paths through
    short_path(), torch's build paths through shorten_build_paths(). Log files keep the
    original."""
    if 'File "' in text:
        text = shorten_traceback_paths(text)
    if ".py:" in text:
        text = _PY_LINE_RE.sub(lambda m: short_path(m.group(1)), text)
    return shorten_build_paths(text)


# The profiler's own markers, written to stderr by torch's C++ profiler (kineto) at every
# start and stop of torch.profiler.profile, whatever KINETO_LOG_LEVEL below 6 says:
# "USDT:2026-11-27 12:15:58 16774:16774 SyncActivityProfilerHandler.cpp:52] profiler_start"
_PROFILER_MARKER_RE = re.compile(r"^USDT:\S+ \S+ \d+:\d+ \w+\.cpp:\d+\] profiler_(start|stop)$")


def lines_to_show(lines: list[str]) -> list[str]:
    """A rank's output lines as a display shows them: paths shortened (shorten_paths),
    the profiler's start and stop markers left out (a timestamp, pids and a C++ file
    that say nothing the learner did not ask for). The log files keep every line."""
    return [shorten_paths(ln) for ln in lines if not _PROFILER_MARKER_RE.match(ln)]


def encode_event(event: dict) -> bytes:
    """One event as one line of JSON (no newline inside, newline at the end)."""
    return (json.dumps(event, separators=(",", ":"), default=str) + "\n").encode()


class EventWriter:
    """Appends events to one rank's events.jsonl; safe to share between threads.

    Each event is a single os.write() on an O_APPEND descriptor, so events from the
    bootstrap's watcher thread and from report() never interleave.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(path)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, event: dict) -> None:
        os.write(self._fd, encode_event(event))


_writer: EventWriter | None = None
_writer_key: tuple | None = None


def event_writer() -> EventWriter | None:
    """This process's event writer, or None when not running under the launcher."""
    global _writer, _writer_key
    run_dir = os.environ.get(ENV_RUN_DIR)
    if not run_dir:
        return None
    key = (run_dir, os.environ.get("RANK", "0"), os.getpid())
    if _writer is None or _writer_key != key:
        _writer = EventWriter(events_path(run_dir, int(key[1])))
        _writer_key = key
    return _writer


def local_agent(env) -> tuple[int, int]:
    """(I, N) of ENV_LOCAL_AGENT in env (a mapping such as os.environ); (0, 1) when unset."""
    index, _, count = env.get(ENV_LOCAL_AGENT, "0/1").partition("/")
    return int(index or 0), int(count or 1)
