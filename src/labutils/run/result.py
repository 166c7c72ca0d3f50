"""RunResult: everything a finished run left behind, as text, HTML and JSON."""

from __future__ import annotations

import html
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from labutils.run.diagnosis import Failure, signal_name
from labutils.run.hang import Hang, rank_list
from labutils.run.states import RankStatus
from labutils.runtime import runfiles

# Exit statuses of `labutils launch` (docs/architecture.md, "Contracts").
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_HANG, EXIT_TIMEOUT, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130


@dataclass
class RankResult:
    """One rank: its state, exit code and output (the full text is read from disk)."""

    rank: int
    state: str = RankStatus.STARTING
    exit_code: int | None = None
    pid: int | None = None
    log_dir: Path | None = None
    stdout_lines: int = 0
    stderr_lines: int = 0
    tail: list[tuple[str, str]] = field(default_factory=list)  # last (stream, line) pairs
    victim: bool = False

    def _read(self, stream: str) -> str:
        if self.log_dir is None:
            return ""
        try:
            return runfiles.stream_path(self.log_dir, self.rank, stream).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    @property
    def stdout(self) -> str:
        """Everything this rank wrote to stdout (all attempts), from its log file."""
        return self._read("stdout")

    @property
    def stderr(self) -> str:
        """Everything this rank wrote to stderr (all attempts), from its log file."""
        return self._read("stderr")

    def to_json(self) -> dict:
        return {
            "rank": self.rank, "exit_code": self.exit_code, "state": self.state,
            "stdout_lines": self.stdout_lines, "stderr_lines": self.stderr_lines,
        }


# The most of a root cause's message the summary repeats when the traceback, message and
# all, is shown just above it (TORCH_DISTRIBUTED_DEBUG=DETAIL's mismatch is one line of
# some 700 characters).
SHOWN_MESSAGE = 200


