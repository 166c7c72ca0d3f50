"""Run a learner's script inside a rank with measurements the checks can trust more.

The checks (and lab notebooks) launch this file instead of the learner's script::

    from labutils.grading.probe import launch_measured
    result = launch_measured("train.py", 2, measure=["weights"], args=["--epochs", "2"])

It installs the requested probes, runs the script unchanged as ``__main__`` and,
when the script ends well, sends what it measured with report(probe=...):

- weights: the parameters of every model wrapped in DistributedDataParallel, read
  from the model itself at the end (values and a sha256 of the raw bytes, so bitwise
  equality can be checked);
- buffers: the running statistics (running_mean, running_var) of every BatchNorm
  layer of those models, read from the layers at the end, whatever the script reports;
- allreduce: how many gradient all-reduces DDP launched between optimizer steps,
  counted by labutils.course.ddp_probes.BucketRecorder as the communication hook (one call
  per bucket; a hook the script registers itself runs inside the recorder, since DDP
  takes only one);
- steps: the optimizer steps this rank took in this attempt (every optimizer's step(),
  seen by a global post-step hook, except those with learning rate 0, which train
  nothing: torch.distributed.checkpoint takes one to create an optimizer's state),
  sent after each step as it happens, with
  torchrun's restart count: the count of an attempt killed halfway is known too, so
  a check can tell a resumed attempt from one that trains from step 0 again;
- traffic: every operation this rank asked of a process group, in order, with the
  bytes of its tensors and the peer of a send or a receive (count_traffic): counted at
  the ProcessGroup itself, so it sees dist.isend,
  torch.distributed.distributed_c10d.all_reduce and batch_isend_irecv alike, and the
  functional collectives' ops too ("_c10d_functional.all_reduce", ...);
- files: what the rank did with files: every file it opened for writing (open(),
  os.open() as tempfile.mkstemp does, torch.save() to a path), every rename (os.replace,
  os.rename), every file it removed (os.remove, os.unlink) and every torch.load(),
  with the map_location it was given and the devices of the tensors it returned (the
  script's own calls: not those torch makes inside, as when it unpickles the tensors
  broadcast_object_list sent),
  and the rank's own device (its DDP model's). Paths inside the working directory
  are relative to it. A check can tell from them which ranks write a checkpoint,
  and whether they load it onto their own device (on GPUs, a load without
  map_location puts every rank's tensors on the GPU they were saved from);
- data: the dataset indices of every batch a DataLoader handed this rank (through a
  Subset, the indices of its items in the dataset underneath), grouped by
  optimizer step (the batches taken since the step before), each with its pass: the
  how-manieth iteration over a DataLoader it came from (a new pass is one `for ... in
  loader`, an epoch in most scripts). Read from the loader's own sampler as it yields,
  so a check sees the data each rank was given, not what its script reports;
- forwards: the forward passes through every model a DistributedDataParallel wraps (by
  way of the wrapper, or of its .module: a correct way to accumulate), grouped by
  optimizer step as data's batches are, each as the batch size of its first tensor
  argument: a check can tell micro-batches accumulated over several forward passes from
  one forward pass over them all. With them, per step, the order of those forward
  passes (F) and of their backward passes (B: the first gradient to reach a forward
  pass's output, seen by a hook on its output tensors), as a string such as "FBFB": a
  check can tell micro-batches whose backward comes before the next forward (each
  graph freed as it goes) from forwards whose graphs are all kept for one backward.

Only the probe's records count as the probe's: launch_measured() hands each run a
secret in the environment, which the probe takes out before the script starts and
puts in each of its records; records that claim a probe without it, the script's own
report(probe=...), are dropped from result.records (own_records()).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sys
from collections.abc import Callable

from labutils.runtime.worker import run_as_main

MEASURES = ("weights", "buffers", "allreduce", "steps", "traffic", "files", "data", "forwards")
SECRET_ENV = "LABUTILS_PROBE_SECRET"   # the run's secret, read and removed by the probe
SIGNED = "signed"   # measure=["signed"]: the script is a lab's harness that signs (signer())
TAG = "probe_tag"                      # the record's field that carries it
# ProcessGroup operations the traffic probe counts: the point-to-point ones, then every
# collective a ring could be replaced with (barrier carries no data: not counted).
POINT_TO_POINT = ("send", "recv", "recv_anysource")
COLLECTIVES = ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather",
               "_allgather_base", "allgather_coalesced", "allgather_into_tensor_coalesced",
               "all_gather_single", "reduce_scatter", "_reduce_scatter_base",
               "reduce_scatter_single", "reduce_scatter_tensor_coalesced", "alltoall",
               "alltoall_base", "all_to_all_single", "gather", "scatter")
FUNCTIONAL_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather_into_tensor",
                          "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
                          "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast",
                          # their in-place and out= forms (all_reduce_inplace's op), and
                          # the autograd namespace's
                          "all_reduce_", "all_reduce_coalesced_", "broadcast_",
                          "all_gather_into_tensor_out", "reduce_scatter_tensor_out")


def launch_measured(script, nproc: int = 2, *, measure, args=(), **launch_kwargs):
    """launch() the script under the probes; their values arrive in result.records.

    Args:
        script: the training script, run unchanged.
        nproc: ranks.
        measure: probes, a subset of MEASURES.
        args: the script's command-line arguments.
        launch_kwargs: passed on to labutils.launch (hang_timeout, fault, display, env...).
    """
    from labutils.run.launcher import launch

    secret = secrets.token_hex(16)
    env = {**(launch_kwargs.pop("env", None) or {}), SECRET_ENV: secret}
    if list(measure) == [SIGNED]:   # a lab's own harness: it signs with signer()
        result = launch(script, nproc, args=[str(a) for a in args], env=env, **launch_kwargs)
        result.records = own_records(result.records, secret)
        return result
    unknown = set(measure) - set(MEASURES)
    if unknown or not measure:
        raise ValueError(f"measure: expected some of {MEASURES} (or [{SIGNED!r}] alone), "
                         f"got {list(measure)}")
    probe_args = ["--measure", ",".join(sorted(measure)), "--", os.path.abspath(script),
                  *map(str, args)]
    result = launch(__file__, nproc, args=probe_args, env=env, **launch_kwargs)
    result.records = own_records(result.records, secret)
    return result


def signer() -> Callable[..., None]:
    """For a lab's own harness, launched with measure=["signed"]: takes the run's secret
    out of the environment before the learner's script starts (which then cannot sign)
    and returns send(probe=NAME, **values), which reports values as the probe's own."""
    secret = os.environ.pop(SECRET_ENV, "")
    from labutils.dist import report  # bound now: the script cannot swap it

    def send(**values) -> None:
        report(**values, **{TAG: secret})

    return send


