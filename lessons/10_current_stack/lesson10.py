"""Helpers for the lesson 10 notebook: tables of the runs' records (placements and
redistributions, DDPOptimizer's graphs, DCP checkpoints and their timings, FSDP2's
collectives), lesson 02's communication formulas applied to the collectives the ranks
counted, and the self-check. The rank scripts do not import this module.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable

import torch

from labutils.course import selfcheck
from labutils.course.tables import bytes_in, text_table
from labutils.course.comm_count import sent_per_rank


def _part(records: Iterable[dict], part: str, **match) -> list[dict]:
    return sorted((r for r in records if r.get("part") == part and all(r.get(k) == v for k, v in match.items())),
                  key=lambda r: r["rank"])


def short_placements(text: str) -> str:
    """'(Shard(dim=0), Replicate())' as '(Shard(0), Replicate())'."""
    return text.replace("dim=", "").replace("Partial(sum)", "Partial()")


# --------------------------------------------------------------------------- 1. DTensor

def layout_table(run) -> str:
    """Per layout, the block of X each rank holds (rank: [row, column] on the mesh)."""
    recs = _part(run.records, "layout")
    ranks = sorted({r["rank"] for r in recs})
    header = ["placements"] + [f"rank {r} {next(x['coords'] for x in recs if x['rank'] == r)}" for r in ranks]
    rows = []
    for placements in dict.fromkeys(r["placements"] for r in recs):
        cells = []
        for r in ranks:
            rec = next(x for x in recs if x["rank"] == r and x["placements"] == placements)
            m = re.fullmatch(r"rows (\d+)-(\d+), cols (\d+)-(\d+)", rec["holds"])
            r0, r1, c0, c1 = map(int, m.groups())
            cells.append(f"X[{r0}:{r1 + 1}, {c0}:{c1 + 1}]")
        rows.append([short_placements(placements), *cells])
    return text_table(header, rows)


def uneven_line(run) -> str:
    """The split that does not divide (X's first 1023 rows): the block of X each rank holds."""
    recs = _part(run.records, "uneven")
    blocks = []
    for rec in recs:
        r0, r1, c0, c1 = map(int, re.fullmatch(r"rows (\d+)-(\d+), cols (\d+)-(\d+)", rec["holds"]).groups())
        blocks.append(f"rank {rec['rank']} X[{r0}:{r1 + 1}, {c0}:{c1 + 1}]")
    return f"X[0:{recs[0]['rows']}] as {short_placements(recs[0]['placements'])}: " + ", ".join(blocks)


def matmul_lines(run) -> str:
    """The placements of A, B and A @ B, and what it took to sum the product (rank 0)."""
    rec = _part(run.records, "matmul", rank=0)[0]
    rows, cols = rec["local_shape"]
    gathered = ", ".join(f"{c['op']} over mesh dim {c['mesh_dim']}" for c in rec["full_calls"])
    return "\n".join([
        f"a: {short_placements(rec['a'])}, b: {short_placements(rec['b'])}",
        f"a @ b: {short_placements(rec['product'])}, local {rows}x{cols}, collectives: {len(rec['product_calls'])}",
        f"(a @ b).full_tensor(): {gathered}; equals A @ B: {rec['equal']}",
    ])


def redistribute_table(run) -> str:
    """Per redistribution (rank 0's view; all ranks issue the same): the collectives
    CommDebugMode counted, the group, the array, the bytes per rank by lesson 02."""
    rows = []
    for rec in _part(run.records, "redistribute", rank=0):
        calls = rec["calls"] or [None]
        for i, c in enumerate(calls):
            first = i == 0
            rows.append([
                short_placements(rec["source"]) if first else "", short_placements(rec["target"]) if first else "",
                "none" if c is None else c["op"], "" if c is None else f"{c['mesh_dim']} ({c['group_size']} ranks)",
                "" if c is None else bytes_in(c["nbytes"], "MiB"), "0" if c is None else bytes_in(sent_per_rank(c), "MiB"),
                rec["correct"] if first else ""])
    return text_table(["from", "to", "collective", "mesh dim", "array (MiB)", "sent per rank (MiB)", "right values"],
                      rows, right=(4, 5))


def commdebug_counts(run) -> str:
    """CommDebugMode's own count (get_comm_counts) per redistribution, rank 0."""
    rows = [[short_placements(r["source"]), short_placements(r["target"]),
             ", ".join(f"{op}: {n}" for op, n in r["counts"].items()) or "{}"]
            for r in _part(run.records, "redistribute", rank=0)]
    return text_table(["from", "to", "comm.get_comm_counts()"], rows)


def uncounted_line(run) -> str:
    """What CommDebugMode counted around a barrier and a send/recv (rank 0)."""
    rec = _part(run.records, "uncounted", rank=0)[0]
    counts = ", ".join(f"{op}: {n}" for op, n in rec["counts"].items()) or "{}"
    return (f"dist.barrier() and a send/recv pair inside CommDebugMode: "
            f"get_comm_counts() {counts}, get_total_counts() {rec['total']}")


# --------------------------------------------------------------------------- 2. compile

def layers_label(groups: list[list[str]]) -> str:
    """[['head', 'layers.7'], ['layers.0', ...]] as '[0-6] [7 head]' (forward order)."""
    def index(name: str) -> int:
        return int(name.split(".")[1]) if name.startswith("layers.") else 10**6

    def label(group: list[str]) -> str:
        idx = sorted(index(n) for n in group)
        layers = [i for i in idx if i < 10**6]
        text = ""
        if layers:
            text = str(layers[0]) if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"
            if layers != list(range(layers[0], layers[-1] + 1)):
                text = ",".join(map(str, layers))
        return "[" + " ".join(filter(None, [text, "head" if 10**6 in idx else ""])) + "]"

    return " ".join(label(g) for g in sorted(groups, key=lambda g: min(index(n) for n in g)))


def graphs_table(run) -> str:
    """Per bucket_cap_mb: DDP's buckets (eager) against DDPOptimizer's graphs."""
    rows, errors = [], []
    for rec in _part(run.records, "graphs", rank=0):
        cap = "unset" if rec["bucket_cap_mb"] is None else f"{rec['bucket_cap_mb']:g}"
        if not rec["optimize_ddp"]:
            cap += ", optimize_ddp=False"
        if rec["error"]:
            errors.append(f"bucket_cap_mb={cap}: {rec['error']}")
        rows.append([cap, len(rec["ddp_buckets"]), layers_label(rec["ddp_buckets"]),
                     "error" if rec["error"] else len(rec["graphs"]),
                     "(below)" if rec["error"] else layers_label(rec["graphs"])])
    table = text_table(["bucket_cap_mb", "DDP buckets", "layers per bucket", "graphs", "layers per graph"],
                       rows, right=(1, 3))
    return "\n".join([table, "", *errors]) if errors else table


def equivalence_lines(run) -> str:
    rec = _part(run.records, "equivalence", rank=0)[0]
    compiled = _part(run.records, "inductor", rank=0, run="inductor")[0]
    return (f"inductor, {compiled['graphs']} graphs, {len(compiled['losses'])} steps against eager DDP:\n"
            f"  losses:  {rec['losses']}\n  weights: {rec['weights']}")


def exactness_line(run) -> str:
    rec = _part(run.records, "equivalence", rank=0)[0]
    return (f"losses bitwise equal: {rec['losses_bitwise']}; weights bitwise equal: {rec['weights_bitwise']}, "
            f"largest difference {rec['max_weight_diff']:.2g}")


def compile_time_table(run) -> str:
    """Seconds per step, eager and compiled, rank 0."""
    eager = _part(run.records, "inductor", rank=0, run="eager")[0]["step_s"]
    compiled = _part(run.records, "inductor", rank=0, run="inductor")[0]["step_s"]
    later = statistics.median(eager[1:])
    rows = [["eager DDP", f"{eager[0]:.3f}", f"{later:.3f}"],
            ["compiled (inductor)", f"{compiled[0]:.3f}", f"{statistics.median(compiled[1:]):.3f}"]]
    return (text_table(["", "step 1 (s)", "median of later steps (s)"], rows, right=(1, 2))
            + f"\n\nthe compiled first step took {compiled[0] / later:,.0f}x a later eager step")


def kernels_line(run) -> str:
    """What inductor wrote on rank 0: fused kernels by language, and library calls."""
    rec = _part(run.records, "kernels", rank=0)[0]
    compiler = f", compiled with {rec['compiler']}" if rec.get("compiler") else ""
    return (f"inductor wrote {rec['cpp']} C++ and {rec['triton']} Triton kernels on {rec['device'].upper()}{compiler}; "
            f"its wrappers make {rec['library_calls']} library calls (the matrix multiplications)")


def shapes_table(run) -> str:
    """Part 3: each call of the compiled function, the graphs it compiled, the FX graph
    cache's hits and its time (rank 0)."""
    rows = [[rec["when"], rec["rows"], rec["new_graphs"], rec["cache_hits"], f"{rec['seconds'] * 1000:.1f}"]
            for rec in _part(run.records, "shapes", rank=0)]
    return text_table(["call", "rows", "graphs compiled", "FX graph cache hits", "time (ms)"], rows,
                      right=(1, 2, 3, 4))


def shapes_claims(run) -> str:
    """Part 3's claims, each True or False: a new shape compiles once more, as a dynamic
    graph that a third shape reuses; after Dynamo's reset the graphs come from the cache,
    each call under a fifth of the first compilation."""
    calls = {(rec["when"], rec["rows"]): rec for rec in _part(run.records, "shapes", rank=0)}
    first = [calls.get(("first", rows)) for rows in (8, 12, 20)]
    again = [calls.get(("after reset", rows)) for rows in (8, 12, 20)]
    if None in first or None in again:
        return "part 3 did not run"
    compiled = [rec["new_graphs"] for rec in first]
    from_cache = all(rec["cache_hits"] >= 1 for rec in again[:2]) and again[2]["new_graphs"] == 0
    quicker = max(rec["seconds"] for rec in again) < first[0]["seconds"] / 5
    return "\n".join([
        f"8 rows compiled a graph, 12 rows another (dynamic), 20 rows none: {compiled == [1, 1, 0]}",
        f"after the reset, every graph came from the FX graph cache:      {from_cache}",
        f"and each call took under a fifth of the first compilation:     {quicker}"])


# --------------------------------------------------------------------------- 3. DCP

def files_table(save_run) -> str:
    """The data files of each checkpoint (one per saving rank) and their sizes."""
    rows = []
    for rec in _part(save_run.records, "saved", rank=0):
        data = [(n, size) for n, size in rec["files"] if n.endswith(".distcp")]
        rows.append([f"{rec['checkpoint']} (from {rec['wrapper']}, 4 ranks)",
                     " ".join(n for n, _ in data), " ".join(f"{s / 1e6:.1f}" for _, s in data),
                     f"{sum(s for _, s in data) / 1e6:.1f}"])
    return text_table(["checkpoint", "data files", "their sizes (MB)", "together (MB)"], rows)


def state_size_line(save_run) -> str:
    rec = _part(save_run.records, "saved", rank=0)[0]
    n = len(rec["fingerprints"])
    return f"the training state: {n} tensors (model parameters, Adam's step, exp_avg and exp_avg_sq per parameter)"


def loaded_table(save_run, load_run) -> str:
    """Per checkpoint and wrapper on 2 ranks: the local shape of layers.0.weight, and
    whether every tensor of the loaded state is bitwise the saved one."""
    saved = {r["checkpoint"]: r["fingerprints"] for r in _part(save_run.records, "saved", rank=0)}
    rows = []
    for rec in _part(load_run.records, "loaded", rank=0):
        mine, want = rec["fingerprints"], saved[rec["checkpoint"]]
        same = sum(mine.get(k) == v for k, v in want.items())
        ranks = _part(load_run.records, "loaded", checkpoint=rec["checkpoint"], wrapper=rec["wrapper"])
        shapes = sorted({tuple(r["local_shape"]) for r in ranks})
        rows.append([rec["checkpoint"], f"{rec['wrapper']} on 2 ranks", " ".join(f"{a}x{b}" for a, b in shapes),
                     f"{same} of {len(want)}", same == len(want) and set(mine) == set(want)])
    return text_table(["checkpoint", "loaded into", "layers.0.weight per rank", "tensors bitwise equal",
                       "state equal"], rows)


def async_consistency(save_run, load_run) -> str:
    """The async checkpoint holds the state it was given, not the one after the step
    taken while it was written."""
    saved = _part(save_run.records, "saved", rank=0, checkpoint="fsdp")[0]
    loaded = _part(load_run.records, "loaded", rank=0, checkpoint="fsdp", wrapper="FSDP2")[0]["fingerprints"]
    return (f"loaded == state when async_save was called: {loaded == saved['fingerprints']}\n"
            f"loaded == state after the training step taken meanwhile: {loaded == saved['after_step']}")


def _save_timings(save_run) -> tuple[dict[str, tuple[float, float]], float, float]:
    """({way: (seconds blocked, seconds until on disk)}, a plain training step, the first
    step while async_save writes): the slowest rank of each round, the median over rounds."""
    recs = _part(save_run.records, "timing")
    rounds = sorted({r["round"] for r in recs})

    def median_of_slowest(way: str, key: str) -> float:
        return statistics.median(max(r[key] for r in recs if r["way"] == way and r["round"] == k) for k in rounds)

    plain = statistics.median(s for r in recs if r["way"] == "no checkpoint" for s in r["step_s"])
    during = statistics.median(r["step_s"][0] for r in recs if r["way"] == "dcp.async_save")
    ways = {way: (median_of_slowest(way, "blocked_s"), median_of_slowest(way, "durable_s"))
            for way in ["torch.save on rank 0", "dcp.save", "dcp.async_save"]}
    return ways, plain, during


def save_timing_table(save_run) -> str:
    """Per way of saving: seconds training was blocked and seconds until the checkpoint
    was on disk (the slowest rank of each round, the median over the rounds)."""
    ways, plain, during = _save_timings(save_run)
    base = ways["torch.save on rank 0"][0]
    rows = [[way, f"{blocked:.3f}", f"{durable:.3f}", f"{blocked / base:.2f}", f"{blocked / plain:.2f}"]
            for way, (blocked, durable) in ways.items()]
    return (text_table(["way", "training blocked (s)", "until on disk (s)", "blocked / torch.save's",
                        "blocked / one training step"], rows, right=(1, 2, 3, 4))
            + f"\n\na training step: {plain:.3f} s; the first step while async_save writes: {during:.3f} s")


def save_claims(save_run) -> str:
    """What the text reads in the timing table: dcp.save blocks training for less time
    than torch.save on rank 0; async_save blocks for less than half a training step, and
    its checkpoint is on disk later than it returned."""
    ways, plain, _ = _save_timings(save_run)
    blocked, durable = ways["dcp.async_save"]
    return "\n".join([
        "dcp.save blocks training for less time than torch.save on rank 0: "
        f"{ways['dcp.save'][0] < ways['torch.save on rank 0'][0]}",
        f"dcp.async_save blocks training for less than half a training step: {blocked < 0.5 * plain}",
        f"... and its checkpoint is on disk only later, while training runs: {durable > blocked}",
    ])


# --------------------------------------------------------------------------- 4. FSDP2

def _by_op(calls: list[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for c in calls:
        out.setdefault((c["mesh_dim"], c["op"], c["dtype"]), []).append(c)
    return out


def precision_table(run) -> str:
    """Per policy: the collectives of one training step, their dtype, and the bytes
    each rank sends for them (lesson 02), against the float32 run."""
    recs = _part(run.records, "precision", rank=0)
    base = {}
    rows = []
    for rec in recs:
        for (dim, op, dtype), calls in _by_op(rec["calls"]).items():
            sent = sum(sent_per_rank(c) for c in calls)
            base.setdefault(op, sent)
            rows.append([rec["policy"], op, dtype, len(calls), bytes_in(sent, "MiB"), f"{sent / base[op]:.2f}"])
    return text_table(["policy", "collective", "dtype", "calls", "sent per rank (MiB)", "vs float32"],
                      rows, right=(3, 4, 5))


def precision_dtypes(run) -> str:
    """Per policy, the dtypes of the sharded parameters, their gradients, the model's output."""
    rows = [[r["policy"], r["dtypes"]["parameters"], r["dtypes"]["gradients"], r["dtypes"]["output"]]
            for r in _part(run.records, "precision", rank=0)]
    return text_table(["policy", "sharded parameters", "their gradients", "model output"], rows)


def precision_losses(run) -> str:
    recs = {r["policy"]: r["losses"] for r in _part(run.records, "precision", rank=0)}
    fp32 = recs["float32"]
    rows = [[policy, " ".join(f"{v:.4f}" for v in losses),
             f"{max(abs(a - b) / abs(b) for a, b in zip(losses, fp32)):.1e}"] for policy, losses in recs.items()]
    return text_table(["policy", "loss per step", "largest relative difference to float32"], rows)


def clip_checks(run) -> str:
    """What clip_grad_norm_ over DTensor gradients returned and did, against one process."""
    rec = _part(run.records, "clip", rank=0)[0]
    calls = "; ".join(f"{c['op']} of {c['nbytes']} B over mesh dim {c['mesh_dim']} ({c['group_size']} ranks)"
                      for c in rec["calls"])
    try:
        torch.testing.assert_close(torch.tensor(rec["total_norm"]), torch.tensor(rec["reference_norm"]))
        norm = "equal (assert_close)"
    except AssertionError:
        norm = "DIFFERENT"
    return "\n".join([
        f"clip_grad_norm_(max_norm={rec['max_norm']}) returned a {rec['total_type']},"
        f" placements {rec['total_placements']}",
        f"total norm against one process: {norm}",
        f"clipped gradients against one process: {rec['clipped_gradients']}",
        f"collectives inside clip_grad_norm_: {calls}",
    ])


def clip_numbers(run) -> str:
    """The norms themselves, and each rank's norm of its own shard."""
    rec = _part(run.records, "clip", rank=0)[0]
    shards = {r["rank"]: r["own_shard_norm"] for r in _part(run.records, "clip shard")}
    combined = sum(v * v for v in shards.values()) ** 0.5
    return "\n".join([
        f"total norm: FSDP2 on 4 ranks {rec['total_norm']:.6f}, one process {rec['reference_norm']:.6f}",
        "norm of each rank's own shard: " + ", ".join(f"rank {r} {v:.4f}" for r, v in shards.items()),
        f"square root of the sum of their squares: {combined:.6f}",
    ])


def hsdp_table(run) -> str:
    """The collectives of one step, FSDP over 4 ranks against HSDP (2 x 2), per mesh dim."""
    rows = []
    runs = [("FSDP2, 1-D mesh of 4", _part(run.records, "precision", rank=0, policy="float32")[0]["calls"]),
            ("HSDP, 2 x 2 mesh", _part(run.records, "hsdp", rank=0)[0]["calls"])]
    for name, calls in runs:
        total = 0.0
        for (dim, op, dtype), group in _by_op(calls).items():
            sent = sum(sent_per_rank(c) for c in group)
            total += sent
            rows.append([name, f"{dim} ({group[0]['group_size']} ranks)", op, len(group), bytes_in(sent, "MiB")])
        rows.append([name, "", "together", "", bytes_in(total, "MiB")])
    return text_table(["run", "mesh dim", "collective", "calls", "sent per rank (MiB)"], rows, right=(3, 4))


def hsdp_lines(run) -> str:
    rec = _part(run.records, "hsdp", rank=0)[0]
    held_2d = {r["rank"]: r["held_bytes"] for r in _part(run.records, "held")}
    held_1d = {r["rank"]: r["held_bytes"] for r in _part(run.records, "held 1-D")}
    return "\n".join([
        f"HSDP losses against FSDP2 on 4 ranks: {rec['vs_fsdp']}",
        "parameter bytes each rank holds: FSDP2 over 4 ranks " + ", ".join(f"{v:,}" for v in held_1d.values())
        + "; HSDP " + ", ".join(f"{v:,}" for v in held_2d.values()),
    ])


# --------------------------------------------------------------------------- self-check

EXPECTED = {
    "q1_partial_to_replicate": (175.0, "an all-reduce: each rank sends 2(n-1)/n of the array, 2 * 7/8 * 100 MB"),
    "q2_partial_to_shard": (87.5, "a reduce-scatter: (n-1)/n of the array, 7/8 * 100 MB"),
    "q3_graphs": (3, "DDPOptimizer starts with a 1 MiB bucket whatever bucket_cap_mb says: [layer 9], "
                     "then 7 layers (28 MiB reach 25), then the last 2"),
    "q4_async_waits_for_disk": (False, "async_save returns once the state is copied; a background thread writes"),
    "q5_bf16_all_gather": (437.5, "bf16 halves the array to 500 MB; an all-gather sends (n-1)/n of it: 7/8 * 500"),
    "q6_hsdp_replicate": (125.0, "the replicate all-reduce carries each rank's shard (1 GB / 8 = 125 MB) "
                                 "over 2 ranks: 2 * 1/2 * 125 MB"),
}


def check_answers(answers: dict) -> None:
    """Print, per question, whether the answer is right (None: not answered yet)."""
    selfcheck.check_answers(answers, EXPECTED, rel_tol=0.02)
