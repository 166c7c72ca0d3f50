"""Checks only the grader runs (never in a learner's copy of the lab): the same fix,
measured in a case the public checks do not show: rank 0, the rank that writes the
checkpoint, killed at step 2."""

from checks import STEPS, _plain

from labutils.grading import check

ELSEWHERE = {"rank": 0, "step": 2}


@check(f"Rank {ELSEWHERE['rank']} killed at step {ELSEWHERE['step']}: the resumed run ends with "
       "exactly the weights of an uninterrupted run", points=2, visibility="after_published")
def kill_elsewhere(c):
    label = f"kill rank {ELSEWHERE['rank']} at step {ELSEWHERE['step']}, resume, finish {STEPS} steps"
    plain = _plain(c)  # the public checks' run
    killed = c.run("train.py", 2, args=["--steps", STEPS], measure=["weights"], fault=ELSEWHERE,
                   max_restarts=1)
    if not (c.completed(plain, "uninterrupted run") and
            c.completed(killed, "killed and resumed run", restarts=1)):
        return
    injected = killed.result.attempts[0].get("injected")
    want, got = plain.probe("weights"), killed.probe("weights")
    same = injected == ELSEWHERE and all(got.get(r, {}).get("sha256") == want[r]["sha256"]
                                         for r in want)
    diff = max((abs(a - b) for r in want if r in got
                for a, b in zip(got[r]["values"], want[r]["values"])), default=float("nan"))
    c.expect(same, label,
             measured=f"killed {injected}; " + ("bitwise equal" if same else
                                                 f"weights differ, by up to {diff:.3g}"),
             expected=f"the kill {ELSEWHERE} happened, then bitwise equal weights on every rank")
