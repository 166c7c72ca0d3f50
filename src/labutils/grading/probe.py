"""Run a learner's script inside a rank with measurements the checks can trust more.

The checks (and lab notebooks) launch this file instead of the learner's script::

    from labutils.grading.probe import launch_measured
    result = launch_measured("train.py", 2, measure=["weights"], args=["--epochs", "2"])

It installs the requested probes, runs the script unchanged as ``__main__`` and,
when the script ends well, sends what it measured with report(probe=...):

- weights: the parameters of every model wrapped in DistributedDataParallel, read
  from the model itself at the end (values and a sha256 of the raw bytes, so bitwise
  equality can be checked);
- allreduce: how many gradient all-reduces DDP launched between optimizer steps,
  counted by labutils.course.ddp_probes.BucketRecorder as the communication hook (one call
  per bucket).
"""

from __future__ import annotations

import hashlib
import os
import runpy
import sys

MEASURES = ("weights", "allreduce")


def launch_measured(script, nproc: int = 2, *, measure, args=(), **launch_kwargs):
    """launch() the script under the probes; their values arrive in result.records.

    Args:
        script: the training script, run unchanged.
        nproc: ranks.
        measure: probes, a subset of MEASURES.
        args: the script's command-line arguments.
        launch_kwargs: passed on to labutils.launch (hang_timeout, fault, display...).
    """
    from labutils.run.launcher import launch

    unknown = set(measure) - set(MEASURES)
    if unknown or not measure:
        raise ValueError(f"measure: expected some of {MEASURES}, got {list(measure)}")
    probe_args = ["--measure", ",".join(sorted(measure)), "--", os.path.abspath(script),
                  *map(str, args)]
    return launch(__file__, nproc, args=probe_args, **launch_kwargs)


def _install(measures: set[str]) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from labutils.course.ddp_probes import BucketRecorder

    state: dict = {"models": [], "recorders": [], "counted": 0, "per_step": []}
    original_init = DistributedDataParallel.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        state["models"].append(self.module)
        if "allreduce" in measures:  # becomes the model's communication hook
            state["recorders"].append(BucketRecorder(self))

    DistributedDataParallel.__init__ = init

    if "allreduce" in measures:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def after_step(optimizer, args, kwargs):
            calls = sum(len(r.calls) for r in state["recorders"])
            state["per_step"].append(calls - state["counted"])
            state["counted"] = calls

        register_optimizer_step_post_hook(after_step)
    return state


def _send(measures: set[str], state: dict) -> None:
    from labutils.dist import report

    if "weights" in measures:
        for index, model in enumerate(state["models"]):
            names, values, digest = [], [], hashlib.sha256()
            for name, param in model.named_parameters():
                data = param.detach().cpu().contiguous()
                digest.update(data.numpy().tobytes())
                names.append(name)
                values.extend(data.flatten().tolist())
            report(probe="weights", model=index, names=names, values=values,
                   sha256=digest.hexdigest())
    if "allreduce" in measures:
        calls = sum(len(r.calls) for r in state["recorders"])
        report(probe="allreduce", per_step=state["per_step"], after_last_step=calls - state["counted"])


def main(argv: list[str]) -> None:
    if "--" not in argv or argv[:1] != ["--measure"]:
        raise SystemExit("usage: probe.py --measure weights,allreduce -- SCRIPT [ARGS...]")
    cut = argv.index("--")
    measures = set(filter(None, argv[1].split(","))) if cut == 2 else set()
    unknown = measures - set(MEASURES)
    if unknown:
        raise SystemExit(f"probe.py: unknown measures {sorted(unknown)}; known: {MEASURES}")
    script, script_args = argv[cut + 1], argv[cut + 2:]
    # The learner's folder, not this package's, is the script's first import path.
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    state = _install(measures)
    sys.argv = [script, *script_args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    _send(measures, state)


if __name__ == "__main__":
    main(sys.argv[1:])
