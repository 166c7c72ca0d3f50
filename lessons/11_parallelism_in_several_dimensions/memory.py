"""What a rank holds, counted by walking tensors: lesson 11's scripts share it.

    from memory import SavedBytes, held_bytes
    saved = SavedBytes(model)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        loss = loss_fn(model(x))
    saved.total                       # bytes autograd keeps for backward, parameters left out
    held_bytes(model.parameters())    # bytes of these tensors' storages, each storage once

A tensor subclass that wraps others (a DTensor, a collective's result still in flight)
is counted by its inner tensors: a DTensor by the piece this rank holds.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def storages(t: torch.Tensor) -> list[tuple[int, int]]:
    """(address, bytes) of the memory behind a tensor."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, name) for name in names)
        return [s for x in inner if isinstance(x, torch.Tensor) for s in storages(x)]
    storage = t.untyped_storage()
    return [(storage.data_ptr(), storage.nbytes())]


def held_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the tensors' storages, each storage once."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            seen.update(storages(t))
    return sum(seen.values())


class SavedBytes:
    """Bytes of the tensors autograd saves for backward, once per storage, parameters
    left out: the activation memory of a step on this rank. The parameters are read at
    every save, so that FSDP2's gathered ones, which replace the shards during a group's
    forward, are left out too."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        params = {ptr for p in self.model.parameters() for ptr, _ in storages(p)}
        for ptr, nbytes in storages(t):
            if ptr not in params:
                self.storages[ptr] = nbytes
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())
