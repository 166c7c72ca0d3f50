"""Lesson 11's notebook helpers (lessons/11_parallelism_in_several_dimensions/lesson11.py)
on hand-made records: the collectives' text and price, the claims on them, and the
memory arithmetic of sequence parallelism. The notebook runs the scripts (nbval)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers import LESSONS

from labutils.course import lesson

L = lesson.load(LESSONS / "11_parallelism_in_several_dimensions", "lesson11")
KiB = 1024
SHAPE = {"vocab": 512, "dim": 128, "heads": 4, "batch": 8, "seq": 64}
ACT, LOGITS = 8 * 64 * 128 * 4, 8 * 64 * 512 * 4


def call(op: str, nbytes: int, n: int = 2) -> dict:
    return {"op": op, "nbytes": nbytes, "group_size": n, "dtype": "float32", "mesh_dim": "0"}


def ways(n: int = 2, *, sp_all_reduce: bool = False, saved_lp: float | None = None) -> SimpleNamespace:
    """tp_block.py's records at n ranks, as torch 2.13 gives them."""
    c = lambda op, size: call(op, size, n)  # noqa: E731
    block_sp = [c("reduce_scatter", ACT), c("all_gather", ACT)] * 3
    ref_saved = 5_795_844
    whole = L.kept_whole_bytes(SHAPE)
    records = [
        {"rank": 0, "part": "reference", "saved_bytes": ref_saved, "param_bytes": 1_316_352, "shape": SHAPE},
        {"rank": 0, "part": "way", "way": "TP", "equal": True, "max_grad_diff": 2e-9,
         "forward": [c("all_reduce", ACT)] * 2 + [c("all_gather", LOGITS)],
         "backward": [c("all_reduce", ACT)] * 3, "saved_bytes": 4_218_884, "param_bytes": 791_040},
        {"rank": 0, "part": "way", "way": "TP + SP", "equal": True, "max_grad_diff": 7e-9,
         "forward": block_sp + [c("all_gather", LOGITS)] + ([c("all_reduce", ACT)] if sp_all_reduce else []),
         "backward": block_sp, "saved_bytes": 3_819_524, "param_bytes": 659_968},
        {"rank": 0, "part": "way", "way": "TP + SP + loss_parallel", "equal": True, "max_grad_diff": 7e-9,
         "forward": block_sp + [c("all_reduce", 2 * KiB)] * 3, "backward": block_sp,
         "saved_bytes": saved_lp if saved_lp is not None else (ref_saved - whole) / n + whole,
         "param_bytes": 659_968},
    ]
    return SimpleNamespace(records=records, world_size=n)


def test_calls_are_grouped_by_kind_and_size_in_order():
    calls = [call("all_reduce", ACT), call("all_gather", LOGITS), call("all_reduce", ACT)]
    assert L.calls_text(calls) == "2 x all_reduce 256, 1 x all_gather 1024"
    assert L.calls_text([]) == "none"


@pytest.mark.parametrize("n", [2, 4])
def test_a_reduce_scatter_and_an_all_gather_cost_one_all_reduce(n):
    assert L.sent([call("reduce_scatter", ACT, n), call("all_gather", ACT, n)]) == \
        pytest.approx(L.sent([call("all_reduce", ACT, n)]))
    assert L.sent([call("all_reduce", ACT, 2)]) == ACT  # 2(n-1)/n = 1 at n = 2


def test_the_claims_hold_for_torchs_counts_and_fail_otherwise():
    assert L.tp_claims(ways()).count(": True") == 4
    broken = L.tp_claims(ways(sp_all_reduce=True)).splitlines()
    assert broken[1].endswith(": False") and broken[0].endswith(": True")


@pytest.mark.parametrize("n", [2, 4])
def test_the_memory_check_is_the_arithmetic_of_what_stays_whole(n):
    assert L.sp_memory_check(ways(n)).endswith(": True")
    assert L.sp_memory_check(ways(n, saved_lp=5_795_844 / n)).endswith(": False")  # all split: not so


def test_what_stays_whole_is_three_gathered_inputs_the_ids_the_targets_and_a_scalar():
    assert L.kept_whole_bytes(SHAPE) == 3 * ACT + 2 * 8 * 64 * 8 + 4


def test_tables_have_one_unit_per_column():
    run = ways()
    for table in (L.tp_collectives_table(run), L.tp_memory_table(run), L.tp_equality_table(run)):
        header = table.splitlines()[0]
        assert header.count("(") <= len(header.split("  "))
    assert "(KiB)" in L.tp_collectives_table(run) and "(MiB)" in L.tp_memory_table(run)
    assert "2e-09" not in L.tp_equality_table(run)  # rounding stays out of the checked table


