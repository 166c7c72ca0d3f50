"""nn.DataParallel's algorithm, made visible, and a way to time it.

On a machine with GPUs, nn.DataParallel runs one training step like this, all in
one process:

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
on any machine. time_data_parallel() picks the real nn.DataParallel when there are
at least two GPUs, and the re-creation otherwise.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn

from model import TIMING, make_batch, make_model, make_optimizer

STAGES = ("scatter", "replicate", "forward", "gather + loss", "backward", "reduce grads", "optimizer step")


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
        # One module object per device, so threads never share one. Device 0 runs the
        # original; the others get their parameter values copied in at every step.
        # (nn.DataParallel rebuilds these shells every step too; that part is cheap.)
        self.replicas = [module, *(copy.deepcopy(module) for _ in range(n_devices - 1))]
        self.seconds: dict[tuple[int, str], float] = defaultdict(float)  # (device, stage) -> total
        self.steps = 0

    def _timed(self, device: int, stage: str, fn: Callable):
        t0 = time.perf_counter()
        out = fn()
        self.seconds[device, stage] += time.perf_counter() - t0
        return out

    def _on_threads(self, work: Callable[[int], None]) -> None:
        """Run work(d) for every device d on its own thread, as parallel_apply does."""
        errors = []

        def run(d: int) -> None:
            try:
                work(d)
            except BaseException as exc:  # re-raised on the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(d,)) for d in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                   optimizer: torch.optim.Optimizer) -> float:
        """One step on the global batch (x, y); returns the loss."""
        n, dev0 = self.n, 0
        xs, ys = self._timed(dev0, "scatter", lambda: (x.chunk(n), y.chunk(n)))
        originals = list(self.module.parameters())

        def replicate():  # copy every parameter from device 0 to every other device
            with torch.no_grad():
                for replica in self.replicas[1:]:
                    for mine, original in zip(replica.parameters(), originals):
                        mine.copy_(original)
                        mine.grad = None

        self._timed(dev0, "replicate", replicate)
        outputs: list[torch.Tensor | None] = [None] * n

        def forward(d: int) -> None:
            outputs[d] = self._timed(d, "forward", lambda: self.replicas[d](xs[d]))

        self._on_threads(forward)

        def gather_and_loss():
            loss = loss_fn(torch.cat(outputs), y)  # every output travels to device 0
            return loss, torch.autograd.grad(loss, outputs)  # d loss / d output, one chunk per device

        loss, output_grads = self._timed(dev0, "gather + loss", gather_and_loss)

        def backward(d: int) -> None:
            self._timed(d, "backward", lambda: torch.autograd.backward(outputs[d], output_grads[d]))

        self._on_threads(backward)

        def reduce_grads():  # what the backward of "replicate" does: sum onto device 0
            for replica in self.replicas[1:]:
                for original, mine in zip(originals, replica.parameters()):
                    original.grad += mine.grad

        self._timed(dev0, "reduce grads", reduce_grads)
        self._timed(dev0, "optimizer step", optimizer.step)
        optimizer.zero_grad(set_to_none=False)
        self.steps += 1
        return loss.item()

    def work_table(self) -> list[dict]:
        """Seconds per step spent in each stage, per device (what each "GPU" did)."""
        rows = []
        for d in range(self.n):
            row = {"device": d}
            for stage in STAGES:
                row[stage] = self.seconds.get((d, stage), 0.0) / max(self.steps, 1)
            row["busy"] = sum(row[s] for s in STAGES)
            rows.append(row)
        return rows


def memory_table(module: nn.Module, *, n_devices: int, global_batch: int, inputs: int,
                 classes: int, optimizer_states: int = 1) -> list[dict]:
    """Bytes each device holds during a DataParallel step (activations left out).

    Device 0 holds the model, its gradients and the optimizer state for good, the
    whole input batch before the scatter and every replica's outputs after the
    gather. The other devices hold a parameter copy, its gradients and their chunk.
    """
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    chunk = global_batch // n_devices
    rows = []
    for d in range(n_devices):
        batch_rows = global_batch if d == 0 else chunk
        out_rows = global_batch if d == 0 else chunk
        row = {
            "device": d,
            "parameters": param_bytes,
            "gradients": param_bytes,
            "optimizer state": param_bytes * optimizer_states if d == 0 else 0,
            "input batch": batch_rows * inputs * 4,
            "outputs": out_rows * classes * 4,
        }
        row["total"] = sum(v for k, v in row.items() if k != "device")
        rows.append(row)
    return rows


def time_data_parallel(*, n_devices: int, per_device_batch: int, steps: int, warmup: int = 2) -> dict:
    """Train the TIMING model with DataParallel and measure samples per second.

    Real nn.DataParallel on GPUs 0..n_devices-1 when there are enough GPUs; the
    thread re-creation on CPU otherwise, with one intra-op thread per replica so
    that each thread uses one core, like a DDP rank with OMP_NUM_THREADS=1.

    Returns:
        {"kind", "samples_per_s", "step_s", "work" (per-device stage seconds, CPU
        only), "memory" (bytes per device: peak on GPUs, accounting on CPU)}.
    """
    global_batch = n_devices * per_device_batch
    model = make_model(**TIMING)
    loss_fn = nn.functional.cross_entropy
    batches = [make_batch(s, global_batch, **TIMING) for s in range(warmup + steps)]
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

        for x, y in batches[:warmup]:
            step(x, y)
        t0 = time.perf_counter()
        for x, y in batches[warmup:]:
            step(x, y)
        elapsed = time.perf_counter() - t0
        memory = [{"device": d, "peak allocated": torch.cuda.max_memory_allocated(d)} for d in range(n_devices)]
        return {"kind": f"nn.DataParallel on {n_devices} GPUs", "step_s": elapsed / steps,
                "samples_per_s": global_batch * steps / elapsed, "work": None, "memory": memory}
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)  # one core per "device"
    try:
        dp = ThreadDataParallel(model, n_devices)
        optimizer = make_optimizer(model)
        for x, y in batches[:warmup]:
            dp.train_step(x, y, loss_fn, optimizer)
        dp.seconds.clear()
        dp.steps = 0
        t0 = time.perf_counter()
        for x, y in batches[warmup:]:
            dp.train_step(x, y, loss_fn, optimizer)
        elapsed = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads_before)
    return {"kind": f"ThreadDataParallel, {n_devices} CPU threads", "step_s": elapsed / steps,
            "samples_per_s": global_batch * steps / elapsed, "work": dp.work_table(),
            "memory": memory_table(model, n_devices=n_devices, global_batch=global_batch, **{
                k: TIMING[k] for k in ("inputs", "classes")})}


def time_single_process(*, global_batch: int, steps: int, warmup: int = 2, threads: int = 1) -> dict:
    """The baseline: one process, one device, the whole batch, ``threads`` intra-op threads."""
    model = make_model(**TIMING)
    optimizer = make_optimizer(model)
    batches = [make_batch(s, global_batch, **TIMING) for s in range(warmup + steps)]
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        def step(x, y):
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        for x, y in batches[:warmup]:
            step(x, y)
        t0 = time.perf_counter()
        for x, y in batches[warmup:]:
            step(x, y)
        elapsed = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads_before)
    return {"kind": f"one process, {threads} thread(s)", "step_s": elapsed / steps,
            "samples_per_s": global_batch * steps / elapsed}
