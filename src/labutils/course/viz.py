"""The plots the lessons share, one function per plot, each with its input checks.

Plots (add new ones as their own section, same habits: checked inputs, axis labels
with units, a title, a legend, a size readable in a notebook):

- plot_bandwidth: time per call and bus bandwidth against message size, log-log,
  one line per algorithm, with fitted alpha-beta models (lesson 02; lesson 03
  reads its bucket-size curve against it).
- plot_ownership: which rank saw which item, per epoch (lesson 04).
- plot_loss_across_restarts: loss against step, one line per torchrun restart (lesson 05).
- plot_scaling: time per step and strong/weak scaling efficiency against ranks (lesson 06).

These draw measurements any run can make (bandwidth curves, who saw which item, a run
with restarts, scaling). A plot of one lesson's own subject lives in that lesson's
folder: lesson 03's DDP buckets, overlap timeline and bucket-cap sweep are in
lessons/03_bucketing_and_overlap/plots.py; their old names here still find them
(MOVED_TO_LESSONS).

Every function returns the matplotlib Figure (created with pyplot, so a notebook
shows it at the end of the cell); call plt.close(fig) when drawing many.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from labutils.course.tables import significant
from labutils.course.timing import (
    AlphaBeta,
    busbw,
    busbw_factor,
    format_bytes,
    format_rate,
    format_seconds,
)
from labutils.errors import InputError, whole_number

__all__ = [
    "plot_bandwidth", "plot_ownership", "plot_loss_across_restarts", "plot_scaling", "check_series",
]

FIGSIZE_WIDE = (12.0, 4.6)  # two panels side by side, readable in a notebook column
# The bandwidth plot's units, so that it can read in the units of the tables beside it.
TIME_UNITS = {"s": 1.0, "ms": 1e3, "µs": 1e6}
RATE_UNITS = {"MB/s": 1e6, "GB/s": 1e9}


# ----------------------------------------------------------------------------- bandwidth

def check_series(series) -> dict[str, tuple[list[float], list[float]]]:
    """{name: (sizes, seconds)} as lists of positive numbers, one time per size (for log
    axes), each series sorted by size so that its line runs left to right.

    Args:
        series: {name: (x values, y values)} as the plots take it.

    Returns:
        {name as str: (list of x, list of y)}, in x order.
    """
    if not isinstance(series, Mapping) or not series:
        raise InputError("series", expected="a dict {name: (sizes_in_bytes, seconds)} with at least one entry",
                         given=series, fix='pass e.g. {"ring": ([8, 1024], [1e-4, 2e-4])}')
    checked = {}
    for name, pair in series.items():
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise InputError(f"series[{name!r}]", expected="a pair (sizes_in_bytes, seconds)",
                             given=pair, fix="pass two equally long lists")
        try:
            sizes, seconds = (list(v) for v in pair)
        except TypeError:
            raise InputError(f"series[{name!r}]", expected="a pair (sizes_in_bytes, seconds) of lists",
                             given=pair, fix="pass two equally long lists") from None
        if not sizes or len(sizes) != len(seconds):
            raise InputError(f"series[{name!r}]", expected="equally long, non-empty sizes and times",
                             given=f"{len(sizes)} sizes, {len(seconds)} times",
                             fix="pass one time per size")
        for label, values in (("sizes", sizes), ("seconds", seconds)):
            if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 for v in values):
                raise InputError(f"series[{name!r}] {label}", expected="numbers > 0 (log axes)",
                                 given=values, fix="drop zero or negative measurements")
        xs, ys = zip(*sorted(zip(sizes, seconds)))
        checked[str(name)] = (list(xs), list(ys))
    return checked


def plot_bandwidth(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    world_size: int,
    collective: str = "all_reduce",
    fits: Mapping[str, AlphaBeta] | None = None,
    title: str | None = None,
    time_unit: str = "s",
    rate_unit: str = "GB/s",
):
    """Two log-log panels: time per call, and busbw, against message size.

    Args:
        series: {algorithm name: (sizes in bytes, seconds per call)}.
        world_size: ranks that took part (sets the busbw factor).
        collective: the collective measured, a key of timing.BUSBW_FACTORS.
        fits: {algorithm name: AlphaBeta} drawn as dashed lines on the time panel
            and named in the legend with their alpha and beta.
        title: the figure title; default names the collective and world size.
        time_unit: the time axis's unit, a key of TIME_UNITS ("s", "ms", "µs").
        rate_unit: busbw's and the fits' beta's unit, "GB/s" (1e9 bytes per second) or
            "MB/s" (1e6).

    Returns:
        The matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    for name, value, units in (("time_unit", time_unit, TIME_UNITS), ("rate_unit", rate_unit, RATE_UNITS)):
        if value not in units:
            raise InputError(name, expected=f"one of {', '.join(map(repr, units))}", given=value,
                             fix="name a unit the tables beside the plot use")
    per_s, per_Bps = TIME_UNITS[time_unit], RATE_UNITS[rate_unit]
    data = check_series(series)
    factor = busbw_factor(collective, world_size)
    fits = dict(fits or {})
    unknown = sorted(set(fits) - set(data))
    if unknown:
        raise InputError("fits", expected=f"names among {sorted(data)}", given=unknown,
                         fix="fit the same algorithms you plot")
    if any(not isinstance(f, AlphaBeta) for f in fits.values()):
        raise InputError("fits", expected="AlphaBeta values (from timing.fit_alpha_beta)",
                         given=fits, fix="pass {name: fit_alpha_beta(sizes, seconds)}")

    fig, (ax_t, ax_bw) = plt.subplots(1, 2, figsize=FIGSIZE_WIDE)
    for name, (xs, ts) in data.items():
        (line,) = ax_t.plot(xs, [t * per_s for t in ts], "o-", label=name, markersize=4)
        bws = [busbw(x, t, collective=collective, world_size=world_size) / per_Bps for x, t in zip(xs, ts)]
        ax_bw.plot(xs, bws, "o-", color=line.get_color(), label=name, markersize=4)
        if name in fits:
            fit = fits[name]
            lo, hi = xs[0], xs[-1]
            grid = [lo * (hi / lo) ** (i / 60) for i in range(61)] if hi > lo else [lo]
            alpha = (format_seconds(fit.alpha_s) if time_unit == "s"
                     else f"{significant(fit.alpha_s * per_s)} {time_unit}")
            beta = (format_rate(fit.beta_Bps) if rate_unit == "GB/s"
                    else f"{significant(fit.beta_Bps / per_Bps)} {rate_unit}")
            ax_t.plot(grid, [fit.predict(x) * per_s for x in grid], "--", color=line.get_color(), alpha=0.7,
                      label=f"{name} fit: α={alpha}, β={beta}")
    for ax in (ax_t, ax_bw):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(True, which="major", alpha=0.3)
        ax.set_xlabel("message size (bytes, whole array)")
        ticks = _size_ticks(min(min(s) for s, _ in data.values()), max(max(s) for s, _ in data.values()))
        ax.set_xticks(ticks, [format_bytes(t) for t in ticks], rotation=30)
        ax.legend(fontsize=8)
    ax_t.set_ylabel("time per call (seconds)" if time_unit == "s" else f"time per call ({time_unit})")
    ax_t.set_title("time per call: latency (flat) then bandwidth (slope 1)")
    ax_bw.set_ylabel(f"busbw ({rate_unit}) = algbw × {factor:.3g}")
    ax_bw.set_title("bus bandwidth: higher is better")
    fig.suptitle(title or f"{collective} on {world_size} ranks")
    fig.tight_layout()
    return fig


