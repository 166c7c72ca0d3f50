"""Checks for lab 11: a run saved at one world size resumes at another.

Run them yourself from this folder (the grader runs the same ones):

    python checks.py

A run at 3 ranks stops after 4 steps; a run at 2 ranks, pointed at the same checkpoint
directory, trains on to 11 steps, saving as it goes (step-5, step-10, step-11); a run
at 4 ranks resumes from the checkpoint that resumed run wrote last and trains the last
step. Together they are compared with a run that trained all 12 steps at 2 ranks, never
stopped. Before the first resume, the checks leave in the directory what a save cut
short by a preemption leaves: a newer folder, step-5, holding the ranks' files (.distcp)
of step 4's checkpoint but no .metadata. The resumed run must pass it by and resume from
step-4, the newest finished checkpoint. The second resume starts from a checkpoint of a
run that resumed itself (a position in the data right only for a run that never resumed
shows there), step-11, with step-5 and step-10 beside it (as text, "step-10" and
"step-11" sort before "step-5").

Not bitwise: at 3 ranks each rank averages the gradient of 4 items and the all-reduce
adds 3 such averages; at 2 ranks, 6 items and 2 averages. The same sum in another
order rounds differently: an uninterrupted run at 3 ranks and one at 2 differ by about
7e-8 in a loss and 6e-8 in a weight after 12 steps. The checks allow TOLERANCE = 1e-5,
over 100 times that; losing SGD's momentum at the resume moves the losses by about 0.1
and the weights by about 0.03, and a repeated or skipped step more.
"""

import math
import os
import re
import shutil
from collections import Counter

from labutils.grading import check

STEPS = 12
TOLERANCE = 1e-5
# The public case, as (ranks, steps done when the run ends): saved at 3 ranks after 4
# steps, resumed at 2 up to 11 steps, resumed again at 4 for the last one.
CHAIN = ((3, 4), (2, 11), (4, STEPS))


def _reference(c):
    return c.run("train.py", 2, args=["--steps", STEPS], measure=["weights"])


def _ckpt_dir(c, chain) -> str:
    return str(c.scratch / ("checkpoint-" + "-to-".join(str(nproc) for nproc, _ in chain)))


def _label(chain) -> str:
    """'saved at 3 ranks after 4 steps, resumed at 2 and saved after 11, resumed again at 4'"""
    (nproc, stop), *resumes = chain
    words = [f"saved at {nproc} ranks after {stop} steps"]
    for k, (nproc, stop) in enumerate(resumes):
        again = " again" if k else ""
        words.append(f"resumed{again} at {nproc}" if k == len(resumes) - 1 else
                     f"resumed{again} at {nproc} and saved after {stop}")
    return ", ".join(words)


def _stop(c, chain):
    """The chain's first run: it trains chain[0]'s steps at its ranks and saves a checkpoint."""
    nproc, stop = chain[0]
    return c.run("train.py", nproc, args=["--steps", stop, "--ckpt-dir", _ckpt_dir(c, chain)],
                 measure=["steps"])


def _cut_short(folder: str, stop: int) -> str:
    """Leave what a save of step stop + 1 cut short by a preemption leaves: a folder
    step-{stop + 1} holding the ranks' files of the step-{stop} checkpoint (the .distcp
    files dcp.save writes first), and no .metadata (which it writes last), nor anything
    else. Once per directory (the resumed run finishes that folder if it saves there).
    Returns what the folder holds, in words ('' when there is no step-N folder to take
    the files from). A step number written with leading zeros (step-000004) counts as
    step-4, and the cut one is written so too. Checkpoints named otherwise than train.py
    names them (step-3 after 4 steps) get theirs after the newest: one past its number (a
    cut folder only where a step-{stop} folder is would leave them none, and a resume
    that takes the newest folder, finished or not, would never meet one)."""
    found = _step_folders(folder)
    if not found:
        return ""
    newest = stop if stop in found else max(found)
    named = found[newest]
    digits = re.search(r"\d+$", named).group()
    done = os.path.join(folder, named)
    cut = os.path.join(folder, named[:-len(digits)] + str(newest + 1).zfill(len(digits)))
    files = sorted(name for name in os.listdir(done) if name.endswith(".distcp"))
    if not os.path.exists(cut):
        os.makedirs(cut)
        for name in files:
            shutil.copy(os.path.join(done, name), os.path.join(cut, name))
    return (f"{os.path.basename(cut)}, a save cut short: {len(files)} rank file"
            f"{'' if len(files) == 1 else 's'} (.distcp), no .metadata")


def _step_folders(folder: str) -> dict[int, str]:
    """step -> the name of the folder in folder named by that step: step-N, or N written
    with leading zeros (step-000004)."""
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    found = {}
    for name in names:
        match = re.fullmatch(r"step-(\d+)", name)
        if match and os.path.isdir(os.path.join(folder, name)):
            found.setdefault(int(match.group(1)), name)
    return found


