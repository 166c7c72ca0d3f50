"""nn.DataParallel's algorithm, made visible, and ways to time it.

On a machine with GPUs, nn.DataParallel runs one training step like this, all in
one process (torch/nn/parallel/data_parallel.py, forward()):

1. scatter:        split the batch along dim 0, one chunk per GPU;
2. replicate:      copy the module's parameters from GPU 0 to every other GPU
                   (again at every step: the copies are thrown away afterwards);
3. parallel_apply: one Python thread per GPU runs that replica's forward pass;
4. gather:         concatenate the outputs on GPU 0, where the loss is computed;
5. backward:       autograd runs each replica's backward on its own GPU and sums
                   the replicas' gradients back onto GPU 0's parameters;
6. step:           the optimizer updates the parameters on GPU 0 only.

On a CPU, nn.DataParallel does none of this: with no GPUs it simply calls the
module (it only adds the ``module.`` prefix to the state_dict keys).
ThreadDataParallel below re-creates the six steps with CPU threads standing in for
GPUs (one intra-op thread each), so the mechanism and its costs can be measured
on any machine: the time of every stage on every "device", and the bytes that
would cross between device 0 and the others, counted from the real tensors.
data_parallel() picks the real nn.DataParallel when there are at least two GPUs,
and the re-creation otherwise; time_in_turn() times it against one process.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn

from labutils.course.timing import sleeps_so_far
from model import FEW_BIG_OPS, make_batch, make_model, make_optimizer, param_bytes

STAGES = ("scatter", "replicate", "forward", "gather + loss", "backward", "reduce grads", "optimizer step")
# What crosses between device 0 and device d in one step, in the order it happens.
TRAFFIC = ("inputs (scatter)", "parameters (replicate)", "outputs (gather)",
           "output gradients (gather's backward)", "parameter gradients (reduce onto device 0)")


class ThreadDataParallel:
    """DataParallel on CPU threads: thread ``d`` plays GPU ``d``; "device 0" owns the model.

    Args:
        module: the model; its parameters are "on device 0".
        n_devices: how many devices (threads) share each batch.
    """

    def __init__(self, module: nn.Module, n_devices: int) -> None:
        if n_devices < 1:
            raise ValueError(f"n_devices: expected >= 1, got {n_devices}")
        self.module = module
        self.n = n_devices
        self.copies: list[list[torch.Tensor]] = []  # per device, this step's parameter copies
        self.seconds: dict[tuple[int, str], float] = defaultdict(float)  # (device, stage) -> total
        self.moved: dict[tuple[str, str], int] = defaultdict(int)  # (what, "to d" / "to 0") -> bytes
        self.steps = 0

    # ------------------------------------------------ the four parts of nn.DataParallel
    def scatter(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Device 0 -> device d: chunk d of the batch."""
        chunks = list(x.chunk(self.n))
        self._count("inputs (scatter)", "to d", chunks[1:])
        return chunks

    def replicate(self) -> list[nn.Module]:
        """Device 0 -> device d: a copy of every parameter, in a fresh shell of every
        module, at every step, as torch.nn.parallel.replicate builds them (device 0
        runs the original module here; torch builds a shell for it too)."""
        modules = list(self.module.modules())
        originals = list(self.module.parameters())
        index = {p: i for i, p in enumerate(originals)}
        position = {m: i for i, m in enumerate(modules)}
        replicas, self.copies = [self.module], [originals]
        for _ in range(1, self.n):
            copies = [p.detach().clone().requires_grad_() for p in originals]
            self._count("parameters (replicate)", "to d", copies)
            shells = [m._replicate_for_data_parallel() for m in modules]  # torch's own, per module
            for module, shell in zip(modules, shells):
                for key, child in module._modules.items():
                    shell._modules[key] = shells[position[child]]
                for key, param in module._parameters.items():
                    setattr(shell, key, copies[index[param]])  # a plain tensor, as in torch
            replicas.append(shells[0])
            self.copies.append(copies)
        return replicas

    def parallel_apply(self, stage: str, work: Callable[[int], object]) -> list:
        """work(d) for every device d, each on its own thread, all at once; the results."""
        results, errors = [None] * self.n, []

        def run(d: int) -> None:
            try:
                t0 = time.perf_counter()
                results[d] = work(d)
                self.seconds[d, stage] += time.perf_counter() - t0
            except BaseException as exc:  # re-raised on the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(d,)) for d in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

    def gather(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """Device d -> device 0: every replica's outputs, concatenated on device 0."""
        self._count("outputs (gather)", "to 0", outputs[1:])
        return torch.cat(outputs)

    def reduce_add(self) -> None:
        """Device d -> device 0: every replica's gradients, summed onto the original's
        (what the backward of replicate does)."""
        originals = self.copies[0]
        for copies in self.copies[1:]:
            for original, mine in zip(originals, copies):
                original.grad += mine.grad
            self._count("parameter gradients (reduce onto device 0)", "to 0", (c.grad for c in copies))

    # ------------------------------------------------------------------ one step
    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                   optimizer: torch.optim.Optimizer) -> float:
        """One step on the global batch (x, y); returns the loss. Device 0 keeps y."""
        chunks = self._timed("scatter", self.scatter, x)
        replicas = self._timed("replicate", self.replicate)
        outputs = self.parallel_apply("forward", lambda d: replicas[d](chunks[d]))

        def gather_and_loss():
            loss = loss_fn(self.gather(outputs), y)
            output_grads = torch.autograd.grad(loss, outputs)  # d loss / d output, per device
            self._count("output gradients (gather's backward)", "to d", output_grads[1:])
            return loss, output_grads

        loss, output_grads = self._timed("gather + loss", gather_and_loss)
        self.parallel_apply("backward", lambda d: outputs[d].backward(output_grads[d]))
        self._timed("reduce grads", self.reduce_add)
        self._timed("optimizer step", optimizer.step)
        optimizer.zero_grad(set_to_none=False)
        self.steps += 1
        return loss.item()

    # ------------------------------------------------------------------ bookkeeping
    def _timed(self, stage: str, fn: Callable, *args):
        """Run a stage on device 0 (the calling thread) and add up its time."""
        t0 = time.perf_counter()
        out = fn(*args)
        self.seconds[0, stage] += time.perf_counter() - t0
        return out

    def _count(self, what: str, direction: str, tensors) -> None:
        self.moved[what, direction] += sum(t.numel() * t.element_size() for t in tensors)

    def work_table(self, seconds: dict[tuple[int, str], float] | None = None,
                   steps: int | None = None) -> list[dict]:
        """Seconds per step spent in each stage, per device (what each "GPU" did): over
        every step so far, or over ``steps`` steps that took ``seconds`` (one step's)."""
        seconds = self.seconds if seconds is None else seconds
        steps = self.steps if steps is None else steps
        rows = []
        for d in range(self.n):
            row = {"device": d}
            for stage in STAGES:
                row[stage] = seconds.get((d, stage), 0.0) / max(steps, 1)
            row["busy"] = sum(row[s] for s in STAGES)
            rows.append(row)
        return rows

    def traffic(self) -> dict[str, dict[str, float]]:
        """Bytes per step between device 0 and the others, per kind of tensor:
        {what: {"device 0 sends", "device 0 receives"}}; each other device
        receives and sends 1/(N-1) of that."""
        steps = max(self.steps, 1)
        return {what: {"device 0 sends": self.moved.get((what, "to d"), 0) / steps,
                       "device 0 receives": self.moved.get((what, "to 0"), 0) / steps}
                for what in TRAFFIC}


