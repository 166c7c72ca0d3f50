"""A parameter server on point-to-point send/recv (lesson 02's primitives), for gloo.

One rank (the server) owns the parameters; every other rank is a worker that, at its
own pace, repeats: receive the current parameters, compute a gradient on its own
batch, push it. The server applies each gradient the moment it arrives, so a gradient
may have been computed on parameters that other workers' updates have since changed:
its staleness is (server version when applied) - (version it was computed on).

The protocol, with a message tag per kind so a mix-up fails loudly instead of
silently pairing the wrong tensors:

    worker -> server  HEADER  [kind, seq, version computed on]   (kind PULL or PUSH)
    worker -> server  GRAD    the flat gradient                  (PUSH only)
    server -> worker  REPLY   [server version, go]
    server -> worker  PARAMS  the flat parameters                (go = 1 only)

The server receives HEADERs from any source (dist.recv without src), so whichever
worker is ready first is served first: nobody waits for the slowest. It hands out
exactly `total_updates` "go" replies; each go is followed by exactly one PUSH, so it
applies exactly `total_updates` gradients, then answers every worker's next message
with go = 0 (stop). One thread, one message at a time: no locks are needed.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

PULL, PUSH = 0, 1
HEADER, GRAD, REPLY, PARAMS = 1, 2, 3, 4  # message tags


def serve(params: torch.Tensor, *, lr: float, total_updates: int, n_workers: int,
          staleness_aware: bool = False, snapshot_every: int = 1) -> dict:
    """Run the server until `total_updates` gradients are applied and every worker stopped.

    Args:
        params: the flat parameter vector, updated in place (plain SGD).
        lr: learning rate.
        total_updates: how many gradients to apply in all.
        n_workers: how many workers will connect (every other rank).
        staleness_aware: scale each step by 1 / (1 + staleness).
        snapshot_every: keep a copy of the parameters every this many versions.

    Returns:
        A log: per applied update (in order) the worker's rank, its push number, the
        staleness and the time since the start; snapshots [(version, time, params)];
        and message counts.
    """
    header = torch.zeros(3, dtype=torch.float64)
    grad = torch.empty_like(params)
    version = issued = stopped = 0
    log = {"worker": [], "seq": [], "staleness": [], "t": [], "snapshots": [(0, 0.0, params.clone())],
           "headers": 0, "grads": 0, "params_sent": 0, "stops_sent": 0}
    start = time.perf_counter()
    while stopped < n_workers:
        src = dist.recv(header, tag=HEADER)  # from whichever worker is ready first
        log["headers"] += 1
        if int(header[0]) == PUSH:
            dist.recv(grad, src=src, tag=GRAD)
            log["grads"] += 1
            staleness = version - int(header[2])
            step = lr / (1 + staleness) if staleness_aware else lr
            params.sub_(grad, alpha=step)
            version += 1
            now = time.perf_counter() - start
            for key, value in (("worker", src), ("seq", int(header[1])),
                               ("staleness", staleness), ("t", now)):
                log[key].append(value)
            if version % snapshot_every == 0:
                log["snapshots"].append((version, now, params.clone()))
        go = issued < total_updates
        dist.send(torch.tensor([version, float(go)], dtype=torch.float64), dst=src, tag=REPLY)
        if go:
            issued += 1
            dist.send(params, dst=src, tag=PARAMS)
            log["params_sent"] += 1
        else:
            stopped += 1
            log["stops_sent"] += 1
    log["version"] = version
    return log


def work(params: torch.Tensor, gradient_at: Callable[[torch.Tensor, int], torch.Tensor], *,
         server: int = 0) -> int:
    """Run a worker: pull parameters, compute a gradient, push it, until told to stop.

    Args:
        params: a flat buffer the size of the parameters (overwritten by each pull).
        gradient_at: gradient_at(params, k) returns the flat gradient of this worker's
            k-th batch at `params`; it takes as long as the worker's computation does.
        server: the server's rank.

    Returns:
        How many gradients this worker pushed.
    """
    reply = torch.zeros(2, dtype=torch.float64)
    dist.send(torch.tensor([PULL, -1, -1], dtype=torch.float64), dst=server, tag=HEADER)
    pushed = 0
    while True:
        dist.recv(reply, src=server, tag=REPLY)
        if reply[1] == 0:
            return pushed
        dist.recv(params, src=server, tag=PARAMS)
        grad = gradient_at(params, pushed)
        dist.send(torch.tensor([PUSH, pushed, reply[0]], dtype=torch.float64), dst=server, tag=HEADER)
        dist.send(grad, dst=server, tag=GRAD)
        pushed += 1
