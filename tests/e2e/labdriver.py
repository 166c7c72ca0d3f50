"""A real JupyterLab server and headless Chromium, driven the way a learner uses them.

start_lab() starts ``jupyter lab`` from this environment on a free localhost port
with token auth, in its own folder with its own Jupyter config, data and
settings (nothing from the user's ~/.jupyter leaks in). open_browser() starts
Debian's chromium through Playwright (never a downloaded browser). NotebookPage
clicks and types in a notebook as a person would: select a cell, press
Ctrl+Enter, read what the page shows.

Everything waits by polling for a condition with a deadline, never by sleeping
a fixed time: the tests run on busy 2-core machines.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from labutils.runtime.procs import free_port, pid_alive

CHROMIUM = os.environ.get("LABUTILS_E2E_CHROMIUM", "/usr/bin/chromium")
# Headless, and nothing that reaches the network or the user's profile.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
VIEWPORT = {"width": 1400, "height": 1000}

# JupyterLab settings for the test server: every cell stays in the page (no
# windowing), and no news or update popup covers the notebook.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False},
}


CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _enter(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns: could not enter a network namespace")


def network_of(pid: int | str = "thread-self") -> int:
    """The inode of a process's network namespace (the calling thread's by default)."""
    return os.stat(f"/proc/{pid}/ns/net").st_ino


@dataclass
class Network:
    """own_network()'s namespace: private is False where none could be made."""

    private: bool
    outer: int  # an fd of the namespace the thread was in

    @contextlib.contextmanager
    def outside(self):
        """This thread back in the outer namespace for a while (to make a virtual
        cluster's interfaces where other tests make theirs)."""
        inner = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            _enter(self.outer)
            try:
                yield
            finally:
                _enter(inner)
        finally:
            os.close(inner)


@contextlib.contextmanager
def own_network():
    """This thread, and every process it starts meanwhile (JupyterLab, its kernels and
    their runs, Playwright's driver and Chromium), in a network namespace of its own with
    only a loopback interface; back in the one it was in at the end.

    Chromium ends the requests it has in flight with ERR_NETWORK_CHANGED whenever an
    address of its namespace comes or goes, as host 0 of every virtual cluster does in
    its caller's namespace (test_multinode.py and test_cluster.py, beside this file in
    the parallel pass: a page waited 120 s for its stylesheet, twice in about 12 runs).
    In a namespace of its own no other test's interface is seen. Without the privilege
    to make one (not root) the tests run in the caller's: no virtual cluster can be made
    beside them then either, as that needs root too."""
    outer = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        if _libc.unshare(CLONE_NEWNET) != 0:
            yield Network(private=False, outer=outer)
            return
        try:
            subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
            yield Network(private=True, outer=outer)
        finally:
            _enter(outer)
    finally:
        os.close(outer)