def _stop_and_resume(c, chain) -> list | None:
    """The chain's runs, in order: the first trains chain[0]'s steps and saves; each next
    one, at its own number of ranks, resumes from what the runs before it saved and
    trains on to its number of steps (the last to STEPS), the first of them past a newer
    save cut short (_cut_short). None when a run failed (the next would start from
    scratch, or from an older checkpoint, and say nothing about this resume)."""
    folder = _ckpt_dir(c, chain)
    first = _stop(c, chain)
    if not c.completed(first, f"{chain[0][0]} ranks, {chain[0][1]} steps, then a checkpoint"):
        return None
    cut = _cut_short(folder, chain[0][1])
    runs = [first]
    for k, (nproc, stop) in enumerate(chain[1:], start=1):
        last = k == len(chain) - 1
        run = c.run("train.py", nproc, args=["--steps", stop, "--ckpt-dir", folder],
                    measure=["weights", "steps"] if last else ["steps"])
        past = f" (the directory also holds {cut})" if cut and k == 1 else ""
        saved = "" if last else ", then a checkpoint"
        if not c.completed(run, f"{nproc} ranks, resumed, on to {stop} steps{saved}{past}"):
            return None
        runs.append(run)
    return runs


def _steps_list(steps) -> str:
    steps = sorted(steps)
    return ", ".join(map(str, steps[:-1])) + (" and " if len(steps) > 1 else "") + str(steps[-1])


def _global_batches(*runs) -> list[tuple[int, list[int]]]:
    """(step, the items every rank trained on in it, sorted), in the order the runs ran
    them."""
    batches = []
    for run in runs:
        here: dict[int, list[int]] = {}
        for row in run.rows("step", "items"):
            here.setdefault(row["step"], []).extend(row["items"])
        batches += [(step, sorted(items)) for step, items in sorted(here.items())]
    return batches


def _losses(*runs) -> dict[int, float]:
    """step -> the mean of the ranks' losses, from the run that ran it last."""
    losses: dict[int, float] = {}
    for run in runs:
        here: dict[int, list[float]] = {}
        for row in run.rows("step", "loss"):
            here.setdefault(row["step"], []).append(row["loss"])
        losses.update({step: sum(v) / len(v) for step, v in here.items()})
    return losses


def _spans(chain) -> str:
    """'steps 0 to 3, then 4 to 10, then 11': the steps each run of the chain should take."""
    spans, begin = [], 0
    for _, stop in chain:
        spans.append(f"{begin}" if stop - 1 == begin else f"{begin} to {stop - 1}")
        begin = stop
    return "steps " + ", then ".join(spans)


def _data_parts(c, runs, chain) -> None:
    """Every step runs once over the chain's runs, on the items of the reference's step."""
    label = _label(chain)
    reference = _reference(c)
    if not c.completed(reference, f"2 ranks, {STEPS} steps, uninterrupted"):
        return
    ran = Counter(row["step"] for run in runs for row in run.rows("step", "items")
                  if row["rank"] == 0)
    twice = [s for s in range(STEPS) if ran[s] > 1]
    never = [s for s in range(STEPS) if ran[s] == 0]
    problems = ([f"steps {_steps_list(twice)} ran twice"] if twice else []) + \
               ([f"steps {_steps_list(never)} never ran"] if never else [])
    resumed = [sorted(row["step"] for row in run.rows("step") if row["rank"] == 0)
               for run in runs[1:]]
    took = " and ".join(map(str, resumed))
    c.expect(not problems, f"{label}: steps 0 to {STEPS - 1}, each once",
             measured="; ".join(problems) + f" (the resumed run{'s' if len(resumed) > 1 else ''} "
             f"ran steps {took})" if problems else "each step ran once",
             expected=f"{_spans(chain)}, each once")
    want, got = dict(_global_batches(reference)), _global_batches(*runs)
    uses = Counter(item for _, items in got for item in items)
    wanted = Counter(item for items in want.values() for item in items)
    more, fewer = len(uses - wanted), len(wanted - uses)  # distinct items
    other = sorted({step for step, items in got if items != want.get(step)})
    if more or fewer:
        measured = (f"{more} items trained on more often than in the uninterrupted run, "
                    f"{fewer} less often")
    elif other:
        measured = f"other items than the uninterrupted run in steps {_steps_list(other)}"
    else:
        measured = "the same items as the uninterrupted run, step by step"
    c.expect(not (more or fewer or other), f"{label}: the items trained on",
             measured=measured,
             expected=f"the {STEPS} global batches of the uninterrupted run, each once, in order")


