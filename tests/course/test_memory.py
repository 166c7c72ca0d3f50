"""labutils.course.memory: bytes held and bytes saved for backward, counted by hand on
small models in one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labutils.course.memory import SavedBytes, held_bytes, is_parameter, storages

F32 = 4


def test_held_bytes_counts_each_storage_once():
    a, b = torch.zeros(10), torch.zeros(3, 4)
    cases = [
        ([a], 10 * F32),
        ([a, a], 10 * F32),                      # the same tensor twice
        ([a, a[2:5], a.view(2, 5)], 10 * F32),   # views: their storage, whole, once
        ([a, b], 22 * F32),
        ([None, b, None], 12 * F32),             # a missing gradient counts nothing
        ([], 0),
        ([torch.zeros(4, dtype=torch.bfloat16)], 8),
    ]
    for tensors, want in cases:
        assert held_bytes(tensors) == want, (tensors, want)
    assert held_bytes(iter([a, b])) == 22 * F32   # any iterable, a generator too


def test_a_wrapper_subclass_counts_the_tensors_inside_it():
    from torch.distributed.tensor import DeviceMesh, DTensor, Shard, distribute_tensor

    store = dist.HashStore()
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        mesh = DeviceMesh("cpu", [0])
        d = distribute_tensor(torch.arange(12.0).reshape(3, 4), mesh, [Shard(0)])
        assert isinstance(d, DTensor)
        inner = storages(d)
        assert [s.data_ptr() for s in inner] == [d.to_local().untyped_storage().data_ptr()]
        assert held_bytes([d, d.to_local()]) == 12 * F32  # the DTensor is its local piece
    finally:
        dist.destroy_process_group()


def test_is_parameter():
    layer = torch.nn.Linear(3, 2)
    assert is_parameter(layer.weight)
    assert is_parameter(layer.weight.t())            # a view, as Linear saves it
    assert not is_parameter(layer.weight.detach())   # same storage, no link back
    assert not is_parameter(torch.zeros(2))


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def test_saved_bytes_are_the_activations_parameters_left_out():
    model, x = _mlp(), torch.randn(5, 8)
    with SavedBytes() as saved:
        loss = model(x).sum()
    # the first Linear keeps its input (5 x 8), ReLU its output (5 x 16), which is also
    # the second Linear's input: once; the weights are parameters
    assert saved.total == (5 * 8 + 5 * 16) * F32
    loss.backward()   # the hooks handed every tensor back unchanged
    assert model[0].weight.grad is not None
    with SavedBytes(model) as by_model:
        model(x).sum()
    assert by_model.total == saved.total


def test_a_model_leaves_out_what_shares_a_parameters_storage():
    model = _mlp()
    x = torch.randn(5, 8, requires_grad=True)
    # the weight, detached: a parameter's storage in a tensor that is no parameter, as
    # FSDP2's gathered parameters are; autograd keeps it for x's gradient
    detached = model[0].weight.detach()
    for owner, want in ((None, 16 * 8 * F32), (model, 0)):
        with SavedBytes(owner) as saved:
            F.linear(x, detached).sum()
        assert saved.total == want, owner


def test_nothing_is_counted_outside_the_context_and_each_use_adds():
    x = torch.randn(256, requires_grad=True)
    saved = SavedBytes()
    x.exp().sum()
    assert saved.total == 0
    with saved:
        x.exp().sum()   # exp keeps its result for backward
    with saved:
        x.exp().sum()   # another result: another storage
    assert saved.total == 2 * 256 * F32
    with saved:
        x.exp().exp()   # two more: the first exp's result is the second's input too
    assert saved.total == 4 * 256 * F32


@pytest.mark.parametrize("dtype,size", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_the_bytes_follow_the_dtype(dtype, size):
    layer = torch.nn.Linear(8, 8).to(dtype)
    with SavedBytes(layer) as saved:
        layer(torch.randn(3, 8, dtype=dtype)).sum()
    assert saved.total == 3 * 8 * size
