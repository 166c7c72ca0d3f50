"""Lesson 07: the measuring tools of the rank scripts (probes.py), the notebook's pure
helpers (lesson07.py: traffic formulas, GPipe replay, parallel layout, self-check), and
one real torchrun run of the hand-written tensor-parallel MLP against the unsplit one."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import LESSONS
import torch

from labutils import launch
from labutils.course import lesson

LESSON = LESSONS / "07_beyond_ddp"


@pytest.fixture
def lesson07():
    return lesson.load(LESSON, "lesson07")


@pytest.fixture
def probes(lesson07):
    return lesson.load(LESSON, "probes")


# ------------------------------------------------------------------ probes.py

def test_storage_bytes_counts_each_storage_once(probes):
    base = torch.zeros(10, 4)
    assert probes.storage_bytes([base, base[2:], base.view(40), None]) == 160
    assert probes.storage_bytes([base, torch.zeros(3, dtype=torch.float64)]) == 160 + 24


def test_saved_activations_of_a_block_are_16_values_per_token_and_width(probes):
    models = lesson.load(LESSON, "models")
    cfg = models.Config(vocab=64, width=32, heads=2, blocks=2, seq_len=16)
    torch.manual_seed(0)
    model = models.TinyTransformer(cfg)
    x, y = models.token_batch(0, 0, batch_size=3, cfg=cfg)
    with probes.SavedActivations(model) as meter:
        models.lm_loss(model(x), y)
    tokens = x.numel()
    # 16 x width floats per token, plus two LayerNorms' mean and 1/std (4 floats) and the
    # attention's log-sum-exp (one float per head)
    per_block = tokens * 4 * (16 * cfg.width + 4 + cfg.heads)
    assert meter.by_part["blocks.0"] == meter.by_part["blocks.1"] == per_block
    assert set(meter.by_part) >= {"embeddings", "blocks.0", "blocks.1", "ln", "head", "loss"}
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())  # hooks removed


def test_rank_scripts_use_the_labutils_collective_log(probes):
    from labutils.course import ddp_probes

    # one recorder for lesson 03 and lesson 07: tested in tests/course/test_collective_log.py
    assert probes.CollectiveLog is ddp_probes.CollectiveLog


# ------------------------------------------------------------------ lesson07.py

@pytest.mark.parametrize(("op", "world", "rank", "peer", "expected"), [
    ("all_reduce", 2, 0, None, 100.0),
    ("all_reduce", 4, 0, None, 150.0),
    ("all_gather_single", 4, 1, None, 75.0),
    ("reduce_scatter_single", 2, 1, None, 50.0),
    ("broadcast", 4, 0, 0, 0.0),
    ("broadcast", 4, 2, 0, 100.0),
    ("send", 2, 0, 1, 100.0),
])
def test_rank_traffic_uses_lesson_02_formulas(lesson07, op, world, rank, peer, expected):
    call = {"op": op, "nbytes": 100, "peer": peer}
    assert lesson07.rank_traffic(call, world_size=world, rank=rank) == pytest.approx(expected)


@pytest.mark.parametrize(("stages", "micro"), [(2, 1), (2, 4), (3, 5), (4, 12)])
def test_gpipe_replay_with_equal_times_gives_the_formula(lesson07, stages, micro):
    replay = lesson07.gpipe_replay([[1.0] * micro] * stages, [[2.0] * micro] * stages)
    assert replay["step_s"] == pytest.approx((micro + stages - 1) * 3.0)
    formula = lesson07.bubble_formulas(stages, micro)
    assert replay["idle_fraction"] == pytest.approx([formula["idle_fraction"]] * stages)
    assert formula["idle_over_busy"] == pytest.approx((stages - 1) / micro)


def test_gpipe_replay_with_a_slow_stage(lesson07):
    # stage 1 twice as slow: the pipeline runs at its pace, stage 0 waits
    replay = lesson07.gpipe_replay([[1.0] * 4, [2.0] * 4], [[1.0] * 4, [2.0] * 4])
    assert replay["step_s"] == pytest.approx(1 + 4 * 2 + 4 * 2 + 1)
    assert replay["idle_fraction"][0] > replay["idle_fraction"][1]
    with pytest.raises(ValueError, match="one list of m times per stage"):
        lesson07.gpipe_replay([[1.0] * 4, [1.0] * 3], [[1.0] * 4, [1.0] * 4])


def test_parallel_layout_matches_a_pp_dp_tp_mesh(lesson07):
    lay = lesson07.parallel_layout(16, tp=4, pp=2)
    assert lay["dp"] == 2
    mesh = torch.arange(16).view(2, 2, 4)  # the order init_device_mesh uses for (pp, dp, tp)
    assert lay["groups"]["tp"] == sorted(mesh.reshape(-1, 4).tolist())
    assert lay["groups"]["dp"] == sorted(mesh.permute(0, 2, 1).reshape(-1, 2).tolist())
    assert lay["groups"]["pp"] == sorted(mesh.permute(1, 2, 0).reshape(-1, 2).tolist())
    for kind in ("tp", "dp", "pp"):
        assert sorted(r for g in lay["groups"][kind] for r in g) == list(range(16))


@pytest.mark.parametrize(("world", "tp", "pp"), [(6, 4, 1), (8, 0, 2), (8, 2, True), (8.0, 2, 2)])
def test_parallel_layout_rejects_bad_degrees(lesson07, world, tp, pp):
    with pytest.raises(ValueError, match="parallel_layout"):
        lesson07.parallel_layout(world, tp=tp, pp=pp)


def test_check_answers(lesson07, capsys):
    right = {name: want for name, (want, _) in lesson07.EXPECTED.items()}
    lesson07.check_answers(right)
    assert capsys.readouterr().out.count(": correct") == len(right)
    lesson07.check_answers({"q1_bytes_per_param_fp32_adam": 20, "q6_keep_inside_one_machine": "Pipeline",
                            "q9": 1})
    out = capsys.readouterr().out
    assert "q1_bytes_per_param_fp32_adam: not quite" in out and "q6_keep_inside_one_machine: not quite" in out
    assert "unknown question names ['q9']" in out and "q2_adam_gb_per_rank_1e9_params_8_ranks: not answered" in out


# ------------------------------------------------------------------ a real run

def test_tensor_parallel_mlp_equals_the_unsplit_one(runs_dir, lesson07):
    result = launch(LESSON / "tensor_parallel.py", 2, display="none", hang_timeout=90, timeout=300)
    assert result.ok, result.summary()
    hand = [r for r in result.records if r["part"] == "by hand"]
    assert sorted(r["rank"] for r in hand) == [0, 1]
    for rec in hand:
        assert all(c["verdict"] == "equal (assert_close)" for c in rec["checks"]), rec["checks"]
        assert [(c["op"], c["phase"]) for c in rec["calls"]] == [("all_reduce", "forward"), ("all_reduce", "backward")]
        assert rec["trap_grad_ratio"] == pytest.approx(2.0)
    for rec in (r for r in result.records if r["part"] == "library"):
        assert rec["verdict"] == "equal (assert_close)" and rec["forward_collectives"] == {"all_reduce": 1}


def _wire_records(sent_ddp=100, sent_fsdp=190):
    """Synthetic fsdp_wire.py records: 2 ranks, 2 timed steps, P = 200 bytes."""
    calls = [{"op": "all_gather_single", "nbytes": 200, "s": 0.010},
             {"op": "reduce_scatter_single", "nbytes": 200, "s": 0.020}]
    recs = [{"part": "wire model", "rank": r, "parameter_bytes": 200} for r in (0, 1)]
    for step in (2, 3):
        for rank in (0, 1):
            recs += [{"part": "wire step", "rank": rank, "way": "compute only", "step": step,
                      "step_s": 0.010, "sent": 0, "calls": []},
                     {"part": "wire step", "rank": rank, "way": "DDP", "step": step,
                      "step_s": 0.030 + 0.002 * rank, "sent": sent_ddp, "calls": []},
                     {"part": "wire step", "rank": rank, "way": "FSDP2", "step": step,
                      "step_s": 0.050, "sent": sent_fsdp, "calls": calls}]
    return recs


def test_wire_summary_prices_calls_and_takes_the_slower_rank(lesson07):
    fractions = {"all_reduce": 1.0, "all_gather_single": 0.5, "reduce_scatter_single": 1.0}
    summary = lesson07.wire_summary(_wire_records(), sent_fraction=fractions, link_bps=8_000)
    ddp, fsdp = summary["DDP"], summary["FSDP2"]
    assert ddp["formula"] == 200 and fsdp["formula"] == 0.5 * 200 + 1.0 * 200
    assert ddp["step_s"] == pytest.approx(0.032)           # the slower rank, median over steps
    assert fsdp["wire_s"] == pytest.approx(190 * 8 / 8_000)
    assert fsdp["inside_s"] == pytest.approx(0.030)
    assert fsdp["ops"]["reduce_scatter_single"]["wire_s"] == pytest.approx(200 * 8 / 8_000)
    table = lesson07.wire_bytes_table(summary)
    assert "1 x all_gather, 1 x reduce_scatter" in table and "compute only" not in table
    assert "-" in lesson07.wire_time_table(summary).splitlines()[2]  # DDP: no FSDP2 collectives


def test_wire_summary_without_a_link(lesson07):
    recs = [dict(r, sent=None) if r["part"] == "wire step" else r for r in _wire_records()]
    summary = lesson07.wire_summary(recs, sent_fraction={"all_reduce": 1.0, "all_gather_single": 0.5,
                                                         "reduce_scatter_single": 1.0}, link_bps=None)
    assert summary["FSDP2"]["sent"] is None and summary["FSDP2"]["wire_s"] is None
    assert lesson07.job_bytes_line({}, {}, recs).startswith("no link counters")


def test_fsdp_wire_ways_learn_the_same_and_log_their_collectives(runs_dir, lesson07):
    # on loopback (no virtual cluster): no bytes counted, everything else as on the cluster
    result = launch(LESSON / "fsdp_wire.py", 2, args=["--steps", "1"], display="none",
                    hang_timeout=90, timeout=300)
    assert result.ok, result.summary()
    model = [r for r in result.records if r["part"] == "wire model"]
    assert len(model) == 2 and all(r["all_to_all_reduce_scatter_ok"] for r in model)
    checks = {(r["rank"], r["way"]): r["losses"] for r in result.records if r["part"] == "wire check"}
    assert set(checks.values()) == {"equal (assert_close)"} and len(checks) == 4
    ops = {r["way"]: sorted(c["op"] for c in r["calls"]) for r in result.records
           if r["part"] == "wire step" and r["rank"] == 0}
    assert ops["DDP"] == [] and ops["compute only"] == []
    assert ops["FSDP2"] == ["all_gather_single"] * 9 + ["reduce_scatter_single"] * 5
    assert ops["FSDP2, all-to-all reduce-scatter"] == ["all_gather_single"] * 9 + ["all_to_all_single"] * 5
    assert all(r["sent"] is None for r in result.records if r["part"] == "wire step")


def test_the_fsdp_check_table_shows_ddp_as_the_reference_not_as_equal_to_itself(lesson07):
    records = [{"part": "check", "run": run, "rank": rank, "loss_curve": curve,
                "weights_bitwise": bitwise}
               for run, curve, bitwise in (("DDP", "equal (assert_close)", True),
                                           ("FSDP2", "DIFFERENT", False))
               for rank in (0, 1)]
    rows = [line.split("  ") for line in lesson07.fsdp_check_table(records).splitlines()[2:]]
    rows = [[cell.strip() for cell in row if cell.strip()] for row in rows]
    assert rows == [["DDP (the reference)", "0", "-", "-"], ["DDP (the reference)", "1", "-", "-"],
                    ["FSDP2", "0", "DIFFERENT", "not bitwise"], ["FSDP2", "1", "DIFFERENT", "not bitwise"]]


def test_wire_claims_read_the_collectives_table_and_can_say_false(lesson07):
    def summary(a2a_op_inside, a2a_inside):
        def way(name, inside, wire, ops):
            return {"way": name, "inside_s": inside, "wire_s": wire,
                    "ops": {op: {"inside_s": op_inside, "wire_s": 0.1} for op, op_inside in ops.items()}}
        return {"FSDP2": way("FSDP2", 0.383, 0.302, {"all_gather_single": 0.20, "reduce_scatter_single": 0.115}),
                "FSDP2, all-to-all reduce-scatter": way("FSDP2, all-to-all reduce-scatter", a2a_inside, 0.224,
                                                        {"all_gather_single": 0.22,
                                                         "all_to_all_single": a2a_op_inside})}

    # as lesson 07's runs measure it: the all-to-all at about twice its wire time, and the
    # way's collectives within a few tens of ms of the default's (the bytes save 78 ms)
    assert lesson07.wire_claims(summary(0.19, 0.369)).count(": True") == 2
    # an all-to-all as quick for its bytes as the reduce-scatter would save more than that
    assert [line.rsplit(": ", 1)[1] for line in lesson07.wire_claims(summary(0.11, 0.29)).splitlines()] == \
        ["False", "False"]
