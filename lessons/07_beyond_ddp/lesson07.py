"""Helpers for the lesson 07 notebook: tables and plots of the runs' records, the
communication formulas of lesson 02 applied to the collectives the ranks logged, the
pipeline bubble, the layout of combined parallelism, and the self-check.

The rank scripts (replica_memory.py, zero_optimizer.py, fsdp_shard.py, fsdp_wire.py,
tensor_parallel.py, pipeline.py) do not import this module; only the notebook does.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path

from labutils.course import selfcheck
from labutils.course.tables import text_table
from labutils.course.timing import busbw_factor, format_bytes

# --------------------------------------------------------------------------- generic


def _part(records: Iterable[dict], part: str) -> list[dict]:
    return sorted((r for r in records if r.get("part") == part), key=lambda r: r["rank"])


def _rank0(records: Iterable[dict], part: str, **match) -> dict:
    return next(r for r in _part(records, part) if r["rank"] == 0 and all(r.get(k) == v for k, v in match.items()))


def _bytes(n: float) -> str:
    return f"{format_bytes(n)} ({int(n):,} B)"


def rank_traffic(call: dict, *, world_size: int, rank: int) -> float:
    """Bytes one rank sends (ring collectives) or receives (broadcast, recv) for one logged
    collective, by lesson 02's formulas; call["nbytes"] is the whole array.

    all_reduce: 2(n-1)/n of it; all_gather, reduce_scatter: (n-1)/n; broadcast: all of
    it for every rank but the source; send and recv: all of it.
    """
    op, nbytes = call["op"], call["nbytes"]
    if op in ("all_reduce", "all_gather_single", "reduce_scatter_single"):
        kind = {"all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter"}.get(op, op)
        return busbw_factor(kind, world_size) * nbytes
    if op == "broadcast":
        return 0.0 if call.get("peer") == rank else float(nbytes)
    if op in ("send", "recv", "isend", "irecv"):
        return float(nbytes)
    raise ValueError(f"rank_traffic: no formula for {op!r}")


# --------------------------------------------------------------------------- 1. replica

def replica_table(records: Iterable[dict]) -> str:
    """What one DDP replica holds: measured bytes against the formula, and whether the
    ranks hold the same values (fingerprints compared across ranks)."""
    recs = _part(records, "replica")
    r0 = recs[0]
    n, tensors = r0["parameter_count"], r0["parameter_tensors"]
    same = {key: len({r["fingerprints"][key] for r in recs}) == 1 for key in r0["fingerprints"]}
    rows = [
        ["parameters", r0["parameters"], "4 B x N", 4 * n, same["parameters"]],
        ["gradients (.grad)", r0["gradients"], "4 B x N", 4 * n, same["gradients"]],
        ["DDP bucket buffers", r0["ddp_buckets"], "4 B x N", 4 * n, same["gradients"]],
        ["Adam state", r0["optimizer_state"], f"8 B x N + 4 B x {tensors} steps", 8 * n + 4 * tensors,
         same["optimizer state"]],
        [f"activations ({r0['batch_size']} x {r0['seq_len']} tokens)", r0["activations"], "measured only", None,
         same["activations (input batch)"]],
    ]
    total = sum(row[1] for row in rows)
    out = [[what, _bytes(got), formula, ("" if want is None else "matches" if want == got else f"differs ({want:,})"),
            "yes" if equal else "no"] for what, got, formula, want, equal in rows]
    out.append(["total per rank", _bytes(total), "", "", ""])
    head = f"N = {n:,} parameters in {tensors} tensors, {len(recs)} ranks\n"
    return head + text_table(["what", "measured on rank 0", "formula", "formula vs measured",
                              "same on every rank"], out)


def activation_table(records: Iterable[dict]) -> str:
    """Saved activations against batch size: they grow with the tokens, linearly."""
    rows = []
    for r in _part(records, "activations"):
        if r["rank"] == 0:
            rows.append([r["batch_size"], r["tokens"], _bytes(r["activations"]), f"{r['activations'] / r['tokens']:,.0f} B"])
    return text_table(["batch size", "tokens", "saved for backward", "per token"], rows, right=[0, 1, 3])


def activation_parts(records: Iterable[dict]) -> str:
    """Saved activations per part of the model, per token and (blocks) in floats per token per unit of width."""
    r0 = _rank0(records, "replica")
    tokens, width = r0["batch_size"] * r0["seq_len"], r0["width"]
    rows = []
    for part, nbytes in r0["activations_by_part"].items():
        per_token = nbytes / tokens
        floats = f"{per_token / 4 / width:.2f}" if part.startswith("blocks") else ""
        rows.append([part, format_bytes(nbytes), f"{per_token:,.0f} B", floats])
    return text_table(["part", "saved", "per token", "floats per token / width"], rows, right=[2, 3])


def block_saved(records: Iterable[dict]) -> str:
    """The tensors autograd keeps for block 0 (one storage each, in the order saved)."""
    r0 = _rank0(records, "replica")
    return "\n".join(f"  {'x'.join(map(str, shape)):>12} {dtype}" for shape, dtype in r0["block0_saved"])


# --------------------------------------------------------------------------- 2. ZeRO

def zero_memory_table(records: Iterable[dict]) -> str:
    """Per run and rank: the optimizer state and the parameters the rank updates."""
    rows = []
    for r in _part(records, "run"):
        rows.append([r["run"], r["rank"], _bytes(r["optimizer_state"]), r["owned_tensors"], format_bytes(r["owned_bytes"]),
                     format_bytes(r["parameters"])])
    rows.sort(key=lambda row: (list(dict.fromkeys(x["run"] for x in _part(records, "run"))).index(row[0]), row[1]))
    return text_table(["run", "rank", "Adam state", "params updated", "their bytes", "params held"], rows,
                      right=[1, 3])


def zero_traffic_table(records: Iterable[dict], *, world_size: int) -> str:
    """Per run (rank 0, one step): DDP's all-reduces and ZeRO's broadcasts, with lesson 02's bytes."""
    rows = []
    for r in _part(records, "run"):
        if r["rank"] != 0:
            continue
        ar = sum(r["all_reduce_bytes"])
        ar_rank = busbw_factor("all_reduce", world_size) * ar
        bc = r["broadcasts"]
        bc_rank = sum(rank_traffic(c, world_size=world_size, rank=0) for c in bc)
        rows.append([r["run"], f"{len(r['all_reduce_bytes'])} x all_reduce, {format_bytes(ar)}", format_bytes(ar_rank),
                     f"{len(bc)} x broadcast, {format_bytes(sum(c['nbytes'] for c in bc))}" if bc else "none",
                     format_bytes(bc_rank), format_bytes(ar_rank + bc_rank)])
    return text_table(["run", "gradients", "per rank", "parameters", "rank 0 receives", "rank 0 in all"], rows)


