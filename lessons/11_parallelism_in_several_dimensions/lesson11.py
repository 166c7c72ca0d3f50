"""Lesson 11's tables and checks, from the records of its scripts (pure functions).

    from labutils.course import lesson
    L = lesson.load("11_parallelism_in_several_dimensions", "lesson11")
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable

from labutils.course import selfcheck
from labutils.course.comm_count import sent_per_rank
from labutils.course.tables import text_table

KiB, MiB = 2**10, 2**20


def _part(records: Iterable[dict], part: str, rank: int | None = 0) -> list[dict]:
    """The records of one part of a script's report: rank's, or every rank's (None)."""
    return [r for r in records if r.get("part") == part and (rank is None or r.get("rank", 0) == rank)]


def _size(nbytes: float) -> str:
    return f"{nbytes / KiB:g}"  # KiB, which the column's header names


def calls_text(calls: list[dict]) -> str:
    """'2 x all_reduce 256, 1 x all_gather 1024': the collectives, by kind and array
    size in KiB, in the order each kind first appears."""
    counts = Counter((c["op"], c["nbytes"]) for c in calls)
    return ", ".join(f"{n} x {op} {_size(nbytes)}" for (op, nbytes), n in counts.items()) or "none"


def sent(calls: list[dict]) -> float:
    """Bytes one rank sends for these collectives, by lesson 02's formulas."""
    return sum(sent_per_rank(c) for c in calls)


def tp_equality_table(run) -> str:
    """Per way: the loss and every gradient against the unsplit model (assert_close at
    float32's default tolerances)."""
    rows = [[w["way"], "equal (assert_close)" if w["equal"] else "DIFFERENT"]
            for w in _part(run.records, "way")]
    return text_table(["way", "loss and every gradient vs unsplit"], rows)


def tp_differences(run) -> str:
    """The largest gradient difference of each way (rounding: it varies with the machine)."""
    return "largest gradient difference: " + ", ".join(
        f"{w['way']} {w['max_grad_diff']:.0e}" for w in _part(run.records, "way"))


def tp_collectives_table(run) -> str:
    """Per way: the collectives of the forward (the loss included) and of the backward,
    and the bytes a rank sends for them, by lesson 02's formulas."""
    rows = []
    for w in _part(run.records, "way"):
        rows.append([w["way"], "forward", calls_text(w["forward"]), f"{sent(w['forward']) / KiB:.0f}"])
        rows.append(["", "backward", calls_text(w["backward"]), f"{sent(w['backward']) / KiB:.0f}"])
    return text_table(["way", "pass", "collectives (array size in KiB)", "sent per rank (KiB)"], rows,
                      right=[3])


def tp_memory_table(run) -> str:
    """Per way: the bytes a rank keeps for backward and the parameter bytes it holds,
    against the unsplit model on one process."""
    ref = _part(run.records, "reference")[0]
    rows = [["unsplit (one process)", f"{ref['saved_bytes'] / MiB:.2f}", "1.00",
             f"{ref['param_bytes'] / MiB:.2f}"]]
    for w in _part(run.records, "way"):
        rows.append([w["way"], f"{w['saved_bytes'] / MiB:.2f}", f"{w['saved_bytes'] / ref['saved_bytes']:.2f}",
                     f"{w['param_bytes'] / MiB:.2f}"])
    return text_table(["way", "saved for backward (MiB)", "of unsplit", "parameters (MiB)"], rows,
                      right=[1, 2, 3])


def kept_whole_bytes(shape: dict) -> int:
    """What sequence parallelism with loss_parallel does not split, by the model's
    shape: the input of each column-split layer, gathered to the whole sequence and kept
    for that layer's backward (the attention's q, k and v share one; the feed-forward's
    w1; the head), batch x seq x dim float32 each; the token ids and the targets (int64);
    and the loss's own 4-byte scalar."""
    b, s, d = shape["batch"], shape["seq"], shape["dim"]
    return 3 * b * s * d * 4 + 2 * b * s * 8 + 4


def sp_memory_check(run, *, tolerance: float = 0.005) -> str:
    """TP + SP + loss_parallel keeps 1/n of everything but kept_whole_bytes."""
    ref = _part(run.records, "reference")[0]
    n = run.world_size
    whole = kept_whole_bytes(ref["shape"])
    predicted = (ref["saved_bytes"] - whole) / n + whole
    measured = next(w["saved_bytes"] for w in _part(run.records, "way") if w["way"] == "TP + SP + loss_parallel")
    return (f"{n} ranks, TP + SP + loss_parallel: saved for backward = (unsplit - kept whole) / {n} "
            f"+ kept whole, within {tolerance:.1%}: {abs(measured / predicted - 1) <= tolerance}")


def tp_claims(run) -> str:
    """The section's claims on the counted collectives, each True or False."""
    ways = {w["way"]: w for w in _part(run.records, "way")}
    tp, sp, lp = ways["TP"], ways["TP + SP"], ways["TP + SP + loss_parallel"]
    ops = lambda calls: Counter(c["op"] for c in calls)  # noqa: E731
    act = [c for c in tp["forward"] if c["op"] == "all_reduce"]
    act_bytes = {c["nbytes"] for c in act}
    sp_block = [c for c in sp["forward"] if c["nbytes"] in act_bytes]
    lines = [
        ("TP: one all-reduce of the activations per split pair in forward (2), "
         "one per gathered input in backward (3)",
         ops(tp["forward"])["all_reduce"] == 2 and ops(tp["backward"])["all_reduce"] == 3),
        ("TP + SP: no all-reduce of activations, a reduce-scatter and an all-gather instead",
         ops(sp["forward"])["all_reduce"] == 0 and ops(sp["backward"])["all_reduce"] == 0
         and ops(sp_block)["reduce_scatter"] == ops(sp_block)["all_gather"] == 3),
        ("a reduce-scatter and an all-gather send what one all-reduce of the same array sends",
         abs(sent([next(c for c in sp_block if c["op"] == "reduce_scatter"),
                   next(c for c in sp_block if c["op"] == "all_gather")]) - sent(act[:1])) < 1),
        ("loss_parallel: no all-gather of the logits, three small all-reduces instead",
         len([c for c in lp["forward"] if c["op"] == "all_gather"]) ==
         len([c for c in sp["forward"] if c["op"] == "all_gather"]) - 1
         and all(c["nbytes"] < KiB * 4 for c in lp["forward"] if c["op"] == "all_reduce")),
    ]
    return "\n".join(f"{text}: {ok}" for text, ok in lines)


# ------------------------------------------------------------------ expert parallelism

def _moe(run, setting: str) -> list[dict]:
    return sorted((r for r in run.records if r.get("part") == "moe" and r["setting"] == setting),
                  key=lambda r: r["rank"])


def moe_traffic_table(run) -> str:
    """Per routing and rank: the check against one process, the tokens this rank sent to
    other ranks' experts, the tokens its own experts received, and the bytes of the two
    all-to-alls it sent."""
    rows = []
    for setting in ("balanced", "skewed"):
        for r in _moe(run, setting):
            rows.append([setting if r["rank"] == 0 else "", r["rank"],
                         "equal (assert_close)" if r["equal"] else "DIFFERENT",
                         r["sent_elsewhere"], r["received"],
                         f"{r['dispatch_bytes'] / KiB:.1f}", f"{r['combine_bytes'] / KiB:.1f}"])
    return text_table(["router", "rank", "outputs and gradients vs one process",
                       "tokens sent to other ranks", "tokens its experts got",
                       "dispatch sent (KiB)", "combine sent (KiB)"], rows, right=[1, 3, 4, 5, 6])


def moe_load_table(run) -> str:
    """Per routing: tokens per expert over all ranks, the busiest rank's tokens against
    a fair share, and the tokens over capacity."""
    rows = []
    for setting in ("balanced", "skewed"):
        recs = _moe(run, setting)
        first = recs[0]
        fair = first["tokens"]  # each rank's experts' fair share: one rank's tokens
        rows.append([setting, " ".join(map(str, first["expert_load"])),
                     f"{max(r['received'] for r in recs) / fair:.2f}", first["capacity"], first["dropped"]])
    return text_table(["router", "tokens per expert (all ranks)", "busiest rank / fair share",
                       "capacity per expert", "tokens over capacity"], rows, right=[2, 3, 4])


