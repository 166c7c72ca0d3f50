"""Wrong fixes of lab 11 that a learner in a hurry would submit; each must fail the lab.

Kept for instructors and the tests (`labutils wrongfixes labs/11_resume_other_world_size`);
never in a learner's copy.
"""

from labutils.grading.wrongfix import WrongFix

# train.py's lines: the folder a save goes to, and the choice of the newest finished one
FOLDER = '    folder = os.path.join(args.ckpt_dir, f"step-{steps_done}")\n'
NEWEST = '''    done = glob.glob(os.path.join(args.ckpt_dir, "step-*", DONE))
    folders = [os.path.dirname(path) for path in done]
    return max(folders, key=lambda folder: int(folder.rsplit("-", 1)[1]), default=None)'''

WRONG_FIXES = [
    WrongFix(
        "saves with torch.distributed.checkpoint but never loads: the resumed run starts over",
        why="the checkpoints look right and the run from step 0 ends with the reference's "
            "losses and weights: only the steps the resumed run took tell it apart",
        edits={"train.py": [("folder = newest_checkpoint()\n",
                             "folder = None  # resuming is for later\n")]}),
    WrongFix(
        "saves and loads only the model with dcp: the momentum starts from zero",
        why="the half fix: every step runs once on the right items, but the trajectory bends",
        edits={"train.py": [
            ('return {"model": model_state, "optimizer": optimizer_state, "samples_seen": samples_seen}',
             'return {"model": model_state, "samples_seen": samples_seen}'),
            ('''    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])''',
             '    model.load_state_dict(state["model"])')]}),
    WrongFix(
        "counts the position in the data per rank: the resume skips steps",
        why="samples_seen is over all ranks; dividing by a rank's share gives another step at "
            "another world size",
        edits={"train.py": [('start = state["samples_seen"] // args.global_batch',
                             'start = state["samples_seen"] // per_rank')]}),
    WrongFix(
        "dcp with the plain state_dict()s: loading into an optimizer that has no momentum yet",
        why="dcp.load fills only the entries of the state it is given, and a fresh SGD's "
            "optimizer.state_dict() holds no momentum buffer yet: the checkpoint has them, the "
            "resumed run never reads them (get_state_dict builds them)",
        edits={"train.py": [
            ("    model_state, optimizer_state = get_state_dict(model, optimizer)\n",
             "    plain = model.module if isinstance(model, DDP) else model\n"
             "    model_state, optimizer_state = plain.state_dict(), optimizer.state_dict()\n"),
            ('''    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])''',
             '''    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])''')]}),
    WrongFix(
        "momentum turned off, so rank 0's torch.save of the model is the whole state",
        why="with the position counted over all ranks, the resume at another world size "
            "matches an uninterrupted run of the same edited script; but that script trains "
            "with other hyperparameters than it was given, and a checkpoint of a stateful "
            "optimizer would still lose its state",
        base="starter",
        edits={"train.py": [
            ("optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)",
             "optimizer = torch.optim.SGD(model.parameters(), lr=0.05)  # no state to lose"),
            ("    start = samples_seen // per_rank\n", "    start = samples_seen // args.global_batch\n"),
            ('torch.save({"model": model.module.state_dict(), "samples_seen": samples_seen},',
             'torch.save({"model": model.module.state_dict(),\n'
             '                    "samples_seen": steps_done * args.global_batch},  # all ranks\'')]}),
    WrongFix(
        "counts samples_seen per rank, converted with the notebook's saving world size (3)",
        why="start = samples_seen x 3 // global batch is the right step only for a checkpoint "
            "saved at 3 ranks, the public case's first; from one saved at 2 (the public case's "
            "second resume, the hidden case) the resume skips steps",
        edits={"train.py": [
            ("start = 0\nfolder = newest_checkpoint()\n",
             "samples_seen = 0  # items this rank has trained on\nstart = 0\n"
             "folder = newest_checkpoint()\n"),
            ('    start = state["samples_seen"] // args.global_batch\n',
             '    samples_seen = state["samples_seen"]\n'
             '    start = samples_seen * 3 // args.global_batch  # saved at 3 ranks\n'),
            ("    dcp.save(training_state(steps_done * args.global_batch), checkpoint_id=folder)",
             "    dcp.save(training_state(samples_seen), checkpoint_id=folder)"),
            ("    report(step=step, items=items, loss=loss.item())\n",
             "    samples_seen += len(items)\n"
             "    report(step=step, items=items, loss=loss.item())\n")]}),
    WrongFix(
        "resumes from the oldest checkpoint",
        why="min instead of max: with one checkpoint (the public case's first resume) it is "
            "the newest too; with several (its second resume, the hidden case) the resume "
            "trains steps again",
        edits={"train.py": [("    return max(folders, key=", "    return min(folders, key=")]}),
    WrongFix(
        "resumes from the newest step-* folder, finished or not (no .metadata test)",
        why="a save cut short by a preemption leaves a newer folder with the ranks' files and "
            "no .metadata: the restart picks it, and dcp.load cannot read it",
        edits={"train.py": [('''    done = glob.glob(os.path.join(args.ckpt_dir, "step-*", DONE))
    folders = [os.path.dirname(path) for path in done]
''', '''    folders = glob.glob(os.path.join(args.ckpt_dir, "step-*"))
''')]}),
    WrongFix(
        "keeps the starter's per-rank samples_seen, saves samples_seen x world_size, restores "
        "the global count into the per-rank counter",
        why="right for a checkpoint of a run that never resumed, so the first resume carries "
            "on where it should; but a resumed run counts on from the global count as if it "
            "were its rank's, and every checkpoint it writes holds a position too far on: "
            "resumed from one of those, the run skips steps",
        edits={"train.py": [
            ("start = 0\nfolder = newest_checkpoint()\n",
             "samples_seen = 0  # items this rank has trained on\nstart = 0\n"
             "folder = newest_checkpoint()\n"),
            ('    start = state["samples_seen"] // args.global_batch\n',
             '    samples_seen = state["samples_seen"]  # over all ranks\n'
             '    start = samples_seen // args.global_batch\n'),
            ("    dcp.save(training_state(steps_done * args.global_batch), checkpoint_id=folder)",
             "    dcp.save(training_state(samples_seen * world_size), checkpoint_id=folder)"),
            ("    report(step=step, items=items, loss=loss.item())\n",
             "    samples_seen += len(items)\n"
             "    report(step=step, items=items, loss=loss.item())\n")]}),
    WrongFix(
        "takes the newest checkpoint by its folder name as text: sorted(folders)[-1]",
        why="right while the step numbers have one digit; with step-10 and step-5 side by "
            "side it takes step-5 (\"step-10\" < \"step-5\") and trains the steps after it again",
        edits={"train.py": [(
            '    return max(folders, key=lambda folder: int(folder.rsplit("-", 1)[1]), default=None)',
            "    return sorted(folders)[-1] if folders else None")]}),
    WrongFix(
        "zero-padded step folders (step-000004), the newest taken finished or not",
        why="the catalogue's 'no .metadata test', with folder names that sort as text: the "
            "checks left their save cut short only beside a folder named step-4, so with "
            "step-000004 none was left and the unfinished-folder bug never showed (found by an "
            "audit, 2026-11-30: it scored 1.000)",
        edits={"train.py": [
            (FOLDER,
             '    folder = os.path.join(args.ckpt_dir, f"step-{steps_done:06d}")  # sorts as text\n'),
            (NEWEST,
             '''    folders = sorted(glob.glob(os.path.join(args.ckpt_dir, "step-*")))
    return folders[-1] if folders else None''')]}),
    WrongFix(
        "one checkpoint folder, overwritten by every save",
        why="dcp.save into the folder of the checkpoint before it: a save cut short by a "
            "preemption leaves the old .metadata over half-written rank files, and no checkpoint "
            "whole (lab 10's write in place, with DCP); no step-N folder, so the checks left no "
            "save cut short (found by an audit, 2026-11-30: it scored 1.000)",
        edits={"train.py": [
            (FOLDER,
             '    folder = os.path.join(args.ckpt_dir, "latest")  # the newest, always\n'),
            (NEWEST,
             '''    folder = os.path.join(args.ckpt_dir, "latest")
    return folder if os.path.exists(os.path.join(folder, DONE)) else None''')]}),
    WrongFix(
        "folders named by the last step's index (step-3 after 4 steps), the newest taken finished or not",
        why="the 'no .metadata test' fix with folders numbered one lower: the checks' save cut "
            "short needed a step-4 folder to copy, found none and left none, so the resume never "
            "met an unfinished folder (found by an audit, 2026-11-30: it scored 1.000)",
        edits={"train.py": [
            ('''    done = glob.glob(os.path.join(args.ckpt_dir, "step-*", DONE))
    folders = [os.path.dirname(path) for path in done]
''', '''    folders = glob.glob(os.path.join(args.ckpt_dir, "step-*"))
'''),
            ('    folder = os.path.join(args.ckpt_dir, f"step-{steps_done}")',
             '    folder = os.path.join(args.ckpt_dir, f"step-{steps_done - 1}")  # the last step\'s index')]}),
]
