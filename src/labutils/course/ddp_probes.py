"""Look inside DistributedDataParallel while it trains: its buckets, when each bucket
is all-reduced, how long each layer's backward takes, which collectives are issued.

Used inside ranks (lesson 03)::

    from labutils.course.ddp_probes import BucketRecorder, BackwardTimer, reducer_buckets
    recorder = BucketRecorder(ddp)                 # becomes ddp's communication hook
    timer = BackwardTimer(layers)                  # {name: module} whose backward to time
    loss.backward()
    recorder.calls                                 # one BucketCall per bucket all-reduce
    timer.spans                                    # one LayerSpan per layer and backward
    reducer_buckets(ddp)                           # DDP's own logging data, parsed

and in notebooks and tests (pure functions)::

    predict_buckets(sizes_in_ready_order, cap_bytes=cap)  # DDP's rule for closing buckets
    trace_spans("trace.json")                          # backward ops and all-reduces of a profiler trace

Times are time.perf_counter() seconds of the rank that recorded them: compare them
within one rank only. On GPUs they are the moments the CPU reached each hook, which
runs ahead of the kernels; the profiler's trace shows the kernels themselves.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from labutils.errors import InputError

__all__ = [
    "BucketCall", "BucketRecorder", "record_hook", "LayerSpan", "BackwardTimer",
    "reducer_param_names", "reducer_buckets", "parse_index_lists", "parse_sizes",
    "predict_buckets", "busy_seconds", "overlap_seconds", "CollectiveCall",
    "CollectiveLog", "count_all_reduces", "trace_spans", "rank_output_dir",
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

    def __init__(self, layers: Mapping[str, object]) -> None:
        if not isinstance(layers, Mapping) or not layers:
            raise InputError("layers", expected="a dict {name: module} with at least one layer",
                             given=layers, fix="pass e.g. {'fc1': model.fc1, 'fc2': model.fc2}")
        self.spans: list[LayerSpan] = []
        self.iteration = 0
        self._open: dict[str, tuple[float, int]] = {}
        self._handles = []
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
    ignored = getattr(ddp, "parameters_to_ignore", set())
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
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(name, expected="a whole number of bytes >= 1", given=value,
                             fix="pass e.g. int(bucket_cap_mb * 2**20)")
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sizes):
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


# ----------------------------------------------------------------------- overlap

def _merged(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals, as sorted disjoint intervals."""
    out: list[list[float]] = []
    for start, end in sorted((float(a), float(b)) for a, b in spans):
        if end < start:
            raise InputError("spans", expected="intervals with end >= start", given=(start, end),
                             fix="pass (start_s, end_s) pairs")
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def busy_seconds(spans: Sequence[tuple[float, float]]) -> float:
    """Seconds covered by at least one interval (overlapping intervals count once)."""
    return sum(b - a for a, b in _merged(spans))


def overlap_seconds(first: Sequence[tuple[float, float]], second: Sequence[tuple[float, float]]) -> float:
    """Seconds during which both something in first and something in second ran:
    e.g. backward compute and all-reduce, the communication DDP hid behind compute."""
    a, b = _merged(first), _merged(second)
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


# ----------------------------------------------------------------------- collectives

@dataclass
class CollectiveCall:
    """One torch.distributed call seen by a CollectiveLog.

    nbytes is the whole array: the gathered output of an all-gather, the input of a
    reduce-scatter, the tensor of an all-reduce, broadcast, send or recv (as nccl-tests
    and lesson 02 count). peer is the source of a broadcast or recv, the destination
    of a send (None otherwise). phase is the log's label when the call was made; t is
    time.perf_counter() of the calling rank, thread the calling thread's name.
    """

    op: str
    numel: int
    nbytes: int
    dtype: str
    phase: str = ""
    peer: int | None = None
    thread: str = ""
    t: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


# Which positional argument holds "the whole array", and its keyword name where that
# is not "tensor"; which keyword names the peer.
_DATA_ARG = {
    "all_gather_single": 0, "all_gather_into_tensor": 0, "reduce_scatter_single": 1,
    "reduce_scatter_tensor": 1, "all_reduce": 0, "broadcast": 0,
    "send": 0, "recv": 0, "isend": 0, "irecv": 0, "all_to_all_single": 1,
}
_DATA_KW = {"reduce_scatter_single": "input", "reduce_scatter_tensor": "input",
            "all_gather_single": "output_tensor", "all_gather_into_tensor": "output_tensor",
            "all_to_all_single": "input"}
_PEER_KW = {"broadcast": "src", "recv": "src", "irecv": "src", "send": "dst", "isend": "dst"}


