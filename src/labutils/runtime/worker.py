"""Worker bootstrap: runs the learner's script, unchanged, inside one rank.

torchrun starts ``python -m labutils.runtime.worker SCRIPT ARGS...`` once per rank. Before
the script's first line runs, the bootstrap

- arranges to be killed if the torchrun agent dies (no orphaned ranks);
- sends fd 1 and fd 2 to rank<R>/stdout.log and stderr.log in the run folder, so
  each rank's output is complete on disk and never mixed with another rank's,
  C-level output (gloo, faulthandler) included;
- registers a faulthandler dump on SIGUSR1, so the launcher can read every rank's
  Python stack even while the rank is blocked inside a collective;
- starts a progress watcher that writes a ``progress`` event whenever the main
  thread moved (its stack changed or it used CPU), the signal the hang detector
  reads;
- routes breakpoint() and torch.distributed.breakpoint() to a debugger the learner
  reaches from the notebook or a terminal (runtime/debugger.py);
- runs the script as ``__main__`` and turns an uncaught exception into an
  ``exception`` event (type, message, file:line, traceback without these
  bootstrap frames), printing the same traceback to stderr as Python would;
- writes an ``exit`` event (its code, and for sys.exit() the line) when the script
  ends itself, and ends the process without the interpreter's teardown (finish());
  a forked rank of a warm run leaves its process at once too (finish_forked()).
How a rank ended that could write nothing (a signal, os._exit()) its agent records
(runtime/agent.py).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import io
import itertools
import os
import runpy
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping
from types import FrameType
from typing import Any, TextIO

from labutils.runtime import debugger, runfiles
from labutils.runtime.frames import caught_elsewhere, dump_thread, is_bootstrap, learners_frame
from labutils.runtime.procs import die_with_parent

STACK_SIGNAL = signal.SIGUSR1
# Signals whose handlers a forked rank inherits from torchrun's agent and resets to what
# a fresh interpreter has (fresh_start; SIGINT too, to Python's KeyboardInterrupt).
INHERITED_HANDLERS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                      signal.SIGUSR2, signal.SIGALRM, signal.SIGCHLD)
PROGRESS_INTERVAL_S = 0.5
# The main thread counts as progressing when it used at least this share of one core.
_CPU_PROGRESS_SHARE = 0.05

_IO_BASE = io.IOBase.__mro__[1]  # _io._IOBase: the C class every file object derives from
# What must outlive main(): the files faulthandler writes to, and the script's objects
# (run_as_main keeps them).
_keep_alive: list = []


def _redirect_fd(fd: int, path: os.PathLike) -> None:
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, fd)
    os.close(target)


class _MainStack:
    """Where the main thread is, read from the progress watcher's thread: its stack as
    faulthandler writes it.

    Not with sys._current_frames() and f_back: walking another thread's frame objects
    from Python crashed a rank with SIGSEGV in PyFrame_GetBack, its main thread deep in
    torch.compile's tracing (Python 3.11.7, torch 2.13, 2026-12-01; samplers that walk
    frames so crash on 3.11 too). faulthandler reads the interpreter's frames in C,
    makes no frame objects and holds the GIL throughout, so the main thread cannot run
    while they are read."""

    def __init__(self, main_ident: int) -> None:
        self.main_ident = main_ident
        # faulthandler writes to a descriptor: one in memory, else an unnamed file; both
        # stay open while the watcher looks (close())
        try:
            self.file = open(os.memfd_create("labutils-stack", os.MFD_CLOEXEC), "w+b", buffering=0)  # noqa: SIM115
        except (AttributeError, OSError):
            self.file = tempfile.TemporaryFile(buffering=0)  # noqa: SIM115

    def signature(self) -> str | None:
        """The main thread's stack now (None once it has ended)."""
        self.file.seek(0)
        self.file.truncate()
        faulthandler.dump_traceback(file=self.file, all_threads=True)
        self.file.seek(0)
        return dump_thread(self.file.read().decode("utf-8", "replace"), self.main_ident)

    def close(self) -> None:
        self.file.close()


