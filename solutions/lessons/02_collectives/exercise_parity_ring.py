"""Solution: a ring all-reduce with blocking send() and recv() that does not deadlock.

ring_deadlock.py hangs because every rank calls send() first. Order the calls by
rank parity instead: even ranks send then receive, odd ranks receive then send.
Then at least one rank of every waiting chain is receiving, and the chain unwinds
(also for an odd number of ranks: work out why on paper for 3).

Write parity_ring_all_reduce below (start from ring.py's ring_all_reduce, replace
_exchange with your own parity-ordered dist.send / dist.recv), then check it from
the notebook (check_parity_ring()) or with

    torchrun --standalone --nproc-per-node 3 02_collectives/exercise_parity_ring.py
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "lessons" / "02_collectives"))
from ring import ring_chunks  # noqa: E402


def _blocking_exchange(send_buf, recv_buf, me, right, left, group):
    """Even positions send first, odd ones receive first: no cycle of waiting senders."""
    def send():
        if send_buf.numel():
            dist.send(send_buf, dst=right, group=group)

    def recv():
        if recv_buf.numel():
            dist.recv(recv_buf, src=left, group=group)

    if me % 2 == 0:
        send()
        recv()
    else:
        recv()
        send()


def parity_ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum tensor over all ranks in place: reduce-scatter then all-gather, blocking calls."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return tensor
    rank_of = (lambda pos: pos) if group is None else (lambda pos: dist.get_global_rank(group, pos))
    right, left = rank_of((me + 1) % n), rank_of((me - 1) % n)
    chunks = ring_chunks(tensor.view(-1), n)
    inbox = torch.empty_like(chunks[0])
    for step in range(n - 1):
        send_c, recv_c = chunks[(me - step) % n], chunks[(me - step - 1) % n]
        _blocking_exchange(send_c, inbox[: recv_c.numel()], me, right, left, group)
        recv_c += inbox[: recv_c.numel()]
    for step in range(n - 1):
        send_c, recv_c = chunks[(me + 1 - step) % n], chunks[(me - step) % n]
        _blocking_exchange(send_c, recv_c, me, right, left, group)
    return tensor


if __name__ == "__main__":
    from labutils.dist import init, report

    rank, world_size, device = init()
    sizes = (1, 2, 3, 5, 7, 10, 1001)
    for numel in sizes:
        data = torch.randn(numel, generator=torch.Generator().manual_seed(rank * 7 + numel),
                           dtype=torch.float64).to(device)
        expected = data.clone()
        dist.all_reduce(expected)
        torch.testing.assert_close(parity_ring_all_reduce(data.clone()), expected)
    report(sizes_checked=len(sizes))
    dist.destroy_process_group()
