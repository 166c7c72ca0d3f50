"""All-reduce written from scratch with point-to-point messages, three ways.

Every function sums ``tensor`` over the ranks of ``group`` in place, exactly like
``dist.all_reduce(tensor)``, and adds the bytes it sent and received to ``traffic``
so the cost of each algorithm can be measured rather than claimed.

- ring_all_reduce: the bandwidth-optimal ring. Split the data into n chunks.
  Reduce-scatter (n-1 steps): pass one chunk to the right neighbour, add the chunk
  arriving from the left; afterwards rank r holds the full sum of chunk r+1.
  All-gather (n-1 steps): pass the finished chunks around the ring.
  Each rank sends 2(n-1) chunks of size 1/n: 2(n-1)/n of the data.
- naive_ring_all_reduce: pass the whole tensor around the ring n-1 times; each
  rank sends (n-1) times the data.
- reduce_broadcast_all_reduce: every rank sends its tensor to the root, the root
  sums and sends the result back; the root sends and receives (n-1) times the
  data, the others only once, so the root is the bottleneck.
- blocking_ring_all_reduce: the ring with blocking send() then recv(). Every rank
  sends first and nobody receives, so it deadlocks (gloo's send waits for the
  matching recv), even for a tensor of a few bytes.

Each step posts the send and the receive together (isend + irecv, through
dist.batch_isend_irecv) and waits for both, so no rank blocks on a send its
neighbour cannot accept yet. (Ordering blocking sends and receives
by rank parity also works: an exercise in the notebook.)
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

__all__ = [
    "ALGORITHMS", "ring_all_reduce", "naive_ring_all_reduce",
    "reduce_broadcast_all_reduce", "blocking_ring_all_reduce", "ring_chunks",
]


def _ring_position(group) -> tuple[int, int, int, int]:
    """(my position, ring size, global rank of the right neighbour, of the left one)."""
    n = dist.get_world_size(group)
    me = dist.get_rank(group)

    def global_rank(pos: int) -> int:
        return pos if group is None else dist.get_global_rank(group, pos)

    return me, n, global_rank((me + 1) % n), global_rank((me - 1) % n)


def ring_chunks(flat: torch.Tensor, n: int) -> list[torch.Tensor]:
    """n views of ``flat`` whose sizes differ by at most one element (some may be empty)."""
    return list(torch.tensor_split(flat, n))


def _exchange(send_buf: torch.Tensor, recv_buf: torch.Tensor, right: int, left: int,
              group, traffic: Counter | None) -> None:
    """Send to the right neighbour and receive from the left one at the same time."""
    ops = []
    if send_buf.numel():  # both ends know the chunk sizes, so both skip empty chunks
        ops.append(dist.P2POp(dist.isend, send_buf, right, group))
    if recv_buf.numel():
        ops.append(dist.P2POp(dist.irecv, recv_buf, left, group))
    # Post both, then wait for both. batch_isend_irecv is isend + irecv on gloo; on NCCL it
    # also groups them, which a ring of 2 (left == right) needs to avoid a deadlock.
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    if traffic is not None:
        traffic["sent"] += send_buf.numel() * send_buf.element_size()
        traffic["received"] += recv_buf.numel() * recv_buf.element_size()


def ring_all_reduce(tensor: torch.Tensor, group=None, *, traffic: Counter | None = None) -> torch.Tensor:
    """Sum ``tensor`` over the group in place with reduce-scatter then all-gather.

    Args:
        tensor: a contiguous tensor, the same shape on every rank.
        group: the process group (None: every rank).
        traffic: a Counter that receives "sent" and "received" byte counts.
    """
    me, n, right, left = _ring_position(group)
    if n == 1:
        return tensor
    flat = tensor.view(-1)
    chunks = ring_chunks(flat, n)
    inbox = torch.empty_like(chunks[0])  # chunk 0 is the largest
    # Reduce-scatter: in step s, send chunk (me - s) and add the incoming chunk (me - s - 1).
    for step in range(n - 1):
        send_c, recv_c = chunks[(me - step) % n], chunks[(me - step - 1) % n]
        incoming = inbox[: recv_c.numel()]
        _exchange(send_c, incoming, right, left, group, traffic)
        recv_c += incoming
    # Now chunk (me + 1) holds the sum from every rank. All-gather: pass finished chunks on.
    for step in range(n - 1):
        send_c, recv_c = chunks[(me + 1 - step) % n], chunks[(me - step) % n]
        _exchange(send_c, recv_c, right, left, group, traffic)
    return tensor


def naive_ring_all_reduce(tensor: torch.Tensor, group=None, *,
                          traffic: Counter | None = None) -> torch.Tensor:
    """Sum ``tensor`` in place by passing whole tensors around the ring n-1 times.

    Args:
        tensor: a contiguous tensor, the same shape on every rank.
        group: the process group (None: every rank).
        traffic: a Counter that receives "sent" and "received" byte counts.
    """
    me, n, right, left = _ring_position(group)
    passing = tensor.clone()  # what this rank forwards next: first its own data
    inbox = torch.empty_like(tensor)
    for _ in range(n - 1):
        _exchange(passing, inbox, right, left, group, traffic)
        tensor += inbox
        passing, inbox = inbox, passing  # forward what just arrived
    return tensor


def reduce_broadcast_all_reduce(tensor: torch.Tensor, group=None, *, root: int = 0,
                                traffic: Counter | None = None) -> torch.Tensor:
    """Sum ``tensor`` in place: everyone sends to the root, the root sends the sum back.

    Args:
        tensor: a contiguous tensor, the same shape on every rank.
        group: the process group (None: every rank).
        root: the group position that collects and redistributes.
        traffic: a Counter that receives "sent" and "received" byte counts.
    """
    me, n, _, _ = _ring_position(group)

    def global_rank(pos: int) -> int:
        return pos if group is None else dist.get_global_rank(group, pos)

    nbytes = tensor.numel() * tensor.element_size()
    if me == root:
        inboxes = [torch.empty_like(tensor) for _ in range(n - 1)]
        others = [p for p in range(n) if p != root]
        for req in [dist.irecv(buf, src=global_rank(p), group=group) for buf, p in zip(inboxes, others)]:
            req.wait()
        for buf in inboxes:
            tensor += buf
        for req in [dist.isend(tensor, dst=global_rank(p), group=group) for p in others]:
            req.wait()
        sent = received = (n - 1) * nbytes
    else:
        dist.send(tensor, dst=global_rank(root), group=group)
        dist.recv(tensor, src=global_rank(root), group=group)
        sent = received = nbytes
    if traffic is not None:
        traffic["sent"] += sent
        traffic["received"] += received
    return tensor


def blocking_ring_all_reduce(tensor: torch.Tensor, group=None, *,
                             traffic: Counter | None = None) -> torch.Tensor:
    """The ring with blocking send() then recv(): every rank waits in send(). Deadlocks.

    Args:
        tensor: a contiguous tensor, the same shape on every rank.
        group: the process group (None: every rank).
        traffic: a Counter that receives "sent" and "received" byte counts.
    """
    me, n, right, left = _ring_position(group)
    chunks = ring_chunks(tensor.view(-1), n)
    inbox = torch.empty_like(chunks[0])
    for step in range(n - 1):
        send_c, recv_c = chunks[(me - step) % n], chunks[(me - step - 1) % n]
        dist.send(send_c, dst=right, group=group)   # every rank is here, nobody receives
        dist.recv(inbox[: recv_c.numel()], src=left, group=group)
        recv_c += inbox[: recv_c.numel()]
    for step in range(n - 1):
        send_c, recv_c = chunks[(me + 1 - step) % n], chunks[(me - step) % n]
        dist.send(send_c, dst=right, group=group)
        dist.recv(recv_c, src=left, group=group)
    return tensor


ALGORITHMS = {
    "ring": ring_all_reduce,
    "naive ring": naive_ring_all_reduce,
    "reduce+broadcast": reduce_broadcast_all_reduce,
}
