"""The tensor-parallel plans of lesson 11's scripts, for parallelize_module.

    block_plan, top_plan = plans("TP + SP")
    parallelize_module(model.block, tp_mesh, block_plan)
    parallelize_module(model, tp_mesh, top_plan)

way: "TP" (column then row splits, activations between them whole on every rank),
"TP + SP" (and sequence parallelism: those activations split along the sequence), or
"TP + SP + loss_parallel" (and the logits left split by vocabulary for loss_parallel).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

WAYS = ("TP", "TP + SP", "TP + SP + loss_parallel")


def plans(way: str) -> tuple[dict, dict]:
    """parallelize_module plans for the TinyTransformer's block and for the model around it."""
    if way not in WAYS:
        raise ValueError(f"way: expected one of {WAYS}, got {way!r}")
    sp, lp = "SP" in way, "loss_parallel" in way
    between = Shard(1) if sp else Replicate()  # the activations between the split layers
    block = {
        # the attention's input is made a whole-sequence Replicate once, for q, k and v
        # together: its backward sums their three gradients in one collective
        "attention": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=between),
        "ffn": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "ffn.w1": ColwiseParallel(), "ffn.w2": RowwiseParallel(output_layouts=between),
    }
    top = {"head": ColwiseParallel(input_layouts=between,
                                   output_layouts=Shard(-1) if lp else Replicate(),
                                   use_local_output=not lp)}
    if sp:
        block.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        top.update({"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                    "norm": SequenceParallel()})
    return block, top
