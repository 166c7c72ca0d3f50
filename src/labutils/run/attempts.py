"""Rank events folded into attempts: who runs, in which attempt, and how each rank ended.

torchrun restarts every rank after a failure or a membership change; which agent
runs which rank, and the world size, are only known from the ranks' own start
events. The fold below reads the events of all ranks in the order they happened
(the run folder's rank<R>/events.jsonl) and keeps, for each rank, its state in the
current attempt, and for the run, the attempts seen. It does no I/O and starts no
process: the launcher feeds it events and acts on the changes it returns, and the
unit tests feed it recorded events.

An attempt is one rendezvous round: the ranks of one attempt share the round key
their start events carry (MASTER_ADDR:MASTER_PORT, new each round; with the agent's
store shared by every round, the port and the restart count: worker.rendezvous_round). A start event
with another round, or a rank that starts twice in one round, opens the next attempt.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from labutils.run.diagnosis import looks_like_victim
from labutils.run.states import LIVE, RankStatus


@dataclass
class RankState:
    """What is known about one rank (global rank number) while the run goes."""

    rank: int
    state: RankStatus = RankStatus.STARTING
    pid: int | None = None
    main_tid: int | None = None
    attempt: int = -1        # the attempt this rank last started in
    agent: int | None = None
    node: str = ""           # the token of the launcher that started it ("": this one)
    local: bool = True       # started by this launcher: its pid can be signalled
    exit_code: int | None = None
    host: str = ""
    # When the rank ended (its exit event, else its agent's reap), and how: its exit
    # event (the script's own end) if it wrote one in this attempt.
    ended_t: float | None = None
    exit_event: dict | None = None
    exceptions: dict[int, dict] = field(default_factory=dict)  # attempt -> exception event
    debugger: dict | None = None  # its debugger event while it waits in or for a debugger


@dataclass
class Attempt:
    """The attempt under way: its rendezvous round and who is in it."""

    index: int
    round: str
    world_size: int
    restart_count: int
    agents: dict[int, list[int]] = field(default_factory=dict)  # agent -> its ranks


# What a fold step changed, for the launcher to show or act on:
#   ("state", rank, state)          a rank's state changed
#   ("record", rank, values)        a rank reported values
#   ("fault", event)                a rank carried out an agent fault
#   ("restart", attempt, note)      a new attempt began; note says how
#   ("debugger", rank, event)       a rank waits for a debugger, got one, or went on
Change = tuple


class AttemptFold:
    """Folds rank events into per-rank state and attempts.

    Args:
        world_size: the most ranks the run can have.
        token: the node token of the launcher that folds ("" on one machine);
            ranks whose start event carries another token are another node's.
        close: called as close(attempt, next_world_size) just before the next
            attempt replaces the current one, while every rank still holds its
            state in the attempt that ends (the launcher records why it ended).
    """

    def __init__(self, world_size: int, *, token: str = "",
                 close: Callable[[Attempt, int], None] | None = None) -> None:
        self.ranks = [RankState(r) for r in range(world_size)]
        self.token = token
        self.current: Attempt | None = None
        self.index = 0
        self.old_rounds: set[str] = set()
        self.records: list[dict] = []
        self.remote_nodes: set[str] = set()
        # The launcher is ending the run (stop, timeout, hang, interrupt): whatever code
        # a rank then ends with, the launcher's stop ended it.
        self.stopping = False
        self._close = close or (lambda attempt, next_world_size: None)

    def members(self, default_size: int) -> list[RankState]:
        """The ranks of the current attempt (default_size of them before any start)."""
        size = self.current.world_size if self.current else default_size
        return self.ranks[:size]

    def set_state(self, r: RankState, state: RankStatus) -> list[Change]:
        if r.state == state:
            return []
        r.state = state
        return [("state", r.rank, state)]

    def apply(self, rank: int, ev: dict) -> list[Change]:
        """Fold one event of one rank; the changes it made."""
        r, kind = self.ranks[rank], ev.get("kind")
        if kind == "start":
            return self._start(r, ev)
        if kind == "record":
            values = ev.get("values", {})
            self.records.append({"rank": r.rank, **values})
            return [("record", r.rank, values)]
        if kind == "fault":
            return [("fault", ev)]
        if kind == "exception":
            r.exceptions[r.attempt] = ev
            if self.stopping and r.state == RankStatus.HUNG:
                return []  # the hang report said it; the stop that followed ended it
            # a peer the launcher's stop ended first took this rank down with it
            lost_peer = self.stopping and looks_like_victim(ev.get("message", ""))
            return self.set_state(r, RankStatus.KILLED if lost_peer else RankStatus.FAILED)
        if kind == "debugger":
            if ev.get("state") == "waiting":
                r.debugger = ev
            elif ev.get("state") == "ended":
                r.debugger = None
            return [("debugger", r.rank, ev)] + self.set_state(
                r, RankStatus.DEBUGGING if r.debugger else RankStatus.RUNNING)
        if kind == "exit":
            r.debugger = None
            r.exit_code = int(ev.get("code", 0))
            r.exit_event, r.ended_t = ev, ev.get("t")
            if self.stopping and r.state in (RankStatus.KILLED, RankStatus.HUNG):
                return []
            return self.set_state(r, RankStatus.DONE if r.exit_code == 0 else RankStatus.FAILED)
        return []

    def reaped(self, record: dict) -> list[Change]:
        """Fold one line of an agent's endings file (runtime/agent.py): the exit code or
        signal of the process it reaped, the final word on how that rank ended."""
        r = next((r for r in self.ranks if r.pid == record.get("pid")
                  and r.host in ("", record.get("host", ""))), None)
        if r is None or r.attempt != self.index:
            return []
        code = int(record["code"])
        if r.ended_t is None:
            r.ended_t = record.get("t")
        r.debugger = None
        r.exit_code = code
        if r.state not in LIVE:
            return []  # its exit or exception event, or the hang report, said it
        if code == 0:
            return self.set_state(r, RankStatus.DONE)
        if self.stopping:
            return self.set_state(r, RankStatus.KILLED)
        # SIGTERM: torchrun ended it because a peer failed, or the launcher stopped the run
        return self.set_state(r, RankStatus.KILLED if code == -signal.SIGTERM
                              else RankStatus.FAILED)

    def begins_attempt(self, rank: int, ev: dict) -> bool:
        """Whether folding this event of this rank would end the current attempt and
        begin the next (a start event of a new rendezvous round, or a second start of a
        rank in the same attempt)."""
        if ev.get("kind") != "start" or self.current is None:
            return False
        key = ev.get("round") or f"restart {int(ev.get('restart', 0))}"
        return key not in self.old_rounds and (
            key != self.current.round or self.ranks[rank].attempt == self.index)

    def _start(self, r: RankState, ev: dict) -> list[Change]:
        restart = int(ev.get("restart", 0))
        key = ev.get("round") or f"restart {restart}"
        if key in self.old_rounds:
            return []  # a late start event of an attempt that is over
        changes: list[Change] = []
        if self.current is None:
            self._open(key, ev)
        elif self.begins_attempt(r.rank, ev):
            previous = self.current.world_size
            self._close(self.current, int(ev.get("world_size", 1)))
            self.old_rounds.add(self.current.round)
            self.index += 1
            self._open(key, ev)
            size = self.current.world_size
            change = f" (was {previous}: the membership changed)" if previous != size else ""
            changes.append(("restart", self.index,
                            f"restart {self.index}: torchrun started the ranks again, restart "
                            f"count {restart}, world size {size}{change}"))
        agent = int(ev.get("agent", 0))
        assert self.current is not None  # opened above
        self.current.agents.setdefault(agent, []).append(r.rank)
        r.node = ev.get("node") or ""
        r.local = r.node == self.token
        if not r.local:
            self.remote_nodes.add(r.node)
        if r.rank == 0:
            self.current.restart_count = restart
        r.attempt, r.pid, r.main_tid, r.exit_code = self.index, ev.get("pid"), ev.get("main_tid"), None
        r.host, r.ended_t, r.exit_event = ev.get("host") or "", None, None
        r.agent = agent
        return changes + self.set_state(r, RankStatus.RUNNING)

    def _open(self, key: str, ev: dict) -> None:
        self.current = Attempt(index=self.index, round=key, world_size=int(ev.get("world_size", 1)),
                               restart_count=int(ev.get("restart", 0)))


def fold_events(events_by_rank: dict[int, list[dict]], world_size: int, *, token: str = "",
                close: Callable[[Attempt, int], None] | None = None) -> AttemptFold:
    """Fold whole event lists (rank -> events, as read from events.jsonl) in time order."""
    fold = AttemptFold(world_size, token=token, close=close)
    ordered = sorted((ev.get("t", 0.0), rank, i, ev) for rank, evs in events_by_rank.items()
                     for i, ev in enumerate(evs))
    for _, rank, _, ev in ordered:
        fold.apply(rank, ev)
    return fold
