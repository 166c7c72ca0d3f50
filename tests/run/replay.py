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
from labutils.runtime.procs import PortClaim

REPO = Path(__file__).resolve().parents[2]
RECORDINGS = REPO / "tests" / "data" / "recorded"
LEARNER = "/home/learner/course"
FILES = ("rank*/events.jsonl", "rank*/stdout.log", "rank*/stderr.log", "rank*/ended-stacks.txt",
         "ended-*.jsonl", "agent.log")


class ReplayAgents(LocalAgents):
    """LocalAgents whose agents have already run: start() writes the recorded files
    into the run folder, and the agents are over, with the recorded exit code."""

    def __init__(self, spec: LaunchSpec, run_dir: Path, recording: Path) -> None:
        super().__init__(spec, run_dir, "", port=PortClaim(0, None), run_id="replay")
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
    shutil.rmtree(out, ignore_errors=True)
    for pattern in FILES:
        for path in Path(result.log_dir).glob(pattern):
            target = out / path.relative_to(result.log_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(path.read_text(errors="replace").replace(str(REPO), LEARNER))
    (out / "recording.json").write_text(json.dumps({
        "how": how, "start": start, "start_reason": result.start_reason, "nproc": nproc,
        "failing": failing,
        "agent_exit_code": result.agent_exit_code}, indent=1) + "\n")
    shutil.rmtree(out.parent / ".tmp", ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    from endings_table import ENDINGS

    for how in ENDINGS:
        if how == "stuck":
            continue  # a hang needs live ranks to read stacks from
        for start in ("warm", "cold"):
            record(how, start, 2, 1, RECORDINGS / f"{how}-{start}")
            print(how, start, flush=True)