class CollectiveLog:
    """Records the torch.distributed calls named in `ops` made from Python in a block.

    It wraps the functions of the torch.distributed module, so it sees what
    communication hooks (fp16 compression, PowerSGD), FSDP2, ZeroRedundancyOptimizer
    and your own code call through it. DDP's built-in all-reduce (no hook) runs in C++
    and is not seen: count those with a BucketRecorder. Set .phase to label the calls
    that follow ("forward", "backward", "step")::

        with CollectiveLog(["all_gather_single", "reduce_scatter_single"]) as log:
            log.phase = "forward"; ...          # log.calls: one CollectiveCall per call

    Args:
        ops: names of torch.distributed functions, some of those in _DATA_ARG.
        on_call: called with each CollectiveCall just before the real call starts
            (e.g. print it, to see the order in which a rank issues them).
    """

    def __init__(self, ops: Sequence[str],
                 on_call: Callable[[CollectiveCall], object] | None = None) -> None:
        unknown = sorted(set(ops) - set(_DATA_ARG))
        if unknown:
            raise InputError("CollectiveLog ops", expected=f"names among {sorted(_DATA_ARG)}",
                             given=unknown, fix="spell them as torch.distributed names them")
        self.ops = list(ops)
        self.on_call = on_call
        self.calls: list[CollectiveCall] = []
        self.phase = ""
        self._real: dict[str, Callable] = {}

    def _wrap(self, op: str, real: Callable) -> Callable:
        def recorded(*args, **kwargs):
            data = kwargs.get(_DATA_KW.get(op, "tensor"))
            if data is None:
                index = _DATA_ARG[op]
                data = args[index] if len(args) > index else next(
                    v for v in kwargs.values() if hasattr(v, "element_size"))
            peer = kwargs.get(_PEER_KW[op]) if op in _PEER_KW else None
            if peer is None and op in _PEER_KW and len(args) > 1:
                peer = args[1]
            call = CollectiveCall(
                op=op, numel=data.numel(), nbytes=data.numel() * data.element_size(),
                dtype=str(data.dtype).replace("torch.", ""), phase=self.phase, peer=peer,
                thread=threading.current_thread().name, t=time.perf_counter())
            self.calls.append(call)
            if self.on_call is not None:
                self.on_call(call)
            return real(*args, **kwargs)

        return recorded

    def __enter__(self) -> "CollectiveLog":
        import torch.distributed as dist

        for op in self.ops:
            self._real[op] = getattr(dist, op)
            setattr(dist, op, self._wrap(op, self._real[op]))
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        for op, real in self._real.items():
            setattr(dist, op, real)
        self._real.clear()


@contextmanager
def count_all_reduces(on_call: Callable[[CollectiveCall], object] | None = None
                      ) -> Iterator[list[CollectiveCall]]:
    """Record every torch.distributed.all_reduce made from Python inside the block.

    A CollectiveLog of all_reduce alone; yields its list of calls.
    """
    with CollectiveLog(["all_reduce"], on_call) as log:
        yield log.calls


# ----------------------------------------------------------------------- profiler trace

def trace_spans(path: str | os.PathLike, *,
                compute_prefix: str = "autograd::engine::evaluate_function: ",
                comm_match: Sequence[str] = ("all_reduce", "allreduce", "AllReduce")) -> dict:
    """Backward ops and all-reduces from a torch.profiler Chrome trace.

    Args:
        path: the file written by prof.export_chrome_trace().
        compute_prefix: name prefix of the autograd engine's events (one per backward op).
        comm_match: substrings naming communication events (gloo:all_reduce on CPU).

    Returns:
        {"compute": [(op, start_s, end_s)], "comm": [(name, start_s, end_s, thread)]},
        times in seconds from the first event of the trace.
    """
    try:
        events = json.loads(Path(path).read_text())["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError("path", expected="a Chrome trace written by export_chrome_trace()",
                         given=str(path), fix=f"check the file ({exc.__class__.__name__})") from None
    spans = [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]
    if not spans:
        return {"compute": [], "comm": []}
    t0 = min(float(e["ts"]) for e in spans)
    compute, comm = [], []
    for e in spans:
        start = (float(e["ts"]) - t0) / 1e6
        end = start + float(e["dur"]) / 1e6
        name = str(e.get("name", ""))
        if name.startswith(compute_prefix):
            compute.append((name[len(compute_prefix):], start, end))
        elif any(m in name for m in comm_match) and not name.startswith("c10d::"):
            comm.append((name, start, end, str(e.get("tid", ""))))
    compute.sort(key=lambda s: s[1])
    comm.sort(key=lambda s: s[1])
    return {"compute": compute, "comm": comm}


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
