"""Helpers for the lesson 07 notebook: tables and plots of the runs' records, the
communication formulas of lesson 02 applied to the collectives the ranks logged, the
layout of combined parallelism, and the self-check; the FSDP2 wire readings (wire.py)
and the pipeline bubble (bubbles.py) are imported here from their own modules.

The rank scripts (replica_memory.py, zero_optimizer.py, fsdp_shard.py, fsdp_wire.py,
tensor_parallel.py, pipeline.py) do not import this module; only the notebook does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from labutils.course import selfcheck
from labutils.course.tables import bytes_in, text_table
from labutils.course.timing import busbw_factor, format_bytes

from bubbles import (  # noqa: F401  (the notebook's L.bubble_table, ...)
    bubble_beyond, bubble_formulas, bubble_of_step, bubble_rows, bubble_shrinks, bubble_table,
    gpipe_replay, pipeline_checks, plot_bubble, plot_schedule,
)
from wire import (  # noqa: F401  (the notebook's L.wire_summary, ...)
    job_bytes_line, wire_bytes_table, wire_calls_table, wire_claims, wire_summary, wire_time_table,
)

# --------------------------------------------------------------------------- generic


def _part(records: Iterable[dict], part: str) -> list[dict]:
    return sorted((r for r in records if r.get("part") == part), key=lambda r: r["rank"])


def _rank0(records: Iterable[dict], part: str, **match) -> dict:
    return next(r for r in _part(records, part) if r["rank"] == 0 and all(r.get(k) == v for k, v in match.items()))




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
    out = [[what, bytes_in(got, "MiB"), f"{got:,}", formula,
            ("" if want is None else "matches" if want == got else f"differs ({want:,})"),
            "yes" if equal else "no"] for what, got, formula, want, equal in rows]
    out.append(["total per rank", bytes_in(total, "MiB"), f"{total:,}", "", "", ""])
    head = f"N = {n:,} parameters in {tensors} tensors, {len(recs)} ranks; measured on rank 0\n"
    return head + text_table(["what", "MiB", "bytes", "formula", "formula vs measured",
                              "same on every rank"], out, right=[1, 2])


def activation_table(records: Iterable[dict]) -> str:
    """Saved activations against batch size: they grow with the tokens, linearly."""
    rows = []
    for r in _part(records, "activations"):
        if r["rank"] == 0:
            rows.append([r["batch_size"], r["tokens"], bytes_in(r["activations"], "MiB"), f"{r['activations']:,}",
                         f"{r['activations'] / r['tokens']:,.0f}"])
    return text_table(["batch size", "tokens", "saved for backward (MiB)", "(bytes)", "per token (bytes)"],
                      rows, right=[0, 1, 2, 3, 4])


def activation_parts(records: Iterable[dict]) -> str:
    """Saved activations per part of the model, per token and (blocks) in floats per token per unit of width."""
    r0 = _rank0(records, "replica")
    tokens, width = r0["batch_size"] * r0["seq_len"], r0["width"]
    rows = []
    for part, nbytes in r0["activations_by_part"].items():
        per_token = nbytes / tokens
        floats = f"{per_token / 4 / width:.2f}" if part.startswith("blocks") else ""
        rows.append([part, bytes_in(nbytes, "KiB", 1), f"{per_token:,.0f}", floats])
    return text_table(["part", "saved (KiB)", "per token (bytes)", "floats per token / width"], rows,
                      right=[1, 2, 3])


def block_saved(records: Iterable[dict]) -> str:
    """The tensors autograd keeps for block 0 (one storage each, in the order saved)."""
    r0 = _rank0(records, "replica")
    return "\n".join(f"  {'x'.join(map(str, shape)):>12} {dtype}" for shape, dtype in r0["block0_saved"])


# --------------------------------------------------------------------------- 2. ZeRO

def zero_memory_table(records: Iterable[dict]) -> str:
    """Per run and rank: the optimizer state and the parameters the rank updates."""
    rows = []
    for r in _part(records, "run"):
        rows.append([r["run"], r["rank"], bytes_in(r["optimizer_state"], "MiB"), f"{r['optimizer_state']:,}", r["owned_tensors"],
                     bytes_in(r["owned_bytes"], "MiB"), bytes_in(r["parameters"], "MiB")])
    rows.sort(key=lambda row: (list(dict.fromkeys(x["run"] for x in _part(records, "run"))).index(row[0]), row[1]))
    return text_table(["run", "rank", "Adam state (MiB)", "(bytes)", "params updated", "their size (MiB)",
                       "params held (MiB)"], rows, right=[1, 2, 3, 4, 5, 6])


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
        rows.append([r["run"], f"{len(r['all_reduce_bytes'])} x all_reduce", bytes_in(ar, "MiB"), bytes_in(ar_rank, "MiB"),
                     f"{len(bc)} x broadcast" if bc else "none",
                     bytes_in(sum(c["nbytes"] for c in bc), "MiB") if bc else "", bytes_in(bc_rank, "MiB"), bytes_in(ar_rank + bc_rank, "MiB")])
    return text_table(["run", "gradients", "data (MiB)", "per rank (MiB)", "parameters", "data (MiB)",
                       "rank 0 receives (MiB)", "rank 0 in all (MiB)"], rows, right=[2, 3, 5, 6, 7])


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
    """Per run and rank: the loss curve against DDP's (assert_close), the final weights
    (bitwise). DDP's own rows are the reference the others are compared with."""
    rows = [[f"{r['run']} (the reference)", r["rank"], "-", "-"] if r["run"] == "DDP" else
            [r["run"], r["rank"], r["loss_curve"], "bitwise equal" if r["weights_bitwise"] else "not bitwise"]
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


# --------------------------------------------------------------------------- 3. FSDP2 on a wire (readings in wire.py)

def show_lines(path: str, start: str, stop: str) -> None:
    """Print the lines of a file from the first one that starts with `start` up to the
    next one that starts with `stop` (not included)."""
    lines = Path(path).read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(start))
    last = next(i for i in range(first + 1, len(lines)) if lines[i].startswith(stop))
    print("\n".join(lines[first:last]).rstrip())


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
    "wire_summary", "wire_bytes_table", "wire_time_table", "wire_calls_table", "wire_claims",
    "job_bytes_line", "show_lines",
    "tp_table", "tp_exactness", "tp_calls",
    "bubble_of_step", "bubble_formulas", "gpipe_replay", "bubble_rows", "bubble_table", "pipeline_checks",
    "plot_bubble", "plot_schedule", "parallel_layout", "layout_text", "EXPECTED", "check_answers",
]
