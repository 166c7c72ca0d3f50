"""Which torch.distributed calls a rank makes from Python, in order, with their sizes.

Used inside ranks (lessons 03 and 07)::

    from labutils.course.collective_log import CollectiveLog, count_all_reduces
    with CollectiveLog(["all_gather_single", "reduce_scatter_single"]) as log:
        ...                                    # log.calls: one CollectiveCall per call
    with count_all_reduces() as calls:         # every dist.all_reduce in the block
        ...
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from labutils.errors import InputError

__all__ = ["CollectiveCall", "CollectiveLog", "count_all_reduces"]


@dataclass
class CollectiveCall:
    """One torch.distributed call seen by a CollectiveLog.

    nbytes is the whole array: the gathered output of an all-gather, the input of a
    reduce-scatter, the tensor of an all-reduce, broadcast, send or recv (as nccl-tests
    and lesson 02 count). peer is the source of a broadcast or recv, the destination
    of a send (None otherwise). phase is the log's label when the call was made; t is
    time.perf_counter() of the calling rank, thread the calling thread's name.
    """

    op: str
    numel: int
    nbytes: int
    dtype: str
    phase: str = ""
    peer: int | None = None
    thread: str = ""
    t: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


# Which positional argument holds "the whole array", and its keyword name where that
# is not "tensor"; which keyword names the peer.
_DATA_ARG = {
    "all_gather_single": 0, "all_gather_into_tensor": 0, "reduce_scatter_single": 1,
    "reduce_scatter_tensor": 1, "all_reduce": 0, "broadcast": 0,
    "send": 0, "recv": 0, "isend": 0, "irecv": 0, "all_to_all_single": 1,
}
_DATA_KW = {"reduce_scatter_single": "input", "reduce_scatter_tensor": "input",
            "all_gather_single": "output_tensor", "all_gather_into_tensor": "output_tensor",
            "all_to_all_single": "input"}
_PEER_KW = {"broadcast": "src", "recv": "src", "irecv": "src", "send": "dst", "isend": "dst"}
# torch 2.13's names and the ones torch 2.11 and 2.12 have for the same functions (which
# FSDP2 calls there): a log of the new name wraps the old function on an older torch.
OLDER_NAME = {"all_gather_single": "all_gather_into_tensor",
              "reduce_scatter_single": "reduce_scatter_tensor"}


class CollectiveLog:
    """Records the torch.distributed calls named in `ops` made from Python in a block.

    It wraps the functions of the torch.distributed module, so it sees what
    communication hooks (fp16 compression, PowerSGD), FSDP2, ZeroRedundancyOptimizer
    and your own code call through it. DDP's built-in all-reduce (no hook) runs in C++
    and is not seen: count those with a BucketRecorder. Set .phase to label the calls
    that follow ("forward", "backward", "step")::

        with CollectiveLog(["all_gather_single", "reduce_scatter_single"]) as log:
            log.phase = "forward"; ...          # log.calls: one CollectiveCall per call

    Args:
        ops: names of torch.distributed functions, some of those in _DATA_ARG.
        on_call: called with each CollectiveCall just before the real call starts
            (e.g. print it, to see the order in which a rank issues them).
    """

    def __init__(self, ops: Sequence[str],
                 on_call: Callable[[CollectiveCall], object] | None = None) -> None:
        unknown = sorted(set(ops) - set(_DATA_ARG))
        if unknown:
            raise InputError("CollectiveLog ops", expected=f"names among {sorted(_DATA_ARG)}",
                             given=unknown, fix="spell them as torch.distributed names them")
        self.ops = list(ops)
        self.on_call = on_call
        self.calls: list[CollectiveCall] = []
        self.phase = ""
        self._real: dict[str, Callable] = {}

    def _wrap(self, op: str, real: Callable) -> Callable:
        def recorded(*args, **kwargs):
            data = kwargs.get(_DATA_KW.get(op, "tensor"))
            if data is None:
                index = _DATA_ARG[op]
                data = args[index] if len(args) > index else next(
                    v for v in kwargs.values() if hasattr(v, "element_size"))
            peer = kwargs.get(_PEER_KW[op]) if op in _PEER_KW else None
            if peer is None and op in _PEER_KW and len(args) > 1:
                peer = args[1]
            call = CollectiveCall(
                op=op, numel=data.numel(), nbytes=data.numel() * data.element_size(),
                dtype=str(data.dtype).replace("torch.", ""), phase=self.phase, peer=peer,
                thread=threading.current_thread().name, t=time.perf_counter())
            self.calls.append(call)
            if self.on_call is not None:
                self.on_call(call)
            return real(*args, **kwargs)

        return recorded

    def __enter__(self) -> CollectiveLog:
        import torch.distributed as dist

        for op in self.ops:
            name = op if hasattr(dist, op) else OLDER_NAME.get(op, op)
            self._real[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(op, self._real[name]))
        return self

    @property
    def installed(self) -> list[str]:
        """The torch.distributed names wrapped inside the block: each of `ops`, or its
        older name (OLDER_NAME) on a torch that lacks the new one."""
        return list(self._real)

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        for name, real in self._real.items():
            setattr(dist, name, real)
        self._real.clear()


@contextmanager
def count_all_reduces(on_call: Callable[[CollectiveCall], object] | None = None
                      ) -> Iterator[list[CollectiveCall]]:
    """Record every torch.distributed.all_reduce made from Python inside the block.

    A CollectiveLog of all_reduce alone; yields its list of calls.
    """
    with CollectiveLog(["all_reduce"], on_call) as log:
        yield log.calls
