"""Lesson 07's pipeline bubble: GPipe's formulas, the schedule replayed with measured
compute times, and the tables and plots of pipeline.py's records.

lesson07.py imports these for the notebook (L.bubble_table); the rank scripts do not.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

from labutils.course.tables import text_table


def _records(records: Iterable[dict], part: str) -> list[dict]:
    """The records of one part of pipeline.py, by rank (= stage)."""
    return sorted((r for r in records if r.get("part") == part), key=lambda r: r["rank"])


def bubble_of_step(record: dict) -> dict:
    """idle = step - busy; as a fraction of the step, and relative to the busy time."""
    idle = record["step_s"] - record["busy_s"]
    return {"idle_fraction": idle / record["step_s"], "idle_over_busy": idle / record["busy_s"]}


def bubble_formulas(stages: int, micro: int) -> dict:
    """GPipe's idle fraction of the step, (p-1)/(m+p-1), and the bubble relative to
    the ideal compute time, (p-1)/m: the same schedule, two denominators."""
    return {"idle_fraction": (stages - 1) / (micro + stages - 1), "idle_over_busy": (stages - 1) / micro}


def gpipe_replay(forward_s: Sequence[Sequence[float]], backward_s: Sequence[Sequence[float]]) -> dict:
    """The GPipe schedule replayed with given compute times and free communication.

    Args:
        forward_s: per stage, the forward time of each micro-batch (index = micro-batch).
        backward_s: per stage, the backward time of each micro-batch (index = micro-batch).

    Returns:
        {"step_s": the step's length, "idle_fraction": [per stage, idle / step]}. A
        stage's forward of micro-batch i starts when its previous forward ended and the
        stage before has sent i; backwards run from the last micro-batch down, each when
        the stage's previous work ended and the stage after has sent the gradient.
    """
    stages, micro = len(forward_s), len(forward_s[0])
    if len(backward_s) != stages or any(len(f) != micro or len(b) != micro for f, b in zip(forward_s, backward_s)):
        raise ValueError("gpipe_replay: forward_s and backward_s need one list of m times per stage")
    f_end = [[0.0] * micro for _ in range(stages)]
    b_end = [[0.0] * micro for _ in range(stages)]
    for s in range(stages):
        free = 0.0
        for i in range(micro):
            start = max(free, f_end[s - 1][i] if s else 0.0)
            free = f_end[s][i] = start + forward_s[s][i]
    for s in reversed(range(stages)):
        free = f_end[s][-1]
        for i in reversed(range(micro)):
            start = max(free, b_end[s + 1][i] if s < stages - 1 else 0.0)
            free = b_end[s][i] = start + backward_s[s][i]
    step = max(b_end[s][0] for s in range(stages))
    busy = [sum(forward_s[s]) + sum(backward_s[s]) for s in range(stages)]
    return {"step_s": step, "idle_fraction": [1 - b / step for b in busy]}


def _replayed_idle(steps: list[dict]) -> dict[int, float]:
    """{stage: idle fraction} of gpipe_replay fed with the spans of one step's records."""
    by_stage = sorted(steps, key=lambda r: r["rank"])
    micro = by_stage[0]["micro"]
    fwd = [[0.0] * micro for _ in by_stage]
    bwd = [[0.0] * micro for _ in by_stage]
    for s, rec in enumerate(by_stage):
        for span in rec["spans"]:
            (fwd if span["kind"] == "F" else bwd)[s][span["micro"]] = span["end"] - span["start"]
    replay = gpipe_replay(fwd, bwd)
    return {rec["rank"]: idle for rec, idle in zip(by_stage, replay["idle_fraction"])}


def bubble_rows(records: Iterable[dict]) -> list[dict]:
    """Per micro-batch count and rank: the median over the timed steps, and the formulas."""
    steps: dict[tuple[int, int], list[dict]] = {}
    replayed: dict[tuple[int, int], list[float]] = {}
    for r in _records(records, "step"):
        steps.setdefault((r["micro"], r["rank"]), []).append(r)
    for micro, repeat in {(r["micro"], r["repeat"]) for r in _records(records, "step")}:
        same_step = [r for r in _records(records, "step") if r["micro"] == micro and r["repeat"] == repeat]
        for rank, idle in _replayed_idle(same_step).items():
            replayed.setdefault((micro, rank), []).append(idle)
    rows = []
    for (micro, rank), recs in sorted(steps.items()):
        measured = [bubble_of_step(r) for r in recs]
        rows.append({
            "micro": micro, "rank": rank, "stages": recs[0]["stages"],
            "step_s": statistics.median(r["step_s"] for r in recs),
            "idle_fraction": statistics.median(m["idle_fraction"] for m in measured),
            "idle_over_busy": statistics.median(m["idle_over_busy"] for m in measured),
            "replayed_idle_fraction": statistics.median(replayed[(micro, rank)]),
            **{f"formula_{k}": v for k, v in bubble_formulas(recs[0]["stages"], micro).items()},
        })
    return rows


def bubble_table(records: Iterable[dict]) -> str:
    """Per micro-batch count and stage: measured idle share and ratio, the formulas, and
    the schedule replayed with the measured compute times (gpipe_replay)."""
    rows = [[r["micro"], r["rank"], f"{r['step_s'] * 1e3:.0f}", f"{r['idle_fraction']:.0%}",
             f"{r['formula_idle_fraction']:.0%}", f"{r['replayed_idle_fraction']:.0%}",
             f"{r['idle_over_busy']:.0%}", f"{r['formula_idle_over_busy']:.0%}"]
            for r in bubble_rows(records)]
    return text_table(["m", "stage", "step (ms)", "idle / step", "(p-1)/(m+p-1)", "replayed",
                       "idle / busy", "(p-1)/m"], rows, right=[0, 1, 2, 3, 4, 5, 6, 7])


def _shares(records: Iterable[dict]) -> tuple[list[int], list[int], dict[tuple[int, int], dict]]:
    rows = bubble_rows(records)
    return (sorted({r["micro"] for r in rows}), sorted({r["rank"] for r in rows}),
            {(r["micro"], r["rank"]): r for r in rows})


def bubble_shrinks(records: Iterable[dict]) -> str:
    """Whether both measured shares shrank on every stage at each step from the fewest
    micro-batches up to 4, as the formulas predict (by a wide margin at these m)."""
    micros, ranks, at = _shares(records)
    low = [m for m in micros if m <= 4]
    shrank = all(at[(a, s)][key] > at[(b, s)][key] for a, b in zip(low, low[1:]) for s in ranks
                 for key in ("idle_fraction", "idle_over_busy"))
    return (f"idle / step and idle / busy shrink on every stage from m = {low[0]} to "
            f"m = {low[-1]}: {shrank}")


def _trend(before: dict, after: dict) -> str:
    change = after["idle_fraction"] - before["idle_fraction"]
    return "about the same" if abs(change) < 0.01 else "grew" if change > 0 else "shrank"


def bubble_beyond(records: Iterable[dict]) -> str:
    """What the measured idle share and the step did beyond 4 micro-batches, where the
    costs paid per micro-batch can outweigh a smaller bubble (one line per doubling)."""
    micros, ranks, at = _shares(records)
    lines = []
    for a, b in zip(micros, micros[1:]):
        if b <= 4:
            continue
        moves = ", ".join(f"stage {s} {at[(a, s)]['idle_fraction']:.0%} -> "
                          f"{at[(b, s)]['idle_fraction']:.0%} ({_trend(at[(a, s)], at[(b, s)])})"
                          for s in ranks)
        lines.append(f"from m = {a} to m = {b}, idle / step: {moves}; the step "
                     f"{at[(a, ranks[0])]['step_s'] * 1e3:.0f} -> {at[(b, ranks[0])]['step_s'] * 1e3:.0f} ms")
    return "\n".join(lines)


def pipeline_checks(records: Iterable[dict]) -> str:
    rows = {}
    for r in _records(records, "check"):
        rows.setdefault(r["micro"], []).append(r["verdict"])
    return text_table(["micro-batches", *(f"stage {i} gradients" for i in range(len(next(iter(rows.values())))))],
                      [[m, *v] for m, v in sorted(rows.items())], right=[0])


def plot_bubble(records: Iterable[dict]):
    """Measured idle fraction per stage against micro-batches, with both formulas."""
    import matplotlib.pyplot as plt

    rows = bubble_rows(records)
    micros = sorted({r["micro"] for r in rows})
    stages = rows[0]["stages"]
    fig, axes = plt.subplots(1, 2, figsize=(12.0, 4.2))
    for ax, key, formula in ((axes[0], "idle_fraction", "(p-1)/(m+p-1)"), (axes[1], "idle_over_busy", "(p-1)/m")):
        for rank in sorted({r["rank"] for r in rows}):
            pts = [r for r in rows if r["rank"] == rank]
            ax.plot([r["micro"] for r in pts], [r[key] for r in pts], "o-", color=f"C{rank}",
                    label=f"measured, stage {rank}")
            if key == "idle_fraction":
                ax.plot([r["micro"] for r in pts], [r["replayed_idle_fraction"] for r in pts], "x:",
                        color=f"C{rank}", label=f"replayed from stage {rank}'s measured times")
        fine = [m / 4 for m in range(4, 4 * max(micros) + 1)]
        ax.plot(fine, [bubble_formulas(stages, m)[key] for m in fine], "k--", label=f"{formula}, p={stages}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(micros, [str(m) for m in micros])
        ax.set_xlabel("micro-batches per step (m)")
        ax.set_ylim(0, None)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("idle time / step time")
    axes[0].set_title("the bubble as a share of the step")
    axes[1].set_ylabel("idle time / busy time")
    axes[1].set_title("the bubble relative to the compute")
    fig.tight_layout()
    return fig


def plot_schedule(records: Iterable[dict], *, micro: int):
    """The quickest timed step with `micro` micro-batches (the one a busy machine
    disturbed least): what each stage computed when."""
    import matplotlib.pyplot as plt

    steps = [r for r in _records(records, "step") if r["micro"] == micro]
    quickest = min({r["repeat"] for r in steps},
                   key=lambda rep: max(r["step_s"] for r in steps if r["repeat"] == rep))
    recs = [r for r in steps if r["repeat"] == quickest]
    fig, ax = plt.subplots(figsize=(12.0, 1.0 + 0.8 * len(recs)))
    colors = {"F": "tab:blue", "B": "tab:orange"}
    for r in recs:
        y = r["rank"]
        for s in r["spans"]:
            ax.broken_barh([(s["start"] * 1e3, (s["end"] - s["start"]) * 1e3)], (y - 0.35, 0.7),
                           facecolors=colors[s["kind"]], edgecolor="black", linewidth=0.4)
            ax.text((s["start"] + s["end"]) / 2 * 1e3, y, f"{s['kind']}{s['micro']}", ha="center", va="center",
                    fontsize=7, color="white")
        ax.axvline(r["step_s"] * 1e3, color="gray", linestyle="--", linewidth=1)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=colors["F"], label="forward of micro-batch i"),
                       Patch(color=colors["B"], label="backward of micro-batch i")],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.set_yticks([r["rank"] for r in recs], [f"stage {r['rank']}" for r in recs])
    ax.invert_yaxis()
    ax.set_xlabel("time since the step started (ms); dashed: the step's end")
    ax.set_title(f"one GPipe step, {micro} micro-batches, {len(recs)} stages (white space: the bubble)")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    return fig
