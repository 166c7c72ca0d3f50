"""Run evaluate.py inside a rank and record which items this rank's model scored.

The checks launch this file instead of evaluate.py (keep it as is)::

    scored_items.py -- evaluate.py --items 11

It runs the script unchanged as ``__main__``, with one difference it cannot see:
evalset.trained_model() returns the model with a forward hook that notes every item
it is given, and evalset.held_out_set() notes each item's features, so an item is
known by its features, whatever loader or sampler brought it. When the script ends
well, each rank reports the indices of the items its model scored, as a record of the
grader's probe (probe="scored") that the script cannot write: what the checks compare,
rather than what the script says it did.
"""

import os
import sys


def main(argv: list[str]) -> None:
    if argv[:1] != ["--"] or len(argv) < 2:
        raise SystemExit("usage: scored_items.py -- evaluate.py [ARGS...]")
    script, script_args = argv[1], argv[2:]
    from labutils.grading.probe import run_script, signer

    send = signer()   # before the script runs: it cannot sign records
    # the learner's folder, not the lab's, is the script's first import path
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    import evalset

    index_of: dict[bytes, int] = {}   # an item's features (raw bytes) -> its index
    scored: set[int] = set()
    held_out_set, trained_model = evalset.held_out_set, evalset.trained_model

    def noted_set(*args, **kwargs):
        dataset = held_out_set(*args, **kwargs)
        index_of.update({row.numpy().tobytes(): i for i, row in enumerate(dataset.tensors[0])})
        return dataset

    def note(model, inputs):
        rows = inputs[0].detach().cpu().reshape(-1, inputs[0].shape[-1])
        scored.update(index_of.get(row.numpy().tobytes(), -1) for row in rows)

    def noted_model():
        model = trained_model()
        model.register_forward_pre_hook(note)
        return model

    # the script's `from evalset import ...` runs later and gets these
    evalset.held_out_set, evalset.trained_model = noted_set, noted_model
    run_script(script, script_args)
    send(probe="scored", items=sorted(scored))


if __name__ == "__main__":
    main(sys.argv[1:])
