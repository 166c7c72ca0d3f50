"""Checks for lab 10: checkpoints that survive a rank killed while it writes them.

Run them yourself from this folder (the grader runs the same ones):

    python checks.py

The runs go through the grader's probe (measure=["files"]), which records what each
rank does with files: what it opens for writing, what it renames, and the arguments
of every torch.load().
"""


from labutils.grading import check

STEPS = 10
CKPT = "checkpoint.pt"
BETWEEN = {"rank": 1, "step": 5}                        # after step 5, its checkpoint done
WHILE_SAVING = {"rank": 0, "step": 5, "phase": "saving"}  # halfway through step 5's checkpoint,
# its writer's (rank 0 here; _kill_while_saving kills whichever rank writes)


def _plain(c, nproc: int = 2):
    return c.run("train.py", nproc, args=["--steps", STEPS], measure=["weights", "files"])


def _killed(c, fault: dict, nproc: int = 2):
    return c.run("train.py", nproc, args=["--steps", STEPS], measure=["weights", "files", "steps"],
                 fault=fault, max_restarts=1)


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _in_place(run) -> list[int]:
    """Ranks that write the checkpoint file itself (open it for writing, torch.save to it)."""
    return sorted(rank for rank, seen in run.probe("files").items() if CKPT in seen["writes"])


def _removers(run) -> list[int]:
    """Ranks that remove the checkpoint (os.remove, os.unlink), as before a rename onto it."""
    return sorted(rank for rank, seen in run.probe("files").items()
                  if CKPT in seen.get("removes", []))


def _from_afar(run) -> list[int]:
    """Ranks that rename a file from outside the checkpoint's folder (the system's
    temporary folder) onto it: not atomic (Run.renames_from_outside)."""
    return run.renames_from_outside({CKPT})


def _writers(run) -> list[int]:
    """Ranks that put something at the checkpoint's path: in place, or by renaming onto it."""
    return sorted(rank for rank, seen in run.probe("files").items()
                  if CKPT in seen["writes"] or any(dst == CKPT for _, dst in seen["renames"]))


def _beside(run) -> dict[int, list[str]]:
    """rank -> the files it opens for writing, anywhere (the checkpoint, a temporary file
    beside it or in the system's temporary folder: train.py writes nothing else): ranks
    with none left out."""
    found = {rank: sorted(set(seen["writes"])) for rank, seen in run.probe("files").items()}
    return {rank: files for rank, files in sorted(found.items()) if files}


def _same_weights(c, plain, killed, label: str) -> None:
    want, got = plain.probe("weights"), killed.probe("weights")
    same = bool(want) and all(got.get(r, {}).get("sha256") == want[r]["sha256"] for r in want)
    diff = max((abs(a - b) for r in want if r in got
                for a, b in zip(got[r]["values"], want[r]["values"])), default=float("nan"))
    c.expect(same, label, measured="bitwise equal" if same else f"weights differ, by up to {diff:.3g}",
             expected="bitwise equal weights on every rank (sha256)")


def _kill_while_saving(c, nproc: int, fault: dict) -> None:
    """Kill the rank that writes the checkpoint (rank 0 unless the uninterrupted run shows
    one other writer) halfway through writing it; the resumed run must end as if it had
    never been killed."""
    plain = _plain(c, nproc)
    if not c.completed(plain, f"{nproc} ranks, uninterrupted run"):
        return
    writers = _writers(plain)
    fault = {**fault, "rank": writers[0]} if len(writers) == 1 else fault
    label = (f"{nproc} ranks, rank {fault['rank']} (the writer) killed halfway through the "
             f"step-{fault['step']} checkpoint, --max-restarts 1")
    killed = _killed(c, fault, nproc)
    in_place, shared, removers = _in_place(plain), plain.shared_writes(), _removers(plain)
    afar = _from_afar(plain)
    if in_place or shared or removers or afar:
        # A write in place leaves half a checkpoint when the writer is killed; two ranks
        # writing one file truncate each other's writes; removing the checkpoint before
        # renaming the new one onto its name leaves none in between. Whatever the
        # restarted run does with the file, a pass would be luck (the kill points fall
        # while the chunks are written).
        this_time = "the restarted run went through" if killed.ok else killed.problem
        measured = (f"{_ranks(in_place)} write{'s' if len(in_place) == 1 else ''} {CKPT} in "
                    "place, so a kill while writing leaves part of it" if in_place else
                    "; ".join(f"{_ranks(r)} write {path}" for path, r in shared.items())
                    + ", one file at the same time" if shared else
                    f"{_ranks(removers)} remove{'s' if len(removers) == 1 else ''} {CKPT} "
                    "before putting the new one in its place, so a kill in between leaves "
                    "no checkpoint (os.replace replaces it in one step)" if removers else
                    f"{_ranks(afar)} rename{'s' if len(afar) == 1 else ''} a file from outside "
                    f"{CKPT}'s folder onto it: a rename is atomic only within one file "
                    "system (the system's temporary folder is often one of its own; across two, "
                    f"os.replace fails and shutil.move copies, writing {CKPT} in place)")
        c.expect(False, label, measured=f"{measured} (this time: {this_time})",
                 expected=f"{CKPT} only ever replaced by a complete file written by one rank "
                          "beside it, and the resumed run ending with the weights of an uninterrupted run")
        return
    if killed.ok and killed.restarts == 0:
        c.expect(False, label,
                 measured=f"the kill never happened: rank {fault['rank']} never called "
                          f"report(step={fault['step']}, phase=\"saving\", ...)",
                 expected="write_checkpoint() writing the checkpoint in chunks and calling "
                          "report(step=step, phase=\"saving\", ...) after each, as the starter's "
                          "does: that report is where the checks kill the writing rank (a plain "
                          "torch.save(state, path) is never killed)")
        return
    if c.completed(killed, label, restarts=1) and c.each_step_once([killed], STEPS, label):
        _same_weights(c, plain, killed, label)