def own_records(records: list[dict], secret: str | None = None) -> list[dict]:
    """The script's own records, and the probe's that carry the run's secret (without it).

    Args:
        records: a run's records, as result.records holds them.
        secret: the secret launch_measured() gave the run; None for a run without the
            probe, whose records that claim a probe are all the script's.
    """
    kept = []
    for record in records:
        if "probe" not in record and TAG not in record:
            kept.append(record)
        elif secret and record.get(TAG) == secret and "probe" in record:
            kept.append({k: v for k, v in record.items() if k != TAG})
    return kept


def _install(measures: set[str], send: Callable[..., None]) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from labutils.course.ddp_probes import BucketRecorder

    state: dict = {"models": [], "recorders": [], "counted": 0, "per_step": []}
    original_init = DistributedDataParallel.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        state["models"].append(self.module)
        if "allreduce" in measures:  # becomes the model's communication hook
            recorder = BucketRecorder(self)
            state["recorders"].append(recorder)

            def register_comm_hook(hook_state, hook, recorder=recorder):
                """DDP takes one hook, and the recorder is it: the script's own hook (a
                compression hook, say) does the communication inside the recorder."""
                recorder.inner, recorder.inner_state = hook, hook_state

            self.register_comm_hook = register_comm_hook
        if "forwards" in measures:  # on the wrapped model: DDP's forward calls it, and so
            # does a script that skips the reducer with model.module (as no_sync does)
            self.module.register_forward_pre_hook(lambda module, args: _forward_began(state, args))
            self.module.register_forward_hook(
                lambda module, args, output: _watch_backward(state, output))

    DistributedDataParallel.__init__ = init  # type: ignore[method-assign]  # the probe's wrapper

    if "data" in measures:
        state["data"] = _watch_batches()
    if "forwards" in measures:
        state["forwards"], state["forwards_taken"] = [], []
        state["passes"], state["passes_taken"] = [], []
    if measures & {"allreduce", "steps", "data", "forwards"}:
        _watch_steps(measures, state, send)
    if "traffic" in measures:
        state["traffic"] = count_traffic()
    if "files" in measures:
        state["files"] = _watch_files()
    return state


