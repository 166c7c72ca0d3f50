"""The run folder as the meeting place of a job's nodes (docs/architecture.md, "run folder").

One launcher follows each node of a job across machines; when the machines share
the log folder, every launcher sees every rank's files. A launcher signals only its
own ranks; with the others it talks through files in the run folder:

- done-<node>: this node's ranks are gone (the others need not wait for them);
- stop.json {"by", "reason"}: end the job on every node (stop, timeout, hang);
- stack-request.json {"by", "ranks"}: these ranks dump their stacks (each rank's progress
  watcher polls the file, runtime/worker.py: no launcher can signal another machine's);
- lease: renewed every second by a launcher that follows a job it submitted (SLURM);
  the nodes end the job when it goes stale (that launcher, or its kernel, was killed).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from labutils.runtime import runfiles

LEASE_RENEW_S = 1.0
LEASE_STALE_S = 30.0
ENV_LEASE_STALE_S = runfiles.ENV_LEASE_STALE_S  # overrides LEASE_STALE_S on the nodes


def node_token(*, multinode: bool, node_rank: int | None) -> str:
    """A launcher's name among the nodes of a job ("" when the run is one machine's):
    node<K> with node ranks, else host-pid (c10d numbers the nodes only as they join)."""
    if not multinode:
        return ""
    if node_rank is not None:
        return f"node{node_rank}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{os.uname().nodename}-{os.getpid()}")


def node_order(token: str) -> tuple:
    """node2 before node10; host-pid tokens (c10d) after node ranks, by name."""
    m = re.fullmatch(r"node(\d+)", token)
    return (0, int(m.group(1)), "") if m else (1, 0, token)


def ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if ranks else "(none had started)"


class NodeFiles:
    """This launcher's side of the run-folder protocol.

    Args:
        run_dir: the run folder every node writes into.
        token: this launcher's node token ("" on one machine).
        note: where to say what another node did (the display's note).
    """

    def __init__(self, run_dir: Path, token: str, note) -> None:
        self.run_dir = run_dir
        self.token = token
        self.note = note
        self.stop_seen = False

    def done(self, token: str) -> bool:
        """Whether the node with this token has said its ranks are gone."""
        return runfiles.node_done_path(self.run_dir, token).exists()

    def mark_done(self) -> None:
        """Write done-<node> once: its time is when this node's ranks were gone (what
        outcome.shared_run_terminated compares a rank's ending with), not touched again."""
        path = runfiles.node_done_path(self.run_dir, self.token)
        if self.token and not path.exists():
            path.touch()

    def first_to_diagnose(self, others: set[str]) -> bool:
        """Whether this node reads the stacks when the job hangs: the first node among
        those that share the run folder (the others would only race it)."""
        return not others or node_order(self.token) <= min(map(node_order, others))

    def lease_lost(self) -> bool:
        """The launcher that submitted this job stopped renewing its lease."""
        try:
            age = time.time() - runfiles.lease_path(self.run_dir).stat().st_mtime
        except OSError:
            return False
        try:
            stale_after = float(os.environ.get(ENV_LEASE_STALE_S, LEASE_STALE_S))
        except ValueError:
            stale_after = LEASE_STALE_S
        if age < stale_after:
            return False
        self.note(f"the launcher that submitted this job has not been heard from for "
                  f"{age:.0f} s (its lease): ending the job")
        return True

    def renew_lease(self) -> None:
        runfiles.lease_path(self.run_dir).touch()

    def stopped_elsewhere(self) -> bool:
        """Another node's launcher ended the job early (stop.json), or the launcher that
        submitted it is gone (a stale lease): stop here too."""
        path = runfiles.stop_path(self.run_dir)
        if self.stop_seen:
            return False
        if not path.exists():
            return self.lease_lost()
        try:
            stop = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        if stop.get("by") == self.token:
            return False
        self.stop_seen = True
        self.note(f"{stop.get('by', 'another node')} ended the job "
                  f"({stop.get('reason', 'stopped')}): stopping this node's ranks")
        return True

    def failed_elsewhere(self, others: set[str], failed_ranks) -> bool:
        """Another node is done and some of its ranks failed (failed_ranks(token) lists
        them): this node's ranks would only wait for peers that are gone."""
        for token in sorted(others):
            if not self.done(token):
                continue
            failed = failed_ranks(token)
            if failed:
                self.note(f"{token} has ended and its rank(s) {ranks_text(failed)} "
                          "failed: stopping the ranks still waiting for them")
                return True
        return False

    def tell_others_to_stop(self, reason: str) -> None:
        """Ask every other node's launcher to stop (this one is ending the job early)."""
        if self.stop_seen or reason not in ("stopped", "timeout", "hang", "interrupted"):
            return
        path = runfiles.stop_path(self.run_dir)
        if not path.exists():
            runfiles.write_atomic(path, json.dumps({"by": self.token or "launcher",
                                                    "reason": reason}))

    def request_stacks(self, ranks: list[int]) -> None:
        """Ask the nodes that run these ranks to make them dump their stacks."""
        runfiles.write_atomic(runfiles.stack_request_path(self.run_dir),
                              json.dumps({"by": self.token, "ranks": ranks}))
