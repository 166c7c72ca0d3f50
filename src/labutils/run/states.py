"""The states a rank goes through and the ways a run ends, as the JSON summary spells them.

Both are str enums: a member is equal to its value ("done" == RankStatus.DONE), prints
as it, shows as it in a list (repr), and is written to JSON as it, so summaries,
displays and a learner's print() of result.ranks read the same words as before.
"""

from __future__ import annotations

from enum import Enum


class RankStatus(str, Enum):
    """A rank's state: RankState.state while the run goes, RunResult.ranks[r].state and
    the summary's "state" after it.

    STARTING -> RUNNING <-> DEBUGGING (at a breakpoint), then one final state: DONE
    (its script ended, exit code 0), FAILED (an exception, exit code or signal of its
    own), KILLED (torchrun or the launcher ended it because of something else), HUNG
    (stopped after the hang report read its stack).
    """

    STARTING = "starting"
    RUNNING = "running"
    DEBUGGING = "debugging"
    DONE = "done"
    FAILED = "failed"
    KILLED = "killed"
    HUNG = "hung"

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    @property
    def final(self) -> bool:
        return self not in LIVE


LIVE = frozenset({RankStatus.STARTING, RankStatus.RUNNING, RankStatus.DEBUGGING})


class Ending(str, Enum):
    """Why a run ended: RunResult.reason and the summary's "reason"; the CLI's exit
    status follows from it (0, 1, 3, 4, 130)."""

    OK = "ok"
    FAILED = "failed"  # a rank failed (result.failure says which and why)
    HANG = "hang"  # no rank made progress for hang_timeout (result.hang)
    TIMEOUT = "timeout"  # the run's wall-clock limit
    STOPPED = "stopped"  # Stop, or another node's launcher ended the job
    INTERRUPTED = "interrupted"  # Ctrl-C, SIGTERM or SIGHUP

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)