def _watch_steps(measures: set[str], state: dict, send: Callable[..., None]) -> None:
    """Hooks around every optimizer step: what each step trained on (data, forwards,
    all-reduces), and the steps that trained (a "steps" record as each is taken)."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    state["steps"] = 0
    state["graded"] = True

    def before_step(optimizer, args, kwargs):
        """Whether this step has a gradient to take: a step on none, or on zeros
        only, trains nothing (one taken before loading a checkpoint so that the
        optimizer has its momentum buffers to load into, say)."""
        state["graded"] = any(p.grad is not None and bool(p.grad.any())
                              for group in optimizer.param_groups for p in group["params"])

    def after_step(optimizer, args, kwargs):
        if "data" in state:  # the batches taken since the last step trained this one
            data = state["data"]
            data["steps"].append(data["taken"])
            data["taken"] = []
        if "forwards" in state:  # the forward passes since the last step trained this one
            state["forwards"].append(state["forwards_taken"])
            state["passes"].append("".join(state["passes_taken"]))
            state["forwards_taken"], state["passes_taken"] = [], []
        calls = sum(len(r.calls) for r in state["recorders"])
        state["per_step"].append(calls - state["counted"])
        state["counted"] = calls
        if "steps" not in measures or not state["graded"] or all(
                float(group.get("lr", 1.0)) == 0.0 for group in optimizer.param_groups):
            return  # lr 0 trains nothing: dcp's get/set_state_dict steps so to make state
        state["steps"] += 1
        send(probe="steps", restart=restart, taken=state["steps"])  # now: a kill may come

    if "steps" in measures:
        register_optimizer_step_pre_hook(before_step)
    register_optimizer_step_post_hook(after_step)


def _watch_batches() -> dict:
    """Wrap DataLoader iteration to note, in order, the sampler's indices of each batch
    the rank is handed: {"steps": [[[pass, indices], ...] per optimizer step],
    "taken": batches since the last step}. A loader asks its sampler for indices before
    it fetches (ahead, and already while its iterator is made, with worker processes);
    each iterator keeps what it asked for in order, from its last reset, and a batch
    takes the oldest entry when it is handed over (torch hands batches in the order
    asked, unless in_order=False)."""
    from torch.utils.data import DataLoader
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    seen: dict = {"steps": [], "taken": [], "passes": 0}
    new_iterator, reset = DataLoader.__iter__, _BaseDataLoaderIter._reset
    next_index, next_batch = _BaseDataLoaderIter._next_index, _BaseDataLoaderIter.__next__

    def iterate(self):
        iterator = new_iterator(self)
        iterator._probe_pass = seen["passes"]
        seen["passes"] += 1
        return iterator

    def restart(self, *args, **kwargs):  # a persistent iterator's new pass: asks anew
        self._probe_asked = []
        return reset(self, *args, **kwargs)

    def asked(self):
        index = next_index(self)
        self.__dict__.setdefault("_probe_asked", []).append(_base_indices(
            getattr(self, "_dataset", None),
            [int(i) for i in index] if isinstance(index, (list, tuple))
            else [int(index)] if hasattr(index, "__index__") else []))
        return index

    def handed(self):
        batch = next_batch(self)
        if self.__dict__.get("_probe_asked"):
            seen["taken"].append([getattr(self, "_probe_pass", -1), self._probe_asked.pop(0)])
        return batch

    DataLoader.__iter__ = iterate  # type: ignore[method-assign]  # the probe's wrappers
    _BaseDataLoaderIter._reset = restart  # type: ignore[method-assign]
    _BaseDataLoaderIter._next_index = asked  # type: ignore[method-assign]
    _BaseDataLoaderIter.__next__ = handed  # type: ignore[method-assign]
    return seen


def _base_indices(dataset, indices: list[int]) -> list[int]:
    """A sampler's indices into a Subset (of a Subset ...) as the indices of the items in
    the dataset underneath, which is what "the items a rank trained on" means: a script
    that shards with Subset(dataset, its share) hands out positions within its share."""
    from torch.utils.data import Subset

    mapped = indices
    try:
        while isinstance(dataset, Subset):
            mapped = [int(dataset.indices[i]) for i in mapped]
            dataset = dataset.dataset
    except (IndexError, TypeError, ValueError):  # not indices the subset can map: as asked
        return indices
    return mapped


def _forward_began(state: dict, args) -> None:
    """Note a forward pass through a wrapped model: its batch size, and an F in the order."""
    state["forwards_taken"].append(_batch_size(args))
    state["passes_taken"].append("F")


def _watch_backward(state: dict, output) -> None:
    """Note a B in the order when the first gradient reaches this forward pass's output
    (a tensor hook on each output tensor that needs one; an output used by no loss, or
    computed under no_grad, gets no B)."""
    begun: list[bool] = []

    def reached(grad):
        if not begun:
            begun.append(True)
            state["passes_taken"].append("B")

    for tensor in _tensors(output):
        if tensor.requires_grad:
            tensor.register_hook(reached)


def _batch_size(args) -> int | None:
    """The first dimension of a forward pass's first tensor argument (None: no tensor, or
    a scalar)."""
    first = next(_tensors(args), None)
    return int(first.shape[0]) if first is not None and first.dim() else None


def _tensors(obj):
    """Every tensor in obj (a tensor, or lists, tuples and dicts of them)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def count_traffic() -> list[list]:
    """Log every operation this process asks of a process group from now on.

    Wraps the ProcessGroup's methods, which every Python path ends in (dist.*,
    torch.distributed.distributed_c10d.*, batch_isend_irecv, P2POp), so a wrapper of the
    dist.* names cannot be gone around, and its backend's (group._get_backend(device)).
    Returns the log, which grows as operations come: [name, bytes, peer] each, the
    ProcessGroup method's name (send, recv, allreduce, ...), the bytes of the tensors in
    its first argument (what a send sends, what a collective contributes) and, for send
    and recv, the rank in the group it sends to or receives from (None for the rest, and
    for a receive from any source). Each call installs one more counter."""
    from torch.distributed import ProcessGroup

    log: list[list] = []

    def counted(name, original):
        def operation(self, *args, **kwargs):
            first = args[0] if args else next(iter(kwargs.values()), None)
            peer = args[1] if name in ("send", "recv") and len(args) > 1 else None
            log.append([name, sum(t.numel() * t.element_size() for t in _tensors(first)),
                        int(peer) if isinstance(peer, int) else None])
            return original(self, *args, **kwargs)
        return operation

    for name in POINT_TO_POINT + COLLECTIVES:
        if hasattr(ProcessGroup, name):
            setattr(ProcessGroup, name, counted(name, getattr(ProcessGroup, name)))
    # The backend under a group (group._get_backend(device), ProcessGroupGloo's methods,
    # which it inherits from Backend) takes the same calls: ProcessGroup's methods reach it
    # from C++, past these, so only a script's own calls are logged here, not twice.
    backend: type | None
    try:
        from torch._C._distributed_c10d import Backend as backend
    except ImportError:
        backend = None
    for name in POINT_TO_POINT + COLLECTIVES:
        if backend is not None and name in vars(backend):
            setattr(backend, name, counted(name, getattr(backend, name)))

    # The functional collectives (torch.distributed._functional_collectives, which DTensor
    # and torch.compile use) reach the process group from C++, past the methods above:
    # their ops are logged as "_c10d_functional.NAME", the bytes of their input tensors
    # (the in-place forms and the autograd namespace's too).
    def functional(name, original):
        def operation(*args, **kwargs):
            first = args[0] if args else next(iter(kwargs.values()), None)
            log.append([name,
                        sum(t.numel() * t.element_size() for t in _tensors(first)), None])
            return original(*args, **kwargs)
        return operation

    import torch
    for space in ("_c10d_functional", "_c10d_functional_autograd"):  # both logged as the first
        namespace = getattr(torch.ops, space, None)
        for name in FUNCTIONAL_COLLECTIVES:
            try:
                original = getattr(namespace, name)
            except (AttributeError, RuntimeError):
                continue
            setattr(namespace, name, functional(f"_c10d_functional.{name}", original))
    return log


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

    seen: dict = {"writes": [], "renames": [], "removes": [], "loads": []}
    original_open, original_save, original_load = builtins.open, torch.save, torch.load
    original_replace, original_rename = os.replace, os.rename
    original_remove, original_unlink = os.remove, os.unlink
    original_os_open = os.open
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    load_signature = inspect.signature(original_load)

    def watched_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+") \
                and kwargs.get("opener") is None:  # an opener opens a file of its own (os.open)
            seen["writes"].append(_shown_path(os.fsdecode(file)))
        return original_open(file, mode, *args, **kwargs)

    def watched_os_open(path, flags, *args, **kwargs):  # tempfile.mkstemp's, os.fdopen's file
        fd = original_os_open(path, flags, *args, **kwargs)
        if isinstance(path, (str, bytes, os.PathLike)) and flags & writing:
            seen["writes"].append(_shown_path(os.fsdecode(path)))
        return fd

    def watched_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            seen["writes"].append(_shown_path(f))
        return original_save(obj, f, *args, **kwargs)

    def watched_load(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller == "torch" or caller.startswith("torch."):  # torch's own: unpickling a
            return original_load(*args, **kwargs)  # tensor broadcast_object_list sent, DCP
        bound = load_signature.bind_partial(*args, **kwargs).arguments
        file = bound.get("f")
        # A file object opened on a path (torch.load(open(path, "rb"))) names that path: the
        # file it was loaded from, as for a path given to torch.load itself.
        name = getattr(file, "name", None) if not isinstance(file, (str, os.PathLike)) else file
        call = {
            "file": _shown_path(os.fsdecode(name)) if isinstance(name, (str, bytes, os.PathLike))
            else type(file).__name__,
            "map_location": _shown_location(bound.get("map_location")),
            "devices": [],
        }
        seen["loads"].append(call)
        loaded = original_load(*args, **kwargs)
        call["devices"] = sorted({str(t.device) for t in _tensors(loaded)})
        return loaded

    def renamer(original):
        def watched(src, dst, *args, **kwargs):
            result = original(src, dst, *args, **kwargs)
            seen["renames"].append([_shown_path(os.fsdecode(src)), _shown_path(os.fsdecode(dst))])
            return result
        return watched

    def remover(original):
        def watched(path, *args, **kwargs):
            result = original(path, *args, **kwargs)
            if isinstance(path, (str, bytes, os.PathLike)):
                seen["removes"].append(_shown_path(os.fsdecode(path)))
            return result
        return watched

    builtins.open = io.open = watched_open
    os.open = watched_os_open
    torch.save, torch.load = watched_save, watched_load
    torch.serialization.load = watched_load  # the same function under its other name
    os.replace, os.rename = renamer(original_replace), renamer(original_rename)
    os.remove, os.unlink = remover(original_remove), remover(original_unlink)
    return seen


def _send(measures: set[str], state: dict, send: Callable[..., None]) -> None:
    if "weights" in measures:
        for index, model in enumerate(state["models"]):
            names, values, digest = [], [], hashlib.sha256()
            for name, param in model.named_parameters():
                data = param.detach().cpu().contiguous()
                digest.update(data.numpy().tobytes())
                names.append(name)
                values.extend(data.flatten().tolist())
            send(probe="weights", model=index, names=names, values=values,
                 sha256=digest.hexdigest())
    if "buffers" in measures:
        import torch

        for index, model in enumerate(state["models"]):
            layers = {}
            for name, module in model.named_modules():  # BatchNorm's, or a layer of the
                # script's own that keeps running statistics under the same names
                mean, var = getattr(module, "running_mean", None), getattr(module, "running_var", None)
                if isinstance(mean, torch.Tensor) and isinstance(var, torch.Tensor):
                    layers[name] = {"running_mean": mean.detach().cpu().tolist(),
                                    "running_var": var.detach().cpu().tolist()}
            send(probe="buffers", model=index, layers=layers)
    if "allreduce" in measures:
        calls = sum(len(r.calls) for r in state["recorders"])
        send(probe="allreduce", per_step=state["per_step"], after_last_step=calls - state["counted"])
    if "traffic" in measures:
        send(probe="traffic", operations=state["traffic"])
    if "data" in measures:
        send(probe="data", steps=state["data"]["steps"], after_last_step=state["data"]["taken"])
    if "forwards" in measures:
        send(probe="forwards", per_step=state["forwards"], after_last_step=state["forwards_taken"],
             passes=state["passes"], passes_after_last_step="".join(state["passes_taken"]))
    if "files" in measures:
        params = [p for model in state["models"] for p in model.parameters()]
        send(probe="files", device=str(params[0].device) if params else "cpu", **state["files"])


def main(argv: list[str]) -> None:
    if "--" not in argv or argv[:1] != ["--measure"]:
        raise SystemExit(f"usage: probe.py --measure {','.join(MEASURES)} -- SCRIPT [ARGS...]")
    cut = argv.index("--")
    measures = set(filter(None, argv[1].split(","))) if cut == 2 else set()
    unknown = measures - set(MEASURES)
    if unknown:
        raise SystemExit(f"probe.py: unknown measures {sorted(unknown)}; known: {MEASURES}")
    script, script_args = argv[cut + 1], argv[cut + 2:]
    send = signer()   # the secret leaves the environment before the script runs
    # The learner's folder, not this package's, is the script's first import path.
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    state = _install(measures, send)
    run_script(script, script_args)
    _send(measures, state, send)


def run_script(script: str, script_args: list[str]) -> None:
    """Run the learner's script unchanged as __main__ with its arguments; return when it
    ends well (sys.exit(0) included), raise as it did otherwise."""
    sys.argv = [script, *script_args]
    try:
        run_as_main(script)   # the script's objects kept to the end: worker.run_as_main says why
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise


if __name__ == "__main__":
    main(sys.argv[1:])
