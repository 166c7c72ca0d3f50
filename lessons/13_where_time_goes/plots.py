"""Lesson 13's plot: one training step of every rank on one time axis.

lesson13.timeline_lanes(run) gives the input: per rank, the spans of each phase of its own
work and of its all-reduces, on one clock. Returns the matplotlib Figure.
"""

from __future__ import annotations

from collections.abc import Mapping

from labutils.errors import InputError

__all__ = ["plot_rank_timeline"]

COLORS = {"data": "tab:gray", "forward": "tab:green", "backward ops": "tab:blue",
          "optimizer": "tab:purple", "all-reduce": "tab:orange"}


def plot_rank_timeline(runs: Mapping[str, tuple[Mapping[int, Mapping[str, list]], float]], *,
                       title: str = "one step of every rank"):
    """One panel per run; in each, two lanes per rank: its own work, coloured by phase,
    and its all-reduces in flight.

    Args:
        runs: {panel title: (lanes, t0)} with lanes {rank: {phase: [(start_s, end_s)]}}
            (phases: data, forward, backward ops, optimizer, all-reduce) and t0 the time
            shown as 0, as lesson13.timeline_lanes returns them.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not runs or not all(isinstance(v, tuple) and len(v) == 2 for v in runs.values()):
        raise InputError("runs", expected="{title: (lanes, t0)} from lesson13.timeline_lanes",
                         given=runs, fix="pass e.g. {'one bucket': L.timeline_lanes(run)}")
    fig, axes = plt.subplots(len(runs), 1, figsize=(12.0, 0.9 + 1.3 * sum(len(v[0]) for v in runs.values())),
                             squeeze=False, sharex=True)
    for ax, (panel, (lanes, t0)) in zip(axes[:, 0], runs.items()):
        labels = []
        for rank in sorted(lanes):
            for kind in ("work", "comm"):
                y = len(labels)
                for phase, spans in lanes[rank].items():
                    if (phase == "all-reduce") != (kind == "comm"):
                        continue
                    if phase not in COLORS:
                        raise InputError("runs", expected=f"phases among {sorted(COLORS)}", given=phase,
                                         fix="use lesson13.timeline_lanes")
                    bars = [((a - t0) * 1e3, (b - a) * 1e3) for a, b in spans]
                    ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=COLORS[phase], edgecolor="black",
                                   linewidth=0.3)
                labels.append(f"rank {rank} " + ("work" if kind == "work" else "all-reduce"))
        ax.set_yticks(range(len(labels)), labels)
        ax.set_ylim(-0.6, len(labels) - 0.4)
        ax.invert_yaxis()
        ax.grid(True, axis="x", alpha=0.3)
        ax.set_title(panel, fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("time from the step's start (ms)")
    fig.legend(handles=[Patch(color=c, label=p) for p, c in COLORS.items()], loc="upper right", fontsize=8,
               ncols=len(COLORS))
    fig.suptitle(title, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig
