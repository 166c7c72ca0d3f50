"""Lesson 12's notebook helpers (lessons/12_where_memory_goes/lesson12.py) on hand-made
records: the memory formulas, and claims that must turn False when a record is off.
The notebook runs the scripts (nbval)."""

from __future__ import annotations

from types import SimpleNamespace

from helpers import LESSONS

from labutils.course import lesson

L = lesson.load(LESSONS / "12_where_memory_goes", "lesson12")
NUMEL, DIM, ROWS, N = 2_102_272, 256, 64, 4


def anatomy_run(**off) -> SimpleNamespace:
    """anatomy.py's records on 4 ranks, each part as the formula says; off={"way.part": delta}."""
    records = [{"rank": r, "part": "model", "numel": NUMEL, "dim": DIM, "rows": ROWS} for r in range(N)]
    for way in L.WAYS:
        want = L.predicted(way, numel=NUMEL, world_size=N, dim=DIM, rows=ROWS)
        for r in range(N):
            rec = {"rank": r, "part": "anatomy", "way": way, **want}
            for key, delta in off.items():
                w, part = key.split(".")
                if w == way and r == 1:
                    rec[part] += delta
            records.append(rec)
    return SimpleNamespace(records=records, world_size=N)


def test_the_formulas_are_the_bytes_torch_2_13_gave_on_4_ranks():
    # what anatomy.py measured (2026-11-27): rank 0, every way
    assert L.predicted("ddp", numel=NUMEL, world_size=N, dim=DIM, rows=ROWS) == {
        "params": 8_409_088, "grads": 8_409_088, "optimizer": 16_818_176, "activations": 2_490_368}
    assert L.predicted("zero1", numel=NUMEL, world_size=N, dim=DIM, rows=ROWS)["optimizer"] == 4_204_544
    assert L.predicted("fsdp2", numel=NUMEL, world_size=N, dim=DIM, rows=ROWS)["params"] == 2_102_272
    tp = L.predicted("tp", numel=NUMEL, world_size=N, dim=DIM, rows=ROWS)
    assert (tp["params"], tp["optimizer"], tp["activations"]) == (2_105_344, 4_210_688, 917_504)


def test_anatomy_claims_hold_only_when_every_part_matches():
    assert L.anatomy_claims(anatomy_run()).startswith(
        "every part, every way, all 4 ranks equal to the formula to the byte: True")
    claims = L.anatomy_claims(anatomy_run(**{"zero1.optimizer": 8}))
    assert ": False" in claims and "zero1 rank 1 optimizer: 4204552 != 4204544" in claims
    table = L.anatomy_table(anatomy_run())
    assert "ddp" in table and "34.45" in table  # 32 MiB of model state + 2.4 MiB of activations


def ckpt_run(*, full_extra: int = 134_217_728, selective_gelu: int = 4, equal: bool = True):
    base = 503_316_480
    recs = [
        {"rank": 0, "part": "checkpointing", "how": "none", "held": 2_424_832, "backward_flops": base,
         "backward_ops": 87, "recomputed": {"mm": 15}},
        {"rank": 0, "part": "checkpointing", "how": "full", "held": 347_904,
         "backward_flops": base + full_extra, "backward_ops": 139,
         "recomputed": {"addmm": 4, "gelu": 4, "mm": 15}},
        {"rank": 0, "part": "checkpointing", "how": "selective", "held": 1_658_624, "backward_flops": base,
         "backward_ops": 135, "recomputed": {"gelu": selective_gelu, "mm": 15}},
        {"rank": 0, "part": "equal", "gradients_equal": equal},
    ]
    return SimpleNamespace(records=recs, world_size=1)


def test_checkpoint_claims_turn_false_with_the_facts():
    assert "False" not in L.checkpoint_claims(ckpt_run())
    assert "exactly: False" in L.checkpoint_claims(ckpt_run(full_extra=2 * 134_217_728))
    assert "in backward: False" in L.checkpoint_claims(ckpt_run(selective_gelu=0))
    assert "bit for bit: False" in L.checkpoint_claims(ckpt_run(equal=False))
    assert "selective" in L.checkpoint_table(ckpt_run())


def accum_run(*, loud_ratio: float = 4.0, fsdp_equal: bool = True, every_calls=(1, 2, 2, 2),
              fsdp_calls=(0, 0, 0, 4)):
    def rec(way, equal, ratio, collective, calls):
        return {"rank": 0, "part": "accumulation", "way": way, "equal": equal, "norm_ratio": ratio,
                "collective": collective, "calls": calls}
    recs = [rec("ddp, no_sync", True, 1.0, "all_reduce", [0, 0, 0, 1]),
            rec("ddp, every micro-step synced", True, 1.0, "all_reduce", every_calls),
            rec("ddp, loss not divided", False, loud_ratio, "all_reduce", [0, 0, 0, 1]),
            rec("fsdp2, sync on the last", fsdp_equal, 1.0, "reduce_scatter", fsdp_calls),
            {"rank": 0, "part": "global_batch", "micro": 8, "accum": 4, "world_size": 4, "rows": 128}]
    return SimpleNamespace(records=recs, world_size=4)


def test_accumulation_claims_turn_false_with_the_facts():
    assert "False" not in L.accumulation_claims(accum_run())
    assert "4x the gradient: False" in L.accumulation_claims(accum_run(loud_ratio=1.0))
    assert "in every micro-step: False" in L.accumulation_claims(accum_run(every_calls=(1, 0, 0, 2)))
    assert "reduce-scatters in the last micro-step only: False" in \
        L.accumulation_claims(accum_run(fsdp_calls=(4, 0, 0, 4)))
    assert "last micro-step only gives the global batch's gradient: False" in \
        L.accumulation_claims(accum_run(fsdp_equal=False))
    assert "0, 0, 0, 4" in L.accumulation_table(accum_run())


def snapshot_run(*, step_added: int = 8 * NUMEL, state: int = 16 * NUMEL, peak: int = 120 * 2**20):
    """Readings shaped like an H200's (torch 2.11): cuBLAS's 32 MiB workspace counted from the
    forward's first matrix multiplication on, a second one for autograd's thread."""
    workspace = 32 * 2**20
    model = 4 * NUMEL
    inputs = model + 2 * 4 * ROWS * DIM
    forward = inputs + 2_400_000 + workspace
    backward = inputs + 4 * NUMEL + 2 * workspace
    readings = {"model": model, "inputs": inputs, "after forward": forward, "after backward": backward,
                "after step": backward + step_added, "state alone": state}
    return SimpleNamespace(records=[{"rank": 0, "part": "snapshot", "readings": readings, "peak": peak,
                                     "numel": NUMEL, "rows": ROWS, "path": "x", "events": 120,
                                     "live_blocks": [[2**20, 8]]}],
                           world_size=1)


def test_snapshot_claims_on_the_gpu_readings_turn_false_with_the_facts():
    assert "False" not in L.snapshot_claims(snapshot_run())
    assert "Adam's 8 bytes per parameter (within 2%): False" in L.snapshot_claims(snapshot_run(step_added=4 * NUMEL))
    assert "above every reading: False" in L.snapshot_claims(snapshot_run(peak=1))
    # the step's reading with the workspaces still in it is not the state
    after_step = snapshot_run().records[0]["readings"]["after step"]
    assert "16 bytes per parameter (within 2%): False" in L.snapshot_claims(snapshot_run(state=after_step))
    assert "bytes per parameter" in L.snapshot_table(snapshot_run())
