"""labutils.course.ddp_probes.CollectiveLog: what it records, and that it puts torch back.

One gloo process group of one rank in this process (the lessons use it on 2-4 ranks:
lesson 03's PowerSGD counts, lesson 07's ZeRO, FSDP2 and tensor-parallel traffic).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labutils.course.ddp_probes import CollectiveLog, count_all_reduces
from labutils.errors import InputError


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_records_op_bytes_phase_and_peer_with_positional_and_keyword_arguments(group):
    real = {op: getattr(dist, op) for op in ("all_reduce", "broadcast", "all_gather_single",
                                              "reduce_scatter_single")}
    seen = []
    with CollectiveLog(list(real), on_call=seen.append) as log:
        log.phase = "forward"
        dist.all_reduce(torch.ones(6))                               # 24 bytes
        dist.broadcast(tensor=torch.ones(3, dtype=torch.float64), src=0)  # 24, peer 0
        log.phase = "backward"
        dist.all_gather_single(torch.empty(4), torch.ones(4))        # output: the whole array
        dist.reduce_scatter_single(output=torch.empty(2, dtype=torch.int64),
                                   input=torch.ones(2, dtype=torch.int64))
    got = [(c.op, c.numel, c.nbytes, c.dtype, c.phase, c.peer) for c in log.calls]
    assert got == [("all_reduce", 6, 24, "float32", "forward", None),
                   ("broadcast", 3, 24, "float64", "forward", 0),
                   ("all_gather_single", 4, 16, "float32", "backward", None),
                   ("reduce_scatter_single", 2, 16, "int64", "backward", None)]
    assert seen == log.calls
    assert all(getattr(dist, op) is fn for op, fn in real.items()), "torch.distributed restored"
    assert set(log.calls[0].to_json()) >= {"op", "nbytes", "phase", "peer"}


def test_the_real_call_still_runs_and_errors_still_restore(group):
    t = torch.full((2,), 3.0)
    with pytest.raises(RuntimeError, match="boom"):
        with count_all_reduces() as calls:
            dist.all_reduce(t)
            raise RuntimeError("boom")
    assert torch.equal(t, torch.full((2,), 3.0)) and len(calls) == 1   # a sum over one rank
    assert dist.all_reduce.__name__ == "all_reduce" and dist.all_reduce.__module__.startswith("torch")


def test_unknown_op_is_one_line_before_anything_is_wrapped():
    before = dist.all_reduce
    with pytest.raises(InputError, match=r"CollectiveLog ops: expected names among .*got \['allreduce'\]"):
        CollectiveLog(["all_reduce", "allreduce"])
    assert dist.all_reduce is before


def test_on_a_torch_before_2_13_the_new_names_log_the_old_functions(group, monkeypatch):
    """torch 2.11 has no all_gather_single: FSDP2 calls all_gather_into_tensor there, and
    a log of "all_gather_single" wraps that (lesson 07 on a GPU machine's torch 2.11)."""
    old = dist.all_gather_into_tensor
    monkeypatch.delattr(dist, "all_gather_single")
    with CollectiveLog(["all_gather_single", "all_reduce"]) as log:
        dist.all_gather_into_tensor(torch.empty(4), torch.ones(4))
        # what a script wraps again (lesson 07's fsdp_wire.py puts a clock around each)
        assert log.installed == ["all_gather_into_tensor", "all_reduce"]
    assert [(c.op, c.nbytes) for c in log.calls] == [("all_gather_single", 16)]
    assert dist.all_gather_into_tensor is old and not hasattr(dist, "all_gather_single")
