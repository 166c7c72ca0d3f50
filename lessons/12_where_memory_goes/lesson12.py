"""Lesson 12's tables and checks, from the records of its scripts (pure functions).

    from labutils.course import lesson
    L = lesson.load("12_where_memory_goes", "lesson12")
"""

from __future__ import annotations

from collections.abc import Iterable

from labutils.course import selfcheck
from labutils.course.tables import text_table

MiB = 2**20
WAYS = ("ddp", "zero1", "fsdp2", "tp")
PARTS = ("params", "grads", "optimizer", "activations")


def _part(records: Iterable[dict], part: str) -> list[dict]:
    return [r for r in records if r.get("part") == part]


def model_facts(run) -> dict:
    """numel (the parameters of the whole model), dim and rows, as the script reported."""
    return _part(run.records, "model")[0]


def predicted(way: str, *, numel: int, world_size: int, dim: int, rows: int, blocks: int = 4) -> dict:
    """Bytes per rank by the formulas, fp32 parameters and Adam (two states per parameter).

    P parameters, N ranks. ddp: 4P + 4P + 8P; zero1 keeps 1/N of the optimizer state:
    4P + 4P + 8P/N; fsdp2 splits all three: (4P + 4P + 8P)/N; tp splits every weight and
    the column-split layer's bias, the row-split layer's bias (dim values per block) stays
    whole on every rank. Activations per block: its input (rows x dim) and the up
    projection's output and the GELU's output (rows x 4 dim, split in N under tp), 4
    bytes each; and the loss keeps its input and target (rows x dim each).
    """
    n = world_size
    if way == "tp":
        local = (numel - blocks * dim) // n + blocks * dim
        params, grads, optimizer = 4 * local, 4 * local, 8 * local
    elif way == "fsdp2":
        params, grads, optimizer = 4 * numel // n, 4 * numel // n, 8 * numel // n
    else:
        params, grads = 4 * numel, 4 * numel
        optimizer = 8 * numel // n if way == "zero1" else 8 * numel
    split = n if way == "tp" else 1
    activations = blocks * 4 * rows * dim * (1 + 8 // split) + 2 * 4 * rows * dim
    return {"params": params, "grads": grads, "optimizer": optimizer, "activations": activations}


def anatomy_table(run) -> str:
    """Per way: rank 0's measured MiB of each part, their sum, and the formula's sum."""
    facts = model_facts(run)
    rows = []
    for way in WAYS:
        rec = next(r for r in _part(run.records, "anatomy") if r["way"] == way and r["rank"] == 0)
        want = predicted(way, numel=facts["numel"], world_size=run.world_size, dim=facts["dim"],
                         rows=facts["rows"])
        rows.append([way, *(f"{rec[p] / MiB:.2f}" for p in PARTS),
                     f"{sum(rec[p] for p in PARTS) / MiB:.2f}", f"{sum(want.values()) / MiB:.2f}"])
    return text_table(["way", "parameters MiB", "gradients MiB", "Adam state MiB", "activations MiB",
                       "total MiB", "formula MiB"], rows, right=range(1, 7))


def anatomy_claims(run) -> str:
    """Every part of every way on every rank equals its formula, to the byte."""
    facts = model_facts(run)
    off = []
    for rec in _part(run.records, "anatomy"):
        want = predicted(rec["way"], numel=facts["numel"], world_size=run.world_size,
                         dim=facts["dim"], rows=facts["rows"])
        off += [f"{rec['way']} rank {rec['rank']} {p}: {rec[p]} != {want[p]}" for p in PARTS
                if rec[p] != want[p]]
    ranks = {r["rank"] for r in _part(run.records, "anatomy")}
    lines = [f"every part, every way, all {len(ranks)} ranks equal to the formula to the byte: {not off}"]
    return "\n".join(lines + off)


def _ckpt(run) -> dict[str, dict]:
    return {r["how"]: r for r in _part(run.records, "checkpointing")}


def checkpoint_table(run) -> str:
    """Per way of checkpointing: what the forward held, backward's FLOPs and ops."""
    c = _ckpt(run)
    rows = [[how, f"{c[how]['held'] / MiB:.2f}", f"{c[how]['backward_flops'] / 1e6:.0f}",
             c[how]["backward_ops"], c[how]["recomputed"].get("addmm", 0), c[how]["recomputed"].get("gelu", 0)]
            for how in ("none", "full", "selective")]
    return text_table(["checkpointing", "held after forward MiB", "backward MFLOP", "backward aten ops",
                       "addmm in backward", "gelu in backward"], rows, right=range(1, 6))


def checkpoint_claims(run, *, dim: int = 256, rows: int = 64, blocks: int = 4) -> str:
    """What the table must show, each line True."""
    c = _ckpt(run)
    up_flops = blocks * 2 * rows * dim * 4 * dim  # the up projections' forward, all blocks
    extra = {how: c[how]["backward_flops"] - c["none"]["backward_flops"] for how in c}
    equal = bool(_part(run.records, "equal") and _part(run.records, "equal")[0]["gradients_equal"])
    return "\n".join([
        f"the gradients of the three are equal, bit for bit: {equal}",
        f"full checkpointing holds less than a fifth of what no checkpointing holds: "
        f"{c['full']['held'] < c['none']['held'] / 5}",
        f"selective holds more than full and less than none: "
        f"{c['full']['held'] < c['selective']['held'] < c['none']['held']}",
        f"full adds the up projections' forward FLOPs to backward, exactly: {extra['full'] == up_flops}",
        f"selective adds no matrix-multiplication FLOPs: {extra['selective'] == 0}",
        f"both run the {blocks} GELUs again in backward: "
        f"{c['full']['recomputed'].get('gelu') == c['selective']['recomputed'].get('gelu') == blocks}",
    ])


def _accum(run) -> dict[str, dict]:
    return {r["way"]: r for r in _part(run.records, "accumulation") if r["rank"] == 0}


def accumulation_table(run) -> str:
    """Per way of accumulating: equal to the global batch's gradient, its size against
    it, and the collectives that carried gradients on rank 0."""
    rows = [[way, r["equal"], f"{r['norm_ratio']:.3f}", r["collective"], ", ".join(map(str, r["calls"]))]
            for way, r in _accum(run).items()]
    return text_table(["way", "gradient equal to the global batch's", "size / global batch's",
                       "gradient collective", "calls in micro-steps 1, 2, 3, 4"], rows, right=(2,))


def accumulation_claims(run) -> str:
    """What the table must show, each line True."""
    a = _accum(run)
    g = next(r for r in _part(run.records, "global_batch") if r["rank"] == 0)
    no_sync, every = a["ddp, no_sync"], a["ddp, every micro-step synced"]
    loud, fsdp = a["ddp, loss not divided"], a["fsdp2, sync on the last"]
    return "\n".join([
        f"global batch: {g['micro']} rows x {g['accum']} micro-steps x {g['world_size']} ranks = "
        f"{g['micro'] * g['accum'] * g['world_size']} rows, the reference's {g['rows']}: "
        f"{g['micro'] * g['accum'] * g['world_size'] == g['rows']}",
        f"no_sync gives the global batch's gradient: {no_sync['equal']}",
        f"with no_sync the gradients travel in the last micro-step only: "
        f"{no_sync['calls'][-1] > 0 and not any(no_sync['calls'][:-1])}",
        f"syncing every micro-step gives the same gradient, all-reducing in every micro-step: "
        f"{every['equal'] and all(every['calls'])}",
        f"a loss not divided by the micro-steps gives {g['accum']}x the gradient: "
        f"{not loud['equal'] and abs(loud['norm_ratio'] - g['accum']) < 1e-3}",
        f"FSDP2 synced on the last micro-step only gives the global batch's gradient: {fsdp['equal']}",
        f"FSDP2 reduce-scatters in the last micro-step only: "
        f"{fsdp['calls'][-1] > 0 and not any(fsdp['calls'][:-1])}",
    ])


def snapshot_table(run) -> str:
    """snapshot.py's readings of torch.cuda.memory_allocated(), in MiB and in bytes per parameter."""
    snap = _part(run.records, "snapshot")[0]
    rows = [[moment, f"{nbytes / MiB:.2f}", f"{nbytes / snap['numel']:.2f}"]
            for moment, nbytes in snap["readings"].items()]
    rows.append(["peak", f"{snap['peak'] / MiB:.2f}", f"{snap['peak'] / snap['numel']:.2f}"])
    if snap.get("workspaces"):
        ws = sum(snap["workspaces"])
        rows.append([f"cuBLAS workspaces at the step ({len(snap['workspaces'])})", f"{ws / MiB:.2f}",
                     f"{ws / snap['numel']:.2f}"])
    return text_table(["moment", "allocated MiB", "bytes per parameter"], rows, right=(1, 2))


def snapshot_claims(run, *, tolerance: float = 0.02) -> str:
    """The allocator's readings against the formulas, each line True."""
    snap = _part(run.records, "snapshot")[0]
    r, n = snap["readings"], snap["numel"]
    step_added = r["after step"] - r["after backward"]
    state = r["state alone"]
    return "\n".join([
        f"the model alone: 4 bytes per parameter (within {tolerance:.0%}): "
        f"{abs(r['model'] - 4 * n) <= tolerance * 4 * n}",
        f"the optimizer step added Adam's 8 bytes per parameter (within {tolerance:.0%}): "
        f"{abs(step_added - 8 * n) <= tolerance * 8 * n}",
        f"the state alone, parameters, gradients and Adam's two: 16 bytes per parameter "
        f"(within {tolerance:.0%}): {abs(state - 16 * n) <= tolerance * 16 * n}",
        f"the peak is above every reading: {snap['peak'] >= max(r.values())}",
        f"the snapshot recorded the step's allocations: {snap['events'] > 0}",
    ])


def check_answers(answers: dict) -> None:
    """Print, per question, whether the answer is right (answers left as None are skipped)."""
    expected = {
        "q1_adam_bytes_per_parameter_ddp": (16, "4 for the value, 4 for the gradient, 8 for Adam's two states"),
        "q2_zero1_bytes_per_parameter_8_ranks": (5, "4 + 4 + 8/8"),
        "q3_fsdp2_bytes_per_parameter_8_ranks": (2, "(4 + 4 + 8)/8"),
        "q4_what_full_checkpointing_keeps": ("input", "each checkpointed block's input"),
        "q5_global_batch_rows_micro16_accum8_ranks4": (512, "16 x 8 x 4"),
    }
    selfcheck.check_answers(answers, expected, text="contains")


__all__ = ["predicted", "model_facts", "anatomy_table", "anatomy_claims", "checkpoint_table",
           "checkpoint_claims", "accumulation_table", "accumulation_claims", "snapshot_table",
           "snapshot_claims", "check_answers"]