class _StackRequests:
    """Stack dumps asked for through the run folder (stack-request.json), for ranks a
    launcher cannot signal: those of another machine in a multi-node job."""

    def __init__(self, run_dir: str | None, rank: int, stacks) -> None:
        self.path = runfiles.stack_request_path(run_dir) if run_dir else None
        self.rank, self.stacks = rank, stacks
        self.mtime = self._mtime()  # requests made before this rank started are old

    def _mtime(self) -> float | None:
        try:
            return self.path.stat().st_mtime_ns if self.path else None
        except OSError:
            return None

    def check(self) -> None:
        mtime = self._mtime()
        if mtime is None or mtime == self.mtime:
            return
        self.mtime = mtime
        try:
            import json

            ranks = json.loads(self.path.read_text()).get("ranks", [])  # type: ignore[union-attr]
        except (OSError, ValueError, AttributeError):
            return
        if self.rank in ranks and self.stacks is not None:
            faulthandler.dump_traceback(file=self.stacks, all_threads=True)
            self.stacks.flush()


def _watch_progress(writer: runfiles.EventWriter, main_ident: int,
                    requests: _StackRequests | None = None) -> None:
    """Write a progress event each interval in which the main thread moved; answer
    stack requests made through the run folder."""
    try:
        clock = time.pthread_getcpuclockid(main_ident)
        cpu_now = lambda: time.clock_gettime(clock)  # noqa: E731
    except (AttributeError, OSError):
        cpu_now = lambda: 0.0  # noqa: E731 - stack changes alone then signal progress
    main = _MainStack(main_ident)
    last_sig, last_cpu = None, cpu_now()
    while True:
        time.sleep(PROGRESS_INTERVAL_S)
        if requests is not None:
            requests.check()
        sig = main.signature()
        if sig is None:  # the main thread has ended (its CPU clock with it)
            main.close()
            return
        cpu = cpu_now()
        if sig != last_sig or cpu - last_cpu > _CPU_PROGRESS_SHARE * PROGRESS_INTERVAL_S:
            writer.write({"kind": "progress", "t": time.time()})
        last_sig, last_cpu = sig, cpu


def describe_exception(exc: BaseException, script: str) -> dict:
    """The facts of an uncaught exception, with the bootstrap's frames removed."""
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    frames = list(te.stack)
    while frames and is_bootstrap(frames[0].filename):
        frames.pop(0)
    te.stack = traceback.StackSummary.from_list(frames)
    mine = learners_frame([f.filename for f in frames], script)
    where = frames[mine] if mine is not None else frames[-1] if frames else None
    if isinstance(exc, SyntaxError) and where is None:
        file, line = exc.filename, exc.lineno
    else:
        file, line = (where.filename, where.lineno) if where else (None, None)
    exc_type, source = type(exc).__name__, (where.line or "").strip() if where else ""
    message = text_of(exc) or ("the debugger was quit (q)" if exc_type == "BdbQuit" else "")
    caught = caught_elsewhere(message)
    if caught is not None:
        # raised in a DataLoader worker: the learner's line is in that process's
        # traceback (their Dataset), unless only library code ran there
        exc_type = caught.exc_type
        message = f"{caught.message} ({caught.where})" if caught.message else caught.where
        inner = learners_frame([f[0] for f in caught.frames], script)
        if inner is not None:
            file, line, source = caught.frames[inner]
    return {
        "exc_type": exc_type,
        "message": message,
        "file": file,
        "line": line,
        "source": source,
        # Paths shortened as a learner reads them; "file" stays absolute for tools.
        "traceback": runfiles.shorten_traceback_paths("".join(te.format())),
    }


def text_of(obj: object) -> str:
    """str(obj), for an exception of the script or the value it passed to sys.exit(): a
    __str__ of the learner's that raises must not end the report (the rank would end
    with no exception event, and the peer it left behind would be blamed)."""
    try:
        return str(obj)
    except Exception as err:  # noqa: BLE001 - any error of the learner's __str__
        return f"<{type(obj).__name__}: its __str__ raised {type(err).__name__}>"


