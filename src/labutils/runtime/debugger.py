"""A debugger for one rank, from the notebook or a terminal, while the others wait.

A rank has no terminal: its stdin is not the learner's, so pdb cannot read from it,
and torch.distributed.breakpoint() opens /dev/stdin, which does not work in a rank
started from a notebook either. Inside a rank, install() routes both to a pdb that
talks over a Unix socket of the rank's own:

- ``breakpoint()`` (through sys.breakpointhook; a PYTHONBREAKPOINT the learner set
  is left alone) and ``torch.distributed.breakpoint(rank=R)`` (torch builds its pdb
  with torch.distributed._make_distributed_pdb, replaced here once torch.distributed
  is imported) stop the rank and write a ``debugger`` event naming the socket;
- the launcher pauses its hang watch while a rank is being debugged (the other ranks
  wait for it, in their next collective or in torch's barrier) and offers a console:
  a text box in the rank's pane, the terminal of ``labutils launch``, or
  ``labutils debug RUN_FOLDER`` from any terminal (Console below);
- ``c`` (continue) ends the session and the rank goes on; ``q`` (quit) or the end of
  the console's input raises bdb.BdbQuit in the rank, which fails it, and the run
  ends as any failed run does. Stop, a timeout or Ctrl-C end it as usual.
- under the grader (LABUTILS_GRADE_TAG set) nobody can type: breakpoints are passed over.

The socket lives in a private folder under the system's temporary folder (mode 0700),
removed when the session ends, or by the launcher when the run ends with the rank
still at its breakpoint (stopped, or ended by its agent when a peer failed).
"""

from __future__ import annotations

import codecs
import importlib.abc
import importlib.util
import os
import select
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import IO, cast

EVENT = "debugger"


