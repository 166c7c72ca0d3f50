"""Activation checkpointing: memory given back, paid for with recomputation. Both measured.

    launch("12_where_memory_goes/checkpointing.py", nproc=1)

The model of model.py takes one forward and backward pass three ways:

- none: autograd keeps what each op saves for backward;
- full: every block runs under torch.utils.checkpoint (non-reentrant): the block keeps
  only its input, and its forward runs again inside backward;
- selective: every block runs under checkpoint with a policy
  (torch.utils.checkpoint.create_selective_checkpoint_contexts) that saves the outputs
  of the matrix multiplications and recomputes the rest (here, the GELU).

For each: the bytes the forward pass allocated and still held when it returned (the
activations kept for backward and the loss), from torch.profiler's memory events: a
selective checkpoint keeps what its policy saves in storage of its own, out of sight of
saved-tensor hooks, so anatomy.py's way of counting would miss it; and what backward
computed, counted by torch's own FlopCounterMode (matrix-multiplication FLOPs) and by a
dispatch mode that counts every aten operation run. The gradients of the three are
compared (they must be equal).
"""

import contextlib
import os
import sys
from collections import Counter
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).parent))  # model.py and anatomy.py sit next to this file
from model import batch, make_mlp

from labutils.dist import init, report

ROWS = 64


class CountOps(TorchDispatchMode):
    """Counts every aten operation run while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def quiet_stderr():
    """fd 2 to /dev/null for a moment: the profiler's C++ side prints a line on stderr
    each time it starts and stops."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def held_after_forward(run) -> tuple[int, object]:
    """run()'s result, and the bytes allocated while it ran and still held when it
    returned, from torch.profiler's memory events (each allocation and free, by op)."""
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with quiet_stderr():  # only the profiler's start and stop, not run()
        prof.__enter__()
    try:
        out = run()
    finally:
        with quiet_stderr():
            prof.__exit__(None, None, None)
    return sum(e.self_cpu_memory_usage for e in prof.events()), out


MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def forward(model, x, how: str):
    for block in model:
        if how == "none":
            x = block(x)
        elif how == "full":
            x = checkpoint(block, x, use_reentrant=False)
        else:
            x = checkpoint(block, x, use_reentrant=False,
                           context_fn=partial(create_selective_checkpoint_contexts, save_matmuls))
    return x


init()
x, y = batch(0, rows=ROWS)
grads = {}
for how in ("none", "full", "selective"):
    model = make_mlp()
    held, loss = held_after_forward(partial(lambda m, h: F.mse_loss(forward(m, x, h), y), model, how))
    flops, ops = FlopCounterMode(display=False), CountOps()
    with flops, ops:
        loss.backward()
    grads[how] = [p.grad for p in model.parameters()]
    del loss  # its graph is freed by backward already; nothing of this pass stays
    report(part="checkpointing", how=how, held=held,
           backward_flops=flops.get_total_flops(), backward_ops=sum(ops.ops.values()),
           recomputed={k: v for k, v in sorted(ops.ops.items()) if k in ("gelu", "addmm", "mm")})
for how in ("full", "selective"):
    for a, b in zip(grads["none"], grads[how]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
report(part="equal", gradients_equal=True)
