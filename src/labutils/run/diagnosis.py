"""What went wrong: the failure summary (the hang report is run/hang.py).

Every rank that raised left an ``exception`` event (type, message, file:line,
traceback without launcher frames); every rank that ended left an ``exit`` event or
its agent's record of how it ended (docs/architecture.md, "How each rank ended").
When one rank dies, its peers usually die of it: torchrun terminates them, or their
next collective fails with a connection error. The root cause is the earliest rank
that failed on its own; the others are marked as victims.
"""

from __future__ import annotations

import signal
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from labutils.run.hang import COLLECTIVE_FILES, rank_list, verb_for, where_text
from labutils.runtime.frames import traceback_frames

# Messages of ranks that failed only because a peer went away first.
_VICTIM_PATTERNS = (
    "connection closed by peer",
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "connectfullmesh",
    "connection refused",
    "failed to recv",
    "failed to send",
    "communicator was aborted",
    "remote process exited",
    "socket closed",
    "read error",
)
# A collective that gave up waiting for its peers: gloo's timeout, NCCL's watchdog.
_TIMEOUT_PATTERNS = (
    "timed out waiting",
    "watchdog caught collective operation timeout",
    "collective operation timeout",
)


def looks_like_victim(message: str) -> bool:
    """True for errors a rank gets when a peer died (gloo/NCCL connection loss)."""
    low = message.lower()
    return any(p in low for p in _VICTIM_PATTERNS)


def is_collective_timeout(message: str) -> bool:
    """True for the error of a collective whose peers never joined it (process-group timeout)."""
    low = message.lower()
    return any(p in low for p in _TIMEOUT_PATTERNS)


def collective_in(traceback: str) -> str:
    """The torch.distributed call a Python traceback ends in ('' if none): the outermost
    frame in distributed_c10d.py is the public function the script called."""
    frames = traceback_frames(traceback)
    names = [fr.func for fr in frames if fr.file.endswith(COLLECTIVE_FILES)]
    if names:
        return names[0]
    return "backward" if any(fr.func == "backward" and "torch" in fr.file for fr in frames) else ""


def signal_name(exit_code: int | None) -> str:
    if exit_code is None or exit_code >= 0:
        return ""
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


@dataclass
class Failure:
    """The root cause of a failed run. Unpacks as (rank, exc_type, message, file, line, traceback)."""

    rank: int
    exc_type: str
    message: str
    file: str | None
    line: int | None
    traceback: str
    source: str = ""
    victims: list[int] = field(default_factory=list)
    exit_code: int | None = None
    also_failed: list[int] = field(default_factory=list)  # ranks that raised their own error
    # those of also_failed that raised the root cause's exception type at its line (every
    # rank runs the same bug); the summary says so, the JSON summary keeps also_failed
    same_error: list[int] = field(default_factory=list)
    # Every rank that raised timed out in a collective: no rank is the root cause, the
    # calls did not match. rank -> {"collective", "where" (file:line), "source"}.
    mismatch: dict[int, dict] = field(default_factory=dict)
    # How the root-cause rank ended: "exception" (it raised), "exit" (a non-zero exit
    # code, no exception), "signal" (killed or crashed), "early_exit" (its script ended
    # while its peers waited in a collective for it), "mismatch" (collectives timed out
    # on every rank), "straggler" (its peers timed out in a collective while it ran
    # outside any), "torchrun" (the agent failed before any rank ran).
    kind: str = "exception"

    def __iter__(self):
        return iter((self.rank, self.exc_type, self.message, self.file, self.line, self.traceback))

    @property
    def where(self) -> str:
        return f"{where_text(self.file)}:{self.line}" if self.file else "unknown location"

    def ended_how(self) -> str:
        """Who failed and how, in words: "rank 1 raised ValueError", "rank 1 died of
        SIGSEGV", "rank 1 exited" (a non-zero status, no exception), "rank 1 ended early",
        "torchrun failed"; a summary follows it with ": " and the message."""
        if self.kind == "torchrun":
            return "torchrun failed"
        if self.kind == "signal":
            return f"rank {self.rank} died of {self.exc_type}"
        if self.kind == "exit" and self.exc_type != "SystemExit":
            return f"rank {self.rank} exited"
        if self.kind == "early_exit":
            return f"rank {self.rank} ended early"
        if self.kind == "straggler":
            return f"rank {self.rank} never reached the collective its peers waited in"
        return f"rank {self.rank} raised {self.exc_type}"

    def to_json(self) -> dict:
        return {
            "rank": self.rank, "exc_type": self.exc_type, "message": self.message,
            "file": self.file, "line": self.line, "source": self.source,
            "victims": self.victims, "also_failed": self.also_failed,
            "exit_code": self.exit_code, "kind": self.kind,
            "mismatch": {str(r): m for r, m in self.mismatch.items()},
        }



