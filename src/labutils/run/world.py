"""A persistent world: ranks that stay up between cells and keep their variables.

``World(nproc=4).start()`` launches labutils/cells.py on every rank through the one
launcher (run/follow.py's Run: warm when it can be, the keeper owning every process,
the run folder, the events), and does not wait for its end. Each rank joins the
process group once and connects back to this caller's Unix socket. ``run_cell(code)``
writes the code to <run folder>/cells/cell-<N>.py, sends it to the chosen ranks and
follows the run, step by step (Run.step), until each of them has answered; the cell's
display gets that cell's lines, and the cell's outcome is a RunResult of its own, so
every display and summary reads it as it reads a run:

- a rank whose cell raised is the root cause, with the cell's line; ranks then stuck
  in a collective with it are its victims (their stacks read once nothing moved for
  VICTIM_WAIT_S);
- ranks that make no progress for the cell's hang timeout are a hang: every rank's
  stack is read and its line in the cell named, as for a run;
- Stop (the display's button) and an interrupt of the caller send SIGINT to the ranks
  still in the cell: the cell ends in KeyboardInterrupt on each.

What happens to the world after a cell that did not end well is decided here, once:
it is kept, every rank's variables with it, only when every rank of the cell came
back and every rank's process group has run the same number of collectives
(cells.collectives). Otherwise a rank is stuck in a collective, or the ranks would
pair the wrong collectives from then on, and the world is restarted: every process
ended, a new world started, and the cell's report names the variables that were lost.
A rank that dies (a signal, os._exit) ends the run as torchrun ends any run, and the
world is restarted the same way.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import json
import os
import pickle
import selectors
import shutil
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labutils.errors import LaunchConfigError, real_number, whole_number
from labutils.run.crash import after_thread
from labutils.run.diagnosis import Failure
from labutils.run.display import Display, check_display_mode, make_display
from labutils.run.follow import POLL_S, TICK_S, Run
from labutils.run.hang import Hang, rank_list, verb_for
from labutils.run.launcher import prepare
from labutils.run.result import RankResult, RunResult
from labutils.run.spec import make_spec
from labutils.run.states import Ending, RankStatus
from labutils.runtime import runfiles

START_TIMEOUT_S = 120.0  # every rank has joined and said hello (a loaded machine, cold)
VICTIM_WAIT_S = 2.0  # after a rank's cell raised: how long the others may stay silent
INTERRUPT_GRACE_S = 3.0  # after SIGINT: how long the ranks have to come back
STOP_GRACE_S = 10.0
STDERR_KEPT = 200  # lines of each rank's stderr in a cell, read for a thread's exception


class WorldError(RuntimeError):
    """The world could not start, or is not there; the message is one line."""


def _cells_script() -> Path:
    """labutils/cells.py, the ranks' loop (a file the launcher runs, not imported here)."""
    return (Path(__file__).resolve().parent.parent / "cells.py")


class _Router(Display):
    """The display the world's run keeps for its whole life: it hands the run's lines,
    records, notes, debugger events and ticks to the display of the cell that runs now.
    Rank states are the cell's own (run_cell sets them); the run's start and end are
    the world's."""

    def __init__(self) -> None:
        super().__init__()
        self.target: Display | None = None
        self.early: list[tuple[str, tuple]] = []  # between cells, for the next one
        self.counts: dict[tuple[int, str], int] = {}  # (rank, stream) -> lines, this cell
        self.stderr: dict[int, list[str]] = {}  # rank -> its last lines of stderr, this cell

    def _send(self, what: str, *args) -> None:
        if self.target is None:
            self.early.append((what, args))
        else:
            getattr(self.target, what)(*args)

    def lines(self, rank: int, stream: str, lines: list[str]) -> None:
        key = (rank, stream)
        self.counts[key] = self.counts.get(key, 0) + len(lines)
        if stream == "stderr":
            kept = self.stderr.setdefault(rank, [])
            kept += lines
            del kept[:-STDERR_KEPT]
        self._send("lines", rank, stream, lines)

    def record(self, rank: int, values: dict) -> None:
        self._send("record", rank, values)

    def note(self, text: str) -> None:
        self._send("note", text)

    def debugger(self, rank: int, event: dict) -> None:
        if self.target is None:
            super().debugger(rank, event)  # nobody to type: the rank continues
        else:
            self.target.debugger(rank, event)

    def tick(self) -> None:
        if self.target is not None:
            self.target.tick()

    def attach(self, display: Display | None) -> None:
        self.target = display
        if display is not None:
            self.counts, self.stderr = {}, {}
            for what, args in self.early:
                getattr(display, what)(*args)
            self.early.clear()


