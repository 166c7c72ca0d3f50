"""Pipeline schedules with torch.distributed.pipelining: GPipe, 1F1B, interleaved 1F1B.

Run it on 2 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 2 11_parallelism_in_several_dimensions/pipeline.py

or from the notebook: launch("11_parallelism_in_several_dimensions/pipeline.py", nproc=2).

The model is 8 layers (Linear 256 -> 256 and ReLU), the same on every rank. Split into
stages of consecutive layers, it runs as a pipeline of 2 ranks on 4 micro-batches of 32
rows, under three of torch's schedules:

- GPipe: every micro-batch's forward, then every backward;
- 1F1B: after a warm-up, each rank alternates one forward and one backward, so it keeps
  the activations of at most as many micro-batches as there are stages from its own on;
- interleaved 1F1B: 4 stages of 2 layers, 2 per rank (rank 0 holds stages 0 and 2),
  so a micro-batch visits each rank twice.

Reported per schedule and rank: the loss (the mean of the micro-batches' losses, on the
rank of the last stage) and every gradient of the rank's stages against the unsplit
model on the same 128 rows in one process (assert_close); and, in a second step, the
most micro-batches whose activations the rank held at once (a forward hook on each of
its stages counts one in, a backward hook out).
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from labutils.dist import init, report

WIDTH, LAYERS, MICRO = 256, 8, 32
SCHEDULES = {"GPipe": (ScheduleGPipe, 1), "1F1B": (Schedule1F1B, 1),
             "interleaved 1F1B": (ScheduleInterleaved1F1B, 2)}

rank, world_size, device = init()
if world_size != 2:
    raise SystemExit(f"pipeline.py is a pipeline of 2 ranks, not {world_size}")
torch.manual_seed(0)
layers = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS)]).to(device)


def batch(m: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m * MICRO, WIDTH, generator=g).to(device),
            torch.randn(m * MICRO, WIDTH, generator=g).to(device))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


class InFlight:
    """Micro-batches whose activations a stage holds: in at its forward, out when its
    backward reaches the stage's input."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.now = self.most = 0
        for module in modules:
            module.register_forward_hook(self._forward)
            module.register_full_backward_hook(self._backward)

    def _forward(self, module, args, output) -> None:
        self.now += 1
        self.most = max(self.most, self.now)

    def _backward(self, module, grad_in, grad_out) -> None:
        self.now -= 1


def build(name: str, m: int, model: nn.Sequential):
    """This rank's stages of the model and the schedule that runs them."""
    cls, per_rank = SCHEDULES[name]
    n_stages = world_size * per_rank
    size = LAYERS // n_stages
    stages, modules = [], []
    for j in range(per_rank):
        index = rank + j * world_size  # interleaved: rank 0 holds stages 0 and 2
        module = model[index * size:(index + 1) * size]
        modules.append(module)
        stages.append(PipelineStage(module, index, n_stages, device))
    schedule = cls(stages if per_rank > 1 else stages[0], n_microbatches=m, loss_fn=loss_fn)
    return schedule, stages, modules


def run_step(schedule, stages, x, y) -> list[torch.Tensor]:
    """One training step of the schedule; the micro-batches' losses on the rank that
    holds the last stage."""
    losses: list[torch.Tensor] = []
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    # only the first stage is given the input and only the last the target: torch 2.11
    # refuses any positional argument on another stage, even None
    inputs = (x,) if first else ()
    schedule.step(*inputs, **({"target": y, "losses": losses} if last else {}))
    return losses


# 1. the same numbers as one process
reference = copy.deepcopy(layers)
x4, y4 = batch(4)
ref_loss = loss_fn(reference(x4), y4)
ref_loss.backward()
for name in SCHEDULES:
    model = copy.deepcopy(layers)
    schedule, stages, modules = build(name, 4, model)
    losses = run_step(schedule, stages, x4, y4)
    equal = True
    for own_name, own in model.named_parameters():  # the names say the layer
        ref = dict(reference.named_parameters())[own_name]
        if own.grad is None:
            continue  # another rank's stage
        try:
            torch.testing.assert_close(own.grad, ref.grad)
        except AssertionError:
            equal = False
    if losses:
        try:
            torch.testing.assert_close(torch.stack(losses).mean(), ref_loss)
        except AssertionError:
            equal = False
    # a second step, counted: the first one also ran each stage once to learn its shapes
    flight = InFlight(modules)
    run_step(schedule, stages, x4, y4)
    report(part="check", schedule=name, equal=equal, most_in_flight=flight.most,
           holds_loss=bool(losses))
