"""Checks for lab 04: gradient accumulation with DDP.

Run them yourself from this folder (the grader runs the same ones):

    python checks.py
"""

from labutils.grading import check

ACCUM = 4
GLOBAL_BATCH = 24  # world size x accum x batch size, the same in every run below
RUNS = {2: 3, 3: 2}  # world size -> batch size per rank


def _run(c, nproc):
    return c.run("train.py", nproc, args=["--accum", ACCUM, "--batch-size", RUNS[nproc]],
                 measure=["weights", "allreduce", "forwards"])


def _reference(c):
    return c.run("train.py", 1, args=["--accum", 1, "--batch-size", GLOBAL_BATCH],
                 measure=["weights"])


@check("One gradient all-reduce per optimizer step, not one per micro-batch", points=4)
def one_allreduce_per_step(c):
    for nproc in RUNS:
        run = _run(c, nproc)
        if not c.completed(run, f"{nproc} ranks"):
            continue
        counts = run.probe("allreduce").get(0, {}).get("per_step", [])
        c.expect(bool(counts) and all(n == 1 for n in counts),
                 f"{nproc} ranks, {ACCUM} micro-batches per step",
                 measured=f"DDP's gradient all-reduces per optimizer step: {counts}",
                 expected=f"1 per step (DDP's gradients fit one bucket; 0: DDP never synchronised, "
                          f"an all-reduce by hand is not DDP's); {ACCUM} means every "
                          "micro-batch synchronised")


# Required: one forward pass over the step's micro-batches put together also gives one
# all-reduce and the reference's weights, but holds the whole step's activations at once,
# which is what accumulating micro-batches is for. So do accum forward passes whose losses
# are summed for one backward at the end: every micro-batch's graph is kept until then.
@check(f"Each optimizer step accumulates {ACCUM} micro-batches: {ACCUM} forward passes of one "
       "micro-batch each, each one's backward before the next forward", points=1, required=True)
def accumulates(c):
    for nproc, batch in RUNS.items():
        run = _run(c, nproc)
        if not c.completed(run, f"{nproc} ranks"):
            continue
        forwards = run.probe("forwards").get(0, {})
        steps, passes = forwards.get("per_step", []), forwards.get("passes", [])
        c.expect(bool(steps) and all(sizes == [batch] * ACCUM for sizes in steps),
                 f"{nproc} ranks, --accum {ACCUM} --batch-size {batch}",
                 measured="items in each forward pass through the model, per optimizer step "
                          f"(rank 0): {steps[:3]}{' ...' if len(steps) > 3 else ''}",
                 expected=f"{[batch] * ACCUM} every step")
        c.expect(bool(passes) and all(order == "FB" * ACCUM for order in passes),
                 f"{nproc} ranks: each micro-batch's backward before the next forward",
                 measured="forward (F) and backward (B) passes through the model, per optimizer "
                          f"step (rank 0): {passes[:3]}{' ...' if len(passes) > 3 else ''}",
                 expected=f"{'FB' * ACCUM!r} every step: a backward per micro-batch, which frees "
                          "its graph; forwards first and one backward over their summed losses "
                          "keep every micro-batch's activations until the end")


@check("The weights equal one process taking the whole batch at once", points=4)
def equals_big_batch(c):
    reference = _reference(c)
    if not c.completed(reference, f"1 rank, batch {GLOBAL_BATCH}, no accumulation (the reference)"):
        return
    expected = reference.probe("weights")[0]["values"]
    for nproc, batch in RUNS.items():
        run = _run(c, nproc)
        if not c.completed(run, f"{nproc} ranks"):
            continue
        values = run.probe("weights")[0]["values"]
        diff = max(abs(a - b) for a, b in zip(values, expected))
        c.expect(diff <= 1e-5, f"{nproc} ranks x {ACCUM} micro-batches of {batch} = 1 rank x {GLOBAL_BATCH}",
                 measured=f"largest weight difference {diff:.2e}", expected="at most 1e-5")


# Required: dividing the loss by accum is half the fix, and the starter's report already
# divides each micro-batch's loss by accum: divided twice, the loss the script logs is
# accum times too small while the training is right, and nothing else here would see it.
@check("Each step's reported loss is the mean loss of the step's batch", points=1, required=True)
def reports_the_mean_loss(c):
    reference = _reference(c)
    if not c.completed(reference, f"1 rank, batch {GLOBAL_BATCH}, no accumulation (the reference)"):
        return
    expected = {r["step"]: r["loss"] for r in reference.rows("step", "loss")}
    if not expected:
        c.expect(False, "the loss each step reports", measured="no report(step=..., loss=...)",
                 expected="each step reports its loss, as the starter does")
        return
    for nproc in RUNS:
        run = _run(c, nproc)
        if not c.completed(run, f"{nproc} ranks"):
            continue
        by_step: dict[int, list[float]] = {}
        for r in run.rows("step", "loss"):
            by_step.setdefault(r["step"], []).append(r["loss"])
        # the ranks' micro-batches are equal in size: the mean of their means is the step's
        means = {step: sum(losses) / len(losses) for step, losses in by_step.items()
                 if len(losses) == nproc}
        worst = max(expected, key=lambda s: abs(means.get(s, float("inf")) - expected[s]))
        got = means.get(worst)
        c.expect(sorted(means) == sorted(expected) and
                 abs(got - expected[worst]) <= 1e-4 * max(1.0, abs(expected[worst])),
                 f"{nproc} ranks: the loss each step reports",
                 measured=f"step {worst}, the furthest off: mean over the ranks of the reported loss {got:.6g}"
                          if got is not None else f"step {worst}: not reported by every rank",
                 expected=f"{expected[worst]:.6g} (to 1e-4), the loss of one process on the "
                          f"step's {GLOBAL_BATCH} items: each rank reports the mean over its "
                          "micro-batches, not their sum, and not that mean divided again by accum")


if __name__ == "__main__":
    from labutils.grading import run_checks

    run_checks()