@dataclass
class CellResult:
    """One cell on the world's ranks.

    seq: the cell's number in this world (its file is cells/cell-<seq>.py).
    ranks: the ranks it ran on.
    values: rank -> the value of the cell's last expression (None when it had none;
        the repr, a str, when the value could not be pickled).
    result: the cell as a run: ok, reason, per-rank states, failure, hang.
    restarted: why the world was restarted after this cell, and what was lost
        ("" when it was kept).
    """

    seq: int
    ranks: list[int]
    values: dict[int, Any] = field(default_factory=dict)
    result: RunResult | None = None
    restarted: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.result and self.result.ok)


class World:
    """N ranks that stay up between cells. See the module's docstring."""

    def __init__(self, nproc: int = 2, *, backend: str = "auto", hang_timeout: float = 30.0,
                 env: dict[str, str] | None = None, log_dir: str | os.PathLike | None = None,
                 warm: bool = True, display: str = "auto") -> None:
        check_display_mode(display)
        self.nproc, self.backend, self.hang_timeout = nproc, backend, _seconds(hang_timeout)
        self.env, self.log_dir, self.warm, self.display_mode = dict(env or {}), log_dir, warm, display
        self.run: Run | None = None
        self.last_result: RunResult | None = None  # the last run of this world that ended
        self.seq = 0
        self._logs: contextlib.ExitStack | None = None
        self._router = _Router()
        self._conns: dict[int, socket.socket] = {}
        self._buffers: dict[int, bytes] = {}
        self._pids: dict[int, int] = {}
        self._collectives: dict[int, int] = {}
        self._names: dict[int, list[str]] = {}
        self._sock_dir: str | None = None
        self._listener: socket.socket | None = None
        make_spec(_cells_script(), nproc, backend=backend, env=self.env, warm=warm)  # launch()'s checks

    # ------------------------------------------------------------------ lifetime
    @property
    def alive(self) -> bool:
        return self.run is not None

    @property
    def pids(self) -> dict[int, int]:
        """rank -> process id of each rank now up."""
        return dict(self._pids)

    @property
    def run_dir(self) -> Path:
        if self.run is None:
            raise WorldError("the world is not running: start it with %dist start -n N "
                             "(or labutils.world(nproc=N))")
        return self.run.run_dir

    def start(self) -> World:
        """Start the ranks and wait until every one has joined; the world (WorldError
        with the run's headline if they could not)."""
        if self.run is not None:
            return self
        self._sock_dir = runfiles.socket_folder(runfiles.WORLD_SOCKET_PREFIX, "s")
        path = os.path.join(self._sock_dir, "s")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(self.nproc)
        self._listener.setblocking(False)
        # No PYTHONPATH of its own: the ranks' loop puts the caller's folder first on
        # sys.path itself (cells.py), and a PYTHONPATH other than the caller's would key
        # a warm server of its own (run/warm.py): the kernel's would not serve the world.
        run = prepare(_cells_script(), self.nproc, backend=self.backend, hang_timeout=None,
                      env={**self.env, runfiles.ENV_WORLD_SOCKET: path},
                      log_dir=self.log_dir, display=self._router, warm=self.warm)
        self._logs = contextlib.ExitStack()
        self.run = run
        try:
            run.begin(self._logs)
            self._await_ranks()
        except BaseException:
            self._end(Ending.INTERRUPTED)
            raise
        _worlds.add(self)
        return self

    def _await_ranks(self) -> None:
        assert self.run is not None and self._listener is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(self._pids) < self.nproc:
            with contextlib.suppress(BlockingIOError):
                conn, _ = self._listener.accept()
                conn.setblocking(True)
                hello = json.loads(conn.makefile("rb").readline() or b"{}")
                if "hello" in hello:
                    rank = int(hello["hello"])
                    self._conns[rank], self._pids[rank] = conn, int(hello["pid"])
                    self._buffers[rank] = b""
                    self._collectives[rank] = 0
                    continue
            ending = self.run.step()
            if ending is not None:
                result = self._end(ending)
                raise WorldError(f"the world's ranks did not start: {result.headline()}"
                                 + (f" ({result.failure.exc_type}: {result.failure.message})"
                                    if result.failure else ""))
            if time.monotonic() > deadline:
                self._end(Ending.TIMEOUT)
                raise WorldError(f"the world's {self.nproc} ranks did not all join within "
                                 f"{START_TIMEOUT_S:g} s")
            time.sleep(POLL_S)

    def stop(self) -> RunResult | None:
        """Tell every rank to leave and end the run; its RunResult (None if not running)."""
        if self.run is None:
            return None
        for conn in self._conns.values():
            with contextlib.suppress(OSError):
                conn.sendall(b'{"op": "stop"}\n')
        deadline = time.monotonic() + STOP_GRACE_S
        ending = None
        while ending is None and time.monotonic() < deadline:
            ending = self.run.step()
            time.sleep(POLL_S)
        return self._end(ending or Ending.STOPPED)

    def _end(self, reason: Ending) -> RunResult:
        """End the run (every process gone) and forget its connections."""
        run, self.run = self.run, None
        assert run is not None
        self._router.attach(None)
        self._router.early.clear()
        run.state.reason = reason
        try:
            result = run.end()
        finally:
            if self._logs is not None:
                self._logs.close()
            for conn in self._conns.values():
                conn.close()
            if self._listener is not None:
                self._listener.close()
            if self._sock_dir:
                shutil.rmtree(self._sock_dir, ignore_errors=True)
            self._conns.clear()
            self._pids.clear()
            self._buffers.clear()
            _worlds.discard(self)
        self.last_result = result
        return result

    def restart(self, why: str) -> str:
        """End this world and start a new one; the line that says what was lost."""
        lost = sorted({n for names in self._names.values() for n in names})
        if self.run is not None:
            self._end(Ending.STOPPED)
        self._names.clear()
        self.start()
        what = ", ".join(lost) if lost else "no variables had been defined"
        return (f"the world was restarted ({why}): every rank's variables are gone ({what}); "
                "run the cells that define them again")

    # --------------------------------------------------------------------- cells
    def run_cell(self, code: str, ranks: list[int] | None = None, *,
                 display: Display | str | None = None,
                 hang_timeout: float | None = None) -> CellResult:
        """Run code on ranks (default all) and follow it to its end on each of them.

        Raises WorldError when the world is not running, LaunchConfigError for a rank
        outside it, KeyboardInterrupt after an interrupted cell has been settled."""
        if self.run is None:
            raise WorldError("the world is not running: start it with %dist start -n N "
                             "(or labutils.world(nproc=N))")
        seconds = self.hang_timeout if hang_timeout is None else _seconds(hang_timeout)
        chosen = self._ranks(ranks)
        self.seq += 1
        path = runfiles.cell_path(self.run_dir, self.seq)
        path.parent.mkdir(exist_ok=True)
        runfiles.write_atomic(path, code)
        shown = make_display(display or self.display_mode) if not isinstance(display, Display) \
            else display
        cell = _Cell(self, chosen, path, shown, seconds)
        return cell.follow()

    def pull(self, name: str, ranks: list[int] | None = None) -> dict[int, Any]:
        """name's value on each rank (default all), rank -> value. WorldError where a rank
        has no such name or its value cannot be pickled."""
        if self.run is None:
            raise WorldError("the world is not running: start it with %dist start -n N")
        if not isinstance(name, str) or not name.isidentifier():
            raise WorldError(f"pull: expected a variable's name, got {name!r}; e.g. %dist pull loss")
        chosen = self._ranks(ranks)
        replies = self._ask(chosen, {"op": "pull", "seq": -1, "name": name})
        missing = sorted(rank for rank, r in replies.items() if r.get("missing"))
        if missing:
            raise WorldError(f"name {name!r} is not defined on {rank_list(missing)}")
        errors = [r["error"] for _, r in sorted(replies.items()) if r.get("error")]
        if errors:
            raise WorldError(errors[0])
        return {rank: pickle.loads(base64.b64decode(r["value"])) for rank, r in sorted(replies.items())}

    def _ranks(self, ranks: list[int] | None) -> list[int]:
        if ranks is None:
            return list(range(self.nproc))
        if isinstance(ranks, (str, bytes)):
            ranks = [ranks]  # named whole below
        bad = [r for r in ranks if not whole_number(r) or not 0 <= r < self.nproc]
        if bad or not ranks:
            raise LaunchConfigError("ranks", expected=f"ranks between 0 and {self.nproc - 1}",
                                    given=ranks, fix="e.g. %%ranks 0,1")
        return sorted(set(ranks))

    def _ask(self, ranks: list[int], request: dict) -> dict[int, dict]:
        """Send a request that runs no learner code and wait for every reply."""
        self._send(ranks, request)
        replies: dict[int, dict] = {}
        deadline = time.monotonic() + 30
        while len(replies) < len(ranks):
            replies.update(self._receive(POLL_S))
            if time.monotonic() > deadline:
                raise WorldError(f"ranks {sorted(set(ranks) - set(replies))} did not answer")
        return replies

    def _send(self, ranks: list[int], request: dict) -> None:
        data = json.dumps(request).encode() + b"\n"
        for rank in ranks:
            self._conns[rank].sendall(data)

    def _receive(self, timeout: float) -> dict[int, dict]:
        """Replies that arrived within timeout, rank -> reply; a rank whose connection
        closed answers {"gone": True}."""
        replies: dict[int, dict] = {}
        with selectors.DefaultSelector() as sel:
            for rank, conn in self._conns.items():
                sel.register(conn, selectors.EVENT_READ, rank)
            for key, _ in sel.select(timeout):
                rank = key.data
                try:
                    data = key.fileobj.recv(1 << 20)  # type: ignore[union-attr]
                except OSError:
                    data = b""
                if not data:
                    replies[rank] = {"gone": True}
                    continue
                self._buffers[rank] += data
                while b"\n" in self._buffers[rank]:
                    line, self._buffers[rank] = self._buffers[rank].split(b"\n", 1)
                    reply = json.loads(line)
                    if "collectives" in reply:
                        self._collectives[rank] = reply["collectives"]
                    if "names" in reply:
                        self._names[rank] = reply["names"]
                    replies[rank] = reply
        return replies


