"""Entry point of a torchrun agent: a keeper process that owns everything below it.

The launcher starts ``python -m labutils.runtime.agent <torchrun args>`` instead of
``python -m torch.distributed.run``. This process is the *keeper*: it makes itself
the subreaper of its tree (every process its descendants orphan, a rank's child or
a double-forked daemon in a new session, is re-parented to it instead of to init),
forks, and the child runs torch.distributed.run's own main, unchanged: the torchrun
agent, which starts, watches, stops and restarts the ranks.

The keeper then only waits. When the agent exits, when it is asked to stop
(SIGTERM, SIGINT or SIGHUP: the launcher's stop) or when the process that started
it dies (it is re-parented: a kernel killed with -9, a CLI killed), it ends every
process left in its tree (SIGTERM, then SIGKILL after a grace period) and exits
the way the agent did; when its starter died, it also removes what that caller
would have (a persistent world's socket folder). So a run leaves nothing behind in
any ending short of a SIGKILL of the keeper itself; the ranks also die with the
agent, and the agent with the keeper (see worker.py), so even then no rank
outlives it.

The keeper imports only the standard library and labutils.runtime, and forks
before any thread exists: forking a single-threaded process is safe.

The agent (the keeper's child) records how each rank it reaps ended, exit code or
signal, and when (record_endings): torchrun's own log names only the first rank that
failed when the ranks are forked (a warm run), and a rank that dies of a signal or
of os._exit() writes nothing itself.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time

from labutils.runtime.procs import become_subreaper, children, die_with_parent, tree
from labutils.runtime.runfiles import (
    ENV_AGENT_PID,
    ENV_PARENT_PID,
    ENV_RUN_DIR,
    ENV_WORLD_SOCKET,
    WORLD_SOCKET_PREFIX,
    EventWriter,
    endings_path,
    remove_socket_folder,
)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
WATCHED = {signal.SIGCHLD, *STOP_SIGNALS}
PARENT_CHECK_S = 0.1   # how often the keeper looks whether its starter is still there
AGENT_GRACE_S = 2.0    # after a stop: how long the agent may wind its ranks down
TREE_GRACE_S = 1.0     # then: how long what is left may take after SIGTERM


def record_endings(run_dir: str) -> None:
    """Append {"host", "pid", "code", "t"} to this agent's endings file each time it
    reaps a process it started: a rank, cold (subprocess.Popen) or warm (a forked
    multiprocessing child). Both classes are patched in this process only; a forked
    rank inherits the patch, and the pid check keeps its own children (DataLoader
    workers) out of the file."""
    import multiprocessing.popen_fork as popen_fork
    import subprocess

    agent, host = os.getpid(), os.uname().nodename
    writer = EventWriter(endings_path(run_dir, host, agent))

    def ended(pid: int, code: int | None) -> None:
        if code is not None and os.getpid() == agent:
            writer.write({"host": host, "pid": pid, "code": code, "t": time.time()})

    handle_exitstatus = subprocess.Popen._handle_exitstatus  # type: ignore[attr-defined]

    def _handle_exitstatus(self, sts, *args, **kwargs):
        handle_exitstatus(self, sts, *args, **kwargs)
        ended(self.pid, self.returncode)

    fork_poll = popen_fork.Popen.poll

    def poll(self, flag=os.WNOHANG):
        before = self.returncode
        code = fork_poll(self, flag)
        if before is None:
            ended(self.pid, code)
        return code

    subprocess.Popen._handle_exitstatus = _handle_exitstatus  # type: ignore[attr-defined]
    popen_fork.Popen.poll = poll  # type: ignore[method-assign]


def hold_signals_across_fork() -> None:
    """Fork this agent's ranks (a warm run) with the signals torchrun's handlers catch
    blocked; the rank unblocks them once it has reset those handlers (worker.fresh_start).

    torchrun's agent handles SIGTERM, SIGINT, SIGHUP and SIGQUIT by raising an exception,
    and a forked rank keeps those handlers until its bootstrap resets them. A rank
    stopped in that moment (Stop or a timeout just as the ranks start, the agent ending
    its ranks while it still forks the last) raised torch's SignalException in torch's
    own frames and exited 1, and torch left an error file in the temporary folder; a
    cold rank stopped as it starts dies of the signal. Blocked, the signal waits and
    comes once the rank has the handlers a cold rank has: it dies of it, as a cold rank
    does. Forks of other processes (a rank's DataLoader workers) are left alone."""
    from labutils.runtime.worker import INHERITED_HANDLERS

    agent, held = os.getpid(), {*INHERITED_HANDLERS, signal.SIGINT}
    masks: list[set[int]] = []

    def before() -> None:
        if os.getpid() == agent:
            masks.append(signal.pthread_sigmask(signal.SIG_BLOCK, held))

    def after_in_parent() -> None:
        if os.getpid() == agent and masks:
            signal.pthread_sigmask(signal.SIG_SETMASK, masks.pop())

    os.register_at_fork(before=before, after_in_parent=after_in_parent,
                        after_in_child=masks.clear)


def name_rendezvous_events_cheaply() -> None:
    """torch's dynamic rendezvous names each event it records after the method that
    recorded it, found with inspect.stack(), twice per event: that builds a frame record
    for every frame of the stack, each of which looks up its source file by walking
    sys.modules. With the ~2,000 modules a warm agent inherits (torch._dynamo
    included), one name took about 10 ms, and an agent records a dozen events or more
    per rendezvous. The same name is read from the frame itself."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    if not callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        return   # a torch without it

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:   # the stack is not that deep
            return "no_method_name"

    dynamic_rendezvous.get_method_name = get_method_name


def run_agent(argv: list[str], keeper: int) -> None:
    """The keeper's child: torchrun's agent in this (forked) interpreter."""
    die_with_parent(keeper)
    os.environ[ENV_AGENT_PID] = str(os.getpid())
    if os.environ.get(ENV_RUN_DIR):
        record_endings(os.environ[ENV_RUN_DIR])
    if "--start-method=fork" in argv or ("--start-method", "fork") in zip(argv, argv[1:]):
        hold_signals_across_fork()  # the ranks are forks of this process (a warm run)
    sys.argv = ["torchrun", *argv]
    name_rendezvous_events_cheaply()
    # what the torchrun command runs (its console script); a warm server imported the
    # module already, a cold agent imports it here
    importlib.import_module("torch.distributed.run").main(argv)
    sys.exit(0)


def _reap(agent: int) -> int | None:
    """Collect every exited child (adopted orphans too); the agent's wait status if it
    was among them."""
    status = None
    while True:
        try:
            pid, code = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == agent:
            status = code


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _unrecorded(agent: int, pids: set[int]) -> set[int]:
    """Those of pids the agent's endings file does not list yet (none where the run
    keeps no such file)."""
    run_dir = os.environ.get(ENV_RUN_DIR)
    if not run_dir or not pids:
        return set()
    try:
        with open(endings_path(run_dir, os.uname().nodename, agent), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return pids
    seen = set()
    for line in lines:
        try:
            seen.add(int(json.loads(line)["pid"]))
        except (ValueError, KeyError, TypeError):
            continue
    return pids - seen


def end_tree(agent: int, *, stopping: bool) -> int | None:
    """End every process below this one; the agent's wait status if it was reaped here.

    Each process gets one SIGTERM, never a second: a rank writes its stacks as SIGTERM
    ends it (worker._dump_on_sigterm), and a second SIGTERM while it writes ends it
    there, its stacks cut short or not written (faulthandler's handler, chained to the
    default action, lets the signal in again). When stopping (the agent may still run),
    the agent gets its SIGTERM first, with everything outside its tree, and ends its
    ranks itself (torchrun's close: one SIGTERM each, then it collects them and records
    how each ended, record_endings: what a launcher following the run folder from
    another machine reads); after AGENT_GRACE_S at most the agent gets SIGKILL: it would
    only wind down a rendezvous nobody needs. Then whatever is left gets its SIGTERM,
    and what is still there TREE_GRACE_S later (a rank's child that ignores it, a
    daemon) SIGKILL until nothing is left; processes forked meanwhile are found on the
    next pass.
    """
    me, status, start = os.getpid(), None, time.monotonic()
    ranks = set(children(agent))
    termed: set[int] = set()

    def terminate(pids: list[int]) -> None:
        fresh = [pid for pid in pids if pid not in termed]
        termed.update(fresh)
        _signal(fresh, signal.SIGTERM)

    if stopping:
        under_agent = set(tree(agent))
        terminate([pid for pid in tree(me) if pid not in under_agent])  # the agent among them
        while time.monotonic() - start < AGENT_GRACE_S:
            status = _reap(agent) if status is None else status
            if status is not None or (not children(agent) and not _unrecorded(agent, ranks)):
                break
            time.sleep(0.02)
        if status is None:
            _signal([agent], signal.SIGKILL)
    start = time.monotonic()
    for sig, until in ((signal.SIGTERM, TREE_GRACE_S), (signal.SIGKILL, TREE_GRACE_S + 5.0)):
        while True:
            status = _reap(agent) if status is None else status
            left = tree(me)
            if not left or time.monotonic() - start >= until:
                break
            if sig == signal.SIGTERM:
                terminate(left)
            else:
                _signal(left, sig)
            time.sleep(0.02)
        if not left:
            break
    return _reap(agent) if status is None else status


def remove_world_socket() -> None:
    """Remove the folder of a persistent world's socket, which its caller (now gone: a
    kernel killed or restarted) would have removed when the world ended."""
    remove_socket_folder(os.environ.get(ENV_WORLD_SOCKET), WORLD_SOCKET_PREFIX)


def _exit_like(status: int | None, stop_signal: int | None) -> None:
    """Leave with the agent's exit status: its code, or death by its signal."""
    if status is not None and os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    sig = os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) \
        else (stop_signal or signal.SIGKILL)
    if sig != signal.SIGKILL:  # SIGKILL has no handler to reset (signal() refuses it)
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    starter = os.getppid()
    if os.environ.get(ENV_PARENT_PID, str(starter)) != str(starter):
        os._exit(137)  # the launcher that started this is already gone
    become_subreaper()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
    keeper = os.getpid()
    agent = os.fork()
    if agent == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        run_agent(argv, keeper)
    status, stop = None, None
    while status is None:
        info = signal.sigtimedwait(WATCHED, PARENT_CHECK_S)
        status = _reap(agent)
        if status is not None:
            break
        if info is not None and info.si_signo in STOP_SIGNALS:
            stop = info.si_signo
        elif os.getppid() != starter:
            stop = signal.SIGTERM  # the launcher died: end the run it cannot end
        if stop is not None:
            break
    reaped = end_tree(agent, stopping=stop is not None)
    if os.getppid() != starter:
        remove_world_socket()
    _exit_like(status if status is not None else reaped, stop)


if __name__ == "__main__":
    main()
