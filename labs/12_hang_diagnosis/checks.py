"""Checks for lab 12: a collective that only some ranks call, and where the hang waits.

Run them yourself from this folder (the grader runs the same ones):

    python checks.py

Each rank reads only its own shard of the readings (readings.py refuses another
rank's), so a rank learns of a corrupt reading elsewhere only through a collective.
"""

import json
import math
import re

from cases import case
from labutils.grading import check

GLOBAL_BATCH = 12          # readings per step, at every world size
RUNS = {2: 6, 3: 4}        # world size -> batch size per rank, in the public checks
STEPS = 96 // GLOBAL_BATCH
HANG_TIMEOUT = 5           # every rank prints or reports each step: 5 s of silence is a hang
# train.py as the lab gives it, hang included (the one-rank reference runs it too).
ORIGINAL = "original/train.py"
ANSWER = "runs/diagnosis.json"  # written by the notebook's diagnosis-save cell


def _run(c, nproc, *more):
    return c.run("train.py", nproc, args=["--batch-size", GLOBAL_BATCH // nproc, *more],
                 measure=["weights", "forwards"],
                 hang_timeout=HANG_TIMEOUT)


def _finished(c, nproc, *more):
    """The run at nproc ranks if it finished, else None with a failed part recorded.

    A script that did not finish at 2 ranks with the lab's data is not launched again
    (every hang costs HANG_TIMEOUT seconds)."""
    label = " ".join([f"{nproc} ranks", *map(str, more)])
    first = min(RUNS)
    if (nproc, more) != (first, ()) and not _run(c, first).ok:
        c.expect(False, label, measured=f"not tried, since it did not finish at {first} ranks",
                 expected="the run finishes")
        return None
    run = _run(c, nproc, *more)
    return run if c.completed(run, label) else None


def _reference(c):
    """The lab's train.py on one rank, the whole batch at once: right as it is, since in a
    world of one no rank waits for another."""
    return c.run(c.lab_file(ORIGINAL), 1, args=["--batch-size", GLOBAL_BATCH], measure=["weights"],
                 hang_timeout=HANG_TIMEOUT)


def _skipped(run) -> dict[int, list[int]]:
    """rank -> the steps it reported as skipped."""
    skipped = {}
    for row in run.rows("step", "skipped"):
        skipped.setdefault(row["rank"], [])
        if row["skipped"]:
            skipped[row["rank"]].append(row["step"])
    return skipped


def _weights(run) -> dict[int, tuple[list[float], str]]:
    """rank -> (values, sha256) of the DDP model at the end; NaN stays NaN."""
    return {rank: ([float(v) for v in r["values"]], r["sha256"])
            for rank, r in run.probe("weights").items()}


def _largest_difference(values, reference) -> float:
    gaps = [abs(a - b) for a, b in zip(values, reference)]
    if len(values) != len(reference) or not all(math.isfinite(g) for g in gaps):
        return math.nan
    return max(gaps, default=0.0)


def _own_readings(c, run, nproc: int) -> None:
    """One part: every forward pass through the DDP model takes the rank's own batch,
    GLOBAL_BATCH // nproc readings (probe "forwards", every pass of the run, skipped steps'
    too). A rank that gathers every rank's readings and trains on the whole batch ends
    with the weights of one process too, doing every rank's work."""
    size = GLOBAL_BATCH // nproc
    sizes = {rank: [n for per_step in r["per_step"] for n in per_step] + list(r["after_last_step"])
             for rank, r in run.probe("forwards").items()}
    other = {rank: sorted(set(s) - {size}) for rank, s in sorted(sizes.items()) if set(s) - {size}}
    c.expect(sorted(sizes) == list(range(nproc)) and all(sizes.values()) and not other,
             f"{nproc} ranks x batch {size}: the readings of each forward pass",
             measured="; ".join(f"rank {rank}: forward passes of {n} readings"
                                for rank, n in list(other.items())[:2]) if other else
             f"forward passes on ranks {sorted(r for r, s in sizes.items() if s)}",
             expected=f"every forward pass through the DDP model on every rank takes the rank's "
                      f"own {size} readings (--batch-size {size}); {GLOBAL_BATCH} are every "
                      "rank's readings together, which DDP's averaged gradients stand for")


def _same_steps_skipped(c, run, nproc: int, expected: list[int]) -> None:
    skipped = _skipped(run)
    wrong = {rank: steps for rank, steps in skipped.items() if steps != expected}
    c.expect(len(skipped) == nproc and not wrong, f"{nproc} ranks: steps skipped on every rank",
             measured=", ".join(f"rank {r}: {s}" for r, s in sorted(skipped.items())) or "no reports",
             expected=f"{expected} on each of the {nproc} ranks, the steps whose readings hold a "
                      "corrupt one")


def _number(value) -> int | None:
    """57, 57.0, "57", "train.py:57" and 'File "train.py", line 57 in <module>' (a frame as
    the stacks show it) all mean 57; anything else (None too) means no answer."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    found = re.fullmatch(r"(?:.*?(?::|\bline\b))?\s*(\d+)(?:\s+in\s+\S+)?", str(value).strip(),
                         re.DOTALL)
    return int(found[1]) if found else None


def _answer(c) -> dict | str:
    """The learner's diagnosis, {"rank": ..., "line": ...} as saved, or why there is none."""
    path = c.learner_file(ANSWER)
    if not path.is_file():
        return f"no {ANSWER}: run the notebook's diagnosis cells"
    try:
        saved = json.loads(path.read_text())
    except ValueError:
        return f"{ANSWER} is not valid JSON: run the notebook's diagnosis cells again"
    if not isinstance(saved, dict):
        return f"{ANSWER} holds {saved!r}, not the notebook's answer"
    return saved


@check("Training finishes at 2 and 3 ranks (no hang)", points=3)
def finishes(c):
    for nproc in RUNS:
        run = _finished(c, nproc)
        if run is None:
            continue
        done = {r["rank"] for r in run.rows("step", "skipped") if r["step"] == STEPS - 1}
        c.expect(len(done) == nproc, f"{nproc} ranks: {STEPS} steps",
                 measured=f"finished in {run.result.duration_s:.1f} s; ranks that reached the last "
                          f"step: {sorted(done)}",
                 expected=f"every rank reports each of the {STEPS} steps, skipped or not")


@check("Every rank skips exactly the steps whose readings hold a corrupt one", points=2)
def skips_the_corrupt_steps(c):
    reference = _reference(c)
    if not c.completed(reference, f"1 rank, batch {GLOBAL_BATCH} (the reference)"):
        return
    expected = _skipped(reference).get(0, [])
    for nproc in RUNS:
        run = _finished(c, nproc)
        if run is not None:
            _same_steps_skipped(c, run, nproc, expected)


# Required. The forward passes too: a rank that gathers every rank's readings of the step
# and trains on all of them ends with one process's weights exactly, with every rank doing
# the whole step's work.
@check("The weights are the same on every rank and equal one process on the whole batch, each "
       "rank training on its own readings", points=3, required=True)
def equals_one_process(c):
    reference = _reference(c)
    if not c.completed(reference, f"1 rank, batch {GLOBAL_BATCH} (the reference)"):
        return
    expected = _weights(reference)[0][0]
    for nproc, batch in RUNS.items():
        run = _finished(c, nproc)
        if run is None:
            continue
        weights = _weights(run)
        digests = {rank: digest[:12] for rank, (_, digest) in sorted(weights.items())}
        gaps = [_largest_difference(values, expected) for values, _ in weights.values()]
        diff = max(gaps) if gaps and not any(math.isnan(g) for g in gaps) else math.nan
        c.expect(len(digests) == nproc and len(set(digests.values())) == 1 and diff <= 1e-5,
                 f"{nproc} ranks x batch {batch} = 1 rank x batch {GLOBAL_BATCH}",
                 measured=f"sha256 per rank {digests}; largest difference from one process "
                          + (f"{diff:.2e}" if not math.isnan(diff) else
                             "not a number: some weights are NaN (a corrupt step was trained on?)"),
                 expected="bitwise identical weights on every rank, at most 1e-5 from one process")
        _own_readings(c, run, nproc)


@check("The diagnosis names the rank that called a collective no other rank called, its line "
       "and that collective, in the hang of your case", points=3)
def diagnosis(c):
    wanted = {"rank": "the rank that waits in a collective which no other rank called",
              "line": "the innermost line of the script in that rank's stack: where it called "
                      "into torch",
              "collective": "the torch.distributed function that rank waits in, as the "
                            "hang report names it (e.g. all_reduce)"}
    saved = _answer(c)
    if isinstance(saved, str):
        for key in wanted:
            c.expect(False, f"hung_{key}", measured=saved, expected=wanted[key])
        return
    try:
        mine = case(saved.get("student_id"))
    except ValueError as exc:
        for key in wanted:
            c.expect(False, f"hung_{key}", measured=f"no case: {exc}", expected=wanted[key])
        return
    given = {"rank": _number(saved.get("rank")), "line": _number(saved.get("line")),
             "collective": _call_name(saved.get("collective"))}
    for key in [k for k, v in given.items() if v is None]:
        c.expect(False, f"hung_{key}", measured=f"hung_{key} = {saved.get(key)!r}",
                 expected=f"{'a name' if key == 'collective' else 'a number'}: {wanted[key]}")
    if all(v is None for v in given.values()):
        return  # nothing to compare: no need to launch the hanging script
    run = c.run(c.lab_file(mine["script"]), mine["nproc"], args=mine["args"],
                hang_timeout=HANG_TIMEOUT)
    hang = run.result.hang if run.result is not None else None
    if hang is None:
        raise RuntimeError(f"the lab's {mine['script']} did not hang at {mine['nproc']} ranks "
                           f"({run.problem or 'it finished'}); the diagnosis cannot be compared")
    # Every rank calls the gradient all-reduce in backward() at every step; the rank that
    # waits anywhere else called a collective of its own.
    odd = [rank for rank, call in sorted(hang.calls.items()) if call != "backward"]
    if len(odd) != 1:
        raise RuntimeError(f"the hang report of the lab's {mine['script']} shows no single odd "
                           f"rank: {hang.waiting}")
    truth = {"rank": odd[0], "line": int(hang.waiting[odd[0]].rsplit(":", 1)[1]),
             "collective": hang.calls[odd[0]]}
    case_text = (f"case {mine['number']} ({mine['script']}, {mine['nproc']} ranks; student id "
                 f"{saved.get('student_id')!r})")
    for key, value in given.items():
        if value is not None:
            c.expect(value == truth[key], f"hung_{key}, {case_text}",
                     measured=f"hung_{key} = {saved.get(key)!r}", expected=wanted[key])


def _call_name(value) -> str | None:
    """ "broadcast", "dist.broadcast", "broadcast()" and "torch.distributed.broadcast" all
    mean broadcast; anything else but a name (None too) means no answer."""
    if not isinstance(value, str) or not value.strip():
        return None
    name = value.strip().rstrip("()").rsplit(".", 1)[-1].strip()
    return name if name.isidentifier() else None


if __name__ == "__main__":
    from labutils.grading import run_checks

    run_checks()