def moe_run(n: int = 2, *, equal: bool = True, dropped: int = 223) -> SimpleNamespace:
    """moe.py's records at 2 ranks: balanced, then skewed."""
    tokens, token_bytes = 256, 64 * 4
    rows = {"balanced": [(127, 254), (125, 258)], "skewed": [(39, 437), (220, 75)]}
    load = {"balanced": [128, 126, 131, 127], "skewed": [383, 54, 54, 21]}
    records = []
    for setting, ranks in rows.items():
        for r, (away, received) in enumerate(ranks):
            other_away = ranks[1 - r][0]
            records.append({"part": "moe", "setting": setting, "rank": r, "equal": equal,
                            "sent_elsewhere": away, "received": received, "tokens": tokens,
                            "dispatch_bytes": away * token_bytes, "combine_bytes": other_away * token_bytes,
                            "expert_load": load[setting], "capacity": 160,
                            "dropped": dropped if setting == "skewed" else 0})
    return SimpleNamespace(records=records, world_size=n)


def test_the_moe_claims_hold_for_the_run_and_fail_for_a_wrong_layer():
    assert L.moe_claims(moe_run()).count(": True") == 4
    assert L.moe_claims(moe_run(equal=False)).splitlines()[0].endswith(": False")
    assert L.moe_claims(moe_run(dropped=0)).splitlines()[-1].endswith(": False")


def test_the_moe_tables_show_the_busiest_rank_against_a_fair_share():
    load = L.moe_load_table(moe_run()).splitlines()
    assert load[2].split()[-3:] == ["1.01", "160", "0"]
    assert load[3].split()[-3:] == ["1.71", "160", "223"]
    traffic = L.moe_traffic_table(moe_run())
    assert "(KiB)" in traffic and "31.8" in traffic


