"""Tensor and sequence parallelism on a transformer block, with torch's own API.

Run it on 2 or 4 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 2 11_parallelism_in_several_dimensions/tp_block.py

or from the notebook: launch("11_parallelism_in_several_dimensions/tp_block.py", nproc=2).

Every rank builds the same TinyTransformer (model.py) from the same seed and takes the
same batch of token ids. One training step (forward, cross-entropy, backward) runs four
ways:

- reference: the whole model on every rank, no communication;
- TP: the attention's q, k, v and the feed-forward's w1 split by output columns
  (ColwiseParallel), wo and w2 by input rows (RowwiseParallel); the norms, the
  embedding and the activations between the two halves of the block stay whole on
  every rank, the head is split by columns and its logits gathered;
- TP + SP: the same, plus sequence parallelism: the activations between the halves are
  split along the sequence (Shard(1)), the norms run on the rank's part of the sequence
  (SequenceParallel), an all-gather brings the whole sequence before each split layer,
  and a reduce-scatter leaves each rank its part after it;
- TP + SP + loss_parallel: the same, and the loss computed on the head's logits as
  they are, split by vocabulary columns (torch's loss_parallel), without gathering them.

Each way is applied by parallelize_module to a copy of the reference's initial weights.
Reported per way: the loss and every parameter's gradient against the reference
(torch.testing.assert_close, and the largest difference); the collectives of the
forward and of the backward with their sizes (labutils.course.comm_count, which is
torch's CommDebugMode); the bytes this rank kept for backward (every tensor autograd
saved, parameters left out, counted once per storage); the parameter bytes it holds.
"""

import contextlib
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    loss_parallel,
    parallelize_module,
)

sys.path.insert(0, str(Path(__file__).parent))  # model.py and plans.py sit next to this file
from model import TinyTransformer, token_batch
from plans import WAYS, plans

from labutils.course.comm_count import CollectiveCounter
from labutils.course.memory import SavedBytes
from labutils.dist import init, report

VOCAB, DIM, HEADS, BATCH, SEQ = 512, 128, 4, 8, 64

rank, world_size, device = init()
if HEADS % world_size or SEQ % world_size:
    raise SystemExit(f"tp_block.py splits {HEADS} heads and {SEQ} positions: run it on 2 or 4 ranks")
mesh = init_device_mesh(device.type, (world_size,))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def step(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor, *, way: str = ""):
    """One forward (the loss included) and backward: (loss, forward calls, backward
    calls, bytes saved for backward)."""
    parallel_loss = loss_parallel() if "loss_parallel" in way else contextlib.nullcontext()
    with parallel_loss:  # cross_entropy on vocabulary-split logits, and its backward
        with CollectiveCounter(mesh) as forward, SavedBytes(model) as saved:
            logits = model(ids)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        with CollectiveCounter(mesh) as backward:
            loss.backward()
    return _full(loss).detach(), forward.calls, backward.calls, saved.total


torch.manual_seed(0)
initial = TinyTransformer(VOCAB, DIM, HEADS).to(device)
ids, targets = token_batch(BATCH, SEQ, VOCAB)
ids, targets = ids.to(device), targets.to(device)
reference = copy.deepcopy(initial)
ref_loss, _, _, ref_saved = step(reference, ids, targets)
ref_grads = {name: p.grad for name, p in reference.named_parameters()}
report(part="reference", loss=ref_loss.item(), saved_bytes=ref_saved,
       param_bytes=sum(p.numel() * p.element_size() for p in reference.parameters()),
       shape={"vocab": VOCAB, "dim": DIM, "heads": HEADS, "batch": BATCH, "seq": SEQ})

for way in WAYS:
    model = copy.deepcopy(initial)
    block_plan, top_plan = plans(way)
    parallelize_module(model.block, mesh, block_plan)
    parallelize_module(model, mesh, top_plan)
    loss, forward_calls, backward_calls, saved = step(model, ids, targets, way=way)
    diffs, equal = {}, True
    for name, p in model.named_parameters():
        grad = _full(p.grad)
        diffs[name] = (grad - ref_grads[name]).abs().max().item()
        try:
            torch.testing.assert_close(grad, ref_grads[name])
        except AssertionError:
            equal = False
    try:
        torch.testing.assert_close(loss, ref_loss)
    except AssertionError:
        equal = False
    report(part="way", way=way, loss=loss.item(), equal=equal, max_grad_diff=max(diffs.values()),
           forward=forward_calls, backward=backward_calls, saved_bytes=saved,
           param_bytes=sum(_local(p).numel() * p.element_size() for p in model.parameters()),
           split=sorted(name for name, p in model.named_parameters() if isinstance(p, DTensor)
                        and any(isinstance(pl, Shard) for pl in p.placements)))
