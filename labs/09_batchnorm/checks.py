"""Checks for lab 09: BatchNorm statistics across ranks whose data differ.

Run them yourself from this folder (the grader runs the same ones):

    python checks.py

The reference is one process training the same model with plain BatchNorm, each step
on every rank's batch of that step together (shards.reference_model). The statistics
are read from each rank's BatchNorm layer by the grader's probe (measure=["buffers"]),
and the items of each forward pass through the DDP model too (measure=["forwards"]): each
rank trains on its own shard, --batch-size items a step, not on every rank's items. The
operations each rank asks of its process group are logged too (measure=["traffic"], for a
hidden check: the other shards' statistics can only come through a collective).

Tolerance: a correct synchronisation computes the same statistics as the reference,
only with sums taken in another order, so they differ by float32 rounding (about 1e-7
after these few steps). Statistics that are not the global batch's (each rank's own,
rank 0's, an average of the ranks' statistics) or gradients that ignore the other
ranks' items are off by 5e-2 or more. 1e-4 separates the two by orders of magnitude.
"""

import torch
import torch.nn.functional as F
from shards import held_out, reference_model

from labutils.grading import check

TOLERANCE = 1e-4
CASE = {"steps": 6, "batch_size": 8, "lr": 0.1, "seed": 0}


def _run(c, nproc, case=CASE):
    return c.run("train.py", nproc, args=["--steps", case["steps"], "--batch-size",
                                          case["batch_size"], "--lr", case["lr"],
                                          "--seed", case["seed"]],
                 measure=["buffers", "forwards", "traffic"])


def _statistics(run) -> dict:
    """rank -> (running_mean, running_var) of the BatchNorm layer of the rank's DDP model,
    read from the layer itself by the grader's probe at the end (measure "buffers"), not
    what the script reports."""
    stats = {}
    for rank, record in run.probe("buffers").items():
        layers = record["layers"]
        layer = layers.get("1") or next(iter(layers.values()), None)  # make_model's model[1]
        if layer is not None:
            stats[rank] = (layer["running_mean"], layer["running_var"])
    return stats


def _reported(c, run, nproc: int) -> dict | None:
    stats = _statistics(run)
    if sorted(stats) != list(range(nproc)):
        c.expect(False, f"{nproc} ranks: the statistics of each rank's BatchNorm layer",
                 measured=f"a BatchNorm layer in a DDP model on ranks {sorted(stats)}",
                 expected="the model of shards.make_model, wrapped in DDP, on every rank")
        return None
    return stats


def _identical_part(c, run, nproc: int) -> None:
    """One part: every rank's running statistics equal rank 0's, bit for bit."""
    stats = _reported(c, run, nproc)
    if stats is None:
        return
    gap = max(abs(a - b) for rank in stats for which in (0, 1)
              for a, b in zip(stats[rank][which], stats[0][which]))
    c.expect(gap == 0, f"{nproc} ranks: running_mean and running_var the same on every rank",
             measured=f"identical on the {nproc} ranks" if gap == 0
             else f"they differ between ranks, by up to {gap:.2e}",
             expected="identical on every rank (each rank evaluates with them)")


def _reference_part(c, run, nproc: int, case: dict) -> None:
    """Two parts: every rank's running statistics equal the one-process reference's; the
    held-out loss each rank reports is the reference's in eval mode, where BatchNorm
    normalises with those running statistics."""
    stats = _reported(c, run, nproc)
    if stats is None:
        return
    reference = reference_model(world_size=nproc, steps=case["steps"],
                                batch_size=case["batch_size"], lr=case["lr"], seed=case["seed"])
    norm = reference[1]
    _held_out_part(c, run, nproc, reference)
    want = (norm.running_mean.tolist(), norm.running_var.tolist())
    if any(len(got[which]) != len(want[which]) for got in stats.values() for which in (0, 1)):
        c.expect(False, f"{nproc} ranks: the statistics", measured="another number of channels",
                 expected=f"{len(want[0])} channels, the BatchNorm layer of shards.make_model")
        return
    gaps = [max(abs(a - b) for a, b in zip(got[which], want[which]))
            for got in stats.values() for which in (0, 1)]
    mean_gap = max(gaps[0::2])
    var_gap = max(gaps[1::2])
    c.expect(max(gaps) <= TOLERANCE,
             f"{nproc} ranks x batch {case['batch_size']}, {case['steps']} steps: the statistics "
             f"of one process with BatchNorm on the whole batch of {nproc * case['batch_size']}",
             measured=f"largest difference: running_mean {mean_gap:.2e}, running_var {var_gap:.2e}",
             expected="at most 1e-4 on every rank (float rounding)")


def _held_out_part(c, run, nproc: int, reference) -> None:
    """One part: the held-out loss every rank reports equals the reference model's in eval
    mode (a rank that evaluates with the held-out batch's own statistics is off by about
    1e-2, a right one by float rounding)."""
    x, y = held_out(nproc)
    with torch.no_grad():
        want = F.mse_loss(reference.eval()(x), y).item()
    got = {r["rank"]: r["val_loss"] for r in run.rows("val_loss")}
    gap = max((abs(v - want) for v in got.values() if isinstance(v, (int, float))),
              default=float("nan"))
    c.expect(sorted(got) == list(range(nproc)) and gap <= TOLERANCE,
             f"{nproc} ranks: the held-out loss, in eval mode",
             measured=f"reported by ranks {sorted(got)}, largest difference {gap:.2e}",
             expected=f"{want:.4f} on every rank (within 1e-4): one process's model in eval mode, "
                      "which normalises with the running statistics")


@check("Every rank ends with the same BatchNorm statistics, at 2 and 3 ranks", points=3)
def same_on_every_rank(c):
    for nproc in (2, 3):
        run = _run(c, nproc)
        if c.completed(run, f"{nproc} ranks"):
            _identical_part(c, run, nproc)


# Required, as the hidden case: statistics that are identical on every rank but not the
# global batch's (a global count hard-coded for 2 ranks, or for 8 items a rank) earn the
# check above, and would pass the lab on it.
@check("The running statistics equal BatchNorm on the whole batch in one process, and the held-out "
       "loss that process's in eval mode, at 2 and 3 ranks",
       points=4, required=True)
def equals_whole_batch(c):
    for nproc in (2, 3):
        run = _run(c, nproc)
        if c.completed(run, f"{nproc} ranks"):
            _reference_part(c, run, nproc, CASE)


# Required: a rank that reads every shard and trains on the whole global batch itself
# matches the reference exactly, with W times the work and no data parallelism.
@check("Each rank trains on its own shard: every forward pass through DDP takes --batch-size "
       "items, at 2 and 3 ranks", points=1, required=True)
def own_shard(c):
    size, steps = CASE["batch_size"], CASE["steps"]
    for nproc in (2, 3):
        run = _run(c, nproc)
        if not c.completed(run, f"{nproc} ranks"):
            continue
        c.one_forward_per_step(run, nproc, size, steps, f"{nproc} ranks, --batch-size {size}",
                               source=" (shard_batch)")


if __name__ == "__main__":
    from labutils.grading import run_checks

    run_checks()
