"""Wrong fixes of lab 07 that a learner in a hurry would submit; each must fail the lab.

Kept for instructors and the tests (`labutils wrongfixes labs/07_resume_after_kill`);
never in a learner's copy.
"""

from labutils.grading.wrongfix import WrongFix

LOAD = '''if os.path.exists(args.ckpt):
    checkpoint = torch.load(args.ckpt, map_location=device)'''

WRONG_FIXES = [
    WrongFix(
        "saves every step but never loads: the restart trains again from step 0",
        why="training is deterministic, so the final weights of a run that starts over equal "
            "an uninterrupted run's; only the steps each attempt took tell it apart",
        edits={"train.py": [(LOAD, '''if False:  # resuming is for later
    checkpoint = torch.load(args.ckpt, map_location=device)''')]}),
    WrongFix(
        "loads the weights but not the optimizer: the momentum starts from zero",
        why="the half fix of the starter: the resumed steps use other updates",
        edits={"train.py": [(
            '    optimizer.load_state_dict(checkpoint["optimizer"])  # the momentum buffers are state too\n',
            "")]}),
    WrongFix(
        "resumes at the checkpoint's step, training that step twice",
        why="the checkpoint is written after its step: resuming at it repeats one step",
        edits={"train.py": [('start = checkpoint["step"] + 1', 'start = checkpoint["step"]')]}),
    WrongFix(
        "momentum turned off, so the optimizer has no state to save",
        why="the starter's checkpoint (the model alone) is then all there is, and with the step "
            "after the checkpoint's the resume matches an uninterrupted run; but the run trains "
            "with other hyperparameters than the ones it was given: the checks compare it with "
            "the same edited script",
        base="starter",
        edits={"train.py": [("optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)",
                             "optimizer = torch.optim.SGD(model.parameters(), lr=0.05)  # no state to lose"),
                            ('    start = checkpoint["step"]\n', '    start = checkpoint["step"] + 1\n')]}),
    WrongFix(
        "checkpoints every 5 steps only",
        why="the public kill (rank 1 at step 5) follows the step-4 checkpoint and retrains one "
            "step; killed at step 2, before any checkpoint, the run trains again from step 0 "
            "(the required hidden check)",
        edits={"train.py": [("    if rank == 0:\n        # write to a temporary file",
                             "    if rank == 0 and step % 5 == 4:  # every 5 steps is enough\n"
                             "        # write to a temporary file")]}),
    WrongFix(
        "the optimizer saved too, but torch.save straight onto the checkpoint",
        why="rewriting the save line drops the temporary file and the rename: the checks' kills "
            "land between two saves, so the resume is bitwise right, but a kill mid-save leaves "
            "half a checkpoint; the files probe sees the resumed run write the file it loaded "
            "(found by an audit, 2026-11-30: it scored 1.000)",
        edits={"train.py": [('                    "step": step}, args.ckpt + ".tmp")\n'
                             '        os.replace(args.ckpt + ".tmp", args.ckpt)\n',
                             '                    "step": step}, args.ckpt)\n')]}),
    WrongFix(
        "every rank writes the checkpoint itself, in place",
        why="every rank holds the same state, so each saves it, straight onto checkpoint.pt: two "
            "writers of one file, in place, and no kill of the checks lands while they write "
            "(found by an audit, 2026-11-30: it scored 1.000)",
        edits={"train.py": [("    if rank == 0:\n        # write to a temporary file",
                             "    if True:  # every rank holds the same state\n        # write to a temporary file"),
                            ('                    "step": step}, args.ckpt + ".tmp")\n'
                             '        os.replace(args.ckpt + ".tmp", args.ckpt)\n',
                             '                    "step": step}, args.ckpt)\n')]}),
    WrongFix(
        "torch.save straight onto the checkpoint, loaded through an open file",
        why="not atomic: a kill while it saves leaves half a checkpoint; the load through a "
            "file object named no file to the files probe (found by an audit, 2026-11-30: it scored 1.000)",
        edits={"train.py": [
            ('                    "step": step}, args.ckpt + ".tmp")\n'
             '        os.replace(args.ckpt + ".tmp", args.ckpt)\n',
             '                    "step": step}, args.ckpt)\n'),
            ('    checkpoint = torch.load(args.ckpt, map_location=device)',
             '    with open(args.ckpt, "rb") as f:\n'
             '        checkpoint = torch.load(f, map_location=device)')]}),
    WrongFix(
        "torch.save straight onto the checkpoint, loaded from its bytes",
        why="not atomic, as the one before; torch.load reads an io.BytesIO, so no file is seen "
            "loaded (found by an audit, 2026-11-30: it scored 1.000)",
        edits={"train.py": [
            ('                    "step": step}, args.ckpt + ".tmp")\n'
             '        os.replace(args.ckpt + ".tmp", args.ckpt)\n',
             '                    "step": step}, args.ckpt)\n'),
            ('    checkpoint = torch.load(args.ckpt, map_location=device)',
             '    import io, pathlib\n'
             '    checkpoint = torch.load(io.BytesIO(pathlib.Path(args.ckpt).read_bytes()), map_location=device)')]}),
    WrongFix(
        "the temporary file made by tempfile.mkstemp() in the system's folder, then shutil.move",
        why="a rename is atomic only within one file system: with /tmp local and the "
            "checkpoint on shared storage, shutil.move copies, writing the checkpoint in place "
            "(found by an audit, 2026-11-30: it scored 1.000)",
        edits={"train.py": [
            ('        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),\n'
             '                    "step": step}, args.ckpt + ".tmp")\n'
             '        os.replace(args.ckpt + ".tmp", args.ckpt)\n',
             '        import shutil, tempfile\n'
             '        fd, tmp = tempfile.mkstemp()\n'
             '        with os.fdopen(fd, "wb") as f:\n'
             '            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),\n'
             '                        "step": step}, f)\n'
             '        shutil.move(tmp, args.ckpt)\n')]}),
    WrongFix(
        "every rank saves and loads a checkpoint file of its own",
        why="each rank replaces its own checkpoint.pt.rankN whole, and the checks' kills land "
            "after both ranks saved; but the ranks save at different moments, so a kill between "
            "two ranks' saves leaves their checkpoints a step apart and the resumed ranks start at "
            "different steps (found by an audit, 2026-11-30: it scored 1.000)",
        edits={"train.py": [("rank, world_size, device = init()\n",
                             "rank, world_size, device = init()\nargs.ckpt = f\"{args.ckpt}.rank{rank}\"\n"),
                            ("    if rank == 0:\n        # write to a temporary file",
                             "    if True:  # each rank its own file\n        # write to a temporary file")]}),
]

# Not here: every rank writing the checkpoint through the same temporary file. Lab 07's
# checks fail it now (the resumed run's writes, read with the files probe: two ranks write
# one file), as lab 10's do; it is catalogued there, where it was first caught every time.