def check_table(records: Iterable[dict], *, key: str) -> str:
    """The ranks' verdicts of an equivalence check, one row per run."""
    runs: dict[str, list[str]] = {}
    for r in _part(records, "check"):
        runs.setdefault(r["run"], []).append(r[key])
    ranks = sorted({r["rank"] for r in _part(records, "check")})
    return text_table(["run", *(f"rank {i}" for i in ranks)], [[run, *v] for run, v in runs.items()])


def exactness(records: Iterable[dict], *, bitwise_keys: Sequence[str]) -> str:
    """Per run: bitwise equal or not, and the largest difference (rank 0)."""
    lines = []
    for r in _part(records, "check"):
        if r["rank"] == 0:
            bits = ", ".join(f"{k}: {r[k]}" for k in bitwise_keys)
            lines.append(f"{r['run']:>42}: {bits}, max |difference| = {r['max_abs_diff']:.2g}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- 3. FSDP

def fsdp_memory_table(records: Iterable[dict]) -> str:
    """Per run and rank: parameters, gradients and Adam state this rank holds."""
    order = list(dict.fromkeys(r["run"] for r in _part(records, "run")))
    rows = []
    for r in sorted(_part(records, "run"), key=lambda r: (order.index(r["run"]), r["rank"])):
        total = r["parameters"] + r["gradients"] + r["optimizer_state"]
        rows.append([r["run"], r["rank"], format_bytes(r["parameters"]), format_bytes(r["gradients"]),
                     format_bytes(r["optimizer_state"]), format_bytes(total)])
    return text_table(["run", "rank", "parameters", "gradients", "Adam state", "together"], rows, right=[1])


def fsdp_traffic_table(records: Iterable[dict], *, world_size: int) -> str:
    """Rank 0's collectives of the last step per run, phase and kind, with lesson 02's
    per-rank bytes, and the step's total in units of P (the parameters' bytes)."""
    rows = []
    for r in _part(records, "run"):
        if r["rank"] != 0:
            continue
        p_bytes = r["parameter_count"] * 4
        groups: dict[tuple[str, str], list[dict]] = {}
        for c in r["calls"]:
            groups.setdefault((c["phase"], c["op"]), []).append(c)
        total = 0.0
        for (phase, op), calls in groups.items():
            data = sum(c["nbytes"] for c in calls)
            per_rank = sum(rank_traffic(c, world_size=world_size, rank=0) for c in calls)
            total += per_rank
            rows.append([r["run"], phase, f"{len(calls)} x {op.replace('_single', '')}", format_bytes(data),
                         format_bytes(per_rank), ""])
        rows.append([r["run"], "whole step", "", "", format_bytes(total), f"{total / p_bytes:.2f} P"])
    return text_table(["run", "phase", "collectives", "data", "per rank", "in units of P"], rows)


def fsdp_check_table(records: Iterable[dict]) -> str:
    """Per run and rank: the loss curve against DDP's (assert_close), the final weights (bitwise)."""
    rows = [[r["run"], r["rank"], r["loss_curve"], "bitwise equal" if r["weights_bitwise"] else "not bitwise"]
            for r in _part(records, "check")]
    order = list(dict.fromkeys(row[0] for row in rows))
    rows.sort(key=lambda row: (order.index(row[0]), row[1]))
    return text_table(["run", "rank", "loss curve vs DDP", "final weights vs DDP"], rows, right=[1])


def fsdp_exactness(records: Iterable[dict]) -> str:
    """Rank 0: largest loss and weight differences from DDP, per run."""
    return "\n".join(f"{r['run']:>36}: losses bitwise {r['losses_bitwise']!s:5} (max |difference| "
                     f"{r['max_loss_diff']:.2g}), weights max |difference| {r['max_abs_diff']:.2g}"
                     for r in _part(records, "check") if r["rank"] == 0)


def fsdp_loss_series(records: Iterable[dict]) -> dict[str, dict[int, list[float]]]:
    """{run: {rank: losses}}."""
    out: dict[str, dict[int, list[float]]] = {}
    for r in _part(records, "run"):
        out.setdefault(r["run"], {})[r["rank"]] = r["losses"]
    return out


def plot_losses(series: dict[str, dict[int, list[float]]], *, title: str):
    """Loss per step, one colour per rank, one line style per run."""
    import matplotlib.pyplot as plt

    styles = ["-", "--", ":", "-."]
    markers = ["o", "x", "+", "."]
    fig, ax = plt.subplots(figsize=(9.0, 4.2))
    for i, (run, ranks) in enumerate(series.items()):
        for rank, losses in sorted(ranks.items()):
            ax.plot(range(len(losses)), losses, linestyle=styles[i % 4], marker=markers[i % 4],
                    color=f"C{rank}", label=f"{run}, rank {rank}", alpha=0.85)
    ax.set_xlabel("step")
    ax.set_ylabel("loss on the rank's own batch")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- 3. FSDP2 on a wire

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


def show_lines(path: str, start: str, stop: str) -> None:
    """Print the lines of a file from the first one that starts with `start` up to the
    next one that starts with `stop` (not included)."""
    lines = Path(path).read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(start))
    last = next(i for i in range(first + 1, len(lines)) if lines[i].startswith(stop))
    print("\n".join(lines[first:last]).rstrip())