def _exit_code(exc: SystemExit) -> int:
    """The exit status a SystemExit gives the process: sys.exit(-1) ends it with 255, as
    the agent then reaps it (the operating system keeps the low 8 bits)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    write_stderr(text_of(exc.code) + "\n")
    return 1


def rendezvous_round(environ: Mapping[str, str]) -> str:
    """Which rendezvous round (attempt) a rank's start belongs to, the same for every rank
    of the round: its MASTER_ADDR:MASTER_PORT. With a store per round (launch() sets
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) torchrun picks a fresh port each round. With
    the agent's store shared by every round (TORCHELASTIC_USE_AGENT_STORE=True: a run
    given TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0) the port stays, and the restart count
    tells the rounds apart; each agent counts its own restarts, so across agents a
    membership change may read as two rounds."""
    where = f"{environ.get('MASTER_ADDR', '')}:{environ.get('MASTER_PORT', '')}"
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return f"{where} restart {environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return where


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    agent = os.environ.get(runfiles.ENV_AGENT_PID)
    die_with_parent(int(agent) if agent else None)
    if not argv:
        print("usage: python -m labutils.runtime.worker SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    script, script_args = argv[0], argv[1:]
    run_dir = os.environ.get(runfiles.ENV_RUN_DIR)
    rank = int(os.environ.get("RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    writer = runfiles.event_writer()

    stacks = ended = None
    if run_dir:
        runfiles.rank_dir(run_dir, rank).mkdir(parents=True, exist_ok=True)
        sys.stdout.flush(), sys.stderr.flush()
        _redirect_fd(1, runfiles.stream_path(run_dir, rank, "stdout"))
        _redirect_fd(2, runfiles.stream_path(run_dir, rank, "stderr"))
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        stacks = open(runfiles.stacks_path(run_dir, rank), "a")  # noqa: SIM115 - must stay open
        _keep_alive.append(stacks)
        faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True, chain=False)
        ended = _dump_on_sigterm(runfiles.ended_stacks_path(run_dir, rank))
    faulthandler.enable(file=sys.stderr, all_threads=True)

    main_ident = threading.main_thread().ident
    if writer is not None:
        writer.write({
            "kind": "start", "t": time.time(), "pid": os.getpid(), "main_tid": main_ident,
            "restart": restart, "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "host": os.uname().nodename,
            "round": rendezvous_round(os.environ),
            "agent": int(os.environ.get(runfiles.ENV_AGENT_INDEX, "0")),
            "group_rank": int(os.environ.get("GROUP_RANK", "0")),
            "node": os.environ.get(runfiles.ENV_NODE, ""),
        })
        threading.Thread(
            target=_watch_progress, name="labutils-progress", daemon=True,
            args=(writer, main_ident, _StackRequests(run_dir, rank, stacks)),
        ).start()

    debugger.install(rank, writer)  # breakpoint() reaches the learner's console
    sys.argv = [script, *script_args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    raised = run_script(script)
    with _sigterm_after_the_report(ended):
        return _report(raised, script, writer, restart)


def _report(raised: BaseException | None, script: str, writer, restart: int) -> int:
    """Write how the script ended (exception and exit events, the traceback on
    stderr); the rank's exit code."""
    code, where = 0, {}
    if isinstance(raised, SystemExit):
        code = _exit_code(raised)
        info = describe_exception(raised, script)  # where the script ended itself
        where = {k: info[k] for k in ("file", "line", "source")}
        if raised.code is not None and not isinstance(raised.code, int):
            where["message"] = text_of(raised.code)  # sys.exit("why"): printed, exit code 1
    elif raised is not None:  # report every way the script can die
        info = describe_exception(raised, script)
        if writer is not None:
            writer.write({"kind": "exception", "t": time.time(), "restart": restart, **info})
        write_stderr(info["traceback"])
        code = 130 if isinstance(raised, KeyboardInterrupt) else 1
    flush_streams()
    if writer is not None:
        writer.write({"kind": "exit", "t": time.time(), "code": code, "restart": restart,
                      **where})
    return code


def _dump_on_sigterm(path) -> TextIO:
    """When SIGTERM ends this rank (torchrun ending the peers of a failed rank, a Stop, a
    timeout), faulthandler writes its stacks to path first, then the default action
    ends the process as before (exit status -15). The launcher reads where the rank was
    waiting: two ranks that waited in different collectives are a mismatch, even when
    only one of them timed out before torchrun stopped the other. A process the script
    forks (a DataLoader worker) does not inherit it: its stacks are not the rank's."""
    ended = open(path, "a")  # noqa: SIM115 - must stay open for faulthandler
    _keep_alive.append(ended)
    faulthandler.register(signal.SIGTERM, file=ended, all_threads=True, chain=True)
    os.register_at_fork(after_in_child=lambda: faulthandler.unregister(signal.SIGTERM))
    return ended


