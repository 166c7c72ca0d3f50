"""Checks for lab 07: a run that resumes after a worker is killed.

Run them yourself from this folder (the grader runs the same ones):

    python checks.py
"""


import torch
import torch.nn as nn
import torch.nn.functional as F

from labutils.grading import check

STEPS = 10
KILL = {"rank": 1, "step": 5}
BATCH = 8  # train.py's --batch-size, per rank
CKPT = "checkpoint.pt"  # train.py's --ckpt, which the checks' runs leave as it is


def _plain(c):
    return c.run("train.py", 2, args=["--steps", STEPS], measure=["weights"])


def _killed(c, fault=KILL):
    return c.run("train.py", 2, args=["--steps", STEPS], measure=["weights", "steps", "files"],
                 fault=fault, max_restarts=1)


def _replayed_weights() -> list[float]:
    """The uninterrupted run as train.py trains it, replayed by one process: the same model
    and seed, SGD with lr 0.05 and momentum 0.9, each step on both ranks' batches at once
    (DDP averages two equal batches' gradients: the gradient of the mean over all items)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        xs = [torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(1000 * step + rank))
              for rank in range(2)]
        x = torch.cat(xs)
        loss = F.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [v for p in model.parameters() for v in p.detach().flatten().tolist()]


def _trains_as_given(c, plain) -> bool:
    """One part: the uninterrupted run's weights within 1e-5 of the replay's. The resume is
    measured against that run, so it must train as the lab's train.py does: a run without
    momentum has no optimizer state to lose, and would resume like itself."""
    expected = _replayed_weights()
    got = plain.probe("weights").get(0, {}).get("values", [])
    diff = max((abs(a - b) for a, b in zip(got, expected)), default=float("inf"))
    if len(got) == len(expected) and diff <= 1e-5:
        return True
    if not got:
        measured = "no final weights were measured (did rank 0 finish its training?)"
    elif len(got) != len(expected):
        measured = (f"its model has {len(got)} weights, the lab's {len(expected)}: the model "
                    "itself was changed")
    else:
        measured = f"its final weights differ by up to {diff:.2e} from one process replaying train.py's training"
    return c.expect(False, "uninterrupted run", measured=measured,
                    expected="the training train.py was given (SGD, lr 0.05, momentum 0.9), "
                             "within 1e-5")


def _whole_files(c, killed, label: str) -> bool:
    """A gate: in the killed run (probe "files", both attempts), no rank opens for writing
    a file that a rank loaded the checkpoint from (torch.save or open() onto it: written in
    place), and no two ranks write one file. Either way a kill while a rank writes leaves half a
    checkpoint, or two ranks' writes mixed; that the checks' kills, which land between two
    saves, were survived says nothing. Records a failed part and returns False then."""
    files = killed.probe("files")
    # The checkpoint: the files the resumed run loaded, and --ckpt's default, where the checks'
    # runs keep it (a torch.load of bytes read first, io.BytesIO, names no file).
    loaded = {call["file"] for seen in files.values() for call in seen["loads"]} | {CKPT}
    in_place = {rank: sorted(loaded & set(seen["writes"])) for rank, seen in files.items()}
    in_place = {rank: paths for rank, paths in sorted(in_place.items()) if paths}
    shared = killed.shared_writes()
    # A rename is atomic only within one file system: from outside the checkpoint's folder
    # (the system's temporary one), os.replace fails there and shutil.move copies.
    afar = killed.renames_from_outside(loaded)
    if not in_place and not shared and not afar:
        return True
    measured = "; ".join(
        [f"rank {rank} writes {', '.join(paths)} in place, the checkpoint the resumed run loads"
         for rank, paths in in_place.items()]
        + [f"ranks {', '.join(map(str, ranks))} all write {path}" for path, ranks in shared.items()]
        + [f"rank {rank} renames a file from outside the checkpoint's folder onto it: "
           "across two file systems (the system's temporary folder is often one of its own) "
           "os.replace fails and shutil.move copies, writing it in place" for rank in afar])
    return c.expect(False, label, measured=measured + " (a kill while it is written leaves a "
                    "broken checkpoint)",
                    expected="the checkpoint replaced whole, as train.py did: one rank writes a "
                             "temporary file beside it, then os.replace() puts it in the "
                             "checkpoint's place")


def _resumed_like_plain(c, plain, killed, fault: dict) -> None:
    """The killed run resumed from its checkpoint (the steps each attempt took), and
    ended with the weights of the uninterrupted run, bit for bit. A run that trains from
    step 0 again ends with them too (training is deterministic): it fails the first."""
    label = f"kill rank {fault['rank']} at step {fault['step']}, resume, finish {STEPS} steps"
    if not _trains_as_given(c, plain):
        return
    injected = killed.result.attempts[0].get("injected")
    if injected != fault:
        c.expect(False, label, measured=f"killed {injected}", expected=f"the kill {fault}")
        return
    if not c.each_step_once([killed], STEPS, label) or not _whole_files(c, killed, label):
        return
    want, got = plain.probe("weights"), killed.probe("weights")
    same = bool(want) and all(got.get(r, {}).get("sha256") == want[r]["sha256"] for r in want)
    diff = max((abs(a - b) for r in want if r in got
                for a, b in zip(got[r]["values"], want[r]["values"])), default=float("nan"))
    c.expect(same, label,
             measured="bitwise equal" if same else f"weights differ, by up to {diff:.3g}",
             expected="bitwise equal weights on every rank (sha256)")


@check(f"Rank {KILL['rank']} killed at step {KILL['step']}: the run restarts once and finishes",
       points=2)
def survives_the_kill(c):
    run = _killed(c)
    if c.completed(run, "2 ranks, SIGKILL, --max-restarts 1", restarts=1):
        injected = run.result.attempts[0].get("injected")
        c.expect(injected == KILL, "2 ranks, SIGKILL, --max-restarts 1",
                 measured=f"killed {injected}, finished after {run.restarts} restart",
                 expected=f"the kill {KILL} happened and the run finished after one restart")


@check("The resumed run carries on from its checkpoint and ends with exactly the weights of an "
       "uninterrupted run", points=5)
def bitwise_resume(c):
    plain, killed = _plain(c), _killed(c)
    if (c.completed(plain, "uninterrupted run") and
            c.completed(killed, "killed and resumed run", restarts=1)):
        _resumed_like_plain(c, plain, killed, KILL)


if __name__ == "__main__":
    from labutils.grading import run_checks

    run_checks()
