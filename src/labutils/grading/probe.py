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
  per bucket);
- files: what the rank did with files: every file it opened for writing (open(),
  torch.save() to a path), every rename (os.replace, os.rename) and every torch.load(),
  with the map_location it was given. Paths inside the working directory are relative
  to it. A check can tell from them which ranks write a checkpoint, and whether they
  load it onto their own device (map_location is harmless on CPU: on GPUs, a load
  without it puts every rank's tensors on the GPU they were saved from).
"""

from __future__ import annotations

import hashlib
import os
import runpy
import sys

MEASURES = ("weights", "allreduce", "files")


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

    DistributedDataParallel.__init__ = init  # type: ignore[method-assign]  # the probe's wrapper

    if "allreduce" in measures:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def after_step(optimizer, args, kwargs):
            calls = sum(len(r.calls) for r in state["recorders"])
            state["per_step"].append(calls - state["counted"])
            state["counted"] = calls

        register_optimizer_step_post_hook(after_step)
    if "files" in measures:
        state["files"] = _watch_files()
    return state


def _shown_path(path) -> str:
    """A path as the checks compare it: relative to the working directory when inside it."""
    full = os.path.abspath(os.fspath(path))
    here = os.getcwd()
    return os.path.relpath(full, here) if full.startswith(here + os.sep) else full


def _shown_location(location) -> str | None:
    """torch.load's map_location as text: None when none was given."""
    if location is None:
        return None
    if callable(location):
        return f"a function ({getattr(location, '__name__', type(location).__name__)})"
    return str(location)


def _watch_files() -> dict:
    """Wrap open(), os.replace/os.rename and torch.save/torch.load to record what a rank
    writes, renames and loads; the wrapped functions behave exactly as before."""
    import builtins
    import inspect
    import io

    import torch

    seen: dict = {"writes": [], "renames": [], "loads": []}
    original_open, original_save, original_load = builtins.open, torch.save, torch.load
    original_replace, original_rename = os.replace, os.rename
    load_signature = inspect.signature(original_load)

    def watched_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+"):
            seen["writes"].append(_shown_path(os.fsdecode(file)))
        return original_open(file, mode, *args, **kwargs)

    def watched_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            seen["writes"].append(_shown_path(f))
        return original_save(obj, f, *args, **kwargs)

    def watched_load(*args, **kwargs):
        bound = load_signature.bind_partial(*args, **kwargs).arguments
        file = bound.get("f")
        seen["loads"].append({
            "file": _shown_path(file) if isinstance(file, (str, os.PathLike)) else type(file).__name__,
            "map_location": _shown_location(bound.get("map_location")),
        })
        return original_load(*args, **kwargs)

    def renamer(original):
        def watched(src, dst, *args, **kwargs):
            result = original(src, dst, *args, **kwargs)
            seen["renames"].append([_shown_path(os.fsdecode(src)), _shown_path(os.fsdecode(dst))])
            return result
        return watched

    builtins.open = io.open = watched_open
    torch.save, torch.load = watched_save, watched_load
    os.replace, os.rename = renamer(original_replace), renamer(original_rename)
    return seen


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
    if "files" in measures:
        report(probe="files", **state["files"])


def main(argv: list[str]) -> None:
    if "--" not in argv or argv[:1] != ["--measure"]:
        raise SystemExit("usage: probe.py --measure weights,allreduce,files -- SCRIPT [ARGS...]")
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
