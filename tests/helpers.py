"""What tests share: the repository's folders, and talking to a real kernel.

Tests import these (`from helpers import REPO, SCRIPTS`); tests/conftest.py holds only
fixtures and pytest's hooks. tests/ mirrors src/labutils: tests/run for labutils.run,
tests/notebook, tests/cluster, tests/course, tests/grading, tests/runtime, and
tests/curriculum for the lessons' own modules and scripts.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
SCRIPTS = TESTS / "scripts"  # small scripts the launcher tests run
DATA = TESTS / "data"  # recorded events, stderr and run folders
LESSONS = REPO / "lessons"


def this_python_kernel(tmp_path, name: str):
    """A KernelManager for an ipykernel on this Python, through a kernelspec in tmp_path
    (not started; the caller starts it, or hands it to nbclient)."""
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    spec_dir = tmp_path / "kernels" / name
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": name, "language": "python",
    }))
    return KernelManager(kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")]),
                         kernel_name=name)


def iopub_until(kc, found, *, timeout: float):
    """Read iopub messages until found(msg) is true; return that message."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:  # queue.Empty
            continue
        if found(msg):
            return msg
    raise AssertionError(f"nothing matched on iopub within {timeout} s")


def execute_reply(kc, msg_id: str, *, timeout: float) -> dict:
    """The shell reply to one execute request."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            reply = kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:  # queue.Empty
            continue
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply
    raise AssertionError(f"no reply within {timeout} s")


def autocast_problem():
    """Lesson 06's autocast cell: its Linear, input and operations (linear, x, ops); each
    op takes the Linear's output, on whatever device it is."""
    import torch

    F = torch.nn.functional
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 16)
    x, y = torch.randn(16, 16), torch.randint(0, 16, (16,))
    ops = {"softmax": lambda h: torch.softmax(h, dim=-1), "sum": lambda h: h.sum(),
           "log_softmax": lambda h: torch.log_softmax(h, dim=-1),
           "layer_norm": lambda h: F.layer_norm(h, h.shape[-1:]),
           "cross_entropy": lambda h: F.cross_entropy(h, y.to(h.device)),
           "mse_loss": lambda h: F.mse_loss(h, torch.zeros_like(h)), "prod": lambda h: h.prod(),
           "linalg.inv": lambda h: torch.linalg.inv(h), "fft.rfft": lambda h: torch.fft.rfft(h)}
    return linear, x, ops


