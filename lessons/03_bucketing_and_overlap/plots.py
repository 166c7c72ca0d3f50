"""Lesson 03's plots: DDP's buckets, one backward pass on a time axis, the bucket-cap sweep.

- plot_bucket_sizes: DDP's buckets per setting as cut bars, with the cap.
- plot_overlap_timeline: backward compute and all-reduces on one time axis.
- plot_bucket_sweep: step time against bucket_cap_mb, measured and predicted.

lesson03.py turns the runs' records into their inputs (bucket_sizes_for_plot,
timeline_lanes, trace_lanes, sweep_series). Each returns the matplotlib Figure, drawn with
the habits of labutils.course.viz (checked inputs, units, a legend).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from labutils.course.viz import check_series
from labutils.errors import InputError

__all__ = ["plot_bucket_sizes", "plot_overlap_timeline", "plot_bucket_sweep"]


def _check_spans(name: str, lanes) -> dict[str, list[tuple[float, float]]]:
    """{lane: [(start, end), ...]} with finite numbers and end >= start."""
    if not isinstance(lanes, Mapping):
        raise InputError(name, expected="a dict {lane label: [(start_s, end_s), ...]}", given=lanes,
                         fix='pass e.g. {"fc2": [(0.001, 0.004)]}')
    checked = {}
    for lane, spans in lanes.items():
        try:
            pairs = [(float(a), float(b)) for a, b in spans]
        except (TypeError, ValueError):
            raise InputError(f"{name}[{lane!r}]", expected="a list of (start_s, end_s) pairs",
                             given=spans, fix="pass two numbers per span") from None
        if any(not (math.isfinite(a) and math.isfinite(b)) or b < a for a, b in pairs):
            raise InputError(f"{name}[{lane!r}]", expected="finite spans with end >= start",
                             given=pairs, fix="drop unfinished spans (end None) before plotting")
        checked[str(lane)] = pairs
    return checked


# ----------------------------------------------------------------------- bucket sizes

def plot_bucket_sizes(
    buckets: Mapping[str, Sequence[int]],
    *,
    caps: Mapping[str, float] | None = None,
    labels: Mapping[str, Sequence[str]] | None = None,
    title: str = "DDP's buckets: one bar per setting, one segment per bucket",
):
    """One horizontal bar per setting, cut into its buckets (in all-reduce order).

    Args:
        buckets: {setting label: bucket sizes in bytes, in all-reduce order}.
        caps: {setting label: the cap in bytes}, drawn as a red tick on each bar.
        labels: {setting label: one short text per bucket}, written in the segments.
        title: the axes title.

    Returns:
        The matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    if not isinstance(buckets, Mapping) or not buckets:
        raise InputError("buckets", expected="a dict {setting: [bytes per bucket]} with at least one entry",
                         given=buckets, fix='pass e.g. {"cap 1 MiB": [2119720, 4198400]}')
    for key, sizes in buckets.items():
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes or any(
                isinstance(s, bool) or not isinstance(s, (int, float)) or s <= 0 for s in sizes):
            raise InputError(f"buckets[{key!r}]", expected="a non-empty list of sizes in bytes > 0",
                             given=sizes, fix="pass the bucket sizes DDP reported")
    caps, labels = dict(caps or {}), dict(labels or {})
    for what, extra in (("caps", caps), ("labels", labels)):
        unknown = sorted(set(extra) - set(buckets))
        if unknown:
            raise InputError(what, expected=f"keys among {sorted(buckets)}", given=unknown,
                             fix="use the same setting labels as buckets")
    for key, texts in labels.items():
        if len(texts) != len(buckets[key]):
            raise InputError(f"labels[{key!r}]", expected=f"{len(buckets[key])} texts (one per bucket)",
                             given=len(texts), fix="give every bucket one label")

    rows = list(buckets)
    fig, ax = plt.subplots(figsize=(11.0, 0.9 + 0.75 * len(rows)))
    cmap = plt.get_cmap("tab10")
    mib = 2.0 ** 20
    for y, key in enumerate(rows):
        left = 0.0
        for i, size in enumerate(buckets[key]):
            width = size / mib
            ax.barh(y, width, left=left, height=0.6, color=cmap(i % 10), edgecolor="white")
            text = labels[key][i] if key in labels else f"b{i}"
            ax.text(left + width / 2, y, text, ha="center", va="center", fontsize=8, clip_on=True)
            left += width
        if key in caps and caps[key]:
            cap = caps[key] / mib
            ax.plot([cap, cap], [y - 0.42, y + 0.42], color="red", linewidth=1.5, linestyle="--")
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("bucket contents (MiB of gradients), in the order buckets are all-reduced")
    ax.set_title(title + ("; red tick: the cap" if caps else ""))
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------- overlap timeline