@check("A rank killed between two checkpoints: the run resumes and ends with exactly the "
       "weights of an uninterrupted run", points=2)
def kill_between_checkpoints(c):
    plain, killed = _plain(c), _killed(c, BETWEEN)
    label = f"2 ranks, rank {BETWEEN['rank']} killed after step {BETWEEN['step']}, --max-restarts 1"
    if (c.completed(plain, "2 ranks, uninterrupted run") and c.completed(killed, label, restarts=1)
            and c.each_step_once([killed], STEPS, label)):
        _same_weights(c, plain, killed, label)


# Required: every rank writing its own temporary file survives every kill below, whether
# each renames it onto the checkpoint or one rank does, so these 3 points alone would
# leave it above the pass mark; but it writes the same bytes once per rank (and the
# renames race onto one name). So the writing ranks are those that put the checkpoint
# in place and those that open any file for writing: in its folder, or elsewhere (a
# temporary file in /tmp that only rank 0 renames onto it).
@check(f"One rank writes {CKPT} and the files on the way to it, at 2 and 3 ranks", points=3,
       required=True)
def one_writer(c):
    for nproc in (2, 3):
        run = _plain(c, nproc)
        if c.completed(run, f"{nproc} ranks"):
            _expect_one_writer(c, run, f"{nproc} ranks")


def _expect_one_writer(c, run, label: str, others: str = "the others") -> None:
    writers, beside = _writers(run), _beside(run)
    ranks = sorted(set(writers) | set(beside))
    if len(ranks) == 1:
        measured = f"{_ranks(ranks)} wrote {CKPT}" if writers else \
            f"{_ranks(ranks)} wrote {', '.join(beside[ranks[0]])}, never {CKPT}"
    elif not ranks:
        measured = f"no rank wrote {CKPT}"
    else:
        measured = "; ".join(
            f"rank {rank} " + " and ".join(
                ([f"wrote {', '.join(beside[rank])}"] if rank in beside else [])
                + ([f"renamed a file onto {CKPT}"]
                   if rank in writers and CKPT not in beside.get(rank, []) else []))
            for rank in ranks)
    c.expect(len(ranks) == 1 and bool(writers), label, measured=measured,
             expected=f"one rank writes {CKPT} (through a temporary file beside it); {others} "
                      "hold the same state and write no file, there or elsewhere")


@check(f"The writing rank killed halfway through writing {CKPT}: the run resumes and ends "
       "with exactly the weights of an uninterrupted run", points=4)
def kill_while_saving(c):
    _kill_while_saving(c, 2, WHILE_SAVING)


def _onto_own_device(call: dict, own: str) -> bool:
    """A torch.load that puts what it loads on the rank's own device, or on the CPU (from
    where load_state_dict copies it to the model's device): map_location names one of
    them, or a function or dict that did (the tensors it returned are there)."""
    import torch

    wanted = {torch.device(own), torch.device("cpu")}
    location = call["map_location"]
    if location is None:
        return False
    try:
        named = torch.device(location)
    except (RuntimeError, TypeError, ValueError):  # a function or a dict: judge by the result
        named = None
    loaded = {torch.device(d) for d in call.get("devices", [])}
    return (named is None or named in wanted) and loaded <= wanted


# Required: on this CPU machine a missing map_location breaks nothing, so its 2 points
# alone would let a fix of the writes that leaves the load as it was pass the lab.
@check("Every rank that loads the checkpoint gives torch.load a map_location: its own device",
       points=2, required=True)
def map_location(c):
    run = _killed(c, BETWEEN)
    label = "2 ranks, the restarted run"
    if not c.completed(run, label, restarts=1):
        return
    files = run.probe("files")
    loads = {rank: seen["loads"] for rank, seen in files.items() if seen["loads"]}
    if not loads:
        c.expect(False, label, measured="no rank called torch.load",
                 expected="the restarted run loads the checkpoint")
        return
    missing = sorted(rank for rank, calls in loads.items()
                     if any(call["map_location"] is None for call in calls))
    elsewhere = sorted(rank for rank, calls in loads.items() if rank not in missing
                       and not all(_onto_own_device(call, files[rank]["device"]) for call in calls))
    given = sorted({call["map_location"] for calls in loads.values() for call in calls} - {None})
    measured = (f"{_ranks(missing)} called torch.load without map_location" if missing else
                f"{_ranks(elsewhere)} loaded onto another rank's device (map_location="
                f"{', '.join(given)}; their own: {', '.join(files[r]['device'] for r in elsewhere)})"
                if elsewhere else f"map_location={', '.join(given)} on {_ranks(loads)}")
    c.expect(not missing and not elsewhere, label, measured=measured,
             expected="torch.load(..., map_location=<this rank's device>) on every rank that "
                      "loads")


if __name__ == "__main__":
    from labutils.grading import run_checks

    run_checks()
