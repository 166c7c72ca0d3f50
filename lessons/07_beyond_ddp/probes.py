"""Measuring tools shared by lesson 07's rank scripts: memory held by tensors,
activations saved for backward, and the collectives a rank issues.

    from probes import storage_bytes, SavedActivations, CollectiveLog
    storage_bytes(model.parameters())          # bytes of their distinct storages
    meter = SavedActivations(model)            # tags saved tensors by top-level part
    with meter:
        loss = loss_fn(model(x), y)            # meter.by_part: {part: bytes}
    with CollectiveLog(["all_gather_single", "reduce_scatter_single"]) as log:
        log.phase = "forward"; ...             # log.calls: one CollectiveCall per collective

CollectiveLog is labutils.course.collective_log.CollectiveLog (lesson 03 counts PowerSGD's
all-reduces with the same helper), re-exported here for the rank scripts.

"Measured" here means: the bytes of the tensors that exist (distinct storages, so
views and shared buffers count once), not a formula. CPU has no allocator counter
like torch.cuda.memory_allocated; on GPUs compare with it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
from torch import nn

from labutils.course.collective_log import CollectiveCall, CollectiveLog  # noqa: F401  (re-exported)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank holds: a DTensor's local shard, else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind tensors (None skipped, DTensors: local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        st = local(t).untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(state: dict) -> list[torch.Tensor]:
    """Every tensor an optimizer keeps in .state (Adam: step, exp_avg, exp_avg_sq)."""
    return [v for per_param in state.values() for v in per_param.values() if torch.is_tensor(v)]


def fingerprint(tensors: Iterable[torch.Tensor]) -> str:
    """A short hash of the values (full tensors: gather DTensors before)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:10]


class SavedActivations:
    """Records the tensors autograd saves for backward inside a `with` block.

    Saved tensors that are parameters are not activations and are skipped; the rest
    count once per storage, under the name of the top-level child of `model` that was
    running (or "embeddings" before the first child, i.e. in model.forward itself, and
    "loss" after the model returned).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.by_part: dict[str, int] = {}
        self.shapes: dict[str, list[tuple[list[int], str]]] = {}
        self._part = "loss"
        self._seen: set[int] = set()
        self._params: set[int] = set()
        self._handles: list = []
        self._hooks = None

    @property
    def total(self) -> int:
        return sum(self.by_part.values())

    def _set(self, name: str):
        def hook(module, args):
            self._part = name
        return hook

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = local(t).untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self._params and ptr not in self._seen:
            self._seen.add(ptr)
            self.by_part[self._part] = self.by_part.get(self._part, 0) + st.nbytes()
            self.shapes.setdefault(self._part, []).append((list(t.shape), str(t.dtype).replace("torch.", "")))
        return t

    def __enter__(self) -> "SavedActivations":
        self.by_part, self.shapes, self._seen = {}, {}, set()
        self._params = {local(p).untyped_storage().data_ptr() for p in self.model.parameters()}
        self._handles = [self.model.register_forward_pre_hook(self._set("embeddings")),
                         self.model.register_forward_hook(lambda *a: self._set("loss")(None, None))]
        for name, child in self.model.named_children():
            if isinstance(child, nn.ModuleList):
                self._handles += [c.register_forward_pre_hook(self._set(f"{name}.{i}")) for i, c in enumerate(child)]
            elif name not in ("tok", "pos"):
                self._handles.append(child.register_forward_pre_hook(self._set(name)))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