def plot_overlap_timeline(
    compute: Mapping[str, Sequence[tuple[float, float]]],
    comm: Mapping[str, Sequence[tuple[float, float]]],
    *,
    t0: float | None = None,
    marks: Mapping[str, float] | None = None,
    title: str = "one backward pass: compute and all-reduce on one time axis",
):
    """Backward compute and all-reduces as bars on one time axis, one lane each.

    Args:
        compute: {lane label: [(start_s, end_s), ...]}: e.g. one lane per layer's
            backward (from hooks) or one lane of autograd ops (from a profiler trace).
        comm: {lane label: [(start_s, end_s), ...]}: e.g. one lane per bucket.
        t0: the time shown as 0 (seconds, same clock); default: the earliest start.
        marks: {label: time_s} drawn as dashed vertical lines (e.g. backward returns).
        title: the axes title.

    Returns:
        The matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    comp = _check_spans("compute", compute)
    com = _check_spans("comm", comm)
    starts = [a for spans in (*comp.values(), *com.values()) for a, _ in spans]
    if not starts:
        raise InputError("compute/comm", expected="at least one span", given=(compute, comm),
                         fix="record a backward pass first")
    marks = dict(marks or {})
    if any(not isinstance(v, (int, float)) or not math.isfinite(v) for v in marks.values()):
        raise InputError("marks", expected="{label: time in seconds}", given=marks,
                         fix="pass finite times on the same clock as the spans")
    origin = min(starts) if t0 is None else float(t0)
    lanes = [("compute", k, v) for k, v in comp.items()] + [("comm", k, v) for k, v in com.items()]
    colors = {"compute": "tab:blue", "comm": "tab:orange"}
    fig, ax = plt.subplots(figsize=(12.0, 1.2 + 0.42 * len(lanes)))
    for y, (kind, label, spans) in enumerate(lanes):
        bars = [((a - origin) * 1e3, (b - a) * 1e3) for a, b in spans]
        ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=colors[kind], edgecolor="black", linewidth=0.3)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=colors["compute"], label="backward compute"),
               Patch(color=colors["comm"], label="all-reduce")]
    for i, (label, t) in enumerate(marks.items()):
        style = ("--", ":", "-.")[i % 3]
        x = (t - origin) * 1e3
        ax.axvline(x, color="gray", linestyle=style, linewidth=1.2)
        handles.append(Line2D([], [], color="gray", linestyle=style, label=f"{label} ({x:.1f} ms)"))
    ax.set_yticks(range(len(lanes)), [label for _, label, _ in lanes])
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------- bucket-cap sweep

def plot_bucket_sweep(
    measured: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    predicted: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
    compute_only: Mapping[str, float] | None = None,
    title: str = "step time against bucket_cap_mb",
    perfect: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
):
    """Step time against bucket cap, one colour per model, log-scaled cap axis.

    Args:
        measured: {model label: (caps in MiB, seconds per step)}: solid lines.
        predicted: {model label: (caps in MiB, seconds)}: dashed lines, the step
            predicted without overlap (compute plus every bucket's all-reduce).
        compute_only: {model label: seconds per step without communication}: dotted
            horizontal lines.
        title: the axes title.
        perfect: {model label: (caps in MiB, seconds)}: dash-dotted lines, the step
            predicted with perfect overlap; shaded up to `predicted` where both exist.

    Returns:
        The matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    data = check_series(measured)
    pred = check_series(predicted) if predicted else {}
    best = check_series(perfect) if perfect else {}
    floor = dict(compute_only or {})
    for what, extra in (("predicted", pred), ("perfect", best), ("compute_only", floor)):
        unknown = sorted(set(extra) - set(data))
        if unknown:
            raise InputError(what, expected=f"model labels among {sorted(data)}", given=unknown,
                             fix="use the same labels as measured")
    fig, ax = plt.subplots(figsize=(9.0, 4.8))
    for name, (caps, seconds) in data.items():  # every series in cap order (check_series)
        (line,) = ax.plot(caps, _ms(seconds), "o-", label=f"{name}: measured")
        if name in pred:
            ax.plot(pred[name][0], _ms(pred[name][1]), "--", color=line.get_color(),
                    label=f"{name}: predicted, no overlap")
        if name in best:
            best_caps, best_seconds = best[name]
            ax.plot(best_caps, _ms(best_seconds), "-.", color=line.get_color(),
                    label=f"{name}: predicted, perfect overlap")
            if name in pred and pred[name][0] == best_caps:
                ax.fill_between(best_caps, _ms(best_seconds), _ms(pred[name][1]),
                                color=line.get_color(), alpha=0.12)
        if name in floor:
            ax.axhline(floor[name] * 1e3, linestyle=":", color=line.get_color(),
                       label=f"{name}: compute only (no_sync)")
    ax.set_xscale("log", base=2)
    ticks = sorted({c for caps, _ in data.values() for c in caps})
    ax.set_xticks(ticks, [f"1/{1 / c:g}" if c < 1 else f"{c:g}" for c in ticks])
    ax.minorticks_off()
    ax.set_xlabel("bucket_cap_mb (MiB)")
    ax.set_ylabel("time per training step (ms)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    return fig


def _ms(seconds: Sequence[float]) -> list[float]:
    """Seconds as milliseconds, the unit of the sweep's y axis."""
    return [s * 1e3 for s in seconds]
