"""Checks only the grader runs (never in a learner's copy of the lab): the same fix,
measured in cases the public checks do not show: other --steps and --log-every at 3
ranks, and 4 ranks."""

from checks import ARGS, LOG_EVERY, STEPS, _logged_means

from labutils.grading import check

OTHER_STEPS, OTHER_LOG_EVERY = 10, 3


# Required: a fix right only at --log-every 4 (the other ranks join the all_reduce at a
# hard-coded interval) hangs here and passes every other check (0.846 of the lab's points).
@check(f"With --steps {OTHER_STEPS} --log-every {OTHER_LOG_EVERY}, at 3 ranks: the run finishes and every "
       "log line shows the loss averaged over all ranks", points=2, visibility="after_published",
       required=True)
def other_log_interval(c):
    nproc = 3
    label = f"{nproc} ranks, --steps {OTHER_STEPS} --log-every {OTHER_LOG_EVERY}"
    if not c.run("train.py", 2, args=ARGS).ok:  # the public checks' run: a hang costs seconds
        c.expect(False, label, measured="not tried, since it did not finish at 2 ranks",
                 expected="the run finishes")
        return
    run = c.run("train.py", nproc, args=["--steps", OTHER_STEPS, "--log-every", OTHER_LOG_EVERY])
    if c.completed(run, label):
        _logged_means(c, run, nproc, OTHER_STEPS, OTHER_LOG_EVERY, label)


# Required: a fix tuned to the world sizes the notebook and the public checks show (the other
# ranks join the all_reduce when rank in (1, 2), or the sum divided by 2 or 3) hangs or logs
# a wrong mean here only, and passes every other check (0.846 of the lab's points).
@check("At 4 ranks: the run finishes and every log line shows the loss averaged over all 4 ranks",
       points=2, visibility="after_published", required=True)
def at_four_ranks(c):
    nproc = 4
    run = c.run("train.py", nproc, args=ARGS)  # not tried if it hung at 2 or 3 ranks
    if c.completed(run, f"{nproc} ranks"):
        _logged_means(c, run, nproc, STEPS, LOG_EVERY, f"{nproc} ranks")
