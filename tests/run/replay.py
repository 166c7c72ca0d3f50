"""A fake back end for the follow loop: it starts no process and replays a run folder
recorded from a real run (tests/data/recorded/NAME), as torch elastic tests its agent with
scripted worker states instead of processes.

    python tests/run/replay.py        re-records every ending of the endings table
                                      (after a change to tests/scripts/endings.py)

A recording holds what the agents and ranks wrote: rank<R>/events.jsonl, stdout.log,
stderr.log and ended-stacks.txt, the agents' ended-*.jsonl and agent.log, and
recording.json (the ending, how the run started, world size, failing rank, the agent's
exit code). This checkout's path is replaced by /home/learner/course, a learner's, in
every file.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

from labutils.run.backends import LocalAgents
from labutils.run.spec import LaunchSpec
from labutils.run.warm import Start
from labutils.runtime.procs import Claim

REPO = Path(__file__).resolve().parents[2]
RECORDINGS = REPO / "tests" / "data" / "recorded"
LEARNER = "/home/learner/course"
FILES = ("rank*/events.jsonl", "rank*/stdout.log", "rank*/stderr.log", "rank*/ended-stacks.txt",
         "ended-*.jsonl", "agent.log")


class ReplayAgents(LocalAgents):
    """LocalAgents whose agents have already run: start() writes the recorded files
    into the run folder, and the agents are over, with the recorded exit code."""

    def __init__(self, spec: LaunchSpec, run_dir: Path, recording: Path) -> None:
        super().__init__(spec, run_dir, "", port=Claim(0, None), run_id="replay")
        self.run_dir, self.recording = run_dir, recording
        self.meta = json.loads((recording / "recording.json").read_text())
        self.startup = Start(self.meta["start"], self.meta.get("start_reason"))
        self.stopped: list[tuple[list[int], str]] = []

    def start(self, env: dict[str, str], logs: contextlib.ExitStack, note) -> None:
        for pattern in FILES:
            for path in self.recording.glob(pattern):
                target = self.run_dir / path.relative_to(self.recording)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)

    def any_alive(self) -> bool:
        return False

    def host_alive(self) -> bool:
        return False

    def exit_codes(self) -> list[int | None]:
        return [self.meta["agent_exit_code"]]

    @property
    def exit_code(self) -> int | None:
        return self.meta["agent_exit_code"]

    def rank_alive(self, r) -> bool:
        return False  # recorded pids are no processes of this run: never signal them

    def stop(self, ranks: list[int], reason: str, note, *, again: bool = False) -> None:
        self.stopped.append((ranks, reason))


def record(how: str, start: str, nproc: int, failing: int, out: Path) -> None:
    """Run one ending for real and keep its run folder as a recording."""
    from endings_table import SCRIPT

    from labutils import launch

    # the ranks' temporary folder is one of its own, as in test_endings.py: a DataLoader
    # worker killed after it sent a batch leaves its multiprocessing folder (pymp-*)
    with tempfile.TemporaryDirectory(prefix="endings-") as tmp:
        result = launch(SCRIPT, nproc=nproc, args=[how, str(failing)], display="none",
                        hang_timeout=4 if how == "stuck" else 30, timeout=90, log_dir=out.parent / ".tmp",
                        warm=start == "warm", env={"TMPDIR": tmp})
    keep(result, out, how=how, start=start, nproc=nproc, failing=failing)


def keep(result, out: Path, **meta) -> None:
    """A run's folder kept as a recording in out, with recording.json (meta and how the
    run started and ended), this checkout's path made a learner's."""
    shutil.rmtree(out, ignore_errors=True)
    for pattern in FILES:
        for path in Path(result.log_dir).glob(pattern):
            target = out / path.relative_to(result.log_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(path.read_text(errors="replace").replace(str(REPO), LEARNER))
    (out / "recording.json").write_text(json.dumps({
        **meta, "start_reason": result.start_reason,
        "agent_exit_code": result.agent_exit_code}, indent=1) + "\n")
    shutil.rmtree(out.parent / ".tmp", ignore_errors=True)


INCIDENTS = REPO / "tests" / "data" / "incidents"
FOREVER = REPO / "tests" / "scripts" / "forever.py"


def record_store_lost(out: Path, *, nproc: int = 2, store_s: float = 6.0) -> None:
    """A run whose torchrun agent joined another program's rendezvous store and lost it:
    what a run did before agent 0 was told it hosts its store (runtime/procs.py says how
    two launchers drew one port). A TCPStore of another process holds the port; the
    agent, not told it hosts the store, finds the port taken and joins that store as a
    client; the store's process ends after store_s, and the agent with it, having ended
    every rank (tests/scripts/forever.py) with SIGTERM. Kept as a recording: today's
    launcher never starts a run this way."""
    import subprocess

    from labutils import launch
    from labutils.run import backends, follow
    from labutils.runtime.procs import claim_port

    port = claim_port()
    store = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from torch.distributed import TCPStore; "
         "s = TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, multi_tenant=True, "
         "wait_for_workers=False); print('up', flush=True); time.sleep(float(sys.argv[2]))",
         str(port.port), str(store_s)], stdout=subprocess.PIPE, text=True)
    assert store.stdout is not None and store.stdout.readline().strip() == "up"
    real = backends.torchrun_command

    def unsaid(spec, **kw):  # the command as it was: is_host left to torchrun's guess
        command = real(spec, **kw)
        at = command.index("--rdzv-conf")
        conf = ",".join(kv for kv in command[at + 1].split(",") if not kv.startswith("is_host="))
        return command[:at] + (["--rdzv-conf", conf] if conf else []) + command[at + 2:]

    backends.torchrun_command = unsaid
    follow.claim_port = lambda host="127.0.0.1": port  # type: ignore[assignment]
    try:
        result = launch(FOREVER, nproc=nproc, display="none", hang_timeout=None, timeout=60,
                        log_dir=out.parent / ".tmp", warm=False)
    finally:
        backends.torchrun_command, follow.claim_port = real, claim_port
        store.wait()
    keep(result, out, how="store_lost", start="cold", nproc=nproc, failing=-1)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    from endings_table import ENDINGS

    for how in ENDINGS:
        if how == "stuck":
            continue  # a hang needs live ranks to read stacks from
        for start in ("warm", "cold"):
            record(how, start, 2, 1, RECORDINGS / f"{how}-{start}")
            print(how, start, flush=True)
