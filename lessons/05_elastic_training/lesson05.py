"""Helpers for the lesson 05 notebook: checkpoint folders, tables of attempts, the
facts the cells check, and the self-check. The rank scripts do not import this.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from labutils.course import selfcheck
from labutils.course.tables import text_table

CHECKPOINTS = Path("runs") / "05_checkpoints"


def fresh_checkpoint_dir(name: str) -> str:
    """An empty folder for one run's checkpoints (runs/05_checkpoints/NAME)."""
    path = CHECKPOINTS / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return str(path)


def attempts_table(result) -> str:
    """One line per attempt: world size, restart count, who failed and why, outcome.

    When an agent left, the row names the agent: which ranks it ran depends on the
    order in which the agents joined the rendezvous, which changes from run to run.
    """
    rows = []
    for a in result.attempts:
        who = "" if a["failed_rank"] is None else f"rank {a['failed_rank']}"
        why = a["why"] or ""
        if a.get("failed_agent") is not None:
            who, why = f"agent {a['failed_agent']}", why.split(" (injected")[0] + " (injected)"
        rows.append([a["attempt"], a.get("world_size", ""), a.get("restart_count", ""), who,
                     a["outcome"], why[:80]])
    return text_table(["attempt", "world", "restart count", "who failed", "outcome", "why"], rows)


def final_hashes(result) -> dict[int, str]:
    """rank -> sha256 of its final parameters (the script reports it at the end)."""
    return {rec["rank"]: rec["params_sha256"] for rec in result.records if "params_sha256" in rec}


def same_parameters(a, b) -> bool:
    """Every rank of run a and of run b ended with the same parameters, bit for bit."""
    hashes = set(final_hashes(a).values()) | set(final_hashes(b).values())
    return bool(final_hashes(a)) and bool(final_hashes(b)) and len(hashes) == 1


def resumed_at(result) -> dict[int, int]:
    """restart count -> the first step that attempt trained (rank 0's records)."""
    first: dict[int, int] = {}
    for rec in result.records:
        if rec["rank"] == 0 and "loss" in rec:
            first[rec["restart"]] = min(first.get(rec["restart"], rec["step"]), rec["step"])
    return dict(sorted(first.items()))


def store_per_attempt(result) -> bool:
    """Every attempt's ranks met through a TCP store of that attempt's own: all its ranks
    on one MASTER_PORT, not the agent's store, and no two attempts on the same port."""
    ports: dict[int, set] = {}
    for rec in result.records:
        if "master_port" in rec:
            ports.setdefault(rec["restart"], set()).add((rec["master_port"], rec["agent_store"]))
    ends = [next(iter(seen)) for seen in ports.values() if len(seen) == 1]
    return (len(ports) >= 2 and len(ends) == len(ports) and not any(agent for _, agent in ends)
            and len({port for port, _ in ends}) == len(ends))


def losses(result, rank: int = 0) -> dict[int, float]:
    """step -> loss of the last attempt that trained that step (one rank)."""
    out: dict[int, float] = {}
    for rec in sorted((r for r in result.records if r["rank"] == rank and "loss" in r),
                      key=lambda r: r["restart"]):
        out[rec["step"]] = rec["loss"]
    return out


def first_difference(a, b, rank: int = 0) -> int | None:
    """The first step whose loss differs (bit for bit) between two runs, or None."""
    la, lb = losses(a, rank), losses(b, rank)
    return next((s for s in sorted(la) if la[s] != lb.get(s)), None)


def epoch_coverage(result, *, samples: int, global_batch: int) -> list[tuple[int, int, int]]:
    """(epoch, samples trained, distinct samples) with each step's samples taken from
    the last attempt that trained the step (steps done again count once)."""
    newest: dict[int, int] = {}
    for rec in result.records:
        if "index" in rec:
            newest[rec["step"]] = max(newest.get(rec["step"], -1), rec["restart"])
    per_step: dict[int, list[int]] = {}
    for rec in result.records:
        if "index" in rec and rec["restart"] == newest[rec["step"]]:
            per_step.setdefault(rec["step"], []).extend(rec["index"])
    steps_per_epoch = samples // global_batch
    rows = []
    for epoch in range(max(per_step) // steps_per_epoch + 1):
        items = [i for s in range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch)
                 for i in per_step.get(s, [])]
        rows.append((epoch, len(items), len(set(items))))
    return rows


def rejoin_seconds(result) -> float:
    """Seconds from the agent's death to the first rank of the next attempt starting."""
    import json

    from labutils.runtime.runfiles import events_path

    killed, started = None, []
    for rank_dir in sorted(Path(result.log_dir).glob("rank*")):
        rank = int(rank_dir.name[4:])
        for line in events_path(result.log_dir, rank).read_text().splitlines():
            ev = json.loads(line)
            if ev["kind"] == "fault":
                killed = ev["t"]
            elif ev["kind"] == "start" and ev.get("restart", 0) > 0:
                started.append(ev["t"])
    return min(started) - killed


# The self-check: question -> (expected answer, hint shown for a wrong answer).
EXPECTED = {
    "q1_resume_step": (16, "the last checkpoint written before the kill: steps done, "
                           "rounded down to a multiple of --save-every"),
    "q2_restart_count": (2, "TORCHELASTIC_RESTART_COUNT counts the agent's restarts"),
    "q3_per_rank_batch": (16, "the global batch (32) stays; it is split over the ranks left"),
    "q4_not_in_checkpoint": ("c", "DDP's reducer is rebuilt by DDP(model) in every attempt"),
    "q5_crash_safe_step": ("b", "what makes the new file appear all at once?"),
}


def check_answers(answers: dict) -> None:
    """Print, per question, whether the answer is right (None: not answered yet)."""
    selfcheck.check_answers(answers, EXPECTED)