def steps_on_core(step: Callable, batches: list) -> tuple[list[float], list[dict[str, float]]]:
    """step(x, y) for every batch: each step's seconds, and how the calling thread spent
    the step: "on_core", the share of its wall time on a core (the thread's CPU time),
    and "sleeps", how many times it gave up its core by itself to sleep (sleeps_so_far).
    A thread waiting for the GIL sleeps until the holder lets go; other work on the
    machine takes cores away (less time on a core) but puts no thread to sleep. Where
    the kernel does not count sleeps, "sleeps" is 0."""
    seconds, shares = [], []
    for x, y in batches:
        wall, cpu, slept = time.perf_counter(), time.thread_time(), sleeps_so_far()
        step(x, y)
        slept_after = sleeps_so_far()  # both read inside the wall-clock interval
        cpu = time.thread_time() - cpu
        seconds.append(time.perf_counter() - wall)
        sleeps = slept_after - slept if slept is not None and slept_after is not None else 0
        shares.append({"on_core": cpu / seconds[-1], "sleeps": float(sleeps)})
    return seconds, shares


def pass_totals(steps: list[float], shares: list[dict[str, float]]) -> dict[str, float]:
    """Many steps together: the share of their whole time on a core (each step weighed
    by its seconds), and the sleeps per step."""
    return {"on_core": sum(s * share["on_core"] for s, share in zip(steps, shares)) / sum(steps),
            "sleeps_per_pass": sum(share["sleeps"] for share in shares) / len(shares)}


