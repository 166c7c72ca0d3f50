"""torch.compile on a DDP model: DDPOptimizer cuts the graph where DDP's buckets end.

Run it on 2 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 2 10_current_stack/compile_ddp.py

or from the notebook: launch("10_current_stack/compile_ddp.py", nproc=2).

A compiled model runs its backward as one fused function: every gradient becomes ready
at its end, too late for DDP to overlap any all-reduce with the rest of the backward.
So when Dynamo compiles a DDP model, DDPOptimizer splits the graph into pieces of about
bucket_cap_mb of parameters each (counted from the output backwards, as gradients
become ready) and compiles each piece on its own: the gradients of a piece are ready
when its backward ends, and DDP can all-reduce them while the earlier pieces' backward runs.

Part 1 (graphs): for each bucket_cap_mb in CAPS, DDP's own buckets (eager, after the
rebuild at the second step) and the graphs DDPOptimizer hands to the backend. The
backend is "eager" wrapped in a counter: only the graph count matters here, and
"eager" runs the graphs as they are, without compiling anything.

Part 2 (inductor): the same model trained STEPS steps eagerly and compiled with the
default backend, inductor, from the same weights on the same data: losses and weights
compared, the time of each step. On CPU, inductor writes C++ and compiles it with the
machine's compiler (g++), which takes seconds per graph; on a GPU it writes Triton
kernels. Then the kernels it wrote are counted from its cache.

Part 3 (rank 0): a small function compiled for inputs of 8, 12 and 20 rows, the graphs
each call compiled and its time; then the same after torch._dynamo.reset(), which makes
Dynamo forget every compiled graph, as a new process would: inductor finds their code in
its FX graph cache.

    --inductor-only    part 2 alone (the lesson runs it on one GPU when there is one)
"""

import logging
import os
import re
import sys
import tempfile
import time
from pathlib import Path

