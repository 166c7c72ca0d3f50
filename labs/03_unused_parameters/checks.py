"""Checks for lab 03: a parameter that takes no part in the loss.

Run them yourself from this folder (the grader runs the same ones):

    python checks.py
"""

import torch
import torch.nn as nn

from labutils.grading import check

BATCH = 4
AUX_HEAD = (["aux_head.weight", "aux_head.bias"], 32 + 1)  # names, values: the model's last
# The one-process references turn the auxiliary loss off by the flag, as train.py's docstring
# runs it, not by its default: a default made a tiny non-zero weight (1e-8) gives aux_head a
# gradient too small to move it, and still fails at step 1 under --aux-weight 0.
OFF = ["--aux-weight", 0]


def _run(c, nproc, batch=BATCH, args=()):
    return c.run("train.py", nproc, args=["--batch-size", batch, *args],
                 measure=["weights", "forwards"])


def _weights(run):
    """rank -> (parameter names, values, sha256) of the DDP model at the end."""
    return {rank: (r["names"], r["values"], r["sha256"]) for rank, r in run.probe("weights").items()}


@check("Training runs every step at 2 and 3 ranks", points=3)
def runs_every_step(c):
    for nproc in (2, 3):
        run = _run(c, nproc)
        if not c.completed(run, f"{nproc} ranks"):
            continue
        steps = 48 // (nproc * BATCH)
        done = dict(sorted({r["rank"]: r["step"] + 1 for r in run.rows("step")}.items()))
        c.expect(all(done.get(r) == steps for r in range(nproc)), f"{nproc} ranks: {steps} steps",
                 measured=f"steps done per rank: {done}", expected=f"{steps} steps on every rank")


@check("Every rank ends with the same weights", points=2)
def same_weights(c):
    for nproc in (2, 3):
        run = _run(c, nproc)
        if not c.completed(run, f"{nproc} ranks"):
            continue
        digests = {rank: w[2][:12] for rank, w in sorted(_weights(run).items())}
        c.expect(len(digests) == nproc and len(set(digests.values())) == 1,
                 f"{nproc} ranks: identical final weights",
                 measured=f"sha256 of the weights per rank: {digests}",
                 expected=f"one DDP model per rank, bitwise identical on all {nproc} ranks")


# Required: ranks that end identical can still have thrown data away (rank 0's weights
# broadcast after each step) or summed the gradients instead of averaging them; only the
# weights of one process training on every rank's batch at once tell them apart. And a
# rank that gathers every rank's batch and trains on all of it matches that process
# exactly, with no data parallelism: each forward pass must take the rank's own batch.
@check("The weights equal one process training on the whole batch, each rank training on "
       "its own --batch-size items", points=2, required=True)
def equals_big_batch(c):
    run, reference = _run(c, 2), _run(c, 1, batch=2 * BATCH, args=OFF)
    if not (c.completed(run, "2 ranks, batch 4 each") and
            c.completed(reference, "1 rank, batch 8, --aux-weight 0 (the reference)")):
        return
    _same_weights(c, run, reference, "2 ranks x batch 4 = 1 rank x batch 8")
    _own_batches(c, run, 2)


def _initial_aux_head() -> list[float]:
    """aux_head's values as train.py creates them: seed 0, then body, head and aux_head."""
    torch.manual_seed(0)
    nn.Linear(8, 32), nn.Linear(32, 2)
    return [v for p in nn.Linear(32, 1).parameters() for v in p.detach().flatten().tolist()]


# Required: the fix lets DDP train a model with a head that takes no part in the loss.
# Giving the head a part instead (the auxiliary loss switched on by default) changes what
# the script trains, and the one-rank reference above, the same script, changes with it.
@check("With --aux-weight 0 (the default) the auxiliary head does not train", points=2,
       required=True)
def the_auxiliary_head_rests(c):
    run = _run(c, 2)
    if not c.completed(run, "2 ranks"):
        return
    names, values, _ = _weights(run)[0]
    if names[-2:] != AUX_HEAD[0]:
        c.expect(not any("aux" in n for n in names), "2 ranks: the model's parameters",
                 measured=f"parameters {names}",
                 expected=f"{AUX_HEAD[0]} last, as train.py defines them (or no auxiliary head)")
        return
    moved = max(abs(a - b) for a, b in zip(values[-AUX_HEAD[1]:], _initial_aux_head()))
    c.expect(moved <= 1e-7, "2 ranks, --aux-weight 0: aux_head as initialised",
             measured=f"aux_head moved by up to {moved:.2e} from its initial values",
             expected="no change: with --aux-weight 0 nothing trains the auxiliary head")


def _own_batches(c, run, nproc: int) -> None:
    """One part: every rank's forward passes through its DDP model (or the model it
    wraps) take the rank's own BATCH items, one forward pass a step."""
    c.one_forward_per_step(run, nproc, BATCH, 48 // (nproc * BATCH),
                           f"{nproc} ranks: each forward pass takes the rank's own {BATCH} items")


def _same_weights(c, run, reference, label: str) -> None:
    """One part: rank 0's weights of run within 1e-5 of the reference's."""
    names, values, _ = _weights(run)[0]
    ref_names, ref_values, _ = _weights(reference)[0]
    if names != ref_names:
        c.expect(False, "same parameters", measured=f"{names} vs {ref_names}")
        return
    diff = max(abs(a - b) for a, b in zip(values, ref_values))
    c.expect(diff <= 1e-5, label, measured=f"largest weight difference {diff:.2e}",
             expected="at most 1e-5")


if __name__ == "__main__":
    from labutils.grading import run_checks

    run_checks()
