"""Wrong fixes of lab 10 that a learner in a hurry would submit; each must fail the lab.

Kept for instructors and the tests (`labutils wrongfixes labs/10_checkpoint_writes`);
never in a learner's copy.
"""

from labutils.grading.wrongfix import WrongFix

LOAD = '''    checkpoint = torch.load(args.ckpt, map_location=device)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    start = checkpoint["step"] + 1  # the checkpoint is written after its step is done
'''
OPEN_PARTIAL = '    partial = path + ".partial"\n    with open(partial, "wb") as f:\n'
REPLACE = "    os.replace(partial, path)\n"
# every rank writes its own temporary file, and rank 0 alone renames it onto the checkpoint
RANK0_RENAMES = [
    (REPLACE, "    if rank == 0:  # one rank puts it in place\n        os.replace(partial, path)\n"),
    ("    if rank == 0:  # the ranks hold identical state: one writer, no race on the file\n"
     "        write_checkpoint(",
     "    if True:  # every rank writes, rank 0 renames\n        write_checkpoint(")]
IN_PLACE = [('    partial = path + ".partial"\n', '    partial = path  # one writer: no race\n'),
            (REPLACE, "")]

WRONG_FIXES = [
    WrongFix(
        "one writer, but in place; a try/except starts over when the file is half written",
        why="the kill leaves half a checkpoint; training from step 0 again hides it, since "
            "training is deterministic: only the steps each attempt took and the writes show it",
        edits={"train.py": IN_PLACE + [(LOAD, "    try:\n" + LOAD.replace("\n    ", "\n        ")
                                        .replace("    checkpoint", "        checkpoint", 1)
                                        + "    except Exception:  # half written: start over\n"
                                          "        start = 0\n")]}),
    WrongFix(
        "every rank writes, through the same temporary file and a rename",
        why="the rename is atomic, but two ranks truncate and write one .partial file at once",
        edits={"train.py": [("    if rank == 0:  # the ranks hold identical state: one writer, "
                             "no race on the file\n        write_checkpoint(",
                             "    if True:  # every rank, atomically\n        write_checkpoint(")]}),
    WrongFix(
        "map_location='cuda:0': every rank loads onto rank 0's GPU",
        why="a map_location is given, but it is the GPU bug itself: the rank's own device is "
            "the one to load onto",
        edits={"train.py": [("torch.load(args.ckpt, map_location=device)",
                             'torch.load(args.ckpt, map_location="cuda:0")')]}),
    WrongFix(
        "saves atomically from one rank but never loads: the restart trains from step 0",
        why="the final weights equal an uninterrupted run's, since training is deterministic",
        edits={"train.py": [("if os.path.exists(args.ckpt):", "if False:  # resuming is for later")]}),
    WrongFix(
        "the writes fixed, the load left as it was: no map_location",
        why="one rank writes, atomically, so the kill no longer leaves half a checkpoint; but "
            "torch.load still puts every tensor back on the device it was saved from, rank 0's "
            "GPU, on every rank (on CPU nothing shows it but the map_location check)",
        edits={"train.py": [("torch.load(args.ckpt, map_location=device)", "torch.load(args.ckpt)")]}),
    WrongFix(
        "every rank writes its own temporary file and renames it onto checkpoint.pt",
        why="no two ranks share a file and each rename is atomic, so every kill is survived; "
            "but every rank writes the whole checkpoint, the same bytes once per rank, and the "
            "renames race onto one name: the files probe sees every rank put checkpoint.pt there",
        edits={"train.py": [
            ('    partial = path + ".partial"\n',
             '    partial = f"{path}.{rank}.partial"  # no two ranks share it\n'),
            ("    if rank == 0:  # the ranks hold identical state: one writer, no race on the file\n"
             "        write_checkpoint(",
             "    if True:  # every rank, each through its own temporary file\n"
             "        write_checkpoint(")]}),
    WrongFix(
        "removes the old checkpoint, then renames the temporary file onto its name",
        why="between os.remove and os.rename there is no checkpoint at all: a kill there "
            "restarts training from step 0 (os.replace replaces the file in one step)",
        edits={"train.py": [(REPLACE,
                             "    if os.path.exists(path):\n"
                             "        os.remove(path)  # rename refuses an existing file on Windows\n"
                             "    os.rename(partial, path)\n")]}),
    WrongFix(
        "every rank writes its own temporary file, only rank 0 renames it onto checkpoint.pt",
        why="no two ranks share a file and rank 0's rename is atomic, so every kill is survived "
            "and only rank 0 puts checkpoint.pt there; but every rank still writes the whole "
            "checkpoint, the same bytes once per rank: the files probe sees every rank open a "
            "file for writing beside checkpoint.pt",
        edits={"train.py": [
            ('    partial = path + ".partial"\n',
             '    partial = f"{path}.{rank}.partial"  # no two ranks share it\n'),
            (REPLACE,
             "    if rank == 0:  # one rank puts it in place\n        os.replace(partial, path)\n"),
            ("    if rank == 0:  # the ranks hold identical state: one writer, no race on the file\n"
             "        write_checkpoint(",
             "    if True:  # every rank writes, rank 0 renames\n"
             "        write_checkpoint(")]}),
    WrongFix(
        "every rank writes its own tempfile.mkstemp() file, only rank 0 renames it onto checkpoint.pt",
        why="the catalogue's 'only rank 0 renames' with the temporary files made by "
            "tempfile.mkstemp() in the system's temporary folder: os.fdopen's writes went past "
            "the files probe (it saw open() and torch.save(), not os.open()), and the files were "
            "not beside the checkpoint; every rank still writes the whole checkpoint (found by an "
            "audit, 2026-11-30: it scored 1.000)",
        edits={"train.py": [
            (OPEN_PARTIAL,
             '    import tempfile\n'
             '    fd, partial = tempfile.mkstemp(suffix=".partial")  # a file of this rank\'s own\n'
             '    with os.fdopen(fd, "wb") as f:\n'),
            *RANK0_RENAMES]}),
    WrongFix(
        "every rank writes its own temporary file in the system's temporary folder, only rank 0 "
        "renames it onto checkpoint.pt",
        why="as the catalogue's 'only rank 0 renames', with each rank's file in "
            "tempfile.gettempdir() instead of beside the checkpoint, where the check looked "
            "(found by an audit, 2026-11-30: it scored 1.000)",
        edits={"train.py": [
            (OPEN_PARTIAL,
             '    import tempfile\n'
             '    partial = os.path.join(tempfile.gettempdir(), f"checkpoint-{rank}.partial")\n'
             '    with open(partial, "wb") as f:\n'),
            *RANK0_RENAMES]}),
    WrongFix(
        "rank 0 writes a tempfile.mkstemp() file in the system's folder, then shutil.move",
        why="a rename is atomic only within one file system: with /tmp local and the "
            "checkpoint on shared storage, shutil.move copies, writing checkpoint.pt in place "
            "(found by an audit, 2026-11-30: it scored 1.000)",
        edits={"train.py": [
            (OPEN_PARTIAL,
             '    import shutil, tempfile\n'
             '    fd, partial = tempfile.mkstemp(suffix=".partial")\n'
             '    with os.fdopen(fd, "wb") as f:\n'),
            (REPLACE, "    shutil.move(partial, path)\n")]}),
    WrongFix(
        "one writer picked by LOCAL_RANK == 0",
        why="one writer on one machine, where every other check runs, but one per node on a "
            "cluster, whose nodes share the checkpoint's storage: every node's first rank writes "
            "the same checkpoint.pt.partial at once and renames it, the lab's bug again; two "
            "torchrun agents of one rank each on one machine show it (found by an audit, "
            "2026-11-30: it scored 1.000)",
        edits={"train.py": [(
            "    if rank == 0:  # the ranks hold identical state: one writer, no race on the file\n",
            "    if int(os.environ.get(\"LOCAL_RANK\", \"0\")) == 0:  # one writer per machine\n")]}),
]

# Not here, as no CPU run can catch them: map_location="cuda:0" (or f"cuda:{rank}", the
# global rank) when torch.cuda.is_available(), else "cpu". On a CPU machine both load onto
# the CPU, which is right there; an audit (2026-11-30) found both scoring 1.000.