def _size_ticks(lo: float, hi: float) -> list[float]:
    """Powers of two spanning [lo, hi], thinned to about 8 labels."""
    ticks, t = [], 1.0
    while t < lo:
        t *= 2
    while t <= hi:
        ticks.append(t)
        t *= 2
    step = max(1, len(ticks) // 7)
    return ticks[::step] or [lo]


# ----------------------------------------------------------------------- sampler ownership

def plot_ownership(
    ownership: Mapping[int, Mapping[int, Sequence[int]]],
    *,
    n_items: int,
    title: str | None = None,
):
    """Which rank saw which item, one panel per epoch: rows are ranks, columns the
    position in the rank's shard, each cell the item (number and colour). Items seen
    more than once in an epoch are outlined in red; missing items are named.

    Args:
        ownership: {epoch: {rank: items in the order the rank saw them}}
            (labutils.course.sharding.ownership builds it from records).
        n_items: the dataset's length.
        title: the figure title.

    Returns:
        The matplotlib Figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    from labutils.course.sharding import coverage

    if not isinstance(ownership, Mapping) or not ownership:
        raise InputError("ownership", expected="a dict {epoch: {rank: [items]}} with at least one epoch",
                         given=ownership, fix="build it with labutils.course.sharding.ownership(records)")
    checks = {epoch: coverage(shards, n_items=n_items) for epoch, shards in ownership.items()}
    ranks = sorted({r for shards in ownership.values() for r in shards})
    width = max((len(items) for shards in ownership.values() for items in shards.values()), default=1)
    epochs = list(ownership)
    panel_w, panel_h = 1.4 + 0.5 * width, 1.3 + 0.5 * len(ranks)
    if panel_w * len(epochs) <= 14:  # panels side by side while they fit a notebook's width
        fig, axes = plt.subplots(1, len(epochs), figsize=(max(panel_w * len(epochs), 6.0), panel_h + 0.5),
                                 squeeze=False)
        panels = list(axes[0])
    else:  # long shards: one panel per row
        fig, axes = plt.subplots(len(epochs), 1, figsize=(min(max(panel_w, 6.0), 14.0),
                                                          panel_h * len(epochs) + 0.5), squeeze=False)
        panels = list(axes[:, 0])
    base = plt.get_cmap("tab20")
    cmap = ListedColormap([base(i % 20) for i in range(max(n_items, 1))])
    for ax, epoch in zip(panels, epochs):
        shards = ownership[epoch]
        dup = checks[epoch].duplicated
        for y, rank in enumerate(ranks):
            for x, item in enumerate(shards.get(rank, [])):
                ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, facecolor=cmap(item),
                                           edgecolor="red" if item in dup else "white",
                                           linewidth=2.5 if item in dup else 1))
                ax.text(x, y, str(item), ha="center", va="center", fontsize=9)
        ax.set_xlim(-0.5, width - 0.5)
        ax.set_ylim(len(ranks) - 0.5, -0.5)
        ax.set_xticks(range(width))
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
        ax.set_xlabel("position in the rank's shard")
        check = checks[epoch]
        status = "each item once" if check.exact else (
            (f"missing {check.missing}" if check.missing else "")
            + ("; " if check.missing and dup else "")
            + (f"repeated {sorted(dup)}" if dup else ""))
        ax.set_title(f"epoch {epoch}: {status}", fontsize=9, color="black" if check.exact else "darkred")
        ax.set_aspect("equal")
    fig.suptitle(title or f"which rank saw which item ({n_items} items)")
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------ loss across restarts

def plot_loss_across_restarts(
    records: Sequence[Mapping],
    *,
    reference: Sequence[Mapping] | None = None,
    rank: int = 0,
    title: str = "training loss across restarts",
):
    """Loss against step, one colour per attempt (torchrun restart), with the world
    size of each attempt in the legend; steps an attempt did again after a resume
    overlap the previous attempt's line. An uninterrupted run can be drawn under it.

    Args:
        records: result.records of the run: dicts with "step", "loss" and "restart"
            (and "world_size", optional), from every rank; only `rank`'s are drawn.
        reference: result.records of an uninterrupted run (grey, dashed), or None.
        rank: whose records to draw (losses differ per rank: each has its own batch).
        title: the axes title.

    Returns:
        The matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    def curve(recs, what):
        if isinstance(recs, (str, bytes)) or not isinstance(recs, Sequence):
            raise InputError(what, expected="a list of record dicts (result.records)", given=recs,
                             fix="pass result.records")
        rows = [r for r in recs if isinstance(r, Mapping) and r.get("rank", rank) == rank
                and isinstance(r.get("step"), int) and isinstance(r.get("loss"), (int, float))]
        if not rows:
            raise InputError(what, expected=f"records of rank {rank} with 'step' and 'loss'",
                             given=f"{len(recs)} records", fix="report(step=step, loss=loss.item()) "
                             "in the script, and pass result.records")
        return rows

    rows = curve(records, "records")
    fig, ax = plt.subplots(figsize=(9.0, 4.2))
    if reference is not None:
        ref = sorted(curve(reference, "reference"), key=lambda r: r["step"])
        ax.plot([r["step"] for r in ref], [r["loss"] for r in ref], "--", color="black",
                linewidth=1.2, zorder=3, label="uninterrupted run (on top)")
    attempts = sorted({int(r.get("restart", 0)) for r in rows})
    for attempt in attempts:
        mine = sorted((r for r in rows if int(r.get("restart", 0)) == attempt), key=lambda r: r["step"])
        sizes = sorted({r["world_size"] for r in mine if "world_size" in r})
        world = f", world size {sizes[0]}" if len(sizes) == 1 else ""
        (line,) = ax.plot([r["step"] for r in mine], [r["loss"] for r in mine], "o-", markersize=3,
                          label=f"restart {attempt}: steps {mine[0]['step']}-{mine[-1]['step']}{world}")
        if attempt != attempts[0]:
            ax.axvline(mine[0]["step"] - 0.5, color=line.get_color(), linestyle=":", alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (rank {rank}'s batch)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------ scaling

def _seconds_by_ranks(times) -> bool:
    """Whether times is {ranks >= 1: seconds > 0}."""
    return isinstance(times, Mapping) and all(
        whole_number(n) and n >= 1
        and isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 for n, t in times.items())


def plot_scaling(
    step_seconds: Mapping[str, Mapping[int, float]],
    *,
    title: str = "scaling efficiency",
    predicted: Mapping[str, Mapping[int, float]] | None = None,
    xlabel: str = "ranks",
):
    """Time per step and efficiency against the number of ranks, strong and weak.

    Strong scaling keeps the global batch: ideal time T1/n, efficiency T1/(n*Tn).
    Weak scaling keeps the per-rank batch: ideal time T1, efficiency T1/Tn.

    Args:
        step_seconds: {"strong": {ranks: seconds per step}, "weak": {...}}; either
            key may be left out; each needs ranks = 1.
        title: the figure title.
        predicted: a model's seconds per step, same shape, drawn dotted with crosses
            from the measured baseline (a prediction for 1 rank is not drawn: T1 is
            measured); its efficiency divides the same measured T1.
        xlabel: what the x axis counts (e.g. "hosts (1 rank each)").

    Returns:
        The matplotlib Figure (left: time per step with the ideal; right: efficiency).
    """
    import matplotlib.pyplot as plt

    if not isinstance(step_seconds, Mapping) or not step_seconds or \
            set(step_seconds) - {"strong", "weak"}:
        raise InputError("step_seconds", expected='{"strong": {ranks: seconds}, "weak": {...}}',
                         given=step_seconds, fix='pass e.g. {"strong": {1: 0.1, 2: 0.06}}')
    for kind, times in step_seconds.items():
        if not _seconds_by_ranks(times) or 1 not in times:
            raise InputError(f"step_seconds[{kind!r}]", expected="{ranks >= 1: seconds > 0} including ranks 1",
                             given=times, fix="measure the 1-rank run too: it is the baseline")
    predicted = predicted or {}
    if not isinstance(predicted, Mapping) or set(predicted) - set(step_seconds) or not all(
            _seconds_by_ranks(times) for times in predicted.values()):
        raise InputError("predicted", expected="{kind of step_seconds: {ranks >= 1: seconds > 0}}",
                         given=predicted, fix='pass e.g. {"strong": {2: 0.06, 4: 0.05}}')
    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=FIGSIZE_WIDE)
    for kind, times in step_seconds.items():
        ns = sorted(times)
        t1 = times[1]
        ideal = [t1 / n if kind == "strong" else t1 for n in ns]
        eff = [t1 / (n * times[n]) if kind == "strong" else t1 / times[n] for n in ns]
        (line,) = ax_t.plot(ns, [times[n] * 1e3 for n in ns], "o-", label=f"{kind}: measured")
        ax_t.plot(ns, [t * 1e3 for t in ideal], "--", color=line.get_color(), label=f"{kind}: ideal")
        ax_e.plot(ns, eff, "o-", color=line.get_color(), label=kind)
        for n, e in zip(ns, eff):  # strong's labels above the points, weak's below
            ax_e.annotate(f"{e:.0%}", (n, e), textcoords="offset points",
                          xytext=(0, 6 if kind == "strong" else -13), ha="center", fontsize=8,
                          color=line.get_color())
        if kind in predicted:  # drawn from the measured baseline at 1 rank
            model = {**predicted[kind], 1: t1}
            pn = sorted(model)
            ax_t.plot(pn, [model[n] * 1e3 for n in pn], "x:", color=line.get_color(),
                      label=f"{kind}: predicted")
            ax_e.plot(pn, [t1 / (n * model[n]) if kind == "strong" else t1 / model[n]
                           for n in pn], "x:", color=line.get_color(), label=f"{kind}: predicted")
    ns_all = sorted({n for times in step_seconds.values() for n in times})
    for ax in (ax_t, ax_e):
        ax.set_xticks(ns_all)
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_t.set_ylabel("time per training step (ms)")
    ax_t.set_ylim(bottom=0)
    ax_t.set_title("time per step")
    ax_e.axhline(1.0, color="0.5", linestyle=":")
    ax_e.set_ylabel("efficiency (1 = ideal)")
    ax_e.set_ylim(0, max(1.1, *(ax_e.get_ylim()[1:])))
    ax_e.set_title("strong: T1/(n·Tn)   weak: T1/Tn")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------ plots that moved to a lesson

# {name: (lesson folder, module)}: notebooks saved before a plot moved into its lesson's
# folder import it from here (from labutils.viz import plot_bucket_sizes).
MOVED_TO_LESSONS = {
    "plot_bucket_sizes": ("03_bucketing_and_overlap", "plots"),
    "plot_overlap_timeline": ("03_bucketing_and_overlap", "plots"),
    "plot_bucket_sweep": ("03_bucketing_and_overlap", "plots"),
}


def __getattr__(name: str):
    """A plot that moved into its lesson's folder, loaded from the checkout's lessons/."""
    if name not in MOVED_TO_LESSONS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from labutils.course import lesson

    folder, module = MOVED_TO_LESSONS[name]
    return getattr(lesson.load(lesson.LESSONS_DIR / folder, module), name)