def _mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.2f}"


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


# --------------------------------------------------------------------------- 4. tensor parallelism

def tp_table(records: Iterable[dict]) -> str:
    """Rank 0's checks of the split MLP against the unsplit one."""
    r0 = _rank0(records, "by hand")
    return text_table(["tensor", "against the unsplit MLP"], [[c["tensor"], c["verdict"]] for c in r0["checks"]])


def tp_exactness(records: Iterable[dict]) -> str:
    r0 = _rank0(records, "by hand")
    return "\n".join(f"{c['tensor']:>30}: bitwise {c['bitwise']!s:5}  max |difference| = {c['max_abs_diff']:.2g}"
                     for c in r0["checks"])


def tp_calls(records: Iterable[dict]) -> str:
    """The collectives of one forward and backward, per rank."""
    rows = []
    for r in _part(records, "by hand"):
        for c in r["calls"]:
            rows.append([r["rank"], c["phase"], c["op"], format_bytes(c["nbytes"])])
    return text_table(["rank", "phase", "collective", "data"], rows, right=[0])


# --------------------------------------------------------------------------- 5. pipeline

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
    for r in _part(records, "step"):
        steps.setdefault((r["micro"], r["rank"]), []).append(r)
    for micro, repeat in {(r["micro"], r["repeat"]) for r in _part(records, "step")}:
        same_step = [r for r in _part(records, "step") if r["micro"] == micro and r["repeat"] == repeat]
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
    rows = [[r["micro"], r["rank"], _ms(r["step_s"]), f"{r['idle_fraction']:.0%}",
             f"{r['formula_idle_fraction']:.0%}", f"{r['replayed_idle_fraction']:.0%}",
             f"{r['idle_over_busy']:.0%}", f"{r['formula_idle_over_busy']:.0%}"]
            for r in bubble_rows(records)]
    return text_table(["m", "stage", "step (ms)", "idle / step", "(p-1)/(m+p-1)", "replayed",
                       "idle / busy", "(p-1)/m"], rows, right=[0, 1, 2, 3, 4, 5, 6, 7])


