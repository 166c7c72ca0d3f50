"""Warm start: a run's torchrun agents forked from a server that has imported torch.

A cold run pays one interpreter start and one ``import torch`` for the torchrun agent
and again for every rank (about a second each on a laptop core), and every DDP rank
another second for ``torch._dynamo``, which DDP's constructor imports. A warm run asks
this caller's server (runtime/server.py), a process started once that has imported
torch, torch._dynamo and the worker bootstrap, to fork the run's keepers; their
torchrun agents start the ranks with torchrun's own function entry point and start
method ``fork``. torchrun still does the rendezvous and starts, watches, stops and
restarts the ranks; the run folder, events, stacks, diagnosis and ownership are those
of a cold run.

Where a warm start does not apply, the run starts cold and says why
(``result.start``, ``result.start_reason``); decide_start() decides for every run of
this machine's agents (a SLURM job's nodes are started by the scheduler, cold:
cluster/slurm_backend.py):

- ``warm=False`` / ``labutils launch --cold``, or LABUTILS_START=cold in the caller's
  environment (every run of a kernel, a class or a test session cold);
- a GPU run (``backend="nccl"``): the course has tested warm starts on CPU only;
- any backend where this machine has a GPU (NVIDIA's driver lists one, or AMD's
  /dev/kfd), the installed torch was built for it (CUDA or ROCm) and the
  *_VISIBLE_DEVICES variables do not hide it: torchrun's agent starts the driver when
  it asks whether CUDA is available, and a rank forked from it then cannot use the GPU
  at all (a cold rank can); a CPU build of torch on such a machine starts warm;
- not Linux (fork, /proc and the subreaper are Linux's);
- the server could not be started (its last words are in the reason).

A server serves one caller (a notebook kernel, a `labutils launch`, a grader's check
process) and dies with it. What a rank reads only when it starts an interpreter or
imports torch (PYTHON*, OMP_*, MKL_*, TORCH_* ..., see import_env) is fixed when its
server starts, so servers are keyed by those variables: a run whose values differ
from every server's gets a server of its own (at most MAX_SERVERS are kept; an idle
one is retired). A server whose torch or labutils files changed on disk since it
started is retired too, and one that died is replaced.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from labutils.run.spec import LaunchSpec
from labutils.runtime import runfiles
from labutils.runtime.procs import pid_alive

MAX_SERVERS = 2
READY_TIMEOUT_S = 120.0  # importing torch on a loaded 2-core machine can take 10 s and more
CALL_TIMEOUT_S = 30.0
# Variables read when an interpreter starts or when torch (and what it loads: OpenMP,
# MKL, OpenBLAS) is imported: a forked rank sees the values its server started with.
IMPORT_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_",
                   "GOTO_", "NUMEXPR_", "CUDA_", "LD_", "MALLOC_")
# ...except these, read when the agent or a process group starts, or read again by the
# worker bootstrap in a forked rank (TORCH_DISTRIBUTED_DEBUG, runtime/worker.py).
READ_AT_RUN = ("TORCHELASTIC_", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "TORCH_DISTRIBUTED_DEBUG",
               "TORCH_NCCL_", "TORCH_GLOO_")
# The launcher's variables of one run: never part of a server's own environment.
PER_RUN = (runfiles.ENV_RUN_DIR, runfiles.ENV_PARENT_PID, runfiles.ENV_AGENT_INDEX,
           runfiles.ENV_LOCAL_AGENT,
           runfiles.ENV_AGENT_PID, runfiles.ENV_NODE, runfiles.ENV_FAULT, runfiles.ENV_BACKEND,
           runfiles.ENV_LINK)


class WarmUnavailable(RuntimeError):
    """No warm server could serve this run; the message is the reason, for result.start_reason."""


@dataclass(frozen=True)
class Start:
    """How a run's agents start: decide_start()'s answer, which the back end, the
    commands and the result (``result.start``, ``.start_reason``, ``.warm_server``) read.

    kind: "warm" or "cold".
    reason: why the run starts cold (None when warm); it means nothing else.
    new_server: a warm run whose server had to be started first, and why (else None).
    server: the warm server that forks the run's keepers (decided with an environment).
    """

    kind: str
    reason: str | None = None
    new_server: str | None = None
    server: Server | None = field(default=None, compare=False, repr=False)

    @property
    def warm(self) -> bool:
        return self.kind == "warm"

    def __str__(self) -> str:
        return f"{self.kind} ({self.reason})" if self.reason else self.kind


def decide_start(spec: LaunchSpec, env: dict[str, str] | None = None) -> Start:
    """Warm or cold, and why: decided here and nowhere else.

    Without env it is the plan, known before anything starts (prepare().request, the
    commands). With env (the run's whole environment) the server is found or started
    too, and a run no server can serve starts cold with the server's last words as
    its reason.
    """
    why = _cold_rule(spec)
    if why is not None:
        return Start("cold", why)
    if env is None:
        return Start("warm")
    try:
        server, note = server_for(env)
    except WarmUnavailable as exc:
        return Start("cold", str(exc))
    return Start("warm", new_server=note, server=server)


def _cold_rule(spec: LaunchSpec) -> str | None:
    """Why this run must start cold whatever the servers can do, or None."""
    if not spec.warm:
        return "warm=False"
    if os.environ.get(runfiles.ENV_START) == "cold":
        return f"{runfiles.ENV_START}=cold"
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return "warm start needs Linux (fork, /proc)"
    if spec.backend == "nccl":
        return "a GPU run starts cold (warm start is tested on CPU only)"
    if ranks_see_a_gpu(spec.env):
        # gloo too: torchrun's agent asks torch.cuda.is_available() (LaunchConfig), which
        # starts the CUDA driver in the agent, and a rank forked from it then fails at its
        # first CUDA call ("Cannot re-initialize CUDA in forked subprocess"): DCP's file
        # writer makes one on torch 2.11, with CPU tensors only
        return ("the ranks can see a GPU: a run that may use CUDA starts cold (a rank forked "
                "from torchrun's agent cannot start CUDA; CUDA_VISIBLE_DEVICES= hides the GPUs)")
    return None


NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
AMD_GPUS = Path("/dev/kfd")  # ROCm's compute device: present where amdgpu drives a GPU
# Where CUDA's and ROCm's runtimes read which GPUs a process may see; empty or -1 hides
# them all (a ROCm build of torch reads CUDA_VISIBLE_DEVICES too).
HIDING = {"cuda": ("CUDA_VISIBLE_DEVICES",),
          "hip": ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")}


def ranks_see_a_gpu(extra: dict[str, str]) -> bool:
    """A GPU on this machine that the run's ranks can use, without importing torch: an
    NVIDIA GPU in its driver's /proc folder with a CUDA build of torch, or an AMD one
    (/dev/kfd) with a ROCm build, and no *_VISIBLE_DEVICES variable, in the run's
    variables or the caller's, empty (or -1), which hides every GPU: the ranks then run
    on CPU as on a machine without one, as they do with a CPU build of torch."""
    builds = torch_gpu_builds()
    for kind, present in (("cuda", _any_entry(NVIDIA_GPUS)), ("hip", AMD_GPUS.exists())):
        if not present or kind not in builds:
            continue
        hidden = False
        for name in HIDING[kind]:
            value = extra.get(name, os.environ.get(name))
            hidden = hidden or (value is not None and value.strip() in ("", "-1"))
        if not hidden:
            return True
    return False


def _any_entry(folder: Path) -> bool:
    try:
        return any(folder.iterdir())
    except OSError:
        return False


def torch_gpu_builds() -> set[str]:
    """Which GPUs the torch the ranks import was built for ("cuda", "hip"), read from
    its torch/version.py without importing it. Where that file cannot be read, both:
    a run that might use a GPU starts cold, which costs time and never a wrong verdict."""
    import importlib.util
    import re

    try:
        spec = importlib.util.find_spec("torch")
        folder = Path(next(iter(spec.submodule_search_locations or ()))) if spec else None
        text = (folder / "version.py").read_text() if folder else ""
    except (OSError, ImportError, StopIteration, ValueError):
        text = ""
    found = dict(re.findall(r"^(cuda|hip)\s*(?::[^=\n]*)?=\s*(.+?)\s*$", text, re.M))
    if set(found) != {"cuda", "hip"}:
        return {"cuda", "hip"}
    return {kind for kind, value in found.items() if value != "None"}


INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"


def import_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of env a forked rank would see with its server's values.

    TORCHINDUCTOR_CACHE_DIR set to torch's own default counts as unset: importing
    torch._dynamo (DDP's constructor does) writes that default into the importing
    process's environment, so a caller that built a DDP model in-process would
    otherwise ask for a second server, identical to the first (the dynamo cache
    directory it fixes at import is the same)."""
    out = {k: v for k, v in env.items()
           if k.startswith(IMPORT_PREFIXES) and not k.startswith(READ_AT_RUN)}
    if out.get(INDUCTOR_CACHE) == inductor_default_cache_dir():
        del out[INDUCTOR_CACHE]
    return out


def inductor_default_cache_dir() -> str:
    """Where torch's inductor and dynamo caches go when TORCHINDUCTOR_CACHE_DIR is unset
    (torch/_inductor/runtime/cache_dir_utils.py, default_cache_dir), without torch."""
    import getpass
    import re

    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def install_stamp() -> int:
    """What changes when torch or labutils is installed again or edited: a hash of the
    name, size and modification time of labutils' modules and torch's version files."""
    import labutils

    files = sorted(Path(labutils.__file__).parent.rglob("*.py"))
    torch_dir = _torch_dir()
    if torch_dir:
        files += [torch_dir / "version.py", torch_dir / "__init__.py"]
    seen = []
    for path in files:
        try:
            st = path.stat()
        except OSError:
            continue
        seen.append((str(path), st.st_size, st.st_mtime_ns))
    return hash(tuple(seen))


def _torch_dir() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("torch")
    return Path(spec.origin).parent if spec and spec.origin else None


def _diff(wanted: dict[str, str], have: dict[str, str]) -> str:
    names = sorted(k for k in set(wanted) | set(have) if wanted.get(k) != have.get(k))
    return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")


class Server:
    """One warm server process and the socket to it."""

    def __init__(self, env: dict[str, str]) -> None:
        self.import_env = import_env(env)
        self.stamp = install_stamp()
        self.lock = threading.Lock()
        self.asked = 0  # the id of the last request sent
        self.keepers: set[int] = set()  # keepers started and not yet seen to end
        self.used = time.monotonic()
        mine, theirs = socket.socketpair()
        # the server's stderr, read if it fails; it lives as long as this object
        self.errors = tempfile.TemporaryFile()  # noqa: SIM115
        env = {k: v for k, v in env.items() if k not in PER_RUN}
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "labutils.runtime.server", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=self.errors, env=env, start_new_session=True)
        finally:
            theirs.close()
        self.sock = mine
        self.reader = mine.makefile("rb")
        self.pid: int | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait until the server answers (torch imported); WarmUnavailable if it dies."""
        if self.pid is not None:
            return
        hello = self._ask({"op": "hello"}, timeout)
        if hello is None or "pid" not in hello:
            raise WarmUnavailable(f"the warm server did not start: {self.last_words()}")
        self.pid = hello["pid"]

    def last_words(self) -> str:
        try:
            self.errors.seek(0)
            lines = self.errors.read().decode(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        return lines[-1] if lines else f"exit code {self.proc.poll()}"

    def _ask(self, request: dict, timeout: float) -> dict | None:
        """Send one request and read until its answer; None, the server closed, when it
        is gone or did not answer within timeout.

        A signal handler may raise (Ctrl-C's KeyboardInterrupt, the CLI's SIGTERM) at
        any point of a call: after the request went out, or after the answer was read
        but before it was returned, its bytes then lost. So answers are matched to
        requests by id: the answer to a cut call is dropped when a later call reads it,
        and a lost one is waited for by no one (counting answers owed instead once
        left a call waiting CALL_TIMEOUT_S for an answer already read)."""
        with self.lock:
            self.asked += 1
            ident = self.asked
            try:
                self.sock.sendall(json.dumps({**request, "id": ident}).encode() + b"\n")
            except OSError:
                self.close()
                return None
            deadline = time.monotonic() + timeout
            while True:
                line = self._readline(deadline - time.monotonic())
                if not line:
                    self.close()
                    return None
                try:
                    answer = json.loads(line)
                except ValueError:
                    continue  # the rest of a line whose start a cut read lost
                if isinstance(answer, dict) and answer.pop("id", None) == ident:
                    return answer

    def _readline(self, timeout: float) -> bytes:
        """One line from the server; b"" when it is gone or timeout ran out."""
        if timeout <= 0:
            return b""
        try:  # a socket already closed (an interrupted call closed it) is a server gone too
            self.sock.settimeout(timeout)
            return self.reader.readline()
        except (OSError, ValueError):
            return b""

    def call(self, request: dict) -> dict:
        """One request and its answer; WarmUnavailable when the server is gone."""
        self.ready()
        reply = self._ask(request, CALL_TIMEOUT_S)
        if reply is None:
            raise WarmUnavailable(f"the warm server is gone: {self.last_words()}")
        if "error" in reply:
            raise WarmUnavailable(f"the warm server refused: {reply['error']}")
        return reply

    def start(self, argv: list[str], env: dict[str, str], log_path: Path) -> Keeper:
        self.ready()
        env = {**env, runfiles.ENV_PARENT_PID: str(self.pid)}  # the keeper's starter
        reply = self.call({"op": "start", "argv": argv, "env": env, "cwd": os.getcwd(),
                           "log": str(log_path)})
        self.used = time.monotonic()
        self.keepers.add(reply["pid"])
        return Keeper(self, reply["pid"], argv)

    def busy(self) -> bool:
        return bool(self.keepers)

    def close(self) -> None:
        """End the server (its idle state has nothing to save); closing the socket is
        enough, the kill makes sure."""
        for f in (self.reader, self.sock):
            try:
                f.close()
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class Keeper:
    """A keeper forked by a server: what LocalAgents needs of a subprocess.Popen."""

    def __init__(self, server: Server, pid: int, args: list[str]) -> None:
        self.server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self.server.call({"op": "poll", "pid": self.pid})["code"]
            except WarmUnavailable:
                # Its server is gone, and with it the keeper, which ends its tree.
                self.returncode = None if pid_alive(self.pid) else -signal.SIGKILL
            if self.returncode is not None:
                self.server.keepers.discard(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, cast(float, timeout))  # deadline set
            time.sleep(0.01)
        return cast(int, self.returncode)  # poll() returned it

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass


_servers: list[Server] = []
_owner = os.getpid()
_lock = threading.Lock()


def server_for(env: dict[str, str]) -> tuple[Server, str | None]:
    """This caller's server for a run with environment env, started if needed; and a
    note when a server had to be started. WarmUnavailable when none can serve."""
    global _owner
    with _lock:
        if _owner != os.getpid():  # a forked copy of the caller: its servers are not ours
            _servers.clear()
            _owner = os.getpid()
        wanted, stamp = import_env(env), install_stamp()
        note = None
        for server in list(_servers):
            if not server.alive():
                _servers.remove(server)
                note = "a new warm server (the last one was gone)"
            elif server.stamp != stamp and not server.busy():
                _servers.remove(server)
                server.close()
                note = "a new warm server (torch or labutils changed on disk)"
        for server in _servers:
            if server.import_env == wanted and server.stamp == stamp:
                server.used = time.monotonic()
                return server, None
        idle = sorted((s for s in _servers if not s.busy()), key=lambda s: s.used)
        while len(_servers) >= MAX_SERVERS and idle:
            old = idle.pop(0)
            _servers.remove(old)
            old.close()
        if note is None:
            note = "a new warm server" + (
                f" ({_diff(wanted, _servers[0].import_env)} differ from the other's)"
                if _servers else "")
        server = Server(env)
        _servers.append(server)
    try:
        server.ready()
    except WarmUnavailable:
        with _lock:
            if server in _servers:
                _servers.remove(server)
        raise
    return server, note


def prestart(env: dict[str, str] | None = None) -> None:
    """Start a server in the background for runs of several ranks (OMP_NUM_THREADS=1,
    as the launcher sets it), so a kernel's first run is warm too. Never raises."""
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        with _lock:
            if any(s.import_env == import_env(env) for s in _servers):
                return
            if len(_servers) < MAX_SERVERS:
                _servers.append(Server(env))
    except OSError:
        pass


def servers() -> list[Server]:
    """This caller's servers (for tests and the benchmark)."""
    return list(_servers)


@atexit.register
def _close_all() -> None:
    if _owner == os.getpid():
        for server in _servers:
            try:
                server.close()
            except OSError:
                pass