# A fresh cache for this run, removed at the end: every run compiles from scratch, so the
# compile times below are what a first run costs.
cache = tempfile.TemporaryDirectory(prefix="inductor-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache.name

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch._inductor.config  # noqa: E402
from torch._dynamo.backends.registry import lookup_backend  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from labutils.course.ddp_probes import reducer_buckets  # noqa: E402
from labutils.dist import init, report  # noqa: E402
from models import MLP, mse, regression_batch  # noqa: E402

WIDTH, DEPTH = 512, 8   # 8 layers of 1,050,624 B each, and a head of 2,052 B
CAPS = [None, 25, 4, 2, 1, 0.5]  # None: bucket_cap_mb left unset
STEPS = 4

INDUCTOR_ONLY = "--inductor-only" in sys.argv[1:]

# DDP's forward wraps itself in a profiler record_function, which Dynamo leaves out of
# the graph with a warning on every rank; it says nothing about this script.
logging.getLogger("torch._dynamo.variables.ctx_manager").addFilter(
    lambda record: not record.getMessage().startswith("Profiler record function"))

rank, world_size, device = init()
if device.type == "cpu":
    torch.set_num_threads(1)  # the ranks share this machine's cores
    # One compile thread: on 2 cores a pool of compile workers only adds processes (on a
    # machine with many cores, drop this line: the default compiles graphs in parallel).
    torch._inductor.config.compile_threads = 1


def build(cap) -> DDP:
    torch.manual_seed(0)
    model = MLP(WIDTH, DEPTH).to(device)
    return DDP(model) if cap is None else DDP(model, bucket_cap_mb=cap)


def step(model, optimizer, i: int) -> float:
    x, y = (t.to(device) for t in regression_batch(rank, i, width=WIDTH))
    loss = mse(model(x), y)
    loss.backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.item()


class CountingBackend:
    """A torch.compile backend that notes each graph it is given (the parameters it
    uses), then hands it to the real backend."""

    def __init__(self, real: str) -> None:
        self.real = lookup_backend(real)
        self.graphs: list[list[str]] = []

    def __call__(self, gm, example_inputs):
        # Dynamo passes parameters as graph inputs named like
        # l_self_modules_layers_modules_3_parameters_weight_ (of the module layers.3)
        names = [n.target for n in gm.graph.nodes if n.op == "placeholder" and "_parameters_" in n.target]
        self.graphs.append([re.sub(r"^[lL]_self_modules_", "", n).split("_parameters_")[0].replace("_modules_", ".")
                            for n in names])
        return self.real(gm, example_inputs)


# Part 1: graphs against buckets.
for cap, optimize_ddp in [] if INDUCTOR_ONLY else [(cap, True) for cap in CAPS] + [(None, False)]:
    eager = build(cap)
    for i in range(3):  # buckets rebuilt in gradient-ready order at step 2, logged from step 3
        step(eager, None, i)
    buckets = [sorted({name.rsplit(".", 1)[0] for name in b}) for b in reducer_buckets(eager)["rebuilt_params"]]
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = optimize_ddp  # False: one graph, no splitting
    backend = CountingBackend("eager")
    error = None
    try:
        step(torch.compile(build(cap), backend=backend), None, 0)
    except Exception as e:  # DDPOptimizer refuses some settings: show what it says
        error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    if rank == 0:  # every rank has the same buckets and graphs: rank 0 speaks for all
        report(part="graphs", bucket_cap_mb=cap, optimize_ddp=optimize_ddp, ddp_buckets=buckets,
               graphs=[sorted(set(g)) for g in backend.graphs], error=error)
torch._dynamo.config.optimize_ddp = True

# Part 2: inductor against eager, step by step.
CAP = None  # bucket_cap_mb left unset, as most scripts do
runs = {}
for name in ["eager", "inductor"]:
    torch._dynamo.reset()
    ddp = build(CAP)
    backend = CountingBackend("inductor")
    model = ddp if name == "eager" else torch.compile(ddp, backend=backend)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    losses, seconds = [], []
    for i in range(STEPS):
        start = time.perf_counter()
        losses.append(step(model, optimizer, i))  # .item() waits for the GPU, if any
        seconds.append(time.perf_counter() - start)
    runs[name] = {"losses": losses, "weights": [p.detach().clone() for p in ddp.parameters()]}
    report(part="inductor", run=name, bucket_cap_mb=CAP, losses=losses, step_s=seconds,
           graphs=len(backend.graphs) if name == "inductor" else None)


def verdict(a, b) -> str:
    try:
        torch.testing.assert_close(a, b)
        return "equal (assert_close)"
    except AssertionError:
        return "DIFFERENT"


eager, compiled = runs["eager"], runs["inductor"]
report(part="equivalence",
       losses=verdict(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"])),
       weights=verdict(compiled["weights"], eager["weights"]),
       losses_bitwise=compiled["losses"] == eager["losses"],
       weights_bitwise=all(torch.equal(a, b) for a, b in zip(compiled["weights"], eager["weights"])),
       max_weight_diff=max((a - b).abs().max().item() for a, b in zip(compiled["weights"], eager["weights"])))


# What inductor wrote: each graph's wrapper (a .py file in the cache) defines its fused
# kernels as `name = async_compile.cpp_pybinding(...)` (C++, CPU) or
# `name = async_compile.triton(...)` (Triton, GPU), and calls matrix multiplications in a
# library (cuBLAS or the CPU's BLAS) through extern_kernels.
KERNEL = re.compile(r"^(\w+) = async_compile\.(cpp_pybinding|cpp|triton)\(", re.M)
kinds = {"C++": set(), "Triton": set()}
library_calls = 0
for wrapper in Path(cache.name).rglob("*.py"):
    text = wrapper.read_text(errors="replace")
    for name, how in KERNEL.findall(text):
        kinds["Triton" if how == "triton" else "C++"].add((wrapper.name, name))
    library_calls += len(re.findall(r"\bextern_kernels\.\w+\(", text))
# On CPU, the compiler inductor hands its C++ to (g++ unless CXX names another).
compiler = None
if device.type == "cpu":
    from torch._inductor.cpp_builder import get_cpp_compiler
    compiler = get_cpp_compiler()
report(part="kernels", device=device.type, cpp=len(kinds["C++"]), triton=len(kinds["Triton"]),
       library_calls=library_calls, compiler=compiler)


# Part 3 (rank 0, a function of one line): what a new input shape costs, and what is left
# of a compilation once Dynamo has forgotten it (torch._dynamo.reset(), as in a new
# process): inductor's FX graph cache on disk. Counted by Dynamo's and inductor's own
# counters.
def shift(x):
    return torch.relu(x) * 2 + 1


if rank == 0 and not INDUCTOR_ONLY:
    from torch._dynamo.utils import counters

    compiled_shift = torch.compile(shift)
    for when in ["first", "after reset"]:
        if when == "after reset":
            torch._dynamo.reset()
        for rows in (8, 12, 20):
            graphs, hits = counters["stats"]["unique_graphs"], counters["inductor"]["fxgraph_cache_hit"]
            start = time.perf_counter()
            compiled_shift(torch.randn(rows, 16, device=device))
            report(part="shapes", when=when, rows=rows, seconds=time.perf_counter() - start,
                   new_graphs=counters["stats"]["unique_graphs"] - graphs,
                   cache_hits=counters["inductor"]["fxgraph_cache_hit"] - hits)
torch.distributed.destroy_process_group()
cache.cleanup()