def pipeline_checks(records: Iterable[dict]) -> str:
    rows = {}
    for r in _part(records, "check"):
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

    steps = [r for r in _part(records, "step") if r["micro"] == micro]
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


# --------------------------------------------------------------------------- 6. combining

def parallel_layout(world_size: int, *, tp: int, pp: int) -> dict:
    """Where each rank sits in a (pipeline, data, tensor) grid, and the groups it talks to.

    Ranks are laid out as torch.arange(world_size).view(pp, dp, tp), the order
    init_device_mesh(device, (pp, dp, tp)) uses: tensor-parallel partners are
    neighbouring ranks (the GPUs of one machine), pipeline stages the farthest apart.

    Args:
        world_size: ranks in all.
        tp: tensor-parallel degree (ranks that split each layer).
        pp: pipeline-parallel degree (stages).

    Returns:
        {"dp": data-parallel degree, "coords": {rank: (pp, dp, tp)},
         "groups": {"tp"|"dp"|"pp": [[ranks], ...]}}
    """
    for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"parallel_layout: {name} must be a whole number >= 1, got {value!r}")
    if world_size % (tp * pp):
        raise ValueError(f"parallel_layout: world_size {world_size} is not a multiple of tp x pp = {tp * pp}; "
                         "pick degrees whose product divides the number of ranks")
    dp = world_size // (tp * pp)
    coords = {r: (r // (dp * tp), r // tp % dp, r % tp) for r in range(world_size)}

    def groups(axis: int) -> list[list[int]]:
        found: dict[tuple, list[int]] = {}
        for r, c in coords.items():
            found.setdefault(tuple(v for i, v in enumerate(c) if i != axis), []).append(r)
        return sorted(found.values())

    return {"dp": dp, "coords": coords, "groups": {"pp": groups(0), "dp": groups(1), "tp": groups(2)}}


def layout_text(world_size: int, *, tp: int, pp: int) -> str:
    lay = parallel_layout(world_size, tp=tp, pp=pp)
    lines = [f"{world_size} ranks = pipeline {pp} x data {lay['dp']} x tensor {tp}"]
    for kind, what in (("tp", "tensor-parallel groups (all-reduce of activations, every layer)"),
                       ("dp", "data-parallel groups (all-reduce or reduce-scatter/all-gather of gradients, every step)"),
                       ("pp", "pipelines (send/recv of activations between neighbouring stages)")):
        lines.append(f"{what}:")
        lines.append("  " + "  ".join("[" + " ".join(map(str, g)) + "]" for g in lay["groups"][kind]))
    return "\n".join(lines)


# --------------------------------------------------------------------------- 7. self-check

EXPECTED = {
    "q1_bytes_per_param_fp32_adam": (16, "4 (parameter) + 4 (gradient) + 8 (Adam's two moments), without DDP's bucket copy"),
    "q2_adam_gb_per_rank_1e9_params_8_ranks": (1, "Adam keeps 8 bytes per parameter; ZeRO splits them over the ranks"),
    "q3_fsdp_all_gathers_per_block_per_step": (2, "once for forward, and again for backward after resharding"),
    "q4_tp_forward_all_reduces": (1, "column split needs no communication, the row split one all-reduce"),
    "q5_idle_fraction_4_stages_12_micro": (0.2, "(p-1)/(m+p-1) with p=4, m=12"),
    "q6_keep_inside_one_machine": ("tensor", "which one communicates inside every layer, with activation-sized messages?"),
}


def check_answers(answers: dict) -> None:
    """Print, per question, whether the answer is right (answers left as None are skipped)."""
    selfcheck.check_answers(answers, EXPECTED, rel_tol=0.02, text="contains")

__all__ = [
    "rank_traffic", "replica_table", "activation_table", "activation_parts", "block_saved",
    "zero_memory_table", "zero_traffic_table", "check_table", "exactness",
    "fsdp_memory_table", "fsdp_traffic_table", "fsdp_check_table", "fsdp_exactness", "fsdp_loss_series", "plot_losses",
    "wire_summary", "wire_bytes_table", "wire_time_table", "wire_calls_table", "job_bytes_line", "show_lines",
    "tp_table", "tp_exactness", "tp_calls",
    "bubble_of_step", "bubble_formulas", "gpipe_replay", "bubble_rows", "bubble_table", "pipeline_checks",
    "plot_bubble", "plot_schedule", "parallel_layout", "layout_text", "EXPECTED", "check_answers",
]
