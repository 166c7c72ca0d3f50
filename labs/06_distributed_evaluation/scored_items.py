"""Run evaluate.py inside a rank and record which items this rank's model scored.

The checks launch this file instead of evaluate.py (keep it as is)::

    scored_items.py -- evaluate.py --items 11

It runs the script unchanged as ``__main__``, with one difference it cannot see:
evalset.trained_model() returns the model with forward hooks (on the model and on each
of its layers) that note every item it is given, and evalset.held_out_set() notes each
item's features, so an item is known by its features (in float32, whatever dtype it
was cast to; a copy rounded to bfloat16 or float16, by the one item it is near),
whatever loader or sampler brought it, and whichever way it reached the model. When
the script ends well, each rank reports the indices of the items its model scored, as
a record of the grader's probe (probe="scored") that the script cannot write: what the
checks compare, rather than what the script says it did.
"""

import os
import sys


def _key(row) -> bytes:
    """An item's features as raw float32 bytes: a cast to float64 and back is exact."""
    return row.float().numpy().tobytes()


def main(argv: list[str]) -> None:
    if argv[:1] != ["--"] or len(argv) < 2:
        raise SystemExit("usage: scored_items.py -- evaluate.py [ARGS...]")
    script, script_args = argv[1], argv[2:]
    from labutils.grading.probe import run_script, signer

    send = signer()   # before the script runs: it cannot sign records
    # the learner's folder, not the lab's, is the script's first import path
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    import evalset
    import torch

    index_of: dict[bytes, int] = {}   # an item's features (raw bytes) -> its index
    features: list = []               # the items' features, to know a rounded copy by
    scored: set[int] = set()
    held_out_set, trained_model = evalset.held_out_set, evalset.trained_model

    def noted_set(*args, **kwargs):
        dataset = held_out_set(*args, **kwargs)
        index_of.update({_key(row): i for i, row in enumerate(dataset.tensors[0])})
        features[:] = [dataset.tensors[0].detach().float().cpu()]
        return dataset

    def index(row) -> int:
        """The item whose features these are: exactly, or else rounded (to bfloat16 or
        float16, which float32 bytes do not match) when they are near one item only."""
        exact = index_of.get(_key(row), -1)
        if exact >= 0 or not features or row.shape[-1] != features[0].shape[-1]:
            return exact
        near = torch.isclose(features[0], row.float(), rtol=1e-2, atol=1e-3).all(dim=1)
        return int(near.nonzero()[0]) if int(near.sum()) == 1 else -1

    def note(model, inputs, known_only=False):
        if not inputs or not isinstance(inputs[0], torch.Tensor) or not inputs[0].dim():
            return
        rows = inputs[0].detach().cpu().reshape(-1, inputs[0].shape[-1])
        found = (index(row) for row in rows)
        scored.update(i for i in found if i >= 0 or not known_only)

    def noted_model():
        model = trained_model()
        model.register_forward_pre_hook(note)
        # the layers too: model.forward(x), or a layer called on its own, skips the
        # model's hook; their inputs other than items (hidden features) are not noted
        for layer in list(model.modules())[1:]:
            layer.register_forward_pre_hook(lambda m, inputs: note(m, inputs, known_only=True))
        return model

    # the script's `from evalset import ...` runs later and gets these
    evalset.held_out_set, evalset.trained_model = noted_set, noted_model
    run_script(script, script_args)
    send(probe="scored", items=sorted(scored))


if __name__ == "__main__":
    main(sys.argv[1:])
