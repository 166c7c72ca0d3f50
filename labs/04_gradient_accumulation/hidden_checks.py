"""Checks only the grader runs (never in a learner's copy of the lab): the same fix,
measured in a case the public checks do not show: 2 micro-batches of 4 per step at 3
ranks (3 x 2 x 4 = 24 items a step, as in the reference)."""

from checks import GLOBAL_BATCH, _reference

from labutils.grading import check

ACCUM, BATCH = 2, 4


@check(f"With {ACCUM} micro-batches of {BATCH} per step, at 3 ranks: one all-reduce per step and "
       "the weights of one process taking the whole batch", points=2, visibility="after_published")
def other_accumulation(c):
    nproc = 3
    label = f"{nproc} ranks, --accum {ACCUM} --batch-size {BATCH}"
    run = c.run("train.py", nproc, args=["--accum", ACCUM, "--batch-size", BATCH],
                measure=["weights", "allreduce"])
    if not c.completed(run, label):
        return
    counts = run.probe("allreduce").get(0, {}).get("per_step", [])
    c.expect(bool(counts) and all(n == 1 for n in counts), f"{label}: all-reduces per step",
             measured=f"all-reduces per optimizer step: {counts}", expected="1 per step")
    reference = _reference(c)  # the public checks' run
    if not c.completed(reference, f"1 rank, batch {GLOBAL_BATCH} (the reference)"):
        return
    expected = reference.probe("weights")[0]["values"]
    values = run.probe("weights")[0]["values"]
    diff = max(abs(a - b) for a, b in zip(values, expected))
    c.expect(diff <= 1e-5, f"{label}: weights = 1 rank x {GLOBAL_BATCH}",
             measured=f"largest weight difference {diff:.2e}", expected="at most 1e-5")
