"""Process plumbing: die with the parent, find free ports, stop process trees.

Kept free of heavy imports: the worker bootstrap and the agent wrapper call
die_with_parent() before anything else.
"""

from __future__ import annotations

import ctypes
import errno
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Iterable
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
# How a run owns every process it starts (RunResult.ownership): "subreaper" where the
# kernel lets the agent's keeper adopt whatever its descendants orphan (Linux >= 3.4),
# else "process-tree" (the launcher stops the tree it can see; a double-forked daemon
# may escape).
OWNERSHIP_SUBREAPER = "subreaper"
OWNERSHIP_TREE = "process-tree"


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def make_undumpable() -> None:
    """Processes of the same user can no longer read this one's memory or open its file
    descriptors through /proc (PR_SET_DUMPABLE 0): what the grader keeps secret stays so."""
    _prctl(_PR_SET_DUMPABLE, 0)


def become_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (a double-forked daemon, the
    children of a rank that died), so that it can end them: True where the kernel can."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def ownership_mode() -> str:
    """How the agents' keepers will own their trees on this machine (see OWNERSHIP_*)."""
    return OWNERSHIP_SUBREAPER if sys.platform.startswith("linux") and os.path.isdir(
        "/proc/self") else OWNERSHIP_TREE


def _proc_table() -> list[tuple[int, int, bool]]:
    """(pid, parent pid, is a zombie) of every process, read from /proc."""
    table = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table.append((int(entry), int(fields[1]), fields[0] in (b"Z", b"X")))
    return table


def tree(root: int) -> list[int]:
    """Every live descendant of root, read from /proc (no psutil: the keeper uses it).

    The walk goes through zombies: a multi-threaded process (a torchrun agent) whose
    main thread has exited shows as a zombie while its other threads finish, and its
    children keep it as their parent until the last thread is gone; they are still
    descendants to end. Zombies themselves are not listed: they are already dead.
    """
    children_of: dict[int, list[tuple[int, bool]]] = {}
    for pid, ppid, dead in _proc_table():
        children_of.setdefault(ppid, []).append((pid, dead))
    found, todo = [], [root]
    while todo:
        for child, dead in children_of.get(todo.pop(), []):
            if not dead:
                found.append(child)
            todo.append(child)
    return found


def children(pid: int) -> list[int]:
    """pid's child processes, zombies included: those its wait has not collected yet."""
    return [child for child, ppid, _ in _proc_table() if ppid == pid]


def carrying(name: str, value: str) -> list[int]:
    """Processes (other than this one) whose environment, as they were started, holds
    name=value: how the processes of one run, or one graded submission, are found
    wherever they were re-parented (Linux; empty elsewhere)."""
    needle = f"{name}={value}".encode()
    found: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def die_with_parent(expected_parent: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux only).

    The parent may already be gone by the time we ask; then exit at once, since
    the signal would never come. Elsewhere this is a no-op: the launcher's own
    stop still reaches every process it started.
    """
    if not _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL):
        return
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(137)


class Claim:
    """A number (a port, a user id) claimed against every other labutils process on this
    machine until release(), or until this object is gone.

    The claim is an abstract Unix socket named after the number: the kernel refuses a
    second bind of the name, frees it when its holder dies, and keeps one such namespace
    per network namespace, as it keeps one TCP port space; any user may hold one (a
    grader's submissions run as users of their own).

    A port is checked free when it is drawn but bound only later, by a torchrun agent
    that starts in a second or, cold on a loaded machine, in ten. Two launchers that
    drew the same port in that window once made two runs of the test suite share one
    rendezvous store: the second agent, finding the port taken, became a client of the
    first run's store (torchrun falls back to that when it guesses is_host), and its
    ranks were all ended with SIGTERM when the first run ended and took its store along
    (2026-11-30: a segfault ending reported as rank 0's SIGTERM).
    """

    def __init__(self, value: int, sock: socket.socket | None) -> None:
        self.value = value
        self._sock = sock

    @property
    def port(self) -> int:
        return self.value

    def release(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __del__(self) -> None:
        self.release()

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Claim({self.value}{'' if self._sock is not None else ', released'})"


def claim(kind: str, value: int) -> Claim | None:
    """The claim on `value` of `kind` ("port", "uid"), or None if another process (or
    this one) holds it. Where abstract sockets do not exist (not Linux), an unheld claim."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"\0labutils-{kind}-{value}")
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        return Claim(value, None)
    return Claim(value, sock)


def claim_port(host: str = "127.0.0.1") -> Claim:
    """A TCP port free on every address here, for a store that binds them all, and
    claimed (Claim) until its holder releases it.

    The rendezvous store listens on the wildcard address, so a port that is free on
    `host` alone is not enough: a listener on another address (gloo's, a kernel's) with
    the same port makes the store's bind fail. The port is drawn below the kernel's
    ephemeral range, where the ports that other programs bind to port 0 and their
    outgoing connections come from, so none of them takes it between this check and
    the store's bind; another labutils launcher's draw is kept off by the claim. `host`
    is kept for callers that name the address the store serves; the check covers it.
    Never 29500 by habit.
    """
    low, _ = _ephemeral_range()
    for _ in range(64 if low > 2048 else 0):
        port = random.randrange(max(1024, low - 12000), low)
        if _bindable(port, host) and (held := claim("port", port)) is not None:
            if _bindable(port, host):  # bound by someone between the check and the claim
                return held
            held.release()
    for _ in range(16):  # all taken: the OS picks
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
            if (held := claim("port", port)) is not None:
                return held
    raise OSError(errno.EADDRINUSE, "no free TCP port could be claimed on this machine")


# free_port() keeps its claims for the process's life, the oldest let go past this many
# (its callers want a number: a test's server, a world of one); a run holds its own.
_KEPT = 32
_kept: list[Claim] = []


def free_port(host: str = "127.0.0.1") -> int:
    """claim_port()'s port, its claim kept by this process (the last few dozen)."""
    held = claim_port(host)
    _kept.append(held)
    while len(_kept) > _KEPT:
        _kept.pop(0).release()
    return held.port


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int, host: str) -> bool:
    for address in ("", host):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address, port))
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:  # not an address here: nothing to clash
                    return False
    return True


def pid_alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False




def signal_all(pids: Iterable[int], sig: int) -> None:
    """Send sig to each process and to the group it leads (a rank leads its own)."""
    for pid in pids:
        try:
            os.killpg(pid, sig)  # workers lead their own session: reach their children too
        except OSError:
            pass
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def stop_processes(pids: Iterable[int], *, grace_s: float = 2.0) -> list[int]:
    """Two-stage stop: SIGTERM to every process (and its group), wait, then SIGKILL.

    Args:
        pids: the processes to stop.
        grace_s: how long they may take after SIGTERM before SIGKILL.

    Returns the pids that were still alive when SIGKILL was sent.
    """
    pids = [p for p in dict.fromkeys(pids) if p and p > 1 and p != os.getpid()]
    signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in pids):
            return []
        time.sleep(0.02)
    stubborn = [p for p in pids if pid_alive(p)]
    signal_all(stubborn, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and any(pid_alive(p) for p in stubborn):
        time.sleep(0.02)
    return stubborn
