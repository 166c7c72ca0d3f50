"""Wrong fixes of lab 11 that a learner in a hurry would submit; each must fail the lab.

Kept for instructors and the tests (`labutils wrongfixes labs/11_resume_other_world_size`);
never in a learner's copy.
"""

from labutils.grading.wrongfix import WrongFix

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
]