def process_table() -> dict[tuple[int, int], tuple[int, float, str]]:
    """Every process now: {(pid, start tick): (parent pid, CPU seconds, name)}."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name, fields = text.split("(", 1)[1].rsplit(")", 1)[0], text.rsplit(")", 1)[1].split()
        out[int(entry), int(fields[19])] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, name)
    return out


class OtherLoad:
    """CPU seconds taken by processes that are not ``root`` or under it, sampled every
    ``every`` seconds by a thread: what else kept the machine busy while ``root`` ran
    (a neighbour, a process left behind by an earlier pass). A process once seen under
    ``root``, or whose environment holds ``token``, stays ours wherever it hangs later
    (a warm server and its ranks are re-parented outside the tree when their caller
    ends). A process that starts and ends between two samples is missed."""

    def __init__(self, root: int, every: float = 1.0, token: bytes | None = None) -> None:
        import threading

        self.root, self.every, self.token = root, every, token
        self.ours: dict[tuple[int, int], bool] = {}  # by (pid, start time): token seen
        self.mine: set[tuple[int, int]] = set()  # seen under root or with the token once
        self.commands: dict[tuple[int, int], str] = {}  # command line when first seen
        self.seen: dict[tuple[int, int], float] = {}  # CPU when first seen (0 if started later)
        self.last: dict[tuple[int, int], tuple[float, str]] = {}
        self.stop = threading.Event()
        self.watching = False
        self.sample()
        self.watching = True
        self.thread = threading.Thread(target=self.run, daemon=True, name="other-load")
        self.thread.start()

    def run(self) -> None:
        while not self.stop.wait(self.every):
            self.sample()

    def sample(self) -> None:
        table = process_table()
        parent = {pid: ppid for (pid, _), (ppid, _, _) in table.items()}
        for key, (_, cpu, name) in table.items():
            pid = key[0]
            while pid > 1 and pid != self.root:
                pid = parent.get(pid, 0)
            if pid == self.root or key in self.mine or self._has_token(key):
                # ours for good: a process of ours orphaned when its caller ends (a warm
                # server, its ranks) is re-parented outside the tree but stays ours
                self.mine.add(key)
                continue
            self.seen.setdefault(key, cpu if not self.watching else 0.0)
            self.last[key] = (cpu, name)
            if key not in self.commands:
                try:
                    raw = Path(f"/proc/{key[0]}/cmdline").read_bytes()
                    self.commands[key] = raw.replace(b"\0", b" ").decode(errors="replace").strip()[:100]
                except OSError:
                    self.commands[key] = ""

    def _has_token(self, key: tuple[int, int]) -> bool:
        if self.token is None:
            return False
        if key not in self.ours:
            try:
                with open(f"/proc/{key[0]}/environ", "rb") as f:
                    self.ours[key] = self.token in f.read().split(b"\0")
            except OSError:
                return False  # gone, or not ours to read: asked again next time
        return self.ours[key]

    def finish(self) -> list[tuple[str, float]]:
        """[(name, CPU seconds since watching began)] of the other processes, largest first."""
        self.stop.set()
        self.thread.join()
        self.sample()
        by_name: dict[str, float] = {}
        for key, (cpu, name) in self.last.items():
            by_name[name] = by_name.get(name, 0.0) + cpu - self.seen[key]
        return sorted(((n, s) for n, s in by_name.items() if s > 0), key=lambda item: -item[1])

    def busiest(self) -> tuple[str, float] | None:
        """The other process that took the most CPU (after finish()): its command line, CPU-s."""
        spent = {key: cpu - self.seen[key] for key, (cpu, _) in self.last.items()}
        key = max(spent, key=spent.get, default=None)
        if key is None or spent[key] <= 0:
            return None
        # a kernel thread has no command line: its name then
        return self.commands.get(key) or f"[{self.last[key][1]}]", spent[key]


def stop_once(ready, *, after_s: float = 1.0):
    """A Display that presses Stop after_s seconds after ready(display) first holds,
    checked at each line the ranks print and each tick. display.started: the ranks that
    printed "started" (tests/scripts/waits_for_a_flag.py's ranks, then in their waits);
    display.notes: what the launcher said."""
    import threading

    from labutils.run.display import Display

    class StopOnce(Display):
        def __init__(self) -> None:
            super().__init__()
            self.started: set[int] = set()
            self.notes: list[str] = []
            self.armed = False

        def lines(self, rank, stream, lines):
            self.started |= {rank for line in lines if line == "started"}
            self.tick()

        def tick(self):
            if not self.armed and ready(self):
                self.armed = True
                threading.Timer(after_s, self.stop_requested.set).start()

        def note(self, text):
            self.notes.append(text)

    return StopOnce()


# What runs of the launcher (and torch under it) would leave in the temporary folder if
# something ended badly: a rank's debugger socket folder, a persistent world's, torch's
# error file of a function entry point whose bootstrap raised, torchrun's default log
# folder, multiprocessing's folder of a rank's DataLoader.
LEFT_BEHIND_PREFIXES = ("labutils-debug-", "labutils-world-", "pytorch-errorfile-",
                        "torchelastic_", "pymp-")


def left_behind(since: float, folder: str | None = None) -> list[str]:
    """Entries of the temporary folder named as LEFT_BEHIND_PREFIXES, made or changed
    since the time ``since``."""
    folder = folder or tempfile.gettempdir()
    found = []
    for entry in os.scandir(folder):
        try:
            if entry.name.startswith(LEFT_BEHIND_PREFIXES) \
                    and entry.stat(follow_symlinks=False).st_mtime >= since - 1:
                found.append(entry.path)
        except OSError:  # gone meanwhile
            continue
    return sorted(found)
