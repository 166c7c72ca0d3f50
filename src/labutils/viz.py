"""The plots the lessons share, one function per plot, each with its input checks.

Plots (add new ones as their own section, same habits: checked inputs, axis labels
with units, a title, a legend, a size readable in a notebook):

- plot_bandwidth: time per call and bus bandwidth against message size, log-log,
  one line per algorithm, with fitted alpha-beta models (lesson 02; lesson 03
  reads its bucket-size curve against it).

Every function returns the matplotlib Figure (created with pyplot, so a notebook
shows it at the end of the cell); call plt.close(fig) when drawing many.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from labutils.errors import InputError
from labutils.timing import AlphaBeta, busbw, busbw_factor, format_bytes, format_rate, format_seconds

__all__ = ["plot_bandwidth"]

FIGSIZE_WIDE = (12.0, 4.6)  # two panels side by side, readable in a notebook column


# ----------------------------------------------------------------------------- bandwidth

def _check_series(series) -> dict[str, tuple[list[float], list[float]]]:
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
        checked[str(name)] = (sizes, seconds)
    return checked


def plot_bandwidth(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    world_size: int,
    collective: str = "all_reduce",
    fits: Mapping[str, AlphaBeta] | None = None,
    title: str | None = None,
):
    """Two log-log panels: seconds per call, and busbw, against message size.

    Args:
        series: {algorithm name: (sizes in bytes, seconds per call)}.
        world_size: ranks that took part (sets the busbw factor).
        collective: the collective measured, a key of timing.BUSBW_FACTORS.
        fits: {algorithm name: AlphaBeta} drawn as dashed lines on the time panel
            and named in the legend with their alpha and beta.
        title: the figure title; default names the collective and world size.

    Returns:
        The matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    data = _check_series(series)
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
    for name, (sizes, seconds) in data.items():
        order = sorted(range(len(sizes)), key=sizes.__getitem__)
        xs = [sizes[i] for i in order]
        ts = [seconds[i] for i in order]
        (line,) = ax_t.plot(xs, ts, "o-", label=name, markersize=4)
        bws = [busbw(x, t, collective=collective, world_size=world_size) / 1e9 for x, t in zip(xs, ts)]
        ax_bw.plot(xs, bws, "o-", color=line.get_color(), label=name, markersize=4)
        if name in fits:
            fit = fits[name]
            lo, hi = xs[0], xs[-1]
            grid = [lo * (hi / lo) ** (i / 60) for i in range(61)] if hi > lo else [lo]
            ax_t.plot(grid, [fit.predict(x) for x in grid], "--", color=line.get_color(), alpha=0.7,
                      label=f"{name} fit: α={format_seconds(fit.alpha_s)}, β={format_rate(fit.beta_Bps)}")
    for ax in (ax_t, ax_bw):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(True, which="major", alpha=0.3)
        ax.set_xlabel("message size (bytes, whole array)")
        ticks = _size_ticks(min(min(s) for s, _ in data.values()), max(max(s) for s, _ in data.values()))
        ax.set_xticks(ticks, [format_bytes(t) for t in ticks], rotation=30)
        ax.legend(fontsize=8)
    ax_t.set_ylabel("time per call (seconds)")
    ax_t.set_title("time per call: latency (flat) then bandwidth (slope 1)")
    ax_bw.set_ylabel(f"busbw (GB/s) = algbw × {factor:.3g}")
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
