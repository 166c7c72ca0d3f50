"""Look inside DistributedDataParallel while it trains: its buckets, when each bucket
is all-reduced, how long each layer's backward takes.

Used inside ranks (lesson 03)::

    from labutils.course.ddp_probes import BucketRecorder, BackwardTimer, reducer_buckets
    recorder = BucketRecorder(ddp)                 # becomes ddp's communication hook
    timer = BackwardTimer(layers)                  # {name: module} whose backward to time
    loss.backward()
    recorder.calls                                 # one BucketCall per bucket all-reduce
    timer.spans                                    # one LayerSpan per layer and backward
    reducer_buckets(ddp)                           # DDP's own logging data, parsed

and in notebooks and tests (pure)::

    predict_buckets(sizes_in_ready_order, cap_bytes=cap)  # DDP's rule for closing buckets

Times are time.perf_counter() seconds of the rank that recorded them: compare them
within one rank only. On GPUs they are the moments the CPU reached each hook, which
runs ahead of the kernels; the profiler's trace shows the kernels themselves.

Which collectives a rank issues (CollectiveLog) and the arithmetic of time spans
(busy_seconds, overlap_seconds, trace_spans) have modules of their own,
collective_log and spans; their names are imported here too, where lessons and
learners' notebooks first found them (labutils.ddp_probes.CollectiveLog).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from labutils.course.collective_log import CollectiveCall, CollectiveLog, count_all_reduces
from labutils.course.spans import busy_seconds, overlap_seconds, trace_spans
from labutils.errors import InputError, whole_number

__all__ = [
    "BucketCall", "BucketRecorder", "record_hook", "LayerSpan", "BackwardTimer",
    "reducer_param_names", "reducer_buckets", "parse_index_lists", "parse_sizes",
    "predict_buckets", "rank_output_dir",
    # from collective_log and spans, at their first address
    "CollectiveCall", "CollectiveLog", "count_all_reduces", "busy_seconds", "overlap_seconds",
    "trace_spans",
]


# ----------------------------------------------------------------------- bucket calls

@dataclass
class BucketCall:
    """One call of the communication hook: one bucket handed over for all-reduce.

    iteration counts backward passes that called the hook (from 0); start_s is when
    DDP handed the bucket over (all its gradients ready), end_s when its all-reduce
    finished (None until then).
    """

    iteration: int
    index: int
    numel: int
    nbytes: int
    params: list[str]
    is_last: bool
    start_s: float
    end_s: float | None = None
    thread: str = ""
    storage: int = 0  # address of the bucket buffer's storage (to spot gradient views)

    def to_json(self) -> dict:
        return asdict(self)


class BucketRecorder:
    """A communication hook that records every bucket, then runs the real hook.

    Args:
        ddp: the DistributedDataParallel model; the recorder registers itself as its
            hook (a DDP model takes one hook, registered before the first backward).
        inner: the hook that does the communication, called as inner(inner_state,
            bucket); default: plain all-reduce with average (DDP's own behaviour).
        inner_state: the state passed to inner; default: ddp's process group.
    """

    def __init__(self, ddp, *, inner: Callable | None = None, inner_state=None) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.inner = inner or default_hooks.allreduce_hook
        self.inner_state = inner_state if inner_state is not None else ddp.process_group
        self.names = {id(p): n for p, n in zip(*_reducer_params(ddp))}
        self.calls: list[BucketCall] = []
        self.iteration = 0
        self._lock = threading.Lock()
        ddp.register_comm_hook(self, record_hook)

    def counts(self) -> dict[int, int]:
        """Hook calls (= all-reduces launched by DDP) per iteration."""
        return dict(Counter(c.iteration for c in self.calls))

    def clear(self) -> None:
        """Forget the calls so far (the iteration count goes on)."""
        with self._lock:
            self.calls.clear()


def record_hook(state: BucketRecorder, bucket):
    """The hook function registered by BucketRecorder (DDP needs a parameter named bucket)."""
    buffer = bucket.buffer()
    call = BucketCall(
        iteration=state.iteration, index=bucket.index(), numel=buffer.numel(),
        nbytes=buffer.numel() * buffer.element_size(),
        params=[state.names.get(id(p), "?") for p in bucket.parameters()],
        is_last=bucket.is_last(), start_s=time.perf_counter(),
        storage=buffer.untyped_storage().data_ptr(),
    )
    with state._lock:
        state.calls.append(call)
        if call.is_last:
            state.iteration += 1
    future = state.inner(state.inner_state, bucket)

    def finished(fut):
        call.end_s = time.perf_counter()
        call.thread = threading.current_thread().name
        return fut.value()

    return future.then(finished)


# ----------------------------------------------------------------------- layer times

@dataclass
class LayerSpan:
    """One layer's part of one backward pass: from the gradient of its output reaching
    it (start_s) to the last of its parameters' gradients being accumulated (end_s)."""

    iteration: int
    name: str
    start_s: float
    end_s: float

    def to_json(self) -> dict:
        return asdict(self)


class BackwardTimer:
    """Times each layer's backward with tensor and parameter hooks.

    Args:
        layers: {name: module} of layers that own parameters (e.g. the Linear layers).
            start: the gradient of the layer's output arrives (a hook on the output
            tensor, set by a forward hook); end: the post-accumulate-grad hook of its
            last parameter, i.e. when DDP sees that gradient as ready.
    """

    def __init__(self, layers: Mapping[str, torch.nn.Module]) -> None:
        if not isinstance(layers, Mapping) or not layers:
            raise InputError("layers", expected="a dict {name: module} with at least one layer",
                             given=layers, fix="pass e.g. {'fc1': model.fc1, 'fc2': model.fc2}")
        self.spans: list[LayerSpan] = []
        self.iteration = 0
        self._open: dict[str, tuple[float, int]] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        for name, module in layers.items():
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if not params:
                raise InputError(f"layers[{name!r}]", expected="a module with its own parameters",
                                 given=type(module).__name__, fix="time the Linear/Conv layers, not activations")
            self._handles.append(module.register_forward_hook(self._forward(name)))
            for p in params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._post(name, len(params))))

    def _forward(self, name: str):
        def hook(module, inputs, output):
            if output.requires_grad:
                output.register_hook(lambda grad: self._start(name))
        return hook

    def _start(self, name: str) -> None:
        self._open[name] = (time.perf_counter(), 0)

    def _post(self, name: str, n_params: int):
        def hook(param):
            start, done = self._open.get(name, (time.perf_counter(), 0))
            done += 1
            self._open[name] = (start, done)
            if done == n_params:
                self.spans.append(LayerSpan(self.iteration, name, start, time.perf_counter()))
                del self._open[name]
        return hook

    def next_iteration(self) -> None:
        """Call after each backward, so spans carry the iteration they belong to."""
        self.iteration += 1

    def remove(self) -> None:
        """Remove every hook this timer registered."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


# ----------------------------------------------------------------------- logging data

def _reducer_params(ddp) -> tuple[list, list[str]]:
    """DDP's parameter list and names, in the reducer's index order (see
    DistributedDataParallel._build_params_for_reducer: modules in named_modules order,
    their own parameters that require grad, shared ones once)."""
    ignored: set[str] = getattr(ddp, "parameters_to_ignore", set())
    params, names, seen = [], [], set()
    for module_name, module in ddp.module.named_modules():
        for param_name, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if p.requires_grad and full not in ignored and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
                names.append(full)
    return params, names


def reducer_param_names(ddp) -> list[str]:
    """Parameter names by the reducer's parameter index (the numbers in the logging data)."""
    return _reducer_params(ddp)[1]