@contextlib.contextmanager
def _sigterm_after_the_report(ended: TextIO | None):
    """Hold a SIGTERM that comes while the rank reports how its script ended, and end
    the rank with it once the report is written.

    Where a rank was when it was stopped is its exception's line when it raised
    (run/outcome.py positions_at_stop). A rank whose peer on another node was stopped
    a moment earlier raises in its collective ("Connection closed by peer"), and its
    own node's SIGTERM comes tens of milliseconds later: on a loaded machine, while the
    bootstrap still formats the traceback. Ended there, it left no exception event,
    and its SIGTERM stacks showed only the bootstrap: "where each rank was" lost it.
    The report takes milliseconds; the keeper's SIGKILL still ends a rank whose report
    would not end."""
    if ended is None:  # no run folder: nothing reads the stacks or the events
        yield
        return
    held: list[int] = []
    faulthandler.unregister(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if held:  # ended by it, as it would have been (exit status -15)
            flush_streams()
            signal.raise_signal(signal.SIGTERM)
        faulthandler.register(signal.SIGTERM, file=ended, all_threads=True, chain=True)


def run_script(script: str) -> BaseException | None:
    """Run the script as __main__; the exception it ended with (SystemExit included),
    or None.

    A signal handler the script installed can still raise once the script is over:
    torch's DataLoader raises from SIGCHLD when one of its workers has died, as often
    after its own check already raised for the same worker. Raised into this
    bootstrap while it reports, it would end the rank with no exception event and a
    half-written report. So the script's handlers are taken off before anything else
    runs, and an exception they raise meanwhile counts only when the script raised
    none itself; one they raise while the script's own exception unwinds, outside the
    script's frames, gives way to that exception (its __context__).
    """
    raised: BaseException | None = None
    try:
        run_as_main(script)
    except BaseException as exc:  # noqa: BLE001 - every way the script can end
        raised = exc
    while True:
        try:
            _script_handlers_off()
            break
        except BaseException as late:  # noqa: BLE001 - a handler that fired meanwhile
            raised = raised or late
    # only now: SIGCHLD once fired while the exception was read here (a 4-rank cold
    # run of the endings table's DataLoader worker killed, named an exit, not its line)
    return scripts_own_exception(raised, script) if raised is not None else None


def run_as_main(script: str) -> None:
    """Run the script as __main__ (runpy) and keep its objects until the process ends,
    as `python script.py` keeps its globals until the interpreter's teardown (which a
    rank skips: finish()); an exception it raises, whose traceback holds them, too.

    Dropped when the script returns, a DDP model would free its Reducer, and with it
    gloo's process group after dist.destroy_process_group(), in the main thread holding
    the GIL: gloo's destructor joins its worker threads while one of them, freeing the
    last all-reduce of the backward pass, waits for the GIL to free the Python object
    that work's thread-local state holds (the autograd context), and the rank never
    exits (5 of 12 warm 4-rank runs of lab 08's solution on a loaded machine, 2026-11-26).
    """
    try:
        _keep_alive.append(runpy.run_path(script, run_name="__main__"))
    except BaseException as exc:
        _keep_alive.append(exc)
        raise


def scripts_own_exception(exc: BaseException, script: str) -> BaseException:
    """exc, or the exception it interrupted when exc was raised outside the script's
    frames (a signal handler firing while the script's own exception unwound)."""
    script_abs = os.path.abspath(script)

    def in_script(e: BaseException) -> bool:
        tb = e.__traceback__
        while tb is not None:
            if os.path.abspath(tb.tb_frame.f_code.co_filename) == script_abs:
                return True
            tb = tb.tb_next
        return False

    seen: BaseException | None = exc
    while seen is not None and not in_script(seen):
        seen = seen.__context__
    return seen if seen is not None else exc


def _script_handlers_off() -> None:
    """Every Python signal handler back to what a fresh interpreter has."""
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                          else signal.SIG_DFL)


