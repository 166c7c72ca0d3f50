"""Checks for lab 02: a collective that only rank 0 calls.

Run them yourself from this folder (the grader runs the same ones):

    python checks.py
"""

from labutils.grading import check

STEPS, LOG_EVERY = 12, 4
ARGS = ["--steps", STEPS, "--log-every", LOG_EVERY]


@check("Training finishes at 2 and 3 ranks (no hang)", points=4)
def finishes(c):
    for nproc in (2, 3):
        run = c.run("train.py", nproc, args=ARGS)
        if c.completed(run, f"{nproc} ranks"):
            c.expect(True, f"{nproc} ranks", measured=f"finished in {run.result.duration_s:.1f} s")


@check("Every log line shows the loss averaged over all ranks", points=3)
def global_loss(c):
    for nproc in (2, 3):
        run = c.run("train.py", nproc, args=ARGS)
        if c.completed(run, f"{nproc} ranks"):
            _logged_means(c, run, nproc, STEPS, LOG_EVERY, f"{nproc} ranks")


def _logged_means(c, run, nproc: int, steps: int, log_every: int, label: str) -> None:
    """One part: every loss rank 0 logged is the mean of the losses all ranks reported."""
    local = {(r["step"], r["rank"]): r["loss"] for r in run.rows("step", "loss")}
    logged = {r["log_step"]: r["global_loss"] for r in run.rows("log_step", "global_loss")
              if r["rank"] == 0}
    wrong = []
    for step in range(0, steps, log_every):
        expected = sum(local.get((step, r), float("nan")) for r in range(nproc)) / nproc
        got = logged.get(step)
        if got is None or abs(got - expected) > 1e-5 * max(1.0, abs(expected)):
            wrong.append(f"step {step}: logged {got}, mean of the ranks' losses {expected:.6f}")
    c.expect(not wrong, f"{label}: logged loss = mean of every rank's loss",
             measured="; ".join(wrong) or f"{len(logged)} log lines, each the mean over {nproc} ranks",
             expected=f"rank 0 logs, at steps {list(range(0, steps, log_every))}, "
                      "the mean of the losses all ranks reported")


if __name__ == "__main__":
    from labutils.grading import run_checks

    run_checks()
