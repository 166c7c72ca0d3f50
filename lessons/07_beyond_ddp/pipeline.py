"""Pipeline parallelism by hand: stages over send/recv, micro-batches, the bubble.

Run it on 2 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 2 07_beyond_ddp/pipeline.py

or from the notebook: launch("07_beyond_ddp/pipeline.py", nproc=2).

Rank r is stage r: it holds layers [r*L/n, (r+1)*L/n) of an L-layer stack. One
training step follows the GPipe schedule: every micro-batch goes forward through
the stages (activations sent with isend, received with recv), then every micro-batch
goes backward in reverse order (gradients of the activations sent back the same way);
the gradients of the micro-batches add up in .grad. The loss of a micro-batch is
divided by the number of micro-batches, so the step's gradients equal the whole
batch's.

For each micro-batch count in --micro (the global batch stays --batch rows) one warm-up
step, then --repeats rounds of timed steps, one step of every count per round: each rank
records when it computed what (forward and backward of each micro-batch), between two
barriers. Reported per step:
the spans, the step's length, the busy time, and once per micro-batch count whether
this stage's gradients equal the unsplit stack's on the whole batch (assert_close).
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))  # models.py sits next to this file
from models import make_stack  # noqa: E402

from labutils.dist import init, report  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--micro", default="1,2,4,8", help="micro-batch counts, comma-separated")
parser.add_argument("--batch", type=int, default=512, help="rows of the global batch")
parser.add_argument("--width", type=int, default=1024)
parser.add_argument("--layers", type=int, default=8, help="Linear+ReLU layers in all (split evenly)")
parser.add_argument("--repeats", type=int, default=5, help="timed steps per micro-batch count")
args = parser.parse_args()

rank, world_size, device = init()
torch.set_num_threads(1)  # one core per stage: the machine may have no more
first, last = rank == 0, rank == world_size - 1

torch.manual_seed(0)  # the same full stack and data on every rank
full = make_stack(args.width, args.layers).to(device)
per_stage = 2 * args.layers // world_size  # modules per stage (each layer is Linear + ReLU)
stage = full[rank * per_stage:(rank + 1) * per_stage]
x = torch.randn(args.batch, args.width, device=device)
target = torch.randn(args.batch, args.width, device=device)

# The reference: the unsplit stack on the whole batch.
F.mse_loss(full(x), target).backward()
reference = [p.grad.clone() for p in stage.parameters()]


def gpipe_step(micro: int) -> tuple[list[dict], float]:
    """One GPipe training step; returns this rank's compute spans and the step length (s)."""
    stage.zero_grad(set_to_none=True)
    xs, targets = x.chunk(micro), target.chunk(micro)
    inputs, outputs, sends, spans = [], [], [], []
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(micro):  # all forwards
        if first:
            inp = xs[i]
        else:
            inp = torch.empty(xs[i].shape, device=device)
            dist.recv(inp, src=rank - 1)
            inp.requires_grad_()
        start = time.perf_counter()
        out = stage(inp)
        if last:
            out = F.mse_loss(out, targets[i]) / micro
        spans.append({"kind": "F", "micro": i, "start": start - t0, "end": time.perf_counter() - t0})
        if not last:
            sends.append(dist.isend(out.detach(), dst=rank + 1))
        inputs.append(inp)
        outputs.append(out)
    for i in reversed(range(micro)):  # all backwards, last micro-batch first
        grad = None
        if not last:
            grad = torch.empty(outputs[i].shape, device=device)
            dist.recv(grad, src=rank + 1)
        start = time.perf_counter()
        outputs[i].backward(grad)
        spans.append({"kind": "B", "micro": i, "start": start - t0, "end": time.perf_counter() - t0})
        if not first:
            sends.append(dist.isend(inputs[i].grad, dst=rank - 1))
    for work in sends:
        work.wait()
    dist.barrier()
    return spans, time.perf_counter() - t0


micros = [int(m) for m in args.micro.split(",")]
for micro in micros:
    gpipe_step(micro)  # warm-up (and the gradients to check)
    try:
        for got, want in zip((p.grad for p in stage.parameters()), reference):
            torch.testing.assert_close(got, want)
        verdict = "equal (assert_close)"
    except AssertionError:
        verdict = "DIFFERENT"
    report(part="check", micro=micro, stages=world_size, verdict=verdict,
           max_abs_diff=max((p.grad - r).abs().max().item() for p, r in zip(stage.parameters(), reference)))
# Timed rounds, one step of every micro-batch count per round: a busy moment of the
# machine then slows a step of each count, not several steps of one.
for repeat in range(args.repeats):
    for micro in micros:
        spans, step_s = gpipe_step(micro)
        busy = sum(s["end"] - s["start"] for s in spans)
        report(part="step", micro=micro, stages=world_size, repeat=repeat, step_s=step_s, busy_s=busy,
               spans=spans)
dist.destroy_process_group()
