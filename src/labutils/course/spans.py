"""Time spans: how long something ran, how long two things ran at once, and the spans
of a torch.profiler trace.

In notebooks and tests (pure functions; lesson 03 reads DDP's overlap with them)::

    busy_seconds([(0, 2), (1, 3)])                  # 3.0: overlapping spans count once
    overlap_seconds(compute_spans, comm_spans)      # communication hidden behind compute
    trace_spans("trace.json")                       # backward ops and all-reduces of a trace
    trace_events("trace.json", marker=("clock", t_ns))  # every span, on the wall clock
    merge_traces({0: ("r0.json", t0_ns), 1: ("r1.json", t1_ns)}, "all.json")  # one timeline
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from labutils.errors import InputError

__all__ = ["busy_seconds", "overlap_seconds", "trace_spans", "trace_events", "merge_traces", "is_comm"]

COMM_MATCH = ("all_reduce", "allreduce", "AllReduce")


def _merged(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals, as sorted disjoint intervals."""
    out: list[list[float]] = []
    for start, end in sorted((float(a), float(b)) for a, b in spans):
        if end < start:
            raise InputError("spans", expected="intervals with end >= start", given=(start, end),
                             fix="pass (start_s, end_s) pairs")
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def busy_seconds(spans: Sequence[tuple[float, float]]) -> float:
    """Seconds covered by at least one interval (overlapping intervals count once)."""
    return sum(b - a for a, b in _merged(spans))


def overlap_seconds(first: Sequence[tuple[float, float]], second: Sequence[tuple[float, float]]) -> float:
    """Seconds during which both something in first and something in second ran:
    e.g. backward compute and all-reduce, the communication DDP hid behind compute."""
    a, b = _merged(first), _merged(second)
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _read_trace(path: str | os.PathLike) -> dict:
    try:
        trace = json.loads(Path(path).read_text())
        trace["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError("path", expected="a Chrome trace written by export_chrome_trace()",
                         given=str(path), fix=f"check the file ({exc.__class__.__name__})") from None
    return trace


def _complete_events(trace: dict) -> list[dict]:
    """The trace's spans: complete events ("X") with a start and a duration."""
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and "ts" in e and "dur" in e]


def _to_wall_us(spans: list[dict], marker: str, wall_ns: int, path) -> float:
    """What to add to this trace's timestamps (µs) to put them on the wall clock: the span
    named marker opened at wall_ns."""
    at = [e for e in spans if e.get("name") == marker]
    if not at:
        raise InputError("marker", expected=f"a span named {marker!r} in the trace", given=str(path),
                         fix="open it with record_function(marker) inside the profiled region")
    return wall_ns / 1e3 - float(at[0]["ts"])


def trace_events(path: str | os.PathLike, *, marker: tuple[str, int]) -> list[dict]:
    """Every span of a torch.profiler Chrome trace, on the wall clock.

    A trace's timestamps are the profiler's own; several ranks' traces go on one clock
    through a marker: the span named marker[0], which the rank opened at wall-clock time
    marker[1] (time.time_ns()), e.g. `with record_function("clock"): t_ns = time.time_ns()`.

    Returns:
        [{"name", "tid", "start", "end"}], times in seconds of time.time(), sorted by start.
    """
    spans = _complete_events(_read_trace(path))
    shift = _to_wall_us(spans, marker[0], marker[1], path)
    out = [{"name": str(e.get("name", "")), "tid": str(e.get("tid", "")),
            "start": (float(e["ts"]) + shift) / 1e6, "end": (float(e["ts"]) + float(e["dur"]) + shift) / 1e6}
           for e in spans]
    return sorted(out, key=lambda e: e["start"])


def merge_traces(traces: dict[int, tuple[str | os.PathLike, int]], out: str | os.PathLike, *,
                 marker: str = "clock") -> Path:
    """One Chrome trace of every rank's, on one clock: rank r is process r ("rank r").

    Args:
        traces: {rank: (trace path, wall-clock ns at which the rank opened the marker span)}.
        out: the merged file; open it in https://ui.perfetto.dev or chrome://tracing.
    """
    events: list[dict] = []
    for rank in sorted(traces):
        path, wall_ns = traces[rank]
        spans = _complete_events(_read_trace(path))
        shift = _to_wall_us(spans, marker, wall_ns, path)
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        events += [dict(e, pid=rank, ts=float(e["ts"]) + shift) for e in spans]
    origin = min((e["ts"] for e in events if "ts" in e), default=0.0)
    for e in events:
        if "ts" in e:
            e["ts"] = round(e["ts"] - origin, 3)
    path = Path(out)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


def is_comm(name: str, comm_match: Sequence[str] = COMM_MATCH) -> bool:
    """A trace event that is the communication itself (gloo:all_reduce on CPU), not the op
    that queued it (c10d::allreduce_)."""
    return any(m in name for m in comm_match) and not name.startswith("c10d::")


def trace_spans(path: str | os.PathLike, *,
                compute_prefix: str = "autograd::engine::evaluate_function: ",
                comm_match: Sequence[str] = COMM_MATCH) -> dict:
    """Backward ops and all-reduces from a torch.profiler Chrome trace.

    Args:
        path: the file written by prof.export_chrome_trace().
        compute_prefix: name prefix of the autograd engine's events (one per backward op).
        comm_match: substrings naming communication events (gloo:all_reduce on CPU).

    Returns:
        {"compute": [(op, start_s, end_s)], "comm": [(name, start_s, end_s, thread)]},
        times in seconds from the first event of the trace.
    """
    spans = _complete_events(_read_trace(path))
    if not spans:
        return {"compute": [], "comm": []}
    t0 = min(float(e["ts"]) for e in spans)
    compute, comm = [], []
    for e in spans:
        start = (float(e["ts"]) - t0) / 1e6
        end = start + float(e["dur"]) / 1e6
        name = str(e.get("name", ""))
        if name.startswith(compute_prefix):
            compute.append((name[len(compute_prefix):], start, end))
        elif is_comm(name, comm_match):
            comm.append((name, start, end, str(e.get("tid", ""))))
    compute.sort(key=lambda s: s[1])
    comm.sort(key=lambda s: s[1])
    return {"compute": compute, "comm": comm}