# Passes per round, for thread_slowdown and for ddp_train.py's part 4a, in multiples of
# the lesson's STEPS: a pass of MANY_SMALL_OPS takes about a quarter of one of FEW_BIG_OPS,
# and 4x the passes make its rounds as long (about 150 ms on a quiet core): a busy moment
# of the machine is then a smaller part of a round.
ROUND_PASSES = {"MANY_SMALL_OPS": 4, "FEW_BIG_OPS": 1}


def replicas_at_once(models: list[nn.Module], x: torch.Tensor, y: torch.Tensor,
                     steps: int) -> tuple[float, list[float], list[dict[str, float]]]:
    """Each model on its own thread, all at once, ``steps`` forward passes (with the
    loss): the median seconds of one pass on the slowest thread, and every thread's
    passes: their seconds and how each was spent (steps_on_core). The backward is left
    out: autograd's engine runs it in C++ without the GIL, so it would only dilute the
    GIL's share by a machine-dependent amount."""
    medians = [0.0] * len(models)
    seconds: list[list[float]] = [[] for _ in models]
    shares: list[list[dict[str, float]]] = [[] for _ in models]

    def work(i: int) -> None:
        seconds[i], shares[i] = steps_on_core(
            lambda x, y: nn.functional.cross_entropy(models[i](x), y), [(x, y)] * steps)
        medians[i] = statistics.median(seconds[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(medians), [s for each in seconds for s in each], [s for each in shares for s in each]


def thread_slowdown(config: dict, *, n: int, batch: int, steps: int, rounds: int = 3) -> dict:
    """One replica alone on one thread, then n replicas on n threads at once (one core
    each): seconds per forward pass, how much slower running together is, and how the
    threads running together spent their passes: their share on a core, and how often
    they went to sleep.

    ``rounds`` rounds of (alone, together), ``steps`` passes each. The times are each
    one's fastest round, the one least disturbed by anything else the machine was doing;
    the share on a core and the sleeps per pass are those of every pass of every round
    together (pass_totals): other work on the machine takes time on a core away, the GIL
    puts threads to sleep."""
    models = [make_model(**config) for _ in range(n)]
    x, y = make_batch(0, batch, **config)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    alone, together, passes, shares = [], [], [], []
    try:
        replicas_at_once(models, x, y, 2)  # warm-up
        for _ in range(rounds):
            alone.append(replicas_at_once(models[:1], x, y, steps)[0])
            median, seconds, how = replicas_at_once(models, x, y, steps)
            together.append(median)
            passes += seconds
            shares += how
    finally:
        torch.set_num_threads(threads_before)
    return {"alone_s": min(alone), "together_s": min(together), "slowdown": min(together) / min(alone),
            **pass_totals(passes, shares)}


def memory_table(module: nn.Module, *, n_devices: int, global_batch: int, inputs: int,
                 classes: int, optimizer_states: int = 1, **_) -> list[dict]:
    """Bytes each device holds during a DataParallel step (activations left out),
    counted from the tensors' sizes.

    Device 0 holds the model, its gradients and the optimizer state for good, the
    whole input batch before the scatter and every replica's outputs after the
    gather. The other devices hold a parameter copy, its gradients and their chunk.
    """
    params = param_bytes(module)
    chunk = global_batch // n_devices
    rows = []
    for d in range(n_devices):
        rows_here = global_batch if d == 0 else chunk
        row = {
            "device": d,
            "parameters": params,
            "gradients": params,
            "optimizer state": params * optimizer_states if d == 0 else 0,
            "input batch": rows_here * inputs * 4,
            "outputs": rows_here * classes * 4,
        }
        row["total"] = sum(v for k, v in row.items() if k != "device")
        rows.append(row)
    return rows


class Way:
    """One way of training a step, ready to time: ``step(x, y)`` on a global batch;
    ``result(step_s, fastest)``, what the way reports once timed: ``step_s``, the
    seconds of its fastest step, the ``fastest``-th after the warm-up; ``reset()``,
    called after the warm-up steps (for what the way counts per step)."""

    def __init__(self, step: Callable, result: Callable[[float, int], dict],
                 reset: Callable[[], None] = lambda: None) -> None:
        self.step, self.result, self.reset = step, result, reset


def one_process(*, global_batch: int, config: dict) -> Way:
    """The baseline: one process, one device, the whole batch."""
    model = make_model(**config)
    optimizer = make_optimizer(model)

    def step(x, y):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return Way(step, lambda step_s, _: {"kind": "one process, 1 thread", "step_s": step_s,
                                        "samples_per_s": global_batch / step_s})


def data_parallel(*, n_devices: int, per_device_batch: int, config: dict) -> Way:
    """DataParallel on ``n_devices``: the real nn.DataParallel on GPUs 0..n_devices-1
    when there are enough GPUs, the thread re-creation on CPU otherwise.

    Its result: {"kind", "samples_per_s", "step_s", "work" (per-device stage seconds,
    CPU only), "traffic" (bytes per step to and from device 0, CPU only), "memory"
    (bytes per device: peak on GPUs, counted from tensor sizes on CPU)}.
    """
    global_batch = n_devices * per_device_batch
    model = make_model(**config)
    loss_fn = nn.functional.cross_entropy
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= n_devices:
        model = model.to("cuda:0")  # DataParallel needs the module on device_ids[0]
        dp = nn.DataParallel(model, device_ids=list(range(n_devices)))
        optimizer = make_optimizer(model)
        for d in range(n_devices):
            torch.cuda.reset_peak_memory_stats(d)

        def step(x, y):
            loss = loss_fn(dp(x.to("cuda:0")), y.to("cuda:0"))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            torch.cuda.synchronize()

        def result(step_s: float, _: int) -> dict:
            memory = [{"device": d, "peak allocated": torch.cuda.max_memory_allocated(d)}
                      for d in range(n_devices)]
            return {"kind": f"nn.DataParallel on {n_devices} GPUs", "step_s": step_s,
                    "samples_per_s": global_batch / step_s, "work": None, "traffic": None, "memory": memory}
        return Way(step, result)

    threads = ThreadDataParallel(model, n_devices)
    optimizer = make_optimizer(model)
    stages: list[dict] = []  # per step since the warm-up: seconds per (device, stage)

    def step(x, y):
        before = dict(threads.seconds)
        threads.train_step(x, y, loss_fn, optimizer)
        stages.append({key: took - before.get(key, 0.0) for key, took in threads.seconds.items()})

    def result(step_s: float, fastest: int) -> dict:
        return {"kind": f"DataParallel, {n_devices} threads", "step_s": step_s,
                "samples_per_s": global_batch / step_s, "work": threads.work_table(stages[fastest], 1),
                "traffic": threads.traffic(),
                "memory": memory_table(model, n_devices=n_devices, global_batch=global_batch, **config)}

    def reset() -> None:
        stages.clear()
        threads.moved.clear()
        threads.steps = 0
    return Way(step, result, reset)


def time_in_turn(ways: list[Way], batches: list, *, warmup: int = 2) -> list[dict]:
    """Train each way on the same batches, one step of each in turn, with one intra-op
    thread (one core per device, like a DDP rank with OMP_NUM_THREADS=1); each way's
    result with its fastest step.

    On a shared host the machine's speed changes from one fraction of a second to the
    next (a 2-core virtual machine measured twice as slow, then not, within a second).
    Steps taken in turn see the same machine, and the fastest step of each way is the
    one least disturbed by the rest of the host; timing one way after the other would
    compare two different machines. DataParallel's stage times are those of its
    fastest step."""
    times: list[list[float]] = [[] for _ in ways]
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i, (x, y) in enumerate(batches):
            for way, took in zip(ways, times):
                if i == warmup:
                    way.reset()
                t0 = time.perf_counter()
                way.step(x, y)
                if i >= warmup:
                    took.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads_before)
    return [way.result(min(took), took.index(min(took))) for way, took in zip(ways, times)]


def global_batches(config: dict, global_batch: int, steps: int, *, warmup: int = 2) -> list:
    """The (x, y) of ``warmup + steps`` global batches of ``config``'s model."""
    return [make_batch(s, global_batch, **config) for s in range(warmup + steps)]