def moe_claims(run) -> str:
    n = run.world_size
    balanced, skewed = _moe(run, "balanced"), _moe(run, "skewed")
    every = balanced + skewed
    share = lambda recs: max(r["received"] for r in recs) / recs[0]["tokens"]  # noqa: E731
    lines = [
        ("the expert-parallel layer equals the layer on one process, outputs and gradients",
         all(r["equal"] for r in every)),
        (f"balanced: each rank sends about (n-1)/n = {(n - 1) / n:.2f} of its tokens away (within 10%)",
         all(abs(r["sent_elsewhere"] / r["tokens"] / ((n - 1) / n) - 1) <= 0.1 for r in balanced)),
        ("the combine all-to-all sends back, in all, the bytes the dispatch sent",
         all(sum(r["dispatch_bytes"] for r in recs) == sum(r["combine_bytes"] for r in recs)
             for recs in (balanced, skewed))),
        ("skewed: the busiest rank's experts get over 1.5x a fair share, and tokens go over capacity",
         share(skewed) > 1.5 and skewed[0]["dropped"] > 0),
    ]
    return "\n".join(f"{text}: {ok}" for text, ok in lines)


# ------------------------------------------------------------------ context parallelism

def _ring(run, layout: str) -> list[dict]:
    return sorted((r for r in run.records if r.get("part") == "ring" and r["layout"] == layout),
                  key=lambda r: r["rank"])


def ring_table(run) -> str:
    """Per layout and rank: the output against one process, the attention scores the
    rank computed and those causal attention needs for its queries (thousands), and the
    keys and values it sent around the ring."""
    rows = []
    for layout in ("contiguous", "zigzag"):
        for r in _ring(run, layout):
            rows.append([layout if r["rank"] == 0 else "", r["rank"],
                         "equal (assert_close)" if r["equal"] else "DIFFERENT",
                         f"{r['needed'] / 1e3:.0f}", f"{r['computed'] / 1e3:.0f}",
                         f"{r['sent_bytes'] / KiB:.0f}"])
    return text_table(["layout", "rank", "output vs one process", "scores needed (k)",
                       "scores computed (k)", "keys and values sent (KiB)"], rows, right=[1, 3, 4, 5])