def _raised(rank: int, ev: dict, exit_code: int | None) -> Failure:
    """The failure an exception event describes."""
    return Failure(rank=rank, exc_type=ev.get("exc_type", "?"), message=ev.get("message", ""),
                   file=ev.get("file"), line=ev.get("line"), traceback=ev.get("traceback", ""),
                   source=ev.get("source", ""), exit_code=exit_code)


def _ended_badly(rank: int, code: int, *, finished: AbstractSet[int], stderr_tail: str,
                 exit_event: dict | None, elsewhere: bool = False) -> Failure:
    """The failure of a rank that ended by a signal or a non-zero exit code, without
    an exception; elsewhere: a SIGTERM neither torchrun nor the launcher sent."""
    if code > 0:
        event = exit_event or {}
        if event.get("code") == code:  # sys.exit(code): the bootstrap saw where
            said = f": {event['message']}" if event.get("message") else ""  # sys.exit("why")
            return Failure(rank=rank, exc_type="SystemExit", message=f"exit code {code}{said}",
                           file=event.get("file"), line=event.get("line"),
                           source=event.get("source", ""), traceback=stderr_tail,
                           exit_code=code, kind="exit")
        return Failure(rank=rank, exc_type="exit", message=(
            f"exit code {code} without a Python exception (os._exit(), or C code that "
            "called exit())"), file=None, line=None, traceback=stderr_tail, exit_code=code,
            kind="exit")
    if rank in finished:
        message = (f"the script ran to its end, then the process died of {signal_name(code)} "
                   "while Python shut down; call dist.destroy_process_group() at the end "
                   "of the script")
    elif elsewhere:
        message = (f"killed by {signal_name(code)}, which neither torchrun nor the launcher "
                   "sent (a `kill PID`, a scheduler ending the process, or the script itself)")
    else:
        message = (f"killed by {signal_name(code)} (no Python exception: the process was "
                   "killed or crashed)")
    return Failure(rank=rank, exc_type=signal_name(code), message=message, file=None,
                   line=None, traceback=stderr_tail, exit_code=code, kind="signal")


def _ended_early(exit_codes: dict[int, int | None], ended_at: dict[int, float],
                 candidates: list[tuple[int, dict]]) -> int | None:
    """The first rank whose script ended (exit code 0) before every exception of its
    peers, when each of those only lost a peer (None if there is no such rank)."""
    if not candidates or any(not looks_like_victim(ev.get("message", ""))
                             for _, ev in candidates):
        return None
    first_error = min(ev.get("t", 0.0) for _, ev in candidates)
    early = sorted((t, r) for r, t in ended_at.items()
                   if exit_codes.get(r) == 0 and r not in dict(candidates) and t < first_error)
    return early[0][1] if early else None


def _wait_of(ev: dict) -> dict:
    """Where a rank's exception left it waiting: {"collective", "where", "source"}."""
    return {"collective": collective_in(ev.get("traceback", "")),
            "where": f"{where_text(ev.get('file'))}:{ev.get('line')}",
            "source": ev.get("source", "")}


def _waits(timed_out: dict[int, dict], exceptions: dict[int, dict],
           stopped_in: dict[int, dict]) -> tuple[dict[int, dict], dict[int, dict]]:
    """Where the ranks that timed out waited, and where the others that waited in a
    collective too were: each rank -> {"collective", "where", "source"}.

    The others ended before their own timeout fired: they lost their peer (the rank
    that timed out exited) or torchrun stopped them (SIGTERM). Which of the two happens
    first is a matter of milliseconds, so such a rank counts as one of a mismatch when
    it waited elsewhere."""
    waits = {r: _wait_of(ev) for r, ev in timed_out.items()}
    others = {r: _wait_of(ev) for r, ev in exceptions.items()
              if r not in timed_out and looks_like_victim(ev.get("message", ""))
              and collective_in(ev.get("traceback", ""))}
    others.update({r: {k: where[k] for k in ("collective", "where", "source")}
                   for r, where in stopped_in.items()
                   if r not in exceptions and where["collective"]})
    return waits, others