class _Cell:
    """Following one cell to its end (World.run_cell)."""

    def __init__(self, world: World, ranks: list[int], path: Path, display: Display,
                 hang_timeout: float) -> None:
        self.world, self.ranks, self.path, self.display = world, ranks, path, display
        self.hang_timeout = hang_timeout
        self.replies: dict[int, dict] = {}
        self.hang: Hang | None = None
        self.victims: list[int] = []
        self.read_for_victims = False
        self.world_result: RunResult | None = None  # the world's run, if it ended in the cell
        self.interrupted = ""
        self.ctrl_c = threading.Event()  # set by Ctrl-C while the cell runs (follow())

    @property
    def run(self) -> Run:
        assert self.world.run is not None
        return self.world.run

    def follow(self) -> CellResult:
        world, run = self.world, self.run
        t0 = time.monotonic()
        self.display.start(world_size=world.nproc, log_dir=str(run.run_dir), script=str(self.path))
        world._router.attach(self.display)
        for rank in self.ranks:
            self.display.state(rank, RankStatus.RUNNING)
        run.last_activity = time.monotonic()
        with _interrupts_as_a_flag() as self.ctrl_c:
            world._send(self.ranks, {"op": "cell", "seq": world.seq, "file": str(self.path)})
            self._wait()
            cell = self._settle(time.monotonic() - t0)
        if self.interrupted == Ending.INTERRUPTED:
            raise KeyboardInterrupt(f"cell {cell.seq} interrupted; "
                                    f"{cell.restarted or 'the world kept its state'}")
        return cell

    def _pending(self) -> list[int]:
        return [r for r in self.ranks if r not in self.replies]

    def _wait(self) -> None:
        """Until every rank answered, the world's run ended, a hang, or victims found."""
        last_tick = 0.0
        while self._pending():
            self.replies.update(self.world._receive(POLL_S))
            ending = self.run.step()
            if ending is not None or any(r.get("gone") for r in self.replies.values()):
                self._world_ended(ending)
                return
            now = time.monotonic()
            if now - last_tick >= TICK_S:
                self.display.tick()
                last_tick = now
            if self.ctrl_c.is_set() or self.display.stop_requested.is_set():
                self.interrupted = Ending.INTERRUPTED if self.ctrl_c.is_set() else Ending.STOPPED
                self.display.note(("interrupted" if self.ctrl_c.is_set() else "stop requested")
                                  + ": interrupting the cell on every rank")
                self._interrupt()
                return
            if any(r.debugger for r in self.run.ranks):
                continue  # a rank at a breakpoint: the others wait for it
            silent = now - self.run.last_activity
            if self._raised() and not self.read_for_victims and \
                    silent >= min(VICTIM_WAIT_S, self.hang_timeout):
                self._find_victims(silent)
                if self.victims:
                    return
            if silent >= self.hang_timeout and self._pending():
                self.hang = self.run.read_stacks(silent, script=str(self.path),
                                                 ranks=set(self._pending()))
                idle = [r for r in range(self.world.nproc) if r not in self.ranks]
                if idle and any(self.hang.calls.values()):
                    self.hang.explanation += (
                        f"; {rank_list(idle)} did not run this cell, and a collective waits "
                        "for every rank of its group")
                return
        self.run.read_new()  # the last lines the ranks flushed before answering

    def _raised(self) -> bool:
        """A rank's cell raised (its rank answered, not ok)."""
        return any(not r.get("gone") and not r.get("ok", True) for r in self.replies.values())

    def _find_victims(self, silent: float) -> None:
        """A rank's cell raised and the others have been silent: those waiting in a
        collective are its victims (and stuck there)."""
        self.read_for_victims = True
        stacks = self.run.read_stacks(silent, script=str(self.path), ranks=set(self._pending()))
        stuck = [r for r in self._pending() if stacks.calls.get(r)]
        if stuck and len(stuck) == len(self._pending()):
            self.victims, self.hang = stuck, stacks

    def _interrupt(self) -> None:
        """SIGINT to the ranks still in the cell; their answers, for INTERRUPT_GRACE_S."""
        for rank in self._pending():
            with contextlib.suppress(OSError):
                os.kill(self.world._pids[rank], signal.SIGINT)
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        while self._pending() and time.monotonic() < deadline:
            self.replies.update(self.world._receive(POLL_S))
            ending = self.run.step()
            if ending is not None:
                self._world_ended(ending)
                return
        self.run.read_new()

    def _world_ended(self, ending: Ending | None) -> None:
        """A rank died: the run ends as any run does, with its root cause."""
        deadline = time.monotonic() + STOP_GRACE_S
        while ending is None and time.monotonic() < deadline:
            ending = self.run.step()
            time.sleep(POLL_S)
        self.world_result = self.world._end(ending or Ending.FAILED)

    # ------------------------------------------------------------------ the end
    def _keep(self) -> str:
        """Why the world cannot be kept after this cell ("" when it can)."""
        if self.world_result is not None:
            f = self.world_result.failure
            return f"rank {f.rank} ended" if f else "its run ended"
        if self.victims:
            return f"{_were(self.victims)} stuck in a collective"
        if self.hang is not None:
            return f"{_were(sorted(self.hang.stacks))} stuck"
        if self._pending():
            return (f"{rank_list(self._pending())} did not come back from the interrupt "
                    "(inside a collective)")
        counts = self.world._collectives
        if len(set(counts.values())) > 1:
            seen = ", ".join(f"rank {r}: {c}" for r, c in sorted(counts.items()))
            return (f"the ranks have run different numbers of collectives ({seen}), so "
                    "their next collectives would not match")
        return ""

    def _settle(self, duration: float) -> CellResult:
        world = self.world
        values: dict[int, Any] = {}
        for rank, reply in sorted(self.replies.items()):
            if reply.get("value") is not None:
                values[rank] = pickle.loads(base64.b64decode(reply["value"]))
            elif reply.get("repr") is not None:
                values[rank] = reply["repr"]
        cell = CellResult(seq=world.seq, ranks=self.ranks, values=values)
        why = self._keep()
        cell.result = self._result(duration)
        world._router.attach(None)
        if why:
            cell.restarted = world.restart(why)
            self.display.note(cell.restarted)
        elif self.interrupted:
            self.display.note("every rank came back from the interrupt, and all have run the same "
                              "collectives: the world kept every rank's variables")
        self.display.finish(cell.result)
        return cell

    def _result(self, duration: float) -> RunResult:
        """The cell as a RunResult: every display and summary reads it as a run's."""
        world = self.world
        run_dir = (self.world_result.log_dir if self.world_result else world.run_dir)
        failure: Failure | None = None
        raised = sorted((r for r, rep in self.replies.items() if rep.get("error")
                         and not rep.get("interrupted")),
                        key=lambda r: r)
        states: dict[int, str] = {}
        for rank in self.ranks:
            reply = self.replies.get(rank, {})
            if reply.get("ok"):
                states[rank] = RankStatus.DONE
            elif reply.get("interrupted"):
                states[rank] = RankStatus.KILLED
            elif reply.get("error"):
                states[rank] = RankStatus.FAILED
            elif rank in self.victims:
                states[rank] = RankStatus.KILLED  # stuck with the failed rank: ended by the restart
            elif self.hang is not None and rank in self.hang.stacks:
                states[rank] = RankStatus.HUNG
            else:
                states[rank] = RankStatus.KILLED
        if self.world_result is not None and self.world_result.failure:
            failure = self.world_result.failure
            for r in self.world_result.ranks:
                if r.rank in self.ranks:
                    states[r.rank] = r.state
        elif raised:
            first = raised[0]
            err = self.replies[first]["error"]
            message = err["message"]
            if err["exc_type"] == "SystemExit":  # as a run that exits says (run/crash.py)
                message = after_thread(message, "\n".join(world._router.stderr.get(first, [])) + "\n")
            failure = Failure(rank=first, exc_type=err["exc_type"], message=message,
                              file=err["file"], line=err["line"], traceback=err["traceback"],
                              source=err.get("source", ""), victims=self.victims,
                              also_failed=raised[1:])
        reason = (Ending.FAILED if failure else Ending.HANG if self.hang is not None
                  else Ending(self.interrupted) if self.interrupted else Ending.OK)
        counts = world._router.counts
        ranks = [RankResult(rank=r, state=states[r], pid=world._pids.get(r), log_dir=run_dir,
                            victim=r in self.victims, stdout_lines=counts.get((r, "stdout"), 0),
                            stderr_lines=counts.get((r, "stderr"), 0)) for r in self.ranks]
        return RunResult(ok=reason == Ending.OK, world_size=len(self.ranks), duration_s=duration,
                         log_dir=run_dir, ranks=ranks, failure=failure,
                         hang=self.hang if not self.victims else None, reason=str(reason),
                         script=str(self.path), kind=f"cell {self.world.seq}")


