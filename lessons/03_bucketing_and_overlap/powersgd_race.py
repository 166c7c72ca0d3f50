"""What comm_hooks.py --powersgd-race did, read from its run: the all-reduces each rank
issued in order, where the ranks' orders first differ, and where the ranks wait.

lesson03.py imports these for the notebook (L.race_report); the rank scripts do not.
"""

from __future__ import annotations

import re
from pathlib import Path

from labutils.runtime import runfiles


_ISSUE_RE = re.compile(r"all_reduce of\s+(\d+) floats from thread (\S+)")


def issue_orders(run) -> dict[int, list[tuple[int, str]]]:
    """Per rank, the all-reduces it issued in order: (floats, thread), from its stdout."""
    return {r.rank: [(int(n), t) for n, t in _ISSUE_RE.findall(r.stdout)] for r in run.ranks}


_FRAME_RE = re.compile(r'File "[^"]*powerSGD_hook\.py", line (\d+) in (\w+)')


def _powersgd_frames(stacks: Path) -> list[str]:
    """Innermost powerSGD_hook.py frame of each thread in a rank's stack dump, as
    "function (line N)"; a thread blocked in a callback waits there."""
    try:
        text = stacks.read_text(errors="replace")
    except OSError:
        return []
    found = []
    for thread in text.split("\n\n"):
        m = _FRAME_RE.search(thread)
        if m:
            found.append(f"{m.group(2)} (line {m.group(1)})")
    return found


def race_report(run) -> str:
    """What comm_hooks.py --powersgd-race did: each rank's all-reduces in issue order
    (* = issued from a thread Python did not start, i.e. inside a future's callback on
    one of gloo's worker threads), where the orders first differ, and how the run ended."""
    orders = issue_orders(run)
    lines = [f"rank {rank}: " + " ".join(f"{n}{'*' if t.startswith('Dummy') else ''}" for n, t in calls)
             for rank, calls in orders.items()]
    lines.append("(* = issued inside a callback, on one of gloo's threads)")
    lines.append(first_difference(orders))
    if run.hang:
        where = sorted({c for c in run.hang.calls.values() if c})
        lines.append(f"outcome: a hang; the ranks' main threads wait in {', '.join(where) or 'no call'}()")
        for rank in sorted(orders):
            blocked = _powersgd_frames(runfiles.stacks_path(run.log_dir, rank))
            lines.append(f"  rank {rank}: {len(blocked)} thread(s) blocked inside PowerSGD's callbacks"
                         + (f": {', '.join(blocked)}" if blocked else ""))
    elif run.failure:
        gloo = [ln.split("] ", 1)[-1].strip() for r in run.ranks for ln in r.stderr.splitlines()
                if "doesn't match" in ln]
        lines.append(f"outcome: rank {run.failure.rank} died ({run.failure.exc_type})")
        if gloo:
            lines.append(f"  gloo said: {gloo[0]}")
    else:
        lines.append(f"outcome: {run.reason}")
    return "\n".join(lines)


def first_difference(orders: dict[int, list[tuple[int, str]]]) -> str:
    """Where the ranks' sequences of all-reduce sizes first differ, as text."""
    seqs = {r: [n for n, _ in calls] for r, calls in orders.items()}
    length = min(len(s) for s in seqs.values())
    for i in range(length):
        sizes = {r: s[i] for r, s in seqs.items()}
        if len(set(sizes.values())) > 1:
            detail = ", ".join(f"rank {r} sends {n} floats" for r, n in sizes.items())
            return f"call {i + 1}: {detail}: a mismatch"
    return f"the first {length} calls match in size on every rank"
