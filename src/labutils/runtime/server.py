"""The warm server: one per caller, torch already imported, the fork point of warm runs.

A cold run starts ``python -m labutils.runtime.agent`` (the keeper), whose torchrun
agent starts every rank as a fresh interpreter: torch is imported once per process,
about a second each. A warm run starts the same keeper and the same torchrun agent by
forking them from this server, which has imported torch and the worker bootstrap
once, and the agent starts the ranks with torchrun's own function entry point
(``--run-path``) and start method ``fork``: torchrun still rendezvouses, starts,
watches, stops and restarts the ranks, only no process imports torch again.

The launcher (labutils.run.warm) starts ``python -u -m labutils.runtime.server FD``
in a session of its own, FD being its end of a socket pair. Messages are JSON
lines; the server answers each request in order, and every answer carries the "id" of
its request (the caller matches them: an answer to a call a signal cut short is
dropped, never taken for the next call's, and one lost in the cut read is waited for by
no one):

    {"op": "hello", "id": N}  ->  {"pid": P, "threads": T, "id": N}
        answered once torch is imported: the server is ready
    {"op": "start", "argv": [...], "env": {...}, "cwd": D, "log": F, "id": N}  ->  {"pid": K, "id": N}
        fork a keeper (runtime/agent.py) in a new session, fd 0 from /dev/null, fd 1
        and 2 to F, in D, with exactly env, running torchrun with argv
    {"op": "poll", "pid": K, "id": N}  ->  {"code": None | exit code | -signal, "id": N}
    anything else  ->  {"error": "...", "id": N or None}

The server is single-threaded whenever it forks: it never runs torch code (importing
torch starts at most OpenBLAS's idle thread server, which OpenBLAS stops itself
before every fork, see main()) and never runs a learner's code; its objects are
frozen out of the garbage collector (gc.freeze) so forks share its pages; every run is a fork of the
same pristine process, so nothing one run does reaches the next. It exits when its
caller closes the socket or dies (its parent changes); the keepers it forked then
see their parent change and end their runs (runtime/agent.py).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import select
import socket
import sys
import traceback
import warnings
from typing import Any

from labutils.runtime import agent

# What a warm rank would otherwise import itself: torch, torchrun's agent, the worker,
# and torch._dynamo, which DDP's constructor imports (about 1.1 s of CPU per rank, 0.01 s
# once preloaded). With torch._dynamo preloaded, 5 of 12 warm 4-rank runs of lab 08 on a
# loaded machine once hung at exit, until the worker kept the script's objects alive to
# the end (worker.run_as_main says why); 36 of 36 then ended (2026-11-26).
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.run", "labutils.runtime.worker")
# Preloaded for a step a rank takes later (DDP's constructor): what importing it does to
# the warning filters (sympy adds one) is undone, so a warm rank's script starts with
# the filters a cold one has.
AHEAD = ("torch._dynamo",)
# Imported, when installed, by the handler torch._dynamo registers with atexit: it
# formats a table of compile times with it at every exit, a rank's included, even when
# nothing was compiled (about 70 ms of a forked rank's exit, reading the package's
# metadata; 0.5 ms once imported).
AT_EXIT = ("tabulate",)
PARENT_CHECK_S = 0.1
# The folder the server started in: the interpreter made PYTHONPATH's relative entries
# absolute against it, where a cold keeper makes them absolute against its run's folder.
START_CWD = os.getcwd()


def threads() -> int:
    """Threads of this process (Linux; 1 elsewhere)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def returncode(status: int) -> int:
    """A wait status as subprocess gives it: the exit code, or -signal."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def read_again() -> None:
    """Recompute, in a keeper now in its run's folder and environment, what the server
    computed from its own when it imported torch: a process started there would read
    them afresh. The temporary folder (tempfile caches it, and importing torch._dynamo
    asked for it: TMPDIR, and torch's compile cache under it), multiprocessing's
    starting folder, the folder TORCH_COMPILE_DEBUG writes to (the current one), and
    the import path's entries from PYTHONPATH's relative ones."""
    import multiprocessing.process
    import tempfile

    sys.path[:] = pythonpath_moved(sys.path, os.environ.get("PYTHONPATH", ""), START_CWD, os.getcwd())
    tempfile.tempdir = None
    multiprocessing.process.ORIGINAL_DIR = os.path.abspath(os.getcwd())  # type: ignore[attr-defined]
    dynamo_config: Any = sys.modules.get("torch._dynamo.config")
    if dynamo_config is not None and hasattr(dynamo_config, "default_debug_dir_root"):
        dynamo_config.debug_dir_root = dynamo_config.default_debug_dir_root()


def pythonpath_moved(path: list[str], pythonpath: str, was: str, now: str) -> list[str]:
    """The import path an interpreter started in `now` would have, given the one it has
    from starting in `was`. The interpreter puts PYTHONPATH's entries, made absolute
    against its folder (an empty one is the folder), right after the first entry, then
    site drops repeats, keeping the first: so are they put again, made absolute
    against `now`."""
    if not pythonpath or was == now:
        return path
    entries = pythonpath.split(os.pathsep)
    if all(os.path.isabs(entry) for entry in entries):
        return path
    given = {os.path.abspath(os.path.join(was, entry)) for entry in entries}
    first = now if path[0] == was else path[0]
    out: list[str] = []
    for entry in [first, *(os.path.abspath(os.path.join(now, e)) for e in entries),
                  *(e for e in path[1:] if e not in given)]:
        if entry not in out:
            out.append(entry)
    return out


def start_keeper(request: dict, conn: socket.socket) -> int:
    """Fork a keeper for one agent of a run; its pid."""
    pid = os.fork()
    if pid:
        return pid
    try:  # the child: become what `subprocess.Popen(start_new_session=True)` would start
        conn.close()
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        read_again()
        agent.main(request["argv"])
        code = 0
    except SystemExit as exc:  # the torchrun agent (the keeper's child) ending
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - whatever went wrong goes to the agent's log
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    os._exit(code)


class Server:
    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.codes: dict[int, int] = {}
        self.buffer = b""

    def send(self, message: dict) -> None:
        self.conn.sendall(json.dumps(message).encode() + b"\n")

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.codes[pid] = returncode(status)

    def answer(self, request: dict) -> dict:
        op = request.get("op")
        if op == "hello":
            return {"pid": os.getpid(), "threads": threads()}
        if op == "start":
            return {"pid": start_keeper(request, self.conn)}
        if op == "poll":
            self.reap()
            return {"code": self.codes.get(int(request["pid"]))}
        return {"error": f"unknown request {op!r}"}

    def serve(self, starter: int) -> None:
        while os.getppid() == starter:
            readable, _, _ = select.select([self.conn], [], [], PARENT_CHECK_S)
            self.reap()
            if not readable:
                continue
            data = self.conn.recv(1 << 20)
            if not data:
                return  # the caller closed its end or exited
            self.buffer += data
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                ident = None
                try:
                    request = json.loads(line)
                    ident = request.get("id")
                    reply = self.answer(request)
                except Exception as exc:  # noqa: BLE001 - a bad request must not end the server
                    reply = {"error": f"{type(exc).__name__}: {exc}"}
                self.send({**reply, "id": ident})


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    starter = os.getppid()
    conn = socket.socket(fileno=int(argv[0]))
    # No collections while importing: each would walk every object imported so far, and
    # the imports make no garbage worth them (torch and torch._dynamo took 2.2-2.7 CPU-s
    # with the collector on, 1.8-2.0 with it off). One collection follows, then the
    # collector is on again, for the forks as for any process.
    gc.disable()
    for name in PRELOAD:
        if name in AHEAD:
            with warnings.catch_warnings():
                importlib.import_module(name)
        else:
            importlib.import_module(name)
    for name in AT_EXIT:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    # Importing torch loads OpenBLAS, whose idle thread server OpenBLAS itself stops
    # before a fork (pthread_atfork) and starts again only for BLAS work, which this
    # process never does: one fork now leaves the server single-threaded for good.
    first = os.fork()
    if first == 0:
        os._exit(0)
    os.waitpid(first, 0)
    # Every object so far lives as long as the server: out of the collector's sight, a
    # forked process's collections do not write to (and so copy) the pages it shares.
    gc.collect()
    gc.freeze()
    gc.enable()
    server = Server(conn)
    try:
        server.serve(starter)
    except OSError:
        pass  # the caller's end is gone
    os._exit(0)


if __name__ == "__main__":
    main()