def ring_claims(run) -> str:
    n = run.world_size
    contiguous, zigzag = _ring(run, "contiguous"), _ring(run, "zigzag")
    kv = contiguous[0]["kv_bytes"]
    busiest = lambda recs: max(r["computed"] for r in recs)  # noqa: E731
    lines = [
        ("ring attention equals causal attention in one process, both layouts",
         all(r["equal"] for r in contiguous + zigzag)),
        (f"each rank sends (n-1)/n = {(n - 1) / n:.2f} of all the keys and values, an all-gather's share",
         all(r["sent_bytes"] == kv * (n - 1) // n for r in contiguous + zigzag)),
        ("contiguous: the last rank computes n times what rank 0 computes",
         contiguous[-1]["computed"] == n * contiguous[0]["computed"]),
        ("zigzag: every rank computes the same, and the busiest rank less than contiguous's busiest",
         len({r["computed"] for r in zigzag}) == 1 and busiest(zigzag) < busiest(contiguous)),
    ]
    return "\n".join(f"{text}: {ok}" for text, ok in lines)


def torch_cp_line(run) -> str:
    result = next(r["result"] for r in run.records if r.get("part") == "torch_cp" and r["rank"] == 0)
    return f"torch's context_parallel on this machine: {result}"


# ------------------------------------------------------------------ pipeline schedules

SCHEDULE_ORDER = ("GPipe", "1F1B", "interleaved 1F1B")


def pipeline_table(run) -> str:
    """Per schedule and rank: the loss and gradients against one process, and the most
    micro-batches whose activations the rank held at once (one per stage visit)."""
    recs = sorted((r for r in run.records if r.get("part") == "check"),
                  key=lambda r: (SCHEDULE_ORDER.index(r["schedule"]), r["rank"]))
    rows = [[r["schedule"] if r["rank"] == 0 else "", r["rank"],
             "equal (assert_close)" if r["equal"] else "DIFFERENT", r["most_in_flight"]] for r in recs]
    return text_table(["schedule", "rank", "loss and gradients vs one process",
                       "most micro-batches held"], rows, right=[1, 3])


def pipeline_claims(run, *, micro_batches: int = 4) -> str:
    recs = {(r["schedule"], r["rank"]): r for r in run.records if r.get("part") == "check"}
    p = run.world_size
    lines = [
        ("every schedule gives the unsplit model's loss and gradients", all(r["equal"] for r in recs.values())),
        (f"GPipe: every rank holds all {micro_batches} micro-batches before the first backward",
         all(recs["GPipe", r]["most_in_flight"] == micro_batches for r in range(p))),
        ("1F1B: rank r holds at most p - r, the stages from its own to the last",
         all(recs["1F1B", r]["most_in_flight"] == p - r for r in range(p))),
    ]
    return "\n".join(f"{text}: {ok}" for text, ok in lines)


def bubble_predicted(stages: int, micro_batches: int) -> float:
    """The idle share of a GPipe or 1F1B step on p stages with m micro-batches, when every
    stage's forward and backward take the same time and sending costs nothing: (p-1)/(m+p-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def _bubbles(run) -> dict:
    """{(schedule, m): {rank: record}} from bubble.py."""
    out: dict = {}
    for r in (r for r in run.records if r.get("part") == "bubble"):
        out.setdefault((r["schedule"], r["micro_batches"]), {})[r["rank"]] = r
    return out


def bubble_table(run) -> str:
    """Per schedule and number of micro-batches: the step, each rank's measured bubble and
    the formula's."""
    rows = []
    for (schedule, m), ranks in sorted(_bubbles(run).items(), key=lambda kv: (SCHEDULE_ORDER.index(kv[0][0]),
                                                                               kv[0][1])):
        p = next(iter(ranks.values()))["stages"]
        rows.append([schedule, m, f"{ranks[0]['step_s'] * 1e3:.0f}",
                     *(f"{ranks[r]['bubble']:.0%}" for r in sorted(ranks)), f"{bubble_predicted(p, m):.0%}"])
    ranks = sorted(next(iter(_bubbles(run).values())))
    return text_table(["schedule", "micro-batches", "step ms", *(f"bubble rank {r}" for r in ranks),
                       "(p-1)/(m+p-1)"], rows, right=range(1, 4 + len(ranks)))


def bubble_claims(run, *, tolerance: float = 0.15) -> str:
    """The measured bubbles: smaller with more micro-batches, the same for GPipe and 1F1B.
    (Not equal to the formula: it counts no time for sending and scheduling each micro-batch.)"""
    found = _bubbles(run)
    mean = {key: statistics.mean(r["bubble"] for r in ranks.values()) for key, ranks in found.items()}
    schedules = sorted({s for s, _ in found}, key=SCHEDULE_ORDER.index)
    fewest, most = min(m for _, m in found), max(m for _, m in found)
    same = all(abs(mean["GPipe", m] - mean["1F1B", m]) <= tolerance for _, m in found)
    return "\n".join([
        f"under each schedule, the bubble is smaller with {most} micro-batches than with {fewest}: "
        f"{all(mean[s, most] < mean[s, fewest] for s in schedules)}",
        f"1F1B's bubble is about GPipe's (the formula gives both the same), within {tolerance * 100:.0f} "
        f"points: {same}",
    ])


def bubble_gap(run) -> str:
    """How far above (p-1)/(m+p-1) the measured bubble is, per number of micro-batches (GPipe)."""
    found = _bubbles(run)
    parts = []
    for (schedule, m), ranks in sorted(found.items(), key=lambda kv: kv[0][1]):
        if schedule == "GPipe":
            p = next(iter(ranks.values()))["stages"]
            measured = statistics.mean(r["bubble"] for r in ranks.values())
            parts.append(f"m={m}: {measured:.0%} against {bubble_predicted(p, m):.0%}")
    return "GPipe's bubble, measured against (p-1)/(m+p-1): " + ", ".join(parts)


# ------------------------------------------------------------------ two dimensions

def _mesh_records(run, rank: int | None = 0) -> list[dict]:
    """fsdp_tp.py's records of its ("dp", "tp") layout (the default), rank's or every rank's."""
    return [r for r in _part(run.records, "2d", rank) if r.get("layout", "dp,tp") == "dp,tp"]


def mesh_table(run) -> str:
    """Rank 0's collectives of one 2-D step, per mesh dimension and pass, with the bytes
    it sends for them (lesson 02's formulas)."""
    rec = _mesh_records(run)[0]
    rows = []
    for dim in ("dp", "tp"):
        for pass_ in ("forward", "backward"):
            calls = [c for c in rec[pass_] if c["mesh_dim"] == dim]
            rows.append([dim if pass_ == "forward" else "", pass_, calls_text(calls),
                         f"{sent(calls) / KiB:.0f}"])
    return text_table(["mesh dim", "pass", "collectives (array size in KiB)", "sent per rank (KiB)"], rows,
                      right=[3])


def mesh_claims(run) -> str:
    recs = _mesh_records(run, rank=None)
    rec = _mesh_records(run)[0]
    calls = rec["forward"] + rec["backward"]
    by_dim = {d: [c for c in calls if c["mesh_dim"] == d] for d in ("dp", "tp")}
    act = rec["activation_bytes"]
    lines = [
        ("2-D (FSDP2 over dp, TP + SP over tp): loss and every gradient equal to one process, all 4 ranks",
         all(r["equal"] for r in recs) and len(recs) == 4),
        ("dp carries parameters and gradients only: all-gathers and reduce-scatters of parameter shards",
         {c["op"] for c in by_dim["dp"]} == {"all_gather", "reduce_scatter"}
         and all(c["nbytes"] != act for c in by_dim["dp"])),
        ("tp carries activations: every all-gather and reduce-scatter of the block's is 256 KiB",
         all(c["nbytes"] in (act, 4 * act) for c in by_dim["tp"] if c["op"] != "all_reduce")),
        ("tp sends more than twice dp's bytes in the step", sent(by_dim["tp"]) > 2 * sent(by_dim["dp"])),
        ("each rank holds a quarter of the parameters (within 1%)",
         all(abs(r["param_bytes"] * 4 / r["unsplit_param_bytes"] - 1) <= 0.01 for r in recs)),
    ]
    return "\n".join(f"{text}: {ok}" for text, ok in lines)


ORDERS = ("dp,tp", "tp,dp")


def _layout_record(run, layout: str) -> dict:
    return next(r for r in _part(run.records, "2d") if r.get("layout") == layout)


def _crossing(run, order: str, per_host: int) -> tuple[str, float]:
    """(the mesh dimension whose pairs are on two hosts, the bytes rank 0 sends for it in a step)."""
    rec = _layout_record(run, order)
    across = "tp" if len({r // per_host for r in rec["tp_group"]}) > 1 else "dp"
    calls = [c for c in rec["forward"] + rec["backward"] if c["mesh_dim"] == across]
    return across, sent(calls)


def _timing(run, layout: str, rank: int = 0) -> dict:
    return next(r for r in run.records if r.get("part") == "timing" and r["layout"] == layout
                and r["rank"] == rank)


def _step(run, layout: str) -> float:
    return statistics.median(r["step_s"] for r in run.records
                             if r.get("part") == "timing" and r["layout"] == layout)


def placement_table(run, *, per_host: int = 2) -> str:
    """Per mesh order (fsdp_tp.py --layouts dp,tp tp,dp): which dimension's pairs share a host, the
    bytes a rank sends over the slow link per step for the other (priced by lesson 02's formulas,
    not measured on the link), and the measured step."""
    rows = []
    for order in ORDERS:
        across, nbytes = _crossing(run, order, per_host)
        inside = "dp" if across == "tp" else "tp"
        rows.append([order, inside, across, f"{nbytes / KiB:.0f}", f"{_step(run, order) * 1e3:.0f}"])
    return text_table(["mesh order", "pairs on one host", "pairs across hosts",
                       "sent across per rank, lesson 02's formulas (KiB)", "step ms"], rows, right=(3, 4))


def placement_claims(run, *, per_host: int = 2) -> str:
    """Tensor parallelism on the fast link ("dp,tp") against on the slow one ("tp,dp")."""
    inside, across = _crossing(run, "dp,tp", per_host), _crossing(run, "tp,dp", per_host)
    ratio = _step(run, "tp,dp") / _step(run, "dp,tp")
    return "\n".join([
        f"the two orders put tp inside the hosts and across them: {inside[0] == 'dp' and across[0] == 'tp'}",
        f"with tp across the hosts, a rank sends more than twice the bytes over the slow link: "
        f"{across[1] > 2 * inside[1]}",
        f"and its step takes at least 1.3 times as long: {ratio >= 1.3}",
        f"every gradient equal to one process's in both orders: "
        f"{all(r['equal'] for r in run.records if r.get('part') == '2d' and r.get('layout') in ORDERS)}",
    ])


# ------------------------------------------------------------------ choosing a layout

# (name, what each pair inside a host does, what the groups across hosts do, fsdp_tp.py's
# --layouts word where the script runs it); "4" marks one group of all 4 ranks
LAYOUTS = (
    ("DDP", "4", "ddp", None),
    ("FSDP2", "4", "fsdp2", None),
    ("TP + SP", "4", "tp", None),
    ("HSDP: shards in a host, replicas across", "fsdp2", "ddp", "hsdp"),
    ("FSDP2 x TP + SP, tp in a host", "tp", "fsdp2", "dp,tp"),
    ("DDP x TP + SP, tp in a host", "tp", "ddp", None),
    ("FSDP2 x TP + SP, tp across hosts", "fsdp2", "tp", "tp,dp"),
)


def gloo_sent(call: dict) -> float:
    """Bytes one rank sends for a counted collective on gloo: lesson 02's formulas, with a
    reduce-scatter priced as the all-reduce of the whole array that gloo runs for it
    (lesson 07)."""
    return sent_per_rank({**call, "op": "all_reduce"} if call["op"] == "reduce_scatter" else call)


def at_least_across(calls: list[dict]) -> float:
    """The fewest bytes a host must send to the other host for these collectives of a
    group with ranks on both, whatever the algorithm: an all-gather needs the host's
    half of the array; an all-reduce (and gloo's reduce-scatter, which is one) its sums
    for half the array, then its half of the result: the whole array."""
    return sum(c["nbytes"] / 2 if c["op"] == "all_gather" else c["nbytes"] for c in calls)


def _tp_way(run) -> dict:
    return next(w for w in _part(run.records, "way") if w["way"] == "TP + SP")


def _scaled(calls: list[dict], factor: float) -> list[dict]:
    """Counted collectives of a tensor-parallel step, for factor times the batch: all but
    the norms' gradient all-reduces carry activations, which grow with the batch."""
    return [c if c["op"] == "all_reduce" else {**c, "nbytes": c["nbytes"] * factor} for c in calls]


def layout_predictions(tp2, tp4, mesh2d, *, batch: int = 32, budget: float = 9 * MiB,
                       link_bits_per_s: float = 200e6, per_host: int = 2) -> list[dict]:
    """Per layout of LAYOUTS on 2 hosts of 2 ranks: a rank's memory and the bytes one host
    sends over the slow link per training step, from the lesson's measurements and formulas.

    Memory is what a rank holds through the step: parameters, gradients and Adam's two
    states, 16 bytes per float32 parameter it keeps (4 times its parameter bytes), and
    the activations autograd saves, section 2's per sequence times the sequences the rank
    computes (FSDP2's gathered parameters, one group at a time, are left out). Bytes: a
    pair of ranks on two hosts sends all its traffic across, per_host pairs per host; a
    group of 4 ranks is priced at the least any algorithm sends (at_least_across). The
    dp collectives are section 6's counts; tp's are too, scaled from its batch to this
    one (_scaled).

    Args:
        tp2, tp4: tp_block.py's runs on 2 and 4 ranks; mesh2d: fsdp_tp.py's on 4.
        batch: sequences per step, all ranks together; budget: bytes a rank may hold.
    """
    ref = _part(tp2.records, "reference")[0]
    shape = ref["shape"]
    way2, way4 = _tp_way(tp2), _tp_way(tp4)
    whole, seq = ref["param_bytes"], ref["saved_bytes"] / shape["batch"]
    piece2, saved2 = way2["param_bytes"], way2["saved_bytes"] / shape["batch"]
    piece4, saved4 = way4["param_bytes"], way4["saved_bytes"] / shape["batch"]
    rec = _mesh_records(mesh2d)[0]
    mesh_batch = rec["activation_bytes"] / (shape["seq"] * shape["dim"] * 4)  # per tp pair
    calls = rec["forward"] + rec["backward"]
    dp_calls = [c for c in calls if c["mesh_dim"] == "dp"]
    tp_calls = _scaled([c for c in calls if c["mesh_dim"] == "tp"], (batch / 2) / mesh_batch)
    tp4_calls = _scaled(way4["forward"] + way4["backward"], batch / shape["batch"])

    def pair(op: str, nbytes: float) -> dict:
        return {"op": op, "nbytes": nbytes, "group_size": 2}

    rows = []
    for name, inside, across, runs_as in LAYOUTS:
        if inside == "4":
            held = {"ddp": whole, "fsdp2": whole / 4, "tp": piece4}[across]
            saved = saved4 * batch if across == "tp" else seq * batch / 4
            group_calls = {"ddp": [{"op": "all_reduce", "nbytes": whole}],
                           "fsdp2": [{"op": "all_gather", "nbytes": whole}, {"op": "reduce_scatter", "nbytes": whole}],
                           "tp": tp4_calls}[across]
            crossing, exact = at_least_across(group_calls), False
        elif inside == "fsdp2":  # hsdp, or tp across hosts with FSDP2 in them
            if across == "ddp":
                held, saved = whole / 2, seq * batch / 4
                crossing = per_host * gloo_sent(pair("all_reduce", whole / 2))
            else:
                held, saved = piece2 / 2, saved2 * batch / 2
                crossing = per_host * sum(gloo_sent(c) for c in tp_calls)
            exact = True
        else:  # tp pairs in a host, data parallelism across
            held, saved = (piece2 / 2 if across == "fsdp2" else piece2), saved2 * batch / 2
            group_calls = dp_calls if across == "fsdp2" else [pair("all_reduce", piece2)]
            crossing, exact = per_host * sum(gloo_sent(c) for c in group_calls), True
        total = 4 * held + saved
        rows.append({"layout": name, "runs_as": runs_as, "state": 4 * held, "activations": saved,
                     "total": total, "fits": total <= budget, "crossing": crossing, "exact": exact,
                     "link_s": crossing * 8 / link_bits_per_s, "budget": budget})
    fitting = [r for r in rows if r["fits"]]
    best = min(fitting, key=lambda r: r["link_s"]) if fitting else None
    for r in rows:
        r["best"] = r is best
    return rows


def layout_table(tp2, tp4, mesh2d, **kwargs) -> str:
    """layout_predictions as a table: memory per rank, whether it fits, bytes and time on
    the slow link per step."""
    rows = []
    predictions = layout_predictions(tp2, tp4, mesh2d, **kwargs)
    for r in predictions:
        at_least = "" if r["exact"] else ">= "
        rows.append([r["layout"], f"{r['state'] / MiB:.2f}",
                     f"{r['activations'] / MiB:.2f}", f"{r['total'] / MiB:.2f}", "yes" if r["fits"] else "no",
                     f"{at_least}{r['crossing'] / KiB:,.0f}", f"{at_least}{r['link_s'] * 1e3:.0f}"])
    best = next((r["layout"] for r in predictions if r["best"]), "none")
    table = text_table(["layout (4 ranks, 2 hosts)", "model state MiB", "activations MiB", "per rank MiB",
                        f"fits {predictions[0]['budget'] / MiB:g} MiB", "slow link KiB per host",
                        "slow link ms"], rows, right=range(1, 7))
    return f"{table}\n\nfastest predicted of those that fit: {best}"


def layout_measured_table(tp2, tp4, mesh2d, placed, **kwargs) -> str:
    """The layouts fsdp_tp.py ran on the cluster: rank 0's memory, its host's link bytes
    per step and the median step, each beside the prediction."""
    rows = []
    for r in layout_predictions(tp2, tp4, mesh2d, **kwargs):
        if r["runs_as"] is None:
            continue
        t = _timing(placed, r["runs_as"])
        held = t["params"] + t["grads"] + t["optimizer"] + t["activations"]
        rows.append([r["runs_as"], f"{r['total'] / MiB:.2f}", f"{held / MiB:.2f}", f"{r['crossing'] / KiB:,.0f}",
                     f"{t['link_sent_per_step'] / KiB:,.0f}", f"{r['link_s'] * 1e3:.0f}",
                     f"{_step(placed, r['runs_as']) * 1e3:.0f}"])
    return text_table(["fsdp_tp.py layout", "predicted MiB", "measured MiB", "predicted KiB per step",
                       "measured KiB per step", "predicted link ms", "measured step ms"], rows, right=range(1, 7))


def layout_claims(tp2, tp4, mesh2d, placed, *, memory_tolerance: float = 0.001,
                  bytes_tolerance: float = 0.10, **kwargs) -> str:
    """The predictions against fsdp_tp.py's measured layouts, each True or False.

    A link carries more than the collectives' bytes: each packet's headers (66 bytes per
    1,448 of data with 1,500-byte packets, 4.6%) and the acknowledgements of what the
    host receives (a header per two packets, 2.3%); hence bytes_tolerance. Pricing gloo's
    reduce-scatters by lesson 02's formula instead would fall about 30% short."""
    rows = [r for r in layout_predictions(tp2, tp4, mesh2d, **kwargs) if r["runs_as"]]
    memory_ok = bytes_ok = slower_than_link = True
    for r in rows:
        for rank in range(placed.world_size):
            m = _timing(placed, r["runs_as"], rank)
            held = m["params"] + m["grads"] + m["optimizer"] + m["activations"]
            memory_ok &= abs(held / r["total"] - 1) <= memory_tolerance
            bytes_ok &= 0 <= m["link_sent_per_step"] / r["crossing"] - 1 <= bytes_tolerance
        slower_than_link &= _step(placed, r["runs_as"]) >= r["link_s"]
    best = next((r for r in rows if r["best"]), None)
    fastest = min(rows, key=lambda r: _step(placed, r["runs_as"]))
    by_link = [r["runs_as"] for r in sorted(rows, key=lambda r: r["link_s"])]
    by_step = [r["runs_as"] for r in sorted(rows, key=lambda r: _step(placed, r["runs_as"]))]
    equal = all(r["equal"] for r in _part(placed.records, "2d", rank=None) if r.get("layout"))
    return "\n".join([
        f"every rank's memory within {memory_tolerance:.1%} of the prediction: {memory_ok}",
        f"every host's link bytes per step at most {bytes_tolerance:.0%} above the prediction "
        f"(packet headers and acknowledgements): {bytes_ok}",
        f"the layout predicted fastest of those that fit ran the fastest step: "
        f"{best is not None and best is fastest}",
        f"the steps come in the order of the predicted link times: {by_link == by_step}",
        f"every step took at least its predicted link time: {slower_than_link}",
        f"every gradient equal to one process's in all {len(rows)} layouts: {equal}",
    ])


# ------------------------------------------------------------------ self-check

def check_answers(answers: dict) -> None:
    """Print, per question, whether the answer is right (answers left as None are skipped)."""
    expected = {
        "q1_forward_all_reduces_per_block": (2, "one after each row-split layer: wo and w2"),
        "q2_sp_replaces_all_reduce_with": ("reduce-scatter", "the row-split layer's output, split along the sequence"),
        "q3_bytes_all_reduce_vs_rs_plus_ag": ("same", "an all-reduce is a reduce-scatter then an all-gather"),
        "q4_what_sp_keeps_whole": ("input", "the gathered input of each column-split layer, kept for its backward"),
        "q5_token_all_to_alls_per_moe_forward": (2, "one to send tokens to their experts, one to bring them back"),
        "q6_zigzag_parts_per_rank": (2, "one early part and one late part of the sequence"),
        "q7_gpipe_idle_share_p4_m12": (0.2, "(p-1)/(m+p-1) = 3/15", 1e-6),
        "q8_hsdp_bytes_across_in_model_bytes": (1, "each of the host's 2 ranks all-reduces its half of the "
                                                   "gradients with its replica, and an all-reduce of a pair "
                                                   "sends the whole array per rank", 1e-6),
    }
    selfcheck.check_answers(answers, expected, text="contains")


__all__ = [
    "calls_text", "sent", "tp_equality_table", "tp_differences", "tp_collectives_table", "tp_memory_table",
    "kept_whole_bytes", "sp_memory_check", "tp_claims", "moe_traffic_table", "moe_load_table", "moe_claims",
    "ring_table", "ring_claims", "torch_cp_line", "pipeline_table", "pipeline_claims", "bubble_predicted",
    "bubble_table", "bubble_claims", "bubble_gap", "mesh_table", "placement_table", "placement_claims",
    "mesh_claims", "LAYOUTS", "gloo_sent", "at_least_across", "layout_predictions", "layout_table",
    "layout_measured_table", "layout_claims", "check_answers",
]
