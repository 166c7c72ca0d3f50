"""Checks only the grader runs (never in a learner's copy of the lab): the same fix,
measured in cases the public checks do not show: 2 micro-batches of 4 per step at 3
ranks, and 3 micro-batches of 2 at 4 ranks (24 items a step, as in the reference)."""

from checks import GLOBAL_BATCH, _reference

from labutils.grading import check


def _accumulation_parts(c, nproc: int, accum: int, batch: int) -> None:
    """Two parts: one all-reduce per optimizer step; the reference's weights."""
    label = f"{nproc} ranks, --accum {accum} --batch-size {batch}"
    run = c.run("train.py", nproc, args=["--accum", accum, "--batch-size", batch],
                measure=["weights", "allreduce"])
    if not c.completed(run, label):
        return
    counts = run.probe("allreduce").get(0, {}).get("per_step", [])
    c.expect(bool(counts) and all(n == 1 for n in counts), f"{label}: all-reduces per step",
             measured=f"DDP's gradient all-reduces per optimizer step: {counts}",
             expected="1 per step, by DDP")
    reference = _reference(c)  # the public checks' run
    if not c.completed(reference, f"1 rank, batch {GLOBAL_BATCH} (the reference)"):
        return
    expected = reference.probe("weights")[0]["values"]
    values = run.probe("weights")[0]["values"]
    diff = max(abs(a - b) for a, b in zip(values, expected))
    c.expect(diff <= 1e-5, f"{label}: weights = 1 rank x {GLOBAL_BATCH}",
             measured=f"largest weight difference {diff:.2e}", expected="at most 1e-5")


# Required: the public checks all run --accum 4, and a fix right at 4 micro-batches only
# (the last one hard-coded as micro 3) passes them all.
@check("With 2 micro-batches of 4 per step, at 3 ranks: one all-reduce per step and "
       "the weights of one process taking the whole batch", points=2, visibility="after_published",
       required=True)
def other_accumulation(c):
    _accumulation_parts(c, 3, accum=2, batch=4)


@check("At 4 ranks, 3 micro-batches of 2 per step: one all-reduce per step and the weights "
       "of one process taking the whole batch", points=2, visibility="after_published")
def at_four_ranks(c):
    _accumulation_parts(c, 4, accum=3, batch=2)