def _trajectory_parts(c, runs, chain) -> None:
    """The losses of every step and the final weights equal the reference's, within
    TOLERANCE; measured only when each resumed run took the steps after its checkpoint's
    (a run that starts over from step 0 ends on the reference's trajectory too)."""
    label = _label(chain)
    reference = _reference(c)
    if not (c.completed(reference, f"2 ranks, {STEPS} steps, uninterrupted")
            and c.each_step_once(runs, STEPS, f"{label}: the steps each run took")):
        return
    want, got = _losses(reference), _losses(*runs)
    gaps = {s: abs(got[s] - want[s]) for s in want if s in got}
    missing = sorted(set(want) - set(got))
    worst = max(gaps, key=gaps.get, default=None)
    off = [s for s, gap in gaps.items() if not gap <= TOLERANCE]
    c.expect(not missing and not off, f"{label}: the loss of every step",
             measured=(f"no loss for steps {_steps_list(missing)}" if missing else
                       f"losses off from step {min(off)} on, by up to {gaps[worst]:.2g} "
                       f"(step {worst})" if off else f"within {max(gaps.values()):.1g}"),
             expected="within 1e-5 of the uninterrupted run's, step by step")
    want_w, got_w = reference.probe("weights"), runs[-1].probe("weights")
    if not want_w or not got_w:
        c.expect(False, f"{label}: the final weights", measured="no weights were measured",
                 expected="a DDP model in train.py")
        return
    reference_values = want_w[min(want_w)]["values"]
    gap = max(abs(a - b) for record in got_w.values()
              for a, b in zip(record["values"], reference_values))
    c.expect(math.isfinite(gap) and gap <= TOLERANCE, f"{label}: the final weights",
             measured=f"off by up to {gap:.2g}" if not gap <= TOLERANCE else f"within {gap:.1g}",
             expected="within 1e-5 of the uninterrupted run's, on every rank")


def _natural(item: tuple[str, int]) -> list:
    """Sort key: step-5 before step-10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", item[0])]


def _files(folder: str) -> list[str]:
    """Every file under folder, relative to it."""
    return sorted(os.path.relpath(os.path.join(parent, name), folder)
                  for parent, _, names in os.walk(folder) for name in names)


@check(f"{_label(CHAIN).capitalize()}: every step runs once, on the items of an uninterrupted "
       "run", points=4)
def data_position(c):
    runs = _stop_and_resume(c, CHAIN)
    if runs is not None:
        _data_parts(c, runs, CHAIN)


# Required, as the next one: a checkpoint that saves the momentum buffers but loads them into
# an optimizer without any (dcp with plain state_dict()s) passes every other check.
@check(f"{_label(CHAIN).capitalize()}: the losses and the final weights are those of an "
       "uninterrupted run (within 1e-5)", points=4, required=True)
def trajectory(c):
    runs = _stop_and_resume(c, CHAIN)
    if runs is not None:
        _trajectory_parts(c, runs, CHAIN)


# Required: a run without momentum has no optimizer state to lose, and its own uninterrupted
# run (the reference) has none either; only this check sees the buffers missing.
@check("The checkpoints are torch.distributed.checkpoint directories, with the optimizer's state",
       points=2, required=True)
def written_with_dcp(c):
    if not c.completed(_stop(c, CHAIN), f"{CHAIN[0][0]} ranks, {CHAIN[0][1]} steps, then a "
                       "checkpoint"):
        return
    from torch.distributed.checkpoint import FileSystemReader

    folder = _ckpt_dir(c, CHAIN)
    files = _files(folder) if os.path.isdir(folder) else []
    saved = [os.path.dirname(os.path.join(folder, f)) for f in files
             if os.path.basename(f) == ".metadata"]
    if not c.expect(bool(saved), "the checkpoint directory",
                    measured=f"{len(saved)} checkpoints with a .metadata file, {len(files)} files"
                    if saved else f"no .metadata file; it holds {', '.join(files) or 'nothing'}",
                    expected="checkpoints as dcp.save writes them: the ranks' files and .metadata"):
        return
    # A folder of its own for each checkpoint: a save into the folder of the one before,
    # cut short, leaves its old .metadata over half-written rank files, and no checkpoint
    # to resume from (and the save cut short the other checks leave needs step-N names).
    names = sorted({os.path.relpath(path, folder) for path in saved}, key=lambda n: _natural((n, 0)))
    unnamed = [name for name in names if not re.fullmatch(r"step-\d+", name)]
    if not c.expect(not unnamed, "a folder of its own for each checkpoint",
                    measured=f"checkpoints (.metadata) in {', '.join(names)}",
                    expected="--ckpt-dir/step-N for the checkpoint after N steps, as train.py "
                             "names them: a save into the folder of the checkpoint before it, "
                             "cut short, leaves no checkpoint whole"):
        return
    counts = {}  # checkpoint -> momentum buffers in it
    for path in saved:
        entries = FileSystemReader(path).read_metadata().state_dict_metadata
        name = os.path.relpath(path, folder)
        counts["the directory" if name == "." else name] = sum("momentum_buffer" in key
                                                              for key in entries)
    c.expect(all(counts.values()), "the optimizer's state in every checkpoint",
             measured=", ".join(f"{n} momentum buffers in {name}"
                                for name, n in sorted(counts.items(), key=_natural)),
             expected="SGD's momentum buffer of every parameter (get_state_dict(model, optimizer))")


if __name__ == "__main__":
    from labutils.grading import run_checks

    run_checks()