def _straggler(primary: list[tuple[int, dict]], exceptions: dict[int, dict],
               failed_ranks: list[int], exit_codes: dict[int, int | None],
               stopped_in: dict[int, dict]) -> Failure | None:
    """The rank its peers' collective timed out waiting for, or None.

    Every rank that failed on its own timed out in one collective at one line (the
    others that waited, waited there too), and torchrun then stopped a rank that was in
    no collective: it never came (a loop that does not end, or work that outlasts the
    process group's timeout). The hang report names the same rank the straggler when
    the hang timeout runs out first. A rank stopped passing through the very line its
    peers waited at reached it: it was going in, or coming out with the collective's
    error as SIGTERM came (hang.passing)."""
    timed_out = {r: ev for r, ev in primary}
    if not all(is_collective_timeout(ev.get("message", "")) for ev in timed_out.values()):
        return None
    waits, others = _waits(timed_out, exceptions, stopped_in)
    places = {(w["collective"], w["where"]) for w in [*waits.values(), *others.values()]}
    if len(places) != 1:
        return None  # the waiting ranks' calls differ too: a mismatch
    collective, where = places.pop()
    outside = sorted(r for r, at in stopped_in.items() if r not in exceptions and not
                     at["collective"] and not (at.get("passing") and at["where"] == where))
    if not outside:
        return None
    rank, at = outside[0], stopped_in[outside[0]]
    call = f"{collective}() at {where}" if collective else where
    return Failure(
        rank=rank, exc_type=signal_name(exit_codes.get(rank)) or "SIGTERM",
        message=(f"{call}, until the process group's timeout ran out; "
                 f"{rank_list(outside)} ran outside any collective (a loop that does not "
                 "end, or work on one rank that outlasts the timeout)"),
        file=at.get("file"), line=at.get("line"), source=at.get("source", ""),
        traceback="", exit_code=exit_codes.get(rank), kind="straggler",
        victims=sorted((set(failed_ranks) | set(exceptions)) - set(outside)),
        also_failed=outside[1:])


def _same_error(a: dict, b: dict) -> bool:
    """Two exception events of one bug: the same exception type raised at the same line."""
    return bool(a.get("file")) and all(a.get(k) == b.get(k) for k in ("exc_type", "file", "line"))


def _first_alike(rank: int, own: list[tuple[int, dict]]) -> int:
    """The lowest rank that raised the same error at the same line as `rank` (every rank
    runs that bug, and which raised first is a matter of milliseconds, warm or cold)."""
    first = dict(own)[rank]
    return min(r for r, ev in own if r == rank or _same_error(ev, first))


def _mark_victims(root: Failure, exceptions: dict[int, dict], failed_ranks: list[int],
                  primary: list[tuple[int, dict]], stopped_in: dict[int, dict]) -> None:
    """Sort the other ranks that ended badly: victims of the root cause, ranks with an
    error of their own (also_failed), or, when every rank that failed on its own timed
    out in a collective, a mismatch of calls."""
    involved = set(failed_ranks) | set(exceptions)
    if root.kind == "early_exit":
        involved.discard(root.rank)
    # Ranks that raised an error of their own (not a lost peer) failed in their own
    # right, often with the same error as the root cause; the rest only died of it.
    root.also_failed = sorted(
        r for r, ev in exceptions.items()
        if r != root.rank and not looks_like_victim(ev.get("message", ""))
    )
    root.victims = sorted(r for r in involved if r != root.rank and r not in root.also_failed)
    root.same_error = [r for r in root.also_failed if root.kind == "exception"
                       and _same_error(exceptions[r], exceptions.get(root.rank, {}))]
    timed_out = {r: ev for r, ev in exceptions.items() if is_collective_timeout(ev.get("message", ""))}
    if not timed_out or not all(r in timed_out for r, _ in primary):
        return

    waits, others = _waits(timed_out, exceptions, stopped_in)
    places = {(w["collective"], w["where"]) for w in [*waits.values(), *others.values()]}
    if len(timed_out) >= 2 or (root.rank in timed_out and others and len(places) >= 2):
        # Each rank waited for peers that were in another call: blaming the first to give
        # up would point at an innocent line. Show every rank's call instead.
        root.mismatch = dict(sorted({**waits, **others}.items()))
        root.also_failed = sorted(r for r in root.mismatch if r != root.rank)
        root.victims = sorted(r for r in involved if r not in root.mismatch)
        root.kind = "mismatch"


