"""Count the collectives a block of code issues, with their sizes and their groups.

CommDebugMode (torch.distributed.tensor.debug) counts collectives by name. It sees
DTensor's redistributions (functional collectives) and the c10d calls that FSDP2 and
the torch.distributed functions make, since both go through torch's dispatcher.
CollectiveCounter is CommDebugMode that also notes, for every collective, its dtype,
the bytes of the whole array as lesson 02 counts them (the gathered output of an
all-gather, the input of a reduce-scatter, the tensor of an all-reduce) and the mesh
dimension whose group ran it::

    from labutils.course.comm_count import CollectiveCounter, sent_per_rank
    with CollectiveCounter(mesh) as comm:
        y = x.redistribute(mesh, (Replicate(), Replicate()))
    comm.get_comm_counts()   # CommDebugMode's own count: {op: calls}
    comm.calls               # [{"op": "all_gather", "dtype": "float32", "nbytes": 4194304,
                             #   "group_size": 2, "mesh_dim": "1", "name": "..."}]
    sent_per_rank(comm.calls[0])  # bytes one rank sends for it, by lesson 02's formulas

Lessons 10 and 11 count with it.
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops

from labutils.course.timing import busbw_factor

# dispatcher op name -> (collective, where the whole array is: "input x group", or the
# position of the argument that holds it)
_OPS = {
    "all_gather_into_tensor": ("all_gather", "input x group"),  # functional: input is my shard
    "_allgather_base_": ("all_gather", 0),                       # c10d: (output, input, group, ...)
    "reduce_scatter_tensor": ("reduce_scatter", 0),              # functional: (input, op, size, name)
    "_reduce_scatter_base_": ("reduce_scatter", 1),              # c10d: (output, input, group, op, ...)
    "all_reduce": ("all_reduce", 0),
    "allreduce_": ("all_reduce", 0),                             # c10d: ([tensors], group, op, ...)
    "all_to_all_single": ("all_to_all", 0),
    "alltoall_base_": ("all_to_all", 1),
    "broadcast_": ("broadcast", 0),
}


def _group_of(args) -> dist.ProcessGroup | None:
    """The process group among a collective's arguments: a group name (functional
    collectives) or a ProcessGroup object (c10d ops)."""
    for a in args:
        if isinstance(a, str):
            try:
                return _resolve_process_group(cast(Any, a))  # a group's name
            except (ValueError, RuntimeError):
                continue
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a)
            except RuntimeError:  # another kind of object (a ReduceOp)
                continue
    return None


def _nbytes(value) -> int:
    tensors = value if isinstance(value, (list, tuple)) else [value]
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def _dtype(value) -> str:
    t = value[0] if isinstance(value, (list, tuple)) else value
    return str(t.dtype).replace("torch.", "")


# CommDebugMode tracks modules with full backward hooks, which wrap each module's output
# in a view: FSDP2 then warns that its module returned a view, and torch that the hooks
# fire on outputs. Both come from the counting itself, so they are silenced inside it.
_COUNTING_WARNINGS = [r"FSDP2-wrapped module .* returned a view tensor",
                      r"Full backward hook is firing when gradients are computed with respect to module outputs"]


class CollectiveCounter(CommDebugMode):
    """CommDebugMode that records every collective's size, dtype and mesh dimension.

    Args:
        mesh: the DeviceMesh whose dimensions name the groups (its mesh_dim_names, or
            the dimension's index); a group of no dimension shows as its ranks.
    """

    def __init__(self, mesh) -> None:
        super().__init__()
        self.calls: list[dict] = []
        self._dims = {}
        for d in range(mesh.ndim):
            name = mesh.mesh_dim_names[d] if mesh.mesh_dim_names else str(d)
            self._dims[tuple(dist.get_process_group_ranks(mesh.get_group(d)))] = name

    def __enter__(self) -> CollectiveCounter:
        self.calls = []
        self._quiet = warnings.catch_warnings()
        self._quiet.__enter__()
        for message in _COUNTING_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._quiet.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # DTensor ops pass through here twice: first as DTensor ops (CommDebugMode lets
        # DTensor turn them into plain ops), then as the plain ops, collectives included.
        if not any(t is DTensor for t in types):
            packet = func._overloadpacket
            if packet in self.comm_registry or packet in c10d_collective_ops:
                self._record(packet.__name__, args)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _record(self, name: str, args) -> None:
        op, where = _OPS.get(name, (name, 0))
        group = _group_of(args)
        size = group.size() if group is not None else None
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        array = args[0] if where == "input x group" else args[where]
        nbytes = _nbytes(array) * ((size or 1) if where == "input x group" else 1)
        self.calls.append({"op": op, "name": name, "dtype": _dtype(array), "nbytes": nbytes,
                           "group_size": size, "mesh_dim": self._dims.get(ranks, str(list(ranks)))})


def sent_per_rank(call: dict) -> float:
    """Bytes one rank sends for one counted collective, by lesson 02's formulas for a
    ring: the whole array times (n-1)/n for all-gather, reduce-scatter and all-to-all,
    2(n-1)/n for all-reduce, n the group's size."""
    return busbw_factor(call["op"], call["group_size"]) * call["nbytes"]