def _wind_down() -> None:
    """What matters of a normal exit, in order: wait for the script's non-daemon
    threads, run its atexit handlers, flush every open file."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    # Files the script left open: write their buffers. Found by their types' MRO (every
    # file object derives from io's C base): issubclass(type, io.IOBase) goes through the
    # ABC machinery, 60 ms for the ~500 types of a rank that imported torch, and
    # isinstance reads __class__, which some objects warn about.
    objects = gc.get_objects()
    types = list(map(type, objects))
    file_types = {t for t in set(types) if _IO_BASE in t.__mro__}
    for obj in itertools.compress(objects, map(file_types.__contains__, types)):
        try:
            if not obj.closed and obj.writable():
                obj.flush()
        except Exception:  # noqa: BLE001 - a broken file must not stop the exit
            pass
    flush_streams()


def flush_streams() -> None:
    """Flush sys.stdout and sys.stderr as the script left them: it may have closed
    them or set them to None, which `python script.py` allows (its exit status is
    still 0): a rank must not fail for it."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def write_stderr(text: str) -> None:
    """Write text to sys.stderr, or straight to file descriptor 2 (the rank's
    stderr.log) when the script closed sys.stderr or replaced it with None."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - whatever the script left in sys.stderr
        with contextlib.suppress(OSError):
            os.write(2, text.encode(errors="backslashreplace"))


def finish(code: int) -> None:
    """End this rank's process with `code`, skipping the interpreter's teardown.

    The script has run and its exit event is written. Python's finalization, and
    C++ static destructors after it, then tear down gloo's threads and whatever
    the script left behind in an order nobody controls; a rank whose script ended
    fine, dist.destroy_process_group() included, occasionally died there with
    SIGABRT ("terminate called without an active exception": 2 of about 75 runs
    of lesson 05's training script on gloo, always after the script's last line).
    So do what matters of a normal exit (_wind_down) and leave with os._exit().
    """
    try:
        _wind_down()
    finally:
        os._exit(code)


def forked_rank() -> bool:
    """This rank is a fork of a warm run's torchrun agent (runtime/server.py): it runs
    inside torchrun's function entry point, a multiprocessing child. Nothing is decided
    here: the agent's command, made from run/warm.py's decide_start(), chose the entry
    point, and this reads which one ran."""
    mp = sys.modules.get("multiprocessing")
    return mp is not None and mp.parent_process() is not None


def fresh_start() -> None:
    """Undo in a forked rank what it inherited that a fresh interpreter has not.

    The signal handlers torchrun's agent installed (SIGTERM would raise an exception
    in the script instead of ending the rank), a blocked signal mask, the server's and
    the agent's weakref finalizers and multiprocessing identity (this rank is a main
    process, as in a cold run), the random, numpy.random and torch default generators
    (seeded from the OS at import, they would be the server's), and TORCH_DISTRIBUTED_DEBUG, which torch reads when
    torch.distributed is imported (the server imported it before the run's variables
    were set). stdout and stderr are already unbuffered: the server runs with -u, as
    torchrun runs a cold rank.
    """
    import multiprocessing.process as mp_process
    import weakref

    for sig in INHERITED_HANDLERS:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # The agent forked this rank with these signals blocked (agent.hold_signals_across_fork):
    # one that came since is delivered now, to the handler a cold rank would have.
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    # multiprocessing's and weakref's private state: what a fresh interpreter starts with
    for finalizer in list(weakref.finalize._registry):  # type: ignore[attr-defined]
        finalizer.detach()
    me: Any = mp_process.current_process()  # made what a main process's own object is
    me._config = {"authkey": mp_process.AuthenticationString(os.urandom(32)),  # type: ignore[attr-defined]
                  "semprefix": "/mp"}
    me._name, me._identity, me._parent_pid, me._parent_name = "MainProcess", (), None, None
    mp_state: Any = mp_process
    mp_state._parent_process = None
    mp_state._children = set()
    # Random state seeded from the OS when a module was imported would otherwise be the
    # server's, the same in every rank and every run: seed it afresh, as an import would.
    import random

    random.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "seed"):
        torch.seed()  # torch seeds its default generator from the OS when it starts
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and hasattr(distributed, "set_debug_level_from_env"):
        distributed.set_debug_level_from_env()


def finish_forked(code: int) -> None:
    """End a forked rank as a cold rank ends: _wind_down, then leave the process.

    A non-zero code leaves through SystemExit(code). A rank whose script ended well
    must end its process too, at once: torchrun's function entry point would keep it
    alive (it waits in an event until every rank has returned), and with it the
    rank's sockets, so that peers still waiting in a collective for it would hang
    instead of failing as they do in a cold run. So the rank hands torchrun the
    script's return value (None) itself and exits (_return_and_exit)."""
    _wind_down()
    atexit._clear()
    if code:
        raise SystemExit(code)
    _return_and_exit()


def _return_and_exit() -> None:
    """Put this rank's return value where torchrun's agent reads it (the queue of its
    function entry point's wrapper, torch.distributed.elastic.multiprocessing.api._wrap)
    and end the process; return into the entry point as before when that wrapper is
    not on the stack (another torch)."""
    frame: FrameType | None = sys._getframe()
    while frame is not None and not (frame.f_code.co_name == "_wrap"
                                     and "ret_val_" in frame.f_locals):
        frame = frame.f_back
    if frame is None:
        return
    frame.f_locals["ret_val_"].put(None)  # what run_script_path returns
    flush_streams()
    os._exit(0)


if __name__ == "__main__":
    if forked_rank():
        fresh_start()
        finish_forked(main())
    else:
        finish(main())