def _first_words(message: str) -> str:
    """A message's first line, cut at a word before SHOWN_MESSAGE characters; " [...]"
    says where something was left out."""
    text = message.strip()
    first = text.split("\n", 1)[0]
    if len(first) > SHOWN_MESSAGE:
        cut = first.rfind(" ", 0, SHOWN_MESSAGE)
        first = first[:cut if cut > SHOWN_MESSAGE // 2 else SHOWN_MESSAGE].rstrip()
    return first + " [...]" if first != text else first


def attempt_line(attempt: dict) -> str:
    """One attempt of result.attempts as a line: size, restart count, outcome, cause."""
    a = attempt
    size = a.get("world_size")
    line = (f"attempt {a['attempt']}: {size if size is not None else '?'} rank(s), "
            f"restart count {a.get('restart_count', a['attempt'])}, {a['outcome']}")
    if a.get("failed_agent") is None and a.get("failed_rank") is not None:
        line = f"{line}; rank {a['failed_rank']} failed: {a['why']}"
    elif a.get("why"):
        line = f"{line}; {a['why']}"
    return runfiles.shorten_build_paths(line)


@dataclass
class RunResult:
    """What launch() returns. ``ok`` is True only when every rank exited with 0."""

    ok: bool
    world_size: int
    duration_s: float
    log_dir: Path
    ranks: list[RankResult]
    records: list[dict] = field(default_factory=list)
    failure: Failure | None = None
    hang: Hang | None = None
    # where each rank was when the launcher stopped the run (timeout, Stop, interrupt:
    # the stacks each dumped then); shown in the summary, not part of the JSON summary
    at_stop: Hang | None = None
    attempts: list[dict] = field(default_factory=list)
    reason: str = "ok"  # ok | failed | hang | timeout | stopped | interrupted
    script: str = ""
    command: list[str] = field(default_factory=list)  # agent 0's torchrun command
    agent_exit_code: int | None = None
    commands: list[list[str]] = field(default_factory=list)  # every agent's command
    cluster: dict | None = None  # the virtual cluster it ran on (labutils.cluster), if any
    # How the run's processes were owned: "subreaper" (each agent's keeper adopts and
    # ends whatever the ranks start, daemons included) or "process-tree" (the tree the
    # launcher can see); None when the nodes ran elsewhere (SLURM).
    ownership: str | None = None
    # How the agents started: "warm" (forked from this caller's warm server, torch
    # already imported) or "cold" (a new interpreter each); why it started cold; and
    # for a warm run, that a new warm server had to be started for it, and why
    # (labutils.run.warm).
    start: str | None = None
    start_reason: str | None = None
    warm_server: str | None = None
    # What the headline calls it: "run", or "cell N" for a cell of a persistent world
    # (labutils.run.world), whose outcome is told as a run's.
    kind: str = "run"

    @property
    def restarts(self) -> int:
        """How often the ranks were started again (failures and membership changes)."""
        return max(0, len(self.attempts) - 1)

    def restart_history(self) -> list[str]:
        """One line per attempt: world size, restart count, how it ended and why."""
        return [attempt_line(a) for a in self.attempts]

    @property
    def exit_status(self) -> int:
        """The CLI's exit status for this result: 0 ok, 1 failed, 3 hang, 4 timeout, 130 stop."""
        return {
            "ok": EXIT_OK, "failed": EXIT_FAILED, "hang": EXIT_HANG, "timeout": EXIT_TIMEOUT,
            "stopped": EXIT_INTERRUPTED, "interrupted": EXIT_INTERRUPTED,
        }.get(self.reason, EXIT_FAILED)

    def values(self, name: str, *, rank: int | None = None) -> list:
        """The reported values of one name, in order (optionally of one rank)."""
        return [r[name] for r in self.records if name in r and (rank is None or r["rank"] == rank)]

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "world_size": self.world_size,
            "duration_s": round(self.duration_s, 3),
            "log_dir": str(self.log_dir),
            "reason": self.reason,
            "ranks": [r.to_json() for r in self.ranks],
            "failure": self.failure.to_json() if self.failure else None,
            "hang": self.hang.to_json() if self.hang else None,
            "attempts": self.attempts,
            "records": self.records,
            **({"cluster": self.cluster} if self.cluster else {}),
            **({"ownership": self.ownership} if self.ownership else {}),
            **({"start": self.start, "start_reason": self.start_reason} if self.start else {}),
            **({"warm_server": self.warm_server} if self.warm_server else {}),
        }

    def write_json(self, path: str | os.PathLike) -> None:
        """Write the JSON summary atomically (temp file, then rename)."""
        runfiles.write_atomic(path, json.dumps(self.to_json(), indent=2, default=str))

    # ------------------------------------------------------------------ reading
    def headline(self) -> str:
        what = {
            "ok": "finished", "failed": "FAILED", "hang": "HUNG", "timeout": "TIMED OUT",
            "stopped": "STOPPED", "interrupted": "INTERRUPTED",
        }.get(self.reason, self.reason)
        restarts = f", {self.restarts} restart(s)" if self.restarts else ""
        return (f"{self.kind} {what}: {self.world_size} rank(s) in {self.duration_s:.1f} s{restarts}; "
                f"logs in {runfiles.relative_path(self.log_dir)}")

    def summary(self, *, traceback_shown: bool = False, traceback_like: int | None = None) -> str:
        """The readable report: headline, per-rank states, failure or hang details.

        Args:
            traceback_shown: the root cause's traceback was printed just above (the
                text display passes True when it showed it): refer to it instead of
                printing it again, and keep only the start of a long message (its
                first line, at most SHOWN_MESSAGE characters).
            traceback_like: the rank whose traceback was shown in full when the root
                cause's was shown as a repeat of another rank's.
        """
        lines = [self.headline()]
        if self.ok and self.kind != "run":
            return lines[0]  # a persistent world's cell that every rank finished: one line
        if self.restarts:
            lines.extend("  " + line for line in self.restart_history())
        for r in self.ranks:
            code = "" if r.exit_code is None else f" exit {r.exit_code}"
            sig = signal_name(r.exit_code)
            extra = " (victim: died because a peer failed)" if r.victim else ""
            lines.append(f"  rank {r.rank}: {r.state}{code}{' ' + sig if sig else ''}{extra}")
        if self.failure and self.failure.mismatch:
            lines.extend(self._mismatch_lines())
        elif self.failure:
            f = self.failure
            message = f.message
            if traceback_shown:
                message = _first_words(message)
            lines.append(f"root cause: {f.ended_how()}" + (f": {message}" if message else ""))
            if f.kind != "torchrun":  # the agent failed: no rank, no line of the script
                lines.append(f"  at {f.where}" + (f"    {f.source}" if f.source else ""))
            same = [r for r in f.also_failed if r in f.same_error]
            own = [r for r in f.also_failed if r not in f.same_error]
            if same:
                lines.append(f"  {rank_list(same)} raised {f.exc_type} at the same line too")
            if len(own) == 1:
                lines.append(f"  rank {own[0]} raised an error of its own too (see its stderr)")
            elif own:
                lines.append(f"  ranks {', '.join(map(str, own))} raised errors of their own too "
                             "(see their stderr)")
            if f.victims:
                who = "rank" if len(f.victims) == 1 else "ranks"
                why = "waited for it in vain" if f.kind == "straggler" else \
                    f"stopped because rank {f.rank} failed"
                lines.append(f"  {who} {', '.join(map(str, f.victims))} {why}")
            if f.traceback and traceback_shown and traceback_like not in (None, f.rank):
                lines.append(f"traceback of rank {f.rank}: like rank {traceback_like}'s, shown above")
            elif f.traceback and traceback_shown:
                lines.append(f"traceback of rank {f.rank}: shown above")
            elif f.traceback:
                lines.append(f"traceback of rank {f.rank}:")
                lines.extend("  " + t for t in f.traceback.rstrip().splitlines())
        if self.hang:
            h = self.hang
            lines.append(f"hang: no rank made progress for {h.silent_s:.0f} s; {h.explanation}")
            lines.extend(_position_lines(h, "waits"))
            for rank, exit_code in h.exited.items():
                if rank in h.lingering:
                    lines.append(f"  rank {rank}'s script {h.lingering[rank]}, but its process "
                                 "runs on: Python waits for its threads that are not daemons "
                                 "(start them with daemon=True, or stop and join them)")
                else:
                    lines.append(f"  rank {rank} had already exited (code {exit_code})")
        if self.at_stop and not self.hang:
            # an instant of a run that may have been well: where each rank was, and no
            # verdict (no straggler, no mismatch) drawn from that one look
            lines.append(f"where each rank was {_WHEN.get(self.reason, 'when the run ended')}:")
            lines.extend(_position_lines(self.at_stop, "was", stragglers=False))
        # torch's build paths in error messages, as the display shows them; the JSON
        # summary and the logs keep the messages as they were raised.
        return runfiles.shorten_build_paths("\n".join(lines))

    def _mismatch_lines(self) -> list[str]:
        f = cast(Failure, self.failure)  # called only for a failure with a mismatch
        ranks = sorted(f.mismatch)
        calls = {(m["collective"], m["where"]) for m in f.mismatch.values()}
        lines = [f"collectives did not match: ranks {', '.join(map(str, ranks))} waited in "
                 "collectives their peers never joined, until the process group's timeout "
                 "ended the wait"]
        for rank in ranks:
            m = f.mismatch[rank]
            call = f" in {m['collective']}()" if m["collective"] else ""
            src = f"    {m['source']}" if m["source"] else ""
            lines.append(f"  rank {rank} waited{call} at {m['where']}{src}")
        if len(calls) > 1:
            lines.append("  no rank alone is the cause: every rank must call the same "
                         "collectives in the same order; compare the calls above")
        else:
            lines.append("  every rank waited in the same call: a rank was missing from it "
                         "(an earlier call that did not match, or a group without it)")
        if f.victims:
            who = "rank" if len(f.victims) == 1 else "ranks"
            lines.append(f"  {who} {', '.join(map(str, f.victims))} stopped because of it")
        return lines

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return f"<RunResult {self.headline()}>"

    def _repr_html_(self) -> str:
        color = "#1a7f37" if self.ok else "#cf222e"
        rows = "".join(
            f"<tr><td>{r.rank}</td><td>{state_badge(r.state)}</td>"
            f"<td>{'' if r.exit_code is None else r.exit_code} {signal_name(r.exit_code)}</td>"
            f"<td>{r.stdout_lines}</td><td>{r.stderr_lines}</td>"
            f"<td>{'victim' if r.victim else ''}</td></tr>"
            for r in self.ranks
        )
        parts = [
            f"<div class='labutils-result'><b style='color:{color}'>"
            f"{html.escape(self.headline())}</b>",
            "<table><tr><th>rank</th><th>state</th><th>exit</th><th>stdout lines</th>"
            f"<th>stderr lines</th><th></th></tr>{rows}</table>",
        ]
        if self.restarts:
            parts.append(f"<pre>{html.escape(chr(10).join(self.restart_history()))}</pre>")
        if self.failure or self.hang:
            skip = 1 + len(self.ranks) + (len(self.attempts) if self.restarts else 0)
            detail = self.summary().split("\n", skip)[-1]
            parts.append(f"<pre>{html.escape(detail)}</pre>")
        parts.append("</div>")
        return "".join(parts)


STATE_COLORS = {
    "starting": "#6e7781", "running": "#0969da", "debugging": "#bf8700", "done": "#1a7f37",
    "failed": "#cf222e", "hung": "#9a6700", "killed": "#8250df",
}


def state_badge(state: str) -> str:
    color = STATE_COLORS.get(state, "#6e7781")
    return (f"<span style='background:{color};color:white;border-radius:8px;"
            f"padding:0 6px'>{html.escape(state)}</span>")


_WHEN = {"timeout": "at the timeout", "stopped": "when the run was stopped",
         "interrupted": "when the run was interrupted"}


def _position_lines(h: Hang, verb: str, *, stragglers: bool = True) -> list[str]:
    """A line for each rank of a hang report: where it waits (verb "waits") or was
    ("was", when the run was stopped), in which collective, whether it is a straggler
    (a hang's verdict only), the source."""
    lines = []
    for rank, where in h.waiting.items():
        call = f" in {h.calls[rank]}()" if h.calls.get(rank) else ""
        src = f"    {h.sources[rank]}" if h.sources.get(rank) else ""
        mark = "  <- straggler" if stragglers and rank in h.stragglers else ""
        lines.append(f"  rank {rank} {verb} at {where}{call}{mark}{src}")
    return lines
