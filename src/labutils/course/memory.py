"""What a rank holds, counted by walking tensors: the memory lessons' rank scripts share it.

    from labutils.course.memory import SavedBytes, held_bytes

    with SavedBytes(model) as saved:       # autograd's saved_tensors_hooks while open
        loss = loss_fn(model(x))
    saved.total                            # bytes autograd keeps for backward, parameters left out
    held_bytes(model.parameters())         # bytes of these tensors' storages, each storage once

A tensor subclass that wraps others (a DTensor, a collective's result still in flight) is
counted by the tensors inside it: a DTensor by the piece this rank holds.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The memory behind a tensor: its storage, or the storages of the tensors a wrapper
    subclass holds."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, name) for name in names)
        return [s for x in inner if isinstance(x, torch.Tensor) for s in storages(x)]
    return [t.untyped_storage()]


def held_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the tensors' storages, each storage once (views of one storage count once;
    None, a missing gradient, counts nothing)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            seen.update((s.data_ptr(), s.nbytes()) for s in storages(t))
    return sum(seen.values())


def is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (Linear saves its weight, transposed, for backward)."""
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


class SavedBytes:
    """Bytes of the tensors autograd saves for backward while the context is open, once
    per storage, parameters left out: the activation memory of a step on this rank.

    A parameter is a tensor that is one (or a view of one) or, with a model, any tensor
    whose storage holds one of the model's parameters at the moment it is saved: FSDP2's
    gathered parameters, which stand in for the shards during a group's forward, are left
    out too. Each counted storage is kept alive until this object goes, so no storage
    allocated later can take its address and be missed.

    Args:
        model: the module whose parameters are left out by storage; None to leave out
            parameter objects only.
    """

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self.model = model
        self.kept: dict[int, torch.UntypedStorage] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """The pack hook: note t's storages, hand t back unchanged."""
        if is_parameter(t):
            return t
        params = set() if self.model is None else {
            s.data_ptr() for p in self.model.parameters() for s in storages(p)}
        for storage in storages(t):
            if storage.data_ptr() not in params:
                self.kept.setdefault(storage.data_ptr(), storage)
        return t

    @property
    def total(self) -> int:
        return sum(s.nbytes() for s in self.kept.values())

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