def ring_run(n: int = 4, *, zigzag_computed=(589_824,) * 4, equal: bool = True) -> SimpleNamespace:
    """ring_attention.py's records at 4 ranks: contiguous, then zigzag, then torch's CP."""
    kv, block = 1_048_576, 262_144
    records = [{"part": "ring", "layout": "contiguous", "rank": r, "equal": equal,
                "computed": block * (r + 1), "needed": 131_584 + 262_144 * r,
                "sent_bytes": kv * (n - 1) // n, "kv_bytes": kv} for r in range(n)]
    records += [{"part": "ring", "layout": "zigzag", "rank": r, "equal": True,
                 "computed": zigzag_computed[r], "needed": 524_800,
                 "sent_bytes": kv * (n - 1) // n, "kv_bytes": kv} for r in range(n)]
    records.append({"part": "torch_cp", "rank": 0, "result": "NotImplementedError: no strategy"})
    return SimpleNamespace(records=records, world_size=n)


def test_the_ring_claims_hold_for_the_run_and_fail_for_an_unbalanced_zigzag():
    assert L.ring_claims(ring_run()).count(": True") == 4
    assert L.ring_claims(ring_run(equal=False)).splitlines()[0].endswith(": False")
    assert L.ring_claims(ring_run(zigzag_computed=(589_824, 589_824, 589_824, 600_000))
                         ).splitlines()[-1].endswith(": False")


def test_the_ring_table_counts_scores_in_thousands_and_bytes_in_kib():
    table = L.ring_table(ring_run())
    assert "(k)" in table and "(KiB)" in table
    assert table.splitlines()[5].split()[-3:] == ["918", "1049", "768"]  # contiguous, rank 3
    assert L.torch_cp_line(ring_run()).endswith("NotImplementedError: no strategy")


def pipeline_run(*, gpipe_held: int = 4, equal: bool = True) -> SimpleNamespace:
    held = {("GPipe", 0): gpipe_held, ("GPipe", 1): 4, ("1F1B", 0): 2, ("1F1B", 1): 1,
            ("interleaved 1F1B", 0): 5, ("interleaved 1F1B", 1): 3}
    records = [{"part": "check", "schedule": s, "rank": r, "equal": equal, "most_in_flight": n,
                "holds_loss": r == 1} for (s, r), n in held.items()]
    return SimpleNamespace(records=records, world_size=2)


def test_the_pipeline_claims_hold_for_the_run_and_fail_otherwise():
    assert L.pipeline_claims(pipeline_run()).count(": True") == 3
    assert L.pipeline_claims(pipeline_run(gpipe_held=3)).splitlines()[1].endswith(": False")
    assert L.pipeline_claims(pipeline_run(equal=False)).splitlines()[0].endswith(": False")
    table = L.pipeline_table(pipeline_run()).splitlines()
    assert table[2].split()[0] == "GPipe" and table[4].split()[0] == "1F1B"


def mesh_run(*, dp_activation: bool = False) -> SimpleNamespace:
    """fsdp_tp.py's records on a 2 x 2 mesh (rank 0's calls, as torch 2.13 makes them)."""
    def c(op, dim, nbytes):
        return {**call(op, nbytes), "mesh_dim": dim}
    tp = [c("reduce_scatter", "tp", ACT), c("all_gather", "tp", ACT)] * 3
    forward = [c("all_gather", "dp", 263_168), c("all_gather", "dp", 396_800), *tp,
               c("all_gather", "tp", LOGITS)] + ([c("all_gather", "dp", ACT)] if dp_activation else [])
    backward = [c("all_gather", "dp", 396_800), *tp, *[c("all_reduce", "tp", 512)] * 6,
                c("reduce_scatter", "dp", 396_800), c("reduce_scatter", "dp", 263_168)]
    records = [{"part": "2d", "rank": r, "equal": True, "dp": r // 2, "tp": r % 2, "forward": forward,
                "backward": backward, "param_bytes": 329_984, "unsplit_param_bytes": 1_316_352,
                "activation_bytes": ACT} for r in range(4)]
    return SimpleNamespace(records=records, world_size=4)


def test_the_mesh_claims_say_which_traffic_each_dimension_carries():
    assert L.mesh_claims(mesh_run()).count(": True") == 5
    assert L.mesh_claims(mesh_run(dp_activation=True)).splitlines()[1].endswith(": False")
    table = L.mesh_table(mesh_run()).splitlines()
    assert table[2].split()[:2] == ["dp", "forward"] and table[2].split()[-1] == "322"


def placed_run(step_inside: float = 0.22, step_across: float = 0.61, *, equal: bool = True,
               swapped: bool = False) -> SimpleNamespace:
    """fsdp_tp.py --layouts dp,tp tp,dp --time-steps on 2 hosts of 2 ranks: the groups follow each order."""
    inner, outer = [[0, 1], [2, 3]], [[0, 2], [1, 3]]
    records = []
    for order, step in (("dp,tp", step_inside), ("tp,dp", step_across)):
        tp_inside = (order == "dp,tp") != swapped
        for r in mesh_run().records:
            r.update(layout=order, equal=equal,
                     tp_group=next(g for g in (inner if tp_inside else outer) if r["rank"] in g),
                     dp_group=next(g for g in (outer if tp_inside else inner) if r["rank"] in g))
            records.append(r)
        records += [{"part": "timing", "rank": r, "layout": order, "step_s": step} for r in range(4)]
    return SimpleNamespace(records=records, world_size=4)


def test_tensor_parallelism_across_the_hosts_is_named_and_must_be_slower():
    assert "False" not in L.placement_claims(placed_run())
    table = L.placement_table(placed_run()).splitlines()
    assert table[2].split()[:3] == ["dp,tp", "tp", "dp"] and table[3].split()[:3] == ["tp,dp", "dp", "tp"]
    assert "1.3 times as long: False" in L.placement_claims(placed_run(step_across=0.25))
    assert "inside the hosts and across them: False" in L.placement_claims(placed_run(swapped=True))
    assert "both orders: False" in L.placement_claims(placed_run(equal=False))


def bubble_run(gpipe=((2, 0.38, 0.34), (8, 0.25, 0.16)), one_f_one_b=((2, 0.40, 0.35), (8, 0.21, 0.14))):
    """bubble.py's records: (micro-batches, rank 0's bubble, rank 1's) per schedule."""
    records = [{"part": "bubble", "rank": rank, "schedule": schedule, "micro_batches": m, "bubble": b,
                "step_s": 0.08 * m, "stages": 2}
               for schedule, rows in (("GPipe", gpipe), ("1F1B", one_f_one_b))
               for m, *bubbles in rows for rank, b in enumerate(bubbles)]
    return SimpleNamespace(records=records, world_size=2)


def test_the_bubble_claims_hold_for_a_shrinking_bubble_and_fail_otherwise():
    assert L.bubble_predicted(2, 8) == pytest.approx(1 / 9)
    assert "False" not in L.bubble_claims(bubble_run())
    flat = bubble_run(gpipe=((2, 0.3, 0.3), (8, 0.31, 0.3)))
    assert "smaller with 8 micro-batches than with 2: False" in L.bubble_claims(flat)
    apart = bubble_run(one_f_one_b=((2, 0.40, 0.35), (8, 0.02, 0.01)))
    assert "within 15 points: False" in L.bubble_claims(apart)
    assert "m=8: 20% against 11%" in L.bubble_gap(bubble_run())
    assert "bubble rank 1" in L.bubble_table(bubble_run())


# ------------------------------------------------------------------ choosing a layout

W = 1_316_352  # the model's parameter bytes (float32)


def predictions(**kwargs) -> dict[str, dict]:
    return {r["layout"]: r for r in L.layout_predictions(ways(2), ways(4), mesh_run(), **kwargs)}


def test_gloo_prices_a_reduce_scatter_as_an_all_reduce():
    assert L.gloo_sent(call("reduce_scatter", 1000)) == L.gloo_sent(call("all_reduce", 1000)) == 1000
    assert L.gloo_sent(call("all_gather", 1000)) == 500
    assert L.at_least_across([call("all_gather", 1000, 4), call("all_reduce", 1000, 4)]) == 1500


def test_each_layout_is_priced_by_hand():
    p = predictions()
    assert p["DDP"]["state"] == 16 * W / 4 and not p["DDP"]["fits"] and not p["DDP"]["exact"]
    hsdp = p["HSDP: shards in a host, replicas across"]
    assert hsdp["state"] == 2 * W and hsdp["activations"] == 5_795_844  # 8 sequences, unsplit
    assert hsdp["crossing"] == W and hsdp["exact"] and hsdp["best"]  # 2 ranks x a pair's all-reduce of W/2
    inside = p["FSDP2 x TP + SP, tp in a host"]
    # 2 ranks x (all-gathers of half, gloo's reduce-scatters of all, of section 6's dp arrays)
    assert inside["crossing"] == 2 * (263_168 / 2 + 2 * 396_800 / 2 + 396_800 + 263_168)
    assert inside["activations"] == 2 * 3_819_524 and inside["state"] == 4 * 659_968 / 2
    across = p["FSDP2 x TP + SP, tp across hosts"]
    assert across["crossing"] == 2 * (18 * ACT + LOGITS + 6 * 512)  # twice section 6's batch
    assert p["FSDP2"]["crossing"] == 1.5 * W and p["FSDP2"]["fits"]
    assert [r["layout"] for r in predictions(budget=7 * 2**20).values() if r["best"]] == ["FSDP2"]
    assert not any(r["best"] for r in predictions(budget=6 * 2**20).values())
    assert "fastest predicted of those that fit: none" in L.layout_table(ways(2), ways(4), mesh_run(),
                                                                       budget=6 * 2**20)


def layouts_run(*, steps=(0.115, 0.23, 0.62), memory: float = 1.0, link: float = 1.005,
                equal: bool = True) -> SimpleNamespace:
    """fsdp_tp.py --layouts hsdp dp,tp tp,dp --time-steps on the cluster, measured as predicted
    (times memory and link)."""
    by_layout = {r["runs_as"]: r for r in predictions().values() if r["runs_as"]}
    records = []
    for (layout, r), step in zip(by_layout.items(), steps):
        state = r["state"] * memory
        for rank in range(4):
            records.append({"part": "2d", "rank": rank, "layout": layout, "equal": equal})
            records.append({"part": "timing", "rank": rank, "layout": layout, "step_s": step,
                            "params": state / 4, "grads": state / 4, "optimizer": state / 2,
                            "activations": r["activations"] * memory,
                            "link_sent_per_step": r["crossing"] * link})
    return SimpleNamespace(records=records, world_size=4)


def claims(run) -> list[str]:
    return L.layout_claims(ways(2), ways(4), mesh_run(), run).splitlines()


def test_the_layout_claims_hold_as_predicted_and_fail_otherwise():
    assert all(line.endswith(": True") for line in claims(layouts_run()))
    assert claims(layouts_run(memory=1.01))[0].endswith(": False")
    assert claims(layouts_run(link=0.99))[1].endswith(": False")  # fewer bytes than the collectives need
    assert claims(layouts_run(link=1.12))[1].endswith(": False")
    assert claims(layouts_run(link=1.39))[1].endswith(": False")  # reduce-scatters priced by the formula
    slow_hsdp = claims(layouts_run(steps=(0.3, 0.23, 0.62)))
    assert slow_hsdp[2].endswith(": False") and slow_hsdp[3].endswith(": False")
    assert claims(layouts_run(steps=(0.115, 0.62, 0.23)))[3].endswith(": False")
    assert claims(layouts_run(steps=(0.04, 0.23, 0.62)))[4].endswith(": False")  # faster than the link
    assert claims(layouts_run(equal=False))[5].endswith(": False")
    table = L.layout_measured_table(ways(2), ways(4), mesh_run(), layouts_run()).splitlines()
    assert [line.split()[0] for line in table[2:]] == ["hsdp", "dp,tp", "tp,dp"]