def _seconds(hang_timeout: object) -> float:
    """A cell's hang timeout, checked: seconds >= 0.5 (a world's cells always have one)."""
    if not real_number(hang_timeout) or hang_timeout < 0.5:  # type: ignore[operator]
        raise LaunchConfigError("hang_timeout", expected="seconds >= 0.5", given=hang_timeout,
                                fix="pass e.g. hang_timeout=30 (--hang-timeout 30)")
    return float(hang_timeout)  # type: ignore[arg-type]


@contextlib.contextmanager
def _interrupts_as_a_flag():
    """While a cell runs, Ctrl-C (a kernel's interrupt) sets the flag this yields instead
    of raising KeyboardInterrupt wherever the caller happens to be: the cell's loop
    sees it between two steps and interrupts the ranks, and the run's state is never
    left half-updated. Only in the main thread (signals go there); elsewhere the flag
    is never set."""
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def _were(ranks: list[int]) -> str:
    return f"{rank_list(ranks)} {verb_for(ranks, 'was', 'were')}"


_worlds: set[World] = set()
_current: World | None = None


def current() -> World | None:
    """The world %dist started (or labutils.world()), if any."""
    return _current


def world(nproc: int = 2, **kwargs) -> World:
    """Start a persistent world of nproc ranks (ending the current one) and make it
    the one %%ranks uses; see World for the options."""
    global _current
    if _current is not None:
        _current.stop()
    made = World(nproc, **kwargs)
    _current = made.start()
    return made


def stop_current() -> RunResult | None:
    global _current
    found, _current = _current, None
    return found.stop() if found is not None else None


@atexit.register
def _stop_all() -> None:
    for w in list(_worlds):
        with contextlib.suppress(Exception):
            w._end(Ending.STOPPED)