def parse_index_lists(text: str) -> list[list[int]]:
    """DDP's logging format for per-bucket indices, "7 6 5 4, 3 2, 1 0", as lists."""
    if not isinstance(text, str):
        raise InputError("text", expected="a string like '7 6, 5 4'", given=text,
                         fix="pass the logging value, e.g. data['rebuilt_per_bucket_param_indices']")
    text = text.strip()
    if not text:
        return []
    try:
        return [[int(v) for v in part.split()] for part in text.split(",")]
    except ValueError:
        raise InputError("text", expected="integers separated by spaces, buckets by commas",
                         given=text, fix="pass the logging value unchanged") from None


def parse_sizes(text: str) -> list[int]:
    """DDP's logging format for lists of numbers ("1071144, 1050624": bucket sizes in
    bytes; "9, 8, 7": gradient-ready order), as ints."""
    if not isinstance(text, str):
        raise InputError("text", expected="a string like '1024, 2048'", given=text,
                         fix="pass the logging value, e.g. data['rebuilt_bucket_sizes']")
    try:
        return [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise InputError("text", expected="integers separated by commas", given=text,
                         fix="pass the logging value unchanged") from None


def reducer_buckets(ddp) -> dict:
    """What DDP's own logging data says about its buckets, parsed.

    Returns:
        {"iteration", "bucket_cap_bytes", "initial_sizes" (bytes per bucket at
        construction), "rebuilt" (bool), "rebuilt_sizes" and "rebuilt_params" (names
        per bucket, in all-reduce order; empty before the rebuild is logged),
        "ready_order" (names in the order their gradients became ready in the
        previous backward), "param_bytes" ({name: bytes}), "num_parameter_tensors", "total_parameter_size_bytes",
        "gradient_as_bucket_view", "find_unused_parameters", "comm_hook",
        "avg_backward_compute_ns", "avg_backward_comm_ns", "avg_overlap_ns"}.
        Runtime averages are sampled (the first 10 iterations, then one in 100).
    """
    data = ddp._get_ddp_logging_data()
    params, names = _reducer_params(ddp)
    rebuilt_idx = parse_index_lists(data.get("rebuilt_per_bucket_param_indices", ""))
    ready = parse_sizes(data.get("prev_iteration_grad_ready_order_indices", ""))
    return {
        "iteration": int(data.get("iteration", 0)),
        "bucket_cap_bytes": int(data.get("bucket_cap_bytes", 0)),
        "initial_sizes": parse_sizes(data.get("bucket_sizes", "")),
        "rebuilt": bool(data.get("has_rebuilt_buckets", 0)),
        "rebuilt_sizes": parse_sizes(data.get("rebuilt_bucket_sizes", "")),
        "rebuilt_params": [[names[i] for i in bucket] for bucket in rebuilt_idx],
        "ready_order": [names[i] for i in ready],
        "param_bytes": {n: p.numel() * p.element_size() for n, p in zip(names, params)},
        "num_parameter_tensors": int(data.get("num_parameter_tensors", 0)),
        "total_parameter_size_bytes": int(data.get("total_parameter_size_bytes", 0)),
        "gradient_as_bucket_view": bool(data.get("gradient_as_bucket_view", 0)),
        "find_unused_parameters": bool(data.get("find_unused_parameters", 0)),
        "comm_hook": data.get("comm_hook", ""),
        "avg_backward_compute_ns": int(data.get("avg_backward_compute_time", 0)),
        "avg_backward_comm_ns": int(data.get("avg_backward_comm_time", 0)),
        "avg_overlap_ns": int(data.get("avg_backward_compute_comm_overlap_time", 0)),
    }


def predict_buckets(sizes: Sequence[int], *, cap_bytes: int,
                    first_cap_bytes: int | None = None) -> list[list[int]]:
    """DDP's bucketing rule (Reducer's compute_bucket_assignment_by_size), one dtype.

    Walk the gradients in order, adding each to the open bucket; once the bucket holds
    cap bytes or more, close it. So a bucket can exceed the cap by up to one tensor,
    and one tensor larger than the cap gets a bucket of its own.

    Args:
        sizes: bytes of each gradient, in the order DDP walks them (after the rebuild:
            the order they became ready in backward).
        cap_bytes: bucket_cap_mb * 2**20.
        first_cap_bytes: the limit of the first bucket (DDP: 1 MiB when bucket_cap_mb
            is left unset, else the same cap).

    Returns:
        Positions into sizes, one list per bucket.
    """
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise InputError("sizes", expected="a list of byte counts", given=sizes,
                         fix="pass e.g. [p.numel() * p.element_size() for p in params]")
    for name, value in (("cap_bytes", cap_bytes), ("first_cap_bytes", first_cap_bytes)):
        if value is None and name == "first_cap_bytes":
            continue
        if not whole_number(value) or value < 1:
            raise InputError(name, expected="a whole number of bytes >= 1", given=value,
                             fix="pass e.g. int(bucket_cap_mb * 2**20)")
    if any(not whole_number(s) or s < 0 for s in sizes):
        raise InputError("sizes", expected="whole numbers of bytes >= 0", given=list(sizes),
                         fix="pass p.numel() * p.element_size() per gradient")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    limit = first_cap_bytes or cap_bytes
    for i, size in enumerate(sizes):
        current.append(i)
        filled += size
        if filled >= limit:
            buckets.append(current)
            current, filled, limit = [], 0, cap_bytes
    if current:
        buckets.append(current)
    return buckets


def rank_output_dir() -> Path:
    """Where this rank should write files: its folder of the launcher's run folder
    (runs/<run>/rank<R>/), or the current folder outside the launcher."""
    from labutils.runtime import runfiles

    run_dir = os.environ.get(runfiles.ENV_RUN_DIR)
    if not run_dir:
        return Path.cwd()
    path = runfiles.rank_dir(run_dir, int(os.environ.get("RANK", "0")))
    path.mkdir(parents=True, exist_ok=True)
    return path