def find_failure(
    exceptions: dict[int, dict],
    exit_codes: dict[int, int | None],
    failed_ranks: list[int],
    *,
    finished: AbstractSet[int] = frozenset(),
    stderr_tails: dict[int, str] | None = None,
    ended_at: dict[int, float] | None = None,
    exit_events: dict[int, dict] | None = None,
    stopped_in: dict[int, dict] | None = None,
    terminated: AbstractSet[int] = frozenset(),
) -> Failure | None:
    """The root-cause failure among the ranks of one attempt.

    In order: the earliest rank that failed on its own, by an exception of its own or by
    ending with a non-zero exit code or a signal (other than the SIGTERM torchrun ends a
    failed rank's peers with) and no exception; else, when every rank that failed on
    its own timed out in one collective, a rank torchrun stopped outside any collective
    (the straggler they waited for); else ranks that timed out in a collective (a
    mismatch when there are several); else a rank whose script ended
    (exit code 0) before its peers failed in a collective, waiting for it; else the
    earliest exception, even one that looks like a lost peer.

    Args:
        exceptions: rank -> its exception event (exc_type, message, file, line, traceback, t).
        exit_codes: rank -> exit code (negative: killed by that signal; None: unknown).
        failed_ranks: ranks that ended badly (exception, non-zero exit, signal).
        finished: ranks whose script ran to its end before the process died.
        stderr_tails: rank -> last lines of its stderr, shown for crashes without
            a Python exception.
        ended_at: rank -> when it ended (time.time(): its exit event, else when its
            agent reaped it); ranks not in it count as ending last.
        exit_events: rank -> its exit event (code, t; file, line and source of a
            sys.exit() with a non-zero code), for ranks whose script ended itself.
        stopped_in: rank -> where it was when SIGTERM ended it ({"collective" (""
            outside any), "where", "source", "file", "line", "passing" (hang.passing)}),
            for ranks torchrun stopped.
        terminated: ranks SIGTERM ended although neither torchrun nor the launcher
            sent it: they ended on their own, as a rank SIGKILL ended.
    """
    stderr_tails = stderr_tails or {}
    ended_at = ended_at or {}
    exit_events = exit_events or {}
    if not failed_ranks and not exceptions:
        return None
    never = float("inf")
    candidates = sorted(exceptions.items(), key=lambda kv: kv[1].get("t", 0.0))
    primary = [kv for kv in candidates if not looks_like_victim(kv[1].get("message", ""))]
    own = [kv for kv in primary if not is_collective_timeout(kv[1].get("message", ""))]
    # A rank that ended with a bad status and no exception is a root cause too: a
    # signal nobody on our side sent (a segfault, an abort, SIGKILL from fault
    # injection or the OOM killer), or an exit code (sys.exit(3), os._exit(3)). SIGTERM
    # is how torchrun ends the peers of a failed rank, unless nobody on our side sent it.
    silent = [r for r in failed_ranks if r not in exceptions
              and (exit_codes.get(r) not in (0, None, -signal.SIGTERM) or r in terminated)]
    first = sorted([(ev.get("t", never), 0, rank) for rank, ev in own]
                   + [(ended_at.get(rank, never), 1, rank) for rank in silent])
    early = _ended_early(exit_codes, ended_at, candidates)
    if first and first[0][1] == 0:
        rank = _first_alike(first[0][2], own)
        root = _raised(rank, exceptions[rank], exit_codes.get(rank))
    elif first:
        root = _ended_badly(first[0][2], exit_codes[first[0][2]] or 0, finished=finished,
                            stderr_tail=stderr_tails.get(first[0][2], ""),
                            exit_event=exit_events.get(first[0][2]),
                            elsewhere=first[0][2] in terminated)
    elif primary:  # every rank that failed on its own timed out in a collective
        straggler = _straggler(primary, exceptions, failed_ranks, exit_codes, stopped_in or {})
        if straggler is not None:
            return straggler
        rank, ev = primary[0]
        root = _raised(rank, ev, exit_codes.get(rank))
    elif early is not None:
        # Every rank that ended badly after it, not only those whose error was read in
        # time: torchrun may end the others before they raise, so the set is the victims'.
        left = sorted((set(failed_ranks) | set(exceptions)) - {early})
        root = Failure(
            rank=early, exc_type="exit 0",
            message=(f"the script ended (exit code 0) while {rank_list(left)} "
                     f"{verb_for(left, 'was', 'were')} still running, and lost it in a collective: "
                     "every rank must make the same collective calls (uneven data, or an early "
                     "return or break)"),
            file=None, line=None, traceback="", exit_code=0, kind="early_exit")
        event = exit_events.get(early) or {}
        root.file, root.line, root.source = event.get("file"), event.get("line"), \
            event.get("source", "")
    elif candidates:
        rank, ev = candidates[0]
        root = _raised(rank, ev, exit_codes.get(rank))
    else:
        rank = failed_ranks[0]
        code = exit_codes.get(rank)
        root = Failure(
            rank=rank, exc_type=signal_name(code) or "Died",
            message="the process ended without an exit code we could read",
            file=None, line=None, traceback="", exit_code=code, kind="signal")
    _mark_victims(root, exceptions, failed_ranks, primary, stopped_in or {})
    return root