class Listener:
    """The rank's end: a listening socket and the events saying where it is."""

    def __init__(self, rank: int, writer) -> None:
        self.rank, self.writer = rank, writer
        self.folder: str | None = None
        self.sock: socket.socket | None = None

    def accept(self) -> socket.socket:
        """Open the socket, say where it is, wait for the console (the rank pauses here)."""
        from labutils.runtime.runfiles import DEBUG_SOCKET_PREFIX, socket_folder

        name = f"rank{self.rank}.sock"
        self.folder = socket_folder(DEBUG_SOCKET_PREFIX, name)
        path = os.path.join(self.folder, name)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(1)
        where = _caller()
        self._event("waiting", socket=path, where=where)
        print(f"[labutils] rank {self.rank} stopped at a breakpoint ({where}) and waits for a "
              "debugger", file=sys.stderr, flush=True)
        conn, _ = self.sock.accept()
        self._event("attached")
        return conn

    def ended(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
            self._event("ended")

    def _event(self, state: str, **extra) -> None:
        if self.writer is not None:
            self.writer.write({"kind": EVENT, "state": state, "t": time.time(), **extra})


def socket_pdb(listener: Listener):
    """A pdb on the listener's next connection (pdb is imported only when one is needed)."""
    import pdb

    class SocketPdb(pdb.Pdb):
        """pdb on one accepted connection; ``continue`` ends the session."""

        def __init__(self) -> None:
            self.conn = listener.accept()
            # two files: a text file that writes drops what it had read ahead
            self.files = (self.conn.makefile("r", encoding="utf-8", errors="replace"),
                          self.conn.makefile("w", buffering=1, encoding="utf-8",
                                             errors="replace"))
            # _Lenient is a duck-typed text file (write and flush)
            super().__init__(stdin=self.files[0], stdout=cast(IO[str], _Lenient(self.files[1])),
                             nosigint=True)
            self.use_rawinput = False
            self.prompt = f"(Pdb rank {listener.rank}) "

        def set_continue(self) -> None:
            super().set_continue()
            self.message(f"rank {listener.rank} continues")
            self.close()

        def set_quit(self) -> None:
            super().set_quit()
            self.close()

        def close(self) -> None:
            for thing in (*self.files, self.conn):
                try:
                    thing.close()
                except OSError:
                    pass
            listener.ended()

    return SocketPdb()


class _Lenient:
    """pdb's output file: a console that went away must not crash the rank (its next
    read sees the end of the input, which pdb takes as quit)."""

    def __init__(self, file) -> None:
        self.file = file

    def write(self, text: str) -> int:
        try:
            return self.file.write(text)
        except (OSError, ValueError):
            return len(text)

    def flush(self) -> None:
        try:
            self.file.flush()
        except (OSError, ValueError):
            pass


def _caller() -> str:
    """file:line of the first frame outside pdb, torch.distributed and this module."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.endswith(("pdb.py", "bdb.py")) or name == __file__
                or f"torch{os.sep}distributed" in name):
            return f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class _PassOver:
    """What a breakpoint gets under the grader: nobody is there to type."""

    def message(self, text: str) -> None:
        pass

    def set_trace(self, frame=None) -> None:
        pass


def install(rank: int, writer) -> None:
    """Route breakpoint() and torch.distributed.breakpoint() of this rank to a socket
    (under the grader, where nobody can type, they are passed over)."""
    from labutils.runtime.runfiles import ENV_GRADE_TAG

    listener = Listener(rank, writer)
    graded = bool(os.environ.get(ENV_GRADE_TAG))

    def make_pdb():
        return _PassOver() if graded else socket_pdb(listener)

    def breakpointhook(*args, **kwargs) -> None:
        make_pdb().set_trace(sys._getframe(1))

    if not os.environ.get("PYTHONBREAKPOINT"):
        sys.breakpointhook = breakpointhook

    def patch(module) -> None:
        if hasattr(module, "_make_distributed_pdb"):
            module._make_distributed_pdb = make_pdb

    after_import("torch.distributed", patch)


def after_import(name: str, fn) -> None:
    """Call fn(module) once the module is imported (now, if it already is)."""
    if name in sys.modules:
        fn(sys.modules[name])
        return

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module) -> None:
                run(module)
                fn(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


# ------------------------------------------------------------------ the console's end

class DebuggerGone(ConnectionError):
    """The rank left before a console reached its debugger: it failed, or torchrun
    ended it because a peer failed, between its "waiting" event and the connection."""


class Console:
    """A connection to a rank's debugger: send lines, read what pdb writes.

    A thread of its own moves what arrives into a buffer that ``take()`` empties, so a
    display can show pdb's output from the thread it runs on; ``take()`` also reads
    what is already on the socket. So everything pdb wrote before the rank went on
    (before it continued, printed or ended) is in what ``take()`` returns after the
    display has seen that: pdb's answers come before the rank's next lines.
    """

    def __init__(self, path: str) -> None:
        # The rank wrote its "waiting" event after its socket listened: a socket that
        # is not there, or refuses, belongs to a rank that has gone.
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            self.sock.close()
            raise DebuggerGone(f"the rank's debugger at {path} is gone: {exc}") from exc
        self._buffer: list[str] = []
        self._decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        self._lock = threading.Lock()
        self.closed = threading.Event()
        threading.Thread(target=self._read, name="labutils-debug-read", daemon=True).start()

    def _read(self) -> None:
        while not self.closed.is_set():
            try:
                select.select([self.sock], [], [], 0.5)
            except (OSError, ValueError):  # closed under us
                self.closed.set()
                return
            with self._lock:
                self._drain()

    def _drain(self) -> None:
        """Move what the socket holds now into the buffer (the lock held)."""
        while not self.closed.is_set():
            try:
                data = self.sock.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self.closed.set()
                return
            self._buffer.append(self._decode(data))

    def take(self) -> str:
        """What pdb wrote since the last call, up to what the socket holds now."""
        with self._lock:
            self._drain()
            text, self._buffer = "".join(self._buffer), []
        return text

    def send(self, line: str) -> None:
        if not self.closed.is_set():
            try:
                self.sock.sendall((line.rstrip("\n") + "\n").encode())
            except OSError:
                self.closed.set()

    def close(self) -> None:
        self.closed.set()
        try:
            self.sock.close()
        except OSError:
            pass


def waiting_sockets(run_dir: str | os.PathLike) -> dict[int, str]:
    """rank -> the socket of its debugger, for the ranks of a run folder that wait for one."""
    import json

    from labutils.runtime.runfiles import events_path

    found: dict[int, str] = {}
    for folder in sorted(Path(run_dir).glob("rank*")):
        rank = int(folder.name[4:]) if folder.name[4:].isdigit() else None
        path = events_path(run_dir, rank) if rank is not None else None
        if rank is None or path is None or not path.is_file():  # path is None when rank is
            continue
        last = None
        for line in path.read_text(errors="replace").splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("kind") == EVENT:
                last = ev if ev.get("state") == "waiting" else None
            elif ev.get("kind") == "exit":
                last = None
        if last is not None and os.path.exists(last.get("socket", "")):
            found[rank] = last["socket"]
    return found


def bridge_terminal(path: str, *, stdin=None, stdout=None, poll_s: float = 0.1,
                    console: Console | None = None, pump=None) -> None:
    """Connect a terminal (stdin, stdout) to a rank's debugger until the session ends.

    The end of stdin sends an end of file, which pdb takes as quit. ``console``: one
    already open; ``pump``: writes what ``console.take()`` returns, for a display that
    also calls it before its own lines (by default, to stdout).
    """
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    if console is None:
        try:
            console = Console(path)
        except DebuggerGone:
            stdout.write("[labutils] the rank ended before its debugger opened\n")
            stdout.flush()
            return

    def to_stdout() -> None:
        text = console.take()
        if text:
            stdout.write(text)
            stdout.flush()

    pump = pump or to_stdout
    try:
        while not console.closed.is_set():
            pump()
            try:
                ready = select.select([stdin], [], [], poll_s)[0]
            except (OSError, ValueError):  # stdin closed, or no file descriptor
                ready = [stdin]
            if ready:
                line = stdin.readline()
                if not line:  # end of input: pdb's EOF command quits
                    console.sock.shutdown(socket.SHUT_WR)
                    break
                console.send(line)
        deadline = time.monotonic() + 5
        while not console.closed.wait(poll_s) and time.monotonic() < deadline:
            pump()  # what pdb answers to the last commands, as it comes
        pump()
    finally:
        console.close()
