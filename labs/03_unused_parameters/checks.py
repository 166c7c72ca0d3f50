"""Checks for lab 03: a parameter that takes no part in the loss.

Run them yourself from this folder (the grader runs the same ones):

    python checks.py
"""

from labutils.grading import check

BATCH = 4


def _run(c, nproc, batch=BATCH, args=()):
    return c.run("train.py", nproc, args=["--batch-size", batch, *args], measure=["weights"])


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
        done = {r["rank"]: r["step"] + 1 for r in run.rows("step")}
        c.expect(all(done.get(r) == steps for r in range(nproc)), f"{nproc} ranks: {steps} steps",
                 measured=f"steps done per rank: {done}", expected=f"{steps} steps on every rank")


@check("Every rank ends with the same weights", points=2)
def same_weights(c):
    for nproc in (2, 3):
        run = _run(c, nproc)
        if not c.completed(run, f"{nproc} ranks"):
            continue
        digests = {rank: w[2][:12] for rank, w in _weights(run).items()}
        c.expect(len(digests) == nproc and len(set(digests.values())) == 1,
                 f"{nproc} ranks: identical final weights",
                 measured=f"sha256 of the weights per rank: {digests}",
                 expected=f"one DDP model per rank, bitwise identical on all {nproc} ranks")


@check("The weights equal one process training on the whole batch", points=2)
def equals_big_batch(c):
    run, reference = _run(c, 2), _run(c, 1, batch=2 * BATCH)
    if not (c.completed(run, "2 ranks, batch 4 each") and
            c.completed(reference, "1 rank, batch 8 (the reference)")):
        return
    _same_weights(c, run, reference, "2 ranks x batch 4 = 1 rank x batch 8")


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
