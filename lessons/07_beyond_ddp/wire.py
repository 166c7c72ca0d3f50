"""Lesson 07's FSDP2 on a wire: fsdp_wire.py's records per way of training (step time,
bytes host 0's link sent, time inside each collective) against lesson 02's formulas,
as tables.

lesson07.py imports these for the notebook (L.wire_summary); the rank scripts do not.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from labutils.course.tables import bytes_in, text_table


def wire_summary(records: Iterable[dict], *, sent_fraction: dict[str, float],
                 link_bps: float | None) -> dict[str, dict]:
    """fsdp_wire.py's records per way: medians over the timed steps of the step time (the
    slower rank's), the bytes host 0's link sent, the time rank 0 spent inside each kind of
    collective; the bytes lesson 02's formulas give (sent_fraction: the share of a call's
    array a rank sends, per torch function; DDP all-reduces every gradient once); the
    wire time of the bytes sent at link_bps (None without a measured link)."""
    records = list(records)
    p_bytes = next(r for r in records if r.get("part") == "wire model")["parameter_bytes"]
    steps = [r for r in records if r.get("part") == "wire step"]
    out: dict[str, dict] = {}
    for way in dict.fromkeys(r["way"] for r in steps):
        mine = [r for r in steps if r["way"] == way]
        by_step: dict[int, float] = {}
        for r in mine:
            by_step[r["step"]] = max(by_step.get(r["step"], 0.0), r["step_s"])
        rank0 = [r for r in mine if r["rank"] == 0]
        calls = rank0[0]["calls"]
        ops: dict[str, dict] = {}
        for c in calls:
            op = ops.setdefault(c["op"], {"calls": 0, "formula": 0.0})
            op["calls"] += 1
            op["formula"] += sent_fraction[c["op"]] * c["nbytes"]
        for name, op in ops.items():
            op["inside_s"] = statistics.median(sum(c["s"] for c in r["calls"] if c["op"] == name) for r in rank0)
            op["wire_s"] = op["formula"] * 8 / link_bps if link_bps else None
        if way == "DDP":  # its all-reduces run in C++, unseen by CollectiveLog: one per bucket
            formula = sent_fraction["all_reduce"] * p_bytes
        else:
            formula = sum(op["formula"] for op in ops.values())
        sent = None if rank0[0]["sent"] is None else statistics.median(r["sent"] for r in rank0)
        out[way] = {"way": way, "step_s": statistics.median(by_step.values()), "formula": formula,
                    "sent": sent, "wire_s": sent * 8 / link_bps if sent is not None and link_bps else None,
                    "inside_s": sum(op["inside_s"] for op in ops.values()), "ops": ops, "P": p_bytes}
    return out


def job_bytes_line(before: dict, after: dict, records: Iterable[dict]) -> str:
    """What host 0's link sent during the whole job (cluster.counters before and after)
    against what rank 0 read for the training steps, warm-up included."""
    if not before:
        return "no link counters: the hosts share this machine's loopback"
    steps = sum(r["sent"] for r in records if r.get("part") in ("wire step", "wire warm-up") and r["rank"] == 0)
    job = after["tx_bytes"] - before["tx_bytes"]
    return (f"host 0's link during the whole job (cluster.counters): {_mib(job)} MiB sent; "
            f"during the training steps (read by rank 0): {_mib(steps)} MiB; the rest: {_mib(job - steps)} MiB")


def _mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else bytes_in(nbytes, "MiB")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def wire_bytes_table(summary: dict[str, dict]) -> str:
    """Per way: its collectives per step, the bytes a rank sends by the formulas, the bytes
    host 0's link sent (counters), and those in units of P."""
    rows = []
    for w in summary.values():
        if w["way"] == "compute only":
            continue
        what = ", ".join(f"{op['calls']} x {name.replace('_single', '')}" for name, op in w["ops"].items())
        rows.append([w["way"], what or "all_reduce per bucket (DDP's reducer)", _mib(w["formula"]),
                     _mib(w["sent"]), "-" if w["sent"] is None else f"{w['sent'] / w['P']:.2f}"])
    return text_table(["way", "collectives per step", "formula (MiB)", "sent on the link (MiB)",
                       "sent / P"], rows, right=[2, 3, 4])


def wire_time_table(summary: dict[str, dict]) -> str:
    """Per way: the step, the compute-only step, the wire time of the bytes it sent, and the
    time rank 0 spent inside FSDP2's collectives (medians, ms)."""
    compute = summary["compute only"]["step_s"]
    rows = [[w["way"], _ms(w["step_s"]), _ms(compute), _ms(w["wire_s"]),
             _ms(w["inside_s"]) if w["ops"] else "-"] for w in summary.values() if w["way"] != "compute only"]
    return text_table(["way", "step (ms)", "compute only (ms)", "wire time of its bytes (ms)",
                       "inside FSDP2's collectives (ms)"], rows, right=[1, 2, 3, 4])


def wire_calls_table(summary: dict[str, dict]) -> str:
    """Per FSDP2 way and kind of collective: calls, bytes by the formula, their wire time,
    the time rank 0 spent inside, and the ratio of the two."""
    rows = []
    for w in summary.values():
        for name, op in w["ops"].items():
            ratio = "-" if not op["wire_s"] else f"{op['inside_s'] / op['wire_s']:.2f}"
            rows.append([w["way"], name.replace("_single", ""), op["calls"], _mib(op["formula"]),
                         _ms(op["wire_s"]), _ms(op["inside_s"]), ratio])
    return text_table(["way", "collective", "calls", "sent (MiB)", "wire time (ms)", "inside (ms)",
                       "inside / wire time"], rows, right=[2, 3, 4, 5, 6])


def wire_claims(summary: dict[str, dict]) -> str:
    """What the text reads in the collectives table (with a measured link): the all-to-all
    takes longer for its bytes than the reduce-scatter (an all-reduce on gloo), so the
    all-to-all way's collectives save less time than the wire time of the bytes it leaves
    out (rank 0's time inside them, against the default way's; the step times, which add
    compute and noise of a few tens of ms, are in the time table)."""
    default, a2a = summary["FSDP2"], summary["FSDP2, all-to-all reduce-scatter"]

    def slowdown(way: dict, kind: str) -> float:
        op = next(op for name, op in way["ops"].items() if name.startswith(kind))
        return op["inside_s"] / op["wire_s"]

    return "\n".join([
        "the all-to-all takes longer for its bytes than the reduce-scatter (inside / wire time): "
        f"{slowdown(a2a, 'all_to_all') > slowdown(default, 'reduce_scatter')}",
        "the all-to-all way's collectives save less time than the wire time of the bytes it leaves out: "
        f"{default['inside_s'] - a2a['inside_s'] < default['wire_s'] - a2a['wire_s']}",
    ])