def wait_for(condition, *, timeout: float, what: str, interval: float = 0.2):
    """Poll condition() until it returns something true; return it, or fail saying what."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}")
        time.sleep(interval)


@dataclass
class Lab:
    """A running JupyterLab server: its address, token, folder, process and log."""

    root: Path
    port: int
    token: str
    proc: subprocess.Popen
    log_path: Path
    runs_dir: Path
    _workspaces: int = field(default=0)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def notebook_url(self, notebook: str) -> str:
        """The notebook in a workspace of its own, never used before, so pages never restore
        each other's tabs. (No ?reset: a new workspace has nothing to reset, and JupyterLab
        answers a reset it is already doing by reloading the page, which aborts what the
        page was loading. Suspected, not shown, in one failure under the suite's load: the
        theme's stylesheet failed to load and the page never showed a kernel.)"""
        self._workspaces += 1
        return (f"{self.base}/lab/workspaces/e2e{self._workspaces}/tree/{notebook}"
                f"?token={self.token}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def run_processes(self) -> list[int]:
        """pids of the keepers, torchrun agents and ranks the server's kernels have
        started: cold, by their command lines; warm, the processes a kernel's warm
        server forked (they carry the server's command line), not the server itself."""
        import psutil

        found = []
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                cmd = " ".join(child.cmdline())
                parent = " ".join(child.parent().cmdline())
            except (psutil.Error, AttributeError):
                continue
            if "labutils.runtime.agent" in cmd or "labutils.runtime.worker" in cmd or \
                    "labutils.runtime.server" in parent:
                found.append(child.pid)
        return found

    def rank_pids(self, run_dir: Path) -> dict[int, int]:
        """rank -> pid from a run folder's start events."""
        pids = {}
        for events in sorted(run_dir.glob("rank*/events.jsonl")):
            for line in events.read_text().splitlines():
                event = json.loads(line)
                if event.get("kind") == "start":
                    pids[int(events.parent.name[4:])] = event["pid"]
        return pids

    def newest_run(self, script_stem: str) -> Path:
        runs = sorted(self.runs_dir.glob(f"*{script_stem}*"), key=lambda p: p.stat().st_mtime)
        assert runs, f"no run folder of {script_stem} in {self.runs_dir}"
        return runs[-1]


def start_lab(root: Path, state: Path) -> Lab:
    """Start ``jupyter lab`` serving ``root``; its Jupyter dirs and log go under ``state``."""
    dirs = {name: state / name for name in ("config", "data", "runtime", "settings", "workspaces")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    for name, values in LAB_SETTINGS.items():
        path = dirs["settings"] / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port, token = free_port(), secrets.token_hex(16)
    runs_dir = root / "runs"
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(dirs["config"]),
           "JUPYTER_DATA_DIR": str(dirs["data"]), "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
           "LABUTILS_RUNS_DIR": str(runs_dir), "PYTHONUNBUFFERED": "1"}
    env.pop("LABUTILS_DISPLAY", None)  # the display must choose widgets by itself
    command = [
        sys.executable, "-m", "jupyterlab", "--no-browser",
        "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
        f"--LabApp.user_settings_dir={dirs['settings']}",
        f"--LabApp.workspaces_dir={dirs['workspaces']}",
        "--LabApp.news_url=", "--LabApp.extension_manager=readonly",
        "--ServerApp.terminals_enabled=False",
    ]
    if os.geteuid() == 0:  # containers and CI runners often run as root
        command.append("--allow-root")
    log_path = state / "jupyterlab.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, cwd=root, env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    lab = Lab(root=root, port=port, token=token, proc=proc, log_path=log_path, runs_dir=runs_dir)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"jupyter lab exited with {proc.returncode}:\n{lab.log_tail()}")
        try:
            with urllib.request.urlopen(f"{lab.base}/api/status?token={token}", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        wait_for(ready, timeout=120, what="jupyter lab to answer /api/status")
    except BaseException:
        stop_lab(lab)
        raise
    return lab


def stop_lab(lab: Lab) -> None:
    """Stop the server (it shuts its kernels down), then anything of it still alive."""
    import psutil

    try:
        family = [p.pid for p in psutil.Process(lab.proc.pid).children(recursive=True)]
    except psutil.Error:
        family = []
    if lab.proc.poll() is None:
        lab.proc.send_signal(signal.SIGTERM)
        try:
            lab.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(lab.proc.pid, signal.SIGKILL)
            lab.proc.wait()
    for pid in family:  # kernels run in their own sessions: make sure they are gone
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def open_browser(playwright):
    """Debian's chromium, headless; a clear failure when it or Playwright is missing."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} not found: the browser tests need Debian's chromium. Install it "
                    "with scripts/install-system-deps.sh (`make test` does), or point "
                    "LABUTILS_E2E_CHROMIUM at a chromium binary.", pytrace=False)
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS,
                                      timeout=120_000)


class NotebookPage:
    """One notebook open in JupyterLab in a browser page."""

    def __init__(self, page, lab: Lab, notebook: str) -> None:
        self.page = page
        self.lab = lab
        self.notebook = notebook
        self.failed_requests: list[str] = []  # said when the page never gets ready
        page.on("requestfailed", lambda r: self.failed_requests.append(f"{r.url}: {r.failure}"))

    def open(self) -> NotebookPage:
        self.page.goto(self.lab.notebook_url(self.notebook), timeout=120_000)
        self.page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for(timeout=120_000)
        self.wait_kernel_idle(timeout=120)
        return self

    @property
    def panel(self):
        return self.page.locator(".jp-NotebookPanel:visible")

    def kernel_status(self) -> str:
        """The kernel status JupyterLab shows, e.g. "Python 3 (ipykernel) | Idle"."""
        status = self.page.locator(".jp-StatusBar-Widget .jp-StatusBar-TextItem",
                                   has_text=re.compile(r"\| (Idle|Busy|Starting|Connecting|"
                                                       r"Unknown|Restarting)"))
        return status.first.inner_text() if status.count() else ""

    def wait_kernel_idle(self, *, timeout: float) -> None:
        try:
            wait_for(lambda: self.kernel_status().endswith("Idle"), timeout=timeout,
                     what=f"an idle kernel for {self.notebook}")
        except AssertionError as exc:
            failed = "\n".join(self.failed_requests[-10:]) or "none"
            raise AssertionError(f"{exc} (status now: {self.kernel_status()!r}; requests that "
                                 f"failed: {failed}; server log:\n{self.lab.log_tail()})") from None

    def cell(self, index: int):
        return self.panel.locator(".jp-Notebook .jp-Cell").nth(index)

    def prompt(self, index: int) -> str:
        return self.cell(index).locator(".jp-InputPrompt").first.inner_text().strip()

    def busy(self, index: int) -> bool:
        """The cell is queued or running: JupyterLab shows [*]."""
        return "*" in self.prompt(index)

    def run(self, index: int) -> None:
        """Select the cell (command mode) and run it in place with Ctrl+Enter."""
        self.cell(index).locator(".jp-InputPrompt").first.click()
        self.page.keyboard.press("Control+Enter")
        wait_for(lambda: self.busy(index) or re.fullmatch(r"\[\d+\]:", self.prompt(index)),
                 timeout=30, what=f"cell {index} to start")

    def wait_finished(self, index: int, *, timeout: float) -> None:
        wait_for(lambda: re.fullmatch(r"\[\d+\]:", self.prompt(index)), timeout=timeout,
                 what=f"cell {index} to finish (prompt {self.prompt(index)!r})")

    def screenshot(self, index: int, path: Path) -> Path:
        """A picture of the cell, input and output."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.cell(index).screenshot(path=str(path), timeout=60_000)
        return path


class RunView:
    """The live display of one launch() in a cell's output, as the page shows it."""

    def __init__(self, cell) -> None:
        self.cell = cell
        self.root = cell.locator(".labutils-run")
        self.panes = cell.locator(".labutils-pane")
        self.stop = cell.locator("button.labutils-stop")
        self.summary = cell.locator(".labutils-result")
        self.notes = cell.locator(".labutils-notes")

    def count(self) -> int:
        return self.panes.count()

    def head(self, rank: int) -> str:
        return self.panes.nth(rank).locator(".labutils-pane-head").inner_text()

    def body(self, rank: int) -> str:
        return self.panes.nth(rank).locator(".labutils-pane-body").inner_text()

    def lines(self, rank: int) -> list[str]:
        return [ln for ln in self.body(rank).splitlines() if ln.strip()]

    def state(self, rank: int) -> str:
        """The state badge: the word after "rank N"."""
        match = re.match(r"rank \d+\s+(\w+)", self.head(rank))
        return match.group(1) if match else ""

    def states(self) -> list[str]:
        return [self.state(r) for r in range(self.count())]

    def progress(self, rank: int) -> tuple[int, int] | None:
        """(done, total) from the rank's progress label, None while it has no bar."""
        label = self.panes.nth(rank).locator(".labutils-progress-label")
        if not label.count():
            return None
        match = re.match(r"(\d+)/(\d+)", label.inner_text())
        return (int(match.group(1)), int(match.group(2))) if match else None

    def bar_width(self, rank: int) -> float:
        """How full the rank's bar is drawn, 0..1 (the bar element's width)."""
        bar = self.panes.nth(rank).locator(".labutils-progress")
        return bar.evaluate(
            "el => { const b = el.querySelector('.progress-bar');"
            " return b.getBoundingClientRect().width / el.querySelector('.progress')"
            ".getBoundingClientRect().width; }")
